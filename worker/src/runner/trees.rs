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
//! - Where the kernel allows it a new tree is layered ([`super::layered`], ADR 25): an
//!   upper directory over the fork's base, which the worker materialises once per fork and
//!   shares between the fork's branches; it is removed when no tree of the fork is held.
//!   Bytes count a base once. A base linked from the run store's files for confined
//!   commands is made in the store's directory of kept trees instead and stays there for
//!   the next process forking the same snapshot (ADR 32: at most four, removed with their
//!   manifest's blob).
//! - Every tree lives in one directory of this worker's, `forkfleet-trees-<pid>-<random>`
//!   in the temporary directory, locked (`flock`) while the worker runs. At start a worker
//!   removes such directories that no live worker holds locked (those of a worker that
//!   crashed or was killed, or one that ended before it finished removing its own), so a
//!   restart leaves nothing behind; both removals run on threads of their own, never in
//!   the way of a worker's start or of a process's end.

use super::layered::{self, Base};
use super::Make;
use super::Workdir;
use crate::cache::BlobCache;
use crate::error::WorkerError;
use forkfleet_shared::blob::{BlobHash, BlobStore};
use forkfleet_shared::ids::ForkId;
use forkfleet_shared::manifest::Manifest;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
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
    /// A new layered tree: an upper directory over the fork's base on this worker
    /// (materialised by the first branch of the fork that ran a command here).
    Layered { paths: usize },
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
    /// The bases of layered trees, by fork ([`super::layered`]): made once, shared by the
    /// fork's branches, dropped (and removed) when no tree uses them.
    bases: Mutex<HashMap<ForkId, Arc<BaseCell>>>,
    /// Trees are layered ([`layered::supported`], unless turned off for this one).
    layered: bool,
}

/// A fork's base on this worker, made by the first checkout that needs it.
struct BaseCell {
    tree: Arc<Manifest>,
    /// `tree`'s blob hash.
    snapshot: BlobHash,
    base: tokio::sync::OnceCell<Arc<Base>>,
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
    /// Its own bytes (a layered tree's upper directory).
    bytes: u64,
    /// When its branch ended.
    finished: Option<Instant>,
    tree: Workdir,
}

impl std::fmt::Debug for Trees {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Trees")
            .field("dir", &self.dir())
            .field("max_bytes", &self.max_bytes)
            .field("layered", &self.layered)
            .finish_non_exhaustive()
    }
}

impl Trees {
    /// Trees kept up to `max_bytes` in a new directory of this worker's (0: none kept).
    /// Directories of workers that are gone are removed first.
    pub fn new(max_bytes: u64) -> Self {
        let dir = match make_dir(&std::env::temp_dir()) {
            Ok((d, _removing)) => Some(d),
            Err(e) => {
                tracing::warn!(error = %e, "cannot make a directory for command trees; every command will start from a fresh copy");
                None
            }
        };
        Self {
            dir,
            max_bytes,
            held: Mutex::new(Held::default()),
            bases: Mutex::new(HashMap::new()),
            layered: layered::supported(),
        }
    }

    /// Never layer trees: every branch keeps a whole tree of its own (as on a kernel
    /// without overlayfs in user namespaces).
    pub fn whole_trees(mut self) -> Self {
        self.layered = false;
        self
    }

    /// True when new trees are layered over a base per fork.
    pub fn layered(&self) -> bool {
        self.layered
    }

    /// Where this worker's trees are (`None`: none are kept).
    pub fn dir(&self) -> Option<&Path> {
        self.dir.as_ref().map(|d| d.path.as_path())
    }

