//! Writing a tree (a snapshot manifest, or a branch overlay's view of it) into a directory,
//! stamping every file as written so a later comparison can skip the untouched ones.

use crate::cache::BlobCache;
use crate::error::WorkerError;
use forkfleet_shared::manifest::{FileEntry, Manifest};
use forkfleet_shared::path::WsPath;
use futures::future::BoxFuture;
use futures::StreamExt;
use std::collections::HashMap;
use std::path::Path;

/// Files fetched and written at once.
pub(super) const WRITES_IN_FLIGHT: usize = 32;

/// How [`materialize`] makes a tree's files.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Make {
    /// Every file written from its blob's bytes.
    Write,
    /// A file that is not executable hard-linked to its blob's file where the blob store
    /// keeps one on this file system ([`BlobStore::local_file`]), written otherwise. Only
    /// for a tree nothing writes through its own path (a layered tree's base whose
    /// commands are confined to their mount: ADR 31), since a write would go into the
    /// store.
    ///
    /// [`BlobStore::local_file`]: forkfleet_shared::blob::BlobStore::local_file
    LinkFromStore,
}

/// What [`materialize`] wrote.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Materialized {
    /// Files and symlinks made.
    pub files: usize,
    /// The bytes of the files made (linked ones included).
    pub bytes: u64,
    /// Of `bytes`, those hard-linked from the blob store, not written ([`Make::LinkFromStore`]).
    pub linked_bytes: u64,
    pub dirs: usize,
    /// Symlinks whose target would leave the tree: not created. In path order.
    pub skipped: Vec<WsPath>,
    /// How every regular file written looked right after (see [`Materialized::untouched`]).
    /// With each, the file's entry in the tree (what an untouched file still is).
    pub(super) stamps: HashMap<WsPath, (Stamp, FileEntry)>,
    /// A stamp whose ctime is at or after this is not trusted: the file may have changed
    /// within the clock tick it was stamped in. The latest ctime among the stamps after
    /// [`materialize`]; a [`Workdir`](super::Workdir) moves it to the ctime of a file it
    /// writes after stamping (`None`: every stamp is trusted).
    pub(super) fence: Option<(i64, i64)>,
}

impl Materialized {
    /// True when the file at `path`, as `meta` shows it now, is as [`materialize`] wrote it:
    /// same inode, size, mode, mtime and ctime. A command can set an mtime back, not a
    /// ctime (every write, chmod or utime moves it to the current time). A file stamped in
    /// the last clock tick of the stamping (at or after the [fence](Self::fence)) may have
    /// been changed within that same tick without its ctime moving: it is not trusted (read
    /// again), as git treats a racily clean index entry.
    pub(super) fn untouched(&self, path: &WsPath, meta: &std::fs::Metadata) -> Option<FileEntry> {
        let (stamp, entry) = self.stamps.get(path)?;
        let trusted = self.fence.is_none_or(|fence| stamp.ctime < fence);
        (trusted && *stamp == Stamp::of(meta)).then_some(*entry)
    }
}

/// What `stat` says of a file, to tell whether anything touched it since.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Stamp {
    ino: u64,
    size: u64,
    mode: u32,
    mtime: (i64, i64),
    pub(super) ctime: (i64, i64),
}

impl Stamp {
    pub(super) fn of(meta: &std::fs::Metadata) -> Self {
        use std::os::unix::fs::MetadataExt;
        Self {
            ino: meta.ino(),
            size: meta.size(),
            mode: meta.mode(),
            mtime: (meta.mtime(), meta.mtime_nsec()),
            ctime: (meta.ctime(), meta.ctime_nsec()),
        }
    }
}

