//! Reading a workspace directory for a snapshot, in two steps that never hold the
//! workspace's bytes:
//!
//! - [`list`] walks the directory (stat only, no file read): which paths are in, their
//!   size and mode, and what was left out and why ([`LeftOut`]). Left out: entries whose
//!   name is in `exclude` (at any depth), and what the ignore files say, as git reads them:
//!   `.gitignore` and `.ignore` in any directory and `.git/info/exclude` at the root (when
//!   `respect_gitignore`), and `.forkfleetignore` in any directory (always); in one
//!   directory a later file of that order wins over an earlier one, a deeper directory over
//!   its parents, `!pattern` re-includes, and nothing below an ignored directory comes back
//!   (as in git). Ignore files above the workspace root are not read.
//! - [`hash`] reads and hashes the listed files, in parallel over the cores, each file in
//!   chunks: memory stays a few chunks per thread whatever the workspace's size. A
//!   [`StatCache`] (like git's index) serves a file whose stat is unchanged since it was last
//!   hashed without reading it.
//!
//! The blobs a store lacks are read again when uploaded (`forkfleet_client::workspace`),
//! each checked against its hash.

use crate::blob::BlobHash;
use crate::manifest::{FileEntry, Manifest, ScanError, MODE_EXEC, MODE_FILE, MODE_SYMLINK};
use crate::path::WsPath;
use ignore::gitignore::{Gitignore, GitignoreBuilder};
use ignore::Match;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};

/// The ignore file forkfleet always reads (gitignore syntax).
pub const FORKFLEET_IGNORE: &str = ".forkfleetignore";
/// Left-out paths a [`LeftOut`] names (the largest).
const LARGEST_SHOWN: usize = 5;
/// Bytes read at once while hashing a file.
const CHUNK: usize = 256 * 1024;

/// What a scan leaves out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScanOptions {
    /// Names left out at any depth (`.git`, `.forkfleet`).
    pub exclude: Vec<String>,
    /// Read `.gitignore`, `.ignore` and `.git/info/exclude`.
    pub respect_gitignore: bool,
    /// Read `.forkfleetignore` (every snapshot does; tests of the plain walk do not).
    pub forkfleetignore: bool,
}

impl ScanOptions {
    /// Only `exclude`: no ignore file read.
    pub fn names_only(exclude: &[String]) -> Self {
        Self {
            exclude: exclude.to_vec(),
            respect_gitignore: false,
            forkfleetignore: false,
        }
    }

    /// A snapshot's: `exclude`, `.forkfleetignore`, and the git ignore files unless turned
    /// off.
    pub fn snapshot(exclude: &[String], respect_gitignore: bool) -> Self {
        Self {
            exclude: exclude.to_vec(),
            respect_gitignore,
            forkfleetignore: true,
        }
    }
}

/// Why a path was left out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LeftOutWhy {
    /// Its name is in `exclude`.
    Exclude,
    /// An ignore file says so.
    IgnoreFile,
}

impl LeftOutWhy {
    pub fn as_str(self) -> &'static str {
        match self {
            LeftOutWhy::Exclude => "exclude",
            LeftOutWhy::IgnoreFile => "ignore file",
        }
    }
}

/// One left-out path (a file, or a directory with everything below it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeftOutPath {
    /// A directory ends with `/`.
    pub path: String,
    pub why: LeftOutWhy,
    /// The rule that left it out: `.gitignore: target/` (the ignore file, relative to the
    /// workspace, and its pattern), or the `exclude` name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rule: Option<String>,
    pub files: u64,
    pub bytes: u64,
}

/// What a scan left out: counts by reason, and the largest left-out paths.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeftOut {
    /// Files (and symlinks) left out by an ignore file, and their bytes.
    pub ignored_files: u64,
    pub ignored_bytes: u64,
    /// Left out by an `exclude` name.
    pub excluded_files: u64,
    pub excluded_bytes: u64,
    /// The largest left-out paths by bytes, at most five.
    #[serde(default)]
    pub largest: Vec<LeftOutPath>,
}

