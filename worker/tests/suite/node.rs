//! The node: concurrency limit, bad tasks, heartbeats, shutdown and hand-back.

use super::common::*;
use bytes::Bytes;
use forkfleet_bus::local::LocalBusConfig;
use forkfleet_shared::event::Event;
use forkfleet_shared::protocol::{BranchEvent, DEFAULT_POOL};
use forkfleet_shared::state::BranchState;
use forkfleet_worker::{WorkerConfig, WorkerError};
use std::collections::HashSet;
use std::time::Duration;

const TWO_SLOW_TURNS: &str = r#"
[defaults]
latency_ms = 30

[[turns."*"]]
tool_calls = [{ name = "write_file", args = { path = "{label}.txt", content = "x" } }]

[[turns."*"]]
text = "done"
"#;

#[tokio::test]
async fn never_more_branches_than_the_concurrency_limit() {
    let fx = Fixture::new().await;
    let (_, snap) = fx.snapshot(&[]);
    let script = fx.script(TWO_SLOW_TURNS);
    let tasks: Vec<_> = (0..6)
        .map(|i| fx.task(&format!("b{i}"), i, snap, script))
        .collect();
    for t in &tasks {
        fx.enqueue(t).await;
    }
    let mut events = fx.events().await;
    let worker = start(&fx, config(2)).await;
    let runs: Vec<_> = tasks.iter().map(|t| t.run_id).collect();
    events.until_terminal(&runs).await;
    shutdown(worker).await;

    let mut running = HashSet::new();
    let mut peak = 0;
    for e in &events.order {
        if let Event::Status { state, .. } = &e.event {
            if *state == BranchState::Running {
                running.insert(e.run_id);
            } else if state.is_terminal() {
                running.remove(&e.run_id);
            }
            peak = peak.max(running.len());
        }
    }
    assert_eq!(peak, 2, "branches ran two at a time, never more");
    for run in runs {
        assert_eq!(events.terminal(run).unwrap().0, BranchState::Done);
    }
    assert_eq!(fx.pending().await, 0);
}

#[tokio::test]
async fn a_garbage_task_is_dropped_and_the_node_goes_on() {
    let fx = Fixture::new().await;
    let (_, snap) = fx.snapshot(&[]);
    fx.bus
        .enqueue_task(DEFAULT_POOL, Bytes::from_static(b"\x93garbage"))
        .await
        .unwrap();
    let task = fx.task(
        "after",
        0,
        snap,
        fx.script("[[turns.\"*\"]]\ntext = \"ok\""),
    );
    fx.enqueue(&task).await;
    let mut events = fx.events().await;
    let worker = start(&fx, config(1)).await;
    events.until_terminal(&[task.run_id]).await;
    assert_eq!(events.terminal(task.run_id).unwrap().0, BranchState::Done);
    // (The agent acks its task just after publishing the terminal status; shutdown waits
    // for it, so only after it is "nothing pending" a fact.)
    shutdown(worker).await;
    assert_eq!(
        fx.pending().await,
        0,
        "the garbage task and the real one were acked, neither handed back"
    );
}

#[tokio::test]
async fn shutdown_drops_a_model_call_in_flight_and_hands_the_branch_back() {
    let fx = Fixture::new().await;
    let (_, snap) = fx.snapshot(&[]);
    // A model call that would take ten minutes.
    let script = fx.script("[defaults]\nlatency_ms = 600000\n\n[[turns.\"*\"]]\ntext = \"late\"\n");
    let task = fx.task("slow", 0, snap, script);
    fx.enqueue(&task).await;
    let mut events = fx.events().await;
    let worker = start(&fx, config(1)).await;
    events
        .until(|e| is_status(e, task.run_id, BranchState::Running))
        .await;
    // `shutdown` is bounded by the fixture's wait: the call does not hold it up.
    shutdown(worker).await;
    settle(&fx, &mut events).await;
    assert_eq!(
        events.count(task.run_id, "usage"),
        0,
        "the call was not made"
    );
    assert!(events.terminal(task.run_id).is_none());
    assert_eq!(fx.pending().await, 1, "the task was handed back");
}

