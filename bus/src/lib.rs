//! # forkfleet-bus
//!
//! The bus: the one narrow interface between the coordinator, the workers and clients, with
//! its two implementations and what runs over it. The types it carries (ids, subjects, the
//! wire envelope, the blob store trait, trace context) live in `forkfleet-shared`.
//!
//! ## Layout
//! - this file: the [`Bus`] trait and what it hands out ([`Delivery`], [`Request`],
//!   [`EventConsumer`], [`BusError`]).
//! - [`local`]: [`local::LocalBus`], the in-process bus of the embedded mode.
//! - [`nats`]: [`nats::NatsBus`], the NATS JetStream bus of a cluster, and its connection
//!   settings; in `nats/`: `config`, `consume`, `forward`, `blobs` and `tests`.
//! - [`lease`]: the coordinator lease in NATS KV (revision-checked reads and writes).
//! - [`apicall`]: one request to the coordinator's API over the bus (the CLI's remote client
//!   and the agents' fork tools).
//! - [`nats_server`]: a local `nats-server -js` child process (the test fixture's and the
//!   bench's), with its store and log in one directory.
//! - [`auth`]: `forkfleet cluster auth`: the nats-server permissions of each role (from
//!   `forkfleet_shared::subjects::permissions`) and each identity's nkey and config file
//!   (ADR 17).
//! - `backoff`: the bus's one backoff, doubling from `RETRY_MIN` to `RETRY_MAX` for every
//!   retried connection, pull, consumer creation, forward and API call.
//! - `testkit` (feature `testkit`): a real `nats-server` on a free port for tests, which
//!   panics where [`nats_server`] returns an error.
//!
//! ## Semantics
//!
//! Two implementations share these semantics and the same behavioural tests
//! (`bus/tests/suite/conformance.rs`): [`local::LocalBus`] (in-process, for the embedded
//! mode) and [`nats::NatsBus`] (NATS JetStream).
//!
//! - **Task queue** per pool: at-least-once. A pulled task must be acked; `nak` hands it
//!   back (optionally after a delay); `in_progress` extends the ack deadline; a task neither
//!   acked nor extended within the ack wait is redelivered, with its delivery count, for as
//!   long as it is not acked (what to do with a task delivered more than `max_deliver`
//!   times is the coordinator's to decide, ADR 38).
//! - **Event stream**: every event a worker publishes reaches the durable consumer at
//!   least once, in publish order per publisher; unacked events are redelivered.
//! - **Control** per run: commands to one running branch, delivered in order.
//! - **Blobs**: a content-addressed store.
//! - **Workers**: heartbeats, for listing the live workers.
//! - **Request/reply**: a bounded-time call to a service by subject.
//!
//! **Trace context**: a task or an event carries the W3C `traceparent` of the span it was
//! enqueued or published in (see [`forkfleet_shared::trace`]), handed out as
//! [`Delivery::trace`].

pub mod apicall;
pub mod auth;
mod backoff;
pub mod lease;
pub mod local;
pub mod nats;
pub mod nats_server;
#[cfg(feature = "testkit")]
pub mod testkit;

use async_trait::async_trait;
use bytes::Bytes;
use forkfleet_shared::blob::{BlobError, BlobStore};
use forkfleet_shared::ids::RunId;
use forkfleet_shared::protocol::WorkerInfo;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

pub type BusResult<T> = Result<T, BusError>;

#[derive(Debug, thiserror::Error)]
pub enum BusError {
    #[error("the bus is closed")]
    Closed,
    #[error("request to `{subject}` got no answer within {ms} ms")]
    Timeout { subject: String, ms: u64 },
    #[error("no service answers on `{0}`")]
    NoResponders(String),
    #[error(transparent)]
    Blob(#[from] BlobError),
    #[error("bus backend failed: {0}")]
    Backend(String),
}

/// Settles one delivery.
#[async_trait]
pub trait Acker: Send + Sync {
    async fn ack(&self) -> BusResult<()>;
    async fn nak(&self, delay: Option<Duration>) -> BusResult<()>;
    async fn in_progress(&self) -> BusResult<()>;
}

/// A message taken from the task queue or the event stream, to be acked.
pub struct Delivery {
    pub payload: Bytes,
    /// 1 on the first delivery, 2 on the first redelivery, ...
    pub attempt: u32,
    /// Tasks: the W3C `traceparent` of the span the task was enqueued in, as received
    /// (unchecked: [`forkfleet_shared::trace::set_parent`] parses it strictly). `None` when it was
    /// enqueued outside any span or without an OpenTelemetry layer, and for events (their
    /// readers do not continue a trace, so publishing one would cost every event for
    /// nothing).
    pub trace: Option<String>,
    /// Tasks: how long the delivery holds the task without an extension (the queue's ack
    /// wait): past it the task may be delivered to another worker. `None` when the bus
    /// never hands a task held by a live process to another one (the local bus).
    pub lease: Option<Duration>,
    /// Tasks: the task's position in its queue (the stream sequence on NATS), the same on
    /// every delivery of it; with [`Bus::queued_task`] the coordinator checks that a task
    /// a worker names is still queued (the proof of a takeover, ADR 18).
    pub seq: Option<u64>,
    acker: Box<dyn Acker>,
}

impl Delivery {
    pub fn new(payload: Bytes, attempt: u32, trace: Option<String>, acker: Box<dyn Acker>) -> Self {
        Self {
            payload,
            attempt,
            trace,
            lease: None,
            seq: None,
            acker,
        }
    }

