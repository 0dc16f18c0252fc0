//! Running a command against a branch's tree: for the test command of a resolve (issue 5)
//! and for the agent's `run_command` tool (`crate::tools`).
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
//!   tree it was materialised from: the files created, changed (content or executable bit)
//!   or deleted, the directories made or removed, and what cannot be taken back (a symlink
//!   leaving the tree, a file over the size limit, a fifo, an unreadable entry).

use bytes::Bytes;
use forkfleet_shared::blob::{fetch, BlobError, BlobStore};
use forkfleet_shared::manifest::{FileEntry, Manifest, MODE_EXEC, MODE_FILE, MODE_SYMLINK};
use forkfleet_shared::path::WsPath;
use futures::future::BoxFuture;
use futures::StreamExt;
use std::collections::BTreeMap;
use std::collections::BTreeSet;
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
pub struct MaterializeStats {
    pub files: usize,
    pub bytes: u64,
    pub dirs: usize,
    /// Symlinks whose target would leave the tree: not created.
    pub skipped_symlinks: usize,
    /// Their paths, in path order.
    pub skipped: Vec<WsPath>,
}

#[derive(Debug, thiserror::Error)]
pub enum MaterializeError {
    #[error("cannot write `{path}` into `{dir}`: {source}")]
    Io {
        dir: PathBuf,
        path: String,
        source: std::io::Error,
    },
    #[error("cannot read the blob of `{path}`: {source}")]
    Blob { path: String, source: BlobError },
}

/// Write `tree` into `dir` (which must exist and should be empty).
pub async fn materialize(
    tree: &Manifest,
    blobs: &dyn BlobStore,
    dir: &Path,
) -> Result<MaterializeStats, MaterializeError> {
    let io = |path: &WsPath, source| MaterializeError::Io {
        dir: dir.to_path_buf(),
        path: path.to_string(),
        source,
    };
    let mut stats = MaterializeStats::default();
    for d in &tree.dirs {
        tokio::fs::create_dir_all(d.to_os_path(dir))
            .await
            .map_err(|e| io(d, e))?;
        stats.dirs += 1;
    }
    // Boxed as `Send` futures here: an iterator of async blocks borrowing the tree would
    // otherwise make the whole call unusable from a spawned task (a higher-ranked `Send`).
    type Write<'a> = BoxFuture<'a, (&'a WsPath, Result<(u64, bool), MaterializeError>)>;
    let writes: Vec<Write<'_>> = tree
        .files
        .iter()
        .map(|(path, entry)| -> Write<'_> {
            Box::pin(async move { (path, write_one(path, entry, blobs, dir).await) })
        })
        .collect();
    let mut written = futures::stream::iter(writes).buffer_unordered(WRITES_IN_FLIGHT);
    while let Some((path, done)) = written.next().await {
        let (bytes, skipped) = done?;
        if skipped {
            stats.skipped_symlinks += 1;
            stats.skipped.push(path.clone());
        } else {
            stats.files += 1;
            stats.bytes += bytes;
        }
    }
    stats.skipped.sort();
    Ok(stats)
}

/// Write one file (or symlink) of a tree; `(bytes written, skipped symlink)`.
async fn write_one(
    path: &WsPath,
    entry: &FileEntry,
    blobs: &dyn BlobStore,
    dir: &Path,
) -> Result<(u64, bool), MaterializeError> {
    let io = |source| MaterializeError::Io {
        dir: dir.to_path_buf(),
        path: path.to_string(),
        source,
    };
    let bytes: Bytes =
        fetch(blobs, &entry.hash)
            .await
            .map_err(|source| MaterializeError::Blob {
                path: path.to_string(),
                source,
            })?;
    let target = path.to_os_path(dir);
    if let Some(parent) = target.parent() {
        tokio::fs::create_dir_all(parent).await.map_err(io)?;
    }
    if entry.is_symlink() {
        let link = String::from_utf8_lossy(&bytes).to_string();
        if !stays_inside(path, &link) {
            return Ok((0, true));
        }
        tokio::fs::symlink(&link, &target).await.map_err(io)?;
        return Ok((0, false));
    }
    tokio::fs::write(&target, &bytes).await.map_err(io)?;
    if entry.mode & 0o111 != 0 {
        use std::os::unix::fs::PermissionsExt;
        let perms = std::fs::Permissions::from_mode(entry.mode & 0o777);
        tokio::fs::set_permissions(&target, perms)
            .await
            .map_err(io)?;
    }
    Ok((bytes.len() as u64, false))
}

