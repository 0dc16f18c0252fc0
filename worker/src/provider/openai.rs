//! `openai:NAME`: OpenAI-compatible chat completions (OpenAI, vLLM, Ollama, llama.cpp
//! server, OpenRouter, ...).
//!
//! One call is `POST {base_url}/chat/completions` (default base
//! `https://api.openai.com/v1`) with `Authorization: Bearer KEY` when there is a key (see
//! [`super::http`] for the key, the retries, streaming and the errors) and the body
//! `{model: NAME, messages, tools?, max_tokens | max_completion_tokens, reasoning_effort?,
//! prompt_cache_key?, stream, stream_options?}`:
//!
//! - messages: system → `system`, user → `user`, an assistant turn → `assistant` with
//!   `content` (`""` when it only calls tools: OpenAI takes null too, llama.cpp's server
//!   answers null with a 500) and `tool_calls`
//!   (`[{id, type: "function", function: {name, arguments}}]`, the arguments as a JSON
//!   string), a tool result → `{"role": "tool", "tool_call_id", "content"}`;
//! - tools: `[{type: "function", function: {name, description, parameters}}]`, left out when
//!   there are none (some servers refuse an empty list);
//! - the output cap as `max_completion_tokens` for OpenAI's own API (its reasoning models
//!   refuse `max_tokens`) and `max_tokens` for any other base URL (what llama.cpp, vLLM,
//!   Ollama and OpenRouter read); the spec's `token_param` chooses either;
//! - `reasoning_effort` when the spec sets it;
//! - `prompt_cache_key` (`forkfleet-{fork root}`) unless `cache = "off"`: every branch of
//!   a fork tree is routed to the same cache, so the parent history they all send is
//!   cached once;
//! - streaming: `stream: true` and `stream_options: {include_usage: true}` (the usage comes
//!   in the last chunk); the chunks' `delta`s are folded into one message (text appended,
//!   tool calls by `index`: id and name from the first, arguments appended).
//!
//! The answer's `choices[0].message` gives the text (`content`) and the tool calls (their
//! arguments parsed from their JSON string; text that is not JSON is kept as a JSON
//! string, so the tool reports the error to the model; a missing id becomes
//! `call_{turn}_{i}`). `usage` gives `prompt_tokens` (input, cached ones included),
//! `completion_tokens` (output, reasoning included), `prompt_tokens_details.cached_tokens`
//! (cached) and `completion_tokens_details.reasoning_tokens`; an answer without usage is
//! estimated from sizes, with a warning.

use super::http::{
    call_id, estimated_usage, parse_arguments, Api, Dialect, HttpProvider, StreamState, Vendor,
};
use super::{ModelReply, ModelRequest, ToolSpec};
use crate::error::WorkerError;
use forkfleet_shared::endpoint::{TokenParam, ToolChoice};
use forkfleet_shared::event::{Message, ToolCall, Usage};
use serde::de::IgnoredAny;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

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
    type Stream = ChatStream;

    fn body(api: &Api, req: &ModelRequest<'_>) -> serde_json::Result<Vec<u8>> {
        let settings = api.settings();
        let options = ChatOptions {
            token_param: api.token_param(),
            reasoning_effort: settings.reasoning_effort.as_deref(),
            cache: settings.cache,
            stream: settings.stream,
            tool_choice: settings.tool_choice,
        };
        serde_json::to_vec(&request(api.name(), req, &options))
    }

    fn reply(api: &Api, body: &[u8], req: &ModelRequest<'_>) -> Result<ModelReply, WorkerError> {
        reply(api, body, req)
    }
}

/// What the spec's settings make of a request.
struct ChatOptions<'a> {
    token_param: TokenParam,
    reasoning_effort: Option<&'a str>,
    cache: bool,
    stream: bool,
    tool_choice: Option<ToolChoice>,
}

/// The prompt-cache key of a cache family (the fork tree's root).
pub(super) fn prompt_cache_key(req: &ModelRequest<'_>, cache: bool) -> Option<String> {
    req.cache_key
        .filter(|_| cache)
        .map(|k| format!("forkfleet-{k}"))
}

