//! Budgets on the worker side: strict reservations before every model call, refusals that
//! stop or pause a branch, stop/pause/terminate commands that cancel a call in flight, and
//! task attempts above the delivery count. The test plays the coordinator by serving
//! `coord.budget` (and `coord.resume`) on the bus.

use super::common::*;
use forkfleet_shared::budget::{
    estimate_cost, BudgetReply, BudgetRequest, OnExhausted, BUDGET_SUBJECT,
};
use forkfleet_shared::event::{messages_from_events, Event};
use forkfleet_shared::ids::{ReservationId, RunId};
use forkfleet_shared::pricing::Price;
use forkfleet_shared::protocol::{BranchEvent, BranchTask, Control, ControlCommand};
use forkfleet_shared::state::BranchState;
use forkfleet_shared::wire;
use forkfleet_worker::provider::{estimate_tokens, message_chars};
use forkfleet_worker::COORDINATOR_TRIES;
use tokio::sync::{mpsc, oneshot};

const PRICE: Price = Price {
    input_per_mtok: 1.0,
    output_per_mtok: 2.0,
    cached_per_mtok: Some(0.5),
    cache_write_per_mtok: None,
};

/// Three calls: scripted usage (with cached tokens), usage estimated from sizes, and
/// scripted usage again.
const THREE_CALLS: &str = r#"
[[turns."*"]]
tool_calls = [{ name = "write_file", args = { path = "a.txt", content = "x" } }]
usage = { input_tokens = 1000, output_tokens = 200, cached_tokens = 500 }

[[turns."*"]]
tool_calls = [{ name = "write_file", args = { path = "b.txt", content = "y" } }]

[[turns."*"]]
text = "done"
usage = { input_tokens = 3000, output_tokens = 10 }
"#;

/// A quick first call, then one that would take ten minutes.
const SLOW_SECOND_CALL: &str = r#"
[[turns."*"]]
tool_calls = [{ name = "write_file", args = { path = "a.txt", content = "x" } }]
usage = { input_tokens = 100, output_tokens = 10 }

[[turns."*"]]
text = "too slow"
latency_ms = 600000
"#;

/// A strict-mode task: reserve before every call, priced.
fn strict(fx: &Fixture, label: &str, script: &str) -> BranchTask {
    let (_, snap) = fx.snapshot(&[]);
    let mut task = fx.task(label, 0, snap, fx.script(script));
    task.price = Some(PRICE);
    task.reserve = true;
    task
}

/// One request the test coordinator answered, and its answer (sent after the answer is).
type Answered = (BudgetRequest, BudgetReply);

/// Serve `coord.budget` as a coordinator would, answering with `decide`; every answered
/// request comes out of the returned channel once its answer is sent.
async fn serve_budget(
    fx: &Fixture,
    decide: impl FnMut(&BudgetRequest) -> BudgetReply + Send + 'static,
) -> mpsc::UnboundedReceiver<Answered> {
    serve_budget_with(fx, decide, None).await
}

/// A budget request the test coordinator holds back: `asked` fires when it arrives, and
/// it is answered once `release` is sent.
struct Held {
    asked: oneshot::Receiver<()>,
    release: oneshot::Sender<()>,
}

impl Held {
    /// Wait until the held request has arrived.
    async fn arrived(&mut self) {
        tokio::time::timeout(WAIT, &mut self.asked)
            .await
            .expect("the held budget request did not come within the wait")
            .expect("budget service stopped");
    }
}

/// [`serve_budget`] granting every request, the answer to the `nth` (from 1) held back
/// until the test releases it.
async fn serve_budget_holding(
    fx: &Fixture,
    nth: usize,
) -> (mpsc::UnboundedReceiver<Answered>, Held) {
    let (asked_tx, asked) = oneshot::channel();
    let (release, release_rx) = oneshot::channel();
    let answered = serve_budget_with(fx, grant, Some((nth, asked_tx, release_rx))).await;
    (answered, Held { asked, release })
}

