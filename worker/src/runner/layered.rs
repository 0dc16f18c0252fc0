//! Layered command trees: one base tree per fork on a worker, and for each branch an
//! overlayfs upper directory holding only what differs from it (ADR 25).
//!
//! - The **base** is the fork's snapshot, materialised once per worker ([`Base`]) and
//!   never written again: every branch of the fork that runs a command here shares it.
//! - A branch's tree is the base with its **upper** directory on top: the files it wrote,
//!   whiteouts (a character device 0/0) where it removed something of the base, and opaque
//!   directories (`user.overlay.opaque`) where it replaced a directory of the base whole.
//!   The worker writes the upper directory itself to bring the tree up to date between
//!   calls ([`super::Workdir::update`]); nothing is mounted then.
//! - A command runs in a **mount** of the two: between its start and exec the child enters a
//!   user and mount namespace of its own, mounts `overlay` (`userxattr`, as an unprivileged
//!   user may) on the tree's directory and changes into it ([`Mount::apply`]). The mount
//!   lives as long as that namespace: when the command's processes are gone, so is the
//!   mount; the worker's view never changes. The mount is `volatile`: its going does not
//!   sync the disk (the tree is scratch; [`reset_work`] clears the marker that leaves).
//! - Afterwards only the upper directory is walked: it is exactly what differs from the
//!   base, so a call on a tree of 14,000 files stats the handful the branch changed.
//!
//! Used where the kernel allows it ([`supported`]: a probe at first use makes a user
//! namespace, mounts an overlay and makes a whiteout, as a command would);
//! `FORKFLEET_LAYERED_TREES=off` turns it off. Elsewhere a branch keeps a whole tree of
//! its own (`super::trees`), as before.

use super::materialize::{materialize, Make, Materialized};
use crate::cache::BlobCache;
use crate::error::WorkerError;
use forkfleet_shared::manifest::{Manifest, Node};
use forkfleet_shared::path::WsPath;
use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

/// Set to `off` to never layer trees (every branch then keeps a whole tree).
pub const LAYERED_ENV: &str = "FORKFLEET_LAYERED_TREES";

/// The extended attribute overlayfs reads (with `userxattr`) to hide a lower directory's
/// entries under an upper one.
const OPAQUE_XATTR: &std::ffi::CStr = c"user.overlay.opaque";

/// A fork's snapshot, materialised once on this worker, shared by its branches' trees.
/// Removed (off the runtime) when the last tree using it is gone.
#[derive(Debug)]
pub struct Base {
    /// The directory holding the base (`ws/` below it is the tree).
    root: PathBuf,
    pub(super) tree: Arc<Manifest>,
    /// Symlinks of the tree leaving it, not in the directory.
    pub(super) skipped: Vec<WsPath>,
    bytes: u64,
    /// Of `bytes`, those hard-linked from the blob store ([`Make::LinkFromStore`]).
    linked_bytes: u64,
    /// Kept in the blob store's directory of kept trees ([`Base::open_or_make_kept`]):
    /// never removed when dropped.
    kept: bool,
}

/// What a kept base records of itself beside its tree (`made`), written before it is
/// renamed into place.
#[derive(serde::Serialize, serde::Deserialize)]
struct Made {
    bytes: u64,
    linked_bytes: u64,
    skipped: Vec<WsPath>,
}

/// The file of a kept base recording [`Made`].
const MADE_FILE: &str = "made";
/// The prefix of a kept base's directory while it is made.
const MAKING_PREFIX: &str = ".making-";
/// Kept bases a store's directory holds at most: beyond, the least recently used ones that
/// no tree of this process uses are removed.
pub const KEPT_BASES: usize = 4;

/// The kept bases this process uses (their directories), with how many [`Base`]s hold
/// each: never removed while held.
fn kept_in_use() -> &'static std::sync::Mutex<std::collections::HashMap<PathBuf, usize>> {
    static IN_USE: OnceLock<std::sync::Mutex<std::collections::HashMap<PathBuf, usize>>> =
        OnceLock::new();
    IN_USE.get_or_init(Default::default)
}

/// Directories of kept bases this process swept of what an earlier process left half
/// made (once per directory, before this process makes any there).
fn swept() -> &'static std::sync::Mutex<std::collections::HashSet<PathBuf>> {
    static SWEPT: OnceLock<std::sync::Mutex<std::collections::HashSet<PathBuf>>> = OnceLock::new();
    SWEPT.get_or_init(Default::default)
}

