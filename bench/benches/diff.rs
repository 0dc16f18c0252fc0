//! Cross-branch diff report and flush benchmarks.
//!
//! Workload: 1,000 branches x 10 writes. For branch `b` and write `j`, category
//! `(b + j) % 3`: 0 -> `shared/split_{j}.txt` with branch-specific content (10 lines),
//! 1 -> `unique/b{b}/f{j}.txt` (touched by that branch only), 2 -> `shared/agree_{j}.txt`
//! with the same content in every branch. The base has `shared/split_{j}.txt` for j < 10
//! and `README.md`.

use bytes::Bytes;
use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use forkfleet_shared::blob::BlobHash;
use forkfleet_shared::diff::{diff_overlays, diff_report, DiffOptions};
use forkfleet_shared::flush::{flush, ConflictPolicy, ManifestTarget};
use forkfleet_shared::manifest::{FileEntry, Manifest, MODE_FILE};
use forkfleet_shared::overlay::{NetChange, Overlay};
use forkfleet_shared::path::WsPath;
use std::collections::{BTreeMap, HashMap};
use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

const BRANCHES: usize = 1_000;
const WRITES: usize = 10;

fn path(s: &str) -> WsPath {
    match WsPath::parse(s) {
        Ok(p) => p,
        Err(e) => panic!("bad bench path {s}: {e}"),
    }
}

struct Workload {
    base: Arc<Manifest>,
    blobs: HashMap<BlobHash, Bytes>,
    branches: Vec<(String, Overlay)>,
}

fn entry(blobs: &mut HashMap<BlobHash, Bytes>, content: String) -> FileEntry {
    let e = FileEntry::for_bytes(content.as_bytes(), MODE_FILE);
    blobs.insert(e.hash, Bytes::from(content));
    e
}

fn workload() -> Workload {
    let mut blobs = HashMap::new();
    let mut base = Manifest::default();
    for j in 0..WRITES {
        let content: String = (0..10).map(|l| format!("base {j} line {l}\n")).collect();
        base.insert_file(
            path(&format!("shared/split_{j}.txt")),
            entry(&mut blobs, content),
        );
    }
    base.insert_file(
        path("README.md"),
        entry(&mut blobs, "# readme\n".to_string()),
    );
    let base = Arc::new(base);
    let mut branches = Vec::with_capacity(BRANCHES);
    for b in 0..BRANCHES {
        let mut ov = Overlay::new(base.clone());
        for j in 0..WRITES {
            let (p, content) = match (b + j) % 3 {
                0 => (
                    format!("shared/split_{j}.txt"),
                    (0..10)
                        .map(|l| format!("branch {b} file {j} line {l}\n"))
                        .collect(),
                ),
                1 => (format!("unique/b{b}/f{j}.txt"), format!("unique {b} {j}\n")),
                _ => (
                    format!("shared/agree_{j}.txt"),
                    format!("agreed content {j}\n"),
                ),
            };
            let e = entry(&mut blobs, content);
            if let Err(err) = ov.write(&path(&p), e) {
                panic!("bench write {p}: {err}");
            }
        }
        branches.push((format!("branch-{b}"), ov));
    }
    Workload {
        base,
        blobs,
        branches,
    }
}

fn bench_diff(c: &mut Criterion) {
    let w = workload();
    let lookup = |h: &BlobHash| w.blobs.get(h).cloned();
    let inputs: Vec<(&str, &Overlay)> = w.branches.iter().map(|(l, o)| (l.as_str(), o)).collect();
    let nets: Vec<BTreeMap<WsPath, NetChange>> =
        w.branches.iter().map(|(_, o)| o.net_changes()).collect();
    let net_inputs: Vec<(&str, &BTreeMap<WsPath, NetChange>)> = w
        .branches
        .iter()
        .zip(&nets)
        .map(|((l, _), n)| (l.as_str(), n))
        .collect();
    let unified = DiffOptions::default();
    let summary_only = DiffOptions {
        unified: false,
        ..DiffOptions::default()
    };

    let mut g = c.benchmark_group("diff_1000x10");
    g.bench_function("overlays_unified", |b| {
        b.iter(|| black_box(diff_overlays(&w.base, &inputs, &lookup, &unified)))
    });
    g.bench_function("net_changes_unified", |b| {
        b.iter(|| black_box(diff_report(&w.base, &net_inputs, &lookup, &unified)))
    });
    g.bench_function("net_changes_no_text", |b| {
        b.iter(|| black_box(diff_report(&w.base, &net_inputs, &lookup, &summary_only)))
    });
    g.finish();

    let (_, one) = &w.branches[0];
    let mut g = c.benchmark_group("flush");
    g.bench_function("one_branch_of_10_writes", |b| {
        b.iter_batched(
            || ManifestTarget::new((*w.base).clone()),
            |mut t| {
                let r = flush(one.changes(), &w.base, &mut t, ConflictPolicy::KeepParent);
                black_box((r, t))
            },
            BatchSize::SmallInput,
        )
    });
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(2));
    targets = bench_diff
}
criterion_main!(benches);
