//! Runs and lineage: the spec's system prompt, history file and goal make the parent run;
//! every branch log starts with a `fork` event at seq 0, then the copied conversation,
//! then its extra instructions and steer; usage is never copied.

use super::harness::{branch, forkfleet, json, path_str, Example};
use serde_json::Value;

fn log(data: &str, run: &str) -> Vec<Value> {
    json(&forkfleet(&["log", run, "--data", data, "--json"]))
        .as_array()
        .unwrap()
        .clone()
}

fn event_types(log: &[Value]) -> Vec<String> {
    log.iter()
        .map(|e| e["event"]["type"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn branch_logs_carry_lineage_and_the_copied_prefix() {
    let ex = Example::quickstart();
    std::fs::write(
        ex.dir.path().join("history.json"),
        r#"[{"role": "user", "text": "What does greet.py do?"},
            {"role": "assistant", "text": "It prints a greeting.", "tool_calls": []}]"#,
    )
    .unwrap();
    let spec = std::fs::read_to_string(ex.spec()).unwrap().replace(
        "system_prompt = ",
        "history = \"history.json\"\nsystem_prompt = ",
    );
    let spec = ex.write_spec(&spec);
    let doc = json(&forkfleet(&[
        "run",
        path_str(&spec),
        "--pick",
        "thorough",
        "--json",
        "--timeout-s",
        "120",
    ]));
    let data = ex.data();
    let data = path_str(&data);

    // The parent: system prompt, history, goal; after the merge, the adopted conversation.
    let parent = log(data, doc["parent_run"].as_str().unwrap());
    let types = event_types(&parent);
    assert_eq!(
        &types[..4],
        ["system", "user_message", "model_response", "user_message"]
    );
    assert_eq!(
        parent[3]["event"]["text"],
        "Make the greet tool friendlier and document how to use it."
    );
    assert_eq!(types.last().unwrap(), "branch_summary");
    assert!(
        !types.contains(&"usage".to_string()),
        "usage is never adopted: {types:?}"
    );

    // A branch: fork at seq 0, the 4 copied events, extra instructions, steer, then its own.
    let thorough = doc["branches"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["label"] == "thorough")
        .unwrap();
    let branch = log(data, thorough["id"].as_str().unwrap());
    let seqs: Vec<u64> = branch.iter().map(|e| e["seq"].as_u64().unwrap()).collect();
    assert_eq!(
        seqs,
        (0..branch.len() as u64).collect::<Vec<_>>(),
        "contiguous from 0"
    );
    let fork = &branch[0]["event"];
    assert_eq!(fork["type"], "fork");
    assert_eq!(fork["parent_run"], doc["parent_run"]);
    assert_eq!(fork["fork_id"], doc["fork_id"]);
    assert_eq!(fork["label"], "thorough");
    assert_eq!(
        fork["cutoff_seq"], 3,
        "the parent's last event before the fork"
    );
    let types = event_types(&branch);
    assert_eq!(
        &types[1..7],
        [
            "system",
            "user_message",
            "model_response",
            "user_message",
            "system",
            "steer"
        ]
    );
    assert_eq!(
        branch[5]["event"]["text"],
        "Add tests for every behaviour you change."
    );
    assert_eq!(
        types.iter().filter(|t| *t == "model_response").count(),
        1 + 4
    );
    assert_eq!(
        types.iter().filter(|t| *t == "usage").count(),
        4,
        "one usage per model call"
    );
    assert_eq!(types.last().unwrap(), "status");
    assert_eq!(branch.last().unwrap()["event"]["state"], "done");

    // A bad history file is a clear error.
    std::fs::write(ex.dir.path().join("history.json"), "{not json").unwrap();
    let out = forkfleet(&["run", path_str(&spec)]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("history file"));
}

#[test]
fn fork_create_from_run_forks_a_root_run_as_it_is_now() {
    let ex = Example::quickstart();
    let data = ex.data();
    let data = path_str(&data);
    let first = json(&forkfleet(&[
        "run",
        path_str(&ex.spec()),
        "--pick",
        "concise",
        "--json",
    ]));
    let forks = json(&forkfleet(&["fork", "ls", "--data", data, "--json"]));
    let root = forks[0]["parent_run"].as_str().unwrap().to_string();
    let concise = branch(&first, "concise")["id"]
        .as_str()
        .unwrap()
        .to_string();

    // The root run, merged into: its branches start from its history after the merge.
    let out = forkfleet(&[
        "fork",
        "create",
        path_str(&ex.spec()),
        "--from-run",
        &root,
        "--data",
        data,
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let second = json(&out);
    let forks = json(&forkfleet(&["fork", "ls", "--data", data, "--json"]));
    let again = forks
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["fork_id"] == second["fork_id"])
        .unwrap();
    assert_eq!(again["parent_run"], root.as_str());
    let tidy = branch(&second, "tidy")["id"].as_str().unwrap().to_string();
    let branch_log = log(data, &tidy);
    assert!(
        event_types(&branch_log).contains(&"branch_summary".to_string()),
        "the first merge's summary is in the copied history: {branch_log:?}"
    );
    // The branches start from the run's workspace version after the merge, where concise
    // had deleted the legacy doc: tidy's delete of it finds nothing.
    // (The copied history holds concise's own delete, adopted by the merge: look at the
    // branch's, the last one.)
    let deleted = branch_log
        .iter()
        .rev()
        .map(|e| &e["event"])
        .find(|e| e["type"] == "tool_result" && e["name"] == "delete_file")
        .unwrap();
    assert_eq!(deleted["ok"], false, "{deleted}");
    // A finished branch run forks as it is too: its conversation and its files (its fork
    // snapshot with its changes), like a child of `runs fork` (docs/LINEAGE.md).
    let doc = json(&forkfleet(&[
        "fork",
        "create",
        path_str(&ex.spec()),
        "--from-run",
        &concise,
        "--data",
        data,
        "--json",
    ]));
    assert_eq!(doc["parent_run"], concise.as_str(), "{doc}");
}

/// `runs diff A B`: two branches part at their steers (their lineage and status events
/// are not the conversation), and their files differ with unified diffs; a run and its
/// copied child have the same history (under other seqs) and files; a run against itself
/// is the same; text says the same as JSON.
#[test]
fn runs_diff_shows_where_two_runs_part_and_how_their_files_differ() {
    let ex = Example::quickstart();
    let data = path_str(&ex.data()).to_string();
    let doc = json(&forkfleet(&[
        "run",
        path_str(&ex.spec()),
        "--json",
        "--data",
        &data,
    ]));
    let fork = doc["fork_id"].as_str().unwrap();
    let (a, b) = (format!("{fork}/concise"), format!("{fork}/tidy"));
    let diff = json(&forkfleet(&[
        "runs", "diff", &a, &b, "--json", "--data", &data,
    ]));
    let steer_seq = |run: &str| {
        log(&data, run)
            .iter()
            .find(|e| e["event"]["type"] == "steer")
            .unwrap()["seq"]
            .clone()
    };
    assert_eq!(diff["parted"]["a_seq"], steer_seq(&a), "{diff}");
    assert_eq!(diff["parted"]["b_seq"], steer_seq(&b), "{diff}");
    assert_eq!(diff["parted"]["field"], "text");
    assert_eq!(
        diff["parted"]["b"],
        "Only tidy up: close finished to-dos and remove stale docs."
    );
    assert!(diff["same_events"].as_u64().unwrap() >= 2, "{diff}");
    let files: Vec<&Value> = diff["files"].as_array().unwrap().iter().collect();
    let greet = files.iter().find(|f| f["path"] == "greet.py").unwrap();
    let unified = greet["diff"].as_str().unwrap();
    assert!(
        unified.starts_with("--- a/greet.py\n+++ b/greet.py\n"),
        "{unified}"
    );
    assert!(files.iter().all(|f| f["a"] != f["b"]), "{diff}");
    let text = forkfleet(&["runs", "diff", &a, &b, "--data", &data]);
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains("then parts at A's seq"), "{text}");
    assert!(text.contains("--- a/greet.py"), "{text}");

    // A copied child: its conversation is its parent's under other seqs, its files too.
    let child = json(&forkfleet(&[
        "runs", "fork", &a, "--label", "copy", "--json", "--data", &data,
    ]));
    let child = child["run_id"].as_str().unwrap();
    let same = json(&forkfleet(&[
        "runs", "diff", &a, child, "--json", "--data", &data,
    ]));
    assert!(same["parted"].is_null(), "{same}");
    assert_eq!(same["files"], serde_json::json!([]), "{same}");
    let itself = json(&forkfleet(&[
        "runs", "diff", &a, &a, "--json", "--data", &data,
    ]));
    assert!(itself["parted"].is_null(), "{itself}");
    let unknown = forkfleet(&["runs", "diff", &a, "0000000", "--data", &data]);
    assert_eq!(unknown.status.code(), Some(2));
}
