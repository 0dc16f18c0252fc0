//! `anthropic:NAME`: the Anthropic Messages API with tool use.
//!
//! One call is `POST {base_url}/messages` (default base `https://api.anthropic.com/v1`)
//! with headers `x-api-key: KEY` (when there is a key; see [`super::http`] for the key,
//! the retries, streaming and the errors) and `anthropic-version: 2023-06-01`, and the body
//! `{model: NAME, max_tokens, system?, messages, tools?, thinking?, stream}`:
//!
//! - every system message goes to `system` (joined by blank lines, in order);
//! - a user message → a `user` message with a `text` block; an assistant turn → an
//!   `assistant` message with a `text` block (if it has text) and a `tool_use` block per
//!   call (`{id, name, input}`; arguments that are not a JSON object are sent as
//!   `{"arguments": ...}`); a tool result → a `tool_result` block (`{tool_use_id,
//!   content}`) in a `user` message;
//! - consecutive messages of the same role are merged into one (the API wants the roles to
//!   alternate), so the results of one turn's tool calls are one user message; empty texts
//!   are left out (the API refuses them), and a conversation that would start with the
//!   assistant starts with a user `(continue)`;
//! - tools: `[{name, description, input_schema}]`, left out when there are none;
//! - prompt caching (unless `cache = "off"`): `cache_control: {type: "ephemeral"}` on the
//!   system prompt (sent as one text block), on the last tool, on the last block of the
//!   fork's shared history (the parent's conversation every branch starts from) and on the
//!   last block of the request (a rolling breakpoint on the branch's own history): four
//!   at most, the API's limit. A fork's branches then write the shared prefix once and
//!   read it after, and each branch reads its own history of the turn before;
//! - extended thinking (`thinking_budget`): `thinking: {type: "enabled", budget_tokens}`,
//!   `max_tokens` raised by the budget (the output cap stays the answer's), no temperature
//!   (the API refuses one with thinking); the answer's `thinking` and `redacted_thinking`
//!   blocks are kept with the turn (its `reasoning`) and sent back first in its assistant
//!   message, as the API requires within a tool-use loop;
//! - streaming: `stream: true`; `message_start` gives the input usage, the blocks come in
//!   `content_block_start` / `content_block_delta` (text, tool input JSON, thinking,
//!   signature), `message_delta` gives the stop reason and the output tokens; an `error`
//!   event is an error.
//!
//! The answer's `content` gives the text (its `text` blocks, joined) and the tool calls (its
//! `tool_use` blocks). `usage` gives input tokens as `input_tokens +
//! cache_creation_input_tokens + cache_read_input_tokens`, cached tokens as
//! `cache_read_input_tokens`, cache writes as `cache_creation_input_tokens` (priced at the
//! cache-write rate) and output as `output_tokens`; an answer without usage is estimated
//! from sizes, with a warning.

use super::http::{
    call_id, estimated_usage, parse_arguments, Api, Dialect, HttpProvider, StreamState, Vendor,
};
use super::{ModelReply, ModelRequest};
use crate::error::WorkerError;
use forkfleet_shared::event::{Message, ToolCall, Usage};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::borrow::Cow;

/// The `dialect` of the reasoning this API's answers carry (thinking blocks).
const REASONING_DIALECT: &str = "anthropic";

/// The API version sent with every request.
const ANTHROPIC_VERSION: &str = "2023-06-01";

/// Anthropic's API and defaults.
static VENDOR: Vendor = Vendor {
    provider: "anthropic",
    default_base_url: "https://api.anthropic.com/v1",
    host: "api.anthropic.com",
    path: "/messages",
    key_header: "x-api-key",
    key_prefix: "",
    headers: &[("anthropic-version", ANTHROPIC_VERSION)],
};

/// The Messages API dialect.
#[derive(Debug)]
pub struct Anthropic;

/// The Anthropic Messages API.
pub type AnthropicProvider = HttpProvider<Anthropic>;

impl Dialect for Anthropic {
    const VENDOR: &'static Vendor = &VENDOR;
    const CACHE_WRITE_SURCHARGE: bool = true;
    type Stream = MessagesStream;

