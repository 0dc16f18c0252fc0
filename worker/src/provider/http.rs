//! What the real providers share: the HTTP client, the API key, retries and errors.
//!
//! - **Client.** One [`reqwest::Client`] per worker ([`client`]), rustls only, redirects
//!   never followed (a redirect would take the key to a URL the catalogue did not name),
//!   shared by every provider (its connection pool too). A provider is cheap to build: settings and a clone
//!   of the client.
//! - **Providers.** [`HttpProvider`] is every real provider: the settings of one (model,
//!   endpoint) ([`Api`]) and a [`Dialect`], which writes the API's request body and reads its
//!   answer (`openai::OpenAi`, `anthropic::Anthropic`). Everything else is here.
//! - **Key.** Only a model of the worker's catalogue has one (ADR 16): the route
//!   ([`ModelRoute`], resolved from the catalogue by [`super::Providers`]) says where it is,
//!   the environment variable (`api_key_env`) or the file (`api_key_file`, trimmed) of the
//!   catalogue entry. It is read once per call, not per try (so a rotated secret file is
//!   picked up), and required when the route names it. A route with no key (a catalogue
//!   entry for a local server such as llama.cpp, vLLM or Ollama, or a spec's own `base_url`
//!   on an allowed host) sends no key header; one that points at the vendor's own API is
//!   refused before any request.
//!   The key never shows itself in `Debug`, header values carrying it are marked sensitive,
//!   and every text taken from an answer is redacted of it before it reaches an error or a
//!   log.
//! - **Retries.** One call is at most `max_retries + 1` HTTP requests (default 3 retries),
//!   each bounded by `timeout_s` (default 120 s: a whole answer as a whole; a stream up to
//!   its headers, then each chunk within `timeout_s` of the one before);
//!   the body and the headers are built once per call. Answers 408, 429 (except
//!   `insufficient_quota`) and 5xx, and requests that got no answer (connection refused or
//!   reset, timeout) are retried: after the answer's `retry-after-ms` or `retry-after`
//!   (seconds or an HTTP date, at most 60 s) when it has one, else after a full-jitter
//!   exponential backoff (a random wait up to `base * 2^(retry - 1)`, at most `cap`). Other
//!   answers are final.
//! - **Cancellation.** A call is one future: dropping it (a terminated branch) drops the
//!   request in flight, which closes its connection, or the backoff sleep.
//! - **Errors.** A final answer becomes a [`WorkerError`] that says what is wrong: the key
//!   (401, 403), the model (404, or a body saying the model is not found), the context
//!   window (`context_length_exceeded`, "maximum context length", "prompt is too long",
//!   ...), or else the status with the API's own message, truncated.
//! - **Streaming.** On by default (the spec's `stream = false` turns it off): the request
//!   asks for server-sent events and the dialect's [`StreamState`] assembles the answer from
//!   them (text, tool calls, reasoning, usage from the last events) into the body a
//!   non-streamed call would have had, read as one. An answer that comes back as plain JSON
//!   (a server that ignores `stream`) is read as such. An answer is finished only when the
//!   provider said so ([`StreamState::finished`]): a stream that ends without it is an
//!   error. A stream that fails before any of its answer arrived is tried again (within the
//!   same tries); after, the failure is final and the caller's meter holds what streamed
//!   (ADR 35). With a [`super::SpendCap`], the running
//!   cost (the input as the stream reported it, else estimated from sizes, plus the output
//!   so far at four characters a token) is checked at every event: past the cap, the
//!   stream is closed and the partial text comes back marked [`super::BUDGET_CUT`], its
//!   usage estimated.
//! - **Prompt cache.** A call whose answer reports cache reads or writes confirms that
//!   many tokens of its prefix cached; for four minutes (Anthropic's cache lives five,
//!   refreshed by every read) the call's [`ModelProvider::estimate`] counts them as cached,
//!   and every other input token as a cache write when the dialect writes at a surcharge
//!   (ADR 26).
//! - **Tracing.** A debug event per attempt (provider, model, attempt, status, latency), a
//!   warning per retry; never the key, never a body.

use super::sse::SseParser;
use super::{
    estimate_tokens, request_tokens, size_estimate, upper_bound_estimate, ModelProvider,
    ModelReply, ModelRequest, BUDGET_CUT, OUTPUT_CAP_CUT, RESERVATION_CUT,
};
use crate::error::WorkerError;
use async_trait::async_trait;
use bytes::Bytes;
use forkfleet_shared::catalogue::{KeySource, ModelRoute};
use forkfleet_shared::endpoint::{Endpoint, TokenParam, ToolChoice};
use forkfleet_shared::event::{ToolCall, Usage};
use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use reqwest::StatusCode;
use std::fmt;
use std::future::Future;
use std::marker::PhantomData;
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime};

/// Seconds one HTTP request may take when the endpoint does not say.
const DEFAULT_TIMEOUT_S: f64 = 120.0;
/// Retries of one call when the endpoint does not say.
const DEFAULT_MAX_RETRIES: u32 = 3;
/// The largest server-sent event a stream may carry (a Responses API `response.completed`
/// holds the whole answer; a delta is a few bytes): past it the call fails, rather than
/// hold an endless line in memory.
const MAX_EVENT_BYTES: usize = 8 << 20;
/// Characters of an API's error message kept in an error.
const MAX_MESSAGE_CHARS: usize = 500;

