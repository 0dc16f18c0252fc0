//! Answers to a branch's request for consent (docs/APPROVALS.md): a person's (`fork
//! approve`, `fork deny`), a resolve's that does not wait (denied by policy), and a
//! timeout's (the rule's `on_timeout`), each appended to the branch's log as an
//! `approval_decided` event after its task is enqueued again, so any worker takes the
//! branch over from its log and goes on: the call runs, or its result says it was denied.
//! Timers are armed when a request is applied and again when the actor loads its fork
//! (a coordinator restart loses none).
//!
//! Whether a request has timed out is decided by the fork's clock (the coordinator's
//! [`forkfleet_shared::clock::Clock`], the system clock unless a test gives it a manual
//! one): a timer that fires early looks again at the deadline, and a step of the clock
//! (a manual clock moved on) answers at once every request whose deadline it passed.

use super::ForkState;
use crate::error::CoordinatorError;
use forkfleet_shared::api::DecisionOutcome;
use forkfleet_shared::approval::{OnTimeout, BY_TIMEOUT};
use forkfleet_shared::event::Event;
use forkfleet_shared::ids::RunId;
use forkfleet_shared::metrics::catalog;
use forkfleet_shared::state::{BranchState, ForkState as ForkPhase};
use std::time::Duration;
use tracing::Instrument;

/// An answer to the request of the branch labelled `label`.
#[derive(Debug, Clone)]
pub(crate) struct Answer {
    pub label: String,
    /// The call it answers (`None`: whichever waits).
    pub call_id: Option<String>,
    pub approved: bool,
    /// Who answers: a person's identity, `timeout` or `policy`.
    pub by: String,
    pub reason: Option<String>,
}

impl ForkState {
    /// The error of a steer or a follow-up on branch `i`, which waits for consent.
    pub(super) fn awaiting(&self, i: usize) -> CoordinatorError {
        let b = &self.branches[i].record;
        let (tool, call_id) = b
            .approval
            .as_ref()
            .map(|p| (p.tool.clone(), p.call_id.clone()))
            .unwrap_or_default();
        CoordinatorError::AwaitingApproval {
            fork: self.record.fork_id,
            label: b.label.clone(),
            tool,
            call_id,
        }
    }

    /// Answer a request: the branch must wait for one (for `answer.call_id` when named) in
    /// a fork not merged or aborted. Its task is enqueued again, then the answer appended
    /// (the branch is pending until a worker takes it over) and flushed.
    pub(super) async fn decide(
        &mut self,
        answer: Answer,
    ) -> Result<DecisionOutcome, CoordinatorError> {
        let fork_id = self.record.fork_id;
        let i = self.branch_index(&answer.label)?;
        let b = &self.branches[i].record;
        let pending = match (&b.approval, b.state) {
            (Some(p), BranchState::AwaitingApproval) => p.clone(),
            _ => {
                return Err(CoordinatorError::NotAwaitingApproval {
                    fork: fork_id,
                    label: answer.label,
                    state: b.state,
                })
            }
        };
        if let Some(given) = &answer.call_id {
            if *given != pending.call_id {
                return Err(CoordinatorError::StaleApproval {
                    fork: fork_id,
                    label: answer.label,
                    given: given.clone(),
                    pending: pending.call_id,
                    tool: pending.tool,
                });
            }
        }
        if matches!(
            self.record.state,
            ForkPhase::Merged { .. } | ForkPhase::Aborted
        ) {
            // Its branches were ended with the fork: nothing waits any more.
            return Err(CoordinatorError::NotAwaitingApproval {
                fork: fork_id,
                label: answer.label,
                state: b.state,
            });
        }
        let run_id = b.run_id;
        let span = tracing::info_span!(
            "approval.decide",
            fork.id = %fork_id,
            branch.label = %answer.label,
            branch.id = %run_id,
            gen_ai.tool.name = %pending.tool,
            gen_ai.tool.call.id = %pending.call_id,
            approval.rule = %pending.rule,
            approval.approved = answer.approved,
            approval.by = %answer.by,
            approval.wait_ms = self.clock.now_ms().saturating_sub(pending.requested_at_ms),
        );
        forkfleet_shared::trace::set_parent(&span, self.record.trace.as_deref());
        let reason = answer.reason.filter(|r| !r.trim().is_empty());
        let decided = Event::ApprovalDecided {
            call_id: pending.call_id.clone(),
            approved: answer.approved,
            by: answer.by.clone(),
            reason: reason.clone(),
            decided_at_ms: self.clock.now_ms(),
        };
        let pool = self.pool.clone();
        let attempt_base = async {
            let attempt_base = self.enqueue(i, &pool).await?;
            self.append_own(i, vec![decided])?;
            self.store.flush_async().await?;
            Ok::<_, CoordinatorError>(attempt_base)
        }
        .instrument(span.clone())
        .await?;
        tracing::info!(
            parent: &span,
            fork.id = %fork_id,
            branch.label = %answer.label,
            approval.call_id = %pending.call_id,
            approval.tool = %pending.tool,
            approval.approved = answer.approved,
            approval.by = %answer.by,
            attempt_base,
            "fork.approval: answered; the branch was enqueued again"
        );
        Ok(DecisionOutcome {
            fork_id,
            label: answer.label,
            run_id,
            call_id: pending.call_id,
            tool: pending.tool,
            approved: answer.approved,
            by: answer.by,
            reason,
            branch: self.branches[i].record.view(),
        })
    }

