//! The branch agent: one actor per branch task, running the agent loop.
//!
//! The actor works in steps so its mailbox (and the stop signal the node sends at
//! shutdown) is looked at between model calls:
//!
//! - `Start`: watch the run's control channel; if the task attempt is above 1, take the
//!   branch over from the coordinator's log (`coord.resume`); publish `status: running`,
//!   load the branch (history prefix + tail, snapshot manifest, provider) and replay what a
//!   resumed branch already did (its file changes onto the overlay, its model calls and
//!   spend).
//! - `Turn` (cast to itself after each turn): apply control commands (steers buffered
//!   during the last call first, then those sent since, in order), check max_turns, then
//!   the budget: with `task.reserve` (strict mode) reserve the call's upper-bound cost on
//!   `coord.budget` (granted: go on; refused: stop or pause; gone: drop the task), else
//!   check the branch's own cap locally. Then call the model, racing the call against the
//!   control channel: `terminate`, `stop` or `pause` cancels the call (nothing is published
//!   for it) and ends the turn at once, a `steer` is buffered. Publish the call's usage
//!   (naming its reservation) and then its response, run the tools (each `file_change`
//!   after its blob is stored, then the `tool_result`).
//! - finish: publish the terminal status as the branch's last event, ack the task, stop.
//! - pause (a budget cap with `on_exhausted = "pause"`): the same with `status: paused`;
//!   the branch is not finished, and a top-up makes the coordinator enqueue it again with
//!   a higher `attempt_base`, so it resumes from the coordinator's log.
//!
//! The task attempt, on every event and every request to the coordinator, is the task's
//! `attempt_base` plus the bus's delivery count. Events are numbered from the task's
//! `first_seq`, one by one, with no gaps. A request to the coordinator (`coord.budget`,
//! `coord.resume`) answered `retry`, timed out or failed is tried again a few times with a
//! growing backoff. An infrastructure failure (bus, blob store, a coordinator that keeps
//! failing those requests) makes the actor fail; the node then hands the task back for
//! another attempt. Everything else ends the branch with a status.

use crate::context::WorkerCtx;
use crate::error::WorkerError;
use crate::forktools::{is_fork_tool, AgentForks, ForkCall, MERGE_OR_SELECT};
use crate::node::TaskLease;
use crate::provider::{ModelProvider, ModelRequest};
use crate::tools::ToolBox;
use bytes::Bytes;
use forkfleet_bus::{Bus, BusError};
use forkfleet_shared::budget::{
    estimate_cost, BudgetReply, BudgetRequest, OnExhausted, BUDGET_SUBJECT,
};
use forkfleet_shared::error::ErrorKind;
use forkfleet_shared::event::{
    history_events, interrupted_results, messages_from_events, Event, Message, Usage,
};
use forkfleet_shared::ids::{ForkId, ReservationId, RunId};
use forkfleet_shared::manifest::Manifest;
use forkfleet_shared::overlay::Overlay;
use forkfleet_shared::protocol::{
    now_ms, BranchEvent, BranchTask, Control, ControlCommand, ResumeReply, ResumeRequest,
    RESUME_SUBJECT,
};
use forkfleet_shared::state::BranchState;
use forkfleet_shared::wire;
use ractor::{Actor, ActorProcessingErr, ActorRef};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tracing::Instrument;

/// The branch agent actor (all data lives in [`AgentState`]).
pub(crate) struct BranchAgent;

pub(crate) struct AgentArgs {
    pub task: BranchTask,
    pub lease: Arc<TaskLease>,
    pub ctx: Arc<WorkerCtx>,
}

pub(crate) enum AgentMsg {
    /// Load the branch and announce it is running.
    Start,
    /// Run the next turn.
    Turn,
}

pub(crate) struct AgentState {
    ctx: Arc<WorkerCtx>,
    lease: Arc<TaskLease>,
    task: BranchTask,
    span: tracing::Span,
    /// Publishes the branch's events; holds the task attempt.
    out: Publisher,
    control: Option<mpsc::UnboundedReceiver<Bytes>>,
    /// Commands that arrived during a model call or a reservation, for the next turn.
    pending: Pending,
    run: Option<Run>,
    finished: bool,
}

