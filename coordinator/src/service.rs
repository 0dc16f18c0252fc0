//! The coordinator's API over the bus: [`serve`] answers [`ApiRequest`]s on the service
//! subjects [`API_SUBJECT`], [`WORKER_API_SUBJECT`] and [`CLIENT_API_PATTERN`] with
//! [`ApiResponse`]s, both in the wire envelope.
//!
//! - Each request is answered for the [`Caller`] its subject names (ADR 17): an admin, a
//!   worker, or the scoped client `ff.api.client.<identity>` names; never for a field of
//!   the request.
//! - Each request runs in its own task (at most 1,024 at once), so a slow diff or a
//!   long-poll `watch` never holds up the others.
//! - A request that does not decode (garbage, a wrong wire version, a wrong kind), or
//!   whose strings exceed their bounds (`forkfleet_shared::api::limits`: checked before
//!   any work, and never echoed), is answered with a `bad_input` [`ApiError`] and logged;
//!   nothing a client sends stops the service.
//! - Errors are mapped to three kinds: `not_found` (unknown fork, run or label),
//!   `bad_input` (the request cannot succeed as sent), `failure` (the coordinator failed;
//!   asking again may work).
//! - Each request goes to its handler through `forkfleet_shared::api::dispatch` (the
//!   handlers: [`crate::api`]); waits (`wait_settled`, `watch`) are capped at
//!   `MAX_API_WAIT_MS`.
//! - A request or a reply larger than [`MAX_INLINE_BYTES`] travels as a blob of the bus's
//!   blob store, named by a `stored` request or reply.
//! - Blobs: clients upload to the bus's blob store and workers write there, but the
//!   coordinator reads the run store. So `create_fork` first copies the blobs the fork
//!   names (snapshot, files, scripts), and a unified `diff` the text files it shows, from
//!   the bus's blob store into the run store. With the local bus both are the same store
//!   and nothing is copied.

use crate::error::CoordinatorError;
use crate::handle::CoordinatorHandle;
use bytes::Bytes;
use forkfleet_bus::{Bus, Request};
use forkfleet_shared::api::{
    ApiError, ApiErrorKind, ApiReply, ApiRequest, ApiResponse, Caller, API_SUBJECT,
    CLIENT_API_PATTERN, MAX_INLINE_BYTES, WORKER_API_SUBJECT,
};
use forkfleet_shared::blob::{BlobError, BlobHash};
use forkfleet_shared::wire::{self, WireError, WIRE_VERSION};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinSet;
use tracing::Instrument;

/// How long [`serve`] lets requests in flight finish after its shutdown.
const DRAIN: Duration = Duration::from_secs(5);
/// Requests answered at once; more wait in the subscription.
const MAX_IN_FLIGHT: usize = 1024;
/// Pause before subscribing again when the bus ends the subscription.
const RESUBSCRIBE_AFTER: Duration = Duration::from_millis(500);

/// Answer API requests on every API subject (see [`ApiServer::bind`]) until `shutdown`
/// completes; then stop taking requests and give the ones in flight a few seconds to
/// finish. Same as [`ApiServer::bind`] then [`ApiServer::run`].
pub async fn serve(
    handle: CoordinatorHandle,
    bus: Arc<dyn Bus>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), CoordinatorError> {
    ApiServer::bind(handle, bus).await?.run(shutdown).await
}

/// The API service, subscribed: requests sent from now on are answered once it runs.
pub struct ApiServer {
    handle: CoordinatorHandle,
    bus: Arc<dyn Bus>,
    subjects: Vec<String>,
    /// The requests of every subject, each with the caller its subject names.
    requests: tokio::sync::mpsc::Receiver<(Caller, Request)>,
}

impl ApiServer {
    /// Subscribe to the API's subjects, each for its callers (ADR 17): [`API_SUBJECT`]
    /// (admins), [`WORKER_API_SUBJECT`] (workers' fork tools) and [`CLIENT_API_PATTERN`]
    /// (scoped clients, one subject per identity).
    pub async fn bind(
        handle: CoordinatorHandle,
        bus: Arc<dyn Bus>,
    ) -> Result<Self, CoordinatorError> {
        Self::bind_all(
            handle,
            bus,
            &[API_SUBJECT, WORKER_API_SUBJECT, CLIENT_API_PATTERN],
        )
        .await
    }

    /// Subscribe to another subject only (several coordinators on one bus, tests); its
    /// requests are an admin's.
    pub async fn bind_on(
        handle: CoordinatorHandle,
        bus: Arc<dyn Bus>,
        subject: &str,
    ) -> Result<Self, CoordinatorError> {
        Self::bind_all(handle, bus, &[subject]).await
    }

