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
//!   check the branch's own cap locally. A branch's first call with a prompt cache waits
//!   for the fork's first call on this worker to warm it (`crate::warmup`). Then call the
//!   model, racing the call against the control channel: `terminate`, `stop` or `pause`
//!   cancels the call (only the usage of what it had streamed is published) and ends the
//!   turn at once, a `steer` is buffered. Publish the call's usage (naming its
//!   reservation) and then its response (with its finish reason; an answer cut at the
//!   output cap with no tool call continues or ends `truncated`, one cut at the branch's
//!   cap ends it), run the tools (each `file_change` after its blob is stored, then the
//!   `tool_result`).
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
//!
//! ## Layout
//! - here: the actor, its state, the [`Publisher`], `Start` and finish.
//! - `turn`: one turn of the loop (`Turn`).
//! - `control`: control commands, filed for the next turn or raced against the work in
//!   flight.
//! - `load`: loading a branch, and replaying what a resumed branch already did.
//! - `coordinator`: requests to the coordinator (`coord.resume`, `coord.budget`) and their
//!   retries.

mod approval;
mod checkpoints;
mod control;
mod coordinator;
mod learn;
mod load;
mod replay;
mod turn;

pub use coordinator::COORDINATOR_TRIES;

use crate::context::WorkerCtx;
use crate::error::WorkerError;
use crate::forktools::AgentForks;
use crate::lease::TaskLease;
use crate::provider::ModelProvider;
use bytes::Bytes;
use coordinator::{resume_log, Resumed};
use forkfleet_bus::Bus;
use forkfleet_shared::blob::BlobHash;
use forkfleet_shared::error::ErrorKind;
use forkfleet_shared::event::{interrupted_results, Event, Message};
use forkfleet_shared::ids::{ForkId, RunId};
use forkfleet_shared::overlay::Overlay;
use forkfleet_shared::protocol::{now_ms, BranchEvent, BranchTask, TaskProof};
use forkfleet_shared::state::BranchState;
use forkfleet_shared::wire;
use load::{load, terminal_state};
use ractor::{Actor, ActorProcessingErr, ActorRef};
use std::sync::Arc;
use tokio::sync::mpsc;
use tracing::Instrument;
use turn::run_turn;

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
struct Pending {
    /// Steers, applied in order before the next call.
    steers: Vec<String>,
    /// A graceful stop or pause that arrived during a call: the call finishes and is
    /// recorded, then the branch ends this way before the next call.
    halt: Option<Step>,
    /// The task's lease: a command saying a later attempt took the branch over loses it
    /// (ADR 18).
    lease: Arc<TaskLease>,
}

impl Pending {
    fn new(lease: Arc<TaskLease>) -> Self {
        Self {
            steers: Vec::new(),
            halt: None,
            lease,
        }
    }
}

/// Why a worker running task `attempt` lost its lease when attempt `by` took over.
fn superseded(by: u32, attempt: u32) -> String {
    format!(
        "superseded: task attempt {by} took the branch over (this worker runs attempt {attempt})"
    )
}