    /// The same delivery with its lease and queue position (see [`Delivery::lease`],
    /// [`Delivery::seq`]).
    pub fn with_position(mut self, lease: Option<Duration>, seq: Option<u64>) -> Self {
        self.lease = lease;
        self.seq = seq;
        self
    }

    pub async fn ack(&self) -> BusResult<()> {
        self.acker.ack().await
    }

    pub async fn nak(&self, delay: Option<Duration>) -> BusResult<()> {
        self.acker.nak(delay).await
    }

    pub async fn in_progress(&self) -> BusResult<()> {
        self.acker.in_progress().await
    }
}

impl std::fmt::Debug for Delivery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Delivery")
            .field("bytes", &self.payload.len())
            .field("attempt", &self.attempt)
            .field("trace", &self.trace)
            .field("lease", &self.lease)
            .field("seq", &self.seq)
            .finish()
    }
}

/// The durable consumer of the event stream.
#[async_trait]
pub trait EventConsumer: Send {
    /// The next event; waits until one arrives. `Err(Closed)` when the bus shuts down.
    async fn next(&mut self) -> BusResult<Delivery>;
}

/// Answers one request.
#[async_trait]
pub trait Replier: Send {
    async fn respond(self: Box<Self>, payload: Bytes) -> BusResult<()>;
}

/// A request received by a service.
pub struct Request {
    pub subject: String,
    pub payload: Bytes,
    /// The W3C `traceparent` of the span the request was sent in (a `traceparent` header
    /// on NATS): the service's span of it continues the caller's trace.
    pub traceparent: Option<String>,
    reply: Box<dyn Replier>,
}

impl Request {
    pub fn new(subject: String, payload: Bytes, reply: Box<dyn Replier>) -> Self {
        Self {
            subject,
            payload,
            traceparent: None,
            reply,
        }
    }

    /// The request, sent from the span of `traceparent`.
    pub fn with_traceparent(mut self, traceparent: Option<String>) -> Self {
        self.traceparent = traceparent;
        self
    }

    pub async fn respond(self, payload: Bytes) -> BusResult<()> {
        self.reply.respond(payload).await
    }
}

/// A task queue's backlog ([`Bus::task_queue`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TaskQueue {
    /// Tasks not yet delivered to any worker (the consumer's lag).
    pub waiting: u64,
    /// Tasks delivered and not yet acked (held by workers).
    pub in_flight: u64,
}

impl TaskQueue {
    /// Tasks not yet acked: waiting or in flight.
    pub fn depth(&self) -> u64 {
        self.waiting + self.in_flight
    }
}

