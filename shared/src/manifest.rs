//! Workspace snapshots: a manifest of `path -> (hash, size, mode, binary)` plus the
//! directories, taken from a real directory at fork time.

use crate::blob::{is_binary, BlobHash};
use crate::path::{PathError, WsPath};
use bytes::Bytes;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// File mode bits kept in a manifest (the permission bits and the symlink marker).
pub const MODE_FILE: u32 = 0o644;
pub const MODE_EXEC: u32 = 0o755;
pub const MODE_SYMLINK: u32 = 0o120000;

/// One file in a snapshot or an overlay. A symlink's blob holds its target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct FileEntry {
    pub hash: BlobHash,
    pub size: u64,
    pub mode: u32,
    pub binary: bool,
}

impl FileEntry {
    pub fn for_bytes(bytes: &[u8], mode: u32) -> Self {
        Self {
            hash: BlobHash::of(bytes),
            size: bytes.len() as u64,
            mode,
            binary: is_binary(bytes),
        }
    }

    pub fn is_symlink(&self) -> bool {
        self.mode & 0o170000 == MODE_SYMLINK
    }

    /// Same content and same mode: nothing changed.
    pub fn same_as(&self, other: &FileEntry) -> bool {
        self.hash == other.hash && self.mode == other.mode
    }
}

/// A workspace version: every file and every directory.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    #[serde(deserialize_with = "bulk::map")]
    pub files: BTreeMap<WsPath, FileEntry>,
    /// Every directory, including empty ones (the root is implied).
    #[serde(deserialize_with = "bulk::set")]
    pub dirs: BTreeSet<WsPath>,
}

/// A manifest's maps decoded in bulk: the entries are read into a list, then the tree is
/// built from it at once (in path order, as written, it is built without searching),
/// rather than inserted one by one. What a later entry of the same path says wins, as
/// with inserting.
mod bulk {
    use serde::de::{Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
    use std::collections::{BTreeMap, BTreeSet};
    use std::marker::PhantomData;

    /// Entries reserved ahead at most (a hint is the sender's word, not a promise).
    const RESERVE_AT_MOST: usize = 1 << 16;

    pub(super) fn map<'de, D, K, V>(d: D) -> Result<BTreeMap<K, V>, D::Error>
    where
        D: Deserializer<'de>,
        K: Deserialize<'de> + Ord,
        V: Deserialize<'de>,
    {
        struct Entries<K, V>(PhantomData<(K, V)>);
        impl<'de, K: Deserialize<'de> + Ord, V: Deserialize<'de>> Visitor<'de> for Entries<K, V> {
            type Value = BTreeMap<K, V>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a map")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut access: A) -> Result<Self::Value, A::Error> {
                let mut entries =
                    Vec::with_capacity(access.size_hint().unwrap_or(0).min(RESERVE_AT_MOST));
                while let Some(entry) = access.next_entry()? {
                    entries.push(entry);
                }
                Ok(entries.into_iter().collect())
            }
        }
        d.deserialize_map(Entries(PhantomData))
    }

    pub(super) fn set<'de, D, T>(d: D) -> Result<BTreeSet<T>, D::Error>
    where
        D: Deserializer<'de>,
        T: Deserialize<'de> + Ord,
    {
        struct Items<T>(PhantomData<T>);
        impl<'de, T: Deserialize<'de> + Ord> Visitor<'de> for Items<T> {
            type Value = BTreeSet<T>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a sequence")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut access: A) -> Result<Self::Value, A::Error> {
                let mut items =
                    Vec::with_capacity(access.size_hint().unwrap_or(0).min(RESERVE_AT_MOST));
                while let Some(item) = access.next_element()? {
                    items.push(item);
                }
                Ok(items.into_iter().collect())
            }
        }
        d.deserialize_seq(Items(PhantomData))
    }
}

/// What a path is in a manifest or an overlay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Node {
    File(FileEntry),
    Dir,
    Missing,
}

impl Manifest {
    pub fn node(&self, path: &WsPath) -> Node {
        if path.is_root() || self.dirs.contains(path) {
            return Node::Dir;
        }
        match self.files.get(path) {
            Some(e) => Node::File(*e),
            None => Node::Missing,
        }
    }

