//! The materialised fork directory: every branch's version of what a fork touched, as real
//! files, for people and their diff tools (`docs/FORKDIR.md`).
//!
//! ```text
//! <workspace>/.forkfleet/forks/<fork id>/
//! ├── manifest.json      the fork, its branches (state, cost, turns, what each touched)
//! │                      and every touched path (parent file, per branch operation)
//! ├── parent/            every touched path as it was at fork time
//! └── branches/<label>/  the same paths as each branch has them: a path the branch
//!                        deleted is absent, one it did not touch is the parent's version
//! ```
//!
//! Everything comes from the coordinator's API ([`CoordinatorClient`]: the fork view, the
//! diff report, blob contents), so it works embedded and against a cluster. A sync
//! ([`Materializer`]) is incremental and idempotent: a file is written only when its
//! content differs, an entry no longer part of the view is removed, `manifest.json` is
//! replaced atomically. [`follow`] keeps the directory in step while a fork runs (at most
//! one sync per [`LIVE_SYNC_EVERY`], and a final one); [`remove_after_merge`] deletes it
//! once the fork is merged unless the plan says `keep_artifacts`; [`open`] syncs it and
//! launches a diff tool on it.
//!
//! **Confinement.** Nothing is written outside the fork directory, whatever a coordinator
//! sends: a branch label that is not a plain name (see [`branch_dir_name`]) is replaced by
//! an encoded one, every path component is checked ([`check_component`], [`confined`]),
//! the directories from the workspace down to the fork directory must be real directories
//! (never followed through a symbolic link), inside the fork directory anything standing
//! where a directory belongs is removed rather than followed, and symbolic links in a
//! branch are written as plain files holding their target.

use crate::remote::CoordinatorClient;
use crate::render::{self, Until};
use crate::BadInput;
use anyhow::Context;
use bytes::Bytes;
use forkfleet_shared::api::ForkView;
use forkfleet_shared::blob::{self, BlobHash, BlobStore};
use forkfleet_shared::diff::{
    BranchChange, DiffOptions, DiffReport, FileInfo, Operation, PathDiff,
};
use forkfleet_shared::ids::ForkId;
use forkfleet_shared::manifest::MODE_EXEC;
use forkfleet_shared::path::WsPath;
use forkfleet_shared::spec;
use serde::Serialize;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::ffi::{OsStr, OsString};
use std::fmt::Write as _;
use std::io::{self, IsTerminal};
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// The directory under a workspace that holds the fork directories.
pub const FORKS_DIR: [&str; 2] = [".forkfleet", "forks"];
/// The fork directory's description of itself.
pub const MANIFEST_FILE: &str = "manifest.json";
/// The fork-time versions of the touched paths.
pub const PARENT_DIR: &str = "parent";
/// One directory per branch under it.
pub const BRANCHES_DIR: &str = "branches";
/// The diff tool template of `forkfleet fork open`.
pub const DIFFTOOL_ENV: &str = "FORKFLEET_DIFFTOOL";
/// The most often [`follow`] syncs while a fork runs.
pub const LIVE_SYNC_EVERY: Duration = Duration::from_secs(1);
/// The version of `manifest.json`'s layout.
pub const MANIFEST_FORMAT: u32 = 1;
/// The longest a file name may be (most file systems: 255 bytes).
const MAX_NAME_BYTES: usize = 255;
/// Temporary files (a write in progress) start with this.
const TMP_PREFIX: &str = ".ff-tmp-";
/// A temporary file younger than this may be another process's write in progress.
const TMP_GRACE: Duration = Duration::from_secs(60);
/// The most editor tabs `fork open` opens at once without a PATH (VS Code).
pub const MAX_PAIRS: usize = 16;
/// The most touched paths an error message lists.
const MAX_LISTED: usize = 20;

// ---- names and paths -----------------------------------------------------------------

/// A name that cannot be an entry of the fork directory.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{name}` cannot name an entry of the fork directory: {reason}")]
pub struct UnsafeName {
    pub name: String,
    pub reason: &'static str,
}

/// Check that `name` is exactly one normal path component: not empty, not `.` or `..`,
/// no `/` or `\`, no NUL or control character, at most 255 bytes (and on Windows no `:`).
/// Joined to a directory, such a name stays inside it.
pub fn check_component(name: &str) -> Result<(), UnsafeName> {
    let bad = |reason| {
        Err(UnsafeName {
            name: name.to_string(),
            reason,
        })
    };
    if name.is_empty() {
        return bad("it is empty");
    }
    if name == "." || name == ".." {
        return bad("it names a directory itself or its parent");
    }
    if name.contains(['/', '\\']) {
        return bad("it contains a path separator");
    }
    if name.chars().any(char::is_control) {
        return bad("it contains a NUL or control character");
    }
    if cfg!(windows) && name.contains(':') {
        return bad("it contains `:`");
    }
    if name.len() > MAX_NAME_BYTES {
        return bad("it is longer than 255 bytes");
    }
    let mut parts = Path::new(name).components();
    match (parts.next(), parts.next()) {
        (Some(Component::Normal(_)), None) => Ok(()),
        _ => bad("it is not a plain file name"),
    }
}

/// `root` joined with the `/`-separated relative path `rel`, every component checked by
/// [`check_component`]: the result is always strictly inside `root`.
pub fn confined(root: &Path, rel: &str) -> Result<PathBuf, UnsafeName> {
    let mut out = root.to_path_buf();
    for part in rel.split('/') {
        check_component(part).map_err(|e| UnsafeName {
            name: rel.to_string(),
            reason: e.reason,
        })?;
        out.push(part);
    }
    Ok(out)
}

/// The directory name of a branch under `branches/`: the label itself when it is a valid
/// spec label and a plain name, else `~` and 16 hex digits of its SHA-256 (a valid label
/// never contains `~`, so the two never collide). `manifest.json` maps labels to
/// directories.
pub fn branch_dir_name(label: &str) -> String {
    if spec::check_label(label).is_ok() && check_component(label).is_ok() {
        label.to_string()
    } else {
        let hex = BlobHash::of(label.as_bytes()).to_hex();
        format!("~{}", hex.get(..16).unwrap_or(&hex))
    }
}

/// The fork directory of `fork` under `workspace`: `<workspace>/.forkfleet/forks/<id>`.
pub fn fork_dir(workspace: &Path, fork: ForkId) -> Result<PathBuf, UnsafeName> {
    let id = fork.to_string();
    check_component(&id)?;
    let mut dir = workspace.to_path_buf();
    for part in FORKS_DIR {
        dir.push(part);
    }
    dir.push(id);
    Ok(dir)
}

/// The workspace of `view` on this machine and its fork directory: an error when the
/// fork has no workspace or it is not a directory here.
fn locate(view: &ForkView) -> anyhow::Result<(PathBuf, PathBuf)> {
    let Some(ws) = view.workspace.as_deref() else {
        anyhow::bail!(
            "fork {} has no workspace directory (its creator did not say where it is), so it has no fork directory",
            view.fork_id
        );
    };
    let ws = PathBuf::from(ws);
    if !ws.is_dir() {
        anyhow::bail!(
            "the fork's workspace `{}` is not a directory on this machine",
            ws.display()
        );
    }
    let dir = fork_dir(&ws, view.fork_id)?;
    Ok((ws, dir))
}