#[tokio::test]
async fn shutdown_hands_running_branches_back_for_another_worker() {
    let fx = Fixture::new().await;
    let (_, snap) = fx.snapshot(&[]);
    let script = fx.script(
        r#"
[defaults]
latency_ms = 40

[[turns."*"]]
tool_calls = [{ name = "write_file", args = { path = "t{turn}.txt", content = "x" } }]
repeat = 6

[[turns."*"]]
text = "done"
"#,
    );
    let task = fx.task("moved", 0, snap, script);
    fx.enqueue(&task).await;
    let mut events = fx.events().await;
    let first = start(&fx, config(1)).await;
    events
        .until(|e| e.run_id == task.run_id && e.event.kind() == "model_response")
        .await;
    shutdown(first).await;
    assert!(events.terminal(task.run_id).is_none(), "stopped mid-run");
    assert_eq!(fx.pending().await, 1, "the task was handed back");

    // Another worker picks it up: it asks the coordinator for the branch's log, which
    // fences off the first attempt, and continues right after the last event it applied.
    let seen: Vec<(u64, Event)> = events.by_run[&task.run_id]
        .iter()
        .map(|e| (e.seq, e.event.clone()))
        .collect();
    let last_seen = seen.last().unwrap().0;
    let resume = fx.serve_resume(&task, seen.clone()).await;
    let second = start(&fx, config(1)).await;
    events
        .until(|e| is_status(e, task.run_id, BranchState::Done))
        .await;
    shutdown(second).await;
    assert_eq!(fx.pending().await, 0);
    let asked = tokio::time::timeout(Duration::from_secs(5), resume)
        .await
        .unwrap()
        .unwrap();
    assert_eq!((asked.run_id, asked.attempt), (task.run_id, 2));

    // The log a coordinator keeps: what it had, then the second attempt's events, which
    // continue the seqs with no gap and no repeat.
    let second_attempt: Vec<&BranchEvent> = events.by_run[&task.run_id]
        .iter()
        .filter(|e| e.attempt == 2)
        .collect();
    let seqs: Vec<u64> = second_attempt.iter().map(|e| e.seq).collect();
    let expected: Vec<u64> = (last_seen + 1..last_seen + 1 + seqs.len() as u64).collect();
    assert_eq!(seqs, expected);
    let log: Vec<Event> = seen
        .into_iter()
        .map(|(_, e)| e)
        .chain(second_attempt.iter().map(|e| e.event.clone()))
        .collect();
    let runnings = log
        .iter()
        .filter(|e| {
            matches!(
                e,
                Event::Status {
                    state: BranchState::Running,
                    ..
                }
            )
        })
        .count();
    assert_eq!(runnings, 2, "the branch started once on each worker");
    // Seven model calls in all (six writes and the answer), none repeated.
    let calls = log.iter().filter(|e| e.kind() == "model_response").count();
    assert_eq!(calls, 7);
    // The call whose result the first worker never reported is answered as interrupted.
    let first_result = second_attempt
        .iter()
        .find(|e| e.event.kind() == "tool_result")
        .unwrap();
    assert!(
        matches!(&first_result.event, Event::ToolResult { ok: false, output, .. } if output.starts_with("interrupted")),
        "{:?}",
        first_result.event
    );
}

#[tokio::test]
async fn a_busy_coordinator_is_asked_again_for_the_branch_log() {
    let fx = Fixture::new().await;
    let (_, snap) = fx.snapshot(&[]);
    let mut task = fx.task("busy", 0, snap, fx.script(TWO_SLOW_TURNS));
    // Delivered once, it is attempt 2: it takes the branch over from the coordinator's
    // log, which the coordinator is too busy to hand over the first two times.
    task.attempt_base = 1;
    let resume = fx.serve_resume_busy(&task, Vec::new(), 2).await;
    fx.enqueue(&task).await;
    let mut events = fx.events().await;
    let worker = start(&fx, config(1)).await;
    events.until_terminal(&[task.run_id]).await;
    shutdown(worker).await;

    assert_eq!(events.terminal(task.run_id).unwrap().0, BranchState::Done);
    let asked = tokio::time::timeout(WAIT, resume).await.unwrap().unwrap();
    assert_eq!(asked.len(), 3);
    assert!(asked
        .iter()
        .all(|r| (r.run_id, r.attempt) == (task.run_id, 2)));
    // The same attempt asked again: the task was never handed back.
    assert!(events.by_run[&task.run_id].iter().all(|e| e.attempt == 2));
    assert_eq!(fx.pending().await, 0);
}

#[tokio::test]
async fn heartbeats_keep_a_long_branch_from_being_redelivered() {
    let fx = Fixture::with_config(LocalBusConfig {
        ack_wait: Duration::from_millis(300),
        max_deliver: 5,
    })
    .await;
    let (_, snap) = fx.snapshot(&[]);
    let script = fx.script(
        r#"
[defaults]
latency_ms = 80

[[turns."*"]]
tool_calls = [{ name = "list_files" }]
repeat = 8

[[turns."*"]]
text = "done"
"#,
    );
    let task = fx.task("slow", 0, snap, script);
    fx.enqueue(&task).await;
    let mut events = fx.events().await;
    let worker = start(
        &fx,
        WorkerConfig {
            heartbeat: Duration::from_millis(50),
            ..config(4)
        },
    )
    .await;
    events.until_terminal(&[task.run_id]).await;
    shutdown(worker).await;
    let runnings = events
        .of(task.run_id)
        .iter()
        .filter(|e| {
            matches!(
                e,
                Event::Status {
                    state: BranchState::Running,
                    ..
                }
            )
        })
        .count();
    assert_eq!(runnings, 1, "the task was never redelivered while it ran");
    assert_eq!(fx.pending().await, 0);
}

