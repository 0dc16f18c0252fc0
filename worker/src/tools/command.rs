//! The `run_command` tool: a command run in a copy of the branch's current tree, whose
//! changes become overlay changes.
//!
//! The branch's current tree (the fork-time snapshot with the branch's changes,
//! [`Overlay::to_manifest`]) is materialised from the blob cache ([`Workdir`], the same
//! path as a resolve's test job; a symlink pointing outside the tree is not created): the
//! first call of a branch writes it whole, later ones take the branch's kept tree
//! ([`crate::runner::Trees`]) and write or remove only the paths that changed since. The
//! command runs there ([`crate::runner::run_command`]): no
//! shell, the environment cleared to `PATH`, `HOME`, `TMPDIR`, `LANG` and the spec's `env`
//! (`HOME` and `TMPDIR` are scratch directories outside the tree, so caches and temporary
//! files do not become changes), the whole process group killed at the timeout (the model's
//! `timeout_s`, capped at the spec's). Afterwards (also after a timeout) the directory is
//! compared with the tree it was materialised from ([`crate::runner::tree_changes`]: a file
//! whose inode, size, mode and times are as written is not read again) and what the command
//! did becomes overlay changes, in the order of that change log: deleted files (`delete`)
//! and directories (`rmdir`), new empty directories (`mkdir`), then new files (`write`) and
//! changed ones (`edit`; a `chmod +x` is an edit that changes the mode); every new blob is
//! stored before the changes are recorded. Not taken back, and reported to the model: a symlink
//! pointing outside the workspace, a new or changed file over [`MAX_IMPORT_FILE_BYTES`],
//! anything that is not a file, directory or symlink, an unreadable entry; such a path stays
//! as it was.
//!
//! The command runs in the sandbox of the spec's `[run_command]` settings
//! ([`crate::runner::sandbox`]): it reads and writes its tree, `HOME` and `TMPDIR`, reads
//! system paths, has no TCP unless `network = true`, and has resource limits; what the
//! sandbox blocks fails in the command (`EACCES`, `EPERM`) and shows in its output. With
//! `sandbox = "required"` on a worker that cannot confine it, the call is refused
//! (`could not start: the sandbox is required ...`).
//!
//! The result is `ok` when the command exited with code 0; a non-zero exit, a signal, a
//! timeout or a command that could not start is `ok = false`. The output is the outcome
//! line (`exit code N`, `timed out after N s`, `could not start: ...`), stdout and stderr
//! together cut in the middle to the spec's `max_output_bytes` (a marker says how many bytes
//! were left out), and a line listing the files created, changed and deleted.

use super::TreeSlot;
use super::{resolve, ToolOutcome};
use crate::cache::BlobCache;
use crate::error::WorkerError;
use crate::runner::{Checkout, CommandOutcome, CommandSpec, SandboxSpec, TreeChanges, Workdir};
use forkfleet_shared::blob::BlobError;
use forkfleet_shared::endpoint::CommandTool;
use forkfleet_shared::error::ErrorKind;
use forkfleet_shared::manifest::Node;
use forkfleet_shared::overlay::{ChangeOp, Overlay};
use forkfleet_shared::path::WsPath;
use serde::Deserialize;
use std::fmt::Write as _;
use std::time::Duration;

use super::{tool, Env, Tool};
use crate::toolspec::{run_command_spec, RUN_COMMAND};

pub(super) const TOOL: Tool = tool!(RUN_COMMAND, run_command_spec, |a, env| run(a, env));

/// `run_command` with the branch's settings (`[run_command]`).
async fn run(a: CommandArgs, env: Env<'_>) -> Result<ToolOutcome, WorkerError> {
    match &env.settings.run_command {
        Some(tool) => run_command(tool, a, env.overlay, env.blobs, env.trees).await,
        // (`ToolBox::run` answers first: its settings offer no tool they do not enable.)
        None => Ok(ToolOutcome::err(
            "`run_command` is not enabled for this run",
        )),
    }
}

