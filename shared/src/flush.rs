//! Replaying one branch's change log onto a parent, with conflict detection against the
//! fork-time snapshot.
//!
//! # Semantics (the reference's)
//! - The log is replayed in order.
//! - A write or edit whose path is later deleted (by a later `Delete` of that path or a
//!   later `Rmdir` of the path or an ancestor) is skipped: its content never reaches the
//!   target. The directories it created in the branch's view are still created, so the
//!   target ends with the same directories as the branch.
//! - Deleting what is already gone is tolerated (and counted as replayed).
//! - A failing op is recorded in [`FlushReport::errors`] and the flush goes on.
//! - A path *conflicts* when the target's current state differs from the fork-time
//!   snapshot (a third party modified, deleted or created it since the fork). Conflicts are
//!   decided once, before anything is replayed, over every file path the log touches
//!   (written, edited, deleted, or below a removed directory), comparing against the
//!   snapshot passed in, never against the state at first touch.
//! - [`ConflictPolicy::KeepParent`] does not replay ops on conflicting paths (the parent
//!   keeps its content); [`ConflictPolicy::Overwrite`] replays them. Both list them.
//! - `Rmdir` deletes the target's files under the directory one by one (under keep-parent,
//!   conflicting ones stay), then removes the directories that ended up empty, deepest
//!   first; a directory that still holds kept files stays.
//!
//! # Targets
//! [`FlushTarget`] abstracts the parent: [`ManifestTarget`] (an in-memory manifest, how the
//! coordinator computes the parent's next workspace version) and [`DirTarget`] (a real
//! directory, written atomically, confined to its root).

use crate::blob::BlobHash;
use crate::manifest::{FileEntry, Manifest, Node, MODE_EXEC, MODE_FILE, MODE_SYMLINK};
use crate::overlay::ChangeOp;
use crate::path::WsPath;
use bytes::Bytes;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeSet, HashMap, HashSet};
use std::path::{Path, PathBuf};

/// What to do with a path the parent changed since the fork.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ConflictPolicy {
    /// Do not replay the branch's ops on the path; the parent keeps its content.
    #[default]
    KeepParent,
    /// Replay them; the branch wins. The path is still reported as a conflict.
    Overwrite,
}

impl ConflictPolicy {
    pub fn as_str(&self) -> &'static str {
        match self {
            ConflictPolicy::KeepParent => "keep-parent",
            ConflictPolicy::Overwrite => "overwrite",
        }
    }
}

impl std::fmt::Display for ConflictPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for ConflictPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "keep-parent" => Ok(ConflictPolicy::KeepParent),
            "overwrite" => Ok(ConflictPolicy::Overwrite),
            other => Err(format!(
                "unknown conflict policy `{other}`; use `keep-parent` or `overwrite`"
            )),
        }
    }
}

/// One op (or, for `rmdir`, one path below it) that failed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FlushError {
    pub path: WsPath,
    /// The op kind: `write`, `edit`, `delete`, `mkdir` or `rmdir`.
    pub op: String,
    pub message: String,
}

/// The outcome of a flush.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FlushReport {
    /// Every path successfully written (write or edit), once, sorted.
    pub applied_paths: Vec<WsPath>,
    /// How many ops were replayed successfully (skipped and failed ops not counted).
    pub applied_changes: usize,
    /// Paths whose target state differed from the fork-time snapshot, sorted.
    pub conflicts: Vec<WsPath>,
    pub errors: Vec<FlushError>,
    /// Files removed, and directories named by an `Rmdir` that were removed; sorted.
    pub deleted_paths: Vec<WsPath>,
}

/// The parent a change log is replayed onto.
pub trait FlushTarget {
    /// What `path` is now, without following a final symlink.
    fn node(&self, path: &WsPath) -> Node;

    /// True when `path` is in the state `expected` (a node of the fork-time snapshot): same
    /// kind, and for files the same content and mode. Targets may answer faster than
    /// [`FlushTarget::node`] (a directory compares sizes before hashing).
    fn matches(&self, path: &WsPath, expected: &Node) -> bool {
        nodes_match(&self.node(path), expected)
    }

    /// Every file (symlinks included) strictly below `dir`, sorted. Paths only: the
    /// contents are compared through [`FlushTarget::matches`].
    fn files_under(&self, dir: &WsPath) -> Vec<WsPath>;