impl LeftOut {
    pub fn is_empty(&self) -> bool {
        self.ignored_files == 0 && self.excluded_files == 0 && self.largest.is_empty()
    }

    /// One line for people: `left out: 1,204 files (310.2 MB) by ignore files, 30 files
    /// (1.1 MB) by exclude; largest: target/ (1,200 files, 310 MB, ignore file), ...`.
    pub fn summary(&self) -> String {
        if self.is_empty() {
            return "left out: nothing".to_string();
        }
        let mut parts = Vec::new();
        if self.ignored_files > 0 {
            parts.push(format!(
                "{} (ignore files)",
                files_and_bytes(self.ignored_files, self.ignored_bytes)
            ));
        }
        if self.excluded_files > 0 || self.largest.iter().any(|p| p.why == LeftOutWhy::Exclude) {
            parts.push(format!(
                "{} (exclude)",
                files_and_bytes(self.excluded_files, self.excluded_bytes)
            ));
        }
        let mut out = format!("left out: {}", parts.join(", "));
        if !self.largest.is_empty() {
            let largest: Vec<String> = self
                .largest
                .iter()
                .map(|p| {
                    format!(
                        "{} ({}, {})",
                        p.path,
                        files_and_bytes(p.files, p.bytes),
                        p.rule.as_deref().unwrap_or(p.why.as_str())
                    )
                })
                .collect();
            out.push_str(&format!("; largest: {}", largest.join(", ")));
        }
        out
    }
}

/// `3 files, 1.2 MB`.
fn files_and_bytes(files: u64, bytes: u64) -> String {
    let unit = if files == 1 { "file" } else { "files" };
    format!("{files} {unit}, {}", human_bytes(bytes))
}

/// Bytes in B, KB, MB or GB (powers of 1000, one decimal).
pub fn human_bytes(bytes: u64) -> String {
    let b = bytes as f64;
    if bytes < 1000 {
        format!("{bytes} B")
    } else if b < 1e6 {
        format!("{:.1} KB", b / 1e3)
    } else if b < 1e9 {
        format!("{:.1} MB", b / 1e6)
    } else {
        format!("{:.2} GB", b / 1e9)
    }
}

/// A file or symlink [`list`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listed {
    pub path: WsPath,
    /// Where it is on disk.
    pub full: PathBuf,
    pub stat: Stat,
    /// A symlink's target (its blob).
    pub link: Option<String>,
}

/// What `stat` says of a file, to tell whether it changed since it was hashed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Stat {
    pub size: u64,
    /// The manifest mode: [`MODE_FILE`], [`MODE_EXEC`] or [`MODE_SYMLINK`].
    pub mode: u32,
    pub mtime: (i64, i64),
    pub ctime: (i64, i64),
    pub ino: u64,
    pub dev: u64,
}

impl Stat {
    fn of(meta: &std::fs::Metadata, mode: u32) -> Self {
        use std::os::unix::fs::MetadataExt;
        Self {
            size: meta.size(),
            mode,
            mtime: (meta.mtime(), meta.mtime_nsec()),
            ctime: (meta.ctime(), meta.ctime_nsec()),
            ino: meta.ino(),
            dev: meta.dev(),
        }
    }
}

/// A directory listed for a snapshot.
#[derive(Debug, Clone, Default)]
pub struct Listing {
    pub files: Vec<Listed>,
    /// Every directory kept (the root implied).
    pub dirs: Vec<WsPath>,
    pub left_out: LeftOut,
}

impl Listing {
    pub fn bytes(&self) -> u64 {
        self.files.iter().map(|f| f.stat.size).sum()
    }
}

/// The ignore matchers in force in one directory, deepest last.
struct Rules {
    stack: Vec<(usize, Gitignore)>,
}

