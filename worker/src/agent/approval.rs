//! Tool calls that wait for a person's consent (docs/APPROVALS.md), as the agent sees
//! them: what the branch's log says of its last response's gated calls ([`Answers`],
//! [`Parked`]), and what to do with one call ([`Gated`]).
//!
//! A call the task's rules gate is run only once the log holds an `approval_decided`
//! approving it. Without one the agent publishes `approval_requested` and stops
//! `awaiting_approval` (its task is acked: no slot, no reservation held). The coordinator
//! appends the answer and enqueues the branch again; the worker that takes it over finds
//! the response's remaining calls here ([`Parked`]) and runs them before its next model
//! call, the answered one first: approved, it runs; denied, its result is a failed one
//! the model reads.

use forkfleet_shared::approval::{denied_output, Gate};
use forkfleet_shared::event::{Event, ToolCall};
use forkfleet_shared::state::BranchState;
use std::collections::HashMap;

/// One answer from the log.
#[derive(Debug, Clone)]
pub(super) struct Answer {
    pub approved: bool,
    pub by: String,
    pub reason: Option<String>,
}

/// The requests and answers about the last response's calls.
#[derive(Debug, Clone, Default)]
pub(super) struct Answers {
    /// The rule each requested call matched, by call id.
    rules: HashMap<String, String>,
    answers: HashMap<String, Answer>,
}

/// The calls of a branch's last response still to run after an answer.
#[derive(Debug, Clone)]
pub(super) struct Parked {
    pub calls: Vec<ToolCall>,
    /// The last event of the history before that response (what a fork tool's fork
    /// copies).
    pub cutoff_seq: u64,
}

/// What to do with one call.
pub(super) enum Gated {
    /// Run it: no rule gates it, or it was approved.
    Run,
    /// It was denied: this is the failed result the model reads.
    Denied(String),
    /// Ask: no answer yet, under this rule.
    Ask(String),
}

impl Answers {
    /// What to do with `call` under `gate`.
    pub fn gated(&self, gate: Option<&Gate>, call: &ToolCall) -> Gated {
        let Some(rule) = gate.and_then(|g| g.needs(&call.name, &call.args)) else {
            return Gated::Run;
        };
        match self.answers.get(&call.id) {
            Some(a) if a.approved => Gated::Run,
            Some(a) => {
                let rule = self.rules.get(&call.id).unwrap_or(&rule);
                Gated::Denied(denied_output(&a.by, a.reason.as_deref(), rule))
            }
            None => Gated::Ask(rule),
        }
    }

    /// A new model response: earlier answers are about earlier calls.
    pub fn clear(&mut self) {
        self.rules.clear();
        self.answers.clear();
    }
}

/// Read a branch's history (seq, event; its own events after a takeover) for the last
/// response's approvals, and the calls left to run when the branch stopped to ask (and
/// no worker has started on them since: a worker lost after it resumed them leaves them
/// interrupted, like any call in flight).
pub(super) fn read(history: &[(u64, &Event)]) -> (Answers, Option<Parked>) {
    let mut answers = Answers::default();
    let Some(r) = history
        .iter()
        .rposition(|(_, e)| matches!(e, Event::ModelResponse { .. }))
    else {
        return (answers, None);
    };
    let (seq, Event::ModelResponse { tool_calls, .. }) = history[r] else {
        return (answers, None);
    };
    let mut waiting = false;
    let mut answered: Vec<&str> = Vec::new();
    for (_, e) in &history[r + 1..] {
        match e {
            Event::ApprovalRequested { call_id, rule, .. } => {
                answers.rules.insert(call_id.clone(), rule.clone());
                waiting = true;
            }
            Event::ApprovalDecided {
                call_id,
                approved,
                by,
                reason,
                ..
            } => {
                answers.answers.insert(
                    call_id.clone(),
                    Answer {
                        approved: *approved,
                        by: by.clone(),
                        reason: reason.clone(),
                    },
                );
            }
            Event::Status {
                state: BranchState::Running,
                ..
            } => waiting = false,
            Event::ToolResult { call_id, .. } => answered.push(call_id),
            _ => {}
        }
    }
    let calls: Vec<ToolCall> = tool_calls
        .iter()
        .filter(|c| !answered.contains(&c.id.as_str()))
        .cloned()
        .collect();
    let parked = (waiting && !calls.is_empty()).then(|| Parked {
        calls,
        cutoff_seq: seq.saturating_sub(1),
    });
    (answers, parked)
}

