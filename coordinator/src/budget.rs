//! The budget ledger: branch, fork and account caps, the money spent under each and the
//! money reserved for calls in flight. One per coordinator, shared by the fork actors (which
//! settle usage as they apply events), the reservation service and the API.
//!
//! - **Spent** comes from applied `usage` events only (exactly once, by (run, seq)); on start
//!   each fork actor registers its branches with the spend rebuilt from their logs. An
//!   account's spend is the sum of its forks'.
//! - **Reserved** is the sum of live reservations. A reservation is made by
//!   [`Ledger::reserve`] (strict mode, before a call), persisted before it is granted, and
//!   ends when the call's `usage` event names it (settled at the actual cost), when its
//!   branch stops or pauses, when a later task attempt takes the branch over (the worker
//!   that held it is presumed dead), or when it expires ([`Ledger::expire`]).
//! - A call is granted only if `spent + reserved + estimate <= cap` at the branch, its fork
//!   and its account at once, so money is spent only inside a reservation and the sum of
//!   what calls really cost stays under every cap (up to the estimate being an upper bound).
//! - The first call a fork's or an account's cap cannot hold marks that cap **exhausted**:
//!   every branch under it is stopped (or paused), and it refuses everything until raised.
//!   In best-effort mode the same happens when a `usage` event takes the spend to the cap.
//! - Caps changed after creation (top-ups, moves) are written to the store's `caps` tree.
//! - Time (when a reservation expires) comes from the ledger's [`Clock`], the system's
//!   unless a test gives it a manual one ([`Ledger::open`]).

mod service;
#[cfg(test)]
mod tests;

pub(crate) use service::start;

use crate::error::{list, CoordinatorError};
use crate::store::{AccountRecord, BranchRecord, ForkRecord, ReservationRecord, RunStore};
use forkfleet_bus::Bus;
use forkfleet_shared::budget::{
    remaining, AccountView, BranchCost, BudgetMode, BudgetPolicy, BudgetReply, BudgetRequest,
    ForkCost, OnExhausted,
};
use forkfleet_shared::clock::Clock;
use forkfleet_shared::ids::{ForkId, ReservationId, RunId};
use forkfleet_shared::protocol::{now_ms, Control, ControlCommand};
use forkfleet_shared::spec::check_account_name;
use forkfleet_shared::state::BranchState;
use forkfleet_shared::wire;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};

/// Slack for floating-point sums of dollars.
const EPSILON: f64 = 1e-12;

/// Which cap a decision is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Level {
    Branch,
    Fork,
    Account,
}

impl Level {
    fn state(self) -> BranchState {
        match self {
            Level::Branch => BranchState::BudgetExhausted,
            Level::Fork | Level::Account => BranchState::AggregateBudgetExhausted,
        }
    }
}

struct RunBudget {
    fork: ForkId,
    label: String,
    cap: Option<f64>,
    spent: f64,
    state: BranchState,
    /// The latest task attempt that took the branch over (every attempt above 1 is fenced
    /// in through `coord.resume`), so reservations of attempts below it are void and a
    /// task resuming the branch starts above it.
    min_attempt: u32,
    /// A stop or pause was sent and the branch has not stopped yet.
    stopping: bool,
    /// The cap that last stopped or refused it (what a top-up must raise to resume it).
    blocked_by: Option<Level>,
    stopped_at_ms: Option<u64>,
}

struct ForkBudget {
    policy: BudgetPolicy,
    cap: Option<f64>,
    spent: f64,
    exhausted: bool,
    crossed_at_ms: Option<u64>,
    /// Its branches, in branch order.
    runs: Vec<RunId>,
}

struct AccountState {
    record: AccountRecord,
    exhausted: bool,
}

#[derive(Default)]
struct State {
    runs: HashMap<RunId, RunBudget>,
    forks: HashMap<ForkId, ForkBudget>,
    accounts: BTreeMap<String, AccountState>,
    reservations: HashMap<ReservationId, ReservationRecord>,
}

/// Commands the ledger wants sent to branches (stops and pauses), sent by
/// [`Ledger::send`] outside its lock.
#[derive(Debug, Default)]
#[must_use]
pub(crate) struct Actions {
    pub controls: Vec<Control>,
}

impl Actions {
    pub fn is_empty(&self) -> bool {
        self.controls.is_empty()
    }
}

