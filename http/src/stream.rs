//! The routes that are not one operation: Server-Sent Events of a fork's changes and of a
//! run's events, blob uploads, stream tickets and forks from a spec document.
//!
//! - `GET /forks/{fork}/stream`: first an event `fork` (id: the coordinator's start, in ms,
//!   times 10^6 plus the fork's version, so ids grow across restarts; data: its version,
//!   view and costs), from the current state; with `Last-Event-ID` (or `?last_event_id=`)
//!   of this start, only once it differs from that version. Then, as it changes, events
//!   `delta`: the fields that changed and, of the branch lists, the rows that did (a fork
//!   of 1,000 branches is not sent whole on every change), at most one every 250 ms. It
//!   ends after the fork is merged or aborted.
//! - `GET /runs/{run}/stream`: an event `event` (id: its seq; data: `{seq, event}`) for
//!   each event of the run's log, from seq 0 or after `Last-Event-ID`, then as they land.
//!   It ends once the run's fork is merged or aborted (a root run: after its log).
//! - `PUT /blobs/{blob}`: store bytes under their SHA-256 (the hash must match), as the
//!   workspace upload of `create_fork` needs: `put_blob_part` with the whole body.
//! - `POST /stream-tickets`: a short-lived ticket for a stream's URL (an `EventSource`
//!   cannot send a token in a header, and a token never goes in a URL).
//! - `POST /forks/from-spec`: a fork from a spec document (the TOML text, and the files it
//!   names, such as scripts) and an uploaded snapshot or a run, as `forkfleet run` makes
//!   one from a spec file: `create_fork` with the plan the spec gives.

use super::problem::Problem;
use super::{ApiHttp, Serving};
use axum::body::Bytes;
use axum::extract::{ConnectInfo, RawPathParams, RawQuery, State};
use axum::http::HeaderMap;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::MethodRouter;
use forkfleet_shared::api::{
    dispatch, Access, ApiReply, Caller, GetForkCost, GetRun, RunEvents, Watch,
};
use forkfleet_shared::blob::BlobHash;
use forkfleet_shared::ids::{ForkId, RunId};
use serde_json::{json, Value};
use std::collections::VecDeque;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

/// How long one round of a stream waits for a change.
const ROUND_MS: u64 = 25_000;

type St = State<Arc<ApiHttp>>;

pub fn routes() -> Vec<(&'static str, MethodRouter<Arc<ApiHttp>>)> {
    vec![
        ("/forks/{fork}/stream", axum::routing::get(fork_stream)),
        ("/runs/{run}/stream", axum::routing::get(run_stream)),
        ("/blobs/{blob}", axum::routing::put(upload)),
        ("/forks/from-spec", axum::routing::post(from_spec)),
        ("/stream-tickets", axum::routing::post(stream_ticket)),
    ]
}

/// The first path value as a `T`, or a problem naming `what`.
fn param<T: std::str::FromStr>(params: &RawPathParams, what: &str) -> Result<T, Problem> {
    let raw = params
        .iter()
        .next()
        .map(|(_, v)| v.to_string())
        .unwrap_or_default();
    raw.parse()
        .map_err(|_| Problem::bad_input(format!("`{raw}` is not a {what}")))
}

/// Versions of a fork per start of the coordinator in its stream's event ids: an id is
/// `since_ms * VERSIONS + version`, monotonic across restarts while a start's versions
/// stay below it (u64 holds it until the year 2540).
const VERSIONS: u64 = 1_000_000;

/// A fork stream's event id for `version` of the start at `since_ms`.
fn fork_event_id(since_ms: u64, version: u64) -> u64 {
    since_ms
        .saturating_mul(VERSIONS)
        .saturating_add(version.min(VERSIONS - 1))
}