/// Create the directories from `workspace` down to `dir` (`.forkfleet/forks/<id>`),
/// refusing to go through anything that is not a real directory.
fn prepare_root(workspace: &Path, dir: &Path) -> anyhow::Result<()> {
    let rel = dir
        .strip_prefix(workspace)
        .context("the fork directory is not under its workspace")?;
    let mut cur = workspace.to_path_buf();
    for part in rel.components() {
        let Component::Normal(name) = part else {
            anyhow::bail!("`{}` is not a plain path", rel.display());
        };
        cur.push(name);
        match std::fs::symlink_metadata(&cur) {
            Ok(m) if m.is_dir() => {}
            Ok(m) if m.file_type().is_symlink() => anyhow::bail!(
                "`{}` is a symbolic link; the fork directory is never written through one",
                cur.display()
            ),
            Ok(_) => anyhow::bail!("`{}` is in the way: it is not a directory", cur.display()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => match std::fs::create_dir(&cur) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists && cur.is_dir() => {}
                Err(e) => {
                    return Err(e).with_context(|| format!("cannot create `{}`", cur.display()))
                }
            },
            Err(e) => return Err(e).with_context(|| format!("cannot read `{}`", cur.display())),
        }
    }
    Ok(())
}

// ---- the layout a view and a report ask for ------------------------------------------

/// One branch's directory and what the manifest says about it.
#[derive(Debug, Clone, Serialize)]
struct BranchDoc {
    label: String,
    /// Relative to the fork directory: `branches/<name>`.
    dir: String,
    state: String,
    error: Option<String>,
    cost_usd: f64,
    turns: u32,
    /// Entries in the branch's change log.
    changes: usize,
    created: Vec<String>,
    modified: Vec<String>,
    deleted: Vec<String>,
}

/// What one branch did to one path.
#[derive(Debug, Clone, Serialize)]
struct TouchDoc {
    operation: Operation,
    /// The file it ended with; none when deleted.
    file: Option<FileInfo>,
}

#[derive(Debug, Clone, Serialize)]
struct PathDoc {
    path: String,
    agreement: String,
    /// The fork-time file; none when the path did not exist.
    parent: Option<FileInfo>,
    /// Per label, the branches that touched the path (the others have the parent's).
    branches: BTreeMap<String, TouchDoc>,
}

#[derive(Debug, Clone, Serialize)]
struct SkippedDoc {
    what: String,
    reason: String,
}

#[derive(Debug, Clone, Serialize)]
struct ManifestDoc {
    format: u32,
    fork_id: String,
    goal: String,
    state: String,
    winner: Option<String>,
    workspace: Option<String>,
    keep_artifacts: bool,
    parent_dir: &'static str,
    branches: Vec<BranchDoc>,
    paths: Vec<PathDoc>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    skipped: Vec<SkippedDoc>,
}

/// The files a fork directory must hold (relative paths), the directories that must exist
/// even when empty, and the manifest.
#[derive(Debug)]
struct Layout {
    files: BTreeMap<PathBuf, FileInfo>,
    trees: Vec<PathBuf>,
    manifest: ManifestDoc,
    /// Per branch index of the report: its directory name.
    dirs: Vec<String>,
}

fn layout(view: &ForkView, report: &DiffReport) -> Layout {
    let mut skipped = Vec::new();
    // Branch directories: unique names, in report order.
    let mut used = HashSet::new();
    let mut dirs = Vec::with_capacity(report.branches.len());
    for label in &report.branches {
        let base = branch_dir_name(label);
        let mut name = base.clone();
        let mut n = 1;
        while !used.insert(name.clone()) {
            n += 1;
            name = format!("{base}~{n}");
        }
        if name != *label {
            let why = if base == *label {
                "another branch has the same label"
            } else {
                "not a plain name"
            };
            skipped.push(SkippedDoc {
                what: format!("label `{}`", label.escape_debug()),
                reason: format!("{why}: its directory is `{BRANCHES_DIR}/{name}`"),
            });
        }
        dirs.push(name);
    }
    let mut branches: Vec<BranchDoc> = report
        .branches
        .iter()
        .zip(&dirs)
        .enumerate()
        .map(|(i, (label, dir))| {
            let bv = view
                .branches
                .get(i)
                .filter(|b| b.label == *label)
                .or_else(|| view.branch(label));
            BranchDoc {
                label: label.clone(),
                dir: format!("{BRANCHES_DIR}/{dir}"),
                state: bv.map(|b| b.state.as_str().to_string()).unwrap_or_default(),
                error: bv.and_then(|b| b.error.clone()),
                cost_usd: bv.map(|b| b.cost_usd).unwrap_or(0.0),
                turns: bv.map(|b| b.turns).unwrap_or(0),
                changes: bv.map(|b| b.changes).unwrap_or(0),
                created: Vec::new(),
                modified: Vec::new(),
                deleted: Vec::new(),
            }
        })
        .collect();
    let mut files = BTreeMap::new();
    let mut paths = Vec::with_capacity(report.paths.len());
    for p in &report.paths {
        let rel = p.path.as_str();
        if let Err(e) = confined(Path::new(""), rel) {
            skipped.push(SkippedDoc {
                what: format!("path `{}`", rel.escape_debug()),
                reason: e.reason.to_string(),
            });
            continue;
        }
        let mut touched = BTreeMap::new();
        for c in &p.changes {
            let Some(doc) = branches.get_mut(c.branch as usize) else {
                continue;
            };
            match c.operation {
                Operation::Created => doc.created.push(rel.to_string()),
                Operation::Modified => doc.modified.push(rel.to_string()),
                Operation::Deleted => doc.deleted.push(rel.to_string()),
                Operation::Untouched => {}
            }
            touched.insert(
                doc.label.clone(),
                TouchDoc {
                    operation: c.operation,
                    file: c.entry,
                },
            );
        }
        if let Some(parent) = p.parent {
            files.insert(Path::new(PARENT_DIR).join(rel), parent);
        }
        for (i, name) in dirs.iter().enumerate() {
            let entry = match u32::try_from(i).ok().and_then(|i| p.change(i)) {
                Some(c) => c.entry,
                None => p.parent,
            };
            if let Some(entry) = entry {
                files.insert(Path::new(BRANCHES_DIR).join(name).join(rel), entry);
            }
        }
        paths.push(PathDoc {
            path: rel.to_string(),
            agreement: p.agreement.as_str().to_string(),
            parent: p.parent,
            branches: touched,
        });
    }
    // A file cannot also be a directory of another file (only a malformed report says so).
    let clashes: Vec<PathBuf> = files
        .keys()
        .filter(|k| {
            files
                .range::<PathBuf, _>((std::ops::Bound::Excluded(*k), std::ops::Bound::Unbounded))
                .next()
                .is_some_and(|(next, _)| next.starts_with(k))
        })
        .cloned()
        .collect();
    for k in clashes {
        files.remove(&k);
        skipped.push(SkippedDoc {
            what: format!("file `{}`", k.display()),
            reason: "another touched path needs it to be a directory".to_string(),
        });
    }
    let mut trees = vec![PathBuf::from(PARENT_DIR), PathBuf::from(BRANCHES_DIR)];
    trees.extend(dirs.iter().map(|d| Path::new(BRANCHES_DIR).join(d)));
    let winner = match &view.state {
        forkfleet_shared::state::ForkState::Merged { winner } => Some(winner.clone()),
        _ => None,
    };
    Layout {
        files,
        trees,
        dirs,
        manifest: ManifestDoc {
            format: MANIFEST_FORMAT,
            fork_id: view.fork_id.to_string(),
            goal: view.goal.clone(),
            state: view.state.as_str().to_string(),
            winner,
            workspace: view.workspace.clone(),
            keep_artifacts: view.keep_artifacts,
            parent_dir: PARENT_DIR,
            branches,
            paths,
            skipped,
        },
    }
}

// ---- the disk side -------------------------------------------------------------------

/// What one sync did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct SyncStats {
    /// The fork directory.
    pub dir: PathBuf,
    /// Files written (new or changed content).
    pub written: usize,
    /// Files already as they should be.
    pub unchanged: usize,
    /// Entries removed (no longer part of the view).
    pub removed: usize,
    /// `manifest.json` was (re)written.
    pub manifest_written: bool,
    pub branches: usize,
    /// Touched paths mirrored.
    pub paths: usize,
    /// Labels encoded and paths left out (see `skipped` in `manifest.json`).
    pub skipped: usize,
}

