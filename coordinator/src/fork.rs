//! The fork actor: one per fork. It owns the fork's state and every branch's replica,
//! applies the branches' events in order, answers views, resolves settle waiters, and
//! runs diffs and merges off its mailbox (on blocking threads).

use crate::budget::Ledger;
use crate::checkpoint::{self, AutoCheckpoints};
use crate::create::{self, PreparedFork};
use crate::error::{actor_call, list, CoordinatorError};
use crate::merge::{self, MergeDone, MergeInto, MergeJob};
use crate::replica::{BranchReplica, Placement};
use crate::store::{encode, event_key, ForkRecord, RunStore};
use forkfleet_bus::Bus;
use forkfleet_shared::api::{
    AbortOutcome, ContinueOutcome, ForkView, MergeOutcome, SteerOutcome, TerminateOutcome,
};
use forkfleet_shared::diff::{diff_overlays, DiffOptions, DiffReport};
use forkfleet_shared::event::{history_events, interrupted_results, messages_from_events, Event};
use forkfleet_shared::flush::{flush, FlushReport};
use forkfleet_shared::ids::{ForkId, RunId};
use forkfleet_shared::manifest::Manifest;
use forkfleet_shared::overlay::Overlay;
use forkfleet_shared::protocol::{now_ms, BranchEvent, Control, ControlCommand};
use forkfleet_shared::state::{BranchState, ForkState as ForkPhase};
use forkfleet_shared::wire;
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{oneshot, watch};
use tracing::Instrument;

/// How long a call into a fork actor may take before the caller gives up.
pub(crate) const CALL_TIMEOUT_MS: u64 = 30_000;
/// A merge replays a change log and writes a transaction: allow it more.
const MERGE_TIMEOUT_MS: u64 = 120_000;

pub(crate) struct ForkActor;

/// Which branches a [`ForkMsg::Resume`] enqueues again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Requeue {
    /// These, if paused by a budget (a cap was raised).
    Paused(Vec<RunId>),
    /// Every pending or running one: their tasks were lost (an embedded process stopped
    /// mid-fork; its task queue lived in memory).
    Unfinished,
}

/// How the actor gets its fork: fresh from creation, or from the store on start.
pub(crate) enum ForkArgs {
    Created {
        prepared: Box<PreparedFork>,
        store: RunStore,
        bus: Arc<dyn Bus>,
        ledger: Arc<Ledger>,
    },
    Load {
        fork: ForkId,
        store: RunStore,
        bus: Arc<dyn Bus>,
        ledger: Arc<Ledger>,
    },
}

pub(crate) struct ForkState {
    store: RunStore,
    bus: Arc<dyn Bus>,
    ledger: Arc<Ledger>,
    /// Branches a resume (or a follow-up) enqueued a task for that no worker has taken over
    /// yet. The task's `attempt_base` is the branch's [`ForkState::attempt_base`]: nothing
    /// moves the fence or the state it is derived from before a worker takes the task over.
    requeued: HashSet<RunId>,
    /// Branches sent a terminate that have not finished yet, with its reason: a later
    /// attempt that takes one over (its worker was lost before it obeyed) finds it ended.
    stopping: HashMap<RunId, String>,
    record: ForkRecord,
    base: Arc<Manifest>,
    branches: Vec<BranchReplica>,
    by_run: HashMap<RunId, usize>,
    terminal: usize,
    waiters: Vec<oneshot::Sender<ForkView>>,
    version: watch::Sender<u64>,
    merging: bool,
    /// A resolve of this fork is running (tests, judges).
    resolving: bool,
    /// The branches' automatic checkpoints (`checkpoint.rs`).
    checkpoints: AutoCheckpoints,
}

/// What resolving a fork starts from: its record and every
/// branch's record and replica overlay, as of the moment the resolve started.
pub(crate) struct ResolveInputs {
    pub record: ForkRecord,
    pub branches: Vec<(crate::store::BranchRecord, Overlay)>,
}

pub(crate) enum ForkMsg {
    View(RpcReplyPort<ForkView>),
    /// Write and apply a batch of events of this fork (in delivery order). The reply comes
    /// once they are written to the store (not yet flushed).
    ApplyEvents(Vec<BranchEvent>, RpcReplyPort<Result<(), CoordinatorError>>),
    /// A receiver of the version counter.
    Subscribe(RpcReplyPort<watch::Receiver<u64>>),
    /// Answer with the view once every branch is terminal.
    WaitSettled(oneshot::Sender<ForkView>),
    Diff(
        DiffOptions,
        RpcReplyPort<Result<DiffReport, CoordinatorError>>,
    ),
    Merge(
        String,
        MergeInto,
        RpcReplyPort<Result<MergeOutcome, CoordinatorError>>,
    ),
    /// Stop the branch with this label (one already finished is left as it is).
    Terminate(
        String,
        RpcReplyPort<Result<TerminateOutcome, CoordinatorError>>,
    ),
    /// Mark the fork aborted and stop every branch still running.
    Abort(RpcReplyPort<Result<AbortOutcome, CoordinatorError>>),
    /// Send the branch with this label a steering message (label, text).
    Steer(
        String,
        String,
        RpcReplyPort<Result<SteerOutcome, CoordinatorError>>,
    ),
    /// Start a follow-up turn of the finished branch with this label, enqueuing its task
    /// on the pool named (pool, label, text; ADR 13).
    Continue(
        String,
        String,
        String,
        RpcReplyPort<Result<ContinueOutcome, CoordinatorError>>,
    ),
    /// The branch's task was delivered `max_deliver` times without finishing: fail it.
    FailBranch(RunId, String),
    /// A worker took a branch over under task attempt `u32`: drop the events of earlier
    /// attempts from now on, and answer with the branch's log as stored.
    Fence(
        RunId,
        u32,
        RpcReplyPort<Result<Vec<(u64, Event)>, CoordinatorError>>,
    ),
    /// Enqueue a task, on the pool named, for each branch `Requeue` selects that has no
    /// task queued by an earlier resume yet. The reply is how many were enqueued.
    Resume(
        String,
        Requeue,
        RpcReplyPort<Result<usize, CoordinatorError>>,
    ),
    /// Start resolving: check the fork can be resolved and hand over what the resolve
    /// needs. Refused while another resolve of the fork runs.
    ResolveStart(RpcReplyPort<Result<ResolveInputs, CoordinatorError>>),
    /// A resolve started by `ResolveStart` ended (whatever its outcome).
    ResolveEnd,
    /// Append this rewind marker to a finished branch's log at the seq given (its log must
    /// end just before it) and rebuild its overlay from the rewound history. The reply is
    /// the marker's seq.
    Rewind(
        RunId,
        Event,
        u64,
        RpcReplyPort<Result<u64, CoordinatorError>>,
    ),
    /// Replay a merge's change log onto a finished branch whose agent made the merged fork,
    /// appending the file changes and a summary to its log (ADR 14). The reply is the
    /// flush report.
    Adopt(
        RunId,
        Box<MergeOutcome>,
        RpcReplyPort<Result<FlushReport, CoordinatorError>>,
    ),
    /// A merge's blocking part finished.
    MergeFinished(
        Box<Result<MergeDone, CoordinatorError>>,
        RpcReplyPort<Result<MergeOutcome, CoordinatorError>>,
    ),
}

