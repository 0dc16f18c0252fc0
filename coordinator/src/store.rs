//! The run store: sled under a data dir.
//!
//! | tree          | key                                  | value (rmp, named fields)  |
//! |---------------|--------------------------------------|----------------------------|
//! | `runs`        | run id (16 bytes)                    | [`RunRecord`]              |
//! | `events`      | run id ++ seq (u64 big-endian)       | [`Event`], or consecutive ones from that seq as an array (`store/events.rs`) |
//! | `forks`       | fork id                              | [`ForkRecord`]             |
//! | `branches`    | fork id ++ run id                    | [`BranchRecord`]           |
//! | `checkpoints` | run id ++ checkpoint id              | [`CheckpointView`]         |
//! | `checkpoint_marks` | run id                          | u64: automatic checkpoints removed by hand up to this seq |
//! | `blobs`       | blob hash (32 bytes)                 | the bytes (up to 1 KiB)    |
//! | `blob_files`  | blob hash (32 bytes)                 | length of a larger blob, whose bytes are the file `blob-files/<hex>` of the data dir |
//! | `accounts`    | account name                         | [`AccountRecord`]          |
//! | `reservations`| reservation id                       | [`ReservationRecord`]      |
//! | `caps`        | fork id, or fork id ++ run id        | `Option<f64>`: a cap after top-ups |
//! | `fenced_usage`| run id ++ attempt ++ seq             | `f64`: a fenced attempt's call cost (ADR 18) |
//!
//! Beside sled's files, the file `store-id` holds the store's id (see [`store_id`]).
//!
//! Ids are UUID v7, so every prefix scan comes back in creation order and a run's events
//! in seq order. The event log is the source of truth for a branch: its record's counters
//! are a snapshot written when its state changes, and the replica is rebuilt from the log
//! on start.
//!
//! Writes are not flushed one by one: the event loop writes a batch, then
//! [`RunStore::flush_async`], then acks (acked means durable). Creation and merge flush
//! before they return.

mod blobs;
mod checkpoints;
mod events;
pub(crate) use events::EventWrites;
mod fenced;
mod id;
mod owners;
pub(crate) use owners::charged;
mod records;

pub use blobs::SledBlobStore;
pub use id::{store_id, STORE_ID_FILE};
pub(crate) use records::{
    AccountRecord, BranchRecord, ForkRecord, Queued, ReservationRecord, RunRecord, PREVIEW_CHARS,
};

use crate::error::CoordinatorError;
use bytes::Bytes;
use forkfleet_shared::api::CheckpointView;
use forkfleet_shared::blob::{BlobHash, BlobStore};
use forkfleet_shared::event::Event;
use forkfleet_shared::ids::{ForkId, ReservationId, RunId};
use forkfleet_shared::manifest::Manifest;
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

/// sled's page cache; the default (1 GB) would let the store alone exceed the memory
/// budget of a whole embedded run.
const CACHE_BYTES: u64 = 32 * 1024 * 1024;

/// Entries per tree.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StoreCounts {
    pub runs: usize,
    pub events: usize,
    pub forks: usize,
    pub branches: usize,
    pub checkpoints: usize,
    pub blobs: usize,
}

/// A cap changed after creation: the branch's (`Some(run)`) or the fork's (`None`), and
/// its new value.
pub(crate) type CapOverride = (Option<RunId>, f64);

/// The coordinator's durable state. Cheap to clone: every clone is the same database.
#[derive(Clone)]
pub struct RunStore {
    inner: Arc<Inner>,
}

