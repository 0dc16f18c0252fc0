//! Running a command against a branch's tree: for the test command of a resolve (issue 5)
//! and for the agent's `run_command` tool (`crate::tools`), both through a [`Workdir`].
//!
//! - [`materialize`] writes a tree (a snapshot manifest, or a branch overlay's view of it) into
//!   a directory: every file from its blob, executable bits from the mode, empty
//!   directories; a symlink is recreated only when its target stays inside the tree.
//! - [`run_command`] runs an argv there, without a shell, in a process group of its own, with
//!   the environment cleared to [`base_env`] plus what the caller passes (no secret of the
//!   worker's leaks in by default), its output (stdout and stderr together, in arrival order)
//!   kept up to a limit (head and tail), and a timeout: on timeout or cancellation the whole
//!   process group is killed, and so are stragglers a command leaves behind.
//! - [`tree_changes`] compares a materialised directory, after a command ran in it, with the
//!   tree it was materialised from, as the change log between the two
//!   ([`changes_between`]), and says what cannot be taken back (a symlink leaving the tree,
//!   a file over the size limit, a fifo, an unreadable entry).
//! - [`Workdir`] puts the three together: a fresh temporary directory with the tree and
//!   scratch `HOME` and `TMPDIR` beside it, the command, the comparison, the removal.

use crate::cache::BlobCache;
use crate::error::WorkerError;
use bytes::Bytes;
use forkfleet_shared::blob::BlobHash;
use forkfleet_shared::flush::changes_between;
use forkfleet_shared::manifest::{FileEntry, Manifest, Node, MODE_EXEC, MODE_FILE, MODE_SYMLINK};
use forkfleet_shared::overlay::ChangeOp;
use forkfleet_shared::path::WsPath;
use futures::future::BoxFuture;
use futures::StreamExt;
use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};
use tokio::io::AsyncReadExt;

/// Files fetched and written at once.
const WRITES_IN_FLIGHT: usize = 32;
/// After the command's leader exits, how long its output pipes may stay open (held by a
/// child it left running) before the group is killed.
const DRAIN_AFTER_EXIT: Duration = Duration::from_millis(500);

/// What [`materialize`] wrote.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Materialized {
    /// Files and symlinks written.
    pub files: usize,
    pub bytes: u64,
    pub dirs: usize,
    /// Symlinks whose target would leave the tree: not created. In path order.
    pub skipped: Vec<WsPath>,
    /// How every regular file written looked right after (see [`Materialized::untouched`]).
    stamps: HashMap<WsPath, Stamp>,
    /// The latest ctime among the stamps.
    last_ctime: Option<(i64, i64)>,
}

impl Materialized {
    /// True when the file at `path`, as `meta` shows it now, is as [`materialize`] wrote it:
    /// same inode, size, mode, mtime and ctime. A command can set an mtime back, not a
    /// ctime (every write, chmod or utime moves it to the current time). A file stamped in
    /// the last clock tick of the writing may have been changed within that same tick
    /// without its ctime moving: it is not trusted (read again), as git treats a racily
    /// clean index entry.
    fn untouched(&self, path: &WsPath, meta: &std::fs::Metadata) -> bool {
        self.stamps
            .get(path)
            .is_some_and(|s| Some(s.ctime) != self.last_ctime && *s == Stamp::of(meta))
    }
}

/// What `stat` says of a file, to tell whether anything touched it since.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stamp {
    ino: u64,
    size: u64,
    mode: u32,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

impl Stamp {
    fn of(meta: &std::fs::Metadata) -> Self {
        use std::os::unix::fs::MetadataExt;
        Self {
            ino: meta.ino(),
            size: meta.size(),
            mode: meta.mode(),
            mtime: (meta.mtime(), meta.mtime_nsec()),
            ctime: (meta.ctime(), meta.ctime_nsec()),
        }
    }
}

/// Write `tree` into `dir` (which must exist and should be empty). Blobs come through the
/// worker's cache, which verified each one when it arrived. An error is a
/// [`WorkerError::WriteFile`] or a [`WorkerError::ReadBlob`].
pub async fn materialize(
    tree: &Manifest,
    blobs: &BlobCache,
    dir: &Path,
) -> Result<Materialized, WorkerError> {
    let mut done = Materialized::default();
    let dirs: Vec<WsPath> = tree.dirs.iter().cloned().collect();
    let root = dir.to_path_buf();
    let made = tokio::task::spawn_blocking(move || {
        for d in &dirs {
            std::fs::create_dir_all(d.to_os_path(&root)).map_err(|e| (d.to_string(), e))?;
        }
        Ok(dirs.len())
    })
    .await
    .unwrap_or_else(|e| Err((String::new(), std::io::Error::other(e))));
    done.dirs = made.map_err(|(path, source)| WorkerError::WriteFile {
        dir: dir.to_path_buf(),
        path,
        source,
    })?;
    // Boxed as `Send` futures here: an iterator of async blocks borrowing the tree would
    // otherwise make the whole call unusable from a spawned task (a higher-ranked `Send`).
    type Write<'a> = BoxFuture<'a, (&'a WsPath, Result<Wrote, WorkerError>)>;
    let writes: Vec<Write<'_>> = tree
        .files
        .iter()
        .map(|(path, entry)| -> Write<'_> {
            Box::pin(async move { (path, write_one(path, entry, blobs, dir).await) })
        })
        .collect();
    let mut written = futures::stream::iter(writes).buffer_unordered(WRITES_IN_FLIGHT);
    while let Some((path, wrote)) = written.next().await {
        match wrote? {
            Wrote::File { bytes, stamp } => {
                done.files += 1;
                done.bytes += bytes;
                done.stamps.insert(path.clone(), stamp);
            }
            Wrote::Symlink => done.files += 1,
            Wrote::Skipped => done.skipped.push(path.clone()),
        }
    }
    done.skipped.sort();
    done.last_ctime = done.stamps.values().map(|s| s.ctime).max();
    Ok(done)
}

