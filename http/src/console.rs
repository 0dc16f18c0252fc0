//! The web console (docs/CONSOLE.md): three files embedded in the binary and served at `/`
//! and `/console/`; everything else it shows comes from the API with the visitor's token.
//! No build step: the files are the source.

use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};

const INDEX: &str = include_str!("console/index.html");
const SCRIPT: &str = include_str!("console/app.js");
const STYLE: &str = include_str!("console/app.css");

/// What a page may load: its own files and API, nothing else (inline styles for the
/// positioned rows and bars).
const CSP: &str = "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'";

fn file(body: &'static str, content_type: &'static str) -> Response {
    let mut r = body.into_response();
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    r
}

pub async fn index() -> Response {
    file(INDEX, "text/html; charset=utf-8")
}

pub async fn script() -> Response {
    file(SCRIPT, "text/javascript; charset=utf-8")
}

pub async fn style() -> Response {
    file(STYLE, "text/css; charset=utf-8")
}
