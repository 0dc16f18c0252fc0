//! Steering a running branch and follow-up turns of finished ones (ADR 13), through the
//! coordinator's handle and its API dispatch, with a fake worker on the test bus.

use super::support::*;
use bytes::Bytes;
use forkfleet_bus::Delivery;
use forkfleet_coordinator::{CoordinatorError, CoordinatorHandle};
use forkfleet_shared::api::dispatch;
use forkfleet_shared::api::{ApiErrorKind, ApiRequest, ForkView, ParentRun, Steer};
use forkfleet_shared::diff::DiffOptions;
use forkfleet_shared::event::{Event, ToolCall};
use forkfleet_shared::ids::{ForkId, RunId};
use forkfleet_shared::protocol::{
    BranchTask, Control, ControlCommand, ResumeReply, ResumeRequest, RESUME_SUBJECT,
};
use forkfleet_shared::state::{BranchState, ForkState};
use forkfleet_shared::wire;
use tokio::sync::mpsc::UnboundedReceiver;

/// The next control message sent to a branch.
async fn next_control(rx: &mut UnboundedReceiver<Bytes>) -> Control {
    let bytes = within(rx.recv()).await.expect("a control message");
    wire::decode(&bytes).unwrap()
}

fn steer_text(c: &Control) -> &str {
    match &c.command {
        ControlCommand::Steer { text } => text,
        other => panic!("expected a steer, got {other:?}"),
    }
}

/// Pull the tasks of a fork's branches: by label.
async fn pull_all(fx: &Fixture, n: usize) -> Vec<(BranchTask, Delivery)> {
    let mut out = Vec::new();
    for _ in 0..n {
        out.push(fx.pull().await);
    }
    out.sort_by(|a, b| a.0.label.cmp(&b.0.label));
    out
}

/// Publish `steps` for `task` from `seq` on, as task attempt `attempt`.
async fn play_from(fx: &Fixture, task: &BranchTask, seq: u64, attempt: u32, steps: Vec<Step>) {
    let blobs = fx.blobs();
    for (seq, step) in (seq..).zip(steps) {
        let event = step.into_event(&blobs).await;
        fx.publish_as(task.fork_id, task.run_id, seq, event, attempt)
            .await;
    }
}

/// Take a branch over like a worker: fence it at `attempt` and read its log.
async fn take_over(
    fx: &Fixture,
    fork_id: ForkId,
    run_id: RunId,
    attempt: u32,
    held: (&BranchTask, &forkfleet_bus::Delivery),
) -> Vec<(u64, Event)> {
    let req = wire::encode(&ResumeRequest {
        fork_id,
        run_id,
        attempt,
        task: Some(Fixture::proof(held.0, held.1, attempt)),
    })
    .unwrap();
    let reply = within(fx.bus.request(RESUME_SUBJECT, req, T))
        .await
        .unwrap();
    match wire::decode::<ResumeReply>(&reply).unwrap() {
        ResumeReply::Log { events } => events,
        other => panic!("expected the log, got {other:?}"),
    }
}

async fn settled(h: &CoordinatorHandle, id: ForkId) -> ForkView {
    wait_view(h, id, |v| v.state == ForkState::Settled).await
}

/// The request was refused as bad input, with a message that mentions `hint`.
fn refused<T: std::fmt::Debug>(result: Result<T, CoordinatorError>, hint: &str) {
    let e = result.unwrap_err();
    assert!(e.is_bad_input(), "{e}");
    let msg = e.to_string();
    assert!(msg.contains(hint), "{msg}");
}

