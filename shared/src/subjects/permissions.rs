//! The nats-server subject permissions of each role (ADR 17), built from the names of
//! [`super`]: what `forkfleet cluster auth` writes into the server's `authorization`
//! block, and what a JWT set-up (`nsc`) maps one for one.
//!
//! - **coordinator**: everything forkfleet uses: `ff.>`, the whole JetStream API, acks,
//!   flow control, every KV bucket and object store (so buckets added later, such as a
//!   lease bucket, are covered), its own inbox; it answers requests (`allow_responses`).
//! - **worker**: pull, ack, nak and extend the tasks of its pools only; publish events;
//!   read control (an ordered consumer it creates on the control stream); read and write
//!   blobs; put its heartbeat; ask `coord.resume`, `coord.budget` and the workers' API;
//!   serve `worker.resolve` (subscribe only: only the coordinator publishes resolve jobs,
//!   and workers answer through `allow_responses`); its own inbox.
//! - **client `<identity>`**: its own API subject `ff.api.client.<identity>` and its own
//!   inbox only. Its blobs and the worker listing go through the coordinator's API
//!   (ADR 37): it cannot list, read or write the blob buckets or the heartbeats. It cannot
//!   publish a task, an event, a control command or a resolve job, consume anything, or
//!   read another identity's replies.

use super::{
    api_subject, check_identity, client_inbox, coordinator_inbox, pool_consumer, worker_inbox,
    SubjectError, BLOB_BUCKET, CONTROL_STREAM, EVENT_SUBJECT, SMALL_BLOB_BUCKET, TASK_STREAM,
    WORKER_BUCKET,
};

/// The subjects one NATS user may publish and subscribe to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Permissions {
    pub publish: Vec<String>,
    pub subscribe: Vec<String>,
    /// May publish one reply to the reply subject of each request it received (the
    /// services: the coordinator's API, the workers' `worker.resolve`).
    pub allow_responses: bool,
}

fn owned(subjects: &[&str]) -> Vec<String> {
    subjects.iter().map(|s| s.to_string()).collect()
}

/// The coordinator's permissions.
pub fn coordinator() -> Permissions {
    let inbox = format!("{}.>", coordinator_inbox());
    Permissions {
        publish: owned(&[
            "ff.>",
            "$JS.API.>",
            "$JS.ACK.>",
            "$JS.FC.>",
            "$KV.>",
            "$O.>",
            &inbox,
        ]),
        subscribe: owned(&["ff.>", "$KV.>", "$O.>", &inbox]),
        allow_responses: true,
    }
}

/// What reading a KV bucket or object store's stream `stream` takes: its info, direct and
/// stored gets, and the ordered consumers listing and large reads use.
fn read_stream(stream: &str) -> Vec<String> {
    vec![
        format!("$JS.API.STREAM.INFO.{stream}"),
        format!("$JS.API.DIRECT.GET.{stream}"),
        format!("$JS.API.DIRECT.GET.{stream}.>"),
        format!("$JS.API.STREAM.MSG.GET.{stream}"),
        format!("$JS.API.CONSUMER.CREATE.{stream}"),
        format!("$JS.API.CONSUMER.CREATE.{stream}.>"),
        format!("$JS.API.CONSUMER.INFO.{stream}.>"),
        format!("$JS.API.CONSUMER.DELETE.{stream}.>"),
        format!("$JS.API.CONSUMER.MSG.NEXT.{stream}.>"),
        format!("$JS.FC.{stream}.>"),
    ]
}

/// Reading and writing blobs (small ones in a KV bucket, large ones in an object store).
fn blobs() -> Vec<String> {
    let mut out = read_stream(&format!("KV_{SMALL_BLOB_BUCKET}"));
    out.extend(read_stream(&format!("OBJ_{BLOB_BUCKET}")));
    out.push(format!("$KV.{SMALL_BLOB_BUCKET}.>"));
    out.push(format!("$O.{BLOB_BUCKET}.>"));
    out
}