/// A file a command creates or changes is taken back into the workspace only up to this
/// size (64 MiB); a larger one is reported and the path left as it was.
pub const MAX_IMPORT_FILE_BYTES: u64 = 64 << 20;
/// Paths of each kind (created, changed, deleted, ...) a `run_command` result names.
pub(super) const MAX_LISTED_PATHS: usize = 50;

/// What one tool call produced. The changes it made are the overlay's new log entries.
#[derive(Deserialize)]
pub(super) struct CommandArgs {
    command: serde_json::Value,
    #[serde(default)]
    timeout_s: Option<f64>,
    #[serde(default)]
    cwd: Option<String>,
}

/// The argv of a `command` argument: a list of words, or a line split as a shell would.
pub(super) fn command_argv(command: &serde_json::Value) -> Result<Vec<String>, String> {
    let argv = match command {
        serde_json::Value::String(line) => forkfleet_shared::spec::split_words(line)?,
        serde_json::Value::Array(words) => words
            .iter()
            .map(|w| {
                w.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| format!("every word of `command` must be a string, got {w}"))
            })
            .collect::<Result<Vec<_>, _>>()?,
        other => {
            return Err(format!(
                "`command` must be a list of words or a string, got {other}"
            ))
        }
    };
    match argv.first() {
        Some(program) if !program.is_empty() => Ok(argv),
        _ => Err("`command` is empty; name the program to run".to_string()),
    }
}

/// The directory a command runs in: `cwd` inside the workspace (symlinks followed in the
/// overlay), an existing directory; `Err` is the tool result saying why not.
async fn command_dir(
    cwd: Option<&str>,
    ov: &Overlay,
    blobs: &BlobCache,
) -> Result<Result<WsPath, ToolOutcome>, BlobError> {
    let Some(input) = cwd.filter(|c| !c.trim().is_empty()) else {
        return Ok(Ok(WsPath::root()));
    };
    if input.starts_with('/') || input.starts_with('\\') {
        return Ok(Err(ToolOutcome::err(format!(
            "cwd `{input}` is an absolute path; give a directory relative to the workspace \
             root, such as `src` (default: the root)"
        ))));
    }
    let path = match WsPath::parse(input) {
        Ok(p) => p,
        Err(forkfleet_shared::path::PathError::Escapes(_)) => {
            return Ok(Err(ToolOutcome::err(format!(
                "cwd `{input}` leaves the workspace; give a directory inside it, relative to \
                 the workspace root"
            ))))
        }
        Err(e) => return Ok(Err(ToolOutcome::err(format!("cwd: {e}")))),
    };
    let path = match resolve(ov, blobs, &path).await? {
        Ok(p) => p,
        Err(e) => return Ok(Err(ToolOutcome::err(format!("cwd: {}", e.output)))),
    };
    Ok(match ov.node(&path) {
        Node::Dir => Ok(path),
        Node::File(_) => Err(ToolOutcome::err(format!(
            "cwd `{input}` is a file, not a directory"
        ))),
        Node::Missing => Err(ToolOutcome::err(format!(
            "cwd `{input}` does not exist in the workspace"
        ))),
    })
}

/// Seconds shown without a trailing `.0`.
fn secs(s: f64) -> String {
    format!("{s}")
}