struct Inner {
    dir: PathBuf,
    /// The store id (`store-id` in the data dir).
    id: String,
    db: sled::Db,
    runs: sled::Tree,
    events: sled::Tree,
    forks: sled::Tree,
    branches: sled::Tree,
    checkpoints: sled::Tree,
    /// run id -> the highest seq of an automatic checkpoint removed by hand (u64 BE), so
    /// a restart's repair does not save it again (see `checkpoint.rs`).
    checkpoint_marks: sled::Tree,
    accounts: sled::Tree,
    reservations: sled::Tree,
    caps: sled::Tree,
    blobs: SledBlobStore,
    /// The same store as a trait object, made once: the embedded mode hands it to the bus,
    /// and `Arc::ptr_eq` then tells the coordinator the bus's blobs are its own.
    blob_store: Arc<dyn BlobStore>,
    /// Serialises the read-modify-write of parent runs (fork creation from an existing
    /// run, merges), which several fork actors may do at once.
    parent_lock: Mutex<()>,
    /// One `flush_async` at a time (see [`RunStore::flush_async`]).
    flush_lock: tokio::sync::Mutex<()>,
    /// Flush requests made, and the highest request a finished flush covered.
    flush_requested: std::sync::atomic::AtomicU64,
    /// The blob quota of each identity and account (`crate::tenancy`), set by the
    /// coordinator at start; unlimited until then.
    blob_quota: std::sync::atomic::AtomicU64,
    flush_done: std::sync::atomic::AtomicU64,
    /// fork id -> the last ResolveReport
    resolutions: sled::Tree,
    /// Manifests decoded, by blob hash, while something holds them (see
    /// [`RunStore::manifest`]).
    manifests: Mutex<std::collections::HashMap<BlobHash, std::sync::Weak<Manifest>>>,
}

pub(crate) fn event_key(run: RunId, seq: u64) -> [u8; 24] {
    let mut k = [0u8; 24];
    k[..16].copy_from_slice(run.as_bytes());
    k[16..].copy_from_slice(&seq.to_be_bytes());
    k
}

fn pair_key(a: &[u8; 16], b: &[u8; 16]) -> [u8; 32] {
    let mut k = [0u8; 32];
    k[..16].copy_from_slice(a);
    k[16..].copy_from_slice(b);
    k
}

/// A failed sled transaction of `what` (a merge, a rewind) as an error. Its closure never
/// aborts on purpose, so an abort is a bug.
pub(crate) fn transaction_error(
    what: &str,
    e: sled::transaction::TransactionError<()>,
) -> CoordinatorError {
    match e {
        sled::transaction::TransactionError::Storage(e) => CoordinatorError::Store(e),
        sled::transaction::TransactionError::Abort(()) => {
            CoordinatorError::Internal(format!("{what} transaction aborted"))
        }
    }
}

pub(crate) fn encode<T: Serialize>(what: &'static str, v: &T) -> Result<Vec<u8>, CoordinatorError> {
    rmp_serde::to_vec_named(v).map_err(|e| CoordinatorError::codec(what, e))
}

pub(crate) fn decode<T: DeserializeOwned>(
    what: &'static str,
    bytes: &[u8],
) -> Result<T, CoordinatorError> {
    rmp_serde::from_slice(bytes).map_err(|e| CoordinatorError::codec(what, e))
}

/// How long `open` retries a locked store before saying another process holds it.
const LOCK_RETRY_FOR: std::time::Duration = std::time::Duration::from_secs(2);
const LOCK_RETRY_PAUSE: std::time::Duration = std::time::Duration::from_millis(50);

impl RunStore {
    /// Open (or create) the store in `data_dir`. A store another process holds open is a
    /// [`CoordinatorError::StoreLocked`] naming the directory.
    pub fn open(data_dir: &Path) -> Result<RunStore, CoordinatorError> {
        // Absolute from here on: the kept command trees below it are mounted by a child
        // that has changed directory (a relative `lowerdir` would name nothing there).
        let dir = std::path::absolute(data_dir).map_err(|e| CoordinatorError::StoreOpen {
            dir: data_dir.to_path_buf(),
            message: format!("cannot make the path absolute: {e}"),
        })?;
        let id = store_id(&dir)?;
        // A store closed a moment ago in this process keeps its lock until sled's background
        // flusher lets go (well under a second); another process's lock stays. Retry briefly.
        let deadline = std::time::Instant::now() + LOCK_RETRY_FOR;
        let db = loop {
            match sled::Config::new()
                .path(&dir)
                .cache_capacity(CACHE_BYTES)
                .open()
            {
                Ok(db) => break db,
                Err(e) => {
                    let message = e.to_string();
                    if !message.contains("could not acquire lock") {
                        return Err(CoordinatorError::StoreOpen {
                            dir: dir.clone(),
                            message,
                        });
                    }
                    if std::time::Instant::now() >= deadline {
                        return Err(CoordinatorError::StoreLocked {
                            dir: dir.clone(),
                            message,
                        });
                    }
                    std::thread::sleep(LOCK_RETRY_PAUSE);
                }
            }
        };
        let tree = |name: &str| db.open_tree(name);
        let blobs = SledBlobStore::open(tree("blobs")?, tree("blob_files")?, &dir)?;
        let inner = Inner {
            runs: tree("runs")?,
            events: tree("events")?,
            forks: tree("forks")?,
            branches: tree("branches")?,
            checkpoints: tree("checkpoints")?,
            checkpoint_marks: tree("checkpoint_marks")?,
            accounts: tree("accounts")?,
            reservations: tree("reservations")?,
            caps: tree("caps")?,
            resolutions: tree("resolutions")?,
            blob_store: Arc::new(blobs.clone()),
            blobs,
            parent_lock: Mutex::new(()),
            flush_lock: tokio::sync::Mutex::new(()),
            flush_requested: std::sync::atomic::AtomicU64::new(0),
            blob_quota: std::sync::atomic::AtomicU64::new(u64::MAX),
            flush_done: std::sync::atomic::AtomicU64::new(0),
            manifests: Mutex::new(std::collections::HashMap::new()),
            dir,
            id,
            db,
        };
        Ok(RunStore {
            inner: Arc::new(inner),
        })
    }

