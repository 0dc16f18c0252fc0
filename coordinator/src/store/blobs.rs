//! Blobs in the run store: the coordinator's copy of workspace files, scripts, history
//! prefixes and manifests. A small blob (up to [`INLINE_MAX`] bytes) is a value of the sled
//! tree `blobs`; a larger one is a file of its own under `<data>/blob-files/` (the first
//! two hex digits of its hash, then the rest), recorded in the tree `blob_files` (hash ->
//! length) once written. sled keeps the nodes it reads in memory: a workspace's files as
//! values made a run's memory grow with the workspace (ADR 24); as files they are read and
//! released. A store written before ADR 24 holds all its blobs in the tree `blobs`, read as
//! always; one written before ADR 31 kept its files in `<data>/blobs/`, sled's own directory
//! of large values (sled warned of each of ours at every open): they are moved on its next
//! open ([`SledBlobStore::open`]).
//!
//! A blob file is written under a temporary name and renamed into place, then recorded: a
//! recorded blob's file is whole. It is not synced on its own (a sync per file would cost
//! more than the fork): a power loss before the next sync of the file system may lose a
//! blob's bytes, which then reads as missing, as a blob the store never had (and is stored
//! again by the next `put` of it).

use crate::error::CoordinatorError;
use async_trait::async_trait;
use bytes::Bytes;
use forkfleet_shared::blob::{BlobError, BlobHash, BlobStore};
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// Blobs up to this size are sled values; larger ones are files.
pub const INLINE_MAX: usize = 1024;

/// The directory of blob files in the data directory.
pub const FILES_DIR: &str = "blob-files";

/// The directory (in the data directory) where a worker keeps the trees it links from the
/// blob files, each named by its manifest's hash (ADR 32).
pub const KEPT_TREES_DIR: &str = "kept-trees";

/// Where stores written before kept blob files: sled's own directory of large values.
const OLD_FILES_DIR: &str = "blobs";

/// A [`BlobStore`] over the run store (see the module's documentation). `put` verifies the
/// hash, so a blob stored under a hash always has that content.
#[derive(Clone)]
pub struct SledBlobStore {
    tree: sled::Tree,
    /// Blobs stored as files: hash -> length (8 bytes, big-endian).
    files: sled::Tree,
    dir: PathBuf,
    /// [`KEPT_TREES_DIR`].
    kept_trees: PathBuf,
    /// Blobs this process has found stored or stored itself, so that a workspace's files
    /// are looked up and `stat`ed once per process, not once per question (an upload asks,
    /// then the fork it is for checks again). At most [`KNOWN_MAX`]; emptied beyond.
    known: Arc<Mutex<HashSet<BlobHash>>>,
}

/// Blobs [`SledBlobStore`] remembers as stored (32 bytes each, and the set's own).
const KNOWN_MAX: usize = 1 << 20;

fn backend(e: impl std::fmt::Display) -> BlobError {
    BlobError::Backend(e.to_string())
}

impl SledBlobStore {
    /// The blobs of the store in `data_dir` (open, so its lock is held): blob files a
    /// store written before left in sled's directory are moved to [`FILES_DIR`] first.
    pub(crate) fn open(
        tree: sled::Tree,
        files: sled::Tree,
        data_dir: &Path,
    ) -> Result<Self, CoordinatorError> {
        let dir = data_dir.join(FILES_DIR);
        move_old_files(&data_dir.join(OLD_FILES_DIR), &dir).map_err(|e| {
            CoordinatorError::StoreOpen {
                dir: data_dir.to_path_buf(),
                message: format!(
                    "cannot move the blob files of `{OLD_FILES_DIR}/` to `{FILES_DIR}/`: {e}"
                ),
            }
        })?;
        Ok(Self {
            tree,
            files,
            dir,
            kept_trees: data_dir.join(KEPT_TREES_DIR),
            known: Arc::default(),
        })
    }

    /// The file of a blob stored as one.
    fn path(&self, hash: &BlobHash) -> PathBuf {
        let hex = hash.to_hex();
        self.dir.join(&hex[..2]).join(&hex[2..])
    }

    /// The bytes of a blob, synchronously.
    pub fn get_sync(&self, hash: &BlobHash) -> Result<Option<Bytes>, CoordinatorError> {
        self.read(hash).map_err(CoordinatorError::from)
    }

    fn read(&self, hash: &BlobHash) -> Result<Option<Bytes>, BlobError> {
        if let Some(v) = self.tree.get(hash.0).map_err(backend)? {
            return Ok(Some(Bytes::copy_from_slice(&v)));
        }
        if !self.files.contains_key(hash.0).map_err(backend)? {
            return Ok(None);
        }
        match std::fs::read(self.path(hash)) {
            Ok(bytes) => Ok(Some(Bytes::from(bytes))),
            // Recorded, but its bytes were lost (see the module's documentation).
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(backend(format!(
                "cannot read blob file `{}`: {e}",
                self.path(hash).display()
            ))),
        }
    }

