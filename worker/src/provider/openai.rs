//! `openai:NAME`: OpenAI-compatible chat completions (OpenAI, vLLM, Ollama, llama.cpp
//! server, OpenRouter, ...).
//!
//! One call is `POST {base_url}/chat/completions` (default base
//! `https://api.openai.com/v1`) with `Authorization: Bearer KEY` when there is a key (see
//! [`super::http`] for the key, the retries and the errors) and the body
//! `{model: NAME, messages, tools?, max_tokens, stream: false}`:
//!
//! - messages: system → `system`, user → `user`, an assistant turn → `assistant` with
//!   `content` (`""` when it only calls tools: OpenAI takes null too, llama.cpp's server
//!   answers null with a 500) and `tool_calls`
//!   (`[{id, type: "function", function: {name, arguments}}]`, the arguments as a JSON
//!   string), a tool result → `{"role": "tool", "tool_call_id", "content"}`;
//! - tools: `[{type: "function", function: {name, description, parameters}}]`, left out when
//!   there are none (some servers refuse an empty list);
//! - `max_tokens` rather than `max_completion_tokens`: every compatible server knows it
//!   (OpenAI still accepts it for its chat models; reasoning models want the other).
//!
//! The answer's `choices[0].message` gives the text (`content`) and the tool calls (their
//! arguments parsed from their JSON string; text that is not JSON is kept as a JSON
//! string, so the tool reports the error to the model; a missing id becomes
//! `call_{turn}_{i}`). `usage` gives `prompt_tokens` (input, cached ones included),
//! `completion_tokens` (output) and `prompt_tokens_details.cached_tokens` (cached); an
//! answer without usage is estimated from sizes, with a warning.

use super::http::{call_id, estimated_usage, parse_arguments, Api, Dialect, HttpProvider, Vendor};
use super::{ModelReply, ModelRequest, ToolSpec};
use crate::error::WorkerError;
use forkfleet_shared::event::{Message, ToolCall, Usage};
use serde::de::IgnoredAny;
use serde::{Deserialize, Serialize};

/// OpenAI's API and defaults.
pub(crate) static VENDOR: Vendor = Vendor {
    provider: "openai",
    default_base_url: "https://api.openai.com/v1",
    host: "api.openai.com",
    path: "/chat/completions",
    key_header: "authorization",
    key_prefix: "Bearer ",
    headers: &[],
};

/// The chat completions dialect.
#[derive(Debug)]
pub struct OpenAi;

/// An OpenAI-compatible chat completions API.
pub type OpenAiProvider = HttpProvider<OpenAi>;

impl Dialect for OpenAi {
    const VENDOR: &'static Vendor = &VENDOR;

    fn body(name: &str, req: &ModelRequest<'_>) -> serde_json::Result<Vec<u8>> {
        serde_json::to_vec(&request(name, req))
    }

    fn reply(api: &Api, body: &[u8], req: &ModelRequest<'_>) -> Result<ModelReply, WorkerError> {
        reply(api, body, req)
    }
}

#[derive(Serialize)]
struct ChatRequest<'a> {
    model: &'a str,
    messages: Vec<ChatMessage<'a>>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    tools: Vec<ChatTool<'a>>,
    max_tokens: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    temperature: Option<f64>,
    stream: bool,
}

#[derive(Serialize)]
#[serde(tag = "role", rename_all = "lowercase")]
enum ChatMessage<'a> {
    System {
        content: &'a str,
    },
    User {
        content: &'a str,
    },
    Assistant {
        content: Option<&'a str>,
        #[serde(skip_serializing_if = "Vec::is_empty")]
        tool_calls: Vec<ChatToolCall<'a>>,
    },
    Tool {
        tool_call_id: &'a str,
        content: &'a str,
    },
}

#[derive(Serialize)]
struct ChatToolCall<'a> {
    id: &'a str,
    #[serde(rename = "type")]
    kind: &'static str,
    function: ChatFunctionCall<'a>,
}

