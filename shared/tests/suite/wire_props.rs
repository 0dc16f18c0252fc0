//! Property tests of the wire envelope: random messages of the bus's kinds survive an
//! encode / decode round trip, are refused with a `kind` error by the readers of every
//! other kind, and decoding never panics, whether on a cut or damaged message or on
//! random bytes.

use forkfleet_shared::api::{self, ApiError, ApiErrorKind, ApiRequest, ApiResponse};
use forkfleet_shared::blob::BlobHash;
use forkfleet_shared::budget::{BudgetReply, BudgetRequest};
use forkfleet_shared::event::{Event, ToolCall, Usage};
use forkfleet_shared::ids::{CheckpointId, ForkId, ReservationId, RunId, WorkerId};
use forkfleet_shared::manifest::FileEntry;
use forkfleet_shared::overlay::ChangeOp;
use forkfleet_shared::path::WsPath;
use forkfleet_shared::protocol::{
    BranchEvent, Control, ControlCommand, ResumeReply, ResumeRequest, WorkerInfo,
};
use forkfleet_shared::state::BranchState;
use forkfleet_shared::wire::{self, WireError, WireMessage, WIRE_VERSION};
use proptest::prelude::*;
use serde::Serialize;
use std::fmt::Debug;

/// `PROPTEST_CASES` overrides the default case count (for stress runs).
fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

// ---- strategies ---------------------------------------------------------------------

fn text() -> impl Strategy<Value = String> {
    // Any characters, multi-byte ones and controls included.
    any::<String>()
}

fn float() -> impl Strategy<Value = f64> {
    use prop::num::f64::{INFINITE, NORMAL, SUBNORMAL, ZERO};
    NORMAL | SUBNORMAL | ZERO | INFINITE
}

fn run_id() -> impl Strategy<Value = RunId> {
    any::<[u8; 16]>().prop_map(RunId::from_bytes)
}

fn fork_id() -> impl Strategy<Value = ForkId> {
    any::<[u8; 16]>().prop_map(ForkId::from_bytes)
}

fn blob_hash() -> impl Strategy<Value = BlobHash> {
    any::<[u8; 32]>().prop_map(BlobHash)
}

fn ws_path() -> impl Strategy<Value = WsPath> {
    prop::collection::vec("[a-zA-Z0-9_.-]{1,8}", 1..4)
        .prop_filter_map("a valid workspace path", |parts| {
            WsPath::parse(&parts.join("/")).ok()
        })
}

fn file_entry() -> impl Strategy<Value = FileEntry> {
    (blob_hash(), any::<u64>(), any::<u32>(), any::<bool>()).prop_map(
        |(hash, size, mode, binary)| FileEntry {
            hash,
            size,
            mode,
            binary,
        },
    )
}

fn change_op() -> impl Strategy<Value = ChangeOp> {
    prop_oneof![
        (ws_path(), file_entry()).prop_map(|(path, entry)| ChangeOp::Write { path, entry }),
        (ws_path(), file_entry()).prop_map(|(path, entry)| ChangeOp::Edit { path, entry }),
        ws_path().prop_map(|path| ChangeOp::Delete { path }),
        ws_path().prop_map(|path| ChangeOp::Mkdir { path }),
        ws_path().prop_map(|path| ChangeOp::Rmdir { path }),
    ]
}

fn branch_state() -> impl Strategy<Value = BranchState> {
    prop::sample::select(BranchState::ALL.to_vec())
}

fn usage() -> impl Strategy<Value = Usage> {
    (any::<u64>(), any::<u64>(), any::<u64>()).prop_map(|(i, o, c)| Usage {
        input_tokens: i,
        output_tokens: o,
        cached_tokens: c,
        cache_write_tokens: 0,
        reasoning_tokens: 0,
    })
}

/// JSON arguments of a tool call: an object of strings, integers and booleans.
fn json_args() -> impl Strategy<Value = serde_json::Value> {
    let value = prop_oneof![
        text().prop_map(serde_json::Value::from),
        any::<i64>().prop_map(serde_json::Value::from),
        any::<u64>().prop_map(serde_json::Value::from),
        any::<bool>().prop_map(serde_json::Value::from),
    ];
    prop::collection::btree_map("[a-z_]{1,8}", value, 0..4)
        .prop_map(|m| serde_json::Value::Object(m.into_iter().collect()))
}

fn tool_call() -> impl Strategy<Value = ToolCall> {
    (text(), text(), json_args()).prop_map(|(id, name, args)| ToolCall { id, name, args })
}

