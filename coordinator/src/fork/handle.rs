//! [`ForkHandle`]: the only way other modules talk to a fork actor, a method per
//! [`ForkMsg`], each call bounded by a timeout.

use super::{ForkMsg, Requeue, ResolveInputs, CALL_TIMEOUT_MS};
use crate::error::{actor_call, CoordinatorError};
use crate::merge::MergeInto;
use forkfleet_shared::api::{
    AbortOutcome, ContinueOutcome, ForkView, MergeOutcome, SteerOutcome, TerminateOutcome,
};
use forkfleet_shared::blob::BlobHash;
use forkfleet_shared::diff::{DiffOptions, DiffReport};
use forkfleet_shared::event::Event;
use forkfleet_shared::flush::FlushReport;
use forkfleet_shared::ids::RunId;
use forkfleet_shared::protocol::BranchEvent;
use ractor::ActorRef;
use std::time::Duration;
use tokio::sync::{oneshot, watch};

/// A merge replays a change log and writes a transaction: allow it more.
const MERGE_TIMEOUT_MS: u64 = 120_000;

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

    /// Write and apply `events`; the text blobs that those written (not duplicates, not of
    /// a fenced attempt) write.
    pub async fn apply(&self, events: Vec<BranchEvent>) -> Result<Vec<BlobHash>, CoordinatorError> {
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

    /// A delivery of a branch's task came past `max_deliver`: queue the branch again or
    /// fail it (ADR 38). The answer says which, for the worker that drops the task.
    pub async fn dead_task(&self, dead: super::DeadTask) -> Result<String, CoordinatorError> {
        ractor::call_t!(self.actor, ForkMsg::DeadTask, CALL_TIMEOUT_MS, dead)
            .map_err(|e| call_error(e, "a dead task", CALL_TIMEOUT_MS))
    }

    /// Fence branch `run` at task `attempt`, held from queue position `seq` of `pool`, and
    /// read its log (see `resume`).
    pub async fn fence(
        &self,
        run: RunId,
        attempt: u32,
        pool: String,
        seq: u64,
    ) -> Result<Vec<(u64, Event)>, CoordinatorError> {
        ractor::call_t!(
            self.actor,
            |reply| ForkMsg::Fence {
                run,
                attempt,
                pool,
                seq,
                reply
            },
            CALL_TIMEOUT_MS
        )
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
            |reply| ForkMsg::Adopt {
                run,
                outcome: Box::new(outcome),
                reply
            },
            CALL_TIMEOUT_MS
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
            |reply| ForkMsg::Rewind {
                run,
                marker,
                seq,
                reply
            },
            CALL_TIMEOUT_MS
        )
        .map_err(|e| call_error(e, "a rewind", CALL_TIMEOUT_MS))?
    }

    pub async fn merge(&self, pick: String) -> Result<MergeOutcome, CoordinatorError> {
        ractor::call_t!(
            self.actor,
            |reply| ForkMsg::Merge {
                pick,
                into: MergeInto::Parent,
                reply
            },
            MERGE_TIMEOUT_MS
        )
        .map_err(|e| call_error(e, "a merge", MERGE_TIMEOUT_MS))?
    }

    /// Record branch `pick` as merged into the branch whose agent made this fork, and
    /// return its change log for that branch (see [`MergeInto::Agent`]).
    pub async fn merge_into_agent(&self, pick: String) -> Result<MergeOutcome, CoordinatorError> {
        ractor::call_t!(
            self.actor,
            |reply| ForkMsg::Merge {
                pick,
                into: MergeInto::Agent,
                reply
            },
            MERGE_TIMEOUT_MS
        )
        .map_err(|e| call_error(e, "a merge", MERGE_TIMEOUT_MS))?
    }

    /// Enqueue tasks resuming these branches on `pool` (see [`ForkMsg::Resume`]).
    pub async fn resume(&self, pool: String, which: Requeue) -> Result<usize, CoordinatorError> {
        ractor::call_t!(
            self.actor,
            |reply| ForkMsg::Resume { pool, which, reply },
            CALL_TIMEOUT_MS
        )
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

    /// Answer a branch's request for consent (see [`ForkMsg::Decide`]).
    pub async fn decide(
        &self,
        answer: super::Answer,
    ) -> Result<forkfleet_shared::api::DecisionOutcome, CoordinatorError> {
        ractor::call_t!(self.actor, ForkMsg::Decide, CALL_TIMEOUT_MS, answer)
            .map_err(|e| call_error(e, "an answer to a request for consent", CALL_TIMEOUT_MS))?
    }

    /// Deny every request for consent that waits (see [`ForkMsg::DenyWaiting`]).
    pub async fn deny_waiting(
        &self,
        by: String,
        reason: String,
    ) -> Result<Vec<String>, CoordinatorError> {
        ractor::call_t!(
            self.actor,
            |reply| ForkMsg::DenyWaiting { by, reason, reply },
            CALL_TIMEOUT_MS
        )
        .map_err(|e| call_error(e, "denying requests for consent", CALL_TIMEOUT_MS))?
    }

    /// Send branch `label` a steering message (see [`ForkMsg::Steer`]).
    pub async fn steer(
        &self,
        label: String,
        text: String,
    ) -> Result<SteerOutcome, CoordinatorError> {
        ractor::call_t!(
            self.actor,
            |reply| ForkMsg::Steer { label, text, reply },
            CALL_TIMEOUT_MS
        )
        .map_err(|e| call_error(e, "a steer", CALL_TIMEOUT_MS))?
    }

    /// Start a follow-up turn of branch `label` (see [`ForkMsg::Continue`]).
    pub async fn follow_up(
        &self,
        pool: String,
        label: String,
        text: Option<String>,
    ) -> Result<ContinueOutcome, CoordinatorError> {
        ractor::call_t!(
            self.actor,
            |reply| ForkMsg::Continue {
                pool,
                label,
                text,
                reply
            },
            CALL_TIMEOUT_MS
        )
        .map_err(|e| call_error(e, "a continue", CALL_TIMEOUT_MS))?
    }
}
