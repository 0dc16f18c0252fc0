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
//!   limits) between its start and exec (`spawn`, which copies nothing of the worker);
//!   [`Workdir::run`] gives it the tree, `HOME` and `TMPDIR` as the only writable
//!   directories.
//! - [`Workdir`] puts the three together: a directory with the tree and scratch `HOME` and
//!   `TMPDIR` beside it, the command, the comparison, and the removal (here, with the
//!   removal of a directory a command may have made unwritable) or, for a branch's
//!   `run_command`, the directory kept as the tree it now holds and brought up to date on
//!   the next call ([`Workdir::update`]; `trees`: [`Trees`], which holds them per branch,
//!   bounded by bytes). A kept tree may be layered ([`layered`]): the fork's base shared,
//!   the branch's changes in an overlayfs upper directory, mounted by the command's child.

mod changes;
mod command;
pub mod layered;
mod materialize;
pub mod sandbox;
pub mod setup;
pub(crate) mod spawn;
mod trees;

pub use changes::{tree_changes, TreeChanges};
pub use command::{base_env, run_command, CommandOutcome, CommandRun, CommandSpec};
pub use materialize::{materialize, Make, Materialized};
pub use sandbox::SandboxSpec;
pub use trees::{Checkout, TreeKey, Trees, DEFAULT_TREE_CACHE_BYTES, FINISHED_TTL};

use crate::cache::BlobCache;
use crate::error::WorkerError;
use forkfleet_shared::flush::changes_between;
use forkfleet_shared::manifest::Manifest;
use forkfleet_shared::overlay::ChangeOp;
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
    /// A layered tree ([`layered`]): the fork's base under the upper directory `upper/`
    /// (with overlayfs's `work/` beside it); `ws/` is only where a command's mount goes.
    /// `written` then stamps the upper directory's files only.
    base: Option<std::sync::Arc<layered::Base>>,
}

impl Workdir {
    /// Materialise `tree` in a new temporary directory whose name starts with `prefix`.
    pub async fn create(
        prefix: &str,
        tree: Manifest,
        blobs: &BlobCache,
    ) -> Result<Self, WorkerError> {
        Self::create_in(&std::env::temp_dir(), prefix, tree, blobs).await
    }

    /// Materialise `tree` in a new directory under `parent` whose name starts with
    /// `prefix`.
    pub async fn create_in(
        parent: &Path,
        prefix: &str,
        tree: Manifest,
        blobs: &BlobCache,
    ) -> Result<Self, WorkerError> {
        let root = Scratch::make(parent, prefix, &["ws", "home", "tmp"]).await?;
        let written = materialize(&tree, blobs, &root.0.join("ws"), Make::Write).await?;
        Ok(Self {
            root,
            tree,
            written,
            base: None,
        })
    }

    /// A layered tree holding `target` in a new directory under `parent`: `base` below, an
    /// upper directory with what `target` changes of it above ([`layered`]); with how many
    /// paths that was.
    pub async fn layered(
        parent: &Path,
        prefix: &str,
        base: std::sync::Arc<layered::Base>,
        target: Manifest,
        blobs: &BlobCache,
    ) -> Result<(Self, usize), WorkerError> {
        let dirs = ["ws", "home", "tmp", "upper", "work"];
        let root = Scratch::make(parent, prefix, &dirs).await?;
        let mut work = Self {
            root,
            tree: (*base.tree).clone(),
            written: Materialized {
                skipped: base.skipped.clone(),
                ..Materialized::default()
            },
            base: Some(base),
        };
        let paths = work.update(target, blobs).await.map_err(|(e, _)| e)?;
        Ok((work, paths))
    }

    /// The base it is layered over: which one (its address, the same for every tree over
    /// it) and the bytes it takes on disk (not those linked from the store).
    pub(super) fn base_id(&self) -> Option<(usize, u64)> {
        self.base.as_ref().map(|b| {
            (
                std::sync::Arc::as_ptr(b) as usize,
                b.bytes().saturating_sub(b.linked_bytes()),
            )
        })
    }

    /// True when it is layered over a base linked from the blob store (ADR 31).
    pub(super) fn base_linked(&self) -> bool {
        self.base.as_ref().is_some_and(|b| b.linked())
    }

    /// The bytes this tree holds on disk of its own: all of its files, or for a layered
    /// tree those of its upper directory (the base is shared).
    pub fn own_bytes(&self) -> u64 {
        if self.base.is_some() {
            self.written.stamps.values().map(|(_, e)| e.size).sum()
        } else {
            self.bytes()
        }
    }

