//! Each API dialect as users run it, against a local server answering in the shapes the
//! real APIs answer (streamed and not, with cache and reasoning usage): prompt-cache
//! breakpoints and keys, reasoning settings, thinking blocks and reasoning items carried
//! between turns, streams assembled, a stream closed when its call is dropped or cut at a
//! spend cap, and truncated answers through the agent.

use super::common::*;
use super::mock_api::*;
use super::providers::{
    at, call, catalogued, conversation, provider_with, real_task, req, tools, user,
};
use forkfleet_shared::catalogue::CatalogueModel;
use forkfleet_shared::endpoint::{CacheMode, Endpoint, OpenAiApi, TokenParam, ToolChoice};
use forkfleet_shared::event::{messages_from_events, Event, Message, ToolCall, Usage};
use forkfleet_shared::ids::RunId;
use forkfleet_shared::pricing::{builtin_price, Price};
use forkfleet_shared::spec::{OnTruncated, CONTINUE_TRUNCATED};
use forkfleet_shared::state::BranchState;
use forkfleet_worker::provider::{
    estimate_tokens, message_chars, AnthropicProvider, ModelProvider, ModelRequest, OpenAiProvider,
    ResponsesProvider, SpendCap, StreamMeter, BUDGET_CUT,
};
use serde_json::{json, Value};

fn openai_with(server: &MockApi, spec: Endpoint) -> OpenAiProvider {
    provider_with(
        "openai:test-model",
        &at(server, CatalogueModel::default()),
        &spec,
    )
}

fn anthropic_with(server: &MockApi, spec: Endpoint) -> AnthropicProvider {
    provider_with(
        "anthropic:claude-test",
        &at(server, CatalogueModel::default()),
        &spec,
    )
}

fn responses_with(server: &MockApi, spec: Endpoint) -> ResponsesProvider {
    provider_with(
        "openai:test-model",
        &at(server, CatalogueModel::default()),
        &spec,
    )
}

fn no_stream() -> Endpoint {
    Endpoint {
        stream: Some(false),
        ..Endpoint::default()
    }
}

/// Every `cache_control` in a request body, as JSON paths.
fn breakpoints(v: &Value, path: String, out: &mut Vec<String>) {
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                if k == "cache_control" {
                    assert_eq!(x, &json!({"type": "ephemeral"}));
                    out.push(path.clone());
                } else {
                    breakpoints(x, format!("{path}.{k}"), out);
                }
            }
        }
        Value::Array(a) => {
            for (i, x) in a.iter().enumerate() {
                breakpoints(x, format!("{path}[{i}]"), out);
            }
        }
        _ => {}
    }
}

fn messages_answer() -> Value {
    json!({
        "id": "msg_1", "type": "message", "role": "assistant", "model": "claude-test",
        "content": [{"type": "text", "text": "ok"}],
        "stop_reason": "end_turn",
        "usage": {"input_tokens": 5, "output_tokens": 2},
    })
}

// ---------------------------------------------------------------------------------------
// Prompt caching

#[tokio::test]
async fn anthropic_breakpoints_mark_system_tools_the_shared_history_and_the_end() {
    let mut server = MockApi::start(|_, _| ok(messages_answer())).await;
    // The fork's shared history: the system prompt and the goal (2 messages); the branch's
    // own: its steer, a tool call and its result.
    let mut msgs = vec![
        Message::System {
            text: "You are careful.".into(),
        },
        Message::User {
            text: "Write the notes.".into(),
        },
        Message::User {
            text: "Take approach a.".into(),
        },
    ];
    msgs.extend(conversation().into_iter().skip(2));
    let tools = tools();
    let r = ModelRequest {
        shared_prefix: 2,
        ..req(&msgs, &tools)
    };
    let cached = anthropic_with(&server, no_stream());
    call(&cached, &r).await.unwrap();
    let off = anthropic_with(
        &server,
        Endpoint {
            cache: Some(CacheMode::Off),
            ..no_stream()
        },
    );
    call(&off, &r).await.unwrap();
    server.until_request(1).await;
    let reqs = server.requests();

    let body = &reqs[0].body;
    let mut found = Vec::new();
    breakpoints(body, String::new(), &mut found);
    found.sort();
    assert_eq!(
        found,
        vec![
            // The end of the shared history: the goal, the first block of the merged user
            // message (the steer after it is the branch's own).
            ".messages[0].content[0]",
            // The end of the request: the tool result (the rolling breakpoint).
            ".messages[2].content[0]",
            ".system[0]",
            ".tools[0]",
        ],
        "{body}"
    );
    assert_eq!(body["system"][0]["text"], "You are careful.");
    assert_eq!(
        body["messages"][0]["content"][0]["text"],
        "Write the notes."
    );
    assert!(body["messages"][0]["content"][1]
        .get("cache_control")
        .is_none());
    assert_eq!(body["messages"][2]["content"][0]["type"], "tool_result");

    // `cache = "off"`: no breakpoint, the system prompt a plain string.
    let mut none = Vec::new();
    breakpoints(&reqs[1].body, String::new(), &mut none);
    assert!(none.is_empty(), "{none:?}");
    assert_eq!(reqs[1].body["system"], "You are careful.");
}