/// The only way other modules talk to a fork actor.
#[derive(Clone)]
pub(crate) struct ForkHandle {
    actor: ActorRef<ForkMsg>,
}

fn call_error<T>(e: ractor::RactorErr<T>, what: &'static str, ms: u64) -> CoordinatorError {
    actor_call(e, "fork actor", what, ms)
}

impl ForkHandle {
    pub fn new(actor: ActorRef<ForkMsg>) -> Self {
        Self { actor }
    }

    pub fn actor(&self) -> &ActorRef<ForkMsg> {
        &self.actor
    }

    pub async fn view(&self) -> Result<ForkView, CoordinatorError> {
        ractor::call_t!(self.actor, ForkMsg::View, CALL_TIMEOUT_MS)
            .map_err(|e| call_error(e, "reading a fork", CALL_TIMEOUT_MS))
    }

    pub async fn subscribe(&self) -> Result<watch::Receiver<u64>, CoordinatorError> {
        ractor::call_t!(self.actor, ForkMsg::Subscribe, CALL_TIMEOUT_MS)
            .map_err(|e| call_error(e, "subscribing to a fork", CALL_TIMEOUT_MS))
    }

    pub async fn apply(&self, events: Vec<BranchEvent>) -> Result<(), CoordinatorError> {
        ractor::call_t!(self.actor, ForkMsg::ApplyEvents, CALL_TIMEOUT_MS, events)
            .map_err(|e| call_error(e, "applying events", CALL_TIMEOUT_MS))?
    }

    pub async fn wait_settled(&self, timeout: Duration) -> Result<ForkView, CoordinatorError> {
        let (tx, rx) = oneshot::channel();
        self.actor
            .cast(ForkMsg::WaitSettled(tx))
            .map_err(|_| CoordinatorError::Closed("fork actor"))?;
        match tokio::time::timeout(timeout, rx).await {
            Ok(Ok(view)) => Ok(view),
            Ok(Err(_)) => Err(CoordinatorError::Closed("fork actor")),
            Err(_) => Err(CoordinatorError::Timeout {
                what: "waiting for the fork to settle",
                ms: timeout.as_millis() as u64,
            }),
        }
    }

    pub async fn diff(&self, opts: DiffOptions) -> Result<DiffReport, CoordinatorError> {
        ractor::call_t!(self.actor, ForkMsg::Diff, MERGE_TIMEOUT_MS, opts)
            .map_err(|e| call_error(e, "a diff", MERGE_TIMEOUT_MS))?
    }

    /// Fail a branch whose task exhausted its deliveries.
    pub fn fail_branch(&self, run: RunId, error: String) -> Result<(), CoordinatorError> {
        self.actor
            .cast(ForkMsg::FailBranch(run, error))
            .map_err(|_| CoordinatorError::Closed("fork actor"))
    }

    /// Fence branch `run` at task `attempt` and read its log (see `resume`).
    pub async fn fence(
        &self,
        run: RunId,
        attempt: u32,
    ) -> Result<Vec<(u64, Event)>, CoordinatorError> {
        ractor::call_t!(self.actor, ForkMsg::Fence, CALL_TIMEOUT_MS, run, attempt)
            .map_err(|e| call_error(e, "fencing a branch", CALL_TIMEOUT_MS))?
    }

    /// Start resolving (see [`ForkMsg::ResolveStart`]); [`ForkHandle::resolve_end`] must
    /// follow, whatever happens.
    pub async fn resolve_start(&self) -> Result<ResolveInputs, CoordinatorError> {
        ractor::call_t!(self.actor, ForkMsg::ResolveStart, CALL_TIMEOUT_MS)
            .map_err(|e| call_error(e, "starting a resolve", CALL_TIMEOUT_MS))?
    }

    pub fn resolve_end(&self) {
        let _ = self.actor.cast(ForkMsg::ResolveEnd);
    }

    /// Merge into a finished branch (see [`ForkMsg::Adopt`]).
    pub async fn adopt(
        &self,
        run: RunId,
        outcome: MergeOutcome,
    ) -> Result<FlushReport, CoordinatorError> {
        ractor::call_t!(
            self.actor,
            ForkMsg::Adopt,
            CALL_TIMEOUT_MS,
            run,
            Box::new(outcome)
        )
        .map_err(|e| call_error(e, "a merge into a branch", CALL_TIMEOUT_MS))?
    }

    /// Rewind a finished branch (see [`ForkMsg::Rewind`]).
    pub async fn rewind(
        &self,
        run: RunId,
        marker: Event,
        seq: u64,
    ) -> Result<u64, CoordinatorError> {
        ractor::call_t!(
            self.actor,
            ForkMsg::Rewind,
            CALL_TIMEOUT_MS,
            run,
            marker,
            seq
        )
        .map_err(|e| call_error(e, "a rewind", CALL_TIMEOUT_MS))?
    }

    pub async fn merge(&self, pick: String) -> Result<MergeOutcome, CoordinatorError> {
        ractor::call_t!(
            self.actor,
            ForkMsg::Merge,
            MERGE_TIMEOUT_MS,
            pick,
            MergeInto::Parent
        )
        .map_err(|e| call_error(e, "a merge", MERGE_TIMEOUT_MS))?
    }

    /// Record branch `pick` as merged into the branch whose agent made this fork, and
    /// return its change log for that branch (see [`MergeInto::Agent`]).
    pub async fn merge_into_agent(&self, pick: String) -> Result<MergeOutcome, CoordinatorError> {
        ractor::call_t!(
            self.actor,
            ForkMsg::Merge,
            MERGE_TIMEOUT_MS,
            pick,
            MergeInto::Agent
        )
        .map_err(|e| call_error(e, "a merge", MERGE_TIMEOUT_MS))?
    }

    /// Enqueue tasks resuming these branches on `pool` (see [`ForkMsg::Resume`]).
    pub async fn resume(&self, pool: String, which: Requeue) -> Result<usize, CoordinatorError> {
        ractor::call_t!(self.actor, ForkMsg::Resume, CALL_TIMEOUT_MS, pool, which)
            .map_err(|e| call_error(e, "resuming branches", CALL_TIMEOUT_MS))?
    }

    pub async fn terminate(&self, label: String) -> Result<TerminateOutcome, CoordinatorError> {
        ractor::call_t!(self.actor, ForkMsg::Terminate, CALL_TIMEOUT_MS, label)
            .map_err(|e| call_error(e, "a terminate", CALL_TIMEOUT_MS))?
    }

