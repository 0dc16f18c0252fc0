//! The worker's GenAI spans, after the OpenTelemetry GenAI semantic conventions: the model
//! call (`chat {model}`) and the tool call (`execute_tool {name}`).
//!
//! Both are made where the agent loop (and the judge) makes the call, the same for every
//! provider. The exported name is set through the `otel.name` field; the `tracing` names
//! (`model.call`, `tool.call`) are what log lines show. A model is named `provider:name`:
//! `gen_ai.provider.name` is the provider (`openai`, `anthropic`, and
//! [`SCRIPTED_PROVIDER`] for the scripted model), `gen_ai.request.model` and the span's
//! name use the name after the colon.
//!
//! Prompt and completion text (`gen_ai.input.messages`, `gen_ai.output.messages`) are
//! recorded only when [`capture_message_content`] is on, as JSON in the conventions'
//! message format, each text cut to [`MAX_PART_CHARS`] characters and the list to the latest
//! messages that fit in [`MAX_MESSAGES_BYTES`]. Nothing else in a span carries message text.

use crate::error::WorkerError;
use crate::metrics::ModelCall;
use crate::provider::{ModelReply, ModelRequest};
use forkfleet_shared::event::{Message, ToolCall};
use forkfleet_shared::ids::{ForkId, RunId};
use forkfleet_shared::trace::capture_message_content;
use serde_json::{json, Value};
use tracing::field::Empty;

/// `gen_ai.provider.name` of the scripted model (a provider of forkfleet's own, so in its
/// namespace, as the conventions ask of custom values).
pub const SCRIPTED_PROVIDER: &str = "forkfleet.scripted";

/// A captured message text is cut to this many characters.
pub const MAX_PART_CHARS: usize = 4_096;

/// A captured message list (the JSON) holds the latest messages that fit in this many bytes.
pub const MAX_MESSAGES_BYTES: usize = 32 * 1024;

/// `gen_ai.provider.name` of a `provider:name` model: the provider, except the scripted
/// model's [`SCRIPTED_PROVIDER`].
pub fn provider_name(model: &str) -> &str {
    match model.split_once(':') {
        Some(("scripted", _)) => SCRIPTED_PROVIDER,
        Some((provider, _)) => provider,
        None => "_OTHER",
    }
}

/// The model's name without its provider (`gpt-4o-mini` of `openai:gpt-4o-mini`).
pub fn model_name(model: &str) -> &str {
    model.split_once(':').map_or(model, |(_, name)| name)
}

/// `error.type` of a failed model call: a short stable class, never the message (which may
/// quote the API's answer). `http_<status>` for a final HTTP answer (`http_429` when every try
/// was rate limited), `no_answer` when the last try got none (a timeout, a refused
/// connection), else the kind of failure.
pub fn error_type(e: &WorkerError) -> String {
    use WorkerError as E;
    match e {
        E::RetriesExhausted {
            last_status: Some(status),
            ..
        }
        | E::BadKey { status, .. }
        | E::UnknownModel { status, .. }
        | E::Api { status, .. } => format!("http_{status}"),
        E::RetriesExhausted {
            last_status: None, ..
        } => "no_answer".into(),
        E::ContextOverflow { .. } => "context_overflow".into(),
        E::BadResponse { .. } => "bad_response".into(),
        E::MissingKey { .. } => "missing_key".into(),
        E::ModelRefused { .. } => "refused".into(),
        E::Script(_) => "script".into(),
        E::ModelUnusable { error, .. } => error_type(error),
        _ => "_OTHER".into(),
    }
}

/// One model call's span, `chat {model}`, and its metrics (`crate::metrics::ModelCall`):
/// the span a child of the span it is made in (the branch's `branch.turn`, or
/// `resolve.judge`). Made before the call and entered around it (`span()`); its outcome is
/// recorded on both with [`ChatSpan::replied`] or [`ChatSpan::failed`] (a call dropped
/// before either is counted `cancelled`).
pub(crate) struct ChatSpan(tracing::Span, ModelCall);