impl Base {
    /// Materialise `tree` in a new directory under `parent`, its files made as `make` says.
    pub async fn create(
        parent: &Path,
        tree: Arc<Manifest>,
        blobs: &BlobCache,
        make: Make,
    ) -> Result<Self, WorkerError> {
        let root = tempfile::Builder::new()
            .prefix("base-")
            .tempdir_in(parent)
            .map_err(WorkerError::TempDir)?
            .keep();
        Self::create_at(root, tree, blobs, make).await
    }

    /// Materialise `tree` in `root` (a new empty directory), removed if that fails.
    async fn create_at(
        root: PathBuf,
        tree: Arc<Manifest>,
        blobs: &BlobCache,
        make: Make,
    ) -> Result<Self, WorkerError> {
        let made = async {
            tokio::fs::create_dir(root.join("ws"))
                .await
                .map_err(WorkerError::TempDir)?;
            materialize(&tree, blobs, &root.join("ws"), make).await
        }
        .await;
        match made {
            Ok(Materialized {
                skipped,
                bytes,
                linked_bytes,
                ..
            }) => Ok(Self {
                root,
                tree,
                skipped,
                bytes,
                linked_bytes,
                kept: false,
            }),
            Err(e) => {
                super::off_runtime(move || super::remove_now(&root));
                Err(e)
            }
        }
    }

    /// The base of `tree` (its manifest's blob hash in hex: `name`) kept in `dir`, the
    /// blob store's directory of kept trees, from one run of a process to the next (ADR
    /// 32): the one there already, else one linked from the store's files
    /// ([`Make::LinkFromStore`]), made under another name and renamed into place once
    /// whole. Making one removes the least recently used beyond [`KEPT_BASES`] that this
    /// process does not use. Only for commands confined to their mounts, as every linked
    /// base.
    pub async fn open_or_make_kept(
        dir: &Path,
        name: &str,
        tree: Arc<Manifest>,
        blobs: &BlobCache,
    ) -> Result<Self, WorkerError> {
        let at = dir.join(name);
        if let Some(base) = Self::open_kept(&at, &tree).await {
            return Ok(base);
        }
        let sweep_dir = dir.to_path_buf();
        tokio::task::spawn_blocking(move || sweep_once(&sweep_dir))
            .await
            .map_err(|e| {
                WorkerError::TempDir(std::io::Error::other(format!(
                    "sweeping kept trees stopped: {e}"
                )))
            })?
            .map_err(WorkerError::TempDir)?;
        let making = tempfile::Builder::new()
            .prefix(MAKING_PREFIX)
            .tempdir_in(dir)
            .map_err(WorkerError::TempDir)?
            .keep();
        let mut base =
            Self::create_at(making.clone(), tree.clone(), blobs, Make::LinkFromStore).await?;
        let made = Made {
            bytes: base.bytes,
            linked_bytes: base.linked_bytes,
            skipped: base.skipped.clone(),
        };
        let into = at.clone();
        let placed = tokio::task::spawn_blocking(move || -> std::io::Result<()> {
            let record = serde_json::to_vec(&made).map_err(std::io::Error::other)?;
            std::fs::write(making.join(MADE_FILE), record)?;
            std::fs::rename(&making, &into)
        })
        .await
        .map_err(|e| {
            WorkerError::TempDir(std::io::Error::other(format!(
                "keeping a base stopped: {e}"
            )))
        })?;
        match placed {
            Ok(()) => {
                hold_count(&at, 1);
                base.root = at;
                base.kept = true;
                let (dir, keep) = (dir.to_path_buf(), base.root.clone());
                // Chosen and renamed away now; removed off the runtime.
                let _ = tokio::task::spawn_blocking(move || evict_kept(&dir, &keep)).await;
                Ok(base)
            }
            // Another tree of this process placed the same base meanwhile: that one is
            // used, this one removed as it drops.
            Err(_) => match Self::open_kept(&at, &tree).await {
                Some(kept) => Ok(kept),
                None => Ok(base),
            },
        }
    }

