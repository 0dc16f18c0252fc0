//! The coordinator's API: what clients send and what they get back.
//!
//! - [`ops`]: every operation, declared once (request, reply, wire name, idempotency,
//!   timeout), with the [`ApiRequest`] and [`ApiReply`] enums, the [`Handler`] /
//!   [`ApiHandler`] traits a server implements, [`dispatch`], and [`ApiClient`], which gives
//!   any client one method per operation.
//! - [`views`]: what the operations answer with (views of forks and runs, outcomes).
//! - [`limits`]: size bounds of a request's strings, checked before any work.
//! - here: the error every operation may answer with, and the response envelope.
//!
//! An in-process client calls [`dispatch`] on the coordinator directly; a cluster carries
//! requests over the bus's request/reply in wire envelopes.

pub mod caller;
pub mod limits;
pub mod ops;
pub mod views;

pub use caller::*;
pub use ops::*;
pub use views::*;

use serde::{Deserialize, Serialize};

/// The service subject of the coordinator's API (on NATS: `ff.api.coordinator`, see
/// [`crate::subjects::api_subject`]).
pub const API_SUBJECT: &str = "coordinator";

/// An encoded request or reply larger than this travels as a blob (`stored`), since a
/// NATS message is limited (1 MiB by default).
pub const MAX_INLINE_BYTES: usize = 512 * 1024;

/// Longest a `wait_settled` or `watch` request may ask the coordinator to hold it; a
/// client wanting longer asks again.
pub const MAX_API_WAIT_MS: u64 = 30_000;

/// How an API call failed, for the caller to decide what to do (and the CLI's exit code):
/// the error kind every forkfleet crate maps its errors to, on the wire as `bad_input`,
/// `not_found`, `conflict`, `unavailable` or `failure`.
pub type ApiErrorKind = crate::error::ErrorKind;

/// An API error: its kind and a message written for the user.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{message}")]
pub struct ApiError {
    pub kind: ApiErrorKind,
    pub message: String,
}

impl ApiError {
    pub fn new(kind: ApiErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }

    /// True when the request cannot succeed as things are (exit code 2).
    pub fn is_bad_input(&self) -> bool {
        self.kind.is_bad_input()
    }
}

/// The answer to an [`ApiRequest`]: `{"ok": {"reply": ..., "body": ...}}` or
/// `{"err": {"kind": ..., "message": ...}}` in the wire envelope (kind `api_response`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ApiResponse {
    Ok(Box<ApiReply>),
    Err(ApiError),
}

impl crate::wire::WireMessage for ApiResponse {
    const KIND: &'static str = "api_response";
}

impl From<Result<ApiReply, ApiError>> for ApiResponse {
    fn from(r: Result<ApiReply, ApiError>) -> Self {
        match r {
            Ok(reply) => ApiResponse::Ok(Box::new(reply)),
            Err(e) => ApiResponse::Err(e),
        }
    }
}