/// What [`write_one`] did.
enum Wrote {
    File {
        bytes: u64,
        stamp: Stamp,
    },
    Symlink,
    /// A symlink leaving the tree, not created.
    Skipped,
}

/// Write one file (or symlink) of a tree.
async fn write_one(
    path: &WsPath,
    entry: &FileEntry,
    blobs: &BlobCache,
    dir: &Path,
) -> Result<Wrote, WorkerError> {
    let bytes = blobs
        .get(&entry.hash)
        .await
        .map_err(|source| WorkerError::ReadBlob {
            path: path.to_string(),
            source,
        })?;
    if entry.is_symlink() && !stays_inside(path, &String::from_utf8_lossy(&bytes)) {
        return Ok(Wrote::Skipped);
    }
    let target = path.to_os_path(dir);
    let entry = *entry;
    tokio::task::spawn_blocking(move || write_entry(&target, &bytes, &entry))
        .await
        .unwrap_or_else(|e| Err(std::io::Error::other(e)))
        .map_err(|source| WorkerError::WriteFile {
            dir: dir.to_path_buf(),
            path: path.to_string(),
            source,
        })
}

/// Write one file or symlink at `target` (blocking), and stamp a file as written. A
/// missing parent directory (a manifest that does not list it) is made.
fn write_entry(target: &Path, bytes: &[u8], entry: &FileEntry) -> std::io::Result<Wrote> {
    let write = || -> std::io::Result<Wrote> {
        if entry.is_symlink() {
            std::os::unix::fs::symlink(&*String::from_utf8_lossy(bytes), target)?;
            return Ok(Wrote::Symlink);
        }
        let mut file = std::fs::File::create(target)?;
        std::io::Write::write_all(&mut file, bytes)?;
        if entry.mode & 0o111 != 0 {
            use std::os::unix::fs::PermissionsExt;
            file.set_permissions(std::fs::Permissions::from_mode(entry.mode & 0o777))?;
        }
        Ok(Wrote::File {
            bytes: bytes.len() as u64,
            stamp: Stamp::of(&file.metadata()?),
        })
    };
    match write() {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            if let Some(parent) = target.parent() {
                std::fs::create_dir_all(parent)?;
            }
            write()
        }
        other => other,
    }
}

/// True when a symlink at `at` pointing to `target` resolves (lexically) inside the tree.
/// An absolute target is outside (for the OS `/` is not the tree's root), and so is one
/// with a `\` ([`WsPath::parse_in`] reads it as a separator, the OS as part of a name, so
/// the two would count its `..` differently).
fn stays_inside(at: &WsPath, target: &str) -> bool {
    if target.starts_with('/') || target.contains('\\') {
        return false;
    }
    WsPath::parse_in(&at.parent().unwrap_or_default(), target).is_ok()
}

/// How a command ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CommandOutcome {
    Exited {
        code: i32,
    },
    /// Killed by a signal it did not ask for (not by us).
    Signalled {
        signal: i32,
    },
    /// It ran past the timeout; its process group was killed.
    TimedOut,
    /// The caller cancelled it; its process group was killed.
    Cancelled,
    /// It could not be started (no such program, not executable, ...).
    SpawnFailed {
        error: String,
    },
}

/// What to run.
#[derive(Debug, Clone, PartialEq)]
pub struct CommandSpec {
    /// The program and its arguments; no shell is involved.
    pub argv: Vec<String>,
    /// Set on top of [`base_env`].
    pub env: BTreeMap<String, String>,
    pub timeout: Duration,
    /// Output kept: the first and the last half of this many bytes.
    pub max_output_bytes: usize,
}

/// What a command did.
#[derive(Debug, Clone, PartialEq)]
pub struct CommandRun {
    pub outcome: CommandOutcome,
    /// stdout and stderr together, in arrival order; lossily UTF-8; when longer than the
    /// limit, the head, a marker line, and the tail.
    pub output: String,
    /// Output bytes left out of the middle.
    pub truncated_bytes: u64,
    pub duration: Duration,
}