impl Rules {
    /// Ignored, per the deepest matcher with an opinion: the rule that says so
    /// (`FILE: PATTERN`, the file relative to `root`).
    fn ignored(&self, root: &Path, full: &Path, is_dir: bool) -> Option<String> {
        for (_, m) in self.stack.iter().rev() {
            match m.matched(full, is_dir) {
                Match::Ignore(glob) => {
                    let file = glob
                        .from()
                        .map(|f| f.strip_prefix(root).unwrap_or(f).display().to_string())
                        .unwrap_or_default();
                    return Some(format!("{file}: {}", glob.original()));
                }
                Match::Whitelist(_) => return None,
                Match::None => {}
            }
        }
        None
    }
}

/// The ignore files of `dir` as one matcher (`None`: it has none). An unreadable or
/// malformed file is an error naming it.
fn matcher(dir: &Path, root: bool, opts: &ScanOptions) -> Result<Option<Gitignore>, ScanError> {
    let mut names: Vec<PathBuf> = Vec::new();
    if opts.respect_gitignore {
        if root {
            names.push(dir.join(".git").join("info").join("exclude"));
        }
        names.push(dir.join(".gitignore"));
        names.push(dir.join(".ignore"));
    }
    if opts.forkfleetignore {
        names.push(dir.join(FORKFLEET_IGNORE));
    }
    let present: Vec<PathBuf> = names.into_iter().filter(|p| p.is_file()).collect();
    if present.is_empty() {
        return Ok(None);
    }
    let mut b = GitignoreBuilder::new(dir);
    for p in &present {
        if let Some(e) = b.add(p) {
            return Err(ScanError::Ignore {
                path: p.clone(),
                error: e.to_string(),
            });
        }
    }
    b.build().map(Some).map_err(|e| ScanError::Ignore {
        path: dir.to_path_buf(),
        error: e.to_string(),
    })
}

/// The file every forkfleet data dir (run store) holds at its root (the coordinator's
/// `STORE_ID_FILE`).
pub const DATA_DIR_MARK: &str = "store-id";

/// True when `dir` is a forkfleet data dir: its [`DATA_DIR_MARK`] file and sled's `conf`.
fn is_data_dir(dir: &Path) -> bool {
    dir.join(DATA_DIR_MARK).is_file() && dir.join("conf").is_file()
}