/// What control commands left for the next turn.
#[derive(Default)]
struct Pending {
    /// Steers, applied in order before the next call.
    steers: Vec<String>,
    /// A graceful stop or pause that arrived during a call: the call finishes and is
    /// recorded, then the branch ends this way before the next call.
    halt: Option<Step>,
}

/// The loaded branch.
struct Run {
    provider: Arc<dyn ModelProvider>,
    overlay: Overlay,
    history: Vec<Message>,
    /// Model calls made by this branch, including those before a resume.
    turns: u32,
    /// Model calls made before the current follow-up turn (ADR 13): `max_turns` counts
    /// from here (0 before any follow-up).
    turn_base: u32,
    spent_usd: f64,
    /// The forks this branch's agent made (fork tools, ADR 14).
    forks: AgentForks,
}

enum Step {
    Continue,
    /// Publish this status as the branch's last event, ack, stop: a terminal state, or
    /// `Paused` (a budget cap paused the branch; it is resumed by a new task).
    Finish(BranchState, Option<String>),
    /// Nothing left to do for this task (the branch already finished, or its fork is
    /// gone): ack it without publishing anything.
    Drop(String),
    /// The worker hands its branches back (shutdown): stop without settling the task, so
    /// the node naks it and another worker takes the branch over from its log.
    HandBack,
}

/// Publishes a branch's events with consecutive seqs.
struct Publisher {
    bus: Arc<dyn Bus>,
    fork_id: ForkId,
    run_id: RunId,
    seq: u64,
    /// The task attempt (`task.attempt_base` plus the delivery count), on every event and
    /// every request to the coordinator (the coordinator fences older ones).
    attempt: u32,
}

impl Publisher {
    /// Publish one event and hand it back (so its parts can move into the history).
    async fn publish(&mut self, event: Event) -> Result<Event, WorkerError> {
        let msg = BranchEvent {
            fork_id: self.fork_id,
            run_id: self.run_id,
            seq: self.seq,
            at_ms: now_ms(),
            event,
            attempt: self.attempt,
        };
        let bytes = wire::encode(&msg)?;
        self.bus.publish_event(bytes).await?;
        self.seq += 1;
        Ok(msg.event)
    }
}

impl Actor for BranchAgent {
    type Msg = AgentMsg;
    type State = AgentState;
    type Arguments = AgentArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<Self::Msg>,
        args: AgentArgs,
    ) -> Result<Self::State, ActorProcessingErr> {
        let task = args.task;
        let attempt = task.attempt_base.saturating_add(args.lease.attempt());
        let span = tracing::info_span!(
            "branch.run",
            fork.id = %task.fork_id,
            run.id = %task.run_id,
            branch.label = %task.label,
            branch.index = task.index,
            worker.id = %args.ctx.worker_id,
        );
        // Before the span is first entered: the task's trace context is its parent.
        forkfleet_shared::trace::set_parent(&span, args.lease.trace());
        let out = Publisher {
            bus: args.ctx.bus.clone(),
            fork_id: task.fork_id,
            run_id: task.run_id,
            seq: task.first_seq,
            attempt,
        };
        Ok(AgentState {
            ctx: args.ctx,
            lease: args.lease,
            task,
            span,
            out,
            control: None,
            pending: Pending::default(),
            run: None,
            finished: false,
        })
    }

    async fn post_start(
        &self,
        myself: ActorRef<Self::Msg>,
        _state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        myself.cast(AgentMsg::Start)?;
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        if state.finished {
            return Ok(());
        }
        let span = state.span.clone();
        let step = match msg {
            AgentMsg::Start => start(state).instrument(span.clone()).await?,
            AgentMsg::Turn => {
                let turn = state.run.as_ref().map_or(0, |r| r.turns);
                let turn_span =
                    tracing::info_span!(parent: &span, "branch.turn", branch.turn = turn);
                run_turn(state).instrument(turn_span).await?
            }
        };
        match step {
            Step::Continue => {
                // Fails only when the actor is already stopping (a hand-back).
                let _ = myself.cast(AgentMsg::Turn);
            }
            Step::Finish(end, error) => {
                finish(state, end, error).instrument(span).await?;
                myself.stop(None);
            }
            Step::HandBack => {
                tracing::info!(parent: &span, "call in flight dropped: the worker hands the branch back");
                myself.stop(None);
            }
            Step::Drop(reason) => {
                tracing::info!(parent: &span, reason = %reason, "task dropped");
                state.finished = true;
                if let Err(e) = state.lease.ack().await {
                    tracing::warn!(parent: &span, error = %e, "could not ack a dropped task");
                }
                myself.stop(None);
            }
        }
        Ok(())
    }
}

