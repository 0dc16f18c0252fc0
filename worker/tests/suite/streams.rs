//! Streams that end honestly, against a local server speaking each API's wire format: a
//! stream cut short is never a finished answer; one that fails before any of its answer is
//! tried again; a slow healthy stream outlives `timeout_s` while a stalled one does not;
//! index-less tool-call deltas stay apart; a stream that breaks is charged for what it
//! streamed; and a strict branch's answer is cut at its reservation when the provider
//! streams past `max_output_tokens`.

use super::common::*;
use super::mock_api::*;
use super::providers::{at, call, catalogued, provider_with, real_task, req, user};
use forkfleet_shared::budget::{BudgetReply, BudgetRequest, BUDGET_SUBJECT};
use forkfleet_shared::catalogue::CatalogueModel;
use forkfleet_shared::endpoint::Endpoint;
use forkfleet_shared::event::Event;
use forkfleet_shared::ids::ReservationId;
use forkfleet_shared::state::BranchState;
use forkfleet_shared::wire;
use forkfleet_worker::provider::{
    AnthropicProvider, ModelProvider, OpenAiProvider, ResponsesProvider, OUTPUT_CAP_CUT, REFUSAL,
    RESERVATION_CUT,
};
use serde_json::{json, Value};
use std::time::Duration;

fn entry(server: &MockApi, timeout_s: f64, max_retries: u32) -> CatalogueModel {
    at(
        server,
        CatalogueModel {
            timeout_s: Some(timeout_s),
            max_retries: Some(max_retries),
            ..CatalogueModel::default()
        },
    )
}

/// `model` at `server`, answering whole JSON (no stream), never retried.
fn unstreamed<D: forkfleet_worker::provider::http::Dialect>(
    server: &MockApi,
    model: &str,
) -> forkfleet_worker::provider::http::HttpProvider<D> {
    provider_with(
        model,
        &entry(server, 30.0, 0),
        &Endpoint {
            stream: Some(false),
            ..Endpoint::default()
        },
    )
}

fn openai(server: &MockApi, timeout_s: f64, retries: u32) -> OpenAiProvider {
    provider_with(
        "openai:test-model",
        &entry(server, timeout_s, retries),
        &Endpoint::default(),
    )
}

fn anthropic(server: &MockApi) -> AnthropicProvider {
    provider_with(
        "anthropic:claude-test",
        &entry(server, 30.0, 2),
        &Endpoint::default(),
    )
}

fn responses(server: &MockApi) -> ResponsesProvider {
    provider_with(
        "openai:test-model",
        &entry(server, 30.0, 2),
        &Endpoint {
            api: Some(forkfleet_shared::endpoint::OpenAiApi::Responses),
            ..Endpoint::default()
        },
    )
}

fn text_chunk(t: &str) -> (&'static str, Value) {
    (
        "",
        json!({"choices": [{"index": 0, "delta": {"content": t}}]}),
    )
}

fn finish_chunk() -> (&'static str, Value) {
    (
        "",
        json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
               "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}),
    )
}

/// A stream that never ends: a provider ignoring `max_tokens` (until the client goes).
fn endless() -> Answer {
    Answer::Sse {
        events: (0..5000)
            .map(|_| {
                let (n, v) = text_chunk("tokentokentoken ");
                (n.to_string(), v.to_string())
            })
            .collect(),
        hang: true,
    }
}

async fn ask<P: ModelProvider>(p: &P) -> Result<forkfleet_worker::provider::ModelReply, String> {
    let hi = user("hi");
    call(p, &req(&hi, &[])).await.map_err(|e| e.to_string())
}

