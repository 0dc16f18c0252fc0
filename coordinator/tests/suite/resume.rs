//! A worker taking over a branch: the coordinator fences the earlier attempt and hands the
//! branch's log over on the resume subject; late events of the lost worker are dropped.

use super::support::*;
use forkfleet_shared::api::ParentRun;
use forkfleet_shared::event::Event;
use forkfleet_shared::ids::{ForkId, RunId};
use forkfleet_shared::protocol::{ResumeReply, ResumeRequest, TaskProof, RESUME_SUBJECT};
use forkfleet_shared::state::BranchState;
use forkfleet_shared::wire;
use std::time::Duration;

async fn resume(
    fx: &Fixture,
    fork_id: ForkId,
    run_id: RunId,
    attempt: u32,
    task: Option<TaskProof>,
) -> ResumeReply {
    let req = wire::encode(&ResumeRequest {
        fork_id,
        run_id,
        attempt,
        task,
    })
    .unwrap();
    let reply = fx
        .bus
        .request(RESUME_SUBJECT, req, Duration::from_secs(10))
        .await
        .unwrap();
    wire::decode(&reply).unwrap()
}

#[tokio::test]
async fn takeover_fences_the_lost_attempt_and_hands_over_the_log() {
    let fx = Fixture::start().await;
    let h = fx.h();
    let snap = fx.upload(&[("a.txt", "a\n")]).await;
    fx.create(plan(&["solo"]), ParentRun::New, snap).await;
    let (task, lost) = fx.pull().await;
    let (fork, run, s) = (task.fork_id, task.run_id, task.first_seq);
    let blobs = fx.blobs();
    let running = Step::Status(BranchState::Running).into_event(&blobs).await;
    let w1 = Step::Write("one.txt".into(), "1".into())
        .into_event(&blobs)
        .await;
    let late = Step::Write("late.txt".into(), "x".into())
        .into_event(&blobs)
        .await;

    // Attempt 1 runs a little: running, one write; another write is held beyond a gap.
    fx.publish_as(fork, run, s, running.clone(), 1).await;
    fx.publish_as(fork, run, s + 1, w1.clone(), 1).await;
    fx.publish_as(fork, run, s + 3, late.clone(), 1).await;
    wait_view(&h, fork, |v| v.branches[0].events == s + 2).await;

    // Attempt 2 takes over: the log it gets ends at the last applied event.
    let proof = Fixture::proof(&task, &lost, 2);
    let ResumeReply::Log { events } = resume(&fx, fork, run, 2, Some(proof)).await else {
        panic!("expected the log");
    };
    let seqs: Vec<u64> = events.iter().map(|(seq, _)| *seq).collect();
    assert_eq!(seqs, (0..s + 2).collect::<Vec<_>>());
    assert!(matches!(events[0].1, Event::Fork { .. }));
    // A stale takeover (attempt 1, below the fence) is refused and does not lower the
    // fence: the lost attempt's late event below stays dropped.
    let stale = Fixture::proof(&task, &lost, 1);
    let refused = resume(&fx, fork, run, 1, Some(stale)).await;
    assert!(
        matches!(&refused, ResumeReply::Refused { reason } if reason.contains("below the branch's fence")),
        "{refused:?}"
    );

    // The lost worker's late events are dropped; attempt 2 continues the seqs.
    fx.publish_as(fork, run, s + 2, late.clone(), 1).await;
    let w2 = Step::Write("two.txt".into(), "2".into())
        .into_event(&blobs)
        .await;
    fx.publish_as(fork, run, s + 2, running, 2).await;
    fx.publish_as(fork, run, s + 3, w2, 2).await;
    fx.publish_as(
        fork,
        run,
        s + 4,
        Event::Status {
            state: BranchState::Done,
            error: None,
        },
        2,
    )
    .await;
    let v = wait_view(&h, fork, |v| v.branches[0].state == BranchState::Done).await;
    assert_eq!(
        v.branches[0].changes, 2,
        "one.txt and two.txt; late.txt was fenced"
    );
    let log = within(h.run_events(run)).await.unwrap();
    assert_eq!(
        log.len() as u64,
        s + 5,
        "contiguous, nothing held beyond the end"
    );
    let written: Vec<String> = log
        .iter()
        .filter_map(|(_, e)| match e {
            Event::FileChange { change } => Some(change.path().to_string()),
            _ => None,
        })
        .collect();
    assert_eq!(written, ["one.txt", "two.txt"]);

    // The task is settled: a takeover naming it is refused.
    lost.ack().await.unwrap();
    let late = resume(&fx, fork, run, 2, Some(proof)).await;
    assert!(
        matches!(&late, ResumeReply::Refused { reason } if reason.contains("not queued")),
        "{late:?}"
    );
}

