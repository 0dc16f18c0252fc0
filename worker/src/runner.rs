//! Running a command against a branch's tree: for the test command of a resolve (issue 5),
//! and later for a command-running tool of the agent (not there yet).
//!
//! - [`materialize`] writes a tree (a snapshot manifest, or a branch overlay's view of it) into
//!   a directory: every file from its blob, executable bits from the mode, empty
//!   directories; a symlink is recreated only when its target stays inside the tree.
//! - [`run_command`] runs an argv there, without a shell, in a process group of its own, with
//!   the environment cleared to [`base_env`] plus what the caller passes (no secret of the
//!   worker's leaks in by default), its output (stdout and stderr together, in arrival order)
//!   kept up to a limit (head and tail), and a timeout: on timeout or cancellation the whole
//!   process group is killed, and so are stragglers a command leaves behind.

use bytes::Bytes;
use forkfleet_shared::blob::{fetch, BlobStore};
use forkfleet_shared::manifest::{FileEntry, Manifest};
use forkfleet_shared::path::WsPath;
use futures::future::BoxFuture;
use futures::StreamExt;
use std::collections::BTreeMap;
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
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MaterializeStats {
    pub files: usize,
    pub bytes: u64,
    pub dirs: usize,
    /// Symlinks whose target would leave the tree: not created.
    pub skipped_symlinks: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum MaterializeError {
    #[error("cannot write `{path}` into `{dir}`: {source}")]
    Io {
        dir: PathBuf,
        path: String,
        source: std::io::Error,
    },
    #[error("cannot read the blob of `{path}`: {message}")]
    Blob { path: String, message: String },
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
    let writes: Vec<BoxFuture<'_, Result<(u64, bool), MaterializeError>>> = tree
        .files
        .iter()
        .map(
            |(path, entry)| -> BoxFuture<'_, Result<(u64, bool), MaterializeError>> {
                Box::pin(write_one(path, entry, blobs, dir))
            },
        )
        .collect();
    let mut written = futures::stream::iter(writes).buffer_unordered(WRITES_IN_FLIGHT);
    while let Some(done) = written.next().await {
        let (bytes, skipped) = done?;
        if skipped {
            stats.skipped_symlinks += 1;
        } else {
            stats.files += 1;
            stats.bytes += bytes;
        }
    }
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
    let bytes: Bytes = fetch(blobs, &entry.hash)
        .await
        .map_err(|e| MaterializeError::Blob {
            path: path.to_string(),
            message: e.to_string(),
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

    fn finish(self) -> (String, u64) {
        let mut out = String::from_utf8_lossy(&self.head).to_string();
        if self.dropped > 0 {
            out.push_str(&format!(
                "\n[... {} bytes of output left out ...]\n",
                self.dropped
            ));
        }
        let tail: Vec<u8> = self.tail.into_iter().collect();
        out.push_str(&String::from_utf8_lossy(&tail));
        (out, self.dropped)
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
}