    /// Which of `hashes` are not stored, in the order given: asked on every core (a
    /// workspace's files are a lookup and a `stat` each). Blocking.
    pub fn missing_sync(&self, hashes: &[BlobHash]) -> Result<Vec<BlobHash>, BlobError> {
        /// Below this many, one thread asks.
        const PER_THREAD_AT_LEAST: usize = 2048;
        // The ones this process knows are stored, under one lock.
        let unknown: Vec<BlobHash> = match self.known.lock() {
            Ok(k) => hashes.iter().filter(|h| !k.contains(h)).copied().collect(),
            Err(_) => hashes.to_vec(),
        };
        let hashes = &unknown[..];
        if hashes.is_empty() {
            return Ok(Vec::new());
        }
        let threads = std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .min(hashes.len() / PER_THREAD_AT_LEAST)
            .max(1);
        let chunk = hashes.len().div_ceil(threads).max(1);
        let parts: Vec<Result<Vec<BlobHash>, BlobError>> = std::thread::scope(|s| {
            let asked: Vec<_> = hashes
                .chunks(chunk)
                .map(|part| {
                    s.spawn(move || {
                        let mut out = Vec::new();
                        for h in part {
                            if !self.looks_up(h)? {
                                out.push(*h);
                            }
                        }
                        Ok(out)
                    })
                })
                .collect();
            asked
                .into_iter()
                .map(|t| {
                    t.join()
                        .unwrap_or_else(|_| Err(backend("a blob lookup thread panicked")))
                })
                .collect()
        });
        let mut out = Vec::new();
        for p in parts {
            out.extend(p?);
        }
        Ok(out)
    }

    /// Stored: a value, or a recorded file that is there (one lost is stored again). A
    /// blob this process found stored or stored is not looked up again: a file lost from
    /// under a running store reads as missing, and is found missing by the next process.
    fn has(&self, hash: &BlobHash) -> Result<bool, BlobError> {
        Ok(self.is_known(hash) || self.looks_up(hash)?)
    }

    /// [`SledBlobStore::has`] asked of sled and the file system, remembered when stored.
    fn looks_up(&self, hash: &BlobHash) -> Result<bool, BlobError> {
        let has = self.tree.contains_key(hash.0).map_err(backend)?
            || (self.files.contains_key(hash.0).map_err(backend)? && self.path(hash).exists());
        if has {
            self.remember(*hash);
        }
        Ok(has)
    }

    fn is_known(&self, hash: &BlobHash) -> bool {
        self.known.lock().is_ok_and(|k| k.contains(hash))
    }

    fn remember(&self, hash: BlobHash) {
        if let Ok(mut k) = self.known.lock() {
            if k.len() >= KNOWN_MAX {
                k.clear();
            }
            k.insert(hash);
        }
    }

    /// Blobs stored.
    pub fn len(&self) -> usize {
        self.tree.len() + self.files.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tree.is_empty() && self.files.is_empty()
    }

    /// Store bytes whose hash the caller computed (no re-hashing).
    pub(crate) fn put_trusted(&self, hash: BlobHash, bytes: &[u8]) -> Result<(), CoordinatorError> {
        Ok(self.store(hash, bytes)?)
    }

    fn store(&self, hash: BlobHash, bytes: &[u8]) -> Result<(), BlobError> {
        if self.has(&hash)? {
            return Ok(());
        }
        if bytes.len() <= INLINE_MAX {
            self.tree.insert(hash.0, bytes).map_err(backend)?;
            self.remember(hash);
            return Ok(());
        }
        let path = self.path(&hash);
        write_whole(&path, bytes)
            .map_err(|e| backend(format!("cannot write blob file `{}`: {e}", path.display())))?;
        self.files
            .insert(hash.0, &(bytes.len() as u64).to_be_bytes())
            .map_err(backend)?;
        self.remember(hash);
        Ok(())
    }
}

/// Move the blob files under `old` (directories named by two hex digits; sled's own files
/// there are named by numbers and stay) to `new`: a directory at once by a rename, or file
/// by file where `new` has it already (a move cut short). Each file is given the mode
/// [`write_whole`] gives (they were written owner-only), once, here: a command tree's base
/// links blob files as they are (ADR 31).
fn move_old_files(old: &Path, new: &Path) -> std::io::Result<()> {
    let entries = match std::fs::read_dir(old) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    for entry in entries {
        let entry = entry?;
        let name = entry.file_name();
        let ours = name.len() == 2
            && name
                .to_str()
                .is_some_and(|n| n.bytes().all(|b| b.is_ascii_hexdigit()))
            && entry.file_type()?.is_dir();
        if !ours {
            continue;
        }
        std::fs::create_dir_all(new)?;
        let to = new.join(&name);
        // Given their mode before they move, so a move cut short leaves none without it.
        let into_existing = to.exists();
        for file in std::fs::read_dir(entry.path())? {
            let file = file?;
            std::fs::set_permissions(file.path(), file_mode())?;
            if into_existing {
                std::fs::rename(file.path(), to.join(file.file_name()))?;
            }
        }
        if into_existing {
            std::fs::remove_dir(entry.path())?;
        } else {
            std::fs::rename(entry.path(), &to)?;
        }
    }
    Ok(())
}

