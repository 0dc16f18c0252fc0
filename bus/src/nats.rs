//! The NATS JetStream bus: the cluster implementation of [`Bus`], with the semantics of
//! [`super::local::LocalBus`] (both run the same conformance tests).
//!
//! Every name lives in [`forkfleet_shared::subjects`]. Everything is created get-or-create at
//! [`NatsBus::connect`], so processes may start in any order, or together.
//!
//! Layout: this file holds the bus and its `Bus` impl; `config` the connection settings,
//! `consume` deliveries and the event consumer, `forward` the control forwarder, `blobs`
//! the blob store, `tests` the unit tests of the settings and the
//! backoff.
//!
//! - **Tasks**: work-queue stream `FF_TASKS` (`ff.task.<pool>`), one durable pull consumer
//!   per pool (`pool-<pool>`, explicit ack, `ack_wait` and `max_deliver` from the config).
//!   `pull_task` issues one pull request for one message that the server holds for at most
//!   `wait`; `attempt` is the server's delivery count. Acks, naks and progress are double
//!   acks: they return once the server has them.
//! - **Events**: limits stream `FF_EVENTS` (`ff.event.>`), a durable pull consumer per
//!   durable name (explicit ack, unlimited deliveries). The consumer keeps one pull stream
//!   open with a bounded prefetch; an event not acked within `ack_wait` (including the
//!   prefetched ones of a consumer that was dropped) is delivered again.
//! - **Control**: limits stream `FF_CONTROL` (`ff.control.<run id>`). `watch_control` reads
//!   the run's subject from the start with an ordered consumer, so a command sent while the
//!   branch was still queued arrives, and commands arrive in order. A watcher that starts
//!   again (a resumed branch) sees the earlier commands again: commands must be idempotent
//!   (terminate is; a repeated steer is the caller's to skip). The local bus hands a second
//!   watcher only new commands.
//! - **Blobs**: small blobs (up to [`SMALL_BLOB_MAX`] bytes, one object-store chunk) are
//!   values in the KV bucket `ff_blobs_small`; larger ones go to the object store `ff_blobs`.
//!   The object store costs four round trips per put (existence check, chunk, metadata, and
//!   its own lookup of an older version) against one for a KV create, and a fork writes
//!   thousands of small files. Measured over loopback on 2 busy cores (debug build,
//!   `measure_rates` in `bus/tests/suite/conformance.rs`), 300-byte puts: KV 5,500 to
//!   11,000/s one at a time and 25,000 to 54,000/s with 64 in flight; object store 1,400 to
//!   2,800/s and 4,500 to 12,000/s. Both are named by the hex hash; `get` and `missing` look
//!   in the KV bucket first. Concurrent puts of one large blob may leave orphan chunks
//!   (never a wrong blob).
//! - **Workers**: KV bucket `ff_workers` (key = worker id) whose `max_age` is the worker TTL,
//!   so the server drops silent workers; `workers()` also filters on `heartbeat_at_ms`, as
//!   the local bus does. The TTL is fixed when the bucket is created.
//! - **Request/reply**: core NATS request under `ff.api.`; services join the queue group
//!   `ff`. At most once, like any request: callers retry.
//!
//! Reconnects are async-nats's; on top of that, every loop here (event pulls, control
//! forwarders, dead-task forwarders, `pull_task`) treats a stream or consumer error as
//! transient and tries again after a short backoff, and every wait is bounded. Control
//! forwarders also reopen their (ephemeral) consumer as soon as the client reconnects, since
//! a restarted server has lost it.
//!
//! Publishes to JetStream carry a `Nats-Msg-Id`, so a publish retried after a lost ack is
//! stored once (within the stream's two-minute duplicate window), and, when the publisher
//! is in a span with an OpenTelemetry context, a W3C `traceparent` header
//! ([`forkfleet_shared::trace`]); task and event deliveries hand it out as [`Delivery::trace`].
//! Control watchers ignore it.

use super::{Acker, Bus, BusError, BusResult, Delivery, EventConsumer, Replier, Request};
use async_nats::jetstream::{self, consumer, kv, object_store, stream, AckKind};
use async_nats::{Client, ConnectOptions};
use async_trait::async_trait;
use bytes::Bytes;
use forkfleet_shared::blob::{BlobError, BlobHash, BlobStore};
use forkfleet_shared::ids::RunId;
use forkfleet_shared::metrics::catalog as metrics;
use forkfleet_shared::protocol::{now_ms, WorkerInfo, WORKER_TTL_MS};
use forkfleet_shared::subjects::{self, SubjectError};
use forkfleet_shared::trace::{current_traceparent, TRACEPARENT};
use futures::StreamExt;
use std::collections::HashMap;
use std::fmt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::time::Instant;

mod blobs;
mod broker;
mod config;
mod consume;
mod forward;
#[cfg(test)]
mod tests;

use blobs::NatsBlobStore;
pub use config::{
    redact_url, NatsAuth, NatsConfig, NatsStorage, NatsTls, DEFAULT_BLOB_MAX_BYTES,
    DEFAULT_STREAM_MAX_BYTES, MAX_REPLICAS,
};
use consume::*;
use forward::*;

/// Blobs up to this size are KV values; larger ones go to the object store.
pub const SMALL_BLOB_MAX: usize = 128 * 1024;

/// Unacked messages a consumer may have out at once (tasks running, events in flight).
const MAX_ACK_PENDING: i64 = 20_000;
/// Events prefetched by one event consumer.
const EVENT_BATCH: usize = 256;
/// Idle heartbeat of long-lived pulls: a dead connection shows within two of these.
const PULL_HEARTBEAT: Duration = Duration::from_secs(5);
/// Expiry of one long-lived pull request.
const PULL_EXPIRES: Duration = Duration::from_secs(30);
use crate::backoff::{Backoff, RETRY_MAX, RETRY_MIN};
/// Blob lookups in flight at once in `missing`.
const BLOB_LOOKUPS_IN_FLIGHT: usize = 64;

