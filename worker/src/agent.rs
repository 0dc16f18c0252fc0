//! The branch agent: one actor per branch task, running the agent loop.
//!
//! The actor works in steps so its mailbox (and the stop signal the node sends at
//! shutdown) is looked at between model calls:
//!
//! - `Start`: watch the run's control channel, publish `status: running`, load the
//!   branch (history prefix + tail, snapshot manifest, provider) and replay what a resumed
//!   branch already did (its file changes onto the overlay, its model calls and spend).
//! - `Turn` (cast to itself after each turn): apply control commands, check max_turns and
//!   the branch budget, call the model, publish its usage and then its response, run the tools
//!   (each `file_change` after its blob is stored, then the `tool_result`).
//! - finish: publish the terminal status as the branch's last event, ack the task, stop.
//!
//! Events are numbered from the task's `first_seq`, one by one, with no gaps. An
//! infrastructure failure (bus, blob store) makes the actor fail; the node then hands the
//! task back for another attempt. Everything else ends the branch with a status.

use crate::context::WorkerCtx;
use crate::error::WorkerError;
use crate::node::TaskLease;
use crate::provider::{ModelProvider, ModelRequest, ProviderError};
use crate::tools::{run_tool, tool_specs};
use bytes::Bytes;
use forkfleet_shared::blob::{BlobError, BlobHash};
use forkfleet_shared::bus::{Bus, BusError};
use forkfleet_shared::event::{messages_from_events, Event, Message};
use forkfleet_shared::ids::{ForkId, RunId};
use forkfleet_shared::manifest::Manifest;
use forkfleet_shared::overlay::Overlay;
use forkfleet_shared::protocol::{
    now_ms, BranchEvent, BranchTask, Control, ControlCommand, ResumeReply, ResumeRequest,
    RESUME_SUBJECT,
};
use forkfleet_shared::state::BranchState;
use forkfleet_shared::wire;
use ractor::{Actor, ActorProcessingErr, ActorRef};
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
    out: Publisher,
    control: Option<mpsc::UnboundedReceiver<Bytes>>,
    run: Option<Run>,
    finished: bool,
}

/// The loaded branch.
struct Run {
    provider: Arc<dyn ModelProvider>,
    overlay: Overlay,
    history: Vec<Message>,
    /// Model calls made by this branch, including those before a resume.
    turns: u32,
    spent_usd: f64,
}

enum Step {
    Continue,
    Finish(BranchState, Option<String>),
    /// Nothing left to do for this task (the branch already finished, or its fork is
    /// gone): ack it without publishing anything.
    Drop(String),
}

