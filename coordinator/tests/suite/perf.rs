//! The benchmark's shape, coordinator side: 1,000 branches x 10 writes (~45,000 events).
//! Ignored by default; run with
//! `cargo test -p forkfleet-coordinator --release -- --ignored --nocapture perf`.

use super::support::*;
use forkfleet_shared::api::ParentRun;
use forkfleet_shared::event::Event;
use forkfleet_shared::protocol::BranchTask;
use forkfleet_shared::state::{BranchState, ForkState};
use std::time::{Duration, Instant};

fn branch_script(task: &BranchTask) -> Vec<Step> {
    let mut steps = vec![Step::Status(BranchState::Running)];
    for i in 0..10 {
        steps.push(Step::Respond(format!("writing file {i}")));
        steps.push(Step::Write(
            format!("src/{}/file{i}.txt", task.label),
            format!("{} {i}\n", task.label),
        ));
        steps.push(Step::Usage(1000, 100, 0.001));
        steps.push(Step::Respond("ok".into()));
    }
    steps.push(Step::Status(BranchState::Done));
    steps
}

fn rss_mb() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        })
        .map(|kb| kb / 1024)
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore]
async fn perf_1000_branches_by_10_writes() {
    let fx = Fixture::start().await;
    let h = fx.h();
    let snap = fx.upload(&[("README.md", "hello\n")]).await;
    let labels: Vec<String> = (0..1000).map(|i| format!("b{i:04}")).collect();
    let refs: Vec<&str> = labels.iter().map(String::as_str).collect();
    let mut p = plan(&refs);
    p.limits.max_branches = 1000;

    let t0 = Instant::now();
    let view = fx.create(p, ParentRun::New, snap).await;
    let created = t0.elapsed();

    // Workers: pre-encode nothing; publish as a worker would, blob first.
    let t1 = Instant::now();
    let tasks = fx.fake_worker(1000, branch_script).await;
    let published = t1.elapsed();
    let settled = tokio::time::timeout(Duration::from_secs(60), h.wait_settled(view.fork_id, T))
        .await
        .unwrap()
        .unwrap();
    let total = t1.elapsed();
    assert_eq!(settled.state, ForkState::Settled);
    assert!(settled
        .branches
        .iter()
        .all(|b| b.state == BranchState::Done && b.changes == 10));
    let events: u64 = settled
        .branches
        .iter()
        .map(|b| b.events - tasks[0].first_seq)
        .sum();

    let t2 = Instant::now();
    let diff = within(h.diff(view.fork_id, Default::default()))
        .await
        .unwrap();
    let diffed = t2.elapsed();
    assert_eq!(diff.summary.total_paths_touched, 10_000);
    let t3 = Instant::now();
    let out = within(h.merge(view.fork_id, "b0500")).await.unwrap();
    let merged = t3.elapsed();
    assert_eq!(out.report.applied_paths.len(), 10);
    let log = within(h.run_events(tasks[0].run_id)).await.unwrap();
    assert!(matches!(log[0].1, Event::Fork { .. }));

    eprintln!(
        "perf: create {created:?}; {events} events published in {published:?}, settled after {total:?}; diff {diffed:?}; merge {merged:?}; peak RSS {} MB",
        rss_mb()
    );
}

/// The coordinator alone: 42,000 events already on the stream when it starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore]
async fn perf_drain_42000_events() {
    let mut fx = Fixture::start().await;
    let snap = fx.upload(&[("README.md", "hello\n")]).await;
    let labels: Vec<String> = (0..1000).map(|i| format!("b{i:04}")).collect();
    let refs: Vec<&str> = labels.iter().map(String::as_str).collect();
    let mut p = plan(&refs);
    p.limits.max_branches = 1000;
    let view = fx.create(p, ParentRun::New, snap).await;
    let mut tasks = Vec::new();
    for _ in 0..1000 {
        let (task, d) = fx.pull().await;
        d.ack().await.unwrap();
        tasks.push(task);
    }
    fx.stop().await;
    for task in &tasks {
        fx.play(task, branch_script(task)).await;
    }
    let t0 = Instant::now();
    fx.restart().await;
    let started = t0.elapsed();
    let h = fx.h();
    let settled = within(h.wait_settled(view.fork_id, T)).await.unwrap();
    let total = t0.elapsed();
    assert!(settled
        .branches
        .iter()
        .all(|b| b.state == BranchState::Done && b.changes == 10));
    eprintln!(
        "perf: restart (reload 1000 branches) {started:?}; drained 42000 events after {total:?}; peak RSS {} MB",
        rss_mb()
    );
}