    /// What was written.
    pub fn written(&self) -> &Materialized {
        &self.written
    }

    /// The bytes of the files of the tree it holds.
    pub fn bytes(&self) -> u64 {
        self.tree.total_bytes()
    }

    /// Bring the directory from the tree it holds to `target`: only the paths that differ
    /// are removed or written ([`changes_between`]), a file's stamp taken as it is written.
    /// Returns how many paths that was. On an error the directory is in between: remove it.
    pub async fn update(
        &mut self,
        target: Manifest,
        blobs: &BlobCache,
    ) -> Result<usize, (WorkerError, Manifest)> {
        match self.apply(&target, blobs).await {
            Ok(paths) => {
                drop_later(std::mem::replace(&mut self.tree, target));
                self.written.fence = fence(&self.root.0).or(self.written.fence);
                Ok(paths)
            }
            Err(e) => Err((e, target)),
        }
    }

    /// The removals and writes of [`Workdir::update`].
    async fn apply(&mut self, target: &Manifest, blobs: &BlobCache) -> Result<usize, WorkerError> {
        use futures::StreamExt;
        let ops = changes_between(&self.tree, target);
        // Where the change log goes: the tree's directory, or a layered tree's upper one.
        let ws = match &self.base {
            Some(_) => self.root.0.join("upper"),
            None => self.root.0.join("ws"),
        };
        let mut writes = Vec::new();
        let mut removals = Vec::new();
        for op in ops {
            match op {
                ChangeOp::Write { path, entry } | ChangeOp::Edit { path, entry } => {
                    writes.push((path, entry))
                }
                other => removals.push(other),
            }
        }
        let paths = writes.len() + removals.len();
        let base = self.base.clone();
        for op in &removals {
            let path = op.path();
            self.written.stamps.remove(path);
            self.written.skipped.retain(|p| p != path);
            if matches!(op, ChangeOp::Rmdir { .. }) {
                self.written.stamps.retain(|p, _| !p.starts_with(path));
                self.written.skipped.retain(|p| !p.starts_with(path));
            }
        }
        let dir = ws.clone();
        let layered = base
            .clone()
            .map(|b| (b, writes.iter().map(|(p, _)| p.clone()).collect::<Vec<_>>()));
        tokio::task::spawn_blocking(move || match layered {
            Some((base, written)) => layered_prepare(&dir, &base.tree, &removals, &written),
            None => remove_and_make(&dir, &removals),
        })
        .await
        .unwrap_or_else(|e| Err((String::new(), std::io::Error::other(e))))
        .map_err(|(path, source)| WorkerError::WriteFile {
            dir: ws.clone(),
            path,
            source,
        })?;
        let mut wrote = futures::stream::iter(writes.into_iter().map(|(path, entry)| {
            let ws = &ws;
            let base = &base;
            async move {
                let done = match base {
                    Some(base) => layered_write(&path, &entry, blobs, ws, &base.tree).await,
                    None => materialize::replace_one(&path, &entry, blobs, ws).await,
                };
                (path, entry, done)
            }
        }))
        .buffer_unordered(materialize::WRITES_IN_FLIGHT);
        while let Some((path, entry, done)) = wrote.next().await {
            self.written.skipped.retain(|p| p != &path);
            self.written.stamps.remove(&path);
            match done? {
                materialize::Wrote::File { stamp, .. } => {
                    self.written.stamps.insert(path, (stamp, entry));
                }
                materialize::Wrote::Symlink => {}
                materialize::Wrote::Skipped => self.written.skipped.push(path),
            }
        }
        self.written.skipped.sort();
        Ok(paths)
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
        if self.base.is_some() {
            if let Err(e) = layered::reset_work(&self.root.0.join("work")) {
                return CommandRun {
                    outcome: CommandOutcome::SpawnFailed {
                        error: format!("cannot prepare the tree's mount: {e}"),
                    },
                    output: String::new(),
                    truncated_bytes: 0,
                    duration: std::time::Duration::ZERO,
                };
            }
        }
        spec.sandbox.layers = self.base.as_ref().map(|base| layered::Dirs {
            lower: base.dir(),
            upper: self.root.0.join("upper"),
            work: self.root.0.join("work"),
            merged: self.root.0.join("ws"),
        });
        run_command(&cwd.to_os_path(&self.root.0.join("ws")), &spec, cancel).await
    }

