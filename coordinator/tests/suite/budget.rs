//! The budget ledger through the bus: reservations (strict), usage reports (best effort),
//! stops and pauses sent to branches, top-ups that resume them, accounts shared by forks,
//! and reservations that never leak (settled, released on stop, on takeover, on expiry,
//! kept across a restart).

use super::support::*;
use bytes::Bytes;
use forkfleet_bus::local::LocalBusConfig;
use forkfleet_coordinator::CoordinatorConfig;
use forkfleet_shared::api::ParentRun;
use forkfleet_shared::budget::{
    BudgetMode, BudgetReply, BudgetRequest, OnExhausted, BUDGET_SUBJECT,
};
use forkfleet_shared::event::{Event, Usage};
use forkfleet_shared::ids::ReservationId;
use forkfleet_shared::protocol::{
    BranchTask, Control, ControlCommand, ResumeReply, ResumeRequest, RESUME_SUBJECT,
};
use forkfleet_shared::spec::ForkPlan;
use forkfleet_shared::state::BranchState;
use forkfleet_shared::wire;
use std::time::Duration;
use tokio::sync::mpsc::UnboundedReceiver;

async fn reserve(fx: &Fixture, task: &BranchTask, attempt: u32, usd: f64) -> BudgetReply {
    reserve_traced(fx, task, attempt, usd, None).await
}

/// A budget request for `task`'s branch, sent with the trace context `trace`.
pub(super) async fn reserve_traced(
    fx: &Fixture,
    task: &BranchTask,
    attempt: u32,
    usd: f64,
    trace: Option<String>,
) -> BudgetReply {
    let req = BudgetRequest {
        fork_id: task.fork_id,
        run_id: task.run_id,
        attempt,
        estimate_usd: usd,
        estimate: Usage::default(),
        trace,
        settles: None,
        least_usd: None,
    };
    let bytes = within(
        fx.bus
            .request(BUDGET_SUBJECT, wire::encode(&req).unwrap(), T),
    )
    .await
    .unwrap();
    wire::decode(&bytes).unwrap()
}

fn granted(r: BudgetReply) -> ReservationId {
    match r {
        BudgetReply::Granted { reservation } => reservation,
        other => panic!("expected a grant, got {other:?}"),
    }
}

fn refused(r: BudgetReply) -> (BranchState, String) {
    match r {
        BudgetReply::Refused { state, reason } => (state, reason),
        other => panic!("expected a refusal, got {other:?}"),
    }
}

fn usage_event(cost: f64, reservation: Option<ReservationId>) -> Event {
    Event::Usage {
        model: MODEL.into(),
        usage: Usage {
            input_tokens: 10,
            output_tokens: 5,
            cached_tokens: 0,
            cache_write_tokens: 0,
            reasoning_tokens: 0,
        },
        cost_usd: cost,
        reservation,
        cached: false,
    }
}

fn capped(labels: &[&str], aggregate: Option<f64>, branch: Option<f64>) -> ForkPlan {
    let mut p = plan(labels);
    p.aggregate_budget_usd = aggregate;
    for b in &mut p.branches {
        b.budget_usd = branch;
    }
    p
}

/// The next control command sent to a branch.
async fn next_control(rx: &mut UnboundedReceiver<Bytes>) -> ControlCommand {
    let bytes = within(rx.recv()).await.expect("a control message");
    wire::decode::<Control>(&bytes).unwrap().command
}

/// Pull every task of a fork, held as a worker holds it (not acked), by branch index.
async fn pull_held(fx: &Fixture, n: usize) -> Vec<(BranchTask, forkfleet_bus::Delivery)> {
    let mut tasks = Vec::new();
    for _ in 0..n {
        tasks.push(fx.pull().await);
    }
    tasks.sort_by_key(|(t, _)| t.index);
    tasks
}

/// Pull every task of a fork (in pull order) and sort them by branch index.
async fn pull_all(fx: &Fixture, n: usize) -> Vec<BranchTask> {
    let mut tasks = Vec::new();
    for _ in 0..n {
        let (t, d) = fx.pull().await;
        d.ack().await.unwrap();
        tasks.push(t);
    }
    tasks.sort_by_key(|t| t.index);
    tasks
}

