//! The coordinator's API over the bus: [`BusApi`] is an [`ApiClient`] (one method per
//! operation) for a coordinator serving a subject of a bus; [`call`] sends one request. A
//! request or a reply too large for one message travels through the blob store. The CLI's
//! client and the agents' fork tools both use it.

use crate::{Bus, BusError};
use forkfleet_shared::api::{
    ApiClient, ApiError, ApiReply, ApiRequest, ApiResponse, Operation, API_SUBJECT,
    MAX_INLINE_BYTES, WORKER_API_SUBJECT,
};
use forkfleet_shared::blob::{fetch, BlobError, BlobHash};
use forkfleet_shared::wire::{self, WireError};
use std::time::{Duration, Instant};

/// Why a call to the coordinator failed.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// The coordinator answered with an error.
    #[error("{0}")]
    Api(#[from] ApiError),
    /// The coordinator could not be reached or did not answer in time.
    #[error("cannot reach the coordinator: {0}")]
    Bus(#[from] BusError),
    #[error("the coordinator's answer does not decode: {0}")]
    Wire(#[from] WireError),
    #[error("blob store: {0}")]
    Blob(#[from] BlobError),
    #[error("the coordinator answered `{got}` to a `{op}` request")]
    UnexpectedReply { op: &'static str, got: &'static str },
    /// No coordinator answered within the retry bound ([`Retry`]).
    #[error("no coordinator answered `{op}` via NATS at {url} within {secs} s ({attempts} attempts, retrying {retried}); last: {last}; is `forkfleet coordinator` running on this NATS server?")]
    GaveUp {
        op: &'static str,
        /// The NATS URL, credentials redacted.
        url: String,
        secs: u64,
        attempts: u32,
        /// What was retried: "no responders", or "no responders and timeouts".
        retried: &'static str,
        last: Box<BusError>,
    },
}

/// How long [`call_retrying`] keeps asking while no coordinator answers, and the (redacted)
/// NATS URL its final error names.
#[derive(Debug, Clone)]
pub struct Retry {
    pub bound: Duration,
    pub url: String,
}

/// [`call`], asked again with backoff while the bus reports no responders (no coordinator
/// subscribed: the request reached nobody, so asking again is safe for any operation) or,
/// for an idempotent operation, a timeout, until `retry.bound` has passed since the first
/// attempt; then a [`CallError::GaveUp`] naming the URL and what was tried. Other errors
/// return at once.
pub async fn call_retrying(
    bus: &dyn Bus,
    subject: &str,
    req: ApiRequest,
    timeout: Duration,
    retry: &Retry,
) -> Result<ApiReply, CallError> {
    let op = req.op();
    let idempotent = req.is_idempotent();
    let deadline = Instant::now() + retry.bound;
    let mut backoff = crate::backoff::Backoff::new();
    let mut attempts = 0u32;
    loop {
        attempts += 1;
        let err = match call(bus, subject, req.clone(), timeout).await {
            Err(CallError::Bus(e @ BusError::NoResponders(_))) => e,
            Err(CallError::Bus(e @ BusError::Timeout { .. })) if idempotent => e,
            other => return other,
        };
        let pause = backoff.next();
        if Instant::now() + pause >= deadline {
            return Err(CallError::GaveUp {
                op,
                url: retry.url.clone(),
                secs: retry.bound.as_secs(),
                attempts,
                retried: if idempotent {
                    "no responders and timeouts"
                } else {
                    "no responders"
                },
                last: Box::new(err),
            });
        }
        tracing::debug!(api.op = op, attempt = attempts, error = %err, "api.call retry");
        tokio::time::sleep(pause).await;
    }
}

impl CallError {
    /// The message for a user or an agent: the coordinator's own words for an API error.
    pub fn message(self) -> String {
        match self {
            CallError::Api(e) => e.message,
            other => other.to_string(),
        }
    }
}

/// The API of the coordinator serving `subject` on `bus`.
#[derive(Clone, Copy)]
pub struct BusApi<'a> {
    pub bus: &'a dyn Bus,
    pub subject: &'a str,
}

impl<'a> BusApi<'a> {
    /// The coordinator serving [`API_SUBJECT`] on `bus`.
    pub fn new(bus: &'a dyn Bus) -> Self {
        Self {
            bus,
            subject: API_SUBJECT,
        }
    }

    /// The coordinator's API for workers, [`WORKER_API_SUBJECT`]: what the agents' fork
    /// tools call (ADR 17).
    pub fn worker(bus: &'a dyn Bus) -> Self {
        Self {
            bus,
            subject: WORKER_API_SUBJECT,
        }
    }
}

impl ApiClient for BusApi<'_> {
    type Error = CallError;

    async fn call<O: Operation>(&self, op: O) -> Result<O::Reply, CallError> {
        let timeout = op.timeout();
        let reply = call(self.bus, self.subject, op.into(), timeout).await?;
        O::from_reply(reply).map_err(|got| CallError::UnexpectedReply { op: O::NAME, got })
    }
}

/// Send `req` on `subject` and decode the answer, waiting at most `timeout` for it.
pub async fn call(
    bus: &dyn Bus,
    subject: &str,
    req: ApiRequest,
    timeout: Duration,
) -> Result<ApiReply, CallError> {
    let op = req.op();
    let started = Instant::now();
    let mut payload = wire::encode(&req)?;
    if payload.len() > MAX_INLINE_BYTES {
        let blob = BlobHash::of(&payload);
        bus.blobs().put(blob, payload).await?;
        payload = wire::encode(&ApiRequest::Stored { blob })?;
    }
    let answer = bus.request(subject, payload, timeout).await?;
    let reply = match decode_response(&answer)? {
        ApiReply::Stored { blob, .. } => {
            let bytes = fetch(bus.blobs().as_ref(), &blob).await?;
            match decode_response(&bytes)? {
                ApiReply::Stored { .. } => {
                    return Err(CallError::UnexpectedReply { op, got: "stored" })
                }
                r => r,
            }
        }
        r => r,
    };
    tracing::debug!(
        api.op = op,
        ms = started.elapsed().as_millis() as u64,
        "api.call"
    );
    Ok(reply)
}

fn decode_response(bytes: &[u8]) -> Result<ApiReply, CallError> {
    match wire::decode::<ApiResponse>(bytes)? {
        ApiResponse::Ok(reply) => Ok(*reply),
        ApiResponse::Err(e) => Err(CallError::Api(e)),
    }
}
