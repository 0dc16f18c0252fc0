//! The records the store keeps, besides events, checkpoints and blobs.

use forkfleet_shared::api::BranchView;
use forkfleet_shared::approval::{BlockedCall, PendingApproval};
use forkfleet_shared::blob::BlobHash;
use forkfleet_shared::event::Usage;
use forkfleet_shared::ids::{ForkId, ReservationId, RunId};
use forkfleet_shared::spec::ForkPlan;
use forkfleet_shared::state::{BranchState, ForkState};
use serde::{Deserialize, Serialize};

/// One run: a root run or a branch run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct RunRecord {
    pub run_id: RunId,
    pub parent: Option<RunId>,
    /// The fork that created this run (branch runs).
    pub fork_id: Option<ForkId>,
    /// The root run of the tree this run belongs to (itself for a root run).
    pub fork_root: RunId,
    /// 0 for a root run, the parent's depth + 1 for a branch run.
    pub depth: u32,
    /// The current workspace version (a `Manifest` blob). For a branch run the fork-time
    /// snapshot its overlay applies to.
    pub workspace: BlobHash,
    /// The seq the next event takes: the last seq is `next_seq - 1`. For a branch run it
    /// is written at creation and when its state changes; the log is authoritative.
    pub next_seq: u64,
    pub created_at_ms: u64,
}

/// One fork. Written at creation, when it settles and when it is merged.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct ForkRecord {
    pub fork_id: ForkId,
    pub plan: ForkPlan,
    pub parent_run: RunId,
    /// The fork-time workspace snapshot (a `Manifest` blob).
    pub snapshot: BlobHash,
    pub workspace: Option<String>,
    /// What the client's snapshot left out, as it said.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub left_out: Option<forkfleet_shared::scan::LeftOut>,
    pub state: ForkState,
    pub created_at_ms: u64,
    /// The parent's last event the branches' histories include.
    pub cutoff_seq: u64,
    /// The copied conversational prefix, shared by every branch (an rmp `Vec<Event>` blob).
    pub prefix: BlobHash,
    /// Events in the prefix: a branch log holds them at seqs `1..=prefix_len`.
    pub prefix_len: u64,
    /// The W3C `traceparent` of the fork's `fork.create` span: the fork's later spans
    /// (`fork.diff`, `fork.resolve`, `fork.merge`) join its trace, after a restart too.
    /// `None` without trace context.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace: Option<String>,
    /// A child of `runs fork --replay`: what its branch's tasks replay (docs/LINEAGE.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replay: Option<forkfleet_shared::protocol::ReplayTask>,
    /// The git commit the client's workspace was at (`fork merge --git-branch`); absent
    /// from records stored before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub git: Option<forkfleet_shared::api::GitHead>,
}

/// One branch of a fork. Static fields plus a summary of its log as of its last state
/// change; the in-memory replica rebuilds the summary from the log on start.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct BranchRecord {
    pub fork_id: ForkId,
    pub run_id: RunId,
    pub index: u32,
    pub label: String,
    pub model: String,
    /// The seq the worker's first event takes (`1 + prefix_len + tail.len()`).
    pub first_seq: u64,
    pub state: BranchState,
    pub error: Option<String>,
    pub turns: u32,
    pub usage: Usage,
    pub cost_usd: f64,
    /// Entries in the change log.
    pub changes: u64,
    /// The seq the next event takes.
    pub next_seq: u64,
    /// Events of task attempts below this are dropped: a later attempt took the branch
    /// over (see `ForkMsg::Fence`).
    #[serde(default)]
    pub min_attempt: u32,
    /// Model calls paid for: `usage` events applied, plus those of fenced attempts
    /// (counted apart, ADR 18).
    #[serde(default)]
    pub calls: u32,
    /// The task of the attempt that took the branch over last: its pool and its position
    /// in that pool's queue (from the takeover's proof, ADR 18), so a branch left without
    /// a runner is found after a restart too.
    #[serde(default)]
    pub task: Option<(String, u64)>,
    /// Model calls a replay served from the record (`usage` events marked `cached`:
    /// nothing spent, docs/LINEAGE.md).
    #[serde(default)]
    pub cached_calls: u32,
    /// The tool call waiting for consent, while the branch is `awaiting_approval`
    /// (docs/APPROVALS.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval: Option<PendingApproval>,
    /// Calls that were not run: denied, or timed out.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub blocked: Vec<BlockedCall>,
    /// The start of the branch's last assistant text ([`PREVIEW_CHARS`] characters at
    /// most): what `fork show` and `fork watch` print as its answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answer: Option<String>,
    /// Where the branch stood when its task was last queued, so that a task that dies is
    /// queued again when its deliveries were lost to progress or an outage (ADR 38).
    /// `None`: a record stored before it was kept, or a run no task runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queued: Option<Queued>,
}

/// A branch's task as it was queued: see [`BranchRecord::queued`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub(crate) struct Queued {
    /// When, in ms since the epoch.
    pub at_ms: u64,
    /// The branch's turns then.
    pub turns: u32,
    /// Times in a row a task of the branch was queued again after dying without a turn
    /// in between.
    pub requeues: u32,
    /// The task's `attempt_base`: a dead task below it is one this task replaced.
    #[serde(default)]
    pub attempt_base: u32,
}

/// The characters of a branch's last answer its record keeps.
pub(crate) const PREVIEW_CHARS: usize = 280;

impl BranchRecord {
    pub fn view(&self) -> BranchView {
        BranchView {
            label: self.label.clone(),
            run_id: self.run_id,
            state: self.state,
            error: self.error.clone(),
            turns: self.turns,
            usage: self.usage,
            cost_usd: self.cost_usd,
            changes: self.changes as usize,
            events: self.next_seq,
            approval: self.approval.clone(),
            blocked: self.blocked.clone(),
            last_message_preview: self.answer.clone(),
            first_seq: self.first_seq,
            unpriced_model: None,
        }
    }
}

/// A named account: a cap shared by every fork that charges it. Its spend is the sum of
/// those forks' spend (rebuilt from their logs), so only the cap is stored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct AccountRecord {
    pub name: String,
    pub cap_usd: Option<f64>,
    pub created_at_ms: u64,
}

/// Money held for one model call until its usage event settles it, its branch stops, a
/// later attempt takes the branch over, or it expires.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct ReservationRecord {
    pub id: ReservationId,
    pub fork_id: ForkId,
    pub run_id: RunId,
    pub account: Option<String>,
    pub attempt: u32,
    pub usd: f64,
    pub expires_at_ms: u64,
}
