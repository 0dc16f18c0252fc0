//! Run events: the append-only log of one run, numbered from 0.
//!
//! A branch run's log starts with a `fork` lineage event at seq 0, then the copied
//! conversational prefix of its parent, then its steer. Usage events are never copied into a
//! child. The model's view of a run ([`Message`]s) is derived from its events. A finished
//! branch continued with `fork continue` gets a `follow_up` event and runs another turn
//! (ADR 13).

use crate::ids::{CheckpointId, ForkId, RunId};
use crate::lineage::RequestHash;
use crate::overlay::ChangeOp;
use crate::state::BranchState;
use serde::{Deserialize, Serialize};

fn is_zero(n: &u64) -> bool {
    *n == 0
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// A tool call requested by the model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    /// The arguments as a JSON object.
    pub args: serde_json::Value,
}

/// Tokens of one model call (or a sum of calls).
///
/// `input_tokens` counts every input token, those read from and written to the provider's
/// prompt cache included: `cached_tokens` of them were read from the cache (priced at the
/// cached rate) and `cache_write_tokens` written to it (priced at the cache-write rate,
/// Anthropic's 1.25x). `output_tokens` counts every output token, the model's reasoning
/// (`reasoning_tokens` of them) included.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct Usage {
    pub input_tokens: u64,
    pub output_tokens: u64,
    #[serde(default)]
    pub cached_tokens: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub cache_write_tokens: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub reasoning_tokens: u64,
}

impl Usage {
    /// Input and output tokens, nothing cached or reasoned.
    pub const fn tokens(input_tokens: u64, output_tokens: u64) -> Self {
        Self {
            input_tokens,
            output_tokens,
            cached_tokens: 0,
            cache_write_tokens: 0,
            reasoning_tokens: 0,
        }
    }

    pub fn add(&mut self, other: &Usage) {
        self.input_tokens += other.input_tokens;
        self.output_tokens += other.output_tokens;
        self.cached_tokens += other.cached_tokens;
        self.cache_write_tokens += other.cache_write_tokens;
        self.reasoning_tokens += other.reasoning_tokens;
    }
}

