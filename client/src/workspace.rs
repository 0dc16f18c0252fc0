//! The client side of a fork: upload a workspace snapshot, apply a merge to a directory.

use crate::error::ClientError;
use bytes::Bytes;
use forkfleet_shared::api::MergeOutcome;
use forkfleet_shared::blob::{fetch, BlobHash, BlobStore};
use forkfleet_shared::flush::{self, ConflictPolicy, DirTarget, FlushReport};
use forkfleet_shared::manifest::{scan_dir, Manifest};
use std::collections::HashMap;
use std::path::Path;

/// What an upload did.
#[derive(Debug, Clone, Copy)]
pub struct Upload {
    pub snapshot: BlobHash,
    pub files: usize,
    pub blobs_sent: usize,
    pub bytes_sent: u64,
}

/// Snapshot `dir` and upload the blobs the store lacks (deduplicated by hash), then the
/// manifest itself. Returns the manifest's hash.
pub async fn upload_workspace(
    store: &dyn BlobStore,
    dir: &Path,
    exclude: &[String],
    extra: impl IntoIterator<Item = (BlobHash, Bytes)>,
) -> Result<(Manifest, Upload), ClientError> {
    let scan = scan_dir(dir, exclude)?;
    let uploading = |e| ClientError::blob("uploading the workspace", e);
    let mut blobs: HashMap<BlobHash, Bytes> = scan.blobs.into_iter().collect();
    blobs.extend(extra);
    let hashes: Vec<BlobHash> = blobs.keys().copied().collect();
    let missing = store.missing(&hashes).await.map_err(uploading)?;
    let mut bytes_sent = 0;
    for h in &missing {
        if let Some(b) = blobs.remove(h) {
            bytes_sent += b.len() as u64;
            store.put(*h, b).await.map_err(uploading)?;
        }
    }
    let manifest_blob = scan
        .manifest
        .to_blob()
        .map_err(|e| ClientError::encode("the workspace manifest", e))?;
    let snapshot = BlobHash::of(&manifest_blob);
    store
        .put(snapshot, manifest_blob)
        .await
        .map_err(uploading)?;
    let files = scan.manifest.files.len();
    Ok((
        scan.manifest,
        Upload {
            snapshot,
            files,
            blobs_sent: missing.len(),
            bytes_sent,
        },
    ))
}

/// Apply a merge to a real directory: replay the winner's change log onto `dir`, detecting
/// conflicts against the fork-time snapshot, so a file changed in `dir` since the fork is
/// kept (unless the policy is `overwrite`).
pub async fn apply_merge(
    store: &dyn BlobStore,
    outcome: &MergeOutcome,
    dir: &Path,
    policy: ConflictPolicy,
) -> Result<FlushReport, ClientError> {
    let (snapshot, contents) = replay_inputs(
        store,
        &outcome.fork_snapshot,
        &outcome.changes,
        "the fork snapshot",
    )
    .await?;
    let dir = dir.to_path_buf();
    let changes = outcome.changes.clone();
    let report = tokio::task::spawn_blocking(move || {
        let mut target = DirTarget::new(&dir, contents)
            .map_err(|e| ClientError::io("apply the merge to", &dir, e))?;
        Ok::<_, ClientError>(flush::flush(&changes, &snapshot, &mut target, policy))
    })
    .await??;
    Ok(report)
}

/// What replaying `changes` onto a directory needs: the manifest conflicts are detected
/// against (`base`, described as `what` in errors: `the fork snapshot`) and the contents
/// the changes write.
pub async fn replay_inputs(
    store: &dyn BlobStore,
    base: &BlobHash,
    changes: &[forkfleet_shared::overlay::ChangeOp],
    what: &'static str,
) -> Result<(Manifest, HashMap<BlobHash, Bytes>), ClientError> {
    let base = fetch(store, base)
        .await
        .map_err(|e| ClientError::blob(format!("reading {what}"), e))?;
    let base = Manifest::from_blob(&base).map_err(|e| ClientError::decode(what, e))?;
    let mut contents = HashMap::new();
    for h in flush::needed_blobs(changes) {
        let bytes = fetch(store, &h)
            .await
            .map_err(|e| ClientError::blob("reading the contents the changes write", e))?;
        contents.insert(h, bytes);
    }
    Ok((base, contents))
}