/// The environment every command starts from: `PATH` (the worker's, so tools are found),
/// `HOME` and `TMPDIR` set to the command's directory, `LANG=C.UTF-8`. Nothing else of the
/// worker's environment (API keys, tokens) is passed.
pub fn base_env(dir: &Path) -> BTreeMap<String, String> {
    let mut env = BTreeMap::new();
    let path = std::env::var("PATH").unwrap_or_else(|_| "/usr/local/bin:/usr/bin:/bin".into());
    env.insert("PATH".to_string(), path);
    env.insert("HOME".to_string(), dir.display().to_string());
    env.insert("TMPDIR".to_string(), dir.display().to_string());
    env.insert("LANG".to_string(), "C.UTF-8".to_string());
    env
}

/// Output kept within a byte limit: the head, then a rolling tail.
struct Capped {
    limit: usize,
    head: Vec<u8>,
    tail: std::collections::VecDeque<u8>,
    dropped: u64,
}

impl Capped {
    fn new(limit: usize) -> Self {
        Self {
            limit,
            head: Vec::new(),
            tail: std::collections::VecDeque::new(),
            dropped: 0,
        }
    }

    fn push(&mut self, bytes: &[u8]) {
        let head_cap = self.limit / 2;
        let mut rest = bytes;
        if self.head.len() < head_cap {
            let take = rest.len().min(head_cap - self.head.len());
            self.head.extend_from_slice(&rest[..take]);
            rest = &rest[take..];
        }
        let tail_cap = self.limit - head_cap;
        self.tail.extend(rest.iter().copied());
        let over = self.tail.len().saturating_sub(tail_cap);
        if over > 0 {
            self.tail.drain(..over);
            self.dropped += over as u64;
        }
    }

    /// The text kept and the bytes left out. Nothing cut: the whole output. Cut: the head,
    /// a marker line saying how many bytes were left out, the tail; a character split by a
    /// cut is left out whole (and counted), so the text has no broken characters.
    fn finish(self) -> (String, u64) {
        let mut head = self.head;
        let mut tail: Vec<u8> = self.tail.into_iter().collect();
        if self.dropped == 0 {
            head.extend_from_slice(&tail);
            return (String::from_utf8_lossy(&head).into_owned(), 0);
        }
        let mut dropped = self.dropped;
        // A character cut at the end of the head: its first bytes go.
        let keep = utf8_complete_prefix(&head);
        dropped += (head.len() - keep) as u64;
        head.truncate(keep);
        // A character cut at the start of the tail: its last bytes go.
        let skip = tail
            .iter()
            .take(3)
            .take_while(|b| (**b & 0xC0) == 0x80)
            .count();
        dropped += skip as u64;
        tail.drain(..skip);
        let mut out = String::from_utf8_lossy(&head).into_owned();
        out.push_str(&format!("\n[... {dropped} bytes of output left out ...]\n"));
        out.push_str(&String::from_utf8_lossy(&tail));
        (out, dropped)
    }
}

/// The length of `bytes` without a UTF-8 sequence cut short at its end: the last lead byte
/// among the last three, when fewer bytes follow it than it announces, starts the cut.
/// Invalid bytes elsewhere are left alone (they show as U+FFFD).
fn utf8_complete_prefix(bytes: &[u8]) -> usize {
    let start = bytes.len().saturating_sub(3);
    let Some(i) = bytes[start..].iter().rposition(|b| (*b & 0xC0) != 0x80) else {
        return bytes.len();
    };
    let lead = start + i;
    let need = match bytes[lead] {
        b if b >= 0xF0 => 4,
        b if b >= 0xE0 => 3,
        b if b >= 0xC0 => 2,
        _ => 1,
    };
    if bytes.len() - lead < need {
        lead
    } else {
        bytes.len()
    }
}

/// Why the wait for a command ended.
enum End {
    Status(std::io::Result<std::process::ExitStatus>),
    TimedOut,
    Cancelled,
}

