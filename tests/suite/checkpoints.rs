//! `forkfleet checkpoint ...` end to end, embedded, on real files: rewinding a run across
//! a merge restores the workspace (and keeps a conflicting local edit), a branch's
//! automatic checkpoints are evicted beyond `max_checkpoints` and it can be rewound, and a
//! new run starts from a checkpoint with the conversation up to it.

use super::harness::{branch, forkfleet, json, json_exit, path_str, run_spec, stderr, Example};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;

/// Every file under `dir` (but `.forkfleet` and `.git`) and its content.
fn tree(dir: &Path) -> BTreeMap<String, String> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeMap<String, String>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let entry = entry.unwrap();
            let name = entry.file_name();
            if name == ".forkfleet" || name == ".git" {
                continue;
            }
            let path = entry.path();
            if entry.file_type().unwrap().is_dir() {
                walk(root, &path, out);
            } else {
                let rel = path
                    .strip_prefix(root)
                    .unwrap()
                    .to_string_lossy()
                    .into_owned();
                out.insert(rel, std::fs::read_to_string(&path).unwrap());
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(dir, dir, &mut out);
    out
}

/// `forkfleet ARGS --data <the example's data dir>`.
fn ff(ex: &Example, args: &[&str]) -> std::process::Output {
    let data = ex.data();
    let mut all: Vec<&str> = args.to_vec();
    all.extend(["--data", path_str(&data)]);
    forkfleet(&all)
}

/// `forkfleet run SPEC --pick PICK --json`: the document.
fn run_and_merge(spec: &Path, pick: &str) -> Value {
    json(&forkfleet(&[
        "run",
        path_str(spec),
        "--pick",
        pick,
        "--json",
        "--timeout-s",
        "120",
    ]))
}

fn labels(doc: &Value) -> Vec<String> {
    doc.as_array()
        .unwrap()
        .iter()
        .map(|c| c["label"].as_str().unwrap().to_string())
        .collect()
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .unwrap_or_else(|| panic!("not an array: {v}"))
        .iter()
        .map(|s| s.as_str().unwrap().to_string())
        .collect()
}

#[test]
fn rewind_across_a_merge_restores_the_files_and_the_conversation() {
    let ex = Example::quickstart();
    let original = tree(&ex.workspace());
    let doc = run_and_merge(&ex.spec(), "thorough");
    let fork = doc["fork_id"].as_str().unwrap().to_string();
    let parent = doc["parent_run"].as_str().unwrap().to_string();
    let merged = tree(&ex.workspace());
    assert!(merged.contains_key("tests/test_greet.py"), "{merged:?}");
    assert_ne!(merged["greet.py"], original["greet.py"]);

    // The parent's checkpoints: before the branches started and after the merge.
    let cps = json(&ff(&ex, &["checkpoint", "ls", &parent, "--json"]));
    let fork_label = format!("fork:{fork}");
    let post_label = format!("post-fork:{fork}");
    assert_eq!(labels(&cps), [fork_label.clone(), post_label.clone()]);

    // Without --apply nothing changes: it says what would.
    let out = ff(&ex, &["checkpoint", "rewind", &parent, &fork_label]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("would rewind"), "{text}");
    assert!(text.contains("rmdir   tests"), "{text}");
    assert!(text.contains("write   greet.py"), "{text}");
    assert!(text.contains("nothing changed"), "{text}");
    assert_eq!(tree(&ex.workspace()), merged);

    // Rewind with --apply: the fork-time files come back, the created ones go.
    let ws = ex.workspace();
    let out = json(&ff(
        &ex,
        &[
            "checkpoint",
            "rewind",
            &parent,
            &fork_label,
            "--apply",
            path_str(&ws),
            "--json",
        ],
    ));
    assert_eq!(out["rewound"], true, "{out}");
    assert_eq!(out["applied"]["conflicts"], serde_json::json!([]), "{out}");
    assert_eq!(out["applied"]["errors"], serde_json::json!([]), "{out}");
    assert_eq!(tree(&ws), original);
    assert!(
        !ws.join("tests").exists(),
        "the directory the merge made is gone"
    );

    // The conversation: the log ends with the rewind, to the fork's seq.
    let log = json(&ff(&ex, &["log", &parent, "--json"]));
    let last = log.as_array().unwrap().last().unwrap();
    assert_eq!(last["event"]["type"], "rewind", "{last}");
    assert_eq!(last["event"]["label"], fork_label.as_str());
    assert_eq!(last["event"]["to_seq"], cps[0]["seq"]);

    // Rewinding to `post-fork:` undoes it.
    let out = json(&ff(
        &ex,
        &[
            "checkpoint",
            "rewind",
            &parent,
            &post_label,
            "--apply",
            path_str(&ws),
            "--json",
        ],
    ));
    assert_eq!(out["applied"]["conflicts"], serde_json::json!([]), "{out}");
    assert_eq!(tree(&ws), merged);
}