/// [`serve_budget`]; with `hold = Some((n, arrived, release))` the answer to request `n`
/// (from 1) is held back: `arrived` is sent when that request comes, and it is answered
/// once `release` fires.
async fn serve_budget_with(
    fx: &Fixture,
    mut decide: impl FnMut(&BudgetRequest) -> BudgetReply + Send + 'static,
    mut hold: Option<(usize, oneshot::Sender<()>, oneshot::Receiver<()>)>,
) -> mpsc::UnboundedReceiver<Answered> {
    let mut rx = fx.bus.serve(BUDGET_SUBJECT).await.unwrap();
    let (tx, answered) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut n = 0;
        while let Some(req) = rx.recv().await {
            n += 1;
            let asked: BudgetRequest = wire::decode(&req.payload).unwrap();
            let reply = decide(&asked);
            if hold.as_ref().is_some_and(|(nth, ..)| *nth == n) {
                if let Some((_, arrived, release)) = hold.take() {
                    let _ = arrived.send(());
                    let _ = release.await;
                }
            }
            req.respond(wire::encode(&reply).unwrap()).await.unwrap();
            let _ = tx.send((asked, reply));
        }
    });
    answered
}

fn grant(_: &BudgetRequest) -> BudgetReply {
    BudgetReply::Granted {
        reservation: ReservationId::new(),
    }
}

async fn next_answer(answered: &mut mpsc::UnboundedReceiver<Answered>) -> Answered {
    tokio::time::timeout(WAIT, answered.recv())
        .await
        .expect("no budget request within the wait")
        .expect("budget service stopped")
}

/// Everything answered so far (call once the worker has stopped).
fn drain(answered: &mut mpsc::UnboundedReceiver<Answered>) -> Vec<Answered> {
    let mut all = Vec::new();
    while let Ok(a) = answered.try_recv() {
        all.push(a);
    }
    all
}

fn reservations(events: &Events, run: RunId) -> Vec<Option<ReservationId>> {
    events
        .of(run)
        .into_iter()
        .filter_map(|e| match e {
            Event::Usage { reservation, .. } => Some(reservation),
            _ => None,
        })
        .collect()
}

fn granted_id(reply: &BudgetReply) -> ReservationId {
    match reply {
        BudgetReply::Granted { reservation } => *reservation,
        other => panic!("not a grant: {other:?}"),
    }
}

#[tokio::test]
async fn every_call_is_made_under_its_own_reservation() {
    let fx = Fixture::new().await;
    let mut task = strict(&fx, "granted", THREE_CALLS);
    // A branch cap the local check would stop at before the first call: in strict mode the
    // coordinator's ledger decides, not the worker.
    task.budget_usd = Some(0.0);
    let mut answered = serve_budget(&fx, grant).await;
    fx.enqueue(&task).await;
    let mut events = fx.events().await;
    let worker = start(&fx, config(1)).await;
    events.until_terminal(&[task.run_id]).await;
    shutdown(worker).await;
    settle(&fx, &mut events).await;

    assert_eq!(
        events.terminal(task.run_id),
        Some((BranchState::Done, None))
    );
    let answers = drain(&mut answered);
    assert_eq!(answers.len(), 3, "one reservation per call: {answers:?}");
    for (req, _) in &answers {
        assert_eq!(
            (req.fork_id, req.run_id, req.attempt),
            (task.fork_id, task.run_id, 1)
        );
        // The estimate is priced by the budget's rule (cached input only as the estimate
        // says, ADR 26).
        assert!((req.estimate_usd - estimate_cost(&PRICE, &req.estimate)).abs() < 1e-15);
    }
    // Each usage event names the reservation granted for its call, in order.
    let granted: Vec<Option<ReservationId>> =
        answers.iter().map(|(_, r)| Some(granted_id(r))).collect();
    assert_eq!(reservations(&events, task.run_id), granted);

    // The scripted model's estimate is exactly the usage it reported, call by call; the
    // size-estimated call's input was measured over the history the model saw.
    let log = events.of(task.run_id);
    let mut seen = fx.initial_log(&task);
    let mut usages = Vec::new();
    for e in &log {
        if let Event::Usage {
            usage, cost_usd, ..
        } = e
        {
            assert!((cost_usd - PRICE.cost(usage)).abs() < 1e-15);
            if usages.len() == 1 {
                let chars = message_chars(&messages_from_events(&seen));
                assert_eq!(usage.input_tokens, estimate_tokens(chars));
            }
            usages.push(*usage);
        }
        seen.push(e.clone());
    }
    let estimates: Vec<_> = answers.iter().map(|(r, _)| r.estimate).collect();
    assert_eq!(usages, estimates);
    assert_eq!(usages[0].cached_tokens, 500);
    // The scripted model knows its cached input exactly, so the reservation is the call's
    // cost (a real provider counts only a prefix its API confirmed cached, ADR 26).
    assert!((answers[0].0.estimate_usd - PRICE.cost(&usages[0])).abs() < 1e-15);
    assert_eq!(fx.pending().await, 0);
}