async fn start(state: &mut AgentState) -> Result<Step, WorkerError> {
    let task = &state.task;
    // Watch before announcing, so a command sent on seeing `running` is not missed.
    state.control = Some(state.ctx.bus.watch_control(task.run_id).await?);
    // A task delivered again (another worker ran this branch and is presumed gone), or
    // enqueued again for a branch that ran before (resumed after a pause): take the branch
    // over from the coordinator's copy of its log, after the coordinator has fenced off the
    // earlier attempts' events.
    let resumed = if state.out.attempt > 1 {
        match resume_log(&state.ctx.bus, task, state.out.attempt).await? {
            Resumed::Log(events) => {
                if let Some(end) = terminal_state(&events) {
                    return Ok(Step::Drop(format!("the branch already finished as {end}")));
                }
                state.out.seq = events.last().map_or(task.first_seq, |(seq, _)| seq + 1);
                Some(events)
            }
            Resumed::Gone(reason) => return Ok(Step::Drop(reason)),
        }
    } else {
        None
    };
    state
        .out
        .publish(Event::Status {
            state: BranchState::Running,
            error: None,
        })
        .await?;
    tracing::info!(
        task.attempt = state.out.attempt,
        first_seq = task.first_seq,
        resumed = resumed.is_some(),
        "branch started"
    );
    match load(&state.ctx, task, resumed).await {
        Ok(mut run) => {
            // A worker lost between a call and its result: the effect is unknown, so the
            // call is answered as interrupted before the next model call.
            for result in interrupted_results(&run.history) {
                if let Event::ToolResult {
                    call_id,
                    name,
                    output,
                    ..
                } = state.out.publish(result).await?
                {
                    run.history.push(Message::Tool {
                        call_id,
                        name,
                        output,
                    });
                }
            }
            state.run = Some(run);
            Ok(Step::Continue)
        }
        // The store failed: another attempt may work.
        Err(e) if e.kind() == ErrorKind::Unavailable => Err(e),
        // The task cannot run (a missing blob, a bad prefix, an unknown model): the branch
        // fails.
        Err(e) => Ok(Step::Finish(BranchState::Failed, Some(e.to_string()))),
    }
}

/// How long one resume request may wait for the coordinator.
const RESUME_TIMEOUT: Duration = Duration::from_secs(15);

/// The coordinator's answer to a resume.
enum Resumed {
    /// The branch's log as the coordinator has it, `(seq, event)` from the `fork` event.
    Log(Vec<(u64, Event)>),
    /// The fork or the branch is not known: nothing to resume.
    Gone(String),
}

/// Ask the coordinator for the branch's log, fencing off earlier attempts. A `retry`
/// answer, a timeout or a bus error is tried again (see [`ask_coordinator`]).
async fn resume_log(
    bus: &Arc<dyn Bus>,
    task: &BranchTask,
    attempt: u32,
) -> Result<Resumed, WorkerError> {
    let req = wire::encode(&ResumeRequest {
        fork_id: task.fork_id,
        run_id: task.run_id,
        attempt,
    })?;
    ask_coordinator(
        bus,
        RESUME_SUBJECT,
        req,
        RESUME_TIMEOUT,
        "branch log",
        |reply| match reply {
            ResumeReply::Log { events } => Ok(Resumed::Log(events)),
            ResumeReply::Gone { reason } => Ok(Resumed::Gone(reason)),
            ResumeReply::Retry { reason } => Err(reason),
        },
    )
    .await
}