    /// What the command did to the tree ([`tree_changes`]); then the directory is removed.
    pub async fn changes(self, max_file_bytes: u64) -> TreeChanges {
        let (changes, kept) = self.changes_keeping(max_file_bytes).await;
        if let Some(kept) = kept {
            kept.remove().await;
        }
        changes
    }

    /// What the command did to the tree ([`tree_changes`]). The directory is kept, as the
    /// tree it now holds, when every path of it was taken back (returned); otherwise it is
    /// removed.
    pub async fn changes_keeping(self, max_file_bytes: u64) -> (TreeChanges, Option<Workdir>) {
        let failed = |e: tokio::task::JoinError| TreeChanges {
            not_imported: vec![(
                ".".to_string(),
                format!("the workspace could not be compared after the command: {e}"),
            )],
            ..TreeChanges::default()
        };
        let compared = tokio::task::spawn_blocking(move || {
            let started = Instant::now();
            let mut changes = match &self.base {
                Some(base) => changes::layered_changes(
                    &self.root.0.join("upper"),
                    &base.tree,
                    &base.skipped,
                    &self.tree,
                    &self.written,
                    max_file_bytes,
                ),
                None => tree_changes(
                    &self.root.0.join("ws"),
                    &self.tree,
                    &self.written,
                    max_file_bytes,
                ),
            };
            let kept = match changes.state.take() {
                Some(state) => {
                    let mut work = self;
                    drop_later((
                        std::mem::replace(&mut work.tree, state.tree),
                        std::mem::replace(&mut work.written.stamps, state.stamps),
                    ));
                    work.written.skipped = state.skipped;
                    work.written.fence = fence(&work.root.0).or(work.written.fence);
                    Some(work)
                }
                None => {
                    let mut work = self;
                    remove_now(&work.root.take());
                    None
                }
            };
            tracing::debug!(
                read = changes.read,
                compare_ms = started.elapsed().as_millis() as u64,
                kept = kept.is_some(),
                "tree compared"
            );
            (changes, kept)
        })
        .await;
        compared.unwrap_or_else(|e| (failed(e), None))
    }

    /// Forget the directory without removing it (it goes with a directory above it).
    pub(crate) fn disown(mut self) {
        self.root.take();
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
    /// A new directory under `parent` whose name starts with `prefix`, with `dirs` in it.
    async fn make(parent: &Path, prefix: &str, dirs: &[&str]) -> Result<Self, WorkerError> {
        let root = tempfile::Builder::new()
            .prefix(prefix)
            .tempdir_in(parent)
            .map_err(WorkerError::TempDir)?;
        let root = Scratch(root.keep());
        for d in dirs {
            tokio::fs::create_dir(root.0.join(d))
                .await
                .map_err(WorkerError::TempDir)?;
        }
        Ok(root)
    }

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
        off_runtime(move || remove_now(&path));
    }
}

/// Run `work` (a removal, a large drop) on the blocking pool when a runtime runs, not on
/// the way of what the caller returns; at once otherwise.
fn off_runtime(work: impl FnOnce() + Send + 'static) {
    match tokio::runtime::Handle::try_current() {
        Ok(rt) => drop(rt.spawn_blocking(work)),
        Err(_) => work(),
    }
}

/// Drop `value` (a tree of a large workspace: thousands of allocations) off the runtime.
fn drop_later<T: Send + 'static>(value: T) {
    off_runtime(move || drop(value));
}

/// The ctime of a file written now in `root` (outside the tree): a stamp taken before has
/// an earlier ctime unless it was taken in the same clock tick, and is then not trusted
/// ([`Materialized::untouched`]). `None` when the file cannot be written.
fn fence(root: &Path) -> Option<(i64, i64)> {
    use std::os::unix::fs::MetadataExt;
    let path = root.join("fence");
    std::fs::write(&path, b"").ok()?;
    let meta = std::fs::metadata(&path).ok()?;
    Some((meta.ctime(), meta.ctime_nsec()))
}

