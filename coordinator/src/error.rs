//! The coordinator's one error type: a variant per decision a caller makes.
//!
//! [`CoordinatorError::is_bad_input`] splits them for the CLI: bad input (exit 2) is a
//! request the caller can fix (an unknown fork or label, an invalid plan, a merge the
//! fork's state does not allow, blobs not uploaded); everything else is a failure (exit 1).

use forkfleet_bus::BusError;
use forkfleet_shared::blob::BlobHash;
use forkfleet_shared::ids::{ForkId, RunId};
use forkfleet_shared::spec::SpecError;
use forkfleet_shared::state::BranchState;
use forkfleet_shared::wire::WireError;
use std::fmt::Write as _;
use std::path::PathBuf;

/// How many items an error message lists before it says "and N more".
const LIST_LIMIT: usize = 10;

#[derive(Debug, thiserror::Error)]
pub enum CoordinatorError {
    // ---- bad input ---------------------------------------------------------------------
    #[error("no fork matches `{0}`; `forkfleet fork ls` lists them")]
    UnknownFork(String),
    #[error("`{prefix}` matches {count} forks ({matches}); give more of the id")]
    AmbiguousFork {
        prefix: String,
        count: usize,
        matches: String,
    },
    #[error("run {0} does not exist")]
    UnknownRun(RunId),
    #[error("fork {fork} has no branch labelled `{label}`; valid labels: {valid}")]
    UnknownLabel {
        fork: ForkId,
        label: String,
        valid: String,
    },
    #[error("invalid fork plan: {0}")]
    InvalidPlan(#[from] SpecError),
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
    #[error("fork {fork} was already merged (winner `{winner}`); a fork merges once")]
    AlreadyMerged { fork: ForkId, winner: String },
    #[error("fork {0} was aborted; nothing can be merged")]
    Aborted(ForkId),
    #[error("fork {0} is being merged right now")]
    MergeInProgress(ForkId),
    #[error("branch `{label}` is {state}: still running; wait for it or terminate it")]
    StillRunning { label: String, state: BranchState },
    /// The fork cannot be resolved as asked (branches unfinished, no judge configured, ...).
    #[error("cannot resolve: {0}")]
    CannotResolve(String),
    /// Checkpoints: no checkpoint of the run has this label or id.
    #[error("run {run} has no checkpoint `{reference}`; {valid}")]
    UnknownCheckpoint {
        run: RunId,
        reference: String,
        valid: String,
    },
    /// Checkpoints: no run matches a prefix, or several do.
    #[error("{0}")]
    NoSuchRun(String),
    /// Checkpoints: the request cannot succeed as sent (a running branch, a bad label, ...).
    #[error("{0}")]
    CheckpointRefused(String),
    /// A fork made by a running agent: the agent merges it (ADR 14).
    #[error("{0}")]
    AgentMerges(String),
    /// A request that cannot succeed as sent (the message says why and what is valid).
    #[error("{0}")]
    BadRequest(String),

    // ---- failures ----------------------------------------------------------------------
    #[error("the run store in `{dir}` is locked by another process (another coordinator or `forkfleet run` using the same data dir): {message}")]
    StoreLocked { dir: PathBuf, message: String },
    #[error("cannot open the run store in `{dir}`: {message}")]
    StoreOpen { dir: PathBuf, message: String },
    #[error("run store failed: {0}")]
    Store(#[from] sled::Error),
    #[error("a stored {what} could not be read or written: {message}")]
    Codec { what: &'static str, message: String },
    #[error(transparent)]
    Bus(#[from] BusError),
    #[error(transparent)]
    Wire(#[from] WireError),
    #[error("{what} did not finish within {ms} ms")]
    Timeout { what: &'static str, ms: u64 },
    #[error("the coordinator is shutting down or its {0} stopped")]
    Closed(&'static str),
    #[error("no account named `{name}`; {valid}")]
    UnknownAccount { name: String, valid: String },
    #[error("{0}")]
    BadBudget(String),
    #[error("internal error: {0}")]
    Internal(String),
}

impl CoordinatorError {
    /// True when the caller asked for something it can fix (exit code 2); false for a
    /// failure of the coordinator or its store or bus (exit code 1).
    pub fn is_bad_input(&self) -> bool {
        matches!(
            self,
            CoordinatorError::UnknownFork(_)
                | CoordinatorError::AmbiguousFork { .. }
                | CoordinatorError::UnknownRun(_)
                | CoordinatorError::UnknownLabel { .. }
                | CoordinatorError::InvalidPlan(_)
                | CoordinatorError::DuplicateLabel(_)
                | CoordinatorError::UnknownModel { .. }
                | CoordinatorError::MissingBlobs { .. }
                | CoordinatorError::BadSnapshot { .. }
                | CoordinatorError::AlreadyMerged { .. }
                | CoordinatorError::Aborted(_)
                | CoordinatorError::MergeInProgress(_)
                | CoordinatorError::StillRunning { .. }
                | CoordinatorError::CannotResolve(_)
                | CoordinatorError::UnknownCheckpoint { .. }
                | CoordinatorError::NoSuchRun(_)
                | CoordinatorError::CheckpointRefused(_)
                | CoordinatorError::BadRequest(_)
                | CoordinatorError::AgentMerges(_)
                | CoordinatorError::UnknownAccount { .. }
                | CoordinatorError::BadBudget(_)
        )
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
mod tests {
    use super::*;

    #[test]
    fn lists_are_bounded() {
        assert_eq!(list(["a", "b"].iter()), "a, b");
        let many: Vec<String> = (0..25).map(|i| i.to_string()).collect();
        let s = list(many.iter());
        assert!(s.ends_with("and 15 more"), "{s}");
    }

    #[test]
    fn bad_input_split() {
        assert!(CoordinatorError::UnknownFork("x".into()).is_bad_input());
        assert!(CoordinatorError::missing_blobs(&[BlobHash::of(b"x")]).is_bad_input());
        assert!(!CoordinatorError::Closed("root").is_bad_input());
        assert!(!CoordinatorError::Internal("x".into()).is_bad_input());
    }
}
