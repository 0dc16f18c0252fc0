//! The coordinator's API types: what clients send and what they get back. The embedded
//! mode calls the coordinator with them directly; a cluster carries them over
//! request/reply in wire envelopes.

use crate::blob::BlobHash;
use crate::event::Usage;
use crate::flush::FlushReport;
use crate::ids::{CheckpointId, ForkId, RunId};
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

/// An agent forks its own branch run: the coordinator makes the fork's plan from the plan of
/// the fork the agent's run belongs to (goal, models, limits, budget policy, resolve
/// settings, tools), with these branches.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AgentFork {
    /// The agent's run (a branch run).
    pub parent_run: RunId,
    /// The last seq of the parent's log the branches' history includes.
    pub cutoff_seq: u64,
    /// The agent's workspace as it is now (a `Manifest` blob in the bus's blob store).
    pub snapshot: BlobHash,
    pub branches: Vec<AgentBranch>,
    /// The resolve strategy (the parent plan's when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strategy: Option<crate::resolve::Strategy>,
    /// A cap on the new fork's total spend.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub aggregate_budget_usd: Option<f64>,
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
    /// The plan's `keep_artifacts`: keep the materialised fork directory after a merge
    /// (false from a coordinator that predates it).
    #[serde(default)]
    pub keep_artifacts: bool,
}

