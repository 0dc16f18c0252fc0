//! `anthropic:NAME`: the Anthropic Messages API with tool use.
//!
//! One call is `POST {base_url}/messages` (default base `https://api.anthropic.com/v1`)
//! with headers `x-api-key: KEY` (when there is a key; see [`super::http`] for the key,
//! the retries and the errors) and `anthropic-version: 2023-06-01`, and the body
//! `{model: NAME, max_tokens, system?, messages, tools?, stream: false}`:
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
//! - tools: `[{name, description, input_schema}]`, left out when there are none.
//!
//! The answer's `content` gives the text (its `text` blocks, joined) and the tool calls (its
//! `tool_use` blocks). `usage` gives input tokens as `input_tokens +
//! cache_creation_input_tokens + cache_read_input_tokens` (cache writes are counted at the
//! input price), cached tokens as `cache_read_input_tokens`, and output as `output_tokens`;
//! an answer without usage is estimated from sizes, with a warning.

use super::http::{call_id, estimated_usage, parse_arguments, Api, Dialect, HttpProvider, Vendor};
use super::{ModelReply, ModelRequest};
use crate::error::WorkerError;
use forkfleet_shared::event::{Message, ToolCall, Usage};
use serde::{Deserialize, Serialize};
use std::borrow::Cow;

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

    fn body(name: &str, req: &ModelRequest<'_>) -> serde_json::Result<Vec<u8>> {
        serde_json::to_vec(&request(name, req))
    }

    fn reply(api: &Api, body: &[u8], req: &ModelRequest<'_>) -> Result<ModelReply, WorkerError> {
        reply(api, body, req)
    }
}

#[derive(Serialize)]
struct MessagesRequest<'a> {
    model: &'a str,
    max_tokens: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    system: Option<String>,
    messages: Vec<Turn<'a>>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    tools: Vec<Tool<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    temperature: Option<f64>,
    stream: bool,
}

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
    },
    ToolUse {
        id: &'a str,
        name: &'a str,
        input: Cow<'a, serde_json::Value>,
    },
    ToolResult {
        tool_use_id: &'a str,
        content: &'a str,
    },
}

#[derive(Serialize)]
struct Tool<'a> {
    name: &'a str,
    description: &'a str,
    input_schema: &'a serde_json::Value,
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
    (!text.trim().is_empty()).then_some(Block::Text { text })
}

/// The request body of `req` for model `name`.
fn request<'a>(name: &'a str, req: &'a ModelRequest<'a>) -> MessagesRequest<'a> {
    let mut system: Vec<&str> = Vec::new();
    let mut turns: Vec<Turn<'a>> = Vec::new();
    for m in req.messages {
        let (role, blocks): (&'static str, Vec<Block<'a>>) = match m {
            Message::System { text } => {
                if !text.trim().is_empty() {
                    system.push(text);
                }
                continue;
            }
            Message::User { text } => ("user", text_block(text).into_iter().collect()),
            Message::Assistant { text, tool_calls } => {
                let mut blocks: Vec<Block<'a>> =
                    text.as_deref().and_then(text_block).into_iter().collect();
                blocks.extend(tool_calls.iter().map(|c| Block::ToolUse {
                    id: &c.id,
                    name: &c.name,
                    input: input(&c.args),
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
    if turns.first().is_none_or(|t| t.role != "user") {
        turns.insert(
            0,
            Turn {
                role: "user",
                content: vec![Block::Text { text: "(continue)" }],
            },
        );
    }
    MessagesRequest {
        model: name,
        max_tokens: req.max_output_tokens,
        system: (!system.is_empty()).then(|| system.join("\n\n")),
        messages: turns,
        tools: req
            .tools
            .iter()
            .map(|t| Tool {
                name: &t.name,
                description: &t.description,
                input_schema: &t.parameters,
            })
            .collect(),
        temperature: req.temperature,
        stream: false,
    }
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
    for block in resp.content {
        match block {
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
                input_tokens: input + written + read,
                output_tokens: output,
                cached_tokens: read,
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
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use serde_json::json;

    fn body(msgs: &[Message]) -> serde_json::Value {
        let req = ModelRequest {
            model: "anthropic:m",
            messages: msgs,
            tools: &[],
            max_output_tokens: 9,
            label: "a",
            index: 0,
            turn: 0,
            temperature: None,
        };
        serde_json::to_value(request("m", &req)).unwrap()
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