fn backend(what: impl fmt::Display, err: impl fmt::Display) -> BusError {
    BusError::Backend(format!("{what}: {err}"))
}

fn invalid(err: SubjectError) -> BusError {
    BusError::Backend(err.to_string())
}

fn blob_backend(what: impl fmt::Display, err: impl fmt::Display) -> BlobError {
    BlobError::Backend(format!("{what}: {err}"))
}

/// The JetStream bus. Cheap to clone.
#[derive(Clone)]
pub struct NatsBus {
    inner: Arc<Inner>,
}

struct Inner {
    config: NatsConfig,
    /// The URL without credentials, for messages.
    url: String,
    client: Client,
    js: jetstream::Context,
    pools: Mutex<HashMap<String, Arc<consumer::PullConsumer>>>,
    reconnects: Reconnects,
    disruptions: Disruptions,
    /// `None` for a scoped client: it lists the workers through the coordinator.
    workers: Option<kv::Store>,
    blobs: Arc<dyn BlobStore>,
}

impl fmt::Debug for NatsBus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsBus")
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

/// Counts (re)connections, so loops over ephemeral consumers (gone after a server restart)
/// reopen them at once instead of waiting to miss heartbeats.
type Reconnects = tokio::sync::watch::Receiver<u64>;

/// When this process last saw the bus disrupted ([`Bus::disrupted_at_ms`]), shared by the
/// connection's callback and the consumers.
#[derive(Debug, Clone, Default)]
pub(crate) struct Disruptions(Arc<std::sync::atomic::AtomicU64>);

impl Disruptions {
    /// A disruption now.
    pub(crate) fn note(&self) {
        self.0
            .fetch_max(now_ms(), std::sync::atomic::Ordering::Relaxed);
    }

    fn last_ms(&self) -> u64 {
        self.0.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// Install the process's rustls crypto provider (aws-lc-rs) once, before any TLS
/// connection: with two providers compiled in, rustls picks none by itself and a `tls://`
/// connection would panic. An application that installed one first keeps its own.
pub fn install_crypto_provider() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if rustls::crypto::CryptoProvider::get_default().is_none() {
            // Another thread may have installed one meanwhile: then it stays.
            let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
        }
    });
}

async fn connect_options(
    config: &NatsConfig,
    url: &str,
    url_user: Option<(String, String)>,
    reconnects: Arc<tokio::sync::watch::Sender<u64>>,
    disruptions: Disruptions,
) -> BusResult<ConnectOptions> {
    install_crypto_provider();
    let log_url = url.to_string();
    let mut opts = ConnectOptions::new()
        .connection_timeout(config.connect_timeout)
        .request_timeout(Some(config.request_timeout))
        .reconnect_delay_callback(|attempts| {
            if attempts <= 1 {
                Duration::ZERO
            } else {
                let exp = u32::try_from(attempts.min(16)).unwrap_or(16);
                (Duration::from_millis(25) * 2u32.pow(exp)).min(RETRY_MAX)
            }
        })
        .event_callback(move |event| {
            let url = log_url.clone();
            let reconnects = reconnects.clone();
            let disruptions = disruptions.clone();
            async move {
                match event {
                    async_nats::Event::Connected => {
                        reconnects.send_modify(|n| {
                            // The first connection is not a reconnect.
                            if *n > 0 {
                                metrics::BUS_RECONNECTS.inc(&[]);
                                disruptions.note();
                            }
                            *n += 1
                        });
                        tracing::info!(nats.url = %url, "bus.nats connected")
                    }
                    async_nats::Event::Disconnected => {
                        disruptions.note();
                        tracing::warn!(nats.url = %url, "bus.nats disconnected; reconnecting")
                    }
                    other => tracing::debug!(nats.url = %url, event = %other, "bus.nats event"),
                }
            }
        });
    if let Some(name) = &config.name {
        opts = opts.name(name);
    }
    if let Some(prefix) = &config.inbox_prefix {
        opts = opts.custom_inbox_prefix(prefix);
    }
    if let Some((user, _)) = &url_user {
        let other = match &config.auth {
            NatsAuth::None => None,
            NatsAuth::UserPassword { user, .. } => Some(format!("user `{user}` + password")),
            NatsAuth::Token(_) => Some("a token".to_string()),
            NatsAuth::NkeySeed(_) => Some("an nkey seed".to_string()),
            NatsAuth::CredsFile(path) => Some(format!("the creds file {}", path.display())),
        };
        if let Some(other) = other {
            return Err(BusError::Backend(format!(
                "the NATS URL carries user `{user}` and {other} is configured too: give one auth method (the URL's user and password, or the configured one)"
            )));
        }
    }
    opts = match &config.auth {
        NatsAuth::None => match url_user {
            Some((user, password)) => opts.user_and_password(user, password),
            None => opts,
        },
        NatsAuth::UserPassword { user, password } => {
            opts.user_and_password(user.clone(), password.clone())
        }
        NatsAuth::Token(token) => opts.token(token.clone()),
        NatsAuth::NkeySeed(seed) => opts.nkey(seed.clone()),
        NatsAuth::CredsFile(path) => opts.credentials_file(path).await.map_err(|e| {
            backend(
                format!("cannot read the NATS credentials file {}", path.display()),
                e,
            )
        })?,
    };
    let tls = &config.tls;
    if let Some(ca) = &tls.ca_file {
        opts = opts.add_root_certificates(ca.clone());
    }
    match (&tls.client_cert, &tls.client_key) {
        (Some(cert), Some(key)) => opts = opts.add_client_certificate(cert.clone(), key.clone()),
        (None, None) => {}
        _ => {
            return Err(BusError::Backend(
                "NATS TLS: client_cert and client_key must be given together".into(),
            ))
        }
    }
    if tls.require {
        opts = opts.require_tls(true);
    }
    Ok(opts)
}