impl ForkView {
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

/// The service subject of the coordinator's API (on NATS: `ff.api.coordinator`, see
/// [`crate::subjects::api_subject`]).
pub const API_SUBJECT: &str = "coordinator";

/// An encoded request or reply larger than this travels as a blob (`stored`), since a
/// NATS message is limited (1 MiB by default).
pub const MAX_INLINE_BYTES: usize = 512 * 1024;

/// Longest a `wait_settled` or `watch` request may ask the coordinator to hold it; a
/// client wanting longer asks again.
pub const MAX_API_WAIT_MS: u64 = 30_000;

/// A request to the coordinator's API (the `forkfleet.api` subject, request/reply).
///
/// Encoded in the wire envelope (kind `api_request`) as `{"op": "<name>", "args": {...}}`;
/// the answer is an [`ApiResponse`]. Waits are bounded by [`MAX_API_WAIT_MS`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", content = "args", rename_all = "snake_case")]
pub enum ApiRequest {
    /// The coordinator's version. Reply: `info`.
    Ping,
    /// Create a fork; every blob it names must be in the bus's blob store. Reply: `fork`.
    CreateFork(Box<CreateFork>),
    /// An agent forks its own run (see [`AgentFork`]). Reply: `fork`.
    AgentFork(Box<AgentFork>),
    /// The agent that made a fork merges branch `pick` into its own run: the fork is
    /// recorded as merged and the winner's change log returned, which the agent (still
    /// running, the only writer of its log) applies to its overlay. Reply: `merge`.
    AgentMerge {
        fork: ForkId,
        pick: String,
        parent_run: RunId,
    },
    /// Reply: `fork`.
    Fork { fork: ForkId },
    /// Every fork, newest first. Reply: `forks`.
    Forks,
    /// A fork by full id or unique prefix. Reply: `fork_id`.
    FindFork { prefix: String },
    /// The view once every branch is terminal, waiting at most `timeout_ms`
    /// (a `failure` error when it does not settle in time). Reply: `fork`.
    WaitSettled { fork: ForkId, timeout_ms: u64 },
    /// The view once its version differs from `seen` (at once when `seen` is absent or
    /// already stale), or after `timeout_ms` unchanged. Reply: `watch`.
    Watch {
        fork: ForkId,
        seen: Option<u64>,
        timeout_ms: u64,
    },
    /// Reply: `diff`.
    Diff {
        fork: ForkId,
        options: crate::diff::DiffOptions,
    },
    /// Merge the branch labelled `pick` into the fork's parent. Reply: `merge`.
    Merge { fork: ForkId, pick: String },
    /// Stop one branch (it keeps its partial work). Reply: `terminate`.
    Terminate { fork: ForkId, label: String },
    /// Stop every branch still running and mark the fork aborted. Reply: `abort`.
    Abort { fork: ForkId },
    /// Send a user message to a pending or running branch, applied before its next model
    /// call. Reply: `steer`.
    Steer {
        fork: ForkId,
        label: String,
        text: String,
    },
    /// Start a new turn of a finished branch (`done`, `failed`, `terminated`) with this
    /// user message, on its whole history and in the same overlay. Reply: `continue`.
    Continue {
        fork: ForkId,
        label: String,
        text: String,
    },
    /// A run's log from seq 0 to the first gap. Reply: `events`.
    RunEvents { run: RunId },
    /// A run's checkpoints, oldest first. Reply: `checkpoints`.
    Checkpoints { run: RunId },
    /// Spent, reserved, cap and remaining per branch, for the fork and its account.
    /// Reply: `cost`.
    ForkCost { fork: ForkId },
    /// Raise a cap by `usd` and resume what it paused: the branch's own cap with
    /// `branch`, else the fork's aggregate cap. Reply: `cost`.
    Topup {
        fork: ForkId,
        branch: Option<String>,
        usd: f64,
    },
    /// Move `usd` of cap from branch `from` to branch `to` of a fork (both capped; `from`
    /// keeps at least what it spent and holds). Reply: `cost`.
    MoveBudget {
        fork: ForkId,
        from: String,
        to: String,
        usd: f64,
    },
    /// Create an account or change its cap (`None`: no cap); resumes what its cap paused.
    /// Reply: `account`.
    AccountSet { name: String, cap_usd: Option<f64> },
    /// Every account, by name. Reply: `accounts`.
    Accounts,
    /// Resolve a settled fork: run the test command on every branch, ask the judges, decide
    /// by `strategy` (the plan's when absent) and merge when the decision is a commit.
    /// Reply: `resolve`.
    Resolve {
        fork: ForkId,
        strategy: Option<crate::resolve::Strategy>,
    },
    // ---- checkpoints (docs/API.md) ----
    /// A run by full id or unique prefix. Reply: `run_id`.
    FindRun { prefix: String },
    /// Save a named checkpoint at the run's current end. Reply: `checkpoint`.
    CheckpointSave { run: RunId, label: String },
    /// Remove the checkpoint with this label or id. Reply: `checkpoint` (the removed one).
    CheckpointRemove { run: RunId, checkpoint: String },
    /// Remove every checkpoint of a run. Reply: `checkpoints` (the removed ones).
    CheckpointClear { run: RunId },
    /// Send a run back to a checkpoint (label or id): its history and its workspace
    /// version; with `dry_run`, only say what would change. Reply: `rewind`.
    Rewind {
        run: RunId,
        checkpoint: String,
        dry_run: bool,
    },
    /// Start a new root run from a checkpoint (label or id): its conversation up to the
    /// checkpoint, on the checkpoint's workspace version. Reply: `new_run`.
    ForkCheckpoint { run: RunId, checkpoint: String },
    /// A root run's current workspace version, to fork the run as it is now (a branch run
    /// is `bad_input`: merge it, or start a new run from one of its checkpoints). Reply:
    /// `workspace`.
    RunWorkspace { run: RunId },
    /// The request itself is too large for one message: it is the `api_request` envelope
    /// stored as this blob in the bus's blob store.
    Stored { blob: BlobHash },
}

impl ApiRequest {
    /// The operation's name, as on the wire.
    pub fn op(&self) -> &'static str {
        match self {
            ApiRequest::Ping => "ping",
            ApiRequest::CreateFork(_) => "create_fork",
            ApiRequest::AgentFork(_) => "agent_fork",
            ApiRequest::AgentMerge { .. } => "agent_merge",
            ApiRequest::Fork { .. } => "fork",
            ApiRequest::Forks => "forks",
            ApiRequest::FindFork { .. } => "find_fork",
            ApiRequest::WaitSettled { .. } => "wait_settled",
            ApiRequest::Watch { .. } => "watch",
            ApiRequest::Diff { .. } => "diff",
            ApiRequest::Merge { .. } => "merge",
            ApiRequest::Terminate { .. } => "terminate",
            ApiRequest::Abort { .. } => "abort",
            ApiRequest::Steer { .. } => "steer",
            ApiRequest::Continue { .. } => "continue",
            ApiRequest::RunEvents { .. } => "run_events",
            ApiRequest::Checkpoints { .. } => "checkpoints",
            ApiRequest::ForkCost { .. } => "fork_cost",
            ApiRequest::Topup { .. } => "topup",
            ApiRequest::MoveBudget { .. } => "move_budget",
            ApiRequest::AccountSet { .. } => "account_set",
            ApiRequest::Accounts => "accounts",
            ApiRequest::Resolve { .. } => "resolve",
            ApiRequest::FindRun { .. } => "find_run",
            ApiRequest::CheckpointSave { .. } => "checkpoint_save",
            ApiRequest::CheckpointRemove { .. } => "checkpoint_remove",
            ApiRequest::CheckpointClear { .. } => "checkpoint_clear",
            ApiRequest::Rewind { .. } => "rewind",
            ApiRequest::ForkCheckpoint { .. } => "fork_checkpoint",
            ApiRequest::RunWorkspace { .. } => "run_workspace",
            ApiRequest::Stored { .. } => "stored",
        }
    }
}