#[derive(Serialize)]
struct ChatRequest<'a> {
    model: &'a str,
    messages: Vec<ChatMessage<'a>>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    tools: Vec<ChatTool<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_choice: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    max_tokens: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    max_completion_tokens: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reasoning_effort: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    temperature: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    prompt_cache_key: Option<String>,
    stream: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    stream_options: Option<StreamOptions>,
}

#[derive(Serialize)]
struct StreamOptions {
    include_usage: bool,
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
fn request<'a>(
    name: &'a str,
    req: &'a ModelRequest<'a>,
    options: &ChatOptions<'a>,
) -> ChatRequest<'a> {
    let messages = req
        .messages
        .iter()
        .map(|m| match m {
            Message::System { text } => ChatMessage::System { content: text },
            Message::User { text } => ChatMessage::User { content: text },
            Message::Assistant {
                text, tool_calls, ..
            } => ChatMessage::Assistant {
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
    let cap = Some(req.max_output_tokens);
    let completion = options.token_param == TokenParam::MaxCompletionTokens;
    ChatRequest {
        model: name,
        messages,
        tools: req.tools.iter().map(tool).collect(),
        tool_choice: options
            .tool_choice
            .filter(|_| !req.tools.is_empty())
            .map(ToolChoice::as_str),
        max_tokens: cap.filter(|_| !completion),
        max_completion_tokens: cap.filter(|_| completion),
        reasoning_effort: options.reasoning_effort,
        // A reasoning model takes no sampling parameters (OpenAI refuses `temperature`
        // beside `reasoning_effort`).
        temperature: req
            .temperature
            .filter(|_| options.reasoning_effort.is_none()),
        prompt_cache_key: prompt_cache_key(req, options.cache),
        stream: options.stream,
        stream_options: options.stream.then_some(StreamOptions {
            include_usage: true,
        }),
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
    /// The model's refusal, in place of content.
    #[serde(default)]
    refusal: Option<String>,
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
    #[serde(default)]
    completion_tokens_details: Option<CompletionDetails>,
}

#[derive(Deserialize)]
struct PromptDetails {
    #[serde(default)]
    cached_tokens: Option<u64>,
}

#[derive(Deserialize)]
struct CompletionDetails {
    #[serde(default)]
    reasoning_tokens: Option<u64>,
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
    let refusal = message.refusal.filter(|r| !r.is_empty());
    let refused = refusal.is_some();
    let text = content_text(message.content).or(refusal);
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
            completion_tokens_details,
        }) => Usage {
            cached_tokens: prompt_tokens_details
                .and_then(|d| d.cached_tokens)
                .unwrap_or(0),
            reasoning_tokens: completion_tokens_details
                .and_then(|d| d.reasoning_tokens)
                .unwrap_or(0),
            ..Usage::tokens(input, output)
        },
        _ => estimated_usage(api, req, text.as_deref(), &tool_calls),
    };
    Ok(ModelReply {
        text,
        tool_calls,
        usage,
        response_model,
        // A refusal is its own end (its text kept), whatever finish reason came with it.
        finish_reason: if refused {
            Some(super::REFUSAL.to_string())
        } else {
            choice.finish_reason
        },
        reasoning: None,
    })
}

/// A streamed chat completion: its chunks folded into one choice.
#[derive(Debug, Default)]
pub struct ChatStream {
    text: String,
    /// The model's refusal so far.
    refusal: String,
    /// Tool calls by their `index`: id, name, arguments so far.
    calls: Vec<(Option<String>, String, String)>,
    finish_reason: Option<String>,
    usage: Option<Value>,
    model: Option<String>,
    chars: u64,
}

#[derive(Deserialize)]
struct Chunk {
    #[serde(default)]
    choices: Vec<ChunkChoice>,
    #[serde(default)]
    usage: Option<Value>,
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    error: Option<Value>,
}

#[derive(Deserialize)]
struct ChunkChoice {
    #[serde(default)]
    delta: Option<Delta>,
    #[serde(default)]
    finish_reason: Option<String>,
}

#[derive(Deserialize)]
struct Delta {
    #[serde(default)]
    content: Option<String>,
    #[serde(default)]
    refusal: Option<String>,
    #[serde(default)]
    tool_calls: Vec<DeltaCall>,
}

