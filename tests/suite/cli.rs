//! `forkfleet run` end to end: the quickstart fork with `--json`, and bad input.

use super::harness::{branch, forkfleet, json, path_str, stderr, Example};
use serde_json::Value;

fn path<'a>(doc: &'a Value, p: &str) -> &'a Value {
    doc["diff"]["paths"]
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["path"] == p)
        .unwrap_or_else(|| panic!("no path {p} in {}", doc["diff"]))
}

#[test]
fn quickstart_runs_diffs_and_merges_the_pick() {
    let ex = Example::quickstart();
    let out = forkfleet(&[
        "run",
        path_str(&ex.spec()),
        "--pick",
        "concise",
        "--json",
        "--timeout-s",
        "120",
    ]);
    let doc = json(&out);

    // Every branch ran to the end of its script.
    for label in ["concise", "thorough", "tidy"] {
        let b = branch(&doc, label);
        assert_eq!(b["state"], "done", "{b}");
        assert!(b["turns"].as_u64().unwrap() >= 3, "{b}");
        assert!(b["cost_usd"].as_f64().unwrap() > 0.0, "{b}");
        assert!(b["id"].as_str().unwrap().len() == 36);
    }
    assert_eq!(branch(&doc, "thorough")["turns"], 4);

    // The diff: agreement per path and per-branch operations.
    let summary = &doc["diff"]["summary"];
    assert_eq!(summary["total_paths_touched"], 5, "{summary}");
    assert_eq!(summary["split_paths"], 3, "{summary}");
    assert_eq!(summary["unanimous_paths"], 1, "{summary}");
    assert_eq!(summary["per_branch_unique"]["thorough"], 1);
    assert!((summary["agreement_score"].as_f64().unwrap() - 0.4).abs() < 1e-9);
    assert_eq!(path(&doc, "README.md")["agreement"], "split");
    assert_eq!(path(&doc, "greet.py")["operations"]["concise"], "modified");
    assert_eq!(
        path(&doc, "docs/legacy.md")["agreement"],
        "unanimous_change"
    );
    assert_eq!(
        path(&doc, "docs/legacy.md")["operations"]["tidy"],
        "deleted"
    );
    assert_eq!(path(&doc, "tests/test_greet.py")["agreement"], "unique");
    assert_eq!(
        path(&doc, "tests/test_greet.py")["operations"]["thorough"],
        "created"
    );
    assert!(path(&doc, "tests/test_greet.py")["operations"]
        .get("concise")
        .is_none());

    // The merge applied exactly the winner's changes to the workspace.
    let merge = &doc["merge"];
    assert_eq!(merge["winner"], "concise");
    assert_eq!(
        merge["applied_paths"],
        serde_json::json!(["README.md", "greet.py"])
    );
    assert_eq!(
        merge["deleted_paths"],
        serde_json::json!(["docs/legacy.md"])
    );
    assert_eq!(merge["conflicts"], serde_json::json!([]));
    assert_eq!(merge["errors"], serde_json::json!([]));
    assert_eq!(merge["applied_changes"], 3);
    assert!(ex
        .read("README.md")
        .unwrap()
        .contains("Run `python greet.py NAME`."));
    assert!(ex.read("greet.py").unwrap().contains("Hello, {name}!"));
    assert!(ex.read("docs/legacy.md").is_none());
    assert!(
        ex.read("tests/test_greet.py").is_none(),
        "thorough's test must not be merged"
    );
    assert_eq!(
        ex.read("notes/todo.md").unwrap(),
        "# To do\n\n- [ ] document usage\n- [ ] handle a missing name\n"
    );
    assert_eq!(doc["state"], "merged");
}

