//! What can go wrong on the client side: [`ClientError`], the crate's one error enum.
//!
//! Every fallible function of the crate answers `Result<_, ClientError>`; a caller matches
//! on the variant for what went wrong, or asks [`ClientError::kind`] what kind of error it
//! is (`forkfleet_shared::error::ErrorKind`, which gives the CLI's exit code). The mapping
//! from variant to kind is the one match in [`ClientError::kind`].

use forkfleet_bus::apicall::CallError;
use forkfleet_shared::api::ApiError;
use forkfleet_shared::blob::BlobError;
use forkfleet_shared::error::ErrorKind;
use forkfleet_shared::ids::ForkId;
use forkfleet_shared::manifest::ScanError;
use std::path::PathBuf;

/// Why a client-side operation failed: a call to the coordinator, the workspace, the
/// blob store, the fork directory or a diff tool.
/// A name that cannot be an entry of the fork directory.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{name}` cannot name an entry of the fork directory: {reason}")]
pub struct UnsafeName {
    pub name: String,
    pub reason: &'static str,
}

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The coordinator answered with an error (embedded or remote alike), could not be
    /// reached, or answered something unexpected.
    #[error(transparent)]
    Call(#[from] CallError),
    /// The command needs something only a cluster has.
    #[error("{0}")]
    NeedsCluster(&'static str),
    /// The user's input cannot be used (a path, a name, a template); the message says what
    /// was wrong and what is valid.
    #[error("{0}")]
    BadInput(String),
    /// The workspace to upload cannot be scanned (it is not a directory, a file cannot be
    /// read).
    #[error(transparent)]
    Scan(#[from] ScanError),
    /// A file or directory could not be read, written, created or removed.
    #[error("cannot {action} `{}`", path.display())]
    Io {
        /// What was being done, completing "cannot ...": `create`, `write`, `remove the
        /// fork directory`, `apply the merge to`.
        action: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The blob store failed, or lacks or corrupted a blob the client needs.
    #[error("{what}")]
    Blob {
        /// What was being done: `uploading the workspace`, `reading blob ... for the fork
        /// directory`.
        what: String,
        #[source]
        source: BlobError,
    },
    /// Something the client produced could not be encoded (a manifest, a JSON document).
    #[error("cannot encode {what}")]
    Encode {
        what: &'static str,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// Something the client read does not decode (a snapshot's manifest).
    #[error("{what} does not decode")]
    Decode {
        what: &'static str,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A task doing blocking work (file-system writes) panicked or was cancelled.
    #[error("a background task failed")]
    Task(#[source] tokio::task::JoinError),
    /// A name the coordinator sent (a fork id, a touched path) cannot be an entry of the
    /// fork directory.
    #[error(transparent)]
    UnsafeName(#[from] UnsafeName),
    /// The fork has no workspace directory, so it has no fork directory.
    #[error("fork {fork} has no workspace directory (its creator did not say where it is), so it has no fork directory")]
    NoWorkspace { fork: ForkId },
    /// The fork was merged and its fork directory removed (the plan does not keep it): it
    /// is not made again.
    #[error("fork {fork} was merged (winner `{winner}`), so its fork directory was removed (a plan with `keep_artifacts = true` keeps it); `forkfleet fork diff {fork} --unified{reach}` shows what the branches changed")]
    ForkDirRemoved {
        fork: ForkId,
        winner: String,
        /// The flags that reach the coordinator (see `Client::reach`).
        reach: String,
    },
    /// The fork's workspace is not a directory on this machine (it was created elsewhere).
    #[error("the fork's workspace `{}` is not a directory on this machine", path.display())]
    WorkspaceNotHere { path: PathBuf },
    /// Something stands where the fork directory or one of its parents belongs (a file, a
    /// symbolic link): the fork directory is never written or removed through it.
    #[error("`{}` {why}", path.display())]
    Blocked {
        path: PathBuf,
        /// Why, completing "`path` ...": `is a symbolic link; ...`, `is in the way: ...`.
        why: &'static str,
    },
    /// A sync left the fork directory incomplete: some entries could not be written or
    /// removed.
    #[error(
        "the fork directory `{}` is incomplete: {}{}",
        dir.display(),
        failures.join("; "),
        if *more > 0 { format!(" (and {more} more)") } else { String::new() }
    )]
    ForkDirIncomplete {
        dir: PathBuf,
        /// The first failures, each naming its entry.
        failures: Vec<String>,
        /// How many more failures there were.
        more: usize,
    },
    /// A step in the user's git repository failed or was refused (`--git-branch`).
    #[error(transparent)]
    Git(#[from] crate::git::GitError),
    /// A diff tool `fork open` launched could not be run or exited with a failure.
    #[error("{}", failed.join("; "))]
    DiffTool {
        /// One line per command that failed: the command and what happened.
        failed: Vec<String>,
    },
    /// Following a fork gave up at its timeout; the fork itself keeps going.
    #[error(
        "gave up waiting after {after_s} s: {finished} of {total} branches finished{} (the fork stays in the store; `forkfleet fork show {fork}{reach}`)",
        if *paused > 0 { format!(", {paused} paused by a budget cap") } else { String::new() }
    )]
    GaveUp {
        fork: ForkId,
        after_s: u64,
        finished: usize,
        total: usize,
        paused: usize,
        /// The flags that reach the coordinator (see `Client::reach`).
        reach: String,
    },
}

impl From<ApiError> for ClientError {
    fn from(e: ApiError) -> Self {
        ClientError::Call(CallError::Api(e))
    }
}

impl ClientError {
    /// What kind of error this is: the one place the mapping lives. An API error is the
    /// kind the coordinator gave it; a bus or blob store that failed is `unavailable`; the
    /// user's input (a name, a path, a workspace that cannot be scanned) is `bad_input`.
    pub fn kind(&self) -> ErrorKind {
        use ClientError as E;
        match self {
            E::Call(CallError::Api(e)) => e.kind,
            E::Call(CallError::Bus(e)) => e.kind(),
            E::Call(CallError::GaveUp { .. }) => ErrorKind::Unavailable,
            E::Call(CallError::Blob(e)) | E::Blob { source: e, .. } => e.kind(),
            E::NeedsCluster(_) | E::BadInput(_) | E::Scan(_) => ErrorKind::BadInput,
            E::NoWorkspace { .. } | E::WorkspaceNotHere { .. } => ErrorKind::NotFound,
            E::Blocked { .. } | E::ForkDirRemoved { .. } => ErrorKind::Conflict,
            E::GaveUp { .. } => ErrorKind::Unavailable,
            E::Git(e) => e.kind(),
            E::Call(CallError::Wire(_))
            | E::Call(CallError::UnexpectedReply { .. })
            | E::Io { .. }
            | E::Encode { .. }
            | E::Decode { .. }
            | E::Task(_)
            | E::UnsafeName(_)
            | E::ForkDirIncomplete { .. }
            | E::DiffTool { .. } => ErrorKind::Failure,
        }
    }

    /// True when the request can be fixed by the user, or the state it names changed
    /// first (exit code 2).
    pub fn is_bad_input(&self) -> bool {
        self.kind().is_bad_input()
    }

    /// The API error the coordinator answered with, if that is what this is.
    pub fn api(&self) -> Option<&ApiError> {
        match self {
            ClientError::Call(CallError::Api(e)) => Some(e),
            _ => None,
        }
    }

    /// A file-system failure: `action` completes "cannot ..." (`create`, `write`).
    pub fn io(action: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        ClientError::Io {
            action,
            path: path.into(),
            source,
        }
    }

    /// A blob store failure while doing `what` (`uploading the workspace`).
    pub fn blob(what: impl Into<String>, source: BlobError) -> Self {
        ClientError::Blob {
            what: what.into(),
            source,
        }
    }

    /// `what` could not be encoded.
    pub fn encode(
        what: &'static str,
        source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        ClientError::Encode {
            what,
            source: source.into(),
        }
    }

    /// `what` does not decode.
    pub fn decode(
        what: &'static str,
        source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        ClientError::Decode {
            what,
            source: source.into(),
        }
    }
}

impl From<tokio::task::JoinError> for ClientError {
    fn from(e: tokio::task::JoinError) -> Self {
        ClientError::Task(e)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::render::error_chain;
    use forkfleet_bus::BusError;
    use forkfleet_shared::blob::BlobHash;
    use std::io;

    fn fork() -> ForkId {
        ForkId::new()
    }

    /// Every variant, with the kind it must have and a word its message must name.
    fn table() -> Vec<(ClientError, ErrorKind, &'static str)> {
        let hash = BlobHash::of(b"x");
        let io = || io::Error::new(io::ErrorKind::PermissionDenied, "permission denied");
        vec![
            (
                ApiError::new(ErrorKind::Conflict, "fork is merged").into(),
                ErrorKind::Conflict,
                "fork is merged",
            ),
            (
                ApiError::new(ErrorKind::NotFound, "no fork `abc`").into(),
                ErrorKind::NotFound,
                "no fork `abc`",
            ),
            (
                CallError::Bus(BusError::Closed).into(),
                ErrorKind::Unavailable,
                "the bus is closed",
            ),
            (
                CallError::Blob(BlobError::Missing(hash)).into(),
                ErrorKind::NotFound,
                "is not in the store",
            ),
            (
                CallError::UnexpectedReply {
                    op: "merge",
                    got: "fork",
                }
                .into(),
                ErrorKind::Failure,
                "answered `fork` to a `merge` request",
            ),
            (
                ClientError::NeedsCluster("`workers` needs a cluster: pass --nats URL"),
                ErrorKind::BadInput,
                "--nats URL",
            ),
            (
                ClientError::BadInput("PATH: `..` is not a workspace path".into()),
                ErrorKind::BadInput,
                "PATH: `..`",
            ),
            (
                ScanError::NotADirectory("/no/such/ws".into()).into(),
                ErrorKind::BadInput,
                "/no/such/ws",
            ),
            (
                ClientError::io("create", "/ws/.forkfleet", io()),
                ErrorKind::Failure,
                "cannot create `/ws/.forkfleet`: permission denied",
            ),
            (
                ClientError::blob("uploading the workspace", BlobError::Backend("down".into())),
                ErrorKind::Unavailable,
                "uploading the workspace: blob store failed: down",
            ),
            (
                ClientError::blob("reading the fork snapshot", BlobError::Missing(hash)),
                ErrorKind::NotFound,
                "reading the fork snapshot: blob",
            ),
            (
                ClientError::blob(
                    "reading the fork snapshot",
                    BlobError::Corrupt {
                        expected: hash,
                        actual: hash,
                    },
                ),
                ErrorKind::Failure,
                "wrong content",
            ),
            (
                ClientError::encode("the manifest", "too deep"),
                ErrorKind::Failure,
                "cannot encode the manifest: too deep",
            ),
            (
                ClientError::decode("the fork snapshot", "truncated"),
                ErrorKind::Failure,
                "the fork snapshot does not decode: truncated",
            ),
            (
                UnsafeName {
                    name: "a/../b".into(),
                    reason: "it names a directory itself or its parent",
                }
                .into(),
                ErrorKind::Failure,
                "`a/../b` cannot name an entry of the fork directory",
            ),
            (
                ClientError::ForkDirRemoved {
                    fork: fork(),
                    winner: "a".into(),
                    reach: String::new(),
                },
                ErrorKind::Conflict,
                "was merged (winner `a`), so its fork directory was removed",
            ),
            (
                ClientError::NoWorkspace { fork: fork() },
                ErrorKind::NotFound,
                "has no workspace directory",
            ),
            (
                ClientError::WorkspaceNotHere {
                    path: "/elsewhere".into(),
                },
                ErrorKind::NotFound,
                "`/elsewhere` is not a directory on this machine",
            ),
            (
                ClientError::Blocked {
                    path: "/ws/.forkfleet".into(),
                    why: "is a symbolic link; the fork directory is never written through one",
                },
                ErrorKind::Conflict,
                "`/ws/.forkfleet` is a symbolic link",
            ),
            (
                ClientError::ForkDirIncomplete {
                    dir: "/ws/.forkfleet/forks/f".into(),
                    failures: vec!["writing `parent/a.py`: disk full".into()],
                    more: 2,
                },
                ErrorKind::Failure,
                "incomplete: writing `parent/a.py`: disk full (and 2 more)",
            ),
            (
                ClientError::DiffTool {
                    failed: vec!["`meld a b` exited with exit status: 1".into()],
                },
                ErrorKind::Failure,
                "`meld a b` exited",
            ),
            (
                ClientError::GaveUp {
                    fork: fork(),
                    after_s: 30,
                    finished: 1,
                    total: 3,
                    paused: 2,
                    reach: " --data /d".into(),
                },
                ErrorKind::Unavailable,
                "gave up waiting after 30 s: 1 of 3 branches finished, 2 paused by a budget cap",
            ),
        ]
    }

    #[test]
    fn every_variant_has_its_kind_and_names_what_was_wrong() {
        for (e, kind, says) in table() {
            let msg = error_chain(&e);
            assert_eq!(e.kind(), kind, "{msg}");
            assert_eq!(e.is_bad_input(), kind.exit_code() == 2, "{msg}");
            assert!(msg.contains(says), "`{msg}` must contain `{says}`");
        }
    }

    #[tokio::test]
    async fn a_failed_task_is_a_failure() {
        let task = tokio::spawn(std::future::pending::<()>());
        task.abort();
        let join = task.await.unwrap_err();
        let e = ClientError::from(join);
        assert_eq!(e.kind(), ErrorKind::Failure);
        assert!(error_chain(&e).starts_with("a background task failed"));
    }

    #[test]
    fn only_an_api_error_is_an_api_error() {
        let e: ClientError = ApiError::new(ErrorKind::BadInput, "empty message").into();
        assert_eq!(e.api().map(|a| a.message.as_str()), Some("empty message"));
        assert!(ClientError::BadInput("x".into()).api().is_none());
    }

    #[test]
    fn a_gave_up_message_without_paused_branches_says_nothing_of_them() {
        let e = ClientError::GaveUp {
            reach: String::new(),
            fork: fork(),
            after_s: 5,
            finished: 0,
            total: 2,
            paused: 0,
        };
        let msg = e.to_string();
        assert!(msg.contains("0 of 2 branches finished (the fork"), "{msg}");
        assert!(!msg.contains("paused"), "{msg}");
    }
}
