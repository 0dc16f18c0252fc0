//! The fork actor: one per fork. It owns the fork's state and every branch's replica,
//! applies the branches' events in order, answers views, resolves settle waiters, and
//! runs diffs and merges off its mailbox (on blocking threads).
//!
//! This file holds the actor, its messages ([`ForkMsg`]), its state ([`ForkState`]) with
//! the views and settling, loading a fork from the store, and the message handler. The
//! state's work is in `fork/events.rs` (applying events, fences), `fork/fencing.rs`
//! (takeovers, fenced spend, branches left without a runner, ADR 18), `fork/control.rs`
//! (resume, follow-up, steer, terminate, abort), `fork/approvals.rs` (answers to requests
//! for consent and their timers) and `fork/merging.rs` (merge, resolve, adopt, rewind);
//! [`ForkHandle`] is in `fork/handle.rs`.

mod approvals;
mod control;
mod events;
mod fencing;
mod handle;
mod merging;

pub(crate) use approvals::Answer;
pub(crate) use fencing::DeadTask;
pub(crate) use handle::ForkHandle;

use crate::budget::Ledger;
use crate::checkpoint::{self, AutoCheckpoints};
use crate::create::PreparedFork;
use crate::error::{list, CoordinatorError};
use crate::merge::{MergeDone, MergeInto};
use crate::replica::BranchReplica;
use crate::store::{ForkRecord, RunStore};
use forkfleet_bus::Bus;
use forkfleet_shared::api::{
    AbortOutcome, ContinueOutcome, DecisionOutcome, ForkView, MergeOutcome, SteerOutcome,
    TerminateOutcome,
};
use forkfleet_shared::blob::BlobHash;
use forkfleet_shared::clock::Clock;
use forkfleet_shared::diff::{diff_overlays, DiffOptions, DiffReport};
use forkfleet_shared::event::Event;
use forkfleet_shared::flush::FlushReport;
use forkfleet_shared::ids::{ForkId, RunId};
use forkfleet_shared::manifest::Manifest;
use forkfleet_shared::overlay::Overlay;
use forkfleet_shared::protocol::BranchEvent;
use forkfleet_shared::state::ForkState as ForkPhase;
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use tokio::sync::{oneshot, watch};

/// How long a call into a fork actor may take before the caller gives up.
pub(crate) const CALL_TIMEOUT_MS: u64 = 30_000;

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
        pool: String,
        store: RunStore,
        bus: Arc<dyn Bus>,
        ledger: Arc<Ledger>,
        clock: Arc<dyn Clock>,
    },
    Load {
        fork: ForkId,
        pool: String,
        store: RunStore,
        bus: Arc<dyn Bus>,
        ledger: Arc<Ledger>,
        clock: Arc<dyn Clock>,
    },
}

