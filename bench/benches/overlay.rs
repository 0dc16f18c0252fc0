//! Overlay benchmarks on a 1,000-file base: writes, reads, listings and net changes.

use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use forkfleet_shared::manifest::{FileEntry, Manifest, MODE_FILE};
use forkfleet_shared::overlay::Overlay;
use forkfleet_shared::path::WsPath;
use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

const FILES: usize = 1_000;

fn path(s: &str) -> WsPath {
    match WsPath::parse(s) {
        Ok(p) => p,
        Err(e) => panic!("bad bench path {s}: {e}"),
    }
}

fn file_path(i: usize) -> WsPath {
    path(&format!(
        "src/mod{}/sub{}/file{i}.rs",
        i / 100,
        (i / 10) % 10
    ))
}

fn base() -> (Arc<Manifest>, Vec<WsPath>) {
    let mut m = Manifest::default();
    let mut paths = Vec::with_capacity(FILES);
    for i in 0..FILES {
        let p = file_path(i);
        m.insert_file(
            p.clone(),
            FileEntry::for_bytes(format!("// file {i}\n").as_bytes(), MODE_FILE),
        );
        paths.push(p);
    }
    (Arc::new(m), paths)
}

/// An overlay with 100 modified files, 50 new ones, 10 deleted files and one deleted dir.
fn busy(base: &Arc<Manifest>, paths: &[WsPath]) -> Overlay {
    let mut ov = Overlay::new(base.clone());
    let e = FileEntry::for_bytes(b"changed\n", MODE_FILE);
    for p in paths.iter().step_by(10) {
        let _ = ov.write(p, e);
    }
    for i in 0..50 {
        let _ = ov.write(&path(&format!("new/dir{}/n{i}.rs", i % 5)), e);
    }
    for p in paths.iter().skip(5).step_by(100) {
        let _ = ov.delete(p);
    }
    let _ = ov.delete(&path("src/mod9/sub9"));
    ov
}

fn bench_overlay(c: &mut Criterion) {
    let (base, paths) = base();
    let e = FileEntry::for_bytes(b"new content\n", MODE_FILE);
    let mut g = c.benchmark_group("overlay_1000_files");
    g.bench_function("write_100", |b| {
        b.iter_batched(
            || Overlay::new(base.clone()),
            |mut ov| {
                for p in paths.iter().step_by(10) {
                    let _ = ov.write(p, e);
                }
                ov
            },
            BatchSize::SmallInput,
        )
    });
    let ov = busy(&base, &paths);
    g.bench_function("read_1000", |b| {
        b.iter(|| {
            for p in &paths {
                black_box(ov.node(p));
            }
        })
    });
    g.bench_function("files", |b| b.iter(|| black_box(ov.files())));
    g.bench_function("net_changes", |b| b.iter(|| black_box(ov.net_changes())));
    g.bench_function("from_log", |b| {
        b.iter(|| black_box(Overlay::from_log(base.clone(), ov.changes()).is_ok()))
    });
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1));
    targets = bench_overlay
}
criterion_main!(benches);
