//! Running one command in a directory: no shell, a cleared environment, its own process
//! group (killed on timeout, cancellation or drop), its output capped to a head and a tail,
//! confined by its sandbox ([`super::sandbox`]) between its start and exec
//! ([`super::spawn`]).

use super::sandbox::{self, SandboxSpec};
use std::collections::BTreeMap;
use std::future::Future;
use std::path::Path;
use std::time::{Duration, Instant};
use tokio::io::AsyncReadExt;

/// After the command's leader exits, how long its output pipes may stay open (held by a
/// child it left running) before the group is killed.
const DRAIN_AFTER_EXIT: Duration = Duration::from_millis(500);

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
    /// How the command is confined (default: the default sandbox, writing only in the
    /// directory it runs in).
    pub sandbox: SandboxSpec,
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
pub(super) struct Capped {
    limit: usize,
    head: Vec<u8>,
    tail: std::collections::VecDeque<u8>,
    dropped: u64,
}

impl Capped {
    pub(super) fn new(limit: usize) -> Self {
        Self {
            limit,
            head: Vec::new(),
            tail: std::collections::VecDeque::new(),
            dropped: 0,
        }
    }

    pub(super) fn push(&mut self, bytes: &[u8]) {
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
    pub(super) fn finish(self) -> (String, u64) {
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
pub(super) fn utf8_complete_prefix(bytes: &[u8]) -> usize {
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
    let mut env = base_env(dir);
    env.extend(spec.env.iter().map(|(k, v)| (k.clone(), v.clone())));
    let mut sandbox_spec = spec.sandbox.clone();
    if sandbox_spec.writable.is_empty() {
        sandbox_spec.writable.push(dir.to_path_buf());
    }
    let confinement = match sandbox::prepare(&sandbox_spec, sandbox::support()) {
        Ok(c) => c,
        Err(error) => return done(CommandOutcome::SpawnFailed { error }, String::new(), 0),
    };
    // A layered tree is mounted by the child itself, before it is confined.
    let mount = match &spec.sandbox.layers {
        Some(dirs) => match super::layered::Mount::new(dirs, dir) {
            Ok(m) => Some(m),
            Err(error) => {
                return done(
                    CommandOutcome::SpawnFailed {
                        error: format!("cannot mount the tree: {error}"),
                    },
                    String::new(),
                    0,
                )
            }
        },
        None => None,
    };
    // A layered tree's directory is empty until the child mounts it; the child enters `dir`
    // after the mount.
    let start_in = spec
        .sandbox
        .layers
        .as_ref()
        .map_or(dir, |l| l.merged.as_path());
    let env: Vec<(String, String)> = env.into_iter().collect();
    let start = super::spawn::Start {
        program,
        args,
        dir: start_in,
        env: &env,
        mount: mount.as_ref(),
        confinement: confinement.as_ref(),
    };
    let mut child = match super::spawn::spawn(&start) {
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
    let pgid = Some(child.id());
    // Dropping this future (the caller gave up on it) kills the whole group, not only the
    // leader that dropping the child kills.
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