/// One record in a run's log.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Event {
    /// Lineage: always seq 0 of a branch run.
    Fork {
        fork_id: ForkId,
        parent_run: RunId,
        fork_root: RunId,
        /// The last parent event the branch's history includes.
        cutoff_seq: u64,
        label: String,
        /// A child of `runs fork` (docs/LINEAGE.md): the parent's events it copied or
        /// re-executes, from seq 1 on (0 for a fork's branch, whose copied prefix is its
        /// fork's).
        #[serde(default, skip_serializing_if = "is_zero")]
        replay_event_count: u64,
        /// A child of `runs fork`: how its prefix was made ([`crate::lineage::STRATEGY`]).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        strategy: Option<String>,
        /// The workspaces the run starts from, as Pixir's lineage names them: its fork's
        /// snapshot (a workspace version, a `Manifest` blob). Empty in logs written
        /// before this field.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        workspaces: Vec<crate::blob::BlobHash>,
    },
    System {
        text: String,
    },
    UserMessage {
        text: String,
    },
    ModelResponse {
        model: String,
        text: Option<String>,
        tool_calls: Vec<ToolCall>,
        /// Why the model stopped, as its API said (`stop`, `tool_calls`, `end_turn`,
        /// `length`, `max_tokens`, ...), or `budget_cut` for an answer the worker cut
        /// mid-stream when the branch's spend crossed its cap (the partial answer is kept).
        /// `None`: not a live model call (a spec's history, a log of an older version).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        finish_reason: Option<String>,
        /// The model's reasoning items as its API wants them back (Anthropic thinking
        /// blocks with their signatures, Responses API reasoning items), a JSON array the
        /// provider that made it reads; never shown to other providers.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        reasoning: Option<String>,
        /// The content hash of the request this answers (a replay serves the response
        /// from the record while its request hashes the same). `None`: not made by a
        /// recorded model call (a spec's history, a log of an older version).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        request: Option<RequestHash>,
    },
    ToolResult {
        call_id: String,
        name: String,
        ok: bool,
        output: String,
        /// The hash of the call's tool name and arguments ([`crate::lineage::tool_call_hash`]);
        /// `None` for a result no tool made (an interrupted call, an older log).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        request: Option<String>,
    },
    FileChange {
        change: ChangeOp,
    },
    Usage {
        model: String,
        usage: Usage,
        cost_usd: f64,
        /// The budget reservation this call was made under (strict mode): applying the
        /// event settles it with the actual cost.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        reservation: Option<crate::ids::ReservationId>,
        /// Served from the record by a replay (docs/LINEAGE.md): no provider was called and
        /// nothing was spent (`cost_usd` is 0); `fork cost` counts it as cached.
        #[serde(default, skip_serializing_if = "is_false")]
        cached: bool,
    },
    /// The steer that starts a branch, or a steering message sent to a running one.
    Steer {
        text: String,
    },
    /// A follow-up turn: a user message the coordinator appends to a finished branch
    /// (`fork continue`), which re-opens it. The branch runs again from its whole history,
    /// this message last; in the model's view it is a user message (ADR 13).
    FollowUp {
        text: String,
    },
    BranchSummary {
        text: String,
    },
    Checkpoint {
        label: String,
    },
    Status {
        state: BranchState,
        error: Option<String>,
    },
    /// A tool call of the last `model_response` needs a person's consent (the branch's
    /// approval rules, docs/APPROVALS.md): it was not run, and the branch stops
    /// `awaiting_approval` after this event until an `approval_decided` answers it.
    ApprovalRequested {
        call_id: String,
        tool: String,
        args: serde_json::Value,
        /// The rule that matched (`tools: delete_file`, `run_command: git push*`, ...).
        rule: String,
        requested_at_ms: u64,
        timeout_s: u64,
        on_timeout: crate::approval::OnTimeout,
    },
    /// The answer to the branch's pending `approval_requested` (the coordinator's own
    /// event): the call runs when approved; denied, the model reads a failed tool result
    /// saying so. `by` is who decided: a person's identity, `timeout` or `policy`.
    ApprovalDecided {
        call_id: String,
        approved: bool,
        by: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        reason: Option<String>,
        decided_at_ms: u64,
    },
    /// The run went back to checkpoint `label`: from here on its history is what it was at
    /// `to_seq` (the events between `to_seq` and this one are left out of it, see
    /// [`history_at`]) and its workspace is the checkpoint's version. The log itself stays
    /// append-only.
    Rewind {
        to_seq: u64,
        checkpoint: CheckpointId,
        label: String,
    },
}

impl Event {
    pub fn kind(&self) -> &'static str {
        match self {
            Event::Fork { .. } => "fork",
            Event::System { .. } => "system",
            Event::UserMessage { .. } => "user_message",
            Event::ModelResponse { .. } => "model_response",
            Event::ToolResult { .. } => "tool_result",
            Event::FileChange { .. } => "file_change",
            Event::Usage { .. } => "usage",
            Event::Steer { .. } => "steer",
            Event::FollowUp { .. } => "follow_up",
            Event::BranchSummary { .. } => "branch_summary",
            Event::Checkpoint { .. } => "checkpoint",
            Event::Status { .. } => "status",
            Event::Rewind { .. } => "rewind",
            Event::ApprovalRequested { .. } => "approval_requested",
            Event::ApprovalDecided { .. } => "approval_decided",
        }
    }

    /// True for the events a child inherits when it forks from this run: the conversation,
    /// not the accounting (usage), the workspace (file changes) or the bookkeeping.
    pub fn is_conversational(&self) -> bool {
        matches!(
            self,
            Event::System { .. }
                | Event::UserMessage { .. }
                | Event::ModelResponse { .. }
                | Event::ToolResult { .. }
                | Event::Steer { .. }
                | Event::FollowUp { .. }
                | Event::BranchSummary { .. }
        )
    }
}

