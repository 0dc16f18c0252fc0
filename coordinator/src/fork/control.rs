//! Commands to a fork's branches: enqueuing their tasks again (a resume, a follow-up turn,
//! ADR 13), steering one, terminating one, and aborting the fork.

use super::{ForkState, Requeue};
use crate::create;
use crate::error::CoordinatorError;
use crate::store::Queued;
use forkfleet_shared::api::{AbortOutcome, ContinueOutcome, SteerOutcome, TerminateOutcome};
use forkfleet_shared::event::{history_events, interrupted_results, messages_from_events, Event};
use forkfleet_shared::ids::RunId;
use forkfleet_shared::protocol::{now_ms, Control, ControlCommand};
use forkfleet_shared::state::{BranchState, ForkState as ForkPhase};
use forkfleet_shared::wire;

impl ForkState {
    /// Enqueue, on `pool`, a task that runs branch `i` next: taken over from its log
    /// (above every attempt before it, see [`ForkState::attempt_base`]), with its cap
    /// after top-ups. The answer is the task's `attempt_base`.
    pub(super) async fn enqueue(&mut self, i: usize, pool: &str) -> Result<u32, CoordinatorError> {
        let fork_id = self.record.fork_id;
        let b = &self.branches[i].record;
        let Some(plan) = self.record.plan.branches.get(b.index as usize) else {
            return Err(CoordinatorError::Internal(format!(
                "branch `{}` has no plan in fork {fork_id}",
                b.label
            )));
        };
        let run_id = b.run_id;
        let mut task = create::branch_task(
            &self.record.plan,
            plan,
            create::BranchIds {
                fork_id,
                run_id,
                index: b.index,
            },
            self.record.prefix,
            self.record.snapshot,
            b.first_seq,
        );
        task.attempt_base = self.attempt_base(i);
        task.budget_usd = self.ledger.run_cap(run_id);
        task.replay = self.record.replay.clone();
        task.fork_root = self.store.run(self.record.parent_run)?.map(|r| r.fork_root);
        self.bus.enqueue_task(pool, wire::encode(&task)?).await?;
        self.requeued.insert(run_id);
        // Where the branch stood, so that a death of this task is judged against it.
        let b = &mut self.branches[i].record;
        b.queued = Some(Queued {
            at_ms: now_ms(),
            turns: b.turns,
            requeues: b.queued.map_or(0, |q| q.requeues),
            attempt_base: task.attempt_base,
        });
        self.store.put_branch(b)?;
        Ok(task.attempt_base)
    }

    /// Stop every branch still going when the fork's account passed its blob quota
    /// ([`ForkState::over_quota`]), saying why.
    pub(super) async fn stop_over_quota(&mut self) {
        let Some(reason) = self.over_quota.take() else {
            return;
        };
        if self.stop_unfinished(&reason).await {
            tracing::warn!(fork.id = %self.record.fork_id, reason = %reason, "fork.blob_quota: branches stopped");
            self.check_settled();
            self.bump();
        }
    }

    /// Stop every branch not yet finished, for `reason`, and flush: true when one was.
    pub(super) async fn stop_unfinished(&mut self, reason: &str) -> bool {
        let fork_id = self.record.fork_id;
        let mut ended = false;
        for i in 0..self.branches.len() {
            if self.branches[i].record.state.is_terminal() {
                continue;
            }
            match self.stop_branch(i, reason.to_string()).await {
                Ok(()) => ended = true,
                Err(e) => {
                    tracing::warn!(fork.id = %fork_id, branch.label = %self.branches[i].record.label, error = %e, "fork.stop: cannot stop a branch")
                }
            }
        }
        if ended {
            if let Err(e) = self.store.flush_async().await {
                tracing::warn!(fork.id = %fork_id, error = %e, "fork.stop: cannot flush the stopped branches");
            }
        }
        ended
    }

    /// Stop branch `i` and end it here, whether or not a worker runs it (ADR 18): a
    /// pending or running one is first sent a terminate command (its worker, if any, stops
    /// at once, cancelling its call in flight, and settles its task), then the branch is
    /// fenced off and its `terminated` status appended under the fence, in the store but
    /// not flushed: the caller flushes once for all it stopped. A terminate that cannot be
    /// sent is logged; the branch ends all the same (a worker still running it finds its
    /// lease superseded at its next takeover or its events dropped).
    pub(super) async fn stop_branch(
        &mut self,
        i: usize,
        reason: String,
    ) -> Result<(), CoordinatorError> {
        let run = self.branches[i].record.run_id;
        // A stopped branch (paused, waiting for approval, idle) has no worker to tell.
        if !self.branches[i].record.state.is_stopped() {
            if let Err(e) = self.send_terminate(i, reason.clone()).await {
                tracing::warn!(fork.id = %self.record.fork_id, run.id = %run, error = %e, "fork.stop_branch: cannot send terminate; the branch is ended here all the same");
            }
        }
        self.end_branch(run, BranchState::Terminated, reason)?;
        self.requeued.remove(&run);
        Ok(())
    }

