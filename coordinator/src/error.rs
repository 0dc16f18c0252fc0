//! The coordinator's one error type: a variant per decision a caller makes.
//!
//! [`CoordinatorError::kind`] says what kind of error each variant is, in one match (see
//! [`ErrorKind`] for the kinds and the CLI's exit codes): bad input is a request the caller
//! can fix (an invalid plan, an empty message, blobs not uploaded); not found names what
//! does not exist (a fork, run, label, checkpoint or account); a conflict is a valid request
//! the current state forbids (a fork already merged, a branch still running, a store locked
//! by another process); unavailable is a bus or actor that did not answer; the rest are
//! failures.

use forkfleet_bus::BusError;
use forkfleet_shared::blob::BlobHash;
use forkfleet_shared::error::ErrorKind;
use forkfleet_shared::ids::{ForkId, RunId};
use forkfleet_shared::resolve::StrategyError;
use forkfleet_shared::spec::SpecError;
use forkfleet_shared::state::BranchState;
use forkfleet_shared::wire::WireError;
use std::fmt::Write as _;
use std::path::PathBuf;

/// How many items an error message lists before it says "and N more".
const LIST_LIMIT: usize = 10;

#[derive(Debug, thiserror::Error)]
pub enum CoordinatorError {
    // ---- bad input: the request cannot succeed as sent -----------------------------------
    #[error("`{prefix}` matches {count} forks ({matches}); give more of the id")]
    AmbiguousFork {
        prefix: String,
        count: usize,
        matches: String,
    },
    /// A run prefix that matches several runs; `count` is how many were found (more than
    /// 10 is written "more than 10").
    #[error("`{prefix}` matches {} runs ({matches}); give more of the id", at_most(.count))]
    AmbiguousRun {
        prefix: String,
        count: usize,
        matches: String,
    },
    /// An empty run id (or prefix).
    #[error("give a run id (or a unique prefix of one)")]
    MissingRunId,
    #[error(
        "`{reference}` matches {count} checkpoints of run {run} ({matches}); give more of the id"
    )]
    AmbiguousCheckpoint {
        run: RunId,
        reference: String,
        count: usize,
        matches: String,
    },
    #[error("invalid fork plan: {0}")]
    InvalidPlan(#[from] SpecError),
    /// A real model of the plan that no live worker of the pool offers, or a spec
    /// `base_url` whose host none allows (ADR 16); the message names the model, the host
    /// and what the workers offer or allow.
    #[error("{0}")]
    ModelNotOffered(String),
    #[error("branch label `{0}` is used twice; labels must be unique within a fork")]
    DuplicateLabel(String),
    #[error("branch `{label}` uses model `{model}`, which the plan does not configure; configured models: {valid}")]
    UnknownModel {
        label: String,
        model: String,
        valid: String,
    },
    #[error(
        "{count} blob(s) missing from the store ({sample}); upload the workspace and scripts first"
    )]
    MissingBlobs { count: usize, sample: String },
    #[error("snapshot {hash} is not a workspace manifest: {message}")]
    BadSnapshot { hash: BlobHash, message: String },
    /// A resolve strategy that cannot be used as given.
    #[error("cannot resolve: {0}")]
    BadStrategy(#[from] StrategyError),
    /// A resolve whose strategy needs a judge, of a fork whose spec configures none.
    #[error("cannot resolve: strategy `{strategy}` needs a judge; the fork's spec names none and no live worker offers a real model to default to; pass `--judge-model provider:name`, set `judge_model` (or `judge_models` for vote) in the spec, or resolve with `--strategy manual`")]
    NoJudge { strategy: String },
    /// An empty steering or follow-up message; `what` names it.
    #[error("a {what} cannot be empty")]
    EmptyMessage { what: &'static str },
    /// An empty checkpoint label.
    #[error("a checkpoint label cannot be empty")]
    EmptyCheckpointLabel,
    /// A checkpoint label that breaks the label rules; `rule` says which and what is valid.
    #[error("{rule}")]
    BadCheckpointLabel { label: String, rule: String },
    /// A checkpoint label of the form only automatic checkpoints use.
    #[error("`{label}` has the form of an automatic checkpoint's label (`turn-N`, `tool-N-NAME`); pick another")]
    AutomaticCheckpointLabel { label: String },
    /// A checkpoint label that reads as a checkpoint id.
    #[error("`{label}` looks like a checkpoint id; pick a label")]
    CheckpointLabelIsId { label: String },
    /// A checkpoint before any conversation: nothing to start a run from.
    #[error("checkpoint `{label}` of run {run} has no conversation to start from")]
    NoConversation { run: RunId, label: String },
    /// `fork_run` asked of a root run: only a branch's agent forks itself.
    #[error(
        "run {run} is a root run: only an agent running in a branch forks itself with fork_run"
    )]
    RootRunForks { run: RunId },
    /// `fork_run` with no branches.
    #[error("fork_run needs at least one branch: give `branches` as a list of {{label, steer}}")]
    NoAgentBranches,
    /// A `fork_run` branch without a steer.
    #[error("branch `{label}` has no steer: say what this branch should try")]
    MissingSteer { label: String },
    /// An agent merging a fork another run made.
    #[error("fork {fork} was not made by run {run}; an agent merges only the forks it made")]
    NotMadeByRun { fork: ForkId, run: RunId },
    /// The workspace of a branch run a worker still runs.
    #[error("run {run} is a branch of fork {fork} that is still running: its files are still changing; wait for it to finish (`forkfleet fork watch {fork}`), or start a run from one of its checkpoints (`forkfleet checkpoint fork {run} LABEL`)")]
    NotARootRun { run: RunId, fork: ForkId },
    /// A fork create request that cannot succeed as sent (the message says why and what is
    /// valid). Built by `create.rs`, whose validation is being rewritten.
    #[error("{0}")]
    BadRequest(String),
    #[error("run {run} finished as {state}: give a message to continue it (`forkfleet runs resume {run} MESSAGE`)")]
    NeedsMessage { run: RunId, state: BranchState },
    /// A budget request that cannot succeed as sent (the message says why and what is
    /// valid). Built by `budget/caps.rs`, which is being rewritten.
    #[error("{0}")]
    BadBudget(String),

    // ---- not found ---------------------------------------------------------------------
    #[error("no fork has the id, id prefix or name `{0}`; `forkfleet fork ls` lists them")]
    UnknownFork(String),
    #[error("run {0} does not exist")]
    UnknownRun(RunId),
    /// A takeover by a task attempt below the branch's fence (ADR 18).
    #[error("task attempt {attempt} is below the branch's fence: attempt {fence} took it over")]
    Superseded { attempt: u32, fence: u32 },
    /// No run id starts with `prefix`.
    #[error("no run matches `{prefix}`: name a fork's branch as FORK/LABEL (its labels are in `forkfleet fork show FORK`), or a run by its id, a unique prefix of one or the end of one (`forkfleet runs ls` lists them)")]
    UnknownRunPrefix { prefix: String },
    #[error("fork {fork} has no branch labelled `{label}`; valid labels: {valid}")]
    UnknownLabel {
        fork: ForkId,
        label: String,
        valid: String,
    },
    /// Checkpoints: no checkpoint of the run has this label or id.
    #[error("run {run} has no checkpoint `{reference}`; {valid}")]
    UnknownCheckpoint {
        run: RunId,
        reference: String,
        valid: String,
    },
    #[error("no account named `{name}`; {valid}")]
    UnknownAccount { name: String, valid: String },

    // ---- conflict: valid, but the current state forbids it --------------------------------
    #[error("fork {fork} was already merged (winner `{winner}`); a fork merges once")]
    AlreadyMerged { fork: ForkId, winner: String },
    #[error("fork {0} was aborted; nothing can be merged")]
    Aborted(ForkId),
    #[error("fork {0} is being merged right now")]
    MergeInProgress(ForkId),
    /// An upload that would take a client identity past its blob quota.
    #[error("{0}")]
    BlobQuota(String),
    #[error("branch `{label}` is {state}: still running; wait for it or terminate it")]
    StillRunning { label: String, state: BranchState },
    /// A branch change asked while its fork is being merged or resolved (`activity`);
    /// `then` says what to do once it is over.
    #[error("fork {fork} is being {activity} right now; {then} afterwards")]
    ForkBusy {
        fork: ForkId,
        activity: &'static str,
        then: String,
    },
    #[error("cannot resolve: fork {0} is being resolved right now")]
    ResolveInProgress(ForkId),
    /// A resolve of a fork whose branches have not all finished; `unfinished` lists them
    /// as `` `label` (state) ``.
    #[error("cannot resolve: fork {fork} has branches that have not finished: {}; wait for them (`forkfleet fork watch`), top up paused ones, answer those awaiting approval (`forkfleet approvals`), or terminate them", .unfinished.join(", "))]
    Unfinished {
        fork: ForkId,
        unfinished: Vec<String>,
    },
    /// A fork made by a running agent: the agent merges it (ADR 14). `parent` is the fork
    /// of the agent's branch `label`.
    #[error("fork {fork} was made by the agent of branch `{label}` of fork {parent}, which is {state}: the agent merges it itself (merge_or_select); wait for the branch to finish or terminate it, then merge here")]
    AgentMerges {
        fork: ForkId,
        parent: ForkId,
        label: String,
        state: BranchState,
    },
    /// A fork's merge into the agent branch that made it, found running when the merge
    /// was replayed onto it: its agent merges `child` itself.
    #[error("branch `{label}` of fork {fork} is {state}: its agent merges fork {child} itself (merge_or_select); wait for it to finish or terminate it")]
    AgentStillRunning {
        fork: ForkId,
        label: String,
        state: BranchState,
        child: ForkId,
    },
    /// A rewind of a branch run that has not finished.
    #[error("run {run} is branch `{label}` of fork {fork} and it is {state}: a running branch cannot be rewound; wait for it to finish or stop it (`forkfleet fork terminate {fork} {label}`), or start a new run from the checkpoint (`forkfleet checkpoint fork RUN LABEL`)")]
    RewindRunning {
        run: RunId,
        fork: ForkId,
        label: String,
        state: BranchState,
    },
    /// A branch's log grew between working out a rewind and applying it.
    #[error("branch `{label}`'s log changed while the rewind was worked out; ask again")]
    RewindRaced { label: String },
    /// A run whose log holds no event yet.
    #[error("run {0} has no events")]
    EmptyLog(RunId),
    /// A checkpoint past the end of its run's log.
    #[error("checkpoint `{label}` is at seq {seq} but run {run}'s log ends at {end}")]
    CheckpointPastEnd {
        run: RunId,
        label: String,
        seq: u64,
        end: u64,
    },
    /// A checkpoint label the run already uses.
    #[error("run {run} already has a checkpoint labelled `{label}` (at seq {seq}); remove it first (`forkfleet checkpoint rm {run} {label}`) or pick another label")]
    CheckpointLabelTaken { run: RunId, label: String, seq: u64 },
    /// A steer of a branch paused by a budget cap (no worker runs it).
    #[error("branch `{label}` of fork {fork} is paused by a budget cap: no worker runs it; raise the cap first (`forkfleet fork topup {fork} --branch {label} --usd N`, or the fork's or account's cap), then steer it")]
    SteerPaused { fork: ForkId, label: String },
    /// A steer of a finished branch.
    #[error("branch `{label}` of fork {fork} has finished ({state}): there is no next model call to steer; start a new turn with `forkfleet fork continue {fork} {label} \"MESSAGE\"`")]
    SteerFinished {
        fork: ForkId,
        label: String,
        state: BranchState,
    },
    /// A steer of a fork that is merged or aborted (its branches are being stopped).
    #[error("fork {fork} is {phase}: its branches are being stopped; nothing to steer")]
    SteerStopping { fork: ForkId, phase: &'static str },
    /// A follow-up on a branch of a merged fork.
    #[error("fork {fork} was merged (winner `{winner}`): its branches are final and cannot be continued")]
    ContinueMerged { fork: ForkId, winner: String },
    /// A follow-up on a branch of an aborted fork.
    #[error("fork {0} was aborted: its branches cannot be continued")]
    ContinueAborted(ForkId),
    /// A follow-up on a branch stopped by a cap that still has no room (`full` names it:
    /// the branch's, the fork's or the account's).
    #[error("branch `{label}` of fork {fork} stopped at a budget cap ({state}) and {full} has no room left: a new turn would stop at once; raise it first (`forkfleet fork topup {fork} --branch {label} --usd N` for the branch's cap, without --branch for the fork's, `forkfleet account set` for an account's), then continue it")]
    CapFull {
        fork: ForkId,
        label: String,
        state: BranchState,
        full: &'static str,
    },
    /// A follow-up on a branch paused by a budget cap.
    #[error("branch `{label}` of fork {fork} is paused by a budget cap, not finished: raise the cap (`forkfleet fork topup {fork} --branch {label} --usd N`) to resume it, and steer it (`forkfleet fork steer {fork} {label} \"MESSAGE\"`) while it runs")]
    ContinuePaused { fork: ForkId, label: String },
    /// A steer or follow-up of a branch whose tool call waits for consent.
    #[error("branch `{label}` of fork {fork} waits for approval of its `{tool}` call ({call_id}): answer it first (`forkfleet fork approve {fork} {label}` or `forkfleet fork deny {fork} {label} --reason TEXT`), then steer or continue it")]
    AwaitingApproval {
        fork: ForkId,
        label: String,
        tool: String,
        call_id: String,
    },
    /// `fork rm` of a fork with branches that have not finished.
    #[error("cannot remove fork {fork}: branches have not finished: {}; abort it first (`forkfleet fork abort {fork}`)", .unfinished.join(", "))]
    RemoveUnfinished {
        fork: ForkId,
        unfinished: Vec<String>,
    },
    /// `fork rm` of a fork something that stays refers to (or that charges an account).
    #[error("cannot remove fork {fork}: {why}")]
    RemoveRefused { fork: ForkId, why: String },
    /// An answer for a branch that is not waiting for one.
    #[error("branch `{label}` of fork {fork} is not waiting for approval (it is {state}); nothing to answer: `forkfleet approvals` lists the requests that wait")]
    NotAwaitingApproval {
        fork: ForkId,
        label: String,
        state: BranchState,
    },
    /// An answer naming a call other than the one that waits.
    #[error("branch `{label}` of fork {fork} waits for call {pending} ({tool}), not {given}: that request was answered already or never made; answer {pending}, or leave the call id out")]
    StaleApproval {
        fork: ForkId,
        label: String,
        given: String,
        pending: String,
        tool: String,
    },
    /// A follow-up on a branch still running.
    #[error("branch `{label}` of fork {fork} is {state} (still running): `fork continue` starts a new turn of a finished branch; steer this one instead (`forkfleet fork steer {fork} {label} \"MESSAGE\"`)")]
    ContinueRunning {
        fork: ForkId,
        label: String,
        state: BranchState,
    },
    #[error("the run store in `{dir}` is locked by another process (another coordinator or `forkfleet run` using the same data dir): {message}")]
    StoreLocked { dir: PathBuf, message: String },

    // ---- unavailable -------------------------------------------------------------------
    #[error(transparent)]
    Bus(#[from] BusError),
    #[error("{what} did not finish within {ms} ms")]
    Timeout { what: &'static str, ms: u64 },
    #[error("the coordinator is shutting down or its {0} stopped")]
    Closed(&'static str),

    // ---- failures ----------------------------------------------------------------------
    #[error("cannot open the run store in `{dir}`: {message}")]
    StoreOpen { dir: PathBuf, message: String },
    #[error("run store failed: {0}")]
    Store(#[from] sled::Error),
    /// A blob of the run store could not be read or written (a blob file).
    #[error("run store failed: {0}")]
    StoreBlob(#[from] forkfleet_shared::blob::BlobError),
    #[error("a stored {what} could not be read or written: {message}")]
    Codec { what: &'static str, message: String },
    #[error(transparent)]
    Wire(#[from] WireError),
    /// A broken invariant of the coordinator (an actor that would not start, a stored
    /// change log that does not apply, ...).
    #[error("internal error: {0}")]
    Internal(String),
}

impl CoordinatorError {
    /// What kind of error this is: the one place the mapping lives.
    pub fn kind(&self) -> ErrorKind {
        use CoordinatorError as E;
        match self {
            E::AmbiguousFork { .. }
            | E::AmbiguousRun { .. }
            | E::MissingRunId
            | E::AmbiguousCheckpoint { .. }
            | E::InvalidPlan(_)
            | E::ModelNotOffered(_)
            | E::DuplicateLabel(_)
            | E::UnknownModel { .. }
            | E::MissingBlobs { .. }
            | E::BadSnapshot { .. }
            | E::BadStrategy(_)
            | E::NoJudge { .. }
            | E::EmptyMessage { .. }
            | E::EmptyCheckpointLabel
            | E::BadCheckpointLabel { .. }
            | E::AutomaticCheckpointLabel { .. }
            | E::CheckpointLabelIsId { .. }
            | E::NoConversation { .. }
            | E::RootRunForks { .. }
            | E::NoAgentBranches
            | E::MissingSteer { .. }
            | E::NotMadeByRun { .. }
            | E::NotARootRun { .. }
            | E::BadRequest(_)
            | E::NeedsMessage { .. }
            | E::BadBudget(_) => ErrorKind::BadInput,
            E::UnknownFork(_)
            | E::UnknownRun(_)
            | E::UnknownRunPrefix { .. }
            | E::UnknownLabel { .. }
            | E::UnknownCheckpoint { .. }
            | E::UnknownAccount { .. } => ErrorKind::NotFound,
            E::AlreadyMerged { .. }
            | E::Aborted(_)
            | E::MergeInProgress(_)
            | E::StillRunning { .. }
            | E::ForkBusy { .. }
            | E::ResolveInProgress(_)
            | E::Unfinished { .. }
            | E::AgentMerges { .. }
            | E::AgentStillRunning { .. }
            | E::RewindRunning { .. }
            | E::RewindRaced { .. }
            | E::EmptyLog(_)
            | E::CheckpointPastEnd { .. }
            | E::CheckpointLabelTaken { .. }
            | E::Superseded { .. }
            | E::SteerPaused { .. }
            | E::SteerFinished { .. }
            | E::SteerStopping { .. }
            | E::ContinueMerged { .. }
            | E::ContinueAborted(_)
            | E::CapFull { .. }
            | E::ContinuePaused { .. }
            | E::AwaitingApproval { .. }
            | E::RemoveUnfinished { .. }
            | E::RemoveRefused { .. }
            | E::NotAwaitingApproval { .. }
            | E::StaleApproval { .. }
            | E::ContinueRunning { .. }
            | E::BlobQuota(_) => ErrorKind::Conflict,
            E::Bus(e) => e.kind(),
            E::Timeout { .. } | E::Closed(_) | E::StoreLocked { .. } => ErrorKind::Unavailable,
            E::StoreOpen { .. }
            | E::Store(_)
            | E::StoreBlob(_)
            | E::Codec { .. }
            | E::Wire(_)
            | E::Internal(_) => ErrorKind::Failure,
        }
    }

    /// True when the request cannot succeed as things are (exit code 2: bad input, an
    /// unknown name, a conflict with the current state); false for a failure (exit 1).
    pub fn is_bad_input(&self) -> bool {
        self.kind().is_bad_input()
    }

    pub(crate) fn codec(what: &'static str, e: impl std::fmt::Display) -> Self {
        CoordinatorError::Codec {
            what,
            message: e.to_string(),
        }
    }

    pub(crate) fn missing_blobs(missing: &[BlobHash]) -> Self {
        CoordinatorError::MissingBlobs {
            count: missing.len(),
            sample: list(missing.iter().map(|h| h.short())),
        }
    }
}

/// A failed actor call: a timeout, or an actor that is gone.
pub(crate) fn actor_call<T>(
    e: ractor::RactorErr<T>,
    actor: &'static str,
    what: &'static str,
    ms: u64,
) -> CoordinatorError {
    match e {
        ractor::RactorErr::Timeout => CoordinatorError::Timeout { what, ms },
        _ => CoordinatorError::Closed(actor),
    }
}

impl From<tokio::task::JoinError> for CoordinatorError {
    fn from(e: tokio::task::JoinError) -> Self {
        CoordinatorError::Internal(format!("a background task failed: {e}"))
    }
}

/// A count of matches as a message says it: "more than 10" past [`LIST_LIMIT`].
fn at_most(count: &usize) -> String {
    if *count > LIST_LIMIT {
        format!("more than {LIST_LIMIT}")
    } else {
        count.to_string()
    }
}

/// `a, b, c and N more`: at most [`LIST_LIMIT`] items.
pub(crate) fn list<S: std::fmt::Display>(items: impl ExactSizeIterator<Item = S>) -> String {
    let total = items.len();
    let mut out = String::new();
    for (i, item) in items.take(LIST_LIMIT).enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        let _ = write!(out, "{item}");
    }
    if total > LIST_LIMIT {
        let _ = write!(out, " and {} more", total - LIST_LIMIT);
    }
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests;
