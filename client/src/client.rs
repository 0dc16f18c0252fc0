//! Talking to a coordinator: [`Client`] is what every front end uses. It is an
//! [`ApiClient`], so it has one method per API operation (`client.merge(fork, "a")`, see
//! `forkfleet_shared::api::ops`), each one request through a [`Transport`]: the bus's
//! request/reply to a coordinator anywhere ([`BusTransport`]), a handler in this process
//! ([`InProcess`], the embedded mode), or another process's embedded coordinator over the
//! Unix socket in its data directory (`crate::local::SocketTransport`), so every command
//! works unchanged, errors included, against any of them.
//!
//! Every call is bounded: by the operation's own timeout ([`Operation::timeout`]); a
//! waiting operation asks the coordinator to hold it at most `MAX_API_WAIT_MS`.
//!
//! Four methods wrap the generated ones with client-side behaviour, and shadow them on
//! [`Client`]: [`Client::find_fork`] and [`Client::find_run`] need no round trip for a full
//! id, [`Client::wait_settled`] asks again until its own deadline, and [`Client::watch`]
//! takes a [`Duration`].

use crate::error::ClientError;
use async_trait::async_trait;
use forkfleet_bus::apicall::{self, CallError};
use forkfleet_bus::Bus;
use forkfleet_shared::api::{
    dispatch, ApiClient, ApiError, ApiErrorKind, ApiHandler, ApiReply, ApiRequest, Caller,
    ForkView, ForkWatch, Operation, API_SUBJECT, MAX_API_WAIT_MS,
};
use forkfleet_shared::blob::BlobStore;
use forkfleet_shared::ids::{ForkId, RunId};
use forkfleet_shared::protocol::WorkerInfo;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How a request reaches a coordinator and its answer comes back.
#[async_trait]
pub trait Transport: Send + Sync {
    /// Send one request and wait at most `timeout` for its answer.
    async fn request(&self, req: ApiRequest, timeout: Duration) -> Result<ApiReply, CallError>;
}

/// A coordinator serving a subject of a bus (NATS in a cluster).
pub struct BusTransport {
    bus: Arc<dyn Bus>,
    subject: String,
    retry: Option<apicall::Retry>,
}

impl BusTransport {
    pub fn new(bus: Arc<dyn Bus>, subject: &str) -> Self {
        Self {
            bus,
            subject: subject.to_string(),
            retry: None,
        }
    }

    /// The same transport, asking again while no coordinator answers, within `retry`
    /// ([`apicall::call_retrying`]).
    pub fn with_retry(mut self, retry: apicall::Retry) -> Self {
        self.retry = Some(retry);
        self
    }
}

#[async_trait]
impl Transport for BusTransport {
    async fn request(&self, req: ApiRequest, timeout: Duration) -> Result<ApiReply, CallError> {
        match &self.retry {
            Some(retry) => {
                apicall::call_retrying(self.bus.as_ref(), &self.subject, req, timeout, retry).await
            }
            None => apicall::call(self.bus.as_ref(), &self.subject, req, timeout).await,
        }
    }
}

/// A coordinator in this process: each request goes straight to its handler
/// (`forkfleet_shared::api::dispatch`), with no encoding and no bus.
pub struct InProcess<H> {
    handler: H,
}

impl<H: ApiHandler + 'static> InProcess<H> {
    pub fn new(handler: H) -> Self {
        Self { handler }
    }
}

#[async_trait]
impl<H: ApiHandler + 'static> Transport for InProcess<H> {
    async fn request(&self, req: ApiRequest, timeout: Duration) -> Result<ApiReply, CallError> {
        let op = req.op();
        match tokio::time::timeout(timeout, dispatch(&self.handler, &Caller::Admin, req)).await {
            Ok(reply) => reply.map_err(CallError::Api),
            Err(_) => Err(CallError::Api(ApiError::new(
                ApiErrorKind::Unavailable,
                format!("`{op}` did not finish within {} ms", timeout.as_millis()),
            ))),
        }
    }
}

/// The coordinator a front end talks to, and the bus its blobs and workers are on.
#[derive(Clone)]
pub struct Client {
    /// The flags that reach this coordinator from a shell anywhere (` --data '/abs/dir'`,
    /// ` --nats URL`), appended to every command a hint prints.
    reach: Arc<str>,
    transport: Arc<dyn Transport>,
    bus: Arc<dyn Bus>,
    remote: bool,
}

impl Client {
    /// The coordinator serving [`API_SUBJECT`] on `bus`.
    pub fn remote(bus: Arc<dyn Bus>) -> Self {
        Self::on_subject(bus, API_SUBJECT)
    }

    /// The coordinator serving [`API_SUBJECT`] on `bus`, each request asked again while no
    /// coordinator answers, within `retry` (a command started while the coordinator is
    /// briefly away).
    pub fn remote_retrying(bus: Arc<dyn Bus>, retry: apicall::Retry) -> Self {
        Self::on_subject_retrying(bus, API_SUBJECT, retry)
    }

    /// [`Client::on_subject`], each request asked again while no coordinator answers,
    /// within `retry`.
    pub fn on_subject_retrying(bus: Arc<dyn Bus>, subject: &str, retry: apicall::Retry) -> Self {
        Self {
            reach: Arc::from(""),
            transport: Arc::new(BusTransport::new(bus.clone(), subject).with_retry(retry)),
            bus,
            remote: true,
        }
    }

    /// The coordinator serving `subject` on `bus` (several coordinators on one bus, tests).
    pub fn on_subject(bus: Arc<dyn Bus>, subject: &str) -> Self {
        Self {
            reach: Arc::from(""),
            transport: Arc::new(BusTransport::new(bus.clone(), subject)),
            bus,
            remote: true,
        }
    }