    /// Every directory strictly below `dir`, sorted.
    fn dirs_under(&self, dir: &WsPath) -> Vec<WsPath>;

    /// Create or replace the file at `path`, creating its parent directories.
    fn write(&mut self, path: &WsPath, entry: &FileEntry) -> Result<(), String>;

    /// Delete the file at `path`; a missing file is not an error, a directory is.
    fn delete_file(&mut self, path: &WsPath) -> Result<(), String>;

    /// Create the directory `path` and its parents; an existing directory is fine.
    fn mkdir(&mut self, path: &WsPath) -> Result<(), String>;

    /// Remove the directory `path` if it is empty. `Ok(true)` when removed, `Ok(false)`
    /// when it is not empty or not a directory.
    fn remove_dir_if_empty(&mut self, path: &WsPath) -> Result<bool, String>;
}

/// Same kind; files with the same content and mode.
pub fn nodes_match(a: &Node, b: &Node) -> bool {
    match (a, b) {
        (Node::File(x), Node::File(y)) => x.same_as(y),
        (Node::Dir, Node::Dir) | (Node::Missing, Node::Missing) => true,
        _ => false,
    }
}

/// For every op of `changes`, whether it is a write or edit whose path is deleted later.
fn superseded_writes(changes: &[ChangeOp]) -> Vec<bool> {
    let mut skip = vec![false; changes.len()];
    let mut deleted: HashSet<&str> = HashSet::new();
    let mut removed_dirs: HashSet<&str> = HashSet::new();
    for (i, op) in changes.iter().enumerate().rev() {
        match op {
            ChangeOp::Delete { path } => {
                deleted.insert(path.as_str());
            }
            ChangeOp::Rmdir { path } => {
                removed_dirs.insert(path.as_str());
            }
            ChangeOp::Write { path, .. } | ChangeOp::Edit { path, .. } => {
                let later_removed = deleted.contains(path.as_str())
                    || removed_dirs.contains(path.as_str())
                    || path.ancestor_strs().any(|a| removed_dirs.contains(a));
                if let Some(s) = skip.get_mut(i) {
                    *s = later_removed;
                }
            }
            ChangeOp::Mkdir { .. } => {}
        }
    }
    skip
}

/// The blobs a flush of `changes` may write (writes not superseded later), sorted, once
/// each, so that callers can prefetch them.
pub fn needed_blobs(changes: &[ChangeOp]) -> Vec<BlobHash> {
    let skip = superseded_writes(changes);
    let mut out: Vec<BlobHash> = changes
        .iter()
        .zip(&skip)
        .filter(|(_, s)| !**s)
        .filter_map(|(op, _)| op.written().map(|e| e.hash))
        .collect();
    out.sort();
    out.dedup();
    out
}

/// The file paths whose state differs between `target` and `fork_snapshot`, over every
/// file path the log touches.
fn find_conflicts(
    changes: &[ChangeOp],
    fork_snapshot: &Manifest,
    target: &dyn FlushTarget,
) -> BTreeSet<WsPath> {
    let mut touched: BTreeSet<WsPath> = BTreeSet::new();
    let mut removed: BTreeSet<&WsPath> = BTreeSet::new();
    for op in changes {
        match op {
            ChangeOp::Write { path, .. }
            | ChangeOp::Edit { path, .. }
            | ChangeOp::Delete { path } => {
                touched.insert(path.clone());
            }
            ChangeOp::Rmdir { path } => {
                if removed.insert(path) {
                    touched.extend(target.files_under(path));
                    touched.extend(fork_snapshot.files_under(path).map(|(p, _)| p.clone()));
                    if matches!(target.node(path), Node::File(_)) {
                        touched.insert(path.clone());
                    }
                }
            }
            ChangeOp::Mkdir { .. } => {}
        }
    }
    touched
        .into_iter()
        .filter(|p| !target.matches(p, &fork_snapshot.node(p)))
        .collect()
}

