//! Checkpoints: a run's history position and workspace version, saved automatically on
//! branch runs (the fork's `checkpoints` policy), at forks (`fork:<id>` on the parent,
//! `post-fork:<id>` after a merge) and by hand; and what uses them: rewind and starting a
//! new run. ADR 12 records the decisions; the store API is in `store/checkpoints.rs`.
//!
//! # What a checkpoint names
//! The history at `seq` ([`history_at`]: the run's events up to `seq`, rewinds honoured)
//! and the workspace version `snapshot` + the run's `file_change` events on that history
//! after `base_seq`. A root run's checkpoints carry their whole version (`base_seq ==
//! seq`); a branch run's carry the fork snapshot and `base_seq = 0`, so an automatic
//! checkpoint is one small record, no manifest, and the version is built only when used.
//!
//! # Automatic checkpoints
//! The fork actor applies each branch's events once, in seq order; its replica reports the
//! steps it applied (model responses, tool results, numbered), and [`AutoCheckpoints`]
//! turns them into checkpoints: `every_turn` saves `turn-N` at the event before the
//! response of model call N (N from 1), `every_tool` saves `tool-N-NAME` at the result of
//! tool call N. Beyond `max_checkpoints` automatic checkpoints the oldest automatic one of
//! the run is removed; named ones are never evicted. Events are applied once per (run,
//! seq), so a redelivery saves nothing. On load, the steps of the replicas' rebuild give
//! the points a crash between writing the events and the checkpoint lost, which are saved
//! (positions after the last automatic checkpoint, and after the run's mark, which a
//! removal by hand raises so nothing removed comes back).
//!
//! # Rewind
//! Appends `Rewind { to_seq }` to the run's log (which stays append-only): the history goes
//! on from the checkpoint's, so a later fork of the run copies the rewound conversation.
//! A root run's workspace version becomes the checkpoint's (its record); a branch run's
//! replica rebuilds its overlay from the file changes of the rewound history, so diffs
//! and merges see the rewound branch. A branch must have finished. The reply carries the
//! change log from the current version to the checkpoint's and both manifests, for a
//! client to apply to a directory with conflicts against the current version.
//!
//! # Files
//! This file holds the labels, versions, finding checkpoints and runs, named checkpoints
//! and the API; `checkpoint/auto.rs` the automatic checkpoints, `checkpoint/rewind.rs`
//! working out and writing a rewind, `checkpoint/new_run.rs` a new run from a checkpoint.

mod auto;
mod new_run;
mod rewind;

pub(crate) use auto::AutoCheckpoints;
pub(crate) use new_run::fork_from;
pub(crate) use rewind::{rewind_in_store, RewindPlan};

use crate::blobs;
use crate::error::{list, CoordinatorError};
use crate::replica::BranchReplica;
use crate::store::{BranchRecord, ForkRecord, RunRecord, RunStore};
use bytes::Bytes;
use forkfleet_bus::{Bus, BusError};
use forkfleet_shared::api::{CheckpointKind, CheckpointView};
use forkfleet_shared::blob::BlobHash;
use forkfleet_shared::event::{history_at, Event};
use forkfleet_shared::flush::needed_blobs;
use forkfleet_shared::ids::{CheckpointId, RunId};
use forkfleet_shared::manifest::Manifest;
use forkfleet_shared::overlay::{ChangeOp, Overlay};
use forkfleet_shared::protocol::now_ms;
use forkfleet_shared::spec::check_label;
use std::sync::Arc;

/// The label of the automatic checkpoint before model call `n` (from 1).
pub fn turn_label(n: u32) -> String {
    format!("turn-{n}")
}

/// The label of the automatic checkpoint after tool call `n` (from 1) of tool `name`.
pub fn tool_label(n: u32, name: &str) -> String {
    format!("tool-{n}-{name}")
}

/// The label of the checkpoint a run made by `checkpoint fork` starts with.
pub fn origin_label(source: RunId) -> String {
    format!("from:{source}")
}

/// True when a log holds a rewind (its replica's overlay is then rebuilt from the rewound
/// history, see [`rewound_overlay`]).
pub(crate) fn has_rewind(stored: &[(u64, Event)]) -> bool {
    stored
        .iter()
        .any(|(_, e)| matches!(e, Event::Rewind { .. }))
}

/// A branch's overlay as of the end of its (rewound) history.
pub(crate) fn rewound_overlay(
    base: &Arc<Manifest>,
    log: &[(u64, Event)],
) -> Result<Overlay, CoordinatorError> {
    let ops = file_changes(log, None, 0);
    Overlay::from_log(base.clone(), ops).map_err(|e| {
        CoordinatorError::Internal(format!("a rewound branch's changes do not apply: {e}"))
    })
}