/// True when a steer waits for the next turn: filed during the last call, or sent since
/// (the control commands that arrived are filed now). A stop among them wins: no turn.
fn steers_waiting(state: &mut AgentState) -> bool {
    let (run_id, attempt) = (state.task.run_id, state.out.attempt);
    while let Some(bytes) = state.control.as_mut().and_then(|rx| rx.try_recv().ok()) {
        if let Some(step) = state.pending.file(&bytes, run_id, attempt) {
            state.pending.halt.get_or_insert(step);
        }
    }
    !state.pending.steers.is_empty() && state.pending.halt.is_none()
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
    /// The last call's reservation and cost, sent with the next reservation request (its
    /// usage event may reach the ledger later).
    last_settle: Option<forkfleet_shared::budget::Settle>,
    /// What the branch's calls say of the next one's cost (strict mode).
    learned: learn::Learned,
    /// The forks this branch's agent made (fork tools, ADR 14).
    forks: AgentForks,
    /// The hash of `history` so far, extended before each call (request hashes).
    messages_hash: forkfleet_shared::lineage::MessagesHash,
    /// The task's request hasher (its fixed parts hashed once), from the first call on.
    hasher: Option<forkfleet_shared::lineage::RequestHasher>,
    /// A child of `runs fork --replay` still re-executing its parent's record.
    replay: Option<replay::Replay>,
    /// The prompt-cache family of the branch's calls: its fork tree's root (its fork's
    /// id from an older coordinator).
    cache_key: String,
    /// Messages at the start of `history` that are the fork's shared history.
    shared_prefix: usize,
    /// The tools the task offers, made once per task (with the checkpoint tools, a list
    /// of its own).
    tools: Arc<crate::tools::ToolBox>,
    /// The calls that wait for a person's consent (the task's approval rules, compiled).
    gate: Option<forkfleet_shared::approval::Gate>,
    /// What the branch's log says of the last response's calls that needed consent:
    /// their requests and answers (docs/APPROVALS.md).
    approvals: approval::Answers,
    /// A branch resumed after an answer: the calls of its last response still to run
    /// (the answered one first), before its next model call.
    parked: Option<approval::Parked>,
}

enum Step {
    Continue,
    /// Publish this status as the branch's last event, ack, stop: a terminal state,
    /// `Paused` (a budget cap paused the branch; it is resumed by a new task) or
    /// `AwaitingApproval` (a call waits for consent; an answer resumes it by a new task).
    Finish(BranchState, Option<String>),
    /// Nothing left to do for this task (the branch already finished, or its fork is
    /// gone): ack it without publishing anything.
    Drop(String),
    /// The worker hands its branches back (shutdown): stop without settling the task, so
    /// the node naks it and another worker takes the branch over from its log.
    HandBack,
    /// This worker's lease on the task is lost (why): stop at once, publishing nothing
    /// more and leaving the task unsettled: another worker holds it (ADR 18).
    Lost(String),
}

/// [`Step::Lost`] when this worker's lease on the task is lost: it expired, or the
/// coordinator said a later attempt took the branch over. Checked before every model call
/// and every tool call.
fn lease_lost(lease: &TaskLease) -> Option<Step> {
    lease.check().err().map(Step::Lost)
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
    /// Events published since the last [`Publisher::flush`], encoded: sent together, one
    /// round trip on NATS.
    pending: Vec<bytes::Bytes>,
    /// The coordinator reads batches (the task's `event_batches`): a flush packs its
    /// events into as few messages as the bus carries.
    batches: bool,
    /// Small texts the pending events write, by hash, sent along with them on a remote bus
    /// ([`Publisher::attach`]); each once.
    blobs: Vec<(BlobHash, bytes::Bytes)>,
    blob_bytes: usize,
}

/// A flush's texts sent along with its events, at most (the coordinator fetches the rest).
const ATTACHED_BYTES_MAX: usize = 256 * 1024;

impl Publisher {
    /// Publish one event (sent at the next [`Publisher::flush`]) and hand it back (so its
    /// parts can move into the history).
    async fn publish(&mut self, event: Event) -> Result<Event, WorkerError> {
        let msg = BranchEvent {
            fork_id: self.fork_id,
            run_id: self.run_id,
            seq: self.seq,
            at_ms: now_ms(),
            event,
            attempt: self.attempt,
        };
        self.pending.push(wire::encode(&msg)?);
        self.seq += 1;
        Ok(msg.event)
    }

    /// Whether [`Publisher::attach`] keeps anything.
    fn attaching(&self) -> bool {
        self.batches && self.bus.remote()
    }

    /// Send the contents of a text the pending events write along with them, when the
    /// coordinator reads batches over a remote bus (it then need not fetch it; the blob is
    /// in the bus's store already) and the flush's attachments stay small.
    fn attach(&mut self, hash: BlobHash, bytes: bytes::Bytes) {
        if self.attaching()
            && self.blob_bytes.saturating_add(bytes.len()) <= ATTACHED_BYTES_MAX
            && !self.blobs.iter().any(|(h, _)| *h == hash)
        {
            self.blob_bytes += bytes.len();
            self.blobs.push((hash, bytes));
        }
    }