/// Consumers a stream may have. nats-server 2.15 limits a stream to 1,000 unless the
/// stream sets its own limit, and every running branch holds a consumer of the control
/// stream, so a fleet running more than 1,000 branches at once would be refused.
const STREAM_MAX_CONSUMERS: i32 = 1_000_000;

/// The smallest `max_bytes` [`fitting`] lowers a stream or bucket to.
const FIT_FLOOR_BYTES: i64 = 16 << 20;

/// JetStream reserves a stream's `max_bytes` against the server's storage (`max_file_store`)
/// and refuses one it cannot hold ("insufficient storage resources", 10047).
fn no_room(e: &impl fmt::Display) -> bool {
    let m = e.to_string();
    m.contains("10047") || m.contains("insufficient storage")
}

/// `make(max_bytes)`, and while the server has no room for it, again with half as much
/// (down to [`FIT_FLOOR_BYTES`]), saying so: the configured limits are what a server with
/// room gets, and a smaller server (8 GB of `max_file_store`, say) still starts.
async fn fitting<T, E: fmt::Display, F: std::future::Future<Output = Result<T, E>>>(
    what: &str,
    mut max_bytes: i64,
    make: impl Fn(i64) -> F,
) -> Result<T, E> {
    loop {
        match make(max_bytes).await {
            Err(e) if no_room(&e) && max_bytes / 2 >= FIT_FLOOR_BYTES => {
                max_bytes /= 2;
                tracing::warn!(what, max_bytes, error = %e, "bus.nats the server has no room for this limit; asking for half");
            }
            done => return done,
        }
    }
}

/// Get the stream, or create it; a concurrent creator with the same config is fine. A
/// stream made by an earlier version with a lower consumer limit, no byte limit or an
/// older discard policy gets ours.
async fn ensure_stream(
    js: &jetstream::Context,
    config: stream::Config,
    url: &str,
) -> BusResult<()> {
    let name = config.name.clone();
    let made = fitting(&name, config.max_bytes, |max_bytes| {
        js.get_or_create_stream(stream::Config {
            max_bytes,
            ..config.clone()
        })
    })
    .await;
    let stream = match made {
        Ok(s) => s,
        Err(first) => match js.get_stream(&name).await {
            Ok(s) => s,
            Err(_) => {
                return Err(backend(
                    format!("cannot create the stream {name} on {url} (is JetStream enabled?)"),
                    first,
                ))
            }
        },
    };
    let existing = stream.cached_info().config.clone();
    if existing.max_consumers != STREAM_MAX_CONSUMERS
        || existing.max_bytes <= 0
        || existing.discard != stream::DiscardPolicy::New
    {
        let want = if existing.max_bytes > 0 {
            existing.max_bytes
        } else {
            config.max_bytes
        };
        let updated = fitting(&name, want, |max_bytes| {
            js.update_stream(stream::Config {
                max_consumers: STREAM_MAX_CONSUMERS,
                max_bytes,
                discard: stream::DiscardPolicy::New,
                ..existing.clone()
            })
        })
        .await;
        if let Err(e) = updated {
            tracing::warn!(stream = %name, error = %e, "bus.nats cannot set a stream's consumer or byte limit; it keeps its own");
        }
    }
    Ok(())
}

pub(crate) async fn ensure_kv(
    js: &jetstream::Context,
    config: kv::Config,
    url: &str,
) -> BusResult<kv::Store> {
    let bucket = config.bucket.clone();
    if let Ok(store) = js.get_key_value(&bucket).await {
        return Ok(store);
    }
    let made = fitting(&bucket, config.max_bytes, |max_bytes| {
        js.create_key_value(kv::Config {
            max_bytes,
            ..config.clone()
        })
    })
    .await;
    match made {
        Ok(store) => Ok(store),
        Err(first) => js.get_key_value(&bucket).await.map_err(|_| {
            backend(
                format!("cannot create the KV bucket {bucket} on {url}"),
                first,
            )
        }),
    }
}

async fn ensure_object_store(
    js: &jetstream::Context,
    config: object_store::Config,
    url: &str,
) -> BusResult<object_store::ObjectStore> {
    let bucket = config.bucket.clone();
    if let Ok(store) = js.get_object_store(&bucket).await {
        return Ok(store);
    }
    let made = fitting(&bucket, config.max_bytes, |max_bytes| {
        js.create_object_store(object_store::Config {
            max_bytes,
            ..config.clone()
        })
    })
    .await;
    match made {
        Ok(store) => Ok(store),
        Err(first) => js.get_object_store(&bucket).await.map_err(|_| {
            backend(
                format!("cannot create the object store {bucket} on {url}"),
                first,
            )
        }),
    }
}