pub(crate) struct Ledger {
    state: Mutex<State>,
    store: RunStore,
    bus: Arc<dyn Bus>,
    ttl_ms: u64,
    clock: Arc<dyn Clock>,
}

impl State {
    fn reserved(&self, keep: impl Fn(&ReservationRecord) -> bool) -> f64 {
        self.reservations
            .values()
            .filter(|r| keep(r))
            .map(|r| r.usd)
            .fold(0.0, |a, b| a + b)
    }

    fn account_spent(&self, name: &str) -> f64 {
        self.forks
            .values()
            .filter(|f| f.policy.account.as_deref() == Some(name))
            .map(|f| f.spent)
            .fold(0.0, |a, b| a + b)
    }

    fn account_view(&self, a: &AccountState) -> AccountView {
        let name = &a.record.name;
        let spent = self.account_spent(name);
        let reserved = self.reserved(|r| r.account.as_deref() == Some(name));
        AccountView {
            name: name.clone(),
            cap_usd: a.record.cap_usd,
            spent_usd: spent,
            reserved_usd: reserved,
            remaining_usd: remaining(a.record.cap_usd, spent, reserved),
            forks: self
                .forks
                .values()
                .filter(|f| f.policy.account.as_deref() == Some(name))
                .count(),
            created_at_ms: a.record.created_at_ms,
        }
    }

    /// Drop the reservations `drop` selects; the ids dropped.
    fn release_where(&mut self, drop: impl Fn(&ReservationRecord) -> bool) -> Vec<ReservationId> {
        let ids: Vec<ReservationId> = self
            .reservations
            .values()
            .filter(|r| drop(r))
            .map(|r| r.id)
            .collect();
        for id in &ids {
            self.reservations.remove(id);
        }
        ids
    }

    /// The command that stops (or pauses) a branch for `level`.
    ///
    /// Unless the fork cancels calls in flight (best effort, by default), the stop is
    /// graceful: a call in flight (paid for by its reservation in strict mode) finishes and
    /// is recorded, and the branch stops before the next.
    /// The command names the attempt it is for, so a branch resumed later ignores it.
    fn stop_command(&mut self, run_id: RunId, level: Level, reason: &str) -> Option<Control> {
        let (pause, graceful) = {
            let run = self.runs.get(&run_id)?;
            let fork = self.forks.get(&run.fork)?;
            (
                fork.policy.on_exhausted == OnExhausted::Pause,
                !fork.policy.cancels_in_flight(),
            )
        };
        let run = self.runs.get_mut(&run_id)?;
        if run.stopping || run.state.is_stopped() {
            return None;
        }
        run.stopping = true;
        run.blocked_by = Some(level);
        let attempt = run.min_attempt.max(1);
        let command = if pause {
            ControlCommand::Pause {
                reason: reason.to_string(),
                graceful,
            }
        } else {
            ControlCommand::Stop {
                state: level.state(),
                reason: reason.to_string(),
                graceful,
            }
        };
        Some(Control {
            run_id,
            command,
            attempt: Some(attempt),
        })
    }

    /// Mark a fork's cap exhausted and stop every branch under it (once: an exhausted cap
    /// stays so until it is raised, and a branch that runs on anyway is stopped by its own
    /// next reservation or usage report).
    fn exhaust_fork(&mut self, fork_id: ForkId, reason: &str, now: u64, out: &mut Actions) {
        let runs = match self.forks.get_mut(&fork_id) {
            Some(f) if f.exhausted => return,
            Some(f) => {
                f.exhausted = true;
                f.crossed_at_ms.get_or_insert(now);
                f.runs.clone()
            }
            None => return,
        };
        for run in runs {
            if let Some(c) = self.stop_command(run, Level::Fork, reason) {
                out.controls.push(c);
            }
        }
    }

    /// Mark an account's cap exhausted and stop every branch of every fork charging it.
    fn exhaust_account(&mut self, name: &str, reason: &str, now: u64, out: &mut Actions) {
        match self.accounts.get_mut(name) {
            Some(a) if a.exhausted => return,
            Some(a) => a.exhausted = true,
            None => {}
        }
        let forks: Vec<ForkId> = self
            .forks
            .iter()
            .filter(|(_, f)| f.policy.account.as_deref() == Some(name))
            .map(|(id, _)| *id)
            .collect();
        for fork_id in forks {
            let runs = match self.forks.get_mut(&fork_id) {
                Some(f) => {
                    f.crossed_at_ms.get_or_insert(now);
                    f.runs.clone()
                }
                None => continue,
            };
            for run in runs {
                if let Some(c) = self.stop_command(run, Level::Account, reason) {
                    out.controls.push(c);
                }
            }
        }
    }

