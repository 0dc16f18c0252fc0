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
        let (reply, out) = self.decide(req);
        let now = self.clock.now_ms();
        if let Some(r) = self.lock().runs.get_mut(&req.run_id) {
            if matches!(reply, BudgetReply::Wait { .. }) {
                r.waiting_since.get_or_insert(now);
            } else {
                r.waiting_since = None;
            }
        }
        (reply, out)
    }

    fn decide(&self, req: &BudgetRequest) -> (BudgetReply, Actions) {
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
        // Spent (with the pending call), reserved and reserved by live attempts (without
        // it) under one cap.
        let counted = |spent: f64, (reserved, live): (f64, f64)| {
            (
                spent + pending_spent,
                (reserved - pending_reserved).max(0.0),
                (live - pending_reserved).max(0.0),
            )
        };
        let least = match req.least_usd {
            Some(l) if !l.is_finite() || l < 0.0 => {
                return (
                    BudgetReply::Refused {
                        state: BranchState::Failed,
                        reason: format!("invalid least cost {l}: it must be a finite amount of USD, zero or more"),
                    },
                    out,
                );
            }
            least => least.map(|l| l.min(est)),
        };
        let max_wait = self.max_wait_ms.load(std::sync::atomic::Ordering::Relaxed);
        let mut waited_ms = 0;
        if let Some(r) = s.runs.get_mut(&req.run_id) {
            r.last_least = Some(least.unwrap_or(est));
            waited_ms = r.waiting_since.map_or(0, |t| now.saturating_sub(t));
        }
        // Waited long enough: the room may be held by calls that will not settle soon (a
        // dead worker's, whose tasks wait for slots the waiting branches hold).
        let waited_out = waited_ms >= max_wait;
        // Set when a refusal below is a wait given up, not a cap reached: then only this
        // branch stops, and no cap is marked exhausted.
        let gave_up = std::cell::Cell::new(false);
        // What may be granted: the whole estimate, else (with `least_usd`) what room is left.
        let mut grant = est;
        let mut decide = |level: &str,
                          (spent, reserved, live): (f64, f64, f64),
                          cap: f64,
                          exhausted: bool| {
            let fit = match fit(spent, reserved, live, cap, est, least) {
                _ if exhausted => Fit::Full,
                Fit::Wait if waited_out => {
                    gave_up.set(true);
                    return Some(Ok(format!(
                        "{level} cap {}: calls in flight held the room left for {} s; this branch stops, and goes on when continued or topped up",
                        money(cap),
                        waited_ms / 1000
                    )));
                }
                other => other,
            };
            let wait = |held: f64| {
                format!(
                    "{level} cap {}: calls in flight hold {} of the {} left; waiting for them to settle",
                    money(cap),
                    money(held),
                    money((cap - spent).max(0.0))
                )
            };
            match fit {
                Fit::Whole => None,
                Fit::Room(room) => {
                    grant = grant.min(room);
                    None
                }
                Fit::Wait => Some(Err(wait(live))),
                Fit::Full => Some(Ok(format!(
                    "{level} cap {} reached (at refusal: spent {}, reserved {}; the call needed {}up to {})",
                    money(cap),
                    money(spent),
                    money(reserved),
                    least.map_or_else(String::new, |l| format!("at least {}, ", money(l))),
                    money(est)
                ))),
            }
        };
        let mine = |r: &ReservationRecord| r.run_id == req.run_id;
        let run_spent = s.runs.get(&req.run_id).map_or(0.0, |r| r.spent);
        let at_branch = counted(run_spent, s.reserved_and_live(mine));
        if let Some(cap) = run_cap {
            match decide("branch", at_branch, cap, false) {
                None => {}
                Some(Err(reason)) => return (BudgetReply::Wait { reason }, out),
                Some(Ok(reason)) => {
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
        let of_fork = |r: &ReservationRecord| r.fork_id == fork_id;
        let at_fork = counted(fork.spent, s.reserved_and_live(of_fork));
        // A refusal at the fork's or the account's cap. `exhaust`: the cap is spent, so
        // every branch under it stops; else only this branch does (another may still fit,
        // or this one gave up waiting for room).
        let refuse =
            |s: &mut State, level: Level, reason: String, exhaust: bool, out: &mut Actions| {
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
                    _ if !exhaust => {}
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
            match decide("fork", at_fork, cap, fork_exhausted) {
                None => {}
                Some(Err(reason)) => return (BudgetReply::Wait { reason }, out),
                Some(Ok(reason)) => {
                    // Another branch may still fit what this one does not (a smaller call,
                    // or one not asked yet): only this branch stops. The fork's cap is
                    // exhausted, and every branch stopped, once none may.
                    let (spent, reserved, live) = at_fork;
                    let room = cap - spent - (reserved - live).max(0.0);
                    // (A worker that sends no least, of an earlier release, gets the rule
                    // it knew: the first refusal stops every branch.)
                    if gave_up.get()
                        || (!fork_exhausted
                            && least.is_some()
                            && s.others_may_fit(fork_id, req.run_id, room))
                    {
                        if let (false, Some(f)) = (gave_up.get(), s.forks.get_mut(&fork_id)) {
                            f.crossed_at_ms.get_or_insert(now);
                        }
                        let reply = refuse(&mut s, Level::Fork, reason, false, &mut out);
                        return (reply, out);
                    }
                    let reply = refuse(&mut s, Level::Fork, reason, true, &mut out);
                    return (reply, out);
                }
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
                let of_account =
                    |r: &ReservationRecord| r.account.as_deref() == Some(name.as_str());
                let at_account = counted(s.account_spent(name), s.reserved_and_live(of_account));
                match decide(&format!("account `{name}`"), at_account, cap, exhausted) {
                    None => {}
                    Some(Err(reason)) => return (BudgetReply::Wait { reason }, out),
                    Some(Ok(reason)) => {
                        let exhaust = !gave_up.get();
                        let reply = refuse(&mut s, Level::Account, reason, exhaust, &mut out);
                        return (reply, out);
                    }
                }
            }
        }
        let record = ReservationRecord {
            id: ReservationId::new(),
            fork_id,
            run_id: req.run_id,
            account,
            attempt: req.attempt,
            usd: grant,
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
        let reply = if grant + EPSILON < est {
            BudgetReply::Partial {
                reservation: id,
                usd: grant,
            }
        } else {
            BudgetReply::Granted { reservation: id }
        };
        (reply, out)
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

/// How a call fits under one cap.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Fit {
    /// The whole estimate fits.
    Whole,
    /// Not the whole estimate, but the call's least does: this much room is left.
    Room(f64),
    /// Not even the call's least, but it would if the reservations live attempts hold
    /// under the cap were released: they may be, when their calls settle.
    Wait,
    /// No room: the call cannot fit, or the cap is reached already (a call estimated at
    /// nothing is not granted past it).
    Full,
}

/// How a call estimated at `est` (at least `least`, when the worker says) fits under `cap`
/// with `spent` spent and `reserved` held by other calls, `live` of it by live attempts.
fn fit(spent: f64, reserved: f64, live: f64, cap: f64, est: f64, least: Option<f64>) -> Fit {
    if spent + EPSILON >= cap {
        return Fit::Full;
    }
    if spent + reserved + est <= cap + EPSILON {
        return Fit::Whole;
    }
    let Some(least) = least else {
        return Fit::Full;
    };
    let room = cap - spent - reserved;
    if room + EPSILON >= least {
        Fit::Room(room.max(0.0))
    } else if live > EPSILON && spent + (reserved - live).max(0.0) + least <= cap + EPSILON {
        Fit::Wait
    } else {
        Fit::Full
    }
}