impl crate::wire::WireMessage for ApiRequest {
    const KIND: &'static str = "api_request";
}

/// A successful answer, one variant per kind of result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "reply", content = "body", rename_all = "snake_case")]
pub enum ApiReply {
    Info(ServerInfo),
    Fork(ForkView),
    Forks(Vec<ForkView>),
    ForkId(ForkId),
    Watch(ForkWatch),
    Diff(crate::diff::DiffReport),
    Merge(MergeOutcome),
    Terminate(TerminateOutcome),
    Abort(AbortOutcome),
    Steer(SteerOutcome),
    Continue(Box<ContinueOutcome>),
    Events(Vec<LoggedEvent>),
    Checkpoints(Vec<CheckpointView>),
    Cost(crate::budget::ForkCost),
    Account(crate::budget::AccountView),
    Accounts(Vec<crate::budget::AccountView>),
    Resolve(Box<ResolveReport>),
    RunId(RunId),
    Checkpoint(CheckpointView),
    Rewind(Box<RewindOutcome>),
    NewRun(NewRunOutcome),
    /// A workspace version (a `Manifest` blob).
    Workspace(BlobHash),
    /// The reply is too large for one message: it is the `api_response` envelope stored
    /// as this blob in the bus's blob store.
    Stored {
        blob: BlobHash,
        bytes: u64,
    },
}

impl ApiReply {
    /// The reply's name, as on the wire.
    pub fn name(&self) -> &'static str {
        match self {
            ApiReply::Info(_) => "info",
            ApiReply::Fork(_) => "fork",
            ApiReply::Forks(_) => "forks",
            ApiReply::ForkId(_) => "fork_id",
            ApiReply::Watch(_) => "watch",
            ApiReply::Diff(_) => "diff",
            ApiReply::Merge(_) => "merge",
            ApiReply::Terminate(_) => "terminate",
            ApiReply::Abort(_) => "abort",
            ApiReply::Steer(_) => "steer",
            ApiReply::Continue(_) => "continue",
            ApiReply::Events(_) => "events",
            ApiReply::Checkpoints(_) => "checkpoints",
            ApiReply::Cost(_) => "cost",
            ApiReply::Account(_) => "account",
            ApiReply::Accounts(_) => "accounts",
            ApiReply::Resolve(_) => "resolve",
            ApiReply::RunId(_) => "run_id",
            ApiReply::Checkpoint(_) => "checkpoint",
            ApiReply::Rewind(_) => "rewind",
            ApiReply::NewRun(_) => "new_run",
            ApiReply::Workspace(_) => "workspace",
            ApiReply::Stored { .. } => "stored",
        }
    }
}

/// How an API call failed, for the caller to decide what to do (and the CLI's exit code:
/// `bad_input` and `not_found` are 2, `failure` is 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ApiErrorKind {
    /// The request cannot succeed as sent (malformed, wrong wire version, invalid plan,
    /// a merge the fork's state does not allow, ...): fix it and ask again.
    BadInput,
    /// The fork, run or branch label named does not exist.
    NotFound,
    /// The coordinator failed (store, bus, timeout): the same request may succeed later.
    Failure,
}

impl ApiErrorKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ApiErrorKind::BadInput => "bad_input",
            ApiErrorKind::NotFound => "not_found",
            ApiErrorKind::Failure => "failure",
        }
    }
}

/// An API error: its kind and a message written for the user.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{message}")]
pub struct ApiError {
    pub kind: ApiErrorKind,
    pub message: String,
}

impl ApiError {
    pub fn new(kind: ApiErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }

    /// True when the caller can fix the request (exit code 2).
    pub fn is_bad_input(&self) -> bool {
        self.kind != ApiErrorKind::Failure
    }
}

/// The answer to an [`ApiRequest`]: `{"ok": {"reply": ..., "body": ...}}` or
/// `{"err": {"kind": ..., "message": ...}}` in the wire envelope (kind `api_response`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ApiResponse {
    Ok(Box<ApiReply>),
    Err(ApiError),
}

impl crate::wire::WireMessage for ApiResponse {
    const KIND: &'static str = "api_response";
}

impl From<Result<ApiReply, ApiError>> for ApiResponse {
    fn from(r: Result<ApiReply, ApiError>) -> Self {
        match r {
            Ok(reply) => ApiResponse::Ok(Box::new(reply)),
            Err(e) => ApiResponse::Err(e),
        }
    }
}

