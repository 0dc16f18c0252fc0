//! Housekeeping (`fork rm`, `forkfleet gc`): deleting finished forks and the blobs nothing
//! refers to any more.
//!
//! A fork is deleted with its branch runs (records, events, checkpoints, fenced calls), its
//! branch records, resolve report and caps. It is kept, and the report says why, when it
//! is not finished (a branch pending, running, paused or waiting for approval), when it
//! charges an account (its spend stays on the account's books, which are rebuilt from the
//! logs), or when a run that stays refers to one of its runs: a fork made from a branch run
//! (an agent's fork, a `runs fork` child), a run started from one of its checkpoints. A
//! fork referred to only by forks deleted with it goes too.
//!
//! Blobs are then swept, mark and sweep: every blob a remaining fork, run, checkpoint or
//! event names (snapshots, prefixes, scripts, replay records, file contents, and every
//! file of every manifest among them) is kept; any other blob stored more than
//! [`BLOB_GRACE`] ago goes (a blob stored within it may belong to a fork being created:
//! its client uploads before it asks). On a cluster the bus's buckets are swept with the
//! same marks (a blob whose age the bucket does not tell is kept). A dry run deletes
//! nothing and reports the same.

use crate::error::CoordinatorError;
use crate::handle::CoordinatorHandle;
use crate::store::{ForkRecord, RunStore};
use forkfleet_shared::api::{GcReport, KeptFork};
use forkfleet_shared::blob::BlobHash;
use forkfleet_shared::event::Event;
use forkfleet_shared::ids::{ForkId, RunId};
use forkfleet_shared::manifest::Manifest;
use forkfleet_shared::protocol::now_ms;
use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::time::{Duration, SystemTime};

/// Blob files stored more recently than this are never swept.
pub(crate) const BLOB_GRACE: Duration = Duration::from_secs(600);

/// Which forks a collection may delete.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Pick {
    /// Merged or aborted forks created at least this long ago (`None`: any age).
    OlderThan(Option<Duration>),
    /// This one (`fork rm`): merged, aborted, or every branch finished.
    One(ForkId),
}

/// Delete what `pick` selects (nothing with `dry_run`) and sweep the blobs.
pub(crate) async fn collect(
    handle: &CoordinatorHandle,
    pick: Pick,
    dry_run: bool,
    grace: Option<Duration>,
) -> Result<GcReport, CoordinatorError> {
    let grace = grace.unwrap_or(BLOB_GRACE);
    // `fork rm` of a fork that is still running is refused before anything.
    if let Pick::One(id) = pick {
        let view = handle.fork(id).await?;
        if !view.state.is_resolved() && !view.settled() {
            let unfinished = view
                .branches
                .iter()
                .filter(|b| !b.state.is_terminal())
                .map(|b| format!("`{}` ({})", b.label, b.state))
                .collect();
            return Err(CoordinatorError::RemoveUnfinished {
                fork: id,
                unfinished,
            });
        }
    }
    let store = handle.store().clone();
    let plan = tokio::task::spawn_blocking(move || plan(&store, pick)).await??;
    if let Pick::One(id) = pick {
        if let Some(k) = plan.kept.iter().find(|k| k.fork_id == id) {
            return Err(CoordinatorError::RemoveRefused {
                fork: id,
                why: k.why.clone(),
            });
        }
    }
    if !dry_run {
        for fork in &plan.remove {
            handle.root().remove(fork.fork_id).await?;
            handle.ledger().forget_fork(fork.fork_id);
        }
    }
    let store = handle.store().clone();
    let (mut report, marked, mut gone) =
        tokio::task::spawn_blocking(move || apply(&store, plan, dry_run, grace)).await??;
    if !dry_run {
        handle.store().flush_async().await?;
    }
    // On a cluster the bus's buckets hold blobs too (uploads, prefixes): the same marks.
    let bus = handle.bus();
    if !crate::blobs::shared_with_bus(handle.store(), &bus) {
        let since = SystemTime::now()
            .checked_sub(grace)
            .unwrap_or(SystemTime::UNIX_EPOCH);
        let blobs = bus.blobs();
        match blobs.list().await {
            Ok(listed) => {
                for (hash, stored) in listed {
                    // Unknown age: kept, as a recent one is.
                    if marked.contains(&hash) || stored.is_none_or(|t| t > since) {
                        continue;
                    }
                    if !dry_run {
                        blobs
                            .delete(&hash)
                            .await
                            .map_err(forkfleet_bus::BusError::from)?;
                        gone.insert(hash);
                    }
                    report.bus_blobs += 1;
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "gc: the bus's blobs cannot be listed; left as they are")
            }
        }
    }
    // What is gone no longer counts against anyone's quota, nor makes anyone its owner.
    if !gone.is_empty() {
        handle.blocking(move |s| s.forget_blobs(&gone)).await?;
    }
    tracing::info!(
        removed = report.removed.len(),
        kept = report.kept.len(),
        blobs = report.blobs,
        blob_bytes = report.blob_bytes,
        dry_run,
        "gc done"
    );
    Ok(report)
}

