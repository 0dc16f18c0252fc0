//! Model providers behind one trait.
//!
//! A model is named `provider:name` (`scripted:demo`, `openai:gpt-4o-mini`,
//! `anthropic:claude-sonnet-4-20250514`). [`Providers::provider_for`] turns a task's model
//! (and the spec's [`Endpoint`] settings) into a [`ModelProvider`], caching what is
//! expensive to build (a parsed script) per worker. A real model is resolved against the
//! worker's own [`ModelCatalogue`] first (ADR 16): a model it does not offer, or a spec
//! `base_url` whose host it does not allow, is refused before any connection is made; the
//! key source comes from the catalogue only. The real providers ([`openai`], [`anthropic`]) are one
//! [`http::HttpProvider`] each speaking its API's dialect; they share one HTTP client per
//! worker and the plumbing in [`http`] (key, retries, errors); building one is cheap, so
//! they are built per task (docs/PROVIDERS.md).
//!
//! A request borrows the branch's history: a provider that sends it over the network
//! serialises it from the borrow, and the scripted one never looks at more than the sizes.
//!
//! Before a call in strict budget mode the agent asks the provider for an upper bound of the
//! call's usage ([`ModelProvider::estimate`]) and reserves its cost. The default bound is
//! conservative ([`upper_bound_estimate`]: the request's size as tokens, plus the call's
//! `max_output_tokens`); a provider that knows better (the scripted one knows exactly what
//! it will report) overrides it.

pub mod anthropic;
pub mod http;
pub mod openai;
pub mod responses;
pub mod scripted;
pub mod sse;

use crate::cache::BlobCache;
use crate::error::WorkerError;
use crate::tools::measured_json_bytes;
use crate::toolspec::tools_json_bytes;
use async_trait::async_trait;
use forkfleet_shared::budget::estimate_input_tokens;
use forkfleet_shared::catalogue::ModelCatalogue;
use forkfleet_shared::endpoint::{Endpoint, OpenAiApi};
use forkfleet_shared::event::{Message, ToolCall, Usage};
use forkfleet_shared::protocol::BranchTask;
use forkfleet_shared::spec::SpecError;
use std::path::PathBuf;
use std::sync::Arc;

pub use crate::toolspec::ToolSpec;
pub use anthropic::AnthropicProvider;
pub use openai::OpenAiProvider;
pub use responses::ResponsesProvider;
pub use scripted::ScriptedProvider;

/// The providers this build implements (the spec checks model names against the same list).
use forkfleet_shared::provider::Provider;

/// One model call.
#[derive(Debug, Clone, Copy)]
pub struct ModelRequest<'a> {
    /// `provider:name`.
    pub model: &'a str,
    /// The branch's history as the model sees it.
    pub messages: &'a [Message],
    pub tools: &'a [ToolSpec],
    pub max_output_tokens: u32,
    /// The branch's label and index in its fork.
    pub label: &'a str,
    pub index: u32,
    /// Model calls the branch made before this one (0 for the first).
    pub turn: u32,
    /// The sampling temperature (`None`: the provider's default, and none is sent).
    pub temperature: Option<f64>,
    /// The prompt-cache family of the call: the same for every branch of a fork tree
    /// (its root), so a provider routes them to one cache (OpenAI's `prompt_cache_key`).
    /// `None`: none is sent.
    pub cache_key: Option<&'a str>,
    /// How many of `messages`, from the start, are the fork's shared history (the parent's
    /// conversation every branch starts from): where a cache breakpoint goes.
    pub shared_prefix: usize,
    /// Cut the answer as it streams once its running cost passes this (best-effort mode
    /// with `on_exhausted = "stop"`): the partial answer comes back marked `budget_cut`.
    pub spend_cap: Option<SpendCap>,
    /// Where a streamed call keeps its running usage, for a caller that cancels it (the
    /// part already streamed was paid for).
    pub meter: Option<&'a StreamMeter>,
}

/// The running usage of a streamed call (input as reported or estimated, output so far at
/// four characters a token); `None` before its first event.
#[derive(Debug, Default)]
pub struct StreamMeter {
    usage: std::sync::Mutex<Option<Usage>>,
    /// Some of the answer arrived: the provider generated (and bills) it, even if the call
    /// then fails.
    generated: std::sync::atomic::AtomicBool,
}

