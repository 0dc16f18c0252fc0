//! A new root run from a checkpoint: the source run's conversation up to it, on its
//! workspace version, starting with checkpoint `from:<run>`.

use super::{checkpoint_version, end_at_or_after, find, load_run, origin_label};
use crate::error::CoordinatorError;
use crate::store::{RunRecord, RunStore};
use forkfleet_shared::api::{CheckpointKind, CheckpointView, NewRunOutcome};
use forkfleet_shared::event::{history_at, Event};
use forkfleet_shared::ids::{CheckpointId, RunId};
use forkfleet_shared::protocol::now_ms;

/// Write a new root run whose log is `run`'s conversation up to the checkpoint and whose
/// workspace is the checkpoint's version, with checkpoint `from:<run>` at its end.
pub(crate) fn fork_from(
    store: &RunStore,
    run: RunId,
    reference: &str,
) -> Result<NewRunOutcome, CoordinatorError> {
    let source = load_run(store, run)?;
    let checkpoint = find(store, run, reference)?;
    let log = store.run_log(run)?;
    end_at_or_after(run, &log, &checkpoint)?;
    let events: Vec<&Event> = history_at(&log, Some(checkpoint.seq))
        .into_iter()
        .map(|i| &log[i].1)
        .filter(|e| e.is_conversational())
        .collect();
    if events.is_empty() {
        return Err(CoordinatorError::NoConversation {
            run,
            label: checkpoint.label.clone(),
        });
    }
    let v = checkpoint_version(store, &log, &checkpoint)?;
    let now = now_ms();
    let run_id = RunId::new();
    let n = events.len() as u64;
    let record = RunRecord {
        run_id,
        parent: None,
        fork_id: None,
        fork_root: run_id,
        depth: 0,
        workspace: v.hash,
        next_seq: n,
        created_at_ms: now,
    };
    let mut metadata = std::collections::BTreeMap::new();
    metadata.insert("source_run".to_string(), run.to_string());
    metadata.insert("source_checkpoint".to_string(), checkpoint.label.clone());
    metadata.insert("source_seq".to_string(), checkpoint.seq.to_string());
    let origin = CheckpointView {
        id: CheckpointId::new(),
        run_id,
        label: origin_label(run),
        seq: n - 1,
        snapshot: v.hash,
        created_at_ms: now,
        base_seq: n - 1,
        turn: events
            .iter()
            .filter(|e| matches!(e, Event::ModelResponse { .. }))
            .count() as u32,
        kind: CheckpointKind::Named,
        metadata,
    };
    store.put_events(
        events
            .iter()
            .enumerate()
            .map(|(i, e)| (run_id, i as u64, *e)),
    )?;
    store.save_checkpoint(&origin)?;
    // The record last: a crash half-way leaves no reachable run.
    store.put_run(&record)?;
    store.flush()?;
    tracing::info!(run.id = %run_id, source.run = %source.run_id, checkpoint = %checkpoint.label, events = n, "checkpoint.fork: a new run");
    Ok(NewRunOutcome {
        run_id,
        source_run: run,
        source: checkpoint,
        events: n,
        snapshot: v.hash,
    })
}