/// The terminal state a log ends in, if it does: a `follow_up` after the last terminal
/// status started a new turn (ADR 13), so that log has not finished.
fn terminal_state(events: &[(u64, Event)]) -> Option<BranchState> {
    events
        .iter()
        .rev()
        .find_map(|(_, e)| match e {
            Event::FollowUp { .. } => Some(None),
            Event::Status { state, .. } if state.is_terminal() => Some(Some(*state)),
            _ => None,
        })
        .flatten()
}

async fn load(
    ctx: &WorkerCtx,
    task: &BranchTask,
    resumed: Option<Vec<(u64, Event)>>,
) -> Result<Run, WorkerError> {
    let blobs = &ctx.blobs;
    let prefix = ctx
        .prefixes
        .get_or_try_init(task.prefix, || async {
            let bytes = blobs
                .get(&task.prefix)
                .await
                .map_err(|error| WorkerError::TaskBlob {
                    what: "history prefix",
                    hash: task.prefix,
                    error,
                })?;
            rmp_serde::from_slice::<Vec<Event>>(&bytes).map_err(|e| WorkerError::BadPrefix {
                hash: task.prefix,
                message: e.to_string(),
            })
        })
        .await?;
    let manifest = ctx
        .manifests
        .get_or_try_init(task.snapshot, || async {
            let bytes = blobs
                .get(&task.snapshot)
                .await
                .map_err(|error| WorkerError::TaskBlob {
                    what: "workspace snapshot",
                    hash: task.snapshot,
                    error,
                })?;
            Manifest::from_blob(&bytes).map_err(|e| WorkerError::BadSnapshot {
                hash: task.snapshot,
                message: e.to_string(),
            })
        })
        .await?;
    let provider =
        ctx.providers
            .provider_for(task)
            .await
            .map_err(|e| WorkerError::ModelUnusable {
                model: task.model.clone(),
                error: Box::new(e),
            })?;

    // A resumed branch's log holds what it already did, after its first `running` status
    // (the copied fork-time prefix never holds a status, a usage or a file change). A task
    // resumed from the coordinator's copy uses that log (after the seq-0 `fork` event), as
    // its history: a finished branch rewound (ADR 12) and then continued (ADR 13) goes on
    // from the rewound conversation and workspace.
    let log: Vec<&Event> = match &resumed {
        Some(events) => history_events(events, None)
            .into_iter()
            .filter(|(seq, _)| *seq > 0)
            .map(|(_, e)| e)
            .collect(),
        None => prefix.iter().chain(task.tail.iter()).collect(),
    };
    let log = || log.iter().copied();
    let mut overlay = Overlay::new(manifest);
    let mut own = false;
    let mut turns = 0u32;
    let mut turn_base = 0u32;
    for event in log() {
        match event {
            Event::Status {
                state: BranchState::Running,
                ..
            } => own = true,
            Event::ModelResponse { .. } if own => turns += 1,
            Event::FollowUp { .. } => turn_base = turns,
            Event::FileChange { change } => {
                overlay
                    .apply(change.clone())
                    .map_err(|e| WorkerError::Replay {
                        change: change.kind(),
                        path: change.path().to_string(),
                        message: e.to_string(),
                    })?
            }
            _ => {}
        }
    }
    // Money spent stays spent, whatever a rewind left out of the history.
    let spent_usd = match &resumed {
        Some(events) => events.iter().map(|(_, e)| cost_of(e)).sum(),
        None => log().map(cost_of).sum(),
    };
    Ok(Run {
        provider,
        overlay,
        history: messages_from_events(log()),
        turns,
        turn_base,
        spent_usd,
        forks: AgentForks::from_log(log()),
    })
}

/// The cost a `usage` event records (0 for any other event).
fn cost_of(event: &Event) -> f64 {
    match event {
        Event::Usage { cost_usd, .. } => *cost_usd,
        _ => 0.0,
    }
}