#[tokio::test]
async fn a_refused_reservation_stops_the_branch_before_the_call() {
    let fx = Fixture::new().await;
    let own = strict(&fx, "own", THREE_CALLS);
    let fork = strict(&fx, "fork", THREE_CALLS);
    let (own_run, fork_run) = (own.run_id, fork.run_id);
    // Each branch is granted its first call; its second is refused, by its own cap or by
    // the fork's.
    let mut calls = std::collections::HashMap::<RunId, u32>::new();
    let mut answered = serve_budget(&fx, move |req| {
        let n = calls.entry(req.run_id).or_default();
        *n += 1;
        match (*n, req.run_id == own_run) {
            (1, _) => grant(req),
            (_, true) => BudgetReply::Refused {
                state: BranchState::BudgetExhausted,
                reason: "branch cap of $0.001 reached".into(),
            },
            (_, false) => BudgetReply::Refused {
                state: BranchState::AggregateBudgetExhausted,
                reason: "fork cap of $0.002 reached".into(),
            },
        }
    })
    .await;
    fx.enqueue(&own).await;
    fx.enqueue(&fork).await;
    let mut events = fx.events().await;
    let worker = start(&fx, config(2)).await;
    events.until_terminal(&[own_run, fork_run]).await;
    shutdown(worker).await;
    settle(&fx, &mut events).await;

    assert_eq!(
        events.terminal(own_run),
        Some((
            BranchState::BudgetExhausted,
            Some("branch cap of $0.001 reached".into())
        ))
    );
    assert_eq!(
        events.terminal(fork_run),
        Some((
            BranchState::AggregateBudgetExhausted,
            Some("fork cap of $0.002 reached".into())
        ))
    );
    let answers = drain(&mut answered);
    for run in [own_run, fork_run] {
        let mine: Vec<&Answered> = answers.iter().filter(|(r, _)| r.run_id == run).collect();
        assert_eq!(mine.len(), 2, "a refusal is final: {mine:?}");
        // The refused call was never made: one usage, one response, then the status.
        assert_eq!(
            reservations(&events, run),
            vec![Some(granted_id(&mine[0].1))]
        );
        assert_eq!(events.count(run, "model_response"), 1);
        let published = &events.by_run[&run];
        assert_eq!(published.last().unwrap().event.kind(), "status");
        // Its work is kept.
        assert_eq!(events.count(run, "file_change"), 1);
    }
    assert_eq!(fx.pending().await, 0);
}

