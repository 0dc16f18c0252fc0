//! RFC 9457 problem details: every error of the HTTP API is an
//! `application/problem+json` document whose `type` names its kind and whose `detail`
//! says what was wrong and what is valid.

use super::Kept;
use axum::body::Bytes;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use forkfleet_shared::api::{ApiError, ApiErrorKind};

pub const CONTENT_TYPE: &str = "application/problem+json";

#[derive(Debug, Clone)]
pub struct Problem {
    pub status: StatusCode,
    /// `bad_input`, `not_found`, `conflict`, `unavailable`, `failure`, `unauthorized`,
    /// `forbidden`: the end of the `type` URI.
    pub kind: &'static str,
    pub detail: String,
}

impl Problem {
    fn new(status: StatusCode, kind: &'static str, detail: impl Into<String>) -> Self {
        Self {
            status,
            kind,
            detail: detail.into(),
        }
    }

    pub fn bad_input(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "bad_input", detail)
    }
    pub fn not_found(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "not_found", detail)
    }
    pub fn unauthorized(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, "unauthorized", detail)
    }
    pub fn forbidden(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::FORBIDDEN, "forbidden", detail)
    }
    pub fn conflict(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, "conflict", detail)
    }
    pub fn unavailable(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable", detail)
    }
    /// A method the route does not take (405); the kind is `bad_input`.
    pub fn method_not_allowed(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::METHOD_NOT_ALLOWED, "bad_input", detail)
    }
    /// A body over the API's limit (413); the kind is `bad_input`.
    pub fn too_large(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::PAYLOAD_TOO_LARGE, "bad_input", detail)
    }
    /// A body of a type the route does not take (415); the kind is `bad_input`.
    pub fn unsupported_media(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::UNSUPPORTED_MEDIA_TYPE, "bad_input", detail)
    }
    pub fn failure(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "failure", detail)
    }

    /// The API's error as a problem: its kind decides the status.
    pub fn from_api(e: &ApiError) -> Self {
        match e.kind {
            ApiErrorKind::BadInput => Self::bad_input(&e.message),
            ApiErrorKind::NotFound => Self::not_found(&e.message),
            ApiErrorKind::Conflict => Self::conflict(&e.message),
            ApiErrorKind::Unavailable => Self::unavailable(&e.message),
            ApiErrorKind::Failure => Self::failure(&e.message),
        }
    }

    fn title(&self) -> &'static str {
        match self.kind {
            "bad_input" => "The request is not valid",
            "not_found" => "Not found",
            "unauthorized" => "No valid token",
            "forbidden" => "Not allowed",
            "conflict" => "Conflict with the current state",
            "unavailable" => "Unavailable for now",
            _ => "The request failed",
        }
    }

    /// The document.
    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "type": format!("urn:forkfleet:problem:{}", self.kind),
            "title": self.title(),
            "status": self.status.as_u16(),
            "detail": self.detail,
            "kind": self.kind,
        })
    }

    /// As an answer to keep (for an idempotency key).
    pub fn kept(&self) -> Kept {
        Kept {
            status: self.status,
            content_type: CONTENT_TYPE,
            body: Bytes::from(self.json().to_string()),
            total: None,
        }
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let mut r = (self.status, self.json().to_string()).into_response();
        r.headers_mut()
            .insert(header::CONTENT_TYPE, HeaderValue::from_static(CONTENT_TYPE));
        if self.status == StatusCode::UNAUTHORIZED {
            r.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        r
    }
}