async fn run_turn(state: &mut AgentState) -> Result<Step, WorkerError> {
    let AgentState {
        ctx,
        task,
        out,
        control,
        pending,
        run,
        ..
    } = state;
    let attempt = out.attempt;
    let Some(run) = run.as_mut() else {
        return Ok(Step::Finish(
            BranchState::Failed,
            Some("internal error: a turn ran before the branch was loaded".into()),
        ));
    };

    // What arrived during the last call, then control commands sent since, one by one in
    // order: steers are applied, a stop ends the branch (between calls a graceful stop is
    // as good as an immediate one).
    loop {
        for text in std::mem::take(&mut pending.steers) {
            apply_steer(out, run, text).await?;
        }
        if let Some(step) = pending.halt.take() {
            return Ok(step);
        }
        let Some(bytes) = control.as_mut().and_then(|rx| rx.try_recv().ok()) else {
            break;
        };
        if let Some(step) = pending.file(&bytes, task.run_id, attempt) {
            return Ok(step);
        }
    }

    if run.turns.saturating_sub(run.turn_base) >= task.max_turns {
        return Ok(Step::Finish(
            BranchState::Failed,
            Some(format!("max_turns ({}) reached", task.max_turns)),
        ));
    }
    // Without reservations, the branch's own cap is checked here; with them the
    // coordinator's ledger is authoritative (and the cap may have been topped up).
    if !task.reserve {
        if let Some(budget) = task.budget_usd {
            if run.spent_usd >= budget {
                return Ok(exhausted(
                    task.on_exhausted,
                    BranchState::BudgetExhausted,
                    format!(
                        "branch budget of ${budget} reached (spent ${:.6})",
                        run.spent_usd
                    ),
                ));
            }
        }
    }

    let tools = ToolBox::for_task(task);
    let req = ModelRequest {
        model: &task.model,
        messages: &run.history,
        tools: tools.specs(),
        max_output_tokens: task.max_output_tokens,
        label: &task.label,
        index: task.index,
        turn: run.turns,
    };
    let reservation = if task.reserve {
        let estimate = run.provider.estimate(&req);
        let reserving = reserve(&ctx.bus, task, attempt, estimate);
        match until_halted(reserving, control, task.run_id, attempt, pending, None).await {
            Err(step) => return Ok(step),
            Ok(granted) => match granted? {
                Reserved::Granted(id) => Some(id),
                Reserved::Refused { state, reason } => {
                    tracing::info!(reason = %reason, "budget reservation refused");
                    return Ok(exhausted(task.on_exhausted, state, reason));
                }
                Reserved::Gone(reason) => return Ok(Step::Drop(reason)),
            },
        }
    } else {
        None
    };
    // A graceful stop that came while reserving waits in `pending` until this call, paid
    // for by its reservation, is made and recorded.
    // The call runs until it answers or a command stops the branch; a cancelled call is
    // dropped (aborted) and nothing is published for it.
    let call = run.provider.complete(&req);
    let reply = match until_halted(
        call,
        control,
        task.run_id,
        attempt,
        pending,
        Some(&ctx.handback),
    )
    .await
    {
        Err(step) => {
            tracing::info!("model call cancelled: the branch stops or is handed back");
            return Ok(step);
        }
        Ok(Ok(r)) => r,
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "model call failed");
            return Ok(Step::Finish(
                BranchState::Failed,
                Some(format!("model call failed: {e}")),
            ));
        }
    };
    run.turns += 1;
    tracing::debug!(
        usage.input_tokens = reply.usage.input_tokens,
        usage.output_tokens = reply.usage.output_tokens,
        tool_calls = reply.tool_calls.len(),
        "model replied"
    );

    // Usage first: the call is paid for whether or not its response is recorded. If this
    // worker is lost before the response is, the branch's next worker makes the call again,
    // and both calls are counted, as both were paid.
    let cost_usd = task.price.map_or(0.0, |p| p.cost(&reply.usage));
    run.spent_usd += cost_usd;
    out.publish(Event::Usage {
        model: task.model.clone(),
        usage: reply.usage,
        cost_usd,
        reservation,
    })
    .await?;
    // A fork the response asks for gets the history before it.
    let cutoff_seq = out.seq.saturating_sub(1);
    let response = out
        .publish(Event::ModelResponse {
            model: task.model.clone(),
            text: reply.text,
            tool_calls: reply.tool_calls,
        })
        .await?;
    let Event::ModelResponse {
        text, tool_calls, ..
    } = response
    else {
        return Ok(Step::Continue);
    };

    if tool_calls.is_empty() {
        run.history.push(Message::Assistant { text, tool_calls });
        return Ok(Step::Finish(BranchState::Done, None));
    }

    let mut results = Vec::with_capacity(tool_calls.len());
    for call in &tool_calls {
        let before = run.overlay.changes().len();
        let running = async {
            if task.forking && is_fork_tool(&call.name) {
                let fork_call = ForkCall {
                    bus: ctx.bus.as_ref(),
                    blobs: &ctx.blobs,
                    run_id: task.run_id,
                    cutoff_seq,
                    overlay: &mut run.overlay,
                };
                Ok(run.forks.run(call, fork_call).await)
            } else {
                tools.run(call, &mut run.overlay, &ctx.blobs).await
            }
        };
        let outcome = if call.name == MERGE_OR_SELECT {
            // A merge is not cut short: the fork would be recorded merged and not applied.
            running.await?
        } else {
            // A command or a wait on branches ends when the branch is stopped (what it did
            // is not published: the branch ends here).
            match until_halted(
                running,
                control,
                task.run_id,
                attempt,
                pending,
                Some(&ctx.handback),
            )
            .await
            {
                Ok(outcome) => outcome?,
                Err(step) => return Ok(step),
            }
        };
        for op in &run.overlay.changes()[before..] {
            out.publish(Event::FileChange { change: op.clone() })
                .await?;
        }
        if !outcome.ok {
            tracing::debug!(tool = %call.name, "tool call failed");
        }
        let result = out
            .publish(Event::ToolResult {
                call_id: call.id.clone(),
                name: call.name.clone(),
                ok: outcome.ok,
                output: outcome.output,
            })
            .await?;
        if let Event::ToolResult {
            call_id,
            name,
            output,
            ..
        } = result
        {
            results.push(Message::Tool {
                call_id,
                name,
                output,
            });
        }
    }
    run.history.push(Message::Assistant { text, tool_calls });
    run.history.extend(results);
    Ok(Step::Continue)
}