/// Replay `changes` onto `target`. See the module documentation for the rules.
pub fn flush(
    changes: &[ChangeOp],
    fork_snapshot: &Manifest,
    target: &mut dyn FlushTarget,
    policy: ConflictPolicy,
) -> FlushReport {
    let skip = superseded_writes(changes);
    let conflicts = find_conflicts(changes, fork_snapshot, target);
    let keep = |p: &WsPath| policy == ConflictPolicy::KeepParent && conflicts.contains(p);

    let mut applied: BTreeSet<WsPath> = BTreeSet::new();
    let mut deleted: BTreeSet<WsPath> = BTreeSet::new();
    let mut errors: Vec<FlushError> = Vec::new();
    let mut count = 0usize;
    let err = |path: &WsPath, op: &str, message: String| FlushError {
        path: path.clone(),
        op: op.to_string(),
        message,
    };

    for (op, skipped) in changes.iter().zip(&skip) {
        match op {
            ChangeOp::Write { path, entry } | ChangeOp::Edit { path, entry } => {
                if *skipped {
                    // The content never lands, but the branch's view has the directories
                    // the write created.
                    if let Some(parent) = path.parent().filter(|p| !p.is_root()) {
                        if target.node(&parent) != Node::Dir {
                            if let Err(m) = target.mkdir(&parent) {
                                errors.push(err(&parent, "mkdir", m));
                            }
                        }
                    }
                    continue;
                }
                if keep(path) {
                    continue;
                }
                match target.write(path, entry) {
                    Ok(()) => {
                        count += 1;
                        applied.insert(path.clone());
                    }
                    Err(m) => errors.push(err(path, op.kind(), m)),
                }
            }
            ChangeOp::Delete { path } => {
                if keep(path) {
                    continue;
                }
                match target.node(path) {
                    Node::Missing => count += 1,
                    Node::Dir => errors.push(err(
                        path,
                        "delete",
                        format!("`{path}` is a directory in the target"),
                    )),
                    Node::File(_) => match target.delete_file(path) {
                        Ok(()) => {
                            count += 1;
                            deleted.insert(path.clone());
                        }
                        Err(m) => errors.push(err(path, "delete", m)),
                    },
                }
            }
            ChangeOp::Mkdir { path } => match target.mkdir(path) {
                Ok(()) => count += 1,
                Err(m) => errors.push(err(path, "mkdir", m)),
            },
            ChangeOp::Rmdir { path } => {
                let mut ok = true;
                if let Node::File(_) = target.node(path) {
                    // A third party put a file where the directory was.
                    if !keep(path) {
                        match target.delete_file(path) {
                            Ok(()) => {
                                deleted.insert(path.clone());
                            }
                            Err(m) => {
                                ok = false;
                                errors.push(err(path, "rmdir", m));
                            }
                        }
                    }
                } else {
                    for f in target.files_under(path) {
                        if keep(&f) {
                            continue;
                        }
                        match target.delete_file(&f) {
                            Ok(()) => {
                                deleted.insert(f);
                            }
                            Err(m) => {
                                ok = false;
                                errors.push(err(&f, "rmdir", m));
                            }
                        }
                    }
                    // Children sort after their parent: reverse order is deepest first.
                    for d in target.dirs_under(path).iter().rev() {
                        if let Err(m) = target.remove_dir_if_empty(d) {
                            ok = false;
                            errors.push(err(d, "rmdir", m));
                        }
                    }
                    match target.remove_dir_if_empty(path) {
                        Ok(true) => {
                            deleted.insert(path.clone());
                        }
                        Ok(false) => {}
                        Err(m) => {
                            ok = false;
                            errors.push(err(path, "rmdir", m));
                        }
                    }
                }
                if ok {
                    count += 1;
                }
            }
        }
    }

    FlushReport {
        applied_paths: applied.into_iter().collect(),
        applied_changes: count,
        conflicts: conflicts.into_iter().collect(),
        errors,
        deleted_paths: deleted.into_iter().collect(),
    }
}

// ---------------------------------------------------------------------------------------
// ManifestTarget

/// An in-memory parent: a manifest mutated in place.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ManifestTarget {
    manifest: Manifest,
}

impl ManifestTarget {
    pub fn new(manifest: Manifest) -> Self {
        Self { manifest }
    }

    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    pub fn into_manifest(self) -> Manifest {
        self.manifest
    }

    fn file_in_the_way(&self, path: &WsPath) -> Option<WsPath> {
        path.ancestors()
            .find(|a| self.manifest.files.contains_key(a))
    }
}