pub(crate) struct ForkState {
    /// The pool the branches' tasks go to when the actor enqueues one itself (an answer
    /// to a request for consent that timed out).
    pool: String,
    /// This actor, for its timers (requests for consent that time out).
    myself: ActorRef<ForkMsg>,
    store: RunStore,
    bus: Arc<dyn Bus>,
    ledger: Arc<Ledger>,
    /// The time that decides: when a request for consent times out.
    clock: Arc<dyn Clock>,
    /// Branches a resume (or a follow-up) enqueued a task for that no worker has taken over
    /// yet. The task's `attempt_base` is the branch's [`ForkState::attempt_base`]: nothing
    /// moves the fence or the state it is derived from before a worker takes the task over.
    requeued: HashSet<RunId>,
    /// Branches sent a terminate that have not finished yet, with its reason: a later
    /// attempt that takes one over (its worker was lost before it obeyed) finds it ended.
    stopping: HashMap<RunId, String>,
    /// Branches a fenced attempt reported finished, to check for a runner
    /// ([`ForkState::check_runners`]).
    suspects: Vec<RunId>,
    /// Steers sent to a running branch that its log does not hold yet, in order. One the
    /// branch ended `done` without (it came after the worker's last look) starts a
    /// follow-up turn instead of being lost ([`ForkState::follow_up_lost_steers`]).
    unapplied_steers: HashMap<RunId, std::collections::VecDeque<String>>,
    /// Branches that ended `done` with steers unapplied, to follow up.
    lost_steers: Vec<(RunId, String)>,
    record: ForkRecord,
    base: Arc<Manifest>,
    branches: Vec<BranchReplica>,
    by_run: HashMap<RunId, usize>,
    terminal: usize,
    waiters: Vec<oneshot::Sender<ForkView>>,
    version: watch::Sender<u64>,
    merging: bool,
    /// Why the fork's branches must stop: its account passed its blob quota with what they
    /// wrote (`crate::tenancy`); taken by [`ForkState::stop_over_quota`].
    over_quota: Option<String>,
    /// A resolve of this fork is running (tests, judges).
    resolving: bool,
    /// The branches' automatic checkpoints (`checkpoint/auto.rs`).
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
    /// Write and apply events; the answer names the text blobs the written ones write.
    ApplyEvents(
        Vec<BranchEvent>,
        RpcReplyPort<Result<Vec<BlobHash>, CoordinatorError>>,
    ),
    /// A receiver of the version counter.
    Subscribe(RpcReplyPort<watch::Receiver<u64>>),
    /// Answer with the view once every branch is terminal.
    WaitSettled(oneshot::Sender<ForkView>),
    Diff(
        DiffOptions,
        RpcReplyPort<Result<DiffReport, CoordinatorError>>,
    ),
    Merge {
        pick: String,
        into: MergeInto,
        reply: RpcReplyPort<Result<MergeOutcome, CoordinatorError>>,
    },
    /// Stop the branch with this label (one already finished is left as it is).
    Terminate(
        String,
        RpcReplyPort<Result<TerminateOutcome, CoordinatorError>>,
    ),
    /// Mark the fork aborted and stop every branch still running.
    Abort(RpcReplyPort<Result<AbortOutcome, CoordinatorError>>),
    /// Send the branch with this label a steering message (label, text).
    Steer {
        label: String,
        text: String,
        reply: RpcReplyPort<Result<SteerOutcome, CoordinatorError>>,
    },
    /// Start a follow-up turn of the finished branch with this label, enqueuing its task
    /// on the pool named (pool, label, text; ADR 13).
    Continue {
        pool: String,
        label: String,
        text: Option<String>,
        reply: RpcReplyPort<Result<ContinueOutcome, CoordinatorError>>,
    },
    /// A branch's task was delivered more than `max_deliver` times: queue it again or fail
    /// the branch ([`DeadTask`], ADR 38); the answer says which.
    DeadTask(DeadTask, RpcReplyPort<String>),
    /// A worker took a branch over under task attempt `u32`, holding the task at queue
    /// position `u64` of the pool named (checked, ADR 18): drop the events of earlier
    /// attempts from now on, tell them they are superseded, and answer with the branch's
    /// log as stored.
    Fence {
        run: RunId,
        attempt: u32,
        pool: String,
        seq: u64,
        reply: RpcReplyPort<Result<Vec<(u64, Event)>, CoordinatorError>>,
    },
    /// Enqueue a task, on the pool named, for each branch `Requeue` selects that has no
    /// task queued by an earlier resume yet. The reply is how many were enqueued.
    Resume {
        pool: String,
        which: Requeue,
        reply: RpcReplyPort<Result<usize, CoordinatorError>>,
    },
    /// Start resolving: check the fork can be resolved and hand over what the resolve
    /// needs. Refused while another resolve of the fork runs.
    ResolveStart(RpcReplyPort<Result<ResolveInputs, CoordinatorError>>),
    /// A resolve started by `ResolveStart` ended (whatever its outcome).
    ResolveEnd,
    /// Append this rewind marker to a finished branch's log at the seq given (its log must
    /// end just before it) and rebuild its overlay from the rewound history. The reply is
    /// the marker's seq.
    Rewind {
        run: RunId,
        marker: Event,
        seq: u64,
        reply: RpcReplyPort<Result<u64, CoordinatorError>>,
    },
    /// Replay a merge's change log onto a finished branch whose agent made the merged fork,
    /// appending the file changes and a summary to its log (ADR 14). The reply is the
    /// flush report.
    Adopt {
        run: RunId,
        outcome: Box<MergeOutcome>,
        reply: RpcReplyPort<Result<FlushReport, CoordinatorError>>,
    },
    /// Answer the request for consent of the branch labelled in the answer.
    Decide(
        Answer,
        RpcReplyPort<Result<DecisionOutcome, CoordinatorError>>,
    ),
    /// Deny every request for consent that waits, as decided by `by` for `reason` (a
    /// resolve that does not wait for a person). The reply lists the branches answered.
    DenyWaiting {
        by: String,
        reason: String,
        reply: RpcReplyPort<Result<Vec<String>, CoordinatorError>>,
    },
    /// The timer of branch run's request for call id fired.
    ApprovalTimeout {
        run: RunId,
        call_id: String,
    },
    /// The fork's clock was stepped (a test's manual clock): answer the requests for
    /// consent whose deadline it passed.
    ClockStepped,
    /// A merge's blocking part finished.
    MergeFinished {
        result: Box<Result<MergeDone, CoordinatorError>>,
        reply: RpcReplyPort<Result<MergeOutcome, CoordinatorError>>,
    },
}