/// The version or seq a reconnecting client saw last.
fn last_event_id(headers: &HeaderMap, query: Option<&str>) -> Result<Option<u64>, Problem> {
    let raw = headers
        .get("last-event-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
        .or_else(|| {
            super::form_pairs(query)
                .into_iter()
                .find(|(k, _)| k == "last_event_id")
                .map(|(_, v)| v)
        });
    raw.map(|r| {
        r.trim().parse().map_err(|_| {
            Problem::bad_input(format!(
                "Last-Event-ID `{r}` is not an event id this stream sent"
            ))
        })
    })
    .transpose()
}

/// What a stream starts from: the coordinator, the caller (admitted to read), the id in
/// the path (`what` says what it is), and the event the client saw last.
fn open<T: std::str::FromStr>(
    st: &ApiHttp,
    headers: &HeaderMap,
    query: Option<&str>,
    peer: SocketAddr,
    params: &RawPathParams,
    what: &str,
) -> Result<(Serving, Caller, T, Option<u64>), Problem> {
    let (principal, serving) = st.admit(headers, query, peer, Access::Read)?;
    let id = param(params, what)?;
    let seen = last_event_id(headers, query)?;
    Ok((serving, principal.caller(), id, seen))
}

async fn call(
    s: &Serving,
    caller: &Caller,
    req: impl Into<forkfleet_shared::api::ApiRequest>,
) -> Result<ApiReply, Problem> {
    dispatch(&s.handle, caller, req.into())
        .await
        .map_err(|e| Problem::from_api(&e))
}

fn error_event(p: &Problem) -> Event {
    Event::default().event("error").data(p.json().to_string())
}

/// The least time between two events of a fork stream: the changes in between go as one
/// (a fork of 1,000 busy branches changes hundreds of times a second).
const FORK_EVENT_GAP: std::time::Duration = std::time::Duration::from_millis(250);

struct ForkRound {
    seen: Option<u64>,
    done: bool,
    /// The view and cost this connection sent last (as JSON): what its deltas are of.
    sent: Option<(Value, Value)>,
    /// When this connection's last event went.
    at: Option<tokio::time::Instant>,
}

/// What changed from `before` to `after` (two JSON objects): the keys whose values differ
/// (`null` for one that is gone), and of the `branches` list the rows that differ, by
/// position (`{"17": row}`); the whole list when it shrank. Nothing (`{}`) when they are
/// equal; `None` when they differ and are not both objects (a cost that was not there), so
/// the caller sends the whole document instead.
fn delta(before: &Value, after: &Value) -> Option<Value> {
    if before == after {
        return Some(Value::Object(serde_json::Map::new()));
    }
    let (Value::Object(b), Value::Object(a)) = (before, after) else {
        return None;
    };
    let mut out = serde_json::Map::new();
    for (k, v) in a {
        if b.get(k) == Some(v) {
            continue;
        }
        let rows = match (k.as_str(), b.get(k), v) {
            ("branches", Some(Value::Array(old)), Value::Array(new)) if new.len() >= old.len() => {
                let changed: serde_json::Map<String, Value> = new
                    .iter()
                    .enumerate()
                    .filter(|(i, row)| old.get(*i) != Some(row))
                    .map(|(i, row)| (i.to_string(), row.clone()))
                    .collect();
                Value::Object(changed)
            }
            _ => v.clone(),
        };
        out.insert(k.clone(), rows);
    }
    for k in b.keys().filter(|k| !a.contains_key(*k)) {
        out.insert(k.clone(), Value::Null);
    }
    Some(Value::Object(out))
}

/// A fork stream's event for `version`: the whole view and cost (`fork`) when the
/// connection has sent nothing yet, else what changed since its last event (`delta`).
fn fork_event(
    since: u64,
    version: u64,
    view: &Value,
    cost: &Value,
    sent: Option<&(Value, Value)>,
) -> Event {
    let changes = sent.and_then(|(v, c)| Some((delta(v, view)?, delta(c, cost)?)));
    let (name, data) = match changes {
        Some((v, c)) => ("delta", json!({ "version": version, "view": v, "cost": c })),
        None => (
            "fork",
            json!({ "version": version, "view": view, "cost": cost }),
        ),
    };
    Event::default()
        .id(fork_event_id(since, version).to_string())
        .event(name)
        .data(data.to_string())
}

async fn fork_stream(
    State(st): St,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    params: RawPathParams,
    RawQuery(query): RawQuery,
) -> Response {
    let opened = async {
        let (serving, caller, fork, seen) =
            open::<ForkId>(&st, &headers, query.as_deref(), peer, &params, "fork id")?;
        // Refused (unknown, another account's) before the stream starts.
        call(&serving, &caller, forkfleet_shared::api::GetFork { fork }).await?;
        Ok::<_, Problem>((serving, caller, fork, seen))
    };
    let (serving, caller, fork, seen) = match opened.await {
        Ok(x) => x,
        Err(p) => return p.into_response(),
    };
    // An id of another start (before a restart or a takeover) says nothing of this one's
    // versions: the stream starts from the current state.
    let since = serving.since_ms;
    let seen = seen.and_then(|id| (id / VERSIONS == since).then_some(id % VERSIONS));
    let start = ForkRound {
        seen,
        done: false,
        sent: None,
        at: None,
    };
    let rounds = futures::stream::unfold(start, move |r| {
        let (serving, caller) = (serving.clone(), caller.clone());
        async move {
            if r.done {
                return None;
            }
            if let Some(at) = r.at {
                tokio::time::sleep_until(at + FORK_EVENT_GAP).await;
            }
            let watched = call(
                &serving,
                &caller,
                Watch {
                    fork,
                    seen: r.seen,
                    timeout_ms: ROUND_MS,
                },
            )
            .await;
            let w = match watched {
                Ok(ApiReply::Watch(w)) => w,
                Ok(_) => return None,
                Err(p) => {
                    return Some((
                        Ok::<_, Infallible>(error_event(&p)),
                        ForkRound { done: true, ..r },
                    ))
                }
            };
            if Some(w.version) == r.seen {
                return Some((Ok(Event::default().comment("unchanged")), r));
            }
            // A cost that cannot be read this round is the one sent last (not a change
            // to nothing and back, which would send the whole view twice).
            let cost = match call(&serving, &caller, GetForkCost { fork }).await {
                Ok(ApiReply::Cost(c)) => serde_json::to_value(c).unwrap_or(Value::Null),
                _ => r.sent.as_ref().map_or(Value::Null, |(_, c)| c.clone()),
            };
            let done = w.view.state.is_resolved();
            let view = serde_json::to_value(&w.view).unwrap_or(Value::Null);
            let event = fork_event(since, w.version, &view, &cost, r.sent.as_ref());
            Some((
                Ok(event),
                ForkRound {
                    seen: Some(w.version),
                    done,
                    sent: Some((view, cost)),
                    at: Some(tokio::time::Instant::now()),
                },
            ))
        }
    });
    Sse::new(rounds)
        .keep_alive(KeepAlive::default())
        .into_response()
}

struct RunRound {
    next: u64,
    fork: Option<ForkId>,
    seen: Option<u64>,
    queue: VecDeque<forkfleet_shared::api::LoggedEvent>,
    /// The fork is resolved: once the queue is empty, the stream ends.
    last: bool,
}

async fn run_stream(
    State(st): St,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    params: RawPathParams,
    RawQuery(query): RawQuery,
) -> Response {
    let opened = async {
        let (serving, caller, run, after) =
            open::<RunId>(&st, &headers, query.as_deref(), peer, &params, "run id")?;
        let fork = match call(&serving, &caller, GetRun { run }).await? {
            ApiReply::Run(d) => d.run.fork_id,
            _ => None,
        };
        Ok::<_, Problem>((serving, caller, run, fork, after.map_or(0, |s| s + 1)))
    };
    let (serving, caller, run, fork, next) = match opened.await {
        Ok(x) => x,
        Err(p) => return p.into_response(),
    };
    let start = RunRound {
        next,
        fork,
        seen: None,
        queue: VecDeque::new(),
        last: false,
    };
    let rounds = futures::stream::unfold(Some(start), move |r| {
        let (serving, caller) = (serving.clone(), caller.clone());
        async move {
            let mut r = r?;
            loop {
                if let Some(e) = r.queue.pop_front() {
                    r.next = e.seq + 1;
                    let data = serde_json::json!({ "seq": e.seq, "event": e.event });
                    let event = Event::default()
                        .id(e.seq.to_string())
                        .event("event")
                        .data(data.to_string());
                    return Some((Ok::<_, Infallible>(event), Some(r)));
                }
                if r.last {
                    return None;
                }
                match call(&serving, &caller, RunEvents { run }).await {
                    Ok(ApiReply::Events(events)) => {
                        r.queue = events.into_iter().filter(|e| e.seq >= r.next).collect();
                    }
                    Ok(_) => return None,
                    Err(p) => return Some((Ok(error_event(&p)), None)),
                }
                if !r.queue.is_empty() {
                    continue;
                }
                // Nothing new: wait for the fork to change (a root run's log does not grow
                // by itself: it ends here).
                let fork = r.fork?;
                match call(
                    &serving,
                    &caller,
                    Watch {
                        fork,
                        seen: r.seen,
                        timeout_ms: ROUND_MS,
                    },
                )
                .await
                {
                    Ok(ApiReply::Watch(w)) => {
                        let unchanged = Some(w.version) == r.seen;
                        r.seen = Some(w.version);
                        r.last = w.view.state.is_resolved();
                        if unchanged {
                            return Some((Ok(Event::default().comment("unchanged")), Some(r)));
                        }
                    }
                    Ok(_) => return None,
                    Err(p) => return Some((Ok(error_event(&p)), None)),
                }
            }
        }
    });
    Sse::new(rounds)
        .keep_alive(KeepAlive::default())
        .into_response()
}

async fn upload(
    State(st): St,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    params: RawPathParams,
    RawQuery(query): RawQuery,
    body: Bytes,
) -> Response {
    let done = async {
        let (principal, serving) = st.admit(&headers, query.as_deref(), peer, Access::Write)?;
        let raw = params
            .iter()
            .next()
            .map(|(_, v)| v.to_string())
            .unwrap_or_default();
        let hash = BlobHash::from_hex(&raw).ok_or_else(|| {
            Problem::bad_input(format!(
                "`{raw}` is not a blob hash (64 hex digits of SHA-256)"
            ))
        })?;
        let actual = BlobHash::of(&body);
        if actual != hash {
            return Err(Problem::bad_input(format!(
                "the body's SHA-256 is {actual}, not {hash}: a blob is stored under its own hash"
            )));
        }
        // Through the coordinator, as a NATS client's upload: verified, counted against
        // the caller's quota, owned by its account (ADR 37).
        let whole = forkfleet_shared::api::PutBlobPart {
            blob: hash,
            offset: 0,
            total: body.len() as u64,
            bytes: body,
        };
        forkfleet_shared::api::dispatch(&serving.handle, &principal.caller(), whole.into())
            .await
            .map_err(|e| Problem::from_api(&e))?;
        Ok::<_, Problem>(principal)
    };
    match done.await {
        Ok(principal) => {
            let status = axum::http::StatusCode::NO_CONTENT;
            let raw: Vec<String> = params.iter().map(|(_, v)| v.to_string()).collect();
            st.audit
                .record(
                    &principal,
                    ("put_blob", "PUT", "/blobs/{blob}"),
                    &raw,
                    status,
                )
                .await;
            status.into_response()
        }
        Err(p) => p.into_response(),
    }
}

/// `POST /stream-tickets`: a ticket standing for the caller for a minute, for the URL of
/// an `EventSource` (which cannot send an `Authorization` header; a token never goes in
/// a URL).
async fn stream_ticket(
    State(st): St,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    RawQuery(query): RawQuery,
) -> Response {
    let principal = match st.auth.authenticate(&headers, query.as_deref(), peer) {
        Ok(p) => p,
        Err(p) => return p.into_response(),
    };
    match st.auth.issue_ticket(&principal) {
        Ok(ticket) => axum::Json(serde_json::json!({
            "ticket": ticket,
            "expires_in_s": super::auth::TICKET_TTL.as_secs(),
        }))
        .into_response(),
        Err(e) => Problem::failure(format!("no random bytes for a ticket: {e}")).into_response(),
    }
}

/// `POST /forks/from-spec`'s body.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct SpecDocument {
    /// The spec, as a spec file holds it (docs/SPEC.md); its `workspace` is not read.
    spec: String,
    /// Files the spec names (`script = "script.toml"`), by their path relative to it.
    #[serde(default)]
    files: std::collections::BTreeMap<String, String>,
    /// The workspace snapshot (a `Manifest` blob already uploaded), or
    snapshot: Option<BlobHash>,
    /// a run to fork as it is now.
    run: Option<RunId>,
    /// A name for the workspace in views (display only).
    workspace: Option<String>,
}

