//! Changing caps after creation: top-ups of a branch's or a fork's cap, moving cap between
//! branches, and accounts' caps; each answers with the paused branches it lets resume.

use super::{money, AccountState, Ledger, Level, State, EPSILON};
use crate::error::{list, CoordinatorError};
use crate::store::AccountRecord;
use forkfleet_shared::budget::AccountView;
use forkfleet_shared::ids::{ForkId, RunId};
use forkfleet_shared::protocol::now_ms;
use forkfleet_shared::spec::check_account_name;
use forkfleet_shared::state::BranchState;

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
}