/// Apply removals and new empty directories of a change log to `dir` (blocking): deletes
/// (a missing file is no error: a symlink that was not created), removed directories
/// (made writable first when needed), new directories. `Err`: the path and the error.
fn remove_and_make(dir: &Path, ops: &[ChangeOp]) -> Result<(), (String, std::io::Error)> {
    for op in ops {
        let path = op.path();
        let full = path.to_os_path(dir);
        let done = match op {
            ChangeOp::Delete { .. } => match std::fs::remove_file(&full) {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
                other => other,
            },
            ChangeOp::Rmdir { .. } => std::fs::remove_dir_all(&full).or_else(|_| {
                make_writable(&full);
                std::fs::remove_dir_all(&full)
            }),
            ChangeOp::Mkdir { .. } => std::fs::create_dir_all(&full),
            _ => Ok(()),
        };
        done.map_err(|e| (path.to_string(), e))?;
    }
    Ok(())
}

/// Prepare the upper directory `upper` of a layered tree (blocking) for a change log from
/// the tree it holds: removals (a whiteout where the base would show through), new
/// directories, and for each write its directory made and what is at its path removed.
/// `Err`: the path and the error.
fn layered_prepare(
    upper: &Path,
    base: &Manifest,
    removals: &[ChangeOp],
    writes: &[WsPath],
) -> Result<(), (String, std::io::Error)> {
    for op in removals {
        let path = op.path();
        let done = match op {
            ChangeOp::Delete { .. } | ChangeOp::Rmdir { .. } => {
                remove_upper(upper, path).and_then(|()| {
                    if layered::base_shows(upper, base, path) {
                        upper_dir(upper, &path.parent().unwrap_or_default())?;
                        layered::whiteout(&path.to_os_path(upper))
                    } else {
                        Ok(())
                    }
                })
            }
            ChangeOp::Mkdir { .. } => upper_dir(upper, path),
            _ => Ok(()),
        };
        done.map_err(|e| (path.to_string(), e))?;
    }
    for path in writes {
        upper_dir(upper, &path.parent().unwrap_or_default())
            .and_then(|()| remove_upper(upper, path))
            .map_err(|e| (path.to_string(), e))?;
    }
    Ok(())
}

/// Remove what the upper directory has at `path` (nothing there is no error).
fn remove_upper(upper: &Path, path: &WsPath) -> std::io::Result<()> {
    let full = path.to_os_path(upper);
    match std::fs::symlink_metadata(&full) {
        Ok(m) if m.is_dir() => std::fs::remove_dir_all(&full).or_else(|_| {
            make_writable(&full);
            std::fs::remove_dir_all(&full)
        }),
        Ok(_) => std::fs::remove_file(&full),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

/// Make `dir` a directory in the upper directory, with every directory above it: one that
/// is missing is made (it merges with the base's, if any); in place of a whiteout or a
/// file, an opaque one (the base's entries there stay hidden).
fn upper_dir(upper: &Path, dir: &WsPath) -> std::io::Result<()> {
    let mut chain = Vec::new();
    let mut at = Some(dir.clone());
    while let Some(a) = at {
        if a.is_root() {
            break;
        }
        at = a.parent();
        chain.push(a);
    }
    for a in chain.into_iter().rev() {
        let full = a.to_os_path(upper);
        match std::fs::symlink_metadata(&full) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => {
                std::fs::remove_file(&full)?;
                std::fs::create_dir(&full)?;
                layered::set_opaque(&full)?;
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => std::fs::create_dir(&full)?,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Write one file (or symlink) into a layered tree's upper directory, prepared by
/// [`layered_prepare`]; a symlink leaving the tree is not made, and a whiteout hides what
/// the base has at its path.
async fn layered_write(
    path: &WsPath,
    entry: &forkfleet_shared::manifest::FileEntry,
    blobs: &BlobCache,
    upper: &Path,
    base: &Manifest,
) -> Result<materialize::Wrote, WorkerError> {
    let wrote = materialize::write_one(path, entry, blobs, upper).await?;
    if matches!(wrote, materialize::Wrote::Skipped) && layered::base_shows(upper, base, path) {
        layered::whiteout(&path.to_os_path(upper)).map_err(|source| WorkerError::WriteFile {
            dir: upper.to_path_buf(),
            path: path.to_string(),
            source,
        })?;
    }
    Ok(wrote)
}

/// Remove a command's temporary directory (blocking). A command may have left directories
/// without write permission: they are made writable and it is tried again.
fn remove_now(path: &Path) {
    match std::fs::remove_dir_all(path) {
        Ok(()) => return,
        // Gone with a directory above it (a base when its worker's trees went).
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return,
        Err(_) => {}
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
