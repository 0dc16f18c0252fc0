//! The budget ledger: branch, fork and account caps, the money spent under each and the
//! money reserved for calls in flight. One per coordinator, shared by the fork actors (which
//! settle usage as they apply events), the reservation service and the API.
//!
//! - **Spent** comes from `usage` events: applied ones (exactly once, by (run, seq)) and
//!   those of fenced attempts (exactly once, by (run, attempt, seq), ADR 18); on start
//!   each fork actor registers its branches with the spend rebuilt from their logs. An
//!   account's spend is the sum of its forks'.
//! - **Reserved** is the sum of live reservations. A reservation is made by
//!   [`Ledger::reserve`] (strict mode, before a call), persisted before it is granted, and
//!   ends when the call's `usage` event names it (settled at the actual cost; a fenced
//!   attempt's usage settles it too), when its branch stops or pauses, or when it expires
//!   ([`Ledger::expire`]). A takeover does not end the earlier attempt's reservations: its
//!   worker may only have been paused, and its call may still be paid for (ADR 18).
//! - A call is granted only if `spent + reserved + estimate <= cap` at the branch, its fork
//!   and its account at once, so money is spent only inside a reservation and the sum of
//!   what calls really cost stays under every cap (up to the estimate being an upper bound).
//! - The first call a fork's or an account's cap cannot hold marks that cap **exhausted**:
//!   every branch under it is stopped (or paused), and it refuses everything until raised.
//!   In best-effort mode the same happens when a `usage` event takes the spend to the cap.
//! - Caps changed after creation (top-ups, moves) are written to the store's `caps` tree.
//! - Time (when a reservation expires) comes from the ledger's [`Clock`], the system's
//!   unless a test gives it a manual one ([`Ledger::open`]).
//!
//! This file holds the ledger's state and its costs, registering forks, settling usage,
//! branch state changes and fences, and sending stops; `budget/reserve.rs` reservations
//! (grant, cancel, expiry), `budget/caps.rs` top-ups, moves and accounts,
//! `budget/service.rs` the reservation service, `budget/metrics.rs` the ledger's gauges.

mod caps;
pub(crate) mod metrics;
mod reserve;
mod service;
#[cfg(test)]
mod tests;

pub(crate) use service::start;

use crate::error::{list, CoordinatorError};
use crate::store::{AccountRecord, BranchRecord, ForkRecord, ReservationRecord, RunStore};
use forkfleet_bus::Bus;
use forkfleet_shared::budget::{
    overrun, remaining, AccountView, BranchCost, BudgetMode, BudgetPolicy, ForkCost, OnExhausted,
};
use forkfleet_shared::clock::Clock;
use forkfleet_shared::ids::{ForkId, ReservationId, RunId};
use forkfleet_shared::metrics::catalog;
use forkfleet_shared::protocol::{Control, ControlCommand};
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
    /// Model calls paid for (`usage` events, fenced ones included).
    calls: u32,
    /// Model calls a replay served from the record.
    cached_calls: u32,
    state: BranchState,
    /// The latest task attempt that took the branch over (every attempt above 1 is fenced
    /// in through `coord.resume`): attempts below it get no new reservations, and a task
    /// resuming the branch starts above it.
    min_attempt: u32,
    /// A stop or pause was sent and the branch has not stopped yet.
    stopping: bool,
    /// The cap that last stopped or refused it (what a top-up must raise to resume it).
    blocked_by: Option<Level>,
    stopped_at_ms: Option<u64>,
    /// The least its latest reservation request needed (`None` before its first): whether
    /// it may still fit under its fork's cap when another branch no longer does.
    last_least: Option<f64>,
    /// Since when it has been told to wait for room (ledger clock), while it is.
    waiting_since: Option<u64>,
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
    /// How long a branch may be told to wait for room before it is refused instead
    /// ([`MAX_WAIT_MS`]).
    max_wait_ms: std::sync::atomic::AtomicU64,
}

/// How long a branch waits for room that calls in flight hold before it is refused: the
/// calls it waits for may belong to a worker that died, whose tasks cannot be taken over
/// while the waiting branches fill every worker's slots.
pub(crate) const MAX_WAIT_MS: u64 = 20_000;

impl State {
    fn reserved(&self, keep: impl Fn(&ReservationRecord) -> bool) -> f64 {
        self.reservations
            .values()
            .filter(|r| keep(r))
            .map(|r| r.usd)
            .fold(0.0, |a, b| a + b)
    }

    /// What the reservations `keep` selects hold, and what of it a live attempt holds (its
    /// branch's current attempt, the branch not finished): what may come back soon, when
    /// their calls settle. A superseded attempt's reservation (its worker lost, ADR 18) is
    /// left to expire and not counted as live. One pass over the reservations.
    fn reserved_and_live(&self, keep: impl Fn(&ReservationRecord) -> bool) -> (f64, f64) {
        self.reservations
            .values()
            .filter(|r| keep(r))
            .fold((0.0, 0.0), |(all, live), r| {
                let current = self
                    .runs
                    .get(&r.run_id)
                    .is_some_and(|run| r.attempt >= run.min_attempt && !run.state.is_terminal());
                (all + r.usd, if current { live + r.usd } else { live })
            })
    }

