//! Who may act on what (ADR 17): the accounts a [`Caller`] may use, and the checks every
//! handler of `crate::api` makes before it acts.
//!
//! - [`Caller::Admin`] (operators, the unrestricted set-up, the embedded mode) and
//!   [`Caller::Worker`] (the agents' fork tools) act on every fork.
//! - A scoped client `alice` ([`Caller::Client`]) may use the account `alice` and the
//!   accounts its grant names (`[access."alice"] accounts = ["team-a"]` in the
//!   coordinator's config). Its fork without an account charges `alice` (created without a
//!   cap on first use; an operator caps it with `forkfleet account set`); naming an account
//!   it may not use is refused.
//! - A fork of an account the client may not use, and every run of such a fork, is
//!   `not_found`, exactly like a fork that does not exist: nothing says it exists. Root runs
//!   (no fork) are an operator's: `not_found` to scoped clients.
//! - Listings (`forks`, `accounts`) show a scoped client what it may use only.
//! - Changing an account's cap (`account_set`) is an operator's (admin only).

use crate::error::CoordinatorError;
use crate::handle::CoordinatorHandle;
use crate::prefix::{keyed, matching, matching_by, one_fork, one_run};
use forkfleet_shared::api::{Caller, CreateFork, ForkView};
use forkfleet_shared::budget::AccountView;
use forkfleet_shared::ids::{ForkId, RunId};
use std::collections::{BTreeMap, BTreeSet};

/// The accounts each client identity may use besides its own (`[access."ID"] accounts`).
pub type Grants = BTreeMap<String, BTreeSet<String>>;

impl CoordinatorHandle {
    /// The accounts `caller` may use; `None`: every account (and forks without one).
    pub(crate) fn usable_accounts(&self, caller: &Caller) -> Option<BTreeSet<String>> {
        let identity = caller.identity()?;
        let mut accounts = self
            .config()
            .access
            .get(identity)
            .cloned()
            .unwrap_or_default();
        accounts.insert(identity.to_string());
        Some(accounts)
    }

    /// May `caller` act on a fork charging `account`?
    fn may_use(&self, caller: &Caller, account: Option<&str>) -> bool {
        match self.usable_accounts(caller) {
            None => true,
            Some(usable) => account.is_some_and(|a| usable.contains(a)),
        }
    }

    /// `Ok` when `caller` may act on fork `id`; `UnknownFork` when it may not (as if the
    /// fork did not exist) or the fork does not exist.
    pub(crate) async fn admit_fork(
        &self,
        caller: &Caller,
        id: ForkId,
    ) -> Result<(), CoordinatorError> {
        if self.usable_accounts(caller).is_none() {
            return Ok(());
        }
        let record = self.blocking(move |s| s.fork(id)).await?;
        match record {
            Some(f) if self.may_use(caller, f.plan.budget.account.as_deref()) => Ok(()),
            _ => Err(CoordinatorError::UnknownFork(id.to_string())),
        }
    }

    /// `Ok` when `caller` may act on run `run` (a branch run of a fork it may act on);
    /// `UnknownRun` otherwise.
    pub(crate) async fn admit_run(
        &self,
        caller: &Caller,
        run: RunId,
    ) -> Result<(), CoordinatorError> {
        if self.usable_accounts(caller).is_none() {
            return Ok(());
        }
        let fork = self.run_record(run).await?.fork_id;
        match fork {
            Some(fork) if self.admit_fork(caller, fork).await.is_ok() => Ok(()),
            _ => Err(CoordinatorError::UnknownRun(run)),
        }
    }

    /// The live workers, each with the running branches `caller` may see (a scoped
    /// client: those of its accounts' forks; a run it may not see is not found to it).
    pub(crate) async fn workers_for(
        &self,
        caller: &Caller,
    ) -> Result<Vec<forkfleet_shared::protocol::WorkerInfo>, CoordinatorError> {
        let mut workers = self.bus().workers().await?;
        if self.usable_accounts(caller).is_some() {
            for w in &mut workers {
                let mut mine = Vec::with_capacity(w.running.len());
                for run in std::mem::take(&mut w.running) {
                    if self.admit_run(caller, run).await.is_ok() {
                        mine.push(run);
                    }
                }
                w.running = mine;
            }
        }
        Ok(workers)
    }

    /// `Ok` for an operator; a `bad_input` error naming `what` for anyone else.
    pub(crate) fn admit_admin(&self, caller: &Caller, what: &str) -> Result<(), CoordinatorError> {
        match caller {
            Caller::Admin => Ok(()),
            other => Err(CoordinatorError::BadRequest(format!(
                "{what} is for operators only ({other} may not); ask an operator, who uses the admin credentials"
            ))),
        }
    }