    /// The kept base at `at`, when it is there whole; marked used now (held before it is
    /// read, so no eviction takes it meanwhile).
    async fn open_kept(at: &Path, tree: &Arc<Manifest>) -> Option<Self> {
        hold_count(at, 1);
        let dir = at.to_path_buf();
        let made = tokio::task::spawn_blocking(move || {
            let made: Made =
                serde_json::from_slice(&std::fs::read(dir.join(MADE_FILE)).ok()?).ok()?;
            // Its time is its last use, for eviction.
            let now = std::fs::FileTimes::new().set_modified(std::time::SystemTime::now());
            let _ = std::fs::File::open(&dir).and_then(|f| f.set_times(now));
            Some(made)
        })
        .await
        .ok()
        .flatten();
        let Some(made) = made else {
            hold_count(at, -1);
            return None;
        };
        Some(Self {
            root: at.to_path_buf(),
            tree: tree.clone(),
            skipped: made.skipped,
            bytes: made.bytes,
            linked_bytes: made.linked_bytes,
            kept: true,
        })
    }

    /// The tree's directory (the lower layer of every branch's mount).
    pub(super) fn dir(&self) -> PathBuf {
        self.root.join("ws")
    }

    /// Forget the directory without removing it (it goes with a directory above it).
    pub(super) fn disown(mut self) {
        self.root = PathBuf::new();
    }

    /// The bytes of its files.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The bytes of its files hard-linked from the blob store (taking no disk of their own).
    pub fn linked_bytes(&self) -> u64 {
        self.linked_bytes
    }

    /// True when some of its files are the blob store's own (only for confined commands).
    pub fn linked(&self) -> bool {
        self.linked_bytes > 0
    }

    /// True when it is kept from one run of a process to the next
    /// ([`Base::open_or_make_kept`]).
    pub fn is_kept(&self) -> bool {
        self.kept
    }
}

impl Drop for Base {
    fn drop(&mut self) {
        if self.kept {
            hold_count(&self.root, -1);
            return;
        }
        let root = std::mem::take(&mut self.root);
        if !root.as_os_str().is_empty() {
            super::off_runtime(move || super::remove_now(&root));
        }
    }
}

/// Count one more (`by` 1) or one fewer (-1) [`Base`] of this process holding the kept
/// base at `root`.
fn hold_count(root: &Path, by: isize) {
    if let Ok(mut in_use) = kept_in_use().lock() {
        let n = in_use.entry(root.to_path_buf()).or_insert(0);
        *n = n.saturating_add_signed(by);
        if *n == 0 {
            in_use.remove(root);
        }
    }
}

/// Remove what an earlier process left half made in `dir` (a directory of kept bases),
/// once per process, before this process makes one there (so never one of its own).
fn sweep_once(dir: &Path) -> std::io::Result<()> {
    let Ok(mut swept) = swept().lock() else {
        return Ok(());
    };
    if swept.contains(dir) {
        return Ok(());
    }
    std::fs::create_dir_all(dir)?;
    for e in std::fs::read_dir(dir)?.flatten() {
        if e.file_name().to_string_lossy().starts_with(MAKING_PREFIX) {
            super::remove_now(&e.path());
        }
    }
    swept.insert(dir.to_path_buf());
    Ok(())
}

/// Take the least recently used kept bases in `dir` beyond [`KEPT_BASES`] away, never `keep`
/// (just made) nor one this process uses: each renamed (a making name, which a later
/// process's sweep removes should this one end first), then removed off the runtime.
fn evict_kept(dir: &Path, keep: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let mut bases: Vec<(std::time::SystemTime, PathBuf)> = entries
        .flatten()
        .filter(|e| !e.file_name().to_string_lossy().starts_with(MAKING_PREFIX))
        .filter_map(|e| Some((e.metadata().ok()?.modified().ok()?, e.path())))
        .collect();
    if bases.len() <= KEPT_BASES {
        return;
    }
    bases.sort();
    let mut over = bases.len() - KEPT_BASES;
    for (_, path) in bases {
        if over == 0 {
            break;
        }
        if path == keep {
            continue;
        }
        // Renamed away while no base of this process can take it up, removed after.
        static EVICTED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = EVICTED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let away = dir.join(format!("{MAKING_PREFIX}evicted-{}-{n}", std::process::id()));
        let moved = match kept_in_use().lock() {
            Ok(in_use) if !in_use.contains_key(&path) => std::fs::rename(&path, &away).is_ok(),
            _ => false,
        };
        if moved {
            tracing::debug!(dir = %path.display(), "command trees: a kept base evicted");
            super::off_runtime(move || super::remove_now(&away));
            over -= 1;
        }
    }
}