async fn from_spec(
    State(st): St,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    RawQuery(query): RawQuery,
    body: Bytes,
) -> Response {
    let (principal, serving) = match st.admit(&headers, query.as_deref(), peer, Access::Write) {
        Ok(x) => x,
        Err(p) => return p.into_response(),
    };
    // A creating call: an Idempotency-Key makes it happen once, however often it is sent.
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let fingerprint =
        super::idempotency::fingerprint("create_fork_from_spec", &[], query.as_deref(), &body);
    let running = match super::begin_keyed(&st, &principal.name, key.as_deref(), &fingerprint).await
    {
        Ok(running) => running,
        Err(answer) => return answer,
    };
    let made = async {
        let doc: SpecDocument = serde_json::from_slice(&body).map_err(|e| {
            Problem::bad_input(format!(
                "the body is {{\"spec\": TOML text, \"files\": {{path: text}}, \"snapshot\": hash | \"run\": run id, \"workspace\": name}}: {e}"
            ))
        })?;
        let caller = principal.caller();
        let (parent, snapshot) = match (doc.snapshot, doc.run) {
            (Some(s), None) => (forkfleet_shared::api::ParentRun::New, s),
            (None, Some(run_id)) => {
                let ApiReply::Workspace(s) = call(
                    &serving,
                    &caller,
                    forkfleet_shared::api::RunWorkspace { run: run_id },
                )
                .await?
                else {
                    return Err(Problem::failure("the run's workspace was not answered"));
                };
                (forkfleet_shared::api::ParentRun::Existing { run_id }, s)
            }
            _ => return Err(Problem::bad_input(
                "give `snapshot` (an uploaded Manifest blob) or `run` (a run to fork), one of them",
            )),
        };
        let loaded = load_document(&doc)?;
        for (hash, bytes) in &loaded.blobs {
            serving
                .bus
                .blobs()
                .put(*hash, bytes.clone())
                .await
                .map_err(|e| Problem::unavailable(format!("the blob store failed: {e}")))?;
        }
        let created = call(
            &serving,
            &caller,
            forkfleet_shared::api::CreateFork {
                plan: loaded.plan,
                parent,
                snapshot,
                workspace: Some(doc.workspace.unwrap_or_else(|| "(http)".to_string())),
                left_out: None,
                git: None,
            },
        )
        .await?;
        Ok::<_, Problem>(created)
    };
    let kept = match made.await {
        Ok(ApiReply::Fork(view)) => {
            let route = ("create_fork_from_spec", "POST", "/forks/from-spec");
            let fork = [view.fork_id.to_string()];
            st.audit
                .record(&principal, route, &fork, axum::http::StatusCode::OK)
                .await;
            super::Kept::json(&view)
        }
        Ok(_) => Problem::failure("the fork was not answered").kept(),
        Err(p) => p.kept(),
    };
    if let Some(running) = running {
        running.finish(kept.clone());
    }
    kept.response(false)
}

