//! Every NATS name forkfleet uses: subjects, streams, consumers, buckets and keys, built here
//! and nowhere else (call sites never `format!` a subject).
//!
//! | what | name |
//! |---|---|
//! | task queue (work-queue stream) | stream `FF_TASKS`, subjects `ff.task.<pool>`, consumer `pool-<pool>` |
//! | branch events (limits stream) | stream `FF_EVENTS`, subject `ff.event.branch` (stream takes `ff.event.>`), consumer = the durable name |
//! | control per run (limits stream) | stream `FF_CONTROL`, subjects `ff.control.<run id>` |
//! | blobs | KV bucket `ff_blobs_small` (small blobs), object store `ff_blobs` (large), key = hex SHA-256 |
//! | worker heartbeats | KV bucket `ff_workers`, key = worker id |
//! | the serving coordinator's lease | KV bucket `ff_coordinator`, key `lease` |
//! | request/reply | `ff.api.<subject>`, queue group `ff` |
//! | API per caller (ADR 17) | `ff.api.coordinator` (admin), `ff.api.worker` (workers), `ff.api.client.<identity>` (scoped clients) |
//! | reply inboxes per role | `_INBOX_ff.coordinator`, `_INBOX_ff.worker`, `_INBOX_ff.client.<identity>` (a client without identity: `_INBOX`) |
//!
//! Names given by callers (pools, durable consumers, service subjects) are checked here: a
//! token is 1 to 64 characters from `A-Z a-z 0-9 _ -`, so it is valid both as a subject
//! token and as a stream or consumer name.

use crate::blob::BlobHash;
use crate::ids::{RunId, WorkerId};

pub mod permissions;

/// The work-queue stream of branch tasks.
pub const TASK_STREAM: &str = "FF_TASKS";
/// Subjects of [`TASK_STREAM`].
pub const TASK_SUBJECTS: &str = "ff.task.*";

/// The stream of branch events.
pub const EVENT_STREAM: &str = "FF_EVENTS";
/// Subjects of [`EVENT_STREAM`].
pub const EVENT_SUBJECTS: &str = "ff.event.>";
/// The subject branch events are published on.
pub const EVENT_SUBJECT: &str = "ff.event.branch";

/// The stream of control commands, one subject per run.
pub const CONTROL_STREAM: &str = "FF_CONTROL";
/// Subjects of [`CONTROL_STREAM`].
pub const CONTROL_SUBJECTS: &str = "ff.control.*";

/// The object store bucket of large blobs.
pub const BLOB_BUCKET: &str = "ff_blobs";
/// The KV bucket of small blobs (one value per blob).
pub const SMALL_BLOB_BUCKET: &str = "ff_blobs_small";
/// The KV bucket of worker heartbeats.
pub const WORKER_BUCKET: &str = "ff_workers";

/// The KV bucket of the coordinator lease: who serves the API and consumes the events.
pub const COORDINATOR_BUCKET: &str = "ff_coordinator";
/// The key of the coordinator lease in [`COORDINATOR_BUCKET`].
pub const COORDINATOR_LEASE_KEY: &str = "lease";

/// The queue group every service subscription joins, so one instance answers each request.
pub const SERVICE_QUEUE_GROUP: &str = "ff";

const API_PREFIX: &str = "ff.api.";
const MAX_TOKEN_LEN: usize = 64;

/// A caller-given name that cannot be used as a NATS subject token or consumer name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {what} `{value}`: {reason}")]
pub struct SubjectError {
    pub what: &'static str,
    pub value: String,
    pub reason: &'static str,
}

fn check_token(what: &'static str, value: &str) -> Result<(), SubjectError> {
    let err = |reason| SubjectError {
        what,
        value: value.to_string(),
        reason,
    };
    if value.is_empty() {
        return Err(err("it is empty"));
    }
    if value.len() > MAX_TOKEN_LEN {
        return Err(err("it is longer than 64 characters"));
    }
    if !value
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
    {
        return Err(err("use only letters, digits, `_` and `-`"));
    }
    Ok(())
}

/// The root of forkfleet's reply inboxes: each role's connection gets its own prefix
/// under it, so nats-server permissions can give each the subscriptions to its own
/// replies only.
pub const INBOX_ROOT: &str = "_INBOX_ff";

/// The reply inbox prefix of the coordinator: `_INBOX_ff.coordinator`.
pub fn coordinator_inbox() -> String {
    format!("{INBOX_ROOT}.coordinator")
}

/// The reply inbox prefix of the workers: `_INBOX_ff.worker`.
pub fn worker_inbox() -> String {
    format!("{INBOX_ROOT}.worker")
}

/// The reply inbox prefix of client `identity`: `_INBOX_ff.client.<identity>`.
pub fn client_inbox(identity: &str) -> Result<String, SubjectError> {
    check_identity(identity)?;
    Ok(format!("{INBOX_ROOT}.client.{identity}"))
}

/// A client identity: one subject token (1 to 64 letters, digits, `_` or `-`).
pub fn check_identity(identity: &str) -> Result<(), SubjectError> {
    check_token("client identity", identity)
}

/// The subject tasks of `pool` are published on: `ff.task.<pool>`.
pub fn task_subject(pool: &str) -> Result<String, SubjectError> {
    check_token("pool name", pool)?;
    Ok(format!("ff.task.{pool}"))
}