impl StreamMeter {
    pub fn set(&self, usage: Usage) {
        if let Ok(mut u) = self.usage.lock() {
            *u = Some(usage);
        }
    }

    pub fn get(&self) -> Option<Usage> {
        self.usage.lock().ok().and_then(|u| *u)
    }

    /// Some of the answer arrived.
    pub fn mark_generated(&self) {
        self.generated
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// The usage of a call that failed after some of its answer arrived (what the provider
    /// bills for it, estimated); `None` when nothing of an answer came.
    pub fn generated(&self) -> Option<Usage> {
        if self.generated.load(std::sync::atomic::Ordering::Relaxed) {
            self.get()
        } else {
            None
        }
    }
}

impl<'a> ModelRequest<'a> {
    /// A request of `messages` and `tools` with no temperature, cache key or spend cap.
    pub fn new(
        model: &'a str,
        messages: &'a [Message],
        tools: &'a [ToolSpec],
        max_output_tokens: u32,
    ) -> Self {
        Self {
            model,
            messages,
            tools,
            max_output_tokens,
            label: "",
            index: 0,
            turn: 0,
            temperature: None,
            cache_key: None,
            shared_prefix: 0,
            spend_cap: None,
            meter: None,
        }
    }
}

/// The most a streamed answer may cost before it is cut.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SpendCap {
    pub price: forkfleet_shared::pricing::Price,
    /// USD the call may still spend: the branch's cap less what it spent (best-effort
    /// mode), or the call's reservation (strict mode).
    pub remaining_usd: f64,
    /// The bound is the call's reservation (strict mode): an answer cut by it is marked
    /// [`RESERVATION_CUT`], not [`BUDGET_CUT`].
    pub reservation: bool,
}

/// The finish reason of an answer cut mid-stream by its [`SpendCap`].
pub const BUDGET_CUT: &str = "budget_cut";

/// The finish reason of an answer the model refused (OpenAI's `refusal` message, a
/// Responses `refusal` part, Anthropic's `refusal` stop reason): its text is the refusal.
pub const REFUSAL: &str = "refusal";

/// True when `finish_reason` says the model refused or the provider's content filter
/// stopped the answer: the branch ends `refused`.
pub fn is_refused(finish_reason: Option<&str>) -> bool {
    matches!(finish_reason, Some("refusal" | "content_filter"))
}

/// The finish reason of an answer cut mid-stream because it ran far past
/// `max_output_tokens` (a provider that ignores it), when no budget bounds the call.
pub const OUTPUT_CAP_CUT: &str = "output_cap_cut";

/// The finish reason of an answer cut mid-stream because its cost reached the call's
/// reservation (strict mode): the provider generated past `max_output_tokens`.
pub const RESERVATION_CUT: &str = "reservation_cut";

/// True when `finish_reason` says the answer was cut at the output cap (OpenAI's `length`,
/// Anthropic's `max_tokens`, the Responses API's `max_output_tokens`).
pub fn is_truncated(finish_reason: Option<&str>) -> bool {
    matches!(
        finish_reason,
        Some("length" | "max_tokens" | "max_output_tokens" | OUTPUT_CAP_CUT)
    )
}

/// What the model answered.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelReply {
    pub text: Option<String>,
    pub tool_calls: Vec<ToolCall>,
    pub usage: Usage,
    /// The model that answered, as the API names it (`None`: the API did not say).
    pub response_model: Option<String>,
    /// Why the model stopped, as the API says it (`stop`, `tool_calls`, `end_turn`, ...),
    /// or [`BUDGET_CUT`].
    pub finish_reason: Option<String>,
    /// Reasoning items the API wants back with this turn (a JSON document the dialect that
    /// made it reads: [`Event::ModelResponse`](forkfleet_shared::event::Event)'s
    /// `reasoning`).
    pub reasoning: Option<String>,
}

