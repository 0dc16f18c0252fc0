//! A streamed model for `bench budget --model streamed`: a local OpenAI-compatible chat
//! completions server (in the bench process) that plays the budget bench's work and
//! streams every answer, billing what it generates.
//!
//! A branch's steer says `BENCH b=B k=K`: its calls 0..K answer a `write_file` call
//! (`file_for(B, j)`), call K a text. Every answer is 200 output tokens (800 characters: a
//! text delta of about 400 characters, then the tool call's arguments padded to fill the
//! rest) streamed as 20 chunks spread evenly over the call's latency (`latency_ms` plus a
//! jitter fixed by branch and call), then the usage (1,000 input, 200 output). The bill:
//! a call's 1,000 input tokens when it arrives (the input is read at once), and 10 output
//! tokens per chunk generated; a client that goes away stops the generation, so a cut or
//! cancelled call is billed its input and the output it got. The output cap the request
//! asks for (`max_tokens` or `max_completion_tokens`) is honoured as a provider honours
//! it: an answer it is lower than stops at the last whole chunk under it, `length`.

use super::file_for;
use axum::body::Bytes;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Chunks per answer.
const CHUNKS: u64 = 20;
/// Output tokens per chunk (four characters each).
const TOKENS_PER_CHUNK: u64 = 10;
/// Input tokens per call.
const INPUT_TOKENS: u64 = 1000;

/// What the server billed.
#[derive(Debug, Clone, Copy, Default)]
pub struct Billed {
    pub input_tokens: u64,
    pub output_tokens: u64,
    /// Calls whose last chunk (with the usage) went out.
    pub completed: u64,
}

pub struct StreamModel {
    latency_ms: u64,
    jitter_ms: u64,
    billed: Mutex<Billed>,
}

impl StreamModel {
    /// The bill so far, and a fresh one from now on.
    pub fn take(&self) -> Billed {
        self.billed
            .lock()
            .map(|mut b| std::mem::take(&mut *b))
            .unwrap_or_default()
    }

    fn add(&self, f: impl FnOnce(&mut Billed)) {
        if let Ok(mut b) = self.billed.lock() {
            f(&mut b);
        }
    }
}