    /// Enqueue a task for each branch of `runs` that `which` selects, taking it over from
    /// its log (above every attempt before it) with its cap after top-ups. A branch no
    /// worker has started yet starts afresh.
    pub(super) async fn resume(
        &mut self,
        pool: &str,
        which: Requeue,
    ) -> Result<usize, CoordinatorError> {
        let runs: Vec<RunId> = match which {
            Requeue::Paused(runs) => runs
                .into_iter()
                .filter(|r| {
                    self.by_run
                        .get(r)
                        .is_some_and(|&i| self.branches[i].record.state == BranchState::Paused)
                })
                .collect(),
            Requeue::Unfinished if self.record.state.is_resolved() => Vec::new(),
            Requeue::Unfinished => self
                .branches
                .iter()
                .filter(|b| matches!(b.record.state, BranchState::Pending | BranchState::Running))
                .map(|b| b.record.run_id)
                .collect(),
        };
        let mut sent = 0;
        for run in runs {
            let Some(&i) = self.by_run.get(&run) else {
                continue;
            };
            // A second top-up before the worker took the first task over must not start a
            // second worker on the branch.
            if self.requeued.contains(&run) {
                continue;
            }
            let attempt_base = self.enqueue(i, pool).await?;
            let b = &self.branches[i].record;
            tracing::info!(fork.id = %self.record.fork_id, branch.label = %b.label, branch.state = %b.state, attempt_base, "fork.resume: a branch was enqueued again");
            sent += 1;
        }
        Ok(sent)
    }

    /// Send branch `i` a terminate command, addressed to the attempt that runs it like
    /// every command (a later attempt, or a later turn's worker re-reading the run's
    /// control stream on NATS, ignores it). Should that worker be lost before it obeys,
    /// the attempt that takes the branch over finds it ended (see [`ForkState::fence`]).
    async fn send_terminate(&mut self, i: usize, reason: String) -> Result<(), CoordinatorError> {
        let run_id = self.branches[i].record.run_id;
        let control = Control {
            run_id,
            command: ControlCommand::Terminate {
                reason: reason.clone(),
            },
            attempt: Some(self.current_attempt(i)),
        };
        self.bus
            .send_control(run_id, wire::encode(&control)?)
            .await?;
        self.stopping.insert(run_id, reason);
        Ok(())
    }

    /// Stop one branch. A branch already terminal is left as it is (`sent: false`).
    pub(super) async fn terminate(
        &mut self,
        label: &str,
    ) -> Result<TerminateOutcome, CoordinatorError> {
        let fork_id = self.record.fork_id;
        let i = self.branch_index(label)?;
        let b = &self.branches[i].record;
        let (run_id, state) = (b.run_id, b.state);
        let sent = !state.is_terminal();
        if sent {
            self.stop_branch(i, format!("terminated by request (fork {fork_id})"))
                .await?;
            self.store.flush_async().await?;
        }
        tracing::info!(fork.id = %fork_id, branch.label = %label, branch.state = %state, sent, "fork.terminate");
        Ok(TerminateOutcome {
            fork_id,
            label: label.to_string(),
            run_id,
            state,
            sent,
        })
    }