#[tokio::test]
async fn openai_prompt_cache_key_is_the_fork_root_for_every_branch() {
    let mut server = MockApi::start(|_, _| {
        ok(json!({
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": "Done."}}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 1},
        }))
    })
    .await;
    let fx = Fixture::new().await;
    // Two branches of one fork tree, and a branch of another tree.
    let (root, other_root) = (RunId::new(), RunId::new());
    let mut a = real_task(&fx, &server, "a");
    let mut b = real_task(&fx, &server, "b");
    let mut c = real_task(&fx, &server, "c");
    a.fork_root = Some(root);
    b.fork_root = Some(root);
    c.fork_root = Some(other_root);
    for t in [&a, &b, &c] {
        fx.enqueue(t).await;
    }
    let mut events = fx.events().await;
    let worker = start(&fx, catalogued(&server, 3)).await;
    events.until_terminal(&[a.run_id, b.run_id, c.run_id]).await;
    shutdown(worker).await;
    server.until_request(2).await;
    let keys: std::collections::BTreeMap<String, String> = server
        .requests()
        .iter()
        .map(|r| {
            let steer = r.body["messages"].as_array().unwrap().last().unwrap()["content"]
                .as_str()
                .unwrap()
                .to_string();
            let key = r.body["prompt_cache_key"].as_str().unwrap().to_string();
            // Streamed by default, the usage asked for in the last chunk.
            assert_eq!(r.body["stream"], true);
            assert_eq!(r.body["stream_options"], json!({"include_usage": true}));
            (steer, key)
        })
        .collect();
    assert_eq!(keys.len(), 3, "{keys:?}");
    let key = |label: &str| keys[&format!("Take approach {label}.")].clone();
    assert_eq!(key("a"), format!("forkfleet-{root}"));
    assert_eq!(key("a"), key("b"), "the branches of a fork share a cache");
    assert_eq!(key("c"), format!("forkfleet-{other_root}"));
    assert_ne!(key("a"), key("c"), "another fork tree has another cache");

    // `cache = "off"`: no key.
    let off = openai_with(
        &server,
        Endpoint {
            cache: Some(CacheMode::Off),
            ..no_stream()
        },
    );
    let hi = user("hi");
    let r = ModelRequest {
        cache_key: Some("root"),
        ..req(&hi, &[])
    };
    call(&off, &r).await.unwrap();
    server.until_request(3).await;
    assert!(server.requests()[3].body.get("prompt_cache_key").is_none());
}