/// Serve it on a free loopback port: the model and the API's base URL.
pub async fn start(
    latency_ms: u64,
    jitter_ms: u64,
) -> anyhow::Result<(Arc<StreamModel>, String, tokio::task::JoinHandle<()>)> {
    let model = Arc::new(StreamModel {
        latency_ms,
        jitter_ms,
        billed: Mutex::default(),
    });
    let app = axum::Router::new()
        .route("/v1/chat/completions", axum::routing::post(chat))
        .with_state(model.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Ok((model, format!("http://{addr}/v1"), task))
}

/// `(b, k)` from the branch's steer, and the call number (tool results so far).
fn position(body: &Value) -> Option<(usize, usize, usize)> {
    let messages = body["messages"].as_array()?;
    let steer = messages.iter().find_map(|m| {
        let text = m["content"].as_str()?;
        text.strip_prefix("BENCH ")
    })?;
    let field = |name: &str| {
        steer
            .split_whitespace()
            .find_map(|w| w.strip_prefix(name))
            .and_then(|v| v.parse::<usize>().ok())
    };
    let turn = messages.iter().filter(|m| m["role"] == "tool").count();
    Some((field("b=")?, field("k=")?, turn))
}

/// A number in `0..=max` fixed by the branch and the call.
fn jitter(b: usize, turn: usize, max: u64) -> u64 {
    if max == 0 {
        return 0;
    }
    let h = (b as u64)
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add((turn as u64).wrapping_mul(0xC2B2_AE3D_27D4_EB4F));
    (h >> 17) % (max + 1)
}

fn chunk(delta: Value, finish: Value) -> Bytes {
    let v = json!({"object": "chat.completion.chunk", "model": "bench-stream",
                   "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]});
    Bytes::from(format!("data: {v}\n\n"))
}

async fn chat(
    axum::extract::State(model): axum::extract::State<Arc<StreamModel>>,
    body: Bytes,
) -> Response {
    let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let Some((b, k, turn)) = position(&body) else {
        return (axum::http::StatusCode::BAD_REQUEST, "no BENCH steer").into_response();
    };
    // The input is read (and billed) as the call arrives.
    model.add(|bill| bill.input_tokens += INPUT_TOKENS);
    let latency = model.latency_ms + jitter(b, turn, model.jitter_ms);
    let pause = Duration::from_millis(latency / CHUNKS);
    let chars = (CHUNKS * TOKENS_PER_CHUNK * 4) as usize;
    // The answer's 800 characters: a text preamble, then the call's arguments (padded).
    let preamble: String = format!("Branch {b}, call {turn}: ")
        .chars()
        .chain(std::iter::repeat('.'))
        .take(chars / 2)
        .collect();
    let (mut pieces, finish): (Vec<Value>, &str) = if turn < k {
        let (path, content) = file_for(b, turn, 3);
        let mut args = json!({"path": path, "content": content}).to_string();
        let pad = (chars - preamble.len()).saturating_sub(args.len() + 12);
        args = json!({"path": path, "content": content, "note": "-".repeat(pad)}).to_string();
        let per = args.len().div_ceil((CHUNKS / 2) as usize);
        let mut pieces: Vec<Value> = preamble
            .as_bytes()
            .chunks(preamble.len().div_ceil((CHUNKS / 2) as usize))
            .map(|c| json!({"content": String::from_utf8_lossy(c)}))
            .collect();
        for (i, c) in args.as_bytes().chunks(per).enumerate() {
            let mut call =
                json!({"index": 0, "function": {"arguments": String::from_utf8_lossy(c)}});
            if i == 0 {
                call["id"] = json!(format!("call_{b}_{turn}"));
                call["type"] = json!("function");
                call["function"]["name"] = json!("write_file");
            }
            pieces.push(json!({"tool_calls": [call]}));
        }
        (pieces, "tool_calls")
    } else {
        let text: String = format!("branch {b} finished after {k} calls. ")
            .chars()
            .chain(std::iter::repeat('.'))
            .take(chars)
            .collect();
        let pieces = text
            .as_bytes()
            .chunks(chars / CHUNKS as usize)
            .map(|c| json!({"content": String::from_utf8_lossy(c)}))
            .collect();
        (pieces, "stop")
    };
    // The tokens each piece stands for: 200 spread evenly, the last one the rest.
    let n = pieces.len() as u64;
    let full = CHUNKS * TOKENS_PER_CHUNK;
    let mut tokens: Vec<u64> = (0..n)
        .map(|i| {
            if i + 1 == n {
                full - (n - 1) * (full / n)
            } else {
                full / n
            }
        })
        .collect();
    // The output cap asked for is honoured: an answer it cuts stops there (`length`).
    let cap = body["max_tokens"]
        .as_u64()
        .or_else(|| body["max_completion_tokens"].as_u64())
        .unwrap_or(u64::MAX);
    let finish = if cap < full {
        let keep = (cap / (full / n).max(1)) as usize;
        pieces.truncate(keep);
        tokens.truncate(keep);
        "length"
    } else {
        finish
    };
    let generated: u64 = tokens.iter().sum();
    let stream = futures::stream::unfold(
        (model, pieces.into_iter().zip(tokens), false),
        move |(model, mut pieces, done)| async move {
            if done {
                return None;
            }
            let Some((delta, tokens)) = pieces.next() else {
                // The last chunk: the finish reason and the usage.
                model.add(|b| b.completed += 1);
                let usage = json!({"object": "chat.completion.chunk", "model": "bench-stream", "choices": [],
                                   "usage": {"prompt_tokens": INPUT_TOKENS,
                                             "completion_tokens": generated}});
                let mut tail = chunk(json!({}), json!(finish)).to_vec();
                tail.extend_from_slice(format!("data: {usage}\n\ndata: [DONE]\n\n").as_bytes());
                return Some((
                    Ok::<_, std::convert::Infallible>(Bytes::from(tail)),
                    (model, pieces, true),
                ));
            };
            tokio::time::sleep(pause).await;
            // The tokens this chunk stands for are generated (and billed) now.
            model.add(|b| b.output_tokens += tokens);
            Some((Ok(chunk(delta, Value::Null)), (model, pieces, false)))
        },
    );
    (
        [("content-type", "text/event-stream")],
        axum::body::Body::from_stream(stream),
    )
        .into_response()
}
