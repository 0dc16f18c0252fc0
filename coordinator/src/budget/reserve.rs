//! Reservations: granting one for a model call of a branch (strict mode) when the branch,
//! its fork and its account can all hold it, withdrawing one, and expiring them.

use super::{money, Actions, Ledger, Level, State, EPSILON};
use crate::store::ReservationRecord;
use forkfleet_shared::budget::{BudgetReply, BudgetRequest};
use forkfleet_shared::ids::{ForkId, ReservationId, RunId};
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

    /// Grant `req` what the caps over its branch (the branch's, its fork's, its
    /// account's, in that order) let it have, or say why not.
    fn decide(&self, req: &BudgetRequest) -> (BudgetReply, Actions) {
        let now = self.clock.now_ms();
        let mut out = Actions::default();
        let mut s = self.lock();
        let reply = match self.check(&mut s, req, now, &mut out) {
            Ok(grant) => self.record(&mut s, req, grant, now),
            Err(reply) => reply,
        };
        (reply, out)
    }

    /// The grant the caps over `req`'s branch allow, or the answer when there is none (a
    /// branch gone or superseded, bad numbers, a cap to wait for or refused at).
    fn check(
        &self,
        s: &mut State,
        req: &BudgetRequest,
        now: u64,
        out: &mut Actions,
    ) -> Result<Grant, BudgetReply> {
        let (fork_id, run_cap) = admit(s, req)?;
        let max_wait = self.max_wait_ms.load(std::sync::atomic::Ordering::Relaxed);
        let mut check = Check::new(s, req, now, max_wait)?;
        if let Some(cap) = run_cap {
            let spent = s.runs.get(&req.run_id).map_or(0.0, |r| r.spent);
            let at_branch = check.counted(spent, s.reserved_and_live(|r| r.run_id == req.run_id));
            match check.at("branch", at_branch, cap, false) {
                Verdict::Fits => {}
                Verdict::Wait(reason) => return Err(BudgetReply::Wait { reason }),
                Verdict::Refuse(reason) => {
                    if let Some(r) = s.runs.get_mut(&req.run_id) {
                        r.blocked_by = Some(Level::Branch);
                    }
                    metrics::BUDGET_REFUSALS.inc(&["branch"]);
                    return Err(BudgetReply::Refused {
                        state: BranchState::BudgetExhausted,
                        reason,
                    });
                }
            }
        }
        let Some(fork) = s.forks.get(&fork_id) else {
            return Err(BudgetReply::Gone {
                reason: format!("fork {fork_id} is not known"),
            });
        };
        let (fork_cap, fork_exhausted) = (fork.cap, fork.exhausted);
        let account = fork.policy.account.clone();
        let refused = Refused {
            run_id: req.run_id,
            fork_id,
            account: account.as_deref(),
            now,
        };
        if let Some(cap) = fork_cap {
            let at_fork = check.counted(fork.spent, s.reserved_and_live(|r| r.fork_id == fork_id));
            match check.at("fork", at_fork, cap, fork_exhausted) {
                Verdict::Fits => {}
                Verdict::Wait(reason) => return Err(BudgetReply::Wait { reason }),
                Verdict::Refuse(reason) => {
                    // Another branch may still fit what this one does not (a smaller call,
                    // or one not asked yet): only this branch stops. The fork's cap is
                    // exhausted, and every branch stopped, once none may.
                    let (spent, reserved, live) = at_fork;
                    let room = cap - spent - (reserved - live).max(0.0);
                    // (A worker that sends no least, of an earlier release, gets the rule
                    // it knew: the first refusal stops every branch.)
                    let others_may_fit = !fork_exhausted
                        && check.least.is_some()
                        && s.others_may_fit(fork_id, req.run_id, room);
                    if others_may_fit && !check.gave_up {
                        if let Some(f) = s.forks.get_mut(&fork_id) {
                            f.crossed_at_ms.get_or_insert(now);
                        }
                    }
                    let exhaust = !(check.gave_up || others_may_fit);
                    return Err(refused.at(s, Level::Fork, reason, exhaust, out));
                }
            }
        }
        if let Some(name) = &account {
            let Some(a) = s.accounts.get(name) else {
                return Err(BudgetReply::Refused {
                    state: BranchState::AggregateBudgetExhausted,
                    reason: format!("account `{name}` no longer exists"),
                });
            };
            if let Some(cap) = a.record.cap_usd {
                let exhausted = a.exhausted;
                let of_account =
                    |r: &ReservationRecord| r.account.as_deref() == Some(name.as_str());
                let at_account =
                    check.counted(s.account_spent(name), s.reserved_and_live(of_account));
                match check.at(&format!("account `{name}`"), at_account, cap, exhausted) {
                    Verdict::Fits => {}
                    Verdict::Wait(reason) => return Err(BudgetReply::Wait { reason }),
                    Verdict::Refuse(reason) => {
                        let exhaust = !check.gave_up;
                        return Err(refused.at(s, Level::Account, reason, exhaust, out));
                    }
                }
            }
        }
        Ok(Grant {
            fork_id,
            account,
            usd: check.grant,
            estimate_usd: check.est,
        })
    }

    /// Write the reservation `grant` makes to the store and hold it: granted whole, or in
    /// part (less than the estimate).
    fn record(&self, s: &mut State, req: &BudgetRequest, grant: Grant, now: u64) -> BudgetReply {
        let record = ReservationRecord {
            id: ReservationId::new(),
            fork_id: grant.fork_id,
            run_id: req.run_id,
            account: grant.account,
            attempt: req.attempt,
            usd: grant.usd,
            expires_at_ms: now.saturating_add(self.ttl_ms),
        };
        if let Err(e) = self.store.put_reservation(&record) {
            return BudgetReply::Retry {
                reason: format!("cannot record the reservation: {e}"),
            };
        }
        let id = record.id;
        s.reservations.insert(id, record);
        if grant.usd + EPSILON < grant.estimate_usd {
            BudgetReply::Partial {
                reservation: id,
                usd: grant.usd,
            }
        } else {
            BudgetReply::Granted { reservation: id }
        }
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

/// The branch a request is for, if it may reserve at all: its fork and its own cap.
fn admit(s: &State, req: &BudgetRequest) -> Result<(ForkId, Option<f64>), BudgetReply> {
    let gone = |reason: String| Err(BudgetReply::Gone { reason });
    let Some(run) = s.runs.get(&req.run_id) else {
        return gone(format!(
            "run {} is not a branch the coordinator knows",
            req.run_id
        ));
    };
    if run.fork != req.fork_id {
        return gone(format!(
            "run {} is not a branch of fork {}",
            req.run_id, req.fork_id
        ));
    }
    if run.state.is_terminal() {
        return gone(format!("the branch already finished as {}", run.state));
    }
    if req.attempt < run.min_attempt {
        return Err(BudgetReply::Superseded {
            by: run.min_attempt,
        });
    }
    Ok((run.fork, run.cap))
}

/// A reservation to write: what [`Ledger::check`] granted.
struct Grant {
    fork_id: ForkId,
    account: Option<String>,
    /// The USD granted: the estimate, or less (the room a cap had left).
    usd: f64,
    estimate_usd: f64,
}

/// What one cap says of a request.
enum Verdict {
    /// It fits (perhaps only in part: [`Check::grant`] is lowered to the room).
    Fits,
    /// It would fit once calls in flight settle: why it waits.
    Wait(String),
    /// It does not fit: why it is refused.
    Refuse(String),
}

/// One request's checks against the caps over its branch, level by level: its numbers,
/// the previous call's settlement, how long it has waited, and the grant so far.
struct Check {
    est: f64,
    least: Option<f64>,
    /// The previous call's cost as the worker counted it, while its reservation is held
    /// (its usage event not in yet): counted as spent, its reservation as released. At
    /// every level: the branch's fork and account hold the same reservation.
    pending_spent: f64,
    pending_reserved: f64,
    waited_ms: u64,
    /// Waited long enough: the room may be held by calls that will not settle soon (a
    /// dead worker's, whose tasks wait for slots the waiting branches hold).
    waited_out: bool,
    /// What may be granted: the whole estimate, else (with `least_usd`) what room is left.
    grant: f64,
    /// Set when a refusal is a wait given up, not a cap reached: then only this branch
    /// stops, and no cap is marked exhausted.
    gave_up: bool,
}

impl Check {
    /// The request's numbers checked (a bad estimate or least fails the branch), and what
    /// its run has waited so far; notes the run's least.
    fn new(
        s: &mut State,
        req: &BudgetRequest,
        now: u64,
        max_wait_ms: u64,
    ) -> Result<Check, BudgetReply> {
        let invalid = |what: &str, v: f64| {
            Err(BudgetReply::Refused {
                state: BranchState::Failed,
                reason: format!(
                    "invalid {what} {v}: it must be a finite amount of USD, zero or more"
                ),
            })
        };
        let est = req.estimate_usd;
        if !est.is_finite() || est < 0.0 {
            return invalid("cost estimate", est);
        }
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
        let least = match req.least_usd {
            Some(l) if !l.is_finite() || l < 0.0 => return invalid("least cost", l),
            least => least.map(|l| l.min(est)),
        };
        let mut waited_ms = 0;
        if let Some(r) = s.runs.get_mut(&req.run_id) {
            r.last_least = Some(least.unwrap_or(est));
            waited_ms = r.waiting_since.map_or(0, |t| now.saturating_sub(t));
        }
        Ok(Check {
            est,
            least,
            pending_spent,
            pending_reserved,
            waited_ms,
            waited_out: waited_ms >= max_wait_ms,
            grant: est,
            gave_up: false,
        })
    }

    /// Spent (with the pending call), reserved and reserved by live attempts (without it)
    /// under one cap.
    fn counted(&self, spent: f64, (reserved, live): (f64, f64)) -> (f64, f64, f64) {
        (
            spent + self.pending_spent,
            (reserved - self.pending_reserved).max(0.0),
            (live - self.pending_reserved).max(0.0),
        )
    }

    /// The request under the cap of `level` (`cap`; `exhausted` if it is marked so),
    /// with `(spent, reserved, live)` counted under it.
    fn at(
        &mut self,
        level: &str,
        (spent, reserved, live): (f64, f64, f64),
        cap: f64,
        exhausted: bool,
    ) -> Verdict {
        let fit = match fit(spent, reserved, live, cap, self.est, self.least) {
            _ if exhausted => Fit::Full,
            Fit::Wait if self.waited_out => {
                self.gave_up = true;
                return Verdict::Refuse(format!(
                    "{level} cap {}: calls in flight held the room left for {} s; this branch stops, and goes on when continued or topped up",
                    money(cap),
                    self.waited_ms / 1000
                ));
            }
            other => other,
        };
        match fit {
            Fit::Whole => Verdict::Fits,
            Fit::Room(room) => {
                self.grant = self.grant.min(room);
                Verdict::Fits
            }
            Fit::Wait => Verdict::Wait(format!(
                "{level} cap {}: calls in flight hold {} of the {} left; waiting for them to settle",
                money(cap),
                money(live),
                money((cap - spent).max(0.0))
            )),
            Fit::Full => Verdict::Refuse(format!(
                "{level} cap {} reached (at refusal: spent {}, reserved {}; the call needed {}up to {})",
                money(cap),
                money(spent),
                money(reserved),
                self.least
                    .map_or_else(String::new, |l| format!("at least {}, ", money(l))),
                money(self.est)
            )),
        }
    }
}

/// A refusal at a fork's or an account's cap, for one branch.
struct Refused<'a> {
    run_id: RunId,
    fork_id: ForkId,
    account: Option<&'a str>,
    now: u64,
}

impl Refused<'_> {
    /// Refuse at `level`'s cap. `exhaust`: the cap is spent, so every branch under it
    /// stops; else only this branch does (another may still fit, or this one gave up
    /// waiting for room).
    fn at(
        &self,
        s: &mut State,
        level: Level,
        reason: String,
        exhaust: bool,
        out: &mut Actions,
    ) -> BudgetReply {
        let scope = if level == Level::Account {
            "account"
        } else {
            "fork"
        };
        metrics::BUDGET_REFUSALS.inc(&[scope]);
        if let Some(r) = s.runs.get_mut(&self.run_id) {
            r.blocked_by = Some(level);
            // The refused branch stops itself; the others are told to.
            r.stopping = true;
        }
        match level {
            _ if !exhaust => {}
            Level::Account => {
                if let Some(name) = self.account {
                    s.exhaust_account(name, &reason, self.now, out)
                }
            }
            _ => s.exhaust_fork(self.fork_id, &reason, self.now, out),
        }
        BudgetReply::Refused {
            state: BranchState::AggregateBudgetExhausted,
            reason,
        }
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