    pub async fn abort(&self) -> Result<AbortOutcome, CoordinatorError> {
        ractor::call_t!(self.actor, ForkMsg::Abort, CALL_TIMEOUT_MS)
            .map_err(|e| call_error(e, "an abort", CALL_TIMEOUT_MS))?
    }

    /// Send branch `label` a steering message (see [`ForkMsg::Steer`]).
    pub async fn steer(
        &self,
        label: String,
        text: String,
    ) -> Result<SteerOutcome, CoordinatorError> {
        ractor::call_t!(self.actor, ForkMsg::Steer, CALL_TIMEOUT_MS, label, text)
            .map_err(|e| call_error(e, "a steer", CALL_TIMEOUT_MS))?
    }

    /// Start a follow-up turn of branch `label` (see [`ForkMsg::Continue`]).
    pub async fn follow_up(
        &self,
        pool: String,
        label: String,
        text: String,
    ) -> Result<ContinueOutcome, CoordinatorError> {
        ractor::call_t!(
            self.actor,
            ForkMsg::Continue,
            CALL_TIMEOUT_MS,
            pool,
            label,
            text
        )
        .map_err(|e| call_error(e, "a continue", CALL_TIMEOUT_MS))?
    }
}

impl ForkState {
    fn view(&self) -> ForkView {
        ForkView {
            fork_id: self.record.fork_id,
            parent_run: self.record.parent_run,
            goal: self.record.plan.goal.clone(),
            state: self.record.state.clone(),
            created_at_ms: self.record.created_at_ms,
            snapshot: self.record.snapshot,
            workspace: self.record.workspace.clone(),
            branches: self.branches.iter().map(|b| b.record.view()).collect(),
            keep_artifacts: self.record.plan.resolve.keep_artifacts,
        }
    }

    fn all_terminal(&self) -> bool {
        self.terminal == self.branches.len()
    }

    /// No branch is pending or running: each finished or waits, paused, for a top-up.
    fn quiescent(&self) -> bool {
        self.all_terminal() || self.branches.iter().all(|b| b.record.state.is_stopped())
    }

    fn bump(&self) {
        self.version.send_modify(|v| *v += 1);
    }

    /// Settle the fork if every branch is terminal, and answer the waiters once nothing
    /// runs (branches paused by a budget wait for a top-up, not for time).
    fn check_settled(&mut self) {
        if !self.quiescent() {
            return;
        }
        if self.record.state == ForkPhase::Open && self.all_terminal() {
            self.record.state = ForkPhase::Settled;
            if let Err(e) = self.store.put_fork(&self.record) {
                tracing::error!(fork.id = %self.record.fork_id, error = %e, "fork.settle: cannot write the fork record");
            }
            tracing::info!(fork.id = %self.record.fork_id, branches = self.branches.len(), "fork.settled");
        }
        if !self.waiters.is_empty() {
            let view = self.view();
            for w in self.waiters.drain(..) {
                let _ = w.send(view.clone());
            }
        }
    }

    /// A branch of a settled fork started a new turn (a follow-up, ADR 13): the fork is
    /// open again until every branch has finished again.
    fn reopen(&mut self) {
        if self.record.state != ForkPhase::Settled {
            return;
        }
        self.record.state = ForkPhase::Open;
        if let Err(e) = self.store.put_fork(&self.record) {
            tracing::error!(fork.id = %self.record.fork_id, error = %e, "fork.reopen: cannot write the fork record");
        }
        tracing::info!(fork.id = %self.record.fork_id, "fork.reopened: a follow-up started a new turn");
    }

    /// The index of the branch labelled `label`, or an error naming the valid labels.
    fn branch_index(&self, label: &str) -> Result<usize, CoordinatorError> {
        self.branches
            .iter()
            .position(|b| b.record.label == label)
            .ok_or_else(|| CoordinatorError::UnknownLabel {
                fork: self.record.fork_id,
                label: label.to_string(),
                valid: list(self.branches.iter().map(|b| b.record.label.as_str())),
            })
    }

    /// The index of the branch with run id `run`.
    fn run_index(&self, run: RunId) -> Result<usize, CoordinatorError> {
        self.by_run
            .get(&run)
            .copied()
            .ok_or(CoordinatorError::UnknownRun(run))
    }

    /// The `attempt_base` of a task that runs branch `i` next: its latest takeover's attempt
    /// (at least 1: the first attempt took it over implicitly), so the task's worker
    /// (attempt `attempt_base + 1` and up) takes the branch over from its log. A branch no
    /// worker has started (pending with no events of its own; a pending one with events
    /// waits for its follow-up turn, ADR 13) starts afresh unless something took it over.
    fn attempt_base(&self, i: usize) -> u32 {
        let b = &self.branches[i].record;
        if b.state == BranchState::Pending && b.next_seq == b.first_seq {
            b.min_attempt
        } else {
            b.min_attempt.max(1)
        }
    }

    /// The task attempt branch `i` runs under (or its queued task will, before a worker
    /// takes it): a command addressed to it reaches that worker and no later one (a worker
    /// ignores commands for attempts below its own). The budget's stop commands address
    /// `min_attempt.max(1)` likewise.
    fn current_attempt(&self, i: usize) -> u32 {
        let b = &self.branches[i].record;
        if self.requeued.contains(&b.run_id) {
            self.attempt_base(i).saturating_add(1)
        } else {
            b.min_attempt.max(1)
        }
    }

    /// A worker took over branch `run` under task `attempt`: from now on events of earlier
    /// attempts are dropped, and what they left held beyond a gap is deleted. The answer is
    /// the branch's log as stored, which the worker continues. A branch sent a terminate
    /// its earlier attempt did not obey is ended first (the log says so, and the worker
    /// drops its task): terminates are addressed to an attempt, like every command.
    async fn fence(
        &mut self,
        run: RunId,
        attempt: u32,
    ) -> Result<Vec<(u64, Event)>, CoordinatorError> {
        self.raise_fence(run, attempt)?;
        if let Some(reason) = self.stopping.remove(&run) {
            self.end_branch(run, BranchState::Terminated, reason)?;
            self.store.flush_async().await?;
        }
        self.store.run_log(run)
    }

    /// Fence off every attempt that ran branch `i`, which no worker runs any more: one
    /// above its latest takeover. A task enqueued later (a follow-up, ADR 13) runs above
    /// that, and is taken over by fencing like any other; a worker of an earlier task that
    /// takes the branch over after this finds it finished.
    fn close(&mut self, i: usize) -> Result<(), CoordinatorError> {
        let b = &self.branches[i].record;
        self.raise_fence(b.run_id, b.min_attempt.max(1).saturating_add(1))
    }