fn event() -> impl Strategy<Value = Event> {
    prop_oneof![
        (fork_id(), run_id(), run_id(), any::<u64>(), text()).prop_map(
            |(fork_id, parent_run, fork_root, cutoff_seq, label)| Event::Fork {
                fork_id,
                parent_run,
                fork_root,
                cutoff_seq,
                label,
                replay_event_count: 0,
                strategy: None,
                workspaces: Vec::new(),
            }
        ),
        text().prop_map(|text| Event::System { text }),
        text().prop_map(|text| Event::UserMessage { text }),
        (
            text(),
            prop::option::of(text()),
            prop::collection::vec(tool_call(), 0..3)
        )
            .prop_map(|(model, text, tool_calls)| Event::ModelResponse {
                model,
                text,
                tool_calls,
                request: None,
                finish_reason: None,
                reasoning: None,
            }),
        (text(), text(), any::<bool>(), text()).prop_map(|(call_id, name, ok, output)| {
            Event::ToolResult {
                call_id,
                name,
                ok,
                output,
                request: None,
            }
        }),
        change_op().prop_map(|change| Event::FileChange { change }),
        (
            text(),
            usage(),
            float(),
            prop::option::of(any::<[u8; 16]>())
        )
            .prop_map(|(model, usage, cost_usd, reservation)| Event::Usage {
                model,
                usage,
                cost_usd,
                reservation: reservation.map(ReservationId::from_bytes),
                cached: false,
            }),
        text().prop_map(|text| Event::Steer { text }),
        text().prop_map(|text| Event::FollowUp { text }),
        text().prop_map(|text| Event::BranchSummary { text }),
        text().prop_map(|label| Event::Checkpoint { label }),
        (branch_state(), prop::option::of(text()))
            .prop_map(|(state, error)| Event::Status { state, error }),
        (any::<u64>(), any::<[u8; 16]>(), text()).prop_map(|(to_seq, checkpoint, label)| {
            Event::Rewind {
                to_seq,
                checkpoint: CheckpointId::from_bytes(checkpoint),
                label,
            }
        }),
    ]
}

fn branch_event() -> impl Strategy<Value = BranchEvent> {
    (
        fork_id(),
        run_id(),
        any::<u64>(),
        any::<u64>(),
        event(),
        any::<u32>(),
    )
        .prop_map(
            |(fork_id, run_id, seq, at_ms, event, attempt)| BranchEvent {
                fork_id,
                run_id,
                seq,
                at_ms,
                event,
                attempt,
            },
        )
}

fn control() -> impl Strategy<Value = Control> {
    let command = prop_oneof![
        text().prop_map(|reason| ControlCommand::Terminate { reason }),
        text().prop_map(|text| ControlCommand::Steer { text }),
        (branch_state(), text(), any::<bool>()).prop_map(|(state, reason, graceful)| {
            ControlCommand::Stop {
                state,
                reason,
                graceful,
            }
        }),
        (text(), any::<bool>())
            .prop_map(|(reason, graceful)| ControlCommand::Pause { reason, graceful }),
    ];
    (run_id(), command, prop::option::of(any::<u32>())).prop_map(|(run_id, command, attempt)| {
        Control {
            run_id,
            command,
            attempt,
        }
    })
}

fn worker_info() -> impl Strategy<Value = WorkerInfo> {
    (
        any::<[u8; 16]>(),
        text(),
        any::<usize>(),
        prop::collection::vec(run_id(), 0..4),
        text(),
        text(),
        any::<u64>(),
        any::<u64>(),
    )
        .prop_map(
            |(worker, pool, concurrency, running, hostname, version, started, heartbeat)| {
                WorkerInfo {
                    worker_id: WorkerId::from_bytes(worker),
                    pool,
                    concurrency,
                    running,
                    hostname,
                    version,
                    started_at_ms: started,
                    heartbeat_at_ms: heartbeat,
                    models: vec![forkfleet_shared::catalogue::OfferedModel {
                        name: "openai:gpt-4o".into(),
                        dialect: "openai".into(),
                        base_url: Some("http://127.0.0.1:8080/v1".into()),
                    }],
                    allowed_model_hosts: vec!["127.0.0.1".into()],
                    commands: None,
                }
            },
        )
}

fn resume_reply() -> impl Strategy<Value = ResumeReply> {
    prop_oneof![
        prop::collection::vec((any::<u64>(), event()), 0..4)
            .prop_map(|events| ResumeReply::Log { events }),
        text().prop_map(|reason| ResumeReply::Gone { reason }),
        text().prop_map(|reason| ResumeReply::Retry { reason }),
        text().prop_map(|reason| ResumeReply::Refused { reason }),
    ]
}

fn budget_request() -> impl Strategy<Value = BudgetRequest> {
    (
        fork_id(),
        run_id(),
        any::<u32>(),
        float(),
        usage(),
        proptest::option::of(float()),
    )
        .prop_map(
            |(fork_id, run_id, attempt, estimate_usd, estimate, least_usd)| BudgetRequest {
                fork_id,
                run_id,
                attempt,
                estimate_usd,
                estimate,
                trace: None,
                settles: None,
                least_usd,
            },
        )
}