async fn running(fx: &Fixture, t: &BranchTask) {
    fx.publish(
        t.fork_id,
        t.run_id,
        t.first_seq,
        Event::Status {
            state: BranchState::Running,
            error: None,
        },
    )
    .await;
}

/// Wait (bounded) until the fork's cost report satisfies `done`, woken by the fork's change
/// counter (the ledger is updated before the counter moves).
async fn wait_cost(
    fx: &Fixture,
    fork: forkfleet_shared::ids::ForkId,
    done: impl Fn(&forkfleet_shared::budget::ForkCost) -> bool,
) -> forkfleet_shared::budget::ForkCost {
    let h = fx.h();
    within(async {
        let mut rx = h.changes(fork).await.unwrap();
        loop {
            let c = h.fork_cost(fork).await.unwrap();
            if done(&c) {
                return c;
            }
            rx.changed().await.unwrap();
        }
    })
    .await
}

/// Wait (bounded) until the fork holds no reservation. An expiry moves nothing a client
/// can wait on, so this looks again every few milliseconds.
async fn wait_released(fx: &Fixture, fork: forkfleet_shared::ids::ForkId) {
    let h = fx.h();
    within(async {
        while h.fork_cost(fork).await.unwrap().reserved_usd != 0.0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
}

#[tokio::test]
async fn strict_grants_until_the_fork_cap_then_stops_every_branch() {
    let fx = Fixture::start().await;
    let snap = fx.upload(&[("a.txt", "1\n")]).await;
    let view = fx
        .create(
            capped(&["a", "b", "c"], Some(1.0), None),
            ParentRun::New,
            snap,
        )
        .await;
    let tasks = pull_all(&fx, 3).await;
    assert!(
        tasks.iter().all(|t| t.reserve),
        "strict mode with a cap reserves"
    );
    let mut ctl_a = fx.bus.watch_control(tasks[0].run_id).await.unwrap();
    let mut ctl_b = fx.bus.watch_control(tasks[1].run_id).await.unwrap();
    for t in &tasks {
        running(&fx, t).await;
    }
    let ra = granted(reserve(&fx, &tasks[0], 1, 0.4).await);
    let _rb = granted(reserve(&fx, &tasks[1], 1, 0.4).await);
    let (state, reason) = refused(reserve(&fx, &tasks[2], 1, 0.4).await);
    assert_eq!(state, BranchState::AggregateBudgetExhausted);
    assert!(reason.contains("fork cap $1.000000"), "{reason}");
    // Everyone else under the cap is told to stop, as exhausted.
    for rx in [&mut ctl_a, &mut ctl_b] {
        match next_control(rx).await {
            ControlCommand::Stop { state, .. } => {
                assert_eq!(state, BranchState::AggregateBudgetExhausted)
            }
            other => panic!("expected a stop, got {other:?}"),
        }
    }
    let cost = fx.h().fork_cost(view.fork_id).await.unwrap();
    assert!((cost.reserved_usd - 0.8).abs() < 1e-9, "{cost:?}");
    assert!(cost.crossed_at_ms.is_some());
    assert!((cost.remaining_usd.unwrap() - 0.2).abs() < 1e-9);
    // The cap stays exhausted: even a call that would fit is refused.
    refused(reserve(&fx, &tasks[2], 1, 0.01).await);
    // Settling charges the actual cost and frees the rest of the reservation.
    let a = &tasks[0];
    fx.publish(
        a.fork_id,
        a.run_id,
        a.first_seq + 1,
        usage_event(0.3, Some(ra)),
    )
    .await;
    let cost = wait_cost(&fx, view.fork_id, |c| c.spent_usd > 0.0).await;
    assert!((cost.spent_usd - 0.3).abs() < 1e-9);
    assert!((cost.reserved_usd - 0.4).abs() < 1e-9, "{cost:?}");
    // A stopped branch holds nothing.
    let b = &tasks[1];
    fx.publish(
        b.fork_id,
        b.run_id,
        b.first_seq + 1,
        Event::Status {
            state: BranchState::AggregateBudgetExhausted,
            error: Some("stopped".into()),
        },
    )
    .await;
    let cost = wait_cost(&fx, view.fork_id, |c| c.reserved_usd == 0.0).await;
    assert!(cost.branches[1].stopped_at_ms.is_some());
    assert!(cost.spent_usd <= 1.0);
}

#[tokio::test]
async fn a_branch_cap_refuses_only_that_branch() {
    let fx = Fixture::start().await;
    let snap = fx.upload(&[("a.txt", "1\n")]).await;
    let view = fx
        .create(capped(&["a", "b"], None, Some(0.5)), ParentRun::New, snap)
        .await;
    let tasks = pull_all(&fx, 2).await;
    let (a, b) = (&tasks[0], &tasks[1]);
    running(&fx, a).await;
    running(&fx, b).await;
    let r = granted(reserve(&fx, a, 1, 0.3).await);
    fx.publish(
        a.fork_id,
        a.run_id,
        a.first_seq + 1,
        usage_event(0.3, Some(r)),
    )
    .await;
    wait_cost(&fx, view.fork_id, |c| c.spent_usd > 0.0).await;
    let (state, reason) = refused(reserve(&fx, a, 1, 0.3).await);
    assert_eq!(state, BranchState::BudgetExhausted);
    assert!(reason.contains("branch cap $0.500000"), "{reason}");
    // The other branch is not affected.
    granted(reserve(&fx, b, 1, 0.3).await);
    let cost = fx.h().fork_cost(view.fork_id).await.unwrap();
    assert_eq!(cost.crossed_at_ms, None);
    assert_eq!(cost.branches[0].remaining_usd, Some(0.2));
}

#[tokio::test]
async fn best_effort_stops_everything_once_usage_crosses_the_cap() {
    let fx = Fixture::start().await;
    let snap = fx.upload(&[("a.txt", "1\n")]).await;
    let mut p = capped(&["a", "b", "c"], Some(0.5), None);
    p.budget.mode = BudgetMode::BestEffort;
    let view = fx.create(p, ParentRun::New, snap).await;
    let tasks = pull_all(&fx, 3).await;
    assert!(
        tasks.iter().all(|t| !t.reserve),
        "best effort does not reserve"
    );
    let mut controls = Vec::new();
    for t in &tasks {
        controls.push(fx.bus.watch_control(t.run_id).await.unwrap());
        running(&fx, t).await;
    }
    let a = &tasks[0];
    fx.publish(a.fork_id, a.run_id, a.first_seq + 1, usage_event(0.3, None))
        .await;
    wait_cost(&fx, view.fork_id, |c| c.spent_usd > 0.0).await;
    let c = &tasks[2];
    fx.publish(c.fork_id, c.run_id, c.first_seq + 1, usage_event(0.3, None))
        .await;
    for rx in &mut controls {
        match next_control(rx).await {
            ControlCommand::Stop { state, reason, .. } => {
                assert_eq!(state, BranchState::AggregateBudgetExhausted);
                assert!(reason.contains("fork cap"), "{reason}");
            }
            other => panic!("expected a stop, got {other:?}"),
        }
    }
    let cost = fx.h().fork_cost(view.fork_id).await.unwrap();
    assert!(cost.crossed_at_ms.is_some());
    assert!((cost.spent_usd - 0.6).abs() < 1e-9);
}

#[tokio::test]
async fn a_paused_branch_resumes_after_a_top_up() {
    let fx = Fixture::start().await;
    let snap = fx.upload(&[("a.txt", "1\n")]).await;
    let mut p = capped(&["a", "b"], Some(0.5), None);
    p.budget.on_exhausted = OnExhausted::Pause;
    let view = fx.create(p, ParentRun::New, snap).await;
    let tasks = pull_all(&fx, 2).await;
    assert!(tasks.iter().all(|t| t.on_exhausted == OnExhausted::Pause));
    let (a, b) = (&tasks[0], &tasks[1]);
    let mut ctl_b = fx.bus.watch_control(b.run_id).await.unwrap();
    running(&fx, a).await;
    running(&fx, b).await;
    let r = granted(reserve(&fx, a, 1, 0.4).await);
    fx.publish(
        a.fork_id,
        a.run_id,
        a.first_seq + 1,
        usage_event(0.4, Some(r)),
    )
    .await;
    wait_cost(&fx, view.fork_id, |c| c.spent_usd > 0.0).await;
    refused(reserve(&fx, a, 1, 0.2).await);
    // The other branch is told to pause, not to stop.
    assert!(matches!(
        next_control(&mut ctl_b).await,
        ControlCommand::Pause { .. }
    ));
    for (t, seq) in [(a, a.first_seq + 2), (b, b.first_seq + 1)] {
        fx.publish(
            t.fork_id,
            t.run_id,
            seq,
            Event::Status {
                state: BranchState::Paused,
                error: Some("fork cap reached".into()),
            },
        )
        .await;
    }
    // Nothing runs: a wait for the fork answers (its branches are paused, not finished).
    let settled = within(fx.h().wait_settled(view.fork_id, T)).await.unwrap();
    assert!(settled
        .branches
        .iter()
        .all(|b| b.state == BranchState::Paused));
    assert_eq!(settled.state, forkfleet_shared::state::ForkState::Open);
    assert_eq!(fx.pending_tasks().await, 0);
    // Top up the fork: both branches are enqueued again, above every earlier attempt.
    let cost = fx.h().topup(view.fork_id, None, 1.0).await.unwrap();
    assert_eq!(cost.cap_usd, Some(1.5));
    let resumed = pull_held(&fx, 2).await;
    for (t, _) in &resumed {
        // Never taken over: the first attempt was 1, so the resumed task starts above it.
        assert_eq!(t.attempt_base, 1, "{t:?}");
    }
    // A resumed worker takes the branch over from its log, and may reserve again.
    let (t, d) = &resumed[0];
    let req = ResumeRequest {
        fork_id: t.fork_id,
        run_id: t.run_id,
        attempt: t.attempt_base + 1,
        task: Some(Fixture::proof(t, d, t.attempt_base + 1)),
    };
    let reply = within(
        fx.bus
            .request(RESUME_SUBJECT, wire::encode(&req).unwrap(), T),
    )
    .await
    .unwrap();
    let ResumeReply::Log { events } = wire::decode(&reply).unwrap() else {
        panic!("expected the log");
    };
    let next = events.last().unwrap().0 + 1;
    fx.publish_as(
        t.fork_id,
        t.run_id,
        next,
        Event::Status {
            state: BranchState::Running,
            error: None,
        },
        t.attempt_base + 1,
    )
    .await;
    granted(reserve(&fx, t, t.attempt_base + 1, 0.4).await);
    let v = wait_view(&fx.h(), view.fork_id, |v| {
        v.branches[0].state == BranchState::Running
    })
    .await;
    assert_eq!(v.branches[0].error, None);
}

#[tokio::test]
async fn terminating_a_paused_branch_ends_it_without_a_worker() {
    let fx = Fixture::start().await;
    let snap = fx.upload(&[("a.txt", "1\n")]).await;
    let mut p = capped(&["a"], None, Some(0.1));
    p.budget.on_exhausted = OnExhausted::Pause;
    let view = fx.create(p, ParentRun::New, snap).await;
    let tasks = pull_all(&fx, 1).await;
    let a = &tasks[0];
    running(&fx, a).await;
    fx.publish(
        a.fork_id,
        a.run_id,
        a.first_seq + 1,
        Event::Status {
            state: BranchState::Paused,
            error: Some("branch cap".into()),
        },
    )
    .await;
    wait_view(&fx.h(), view.fork_id, |v| {
        v.branches[0].state == BranchState::Paused
    })
    .await;
    let out = fx.h().terminate(view.fork_id, "a").await.unwrap();
    assert!(out.sent);
    let v = within(fx.h().wait_settled(view.fork_id, T)).await.unwrap();
    assert_eq!(v.branches[0].state, BranchState::Terminated);
    assert_eq!(v.state, forkfleet_shared::state::ForkState::Settled);
    // A branch with its own cap can be topped up; one without cannot; amounts are checked.
    let err = fx.h().topup(view.fork_id, None, 1.0).await.unwrap_err();
    assert!(err.to_string().contains("no aggregate cap"), "{err}");
    let err = fx
        .h()
        .topup(view.fork_id, Some("zz"), 1.0)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("valid labels: a"), "{err}");
    for bad in [0.0, -1.0, f64::NAN] {
        let err = fx
            .h()
            .topup(view.fork_id, Some("a"), bad)
            .await
            .unwrap_err();
        assert!(err.to_string().contains("more than zero"), "{err}");
        assert!(err.is_bad_input());
    }
    let cost = fx.h().topup(view.fork_id, Some("a"), 0.5).await.unwrap();
    assert_eq!(cost.branches[0].cap_usd, Some(0.6));
    assert_eq!(
        fx.pending_tasks().await,
        0,
        "a terminated branch is not resumed"
    );
}

#[tokio::test]
async fn budget_moves_between_branches() {
    let fx = Fixture::start().await;
    let snap = fx.upload(&[("a.txt", "1\n")]).await;
    let view = fx
        .create(capped(&["a", "b"], None, Some(1.0)), ParentRun::New, snap)
        .await;
    let tasks = pull_all(&fx, 2).await;
    let a = &tasks[0];
    running(&fx, a).await;
    granted(reserve(&fx, a, 1, 0.7).await);
    let err = fx
        .h()
        .move_budget(view.fork_id, "a", "b", 0.5)
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("can give at most $0.300000"),
        "{err}"
    );
    let cost = fx
        .h()
        .move_budget(view.fork_id, "a", "b", 0.25)
        .await
        .unwrap();
    assert_eq!(cost.branches[0].cap_usd, Some(0.75));
    assert_eq!(cost.branches[1].cap_usd, Some(1.25));
    let err = fx
        .h()
        .move_budget(view.fork_id, "a", "a", 0.1)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("two different branches"), "{err}");
}