#[test]
fn rewind_apply_keeps_a_conflicting_local_edit_unless_overwrite() {
    let ex = Example::quickstart();
    let original = tree(&ex.workspace());
    let doc = run_and_merge(&ex.spec(), "thorough");
    let fork = doc["fork_id"].as_str().unwrap().to_string();
    let parent = doc["parent_run"].as_str().unwrap().to_string();
    let ws = ex.workspace();
    let merged = tree(&ws);

    // Local work since the merge: an edit of a merged file, and a new file in a directory
    // the rewind removes.
    std::fs::write(ws.join("greet.py"), "# my local edit\n").unwrap();
    std::fs::write(ws.join("tests/mine.py"), "# mine\n").unwrap();

    // Applied with local edits kept: the document, and exit 3.
    let out = json_exit(
        &ff(
            &ex,
            &[
                "checkpoint",
                "rewind",
                &parent,
                &format!("fork:{fork}"),
                "--apply",
                path_str(&ws),
                "--json",
            ],
        ),
        3,
    );
    let applied = &out["applied"];
    assert_eq!(
        strings(&applied["conflicts"]),
        ["greet.py", "tests/mine.py"],
        "{out}"
    );
    let now = tree(&ws);
    assert_eq!(
        now["greet.py"], "# my local edit\n",
        "the local edit is kept"
    );
    assert_eq!(now["tests/mine.py"], "# mine\n", "so is the new file");
    assert!(!now.contains_key("tests/test_greet.py"), "{now:?}");
    for path in ["README.md", "notes/todo.md", "docs/legacy.md"] {
        assert_eq!(now[path], original[path], "{path} restored");
    }
    assert!(strings(&applied["deleted_paths"]).contains(&"tests/test_greet.py".to_string()));

    // The text form says the same.
    std::fs::write(ws.join("README.md"), "mine too\n").unwrap();
    let out = ff(
        &ex,
        &[
            "checkpoint",
            "rewind",
            &parent,
            &format!("post-fork:{fork}"),
            "--apply",
            path_str(&ws),
        ],
    );
    // Applied, with a local edit kept: exit 3 (issue 13's exit-code rule).
    assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("edited since kept as"),
        "{}",
        stderr(&out)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.lines()
            .any(|l| l.trim_start().starts_with("conflict") && l.contains("README.md (")),
        "{text}"
    );
    assert_eq!(tree(&ws)["README.md"], "mine too\n");

    // --overwrite: the checkpoint's files win.
    let out = json(&ff(
        &ex,
        &[
            "checkpoint",
            "rewind",
            &parent,
            &format!("fork:{fork}"),
            "--apply",
            path_str(&ws),
            "--overwrite",
            "--json",
        ],
    ));
    // Reported once, as what happened: the local edit was overwritten (issue 13).
    assert!(
        strings(&out["applied"]["overwritten"]).contains(&"README.md".to_string()),
        "{out}"
    );
    for key in ["conflicts", "applied_paths", "deleted_paths"] {
        assert!(
            !strings(&out["applied"][key]).contains(&"README.md".to_string()),
            "README.md also under {key}: {out}"
        );
    }
    let now = tree(&ws);
    assert_eq!(now["README.md"], original["README.md"]);
    assert_ne!(merged["README.md"], original["README.md"]);
}

/// The quickstart with automatic checkpoints kept to `max`.
fn spec_with_max(ex: &Example, max: u32) -> std::path::PathBuf {
    let text = std::fs::read_to_string(ex.spec()).unwrap();
    let text = text.replace(
        "model = \"scripted:quickstart\"\n",
        &format!(
            "model = \"scripted:quickstart\"\ncheckpoints = \"every_tool\"\nmax_checkpoints = {max}\n"
        ),
    );
    ex.write_spec(&text)
}

