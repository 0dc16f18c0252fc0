#![allow(clippy::unwrap_used)]

use super::*;
use crate::event::Usage;
use crate::ids::{CheckpointId, ForkId, RunId};
use crate::manifest::FileEntry;
use crate::overlay::ChangeOp;
use crate::path::WsPath;
use crate::state::BranchState;

fn user(t: &str) -> Event {
    Event::UserMessage { text: t.into() }
}

fn response(t: &str) -> Event {
    Event::ModelResponse {
        model: "scripted:x".into(),
        text: Some(t.into()),
        tool_calls: vec![],
        request: None,
        finish_reason: None,
        reasoning: None,
    }
}

fn write(p: &str) -> Event {
    Event::FileChange {
        change: ChangeOp::Write {
            path: WsPath::parse(p).unwrap(),
            entry: FileEntry::for_bytes(p.as_bytes(), 0o644),
        },
    }
}

fn usage() -> Event {
    Event::Usage {
        model: "scripted:x".into(),
        usage: Usage::default(),
        cost_usd: 0.1,
        reservation: None,
        cached: false,
    }
}

/// A branch log: lineage, a copied prefix, then the branch's own work.
fn log() -> Vec<(u64, Event)> {
    let events = vec![
        Event::Fork {
            fork_id: ForkId::new(),
            parent_run: RunId::new(),
            fork_root: RunId::new(),
            cutoff_seq: 1,
            label: "main".into(),
            replay_event_count: 0,
            strategy: None,
            workspaces: Vec::new(),
        },
        Event::System { text: "sys".into() },
        user("goal"),
        usage(),
        Event::ModelResponse {
            model: "scripted:x".into(),
            text: None,
            tool_calls: vec![ToolCall {
                id: "c1".into(),
                name: "write_file".into(),
                args: serde_json::json!({"path": "a.txt", "content": "a"}),
            }],
            request: None,
            finish_reason: None,
            reasoning: None,
        },
        write("a.txt"),
        Event::ToolResult {
            call_id: "c1".into(),
            name: "write_file".into(),
            ok: true,
            output: "ok".into(),
            request: None,
        },
        Event::BranchSummary {
            text: "earlier summary".into(),
        },
        usage(),
        response("done"),
        Event::Status {
            state: BranchState::Done,
            error: None,
        },
    ];
    events
        .into_iter()
        .enumerate()
        .map(|(s, e)| (s as u64, e))
        .collect()
}

#[test]
fn the_copy_rules_keep_the_conversation_and_leave_out_the_rest() {
    let log = log();
    let plan = copy_plan(&log, 9);
    let kinds: Vec<&str> = plan.copied.iter().map(|(_, e)| e.kind()).collect();
    assert_eq!(
        kinds,
        [
            "system",
            "user_message",
            "model_response",
            "tool_result",
            "model_response"
        ]
    );
    let seqs: Vec<u64> = plan.copied.iter().map(|(s, _)| *s).collect();
    assert_eq!(seqs, [1, 2, 4, 6, 9]);
    let skipped: Vec<(&str, u64)> = plan.skipped.iter().map(|(k, n)| (k.as_str(), *n)).collect();
    assert_eq!(
        skipped,
        [
            ("branch_summary", 1),
            ("file_change", 1),
            ("fork", 1),
            ("usage", 2)
        ]
    );
    // Inclusive cutoff: the tool result at 6 is in, what follows is not.
    let plan = copy_plan(&log, 6);
    assert_eq!(plan.copied.last().unwrap().0, 6);
    assert_eq!(plan.copied.len(), 4);
}

#[test]
fn the_copy_follows_rewinds() {
    let mut log = log();
    log.truncate(7);
    log.push((
        7,
        Event::Rewind {
            to_seq: 2,
            checkpoint: CheckpointId::new(),
            label: "turn-1".into(),
        },
    ));
    log.push((8, user("again")));
    let plan = copy_plan(&log, 8);
    let seqs: Vec<u64> = plan.copied.iter().map(|(s, _)| *s).collect();
    assert_eq!(seqs, [1, 2, 8]);
}