#[tokio::test]
async fn a_steer_reaches_only_the_branch_named_and_only_while_it_runs() {
    let fx = Fixture::start().await;
    let h = fx.h();
    let snap = fx.upload(&[("a.txt", "a\n")]).await;
    let id = fx
        .create(plan(&["a", "b"]), ParentRun::New, snap)
        .await
        .fork_id;
    let tasks = pull_all(&fx, 2).await;
    let (a, b) = (&tasks[0].0, &tasks[1].0);
    // The test plays both workers: it watches both control channels.
    let mut rx_a = within(fx.bus.watch_control(a.run_id)).await.unwrap();
    let mut rx_b = within(fx.bus.watch_control(b.run_id)).await.unwrap();
    fx.publish(
        id,
        a.run_id,
        a.first_seq,
        Event::Status {
            state: BranchState::Running,
            error: None,
        },
    )
    .await;
    wait_view(&h, id, |v| {
        v.branch("a").unwrap().state == BranchState::Running
    })
    .await;

    let sent = within(h.steer(id, "a", "go left".into())).await.unwrap();
    assert_eq!((sent.state, sent.attempt), (BranchState::Running, 1));
    let c = next_control(&mut rx_a).await;
    assert_eq!((c.run_id, c.attempt), (a.run_id, Some(1)));
    assert_eq!(steer_text(&c), "go left");

    // An unknown label is not found, naming the valid ones; an empty message is refused.
    // Through the API dispatch too, with the error kinds clients see.
    let err = within(h.steer(id, "c", "go right".into()))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, CoordinatorError::UnknownLabel { valid, .. } if valid == "a, b"),
        "{err}"
    );
    let req = ApiRequest::from(Steer {
        fork: id,
        label: "nope".into(),
        text: "go right".into(),
    });
    let err = within(dispatch(&h, &forkfleet_shared::api::Caller::Admin, req))
        .await
        .unwrap_err();
    assert_eq!(err.kind, ApiErrorKind::NotFound, "{err:?}");
    assert!(err.message.contains("a, b"), "{}", err.message);
    refused(within(h.steer(id, "a", "  \n".into())).await, "empty");

    // A pending branch is steered too (its worker reads the command when it starts).
    // What each channel receives next is what was sent to it: nothing went astray.
    within(h.steer(id, "b", "for b".into())).await.unwrap();
    within(h.steer(id, "a", "second".into())).await.unwrap();
    assert_eq!(steer_text(&next_control(&mut rx_b).await), "for b");
    assert_eq!(steer_text(&next_control(&mut rx_a).await), "second");

    // The worker applies it (its steer event), then the branch finishes: no more steers.
    play_from(
        &fx,
        a,
        a.first_seq + 1,
        1,
        vec![
            Step::Steer("go left"),
            Step::Steer("second"),
            Step::Respond("ok".into()),
            Step::Status(BranchState::Done),
        ],
    )
    .await;
    wait_view(&h, id, |v| {
        v.branch("a").unwrap().state == BranchState::Done
    })
    .await;
    refused(
        within(h.steer(id, "a", "too late".into())).await,
        "fork continue",
    );
    // The unknown label left no trace in any log.
    for run in [a.run_id, b.run_id] {
        let log = within(h.run_events(run)).await.unwrap();
        assert!(
            !log.iter()
                .any(|(_, e)| matches!(e, Event::Steer { text } if text == "go right")),
            "{log:?}"
        );
    }
}