/// The worker's HTTP client for model APIs (build one and share it).
pub fn client() -> Result<reqwest::Client, WorkerError> {
    reqwest::Client::builder()
        .user_agent(concat!("forkfleet/", env!("CARGO_PKG_VERSION")))
        // A redirect would carry the key (`x-api-key` is not stripped on a change of host)
        // to a URL the catalogue never named: a model API is never followed elsewhere.
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .map_err(|e| WorkerError::Client(error_chain(&e)))
}

/// One vendor's API: its name, defaults and fixed headers.
#[derive(Debug)]
pub struct Vendor {
    /// The provider's prefix in model names (`openai`).
    pub provider: &'static str,
    pub default_base_url: &'static str,
    /// The vendor's own API host: a route to it without a key is an error.
    pub host: &'static str,
    /// Where a call is posted, after the base URL (`/chat/completions`).
    pub path: &'static str,
    /// The header carrying the key (lowercase), and what precedes the key in it.
    pub key_header: &'static str,
    pub key_prefix: &'static str,
    /// Headers (lowercase names) every request carries besides the content type and the key.
    pub headers: &'static [(&'static str, &'static str)],
}

/// How a model's calls are made: the spec's settings of the model
/// ([`Endpoint`]) besides where it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallSettings {
    /// Stream answers (default true).
    pub stream: bool,
    /// Use the prompt cache (default true).
    pub cache: bool,
    /// OpenAI's `reasoning_effort`.
    pub reasoning_effort: Option<String>,
    /// OpenAI chat's output cap field (`None`: by the base URL, see [`Api::token_param`]).
    pub token_param: Option<TokenParam>,
    /// OpenAI's `tool_choice`, sent with tools.
    pub tool_choice: Option<ToolChoice>,
    /// Anthropic's extended thinking budget.
    pub thinking_budget: Option<u32>,
}

impl Default for CallSettings {
    fn default() -> Self {
        Self::of(None)
    }
}

impl CallSettings {
    /// The settings a spec's model section gives (`None`: the defaults).
    pub fn of(endpoint: Option<&Endpoint>) -> Self {
        let e = endpoint.cloned().unwrap_or_default();
        Self {
            stream: e.streams(),
            cache: e.caches(),
            reasoning_effort: e.reasoning_effort,
            token_param: e.token_param,
            tool_choice: e.tool_choice,
            thinking_budget: e.thinking_budget,
        }
    }
}

/// One API's wire format: the request body it wants and how its answer is read.
pub trait Dialect: Send + Sync + 'static {
    const VENDOR: &'static Vendor;
    /// Cache writes cost more than fresh input (Anthropic's 1.25x): the estimate of a
    /// call counts its uncached input as written.
    const CACHE_WRITE_SURCHARGE: bool = false;
    /// Reads a streamed answer.
    type Stream: StreamState;
    /// The JSON request body of `req` for the API's model (`api.name()`).
    fn body(api: &Api, req: &ModelRequest<'_>) -> serde_json::Result<Vec<u8>>;
    /// The reply in a success answer's body.
    fn reply(api: &Api, body: &[u8], req: &ModelRequest<'_>) -> Result<ModelReply, WorkerError>;
    /// Output tokens a call may spend beyond `max_output_tokens` (Anthropic's thinking
    /// budget).
    fn extra_output_tokens(_api: &Api) -> u64 {
        0
    }
}

/// A streamed answer being read: its events folded into the body a non-streamed answer
/// would have had.
pub trait StreamState: Default + Send {
    /// One event (its `event:` name, empty when none, and its data). An error event is an
    /// `Err` with the API's message.
    fn event(&mut self, name: &str, data: &str) -> Result<(), String>;
    /// Characters of output streamed so far (text, tool arguments, reasoning).
    fn output_chars(&self) -> u64;
    /// The input usage the stream reported so far (Anthropic says it first).
    fn input_usage(&self) -> Option<Usage>;
    /// The answer as the API's non-streamed body.
    fn body(&self) -> serde_json::Value;
    /// The text streamed so far (`None`: none).
    fn text(&self) -> Option<String>;
    /// The provider said the answer is complete: its finish reason or its final event
    /// (OpenAI's `[DONE]` is seen by the reader itself). A stream that ends without it was
    /// cut short, whatever it carried.
    fn finished(&self) -> bool;
}

/// How a streamed answer went wrong.
enum StreamFailure {
    /// Before any of the answer arrived (an error event first, a stream that ended or
    /// broke empty): the call is tried again, as an HTTP error would be.
    Empty(WorkerError),
    /// After some of it arrived: the call failed; what streamed was generated, and billed.
    Partial(WorkerError),
}

/// A real model provider: a [`Dialect`] spoken over HTTP with the settings of one (model,
/// route).
pub struct HttpProvider<D> {
    api: Api,
    /// Tokens of the prompt the API last said it read from or wrote to its cache, and
    /// when.
    confirmed: Mutex<Option<(u64, Instant)>>,
    dialect: PhantomData<fn() -> D>,
}

/// How long a confirmed cached prefix is counted on: Anthropic keeps a cache entry five
/// minutes after its last use.
const CONFIRMED_CACHE_TTL: Duration = Duration::from_secs(240);

impl<D> fmt::Debug for HttpProvider<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HttpProvider")
            .field("api", &self.api)
            .finish()
    }
}

