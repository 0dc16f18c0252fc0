//! `openai:NAME` with `api = "responses"`: OpenAI's Responses API.
//!
//! One call is `POST {base_url}/responses` (default base `https://api.openai.com/v1`),
//! with the key, retries, streaming and errors of [`super::http`], and the body
//! `{model: NAME, instructions?, input, tools?, max_output_tokens, reasoning?, include?,
//! prompt_cache_key?, store: false, stream}`:
//!
//! - system messages → `instructions` (joined by blank lines);
//! - a user message → `{role: "user", content}`; an assistant turn → its reasoning items
//!   (as the API sent them, `encrypted_content` included), then `{role: "assistant",
//!   content}` when it has text, then a `{type: "function_call", call_id, name,
//!   arguments}` per tool call; a tool result → `{type: "function_call_output", call_id,
//!   output}`;
//! - tools: `[{type: "function", name, description, parameters}]`, left out when none;
//! - `reasoning: {effort}` and `include: ["reasoning.encrypted_content"]` when the spec
//!   sets `reasoning_effort`: with `store: false` (nothing is kept on OpenAI's side) the
//!   reasoning items are carried between turns in the history, encrypted;
//! - `prompt_cache_key` as for chat completions ([`super::openai`]);
//! - streaming: the `response.*.delta` events are metered, and the final
//!   `response.completed` (or `response.incomplete`) event carries the whole response,
//!   read as a non-streamed one; `response.failed` and `error` are errors.
//!
//! The answer's `output` gives the text (`message` items' `output_text` parts), the tool
//! calls (`function_call` items: `call_id`, `name`, `arguments`) and the reasoning items
//! (kept with the turn). `status: "incomplete"` with `incomplete_details.reason` gives the
//! finish reason (`max_output_tokens`), else `completed`. `usage` gives `input_tokens`
//! (`input_tokens_details.cached_tokens` of them cached), `output_tokens`
//! (`output_tokens_details.reasoning_tokens` of them reasoning).

use super::anthropic::{reasoning_doc, reasoning_items};
use super::http::{
    call_id, estimated_usage, parse_arguments, Api, Dialect, HttpProvider, StreamState, Vendor,
};
use super::openai::prompt_cache_key;
use super::{ModelReply, ModelRequest};
use crate::error::WorkerError;
use forkfleet_shared::event::{Message, ToolCall, Usage};
use serde_json::{json, Value};

/// The `dialect` of the reasoning items this API's answers carry.
const REASONING_DIALECT: &str = "openai-responses";

/// OpenAI's Responses API.
static VENDOR: Vendor = Vendor {
    provider: "openai",
    default_base_url: "https://api.openai.com/v1",
    host: "api.openai.com",
    path: "/responses",
    key_header: "authorization",
    key_prefix: "Bearer ",
    headers: &[],
};

/// The Responses API dialect.
#[derive(Debug)]
pub struct Responses;

/// An `openai:` model called through the Responses API.
pub type ResponsesProvider = HttpProvider<Responses>;

impl Dialect for Responses {
    const VENDOR: &'static Vendor = &VENDOR;
    type Stream = ResponsesStream;

    fn body(api: &Api, req: &ModelRequest<'_>) -> serde_json::Result<Vec<u8>> {
        serde_json::to_vec(&request(api, req))
    }

    fn reply(api: &Api, body: &[u8], req: &ModelRequest<'_>) -> Result<ModelReply, WorkerError> {
        reply(api, body, req)
    }
}