#[tokio::test]
async fn a_follow_up_runs_a_new_turn_of_a_done_branch_in_the_same_overlay() {
    let mut fx = Fixture::start().await;
    let h = fx.h();
    let snap = fx.upload(&[("a.txt", "a\n")]).await;
    let id = fx
        .create(plan(&["a", "b"]), ParentRun::New, snap)
        .await
        .fork_id;
    let tasks = fx
        .fake_worker(2, |t| simple(t, &format!("{}.txt", t.label)))
        .await;
    let first = settled(&h, id).await;
    let a = tasks.iter().find(|t| t.label == "a").unwrap().clone();
    let before = first.branch("a").unwrap().clone();
    assert_eq!((before.state, before.turns), (BranchState::Done, 1));

    // Refused: an unknown label, an empty message.
    let err = within(h.follow_up(id, "zz", "more".into()))
        .await
        .unwrap_err();
    assert!(
        matches!(err, CoordinatorError::UnknownLabel { .. }),
        "{err}"
    );
    refused(within(h.follow_up(id, "a", "".into())).await, "empty");

    let out = within(h.follow_up(id, "a", "now write the docs".into()))
        .await
        .unwrap();
    assert_eq!(out.previous, BranchState::Done);
    assert_eq!(out.branch.state, BranchState::Pending);
    assert_eq!(out.fork_state, ForkState::Open);
    assert_eq!(out.seq, before.events, "appended at the branch's next seq");
    let view = within(h.fork(id)).await.unwrap();
    assert_eq!(view.state, ForkState::Open, "the fork is open again");
    let log = within(h.run_events(a.run_id)).await.unwrap();
    assert_eq!(
        log.last().unwrap(),
        &(
            out.seq,
            Event::FollowUp {
                text: "now write the docs".into()
            }
        )
    );
    // A pending (or running) branch cannot be continued: it is steered.
    refused(within(h.follow_up(id, "a", "again".into())).await, "steer");

    // The branch's task again, above the attempt that ran it: a worker takes it over from
    // the log, which ends with the follow-up.
    let (task, delivery) = fx.pull().await;
    assert_eq!(task.run_id, a.run_id);
    assert_eq!(task.attempt_base, 1);
    let attempt = task.attempt_base + delivery.attempt;
    let taken = take_over(&fx, id, a.run_id, attempt, (&task, &delivery)).await;
    assert!(matches!(taken.last(), Some((_, Event::FollowUp { .. }))));
    // A steer now goes to the new attempt.
    let steered = within(h.steer(id, "a", "briefly".into())).await.unwrap();
    assert_eq!(steered.attempt, attempt);
    play_from(
        &fx,
        &task,
        out.seq + 1,
        attempt,
        vec![
            Step::Status(BranchState::Running),
            Step::Steer("briefly"),
            Step::Respond("writing docs".into()),
            Step::Write("docs.md".into(), "docs\n".into()),
            Step::Usage(10, 5, 0.02),
            Step::Status(BranchState::Done),
        ],
    )
    .await;
    delivery.ack().await.unwrap();
    let after = settled(&h, id).await;
    let a_view = after.branch("a").unwrap().clone();
    assert_eq!(a_view.state, BranchState::Done);
    assert_eq!(a_view.turns, 2);
    assert_eq!(a_view.changes, 2, "both turns' files, one overlay");
    assert!((a_view.cost_usd - 0.03).abs() < 1e-9, "{a_view:?}");
    let diff = within(h.diff(id, DiffOptions::default())).await.unwrap();
    let touched: Vec<String> = diff.paths.iter().map(|p| p.path.to_string()).collect();
    assert!(touched.contains(&"docs.md".to_string()), "{touched:?}");
    assert!(touched.contains(&"a.txt".to_string()), "{touched:?}");

    // A restart rebuilds the same state from the log.
    drop(h);
    fx.restart().await;
    let h = fx.h();
    let reloaded = within(h.fork(id)).await.unwrap();
    assert_eq!(reloaded.state, ForkState::Settled);
    assert_eq!(reloaded.branch("a").unwrap(), &a_view);

    // The merge holds both turns' work; afterwards nothing can be continued.
    let merged = within(h.merge(id, "a")).await.unwrap();
    let paths: Vec<String> = merged
        .changes
        .iter()
        .map(|c| c.path().to_string())
        .collect();
    assert_eq!(paths, ["a.txt", "docs.md"]);
    refused(within(h.follow_up(id, "b", "more".into())).await, "merged");
}