    /// Send branch `label` a steering message: a control command addressed to the attempt
    /// that runs it (or will: a pending branch's worker reads it when it starts). The worker
    /// applies it before its next model call and publishes it as a `steer` event. Only a
    /// pending or running branch can be steered; nothing is sent anywhere else.
    pub(super) async fn steer(
        &mut self,
        label: &str,
        text: String,
    ) -> Result<SteerOutcome, CoordinatorError> {
        let fork_id = self.record.fork_id;
        let i = self.branch_index(label)?;
        if text.trim().is_empty() {
            return Err(CoordinatorError::EmptyMessage {
                what: "steering message",
            });
        }
        let b = &self.branches[i].record;
        let (run_id, state) = (b.run_id, b.state);
        match state {
            BranchState::Pending | BranchState::Running => {}
            BranchState::Paused => {
                return Err(CoordinatorError::SteerPaused {
                    fork: fork_id,
                    label: label.to_string(),
                })
            }
            BranchState::AwaitingApproval => return Err(self.awaiting(i)),
            _ => {
                return Err(CoordinatorError::SteerFinished {
                    fork: fork_id,
                    label: label.to_string(),
                    state,
                })
            }
        }
        if self.record.state.is_resolved() {
            return Err(CoordinatorError::SteerStopping {
                fork: fork_id,
                phase: self.record.state.as_str(),
            });
        }
        let attempt = self.current_attempt(i);
        // A branch whose task waits for a worker (a follow-up, a resume): no worker reads
        // its commands yet, so the steer goes into its log, where the worker that takes it
        // over reads its history.
        if self.requeued.contains(&run_id) {
            self.append_own(i, vec![Event::Steer { text }])?;
            self.store.flush_async().await?;
            tracing::info!(fork.id = %fork_id, branch.label = %label, branch.state = %state, "fork.steer: recorded in the log of a branch whose task waits for a worker");
            return Ok(SteerOutcome {
                fork_id,
                label: label.to_string(),
                run_id,
                state,
                attempt,
            });
        }
        let control = Control {
            run_id,
            command: ControlCommand::Steer { text },
            attempt: Some(attempt),
        };
        self.bus
            .send_control(run_id, wire::encode(&control)?)
            .await?;
        tracing::info!(fork.id = %fork_id, branch.label = %label, branch.state = %state, attempt, "fork.steer: sent");
        if let ControlCommand::Steer { text } = &control.command {
            self.unapplied_steers
                .entry(run_id)
                .or_default()
                .push_back(text.clone());
        }
        Ok(SteerOutcome {
            fork_id,
            label: label.to_string(),
            run_id,
            state,
            attempt,
        })
    }

    /// The checks of a follow-up on branch `i` (ADR 13): the fork is open or settled and
    /// not being merged or resolved; the branch finished `done`, `failed` or `terminated`
    /// (stopped by a cap: only once the cap has room again).
    fn check_follow_up(&self, i: usize) -> Result<(), CoordinatorError> {
        let fork_id = self.record.fork_id;
        match &self.record.state {
            ForkPhase::Merged { winner } => {
                return Err(CoordinatorError::ContinueMerged {
                    fork: fork_id,
                    winner: winner.clone(),
                })
            }
            ForkPhase::Aborted => return Err(CoordinatorError::ContinueAborted(fork_id)),
            ForkPhase::Open | ForkPhase::Settled => {}
        }
        self.check_not_busy("continue its branches (if it does not merge)")?;
        let b = &self.branches[i].record;
        let label = &b.label;
        match b.state {
            BranchState::Done
            | BranchState::Failed
            | BranchState::Terminated
            | BranchState::Truncated
            | BranchState::Refused
            | BranchState::Idle => Ok(()),
            BranchState::BudgetExhausted | BranchState::AggregateBudgetExhausted => {
                match self.budget_room(b.run_id) {
                    None => Ok(()),
                    Some(full) => Err(CoordinatorError::CapFull {
                        fork: fork_id,
                        label: label.clone(),
                        state: b.state,
                        full,
                    }),
                }
            }
            BranchState::Paused => Err(CoordinatorError::ContinuePaused {
                fork: fork_id,
                label: label.clone(),
            }),
            BranchState::AwaitingApproval => Err(self.awaiting(i)),
            BranchState::Pending | BranchState::Running => Err(CoordinatorError::ContinueRunning {
                fork: fork_id,
                label: label.clone(),
                state: b.state,
            }),
        }
    }

