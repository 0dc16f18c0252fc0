//! Command trees kept between calls: a branch's materialised tree stays on disk after its
//! `run_command` call, and the next call (or a resolve's test job on the same worker)
//! brings it up to date with only the paths that changed since ([`Workdir::update`])
//! instead of writing the whole tree again.
//!
//! - A tree is held by its branch ([`TreeKey`]: fork and label) and taken out while a
//!   command runs in it, so no two calls share one and eviction never removes a tree in
//!   use.
//! - It is kept only when the directory is exactly a version of the workspace after the
//!   command (everything the command left was taken back); otherwise (a fifo, a file over
//!   the import limit, a symlink leaving the tree, ...) it is removed and the next call
//!   starts from a fresh copy, as every call did before.
//! - Held trees are bounded by bytes (the files of their trees): over the bound the least
//!   recently used ones are removed. A tree over the bound alone is not kept.
//! - A branch that ended keeps its tree for [`FINISHED_TTL`], for the tests of a resolve
//!   that runs on this worker; a test job takes the tree and removes it after.
//! - Every tree lives in one directory of this worker's, `forkfleet-trees-<pid>-<random>`
//!   in the temporary directory, locked (`flock`) while the worker runs. At start a worker
//!   removes such directories that no live worker holds locked (those of a worker that
//!   crashed or was killed), so a restart leaves nothing behind.

use super::Workdir;
use crate::cache::BlobCache;
use crate::error::WorkerError;
use forkfleet_shared::ids::ForkId;
use forkfleet_shared::manifest::Manifest;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Bytes of trees a worker keeps between calls by default (2 GiB).
pub const DEFAULT_TREE_CACHE_BYTES: u64 = 2 << 30;
/// How long a tree stays after its branch ended (for a resolve's tests on this worker).
pub const FINISHED_TTL: Duration = Duration::from_secs(10 * 60);
/// The prefix of a worker's directory of trees, in the temporary directory.
const DIR_PREFIX: &str = "forkfleet-trees-";
/// The name of that directory while it is made.
const MAKING_PREFIX: &str = ".forkfleet-trees-making-";
/// The lock file in that directory, held while the worker runs.
const LOCK_FILE: &str = "lock";

/// Whose tree: a branch of a fork.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TreeKey {
    pub fork: ForkId,
    pub label: String,
}

/// How a checked-out tree came to be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Checkout {
    /// Materialised whole, in a new directory.
    Fresh,
    /// A kept tree, brought up to date by writing or removing `paths` paths.
    Updated { paths: usize },
}

/// The trees a worker keeps (see the module's documentation).
pub struct Trees {
    /// This worker's directory of trees; `None` when it could not be made (trees are then
    /// made in the temporary directory and never kept).
    dir: Option<TreesDir>,
    max_bytes: u64,
    held: Mutex<Held>,
}

/// The directory and its lock (released when the file closes).
struct TreesDir {
    path: PathBuf,
    _lock: std::fs::File,
}

#[derive(Default)]
struct Held {
    /// Last use, to evict the least recently used.
    clock: u64,
    trees: HashMap<TreeKey, HeldTree>,
}

struct HeldTree {
    used: u64,
    bytes: u64,
    /// When its branch ended.
    finished: Option<Instant>,
    tree: Workdir,
}

impl Trees {
    /// Trees kept up to `max_bytes` in a new directory of this worker's (0: none kept).
    /// Directories of workers that are gone are removed first.
    pub fn new(max_bytes: u64) -> Self {
        let dir = match make_dir(&std::env::temp_dir()) {
            Ok(d) => Some(d),
            Err(e) => {
                tracing::warn!(error = %e, "cannot make a directory for command trees; every command will start from a fresh copy");
                None
            }
        };
        Self {
            dir,
            max_bytes,
            held: Mutex::new(Held::default()),
        }
    }

    /// Where this worker's trees are (`None`: none are kept).
    pub fn dir(&self) -> Option<&Path> {
        self.dir.as_ref().map(|d| d.path.as_path())
    }

    /// A directory holding `target` for a command: the tree kept for `key` brought up to
    /// date, or a fresh one. A kept tree that cannot be brought up to date is removed and a
    /// fresh one made.
    pub async fn checkout(
        &self,
        key: &TreeKey,
        prefix: &str,
        target: Manifest,
        blobs: &BlobCache,
    ) -> Result<(Workdir, Checkout), WorkerError> {
        let mut target = target;
        if let Some(mut kept) = self.take(key) {
            match kept.update(target, blobs).await {
                Ok(paths) => return Ok((kept, Checkout::Updated { paths })),
                Err((e, back)) => {
                    tracing::warn!(error = %e, "a kept command tree could not be brought up to date; making a fresh one");
                    kept.remove().await;
                    if e.kind() == forkfleet_shared::error::ErrorKind::Unavailable {
                        return Err(e);
                    }
                    target = back;
                }
            }
        }
        let tree = match &self.dir {
            Some(d) => Workdir::create_in(&d.path, prefix, target, blobs).await?,
            None => Workdir::create(prefix, target, blobs).await?,
        };
        Ok((tree, Checkout::Fresh))
    }