/// Every file the spec names (its `history`, each model's `script`) is one the request
/// carries in `files`: a spec sent over HTTP reads nothing on the coordinator's host.
fn names_only_uploaded_files(doc: &SpecDocument) -> Result<(), Problem> {
    let table: toml::Table = toml::from_str(&doc.spec)
        .map_err(|e| Problem::bad_input(format!("the spec is not TOML: {}", e.message())))?;
    let mut named: Vec<(String, &toml::Value)> = Vec::new();
    if let Some(h) = table.get("history") {
        named.push(("history".to_string(), h));
    }
    if let Some(models) = table.get("models").and_then(toml::Value::as_table) {
        for (name, section) in models {
            if let Some(script) = section.as_table().and_then(|t| t.get("script")) {
                named.push((format!("[models.\"{name}\"] script"), script));
            }
        }
    }
    let given = || {
        if doc.files.is_empty() {
            "none".to_string()
        } else {
            doc.files
                .keys()
                .map(|k| format!("`{k}`"))
                .collect::<Vec<_>>()
                .join(", ")
        }
    };
    for (key, value) in named {
        let Some(name) = value.as_str() else {
            return Err(Problem::bad_input(format!(
                "the spec's {key} must be a file name"
            )));
        };
        // Exactly a relative path in its plain form (`a/b.toml`: not absolute, no `.`,
        // `..` or empty parts), and one of `files`: the spec's loader joins it to the
        // directory the files were written to, and an absolute path would replace that
        // directory (a hostile test read /etc/shadow naming it in both).
        let plain = forkfleet_shared::path::WsPath::parse_file(name)
            .is_ok_and(|p| p.as_str() == name)
            && std::path::Path::new(name).is_relative();
        let uploaded = plain && doc.files.contains_key(name);
        if !uploaded {
            return Err(Problem::bad_input(format!(
                "the spec's {key} names a file the request does not carry: a spec sent over HTTP reads only the files in `files`, by a relative path without `..` (given: {})",
                given()
            )));
        }
    }
    Ok(())
}