    async fn bind_all(
        handle: CoordinatorHandle,
        bus: Arc<dyn Bus>,
        subjects: &[&str],
    ) -> Result<Self, CoordinatorError> {
        let (tx, requests) = tokio::sync::mpsc::channel(MAX_IN_FLIGHT);
        for subject in subjects {
            let sub = bus.serve(subject).await?;
            tracing::info!(api.subject = %subject, "api.serving");
            tokio::spawn(forward(bus.clone(), subject.to_string(), sub, tx.clone()));
        }
        Ok(Self {
            handle,
            bus,
            subjects: subjects.iter().map(|s| s.to_string()).collect(),
            requests,
        })
    }

    /// Answer requests until `shutdown` completes, each in its own task.
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> Result<(), CoordinatorError> {
        let ApiServer {
            handle,
            bus,
            subjects,
            mut requests,
        } = self;
        tokio::pin!(shutdown);
        let mut tasks = JoinSet::new();
        loop {
            tokio::select! {
                _ = &mut shutdown => break,
                // At most MAX_IN_FLIGHT at once: past it, wait for one to finish.
                req = requests.recv(), if tasks.len() < MAX_IN_FLIGHT => match req {
                    Some((caller, req)) => {
                        tasks.spawn(answer(handle.clone(), bus.clone(), caller, req));
                    }
                    None => break,
                },
                Some(done) = tasks.join_next(), if !tasks.is_empty() => log_join(done),
            }
        }
        // The forwarders stop when they see the receiver gone.
        drop(requests);
        let drained = tokio::time::timeout(DRAIN, async {
            while let Some(done) = tasks.join_next().await {
                log_join(done);
            }
        })
        .await;
        if drained.is_err() {
            tracing::warn!(
                requests = tasks.len(),
                "api.shutdown: requests still running were dropped"
            );
            tasks.abort_all();
        }
        tracing::info!(api.subjects = ?subjects, "api.stopped");
        Ok(())
    }
}

/// Hand the requests of one subscription to the service, each with its caller (from the
/// subject it arrived on), until the service stops; when the bus ends the subscription,
/// subscribe again.
async fn forward(
    bus: Arc<dyn Bus>,
    subject: String,
    mut sub: tokio::sync::mpsc::Receiver<Request>,
    tx: tokio::sync::mpsc::Sender<(Caller, Request)>,
) {
    loop {
        let req = tokio::select! {
            _ = tx.closed() => return,
            req = sub.recv() => req,
        };
        match req {
            Some(req) => {
                let caller = Caller::of_subject(&req.subject);
                if tx.send((caller, req)).await.is_err() {
                    return;
                }
            }
            None => {
                tracing::warn!(api.subject = %subject, "api.subscription ended; subscribing again");
                loop {
                    tokio::select! {
                        _ = tx.closed() => return,
                        _ = tokio::time::sleep(RESUBSCRIBE_AFTER) => {}
                    }
                    match bus.serve(&subject).await {
                        Ok(s) => {
                            sub = s;
                            break;
                        }
                        Err(e) => {
                            tracing::warn!(api.subject = %subject, error = %e, "api.subscribe failed; retrying")
                        }
                    }
                }
            }
        }
    }
}

fn log_join(done: Result<(), tokio::task::JoinError>) {
    if let Err(e) = done {
        if e.is_panic() {
            tracing::error!(error = %e, "api.request handler panicked; the client times out");
        }
    }
}

/// Answer one request from `caller`. Never fails: every outcome is a reply (or a logged
/// send error).
async fn answer(handle: CoordinatorHandle, bus: Arc<dyn Bus>, caller: Caller, req: Request) {
    let bytes_in = req.payload.len();
    // Sizes are checked by `dispatch`, as for every transport.
    let decoded = decode_request(&handle, &caller, bus.as_ref(), &req.payload).await;
    let response = match decoded {
        Ok(api) => {
            let span = tracing::info_span!("api.request", api.op = api.op(), api.caller = %caller, bytes_in);
            // The caller's trace (a client command's, an agent's fork tool's) continues
            // here; whether it is recorded is this process's decision.
            forkfleet_shared::trace::set_caller_parent(&span, req.traceparent.as_deref());
            let result = forkfleet_shared::api::dispatch(&handle, &caller, api)
                .instrument(span.clone())
                .await;
            if let Err(e) = &result {
                span.in_scope(|| match e.kind {
                    ApiErrorKind::Failure | ApiErrorKind::Unavailable => {
                        tracing::error!(api.error = e.kind.as_str(), error = %e.message, "api.request failed")
                    }
                    _ => {
                        tracing::info!(api.error = e.kind.as_str(), error = %e.message, "api.request refused")
                    }
                });
            }
            ApiResponse::from(result)
        }
        Err(e) => {
            tracing::error!(bytes_in, error = %e.message, "api.request rejected: it does not decode or is oversized");
            ApiResponse::Err(e)
        }
    };
    let payload = encode_response(&handle, &caller, bus.as_ref(), &response).await;
    if let Err(e) = req.respond(payload).await {
        tracing::warn!(error = %e, "api.reply could not be sent (the client left?)");
    }
}