/// True when trees are layered on this worker: overlays work here ([`overlay_works`]) and
/// a command started in one under the sandbox ran (`super::setup`).
pub fn supported() -> bool {
    super::setup::setup().layered
}

/// `Ok` when trees can be layered here: not turned off with [`LAYERED_ENV`], and a probe
/// made a user and mount namespace, mounted an overlay with `userxattr` in it and a
/// `tmpfs` over its base, and made a whiteout and an opaque directory as this user. `Err`:
/// why not.
pub(super) fn overlay_works() -> Result<(), String> {
    if std::env::var(LAYERED_ENV).is_ok_and(|v| v.eq_ignore_ascii_case("off")) {
        return Err(format!("turned off ({LAYERED_ENV}=off)"));
    }
    probe()
}

/// Try what a layered tree needs, in a scratch directory.
fn probe() -> Result<(), String> {
    let scratch = tempfile::Builder::new()
        .prefix("forkfleet-overlay-probe-")
        .tempdir()
        .map_err(|e| format!("no temporary directory: {e}"))?;
    let dirs = Dirs::new(scratch.path());
    for d in [&dirs.lower, &dirs.upper, &dirs.work, &dirs.merged] {
        std::fs::create_dir(d).map_err(|e| e.to_string())?;
    }
    std::fs::write(dirs.lower.join("gone"), b"").map_err(|e| e.to_string())?;
    std::fs::create_dir(dirs.lower.join("dir")).map_err(|e| e.to_string())?;
    std::fs::write(dirs.lower.join("dir/hidden"), b"").map_err(|e| e.to_string())?;
    whiteout(&dirs.upper.join("gone")).map_err(|e| format!("cannot make a whiteout: {e}"))?;
    std::fs::create_dir(dirs.upper.join("dir")).map_err(|e| e.to_string())?;
    set_opaque(&dirs.upper.join("dir"))
        .map_err(|e| format!("cannot set an overlay attribute: {e}"))?;
    let mount = Mount::new(&dirs, &dirs.merged)?;
    // Mounted in a child, as for a command; the child checks what the mount shows.
    let gone = path_c(&dirs.merged.join("gone"))?;
    let hidden = path_c(&dirs.merged.join("dir/hidden"))?;
    let in_lower = path_c(&dirs.lower.join("gone"))?;
    // SAFETY: the child makes only async-signal-safe system calls on memory made before the
    // fork, then `_exit`s; the parent waits for it.
    unsafe {
        let pid = libc::fork();
        if pid < 0 {
            return Err(format!("fork: {}", std::io::Error::last_os_error()));
        }
        if pid == 0 {
            let mut st: libc::stat = std::mem::zeroed();
            let code = if mount.apply().is_err() {
                1
            } else if libc::lstat(gone.as_ptr(), &mut st) == 0
                || libc::lstat(hidden.as_ptr(), &mut st) == 0
            {
                2
            } else if libc::lstat(in_lower.as_ptr(), &mut st) == 0 {
                3
            } else {
                0
            };
            libc::_exit(code);
        }
        let mut status = 0;
        if libc::waitpid(pid, &mut status, 0) != pid {
            return Err(format!("waitpid: {}", std::io::Error::last_os_error()));
        }
        match (libc::WIFEXITED(status), libc::WEXITSTATUS(status)) {
            (true, 0) => Ok(()),
            (true, 1) => Err(
                "cannot mount an overlay (and a tmpfs over its base) in a user namespace".into(),
            ),
            (true, 3) => Err("the base is not hidden under the overlay".into()),
            (true, _) => Err("the overlay does not hide whiteouts and opaque directories".into()),
            _ => Err("the probe was killed".into()),
        }
    }
}

/// The directories of one branch's mount.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dirs {
    /// The base (read only).
    pub lower: PathBuf,
    /// What the branch changed.
    pub upper: PathBuf,
    /// overlayfs's own scratch directory, beside `upper`.
    pub work: PathBuf,
    /// Where the command sees the tree.
    pub merged: PathBuf,
}

