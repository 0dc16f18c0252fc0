//! The HTTP API (`/api/v1`, docs/HTTP.md): every operation of the API declaration
//! (`forkfleet_shared::api::ROUTES`) as an HTTP route, answered by the same `dispatch` and
//! handlers as the bus and the in-process client, for the caller a bearer token names.
//!
//! A request's fields come from its path (`/forks/{fork}`), its query string (a value is
//! read as JSON when it parses as JSON, else as a string) and its JSON body; the answer is
//! the reply's JSON, or an RFC 9457 `application/problem+json` document naming what was
//! wrong. A list answer pages with `limit` and `offset` (`X-Total-Count` says how many)
//! and filters on its items' fields (`?state=done`). Creating requests take an
//! `Idempotency-Key`. Besides the operations: Server-Sent Events of a fork's changes and
//! of a run's events (`stream`), blob uploads, the workers, and the OpenAPI document
//! generated from the same declaration (`openapi`).
//!
//! Layout: here the router and the call path; `auth` (tokens, scopes, the loopback rule),
//! `guard` (what every request must be first: Origin, Host, JSON bodies, no tokens in
//! URLs; ADR 36), `problem` (errors), `stream` (SSE), `openapi`, `audit` (who wrote what,
//! when), `idempotency` (replayed answers), `console` (the web console's three files,
//! docs/CONSOLE.md), `endpoint` (a service's HTTP listener: this API, `/metrics`,
//! `/healthz` and `/readyz` with its [`endpoint::Readiness`]).

pub mod audit;
pub mod auth;
mod console;
pub mod endpoint;
mod guard;
mod idempotency;
pub mod openapi;
pub mod problem;
mod stream;

use crate::auth::Principal;
use crate::problem::Problem;
use axum::body::Bytes;
use axum::extract::{ConnectInfo, RawPathParams, RawQuery, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodFilter, MethodRouter};
use axum::Router;
use forkfleet_bus::Bus;
use forkfleet_coordinator::handle::CoordinatorHandle;
use forkfleet_shared::api::{dispatch, Access, ApiReply, ApiRequest, Route, ROUTES};
use serde_json::{Map, Value};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, RwLock};

/// The prefix of every route.
pub const PREFIX: &str = "/api/v1";

/// What answers once the coordinator serves: its handle and its bus.
#[derive(Clone)]
pub struct Serving {
    pub handle: CoordinatorHandle,
    pub bus: Arc<dyn Bus>,
    /// When it began serving, in ms since the Unix epoch: a fork's version starts again
    /// with every start, so its stream's event ids carry this first and stay monotonic
    /// across restarts (two starts within one second are told apart).
    pub since_ms: u64,
}

impl Serving {
    /// The coordinator `handle` on `bus`, serving from now.
    pub fn new(handle: CoordinatorHandle, bus: Arc<dyn Bus>) -> Self {
        Self {
            handle,
            bus,
            since_ms: forkfleet_shared::protocol::now_ms(),
        }
    }
}

/// Where the coordinator is put once it serves (a standby has none yet).
#[derive(Clone, Default)]
pub struct Slot(Arc<RwLock<Option<Serving>>>);

impl Slot {
    pub fn set(&self, serving: Option<Serving>) {
        *self.0.write().unwrap_or_else(|p| p.into_inner()) = serving;
    }

