//! What the API's operations answer with: views of forks, branches, runs and checkpoints,
//! and the outcome of each command. Plain data, carried in [`super::ApiReply`].

use crate::blob::BlobHash;
use crate::event::Usage;
use crate::flush::FlushReport;
use crate::ids::{CheckpointId, ForkId, RunId};
use crate::overlay::ChangeOp;
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
    /// A branch run forked by its own agent (the fork tools): the branches get its history
    /// up to `cutoff_seq` (the events before the model response that asked for the fork),
    /// once the coordinator's copy of its log has reached that seq.
    Branch { run_id: RunId, cutoff_seq: u64 },
}

/// One branch an agent asks for with `fork_run`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AgentBranch {
    pub label: String,
    pub steer: String,
    /// A model the parent fork configures (the parent branch's model when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget_usd: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub extra_instructions: Option<String>,
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
    /// The tool call waiting for consent, while the branch is `awaiting_approval`
    /// (docs/APPROVALS.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval: Option<crate::approval::PendingApproval>,
    /// Calls that were not run: denied by a person or a policy, or timed out.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub blocked: Vec<crate::approval::BlockedCall>,
    /// The start of the branch's last answer (its last model response's text, up to 280
    /// characters, `…` when cut); `None` before it answered with text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_message_preview: Option<String>,
    /// The seq of the branch's first event of its own: the events before it (its lineage
    /// event, the copied prefix, its instructions and steer) are not its work. 0 from a
    /// coordinator before this field.
    #[serde(default)]
    pub first_seq: u64,
    /// Its model, when it is a provider's with no price and the branch made calls: what
    /// they cost is unknown, and `cost_usd` counts none of it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unpriced_model: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ForkView {
    pub fork_id: ForkId,
    /// The spec's `name` (or `--name`): what lists show, usable where a fork id is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub parent_run: RunId,
    pub goal: String,
    pub state: ForkState,
    pub created_at_ms: u64,
    pub snapshot: BlobHash,
    pub workspace: Option<String>,
    /// What the workspace snapshot left out (`None`: not told, e.g. an agent's fork).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub left_out: Option<crate::scan::LeftOut>,
    pub branches: Vec<BranchView>,
    /// The plan's `keep_artifacts`: keep the materialised fork directory after a merge
    /// (false from a coordinator that predates it).
    #[serde(default)]
    pub keep_artifacts: bool,
    /// The git commit the workspace was at when the fork was made (`None`: not a git
    /// repository, or a fork made by an agent, from a run, or before this was recorded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub git: Option<GitHead>,
}

/// Where a workspace stood in its git repository when a fork was made: what
/// `fork merge --git-branch` commits the winner on top of (docs/GIT.md).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GitHead {
    /// The commit `HEAD` named (its full hex id).
    pub commit: String,
    /// The workspace's directory inside the repository, `/`-terminated (`sub/dir/`);
    /// empty when the workspace is the repository's top level.
    #[serde(default)]
    pub prefix: String,
    /// Tracked files had uncommitted changes (the snapshot holds them, the commit not).
    #[serde(default)]
    pub dirty: bool,
}

impl ForkView {
    /// Whether a branch that made calls has a model with no price: the total is then a
    /// lower bound.
    pub fn cost_unknown(&self) -> bool {
        self.branches.iter().any(|b| b.unpriced_model.is_some())
    }

    pub fn total_cost_usd(&self) -> f64 {
        self.branches.iter().map(|b| b.cost_usd).sum()
    }

    pub fn settled(&self) -> bool {
        self.branches.iter().all(|b| b.state.is_terminal())
    }