    /// Drop the events of task attempts below `attempt` from now on, and what they left
    /// held beyond a gap; persisted with the branch record.
    fn raise_fence(&mut self, run: RunId, attempt: u32) -> Result<(), CoordinatorError> {
        let i = self.run_index(run)?;
        let b = &mut self.branches[i];
        if let Some(held) = b.fence(attempt) {
            if !held.is_empty() {
                self.store.delete_events(run, &held)?;
            }
            self.store.put_branch(&b.record)?;
            tracing::info!(fork.id = %self.record.fork_id, run.id = %run, branch.label = %b.record.label, attempt, dropped_held = held.len(), "fork.fence: a worker took the branch over");
            self.ledger.on_fence(run, attempt);
            self.requeued.remove(&run);
        }
        Ok(())
    }

    /// End a branch whose task no worker could finish: fence off every attempt, then
    /// append a `failed` status as the branch's last event (its partial work is kept).
    fn fail_branch(&mut self, run: RunId, error: String) -> Result<(), CoordinatorError> {
        tracing::warn!(fork.id = %self.record.fork_id, run.id = %run, error = %error, "fork.fail_branch");
        self.end_branch(run, BranchState::Failed, error)
    }

    /// End a branch no worker runs (its task is dead, or it is paused): fence off every
    /// attempt, then append the terminal status as its last event (its work is kept).
    /// Written, not flushed.
    fn end_branch(
        &mut self,
        run: RunId,
        state: BranchState,
        error: String,
    ) -> Result<(), CoordinatorError> {
        let i = self.run_index(run)?;
        if self.branches[i].record.state.is_terminal() {
            return Ok(());
        }
        self.close(i)?;
        self.append_own(
            i,
            vec![Event::Status {
                state,
                error: Some(error),
            }],
        )?;
        Ok(())
    }

    /// Append the coordinator's own `events` to branch `i`'s log at its next seqs, through
    /// the path the workers' events take, under the branch's current fence (so they are
    /// not dropped, and a worker that takes the branch over later fences above them).
    /// Written, not flushed; the answer is the seq of the last one.
    fn append_own(&mut self, i: usize, events: Vec<Event>) -> Result<u64, CoordinatorError> {
        let b = &self.branches[i].record;
        let (fork_id, run_id, attempt, first) =
            (self.record.fork_id, b.run_id, b.min_attempt, b.next_seq);
        let at_ms = now_ms();
        let batch: Vec<BranchEvent> = (first..)
            .zip(events)
            .map(|(seq, event)| BranchEvent {
                fork_id,
                run_id,
                seq,
                at_ms,
                event,
                attempt,
            })
            .collect();
        let last = batch.last().map_or(first, |e| e.seq);
        self.apply_events(batch)?;
        Ok(last)
    }

    /// Refuse to change a branch while its fork is being merged or resolved (they read the
    /// branches as they are); `then` says what to do once it is over.
    fn check_not_busy(&self, then: &str) -> Result<(), CoordinatorError> {
        let activity = if self.merging {
            "merged"
        } else if self.resolving {
            "resolved"
        } else {
            return Ok(());
        };
        Err(CoordinatorError::ForkBusy {
            fork: self.record.fork_id,
            activity,
            then: then.to_string(),
        })
    }

    /// Enqueue, on `pool`, a task that runs branch `i` next: taken over from its log
    /// (above every attempt before it, see [`ForkState::attempt_base`]), with its cap
    /// after top-ups. The answer is the task's `attempt_base`.
    async fn enqueue(&mut self, i: usize, pool: &str) -> Result<u32, CoordinatorError> {
        let fork_id = self.record.fork_id;
        let b = &self.branches[i].record;
        let Some(plan) = self.record.plan.branches.get(b.index as usize) else {
            return Err(CoordinatorError::Internal(format!(
                "branch `{}` has no plan in fork {fork_id}",
                b.label
            )));
        };
        let run_id = b.run_id;
        let mut task = create::branch_task(
            &self.record.plan,
            plan,
            create::BranchIds {
                fork_id,
                run_id,
                index: b.index,
            },
            self.record.prefix,
            self.record.snapshot,
            b.first_seq,
        );
        task.attempt_base = self.attempt_base(i);
        task.budget_usd = self.ledger.run_cap(run_id);
        self.bus.enqueue_task(pool, wire::encode(&task)?).await?;
        self.requeued.insert(run_id);
        Ok(task.attempt_base)
    }

    /// Stop branch `i`: a running one is sent a terminate command; a paused one (no worker
    /// runs it) is ended here, in the store but not flushed: true then, and the caller
    /// flushes once for all it stopped.
    async fn stop_branch(&mut self, i: usize, reason: String) -> Result<bool, CoordinatorError> {
        if self.branches[i].record.state == BranchState::Paused {
            let run = self.branches[i].record.run_id;
            self.end_branch(run, BranchState::Terminated, reason)?;
            return Ok(true);
        }
        self.send_terminate(i, reason).await?;
        Ok(false)
    }

    /// Enqueue a task for each branch of `runs` that `which` selects, taking it over from
    /// its log (above every attempt before it) with its cap after top-ups. A branch no
    /// worker has started yet starts afresh.
    async fn resume(&mut self, pool: &str, which: Requeue) -> Result<usize, CoordinatorError> {
        let runs: Vec<RunId> = match which {
            Requeue::Paused(runs) => runs
                .into_iter()
                .filter(|r| {
                    self.by_run
                        .get(r)
                        .is_some_and(|&i| self.branches[i].record.state == BranchState::Paused)
                })
                .collect(),
            Requeue::Unfinished if self.record.state.is_resolved() => Vec::new(),
            Requeue::Unfinished => self
                .branches
                .iter()
                .filter(|b| matches!(b.record.state, BranchState::Pending | BranchState::Running))
                .map(|b| b.record.run_id)
                .collect(),
        };
        let mut sent = 0;
        for run in runs {
            let Some(&i) = self.by_run.get(&run) else {
                continue;
            };
            // A second top-up before the worker took the first task over must not start a
            // second worker on the branch.
            if self.requeued.contains(&run) {
                continue;
            }
            let attempt_base = self.enqueue(i, pool).await?;
            let b = &self.branches[i].record;
            tracing::info!(fork.id = %self.record.fork_id, branch.label = %b.label, branch.state = %b.state, attempt_base, "fork.resume: a branch was enqueued again");
            sent += 1;
        }
        Ok(sent)
    }