    /// Deny every request that waits, as `by` for `reason`: the labels answered.
    pub(super) async fn deny_waiting(
        &mut self,
        by: &str,
        reason: &str,
    ) -> Result<Vec<String>, CoordinatorError> {
        let waiting: Vec<String> = self
            .branches
            .iter()
            .filter(|b| {
                b.record.state == BranchState::AwaitingApproval && b.record.approval.is_some()
            })
            .map(|b| b.record.label.clone())
            .collect();
        for label in &waiting {
            self.decide(Answer {
                label: label.clone(),
                call_id: None,
                approved: false,
                by: by.to_string(),
                reason: Some(reason.to_string()),
            })
            .await?;
        }
        Ok(waiting)
    }

    /// Arm a timer for every request that waits.
    pub(super) fn arm_approval_timers(&self) {
        for b in &self.branches {
            if let Some(p) = &b.record.approval {
                self.arm_timer(b.record.run_id, p.call_id.clone(), p.deadline_ms);
            }
        }
    }

    /// Fire [`super::ForkMsg::ApprovalTimeout`] for `run`'s request `call_id` at
    /// `deadline_ms` (by the fork's clock).
    pub(super) fn arm_timer(&self, run: RunId, call_id: String, deadline_ms: u64) {
        let wait = Duration::from_millis(deadline_ms.saturating_sub(self.clock.now_ms()));
        self.myself
            .send_after(wait, move || super::ForkMsg::ApprovalTimeout {
                run,
                call_id,
            });
    }

    /// Be told of the steps of the fork's clock ([`super::ForkMsg::ClockStepped`]), while
    /// this actor lives. The system clock never steps.
    pub(super) fn watch_clock_steps(&self) {
        let me = self.myself.clone();
        self.clock.on_step(Box::new(move || {
            me.cast(super::ForkMsg::ClockStepped).is_ok()
        }));
    }

    /// The fork's clock was stepped: answer every request that waits past its deadline.
    pub(super) async fn clock_stepped(&mut self) {
        let now = self.clock.now_ms();
        let due: Vec<(RunId, String)> = self
            .branches
            .iter()
            .filter(|b| b.record.state == BranchState::AwaitingApproval)
            .filter_map(|b| {
                let p = b.record.approval.as_ref()?;
                (now >= p.deadline_ms).then(|| (b.record.run_id, p.call_id.clone()))
            })
            .collect();
        for (run, call_id) in due {
            self.timed_out(run, &call_id).await;
        }
    }

    /// A request's timer fired (or the clock was stepped): if it still waits and its
    /// deadline has come by the fork's clock, its rule's `on_timeout` answers it.
    pub(super) async fn timed_out(&mut self, run: RunId, call_id: &str) {
        let Ok(i) = self.run_index(run) else {
            return;
        };
        let b = &self.branches[i].record;
        let Some(p) = b
            .approval
            .as_ref()
            .filter(|p| p.call_id == call_id && b.state == BranchState::AwaitingApproval)
        else {
            return;
        };
        let now = self.clock.now_ms();
        if now < p.deadline_ms {
            // Early (a clock step): look again at the deadline.
            self.arm_timer(run, call_id.to_string(), p.deadline_ms);
            return;
        }
        let waited_s = p.deadline_ms.saturating_sub(p.requested_at_ms) / 1000;
        let answer = Answer {
            label: b.label.clone(),
            call_id: Some(call_id.to_string()),
            approved: p.on_timeout == OnTimeout::Approve,
            by: BY_TIMEOUT.to_string(),
            reason: Some(format!(
                "no answer within {waited_s} s (on_timeout = \"{}\")",
                p.on_timeout.as_str()
            )),
        };
        if let Err(e) = self.decide(answer).await {
            tracing::error!(fork.id = %self.record.fork_id, run.id = %run, error = %e, "fork.approval: cannot answer a request that timed out; trying again in a second");
            self.arm_timer(run, call_id.to_string(), now + 1000);
        }
    }

    /// What applying a request or an answer means beyond the replica: the timer of a new
    /// request, the metrics of both.
    pub(super) fn on_approval_events(
        &self,
        run: RunId,
        requested: Option<(String, u64)>,
        decided: Option<(bool, String, u64)>,
    ) {
        if let Some((tool, deadline_ms)) = requested {
            catalog::APPROVALS_REQUESTED.inc(&[tool.as_str()]);
            if let Ok(i) = self.run_index(run) {
                if let Some(p) = &self.branches[i].record.approval {
                    self.arm_timer(run, p.call_id.clone(), deadline_ms);
                }
            }
        }
        if let Some((approved, by, waited_ms)) = decided {
            let decision = if approved { "approved" } else { "denied" };
            let by = match by.as_str() {
                BY_TIMEOUT | forkfleet_shared::approval::BY_POLICY => by.as_str(),
                _ => "person",
            };
            catalog::APPROVALS_DECIDED.inc(&[decision, by]);
            catalog::APPROVAL_WAIT.observe(&[decision], waited_ms as f64 / 1000.0);
        }
    }
}