    /// Nothing runs: every branch has finished or is paused.
    pub fn quiet(&self) -> bool {
        self.branches.iter().all(|b| b.state.is_stopped())
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
    /// The checkpoint saved after the merge (`post-fork:<fork id>`); empty for a merge
    /// into a running agent's branch (the agent applies it).
    pub checkpoint: String,
    /// The plan's conflict policy (the agent applying an agent merge uses it).
    #[serde(default)]
    pub conflict_policy: crate::flush::ConflictPolicy,
    /// Merged into the branch whose agent made the fork (ADR 14), not into a root run's
    /// workspace: there is nothing to apply to a directory.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub into_branch: bool,
    /// The winner's last answer (an agent merge hands it to the agent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub summary: Option<String>,
    /// The winner's calls that were not run (denied, or timed out; docs/APPROVALS.md):
    /// what its work does not include.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub blocked: Vec<crate::approval::BlockedCall>,
}

/// A checkpoint: a history position and a workspace version of one run.
///
/// The history is the run's conversation as it was at `seq` (rewinds before `seq`
/// honoured, see [`crate::event::history_at`]); the workspace version is `snapshot` with
/// the run's `file_change` events on that history after `base_seq` replayed onto it. A
/// root run's checkpoints have `base_seq == seq` (their snapshot is the whole version); a
/// branch run's have the fork snapshot and `base_seq == 0`, so saving one builds no
/// manifest.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointView {
    /// Unique per run; UUID v7, so ids sort in creation order. (Checkpoints stored before
    /// ids were in the record get theirs from the store's key.)
    #[serde(default)]
    pub id: CheckpointId,
    pub run_id: RunId,
    pub label: String,
    /// The last event of the run the checkpoint includes.
    pub seq: u64,
    pub snapshot: BlobHash,
    pub created_at_ms: u64,
    /// File changes of the run after this seq (on the checkpoint's history) belong to
    /// the version; see above.
    #[serde(default)]
    pub base_seq: u64,
    /// Model calls the run had made at `seq`.
    #[serde(default)]
    pub turn: u32,
    #[serde(default)]
    pub kind: CheckpointKind,
    /// Free-form details (`tool`: the tool of a `tool-N-...` checkpoint; `source_run`,
    /// `source_checkpoint`: where a run made by `checkpoint fork` came from).
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub metadata: std::collections::BTreeMap<String, String>,
}

/// How a checkpoint came to be. Automatic ones are evicted beyond the fork's
/// `max_checkpoints`; named ones (`fork:`, `post-fork:`, `from:`, saved by hand) never are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CheckpointKind {
    #[default]
    Named,
    Auto,
}

impl CheckpointKind {
    pub fn as_str(self) -> &'static str {
        match self {
            CheckpointKind::Named => "named",
            CheckpointKind::Auto => "auto",
        }
    }
}

/// A fork's view and the version it was read at. The version changes whenever the view
/// does (a batch of events applied, a merge, a terminate, an abort); it starts again from
/// 0 when the coordinator restarts, so a watcher compares it for equality, not order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ForkWatch {
    pub version: u64,
    pub view: ForkView,
}

/// What a terminate request did.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TerminateOutcome {
    pub fork_id: ForkId,
    pub label: String,
    pub run_id: RunId,
    /// The branch's state when the request arrived.
    pub state: BranchState,
    /// True when a terminate command was sent; false when the branch had already finished.
    pub sent: bool,
}

/// What a steer request did: the message was sent to the branch's worker, which applies
/// it (a `steer` event in the branch's log) before its next model call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SteerOutcome {
    pub fork_id: ForkId,
    pub label: String,
    pub run_id: RunId,
    /// The branch's state when the request arrived (`pending` or `running`).
    pub state: BranchState,
    /// The task attempt the message is addressed to (a later attempt ignores it).
    pub attempt: u32,
}

/// What an answer to a request for consent did (docs/APPROVALS.md): the branch's task was
/// enqueued again and the answer appended to its log; any worker takes the branch over and
/// runs the call (approved) or answers it as denied.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DecisionOutcome {
    pub fork_id: ForkId,
    pub label: String,
    pub run_id: RunId,
    pub call_id: String,
    pub tool: String,
    pub approved: bool,
    /// Who answered: a person's identity (`admin` for an operator), `timeout`, `policy`.
    pub by: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The branch after the answer (pending until a worker takes it over).
    pub branch: BranchView,
}