impl From<ApiResponse> for Result<ApiReply, ApiError> {
    fn from(r: ApiResponse) -> Self {
        match r {
            ApiResponse::Ok(reply) => Ok(*reply),
            ApiResponse::Err(e) => Err(e),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::diff::{diff_report, DiffOptions};
    use crate::wire::{decode, encode};
    use uuid::Uuid;

    fn fork_id() -> ForkId {
        ForkId(Uuid::from_u128(0x0192_d2f4_5b7e_7c3a_9f1e_2b4c_6d8e_0a1b))
    }

    /// The exact bytes of two API messages. If this test fails, the API's wire format
    /// changed: that must be a deliberate act (clients in other languages read it).
    const GOLDEN_MERGE: &str = "83a17601a46b696e64ab6170695f72657175657374a4626f647982a26f70a56d65726765a46172677382a4666f726bc4100192d2f45b7e7c3a9f1e2b4c6d8e0a1ba47069636ba161";
    const GOLDEN_ERROR: &str = "83a17601a46b696e64ac6170695f726573706f6e7365a4626f647981a365727282a46b696e64a96e6f745f666f756e64a76d657373616765a76e6f20666f726b";

    #[test]
    fn golden_api_bytes() {
        let req = ApiRequest::Merge {
            fork: fork_id(),
            pick: "a".into(),
        };
        let bytes = encode(&req).unwrap();
        assert_eq!(hex::encode(&bytes), GOLDEN_MERGE);
        assert_eq!(decode::<ApiRequest>(&bytes).unwrap(), req);
        let resp = ApiResponse::Err(ApiError::new(ApiErrorKind::NotFound, "no fork"));
        let bytes = encode(&resp).unwrap();
        assert_eq!(hex::encode(&bytes), GOLDEN_ERROR);
        assert_eq!(decode::<ApiResponse>(&bytes).unwrap(), resp);
    }

    #[test]
    fn unit_and_tuple_variants_round_trip() {
        for req in [
            ApiRequest::Ping,
            ApiRequest::Forks,
            ApiRequest::Watch {
                fork: fork_id(),
                seen: None,
                timeout_ms: 5,
            },
            ApiRequest::Diff {
                fork: fork_id(),
                options: DiffOptions::default(),
            },
            ApiRequest::Stored {
                blob: BlobHash::of(b"x"),
            },
            ApiRequest::Steer {
                fork: fork_id(),
                label: "a".into(),
                text: "go left".into(),
            },
            ApiRequest::Continue {
                fork: fork_id(),
                label: "a".into(),
                text: "now the tests".into(),
            },
        ] {
            assert_eq!(decode::<ApiRequest>(&encode(&req).unwrap()).unwrap(), req);
        }
        let mut changes = std::collections::BTreeMap::new();
        changes.insert(
            crate::path::WsPath::parse("a.txt").unwrap(),
            crate::overlay::NetChange::Created(crate::manifest::FileEntry::for_bytes(
                b"hi\n", 0o644,
            )),
        );
        let report = diff_report(
            &crate::manifest::Manifest::default(),
            &[("x", &changes), ("y", &changes)],
            &|_| Some(bytes::Bytes::from_static(b"hi\n")),
            &DiffOptions {
                unified: true,
                ..DiffOptions::default()
            },
        );
        assert_eq!(report.paths.len(), 1);
        for reply in [
            ApiReply::ForkId(fork_id()),
            ApiReply::Forks(vec![]),
            ApiReply::Events(vec![LoggedEvent {
                seq: 0,
                event: crate::event::Event::Steer { text: "s".into() },
            }]),
            ApiReply::Diff(report),
        ] {
            let resp = ApiResponse::Ok(Box::new(reply));
            assert_eq!(
                decode::<ApiResponse>(&encode(&resp).unwrap()).unwrap(),
                resp
            );
        }
    }

    #[test]
    fn error_kinds_split_exit_codes() {
        assert!(ApiError::new(ApiErrorKind::NotFound, "x").is_bad_input());
        assert!(ApiError::new(ApiErrorKind::BadInput, "x").is_bad_input());
        assert!(!ApiError::new(ApiErrorKind::Failure, "x").is_bad_input());
    }
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
    /// Present when the decision was a commit.
    pub merge: Option<MergeOutcome>,
    /// The judges' usage and cost together (not part of any branch's spend).
    pub judge_usage: Usage,
    pub judge_cost_usd: f64,
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