#[test]
fn a_branch_keeps_its_last_automatic_checkpoints_and_a_finished_one_rewinds() {
    let ex = Example::quickstart();
    let spec = spec_with_max(&ex, 2);
    let doc = json(&run_spec(&spec));
    let fork = doc["fork_id"].as_str().unwrap().to_string();
    let thorough = branch(&doc, "thorough")["id"].as_str().unwrap().to_string();

    // Six tool calls (read, list; edit, write, write; edit): the last two are kept.
    let cps = json(&ff(&ex, &["checkpoint", "ls", &thorough, "--json"]));
    assert_eq!(
        labels(&cps),
        ["tool-5-write_file", "tool-6-edit_file"],
        "{cps}"
    );
    for c in cps.as_array().unwrap() {
        assert_eq!(c["kind"], "auto");
    }
    let text =
        String::from_utf8_lossy(&ff(&ex, &["checkpoint", "ls", &thorough]).stdout).into_owned();
    assert!(
        text.contains("tool-6-edit_file") && text.contains("auto"),
        "{text}"
    );

    // A named checkpoint is never evicted; a label in use or of the automatic form is
    // refused; removing works by label.
    let out = ff(&ex, &["checkpoint", "save", &thorough, "mine"]);
    assert!(out.status.success(), "{}", stderr(&out));
    for bad in ["mine", "tool-9-x", "has space"] {
        let out = ff(&ex, &["checkpoint", "save", &thorough, bad]);
        assert_eq!(out.status.code(), Some(2), "{bad}: {}", stderr(&out));
    }
    let out = ff(&ex, &["checkpoint", "rm", &thorough, "mine"]);
    assert!(out.status.success(), "{}", stderr(&out));

    // The finished branch goes back to before its last edit (the to-do): the fork's diff
    // follows. A run id prefix is enough.
    let prefix = &thorough[..30];
    let out = json(&ff(
        &ex,
        &[
            "checkpoint",
            "rewind",
            prefix,
            "tool-5-write_file",
            "--no-apply",
            "--json",
        ],
    ));
    assert_eq!(out["rewound"], true);
    assert_eq!(out["run_id"], thorough.as_str());
    let changes = out["changes"].as_array().unwrap();
    assert_eq!(changes.len(), 1, "{out}");
    assert_eq!(changes[0]["path"], "notes/todo.md");
    let diff = json(&ff(&ex, &["fork", "diff", &fork, "--json"]));
    let todo = diff["paths"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["path"] == "notes/todo.md");
    // Only `tidy` changes the to-do now.
    let ops = &todo.unwrap()["operations"];
    assert!(ops.get("thorough").is_none(), "{ops}");
    assert!(ops.get("tidy").is_some(), "{ops}");
}