/// The request body of `req`.
fn request(api: &Api, req: &ModelRequest<'_>) -> Value {
    let settings = api.settings();
    let mut instructions: Vec<&str> = Vec::new();
    let mut input: Vec<Value> = Vec::new();
    for (i, m) in req.messages.iter().enumerate() {
        match m {
            // A branch's own instructions (after the fork's shared history) stay where they
            // stand: in `instructions` they would change the prefix every branch caches.
            Message::System { text } if req.shared_prefix > 0 && i >= req.shared_prefix => {
                if !text.trim().is_empty() {
                    input.push(json!({"role": "system", "content": text}));
                }
            }
            Message::System { text } => {
                if !text.trim().is_empty() {
                    instructions.push(text);
                }
            }
            Message::User { text } => input.push(json!({"role": "user", "content": text})),
            Message::Assistant {
                text,
                tool_calls,
                reasoning,
            } => {
                // With `store: false` a reasoning item is resolved from its encrypted
                // content only: one without it (an answer of an older worker, which did not
                // ask for it) would be looked up by id and refused (404), so it is left out.
                input.extend(
                    reasoning_items(reasoning.as_deref(), REASONING_DIALECT)
                        .into_iter()
                        .filter(|item| {
                            item.get("type").and_then(Value::as_str) != Some("reasoning")
                                || item
                                    .get("encrypted_content")
                                    .is_some_and(|c| c.as_str().is_some_and(|c| !c.is_empty()))
                        }),
                );
                if let Some(text) = text.as_deref().filter(|t| !t.is_empty()) {
                    input.push(json!({"role": "assistant", "content": text}));
                }
                for c in tool_calls {
                    let arguments = match &c.args {
                        Value::String(raw) => raw.clone(),
                        other => other.to_string(),
                    };
                    input.push(json!({
                        "type": "function_call",
                        "call_id": c.id,
                        "name": c.name,
                        "arguments": arguments,
                    }));
                }
            }
            Message::Tool {
                call_id, output, ..
            } => input.push(json!({
                "type": "function_call_output",
                "call_id": call_id,
                "output": output,
            })),
        }
    }
    let mut body = json!({
        "model": api.name(),
        "input": input,
        "max_output_tokens": req.max_output_tokens,
        "store": false,
        "stream": settings.stream,
    });
    let Value::Object(fields) = &mut body else {
        return body;
    };
    if !instructions.is_empty() {
        fields.insert("instructions".into(), json!(instructions.join("\n\n")));
    }
    if !req.tools.is_empty() {
        let tools: Vec<Value> = req
            .tools
            .iter()
            .map(|t| {
                json!({
                    "type": "function",
                    "name": t.name,
                    "description": t.description,
                    "parameters": t.parameters,
                })
            })
            .collect();
        fields.insert("tools".into(), Value::Array(tools));
        if let Some(choice) = settings.tool_choice {
            fields.insert("tool_choice".into(), json!(choice.as_str()));
        }
    }
    // Asked for on every call, not only with an effort: a reasoning model reasons at its
    // default effort too, and its items come back with this turn only when encrypted
    // (`store: false` keeps nothing on OpenAI's side).
    fields.insert("include".into(), json!(["reasoning.encrypted_content"]));
    if let Some(effort) = &settings.reasoning_effort {
        fields.insert("reasoning".into(), json!({"effort": effort}));
    } else if let Some(t) = req.temperature {
        // No sampling parameters beside an effort (OpenAI refuses them).
        fields.insert("temperature".into(), json!(t));
    }
    if let Some(key) = prompt_cache_key(req, settings.cache) {
        fields.insert("prompt_cache_key".into(), json!(key));
    }
    body
}

/// A number at `path` of `v`.
fn count(v: &Value, path: &[&str]) -> Option<u64> {
    path.iter().try_fold(v, |v, k| v.get(k))?.as_u64()
}

