//! The real providers against a real local HTTP server (axum on 127.0.0.1:0, in process)
//! that speaks each API: recorded requests, answers of the APIs' shapes, retries, errors,
//! cancellation; and a branch run through the agent on an OpenAI-compatible server.

use super::common::*;
use super::mock_api::*;
use forkfleet_shared::catalogue::{CatalogueModel, ModelCatalogue};
use forkfleet_shared::endpoint::{CacheMode, Endpoint};
use forkfleet_shared::error::ErrorKind;
use forkfleet_shared::event::{messages_from_events, Event, Message, ToolCall, Usage};
use forkfleet_shared::pricing::Price;
use forkfleet_shared::protocol::ControlCommand;
use forkfleet_shared::state::BranchState;
use forkfleet_worker::provider::http::{client, Backoff, CallSettings, Dialect, HttpProvider};
use forkfleet_worker::provider::{
    estimate_tokens, message_chars, AnthropicProvider, ModelProvider, ModelRequest, OpenAiProvider,
    ToolSpec,
};
use forkfleet_worker::{WorkerConfig, WorkerError};
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::{Duration, Instant};

// ---------------------------------------------------------------------------------------
// Helpers

pub(super) fn fast_backoff() -> Backoff {
    Backoff {
        base: Duration::from_millis(5),
        cap: Duration::from_millis(20),
        max_retry_after: Duration::from_secs(5),
    }
}

/// A catalogue entry for `server` (the worker's config `[models."NAME"]`).
pub(super) fn at(server: &MockApi, entry: CatalogueModel) -> CatalogueModel {
    CatalogueModel {
        base_url: Some(server.url.clone()),
        ..entry
    }
}

/// A catalogue of one model.
pub(super) fn catalogue_of(model: &str, entry: CatalogueModel) -> ModelCatalogue {
    ModelCatalogue {
        models: [(model.to_string(), entry)].into_iter().collect(),
        allowed_hosts: Vec::new(),
    }
}

/// The provider of `model` as a worker with `entry` in its catalogue builds it, with
/// neither streaming nor the prompt cache (the plain request shapes).
pub(super) fn provider<D: Dialect>(model: &str, entry: &CatalogueModel) -> HttpProvider<D> {
    let plain = Endpoint {
        stream: Some(false),
        cache: Some(CacheMode::Off),
        ..Endpoint::default()
    };
    provider_with(model, entry, &plain)
}

/// The provider of `model` with the spec's settings `spec`.
pub(super) fn provider_with<D: Dialect>(
    model: &str,
    entry: &CatalogueModel,
    spec: &Endpoint,
) -> HttpProvider<D> {
    let route = catalogue_of(model, entry.clone())
        .route(model, None)
        .unwrap();
    HttpProvider::new(model, &route, client().unwrap())
        .unwrap()
        .with_backoff(fast_backoff())
        .with_settings(CallSettings::of(Some(spec)))
}

pub(super) fn openai(server: &MockApi, ep: CatalogueModel) -> OpenAiProvider {
    provider("openai:test-model", &at(server, ep))
}

pub(super) fn anthropic(server: &MockApi, ep: CatalogueModel) -> AnthropicProvider {
    provider("anthropic:claude-test", &at(server, ep))
}

pub(super) fn req<'a>(messages: &'a [Message], tools: &'a [ToolSpec]) -> ModelRequest<'a> {
    ModelRequest {
        model: "test",
        messages,
        tools,
        max_output_tokens: 321,
        label: "a",
        index: 0,
        turn: 3,
        temperature: None,
        cache_key: None,
        shared_prefix: 0,
        spend_cap: None,
        meter: None,
    }
}

pub(super) fn user(text: &str) -> Vec<Message> {
    vec![Message::User { text: text.into() }]
}

/// A conversation with every kind of message, a tool call round trip included.
pub(super) fn conversation() -> Vec<Message> {
    vec![
        Message::System {
            text: "You are careful.".into(),
        },
        Message::User {
            text: "Read a.txt".into(),
        },
        Message::Assistant {
            text: Some("Reading.".into()),
            tool_calls: vec![ToolCall {
                id: "call_a".into(),
                name: "read_file".into(),
                args: json!({"path": "a.txt"}),
            }],
            reasoning: None,
        },
        Message::Tool {
            call_id: "call_a".into(),
            name: "read_file".into(),
            output: "contents of a".into(),
        },
    ]
}

pub(super) fn tools() -> Vec<ToolSpec> {
    vec![ToolSpec {
        name: "read_file".into(),
        description: "Read a file.".into(),
        parameters: json!({"type": "object", "properties": {"path": {"type": "string"}}}),
    }]
}

pub(super) fn header<'a>(r: &'a Recorded, name: &str) -> Option<&'a str> {
    r.headers.get(name).map(|v| v.to_str().unwrap())
}

pub(super) fn chat_text(text: &str, usage: Value) -> Value {
    json!({
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": "test-model",
        "choices": [{"index": 0, "finish_reason": "stop",
                     "message": {"role": "assistant", "content": text}}],
        "usage": usage,
    })
}