/// ADR 18: a resume request is acted on only when it proves the delivery of the branch's
/// task it comes from; anything else is refused and fences nothing, so the worker that
/// holds the task goes on and its events are applied.
#[tokio::test]
async fn takeovers_without_a_valid_delivery_proof_are_refused_and_fence_nothing() {
    let fx = Fixture::start().await;
    let h = fx.h();
    let snap = fx.upload(&[("a.txt", "a\n")]).await;
    fx.create(plan(&["solo", "other"]), ParentRun::New, snap)
        .await;
    let (t1, d1) = fx.pull().await;
    let (t2, d2) = fx.pull().await;
    let ((task, held), (other, other_d)) = if t1.label == "solo" {
        ((t1, d1), (t2, d2))
    } else {
        ((t2, d2), (t1, d1))
    };
    let (fork, run, s) = (task.fork_id, task.run_id, task.first_seq);
    let seq = held.seq.unwrap();
    let refusals = [
        // A delivery count no delivery has.
        (2, Some(TaskProof { seq, delivered: 0 }), "delivery count 0"),
        // No proof at all.
        (2, None, "no delivery proof"),
        // An attempt that is not the task's attempt_base plus the delivery count.
        (3, Some(TaskProof { seq, delivered: 2 }), "attempt_base"),
        // Another branch's task.
        (
            2,
            Some(Fixture::proof(&other, &other_d, 2)),
            "not the one named",
        ),
        // A position no task holds.
        (
            2,
            Some(TaskProof {
                seq: seq + 1000,
                delivered: 2,
            }),
            "not queued",
        ),
    ];
    for (attempt, proof, why) in refusals {
        let reply = resume(&fx, fork, run, attempt, proof).await;
        assert!(
            matches!(&reply, ResumeReply::Refused { reason } if reason.contains(why)),
            "attempt {attempt}, {proof:?}: {reply:?}"
        );
    }
    // Nothing was fenced: the real attempt's events are applied, and it finishes.
    let running = Event::Status {
        state: BranchState::Running,
        error: None,
    };
    fx.publish_as(fork, run, s, running, 1).await;
    fx.publish_as(
        fork,
        run,
        s + 1,
        Event::Status {
            state: BranchState::Done,
            error: None,
        },
        1,
    )
    .await;
    let v = wait_view(&h, fork, |v| {
        v.branch("solo")
            .is_some_and(|b| b.state == BranchState::Done)
    })
    .await;
    assert_eq!(v.branch("solo").unwrap().events, s + 2);
    // A valid proof for an unknown fork is refused too (the task names another fork).
    let gone = resume(
        &fx,
        ForkId::new(),
        run,
        2,
        Some(TaskProof { seq, delivered: 2 }),
    )
    .await;
    assert!(matches!(gone, ResumeReply::Refused { .. }), "{gone:?}");
}

