//! Applying a fork's events (written, then applied to the branches' replicas, once per
//! (run, seq)), the fences that drop the events of task attempts a later worker took over
//! from, and the coordinator's own events, such as the status that ends a branch.

use super::ForkState;
use crate::error::CoordinatorError;
use crate::replica::Placement;
use crate::store::{encode, EventWrites};
use forkfleet_shared::blob::BlobHash;
use forkfleet_shared::event::Event;
use forkfleet_shared::ids::RunId;
use forkfleet_shared::protocol::{now_ms, BranchEvent};
use forkfleet_shared::state::BranchState;
use std::collections::HashSet;

impl ForkState {
    /// The `attempt_base` of a task that runs branch `i` next: its latest takeover's attempt
    /// (at least 1: the first attempt took it over implicitly), so the task's worker
    /// (attempt `attempt_base + 1` and up) takes the branch over from its log. A branch no
    /// worker has started (pending with no events of its own; a pending one with events
    /// waits for its follow-up turn, ADR 13) starts afresh unless something took it over.
    pub(super) fn attempt_base(&self, i: usize) -> u32 {
        let b = &self.branches[i].record;
        if b.state == BranchState::Pending && b.next_seq == b.first_seq {
            b.min_attempt
        } else {
            b.min_attempt.max(1)
        }
    }

    /// The task attempt branch `i` runs under (or its queued task will, before a worker
    /// takes it): a command addressed to it reaches that worker and no later one (a worker
    /// ignores commands for attempts below its own). The budget's stop commands address
    /// `min_attempt.max(1)` likewise.
    pub(super) fn current_attempt(&self, i: usize) -> u32 {
        let b = &self.branches[i].record;
        if self.requeued.contains(&b.run_id) {
            self.attempt_base(i).saturating_add(1)
        } else {
            b.min_attempt.max(1)
        }
    }

    /// Fence off every attempt that ran branch `i`, which no worker runs any more: one
    /// above its latest takeover. A task enqueued later (a follow-up, ADR 13) runs above
    /// that, and is taken over by fencing like any other; a worker of an earlier task that
    /// takes the branch over after this finds it finished.
    pub(super) fn close(&mut self, i: usize) -> Result<(), CoordinatorError> {
        let b = &self.branches[i].record;
        self.raise_fence(b.run_id, b.min_attempt.max(1).saturating_add(1))?;
        Ok(())
    }

    /// Drop the events of task attempts below `attempt` from now on, and what they left
    /// held beyond a gap; persisted with the branch record.
    /// True when the fence rose.
    pub(super) fn raise_fence(
        &mut self,
        run: RunId,
        attempt: u32,
    ) -> Result<bool, CoordinatorError> {
        let i = self.run_index(run)?;
        let b = &mut self.branches[i];
        let Some(held) = b.fence(attempt) else {
            return Ok(false);
        };
        if !held.is_empty() {
            self.store.delete_events(run, &held)?;
        }
        self.store.put_branch(&b.record)?;
        tracing::info!(fork.id = %self.record.fork_id, run.id = %run, branch.label = %b.record.label, attempt, dropped_held = held.len(), "fork.fence: a worker took the branch over");
        self.ledger.on_fence(run, attempt);
        self.requeued.remove(&run);
        Ok(true)
    }

    /// End a branch whose task no worker could finish: fence off every attempt, then
    /// append a `failed` status as the branch's last event (its partial work is kept).
    pub(super) fn fail_branch(
        &mut self,
        run: RunId,
        error: String,
    ) -> Result<(), CoordinatorError> {
        tracing::warn!(fork.id = %self.record.fork_id, run.id = %run, error = %error, "fork.fail_branch");
        self.end_branch(run, BranchState::Failed, error)
    }

    /// End a branch no worker runs (its task is dead, or it is paused): fence off every
    /// attempt, then append the terminal status as its last event (its work is kept).
    /// Written, not flushed.
    pub(super) fn end_branch(
        &mut self,
        run: RunId,
        state: BranchState,
        error: String,
    ) -> Result<(), CoordinatorError> {
        let i = self.run_index(run)?;
        if self.branches[i].record.state.is_terminal() {
            return Ok(());
        }
        self.close(i)?;
        self.append_own(
            i,
            vec![Event::Status {
                state,
                error: Some(error),
            }],
        )?;
        Ok(())
    }

