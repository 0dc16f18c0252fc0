//! The wire format: every message travels in a versioned envelope, encoded with rmp-serde
//! using named fields (`to_vec_named`), so fields can be added without breaking readers.
//!
//! `{ "v": WIRE_VERSION, "kind": "<message kind>", "body": { ... } }`
//!
//! A reader rejects a wrong version or a wrong kind with an error that says which, so a
//! stray or outdated message is logged and dropped, never misread. Golden-bytes tests pin
//! the encoding: changing it is a deliberate act (bump [`WIRE_VERSION`], never reuse a kind).

use bytes::Bytes;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// The envelope version this build writes and reads.
pub const WIRE_VERSION: u16 = 1;

/// A message that travels on the bus.
pub trait WireMessage: Serialize + DeserializeOwned {
    /// A stable name for the message type; never reused for another type.
    const KIND: &'static str;
}

#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("cannot encode {kind}: {message}")]
    Encode { kind: &'static str, message: String },
    #[error("not a forkfleet message ({message})")]
    NotAnEnvelope { message: String },
    #[error("wire version {found} is not supported (this build speaks version {supported})")]
    Version { found: u16, supported: u16 },
    #[error("expected a `{expected}` message, got `{found}`")]
    Kind {
        expected: &'static str,
        found: String,
    },
    #[error("malformed `{kind}` message: {message}")]
    Body { kind: &'static str, message: String },
}

#[derive(Serialize)]
struct EnvelopeOut<'a, T: ?Sized> {
    v: u16,
    kind: &'a str,
    body: &'a T,
}

#[derive(Deserialize)]
struct EnvelopeIn<'a, T> {
    v: u16,
    /// Borrowed from the message: no allocation per decode.
    kind: &'a str,
    body: T,
}

#[derive(Deserialize)]
struct Header {
    v: u16,
    kind: String,
}

pub fn encode<T: WireMessage>(msg: &T) -> Result<Bytes, WireError> {
    encode_kind(T::KIND, msg)
}

/// [`encode`] of a body that is not a [`WireMessage`] of its own (one that borrows what
/// it carries, such as a [`crate::protocol::BranchEventBatch`]), under `kind`.
pub fn encode_kind<T: Serialize + ?Sized>(kind: &'static str, msg: &T) -> Result<Bytes, WireError> {
    rmp_serde::to_vec_named(&EnvelopeOut {
        v: WIRE_VERSION,
        kind,
        body: msg,
    })
    .map(Bytes::from)
    .map_err(|e| WireError::Encode {
        kind,
        message: e.to_string(),
    })
}

pub fn decode<T: WireMessage>(bytes: &[u8]) -> Result<T, WireError> {
    decode_kind(T::KIND, bytes)
}

/// [`decode`] of a `kind` message whose body may borrow from `bytes`.
pub fn decode_kind<'a, T: Deserialize<'a>>(
    kind: &'static str,
    bytes: &'a [u8],
) -> Result<T, WireError> {
    match rmp_serde::from_slice::<EnvelopeIn<'a, T>>(bytes) {
        Ok(env) if env.v == WIRE_VERSION && env.kind == kind => Ok(env.body),
        Ok(env) => Err(check_header(env.v, env.kind, kind)),
        Err(body_err) => match rmp_serde::from_slice::<Header>(bytes) {
            Ok(h) if h.v == WIRE_VERSION && h.kind == kind => Err(WireError::Body {
                kind,
                message: body_err.to_string(),
            }),
            Ok(h) => Err(check_header(h.v, &h.kind, kind)),
            Err(e) => Err(WireError::NotAnEnvelope {
                message: e.to_string(),
            }),
        },
    }
}

fn check_header(v: u16, kind: &str, expected: &'static str) -> WireError {
    if v != WIRE_VERSION {
        WireError::Version {
            found: v,
            supported: WIRE_VERSION,
        }
    } else {
        WireError::Kind {
            expected,
            found: kind.to_string(),
        }
    }
}

/// The kind named in an envelope, read from its first bytes when they are laid out as
/// [`encode`] writes them (`v`, then `kind`), else as [`peek_kind`] reads it: a reader of
/// several kinds picks the body's type without decoding the message twice. The fast path
/// reads the head only: a message cut short after its kind passes here, and its decode
/// then fails.
pub fn kind_of(bytes: &[u8]) -> Result<std::borrow::Cow<'_, str>, WireError> {
    // fixmap(3), fixstr "v", positive fixint version, fixstr "kind", fixstr kind.
    const HEAD: [u8; 8] = [0x83, 0xa1, b'v', WIRE_VERSION as u8, 0xa4, b'k', b'i', b'n'];
    if WIRE_VERSION < 0x80 && bytes.len() > 10 && bytes[..8] == HEAD && bytes[8] == b'd' {
        let tag = bytes[9];
        let len = usize::from(tag & 0x1f);
        if tag & 0xe0 == 0xa0 && bytes.len() >= 10 + len {
            if let Ok(kind) = std::str::from_utf8(&bytes[10..10 + len]) {
                return Ok(std::borrow::Cow::Borrowed(kind));
            }
        }
    }
    peek_kind(bytes).map(std::borrow::Cow::Owned)
}

