//! Merging a winner into its fork's parent. Runs on a blocking thread; the fork actor
//! checks the request first (label, fork state, winner finished) and records the result.
//!
//! 1. Flush the winner's change log onto the parent's *current* workspace version
//!    ([`ManifestTarget`]), conflicts detected against the fork-time snapshot, with the
//!    plan's conflict policy; store the result as a manifest blob.
//! 2. Adopt the winner's history: its conversational events after the copied prefix
//!    (extra instructions, steer, model responses, tool results; never usage or file
//!    changes), then a `BranchSummary` naming the winner, appended to the parent's log.
//! 3. Checkpoint `post-fork:<fork id>` at the parent's new last seq, on the merged manifest.
//! 4. The parent's record (workspace version, next seq), its new events, the checkpoint and
//!    the fork record (`Merged { winner }`) are written in one transaction.
//!
//! A fork an agent made inside its branch ([`MergeInto::Agent`], ADR 14) merges into that
//! branch's overlay, whose log only its worker (or, once it has finished, its fork actor)
//! writes: here only the fork record is written, and the outcome carries the winner's change
//! log and last answer for whoever appends them to the branch.

use crate::create::post_fork_checkpoint_label;
use crate::error::CoordinatorError;
use crate::store::{BranchRecord, ForkRecord, RunStore};
use forkfleet_shared::api::{CheckpointKind, CheckpointView, MergeOutcome};
use forkfleet_shared::event::{history_at, own_answer, Event};
use forkfleet_shared::flush::{flush, ManifestTarget};
use forkfleet_shared::ids::CheckpointId;
use forkfleet_shared::manifest::Manifest;
use forkfleet_shared::overlay::ChangeOp;
use forkfleet_shared::state::ForkState;
use std::sync::Arc;

/// Where a merge lands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MergeInto {
    /// The fork's parent run, here (a root run or any run no worker writes).
    Parent,
    /// A branch run whose agent forked: the caller applies the outcome to it.
    Agent,
}

pub(crate) struct MergeJob {
    pub into: MergeInto,
    pub store: RunStore,
    pub fork: ForkRecord,
    pub winner: BranchRecord,
    pub changes: Vec<ChangeOp>,
    pub fork_snapshot: Arc<Manifest>,
    pub now_ms: u64,
}

/// The merge's result: what the caller gets and the fork record as written.
pub(crate) struct MergeDone {
    pub outcome: MergeOutcome,
    pub fork: ForkRecord,
    /// The parent's new workspace version (none for a merge into an agent's branch).
    pub merged_manifest: Option<bytes::Bytes>,
}

