//! The fan-out benchmark command produces a complete, consistent measurement (its figures
//! are recorded in docs/BENCHMARKS.md, never asserted here).

use super::harness::{forkfleet, forkfleet_env, json, stderr};

#[test]
fn fanout_bench_reports_every_field() {
    let doc = json(&forkfleet(&[
        "bench",
        "fanout",
        "--branches",
        "12",
        "--writes",
        "3",
        "--json",
        "--timeout-s",
        "120",
    ]));
    for key in [
        "branches",
        "writes",
        "wall_s",
        "diff_s",
        "merge_s",
        "peak_rss_mb",
    ] {
        assert!(doc.get(key).is_some(), "missing {key} in {doc}");
    }
    assert_eq!(doc["branches"], 12);
    assert_eq!(doc["states"]["done"], 12, "{doc}");
    // 12 branches x (3 writes + 1 answer).
    assert_eq!(doc["model_turns"], 48);
    // Writes j=0..2 of branch b land by (b+j)%3: 3 split, 3 agree, and 12 unique files.
    assert_eq!(doc["split_paths"], 3, "{doc}");
    assert_eq!(doc["unanimous_paths"], 3, "{doc}");
    assert_eq!(doc["paths_touched"], 18, "{doc}");
    // b0 writes split_0, unique/b0/f1, agree_2.
    assert_eq!(doc["applied_paths"], 3);
    assert!((doc["total_cost_usd"].as_f64().unwrap() - 48.0 * 0.00027).abs() < 1e-9);
}

/// `bench stream`: a live fork's stream through the HTTP API, read for its window: one whole
/// view, then deltas of rows (a small fork: 30 branches, 3 writes of 50 to 100 ms each).
#[test]
fn stream_bench_reports_a_whole_view_then_deltas() {
    let doc = json(&forkfleet(&[
        "bench",
        "stream",
        "--branches",
        "30",
        "--turns",
        "3",
        "--latency-ms",
        "50",
        "--seconds",
        "2",
        "--json",
    ]));
    assert_eq!(doc["fork_events"], 1, "{doc}");
    assert!(doc["delta_events"].as_u64().unwrap() >= 1, "{doc}");
    assert!(doc["delta_rows"].as_u64().unwrap() >= 1, "{doc}");
    assert!(doc["model_turns"].as_u64().unwrap() >= 30, "{doc}");
    assert!(
        doc["bytes"].as_u64().unwrap() > doc["first_event_bytes"].as_u64().unwrap(),
        "{doc}"
    );
}

/// `--bus nats`: its own nats-server, the coordinator in the bench process, two worker
/// processes. Needs nats-server (`scripts/setup`), like the other cluster tests.
#[test]
fn fanout_bench_on_nats_reports_every_field() {
    let doc = json(&forkfleet(&[
        "bench",
        "fanout",
        "--bus",
        "nats",
        "--workers",
        "2",
        "--branches",
        "6",
        "--writes",
        "2",
        "--json",
        "--timeout-s",
        "120",
    ]));
    for key in [
        "bus",
        "branches",
        "writes",
        "workers",
        "concurrency",
        "upload_s",
        "wall_s",
        "fork_call_s",
        "diff_s",
        "merge_s",
        "peak_rss_mb",
        "worker_peak_rss_mb",
        "workers_peak_rss_mb",
        "nats_server_peak_rss_mb",
        "model_turns",
        "per_turn_ms",
        "per_turn_ms_p90",
        "aggregate_turn_ms",
        "events",
        "workers_killed",
        "states",
    ] {
        assert!(doc.get(key).is_some(), "missing {key} in {doc}");
    }
    for key in [
        "wall_s",
        "peak_rss_mb",
        "worker_peak_rss_mb",
        "per_turn_ms",
        "aggregate_turn_ms",
    ] {
        assert!(doc[key].is_number(), "{key} is not a number in {doc}");
    }
    assert_eq!(doc["bus"], "nats");
    assert_eq!(doc["branches"], 6);
    assert_eq!(doc["writes"], 2);
    assert_eq!(doc["workers"], 2);
    assert_eq!(doc["states"]["done"], 6, "{doc}");
    assert_eq!(doc["states"].as_object().unwrap().len(), 1, "{doc}");
    // 6 branches x (2 writes + 1 answer).
    assert_eq!(doc["model_turns"], 18);
    // Per branch: running, then per write turn usage, response, file change, tool result,
    // then usage, response, done: 1 + 2 x 4 + 3.
    assert_eq!(doc["events"], 6 * 12, "{doc}");
    assert_eq!(
        doc["workers_peak_rss_mb"].as_array().unwrap().len(),
        2,
        "{doc}"
    );
    assert_eq!(
        doc["workers_killed"], 0,
        "the workers drain on SIGTERM: {doc}"
    );
    // Writes j=0..1 of branch b land by (b+j)%3: 2 split, 2 agree, 4 unique files; the
    // same diff and merge as the embedded mode.
    assert_eq!(doc["split_paths"], 2, "{doc}");
    assert_eq!(doc["unanimous_paths"], 2, "{doc}");
    assert_eq!(doc["paths_touched"], 8, "{doc}");
    // b0 writes split_0 and unique/b0/f1.
    assert_eq!(doc["applied_paths"], 2);
    assert!((doc["total_cost_usd"].as_f64().unwrap() - 18.0 * 0.00027).abs() < 1e-9);
}

