//! Comparing a materialised directory, after a command ran in it, with the tree it was
//! materialised from: the change log between the two and what cannot be taken back.

use super::materialize::{stays_inside, Materialized, Stamp};
use bytes::Bytes;
use forkfleet_shared::blob::BlobHash;
use forkfleet_shared::flush::changes_between;
use forkfleet_shared::manifest::{FileEntry, Manifest, Node, MODE_EXEC, MODE_FILE, MODE_SYMLINK};
use forkfleet_shared::overlay::ChangeOp;
use forkfleet_shared::path::WsPath;
use std::collections::HashMap;
use std::path::Path;

/// What a command did to a materialised tree (see [`tree_changes`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TreeChanges {
    /// The change log from the tree to the directory, as [`changes_between`] makes it:
    /// deletes, removed directories (the topmost of each gone subtree), new empty
    /// directories, then writes (new files, and files whose content or executable bit
    /// changed) in path order.
    pub ops: Vec<ChangeOp>,
    /// The bytes of the writes in `ops` (a symlink's: its target), by hash; not of a mode
    /// change (the tree's blob, in the store already).
    pub blobs: HashMap<BlobHash, Bytes>,
    /// What could not be taken back, and why. Such a path (and everything below it) is left
    /// as it was in the tree: not created, changed or deleted.
    pub not_imported: Vec<(String, String)>,
    /// Files read and hashed to compare them (the others were as materialised).
    pub read: usize,
    /// The directory as the command left it, when all of it was taken back (nothing in
    /// `not_imported`): what a kept tree holds from then on. `None` when some path was left
    /// as it was in the tree (the directory and the tree differ there).
    pub(super) state: Option<DirState>,
}

/// What a materialised directory holds, file by file, as last seen.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct DirState {
    /// The directory as a tree (a symlink it could not hold, see `skipped`, included).
    pub(super) tree: Manifest,
    /// How every regular file looked when it was seen.
    pub(super) stamps: HashMap<WsPath, (Stamp, FileEntry)>,
    /// Symlinks of `tree` leaving it, so not in the directory. In path order.
    pub(super) skipped: Vec<WsPath>,
}

/// Compare `dir`, where `tree` was materialised (`written`: the symlinks it skipped stay as
/// they are in the tree), with `tree`. A regular file is read and hashed unless it is
/// exactly as [`materialize`](super::materialize()) left it (same inode, size, mode, mtime
/// and ctime, not written in its last clock tick); an executable bit counts (a mode is
/// `0o755` or `0o644` as in a snapshot, or the tree's own mode when only the content
/// changed). A symlink is taken back only when its target stays inside the
/// tree. A new or changed file over `max_file_bytes` is not read. Blocking: call it off the
/// async runtime.
pub fn tree_changes(
    dir: &Path,
    tree: &Manifest,
    written: &Materialized,
    max_file_bytes: u64,
) -> TreeChanges {
    let mut walked = walk(dir, tree, written, max_file_bytes, false);
    // The directory as a version of the tree: built at once from what the walk found (in
    // path order after a sort, which a map builds from without searching).
    let mut files = std::mem::take(&mut walked.files);
    files.sort_unstable_by(|a, b| a.0.cmp(&b.0));
    let after = Manifest {
        files: files.into_iter().collect(),
        dirs: std::mem::take(&mut walked.dirs).into_iter().collect(),
    };
    finish(tree, written, walked, after)
}

/// Compare a layered tree ([`super::layered`]) after a command with `tree`, the tree it
/// held: only its upper directory `upper` is walked (what differs from the base `base`,
/// whose symlinks leaving the tree are `base_skipped`); the rest is the base's. Otherwise
/// as [`tree_changes`].
pub(super) fn layered_changes(
    upper: &Path,
    base: &Manifest,
    base_skipped: &[WsPath],
    tree: &Manifest,
    written: &Materialized,
    max_file_bytes: u64,
) -> TreeChanges {
    let mut walked = walk(upper, tree, written, max_file_bytes, true);
    let mut after = base.clone();
    for p in base_skipped {
        after.files.remove(p);
    }
    // A whiteout hides the base's node (and what is below it); an opaque directory what is
    // below it; an upper file a base directory at its path.
    for w in std::mem::take(&mut walked.whiteouts) {
        after.files.remove(&w);
        if after.dirs.remove(&w) {
            after.remove_below(&w);
        }
    }
    for o in std::mem::take(&mut walked.opaque) {
        after.remove_below(&o);
    }
    for (p, e) in std::mem::take(&mut walked.files) {
        if after.dirs.remove(&p) {
            after.remove_below(&p);
        }
        after.files.insert(p, e);
    }
    for d in std::mem::take(&mut walked.dirs) {
        after.files.remove(&d);
        after.dirs.insert(d);
    }
    finish(tree, written, walked, after)
}