    fn body(api: &Api, req: &ModelRequest<'_>) -> serde_json::Result<Vec<u8>> {
        let settings = api.settings();
        let options = Options {
            cache: settings.cache,
            thinking_budget: settings.thinking_budget,
            stream: settings.stream,
        };
        serde_json::to_vec(&request(api.name(), req, &options))
    }

    fn reply(api: &Api, body: &[u8], req: &ModelRequest<'_>) -> Result<ModelReply, WorkerError> {
        reply(api, body, req)
    }

    fn extra_output_tokens(api: &Api) -> u64 {
        api.settings().thinking_budget.map_or(0, u64::from)
    }
}

/// What the spec's settings make of a request.
struct Options {
    cache: bool,
    thinking_budget: Option<u32>,
    stream: bool,
}

#[derive(Serialize)]
struct MessagesRequest<'a> {
    model: &'a str,
    max_tokens: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    system: Option<System>,
    messages: Vec<Turn<'a>>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    tools: Vec<Tool<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    temperature: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    thinking: Option<Thinking>,
    stream: bool,
}

/// The system prompt: a string, or one text block carrying a cache breakpoint.
#[derive(Serialize)]
#[serde(untagged)]
enum System {
    Text(String),
    Blocks([SystemBlock; 1]),
}

#[derive(Serialize)]
struct SystemBlock {
    #[serde(rename = "type")]
    kind: &'static str,
    text: String,
    cache_control: Ephemeral,
}

#[derive(Serialize)]
struct Thinking {
    #[serde(rename = "type")]
    kind: &'static str,
    budget_tokens: u32,
}

/// A cache breakpoint: `{"type": "ephemeral"}`.
#[derive(Serialize, Clone, Copy)]
struct Ephemeral {
    #[serde(rename = "type")]
    kind: &'static str,
}

const EPHEMERAL: Ephemeral = Ephemeral { kind: "ephemeral" };

#[derive(Serialize)]
struct Turn<'a> {
    role: &'static str,
    content: Vec<Block<'a>>,
}

#[derive(Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Block<'a> {
    Text {
        text: &'a str,
        #[serde(skip_serializing_if = "Option::is_none")]
        cache_control: Option<Ephemeral>,
    },
    ToolUse {
        id: &'a str,
        name: &'a str,
        input: Cow<'a, serde_json::Value>,
        #[serde(skip_serializing_if = "Option::is_none")]
        cache_control: Option<Ephemeral>,
    },
    ToolResult {
        tool_use_id: &'a str,
        content: &'a str,
        #[serde(skip_serializing_if = "Option::is_none")]
        cache_control: Option<Ephemeral>,
    },
    /// A thinking or redacted thinking block, as the API sent it (it takes no breakpoint).
    #[serde(untagged)]
    Raw(Value),
}

impl Block<'_> {
    /// Put a cache breakpoint on this block; false for one that cannot take it.
    fn mark(&mut self) -> bool {
        match self {
            Block::Text { cache_control, .. }
            | Block::ToolUse { cache_control, .. }
            | Block::ToolResult { cache_control, .. } => {
                *cache_control = Some(EPHEMERAL);
                true
            }
            Block::Raw(_) => false,
        }
    }
}

#[derive(Serialize)]
struct Tool<'a> {
    name: &'a str,
    description: &'a str,
    input_schema: &'a serde_json::Value,
    #[serde(skip_serializing_if = "Option::is_none")]
    cache_control: Option<Ephemeral>,
}

/// The reasoning items of a turn as kept in its `reasoning`.
pub(super) fn reasoning_doc(dialect: &str, items: &[Value]) -> Option<String> {
    (!items.is_empty()).then(|| json!({"dialect": dialect, "items": items}).to_string())
}

/// The items of a turn's `reasoning` when `dialect` made it (another API's are not sent).
pub(super) fn reasoning_items(reasoning: Option<&str>, dialect: &str) -> Vec<Value> {
    let Some(doc) = reasoning.and_then(|r| serde_json::from_str::<Value>(r).ok()) else {
        return Vec::new();
    };
    if doc.get("dialect").and_then(Value::as_str) != Some(dialect) {
        return Vec::new();
    }
    match doc.get("items") {
        Some(Value::Array(items)) => items.clone(),
        _ => Vec::new(),
    }
}