    /// The data dir this store lives in.
    pub fn dir(&self) -> &Path {
        &self.inner.dir
    }

    /// The store's id (see [`store_id`]).
    pub fn id(&self) -> &str {
        &self.inner.id
    }

    /// The store's blobs (tree `blobs`) as a [`BlobStore`], e.g. for a [`LocalBus`] in the
    /// embedded mode so workers and coordinator share one copy.
    ///
    /// [`LocalBus`]: forkfleet_bus::local::LocalBus
    pub fn blob_store(&self) -> Arc<dyn BlobStore> {
        self.inner.blob_store.clone()
    }

    /// The concrete blob store, with its synchronous getter.
    pub fn blobs(&self) -> &SledBlobStore {
        &self.inner.blobs
    }

    /// A blob's bytes, synchronously (diffs and merges run on blocking threads).
    pub fn blob(&self, hash: &BlobHash) -> Result<Option<Bytes>, CoordinatorError> {
        self.inner.blobs.get_sync(hash)
    }

    /// The manifest stored as blob `hash`, decoded once while anything holds it: the forks
    /// of one snapshot (a workspace forked again and again) share one in memory, and a
    /// start that loads them all decodes it once. `None` when no such blob is stored; an
    /// error when it is not a manifest.
    pub fn manifest(&self, hash: &BlobHash) -> Result<Option<Arc<Manifest>>, CoordinatorError> {
        let held = |m: &Mutex<std::collections::HashMap<BlobHash, std::sync::Weak<Manifest>>>| {
            m.lock().ok()?.get(hash)?.upgrade()
        };
        if let Some(m) = held(&self.inner.manifests) {
            return Ok(Some(m));
        }
        let Some(bytes) = self.blob(hash)? else {
            return Ok(None);
        };
        let m =
            Arc::new(
                Manifest::from_blob(&bytes).map_err(|e| CoordinatorError::BadSnapshot {
                    hash: *hash,
                    message: e.to_string(),
                })?,
            );
        if let Ok(mut held) = self.inner.manifests.lock() {
            held.retain(|_, w| w.strong_count() > 0);
            held.insert(*hash, Arc::downgrade(&m));
        }
        Ok(Some(m))
    }

    /// How many entries each tree holds (for status output and tests).
    pub fn counts(&self) -> Result<StoreCounts, CoordinatorError> {
        let i = &self.inner;
        Ok(StoreCounts {
            runs: i.runs.len(),
            events: self.event_count()?,
            forks: i.forks.len(),
            branches: i.branches.len(),
            checkpoints: i.checkpoints.len(),
            blobs: i.blobs.len(),
        })
    }