/// The change log from `tree` to `after` (what the walk found), with what the walk could
/// not take back left as it was in the tree.
fn finish(tree: &Manifest, written: &Materialized, walked: Walked, after: Manifest) -> TreeChanges {
    let mut after = after;
    let mut out = TreeChanges {
        blobs: walked.blobs,
        not_imported: walked.not_imported,
        read: walked.read,
        ..TreeChanges::default()
    };
    let kept = walked.kept;
    let mut stamps = HashMap::with_capacity(walked.stamps.len());
    stamps.extend(walked.stamps);
    // What is left as it was: the tree's node there (and below), whatever the directory has.
    for p in &kept {
        after.files.retain(|f, _| !f.starts_with(p));
        after.dirs.retain(|d| !d.starts_with(p));
        match tree.node(p) {
            Node::File(e) => {
                after.files.insert(p.clone(), e);
            }
            Node::Dir => {
                if !p.is_root() {
                    after.dirs.insert(p.clone());
                }
                after.dirs.extend(tree.dirs_under(p).cloned());
                after
                    .files
                    .extend(tree.files_under(p).map(|(f, e)| (f.clone(), *e)));
            }
            Node::Missing => {}
        }
    }
    // A symlink that was not created is still there, unless the command put something at
    // its path or removed its directory.
    let mut skipped = Vec::new();
    for p in &written.skipped {
        let dir_there = p
            .parent()
            .is_none_or(|d| d.is_root() || after.dirs.contains(&d));
        if dir_there && after.node(p) == Node::Missing {
            if let Some(e) = tree.files.get(p) {
                after.files.insert(p.clone(), *e);
                skipped.push(p.clone());
            }
        }
    }
    out.ops = changes_between(tree, &after);
    out.not_imported.sort();
    if kept.is_empty() && out.not_imported.is_empty() {
        out.state = Some(DirState {
            tree: after,
            stamps,
            skipped,
        });
    }
    out
}

/// What the walk of a directory found (see [`tree_changes`]).
#[derive(Default)]
struct Walked {
    files: Vec<(WsPath, FileEntry)>,
    dirs: Vec<WsPath>,
    stamps: Vec<(WsPath, (Stamp, FileEntry))>,
    blobs: HashMap<BlobHash, Bytes>,
    not_imported: Vec<(String, String)>,
    kept: Vec<WsPath>,
    read: usize,
    /// In an upper directory: whiteouts, and opaque directories.
    whiteouts: Vec<WsPath>,
    opaque: Vec<WsPath>,
}

impl Walked {
    fn absorb(&mut self, other: Walked) {
        self.files.extend(other.files);
        self.dirs.extend(other.dirs);
        self.stamps.extend(other.stamps);
        self.blobs.extend(other.blobs);
        self.not_imported.extend(other.not_imported);
        self.kept.extend(other.kept);
        self.read += other.read;
        self.whiteouts.extend(other.whiteouts);
        self.opaque.extend(other.opaque);
    }
}

/// Threads walking a directory at once: a stat walk of a large tree is bound by the
/// system calls, which run in parallel.
const WALKERS: usize = 4;

/// Walk `dir` on up to [`WALKERS`] threads, each taking the next directory to list from a
/// shared stack.
fn walk(
    dir: &Path,
    tree: &Manifest,
    written: &Materialized,
    max_file_bytes: u64,
    upper: bool,
) -> Walked {
    use std::sync::{Condvar, Mutex};
    struct Queue {
        dirs: Vec<(std::path::PathBuf, WsPath)>,
        /// Walkers listing a directory now (which may push more).
        busy: usize,
    }
    let queue = Mutex::new(Queue {
        dirs: vec![(dir.to_path_buf(), WsPath::root())],
        busy: 0,
    });
    let wake = Condvar::new();
    let threads = std::thread::available_parallelism()
        .map_or(2, |n| n.get())
        .clamp(1, WALKERS);
    let walker = || {
        let mut mine = Walked::default();
        loop {
            let next = {
                let Ok(mut q) = queue.lock() else { break };
                loop {
                    if let Some(d) = q.dirs.pop() {
                        q.busy += 1;
                        break Some(d);
                    }
                    if q.busy == 0 {
                        break None;
                    }
                    q = match wake.wait(q) {
                        Ok(q) => q,
                        Err(_) => return mine,
                    };
                }
            };
            let Some((os_dir, rel)) = next else {
                wake.notify_all();
                break;
            };
            let subdirs = list_dir(
                &os_dir,
                &rel,
                tree,
                written,
                max_file_bytes,
                upper,
                &mut mine,
            );
            let Ok(mut q) = queue.lock() else { break };
            q.dirs.extend(subdirs);
            q.busy -= 1;
            drop(q);
            wake.notify_all();
        }
        mine
    };
    let mut all = Walked::default();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads).map(|_| s.spawn(walker)).collect();
        for h in handles {
            match h.join() {
                Ok(w) => all.absorb(w),
                Err(_) => {
                    all.not_imported
                        .push((".".to_string(), "the comparison failed".to_string()));
                    all.kept.push(WsPath::root());
                }
            }
        }
    });
    all
}

