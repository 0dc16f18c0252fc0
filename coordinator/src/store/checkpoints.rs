//! The checkpoint store: the reference's `CheckpointStore` protocol (save, get, get by
//! label, list, remove, remove oldest, count, clear), scoped to one run.
//!
//! A checkpoint lives in tree `checkpoints` under run id ++ checkpoint id. Ids are UUID v7
//! made when the checkpoint is, so a run's keys list in creation order; saving an existing
//! id overwrites it in place. `remove_oldest` goes by `created_at_ms` (ties by id), as the
//! reference's stores do, so clock skew or an overwrite cannot make the two orders evict
//! differently.

use super::{decode, encode, event_key, pair_key, transaction_error, RunRecord, RunStore};
use crate::error::CoordinatorError;
use forkfleet_shared::api::CheckpointView;
use forkfleet_shared::event::Event;
use forkfleet_shared::ids::{CheckpointId, RunId};

fn checkpoint_from(key: &[u8], value: &[u8]) -> Result<CheckpointView, CoordinatorError> {
    let mut c: CheckpointView = decode("checkpoint", value)?;
    // Records written before ids were stored in them take theirs from the key.
    if let Some(id) = key.get(16..32).and_then(|b| <[u8; 16]>::try_from(b).ok()) {
        c.id = CheckpointId::from_bytes(id);
    }
    Ok(c)
}

impl RunStore {
    /// Save a checkpoint, or overwrite the one with its id (not flushed).
    pub fn save_checkpoint(&self, c: &CheckpointView) -> Result<(), CoordinatorError> {
        let key = pair_key(c.run_id.as_bytes(), c.id.as_bytes());
        self.inner
            .checkpoints
            .insert(key, encode("checkpoint", c)?)?;
        Ok(())
    }

    /// The checkpoint `id` of `run`.
    pub fn checkpoint(
        &self,
        run: RunId,
        id: CheckpointId,
    ) -> Result<Option<CheckpointView>, CoordinatorError> {
        let key = pair_key(run.as_bytes(), id.as_bytes());
        match self.inner.checkpoints.get(key)? {
            Some(v) => Ok(Some(checkpoint_from(&key, &v)?)),
            None => Ok(None),
        }
    }

    /// The first checkpoint of `run` (in creation order) labelled `label`.
    pub fn checkpoint_by_label(
        &self,
        run: RunId,
        label: &str,
    ) -> Result<Option<CheckpointView>, CoordinatorError> {
        for kv in self.inner.checkpoints.scan_prefix(run.as_bytes()) {
            let (k, v) = kv?;
            let c = checkpoint_from(&k, &v)?;
            if c.label == label {
                return Ok(Some(c));
            }
        }
        Ok(None)
    }

    /// A run's checkpoints in creation order.
    pub fn checkpoints(&self, run: RunId) -> Result<Vec<CheckpointView>, CoordinatorError> {
        let mut out = Vec::new();
        for kv in self.inner.checkpoints.scan_prefix(run.as_bytes()) {
            let (k, v) = kv?;
            out.push(checkpoint_from(&k, &v)?);
        }
        Ok(out)
    }

    /// Remove checkpoint `id` of `run`: true if it existed (not flushed).
    pub fn remove_checkpoint(
        &self,
        run: RunId,
        id: CheckpointId,
    ) -> Result<bool, CoordinatorError> {
        let key = pair_key(run.as_bytes(), id.as_bytes());
        Ok(self.inner.checkpoints.remove(key)?.is_some())
    }

    /// Remove the checkpoint of `run` created first (by `created_at_ms`, ties by id):
    /// true if there was one (not flushed).
    pub fn remove_oldest_checkpoint(&self, run: RunId) -> Result<bool, CoordinatorError> {
        let oldest = self
            .checkpoints(run)?
            .into_iter()
            .min_by_key(|c| (c.created_at_ms, c.id));
        match oldest {
            Some(c) => self.remove_checkpoint(run, c.id),
            None => Ok(false),
        }
    }

    /// How many checkpoints `run` has.
    pub fn checkpoint_count(&self, run: RunId) -> Result<usize, CoordinatorError> {
        let mut n = 0;
        for kv in self.inner.checkpoints.scan_prefix(run.as_bytes()).keys() {
            kv?;
            n += 1;
        }
        Ok(n)
    }

