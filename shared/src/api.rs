//! The coordinator's API types: what clients send and what they get back. The embedded
//! mode calls the coordinator with them directly; a cluster carries them over
//! request/reply in wire envelopes.

use crate::blob::BlobHash;
use crate::event::Usage;
use crate::flush::FlushReport;
use crate::ids::{ForkId, RunId};
use crate::overlay::ChangeOp;
use crate::spec::ForkPlan;
use crate::state::{BranchState, ForkState};
use serde::{Deserialize, Serialize};

/// Where a fork's parent run comes from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ParentRun {
    /// A new root run made of the plan's system prompt, history and goal.
    New,
    /// An existing run, forked at the end of its log.
    Existing { run_id: RunId },
}

/// Create a fork. Every blob the snapshot names must already be in the blob store.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CreateFork {
    pub plan: ForkPlan,
    pub parent: ParentRun,
    /// The workspace snapshot (a `Manifest` blob).
    pub snapshot: BlobHash,
    /// Where the workspace lives on the client, for display only.
    pub workspace: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BranchView {
    pub label: String,
    pub run_id: RunId,
    pub state: BranchState,
    pub error: Option<String>,
    /// Model calls made by the branch.
    pub turns: u32,
    pub usage: Usage,
    pub cost_usd: f64,
    /// Entries in the branch's change log.
    pub changes: usize,
    /// Events in the branch's log.
    pub events: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ForkView {
    pub fork_id: ForkId,
    pub parent_run: RunId,
    pub goal: String,
    pub state: ForkState,
    pub created_at_ms: u64,
    pub snapshot: BlobHash,
    pub workspace: Option<String>,
    pub branches: Vec<BranchView>,
}

impl ForkView {
    pub fn total_cost_usd(&self) -> f64 {
        self.branches.iter().map(|b| b.cost_usd).sum()
    }

    pub fn settled(&self) -> bool {
        self.branches.iter().all(|b| b.state.is_terminal())
    }

    pub fn branch(&self, label: &str) -> Option<&BranchView> {
        self.branches.iter().find(|b| b.label == label)
    }
}

/// The result of merging a winner into its fork's parent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MergeOutcome {
    pub fork_id: ForkId,
    pub winner: String,
    pub winner_run: RunId,
    pub parent_run: RunId,
    /// The flush of the winner's change log onto the parent's workspace version.
    pub report: FlushReport,
    /// The winner's change log, for clients applying the merge to a directory.
    pub changes: Vec<ChangeOp>,
    /// The fork-time snapshot (conflicts are detected against it).
    pub fork_snapshot: BlobHash,
    /// The parent's workspace version after the merge (a `Manifest` blob).
    pub merged_snapshot: BlobHash,
    /// The checkpoint saved after the merge (`post-fork:<fork id>`).
    pub checkpoint: String,
}

/// A checkpoint: a history position and a workspace version of one run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointView {
    pub run_id: RunId,
    pub label: String,
    /// The last event of the run the checkpoint includes.
    pub seq: u64,
    pub snapshot: BlobHash,
    pub created_at_ms: u64,
}