#[tokio::test]
async fn an_account_cap_holds_across_forks() {
    let fx = Fixture::start().await;
    let snap = fx.upload(&[("a.txt", "1\n")]).await;
    let mut p = plan(&["a"]);
    p.budget.account = Some("team".into());
    // An account must exist before a fork charges it; nothing is created otherwise.
    let err = fx
        .h()
        .create_fork(forkfleet_shared::api::CreateFork {
            plan: p.clone(),
            parent: ParentRun::New,
            snapshot: snap,
            workspace: None,
            left_out: None,
            git: None,
        })
        .await
        .unwrap_err();
    assert!(err.to_string().contains("no account named `team`"), "{err}");
    assert!(fx.h().forks().await.unwrap().is_empty());
    let err = fx.h().account_set("../x", Some(1.0)).await.unwrap_err();
    assert!(err.to_string().contains("account name"), "{err}");
    let acct = fx.h().account_set("team", Some(1.0)).await.unwrap();
    assert_eq!(acct.cap_usd, Some(1.0));

    let f1 = fx.create(p.clone(), ParentRun::New, snap).await;
    let t1 = pull_all(&fx, 1).await.remove(0);
    assert!(t1.reserve, "a fork charging an account reserves");
    let f2 = fx.create(p, ParentRun::New, snap).await;
    let t2 = pull_all(&fx, 1).await.remove(0);
    let mut ctl1 = fx.bus.watch_control(t1.run_id).await.unwrap();
    running(&fx, &t1).await;
    running(&fx, &t2).await;
    let r = granted(reserve(&fx, &t1, 1, 0.6).await);
    fx.publish(
        t1.fork_id,
        t1.run_id,
        t1.first_seq + 1,
        usage_event(0.6, Some(r)),
    )
    .await;
    wait_cost(&fx, f1.fork_id, |c| c.spent_usd > 0.0).await;
    let (state, reason) = refused(reserve(&fx, &t2, 1, 0.5).await);
    assert_eq!(state, BranchState::AggregateBudgetExhausted);
    assert!(reason.contains("account `team`"), "{reason}");
    // The other fork's branch under the same account is stopped too.
    assert!(matches!(
        next_control(&mut ctl1).await,
        ControlCommand::Stop { .. }
    ));
    let accounts = fx.h().accounts().await.unwrap();
    assert_eq!(accounts.len(), 1);
    assert_eq!(accounts[0].forks, 2);
    assert!((accounts[0].spent_usd - 0.6).abs() < 1e-9);
    let cost = fx.h().fork_cost(f2.fork_id).await.unwrap();
    assert_eq!(cost.account.as_ref().unwrap().name, "team");
    // Raising the cap lets calls through again.
    fx.h().account_set("team", Some(2.0)).await.unwrap();
    granted(reserve(&fx, &t2, 1, 0.5).await);
}