#[test]
fn checkpoint_fork_starts_a_run_whose_log_ends_at_the_checkpoint() {
    let ex = Example::quickstart();
    let doc = json(&run_spec(&ex.spec()));
    let thorough = branch(&doc, "thorough")["id"].as_str().unwrap().to_string();
    let cps = json(&ff(&ex, &["checkpoint", "ls", &thorough, "--json"]));
    let at = cps
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["label"] == "tool-2-list_files")
        .unwrap_or_else(|| panic!("{cps}"))
        .clone();

    let out = json(&ff(
        &ex,
        &[
            "checkpoint",
            "fork",
            &thorough,
            "tool-2-list_files",
            "--json",
        ],
    ));
    let new_run = out["run_id"].as_str().unwrap().to_string();
    assert_ne!(new_run, thorough);

    // Its log is the branch's conversation up to the checkpoint, which it ends with.
    let branch_log = json(&ff(&ex, &["log", &thorough, "--json"]));
    let conversational = [
        "system",
        "user_message",
        "model_response",
        "tool_result",
        "steer",
        "branch_summary",
    ];
    let expected: Vec<&Value> = branch_log
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["seq"].as_u64().unwrap() <= at["seq"].as_u64().unwrap())
        .map(|e| &e["event"])
        .filter(|e| conversational.contains(&e["type"].as_str().unwrap()))
        .collect();
    let new_log = json(&ff(&ex, &["log", &new_run, "--json"]));
    let got: Vec<&Value> = new_log
        .as_array()
        .unwrap()
        .iter()
        .map(|e| &e["event"])
        .collect();
    assert_eq!(got, expected);
    let last = got.last().unwrap();
    assert_eq!(last["type"], "tool_result");
    assert_eq!(last["name"], "list_files");

    // It starts with a checkpoint naming where it came from; the text form prints its id.
    let cps = json(&ff(&ex, &["checkpoint", "ls", &new_run, "--json"]));
    assert_eq!(labels(&cps), [format!("from:{thorough}")]);
    assert_eq!(cps[0]["metadata"]["source_checkpoint"], "tool-2-list_files");
    let out = ff(&ex, &["checkpoint", "fork", &thorough, "tool-2-list_files"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let id = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert_eq!(id.len(), 36, "{id}");
}

#[test]
fn checkpoint_errors_are_clear_and_exit_2() {
    let ex = Example::quickstart();
    let doc = run_and_merge(&ex.spec(), "concise");
    let parent = doc["parent_run"].as_str().unwrap().to_string();

    // An unknown label lists the valid ones.
    let out = ff(
        &ex,
        &["checkpoint", "rewind", &parent, "nope", "--no-apply"],
    );
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(err.contains("no checkpoint `nope`"), "{err}");
    assert!(err.contains("fork:") && err.contains("post-fork:"), "{err}");

    // An unknown run.
    let out = ff(&ex, &["checkpoint", "ls", "ffffffff"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("no run matches `ffffffff`"),
        "{}",
        stderr(&out)
    );
    let missing = "01890000-0000-7000-8000-000000000000";
    let out = ff(&ex, &["checkpoint", "ls", missing]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("does not exist"), "{}", stderr(&out));

    // --apply to something that is not a directory: refused before anything changes.
    let out = ff(
        &ex,
        &[
            "checkpoint",
            "rewind",
            &parent,
            "post-fork:x",
            "--apply",
            "/definitely/not/here",
        ],
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("not a directory"), "{}", stderr(&out));
    let log = json(&ff(&ex, &["log", &parent, "--json"]));
    assert_ne!(
        log.as_array().unwrap().last().unwrap()["event"]["type"],
        "rewind"
    );

    // --overwrite needs --apply.
    let out = ff(&ex, &["checkpoint", "rewind", &parent, "x", "--overwrite"]);
    assert_eq!(out.status.code(), Some(2));

    // Clear removes them all.
    let out = json(&ff(&ex, &["checkpoint", "clear", &parent, "--json"]));
    assert_eq!(out.as_array().unwrap().len(), 2);
    let out = ff(&ex, &["checkpoint", "ls", &parent]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("has no checkpoints"));
}

#[test]
fn rewind_on_a_cluster_restores_the_files() {
    use super::fleet::{Fleet, Options};
    let cluster = Fleet::start(
        1,
        8,
        Options {
            pool: Some("default"),
            drain_grace_s: Some("5"),
            ..Options::default()
        },
    );
    let ex = Example::quickstart();
    let original = tree(&ex.workspace());
    let created = cluster
        .client(&["fork", "create", path_str(&ex.spec()), "--json"])
        .json();
    let fork = created["fork_id"].as_str().unwrap().to_string();
    let parent = created["parent_run"].as_str().unwrap().to_string();
    let watched = cluster
        .client(&["fork", "watch", &fork, "--json", "--timeout-s", "60"])
        .json();
    assert_eq!(watched["state"], "settled", "{}", cluster.logs());
    let ws = ex.workspace();
    let merged = cluster.client(&[
        "fork",
        "merge",
        &fork,
        "--pick",
        "thorough",
        "--apply",
        path_str(&ws),
    ]);
    assert_eq!(merged.code, Some(0), "{}", merged.stderr);
    assert!(tree(&ws).contains_key("tests/test_greet.py"));

    // The branch's automatic checkpoints came over the event stream.
    let thorough = branch(&watched, "thorough")["id"]
        .as_str()
        .unwrap()
        .to_string();
    let cps = cluster
        .client(&["checkpoint", "ls", &thorough, "--json"])
        .json();
    assert_eq!(cps.as_array().unwrap().len(), 6, "{cps}");

    let out = cluster
        .client(&[
            "checkpoint",
            "rewind",
            &parent,
            &format!("fork:{fork}"),
            "--apply",
            path_str(&ws),
            "--json",
        ])
        .json();
    assert_eq!(out["applied"]["conflicts"], serde_json::json!([]), "{out}");
    assert_eq!(out["applied"]["errors"], serde_json::json!([]), "{out}");
    assert_eq!(tree(&ws), original);

    // Back to the merged files: their contents come from what the workers wrote.
    let out = cluster
        .client(&[
            "checkpoint",
            "rewind",
            &parent,
            &format!("post-fork:{fork}"),
            "--apply",
            path_str(&ws),
            "--json",
        ])
        .json();
    assert_eq!(out["applied"]["errors"], serde_json::json!([]), "{out}");
    assert!(tree(&ws)["tests/test_greet.py"].contains("test_missing_name"));
}