/// A file the materializer wrote or read, by its stat: when size and modification time are
/// unchanged, its hash is not computed again.
#[derive(Debug, Clone, Copy)]
struct Known {
    hash: BlobHash,
    size: u64,
    modified: Option<SystemTime>,
}

/// Syncs one fork directory, remembering what it wrote between syncs (a live sync reads
/// no file twice unless it changed on disk). A fresh one works too: it hashes what it
/// finds, those files of the expected size only.
#[derive(Debug, Default)]
pub struct Materializer {
    dir: Option<PathBuf>,
    known: HashMap<PathBuf, Known>,
}

/// What to do to reach a layout.
#[derive(Debug, Default)]
struct Plan {
    write: Vec<(PathBuf, FileInfo)>,
    remove: Vec<PathBuf>,
    /// Directories found on disk that no longer hold any part of the layout, deepest first
    /// (removed when empty once the files are written and removed).
    prune: Vec<PathBuf>,
    unchanged: usize,
}

/// A fork after a sync: the report it was built from.
#[derive(Debug, Clone)]
struct Synced {
    report: DiffReport,
    stats: SyncStats,
    /// Per branch index of the report: its directory name under `branches/`.
    dirs: Vec<String>,
}

impl Materializer {
    pub fn new() -> Self {
        Self::default()
    }

    /// Read the diff report of `view`'s fork from the coordinator and mirror both into the
    /// fork directory under the view's workspace; with `unified`, the report keeps the
    /// coordinator's unified diff texts.
    async fn sync(
        &mut self,
        coord: &CoordinatorClient,
        view: &ForkView,
        unified: bool,
    ) -> anyhow::Result<Synced> {
        let (workspace, dir) = locate(view)?;
        let report = coord
            .diff(
                view.fork_id,
                DiffOptions {
                    paths: None,
                    unified,
                    ..DiffOptions::default()
                },
            )
            .await?;
        prepare_root(&workspace, &dir)?;
        let (stats, dirs) = self
            .write_layout(&dir, view, &report, coord.blobs().as_ref())
            .await?;
        Ok(Synced {
            report,
            stats,
            dirs,
        })
    }

    /// Mirror `view` and `report` into `dir` (which must exist), with contents from
    /// `blobs`. Idempotent: a second call with the same input writes nothing.
    pub async fn write(
        &mut self,
        dir: &Path,
        view: &ForkView,
        report: &DiffReport,
        blobs: &dyn BlobStore,
    ) -> anyhow::Result<SyncStats> {
        self.write_layout(dir, view, report, blobs)
            .await
            .map(|(stats, _)| stats)
    }

    async fn write_layout(
        &mut self,
        dir: &Path,
        view: &ForkView,
        report: &DiffReport,
        blobs: &dyn BlobStore,
    ) -> anyhow::Result<(SyncStats, Vec<String>)> {
        if self.dir.as_deref() != Some(dir) {
            self.known.clear();
            self.dir = Some(dir.to_path_buf());
        }
        let layout = Arc::new(layout(view, report));
        let root = dir.to_path_buf();
        let known = std::mem::take(&mut self.known);
        let (plan, known) = {
            let layout = layout.clone();
            let root = root.clone();
            tokio::task::spawn_blocking(move || {
                let mut known = known;
                let plan = plan_sync(&root, &layout, &mut known);
                (plan, known)
            })
            .await?
        };
        self.known = known;
        let plan = plan?;
        let mut contents: HashMap<BlobHash, Bytes> = HashMap::new();
        for (_, info) in &plan.write {
            if let std::collections::hash_map::Entry::Vacant(slot) = contents.entry(info.hash) {
                let bytes = blob::fetch(blobs, &info.hash).await.with_context(|| {
                    format!("reading blob {} for the fork directory", info.hash)
                })?;
                slot.insert(bytes);
            }
        }
        let known = std::mem::take(&mut self.known);
        let (result, known) = {
            let layout = layout.clone();
            tokio::task::spawn_blocking(move || {
                let mut known = known;
                let r = apply_sync(&root, &layout, plan, &contents, &mut known);
                (r, known)
            })
            .await?
        };
        self.known = known;
        let mut stats = result?;
        stats.branches = layout.manifest.branches.len();
        stats.paths = layout.manifest.paths.len();
        stats.skipped = layout.manifest.skipped.len();
        Ok((stats, layout.dirs.clone()))
    }
}

/// Mirror `view` and `report` into `dir` (created if missing), contents from `blobs`: the
/// writer behind a sync, for callers that have the view and report already.
pub async fn materialize(
    dir: &Path,
    view: &ForkView,
    report: &DiffReport,
    blobs: &dyn BlobStore,
) -> anyhow::Result<SyncStats> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create `{}`", dir.display()))?;
    Materializer::new().write(dir, view, report, blobs).await
}

/// What is on disk under the trees: non-directories by relative path (a symbolic link
/// counts as a non-regular file), and every directory.
#[derive(Debug, Default)]
struct OnDisk {
    files: BTreeMap<PathBuf, Option<std::fs::Metadata>>,
    dirs: Vec<PathBuf>,
}

fn scan_trees(root: &Path) -> io::Result<OnDisk> {
    let mut out = OnDisk::default();
    for top in [PARENT_DIR, BRANCHES_DIR] {
        scan_into(root, Path::new(top), &mut out)?;
    }
    Ok(out)
}

fn scan_into(root: &Path, rel: &Path, out: &mut OnDisk) -> io::Result<()> {
    let meta = match std::fs::symlink_metadata(root.join(rel)) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    if !meta.is_dir() {
        let regular = meta.is_file();
        out.files.insert(rel.to_path_buf(), regular.then_some(meta));
        return Ok(());
    }
    out.dirs.push(rel.to_path_buf());
    for entry in std::fs::read_dir(root.join(rel))? {
        let entry = entry?;
        scan_into(root, &rel.join(entry.file_name()), out)?;
    }
    Ok(())
}

fn plan_sync(
    root: &Path,
    layout: &Layout,
    known: &mut HashMap<PathBuf, Known>,
) -> anyhow::Result<Plan> {
    let disk = scan_trees(root)
        .with_context(|| format!("cannot read the fork directory `{}`", root.display()))?;
    known.retain(|rel, _| layout.files.contains_key(rel));
    let mut plan = Plan::default();
    for (rel, meta) in &disk.files {
        if !layout.files.contains_key(rel) {
            // Another process's write in progress (two watchers of one fork) is left alone.
            let fresh_tmp = rel
                .file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with(TMP_PREFIX))
                && meta
                    .as_ref()
                    .and_then(|m| m.modified().ok())
                    .and_then(|t| t.elapsed().ok())
                    .is_some_and(|age| age < TMP_GRACE);
            if !fresh_tmp {
                plan.remove.push(rel.clone());
            }
        }
    }
    for (rel, want) in &layout.files {
        let same = match disk.files.get(rel) {
            Some(Some(meta)) => {
                mode_matches(meta, want.mode)
                    && current_hash(root, rel, meta, want.size, known) == Some(want.hash)
            }
            _ => false,
        };
        if same {
            plan.unchanged += 1;
        } else {
            plan.write.push((rel.clone(), *want));
        }
    }
    // The directories the layout needs are the trees and the files' directories; the
    // scan's other directories will be empty once the plan is applied.
    let mut needed: HashSet<&Path> = layout.trees.iter().map(PathBuf::as_path).collect();
    for rel in layout.files.keys() {
        needed.extend(rel.ancestors().skip(1));
    }
    plan.prune = disk
        .dirs
        .into_iter()
        .filter(|d| !needed.contains(d.as_path()))
        .collect();
    plan.prune
        .sort_by_key(|d| std::cmp::Reverse(d.components().count()));
    Ok(plan)
}