    /// Append the coordinator's own `events` to branch `i`'s log at its next seqs, through
    /// the path the workers' events take, under the branch's current fence (so they are
    /// not dropped, and a worker that takes the branch over later fences above them).
    /// Written, not flushed; the answer is the seq of the last one.
    pub(super) fn append_own(
        &mut self,
        i: usize,
        events: Vec<Event>,
    ) -> Result<u64, CoordinatorError> {
        let b = &self.branches[i].record;
        let (fork_id, run_id, attempt, first) =
            (self.record.fork_id, b.run_id, b.min_attempt, b.next_seq);
        let at_ms = now_ms();
        let batch: Vec<BranchEvent> = (first..)
            .zip(events)
            .map(|(seq, event)| BranchEvent {
                fork_id,
                run_id,
                seq,
                at_ms,
                event,
                attempt,
            })
            .collect();
        let last = batch.last().map_or(first, |e| e.seq);
        self.apply_events(batch)?;
        Ok(last)
    }

    /// Write a batch, then apply it. Nothing in memory changes unless the write succeeded.
    /// The answer: on a cluster, the text blobs the written events write (for the run
    /// store's prefetch); embedded, the run store is the bus's and there is nothing to copy.
    pub(super) fn apply_events(
        &mut self,
        events: Vec<BranchEvent>,
    ) -> Result<Vec<BlobHash>, CoordinatorError> {
        let fork_id = self.record.fork_id;
        // Pass 1: write every event that is not a duplicate as of now.
        // The first copy of a (run, seq) is the one applied, so it is the one written.
        let mut writes = EventWrites::with_capacity(events.len());
        let mut written: HashSet<(RunId, u64)> = HashSet::with_capacity(events.len());
        // The files its branches write belong to the fork's account (`crate::tenancy`).
        let account = self.record.plan.budget.account.as_deref();
        let mut files: Vec<(BlobHash, u64)> = Vec::new();
        // On a cluster (the run store is not the bus's), the texts written, to copy over.
        let cluster = !crate::blobs::shared_with_bus(&self.store, &self.bus);
        let mut texts: Vec<BlobHash> = Vec::new();
        for ev in &events {
            let Some(&i) = self.by_run.get(&ev.run_id) else {
                continue;
            };
            if self.branches[i].fenced(ev.attempt) {
                continue;
            }
            if self.branches[i].placement(ev.seq) != Placement::Duplicate
                && written.insert((ev.run_id, ev.seq))
            {
                writes.push(ev.run_id, ev.seq, encode("event", &ev.event)?);
                if let Event::FileChange { change } = &ev.event {
                    if let Some(e) = change.written() {
                        if account.is_some() {
                            files.push((e.hash, e.size));
                        }
                        if cluster && !e.binary {
                            texts.push(e.hash);
                        }
                    }
                }
            }
        }
        if let Some(account) = account.filter(|_| !files.is_empty()) {
            self.store.own_blobs(account, files.iter().map(|f| f.0))?;
            // Quotas hold tenants of a cluster's shared buckets apart; the embedded system
            // (one user, its own store) has none to hold apart.
            let over = if cluster {
                self.store.record_written(account, &files)?
            } else {
                None
            };
            if let Some((used, quota)) = over {
                let size = crate::tenancy::size_text;
                self.over_quota = Some(format!(
                    "account `{account}` passed its blob quota with the files its branches wrote ({} of {}): an operator raises `[coordinator] blob_quota_mb`, or frees what no fork refers to with `forkfleet gc`",
                    size(used),
                    size(quota)
                ));
            }
        }
        // Last, and nothing that can fail between it and pass 2: events written are applied.
        // (Written but not applied, a redelivery could pack them otherwise, and two values
        // would hold the same seqs: ADR 45.)
        self.store.write_events(writes)?;
        // Pass 2: apply in memory.
        let mut changed = false;
        for ev in events {
            let Some(&i) = self.by_run.get(&ev.run_id) else {
                tracing::error!(fork.id = %fork_id, run.id = %ev.run_id, seq = ev.seq, "fork.event: run is not a branch of this fork; dropped");
                continue;
            };
            let b = &mut self.branches[i];
            if b.fenced(ev.attempt) {
                // After a terminate or an abort (the branch stopped), the attempt that ran
                // it has events in flight: expected, not worth a warning each.
                if b.record.state.is_terminal() {
                    tracing::debug!(fork.id = %fork_id, run.id = %ev.run_id, seq = ev.seq, attempt = ev.attempt, "fork.event: a stopped branch's earlier attempt's event; dropped");
                } else {
                    tracing::warn!(fork.id = %fork_id, run.id = %ev.run_id, seq = ev.seq, attempt = ev.attempt, "fork.event: an earlier task attempt's event after a takeover; dropped");
                }
                // Its spend still counts; its end may leave the branch without a runner.
                changed |= self.fenced_event(i, &ev);
                continue;
            }
            let run_id = ev.run_id;
            if let Event::Steer { text } = &ev.event {
                if let Some(sent) = self.unapplied_steers.get_mut(&run_id) {
                    if let Some(at) = sent.iter().position(|t| t == text) {
                        sent.remove(at);
                    }
                }
            }
            let b = &mut self.branches[i];
            let effect = b.arrive(ev.seq, ev.event);
            if effect.applied > 0 {
                changed = true;
                self.checkpoints
                    .on_applied(&self.store, run_id, &effect.steps);
            }
            for (cost, reservation, model) in effect.usage {
                let actions = self.ledger.on_usage(run_id, cost, reservation, &model);
                self.ledger.send(actions);
            }
            for _ in 0..effect.cached {
                self.ledger.on_cached(run_id);
            }
            if effect.rewound {
                // An agent rewound itself (`rewind_to`): its files are those of the
                // rewound history.
                match self.store.run_log(run_id) {
                    Ok(log) => {
                        if let Err(e) =
                            crate::checkpoint::apply_rewind(&mut self.branches[i], &self.base, &log)
                        {
                            tracing::error!(fork.id = %fork_id, run.id = %run_id, error = %e, "fork.rewind: the replica cannot follow an agent's rewind");
                        }
                    }
                    Err(e) => {
                        tracing::error!(fork.id = %fork_id, run.id = %run_id, error = %e, "fork.rewind: cannot read the log")
                    }
                }
            }
            if effect.approval_requested.is_some() || effect.approval_decided.is_some() {
                self.on_approval_events(
                    run_id,
                    effect.approval_requested.clone(),
                    effect.approval_decided.clone(),
                );
            }
            if effect.became_terminal {
                self.terminal += 1;
                self.stopping.remove(&run_id);
                let unapplied = self.unapplied_steers.remove(&run_id);
                if let Some(sent) = unapplied.filter(|s| !s.is_empty()) {
                    if self.branches[i].record.state == BranchState::Done {
                        let text: Vec<String> = sent.into_iter().collect();
                        self.lost_steers.push((run_id, text.join("\n\n")));
                    }
                }
            }
            if effect.reopened {
                // A follow-up started a new turn of a finished branch (ADR 13).
                self.terminal = self.terminal.saturating_sub(1);
                self.reopen();
            }
            if effect.state_changed {
                let b = &self.branches[i];
                self.ledger.on_state(run_id, b.record.state);
                // Its task is still queued while the branch is pending (a follow-up's own
                // event made it so): commands go to the attempt that task will run under.
                if b.record.state != BranchState::Pending {
                    self.requeued.remove(&run_id);
                }
                tracing::debug!(fork.id = %fork_id, branch.label = %b.record.label, state = %b.record.state, "fork.branch_state");
                if let Err(e) = self.store.put_branch(&b.record) {
                    tracing::error!(fork.id = %fork_id, branch.label = %b.record.label, error = %e, "fork.branch_state: cannot write the branch record");
                }
            }
        }
        if changed {
            self.check_settled();
            self.bump();
        }
        Ok(texts)
    }
}