impl Dirs {
    /// `lower`, `upper`, `work` and `ws` (merged) under `root`.
    fn new(root: &Path) -> Self {
        Self {
            lower: root.join("lower"),
            upper: root.join("upper"),
            work: root.join("work"),
            merged: root.join("ws"),
        }
    }
}

/// True when overlayfs can take `dir` (and what is below it) in its mount options: no
/// `,`, `:` or `\` in its absolute path.
pub fn mountable(dir: &Path) -> bool {
    std::path::absolute(dir)
        .ok()
        .and_then(|d| d.to_str().map(|s| !s.contains([',', ':', '\\'])))
        .unwrap_or(false)
}

/// What a command's child does between its start and exec to see its tree: everything it
/// needs made before the child starts (C strings, the ID maps), so that [`Mount::apply`]
/// only makes system calls.
#[derive(Debug)]
pub struct Mount {
    merged: CString,
    lower: CString,
    options: CString,
    cwd: CString,
    uid_map: Vec<u8>,
    gid_map: Vec<u8>,
}

impl Mount {
    /// The mount of `dirs`, the command to start in `cwd` (inside `dirs.merged`). `Err`:
    /// a path overlayfs cannot take in its options (a `,`, `:` or `\`), or with a NUL.
    pub fn new(dirs: &Dirs, cwd: &Path) -> Result<Self, String> {
        // Every path absolute: the child mounts after it has entered the tree's directory,
        // where a relative path (a store opened as `.forkfleet`) would name nothing.
        let abs = |p: &Path| {
            std::path::absolute(p)
                .map_err(|e| format!("`{}` cannot be made absolute: {e}", p.display()))
        };
        let dirs = &Dirs {
            lower: abs(&dirs.lower)?,
            upper: abs(&dirs.upper)?,
            work: abs(&dirs.work)?,
            merged: abs(&dirs.merged)?,
        };
        let cwd = &abs(cwd)?;
        let opt = |p: &Path| -> Result<String, String> {
            let s = p
                .to_str()
                .ok_or_else(|| format!("`{}` is not UTF-8", p.display()))?;
            if s.contains([',', ':', '\\']) {
                return Err(format!(
                    "`{s}` has a `,`, `:` or `\\` an overlay mount cannot take"
                ));
            }
            Ok(s.to_string())
        };
        let options = format!(
            "lowerdir={},upperdir={},workdir={},userxattr,volatile",
            opt(&dirs.lower)?,
            opt(&dirs.upper)?,
            opt(&dirs.work)?
        );
        // SAFETY: getuid and getgid cannot fail.
        let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
        Ok(Self {
            merged: path_c(&dirs.merged)?,
            lower: path_c(&dirs.lower)?,
            options: CString::new(options).map_err(|e| e.to_string())?,
            cwd: path_c(cwd)?,
            uid_map: format!("{uid} {uid} 1").into_bytes(),
            gid_map: format!("{gid} {gid} 1").into_bytes(),
        })
    }