    /// Persist everything written so far.
    ///
    /// Flushes are single-flight and shared: sled 0.34 deadlocks when many `flush_async`
    /// calls wait at once (they fill its I/O thread pool, which the flush itself needs), so
    /// one flush runs at a time, and a caller whose writes a flush that started after its
    /// request already covered returns without another.
    pub async fn flush_async(&self) -> Result<(), CoordinatorError> {
        use std::sync::atomic::Ordering;
        let i = &self.inner;
        // Writes made before this point are covered by any flush that starts after it.
        let mine = i.flush_requested.fetch_add(1, Ordering::AcqRel) + 1;
        let _one = i.flush_lock.lock().await;
        if i.flush_done.load(Ordering::Acquire) >= mine {
            return Ok(());
        }
        let covers = i.flush_requested.load(Ordering::Acquire);
        i.db.flush_async().await?;
        i.flush_done.fetch_max(covers, Ordering::AcqRel);
        Ok(())
    }

    pub(crate) fn flush(&self) -> Result<(), CoordinatorError> {
        self.inner.db.flush()?;
        Ok(())
    }

    pub(crate) fn lock_parents(&self) -> MutexGuard<'_, ()> {
        // A poisoned lock only means another holder panicked; the data is in sled.
        self.inner
            .parent_lock
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    // ---- runs ---------------------------------------------------------------------------

    pub(crate) fn run(&self, id: RunId) -> Result<Option<RunRecord>, CoordinatorError> {
        match self.inner.runs.get(id.as_bytes())? {
            Some(v) => Ok(Some(decode("run record", &v)?)),
            None => Ok(None),
        }
    }

    /// Every run, in id order (UUID v7: creation order).
    pub(crate) fn runs(&self) -> Result<Vec<RunRecord>, CoordinatorError> {
        self.inner
            .runs
            .iter()
            .map(|kv| {
                let (_, v) = kv?;
                decode("run record", &v)
            })
            .collect()
    }

    pub(crate) fn put_run(&self, run: &RunRecord) -> Result<(), CoordinatorError> {
        self.inner
            .runs
            .insert(run.run_id.as_bytes(), encode("run record", run)?)?;
        Ok(())
    }

    // ---- events -------------------------------------------------------------------------

    // The events tree's methods are in `store/events.rs` (packed values, ADR 45).

    // ---- forks and branches -------------------------------------------------------------

    pub(crate) fn put_fork(&self, fork: &ForkRecord) -> Result<(), CoordinatorError> {
        self.inner
            .forks
            .insert(fork.fork_id.as_bytes(), encode("fork record", fork)?)?;
        Ok(())
    }

    /// Every fork, oldest first.
    pub(crate) fn forks(&self) -> Result<Vec<ForkRecord>, CoordinatorError> {
        let mut out = Vec::new();
        for kv in self.inner.forks.iter() {
            let (_, v) = kv?;
            out.push(decode("fork record", &v)?);
        }
        Ok(out)
    }

    pub(crate) fn fork(&self, id: ForkId) -> Result<Option<ForkRecord>, CoordinatorError> {
        match self.inner.forks.get(id.as_bytes())? {
            Some(v) => Ok(Some(decode("fork record", &v)?)),
            None => Ok(None),
        }
    }

    pub(crate) fn put_branch(&self, b: &BranchRecord) -> Result<(), CoordinatorError> {
        self.inner.branches.insert(
            pair_key(b.fork_id.as_bytes(), b.run_id.as_bytes()),
            encode("branch record", b)?,
        )?;
        Ok(())
    }

    /// A fork's branches, in branch order.
    pub(crate) fn branches(&self, fork: ForkId) -> Result<Vec<BranchRecord>, CoordinatorError> {
        let mut out: Vec<BranchRecord> = Vec::new();
        for kv in self.inner.branches.scan_prefix(fork.as_bytes()) {
            let (_, v) = kv?;
            out.push(decode("branch record", &v)?);
        }
        out.sort_by_key(|b| b.index);
        Ok(out)
    }

    // ---- resolutions ------------------------------------------------------------------

    /// Keep a fork's latest resolve report (tests, verdicts, decision, judge cost).
    pub(crate) fn put_resolution(
        &self,
        fork: ForkId,
        report: &forkfleet_shared::api::ResolveReport,
    ) -> Result<(), CoordinatorError> {
        self.inner
            .resolutions
            .insert(fork.as_bytes(), encode("resolve report", report)?)?;
        Ok(())
    }