/// The spec document as a spec file in a directory of its own, its files beside it.
fn load_document(doc: &SpecDocument) -> Result<forkfleet_shared::spec::LoadedSpec, Problem> {
    names_only_uploaded_files(doc)?;
    let dir = tempfile::tempdir()
        .map_err(|e| Problem::failure(format!("no temporary directory: {e}")))?;
    for (name, text) in &doc.files {
        let rel = forkfleet_shared::path::WsPath::parse_file(name)
            .map_err(|e| Problem::bad_input(format!("files: `{name}`: {e}")))?;
        let path = dir.path().join(rel.as_str());
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(|e| Problem::failure(e.to_string()))?;
        }
        std::fs::write(&path, text).map_err(|e| Problem::failure(e.to_string()))?;
    }
    let spec = dir.path().join("fork.toml");
    std::fs::write(&spec, &doc.spec).map_err(|e| Problem::failure(e.to_string()))?;
    let mut over = toml::Table::new();
    over.insert(
        "workspace".into(),
        toml::Value::String(dir.path().display().to_string()),
    );
    forkfleet_shared::spec::load_overridden(Some(&spec), over, &Default::default())
        .map_err(|e| Problem::bad_input(format!("the spec: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fork_event_ids_grow_across_starts() {
        // A later start's first version is above an earlier start's last, even a start
        // within the same second (one ms later).
        let start = 1_795_000_000_123;
        assert!(fork_event_id(start, 123_456) < fork_event_id(start + 1, 0));
        let id = fork_event_id(start, 42);
        assert_eq!((id / VERSIONS, id % VERSIONS), (start, 42));
        // The last start u64 holds is far off.
        assert!(fork_event_id(17_000_000_000_000, VERSIONS) < u64::MAX);
    }

    /// Applies a delta as the console does: each key replaced, of `branches` the rows by
    /// position (a list replaces the whole).
    fn patch(target: &mut Value, d: &Value) {
        for (k, v) in d.as_object().unwrap() {
            match (k.as_str(), v) {
                ("branches", Value::Object(rows)) => {
                    let list = target["branches"].as_array_mut().unwrap();
                    let mut rows: Vec<(usize, &Value)> =
                        rows.iter().map(|(i, r)| (i.parse().unwrap(), r)).collect();
                    rows.sort_by_key(|(i, _)| *i);
                    for (i, row) in rows {
                        if i < list.len() {
                            list[i] = row.clone();
                        } else {
                            assert_eq!(i, list.len(), "rows beyond the list follow it");
                            list.push(row.clone());
                        }
                    }
                }
                _ => target[k] = v.clone(),
            }
        }
    }

    #[test]
    fn a_delta_carries_what_changed_and_rebuilds_the_document() {
        let row = |l: &str, turns: u32| json!({"label": l, "turns": turns, "state": "running"});
        let before = json!({"state": "running", "goal": "g".repeat(500), "gone": 1,
            "branches": (0..1000).map(|i| row(&format!("b{i}"), 1)).collect::<Vec<_>>()});
        let mut after = before.clone();
        after["state"] = json!("settled");
        after.as_object_mut().unwrap().remove("gone");
        after["branches"][17]["turns"] = json!(2);
        after["branches"][999]["state"] = json!("done");
        let d = delta(&before, &after).unwrap();
        assert_eq!(
            d,
            json!({"state": "settled", "gone": null,
                "branches": {"17": after["branches"][17], "999": after["branches"][999]}})
        );
        let mut rebuilt = before.clone();
        patch(&mut rebuilt, &d);
        rebuilt.as_object_mut().unwrap().remove("gone");
        assert_eq!(rebuilt, after);
        // Nothing changed: an empty delta. Rows added: sent by position; a list that
        // shrank: whole.
        assert_eq!(delta(&after, &after).unwrap(), json!({}));
        let mut longer = after.clone();
        longer["branches"]
            .as_array_mut()
            .unwrap()
            .push(row("new", 0));
        let d = delta(&after, &longer).unwrap();
        assert_eq!(d, json!({"branches": {"1000": row("new", 0)}}));
        let mut shorter = after.clone();
        shorter["branches"].as_array_mut().unwrap().truncate(2);
        assert_eq!(
            delta(&after, &shorter).unwrap()["branches"],
            shorter["branches"]
        );
        // Not two objects (a cost that was not there): no delta, the whole document; a
        // cost that stays away is no change.
        assert!(delta(&Value::Null, &after).is_none());
        assert_eq!(delta(&Value::Null, &Value::Null).unwrap(), json!({}));
        // Rows past a digit boundary (keys "9", "10", "11" sort as strings).
        let mut grown = after.clone();
        grown["branches"].as_array_mut().unwrap().truncate(9);
        let mut rebuilt = grown.clone();
        patch(&mut rebuilt, &delta(&grown, &after).unwrap());
        assert_eq!(rebuilt, after);
    }
}
