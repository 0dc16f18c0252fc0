//! Re-executing a parent's recorded prefix (`runs fork --replay`, docs/LINEAGE.md).
//!
//! The task names the parent's record ([`ReplayTask`]): its conversation through the
//! cutoff, with the file changes its recorded tool calls made. The agent walks it turn by
//! turn:
//!
//! - events no recorded call made (the system prompt, user messages, steers, follow-ups, a
//!   spec's history, a summary) are published as they are, before the next call;
//! - a model call whose request hashes the same as the recorded response's
//!   ([`forkfleet_shared::lineage::RequestHash`]) is served from the record: no provider
//!   call, a `usage` event marked `cached` with no cost;
//! - each tool call of a served response is served too (no side effect): its recorded file
//!   changes are applied to the overlay and published, then its result;
//! - the first request that differs fails the child with a `replay_divergence` error
//!   naming the seq, both hashes and the first differing part, unless `record_live`
//!   (`--record`): then the agent goes on live from there, and records what it does.
//!
//! Once the record is used up the agent goes on live, like any branch.

use crate::error::WorkerError;
use forkfleet_shared::event::{Event, ToolCall};
use forkfleet_shared::ids::RunId;
use forkfleet_shared::lineage::{self, RequestHash};
use forkfleet_shared::overlay::ChangeOp;
use forkfleet_shared::protocol::ReplayTask;

/// The parent's record, and how far the child got through it.
pub(crate) struct Replay {
    items: Vec<(u64, Event)>,
    pos: usize,
    parent_run: RunId,
    record_live: bool,
}

/// A model's answer: a live call's, or one served from the record (what the recorded call
/// answered, and why it stopped, so the replayed log is the parent's, event for event).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Answer {
    pub(crate) text: Option<String>,
    pub(crate) tool_calls: Vec<ToolCall>,
    pub(crate) finish_reason: Option<String>,
    pub(crate) reasoning: Option<String>,
}

/// What the next recorded model call is.
pub(crate) enum Next<'a> {
    /// A recorded call to serve or diverge from: its seq in the parent and its request.
    Call { seq: u64, request: &'a RequestHash },
    /// The record is used up: the agent goes on live.
    Done,
}

impl Replay {
    /// The record of `task` (its bytes, read from the bus's blob store by the caller), the
    /// position after what the child's log already holds (`own`: its events from its first
    /// seq on, on a takeover). `None` when the child already went on live.
    pub(crate) fn new(
        task: &ReplayTask,
        bytes: &[u8],
        own: &[&Event],
    ) -> Result<Option<Replay>, WorkerError> {
        let items: Vec<(u64, Event)> =
            rmp_serde::from_slice(bytes).map_err(|e| WorkerError::BadPrefix {
                hash: task.record,
                message: format!("replay record: {e}"),
            })?;
        let mut replay = Replay {
            items,
            pos: 0,
            parent_run: task.parent_run,
            record_live: task.record_live,
        };
        // A takeover: the child's events so far are the record's, in order, until it went
        // live (then nothing is served any more).
        for e in own.iter().filter(|e| recorded_kind(e)) {
            match replay.items.get(replay.pos) {
                Some((_, r)) if same(r, e) => replay.pos += 1,
                _ => return Ok(None),
            }
        }
        Ok(Some(replay))
    }

    /// The events to publish before the next model call: up to the next recorded call
    /// (whose response carries its request's hash).
    pub(crate) fn inputs(&mut self) -> Vec<Event> {
        let mut out = Vec::new();
        while let Some((_, e)) = self.items.get(self.pos) {
            if matches!(
                e,
                Event::ModelResponse {
                    request: Some(_),
                    ..
                }
            ) {
                break;
            }
            out.push(e.clone());
            self.pos += 1;
        }
        out
    }

    pub(crate) fn next(&self) -> Next<'_> {
        match self.items.get(self.pos) {
            Some((
                seq,
                Event::ModelResponse {
                    request: Some(request),
                    ..
                },
            )) => Next::Call { seq: *seq, request },
            _ => Next::Done,
        }
    }

    /// The recorded response, served: the record moves past it.
    pub(crate) fn serve_response(&mut self) -> Option<Answer> {
        match self.items.get(self.pos) {
            Some((
                _,
                Event::ModelResponse {
                    text,
                    tool_calls,
                    finish_reason,
                    reasoning,
                    ..
                },
            )) => {
                let out = Answer {
                    text: text.clone(),
                    tool_calls: tool_calls.clone(),
                    finish_reason: finish_reason.clone(),
                    reasoning: reasoning.clone(),
                };
                self.pos += 1;
                Some(out)
            }
            _ => None,
        }
    }

    /// Serve `call` from the record: the file changes its recorded run made and its result
    /// (with the call's hash), when the record's next events are that call's; `None`
    /// leaves the record where it is and the call runs live.
    pub(crate) fn serve_tool(&mut self, call: &ToolCall) -> Option<(Vec<ChangeOp>, Event)> {
        let hash = lineage::tool_call_hash(call);
        let mut at = self.pos;
        let mut changes = Vec::new();
        while let Some((_, Event::FileChange { change })) = self.items.get(at) {
            changes.push(change.clone());
            at += 1;
        }
        match self.items.get(at) {
            Some((
                _,
                result @ Event::ToolResult {
                    call_id, request, ..
                },
            )) if *call_id == call.id && request.as_deref() == Some(hash.as_str()) => {
                let result = result.clone();
                self.pos = at + 1;
                Some((changes, result))
            }
            _ => None,
        }
    }

    /// Every event of the record is published: the agent goes on live.
    pub(crate) fn exhausted(&self) -> bool {
        self.pos >= self.items.len()
    }

    /// `--record`: go on live at the first divergence.
    pub(crate) fn record_live(&self) -> bool {
        self.record_live
    }

    /// The `replay_divergence` error of a request hashed `now` where the record has the
    /// call at parent seq `seq` hashed `recorded`; the child's event would be `child_seq`.
    pub(crate) fn divergence(
        &self,
        child_seq: u64,
        seq: u64,
        recorded: &RequestHash,
        now: &RequestHash,
    ) -> String {
        format!(
            "replay_divergence: the model request at seq {child_seq} differs from run {}'s recorded one at seq {seq}: request hash {} (recorded {}); first differing field: {}. Fork again with --record to go on live from there, or without --set",
            self.parent_run,
            now.hash,
            recorded.hash,
            now.first_difference(recorded).unwrap_or_else(|| "none".to_string())
        )
    }
}