/// Decode a request, following a `stored` request to its blob once (a scoped client's
/// own upload only: another tenant's stored request is not its to send).
async fn decode_request(
    handle: &CoordinatorHandle,
    caller: &Caller,
    bus: &dyn Bus,
    payload: &[u8],
) -> Result<ApiRequest, ApiError> {
    match wire::decode::<ApiRequest>(payload).map_err(malformed)? {
        ApiRequest::Stored { blob } => {
            if !handle
                .may_read_blob(caller, blob)
                .await
                .map_err(ApiError::from)?
            {
                return Err(ApiError::new(
                    ApiErrorKind::BadInput,
                    format!("stored request {blob}: {}", BlobError::Missing(blob)),
                ));
            }
            let bytes = forkfleet_shared::blob::fetch(bus.blobs().as_ref(), &blob)
                .await
                .map_err(|e| {
                    ApiError::new(
                        ApiErrorKind::BadInput,
                        format!("stored request {blob}: {e}"),
                    )
                })?;
            match wire::decode::<ApiRequest>(&bytes).map_err(malformed)? {
                ApiRequest::Stored { .. } => Err(ApiError::new(
                    ApiErrorKind::BadInput,
                    "a stored request cannot name another stored request",
                )),
                req => Ok(req),
            }
        }
        req => Ok(req),
    }
}

fn malformed(e: WireError) -> ApiError {
    let message = match &e {
        WireError::Version { .. } => format!(
            "{e}; upgrade the client or the coordinator so both speak wire version {WIRE_VERSION}"
        ),
        // A decoder's message may quote what it could not read.
        _ => format!(
            "malformed API request: {}",
            forkfleet_shared::api::limits::truncated_to(&e.to_string(), 300)
        ),
    };
    ApiError::new(ApiErrorKind::BadInput, message)
}

/// Encode a response; one too large for a message goes to the blob store (owned by a
/// scoped caller, who reads it through the coordinator).
async fn encode_response(
    handle: &CoordinatorHandle,
    caller: &Caller,
    bus: &dyn Bus,
    response: &ApiResponse,
) -> Bytes {
    let bytes = match wire::encode(response) {
        Ok(b) => b,
        Err(e) => {
            tracing::error!(error = %e, "api.reply cannot be encoded");
            return encode_error(ApiError::new(
                ApiErrorKind::Failure,
                format!("the reply cannot be encoded: {e}"),
            ));
        }
    };
    if bytes.len() <= MAX_INLINE_BYTES {
        return bytes;
    }
    let blob = BlobHash::of(&bytes);
    let size = bytes.len() as u64;
    if let Err(e) = bus.blobs().put(blob, bytes).await {
        tracing::error!(error = %e, bytes = size, "api.reply too large and cannot be stored");
        return encode_error(ApiError::new(
            ApiErrorKind::Failure,
            format!("the reply ({size} bytes) is too large for one message and could not be stored: {e}"),
        ));
    }
    if let Some(identity) = caller.identity().map(str::to_string) {
        if let Err(e) = handle
            .blocking(move |s| s.own_blobs(&identity, [blob]))
            .await
        {
            tracing::error!(error = %e, "api.reply stored, but its owner could not be recorded");
        }
    }
    tracing::debug!(bytes = size, blob = %blob.short(), "api.reply stored as a blob");
    encode_error_or(ApiResponse::Ok(Box::new(ApiReply::Stored {
        blob,
        bytes: size,
    })))
}

fn encode_error(e: ApiError) -> Bytes {
    encode_error_or(ApiResponse::Err(e))
}

/// Encode a small response; it cannot realistically fail, but if it does the client
/// gets an empty reply (which it reports as malformed) rather than nothing.
fn encode_error_or(response: ApiResponse) -> Bytes {
    wire::encode(&response).unwrap_or_else(|e| {
        tracing::error!(error = %e, "api.reply cannot be encoded");
        Bytes::new()
    })
}

/// The API error a coordinator error becomes: its [`CoordinatorError::kind`] and message.
pub fn api_error(e: &CoordinatorError) -> ApiError {
    ApiError::new(e.kind(), e.to_string())
}

impl From<CoordinatorError> for ApiError {
    fn from(e: CoordinatorError) -> Self {
        api_error(&e)
    }
}
