//! Run events: the append-only log of one run, numbered from 0.
//!
//! A branch run's log starts with a `fork` lineage event at seq 0, then the copied
//! conversational prefix of its parent, then its steer. Usage events are never copied into a
//! child. The model's view of a run ([`Message`]s) is derived from its events.

use crate::ids::{ForkId, RunId};
use crate::overlay::ChangeOp;
use crate::state::BranchState;
use serde::{Deserialize, Serialize};

/// A tool call requested by the model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    /// The arguments as a JSON object.
    pub args: serde_json::Value,
}

/// Tokens and dollars of one model call.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct Usage {
    pub input_tokens: u64,
    pub output_tokens: u64,
    #[serde(default)]
    pub cached_tokens: u64,
}

impl Usage {
    pub fn add(&mut self, other: &Usage) {
        self.input_tokens += other.input_tokens;
        self.output_tokens += other.output_tokens;
        self.cached_tokens += other.cached_tokens;
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
    },
    ToolResult {
        call_id: String,
        name: String,
        ok: bool,
        output: String,
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
    },
    /// The steer that starts a branch, or a steering message sent to a running one.
    Steer {
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
            Event::BranchSummary { .. } => "branch_summary",
            Event::Checkpoint { .. } => "checkpoint",
            Event::Status { .. } => "status",
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
                | Event::BranchSummary { .. }
        )
    }
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
            Event::UserMessage { text } | Event::Steer { text } => {
                out.push(Message::User { text: text.clone() })
            }
            Event::BranchSummary { text } => out.push(Message::User {
                text: format!("[branch summary] {text}"),
            }),
            Event::ModelResponse {
                text, tool_calls, ..
            } => out.push(Message::Assistant {
                text: text.clone(),
                tool_calls: tool_calls.clone(),
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
            Message::Assistant { text, tool_calls } => Event::ModelResponse {
                model: model.to_string(),
                text: text.clone(),
                tool_calls: tool_calls.clone(),
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
            },
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
