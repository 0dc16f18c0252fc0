//! The client side of a fork: upload a workspace snapshot, apply a merge to a directory.

use crate::error::ClientError;
use bytes::Bytes;
use forkfleet_shared::api::MergeOutcome;
use forkfleet_shared::blob::{fetch, BlobHash, BlobStore};
use forkfleet_shared::flush::{self, ConflictPolicy, DirTarget, FlushReport};
use forkfleet_shared::manifest::{FileEntry, Manifest, ScanError};
use forkfleet_shared::scan::{self, LeftOut, ScanOptions, StatCache};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// What an upload did.
#[derive(Debug, Clone)]
pub struct Upload {
    pub snapshot: BlobHash,
    pub files: usize,
    /// Bytes of the files in the snapshot.
    pub bytes: u64,
    pub blobs_sent: usize,
    pub bytes_sent: u64,
    /// Files read and hashed (the others came from the stat cache).
    pub files_read: usize,
    /// What the snapshot left out, and why.
    pub left_out: LeftOut,
}

/// Blobs read from disk and sent at once: the bytes held are these files'.
const PUTS_IN_FLIGHT: usize = 8;

/// Snapshot `dir` (what `opts` leaves out left out, see [`forkfleet_shared::scan`]) and
/// upload the blobs the store lacks, then the manifest itself. Returns the manifest.
///
/// The workspace's bytes are never held together: files are hashed in chunks on every
/// core (unchanged ones served by the stat cache in the user's cache directory), then the
/// missing ones read again one by one as they are sent, each checked against its hash (a
/// file changed meanwhile fails the upload, naming it: run again).
pub async fn upload_workspace(
    store: &dyn BlobStore,
    dir: &Path,
    opts: &ScanOptions,
    extra: impl IntoIterator<Item = (BlobHash, Bytes)>,
) -> Result<(Manifest, Upload), ClientError> {
    use futures::{StreamExt, TryStreamExt};
    let root = dir.to_path_buf();
    let opts = opts.clone();
    let started = std::time::Instant::now();
    let ms = |since: std::time::Instant| since.elapsed().as_millis() as u64;
    let (listing, manifest, hashed, listed_ms, hashed_ms) = tokio::task::spawn_blocking(move || {
        let listing = scan::list(&root, &opts)?;
        let listed_ms = ms(started);
        let cache_file = stat_cache_file(&root);
        let cache = cache_file
            .as_deref()
            .map(StatCache::load)
            .unwrap_or_default();
        let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
        let (manifest, hashed) = scan::hash(&listing, &cache, threads)?;
        let hashed_ms = ms(started);
        if let Some(file) = cache_file {
            // Written again only when it would change (a file was read, or one came or
            // went); else only marked used, for the pruning of the least recently used.
            let unchanged = hashed.read == 0 && cache.len() == listing.files.len();
            let now = std::fs::FileTimes::new().set_modified(std::time::SystemTime::now());
            let saved = if unchanged {
                std::fs::File::options()
                    .write(true)
                    .open(&file)
                    .and_then(|f| f.set_times(now))
            } else {
                StatCache::save(&file, &listing, &manifest)
            };
            if let Err(e) = saved {
                tracing::debug!(error = %e, file = %file.display(), "cannot write the snapshot's stat cache");
            }
            prune_stat_caches(&file);
        }
        Ok::<_, ScanError>((listing, manifest, hashed, listed_ms, hashed_ms))
    })
    .await??;
    let uploading = |e| ClientError::blob("uploading the workspace", e);
    let extra: HashMap<BlobHash, Bytes> = extra.into_iter().collect();
    // One listed file (or extra blob) for each hash.
    let mut by_hash: HashMap<BlobHash, (&scan::Listed, FileEntry)> = HashMap::new();
    for f in &listing.files {
        if let Some(e) = manifest.files.get(&f.path) {
            by_hash.entry(e.hash).or_insert((f, *e));
        }
    }
    let mut hashes: Vec<BlobHash> = by_hash.keys().copied().collect();
    hashes.extend(extra.keys().filter(|h| !by_hash.contains_key(h)));
    let missing = store.missing(&hashes).await.map_err(uploading)?;
    let asked_ms = ms(started);
    let sent: Vec<u64> = futures::stream::iter(missing.iter().copied())
        .map(|h| {
            let extra = extra.get(&h).cloned();
            let listed = by_hash.get(&h).map(|(f, e)| ((*f).clone(), *e));
            async move {
                let bytes = match (extra, listed) {
                    (Some(b), _) => b,
                    (None, Some((f, entry))) => {
                        tokio::task::spawn_blocking(move || {
                            scan::read_checked(&f, &entry).map(Bytes::from)
                        })
                        .await??
                    }
                    (None, None) => return Ok(0),
                };
                let len = bytes.len() as u64;
                store.put(h, bytes).await.map_err(uploading)?;
                Ok::<u64, ClientError>(len)
            }
        })
        .buffer_unordered(PUTS_IN_FLIGHT)
        .try_collect()
        .await?;
    let manifest_blob = manifest
        .to_blob()
        .map_err(|e| ClientError::encode("the workspace manifest", e))?;
    let snapshot = BlobHash::of(&manifest_blob);
    store
        .put(snapshot, manifest_blob)
        .await
        .map_err(uploading)?;
    // Where a snapshot's time goes, each phase's end since its start.
    tracing::debug!(
        listed_ms,
        hashed_ms,
        read = hashed.read,
        asked_ms,
        missing = missing.len(),
        ms = ms(started),
        "snapshot uploaded"
    );
    let upload = Upload {
        snapshot,
        files: manifest.files.len(),
        bytes: manifest.total_bytes(),
        blobs_sent: sent.len(),
        bytes_sent: sent.iter().sum(),
        files_read: hashed.read,
        left_out: listing.left_out,
    };
    Ok((manifest, upload))
}