/// Get or create every stream and bucket (with `config.replicas`): the coordinator's
/// set-up, and every process's in an unrestricted one.
async fn provision(
    js: &jetstream::Context,
    config: &NatsConfig,
    url: &str,
) -> BusResult<(
    Option<kv::Store>,
    Option<(kv::Store, object_store::ObjectStore)>,
)> {
    let storage: stream::StorageType = config.storage.into();

    // Tasks keep until acked; events, control and dead-task advisories for `max_age`.
    let streams = [
        (
            subjects::TASK_STREAM,
            "forkfleet branch tasks, one subject per pool",
            subjects::TASK_SUBJECTS.to_string(),
            stream::RetentionPolicy::WorkQueue,
            Duration::ZERO,
        ),
        (
            subjects::EVENT_STREAM,
            "forkfleet branch events",
            subjects::EVENT_SUBJECTS.to_string(),
            stream::RetentionPolicy::Limits,
            config.max_age,
        ),
        (
            subjects::CONTROL_STREAM,
            "forkfleet control commands, one subject per run",
            subjects::CONTROL_SUBJECTS.to_string(),
            stream::RetentionPolicy::Limits,
            config.max_age,
        ),
    ];
    for (name, description, subject, retention, max_age) in streams {
        let stream = stream::Config {
            name: name.into(),
            description: Some(description.into()),
            subjects: vec![subject],
            retention,
            max_age,
            storage,
            max_consumers: STREAM_MAX_CONSUMERS,
            max_bytes: config.stream_max_bytes,
            // Full: a publish is refused (and retried, or its error reported), never
            // an older task or event silently dropped.
            discard: stream::DiscardPolicy::New,
            num_replicas: config.replicas,
            ..Default::default()
        };
        ensure_stream(js, stream, url).await?;
    }
    let workers = ensure_kv(
        js,
        kv::Config {
            bucket: subjects::WORKER_BUCKET.into(),
            description: "forkfleet worker heartbeats".into(),
            history: 1,
            max_age: config.worker_ttl,
            max_bytes: (config.stream_max_bytes / 16).max(1 << 20),
            storage,
            num_replicas: config.replicas,
            ..Default::default()
        },
        url,
    )
    .await?;
    let small = ensure_kv(
        js,
        kv::Config {
            bucket: subjects::SMALL_BLOB_BUCKET.into(),
            description: "forkfleet small blobs, by hex SHA-256".into(),
            history: 1,
            max_bytes: config.blob_max_bytes,
            storage,
            num_replicas: config.replicas,
            ..Default::default()
        },
        url,
    )
    .await?;
    let large = ensure_object_store(
        js,
        object_store::Config {
            bucket: subjects::BLOB_BUCKET.into(),
            description: Some("forkfleet large blobs, by hex SHA-256".into()),
            max_bytes: config.blob_max_bytes,
            storage,
            num_replicas: config.replicas,
            ..Default::default()
        },
        url,
    )
    .await?;
    Ok((Some(workers), Some((small, large))))
}

/// Bind to the buckets a worker or client uses, which the coordinator creates: each is
/// waited for (at most `config.bind_wait`, saying so every few seconds), so start order
/// does not matter.
async fn bind(
    js: &jetstream::Context,
    config: &NatsConfig,
    url: &str,
) -> BusResult<(
    Option<kv::Store>,
    Option<(kv::Store, object_store::ObjectStore)>,
)> {
    // A scoped client's blobs and worker listing go through the coordinator: it binds no
    // bucket (ADR 37).
    if config.blob_broker.is_some() {
        return Ok((None, None));
    }
    let deadline = Instant::now() + config.bind_wait;
    let workers = bind_one(subjects::WORKER_BUCKET, deadline, url, || {
        js.get_key_value(subjects::WORKER_BUCKET)
    })
    .await?;
    let small = bind_one(subjects::SMALL_BLOB_BUCKET, deadline, url, || {
        js.get_key_value(subjects::SMALL_BLOB_BUCKET)
    })
    .await?;
    let large = bind_one(subjects::BLOB_BUCKET, deadline, url, || {
        js.get_object_store(subjects::BLOB_BUCKET)
    })
    .await?;
    Ok((Some(workers), Some((small, large))))
}

/// Pause between two looks for a bucket the coordinator has not created yet.
const BIND_RETRY: Duration = Duration::from_millis(500);
/// How often a process waiting for a bucket says so.
const BIND_LOG_EVERY: Duration = Duration::from_secs(5);

async fn bind_one<T, E: fmt::Display, F: std::future::Future<Output = Result<T, E>>>(
    bucket: &str,
    deadline: Instant,
    url: &str,
    get: impl Fn() -> F,
) -> BusResult<T> {
    let mut logged: Option<Instant> = None;
    loop {
        let err = match get().await {
            Ok(found) => return Ok(found),
            Err(e) => e,
        };
        let what = format!(
            "the bucket {bucket} does not exist yet on {url} (or this NATS user may not read it): is the coordinator running? It creates the streams and buckets"
        );
        if Instant::now() + BIND_RETRY >= deadline {
            return Err(backend(what, err));
        }
        if logged.is_none_or(|t| t.elapsed() >= BIND_LOG_EVERY) {
            tracing::warn!(nats.bucket = %bucket, error = %err, "bus.nats waiting: {what}");
            logged = Some(Instant::now());
        }
        tokio::time::sleep(BIND_RETRY).await;
    }
}