/// The hash of the regular file at `rel`: from `known` when its stat did not change, else
/// read and hashed. `None` when it cannot be read, or when its size is not `want_size`
/// (its content differs: no need to read it).
fn current_hash(
    root: &Path,
    rel: &Path,
    meta: &std::fs::Metadata,
    want_size: u64,
    known: &mut HashMap<PathBuf, Known>,
) -> Option<BlobHash> {
    let modified = meta.modified().ok();
    if let Some(k) = known.get(rel) {
        if k.size == meta.len() && k.modified == modified && modified.is_some() {
            return Some(k.hash);
        }
    }
    if meta.len() != want_size {
        return None;
    }
    let bytes = std::fs::read(root.join(rel)).ok()?;
    let hash = BlobHash::of(&bytes);
    known.insert(
        rel.to_path_buf(),
        Known {
            hash,
            size: meta.len(),
            modified,
        },
    );
    Some(hash)
}

#[cfg(unix)]
fn mode_matches(meta: &std::fs::Metadata, mode: u32) -> bool {
    use std::os::unix::fs::PermissionsExt;
    let exec = meta.permissions().mode() & 0o111 != 0;
    exec == (mode == MODE_EXEC)
}

#[cfg(not(unix))]
fn mode_matches(_meta: &std::fs::Metadata, _mode: u32) -> bool {
    true
}

#[cfg(unix)]
fn set_mode(file: &std::fs::File, mode: u32) -> io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let bits = if mode == MODE_EXEC { 0o755 } else { 0o644 };
    file.set_permissions(std::fs::Permissions::from_mode(bits))
}

#[cfg(not(unix))]
fn set_mode(_file: &std::fs::File, _mode: u32) -> io::Result<()> {
    Ok(())
}

fn apply_sync(
    root: &Path,
    layout: &Layout,
    plan: Plan,
    contents: &HashMap<BlobHash, Bytes>,
    known: &mut HashMap<PathBuf, Known>,
) -> anyhow::Result<SyncStats> {
    let mut stats = SyncStats {
        dir: root.to_path_buf(),
        unchanged: plan.unchanged,
        ..SyncStats::default()
    };
    let mut failures: Vec<String> = Vec::new();
    for rel in &plan.remove {
        match std::fs::remove_file(root.join(rel)) {
            Ok(()) => stats.removed += 1,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => failures.push(format!("removing `{}`: {e}", rel.display())),
        }
    }
    for (rel, info) in &plan.write {
        let Some(bytes) = contents.get(&info.hash) else {
            failures.push(format!("`{}`: its content was not fetched", rel.display()));
            continue;
        };
        match write_file(root, rel, bytes, info.mode) {
            Ok(meta) => {
                stats.written += 1;
                known.insert(
                    rel.clone(),
                    Known {
                        hash: info.hash,
                        size: meta.len(),
                        modified: meta.modified().ok(),
                    },
                );
            }
            Err(e) => {
                known.remove(rel);
                failures.push(format!("writing `{}`: {e}", rel.display()));
            }
        }
    }
    for d in &plan.prune {
        // Fails (and is left) when not empty: another process's write in progress.
        let _ = std::fs::remove_dir(root.join(d));
    }
    for tree in &layout.trees {
        if let Err(e) = ensure_dirs(root, tree) {
            failures.push(format!("creating `{}`: {e}", tree.display()));
        }
    }
    let mut doc = serde_json::to_vec_pretty(&layout.manifest)?;
    doc.push(b'\n');
    let path = root.join(MANIFEST_FILE);
    let same = std::fs::read(&path).is_ok_and(|old| old == doc);
    if !same {
        write_atomic(root, Path::new(MANIFEST_FILE), &doc, 0o644)
            .with_context(|| format!("cannot write `{}`", path.display()))?;
        stats.manifest_written = true;
    }
    if !failures.is_empty() {
        let more = failures.len().saturating_sub(3);
        failures.truncate(3);
        anyhow::bail!(
            "the fork directory `{}` is incomplete: {}{}",
            root.display(),
            failures.join("; "),
            if more > 0 {
                format!(" (and {more} more)")
            } else {
                String::new()
            }
        );
    }
    Ok(stats)
}