#[tokio::test]
async fn a_task_no_worker_finishes_fails_its_branch_and_keeps_its_work() {
    let fx = Fixture::start_with(forkfleet_bus::local::LocalBusConfig {
        ack_wait: Duration::from_millis(200),
        max_deliver: 1,
    })
    .await;
    let h = fx.h();
    let snap = fx.upload(&[("a.txt", "a\n")]).await;
    fx.create(plan(&["doomed", "witness"]), ParentRun::New, snap)
        .await;
    // The witness's events later show the stream was read past the straggler's.
    let (first, first_d) = fx.pull().await;
    let (second, second_d) = fx.pull().await;
    let ((task, _never_acked), (witness, witness_d)) = if first.label == "doomed" {
        ((first, first_d), (second, second_d))
    } else {
        ((second, second_d), (first, first_d))
    };
    witness_d.ack().await.unwrap();
    let (fork, run, s) = (task.fork_id, task.run_id, task.first_seq);
    let blobs = fx.blobs();
    let running = Step::Status(BranchState::Running).into_event(&blobs).await;
    let w1 = Step::Write("partial.txt".into(), "p".into())
        .into_event(&blobs)
        .await;
    fx.publish(fork, run, s, running).await;
    fx.publish(fork, run, s + 1, w1).await;
    wait_view(&h, fork, |v| v.branch("doomed").unwrap().changes == 1).await;

    // The worker is gone. Past the 200 ms ack wait the task is delivered a second time,
    // past max_deliver 1: its worker's takeover is answered Gone, and since no turn was
    // made and no outage explains the lost delivery, the branch fails (ADR 38).
    let (again, dead) = fx.pull().await;
    assert_eq!((again.run_id, dead.attempt), (run, 2));
    let proof = Fixture::proof(&again, &dead, 2);
    let ResumeReply::Gone { reason } = resume(&fx, fork, run, 2, Some(proof)).await else {
        panic!("a delivery past max_deliver is not a takeover");
    };
    assert!(reason.contains("no worker finished it"), "{reason}");
    dead.ack().await.unwrap();
    let v = wait_view(&h, fork, |v| {
        v.branch("doomed").unwrap().state == BranchState::Failed
    })
    .await;
    let b = v.branch("doomed").unwrap();
    assert!(
        b.error
            .as_deref()
            .unwrap()
            .contains("delivered more than once and no worker finished it"),
        "{b:?}"
    );
    assert_eq!(b.changes, 1, "the partial work is kept");
    let log = within(h.run_events(run)).await.unwrap();
    assert_eq!(log.len() as u64, s + 3);
    // A straggler of the lost worker changes nothing.
    let late = Step::Write("late.txt".into(), "x".into())
        .into_event(&blobs)
        .await;
    fx.publish(fork, run, s + 2, late).await;
    fx.publish(
        fork,
        run,
        s + 3,
        Event::Status {
            state: BranchState::Done,
            error: None,
        },
    )
    .await;
    // Published after the straggler's events on the same stream: once it is applied, so
    // were (or were dropped) the straggler's.
    let witness_running = Step::Status(BranchState::Running).into_event(&blobs).await;
    fx.publish(
        witness.fork_id,
        witness.run_id,
        witness.first_seq,
        witness_running,
    )
    .await;
    let v = wait_view(&h, fork, |v| {
        v.branch("witness").unwrap().state == BranchState::Running
    })
    .await;
    let b = v.branch("doomed").unwrap();
    assert_eq!(b.state, BranchState::Failed);
    assert_eq!(b.changes, 1);
    assert_eq!(within(h.run_events(run)).await.unwrap().len() as u64, s + 3);
}

/// A fork of one branch, `solo`, on a local bus of `ack_wait_ms` and `max_deliver` 1: its
/// task's first delivery, taken and never acked (its worker is lost), and the branch
/// running.
async fn solo_running(
    ack_wait_ms: u64,
) -> (
    Fixture,
    forkfleet_shared::protocol::BranchTask,
    forkfleet_bus::Delivery,
) {
    let fx = Fixture::start_with(forkfleet_bus::local::LocalBusConfig {
        ack_wait: Duration::from_millis(ack_wait_ms),
        max_deliver: 1,
    })
    .await;
    let snap = fx.upload(&[("a.txt", "a\n")]).await;
    fx.create(plan(&["solo"]), ParentRun::New, snap).await;
    let (task, lost) = fx.pull().await;
    let running = Step::Status(BranchState::Running)
        .into_event(&fx.blobs())
        .await;
    fx.publish(task.fork_id, task.run_id, task.first_seq, running)
        .await;
    (fx, task, lost)
}

