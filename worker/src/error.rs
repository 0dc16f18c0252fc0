//! The crate's one error type.
//!
//! A branch's own failures (a model error, a missing script turn, a tool error) are not
//! errors of the worker: they end the branch with a `failed` status or become tool results
//! the model sees, and their message is this error's. What decides between ending a branch
//! and handing its task back for another attempt is the error's [`ErrorKind`]: an
//! `unavailable` one (the bus or the blob store failed) may succeed on another attempt; any
//! other kind will not.
//!
//! The variants, by where they arise:
//! - the worker itself: a bad configuration, a node that would not start or stopped, the
//!   bus, the wire, the blob store;
//! - loading a branch's task: its history prefix, workspace snapshot and change log, its
//!   model ([`WorkerError::ModelUnusable`] wraps the provider's error);
//! - a model and its provider: the model's name, a scripted model's script, and a real
//!   API's answers, told apart by variant (a rejected key, an unknown model, a context
//!   overflow, another final answer, and [`WorkerError::RetriesExhausted`] for rate limits,
//!   server errors and timeouts, whose `last_status` says which);
//! - running a command: the temporary directory and the workspace written into it.

use forkfleet_bus::BusError;
use forkfleet_shared::blob::{BlobError, BlobHash};
use forkfleet_shared::error::ErrorKind;
use forkfleet_shared::script::ScriptError;
use forkfleet_shared::wire::WireError;
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    // ---- the worker itself -------------------------------------------------------------
    /// The configuration cannot work (e.g. a concurrency of 0).
    #[error("invalid worker configuration: {0}")]
    Config(String),
    /// The node actor could not be started.
    #[error("the worker node could not start: {0}")]
    Spawn(String),
    /// The node stopped on its own (it panicked, or the bus went away).
    #[error("the worker node stopped unexpectedly: {0}")]
    NodeStopped(String),
    #[error("bus: {0}")]
    Bus(#[from] BusError),
    #[error("wire: {0}")]
    Wire(#[from] WireError),
    #[error("blob store: {0}")]
    Blob(#[from] BlobError),

    // ---- loading a branch's task -------------------------------------------------------
    /// A blob the task names (`what`: its history prefix, its workspace snapshot) could not
    /// be read.
    #[error("cannot load the {what} ({hash:?}): {error}")]
    TaskBlob {
        what: &'static str,
        hash: BlobHash,
        error: BlobError,
    },
    /// The task's history prefix blob is not a list of events.
    #[error("the history prefix blob {hash:?} is not a list of events: {message}")]
    BadPrefix { hash: BlobHash, message: String },
    /// A part of the task is not valid (a coordinator that skipped a check).
    #[error("the task's {what} are not valid: {message}")]
    BadTask { what: &'static str, message: String },
    /// The task's workspace snapshot blob is not a manifest.
    #[error("the workspace snapshot blob {hash:?} is not a manifest: {message}")]
    BadSnapshot { hash: BlobHash, message: String },
    /// A file change of the branch's log does not apply to its workspace.
    #[error("cannot replay the branch's {change} of `{path}`: {message}")]
    Replay {
        change: &'static str,
        path: String,
        message: String,
    },
    /// The task's model cannot be used; `error` says why (a provider error).
    #[error("cannot use model `{model}`: {error}")]
    ModelUnusable {
        model: String,
        error: Box<WorkerError>,
    },

    // ---- a model and its provider ------------------------------------------------------
    #[error("model `{model}` must be written `provider:name` (known providers: {known})")]
    BadModelName { model: String, known: String },
    #[error("model `{model}` names unknown provider `{provider}` (known providers: {known})")]
    UnknownProvider {
        model: String,
        provider: String,
        known: String,
    },
    #[error("model `{model}` is scripted but the task carries no script")]
    MissingScript { model: String },
    #[error("cannot load the script: {0}")]
    ScriptBlob(BlobError),
    #[error("the script is not valid UTF-8")]
    ScriptEncoding,
    #[error(transparent)]
    Script(#[from] ScriptError),
    /// The key is not where the endpoint says (a variable unset, a file unreadable).
    #[error("model `{model}`: no API key: {detail}")]
    MissingKey { model: String, detail: String },
    /// 401 or 403. `key` says which key was sent (where it was read, never its value).
    #[error("model `{model}`: the API at {base_url} rejected {key} (HTTP {status}: {message})")]
    BadKey {
        model: String,
        base_url: String,
        key: String,
        status: u16,
        message: String,
    },
    /// 404, or an answer saying the model is not found.
    #[error("model `{model}`: the API at {base_url} does not know model `{name}` (HTTP {status}: {message}); check the model name, and that base_url is the API's root (such as https://api.openai.com/v1)")]
    UnknownModel {
        model: String,
        name: String,
        base_url: String,
        status: u16,
        message: String,
    },
    /// The request does not fit the model's context window.
    #[error("model `{model}`: the request ({messages} messages) exceeds the model's context window (HTTP {status}: {message})")]
    ContextOverflow {
        model: String,
        messages: usize,
        status: u16,
        message: String,
    },
    /// Any other final error answer (status and the API's message, truncated): a request
    /// the API refuses (4xx, an exhausted quota among them) or a server error not retried.
    #[error("model `{model}`: the API answered HTTP {status}: {message}")]
    Api {
        model: String,
        status: u16,
        message: String,
    },
    /// Every try was answered 429 or 5xx, or not at all. `last_status` is the last try's
    /// status (429: rate limited; 5xx: the API failed), `None` when it got no answer (a
    /// timeout, a refused connection).
    #[error("model `{model}`: the API at {base_url} failed {tries} tries (the last: {last})")]
    RetriesExhausted {
        model: String,
        base_url: String,
        tries: u32,
        last: String,
        last_status: Option<u16>,
    },
    /// A success answer the provider cannot read.
    #[error("model `{model}`: the API's answer is not understood: {detail}")]
    BadResponse { model: String, detail: String },
    /// The endpoint settings cannot be used.
    #[error("model `{model}`: {detail}")]
    BadEndpoint { model: String, detail: String },
    /// The worker's catalogue refuses the model: not offered, a spec `base_url` on a host
    /// not allowed, or a key source in the task (`detail` names the model already).
    #[error("refused by the worker's model catalogue: {detail}")]
    ModelRefused { model: String, detail: String },
    #[error("cannot build the HTTP client: {0}")]
    Client(String),

    // ---- running a command -------------------------------------------------------------
    /// The command's temporary directory could not be made.
    #[error("cannot make a temporary directory: {0}")]
    TempDir(std::io::Error),
    /// A file of the workspace could not be written into the command's directory.
    #[error("cannot write `{path}` into `{dir}`: {source}")]
    WriteFile {
        dir: PathBuf,
        path: String,
        source: std::io::Error,
    },
    /// The blob of a workspace file could not be read to write it.
    #[error("cannot read the blob of `{path}`: {source}")]
    ReadBlob { path: String, source: BlobError },
    /// An agent's `rewind_to` could not read its rewound log back from the coordinator
    /// (the marker is published: the attempt that takes the branch over loads it).
    #[error("rewind: {0}")]
    Rewind(String),
}

impl WorkerError {
    /// What kind of error this is: the one place the mapping lives. An `unavailable`
    /// error (the bus, the blob store, a model API that kept failing) may succeed later.
    pub fn kind(&self) -> ErrorKind {
        use WorkerError as E;
        match self {
            E::Config(_)
            | E::BadModelName { .. }
            | E::UnknownProvider { .. }
            | E::MissingScript { .. }
            | E::ScriptEncoding
            | E::Script(_)
            | E::MissingKey { .. }
            | E::BadKey { .. }
            | E::ContextOverflow { .. }
            | E::BadEndpoint { .. }
            | E::ModelRefused { .. } => ErrorKind::BadInput,
            E::UnknownModel { .. } => ErrorKind::NotFound,
            E::Api { status, .. } if (400..500).contains(status) => ErrorKind::BadInput,
            E::RetriesExhausted { .. } | E::Rewind(_) => ErrorKind::Unavailable,
            E::Bus(e) => e.kind(),
            E::Blob(e)
            | E::TaskBlob { error: e, .. }
            | E::ScriptBlob(e)
            | E::ReadBlob { source: e, .. } => e.kind(),
            E::ModelUnusable { error, .. } => error.kind(),
            E::Spawn(_)
            | E::NodeStopped(_)
            | E::Wire(_)
            | E::BadPrefix { .. }
            | E::BadTask { .. }
            | E::BadSnapshot { .. }
            | E::Replay { .. }
            | E::Api { .. }
            | E::BadResponse { .. }
            | E::Client(_)
            | E::TempDir(_)
            | E::WriteFile { .. } => ErrorKind::Failure,
        }
    }

    /// True when the workspace could not be written for a command (its directory made,
    /// but a file not written or its blob not read).
    pub fn is_materialize(&self) -> bool {
        matches!(
            self,
            WorkerError::WriteFile { .. } | WorkerError::ReadBlob { .. }
        )
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    /// Every variant: its kind, and words its message must hold (what was wrong).
    #[test]
    fn each_error_has_its_kind_and_names_what_was_wrong() {
        use ErrorKind::*;
        use WorkerError as E;
        let s = |x: &str| x.to_string();
        let hash = BlobHash::of(b"x");
        let io = || std::io::Error::other("disk full");
        let table: Vec<(WorkerError, ErrorKind, Vec<&str>)> = vec![
            (
                E::Config(s("concurrency must be at least 1")),
                BadInput,
                vec!["concurrency must be at least 1"],
            ),
            (
                E::Spawn(s("no runtime")),
                Failure,
                vec!["could not start: no runtime"],
            ),
            (
                E::NodeStopped(s("panicked")),
                Failure,
                vec!["stopped unexpectedly: panicked"],
            ),
            (
                E::Bus(BusError::Closed),
                Unavailable,
                vec!["the bus is closed"],
            ),
            (
                E::Bus(BusError::Timeout {
                    subject: s("s"),
                    ms: 5,
                }),
                Unavailable,
                vec!["within 5 ms"],
            ),
            (
                E::Wire(WireError::Version {
                    found: 9,
                    supported: 1,
                }),
                Failure,
                vec!["wire version 9"],
            ),
            (
                E::Blob(BlobError::Backend(s("down"))),
                Unavailable,
                vec!["down"],
            ),
            (
                E::Blob(BlobError::Missing(hash)),
                NotFound,
                vec!["not in the store"],
            ),
            (
                E::TaskBlob {
                    what: "history prefix",
                    hash,
                    error: BlobError::Backend(s("down")),
                },
                Unavailable,
                vec!["cannot load the history prefix", "down"],
            ),
            (
                E::TaskBlob {
                    what: "workspace snapshot",
                    hash,
                    error: BlobError::Missing(hash),
                },
                NotFound,
                vec!["cannot load the workspace snapshot"],
            ),
            (
                E::TaskBlob {
                    what: "workspace snapshot",
                    hash,
                    error: BlobError::Corrupt {
                        expected: hash,
                        actual: hash,
                    },
                },
                Failure,
                vec!["wrong content"],
            ),
            (
                E::BadPrefix {
                    hash,
                    message: s("eof"),
                },
                Failure,
                vec!["history prefix blob", "not a list of events: eof"],
            ),
            (
                E::BadSnapshot {
                    hash,
                    message: s("eof"),
                },
                Failure,
                vec!["workspace snapshot blob", "not a manifest: eof"],
            ),
            (
                E::Replay {
                    change: "write",
                    path: s("a.txt"),
                    message: s("no parent"),
                },
                Failure,
                vec!["cannot replay the branch's write of `a.txt`: no parent"],
            ),
            (
                E::ModelUnusable {
                    model: s("scripted:x"),
                    error: Box::new(E::ScriptEncoding),
                },
                BadInput,
                vec!["cannot use model `scripted:x`", "not valid UTF-8"],
            ),
            (
                E::ModelUnusable {
                    model: s("scripted:x"),
                    error: Box::new(E::ScriptBlob(BlobError::Backend(s("down")))),
                },
                Unavailable,
                vec!["cannot load the script"],
            ),
            (
                E::BadModelName {
                    model: s("gpt"),
                    known: s("scripted, openai"),
                },
                BadInput,
                vec!["`gpt` must be written `provider:name`", "scripted, openai"],
            ),
            (
                E::UnknownProvider {
                    model: s("x:y"),
                    provider: s("x"),
                    known: s("openai"),
                },
                BadInput,
                vec!["unknown provider `x`", "openai"],
            ),
            (
                E::MissingScript {
                    model: s("scripted:x"),
                },
                BadInput,
                vec!["`scripted:x` is scripted but the task carries no script"],
            ),
            (
                E::ScriptBlob(BlobError::Missing(hash)),
                NotFound,
                vec!["cannot load the script"],
            ),
            (E::ScriptEncoding, BadInput, vec!["not valid UTF-8"]),
            (
                E::Script(ScriptError::Parse(s("line 3: expected `=`"))),
                BadInput,
                vec!["invalid script: line 3"],
            ),
            (
                E::MissingKey {
                    model: s("openai:m"),
                    detail: s("`OPENAI_API_KEY` is not set"),
                },
                BadInput,
                vec!["no API key", "OPENAI_API_KEY"],
            ),
            (
                E::BadKey {
                    model: s("openai:m"),
                    base_url: s("https://api"),
                    key: s("the key from env `K`"),
                    status: 401,
                    message: s("bad key"),
                },
                BadInput,
                vec!["rejected the key from env `K`", "HTTP 401"],
            ),
            (
                E::UnknownModel {
                    model: s("openai:m"),
                    name: s("m"),
                    base_url: s("https://api"),
                    status: 404,
                    message: s("no"),
                },
                NotFound,
                vec!["does not know model `m`", "HTTP 404"],
            ),
            (
                E::ContextOverflow {
                    model: s("openai:m"),
                    messages: 5,
                    status: 400,
                    message: s("too long"),
                },
                BadInput,
                vec!["(5 messages) exceeds the model's context window"],
            ),
            (
                E::Api {
                    model: s("openai:m"),
                    status: 400,
                    message: s("temperature is wrong"),
                },
                BadInput,
                vec!["HTTP 400: temperature is wrong"],
            ),
            (
                E::Api {
                    model: s("openai:m"),
                    status: 501,
                    message: s("not implemented"),
                },
                Failure,
                vec!["HTTP 501"],
            ),
            (
                E::RetriesExhausted {
                    model: s("openai:m"),
                    base_url: s("https://api"),
                    tries: 3,
                    last: s("HTTP 429: slow down"),
                    last_status: Some(429),
                },
                Unavailable,
                vec!["failed 3 tries", "HTTP 429: slow down"],
            ),
            (
                E::RetriesExhausted {
                    model: s("openai:m"),
                    base_url: s("https://api"),
                    tries: 2,
                    last: s("no answer within 1 s (timeout_s)"),
                    last_status: None,
                },
                Unavailable,
                vec!["timeout_s"],
            ),
            (
                E::BadResponse {
                    model: s("openai:m"),
                    detail: s("no choices"),
                },
                Failure,
                vec!["not understood: no choices"],
            ),
            (
                E::BadEndpoint {
                    model: s("openai:m"),
                    detail: s("base_url `x` is not a URL"),
                },
                BadInput,
                vec!["base_url `x` is not a URL"],
            ),
            (
                E::ModelRefused {
                    model: s("openai:m"),
                    detail: s("model `openai:m` is not in the model catalogue of this worker"),
                },
                BadInput,
                vec!["refused by the worker's model catalogue: model `openai:m`"],
            ),
            (E::Client(s("no TLS")), Failure, vec!["HTTP client: no TLS"]),
            (
                E::TempDir(io()),
                Failure,
                vec!["temporary directory: disk full"],
            ),
            (
                E::WriteFile {
                    dir: PathBuf::from("/w"),
                    path: s("a.txt"),
                    source: io(),
                },
                Failure,
                vec!["cannot write `a.txt` into `/w`: disk full"],
            ),
            (
                E::ReadBlob {
                    path: s("a.txt"),
                    source: BlobError::Backend(s("down")),
                },
                Unavailable,
                vec!["blob of `a.txt`"],
            ),
            (
                E::ReadBlob {
                    path: s("a.txt"),
                    source: BlobError::Missing(hash),
                },
                NotFound,
                vec!["blob of `a.txt`"],
            ),
        ];
        for (e, kind, words) in table {
            assert_eq!(e.kind(), kind, "{e:?}");
            let text = e.to_string();
            for w in words {
                assert!(text.contains(w), "`{w}` not in: {text}");
            }
        }
    }
}
