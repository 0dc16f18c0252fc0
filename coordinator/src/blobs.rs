//! The coordinator reads file contents from its run store, while clients and workers put
//! them in the bus's blob store (the same store when embedded; on a cluster, the NATS one).
//! Before work that needs contents, copy what the run store lacks from the bus: a new
//! fork's snapshot, files and scripts; the text files a unified diff shows.

use crate::error::CoordinatorError;
use crate::store::RunStore;
use forkfleet_bus::{Bus, BusError};
use forkfleet_shared::api::CreateFork;
use forkfleet_shared::blob::{BlobHash, BlobStore};
use forkfleet_shared::diff::DiffReport;
use forkfleet_shared::manifest::Manifest;
use futures::{StreamExt, TryStreamExt};
use std::sync::Arc;

/// True when the bus's blob store is the run store's (the embedded mode): nothing to copy.
pub(crate) fn shared_with_bus(store: &RunStore, bus: &Arc<dyn Bus>) -> bool {
    Arc::ptr_eq(&store.blob_store(), &bus.blobs())
}

/// Blobs copied at once.
const COPY_IN_FLIGHT: usize = 64;

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
    copy_missing(&local, from, &wanted).await?;
    let Some(bytes) = store.blob(&req.snapshot)? else {
        return Ok(());
    };
    let Ok(manifest) = Manifest::from_blob(&bytes) else {
        return Ok(());
    };
    let files: Vec<BlobHash> = manifest.files.values().map(|f| f.hash).collect();
    copy_missing(&local, from, &files).await
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
    copy_missing(&store.blob_store(), from, &hashes).await
}

async fn copy_missing(
    to: &Arc<dyn BlobStore>,
    from: &Arc<dyn BlobStore>,
    hashes: &[BlobHash],
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
        .buffer_unordered(COPY_IN_FLIGHT)
        .try_collect::<()>()
        .await
        .map_err(BusError::from)?;
    Ok(())
}
