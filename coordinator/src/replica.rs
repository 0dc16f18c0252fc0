//! The coordinator's replica of one branch: its summary (state, turns, usage, cost) and its
//! overlay, built by applying the branch's events in seq order exactly once.
//!
//! Delivery is at least once and may reorder after a redelivery, so every event is placed
//! by its seq against `next_seq`, the seq the replica expects:
//! - `seq < next_seq`, or already held: a duplicate, ignored;
//! - `seq == next_seq`: applied, then every held successor that is now in order;
//! - `seq > next_seq`: held until the gap fills.
//!
//! Held events are written to the store like applied ones (so their delivery can be acked);
//! a replica rebuilt from the store re-holds whatever lies beyond a gap.

use crate::store::BranchRecord;
use forkfleet_shared::approval::{BlockedCall, PendingApproval};
use forkfleet_shared::event::{Event, Usage};
use forkfleet_shared::ids::ReservationId;
use forkfleet_shared::manifest::Manifest;
use forkfleet_shared::overlay::Overlay;
use forkfleet_shared::state::BranchState;
use std::collections::BTreeMap;
use std::sync::Arc;

/// Where an arriving event goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Placement {
    Duplicate,
    Hold,
    Apply,
}

/// What applying events changed, for the caller's bookkeeping.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Effect {
    /// The branch's state changed (its record is rewritten).
    pub state_changed: bool,
    /// The branch reached a terminal state.
    pub became_terminal: bool,
    /// The branch was terminal and a `follow_up` re-opened it (ADR 13): it counts as
    /// unfinished again. Both flags are net over what one arrival applied: a branch
    /// re-opened and finished again within it sets neither.
    pub reopened: bool,
    /// Events applied (held successors included).
    pub applied: usize,
    /// The cost, reservation and model of each `usage` event applied, in order.
    pub usage: Vec<(f64, Option<ReservationId>, String)>,
    /// Calls a replay served from the record (no spend).
    pub cached: u32,
    /// The model responses and tool results applied, in order (automatic checkpoints).
    pub steps: Vec<Step>,
    /// A request for consent was applied: its tool (metrics) and its deadline (the
    /// fork's timer).
    pub approval_requested: Option<(String, u64)>,
    /// An answer was applied: approved, who decided, and how long it waited (ms).
    pub approval_decided: Option<(bool, String, u64)>,
    /// A `rewind` marker was applied (an agent's `rewind_to`): the overlay must be rebuilt
    /// from the rewound history.
    pub rewound: bool,
}

/// A model response or a tool result the replica applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Step {
    /// The response of model call `turn` (from 1), at `seq`.
    Response { seq: u64, turn: u32 },
    /// The result of tool call `call` (from 1) of tool `name`, at `seq`, during model
    /// turn `turn` (responses applied before it).
    Tool {
        seq: u64,
        call: u32,
        name: String,
        turn: u32,
    },
}

pub(crate) struct BranchReplica {
    pub record: BranchRecord,
    pub overlay: Overlay,
    held: BTreeMap<u64, Event>,
    /// Tool results applied (rebuilt with the replica; not stored).
    tool_calls: u32,
}

impl BranchReplica {
    /// A replica of a branch with no worker events yet.
    pub fn new(mut record: BranchRecord, base: Arc<Manifest>) -> Self {
        record.state = BranchState::Pending;
        record.error = None;
        record.turns = 0;
        record.calls = 0;
        record.cached_calls = 0;
        record.usage = Usage::default();
        record.cost_usd = 0.0;
        record.changes = 0;
        record.next_seq = record.first_seq;
        record.approval = None;
        record.blocked = Vec::new();
        record.answer = None;
        Self {
            record,
            overlay: Overlay::new(base),
            held: BTreeMap::new(),
            tool_calls: 0,
        }
    }

    /// Rebuild from the stored log (every stored event, gaps included, in seq order), with
    /// the steps applied on the way.
    pub fn rebuild(
        record: BranchRecord,
        base: Arc<Manifest>,
        stored: Vec<(u64, Event)>,
    ) -> (Self, Vec<Step>) {
        let mut r = Self::new(record, base);
        let mut steps = Vec::new();
        for (seq, event) in stored {
            if seq < r.record.first_seq {
                continue; // lineage, copied prefix and tail: written at creation
            }
            steps.extend(r.arrive(seq, event).steps);
        }
        (r, steps)
    }