    /// A fork's latest resolve report, if it was ever resolved.
    pub fn resolution(
        &self,
        fork: ForkId,
    ) -> Result<Option<forkfleet_shared::api::ResolveReport>, CoordinatorError> {
        self.inner
            .resolutions
            .get(fork.as_bytes())?
            .map(|v| decode("resolve report", &v))
            .transpose()
    }

    /// Delete a fork and its branch runs `runs` (`crate::gc` decided nothing refers to
    /// them): the fork's record, branch records, resolve report and caps; each run's record,
    /// events, checkpoints and fenced calls. Blobs are swept apart. The counts: events,
    /// checkpoints.
    pub(crate) fn delete_fork(
        &self,
        fork: ForkId,
        runs: &[RunId],
    ) -> Result<(usize, usize), CoordinatorError> {
        fn remove_prefix(tree: &sled::Tree, prefix: &[u8]) -> Result<usize, CoordinatorError> {
            let keys: Vec<sled::IVec> =
                tree.scan_prefix(prefix).keys().collect::<Result<_, _>>()?;
            for k in &keys {
                tree.remove(k)?;
            }
            Ok(keys.len())
        }
        let i = &self.inner;
        let fenced = i.db.open_tree("fenced_usage")?;
        let (mut events, mut checkpoints) = (0, 0);
        for run in runs {
            events += self.remove_events(*run)?;
            checkpoints += remove_prefix(&i.checkpoints, run.as_bytes())?;
            remove_prefix(&fenced, run.as_bytes())?;
            i.checkpoint_marks.remove(run.as_bytes())?;
            i.runs.remove(run.as_bytes())?;
        }
        remove_prefix(&i.branches, fork.as_bytes())?;
        remove_prefix(&i.caps, fork.as_bytes())?;
        i.resolutions.remove(fork.as_bytes())?;
        i.forks.remove(fork.as_bytes())?;
        Ok((events, checkpoints))
    }

    // ---- checkpoints: the store API is in `store/checkpoints.rs` ------------------------

    // ---- budgets ------------------------------------------------------------------------

    pub(crate) fn put_account(&self, a: &AccountRecord) -> Result<(), CoordinatorError> {
        self.inner
            .accounts
            .insert(a.name.as_bytes(), encode("account", a)?)?;
        Ok(())
    }

    /// Every account, by name.
    pub(crate) fn accounts(&self) -> Result<Vec<AccountRecord>, CoordinatorError> {
        let mut out = Vec::new();
        for kv in self.inner.accounts.iter() {
            let (_, v) = kv?;
            out.push(decode("account", &v)?);
        }
        Ok(out)
    }

    pub(crate) fn put_reservation(&self, r: &ReservationRecord) -> Result<(), CoordinatorError> {
        self.inner
            .reservations
            .insert(r.id.as_bytes(), encode("reservation", r)?)?;
        Ok(())
    }

    pub(crate) fn delete_reservation(&self, id: ReservationId) -> Result<(), CoordinatorError> {
        self.inner.reservations.remove(id.as_bytes())?;
        Ok(())
    }

    /// Every reservation not yet settled or released.
    pub(crate) fn reservations(&self) -> Result<Vec<ReservationRecord>, CoordinatorError> {
        let mut out = Vec::new();
        for kv in self.inner.reservations.iter() {
            let (_, v) = kv?;
            out.push(decode("reservation", &v)?);
        }
        Ok(out)
    }

    /// Record a cap changed after creation (a top-up or a move): the fork's aggregate cap
    /// with `run: None`, else the branch's.
    pub(crate) fn put_cap(
        &self,
        fork: ForkId,
        run: Option<RunId>,
        cap: f64,
    ) -> Result<(), CoordinatorError> {
        let bytes = encode("cap", &cap)?;
        match run {
            None => self.inner.caps.insert(fork.as_bytes(), bytes)?,
            Some(run) => self
                .inner
                .caps
                .insert(pair_key(fork.as_bytes(), run.as_bytes()), bytes)?,
        };
        Ok(())
    }