#[test]
fn text_output_shows_progress_table_and_diff() {
    let ex = Example::quickstart();
    let out = forkfleet(&["run", path_str(&ex.spec()), "--timeout-s", "120"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let err = stderr(&out);
    assert!(err.contains("concise: done"), "{err}");
    assert!(stdout.contains("LABEL"), "{stdout}");
    assert!(stdout.contains("docs/legacy.md"), "{stdout}");
    assert!(stdout.contains("unanimous_change"), "{stdout}");
    assert!(stdout.contains("forkfleet fork merge"), "{stdout}");
    // Not merged: the workspace is untouched.
    assert!(ex.read("docs/legacy.md").is_some());
}

fn bad_input(ex: &Example, spec_text: &str, expect: &[&str]) {
    let spec = ex.write_spec(spec_text);
    let out = forkfleet(&["run", path_str(&spec), "--json"]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    for e in expect {
        assert!(err.contains(e), "expected `{e}` in: {err}");
    }
    assert!(!ex.data().exists(), "bad input must create nothing");
}

const HEAD: &str = "goal = \"g\"\nworkspace = \"workspace\"\nmodel = \"scripted:quickstart\"\n";
const MODEL: &str = "[models.\"scripted:quickstart\"]\nscript = \"script.toml\"\n";

#[test]
fn bad_specs_are_clear_errors_and_create_nothing() {
    let ex = Example::quickstart();
    bad_input(
        &ex,
        &format!("{HEAD}colour = \"red\"\n{MODEL}[[branches]]\nlabel = \"concise\""),
        &[
            "unknown field `colour`",
            "goal",
            "max_branches",
            "aggregate_budget_usd",
        ],
    );
    // No branches is a single agent run; with no goal either there is nothing to run.
    bad_input(
        &ex,
        &format!("{}{MODEL}", HEAD.replace("goal = \"g\"", "goal = \"\"")),
        &["no branches and no goal"],
    );
    bad_input(
        &ex,
        &format!("{HEAD}max_branches = 1\n{MODEL}[[branches]]\nlabel = \"concise\"\n[[branches]]\nlabel = \"tidy\""),
        &["2 branches requested, max_branches is 1"],
    );
    bad_input(
        &ex,
        &format!("{HEAD}{MODEL}[[branches]]\nlabel = \"../../x\""),
        &["`../../x`", "path separator"],
    );
    bad_input(
        &ex,
        &format!("{HEAD}{MODEL}[[branches]]\nlabel = \"concise\"\nbudget_usd = -1"),
        &["branches[0].budget_usd", "zero or more"],
    );
    bad_input(
        &ex,
        &format!("goal = \"g\"\nworkspace = \"nowhere\"\nmodel = \"scripted:quickstart\"\n{MODEL}[[branches]]\nlabel = \"concise\""),
        &["nowhere", "does not exist"],
    );
    bad_input(
        &ex,
        &format!("{HEAD}aggregate_budget_usd = 1.0\n[models.\"scripted:quickstart\"]\nscript = \"script.toml\"\n[[branches]]\nlabel = \"concise\""),
        &["no known price", "scripted:quickstart"],
    );
    bad_input(
        &ex,
        &format!("{HEAD}{MODEL}[[branches]]\nlabel = \"nobody\""),
        &["no turns for branch `nobody`"],
    );
    // --pick of a label the spec does not have.
    let out = forkfleet(&["run", path_str(&ex.spec()), "--pick", "nope"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("concise, thorough, tidy"),
        "{}",
        stderr(&out)
    );
    assert!(!ex.data().exists());
}

#[test]
fn blank_and_duplicate_labels_are_renamed() {
    let ex = Example::quickstart();
    let spec = ex.write_spec(&format!(
        "{HEAD}[models.\"scripted:quickstart\"]\nscript = \"dup.toml\"\n[[branches]]\n[[branches]]\nlabel = \"x\"\n[[branches]]\nlabel = \"x\""
    ));
    std::fs::write(
        ex.dir.path().join("dup.toml"),
        "[[turns.\"*\"]]\ntext = \"hi {label}\"\n",
    )
    .unwrap();
    let doc = json(&forkfleet(&[
        "run",
        path_str(&spec),
        "--json",
        "--timeout-s",
        "60",
    ]));
    let labels: Vec<&str> = doc["branches"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["label"].as_str().unwrap())
        .collect();
    assert_eq!(labels, ["branch-1", "x", "x-2"]);
}

/// `forkfleet completions SHELL`: bash's script, sourced in a real bash, completes
/// commands, subcommands and flags; zsh's and fish's are their shells' formats; any other
/// shell is refused naming the ones there are.
#[test]
fn completions_complete_commands_and_flags_in_bash() {
    let out = forkfleet(&["completions", "bash"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("forkfleet.bash");
    std::fs::write(&script, &out.stdout).unwrap();
    // `_forkfleet CMD CUR PREV` with COMP_WORDS/COMP_CWORD set, as bash calls it.
    let complete = |words: &[&str]| -> Vec<String> {
        let quoted: Vec<String> = words.iter().map(|w| format!("'{w}'")).collect();
        let cur = words.last().unwrap();
        let prev = words[words.len() - 2];
        let line = format!(
            "source '{}'; COMP_WORDS=({}); COMP_CWORD={}; _forkfleet forkfleet '{cur}' '{prev}'; printf '%s\\n' \"${{COMPREPLY[@]}}\"",
            script.display(),
            quoted.join(" "),
            words.len() - 1
        );
        let out = std::process::Command::new("bash")
            .args(["--norc", "--noprofile", "-c", &line])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", stderr(&out));
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(String::from)
            .collect()
    };
    assert_eq!(complete(&["forkfleet", "fo"]), ["fork"]);
    let runs = complete(&["forkfleet", "runs", ""]);
    for sub in ["ls", "show", "tree", "fork", "resume"] {
        assert!(runs.iter().any(|w| w == sub), "{sub}: {runs:?}");
    }
    assert_eq!(
        complete(&["forkfleet", "fork", "merge", "F", "--overw"]),
        ["--overwrite"]
    );
    let zsh = forkfleet(&["completions", "zsh"]);
    assert!(String::from_utf8_lossy(&zsh.stdout).starts_with("#compdef forkfleet"));
    let fish = forkfleet(&["completions", "fish"]);
    assert!(String::from_utf8_lossy(&fish.stdout).contains("complete -c forkfleet"));
    let other = forkfleet(&["completions", "powershell"]);
    assert_eq!(other.status.code(), Some(2));
    assert!(
        stderr(&other).contains("bash, zsh, fish"),
        "{}",
        stderr(&other)
    );
}

/// A merge that kept files edited since the fork (exit 3) names the command that applies
/// it again over them, and that command works: `fork merge F --reapply --overwrite`
/// (`--overwrite` on a second `--pick` was refused: a fork merges once).
#[test]
fn a_conflicted_merge_names_a_command_that_applies_it_again() {
    let ex = Example::quickstart();
    let data = path_str(&ex.data()).to_string();
    let created = json(&forkfleet(&[
        "fork",
        "create",
        path_str(&ex.spec()),
        "--json",
        "--data",
        &data,
    ]));
    let fork = created["fork_id"].as_str().unwrap().to_string();
    let greet = ex.workspace().join("greet.py");
    std::fs::write(&greet, "print('mine')\n").unwrap();
    let unmerged = forkfleet(&["fork", "merge", &fork, "--reapply", "--data", &data]);
    assert_eq!(unmerged.status.code(), Some(2), "{}", stderr(&unmerged));
    assert!(
        stderr(&unmerged).contains("is not merged"),
        "{}",
        stderr(&unmerged)
    );

    let merged = forkfleet(&["fork", "merge", &fork, "--pick", "concise", "--data", &data]);
    assert_eq!(merged.status.code(), Some(3), "{}", stderr(&merged));
    assert_eq!(std::fs::read_to_string(&greet).unwrap(), "print('mine')\n");
    let hint = stderr(&merged);
    let again = format!("forkfleet fork merge {fork} --reapply --overwrite");
    assert!(hint.contains(&again), "{hint}");
    // The hint's command, as written (with the store's flag).
    let both = forkfleet(&[
        "fork",
        "merge",
        &fork,
        "--reapply",
        "--pick",
        "concise",
        "--data",
        &data,
    ]);
    assert_eq!(both.status.code(), Some(2));
    let kept_again = forkfleet(&["fork", "merge", &fork, "--reapply", "--data", &data]);
    assert_eq!(kept_again.status.code(), Some(3), "{}", stderr(&kept_again));
    assert_eq!(std::fs::read_to_string(&greet).unwrap(), "print('mine')\n");
    let replaced = json(&forkfleet(&[
        "fork",
        "merge",
        &fork,
        "--reapply",
        "--overwrite",
        "--json",
        "--data",
        &data,
    ]));
    let winner = json(&forkfleet(&[
        "fork", "show", &fork, "concise", "--json", "--data", &data,
    ]));
    assert_eq!(winner["label"], "concise");
    let now = std::fs::read_to_string(&greet).unwrap();
    assert_ne!(now, "print('mine')\n", "{replaced}");
    assert!(!ex.workspace().join("docs/legacy.md").exists());
    // Applying again over a directory already merged changes nothing and exits 0.
    let clean = forkfleet(&["fork", "merge", &fork, "--reapply", "--data", &data]);
    assert!(clean.status.success(), "{}", stderr(&clean));
    assert_eq!(std::fs::read_to_string(&greet).unwrap(), now);
}