pub(super) async fn run_command(
    tool: &CommandTool,
    a: CommandArgs,
    ov: &mut Overlay,
    blobs: &BlobCache,
    trees: Option<&TreeSlot>,
) -> Result<ToolOutcome, WorkerError> {
    let argv = match command_argv(&a.command) {
        Ok(v) => v,
        Err(e) => return Ok(ToolOutcome::err(e)),
    };
    let limit = if tool.timeout_s.is_finite() && tool.timeout_s > 0.0 {
        tool.timeout_s
    } else {
        forkfleet_shared::endpoint::DEFAULT_COMMAND_TIMEOUT_S
    };
    let (timeout_s, capped) = match a.timeout_s {
        None => (limit, false),
        Some(t) if !(t.is_finite() && t > 0.0) => {
            return Ok(ToolOutcome::err(format!(
                "timeout_s is {t}; give a number of seconds above 0 (at most {})",
                secs(limit)
            )))
        }
        Some(t) if t > limit => (limit, true),
        Some(t) => (t, false),
    };
    let timeout = Duration::try_from_secs_f64(timeout_s).unwrap_or(Duration::from_secs(60));
    let cwd = match command_dir(a.cwd.as_deref(), ov, blobs).await? {
        Ok(p) => p,
        Err(e) => return Ok(e),
    };
    let not_started = |why: String| ToolOutcome::err(format!("could not start: {why}"));
    let started = std::time::Instant::now();
    let checkout = match trees {
        Some(slot) => {
            slot.trees
                .checkout(
                    &slot.key,
                    "forkfleet-cmd-",
                    ov.to_manifest(),
                    Some((ov.base(), slot.snapshot)),
                    blobs,
                    crate::runner::sandbox::confines(&tool.sandbox),
                )
                .await
        }
        None => Workdir::create("forkfleet-cmd-", ov.to_manifest(), blobs)
            .await
            .map(|w| (w, Checkout::Fresh)),
    };
    let (work, checkout) = match checkout {
        Ok(w) => w,
        // The blob store failed: another attempt may work.
        Err(e) if e.kind() == ErrorKind::Unavailable => return Err(e),
        Err(e) if e.is_materialize() => {
            return Ok(not_started(format!(
                "cannot copy the workspace to run in: {e}"
            )))
        }
        Err(e) => return Ok(not_started(e.to_string())),
    };
    let materialized = started.elapsed();
    let bytes = work.bytes();
    let spec = CommandSpec {
        argv,
        env: tool.env.clone(),
        timeout,
        max_output_bytes: usize::try_from(tool.max_output_bytes).unwrap_or(usize::MAX),
        sandbox: SandboxSpec {
            settings: tool.sandbox.clone(),
            writable: Vec::new(),
            exec: Vec::new(),
            layers: None,
        },
    };
    let run = work.run(&cwd, &spec, std::future::pending()).await;
    let compare_started = std::time::Instant::now();
    let changes = match trees {
        // Kept for the next call when the directory is a version of the workspace.
        Some(slot) => {
            let (changes, kept) = work.changes_keeping(MAX_IMPORT_FILE_BYTES).await;
            if let Some(kept) = kept {
                slot.trees.keep(slot.key.clone(), kept);
            }
            changes
        }
        None if matches!(run.outcome, CommandOutcome::SpawnFailed { .. }) => {
            work.remove().await;
            TreeChanges::default()
        }
        None => work.changes(MAX_IMPORT_FILE_BYTES).await,
    };
    tracing::debug!(
        bytes,
        ?checkout,
        materialize_ms = materialized.as_millis() as u64,
        run_ms = run.duration.as_millis() as u64,
        compare_and_remove_ms = compare_started.elapsed().as_millis() as u64,
        files_read = changes.read,
        outcome = ?run.outcome,
        "run_command done"
    );
    let applied = apply_changes(changes, ov, blobs).await?;

    let mut out = match &run.outcome {
        CommandOutcome::Exited { code } => format!("exit code {code}"),
        CommandOutcome::Signalled { signal } => format!("killed by signal {signal}"),
        CommandOutcome::TimedOut => format!(
            "timed out after {} s; the command and everything it started were killed",
            secs(timeout_s)
        ),
        CommandOutcome::Cancelled => "cancelled".to_string(),
        CommandOutcome::SpawnFailed { error } => format!("could not start: {error}"),
    };
    if capped {
        let _ = write!(
            out,
            " (timeout_s {} is over this run's limit; {} s was used)",
            a.timeout_s.map(secs).unwrap_or_default(),
            secs(limit)
        );
    }
    out.push('\n');
    if run.output.trim().is_empty() {
        out.push_str("(no output)\n");
    } else {
        out.push_str(&run.output);
        if !run.output.ends_with('\n') {
            out.push('\n');
        }
    }
    out.push_str(&applied.report());
    Ok(ToolOutcome {
        ok: run.outcome == CommandOutcome::Exited { code: 0 },
        output: out,
    })
}