#[tokio::test]
async fn a_refusal_pauses_a_pausing_branch_and_a_new_task_resumes_it() {
    let fx = Fixture::new().await;
    let mut task = strict(&fx, "pausing", THREE_CALLS);
    task.on_exhausted = OnExhausted::Pause;
    // Attempt 1 is granted one call, then refused; a later attempt (after the top-up) is
    // granted everything.
    let mut first_attempt_calls = 0;
    let mut answered = serve_budget(&fx, move |req| {
        if req.attempt > 1 {
            return grant(req);
        }
        first_attempt_calls += 1;
        if first_attempt_calls == 1 {
            grant(req)
        } else {
            BudgetReply::Refused {
                state: BranchState::AggregateBudgetExhausted,
                reason: "account cap reached".into(),
            }
        }
    })
    .await;
    fx.enqueue(&task).await;
    let mut events = fx.events().await;
    let worker = start(&fx, config(1)).await;
    events
        .until(|e| is_status(e, task.run_id, BranchState::Paused))
        .await;
    shutdown(worker).await;
    settle(&fx, &mut events).await;

    // Paused is the attempt's last event, with the reason; the task was acked, not handed
    // back.
    let published = events.by_run[&task.run_id].clone();
    assert!(
        matches!(
            &published.last().unwrap().event,
            Event::Status { state: BranchState::Paused, error: Some(r) } if r == "account cap reached"
        ),
        "{:?}",
        published.last()
    );
    assert_eq!(events.terminal(task.run_id), None);
    assert_eq!(events.count(task.run_id, "usage"), 1);
    assert_eq!(fx.pending().await, 0, "a paused branch's task is acked");
    assert_eq!(drain(&mut answered).len(), 2);

    // The top-up: the coordinator enqueues the branch again above every attempt it saw,
    // and hands over the log it applied.
    let seen: Vec<(u64, Event)> = published.iter().map(|e| (e.seq, e.event.clone())).collect();
    let last_seq = seen.last().unwrap().0;
    let resume = fx.serve_resume(&task, seen).await;
    let mut again = task.clone();
    again.attempt_base = 1;
    fx.enqueue(&again).await;
    let worker = start(&fx, config(1)).await;
    events.until_terminal(&[task.run_id]).await;
    shutdown(worker).await;

    let asked = tokio::time::timeout(WAIT, resume).await.unwrap().unwrap();
    assert_eq!((asked.run_id, asked.attempt), (task.run_id, 2));
    assert_eq!(
        events.terminal(task.run_id),
        Some((BranchState::Done, None))
    );
    let second: Vec<&BranchEvent> = events.by_run[&task.run_id]
        .iter()
        .filter(|e| e.attempt == 2)
        .collect();
    assert_eq!(second[0].seq, last_seq + 1, "seqs go on after the pause");
    assert!(is_status(second[0], task.run_id, BranchState::Running));
    // The refused call is made now, once: three calls in all, each reserved.
    assert_eq!(events.count(task.run_id, "model_response"), 3);
    let answers = drain(&mut answered);
    assert_eq!(answers.len(), 2);
    assert!(answers.iter().all(|(r, _)| r.attempt == 2));
    assert_eq!(fx.pending().await, 0);
}

#[tokio::test]
async fn a_branch_cap_pauses_a_pausing_branch_without_reservations() {
    let fx = Fixture::new().await;
    let (_, snap) = fx.snapshot(&[]);
    let script = fx.script(
        r#"
[defaults]
usage = { input_tokens = 1000000, output_tokens = 0 }

[[turns."*"]]
tool_calls = [{ name = "list_files" }]
repeat = 10

[[turns."*"]]
text = "done"
"#,
    );
    let mut task = fx.task("capped", 0, snap, script);
    // $1 per call; a $1.50 cap allows two calls.
    task.price = Some(PRICE);
    task.budget_usd = Some(1.5);
    task.on_exhausted = OnExhausted::Pause;
    fx.enqueue(&task).await;
    let mut events = fx.events().await;
    let worker = start(&fx, config(1)).await;
    events
        .until(|e| is_status(e, task.run_id, BranchState::Paused))
        .await;
    shutdown(worker).await;
    settle(&fx, &mut events).await;

    assert_eq!(events.count(task.run_id, "usage"), 2);
    assert_eq!(reservations(&events, task.run_id), vec![None, None]);
    let last = &events.by_run[&task.run_id].last().unwrap().event;
    assert!(
        matches!(last, Event::Status { state: BranchState::Paused, error: Some(r) } if r.contains("budget")),
        "{last:?}"
    );
    assert_eq!(fx.pending().await, 0);
}