#[async_trait]
pub trait ModelProvider: Send + Sync {
    /// Make the call. Dropping the future cancels it (a branch stopped mid-call).
    async fn complete(&self, req: &ModelRequest<'_>) -> Result<ModelReply, WorkerError>;

    /// An upper bound of the usage `complete(req)` will report, reserved before the call in
    /// strict budget mode. Defaults to [`upper_bound_estimate`].
    fn estimate(&self, req: &ModelRequest<'_>) -> Usage {
        upper_bound_estimate(req)
    }

    /// The host and port the calls go to (`server.address`, `server.port` of the model
    /// call's span); `None` for a model in the process (the scripted one).
    fn server_address(&self) -> Option<(&str, u16)> {
        None
    }

    /// `estimate` is exactly what the call reports (the scripted model): a branch learns
    /// nothing to lower it from its calls (`agent::learn`).
    fn estimate_is_exact(&self) -> bool {
        false
    }

    /// The provider's prompt cache is used: a fork's branches warm it with one first call
    /// (`crate::warmup`).
    fn caches_prompts(&self) -> bool {
        false
    }
}

/// A conservative bound of a request's usage: its messages and tool schemas (as JSON)
/// converted to input tokens by [`estimate_input_tokens`], and `max_output_tokens` of
/// output; nothing counted as cached. The worker's own tool lists (the static lists of
/// [`crate::toolspec`] a branch is offered) are measured once; other ones on every call.
pub fn upper_bound_estimate(req: &ModelRequest<'_>) -> Usage {
    let tools_bytes = measured_json_bytes(req.tools).unwrap_or_else(|| tools_json_bytes(req.tools));
    Usage::tokens(
        estimate_input_tokens(req.messages, tools_bytes),
        u64::from(req.max_output_tokens),
    )
}

/// A writer that only counts the UTF-8 characters written.
#[derive(Default)]
struct CountChars(u64);

impl std::io::Write for CountChars {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        // Count UTF-8 sequence starts: one per character.
        self.0 += buf.iter().filter(|b| (**b & 0xC0) != 0x80).count() as u64;
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Split `provider:name`, checking the provider is one this build knows.
pub fn split_model(model: &str) -> Result<(&str, &str), WorkerError> {
    forkfleet_shared::spec::split_model(model).map_err(|e| match e {
        SpecError::UnknownProvider {
            model,
            provider,
            valid,
        } => WorkerError::UnknownProvider {
            model,
            provider,
            known: valid,
        },
        _ => WorkerError::BadModelName {
            model: model.to_string(),
            known: Provider::names(),
        },
    })
}

/// The input tokens of a request estimated from its size: one per four characters of its
/// messages and of its tool schemas (as JSON). What a provider bills for a call cancelled
/// before it reported its usage.
pub fn request_tokens(req: &ModelRequest<'_>) -> u64 {
    let tools = measured_json_bytes(req.tools).unwrap_or_else(|| tools_json_bytes(req.tools));
    estimate_tokens(message_chars(req.messages) + tools as u64)
}

/// Estimated tokens of a text: one per four characters, rounded up.
pub fn estimate_tokens(chars: u64) -> u64 {
    chars.div_ceil(4)
}

/// The usage of a call estimated from sizes (a scripted turn without usage, an API answer
/// without it): one token per four characters of the request's messages (input) and of the
/// reply's text and tool calls (output), nothing cached.
pub fn size_estimate(messages: &[Message], text: Option<&str>, calls: &[ToolCall]) -> Usage {
    Usage::tokens(
        estimate_tokens(message_chars(messages)),
        estimate_tokens(text.map_or(0, char_count) + tool_call_chars(calls)),
    )
}

/// Characters of a request's messages, counted as a model would read them (texts, tool
/// names, tool arguments as JSON, tool outputs).
pub fn message_chars(messages: &[Message]) -> u64 {
    messages
        .iter()
        .map(|m| match m {
            Message::System { text } | Message::User { text } => char_count(text),
            Message::Assistant {
                text, tool_calls, ..
            } => text.as_deref().map_or(0, char_count) + tool_call_chars(tool_calls),
            Message::Tool { name, output, .. } => char_count(name) + char_count(output),
        })
        .sum()
}

/// Characters of tool calls: names and arguments as JSON.
pub fn tool_call_chars(calls: &[ToolCall]) -> u64 {
    calls
        .iter()
        .map(|c| char_count(&c.name) + json_chars(&c.args))
        .sum()
}

fn char_count(s: &str) -> u64 {
    s.chars().count() as u64
}

/// Characters of a JSON value's compact encoding, without building the string.
fn json_chars(v: &serde_json::Value) -> u64 {
    let mut c = CountChars::default();
    match serde_json::to_writer(&mut c, v) {
        Ok(()) => c.0,
        Err(_) => 0,
    }
}

/// The worker's providers, built per task and cached where building is costly.
pub struct Providers {
    blobs: Arc<BlobCache>,
    /// Where scripted models log their calls ([`ScriptedProvider::with_usage_log`]).
    scripted_usage_log: Option<PathBuf>,
    /// The one HTTP client of the real providers, built on first use.
    http: tokio::sync::OnceCell<reqwest::Client>,
    /// The real models this worker offers and the hosts a spec's `base_url` may name.
    catalogue: Arc<ModelCatalogue>,
}

impl Providers {
    pub fn new(
        blobs: Arc<BlobCache>,
        scripted_usage_log: Option<PathBuf>,
        catalogue: Arc<ModelCatalogue>,
    ) -> Self {
        Self {
            blobs,
            scripted_usage_log,
            http: tokio::sync::OnceCell::new(),
            catalogue,
        }
    }