    fn get(&self) -> Option<Serving> {
        self.0.read().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// The HTTP API's state: the coordinator's slot, the tokens, the audit log, the answers
/// kept for idempotency keys.
pub struct ApiHttp {
    pub slot: Slot,
    pub auth: auth::Tokens,
    pub audit: audit::Audit,
    idem: idempotency::Cache,
    /// `forkfleet ui`: a client of the embedded system, whose merges (and resolves that
    /// merged) are applied to the fork's workspace directory on this machine, as `fork
    /// merge` does. A coordinator has none: its forks' directories are the clients'.
    pub local: Option<forkfleet_client::Client>,
}

impl ApiHttp {
    pub fn new(slot: Slot, auth: auth::Tokens, audit: audit::Audit) -> Arc<Self> {
        Self::with_local(slot, auth, audit, None)
    }

    /// [`ApiHttp::new`], merges applied to their workspace directories through `local`.
    pub fn with_local(
        slot: Slot,
        auth: auth::Tokens,
        audit: audit::Audit,
        local: Option<forkfleet_client::Client>,
    ) -> Arc<Self> {
        Arc::new(Self {
            slot,
            auth,
            audit,
            idem: idempotency::Cache::default(),
            local,
        })
    }

    /// With a local client, apply a merge the reply reports to its fork's workspace
    /// directory (when that directory is on this machine).
    async fn apply_locally(&self, reply: &ApiReply) {
        let Some(client) = &self.local else { return };
        let outcome = match reply {
            ApiReply::Merge(o) => o,
            ApiReply::Resolve(r) => match &r.merge {
                Some(o) => o,
                None => return,
            },
            _ => return,
        };
        use forkfleet_shared::api::ApiClient;
        let Ok(view) = client.fork(outcome.fork_id).await else {
            return;
        };
        let Some(dir) = view.workspace.as_deref().map(std::path::PathBuf::from) else {
            return;
        };
        if !dir.is_dir() {
            return;
        }
        match forkfleet_client::run::apply_outcome(client, outcome, Some(&dir), None).await {
            Ok(report) => {
                tracing::info!(fork.id = %outcome.fork_id, paths = report.applied_paths.len(), dir = %dir.display(), "merge applied to the workspace")
            }
            Err(e) => {
                tracing::error!(fork.id = %outcome.fork_id, error = %e, "the merge could not be applied to the workspace")
            }
        }
        forkfleet_client::forkdir::cleanup_after_merge(client, outcome.fork_id).await;
    }

    /// Who asks, allowed `need`; the coordinator that answers.
    fn admit(
        &self,
        headers: &HeaderMap,
        query: Option<&str>,
        peer: SocketAddr,
        need: Access,
    ) -> Result<(Principal, Serving), Problem> {
        let principal = self.auth.authenticate(headers, query, peer)?;
        if !principal.may(need) {
            return Err(Problem::forbidden(format!(
                "token `{}` has the scopes {}; this needs `{}`",
                principal.name,
                principal.scopes_text(),
                need.as_str()
            )));
        }
        let serving = self.slot.get().ok_or_else(|| {
            Problem::unavailable(
                "the coordinator does not serve yet (starting, or a standby waiting for the lease); try again",
            )
        })?;
        Ok((principal, serving))
    }
}

/// The API's routes, under [`PREFIX`], for a server that gives each request its peer
/// address (`into_make_service_with_connect_info::<SocketAddr>()`).
pub fn router(state: Arc<ApiHttp>) -> Router {
    let mut paths: BTreeMap<String, MethodRouter<Arc<ApiHttp>>> = BTreeMap::new();
    for route in ROUTES {
        let filter = match route.method {
            "GET" => MethodFilter::GET,
            "POST" => MethodFilter::POST,
            "PUT" => MethodFilter::PUT,
            _ => MethodFilter::DELETE,
        };
        let handler = move |State(st): State<Arc<ApiHttp>>,
                            ConnectInfo(peer): ConnectInfo<SocketAddr>,
                            headers: HeaderMap,
                            params: RawPathParams,
                            RawQuery(query): RawQuery,
                            body: Bytes| async move {
            let params: Vec<String> = params.iter().map(|(_, v)| v.to_string()).collect();
            call(&st, route, peer, &headers, &params, query.as_deref(), &body).await
        };
        let path = axum_path(route.path);
        let entry = paths.remove(&path).unwrap_or_default();
        paths.insert(path, entry.on(filter, handler));
    }
    for (path, extra) in stream::routes() {
        let path = axum_path(path);
        let entry = paths.remove(&path).unwrap_or_default();
        paths.insert(path, entry.merge(extra));
    }
    let mut router = Router::new();
    for (path, methods) in paths {
        router = router.route(&format!("{PREFIX}{path}"), methods);
    }
    router
        .route(
            &format!("{PREFIX}/openapi.json"),
            axum::routing::get(openapi::serve),
        )
        .route(PREFIX, axum::routing::get(openapi::serve))
        .route("/", axum::routing::get(console::index))
        .route("/console/app.js", axum::routing::get(console::script))
        .route("/console/app.css", axum::routing::get(console::style))
        .fallback(not_found)
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            guard::guard,
        ))
        .layer(axum::middleware::from_fn(traced))
        .with_state(state)
}