/// A tool call's arguments as the `input` object the API wants.
fn input(args: &serde_json::Value) -> Cow<'_, serde_json::Value> {
    if args.is_object() {
        Cow::Borrowed(args)
    } else {
        Cow::Owned(serde_json::json!({ "arguments": args }))
    }
}

fn text_block(text: &str) -> Option<Block<'_>> {
    (!text.trim().is_empty()).then_some(Block::Text {
        text,
        cache_control: None,
    })
}

/// The request body of `req` for model `name`.
fn request<'a>(name: &'a str, req: &'a ModelRequest<'a>, options: &Options) -> MessagesRequest<'a> {
    let mut system: Vec<&str> = Vec::new();
    let mut turns: Vec<Turn<'a>> = Vec::new();
    // Where the fork's shared history ends: the last block made of it (turn, block).
    let mut shared_end: Option<(usize, usize)> = None;
    for (i, m) in req.messages.iter().enumerate() {
        if i == req.shared_prefix {
            shared_end = last_block(&turns);
        }
        let (role, blocks): (&'static str, Vec<Block<'a>>) = match m {
            // A branch's own instructions (`extra_instructions`, after the fork's shared
            // history) go where they stand, as user text: in `system` they would change
            // the cached prefix every branch shares.
            Message::System { text } if req.shared_prefix > 0 && i >= req.shared_prefix => {
                ("user", text_block(text).into_iter().collect())
            }
            Message::System { text } => {
                if !text.trim().is_empty() {
                    system.push(text);
                }
                continue;
            }
            Message::User { text } => ("user", text_block(text).into_iter().collect()),
            Message::Assistant {
                text,
                tool_calls,
                reasoning,
            } => {
                let mut blocks: Vec<Block<'a>> =
                    reasoning_items(reasoning.as_deref(), REASONING_DIALECT)
                        .into_iter()
                        .map(Block::Raw)
                        .collect();
                blocks.extend(text.as_deref().and_then(text_block));
                blocks.extend(tool_calls.iter().map(|c| Block::ToolUse {
                    id: &c.id,
                    name: &c.name,
                    input: input(&c.args),
                    cache_control: None,
                }));
                ("assistant", blocks)
            }
            Message::Tool {
                call_id, output, ..
            } => (
                "user",
                vec![Block::ToolResult {
                    tool_use_id: call_id,
                    content: output,
                    cache_control: None,
                }],
            ),
        };
        if blocks.is_empty() {
            continue;
        }
        match turns.last_mut() {
            Some(last) if last.role == role => last.content.extend(blocks),
            _ => turns.push(Turn {
                role,
                content: blocks,
            }),
        }
    }
    if req.shared_prefix >= req.messages.len() {
        shared_end = last_block(&turns);
    }
    if turns.first().is_none_or(|t| t.role != "user") {
        turns.insert(
            0,
            Turn {
                role: "user",
                content: vec![Block::Text {
                    text: "(continue)",
                    cache_control: None,
                }],
            },
        );
        shared_end = shared_end.map(|(t, b)| (t + 1, b));
    }
    let mut tools: Vec<Tool<'a>> = req
        .tools
        .iter()
        .map(|t| Tool {
            name: &t.name,
            description: &t.description,
            input_schema: &t.parameters,
            cache_control: None,
        })
        .collect();
    let system = (!system.is_empty()).then(|| system.join("\n\n"));
    let system = if options.cache {
        // Breakpoints: the tools, the system prompt, the end of the shared history, the
        // end of the request (four at most).
        if let Some(last) = tools.last_mut() {
            last.cache_control = Some(EPHEMERAL);
        }
        let ends = [shared_end, last_block(&turns)];
        for (t, b) in ends.into_iter().flatten() {
            if let Some(block) = turns.get_mut(t).and_then(|turn| turn.content.get_mut(b)) {
                block.mark();
            }
        }
        system.map(|text| {
            System::Blocks([SystemBlock {
                kind: "text",
                text,
                cache_control: EPHEMERAL,
            }])
        })
    } else {
        system.map(System::Text)
    };
    let thinking = options.thinking_budget.map(|budget| Thinking {
        kind: "enabled",
        budget_tokens: budget,
    });
    MessagesRequest {
        model: name,
        max_tokens: req
            .max_output_tokens
            .saturating_add(options.thinking_budget.unwrap_or(0)),
        system,
        messages: turns,
        tools,
        // The API takes no temperature with thinking.
        temperature: req.temperature.filter(|_| thinking.is_none()),
        thinking,
        stream: options.stream,
    }
}