    /// The fork `caller` creates: a scoped client's fork without an account charges the
    /// client's own account (created without a cap if missing); an account it may not use
    /// is refused.
    pub(crate) async fn scope_create(
        &self,
        caller: &Caller,
        mut req: CreateFork,
    ) -> Result<CreateFork, CoordinatorError> {
        let (Some(identity), Some(usable)) = (caller.identity(), self.usable_accounts(caller))
        else {
            return Ok(req);
        };
        // A fork of an existing run is of a run the caller may act on: another tenant's
        // would start from its conversation and merge into its files.
        match req.parent {
            forkfleet_shared::api::ParentRun::New => {}
            forkfleet_shared::api::ParentRun::Existing { run_id }
            | forkfleet_shared::api::ParentRun::Branch { run_id, .. } => {
                self.admit_run(caller, run_id).await?
            }
        }
        let account = req
            .plan
            .budget
            .account
            .get_or_insert_with(|| identity.to_string())
            .clone();
        if !usable.contains(&account) {
            return Err(CoordinatorError::BadRequest(format!(
                "{caller} may not charge account `{account}`; accounts it may use: {} (an operator grants more with [access.\"{identity}\"] accounts in the coordinator's config)",
                usable.iter().map(|a| format!("`{a}`")).collect::<Vec<_>>().join(", ")
            )));
        }
        if account == identity && self.ledger().check_account(&account).is_err() {
            self.account_set(&account, None).await?;
            tracing::info!(account = %account, "budget.account created for its client identity (no cap)");
        }
        Ok(req)
    }

    /// Every fork `caller` may act on, newest first.
    pub(crate) async fn forks_for(
        &self,
        caller: &Caller,
    ) -> Result<Vec<ForkView>, CoordinatorError> {
        let forks = self.forks().await?;
        if self.usable_accounts(caller).is_none() {
            return Ok(forks);
        }
        let mut out = Vec::with_capacity(forks.len());
        for f in forks {
            if self.admit_fork(caller, f.fork_id).await.is_ok() {
                out.push(f);
            }
        }
        Ok(out)
    }

    /// Every run `caller` may see: all for an operator; for a client, the runs of forks
    /// of its accounts (root runs are not theirs, as for every operation).
    pub(crate) async fn runs_for(
        &self,
        caller: &Caller,
    ) -> Result<Vec<forkfleet_shared::api::RunView>, CoordinatorError> {
        let runs = self.runs().await?;
        if self.usable_accounts(caller).is_none() {
            return Ok(runs);
        }
        let mut out = Vec::with_capacity(runs.len());
        for r in runs {
            if let Some(fork) = r.fork_id {
                if self.admit_fork(caller, fork).await.is_ok() {
                    out.push(r);
                }
            }
        }
        Ok(out)
    }

    /// Every account `caller` may use, by name.
    pub(crate) async fn accounts_for(
        &self,
        caller: &Caller,
    ) -> Result<Vec<AccountView>, CoordinatorError> {
        let accounts = self.accounts().await?;
        Ok(match self.usable_accounts(caller) {
            None => accounts,
            Some(usable) => accounts
                .into_iter()
                .filter(|a| usable.contains(&a.name))
                .collect(),
        })
    }

    /// A fork by id or prefix, among those `caller` may act on: a scoped client's prefix
    /// is matched against its own forks only, so an ambiguity never names another
    /// account's fork.
    pub(crate) async fn find_fork_for(
        &self,
        caller: &Caller,
        prefix: &str,
    ) -> Result<ForkId, CoordinatorError> {
        // The start of an id, then a name, then the end of an id (a name like `cafe` is
        // the fork of that name, not one whose id ends so).
        let found = if self.usable_accounts(caller).is_none() {
            self.find_fork(prefix).await
        } else {
            let ids = keyed(self.forks_for(caller).await?.into_iter().map(|f| f.fork_id));
            one_fork(&matching_by(ids, prefix, false), prefix)
        };
        match found {
            // Not an id's start: a fork's name (the newest fork of that name the caller
            // may see), else the end of an id.
            Err(CoordinatorError::UnknownFork(_)) => {
                let forks = self.forks_for(caller).await?;
                let named = forks
                    .iter()
                    .filter(|f| f.name.as_deref() == Some(prefix))
                    .max_by_key(|f| f.created_at_ms);
                match named {
                    Some(f) => Ok(f.fork_id),
                    None => {
                        let ids = keyed(forks.iter().map(|f| f.fork_id));
                        one_fork(&matching_by(ids, prefix, true), prefix)
                    }
                }
            }
            other => other,
        }
    }

    /// A run by id or prefix, among those `caller` may act on: a scoped client's prefix is
    /// matched against the branch runs of its own forks only.
    pub(crate) async fn find_run_for(
        &self,
        caller: &Caller,
        prefix: &str,
    ) -> Result<RunId, CoordinatorError> {
        if self.usable_accounts(caller).is_none() {
            return self.find_run(prefix).await;
        }
        let runs = self
            .forks_for(caller)
            .await?
            .into_iter()
            .flat_map(|f| f.branches.into_iter().map(|b| b.run_id));
        one_run(&matching(runs, prefix), prefix)
    }
}