#[test]
fn the_cutoff_defaults_to_the_last_replayable_event_and_refuses_others() {
    let log = log();
    assert_eq!(cutoff(&log, None), Ok(9));
    assert_eq!(cutoff(&log, Some(4)), Ok(4));
    let e = cutoff(&log, Some(5)).unwrap_err();
    assert_eq!(e.kind, Some("file_change"));
    assert_eq!(e.range, Some((1, 9)));
    assert_eq!(e.nearest, (Some(4), Some(6)));
    let msg = e.to_string();
    assert!(msg.contains("seq 5 is a `file_change` event"), "{msg}");
    assert!(msg.contains("from 1 to 9"), "{msg}");
    assert!(msg.contains("nearest: 4 or 6"), "{msg}");
    let e = cutoff(&log, Some(11)).unwrap_err();
    assert_eq!(e.kind, None);
    assert!(e.to_string().contains("seq 11 is beyond the log"), "{e}");
    // A branch summary and a status are not replayable either.
    assert_eq!(
        cutoff(&log, Some(7)).unwrap_err().kind,
        Some("branch_summary")
    );
    assert_eq!(cutoff(&log, Some(0)).unwrap_err().kind, Some("fork"));
    assert!(cutoff(&log[..1], None)
        .unwrap_err()
        .to_string()
        .contains("no replayable event"));
}

fn settings() -> RunSettings {
    RunSettings {
        model: "scripted:x".into(),
        temperature: None,
        system_prompt: Some("sys".into()),
        max_turns: 50,
        max_output_tokens: 4096,
        budget_usd: None,
        run_command: false,
        forking: false,
    }
}

#[test]
fn set_type_checks_every_key() {
    let mut s = settings();
    for (k, v) in [
        ("model", "openai:gpt-4o"),
        ("temperature", "0.2"),
        ("system_prompt", "be brief"),
        ("max_turns", "7"),
        ("max_output_tokens", "512"),
        ("budget", "1.5"),
        ("tools.run_command", "true"),
        ("tools.forking", "true"),
    ] {
        apply_set(&mut s, k, v).unwrap();
    }
    assert_eq!(
        s,
        RunSettings {
            model: "openai:gpt-4o".into(),
            temperature: Some(0.2),
            system_prompt: Some("be brief".into()),
            max_turns: 7,
            max_output_tokens: 512,
            budget_usd: Some(1.5),
            run_command: true,
            forking: true,
        }
    );
    apply_set(&mut s, "temperature", "none").unwrap();
    apply_set(&mut s, "budget", "none").unwrap();
    apply_set(&mut s, "system_prompt", "none").unwrap();
    assert_eq!(
        (s.temperature, s.budget_usd, s.system_prompt.clone()),
        (None, None, None)
    );
    for (k, v) in [
        ("temperature", "3"),
        ("temperature", "warm"),
        ("max_turns", "0"),
        ("max_turns", "-1"),
        ("budget", "0"),
        ("budget", "NaN"),
        ("tools.forking", "yes"),
        ("model", "gpt-4o"),
        ("model", "nope:x"),
    ] {
        let e = apply_set(&mut s, k, v).unwrap_err();
        assert!(
            matches!(&e, SetError::BadValue { key, .. } if *key == k),
            "{k}={v}: {e}"
        );
        assert!(
            e.to_string().contains(&format!("--set {k}: `{v}` is not")),
            "{e}"
        );
    }
}

#[test]
fn an_unknown_key_names_the_closest_and_every_valid_one() {
    let mut s = settings();
    let e = apply_set(&mut s, "temprature", "0.5").unwrap_err();
    assert_eq!(
        e,
        SetError::UnknownKey {
            key: "temprature".into(),
            suggestion: Some("temperature")
        }
    );
    let msg = e.to_string();
    assert!(msg.contains("did you mean `temperature`?"), "{msg}");
    for (k, _) in SETTING_KEYS {
        assert!(msg.contains(k), "{msg} lists {k}");
    }
    assert_eq!(
        apply_set(&mut s, "max_turn", "3").unwrap_err(),
        SetError::UnknownKey {
            key: "max_turn".into(),
            suggestion: Some("max_turns")
        }
    );
    assert_eq!(
        apply_set(&mut s, "run_command", "true").unwrap_err(),
        SetError::UnknownKey {
            key: "run_command".into(),
            suggestion: Some("tools.run_command")
        }
    );
    assert_eq!(
        apply_set(&mut s, "colour", "red").unwrap_err(),
        SetError::UnknownKey {
            key: "colour".into(),
            suggestion: None
        }
    );
    assert_eq!(s, settings(), "nothing changed");
    assert!(parse_set("novalue").is_err());
    assert!(parse_set("=x").is_err());
    assert_eq!(parse_set("a=b=c").unwrap(), ("a".into(), "b=c".into()));
}