pub(super) fn messages_text(text: &str) -> Value {
    json!({
        "id": "msg_1", "type": "message", "role": "assistant", "model": "claude-test",
        "content": [{"type": "text", "text": text}],
        "stop_reason": "end_turn",
        "usage": {"input_tokens": 5, "output_tokens": 2},
    })
}

pub(super) fn key_file(dir: &tempfile::TempDir, key: &str) -> std::path::PathBuf {
    let path = dir.path().join("api-key");
    std::fs::write(&path, format!("{key}\n")).unwrap();
    path
}

pub(super) async fn call<P: ModelProvider>(
    p: &P,
    r: &ModelRequest<'_>,
) -> Result<forkfleet_worker::provider::ModelReply, WorkerError> {
    tokio::time::timeout(WAIT, p.complete(r))
        .await
        .expect("the call did not end within the wait")
}

// ---------------------------------------------------------------------------------------
// (1) Request and reply shapes

#[tokio::test]
async fn openai_requests_and_replies_have_the_api_shape() {
    let mut server = MockApi::start(|_, _| {
        ok(chat_text(
            "Hello there.",
            json!({"prompt_tokens": 120, "completion_tokens": 7, "total_tokens": 127,
                   "prompt_tokens_details": {"cached_tokens": 100}}),
        ))
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let from_file = openai(
        &server,
        CatalogueModel {
            api_key_file: Some(key_file(&dir, "sk-from-file-1234")),
            ..CatalogueModel::default()
        },
    );
    let msgs = conversation();
    let tools = tools();
    let reply = call(&from_file, &req(&msgs, &tools)).await.unwrap();
    assert_eq!(reply.text.as_deref(), Some("Hello there."));
    assert!(reply.tool_calls.is_empty());
    assert_eq!(
        reply.usage,
        Usage {
            input_tokens: 120,
            output_tokens: 7,
            cached_tokens: 100,
            cache_write_tokens: 0,
            reasoning_tokens: 0,
        }
    );

    // A key from an environment variable; a local server without any key gets none.
    std::env::set_var("FORKFLEET_TEST_KEY_OPENAI_SHAPE", "sk-from-env-5678");
    let from_env = openai(
        &server,
        CatalogueModel {
            api_key_env: Some("FORKFLEET_TEST_KEY_OPENAI_SHAPE".into()),
            ..CatalogueModel::default()
        },
    );
    let hi = user("hi");
    call(&from_env, &req(&hi, &[])).await.unwrap();
    let keyless = openai(&server, CatalogueModel::default());
    call(&keyless, &req(&hi, &[])).await.unwrap();
    server.until_request(2).await;

    let reqs = server.requests();
    assert_eq!(reqs.len(), 3);
    let first = &reqs[0];
    assert_eq!(first.path, "/v1/chat/completions");
    assert_eq!(
        header(first, "authorization"),
        Some("Bearer sk-from-file-1234")
    );
    assert_eq!(header(first, "content-type"), Some("application/json"));
    assert_eq!(
        first.body,
        json!({
            "model": "test-model",
            "messages": [
                {"role": "system", "content": "You are careful."},
                {"role": "user", "content": "Read a.txt"},
                {"role": "assistant", "content": "Reading.", "tool_calls": [
                    {"id": "call_a", "type": "function",
                     "function": {"name": "read_file", "arguments": "{\"path\":\"a.txt\"}"}}
                ]},
                {"role": "tool", "tool_call_id": "call_a", "content": "contents of a"}
            ],
            "tools": [{"type": "function", "function": {
                "name": "read_file", "description": "Read a file.",
                "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}
            }}],
            "max_tokens": 321,
            "stream": false
        })
    );
    assert_eq!(
        header(&reqs[1], "authorization"),
        Some("Bearer sk-from-env-5678")
    );
    // No tools: no `tools` key at all.
    assert!(reqs[1].body.get("tools").is_none(), "{}", reqs[1].body);
    assert_eq!(header(&reqs[2], "authorization"), None);

    // The key file is read at every call: a rotated key is sent by the next call.
    key_file(&dir, "sk-rotated-9999");
    call(&from_file, &req(&hi, &[])).await.unwrap();
    server.until_request(3).await;
    assert_eq!(
        header(&server.requests()[3], "authorization"),
        Some("Bearer sk-rotated-9999")
    );
}

#[tokio::test]
async fn anthropic_requests_and_replies_have_the_api_shape() {
    let mut server = MockApi::start(|_, _| {
        ok(json!({
            "id": "msg_1", "type": "message", "role": "assistant", "model": "claude-test",
            "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there."}],
            "stop_reason": "end_turn",
            "usage": {"input_tokens": 20, "output_tokens": 9,
                      "cache_creation_input_tokens": 30, "cache_read_input_tokens": 100},
        }))
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let from_file = anthropic(
        &server,
        CatalogueModel {
            api_key_file: Some(key_file(&dir, "sk-ant-file-1234")),
            ..CatalogueModel::default()
        },
    );
    let mut msgs = conversation();
    // A second tool result and a steer after it: all one user message.
    if let Message::Assistant { tool_calls, .. } = &mut msgs[2] {
        tool_calls.push(ToolCall {
            id: "call_b".into(),
            name: "read_file".into(),
            args: json!({"path": "b.txt"}),
        });
    }
    msgs.push(Message::Tool {
        call_id: "call_b".into(),
        name: "read_file".into(),
        output: "contents of b".into(),
    });
    msgs.push(Message::User {
        text: "Now summarise.".into(),
    });
    let tools = tools();
    let reply = call(&from_file, &req(&msgs, &tools)).await.unwrap();
    assert_eq!(reply.text.as_deref(), Some("Hello there."));
    assert_eq!(
        reply.usage,
        Usage {
            input_tokens: 150,
            output_tokens: 9,
            cached_tokens: 100,
            cache_write_tokens: 30,
            reasoning_tokens: 0,
        }
    );
    std::env::set_var("FORKFLEET_TEST_KEY_ANTHROPIC_SHAPE", "sk-ant-env-5678");
    let from_env = anthropic(
        &server,
        CatalogueModel {
            api_key_env: Some("FORKFLEET_TEST_KEY_ANTHROPIC_SHAPE".into()),
            ..CatalogueModel::default()
        },
    );
    let hi = user("hi");
    call(&from_env, &req(&hi, &[])).await.unwrap();
    server.until_request(1).await;

    let reqs = server.requests();
    let first = &reqs[0];
    assert_eq!(first.path, "/v1/messages");
    assert_eq!(header(first, "x-api-key"), Some("sk-ant-file-1234"));
    assert_eq!(header(first, "anthropic-version"), Some("2023-06-01"));
    assert_eq!(header(first, "authorization"), None);
    assert_eq!(
        first.body,
        json!({
            "model": "claude-test",
            "max_tokens": 321,
            "system": "You are careful.",
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "Read a.txt"}]},
                {"role": "assistant", "content": [
                    {"type": "text", "text": "Reading."},
                    {"type": "tool_use", "id": "call_a", "name": "read_file", "input": {"path": "a.txt"}},
                    {"type": "tool_use", "id": "call_b", "name": "read_file", "input": {"path": "b.txt"}}
                ]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "call_a", "content": "contents of a"},
                    {"type": "tool_result", "tool_use_id": "call_b", "content": "contents of b"},
                    {"type": "text", "text": "Now summarise."}
                ]}
            ],
            "tools": [{"name": "read_file", "description": "Read a file.",
                       "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}],
            "stream": false
        })
    );
    assert_eq!(header(&reqs[1], "x-api-key"), Some("sk-ant-env-5678"));
    assert!(reqs[1].body.get("system").is_none());
    assert!(reqs[1].body.get("tools").is_none());
}