    pub fn placement(&self, seq: u64) -> Placement {
        let next = self.record.next_seq;
        if seq < next || self.held.contains_key(&seq) {
            Placement::Duplicate
        } else if seq > next {
            Placement::Hold
        } else {
            Placement::Apply
        }
    }

    /// A later task attempt takes the branch over: events of earlier attempts are dropped
    /// from now on, and so is whatever was held beyond a gap (it can only come from an
    /// earlier attempt). Returns the seqs that were held, so the caller deletes them from
    /// the store; `None` when the attempt is not newer than the current fence.
    pub fn fence(&mut self, attempt: u32) -> Option<Vec<u64>> {
        if attempt <= self.record.min_attempt {
            return None;
        }
        self.record.min_attempt = attempt;
        Some(std::mem::take(&mut self.held).into_keys().collect())
    }

    /// A `usage` event of a fenced attempt, first seen (see `fork/fenced.rs`): the call
    /// was paid for, so it counts in the branch's calls and spend, though its event is not
    /// in the log.
    pub fn count_fenced(&mut self, cost_usd: f64) {
        self.record.calls += 1;
        if cost_usd.is_finite() {
            self.record.cost_usd += cost_usd;
        }
    }

    /// True when an event of this task attempt must be dropped.
    pub fn fenced(&self, attempt: u32) -> bool {
        attempt < self.record.min_attempt
    }

    /// Place one event: apply it (and held successors), hold it, or drop a duplicate.
    pub fn arrive(&mut self, seq: u64, event: Event) -> Effect {
        match self.placement(seq) {
            Placement::Duplicate => Effect::default(),
            Placement::Hold => {
                self.held.insert(seq, event);
                Effect::default()
            }
            Placement::Apply => {
                let was_terminal = self.record.state.is_terminal();
                let mut effect = Effect::default();
                self.apply(event, &mut effect);
                while let Some(next) = self.held.remove(&self.record.next_seq) {
                    self.apply(next, &mut effect);
                }
                // Only the net change counts: a follow-up may re-open a finished branch and
                // its new turn finish within one batch.
                let now_terminal = self.record.state.is_terminal();
                effect.became_terminal = !was_terminal && now_terminal;
                effect.reopened = was_terminal && !now_terminal;
                effect
            }
        }
    }

    /// Events waiting for an earlier one.
    #[cfg(test)]
    pub fn held(&self) -> usize {
        self.held.len()
    }