impl From<ApiResponse> for Result<ApiReply, ApiError> {
    fn from(r: ApiResponse) -> Self {
        match r {
            ApiResponse::Ok(reply) => Ok(*reply),
            ApiResponse::Err(e) => Err(e),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::blob::BlobHash;
    use crate::diff::{diff_report, DiffOptions};
    use crate::ids::ForkId;
    use crate::wire::{decode, encode};
    use uuid::Uuid;

    fn fork_id() -> ForkId {
        ForkId(Uuid::from_u128(0x0192_d2f4_5b7e_7c3a_9f1e_2b4c_6d8e_0a1b))
    }

    /// The exact bytes of two API messages. If this test fails, the API's wire format
    /// changed: that must be a deliberate act (clients in other languages read it).
    const GOLDEN_MERGE: &str = "83a17601a46b696e64ab6170695f72657175657374a4626f647982a26f70a56d65726765a46172677382a4666f726bc4100192d2f45b7e7c3a9f1e2b4c6d8e0a1ba47069636ba161";
    const GOLDEN_ERROR: &str = "83a17601a46b696e64ac6170695f726573706f6e7365a4626f647981a365727282a46b696e64a96e6f745f666f756e64a76d657373616765a76e6f20666f726b";

    #[test]
    fn golden_api_bytes() {
        let req = ApiRequest::from(Merge {
            fork: fork_id(),
            pick: "a".into(),
        });
        let bytes = encode(&req).unwrap();
        assert_eq!(hex::encode(&bytes), GOLDEN_MERGE);
        assert_eq!(decode::<ApiRequest>(&bytes).unwrap(), req);
        let resp = ApiResponse::Err(ApiError::new(ApiErrorKind::NotFound, "no fork"));
        let bytes = encode(&resp).unwrap();
        assert_eq!(hex::encode(&bytes), GOLDEN_ERROR);
        assert_eq!(decode::<ApiResponse>(&bytes).unwrap(), resp);
    }

    #[test]
    fn unit_and_tuple_variants_round_trip() {
        for req in [
            ApiRequest::Ping,
            ApiRequest::Forks,
            Watch {
                fork: fork_id(),
                seen: None,
                timeout_ms: 5,
            }
            .into(),
            Diff {
                fork: fork_id(),
                options: DiffOptions::default(),
            }
            .into(),
            ApiRequest::Stored {
                blob: BlobHash::of(b"x"),
            },
            Steer {
                fork: fork_id(),
                label: "a".into(),
                text: "go left".into(),
            }
            .into(),
            Continue {
                fork: fork_id(),
                label: "a".into(),
                text: "now the tests".into(),
            }
            .into(),
        ] {
            assert_eq!(decode::<ApiRequest>(&encode(&req).unwrap()).unwrap(), req);
        }
        let mut changes = std::collections::BTreeMap::new();
        changes.insert(
            crate::path::WsPath::parse("a.txt").unwrap(),
            crate::overlay::NetChange::Created(crate::manifest::FileEntry::for_bytes(
                b"hi\n", 0o644,
            )),
        );
        let report = diff_report(
            &crate::manifest::Manifest::default(),
            &[("x", &changes), ("y", &changes)],
            &|_| Some(bytes::Bytes::from_static(b"hi\n")),
            &DiffOptions {
                unified: true,
                ..DiffOptions::default()
            },
        );
        assert_eq!(report.paths.len(), 1);
        for reply in [
            ApiReply::ForkId(fork_id()),
            ApiReply::Forks(vec![]),
            ApiReply::Events(vec![LoggedEvent {
                seq: 0,
                event: crate::event::Event::Steer { text: "s".into() },
            }]),
            ApiReply::Diff(report),
        ] {
            let resp = ApiResponse::Ok(Box::new(reply));
            assert_eq!(
                decode::<ApiResponse>(&encode(&resp).unwrap()).unwrap(),
                resp
            );
        }
    }

    #[test]
    fn error_kinds_split_exit_codes() {
        assert!(ApiError::new(ApiErrorKind::NotFound, "x").is_bad_input());
        assert!(ApiError::new(ApiErrorKind::BadInput, "x").is_bad_input());
        assert!(ApiError::new(ApiErrorKind::Conflict, "x").is_bad_input());
        assert!(!ApiError::new(ApiErrorKind::Unavailable, "x").is_bad_input());
        assert!(!ApiError::new(ApiErrorKind::Failure, "x").is_bad_input());
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod operation_tests {
    use super::*;
    use crate::wire::{decode, encode};
    use std::time::Duration;

    /// The wire form of operations without arguments is `{"op": "<name>"}`, as before the
    /// API was declared in one place: an older client's `ping` still decodes.
    #[test]
    fn operations_without_arguments_have_no_args_on_the_wire() {
        let json = serde_json::to_string(&ApiRequest::Ping).unwrap();
        assert_eq!(json, r#"{"op":"ping"}"#);
        let back: ApiRequest = serde_json::from_str(r#"{"op":"accounts"}"#).unwrap();
        assert_eq!(back, ApiRequest::Accounts);
    }

    /// Each operation's declared name is the tag its request carries on the wire, and
    /// names are unique.
    #[test]
    fn declared_names_are_the_wire_tags() {
        let requests: Vec<ApiRequest> = vec![
            Ping.into(),
            Forks.into(),
            Accounts.into(),
            GetFork {
                fork: crate::ids::ForkId::new(),
            }
            .into(),
            FindRun { prefix: "x".into() }.into(),
            Continue {
                fork: crate::ids::ForkId::new(),
                label: "a".into(),
                text: "t".into(),
            }
            .into(),
        ];
        for req in requests {
            let json: serde_json::Value = serde_json::to_value(&req).unwrap();
            assert_eq!(json["op"], req.op(), "{req:?}");
            assert_eq!(decode::<ApiRequest>(&encode(&req).unwrap()).unwrap(), req);
        }
        let mut names = OPERATIONS.to_vec();
        names.sort_unstable();
        names.dedup();
        assert_eq!(
            names.len(),
            OPERATIONS.len(),
            "an operation name is declared twice"
        );
        assert!(!OPERATIONS.contains(&"stored"));
    }

    /// Every operation has one route; its path names only its fields; a route is not
    /// declared twice; reads are idempotent and GETs are reads; writes are not GETs.
    #[test]
    fn every_operation_has_one_consistent_http_route() {
        assert_eq!(ROUTES.len(), OPERATIONS.len());
        let mut seen = std::collections::BTreeSet::new();
        for (r, name) in ROUTES.iter().zip(OPERATIONS) {
            assert_eq!(r.name, *name);
            assert!(r.path.starts_with('/'), "{r:?}");
            assert!(
                seen.insert((r.method, r.path)),
                "{} {} twice",
                r.method,
                r.path
            );
            for f in r.path_fields() {
                assert!(
                    r.fields.iter().any(|(n, _)| *n == f),
                    "{}: {{{f}}} is not a field",
                    r.name
                );
            }
            assert!(
                ["GET", "POST", "PUT", "DELETE"].contains(&r.method),
                "{r:?}"
            );
            if r.access == Access::Read {
                assert!(r.idempotent && r.method == "GET", "{r:?}");
            } else {
                assert_ne!(r.method, "GET", "{r:?}");
            }
            assert!(!r.doc.trim().is_empty(), "{} has no doc", r.name);
        }
        assert_eq!(
            Route::of("merge").map(|r| r.path),
            Some("/forks/{fork}/merge")
        );
    }

    #[test]
    fn replies_come_back_only_as_their_own_kind() {
        let ok = GetForkCost::from_reply(ApiReply::ForkId(crate::ids::ForkId::new()));
        assert_eq!(ok, Err("fork_id"));
        let reply = Ping::into_reply(ServerInfo {
            version: "1".into(),
            wire_version: 1,
        });
        assert_eq!(reply.name(), "info");
        assert!(Ping::from_reply(reply).is_ok());
    }

    #[test]
    fn waiting_operations_wait_what_they_ask_plus_a_margin() {
        let w = Watch {
            fork: crate::ids::ForkId::new(),
            seen: None,
            timeout_ms: 1_000,
        };
        assert_eq!(w.timeout(), Duration::from_millis(1_000) + WAIT_MARGIN);
        let long = WaitSettled {
            fork: crate::ids::ForkId::new(),
            timeout_ms: u64::MAX,
        };
        assert_eq!(
            long.timeout(),
            Duration::from_millis(MAX_API_WAIT_MS) + WAIT_MARGIN
        );
        const { assert!(GetFork::IDEMPOTENT && !Merge::IDEMPOTENT) };
        assert!(ApiRequest::from(Ping).is_idempotent());
    }
}