/// What a garbage collection (`forkfleet gc`, `fork rm`) deleted, or would with `dry_run`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct GcReport {
    /// The forks deleted with their branch runs.
    pub removed: Vec<ForkId>,
    /// Where each deleted fork's workspace was (its fork directory is the client's to
    /// remove).
    #[serde(default)]
    pub workspaces: Vec<(ForkId, String)>,
    /// Forks it could have deleted but kept, and why.
    pub kept: Vec<KeptFork>,
    pub runs: usize,
    pub events: usize,
    pub checkpoints: usize,
    /// Blobs nothing refers to any more, deleted, and their bytes.
    pub blobs: usize,
    pub blob_bytes: u64,
    /// Blobs deleted from the bus's buckets (a cluster's; the embedded mode's bus blobs
    /// are the store's).
    #[serde(default)]
    pub bus_blobs: usize,
    pub dry_run: bool,
}

/// A fork a collection kept, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeptFork {
    pub fork_id: ForkId,
    pub why: String,
}

/// What a continue request did: a `follow_up` event appended to a finished branch's log,
/// which re-opened it, and its task enqueued again (ADR 13).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ContinueOutcome {
    pub fork_id: ForkId,
    pub label: String,
    pub run_id: RunId,
    /// The state the branch had finished in (`done`, `failed` or `terminated`).
    pub previous: BranchState,
    /// The seq of the `follow_up` event.
    pub seq: u64,
    /// The branch after the request (state `pending` until a worker takes it).
    pub branch: BranchView,
    /// The fork's state after the request (`open` again).
    pub fork_state: ForkState,
}

/// What an abort request did.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AbortOutcome {
    /// The branches a terminate command was sent to (those not yet terminal).
    pub terminated: Vec<String>,
    /// False when the fork was already aborted (nothing changed).
    pub changed: bool,
    pub view: ForkView,
}

/// One event of a run's log.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoggedEvent {
    pub seq: u64,
    pub event: crate::event::Event,
}

/// What the coordinator says about itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServerInfo {
    /// The coordinator's crate version.
    pub version: String,
    /// The wire envelope version it speaks.
    pub wire_version: u16,
}

/// What resolving a fork found and did: the tests on every branch, each judge's verdict,
/// the confidence behind the pick, the strategy's decision and, when it committed, the
/// merge.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ResolveReport {
    pub fork_id: ForkId,
    pub strategy: crate::resolve::Strategy,
    pub formula: crate::resolve::ConfidenceFormula,
    /// One per branch when the plan has a test command, in branch order.
    pub tests: Vec<crate::protocol::TestRun>,
    /// One per judge model, in the plan's order.
    pub judges: Vec<JudgedBy>,
    /// The diff report's agreement score.
    pub agreement_score: f64,
    pub decision: crate::resolve::Decision,
    /// Present when the decision was a commit (and the resolve was not `no_commit`).
    pub merge: Option<MergeOutcome>,
    /// Asked not to commit (`fork resolve --no-commit`): a commit decision was not merged.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub no_commit: bool,
    /// The judges' usage and cost together (not part of any branch's spend).
    pub judge_usage: Usage,
    pub judge_cost_usd: f64,
    /// The judges' models with no price (the fork's plan and the built-in table name
    /// none): what they spent is unknown, and `judge_cost_usd` counts none of it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub judge_unpriced: Vec<String>,
    pub resolved_at_ms: u64,
}

/// One judge's run, with the confidence its pick scored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JudgedBy {
    pub run: crate::protocol::JudgeRun,
    /// The signals of the branch it picked (none without a verdict).
    pub signals: Option<crate::resolve::ConfidenceSignals>,
    /// The effective confidence: the formula's heuristic times the judge's confidence.
    pub confidence: Option<f64>,
}