impl FlushTarget for ManifestTarget {
    fn node(&self, path: &WsPath) -> Node {
        self.manifest.node(path)
    }

    fn files_under(&self, dir: &WsPath) -> Vec<WsPath> {
        self.manifest
            .files_under(dir)
            .map(|(p, _)| p.clone())
            .collect()
    }

    fn dirs_under(&self, dir: &WsPath) -> Vec<WsPath> {
        self.manifest.dirs_under(dir).cloned().collect()
    }

    fn write(&mut self, path: &WsPath, entry: &FileEntry) -> Result<(), String> {
        if path.is_root() || self.manifest.dirs.contains(path) {
            return Err(format!("`{path}` is a directory"));
        }
        if let Some(a) = self.file_in_the_way(path) {
            return Err(format!("`{a}` is a file, not a directory"));
        }
        self.manifest.insert_file(path.clone(), *entry);
        Ok(())
    }

    fn delete_file(&mut self, path: &WsPath) -> Result<(), String> {
        if self.manifest.dirs.contains(path) {
            return Err(format!("`{path}` is a directory"));
        }
        self.manifest.files.remove(path);
        Ok(())
    }

    fn mkdir(&mut self, path: &WsPath) -> Result<(), String> {
        if path.is_root() {
            return Ok(());
        }
        if self.manifest.files.contains_key(path) {
            return Err(format!(
                "cannot create directory `{path}`: a file exists there"
            ));
        }
        if let Some(a) = self.file_in_the_way(path) {
            return Err(format!("`{a}` is a file, not a directory"));
        }
        for a in path.ancestors() {
            self.manifest.dirs.insert(a);
        }
        self.manifest.dirs.insert(path.clone());
        Ok(())
    }

    fn remove_dir_if_empty(&mut self, path: &WsPath) -> Result<bool, String> {
        if !self.manifest.dirs.contains(path)
            || self.manifest.files_under(path).next().is_some()
            || self.manifest.dirs_under(path).next().is_some()
        {
            return Ok(false);
        }
        Ok(self.manifest.dirs.remove(path))
    }
}

// ---------------------------------------------------------------------------------------
// An overlay as the parent

/// A branch's overlay as the parent: a fork an agent made inside its branch merges into
/// that branch's overlay (ADR 14). Every replayed op lands in the overlay's change log, so
/// the branch publishes (or its fork actor appends) them as its own file changes.
impl FlushTarget for crate::overlay::Overlay {
    fn node(&self, path: &WsPath) -> Node {
        crate::overlay::Overlay::node(self, path)
    }

    fn files_under(&self, dir: &WsPath) -> Vec<WsPath> {
        self.files()
            .into_iter()
            .map(|(p, _)| p)
            .filter(|p| p.starts_with(dir) && p != dir)
            .collect()
    }

    fn dirs_under(&self, dir: &WsPath) -> Vec<WsPath> {
        self.dirs()
            .into_iter()
            .filter(|p| p.starts_with(dir) && p != dir)
            .collect()
    }

    fn write(&mut self, path: &WsPath, entry: &FileEntry) -> Result<(), String> {
        crate::overlay::Overlay::write(self, path, *entry).map_err(|e| e.to_string())
    }

    fn delete_file(&mut self, path: &WsPath) -> Result<(), String> {
        match crate::overlay::Overlay::node(self, path) {
            Node::Dir => Err(format!("`{path}` is a directory")),
            Node::Missing => Ok(()),
            Node::File(_) => self.delete(path).map_err(|e| e.to_string()),
        }
    }

    fn mkdir(&mut self, path: &WsPath) -> Result<(), String> {
        if path.is_root() {
            return Ok(());
        }
        crate::overlay::Overlay::mkdir(self, path).map_err(|e| e.to_string())
    }

    fn remove_dir_if_empty(&mut self, path: &WsPath) -> Result<bool, String> {
        if crate::overlay::Overlay::node(self, path) != Node::Dir || path.is_root() {
            return Ok(false);
        }
        match self.list(path) {
            Ok(children) if children.is_empty() => {
                self.rmdir(path).map_err(|e| e.to_string())?;
                Ok(true)
            }
            _ => Ok(false),
        }
    }
}

// ---------------------------------------------------------------------------------------
// DirTarget