    /// In the child, between its start and exec: a user and mount namespace of its own (the
    /// command keeps its user and group IDs), the mounts made private (nothing reaches the
    /// worker's namespace), the overlay mounted, the base hidden under an empty read-only
    /// `tmpfs` (the overlay keeps its own hold on it), the working directory entered again
    /// (it named the directory under the mount). Only async-signal-safe system calls.
    ///
    /// The base is hidden because Landlock, which keeps the command from writing outside
    /// its tree, does not govern `chmod`, `chown` or `utime`: by the base's own path (which
    /// `/proc/self/mountinfo` names) a command could otherwise change its siblings' view,
    /// and a file linked from the store (ADR 31). A confined command cannot unmount it
    /// (Landlock refuses mount changes to a confined process).
    pub fn apply(&self) -> std::io::Result<()> {
        let fail = || Err(std::io::Error::last_os_error());
        // SAFETY: plain system calls on C strings and buffers made before the fork.
        unsafe {
            if libc::unshare(libc::CLONE_NEWUSER | libc::CLONE_NEWNS) != 0 {
                return fail();
            }
            for (file, data) in [
                (c"/proc/self/setgroups", &b"deny"[..]),
                (c"/proc/self/uid_map", &self.uid_map[..]),
                (c"/proc/self/gid_map", &self.gid_map[..]),
            ] {
                let fd = libc::open(file.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                if fd < 0 {
                    return fail();
                }
                let wrote = libc::write(fd, data.as_ptr().cast(), data.len());
                libc::close(fd);
                if wrote < 0 {
                    return fail();
                }
            }
            if libc::mount(
                std::ptr::null(),
                c"/".as_ptr(),
                std::ptr::null(),
                libc::MS_REC | libc::MS_PRIVATE,
                std::ptr::null(),
            ) != 0
            {
                return fail();
            }
            if libc::mount(
                c"overlay".as_ptr(),
                self.merged.as_ptr(),
                c"overlay".as_ptr(),
                0,
                self.options.as_ptr().cast(),
            ) != 0
            {
                return fail();
            }
            if libc::mount(
                c"forkfleet-base".as_ptr(),
                self.lower.as_ptr(),
                c"tmpfs".as_ptr(),
                libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
                c"size=4k,mode=0".as_ptr().cast(),
            ) != 0
            {
                return fail();
            }
            if libc::chdir(self.cwd.as_ptr()) != 0 {
                return fail();
            }
        }
        Ok(())
    }

    /// The tree's directory, for a sandbox rule opened after the mount.
    pub fn merged(&self) -> &std::ffi::CStr {
        &self.merged
    }
}

fn path_c(p: &Path) -> Result<CString, String> {
    CString::new(p.as_os_str().as_bytes()).map_err(|_| format!("`{}` has a NUL byte", p.display()))
}

/// Empty overlayfs's work directory `work` before a mount. A `volatile` mount (which skips
/// syncing the upper directory's file system when it goes: a command's tree is scratch,
/// and a sync after every command would write out every tree being made on the worker)
/// leaves a marker there that refuses the next mount.
pub(super) fn reset_work(work: &Path) -> std::io::Result<()> {
    // overlayfs leaves its own directory there without permissions: opened up first, so
    // the removal is one pass.
    super::make_writable(work);
    match std::fs::remove_dir_all(work) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    std::fs::create_dir(work)
}

/// Make a whiteout at `path` (nothing there): a character device 0/0, which Linux lets any
/// user make (5.8 and later).
pub(super) fn whiteout(path: &Path) -> std::io::Result<()> {
    let c = path_c(path).map_err(std::io::Error::other)?;
    // SAFETY: a C string for the call's duration.
    if unsafe { libc::mknod(c.as_ptr(), libc::S_IFCHR | 0o600, 0) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// True when `meta` is a whiteout.
pub(super) fn is_whiteout(meta: &std::fs::Metadata) -> bool {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    meta.file_type().is_char_device() && meta.rdev() == 0
}

/// Mark the directory `path` opaque: the base's entries below it are hidden.
pub(super) fn set_opaque(path: &Path) -> std::io::Result<()> {
    let c = path_c(path).map_err(std::io::Error::other)?;
    // SAFETY: C strings and a one-byte buffer for the call's duration.
    let done = unsafe {
        libc::lsetxattr(
            c.as_ptr(),
            OPAQUE_XATTR.as_ptr(),
            b"y".as_ptr().cast(),
            1,
            0,
        )
    };
    if done != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// True when the directory `path` is opaque.
pub(super) fn is_opaque(path: &Path) -> bool {
    let Ok(c) = path_c(path) else {
        return false;
    };
    let mut value = [0u8; 4];
    // SAFETY: C strings and a buffer of the length given, for the call's duration.
    let n = unsafe {
        libc::lgetxattr(
            c.as_ptr(),
            OPAQUE_XATTR.as_ptr(),
            value.as_mut_ptr().cast(),
            value.len(),
        )
    };
    n == 1 && value[0] == b'y'
}

/// What the upper directory `upper` shows at `path` in the merged view, as far as hiding
/// the base goes: true when the base's node at `path` shows through (no ancestor in the
/// upper directory is a whiteout, a non-directory or an opaque directory).
pub(super) fn base_shows(upper: &Path, base: &Manifest, path: &WsPath) -> bool {
    if matches!(base.node(path), Node::Missing) {
        return false;
    }
    let mut at = path.parent();
    while let Some(a) = at {
        if a.is_root() {
            break;
        }
        let full = a.to_os_path(upper);
        match std::fs::symlink_metadata(&full) {
            Ok(m) if !m.is_dir() => return false,
            Ok(_) if is_opaque(&full) => return false,
            _ => {}
        }
        at = a.parent();
    }
    true
}