// ---------------------------------------------------------------------------------------
// (2) Tool calls

#[tokio::test]
async fn openai_tool_calls_are_parsed() {
    let server = MockApi::start(|_, _| {
        ok(json!({
            "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
                "role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "write_file", "arguments": "{\"path\": \"x.txt\", \"content\": \"hi\"}"}},
                    {"type": "function",
                     "function": {"name": "read_file", "arguments": "{not json"}},
                    {"id": "", "type": "function",
                     "function": {"name": "list_files", "arguments": ""}}
                ]}}],
            // No usage (some local servers): estimated.
        }))
    })
    .await;
    let p = openai(&server, CatalogueModel::default());
    let msgs = user("write x.txt");
    let reply = call(&p, &req(&msgs, &[])).await.unwrap();
    assert_eq!(reply.text, None);
    assert_eq!(
        reply.tool_calls,
        vec![
            ToolCall {
                id: "call_1".into(),
                name: "write_file".into(),
                args: json!({"path": "x.txt", "content": "hi"}),
            },
            ToolCall {
                id: "call_3_1".into(),
                name: "read_file".into(),
                args: json!("{not json"),
            },
            ToolCall {
                id: "call_3_2".into(),
                name: "list_files".into(),
                args: json!({}),
            },
        ]
    );
    // No usage reported: the input at the bound a reservation holds (13 bytes, "write
    // x.txt" and the tool list `[]`, at two a token, and 8 tokens for each of the message
    // and the request: 23), the output at one token per four characters of the calls'
    // names and arguments as JSON (10 + 31, 9 + 11, 10 + 2).
    assert_eq!(
        reply.usage,
        Usage {
            input_tokens: 23,
            output_tokens: 19,
            cached_tokens: 0,
            cache_write_tokens: 0,
            reasoning_tokens: 0,
        }
    );
}

