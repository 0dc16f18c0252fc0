//! Takeovers and what they leave behind (ADR 18): fencing a branch at a checked attempt
//! and telling the earlier attempts they are superseded, counting the spend of a fenced
//! attempt's calls, and resolving a branch left without a runner: one whose task a fenced
//! attempt settled, or whose task died (ADR 38).

use super::ForkState;
use crate::budget::Actions;
use crate::error::CoordinatorError;
use forkfleet_shared::event::Event;
use forkfleet_shared::ids::RunId;
use forkfleet_shared::protocol::{BranchEvent, Control, ControlCommand};

/// How many times in a row one branch's dead tasks are queued again without a turn in
/// between before it fails anyway (ADR 38): a backstop, each time being `max_deliver`
/// deliveries lost to disruptions. A turn starts the count again.
pub(crate) const MAX_REQUEUES: u32 = 20;

/// A branch's task delivered more than `max_deliver` times without finishing (a worker
/// given one more asked to take the branch over). Its deliveries are counted as workers
/// lost on it only when they made no turn and no disruption explains them: otherwise the
/// branch is queued again (ADR 38).
#[derive(Debug, Clone)]
pub(crate) struct DeadTask {
    pub run: RunId,
    /// The task's `attempt_base`: its deliveries ran attempts above it.
    pub attempt_base: u32,
    /// The pool whose queue it was on.
    pub pool: String,
    /// The latest evidence of a disruption, in ms since the epoch: when the coordinator
    /// last saw its bus disrupted (`Bus::disrupted_at_ms`), or when it started serving.
    pub outage_ms: u64,
}

impl ForkState {
    /// A worker took over branch `run` under task `attempt`, holding the task at queue
    /// position `seq` of `pool` (its proof was checked, `resume.rs`): from now on events of
    /// earlier attempts are dropped, what they left held beyond a gap is deleted, and the
    /// earlier attempts are told they are superseded (a control command: their workers stop
    /// without settling the task). The answer is the branch's log as stored, which the
    /// worker continues. An attempt below the fence is refused
    /// ([`CoordinatorError::Superseded`]). A branch sent a terminate its earlier attempt did
    /// not obey is ended first (the log says so, and the worker drops its task): terminates
    /// are addressed to an attempt, like every command.
    pub(super) async fn fence(
        &mut self,
        run: RunId,
        attempt: u32,
        pool: String,
        seq: u64,
    ) -> Result<Vec<(u64, Event)>, CoordinatorError> {
        let i = self.run_index(run)?;
        let fence = self.branches[i].record.min_attempt;
        if attempt < fence {
            return Err(CoordinatorError::Superseded { attempt, fence });
        }
        if self.raise_fence(run, attempt)? && attempt > 1 {
            self.ledger.send(Actions {
                controls: vec![Control {
                    run_id: run,
                    command: ControlCommand::Superseded { by: attempt },
                    attempt: Some(attempt - 1),
                }],
            });
        }
        let b = &mut self.branches[i].record;
        if b.task.as_ref() != Some(&(pool.clone(), seq)) {
            b.task = Some((pool, seq));
            self.store.put_branch(b)?;
        }
        if let Some(reason) = self.stopping.remove(&run) {
            self.end_branch(
                run,
                forkfleet_shared::state::BranchState::Terminated,
                reason,
            )?;
            self.store.flush_async().await?;
        }
        self.store.run_log(run)
    }

    /// An event of a fenced attempt of branch `i` (dropped from the log): a `usage` event's
    /// call was paid for, so it is counted once by (run, attempt, seq) in the branch's calls
    /// and spend, and it settles its reservation; a status that ends the attempt makes the
    /// branch a suspect for [`ForkState::check_runners`]. True when the branch changed.
    pub(super) fn fenced_event(&mut self, i: usize, ev: &BranchEvent) -> bool {
        let fork_id = self.record.fork_id;
        match &ev.event {
            Event::Usage {
                model,
                cost_usd,
                reservation,
                ..
            } => {
                match self
                    .store
                    .put_fenced_usage(ev.run_id, ev.attempt, ev.seq, *cost_usd)
                {
                    Ok(true) => {}
                    Ok(false) => return false,
                    Err(e) => {
                        tracing::error!(fork.id = %fork_id, run.id = %ev.run_id, error = %e, "fork.fenced_usage: cannot record a fenced attempt's call; not counted");
                        return false;
                    }
                }
                self.branches[i].count_fenced(*cost_usd);
                let actions = self
                    .ledger
                    .on_usage(ev.run_id, *cost_usd, *reservation, model);
                self.ledger.send(actions);
                tracing::info!(fork.id = %fork_id, run.id = %ev.run_id, attempt = ev.attempt, seq = ev.seq, cost_usd, "fork.fenced_usage: a fenced attempt's call counted");
                true
            }
            Event::Status { state, .. } if state.is_stopped() => {
                self.suspects.push(ev.run_id);
                false
            }
            _ => false,
        }
    }

