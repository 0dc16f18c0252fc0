//! What kind of error an error is: the one question every caller of forkfleet asks of a
//! failed request, whichever crate it failed in.
//!
//! Each crate has one error enum whose variants say exactly what went wrong (the
//! coordinator's `CoordinatorError`, the worker's `WorkerError`); each answers
//! `kind() -> ErrorKind` in one match, the single place its mapping lives. The CLI's exit
//! code follows from the kind, through [`ErrorKind::exit_code`]:
//!
//! | kind          | exit code | meaning                                                   |
//! |---------------|-----------|-----------------------------------------------------------|
//! | `bad_input`   | 2         | the request cannot succeed as sent: fix it                 |
//! | `not_found`   | 2         | what the request names does not exist                      |
//! | `conflict`    | 2         | the request is valid, but the current state forbids it     |
//! | `unavailable` | 1         | a service could not be reached, or closed, or timed out    |
//! | `failure`     | 1         | an internal failure                                        |
//!
//! Exit code 2 says "this request cannot succeed as things are: change it, or them";
//! exit code 1 says "it did not happen, through no fault of the request".
//!
//! The kind travels on the wire as the API error's kind (`forkfleet_shared::api::ApiError`),
//! so a remote client decides exactly as an in-process one.

use crate::blob::BlobError;
use serde::{Deserialize, Serialize};

/// What kind of error an error is (see the module docs for the exit codes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// The request cannot succeed as sent (malformed, an invalid plan or amount, an empty
    /// message, a missing API key ...): fix it and ask again.
    BadInput,
    /// The fork, run, label, account or checkpoint named does not exist.
    NotFound,
    /// The request is valid but the current state forbids it: the fork is already merged,
    /// aborted or being merged, a branch is still running ... Asking again after the state
    /// changes may succeed.
    Conflict,
    /// A service could not be reached, is closed, or did not answer in time (the bus, the
    /// blob store, a model API, a run store another process holds): the same request may
    /// succeed later.
    Unavailable,
    /// An internal failure (a store that cannot be read or written, a broken invariant).
    Failure,
}

impl ErrorKind {
    /// Every kind, in declaration order.
    pub const ALL: [ErrorKind; 5] = [
        ErrorKind::BadInput,
        ErrorKind::NotFound,
        ErrorKind::Conflict,
        ErrorKind::Unavailable,
        ErrorKind::Failure,
    ];

    /// The kind's wire name (`bad_input`, `not_found`, ...), as serde writes it.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::BadInput => "bad_input",
            ErrorKind::NotFound => "not_found",
            ErrorKind::Conflict => "conflict",
            ErrorKind::Unavailable => "unavailable",
            ErrorKind::Failure => "failure",
        }
    }

    /// The CLI's exit code for an error of this kind: 2 when the request cannot succeed as
    /// things are (bad input, it names what does not exist, the state forbids it), 1 when
    /// it did not happen for another reason.
    pub fn exit_code(self) -> u8 {
        match self {
            ErrorKind::BadInput | ErrorKind::NotFound | ErrorKind::Conflict => 2,
            ErrorKind::Unavailable | ErrorKind::Failure => 1,
        }
    }

    /// True when the caller must change the request or the state first (exit code 2).
    pub fn is_bad_input(self) -> bool {
        self.exit_code() == 2
    }
}

impl std::fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl BlobError {
    /// A missing blob is `not_found`, a store that failed `unavailable`, a blob that
    /// arrived with the wrong content a `failure`.
    pub fn kind(&self) -> ErrorKind {
        match self {
            BlobError::Missing(_) => ErrorKind::NotFound,
            BlobError::Corrupt { .. } => ErrorKind::Failure,
            BlobError::Backend(_) => ErrorKind::Unavailable,
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::blob::BlobHash;

    #[test]
    fn exit_codes_follow_the_table() {
        let table = [
            (ErrorKind::BadInput, 2),
            (ErrorKind::NotFound, 2),
            (ErrorKind::Conflict, 2),
            (ErrorKind::Unavailable, 1),
            (ErrorKind::Failure, 1),
        ];
        assert_eq!(table.len(), ErrorKind::ALL.len());
        for (kind, code) in table {
            assert_eq!(kind.exit_code(), code, "{kind}");
        }
    }

    #[test]
    fn serde_names_are_as_str() {
        for kind in ErrorKind::ALL {
            let json = serde_json::to_string(&kind).unwrap();
            assert_eq!(json, format!("\"{}\"", kind.as_str()));
            let back: ErrorKind = serde_json::from_str(&json).unwrap();
            assert_eq!(back, kind);
        }
    }

    #[test]
    fn shared_errors_have_kinds() {
        let hash = BlobHash::of(b"x");
        let table = [
            (BlobError::Missing(hash).kind(), ErrorKind::NotFound),
            (
                BlobError::Corrupt {
                    expected: hash,
                    actual: hash,
                }
                .kind(),
                ErrorKind::Failure,
            ),
            (
                BlobError::Backend("x".into()).kind(),
                ErrorKind::Unavailable,
            ),
        ];
        for (got, want) in table {
            assert_eq!(got, want);
        }
    }
}