#[tokio::test]
async fn a_pending_follow_up_survives_a_restart_and_settles_the_fork_again() {
    let mut fx = Fixture::start().await;
    let h = fx.h();
    let snap = fx.upload(&[]).await;
    let id = fx
        .create(plan(&["a", "b"]), ParentRun::New, snap)
        .await
        .fork_id;
    let tasks = pull_all(&fx, 2).await;
    let (a, b) = (&tasks[0].0, &tasks[1].0);
    fx.play(a, simple(a, "a.txt")).await;
    // `b` is terminated while a tool call is in flight: its result never came.
    let call = ToolCall {
        id: "call_9".into(),
        name: "write_file".into(),
        args: serde_json::json!({"path": "x", "content": "y"}),
    };
    let s = b.first_seq;
    fx.publish(
        id,
        b.run_id,
        s,
        Event::Status {
            state: BranchState::Running,
            error: None,
        },
    )
    .await;
    fx.publish(
        id,
        b.run_id,
        s + 1,
        Event::ModelResponse {
            model: MODEL.into(),
            text: None,
            tool_calls: vec![call],
            request: None,
            finish_reason: None,
            reasoning: None,
        },
    )
    .await;
    fx.publish(
        id,
        b.run_id,
        s + 2,
        Event::Status {
            state: BranchState::Terminated,
            error: Some("stopped".into()),
        },
    )
    .await;
    for (_, d) in &tasks {
        d.ack().await.unwrap();
    }
    settled(&h, id).await;

    // The call is answered as interrupted before the follow-up: a model API needs a
    // result for every call before the next user message.
    let out = within(h.follow_up(id, "b", "go on".into())).await.unwrap();
    assert_eq!(out.previous, BranchState::Terminated);
    assert_eq!(out.seq, s + 4);
    let log = within(h.run_events(b.run_id)).await.unwrap();
    assert!(
        matches!(&log[log.len() - 2].1, Event::ToolResult { call_id, ok: false, .. } if call_id == "call_9"),
        "{log:?}"
    );

    // The coordinator stops before a worker takes the new turn: it comes back open, the
    // branch pending (rebuilt from the log).
    drop(h);
    fx.restart().await;
    let h = fx.h();
    let v = within(h.fork(id)).await.unwrap();
    assert_eq!(v.state, ForkState::Open, "{v:?}");
    assert_eq!(v.branch("b").unwrap().state, BranchState::Pending);
    assert_eq!(v.branch("b").unwrap().error, None);

    let (task, delivery) = fx.pull().await;
    assert_eq!(task.run_id, b.run_id);
    let attempt = task.attempt_base + delivery.attempt;
    take_over(&fx, id, b.run_id, attempt, (&task, &delivery)).await;
    play_from(
        &fx,
        &task,
        out.seq + 1,
        attempt,
        vec![
            Step::Status(BranchState::Running),
            Step::Respond("went on".into()),
            Step::Status(BranchState::Done),
        ],
    )
    .await;
    delivery.ack().await.unwrap();
    // Settled again: the count of finished branches came back right after the restart.
    let v = settled(&h, id).await;
    assert_eq!(v.branch("b").unwrap().state, BranchState::Done);
    assert_eq!(v.branch("b").unwrap().turns, 2);
}

#[tokio::test]
async fn a_follow_up_is_refused_where_it_cannot_run() {
    let fx = Fixture::start().await;
    let h = fx.h();
    let snap = fx.upload(&[]).await;
    let mut p = plan(&["a", "b"]);
    p.branches[0].budget_usd = Some(0.01);
    let id = fx.create(p, ParentRun::New, snap).await.fork_id;
    fx.fake_worker(2, |t| {
        if t.label == "a" {
            vec![
                Step::Status(BranchState::Running),
                Step::Respond("spent".into()),
                Step::Usage(10, 5, 0.01),
                Step::Fail(BranchState::BudgetExhausted, "branch cap reached"),
            ]
        } else {
            simple(t, "b.txt")
        }
    })
    .await;
    settled(&h, id).await;

    // Stopped at its cap: refused until the cap has room, with the way to give it some.
    refused(
        within(h.follow_up(id, "a", "more".into())).await,
        "budget_exhausted",
    );
    refused(within(h.follow_up(id, "a", "more".into())).await, "topup");
    within(h.topup(id, Some("a"), 1.0)).await.unwrap();
    let out = within(h.follow_up(id, "a", "more".into())).await.unwrap();
    assert_eq!(out.previous, BranchState::BudgetExhausted);

    // An aborted fork's branches are final.
    within(h.abort(id)).await.unwrap();
    refused(within(h.follow_up(id, "b", "more".into())).await, "aborted");
}