#[tokio::test]
async fn anthropic_tool_use_is_parsed() {
    let server = MockApi::start(|_, _| {
        ok(json!({
            "id": "msg_1", "type": "message", "role": "assistant",
            "content": [
                {"type": "text", "text": "Writing."},
                {"type": "tool_use", "id": "toolu_1", "name": "write_file",
                 "input": {"path": "x.txt", "content": "hi"}},
                {"type": "tool_use", "id": "toolu_2", "name": "list_files", "input": {}}
            ],
            "stop_reason": "tool_use",
            "usage": {"input_tokens": 11, "output_tokens": 22},
        }))
    })
    .await;
    let p = anthropic(&server, CatalogueModel::default());
    let msgs = user("write x.txt");
    let reply = call(&p, &req(&msgs, &[])).await.unwrap();
    assert_eq!(reply.text.as_deref(), Some("Writing."));
    assert_eq!(
        reply.tool_calls,
        vec![
            ToolCall {
                id: "toolu_1".into(),
                name: "write_file".into(),
                args: json!({"path": "x.txt", "content": "hi"}),
            },
            ToolCall {
                id: "toolu_2".into(),
                name: "list_files".into(),
                args: json!({}),
            },
        ]
    );
    assert_eq!(
        reply.usage,
        Usage {
            input_tokens: 11,
            output_tokens: 22,
            cached_tokens: 0,
            cache_write_tokens: 0,
            reasoning_tokens: 0,
        }
    );
}

// ---------------------------------------------------------------------------------------
// (3) 429 then success, honouring retry-after

#[tokio::test]
async fn a_429_is_retried_after_its_retry_after() {
    let mut server = MockApi::start(|n, _| match n {
        0 => Answer::Json(
            429,
            vec![("retry-after", "1".to_string())],
            json!({"error": {"message": "Rate limit reached", "type": "requests"}}),
        ),
        _ => ok(chat_text(
            "after the wait",
            json!({"prompt_tokens": 1, "completion_tokens": 1}),
        )),
    })
    .await;
    // Without retry-after the backoff would be no wait at all.
    let p = openai(&server, CatalogueModel::default()).with_backoff(Backoff {
        base: Duration::ZERO,
        cap: Duration::ZERO,
        max_retry_after: Duration::from_secs(5),
    });
    let msgs = user("hi");
    let started = Instant::now();
    let reply = call(&p, &req(&msgs, &[])).await.unwrap();
    let took = started.elapsed();
    server.until_request(1).await;
    assert_eq!(reply.text.as_deref(), Some("after the wait"));
    let reqs = server.requests();
    assert_eq!(reqs.len(), 2);
    let gap = reqs[1].at - reqs[0].at;
    assert!(gap >= Duration::from_secs(1), "retried after {gap:?}");
    assert!(took < Duration::from_secs(5), "took {took:?}");
}