#[derive(Serialize)]
struct ChatFunctionCall<'a> {
    name: &'a str,
    arguments: String,
}

#[derive(Serialize)]
struct ChatTool<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    function: ChatFunction<'a>,
}

#[derive(Serialize)]
struct ChatFunction<'a> {
    name: &'a str,
    description: &'a str,
    parameters: &'a serde_json::Value,
}

/// A tool call's arguments as the JSON string the API wants (arguments kept as a string
/// because they were not JSON go back as they came).
fn arguments_string(args: &serde_json::Value) -> String {
    match args {
        serde_json::Value::String(raw) => raw.clone(),
        other => other.to_string(),
    }
}

/// The request body of `req` for model `name`.
fn request<'a>(name: &'a str, req: &'a ModelRequest<'a>) -> ChatRequest<'a> {
    let messages = req
        .messages
        .iter()
        .map(|m| match m {
            Message::System { text } => ChatMessage::System { content: text },
            Message::User { text } => ChatMessage::User { content: text },
            Message::Assistant { text, tool_calls } => ChatMessage::Assistant {
                // Always a string: llama.cpp's server fails on a null content.
                content: Some(text.as_deref().unwrap_or("")),
                tool_calls: tool_calls
                    .iter()
                    .map(|c| ChatToolCall {
                        id: &c.id,
                        kind: "function",
                        function: ChatFunctionCall {
                            name: &c.name,
                            arguments: arguments_string(&c.args),
                        },
                    })
                    .collect(),
            },
            Message::Tool {
                call_id, output, ..
            } => ChatMessage::Tool {
                tool_call_id: call_id,
                content: output,
            },
        })
        .collect();
    ChatRequest {
        model: name,
        messages,
        tools: req.tools.iter().map(tool).collect(),
        max_tokens: req.max_output_tokens,
        temperature: req.temperature,
        stream: false,
    }
}

fn tool(t: &ToolSpec) -> ChatTool<'_> {
    ChatTool {
        kind: "function",
        function: ChatFunction {
            name: &t.name,
            description: &t.description,
            parameters: &t.parameters,
        },
    }
}

#[derive(Deserialize)]
struct ChatResponse {
    #[serde(default)]
    choices: Vec<Choice>,
    #[serde(default)]
    usage: Option<ChatUsage>,
    #[serde(default)]
    model: Option<String>,
}

#[derive(Deserialize)]
struct Choice {
    #[serde(default)]
    message: Option<ChoiceMessage>,
    #[serde(default)]
    finish_reason: Option<String>,
}

#[derive(Deserialize)]
struct ChoiceMessage {
    #[serde(default)]
    content: Option<Content>,
    #[serde(default)]
    tool_calls: Option<Vec<RawToolCall>>,
}

#[derive(Deserialize)]
struct RawToolCall {
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    function: Option<RawFunction>,
}

#[derive(Deserialize, Default)]
struct RawFunction {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    arguments: Option<serde_json::Value>,
}

#[derive(Deserialize)]
struct ChatUsage {
    #[serde(default)]
    prompt_tokens: Option<u64>,
    #[serde(default)]
    completion_tokens: Option<u64>,
    #[serde(default)]
    prompt_tokens_details: Option<PromptDetails>,
}

#[derive(Deserialize)]
struct PromptDetails {
    #[serde(default)]
    cached_tokens: Option<u64>,
}

/// A message's content: a string, or parts (whose texts are joined), or something else
/// (ignored).
#[derive(Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
    Other(IgnoredAny),
}

#[derive(Deserialize)]
struct ContentPart {
    #[serde(default)]
    text: Option<String>,
}

/// A message's text, `None` when empty.
fn content_text(content: Option<Content>) -> Option<String> {
    let text = match content? {
        Content::Text(s) => s,
        Content::Parts(parts) => parts.into_iter().filter_map(|p| p.text).collect(),
        Content::Other(_) => return None,
    };
    (!text.is_empty()).then_some(text)
}

