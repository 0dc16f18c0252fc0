//! Housekeeping: `forkfleet gc` and `fork rm` delete finished forks and the blobs nothing
//! refers to, and nothing still referenced: after a collection a kept fork still merges,
//! a root run still rewinds (files included), and a branch run a child refers to still
//! replays.

use super::harness::{branch, forkfleet, json, path_str, stderr, Example};
use serde_json::Value;

fn ff(ex: &Example, args: &[&str]) -> std::process::Output {
    let data = ex.data();
    let mut all = args.to_vec();
    all.extend(["--data", path_str(&data)]);
    forkfleet(&all)
}

fn forks(ex: &Example) -> Vec<String> {
    json(&ff(ex, &["fork", "ls", "--json"]))
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["fork_id"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn gc_deletes_finished_forks_and_nothing_still_referenced() {
    let ex = Example::quickstart();
    let spec = path_str(&ex.spec()).to_string();
    let original = std::fs::read_to_string(ex.workspace().join("greet.py")).unwrap();
    // A: merged; one of its branch runs is forked below (a replayed child refers to it).
    let a = json(&ff(&ex, &["run", &spec, "--pick", "concise", "--json"]));
    let a_id = a["fork_id"].as_str().unwrap().to_string();
    let root = a["parent_run"].as_str().unwrap().to_string();
    let thorough = branch(&a, "thorough")["id"].as_str().unwrap().to_string();
    let child = json(&ff(
        &ex,
        &[
            "runs", "fork", &thorough, "--replay", "--label", "again", "--json",
        ],
    ));
    assert_eq!(child["run"]["run"]["state"], "done", "{child}");
    // B: aborted, nothing refers to it (its goal makes a history blob of its own).
    let b = json(&ff(&ex, &["run", &spec, "--goal", "only B's", "--json"]));
    let b_id = b["fork_id"].as_str().unwrap().to_string();
    let b_dir = ex.workspace().join(".forkfleet/forks").join(&b_id);
    assert!(b_dir.is_dir());
    let abort = ff(&ex, &["fork", "abort", &b_id]);
    assert!(abort.status.success(), "{}", stderr(&abort));
    // C: settled, not merged: not a candidate of `gc`.
    let c = json(&ff(&ex, &["fork", "create", &spec, "--json"]));
    let c_id = c["fork_id"].as_str().unwrap().to_string();

    // A dry run says the same and deletes nothing.
    let dry = json(&ff(
        &ex,
        &["gc", "--older-than", "0s", "--dry-run", "--json"],
    ));
    let before = forks(&ex);
    let report = json(&ff(&ex, &["gc", "--older-than", "0s", "--json"]));
    // Counted alike: forks, runs, events, checkpoints, blobs (a dry run counted no events
    // or checkpoints).
    for count in ["removed", "runs", "events", "checkpoints", "blobs"] {
        assert_eq!(dry[count], report[count], "{count}: {dry}\n{report}");
    }
    assert_eq!(dry["dry_run"], true);
    assert!(report["events"].as_u64().unwrap() > 0, "{report}");
    assert!(before.contains(&b_id));
    // B went, with its runs, checkpoints and blobs; A stayed, because of the child.
    assert_eq!(report["removed"], serde_json::json!([b_id]), "{report}");
    assert!(report["runs"].as_u64().unwrap() >= 3, "{report}");
    assert!(report["checkpoints"].as_u64().unwrap() > 0, "{report}");
    assert!(report["blobs"].as_u64().unwrap() > 0, "{report}");
    let kept: Vec<&Value> = report["kept"].as_array().unwrap().iter().collect();
    let a_kept = kept.iter().find(|k| k["fork_id"] == a_id.as_str()).unwrap();
    assert!(
        a_kept["why"]
            .as_str()
            .unwrap()
            .contains("was forked from its run"),
        "{a_kept}"
    );
    let after = forks(&ex);
    assert!(!after.contains(&b_id) && after.contains(&a_id) && after.contains(&c_id));
    let gone = ff(&ex, &["fork", "show", &b_id]);
    assert_eq!(gone.status.code(), Some(2));

    // Nothing still referenced was deleted: C merges, the root run rewinds (its files
    // included), A's branch replays again.
    let merged = ff(
        &ex,
        &["fork", "merge", &c_id, "--pick", "tidy", "--no-apply"],
    );
    assert!(merged.status.success(), "{}", stderr(&merged));
    let rewind = ff(
        &ex,
        &[
            "checkpoint",
            "rewind",
            &root,
            &format!("fork:{a_id}"),
            "--apply",
            path_str(&ex.workspace()),
            "--overwrite",
        ],
    );
    assert!(rewind.status.success(), "{}", stderr(&rewind));
    assert_eq!(
        std::fs::read_to_string(ex.workspace().join("greet.py")).unwrap(),
        original
    );
    let again = json(&ff(
        &ex,
        &[
            "runs", "fork", &thorough, "--replay", "--label", "twice", "--json",
        ],
    ));
    assert_eq!(again["run"]["run"]["state"], "done", "{again}");
    assert_eq!(
        again["run"]["run"]["calls"], 0,
        "served from the record: {again}"
    );

    // `fork rm`: refused while something refers to the fork, or while it runs; a fork
    // nothing refers to goes with its directory.
    let refused = ff(&ex, &["fork", "rm", &a_id]);
    assert_eq!(refused.status.code(), Some(2));
    assert!(
        stderr(&refused).contains("was forked from its run"),
        "{}",
        stderr(&refused)
    );
    let d = json(&ff(&ex, &["run", &spec, "--goal", "D", "--json"]));
    let d_id = d["fork_id"].as_str().unwrap().to_string();
    let d_dir = ex.workspace().join(".forkfleet/forks").join(&d_id);
    assert!(d_dir.is_dir());
    let dry = json(&ff(&ex, &["fork", "rm", &d_id, "--dry-run", "--json"]));
    assert!(d_dir.is_dir(), "a dry run removes nothing");
    let removed = json(&ff(&ex, &["fork", "rm", &d_id, "--json"]));
    assert_eq!(removed["removed"], serde_json::json!([d_id]));
    for count in ["removed", "runs", "events", "checkpoints"] {
        assert_eq!(dry[count], removed[count], "{count}: {dry}\n{removed}");
    }
    assert!(removed["events"].as_u64().unwrap() > 0, "{removed}");
    assert!(!d_dir.exists(), "its fork directory goes too");
    assert!(!forks(&ex).contains(&d_id));
    let bad = ff(&ex, &["gc", "--older-than", "3 weeks"]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(stderr(&bad).contains("unknown unit"), "{}", stderr(&bad));
}