type Lookup<'a> = Box<dyn Fn(&BlobHash) -> Option<Bytes> + Send + Sync + 'a>;

/// A real directory as the parent. Writes go to a temporary file in the destination
/// directory and are renamed into place; executable bits follow the entry's mode; symlink
/// entries become symlinks whose target is the blob's content. No operation goes through a
/// symlinked directory component that leads outside the root.
pub struct DirTarget<'a> {
    root: PathBuf,
    blobs: Lookup<'a>,
    exclude: Vec<String>,
}

impl std::fmt::Debug for DirTarget<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DirTarget")
            .field("root", &self.root)
            .field("exclude", &self.exclude)
            .finish_non_exhaustive()
    }
}

impl DirTarget<'static> {
    /// A target over `root` (which must exist) writing blobs from `blobs`.
    pub fn new(root: &Path, blobs: HashMap<BlobHash, Bytes>) -> std::io::Result<Self> {
        DirTarget::with_lookup(root, move |h: &BlobHash| blobs.get(h).cloned())
    }
}

impl<'a> DirTarget<'a> {
    /// A target over `root` (which must exist) reading blobs through `lookup`.
    pub fn with_lookup(
        root: &Path,
        lookup: impl Fn(&BlobHash) -> Option<Bytes> + Send + Sync + 'a,
    ) -> std::io::Result<Self> {
        let root = std::fs::canonicalize(root)?;
        if !root.is_dir() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::NotADirectory,
                format!("`{}` is not a directory", root.display()),
            ));
        }
        Ok(Self {
            root,
            blobs: Box::new(lookup),
            exclude: Vec::new(),
        })
    }

    /// Names (at any depth) that listings skip, such as `.git`: a removed directory that
    /// holds one stays.
    pub fn exclude(mut self, names: Vec<String>) -> Self {
        self.exclude = names;
        self
    }

    /// The canonical root.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The OS path of `path`, after checking that no existing directory component is a
    /// symlink leading outside the root.
    fn locate(&self, path: &WsPath) -> Result<PathBuf, String> {
        for a in path.ancestor_strs() {
            let cur = self.root.join(a);
            match std::fs::symlink_metadata(&cur) {
                Ok(m) if m.file_type().is_symlink() => {
                    let real = std::fs::canonicalize(&cur)
                        .map_err(|e| format!("cannot resolve symlink `{a}`: {e}"))?;
                    if !real.starts_with(&self.root) {
                        return Err(format!(
                            "`{a}` is a symlink that leads outside the workspace (to `{}`)",
                            real.display()
                        ));
                    }
                }
                Ok(_) => {}
                Err(_) => break,
            }
        }
        Ok(path.to_os_path(&self.root))
    }

    fn walk(&self, dir: &WsPath, files: bool) -> Vec<WsPath> {
        let mut out = Vec::new();
        let Ok(start) = self.locate(dir) else {
            return out;
        };
        match std::fs::symlink_metadata(&start) {
            Ok(m) if m.is_dir() => {}
            _ => return out,
        }
        let mut stack = vec![(start, dir.clone())];
        while let Some((os, rel)) = stack.pop() {
            let Ok(entries) = std::fs::read_dir(&os) else {
                continue;
            };
            for entry in entries.flatten() {
                let name = entry.file_name();
                let Some(name) = name.to_str() else {
                    continue;
                };
                if self.exclude.iter().any(|x| x == name) {
                    continue;
                }
                let Ok(child) = rel.join(name) else {
                    continue;
                };
                let Ok(ft) = entry.file_type() else {
                    continue;
                };
                if ft.is_dir() {
                    if !files {
                        out.push(child.clone());
                    }
                    stack.push((entry.path(), child));
                } else if files {
                    out.push(child);
                }
            }
        }
        out.sort();
        out
    }
}

/// The manifest mode of a file on disk (as [`crate::manifest::scan_dir`] records it).
#[cfg(unix)]
fn disk_mode(meta: &std::fs::Metadata) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    if meta.permissions().mode() & 0o111 != 0 {
        MODE_EXEC
    } else {
        MODE_FILE
    }
}

#[cfg(not(unix))]
fn disk_mode(_meta: &std::fs::Metadata) -> u32 {
    MODE_FILE
}

fn is_exec(mode: u32) -> bool {
    mode & 0o111 != 0
}

