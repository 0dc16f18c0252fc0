//! What every request must be before any route sees it: checks that keep a web page in a
//! browser, on this machine or on the network, from using the API on its user's behalf.
//!
//! - **Host**: with no token configured the API answers loopback peers as the operator;
//!   it then also answers only requests addressed to a loopback name (`localhost`,
//!   `127.0.0.1`, `[::1]`, any port), so a page whose own domain resolves to 127.0.0.1
//!   (DNS rebinding) reaches nothing.
//! - **Origin**: a request that changes state (any method but `GET`, `HEAD`, `OPTIONS`)
//!   sent with an `Origin` is refused unless that origin is the API's own (its host and
//!   port are the `Host`, or `X-Forwarded-Host` behind a proxy). Browsers send `Origin` with
//!   every cross-origin `POST`, `no-cors` ones too; a tool without a browser sends none.
//! - **Bodies**: a `POST` or `PUT` with a body takes `application/json` only (a blob's
//!   `PUT` its bytes); the types a page may send without asking the server (`text/plain`,
//!   forms) are refused (415).
//! - **Tokens never in URLs**: `access_token` in a query is refused (URLs end up in logs
//!   and histories). An `EventSource` (which cannot send headers) uses a short-lived
//!   `ticket` from `POST /stream-tickets`, taken on `GET .../stream` only.

use super::problem::Problem;
use super::ApiHttp;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, Method};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use std::sync::Arc;

pub async fn guard(State(st): State<Arc<ApiHttp>>, req: Request, next: Next) -> Response {
    if let Err(p) = check(&st, req.method(), req.uri(), req.headers()) {
        return p.into_response();
    }
    let method = req.method().clone();
    let response = next.run(req).await;
    as_problem(response, &method)
}

/// The framework's own refusals (a method a route does not take, a body over the limit)
/// as problems, like every other error of the API.
fn as_problem(response: Response, method: &Method) -> Response {
    let problem = response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|t| t.to_str().ok())
        .is_some_and(|t| t.starts_with("application/problem+json"));
    if problem {
        return response;
    }
    match response.status() {
        axum::http::StatusCode::METHOD_NOT_ALLOWED => {
            let allowed = response
                .headers()
                .get(header::ALLOW)
                .and_then(|a| a.to_str().ok())
                .unwrap_or("")
                .to_string();
            let mut r = Problem::method_not_allowed(format!(
                "this route does not take {method}; it takes: {allowed}"
            ))
            .into_response();
            if let Ok(v) = header::HeaderValue::from_str(&allowed) {
                r.headers_mut().insert(header::ALLOW, v);
            }
            r
        }
        axum::http::StatusCode::PAYLOAD_TOO_LARGE => Problem::too_large(
            "the request body is larger than the API takes in one request (2 MiB)",
        )
        .into_response(),
        _ => response,
    }
}

fn check(
    st: &ApiHttp,
    method: &Method,
    uri: &axum::http::Uri,
    headers: &HeaderMap,
) -> Result<(), Problem> {
    let host = headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .unwrap_or("");
    if st.auth.is_empty() && !is_loopback_host(host) {
        return Err(Problem::forbidden(
            "with no token configured the API answers requests addressed to this machine's loopback (localhost, 127.0.0.1, [::1]) only: configure [http.tokens] to serve it under another name (docs/HTTP.md)",
        ));
    }
    let safe = matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS);
    if !safe {
        if let Some(origin) = headers.get(header::ORIGIN) {
            let origin = origin.to_str().unwrap_or("null");
            let forwarded = headers
                .get("x-forwarded-host")
                .and_then(|h| h.to_str().ok());
            let authority = origin_authority(origin);
            let ours = authority.is_some_and(|a| {
                a.eq_ignore_ascii_case(host)
                    || forwarded.is_some_and(|f| a.eq_ignore_ascii_case(f.trim()))
            });
            if !ours {
                return Err(Problem::forbidden(format!(
                    "a request from another origin ({}) may not change anything: the API takes writes from its own origin and from clients that are not browsers",
                    shown(origin)
                )));
            }
        }
    }
    // A body of a write is JSON; a blob's bytes are the one exception.
    let blob = uri
        .path()
        .strip_prefix(super::PREFIX)
        .is_some_and(|p| p.starts_with("/blobs/"));
    if *method == Method::POST || (*method == Method::PUT && !blob) {
        let kind = headers
            .get(header::CONTENT_TYPE)
            .and_then(|h| h.to_str().ok())
            .map(|t| {
                t.split(';')
                    .next()
                    .unwrap_or("")
                    .trim()
                    .to_ascii_lowercase()
            });
        let has_body = headers
            .get(header::CONTENT_LENGTH)
            .and_then(|h| h.to_str().ok())
            .is_some_and(|n| n.trim() != "0")
            || headers.contains_key(header::TRANSFER_ENCODING);
        match kind.as_deref() {
            Some("application/json") => {}
            None if !has_body => {}
            other => {
                return Err(Problem::unsupported_media(format!(
                    "a {method} body must be `Content-Type: application/json` (got {})",
                    other.map_or_else(|| "none".to_string(), |t| format!("`{}`", shown(t)))
                )))
            }
        }
    }
    let params = super::form_pairs(uri.query());
    if params.iter().any(|(k, _)| k == "access_token") {
        return Err(Problem::bad_input(
            "a token is never taken from a URL (URLs end up in logs and histories): send `Authorization: Bearer TOKEN`; an EventSource uses a ticket from `POST /api/v1/stream-tickets`",
        ));
    }
    if params.iter().any(|(k, _)| k == "ticket")
        && !(*method == Method::GET && uri.path().ends_with("/stream"))
    {
        return Err(Problem::bad_input(
            "a stream ticket is taken by `GET .../stream` only: send `Authorization: Bearer TOKEN` elsewhere",
        ));
    }
    Ok(())
}

/// `host[:port]` of an origin (`scheme://host[:port]`); `None` for `null` or garbage.
fn origin_authority(origin: &str) -> Option<&str> {
    let (_, rest) = origin.split_once("://")?;
    let authority = rest.split('/').next()?;
    (!authority.is_empty()).then_some(authority)
}

/// A loopback name, with or without a port.
fn is_loopback_host(host: &str) -> bool {
    let name = if let Some(rest) = host.strip_prefix('[') {
        rest.split(']').next().unwrap_or("")
    } else {
        host.rsplit_once(':').map_or(host, |(n, port)| {
            if port.chars().all(|c| c.is_ascii_digit()) {
                n
            } else {
                host
            }
        })
    };
    name.eq_ignore_ascii_case("localhost")
        || name
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// At most 100 characters of what a request sent, for an error.
fn shown(text: &str) -> String {
    text.chars().take(100).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_names_with_and_without_ports() {
        for h in [
            "localhost",
            "LOCALHOST:9090",
            "127.0.0.1",
            "127.0.0.1:80",
            "[::1]:9",
            "[::1]",
        ] {
            assert!(is_loopback_host(h), "{h}");
        }
        for h in [
            "",
            "evil.example",
            "evil.example:9090",
            "10.0.0.1:9090",
            "localhost.evil.example",
            "[::2]:9",
        ] {
            assert!(!is_loopback_host(h), "{h}");
        }
    }

    #[test]
    fn origins_authorities() {
        assert_eq!(
            origin_authority("http://127.0.0.1:9090"),
            Some("127.0.0.1:9090")
        );
        assert_eq!(
            origin_authority("https://ff.example.com"),
            Some("ff.example.com")
        );
        assert_eq!(origin_authority("null"), None);
    }
}