impl ChatSpan {
    pub(crate) fn new(
        req: &ModelRequest<'_>,
        fork_id: ForkId,
        branch_id: Option<RunId>,
        server: Option<(&str, u16)>,
    ) -> Self {
        let span = tracing::info_span!(
            "model.call",
            otel.name = %format_args!("chat {}", model_name(req.model)),
            otel.kind = "client",
            otel.status_code = Empty,
            gen_ai.operation.name = "chat",
            gen_ai.provider.name = provider_name(req.model),
            gen_ai.request.model = model_name(req.model),
            gen_ai.request.max_tokens = i64::from(req.max_output_tokens),
            gen_ai.response.model = Empty,
            gen_ai.usage.input_tokens = Empty,
            gen_ai.usage.output_tokens = Empty,
            gen_ai.usage.cache_read.input_tokens = Empty,
            gen_ai.usage.cache_creation.input_tokens = Empty,
            gen_ai.usage.reasoning.output_tokens = Empty,
            gen_ai.input.messages = Empty,
            gen_ai.output.messages = Empty,
            error.type = Empty,
            forkfleet.cost_usd = Empty,
            fork.id = %fork_id,
            branch.id = Empty,
            gen_ai.conversation.id = Empty,
            server.address = Empty,
            server.port = Empty,
        );
        if let Some(id) = branch_id {
            span.record("branch.id", tracing::field::display(id));
            // A branch's history is one conversation, its run.
            span.record("gen_ai.conversation.id", tracing::field::display(id));
        }
        if let Some((host, port)) = server {
            span.record("server.address", host);
            span.record("server.port", i64::from(port));
        }
        if capture_message_content() && !span.is_disabled() {
            span.record("gen_ai.input.messages", input_messages(req.messages));
        }
        Self(span, ModelCall::start(req.model))
    }

    /// The span, to instrument the call with.
    pub(crate) fn span(&self) -> &tracing::Span {
        &self.0
    }

    /// The call answered: its usage, finish reason and response model, and its cost (`None`:
    /// no price known).
    pub(crate) fn replied(self, reply: &ModelReply, cost_usd: Option<f64>) {
        let span = &self.0;
        span.record("gen_ai.usage.input_tokens", int(reply.usage.input_tokens));
        span.record("gen_ai.usage.output_tokens", int(reply.usage.output_tokens));
        for (field, tokens) in [
            (
                "gen_ai.usage.cache_read.input_tokens",
                reply.usage.cached_tokens,
            ),
            (
                "gen_ai.usage.cache_creation.input_tokens",
                reply.usage.cache_write_tokens,
            ),
            (
                "gen_ai.usage.reasoning.output_tokens",
                reply.usage.reasoning_tokens,
            ),
        ] {
            if tokens > 0 {
                span.record(field, int(tokens));
            }
        }
        if let Some(model) = &reply.response_model {
            span.record("gen_ai.response.model", model.as_str());
        }
        if let Some(reason) = &reply.finish_reason {
            // A string array, as the conventions define it (a `tracing` field cannot be one).
            use tracing_opentelemetry::OpenTelemetrySpanExt as _;
            span.set_attribute(
                "gen_ai.response.finish_reasons",
                opentelemetry::Value::Array(
                    vec![opentelemetry::StringValue::from(reason.clone())].into(),
                ),
            );
        }
        if let Some(cost) = cost_usd {
            span.record("forkfleet.cost_usd", cost);
        }
        if capture_message_content() && !span.is_disabled() {
            span.record("gen_ai.output.messages", output_messages(reply));
        }
        self.1.ok(&reply.usage);
    }

    /// The call failed (`error_type`: see [`error_type`]; `timeout` for one that took too
    /// long).
    pub(crate) fn failed(self, error_type: &str) {
        self.0.record("error.type", error_type);
        self.0.record("otel.status_code", "ERROR");
        self.1.failed(error_type);
    }

    /// A stopped branch dropped the call: the span says `cancelled`, the call is counted
    /// with that outcome.
    pub(crate) fn cancelled(self) {
        self.0.record("error.type", "cancelled");
        self.0.record("otel.status_code", "ERROR");
    }
}