    /// Keep `tree` for `key` (replacing one held), then remove the least recently used
    /// trees over the bound and the finished ones past [`FINISHED_TTL`].
    pub fn keep(&self, key: TreeKey, tree: Workdir) {
        let bytes = tree.bytes();
        if self.dir.is_none() || bytes > self.max_bytes {
            drop(tree);
            return;
        }
        let evicted = {
            let Ok(mut held) = self.held.lock() else {
                return;
            };
            held.clock += 1;
            let used = held.clock;
            held.trees.insert(
                key,
                HeldTree {
                    used,
                    bytes,
                    finished: None,
                    tree,
                },
            );
            held.evict(self.max_bytes, Instant::now())
        };
        // Removed off the runtime (a `Workdir` removes its directory when dropped).
        drop(evicted);
    }

    /// The branch `key` ended: its tree stays [`FINISHED_TTL`] at most.
    pub fn finished(&self, key: &TreeKey) {
        if let Ok(mut held) = self.held.lock() {
            if let Some(t) = held.trees.get_mut(key) {
                t.finished = Some(Instant::now());
            }
        }
    }

    /// Trees held, and their bytes.
    pub fn held(&self) -> (usize, u64) {
        self.held
            .lock()
            .map(|h| (h.trees.len(), h.trees.values().map(|t| t.bytes).sum()))
            .unwrap_or_default()
    }

    fn take(&self, key: &TreeKey) -> Option<Workdir> {
        self.held.lock().ok()?.trees.remove(key).map(|t| t.tree)
    }
}

impl Held {
    /// Remove the finished trees past their time, then the least recently used ones until
    /// the rest fit in `max_bytes`; the removed trees are returned (to be dropped).
    fn evict(&mut self, max_bytes: u64, now: Instant) -> Vec<Workdir> {
        let mut gone: Vec<TreeKey> = self
            .trees
            .iter()
            .filter(|(_, t)| {
                t.finished
                    .is_some_and(|f| now.duration_since(f) > FINISHED_TTL)
            })
            .map(|(k, _)| k.clone())
            .collect();
        let mut total: u64 = self
            .trees
            .iter()
            .filter(|(k, _)| !gone.contains(k))
            .map(|(_, t)| t.bytes)
            .sum();
        if total > max_bytes {
            let mut by_age: Vec<(&TreeKey, &HeldTree)> = self
                .trees
                .iter()
                .filter(|(k, _)| !gone.contains(k))
                .collect();
            by_age.sort_by_key(|(_, t)| t.used);
            for (k, t) in by_age {
                if total <= max_bytes {
                    break;
                }
                total -= t.bytes;
                gone.push(k.clone());
            }
        }
        gone.iter()
            .filter_map(|k| self.trees.remove(k).map(|t| t.tree))
            .collect()
    }
}

/// Make this worker's directory of trees in `tmp`, locked, after removing the directories
/// of workers that are gone.
fn make_dir(tmp: &Path) -> std::io::Result<TreesDir> {
    remove_abandoned(tmp);
    // Made under another name and renamed once locked: another worker starting now never
    // sees it without its lock held.
    let making = tempfile::Builder::new()
        .prefix(MAKING_PREFIX)
        .tempdir_in(tmp)?;
    let lock = std::fs::File::create(making.path().join(LOCK_FILE))?;
    lock.try_lock().map_err(std::io::Error::other)?;
    let unique = making
        .path()
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.strip_prefix(MAKING_PREFIX))
        .unwrap_or_default()
        .to_string();
    let path = tmp.join(format!("{DIR_PREFIX}{}-{unique}", std::process::id()));
    std::fs::rename(making.keep(), &path)?;
    Ok(TreesDir { path, _lock: lock })
}

/// Remove every directory of trees in `tmp` whose lock no process holds: its worker is
/// gone. A directory without a lock file (a worker that died while making it) goes too.
fn remove_abandoned(tmp: &Path) {
    let Ok(entries) = std::fs::read_dir(tmp) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        if !name.to_str().is_some_and(|n| n.starts_with(DIR_PREFIX)) {
            continue;
        }
        let dir = e.path();
        let abandoned = match std::fs::File::open(dir.join(LOCK_FILE)) {
            Ok(f) => f.try_lock().is_ok(),
            Err(e) => e.kind() == std::io::ErrorKind::NotFound,
        };
        if abandoned {
            tracing::info!(dir = %dir.display(), "removing the command trees of a worker that is gone");
            super::remove_now(&dir);
        }
    }
}