    /// Write a batch, then apply it. Nothing in memory changes unless the write succeeded.
    fn apply_events(&mut self, events: Vec<BranchEvent>) -> Result<(), CoordinatorError> {
        let fork_id = self.record.fork_id;
        // Pass 1: write every event that is not a duplicate as of now.
        // The first copy of a (run, seq) is the one applied, so it is the one written.
        let mut batch = sled::Batch::default();
        let mut written: HashSet<(RunId, u64)> = HashSet::with_capacity(events.len());
        for ev in &events {
            let Some(&i) = self.by_run.get(&ev.run_id) else {
                continue;
            };
            if self.branches[i].fenced(ev.attempt) {
                continue;
            }
            if self.branches[i].placement(ev.seq) != Placement::Duplicate
                && written.insert((ev.run_id, ev.seq))
            {
                batch.insert(&event_key(ev.run_id, ev.seq), encode("event", &ev.event)?);
            }
        }
        if !written.is_empty() {
            self.store.apply_event_batch(batch)?;
        }
        // Pass 2: apply in memory.
        let mut changed = false;
        for ev in events {
            let Some(&i) = self.by_run.get(&ev.run_id) else {
                tracing::error!(fork.id = %fork_id, run.id = %ev.run_id, seq = ev.seq, "fork.event: run is not a branch of this fork; dropped");
                continue;
            };
            let b = &mut self.branches[i];
            if b.fenced(ev.attempt) {
                tracing::warn!(fork.id = %fork_id, run.id = %ev.run_id, seq = ev.seq, attempt = ev.attempt, "fork.event: an earlier task attempt's event after a takeover; dropped");
                continue;
            }
            let run_id = ev.run_id;
            let effect = b.arrive(ev.seq, ev.event);
            if effect.applied > 0 {
                changed = true;
                self.checkpoints
                    .on_applied(&self.store, run_id, &effect.steps);
            }
            for (cost, reservation) in effect.usage {
                let actions = self.ledger.on_usage(run_id, cost, reservation);
                self.ledger.send(actions);
            }
            if effect.became_terminal {
                self.terminal += 1;
                self.stopping.remove(&run_id);
            }
            if effect.reopened {
                // A follow-up started a new turn of a finished branch (ADR 13).
                self.terminal = self.terminal.saturating_sub(1);
                self.reopen();
            }
            if effect.state_changed {
                let b = &self.branches[i];
                self.ledger.on_state(run_id, b.record.state);
                self.requeued.remove(&run_id);
                tracing::debug!(fork.id = %fork_id, branch.label = %b.record.label, state = %b.record.state, "fork.branch_state");
                if let Err(e) = self.store.put_branch(&b.record) {
                    tracing::error!(fork.id = %fork_id, branch.label = %b.record.label, error = %e, "fork.branch_state: cannot write the branch record");
                }
            }
        }
        if changed {
            self.check_settled();
            self.bump();
        }
        Ok(())
    }

    /// Rewind a finished branch: fence off the attempts that ran it, append `marker` at
    /// `seq` (the branch's log must end just before it: nothing changed since the rewind
    /// was worked out), and rebuild its overlay from the rewound history.
    async fn rewind(
        &mut self,
        run: RunId,
        marker: Event,
        seq: u64,
    ) -> Result<u64, CoordinatorError> {
        let fork_id = self.record.fork_id;
        let i = self.run_index(run)?;
        self.check_not_busy("rewind its branches")?;
        let b = &self.branches[i].record;
        if !b.state.is_terminal() {
            return Err(CoordinatorError::RewindRunning {
                run,
                fork: fork_id,
                label: b.label.clone(),
                state: b.state,
            });
        }
        if b.next_seq != seq {
            return Err(CoordinatorError::RewindRaced {
                label: b.label.clone(),
            });
        }
        self.close(i)?;
        self.append_own(i, vec![marker])?;
        let log = self.store.run_log(run)?;
        checkpoint::apply_rewind(&mut self.branches[i], &self.base, &log)?;
        self.store.put_branch(&self.branches[i].record)?;
        self.store.flush_async().await?;
        self.bump();
        Ok(seq)
    }

    /// Merge a fork made by a finished branch's agent into that branch: replay the
    /// winner's change log onto the branch's overlay (conflicts against the inner fork's
    /// snapshot, its conflict policy), and append the resulting file changes and a summary
    /// to the branch's log as the coordinator's own events.
    async fn adopt(
        &mut self,
        run: RunId,
        outcome: MergeOutcome,
    ) -> Result<FlushReport, CoordinatorError> {
        let fork_id = self.record.fork_id;
        let i = self.run_index(run)?;
        self.check_not_busy(&format!("merge fork {}", outcome.fork_id))?;
        let b = &self.branches[i];
        if !b.record.state.is_terminal() {
            return Err(CoordinatorError::AgentStillRunning {
                fork: fork_id,
                label: b.record.label.clone(),
                state: b.record.state,
                child: outcome.fork_id,
            });
        }
        let bytes = self
            .store
            .blob(&outcome.fork_snapshot)?
            .ok_or_else(|| CoordinatorError::missing_blobs(&[outcome.fork_snapshot]))?;
        let snapshot = Manifest::from_blob(&bytes).map_err(|e| CoordinatorError::BadSnapshot {
            hash: outcome.fork_snapshot,
            message: e.to_string(),
        })?;
        let mut overlay = b.overlay.clone();
        let before = overlay.changes().len();
        let report = flush(
            &outcome.changes,
            &snapshot,
            &mut overlay,
            outcome.conflict_policy,
        );
        let mut events: Vec<Event> = overlay.changes()[before..]
            .iter()
            .map(|op| Event::FileChange { change: op.clone() })
            .collect();
        events.push(Event::BranchSummary {
            text: merge_summary(&outcome, &report),
        });
        self.append_own(i, events)?;
        self.store.put_branch(&self.branches[i].record)?;
        self.store.flush_async().await?;
        self.bump();
        Ok(report)
    }

    /// Send branch `i` a terminate command, addressed to the attempt that runs it like
    /// every command (a later attempt, or a later turn's worker re-reading the run's
    /// control stream on NATS, ignores it). Should that worker be lost before it obeys,
    /// the attempt that takes the branch over finds it ended (see [`ForkState::fence`]).
    async fn send_terminate(&mut self, i: usize, reason: String) -> Result<(), CoordinatorError> {
        let run_id = self.branches[i].record.run_id;
        let control = Control {
            run_id,
            command: ControlCommand::Terminate {
                reason: reason.clone(),
            },
            attempt: Some(self.current_attempt(i)),
        };
        self.bus
            .send_control(run_id, wire::encode(&control)?)
            .await?;
        self.stopping.insert(run_id, reason);
        Ok(())
    }

    /// Stop one branch. A branch already terminal is left as it is (`sent: false`).
    async fn terminate(&mut self, label: &str) -> Result<TerminateOutcome, CoordinatorError> {
        let fork_id = self.record.fork_id;
        let i = self.branch_index(label)?;
        let b = &self.branches[i].record;
        let (run_id, state) = (b.run_id, b.state);
        let sent = !state.is_terminal();
        if sent
            && self
                .stop_branch(i, format!("terminated by request (fork {fork_id})"))
                .await?
        {
            self.store.flush_async().await?;
        }
        tracing::info!(fork.id = %fork_id, branch.label = %label, branch.state = %state, sent, "fork.terminate");
        Ok(TerminateOutcome {
            fork_id,
            label: label.to_string(),
            run_id,
            state,
            sent,
        })
    }