    /// A directory holding `target` for a command: the tree kept for `key` brought up to
    /// date, or a new one: layered over the fork's base where the kernel allows it (`base`:
    /// the branch overlay's base, the fork's snapshot; without it, only a base made already
    /// for the fork is used), whole otherwise. A kept tree that cannot be brought up to date
    /// is removed and a new one made. `confined`: the command will run confined to its
    /// mounted tree (the sandbox applied with Landlock), so a base made for it may
    /// hard-link the store's blob files (ADR 31); a base made so is never used for a
    /// command that is not confined (it gets a whole tree).
    pub async fn checkout(
        &self,
        key: &TreeKey,
        prefix: &str,
        target: Manifest,
        base: Option<(&Arc<Manifest>, BlobHash)>,
        blobs: &BlobCache,
        confined: bool,
    ) -> Result<(Workdir, Checkout), WorkerError> {
        let mut target = target;
        // A kept tree over a linked base is not for a command that is not confined.
        let kept = match self.take(key) {
            Some(kept) if !confined && kept.base_linked() => {
                kept.remove().await;
                None
            }
            other => other,
        };
        if let Some(mut kept) = kept {
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
        if let Some(d) = &self.dir {
            if let Some(base) = self.base(key, base, blobs, &d.path, confined).await? {
                let (tree, paths) = Workdir::layered(&d.path, prefix, base, target, blobs).await?;
                return Ok((tree, Checkout::Layered { paths }));
            }
        }
        let tree = match &self.dir {
            Some(d) => Workdir::create_in(&d.path, prefix, target, blobs).await?,
            None => Workdir::create(prefix, target, blobs).await?,
        };
        Ok((tree, Checkout::Fresh))
    }

    /// The base of `key`'s fork for a layered tree: the one this worker has, or one made
    /// of `tree` (linked from the store when `confined`). `None` when trees are not layered
    /// here, there is no base and no `tree`, or the base is linked and `confined` is not
    /// set.
    async fn base(
        &self,
        key: &TreeKey,
        tree: Option<(&Arc<Manifest>, BlobHash)>,
        blobs: &BlobCache,
        parent: &Path,
        confined: bool,
    ) -> Result<Option<Arc<Base>>, WorkerError> {
        if !self.layered {
            return Ok(None);
        }
        let cell = {
            let Ok(mut bases) = self.bases.lock() else {
                return Ok(None);
            };
            match (bases.get(&key.fork), tree) {
                (Some(c), _) => c.clone(),
                (None, Some((tree, snapshot))) => {
                    let c = Arc::new(BaseCell {
                        tree: tree.clone(),
                        snapshot,
                        base: tokio::sync::OnceCell::new(),
                    });
                    bases.insert(key.fork, c.clone());
                    c
                }
                (None, None) => return Ok(None),
            }
        };
        let base = cell
            .base
            .get_or_try_init(|| async {
                let started = Instant::now();
                // A data dir whose path an overlay mount cannot take (a `,`, `:` or `\`
                // in it) keeps no base: the base is made in this worker's directory.
                let kept = blobs.kept_trees_dir().filter(|d| layered::mountable(d));
                let base = match (confined, kept) {
                    (true, Some(dir)) => {
                        let name = cell.snapshot.to_hex();
                        Base::open_or_make_kept(&dir, &name, cell.tree.clone(), blobs).await?
                    }
                    (true, None) => {
                        Base::create(parent, cell.tree.clone(), blobs, Make::LinkFromStore).await?
                    }
                    (false, _) => {
                        Base::create(parent, cell.tree.clone(), blobs, Make::Write).await?
                    }
                };
                tracing::debug!(
                    fork.id = %key.fork,
                    bytes = base.bytes(),
                    linked_bytes = base.linked_bytes(),
                    kept = base.is_kept(),
                    ms = started.elapsed().as_millis() as u64,
                    "command trees: the fork's base ready"
                );
                Ok::<_, WorkerError>(Arc::new(base))
            })
            .await?;
        if base.linked() && !confined {
            return Ok(None);
        }
        Ok(Some(base.clone()))
    }

    /// Drop the bases no tree uses (their directories go off the runtime).
    fn prune_bases(&self) {
        let gone: Vec<Arc<BaseCell>> = match self.bases.lock() {
            Ok(mut bases) => {
                let unused: Vec<ForkId> = bases
                    .iter()
                    .filter(|(_, c)| c.base.get().is_some_and(|b| Arc::strong_count(b) == 1))
                    .map(|(f, _)| *f)
                    .collect();
                unused.iter().filter_map(|f| bases.remove(f)).collect()
            }
            Err(_) => Vec::new(),
        };
        drop(gone);
    }

    /// Keep `tree` for `key` (replacing one held), then remove the least recently used
    /// trees over the bound and the finished ones past [`FINISHED_TTL`].
    pub fn keep(&self, key: TreeKey, tree: Workdir) {
        let bytes = tree.own_bytes();
        let base_bytes = tree.base_id().map_or(0, |(_, b)| b);
        if self.dir.is_none() || bytes + base_bytes > self.max_bytes {
            drop(tree);
            self.prune_bases();
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
        self.prune_bases();
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
        // A base counts once, however many trees use it.
        let mut users: HashMap<usize, (usize, u64)> = HashMap::new();
        let mut total: u64 = 0;
        for (_, t) in self.trees.iter().filter(|(k, _)| !gone.contains(k)) {
            total += t.bytes;
            if let Some((id, bytes)) = t.tree.base_id() {
                let u = users.entry(id).or_insert((0, bytes));
                if u.0 == 0 {
                    total += bytes;
                }
                u.0 += 1;
            }
        }
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
                if let Some((id, bytes)) = t.tree.base_id() {
                    if let Some(u) = users.get_mut(&id) {
                        u.0 -= 1;
                        if u.0 == 0 {
                            total -= bytes;
                        }
                    }
                }
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
/// Those are removed off the worker's way, on a thread of its own (returned; whatever it
/// does not finish, the next worker to start does).
fn make_dir(tmp: &Path) -> std::io::Result<(TreesDir, Option<std::thread::JoinHandle<()>>)> {
    let gone_from = tmp.to_path_buf();
    let removing = std::thread::Builder::new()
        .name("forkfleet-trees-abandoned".into())
        .spawn(move || remove_abandoned(&gone_from))
        .map_err(|e| tracing::warn!(error = %e, "cannot start removing abandoned command trees"))
        .ok();
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
    Ok((TreesDir { path, _lock: lock }, removing))
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
        let bases = self.bases.get_mut().map(std::mem::take).unwrap_or_default();
        for cell in bases.into_values() {
            if let Some(base) = Arc::into_inner(cell).and_then(|c| c.base.into_inner()) {
                if let Some(base) = Arc::into_inner(base) {
                    base.disown();
                }
            }
        }
        // Removed on a thread of its own, not the runtime's blocking pool: a process that
        // ends does not wait for it (removing a large tree takes seconds on a busy disk).
        // The lock goes with the thread: if the process ends first, the next worker to
        // start finds the directory unlocked and removes the rest.
        if let Some(d) = self.dir.take() {
            let spawned = std::thread::Builder::new()
                .name("forkfleet-trees-removal".into())
                .spawn(move || {
                    super::remove_now(&d.path);
                    drop(d._lock);
                });
            if let Err(e) = spawned {
                tracing::warn!(error = %e, "cannot start removing the command trees");
            }
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
            let (w, how) = trees
                .checkout(k, "t-", m.clone(), None, &cache, false)
                .await
                .unwrap();
            assert_eq!(how, Checkout::Fresh);
            trees.keep(k.clone(), w);
        }
        assert_eq!(trees.held(), (2, 200));
        // `a` used again: `b` is now the least recently used.
        let (w, how) = trees
            .checkout(&a, "t-", m.clone(), None, &cache, false)
            .await
            .unwrap();
        assert_eq!(how, Checkout::Updated { paths: 0 });
        trees.keep(a.clone(), w);
        let (w, _) = trees
            .checkout(&c, "t-", m.clone(), None, &cache, false)
            .await
            .unwrap();
        trees.keep(c.clone(), w);
        assert_eq!(trees.held(), (2, 200));
        let (_, how) = trees
            .checkout(&b, "t-", m.clone(), None, &cache, false)
            .await
            .unwrap();
        assert_eq!(how, Checkout::Fresh, "b was evicted");
        let (_, how) = trees
            .checkout(&a, "t-", m.clone(), None, &cache, false)
            .await
            .unwrap();
        assert_eq!(how, Checkout::Updated { paths: 0 });

        // A tree over the bound alone is not kept.
        let (big, cache) = tree(300);
        let (w, _) = trees
            .checkout(&a, "t-", big, None, &cache, false)
            .await
            .unwrap();
        trees.keep(a.clone(), w);
        assert_eq!(trees.held(), (1, 100), "only c is left");
    }

    #[tokio::test]
    async fn finished_trees_go_after_their_time() {
        let trees = Trees::new(1 << 20);
        let (m, cache) = tree(10);
        let (a, b) = (key("a"), key("b"));
        let (w, _) = trees
            .checkout(&a, "t-", m.clone(), None, &cache, false)
            .await
            .unwrap();
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
        let (w, _) = trees
            .checkout(&b, "t-", m, None, &cache, false)
            .await
            .unwrap();
        trees.keep(b, w);
        assert_eq!(trees.held().0, 1);
    }

    #[test]
    fn directories_of_workers_that_are_gone_are_removed_at_start() {
        let tmp = tempfile::tempdir().unwrap();
        let (live, removing) = make_dir(tmp.path()).unwrap();
        removing.unwrap().join().unwrap();
        // A worker that was killed: its lock file is there, nobody holds it.
        let dead = tmp.path().join(format!("{DIR_PREFIX}1-dead"));
        std::fs::create_dir_all(dead.join("cmd-x/ws")).unwrap();
        std::fs::write(dead.join(LOCK_FILE), b"").unwrap();
        std::fs::write(dead.join("cmd-x/ws/a.txt"), b"left behind").unwrap();
        // Not ours: left alone.
        let other = tmp.path().join("something-else");
        std::fs::create_dir(&other).unwrap();
        let (second, removing) = make_dir(tmp.path()).unwrap();
        removing.unwrap().join().unwrap();
        assert!(!dead.exists(), "a dead worker's trees are removed");
        assert!(live.path.exists(), "a live worker's trees are kept");
        assert!(second.path.exists() && other.exists());
        assert_ne!(live.path, second.path);
    }
}