/// List one directory of the walk into `out` (`upper`: of an overlay's upper directory,
/// with whiteouts and opaque directories); returns its subdirectories.
fn list_dir(
    os_dir: &Path,
    rel: &WsPath,
    tree: &Manifest,
    written: &Materialized,
    max_file_bytes: u64,
    upper: bool,
    out: &mut Walked,
) -> Vec<(std::path::PathBuf, WsPath)> {
    let mut subdirs = Vec::new();
    let entries = match std::fs::read_dir(os_dir) {
        Ok(e) => e,
        Err(e) => {
            let shown = if rel.is_root() {
                ".".to_string()
            } else {
                format!("{rel}/")
            };
            out.not_imported
                .push((shown, format!("cannot read the directory: {e}")));
            out.kept.push(rel.clone());
            return subdirs;
        }
    };
    for entry in entries {
        let entry = match entry {
            Ok(e) => e,
            Err(e) => {
                out.not_imported
                    .push((rel.to_string(), format!("cannot list the directory: {e}")));
                out.kept.push(rel.clone());
                continue;
            }
        };
        let os_name = entry.file_name();
        let shown = |name: &str| format!("{}{name}", rel.child_prefix());
        let Some(name) = os_name.to_str() else {
            out.not_imported.push((
                shown(&os_name.to_string_lossy()),
                "the name is not valid UTF-8".to_string(),
            ));
            continue;
        };
        if name.contains('\\') {
            // forkfleet reads `\` as a separator: this name cannot be a workspace path.
            out.not_imported
                .push((shown(name), "the name has a `\\`".to_string()));
            continue;
        }
        let path = match rel.join(name) {
            Ok(p) => p,
            Err(e) => {
                out.not_imported.push((shown(name), e.to_string()));
                continue;
            }
        };
        let meta = match entry.metadata() {
            Ok(m) => m,
            Err(e) => {
                out.not_imported
                    .push((path.to_string(), format!("cannot read it: {e}")));
                out.kept.push(path);
                continue;
            }
        };
        if upper && super::layered::is_whiteout(&meta) {
            out.whiteouts.push(path);
            continue;
        }
        if meta.is_dir() {
            if upper && super::layered::is_opaque(&entry.path()) {
                out.opaque.push(path.clone());
            }
            out.dirs.push(path.clone());
            subdirs.push((entry.path(), path));
            continue;
        }
        // A file as it was stamped: its entry, without a look in the tree.
        if meta.is_file() {
            if let Some(e) = written.untouched(&path, &meta) {
                out.stamps.push((path.clone(), (Stamp::of(&meta), e)));
                out.files.push((path, e));
                continue;
            }
        }
        let old = tree
            .files
            .get(&path)
            .filter(|_| written.skipped.binary_search(&path).is_err());
        match read_entry(&entry.path(), &meta, &path, old, max_file_bytes) {
            Ok((entry, bytes)) => {
                out.read += 1;
                // A mode change only: the blob is the tree's, stored already.
                if tree.files.get(&path).is_none_or(|o| o.hash != entry.hash) {
                    out.blobs.insert(entry.hash, bytes);
                }
                if meta.is_file() {
                    out.stamps.push((path.clone(), (Stamp::of(&meta), entry)));
                }
                out.files.push((path, entry));
            }
            Err(why) => {
                out.not_imported.push((path.to_string(), why));
                out.kept.push(path);
            }
        }
    }
    subdirs
}

/// The entry and bytes of the file or symlink at `full` (`old`: the tree's entry; the caller
/// found it changed or new), or why it is not taken back.
fn read_entry(
    full: &Path,
    meta: &std::fs::Metadata,
    path: &WsPath,
    old: Option<&FileEntry>,
    max_file_bytes: u64,
) -> Result<(FileEntry, Bytes), String> {
    let file_type = meta.file_type();
    if file_type.is_symlink() {
        let target =
            std::fs::read_link(full).map_err(|e| format!("cannot read the symlink: {e}"))?;
        let target = target
            .to_str()
            .ok_or("a symlink whose target is not valid UTF-8")?
            .to_string();
        if !stays_inside(path, &target) {
            return Err(format!("a symlink to `{target}`, outside the workspace"));
        }
        let bytes = Bytes::from(target.into_bytes());
        return Ok((FileEntry::for_bytes(&bytes, MODE_SYMLINK), bytes));
    }
    if !file_type.is_file() {
        return Err("not a regular file, a directory or a symlink".to_string());
    }
    let old = old.filter(|e| !e.is_symlink());
    let size = meta.len();
    if size > max_file_bytes && old.is_none_or(|e| e.size != size) {
        return Err(format!(
            "{size} bytes, over the limit of {max_file_bytes} bytes"
        ));
    }
    let bytes = Bytes::from(std::fs::read(full).map_err(|e| format!("cannot read it: {e}"))?);
    let exec = {
        use std::os::unix::fs::PermissionsExt;
        meta.permissions().mode() & 0o111 != 0
    };
    let mode = match old {
        Some(e) if (e.mode & 0o111 != 0) == exec => e.mode,
        _ if exec => MODE_EXEC,
        _ => MODE_FILE,
    };
    Ok((FileEntry::for_bytes(&bytes, mode), bytes))
}
