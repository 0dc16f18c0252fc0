//! A model API on a real local HTTP server (axum on 127.0.0.1:0, in process): it records
//! every request and answers as a test script says, with a JSON body, a stream of
//! server-sent events, or never (until the client goes away).

use super::common::WAIT;
use axum::body::Bytes;
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use serde_json::Value;
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tokio::sync::mpsc;

/// One request the server received.
#[derive(Debug, Clone)]
pub struct Recorded {
    pub path: String,
    pub headers: HeaderMap,
    pub body: Value,
    pub at: Instant,
}

/// What the server answers to a request.
pub enum Answer {
    /// A status, headers and a JSON body.
    Json(u16, Vec<(&'static str, String)>, Value),
    /// Never answer (until the client goes away: the handler is then dropped).
    Hang,
    /// A `text/event-stream` answer: these events (`event:` name, empty for none, and
    /// data), each in its own chunk; then, with `hang`, the stream stays open and never
    /// ends (until the client goes away, which drops it).
    Sse {
        events: Vec<(String, String)>,
        hang: bool,
    },
    /// A `text/event-stream` answer whose events come `every` apart (a slow, healthy
    /// stream), then ends.
    Paced {
        events: Vec<(String, String)>,
        every: std::time::Duration,
    },
}

/// A stream of these events that ends (a JSON string is sent as its text: `[DONE]`).
pub fn sse(events: Vec<(&str, Value)>) -> Answer {
    Answer::Sse {
        events: events
            .into_iter()
            .map(|(n, v)| {
                let data = match v {
                    Value::String(s) => s,
                    other => other.to_string(),
                };
                (n.to_string(), data)
            })
            .collect(),
        hang: false,
    }
}

/// The bytes of one event.
fn sse_bytes(name: &str, data: &str) -> Bytes {
    let mut out = String::new();
    if !name.is_empty() {
        out.push_str(&format!("event: {name}\n"));
    }
    out.push_str(&format!("data: {data}\n\n"));
    Bytes::from(out)
}

pub fn ok(body: Value) -> Answer {
    Answer::Json(200, Vec::new(), body)
}

pub type Script = Box<dyn Fn(usize, &Value) -> Answer + Send + Sync>;

pub struct ServerState {
    script: Script,
    requests: Mutex<Vec<Recorded>>,
    arrived: mpsc::UnboundedSender<usize>,
    dropped: mpsc::UnboundedSender<()>,
}

/// Signals when a handler that never answers is dropped (its connection closed).
struct DropSignal(mpsc::UnboundedSender<()>);

impl Drop for DropSignal {
    fn drop(&mut self) {
        let _ = self.0.send(());
    }
}

pub struct MockApi {
    /// The API's base URL (`http://127.0.0.1:PORT/v1`).
    pub url: String,
    state: Arc<ServerState>,
    pub arrived: mpsc::UnboundedReceiver<usize>,
    dropped: mpsc::UnboundedReceiver<()>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for MockApi {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn handle(
    axum::extract::State(state): axum::extract::State<Arc<ServerState>>,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let n = {
        let mut reqs = state.requests.lock().unwrap();
        reqs.push(Recorded {
            path: uri.path().to_string(),
            headers,
            body: body.clone(),
            at: Instant::now(),
        });
        reqs.len() - 1
    };
    let answer = (state.script)(n, &body);
    let _ = state.arrived.send(n);
    match answer {
        Answer::Json(status, extra, value) => {
            let mut resp = (
                StatusCode::from_u16(status).unwrap(),
                [("content-type", "application/json")],
                value.to_string(),
            )
                .into_response();
            for (name, v) in extra {
                resp.headers_mut().insert(name, v.parse().unwrap());
            }
            resp
        }
        Answer::Sse { events, hang } => {
            // Held by the stream's endless tail: dropped (and signalled) when the client
            // goes away.
            let signal = hang.then(|| DropSignal(state.dropped.clone()));
            let chunks = futures::stream::iter(
                events
                    .into_iter()
                    .map(|(n, d)| Ok::<_, std::convert::Infallible>(sse_bytes(&n, &d))),
            );
            let tail = futures::stream::unfold(signal, |signal| async move {
                if signal.is_some() {
                    std::future::pending::<()>().await;
                }
                None::<(Result<Bytes, std::convert::Infallible>, Option<DropSignal>)>
            });
            let body = axum::body::Body::from_stream(futures::StreamExt::chain(chunks, tail));
            (
                StatusCode::OK,
                [("content-type", "text/event-stream")],
                body,
            )
                .into_response()
        }
        Answer::Paced { events, every } => {
            let chunks = futures::stream::unfold(events.into_iter(), move |mut rest| async move {
                let (n, d) = rest.next()?;
                tokio::time::sleep(every).await;
                Some((Ok::<_, std::convert::Infallible>(sse_bytes(&n, &d)), rest))
            });
            (
                StatusCode::OK,
                [("content-type", "text/event-stream")],
                axum::body::Body::from_stream(chunks),
            )
                .into_response()
        }
        Answer::Hang => {
            let _signal = DropSignal(state.dropped.clone());
            std::future::pending::<Response>().await
        }
    }
}

impl MockApi {
    pub async fn start(script: impl Fn(usize, &Value) -> Answer + Send + Sync + 'static) -> Self {
        let (arrived_tx, arrived) = mpsc::unbounded_channel();
        let (dropped_tx, dropped) = mpsc::unbounded_channel();
        let state = Arc::new(ServerState {
            script: Box::new(script),
            requests: Mutex::new(Vec::new()),
            arrived: arrived_tx,
            dropped: dropped_tx,
        });
        let app = axum::Router::new()
            .fallback(handle)
            .with_state(state.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Self {
            url: format!("http://{addr}/v1"),
            state,
            arrived,
            dropped,
            task,
        }
    }

    pub fn requests(&self) -> Vec<Recorded> {
        self.state.requests.lock().unwrap().clone()
    }

    /// Wait (bounded) until request `n` (from 0) has arrived.
    pub async fn until_request(&mut self, n: usize) {
        loop {
            let got = tokio::time::timeout(WAIT, self.arrived.recv())
                .await
                .expect("no request within the wait")
                .expect("server gone");
            if got >= n {
                return;
            }
        }
    }

    /// Wait (bounded) until a handler that never answers has been dropped.
    pub async fn until_dropped(&mut self) {
        tokio::time::timeout(WAIT, self.dropped.recv())
            .await
            .expect("the server still holds the request: the connection was not closed")
            .expect("server gone");
    }
}
