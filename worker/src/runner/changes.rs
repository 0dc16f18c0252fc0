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
    pub(super) stamps: HashMap<WsPath, Stamp>,
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
    let mut out = TreeChanges::default();
    // The directory as a version of the tree.
    let mut after = Manifest::default();
    let mut stamps = HashMap::new();
    // Paths left as they are in the tree (not taken back, or unreadable).
    let mut kept: Vec<WsPath> = Vec::new();
    let mut stack = vec![(dir.to_path_buf(), WsPath::root())];
    while let Some((os_dir, rel)) = stack.pop() {
        let entries = match std::fs::read_dir(&os_dir) {
            Ok(e) => e,
            Err(e) => {
                let shown = if rel.is_root() {
                    ".".to_string()
                } else {
                    format!("{rel}/")
                };
                out.not_imported
                    .push((shown, format!("cannot read the directory: {e}")));
                kept.push(rel);
                continue;
            }
        };
        for entry in entries {
            let entry = match entry {
                Ok(e) => e,
                Err(e) => {
                    out.not_imported
                        .push((rel.to_string(), format!("cannot list the directory: {e}")));
                    kept.push(rel.clone());
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
            let full = entry.path();
            let found = std::fs::symlink_metadata(&full)
                .map_err(|e| format!("cannot read it: {e}"))
                .and_then(|meta| {
                    if meta.is_dir() {
                        return Ok(None);
                    }
                    let old = tree
                        .files
                        .get(&path)
                        .filter(|_| written.skipped.binary_search(&path).is_err());
                    let stamp = meta.is_file().then(|| Stamp::of(&meta));
                    read_entry(&full, &meta, &path, old, written, max_file_bytes)
                        .map(|found| Some((found, stamp)))
                });
            match found {
                Ok(None) => {
                    after.dirs.insert(path.clone());
                    stack.push((full, path));
                }
                Ok(Some((found, stamp))) => {
                    if let Some(stamp) = stamp {
                        stamps.insert(path.clone(), stamp);
                    }
                    let entry = match found {
                        Found::Untouched(entry) => entry,
                        Found::Read(entry, bytes) => {
                            out.read += 1;
                            // A mode change only: the blob is the tree's, stored already.
                            if tree.files.get(&path).is_none_or(|o| o.hash != entry.hash) {
                                out.blobs.insert(entry.hash, bytes);
                            }
                            entry
                        }
                    };
                    after.files.insert(path, entry);
                }
                Err(why) => {
                    out.not_imported.push((path.to_string(), why));
                    kept.push(path);
                }
            }
        }
    }
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

/// A file or symlink found by [`tree_changes`].
enum Found {
    /// As materialised: the tree's entry.
    Untouched(FileEntry),
    /// Read: its entry and bytes.
    Read(FileEntry, Bytes),
}

/// The entry of the file or symlink at `full` (`old`: the tree's), or why it is not taken
/// back.
fn read_entry(
    full: &Path,
    meta: &std::fs::Metadata,
    path: &WsPath,
    old: Option<&FileEntry>,
    written: &Materialized,
    max_file_bytes: u64,
) -> Result<Found, String> {
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
        return Ok(Found::Read(
            FileEntry::for_bytes(&bytes, MODE_SYMLINK),
            bytes,
        ));
    }
    if !file_type.is_file() {
        return Err("not a regular file, a directory or a symlink".to_string());
    }
    let old = old.filter(|e| !e.is_symlink());
    if let Some(old) = old {
        if written.untouched(path, meta) {
            return Ok(Found::Untouched(*old));
        }
    }
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
    Ok(Found::Read(FileEntry::for_bytes(&bytes, mode), bytes))
}