    /// The worker's HTTP client (built once; clones share its connection pool).
    async fn http_client(&self) -> Result<reqwest::Client, WorkerError> {
        self.http
            .get_or_try_init(|| async { http::client() })
            .await
            .cloned()
    }

    /// The provider for a task's model. A scripted model's script is fetched and parsed
    /// once per process ([`scripted::parsed_scripts`]) and shared by every branch that uses
    /// it.
    pub async fn provider_for(
        &self,
        task: &BranchTask,
    ) -> Result<Arc<dyn ModelProvider>, WorkerError> {
        self.provider(&task.model, task.script, task.endpoint.as_ref())
            .await
    }

    /// The provider for `model` (`provider:name`); `script` is a scripted model's script,
    /// `endpoint` the spec's settings of a real model (`None`: the catalogue's entry alone).
    /// A real model the catalogue refuses is [`WorkerError::ModelRefused`], before any
    /// request.
    pub async fn provider(
        &self,
        model: &str,
        script: Option<forkfleet_shared::blob::BlobHash>,
        endpoint: Option<&Endpoint>,
    ) -> Result<Arc<dyn ModelProvider>, WorkerError> {
        let (provider, _name) = split_model(model)?;
        let Some(provider) = Provider::parse(provider) else {
            return Err(WorkerError::UnknownProvider {
                model: model.to_string(),
                provider: provider.to_string(),
                known: Provider::names(),
            });
        };
        match provider {
            Provider::Scripted => {
                let hash = script.ok_or_else(|| WorkerError::MissingScript {
                    model: model.to_string(),
                })?;
                let script = scripted::parsed_scripts()
                    .get_or_try_init(hash, || async {
                        let bytes = self
                            .blobs
                            .get(&hash)
                            .await
                            .map_err(WorkerError::ScriptBlob)?;
                        scripted::parse_blocking(bytes).await
                    })
                    .await?;
                // The parse is shared; the provider around it is a pointer and a path.
                Ok(Arc::new(
                    ScriptedProvider::new(script).with_usage_log(self.scripted_usage_log.clone()),
                ))
            }
            Provider::OpenAi => {
                let route = self.route(model, endpoint)?;
                let settings = http::CallSettings::of(endpoint);
                let client = self.http_client().await?;
                Ok(match endpoint.and_then(|e| e.api).unwrap_or_default() {
                    OpenAiApi::Chat => Arc::new(
                        OpenAiProvider::new(model, &route, client)?.with_settings(settings),
                    ),
                    OpenAiApi::Responses => Arc::new(
                        ResponsesProvider::new(model, &route, client)?.with_settings(settings),
                    ),
                })
            }
            Provider::Anthropic => Ok(Arc::new(
                AnthropicProvider::new(
                    model,
                    &self.route(model, endpoint)?,
                    self.http_client().await?,
                )?
                .with_settings(http::CallSettings::of(endpoint)),
            )),
        }
    }
}

impl Providers {
    /// How this worker calls the real model `model` (see [`ModelCatalogue::route`]); a
    /// refusal is logged at WARN (never a key: the catalogue holds only where keys are).
    fn route(
        &self,
        model: &str,
        endpoint: Option<&Endpoint>,
    ) -> Result<forkfleet_shared::catalogue::ModelRoute, WorkerError> {
        self.catalogue.route(model, endpoint).map_err(|detail| {
            tracing::warn!(model, error = %detail, "model refused by the worker's catalogue");
            WorkerError::ModelRefused {
                model: model.to_string(),
                detail,
            }
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::tools::ToolBox;
    use crate::toolspec::tool_specs;

    /// Two workers of one process (two `Providers`, each with its own blob cache) share
    /// one parse of a script: the second finds it parsed; a bad script is an error for
    /// each.
    #[tokio::test]
    async fn workers_of_one_process_share_a_scripts_parse() {
        use forkfleet_shared::blob::MemBlobStore;
        let store = MemBlobStore::new();
        // A text no other test uses, so the process-wide memo starts without it.
        let text = "[[turns.\"*\"]]\ntext = \"shared parse\"\n";
        let hash = store.insert(bytes::Bytes::from_static(text.as_bytes()));
        let bad = store.insert(bytes::Bytes::from_static(b"[[turns.x]]\ntxt = 1"));
        let workers: Vec<Providers> = (0..2)
            .map(|_| {
                let blobs = Arc::new(BlobCache::new(Arc::new(store.clone()), 1 << 20));
                Providers::new(blobs, None, Arc::default())
            })
            .collect();
        workers[0]
            .provider("scripted:m", Some(hash), None)
            .await
            .unwrap();
        let again = scripted::parsed_scripts()
            .get_or_try_init(hash, || async { Err("parsed a second time") })
            .await;
        assert!(again.is_ok(), "the first worker's parse was not kept");
        workers[1]
            .provider("scripted:m", Some(hash), None)
            .await
            .unwrap();
        for w in &workers {
            let err = w
                .provider("scripted:m", Some(bad), None)
                .await
                .err()
                .unwrap();
            assert!(matches!(err, WorkerError::Script(_)), "{err}");
        }
    }

    #[test]
    fn model_names_are_checked() {
        assert_eq!(split_model("scripted:demo").unwrap(), ("scripted", "demo"));
        let err = split_model("gpt-4o").unwrap_err().to_string();
        assert!(
            err.contains("provider:name") && err.contains("scripted"),
            "{err}"
        );
        let err = split_model("nope:x").unwrap_err().to_string();
        assert!(
            err.contains("unknown provider `nope`") && err.contains("scripted"),
            "{err}"
        );
        assert!(split_model("scripted:").is_err());
    }

    #[test]
    fn sizes_count_characters() {
        let msgs = vec![
            Message::User {
                text: "héllo".into(),
            },
            Message::Assistant {
                text: None,
                tool_calls: vec![ToolCall {
                    id: "c".into(),
                    name: "ab".into(),
                    args: serde_json::json!({"p": "é"}),
                }],
                reasoning: None,
            },
        ];
        // 5 + 2 + len(`{"p":"é"}`) = 5 + 2 + 9
        assert_eq!(message_chars(&msgs), 16);
        assert_eq!(estimate_tokens(16), 4);
        assert_eq!(estimate_tokens(17), 5);
        assert_eq!(estimate_tokens(0), 0);
    }

    #[test]
    fn the_default_estimate_bounds_the_request() {
        let msgs = vec![Message::User {
            text: "x".repeat(100),
        }];
        let tools = vec![ToolSpec {
            name: "t".into(),
            description: "é".into(),
            parameters: serde_json::json!({"type": "object"}),
        }];
        // `[{"name":"t","description":"é","parameters":{"type":"object"}}]`
        assert_eq!(tools_json_bytes(&tools), 64);
        let req = ModelRequest::new("scripted:t", &msgs, &tools, 321);
        // (100 + 64 bytes) / 2 per token, plus 8 tokens for the message and 8 for the tools.
        assert_eq!(upper_bound_estimate(&req), Usage::tokens(98, 321));
    }

    #[test]
    fn the_worker_tools_are_measured_once_and_alike() {
        let msgs = vec![Message::User { text: "hi".into() }];
        let standard = ToolBox::standard();
        let copy = tool_specs().to_vec();
        assert_eq!(
            measured_json_bytes(standard.specs()),
            Some(tools_json_bytes(&copy))
        );
        let shared = ModelRequest::new("scripted:t", &msgs, standard.specs(), 1);
        let copied = ModelRequest {
            tools: &copy,
            ..shared
        };
        assert_eq!(upper_bound_estimate(&shared), upper_bound_estimate(&copied));
    }
}