impl NatsBus {
    /// Connect, and get or create the streams and buckets the bus uses (with
    /// [`NatsConfig::provision`]; else bind to them, waiting for the coordinator). A server
    /// that cannot be reached is tried again with backoff until `connect_timeout` has passed
    /// (a process started while NATS is briefly down); a refused login fails at once.
    pub async fn connect(config: NatsConfig) -> BusResult<NatsBus> {
        let url = redact_url(&config.url);
        if !(1..=MAX_REPLICAS).contains(&config.replicas) {
            return Err(BusError::Backend(format!(
                "NATS replicas must be 1 to {MAX_REPLICAS}, got {}",
                config.replicas
            )));
        }
        // The library ignores a user in the URL: take it out and authenticate with it.
        let (url_user, bare_urls) =
            config::url_credentials(&config.url).map_err(BusError::Backend)?;
        let (reconnects_tx, reconnects) = tokio::sync::watch::channel(0u64);
        let reconnects_tx = Arc::new(reconnects_tx);
        let disruptions = Disruptions::default();
        let servers: Vec<&str> = bare_urls
            .split(',')
            .map(str::trim)
            .filter(|u| !u.is_empty())
            .collect();
        let deadline = Instant::now() + config.connect_timeout;
        let mut backoff = Backoff::new();
        let mut attempts = 0u32;
        let client = loop {
            attempts += 1;
            let opts = connect_options(
                &config,
                &url,
                url_user.clone(),
                reconnects_tx.clone(),
                disruptions.clone(),
            )
            .await?;
            let left = deadline.saturating_duration_since(Instant::now());
            let last = match tokio::time::timeout(left, opts.connect(servers.as_slice())).await {
                Ok(Ok(client)) => break client,
                Ok(Err(e)) => {
                    use async_nats::ConnectErrorKind as K;
                    if matches!(
                        e.kind(),
                        K::AuthorizationViolation | K::Authentication | K::Tls | K::ServerParse
                    ) {
                        return Err(backend(format!("cannot connect to NATS at {url}"), e));
                    }
                    e.to_string()
                }
                Err(_) => "no connection".to_string(),
            };
            let pause = backoff.next();
            if Instant::now() + pause >= deadline {
                return Err(BusError::Backend(format!(
                    "cannot reach NATS at {url}: tried for {} s ({attempts} attempts; `connect_timeout_s` sets how long); last: {last}",
                    config.connect_timeout.as_secs_f64().round()
                )));
            }
            tracing::debug!(nats.url = %url, attempt = attempts, error = %last, "bus.nats connect retry");
            tokio::time::sleep(pause).await;
        };
        let js = jetstream::ContextBuilder::new()
            .timeout(config.request_timeout)
            .build(client.clone());
        // JetStream may answer a little after the server does (a cluster elects its meta
        // leader first, a restarted server recovers its streams): asked again, with the
        // connection's backoff, until `connect_timeout` has passed.
        let ready_by = Instant::now() + config.connect_timeout;
        let mut backoff = Backoff::new();
        let (workers, blobs) = loop {
            let ready = if config.provision {
                provision(&js, &config, &url).await
            } else {
                bind(&js, &config, &url).await
            };
            match ready {
                Ok(ready) => break ready,
                Err(e) => {
                    let pause = backoff.next();
                    if Instant::now() + pause >= ready_by {
                        return Err(e);
                    }
                    tracing::warn!(nats.url = %url, error = %e, "bus.nats JetStream not ready yet; asking again");
                    tokio::time::sleep(pause).await;
                }
            }
        };
        // A client with an identity goes through the coordinator even where it may
        // provision (an unrestricted set-up): the coordinator owns and counts its blobs.
        let blobs: Arc<dyn BlobStore> = match (&config.blob_broker, blobs) {
            (Some(subject), _) => Arc::new(broker::BrokeredBlobs::new(
                client.clone(),
                subject.clone(),
                config.connect_timeout,
            )),
            (None, Some((small, large))) => Arc::new(NatsBlobStore { small, large }),
            (None, None) => {
                return Err(BusError::Backend(
                    "no blob store: the buckets were not bound".into(),
                ))
            }
        };
        tracing::info!(nats.url = %url, "bus.nats ready");
        Ok(NatsBus {
            inner: Arc::new(Inner {
                config,
                url,
                client,
                js,
                pools: Mutex::new(HashMap::new()),
                reconnects,
                disruptions,
                workers,
                blobs,
            }),
        })
    }

    pub fn config(&self) -> &NatsConfig {
        &self.inner.config
    }

    /// The heartbeat bucket; a scoped client has none (it asks the coordinator).
    fn worker_bucket(&self) -> BusResult<&kv::Store> {
        self.inner.workers.as_ref().ok_or_else(|| {
            BusError::Backend(
                "a client with an identity reads no bucket: it lists the workers through the coordinator (the `workers` operation)".into(),
            )
        })
    }

    /// The JetStream context (the lease bucket's).
    pub(crate) fn js(&self) -> &jetstream::Context {
        &self.inner.js
    }

    /// The URL without credentials, for messages.
    pub fn url(&self) -> &str {
        &self.inner.url
    }

    /// Tasks of `pool` waiting or in flight (what a queue-depth autoscaler reads).
    pub async fn pending_tasks(&self, pool: &str) -> BusResult<u64> {
        // A clone of the cached handle: `info` refreshes its cache, so it needs its own.
        let mut consumer = (*self.pool_consumer(pool).await?).clone();
        let info = consumer
            .info()
            .await
            .map_err(|e| backend(format!("consumer info of pool `{pool}`"), e))?;
        Ok(info.num_pending + info.num_ack_pending as u64)
    }