pub(crate) fn run(job: MergeJob) -> Result<MergeDone, CoordinatorError> {
    if job.into == MergeInto::Agent {
        return into_agent(job);
    }
    let MergeJob {
        into: _,
        store,
        fork,
        winner,
        changes,
        fork_snapshot,
        now_ms,
    } = job;
    let _parents = store.lock_parents();
    let mut parent = store
        .run(fork.parent_run)?
        .ok_or(CoordinatorError::UnknownRun(fork.parent_run))?;

    // 1. The workspace.
    let current = if parent.workspace == fork.snapshot {
        (*fork_snapshot).clone()
    } else {
        let bytes = store
            .blob(&parent.workspace)?
            .ok_or_else(|| CoordinatorError::missing_blobs(&[parent.workspace]))?;
        Manifest::from_blob(&bytes).map_err(|e| CoordinatorError::BadSnapshot {
            hash: parent.workspace,
            message: e.to_string(),
        })?
    };
    let mut target = ManifestTarget::new(current);
    let report = flush(
        &changes,
        &fork_snapshot,
        &mut target,
        fork.plan.conflict_policy,
    );
    let merged = target.into_manifest();
    let merged_bytes = merged
        .to_blob()
        .map_err(|e| CoordinatorError::codec("merged manifest", e))?;
    let merged_hash = forkfleet_shared::blob::BlobHash::of(&merged_bytes);
    store.blobs().put_trusted(merged_hash, &merged_bytes)?;

    // 2. The history (the winner's as it stands: a rewind of the winner is honoured).
    let winner_log = store.run_log(winner.run_id)?;
    let summary = own_answer(&winner_log, winner.first_seq);
    let mut adopted = adopted_history(&winner_log, fork.prefix_len);
    adopted.push(Event::BranchSummary {
        text: format!(
            "fork {} merged branch `{}` (run {}): {}, {} turn(s), {} change(s), ${:.4}; {} path(s) applied, {} overwritten, {} conflict(s) under {}",
            fork.fork_id,
            winner.label,
            winner.run_id,
            winner.state,
            winner.turns,
            changes.len(),
            winner.cost_usd,
            report.applied_paths.len(),
            report.overwritten.len(),
            report.conflicts.len(),
            fork.plan.conflict_policy,
        ),
    });
    let first = parent.next_seq;
    let events: Vec<(u64, Event)> = adopted
        .into_iter()
        .enumerate()
        .map(|(i, e)| (first + i as u64, e))
        .collect();
    parent.next_seq = first + events.len() as u64;
    parent.workspace = merged_hash;

    // 3. The checkpoint, and 4. one transaction.
    let parent_log = store.run_log(parent.run_id)?;
    let turn = history_at(&parent_log, None)
        .into_iter()
        .map(|i| &parent_log[i].1)
        .chain(events.iter().map(|(_, e)| e))
        .filter(|e| matches!(e, Event::ModelResponse { .. }))
        .count() as u32;
    let checkpoint = CheckpointView {
        id: CheckpointId::new(),
        run_id: parent.run_id,
        label: post_fork_checkpoint_label(fork.fork_id),
        seq: parent.next_seq - 1,
        snapshot: merged_hash,
        created_at_ms: now_ms,
        base_seq: parent.next_seq - 1,
        turn,
        kind: CheckpointKind::Named,
        metadata: Default::default(),
    };
    let mut fork = fork;
    fork.state = ForkState::Merged {
        winner: winner.label.clone(),
    };
    store.commit_merge(&parent, &events, &checkpoint, &fork)?;

    Ok(MergeDone {
        outcome: MergeOutcome {
            fork_id: fork.fork_id,
            winner: winner.label.clone(),
            winner_run: winner.run_id,
            parent_run: parent.run_id,
            report,
            changes,
            fork_snapshot: fork.snapshot,
            merged_snapshot: merged_hash,
            checkpoint: checkpoint.label,
            conflict_policy: fork.plan.conflict_policy,
            into_branch: false,
            summary,
            blocked: winner.blocked.clone(),
        },
        fork,
        merged_manifest: Some(merged_bytes),
    })
}

/// A merge into the branch whose agent forked: record the fork as merged and hand back the
/// winner's change log and last answer (the parent's workspace and log are not touched).
fn into_agent(job: MergeJob) -> Result<MergeDone, CoordinatorError> {
    let MergeJob {
        store,
        fork,
        winner,
        changes,
        ..
    } = job;
    let summary = own_answer(&store.run_log(winner.run_id)?, winner.first_seq);
    let mut fork = fork;
    fork.state = ForkState::Merged {
        winner: winner.label.clone(),
    };
    store.put_fork(&fork)?;
    store.flush()?;
    Ok(MergeDone {
        outcome: MergeOutcome {
            fork_id: fork.fork_id,
            winner: winner.label.clone(),
            winner_run: winner.run_id,
            parent_run: fork.parent_run,
            report: Default::default(),
            changes,
            fork_snapshot: fork.snapshot,
            merged_snapshot: fork.snapshot,
            checkpoint: String::new(),
            conflict_policy: fork.plan.conflict_policy,
            into_branch: true,
            summary,
            blocked: winner.blocked.clone(),
        },
        merged_manifest: None,
        fork,
    })
}

/// The winner's conversation a merge adopts: its conversational events after the copied
/// prefix (`prefix_len` events after its `fork` event), as its history stands (a rewind of
/// the winner is honoured).
pub(crate) fn adopted_history(winner_log: &[(u64, Event)], prefix_len: u64) -> Vec<Event> {
    let adopt_from = 1 + prefix_len;
    history_at(winner_log, None)
        .into_iter()
        .map(|i| &winner_log[i])
        .filter(|(seq, e)| *seq >= adopt_from && e.is_conversational())
        .map(|(_, e)| e.clone())
        .collect()
}