#[tokio::test]
async fn a_reservation_counts_only_a_confirmed_prefix_as_cached() {
    let mut server = MockApi::start(|n, _| {
        let usage = if n == 0 {
            json!({"input_tokens": 50, "output_tokens": 3,
                   "cache_creation_input_tokens": 4000, "cache_read_input_tokens": 0})
        } else {
            json!({"input_tokens": 60, "output_tokens": 3,
                   "cache_creation_input_tokens": 100, "cache_read_input_tokens": 4000})
        };
        ok(json!({
            "content": [{"type": "text", "text": "ok"}], "stop_reason": "end_turn",
            "model": "claude-test", "usage": usage,
        }))
    })
    .await;
    let p = anthropic_with(&server, no_stream());
    let msgs = vec![Message::User {
        text: "x".repeat(20_000),
    }];
    let r = req(&msgs, &[]);
    // Nothing confirmed yet: no cached input; all of it may be written (Anthropic's 1.25x).
    let first = p.estimate(&r);
    assert_eq!(first.cached_tokens, 0);
    assert_eq!(first.cache_write_tokens, first.input_tokens);
    let reply = call(&p, &r).await.unwrap();
    assert_eq!(
        reply.usage,
        Usage {
            cached_tokens: 0,
            cache_write_tokens: 4000,
            ..Usage::tokens(4050, 3)
        }
    );
    // The answer confirmed 4,000 tokens cached: the next estimate counts them cached.
    let second = p.estimate(&r);
    assert_eq!(second.cached_tokens, 4000);
    assert_eq!(second.input_tokens, first.input_tokens);
    assert_eq!(
        second.cache_write_tokens,
        second.input_tokens - second.cached_tokens
    );
    let price = builtin_price("anthropic:claude-sonnet-4").unwrap();
    let bound = forkfleet_shared::budget::estimate_cost(&price, &second);
    let reply = call(&p, &r).await.unwrap();
    assert!(price.cost(&reply.usage) <= bound);
    assert!(
        forkfleet_shared::budget::estimate_cost(&price, &first) > bound,
        "the confirmed prefix lowers the reservation"
    );
    server.until_request(1).await;

    // With the cache off nothing is counted cached, whatever the answers said.
    let off = anthropic_with(
        &server,
        Endpoint {
            cache: Some(CacheMode::Off),
            ..no_stream()
        },
    );
    call(&off, &r).await.unwrap();
    assert_eq!(off.estimate(&r).cached_tokens, 0);
    assert_eq!(off.estimate(&r).cache_write_tokens, 0);
}

// ---------------------------------------------------------------------------------------
// Streams