impl ForkState {
    fn view(&self) -> ForkView {
        ForkView {
            fork_id: self.record.fork_id,
            name: self.record.plan.name.clone(),
            parent_run: self.record.parent_run,
            goal: self.record.plan.goal.clone(),
            state: self.record.state.clone(),
            created_at_ms: self.record.created_at_ms,
            snapshot: self.record.snapshot,
            workspace: self.record.workspace.clone(),
            left_out: self.record.left_out.clone(),
            branches: self
                .branches
                .iter()
                .map(|b| {
                    let mut v = b.record.view();
                    v.unpriced_model = (b.record.turns > 0 && self.unpriced(&b.record.model))
                        .then(|| b.record.model.clone());
                    v
                })
                .collect(),
            keep_artifacts: self.record.plan.resolve.keep_artifacts,
            git: self.record.git.clone(),
        }
    }

    /// Whether `model` is a provider's model the plan gives no price (a scripted model
    /// costs nothing, so it is priced at zero).
    fn unpriced(&self, model: &str) -> bool {
        forkfleet_shared::catalogue::dialect_of(model).is_some()
            && self
                .record
                .plan
                .models
                .get(model)
                .is_none_or(|m| m.price.is_none())
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
        // Calls of fenced attempts: paid for, not in the log (ADR 18).
        for cost in store.fenced_usage(run)? {
            replica.count_fenced(cost);
        }
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
    store
        .manifest(&record.snapshot)?
        .ok_or_else(|| CoordinatorError::missing_blobs(&[record.snapshot]))
}

impl Actor for ForkActor {
    type Msg = ForkMsg;
    type State = ForkState;
    type Arguments = ForkArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<Self::Msg>,
        args: Self::Arguments,
    ) -> Result<Self::State, ActorProcessingErr> {
        let (pool, store, bus, ledger, clock, record, base, branches, checkpoints) = match args {
            ForkArgs::Created {
                prepared,
                pool,
                store,
                bus,
                ledger,
                clock,
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
                (
                    pool,
                    store,
                    bus,
                    ledger,
                    clock,
                    fork,
                    base,
                    replicas,
                    checkpoints,
                )
            }
            ForkArgs::Load {
                fork,
                pool,
                store,
                bus,
                ledger,
                clock,
            } => {
                let s = store.clone();
                let (record, base, replicas, checkpoints) =
                    tokio::task::spawn_blocking(move || load(&s, fork)).await??;
                (
                    pool,
                    store,
                    bus,
                    ledger,
                    clock,
                    record,
                    base,
                    replicas,
                    checkpoints,
                )
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
            pool,
            myself,
            store,
            bus,
            ledger,
            clock,
            requeued: HashSet::new(),
            stopping: HashMap::new(),
            suspects: Vec::new(),
            unapplied_steers: HashMap::new(),
            lost_steers: Vec::new(),
            record,
            base,
            branches,
            by_run,
            terminal,
            waiters: Vec::new(),
            version,
            merging: false,
            over_quota: None,
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
        // Requests for consent that wait: their timers (those past their deadline fire
        // at once), and the clock's steps, which may pass their deadlines.
        state.arm_approval_timers();
        state.watch_clock_steps();
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
                state.stop_over_quota().await;
                // Branches whose fenced attempt finished: is their task still held?
                state.check_runners().await;
                state.follow_up_lost_steers().await;
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
                let span = tracing::info_span!(
                    "fork.diff",
                    fork.id = %state.record.fork_id,
                    fork.branches = i64::try_from(state.branches.len()).unwrap_or(i64::MAX)
                );
                forkfleet_shared::trace::set_parent(&span, state.record.trace.as_deref());
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
                    let lookup = |h: &BlobHash| store.blob(h).ok().flatten();
                    let report = diff_overlays(&base, &inputs, &lookup, &opts);
                    tracing::info!(paths = report.summary.total_paths_touched, "fork.diff done");
                    let _ = reply.send(Ok(report));
                });
            }
            ForkMsg::Fence {
                run,
                attempt,
                pool,
                seq,
                reply,
            } => {
                let _ = reply.send(state.fence(run, attempt, pool, seq).await);
            }
            ForkMsg::DeadTask(dead, reply) => {
                let _ = reply.send(state.dead_task(dead).await);
                state.bump();
            }
            ForkMsg::Merge { pick, into, reply } => {
                state.start_merge(myself, pick, into, reply);
            }
            ForkMsg::Resume { pool, which, reply } => {
                let _ = reply.send(state.resume(&pool, which).await);
            }
            ForkMsg::Terminate(label, reply) => {
                let _ = reply.send(state.terminate(&label).await);
            }
            ForkMsg::Abort(reply) => {
                let _ = reply.send(state.abort().await);
            }
            ForkMsg::Steer { label, text, reply } => {
                let _ = reply.send(state.steer(&label, text).await);
            }
            ForkMsg::Continue {
                pool,
                label,
                text,
                reply,
            } => {
                let _ = reply.send(state.follow_up(&pool, &label, text).await);
            }
            ForkMsg::ResolveStart(reply) => {
                let _ = reply.send(state.resolve_start());
            }
            ForkMsg::ResolveEnd => state.resolving = false,
            ForkMsg::Adopt {
                run,
                outcome,
                reply,
            } => {
                let _ = reply.send(state.adopt(run, *outcome).await);
            }
            ForkMsg::Rewind {
                run,
                marker,
                seq,
                reply,
            } => {
                let _ = reply.send(state.rewind(run, marker, seq).await);
            }
            ForkMsg::Decide(answer, reply) => {
                let _ = reply.send(state.decide(answer).await);
            }
            ForkMsg::DenyWaiting { by, reason, reply } => {
                let _ = reply.send(state.deny_waiting(&by, &reason).await);
            }
            ForkMsg::ApprovalTimeout { run, call_id } => state.timed_out(run, &call_id).await,
            ForkMsg::ClockStepped => state.clock_stepped().await,
            ForkMsg::MergeFinished { result, reply } => {
                state.merge_finished(result, reply).await;
            }
        }
        Ok(())
    }
}
