//! Finding a fork or a run by a prefix of its id: one rule for every lookup (the root's
//! forks, the store's runs, a scoped client's own forks and runs).

use crate::error::{list, CoordinatorError};
use forkfleet_shared::ids::{ForkId, RunId};

/// A prefix as matched: trimmed, lower case.
pub(crate) fn needle(prefix: &str) -> String {
    prefix.trim().to_ascii_lowercase()
}

/// The ids among `ids` that start with `prefix` (see [`needle`]); an empty prefix matches
/// nothing.
pub(crate) fn matching<T: ToString>(ids: impl Iterator<Item = T>, prefix: &str) -> Vec<T> {
    let needle = needle(prefix);
    if needle.is_empty() {
        return Vec::new();
    }
    ids.filter(|id| id.to_string().starts_with(&needle))
        .collect()
}

/// The one fork `matches` holds for `prefix`, or the error saying none or which.
pub(crate) fn one_fork(matches: &[ForkId], prefix: &str) -> Result<ForkId, CoordinatorError> {
    match matches {
        [one] => Ok(*one),
        [] => Err(CoordinatorError::UnknownFork(prefix.to_string())),
        many => Err(CoordinatorError::AmbiguousFork {
            prefix: prefix.to_string(),
            count: many.len(),
            matches: list(many.iter()),
        }),
    }
}

/// The one run `matches` holds for `prefix`, or the error saying none or which (the
/// store stops looking past 11 matches, so the message says "more than 10" and lists 10).
pub(crate) fn one_run(matches: &[RunId], prefix: &str) -> Result<RunId, CoordinatorError> {
    match matches {
        [one] => Ok(*one),
        [] => Err(CoordinatorError::UnknownRunPrefix {
            prefix: prefix.to_string(),
        }),
        many => Err(CoordinatorError::AmbiguousRun {
            prefix: prefix.to_string(),
            count: many.len(),
            matches: list(many.iter().take(10)),
        }),
    }
}