/// What of a command's changes went into the overlay, for the model.
#[derive(Debug, Default)]
pub(super) struct Applied {
    pub(super) created: Vec<String>,
    pub(super) changed: Vec<String>,
    pub(super) made_executable: Vec<String>,
    pub(super) made_not_executable: Vec<String>,
    pub(super) deleted: Vec<String>,
    pub(super) new_dirs: Vec<String>,
    pub(super) not_imported: Vec<(String, String)>,
}

impl Applied {
    /// The `files:` line, and a `not taken back:` line when something was left out.
    pub(super) fn report(&self) -> String {
        let mut parts = Vec::new();
        for (what, paths) in [
            ("created", &self.created),
            ("changed", &self.changed),
            ("made executable", &self.made_executable),
            ("made not executable", &self.made_not_executable),
            ("deleted", &self.deleted),
            ("new empty directories", &self.new_dirs),
        ] {
            if !paths.is_empty() {
                parts.push(format!(
                    "{what} {}",
                    listed(paths.iter().map(|p| format!("`{p}`")))
                ));
            }
        }
        let mut out = if parts.is_empty() {
            "files: no changes\n".to_string()
        } else {
            format!("files: {}\n", parts.join("; "))
        };
        if !self.not_imported.is_empty() {
            let _ = writeln!(
                out,
                "not taken back (left as they were): {}",
                listed(
                    self.not_imported
                        .iter()
                        .map(|(p, why)| format!("`{p}` ({why})"))
                )
            );
        }
        out
    }
}

/// Items joined by `, `, at most [`MAX_LISTED_PATHS`] of them and a count of the rest.
fn listed(items: impl ExactSizeIterator<Item = String>) -> String {
    let total = items.len();
    let mut shown: Vec<String> = items.take(MAX_LISTED_PATHS).collect();
    if total > MAX_LISTED_PATHS {
        shown.push(format!("and {} more", total - MAX_LISTED_PATHS));
    }
    shown.join(", ")
}

/// Record a command's changes in the overlay, in the order of `changes.ops` (removals
/// first: a path may change from a directory to a file or back), every new blob stored
/// first. A change to a file the overlay has is an `edit`. A change the overlay refuses is
/// reported, not recorded.
async fn apply_changes(
    changes: TreeChanges,
    ov: &mut Overlay,
    blobs: &BlobCache,
) -> Result<Applied, BlobError> {
    use futures::{StreamExt, TryStreamExt};
    futures::stream::iter(changes.blobs)
        .map(|(hash, bytes)| blobs.put_known(hash, bytes))
        .buffer_unordered(BLOB_PUTS_IN_FLIGHT)
        .try_collect::<Vec<()>>()
        .await?;
    let mut applied = Applied {
        not_imported: changes.not_imported,
        ..Applied::default()
    };
    for op in changes.ops {
        let path = op.path().clone();
        let (done, list, shown) = match op {
            ChangeOp::Delete { .. } => (ov.delete(&path), &mut applied.deleted, path.to_string()),
            ChangeOp::Rmdir { .. } => (ov.delete(&path), &mut applied.deleted, format!("{path}/")),
            ChangeOp::Mkdir { .. } => (ov.mkdir(&path), &mut applied.new_dirs, format!("{path}/")),
            ChangeOp::Write { entry, .. } | ChangeOp::Edit { entry, .. } => match ov.file(&path) {
                Err(_) => (
                    ov.write(&path, entry),
                    &mut applied.created,
                    path.to_string(),
                ),
                Ok(before) => {
                    let mode_only =
                        before.hash == entry.hash && !before.is_symlink() && !entry.is_symlink();
                    let list = if !mode_only {
                        &mut applied.changed
                    } else if entry.mode & 0o111 != 0 {
                        &mut applied.made_executable
                    } else {
                        &mut applied.made_not_executable
                    };
                    (ov.edit(&path, entry), list, path.to_string())
                }
            },
        };
        match done {
            Ok(()) => list.push(shown),
            Err(e) => applied.not_imported.push((path.to_string(), e.to_string())),
        }
    }
    Ok(applied)
}

/// Blobs of a command's new files stored at once.
const BLOB_PUTS_IN_FLIGHT: usize = 16;