/// Run a branch whose second call is slow, send `command` once that call is under way
/// (its reservation granted), and wait for the branch to stop; returns the events and the
/// answered reservations.
async fn command_during_the_call(
    command: ControlCommand,
    stops_as: BranchState,
) -> (Fixture, Events, BranchTask, Vec<Answered>) {
    let fx = Fixture::new().await;
    let task = strict(&fx, "slow", SLOW_SECOND_CALL);
    let mut answered = serve_budget(&fx, grant).await;
    fx.enqueue(&task).await;
    let mut events = fx.events().await;
    let worker = start(&fx, config(1)).await;
    let first = next_answer(&mut answered).await;
    let second = next_answer(&mut answered).await;
    // The second call (ten minutes long) starts right after its grant.
    fx.send(task.run_id, command).await;
    events.until(|e| is_status(e, task.run_id, stops_as)).await;
    // Stopped at once: the node has nothing left to wait for.
    shutdown(worker).await;
    settle(&fx, &mut events).await;
    let mut all = vec![first, second];
    all.extend(drain(&mut answered));
    (fx, events, task, all)
}

/// The cancelled call published nothing: one usage (the first call's), the status last.
fn assert_cancelled(events: &Events, task: &BranchTask, answers: &[Answered]) {
    assert_eq!(answers.len(), 2, "{answers:?}");
    assert_eq!(
        reservations(events, task.run_id),
        vec![Some(granted_id(&answers[0].1))]
    );
    assert_eq!(events.count(task.run_id, "model_response"), 1);
    assert_eq!(events.count(task.run_id, "file_change"), 1, "work kept");
    let published = &events.by_run[&task.run_id];
    assert_eq!(published.last().unwrap().event.kind(), "status");
    for (i, e) in published.iter().enumerate() {
        assert_eq!(e.seq, task.first_seq + i as u64);
    }
}

#[tokio::test]
async fn a_stop_cancels_the_call_in_flight() {
    let (fx, events, task, answers) = command_during_the_call(
        ControlCommand::Stop {
            state: BranchState::AggregateBudgetExhausted,
            reason: "fork cap crossed".into(),
            graceful: false,
        },
        BranchState::AggregateBudgetExhausted,
    )
    .await;
    assert_eq!(
        events.terminal(task.run_id),
        Some((
            BranchState::AggregateBudgetExhausted,
            Some("fork cap crossed".into())
        ))
    );
    assert_cancelled(&events, &task, &answers);
    assert_eq!(fx.pending().await, 0);
}

#[tokio::test]
async fn a_terminate_cancels_the_call_in_flight() {
    let (fx, events, task, answers) = command_during_the_call(
        ControlCommand::Terminate {
            reason: "user asked".into(),
        },
        BranchState::Terminated,
    )
    .await;
    assert_eq!(
        events.terminal(task.run_id),
        Some((BranchState::Terminated, Some("user asked".into())))
    );
    assert_cancelled(&events, &task, &answers);
    assert_eq!(fx.pending().await, 0);
}

#[tokio::test]
async fn a_pause_cancels_the_call_in_flight() {
    let (fx, events, task, answers) = command_during_the_call(
        ControlCommand::Pause {
            reason: "fork cap crossed; paused".into(),
            graceful: false,
        },
        BranchState::Paused,
    )
    .await;
    assert_eq!(events.terminal(task.run_id), None);
    let last = &events.by_run[&task.run_id].last().unwrap().event;
    assert_eq!(
        last,
        &Event::Status {
            state: BranchState::Paused,
            error: Some("fork cap crossed; paused".into())
        }
    );
    assert_cancelled(&events, &task, &answers);
    assert_eq!(fx.pending().await, 0, "a paused branch's task is acked");
}