/// The events a replay's record holds (what a child re-executes or replays).
fn recorded_kind(e: &Event) -> bool {
    lineage::is_replayable(e) || matches!(e, Event::FileChange { .. } | Event::BranchSummary { .. })
}

/// The child's event is the record's: the same kind and content (a served response is the
/// record's with the child's own request hash, which equals the recorded one).
fn same(recorded: &Event, own: &Event) -> bool {
    match (recorded, own) {
        (
            Event::ModelResponse {
                text: a,
                tool_calls: ca,
                ..
            },
            Event::ModelResponse {
                text: b,
                tool_calls: cb,
                ..
            },
        ) => a == b && ca == cb,
        (a, b) => a == b,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn response(text: &str, calls: Vec<ToolCall>, request: Option<RequestHash>) -> Event {
        Event::ModelResponse {
            model: "scripted:x".into(),
            text: Some(text.into()),
            tool_calls: calls,
            request,
            finish_reason: None,
            reasoning: None,
        }
    }

    fn hash(n: u32) -> RequestHash {
        let mut m = lineage::MessagesHash::default();
        m.update(&[]);
        RequestHash::of("scripted:x", &m, "no tools", None, n)
    }

    fn call() -> ToolCall {
        ToolCall {
            id: "c1".into(),
            name: "read_file".into(),
            args: serde_json::json!({"path": "a"}),
        }
    }

    fn record() -> Vec<(u64, Event)> {
        let c = call();
        vec![
            (1, Event::System { text: "s".into() }),
            (2, Event::UserMessage { text: "u".into() }),
            (4, response("", vec![c.clone()], Some(hash(1)))),
            (
                5,
                Event::ToolResult {
                    call_id: "c1".into(),
                    name: "read_file".into(),
                    ok: true,
                    output: "x".into(),
                    request: Some(lineage::tool_call_hash(&c)),
                },
            ),
            (7, response("done", vec![], Some(hash(2)))),
        ]
    }

    fn replay(own: &[&Event]) -> Option<Replay> {
        let task = ReplayTask {
            record: forkfleet_shared::blob::BlobHash::of(b"x"),
            parent_run: RunId::new(),
            record_live: false,
        };
        let bytes = rmp_serde::to_vec_named(&record()).unwrap();
        Replay::new(&task, &bytes, own).unwrap()
    }

    #[test]
    fn a_replay_walks_inputs_calls_and_tools_in_order() {
        let mut r = replay(&[]).unwrap();
        assert_eq!(r.inputs().len(), 2);
        assert!(matches!(r.next(), Next::Call { seq: 4, .. }));
        let calls = r.serve_response().unwrap().tool_calls;
        let (changes, result) = r.serve_tool(&calls[0]).unwrap();
        assert!(changes.is_empty());
        assert!(matches!(result, Event::ToolResult { .. }));
        assert!(r.inputs().is_empty());
        assert!(matches!(r.next(), Next::Call { seq: 7, .. }));
        r.serve_response().unwrap();
        assert!(matches!(r.next(), Next::Done));
    }

    #[test]
    fn a_tool_call_that_is_not_the_recorded_one_runs_live() {
        let mut r = replay(&[]).unwrap();
        r.inputs();
        r.serve_response().unwrap();
        let mut other = call();
        other.args = serde_json::json!({"path": "b"});
        assert!(r.serve_tool(&other).is_none());
        assert!(r.serve_tool(&call()).is_some(), "the record stayed put");
    }

    #[test]
    fn a_takeover_resumes_after_what_the_child_already_holds() {
        let rec = record();
        let own: Vec<&Event> = rec[..3].iter().map(|(_, e)| e).collect();
        let r = replay(&own).unwrap();
        assert_eq!(r.pos, 3);
        // A child that went live (its response is not the record's) serves nothing.
        let live = response("other", vec![], Some(hash(9)));
        let own = vec![&rec[0].1, &rec[1].1, &live];
        assert!(replay(&own).is_none());
    }
}
