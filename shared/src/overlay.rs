//! The copy-on-write view a branch works in.
//!
//! Reads fall through to the fork-time snapshot; writes and deletes are recorded in the
//! overlay's own node table and in an append-only, ordered change log. The overlay holds
//! metadata only (hashes, sizes, modes): file bytes live in a blob store, so the same type
//! serves the worker that runs a branch and the coordinator's replica built from its log.
//!
//! Semantics (the reference's, plus confinement):
//! - a path resolves overlay first, then the snapshot;
//! - deleting a directory leaves a whiteout that hides the snapshot's whole subtree;
//! - recreating a deleted directory gives an *opaque* one: empty, the snapshot's old
//!   children stay hidden;
//! - writing over a directory and creating a directory over a file are errors;
//! - every successful mutation appends exactly one [`ChangeOp`]; [`Overlay::apply`] replays
//!   one, so `replica.apply(op)` for each op of a log rebuilds the same overlay.

use crate::manifest::{FileEntry, Manifest, Node};
use crate::path::{PathError, WsPath};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

/// One recorded mutation of an overlay. Edits carry the resulting file, so a log can be
/// replayed anywhere with only the blobs it names.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum ChangeOp {
    Write { path: WsPath, entry: FileEntry },
    Edit { path: WsPath, entry: FileEntry },
    Delete { path: WsPath },
    Mkdir { path: WsPath },
    Rmdir { path: WsPath },
}

impl ChangeOp {
    pub fn path(&self) -> &WsPath {
        match self {
            ChangeOp::Write { path, .. }
            | ChangeOp::Edit { path, .. }
            | ChangeOp::Delete { path }
            | ChangeOp::Mkdir { path }
            | ChangeOp::Rmdir { path } => path,
        }
    }

    /// The file this op writes, if it writes one.
    pub fn written(&self) -> Option<&FileEntry> {
        match self {
            ChangeOp::Write { entry, .. } | ChangeOp::Edit { entry, .. } => Some(entry),
            _ => None,
        }
    }

    pub fn kind(&self) -> &'static str {
        match self {
            ChangeOp::Write { .. } => "write",
            ChangeOp::Edit { .. } => "edit",
            ChangeOp::Delete { .. } => "delete",
            ChangeOp::Mkdir { .. } => "mkdir",
            ChangeOp::Rmdir { .. } => "rmdir",
        }
    }
}

/// Why an overlay operation was refused. Nothing is recorded when one is returned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OverlayError {
    #[error("`{0}` does not exist")]
    NotFound(WsPath),
    #[error("`{0}` is a directory; name a file")]
    IsADirectory(WsPath),
    #[error("`{0}` is a file, not a directory")]
    NotADirectory(WsPath),
    #[error("cannot create directory `{0}`: a file exists there")]
    FileExists(WsPath),
    #[error("the workspace root itself cannot be written, edited or deleted")]
    Root,
    #[error("too many levels of symbolic links resolving `{0}`")]
    SymlinkLoop(WsPath),
    #[error(transparent)]
    Path(#[from] PathError),
}

/// What the overlay holds for one path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OvNode {
    File(FileEntry),
    /// A directory; `opaque` hides the snapshot's children below it.
    Dir {
        opaque: bool,
    },
    /// Deleted: hides the snapshot's file or subtree at this path.
    Whiteout,
}

/// The net effect of a branch on one file, relative to the snapshot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum NetChange {
    Created(FileEntry),
    Modified(FileEntry),
    Deleted,
}

impl NetChange {
    pub fn entry(&self) -> Option<&FileEntry> {
        match self {
            NetChange::Created(e) | NetChange::Modified(e) => Some(e),
            NetChange::Deleted => None,
        }
    }
}

/// One child in a directory listing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirEntry {
    pub name: String,
    pub is_dir: bool,
    pub size: u64,
}

/// A branch's copy-on-write view of a snapshot.
#[derive(Debug, Clone)]
pub struct Overlay {
    base: Arc<Manifest>,
    nodes: BTreeMap<WsPath, OvNode>,
    log: Vec<ChangeOp>,
}

impl Overlay {
    pub fn new(base: Arc<Manifest>) -> Self {
        Self {
            base,
            nodes: BTreeMap::new(),
            log: Vec::new(),
        }
    }