#[tokio::test]
async fn steers_sent_during_a_turn_are_applied_before_the_next_call() {
    let fx = Fixture::new().await;
    let task = strict(
        &fx,
        "steered",
        r#"
[[turns."*"]]
tool_calls = [{ name = "write_file", args = { path = "a.txt", content = "x" } }]

[[turns."*"]]
tool_calls = [{ name = "write_file", args = { path = "b.txt", content = "y" } }]

[[turns."*"]]
text = "done"
"#,
    );
    let (mut answered, mut held) = serve_budget_holding(&fx, 2).await;
    fx.enqueue(&task).await;
    let mut events = fx.events().await;
    let worker = start(&fx, config(1)).await;
    next_answer(&mut answered).await;
    // The second call's turn is under way (its reservation waits) while the steers are
    // sent; only then is it granted.
    held.arrived().await;
    for text in ["first steer", "second steer"] {
        fx.send(task.run_id, ControlCommand::Steer { text: text.into() })
            .await;
    }
    held.release.send(()).unwrap();
    next_answer(&mut answered).await;
    events.until_terminal(&[task.run_id]).await;
    shutdown(worker).await;

    assert_eq!(
        events.terminal(task.run_id),
        Some((BranchState::Done, None))
    );
    let log = events.of(task.run_id);
    let kinds: Vec<&str> = log.iter().map(|e| e.kind()).collect();
    let steers: Vec<(usize, &str)> = log
        .iter()
        .enumerate()
        .filter_map(|(i, e)| match e {
            Event::Steer { text } => Some((i, text.as_str())),
            _ => None,
        })
        .collect();
    assert_eq!(
        steers.iter().map(|s| s.1).collect::<Vec<_>>(),
        ["first steer", "second steer"],
        "both applied, in order"
    );
    // After the second call's response and before the third call.
    let responses: Vec<usize> = kinds
        .iter()
        .enumerate()
        .filter(|(_, k)| **k == "model_response")
        .map(|(i, _)| i)
        .collect();
    assert_eq!(responses.len(), 3);
    assert!(steers[0].0 > responses[1] && steers[1].0 < responses[2]);
    // The third call's reservation was estimated over the history holding them.
    let third = &drain(&mut answered)[0].0;
    let before_third = log.iter().rposition(|e| e.kind() == "usage").unwrap();
    let mut seen = fx.initial_log(&task);
    seen.extend(log[..before_third].iter().cloned());
    assert_eq!(
        third.estimate.input_tokens,
        estimate_tokens(message_chars(&messages_from_events(&seen)))
    );
}

#[tokio::test]
async fn a_steer_sent_during_the_last_call_starts_one_more_turn() {
    let fx = Fixture::new().await;
    // One answer with no tool call: the call that would end the branch.
    let task = strict(
        &fx,
        "last",
        r#"
[[turns."*"]]
text = "all done"

[[turns."*"]]
text = "steered too"
"#,
    );
    let (mut answered, mut held) = serve_budget_holding(&fx, 1).await;
    fx.enqueue(&task).await;
    let mut events = fx.events().await;
    let worker = start(&fx, config(1)).await;
    // The steer comes while the (last) call's turn is under way. On NATS a control message
    // is stored, then pushed to each watcher: the call is released once a watcher of the
    // test's own has it, so that the worker's has it too by then (not a later push racing
    // the call's answer, which this test is not about). The local bus hands it over at once
    // (and has one watcher per run: a second would take the worker's).
    let mut watcher = match fx.local() {
        None => Some(fx.bus.watch_control(task.run_id).await.unwrap()),
        Some(_) => None,
    };
    held.arrived().await;
    fx.send(
        task.run_id,
        ControlCommand::Steer {
            text: "one more thing".into(),
        },
    )
    .await;
    if let Some(watcher) = watcher.as_mut() {
        tokio::time::timeout(std::time::Duration::from_secs(30), watcher.recv())
            .await
            .expect("the steer is delivered within 30 s")
            .expect("the control stream is open");
    }
    held.release.send(()).unwrap();
    next_answer(&mut answered).await;
    events.until_terminal(&[task.run_id]).await;
    shutdown(worker).await;

    assert_eq!(
        events.terminal(task.run_id),
        Some((BranchState::Done, None))
    );
    let log = events.of(task.run_id);
    let kinds: Vec<&str> = log.iter().map(|e| e.kind()).collect();
    let steer = kinds
        .iter()
        .position(|k| *k == "steer")
        .expect("the steer is recorded");
    let responses: Vec<usize> = kinds
        .iter()
        .enumerate()
        .filter(|(_, k)| **k == "model_response")
        .map(|(i, _)| i)
        .collect();
    // Applied after the answer that would have ended the branch, before one more call.
    assert_eq!(responses.len(), 2, "{kinds:?}");
    assert!(responses[0] < steer && steer < responses[1], "{kinds:?}");
}