#[tokio::test]
async fn commands_after_a_follow_up_are_addressed_to_its_attempt() {
    let fx = Fixture::start().await;
    let h = fx.h();
    let snap = fx.upload(&[]).await;
    let id = fx.create(plan(&["a"]), ParentRun::New, snap).await.fork_id;
    fx.fake_worker(1, |t| simple(t, "a.txt")).await;
    settled(&h, id).await;
    within(h.follow_up(id, "a", "more".into())).await.unwrap();
    let (task, delivery) = fx.pull().await;
    let attempt = task.attempt_base + delivery.attempt;
    let mut rx = within(fx.bus.watch_control(task.run_id)).await.unwrap();
    take_over(&fx, id, task.run_id, attempt, (&task, &delivery)).await;
    let log = within(h.run_events(task.run_id)).await.unwrap();
    let next = log.last().unwrap().0 + 1;
    play_from(
        &fx,
        &task,
        next,
        attempt,
        vec![Step::Status(BranchState::Running)],
    )
    .await;
    wait_view(&h, id, |v| v.branches[0].state == BranchState::Running).await;
    // A follow-up's worker ignores commands addressed to no attempt (on NATS it reads the
    // earlier turns' again): a terminate now names this turn's attempt.
    let t = within(h.terminate(id, "a")).await.unwrap();
    assert!(t.sent);
    let c = loop {
        let c = next_control(&mut rx).await;
        if matches!(c.command, ControlCommand::Terminate { .. }) {
            break c;
        }
    };
    assert_eq!(c.attempt, Some(attempt));
}

#[tokio::test]
async fn a_terminate_its_worker_did_not_obey_ends_the_branch_at_the_next_takeover() {
    let fx = Fixture::start().await;
    let h = fx.h();
    let snap = fx.upload(&[]).await;
    let id = fx.create(plan(&["a"]), ParentRun::New, snap).await.fork_id;
    let (task, _delivery) = fx.pull().await;
    let mut rx = within(fx.bus.watch_control(task.run_id)).await.unwrap();
    play_from(
        &fx,
        &task,
        task.first_seq,
        1,
        vec![Step::Status(BranchState::Running)],
    )
    .await;
    wait_view(&h, id, |v| v.branches[0].state == BranchState::Running).await;
    // Addressed to the attempt that runs the branch, like every command.
    assert!(within(h.terminate(id, "a")).await.unwrap().sent);
    let c = next_control(&mut rx).await;
    assert!(
        matches!(c.command, ControlCommand::Terminate { .. }),
        "{c:?}"
    );
    assert_eq!(c.attempt, Some(1));

    // Its worker is lost before it obeys; the task's next attempt (which ignores a
    // command for attempt 1) finds the branch ended, and the lost worker's late events
    // are dropped.
    let log = take_over(&fx, id, task.run_id, 2, (&task, &_delivery)).await;
    assert!(
        matches!(
            log.last(),
            Some((_, Event::Status { state: BranchState::Terminated, error: Some(e) })) if e.contains("terminated by request")
        ),
        "{log:?}"
    );
    assert_eq!(
        within(h.fork(id)).await.unwrap().branches[0].state,
        BranchState::Terminated
    );
    let next = log.last().unwrap().0 + 1;
    play_from(
        &fx,
        &task,
        next,
        1,
        vec![Step::Write("late.txt".into(), "late\n".into())],
    )
    .await;
    // The first copy of a seq that is not fenced is the one applied: one of attempt 3
    // (above the fence), published after the late write, is applied only if it was dropped.
    play_from(&fx, &task, next, 3, vec![Step::Respond("x".into())]).await;
    let v = wait_view(&h, id, |v| v.branches[0].events > next).await;
    assert_eq!(v.branches[0].changes, 0, "{v:?}");
}