/// Publish a steer and add it to the model's history.
async fn apply_steer(out: &mut Publisher, run: &mut Run, text: String) -> Result<(), WorkerError> {
    tracing::info!("steering message applied");
    if let Event::Steer { text } = out.publish(Event::Steer { text }).await? {
        run.history.push(Message::User { text });
    }
    Ok(())
}

impl Pending {
    /// File the control message `bytes` (see [`command`]): a steer or a graceful stop is
    /// kept here (the first graceful stop is the one kept); a command that stops the branch
    /// now is returned.
    fn file(&mut self, bytes: &Bytes, run_id: RunId, attempt: u32) -> Option<Step> {
        match command(bytes, run_id, attempt)? {
            Command::Steer(text) => self.steers.push(text),
            Command::HaltAfterCall(step) => {
                self.halt.get_or_insert(step);
            }
            Command::Halt(step) => return Some(step),
        }
        None
    }
}

/// What a control command asks of the branch.
enum Command {
    Steer(String),
    /// Stop now (terminate, stop for budget, pause), cancelling a call in flight.
    Halt(Step),
    /// Stop (or pause) once the call in flight, if any, is recorded.
    HaltAfterCall(Step),
}

/// Decode a control message for `run_id` and task attempt `attempt`; `None` (logged) when
/// it is not one, or is meant for an earlier attempt of the branch (the coordinator
/// addresses every command to the attempt that runs the branch, so a later attempt, or a
/// later turn's worker re-reading the run's control stream on NATS, ignores it).
fn command(bytes: &Bytes, run_id: RunId, attempt: u32) -> Option<Command> {
    match wire::decode::<Control>(bytes) {
        Ok(c) if c.run_id != run_id => {
            tracing::warn!(control.run_id = %c.run_id, "control message for another run dropped");
            None
        }
        Ok(Control {
            attempt: Some(for_attempt),
            ..
        }) if for_attempt < attempt => {
            tracing::debug!(
                for_attempt,
                attempt,
                "control message for an earlier attempt ignored"
            );
            None
        }
        Ok(Control { command, .. }) => Some(match command {
            ControlCommand::Steer { text } => Command::Steer(text),
            ControlCommand::Terminate { reason } => {
                tracing::info!(reason = %reason, "branch terminated by control command");
                let reason = (!reason.is_empty()).then_some(reason);
                Command::Halt(Step::Finish(BranchState::Terminated, reason))
            }
            ControlCommand::Stop {
                state,
                reason,
                graceful,
            } => {
                tracing::info!(reason = %reason, branch.state = %state, graceful, "branch stopped by control command");
                let step = stopped(state, reason);
                if graceful {
                    Command::HaltAfterCall(step)
                } else {
                    Command::Halt(step)
                }
            }
            ControlCommand::Pause { reason, graceful } => {
                tracing::info!(reason = %reason, graceful, "branch paused by control command");
                let step = Step::Finish(BranchState::Paused, Some(reason));
                if graceful {
                    Command::HaltAfterCall(step)
                } else {
                    Command::Halt(step)
                }
            }
        }),
        Err(e) => {
            tracing::warn!(error = %e, "undecodable control message dropped");
            None
        }
    }
}

