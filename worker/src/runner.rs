//! Running a command against a branch's tree: for the test command of a resolve (issue 5)
//! and for the agent's `run_command` tool (`crate::tools`), both through a [`Workdir`].
//!
//! - [`materialize`](fn@materialize) (in `materialize`) writes a tree (a snapshot
//!   manifest, or a branch overlay's view of it) into a directory: every file from its
//!   blob, executable bits from the mode, empty directories; a symlink is recreated only
//!   when its target stays inside the tree.
//! - [`run_command`] (in `command`) runs an argv there, without a shell, in a process
//!   group of its own, with the environment cleared to [`base_env`] plus what the caller
//!   passes (no secret of the worker's leaks in by default), its output (stdout and stderr
//!   together, in arrival order) kept up to a limit (head and tail), and a timeout: on
//!   timeout or cancellation the whole process group is killed, and so are stragglers a
//!   command leaves behind.
//! - [`tree_changes`] (in `changes`) compares a materialised directory, after a command ran
//!   in it, with the tree it was materialised from, as the change log between the two
//!   ([`forkfleet_shared::flush::changes_between`]), and says what cannot be taken back (a
//!   symlink leaving the tree, a file over the size limit, a fifo, an unreadable entry).
//! - [`sandbox`] confines the command (Landlock filesystem and network rules, resource
//!   limits) between fork and exec; [`Workdir::run`] gives it the tree, `HOME` and `TMPDIR`
//!   as the only writable directories.
//! - [`Workdir`] puts the three together: a fresh temporary directory with the tree and
//!   scratch `HOME` and `TMPDIR` beside it, the command, the comparison, the removal
//!   (here, with the removal of a directory a command may have made unwritable).

mod changes;
mod command;
mod materialize;
pub mod sandbox;

pub use changes::{tree_changes, TreeChanges};
pub use command::{base_env, run_command, CommandOutcome, CommandRun, CommandSpec};
pub use materialize::{materialize, Materialized};
pub use sandbox::SandboxSpec;

use crate::cache::BlobCache;
use crate::error::WorkerError;
use forkfleet_shared::manifest::Manifest;
use forkfleet_shared::path::WsPath;
use std::collections::BTreeMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::Instant;

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
        let mut spec = CommandSpec {
            env,
            ..spec.clone()
        };
        // The command writes only in its tree and its scratch HOME and TMPDIR.
        spec.sandbox.writable = ["ws", "home", "tmp"]
            .iter()
            .map(|d| self.root.0.join(d))
            .collect();
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
mod tests;
