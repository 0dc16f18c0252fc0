//! A fork outlives the process that made it: created and settled in one process, read and
//! merged from another, with a conflicting local edit kept.

use super::harness::{forkfleet, json, path_str, stderr, Example};

#[test]
fn fork_merged_by_a_later_process() {
    let ex = Example::quickstart();
    let created = json(&forkfleet(&[
        "run",
        path_str(&ex.spec()),
        "--json",
        "--timeout-s",
        "120",
    ]));
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

    let merged = json(&forkfleet(&[
        "fork", "merge", &fork_id, "--pick", "thorough", "--data", data, "--json",
    ]));
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