/// Every request is a span, `{METHOD} {route}` (the HTTP semantic conventions' server
/// span), the child of the caller's `traceparent` header when it sends one: what the
/// request asks of the coordinator and the workers continues its trace. A ticket or a
/// token never reaches it (only the route, not the path's values or the query).
async fn traced(
    matched: Option<axum::extract::MatchedPath>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    use tracing::Instrument as _;
    let route = matched.as_ref().map_or("(unrouted)", |m| m.as_str());
    // The conventions' known methods; any other is `_OTHER` (a span name of bounded kinds).
    let method = match req.method().as_str() {
        m @ ("GET" | "HEAD" | "POST" | "PUT" | "DELETE" | "CONNECT" | "OPTIONS" | "TRACE"
        | "PATCH") => m.to_string(),
        _ => "_OTHER".to_string(),
    };
    let span = tracing::info_span!(
        "http.request",
        otel.name = %format_args!("{method} {route}"),
        otel.kind = "server",
        otel.status_code = tracing::field::Empty,
        http.request.method = %method,
        http.route = %route,
        http.response.status_code = tracing::field::Empty,
    );
    let parent = req
        .headers()
        .get("traceparent")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    // The caller's trace continues; whether it is recorded is this process's decision.
    forkfleet_shared::trace::set_caller_parent(&span, parent.as_deref());
    let resp = next.run(req).instrument(span.clone()).await;
    let status = resp.status().as_u16();
    span.record("http.response.status_code", i64::from(status));
    if status >= 500 {
        span.record("otel.status_code", "ERROR");
    }
    resp
}

async fn not_found(uri: axum::http::Uri) -> Response {
    Problem::not_found(format!(
        "no route {}: GET {PREFIX}/openapi.json lists them",
        uri.path()
    ))
    .into_response()
}