#[tokio::test]
async fn a_stream_cut_short_is_an_error_in_every_dialect_never_an_answer() {
    // OpenAI chat: text, then the stream ends: no finish reason, no usage, no [DONE].
    let server =
        MockApi::start(|_, _| sse(vec![text_chunk("Half a sen"), text_chunk("tence")])).await;
    let err = ask(&openai(&server, 30.0, 2)).await.unwrap_err();
    assert!(
        err.contains("ended before the provider said the answer was finished"),
        "{err}"
    );
    // Some of the answer came: not tried again (it was generated, and billed).
    assert_eq!(server.requests().len(), 1);

    // Anthropic: message_start and a text delta, no message_delta, no message_stop.
    let server = MockApi::start(|_, _| {
        sse(vec![
            (
                "message_start",
                json!({"type": "message_start", "message": {
                "model": "claude-test", "usage": {"input_tokens": 5, "output_tokens": 1}}}),
            ),
            (
                "content_block_start",
                json!({"type": "content_block_start", "index": 0,
                "content_block": {"type": "text", "text": ""}}),
            ),
            (
                "content_block_delta",
                json!({"type": "content_block_delta", "index": 0,
                "delta": {"type": "text_delta", "text": "Half a sen"}}),
            ),
        ])
    })
    .await;
    let err = ask(&anthropic(&server)).await.unwrap_err();
    assert!(err.contains("ended before the provider said"), "{err}");
    assert_eq!(server.requests().len(), 1);

    // The Responses API: deltas, no response.completed.
    let server = MockApi::start(|_, _| {
        sse(vec![(
            "response.output_text.delta",
            json!({"type": "response.output_text.delta", "delta": "Half a sen"}),
        )])
    })
    .await;
    let err = ask(&responses(&server)).await.unwrap_err();
    assert!(err.contains("ended before the provider said"), "{err}");

    // With its finish reason (and no [DONE]), the same text is an answer.
    let server = MockApi::start(|_, _| sse(vec![text_chunk("Whole."), finish_chunk()])).await;
    let reply = ask(&openai(&server, 30.0, 2)).await.unwrap();
    assert_eq!(reply.text.as_deref(), Some("Whole."));
}

#[tokio::test]
async fn a_stream_that_fails_before_any_answer_is_tried_again() {
    // First an error event before any content, then an empty stream, then the answer.
    let server = MockApi::start(|n, _| match n {
        0 => sse(vec![(
            "",
            json!({"error": {"message": "overloaded", "type": "server_error"}}),
        )]),
        1 => sse(vec![]),
        _ => sse(vec![text_chunk("Third time."), finish_chunk()]),
    })
    .await;
    let reply = ask(&openai(&server, 30.0, 3)).await.unwrap();
    assert_eq!(reply.text.as_deref(), Some("Third time."));
    assert_eq!(server.requests().len(), 3);

    // Within the same number of tries as HTTP errors: one retry, two failures.
    let server = MockApi::start(|_, _| {
        sse(vec![(
            "",
            json!({"error": {"message": "overloaded", "type": "server_error"}}),
        )])
    })
    .await;
    let err = ask(&openai(&server, 30.0, 1)).await.unwrap_err();
    assert!(err.contains("overloaded"), "{err}");
    assert_eq!(server.requests().len(), 2);

    // An error event after content is final: the answer was generated.
    let server = MockApi::start(|_, _| {
        sse(vec![
            text_chunk("Some text"),
            ("", json!({"error": {"message": "internal"}})),
        ])
    })
    .await;
    let err = ask(&openai(&server, 30.0, 3)).await.unwrap_err();
    assert!(err.contains("internal"), "{err}");
    assert_eq!(server.requests().len(), 1);
}

#[tokio::test]
async fn a_slow_healthy_stream_outlives_timeout_s_and_a_stalled_one_does_not() {
    // Ten chunks 300 ms apart (3 s in all) under timeout_s = 1: each chunk is within the
    // bound of the one before.
    let server = MockApi::start(|_, _| {
        let mut events: Vec<(String, String)> = (0..9)
            .map(|i| {
                let (n, v) = text_chunk(&format!("w{i} "));
                (n.to_string(), v.to_string())
            })
            .collect();
        let (n, v) = finish_chunk();
        events.push((n.to_string(), v.to_string()));
        Answer::Paced {
            events,
            every: Duration::from_millis(300),
        }
    })
    .await;
    let reply = ask(&openai(&server, 1.0, 0)).await.unwrap();
    assert_eq!(reply.text.as_deref(), Some("w0 w1 w2 w3 w4 w5 w6 w7 w8 "));

    // One chunk, then nothing: failed on the idle bound, naming it.
    let mut server = MockApi::start(|_, _| {
        let (n, v) = text_chunk("Then silence");
        Answer::Sse {
            events: vec![(n.to_string(), v.to_string())],
            hang: true,
        }
    })
    .await;
    let err = ask(&openai(&server, 1.0, 2)).await.unwrap_err();
    assert!(err.contains("stalled"), "{err}");
    server.until_dropped().await;
}

