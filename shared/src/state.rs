//! Branch and fork states. The first terminal state of a branch is final within a turn: only
//! a follow-up (`fork continue`, a `follow_up` event appended by the coordinator, ADR 13)
//! re-opens a finished branch, and starts a new turn, back at `pending`.

use serde::{Deserialize, Serialize};
use std::fmt;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, PartialOrd, Ord)]
#[serde(rename_all = "snake_case")]
pub enum BranchState {
    /// Created and queued, not yet picked up by a worker.
    Pending,
    /// A child `runs fork` made from a recorded run (docs/LINEAGE.md): its history is the
    /// parent's up to the cutoff, no worker runs it until `runs resume` starts it. Not
    /// terminal; stopped, like `paused`.
    Idle,
    Running,
    /// Stopped by a budget cap with `on_exhausted = "pause"`: its work is kept, no worker
    /// runs it, and a top-up resumes it. Not terminal.
    Paused,
    /// A tool call waits for a person's consent (docs/APPROVALS.md): no worker runs the
    /// branch and it holds no reservation; an answer resumes it on any worker. Not
    /// terminal; stopped, like `paused`.
    AwaitingApproval,
    Done,
    Failed,
    Terminated,
    BudgetExhausted,
    AggregateBudgetExhausted,
    /// The model's last answer was cut at the output cap (`max_output_tokens`) with no
    /// tool call, and the spec's `on_truncated = "stop"` ends the branch here rather than
    /// asking the model to go on.
    Truncated,
    /// The model refused, or the provider's content filter stopped its answer (OpenAI's
    /// `refusal` and `content_filter`, Anthropic's `refusal`): the answer's text is kept.
    Refused,
}

impl BranchState {
    pub const ALL: [BranchState; 12] = [
        BranchState::Pending,
        BranchState::Idle,
        BranchState::Running,
        BranchState::Paused,
        BranchState::AwaitingApproval,
        BranchState::Done,
        BranchState::Failed,
        BranchState::Terminated,
        BranchState::BudgetExhausted,
        BranchState::AggregateBudgetExhausted,
        BranchState::Truncated,
        BranchState::Refused,
    ];

    pub fn is_terminal(self) -> bool {
        !matches!(
            self,
            BranchState::Pending
                | BranchState::Idle
                | BranchState::Running
                | BranchState::Paused
                | BranchState::AwaitingApproval
        )
    }

    /// Terminal, paused, awaiting approval or idle: no worker runs the branch, nothing it
    /// does changes until a top-up (paused), an answer (awaiting approval), `runs resume`
    /// (idle) or never (terminal).
    pub fn is_stopped(self) -> bool {
        self.is_terminal()
            || matches!(
                self,
                BranchState::Paused | BranchState::Idle | BranchState::AwaitingApproval
            )
    }

    pub fn as_str(self) -> &'static str {
        match self {
            BranchState::Pending => "pending",
            BranchState::Idle => "idle",
            BranchState::Running => "running",
            BranchState::Paused => "paused",
            BranchState::AwaitingApproval => "awaiting_approval",
            BranchState::Done => "done",
            BranchState::Failed => "failed",
            BranchState::Terminated => "terminated",
            BranchState::BudgetExhausted => "budget_exhausted",
            BranchState::AggregateBudgetExhausted => "aggregate_budget_exhausted",
            BranchState::Truncated => "truncated",
            BranchState::Refused => "refused",
        }
    }

    /// The state after a transition to `next`: a terminal state never changes, and a
    /// running or paused branch never goes back to pending (paused and running alternate). Returns `None` when nothing changes.
    /// (A status never re-opens a branch; a `follow_up` event does, outside this function.)
    pub fn transition(self, next: BranchState) -> Option<BranchState> {
        if self.is_terminal() || self == next {
            return None;
        }
        // Nothing goes back to pending once a worker took it; an idle child, which no
        // worker ever took, is queued by `runs resume`.
        if next == BranchState::Pending && self != BranchState::Idle {
            return None;
        }
        Some(next)
    }
}

impl fmt::Display for BranchState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where a fork is in its life.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum ForkState {
    /// Branches are running.
    Open,
    /// Every branch reached a terminal state; waiting for a merge decision.
    Settled,
    /// A winner was merged into the parent.
    Merged { winner: String },
    /// Abandoned; nothing was merged.
    Aborted,
}

impl ForkState {
    pub fn as_str(&self) -> &'static str {
        match self {
            ForkState::Open => "open",
            ForkState::Settled => "settled",
            ForkState::Merged { .. } => "merged",
            ForkState::Aborted => "aborted",
        }
    }

    pub fn is_resolved(&self) -> bool {
        matches!(self, ForkState::Merged { .. } | ForkState::Aborted)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_terminal_state_is_final() {
        for t in BranchState::ALL.into_iter().filter(|s| s.is_terminal()) {
            for n in BranchState::ALL {
                assert_eq!(t.transition(n), None, "{t} -> {n} must not change");
            }
        }
        assert_eq!(
            BranchState::Pending.transition(BranchState::Running),
            Some(BranchState::Running)
        );
        assert_eq!(BranchState::Running.transition(BranchState::Pending), None);
        assert_eq!(BranchState::Paused.transition(BranchState::Pending), None);
        assert_eq!(
            BranchState::Idle.transition(BranchState::Pending),
            Some(BranchState::Pending)
        );
        assert!(!BranchState::Idle.is_terminal() && BranchState::Idle.is_stopped());
        assert_eq!(
            BranchState::Running.transition(BranchState::BudgetExhausted),
            Some(BranchState::BudgetExhausted)
        );
    }
}