/// A chat completion streamed as OpenAI streams it: text, then a tool call whose
/// arguments come in pieces, the finish reason, then the usage in a last chunk.
fn chat_stream() -> Answer {
    let chunk = |delta: Value, finish: Value| {
        (
            "",
            json!({"id": "chatcmpl-9", "object": "chat.completion.chunk", "model": "o4-mini-2025-04-16",
                   "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}),
        )
    };
    sse(vec![
        chunk(json!({"role": "assistant", "content": ""}), Value::Null),
        chunk(json!({"content": "Reading "}), Value::Null),
        chunk(json!({"content": "the file."}), Value::Null),
        chunk(
            json!({"tool_calls": [{"index": 0, "id": "call_r", "type": "function",
                                   "function": {"name": "read_file", "arguments": ""}}]}),
            Value::Null,
        ),
        chunk(
            json!({"tool_calls": [{"index": 0, "function": {"arguments": "{\"pa"}}]}),
            Value::Null,
        ),
        chunk(
            json!({"tool_calls": [{"index": 0, "function": {"arguments": "th\": \"a.txt\"}"}}]}),
            Value::Null,
        ),
        chunk(json!({}), json!("tool_calls")),
        (
            "",
            json!({"id": "chatcmpl-9", "object": "chat.completion.chunk", "model": "o4-mini-2025-04-16",
                   "choices": [],
                   "usage": {"prompt_tokens": 2000, "completion_tokens": 300, "total_tokens": 2300,
                             "prompt_tokens_details": {"cached_tokens": 1536, "audio_tokens": 0},
                             "completion_tokens_details": {"reasoning_tokens": 256, "audio_tokens": 0}}}),
        ),
        ("", json!("[DONE]")),
    ])
}

#[tokio::test]
async fn a_streamed_chat_completion_is_assembled_and_reasoning_models_get_their_fields() {
    let mut server = MockApi::start(|_, _| chat_stream()).await;
    let p = openai_with(
        &server,
        Endpoint {
            reasoning_effort: Some("low".into()),
            token_param: Some(TokenParam::MaxCompletionTokens),
            ..Endpoint::default()
        },
    );
    let hi = user("Read a.txt");
    let r = ModelRequest {
        cache_key: Some("root-1"),
        ..req(&hi, &[])
    };
    let reply = call(&p, &r).await.unwrap();
    assert_eq!(reply.text.as_deref(), Some("Reading the file."));
    assert_eq!(
        reply.tool_calls,
        vec![ToolCall {
            id: "call_r".into(),
            name: "read_file".into(),
            args: json!({"path": "a.txt"}),
        }]
    );
    assert_eq!(reply.finish_reason.as_deref(), Some("tool_calls"));
    assert_eq!(reply.response_model.as_deref(), Some("o4-mini-2025-04-16"));
    assert_eq!(
        reply.usage,
        Usage {
            cached_tokens: 1536,
            reasoning_tokens: 256,
            ..Usage::tokens(2000, 300)
        }
    );
    // o4-mini's price: 464 fresh at $1.10, 1,536 cached at $0.275, 300 out (reasoning
    // included) at $4.40.
    let price = builtin_price("openai:o4-mini").unwrap();
    let want = (464.0 * 1.10 + 1536.0 * 0.275 + 300.0 * 4.40) / 1e6;
    assert!((price.cost(&reply.usage) - want).abs() < 1e-12);

    server.until_request(0).await;
    let body = &server.requests()[0].body;
    assert_eq!(body["max_completion_tokens"], 321);
    assert!(body.get("max_tokens").is_none(), "{body}");
    assert_eq!(body["reasoning_effort"], "low");
    assert_eq!(body["prompt_cache_key"], "forkfleet-root-1");
    assert_eq!(body["stream"], true);
}

/// `tool_choice` is sent only when the model's settings name one and the request has
/// tools (llama-cpp-python's `chatml-function-calling` format drops the tools without
/// `auto`; vLLM refuses `auto` unless started for it, so nothing is sent by default).
#[tokio::test]
async fn tool_choice_is_sent_with_tools_only_when_configured() {
    let mut server = MockApi::start(|_, _| chat_stream()).await;
    let auto = Endpoint {
        tool_choice: Some(ToolChoice::Auto),
        ..Endpoint::default()
    };
    let hi = user("Read a.txt");
    let tools = tools();
    let cases = [
        (auto.clone(), true, Some("auto")),
        (auto, false, None),
        (Endpoint::default(), true, None),
    ];
    for (endpoint, with_tools, _) in &cases {
        let p = openai_with(&server, endpoint.clone());
        let r = req(&hi, if *with_tools { &tools } else { &[] });
        call(&p, &r).await.unwrap();
    }
    server.until_request(2).await;
    let requests = server.requests();
    let sent: Vec<Option<&str>> = requests
        .iter()
        .map(|r| r.body.get("tool_choice").and_then(Value::as_str))
        .collect();
    let want: Vec<Option<&str>> = cases.iter().map(|c| c.2).collect();
    assert_eq!(sent, want);
    // A setting only `openai:` models take.
    let refused = Endpoint {
        tool_choice: Some(ToolChoice::Required),
        ..Endpoint::default()
    }
    .validate_for("anthropic")
    .unwrap_err();
    assert!(
        refused.contains("tool_choice is for openai: models"),
        "{refused}"
    );
}

/// An Anthropic answer streamed with extended thinking: thinking (and its signature), text,
/// a tool use whose input comes in pieces, cache usage in `message_start`.
fn messages_stream() -> Answer {
    let delta = |i: u64, d: Value| {
        (
            "content_block_delta",
            json!({"type": "content_block_delta", "index": i, "delta": d}),
        )
    };
    sse(vec![
        (
            "message_start",
            json!({"type": "message_start", "message": {
                "id": "msg_01", "type": "message", "role": "assistant", "model": "claude-sonnet-4-5-20250929",
                "content": [], "stop_reason": null, "stop_sequence": null,
                "usage": {"input_tokens": 12, "cache_creation_input_tokens": 300,
                          "cache_read_input_tokens": 19000, "output_tokens": 1}}}),
        ),
        (
            "content_block_start",
            json!({"type": "content_block_start", "index": 0,
                   "content_block": {"type": "thinking", "thinking": "", "signature": ""}}),
        ),
        delta(
            0,
            json!({"type": "thinking_delta", "thinking": "The file "}),
        ),
        delta(
            0,
            json!({"type": "thinking_delta", "thinking": "is needed."}),
        ),
        delta(
            0,
            json!({"type": "signature_delta", "signature": "EqQBCgIYAhIM1gbc"}),
        ),
        (
            "content_block_stop",
            json!({"type": "content_block_stop", "index": 0}),
        ),
        ("ping", json!({"type": "ping"})),
        (
            "content_block_start",
            json!({"type": "content_block_start", "index": 1,
                   "content_block": {"type": "text", "text": ""}}),
        ),
        delta(1, json!({"type": "text_delta", "text": "Reading it."})),
        (
            "content_block_stop",
            json!({"type": "content_block_stop", "index": 1}),
        ),
        (
            "content_block_start",
            json!({"type": "content_block_start", "index": 2,
                   "content_block": {"type": "tool_use", "id": "toolu_01", "name": "read_file", "input": {}}}),
        ),
        delta(2, json!({"type": "input_json_delta", "partial_json": ""})),
        delta(
            2,
            json!({"type": "input_json_delta", "partial_json": "{\"path\": \"a"}),
        ),
        delta(
            2,
            json!({"type": "input_json_delta", "partial_json": ".txt\"}"}),
        ),
        (
            "content_block_stop",
            json!({"type": "content_block_stop", "index": 2}),
        ),
        (
            "message_delta",
            json!({"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": null},
                   "usage": {"output_tokens": 95}}),
        ),
        ("message_stop", json!({"type": "message_stop"})),
    ])
}

#[tokio::test]
async fn a_streamed_anthropic_answer_keeps_its_thinking_for_the_next_turn() {
    let mut server = MockApi::start(|n, _| {
        if n == 0 {
            messages_stream()
        } else {
            ok(messages_answer())
        }
    })
    .await;
    let p = anthropic_with(
        &server,
        Endpoint {
            thinking_budget: Some(2048),
            ..Endpoint::default()
        },
    );
    let mut msgs = user("Read a.txt");
    let r = ModelRequest {
        temperature: Some(0.2),
        ..req(&msgs, &[])
    };
    let reply = call(&p, &r).await.unwrap();
    assert_eq!(reply.text.as_deref(), Some("Reading it."));
    assert_eq!(
        reply.tool_calls,
        vec![ToolCall {
            id: "toolu_01".into(),
            name: "read_file".into(),
            args: json!({"path": "a.txt"}),
        }]
    );
    assert_eq!(reply.finish_reason.as_deref(), Some("tool_use"));
    assert_eq!(
        reply.usage,
        Usage {
            cached_tokens: 19000,
            cache_write_tokens: 300,
            ..Usage::tokens(19312, 95)
        }
    );
    // Sonnet 4.5: 12 fresh at $3, 19,000 read at $0.30, 300 written at $3.75, 95 out at $15.
    let price = builtin_price("anthropic:claude-sonnet-4-5-20250929").unwrap();
    let want = (12.0 * 3.0 + 19000.0 * 0.3 + 300.0 * 3.75 + 95.0 * 15.0) / 1e6;
    assert!((price.cost(&reply.usage) - want).abs() < 1e-12);
    let reasoning = reply.reasoning.clone().expect("the thinking block is kept");

    // The next turn sends the thinking block back first, signature and all.
    msgs.push(Message::Assistant {
        text: reply.text,
        tool_calls: reply.tool_calls,
        reasoning: Some(reasoning),
    });
    msgs.push(Message::Tool {
        call_id: "toolu_01".into(),
        name: "read_file".into(),
        output: "contents".into(),
    });
    call(&p, &req(&msgs, &[])).await.unwrap();
    server.until_request(1).await;
    let reqs = server.requests();
    let first = &reqs[0].body;
    assert_eq!(
        first["thinking"],
        json!({"type": "enabled", "budget_tokens": 2048})
    );
    assert_eq!(first["max_tokens"], 321 + 2048);
    assert!(first.get("temperature").is_none(), "{first}");
    assert_eq!(first["stream"], true);
    let assistant = &reqs[1].body["messages"][1];
    assert_eq!(assistant["role"], "assistant");
    assert_eq!(
        assistant["content"][0],
        json!({"type": "thinking", "thinking": "The file is needed.", "signature": "EqQBCgIYAhIM1gbc"})
    );
    assert_eq!(assistant["content"][1]["type"], "text");
    assert_eq!(assistant["content"][2]["type"], "tool_use");
    assert_eq!(assistant["content"][2]["input"], json!({"path": "a.txt"}));
}

#[tokio::test]
async fn a_stream_error_event_is_an_error_naming_it() {
    let server = MockApi::start(|_, _| {
        sse(vec![
            (
                "message_start",
                json!({"type": "message_start", "message": {"model": "claude-test",
                       "usage": {"input_tokens": 5, "output_tokens": 1}}}),
            ),
            (
                "error",
                json!({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}),
            ),
        ])
    })
    .await;
    let p = anthropic_with(&server, Endpoint::default());
    let hi = user("hi");
    let err = call(&p, &req(&hi, &[])).await.unwrap_err().to_string();
    assert!(
        err.contains("stream reported an error") && err.contains("Overloaded"),
        "{err}"
    );
}

#[tokio::test]
async fn dropping_a_streamed_call_closes_its_stream_at_once() {
    let mut server = MockApi::start(|_, _| Answer::Sse {
        events: vec![(
            String::new(),
            json!({"choices": [{"index": 0, "delta": {"content": "Thinking about"}}]}).to_string(),
        )],
        hang: true,
    })
    .await;
    let p = std::sync::Arc::new(openai_with(&server, Endpoint::default()));
    let meter = std::sync::Arc::new(StreamMeter::default());
    let running = {
        let (p, meter) = (p.clone(), meter.clone());
        tokio::spawn(async move {
            let hi = user("hi");
            let r = ModelRequest {
                meter: Some(&meter),
                ..req(&hi, &[])
            };
            p.complete(&r).await
        })
    };
    // The call has read the first event of its stream (which never ends)...
    tokio::time::timeout(WAIT, async {
        while meter.get().is_none_or(|u| u.output_tokens == 0) {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the stream's first event was not read within the wait");
    assert!(!running.is_finished());
    // ...and its meter holds what it had streamed: the input estimated from the request
    // ("hi": 1 token; counted from the request's sending), 14 characters of output (4
    // tokens).
    assert_eq!(meter.get(), Some(Usage::tokens(1, 4)));
    running.abort();
    server.until_dropped().await;
}

#[tokio::test]
async fn a_stream_past_its_spend_cap_is_cut_and_its_text_kept() {
    // Words of text forever: only the cap ends this answer.
    let mut server = MockApi::start(|_, _| Answer::Sse {
        events: (0..40)
            .map(|i| {
                (
                    String::new(),
                    json!({"choices": [{"index": 0, "delta": {"content": format!("word{i:02} ")}}]})
                        .to_string(),
                )
            })
            .collect(),
        hang: true,
    })
    .await;
    let p = openai_with(&server, Endpoint::default());
    let hi = user("hi");
    // $1 a token out: the input (1 token at $0) and 20 tokens (80 characters) fit.
    let price = Price::flat(0.0, 1_000_000.0);
    let r = ModelRequest {
        spend_cap: Some(SpendCap {
            price,
            remaining_usd: 20.0,
            reservation: false,
        }),
        ..req(&hi, &[])
    };
    let reply = call(&p, &r).await.unwrap();
    assert_eq!(reply.finish_reason.as_deref(), Some(BUDGET_CUT));
    let text = reply.text.unwrap();
    assert!(text.starts_with("word00 word01 "), "{text}");
    // Cut as soon as the running cost passed the cap: 21 tokens = 84 characters, 12 words.
    assert_eq!(text.len(), 84, "{text}");
    assert!(reply.tool_calls.is_empty());
    assert_eq!(reply.usage.output_tokens, 21);
    assert!(price.cost(&reply.usage) > 20.0);
    // The stream was closed.
    server.until_dropped().await;
}

// ---------------------------------------------------------------------------------------
// The Responses API

fn response(output: Value, status: &str) -> Value {
    json!({
        "id": "resp_1", "object": "response", "model": "o4-mini-2025-04-16", "status": status,
        "incomplete_details": if status == "incomplete" { json!({"reason": "max_output_tokens"}) } else { Value::Null },
        "output": output,
        "usage": {"input_tokens": 3000, "input_tokens_details": {"cached_tokens": 2048},
                  "output_tokens": 400, "output_tokens_details": {"reasoning_tokens": 320},
                  "total_tokens": 3400},
    })
}

#[tokio::test]
async fn the_responses_api_carries_reasoning_items_and_tool_calls_between_turns() {
    let reasoning_item = json!({"type": "reasoning", "id": "rs_1", "summary": [],
                                "encrypted_content": "gAAAAABo-encrypted"});
    let first = response(
        json!([
            reasoning_item,
            {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "read_file",
             "arguments": "{\"path\":\"a.txt\"}", "status": "completed"}
        ]),
        "completed",
    );
    let second = response(
        json!([{"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
                "content": [{"type": "output_text", "text": "Done.", "annotations": []}]}]),
        "completed",
    );
    let mut server = MockApi::start(move |n, _| {
        if n == 0 {
            // The first answer streamed: deltas, then the whole response.
            sse(vec![
                (
                    "response.created",
                    json!({"type": "response.created", "response": {"id": "resp_1", "status": "in_progress", "output": []}}),
                ),
                (
                    "response.function_call_arguments.delta",
                    json!({"type": "response.function_call_arguments.delta", "item_id": "fc_1",
                           "output_index": 1, "delta": "{\"path\":\"a.txt\"}"}),
                ),
                (
                    "response.completed",
                    json!({"type": "response.completed", "response": first}),
                ),
            ])
        } else {
            ok(second.clone())
        }
    })
    .await;
    let p = responses_with(
        &server,
        Endpoint {
            api: Some(OpenAiApi::Responses),
            reasoning_effort: Some("medium".into()),
            ..Endpoint::default()
        },
    );
    let mut msgs = vec![
        Message::System {
            text: "You are careful.".into(),
        },
        Message::User {
            text: "Read a.txt".into(),
        },
    ];
    let tools = tools();
    let r = ModelRequest {
        cache_key: Some("root-2"),
        ..req(&msgs, &tools)
    };
    let reply = call(&p, &r).await.unwrap();
    assert_eq!(reply.text, None);
    assert_eq!(
        reply.tool_calls,
        vec![ToolCall {
            id: "call_1".into(),
            name: "read_file".into(),
            args: json!({"path": "a.txt"}),
        }]
    );
    assert_eq!(reply.finish_reason.as_deref(), Some("completed"));
    assert_eq!(
        reply.usage,
        Usage {
            cached_tokens: 2048,
            reasoning_tokens: 320,
            ..Usage::tokens(3000, 400)
        }
    );
    msgs.push(Message::Assistant {
        text: None,
        tool_calls: reply.tool_calls,
        reasoning: reply.reasoning,
    });
    msgs.push(Message::Tool {
        call_id: "call_1".into(),
        name: "read_file".into(),
        output: "contents".into(),
    });
    let p2 = responses_with(
        &server,
        Endpoint {
            api: Some(OpenAiApi::Responses),
            reasoning_effort: Some("medium".into()),
            ..no_stream()
        },
    );
    let done = call(&p2, &req(&msgs, &tools)).await.unwrap();
    assert_eq!(done.text.as_deref(), Some("Done."));
    server.until_request(1).await;
    let reqs = server.requests();
    assert_eq!(reqs[0].path, "/v1/responses");
    let body = &reqs[0].body;
    assert_eq!(body["instructions"], "You are careful.");
    assert_eq!(
        body["input"],
        json!([{"role": "user", "content": "Read a.txt"}])
    );
    assert_eq!(
        body["tools"][0],
        json!({"type": "function", "name": "read_file", "description": "Read a file.",
               "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}})
    );
    assert_eq!(body["max_output_tokens"], 321);
    assert_eq!(body["reasoning"], json!({"effort": "medium"}));
    assert_eq!(body["include"], json!(["reasoning.encrypted_content"]));
    assert_eq!(body["store"], false);
    assert_eq!(body["stream"], true);
    assert_eq!(body["prompt_cache_key"], "forkfleet-root-2");
    // The second turn: the reasoning item back as it came, then the call, then its output.
    assert_eq!(
        reqs[1].body["input"],
        json!([
            {"role": "user", "content": "Read a.txt"},
            reasoning_item,
            {"type": "function_call", "call_id": "call_1", "name": "read_file",
             "arguments": "{\"path\":\"a.txt\"}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "contents"}
        ])
    );
    assert_eq!(reqs[1].body["stream"], false);
}

#[tokio::test]
async fn an_incomplete_response_reports_the_output_cap() {
    let server = MockApi::start(|_, _| {
        ok(response(
            json!([{"type": "message", "role": "assistant",
                    "content": [{"type": "output_text", "text": "Half an ans"}]}]),
            "incomplete",
        ))
    })
    .await;
    let p = responses_with(&server, no_stream());
    let hi = user("hi");
    let reply = call(&p, &req(&hi, &[])).await.unwrap();
    assert_eq!(reply.text.as_deref(), Some("Half an ans"));
    assert_eq!(reply.finish_reason.as_deref(), Some("max_output_tokens"));
    assert!(forkfleet_worker::provider::is_truncated(
        reply.finish_reason.as_deref()
    ));
}

// ---------------------------------------------------------------------------------------
// Truncated answers and cut streams through the agent

/// An answer cut at the output cap, then (when asked to go on) a finished one.
const CUT_THEN_DONE: &str = r#"
[[turns."*"]]
text = "The plan is: first, read the"
finish_reason = "length"
usage = { input_tokens = 100, output_tokens = 96 }

[[turns."*"]]
text = "files, then write the notes. Done."
usage = { input_tokens = 200, output_tokens = 10 }
"#;

#[tokio::test]
async fn a_truncated_answer_continues_or_ends_truncated_never_done() {
    let fx = Fixture::new().await;
    let (_, snap) = fx.snapshot(&[]);
    let mut go_on = fx.task("go-on", 0, snap, fx.script(CUT_THEN_DONE));
    go_on.on_truncated = OnTruncated::Continue;
    let mut stop = fx.task("stop", 1, snap, fx.script(CUT_THEN_DONE));
    stop.on_truncated = OnTruncated::Stop;
    stop.max_output_tokens = 96;
    fx.enqueue(&go_on).await;
    fx.enqueue(&stop).await;
    let mut events = fx.events().await;
    let worker = start(&fx, config(2)).await;
    events.until_terminal(&[go_on.run_id, stop.run_id]).await;
    shutdown(worker).await;

    // `stop`: the branch ends `truncated`, saying why; the response records its reason.
    let (state, why) = events.terminal(stop.run_id).unwrap();
    assert_eq!(state, BranchState::Truncated);
    let why = why.unwrap();
    assert!(why.contains("max_output_tokens (96)"), "{why}");
    let finish: Vec<Option<String>> = events
        .of(stop.run_id)
        .iter()
        .filter_map(|e| match e {
            Event::ModelResponse { finish_reason, .. } => Some(finish_reason.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(finish, vec![Some("length".to_string())]);

    // `continue`: asked to go on, the branch finishes on its next answer.
    assert_eq!(
        events.terminal(go_on.run_id),
        Some((BranchState::Done, None))
    );
    let log = events.of(go_on.run_id);
    let kinds: Vec<String> = log
        .iter()
        .filter_map(|e| match e {
            Event::ModelResponse { finish_reason, .. } => {
                Some(format!("response:{}", finish_reason.clone().unwrap()))
            }
            Event::UserMessage { text } if text == CONTINUE_TRUNCATED => {
                Some("asked to go on".to_string())
            }
            _ => None,
        })
        .collect();
    assert_eq!(
        kinds,
        vec!["response:length", "asked to go on", "response:stop"]
    );
}

#[tokio::test]
async fn a_best_effort_branch_is_cut_mid_answer_at_its_cap() {
    let mut server = MockApi::start(|_, _| Answer::Sse {
        events: (0..200)
            .map(|i| {
                (
                    String::new(),
                    json!({"choices": [{"index": 0, "delta": {"content": format!("part{i:03} ")}}]})
                        .to_string(),
                )
            })
            .collect(),
        hang: true,
    })
    .await;
    let fx = Fixture::new().await;
    let mut task = real_task(&fx, &server, "capped");
    // real_task's price: $1 per million input tokens, $2 per million output. The input
    // (the messages and the worker's tool schemas at four characters a token, as the
    // stream reports none) and 92.5 tokens of output fit.
    let seen = messages_from_events(&fx.initial_log(&task));
    let tools =
        forkfleet_worker::toolspec::tools_json_bytes(forkfleet_worker::toolspec::tool_specs())
            as u64;
    let input = estimate_tokens(message_chars(&seen) + tools) as f64;
    task.budget_usd = Some((input + 185.0) / 1e6);
    fx.enqueue(&task).await;
    let mut events = fx.events().await;
    let worker = start(&fx, catalogued(&server, 1)).await;
    events.until_terminal(&[task.run_id]).await;
    shutdown(worker).await;
    server.until_dropped().await;

    let (state, why) = events.terminal(task.run_id).unwrap();
    assert_eq!(state, BranchState::BudgetExhausted);
    assert!(why.unwrap().contains("mid-answer"));
    let log = events.of(task.run_id);
    let (text, finish) = log
        .iter()
        .find_map(|e| match e {
            Event::ModelResponse {
                text,
                finish_reason,
                ..
            } => Some((text.clone().unwrap(), finish_reason.clone())),
            _ => None,
        })
        .unwrap();
    assert_eq!(finish.as_deref(), Some(BUDGET_CUT));
    assert!(text.starts_with("part000 part001"), "{text}");
    let cost: f64 = log
        .iter()
        .filter_map(|e| match e {
            Event::Usage { cost_usd, .. } => Some(*cost_usd),
            _ => None,
        })
        .sum();
    // Cut at the first event past the cap (47 parts of 8 characters: 94 tokens): over it
    // by one event's tokens.
    assert!((cost - (input + 94.0 * 2.0) / 1e6).abs() < 1e-12, "{cost}");
    assert_eq!(text.len(), 47 * 8, "{text}");
}