/// The next delivery of a task, past `max_deliver` 1: its worker asks to take the branch
/// over with its proof and is answered `Gone` (the delivery, its proof and the reason).
async fn dead_delivery(fx: &Fixture) -> (forkfleet_bus::Delivery, TaskProof, String) {
    let (task, dead) = fx.pull().await;
    let attempt = task.attempt_base + 2;
    let proof = Fixture::proof(&task, &dead, attempt);
    match resume(fx, task.fork_id, task.run_id, attempt, Some(proof)).await {
        ResumeReply::Gone { reason } => (dead, proof, reason),
        other => panic!("a delivery past max_deliver is not a takeover: {other:?}"),
    }
}

/// ADR 38: a task whose deliveries ran out after its branch made a turn was not killing
/// its workers (they were lost while it went on, e.g. to an outage longer than the lease):
/// it is queued again above every attempt of the dead task, and the branch finishes.
#[tokio::test]
async fn a_task_that_dies_after_its_branch_made_a_turn_is_queued_again() {
    let (fx, task, _lost) = solo_running(200).await;
    let (h, blobs) = (fx.h(), fx.blobs());
    let (fork, run, s) = (task.fork_id, task.run_id, task.first_seq);
    fx.publish(
        fork,
        run,
        s + 1,
        Step::Respond("one".into()).into_event(&blobs).await,
    )
    .await;
    wait_view(&h, fork, |v| v.branch("solo").unwrap().turns == 1).await;

    // The worker is lost; the task comes a second time, past max_deliver 1: dead. The
    // branch is not failed: it is queued again as a new task, above the dead one's attempts.
    let (dead, proof, reason) = dead_delivery(&fx).await;
    assert_eq!((proof.delivered, dead.attempt), (2, 2));
    assert!(reason.contains("queued again"), "{reason}");
    // Asked again (an answer lost on the way): the branch is not queued twice.
    let ResumeReply::Gone { reason } = resume(&fx, fork, run, 2, Some(proof)).await else {
        panic!("a delivery past max_deliver is not a takeover");
    };
    assert!(reason.contains("replaced"), "{reason}");
    dead.ack().await.unwrap();
    let (again, held) = fx.pull().await;
    assert_eq!(again.run_id, run);
    assert_eq!(again.attempt_base, 1);
    let v = within(h.fork(fork)).await.unwrap();
    assert_eq!(
        v.branch("solo").unwrap().state,
        BranchState::Running,
        "{v:?}"
    );

    // Its worker takes the branch over from the log and finishes it.
    let proof = Fixture::proof(&again, &held, 2);
    let ResumeReply::Log { events, .. } = resume(&fx, fork, run, 2, Some(proof)).await else {
        panic!("the requeued task's worker may take the branch over");
    };
    assert_eq!(events.len() as u64, s + 2, "the log as stored");
    // A straggler of the lost attempt 1 is dropped.
    fx.publish_as(
        fork,
        run,
        s + 2,
        Step::Write("late.txt".into(), "x".into())
            .into_event(&blobs)
            .await,
        1,
    )
    .await;
    fx.publish_as(
        fork,
        run,
        s + 2,
        Step::Respond("two".into()).into_event(&blobs).await,
        2,
    )
    .await;
    fx.publish_as(
        fork,
        run,
        s + 3,
        Step::Status(BranchState::Done).into_event(&blobs).await,
        2,
    )
    .await;
    held.ack().await.unwrap();
    let v = wait_view(&h, fork, |v| v.branch("solo").unwrap().state.is_terminal()).await;
    let b = v.branch("solo").unwrap();
    assert_eq!(b.state, BranchState::Done, "{b:?}");
    assert_eq!((b.turns, b.changes, b.error.as_deref()), (2, 0, None));
}