    /// Send branch `label` a steering message: a control command addressed to the attempt
    /// that runs it (or will: a pending branch's worker reads it when it starts). The worker
    /// applies it before its next model call and publishes it as a `steer` event. Only a
    /// pending or running branch can be steered; nothing is sent anywhere else.
    async fn steer(&mut self, label: &str, text: String) -> Result<SteerOutcome, CoordinatorError> {
        let fork_id = self.record.fork_id;
        let i = self.branch_index(label)?;
        if text.trim().is_empty() {
            return Err(CoordinatorError::EmptyMessage {
                what: "steering message",
            });
        }
        let b = &self.branches[i].record;
        let (run_id, state) = (b.run_id, b.state);
        match state {
            BranchState::Pending | BranchState::Running => {}
            BranchState::Paused => {
                return Err(CoordinatorError::SteerPaused {
                    fork: fork_id,
                    label: label.to_string(),
                })
            }
            _ => {
                return Err(CoordinatorError::SteerFinished {
                    fork: fork_id,
                    label: label.to_string(),
                    state,
                })
            }
        }
        if self.record.state.is_resolved() {
            return Err(CoordinatorError::SteerStopping {
                fork: fork_id,
                phase: self.record.state.as_str(),
            });
        }
        let attempt = self.current_attempt(i);
        let control = Control {
            run_id,
            command: ControlCommand::Steer { text },
            attempt: Some(attempt),
        };
        self.bus
            .send_control(run_id, wire::encode(&control)?)
            .await?;
        tracing::info!(fork.id = %fork_id, branch.label = %label, branch.state = %state, attempt, "fork.steer: sent");
        Ok(SteerOutcome {
            fork_id,
            label: label.to_string(),
            run_id,
            state,
            attempt,
        })
    }

    /// The checks of a follow-up on branch `i` (ADR 13): the fork is open or settled and
    /// not being merged or resolved; the branch finished `done`, `failed` or `terminated`
    /// (stopped by a cap: only once the cap has room again).
    fn check_follow_up(&self, i: usize) -> Result<(), CoordinatorError> {
        let fork_id = self.record.fork_id;
        match &self.record.state {
            ForkPhase::Merged { winner } => {
                return Err(CoordinatorError::ContinueMerged {
                    fork: fork_id,
                    winner: winner.clone(),
                })
            }
            ForkPhase::Aborted => return Err(CoordinatorError::ContinueAborted(fork_id)),
            ForkPhase::Open | ForkPhase::Settled => {}
        }
        self.check_not_busy("continue its branches (if it does not merge)")?;
        let b = &self.branches[i].record;
        let label = &b.label;
        match b.state {
            BranchState::Done | BranchState::Failed | BranchState::Terminated => Ok(()),
            BranchState::BudgetExhausted | BranchState::AggregateBudgetExhausted => {
                match self.budget_room(b.run_id) {
                    None => Ok(()),
                    Some(full) => Err(CoordinatorError::CapFull {
                        fork: fork_id,
                        label: label.clone(),
                        state: b.state,
                        full,
                    }),
                }
            }
            BranchState::Paused => Err(CoordinatorError::ContinuePaused {
                fork: fork_id,
                label: label.clone(),
            }),
            BranchState::Pending | BranchState::Running => Err(CoordinatorError::ContinueRunning {
                fork: fork_id,
                label: label.clone(),
                state: b.state,
            }),
        }
    }

    /// Which cap has no room left for branch `run` (its own, its fork's, its account's),
    /// if any.
    fn budget_room(&self, run: RunId) -> Option<&'static str> {
        let cost = self.ledger.fork_cost(self.record.fork_id).ok()?;
        let full = |remaining: Option<f64>| remaining.is_some_and(|r| r <= 0.0);
        if cost
            .branches
            .iter()
            .any(|b| b.run_id == run && full(b.remaining_usd))
        {
            Some("its cap")
        } else if full(cost.remaining_usd) {
            Some("the fork's cap")
        } else if cost.account.as_ref().is_some_and(|a| full(a.remaining_usd)) {
            Some("the account's cap")
        } else {
            None
        }
    }

    /// Start a follow-up turn of branch `label` with the user message `text` (ADR 13).
    ///
    /// Its task is enqueued again as a resumed branch's is ([`ForkState::enqueue`]: above
    /// every attempt before it, so a worker takes it over from the log), then a `follow_up`
    /// event (after interrupted results for tool calls a lost worker left unanswered) is
    /// appended at the branch's next seq under its current fence: applying it re-opens the
    /// branch (pending) and the fork. In that order, a failure leaves at worst a task that finds the branch finished
    /// and is dropped, never a re-opened branch without a task. Both happen before this
    /// actor reads its next message, so the worker's takeover finds the event in the log.
    async fn follow_up(
        &mut self,
        pool: &str,
        label: &str,
        text: String,
    ) -> Result<ContinueOutcome, CoordinatorError> {
        let fork_id = self.record.fork_id;
        let i = self.branch_index(label)?;
        if text.trim().is_empty() {
            return Err(CoordinatorError::EmptyMessage {
                what: "follow-up message",
            });
        }
        self.check_follow_up(i)?;
        let b = &self.branches[i].record;
        let (run_id, previous) = (b.run_id, b.state);
        // What a lost worker left unanswered (the model API needs a result for every call
        // before the next user message).
        let log = self.store.run_log(run_id)?;
        let history = messages_from_events(history_events(&log, None).into_iter().map(|(_, e)| e));
        let mut events = interrupted_results(&history);
        events.push(Event::FollowUp { text });
        let attempt_base = self.enqueue(i, pool).await?;
        let seq = self.append_own(i, events)?;
        self.store.flush_async().await?;
        let b = &self.branches[i];
        tracing::info!(fork.id = %fork_id, branch.label = %label, previous = %previous, seq, attempt_base, "fork.follow_up: a new turn was enqueued");
        Ok(ContinueOutcome {
            fork_id,
            label: label.to_string(),
            run_id,
            previous,
            seq,
            branch: b.record.view(),
            fork_state: self.record.state.clone(),
        })
    }

    /// Mark the fork aborted (durably), then stop every branch still running. Aborting an
    /// aborted fork changes nothing; a merged fork cannot be aborted.
    async fn abort(&mut self) -> Result<AbortOutcome, CoordinatorError> {
        let fork_id = self.record.fork_id;
        match &self.record.state {
            ForkPhase::Merged { winner } => {
                return Err(CoordinatorError::AlreadyMerged {
                    fork: fork_id,
                    winner: winner.clone(),
                })
            }
            ForkPhase::Aborted => {
                return Ok(AbortOutcome {
                    terminated: Vec::new(),
                    changed: false,
                    view: self.view(),
                })
            }
            ForkPhase::Open | ForkPhase::Settled => {}
        }
        if self.merging {
            return Err(CoordinatorError::MergeInProgress(fork_id));
        }
        let mut record = self.record.clone();
        record.state = ForkPhase::Aborted;
        self.store.put_fork(&record)?;
        self.store.flush_async().await?;
        self.record = record;
        let mut terminated = Vec::new();
        let mut ended = false;
        for i in 0..self.branches.len() {
            if self.branches[i].record.state.is_terminal() {
                continue;
            }
            let label = self.branches[i].record.label.clone();
            match self
                .stop_branch(i, format!("fork {fork_id} was aborted"))
                .await
            {
                Ok(here) => {
                    ended |= here;
                    terminated.push(label);
                }
                Err(e) => {
                    tracing::warn!(fork.id = %fork_id, branch.label = %label, error = %e, "fork.abort: cannot send terminate")
                }
            }
        }
        if ended {
            self.store.flush_async().await?;
        }
        tracing::info!(fork.id = %fork_id, terminated = terminated.len(), "fork.aborted");
        self.bump();
        Ok(AbortOutcome {
            terminated,
            changed: true,
            view: self.view(),
        })
    }

    /// The fork can still merge: not merged, not aborted, no merge under way.
    fn check_mergeable(&self) -> Result<(), CoordinatorError> {
        let fork = self.record.fork_id;
        match &self.record.state {
            ForkPhase::Merged { winner } => Err(CoordinatorError::AlreadyMerged {
                fork,
                winner: winner.clone(),
            }),
            ForkPhase::Aborted => Err(CoordinatorError::Aborted(fork)),
            ForkPhase::Open | ForkPhase::Settled if self.merging => {
                Err(CoordinatorError::MergeInProgress(fork))
            }
            ForkPhase::Open | ForkPhase::Settled => Ok(()),
        }
    }

    /// The checks of a resolve: the fork is open or settled, not being merged or resolved,
    /// and every branch has finished (a paused branch must be topped up or terminated
    /// first). Marks the fork as resolving.
    fn resolve_start(&mut self) -> Result<ResolveInputs, CoordinatorError> {
        let fork = self.record.fork_id;
        self.check_mergeable()?;
        if self.resolving {
            return Err(CoordinatorError::ResolveInProgress(fork));
        }
        let unfinished: Vec<String> = self
            .branches
            .iter()
            .filter(|b| !b.record.state.is_terminal())
            .map(|b| format!("`{}` ({})", b.record.label, b.record.state))
            .collect();
        if !unfinished.is_empty() {
            return Err(CoordinatorError::Unfinished { fork, unfinished });
        }
        self.resolving = true;
        Ok(ResolveInputs {
            record: self.record.clone(),
            branches: self
                .branches
                .iter()
                .map(|b| (b.record.clone(), b.overlay.clone()))
                .collect(),
        })
    }

    /// The request checks of a merge; the winner's index.
    fn check_merge(&self, pick: &str) -> Result<usize, CoordinatorError> {
        self.check_mergeable()?;
        let i = self.branch_index(pick)?;
        let state = self.branches[i].record.state;
        if !state.is_terminal() {
            return Err(CoordinatorError::StillRunning {
                label: pick.to_string(),
                state,
            });
        }
        Ok(i)
    }
}