/// The history of a run at position `at` (the last seq it includes; `None`: the end of the
/// log), as indices into `log`, oldest first.
///
/// Without rewinds that is every event up to `at`. A `Rewind { to_seq }` event makes the
/// history go on from what it was at `to_seq`: the events between are left out, and so
/// is the marker itself. Rewinds nest (a rewind to a seq inside a part an earlier rewind
/// left out brings that part back). `log` is a run's log in seq order, as
/// `RunStore::run_log` returns it; a rewind to a seq it does not hold before the marker is
/// ignored. O(len) time and memory.
pub fn history_at(log: &[(u64, Event)], at: Option<u64>) -> Vec<usize> {
    // prev[i]: the event before log[i] on its history; tip[i]: the last event of the
    // history once log[i] is read (the marker's target for a rewind).
    let mut prev: Vec<Option<usize>> = Vec::with_capacity(log.len());
    let mut tip: Vec<Option<usize>> = Vec::with_capacity(log.len());
    let index_of = |seq: u64, before: usize| -> Option<usize> {
        log[..before].binary_search_by_key(&seq, |(s, _)| *s).ok()
    };
    let mut end = log.len();
    for (i, (seq, event)) in log.iter().enumerate() {
        if at.is_some_and(|a| *seq > a) {
            end = i;
            break;
        }
        let last = i.checked_sub(1).and_then(|j| tip[j]);
        match event {
            Event::Rewind { to_seq, .. } => {
                prev.push(None);
                tip.push(match index_of(*to_seq, i) {
                    Some(j) => tip[j],
                    None => last,
                });
            }
            _ => {
                prev.push(last);
                tip.push(Some(i));
            }
        }
    }
    let mut out = Vec::new();
    let mut cur = end.checked_sub(1).and_then(|j| tip[j]);
    while let Some(i) = cur {
        out.push(i);
        cur = prev[i];
    }
    out.reverse();
    out
}

/// The events of [`history_at`], with their seqs.
pub fn history_events(log: &[(u64, Event)], at: Option<u64>) -> Vec<&(u64, Event)> {
    history_at(log, at).into_iter().map(|i| &log[i]).collect()
}

/// The last text a run's own model answered on its history: from `first_seq` on (a
/// branch's first event of its own; its copied prefix holds its parent's answers, which are
/// not its own), rewinds honoured. `None` when it has not answered with text.
pub fn own_answer(log: &[(u64, Event)], first_seq: u64) -> Option<String> {
    history_events(log, None)
        .into_iter()
        .rev()
        .take_while(|(seq, _)| *seq >= first_seq)
        .find_map(|(_, e)| match e {
            Event::ModelResponse {
                text: Some(text), ..
            } if !text.trim().is_empty() => Some(text.clone()),
            _ => None,
        })
}

/// A message as a model sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "role", rename_all = "snake_case")]
pub enum Message {
    System {
        text: String,
    },
    User {
        text: String,
    },
    Assistant {
        text: Option<String>,
        tool_calls: Vec<ToolCall>,
        /// The reasoning items the provider wants back with this turn
        /// ([`Event::ModelResponse`]'s `reasoning`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        reasoning: Option<String>,
    },
    Tool {
        call_id: String,
        name: String,
        output: String,
    },
}

/// The model's view of a sequence of events.
pub fn messages_from_events<'a>(events: impl IntoIterator<Item = &'a Event>) -> Vec<Message> {
    let mut out = Vec::new();
    for e in events {
        match e {
            Event::System { text } => out.push(Message::System { text: text.clone() }),
            Event::UserMessage { text } | Event::Steer { text } | Event::FollowUp { text } => {
                out.push(Message::User { text: text.clone() })
            }
            Event::BranchSummary { text } => out.push(Message::User {
                text: format!("[branch summary] {text}"),
            }),
            Event::ModelResponse {
                text,
                tool_calls,
                reasoning,
                ..
            } => out.push(Message::Assistant {
                text: text.clone(),
                tool_calls: tool_calls.clone(),
                reasoning: reasoning.clone(),
            }),
            Event::ToolResult {
                call_id,
                name,
                output,
                ..
            } => out.push(Message::Tool {
                call_id: call_id.clone(),
                name: name.clone(),
                output: output.clone(),
            }),
            _ => {}
        }
    }
    out
}