    /// Rebuild an overlay from a change log (a replica). Fails on the first op that does
    /// not apply, which means the log was not produced by an overlay over this base.
    pub fn from_log<'a>(
        base: Arc<Manifest>,
        log: impl IntoIterator<Item = &'a ChangeOp>,
    ) -> Result<Self, OverlayError> {
        let mut ov = Self::new(base);
        for op in log {
            ov.apply(op.clone())?;
        }
        Ok(ov)
    }

    pub fn base(&self) -> &Arc<Manifest> {
        &self.base
    }

    /// The append-only change log, in the order the changes were made.
    pub fn changes(&self) -> &[ChangeOp] {
        &self.log
    }

    /// What `path` is in this view, without following symlinks.
    pub fn node(&self, path: &WsPath) -> Node {
        if path.is_root() {
            return Node::Dir;
        }
        match self.above(path) {
            Some(base_visible) => self.at(path, base_visible),
            None => Node::Missing,
        }
    }

    /// What the view's directories above `path` say of it: `None` when they hide it (a
    /// file or whiteout above it, or a directory above it that is not there), else whether
    /// the snapshot still shows through them (no opaque directory above it). The same for
    /// every path of one directory.
    fn above(&self, path: &WsPath) -> Option<bool> {
        let mut base_visible = true;
        for a in path.ancestor_strs() {
            match self.nodes.get(a) {
                Some(OvNode::Whiteout) | Some(OvNode::File(_)) => return None,
                Some(OvNode::Dir { opaque }) => {
                    if *opaque {
                        base_visible = false;
                    }
                }
                None => {
                    if !base_visible || !self.base.dirs.contains(a) {
                        return None;
                    }
                }
            }
        }
        Some(base_visible)
    }

    /// The node at `path` (not the root), given what [`Overlay::above`] said of it.
    fn at(&self, path: &WsPath, base_visible: bool) -> Node {
        match self.nodes.get(path) {
            Some(OvNode::File(e)) => Node::File(*e),
            Some(OvNode::Dir { .. }) => Node::Dir,
            Some(OvNode::Whiteout) => Node::Missing,
            None if base_visible => self.base.node(path),
            None => Node::Missing,
        }
    }

    /// The file at `path` (not following symlinks).
    pub fn file(&self, path: &WsPath) -> Result<FileEntry, OverlayError> {
        match self.node(path) {
            Node::File(e) => Ok(e),
            Node::Dir => Err(OverlayError::IsADirectory(path.clone())),
            Node::Missing => Err(OverlayError::NotFound(path.clone())),
        }
    }

    /// Follow symlinks in every component of `path`. `read_link` returns a symlink's target
    /// (the content of its blob). A target that leaves the workspace is an error.
    pub fn resolve(
        &self,
        path: &WsPath,
        read_link: &dyn Fn(&FileEntry) -> Option<String>,
    ) -> Result<WsPath, OverlayError> {
        let mut hops = 0;
        let mut pending: Vec<String> = path.components().rev().map(str::to_string).collect();
        let mut done = WsPath::root();
        while let Some(part) = pending.pop() {
            let next = done.join(&part)?;
            match self.node(&next) {
                Node::File(e) if e.is_symlink() => {
                    hops += 1;
                    if hops > 40 {
                        return Err(OverlayError::SymlinkLoop(path.clone()));
                    }
                    let target =
                        read_link(&e).ok_or_else(|| OverlayError::NotFound(next.clone()))?;
                    let parent = next.parent().unwrap_or_default();
                    let resolved = WsPath::parse_in(&parent, &target).map_err(|_| {
                        PathError::SymlinkEscapes {
                            path: next.to_string(),
                            target: target.clone(),
                        }
                    })?;
                    if target.starts_with('/') {
                        return Err(PathError::SymlinkEscapes {
                            path: next.to_string(),
                            target,
                        }
                        .into());
                    }
                    for c in resolved.components().collect::<Vec<_>>().into_iter().rev() {
                        pending.push(c.to_string());
                    }
                    done = WsPath::root();
                }
                _ => done = next,
            }
        }
        Ok(done)
    }

    /// Create or replace the file at `path`, creating missing parent directories.
    pub fn write(&mut self, path: &WsPath, entry: FileEntry) -> Result<(), OverlayError> {
        self.check_writable(path)?;
        if self.node(path) == Node::Dir {
            return Err(OverlayError::IsADirectory(path.clone()));
        }
        self.make_parents(path)?;
        self.nodes.insert(path.clone(), OvNode::File(entry));
        self.log.push(ChangeOp::Write {
            path: path.clone(),
            entry,
        });
        Ok(())
    }

    /// Replace an existing file's content (the result of an exact string replace).
    pub fn edit(&mut self, path: &WsPath, entry: FileEntry) -> Result<(), OverlayError> {
        self.check_writable(path)?;
        self.file(path)?;
        self.nodes.insert(path.clone(), OvNode::File(entry));
        self.log.push(ChangeOp::Edit {
            path: path.clone(),
            entry,
        });
        Ok(())
    }

    /// Delete a file, or a directory with everything below it.
    pub fn delete(&mut self, path: &WsPath) -> Result<(), OverlayError> {
        self.check_writable(path)?;
        match self.node(path) {
            Node::Missing => Err(OverlayError::NotFound(path.clone())),
            Node::File(_) => {
                self.nodes.insert(path.clone(), OvNode::Whiteout);
                self.log.push(ChangeOp::Delete { path: path.clone() });
                Ok(())
            }
            Node::Dir => {
                self.whiteout_dir(path);
                self.log.push(ChangeOp::Rmdir { path: path.clone() });
                Ok(())
            }
        }
    }

    /// Remove a directory and its subtree.
    pub fn rmdir(&mut self, path: &WsPath) -> Result<(), OverlayError> {
        self.check_writable(path)?;
        match self.node(path) {
            Node::Dir => {
                self.whiteout_dir(path);
                self.log.push(ChangeOp::Rmdir { path: path.clone() });
                Ok(())
            }
            Node::File(_) => Err(OverlayError::NotADirectory(path.clone())),
            Node::Missing => Err(OverlayError::NotFound(path.clone())),
        }
    }

    /// Create a directory (and its parents). An existing directory is left as it is and
    /// records nothing; a directory recreated after a delete is opaque (empty).
    pub fn mkdir(&mut self, path: &WsPath) -> Result<(), OverlayError> {
        self.check_writable(path)?;
        match self.node(path) {
            Node::Dir => Ok(()),
            Node::File(_) => Err(OverlayError::FileExists(path.clone())),
            Node::Missing => {
                self.make_parents(path)?;
                self.create_dir(path);
                self.log.push(ChangeOp::Mkdir { path: path.clone() });
                Ok(())
            }
        }
    }

    /// Replay one op of a change log.
    pub fn apply(&mut self, op: ChangeOp) -> Result<(), OverlayError> {
        match op {
            ChangeOp::Write { path, entry } => self.write(&path, entry),
            ChangeOp::Edit { path, entry } => self.edit(&path, entry),
            ChangeOp::Delete { path } => match self.node(&path) {
                Node::Dir => Err(OverlayError::IsADirectory(path)),
                _ => self.delete(&path),
            },
            ChangeOp::Mkdir { path } => self.mkdir(&path),
            ChangeOp::Rmdir { path } => self.rmdir(&path),
        }
    }

    /// The children of a directory, sorted by name.
    pub fn list(&self, dir: &WsPath) -> Result<Vec<DirEntry>, OverlayError> {
        match self.node(dir) {
            Node::Dir => {}
            Node::File(_) => return Err(OverlayError::NotADirectory(dir.clone())),
            Node::Missing => return Err(OverlayError::NotFound(dir.clone())),
        }
        let prefix = dir.child_prefix();
        let mut names: BTreeSet<String> = BTreeSet::new();
        let direct = |p: &WsPath| -> Option<String> {
            let rest = p.as_str().strip_prefix(prefix.as_str())?;
            Some(rest.split('/').next().unwrap_or(rest).to_string())
        };
        for (p, _) in self.base.files_under(dir) {
            names.extend(direct(p));
        }
        for p in self.base.dirs_under(dir) {
            names.extend(direct(p));
        }
        for p in self
            .nodes
            .keys()
            .filter(|p| p.starts_with(dir) && *p != dir)
        {
            names.extend(direct(p));
        }
        let mut out = Vec::new();
        for name in names {
            let child = dir.join(&name)?;
            match self.node(&child) {
                Node::File(e) => out.push(DirEntry {
                    name,
                    is_dir: false,
                    size: e.size,
                }),
                Node::Dir => out.push(DirEntry {
                    name,
                    is_dir: true,
                    size: 0,
                }),
                Node::Missing => {}
            }
        }
        Ok(out)
    }

    /// Every visible file, in path order.
    pub fn files(&self) -> Vec<(WsPath, FileEntry)> {
        self.to_manifest().files.into_iter().collect()
    }

    /// Every visible directory, in path order (the root excluded).
    pub fn dirs(&self) -> Vec<WsPath> {
        self.to_manifest().dirs.into_iter().collect()
    }

    /// The view as a manifest (used to materialise a branch's tree, on every command a
    /// branch runs): the snapshot with the branch's own paths applied in path order, so
    /// its cost is a copy of the snapshot's maps plus the paths the branch touched (a
    /// parent's before its children). Each own path is what [`Overlay::node`] says it is;
    /// the snapshot's paths below one that hides them (deleted, a file, or an opaque
    /// directory) go with it, and the branch's own paths below it come back after.
    pub fn to_manifest(&self) -> Manifest {
        let mut m = (*self.base).clone();
        for (p, own) in self.nodes.iter().filter(|(p, _)| !p.is_root()) {
            let node = self.node(p);
            let hides_below = match (&node, own) {
                (Node::Dir, OvNode::Dir { opaque }) => *opaque,
                (Node::Dir, _) => false,
                (Node::File(_) | Node::Missing, _) => true,
            };
            if hides_below {
                m.remove_below(p);
            }
            match node {
                Node::File(e) => {
                    m.dirs.remove(p);
                    m.insert_file(p.clone(), e);
                }
                Node::Dir => {
                    m.files.remove(p);
                    m.dirs.extend(p.ancestors());
                    m.dirs.insert(p.clone());
                }
                Node::Missing => {
                    m.files.remove(p);
                    m.dirs.remove(p);
                }
            }
        }
        m
    }

    /// What the branch changed, per file, relative to the snapshot: created, modified or
    /// deleted. A file written back with its original content and mode is not a change.
    pub fn net_changes(&self) -> BTreeMap<WsPath, NetChange> {
        let mut candidates: BTreeSet<&WsPath> = BTreeSet::new();
        for (p, n) in &self.nodes {
            match n {
                OvNode::File(_) => {
                    candidates.insert(p);
                    // A file that replaced a deleted directory hides the snapshot's files
                    // below it.
                    candidates.extend(self.base.files_under(p).map(|(bp, _)| bp));
                }
                OvNode::Whiteout | OvNode::Dir { opaque: true } => {
                    if self.base.files.contains_key(p) {
                        candidates.insert(p);
                    }
                    candidates.extend(self.base.files_under(p).map(|(bp, _)| bp));
                }
                OvNode::Dir { opaque: false } => {
                    if let Some((bp, _)) = self.base.files.get_key_value(p) {
                        candidates.insert(bp);
                    }
                }
            }
        }
        let mut out = BTreeMap::new();
        for p in candidates {
            let before = self.base.files.get(p);
            let change = match (before, self.node(p)) {
                (None, Node::File(e)) => Some(NetChange::Created(e)),
                (Some(b), Node::File(e)) if !e.same_as(b) => Some(NetChange::Modified(e)),
                (Some(_), Node::File(_)) => None,
                (Some(_), _) => Some(NetChange::Deleted),
                (None, _) => None,
            };
            if let Some(c) = change {
                out.insert(p.clone(), c);
            }
        }
        out
    }

    fn check_writable(&self, path: &WsPath) -> Result<(), OverlayError> {
        if path.is_root() {
            return Err(OverlayError::Root);
        }
        Ok(())
    }

    fn make_parents(&mut self, path: &WsPath) -> Result<(), OverlayError> {
        for a in path.ancestors() {
            match self.node(&a) {
                Node::Dir => {}
                Node::File(_) => return Err(OverlayError::NotADirectory(a)),
                Node::Missing => self.create_dir(&a),
            }
        }
        Ok(())
    }

    /// Create a directory that is missing in the view. Where the snapshot has (hidden)
    /// content below it, the new directory is opaque so that content stays hidden.
    fn create_dir(&mut self, path: &WsPath) {
        let hides_base = matches!(self.nodes.get(path), Some(OvNode::Whiteout))
            || self.base.node(path) != Node::Missing
            || self.base.files_under(path).next().is_some();
        self.nodes
            .insert(path.clone(), OvNode::Dir { opaque: hides_base });
    }

    fn whiteout_dir(&mut self, path: &WsPath) {
        let prefix = path.child_prefix();
        let below: Vec<WsPath> = self
            .nodes
            .range::<str, _>((
                std::ops::Bound::Included(prefix.as_str()),
                std::ops::Bound::Unbounded,
            ))
            .take_while(|(p, _)| p.as_str().starts_with(prefix.as_str()))
            .map(|(p, _)| p.clone())
            .collect();
        for p in below {
            self.nodes.remove(&p);
        }
        self.nodes.insert(path.clone(), OvNode::Whiteout);
    }
}

/// Why an exact string replace was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EditError {
    #[error("the text to replace was not found in the file")]
    NotFound,
    #[error("the text to replace occurs {count} times; give more context so it is unique, or set replace_all")]
    NotUnique { count: usize },
    #[error("the text to replace is empty")]
    EmptyOld,
}

/// Exact string replace: `old` must occur exactly once unless `replace_all`.
pub fn apply_edit(
    content: &str,
    old: &str,
    new: &str,
    replace_all: bool,
) -> Result<String, EditError> {
    if old.is_empty() {
        return Err(EditError::EmptyOld);
    }
    let count = content.matches(old).count();
    match count {
        0 => Err(EditError::NotFound),
        1 => Ok(content.replacen(old, new, 1)),
        _ if replace_all => Ok(content.replace(old, new)),
        _ => Err(EditError::NotUnique { count }),
    }
}