impl<D: Dialect> HttpProvider<D> {
    /// `model` is `provider:NAME`; `route` where and how it is called (resolved from the
    /// worker's catalogue, [`forkfleet_shared::catalogue::ModelCatalogue::route`]).
    pub fn new(
        model: &str,
        route: &ModelRoute,
        client: reqwest::Client,
    ) -> Result<Self, WorkerError> {
        Ok(Self {
            api: Api::new(D::VENDOR, model, route, client)?,
            confirmed: Mutex::new(None),
            dialect: PhantomData,
        })
    }

    /// The same provider waiting `backoff` between tries (tests shorten it).
    pub fn with_backoff(mut self, backoff: Backoff) -> Self {
        self.api.backoff = backoff;
        self
    }

    /// The same provider with the spec's call settings (the defaults otherwise).
    pub fn with_settings(mut self, settings: CallSettings) -> Self {
        self.api.settings = settings;
        self
    }

    /// Tokens of the prompt confirmed cached by a recent answer.
    fn confirmed_cached(&self) -> u64 {
        let confirmed = self.confirmed.lock().map(|c| *c).unwrap_or(None);
        match confirmed {
            Some((tokens, at)) if at.elapsed() < CONFIRMED_CACHE_TTL => tokens,
            _ => 0,
        }
    }

    /// Note what `usage` says is cached now.
    fn confirm(&self, usage: &Usage) {
        let tokens = usage.cached_tokens + usage.cache_write_tokens;
        if tokens > 0 {
            if let Ok(mut c) = self.confirmed.lock() {
                *c = Some((tokens, Instant::now()));
            }
        }
    }

    /// Read a streamed answer (see the module docs): each chunk within the call's
    /// `timeout_s` of the one before (an idle bound: a long healthy stream is never cut),
    /// finished only when the provider said so.
    async fn read_stream(
        &self,
        mut resp: reqwest::Response,
        req: &ModelRequest<'_>,
    ) -> Result<ModelReply, StreamFailure> {
        let mut parser = SseParser::default();
        let mut state = D::Stream::default();
        let api = &self.api;
        let mut done = false;
        let output_bound = (u64::from(req.max_output_tokens) + D::extra_output_tokens(api))
            .saturating_mul(2)
            .saturating_add(256);
        // Nothing of the answer yet: a failure now is tried again.
        let fail = |state: &D::Stream, e: WorkerError| {
            if state.output_chars() == 0 {
                StreamFailure::Empty(e)
            } else {
                StreamFailure::Partial(e)
            }
        };
        loop {
            let chunk = match tokio::time::timeout(api.timeout, resp.chunk()).await {
                Ok(Ok(chunk)) => chunk,
                Ok(Err(e)) => {
                    let e =
                        api.bad_response(format!("the answer's stream broke: {}", error_chain(&e)));
                    return Err(fail(&state, e));
                }
                Err(_) => {
                    let e = api.bad_response(format!(
                        "the answer's stream stalled: nothing for {} s (timeout_s bounds the wait between chunks)",
                        api.timeout.as_secs_f64()
                    ));
                    return Err(fail(&state, e));
                }
            };
            let Some(chunk) = chunk else { break };
            let events = parser.push(&chunk);
            if parser.pending_bytes() > MAX_EVENT_BYTES
                || events.iter().any(|e| e.data.len() > MAX_EVENT_BYTES)
            {
                let e = api.bad_response(format!(
                    "the answer's stream sent an event of more than {} MiB",
                    MAX_EVENT_BYTES >> 20
                ));
                // Final: a server that sends one will send it again.
                return Err(StreamFailure::Partial(e));
            }
            for ev in events {
                if ev.data.trim() == "[DONE]" {
                    done = true;
                    continue;
                }
                if let Err(message) = state.event(&ev.name, &ev.data) {
                    return Err(fail(&state, api.stream_error(&message)));
                }
                if let Some(meter) = req.meter {
                    meter.set(running_usage(&state, req));
                    if state.output_chars() > 0 {
                        meter.mark_generated();
                    }
                }
                // A provider that ignores `max_output_tokens` is stopped at twice it, budget
                // or not (a spend cap below usually stops it first).
                let output = estimate_tokens(state.output_chars());
                if output > output_bound {
                    drop(resp);
                    tracing::warn!(
                        model = %api.model,
                        output_tokens = output,
                        max_output_tokens = req.max_output_tokens,
                        "the answer was cut mid-stream: the provider streamed far past max_output_tokens"
                    );
                    let mut reply = self.cut(&state, running_usage(&state, req), false);
                    reply.finish_reason = Some(OUTPUT_CAP_CUT.to_string());
                    return Ok(reply);
                }
                let Some(cap) = req.spend_cap else { continue };
                let usage = running_usage(&state, req);
                if cap.price.cost(&usage) > cap.remaining_usd {
                    drop(resp);
                    tracing::info!(
                        model = %api.model,
                        output_tokens = usage.output_tokens,
                        remaining_usd = cap.remaining_usd,
                        "the answer was cut mid-stream: its running cost passed what the call may spend"
                    );
                    return Ok(self.cut(&state, usage, cap.reservation));
                }
            }
        }
        if let Some(ev) = parser.finish() {
            if ev.data.trim() == "[DONE]" {
                done = true;
            } else if let Err(message) = state.event(&ev.name, &ev.data) {
                return Err(fail(&state, api.stream_error(&message)));
            }
        }
        if !done && !state.finished() {
            let e = api.bad_response(format!(
                "the answer's stream ended before the provider said the answer was finished (no finish reason or final event; {} characters received)",
                state.output_chars()
            ));
            return Err(fail(&state, e));
        }
        let body = serde_json::to_vec(&state.body()).map_err(|e| {
            StreamFailure::Partial(
                api.bad_response(format!("cannot read the streamed answer: {e}")),
            )
        })?;
        D::reply(api, &body, req).map_err(StreamFailure::Partial)
    }

