//! Rewind: working out how a run goes back to a checkpoint (the marker event, the change
//! log between the two versions) and writing it for a root run; a branch run's marker is
//! appended by its fork actor.

use super::{
    checkpoint_version, current_version, end_at_or_after, find, load_run, run_kind, RunKind,
};
use crate::error::CoordinatorError;
use crate::store::{RunRecord, RunStore};
use forkfleet_shared::api::RewindOutcome;
use forkfleet_shared::event::{history_at, Event};
use forkfleet_shared::flush::changes_between;
use forkfleet_shared::ids::RunId;

/// A rewind worked out, not yet written.
pub(crate) struct RewindPlan {
    pub outcome: RewindOutcome,
    /// The marker to append at `next_seq`.
    pub marker: Event,
    pub next_seq: u64,
    /// The branch's fork, for a branch run (its actor appends the marker).
    pub fork: Option<forkfleet_shared::ids::ForkId>,
}

/// Refuse a branch that has not finished.
fn check_rewindable(run: RunId, kind: &RunKind) -> Result<(), CoordinatorError> {
    if let RunKind::Branch { fork, branch } = kind {
        if !branch.state.is_terminal() {
            return Err(CoordinatorError::RewindRunning {
                run,
                fork: fork.fork_id,
                label: branch.label.clone(),
                state: branch.state,
            });
        }
    }
    Ok(())
}

fn plan_rewind(
    store: &RunStore,
    run: RunId,
    reference: &str,
    rewound: bool,
) -> Result<(RewindPlan, RunRecord), CoordinatorError> {
    let record = load_run(store, run)?;
    let kind = run_kind(store, &record)?;
    let checkpoint = find(store, run, reference)?;
    check_rewindable(run, &kind)?;
    let log = store.run_log(run)?;
    let end = end_at_or_after(run, &log, &checkpoint)?;
    let from = current_version(store, &record, &kind, &log)?;
    let to = checkpoint_version(store, &log, &checkpoint)?;
    let now: std::collections::HashSet<usize> = history_at(&log, None).into_iter().collect();
    let then: std::collections::HashSet<usize> =
        history_at(&log, Some(checkpoint.seq)).into_iter().collect();
    let dropped = now.difference(&then).count() as u64;
    let changes = changes_between(&from.manifest, &to.manifest);
    let next_seq = end + 1;
    let marker = Event::Rewind {
        to_seq: checkpoint.seq,
        checkpoint: checkpoint.id,
        label: checkpoint.label.clone(),
    };
    let (fork, conflict_policy) = match &kind {
        RunKind::Root => (None, Default::default()),
        RunKind::Branch { fork, .. } => (Some(fork.fork_id), fork.plan.conflict_policy),
    };
    Ok((
        RewindPlan {
            outcome: RewindOutcome {
                run_id: run,
                checkpoint,
                rewound,
                marker_seq: rewound.then_some(next_seq),
                dropped_events: dropped,
                from_snapshot: from.hash,
                to_snapshot: to.hash,
                changes,
                conflict_policy,
            },
            marker,
            next_seq,
            fork,
        },
        record,
    ))
}

/// Work out a rewind; for a root run also write it (the marker event and the run's new
/// workspace version, in one transaction). A branch run's plan is written by its fork
/// actor ([`crate::fork::ForkHandle::rewind`]).
pub(crate) fn rewind_in_store(
    store: &RunStore,
    run: RunId,
    reference: &str,
    dry_run: bool,
) -> Result<RewindPlan, CoordinatorError> {
    // Merges append to root runs under this lock; so does a rewind.
    let _parents = store.lock_parents();
    let (plan, mut record) = plan_rewind(store, run, reference, !dry_run)?;
    if dry_run || plan.fork.is_some() {
        return Ok(plan);
    }
    record.workspace = plan.outcome.to_snapshot;
    record.next_seq = plan.next_seq + 1;
    store.commit_rewind(&record, plan.next_seq, &plan.marker)?;
    tracing::info!(run.id = %run, checkpoint = %plan.outcome.checkpoint.label, seq = plan.next_seq, changes = plan.outcome.changes.len(), "checkpoint.rewind");
    Ok(plan)
}