    fn apply(&mut self, event: Event, effect: &mut Effect) {
        let r = &mut self.record;
        match event {
            Event::ModelResponse { text, .. } => {
                if let Some(text) = text.as_deref().map(str::trim).filter(|t| !t.is_empty()) {
                    r.answer = Some(preview(text));
                }
                r.turns += 1;
                effect.steps.push(Step::Response {
                    seq: r.next_seq,
                    turn: r.turns,
                });
            }
            Event::ToolResult { name, .. } => {
                self.tool_calls += 1;
                effect.steps.push(Step::Tool {
                    seq: r.next_seq,
                    call: self.tool_calls,
                    name,
                    turn: r.turns,
                });
            }
            Event::Usage { cached: true, .. } => {
                r.cached_calls += 1;
                effect.cached += 1;
            }
            Event::Usage {
                model,
                usage,
                cost_usd,
                reservation,
                ..
            } => {
                r.calls += 1;
                r.usage.add(&usage);
                if cost_usd.is_finite() {
                    r.cost_usd += cost_usd;
                }
                effect.usage.push((cost_usd, reservation, model));
            }
            Event::FileChange { change } => {
                let path = change.path().clone();
                match self.overlay.apply(change) {
                    Ok(()) => r.changes = self.overlay.changes().len() as u64,
                    Err(e) => tracing::error!(
                        branch.label = %r.label,
                        run.id = %r.run_id,
                        seq = r.next_seq,
                        path = %path,
                        error = %e,
                        "fork.replica: file change does not apply to the replica"
                    ),
                }
            }
            // A new turn (ADR 13): the first terminal state is final within a turn, and this
            // one starts the next, back at pending until a worker takes it.
            Event::FollowUp { .. } if r.state.is_terminal() || r.state == BranchState::Idle => {
                r.state = BranchState::Pending;
                r.error = None;
                effect.state_changed = true;
            }
            Event::ApprovalRequested {
                call_id,
                tool,
                args,
                rule,
                requested_at_ms,
                timeout_s,
                on_timeout,
            } => {
                let deadline_ms = requested_at_ms.saturating_add(timeout_s.saturating_mul(1000));
                effect.approval_requested = Some((tool.clone(), deadline_ms));
                r.approval = Some(PendingApproval {
                    call_id,
                    tool,
                    args,
                    rule,
                    requested_at_ms,
                    deadline_ms,
                    on_timeout,
                });
            }
            // The answer to the pending request: the branch goes back to pending until a
            // worker takes it over (its task is enqueued with the answer).
            Event::ApprovalDecided {
                call_id,
                approved,
                by,
                reason,
                decided_at_ms,
            } => {
                if let Some(p) = r.approval.take_if(|p| p.call_id == call_id) {
                    effect.approval_decided = Some((
                        approved,
                        by.clone(),
                        decided_at_ms.saturating_sub(p.requested_at_ms),
                    ));
                    if !approved {
                        r.blocked.push(BlockedCall {
                            call_id,
                            tool: p.tool,
                            args: p.args,
                            rule: p.rule,
                            by,
                            reason,
                            decided_at_ms,
                        });
                    }
                }
                if r.state == BranchState::AwaitingApproval {
                    r.state = BranchState::Pending;
                    r.error = None;
                    effect.state_changed = true;
                }
            }
            Event::Rewind { .. } => effect.rewound = true,
            Event::Status { state, error } => {
                if let Some(next) = r.state.transition(state) {
                    r.state = next;
                    if next == BranchState::Running {
                        r.error = None; // resumed after a pause
                    } else if error.is_some() {
                        r.error = error;
                    }
                    // A branch that ends (terminated, aborted, stopped by a cap) while a
                    // request waits takes the request with it.
                    if next.is_terminal() {
                        r.approval = None;
                    }
                    effect.state_changed = true;
                }
            }
            _ => {}
        }
        r.next_seq += 1;
        effect.applied += 1;
    }
}