#[tokio::test]
async fn a_gone_reply_drops_the_task_silently() {
    let fx = Fixture::new().await;
    let task = strict(&fx, "orphan", THREE_CALLS);
    let mut n = 0;
    let mut answered = serve_budget(&fx, move |req| {
        n += 1;
        if n == 1 {
            grant(req)
        } else {
            BudgetReply::Gone {
                reason: "the fork was deleted".into(),
            }
        }
    })
    .await;
    fx.enqueue(&task).await;
    let mut events = fx.events().await;
    let worker = start(&fx, config(1)).await;
    next_answer(&mut answered).await;
    let (_, gone) = next_answer(&mut answered).await;
    assert!(matches!(gone, BudgetReply::Gone { .. }));
    // The agent is handling the answer; shutdown lets it finish that step.
    shutdown(worker).await;
    settle(&fx, &mut events).await;

    // The first call's events and nothing after: no status, no second call.
    let log = events.of(task.run_id);
    let kinds: Vec<&str> = log.iter().map(|e| e.kind()).collect();
    assert_eq!(
        kinds,
        [
            "status",
            "usage",
            "model_response",
            "file_change",
            "tool_result"
        ]
    );
    assert!(drain(&mut answered).is_empty());
    assert_eq!(fx.pending().await, 0, "dropped, not handed back");
}

#[tokio::test]
async fn a_budget_service_that_keeps_failing_hands_the_task_back() {
    let fx = Fixture::new().await;
    let task = strict(&fx, "retried", THREE_CALLS);
    // Attempt 1: the coordinator cannot decide, every time. Attempt 2: granted.
    let mut answered = serve_budget(&fx, |req| {
        if req.attempt == 1 {
            BudgetReply::Retry {
                reason: "store busy".into(),
            }
        } else {
            grant(req)
        }
    })
    .await;
    fx.enqueue(&task).await;
    let mut events = fx.events().await;
    // The second attempt takes the branch over from the coordinator's log.
    let resume = fx.serve_resume(&task, Vec::new()).await;
    let worker = start(&fx, config(1)).await;
    events.until_terminal(&[task.run_id]).await;
    shutdown(worker).await;

    assert_eq!(
        events.terminal(task.run_id),
        Some((BranchState::Done, None))
    );
    let asked = tokio::time::timeout(WAIT, resume).await.unwrap().unwrap();
    assert_eq!(asked.attempt, 2);
    let answers = drain(&mut answered);
    let retried = answers.iter().filter(|(r, _)| r.attempt == 1).count();
    assert_eq!(
        retried, COORDINATOR_TRIES as usize,
        "tried a bounded number of times"
    );
    // No call was made without a reservation.
    assert!(events.of(task.run_id).iter().all(|e| !matches!(
        e,
        Event::Usage {
            reservation: None,
            ..
        }
    )));
    let by_attempt: Vec<u32> = events.by_run[&task.run_id]
        .iter()
        .filter(|e| e.event.kind() == "usage")
        .map(|e| e.attempt)
        .collect();
    assert_eq!(by_attempt, [2, 2, 2]);
    assert_eq!(fx.pending().await, 0);
}

#[tokio::test]
async fn the_attempt_counts_from_the_tasks_base() {
    let fx = Fixture::new().await;
    let mut task = strict(&fx, "based", THREE_CALLS);
    task.attempt_base = 3;
    let mut answered = serve_budget(&fx, grant).await;
    let resume = fx.serve_resume(&task, Vec::new()).await;
    fx.enqueue(&task).await;
    let mut events = fx.events().await;
    let worker = start(&fx, config(1)).await;
    events.until_terminal(&[task.run_id]).await;
    shutdown(worker).await;

    // Delivered once, it is attempt 4: it takes the branch over from the coordinator's log
    // as a redelivery would, and every event and reservation says so.
    let asked = tokio::time::timeout(WAIT, resume).await.unwrap().unwrap();
    assert_eq!((asked.run_id, asked.attempt), (task.run_id, 4));
    assert_eq!(
        events.terminal(task.run_id),
        Some((BranchState::Done, None))
    );
    let published = &events.by_run[&task.run_id];
    assert!(published.iter().all(|e| e.attempt == 4));
    // The log handed over ends at the initial log's last seq (the `fork` event is seq 0).
    let last_seq = fx.initial_log(&task).len() as u64;
    assert_eq!(published[0].seq, last_seq + 1);
    let answers = drain(&mut answered);
    assert_eq!(answers.len(), 3);
    assert!(answers.iter().all(|(r, _)| r.attempt == 4));
}