fn budget_reply() -> impl Strategy<Value = BudgetReply> {
    prop_oneof![
        any::<[u8; 16]>().prop_map(|r| BudgetReply::Granted {
            reservation: ReservationId::from_bytes(r)
        }),
        (branch_state(), text()).prop_map(|(state, reason)| BudgetReply::Refused { state, reason }),
        text().prop_map(|reason| BudgetReply::Gone { reason }),
        any::<u32>().prop_map(|by| BudgetReply::Superseded { by }),
        text().prop_map(|reason| BudgetReply::Retry { reason }),
        text().prop_map(|reason| BudgetReply::Wait { reason }),
        (any::<[u8; 16]>(), float()).prop_map(|(r, usd)| BudgetReply::Partial {
            reservation: ReservationId::from_bytes(r),
            usd
        }),
    ]
}

/// API requests made of ids, labels and texts (the ones carrying a fork plan are left to
/// the API's own tests).
fn api_request() -> impl Strategy<Value = ApiRequest> {
    prop_oneof![
        Just(ApiRequest::Ping),
        Just(ApiRequest::Forks),
        Just(ApiRequest::Accounts),
        fork_id().prop_map(|fork| ApiRequest::from(api::GetFork { fork })),
        text().prop_map(|prefix| ApiRequest::from(api::FindFork { prefix })),
        (fork_id(), any::<u64>())
            .prop_map(|(fork, timeout_ms)| ApiRequest::from(api::WaitSettled { fork, timeout_ms })),
        (fork_id(), prop::option::of(any::<u64>()), any::<u64>()).prop_map(
            |(fork, seen, timeout_ms)| ApiRequest::from(api::Watch {
                fork,
                seen,
                timeout_ms
            })
        ),
        (fork_id(), text()).prop_map(|(fork, pick)| ApiRequest::from(api::Merge { fork, pick })),
        (fork_id(), text())
            .prop_map(|(fork, label)| ApiRequest::from(api::Terminate { fork, label })),
        fork_id().prop_map(|fork| ApiRequest::from(api::Abort { fork })),
        (fork_id(), text(), text()).prop_map(|(fork, label, text)| ApiRequest::from(api::Steer {
            fork,
            label,
            text
        })),
        (fork_id(), text(), text())
            .prop_map(|(fork, label, text)| ApiRequest::from(api::Continue { fork, label, text })),
        run_id().prop_map(|run| ApiRequest::from(api::RunEvents { run })),
        (fork_id(), prop::option::of(text()), float())
            .prop_map(|(fork, branch, usd)| ApiRequest::from(api::Topup { fork, branch, usd })),
        (text(), prop::option::of(float()))
            .prop_map(|(name, cap_usd)| ApiRequest::from(api::AccountSet { name, cap_usd })),
        (run_id(), text(), any::<bool>()).prop_map(|(run, checkpoint, dry_run)| {
            ApiRequest::from(api::Rewind {
                run,
                checkpoint,
                dry_run,
            })
        }),
        blob_hash().prop_map(|blob| ApiRequest::Stored { blob }),
    ]
}

fn api_error() -> impl Strategy<Value = ApiResponse> {
    let kind = prop::sample::select(vec![
        ApiErrorKind::BadInput,
        ApiErrorKind::NotFound,
        ApiErrorKind::Conflict,
        ApiErrorKind::Unavailable,
        ApiErrorKind::Failure,
    ]);
    (kind, text()).prop_map(|(kind, message)| ApiResponse::Err(ApiError::new(kind, message)))
}

/// One message of any of the kinds above, encoded, with its kind.
fn any_message() -> impl Strategy<Value = (&'static str, Vec<u8>)> {
    fn enc<T: WireMessage>(m: T) -> (&'static str, Vec<u8>) {
        (T::KIND, wire::encode(&m).unwrap().to_vec())
    }
    prop_oneof![
        branch_event().prop_map(enc),
        control().prop_map(enc),
        worker_info().prop_map(enc),
        resume_reply().prop_map(enc),
        budget_request().prop_map(enc),
        budget_reply().prop_map(enc),
        api_request().prop_map(enc),
        api_error().prop_map(enc),
    ]
}

// ---- checks -------------------------------------------------------------------------

