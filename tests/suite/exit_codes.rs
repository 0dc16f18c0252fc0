//! The exit-code rule (README, "Exit codes"), across every client command in one table:
//! 0 when what was asked happened in full; 1 when it ran and failed or applied only in
//! part; 2 for input that cannot succeed as things are (bad input, an unknown name, a
//! state that forbids it); 3 when it applied everything but kept local edits.

use super::harness::{forkfleet, json, path_str, run_spec, stderr, Example};

#[test]
fn every_command_exits_by_the_rule() {
    let ex = Example::quickstart();
    let spec = ex.spec();
    let spec = path_str(&spec).to_string();
    let data = ex.data();
    let data = path_str(&data).to_string();
    let ws = ex.workspace();
    let ws = path_str(&ws).to_string();

    // One fork left unresolved, one merged with a local edit kept.
    let open = json(&run_spec(&ex.spec()));
    let open_id = open["fork_id"].as_str().unwrap().to_string();
    let run = open["branches"][0]["id"].as_str().unwrap().to_string();
    let kept = json(&run_spec(&ex.spec()));
    let kept_id = kept["fork_id"].as_str().unwrap().to_string();
    std::fs::write(ex.workspace().join("README.md"), "my own edit\n").unwrap();

    let d = |args: &[&str]| {
        let mut v: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        v.extend(["--data".to_string(), data.clone()]);
        v
    };
    let plain = |args: &[&str]| args.iter().map(|a| a.to_string()).collect::<Vec<_>>();
    let table: Vec<(&str, Vec<String>, i32)> = vec![
        (
            "run: a spec that does not exist",
            plain(&["run", "/nonexistent/fork.toml"]),
            2,
        ),
        (
            "run: a pick that is not a branch",
            plain(&["run", &spec, "--pick", "nope"]),
            2,
        ),
        ("fork ls", d(&["fork", "ls"]), 0),
        ("fork show", d(&["fork", "show", &open_id]), 0),
        (
            "fork show: an unknown fork",
            d(&["fork", "show", "ffffffff"]),
            2,
        ),
        ("fork diff", d(&["fork", "diff", &open_id]), 0),
        ("fork cost", d(&["fork", "cost", &open_id]), 0),
        (
            "fork terminate: an unknown label",
            d(&["fork", "terminate", &open_id, "nope"]),
            2,
        ),
        (
            "fork terminate: a finished branch",
            d(&["fork", "terminate", &open_id, "tidy"]),
            0,
        ),
        (
            "fork steer: a finished branch",
            d(&["fork", "steer", &open_id, "tidy", "go"]),
            2,
        ),
        (
            "fork steer: an empty message",
            d(&["fork", "steer", &open_id, "tidy", " "]),
            2,
        ),
        (
            "fork topup: a negative amount",
            d(&["fork", "topup", &open_id, "--usd", "-1"]),
            2,
        ),
        (
            "fork merge: an unknown pick",
            d(&["fork", "merge", &open_id, "--pick", "nope"]),
            2,
        ),
        (
            "fork merge: local edit kept",
            d(&["fork", "merge", &kept_id, "--pick", "concise"]),
            3,
        ),
        (
            "fork merge: twice",
            d(&["fork", "merge", &kept_id, "--pick", "tidy"]),
            2,
        ),
        (
            "fork abort: a merged fork",
            d(&["fork", "abort", &kept_id]),
            2,
        ),
        (
            "fork open: a merged fork",
            d(&["fork", "open", &kept_id]),
            2,
        ),
        (
            "fork continue: the turn fails",
            d(&["fork", "continue", &open_id, "concise", "more"]),
            1,
        ),
        (
            "fork continue: a merged fork",
            d(&["fork", "continue", &kept_id, "tidy", "more"]),
            2,
        ),
        ("log", d(&["log", &run]), 0),
        ("log: not a run id", d(&["log", "nope"]), 2),
        ("checkpoint ls", d(&["checkpoint", "ls", &run]), 0),
        (
            "checkpoint rewind: an unknown checkpoint",
            d(&["checkpoint", "rewind", &run, "nope"]),
            2,
        ),
        (
            "account set",
            d(&["account", "set", "team", "--cap", "5"]),
            0,
        ),
        (
            "account set: a negative cap",
            d(&["account", "set", "team", "--cap", "-1"]),
            2,
        ),
        (
            "account show: an unknown account",
            d(&["account", "show", "nobody"]),
            2,
        ),
        (
            "fork merge",
            d(&[
                "fork",
                "merge",
                &open_id,
                "--pick",
                "thorough",
                "--apply",
                &ws,
                "--overwrite",
            ]),
            0,
        ),
        ("workers: not a cluster", plain(&["workers"]), 2),
        (
            "fork ls: a data dir that does not exist",
            plain(&["fork", "ls", "--data", "/nonexistent/ff"]),
            2,
        ),
    ];
    let mut wrong = Vec::new();
    for (what, args, want) in &table {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = forkfleet(&args);
        let got = out.status.code();
        if got != Some(*want) {
            wrong.push(format!(
                "{what}: exit {got:?}, want {want}\n  {}",
                stderr(&out)
            ));
        }
        assert!(
            !stderr(&out).contains("panicked"),
            "{what}: {}",
            stderr(&out)
        );
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// A project of two branches: `good` finishes, `bad` runs out of scripted turns (its second
/// model call fails).
fn one_fails() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("ws")).unwrap();
    std::fs::write(dir.path().join("ws/a.txt"), "a\n").unwrap();
    std::fs::write(
        dir.path().join("script.toml"),
        "[[turns.good]]\ntool_calls = [{ name = \"write_file\", args = { path = \"b.txt\", content = \"b\\n\" } }]\n\n[[turns.good]]\ntext = \"done\"\n\n[[turns.bad]]\ntool_calls = [{ name = \"read_file\", args = { path = \"a.txt\" } }]\n",
    )
    .unwrap();
    std::fs::write(
        dir.path().join("fork.toml"),
        "goal = \"g\"\nworkspace = \"ws\"\nmodel = \"scripted:x\"\n\n[models.\"scripted:x\"]\nscript = \"script.toml\"\n\n[[branches]]\nlabel = \"good\"\n\n[[branches]]\nlabel = \"bad\"\n",
    )
    .unwrap();
    dir
}