    /// Send the events published since the last flush, and wait until the bus stored
    /// them: before whatever depends on the coordinator having them (a model call, a
    /// reservation, a tool that calls the coordinator or takes time, reading the
    /// branch's own log back after a rewind, the task's ack or its hand-back).
    async fn flush(&mut self) -> Result<(), WorkerError> {
        if self.pending.is_empty() {
            return Ok(());
        }
        // Packed from where they lie (the pending events stay if packing fails).
        let batch = if self.batches {
            forkfleet_shared::protocol::pack_events_with(
                &self.pending,
                &self.blobs,
                self.bus.max_payload(),
            )?
        } else {
            std::mem::take(&mut self.pending)
        };
        self.pending.clear();
        self.blobs.clear();
        self.blob_bytes = 0;
        self.bus.publish_events(batch).await?;
        Ok(())
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
        // Exported as the GenAI conventions' agent invocation, `invoke_agent {label}`.
        let span = tracing::info_span!(
            "branch.run",
            otel.name = %format_args!("invoke_agent {}", task.label),
            gen_ai.operation.name = "invoke_agent",
            gen_ai.provider.name = crate::genai::provider_name(&task.model),
            gen_ai.agent.name = %task.label,
            // The branch is the agent, its history one conversation: both its run id.
            gen_ai.agent.id = %task.run_id,
            gen_ai.conversation.id = %task.run_id,
            fork.id = %task.fork_id,
            branch.id = %task.run_id,
            branch.label = %task.label,
            branch.index = i64::from(task.index),
            worker.id = %args.ctx.worker_id,
            forkfleet.cost_usd = tracing::field::Empty,
        );
        // Before the span is first entered: the task's trace context is its parent.
        forkfleet_shared::trace::set_parent(&span, args.lease.trace());
        let out = Publisher {
            bus: args.ctx.bus.clone(),
            fork_id: task.fork_id,
            run_id: task.run_id,
            seq: task.first_seq,
            attempt,
            pending: Vec::new(),
            batches: task.event_batches,
            blobs: Vec::new(),
            blob_bytes: 0,
        };
        Ok(AgentState {
            ctx: args.ctx,
            pending: Pending::new(args.lease.clone()),
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
            AgentMsg::Start => start(state).instrument(span.clone()).await,
            AgentMsg::Turn => {
                let turn = state.run.as_ref().map_or(0, |r| r.turns);
                let turn_span = tracing::info_span!(
                    parent: &span,
                    "branch.turn",
                    branch.turn = i64::from(turn),
                    fork.id = %state.task.fork_id,
                    branch.id = %state.task.run_id,
                );
                run_turn(state).instrument(turn_span).await
            }
        };
        let step = match step {
            Ok(step) => step,
            Err(e) => {
                // What the turn published before it failed is not lost.
                if let Err(flush) = state.out.flush().await {
                    tracing::warn!(parent: &span, error = %flush, "could not publish a failed turn's events");
                }
                return Err(e.into());
            }
        };
        match step {
            Step::Continue => {
                // The turn's events, stored before the next turn (one round trip).
                state.out.flush().await?;
                // Fails only when the actor is already stopping (a hand-back).
                let _ = myself.cast(AgentMsg::Turn);
            }
            // A steer that came during the last model call (the answer ended the branch)
            // is not dropped: it starts one more turn, which applies it first.
            Step::Finish(BranchState::Done, _) if steers_waiting(state) => {
                tracing::info!(parent: &span, "a steer came during the last model call: one more turn applies it");
                state.out.flush().await?;
                let _ = myself.cast(AgentMsg::Turn);
            }
            Step::Finish(end, error) => {
                finish(state, end, error).instrument(span).await?;
                myself.stop(None);
            }
            Step::HandBack => {
                // The next worker takes the branch over from what the coordinator has.
                state.out.flush().await?;
                record_cost(state);
                tracing::info!(parent: &span, "call in flight dropped: the worker hands the branch back");
                myself.stop(None);
            }
            Step::Lost(why) => {
                // Counted even from a fenced attempt (a paid call's usage); the rest is
                // dropped by the coordinator.
                if let Err(e) = state.out.flush().await {
                    tracing::warn!(parent: &span, error = %e, "could not publish a lost attempt's events");
                }
                record_cost(state);
                tracing::warn!(
                    parent: &span,
                    fork.id = %state.task.fork_id,
                    run.id = %state.task.run_id,
                    branch.label = %state.task.label,
                    task.attempt = state.out.attempt,
                    reason = %why,
                    "branch stopped: this worker's lease on the task is lost; no more model calls or tools, the task is left to the worker that holds it"
                );
                state.finished = true;
                state.lease.lose(why);
                myself.stop(None);
            }
            Step::Drop(reason) => {
                tracing::info!(parent: &span, reason = %reason, "task dropped");
                if let Err(e) = state.out.flush().await {
                    tracing::warn!(parent: &span, error = %e, "could not publish a dropped task's events");
                }
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
    if let Some(step) = lease_lost(&state.lease) {
        return Ok(step);
    }
    let task = &state.task;
    // Watch before announcing, so a command sent on seeing `running` is not missed.
    state.control = Some(state.ctx.bus.watch_control(task.run_id).await?);
    // A task delivered again (another worker ran this branch and is presumed gone), or
    // enqueued again for a branch that ran before (resumed after a pause): take the branch
    // over from the coordinator's copy of its log, after the coordinator has fenced off the
    // earlier attempts' events.
    let resumed = if state.out.attempt > 1 {
        let proof = state.lease.seq().map(|seq| TaskProof {
            seq,
            delivered: state.lease.attempt(),
        });
        // A hand-back ends a wait for a coordinator that is away.
        let mut handed_back = state.ctx.handback.subscribe();
        let asking = resume_log(&state.ctx.bus, &state.lease, task, state.out.attempt, proof);
        let answer = tokio::select! {
            answer = asking => answer?,
            _ = handed_back.wait_for(|back| *back) => return Ok(Step::HandBack),
        };
        match answer {
            Resumed::Log(events) => {
                if let Some(end) = terminal_state(&events) {
                    return Ok(Step::Drop(format!("the branch already finished as {end}")));
                }
                state.out.seq = events.last().map_or(task.first_seq, |(seq, _)| seq + 1);
                Some(events)
            }
            Resumed::Gone(reason) => return Ok(Step::Drop(reason)),
            Resumed::Refused(reason) => {
                return Ok(Step::Lost(format!(
                    "the coordinator refused the takeover: {reason}"
                )))
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
        task.attempt = state.out.attempt,
        first_seq = task.first_seq,
        resumed = resumed.is_some(),
        "branch started"
    );
    match load(&state.ctx, task, resumed).await {
        Ok(mut run) => {
            // A worker lost between a call and its result: the effect is unknown, so the
            // call is answered as interrupted before the next model call. A branch resumed
            // after an answer runs its last response's remaining calls instead.
            let unanswered = if run.parked.is_some() {
                Vec::new()
            } else {
                interrupted_results(&run.history)
            };
            for result in unanswered {
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

/// Record the branch's spend (a resumed branch's before included) on its span, once, as
/// this task's run of it ends: the OpenTelemetry span keeps every value recorded.
fn record_cost(state: &AgentState) {
    let spent = state.run.as_ref().map_or(0.0, |r| r.spent_usd);
    state.span.record("forkfleet.cost_usd", spent);
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
    state.out.flush().await?;
    state.finished = true;
    record_cost(state);
    // Its command tree stays a while only, for a resolve's tests on this worker.
    state.ctx.trees.finished(&crate::runner::TreeKey {
        fork: state.task.fork_id,
        label: state.task.label.clone(),
    });
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
    } else if end == BranchState::AwaitingApproval {
        tracing::info!(
            branch.turns = turns,
            branch.cost_usd = spent,
            "branch waits for approval; its task is settled, any worker resumes it once answered"
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