/// List `root` for a snapshot (see the module's documentation). Symlinks are recorded,
/// never followed. A forkfleet data dir below it, whatever its name, is left out. Blocking.
pub fn list(root: &Path, opts: &ScanOptions) -> Result<Listing, ScanError> {
    if !root.is_dir() {
        return Err(ScanError::NotADirectory(root.to_path_buf()));
    }
    let mut out = Listing::default();
    let mut largest: Vec<LeftOutPath> = Vec::new();
    let mut rules = Rules { stack: Vec::new() };
    // (directory, its path, depth); depth orders the matchers.
    let mut stack = vec![(root.to_path_buf(), WsPath::root(), 0usize)];
    while let Some((dir, rel, depth)) = stack.pop() {
        rules.stack.retain(|(d, _)| *d < depth);
        if let Some(m) = matcher(&dir, depth == 0, opts)? {
            rules.stack.push((depth, m));
        }
        // Depth-first, so the matchers stacked are those of this directory's ancestors:
        // children are pushed after the matchers of this directory, and popped before any
        // sibling of this directory.
        let mut entries: Vec<std::fs::DirEntry> = std::fs::read_dir(&dir)
            .map_err(|source| ScanError::Io {
                path: dir.clone(),
                source,
            })?
            .collect::<Result<_, _>>()
            .map_err(|source| ScanError::Io {
                path: dir.clone(),
                source,
            })?;
        entries.sort_by_key(|e| e.file_name());
        let mut subdirs = Vec::new();
        for entry in entries {
            let os_name = entry.file_name();
            let name = os_name
                .to_str()
                .ok_or_else(|| ScanError::NonUtf8 { path: entry.path() })?;
            let child = rel.join(name)?;
            let full = entry.path();
            // Asked of the directory (`fstatat`), not by the whole path again.
            let meta = entry.metadata().map_err(|source| ScanError::Io {
                path: full.clone(),
                source,
            })?;
            let is_dir = meta.is_dir();
            let why = if opts.exclude.iter().any(|x| x == name) {
                Some((LeftOutWhy::Exclude, format!("exclude: {name}")))
            } else if is_dir && is_data_dir(&full) {
                // A run store under the workspace, whatever its name: its files (a live
                // run's socket token among them) never reach a branch's tree.
                Some((LeftOutWhy::Exclude, format!("a forkfleet data dir: {name}")))
            } else {
                rules
                    .ignored(root, &full, is_dir)
                    .map(|rule| (LeftOutWhy::IgnoreFile, rule))
            };
            if let Some((why, rule)) = why {
                let (files, bytes) = if is_dir {
                    count_below(&full)
                } else {
                    (1, meta.len())
                };
                match why {
                    LeftOutWhy::Exclude => {
                        out.left_out.excluded_files += files;
                        out.left_out.excluded_bytes += bytes;
                    }
                    LeftOutWhy::IgnoreFile => {
                        out.left_out.ignored_files += files;
                        out.left_out.ignored_bytes += bytes;
                    }
                }
                let shown = if is_dir {
                    format!("{child}/")
                } else {
                    child.to_string()
                };
                keep_largest(
                    &mut largest,
                    LeftOutPath {
                        path: shown,
                        why,
                        rule: Some(rule),
                        files,
                        bytes,
                    },
                );
                continue;
            }
            let io = |source| ScanError::Io {
                path: full.clone(),
                source,
            };
            if meta.file_type().is_symlink() {
                let target = std::fs::read_link(&full).map_err(io)?;
                out.files.push(Listed {
                    path: child,
                    stat: Stat::of(&meta, MODE_SYMLINK),
                    full,
                    link: Some(target.to_string_lossy().into_owned()),
                });
            } else if is_dir {
                out.dirs.push(child.clone());
                subdirs.push((full, child, depth + 1));
            } else if meta.is_file() {
                out.files.push(Listed {
                    path: child,
                    stat: Stat::of(&meta, file_mode(&meta)),
                    full,
                    link: None,
                });
            }
        }
        // Reversed: popped in name order.
        stack.extend(subdirs.into_iter().rev());
    }
    out.left_out.largest = largest;
    Ok(out)
}

/// Keep the [`LARGEST_SHOWN`] largest by bytes, largest first.
fn keep_largest(largest: &mut Vec<LeftOutPath>, p: LeftOutPath) {
    largest.push(p);
    largest.sort_by(|a, b| b.bytes.cmp(&a.bytes).then_with(|| a.path.cmp(&b.path)));
    largest.truncate(LARGEST_SHOWN);
}

/// Files (and symlinks) below a left-out directory, and their bytes; unreadable parts
/// are not counted.
fn count_below(dir: &Path) -> (u64, u64) {
    let (mut files, mut bytes) = (0, 0);
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let Ok(meta) = e.path().symlink_metadata() else {
                continue;
            };
            if meta.is_dir() {
                stack.push(e.path());
            } else {
                files += 1;
                bytes += meta.len();
            }
        }
    }
    (files, bytes)
}

fn file_mode(meta: &std::fs::Metadata) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    if meta.permissions().mode() & 0o111 != 0 {
        MODE_EXEC
    } else {
        MODE_FILE
    }
}

/// Hashes of files by path and stat, from an earlier scan: a file whose stat is the same is
/// not read again. A stat taken in the last clock tick before the cache was written is not
/// trusted (the file may have changed within that tick), as git treats a racily clean
/// index entry.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct StatCache {
    entries: HashMap<WsPath, (Stat, FileEntry)>,
    /// The ctime of a file written after every stat was taken (see [`StatCache::save`]).
    fence: Option<(i64, i64)>,
}

impl StatCache {
    /// The cache at `path`; empty when missing or unreadable (it is only a shortcut).
    pub fn load(path: &Path) -> Self {
        std::fs::read(path)
            .ok()
            .and_then(|b| rmp_serde::from_slice(&b).ok())
            .unwrap_or_default()
    }