#[tokio::test]
async fn tool_call_deltas_without_an_index_stay_apart() {
    // As Gemini's OpenAI-compatible endpoint sends them: each call whole, no `index`.
    let server = MockApi::start(|_, _| {
        sse(vec![
            ("", json!({"choices": [{"index": 0, "delta": {"tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "write_file", "arguments": "{\"path\":\"a\"}"}}]}}]})),
            ("", json!({"choices": [{"index": 0, "delta": {"tool_calls": [
                {"id": "c2", "type": "function", "function": {"name": "write_file", "arguments": "{\"path\":\"b\"}"}}]}}]})),
            ("", json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})),
        ])
    })
    .await;
    let reply = ask(&openai(&server, 30.0, 0)).await.unwrap();
    let calls: Vec<(String, String, Value)> = reply
        .tool_calls
        .iter()
        .map(|c| (c.id.clone(), c.name.clone(), c.args.clone()))
        .collect();
    assert_eq!(
        calls,
        vec![
            ("c1".into(), "write_file".into(), json!({"path": "a"})),
            ("c2".into(), "write_file".into(), json!({"path": "b"})),
        ]
    );
}

/// Run one branch of `label` against `server` on a worker: how it ended, and its log.
async fn run_one(server: &MockApi, label: &str) -> (BranchState, Option<String>, Vec<Event>) {
    let fx = Fixture::new().await;
    let task = real_task(&fx, server, label);
    fx.enqueue(&task).await;
    let mut events = fx.events().await;
    let worker = start(&fx, catalogued(server, 1)).await;
    events.until_terminal(&[task.run_id]).await;
    shutdown(worker).await;
    let (state, why) = events.terminal(task.run_id).unwrap();
    (state, why, events.of(task.run_id))
}

/// The branch's usage events: (cost, reservation).
fn usages(log: &[Event]) -> Vec<(f64, Option<ReservationId>)> {
    log.iter()
        .filter_map(|e| match e {
            Event::Usage {
                cost_usd,
                reservation,
                ..
            } => Some((*cost_usd, *reservation)),
            _ => None,
        })
        .collect()
}

#[tokio::test]
async fn a_stream_that_breaks_is_charged_for_what_it_streamed() {
    let server = MockApi::start(|_, _| {
        sse((0..50)
            .map(|i| text_chunk(if i % 2 == 0 { "abcd" } else { "efgh" }))
            .collect())
    })
    .await;
    let (state, why, log) = run_one(&server, "broken").await;
    assert_eq!(state, BranchState::Failed);
    assert!(why.unwrap().contains("ended before the provider said"));
    let paid = usages(&log);
    assert_eq!(paid.len(), 1, "{paid:?}");
    // 200 characters streamed: 50 output tokens at $2 a million, with the input.
    assert!(paid[0].0 > 100.0 / 1e6, "{paid:?}");
    assert!(
        !log.iter().any(|e| matches!(e, Event::ModelResponse { .. })),
        "a broken answer is not recorded as one"
    );
}