/// The durable pull consumer of `pool`: `pool-<pool>`.
pub fn pool_consumer(pool: &str) -> Result<String, SubjectError> {
    check_token("pool name", pool)?;
    Ok(format!("pool-{pool}"))
}

/// The durable consumer of the event stream named `durable` (the name itself, checked).
pub fn event_consumer(durable: &str) -> Result<String, SubjectError> {
    check_token("durable consumer name", durable)?;
    Ok(durable.to_string())
}

/// The control subject of one run: `ff.control.<run id>`.
pub fn control_subject(run: RunId) -> String {
    format!("ff.control.{run}")
}

/// A service subject, namespaced: `ff.api.<subject>`; `subject` is dot-separated tokens.
pub fn api_subject(subject: &str) -> Result<String, SubjectError> {
    if subject.is_empty() {
        return Err(SubjectError {
            what: "service subject",
            value: String::new(),
            reason: "it is empty",
        });
    }
    for token in subject.split('.') {
        check_token("service subject", token).map_err(|e| SubjectError {
            value: subject.to_string(),
            ..e
        })?;
    }
    Ok(format!("{API_PREFIX}{subject}"))
}

/// A service subject to serve, namespaced like [`api_subject`], where a whole token may
/// also be `*` (one subject per client: `client.*`).
pub fn api_serve_subject(subject: &str) -> Result<String, SubjectError> {
    let concrete = subject
        .split('.')
        .map(|t| if t == "*" { "x" } else { t })
        .collect::<Vec<_>>()
        .join(".");
    api_subject(&concrete).map_err(|e| SubjectError {
        value: subject.to_string(),
        ..e
    })?;
    Ok(format!("{API_PREFIX}{subject}"))
}

/// Whether `subject` is one `pattern` names: token by token, `*` any one token, `>` one or
/// more at the end (NATS's wildcards).
pub fn subject_matches(pattern: &str, subject: &str) -> bool {
    let mut s = subject.split('.');
    for p in pattern.split('.') {
        match (p, s.next()) {
            (">", Some(_)) => return true,
            ("*", Some(t)) if !t.is_empty() => {}
            (p, Some(t)) if p == t => {}
            _ => return false,
        }
    }
    s.next().is_none()
}

/// The service subject of a request received on `full` (`ff.api.client.alice` →
/// `client.alice`); `full` itself when it is not under `ff.api.`.
pub fn service_of(full: &str) -> &str {
    full.strip_prefix(API_PREFIX).unwrap_or(full)
}

/// The key of a worker's heartbeat in [`WORKER_BUCKET`].
pub fn worker_key(worker: WorkerId) -> String {
    worker.to_string()
}

/// The key (KV) or object name (object store) of a blob: its hex hash.
pub fn blob_key(hash: &BlobHash) -> String {
    hash.to_hex()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subjects_match_as_nats_matches_them() {
        assert!(subject_matches("ff.api.coordinator", "ff.api.coordinator"));
        assert!(subject_matches("ff.api.client.*", "ff.api.client.alice"));
        assert!(subject_matches("ff.>", "ff.api.client.alice"));
        for (pattern, subject) in [
            ("ff.api.coordinator", "$KV.ff_blobs_small.x"),
            ("ff.api.coordinator", "ff.api.coordinator.x"),
            ("ff.api.client.*", "ff.api.client"),
            ("ff.api.client.*", "ff.api.client.alice.x"),
            ("ff.api.client.*", "ff.api.client."),
            ("ff.>", "ff"),
        ] {
            assert!(!subject_matches(pattern, subject), "{pattern} {subject}");
        }
    }

    #[test]
    fn builds_names() {
        assert_eq!(task_subject("default").unwrap(), "ff.task.default");
        assert_eq!(pool_consumer("gpu-1").unwrap(), "pool-gpu-1");
        assert_eq!(
            api_subject("budget.reserve").unwrap(),
            "ff.api.budget.reserve"
        );
        let run = RunId::new();
        assert_eq!(control_subject(run), format!("ff.control.{run}"));
        assert_eq!(blob_key(&BlobHash::of(b"x")).len(), 64);
        assert_eq!(api_serve_subject("client.*").unwrap(), "ff.api.client.*");
        assert!(api_serve_subject("client.>").is_err());
        assert_eq!(service_of("ff.api.client.alice"), "client.alice");
        assert_eq!(client_inbox("alice").unwrap(), "_INBOX_ff.client.alice");
        assert!(client_inbox("a.b").is_err());
    }

    #[test]
    fn rejects_names_that_break_subjects() {
        for bad in ["", "a.b", "a*", ">", "a b", "a/b", &"x".repeat(65)] {
            assert!(task_subject(bad).is_err(), "{bad:?}");
            assert!(event_consumer(bad).is_err(), "{bad:?}");
        }
        for bad in ["", "a..b", ".a", "a.", "a.*", "a.>", "a b"] {
            let err = api_subject(bad).unwrap_err();
            assert_eq!(err.value, bad);
        }
        let err = task_subject("a.b").unwrap_err();
        assert!(err.to_string().contains("pool name `a.b`"), "{err}");
    }
}