    /// A streamed call: sent (HTTP errors retried by [`Api::send`]) and read; a stream that
    /// failed before any of its answer arrived is tried again, within the same number of
    /// tries.
    async fn complete_streamed(
        &self,
        body: Bytes,
        messages: usize,
        req: &ModelRequest<'_>,
    ) -> Result<ModelReply, WorkerError> {
        let tries = self.api.max_retries.saturating_add(1);
        let mut attempt = 1;
        loop {
            let resp = self.api.send(body.clone(), messages, stream_start).await?;
            if !is_event_stream(resp.headers()) {
                // A server that ignored `stream`: its answer is the plain body.
                let answer = tokio::time::timeout(self.api.timeout, resp.bytes())
                    .await
                    .map_err(|_| {
                        self.api.bad_response(format!(
                            "no whole answer within {} s (timeout_s)",
                            self.api.timeout.as_secs_f64()
                        ))
                    })?
                    .map_err(|e| {
                        self.api
                            .bad_response(format!("cannot read the answer: {}", error_chain(&e)))
                    })?;
                return D::reply(&self.api, &answer, req);
            }
            match self.read_stream(resp, req).await {
                Ok(reply) => return Ok(reply),
                Err(StreamFailure::Partial(e)) => return Err(e),
                Err(StreamFailure::Empty(e)) if attempt < tries => {
                    let wait = self.api.backoff.jittered(attempt);
                    tracing::warn!(
                        provider = self.api.vendor.provider,
                        model = %self.api.model,
                        attempt,
                        wait_ms = wait.as_millis() as u64,
                        last = %e,
                        "model api stream failed before any answer; retrying"
                    );
                    tokio::time::sleep(wait).await;
                    attempt += 1;
                }
                Err(StreamFailure::Empty(e)) => return Err(e),
            }
        }
    }

    /// The partial answer of a stream cut by its spend cap: its text so far (tool calls
    /// in progress are dropped), marked [`BUDGET_CUT`], with `usage` (estimated).
    fn cut(&self, state: &D::Stream, usage: Usage, reservation: bool) -> ModelReply {
        ModelReply {
            text: state.text(),
            tool_calls: Vec::new(),
            usage,
            response_model: None,
            finish_reason: Some(
                if reservation {
                    RESERVATION_CUT
                } else {
                    BUDGET_CUT
                }
                .to_string(),
            ),
            reasoning: None,
        }
    }
}

/// The usage of a stream so far: its input as reported (else estimated from the request's
/// size, [`request_tokens`]), its output at four characters a token.
fn running_usage<S: StreamState>(state: &S, req: &ModelRequest<'_>) -> Usage {
    let output = estimate_tokens(state.output_chars());
    match state.input_usage() {
        Some(input) => Usage {
            output_tokens: output,
            ..input
        },
        None => Usage::tokens(request_tokens(req), output),
    }
}

#[async_trait]
impl<D: Dialect> ModelProvider for HttpProvider<D> {
    fn server_address(&self) -> Option<(&str, u16)> {
        Some((self.api.server.0.as_str(), self.api.server.1))
    }

    async fn complete(&self, req: &ModelRequest<'_>) -> Result<ModelReply, WorkerError> {
        let body = D::body(&self.api, req).map_err(|e| {
            self.api
                .bad_response(format!("cannot encode the request: {e}"))
        })?;
        let messages = req.messages.len();
        // From here the API may read the input, which it bills even if the call is
        // cancelled before any answer: a caller that cancels counts it (estimated).
        if let Some(meter) = req.meter {
            meter.set(running_usage(&D::Stream::default(), req));
        }
        let mut reply = if self.api.settings.stream {
            self.complete_streamed(body.into(), messages, req).await?
        } else {
            let answer = self.api.send(body.into(), messages, whole_body).await?;
            D::reply(&self.api, &answer, req)?
        };
        // No input at all for a request of messages is no count a provider bills: a cap
        // must not read it as free. Estimated from sizes instead (a larger output reported
        // is kept).
        if reply.usage.input_tokens == 0 && !req.messages.is_empty() {
            tracing::warn!(
                provider = self.api.vendor.provider,
                model = %self.api.model,
                reported_output_tokens = reply.usage.output_tokens,
                "the API reported 0 input tokens for a request of messages; tokens are estimated from sizes"
            );
            let estimated = Usage::tokens(
                upper_bound_estimate(req).input_tokens,
                size_estimate(req.messages, reply.text.as_deref(), &reply.tool_calls).output_tokens,
            );
            reply.usage = Usage {
                output_tokens: estimated.output_tokens.max(reply.usage.output_tokens),
                ..estimated
            };
        }
        if self.api.settings.cache {
            self.confirm(&reply.usage);
        }
        Ok(reply)
    }