/// The step that ends a branch as `state` (a terminal state, or paused) for `reason`. A
/// state a branch cannot end in (pending, running) ends it as terminated.
fn stopped(state: BranchState, reason: String) -> Step {
    if state.is_stopped() {
        Step::Finish(state, Some(reason))
    } else {
        tracing::warn!(branch.state = %state, "asked to stop in a non-final state; terminating");
        Step::Finish(BranchState::Terminated, Some(reason))
    }
}

/// A budget cap has no room for the next call: stop as `state`, or pause.
fn exhausted(on_exhausted: OnExhausted, state: BranchState, reason: String) -> Step {
    match on_exhausted {
        OnExhausted::Pause => Step::Finish(BranchState::Paused, Some(reason)),
        OnExhausted::Stop => stopped(state, reason),
    }
}

/// Run `work` unless a command that stops the branch arrives first (then `work` is dropped,
/// which cancels it, and the step the command asks for is returned). Steers and graceful
/// stops that arrive meanwhile are left in `pending` for the next turn. Work that is done
/// wins over a command that arrived at the same time: its result is kept, and the command
/// is read before the next call.
async fn until_halted<F: Future>(
    work: F,
    control: &mut Option<mpsc::UnboundedReceiver<Bytes>>,
    run_id: RunId,
    attempt: u32,
    pending: &mut Pending,
    handback: Option<&tokio::sync::watch::Sender<bool>>,
) -> Result<F::Output, Step> {
    // A hand-back cuts model calls and tools short; a request to the coordinator (bounded
    // by its own timeouts) finishes, so its answer is acted on.
    let mut handed_back = handback.map(|h| h.subscribe());
    let mut no_control = None;
    let (rx, mut open) = match control.as_mut() {
        Some(rx) => (rx, true),
        None => (
            no_control.get_or_insert_with(|| mpsc::unbounded_channel().1),
            false,
        ),
    };
    tokio::pin!(work);
    loop {
        tokio::select! {
            biased;
            out = &mut work => return Ok(out),
            Some(()) = async { handed_back.as_mut()?.wait_for(|back| *back).await.ok().map(|_| ()) } => return Err(Step::HandBack),
            msg = rx.recv(), if open => match msg {
                None => open = false,
                Some(bytes) => {
                    if let Some(step) = pending.file(&bytes, run_id, attempt) {
                        return Err(step);
                    }
                }
            },
        }
    }
}

/// How long one budget request may wait for the coordinator.
const BUDGET_TIMEOUT: Duration = Duration::from_secs(10);
/// Requests to the coordinator (budget reservations, resumes) tried before the task is
/// handed back.
pub const COORDINATOR_TRIES: u32 = 5;
/// The wait after the first failed request to the coordinator; doubled after each.
const COORDINATOR_BACKOFF: Duration = Duration::from_millis(100);

