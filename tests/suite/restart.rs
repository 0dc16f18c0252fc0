//! A fork outlives the process that made it: created and settled in one process, read and
//! merged from another, with a conflicting local edit kept.

use super::harness::{command, forkfleet, json, json_exit, path_str, run_spec, stderr, Example};

#[test]
fn fork_merged_by_a_later_process() {
    let ex = Example::quickstart();
    let created = json(&run_spec(&ex.spec()));
    let fork_id = created["fork_id"].as_str().unwrap().to_string();
    assert_eq!(created["state"], "settled");
    assert!(created.get("merge").is_none());
    let data = ex.data();
    let data = path_str(&data);

    // A new process lists and shows it.
    let list = json(&forkfleet(&["fork", "ls", "--data", data, "--json"]));
    assert_eq!(list.as_array().unwrap().len(), 1);
    assert_eq!(list[0]["fork_id"], fork_id.as_str());
    let shown = json(&forkfleet(&[
        "fork",
        "show",
        &fork_id[..13],
        "--data",
        data,
        "--json",
    ]));
    assert_eq!(shown["branches"].as_array().unwrap().len(), 3);
    let diff = json(&forkfleet(&[
        "fork", "diff", &fork_id, "--data", data, "--json", "--path", "tests",
    ]));
    assert_eq!(diff["paths"].as_array().unwrap().len(), 1, "{diff}");

    // The user edits a file the winner also changes, after the fork was made.
    std::fs::write(
        ex.workspace().join("README.md"),
        "# greet\n\nmy own words\n",
    )
    .unwrap();

    // Applied, with the local edit kept: exit 3.
    let merged = json_exit(
        &forkfleet(&[
            "fork", "merge", &fork_id, "--pick", "thorough", "--data", data, "--json",
        ]),
        3,
    );
    let m = &merged["merge"];
    assert_eq!(m["winner"], "thorough");
    assert_eq!(m["conflicts"], serde_json::json!(["README.md"]));
    assert_eq!(
        ex.read("README.md").unwrap(),
        "# greet\n\nmy own words\n",
        "the local edit is kept"
    );
    assert!(ex
        .read("tests/test_greet.py")
        .unwrap()
        .contains("test_missing_name"));
    assert!(ex
        .read("notes/todo.md")
        .unwrap()
        .contains("- [x] handle a missing name"));
    assert!(ex.read("greet.py").unwrap().contains("name or 'world'"));
    assert_eq!(merged["state"], "merged");

    // A second merge is refused, and so is an unknown fork.
    let again = forkfleet(&[
        "fork", "merge", &fork_id, "--pick", "concise", "--data", data,
    ]);
    assert_eq!(again.status.code(), Some(2), "{}", stderr(&again));
    assert!(stderr(&again).contains("merged"), "{}", stderr(&again));
    let unknown = forkfleet(&[
        "fork",
        "show",
        "00000000-0000-7000-8000-000000000000",
        "--data",
        data,
    ]);
    assert_eq!(unknown.status.code(), Some(2), "{}", stderr(&unknown));
}

/// An embedded `forkfleet run` killed (SIGKILL) mid-fork: its task queue lived in memory,
/// but `fork watch` in a new process enqueues the unfinished branches again and runs them
/// to the end, each branch's log contiguous and every turn made once.
#[test]
fn an_embedded_fork_interrupted_mid_run_is_finished_by_watch() {
    let ex = Example::quickstart();
    std::fs::write(
        ex.dir.path().join("slow.toml"),
        "[defaults]\nlatency_ms = 150\nusage = { input_tokens = 10, output_tokens = 5 }\n\n\
         [[turns.\"*\"]]\ntool_calls = [{ name = \"write_file\", args = { path = \"out/{label}/{repeat}.txt\", content = \"{label} {repeat}\\n\" } }]\nrepeat = 6\n\n\
         [[turns.\"*\"]]\ntext = \"done\"\n",
    )
    .unwrap();
    let spec = ex.write_spec(
        "goal = \"slow\"\nworkspace = \"workspace\"\nmodel = \"scripted:slow\"\n\
         [models.\"scripted:slow\"]\nscript = \"slow.toml\"\n\
         [[branches]]\nlabel = \"a\"\n[[branches]]\nlabel = \"b\"\n[[branches]]\nlabel = \"c\"\n",
    );
    let usage = ex.dir.path().join("usage.jsonl");
    let mut run = command()
        .args(["run", path_str(&spec), "--json", "--timeout-s", "120"])
        .env("FORKFLEET_SCRIPTED_USAGE_LOG", &usage)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // Until the branches made a few calls (bounded), then kill the process outright.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let calls = std::fs::read_to_string(&usage)
            .map(|t| t.lines().count())
            .unwrap_or(0);
        if calls >= 4 {
            break;
        }
        assert!(
            run.try_wait().unwrap().is_none(),
            "`forkfleet run` ended before it was killed"
        );
        assert!(std::time::Instant::now() < deadline, "no progress");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    run.kill().unwrap();
    run.wait().unwrap();

    let data = ex.data();
    let data = path_str(&data);
    let list = json(&forkfleet(&["fork", "ls", "--data", data, "--json"]));
    let fork_id = list[0]["fork_id"].as_str().unwrap().to_string();
    let unfinished = list[0]["branches"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|b| b["state"] != "done")
        .count();
    assert!(
        unfinished > 0,
        "the kill came too late to test anything: {list}"
    );

    let view = json(&forkfleet(&[
        "fork",
        "watch",
        &fork_id,
        "--data",
        data,
        "--json",
        "--timeout-s",
        "120",
    ]));
    for b in view["branches"].as_array().unwrap() {
        assert_eq!(b["state"], "done", "{view}");
        let log = json(&forkfleet(&[
            "log",
            b["id"].as_str().unwrap(),
            "--data",
            data,
            "--json",
        ]));
        let log = log.as_array().unwrap();
        let seqs: Vec<u64> = log.iter().map(|e| e["seq"].as_u64().unwrap()).collect();
        assert_eq!(
            seqs,
            (0..log.len() as u64).collect::<Vec<_>>(),
            "contiguous"
        );
        let responses = log
            .iter()
            .filter(|e| e["event"]["type"] == "model_response")
            .count();
        assert_eq!(responses, 7, "every turn once: {}", b["label"]);
    }
}