type Loaded = (
    ForkRecord,
    Arc<Manifest>,
    Vec<BranchReplica>,
    AutoCheckpoints,
);

fn load(store: &RunStore, fork: ForkId) -> Result<Loaded, CoordinatorError> {
    let record = store
        .fork(fork)?
        .ok_or_else(|| CoordinatorError::UnknownFork(fork.to_string()))?;
    let base = load_manifest(store, &record)?;
    let policy = record.plan.limits.checkpoints;
    let mut replicas = Vec::new();
    let mut steps = Vec::new();
    for b in store.branches(fork)? {
        let run = b.run_id;
        let stored = store.stored_events(run)?;
        let rewound = checkpoint::has_rewind(&stored);
        let (mut replica, applied) = BranchReplica::rebuild(b, base.clone(), stored);
        steps.push((run, applied));
        if rewound {
            checkpoint::apply_rewind(&mut replica, &base, &store.run_log(run)?)?;
        }
        replicas.push(replica);
    }
    let checkpoints = AutoCheckpoints::load(store, policy, record.snapshot, steps)?;
    Ok((record, base, replicas, checkpoints))
}

fn load_manifest(store: &RunStore, record: &ForkRecord) -> Result<Arc<Manifest>, CoordinatorError> {
    let bytes = store
        .blob(&record.snapshot)?
        .ok_or_else(|| CoordinatorError::missing_blobs(&[record.snapshot]))?;
    let m = Manifest::from_blob(&bytes).map_err(|e| CoordinatorError::BadSnapshot {
        hash: record.snapshot,
        message: e.to_string(),
    })?;
    Ok(Arc::new(m))
}