    /// Remove every checkpoint of `run`; returns them, in creation order (not flushed).
    pub fn clear_checkpoints(&self, run: RunId) -> Result<Vec<CheckpointView>, CoordinatorError> {
        let all = self.checkpoints(run)?;
        let mut batch = sled::Batch::default();
        for c in &all {
            batch.remove(&pair_key(run.as_bytes(), c.id.as_bytes()));
        }
        self.inner.checkpoints.apply_batch(batch)?;
        Ok(all)
    }

    // ---- what checkpoints need besides ------------------------------------------------

    /// Up to `limit` runs whose id (as text, lower case) starts with `prefix`, else ends with
    /// it (at least `crate::prefix::MIN_TAIL` characters: a random tail).
    pub(crate) fn run_ids_with_prefix(
        &self,
        prefix: &str,
        limit: usize,
    ) -> Result<Vec<RunId>, CoordinatorError> {
        // By the id's start; when nothing starts so, by its random tail
        // (`crate::prefix::matching`'s rule).
        for tail in [false, true] {
            let mut out = Vec::new();
            for k in self.inner.runs.iter().keys() {
                let k = k?;
                let Ok(bytes) = <[u8; 16]>::try_from(k.as_ref()) else {
                    continue;
                };
                let id = RunId::from_bytes(bytes);
                if crate::prefix::id_matches(&id.to_string(), prefix, tail) {
                    out.push(id);
                    if out.len() >= limit {
                        break;
                    }
                }
            }
            if !out.is_empty() {
                return Ok(out);
            }
        }
        Ok(Vec::new())
    }

    /// Write a root run's rewind in one transaction: the marker event at `seq` and the
    /// run's record (its new workspace version and next seq); then flush.
    pub(crate) fn commit_rewind(
        &self,
        run: &RunRecord,
        seq: u64,
        marker: &Event,
    ) -> Result<(), CoordinatorError> {
        use sled::transaction::{ConflictableTransactionError, Transactional};
        let run_bytes = encode("run record", run)?;
        let event_bytes = encode("event", marker)?;
        let key = event_key(run.run_id, seq);
        let i = &self.inner;
        (&i.runs, &i.events)
            .transaction(|(runs, events)| {
                events.insert(&key[..], event_bytes.as_slice())?;
                runs.insert(run.run_id.as_bytes(), run_bytes.as_slice())?;
                Ok::<(), ConflictableTransactionError<()>>(())
            })
            .map_err(|e| transaction_error("rewind", e))?;
        self.flush()
    }

    /// The highest seq of an automatic checkpoint of `run` removed by hand (0: none).
    pub(crate) fn checkpoint_mark(&self, run: RunId) -> Result<u64, CoordinatorError> {
        Ok(self
            .inner
            .checkpoint_marks
            .get(run.as_bytes())?
            .and_then(|v| <[u8; 8]>::try_from(v.as_ref()).ok())
            .map_or(0, u64::from_be_bytes))
    }