#[tokio::test]
async fn run_returns_when_the_shutdown_future_completes() {
    let fx = Fixture::new().await;
    let (_, snap) = fx.snapshot(&[]);
    let task = fx.task(
        "served",
        0,
        snap,
        fx.script("[[turns.\"*\"]]\ntext = \"ok\""),
    );
    fx.enqueue(&task).await;
    let mut events = fx.events().await;
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let service = tokio::spawn(forkfleet_worker::run(config(2), fx.dyn_bus(), async {
        let _ = rx.await;
    }));
    events.until_terminal(&[task.run_id]).await;
    tx.send(()).unwrap();
    tokio::time::timeout(WAIT, service)
        .await
        .expect("run returned")
        .unwrap()
        .unwrap();
    assert_eq!(fx.pending().await, 0);
}

#[tokio::test]
async fn a_bad_config_is_refused() {
    let fx = Fixture::new().await;
    let err = forkfleet_worker::start(
        WorkerConfig {
            concurrency: 0,
            ..WorkerConfig::default()
        },
        fx.dyn_bus(),
    )
    .await
    .err()
    .unwrap();
    assert!(matches!(err, WorkerError::Config(_)));
    assert!(err.to_string().contains("concurrency"));
}

#[tokio::test]
async fn workers_share_a_pool() {
    let fx = Fixture::new().await;
    let (_, snap) = fx.snapshot(&[]);
    let script = fx.script(TWO_SLOW_TURNS);
    let tasks: Vec<_> = (0..8)
        .map(|i| fx.task(&format!("w{i}"), i, snap, script))
        .collect();
    for t in &tasks {
        fx.enqueue(t).await;
    }
    let mut events = fx.events().await;
    let a = start(&fx, config(2)).await;
    let b = start(&fx, config(2)).await;
    let runs: Vec<_> = tasks.iter().map(|t| t.run_id).collect();
    events.until_terminal(&runs).await;
    shutdown(a).await;
    shutdown(b).await;
    for run in runs {
        assert_eq!(events.terminal(run).unwrap().0, BranchState::Done);
        assert_eq!(events.count(run, "status"), 2, "each branch ran once");
    }
    assert_eq!(fx.pending().await, 0);
}

const SLOW_SCRIPT: &str = r#"
[defaults]
latency_ms = 60

[[turns."*"]]
tool_calls = [{ name = "write_file", args = { path = "t{turn}.txt", content = "x" } }]
repeat = 5

[[turns."*"]]
text = "done"
"#;

#[tokio::test]
async fn drain_lets_running_branches_finish() {
    let fx = Fixture::new().await;
    let (_, snap) = fx.snapshot(&[]);
    let script = fx.script(SLOW_SCRIPT);
    let task = fx.task("draining", 0, snap, script);
    fx.enqueue(&task).await;
    let mut events = fx.events().await;
    let worker = start(&fx, config(2)).await;
    events
        .until(|e| is_status(e, task.run_id, BranchState::Running))
        .await;
    tokio::time::timeout(
        Duration::from_secs(30),
        worker.drain(Duration::from_secs(20)),
    )
    .await
    .expect("drain timed out")
    .expect("drain failed");
    events.until_terminal(&[task.run_id]).await;
    assert_eq!(events.terminal(task.run_id).unwrap().0, BranchState::Done);
    assert_eq!(
        fx.pending().await,
        0,
        "the branch finished and its task was acked"
    );
}

#[tokio::test]
async fn drain_hands_back_what_outlasts_the_grace() {
    let fx = Fixture::new().await;
    let (_, snap) = fx.snapshot(&[]);
    let script = fx.script(SLOW_SCRIPT);
    let task = fx.task("long", 0, snap, script);
    fx.enqueue(&task).await;
    let mut events = fx.events().await;
    let worker = start(&fx, config(2)).await;
    events
        .until(|e| is_status(e, task.run_id, BranchState::Running))
        .await;
    tokio::time::timeout(
        Duration::from_secs(30),
        worker.drain(Duration::from_millis(50)),
    )
    .await
    .expect("drain timed out")
    .expect("drain failed");
    // Everything the branch published, up to the hand-back: no terminal status.
    settle(&fx, &mut events).await;
    assert!(events.terminal(task.run_id).is_none());
    assert_eq!(
        fx.pending().await,
        1,
        "the unfinished branch went back to the queue"
    );
}
