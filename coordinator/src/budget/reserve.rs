//! Reservations: granting one for a model call of a branch (strict mode) when the branch,
//! its fork and its account can all hold it, withdrawing one, and expiring them.

use super::{money, Actions, Ledger, Level, State, EPSILON};
use crate::store::ReservationRecord;
use forkfleet_shared::budget::{BudgetReply, BudgetRequest};
use forkfleet_shared::ids::ReservationId;
use forkfleet_shared::metrics::catalog as metrics;
use forkfleet_shared::state::BranchState;

impl Ledger {
    /// Reserve an upper bound for one model call of a branch (strict mode). Granted, the
    /// reservation is written to the store; the caller flushes before answering.
    pub fn reserve(&self, req: &BudgetRequest) -> (BudgetReply, Actions) {
        let now = self.clock.now_ms();
        let mut out = Actions::default();
        let mut s = self.lock();
        let Some(run) = s.runs.get(&req.run_id) else {
            return (
                BudgetReply::Gone {
                    reason: format!("run {} is not a branch the coordinator knows", req.run_id),
                },
                out,
            );
        };
        if run.fork != req.fork_id {
            return (
                BudgetReply::Gone {
                    reason: format!("run {} is not a branch of fork {}", req.run_id, req.fork_id),
                },
                out,
            );
        }
        if run.state.is_terminal() {
            return (
                BudgetReply::Gone {
                    reason: format!("the branch already finished as {}", run.state),
                },
                out,
            );
        }
        if req.attempt < run.min_attempt {
            return (
                BudgetReply::Superseded {
                    by: run.min_attempt,
                },
                out,
            );
        }
        let est = req.estimate_usd;
        if !est.is_finite() || est < 0.0 {
            return (
                BudgetReply::Refused {
                    state: BranchState::Failed,
                    reason: format!("invalid cost estimate {est}: it must be a finite amount of USD, zero or more"),
                },
                out,
            );
        }
        let (fork_id, run_cap) = (run.fork, run.cap);
        // The previous call's cost as the worker counted it, while its reservation is held
        // (its usage event not in yet): counted as spent, its reservation as released. At
        // every level: the branch's fork and account hold the same reservation.
        let (pending_spent, pending_reserved) = req
            .settles
            .and_then(|st| {
                let held = s.reservations.get(&st.reservation)?;
                let cost = if st.cost_usd.is_finite() {
                    st.cost_usd.max(0.0)
                } else {
                    0.0
                };
                (held.run_id == req.run_id).then_some((cost, held.usd))
            })
            .unwrap_or((0.0, 0.0));
        // Spent (with the pending call) and reserved (without it) under one cap.
        let counted = |spent: f64, reserved: f64| {
            (
                spent + pending_spent,
                (reserved - pending_reserved).max(0.0),
            )
        };
        // No room: the call does not fit, or the cap is reached already (a call estimated
        // at nothing is not granted past it).
        let full = |spent: f64, reserved: f64, cap: f64| {
            spent + reserved + est > cap + EPSILON || spent + EPSILON >= cap
        };
        let (run_spent, run_reserved) = counted(run.spent, s.reserved(|r| r.run_id == req.run_id));
        if let Some(cap) = run_cap {
            if full(run_spent, run_reserved, cap) {
                let reason = format!(
                    "branch cap {} reached (at refusal: spent {}, reserved {}; the call needed up to {})",
                    money(cap),
                    money(run_spent),
                    money(run_reserved),
                    money(est)
                );
                if let Some(r) = s.runs.get_mut(&req.run_id) {
                    r.blocked_by = Some(Level::Branch);
                }
                metrics::BUDGET_REFUSALS.inc(&["branch"]);
                return (
                    BudgetReply::Refused {
                        state: BranchState::BudgetExhausted,
                        reason,
                    },
                    out,
                );
            }
        }
        let Some(fork) = s.forks.get(&fork_id) else {
            return (
                BudgetReply::Gone {
                    reason: format!("fork {fork_id} is not known"),
                },
                out,
            );
        };
        let (fork_cap, fork_exhausted) = (fork.cap, fork.exhausted);
        let account = fork.policy.account.clone();
        let (fork_spent, fork_reserved) = counted(fork.spent, s.reserved(|r| r.fork_id == fork_id));
        let refuse = |s: &mut State, level: Level, reason: String, out: &mut Actions| {
            let scope = if level == Level::Account {
                "account"
            } else {
                "fork"
            };
            metrics::BUDGET_REFUSALS.inc(&[scope]);
            if let Some(r) = s.runs.get_mut(&req.run_id) {
                r.blocked_by = Some(level);
                // The refused branch stops itself; the others are told to.
                r.stopping = true;
            }
            match level {
                Level::Account => {
                    if let Some(name) = &account {
                        s.exhaust_account(name, &reason, now, out)
                    }
                }
                _ => s.exhaust_fork(fork_id, &reason, now, out),
            }
            BudgetReply::Refused {
                state: BranchState::AggregateBudgetExhausted,
                reason,
            }
        };
        if let Some(cap) = fork_cap {
            if fork_exhausted || full(fork_spent, fork_reserved, cap) {
                let reason = format!(
                    "fork cap {} reached (at refusal: spent {}, reserved {}; the call needed up to {})",
                    money(cap),
                    money(fork_spent),
                    money(fork_reserved),
                    money(est)
                );
                let reply = refuse(&mut s, Level::Fork, reason, &mut out);
                return (reply, out);
            }
        }
        if let Some(name) = &account {
            let Some(a) = s.accounts.get(name) else {
                return (
                    BudgetReply::Refused {
                        state: BranchState::AggregateBudgetExhausted,
                        reason: format!("account `{name}` no longer exists"),
                    },
                    out,
                );
            };
            let (cap, exhausted) = (a.record.cap_usd, a.exhausted);
            if let Some(cap) = cap {
                let (spent, reserved) = counted(
                    s.account_spent(name),
                    s.reserved(|r| r.account.as_deref() == Some(name.as_str())),
                );
                if exhausted || full(spent, reserved, cap) {
                    let reason = format!(
                        "account `{name}` cap {} reached (at refusal: spent {}, reserved {}; the call needed up to {})",
                        money(cap),
                        money(spent),
                        money(reserved),
                        money(est)
                    );
                    let reply = refuse(&mut s, Level::Account, reason, &mut out);
                    return (reply, out);
                }
            }
        }
        let record = ReservationRecord {
            id: ReservationId::new(),
            fork_id,
            run_id: req.run_id,
            account,
            attempt: req.attempt,
            usd: est,
            expires_at_ms: now.saturating_add(self.ttl_ms),
        };
        if let Err(e) = self.store.put_reservation(&record) {
            return (
                BudgetReply::Retry {
                    reason: format!("cannot record the reservation: {e}"),
                },
                out,
            );
        }
        let id = record.id;
        s.reservations.insert(id, record);
        (BudgetReply::Granted { reservation: id }, out)
    }

    /// Withdraw a grant that could not be made durable.
    pub fn cancel(&self, id: ReservationId) {
        let removed = self.lock().reservations.remove(&id);
        if removed.is_some() {
            self.forget(&[id]);
        }
    }

    /// Release reservations past their expiry by the ledger's clock; how many.
    pub fn expire_due(&self) -> usize {
        self.expire(self.clock.now_ms())
    }

    /// Release reservations that expire at `now` or before; how many.
    pub fn expire(&self, now: u64) -> usize {
        let mut s = self.lock();
        let released = s.release_where(|r| r.expires_at_ms <= now);
        drop(s);
        if !released.is_empty() {
            tracing::warn!(
                released = released.len(),
                "budget: reservations expired (their workers are gone?)"
            );
        }
        self.forget(&released);
        released.len()
    }
}