/// A count as a span attribute: `tracing-opentelemetry` records a `u64` as text, an `i64`
/// as an integer.
pub(crate) fn int(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// The span of one tool call, `execute_tool {name}`, a child of the branch's `branch.turn`.
/// A tool that reports a failure (the model sees it) gets `error.type = "tool_error"`
/// ([`tool_failed`]).
pub(crate) fn tool_span(call: &ToolCall, fork_id: ForkId, branch_id: RunId) -> tracing::Span {
    tracing::info_span!(
        "tool.call",
        otel.name = %format_args!("execute_tool {}", call.name),
        gen_ai.operation.name = "execute_tool",
        gen_ai.tool.name = %call.name,
        gen_ai.tool.call.id = %call.id,
        gen_ai.tool.type = "function",
        error.type = Empty,
        otel.status_code = Empty,
        fork.id = %fork_id,
        branch.id = %branch_id,
    )
}

/// Record that the tool call of `span` failed: `error.type`, and the span's status ERROR.
pub(crate) fn tool_failed(span: &tracing::Span) {
    span.record("error.type", "tool_error");
    span.record("otel.status_code", "ERROR");
}

/// A text part, cut to [`MAX_PART_CHARS`] characters.
fn text_part(text: &str) -> Value {
    let content = match text.char_indices().nth(MAX_PART_CHARS) {
        Some((end, _)) => format!("{}[...]", &text[..end]),
        None => text.to_string(),
    };
    json!({ "type": "text", "content": content })
}

/// A tool call part.
fn tool_call_part(call: &ToolCall) -> Value {
    json!({ "type": "tool_call", "id": call.id, "name": call.name, "arguments": call.args })
}

/// One history message in the conventions' format.
fn message_json(m: &Message) -> Value {
    match m {
        Message::System { text } => json!({ "role": "system", "parts": [text_part(text)] }),
        Message::User { text } => json!({ "role": "user", "parts": [text_part(text)] }),
        Message::Assistant {
            text, tool_calls, ..
        } => {
            let parts: Vec<Value> = text
                .iter()
                .map(|t| text_part(t))
                .chain(tool_calls.iter().map(tool_call_part))
                .collect();
            json!({ "role": "assistant", "parts": parts })
        }
        Message::Tool {
            call_id, output, ..
        } => {
            let part = json!({
                "type": "tool_call_response",
                "id": call_id,
                "response": text_part(output)["content"],
            });
            json!({ "role": "tool", "parts": [part] })
        }
    }
}

/// `gen_ai.input.messages`: the latest messages whose JSON fits in [`MAX_MESSAGES_BYTES`].
pub fn input_messages(messages: &[Message]) -> String {
    let mut kept: Vec<String> = Vec::new();
    let mut bytes = 2;
    for m in messages.iter().rev() {
        let one = message_json(m).to_string();
        if bytes + one.len() + 1 > MAX_MESSAGES_BYTES {
            break;
        }
        bytes += one.len() + 1;
        kept.push(one);
    }
    kept.reverse();
    format!("[{}]", kept.join(","))
}

/// `gen_ai.output.messages`: the reply as one assistant message.
fn output_messages(reply: &ModelReply) -> String {
    let mut message = message_json(&Message::Assistant {
        text: reply.text.clone(),
        tool_calls: reply.tool_calls.clone(),
        reasoning: None,
    });
    if let Some(reason) = &reply.finish_reason {
        message["finish_reason"] = json!(reason);
    }
    Value::Array(vec![message]).to_string()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn provider_and_model_names() {
        assert_eq!(provider_name("scripted:demo"), SCRIPTED_PROVIDER);
        assert_eq!(provider_name("openai:gpt-4o"), "openai");
        assert_eq!(provider_name("anthropic:claude"), "anthropic");
        assert_eq!(model_name("openai:gpt-4o"), "gpt-4o");
        assert_eq!(model_name("bare"), "bare");
    }

    #[test]
    fn captured_messages_are_bounded_json() {
        let long = "x".repeat(MAX_PART_CHARS + 10);
        let messages: Vec<Message> = (0..40)
            .map(|_| Message::User { text: long.clone() })
            .collect();
        let json = input_messages(&messages);
        assert!(json.len() <= MAX_MESSAGES_BYTES, "{}", json.len());
        let parsed: Vec<Value> = serde_json::from_str(&json).unwrap();
        assert!(!parsed.is_empty() && parsed.len() < 40);
        let content = parsed[0]["parts"][0]["content"].as_str().unwrap();
        assert!(content.ends_with("[...]"));
        assert_eq!(content.chars().count(), MAX_PART_CHARS + 5);
    }
}