/// The reply in a chat completion.
fn reply(api: &Api, body: &[u8], req: &ModelRequest<'_>) -> Result<ModelReply, WorkerError> {
    let resp: ChatResponse = serde_json::from_slice(body)
        .map_err(|e| api.bad_response(format!("not a chat completion: {e}")))?;
    let response_model = resp.model;
    let choice = resp
        .choices
        .into_iter()
        .next()
        .ok_or_else(|| api.bad_response("no choices"))?;
    if choice.finish_reason.as_deref() == Some("length") {
        tracing::debug!(model = %api.model(), "the reply was cut at max_tokens");
    }
    let message = choice
        .message
        .ok_or_else(|| api.bad_response("the choice has no message"))?;
    let text = content_text(message.content);
    let tool_calls = message
        .tool_calls
        .unwrap_or_default()
        .into_iter()
        .enumerate()
        .map(|(i, call)| {
            let RawFunction { name, arguments } = call.function.unwrap_or_default();
            let name = name
                .filter(|n| !n.is_empty())
                .ok_or_else(|| api.bad_response(format!("tool call {i} has no name")))?;
            Ok(ToolCall {
                id: call_id(call.id, req, i),
                name,
                args: parse_arguments(arguments),
            })
        })
        .collect::<Result<Vec<_>, WorkerError>>()?;
    let usage = match resp.usage {
        Some(ChatUsage {
            prompt_tokens: Some(input),
            completion_tokens: Some(output),
            prompt_tokens_details,
        }) => Usage {
            input_tokens: input,
            output_tokens: output,
            cached_tokens: prompt_tokens_details
                .and_then(|d| d.cached_tokens)
                .unwrap_or(0),
        },
        _ => estimated_usage(api, req, text.as_deref(), &tool_calls),
    };
    Ok(ModelReply {
        text,
        tool_calls,
        usage,
        response_model,
        finish_reason: choice.finish_reason,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn requests_map_every_message_kind() {
        let msgs = vec![
            Message::System { text: "sys".into() },
            Message::User { text: "hi".into() },
            Message::Assistant {
                text: None,
                tool_calls: vec![
                    ToolCall {
                        id: "c1".into(),
                        name: "read_file".into(),
                        args: json!({"path": "a"}),
                    },
                    ToolCall {
                        id: "c2".into(),
                        name: "x".into(),
                        args: json!("{broken"),
                    },
                ],
            },
            Message::Tool {
                call_id: "c1".into(),
                name: "read_file".into(),
                output: "text".into(),
            },
            Message::Assistant {
                text: None,
                tool_calls: vec![],
            },
        ];
        let req = ModelRequest {
            model: "openai:m",
            messages: &msgs,
            tools: &[],
            max_output_tokens: 7,
            label: "a",
            index: 0,
            turn: 0,
            temperature: None,
        };
        let v = serde_json::to_value(request("m", &req)).unwrap();
        assert_eq!(
            v,
            json!({
                "model": "m",
                "messages": [
                    {"role": "system", "content": "sys"},
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "", "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": "{\"path\":\"a\"}"}},
                        {"id": "c2", "type": "function", "function": {"name": "x", "arguments": "{broken"}}
                    ]},
                    {"role": "tool", "tool_call_id": "c1", "content": "text"},
                    {"role": "assistant", "content": ""}
                ],
                "max_tokens": 7,
                "stream": false
            })
        );
    }

    #[test]
    fn content_parts_are_joined() {
        let text = |v: serde_json::Value| {
            let m: ChoiceMessage = serde_json::from_value(json!({ "content": v })).unwrap();
            content_text(m.content)
        };
        assert_eq!(
            text(
                json!([{"type": "text", "text": "a"}, {"type": "image_url"}, {"type": "text", "text": "b"}])
            ),
            Some("ab".into())
        );
        assert_eq!(text(json!("c")), Some("c".into()));
        assert_eq!(text(json!("")), None);
        assert_eq!(text(json!(null)), None);
        assert_eq!(text(json!(7)), None);
    }
}