    /// The pool's durable consumer, created (or its config brought up to date) on first use.
    async fn pool_consumer(&self, pool: &str) -> BusResult<Arc<consumer::PullConsumer>> {
        if let Some(c) = self.cached_pool(pool) {
            return Ok(c);
        }
        let name = subjects::pool_consumer(pool).map_err(invalid)?;
        let filter = subjects::task_subject(pool).map_err(invalid)?;
        let config = &self.inner.config;
        if !config.provision {
            // The coordinator creates it (when it starts, for its pool).
            let consumer: consumer::PullConsumer = self
                .inner
                .js
                .get_consumer_from_stream(&name, subjects::TASK_STREAM)
                .await
                .map_err(|e| {
                    backend(
                        format!(
                            "the task consumer {name} of stream {} does not exist yet (or this NATS user may not use it): is the coordinator running with pool `{pool}`?",
                            subjects::TASK_STREAM
                        ),
                        e,
                    )
                })?;
            let consumer = Arc::new(consumer);
            if let Ok(mut pools) = self.inner.pools.lock() {
                pools.insert(pool.to_string(), consumer.clone());
            }
            return Ok(consumer);
        }
        let consumer = self
            .inner
            .js
            .create_consumer_on_stream(
                consumer::pull::Config {
                    durable_name: Some(name.clone()),
                    description: Some(format!("forkfleet workers of pool {pool}")),
                    filter_subject: filter,
                    deliver_policy: consumer::DeliverPolicy::All,
                    ack_policy: consumer::AckPolicy::Explicit,
                    ack_wait: config.ack_wait,
                    // The server never gives a task up: a task it dropped at a limit of its
                    // own stays in the work queue undelivered (a restart that finds deliveries
                    // past the limit drops them with no advisory). The coordinator counts the
                    // deliveries a worker's takeover names against `max_deliver` (ADR 38).
                    max_deliver: -1,
                    max_ack_pending: MAX_ACK_PENDING,
                    ..Default::default()
                },
                subjects::TASK_STREAM,
            )
            .await
            .map_err(|e| backend(format!("cannot create the task consumer {name}"), e))?;
        let consumer = Arc::new(consumer);
        if let Ok(mut pools) = self.inner.pools.lock() {
            pools.insert(pool.to_string(), consumer.clone());
        }
        Ok(consumer)
    }

    fn cached_pool(&self, pool: &str) -> Option<Arc<consumer::PullConsumer>> {
        self.inner.pools.lock().ok()?.get(pool).cloned()
    }

    fn forget_pool(&self, pool: &str) {
        if let Ok(mut pools) = self.inner.pools.lock() {
            pools.remove(pool);
        }
    }

    /// Publish to JetStream and wait for the stream's acknowledgement, retrying a lost ack
    /// (or a stream not ready after a restart) with the same message id until the request
    /// timeout.
    ///
    /// `trace` is the W3C `traceparent` to send as a header (tasks only: see
    /// [`Delivery::trace`]).
    async fn publish_js(
        &self,
        subject: async_nats::Subject,
        payload: Bytes,
        trace: Option<String>,
    ) -> BusResult<()> {
        let msg_id = uuid::Uuid::now_v7().to_string();
        self.publish_js_id(subject, payload, trace, msg_id).await
    }

    /// [`Self::publish_js`] with the message id given (the stream drops a second message
    /// with the same id within its duplicate window).
    async fn publish_js_id(
        &self,
        subject: async_nats::Subject,
        payload: Bytes,
        trace: Option<String>,
        msg_id: String,
    ) -> BusResult<()> {
        let js = &self.inner.js;
        let deadline = Instant::now() + self.inner.config.request_timeout;
        let mut backoff = Backoff::new();
        let mut first = true;
        loop {
            let mut msg = jetstream::message::PublishMessage::build()
                .payload(payload.clone())
                .message_id(&msg_id);
            if let Some(tp) = &trace {
                msg = msg.header(TRACEPARENT, tp.as_str());
            }
            let result = async {
                let ack = js.send_publish(subject.clone(), msg).await?;
                if first {
                    // The context's own request timeout bounds the first ack.
                    return ack.await.map(|_| ());
                }
                let remaining = deadline.saturating_duration_since(Instant::now());
                match tokio::time::timeout(remaining, ack).await {
                    Ok(ack) => ack.map(|_| ()),
                    Err(_) => Err(jetstream::context::PublishError::new(
                        jetstream::context::PublishErrorKind::TimedOut,
                    )),
                }
            }
            .await;
            first = false;
            let err = match result {
                Ok(()) => return Ok(()),
                Err(err) => err,
            };
            use jetstream::context::PublishErrorKind as K;
            let transient = matches!(
                err.kind(),
                K::TimedOut | K::StreamNotFound | K::BrokenPipe | K::Other
            );
            let pause = backoff.next();
            if !transient || Instant::now() + pause >= deadline {
                return Err(backend(
                    format!("publish to `{subject}` on {} failed", self.inner.url),
                    err,
                ));
            }
            tracing::debug!(nats.subject = %subject, error = %err, "bus.publish retry");
            tokio::time::sleep(pause).await;
        }
    }
}

struct NatsReplier {
    client: Client,
    reply: async_nats::Subject,
}

#[async_trait]
impl Replier for NatsReplier {
    async fn respond(self: Box<Self>, payload: Bytes) -> BusResult<()> {
        self.client
            .publish(self.reply, payload)
            .await
            .map_err(|e| backend("reply failed", e))
    }
}

#[async_trait]
impl Bus for NatsBus {
    async fn enqueue_task(&self, pool: &str, payload: Bytes) -> BusResult<()> {
        let subject = subjects::task_subject(pool).map_err(invalid)?;
        // The consumer exists from the first task on, so queue depth is visible.
        self.pool_consumer(pool).await?;
        // Read in the caller's span: the task's worker continues the trace.
        self.publish_js(subject.into(), payload, current_traceparent())
            .await
    }