/// The permissions of a blob file: a workspace file's that is not executable, as a
/// command tree's base shows it through a hard link (ADR 31).
fn file_mode() -> std::fs::Permissions {
    std::os::unix::fs::PermissionsExt::from_mode(forkfleet_shared::manifest::MODE_FILE)
}

/// Write `bytes` at `path` under a temporary name in the same directory, then rename it
/// into place (a reader never sees part of it).
fn write_whole(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = path
        .parent()
        .ok_or_else(|| std::io::Error::other("a blob file has no directory"))?;
    std::fs::create_dir_all(dir)?;
    let mut tmp = tempfile::NamedTempFile::new_in(dir)?;
    std::io::Write::write_all(&mut tmp, bytes)?;
    tmp.as_file().set_permissions(file_mode())?;
    tmp.persist(path).map_err(|e| e.error)?;
    Ok(())
}

#[async_trait]
impl BlobStore for SledBlobStore {
    async fn put(&self, hash: BlobHash, bytes: Bytes) -> Result<(), BlobError> {
        // Hashing and writing a file block: off the runtime, so that puts in flight (an
        // upload of a large workspace) run side by side. A blob that is a sled value (a
        // file an agent wrote, mostly) is hashed and stored here: a hop to a blocking
        // thread and back cost more than the work (about 1,000 context switches per 1,000
        // writes, and dozens of blocking threads, on the fan-out benchmark).
        let store = self.clone();
        let small = bytes.len() <= INLINE_MAX;
        let put = move || {
            let actual = BlobHash::of(&bytes);
            if actual != hash {
                return Err(BlobError::Corrupt {
                    expected: hash,
                    actual,
                });
            }
            store.store(hash, &bytes)
        };
        if small {
            return put();
        }
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => rt
                .spawn_blocking(put)
                .await
                .map_err(|e| backend(format!("a blob write stopped: {e}")))?,
            Err(_) => put(),
        }
    }

    async fn get(&self, hash: &BlobHash) -> Result<Option<Bytes>, BlobError> {
        self.read(hash)
    }

    async fn missing(&self, hashes: &[BlobHash]) -> Result<Vec<BlobHash>, BlobError> {
        let (store, hashes) = (self.clone(), hashes.to_vec());
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => rt
                .spawn_blocking(move || store.missing_sync(&hashes))
                .await
                .map_err(|e| backend(format!("a blob lookup stopped: {e}")))?,
            Err(_) => store.missing_sync(&hashes),
        }
    }

    /// The blob's file, when it is stored as one (recorded: its file is whole, unless lost
    /// since, when a link to it fails and the caller reads the blob as usual).
    fn local_file(&self, hash: &BlobHash) -> Option<PathBuf> {
        self.files
            .contains_key(hash.0)
            .ok()?
            .then(|| self.path(hash))
    }

    fn kept_trees_dir(&self) -> Option<PathBuf> {
        Some(self.kept_trees.clone())
    }
}

impl SledBlobStore {
    /// Every stored blob: its hash, its size, and for a file its last modification (what
    /// the garbage collector's grace period reads).
    pub(crate) fn stored(
        &self,
    ) -> Result<Vec<(BlobHash, u64, Option<std::time::SystemTime>)>, CoordinatorError> {
        let mut out = Vec::new();
        for kv in self.tree.iter() {
            let (k, v) = kv?;
            if let Ok(h) = <[u8; 32]>::try_from(&k[..]) {
                out.push((BlobHash(h), v.len() as u64, None));
            }
        }
        for kv in self.files.iter() {
            let (k, v) = kv?;
            let Ok(h) = <[u8; 32]>::try_from(&k[..]) else {
                continue;
            };
            let hash = BlobHash(h);
            let len = <[u8; 8]>::try_from(&v[..]).map_or(0, u64::from_be_bytes);
            let modified = std::fs::metadata(self.path(&hash))
                .and_then(|m| m.modified())
                .ok();
            out.push((hash, len, modified));
        }
        Ok(out)
    }

    /// Remove a blob: its value, or its record and then its file; and a tree a worker
    /// kept of it when it is a manifest (whose links would keep the bytes of removed blobs
    /// on disk).
    pub(crate) fn remove(&self, hash: &BlobHash) -> Result<(), CoordinatorError> {
        if let Ok(mut k) = self.known.lock() {
            k.remove(hash);
        }
        let kept = self.kept_trees.join(hash.to_hex());
        match std::fs::remove_dir_all(&kept) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                return Err(CoordinatorError::Internal(format!(
                    "cannot remove the kept tree `{}`: {e}",
                    kept.display()
                )))
            }
        }
        self.tree.remove(hash.0)?;
        if self.files.remove(hash.0)?.is_some() {
            match std::fs::remove_file(self.path(hash)) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    return Err(CoordinatorError::Internal(format!(
                        "cannot remove blob file `{}`: {e}",
                        self.path(hash).display()
                    )))
                }
            }
        }
        Ok(())
    }
}
