//! The coordinator reads file contents from its run store, while clients and workers put
//! them in the bus's blob store (the same store when embedded; on a cluster, the NATS one).
//! Before work that needs contents, copy what the run store lacks from the bus: a new
//! fork's snapshot, files and scripts; the text files a unified diff shows.

use crate::error::CoordinatorError;
use crate::store::RunStore;
use bytes::Bytes;
use forkfleet_bus::{Bus, BusError};
use forkfleet_shared::api::CreateFork;
use forkfleet_shared::blob::{BlobHash, BlobStore};
use forkfleet_shared::diff::DiffReport;
use forkfleet_shared::manifest::Manifest;
use futures::{StreamExt, TryStreamExt};
use std::sync::Arc;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// True when the bus's blob store is the run store's (the embedded mode): nothing to copy.
pub(crate) fn shared_with_bus(store: &RunStore, bus: &Arc<dyn Bus>) -> bool {
    Arc::ptr_eq(&store.blob_store(), &bus.blobs())
}

/// Blobs copied at once: each copy is a request to the bus and waits for its answer, so
/// the window, not the bandwidth, bounds a copy of thousands of small files (a window of
/// 64 took 1.1 to 2.0 s for the 6,677 text blobs of a 1,000 x 10 fork's unified diff, 256
/// 0.33 to 0.40 s, docs/BENCHMARKS.md).
const COPY_IN_FLIGHT: usize = 256;
/// Hashes a prefetch copies in one go.
const PREFETCH_BATCH: usize = 4096;
/// A prefetch's window: smaller, as it runs beside the branches' events.
const PREFETCH_IN_FLIGHT: usize = 64;

/// The text blobs branches write, copied from the bus into the run store as their
/// `file_change` events arrive (the workers put each blob before its event), so a unified
/// diff finds them there instead of copying thousands at diff time. A cluster's coordinator
/// only: embedded, the run store is the bus's. Best effort: a blob it could not copy is
/// copied by the diff that needs it.
#[derive(Clone)]
pub(crate) struct Prefetch {
    tx: Option<mpsc::Sender<Written>>,
}

/// Messages the prefetch holds at most; when it falls behind, what is written next is left
/// for the diff to copy (memory stays bounded whatever workers send).
const PREFETCH_QUEUE: usize = 1024;

/// What a fork wrote from one apply: the text blobs its events write, and the contents
/// workers sent along for them (matched by the hash they claim, checked when stored).
struct Written {
    hashes: Vec<BlobHash>,
    sent: Vec<(BlobHash, Bytes)>,
}

impl Prefetch {
    /// The prefetch of `store` from `bus`, and its task (none when they share a store).
    pub(crate) fn start(
        store: &RunStore,
        bus: &Arc<dyn Bus>,
    ) -> (Prefetch, Option<JoinHandle<()>>) {
        if shared_with_bus(store, bus) {
            return (Prefetch { tx: None }, None);
        }
        let (tx, rx) = mpsc::channel(PREFETCH_QUEUE);
        let task = tokio::spawn(prefetch(rx, store.blob_store(), bus.blobs()));
        (Prefetch { tx: Some(tx) }, Some(task))
    }

    /// Queue the text blobs `hashes` (those a fork's applied events write) for a copy into
    /// the run store; `sent`, contents workers sent along with the events, are kept instead
    /// of fetched where they claim one of those hashes (the store checks the bytes), and
    /// dropped otherwise.
    pub(crate) fn written(&self, hashes: Vec<BlobHash>, mut sent: Vec<(BlobHash, Bytes)>) {
        let Some(tx) = &self.tx else {
            return;
        };
        if hashes.is_empty() {
            return;
        }
        if !sent.is_empty() {
            let named: std::collections::HashSet<&BlobHash> = hashes.iter().collect();
            sent.retain(|(h, _)| named.contains(h));
        }
        if let Err(e) = tx.try_send(Written { hashes, sent }) {
            tracing::debug!(error = %e, "coordinator.blobs: the prefetch is behind; a diff copies what it needs");
        }
    }
}

async fn prefetch(
    mut rx: mpsc::Receiver<Written>,
    to: Arc<dyn BlobStore>,
    from: Arc<dyn BlobStore>,
) {
    while let Some(first) = rx.recv().await {
        let mut batch = Vec::new();
        let mut next = Some(first);
        while let Some(written) = next.take() {
            for (hash, bytes) in written.sent {
                // Checked against its hash by the store: a wrong one is refused.
                if let Err(e) = to.put(hash, bytes).await {
                    tracing::debug!(error = %e, "coordinator.blobs: a sent blob not kept; a diff copies it");
                }
            }
            batch.extend(written.hashes);
            if batch.len() < PREFETCH_BATCH {
                next = rx.try_recv().ok();
            }
        }
        batch.sort_unstable();
        batch.dedup();
        if let Err(e) = copy_missing(&to, &from, &batch, PREFETCH_IN_FLIGHT).await {
            tracing::debug!(error = %e, blobs = batch.len(), "coordinator.blobs: prefetch failed; a diff copies what it needs");
        }
    }
}

/// Copy a new fork's blobs into the run store: the snapshot first, then its files and the
/// scripts. What is missing from both stores is left for validation to report.
pub(crate) async fn import_for_fork(
    store: &RunStore,
    from: &Arc<dyn BlobStore>,
    req: &CreateFork,
) -> Result<(), CoordinatorError> {
    let local = store.blob_store();
    let mut wanted = vec![req.snapshot];
    wanted.extend(req.plan.models.values().filter_map(|m| m.script));
    copy_missing(&local, from, &wanted, COPY_IN_FLIGHT).await?;
    let Some(bytes) = store.blob(&req.snapshot)? else {
        return Ok(());
    };
    let Ok(manifest) = Manifest::from_blob(&bytes) else {
        return Ok(());
    };
    let files: Vec<BlobHash> = manifest.files.values().map(|f| f.hash).collect();
    copy_missing(&local, from, &files, COPY_IN_FLIGHT).await
}

/// Copy the text blobs a report without contents shows (the parent's and every branch's
/// version of each reported path), so the same report can be computed with them.
pub(crate) async fn import_for_diff(
    store: &RunStore,
    from: &Arc<dyn BlobStore>,
    plain: &DiffReport,
) -> Result<(), CoordinatorError> {
    let mut hashes: Vec<BlobHash> = Vec::new();
    for p in &plain.paths {
        let files = p
            .parent
            .iter()
            .chain(p.changes.iter().filter_map(|c| c.entry.as_ref()));
        hashes.extend(files.filter(|f| !f.binary).map(|f| f.hash));
    }
    hashes.sort_unstable();
    hashes.dedup();
    copy_missing(&store.blob_store(), from, &hashes, COPY_IN_FLIGHT).await
}

async fn copy_missing(
    to: &Arc<dyn BlobStore>,
    from: &Arc<dyn BlobStore>,
    hashes: &[BlobHash],
    window: usize,
) -> Result<(), CoordinatorError> {
    let missing = to.missing(hashes).await.map_err(BusError::from)?;
    if missing.is_empty() {
        return Ok(());
    }
    tracing::debug!(
        blobs = missing.len(),
        "coordinator.blobs: copying from the bus"
    );
    // A window of copies in flight, not batches that each wait for their slowest.
    futures::stream::iter(missing)
        .map(|h| async move {
            match from.get(&h).await? {
                Some(bytes) => to.put(h, bytes).await,
                None => Ok(()),
            }
        })
        .buffer_unordered(window)
        .try_collect::<()>()
        .await
        .map_err(BusError::from)?;
    Ok(())
}