/// A worker's permissions, for the workers of `pools`.
pub fn worker(pools: &[String]) -> Result<Permissions, SubjectError> {
    let mut publish = vec![
        "$JS.API.INFO".to_string(),
        EVENT_SUBJECT.to_string(),
        api_subject(crate::protocol::RESUME_SUBJECT)?,
        api_subject(crate::budget::BUDGET_SUBJECT)?,
        api_subject(crate::api::WORKER_API_SUBJECT)?,
    ];
    for pool in pools {
        let consumer = pool_consumer(pool)?;
        publish.push(format!("$JS.API.CONSUMER.INFO.{TASK_STREAM}.{consumer}"));
        publish.push(format!(
            "$JS.API.CONSUMER.MSG.NEXT.{TASK_STREAM}.{consumer}"
        ));
        publish.push(format!("$JS.ACK.{TASK_STREAM}.{consumer}.>"));
    }
    publish.extend(read_stream(CONTROL_STREAM));
    publish.extend(blobs());
    publish.push(format!("$JS.API.STREAM.INFO.KV_{WORKER_BUCKET}"));
    publish.push(format!("$KV.{WORKER_BUCKET}.>"));
    let subscribe = vec![
        api_subject(crate::protocol::RESOLVE_SUBJECT)?,
        format!("{}.>", worker_inbox()),
    ];
    Ok(Permissions {
        publish,
        subscribe,
        allow_responses: true,
    })
}

/// The permissions of the client `identity`.
pub fn client(identity: &str) -> Result<Permissions, SubjectError> {
    check_identity(identity)?;
    let publish = vec![
        "$JS.API.INFO".to_string(),
        api_subject(&crate::api::client_api_subject(identity)?)?,
    ];
    Ok(Permissions {
        publish,
        subscribe: vec![format!("{}.>", client_inbox(identity)?)],
        allow_responses: false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_get_what_they_need_only() {
        let w = worker(&["default".into(), "gpu".into()]).unwrap();
        assert!(w.publish.contains(&"ff.event.branch".to_string()));
        assert!(w
            .publish
            .contains(&"$JS.API.CONSUMER.MSG.NEXT.FF_TASKS.pool-gpu".to_string()));
        assert!(w
            .publish
            .contains(&"$JS.ACK.FF_TASKS.pool-default.>".to_string()));
        assert!(w.publish.contains(&"ff.api.worker".to_string()));
        assert_eq!(
            w.subscribe,
            vec![
                "ff.api.worker.resolve".to_string(),
                "_INBOX_ff.worker.>".into()
            ]
        );
        // Nobody but the coordinator publishes tasks, control or resolve jobs, or reads
        // events.
        for p in [&w, &client("alice").unwrap()] {
            for s in &p.publish {
                assert!(!s.starts_with("ff.task"), "{s}");
                assert!(!s.starts_with("ff.control"), "{s}");
                assert!(!s.contains("FF_EVENTS"), "{s}");
                assert_ne!(s, "ff.api.worker.resolve");
                assert_ne!(s, "ff.api.coordinator");
                assert!(!s.contains('>') || s.ends_with(".>"), "{s}");
                assert!(!s.starts_with("$JS.API.STREAM.CREATE"), "{s}");
            }
        }
        let c = client("alice").unwrap();
        assert!(c.publish.contains(&"ff.api.client.alice".to_string()));
        // Blobs go through the coordinator: no bucket of them is the client's to touch.
        for s in &c.publish {
            assert!(!s.contains(BLOB_BUCKET), "{s}");
        }
        assert!(!c
            .publish
            .iter()
            .any(|s| s.starts_with("ff.") && s != "ff.api.client.alice"));
        assert_eq!(c.subscribe, vec!["_INBOX_ff.client.alice.>".to_string()]);
        assert!(!c.allow_responses);
        assert!(client("a.b").is_err());
        assert!(worker(&["a b".into()]).is_err());
        let co = coordinator();
        assert!(co.publish.contains(&"$JS.API.>".to_string()));
        assert!(co.publish.contains(&"$KV.>".to_string()));
    }
}