#[tokio::test]
async fn a_follow_up_of_a_branch_the_coordinator_ended_is_fenced_like_any_turn() {
    let fx = Fixture::start().await;
    let h = fx.h();
    let snap = fx.upload(&[]).await;
    let id = fx.create(plan(&["a"]), ParentRun::New, snap).await.fork_id;
    fx.fake_worker(1, |_| {
        vec![
            Step::Status(BranchState::Running),
            Step::Fail(BranchState::Paused, "cap reached"),
        ]
    })
    .await;
    wait_view(&h, id, |v| v.branches[0].state == BranchState::Paused).await;
    // No worker runs a paused branch: the coordinator ends it itself, fencing off the
    // attempts that ran it.
    within(h.terminate(id, "a")).await.unwrap();
    settled(&h, id).await;

    // The new turn runs above those attempts, not at the top of the range: a takeover of
    // it fences off the attempt it took over from.
    let out = within(h.follow_up(id, "a", "go on".into())).await.unwrap();
    let (task, delivery) = fx.pull().await;
    assert_eq!(task.attempt_base, 2);
    let first = task.attempt_base + delivery.attempt;
    take_over(&fx, id, task.run_id, first, (&task, &delivery)).await;
    play_from(
        &fx,
        &task,
        out.seq + 1,
        first,
        vec![Step::Status(BranchState::Running)],
    )
    .await;
    wait_view(&h, id, |v| v.branches[0].state == BranchState::Running).await;
    // Its worker is presumed lost: the next attempt takes over; the first one's late write
    // is dropped, the next one's events are the branch's.
    take_over(&fx, id, task.run_id, first + 1, (&task, &delivery)).await;
    play_from(
        &fx,
        &task,
        out.seq + 2,
        first,
        vec![Step::Write("zombie.txt".into(), "z\n".into())],
    )
    .await;
    play_from(
        &fx,
        &task,
        out.seq + 2,
        first + 1,
        vec![
            Step::Write("kept.txt".into(), "k\n".into()),
            Step::Status(BranchState::Done),
        ],
    )
    .await;
    let v = settled(&h, id).await;
    assert_eq!(v.branches[0].state, BranchState::Done);
    let log = within(h.run_events(task.run_id)).await.unwrap();
    let written: Vec<String> = log
        .iter()
        .filter_map(|(_, e)| match e {
            Event::FileChange { change } => Some(change.path().to_string()),
            _ => None,
        })
        .collect();
    assert_eq!(written, ["kept.txt"]);
}

#[tokio::test]
async fn a_steer_the_branch_ended_without_starts_a_follow_up_turn() {
    let fx = Fixture::start().await;
    let h = fx.h();
    let snap = fx.upload(&[("a.txt", "a\n")]).await;
    let id = fx.create(plan(&["a"]), ParentRun::New, snap).await.fork_id;
    let (task, delivery) = fx.pull().await;
    fx.publish(
        id,
        task.run_id,
        task.first_seq,
        Event::Status {
            state: BranchState::Running,
            error: None,
        },
    )
    .await;
    wait_view(&h, id, |v| {
        v.branch("a").unwrap().state == BranchState::Running
    })
    .await;
    // Acknowledged while the branch runs, but its worker had looked for steers for the last
    // time: its log ends `done` without it.
    within(h.steer(id, "a", "one more thing".into()))
        .await
        .unwrap();
    play_from(
        &fx,
        &task,
        task.first_seq + 1,
        1,
        vec![
            Step::Respond("all done".into()),
            Step::Status(BranchState::Done),
        ],
    )
    .await;
    delivery.ack().await.unwrap();
    // Not lost: the branch goes on with it, as `fork continue` would have started it.
    let (again, _) = fx.pull().await;
    assert_eq!(again.run_id, task.run_id);
    let log = within(h.run_events(task.run_id)).await.unwrap();
    assert!(
        matches!(log.last(), Some((_, Event::FollowUp { text })) if text == "one more thing"),
        "{log:?}"
    );
    let view = within(h.fork(id)).await.unwrap();
    assert_eq!(view.branch("a").unwrap().state, BranchState::Pending);
    // A steer while that task waits for a worker (none reads the branch's commands yet)
    // goes into the log, where the worker that takes the branch over reads it.
    within(h.steer(id, "a", "and another".into()))
        .await
        .unwrap();
    let log = within(h.run_events(task.run_id)).await.unwrap();
    assert!(
        matches!(log.last(), Some((_, Event::Steer { text })) if text == "and another"),
        "{log:?}"
    );
}