/// A run's history as stored in a history file (`history = "..."` in a spec): a JSON array
/// of messages, e.g. `[{"role": "user", "text": "hi"}, {"role": "assistant", "text": "hello",
/// "tool_calls": []}]`.
pub fn events_from_messages(messages: &[Message], model: &str) -> Vec<Event> {
    messages
        .iter()
        .map(|m| match m {
            Message::System { text } => Event::System { text: text.clone() },
            Message::User { text } => Event::UserMessage { text: text.clone() },
            Message::Assistant {
                text,
                tool_calls,
                reasoning,
            } => Event::ModelResponse {
                model: model.to_string(),
                text: text.clone(),
                tool_calls: tool_calls.clone(),
                finish_reason: None,
                reasoning: reasoning.clone(),
                request: None,
            },
            Message::Tool {
                call_id,
                name,
                output,
            } => Event::ToolResult {
                call_id: call_id.clone(),
                name: name.clone(),
                ok: true,
                output: output.clone(),
                request: None,
            },
        })
        .collect()
}

/// The output a model sees for a tool call that never returned a result (its worker was
/// lost during it, or the branch stopped there and was continued).
pub const INTERRUPTED: &str = "interrupted: this call returned no result (its worker was lost, or the branch stopped during it); its effect on the workspace is whatever the file changes before this result show. Check before relying on it.";

/// `tool_result` events answering, as [`INTERRUPTED`], the tool calls of the last assistant
/// message of `history` that have no result: a model API rejects a call without one.
pub fn interrupted_results(history: &[Message]) -> Vec<Event> {
    let Some(pos) = history
        .iter()
        .rposition(|m| matches!(m, Message::Assistant { .. }))
    else {
        return Vec::new();
    };
    let Message::Assistant { tool_calls, .. } = &history[pos] else {
        return Vec::new();
    };
    let answered: Vec<&str> = history[pos + 1..]
        .iter()
        .filter_map(|m| match m {
            Message::Tool { call_id, .. } => Some(call_id.as_str()),
            _ => None,
        })
        .collect();
    tool_calls
        .iter()
        .filter(|c| !answered.contains(&c.id.as_str()))
        .map(|c| Event::ToolResult {
            call_id: c.id.clone(),
            name: c.name.clone(),
            ok: false,
            output: INTERRUPTED.to_string(),
            request: None,
        })
        .collect()
}

