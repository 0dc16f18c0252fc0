//! Merging and resolving a fork (the checks, a merge's blocking part off the mailbox,
//! stopping the losers), and the coordinator's changes to a finished branch's history: the
//! merge of a fork its agent made (ADR 14) and a rewind (ADR 12).

use super::{ForkMsg, ForkState, ResolveInputs};
use crate::checkpoint;
use crate::error::CoordinatorError;
use crate::merge::{self, MergeDone, MergeInto, MergeJob};
use forkfleet_shared::api::MergeOutcome;
use forkfleet_shared::event::Event;
use forkfleet_shared::flush::{flush, FlushReport};
use forkfleet_shared::ids::RunId;
use forkfleet_shared::manifest::Manifest;
use forkfleet_shared::protocol::now_ms;
use forkfleet_shared::state::ForkState as ForkPhase;
use ractor::{ActorRef, RpcReplyPort};
use tracing::Instrument;

impl ForkState {
    /// The fork can still merge: not merged, not aborted, no merge under way.
    fn check_mergeable(&self) -> Result<(), CoordinatorError> {
        let fork = self.record.fork_id;
        match &self.record.state {
            ForkPhase::Merged { winner } => Err(CoordinatorError::AlreadyMerged {
                fork,
                winner: winner.clone(),
            }),
            ForkPhase::Aborted => Err(CoordinatorError::Aborted(fork)),
            ForkPhase::Open | ForkPhase::Settled if self.merging => {
                Err(CoordinatorError::MergeInProgress(fork))
            }
            ForkPhase::Open | ForkPhase::Settled => Ok(()),
        }
    }

    /// The checks of a resolve: the fork is open or settled, not being merged or resolved,
    /// and every branch has finished (a paused branch must be topped up or terminated
    /// first). Marks the fork as resolving.
    pub(super) fn resolve_start(&mut self) -> Result<ResolveInputs, CoordinatorError> {
        let fork = self.record.fork_id;
        self.check_mergeable()?;
        if self.resolving {
            return Err(CoordinatorError::ResolveInProgress(fork));
        }
        let unfinished: Vec<String> = self
            .branches
            .iter()
            .filter(|b| !b.record.state.is_terminal())
            .map(|b| format!("`{}` ({})", b.record.label, b.record.state))
            .collect();
        if !unfinished.is_empty() {
            return Err(CoordinatorError::Unfinished { fork, unfinished });
        }
        self.resolving = true;
        Ok(ResolveInputs {
            record: self.record.clone(),
            branches: self
                .branches
                .iter()
                .map(|b| (b.record.clone(), b.overlay.clone()))
                .collect(),
        })
    }

    /// The request checks of a merge; the winner's index.
    fn check_merge(&self, pick: &str) -> Result<usize, CoordinatorError> {
        self.check_mergeable()?;
        let i = self.branch_index(pick)?;
        let state = self.branches[i].record.state;
        if !state.is_terminal() {
            return Err(CoordinatorError::StillRunning {
                label: pick.to_string(),
                state,
            });
        }
        Ok(i)
    }

    /// Rewind a finished branch: fence off the attempts that ran it, append `marker` at
    /// `seq` (the branch's log must end just before it: nothing changed since the rewind
    /// was worked out), and rebuild its overlay from the rewound history.
    pub(super) async fn rewind(
        &mut self,
        run: RunId,
        marker: Event,
        seq: u64,
    ) -> Result<u64, CoordinatorError> {
        let fork_id = self.record.fork_id;
        let i = self.run_index(run)?;
        self.check_not_busy("rewind its branches")?;
        let b = &self.branches[i].record;
        if !b.state.is_terminal() {
            return Err(CoordinatorError::RewindRunning {
                run,
                fork: fork_id,
                label: b.label.clone(),
                state: b.state,
            });
        }
        if b.next_seq != seq {
            return Err(CoordinatorError::RewindRaced {
                label: b.label.clone(),
            });
        }
        self.close(i)?;
        self.append_own(i, vec![marker])?;
        let log = self.store.run_log(run)?;
        checkpoint::apply_rewind(&mut self.branches[i], &self.base, &log)?;
        self.store.put_branch(&self.branches[i].record)?;
        self.store.flush_async().await?;
        self.bump();
        Ok(seq)
    }