/// Write `tree` into `dir` (which must exist and should be empty). Blobs come through the
/// worker's cache, which verified each one when it arrived (a linked file is the store's
/// own, verified when it was put). An error is a [`WorkerError::WriteFile`] or a
/// [`WorkerError::ReadBlob`].
pub async fn materialize(
    tree: &Manifest,
    blobs: &BlobCache,
    dir: &Path,
    make: Make,
) -> Result<Materialized, WorkerError> {
    let mut done = Materialized::default();
    let dirs: Vec<WsPath> = tree.dirs.iter().cloned().collect();
    let root = dir.to_path_buf();
    let made = tokio::task::spawn_blocking(move || {
        for d in &dirs {
            std::fs::create_dir_all(d.to_os_path(&root)).map_err(|e| (d.to_string(), e))?;
        }
        Ok(dirs.len())
    })
    .await
    .unwrap_or_else(|e| Err((String::new(), std::io::Error::other(e))));
    done.dirs = made.map_err(|(path, source)| WorkerError::WriteFile {
        dir: dir.to_path_buf(),
        path,
        source,
    })?;
    // Linked from the store first, all at once off the runtime (a link is one system call:
    // a task per file would cost more than the link); what was not linked is written.
    let linked = match make {
        Make::LinkFromStore => link_all(tree, blobs, dir).await,
        Make::Write => Vec::new(),
    };
    let is_linked = |i: usize| linked.get(i).copied().unwrap_or(false);
    for (i, (_, entry)) in tree.files.iter().enumerate() {
        if is_linked(i) {
            done.files += 1;
            done.bytes += entry.size;
            done.linked_bytes += entry.size;
        }
    }
    // Boxed as `Send` futures here: an iterator of async blocks borrowing the tree would
    // otherwise make the whole call unusable from a spawned task (a higher-ranked `Send`).
    type Write<'a> = BoxFuture<'a, (&'a WsPath, &'a FileEntry, Result<Wrote, WorkerError>)>;
    // Made as slots free up: only the writes in flight exist at once (not one future per
    // file of a large tree).
    let mut files = tree
        .files
        .iter()
        .enumerate()
        .filter(|(i, _)| !is_linked(*i))
        .map(|(_, f)| f);
    let mut written = futures::stream::FuturesUnordered::<Write<'_>>::new();
    loop {
        while written.len() < WRITES_IN_FLIGHT {
            let Some((path, entry)) = files.next() else {
                break;
            };
            written.push(Box::pin(async move {
                (path, entry, write_one(path, entry, blobs, dir).await)
            }));
        }
        let Some((path, entry, wrote)) = written.next().await else {
            break;
        };
        match wrote? {
            Wrote::File { bytes, stamp } => {
                done.files += 1;
                done.bytes += bytes;
                done.stamps.insert(path.clone(), (stamp, *entry));
            }
            Wrote::Symlink => done.files += 1,
            Wrote::Skipped => done.skipped.push(path.clone()),
        }
    }
    done.skipped.sort();
    done.fence = done.stamps.values().map(|(s, _)| s.ctime).max();
    Ok(done)
}

/// What [`write_one`] did.
pub(super) enum Wrote {
    File {
        bytes: u64,
        stamp: Stamp,
    },
    Symlink,
    /// A symlink leaving the tree, not created.
    Skipped,
}

/// Threads linking a tree's files at most (a link is a system call on the file system's
/// metadata: a few threads keep it busy).
const LINK_THREADS: usize = 4;