#[tokio::test]
async fn reservations_never_leak() {
    let cfg = CoordinatorConfig {
        reservation_ttl_ms: 300,
        ..CoordinatorConfig::default()
    };
    let fx = Fixture::start_full(LocalBusConfig::default(), cfg).await;
    let snap = fx.upload(&[("a.txt", "1\n")]).await;
    let view = fx
        .create(capped(&["a", "b"], Some(10.0), None), ParentRun::New, snap)
        .await;
    let tasks = pull_held(&fx, 2).await;
    let ((a, a_held), (b, _)) = (&tasks[0], &tasks[1]);
    running(&fx, a).await;
    running(&fx, b).await;
    // Taken over by a later attempt: the earlier attempt's reservation stays held (its
    // worker may only be paused, ADR 18) until it settles or expires.
    granted(reserve(&fx, a, 1, 1.0).await);
    let req = ResumeRequest {
        fork_id: a.fork_id,
        run_id: a.run_id,
        attempt: 2,
        task: Some(Fixture::proof(a, a_held, 2)),
    };
    within(
        fx.bus
            .request(RESUME_SUBJECT, wire::encode(&req).unwrap(), T),
    )
    .await
    .unwrap();
    let cost = fx.h().fork_cost(view.fork_id).await.unwrap();
    assert_eq!(
        cost.branches[0].reserved_usd, 1.0,
        "still held after the takeover"
    );
    // The fenced-off attempt can no longer reserve: it is told it was superseded.
    assert!(matches!(
        reserve(&fx, a, 1, 1.0).await,
        BudgetReply::Superseded { by: 2 }
    ));
    // Never settled: it expires.
    granted(reserve(&fx, b, 1, 2.0).await);
    wait_released(&fx, view.fork_id).await;
    assert_eq!(fx.h().fork_cost(view.fork_id).await.unwrap().spent_usd, 0.0);
    // Unknown runs are gone, not granted.
    let mut ghost = a.clone();
    ghost.run_id = forkfleet_shared::ids::RunId::new();
    assert!(matches!(
        reserve(&fx, &ghost, 1, 1.0).await,
        BudgetReply::Gone { .. }
    ));
}