/// `text` cut to [`crate::store::PREVIEW_CHARS`] characters, `…` marking a cut.
fn preview(text: &str) -> String {
    match text.char_indices().nth(crate::store::PREVIEW_CHARS) {
        Some((end, _)) => format!("{}…", &text[..end]),
        None => text.to_string(),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use forkfleet_shared::ids::{ForkId, RunId};
    use forkfleet_shared::manifest::FileEntry;
    use forkfleet_shared::overlay::ChangeOp;
    use forkfleet_shared::path::WsPath;

    fn replica() -> BranchReplica {
        let record = BranchRecord {
            fork_id: ForkId::new(),
            run_id: RunId::new(),
            index: 0,
            label: "a".into(),
            model: "scripted:x".into(),
            first_seq: 3,
            state: BranchState::Done,
            error: None,
            turns: 9,
            usage: Usage::default(),
            cost_usd: 0.0,
            changes: 0,
            next_seq: 0,
            min_attempt: 0,
            calls: 0,
            task: None,
            cached_calls: 0,
            approval: None,
            blocked: Vec::new(),
            answer: None,
            queued: None,
        };
        BranchReplica::new(record, Arc::new(Manifest::default()))
    }

    fn status(state: BranchState) -> Event {
        Event::Status { state, error: None }
    }

    fn write(p: &str) -> Event {
        Event::FileChange {
            change: ChangeOp::Write {
                path: WsPath::parse(p).unwrap(),
                entry: FileEntry::for_bytes(p.as_bytes(), 0o644),
            },
        }
    }

    #[test]
    fn a_request_waits_until_answered_and_a_denial_is_kept_as_blocked() {
        use forkfleet_shared::approval::OnTimeout;
        let mut r = replica();
        r.arrive(3, status(BranchState::Running));
        let e = r.arrive(
            4,
            Event::ApprovalRequested {
                call_id: "c1".into(),
                tool: "delete_file".into(),
                args: serde_json::json!({"path": "x"}),
                rule: "tools: delete_file".into(),
                requested_at_ms: 1_000,
                timeout_s: 60,
                on_timeout: OnTimeout::Deny,
            },
        );
        assert_eq!(e.approval_requested, Some(("delete_file".into(), 61_000)));
        r.arrive(5, status(BranchState::AwaitingApproval));
        assert_eq!(r.record.state, BranchState::AwaitingApproval);
        assert_eq!(r.record.approval.as_ref().unwrap().deadline_ms, 61_000);
        // The answer: pending again (a worker takes it over), the denial kept.
        let decided = |call: &str| Event::ApprovalDecided {
            call_id: call.into(),
            approved: false,
            by: "admin".into(),
            reason: Some("no".into()),
            decided_at_ms: 3_000,
        };
        let e = r.arrive(6, decided("c1"));
        assert!(e.state_changed);
        assert_eq!(e.approval_decided, Some((false, "admin".into(), 2_000)));
        assert_eq!(r.record.state, BranchState::Pending);
        assert!(r.record.approval.is_none());
        assert_eq!(r.record.blocked.len(), 1);
        assert_eq!(r.record.blocked[0].reason.as_deref(), Some("no"));
        // A request cleared by the branch ending.
        let mut t = replica();
        t.arrive(3, status(BranchState::Running));
        t.arrive(
            4,
            Event::ApprovalRequested {
                call_id: "c2".into(),
                tool: "write_file".into(),
                args: serde_json::json!({}),
                rule: "paths: m/**".into(),
                requested_at_ms: 0,
                timeout_s: 1,
                on_timeout: OnTimeout::Approve,
            },
        );
        t.arrive(5, status(BranchState::AwaitingApproval));
        t.arrive(6, status(BranchState::Terminated));
        assert!(t.record.approval.is_none());
        assert!(t.record.blocked.is_empty());
    }

    #[test]
    fn new_replica_starts_pending_at_first_seq() {
        let r = replica();
        assert_eq!(r.record.state, BranchState::Pending);
        assert_eq!(r.record.turns, 0);
        assert_eq!(r.record.next_seq, 3);
        assert_eq!(r.placement(2), Placement::Duplicate);
        assert_eq!(r.placement(4), Placement::Hold);
    }

    #[test]
    fn out_of_order_and_duplicates_apply_once_in_order() {
        let mut r = replica();
        assert_eq!(r.arrive(5, write("b")).applied, 0);
        assert_eq!(r.arrive(4, write("a")).applied, 0);
        assert_eq!(r.arrive(4, write("a")), Effect::default());
        assert_eq!(r.held(), 2);
        let e = r.arrive(3, status(BranchState::Running));
        assert_eq!(e.applied, 3);
        assert!(e.state_changed && !e.became_terminal);
        assert_eq!(r.held(), 0);
        let paths: Vec<&str> = r
            .overlay
            .changes()
            .iter()
            .map(|c| c.path().as_str())
            .collect();
        assert_eq!(paths, ["a", "b"]);
        assert_eq!(r.arrive(4, write("a")), Effect::default());
        assert_eq!(r.record.next_seq, 6);
        assert_eq!(r.record.changes, 2);
    }

    #[test]
    fn steps_are_numbered_in_seq_order_across_held_events_and_rebuilds() {
        let response = || Event::ModelResponse {
            model: "scripted:x".into(),
            text: None,
            tool_calls: Vec::new(),
            request: None,
            finish_reason: None,
            reasoning: None,
        };
        let result = |name: &str| Event::ToolResult {
            call_id: "c".into(),
            name: name.into(),
            ok: true,
            output: String::new(),
            request: None,
        };
        let mut r = replica();
        let log = vec![
            (3, response()),
            (4, result("read_file")),
            (5, result("write_file")),
            (6, response()),
        ];
        // 5 and 6 arrive first and wait; 4 and then 3 release everything in order.
        assert!(r.arrive(6, log[3].1.clone()).steps.is_empty());
        assert!(r.arrive(5, log[2].1.clone()).steps.is_empty());
        assert!(r.arrive(4, log[1].1.clone()).steps.is_empty());
        let steps = r.arrive(3, log[0].1.clone()).steps;
        let want = vec![
            Step::Response { seq: 3, turn: 1 },
            Step::Tool {
                seq: 4,
                call: 1,
                name: "read_file".into(),
                turn: 1,
            },
            Step::Tool {
                seq: 5,
                call: 2,
                name: "write_file".into(),
                turn: 1,
            },
            Step::Response { seq: 6, turn: 2 },
        ];
        assert_eq!(steps, want);
        // A duplicate makes no step; a rebuild from the log makes the same ones.
        assert!(r.arrive(4, log[1].1.clone()).steps.is_empty());
        let (_, rebuilt) =
            BranchReplica::rebuild(r.record.clone(), Arc::new(Manifest::default()), log);
        assert_eq!(rebuilt, want);
    }

    #[test]
    fn first_terminal_state_is_final_and_counters_add_up() {
        let mut r = replica();
        r.arrive(3, status(BranchState::Running));
        r.arrive(
            4,
            Event::ModelResponse {
                model: "m".into(),
                text: None,
                tool_calls: vec![],
                request: None,
                finish_reason: None,
                reasoning: None,
            },
        );
        let usage = Usage {
            input_tokens: 10,
            output_tokens: 5,
            cached_tokens: 0,
            cache_write_tokens: 0,
            reasoning_tokens: 0,
        };
        r.arrive(
            5,
            Event::Usage {
                model: "m".into(),
                usage,
                cost_usd: 0.25,
                reservation: None,
                cached: false,
            },
        );
        let e = r.arrive(
            6,
            Event::Status {
                state: BranchState::BudgetExhausted,
                error: Some("budget".into()),
            },
        );
        assert!(e.became_terminal);
        let e = r.arrive(7, status(BranchState::Done));
        assert!(!e.state_changed && e.applied == 1);
        assert_eq!(r.record.state, BranchState::BudgetExhausted);
        assert_eq!(r.record.error.as_deref(), Some("budget"));
        assert_eq!(r.record.turns, 1);
        assert_eq!(r.record.usage.input_tokens, 10);
        assert!((r.record.cost_usd - 0.25).abs() < 1e-12);
    }

    #[test]
    fn a_follow_up_reopens_a_finished_branch_for_a_new_turn() {
        let follow_up = || Event::FollowUp {
            text: "more".into(),
        };
        let mut r = replica();
        r.arrive(3, status(BranchState::Running));
        r.arrive(4, write("a"));
        let e = r.arrive(
            5,
            Event::Status {
                state: BranchState::Terminated,
                error: Some("stop".into()),
            },
        );
        assert!(e.became_terminal);
        let e = r.arrive(6, follow_up());
        assert!(e.reopened && e.state_changed && !e.became_terminal);
        assert_eq!(r.record.state, BranchState::Pending);
        assert_eq!(r.record.error, None);
        // The new turn: running, more work in the same overlay, done.
        let e = r.arrive(7, status(BranchState::Running));
        assert!(e.state_changed && !e.reopened);
        r.arrive(8, write("b"));
        assert!(r.arrive(9, status(BranchState::Done)).became_terminal);
        assert_eq!(r.record.state, BranchState::Done);
        assert_eq!(r.overlay.changes().len(), 2);
        // Re-opened and finished again within one arrival: no net change.
        r.arrive(12, status(BranchState::Done));
        r.arrive(11, status(BranchState::Running));
        let e = r.arrive(10, follow_up());
        assert!(!e.reopened && !e.became_terminal && e.applied == 3);
        // A rebuild from the log ends in the same state.
        let log: Vec<(u64, Event)> = vec![
            (3, status(BranchState::Running)),
            (4, status(BranchState::Done)),
            (5, follow_up()),
        ];
        let (rebuilt, _) =
            BranchReplica::rebuild(r.record.clone(), Arc::new(Manifest::default()), log);
        assert_eq!(rebuilt.record.state, BranchState::Pending);
    }

    #[test]
    fn rebuild_skips_creation_events_and_reholds_past_a_gap() {
        let base = replica();
        let stored = vec![
            (
                0,
                Event::Steer {
                    text: "fork".into(),
                },
            ),
            (
                1,
                Event::Steer {
                    text: "prefix".into(),
                },
            ),
            (3, status(BranchState::Running)),
            (4, write("a")),
            (6, write("c")),
        ];
        let (r, _) =
            BranchReplica::rebuild(base.record.clone(), Arc::new(Manifest::default()), stored);
        assert_eq!(r.record.next_seq, 5);
        assert_eq!(r.held(), 1);
        assert_eq!(r.record.state, BranchState::Running);
        assert_eq!(r.overlay.changes().len(), 1);
    }
}