#[async_trait]
pub trait Bus: Send + Sync + 'static {
    async fn enqueue_task(&self, pool: &str, payload: Bytes) -> BusResult<()>;
    /// The next task of `pool`, waiting at most `wait`.
    async fn pull_task(&self, pool: &str, wait: Duration) -> BusResult<Option<Delivery>>;
    /// True when a [`Bus::pull_task`] dropped before it returns takes no task (a worker
    /// that stops may then drop its pull at once rather than wait it out). False (the
    /// default) where a pull in flight may have been given a task already.
    fn pull_cancel_safe(&self) -> bool {
        false
    }
    /// Make `pool`'s queue ready for workers now (NATS: its consumer, which workers that
    /// may only bind to it must find before the first fork).
    async fn open_pool(&self, _pool: &str) -> BusResult<()> {
        Ok(())
    }
    /// The payload of `pool`'s task at queue position `seq` ([`Delivery::seq`]) while it
    /// is still queued or held by a worker; `None` once it was acked (or never existed).
    async fn queued_task(&self, pool: &str, seq: u64) -> BusResult<Option<Bytes>>;
    /// Deliveries of one task that may take its branch over: a worker given a later one
    /// finds the task dead (the coordinator counts, ADR 38; the queue itself delivers a
    /// task until it is acked).
    fn max_deliver(&self) -> u32;
    /// How many of `pool`'s tasks are waiting and how many are held by workers.
    async fn task_queue(&self, pool: &str) -> BusResult<TaskQueue>;
    /// Whether the bus is connected now (a NATS connection may be down and reconnecting;
    /// the in-process bus always is).
    fn connected(&self) -> bool {
        true
    }

    /// When this process last saw the bus disrupted, in ms since the epoch (0: never; the
    /// in-process bus never is): its connection lost or back, or a pull that missed the
    /// server's heartbeats (a server frozen or partitioned keeps the connection open).
    /// Deliveries lost to a disruption are not a worker's death (ADR 38).
    fn disrupted_at_ms(&self) -> u64 {
        0
    }

    /// The bus crosses processes (NATS): the coordinator's run store is not the bus's blob
    /// store, so what it needs of a blob travels (a worker sends small written texts along
    /// with its events). `false` for the in-process bus, whose store the coordinator shares.
    fn remote(&self) -> bool {
        false
    }

    /// The largest message the bus carries, in bytes (NATS: the server's `max_payload`);
    /// `None`: no limit (the in-process bus).
    fn max_payload(&self) -> Option<usize> {
        None
    }

    async fn publish_event(&self, payload: Bytes) -> BusResult<()>;

    /// Publish `payloads` as events, in order, as one batch: on NATS they are all sent
    /// before any acknowledgement is awaited (one round trip for the batch), and one that
    /// fails is sent again (its message id lets the stream drop a duplicate), so an event
    /// may then arrive after a later one; the coordinator holds an event past a gap until
    /// the gap fills. `Ok` once every one is stored.
    async fn publish_events(&self, payloads: Vec<Bytes>) -> BusResult<()> {
        for payload in payloads {
            self.publish_event(payload).await?;
        }
        Ok(())
    }

    async fn events(&self, durable: &str) -> BusResult<Box<dyn EventConsumer>>;

    async fn send_control(&self, run: RunId, payload: Bytes) -> BusResult<()>;
    async fn watch_control(&self, run: RunId) -> BusResult<mpsc::UnboundedReceiver<Bytes>>;

    fn blobs(&self) -> Arc<dyn BlobStore>;

    /// Record a worker's heartbeat (replacing its previous one).
    async fn put_worker(&self, info: WorkerInfo) -> BusResult<()>;
    /// Forget a worker's heartbeat (a worker stopping cleanly), so it is listed no more.
    async fn remove_worker(&self, worker: forkfleet_shared::ids::WorkerId) -> BusResult<()>;
    /// Workers whose last heartbeat is younger than [`forkfleet_shared::protocol::WORKER_TTL_MS`].
    async fn workers(&self) -> BusResult<Vec<WorkerInfo>>;

    /// Send a request to one server of `subject` and wait at most `timeout` for its reply.
    async fn request(&self, subject: &str, payload: Bytes, timeout: Duration) -> BusResult<Bytes>;
    /// Serve `subject`. Every server of a subject is in one queue group: each request goes
    /// to one of them.
    async fn serve(&self, subject: &str) -> BusResult<mpsc::Receiver<Request>>;
}

impl BusError {
    /// A bus that is closed, failed or did not answer is `unavailable`; a blob error
    /// carried by the bus is that error's kind.
    pub fn kind(&self) -> forkfleet_shared::error::ErrorKind {
        match self {
            BusError::Blob(e) => e.kind(),
            BusError::Closed
            | BusError::Timeout { .. }
            | BusError::NoResponders(_)
            | BusError::Backend(_) => forkfleet_shared::error::ErrorKind::Unavailable,
        }
    }
}

#[cfg(test)]
mod error_kind_tests {
    use super::*;
    use forkfleet_shared::blob::BlobHash;
    use forkfleet_shared::error::ErrorKind;

    #[test]
    fn bus_errors_have_kinds() {
        let timeout = BusError::Timeout {
            subject: "s".into(),
            ms: 1,
        };
        for e in [
            BusError::Closed,
            timeout,
            BusError::NoResponders("s".into()),
            BusError::Backend("x".into()),
        ] {
            assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
        }
        let missing = BusError::Blob(BlobError::Missing(BlobHash::of(b"x")));
        assert_eq!(missing.kind(), ErrorKind::NotFound);
    }
}