#[tokio::test]
async fn a_reservation_is_held_across_a_restart() {
    // The default ttl (minutes): nothing expires while the coordinator restarts.
    let mut fx = Fixture::start().await;
    let snap = fx.upload(&[("a.txt", "1\n")]).await;
    let view = fx
        .create(capped(&["a"], Some(10.0), None), ParentRun::New, snap)
        .await;
    let a = pull_all(&fx, 1).await.remove(0);
    running(&fx, &a).await;
    granted(reserve(&fx, &a, 1, 3.0).await);
    fx.restart().await;
    let cost = fx.h().fork_cost(view.fork_id).await.unwrap();
    assert!((cost.reserved_usd - 3.0).abs() < 1e-9, "{cost:?}");
    // And it still counts against the cap.
    let (state, _) = refused(reserve(&fx, &a, 1, 7.5).await);
    assert_eq!(state, BranchState::AggregateBudgetExhausted);
}

#[tokio::test]
async fn a_paused_branch_is_enqueued_once_however_often_its_cap_is_raised() {
    let fx = Fixture::start().await;
    let snap = fx.upload(&[("a.txt", "1\n")]).await;
    let mut p = capped(&["a"], None, Some(0.1));
    p.budget.on_exhausted = OnExhausted::Pause;
    let view = fx.create(p, ParentRun::New, snap).await;
    let (a, a_held) = pull_held(&fx, 1).await.remove(0);
    running(&fx, &a).await;
    // Applied before the takeover below fences attempt 1 off (else the `running` event
    // is dropped and the `paused` one waits for it forever).
    wait_view(&fx.h(), view.fork_id, |v| {
        v.branches[0].state == BranchState::Running
    })
    .await;
    // Taken over by attempt 3 before it paused: a resumed task starts above that.
    let req = ResumeRequest {
        fork_id: a.fork_id,
        run_id: a.run_id,
        attempt: 3,
        task: Some(Fixture::proof(&a, &a_held, 3)),
    };
    within(
        fx.bus
            .request(RESUME_SUBJECT, wire::encode(&req).unwrap(), T),
    )
    .await
    .unwrap();
    refused(reserve(&fx, &a, 3, 0.2).await);
    fx.publish_as(
        a.fork_id,
        a.run_id,
        a.first_seq + 1,
        Event::Status {
            state: BranchState::Paused,
            error: Some("branch cap".into()),
        },
        3,
    )
    .await;
    // A paused worker hands its task back as done.
    a_held.ack().await.unwrap();
    wait_view(&fx.h(), view.fork_id, |v| {
        v.branches[0].state == BranchState::Paused
    })
    .await;
    fx.h().topup(view.fork_id, Some("a"), 1.0).await.unwrap();
    fx.h().topup(view.fork_id, Some("a"), 1.0).await.unwrap();
    assert_eq!(fx.pending_tasks().await, 1, "one task, not one per top-up");
    let t = pull_all(&fx, 1).await.remove(0);
    assert_eq!(t.attempt_base, 3);
    // The task carries the cap as it was enqueued; the ledger has the latest.
    assert_eq!(t.budget_usd, Some(1.1));
    let cost = fx.h().fork_cost(view.fork_id).await.unwrap();
    assert!((cost.branches[0].cap_usd.unwrap() - 2.1).abs() < 1e-9);
}