    fn caches_prompts(&self) -> bool {
        self.api.settings.cache
    }

    /// [`upper_bound_estimate`], plus the thinking budget; with the prompt cache on, the
    /// prefix a recent answer confirmed cached counts as cached and, where writes cost
    /// more, the rest as written (ADR 26).
    fn estimate(&self, req: &ModelRequest<'_>) -> Usage {
        let mut usage = upper_bound_estimate(req);
        usage.output_tokens += D::extra_output_tokens(&self.api);
        if self.api.settings.cache {
            usage.cached_tokens = self.confirmed_cached().min(usage.input_tokens);
            if D::CACHE_WRITE_SURCHARGE {
                usage.cache_write_tokens = usage.input_tokens - usage.cached_tokens;
            }
        }
        usage
    }
}

/// A successful streamed answer: its response, the body unread.
fn stream_start(
    resp: reqwest::Response,
) -> std::future::Ready<Result<reqwest::Response, reqwest::Error>> {
    std::future::ready(Ok(resp))
}

/// A successful answer's whole body.
fn whole_body(resp: reqwest::Response) -> impl Future<Output = Result<Bytes, reqwest::Error>> {
    resp.bytes()
}

/// True when the answer is `text/event-stream`.
fn is_event_stream(headers: &HeaderMap) -> bool {
    headers
        .get(reqwest::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.to_ascii_lowercase().starts_with("text/event-stream"))
}

/// An API key. `Debug` never shows it.
#[derive(Clone, PartialEq, Eq)]
struct ApiKey(String);

impl ApiKey {
    /// A header value carrying `prefix` and the key, marked sensitive (never printed).
    fn header(&self, prefix: &str) -> Option<HeaderValue> {
        let mut v = HeaderValue::from_str(&format!("{prefix}{}", self.0)).ok()?;
        v.set_sensitive(true);
        Some(v)
    }
}

impl fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ApiKey(<redacted>)")
    }
}

/// Backoff between tries (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    /// The first backoff's bound; doubled for each further retry.
    pub base: Duration,
    /// The most one backoff may be.
    pub cap: Duration,
    /// The most a `retry-after` is waited.
    pub max_retry_after: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Self {
            base: Duration::from_millis(500),
            cap: Duration::from_secs(30),
            max_retry_after: Duration::from_secs(60),
        }
    }
}

impl Backoff {
    /// The wait before retry `retry` (1 for the first): a random duration up to
    /// `base * 2^(retry - 1)`, at most `cap` (full jitter).
    fn jittered(&self, retry: u32) -> Duration {
        let exp = retry.saturating_sub(1).min(20);
        let bound = self.base.saturating_mul(1u32 << exp).min(self.cap);
        random_up_to(bound)
    }
}

/// A random duration in `[0, bound]`.
fn random_up_to(bound: Duration) -> Duration {
    use std::hash::{BuildHasher, Hasher};
    let nanos = u64::try_from(bound.as_nanos()).unwrap_or(u64::MAX);
    if nanos == 0 {
        return Duration::ZERO;
    }
    // Every `RandomState` has fresh keys, so the hash of nothing is a fresh random number.
    let r = std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish();
    Duration::from_nanos(r % nanos.saturating_add(1))
}

/// A model API reached over HTTP: the settings every call of one (model, endpoint) uses.
pub struct Api {
    vendor: &'static Vendor,
    /// `provider:name`.
    model: String,
    /// The name sent as the API's `model`.
    name: String,
    /// Without a trailing `/`.
    base_url: String,
    /// `{base_url}{vendor.path}`.
    url: String,
    /// Where the key is read; `None`: no key is sent.
    key_source: Option<KeySource>,
    /// What every request carries but the key (built once).
    headers: HeaderMap,
    key_header: HeaderName,
    timeout: Duration,
    max_retries: u32,
    backoff: Backoff,
    client: reqwest::Client,
    /// How calls are made (the spec's settings).
    settings: CallSettings,
    /// The base URL is the vendor's own API (not a compatible server).
    vendor_api: bool,
    /// The base URL's host and port (the scheme's default when none is written).
    server: (String, u16),
}

impl fmt::Debug for Api {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Api")
            .field("model", &self.model)
            .field("base_url", &self.base_url)
            .field("key_source", &self.key_source)
            .field("timeout", &self.timeout)
            .field("max_retries", &self.max_retries)
            .finish_non_exhaustive()
    }
}