    /// Which cap has no room left for branch `run` (its own, its fork's, its account's),
    /// if any.
    fn budget_room(&self, run: RunId) -> Option<&'static str> {
        let cost = self.ledger.fork_cost(self.record.fork_id).ok()?;
        let full = |remaining: Option<f64>| remaining.is_some_and(|r| r <= 0.0);
        if cost
            .branches
            .iter()
            .any(|b| b.run_id == run && full(b.remaining_usd))
        {
            Some("its cap")
        } else if full(cost.remaining_usd) {
            Some("the fork's cap")
        } else if cost.account.as_ref().is_some_and(|a| full(a.remaining_usd)) {
            Some("the account's cap")
        } else {
            None
        }
    }

    /// Start a follow-up turn of branch `label` with the user message `text` (ADR 13).
    ///
    /// Its task is enqueued again as a resumed branch's is ([`ForkState::enqueue`]: above
    /// every attempt before it, so a worker takes it over from the log), then a `follow_up`
    /// event (after interrupted results for tool calls a lost worker left unanswered) is
    /// appended at the branch's next seq under its current fence: applying it re-opens the
    /// branch (pending) and the fork. In that order, a failure leaves at worst a task that finds the branch finished
    /// and is dropped, never a re-opened branch without a task. Both happen before this
    /// actor reads its next message, so the worker's takeover finds the event in the log.
    ///
    /// Without `text`, an idle child of `runs fork` (docs/LINEAGE.md) is started from its
    /// copied history: a `pending` status is appended instead of a follow-up (a finished
    /// branch needs a message).
    pub(super) async fn follow_up(
        &mut self,
        pool: &str,
        label: &str,
        text: Option<String>,
    ) -> Result<ContinueOutcome, CoordinatorError> {
        let fork_id = self.record.fork_id;
        let i = self.branch_index(label)?;
        if text.as_ref().is_some_and(|t| t.trim().is_empty()) {
            return Err(CoordinatorError::EmptyMessage {
                what: "follow-up message",
            });
        }
        self.check_follow_up(i)?;
        let b = &self.branches[i].record;
        let (run_id, previous) = (b.run_id, b.state);
        if text.is_none() && previous != BranchState::Idle {
            return Err(CoordinatorError::NeedsMessage {
                run: run_id,
                state: previous,
            });
        }
        // What a lost worker left unanswered, or a child's cutoff left after a response
        // (the model API needs a result for every call before the next user message).
        let log = self.store.run_log(run_id)?;
        let history = messages_from_events(history_events(&log, None).into_iter().map(|(_, e)| e));
        let mut events = interrupted_results(&history);
        events.push(match text {
            Some(text) => Event::FollowUp { text },
            None => Event::Status {
                state: BranchState::Pending,
                error: None,
            },
        });
        let attempt_base = self.enqueue(i, pool).await?;
        let seq = self.append_own(i, events)?;
        self.store.flush_async().await?;
        let b = &self.branches[i];
        tracing::info!(fork.id = %fork_id, branch.label = %label, previous = %previous, seq, attempt_base, "fork.follow_up: a new turn was enqueued");
        Ok(ContinueOutcome {
            fork_id,
            label: label.to_string(),
            run_id,
            previous,
            seq,
            branch: b.record.view(),
            fork_state: self.record.state.clone(),
        })
    }

    /// Follow up the branches that ended `done` without steers sent to them while they ran
    /// (each came after the worker's last look): the steers, joined, start the branch's
    /// next turn (ADR 13), as `fork continue` would. One that cannot (the fork is being
    /// merged) is logged.
    pub(super) async fn follow_up_lost_steers(&mut self) {
        for (run_id, text) in std::mem::take(&mut self.lost_steers) {
            let Some(&i) = self.by_run.get(&run_id) else {
                continue;
            };
            let label = self.branches[i].record.label.clone();
            let pool = self.pool.clone();
            match self.follow_up(&pool, &label, Some(text)).await {
                Ok(_) => {
                    tracing::info!(fork.id = %self.record.fork_id, branch.label = %label, "fork.steer: it came after the branch's last model call; a follow-up turn applies it")
                }
                Err(e) => {
                    tracing::warn!(fork.id = %self.record.fork_id, branch.label = %label, error = %e, "fork.steer: it came after the branch's last model call and could not start a follow-up turn")
                }
            }
        }
    }

    /// Mark the fork aborted (durably), then stop every branch still running. Aborting an
    /// aborted fork changes nothing; a merged fork cannot be aborted.
    pub(super) async fn abort(&mut self) -> Result<AbortOutcome, CoordinatorError> {
        let fork_id = self.record.fork_id;
        match &self.record.state {
            ForkPhase::Merged { winner } => {
                return Err(CoordinatorError::AlreadyMerged {
                    fork: fork_id,
                    winner: winner.clone(),
                })
            }
            ForkPhase::Aborted => {
                return Ok(AbortOutcome {
                    terminated: Vec::new(),
                    changed: false,
                    view: self.view(),
                })
            }
            ForkPhase::Open | ForkPhase::Settled => {}
        }
        if self.merging {
            return Err(CoordinatorError::MergeInProgress(fork_id));
        }
        let mut record = self.record.clone();
        record.state = ForkPhase::Aborted;
        self.store.put_fork(&record)?;
        self.store.flush_async().await?;
        self.record = record;
        let mut terminated = Vec::new();
        for i in 0..self.branches.len() {
            if self.branches[i].record.state.is_terminal() {
                continue;
            }
            let label = self.branches[i].record.label.clone();
            match self
                .stop_branch(i, format!("fork {fork_id} was aborted"))
                .await
            {
                Ok(()) => terminated.push(label),
                Err(e) => {
                    tracing::error!(fork.id = %fork_id, branch.label = %label, error = %e, "fork.abort: cannot end the branch")
                }
            }
        }
        if !terminated.is_empty() {
            self.store.flush_async().await?;
        }
        tracing::info!(fork.id = %fork_id, terminated = terminated.len(), "fork.aborted");
        self.bump();
        Ok(AbortOutcome {
            terminated,
            changed: true,
            view: self.view(),
        })
    }
}