fn hash_file(path: &Path) -> std::io::Result<BlobHash> {
    use sha2::{Digest, Sha256};
    let mut file = std::fs::File::open(path)?;
    let mut hasher = Sha256::new();
    std::io::copy(&mut file, &mut hasher)?;
    Ok(BlobHash(hasher.finalize().into()))
}

fn link_bytes(path: &Path) -> std::io::Result<Vec<u8>> {
    Ok(std::fs::read_link(path)?
        .to_string_lossy()
        .into_owned()
        .into_bytes())
}

fn temp_name(dest: &Path) -> PathBuf {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let name = dest
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    dest.with_file_name(format!(".{name}.forkfleet-{}-{n}.tmp", std::process::id()))
}

impl FlushTarget for DirTarget<'_> {
    fn node(&self, path: &WsPath) -> Node {
        if path.is_root() {
            return Node::Dir;
        }
        let Ok(full) = self.locate(path) else {
            return Node::Missing;
        };
        let Ok(meta) = std::fs::symlink_metadata(&full) else {
            return Node::Missing;
        };
        if meta.file_type().is_symlink() {
            match link_bytes(&full) {
                Ok(b) => Node::File(FileEntry::for_bytes(&b, MODE_SYMLINK)),
                Err(_) => Node::Missing,
            }
        } else if meta.is_dir() {
            Node::Dir
        } else {
            match std::fs::read(&full) {
                Ok(b) => Node::File(FileEntry::for_bytes(&b, disk_mode(&meta))),
                Err(_) => Node::Missing,
            }
        }
    }

    fn matches(&self, path: &WsPath, expected: &Node) -> bool {
        if path.is_root() {
            return *expected == Node::Dir;
        }
        let meta = self
            .locate(path)
            .ok()
            .and_then(|full| std::fs::symlink_metadata(&full).ok().map(|m| (full, m)));
        match (meta, expected) {
            (None, Node::Missing) => true,
            (None, _) => false,
            (Some((_, m)), Node::Dir) => m.is_dir(),
            (Some(_), Node::Missing) => false,
            (Some((full, m)), Node::File(e)) => {
                if m.file_type().is_symlink() {
                    e.is_symlink() && link_bytes(&full).is_ok_and(|b| BlobHash::of(&b) == e.hash)
                } else if m.is_file() {
                    !e.is_symlink()
                        && m.len() == e.size
                        && is_exec(disk_mode(&m)) == is_exec(e.mode)
                        && hash_file(&full).is_ok_and(|h| h == e.hash)
                } else {
                    false
                }
            }
        }
    }

    fn files_under(&self, dir: &WsPath) -> Vec<WsPath> {
        self.walk(dir, true)
    }

    fn dirs_under(&self, dir: &WsPath) -> Vec<WsPath> {
        self.walk(dir, false)
    }

    fn write(&mut self, path: &WsPath, entry: &FileEntry) -> Result<(), String> {
        if path.is_root() {
            return Err("the workspace root cannot be written".to_string());
        }
        let full = self.locate(path)?;
        let bytes = (self.blobs)(&entry.hash)
            .ok_or_else(|| format!("blob {} is not available", entry.hash.short()))?;
        if BlobHash::of(&bytes) != entry.hash {
            return Err(format!(
                "blob {} does not match its hash",
                entry.hash.short()
            ));
        }
        if std::fs::symlink_metadata(&full).is_ok_and(|m| m.is_dir()) {
            return Err(format!("`{path}` is a directory"));
        }
        let parent = full
            .parent()
            .ok_or_else(|| format!("`{path}` has no parent directory"))?;
        std::fs::create_dir_all(parent)
            .map_err(|e| format!("cannot create the directory of `{path}`: {e}"))?;
        let tmp = temp_name(&full);
        let written = if entry.is_symlink() {
            write_link(&tmp, &bytes)
        } else {
            write_file(&tmp, &bytes, entry.mode)
        };
        let result = written.and_then(|()| std::fs::rename(&tmp, &full));
        if let Err(e) = result {
            let _ = std::fs::remove_file(&tmp);
            return Err(format!("cannot write `{path}`: {e}"));
        }
        Ok(())
    }

    fn delete_file(&mut self, path: &WsPath) -> Result<(), String> {
        let full = self.locate(path)?;
        match std::fs::symlink_metadata(&full) {
            Err(_) => Ok(()),
            Ok(m) if m.is_dir() => Err(format!("`{path}` is a directory")),
            Ok(_) => {
                std::fs::remove_file(&full).map_err(|e| format!("cannot delete `{path}`: {e}"))
            }
        }
    }

    fn mkdir(&mut self, path: &WsPath) -> Result<(), String> {
        let full = self.locate(path)?;
        match std::fs::symlink_metadata(&full) {
            Ok(m) if m.is_dir() => return Ok(()),
            Ok(_) => {
                return Err(format!(
                    "cannot create directory `{path}`: a file exists there"
                ))
            }
            Err(_) => {}
        }
        std::fs::create_dir_all(&full).map_err(|e| format!("cannot create directory `{path}`: {e}"))
    }

    fn remove_dir_if_empty(&mut self, path: &WsPath) -> Result<bool, String> {
        if path.is_root() {
            return Ok(false);
        }
        let full = self.locate(path)?;
        match std::fs::symlink_metadata(&full) {
            Ok(m) if m.is_dir() => {}
            _ => return Ok(false),
        }
        match std::fs::remove_dir(&full) {
            Ok(()) => Ok(true),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::DirectoryNotEmpty | std::io::ErrorKind::NotFound
                ) =>
            {
                Ok(false)
            }
            Err(e) => Err(format!("cannot remove directory `{path}`: {e}")),
        }
    }
}