/// Replace a replica's overlay by its rewound one (its `changes` count with it).
pub(crate) fn apply_rewind(
    replica: &mut BranchReplica,
    base: &Arc<Manifest>,
    log: &[(u64, Event)],
) -> Result<(), CoordinatorError> {
    let overlay = rewound_overlay(base, log)?;
    replica.record.changes = overlay.changes().len() as u64;
    replica.overlay = overlay;
    Ok(())
}

// ---- versions ---------------------------------------------------------------------------

/// The file changes on the history at `at` (the end with `None`) after `base_seq`.
fn file_changes(log: &[(u64, Event)], at: Option<u64>, base_seq: u64) -> Vec<&ChangeOp> {
    history_at(log, at)
        .into_iter()
        .filter_map(|i| match &log[i] {
            (seq, Event::FileChange { change }) if *seq > base_seq => Some(change),
            _ => None,
        })
        .collect()
}

fn read_manifest(store: &RunStore, hash: BlobHash) -> Result<Manifest, CoordinatorError> {
    let bytes = store
        .blob(&hash)?
        .ok_or_else(|| CoordinatorError::missing_blobs(&[hash]))?;
    Manifest::from_blob(&bytes).map_err(|e| CoordinatorError::BadSnapshot {
        hash,
        message: e.to_string(),
    })
}

/// A workspace version: its manifest and the blob it is stored as (in the run store).
struct Version {
    hash: BlobHash,
    manifest: Manifest,
}

/// The workspace version checkpoint `c` names, on `log` (its run's).
fn checkpoint_version(
    store: &RunStore,
    log: &[(u64, Event)],
    c: &CheckpointView,
) -> Result<Version, CoordinatorError> {
    version(store, log, c.snapshot, c.base_seq, c.seq)
}

/// [`version`] without storing it: the version, and its manifest blob's bytes when it is
/// not `snapshot` itself (for a caller that stores it later, or never: a dry run).
pub(crate) fn version_unstored(
    store: &RunStore,
    log: &[(u64, Event)],
    snapshot: BlobHash,
    base_seq: u64,
    at: u64,
) -> Result<(BlobHash, Manifest, Option<Bytes>), CoordinatorError> {
    let base = read_manifest(store, snapshot)?;
    let ops = file_changes(log, Some(at), base_seq);
    if ops.is_empty() {
        return Ok((snapshot, base, None));
    }
    let overlay = Overlay::from_log(Arc::new(base), ops).map_err(|e| {
        CoordinatorError::Internal(format!("the run's file changes do not apply: {e}"))
    })?;
    let manifest = overlay.to_manifest();
    let bytes = manifest
        .to_blob()
        .map_err(|e| CoordinatorError::codec("workspace manifest", e))?;
    Ok((BlobHash::of(&bytes), manifest, Some(bytes)))
}

/// `snapshot` with the file changes on the history at `at` after `base_seq`; stored as a
/// blob when it differs from the snapshot.
fn version(
    store: &RunStore,
    log: &[(u64, Event)],
    snapshot: BlobHash,
    base_seq: u64,
    at: u64,
) -> Result<Version, CoordinatorError> {
    let (hash, manifest, bytes) = version_unstored(store, log, snapshot, base_seq, at)?;
    if let Some(bytes) = bytes {
        store.blobs().put_trusted(hash, &bytes)?;
    }
    Ok(Version { hash, manifest })
}

/// A run as checkpoints see it.
enum RunKind {
    /// A root run: its record holds its workspace version.
    Root,
    /// A branch run: its version is the fork snapshot with its file changes.
    Branch {
        fork: Box<ForkRecord>,
        branch: Box<BranchRecord>,
    },
}

fn run_kind(store: &RunStore, run: &RunRecord) -> Result<RunKind, CoordinatorError> {
    let Some(fork_id) = run.fork_id else {
        return Ok(RunKind::Root);
    };
    let fork = store
        .fork(fork_id)?
        .ok_or_else(|| CoordinatorError::UnknownFork(fork_id.to_string()))?;
    let branch = store
        .branches(fork_id)?
        .into_iter()
        .find(|b| b.run_id == run.run_id)
        .ok_or(CoordinatorError::UnknownRun(run.run_id))?;
    Ok(RunKind::Branch {
        fork: Box::new(fork),
        branch: Box::new(branch),
    })
}

fn load_run(store: &RunStore, run: RunId) -> Result<RunRecord, CoordinatorError> {
    store.run(run)?.ok_or(CoordinatorError::UnknownRun(run))
}