#[tokio::test]
async fn retry_after_ms_is_honoured_and_long_waits_are_capped() {
    // Anthropic's overloaded 529 with retry-after-ms, then a retry-after of an hour (capped).
    let mut server = MockApi::start(|n, _| match n {
        0 => Answer::Json(
            529,
            vec![("retry-after-ms", "300".to_string())],
            json!({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}),
        ),
        1 => Answer::Json(
            429,
            vec![("retry-after", "3600".to_string())],
            json!({"type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}}),
        ),
        _ => ok(messages_text("ok")),
    })
    .await;
    let p = anthropic(&server, CatalogueModel::default()).with_backoff(Backoff {
        base: Duration::ZERO,
        cap: Duration::ZERO,
        max_retry_after: Duration::from_millis(400),
    });
    let msgs = user("hi");
    let reply = call(&p, &req(&msgs, &[])).await.unwrap();
    server.until_request(2).await;
    assert_eq!(reply.text.as_deref(), Some("ok"));
    let reqs = server.requests();
    assert_eq!(reqs.len(), 3);
    let first = reqs[1].at - reqs[0].at;
    let second = reqs[2].at - reqs[1].at;
    assert!(first >= Duration::from_millis(300), "{first:?}");
    assert!(
        second >= Duration::from_millis(400) && second < Duration::from_secs(5),
        "{second:?}"
    );
}

// ---------------------------------------------------------------------------------------
// (4) Retries exhausted

#[tokio::test]
async fn a_500_every_time_exhausts_the_retries() {
    let mut server = MockApi::start(|_, _| {
        Answer::Json(
            500,
            Vec::new(),
            json!({"error": {"message": "The server had an error", "type": "server_error"}}),
        )
    })
    .await;
    let p = openai(
        &server,
        CatalogueModel {
            max_retries: Some(2),
            ..CatalogueModel::default()
        },
    );
    let msgs = user("hi");
    let err = call(&p, &req(&msgs, &[])).await.unwrap_err();
    server.until_request(2).await;
    assert!(
        matches!(
            err,
            WorkerError::RetriesExhausted {
                tries: 3,
                last_status: Some(500),
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(err.kind(), ErrorKind::Unavailable);
    let text = err.to_string();
    assert!(
        text.contains("3 tries")
            && text.contains("HTTP 500")
            && text.contains("The server had an error")
            && text.contains(&server.url),
        "{text}"
    );
    assert_eq!(server.requests().len(), 3);
}

#[tokio::test]
async fn no_answer_is_retried_too() {
    // A request that times out, every time.
    let mut server = MockApi::start(|_, _| Answer::Hang).await;
    let p = openai(
        &server,
        CatalogueModel {
            timeout_s: Some(0.2),
            max_retries: Some(1),
            ..CatalogueModel::default()
        },
    );
    let msgs = user("hi");
    let err = call(&p, &req(&msgs, &[])).await.unwrap_err();
    server.until_request(1).await;
    assert!(
        matches!(
            err,
            WorkerError::RetriesExhausted {
                tries: 2,
                last_status: None,
                ..
            }
        ),
        "{err}"
    );
    let err = err.to_string();
    assert!(
        err.contains("2 tries") && err.contains("no answer within 0.2 s"),
        "{err}"
    );
    assert_eq!(server.requests().len(), 2);
    // Both timed-out requests were abandoned (their connections closed).
    server.until_dropped().await;
    server.until_dropped().await;

    // Nobody listening.
    let closed = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    let p: OpenAiProvider = provider(
        "openai:test-model",
        &CatalogueModel {
            base_url: Some(format!("http://127.0.0.1:{port}/v1")),
            max_retries: Some(1),
            ..CatalogueModel::default()
        },
    );
    let err = call(&p, &req(&msgs, &[])).await.unwrap_err().to_string();
    assert!(
        err.contains("2 tries") && err.contains("cannot connect"),
        "{err}"
    );
}

// ---------------------------------------------------------------------------------------
// (5) Cancellation

#[tokio::test]
async fn dropping_a_call_closes_its_connection() {
    for anthropic_api in [false, true] {
        let mut server = MockApi::start(|_, _| Answer::Hang).await;
        let p: Box<dyn ModelProvider> = if anthropic_api {
            Box::new(anthropic(&server, CatalogueModel::default()))
        } else {
            Box::new(openai(&server, CatalogueModel::default()))
        };
        let msgs = user("take your time");
        let r = req(&msgs, &[]);
        let mut fut = p.complete(&r);
        tokio::select! {
            _ = &mut fut => panic!("the server never answers"),
            got = server.arrived.recv() => assert_eq!(got, Some(0)),
            _ = tokio::time::sleep(WAIT) => panic!("no request within the wait"),
        }
        // As a terminated branch does: drop the call mid-request.
        drop(fut);
        server.until_dropped().await;
        assert_eq!(server.requests().len(), 1);
    }
}

// ---------------------------------------------------------------------------------------
// (6) Clear errors

#[tokio::test]
async fn errors_name_the_key_source_never_the_key() {
    const KEY: &str = "sk-test-very-secret-0123456789";
    // The API echoes the header it got, as some proxies do.
    let server = MockApi::start(|_, _| {
        Answer::Json(
            401,
            Vec::new(),
            json!({"error": {"message": format!("Incorrect API key provided: Bearer {KEY}"),
                             "type": "invalid_request_error", "code": "invalid_api_key"}}),
        )
    })
    .await;
    std::env::set_var("FORKFLEET_TEST_KEY_BAD", KEY);
    let p = openai(
        &server,
        CatalogueModel {
            api_key_env: Some("FORKFLEET_TEST_KEY_BAD".into()),
            ..CatalogueModel::default()
        },
    );
    let msgs = user("hi");
    let err = call(&p, &req(&msgs, &[])).await.unwrap_err();
    assert!(
        matches!(err, WorkerError::BadKey { status: 401, .. }),
        "{err}"
    );
    assert_eq!(err.kind(), ErrorKind::BadInput);
    let text = err.to_string();
    assert!(
        text.contains("rejected the key from env `FORKFLEET_TEST_KEY_BAD`"),
        "{text}"
    );
    assert!(text.contains("[redacted]"), "{text}");
    assert!(
        !text.contains(KEY) && !format!("{err:?}").contains(KEY),
        "{text}"
    );
    assert!(!format!("{p:?}").contains(KEY));
    // One request: a bad key is not retried.
    assert_eq!(server.requests().len(), 1);

    // No key where the endpoint says: the variable or the file is named.
    let unset = openai(
        &server,
        CatalogueModel {
            api_key_env: Some("FORKFLEET_TEST_KEY_NEVER_SET".into()),
            ..CatalogueModel::default()
        },
    );
    let err = call(&unset, &req(&msgs, &[]))
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("`FORKFLEET_TEST_KEY_NEVER_SET` is not set"),
        "{err}"
    );
    let missing = anthropic(
        &server,
        CatalogueModel {
            api_key_file: Some("/nonexistent/forkfleet/key".into()),
            ..CatalogueModel::default()
        },
    );
    let err = call(&missing, &req(&msgs, &[]))
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("/nonexistent/forkfleet/key"), "{err}");
    // (A vendor's own API without a key is refused before any request too: the unit tests
    // of `provider::http`, which do not depend on the environment.)
    assert_eq!(server.requests().len(), 1);
}

#[tokio::test]
async fn unknown_models_and_context_overflows_are_named() {
    let server = MockApi::start(|_, body| {
        let last = body["messages"]
            .as_array()
            .and_then(|m| m.last())
            .map(|m| m["content"].to_string())
            .unwrap_or_default();
        if body["model"] == "no-such-model" {
            Answer::Json(
                404,
                Vec::new(),
                json!({"error": {"message": "The model `no-such-model` does not exist",
                                 "type": "invalid_request_error", "code": "model_not_found"}}),
            )
        } else if body.get("system").is_some() || last.contains("anthropic") {
            Answer::Json(
                400,
                Vec::new(),
                json!({"type": "error", "error": {"type": "invalid_request_error",
                       "message": "prompt is too long: 250000 tokens > 200000 maximum"}}),
            )
        } else if last.contains("long") {
            Answer::Json(
                400,
                Vec::new(),
                json!({"error": {"message": "This model's maximum context length is 8192 tokens.",
                                 "type": "invalid_request_error", "code": "context_length_exceeded"}}),
            )
        } else {
            Answer::Json(
                400,
                Vec::new(),
                json!({"error": {"message": format!("bad temperature {}", "x".repeat(2000))}}),
            )
        }
    })
    .await;
    let unknown: OpenAiProvider = provider(
        "openai:no-such-model",
        &at(&server, CatalogueModel::default()),
    );
    let msgs = user("hi");
    let err = call(&unknown, &req(&msgs, &[])).await.unwrap_err();
    assert!(
        matches!(err, WorkerError::UnknownModel { status: 404, .. }),
        "{err}"
    );
    assert_eq!(err.kind(), ErrorKind::NotFound);
    let text = err.to_string();
    assert!(
        text.contains("does not know model `no-such-model`") && text.contains(&server.url),
        "{text}"
    );

    let p = openai(&server, CatalogueModel::default());
    let mut long = conversation();
    long.push(Message::User {
        text: "a long one".into(),
    });
    let err = call(&p, &req(&long, &[])).await.unwrap_err();
    assert!(
        matches!(err, WorkerError::ContextOverflow { messages: 5, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("context window"), "{err}");

    let a = anthropic(&server, CatalogueModel::default());
    let err = call(&a, &req(&long, &[])).await.unwrap_err();
    assert!(
        matches!(err, WorkerError::ContextOverflow { messages: 5, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("prompt is too long"), "{err}");

    // Any other 4xx: the status and the API's message, truncated; not retried.
    let before = server.requests().len();
    let err = call(&p, &req(&msgs, &[])).await.unwrap_err();
    assert!(matches!(err, WorkerError::Api { status: 400, .. }), "{err}");
    assert_eq!(err.kind(), ErrorKind::BadInput);
    let text = err.to_string();
    assert!(
        text.contains("HTTP 400")
            && text.contains("bad temperature")
            && text.contains("(truncated)"),
        "{text}"
    );
    assert!(text.len() < 1000, "{} chars", text.len());
    assert_eq!(server.requests().len(), before + 1);
}

// ---------------------------------------------------------------------------------------
// Through the agent

/// The key variable of the catalogue of [`catalogued`] (set by it).
const AGENT_KEY_ENV: &str = "FORKFLEET_TEST_KEY_AGENT";
const AGENT_KEY: &str = "sk-agent-test-4242";

/// A worker config whose catalogue has `openai:test-model` at `server`, with its key from
/// an environment variable.
pub(super) fn catalogued(server: &MockApi, concurrency: usize) -> WorkerConfig {
    std::env::set_var(AGENT_KEY_ENV, AGENT_KEY);
    let entry = at(
        server,
        CatalogueModel {
            api_key_env: Some(AGENT_KEY_ENV.into()),
            ..CatalogueModel::default()
        },
    );
    WorkerConfig {
        catalogue: Arc::new(catalogue_of("openai:test-model", entry)),
        ..config(concurrency)
    }
}

/// A worker config that allows a spec's own base_url on `hosts` (and offers no model).
fn allowing(hosts: &[&str], concurrency: usize) -> WorkerConfig {
    WorkerConfig {
        catalogue: Arc::new(ModelCatalogue {
            models: Default::default(),
            allowed_hosts: hosts.iter().map(|h| h.to_string()).collect(),
        }),
        ..config(concurrency)
    }
}

/// A spec's own `base_url` at `server` (no key source: a spec never has one).
fn spec_url(server: &MockApi) -> Endpoint {
    Endpoint {
        base_url: Some(server.url.clone()),
        ..Endpoint::default()
    }
}

/// A branch task for `openai:test-model`, which the worker's catalogue routes (see
/// [`catalogued`]).
pub(super) fn real_task(
    fx: &Fixture,
    _server: &MockApi,
    label: &str,
) -> forkfleet_shared::protocol::BranchTask {
    let (_, snap) = fx.snapshot(&[("README.md", "hello\n")]);
    let mut task = fx.task(label, 0, snap, fx.script(""));
    task.model = "openai:test-model".into();
    task.script = None;
    task.endpoint = None;
    task.price = Some(Price {
        input_per_mtok: 1.0,
        output_per_mtok: 2.0,
        cached_per_mtok: Some(0.5),
        cache_write_per_mtok: None,
    });
    task
}

#[tokio::test]
async fn a_branch_runs_against_an_openai_compatible_server() {
    let mut server = MockApi::start(|n, _| match n {
        0 => ok(json!({
            "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
                "role": "assistant", "content": "Writing the notes.", "tool_calls": [
                    {"id": "call_w", "type": "function", "function": {
                        "name": "write_file",
                        "arguments": "{\"path\": \"notes.md\", \"content\": \"real notes\\n\"}"}}
                ]}}],
            "usage": {"prompt_tokens": 900, "completion_tokens": 40,
                      "prompt_tokens_details": {"cached_tokens": 600}},
        })),
        _ => ok(chat_text(
            "The notes are written.",
            json!({"prompt_tokens": 1000, "completion_tokens": 8}),
        )),
    })
    .await;
    let fx = Fixture::new().await;
    let task = real_task(&fx, &server, "real");
    fx.enqueue(&task).await;
    let mut events = fx.events().await;
    let worker = start(&fx, catalogued(&server, 1)).await;
    events.until_terminal(&[task.run_id]).await;
    shutdown(worker).await;
    server.until_request(1).await;
    // The key of the worker's catalogue entry, from the worker's environment.
    for r in server.requests() {
        assert_eq!(
            header(&r, "authorization"),
            Some(format!("Bearer {AGENT_KEY}").as_str())
        );
    }

    assert_eq!(
        events.terminal(task.run_id),
        Some((BranchState::Done, None))
    );
    let log = events.of(task.run_id);
    let usages: Vec<(Usage, f64)> = log
        .iter()
        .filter_map(|e| match e {
            Event::Usage {
                model,
                usage,
                cost_usd,
                ..
            } => {
                assert_eq!(model, "openai:test-model");
                Some((*usage, *cost_usd))
            }
            _ => None,
        })
        .collect();
    assert_eq!(
        usages.iter().map(|(u, _)| *u).collect::<Vec<_>>(),
        vec![
            Usage {
                input_tokens: 900,
                output_tokens: 40,
                cached_tokens: 600,
                cache_write_tokens: 0,
                reasoning_tokens: 0,
            },
            Usage {
                input_tokens: 1000,
                output_tokens: 8,
                cached_tokens: 0,
                cache_write_tokens: 0,
                reasoning_tokens: 0,
            },
        ]
    );
    // 300 fresh at $1, 600 cached at $0.5, 40 out at $2 (per million).
    assert!((usages[0].1 - (300.0 + 300.0 + 80.0) / 1e6).abs() < 1e-12);
    assert!(log.iter().any(|e| matches!(e,
        Event::FileChange { change } if change.path().to_string() == "notes.md")));
    assert!(log.iter().any(|e| matches!(e,
        Event::ToolResult { call_id, name, ok: true, .. } if call_id == "call_w" && name == "write_file")));
    assert!(log.iter().any(|e| matches!(e,
        Event::ModelResponse { text: Some(t), .. } if t == "The notes are written.")));

    // The second request carried the tool call and its result back.
    let reqs = server.requests();
    assert_eq!(reqs.len(), 2);
    let msgs = reqs[1].body["messages"].as_array().unwrap();
    let n = msgs.len();
    assert_eq!(msgs[n - 2]["role"], "assistant");
    assert_eq!(msgs[n - 2]["tool_calls"][0]["id"], "call_w");
    assert_eq!(msgs[n - 1]["role"], "tool");
    assert_eq!(msgs[n - 1]["tool_call_id"], "call_w");
    assert_eq!(reqs[0].body["model"], "test-model");
    assert_eq!(reqs[0].body["max_tokens"], task.max_output_tokens);
    assert!(reqs[0].body["tools"].as_array().unwrap().len() >= 7);
}

#[tokio::test]
async fn terminate_aborts_a_slow_model_call() {
    let mut server = MockApi::start(|_, _| Answer::Hang).await;
    let fx = Fixture::new().await;
    let task = real_task(&fx, &server, "slow");
    fx.enqueue(&task).await;
    let mut events = fx.events().await;
    let worker = start(&fx, catalogued(&server, 1)).await;
    server.until_request(0).await;
    let asked = Instant::now();
    fx.send(
        task.run_id,
        ControlCommand::Terminate {
            reason: "too slow".into(),
        },
    )
    .await;
    events.until_terminal(&[task.run_id]).await;
    // The request was aborted: the server saw its connection close.
    server.until_dropped().await;
    let took = asked.elapsed();
    shutdown(worker).await;
    assert_eq!(
        events.terminal(task.run_id),
        Some((BranchState::Terminated, Some("too slow".into())))
    );
    // The call was sent, so its input may have been billed: its usage is the input
    // estimated from the request (no output came), published before the status.
    let log = events.of(task.run_id);
    let usages: Vec<&Event> = log
        .iter()
        .filter(|e| matches!(e, Event::Usage { .. }))
        .collect();
    let [Event::Usage {
        usage, cost_usd, ..
    }] = usages.as_slice()
    else {
        panic!("one usage event expected: {usages:?}");
    };
    // (Its messages and the worker's tool schemas, four characters a token.)
    let seen = messages_from_events(&fx.initial_log(&task));
    let tools =
        forkfleet_worker::toolspec::tools_json_bytes(forkfleet_worker::toolspec::tool_specs())
            as u64;
    assert_eq!(
        *usage,
        Usage::tokens(estimate_tokens(message_chars(&seen) + tools), 0)
    );
    assert!(*cost_usd > 0.0);
    assert!(matches!(log.last(), Some(Event::Status { .. })));
    assert_eq!(events.count(task.run_id, "model_response"), 0);
    assert!(took < Duration::from_secs(5), "took {took:?}");
    assert_eq!(server.requests().len(), 1);
}

#[tokio::test]
async fn a_judge_job_reaches_its_endpoint() {
    use forkfleet_shared::protocol::{JudgeJob, ResolveJob, ResolveJobReply};
    let mut server = MockApi::start(|_, _| {
        ok(chat_text(
            r#"{"winner": "b", "confidence": 0.8, "reasoning": "b is simpler"}"#,
            json!({"prompt_tokens": 500, "completion_tokens": 30}),
        ))
    })
    .await;
    let fx = Fixture::new().await;
    let worker = start(&fx, allowing(&["127.0.0.1"], 1)).await;
    let job = ResolveJob::Judge(JudgeJob {
        fork_id: fx.fork_id,
        model: "openai:judge-model".into(),
        price: None,
        script: None,
        prompt: "Pick a or b.".into(),
        labels: vec!["a".into(), "b".into()],
        candidates: Vec::new(),
        candidates_reason: None,
        max_output_tokens: 200,
        endpoint: Some(spec_url(&server)),
        trace: None,
    });
    let reply = ask_resolve(&fx, &job).await;
    shutdown(worker).await;
    let ResolveJobReply::Judge(run) = reply else {
        panic!("not a judge reply");
    };
    assert_eq!(run.error, None);
    assert_eq!(run.verdict.unwrap().winner, "b");
    assert_eq!(
        run.usage,
        Usage {
            input_tokens: 500,
            output_tokens: 30,
            cached_tokens: 0,
            cache_write_tokens: 0,
            reasoning_tokens: 0,
        }
    );
    server.until_request(0).await;
    let reqs = server.requests();
    assert_eq!(reqs[0].body["model"], "judge-model");
    assert_eq!(reqs[0].body["max_tokens"], 200);
    // A spec's own base_url runs with no key.
    assert_eq!(header(&reqs[0], "authorization"), None);
}

#[tokio::test]
async fn a_redirect_is_never_followed_with_the_key() {
    let elsewhere = MockApi::start(|_, _| ok(chat_text("never", json!({})))).await;
    let target = format!("{}/chat/completions", elsewhere.url);
    let mut server = MockApi::start(move |_, _| {
        Answer::Json(307, vec![("location", target.clone())], json!({}))
    })
    .await;
    for anthropic_api in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let entry = CatalogueModel {
            api_key_file: Some(key_file(&dir, "sk-redirected-1234")),
            max_retries: Some(0),
            ..CatalogueModel::default()
        };
        let p: Box<dyn ModelProvider> = if anthropic_api {
            Box::new(anthropic(&server, entry))
        } else {
            Box::new(openai(&server, entry))
        };
        let msgs = user("hi");
        let err = p.complete(&req(&msgs, &[])).await.unwrap_err().to_string();
        assert!(err.contains("307"), "{err}");
        assert!(!err.contains("sk-redirected-1234"), "{err}");
    }
    server.until_request(1).await;
    assert_eq!(elsewhere.requests().len(), 0, "the redirect was followed");
}

#[tokio::test]
async fn a_worker_refuses_a_model_its_catalogue_does_not_allow_before_any_request() {
    let server = MockApi::start(|_, _| ok(chat_text("never", json!({})))).await;
    let fx = Fixture::new().await;
    // A spec base_url on a host the worker does not allow (127.0.0.1 with another port
    // only), and a model the catalogue does not offer.
    let mut not_allowed = real_task(&fx, &server, "not-allowed");
    not_allowed.endpoint = Some(spec_url(&server));
    let mut not_offered = real_task(&fx, &server, "not-offered");
    not_offered.model = "openai:other-model".into();
    fx.enqueue(&not_allowed).await;
    fx.enqueue(&not_offered).await;
    let mut events = fx.events().await;
    let mut cfg = catalogued(&server, 2);
    cfg.catalogue = Arc::new(ModelCatalogue {
        allowed_hosts: vec!["127.0.0.1:1".into()],
        ..(*cfg.catalogue).clone()
    });
    let worker = start(&fx, cfg).await;
    events
        .until_terminal(&[not_allowed.run_id, not_offered.run_id])
        .await;
    shutdown(worker).await;
    let failed = |run| match events.terminal(run) {
        Some((BranchState::Failed, Some(reason))) => reason,
        other => panic!("not failed: {other:?}"),
    };
    let reason = failed(not_allowed.run_id);
    let host = server
        .url
        .trim_start_matches("http://")
        .split('/')
        .next()
        .unwrap()
        .to_string();
    for says in [
        "model `openai:test-model`",
        &format!("host `{host}`"),
        "allowed: 127.0.0.1:1",
    ] {
        assert!(reason.contains(says), "{says:?} not in {reason}");
    }
    let reason = failed(not_offered.run_id);
    assert!(
        reason.contains("model `openai:other-model` is not in the model catalogue of this worker (offered: openai:test-model)"),
        "{reason}"
    );
    assert!(!reason.contains(AGENT_KEY), "{reason}");
    assert_eq!(server.requests().len(), 0, "no request reached the server");
}