/// Without a nats-server, each bench's error names its own command on NATS and the way to
/// run it without one (issue 13: `bench budget` named `bench fanout`).
#[test]
fn a_bench_without_a_nats_server_names_itself_and_the_local_bus() {
    let missing = ("FORKFLEET_NATS_SERVER", "/nonexistent/nats-server");
    for bench in ["budget", "fanout"] {
        let mut args = vec!["bench", bench, "--bus", "nats"];
        if bench == "budget" {
            // Its default bus is NATS: no flag at all must say the same.
            args.truncate(2);
        }
        let out = forkfleet_env(&args, &[missing]);
        assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
        let err = stderr(&out);
        assert!(
            err.contains(&format!(
                "`forkfleet bench {bench} --bus nats` needs a nats-server"
            )),
            "{err}"
        );
        assert!(
            err.contains(&format!("`forkfleet bench {bench} --bus local`")),
            "{err}"
        );
    }
}

#[test]
fn workspace_bench_reports_every_field() {
    let doc = json(&forkfleet(&[
        "bench",
        "workspace",
        "--files",
        "300",
        "--mb",
        "2",
        "--branches",
        "2,3",
        "--commands",
        "3",
        "--repeat",
        "2",
        "--json",
        "--timeout-s",
        "120",
    ]));
    assert_eq!(doc["files"], 300, "{doc}");
    for key in [
        "mb",
        "snapshot_cold_s",
        "snapshot_warm_s",
        "call_kept_p50_ms",
        "call_kept_p90_ms",
        "call_whole_p50_ms",
        "call_whole_p90_ms",
        "call_fresh_p50_ms",
        "call_fresh_p90_ms",
    ] {
        assert!(doc[key].as_f64().is_some_and(|v| v > 0.0), "{key} in {doc}");
    }
    // The warm snapshot is served by the stat cache where the clock allows (a file stamped
    // in the cache's last tick is read again): never more files than the tree has.
    assert!(doc["snapshot_warm_files_read"].as_u64().unwrap() <= 300);
    let runs = doc["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 2, "{doc}");
    for (run, n) in runs.iter().zip([2, 3]) {
        assert_eq!(run["branches"], n);
        // Every branch finished `done` (the bench refuses otherwise), on both sides.
        assert!(run["forkfleet_wall_s"].as_f64().unwrap() > 0.0, "{run}");
        assert!(
            run["forkfleet_peak_rss_mb"].as_f64().unwrap() > 0.0,
            "{run}"
        );
        assert!(
            run["forkfleet_warm_wall_s"].as_f64().unwrap() > 0.0,
            "{run}"
        );
        assert!(run["git_worktree_wall_s"].as_f64().unwrap() > 0.0, "{run}");
        assert!(run["git_repo_s"].as_f64().unwrap() > 0.0, "{run}");
        // What git's objects take, which tells how well the tree compresses.
        assert!(run["git_objects_mb"].as_f64().unwrap() > 0.0, "{run}");
        // `--repeat 2`: each side's run over its store or repository twice, alternating.
        for walls in ["forkfleet_warm_walls_s", "git_worktree_walls_s"] {
            let walls = run[walls].as_array().unwrap();
            assert_eq!(walls.len(), 2, "{run}");
            assert!(walls.iter().all(|w| w.as_f64().unwrap() > 0.0), "{run}");
        }
        assert!(run["ratio"].as_f64().is_some(), "{run}");
        assert!(run["ratio_warm"].as_f64().is_some(), "{run}");
    }
}