#[cfg(test)]
mod tests {
    use super::*;
    use forkfleet_shared::approval::{ApprovalSection, OnTimeout};
    use serde_json::json;

    fn call(id: &str, name: &str) -> ToolCall {
        ToolCall {
            id: id.into(),
            name: name.into(),
            args: json!({"path": "x"}),
        }
    }

    fn response(calls: Vec<ToolCall>) -> Event {
        Event::ModelResponse {
            model: "m".into(),
            text: None,
            tool_calls: calls,
            finish_reason: None,
            reasoning: None,
            request: None,
        }
    }

    fn requested(id: &str) -> Event {
        Event::ApprovalRequested {
            call_id: id.into(),
            tool: "delete_file".into(),
            args: json!({"path": "x"}),
            rule: "tools: delete_file".into(),
            requested_at_ms: 1,
            timeout_s: 60,
            on_timeout: OnTimeout::Deny,
        }
    }

    fn decided(id: &str, approved: bool) -> Event {
        Event::ApprovalDecided {
            call_id: id.into(),
            approved,
            by: "admin".into(),
            reason: Some("no".into()),
            decided_at_ms: 2,
        }
    }

    fn result(id: &str) -> Event {
        Event::ToolResult {
            call_id: id.into(),
            name: "read_file".into(),
            ok: true,
            output: String::new(),
            request: None,
        }
    }

    fn running() -> Event {
        Event::Status {
            state: BranchState::Running,
            error: None,
        }
    }

    #[test]
    fn a_branch_that_asked_resumes_with_the_calls_left() {
        let log = [
            response(vec![
                call("a", "read_file"),
                call("b", "delete_file"),
                call("c", "read_file"),
            ]),
            result("a"),
            requested("b"),
            decided("b", false),
        ];
        let history: Vec<(u64, &Event)> = (10..).zip(log.iter()).collect();
        let (answers, parked) = read(&history);
        let parked = parked.unwrap();
        assert_eq!(parked.cutoff_seq, 9);
        let ids: Vec<&str> = parked.calls.iter().map(|c| c.id.as_str()).collect();
        assert_eq!(ids, ["b", "c"]);
        let gate = ApprovalSection {
            tools: vec!["delete_file".into()],
            ..Default::default()
        }
        .build("approval")
        .unwrap()
        .gate()
        .unwrap();
        match answers.gated(Some(&gate), &parked.calls[0]) {
            Gated::Denied(text) => assert!(text.contains("denied by admin") && text.contains("no")),
            _ => panic!("b was denied"),
        }
        assert!(matches!(
            answers.gated(Some(&gate), &parked.calls[1]),
            Gated::Run
        ));
        assert!(matches!(
            Answers::default().gated(Some(&gate), &parked.calls[0]),
            Gated::Ask(rule) if rule == "tools: delete_file"
        ));

        // A worker that took the branch over after the answer and was lost: its calls are
        // interrupted like any other, not run again.
        let lost = [
            response(vec![call("b", "delete_file")]),
            requested("b"),
            decided("b", true),
            running(),
        ];
        let history: Vec<(u64, &Event)> = (0..).zip(lost.iter()).collect();
        assert!(read(&history).1.is_none());
        // A response with no request after it parks nothing.
        let plain = [response(vec![call("a", "read_file")])];
        let history: Vec<(u64, &Event)> = (0..).zip(plain.iter()).collect();
        assert!(read(&history).1.is_none());
    }
}