/// What a rewind did (or, on a dry run, would do).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RewindOutcome {
    pub run_id: RunId,
    pub checkpoint: CheckpointView,
    /// False on a dry run: nothing was changed.
    pub rewound: bool,
    /// The seq of the `rewind` event appended to the run's log (none on a dry run).
    pub marker_seq: Option<u64>,
    /// Events of the run's history (conversation and file changes) the rewind leaves out.
    pub dropped_events: u64,
    /// The run's workspace version before the rewind (a `Manifest` blob): a directory
    /// the changes apply to is checked against it, a path that differs is a conflict.
    pub from_snapshot: BlobHash,
    /// The checkpoint's workspace version, the run's after the rewind.
    pub to_snapshot: BlobHash,
    /// The change log turning `from_snapshot` into `to_snapshot`.
    pub changes: Vec<ChangeOp>,
    /// What a directory the rewind is applied to does with a path edited since: a branch
    /// run's fork plan's `conflict_policy`; a root run's is `keep-parent`.
    #[serde(default)]
    pub conflict_policy: crate::flush::ConflictPolicy,
}

/// A run started from a checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NewRunOutcome {
    pub run_id: RunId,
    pub source_run: RunId,
    /// The checkpoint it started from (of the source run).
    pub source: CheckpointView,
    /// Events in the new run's log: the conversation up to the checkpoint.
    pub events: u64,
    /// The new run's workspace version (a `Manifest` blob).
    pub snapshot: BlobHash,
}

// ---- runs and lineage (docs/LINEAGE.md) ---------------------------------------------------

/// How a run came to be.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RunKind {
    /// A parent run: a spec's system prompt, history and goal, or a `checkpoint fork`.
    Root,
    /// A branch of a fork (a spec's single agent `main` included).
    Branch,
    /// A child `runs fork` made from a recorded run.
    Child,
}

impl RunKind {
    pub fn as_str(self) -> &'static str {
        match self {
            RunKind::Root => "root",
            RunKind::Branch => "branch",
            RunKind::Child => "child",
        }
    }
}

/// A run's seq-0 `fork` lineage event.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Lineage {
    pub fork_id: ForkId,
    pub parent_run: RunId,
    pub fork_root: RunId,
    /// The last parent event the run's history includes.
    pub cutoff_seq: u64,
    pub label: String,
    /// A child: the parent's events it copied or re-executes.
    pub replay_event_count: u64,
    /// A child: how its prefix was made (`replay_v1`).
    pub strategy: Option<String>,
    /// The workspace versions it starts from (its fork's snapshot); empty for a run
    /// written before the field.
    #[serde(default)]
    pub workspaces: Vec<crate::blob::BlobHash>,
}

/// A root run made by `checkpoint fork`: where it came from (its `from:<run>` checkpoint).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunOrigin {
    pub run: RunId,
    pub checkpoint: String,
    pub seq: u64,
}

/// One run of the store (`runs ls`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunView {
    pub run_id: RunId,
    pub kind: RunKind,
    /// The run it was forked from (`None` for a root run).
    pub parent: Option<RunId>,
    /// The root run of its tree.
    pub fork_root: RunId,
    /// The fork it is a branch of (a child: the one-branch fork `runs fork` made).
    pub fork_id: Option<ForkId>,
    pub label: Option<String>,
    /// A branch's or child's state; `None` for a root run (no worker runs it).
    pub state: Option<BranchState>,
    pub error: Option<String>,
    pub model: Option<String>,
    /// Events in its log.
    pub events: u64,
    pub cost_usd: f64,
    /// Model calls paid for.
    pub calls: u32,
    /// Model calls a replay served from the record (nothing spent).
    pub cached_calls: u32,
    pub created_at_ms: u64,
    /// Its seq-0 lineage event (branches and children).
    pub lineage: Option<Lineage>,
    /// A root run made by `checkpoint fork`.
    pub origin: Option<RunOrigin>,
    /// Its fork was merged and it was the winner.
    pub merged: bool,
    /// The workspace version it started from (a root run: its current one).
    pub workspace: BlobHash,
}