/// Where `history` breaks the order every model API enforces: a message after an
/// assistant's tool calls before each has its result (OpenAI answers such a history with
/// 400). Calls still unanswered at the very end are not a break: the worker answers them
/// (runs them, or answers them as interrupted) before the next model call. `None` when
/// the order holds; else the position of the offending message and the calls it cuts off.
pub fn ordering_break(history: &[Message]) -> Option<(usize, Vec<String>)> {
    let mut pending: Vec<&str> = Vec::new();
    for (i, m) in history.iter().enumerate() {
        match m {
            Message::Tool { call_id, .. } => pending.retain(|c| *c != call_id.as_str()),
            _ if !pending.is_empty() => {
                return Some((i, pending.iter().map(|c| c.to_string()).collect()));
            }
            Message::Assistant { tool_calls, .. } => {
                pending = tool_calls.iter().map(|c| c.id.as_str()).collect();
            }
            _ => {}
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_message_between_a_call_and_its_result_breaks_the_order() {
        let call = |id: &str| ToolCall {
            id: id.into(),
            name: "read_file".into(),
            args: serde_json::json!({}),
        };
        let assistant = Message::Assistant {
            text: None,
            tool_calls: vec![call("a"), call("b")],
            reasoning: None,
        };
        let tool = |id: &str| Message::Tool {
            call_id: id.into(),
            name: "read_file".into(),
            output: "x".into(),
        };
        let user = Message::User { text: "u".into() };
        assert_eq!(
            ordering_break(&[assistant.clone(), tool("a"), tool("b"), user.clone()]),
            None
        );
        // Unanswered at the end: the worker answers them.
        assert_eq!(ordering_break(&[assistant.clone(), tool("a")]), None);
        assert_eq!(
            ordering_break(&[assistant.clone(), user.clone(), tool("a"), tool("b")]),
            Some((1, vec!["a".to_string(), "b".to_string()]))
        );
        assert_eq!(
            ordering_break(&[assistant.clone(), tool("b"), user]),
            Some((2, vec!["a".to_string()]))
        );
    }

    #[test]
    fn only_the_last_responses_unanswered_calls_are_interrupted() {
        let call = |id: &str| ToolCall {
            id: id.into(),
            name: "read_file".into(),
            args: serde_json::json!({}),
        };
        let tool = |id: &str| Message::Tool {
            call_id: id.into(),
            name: "read_file".into(),
            output: "x".into(),
        };
        let history = vec![
            Message::Assistant {
                text: None,
                tool_calls: vec![call("old")],
                reasoning: None,
            },
            Message::Assistant {
                text: None,
                tool_calls: vec![call("a"), call("b")],
                reasoning: None,
            },
            tool("a"),
        ];
        let results = interrupted_results(&history);
        assert_eq!(results.len(), 1);
        assert!(matches!(
            &results[0],
            Event::ToolResult { call_id, ok: false, output, .. } if call_id == "b" && output == INTERRUPTED
        ));
        assert!(interrupted_results(
            &history[..1]
                .iter()
                .cloned()
                .chain([tool("old")])
                .collect::<Vec<_>>()
        )
        .is_empty());
        assert!(interrupted_results(&[]).is_empty());
    }

    fn steer(t: &str) -> Event {
        Event::Steer { text: t.into() }
    }

    fn rewind(to_seq: u64) -> Event {
        Event::Rewind {
            to_seq,
            checkpoint: CheckpointId::new(),
            label: "x".into(),
        }
    }

    fn seqs(log: &[(u64, Event)], at: Option<u64>) -> Vec<u64> {
        history_at(log, at).into_iter().map(|i| log[i].0).collect()
    }

    #[test]
    fn history_follows_rewinds_and_nests() {
        // 0 1 2 3 | R(1)@4 | 5 6 | R(5)@7 | 8 | R(2)@9 | 10
        let mut log: Vec<(u64, Event)> = (0..4).map(|s| (s, steer("a"))).collect();
        log.push((4, rewind(1)));
        log.push((5, steer("b")));
        log.push((6, steer("c")));
        log.push((7, rewind(5)));
        log.push((8, steer("d")));
        log.push((9, rewind(2)));
        log.push((10, steer("e")));
        assert_eq!(seqs(&log, Some(3)), [0, 1, 2, 3]);
        assert_eq!(seqs(&log, Some(4)), [0, 1]);
        assert_eq!(seqs(&log, Some(6)), [0, 1, 5, 6]);
        assert_eq!(seqs(&log, Some(8)), [0, 1, 5, 8]);
        // Back to seq 2, which the first rewind had left out: it is history again.
        assert_eq!(seqs(&log, Some(9)), [0, 1, 2]);
        assert_eq!(seqs(&log, None), [0, 1, 2, 10]);
        assert_eq!(seqs(&log[..0], None), Vec::<u64>::new());
        // A rewind to a seq the log does not hold before it changes nothing.
        let odd = vec![(0, steer("a")), (1, rewind(7)), (2, steer("b"))];
        assert_eq!(seqs(&odd, None), [0, 2]);
        assert_eq!(history_events(&log, Some(4)).len(), 2);
    }

    #[test]
    fn history_view_skips_accounting() {
        let events = vec![
            Event::System { text: "sys".into() },
            Event::UserMessage {
                text: "goal".into(),
            },
            Event::Usage {
                model: "m".into(),
                usage: Usage::default(),
                cost_usd: 0.0,
                reservation: None,
                cached: false,
            },
            Event::Steer {
                text: "go left".into(),
            },
        ];
        let msgs = messages_from_events(&events);
        assert_eq!(msgs.len(), 3);
        assert_eq!(
            msgs[2],
            Message::User {
                text: "go left".into()
            }
        );
        assert!(!events[2].is_conversational());
    }

    #[test]
    fn a_follow_up_is_a_user_message_of_the_conversation() {
        let follow_up = Event::FollowUp {
            text: "now add tests".into(),
        };
        assert_eq!(follow_up.kind(), "follow_up");
        assert!(follow_up.is_conversational());
        let events = vec![
            Event::ModelResponse {
                model: "m".into(),
                text: Some("done".into()),
                tool_calls: vec![],
                request: None,
                finish_reason: None,
                reasoning: None,
            },
            Event::Status {
                state: BranchState::Done,
                error: None,
            },
            follow_up,
        ];
        let msgs = messages_from_events(&events);
        assert_eq!(
            msgs.last(),
            Some(&Message::User {
                text: "now add tests".into()
            })
        );
        assert_eq!(msgs.len(), 2);
    }
}