impl Api {
    /// The settings of `model` (`provider:name`) along `route`.
    fn new(
        vendor: &'static Vendor,
        model: &str,
        route: &ModelRoute,
        client: reqwest::Client,
    ) -> Result<Self, WorkerError> {
        let bad = |detail: String| WorkerError::BadEndpoint {
            model: model.to_string(),
            detail,
        };
        let (_, name) = super::split_model(model)?;
        let name = route.model.as_deref().unwrap_or(name);
        let base_url = route
            .base_url
            .as_deref()
            .unwrap_or(vendor.default_base_url)
            .trim_end_matches('/')
            .to_string();
        let parsed = reqwest::Url::parse(&base_url)
            .map_err(|e| bad(format!("base_url `{base_url}` is not a URL: {e}")))?;
        let vendor_host = parsed
            .host_str()
            .is_some_and(|h| h.eq_ignore_ascii_case(vendor.host));
        if vendor_host && route.key.is_none() {
            return Err(WorkerError::MissingKey {
                model: model.to_string(),
                detail: format!(
                    "{base_url} is the vendor's own API, which needs a key; define the model in the worker's config `[models.\"{model}\"]` with api_key_env or api_key_file"
                ),
            });
        }
        let timeout_s = route.timeout_s.unwrap_or(DEFAULT_TIMEOUT_S);
        let timeout = Duration::try_from_secs_f64(timeout_s)
            .map_err(|_| bad(format!("timeout_s {timeout_s} is not a duration")))?;
        let mut headers = HeaderMap::new();
        headers.insert(
            reqwest::header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        for (name, value) in vendor.headers {
            headers.insert(
                HeaderName::from_static(name),
                HeaderValue::from_static(value),
            );
        }
        Ok(Self {
            vendor,
            model: model.to_string(),
            name: name.to_string(),
            url: format!("{base_url}{}", vendor.path),
            base_url,
            key_source: route.key.clone(),
            headers,
            key_header: HeaderName::from_static(vendor.key_header),
            timeout,
            max_retries: route.max_retries.unwrap_or(DEFAULT_MAX_RETRIES),
            backoff: Backoff::default(),
            client,
            settings: CallSettings::default(),
            vendor_api: vendor_host,
            server: (
                parsed.host_str().unwrap_or_default().to_string(),
                parsed.port_or_known_default().unwrap_or(0),
            ),
        })
    }

    /// `provider:name`.
    pub(super) fn model(&self) -> &str {
        &self.model
    }

    /// The name sent as the API's `model`.
    pub(super) fn name(&self) -> &str {
        &self.name
    }

    /// How calls are made.
    pub(super) fn settings(&self) -> &CallSettings {
        &self.settings
    }

    /// The field carrying an OpenAI chat call's output cap: the setting, else
    /// `max_completion_tokens` for OpenAI's own API (its reasoning models refuse
    /// `max_tokens`) and `max_tokens` for any other server (llama.cpp, vLLM, Ollama,
    /// OpenRouter read it).
    pub(super) fn token_param(&self) -> TokenParam {
        self.settings.token_param.unwrap_or(if self.vendor_api {
            TokenParam::MaxCompletionTokens
        } else {
            TokenParam::MaxTokens
        })
    }

    /// An error event in an answer's stream.
    fn stream_error(&self, message: &str) -> WorkerError {
        WorkerError::Api {
            model: self.model.clone(),
            status: 200,
            message: format!(
                "the answer's stream reported an error: {}",
                truncate(message, MAX_MESSAGE_CHARS)
            ),
        }
    }

    /// Read the key (see the module docs). `None`: no key, and none is required.
    fn load_key(&self) -> Result<Option<ApiKey>, WorkerError> {
        let missing = |detail: String| WorkerError::MissingKey {
            model: self.model.clone(),
            detail,
        };
        match &self.key_source {
            None => Ok(None),
            Some(KeySource::File(path)) => {
                let text = std::fs::read_to_string(path).map_err(|e| {
                    missing(format!(
                        "cannot read the key file `{}`: {e}",
                        path.display()
                    ))
                })?;
                let key = text.trim();
                if key.is_empty() {
                    return Err(missing(format!(
                        "the key file `{}` is empty",
                        path.display()
                    )));
                }
                Ok(Some(ApiKey(key.to_string())))
            }
            Some(KeySource::Env(name)) => {
                let value = std::env::var(name).unwrap_or_default();
                let key = value.trim();
                if key.is_empty() {
                    return Err(missing(format!(
                        "the environment variable `{name}` is not set (or empty) on the worker; \
                         set it, or name another in the catalogue entry (api_key_env or api_key_file)"
                    )));
                }
                Ok(Some(ApiKey(key.to_string())))
            }
        }
    }

    /// The headers of one call: the fixed ones and the key (read now), if any.
    fn call_headers(&self) -> Result<(HeaderMap, Option<ApiKey>), WorkerError> {
        let key = self.load_key()?;
        let mut headers = self.headers.clone();
        if let (Some(k), Some(source)) = (&key, &self.key_source) {
            let value =
                k.header(self.vendor.key_prefix)
                    .ok_or_else(|| WorkerError::MissingKey {
                        model: self.model.clone(),
                        detail: format!("the key from {source} is not a valid header value"),
                    })?;
            headers.insert(self.key_header.clone(), value);
        }
        Ok((headers, key))
    }

    /// POST `body` (JSON) to the vendor's path, with the key read once for the call and
    /// retrying as the module docs say; `success` reads a success answer (its whole body,
    /// or only its start for a stream: an error there counts as no answer and is retried).
    /// `messages` is the request's message count (for a context overflow error).
    async fn send<T, F, Fut>(
        &self,
        body: Bytes,
        messages: usize,
        success: F,
    ) -> Result<T, WorkerError>
    where
        F: Fn(reqwest::Response) -> Fut,
        Fut: Future<Output = Result<T, reqwest::Error>>,
    {
        let (headers, key) = self.call_headers()?;
        let key = key.as_ref();
        let tries = self.max_retries.saturating_add(1);
        let mut last = String::new();
        let mut last_status = None;
        for attempt in 1..=tries {
            let started = Instant::now();
            let request = self
                .client
                .post(&self.url)
                .headers(headers.clone())
                .body(body.clone());
            // A whole answer is bounded by `timeout_s` as a whole; a stream only up to its
            // status and headers (its chunks each by the same bound, `read_stream`).
            let request = if self.settings.stream {
                request
            } else {
                request.timeout(self.timeout)
            };
            let Ok(sent) = tokio::time::timeout(self.timeout, request.send()).await else {
                last = format!(
                    "no answer within {} s (timeout_s)",
                    self.timeout.as_secs_f64()
                );
                last_status = None;
                tracing::debug!(
                    provider = self.vendor.provider,
                    model = %self.model,
                    attempt,
                    error = %last,
                    "model api attempt got no answer"
                );
                if attempt < tries {
                    tokio::time::sleep(self.backoff.jittered(attempt)).await;
                }
                continue;
            };
            let answer = match sent {
                Ok(resp) if resp.status().is_success() => {
                    success(resp).await.map(|done| Ok((StatusCode::OK, done)))
                }
                Ok(resp) => {
                    let status = resp.status();
                    let wait = retry_after(resp.headers(), SystemTime::now());
                    resp.bytes().await.map(|b| Err((status, wait, b)))
                }
                Err(e) => Err(e),
            };
            let latency_ms = started.elapsed().as_millis() as u64;
            let wait = match answer {
                Ok(Ok((status, done))) => {
                    tracing::debug!(
                        provider = self.vendor.provider,
                        model = %self.model,
                        attempt,
                        status = status.as_u16(),
                        latency_ms,
                        "model api attempt"
                    );
                    return Ok(done);
                }
                Ok(Err((status, retry_after, bytes))) => {
                    tracing::debug!(
                        provider = self.vendor.provider,
                        model = %self.model,
                        attempt,
                        status = status.as_u16(),
                        latency_ms,
                        "model api attempt"
                    );
                    let text = redact(&String::from_utf8_lossy(&bytes), key);
                    if !retryable(status, &text) {
                        return Err(self.failure(status, &text, key.is_some(), messages));
                    }
                    last = format!("HTTP {}: {}", status.as_u16(), api_message(&text));
                    last_status = Some(status.as_u16());
                    retry_after.map(|w| w.min(self.backoff.max_retry_after))
                }
                Err(e) => {
                    let what = redact(&self.no_answer(&e), key);
                    tracing::debug!(
                        provider = self.vendor.provider,
                        model = %self.model,
                        attempt,
                        latency_ms,
                        error = %what,
                        "model api attempt got no answer"
                    );
                    if e.is_builder() {
                        return Err(WorkerError::BadEndpoint {
                            model: self.model.clone(),
                            detail: what,
                        });
                    }
                    last = what;
                    last_status = None;
                    None
                }
            };
            if attempt < tries {
                let wait = wait.unwrap_or_else(|| self.backoff.jittered(attempt));
                tracing::warn!(
                    provider = self.vendor.provider,
                    model = %self.model,
                    attempt,
                    wait_ms = wait.as_millis() as u64,
                    last = %last,
                    "model api call failed; retrying"
                );
                tokio::time::sleep(wait).await;
            }
        }
        Err(WorkerError::RetriesExhausted {
            model: self.model.clone(),
            base_url: self.base_url.clone(),
            tries,
            last,
            last_status,
        })
    }

    /// What a request that got no answer ran into.
    fn no_answer(&self, e: &reqwest::Error) -> String {
        if e.is_timeout() {
            format!(
                "no answer within {} s (timeout_s)",
                self.timeout.as_secs_f64()
            )
        } else if e.is_connect() {
            format!("cannot connect to {}: {}", self.base_url, error_chain(e))
        } else {
            error_chain(e)
        }
    }

    /// The error of a final (not retried) answer; `text` is its body, redacted.
    fn failure(
        &self,
        status: StatusCode,
        text: &str,
        sent_key: bool,
        messages: usize,
    ) -> WorkerError {
        let lower = text.to_ascii_lowercase();
        let message = api_message(text);
        let code = status.as_u16();
        if matches!(code, 400 | 413 | 422) && is_context_overflow(&lower) {
            return WorkerError::ContextOverflow {
                model: self.model.clone(),
                messages,
                status: code,
                message,
            };
        }
        if matches!(code, 401 | 403) {
            let key = match (&self.key_source, sent_key) {
                (Some(source), true) => format!("the key from {source}"),
                _ => "the request: no key was sent (the model has none: only a model of the \
                      worker's catalogue with api_key_env or api_key_file has a key)"
                    .to_string(),
            };
            return WorkerError::BadKey {
                model: self.model.clone(),
                base_url: self.base_url.clone(),
                key,
                status: code,
                message,
            };
        }
        // A 404 names the model unless it says an item of the request was not found (a
        // Responses API reasoning item that is neither stored nor encrypted).
        let item_not_found = lower.contains("item with id") || lower.contains("item not found");
        if (code == 404 && !item_not_found)
            || (matches!(code, 400 | 422) && is_model_not_found(&lower))
        {
            return WorkerError::UnknownModel {
                model: self.model.clone(),
                name: self.name.clone(),
                base_url: self.base_url.clone(),
                status: code,
                message,
            };
        }
        WorkerError::Api {
            model: self.model.clone(),
            status: code,
            message,
        }
    }

    /// A body the provider cannot read.
    pub(super) fn bad_response(&self, detail: impl Into<String>) -> WorkerError {
        WorkerError::BadResponse {
            model: self.model.clone(),
            detail: detail.into(),
        }
    }
}

/// Retried answers: 408, 429 (unless the quota is exhausted: waiting will not help), 5xx.
fn retryable(status: StatusCode, text: &str) -> bool {
    match status.as_u16() {
        408 => true,
        429 => !text.contains("insufficient_quota"),
        s => (500..600).contains(&s),
    }
}

fn is_context_overflow(lower: &str) -> bool {
    [
        "context_length_exceeded",
        "maximum context length",
        "prompt is too long",
        "exceed_context_size",
        "exceeds the available context size",
        "context window",
        "too many tokens",
        "input is too long",
    ]
    .iter()
    .any(|p| lower.contains(p))
}

fn is_model_not_found(lower: &str) -> bool {
    lower.contains("model_not_found")
        || lower.contains("model not found")
        || (lower.contains("model") && lower.contains("does not exist"))
        || (lower.contains("model") && lower.contains("not found"))
}

/// The wait an answer asks for: `retry-after-ms` (milliseconds), else `retry-after`
/// (seconds, or an HTTP date, counted from `now`). Not capped.
fn retry_after(headers: &HeaderMap, now: SystemTime) -> Option<Duration> {
    let header = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
    };
    let secs = |s: &str| {
        s.parse::<f64>()
            .ok()
            .filter(|n| n.is_finite() && *n >= 0.0)
            .and_then(|n| Duration::try_from_secs_f64(n).ok())
    };
    if let Some(ms) = header("retry-after-ms").and_then(secs) {
        return Some(ms / 1000);
    }
    let value = header("retry-after")?;
    if let Some(d) = secs(value) {
        return Some(d);
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

/// The API's error message in an error body (`{"error": {"message"}}`, `{"error": "..."}`,
/// `{"message"}`, `{"detail"}`), else the body itself; truncated.
fn api_message(text: &str) -> String {
    let from_json = serde_json::from_str::<serde_json::Value>(text)
        .ok()
        .and_then(|v| {
            let err = v.get("error");
            let s = err
                .and_then(|e| e.get("message"))
                .or(err)
                .or_else(|| v.get("message"))
                .or_else(|| v.get("detail"))?;
            Some(match s {
                serde_json::Value::String(s) => s.clone(),
                other => other.to_string(),
            })
        });
    let msg = from_json.unwrap_or_else(|| text.trim().to_string());
    let msg = if msg.is_empty() {
        "(no message)".to_string()
    } else {
        msg
    };
    truncate(&msg, MAX_MESSAGE_CHARS)
}

/// `text` cut to `max` characters, marked when cut.
fn truncate(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        None => text.to_string(),
        Some((at, _)) => format!("{}… (truncated)", &text[..at]),
    }
}

/// `text` with every occurrence of the key replaced.
fn redact(text: &str, key: Option<&ApiKey>) -> String {
    match key {
        Some(k) if !k.0.is_empty() => text.replace(&k.0, "[redacted]"),
        _ => text.to_string(),
    }
}

/// An error and its sources, `: `-separated.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let s_text = s.to_string();
        if !out.contains(&s_text) {
            out.push_str(": ");
            out.push_str(&s_text);
        }
        source = s.source();
    }
    out
}