/// Three calls: a write, another write, then an answer.
const WRITE_ON_THE_SECOND_CALL: &str = r#"
[[turns."*"]]
tool_calls = [{ name = "write_file", args = { path = "a.txt", content = "x" } }]
usage = { input_tokens = 100, output_tokens = 10 }

[[turns."*"]]
tool_calls = [{ name = "write_file", args = { path = "b.txt", content = "y" } }]
usage = { input_tokens = 100, output_tokens = 10 }

[[turns."*"]]
text = "done"
"#;

#[tokio::test]
async fn a_graceful_stop_lets_the_call_in_flight_finish_and_records_it() {
    let fx = Fixture::new().await;
    let task = strict(&fx, "graceful", WRITE_ON_THE_SECOND_CALL);
    let (mut answered, mut held) = serve_budget_holding(&fx, 2).await;
    fx.enqueue(&task).await;
    let mut events = fx.events().await;
    let worker = start(&fx, config(1)).await;
    let first = next_answer(&mut answered).await;
    // The second call is under way (its reservation waits): stop, gracefully; then the
    // reservation is granted.
    held.arrived().await;
    fx.send(
        task.run_id,
        ControlCommand::Stop {
            state: BranchState::AggregateBudgetExhausted,
            reason: "fork cap reached".into(),
            graceful: true,
        },
    )
    .await;
    held.release.send(()).unwrap();
    let second = next_answer(&mut answered).await;
    events
        .until(|e| is_status(e, task.run_id, BranchState::AggregateBudgetExhausted))
        .await;
    shutdown(worker).await;
    settle(&fx, &mut events).await;
    let mut all = vec![first, second];
    all.extend(drain(&mut answered));
    // Both paid calls are recorded with their reservations, the second call's write is
    // kept, and no third call was reserved.
    assert_eq!(all.len(), 2, "{all:?}");
    assert_eq!(
        reservations(&events, task.run_id),
        vec![Some(granted_id(&all[0].1)), Some(granted_id(&all[1].1))]
    );
    assert_eq!(events.count(task.run_id, "file_change"), 2);
    assert_eq!(events.count(task.run_id, "tool_result"), 2);
    assert_eq!(
        events.terminal(task.run_id),
        Some((
            BranchState::AggregateBudgetExhausted,
            Some("fork cap reached".into())
        ))
    );
}

#[tokio::test]
async fn a_command_for_an_earlier_attempt_is_ignored() {
    let fx = Fixture::new().await;
    let mut task = strict(&fx, "later", WRITE_ON_THE_SECOND_CALL);
    task.reserve = false;
    // Played as attempt 1; a stop meant for attempt 0 (say, before a pause) is left unread
    // on the channel the branch watches from its start.
    let stale = Control {
        run_id: task.run_id,
        command: ControlCommand::Stop {
            state: BranchState::AggregateBudgetExhausted,
            reason: "old".into(),
            graceful: false,
        },
        attempt: Some(0),
    };
    fx.bus
        .send_control(task.run_id, wire::encode(&stale).unwrap())
        .await
        .unwrap();
    fx.enqueue(&task).await;
    let mut events = fx.events().await;
    let worker = start(&fx, config(1)).await;
    events
        .until(|e| is_status(e, task.run_id, BranchState::Done))
        .await;
    shutdown(worker).await;
    assert_eq!(events.count(task.run_id, "model_response"), 3);
}