/// `fork cost` reports each branch's tokens, its prompt-cache reads and writes, and what
/// the cache saved at its model's price; every task names the fork tree's root (the
/// providers' cache family).
#[tokio::test]
async fn fork_cost_reports_cache_tokens_and_savings() {
    let fx = Fixture::start().await;
    let snap = fx.upload(&[("a.txt", "1\n")]).await;
    let mut p = plan(&["a", "b"]);
    // Anthropic's rates: reads at 0.1x, writes at 1.25x.
    p.models.get_mut(MODEL).unwrap().price = Some(forkfleet_shared::pricing::Price {
        input_per_mtok: 4.0,
        output_per_mtok: 20.0,
        cached_per_mtok: Some(0.4),
        cache_write_per_mtok: Some(5.0),
    });
    p.budget.mode = BudgetMode::BestEffort;
    let view = fx.create(p, ParentRun::New, snap).await;
    let tasks = pull_all(&fx, 2).await;
    assert_eq!(tasks[0].fork_root, Some(view.parent_run));
    assert_eq!(tasks[0].fork_root, tasks[1].fork_root);
    for t in &tasks {
        running(&fx, t).await;
    }
    // Branch a writes the shared prefix (1,000 tokens); b reads it.
    let usage = |cached: u64, written: u64| Event::Usage {
        model: MODEL.into(),
        usage: Usage {
            cached_tokens: cached,
            cache_write_tokens: written,
            ..Usage::tokens(1_100, 50)
        },
        cost_usd: 0.001,
        reservation: None,
        cached: false,
    };
    let (a, b) = (&tasks[0], &tasks[1]);
    fx.publish(a.fork_id, a.run_id, a.first_seq + 1, usage(0, 1_000))
        .await;
    fx.publish(b.fork_id, b.run_id, b.first_seq + 1, usage(1_000, 0))
        .await;
    let cost = wait_cost(&fx, view.fork_id, |c| c.usage.input_tokens == 2_200).await;
    let by = |label: &str| cost.branches.iter().find(|x| x.label == label).unwrap();
    assert_eq!(by("a").usage.cache_write_tokens, 1_000);
    assert_eq!(by("b").usage.cached_tokens, 1_000);
    // a: 1,000 written at $1 over the input price; b: 1,000 read at $3.60 under it.
    assert!((by("a").cache_saved_usd + 1_000.0 * 1.0 / 1e6).abs() < 1e-12);
    assert!((by("b").cache_saved_usd - 1_000.0 * 3.6 / 1e6).abs() < 1e-12);
    assert!((cost.cache_saved_usd - 2_600.0 / 1e6).abs() < 1e-12);
    assert_eq!(cost.usage.cached_tokens, 1_000);
    assert_eq!(cost.usage.output_tokens, 100);
}