#[test]
fn request_hashes_name_the_first_differing_part() {
    let messages = vec![
        Message::System { text: "s".into() },
        Message::User { text: "u".into() },
    ];
    let mut h = MessagesHash::default();
    h.update(&messages);
    let tools = RequestHash::tools_hash(&serde_json::json!([{"name": "read_file"}]));
    let a = RequestHash::of("scripted:a", &h, &tools, None, 100);
    assert_eq!(a, RequestHash::of("scripted:a", &h, &tools, None, 100));
    assert_eq!(a.first_difference(&a), None);
    let b = RequestHash::of("scripted:b", &h, &tools, Some(0.5), 100);
    assert_eq!(b.first_difference(&a).as_deref(), Some("model"));
    let t = RequestHash::of("scripted:a", &h, &tools, Some(0.5), 100);
    assert_eq!(t.first_difference(&a).as_deref(), Some("temperature"));
    let o = RequestHash::of("scripted:a", &h, &tools, None, 101);
    assert_eq!(o.first_difference(&a).as_deref(), Some("max_output_tokens"));
    let n = RequestHash::of(
        "scripted:a",
        &h,
        &RequestHash::tools_hash(&serde_json::json!([])),
        None,
        100,
    );
    assert_eq!(n.first_difference(&a).as_deref(), Some("tools"));

    // Extended incrementally or hashed at once: the same hash.
    let mut more = messages.clone();
    more.push(Message::User { text: "v".into() });
    let mut inc = h.clone();
    inc.update(&more);
    let mut fresh = MessagesHash::default();
    fresh.update(&more);
    assert_eq!(inc, fresh);
    let m = RequestHash::of("scripted:a", &inc, &tools, None, 100);
    assert_eq!(
        m.first_difference(&a).as_deref(),
        Some("messages (2 in the recorded request, 3 now)")
    );
    // A shorter history starts over.
    inc.update(&messages);
    assert_eq!(inc, h);
}

#[test]
fn tool_call_hashes_ignore_key_order() {
    let call = |args| ToolCall {
        id: "x".into(),
        name: "write_file".into(),
        args,
    };
    let a = tool_call_hash(&call(serde_json::json!({"path": "a", "content": "b"})));
    let b = tool_call_hash(&call(
        serde_json::from_str(r#"{"content": "b", "path": "a"}"#).unwrap(),
    ));
    assert_eq!(a, b);
    let c = tool_call_hash(&call(serde_json::json!({"path": "a", "content": "c"})));
    assert_ne!(a, c);
    assert_eq!(a.len(), 32);
}

#[test]
fn the_deterministic_summary_counts_turns_tools_and_files() {
    let log = log();
    let history: Vec<&Event> = log.iter().map(|(_, e)| e).collect();
    let s = deterministic_summary("r1", 9, &history);
    assert!(
        s.starts_with("[deterministic_operational_summary_v1; lossy"),
        "{s}"
    );
    assert!(s.contains("Run r1 through seq 9: 2 model turns"), "{s}");
    assert!(s.contains("tool calls: write_file x1"), "{s}");
    assert!(s.contains("files touched: a.txt"), "{s}");
    assert!(s.contains("last answer: \"done\""), "{s}");
    // A cutoff on the response that made the call, before its result: the call counts,
    // and is said to have no result.
    let at_call = history
        .iter()
        .position(
            |e| matches!(e, Event::ModelResponse { tool_calls, .. } if !tool_calls.is_empty()),
        )
        .unwrap();
    let inside = deterministic_summary("r1", 4, &history[..=at_call]);
    assert!(
        inside.contains("tool calls: write_file x1 (1 without a result at the cutoff)"),
        "{inside}"
    );
    let none = deterministic_summary("r1", 2, &history[..3]);
    assert!(
        none.contains("0 model turns; no tool calls; no files touched; no answer yet"),
        "{none}"
    );
}