    /// Branches whose fenced attempt finished (its worker settled the task it shared with
    /// the attempt that took the branch over): when the branch is not finished, not
    /// enqueued again, and its task is no longer queued or held, no worker can run it, so
    /// it is enqueued again above the fence (a WARN says why). A branch whose task's
    /// position is not known here (the coordinator restarted since its takeover) is left
    /// as it is, with a WARN.
    pub(super) async fn check_runners(&mut self) {
        let fork_id = self.record.fork_id;
        for run in std::mem::take(&mut self.suspects) {
            let Some(&i) = self.by_run.get(&run) else {
                continue;
            };
            let b = &self.branches[i].record;
            if b.state.is_stopped() || self.requeued.contains(&run) {
                continue;
            }
            let label = b.label.clone();
            let Some((pool, seq)) = b.task.clone() else {
                tracing::warn!(fork.id = %fork_id, branch.label = %label, "fork.runner: a fenced attempt ended, and the task of the attempt that took over is not known (a takeover by a coordinator before ADR 18): not checked");
                continue;
            };
            match self.bus.queued_task(&pool, seq).await {
                Ok(Some(_)) => {}
                Ok(None) => {
                    tracing::warn!(fork.id = %fork_id, branch.label = %label, task.seq = seq, "fork.runner: the branch's task was settled by a fenced attempt while the branch is unfinished, so no worker runs it: enqueued again above the fence");
                    match self.enqueue(i, &pool).await {
                        Ok(attempt_base) => {
                            tracing::info!(fork.id = %fork_id, branch.label = %label, attempt_base, "fork.runner: the branch was enqueued again")
                        }
                        Err(e) => {
                            tracing::error!(fork.id = %fork_id, branch.label = %label, error = %e, "fork.runner: cannot enqueue the branch again")
                        }
                    }
                }
                Err(e) => {
                    tracing::warn!(fork.id = %fork_id, branch.label = %label, error = %e, "fork.runner: cannot check the branch's task")
                }
            }
        }
    }

    /// Branch `dead.run`'s task was delivered more than `max_deliver` times. Its deliveries
    /// were lost to something other than the branch when the branch made a turn since the
    /// task was queued (workers were lost or handed it back while it went on) or when a
    /// disruption came after it was queued (a NATS outage or freeze, or a coordinator
    /// restart, longer than the lease loses every delivery in flight): then the branch is
    /// queued again as a new task, above every attempt of the dead one (without a turn, at
    /// most [`MAX_REQUEUES`] times in a row). Otherwise the branch fails (what it did is
    /// kept). A task a later one replaced, or of a finished branch, changes nothing. The
    /// answer says what became of the branch, for the worker that drops the task.
    pub(super) async fn dead_task(&mut self, dead: DeadTask) -> String {
        let fork_id = self.record.fork_id;
        let Some(&i) = self.by_run.get(&dead.run) else {
            return format!("run {} is not a branch of fork {fork_id}", dead.run);
        };
        let max = self.bus.max_deliver();
        let last = dead.attempt_base.saturating_add(max);
        let b = &self.branches[i].record;
        let label = b.label.clone();
        if b.state.is_terminal() {
            return format!("the branch already finished as {}", b.state);
        }
        let queued = b.queued.unwrap_or_default();
        if dead.attempt_base < queued.attempt_base || b.min_attempt > last {
            return "a later task of the branch replaced this one".into();
        }
        let delivered = if max == 1 {
            "more than once".to_string()
        } else {
            format!("more than {max} times")
        };
        // Why its deliveries were not deaths: progress (which also resets the count of
        // requeues without any), or a disruption of the bus or the coordinator since.
        let progressed = b.turns > queued.turns;
        let cause = if progressed {
            Some(format!(
                "its deliveries made {} turn(s) before they ended (workers lost or handing it back while it went on)",
                b.turns - queued.turns
            ))
        } else if dead.outage_ms > queued.at_ms {
            Some("the bus or the coordinator was disrupted after it was queued".to_string())
        } else {
            None
        };
        let error = match cause {
            Some(cause) if progressed || queued.requeues < MAX_REQUEUES => {
                match self.requeue_dead(i, last, &dead.pool, progressed).await {
                    Ok(attempt_base) => {
                        let outcome = format!("the branch's task was delivered {delivered}, and {cause}: the branch was queued again as a new task");
                        tracing::warn!(fork.id = %fork_id, branch.label = %label, attempt_base, "fork.dead_task: {outcome}");
                        return outcome;
                    }
                    Err(e) => format!(
                        "the branch's task was delivered {delivered}, and {cause}, but it could not be queued again: {e}; what it did is kept"
                    ),
                }
            }
            Some(cause) => format!(
                "the branch's task was delivered {delivered} without a turn, {MAX_REQUEUES} times in a row ({cause}, this time); what it did is kept"
            ),
            None => format!(
                "the branch's task was delivered {delivered} and no worker finished it: no turn was made and no disruption of the bus or the coordinator explains it (workers lost or crashing on it); what it did is kept"
            ),
        };
        if let Err(e) = self.fail_branch(dead.run, error.clone()) {
            tracing::error!(fork.id = %fork_id, run.id = %dead.run, error = %e, "fork.dead_task: could not record the failure");
        }
        error
    }

    /// Queue branch `i` again after its task died, above `last`, the dead task's last
    /// attempt that may have taken the branch over; a worker still running one of them
    /// (its lease not yet run out) is told it is superseded.
    /// `progressed`: it made a turn since its task was queued, which starts the count of
    /// requeues without a turn again.
    async fn requeue_dead(
        &mut self,
        i: usize,
        last: u32,
        pool: &str,
        progressed: bool,
    ) -> Result<u32, CoordinatorError> {
        let run = self.branches[i].record.run_id;
        self.raise_fence(run, last)?;
        self.ledger.send(Actions {
            controls: vec![Control {
                run_id: run,
                command: ControlCommand::Superseded {
                    by: last.saturating_add(1),
                },
                attempt: Some(last),
            }],
        });
        let queued = self.branches[i].record.queued.get_or_insert_default();
        queued.requeues = if progressed { 0 } else { queued.requeues + 1 };
        self.enqueue(i, pool).await
    }
}