/// The last seq of a log, or an error for a run without events.
fn last_seq(run: RunId, log: &[(u64, Event)]) -> Result<u64, CoordinatorError> {
    log.last()
        .map(|(s, _)| *s)
        .ok_or(CoordinatorError::EmptyLog(run))
}

/// The last seq of `run`'s log, which `checkpoint` must not be past (a log cut short
/// under it, e.g. a store restored from an older copy).
fn end_at_or_after(
    run: RunId,
    log: &[(u64, Event)],
    checkpoint: &CheckpointView,
) -> Result<u64, CoordinatorError> {
    let end = last_seq(run, log)?;
    if checkpoint.seq > end {
        return Err(CoordinatorError::CheckpointPastEnd {
            run,
            label: checkpoint.label.clone(),
            seq: checkpoint.seq,
            end,
        });
    }
    Ok(end)
}

/// The run's current version: a root run's record, or a branch's snapshot + changes.
fn current_version(
    store: &RunStore,
    run: &RunRecord,
    kind: &RunKind,
    log: &[(u64, Event)],
) -> Result<Version, CoordinatorError> {
    match kind {
        RunKind::Root => Ok(Version {
            hash: run.workspace,
            manifest: read_manifest(store, run.workspace)?,
        }),
        RunKind::Branch { fork, .. } => {
            version(store, log, fork.snapshot, 0, last_seq(run.run_id, log)?)
        }
    }
}

fn turns_at(log: &[(u64, Event)], at: u64) -> u32 {
    history_at(log, Some(at))
        .into_iter()
        .filter(|i| matches!(log[*i].1, Event::ModelResponse { .. }))
        .count() as u32
}

// ---- finding checkpoints and runs -------------------------------------------------------

/// What an unknown reference's error lists.
fn valid_checkpoints(all: &[CheckpointView]) -> String {
    if all.is_empty() {
        "it has no checkpoints (save one with `forkfleet checkpoint save RUN LABEL`)".to_string()
    } else {
        format!(
            "its checkpoints: {}",
            list(all.iter().map(|c| c.label.as_str()))
        )
    }
}

/// A run's checkpoint by full id, label (the first, in creation order), or unique prefix
/// of an id (4 characters or more).
pub(crate) fn find(
    store: &RunStore,
    run: RunId,
    reference: &str,
) -> Result<CheckpointView, CoordinatorError> {
    let reference = reference.trim();
    if let Ok(id) = reference.parse::<CheckpointId>() {
        if let Some(c) = store.checkpoint(run, id)? {
            return Ok(c);
        }
    }
    let all = store.checkpoints(run)?;
    if let Some(c) = all.iter().find(|c| c.label == reference) {
        return Ok(c.clone());
    }
    let lower = reference.to_ascii_lowercase();
    if lower.len() >= 4 {
        let matches: Vec<&CheckpointView> = all
            .iter()
            .filter(|c| c.id.to_string().starts_with(&lower))
            .collect();
        match matches.as_slice() {
            [one] => return Ok((*one).clone()),
            [] => {}
            many => {
                return Err(CoordinatorError::AmbiguousCheckpoint {
                    run,
                    reference: reference.to_string(),
                    count: many.len(),
                    matches: list(many.iter().map(|c| c.label.as_str())),
                })
            }
        }
    }
    Err(CoordinatorError::UnknownCheckpoint {
        run,
        reference: reference.to_string(),
        valid: valid_checkpoints(&all),
    })
}

/// A run by full id or unique prefix of its id.
pub(crate) fn find_run(store: &RunStore, prefix: &str) -> Result<RunId, CoordinatorError> {
    let needle = crate::prefix::needle(prefix);
    if let Ok(id) = needle.parse::<RunId>() {
        return match store.run(id)? {
            Some(_) => Ok(id),
            None => Err(CoordinatorError::UnknownRun(id)),
        };
    }
    if needle.is_empty() {
        return Err(CoordinatorError::MissingRunId);
    }
    let matches = store.run_ids_with_prefix(&needle, 11)?;
    crate::prefix::one_run(&matches, prefix)
}

// ---- named checkpoints ------------------------------------------------------------------