/// The kind named in an envelope, without decoding the body.
pub fn peek_kind(bytes: &[u8]) -> Result<String, WireError> {
    let h: Header = rmp_serde::from_slice(bytes).map_err(|e| WireError::NotAnEnvelope {
        message: e.to_string(),
    })?;
    if h.v != WIRE_VERSION {
        return Err(WireError::Version {
            found: h.v,
            supported: WIRE_VERSION,
        });
    }
    Ok(h.kind)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::blob::BlobHash;
    use crate::event::{Event, ToolCall, Usage};
    use crate::ids::{ForkId, RunId};
    use crate::manifest::FileEntry;
    use crate::overlay::ChangeOp;
    use crate::path::WsPath;
    use crate::protocol::{BranchEvent, BranchTask, Control, ControlCommand};
    use crate::state::BranchState;
    use uuid::Uuid;

    fn fork_id() -> ForkId {
        ForkId(Uuid::from_u128(0x0192_d2f4_5b7e_7c3a_9f1e_2b4c_6d8e_0a1b))
    }

    fn run_id() -> RunId {
        RunId(Uuid::from_u128(0x0192_d2f4_5b7e_7c3a_9f1e_2b4c_6d8e_0a1c))
    }

    fn golden_event() -> BranchEvent {
        BranchEvent {
            fork_id: fork_id(),
            run_id: run_id(),
            seq: 7,
            at_ms: 1_700_000_000_000,
            event: Event::FileChange {
                change: ChangeOp::Write {
                    path: WsPath::parse("src/a.txt").unwrap(),
                    entry: FileEntry::for_bytes(b"hi\n", 0o644),
                },
            },
            attempt: 2,
        }
    }

    /// The exact bytes of a branch event. If this test fails, the wire format changed:
    /// that must be a deliberate act (bump WIRE_VERSION or add only optional fields).
    const GOLDEN_EVENT: &str = "83a17601a46b696e64ac6272616e63685f6576656e74a4626f647986a7666f726b5f6964c4100192d2f45b7e7c3a9f1e2b4c6d8e0a1ba672756e5f6964c4100192d2f45b7e7c3a9f1e2b4c6d8e0a1ca373657107a561745f6d73cf0000018bcfe56800a56576656e7482a474797065ab66696c655f6368616e6765a66368616e676583a26f70a57772697465a470617468a97372632f612e747874a5656e74727984a468617368c42098ea6e4f216f2fb4b69fff9b3a44842c38686ca685f3f55dc48c5d3fb1107be4a473697a6503a46d6f6465cd01a4a662696e617279c2a7617474656d707402";

    /// The same event as written before `attempt` existed (wire version 1 still).
    const GOLDEN_EVENT_BEFORE_ATTEMPT: &str = "83a17601a46b696e64ac6272616e63685f6576656e74a4626f647985a7666f726b5f6964c4100192d2f45b7e7c3a9f1e2b4c6d8e0a1ba672756e5f6964c4100192d2f45b7e7c3a9f1e2b4c6d8e0a1ca373657107a561745f6d73cf0000018bcfe56800a56576656e7482a474797065ab66696c655f6368616e6765a66368616e676583a26f70a57772697465a470617468a97372632f612e747874a5656e74727984a468617368c42098ea6e4f216f2fb4b69fff9b3a44842c38686ca685f3f55dc48c5d3fb1107be4a473697a6503a46d6f6465cd01a4a662696e617279c2";

    #[test]
    fn golden_branch_event_bytes() {
        let bytes = encode(&golden_event()).unwrap();
        assert_eq!(hex::encode(&bytes), GOLDEN_EVENT);
        let back: BranchEvent = decode(&bytes).unwrap();
        assert_eq!(back, golden_event());
    }

    #[test]
    fn an_event_from_before_attempt_still_decodes() {
        let bytes = hex::decode(GOLDEN_EVENT_BEFORE_ATTEMPT).unwrap();
        let back: BranchEvent = decode(&bytes).unwrap();
        assert_eq!(back.attempt, 0);
        assert_eq!(back.event, golden_event().event);
    }

    fn golden_task() -> BranchTask {
        BranchTask {
            tools: Default::default(),
            approval: None,
            fork_id: fork_id(),
            run_id: run_id(),
            label: "a".into(),
            index: 0,
            model: "scripted:demo".into(),
            price: None,
            script: Some(BlobHash::of(b"script")),
            prefix: BlobHash::of(b"prefix"),
            tail: vec![Event::Steer { text: "go".into() }],
            snapshot: BlobHash::of(b"snapshot"),
            first_seq: 3,
            max_turns: 50,
            max_output_tokens: 4096,
            budget_usd: Some(0.5),
            reserve: false,
            on_exhausted: crate::budget::OnExhausted::Stop,
            attempt_base: 0,
            endpoint: None,
            temperature: None,
            replay: None,
            fork_root: None,
            on_truncated: Default::default(),
            event_batches: false,
        }
    }

    const GOLDEN_TASK: &str = "83a17601a46b696e64ab6272616e63685f7461736ba4626f64798ea7666f726b5f6964c4100192d2f45b7e7c3a9f1e2b4c6d8e0a1ba672756e5f6964c4100192d2f45b7e7c3a9f1e2b4c6d8e0a1ca56c6162656ca161a5696e64657800a56d6f64656cad73637269707465643a64656d6fa57072696365c0a6736372697074c42021a0270b7f66a1e4c25933f13a1e5a1bbb4757578072930c8189131f9c6aaae1a6707265666978c420e7a2e8b216e5aec3facf743962d3997f2e7d70088ef257de472d6a258049832ea47461696c9182a474797065a57374656572a474657874a2676fa8736e617073686f74c42016a0eeb0791b6c92451fd284dd9f599e0a7dbe7f6ebea6e2d2d06c7f74aec112a966697273745f73657103a96d61785f7475726e7332b16d61785f6f75747075745f746f6b656e73cd1000aa6275646765745f757364cb3fe0000000000000";

    #[test]
    fn golden_task_bytes() {
        let bytes = encode(&golden_task()).unwrap();
        assert_eq!(hex::encode(&bytes), GOLDEN_TASK);
        assert_eq!(decode::<BranchTask>(&bytes).unwrap(), golden_task());
    }

    #[test]
    fn round_trips_every_event_kind() {
        let events = vec![
            Event::Fork {
                fork_id: fork_id(),
                parent_run: run_id(),
                fork_root: run_id(),
                cutoff_seq: 2,
                label: "a".into(),
                replay_event_count: 0,
                strategy: None,
                workspaces: Vec::new(),
            },
            Event::System { text: "s".into() },
            Event::UserMessage { text: "u".into() },
            Event::ModelResponse {
                model: "scripted:x".into(),
                text: None,
                tool_calls: vec![ToolCall {
                    id: "c1".into(),
                    name: "write_file".into(),
                    args: serde_json::json!({"path": "a", "content": "b"}),
                }],
                request: None,
                finish_reason: None,
                reasoning: None,
            },
            Event::ToolResult {
                call_id: "c1".into(),
                name: "write_file".into(),
                ok: true,
                output: "ok".into(),
                request: None,
            },
            Event::Usage {
                model: "scripted:x".into(),
                usage: Usage {
                    input_tokens: 1,
                    output_tokens: 2,
                    cached_tokens: 0,
                    cache_write_tokens: 0,
                    reasoning_tokens: 0,
                },
                cost_usd: 0.25,
                reservation: Some(crate::ids::ReservationId::new()),
                cached: false,
            },
            Event::Steer { text: "t".into() },
            Event::BranchSummary { text: "b".into() },
            Event::Checkpoint { label: "c".into() },
            Event::Status {
                state: BranchState::AggregateBudgetExhausted,
                error: Some("cap".into()),
            },
        ];
        for (seq, event) in events.into_iter().enumerate() {
            let msg = BranchEvent {
                fork_id: fork_id(),
                run_id: run_id(),
                seq: seq as u64,
                at_ms: 0,
                event,
                attempt: 1,
            };
            let back: BranchEvent = decode(&encode(&msg).unwrap()).unwrap();
            assert_eq!(back, msg);
        }
        let c = Control {
            run_id: run_id(),
            command: ControlCommand::Steer { text: "x".into() },
            attempt: None,
        };
        assert_eq!(decode::<Control>(&encode(&c).unwrap()).unwrap(), c);
    }

    #[test]
    fn rejects_wrong_version_kind_and_garbage() {
        let c = Control {
            run_id: run_id(),
            command: ControlCommand::Terminate { reason: "r".into() },
            attempt: None,
        };
        let bytes = encode(&c).unwrap();
        assert!(matches!(
            decode::<BranchEvent>(&bytes),
            Err(WireError::Kind {
                expected: "branch_event",
                ..
            })
        ));
        let future = rmp_serde::to_vec_named(&EnvelopeOut {
            v: 99,
            kind: Control::KIND,
            body: &c,
        })
        .unwrap();
        let err = decode::<Control>(&future).unwrap_err();
        assert!(matches!(err, WireError::Version { found: 99, .. }), "{err}");
        assert!(err.to_string().contains("version 99"));
        assert!(matches!(
            decode::<Control>(b"\x00garbage"),
            Err(WireError::NotAnEnvelope { .. })
        ));
        let wrong_body = rmp_serde::to_vec_named(&EnvelopeOut {
            v: WIRE_VERSION,
            kind: Control::KIND,
            body: &42u8,
        })
        .unwrap();
        assert!(matches!(
            decode::<Control>(&wrong_body),
            Err(WireError::Body { .. })
        ));
        assert_eq!(peek_kind(&bytes).unwrap(), "control");
    }

    /// A batch of the golden event with one text sent along: the layout a coordinator of
    /// this version reads from workers of this version (ADR 42).
    const GOLDEN_BATCH: &str = "83a17601a46b696e64b26272616e63685f6576656e745f6261746368a4626f647982a66576656e747391c4e883a17601a46b696e64ac6272616e63685f6576656e74a4626f647986a7666f726b5f6964c4100192d2f45b7e7c3a9f1e2b4c6d8e0a1ba672756e5f6964c4100192d2f45b7e7c3a9f1e2b4c6d8e0a1ca373657107a561745f6d73cf0000018bcfe56800a56576656e7482a474797065ab66696c655f6368616e6765a66368616e676583a26f70a57772697465a470617468a97372632f612e747874a5656e74727984a468617368c42098ea6e4f216f2fb4b69fff9b3a44842c38686ca685f3f55dc48c5d3fb1107be4a473697a6503a46d6f6465cd01a4a662696e617279c2a7617474656d707402a5626c6f62739182a468617368c42098ea6e4f216f2fb4b69fff9b3a44842c38686ca685f3f55dc48c5d3fb1107be4a56279746573c40368690a";

    #[test]
    fn golden_branch_event_batch_bytes() {
        // Packed as a worker packs a flush.
        let bytes = crate::protocol::pack_events_with(
            &[encode(&golden_event()).unwrap()],
            &[(BlobHash::of(b"hi\n"), Bytes::from_static(b"hi\n"))],
            None,
        )
        .unwrap()
        .remove(0);
        assert_eq!(hex::encode(&bytes), GOLDEN_BATCH);
        let read = crate::protocol::read_message(&bytes).unwrap();
        assert_eq!(read.events, vec![golden_event()]);
        assert_eq!(
            read.blobs,
            vec![(BlobHash::of(b"hi\n"), Bytes::from_static(b"hi\n"))]
        );
    }

    #[test]
    fn kind_of_reads_the_kind_from_the_first_bytes_and_falls_back_to_a_decode() {
        let event = encode(&golden_event()).unwrap();
        let batch = crate::protocol::pack_events(&[event.clone(), event.clone()], None)
            .unwrap()
            .remove(0);
        for bytes in [&event, &batch] {
            let fast = kind_of(bytes).unwrap();
            assert!(matches!(fast, std::borrow::Cow::Borrowed(_)));
            assert_eq!(fast, peek_kind(bytes).unwrap());
        }
        assert_eq!(kind_of(&batch).unwrap(), "branch_event_batch");
        // Another writer's key order: read by decoding the header.
        #[derive(Serialize)]
        struct KindFirst<'a> {
            kind: &'a str,
            v: u16,
            body: u8,
        }
        let other = rmp_serde::to_vec_named(&KindFirst {
            kind: "branch_event",
            v: WIRE_VERSION,
            body: 0,
        })
        .unwrap();
        assert!(
            matches!(kind_of(&other).unwrap(), std::borrow::Cow::Owned(k) if k == "branch_event")
        );
        // Cut short within the kind, or not an envelope at all: errors, never a kind.
        assert!(kind_of(&event[..12]).is_err());
        assert!(kind_of(b"\x00garbage").is_err());
        assert!(kind_of(&[]).is_err());
        let wrong_version = rmp_serde::to_vec_named(&EnvelopeOut {
            v: 2,
            kind: "branch_event",
            body: &0u8,
        })
        .unwrap();
        assert!(matches!(
            kind_of(&wrong_version),
            Err(WireError::Version { found: 2, .. })
        ));
    }
}