/// The usage of an answer that reports none: estimated from the sizes of the request and
/// the reply ([`size_estimate`], as the scripted provider does), with a warning.
pub(super) fn estimated_usage(
    api: &Api,
    req: &ModelRequest<'_>,
    text: Option<&str>,
    calls: &[ToolCall],
) -> Usage {
    tracing::warn!(
        provider = api.vendor.provider,
        model = %api.model,
        "the API reported no usage; tokens are estimated from sizes"
    );
    // The input at the bound a reservation holds (two bytes a token, tool schemas too):
    // a provider that says nothing is not taken to bill less than a cap allowed for.
    Usage::tokens(
        upper_bound_estimate(req).input_tokens,
        size_estimate(req.messages, text, calls).output_tokens,
    )
}

/// A tool call's arguments as the API sent them: a JSON object in a string (parsed), an
/// object, or nothing (`{}`). Arguments that are not valid JSON are kept as a JSON string,
/// so the tool reports a clear error to the model instead of the branch failing.
pub(super) fn parse_arguments(raw: Option<serde_json::Value>) -> serde_json::Value {
    match raw {
        None | Some(serde_json::Value::Null) => serde_json::json!({}),
        Some(serde_json::Value::String(s)) => {
            if s.trim().is_empty() {
                serde_json::json!({})
            } else {
                serde_json::from_str(&s).unwrap_or(serde_json::Value::String(s))
            }
        }
        Some(other) => other,
    }
}

/// A tool call's id: the API's, else (some local servers send none) `call_{turn}_{i}` for
/// the `i`th call of the request's turn.
pub(super) fn call_id(id: Option<String>, req: &ModelRequest<'_>, i: usize) -> String {
    id.filter(|id| !id.is_empty())
        .unwrap_or_else(|| format!("call_{}_{i}", req.turn))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests;