    /// Whether a branch of `fork_id` other than `run` may still fit `room` under the
    /// fork's cap: running, not told to stop, and either not asked yet or last needing no
    /// more than `room`.
    fn others_may_fit(&self, fork_id: ForkId, run: RunId, room: f64) -> bool {
        let Some(f) = self.forks.get(&fork_id) else {
            return false;
        };
        f.runs.iter().filter(|r| **r != run).any(|r| {
            self.runs.get(r).is_some_and(|b| {
                !b.state.is_terminal()
                    && b.state != BranchState::Paused
                    && !b.stopping
                    && b.last_least.is_none_or(|l| l <= room + EPSILON)
            })
        })
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
            overrun_usd: overrun(r.cap, r.spent),
            calls: r.calls,
            cached_calls: r.cached_calls,
            stopped_at_ms: r.stopped_at_ms,
            usage: Default::default(),
            cache_saved_usd: 0.0,
            unpriced_model: None,
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
            overrun_usd: overrun(f.cap, f.spent),
            crossed_at_ms: f.crossed_at_ms,
            branches: f.runs.iter().filter_map(|r| self.branch_cost(*r)).collect(),
            account: f
                .policy
                .account
                .as_deref()
                .and_then(|n| self.accounts.get(n))
                .map(|a| self.account_view(a)),
            judge_cost_usd: 0.0,
            judge_unpriced: Vec::new(),
            judge_usage: Default::default(),
            usage: Default::default(),
            cache_saved_usd: 0.0,
        })
    }
}

fn money(v: f64) -> String {
    format!("${v:.6}")
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
            max_wait_ms: std::sync::atomic::AtomicU64::new(MAX_WAIT_MS),
        }))
    }

    /// Release every reservation held: their calls are known not to be in flight (the
    /// embedded system starting again, its workers gone with the process that held them).
    pub fn release_all(&self) {
        let released = self.lock().release_where(|_| true);
        if !released.is_empty() {
            tracing::info!(
                released = released.len(),
                "budget: reservations of calls that ended with the previous process released"
            );
        }
        self.forget(&released);
    }

    /// Set how long a branch may wait for room (tests: without a bound).
    #[cfg(test)]
    pub fn set_max_wait_ms(&self, ms: u64) {
        self.max_wait_ms
            .store(ms, std::sync::atomic::Ordering::Relaxed);
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
    /// A fork deleted (`gc`): its runs and totals leave the ledger. Only forks that charge
    /// no account are deleted, so no account's spend changes.
    pub fn forget_fork(&self, fork_id: ForkId) {
        let mut s = self.lock();
        if let Some(f) = s.forks.remove(&fork_id) {
            for run in f.runs {
                s.runs.remove(&run);
            }
        }
    }

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
                    calls: b.calls,
                    cached_calls: b.cached_calls,
                    state: b.state,
                    min_attempt: b.min_attempt,
                    stopping: false,
                    blocked_by: None,
                    stopped_at_ms: None,
                    last_least: None,
                    waiting_since: None,
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

    /// A `usage` event was applied, or one of a fenced attempt was first seen (ADR 18):
    /// charge its cost, settle its reservation, and in best-effort mode stop what crossed a
    /// cap.
    /// A call a replay served from the record: counted, nothing spent.
    pub fn on_cached(&self, run_id: RunId) {
        if let Some(run) = self.lock().runs.get_mut(&run_id) {
            run.cached_calls += 1;
        }
    }

    pub fn on_usage(
        &self,
        run_id: RunId,
        cost_usd: f64,
        reservation: Option<ReservationId>,
        model: &str,
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
        run.calls += 1;
        let (fork_id, run_cap, run_spent) = (run.fork, run.cap, run.spent);
        let Some(fork) = s.forks.get_mut(&fork_id) else {
            return out;
        };
        fork.spent += cost;
        let (mode, fork_cap, fork_spent) = (fork.policy.mode, fork.cap, fork.spent);
        let account = fork.policy.account.clone();
        // Monotonic, unlike the spend gauges that go with their fork: a day's spend is its
        // increase over the day.
        forkfleet_shared::metrics::catalog::add_cost(account.as_deref().unwrap_or(""), model, cost);
        // Past a cap: in strict mode only through estimation error; the branches are
        // stopped in either mode, as more calls cannot fit.
        if let Some(cap) = run_cap {
            if run_spent + EPSILON >= cap && mode == BudgetMode::BestEffort {
                let reason = format!(
                    "branch cap {} reached (when crossed: spent {})",
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
                    "fork cap {} reached (when crossed: spent {})",
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
                        "account `{name}` cap {} reached (when crossed: spent {})",
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

    /// A branch's state changed: a stopped or paused branch holds no reservations of its
    /// current attempt. Those of attempts a takeover superseded stay held until their
    /// usage settles them or they expire (their worker may still be making the call, ADR 18).
    pub fn on_state(&self, run_id: RunId, state: BranchState) {
        let mut s = self.lock();
        let Some(run) = s.runs.get_mut(&run_id) else {
            return;
        };
        if state.is_terminal() && !run.state.is_terminal() {
            catalog::BRANCHES_ENDED.inc(&[state.as_str()]);
        }
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
        let current = run.min_attempt;
        let released = s.release_where(|r| r.run_id == run_id && r.attempt >= current);
        drop(s);
        self.forget(&released);
    }

    /// A task attempt took the branch over: earlier attempts get no new reservations. Those
    /// they hold stay held (ADR 18): the worker that holds one may still be making its call
    /// (it was paused, not dead), so the money stays reserved until the call's `usage`
    /// settles it (counted even from a fenced attempt) or the reservation expires. Strict
    /// caps so hold across a takeover.
    pub fn on_fence(&self, run_id: RunId, attempt: u32) {
        let mut s = self.lock();
        if let Some(r) = s.runs.get_mut(&run_id) {
            r.min_attempt = r.min_attempt.max(attempt);
            // A stop sent to the earlier attempt does not reach this one, nor does the
            // time its waits for room took.
            r.stopping = false;
            r.waiting_since = None;
        }
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