/// The rules of a label saved by hand: a branch label's characters (1 to 64 letters,
/// digits, `-`, `_`, `.`, not starting with `.`), not an automatic label's form
/// (`turn-`, `tool-`), not an id, and not used by another checkpoint of the run.
fn check_manual_label(store: &RunStore, run: RunId, label: &str) -> Result<(), CoordinatorError> {
    let label_owned = || label.to_string();
    if label.is_empty() {
        return Err(CoordinatorError::EmptyCheckpointLabel);
    }
    if let Err(e) = check_label(label) {
        return Err(CoordinatorError::BadCheckpointLabel {
            label: label_owned(),
            rule: e.to_string().replace("branch label", "checkpoint label"),
        });
    }
    if label.starts_with("turn-") || label.starts_with("tool-") {
        return Err(CoordinatorError::AutomaticCheckpointLabel {
            label: label_owned(),
        });
    }
    if label.parse::<CheckpointId>().is_ok() {
        return Err(CoordinatorError::CheckpointLabelIsId {
            label: label_owned(),
        });
    }
    if let Some(c) = store.checkpoint_by_label(run, label)? {
        return Err(CoordinatorError::CheckpointLabelTaken {
            run,
            label: label_owned(),
            seq: c.seq,
        });
    }
    Ok(())
}

/// Save checkpoint `label` at the run's current end, or at seq `at` (which its log must
/// hold).
pub(crate) fn save_named(
    store: &RunStore,
    run: RunId,
    label: &str,
    at: Option<u64>,
) -> Result<CheckpointView, CoordinatorError> {
    // A merge into this run must not append between reading its record and its log.
    let _parents = store.lock_parents();
    let record = load_run(store, run)?;
    check_manual_label(store, run, label)?;
    let kind = run_kind(store, &record)?;
    let log = store.run_log(run)?;
    let last = last_seq(run, &log)?;
    let seq = match at {
        Some(seq) if seq <= last => seq,
        Some(seq) => {
            return Err(CoordinatorError::BadRequest(format!(
                "run {run}'s log ends at seq {last}: no checkpoint at seq {seq}"
            )))
        }
        None => last,
    };
    let (snapshot, base_seq) = match &kind {
        RunKind::Root => (record.workspace, seq),
        RunKind::Branch { fork, .. } => (fork.snapshot, 0),
    };
    let c = CheckpointView {
        id: CheckpointId::new(),
        run_id: run,
        label: label.to_string(),
        seq,
        snapshot,
        created_at_ms: now_ms(),
        base_seq,
        turn: turns_at(&log, seq),
        kind: CheckpointKind::Named,
        metadata: Default::default(),
    };
    store.save_checkpoint(&c)?;
    store.flush()?;
    Ok(c)
}

/// Remove one checkpoint (by label or id). An automatic one raises the run's mark, so a
/// restart's repair does not bring it back.
pub(crate) fn remove(
    store: &RunStore,
    run: RunId,
    reference: &str,
) -> Result<CheckpointView, CoordinatorError> {
    load_run(store, run)?;
    let c = find(store, run, reference)?;
    store.remove_checkpoint(run, c.id)?;
    if c.kind == CheckpointKind::Auto {
        store.raise_checkpoint_mark(run, c.seq)?;
    }
    store.flush()?;
    Ok(c)
}

/// Remove every checkpoint of a run; returns them.
pub(crate) fn clear(store: &RunStore, run: RunId) -> Result<Vec<CheckpointView>, CoordinatorError> {
    load_run(store, run)?;
    let removed = store.clear_checkpoints(run)?;
    if let Some(seq) = removed
        .iter()
        .filter(|c| c.kind == CheckpointKind::Auto)
        .map(|c| c.seq)
        .max()
    {
        store.raise_checkpoint_mark(run, seq)?;
    }
    store.flush()?;
    Ok(removed)
}

// ---- blobs for clients ------------------------------------------------------------------

/// Put on the bus's blob store what a client applying these changes reads (both
/// manifests, the files written) and the run store has but the bus lacks (nothing to copy
/// when both are one store, embedded); `owner`, the account of the run's fork, owns them
/// (`crate::tenancy`), so its scoped clients read them.
pub(crate) async fn publish_blobs(
    store: &RunStore,
    bus: &Arc<dyn Bus>,
    owner: Option<&str>,
    manifests: &[BlobHash],
    changes: &[ChangeOp],
) -> Result<(), CoordinatorError> {
    let mut wanted: Vec<BlobHash> = manifests.to_vec();
    wanted.extend(needed_blobs(changes));
    wanted.sort_unstable();
    wanted.dedup();
    if let Some(account) = owner {
        store.own_blobs(account, wanted.iter().copied())?;
    }
    if blobs::shared_with_bus(store, bus) {
        return Ok(());
    }
    let missing = bus.blobs().missing(&wanted).await.map_err(BusError::from)?;
    for h in missing {
        if let Some(bytes) = store.blob(&h)? {
            bus.blobs()
                .put(h, Bytes::copy_from_slice(&bytes))
                .await
                .map_err(BusError::from)?;
        }
    }
    Ok(())
}