/// The last block of `turns` that can take a cache breakpoint, as (turn, block).
fn last_block(turns: &[Turn<'_>]) -> Option<(usize, usize)> {
    let t = turns.len().checked_sub(1)?;
    let turn = turns.get(t)?;
    let b = turn
        .content
        .iter()
        .rposition(|b| !matches!(b, Block::Raw(_)))?;
    Some((t, b))
}

#[derive(Deserialize)]
struct MessagesResponse {
    #[serde(default)]
    content: Vec<ResponseBlock>,
    #[serde(default)]
    usage: Option<ResponseUsage>,
    #[serde(default)]
    stop_reason: Option<String>,
    #[serde(default)]
    model: Option<String>,
}

#[derive(Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum ResponseBlock {
    Text {
        #[serde(default)]
        text: String,
    },
    ToolUse {
        #[serde(default)]
        id: String,
        #[serde(default)]
        name: String,
        #[serde(default)]
        input: Option<serde_json::Value>,
    },
    Thinking {
        #[serde(default)]
        thinking: String,
        #[serde(default)]
        signature: String,
    },
    RedactedThinking {
        #[serde(default)]
        data: String,
    },
    #[serde(other)]
    Other,
}

#[derive(Deserialize)]
struct ResponseUsage {
    #[serde(default)]
    input_tokens: Option<u64>,
    #[serde(default)]
    output_tokens: Option<u64>,
    #[serde(default)]
    cache_creation_input_tokens: Option<u64>,
    #[serde(default)]
    cache_read_input_tokens: Option<u64>,
}

/// The reply in a Messages answer.
fn reply(api: &Api, body: &[u8], req: &ModelRequest<'_>) -> Result<ModelReply, WorkerError> {
    let resp: MessagesResponse = serde_json::from_slice(body)
        .map_err(|e| api.bad_response(format!("not a messages answer: {e}")))?;
    if resp.stop_reason.as_deref() == Some("max_tokens") {
        tracing::debug!(model = %api.model(), "the reply was cut at max_tokens");
    }
    let mut text = String::new();
    let mut tool_calls = Vec::new();
    let mut thinking: Vec<Value> = Vec::new();
    for block in resp.content {
        match block {
            ResponseBlock::Thinking {
                thinking: t,
                signature,
            } => thinking.push(json!({"type": "thinking", "thinking": t, "signature": signature})),
            ResponseBlock::RedactedThinking { data } => {
                thinking.push(json!({"type": "redacted_thinking", "data": data}))
            }
            ResponseBlock::Text { text: t } => text.push_str(&t),
            ResponseBlock::ToolUse { id, name, input } => {
                if name.is_empty() {
                    return Err(api.bad_response("a tool_use block has no name"));
                }
                tool_calls.push(ToolCall {
                    id: call_id(Some(id), req, tool_calls.len()),
                    name,
                    args: parse_arguments(input),
                });
            }
            ResponseBlock::Other => {}
        }
    }
    let text = (!text.is_empty()).then_some(text);
    let usage = match resp.usage {
        Some(ResponseUsage {
            input_tokens: Some(input),
            output_tokens: Some(output),
            cache_creation_input_tokens,
            cache_read_input_tokens,
        }) => {
            let written = cache_creation_input_tokens.unwrap_or(0);
            let read = cache_read_input_tokens.unwrap_or(0);
            Usage {
                cached_tokens: read,
                cache_write_tokens: written,
                ..Usage::tokens(input + written + read, output)
            }
        }
        _ => estimated_usage(api, req, text.as_deref(), &tool_calls),
    };
    Ok(ModelReply {
        text,
        tool_calls,
        usage,
        response_model: resp.model,
        finish_reason: resp.stop_reason,
        reasoning: reasoning_doc(REASONING_DIALECT, &thinking),
    })
}