/// Decode `bytes` as every kind above: the kind and whether it decoded, or its error.
fn decode_as_every_kind(bytes: &[u8]) -> Vec<(&'static str, Result<(), WireError>)> {
    fn one<T: WireMessage>(bytes: &[u8]) -> (&'static str, Result<(), WireError>) {
        (T::KIND, wire::decode::<T>(bytes).map(|_| ()))
    }
    vec![
        one::<BranchEvent>(bytes),
        one::<Control>(bytes),
        one::<WorkerInfo>(bytes),
        one::<ResumeRequest>(bytes),
        one::<ResumeReply>(bytes),
        one::<BudgetRequest>(bytes),
        one::<BudgetReply>(bytes),
        one::<ApiRequest>(bytes),
        one::<ApiResponse>(bytes),
    ]
}

/// The envelope written by hand, with any version.
#[derive(Serialize)]
struct Envelope<'a, T> {
    v: u16,
    kind: &'a str,
    body: &'a T,
}

fn round_trip<T: WireMessage + PartialEq + Debug>(msg: &T) -> Result<(), TestCaseError> {
    let bytes = wire::encode(msg).unwrap();
    prop_assert_eq!(&wire::decode::<T>(&bytes).unwrap(), msg);
    prop_assert_eq!(wire::peek_kind(&bytes).unwrap(), T::KIND);
    // The envelope is exactly `{v, kind, body}` with named fields...
    let by_hand = rmp_serde::to_vec_named(&Envelope {
        v: WIRE_VERSION,
        kind: T::KIND,
        body: msg,
    })
    .unwrap();
    prop_assert_eq!(&bytes[..], &by_hand[..]);
    // ...and a reader refuses any other version, saying which.
    for v in [0, WIRE_VERSION + 1, u16::MAX] {
        let other = rmp_serde::to_vec_named(&Envelope {
            v,
            kind: T::KIND,
            body: msg,
        })
        .unwrap();
        match wire::decode::<T>(&other) {
            Err(WireError::Version { found, supported }) => {
                prop_assert_eq!(found, v);
                prop_assert_eq!(supported, WIRE_VERSION);
            }
            other => prop_assert!(false, "version {v} read as {other:?}"),
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases(256)))]

    #[test]
    fn branch_events_round_trip(m in branch_event()) {
        round_trip(&m)?;
    }

    #[test]
    fn controls_round_trip(m in control()) {
        round_trip(&m)?;
    }

    #[test]
    fn worker_infos_round_trip(m in worker_info()) {
        round_trip(&m)?;
    }

    #[test]
    fn resume_messages_round_trip(
        fork_id in fork_id(),
        run_id in run_id(),
        attempt in any::<u32>(),
        reply in resume_reply(),
    ) {
        round_trip(&ResumeRequest { fork_id, run_id, attempt, task: None })?;
        round_trip(&ResumeRequest {
            fork_id,
            run_id,
            attempt,
            task: Some(forkfleet_shared::protocol::TaskProof { seq: u64::from(attempt), delivered: attempt }),
        })?;
        round_trip(&reply)?;
    }

    #[test]
    fn budget_messages_round_trip(req in budget_request(), reply in budget_reply()) {
        round_trip(&req)?;
        round_trip(&reply)?;
    }

    #[test]
    fn api_messages_round_trip(req in api_request(), err in api_error()) {
        round_trip(&req)?;
        round_trip(&err)?;
    }

    #[test]
    fn only_the_reader_of_its_kind_accepts_a_message((kind, bytes) in any_message()) {
        for (reader, result) in decode_as_every_kind(&bytes) {
            if reader == kind {
                prop_assert!(result.is_ok(), "{kind}: {result:?}");
            } else {
                match result {
                    Err(WireError::Kind { expected, found }) => {
                        prop_assert_eq!(expected, reader);
                        prop_assert_eq!(found, kind);
                    }
                    other => prop_assert!(false, "a {kind} read as {reader}: {other:?}"),
                }
            }
        }
    }

    #[test]
    fn a_cut_message_never_decodes((kind, bytes) in any_message(), cut in any::<prop::sample::Index>()) {
        let cut = cut.index(bytes.len());
        for (reader, result) in decode_as_every_kind(&bytes[..cut]) {
            prop_assert!(result.is_err(), "{} of {} bytes of a {kind} read as {reader}", cut, bytes.len());
        }
    }

    #[test]
    fn a_damaged_message_decodes_or_fails_without_a_panic(
        (_kind, mut bytes) in any_message(),
        at in any::<prop::sample::Index>(),
        byte in any::<u8>(),
    ) {
        let at = at.index(bytes.len());
        bytes[at] = byte;
        for (_, result) in decode_as_every_kind(&bytes) {
            if let Err(e) = result {
                prop_assert!(!e.to_string().is_empty());
            }
        }
        let _ = wire::peek_kind(&bytes);
    }

    #[test]
    fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        for (_, result) in decode_as_every_kind(&bytes) {
            if let Err(e) = result {
                prop_assert!(!e.to_string().is_empty());
            }
        }
        let _ = wire::peek_kind(&bytes);
    }
}