impl Drop for Trees {
    fn drop(&mut self) {
        let held = self
            .held
            .get_mut()
            .map(|h| std::mem::take(&mut h.trees))
            .unwrap_or_default();
        // Removed with the whole directory below.
        for t in held.into_values() {
            t.tree.disown();
        }
        if let Some(d) = &self.dir {
            let path = d.path.clone();
            super::off_runtime(move || super::remove_now(&path));
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use forkfleet_shared::manifest::{FileEntry, MODE_FILE};
    use forkfleet_shared::path::WsPath;

    fn key(label: &str) -> TreeKey {
        TreeKey {
            fork: ForkId::new(),
            label: label.into(),
        }
    }

    /// A tree of one file of `size` bytes, and a cache with its blob.
    fn tree(size: usize) -> (Manifest, BlobCache) {
        let store = forkfleet_shared::blob::MemBlobStore::new();
        let bytes = vec![b'x'; size];
        store.insert(Bytes::from(bytes.clone()));
        let mut m = Manifest::default();
        m.insert_file(
            WsPath::parse("f").unwrap(),
            FileEntry::for_bytes(&bytes, MODE_FILE),
        );
        (m, BlobCache::new(std::sync::Arc::new(store), 1 << 20))
    }

    #[tokio::test]
    async fn the_least_recently_used_trees_go_over_the_bound() {
        let trees = Trees::new(250);
        let (m, cache) = tree(100);
        let (a, b, c) = (key("a"), key("b"), key("c"));
        for k in [&a, &b] {
            let (w, how) = trees.checkout(k, "t-", m.clone(), &cache).await.unwrap();
            assert_eq!(how, Checkout::Fresh);
            trees.keep(k.clone(), w);
        }
        assert_eq!(trees.held(), (2, 200));
        // `a` used again: `b` is now the least recently used.
        let (w, how) = trees.checkout(&a, "t-", m.clone(), &cache).await.unwrap();
        assert_eq!(how, Checkout::Updated { paths: 0 });
        trees.keep(a.clone(), w);
        let (w, _) = trees.checkout(&c, "t-", m.clone(), &cache).await.unwrap();
        trees.keep(c.clone(), w);
        assert_eq!(trees.held(), (2, 200));
        let (_, how) = trees.checkout(&b, "t-", m.clone(), &cache).await.unwrap();
        assert_eq!(how, Checkout::Fresh, "b was evicted");
        let (_, how) = trees.checkout(&a, "t-", m.clone(), &cache).await.unwrap();
        assert_eq!(how, Checkout::Updated { paths: 0 });

        // A tree over the bound alone is not kept.
        let (big, cache) = tree(300);
        let (w, _) = trees.checkout(&a, "t-", big, &cache).await.unwrap();
        trees.keep(a.clone(), w);
        assert_eq!(trees.held(), (1, 100), "only c is left");
    }

    #[tokio::test]
    async fn finished_trees_go_after_their_time() {
        let trees = Trees::new(1 << 20);
        let (m, cache) = tree(10);
        let (a, b) = (key("a"), key("b"));
        let (w, _) = trees.checkout(&a, "t-", m.clone(), &cache).await.unwrap();
        trees.keep(a.clone(), w);
        trees.finished(&a);
        {
            let mut held = trees.held.lock().unwrap();
            let later = Instant::now() + FINISHED_TTL + Duration::from_secs(1);
            assert!(
                held.evict(1 << 20, Instant::now()).is_empty(),
                "still in its time"
            );
            let gone = held.evict(1 << 20, later);
            assert_eq!(gone.len(), 1);
            assert!(held.trees.is_empty());
        }
        let (w, _) = trees.checkout(&b, "t-", m, &cache).await.unwrap();
        trees.keep(b, w);
        assert_eq!(trees.held().0, 1);
    }

    #[test]
    fn directories_of_workers_that_are_gone_are_removed_at_start() {
        let tmp = tempfile::tempdir().unwrap();
        let live = make_dir(tmp.path()).unwrap();
        // A worker that was killed: its lock file is there, nobody holds it.
        let dead = tmp.path().join(format!("{DIR_PREFIX}1-dead"));
        std::fs::create_dir_all(dead.join("cmd-x/ws")).unwrap();
        std::fs::write(dead.join(LOCK_FILE), b"").unwrap();
        std::fs::write(dead.join("cmd-x/ws/a.txt"), b"left behind").unwrap();
        // Not ours: left alone.
        let other = tmp.path().join("something-else");
        std::fs::create_dir(&other).unwrap();
        let second = make_dir(tmp.path()).unwrap();
        assert!(!dead.exists(), "a dead worker's trees are removed");
        assert!(live.path.exists(), "a live worker's trees are kept");
        assert!(second.path.exists() && other.exists());
        assert_ne!(live.path, second.path);
    }
}