/// A streamed Messages answer: its events folded into the answer's blocks and usage.
#[derive(Debug, Default)]
pub struct MessagesStream {
    blocks: Vec<Value>,
    /// Tool input JSON so far, by block index.
    inputs: Vec<String>,
    usage: serde_json::Map<String, Value>,
    stop_reason: Option<String>,
    /// `message_stop` arrived.
    stopped: bool,
    model: Option<String>,
    chars: u64,
}

impl StreamState for MessagesStream {
    fn event(&mut self, name: &str, data: &str) -> Result<(), String> {
        let v: Value =
            serde_json::from_str(data).map_err(|e| format!("not a messages event: {e}"))?;
        let kind = v.get("type").and_then(Value::as_str).unwrap_or(name);
        match kind {
            "message_start" => {
                let message = v.get("message");
                self.model = message
                    .and_then(|m| m.get("model"))
                    .and_then(Value::as_str)
                    .map(str::to_string);
                self.merge_usage(message.and_then(|m| m.get("usage")));
            }
            "content_block_start" => {
                let i = index(&v);
                let block = v.get("content_block").cloned().unwrap_or(Value::Null);
                while self.blocks.len() <= i {
                    self.blocks.push(Value::Null);
                    self.inputs.push(String::new());
                }
                if let Some(slot) = self.blocks.get_mut(i) {
                    *slot = block;
                }
            }
            "content_block_delta" => {
                let i = index(&v);
                let delta = v.get("delta").cloned().unwrap_or(Value::Null);
                let text = |key: &str| delta.get(key).and_then(Value::as_str).unwrap_or("");
                let (field, piece) = match delta.get("type").and_then(Value::as_str) {
                    Some("text_delta") => ("text", text("text")),
                    Some("thinking_delta") => ("thinking", text("thinking")),
                    Some("signature_delta") => ("signature", text("signature")),
                    Some("input_json_delta") => ("", text("partial_json")),
                    _ => return Ok(()),
                };
                if field != "signature" {
                    self.chars += piece.chars().count() as u64;
                }
                if field.is_empty() {
                    if let Some(input) = self.inputs.get_mut(i) {
                        input.push_str(piece);
                    }
                } else if let Some(Value::Object(block)) = self.blocks.get_mut(i) {
                    let so_far = block
                        .get(field)
                        .and_then(Value::as_str)
                        .unwrap_or("")
                        .to_string();
                    block.insert(field.to_string(), Value::String(so_far + piece));
                }
            }
            "message_delta" => {
                if let Some(reason) = v
                    .get("delta")
                    .and_then(|d| d.get("stop_reason"))
                    .and_then(Value::as_str)
                {
                    self.stop_reason = Some(reason.to_string());
                }
                self.merge_usage(v.get("usage"));
            }
            "message_stop" => self.stopped = true,
            "error" => {
                let error = v.get("error").unwrap_or(&v);
                return Err(error
                    .get("message")
                    .and_then(Value::as_str)
                    .map_or_else(|| error.to_string(), str::to_string));
            }
            _ => {}
        }
        Ok(())
    }

    fn output_chars(&self) -> u64 {
        self.chars
    }

    fn finished(&self) -> bool {
        self.stopped || self.stop_reason.is_some()
    }

    fn input_usage(&self) -> Option<Usage> {
        let n = |key: &str| self.usage.get(key).and_then(Value::as_u64).unwrap_or(0);
        self.usage.get("input_tokens")?;
        let (read, written) = (
            n("cache_read_input_tokens"),
            n("cache_creation_input_tokens"),
        );
        Some(Usage {
            cached_tokens: read,
            cache_write_tokens: written,
            ..Usage::tokens(n("input_tokens") + read + written, 0)
        })
    }