/// One file of a workspace version.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FileAt {
    pub path: String,
    pub bytes: u64,
    pub hash: BlobHash,
}

/// A run with its settings and workspace (`runs show`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunDetail {
    pub run: RunView,
    /// What `runs fork --set` starts from: the run's model and limits (`None`: a root run
    /// never forked, whose settings no plan holds).
    pub settings: Option<crate::lineage::RunSettings>,
    /// Its current workspace version: a root run's, or a branch's fork snapshot with its
    /// file changes.
    pub workspace: BlobHash,
    pub files: u64,
    pub bytes: u64,
    /// Runs forked from it, oldest first.
    pub children: Vec<RunId>,
}

/// One event a child copies: its seq in the parent and in the child.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CopiedEvent {
    /// `None`: not the parent's (the system prompt `--set` gave the child).
    pub parent_seq: Option<u64>,
    pub seq: u64,
    pub kind: String,
}

/// How `runs fork` makes a child (docs/LINEAGE.md).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RunForkOptions {
    /// The last parent event the child copies (default: the parent's last replayable one).
    pub at_event: Option<u64>,
    /// The child's label (default: `at-<cutoff>`).
    pub label: Option<String>,
    /// `KEY=VALUE` overrides of the child's settings.
    pub set: Vec<String>,
    /// Record a branch summary after the copied prefix.
    pub summarize: Option<crate::lineage::SummaryMode>,
    /// Re-execute the prefix, served from the parent's record, instead of copying it.
    pub replay: bool,
    /// With `replay`: go on live at the first divergence instead of failing.
    pub record: bool,
    /// Say what would be done; write nothing.
    pub dry_run: bool,
}

/// What `runs fork` does (with `dry_run`, would do: then nothing is written and `run_id`
/// is `None`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunForkOutcome {
    pub dry_run: bool,
    pub parent_run: RunId,
    pub fork_root: RunId,
    /// The last parent event the child's history includes.
    pub cutoff_seq: u64,
    pub label: String,
    /// `replay_v1`.
    pub strategy: String,
    /// Events copied into the child (empty with `replay`: they are re-executed).
    pub copied: Vec<CopiedEvent>,
    /// The parent's events the child copies or re-executes.
    pub replay_event_count: u64,
    /// Events on the parent's history through the cutoff that are not copied, by kind.
    pub skipped: std::collections::BTreeMap<String, u64>,
    /// The branch summary recorded after the copied prefix (`--summarize`).
    pub summary: Option<String>,
    /// The child's settings, `--set` applied.
    pub settings: crate::lineage::RunSettings,
    /// The keys `--set` changed.
    pub changed: Vec<String>,
    /// The child's workspace: the parent's files as they were at the cutoff (with `replay`,
    /// what the parent started from: the replay rebuilds the rest).
    pub workspace: BlobHash,
    pub files: Vec<FileAt>,
    pub replay: bool,
    pub record: bool,
    pub run_id: Option<RunId>,
    pub fork_id: Option<ForkId>,
    pub state: Option<BranchState>,
}

/// Where an upload of one blob in parts stands ([`super::PutBlobPart`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlobUpload {
    /// Bytes received so far (the next part's `offset`).
    pub received: u64,
    /// True once every byte arrived, hashed to the blob's name and is stored.
    pub stored: bool,
}

/// Part of a blob's bytes ([`super::GetBlobPart`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlobPart {
    /// The whole blob's size in bytes.
    pub total: u64,
    /// The bytes from the part's offset on (fewer than asked at the end).
    pub bytes: bytes::Bytes,
}