/// ADR 38: the backstop on requeues counts requeues without a turn in between; a branch
/// whose tasks keep dying while it goes on (a worker lost after each turn, more times than
/// the backstop allows) is queued again every time, never failed.
#[tokio::test]
async fn a_branch_that_goes_on_is_queued_again_past_the_backstop() {
    let (fx, first, _lost) = solo_running(100).await;
    let (h, blobs) = (fx.h(), fx.blobs());
    let (fork, run, s) = (first.fork_id, first.run_id, first.first_seq);
    let mut attempt = 1;
    for (seq, turn) in (s + 1..).zip(1..=25u32) {
        // The worker of `attempt` makes one turn, then is lost.
        let said = Step::Respond(format!("turn {turn}"))
            .into_event(&blobs)
            .await;
        fx.publish_as(fork, run, seq, said, attempt).await;
        wait_view(&h, fork, |v| v.branch("solo").unwrap().turns == turn).await;
        // Its task comes again past max_deliver 1: dead, and queued again.
        let (dead, _, reason) = dead_delivery(&fx).await;
        assert!(reason.contains("queued again"), "turn {turn}: {reason}");
        dead.ack().await.unwrap();
        // The new task's worker takes the branch over.
        let (task, held) = fx.pull().await;
        attempt = task.attempt_base + 1;
        let proof = Fixture::proof(&task, &held, attempt);
        let ResumeReply::Log { .. } = resume(&fx, fork, run, attempt, Some(proof)).await else {
            panic!("turn {turn}: the new task's worker may take the branch over");
        };
        drop(held); // lost in turn, without an ack
    }
    let v = within(h.fork(fork)).await.unwrap();
    let b = v.branch("solo").unwrap();
    assert_eq!((b.state, b.turns), (BranchState::Running, 25), "{b:?}");
}

/// ADR 18: a fenced attempt that finishes and settles the task the attempt that took the
/// branch over runs from leaves the branch without a runner: the coordinator sees the task
/// gone and enqueues the branch again above the fence.
#[tokio::test]
async fn a_branch_whose_task_a_fenced_attempt_settled_is_enqueued_again() {
    settled_by_a_fenced_attempt(false).await;
}

/// The same after a coordinator restart between the takeover and the fenced attempt's
/// end: the task the takeover proved is in the branch's stored record.
#[tokio::test]
async fn a_branch_left_without_a_runner_is_found_after_a_restart_too() {
    settled_by_a_fenced_attempt(true).await;
}

async fn settled_by_a_fenced_attempt(restart: bool) {
    let mut fx = Fixture::start().await;
    let snap = fx.upload(&[("a.txt", "a\n")]).await;
    fx.create(plan(&["solo"]), ParentRun::New, snap).await;
    let (task, held) = fx.pull().await;
    let (fork, run, s) = (task.fork_id, task.run_id, task.first_seq);
    let running = Event::Status {
        state: BranchState::Running,
        error: None,
    };
    fx.publish_as(fork, run, s, running.clone(), 1).await;
    wait_view(&fx.h(), fork, |v| {
        v.branches[0].state == BranchState::Running
    })
    .await;
    // Attempt 2 takes the branch over from the same task.
    let proof = Fixture::proof(&task, &held, 2);
    assert!(matches!(
        resume(&fx, fork, run, 2, Some(proof)).await,
        ResumeReply::Log { .. }
    ));
    fx.publish_as(fork, run, s + 1, running, 2).await;
    if restart {
        wait_view(&fx.h(), fork, |v| v.branches[0].events > s + 1).await;
        fx.restart().await;
    }
    let h = fx.h();
    // The fenced attempt 1 did not notice: it finishes and acks the shared task.
    fx.publish_as(
        fork,
        run,
        s + 1,
        Event::Status {
            state: BranchState::Done,
            error: None,
        },
        1,
    )
    .await;
    held.ack().await.unwrap();
    fx.publish_as(
        fork,
        run,
        s + 2,
        Event::Status {
            state: BranchState::Done,
            error: None,
        },
        1,
    )
    .await;
    // The branch is enqueued again, above the fence.
    let (again, _d) = fx.pull().await;
    assert_eq!(again.run_id, run);
    assert_eq!(again.attempt_base, 2);
    let v = within(h.fork(fork)).await.unwrap();
    assert_eq!(v.branches[0].state, BranchState::Running, "{v:?}");
}
