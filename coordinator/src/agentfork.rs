//! Forks made by agents (the fork tools; ADR 14).
//!
//! An agent running in a branch forks its own run with `fork_run`: the coordinator makes
//! the new fork's plan from the plan of the fork the agent's run belongs to (goal, models,
//! limits, budget policy, resolve settings, tools) with the branches the agent asked for,
//! and creates it like any other fork, its parent being the agent's run cut at the model
//! response that asked for the fork. `max_depth` holds: the agent's run is one level deeper
//! than its fork's parent, so a fork past the limit is refused (the agent sees the error).
//!
//! Such a fork merges into the agent's branch, not into a root run:
//! - while the agent runs, its `merge_or_select` marks the fork merged and gets the winner's
//!   change log back ([`CoordinatorHandle::agent_merge`]), which the agent replays onto its
//!   overlay and publishes as its own file changes (its worker is the only writer of its log);
//! - once the agent has finished, `forkfleet fork merge` does the same on its behalf: the
//!   branch's fork actor replays the change log onto the branch's replica and appends the
//!   file changes and a summary to the branch's log ([`CoordinatorHandle::merge`]);
//! - while the agent runs, a merge from outside is refused: it would race the agent.

use crate::error::{list, CoordinatorError};
use crate::handle::CoordinatorHandle;
use forkfleet_shared::api::{AgentFork, CreateFork, ForkView, MergeOutcome, ParentRun};
use forkfleet_shared::ids::{ForkId, RunId};
use forkfleet_shared::spec::{normalise_labels, BranchPlan, ForkPlan, SpecError};
use std::time::Duration;

/// How long an agent's fork waits for the coordinator's copy of the agent's log to reach
/// the fork point (events stream in asynchronously; normally it is there already).
const LOG_WAIT: Duration = Duration::from_secs(15);

impl CoordinatorHandle {
    /// Create the fork an agent asked for (see the module docs).
    pub async fn agent_fork(&self, req: AgentFork) -> Result<ForkView, CoordinatorError> {
        let parent_run = req.parent_run;
        let Some(fork_id) = self.run_record(parent_run).await?.fork_id else {
            return Err(CoordinatorError::RootRunForks { run: parent_run });
        };
        let (parent_fork, model) = self
            .blocking(move |s| {
                let fork = s
                    .fork(fork_id)?
                    .ok_or_else(|| CoordinatorError::UnknownFork(fork_id.to_string()))?;
                let agent = s
                    .branches(fork_id)?
                    .into_iter()
                    .find(|b| b.run_id == parent_run);
                let model = agent
                    .as_ref()
                    .map_or_else(|| fork.plan.model.clone(), |b| b.model.clone());
                Ok((fork, (model, agent.map(|b| b.index as usize))))
            })
            .await?;
        let (model, index) = model;
        // The agent's forks wait for consent as the agent itself does.
        let approval = index
            .and_then(|i| parent_fork.plan.branches.get(i))
            .and_then(|b| parent_fork.plan.approval_for(b))
            .cloned();
        let mut plan = child_plan(&parent_fork.plan, &model, &req)?;
        plan.approval = approval;
        self.wait_for_log(parent_fork.fork_id, parent_run, req.cutoff_seq)
            .await?;
        self.create_fork(CreateFork {
            plan,
            parent: ParentRun::Branch {
                run_id: parent_run,
                cutoff_seq: req.cutoff_seq,
            },
            snapshot: req.snapshot,
            workspace: parent_fork.workspace.clone(),
            left_out: None,
            git: None,
        })
        .await
    }

    /// The agent of `parent_run` merges branch `pick` of the fork it made: the fork is
    /// recorded as merged and the winner's change log returned for the agent to apply.
    pub async fn agent_merge(
        &self,
        fork: ForkId,
        pick: &str,
        parent_run: RunId,
    ) -> Result<MergeOutcome, CoordinatorError> {
        let handle = self.fork_handle(fork).await?;
        let view = handle.view().await?;
        if view.parent_run != parent_run {
            return Err(CoordinatorError::NotMadeByRun {
                fork,
                run: parent_run,
            });
        }
        handle.merge_into_agent(pick.to_string()).await
    }

    /// Wait, bounded, until the coordinator's copy of `run`'s log (a branch of `fork`)
    /// reaches `seq`: the fork actor's view says how far each branch's log goes, and its
    /// version channel says when that may have changed.
    pub(crate) async fn wait_for_log(
        &self,
        fork: ForkId,
        run: RunId,
        seq: u64,
    ) -> Result<(), CoordinatorError> {
        let deadline = tokio::time::Instant::now() + LOG_WAIT;
        loop {
            let handle = self.fork_handle(fork).await?;
            let mut versions = handle.subscribe().await?;
            versions.borrow_and_update();
            let view = handle.view().await?;
            // `events` is the branch's next seq: its log holds seqs below it.
            if view
                .branches
                .iter()
                .any(|b| b.run_id == run && b.events > seq)
            {
                return Ok(());
            }
            // A closed channel (the fork actor restarting) just looks again.
            if tokio::time::timeout_at(deadline, versions.changed())
                .await
                .is_err()
            {
                return Err(CoordinatorError::Timeout {
                    what: "the agent's log reaching the fork point",
                    ms: LOG_WAIT.as_millis() as u64,
                });
            }
        }
    }
}

/// The plan of a fork an agent asks for, from the plan of the fork its run belongs to.
fn child_plan(
    parent: &ForkPlan,
    parent_model: &str,
    req: &AgentFork,
) -> Result<ForkPlan, CoordinatorError> {
    if req.branches.is_empty() {
        return Err(CoordinatorError::NoAgentBranches);
    }
    let labels = normalise_labels(req.branches.iter().map(|b| Some(b.label.as_str())))?;
    let mut branches = Vec::with_capacity(req.branches.len());
    for (b, label) in req.branches.iter().zip(labels) {
        let model = b.model.clone().unwrap_or_else(|| parent_model.to_string());
        if !parent.models.contains_key(&model) {
            return Err(CoordinatorError::UnknownModel {
                label,
                model,
                valid: list(parent.models.keys()),
            });
        }
        if b.steer.trim().is_empty() {
            return Err(CoordinatorError::MissingSteer { label });
        }
        branches.push(BranchPlan {
            label,
            steer: b.steer.clone(),
            model,
            budget_usd: b.budget_usd,
            extra_instructions: b.extra_instructions.clone(),
            max_turns: parent.limits.max_turns,
            max_output_tokens: None,
            temperature: None,
            approval: None,
        });
    }
    if branches.len() > parent.limits.max_branches {
        return Err(SpecError::TooManyBranches {
            requested: branches.len(),
            max: parent.limits.max_branches,
        }
        .into());
    }
    let mut resolve = parent.resolve.clone();
    if let Some(strategy) = &req.strategy {
        resolve.strategy = strategy.clone();
    }
    Ok(ForkPlan {
        name: None,
        goal: parent.goal.clone(),
        system_prompt: None,
        history: Vec::new(),
        model: parent_model.to_string(),
        limits: parent.limits,
        conflict_policy: parent.conflict_policy,
        aggregate_budget_usd: req.aggregate_budget_usd,
        budget: parent.budget.clone(),
        resolve,
        models: parent.models.clone(),
        branches,
        tools: parent.tools.clone(),
        approval: None,
        solo: false,
    })
}