/// Ask the coordinator: send `req` on `subject`, decode the reply and `classify` it (`Ok`:
/// the answer; `Err(reason)`: a reply asking to try again later). A retry reply, a timeout
/// (`timeout` per try), a bus error or an undecodable reply is tried again, up to
/// [`COORDINATOR_TRIES`] times with a growing backoff, then becomes an error (the task is
/// handed back). `what` names the answer in logs and errors.
async fn ask_coordinator<R: wire::WireMessage, T>(
    bus: &Arc<dyn Bus>,
    subject: &str,
    req: Bytes,
    timeout: Duration,
    what: &str,
    classify: impl Fn(R) -> Result<T, String>,
) -> Result<T, WorkerError> {
    let mut backoff = COORDINATOR_BACKOFF;
    let mut last = String::new();
    for tried in 1..=COORDINATOR_TRIES {
        match bus.request(subject, req.clone(), timeout).await {
            Ok(bytes) => match wire::decode::<R>(&bytes) {
                Ok(reply) => match classify(reply) {
                    Ok(answer) => return Ok(answer),
                    Err(reason) => last = reason,
                },
                Err(e) => last = format!("undecodable reply: {e}"),
            },
            Err(e) => last = e.to_string(),
        }
        tracing::warn!(tried, error = %last, "no {what} from the coordinator yet");
        if tried < COORDINATOR_TRIES {
            tokio::time::sleep(backoff).await;
            backoff *= 2;
        }
    }
    Err(WorkerError::Bus(BusError::Backend(format!(
        "no {what} after {COORDINATOR_TRIES} tries: {last}"
    ))))
}

/// The coordinator's answer to a reservation.
enum Reserved {
    Granted(ReservationId),
    Refused { state: BranchState, reason: String },
    Gone(String),
}

/// Reserve the upper bound `estimate` of the next call's cost (strict mode). A `retry`
/// answer, a timeout or a bus error is tried again (see [`ask_coordinator`]).
async fn reserve(
    bus: &Arc<dyn Bus>,
    task: &BranchTask,
    attempt: u32,
    estimate: Usage,
) -> Result<Reserved, WorkerError> {
    let estimate_usd = task.price.map_or(0.0, |p| estimate_cost(&p, &estimate));
    let req = wire::encode(&BudgetRequest {
        fork_id: task.fork_id,
        run_id: task.run_id,
        attempt,
        estimate_usd,
        estimate,
    })?;
    let reserved = ask_coordinator(
        bus,
        BUDGET_SUBJECT,
        req,
        BUDGET_TIMEOUT,
        "budget reservation",
        |reply| match reply {
            BudgetReply::Granted { reservation } => Ok(Reserved::Granted(reservation)),
            BudgetReply::Refused { state, reason } => Ok(Reserved::Refused { state, reason }),
            BudgetReply::Gone { reason } => Ok(Reserved::Gone(reason)),
            BudgetReply::Retry { reason } => Err(reason),
        },
    )
    .await?;
    if let Reserved::Granted(reservation) = &reserved {
        tracing::debug!(reservation = %reservation, estimate_usd, "budget reserved");
    }
    Ok(reserved)
}

async fn finish(
    state: &mut AgentState,
    end: BranchState,
    error: Option<String>,
) -> Result<(), WorkerError> {
    state
        .out
        .publish(Event::Status { state: end, error })
        .await?;
    state.finished = true;
    let (turns, spent) = state
        .run
        .as_ref()
        .map_or((0, 0.0), |r| (r.turns, r.spent_usd));
    if end == BranchState::Paused {
        tracing::info!(
            branch.turns = turns,
            branch.cost_usd = spent,
            "branch paused"
        );
    } else {
        tracing::info!(
            branch.state = %end,
            branch.turns = turns,
            branch.cost_usd = spent,
            "branch finished"
        );
    }
    if let Err(e) = state.lease.ack().await {
        // The terminal status is out; a redelivery replays a finished branch, which the
        // coordinator ignores (the first terminal state is final).
        tracing::warn!(error = %e, "could not ack a finished branch's task");
    }
    Ok(())
}