fn write_file(tmp: &Path, bytes: &[u8], mode: u32) -> std::io::Result<()> {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(tmp)?;
    f.write_all(bytes)?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let perm = if is_exec(mode) { 0o755 } else { 0o644 };
        f.set_permissions(std::fs::Permissions::from_mode(perm))?;
    }
    #[cfg(not(unix))]
    let _ = mode;
    Ok(())
}

#[cfg(unix)]
fn write_link(tmp: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let target = String::from_utf8_lossy(bytes).into_owned();
    std::os::unix::fs::symlink(target, tmp)
}

#[cfg(not(unix))]
fn write_link(_tmp: &Path, _bytes: &[u8]) -> std::io::Result<()> {
    Err(std::io::Error::new(
        std::io::ErrorKind::Unsupported,
        "symlinks are not supported on this platform",
    ))
}

// ---------------------------------------------------------------------------------------
// Between two versions

/// The change log that turns workspace version `from` into version `to` (a rewind to a
/// checkpoint): deletes of the files only `from` has (outside the directories removed),
/// rmdirs of the topmost directories only `from` has, mkdirs of the new directories no
/// write creates, and writes of the files `to` has new or different (content or mode).
///
/// Replayed with [`flush`] against `from` as the snapshot, a target at version `from` ends
/// at version `to`; a path of the target that differs from `from` (edited since) is a
/// conflict, kept under [`ConflictPolicy::KeepParent`].
pub fn changes_between(from: &Manifest, to: &Manifest) -> Vec<ChangeOp> {
    let gone_dir = |d: &WsPath| !to.dirs.contains(d);
    // Topmost: its parent stays (or is the root).
    let removed_dirs: Vec<&WsPath> = from
        .dirs
        .iter()
        .filter(|d| gone_dir(d))
        .filter(|d| d.parent().is_none_or(|p| p.is_root() || !gone_dir(&p)))
        .collect();
    let under_removed = |p: &WsPath| {
        p.ancestor_strs()
            .any(|a| from.dirs.contains(a) && !to.dirs.contains(a))
    };
    let mut ops = Vec::new();
    for path in from.files.keys() {
        if !to.files.contains_key(path) && !under_removed(path) {
            ops.push(ChangeOp::Delete { path: path.clone() });
        }
    }
    for d in removed_dirs {
        ops.push(ChangeOp::Rmdir { path: d.clone() });
    }
    for d in to.dirs.difference(&from.dirs) {
        let leaf = to.files_under(d).next().is_none() && to.dirs_under(d).next().is_none();
        if leaf {
            ops.push(ChangeOp::Mkdir { path: d.clone() });
        }
    }
    for (path, entry) in &to.files {
        let same = from.files.get(path).is_some_and(|e| e.same_as(entry));
        if !same {
            ops.push(ChangeOp::Write {
                path: path.clone(),
                entry: *entry,
            });
        }
    }
    ops
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod between_tests {
    use super::*;

    fn p(s: &str) -> WsPath {
        WsPath::parse(s).unwrap()
    }

    fn manifest(files: &[(&str, &str, u32)], dirs: &[&str]) -> Manifest {
        let mut m = Manifest::default();
        for (path, content, mode) in files {
            m.insert_file(p(path), FileEntry::for_bytes(content.as_bytes(), *mode));
        }
        for d in dirs {
            let d = p(d);
            m.dirs.extend(d.ancestors());
            m.dirs.insert(d);
        }
        m
    }

    fn replay(from: &Manifest, to: &Manifest) -> (Vec<ChangeOp>, Manifest, FlushReport) {
        let ops = changes_between(from, to);
        let mut target = ManifestTarget::new(from.clone());
        let report = flush(&ops, from, &mut target, ConflictPolicy::KeepParent);
        (ops, target.into_manifest(), report)
    }

    #[test]
    fn replaying_the_changes_between_two_versions_reaches_the_second() {
        let from = manifest(
            &[
                ("a.txt", "one", MODE_FILE),
                ("keep.txt", "same", MODE_FILE),
                ("run.sh", "echo", MODE_FILE),
                ("old/deep/x.txt", "x", MODE_FILE),
                ("was_file", "f", MODE_FILE),
                ("was_dir/y.txt", "y", MODE_FILE),
            ],
            &["empty_old"],
        );
        let to = manifest(
            &[
                ("a.txt", "two", MODE_FILE),
                ("keep.txt", "same", MODE_FILE),
                ("run.sh", "echo", MODE_EXEC),
                ("new/z.txt", "z", MODE_FILE),
                ("was_file/inner.txt", "i", MODE_FILE),
                ("was_dir", "now a file", MODE_FILE),
            ],
            &["empty_new/leaf"],
        );
        let (ops, reached, report) = replay(&from, &to);
        assert_eq!(reached, to, "{ops:?}");
        assert!(
            report.conflicts.is_empty() && report.errors.is_empty(),
            "{report:?}"
        );
        // Minimal: one rmdir for the removed tree, nothing for the unchanged file, one
        // mkdir for the empty leaf only.
        let kinds: Vec<String> = ops
            .iter()
            .map(|o| format!("{} {}", o.kind(), o.path()))
            .collect();
        assert!(kinds.contains(&"rmdir old".to_string()), "{kinds:?}");
        assert!(!kinds.iter().any(|k| k.contains("old/deep")), "{kinds:?}");
        assert!(!kinds.iter().any(|k| k.contains("keep.txt")), "{kinds:?}");
        assert!(
            kinds.contains(&"mkdir empty_new/leaf".to_string()),
            "{kinds:?}"
        );
        assert!(!kinds.contains(&"mkdir empty_new".to_string()), "{kinds:?}");
        assert!(kinds.contains(&"write run.sh".to_string()), "{kinds:?}");
        // And back.
        let (_, back, report) = replay(&to, &from);
        assert_eq!(back, from);
        assert!(report.conflicts.is_empty() && report.errors.is_empty());
        assert!(changes_between(&to, &to).is_empty());
    }

    #[test]
    fn a_target_edited_since_keeps_its_edit_as_a_conflict() {
        let from = manifest(
            &[("a.txt", "merged", MODE_FILE), ("b.txt", "b", MODE_FILE)],
            &[],
        );
        let to = manifest(&[("a.txt", "original", MODE_FILE)], &[]);
        let ops = changes_between(&from, &to);
        // The target edited a.txt after version `from`, and made c.txt.
        let mut edited = from.clone();
        edited.insert_file(p("a.txt"), FileEntry::for_bytes(b"local edit", MODE_FILE));
        let mut target = ManifestTarget::new(edited);
        let report = flush(&ops, &from, &mut target, ConflictPolicy::KeepParent);
        assert_eq!(report.conflicts, vec![p("a.txt")]);
        assert_eq!(report.deleted_paths, vec![p("b.txt")]);
        let m = target.into_manifest();
        assert_eq!(
            m.files[&p("a.txt")].hash,
            FileEntry::for_bytes(b"local edit", MODE_FILE).hash
        );
    }
}
