//! Finding a fork or a run by a prefix of its id: one rule for every lookup (the root's
//! forks, the store's runs, a scoped client's own forks and runs).

use crate::error::{list, CoordinatorError};
use forkfleet_shared::ids::{ForkId, RunId};

/// A prefix as matched: trimmed, lower case, without a leading `…` (or `...`) a tail is
/// shown with.
pub(crate) fn needle(prefix: &str) -> String {
    let t = prefix.trim();
    let t = t
        .strip_prefix('…')
        .or_else(|| t.strip_prefix("..."))
        .unwrap_or(t);
    t.to_ascii_lowercase()
}

/// The shortest tail that finds an id: ids made in the same millisecond (UUID v7) share
/// their first 26 characters, so their random tails are what tells them apart.
pub(crate) const MIN_TAIL: usize = 4;

/// Whether `id` matches `needle` ([`needle`]): by its start, or (`tail`) by its end.
pub(crate) fn id_matches(id: &str, needle: &str, tail: bool) -> bool {
    if tail {
        needle.len() >= MIN_TAIL && id.ends_with(needle)
    } else {
        id.starts_with(needle)
    }
}

/// The ids among `ids` that start with `prefix` (see [`needle`]); when none does, those
/// that end with it (at least [`MIN_TAIL`] characters). An empty prefix matches nothing.
pub(crate) fn matching<T: ToString>(ids: impl Iterator<Item = T>, prefix: &str) -> Vec<T> {
    let all: Vec<(String, T)> = ids.map(|id| (id.to_string(), id)).collect();
    let needle = needle(prefix);
    let by_start = all.iter().any(|(s, _)| id_matches(s, &needle, false));
    matching_by(all, prefix, !by_start)
}

/// The ids among `ids` that start with `prefix`, or (`tail`) end with it.
pub(crate) fn matching_by<T>(ids: Vec<(String, T)>, prefix: &str, tail: bool) -> Vec<T> {
    let needle = needle(prefix);
    if needle.is_empty() {
        return Vec::new();
    }
    ids.into_iter()
        .filter(|(s, _)| id_matches(s, &needle, tail))
        .map(|(_, id)| id)
        .collect()
}

/// `ids` as [`matching_by`] takes them.
pub(crate) fn keyed<T: ToString>(ids: impl Iterator<Item = T>) -> Vec<(String, T)> {
    ids.map(|id| (id.to_string(), id)).collect()
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

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_wins_and_a_random_tail_finds_an_id_when_no_prefix_does() {
        let ids = ["01a2-aaaa-1111", "01a2-aaaa-2222", "01a2-bbbb-1111"];
        assert_eq!(matching(ids.iter(), "01a2-a").len(), 2);
        assert_eq!(matching(ids.iter(), "2222"), [&"01a2-aaaa-2222"]);
        assert_eq!(matching(ids.iter(), "…2222"), [&"01a2-aaaa-2222"]);
        assert_eq!(matching(ids.iter(), "...2222"), [&"01a2-aaaa-2222"]);
        // Two tails alike: ambiguous, as a prefix would be.
        assert_eq!(matching(ids.iter(), "1111").len(), 2);
        // Too short a tail finds nothing.
        assert!(matching(ids.iter(), "222").is_empty());
    }
}