    /// The caps of a fork changed after creation: its own (`None` key) and its branches'.
    pub(crate) fn caps(&self, fork: ForkId) -> Result<Vec<CapOverride>, CoordinatorError> {
        let mut out = Vec::new();
        for kv in self.inner.caps.scan_prefix(fork.as_bytes()) {
            let (k, v) = kv?;
            let cap: f64 = decode("cap", &v)?;
            let run = match k.len() {
                16 => None,
                32 => {
                    let bytes = <[u8; 16]>::try_from(&k[16..32])
                        .map_err(|_| CoordinatorError::codec("cap key", "not 32 bytes"))?;
                    Some(RunId::from_bytes(bytes))
                }
                _ => return Err(CoordinatorError::codec("cap key", "not 16 or 32 bytes")),
            };
            out.push((run, cap));
        }
        Ok(out)
    }

    /// Write everything a merge changes in one transaction: the parent's record, its new
    /// events, the post-merge checkpoint and the fork record.
    pub(crate) fn commit_merge(
        &self,
        parent: &RunRecord,
        events: &[(u64, Event)],
        checkpoint: &CheckpointView,
        fork: &ForkRecord,
    ) -> Result<(), CoordinatorError> {
        use sled::transaction::{ConflictableTransactionError, Transactional};
        let run_bytes = encode("run record", parent)?;
        let fork_bytes = encode("fork record", fork)?;
        let cp_bytes = encode("checkpoint", checkpoint)?;
        let cp_key = pair_key(checkpoint.run_id.as_bytes(), checkpoint.id.as_bytes());
        let mut event_bytes = Vec::with_capacity(events.len());
        for (seq, e) in events {
            event_bytes.push((event_key(parent.run_id, *seq), encode("event", e)?));
        }
        let i = &self.inner;
        (&i.runs, &i.events, &i.checkpoints, &i.forks)
            .transaction(|(runs, evs, cps, forks)| {
                for (k, v) in &event_bytes {
                    evs.insert(&k[..], v.as_slice())?;
                }
                cps.insert(&cp_key[..], cp_bytes.as_slice())?;
                runs.insert(parent.run_id.as_bytes(), run_bytes.as_slice())?;
                forks.insert(fork.fork_id.as_bytes(), fork_bytes.as_slice())?;
                Ok::<(), ConflictableTransactionError<()>>(())
            })
            .map_err(|e| transaction_error("merge", e))?;
        self.flush()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn log_stops_at_the_first_gap_and_events_sort_by_seq() {
        let dir = tempfile::tempdir().unwrap();
        let store = RunStore::open(dir.path()).unwrap();
        let run = RunId::new();
        let other = RunId::new();
        let ev = |t: &str| Event::Steer { text: t.into() };
        let evs: Vec<(u64, Event)> = [0u64, 1, 2, 256, 4]
            .into_iter()
            .map(|seq| (seq, ev(&seq.to_string())))
            .collect();
        store
            .put_events(evs.iter().map(|(seq, e)| (run, *seq, e)))
            .unwrap();
        store.put_events([(other, 0, &ev("x"))]).unwrap();
        let seqs: Vec<u64> = store
            .stored_events(run)
            .unwrap()
            .iter()
            .map(|e| e.0)
            .collect();
        assert_eq!(seqs, [0, 1, 2, 4, 256]);
        assert_eq!(store.run_log(run).unwrap().len(), 3);
        assert_eq!(
            store.run_log(RunId::new()).unwrap(),
            Vec::<(u64, Event)>::new()
        );
    }

    #[test]
    fn second_open_of_a_locked_dir_names_it() {
        let dir = tempfile::tempdir().unwrap();
        let _store = RunStore::open(dir.path()).unwrap();
        let err = RunStore::open(dir.path()).err().unwrap();
        assert!(matches!(err, CoordinatorError::StoreLocked { .. }), "{err}");
        assert!(err.to_string().contains(&dir.path().display().to_string()));
    }

    #[tokio::test]
    async fn blobs_round_trip_and_verify() {
        let dir = tempfile::tempdir().unwrap();
        let store = RunStore::open(dir.path()).unwrap();
        let blobs = store.blob_store();
        let h = BlobHash::of(b"hello");
        blobs.put(h, Bytes::from_static(b"hello")).await.unwrap();
        assert_eq!(
            store.blob(&h).unwrap().unwrap(),
            Bytes::from_static(b"hello")
        );
        let other = BlobHash::of(b"nope");
        assert_eq!(blobs.missing(&[h, other]).await.unwrap(), vec![other]);
        assert!(blobs.put(other, Bytes::from_static(b"x")).await.is_err());
    }

    /// A manifest is decoded once while something holds it: what the forks of one snapshot
    /// share, in memory and in a start's loading.
    #[tokio::test]
    async fn a_held_manifest_is_shared() {
        use forkfleet_shared::manifest::FileEntry;
        let dir = tempfile::tempdir().unwrap();
        let store = RunStore::open(dir.path()).unwrap();
        let mut m = Manifest::default();
        m.insert_file(
            forkfleet_shared::path::WsPath::parse("a/b.txt").unwrap(),
            FileEntry::for_bytes(b"b", 0o644),
        );
        let blob = m.to_blob().unwrap();
        let hash = BlobHash::of(&blob);
        assert!(store.manifest(&hash).unwrap().is_none());
        store.blob_store().put(hash, blob).await.unwrap();
        let one = store.manifest(&hash).unwrap().unwrap();
        let two = store.manifest(&hash).unwrap().unwrap();
        assert!(Arc::ptr_eq(&one, &two));
        assert_eq!(*one, m);
        drop((one, two));
        // Held by nothing, it is decoded again.
        assert_eq!(*store.manifest(&hash).unwrap().unwrap(), m);
        // A blob that is not a manifest is an error naming it.
        let other = Bytes::from_static(b"not a manifest");
        store
            .blob_store()
            .put(BlobHash::of(&other), other.clone())
            .await
            .unwrap();
        let err = store.manifest(&BlobHash::of(&other)).unwrap_err();
        assert!(matches!(err, CoordinatorError::BadSnapshot { .. }), "{err}");
    }

    /// A tree a worker kept of a manifest (ADR 32) goes when the manifest's blob does (the
    /// garbage collector's delete): its links would keep the bytes of deleted blobs. Other
    /// kept trees stay.
    #[tokio::test]
    async fn a_kept_tree_goes_with_its_manifests_blob() {
        let dir = tempfile::tempdir().unwrap();
        let store = RunStore::open(dir.path()).unwrap();
        let kept = store.blob_store().kept_trees_dir().unwrap();
        assert_eq!(kept, dir.path().join(blobs::KEPT_TREES_DIR));
        let (gone, stays) = (
            Bytes::from(vec![1u8; blobs::INLINE_MAX + 1]),
            Bytes::from_static(b"small"),
        );
        for b in [&gone, &stays] {
            store
                .blob_store()
                .put(BlobHash::of(b), b.clone())
                .await
                .unwrap();
            let ws = kept.join(BlobHash::of(b).to_hex()).join("ws");
            std::fs::create_dir_all(&ws).unwrap();
            std::fs::write(ws.join("f"), b"x").unwrap();
        }
        store.blobs().remove(&BlobHash::of(&gone)).unwrap();
        assert!(!kept.join(BlobHash::of(&gone).to_hex()).exists());
        assert!(kept
            .join(BlobHash::of(&stays).to_hex())
            .join("ws/f")
            .exists());
        assert!(store.blob(&BlobHash::of(&gone)).unwrap().is_none());
        assert_eq!(
            store.blob(&BlobHash::of(&stays)).unwrap(),
            Some(stays.clone())
        );
        // The store remembered both as stored (`put`); it forgets the one removed.
        assert_eq!(
            store
                .blob_store()
                .missing(&[BlobHash::of(&gone), BlobHash::of(&stays)])
                .await
                .unwrap(),
            vec![BlobHash::of(&gone)]
        );
    }

    /// A store written before kept blob files in `blobs/`, sled's own directory (which made
    /// sled warn of each at every open): they move to `blob-files/` on the next open,
    /// whole directories or, after a move cut short, file by file.
    #[tokio::test]
    async fn blob_files_of_an_older_store_move_out_of_sleds_directory() {
        let dir = tempfile::tempdir().unwrap();
        let blobs: Vec<Bytes> = (0..40u8)
            .map(|i| Bytes::from(vec![i; blobs::INLINE_MAX + 1]))
            .collect();
        {
            let store = RunStore::open(dir.path()).unwrap();
            for b in &blobs {
                store
                    .blob_store()
                    .put(BlobHash::of(b), b.clone())
                    .await
                    .unwrap();
            }
            store.flush_async().await.unwrap();
        }
        let (new, old) = (dir.path().join(blobs::FILES_DIR), dir.path().join("blobs"));
        std::fs::create_dir_all(&old).unwrap();
        let mut moved_back = 0;
        for (i, e) in std::fs::read_dir(&new).unwrap().flatten().enumerate() {
            if i % 2 == 0 {
                // The older layout.
                std::fs::rename(e.path(), old.join(e.file_name())).unwrap();
            } else {
                // A move cut short: the directory in both (its files still in the old one).
                let back = old.join(e.file_name());
                std::fs::create_dir(&back).unwrap();
                for f in std::fs::read_dir(e.path()).unwrap().flatten() {
                    std::fs::rename(f.path(), back.join(f.file_name())).unwrap();
                }
            }
            moved_back += 1;
        }
        assert!(moved_back > 2);
        // Owner-only, as stores before ADR 31 wrote them.
        use std::os::unix::fs::PermissionsExt;
        for d in std::fs::read_dir(&old).unwrap().flatten() {
            for f in std::fs::read_dir(d.path()).unwrap().flatten() {
                std::fs::set_permissions(f.path(), std::fs::Permissions::from_mode(0o600)).unwrap();
            }
        }
        let store = RunStore::open(dir.path()).unwrap();
        for b in &blobs {
            assert_eq!(&store.blob(&BlobHash::of(b)).unwrap().unwrap(), b);
            let hex = BlobHash::of(b).to_hex();
            let file = new.join(&hex[..2]).join(&hex[2..]);
            let mode = std::fs::metadata(&file).unwrap().permissions().mode();
            assert_eq!(mode & 0o7777, 0o644, "{}", file.display());
        }
        // Nothing of ours is left in sled's directory (what sled keeps there is its own).
        let left: Vec<_> = std::fs::read_dir(&old)
            .unwrap()
            .flatten()
            .filter(|e| e.file_type().unwrap().is_dir())
            .map(|e| e.file_name())
            .collect();
        assert!(left.is_empty(), "{left:?}");
    }

    #[tokio::test]
    async fn a_large_blob_is_a_file_of_its_own_and_survives_a_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let big = Bytes::from(vec![7u8; blobs::INLINE_MAX + 1]);
        let small = Bytes::from(vec![1u8; blobs::INLINE_MAX]);
        let (hb, hs) = (BlobHash::of(&big), BlobHash::of(&small));
        {
            let store = RunStore::open(dir.path()).unwrap();
            let b = store.blob_store();
            b.put(hb, big.clone()).await.unwrap();
            b.put(hs, small.clone()).await.unwrap();
            // Stored twice: once.
            b.put(hb, big.clone()).await.unwrap();
            assert_eq!(store.blobs().len(), 2);
            store.flush_async().await.unwrap();
        }
        let hex = hb.to_hex();
        let file = dir
            .path()
            .join(blobs::FILES_DIR)
            .join(&hex[..2])
            .join(&hex[2..]);
        assert_eq!(std::fs::read(&file).unwrap(), big.to_vec());
        // The small one is a sled value: no file of its name anywhere below `blob-files/`.
        let small_hex = hs.to_hex();
        let small_file = dir
            .path()
            .join(blobs::FILES_DIR)
            .join(&small_hex[..2])
            .join(&small_hex[2..]);
        assert!(!small_file.exists());
        let store = RunStore::open(dir.path()).unwrap();
        assert_eq!(store.blob(&hb).unwrap().unwrap(), big);
        assert_eq!(store.blob(&hs).unwrap().unwrap(), small);
        assert!(store
            .blob_store()
            .missing(&[hb, hs])
            .await
            .unwrap()
            .is_empty());
        // A recorded blob whose file was lost (a power loss: the next process) reads as
        // missing, not as bytes, and is stored again.
        std::fs::remove_file(&file).unwrap();
        drop(store);
        let store = RunStore::open(dir.path()).unwrap();
        assert_eq!(store.blob(&hb).unwrap(), None);
        let b = store.blob_store();
        assert_eq!(b.missing(&[hb]).await.unwrap(), vec![hb]);
        b.put(hb, big.clone()).await.unwrap();
        assert_eq!(store.blob(&hb).unwrap().unwrap(), big);
    }
}
