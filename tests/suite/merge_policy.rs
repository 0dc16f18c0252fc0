//! What a merge does to a path edited in the workspace since the fork (issue 13): the
//! spec's `conflict_policy` applies unless a flag overrides it, and each path is reported
//! once, as what happened to it.

use super::harness::{forkfleet, json, path_str, run_spec, stderr, Example};
use serde_json::Value;

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .map(|a| a.iter().map(|x| x.as_str().unwrap().to_string()).collect())
        .unwrap_or_default()
}

/// Run the quickstart unresolved with `policy_line` at the top of its spec, edit the
/// README (which `concise` edits too), merge `concise` with `flags`; the merge's JSON and
/// its exit code.
fn merge_after_a_local_edit(policy_line: &str, flags: &[&str]) -> (Example, Value, i32) {
    let ex = Example::quickstart();
    let text = std::fs::read_to_string(ex.spec()).unwrap();
    let spec = ex.write_spec(&format!("{policy_line}\n{text}"));
    let fork = json(&run_spec(&spec))["fork_id"]
        .as_str()
        .unwrap()
        .to_string();
    std::fs::write(ex.workspace().join("README.md"), "my own edit\n").unwrap();
    let data = ex.dir.path().join(".forkfleet");
    let mut args = vec![
        "fork",
        "merge",
        &fork,
        "--pick",
        "concise",
        "--data",
        path_str(&data),
        "--json",
    ];
    args.extend_from_slice(flags);
    let out = forkfleet(&args);
    let doc = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", stderr(&out)));
    (ex, doc, out.status.code().unwrap())
}

#[test]
fn the_specs_overwrite_policy_applies_to_fork_merge_and_says_overwritten_once() {
    let (ex, doc, code) = merge_after_a_local_edit("conflict_policy = \"overwrite\"", &[]);
    assert_eq!(code, 0, "overwritten in full: {doc}");
    let merge = &doc["merge"];
    assert_eq!(strings(&merge["overwritten"]), ["README.md"], "{merge}");
    for key in ["applied_paths", "conflicts", "deleted_paths"] {
        assert!(
            !strings(&merge[key]).contains(&"README.md".to_string()),
            "README.md also under {key}: {merge}"
        );
    }
    let readme = ex.read("README.md").unwrap();
    assert!(readme.contains("python greet.py NAME"), "{readme}");
}

#[test]
fn without_a_policy_a_local_edit_is_kept_unless_overwrite_is_asked() {
    let (ex, doc, code) = merge_after_a_local_edit("", &[]);
    // Applied, a local edit kept: the JSON is printed and the exit code says so.
    assert_eq!(code, 3, "{doc}");
    assert_eq!(strings(&doc["merge"]["conflicts"]), ["README.md"], "{doc}");
    assert!(strings(&doc["merge"]["overwritten"]).is_empty());
    assert_eq!(ex.read("README.md").unwrap(), "my own edit\n");

    let (ex, doc, code) = merge_after_a_local_edit("", &["--overwrite"]);
    assert_eq!(code, 0, "{doc}");
    assert_eq!(
        strings(&doc["merge"]["overwritten"]),
        ["README.md"],
        "{doc}"
    );
    assert!(strings(&doc["merge"]["conflicts"]).is_empty(), "{doc}");
    assert_ne!(ex.read("README.md").unwrap(), "my own edit\n");
}