/// The reply in a Responses answer.
fn reply(api: &Api, body: &[u8], req: &ModelRequest<'_>) -> Result<ModelReply, WorkerError> {
    let resp: Value = serde_json::from_slice(body)
        .map_err(|e| api.bad_response(format!("not a response: {e}")))?;
    let output = resp
        .get("output")
        .and_then(Value::as_array)
        .ok_or_else(|| api.bad_response("the response has no output"))?;
    let mut text = String::new();
    let mut tool_calls = Vec::new();
    let mut reasoning = Vec::new();
    let mut refused = false;
    for item in output {
        match item.get("type").and_then(Value::as_str) {
            Some("message") => {
                for part in item
                    .get("content")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                {
                    match part.get("type").and_then(Value::as_str) {
                        Some("output_text") => {
                            text.push_str(part.get("text").and_then(Value::as_str).unwrap_or(""))
                        }
                        Some("refusal") => {
                            refused = true;
                            text.push_str(
                                part.get("refusal").and_then(Value::as_str).unwrap_or(""),
                            );
                        }
                        _ => {}
                    }
                }
            }
            Some("function_call") => {
                let name = item
                    .get("name")
                    .and_then(Value::as_str)
                    .filter(|n| !n.is_empty())
                    .ok_or_else(|| api.bad_response("a function_call item has no name"))?;
                let id = item
                    .get("call_id")
                    .and_then(Value::as_str)
                    .map(str::to_string);
                tool_calls.push(ToolCall {
                    id: call_id(id, req, tool_calls.len()),
                    name: name.to_string(),
                    args: parse_arguments(item.get("arguments").cloned()),
                });
            }
            Some("reasoning") => reasoning.push(item.clone()),
            _ => {}
        }
    }
    let text = (!text.is_empty()).then_some(text);
    let finish_reason = match resp.get("status").and_then(Value::as_str) {
        Some("incomplete") => Some(
            resp.get("incomplete_details")
                .and_then(|d| d.get("reason"))
                .and_then(Value::as_str)
                .unwrap_or("incomplete")
                .to_string(),
        ),
        _ if refused => Some(super::REFUSAL.to_string()),
        Some(status) => Some(status.to_string()),
        None => None,
    };
    let usage = match resp.get("usage") {
        Some(u) => match (count(u, &["input_tokens"]), count(u, &["output_tokens"])) {
            (Some(input), Some(output)) => Usage {
                cached_tokens: count(u, &["input_tokens_details", "cached_tokens"]).unwrap_or(0),
                reasoning_tokens: count(u, &["output_tokens_details", "reasoning_tokens"])
                    .unwrap_or(0),
                ..Usage::tokens(input, output)
            },
            _ => estimated_usage(api, req, text.as_deref(), &tool_calls),
        },
        None => estimated_usage(api, req, text.as_deref(), &tool_calls),
    };
    Ok(ModelReply {
        text,
        tool_calls,
        usage,
        response_model: resp
            .get("model")
            .and_then(Value::as_str)
            .map(str::to_string),
        finish_reason,
        reasoning: reasoning_doc(REASONING_DIALECT, &reasoning),
    })
}

/// A streamed response: its deltas metered, its final event's response kept.
#[derive(Debug, Default)]
pub struct ResponsesStream {
    /// The text streamed so far (for a cut answer).
    text: String,
    chars: u64,
    /// The whole response of the final event.
    done: Option<Value>,
}

impl StreamState for ResponsesStream {
    fn event(&mut self, name: &str, data: &str) -> Result<(), String> {
        let v: Value =
            serde_json::from_str(data).map_err(|e| format!("not a response event: {e}"))?;
        let kind = v.get("type").and_then(Value::as_str).unwrap_or(name);
        let delta = || v.get("delta").and_then(Value::as_str).unwrap_or("");
        match kind {
            "response.output_text.delta" => {
                self.chars += delta().chars().count() as u64;
                self.text.push_str(delta());
            }
            "response.function_call_arguments.delta"
            | "response.reasoning_summary_text.delta"
            | "response.reasoning_text.delta" => {
                self.chars += delta().chars().count() as u64;
            }
            "response.completed" | "response.incomplete" => {
                self.done = v.get("response").cloned();
            }
            "response.failed" => {
                let error = v
                    .get("response")
                    .and_then(|r| r.get("error"))
                    .unwrap_or(&Value::Null);
                return Err(error
                    .get("message")
                    .and_then(Value::as_str)
                    .map_or_else(|| "the response failed".to_string(), str::to_string));
            }
            "error" => {
                return Err(v
                    .get("message")
                    .and_then(Value::as_str)
                    .map_or_else(|| v.to_string(), str::to_string));
            }
            _ => {}
        }
        Ok(())
    }

    fn output_chars(&self) -> u64 {
        self.chars
    }

    fn input_usage(&self) -> Option<Usage> {
        None
    }

    fn text(&self) -> Option<String> {
        (!self.text.is_empty()).then(|| self.text.clone())
    }

    fn finished(&self) -> bool {
        self.done.is_some()
    }

    fn body(&self) -> Value {
        match &self.done {
            Some(response) => response.clone(),
            None => json!({
                "output": [{"type": "message", "content": [{"type": "output_text", "text": self.text}]}],
            }),
        }
    }
}