    async fn pull_task(&self, pool: &str, wait: Duration) -> BusResult<Option<Delivery>> {
        let deadline = Instant::now() + wait;
        let mut backoff = Backoff::new();
        loop {
            let remaining = deadline.saturating_duration_since(Instant::now());
            let result = match self.pool_consumer(pool).await {
                Ok(consumer) => fetch_one(&consumer, remaining)
                    .await
                    .map_err(|e| backend(format!("pull from pool `{pool}` failed"), e)),
                Err(e) => Err(e),
            };
            let pause = match result {
                Ok(Some(msg)) => {
                    let d = delivery(msg);
                    let seq = d.seq;
                    return Ok(Some(d.with_position(Some(self.inner.config.ack_wait), seq)));
                }
                Ok(None) => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left < RETRY_MIN {
                        return Ok(None);
                    }
                    // The request ended early (a restart, a leadership change): ask again.
                    RETRY_MIN
                }
                Err(e) => {
                    self.forget_pool(pool);
                    let pause = backoff.next();
                    if Instant::now() + pause >= deadline {
                        return Err(e);
                    }
                    tracing::warn!(bus.pool = %pool, error = %e, "bus.pull retry");
                    pause
                }
            };
            tokio::time::sleep(pause).await;
        }
    }

    async fn open_pool(&self, pool: &str) -> BusResult<()> {
        if self.inner.config.provision {
            self.pool_consumer(pool).await?;
        }
        Ok(())
    }

    async fn queued_task(&self, pool: &str, seq: u64) -> BusResult<Option<Bytes>> {
        let subject = subjects::task_subject(pool).map_err(invalid)?;
        let tasks = self
            .inner
            .js
            .get_stream_no_info(subjects::TASK_STREAM)
            .await
            .map_err(|e| backend("cannot open the task stream", e))?;
        // A work-queue stream: an acked task is deleted.
        match tasks.get_raw_message(seq).await {
            Ok(task) if task.subject.as_str() == subject => Ok(Some(task.payload)),
            Ok(_) => Ok(None),
            Err(e) if e.kind() == stream::RawMessageErrorKind::NoMessageFound => Ok(None),
            Err(e) => Err(backend(
                format!("cannot read task {seq} of pool `{pool}`"),
                e,
            )),
        }
    }

    async fn task_queue(&self, pool: &str) -> BusResult<crate::TaskQueue> {
        // A clone of the cached handle: `info` refreshes its cache, so it needs its own.
        let mut consumer = (*self.pool_consumer(pool).await?).clone();
        let info = consumer
            .info()
            .await
            .map_err(|e| backend(format!("consumer info of pool `{pool}`"), e))?;
        Ok(crate::TaskQueue {
            waiting: info.num_pending,
            in_flight: info.num_ack_pending as u64,
        })
    }

    fn connected(&self) -> bool {
        self.inner.client.connection_state() == async_nats::connection::State::Connected
    }

    fn disrupted_at_ms(&self) -> u64 {
        self.inner.disruptions.last_ms()
    }

    fn remote(&self) -> bool {
        true
    }

    fn max_payload(&self) -> Option<usize> {
        Some(self.inner.client.server_info().max_payload).filter(|n| *n > 0)
    }

    fn max_deliver(&self) -> u32 {
        self.inner.config.max_deliver
    }

    async fn publish_event(&self, payload: Bytes) -> BusResult<()> {
        self.publish_js(
            async_nats::Subject::from_static(subjects::EVENT_SUBJECT),
            payload,
            None,
        )
        .await
    }

    async fn publish_events(&self, payloads: Vec<Bytes>) -> BusResult<()> {
        let subject = async_nats::Subject::from_static(subjects::EVENT_SUBJECT);
        if payloads.len() < 2 {
            for payload in payloads {
                self.publish_js(subject.clone(), payload, None).await?;
            }
            return Ok(());
        }
        // All sent first, in order, on the one connection; then their acks.
        let mut sent = Vec::with_capacity(payloads.len());
        for payload in payloads {
            let msg_id = uuid::Uuid::now_v7().to_string();
            let msg = jetstream::message::PublishMessage::build()
                .payload(payload.clone())
                .message_id(&msg_id);
            let ack = self.inner.js.send_publish(subject.clone(), msg).await;
            sent.push((msg_id, payload, ack));
        }
        for (msg_id, payload, ack) in sent {
            let stored = match ack {
                Ok(ack) => ack.await.is_ok(),
                Err(_) => false,
            };
            if !stored {
                // Again, with its id: retried as a single publish is.
                self.publish_js_id(subject.clone(), payload, None, msg_id)
                    .await?;
            }
        }
        Ok(())
    }

    async fn events(&self, durable: &str) -> BusResult<Box<dyn EventConsumer>> {
        let durable = subjects::event_consumer(durable).map_err(invalid)?;
        let mut consumer = NatsEventConsumer {
            js: self.inner.js.clone(),
            durable,
            ack_wait: self.inner.config.ack_wait,
            messages: None,
            backoff: Backoff::new(),
            disruptions: self.inner.disruptions.clone(),
        };
        // Fail now on a setup error (no stream, no permission) rather than retry forever.
        let messages = consumer.open().await.map_err(|e| {
            backend(
                format!("cannot open the event consumer {}", consumer.durable),
                e,
            )
        })?;
        consumer.messages = Some(messages);
        Ok(Box::new(consumer))
    }

    async fn send_control(&self, run: RunId, payload: Bytes) -> BusResult<()> {
        self.publish_js(subjects::control_subject(run).into(), payload, None)
            .await
    }

    async fn watch_control(&self, run: RunId) -> BusResult<mpsc::UnboundedReceiver<Bytes>> {
        let subject = subjects::control_subject(run);
        let first = open_control(&self.inner.js, &subject, None)
            .await
            .map_err(|e| backend(format!("cannot watch `{subject}`"), e))?;
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(forward_control(
            self.inner.js.clone(),
            subject,
            tx,
            Some(first),
            self.inner.reconnects.clone(),
        ));
        Ok(rx)
    }

    fn blobs(&self) -> Arc<dyn BlobStore> {
        self.inner.blobs.clone()
    }

    async fn put_worker(&self, info: WorkerInfo) -> BusResult<()> {
        let value =
            forkfleet_shared::wire::encode(&info).map_err(|e| backend("encode worker info", e))?;
        self.worker_bucket()?
            .put(subjects::worker_key(info.worker_id), value)
            .await
            .map(|_| ())
            .map_err(|e| backend("worker heartbeat put failed", e))
    }

    async fn remove_worker(&self, worker: forkfleet_shared::ids::WorkerId) -> BusResult<()> {
        self.worker_bucket()?
            .delete(subjects::worker_key(worker))
            .await
            .map_err(|e| backend("worker heartbeat delete failed", e))
    }

    async fn workers(&self) -> BusResult<Vec<WorkerInfo>> {
        let kv = self.worker_bucket()?;
        let keys: Vec<String> = kv
            .keys()
            .await
            .map_err(|e| backend("list workers", e))?
            .filter_map(|k| async move { k.ok() })
            .collect()
            .await;
        let values = futures::future::join_all(keys.iter().map(|k| kv.get(k))).await;
        let ttl_ms = u64::try_from(self.inner.config.worker_ttl.as_millis()).unwrap_or(u64::MAX);
        let now = now_ms();
        let mut out = Vec::with_capacity(values.len());
        for (key, value) in keys.iter().zip(values) {
            let bytes = match value {
                Ok(Some(bytes)) => bytes,
                Ok(None) => continue,
                Err(e) => return Err(backend(format!("read worker {key}"), e)),
            };
            match forkfleet_shared::wire::decode::<WorkerInfo>(&bytes) {
                Ok(w) if now.saturating_sub(w.heartbeat_at_ms) < ttl_ms => out.push(w),
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(worker.key = %key, error = %e, "bus.workers bad entry skipped")
                }
            }
        }
        out.sort_by_key(|w| w.worker_id);
        Ok(out)
    }

    async fn request(&self, subject: &str, payload: Bytes, timeout: Duration) -> BusResult<Bytes> {
        let full = subjects::api_subject(subject).map_err(invalid)?;
        let mut request = async_nats::Request::new()
            .payload(payload)
            .timeout(Some(timeout));
        // The caller's trace goes with the request: the service's span continues it.
        if let Some(tp) = current_traceparent() {
            let mut headers = async_nats::HeaderMap::new();
            headers.insert(TRACEPARENT, tp.as_str());
            request = request.headers(headers);
        }
        // The client's own timeout covers the answer; this one covers a stalled send.
        let sent = tokio::time::timeout(
            timeout + Duration::from_millis(100),
            self.inner.client.send_request(full, request),
        )
        .await;
        let timed_out = || BusError::Timeout {
            subject: subject.to_string(),
            ms: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
        };
        match sent {
            Err(_) => Err(timed_out()),
            Ok(Ok(msg)) => Ok(msg.payload),
            Ok(Err(e)) => match e.kind() {
                async_nats::RequestErrorKind::NoResponders => {
                    Err(BusError::NoResponders(subject.to_string()))
                }
                async_nats::RequestErrorKind::TimedOut => Err(timed_out()),
                _ => Err(backend(format!("request to `{subject}` failed"), e)),
            },
        }
    }

    async fn serve(&self, subject: &str) -> BusResult<mpsc::Receiver<Request>> {
        // `subject` may have `*` tokens (`client.*`); each request names its own.
        let full = subjects::api_serve_subject(subject).map_err(invalid)?;
        let client = self.inner.client.clone();
        let mut sub = client
            .queue_subscribe(full.clone(), subjects::SERVICE_QUEUE_GROUP.to_string())
            .await
            .map_err(|e| backend(format!("cannot serve `{subject}`"), e))?;
        let (tx, rx) = mpsc::channel(1024);
        let subject = subject.to_string();
        tokio::spawn(async move {
            let mut dropped: u64 = 0;
            loop {
                let msg = tokio::select! {
                    _ = tx.closed() => break,
                    msg = sub.next() => msg,
                };
                let Some(msg) = msg else { break };
                // Who asks is read from the subject a request names (ADR 17), so only a
                // request published on it counts: a stream's push consumer can deliver a
                // stored message here under the stream's own subject (a worker may write
                // the blob buckets and create consumers on them), and a JetStream delivery
                // replies to `$JS.ACK`. Either is dropped, never answered as an admin.
                if !subjects::subject_matches(&full, &msg.subject)
                    || msg.reply.as_ref().is_some_and(|r| r.starts_with("$JS."))
                {
                    // Warned of once, then every 1,000th: a consumer aimed here could
                    // otherwise flood the log.
                    dropped += 1;
                    if dropped % 1000 == 1 {
                        tracing::warn!(
                            nats.subject = %subject,
                            nats.delivered_as = %msg.subject,
                            dropped,
                            "bus.serve a message delivered here that was not published on the service's subject (a stream consumer's delivery?): dropped"
                        );
                    }
                    continue;
                }
                let Some(reply) = msg.reply else {
                    tracing::debug!(nats.subject = %subject, "bus.serve request without reply");
                    continue;
                };
                let replier = NatsReplier {
                    client: client.clone(),
                    reply,
                };
                let service = subjects::service_of(&msg.subject).to_string();
                let traceparent = msg
                    .headers
                    .as_ref()
                    .and_then(|h| h.get(TRACEPARENT))
                    .map(|v| v.as_str().to_string());
                let req = Request::new(service, msg.payload, Box::new(replier))
                    .with_traceparent(traceparent);
                if tx.send(req).await.is_err() {
                    break;
                }
            }
            let _ = sub.unsubscribe().await;
        });
        Ok(rx)
    }
}