#[test]
fn a_failed_branch_makes_run_create_and_watch_exit_1() {
    let p = one_fails();
    let spec = p.path().join("fork.toml");
    let spec = path_str(&spec);
    let data = p.path().join(".forkfleet");
    let data = path_str(&data);

    // `run`: everything printed (the JSON document too), then exit 1 naming the branch.
    let out = forkfleet(&["run", spec, "--json"]);
    let doc = super::harness::json_exit(&out, 1);
    let fork = doc["fork_id"].as_str().unwrap().to_string();
    let err = stderr(&out);
    assert!(
        err.contains("1 branch of 2 failed") && err.contains("`bad`"),
        "{err}"
    );
    // `fork watch` of it, on a finished fork: the same.
    let out = forkfleet(&["fork", "watch", &fork, "--data", data]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(stderr(&out).contains("`bad`"), "{}", stderr(&out));

    // `--pick` of the failed branch: nothing merged, exit 1, a hint that can be followed.
    let out = forkfleet(&["run", spec, "--pick", "bad", "--json"]);
    let doc = super::harness::json_exit(&out, 1);
    assert!(doc.get("merge").is_none_or(|m| m.is_null()), "{doc}");
    let err = stderr(&out);
    assert!(
        err.contains("--pick `bad` failed") && err.contains("nothing was merged"),
        "{err}"
    );
    assert!(!p.path().join("ws/b.txt").exists());

    // `--pick` of the good one: merged, and still 1 (a branch asked for failed).
    let out = forkfleet(&["run", spec, "--pick", "good"]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert_eq!(
        std::fs::read_to_string(p.path().join("ws/b.txt")).unwrap(),
        "b\n"
    );

    // `fork create`, embedded: runs the fork here, so its failure is this command's.
    let out = forkfleet(&["fork", "create", spec, "--data", data]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
}

#[test]
fn a_refused_branch_makes_run_exit_1_and_is_not_merged_when_picked() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("ws")).unwrap();
    std::fs::write(dir.path().join("ws/a.txt"), "a\n").unwrap();
    // `nope` writes a file, then the model refuses; `good` finishes.
    std::fs::write(
        dir.path().join("script.toml"),
        "[[turns.good]]\ntext = \"done\"\n\n[[turns.nope]]\ntool_calls = [{ name = \"write_file\", args = { path = \"n.txt\", content = \"n\\n\" } }]\n\n[[turns.nope]]\ntext = \"I can't help with that.\"\nfinish_reason = \"refusal\"\n",
    )
    .unwrap();
    std::fs::write(
        dir.path().join("fork.toml"),
        "goal = \"g\"\nworkspace = \"ws\"\nmodel = \"scripted:x\"\n\n[models.\"scripted:x\"]\nscript = \"script.toml\"\n\n[[branches]]\nlabel = \"good\"\n\n[[branches]]\nlabel = \"nope\"\n",
    )
    .unwrap();
    let spec = dir.path().join("fork.toml");
    let spec = path_str(&spec);
    let out = forkfleet(&["run", spec, "--json"]);
    let doc = super::harness::json_exit(&out, 1);
    let states: Vec<&str> = doc["branches"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["state"].as_str().unwrap())
        .collect();
    assert!(states.contains(&"refused"), "{doc}");
    let err = stderr(&out);
    assert!(
        err.contains("1 branch of 2 did not finish") && err.contains("`nope` (refused"),
        "{err}"
    );
    let out = forkfleet(&["run", spec, "--pick", "nope"]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("--pick `nope` refused"),
        "{}",
        stderr(&out)
    );
    assert!(!dir.path().join("ws/n.txt").exists());
}