#[tokio::test]
async fn a_strict_branch_is_cut_at_its_reservation_when_the_provider_ignores_max_tokens() {
    // A provider that ignores `max_tokens`: text forever (and a bill to match).
    let mut server = MockApi::start(|_, _| endless()).await;
    let fx = Fixture::new().await;
    let mut task = real_task(&fx, &server, "strict");
    task.reserve = true;
    task.max_output_tokens = 100;
    task.on_truncated = forkfleet_shared::spec::OnTruncated::Stop;
    // Input free, output $2 a million: the reservation is the output cap's worth, and the
    // cut comes at 1.25 times it (before the output bound of twice the cap).
    task.price = Some(forkfleet_shared::pricing::Price::flat(0.0, 2.0));
    // The test's coordinator grants every reservation and records what it was asked.
    let mut rx = fx.bus.serve(BUDGET_SUBJECT).await.unwrap();
    let (asked_tx, mut asked) = tokio::sync::mpsc::unbounded_channel::<BudgetRequest>();
    tokio::spawn(async move {
        while let Some(req) = rx.recv().await {
            let r: BudgetRequest = wire::decode(&req.payload).unwrap();
            let reply = BudgetReply::Granted {
                reservation: ReservationId::new(),
            };
            req.respond(wire::encode(&reply).unwrap()).await.unwrap();
            let _ = asked_tx.send(r);
        }
    });
    fx.enqueue(&task).await;
    let mut events = fx.events().await;
    let worker = start(&fx, catalogued(&server, 1)).await;
    events.until_terminal(&[task.run_id]).await;
    shutdown(worker).await;
    server.until_dropped().await;

    let first = asked.try_recv().unwrap();
    let (state, _) = events.terminal(task.run_id).unwrap();
    assert_eq!(state, BranchState::Truncated);
    let log = events.of(task.run_id);
    let finish = log.iter().find_map(|e| match e {
        Event::ModelResponse { finish_reason, .. } => finish_reason.clone(),
        _ => None,
    });
    assert_eq!(finish.as_deref(), Some(RESERVATION_CUT));
    let paid = usages(&log);
    assert_eq!(paid.len(), 1);
    // What it cost stays within the reservation's margin (1.25) and one chunk of it.
    let chunk = 4.0 * 2.0 / 1e6;
    assert!(
        paid[0].0 <= first.estimate_usd * 1.25 + chunk,
        "spent {} of a reservation of {}",
        paid[0].0,
        first.estimate_usd
    );
    assert!(paid[0].0 > first.estimate_usd, "cut before the reservation");
    assert!(first.settles.is_none());
}

// ---------------------------------------------------------------------------------------
// Provider details that gave wrong results

#[tokio::test]
async fn a_refusal_is_its_own_end_with_its_text_kept() {
    // OpenAI chat, whole: a `refusal` in place of content.
    let server = MockApi::start(|_, _| {
        ok(
            json!({"choices": [{"index": 0, "finish_reason": "stop", "message": {
            "role": "assistant", "content": null, "refusal": "I can't help with that."}}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 6}}),
        )
    })
    .await;
    let p: OpenAiProvider = unstreamed(&server, "openai:test-model");
    let reply = ask(&p).await.unwrap();
    assert_eq!(reply.finish_reason.as_deref(), Some(REFUSAL));
    assert_eq!(reply.text.as_deref(), Some("I can't help with that."));

    // Streamed: refusal deltas.
    let server = MockApi::start(|_, _| {
        sse(vec![
            (
                "",
                json!({"choices": [{"index": 0, "delta": {"refusal": "I can't "}}]}),
            ),
            (
                "",
                json!({"choices": [{"index": 0, "delta": {"refusal": "do that."}}]}),
            ),
            finish_chunk(),
        ])
    })
    .await;
    let reply = ask(&openai(&server, 30.0, 0)).await.unwrap();
    assert_eq!(reply.finish_reason.as_deref(), Some(REFUSAL));
    assert_eq!(reply.text.as_deref(), Some("I can't do that."));

    // The Responses API: a `refusal` part.
    let server = MockApi::start(|_, _| {
        sse(vec![(
            "response.completed",
            json!({"type": "response.completed", "response": {"status": "completed",
                "output": [{"type": "message", "content": [{"type": "refusal", "refusal": "No."}]}],
                "usage": {"input_tokens": 3, "output_tokens": 1}}}),
        )])
    })
    .await;
    let reply = ask(&responses(&server)).await.unwrap();
    assert_eq!(reply.finish_reason.as_deref(), Some(REFUSAL));
    assert_eq!(reply.text.as_deref(), Some("No."));
}