/// Kill the process group `pgid` (the command and everything it started).
fn kill_group(pgid: u32) {
    if let Ok(pid) = i32::try_from(pgid) {
        let _ = nix::sys::signal::killpg(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
}

/// Kills its process group when dropped while armed.
struct GroupGuard(Option<u32>);

impl Drop for GroupGuard {
    fn drop(&mut self) {
        if let Some(g) = self.0.take() {
            kill_group(g);
        }
    }
}

/// Run `spec` in `dir` until it exits, times out, or `cancel` completes. Dropping the
/// returned future kills the command's process group.
pub async fn run_command(
    dir: &Path,
    spec: &CommandSpec,
    cancel: impl Future<Output = ()>,
) -> CommandRun {
    let started = Instant::now();
    let done = |outcome, output: String, truncated_bytes| CommandRun {
        outcome,
        output,
        truncated_bytes,
        duration: started.elapsed(),
    };
    let Some((program, args)) = spec.argv.split_first() else {
        return done(
            CommandOutcome::SpawnFailed {
                error: "the command is empty".into(),
            },
            String::new(),
            0,
        );
    };
    let mut cmd = tokio::process::Command::new(program);
    cmd.args(args)
        .current_dir(dir)
        .env_clear()
        .envs(base_env(dir))
        .envs(&spec.env)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true);
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => {
            return done(
                CommandOutcome::SpawnFailed {
                    error: format!("cannot start `{program}`: {e}"),
                },
                String::new(),
                0,
            )
        }
    };
    let pgid = child.id();
    // Dropping this future (the caller gave up on it) kills the whole group, not only the
    // leader `kill_on_drop` would.
    let mut guard = GroupGuard(pgid);
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Vec<u8>>();
    for pipe in [
        child
            .stdout
            .take()
            .map(|p| Box::new(p) as Box<dyn tokio::io::AsyncRead + Unpin + Send>),
        child
            .stderr
            .take()
            .map(|p| Box::new(p) as Box<dyn tokio::io::AsyncRead + Unpin + Send>),
    ]
    .into_iter()
    .flatten()
    {
        let tx = tx.clone();
        tokio::spawn(async move {
            let mut pipe = pipe;
            let mut buf = vec![0u8; 8192];
            loop {
                match pipe.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        if tx.send(buf[..n].to_vec()).is_err() {
                            break;
                        }
                    }
                }
            }
        });
    }
    drop(tx);
    let mut output = Capped::new(spec.max_output_bytes.max(2));
    tokio::pin!(cancel);
    let deadline = tokio::time::sleep(spec.timeout);
    tokio::pin!(deadline);
    let mut open = true;
    let end = loop {
        tokio::select! {
            chunk = rx.recv(), if open => match chunk {
                Some(c) => output.push(&c),
                None => open = false,
            },
            status = child.wait() => break End::Status(status),
            _ = &mut deadline => break End::TimedOut,
            _ = &mut cancel => break End::Cancelled,
        }
    };
    if !matches!(end, End::Status(_)) {
        if let Some(g) = pgid {
            kill_group(g);
        }
    }
    // Whatever the leader did, nothing of the group outlives the command: the rest of the
    // output is read for a moment, then stragglers are killed.
    let drain = tokio::time::sleep(DRAIN_AFTER_EXIT);
    tokio::pin!(drain);
    while open {
        tokio::select! {
            chunk = rx.recv() => match chunk {
                Some(c) => output.push(&c),
                None => open = false,
            },
            _ = &mut drain => break,
        }
    }
    if let Some(g) = pgid {
        kill_group(g);
    }
    let _ = child.wait().await;
    guard.0 = None;
    let (text, dropped) = output.finish();
    let outcome = match end {
        End::Status(Ok(s)) => match (s.code(), std::os::unix::process::ExitStatusExt::signal(&s)) {
            (Some(code), _) => CommandOutcome::Exited { code },
            (None, Some(signal)) => CommandOutcome::Signalled { signal },
            (None, None) => CommandOutcome::Signalled { signal: 0 },
        },
        End::Status(Err(e)) => CommandOutcome::SpawnFailed {
            error: format!("cannot wait for `{program}`: {e}"),
        },
        End::TimedOut => CommandOutcome::TimedOut,
        End::Cancelled => CommandOutcome::Cancelled,
    };
    done(outcome, text, dropped)
}

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
}

