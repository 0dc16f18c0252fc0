//! A real directory as the parent ([`DirTarget`]): written atomically, confined to its root.

use super::FlushTarget;
use crate::blob::BlobHash;
use crate::manifest::{FileEntry, Node, MODE_EXEC, MODE_FILE, MODE_SYMLINK};
use crate::path::WsPath;
use bytes::Bytes;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

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