/// Publishes a branch's events with consecutive seqs.
struct Publisher {
    bus: Arc<dyn Bus>,
    fork_id: ForkId,
    run_id: RunId,
    seq: u64,
    /// The task's delivery attempt, on every event (the coordinator fences older ones).
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
        let span = tracing::info_span!(
            "branch.run",
            fork.id = %task.fork_id,
            run.id = %task.run_id,
            branch.label = %task.label,
            branch.index = task.index,
            worker.id = %args.ctx.worker_id,
        );
        let out = Publisher {
            bus: args.ctx.bus.clone(),
            fork_id: task.fork_id,
            run_id: task.run_id,
            seq: task.first_seq,
            attempt: args.lease.attempt(),
        };
        Ok(AgentState {
            ctx: args.ctx,
            lease: args.lease,
            task,
            span,
            out,
            control: None,
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

/// Why a branch could not be loaded.
enum LoadError {
    /// The task cannot run (missing blob, bad prefix, unknown model): the branch fails.
    Fatal(String),
    /// The store failed; another attempt may work.
    Transient(WorkerError),
}

impl LoadError {
    fn blob(what: &str, hash: &BlobHash, e: BlobError) -> Self {
        match e {
            BlobError::Backend(_) => LoadError::Transient(WorkerError::Blob(e)),
            other => LoadError::Fatal(format!("cannot load the {what} ({hash:?}): {other}")),
        }
    }
}

async fn start(state: &mut AgentState) -> Result<Step, WorkerError> {
    let task = &state.task;
    // Watch before announcing, so a command sent on seeing `running` is not missed.
    state.control = Some(state.ctx.bus.watch_control(task.run_id).await?);
    // A task delivered again: another worker ran this branch and is presumed gone. Take
    // the branch over from the coordinator's copy of its log, after the coordinator has
    // fenced off the earlier attempt's events.
    let resumed = if state.lease.attempt() > 1 {
        match resume_log(&state.ctx.bus, task, state.lease.attempt()).await? {
            ResumeReply::Log { events } => {
                if let Some(end) = terminal_state(&events) {
                    return Ok(Step::Drop(format!("the branch already finished as {end}")));
                }
                state.out.seq = events.last().map_or(task.first_seq, |(seq, _)| seq + 1);
                Some(events)
            }
            ResumeReply::Gone { reason } => return Ok(Step::Drop(reason)),
            ResumeReply::Retry { reason } => {
                return Err(WorkerError::Bus(BusError::Backend(format!(
                    "the coordinator cannot resume the branch yet: {reason}"
                ))))
            }
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
        task.attempt = state.lease.attempt(),
        first_seq = task.first_seq,
        resumed = resumed.is_some(),
        "branch started"
    );
    match load(&state.ctx, task, resumed).await {
        Ok(mut run) => {
            for (call_id, name) in dangling_calls(&run.history) {
                if let Event::ToolResult {
                    call_id,
                    name,
                    output,
                    ..
                } = state
                    .out
                    .publish(Event::ToolResult {
                        call_id,
                        name,
                        ok: false,
                        output: INTERRUPTED.to_string(),
                    })
                    .await?
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
        Err(LoadError::Fatal(msg)) => Ok(Step::Finish(BranchState::Failed, Some(msg))),
        Err(LoadError::Transient(e)) => Err(e),
    }
}

/// How long a worker waits for the coordinator to hand over a resumed branch's log.
const RESUME_TIMEOUT: Duration = Duration::from_secs(15);

/// Ask the coordinator for the branch's log, fencing off earlier attempts.
async fn resume_log(
    bus: &Arc<dyn Bus>,
    task: &BranchTask,
    attempt: u32,
) -> Result<ResumeReply, WorkerError> {
    let req = wire::encode(&ResumeRequest {
        fork_id: task.fork_id,
        run_id: task.run_id,
        attempt,
    })?;
    let reply = bus.request(RESUME_SUBJECT, req, RESUME_TIMEOUT).await?;
    Ok(wire::decode::<ResumeReply>(&reply)?)
}

/// The terminal state a log ends in, if it does.
fn terminal_state(events: &[(u64, Event)]) -> Option<BranchState> {
    events.iter().rev().find_map(|(_, e)| match e {
        Event::Status { state, .. } if state.is_terminal() => Some(*state),
        _ => None,
    })
}

async fn load(
    ctx: &WorkerCtx,
    task: &BranchTask,
    resumed: Option<Vec<(u64, Event)>>,
) -> Result<Run, LoadError> {
    let blobs = &ctx.blobs;
    let prefix = ctx
        .prefixes
        .get_or_try_init(task.prefix, || async {
            let bytes = blobs
                .get(&task.prefix)
                .await
                .map_err(|e| LoadError::blob("history prefix", &task.prefix, e))?;
            rmp_serde::from_slice::<Vec<Event>>(&bytes).map_err(|e| {
                LoadError::Fatal(format!(
                    "the history prefix blob {:?} is not a list of events: {e}",
                    task.prefix
                ))
            })
        })
        .await?;
    let manifest = ctx
        .manifests
        .get_or_try_init(task.snapshot, || async {
            let bytes = blobs
                .get(&task.snapshot)
                .await
                .map_err(|e| LoadError::blob("workspace snapshot", &task.snapshot, e))?;
            Manifest::from_blob(&bytes).map_err(|e| {
                LoadError::Fatal(format!(
                    "the workspace snapshot blob {:?} is not a manifest: {e}",
                    task.snapshot
                ))
            })
        })
        .await?;
    let provider = ctx
        .providers
        .provider_for(task)
        .await
        .map_err(|e| match e {
            ProviderError::ScriptBlob(b @ BlobError::Backend(_)) => {
                LoadError::Transient(WorkerError::Blob(b))
            }
            other => LoadError::Fatal(format!("cannot use model `{}`: {other}", task.model)),
        })?;

    // A resumed branch's log holds what it already did, after its first `running` status
    // (the copied fork-time prefix never holds a status, a usage or a file change). A task
    // resumed from the coordinator's copy uses that log (after the seq-0 `fork` event).
    let log: Vec<&Event> = match &resumed {
        Some(events) => events
            .iter()
            .filter(|(seq, _)| *seq > 0)
            .map(|(_, e)| e)
            .collect(),
        None => prefix.iter().chain(task.tail.iter()).collect(),
    };
    let log = || log.iter().copied();
    let mut overlay = Overlay::new(manifest);
    let mut own = false;
    let mut turns = 0u32;
    let mut spent_usd = 0.0;
    for event in log() {
        match event {
            Event::Status {
                state: BranchState::Running,
                ..
            } => own = true,
            Event::ModelResponse { .. } if own => turns += 1,
            Event::Usage { cost_usd, .. } => spent_usd += cost_usd,
            Event::FileChange { change } => overlay.apply(change.clone()).map_err(|e| {
                LoadError::Fatal(format!(
                    "cannot replay the branch's {} of `{}`: {e}",
                    change.kind(),
                    change.path()
                ))
            })?,
            _ => {}
        }
    }
    Ok(Run {
        provider,
        overlay,
        history: messages_from_events(log()),
        turns,
        spent_usd,
    })
}

/// Tool calls of the log's last model response that have no result: a worker was lost
/// between the call and its result. Their effect is unknown, so they are answered as
/// interrupted before the next model call (a model API rejects a call without a result).
fn dangling_calls(history: &[Message]) -> Vec<(String, String)> {
    let Some(pos) = history
        .iter()
        .rposition(|m| matches!(m, Message::Assistant { .. }))
    else {
        return Vec::new();
    };
    let Message::Assistant { tool_calls, .. } = &history[pos] else {
        return Vec::new();
    };
    let answered: Vec<&str> = history[pos + 1..]
        .iter()
        .filter_map(|m| match m {
            Message::Tool { call_id, .. } => Some(call_id.as_str()),
            _ => None,
        })
        .collect();
    tool_calls
        .iter()
        .filter(|c| !answered.contains(&c.id.as_str()))
        .map(|c| (c.id.clone(), c.name.clone()))
        .collect()
}

/// The output a model sees for a tool call whose worker was lost.
pub(crate) const INTERRUPTED: &str = "interrupted: the worker running this branch was lost during this call; its effect on the workspace is whatever the file changes before this result show. Check before relying on it.";

async fn run_turn(state: &mut AgentState) -> Result<Step, WorkerError> {
    let AgentState {
        ctx,
        task,
        out,
        control,
        run,
        ..
    } = state;
    let Some(run) = run.as_mut() else {
        return Ok(Step::Finish(
            BranchState::Failed,
            Some("internal error: a turn ran before the branch was loaded".into()),
        ));
    };

    // Control commands sent since the last turn, in order.
    if let Some(rx) = control.as_mut() {
        while let Ok(bytes) = rx.try_recv() {
            match wire::decode::<Control>(&bytes) {
                Ok(c) if c.run_id != task.run_id => {
                    tracing::warn!(control.run_id = %c.run_id, "control message for another run dropped");
                }
                Ok(Control {
                    command: ControlCommand::Terminate { reason },
                    ..
                }) => {
                    tracing::info!(reason = %reason, "branch terminated by control command");
                    let reason = (!reason.is_empty()).then_some(reason);
                    return Ok(Step::Finish(BranchState::Terminated, reason));
                }
                Ok(Control {
                    command: ControlCommand::Steer { text },
                    ..
                }) => {
                    tracing::info!("steering message applied");
                    if let Event::Steer { text } = out.publish(Event::Steer { text }).await? {
                        run.history.push(Message::User { text });
                    }
                }
                Err(e) => tracing::warn!(error = %e, "undecodable control message dropped"),
            }
        }
    }

    if run.turns >= task.max_turns {
        return Ok(Step::Finish(
            BranchState::Failed,
            Some(format!("max_turns ({}) reached", task.max_turns)),
        ));
    }
    if let Some(budget) = task.budget_usd {
        if run.spent_usd >= budget {
            return Ok(Step::Finish(
                BranchState::BudgetExhausted,
                Some(format!(
                    "branch budget of ${budget} reached (spent ${:.6})",
                    run.spent_usd
                )),
            ));
        }
    }

    let req = ModelRequest {
        model: &task.model,
        messages: &run.history,
        tools: tool_specs(),
        max_output_tokens: task.max_output_tokens,
        label: &task.label,
        index: task.index,
        turn: run.turns,
    };
    let reply = match run.provider.complete(&req).await {
        Ok(r) => r,
        Err(e) => {
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
    })
    .await?;
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
        let outcome = run_tool(call, &mut run.overlay, &ctx.blobs).await?;
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
    tracing::info!(
        branch.state = %end,
        branch.turns = turns,
        branch.cost_usd = spent,
        "branch finished"
    );
    if let Err(e) = state.lease.ack().await {
        // The terminal status is out; a redelivery replays a finished branch, which the
        // coordinator ignores (the first terminal state is final).
        tracing::warn!(error = %e, "could not ack a finished branch's task");
    }
    Ok(())
}