#[derive(Deserialize)]
struct DeltaCall {
    #[serde(default)]
    index: Option<usize>,
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    function: Option<DeltaFunction>,
}

#[derive(Deserialize)]
struct DeltaFunction {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    arguments: Option<String>,
}

impl ChatStream {
    /// The slot of a tool-call delta: its `index`; without one (Gemini's compatible
    /// endpoint sends none) the call with its `id`, else a new call when it names a
    /// function and the last call has a name already, else the last call.
    fn slot_of(&self, call: &DeltaCall) -> usize {
        if let Some(i) = call.index {
            return i;
        }
        if let Some(id) = &call.id {
            return self
                .calls
                .iter()
                .position(|c| c.0.as_deref() == Some(id.as_str()))
                .unwrap_or(self.calls.len());
        }
        let names = call
            .function
            .as_ref()
            .is_some_and(|f| f.name.as_deref().is_some_and(|n| !n.is_empty()));
        match self.calls.last() {
            Some(last) if !names || last.1.is_empty() => self.calls.len() - 1,
            _ => self.calls.len(),
        }
    }
}

impl StreamState for ChatStream {
    fn event(&mut self, _name: &str, data: &str) -> Result<(), String> {
        let chunk: Chunk =
            serde_json::from_str(data).map_err(|e| format!("not a chat completion chunk: {e}"))?;
        if let Some(error) = chunk.error {
            return Err(error
                .get("message")
                .and_then(Value::as_str)
                .map_or_else(|| error.to_string(), str::to_string));
        }
        if chunk.model.is_some() {
            self.model = chunk.model;
        }
        if chunk.usage.as_ref().is_some_and(|u| !u.is_null()) {
            self.usage = chunk.usage;
        }
        for choice in chunk.choices {
            if choice.finish_reason.is_some() {
                self.finish_reason = choice.finish_reason;
            }
            let Some(delta) = choice.delta else { continue };
            if let Some(text) = delta.content {
                self.chars += text.chars().count() as u64;
                self.text.push_str(&text);
            }
            if let Some(text) = delta.refusal {
                self.chars += text.chars().count() as u64;
                self.refusal.push_str(&text);
            }
            for call in delta.tool_calls {
                let i = self.slot_of(&call);
                while self.calls.len() <= i {
                    self.calls.push((None, String::new(), String::new()));
                }
                let Some(slot) = self.calls.get_mut(i) else {
                    continue;
                };
                if call.id.is_some() {
                    slot.0 = call.id;
                }
                if let Some(f) = call.function {
                    // A name comes whole; a server that repeats it on every delta of the
                    // call is not read as `write_filewrite_file`.
                    if let Some(name) = f.name.filter(|n| *n != slot.1) {
                        self.chars += name.chars().count() as u64;
                        slot.1.push_str(&name);
                    }
                    if let Some(args) = f.arguments {
                        self.chars += args.chars().count() as u64;
                        slot.2.push_str(&args);
                    }
                }
            }
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
        self.finish_reason.is_some()
    }

    fn body(&self) -> Value {
        let calls: Vec<Value> = self
            .calls
            .iter()
            .map(|(id, name, args)| {
                json!({"id": id, "type": "function", "function": {"name": name, "arguments": args}})
            })
            .collect();
        json!({
            "model": self.model,
            "choices": [{
                "message": {"role": "assistant", "content": self.text, "tool_calls": calls,
                            "refusal": (!self.refusal.is_empty()).then_some(&self.refusal)},
                "finish_reason": self.finish_reason,
            }],
            "usage": self.usage,
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

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
                reasoning: None,
            },
            Message::Tool {
                call_id: "c1".into(),
                name: "read_file".into(),
                output: "text".into(),
            },
            Message::Assistant {
                text: None,
                tool_calls: vec![],
                reasoning: None,
            },
        ];
        let req = ModelRequest::new("openai:m", &msgs, &[], 7);
        let options = ChatOptions {
            token_param: TokenParam::MaxTokens,
            reasoning_effort: None,
            cache: true,
            stream: false,
            tool_choice: None,
        };
        let v = serde_json::to_value(request("m", &req, &options)).unwrap();
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