    /// Write the cache (entries for `manifest`'s files as `listing` saw them) to `path`,
    /// through a temporary file renamed over it. The fence is the ctime of that file.
    pub fn save(path: &Path, listing: &Listing, manifest: &Manifest) -> std::io::Result<()> {
        use std::os::unix::fs::MetadataExt;
        let mut entries = HashMap::with_capacity(listing.files.len());
        for f in &listing.files {
            if let Some(e) = manifest.files.get(&f.path) {
                entries.insert(f.path.clone(), (f.stat, *e));
            }
        }
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)?;
        }
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, b"")?;
        let fence = std::fs::metadata(&tmp).map(|m| (m.ctime(), m.ctime_nsec()))?;
        let cache = StatCache {
            entries,
            fence: Some(fence),
        };
        let bytes = rmp_serde::to_vec(&cache).map_err(std::io::Error::other)?;
        std::fs::write(&tmp, bytes)?;
        std::fs::rename(&tmp, path)
    }

    /// The entry of `f` when its stat is as cached and older than the fence.
    fn get(&self, f: &Listed) -> Option<FileEntry> {
        let fence = self.fence?;
        let (stat, entry) = self.entries.get(&f.path)?;
        (*stat == f.stat && stat.ctime < fence).then_some(*entry)
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// What [`hash`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Hashed {
    /// Files read and hashed.
    pub read: usize,
    pub bytes_read: u64,
    /// Files served by the stat cache.
    pub cached: usize,
}

/// What one hashing thread did: entries by index in the listing.
type ThreadHashed = (Vec<(usize, FileEntry)>, Hashed);

/// The manifest of a listing: every file's entry, read in chunks and hashed on `threads`
/// threads (the stat cache's entry where the stat is unchanged). A file that cannot be read
/// is an error naming it. Blocking.
pub fn hash(
    listing: &Listing,
    cache: &StatCache,
    threads: usize,
) -> Result<(Manifest, Hashed), ScanError> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let next = AtomicUsize::new(0);
    let threads = threads.clamp(1, 64);
    let results: Vec<Result<ThreadHashed, ScanError>> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| {
                    let mut mine = Vec::new();
                    let mut done = Hashed::default();
                    let mut buf = vec![0u8; CHUNK];
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(f) = listing.files.get(i) else {
                            break;
                        };
                        let entry = if let Some(link) = &f.link {
                            FileEntry::for_bytes(link.as_bytes(), MODE_SYMLINK)
                        } else if let Some(e) = cache.get(f) {
                            done.cached += 1;
                            e
                        } else {
                            let e = hash_file(&f.full, f.stat.mode, &mut buf)?;
                            done.read += 1;
                            done.bytes_read += e.size;
                            e
                        };
                        mine.push((i, entry));
                    }
                    Ok((mine, done))
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| {
                w.join().unwrap_or_else(|_| {
                    Err(ScanError::Io {
                        path: PathBuf::new(),
                        source: std::io::Error::other("a hashing thread panicked"),
                    })
                })
            })
            .collect()
    });
    let mut entries: Vec<Option<FileEntry>> = vec![None; listing.files.len()];
    let mut total = Hashed::default();
    for r in results {
        let (mine, done) = r?;
        total.read += done.read;
        total.bytes_read += done.bytes_read;
        total.cached += done.cached;
        for (i, e) in mine {
            entries[i] = Some(e);
        }
    }
    let mut manifest = Manifest::default();
    for d in &listing.dirs {
        manifest.dirs.insert(d.clone());
    }
    for (f, e) in listing.files.iter().zip(entries) {
        if let Some(e) = e {
            manifest.insert_file(f.path.clone(), e);
        }
    }
    Ok((manifest, total))
}

