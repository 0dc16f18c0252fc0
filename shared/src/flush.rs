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
//!   keeps its content): they are listed in [`FlushReport::conflicts`].
//!   [`ConflictPolicy::Overwrite`] replays them: a conflicting path that was written or
//!   deleted is listed in [`FlushReport::overwritten`] (a local edit replaced), not as a
//!   conflict. Each path is reported once: `applied_paths`, `deleted_paths`, `conflicts`
//!   and `overwritten` are disjoint.
//! - `Rmdir` deletes the target's files under the directory one by one (under keep-parent,
//!   conflicting ones stay), then removes the directories that ended up empty, deepest
//!   first; a directory that still holds kept files stays.
//!
//! # Targets
//! [`FlushTarget`] abstracts the parent: [`ManifestTarget`] (an in-memory manifest, how the
//! coordinator computes the parent's next workspace version) and [`DirTarget`] (a real
//! directory, written atomically, confined to its root).
//!
//! Layout: this file holds the policy, the report, the [`FlushTarget`] trait and [`flush`];
//! `memory` the in-memory targets, `dir` the directory target, `between` [`changes_between`].

mod between;
mod dir;
mod memory;

pub use between::changes_between;
pub use dir::DirTarget;
pub use memory::ManifestTarget;

use crate::blob::BlobHash;
use crate::manifest::{FileEntry, Manifest, Node};
use crate::overlay::ChangeOp;
use crate::path::WsPath;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeSet, HashSet};

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
    /// Every path successfully written (write or edit) that was not a conflict, once,
    /// sorted.
    pub applied_paths: Vec<WsPath>,
    /// How many ops were replayed successfully (skipped and failed ops not counted).
    pub applied_changes: usize,
    /// Paths whose target state differed from the fork-time snapshot and were left as
    /// they are (keep-parent, or an op on them failed), sorted.
    pub conflicts: Vec<WsPath>,
    pub errors: Vec<FlushError>,
    /// Files removed, and directories named by an `Rmdir` that were removed, that were not
    /// conflicts; sorted.
    pub deleted_paths: Vec<WsPath>,
    /// Under overwrite: paths whose target state differed from the fork-time snapshot (a
    /// local edit) and were written or deleted anyway, sorted.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub overwritten: Vec<WsPath>,
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

    // Each path once, with what happened to it: a conflict that was written or deleted
    // anyway (overwrite) is an overwritten local edit, not a conflict kept.
    let (overwritten, conflicts): (BTreeSet<WsPath>, BTreeSet<WsPath>) = conflicts
        .into_iter()
        .partition(|p| applied.contains(p) || deleted.contains(p));
    applied.retain(|p| !overwritten.contains(p));
    deleted.retain(|p| !overwritten.contains(p));
    FlushReport {
        applied_paths: applied.into_iter().collect(),
        applied_changes: count,
        conflicts: conflicts.into_iter().collect(),
        errors,
        deleted_paths: deleted.into_iter().collect(),
        overwritten: overwritten.into_iter().collect(),
    }
}