/// Compare `dir`, where `tree` was materialised (`written`: the symlinks it skipped stay as
/// they are in the tree), with `tree`. A regular file is read and hashed unless it is
/// exactly as [`materialize`] left it (same inode, size, mode, mtime and ctime, not written
/// in its last clock tick); an executable bit
/// counts (a mode is `0o755` or `0o644` as in a snapshot, or the tree's own mode when only
/// the content changed). A symlink is taken back only when its target stays inside the
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
                    read_entry(&full, &meta, &path, old, written, max_file_bytes).map(Some)
                });
            match found {
                Ok(None) => {
                    after.dirs.insert(path.clone());
                    stack.push((full, path));
                }
                Ok(Some(found)) => {
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
    for p in &written.skipped {
        let dir_there = p
            .parent()
            .is_none_or(|d| d.is_root() || after.dirs.contains(&d));
        if dir_there && after.node(p) == Node::Missing {
            if let Some(e) = tree.files.get(p) {
                after.files.insert(p.clone(), *e);
            }
        }
    }
    out.ops = changes_between(tree, &after);
    out.not_imported.sort();
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

/// A tree materialised for one command, in a fresh temporary directory: `ws/` holds the
/// tree; `home/` and `tmp/` beside it are the command's `HOME` and `TMPDIR` (scratch: what
/// a command caches there is not part of the tree). The resolve's test job and the
/// `run_command` tool both run through it. The directory is removed off the async runtime:
/// by [`Workdir::changes`] or [`Workdir::remove`], or when it is dropped (a job or a tool
/// call given up).
pub struct Workdir {
    root: Scratch,
    tree: Manifest,
    written: Materialized,
}

impl Workdir {
    /// Materialise `tree` in a new temporary directory whose name starts with `prefix`.
    pub async fn create(
        prefix: &str,
        tree: Manifest,
        blobs: &BlobCache,
    ) -> Result<Self, WorkerError> {
        let root = tempfile::Builder::new()
            .prefix(prefix)
            .tempdir()
            .map_err(WorkerError::TempDir)?;
        let root = Scratch(root.keep());
        for d in ["ws", "home", "tmp"] {
            tokio::fs::create_dir(root.0.join(d))
                .await
                .map_err(WorkerError::TempDir)?;
        }
        let written = materialize(&tree, blobs, &root.0.join("ws")).await?;
        Ok(Self {
            root,
            tree,
            written,
        })
    }

    /// What was written.
    pub fn written(&self) -> &Materialized {
        &self.written
    }

    /// Run `spec` in the tree's directory `cwd` (see [`run_command`]), with `HOME` and
    /// `TMPDIR` the scratch directories unless `spec.env` sets them.
    pub async fn run(
        &self,
        cwd: &WsPath,
        spec: &CommandSpec,
        cancel: impl Future<Output = ()>,
    ) -> CommandRun {
        let mut env = BTreeMap::new();
        for (name, dir) in [("HOME", "home"), ("TMPDIR", "tmp")] {
            env.insert(
                name.to_string(),
                self.root.0.join(dir).display().to_string(),
            );
        }
        env.extend(spec.env.iter().map(|(k, v)| (k.clone(), v.clone())));
        let spec = CommandSpec {
            env,
            ..spec.clone()
        };
        run_command(&cwd.to_os_path(&self.root.0.join("ws")), &spec, cancel).await
    }

    /// What the command did to the tree ([`tree_changes`]); then the directory is removed.
    pub async fn changes(self, max_file_bytes: u64) -> TreeChanges {
        let Workdir {
            mut root,
            tree,
            written,
        } = self;
        let compared = tokio::task::spawn_blocking(move || {
            let started = Instant::now();
            let changes = tree_changes(&root.0.join("ws"), &tree, &written, max_file_bytes);
            let compare_ms = started.elapsed().as_millis() as u64;
            remove_now(&root.take());
            tracing::debug!(
                files = written.files,
                read = changes.read,
                compare_ms,
                remove_ms = started.elapsed().as_millis() as u64 - compare_ms,
                "tree compared and removed"
            );
            changes
        })
        .await;
        compared.unwrap_or_else(|e| TreeChanges {
            not_imported: vec![(
                ".".to_string(),
                format!("the workspace could not be compared after the command: {e}"),
            )],
            ..TreeChanges::default()
        })
    }

    /// Remove the directory.
    pub async fn remove(mut self) {
        let root = self.root.take();
        if let Err(e) = tokio::task::spawn_blocking(move || remove_now(&root)).await {
            tracing::warn!(error = %e, "cannot remove a command's directory");
        }
    }
}

/// A command's temporary directory, removed when dropped (off the async runtime when there
/// is one) unless taken.
struct Scratch(PathBuf);

impl Scratch {
    /// The path, now the caller's to remove.
    fn take(&mut self) -> PathBuf {
        std::mem::take(&mut self.0)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let path = self.take();
        if path.as_os_str().is_empty() {
            return;
        }
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => drop(rt.spawn_blocking(move || remove_now(&path))),
            Err(_) => remove_now(&path),
        }
    }
}

/// Remove a command's temporary directory (blocking). A command may have left directories
/// without write permission: they are made writable and it is tried again.
fn remove_now(path: &Path) {
    if std::fs::remove_dir_all(path).is_ok() {
        return;
    }
    make_writable(path);
    if let Err(e) = std::fs::remove_dir_all(path) {
        tracing::warn!(error = %e, dir = %path.display(), "cannot remove a command's directory");
    }
}

/// Give every directory below `dir` (and `dir`) owner rwx, not following symlinks.
fn make_writable(dir: &Path) {
    use std::os::unix::fs::PermissionsExt;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let _ = std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o700));
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                stack.push(e.path());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn symlinks_must_stay_inside() {
        let at = WsPath::parse("a/b/link").unwrap();
        assert!(stays_inside(&at, "c.txt"));
        assert!(stays_inside(&at, "../c.txt"));
        assert!(stays_inside(&at, "../../top.txt"));
        assert!(stays_inside(&at, "./../c/../d.txt"));
        assert!(!stays_inside(&at, "../../../out.txt"));
        assert!(
            !stays_inside(&at, "../../../a/b/c.txt"),
            "leaves, then comes back"
        );
        assert!(!stays_inside(&at, "/etc/passwd"));
        // For the OS `x\y` is one name: four `..` leave the tree.
        assert!(!stays_inside(&at, "x\\y/../../../../out.txt"));
        let top = WsPath::parse("link").unwrap();
        assert!(stays_inside(&top, "a.txt"));
        assert!(!stays_inside(&top, "../a.txt"));
    }

    #[test]
    fn capped_output_keeps_head_and_tail() {
        let mut c = Capped::new(10);
        c.push(b"0123456789");
        c.push(b"abcdefghij");
        let (text, dropped) = c.finish();
        assert_eq!(dropped, 10);
        assert!(text.starts_with("01234"), "{text}");
        assert!(text.ends_with("fghij"), "{text}");
        assert!(text.contains("10 bytes of output left out"));
    }

    fn capped(limit: usize, chunks: &[&[u8]]) -> (String, u64) {
        let mut c = Capped::new(limit);
        for chunk in chunks {
            c.push(chunk);
        }
        c.finish()
    }

    #[test]
    fn output_within_the_limit_is_kept_whole() {
        assert_eq!(capped(10, &[b"0123456789"]), ("0123456789".into(), 0));
        assert_eq!(
            capped(10, &[b"01", b"234", b"56789"]),
            ("0123456789".into(), 0)
        );
        assert_eq!(capped(10, &[]), (String::new(), 0));
        // A character across the head/tail boundary is not split when nothing is cut.
        let text = "abcé€xyz"; // 1+1+1+2+3+1+1+1 = 11 bytes
        assert_eq!(capped(12, &[text.as_bytes()]), (text.into(), 0));
        for split in 0..text.len() {
            let (a, b) = text.as_bytes().split_at(split);
            assert_eq!(capped(11, &[a, b]), (text.into(), 0), "split at {split}");
        }
    }

    #[test]
    fn long_output_is_cut_in_the_middle_with_the_count() {
        let input: Vec<u8> = (0..1000u32).map(|i| b'a' + (i % 26) as u8).collect();
        for chunk in [1usize, 7, 100, 1000] {
            let chunks: Vec<&[u8]> = input.chunks(chunk).collect();
            let (text, dropped) = capped(100, &chunks);
            assert_eq!(dropped, 900, "chunks of {chunk}");
            let (head, rest) = text
                .split_once("\n[... 900 bytes of output left out ...]\n")
                .unwrap();
            assert_eq!(head.as_bytes(), &input[..50]);
            assert_eq!(rest.as_bytes(), &input[950..]);
        }
    }

    #[test]
    fn a_cut_never_breaks_a_character() {
        // Every cut position through runs of 2-, 3- and 4-byte characters.
        for ch in ["é", "€", "😀"] {
            let input = ch.repeat(100);
            for limit in 2..40 {
                let (text, dropped) = capped(limit, &[input.as_bytes()]);
                assert!(!text.contains('\u{FFFD}'), "{ch} limit {limit}: {text}");
                let marker = format!("\n[... {dropped} bytes of output left out ...]\n");
                let (head, tail) = text.split_once(&marker).unwrap();
                assert!(head.chars().all(|c| c.to_string() == ch));
                assert!(tail.chars().all(|c| c.to_string() == ch));
                assert!(head.len() <= limit / 2 && tail.len() <= limit - limit / 2);
                assert_eq!(head.len() + tail.len() + dropped as usize, input.len());
            }
        }
    }

    #[test]
    fn utf8_prefixes() {
        assert_eq!(utf8_complete_prefix(b"abc"), 3);
        assert_eq!(utf8_complete_prefix("a€".as_bytes()), 4);
        assert_eq!(utf8_complete_prefix(&"a€".as_bytes()[..3]), 1);
        assert_eq!(utf8_complete_prefix(&"a😀".as_bytes()[..4]), 1);
        // Invalid bytes earlier on: only a cut character at the end is taken off.
        assert_eq!(utf8_complete_prefix(b"\xff\xfeab"), 4);
        assert_eq!(utf8_complete_prefix(b"\xffa\xe2\x82"), 2);
    }

    fn ws(p: &str) -> WsPath {
        WsPath::parse(p).unwrap()
    }

    /// `(kind, path)` of each op.
    fn summary(ch: &TreeChanges) -> Vec<(&'static str, &str)> {
        ch.ops
            .iter()
            .map(|op| (op.kind(), op.path().as_str()))
            .collect()
    }

    fn written_entry<'a>(ch: &'a TreeChanges, path: &str) -> &'a FileEntry {
        ch.ops
            .iter()
            .find(|op| op.path().as_str() == path)
            .and_then(ChangeOp::written)
            .unwrap()
    }

    #[test]
    fn tree_changes_finds_what_a_command_did() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        for (p, c) in [
            ("README.md", "draft\n"),
            ("same.txt", "same\n"),
            ("run.sh", "echo hi\n"),
            ("gone/a.txt", "a\n"),
            ("gone/deep/b.txt", "b\n"),
            ("was_file", "f\n"),
            ("was_dir/x.txt", "x\n"),
            ("old.txt", "old\n"),
            ("src/keep.rs", "k\n"),
        ] {
            std::fs::create_dir_all(d.join(p).parent().unwrap()).unwrap();
            std::fs::write(d.join(p), c).unwrap();
        }
        std::fs::create_dir_all(d.join("empty_before")).unwrap();
        std::os::unix::fs::symlink("README.md", d.join("link")).unwrap();
        let tree = forkfleet_shared::manifest::scan_dir(d, &[])
            .unwrap()
            .manifest;

        // What the command does.
        std::fs::write(d.join("README.md"), "final\n").unwrap();
        std::fs::set_permissions(d.join("run.sh"), std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::remove_dir_all(d.join("gone")).unwrap();
        std::fs::remove_file(d.join("was_file")).unwrap();
        std::fs::create_dir_all(d.join("was_file")).unwrap();
        std::fs::write(d.join("was_file/in.txt"), "in\n").unwrap();
        std::fs::remove_dir_all(d.join("was_dir")).unwrap();
        std::fs::write(d.join("was_dir"), "now a file\n").unwrap();
        std::fs::remove_file(d.join("old.txt")).unwrap();
        std::fs::write(d.join("new.bin"), [0u8, 1, 2, 255]).unwrap();
        std::fs::create_dir_all(d.join("made/empty")).unwrap();
        std::fs::remove_file(d.join("link")).unwrap();
        std::os::unix::fs::symlink("same.txt", d.join("link")).unwrap();
        std::os::unix::fs::symlink("src/keep.rs", d.join("inside")).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", d.join("escape")).unwrap();
        std::os::unix::fs::symlink("../../x", d.join("src/escape2")).unwrap();
        std::fs::write(d.join("big.dat"), vec![b'x'; 2000]).unwrap();
        let _socket = std::os::unix::net::UnixListener::bind(d.join("sock")).unwrap();

        let ch = tree_changes(d, &tree, &Materialized::default(), 1000);
        assert_eq!(
            summary(&ch),
            [
                ("delete", "old.txt"),
                ("delete", "was_file"),
                ("rmdir", "gone"),
                ("rmdir", "was_dir"),
                ("mkdir", "made/empty"),
                ("write", "README.md"),
                ("write", "inside"),
                ("write", "link"),
                ("write", "new.bin"),
                ("write", "run.sh"),
                ("write", "was_dir"),
                ("write", "was_file/in.txt"),
            ]
        );
        let bin = written_entry(&ch, "new.bin");
        assert!(bin.binary);
        assert_eq!(bin.hash, BlobHash::of(&[0u8, 1, 2, 255]));
        assert_eq!(&ch.blobs[&bin.hash][..], &[0u8, 1, 2, 255]);
        let inside = written_entry(&ch, "inside");
        assert!(inside.is_symlink());
        assert_eq!(&ch.blobs[&inside.hash][..], b"src/keep.rs");
        assert_eq!(written_entry(&ch, "README.md").mode, MODE_FILE);
        assert_eq!(
            &ch.blobs[&written_entry(&ch, "README.md").hash][..],
            b"final\n"
        );
        assert_eq!(written_entry(&ch, "link").mode, MODE_SYMLINK);
        let run_sh = written_entry(&ch, "run.sh");
        assert_eq!(run_sh.mode, MODE_EXEC);
        assert_eq!(run_sh.hash, tree.files[&ws("run.sh")].hash);
        let refused: Vec<&str> = ch.not_imported.iter().map(|(p, _)| p.as_str()).collect();
        assert_eq!(refused, ["big.dat", "escape", "sock", "src/escape2"]);
        assert!(ch.not_imported[1].1.contains("outside the workspace"));
        assert!(ch.not_imported[0].1.contains("over the limit"));
    }

    #[test]
    fn tree_changes_leaves_what_it_cannot_read_or_did_not_write() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        std::fs::create_dir_all(d.join("sub")).unwrap();
        std::fs::write(d.join("sub/a.txt"), "a\n").unwrap();
        std::fs::write(d.join("big.dat"), vec![b'y'; 2000]).unwrap();
        let mut tree = forkfleet_shared::manifest::scan_dir(d, &[])
            .unwrap()
            .manifest;
        // A symlink that leaves the tree was never materialised: it is not deleted.
        tree.insert_file(
            ws("escape"),
            FileEntry::for_bytes(b"/etc/passwd", MODE_SYMLINK),
        );
        let written = Materialized {
            skipped: vec![ws("escape")],
            ..Materialized::default()
        };
        // Unchanged big files from the tree are compared whatever the limit.
        let ch = tree_changes(d, &tree, &written, 1000);
        assert!(ch.ops.is_empty(), "{ch:?}");
        assert!(ch.not_imported.is_empty());

        // A big file changed past the limit is left as it was, not deleted.
        std::fs::write(d.join("big.dat"), vec![b'y'; 3000]).unwrap();
        let ch = tree_changes(d, &tree, &written, 1000);
        assert!(ch.ops.is_empty(), "{ch:?}");
        assert_eq!(ch.not_imported.len(), 1);

        // A command that replaced the escaping link, and changed big.dat (now within the
        // limit).
        std::fs::write(d.join("escape"), "plain\n").unwrap();
        let ch = tree_changes(d, &tree, &written, 1 << 20);
        assert_eq!(summary(&ch), [("write", "big.dat"), ("write", "escape")]);

        // The directory of the escaping link removed: one rmdir stands for both.
        std::fs::create_dir(d.join("sub/deeper")).unwrap();
        tree.insert_file(
            ws("sub/deeper/out"),
            FileEntry::for_bytes(b"../../..", MODE_SYMLINK),
        );
        tree.dirs.insert(ws("sub/deeper"));
        let written = Materialized {
            skipped: vec![ws("escape"), ws("sub/deeper/out")],
            ..Materialized::default()
        };
        std::fs::remove_file(d.join("escape")).unwrap();
        std::fs::write(d.join("big.dat"), vec![b'y'; 2000]).unwrap();
        assert!(tree_changes(d, &tree, &written, 1000).ops.is_empty());
        std::fs::remove_dir_all(d.join("sub")).unwrap();
        let ch = tree_changes(d, &tree, &written, 1000);
        assert_eq!(summary(&ch), [("rmdir", "sub")]);
    }

    /// A tree of `files` and a cache holding their blobs.
    fn stored(files: &[(&str, &str)]) -> (Manifest, BlobCache) {
        let store = forkfleet_shared::blob::MemBlobStore::new();
        let mut tree = Manifest::default();
        for (p, c) in files {
            store.insert(Bytes::copy_from_slice(c.as_bytes()));
            tree.insert_file(ws(p), FileEntry::for_bytes(c.as_bytes(), MODE_FILE));
        }
        (tree, BlobCache::new(std::sync::Arc::new(store), 1 << 20))
    }

    async fn materialized(files: &[(&str, &str)]) -> (tempfile::TempDir, Manifest, Materialized) {
        let (tree, cache) = stored(files);
        let dir = tempfile::tempdir().unwrap();
        let written = materialize(&tree, &cache, dir.path()).await.unwrap();
        (dir, tree, written)
    }

    #[tokio::test]
    async fn files_as_materialised_are_not_read_again() {
        let (dir, tree, mut written) = materialized(&[
            ("a.txt", "aaaa\n"),
            ("d/b.txt", "bbbb\n"),
            ("d/c.txt", "cc\n"),
        ])
        .await;
        let d = dir.path();
        // Nothing touched, and every stamp older than the last clock tick of the writing:
        // nothing is read.
        written.last_ctime = None;
        let ch = tree_changes(d, &tree, &written, 1 << 20);
        assert!(ch.ops.is_empty(), "{ch:?}");
        assert_eq!(ch.read, 0);

        // A file rewritten with as many bytes and its mtime set back: its ctime moved.
        let mtime = std::fs::metadata(d.join("a.txt"))
            .unwrap()
            .modified()
            .unwrap();
        std::fs::write(d.join("a.txt"), "AAAA\n").unwrap();
        let file = std::fs::File::options()
            .write(true)
            .open(d.join("a.txt"))
            .unwrap();
        file.set_modified(mtime).unwrap();
        let now = Stamp::of(&std::fs::metadata(d.join("a.txt")).unwrap());
        let moved = now != written.stamps[&ws("a.txt")];
        if !moved {
            // Changed within the clock tick it was written in (a kernel without fine-grained
            // ctimes): only the last-tick rule tells.
            written.last_ctime = Some(now.ctime);
        }
        let ch = tree_changes(d, &tree, &written, 1 << 20);
        assert_eq!(summary(&ch), [("write", "a.txt")]);
        if moved {
            assert_eq!(ch.read, 1);
        }
    }

    #[tokio::test]
    async fn a_file_stamped_in_the_last_tick_is_read() {
        let (dir, tree, mut written) =
            materialized(&[("a.txt", "aaaa\n"), ("b.txt", "bbbb\n")]).await;
        let d = dir.path();
        // The command changed a.txt without its stamp showing it (as within the tick it was
        // written in): trusted, the stamp would hide the change; as the last tick's, it is read.
        std::fs::write(d.join("a.txt"), "AAAA\n").unwrap();
        let now = Stamp::of(&std::fs::metadata(d.join("a.txt")).unwrap());
        written.stamps.insert(ws("a.txt"), now);
        written.last_ctime = Some(now.ctime);
        let ch = tree_changes(d, &tree, &written, 1 << 20);
        assert_eq!(summary(&ch), [("write", "a.txt")]);
        written.last_ctime = None;
        let ch = tree_changes(d, &tree, &written, 1 << 20);
        assert!(ch.ops.is_empty(), "a trusted stamp is not read: {ch:?}");
    }

    #[tokio::test]
    async fn a_workdir_is_removed_after_use_or_when_dropped() {
        let (tree, cache) = stored(&[("a.txt", "a\n")]);
        let work = Workdir::create("forkfleet-test-", tree.clone(), &cache)
            .await
            .unwrap();
        let path = work.root.0.clone();
        let spec = CommandSpec {
            argv: vec![
                "sh".into(),
                "-c".into(),
                "cat a.txt > made.txt && echo c > \"$HOME/cache\" && echo t > \"$TMPDIR/t\"".into(),
            ],
            env: BTreeMap::new(),
            timeout: Duration::from_secs(30),
            max_output_bytes: 1024,
        };
        let run = work
            .run(&WsPath::root(), &spec, std::future::pending())
            .await;
        assert_eq!(
            run.outcome,
            CommandOutcome::Exited { code: 0 },
            "{}",
            run.output
        );
        // HOME and TMPDIR are beside the tree: what goes there is no change.
        let ch = work.changes(1 << 20).await;
        assert_eq!(summary(&ch), [("write", "made.txt")]);
        assert!(!path.exists());

        // Given up (dropped) where no runtime runs: removed at once.
        let work = Workdir::create("forkfleet-test-", tree, &cache)
            .await
            .unwrap();
        let path = work.root.0.clone();
        assert!(path.join("ws/a.txt").exists());
        std::thread::spawn(move || drop(work)).join().unwrap();
        assert!(!path.exists());
    }
}