/// A declared path with its fields' segments renamed by position (`/runs/{p1}/events`):
/// the router wants one name per position across routes, the declarations name fields.
fn axum_path(path: &str) -> String {
    path.split('/')
        .enumerate()
        .map(|(i, seg)| {
            if seg.starts_with('{') {
                format!("{{p{i}}}")
            } else {
                seg.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join("/")
}

/// One operation's request from the path's values (in the route's order), the query
/// string and the body; what the HTTP layer reads itself (`limit`, `offset`, filters,
/// a stream's `ticket`) apart.
#[derive(Debug)]
struct Parsed {
    request: ApiRequest,
    paging: Paging,
}

/// What a list answer is cut to: its items whose fields match `filters`, then `limit`
/// items from `offset` (query parameters `limit`, `offset` and any item field).
#[derive(Debug)]
struct Paging {
    filters: Vec<(String, String)>,
    limit: Option<usize>,
    offset: usize,
}

fn parse(
    route: &Route,
    params: &[String],
    query: Option<&str>,
    body: &[u8],
) -> Result<Parsed, Problem> {
    let mut args = Map::new();
    for (name, value) in route.path_fields().zip(params) {
        args.insert(name.to_string(), Value::String(value.clone()));
    }
    let mut raw_query = Vec::new();
    let mut filters = Vec::new();
    let (mut limit, mut offset) = (None, 0);
    for (k, v) in form_pairs(query) {
        match k.as_str() {
            "limit" => limit = Some(number(&k, &v)?),
            "offset" => offset = number(&k, &v)?,
            "ticket" => {}
            _ if route.fields.iter().any(|(f, _)| *f == k) => {
                if args.contains_key(&k) {
                    return Err(Problem::bad_input(format!("`{k}` is given twice")));
                }
                raw_query.push((k.clone(), v.clone()));
                args.insert(k, serde_json::from_str(&v).unwrap_or(Value::String(v)));
            }
            _ => filters.push((k, v)),
        }
    }
    if !body.iter().all(u8::is_ascii_whitespace) {
        let Value::Object(fields) = serde_json::from_slice::<Value>(body)
            .map_err(|e| Problem::bad_input(format!("the body is not JSON: {e}")))?
        else {
            return Err(Problem::bad_input(format!(
                "the body is a JSON object of `{}`'s fields: {}",
                route.name,
                fields_text(route)
            )));
        };
        for (k, v) in fields {
            if args.contains_key(&k) {
                return Err(Problem::bad_input(format!(
                    "`{k}` is given twice (in the path or query, and in the body)"
                )));
            }
            args.insert(k, v);
        }
    }
    let request = decode(route, args.clone()).or_else(|first| {
        // A query value that parsed as JSON may have been meant as a string (`label=1`).
        if raw_query.is_empty() {
            return Err(first);
        }
        for (k, v) in &raw_query {
            args.insert(k.clone(), Value::String(v.clone()));
        }
        decode(route, args).map_err(|_| first)
    })?;
    Ok(Parsed {
        request,
        paging: Paging {
            filters,
            limit,
            offset,
        },
    })
}

fn number(k: &str, v: &str) -> Result<usize, Problem> {
    v.parse()
        .map_err(|_| Problem::bad_input(format!("`{k}` is a count of 0 or more, not `{v}`")))
}

/// The query string's pairs, percent-decoded.
fn form_pairs(query: Option<&str>) -> Vec<(String, String)> {
    let Some(q) = query else { return Vec::new() };
    q.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (unescape(k), unescape(v))
        })
        .collect()
}

fn unescape(s: &str) -> String {
    let s = s.replace('+', " ");
    forkfleet_shared::percent::decode(&s).unwrap_or(s)
}

fn fields_text(route: &Route) -> String {
    if route.fields.is_empty() {
        return "none".to_string();
    }
    route
        .fields
        .iter()
        .map(|(n, t)| format!("{n}: {t}"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn decode(route: &Route, args: Map<String, Value>) -> Result<ApiRequest, Problem> {
    let doc = if route.fields.is_empty() {
        if let Some(k) = args.keys().next() {
            return Err(Problem::bad_input(format!(
                "`{}` takes no fields; `{k}` is not one",
                route.name
            )));
        }
        serde_json::json!({ "op": route.name })
    } else {
        serde_json::json!({ "op": route.name, "args": args })
    };
    serde_json::from_value(doc).map_err(|e| {
        Problem::bad_input(format!(
            "not a valid `{}` request: {e}; its fields: {}",
            route.name,
            fields_text(route)
        ))
    })
}

/// Answer one request of `route`.
async fn call(
    st: &ApiHttp,
    route: &'static Route,
    peer: SocketAddr,
    headers: &HeaderMap,
    params: &[String],
    query: Option<&str>,
    body: &Bytes,
) -> Response {
    let (principal, serving) = match st.admit(headers, query, peer, route.access) {
        Ok(x) => x,
        Err(p) => return p.into_response(),
    };
    let parsed = match parse(route, params, query, body) {
        Ok(p) => p,
        Err(p) => return p.into_response(),
    };
    let key = (!route.idempotent)
        .then(|| headers.get("idempotency-key"))
        .flatten()
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let fingerprint = idempotency::fingerprint(route.name, params, query, body);
    let running = match begin_keyed(st, &principal.name, key.as_deref(), &fingerprint).await {
        Ok(running) => running,
        Err(answer) => return answer,
    };
    let answered = dispatch(&serving.handle, &principal.caller(), parsed.request).await;
    let kept = match answered {
        Ok(reply) => {
            st.apply_locally(&reply).await;
            reply_body(route, reply, &parsed.paging)
        }
        Err(e) => Err(Problem::from_api(&e)),
    };
    let kept = kept.unwrap_or_else(|p| p.kept());
    if route.access != Access::Read {
        st.audit
            .record(
                &principal,
                (route.name, route.method, route.path),
                params,
                kept.status,
            )
            .await;
    }
    if let Some(running) = running {
        running.finish(kept.clone());
    }
    kept.response(false)
}

/// Begin a creating call under its `Idempotency-Key`, if it has one: the key's running
/// request to finish with the answer, or (`Err`) the response to send now: the answer
/// the key already had (replayed), or a problem.
async fn begin_keyed<'a>(
    st: &'a ApiHttp,
    who: &str,
    key: Option<&str>,
    fingerprint: &[u8; 32],
) -> Result<Option<idempotency::Running<'a>>, Response> {
    let Some(key) = key else { return Ok(None) };
    match st.idem.begin(who, key, fingerprint).await {
        Ok(Ok(kept)) => Err(kept.response(true)),
        Ok(Err(running)) => Ok(Some(running)),
        Err(p) => Err(p.into_response()),
    }
}

/// An answer as kept for an idempotency key: its status, type and body.
#[derive(Debug, Clone)]
pub struct Kept {
    pub status: StatusCode,
    pub content_type: &'static str,
    pub body: Bytes,
    pub total: Option<usize>,
}

impl Kept {
    /// A JSON answer of 200.
    fn json(value: &impl serde::Serialize) -> Kept {
        match serde_json::to_vec(value) {
            Ok(body) => Kept {
                status: StatusCode::OK,
                content_type: "application/json",
                body: Bytes::from(body),
                total: None,
            },
            Err(e) => Problem::failure(format!("cannot encode the answer: {e}")).kept(),
        }
    }

    fn response(&self, replayed: bool) -> Response {
        let mut r = (self.status, self.body.clone()).into_response();
        r.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static(self.content_type),
        );
        if let Some(t) = self.total {
            if let Ok(v) = HeaderValue::from_str(&t.to_string()) {
                r.headers_mut().insert("x-total-count", v);
            }
        }
        if replayed {
            r.headers_mut()
                .insert("idempotent-replayed", HeaderValue::from_static("true"));
        }
        r
    }
}

/// The reply as JSON (a blob as its bytes), a list paged and filtered.
fn reply_body(route: &Route, reply: ApiReply, parsed: &Paging) -> Result<Kept, Problem> {
    if let ApiReply::Blob(blob) = reply {
        return match blob {
            Some(bytes) => Ok(Kept {
                status: StatusCode::OK,
                content_type: "application/octet-stream",
                body: bytes,
                total: None,
            }),
            None => Err(Problem::not_found("the store has no such blob")),
        };
    }
    let mut doc = serde_json::to_value(&reply)
        .map_err(|e| Problem::failure(format!("the answer could not be encoded: {e}")))?;
    let mut body = doc.get_mut("body").map(Value::take).unwrap_or(Value::Null);
    let mut total = None;
    if let Value::Array(items) = &mut body {
        for (k, v) in &parsed.filters {
            if !items.is_empty() && !items.iter().any(|i| i.get(k).is_some()) {
                let mut valid: Vec<&String> = items
                    .first()
                    .and_then(Value::as_object)
                    .map(|o| o.keys().collect())
                    .unwrap_or_default();
                valid.sort();
                return Err(Problem::bad_input(format!(
                    "`{k}` is not a field of `{}`'s items to filter on; they have: {}",
                    route.name,
                    valid
                        .iter()
                        .map(|s| s.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                )));
            }
            items.retain(|i| i.get(k).is_some_and(|f| matches(f, v)));
        }
        total = Some(items.len());
        let end = parsed
            .limit
            .map_or(items.len(), |l| (parsed.offset + l).min(items.len()));
        let start = parsed.offset.min(end);
        *items = items.drain(start..end).collect();
    } else if let Some((k, _)) = parsed.filters.first() {
        return Err(Problem::bad_input(format!(
            "`{k}` is not a field of `{}`: {}",
            route.name,
            fields_text(route)
        )));
    }
    let bytes = serde_json::to_vec(&body)
        .map_err(|e| Problem::failure(format!("the answer could not be encoded: {e}")))?;
    Ok(Kept {
        status: StatusCode::OK,
        content_type: "application/json",
        body: Bytes::from(bytes),
        total,
    })
}

/// A filter's value against a field: a string equal to it, a number or bool written so,
/// or an object (a tagged state) with a string member equal to it.
fn matches(field: &Value, want: &str) -> bool {
    match field {
        Value::String(s) => s == want,
        Value::Number(n) => n.to_string() == want,
        Value::Bool(b) => b.to_string() == want,
        Value::Object(o) => o.values().any(|v| v.as_str() == Some(want)),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_renamed_by_position() {
        assert_eq!(axum_path("/runs/{run}/events"), "/runs/{p2}/events");
        assert_eq!(
            axum_path("/forks/{fork}/branches/{label}/steer"),
            "/forks/{p2}/branches/{p4}/steer"
        );
    }

    #[test]
    fn a_request_comes_from_the_path_the_query_and_the_body() {
        let steer = Route::of("steer").unwrap();
        let fork = forkfleet_shared::ids::ForkId::new();
        let p = parse(
            steer,
            &[fork.to_string(), "1".into()],
            None,
            br#"{"text": "go"}"#,
        )
        .unwrap();
        match p.request {
            ApiRequest::Steer(s) => assert_eq!((s.label.as_str(), s.text.as_str()), ("1", "go")),
            other => panic!("{other:?}"),
        }
        let watch = Route::of("watch").unwrap();
        let p = parse(
            watch,
            &[fork.to_string()],
            Some("timeout_ms=5&seen=3&limit=2&state=open"),
            b"",
        )
        .unwrap();
        assert!(
            matches!(p.request, ApiRequest::Watch(ref w) if w.timeout_ms == 5 && w.seen == Some(3))
        );
        assert_eq!((p.paging.limit, p.paging.filters.len()), (Some(2), 1));
        let e = parse(steer, &[fork.to_string(), "a".into()], None, b"[1]").unwrap_err();
        assert!(e.detail.contains("text: String"), "{}", e.detail);
        let e = parse(
            steer,
            &[fork.to_string(), "a".into()],
            None,
            br#"{"label": "b", "text": "x"}"#,
        )
        .unwrap_err();
        assert!(e.detail.contains("given twice"), "{}", e.detail);
        let e = parse(
            steer,
            &["nope".into(), "a".into()],
            None,
            br#"{"text": "x"}"#,
        )
        .unwrap_err();
        assert!(
            e.detail.contains("not a valid `steer` request"),
            "{}",
            e.detail
        );
    }

    /// docs/HTTP.md's table names every declared route.
    #[test]
    fn the_docs_list_every_route() {
        let doc = include_str!("../../docs/HTTP.md");
        for r in ROUTES {
            let row = format!(
                "| `{} {}` | `{}` | {} |",
                r.method,
                r.path,
                r.name,
                r.access.as_str()
            );
            assert!(doc.contains(&row), "docs/HTTP.md lacks {row}");
        }
    }

    #[test]
    fn filters_match_strings_numbers_and_tagged_states() {
        assert!(matches(&serde_json::json!("done"), "done"));
        assert!(matches(&serde_json::json!(3), "3"));
        assert!(matches(
            &serde_json::json!({"state": "merged", "winner": "a"}),
            "merged"
        ));
        assert!(!matches(&serde_json::json!(null), "x"));
    }
}