    fn text(&self) -> Option<String> {
        let text: String = self
            .blocks
            .iter()
            .filter(|b| b.get("type").and_then(Value::as_str) == Some("text"))
            .filter_map(|b| b.get("text").and_then(Value::as_str))
            .collect();
        (!text.is_empty()).then_some(text)
    }

    fn body(&self) -> Value {
        let content: Vec<Value> = self
            .blocks
            .iter()
            .zip(&self.inputs)
            .filter(|(b, _)| !b.is_null())
            .map(|(block, input)| {
                let mut block = block.clone();
                if block.get("type").and_then(Value::as_str) == Some("tool_use")
                    && !input.trim().is_empty()
                {
                    // Arguments that are not JSON are kept as a string (the tool says so).
                    let parsed = serde_json::from_str::<Value>(input)
                        .unwrap_or_else(|_| Value::String(input.clone()));
                    if let Value::Object(b) = &mut block {
                        b.insert("input".to_string(), parsed);
                    }
                }
                block
            })
            .collect();
        json!({
            "content": content,
            "usage": self.usage,
            "stop_reason": self.stop_reason,
            "model": self.model,
        })
    }
}

impl MessagesStream {
    /// Usage fields of an event: later values replace earlier ones (`message_delta`
    /// repeats the input's and gives the final output count).
    fn merge_usage(&mut self, usage: Option<&Value>) {
        if let Some(Value::Object(fields)) = usage {
            for (k, v) in fields {
                if !v.is_null() {
                    self.usage.insert(k.clone(), v.clone());
                }
            }
        }
    }
}

/// A stream event's block `index`.
fn index(v: &Value) -> usize {
    v.get("index")
        .and_then(Value::as_u64)
        .and_then(|i| usize::try_from(i).ok())
        .unwrap_or(0)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn body(msgs: &[Message]) -> serde_json::Value {
        let req = ModelRequest::new("anthropic:m", msgs, &[], 9);
        let options = Options {
            cache: false,
            thinking_budget: None,
            stream: false,
        };
        serde_json::to_value(request("m", &req, &options)).unwrap()
    }

    // The suite's shape test (tests/suite/providers.rs) covers a tool round trip on the
    // wire; these cover the mapping's edges.

    #[test]
    fn systems_are_joined_empty_texts_dropped_and_roles_alternate() {
        let msgs = vec![
            Message::System { text: "one".into() },
            Message::User {
                text: "goal".into(),
            },
            Message::System { text: " ".into() },
            Message::System { text: "two".into() },
            Message::User {
                text: "steer".into(),
            },
            Message::User { text: "".into() },
            Message::Assistant {
                text: Some("  ".into()),
                tool_calls: vec![ToolCall {
                    id: "c".into(),
                    name: "x".into(),
                    args: json!("{broken"),
                }],
                reasoning: None,
            },
            Message::Tool {
                call_id: "c".into(),
                name: "x".into(),
                output: "out".into(),
            },
        ];
        assert_eq!(
            body(&msgs),
            json!({
                "model": "m",
                "max_tokens": 9,
                "system": "one\n\ntwo",
                "messages": [
                    {"role": "user", "content": [
                        {"type": "text", "text": "goal"},
                        {"type": "text", "text": "steer"}
                    ]},
                    {"role": "assistant", "content": [
                        {"type": "tool_use", "id": "c", "name": "x", "input": {"arguments": "{broken"}}
                    ]},
                    {"role": "user", "content": [
                        {"type": "tool_result", "tool_use_id": "c", "content": "out"}
                    ]}
                ],
                "stream": false
            })
        );
    }

    #[test]
    fn a_conversation_starts_with_the_user() {
        let v = body(&[Message::Assistant {
            text: Some("hi".into()),
            tool_calls: vec![],
            reasoning: None,
        }]);
        assert_eq!(
            v["messages"],
            json!([
                {"role": "user", "content": [{"type": "text", "text": "(continue)"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "hi"}]}
            ])
        );
        assert!(v.get("system").is_none());
    }
}