/// True when a symlink at `at` pointing to `target` resolves (lexically) inside the tree.
/// An absolute target is outside (for the OS `/` is not the tree's root), and so is one
/// with a `\` ([`WsPath::parse_in`] reads it as a separator, the OS as part of a name, so
/// the two would count its `..` differently).
pub(crate) fn stays_inside(at: &WsPath, target: &str) -> bool {
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

/// The length of `bytes` without a UTF-8 sequence cut short at its end.
fn utf8_complete_prefix(bytes: &[u8]) -> usize {
    match std::str::from_utf8(bytes) {
        Ok(_) => bytes.len(),
        // `error_len() == None`: the input ended in the middle of a character.
        Err(e) if e.error_len().is_none() => e.valid_up_to(),
        Err(_) => {
            // Invalid bytes earlier on (shown as U+FFFD anyway); only look at the end.
            let start = bytes.len().saturating_sub(3);
            let lead = bytes[start..]
                .iter()
                .rposition(|b| (*b & 0xC0) != 0x80)
                .map(|i| start + i);
            match lead {
                Some(i) => {
                    let need = match bytes[i] {
                        b if b >= 0xF0 => 4,
                        b if b >= 0xE0 => 3,
                        b if b >= 0xC0 => 2,
                        _ => 1,
                    };
                    if bytes.len() - i < need {
                        i
                    } else {
                        bytes.len()
                    }
                }
                None => bytes.len(),
            }
        }
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

/// A file a command created or changed, with its new bytes (a symlink's: its target).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Written {
    pub path: WsPath,
    pub entry: FileEntry,
    pub bytes: Bytes,
}

/// What a command did to a materialised tree (see [`tree_changes`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TreeChanges {
    /// Files (and symlinks) that were not in the tree, in path order.
    pub created: Vec<Written>,
    /// Files whose content or executable bit changed, in path order.
    pub modified: Vec<Written>,
    /// Files that are gone, except those below a gone directory, in path order.
    pub deleted: Vec<WsPath>,
    /// Directories that are gone, the topmost of each gone subtree only, in path order.
    pub deleted_dirs: Vec<WsPath>,
    /// Directories that were not in the tree, in path order.
    pub new_dirs: Vec<WsPath>,
    /// What could not be taken back, and why. Such a path (and everything below it) is left
    /// as it was in the tree: not created, changed or deleted.
    pub not_imported: Vec<(String, String)>,
}

impl TreeChanges {
    pub fn is_empty(&self) -> bool {
        self.created.is_empty()
            && self.modified.is_empty()
            && self.deleted.is_empty()
            && self.deleted_dirs.is_empty()
            && self.new_dirs.is_empty()
    }
}

/// Compare `dir`, where `tree` was materialised (without the symlinks in `skipped`, which
/// [`materialize`] did not create), with `tree`. Every regular file is read and hashed
/// (sizes and times are not trusted: a command may keep both); an executable bit counts
/// (a mode is `0o755` or `0o644` as in a snapshot, or the tree's own mode when only the
/// content changed). A symlink is taken back only when its target stays inside the tree.
/// A new or changed file over `max_file_bytes` is not read. Blocking: call it off the
/// async runtime.
pub fn tree_changes(
    dir: &Path,
    tree: &Manifest,
    skipped: &[WsPath],
    max_file_bytes: u64,
) -> TreeChanges {
    let mut out = TreeChanges::default();
    let skipped: BTreeSet<&WsPath> = skipped.iter().collect();
    let before = |p: &WsPath| tree.files.get(p).filter(|_| !skipped.contains(p));
    let mut dirs_before: BTreeSet<WsPath> = BTreeSet::new();
    for d in &tree.dirs {
        dirs_before.extend(d.ancestors());
        dirs_before.insert(d.clone());
    }
    for p in tree.files.keys() {
        dirs_before.extend(p.ancestors());
    }
    // What is there now: files (whatever their fate) and directories; and the paths left as
    // they were (not imported, or unreadable).
    let mut files_after: BTreeSet<WsPath> = BTreeSet::new();
    let mut dirs_after: BTreeSet<WsPath> = BTreeSet::new();
    let mut kept: Vec<WsPath> = Vec::new();
    let refuse = |out: &mut TreeChanges, kept: &mut Vec<WsPath>, path: &WsPath, why: String| {
        out.not_imported.push((path.to_string(), why));
        kept.push(path.clone());
    };
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
                kept.push(rel.clone());
                continue;
            }
        };
        for entry in entries {
            let entry = match entry {
                Ok(e) => e,
                Err(e) => {
                    refuse(
                        &mut out,
                        &mut kept,
                        &rel,
                        format!("cannot list the directory: {e}"),
                    );
                    continue;
                }
            };
            let os_name = entry.file_name();
            let Some(name) = os_name.to_str() else {
                out.not_imported.push((
                    format!("{}{}", rel.child_prefix(), os_name.to_string_lossy()),
                    "the name is not valid UTF-8".to_string(),
                ));
                continue;
            };
            if name.contains('\\') {
                // forkfleet reads `\` as a separator: this name cannot be a workspace path.
                out.not_imported.push((
                    format!("{}{name}", rel.child_prefix()),
                    "the name has a `\\`".to_string(),
                ));
                continue;
            }
            let path = match rel.join(name) {
                Ok(p) => p,
                Err(e) => {
                    out.not_imported
                        .push((format!("{}{name}", rel.child_prefix()), e.to_string()));
                    continue;
                }
            };
            let full = entry.path();
            let meta = match std::fs::symlink_metadata(&full) {
                Ok(m) => m,
                Err(e) => {
                    refuse(&mut out, &mut kept, &path, format!("cannot read it: {e}"));
                    continue;
                }
            };
            let file_type = meta.file_type();
            if file_type.is_dir() {
                dirs_after.insert(path.clone());
                stack.push((full, path));
                continue;
            }
            let old = before(&path);
            let (entry, bytes) = if file_type.is_symlink() {
                let target = match std::fs::read_link(&full) {
                    Ok(t) => t,
                    Err(e) => {
                        refuse(
                            &mut out,
                            &mut kept,
                            &path,
                            format!("cannot read the symlink: {e}"),
                        );
                        continue;
                    }
                };
                let Some(target) = target.to_str().map(str::to_string) else {
                    refuse(
                        &mut out,
                        &mut kept,
                        &path,
                        "a symlink whose target is not valid UTF-8".to_string(),
                    );
                    continue;
                };
                if !stays_inside(&path, &target) {
                    refuse(
                        &mut out,
                        &mut kept,
                        &path,
                        format!("a symlink to `{target}`, outside the workspace"),
                    );
                    continue;
                }
                let bytes = Bytes::from(target.into_bytes());
                (FileEntry::for_bytes(&bytes, MODE_SYMLINK), bytes)
            } else if file_type.is_file() {
                let size = meta.len();
                let same_size = old.is_some_and(|e| !e.is_symlink() && e.size == size);
                if size > max_file_bytes && !same_size {
                    refuse(
                        &mut out,
                        &mut kept,
                        &path,
                        format!("{size} bytes, over the limit of {max_file_bytes} bytes"),
                    );
                    continue;
                }
                let bytes = match std::fs::read(&full) {
                    Ok(b) => Bytes::from(b),
                    Err(e) => {
                        refuse(&mut out, &mut kept, &path, format!("cannot read it: {e}"));
                        continue;
                    }
                };
                let exec = {
                    use std::os::unix::fs::PermissionsExt;
                    meta.permissions().mode() & 0o111 != 0
                };
                let mode = match old {
                    Some(e) if !e.is_symlink() && (e.mode & 0o111 != 0) == exec => e.mode,
                    _ if exec => MODE_EXEC,
                    _ => MODE_FILE,
                };
                (FileEntry::for_bytes(&bytes, mode), bytes)
            } else {
                refuse(
                    &mut out,
                    &mut kept,
                    &path,
                    "not a regular file, a directory or a symlink".to_string(),
                );
                continue;
            };
            files_after.insert(path.clone());
            match old {
                Some(o) if o.same_as(&entry) => {}
                Some(_) => out.modified.push(Written { path, entry, bytes }),
                None => out.created.push(Written { path, entry, bytes }),
            }
        }
    }
    let kept: BTreeSet<WsPath> = kept.into_iter().collect();
    let is_kept = |p: &WsPath| {
        kept.contains(p)
            || kept.contains(&WsPath::root())
            || p.ancestors().any(|a| kept.contains(&a))
    };
    let mut gone_dirs: BTreeSet<WsPath> = BTreeSet::new();
    for d in &dirs_before {
        if dirs_after.contains(d) || is_kept(d) {
            continue;
        }
        // The topmost gone directory stands for its subtree.
        if !d.ancestors().any(|a| gone_dirs.contains(&a)) {
            out.deleted_dirs.push(d.clone());
        }
        gone_dirs.insert(d.clone());
    }
    for p in tree.files.keys() {
        if before(p).is_none() || files_after.contains(p) || is_kept(p) {
            continue;
        }
        if !p.ancestors().any(|a| gone_dirs.contains(&a)) {
            out.deleted.push(p.clone());
        }
    }
    out.new_dirs = dirs_after.difference(&dirs_before).cloned().collect();
    out.created.sort_by(|a, b| a.path.cmp(&b.path));
    out.modified.sort_by(|a, b| a.path.cmp(&b.path));
    out.not_imported.sort();
    out
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

    fn paths(ps: &[WsPath]) -> Vec<&str> {
        ps.iter().map(WsPath::as_str).collect()
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

        let ch = tree_changes(d, &tree, &[], 1000);
        let created: Vec<&str> = ch.created.iter().map(|w| w.path.as_str()).collect();
        assert_eq!(created, ["inside", "new.bin", "was_dir", "was_file/in.txt"]);
        let bin = &ch.created[1];
        assert!(bin.entry.binary);
        assert_eq!(&bin.bytes[..], &[0u8, 1, 2, 255]);
        assert_eq!(
            bin.entry.hash,
            forkfleet_shared::blob::BlobHash::of(&bin.bytes)
        );
        let inside = &ch.created[0];
        assert!(inside.entry.is_symlink());
        assert_eq!(&inside.bytes[..], b"src/keep.rs");

        let modified: Vec<(&str, u32)> = ch
            .modified
            .iter()
            .map(|w| (w.path.as_str(), w.entry.mode))
            .collect();
        assert_eq!(
            modified,
            [
                ("README.md", MODE_FILE),
                ("link", MODE_SYMLINK),
                ("run.sh", MODE_EXEC)
            ]
        );
        assert_eq!(&ch.modified[0].bytes[..], b"final\n");
        assert_eq!(paths(&ch.deleted), ["old.txt", "was_file"]);
        assert_eq!(paths(&ch.deleted_dirs), ["gone", "was_dir"]);
        assert_eq!(paths(&ch.new_dirs), ["made", "made/empty", "was_file"]);
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
        // Unchanged big files from the tree are compared whatever the limit.
        let ch = tree_changes(d, &tree, &[ws("escape")], 1000);
        assert!(ch.is_empty(), "{ch:?}");
        assert!(ch.not_imported.is_empty());

        // A big file changed past the limit is left as it was, not deleted.
        std::fs::write(d.join("big.dat"), vec![b'y'; 3000]).unwrap();
        let ch = tree_changes(d, &tree, &[ws("escape")], 1000);
        assert!(ch.is_empty(), "{ch:?}");
        assert_eq!(ch.not_imported.len(), 1);

        // A command that replaced the escaping link: a new file.
        std::fs::write(d.join("escape"), "plain\n").unwrap();
        let ch = tree_changes(d, &tree, &[ws("escape")], 1 << 20);
        let created: Vec<&str> = ch.created.iter().map(|w| w.path.as_str()).collect();
        assert_eq!(created, ["escape"]);
        assert_eq!(ch.modified.len(), 1, "big.dat, now within the limit");
    }
}