    /// A coordinator in this process (`handler`), whose workers are on `bus`.
    pub fn in_process<H: ApiHandler + 'static>(handler: H, bus: Arc<dyn Bus>) -> Self {
        Self {
            reach: Arc::from(""),
            transport: Arc::new(InProcess::new(handler)),
            bus,
            remote: false,
        }
    }

    /// The same client, whose hints name `reach`: the flags (each value shell-quoted,
    /// paths absolute) that reach this coordinator from a shell in any directory.
    pub fn with_reach(mut self, reach: impl Into<String>) -> Self {
        self.reach = Arc::from(reach.into());
        self
    }

    /// What [`Client::with_reach`] set: appended to every command a hint prints, so it
    /// runs as printed from any directory.
    pub fn reach(&self) -> &str {
        &self.reach
    }

    /// The coordinator of another process's embedded system, served on its local socket
    /// (`crate::local`): its workers run there, and its run store's blobs are read through
    /// the socket (`get_blob`).
    #[cfg(unix)]
    pub fn over_socket(transport: crate::local::SocketTransport) -> Self {
        let transport = Arc::new(transport);
        let blobs = Arc::new(crate::local::SocketBlobs::new(transport.clone()));
        Self {
            reach: Arc::from(""),
            transport,
            bus: Arc::new(forkfleet_bus::local::LocalBus::new(blobs)),
            remote: true,
        }
    }

    /// True when the coordinator and its workers are not in this process: a cluster
    /// reached over a bus, or another process's embedded system over its local socket.
    pub fn is_remote(&self) -> bool {
        self.remote
    }

    /// Where the client uploads blobs and reads merge results.
    pub fn blobs(&self) -> Arc<dyn BlobStore> {
        self.bus.blobs()
    }

    /// The bus the client is on (the in-process one when embedded; over a local socket, a
    /// bus of its own that only carries the socket's blobs).
    pub fn bus(&self) -> &Arc<dyn Bus> {
        &self.bus
    }

    /// Send one request as it is and wait at most `timeout` for its answer.
    pub async fn request(
        &self,
        req: ApiRequest,
        timeout: Duration,
    ) -> Result<ApiReply, ClientError> {
        Ok(self.transport.request(req, timeout).await?)
    }

    /// A fork by full id (no round trip, so it works while the coordinator is away: an
    /// unknown one is reported by the call that uses it) or unique prefix.
    pub async fn find_fork(&self, prefix: &str) -> Result<ForkId, ClientError> {
        match prefix.trim().parse::<ForkId>() {
            Ok(id) => Ok(id),
            Err(_) => ApiClient::find_fork(self, prefix).await,
        }
    }

    /// A run by full id (no round trip), unique prefix, or a fork's branch as `FORK/LABEL`
    /// (FORK a fork's id or a unique prefix of one): every command that takes a run takes
    /// all three.
    pub async fn find_run(&self, arg: &str) -> Result<RunId, ClientError> {
        let arg = arg.trim();
        if let Some((fork, label)) = arg.split_once('/') {
            forkfleet_shared::spec::check_label(label)
                .map_err(|e| ClientError::BadInput(format!("`{arg}`: {e}")))?;
            let view = self.fork(self.find_fork(fork).await?).await?;
            return view
                .branch(label)
                .map(|b| b.run_id)
                .ok_or_else(|| crate::render::no_branch(&view, label));
        }
        match arg.parse::<RunId>() {
            Ok(id) => Ok(id),
            Err(_) => ApiClient::find_run(self, arg).await,
        }
    }

    /// The view once nothing runs (every branch is terminal, or paused by a budget cap
    /// waiting for a top-up), waiting at most `timeout` (asking again every
    /// `MAX_API_WAIT_MS`).
    pub async fn wait_settled(
        &self,
        fork: ForkId,
        timeout: Duration,
    ) -> Result<ForkView, ClientError> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let wait = left.min(Duration::from_millis(MAX_API_WAIT_MS));
            let asked = Instant::now();
            match ApiClient::wait_settled(self, fork, wait.as_millis() as u64).await {
                Ok(view) => return Ok(view),
                // Not settled within this round (the coordinator answers a timeout only
                // after the whole wait): ask again while time is left.
                Err(ClientError::Call(CallError::Api(e)))
                    if !e.is_bad_input()
                        && asked.elapsed() >= wait
                        && Instant::now() < deadline =>
                {
                    tracing::debug!(error = %e.message, "api.wait_settled: asking again");
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// The view once its version differs from `seen`, or after `wait` (capped at
    /// `MAX_API_WAIT_MS`).
    pub async fn watch(
        &self,
        fork: ForkId,
        seen: Option<u64>,
        wait: Duration,
    ) -> Result<ForkWatch, ClientError> {
        ApiClient::watch(self, fork, seen, wait.as_millis() as u64).await
    }

    /// The live workers (from their heartbeats on the bus, not from the coordinator).
    pub async fn workers(&self) -> Result<Vec<WorkerInfo>, ClientError> {
        Ok(self.bus.workers().await.map_err(CallError::from)?)
    }
}

impl ApiClient for Client {
    type Error = ClientError;

    async fn call<O: Operation>(&self, op: O) -> Result<O::Reply, ClientError> {
        let timeout = op.timeout();
        let reply = self.transport.request(op.into(), timeout).await?;
        O::from_reply(reply)
            .map_err(|got| ClientError::Call(CallError::UnexpectedReply { op: O::NAME, got }))
    }
}