/// A file's entry, read in chunks of `buf`'s size.
fn hash_file(full: &Path, mode: u32, buf: &mut [u8]) -> Result<FileEntry, ScanError> {
    use sha2::{Digest, Sha256};
    let io = |source| ScanError::Io {
        path: full.to_path_buf(),
        source,
    };
    let mut file = std::fs::File::open(full).map_err(io)?;
    let mut hasher = Sha256::new();
    let (mut size, mut binary) = (0u64, false);
    loop {
        let n = file.read(buf).map_err(io)?;
        if n == 0 {
            break;
        }
        if size < 8192 {
            binary |= crate::blob::is_binary(&buf[..n.min((8192 - size) as usize)]);
        }
        hasher.update(&buf[..n]);
        size += n as u64;
    }
    Ok(FileEntry {
        hash: BlobHash::from_digest(hasher.finalize().into()),
        size,
        mode,
        binary,
    })
}

/// The bytes of a listed file as they are now, checked against `entry`: a file changed
/// since it was hashed is an error naming it (the snapshot would not be what was listed).
pub fn read_checked(f: &Listed, entry: &FileEntry) -> Result<Vec<u8>, ScanError> {
    let bytes = match &f.link {
        Some(target) => target.clone().into_bytes(),
        None => std::fs::read(&f.full).map_err(|source| ScanError::Io {
            path: f.full.clone(),
            source,
        })?,
    };
    if BlobHash::of(&bytes) != entry.hash {
        return Err(ScanError::Changed {
            path: f.full.clone(),
        });
    }
    Ok(bytes)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::manifest::scan_dir;

    fn write(root: &Path, rel: &str, text: &str) {
        let p = root.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    }

    fn paths(l: &Listing) -> Vec<String> {
        let mut v: Vec<String> = l.files.iter().map(|f| f.path.to_string()).collect();
        v.sort();
        v
    }

    #[test]
    fn ignore_files_are_read_as_git_reads_them() {
        let tmp = tempfile::tempdir().unwrap();
        let r = tmp.path();
        write(r, ".gitignore", "*.log\n!keep.log\nbuild/\n/only-top.txt\n");
        write(r, "a.log", "x");
        write(r, "keep.log", "k");
        write(r, "only-top.txt", "t");
        write(r, "sub/only-top.txt", "not at the top: kept");
        write(r, "build/out.o", "o");
        // Nothing below an ignored directory comes back, whatever it says.
        write(r, "build/.gitignore", "!out.o\n");
        // A deeper file wins over its parents'; in one directory `.ignore` over `.gitignore`.
        write(r, "sub/.gitignore", "!b.log\nsecret.txt\n");
        write(r, "sub/b.log", "b");
        write(r, "sub/secret.txt", "s");
        write(r, "sub/.ignore", "!secret.txt\n");
        write(r, "sub/x/.forkfleetignore", "*.tmp\n");
        write(r, "sub/x/y.tmp", "tmp");
        write(r, "sub/x/y.txt", "txt");
        write(r, "z.tmp", "not below the .forkfleetignore: kept");
        write(r, ".git/info/exclude", "local-only.txt\n");
        write(r, ".git/HEAD", "ref");
        write(r, "local-only.txt", "l");
        let opts = ScanOptions::snapshot(&[".git".to_string()], true);
        let l = list(r, &opts).unwrap();
        assert_eq!(
            paths(&l),
            [
                ".gitignore",
                "keep.log",
                "sub/.gitignore",
                "sub/.ignore",
                "sub/b.log",
                "sub/only-top.txt",
                "sub/secret.txt",
                "sub/x/.forkfleetignore",
                "sub/x/y.txt",
                "z.tmp",
            ]
        );
        // a.log, only-top.txt, build/ (2 files), y.tmp, local-only.txt.
        assert_eq!(l.left_out.ignored_files, 6);
        assert_eq!(l.left_out.ignored_bytes, 1 + 1 + 1 + 7 + 3 + 1);
        assert_eq!(l.left_out.excluded_files, 2, ".git's two files");
        let build = l
            .left_out
            .largest
            .iter()
            .find(|p| p.path == "build/")
            .unwrap();
        assert_eq!((build.files, build.why), (2, LeftOutWhy::IgnoreFile));
        assert_eq!(build.rule.as_deref(), Some(".gitignore: build/"));
        let git = l
            .left_out
            .largest
            .iter()
            .find(|p| p.path == ".git/")
            .unwrap();
        assert_eq!(git.rule.as_deref(), Some("exclude: .git"));

        // Off: only `.forkfleetignore` and `exclude`.
        let off = list(r, &ScanOptions::snapshot(&[".git".to_string()], false)).unwrap();
        let got = paths(&off);
        assert!(got.contains(&"a.log".to_string()) && got.contains(&"build/out.o".to_string()));
        assert!(!got.contains(&"sub/x/y.tmp".to_string()));
        assert_eq!(off.left_out.ignored_files, 1);
    }

    #[test]
    fn hashing_in_chunks_on_threads_gives_the_in_memory_manifest() {
        let tmp = tempfile::tempdir().unwrap();
        let r = tmp.path();
        for i in 0..40 {
            write(r, &format!("d{}/f{i}.txt", i % 4), &"x".repeat(i * 1000));
        }
        // Over a chunk, with a zero byte past the first 8 KiB: text, as `is_binary` says.
        let mut big = vec![b'a'; CHUNK * 2 + 17];
        big[9000] = 0;
        std::fs::write(r.join("big.bin"), &big).unwrap();
        std::fs::write(r.join("bin.dat"), [0u8, 1, 2]).unwrap();
        std::os::unix::fs::symlink("d0/f0.txt", r.join("link")).unwrap();
        std::fs::create_dir_all(r.join("empty")).unwrap();
        let l = list(r, &ScanOptions::names_only(&[])).unwrap();
        for threads in [1, 3] {
            let (m, done) = hash(&l, &StatCache::default(), threads).unwrap();
            assert_eq!(m, scan_dir(r, &[]).unwrap().manifest);
            assert_eq!(done.read, 42, "the symlink is not read");
            assert_eq!(done.cached, 0);
        }
    }

    #[test]
    fn an_unchanged_workspace_is_served_by_the_stat_cache() {
        let tmp = tempfile::tempdir().unwrap();
        let (r, cache_file) = (tmp.path().join("ws"), tmp.path().join("cache"));
        for i in 0..20 {
            write(&r, &format!("f{i}.txt"), &format!("file {i}\n"));
        }
        let opts = ScanOptions::names_only(&[]);
        let l = list(&r, &opts).unwrap();
        let (m, _) = hash(&l, &StatCache::default(), 2).unwrap();
        // Saved until the fence is past every file's ctime (a stat taken in the fence's own
        // clock tick is not trusted): bounded, each try writes the cache again.
        let newest = l.files.iter().map(|f| f.stat.ctime).max().unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let cache = loop {
            StatCache::save(&cache_file, &l, &m).unwrap();
            let cache = StatCache::load(&cache_file);
            if cache.fence.is_some_and(|f| f > newest) {
                break cache;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the clock did not move"
            );
        };
        assert_eq!(cache.len(), 20);
        let (again, done) = hash(&list(&r, &opts).unwrap(), &cache, 2).unwrap();
        assert_eq!(again, m);
        assert_eq!((done.read, done.cached), (0, 20), "no file read");

        // A file rewritten with as many bytes and its mtime set back: its ctime moved.
        let f = r.join("f3.txt");
        let mtime = std::fs::metadata(&f).unwrap().modified().unwrap();
        std::fs::write(&f, "FILE 3\n").unwrap();
        std::fs::File::options()
            .write(true)
            .open(&f)
            .unwrap()
            .set_modified(mtime)
            .unwrap();
        let (changed, done) = hash(&list(&r, &opts).unwrap(), &cache, 2).unwrap();
        assert_eq!(done.read, 1);
        assert_ne!(changed, m);
        assert_eq!(changed, scan_dir(&r, &[]).unwrap().manifest);
        // A missing or corrupt cache is only a miss.
        std::fs::write(&cache_file, b"not a cache").unwrap();
        assert!(StatCache::load(&cache_file).is_empty());
    }
}
