//! The disk side: syncing a fork directory to a layout, incrementally and atomically.

use super::*;

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
pub(crate) struct Known {
    pub(crate) hash: BlobHash,
    pub(crate) size: u64,
    pub(crate) modified: Option<SystemTime>,
}

/// Syncs one fork directory, remembering what it wrote between syncs (a live sync reads
/// no file twice unless it changed on disk). A fresh one works too: it hashes what it
/// finds, those files of the expected size only.
#[derive(Debug, Default)]
pub struct Materializer {
    pub(crate) dir: Option<PathBuf>,
    pub(crate) known: HashMap<PathBuf, Known>,
}

/// What to do to reach a layout.
#[derive(Debug, Default)]
pub(crate) struct Plan {
    pub(crate) write: Vec<(PathBuf, FileInfo)>,
    pub(crate) remove: Vec<PathBuf>,
    /// Directories found on disk that no longer hold any part of the layout, deepest first
    /// (removed when empty once the files are written and removed).
    pub(crate) prune: Vec<PathBuf>,
    pub(crate) unchanged: usize,
}

/// A fork after a sync: the report it was built from.
#[derive(Debug, Clone)]
pub(crate) struct Synced {
    pub(crate) report: DiffReport,
    pub(crate) stats: SyncStats,
    /// Per branch index of the report: its directory name under `branches/`.
    pub(crate) dirs: Vec<String>,
}

impl Materializer {
    pub fn new() -> Self {
        Self::default()
    }

    /// Read the diff report of `view`'s fork from the coordinator and mirror both into the
    /// fork directory under the view's workspace; with `unified`, the report keeps the
    /// coordinator's unified diff texts.
    pub(crate) async fn sync(
        &mut self,
        coord: &Client,
        view: &ForkView,
        unified: bool,
    ) -> Result<Synced, ClientError> {
        if let Some(winner) = removed_after_merge(view) {
            return Err(ClientError::ForkDirRemoved {
                fork: view.fork_id,
                winner: winner.to_string(),
                reach: coord.reach().to_string(),
            });
        }
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
    ) -> Result<SyncStats, ClientError> {
        self.write_layout(dir, view, report, blobs)
            .await
            .map(|(stats, _)| stats)
    }

    pub(crate) async fn write_layout(
        &mut self,
        dir: &Path,
        view: &ForkView,
        report: &DiffReport,
        blobs: &dyn BlobStore,
    ) -> Result<(SyncStats, Vec<String>), ClientError> {
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
                let bytes = blob::fetch(blobs, &info.hash).await.map_err(|e| {
                    ClientError::blob(
                        format!("reading blob {} for the fork directory", info.hash),
                        e,
                    )
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
) -> Result<SyncStats, ClientError> {
    std::fs::create_dir_all(dir).map_err(|e| ClientError::io("create", dir, e))?;
    Materializer::new().write(dir, view, report, blobs).await
}

/// What is on disk under the trees: non-directories by relative path (a symbolic link
/// counts as a non-regular file), and every directory.
#[derive(Debug, Default)]
pub(crate) struct OnDisk {
    pub(crate) files: BTreeMap<PathBuf, Option<std::fs::Metadata>>,
    pub(crate) dirs: Vec<PathBuf>,
}

pub(crate) fn scan_trees(root: &Path) -> io::Result<OnDisk> {
    let mut out = OnDisk::default();
    for top in [PARENT_DIR, BRANCHES_DIR] {
        scan_into(root, Path::new(top), &mut out)?;
    }
    Ok(out)
}

pub(crate) fn scan_into(root: &Path, rel: &Path, out: &mut OnDisk) -> io::Result<()> {
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

pub(crate) fn plan_sync(
    root: &Path,
    layout: &Layout,
    known: &mut HashMap<PathBuf, Known>,
) -> Result<Plan, ClientError> {
    let disk = scan_trees(root).map_err(|e| ClientError::io("read the fork directory", root, e))?;
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
pub(crate) fn current_hash(
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
pub(crate) fn mode_matches(meta: &std::fs::Metadata, mode: u32) -> bool {
    use std::os::unix::fs::PermissionsExt;
    let exec = meta.permissions().mode() & 0o111 != 0;
    exec == (mode == MODE_EXEC)
}

#[cfg(not(unix))]
pub(crate) fn mode_matches(_meta: &std::fs::Metadata, _mode: u32) -> bool {
    true
}

/// A mirror file's permissions: read-only (`0444`, `0555` for an executable), so an edit
/// made in the fork directory, which the next sync would replace, is refused instead of
/// silently lost. Syncs replace files by renaming, which a read-only file does not stop.
#[cfg(unix)]
pub(crate) fn set_mode(file: &std::fs::File, mode: u32) -> io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let bits = if mode == MODE_EXEC { 0o555 } else { 0o444 };
    file.set_permissions(std::fs::Permissions::from_mode(bits))
}

#[cfg(not(unix))]
pub(crate) fn set_mode(_file: &std::fs::File, _mode: u32) -> io::Result<()> {
    Ok(())
}

pub(crate) fn apply_sync(
    root: &Path,
    layout: &Layout,
    plan: Plan,
    contents: &HashMap<BlobHash, Bytes>,
    known: &mut HashMap<PathBuf, Known>,
) -> Result<SyncStats, ClientError> {
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
    let mut doc = serde_json::to_vec_pretty(&layout.manifest)
        .map_err(|e| ClientError::encode("the fork directory's manifest", e))?;
    doc.push(b'\n');
    let path = root.join(MANIFEST_FILE);
    let same = std::fs::read(&path).is_ok_and(|old| old == doc);
    if !same {
        write_atomic(root, Path::new(MANIFEST_FILE), &doc, 0o644)
            .map_err(|e| ClientError::io("write", path, e))?;
        stats.manifest_written = true;
    }
    if !failures.is_empty() {
        let more = failures.len().saturating_sub(3);
        failures.truncate(3);
        return Err(ClientError::ForkDirIncomplete {
            dir: root.to_path_buf(),
            failures,
            more,
        });
    }
    Ok(stats)
}

/// Make every directory of `rel` (relative to `root`) a real directory: whatever else
/// stands there (a file, a symbolic link) is removed first, never followed.
pub(crate) fn ensure_dirs(root: &Path, rel: &Path) -> io::Result<()> {
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
pub(crate) fn write_file(
    root: &Path,
    rel: &Path,
    bytes: &[u8],
    mode: u32,
) -> io::Result<std::fs::Metadata> {
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

pub(crate) fn write_atomic(root: &Path, rel: &Path, bytes: &[u8], mode: u32) -> io::Result<()> {
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