#[tokio::test]
async fn a_refused_or_filtered_branch_ends_refused_never_done() {
    for (finish, text) in [("content_filter", "Partial"), ("stop", "")] {
        let server = MockApi::start(move |_, _| {
            let mut events = Vec::new();
            if !text.is_empty() {
                events.push(text_chunk(text));
            } else {
                events.push((
                    "",
                    json!({"choices": [{"index": 0, "delta": {"refusal": "I won't."}}]}),
                ));
            }
            events.push((
                "",
                json!({"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]}),
            ));
            sse(events)
        })
        .await;
        let (state, why, log) = run_one(&server, "refusing").await;
        assert_eq!(state, BranchState::Refused, "{finish}");
        let why = why.unwrap();
        let kept = log.iter().find_map(|e| match e {
            Event::ModelResponse { text, .. } => text.clone(),
            _ => None,
        });
        if text.is_empty() {
            assert!(why.contains("the model refused: I won't."), "{why}");
            assert_eq!(kept.as_deref(), Some("I won't."));
        } else {
            assert!(why.contains("content filter"), "{why}");
            assert_eq!(kept.as_deref(), Some("Partial"));
        }
    }
}

#[tokio::test]
async fn reasoning_requests_carry_no_sampling_and_responses_keep_their_items_resolvable() {
    let server = MockApi::start(|_, _| sse(vec![text_chunk("ok"), finish_chunk()])).await;
    let effort = Endpoint {
        reasoning_effort: Some("low".into()),
        ..Endpoint::default()
    };
    let p: OpenAiProvider = provider_with("openai:test-model", &entry(&server, 30.0, 0), &effort);
    let hi = user("hi");
    let r = forkfleet_worker::provider::ModelRequest {
        temperature: Some(0.7),
        ..req(&hi, &[])
    };
    call(&p, &r).await.unwrap();
    let body = &server.requests()[0].body;
    assert_eq!(body["reasoning_effort"], "low");
    assert!(body.get("temperature").is_none(), "{body}");

    // Responses without an effort: the encrypted items are asked for anyway, and a
    // reasoning item that came back without them (an older worker's) is not sent back.
    let server = MockApi::start(|_, _| {
        sse(vec![(
            "response.completed",
            json!({"type": "response.completed", "response": {"status": "completed",
                "output": [{"type": "message", "content": [{"type": "output_text", "text": "ok"}]}],
                "usage": {"input_tokens": 3, "output_tokens": 1}}}),
        )])
    })
    .await;
    let p = responses(&server);
    let history = vec![
        forkfleet_shared::event::Message::User { text: "hi".into() },
        forkfleet_shared::event::Message::Assistant {
            text: Some("first".into()),
            tool_calls: Vec::new(),
            reasoning: Some(
                json!({"dialect": "openai-responses", "items": [
                    {"type": "reasoning", "id": "rs_plain", "summary": []},
                    {"type": "reasoning", "id": "rs_enc", "summary": [], "encrypted_content": "gAAA"}
                ]})
                .to_string(),
            ),
        },
        forkfleet_shared::event::Message::User { text: "again".into() },
    ];
    let r = forkfleet_worker::provider::ModelRequest {
        temperature: Some(0.2),
        ..req(&history, &[])
    };
    call(&p, &r).await.unwrap();
    let body = &server.requests()[0].body;
    assert_eq!(body["include"], json!(["reasoning.encrypted_content"]));
    assert_eq!(body["temperature"], json!(0.2));
    let ids: Vec<&str> = body["input"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|i| i["type"] == "reasoning")
        .map(|i| i["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["rs_enc"]);

    // A 404 for an item of the request is not "the API does not know model".
    let server = MockApi::start(|_, _| {
        Answer::Json(
            404,
            Vec::new(),
            json!({"error": {"message": "Item with id 'rs_1' not found. Items are not persisted when `store` is set to false.", "type": "invalid_request_error"}}),
        )
    })
    .await;
    let err = ask(&responses(&server)).await.unwrap_err();
    assert!(!err.contains("does not know model"), "{err}");
    assert!(err.contains("Item with id 'rs_1' not found"), "{err}");
}

#[tokio::test]
async fn a_branchs_own_instructions_stay_after_the_shared_prefix() {
    let server = MockApi::start(|_, _| {
        ok(
            json!({"id": "msg_1", "type": "message", "role": "assistant", "model": "claude-test",
            "content": [{"type": "text", "text": "ok"}], "stop_reason": "end_turn",
            "usage": {"input_tokens": 10, "output_tokens": 1}}),
        )
    })
    .await;
    let p: AnthropicProvider = unstreamed(&server, "anthropic:claude-test");
    use forkfleet_shared::event::Message;
    // The fork's shared history (system prompt, goal), then the branch's own instructions
    // and steer.
    let history = vec![
        Message::System {
            text: "shared system".into(),
        },
        Message::User {
            text: "the goal".into(),
        },
        Message::System {
            text: "branch instructions".into(),
        },
        Message::User {
            text: "the steer".into(),
        },
    ];
    let r = forkfleet_worker::provider::ModelRequest {
        shared_prefix: 2,
        ..req(&history, &[])
    };
    call(&p, &r).await.unwrap();
    let body = &server.requests()[0].body;
    let system = body["system"].to_string();
    assert!(system.contains("shared system"), "{body}");
    assert!(!system.contains("branch instructions"), "{body}");
    let last = body["messages"]
        .as_array()
        .unwrap()
        .last()
        .unwrap()
        .to_string();
    assert!(
        last.contains("branch instructions") && last.contains("the steer"),
        "{body}"
    );
}

#[tokio::test]
async fn a_tool_name_repeated_on_every_delta_is_one_name() {
    let server = MockApi::start(|_, _| {
        let delta = |args: &str| {
            (
                "",
                json!({"choices": [{"index": 0, "delta": {"tool_calls": [
                {"index": 0, "id": "c1", "type": "function",
                 "function": {"name": "write_file", "arguments": args}}]}}]}),
            )
        };
        sse(vec![
            delta("{\"path\":"),
            delta("\"a\"}"),
            (
                "",
                json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}),
            ),
        ])
    })
    .await;
    let reply = ask(&openai(&server, 30.0, 0)).await.unwrap();
    assert_eq!(reply.tool_calls.len(), 1);
    assert_eq!(reply.tool_calls[0].name, "write_file");
    assert_eq!(reply.tool_calls[0].args, json!({"path": "a"}));
}

#[tokio::test]
async fn a_stream_far_past_max_tokens_is_cut_without_a_budget_and_a_huge_event_fails() {
    // No budget at all: text forever, cut at twice max_output_tokens (plus 256).
    let mut server = MockApi::start(|_, _| endless()).await;
    let p = openai(&server, 30.0, 0);
    let hi = user("hi");
    let r = forkfleet_worker::provider::ModelRequest {
        max_output_tokens: 100,
        ..req(&hi, &[])
    };
    let reply = call(&p, &r).await.unwrap();
    assert_eq!(reply.finish_reason.as_deref(), Some(OUTPUT_CAP_CUT));
    assert!(reply.usage.output_tokens > 456 && reply.usage.output_tokens <= 460);
    server.until_dropped().await;

    // One event of more than 8 MiB: the call fails (nothing held past the bound).
    let server = MockApi::start(|_, _| {
        let big = "x".repeat(9 << 20);
        sse(vec![text_chunk("start "), text_chunk(&big)])
    })
    .await;
    let err = ask(&openai(&server, 30.0, 2)).await.unwrap_err();
    assert!(err.contains("more than 8 MiB"), "{err}");
    assert_eq!(server.requests().len(), 1, "not tried again");
}