    fn branch_cost(&self, run_id: RunId) -> Option<BranchCost> {
        let r = self.runs.get(&run_id)?;
        let reserved = self.reserved(|x| x.run_id == run_id);
        Some(BranchCost {
            label: r.label.clone(),
            run_id,
            state: r.state,
            spent_usd: r.spent,
            reserved_usd: reserved,
            cap_usd: r.cap,
            remaining_usd: remaining(r.cap, r.spent, reserved),
            // The fork's view has the turns; `CoordinatorHandle::fork_cost` fills them in.
            calls: 0,
            stopped_at_ms: r.stopped_at_ms,
        })
    }

    fn fork_cost(&self, fork_id: ForkId) -> Option<ForkCost> {
        let f = self.forks.get(&fork_id)?;
        let reserved = self.reserved(|x| x.fork_id == fork_id);
        Some(ForkCost {
            fork_id,
            mode: f.policy.mode,
            on_exhausted: f.policy.on_exhausted,
            spent_usd: f.spent,
            reserved_usd: reserved,
            cap_usd: f.cap,
            remaining_usd: remaining(f.cap, f.spent, reserved),
            crossed_at_ms: f.crossed_at_ms,
            branches: f.runs.iter().filter_map(|r| self.branch_cost(*r)).collect(),
            account: f
                .policy
                .account
                .as_deref()
                .and_then(|n| self.accounts.get(n))
                .map(|a| self.account_view(a)),
            judge_cost_usd: 0.0,
            judge_usage: Default::default(),
        })
    }
}

fn money(v: f64) -> String {
    format!("${v:.6}")
}

fn check_usd(what: &str, usd: f64, zero_ok: bool) -> Result<(), CoordinatorError> {
    let ok = usd.is_finite() && if zero_ok { usd >= 0.0 } else { usd > 0.0 };
    if ok {
        Ok(())
    } else {
        let valid = if zero_ok {
            "zero or more"
        } else {
            "more than zero"
        };
        Err(CoordinatorError::BadBudget(format!(
            "{what} is {usd}; it must be a finite amount of USD, {valid}"
        )))
    }
}

impl Ledger {
    /// The ledger over `store`'s accounts and reservations (forks register themselves as
    /// their actors start). Reservations expire `ttl_ms` after they are granted, by
    /// `clock`.
    pub fn open(
        store: RunStore,
        bus: Arc<dyn Bus>,
        ttl_ms: u64,
        clock: Arc<dyn Clock>,
    ) -> Result<Arc<Ledger>, CoordinatorError> {
        let mut state = State::default();
        for a in store.accounts()? {
            state.accounts.insert(
                a.name.clone(),
                AccountState {
                    record: a,
                    exhausted: false,
                },
            );
        }
        for r in store.reservations()? {
            state.reservations.insert(r.id, r);
        }
        Ok(Arc::new(Ledger {
            state: Mutex::new(state),
            store,
            bus,
            ttl_ms,
            clock,
        }))
    }

