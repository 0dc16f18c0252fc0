//! The fan-out benchmark command produces a complete, consistent measurement (its figures
//! are recorded in docs/BENCHMARKS.md, never asserted here).

use super::harness::{forkfleet, json};

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