    /// Raise `run`'s mark to `seq` (never lowers it).
    pub(crate) fn raise_checkpoint_mark(
        &self,
        run: RunId,
        seq: u64,
    ) -> Result<(), CoordinatorError> {
        if seq > self.checkpoint_mark(run)? {
            self.inner
                .checkpoint_marks
                .insert(run.as_bytes(), &seq.to_be_bytes())?;
        }
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use forkfleet_shared::api::CheckpointKind;
    use forkfleet_shared::blob::BlobHash;

    fn cp(run: RunId, label: &str, seq: u64, created_at_ms: u64) -> CheckpointView {
        CheckpointView {
            id: CheckpointId::new(),
            run_id: run,
            label: label.into(),
            seq,
            snapshot: BlobHash::of(b"m"),
            created_at_ms,
            base_seq: 0,
            turn: 0,
            kind: CheckpointKind::Auto,
            metadata: Default::default(),
        }
    }

    fn store() -> (tempfile::TempDir, RunStore) {
        let dir = tempfile::tempdir().unwrap();
        let store = RunStore::open(dir.path()).unwrap();
        (dir, store)
    }

    fn labels(store: &RunStore, run: RunId) -> Vec<String> {
        store
            .checkpoints(run)
            .unwrap()
            .into_iter()
            .map(|c| c.label)
            .collect()
    }

    #[test]
    fn save_get_and_overwrite_by_id() {
        let (_d, store) = store();
        let run = RunId::new();
        let a = cp(run, "a", 3, 10);
        store.save_checkpoint(&a).unwrap();
        assert_eq!(store.checkpoint(run, a.id).unwrap(), Some(a.clone()));
        // Another run's key space is separate.
        assert_eq!(store.checkpoint(RunId::new(), a.id).unwrap(), None);
        assert_eq!(store.checkpoint(run, CheckpointId::new()).unwrap(), None);
        let b = cp(run, "b", 4, 11);
        store.save_checkpoint(&b).unwrap();
        let mut a2 = a.clone();
        a2.label = "a-renamed".into();
        store.save_checkpoint(&a2).unwrap();
        assert_eq!(store.checkpoint_count(run).unwrap(), 2);
        // Overwritten in place: still first.
        assert_eq!(labels(&store, run), ["a-renamed", "b"]);
    }

    #[test]
    fn get_by_label_is_the_first_match_in_creation_order() {
        let (_d, store) = store();
        let run = RunId::new();
        let first = cp(run, "same", 1, 10);
        let second = cp(run, "same", 2, 11);
        store.save_checkpoint(&first).unwrap();
        store.save_checkpoint(&second).unwrap();
        store
            .save_checkpoint(&cp(RunId::new(), "same", 9, 1))
            .unwrap();
        assert_eq!(
            store
                .checkpoint_by_label(run, "same")
                .unwrap()
                .map(|c| c.id),
            Some(first.id)
        );
        assert_eq!(store.checkpoint_by_label(run, "nope").unwrap(), None);
    }

    #[test]
    fn list_remove_count_and_clear() {
        let (_d, store) = store();
        let run = RunId::new();
        let other = RunId::new();
        let cps: Vec<CheckpointView> = (0..4)
            .map(|i| cp(run, &format!("c{i}"), i, 100 + i))
            .collect();
        for c in &cps {
            store.save_checkpoint(c).unwrap();
        }
        store.save_checkpoint(&cp(other, "x", 0, 1)).unwrap();
        assert_eq!(labels(&store, run), ["c0", "c1", "c2", "c3"]);
        assert_eq!(store.checkpoint_count(run).unwrap(), 4);
        assert!(store.remove_checkpoint(run, cps[1].id).unwrap());
        assert!(
            !store.remove_checkpoint(run, cps[1].id).unwrap(),
            "already gone"
        );
        assert_eq!(labels(&store, run), ["c0", "c2", "c3"]);
        let cleared = store.clear_checkpoints(run).unwrap();
        assert_eq!(cleared.len(), 3);
        assert_eq!(store.checkpoint_count(run).unwrap(), 0);
        assert!(store.checkpoints(run).unwrap().is_empty());
        assert_eq!(
            store.checkpoint_count(other).unwrap(),
            1,
            "other runs untouched"
        );
    }

    #[test]
    fn remove_oldest_goes_by_creation_time_not_key_order() {
        let (_d, store) = store();
        let run = RunId::new();
        // Saved first (smaller id) but created later, e.g. by a skewed clock.
        let late = cp(run, "late", 1, 500);
        let early = cp(run, "early", 2, 100);
        store.save_checkpoint(&late).unwrap();
        store.save_checkpoint(&early).unwrap();
        assert!(store.remove_oldest_checkpoint(run).unwrap());
        assert_eq!(labels(&store, run), ["late"]);
        assert!(store.remove_oldest_checkpoint(run).unwrap());
        assert!(!store.remove_oldest_checkpoint(run).unwrap(), "none left");
    }

    #[test]
    fn marks_only_rise() {
        let (_d, store) = store();
        let run = RunId::new();
        assert_eq!(store.checkpoint_mark(run).unwrap(), 0);
        store.raise_checkpoint_mark(run, 7).unwrap();
        store.raise_checkpoint_mark(run, 3).unwrap();
        assert_eq!(store.checkpoint_mark(run).unwrap(), 7);
    }
}
