//! The ledger's sums as gauges: per fork (spent, reserved, cap) while the fork is live and
//! for a grace period after every branch of it finished, per account, and the branches per
//! state over the same forks. Read by a collector the registry runs before each read
//! ([`forkfleet_shared::metrics::register_collector`]), so the gauges are as fresh as
//! the scrape.

use super::{Ledger, State};
use forkfleet_shared::ids::ForkId;
use forkfleet_shared::metrics::catalog as metrics;
use forkfleet_shared::metrics::{Gauge, GracePeriod, DEFAULT_FORK_GRACE};
use forkfleet_shared::state::BranchState;
use std::collections::{HashMap, HashSet};
use std::time::Duration;

/// What one ledger published: taken back when it is dropped (the coordinator stopped).
pub(crate) struct Published {
    grace: GracePeriod<ForkId>,
    /// This ledger's share of `forkfleet.branches` per state (the shares of several
    /// coordinators in one process, as in tests, add up).
    pub(super) branches: HashMap<&'static str, f64>,
    forks: HashSet<ForkId>,
    accounts: HashSet<String>,
}

impl Published {
    pub fn new(grace: Duration) -> Self {
        Self {
            grace: GracePeriod::new(grace),
            branches: HashMap::new(),
            forks: HashSet::new(),
            accounts: HashSet::new(),
        }
    }
}

impl Default for Published {
    fn default() -> Self {
        Self::new(DEFAULT_FORK_GRACE)
    }
}

impl Drop for Published {
    fn drop(&mut self) {
        for (state, n) in &self.branches {
            metrics::BRANCHES.add(&[state], -n);
        }
        for fork in &self.forks {
            remove_fork(*fork);
        }
        for account in &self.accounts {
            for g in [
                &metrics::ACCOUNT_SPENT,
                &metrics::ACCOUNT_RESERVED,
                &metrics::ACCOUNT_CAP,
            ] {
                g.remove(&[account]);
            }
        }
    }
}

fn remove_fork(fork: ForkId) {
    let id = fork.to_string();
    for g in [
        &metrics::FORK_SPENT,
        &metrics::FORK_RESERVED,
        &metrics::FORK_CAP,
    ] {
        g.remove(&[&id]);
    }
}

fn set_or_remove(gauge: &Gauge, label: &str, v: Option<f64>) {
    match v {
        Some(v) => gauge.set(&[label], v),
        None => gauge.remove(&[label]),
    }
}

impl Ledger {
    /// Bring the budget and branch gauges up to date (see the module documentation). The
    /// ledger is locked only to read its sums, not while the registry is written, so a
    /// scrape holds up no reservation.
    pub(crate) fn publish_metrics(&self, p: &mut Published) {
        let now = self.clock.now_ms();
        let mut branches: HashMap<&'static str, f64> = BranchState::ALL
            .iter()
            .map(|state| (state.as_str(), 0.0))
            .collect();
        // (fork, spent, reserved, cap) of the forks shown; (account, spent, reserved, cap).
        let mut fork_rows = Vec::with_capacity(p.forks.len());
        let mut account_rows = Vec::new();
        {
            let s = self.lock();
            let State {
                runs,
                forks,
                accounts,
                reservations,
            } = &*s;
            let mut fork_reserved: HashMap<ForkId, f64> = HashMap::new();
            let mut account_reserved: HashMap<&str, f64> = HashMap::new();
            for r in reservations.values() {
                *fork_reserved.entry(r.fork_id).or_default() += r.usd;
                if let Some(a) = &r.account {
                    *account_reserved.entry(a.as_str()).or_default() += r.usd;
                }
            }
            let mut account_spent: HashMap<&str, f64> = HashMap::new();
            for (id, f) in forks {
                if let Some(a) = &f.policy.account {
                    *account_spent.entry(a.as_str()).or_default() += f.spent;
                }
                let states: Vec<BranchState> = f
                    .runs
                    .iter()
                    .filter_map(|r| runs.get(r).map(|r| r.state))
                    .collect();
                let ended = states.iter().all(|st| st.is_terminal());
                if !p.grace.keep(id, ended, now) {
                    continue;
                }
                for st in states {
                    *branches.entry(st.as_str()).or_default() += 1.0;
                }
                let reserved = fork_reserved.get(id).copied().unwrap_or(0.0);
                fork_rows.push((*id, f.spent, reserved, f.cap));
            }
            p.grace.retain(|id| forks.contains_key(id));
            for (name, a) in accounts {
                let n = name.as_str();
                account_rows.push((
                    name.clone(),
                    account_spent.get(n).copied().unwrap_or(0.0),
                    account_reserved.get(n).copied().unwrap_or(0.0),
                    a.record.cap_usd,
                ));
            }
        }
        let mut shown = HashSet::with_capacity(fork_rows.len());
        for (id, spent, reserved, cap) in fork_rows {
            let label = id.to_string();
            metrics::FORK_SPENT.set(&[&label], spent);
            metrics::FORK_RESERVED.set(&[&label], reserved);
            set_or_remove(&metrics::FORK_CAP, &label, cap);
            shown.insert(id);
        }
        for gone in p.forks.difference(&shown) {
            remove_fork(*gone);
        }
        p.forks = shown;
        for (name, spent, reserved, cap) in account_rows {
            metrics::ACCOUNT_SPENT.set(&[&name], spent);
            metrics::ACCOUNT_RESERVED.set(&[&name], reserved);
            set_or_remove(&metrics::ACCOUNT_CAP, &name, cap);
            p.accounts.insert(name);
        }
        for (state, n) in &branches {
            let before = p.branches.get(state).copied().unwrap_or(0.0);
            if *n != before {
                metrics::BRANCHES.add(&[state], n - before);
            } else {
                // Present at zero, so every state is listed.
                metrics::BRANCHES.add(&[state], 0.0);
            }
        }
        p.branches = branches;
    }
}