    /// Merge a fork made by a finished branch's agent into that branch: replay the
    /// winner's change log onto the branch's overlay (conflicts against the inner fork's
    /// snapshot, its conflict policy), and append the resulting file changes and a summary
    /// to the branch's log as the coordinator's own events.
    pub(super) async fn adopt(
        &mut self,
        run: RunId,
        outcome: MergeOutcome,
    ) -> Result<FlushReport, CoordinatorError> {
        let fork_id = self.record.fork_id;
        let i = self.run_index(run)?;
        self.check_not_busy(&format!("merge fork {}", outcome.fork_id))?;
        let b = &self.branches[i];
        if !b.record.state.is_terminal() {
            return Err(CoordinatorError::AgentStillRunning {
                fork: fork_id,
                label: b.record.label.clone(),
                state: b.record.state,
                child: outcome.fork_id,
            });
        }
        let bytes = self
            .store
            .blob(&outcome.fork_snapshot)?
            .ok_or_else(|| CoordinatorError::missing_blobs(&[outcome.fork_snapshot]))?;
        let snapshot = Manifest::from_blob(&bytes).map_err(|e| CoordinatorError::BadSnapshot {
            hash: outcome.fork_snapshot,
            message: e.to_string(),
        })?;
        let mut overlay = b.overlay.clone();
        let before = overlay.changes().len();
        let report = flush(
            &outcome.changes,
            &snapshot,
            &mut overlay,
            outcome.conflict_policy,
        );
        let mut events = self.adopted_conversation(run, &outcome)?;
        events.extend(
            overlay.changes()[before..]
                .iter()
                .map(|op| Event::FileChange { change: op.clone() }),
        );
        events.push(Event::BranchSummary {
            text: merge_summary(&outcome, &report),
        });
        self.append_own(i, events)?;
        self.store.put_branch(&self.branches[i].record)?;
        self.store.flush_async().await?;
        self.bump();
        Ok(report)
    }

    /// The winner's conversation (steer, answers, tool calls and results) for the branch of
    /// `run` to adopt with a merge of a fork it made, when the branch's conversation has
    /// not moved on since the fork point (a fork made from `forkfleet chat` once the agent
    /// answered): the chat then goes on from the winner's turns. Empty otherwise (the
    /// agent's own `fork_run` answered with more turns after it): the summary says what
    /// was merged.
    fn adopted_conversation(
        &self,
        run: RunId,
        outcome: &MergeOutcome,
    ) -> Result<Vec<Event>, CoordinatorError> {
        let winner_log = self.store.run_log(outcome.winner_run)?;
        let Some((_, Event::Fork { cutoff_seq, .. })) = winner_log.first() else {
            return Ok(Vec::new());
        };
        let moved_on = self
            .store
            .run_log(run)?
            .iter()
            .any(|(seq, e)| seq > cutoff_seq && e.is_conversational());
        let inner = self.store.fork(outcome.fork_id)?;
        match inner {
            Some(inner) if !moved_on => Ok(merge::adopted_history(&winner_log, inner.prefix_len)),
            _ => Ok(Vec::new()),
        }
    }