impl Actor for ForkActor {
    type Msg = ForkMsg;
    type State = ForkState;
    type Arguments = ForkArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<Self::Msg>,
        args: Self::Arguments,
    ) -> Result<Self::State, ActorProcessingErr> {
        let (store, bus, ledger, record, base, branches, checkpoints) = match args {
            ForkArgs::Created {
                prepared,
                store,
                bus,
                ledger,
            } => {
                let PreparedFork {
                    fork,
                    branches,
                    base,
                    ..
                } = *prepared;
                let replicas = branches
                    .into_iter()
                    .map(|b| BranchReplica::new(b, base.clone()))
                    .collect();
                let checkpoints = AutoCheckpoints::new(fork.plan.limits.checkpoints, fork.snapshot);
                (store, bus, ledger, fork, base, replicas, checkpoints)
            }
            ForkArgs::Load {
                fork,
                store,
                bus,
                ledger,
            } => {
                let s = store.clone();
                let (record, base, replicas, checkpoints) =
                    tokio::task::spawn_blocking(move || load(&s, fork)).await??;
                (store, bus, ledger, record, base, replicas, checkpoints)
            }
        };
        let records: Vec<_> = branches.iter().map(|b| b.record.clone()).collect();
        ledger.register_fork(&record, &records);
        let by_run = branches
            .iter()
            .enumerate()
            .map(|(i, b)| (b.record.run_id, i))
            .collect();
        let terminal = branches
            .iter()
            .filter(|b| b.record.state.is_terminal())
            .count();
        let (version, _) = watch::channel(0u64);
        let mut state = ForkState {
            store,
            bus,
            ledger,
            requeued: HashSet::new(),
            stopping: HashMap::new(),
            record,
            base,
            branches,
            by_run,
            terminal,
            waiters: Vec::new(),
            version,
            merging: false,
            resolving: false,
            checkpoints,
        };
        // A follow-up re-opened a branch, and the coordinator stopped before the fork record
        // said so (ADR 13).
        if !state.all_terminal() {
            state.reopen();
        }
        // A fork whose branches all finished while the coordinator was down.
        state.check_settled();
        Ok(state)
    }

    async fn handle(
        &self,
        myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            ForkMsg::View(reply) => {
                let _ = reply.send(state.view());
            }
            ForkMsg::ApplyEvents(events, reply) => {
                let _ = reply.send(state.apply_events(events));
            }
            ForkMsg::Subscribe(reply) => {
                let _ = reply.send(state.version.subscribe());
            }
            ForkMsg::WaitSettled(tx) => {
                if state.quiescent() {
                    let _ = tx.send(state.view());
                } else {
                    state.waiters.retain(|w| !w.is_closed());
                    state.waiters.push(tx);
                }
            }
            ForkMsg::Diff(opts, reply) => {
                let span = tracing::info_span!("fork.diff", fork.id = %state.record.fork_id, branches = state.branches.len());
                let labelled: Vec<(String, Overlay)> = state
                    .branches
                    .iter()
                    .map(|b| (b.record.label.clone(), b.overlay.clone()))
                    .collect();
                let base = state.base.clone();
                let store = state.store.clone();
                tokio::task::spawn_blocking(move || {
                    let _enter = span.enter();
                    let inputs: Vec<(&str, &Overlay)> =
                        labelled.iter().map(|(l, o)| (l.as_str(), o)).collect();
                    let lookup =
                        |h: &forkfleet_shared::blob::BlobHash| store.blob(h).ok().flatten();
                    let report = diff_overlays(&base, &inputs, &lookup, &opts);
                    tracing::info!(paths = report.summary.total_paths_touched, "fork.diff done");
                    let _ = reply.send(Ok(report));
                });
            }
            ForkMsg::Fence(run, attempt, reply) => {
                let _ = reply.send(state.fence(run, attempt).await);
            }
            ForkMsg::FailBranch(run, error) => {
                if let Err(e) = state.fail_branch(run, error) {
                    tracing::error!(fork.id = %state.record.fork_id, run.id = %run, error = %e, "fork.fail_branch: could not record the failure");
                }
            }
            ForkMsg::Merge(pick, into, reply) => {
                let span = tracing::info_span!("fork.merge", fork.id = %state.record.fork_id, branch.label = %pick);
                let i = match span.in_scope(|| state.check_merge(&pick)) {
                    Ok(i) => i,
                    Err(e) => {
                        span.in_scope(|| tracing::info!(error = %e, "fork.merge refused"));
                        let _ = reply.send(Err(e));
                        return Ok(());
                    }
                };
                state.merging = true;
                let winner = &state.branches[i];
                let job = MergeJob {
                    into,
                    store: state.store.clone(),
                    fork: state.record.clone(),
                    winner: winner.record.clone(),
                    changes: winner.overlay.changes().to_vec(),
                    fork_snapshot: state.base.clone(),
                    now_ms: now_ms(),
                };
                tokio::spawn(
                    async move {
                        let result = tokio::task::spawn_blocking(move || merge::run(job))
                            .await
                            .map_err(CoordinatorError::from)
                            .and_then(|r| r);
                        if let Err(ractor::MessagingErr::SendErr(ForkMsg::MergeFinished(
                            _,
                            reply,
                        ))) = myself.cast(ForkMsg::MergeFinished(Box::new(result), reply))
                        {
                            let _ = reply.send(Err(CoordinatorError::Closed("fork actor")));
                        }
                    }
                    .instrument(span),
                );
            }
            ForkMsg::Resume(pool, which, reply) => {
                let _ = reply.send(state.resume(&pool, which).await);
            }
            ForkMsg::Terminate(label, reply) => {
                let _ = reply.send(state.terminate(&label).await);
            }
            ForkMsg::Abort(reply) => {
                let _ = reply.send(state.abort().await);
            }
            ForkMsg::Steer(label, text, reply) => {
                let _ = reply.send(state.steer(&label, text).await);
            }
            ForkMsg::Continue(pool, label, text, reply) => {
                let _ = reply.send(state.follow_up(&pool, &label, text).await);
            }
            ForkMsg::ResolveStart(reply) => {
                let _ = reply.send(state.resolve_start());
            }
            ForkMsg::ResolveEnd => state.resolving = false,
            ForkMsg::Adopt(run, outcome, reply) => {
                let _ = reply.send(state.adopt(run, *outcome).await);
            }
            ForkMsg::Rewind(run, marker, seq, reply) => {
                let _ = reply.send(state.rewind(run, marker, seq).await);
            }
            ForkMsg::MergeFinished(result, reply) => {
                state.merging = false;
                let done = match *result {
                    Ok(done) => done,
                    Err(e) => {
                        tracing::error!(fork.id = %state.record.fork_id, error = %e, "fork.merge failed");
                        let _ = reply.send(Err(e));
                        return Ok(());
                    }
                };
                state.record = done.fork;
                let fork_id = state.record.fork_id;
                // Clients applying the merge read the manifest from the bus's blob store.
                let hash = done.outcome.merged_snapshot;
                // (A merge into an agent's branch makes no new parent version.)
                if let Some(bytes) = done.merged_manifest {
                    if let Err(e) = state.bus.blobs().put(hash, bytes).await {
                        tracing::warn!(fork.id = %fork_id, error = %e, "fork.merge: cannot publish the merged manifest");
                    }
                }
                // Stop the losers that are still running or paused.
                let reason = format!("fork {fork_id} merged branch `{}`", done.outcome.winner);
                let mut ended = false;
                for i in 0..state.branches.len() {
                    if state.branches[i].record.state.is_terminal() {
                        continue;
                    }
                    match state.stop_branch(i, reason.clone()).await {
                        Ok(here) => ended |= here,
                        Err(e) => {
                            tracing::warn!(fork.id = %fork_id, branch.label = %state.branches[i].record.label, error = %e, "fork.merge: cannot stop a losing branch")
                        }
                    }
                }
                if ended {
                    if let Err(e) = state.store.flush_async().await {
                        tracing::warn!(fork.id = %fork_id, error = %e, "fork.merge: cannot flush the stopped losers");
                    }
                }
                tracing::info!(
                    fork.id = %fork_id,
                    branch.label = %done.outcome.winner,
                    applied = done.outcome.report.applied_paths.len(),
                    conflicts = done.outcome.report.conflicts.len(),
                    "fork.merged"
                );
                state.bump();
                let _ = reply.send(Ok(done.outcome));
            }
        }
        Ok(())
    }
}

/// What a branch's history says about a fork of its agent that was merged into it.
pub(crate) fn merge_summary(outcome: &MergeOutcome, report: &FlushReport) -> String {
    let mut text = format!(
        "fork {} merged branch `{}` into this run: {} path(s) applied, {} conflict(s) under {}",
        outcome.fork_id,
        outcome.winner,
        report.applied_paths.len(),
        report.conflicts.len(),
        outcome.conflict_policy,
    );
    if !report.conflicts.is_empty() {
        let paths: Vec<String> = report.conflicts.iter().map(|p| p.to_string()).collect();
        text.push_str(&format!(" ({})", paths.join(", ")));
    }
    if let Some(summary) = &outcome.summary {
        text.push_str(&format!(". Its last answer: {summary}"));
    }
    text
}