/// Make every directory of `rel` (relative to `root`) a real directory: whatever else
/// stands there (a file, a symbolic link) is removed first, never followed.
fn ensure_dirs(root: &Path, rel: &Path) -> io::Result<()> {
    let mut cur = root.to_path_buf();
    for part in rel.components() {
        let Component::Normal(name) = part else {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("`{}` is not a plain relative path", rel.display()),
            ));
        };
        cur.push(name);
        match std::fs::symlink_metadata(&cur) {
            Ok(m) if m.is_dir() => continue,
            Ok(_) => std::fs::remove_file(&cur)?,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        match std::fs::create_dir(&cur) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                // Another sync made it meanwhile; it must be a directory now.
                if !std::fs::symlink_metadata(&cur)?.is_dir() {
                    return Err(e);
                }
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

static TMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// Write `bytes` at `rel` under `root` atomically (a temporary file beside it, renamed
/// over it), its directories made real first. Returns the new file's metadata.
fn write_file(root: &Path, rel: &Path, bytes: &[u8], mode: u32) -> io::Result<std::fs::Metadata> {
    if let Some(parent) = rel.parent() {
        ensure_dirs(root, parent)?;
    }
    let target = root.join(rel);
    if let Ok(m) = std::fs::symlink_metadata(&target) {
        if m.is_dir() {
            std::fs::remove_dir_all(&target)?;
        }
    }
    write_atomic(root, rel, bytes, mode)?;
    std::fs::symlink_metadata(&target)
}

fn write_atomic(root: &Path, rel: &Path, bytes: &[u8], mode: u32) -> io::Result<()> {
    use std::io::Write as _;
    let target = root.join(rel);
    let dir = target.parent().unwrap_or(root);
    let tmp = dir.join(format!(
        "{TMP_PREFIX}{}-{}",
        std::process::id(),
        TMP_COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let written = (|| {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)?;
        f.write_all(bytes)?;
        set_mode(&f, mode)?;
        drop(f);
        std::fs::rename(&tmp, &target)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

// ---- after a merge -------------------------------------------------------------------

/// What [`remove_after_merge`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cleanup {
    /// The fork directory was removed (with `.forkfleet/forks` and `.forkfleet` when they
    /// were left empty).
    Removed(PathBuf),
    /// `keep_artifacts` is set: the directory stays.
    Kept(PathBuf),
    /// There was nothing to remove (no workspace, or no directory).
    Absent,
}

/// Remove the fork directory of a fork that has been **merged**, unless its plan says
/// `keep_artifacts`.
///
/// Contract, for every path that merges (`fork merge`, `run --pick`, an automatic merge
/// by the resolve path):
/// - call it only after the merge has committed in the coordinator (and after any live
///   sync of the fork has finished: a sync running afterwards would recreate the
///   directory); `view` may be read before or after the merge, only its `fork_id`,
///   `workspace` and `keep_artifacts` are used;
/// - it touches nothing but `<workspace>/.forkfleet/forks/<fork id>/` (never following a
///   symbolic link) and then removes `.forkfleet/forks/` and `.forkfleet/` only if they
///   are empty;
/// - it is idempotent: a second call (or a fork without a workspace, or a workspace not
///   on this machine) answers [`Cleanup::Absent`];
/// - an error means the directory could not be removed; the merge itself stands, so
///   callers report it as a warning ([`cleanup_after_merge`] does) and never fail the
///   merge for it.
pub fn remove_after_merge(view: &ForkView) -> anyhow::Result<Cleanup> {
    let Some(ws) = view.workspace.as_deref() else {
        return Ok(Cleanup::Absent);
    };
    let ws = Path::new(ws);
    let dir = fork_dir(ws, view.fork_id)?;
    if view.keep_artifacts {
        return Ok(if dir.is_dir() {
            Cleanup::Kept(dir)
        } else {
            Cleanup::Absent
        });
    }
    // Never through a link: every directory from the workspace down must be real.
    let id = view.fork_id.to_string();
    let mut cur = ws.to_path_buf();
    let mut chain = Vec::new();
    for part in FORKS_DIR
        .iter()
        .copied()
        .chain(std::iter::once(id.as_str()))
    {
        cur.push(part);
        match std::fs::symlink_metadata(&cur) {
            Ok(m) if m.is_dir() => chain.push(cur.clone()),
            Ok(m) if m.file_type().is_symlink() => anyhow::bail!(
                "`{}` is a symbolic link; not removing the fork directory through it",
                cur.display()
            ),
            _ => return Ok(Cleanup::Absent),
        }
    }
    std::fs::remove_dir_all(&dir)
        .with_context(|| format!("cannot remove the fork directory `{}`", dir.display()))?;
    // `.forkfleet/forks`, then `.forkfleet`: only when empty (a data dir keeps its files).
    chain.pop();
    for d in chain.iter().rev() {
        if std::fs::remove_dir(d).is_err() {
            break;
        }
    }
    Ok(Cleanup::Removed(dir))
}

/// After a merge of `fork` committed: [`remove_after_merge`] with the fork's view, any
/// error printed as a warning on stderr (the merge stands either way).
pub async fn cleanup_after_merge(coord: &CoordinatorClient, fork: ForkId) -> Option<Cleanup> {
    let result = match coord.fork(fork).await {
        Ok(view) => remove_after_merge(&view),
        Err(e) => Err(e.into()),
    };
    match result {
        Ok(c) => Some(c),
        Err(e) => {
            eprintln!("warning: the fork directory was not removed: {e:#}");
            None
        }
    }
}

// ---- live updates --------------------------------------------------------------------

/// Prints a warning, but not the same one twice in a row.
#[derive(Debug, Default)]
struct Warner {
    last: Option<String>,
}

impl Warner {
    fn warn(&mut self, e: &anyhow::Error) {
        let msg = format!("{e:#}");
        if self.last.as_deref() != Some(msg.as_str()) {
            eprintln!("warning: the fork directory is not up to date: {msg}");
            self.last = Some(msg);
        }
    }
}

/// What [`LiveSync`] tells its task.
#[derive(Debug, Clone)]
struct Signal {
    /// Versions of the fork notified so far.
    changes: u64,
    /// The latest of them.
    view: ForkView,
    closing: bool,
}

struct LiveInner {
    tx: watch::Sender<Signal>,
    task: JoinHandle<Option<SyncStats>>,
}

/// Keeps a fork directory in step with a running fork: [`LiveSync::notify`] with each new
/// version of the fork; a background task syncs at most once per [`LIVE_SYNC_EVERY`]
/// (versions in between are folded into one sync); [`LiveSync::finish`] makes the final
/// sync. Errors are warnings on stderr (each once), never failures.
pub struct LiveSync {
    inner: Option<LiveInner>,
}

impl LiveSync {
    /// Start for `view`'s fork. A fork without a workspace on this machine gets a disabled
    /// one (with a warning when it has a workspace that is not here).
    pub fn start(coord: &CoordinatorClient, view: &ForkView) -> Self {
        match (&view.workspace, locate(view)) {
            (None, _) => return Self { inner: None },
            (Some(_), Err(e)) => {
                eprintln!("warning: no fork directory: {e:#}");
                return Self { inner: None };
            }
            (Some(_), Ok(_)) => {}
        }
        let (tx, rx) = watch::channel(Signal {
            changes: 0,
            view: view.clone(),
            closing: false,
        });
        let task = tokio::spawn(live_loop(coord.clone(), rx, LIVE_SYNC_EVERY));
        Self {
            inner: Some(LiveInner { tx, task }),
        }
    }

    /// The fork changed to `view`: sync soon. Returns at once.
    pub fn notify(&self, view: &ForkView) {
        if let Some(inner) = &self.inner {
            inner.tx.send_modify(|s| {
                s.changes += 1;
                s.view = view.clone();
            });
        }
    }

    /// Sync the latest version at once unless the last sync had it, stop the background
    /// task, and answer the last sync's stats (none when it failed).
    pub async fn finish(self) -> Option<SyncStats> {
        let inner = self.inner?;
        inner.tx.send_modify(|s| s.closing = true);
        inner.task.await.ok().flatten()
    }
}

/// The task of a [`LiveSync`]: syncs the view notified last (the view is not read again),
/// at most once per `every`; once closing, syncs a last time when the latest version is
/// not synced (or its sync failed). Answers the last sync's stats.
async fn live_loop(
    coord: CoordinatorClient,
    mut rx: watch::Receiver<Signal>,
    every: Duration,
) -> Option<SyncStats> {
    let mut mat = Materializer::new();
    let mut warner = Warner::default();
    // The version synced last, and its outcome.
    let mut done = 0u64;
    let mut synced: Option<SyncStats> = None;
    let mut last: Option<tokio::time::Instant> = None;
    loop {
        let (changes, closing) = {
            let s = rx.borrow_and_update();
            (s.changes, s.closing)
        };
        let pending = changes != done || (closing && synced.is_none());
        if !pending {
            if closing || rx.changed().await.is_err() {
                return synced;
            }
            continue;
        }
        if let (false, Some(at)) = (closing, last) {
            let due = at + every;
            if tokio::time::Instant::now() < due {
                tokio::select! {
                    _ = tokio::time::sleep_until(due) => {}
                    r = rx.changed() => {
                        if r.is_err() {
                            return synced;
                        }
                        continue;
                    }
                }
            }
        }
        let (changes, view) = {
            let s = rx.borrow_and_update();
            (s.changes, s.view.clone())
        };
        done = changes;
        synced = match mat.sync(&coord, &view, false).await {
            Ok(s) => Some(s.stats),
            Err(e) => {
                warner.warn(&e);
                None
            }
        };
        if closing {
            return synced;
        }
        last = Some(tokio::time::Instant::now());
    }
}

/// [`render::follow`], keeping the fork directory in step as the fork changes: from the
/// first view `follow` sees, at most once per [`LIVE_SYNC_EVERY`], and once more at the
/// end unless the last sync had the latest view.
pub async fn follow(
    coord: &CoordinatorClient,
    fork: ForkId,
    timeout: Option<Duration>,
    until: Until,
    show: bool,
) -> anyhow::Result<ForkView> {
    let mut live: Option<LiveSync> = None;
    let result = render::follow_with(coord, fork, timeout, until, show, &mut |view| {
        live.get_or_insert_with(|| LiveSync::start(coord, view))
            .notify(view);
    })
    .await;
    let stats = match live {
        Some(live) => live.finish().await,
        None => None,
    };
    if let (true, Some(stats)) = (show, stats) {
        eprintln!(
            "fork directory: {} (`forkfleet fork open` opens it in a diff tool)",
            stats.dir.display()
        );
    }
    result
}

// ---- forkfleet fork open -------------------------------------------------------------

/// When the terminal diff is coloured.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum ColorChoice {
    /// When stdout is a terminal and `NO_COLOR` is not set.
    #[default]
    Auto,
    Always,
    Never,
}

/// The diff tool `fork open` uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Tool {
    /// `FORKFLEET_DIFFTOOL`, split into words.
    Custom(Vec<String>),
    /// `pycharm`, `pycharm.sh` or `charm` on PATH: one 3-way diff.
    PyCharm(PathBuf),
    /// `code` on PATH: one `code --diff` per pair.
    VsCode(PathBuf),
    /// A unified diff printed here.
    Terminal,
}

impl Tool {
    pub fn name(&self) -> &'static str {
        match self {
            Tool::Custom(_) => "custom",
            Tool::PyCharm(_) => "pycharm",
            Tool::VsCode(_) => "vscode",
            Tool::Terminal => "terminal",
        }
    }
}

/// Pick the diff tool: `difftool` (the `FORKFLEET_DIFFTOOL` value) when set and not
/// blank, else PyCharm, else VS Code found on `path_var` (a `PATH` value), else the
/// terminal. A template that does not split into words is bad input.
pub fn detect(difftool: Option<&OsStr>, path_var: Option<&OsStr>) -> Result<Tool, BadInput> {
    if let Some(t) = difftool {
        let t = t
            .to_str()
            .ok_or_else(|| BadInput(format!("{DIFFTOOL_ENV} is not valid UTF-8")))?;
        if !t.trim().is_empty() {
            let words =
                spec::split_words(t).map_err(|e| BadInput(format!("{DIFFTOOL_ENV} `{t}`: {e}")))?;
            return Ok(Tool::Custom(words));
        }
    }
    for name in ["pycharm", "pycharm.sh", "charm"] {
        if let Some(p) = find_on_path(name, path_var) {
            return Ok(Tool::PyCharm(p));
        }
    }
    if let Some(p) = find_on_path("code", path_var) {
        return Ok(Tool::VsCode(p));
    }
    Ok(Tool::Terminal)
}

/// The executable `name` in a directory of `path_var` (empty entries, the current
/// directory, are skipped).
pub fn find_on_path(name: &str, path_var: Option<&OsStr>) -> Option<PathBuf> {
    let path_var = path_var?;
    for dir in std::env::split_paths(path_var) {
        if dir.as_os_str().is_empty() {
            continue;
        }
        let candidates: &[&str] = if cfg!(windows) {
            &["", ".exe", ".cmd", ".bat"]
        } else {
            &[""]
        };
        for ext in candidates {
            let p = dir.join(format!("{name}{ext}"));
            if is_executable(&p) {
                return Some(p);
            }
        }
    }
    None
}

#[cfg(unix)]
fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

#[cfg(not(unix))]
fn is_executable(p: &Path) -> bool {
    p.is_file()
}

/// One file of the parent against one branch's (absent: `None`).
#[derive(Debug, Clone)]
struct Pair {
    label: String,
    /// The branch's file relative to the fork directory, for display.
    shown: String,
    path: String,
    parent: Option<PathBuf>,
    branch: Option<PathBuf>,
    /// The coordinator's unified diff of the two (when the report was asked for them).
    diff: Option<Arc<str>>,
}

/// What `fork open` compares: the parent (a directory, or the parent's file at PATH) and
/// each branch that changed something (at PATH), plus file pairs.
#[derive(Debug, Clone)]
struct Targets {
    parent: PathBuf,
    /// (label, directory or file; `None` for a file the branch deleted)
    branches: Vec<(String, Option<PathBuf>)>,
    pairs: Vec<Pair>,
}

/// The null device, standing for a file that does not exist (git difftool's convention).
fn null_device() -> PathBuf {
    PathBuf::from(if cfg!(windows) { "NUL" } else { "/dev/null" })
}

fn touched_list(report: &DiffReport) -> String {
    if report.paths.is_empty() {
        return "the fork touched no path".to_string();
    }
    let list: Vec<&str> = report
        .paths
        .iter()
        .take(MAX_LISTED)
        .map(|p| p.path.as_str())
        .collect();
    let more = report.paths.len().saturating_sub(MAX_LISTED);
    let more = if more > 0 {
        format!(" and {more} more")
    } else {
        String::new()
    };
    format!("touched paths: {}{more}", list.join(", "))
}

fn targets(dir: &Path, synced: &Synced, path: Option<&WsPath>) -> anyhow::Result<Targets> {
    let report = &synced.report;
    let branch_root = |i: usize| -> Option<PathBuf> {
        synced.dirs.get(i).map(|d| dir.join(BRANCHES_DIR).join(d))
    };
    let shown = |i: usize, rel: &str| {
        let name = synced.dirs.get(i).map(String::as_str).unwrap_or("?");
        format!("{BRANCHES_DIR}/{name}/{rel}")
    };
    // A touched path as a relative file path; `None` for one the layout left out.
    let rel_path = |rel: &str| confined(Path::new(""), rel).ok();
    let pair = |i: usize, label: &str, pd: &PathDiff, local: &Path, c: &BranchChange| Pair {
        label: label.to_string(),
        shown: shown(i, pd.path.as_str()),
        path: pd.path.as_str().to_string(),
        parent: pd.parent.map(|_| dir.join(PARENT_DIR).join(local)),
        branch: c
            .entry
            .and_then(|_| branch_root(i))
            .map(|root| root.join(local)),
        diff: c.diff.clone(),
    };
    match path {
        Some(p) => {
            let Some(pd) = report.path(p) else {
                return Err(BadInput(format!(
                    "the fork did not touch `{p}`; {}",
                    touched_list(report)
                ))
                .into());
            };
            let local = rel_path(pd.path.as_str())
                .context("the path cannot be mirrored in the fork directory")?;
            let pairs: Vec<Pair> = pd
                .changes
                .iter()
                .map(|c| pair(c.branch as usize, report.label(c.branch), pd, &local, c))
                .collect();
            Ok(Targets {
                parent: pd
                    .parent
                    .map(|_| dir.join(PARENT_DIR).join(&local))
                    .unwrap_or_else(null_device),
                branches: pairs
                    .iter()
                    .map(|p| (p.label.clone(), p.branch.clone()))
                    .collect(),
                pairs,
            })
        }
        None => {
            let mut branches = Vec::new();
            let mut pairs = Vec::new();
            for (i, label) in report.branches.iter().enumerate() {
                let (Some(root), Ok(bi)) = (branch_root(i), u32::try_from(i)) else {
                    continue;
                };
                let before = pairs.len();
                for pd in &report.paths {
                    if let (Some(c), Some(local)) = (pd.change(bi), rel_path(pd.path.as_str())) {
                        pairs.push(pair(i, label, pd, &local, c));
                    }
                }
                if pairs.len() > before {
                    branches.push((label.clone(), Some(root)));
                }
            }
            Ok(Targets {
                parent: dir.join(PARENT_DIR),
                branches,
                pairs,
            })
        }
    }
}

/// The commands that open `targets` with `tool`, and notes about what was left out.
fn commands(tool: &Tool, t: &Targets) -> (Vec<Vec<OsString>>, Vec<String>) {
    let or_null = |p: &Option<PathBuf>| p.clone().unwrap_or_else(null_device);
    let mut notes = Vec::new();
    let cmds = match tool {
        Tool::Terminal => Vec::new(),
        Tool::Custom(words) => {
            let has = |ph: &str| words.iter().any(|w| w.contains(ph));
            let mut words = words.clone();
            if !has("{parent}") && !has("{branches}") {
                words.push("{parent}".to_string());
                words.push("{branches}".to_string());
            }
            let parent = t.parent.as_os_str().to_string_lossy().into_owned();
            let mut argv: Vec<OsString> = Vec::new();
            for w in &words {
                if w == "{parent}" {
                    argv.push(t.parent.clone().into_os_string());
                } else if w == "{branches}" {
                    argv.extend(t.branches.iter().map(|(_, p)| or_null(p).into_os_string()));
                } else if w.contains("{branches}") {
                    for (_, p) in &t.branches {
                        let b = or_null(p).to_string_lossy().into_owned();
                        argv.push(
                            w.replace("{parent}", &parent)
                                .replace("{branches}", &b)
                                .into(),
                        );
                    }
                } else {
                    argv.push(w.replace("{parent}", &parent).into());
                }
            }
            vec![argv]
        }
        Tool::PyCharm(exe) => {
            let mut argv: Vec<OsString> = vec![exe.clone().into_os_string(), "diff".into()];
            let parent = t.parent.clone().into_os_string();
            match t.branches.as_slice() {
                [] => {}
                [(_, a)] => {
                    argv.push(parent);
                    argv.push(or_null(a).into_os_string());
                }
                [(la, a), (lb, b), rest @ ..] => {
                    // 3-way: the base in the middle.
                    argv.push(or_null(a).into_os_string());
                    argv.push(parent);
                    argv.push(or_null(b).into_os_string());
                    if !rest.is_empty() {
                        let others: Vec<&str> = rest.iter().map(|(l, _)| l.as_str()).collect();
                        notes.push(format!(
                            "PyCharm compares three at a time: {la} and {lb} against the parent; not shown: {}",
                            others.join(", ")
                        ));
                    }
                }
            }
            if t.branches.is_empty() {
                Vec::new()
            } else {
                vec![argv]
            }
        }
        Tool::VsCode(exe) => {
            let mut cmds = Vec::new();
            for pair in t.pairs.iter().take(MAX_PAIRS) {
                cmds.push(vec![
                    exe.clone().into_os_string(),
                    "--diff".into(),
                    or_null(&pair.parent).into_os_string(),
                    or_null(&pair.branch).into_os_string(),
                ]);
            }
            if t.pairs.len() > MAX_PAIRS {
                notes.push(format!(
                    "{} more pairs not opened; name a path: forkfleet fork open FORK PATH",
                    t.pairs.len() - MAX_PAIRS
                ));
            }
            cmds
        }
    };
    (cmds, notes)
}

/// A command line as a shell would read it back.
fn shell_line(argv: &[OsString]) -> String {
    argv.iter()
        .map(|a| {
            let s = a.to_string_lossy();
            let plain = !s.is_empty()
                && s.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_./=:,+@%{}~".contains(c));
            if plain {
                s.into_owned()
            } else {
                format!("'{}'", s.replace('\'', r"'\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// ANSI styles of the terminal diff.
struct Style {
    on: bool,
}

impl Style {
    fn paint(&self, code: &str, text: &str) -> String {
        if self.on {
            format!("\x1b[{code}m{text}\x1b[0m")
        } else {
            text.to_string()
        }
    }
}

/// The unified diff of every pair, parent first (`a`: the parent, `b`: the branch): the
/// coordinator's text (as `forkfleet diff` shows it), its `a/PATH` and `b/PATH` headers
/// replaced by the files in the fork directory.
fn terminal_diff(pairs: &[Pair], color: bool) -> String {
    let style = Style { on: color };
    let mut out = String::new();
    for pair in pairs {
        let parent_shown = format!("{PARENT_DIR}/{}", pair.path);
        let (a, b, what) = match (&pair.parent, &pair.branch) {
            (None, _) => (
                "/dev/null".to_string(),
                pair.shown.clone(),
                format!(" (created by {})", pair.label),
            ),
            (_, None) => (
                parent_shown.clone(),
                "/dev/null".to_string(),
                format!(" (deleted by {})", pair.label),
            ),
            _ => (parent_shown.clone(), pair.shown.clone(), String::new()),
        };
        let _ = writeln!(
            out,
            "{}",
            style.paint("1", &format!("diff {parent_shown} {}{what}", pair.shown))
        );
        let text = pair.diff.as_deref().unwrap_or("[no diff text]\n");
        // A text diff starts with its `---` and `+++` lines; a binary one is a placeholder.
        let body = if text.starts_with("--- ") {
            let _ = writeln!(out, "{}", style.paint("1", &format!("--- {a}")));
            let _ = writeln!(out, "{}", style.paint("1", &format!("+++ {b}")));
            text.splitn(3, '\n').nth(2).unwrap_or("")
        } else {
            text
        };
        for line in body.lines() {
            let painted = if line.starts_with("@@") {
                style.paint("36", line)
            } else if line.starts_with('+') {
                style.paint("32", line)
            } else if line.starts_with('-') {
                style.paint("31", line)
            } else {
                line.to_string()
            };
            let _ = writeln!(out, "{painted}");
        }
        out.push('\n');
    }
    out
}

/// What `fork open` did.
#[derive(Debug, Clone, Serialize)]
pub struct Opened {
    pub fork_id: String,
    pub dir: PathBuf,
    pub tool: &'static str,
    /// The command lines launched, each as its words.
    pub commands: Vec<Vec<String>>,
    pub notes: Vec<String>,
    /// The terminal diff (uncoloured), when that was the tool.
    pub diff: Option<String>,
    pub sync: SyncStats,
}

/// `forkfleet fork open FORK [PATH]`: sync the fork directory, then open it with the
/// diff tool [`detect`] picks from the environment (each launched tool is waited for) or
/// print the diff. Prints what it launched; with `json`, one document instead.
pub async fn open(
    coord: &CoordinatorClient,
    fork: ForkId,
    path: Option<&str>,
    color: ColorChoice,
    json: bool,
) -> anyhow::Result<()> {
    let path = path
        .map(|p| WsPath::parse_file(p).map_err(|e| BadInput(format!("PATH: {e}"))))
        .transpose()?;
    let tool = detect(
        std::env::var_os(DIFFTOOL_ENV).as_deref(),
        std::env::var_os("PATH").as_deref(),
    )?;
    // The terminal prints the coordinator's diff texts: the report carries them.
    let view = coord.fork(fork).await?;
    let synced = Materializer::new()
        .sync(coord, &view, tool == Tool::Terminal)
        .await?;
    let dir = synced.stats.dir.clone();
    let t = targets(&dir, &synced, path.as_ref())?;
    let (cmds, notes) = commands(&tool, &t);
    let mut opened = Opened {
        fork_id: fork.to_string(),
        dir: dir.clone(),
        tool: tool.name(),
        commands: cmds
            .iter()
            .map(|c| c.iter().map(|w| w.to_string_lossy().into_owned()).collect())
            .collect(),
        notes,
        diff: None,
        sync: synced.stats.clone(),
    };
    if t.branches.is_empty() {
        if json {
            println!("{}", serde_json::to_string_pretty(&opened)?);
        } else {
            println!("no branch changed anything: nothing to compare");
        }
        return Ok(());
    }
    if !json {
        let s = &synced.stats;
        eprintln!(
            "fork directory: {} ({} written, {} removed, {} unchanged)",
            dir.display(),
            s.written,
            s.removed,
            s.unchanged
        );
        for n in &opened.notes {
            eprintln!("note: {n}");
        }
    }
    if tool == Tool::Terminal {
        if json {
            opened.diff = Some(terminal_diff(&t.pairs, false));
            println!("{}", serde_json::to_string_pretty(&opened)?);
        } else {
            let on = match color {
                ColorChoice::Always => true,
                ColorChoice::Never => false,
                ColorChoice::Auto => {
                    io::stdout().is_terminal() && std::env::var_os("NO_COLOR").is_none()
                }
            };
            print!("{}", terminal_diff(&t.pairs, on));
        }
        return Ok(());
    }
    let mut failed = Vec::new();
    for argv in &cmds {
        let Some((program, args)) = argv.split_first() else {
            continue;
        };
        if !json {
            println!("launched: {}", shell_line(argv));
        }
        let mut cmd = tokio::process::Command::new(program);
        cmd.args(args).stdin(std::process::Stdio::inherit());
        if json {
            cmd.stdout(std::process::Stdio::null());
        }
        match cmd.status().await {
            Ok(status) if status.success() => {}
            Ok(status) => failed.push(format!("`{}` exited with {status}", shell_line(argv))),
            Err(e) => failed.push(format!("cannot run `{}`: {e}", shell_line(argv))),
        }
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&opened)?);
    }
    if !failed.is_empty() {
        anyhow::bail!("{}", failed.join("; "));
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn components_that_could_escape_are_refused() {
        for bad in [
            "", ".", "..", "../x", "a/b", "a\\b", "\\", "/", "/etc", "a\0b", "a\nb",
        ] {
            assert!(check_component(bad).is_err(), "{bad:?} must be refused");
        }
        assert!(check_component(&"x".repeat(256)).is_err());
        for good in [
            "a",
            "approach_a",
            "x.y",
            "-dash",
            ".hidden",
            "..dots",
            "ünï",
        ] {
            assert!(check_component(good).is_ok(), "{good:?} must be accepted");
        }
    }

    #[test]
    fn confined_paths_stay_under_the_root() {
        let root = Path::new("/tmp/fork");
        assert_eq!(
            confined(root, "a/b.txt").unwrap(),
            PathBuf::from("/tmp/fork/a/b.txt")
        );
        for bad in ["", "../x", "a/../../x", "/abs", "a//b", "a/./b", "a\\..\\x"] {
            assert!(confined(root, bad).is_err(), "{bad:?} must be refused");
        }
    }

    #[test]
    fn hostile_labels_get_an_encoded_directory_name() {
        assert_eq!(branch_dir_name("approach_a"), "approach_a");
        for bad in [
            "../../x", "..", ".", "", "a/b", "a\\b", "~x", "a b", ".hidden",
        ] {
            let name = branch_dir_name(bad);
            assert!(name.starts_with('~'), "{bad:?} -> {name}");
            assert_eq!(name.len(), 17, "{bad:?} -> {name}");
            check_component(&name).unwrap();
        }
        assert_ne!(branch_dir_name("../../x"), branch_dir_name("../../y"));
    }

    #[test]
    fn fork_ids_make_one_component() {
        let id = ForkId::new();
        let dir = fork_dir(Path::new("/ws"), id).unwrap();
        assert_eq!(dir, Path::new("/ws/.forkfleet/forks").join(id.to_string()));
    }

    #[test]
    fn detect_prefers_the_template_then_pycharm_then_code() {
        let bin = tempfile::tempdir().unwrap();
        let path = bin.path().as_os_str().to_owned();
        assert_eq!(detect(None, Some(&path)).unwrap(), Tool::Terminal);
        assert_eq!(detect(None, None).unwrap(), Tool::Terminal);
        make_exe(&bin.path().join("code"));
        assert_eq!(
            detect(None, Some(&path)).unwrap(),
            Tool::VsCode(bin.path().join("code"))
        );
        make_exe(&bin.path().join("charm"));
        assert_eq!(
            detect(None, Some(&path)).unwrap(),
            Tool::PyCharm(bin.path().join("charm"))
        );
        assert_eq!(
            detect(Some(OsStr::new("meld '{parent}' {branches}")), Some(&path)).unwrap(),
            Tool::Custom(vec!["meld".into(), "{parent}".into(), "{branches}".into()])
        );
        assert_eq!(
            detect(Some(OsStr::new("  ")), Some(&path)).unwrap(),
            Tool::PyCharm(bin.path().join("charm"))
        );
        assert!(detect(Some(OsStr::new("meld \"open")), None).is_err());
    }

    fn make_exe(p: &Path) {
        std::fs::write(p, "#!/bin/sh\n").unwrap();
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
    }

    fn targets_of(n: usize) -> Targets {
        Targets {
            parent: PathBuf::from("/f/parent"),
            branches: (0..n)
                .map(|i| {
                    (
                        format!("b{i}"),
                        Some(PathBuf::from(format!("/f/branches/b{i}"))),
                    )
                })
                .collect(),
            pairs: (0..n)
                .map(|i| Pair {
                    label: format!("b{i}"),
                    shown: format!("branches/b{i}/x"),
                    path: "x".into(),
                    parent: None,
                    branch: Some(PathBuf::from(format!("/f/branches/b{i}/x"))),
                    diff: None,
                })
                .collect(),
        }
    }

    fn words(cmds: &[Vec<OsString>]) -> Vec<Vec<String>> {
        cmds.iter()
            .map(|c| c.iter().map(|w| w.to_string_lossy().into_owned()).collect())
            .collect()
    }

    #[test]
    fn commands_follow_each_tools_convention() {
        let t = targets_of(3);
        let (c, notes) = commands(&Tool::PyCharm(PathBuf::from("charm")), &t);
        assert_eq!(
            words(&c),
            vec![vec![
                "charm",
                "diff",
                "/f/branches/b0",
                "/f/parent",
                "/f/branches/b1"
            ]]
        );
        assert!(notes[0].contains("b2"), "{notes:?}");
        let (c, _) = commands(&Tool::PyCharm(PathBuf::from("charm")), &targets_of(1));
        assert_eq!(
            words(&c),
            vec![vec!["charm", "diff", "/f/parent", "/f/branches/b0"]]
        );
        let (c, _) = commands(&Tool::VsCode(PathBuf::from("code")), &targets_of(2));
        assert_eq!(
            words(&c),
            vec![
                vec!["code", "--diff", "/dev/null", "/f/branches/b0/x"],
                vec!["code", "--diff", "/dev/null", "/f/branches/b1/x"],
            ]
        );
        let tool = Tool::Custom(vec![
            "tool".into(),
            "--base={parent}".into(),
            "{branches}".into(),
            "--each={branches}".into(),
        ]);
        let (c, _) = commands(&tool, &targets_of(2));
        assert_eq!(
            words(&c),
            vec![vec![
                "tool",
                "--base=/f/parent",
                "/f/branches/b0",
                "/f/branches/b1",
                "--each=/f/branches/b0",
                "--each=/f/branches/b1",
            ]]
        );
        let (c, _) = commands(&Tool::Custom(vec!["t".into()]), &targets_of(1));
        assert_eq!(words(&c), vec![vec!["t", "/f/parent", "/f/branches/b0"]]);
    }

    #[test]
    fn the_terminal_diff_names_the_files_of_the_fork_directory() {
        let pair = |parent: bool, branch: bool, diff: &str| Pair {
            label: "b0".into(),
            shown: "branches/b0/x".into(),
            path: "x".into(),
            parent: parent.then(|| PathBuf::from("/f/parent/x")),
            branch: branch.then(|| PathBuf::from("/f/branches/b0/x")),
            diff: Some(Arc::from(diff)),
        };
        let pairs = [
            pair(true, true, "--- a/x\n+++ b/x\n@@ -1 +1 @@\n-old\n+new\n"),
            pair(true, false, "--- a/x\n+++ /dev/null\n@@ -1 +0,0 @@\n-old\n"),
            pair(false, true, "[binary · 3 bytes · sha256:abc]"),
        ];
        assert_eq!(
            terminal_diff(&pairs, false),
            "diff parent/x branches/b0/x\n--- parent/x\n+++ branches/b0/x\n@@ -1 +1 @@\n-old\n+new\n\n\
             diff parent/x branches/b0/x (deleted by b0)\n--- parent/x\n+++ /dev/null\n@@ -1 +0,0 @@\n-old\n\n\
             diff parent/x branches/b0/x (created by b0)\n[binary · 3 bytes · sha256:abc]\n\n"
        );
        let coloured = terminal_diff(&pairs[..1], true);
        assert!(
            coloured.contains("\x1b[1m--- parent/x\x1b[0m\n"),
            "{coloured}"
        );
        assert!(
            coloured.contains("\x1b[36m@@ -1 +1 @@\x1b[0m\n"),
            "{coloured}"
        );
        assert!(coloured.contains("\x1b[31m-old\x1b[0m\n"), "{coloured}");
        assert!(coloured.contains("\x1b[32m+new\x1b[0m\n"), "{coloured}");
    }

    #[test]
    fn shell_lines_quote_what_needs_it() {
        let argv: Vec<OsString> = vec!["code".into(), "--diff".into(), "a b".into(), "it's".into()];
        assert_eq!(shell_line(&argv), r"code --diff 'a b' 'it'\''s'");
    }
}