    /// Start a merge of branch `pick` (see [`ForkMsg::Merge`]): check it, then run its
    /// blocking part off the mailbox; [`ForkMsg::MergeFinished`] brings the result back.
    pub(super) fn start_merge(
        &mut self,
        myself: ActorRef<ForkMsg>,
        pick: String,
        into: MergeInto,
        reply: RpcReplyPort<Result<MergeOutcome, CoordinatorError>>,
    ) {
        let span =
            tracing::info_span!("fork.merge", fork.id = %self.record.fork_id, branch.label = %pick);
        // In the fork's trace, under its `fork.create`.
        forkfleet_shared::trace::set_parent(&span, self.record.trace.as_deref());
        let i = match span.in_scope(|| self.check_merge(&pick)) {
            Ok(i) => i,
            Err(e) => {
                span.in_scope(|| tracing::info!(error = %e, "fork.merge refused"));
                let _ = reply.send(Err(e));
                return;
            }
        };
        self.merging = true;
        let winner = &self.branches[i];
        let job = MergeJob {
            into,
            store: self.store.clone(),
            fork: self.record.clone(),
            winner: winner.record.clone(),
            changes: winner.overlay.changes().to_vec(),
            fork_snapshot: self.base.clone(),
            now_ms: now_ms(),
        };
        tokio::spawn(
            async move {
                let result = tokio::task::spawn_blocking(move || merge::run(job))
                    .await
                    .map_err(CoordinatorError::from)
                    .and_then(|r| r);
                if let Err(ractor::MessagingErr::SendErr(ForkMsg::MergeFinished {
                    reply, ..
                })) = myself.cast(ForkMsg::MergeFinished {
                    result: Box::new(result),
                    reply,
                }) {
                    let _ = reply.send(Err(CoordinatorError::Closed("fork actor")));
                }
            }
            .instrument(span),
        );
    }

    /// A merge's blocking part finished: take its fork record, publish the merged manifest,
    /// stop the losers still running or paused, and answer.
    pub(super) async fn merge_finished(
        &mut self,
        result: Box<Result<MergeDone, CoordinatorError>>,
        reply: RpcReplyPort<Result<MergeOutcome, CoordinatorError>>,
    ) {
        self.merging = false;
        let done = match *result {
            Ok(done) => done,
            Err(e) => {
                tracing::error!(fork.id = %self.record.fork_id, error = %e, "fork.merge failed");
                let _ = reply.send(Err(e));
                return;
            }
        };
        self.record = done.fork;
        let fork_id = self.record.fork_id;
        // Clients applying the merge read the manifest from the bus's blob store.
        let hash = done.outcome.merged_snapshot;
        // (A merge into an agent's branch makes no new parent version.)
        if let Some(bytes) = done.merged_manifest {
            if let Err(e) = self.bus.blobs().put(hash, bytes).await {
                tracing::warn!(fork.id = %fork_id, error = %e, "fork.merge: cannot publish the merged manifest");
            }
            if let Some(account) = &self.record.plan.budget.account {
                if let Err(e) = self.store.own_blobs(account, [hash]) {
                    tracing::warn!(fork.id = %fork_id, error = %e, "fork.merge: cannot record the merged manifest's owner");
                }
            }
        }
        // Stop the losers that are still running or paused.
        let reason = format!("fork {fork_id} merged branch `{}`", done.outcome.winner);
        self.stop_unfinished(&reason).await;
        tracing::info!(
            fork.id = %fork_id,
            branch.label = %done.outcome.winner,
            applied = done.outcome.report.applied_paths.len(),
            overwritten = done.outcome.report.overwritten.len(),
            conflicts = done.outcome.report.conflicts.len(),
            "fork.merged"
        );
        self.bump();
        let _ = reply.send(Ok(done.outcome));
    }
}

/// What a branch's history says about a fork of its agent that was merged into it.
fn merge_summary(outcome: &MergeOutcome, report: &FlushReport) -> String {
    let mut text = format!(
        "fork {} merged branch `{}` into this run: {} path(s) applied, {} overwritten, {} conflict(s) under {}",
        outcome.fork_id,
        outcome.winner,
        report.applied_paths.len(),
        report.overwritten.len(),
        report.conflicts.len(),
        outcome.conflict_policy,
    );
    if !report.conflicts.is_empty() {
        let paths: Vec<String> = report.conflicts.iter().map(|p| p.to_string()).collect();
        text.push_str(&format!(" ({})", paths.join(", ")));
    }
    if let Some(summary) = &outcome.summary {
        text.push_str(&format!(". Its last answer: {summary}"));
    }
    text
}