/// What a collection will delete.
struct Plan {
    remove: Vec<ForkRecord>,
    /// The branch runs of each fork removed.
    runs: BTreeMap<ForkId, Vec<RunId>>,
    kept: Vec<KeptFork>,
}

/// Decide which forks go (reads only).
fn plan(store: &RunStore, pick: Pick) -> Result<Plan, CoordinatorError> {
    let forks = store.forks()?;
    let now = now_ms();
    let mut candidates: BTreeMap<ForkId, ForkRecord> = forks
        .iter()
        .filter(|f| match pick {
            Pick::One(id) => f.fork_id == id,
            Pick::OlderThan(age) => {
                f.state.is_resolved()
                    && age
                        .is_none_or(|a| f.created_at_ms <= now.saturating_sub(a.as_millis() as u64))
            }
        })
        .map(|f| (f.fork_id, f.clone()))
        .collect();
    let mut kept = Vec::new();
    // A fork charging an account stays: the account's spend is rebuilt from its forks'
    // logs, so deleting one would give its money back.
    candidates.retain(|id, f| match &f.plan.budget.account {
        Some(account) => {
            kept.push(KeptFork {
                fork_id: *id,
                why: format!(
                    "it charges account `{account}`, whose spend is counted from its forks' logs"
                ),
            });
            false
        }
        None => true,
    });
    let mut runs: BTreeMap<ForkId, Vec<RunId>> = BTreeMap::new();
    for id in candidates.keys() {
        runs.insert(
            *id,
            store.branches(*id)?.into_iter().map(|b| b.run_id).collect(),
        );
    }
    // Who refers to a run, and the fork the referrer belongs to (`None`: a root run): runs
    // forked from it (a fork's branch runs, an agent's fork's, a `runs fork` child's) and
    // runs started from one of its checkpoints.
    let mut referrers: BTreeMap<RunId, Vec<(Option<ForkId>, String)>> = BTreeMap::new();
    for r in store.runs()? {
        if let Some(parent) = r.parent {
            referrers.entry(parent).or_default().push((
                r.fork_id,
                format!("run {} was forked from its run {parent}", r.run_id),
            ));
        }
        for c in store.checkpoints(r.run_id)? {
            let source = c
                .metadata
                .get("source_run")
                .and_then(|s| s.parse::<RunId>().ok());
            if let Some(source) = source {
                referrers.entry(source).or_default().push((
                    r.fork_id,
                    format!(
                        "run {} was started from a checkpoint of its run {source}",
                        r.run_id
                    ),
                ));
            }
        }
    }
    // A fork stays while something that stays refers to one of its runs; forks going
    // together may refer to each other.
    loop {
        let mut dropped = Vec::new();
        for (id, rs) in &runs {
            let outside = rs.iter().find_map(|r| {
                referrers
                    .get(r)?
                    .iter()
                    .find(|(fork, _)| fork.is_none_or(|f| !runs.contains_key(&f)))
            });
            if let Some((_, why)) = outside {
                dropped.push((*id, why.clone()));
            }
        }
        if dropped.is_empty() {
            break;
        }
        for (id, why) in dropped {
            runs.remove(&id);
            candidates.remove(&id);
            kept.push(KeptFork {
                fork_id: id,
                why: format!("{why}, which stays"),
            });
        }
    }
    Ok(Plan {
        remove: candidates.into_values().collect(),
        runs,
        kept,
    })
}

