//! Messages between the coordinator and the workers.
//!
//! - [`BranchTask`] on the task queue: run (or resume) one branch.
//! - [`BranchEvent`] on the event stream: one event of a branch's log, numbered by
//!   (run, seq) so delivery can be at-least-once and applying idempotent.
//! - [`Control`] to a running branch: terminate or steer.

use crate::blob::BlobHash;
use crate::event::Event;
use crate::ids::{ForkId, RunId};
use crate::pricing::Price;
use crate::state::BranchState;
use crate::wire::WireMessage;
use serde::{Deserialize, Serialize};

/// The queue branch tasks are published to (one pool for now).
pub const DEFAULT_POOL: &str = "default";

/// Run one branch: everything a worker needs, with large parts by blob reference.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BranchTask {
    pub fork_id: ForkId,
    pub run_id: RunId,
    pub label: String,
    /// Position of the branch in its fork, from 0.
    pub index: u32,
    pub model: String,
    /// The model's price, when known (usage events carry the cost).
    pub price: Option<Price>,
    /// Scripted models: the script file.
    pub script: Option<BlobHash>,
    /// The parent's conversational events copied into the branch (its log's seqs 1..=P),
    /// as an rmp blob of `Vec<Event>` shared by all branches of the fork. The `fork`
    /// lineage event at seq 0 stays in the coordinator's store: the model never needs it.
    pub prefix: BlobHash,
    /// The branch-specific events after the prefix: extra instructions and the steer.
    /// `prefix + tail` is the branch's log from seq 1; the worker continues at
    /// `first_seq = 1 + P + tail.len()`.
    pub tail: Vec<Event>,
    /// The fork-time workspace snapshot (a `Manifest` blob).
    pub snapshot: BlobHash,
    /// The seq the worker's first event takes.
    pub first_seq: u64,
    pub max_turns: u32,
    pub max_output_tokens: u32,
    /// The branch's own cap when the task was made (the worker's early check; the
    /// coordinator's ledger is authoritative and may have been topped up).
    pub budget_usd: Option<f64>,
    /// Strict budget mode with a cap on the branch, its fork or its account: reserve on
    /// [`crate::budget::BUDGET_SUBJECT`] before every model call.
    #[serde(default, skip_serializing_if = "is_false")]
    pub reserve: bool,
    /// What a refused reservation or a stop for budget does to the branch.
    #[serde(default, skip_serializing_if = "crate::budget::OnExhausted::is_stop")]
    pub on_exhausted: crate::budget::OnExhausted,
    /// Added to the delivery count to make the task attempt. A task enqueued again for a
    /// branch that already ran (resumed after a pause) starts above every attempt before
    /// it, so it takes the branch over from the coordinator's log like a redelivery.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub attempt_base: u32,
}

fn is_false(b: &bool) -> bool {
    !*b
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

impl WireMessage for BranchTask {
    const KIND: &'static str = "branch_task";
}

/// One event of a branch run's log.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BranchEvent {
    pub fork_id: ForkId,
    pub run_id: RunId,
    pub seq: u64,
    pub at_ms: u64,
    pub event: Event,
    /// The delivery attempt of the task that produced the event (1 for the first). Once a
    /// branch resumes under attempt N, the coordinator drops events of earlier attempts,
    /// so a worker presumed dead can never interleave with the one that took over.
    #[serde(default)]
    pub attempt: u32,
}

impl WireMessage for BranchEvent {
    const KIND: &'static str = "branch_event";
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "command", rename_all = "snake_case")]
pub enum ControlCommand {
    /// Stop as `terminated`, cancelling a model call in flight.
    Terminate {
        reason: String,
    },
    Steer {
        text: String,
    },
    /// A budget cap was crossed: stop as `state` (`budget_exhausted` or
    /// `aggregate_budget_exhausted`), cancelling a model call in flight unless `graceful`.
    Stop {
        state: BranchState,
        reason: String,
        /// Let a model call in flight finish and be recorded first (strict mode: the call
        /// is paid for by its reservation), then stop before the next one.
        #[serde(default, skip_serializing_if = "is_false")]
        graceful: bool,
    },
    /// A budget cap was crossed and the fork pauses instead of stopping: publish `paused`,
    /// hand the task back as finished, and wait for a top-up to enqueue the branch again.
    Pause {
        reason: String,
        /// As for `stop`.
        #[serde(default, skip_serializing_if = "is_false")]
        graceful: bool,
    },
}

/// A command to one running branch.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Control {
    pub run_id: RunId,
    pub command: ControlCommand,
    /// The last task attempt the command is meant for: a later attempt (a branch resumed
    /// after a pause, which watches the run's control channel from its start) ignores it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempt: Option<u32>,
}

impl WireMessage for Control {
    const KIND: &'static str = "control";
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// A worker's heartbeat: what `forkfleet workers` lists. Workers put it on the bus every
/// few seconds; an entry not refreshed within [`WORKER_TTL_MS`] is gone.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkerInfo {
    pub worker_id: crate::ids::WorkerId,
    pub pool: String,
    pub concurrency: usize,
    /// The branches it runs now.
    pub running: Vec<RunId>,
    pub hostname: String,
    pub version: String,
    pub started_at_ms: u64,
    pub heartbeat_at_ms: u64,
}

impl WireMessage for WorkerInfo {
    const KIND: &'static str = "worker_info";
}

/// A heartbeat older than this means the worker is gone.
pub const WORKER_TTL_MS: u64 = 30_000;

/// The request/reply subject on which the coordinator hands a redelivered branch its log.
pub const RESUME_SUBJECT: &str = "coord.resume";

/// A worker took over a branch (its task was delivered again): fence off the earlier
/// attempts and send the branch's log as the coordinator has it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ResumeRequest {
    pub fork_id: ForkId,
    pub run_id: RunId,
    pub attempt: u32,
}

impl WireMessage for ResumeRequest {
    const KIND: &'static str = "resume_request";
}

/// The answer to a [`ResumeRequest`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "result", rename_all = "snake_case")]
pub enum ResumeReply {
    /// The branch's whole log, seq 0 (the `fork` event) first. The worker continues at the
    /// seq after the last one.
    Log { events: Vec<(u64, Event)> },
    /// The coordinator knows no such branch, or the fork was resolved: drop the task.
    Gone { reason: String },
    /// Try again later (the coordinator could not read its store).
    Retry { reason: String },
}

impl WireMessage for ResumeReply {
    const KIND: &'static str = "resume_reply";
}