    /// Files strictly below `dir`, in path order.
    pub fn files_under<'a>(
        &'a self,
        dir: &'a WsPath,
    ) -> impl Iterator<Item = (&'a WsPath, &'a FileEntry)> + 'a {
        let prefix = dir.child_prefix();
        self.files
            .range::<str, _>((
                std::ops::Bound::Included(prefix.as_str()),
                std::ops::Bound::Unbounded,
            ))
            .take_while(move |(p, _)| p.as_str().starts_with(prefix.as_str()))
    }

    /// Directories strictly below `dir`, in path order.
    pub fn dirs_under<'a>(&'a self, dir: &'a WsPath) -> impl Iterator<Item = &'a WsPath> + 'a {
        let prefix = dir.child_prefix();
        self.dirs
            .range::<str, _>((
                std::ops::Bound::Included(prefix.as_str()),
                std::ops::Bound::Unbounded,
            ))
            .take_while(move |p| p.as_str().starts_with(prefix.as_str()))
    }

    /// Remove every file and directory strictly below `dir`.
    pub fn remove_below(&mut self, dir: &WsPath) {
        let files: Vec<WsPath> = self.files_under(dir).map(|(f, _)| f.clone()).collect();
        for f in files {
            self.files.remove(&f);
        }
        let dirs: Vec<WsPath> = self.dirs_under(dir).cloned().collect();
        for d in dirs {
            self.dirs.remove(&d);
        }
    }

    /// Insert a file and every directory above it.
    pub fn insert_file(&mut self, path: WsPath, entry: FileEntry) {
        for a in path.ancestors() {
            self.dirs.insert(a);
        }
        self.files.insert(path, entry);
    }

    pub fn total_bytes(&self) -> u64 {
        self.files.values().map(|e| e.size).sum()
    }

    /// The manifest as one blob (what tasks and checkpoints refer to).
    pub fn to_blob(&self) -> Result<Bytes, rmp_serde::encode::Error> {
        rmp_serde::to_vec_named(self).map(Bytes::from)
    }

    pub fn from_blob(bytes: &[u8]) -> Result<Self, rmp_serde::decode::Error> {
        rmp_serde::from_slice(bytes)
    }
}

/// Why a workspace could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ScanError {
    #[error("workspace `{0}` does not exist or is not a directory")]
    NotADirectory(PathBuf),
    #[error("cannot read `{path}`: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("`{path}` has a name that is not valid UTF-8; forkfleet needs UTF-8 paths")]
    NonUtf8 { path: PathBuf },
    #[error(transparent)]
    Path(#[from] PathError),
    #[error("cannot read the ignore file `{path}`: {error}")]
    Ignore { path: PathBuf, error: String },
    #[error("`{path}` changed while the snapshot was taken; run again")]
    Changed { path: PathBuf },
}

/// A scanned workspace: the manifest and the bytes of every file, by hash.
pub struct Scan {
    pub manifest: Manifest,
    pub blobs: BTreeMap<BlobHash, Bytes>,
}

/// Read a directory into a manifest and its blobs, all in memory (small trees and tests;
/// a snapshot of a workspace goes through [`crate::scan`], which does not hold the bytes).
/// Entries whose name matches `exclude` (a top-level or nested directory or file name such
/// as `.git`) are skipped; no ignore file is read. Symlinks are recorded as symlinks, never
/// followed.
pub fn scan_dir(root: &Path, exclude: &[String]) -> Result<Scan, ScanError> {
    let listing = crate::scan::list(root, &crate::scan::ScanOptions::names_only(exclude))?;
    let mut scan = Scan {
        manifest: Manifest::default(),
        blobs: BTreeMap::new(),
    };
    scan.manifest.dirs.extend(listing.dirs.iter().cloned());
    for f in &listing.files {
        let bytes = match &f.link {
            Some(target) => Bytes::from(target.clone().into_bytes()),
            None => Bytes::from(std::fs::read(&f.full).map_err(|source| ScanError::Io {
                path: f.full.clone(),
                source,
            })?),
        };
        let fe = FileEntry::for_bytes(&bytes, f.stat.mode);
        scan.blobs.insert(fe.hash, bytes);
        scan.manifest.insert_file(f.path.clone(), fe);
    }
    Ok(scan)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scan_records_files_dirs_modes_and_symlinks() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("src/empty")).unwrap();
        std::fs::create_dir_all(dir.path().join(".git")).unwrap();
        std::fs::write(dir.path().join(".git/HEAD"), "x").unwrap();
        std::fs::write(dir.path().join("src/a.txt"), "hello\n").unwrap();
        std::fs::write(dir.path().join("bin.dat"), [0u8, 1, 2]).unwrap();
        #[cfg(unix)]
        std::os::unix::fs::symlink("src/a.txt", dir.path().join("link")).unwrap();
        let scan = scan_dir(dir.path(), &[".git".to_string()]).unwrap();
        let m = &scan.manifest;
        let a = WsPath::parse("src/a.txt").unwrap();
        assert_eq!(m.files[&a].size, 6);
        assert!(!m.files[&a].binary);
        assert!(m.files[&WsPath::parse("bin.dat").unwrap()].binary);
        assert!(m.dirs.contains(&WsPath::parse("src/empty").unwrap()));
        assert_eq!(m.node(&WsPath::parse("src").unwrap()), Node::Dir);
        assert!(!m.files.keys().any(|p| p.as_str().starts_with(".git")));
        #[cfg(unix)]
        assert!(m.files[&WsPath::parse("link").unwrap()].is_symlink());
        let under: Vec<_> = m
            .files_under(&WsPath::parse("src").unwrap())
            .map(|(p, _)| p.as_str().to_string())
            .collect();
        assert_eq!(under, vec!["src/a.txt"]);
        let back = Manifest::from_blob(&m.to_blob().unwrap()).unwrap();
        assert_eq!(&back, m);
    }

    #[test]
    fn missing_workspace_is_an_error() {
        let err = scan_dir(Path::new("/definitely/not/here"), &[])
            .err()
            .unwrap();
        assert!(err.to_string().contains("does not exist"));
    }
}