/// The stat cache of the workspace at `dir`: in the user's cache directory
/// (`$XDG_CACHE_HOME/forkfleet/scan/`, else `~/.cache/forkfleet/scan/`), named by the hash of
/// the workspace's absolute path, so nothing is written into the workspace. `None` without
/// a cache directory (`FORKFLEET_STAT_CACHE=off` turns it off).
pub fn stat_cache_file(dir: &Path) -> Option<PathBuf> {
    if std::env::var("FORKFLEET_STAT_CACHE").is_ok_and(|v| v == "off") {
        return None;
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    let abs = std::fs::canonicalize(dir).ok()?;
    let name = BlobHash::of(abs.to_string_lossy().as_bytes()).short();
    Some(base.join("forkfleet").join("scan").join(name))
}

/// Stat caches kept (one per workspace), the most recently written.
const STAT_CACHES_KEPT: usize = 32;

/// Remove all but the [`STAT_CACHES_KEPT`] most recently written stat caches beside
/// `file`.
fn prune_stat_caches(file: &Path) {
    let Some(dir) = file.parent() else { return };
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let mut caches: Vec<(std::time::SystemTime, PathBuf)> = entries
        .flatten()
        .filter_map(|e| Some((e.metadata().ok()?.modified().ok()?, e.path())))
        .collect();
    if caches.len() <= STAT_CACHES_KEPT {
        return;
    }
    caches.sort_by_key(|c| std::cmp::Reverse(c.0));
    for (_, old) in caches.into_iter().skip(STAT_CACHES_KEPT) {
        let _ = std::fs::remove_file(old);
    }
}

/// List what a snapshot of `dir` would hold and leave out, reading no file (a dry run).
pub async fn list_workspace(dir: &Path, opts: &ScanOptions) -> Result<scan::Listing, ClientError> {
    let (root, opts) = (dir.to_path_buf(), opts.clone());
    tokio::task::spawn_blocking(move || scan::list(&root, &opts))
        .await?
        .map_err(ClientError::from)
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
    replay_onto(dir, outcome.changes.clone(), snapshot, contents, policy).await
}

/// Bring a real directory from workspace version `from` to version `to` (both `Manifest`
/// blobs): the changes between them replayed onto `dir`, conflicts detected against
/// `from`, so a file changed in `dir` since `from` was written is kept (unless the policy
/// is `overwrite`). How `forkfleet chat` keeps its workspace in step with its agent.
pub async fn apply_version(
    store: &dyn BlobStore,
    from: &BlobHash,
    to: &BlobHash,
    dir: &Path,
    policy: ConflictPolicy,
) -> Result<FlushReport, ClientError> {
    bring_to_version(store, (from, to), dir, policy, false).await
}

/// Apply the changes from workspace version `from` to `to` to `dir` again (`fork merge
/// --reapply`): as [`apply_version`], except that a path `dir` already holds as `to` has it
/// (a file with its content and mode, a directory, nothing) is left alone, every change to
/// it dropped (a directory replaced by a file is a removal and a write of one path), so it
/// is neither applied again nor a conflict; only paths edited since `from` to something
/// else are conflicts (kept, or replaced under `overwrite`).
pub async fn reapply_version(
    store: &dyn BlobStore,
    from: &BlobHash,
    to: &BlobHash,
    dir: &Path,
    policy: ConflictPolicy,
) -> Result<FlushReport, ClientError> {
    bring_to_version(store, (from, to), dir, policy, true).await
}

/// [`apply_version`], or with `skip_done` [`reapply_version`].
async fn bring_to_version(
    store: &dyn BlobStore,
    (from, to): (&BlobHash, &BlobHash),
    dir: &Path,
    policy: ConflictPolicy,
    skip_done: bool,
) -> Result<FlushReport, ClientError> {
    use flush::FlushTarget as _;
    let target = version(store, to).await?;
    let base = version(store, from).await?;
    let mut changes = flush::changes_between(&base, &target);
    if skip_done {
        let root = dir.to_path_buf();
        changes = tokio::task::spawn_blocking(move || {
            let now = DirTarget::new(&root, HashMap::new())
                .map_err(|e| ClientError::io("read", &root, e))?;
            let done: std::collections::BTreeSet<_> = changes
                .iter()
                .map(|op| op.path().clone())
                .filter(|p| flush::nodes_match(&now.node(p), &target.node(p)))
                .collect();
            changes.retain(|op| !done.contains(op.path()));
            Ok::<_, ClientError>(changes)
        })
        .await??;
    }
    let contents = written_contents(store, &changes).await?;
    replay_onto(dir, changes, base, contents, policy).await
}

/// A workspace version (a `Manifest` blob) from `store`.
async fn version(store: &dyn BlobStore, hash: &BlobHash) -> Result<Manifest, ClientError> {
    let bytes = fetch(store, hash)
        .await
        .map_err(|e| ClientError::blob("reading the workspace version", e))?;
    Manifest::from_blob(&bytes).map_err(|e| ClientError::decode("the workspace version", e))
}

/// Replay `changes` onto `dir` off the runtime, conflicts against `base`.
async fn replay_onto(
    dir: &Path,
    changes: Vec<forkfleet_shared::overlay::ChangeOp>,
    snapshot: Manifest,
    contents: HashMap<BlobHash, Bytes>,
    policy: ConflictPolicy,
) -> Result<FlushReport, ClientError> {
    let dir = dir.to_path_buf();
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
    Ok((base, written_contents(store, changes).await?))
}

/// The contents `changes` write, from `store`.
async fn written_contents(
    store: &dyn BlobStore,
    changes: &[forkfleet_shared::overlay::ChangeOp],
) -> Result<HashMap<BlobHash, Bytes>, ClientError> {
    let mut contents = HashMap::new();
    for h in flush::needed_blobs(changes) {
        let bytes = fetch(store, &h)
            .await
            .map_err(|e| ClientError::blob("reading the contents the changes write", e))?;
        contents.insert(h, bytes);
    }
    Ok(contents)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod reapply_tests {
    use super::*;
    use forkfleet_shared::blob::MemBlobStore;
    use forkfleet_shared::manifest::{MODE_EXEC, MODE_FILE};
    use forkfleet_shared::path::WsPath;
    use std::os::unix::fs::PermissionsExt;

    fn file(store: &MemBlobStore, text: &str, mode: u32) -> FileEntry {
        store.insert(Bytes::from(text.to_string()));
        FileEntry::for_bytes(text.as_bytes(), mode)
    }

    /// A merge that turned a directory into a file, applied already: applying it again
    /// changes nothing and keeps nothing (it removed the merged file under --overwrite);
    /// a mode the merge set that the directory lacks is applied again (it was skipped).
    #[tokio::test]
    async fn applying_a_merge_again_leaves_what_it_made_and_restores_what_it_lacks() {
        let store = MemBlobStore::new();
        let p = |s: &str| WsPath::parse(s).unwrap();
        let mut before = Manifest::default();
        before.insert_file(p("a/x"), file(&store, "x\n", MODE_FILE));
        before.insert_file(p("run.sh"), file(&store, "echo\n", MODE_FILE));
        let mut after = Manifest::default();
        after.insert_file(p("a"), file(&store, "a file now\n", MODE_FILE));
        after.insert_file(p("run.sh"), file(&store, "echo\n", MODE_EXEC));
        let from = store.insert(before.to_blob().unwrap());
        let to = store.insert(after.to_blob().unwrap());
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a"), "a file now\n").unwrap();
        std::fs::write(dir.path().join("run.sh"), "echo\n").unwrap();
        std::fs::set_permissions(
            dir.path().join("run.sh"),
            std::fs::Permissions::from_mode(0o644),
        )
        .unwrap();
        for policy in [ConflictPolicy::KeepParent, ConflictPolicy::Overwrite] {
            let report = reapply_version(&store, &from, &to, dir.path(), policy)
                .await
                .unwrap();
            assert!(report.conflicts.is_empty(), "{report:?}");
            assert!(report.errors.is_empty(), "{report:?}");
            assert_eq!(
                std::fs::read_to_string(dir.path().join("a")).unwrap(),
                "a file now\n"
            );
            let mode = std::fs::metadata(dir.path().join("run.sh"))
                .unwrap()
                .permissions()
                .mode();
            assert_eq!(mode & 0o111, 0o111, "{policy:?}: {mode:o}");
        }
    }
}