/// Delete the plan's forks (unless `dry_run`), then sweep the blobs nothing that stays
/// names.
fn apply(
    store: &RunStore,
    plan: Plan,
    dry_run: bool,
    grace: Duration,
) -> Result<(GcReport, BTreeSet<BlobHash>, HashSet<BlobHash>), CoordinatorError> {
    let removed_runs: HashSet<RunId> = plan.runs.values().flatten().copied().collect();
    let removed_forks: HashSet<ForkId> = plan.remove.iter().map(|f| f.fork_id).collect();
    let mut report = GcReport {
        removed: plan.remove.iter().map(|f| f.fork_id).collect(),
        workspaces: plan
            .remove
            .iter()
            .filter_map(|f| Some((f.fork_id, f.workspace.clone()?)))
            .collect(),
        kept: plan.kept,
        runs: removed_runs.len(),
        dry_run,
        ..GcReport::default()
    };
    for f in &plan.remove {
        let runs = plan.runs.get(&f.fork_id).cloned().unwrap_or_default();
        // A dry run counts what the deletion would.
        let (events, checkpoints) = if dry_run {
            let mut counts = (0, 0);
            for run in &runs {
                counts.0 += store.run_event_count(*run)?;
                counts.1 += store.checkpoints(*run)?.len();
            }
            counts
        } else {
            store.delete_fork(f.fork_id, &runs)?
        };
        report.events += events;
        report.checkpoints += checkpoints;
    }
    // Mark: everything that stays.
    let mut marked: BTreeSet<BlobHash> = BTreeSet::new();
    let mut manifests: BTreeSet<BlobHash> = BTreeSet::new();
    for f in store.forks()? {
        if removed_forks.contains(&f.fork_id) {
            continue;
        }
        manifests.insert(f.snapshot);
        marked.insert(f.prefix);
        marked.extend(f.plan.models.values().filter_map(|m| m.script));
        if let Some(r) = &f.replay {
            marked.insert(r.record);
        }
        if let Some(r) = store.resolution(f.fork_id)? {
            if let Some(m) = &r.merge {
                manifests.insert(m.fork_snapshot);
                manifests.insert(m.merged_snapshot);
            }
        }
    }
    for r in store.runs()? {
        if removed_runs.contains(&r.run_id) {
            continue;
        }
        manifests.insert(r.workspace);
        for c in store.checkpoints(r.run_id)? {
            manifests.insert(c.snapshot);
        }
        for (_, e) in store.stored_events(r.run_id)? {
            if let Event::FileChange { change } = e {
                if let Some(entry) = change.written() {
                    marked.insert(entry.hash);
                }
            }
        }
    }
    for m in &manifests {
        marked.insert(*m);
        if let Some(bytes) = store.blob(m)? {
            if let Ok(manifest) = Manifest::from_blob(&bytes) {
                marked.extend(manifest.files.values().map(|e| e.hash));
            }
        }
    }
    // Sweep: the rest, past the grace period.
    let mut gone = HashSet::new();
    let grace = SystemTime::now()
        .checked_sub(grace)
        .unwrap_or(SystemTime::UNIX_EPOCH);
    for (hash, len, modified) in store.blobs().stored()? {
        if marked.contains(&hash) || modified.is_some_and(|m| m > grace) {
            continue;
        }
        if !dry_run {
            store.blobs().remove(&hash)?;
            gone.insert(hash);
        }
        report.blobs += 1;
        report.blob_bytes += len;
    }
    Ok((report, marked, gone))
}