/// Hard-link the files of `tree` that can be ([`Make::LinkFromStore`]: not executable, not
/// a symlink, and the store has the blob as a file here) into `dir`, whose directories are
/// made. Which files were linked, by their index in the tree; one the file system refused
/// (another file system, too many links, a blob file lost) is not, and is then written.
async fn link_all(tree: &Manifest, blobs: &BlobCache, dir: &Path) -> Vec<bool> {
    use forkfleet_shared::blob::BlobStore;
    let jobs: Vec<(usize, std::path::PathBuf, std::path::PathBuf)> = tree
        .files
        .iter()
        .enumerate()
        .filter(|(_, (_, e))| !e.is_symlink() && e.mode & 0o111 == 0)
        .filter_map(|(i, (p, e))| Some((i, blobs.local_file(&e.hash)?, p.to_os_path(dir))))
        .collect();
    let n = tree.files.len();
    if jobs.is_empty() {
        return Vec::new();
    }
    tokio::task::spawn_blocking(move || {
        let threads = std::thread::available_parallelism()
            .map_or(2, |t| t.get())
            .clamp(1, LINK_THREADS);
        let chunk = jobs.len().div_ceil(threads);
        let linked: Vec<usize> = std::thread::scope(|s| {
            let handles: Vec<_> = jobs
                .chunks(chunk)
                .map(|part| {
                    s.spawn(move || {
                        part.iter()
                            .filter(|(_, source, target)| match link_entry(source, target) {
                                Ok(()) => true,
                                Err(e) => {
                                    tracing::trace!(error = %e, target = %target.display(), "cannot link a blob's file; writing it");
                                    false
                                }
                            })
                            .map(|(i, _, _)| *i)
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            handles
                .into_iter()
                .flat_map(|h| h.join().unwrap_or_default())
                .collect()
        });
        let mut out = vec![false; n];
        for i in linked {
            out[i] = true;
        }
        out
    })
    .await
    .unwrap_or_default()
}

/// Hard-link `source` (a blob's file, which the store gives a non-executable workspace
/// file's permissions) at `target`.
fn link_entry(source: &Path, target: &Path) -> std::io::Result<()> {
    match std::fs::hard_link(source, target) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && source.exists() => {
            if let Some(parent) = target.parent() {
                std::fs::create_dir_all(parent)?;
            }
            std::fs::hard_link(source, target)
        }
        other => other,
    }
}

/// Write one file (or symlink) of a tree.
pub(super) async fn write_one(
    path: &WsPath,
    entry: &FileEntry,
    blobs: &BlobCache,
    dir: &Path,
) -> Result<Wrote, WorkerError> {
    let bytes = blobs
        .get(&entry.hash)
        .await
        .map_err(|source| WorkerError::ReadBlob {
            path: path.to_string(),
            source,
        })?;
    if entry.is_symlink() && !stays_inside(path, &String::from_utf8_lossy(&bytes)) {
        return Ok(Wrote::Skipped);
    }
    let target = path.to_os_path(dir);
    let entry = *entry;
    tokio::task::spawn_blocking(move || write_entry(&target, &bytes, &entry))
        .await
        .unwrap_or_else(|e| Err(std::io::Error::other(e)))
        .map_err(|source| WorkerError::WriteFile {
            dir: dir.to_path_buf(),
            path: path.to_string(),
            source,
        })
}

/// Write one file (or symlink) of a tree where something may be already (a kept tree
/// brought up to date): what is there is removed first (never written through: it may be
/// a symlink, or a file a command made read-only).
pub(super) async fn replace_one(
    path: &WsPath,
    entry: &FileEntry,
    blobs: &BlobCache,
    dir: &Path,
) -> Result<Wrote, WorkerError> {
    let target = path.to_os_path(dir);
    let removed = tokio::task::spawn_blocking(move || match std::fs::symlink_metadata(&target) {
        Ok(meta) if meta.is_dir() => std::fs::remove_dir_all(&target),
        Ok(_) => std::fs::remove_file(&target),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    })
    .await
    .unwrap_or_else(|e| Err(std::io::Error::other(e)));
    removed.map_err(|source| WorkerError::WriteFile {
        dir: dir.to_path_buf(),
        path: path.to_string(),
        source,
    })?;
    write_one(path, entry, blobs, dir).await
}

/// Write one file or symlink at `target` (blocking), and stamp a file as written. A
/// missing parent directory (a manifest that does not list it) is made.
pub(super) fn write_entry(
    target: &Path,
    bytes: &[u8],
    entry: &FileEntry,
) -> std::io::Result<Wrote> {
    let write = || -> std::io::Result<Wrote> {
        if entry.is_symlink() {
            std::os::unix::fs::symlink(&*String::from_utf8_lossy(bytes), target)?;
            return Ok(Wrote::Symlink);
        }
        let mut file = std::fs::File::create(target)?;
        std::io::Write::write_all(&mut file, bytes)?;
        if entry.mode & 0o111 != 0 {
            use std::os::unix::fs::PermissionsExt;
            file.set_permissions(std::fs::Permissions::from_mode(entry.mode & 0o777))?;
        }
        Ok(Wrote::File {
            bytes: bytes.len() as u64,
            stamp: Stamp::of(&file.metadata()?),
        })
    };
    match write() {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            if let Some(parent) = target.parent() {
                std::fs::create_dir_all(parent)?;
            }
            write()
        }
        other => other,
    }
}

/// True when a symlink at `at` pointing to `target` resolves (lexically) inside the tree.
/// An absolute target is outside (for the OS `/` is not the tree's root), and so is one
/// with a `\` ([`WsPath::parse_in`] reads it as a separator, the OS as part of a name, so
/// the two would count its `..` differently).
pub(super) fn stays_inside(at: &WsPath, target: &str) -> bool {
    if target.starts_with('/') || target.contains('\\') {
        return false;
    }
    WsPath::parse_in(&at.parent().unwrap_or_default(), target).is_ok()
}