    /// How long a reservation holds money unsettled.
    pub fn ttl_ms(&self) -> u64 {
        self.ttl_ms
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A poisoned lock only means a holder panicked; the sums are still consistent
        // (every change is a single insert or remove).
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Delete released reservations from the store (not flushed: the next event batch's
    /// flush, or the next grant's, makes it durable; a release lost in a crash only holds
    /// money until the reservation expires).
    fn forget(&self, ids: &[ReservationId]) {
        for id in ids {
            if let Err(e) = self.store.delete_reservation(*id) {
                tracing::warn!(reservation = %id, error = %e, "budget: cannot delete a released reservation; it expires instead");
            }
        }
    }

    /// A fork's actor started (created or loaded): its caps (after top-ups), its branches'
    /// spend and states. Registering again replaces what was there.
    pub fn register_fork(&self, fork: &ForkRecord, branches: &[BranchRecord]) {
        let mut fork_cap = fork.plan.aggregate_budget_usd;
        let mut run_caps: HashMap<RunId, Option<f64>> = HashMap::new();
        match self.store.caps(fork.fork_id) {
            Ok(caps) => {
                for (run, cap) in caps {
                    match run {
                        None => fork_cap = Some(cap),
                        Some(run) => {
                            run_caps.insert(run, Some(cap));
                        }
                    }
                }
            }
            Err(e) => {
                tracing::error!(fork.id = %fork.fork_id, error = %e, "budget: cannot read top-ups; using the plan's caps")
            }
        }
        let mut s = self.lock();
        let mut runs = Vec::with_capacity(branches.len());
        let mut spent = 0.0;
        for b in branches {
            let plan_cap = fork
                .plan
                .branches
                .get(b.index as usize)
                .and_then(|p| p.budget_usd);
            let cap = run_caps.get(&b.run_id).copied().unwrap_or(plan_cap);
            spent += b.cost_usd;
            runs.push(b.run_id);
            s.runs.insert(
                b.run_id,
                RunBudget {
                    fork: fork.fork_id,
                    label: b.label.clone(),
                    cap,
                    spent: b.cost_usd,
                    state: b.state,
                    min_attempt: b.min_attempt,
                    stopping: false,
                    blocked_by: None,
                    stopped_at_ms: None,
                },
            );
        }
        s.forks.insert(
            fork.fork_id,
            ForkBudget {
                policy: fork.plan.budget.clone(),
                cap: fork_cap,
                spent,
                exhausted: false,
                crossed_at_ms: None,
                runs,
            },
        );
        // Reservations of branches that stopped while the coordinator was down.
        let stopped: Vec<RunId> = branches
            .iter()
            .filter(|b| b.state.is_stopped())
            .map(|b| b.run_id)
            .collect();
        let released = s.release_where(|r| stopped.contains(&r.run_id));
        drop(s);
        self.forget(&released);
    }

    /// Check that an account exists (a fork is about to charge it).
    pub fn check_account(&self, name: &str) -> Result<(), CoordinatorError> {
        let s = self.lock();
        if s.accounts.contains_key(name) {
            return Ok(());
        }
        Err(CoordinatorError::UnknownAccount {
            name: name.to_string(),
            valid: if s.accounts.is_empty() {
                "no accounts exist; create one with `forkfleet account set NAME --cap USD`"
                    .to_string()
            } else {
                format!(
                    "accounts: {} (`forkfleet account set` creates one)",
                    list(s.accounts.keys())
                )
            },
        })
    }

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
                BudgetReply::Gone {
                    reason: format!(
                        "task attempt {} was taken over by attempt {}",
                        req.attempt, run.min_attempt
                    ),
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
        let (fork_id, run_cap, run_spent) = (run.fork, run.cap, run.spent);
        let run_reserved = s.reserved(|r| r.run_id == req.run_id);
        if let Some(cap) = run_cap {
            if run_spent + run_reserved + est > cap + EPSILON {
                let reason = format!(
                    "branch cap {} reached: spent {}, reserved {}, this call needs up to {}",
                    money(cap),
                    money(run_spent),
                    money(run_reserved),
                    money(est)
                );
                if let Some(r) = s.runs.get_mut(&req.run_id) {
                    r.blocked_by = Some(Level::Branch);
                }
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
        let (fork_cap, fork_spent, fork_exhausted) = (fork.cap, fork.spent, fork.exhausted);
        let account = fork.policy.account.clone();
        let fork_reserved = s.reserved(|r| r.fork_id == fork_id);
        let refuse = |s: &mut State, level: Level, reason: String, out: &mut Actions| {
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
            if fork_exhausted || fork_spent + fork_reserved + est > cap + EPSILON {
                let reason = format!(
                    "fork cap {} reached: spent {}, reserved {}, this call needs up to {}",
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
                let spent = s.account_spent(name);
                let reserved = s.reserved(|r| r.account.as_deref() == Some(name.as_str()));
                if exhausted || spent + reserved + est > cap + EPSILON {
                    let reason = format!(
                        "account `{name}` cap {} reached: spent {}, reserved {}, this call needs up to {}",
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

    /// A `usage` event was applied: charge its cost, settle its reservation, and in
    /// best-effort mode stop what crossed a cap.
    pub fn on_usage(
        &self,
        run_id: RunId,
        cost_usd: f64,
        reservation: Option<ReservationId>,
    ) -> Actions {
        let now = self.clock.now_ms();
        let mut out = Actions::default();
        // The replica's rule (`replica.rs`): a finite cost counts, anything else does not.
        let cost = if cost_usd.is_finite() { cost_usd } else { 0.0 };
        let mut s = self.lock();
        let settled = reservation.and_then(|id| s.reservations.remove(&id));
        let Some(run) = s.runs.get_mut(&run_id) else {
            drop(s);
            if let Some(r) = settled {
                self.forget(&[r.id]);
            }
            return out;
        };
        run.spent += cost;
        let (fork_id, run_cap, run_spent) = (run.fork, run.cap, run.spent);
        let Some(fork) = s.forks.get_mut(&fork_id) else {
            return out;
        };
        fork.spent += cost;
        let (mode, fork_cap, fork_spent) = (fork.policy.mode, fork.cap, fork.spent);
        let account = fork.policy.account.clone();
        // Past a cap: in strict mode only through estimation error; the branches are
        // stopped in either mode, as more calls cannot fit.
        if let Some(cap) = run_cap {
            if run_spent + EPSILON >= cap && mode == BudgetMode::BestEffort {
                let reason = format!(
                    "branch cap {} reached: spent {}",
                    money(cap),
                    money(run_spent)
                );
                if let Some(c) = s.stop_command(run_id, Level::Branch, &reason) {
                    out.controls.push(c);
                }
            }
        }
        if let Some(cap) = fork_cap {
            if fork_spent + EPSILON >= cap {
                let reason = format!(
                    "fork cap {} reached: spent {}",
                    money(cap),
                    money(fork_spent)
                );
                // Every branch the first time; later, the one still spending (a branch
                // taken over after the stop was sent to its lost worker).
                if let Some(c) = s.stop_command(run_id, Level::Fork, &reason) {
                    out.controls.push(c);
                }
                s.exhaust_fork(fork_id, &reason, now, &mut out);
            }
        }
        if let Some(name) = account {
            let cap = s.accounts.get(&name).and_then(|a| a.record.cap_usd);
            if let Some(cap) = cap {
                let spent = s.account_spent(&name);
                if spent + EPSILON >= cap {
                    let reason = format!(
                        "account `{name}` cap {} reached: spent {}",
                        money(cap),
                        money(spent)
                    );
                    if let Some(c) = s.stop_command(run_id, Level::Account, &reason) {
                        out.controls.push(c);
                    }
                    s.exhaust_account(&name, &reason, now, &mut out);
                }
            }
        }
        drop(s);
        if let Some(r) = settled {
            self.forget(&[r.id]);
        }
        out
    }

    /// A branch's state changed: a stopped or paused branch holds no reservations.
    pub fn on_state(&self, run_id: RunId, state: BranchState) {
        let mut s = self.lock();
        let Some(run) = s.runs.get_mut(&run_id) else {
            return;
        };
        run.state = state;
        let stopped = state.is_stopped();
        if stopped {
            run.stopping = false;
            let now = self.clock.now_ms();
            run.stopped_at_ms.get_or_insert(now);
        } else if state == BranchState::Running {
            run.stopped_at_ms = None;
        }
        if !stopped {
            return;
        }
        let released = s.release_where(|r| r.run_id == run_id);
        drop(s);
        self.forget(&released);
    }

    /// A task attempt took the branch over: reservations of earlier attempts are void
    /// (their worker is presumed dead; a call it still had in flight is lost with it).
    pub fn on_fence(&self, run_id: RunId, attempt: u32) {
        let mut s = self.lock();
        if let Some(r) = s.runs.get_mut(&run_id) {
            r.min_attempt = r.min_attempt.max(attempt);
            // A stop sent to the earlier attempt does not reach this one.
            r.stopping = false;
        }
        let released = s.release_where(|r| r.run_id == run_id && r.attempt < attempt);
        drop(s);
        if !released.is_empty() {
            tracing::info!(run.id = %run_id, attempt, released = released.len(), "budget: reservations of an earlier attempt released");
        }
        self.forget(&released);
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

    /// A branch's cap now (after top-ups and moves).
    pub fn run_cap(&self, run_id: RunId) -> Option<f64> {
        self.lock().runs.get(&run_id).and_then(|r| r.cap)
    }

    pub fn fork_cost(&self, fork_id: ForkId) -> Result<ForkCost, CoordinatorError> {
        self.lock()
            .fork_cost(fork_id)
            .ok_or_else(|| CoordinatorError::UnknownFork(fork_id.to_string()))
    }

    fn label_to_run(
        &self,
        s: &State,
        fork_id: ForkId,
        label: &str,
    ) -> Result<RunId, CoordinatorError> {
        let f = s
            .forks
            .get(&fork_id)
            .ok_or_else(|| CoordinatorError::UnknownFork(fork_id.to_string()))?;
        f.runs
            .iter()
            .find(|r| s.runs.get(r).is_some_and(|b| b.label == label))
            .copied()
            .ok_or_else(|| CoordinatorError::UnknownLabel {
                fork: fork_id,
                label: label.to_string(),
                valid: list(
                    f.runs
                        .iter()
                        .filter_map(|r| s.runs.get(r))
                        .map(|b| b.label.as_str())
                        .collect::<Vec<_>>()
                        .iter(),
                ),
            })
    }

    /// Paused branches whose blocking cap is one of `levels` (and, for the branch level,
    /// only `only` when given), in branch order; they are marked unblocked.
    fn take_resumable(
        s: &mut State,
        forks: &[ForkId],
        levels: &[Level],
        only: Option<RunId>,
    ) -> Vec<(ForkId, RunId)> {
        let mut out = Vec::new();
        for fork_id in forks {
            let Some(f) = s.forks.get(fork_id) else {
                continue;
            };
            for run_id in f.runs.clone() {
                if only.is_some_and(|o| o != run_id) {
                    continue;
                }
                let Some(r) = s.runs.get_mut(&run_id) else {
                    continue;
                };
                if r.state == BranchState::Paused
                    && r.blocked_by.is_none_or(|l| levels.contains(&l))
                {
                    r.blocked_by = None;
                    out.push((*fork_id, run_id));
                }
            }
        }
        out
    }

    /// Raise a branch's cap (`label`) or the fork's by `usd`. Returns the paused
    /// branches to resume.
    pub fn topup(
        &self,
        fork_id: ForkId,
        label: Option<&str>,
        usd: f64,
    ) -> Result<Vec<(ForkId, RunId)>, CoordinatorError> {
        check_usd("--usd", usd, false)?;
        let mut s = self.lock();
        match label {
            Some(label) => {
                let run_id = self.label_to_run(&s, fork_id, label)?;
                let Some(run) = s.runs.get_mut(&run_id) else {
                    return Err(CoordinatorError::UnknownRun(run_id));
                };
                let Some(cap) = run.cap else {
                    return Err(CoordinatorError::BadBudget(format!(
                        "branch `{label}` has no cap of its own; top up the fork's aggregate cap (leave out --branch) or its account (`forkfleet account set`)"
                    )));
                };
                let new = cap + usd;
                self.store.put_cap(fork_id, Some(run_id), new)?;
                run.cap = Some(new);
                tracing::info!(fork.id = %fork_id, branch.label = %label, cap = new, "budget.topup");
                Ok(Self::take_resumable(
                    &mut s,
                    &[fork_id],
                    &[Level::Branch],
                    Some(run_id),
                ))
            }
            None => {
                let f = s
                    .forks
                    .get_mut(&fork_id)
                    .ok_or_else(|| CoordinatorError::UnknownFork(fork_id.to_string()))?;
                let Some(cap) = f.cap else {
                    return Err(CoordinatorError::BadBudget(format!(
                        "fork {fork_id} has no aggregate cap; top up a branch (--branch LABEL) or its account (`forkfleet account set`)"
                    )));
                };
                let new = cap + usd;
                self.store.put_cap(fork_id, None, new)?;
                f.cap = Some(new);
                f.exhausted = false;
                tracing::info!(fork.id = %fork_id, cap = new, "budget.topup");
                Ok(Self::take_resumable(
                    &mut s,
                    &[fork_id],
                    &[Level::Fork],
                    None,
                ))
            }
        }
    }

    /// Move `usd` of cap from branch `from` to branch `to`. Returns `to` when it was
    /// paused by its cap.
    pub fn move_budget(
        &self,
        fork_id: ForkId,
        from: &str,
        to: &str,
        usd: f64,
    ) -> Result<Vec<(ForkId, RunId)>, CoordinatorError> {
        check_usd("--usd", usd, false)?;
        if from == to {
            return Err(CoordinatorError::BadBudget(format!(
                "--from and --to are both `{from}`; name two different branches"
            )));
        }
        let mut s = self.lock();
        let from_run = self.label_to_run(&s, fork_id, from)?;
        let to_run = self.label_to_run(&s, fork_id, to)?;
        let held = s.reserved(|r| r.run_id == from_run);
        let (Some(a), Some(b)) = (
            s.runs.get(&from_run).map(|r| (r.cap, r.spent)),
            s.runs.get(&to_run).map(|r| r.cap),
        ) else {
            return Err(CoordinatorError::UnknownRun(from_run));
        };
        let (Some(from_cap), from_spent) = a else {
            return Err(CoordinatorError::BadBudget(format!(
                "branch `{from}` has no cap of its own to move budget from"
            )));
        };
        let Some(to_cap) = b else {
            return Err(CoordinatorError::BadBudget(format!(
                "branch `{to}` has no cap of its own to move budget to; it is limited only by the fork's and the account's caps"
            )));
        };
        let movable = (from_cap - from_spent - held).max(0.0);
        if usd > movable + EPSILON {
            return Err(CoordinatorError::BadBudget(format!(
                "branch `{from}` can give at most {} (cap {}, spent {}, reserved {}); asked for {}",
                money(movable),
                money(from_cap),
                money(from_spent),
                money(held),
                money(usd)
            )));
        }
        self.store
            .put_cap(fork_id, Some(from_run), from_cap - usd)?;
        self.store.put_cap(fork_id, Some(to_run), to_cap + usd)?;
        if let Some(r) = s.runs.get_mut(&from_run) {
            r.cap = Some(from_cap - usd);
        }
        if let Some(r) = s.runs.get_mut(&to_run) {
            r.cap = Some(to_cap + usd);
        }
        tracing::info!(fork.id = %fork_id, from, to, usd, "budget.move");
        Ok(Self::take_resumable(
            &mut s,
            &[fork_id],
            &[Level::Branch],
            Some(to_run),
        ))
    }

    /// Create an account or change its cap. Returns its view and the paused branches to
    /// resume (a raised or removed cap resumes what it paused).
    pub fn account_set(
        &self,
        name: &str,
        cap_usd: Option<f64>,
    ) -> Result<(AccountView, Vec<(ForkId, RunId)>), CoordinatorError> {
        check_account_name(name)?;
        if let Some(cap) = cap_usd {
            check_usd("--cap", cap, true)?;
        }
        let mut s = self.lock();
        let record = match s.accounts.get(name) {
            Some(a) => AccountRecord {
                cap_usd,
                ..a.record.clone()
            },
            None => AccountRecord {
                name: name.to_string(),
                cap_usd,
                created_at_ms: now_ms(),
            },
        };
        self.store.put_account(&record)?;
        let spent = s.account_spent(name);
        let reserved = s.reserved(|r| r.account.as_deref() == Some(name));
        let room = cap_usd.is_none_or(|c| c > spent + reserved + EPSILON);
        s.accounts.insert(
            name.to_string(),
            AccountState {
                record,
                exhausted: !room,
            },
        );
        let resume = if room {
            let forks: Vec<ForkId> = s
                .forks
                .iter()
                .filter(|(_, f)| f.policy.account.as_deref() == Some(name))
                .map(|(id, _)| *id)
                .collect();
            Self::take_resumable(&mut s, &forks, &[Level::Account], None)
        } else {
            Vec::new()
        };
        let view = s
            .accounts
            .get(name)
            .map(|a| s.account_view(a))
            .ok_or_else(|| CoordinatorError::Internal("account vanished".into()))?;
        tracing::info!(account = %name, cap = ?cap_usd, "budget.account_set");
        Ok((view, resume))
    }

    pub fn accounts(&self) -> Vec<AccountView> {
        let s = self.lock();
        s.accounts.values().map(|a| s.account_view(a)).collect()
    }

    /// Send the commands of `actions` (in the background: callers hold actor state).
    pub fn send(&self, actions: Actions) {
        if actions.is_empty() {
            return;
        }
        let bus = self.bus.clone();
        tokio::spawn(async move {
            let sends = actions.controls.into_iter().map(|c| {
                let bus = bus.clone();
                async move {
                    let run = c.run_id;
                    match wire::encode(&c) {
                        Ok(bytes) => {
                            if let Err(e) = bus.send_control(run, bytes).await {
                                tracing::warn!(run.id = %run, error = %e, "budget: cannot send a stop");
                            }
                        }
                        Err(e) => tracing::error!(error = %e, "budget: cannot encode a stop"),
                    }
                }
            });
            futures::future::join_all(sends).await;
        });
    }
}
