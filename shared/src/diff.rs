//! The cross-branch diff report: what every branch did to every file, and whether the
//! branches agree.
//!
//! # Inputs
//! - the fork-time snapshot (the parent every branch started from);
//! - per branch a label and its net changes ([`Overlay::net_changes`]), either precomputed
//!   ([`diff_report`]) or taken from the overlays ([`diff_overlays`]);
//! - a blob lookup for file contents (only needed for unified diffs);
//! - [`DiffOptions`]: a path filter, whether to compute unified diffs, and their context.
//!
//! # Semantics
//! Per path and per branch an [`Operation`]: `created` (the parent lacks the path),
//! `modified`, `deleted` or `untouched`. Net changes are used, so a file written back with
//! its original content *and* mode is not a change: a branch that rewrote a file to what it
//! was is `untouched` for that path.
//!
//! Per path an [`Agreement`]:
//! - `unique`: exactly one branch touched it;
//! - `unanimous_change`: two or more branches touched it and every toucher reached the same
//!   end state (same operation, same content hash; all deleters agree);
//! - `split`: two or more branches touched it and their outcomes differ;
//! - `unanimous_no_change`: no branch touched it. Only appears for a path the filter names
//!   and that matched no touched path (see [`DiffOptions::paths`]).
//!
//! The [`DiffSummary`] is computed over *all* touched paths, whatever the filter.
//!
//! # Representation and cost
//! The report is sparse: a [`PathDiff`] lists only the branches that touched the path, in
//! branch order; a branch absent from the list left the path untouched. Branches are named
//! by their index into [`DiffReport::branches`]. Nothing is allocated per (path, branch)
//! pair for untouched pairs. Unified diffs are computed once per distinct (old, new)
//! outcome of a path and shared between branches through an `Arc<str>`.
//!
//! # JSON
//! [`DiffReport`] serialises with branch *labels*, not indices: every path carries
//! `path`, `agreement`, `parent`, `operations` (a map label -> operation for the branches
//! that touched it) and `changes` (a list of objects whose `branch` is the label). It
//! deserialises from that form (and also accepts numeric `branch` indices); the
//! `operations` map is derived and ignored on input. [`DiffReport::to_json_value`] is a
//! shortcut for `serde_json::to_value`. [`PathDiff`] and [`BranchChange`] on their own
//! serialise the index, since they do not know the labels.
//!
//! # Layout
//! This file holds the report's types and how it is built ([`diff_report`],
//! [`diff_overlays`]); `unified` the unified diffs, `render` the terminal table
//! ([`render_summary`]), `json` the JSON form, `patch` a branch's change as a git patch.

mod json;
pub mod patch;
mod render;
mod unified;

pub use render::render_summary;
pub use unified::{binary_placeholder, truncate_lines};

use unified::DiffCache;

use crate::blob::BlobHash;
use crate::manifest::{FileEntry, Manifest};
use crate::overlay::{NetChange, Overlay};
use crate::path::WsPath;
use bytes::Bytes;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::Arc;

/// A diff longer than this many lines is truncated.
pub const MAX_DIFF_LINES: usize = 500;
/// How many lines a truncated diff keeps at its start and at its end.
pub const KEEP_DIFF_LINES: usize = 200;

/// What to report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct DiffOptions {
    /// Only report these paths: each entry is an exact file path or a directory prefix
    /// (the root matches everything). An entry that matches no touched path is reported
    /// itself as `unanimous_no_change`. `None` reports every touched path.
    pub paths: Option<Vec<WsPath>>,
    /// Compute unified diff text for text files.
    pub unified: bool,
    /// Lines of context around each hunk.
    pub context: usize,
}

impl Default for DiffOptions {
    fn default() -> Self {
        Self {
            paths: None,
            unified: true,
            context: 3,
        }
    }
}

/// What one branch did to one path, relative to the parent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Operation {
    Created,
    Modified,
    Deleted,
    Untouched,
}

impl Operation {
    pub fn as_str(&self) -> &'static str {
        match self {
            Operation::Created => "created",
            Operation::Modified => "modified",
            Operation::Deleted => "deleted",
            Operation::Untouched => "untouched",
        }
    }
}

impl std::fmt::Display for Operation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How the branches relate on one path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Agreement {
    Unique,
    UnanimousChange,
    Split,
    UnanimousNoChange,
}

impl Agreement {
    pub fn as_str(&self) -> &'static str {
        match self {
            Agreement::Unique => "unique",
            Agreement::UnanimousChange => "unanimous_change",
            Agreement::Split => "split",
            Agreement::UnanimousNoChange => "unanimous_no_change",
        }
    }
}

impl std::fmt::Display for Agreement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A file's identity as the report shows it. `hash` serialises as hex.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct FileInfo {
    #[serde(with = "json::hex_hash")]
    pub hash: BlobHash,
    pub size: u64,
    pub binary: bool,
    /// The file mode (0o644, 0o755, or the symlink marker). Shown so that a mode-only
    /// change, which counts as `modified`, is visible.
    #[serde(default = "default_mode")]
    pub mode: u32,
}

fn default_mode() -> u32 {
    crate::manifest::MODE_FILE
}

impl From<&FileEntry> for FileInfo {
    fn from(e: &FileEntry) -> Self {
        Self {
            hash: e.hash,
            size: e.size,
            binary: e.binary,
            mode: e.mode,
        }
    }
}

/// One branch's change to one path.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BranchChange {
    /// Index into [`DiffReport::branches`].
    pub branch: u32,
    /// Never `Untouched`: untouched branches are not listed.
    pub operation: Operation,
    /// The file the branch ended with; `None` when deleted.
    pub entry: Option<FileInfo>,
    /// Unified diff (or a binary placeholder), when [`DiffOptions::unified`] was set.
    /// Branches with the same outcome share one allocation.
    #[serde(with = "json::arc_str_opt", default)]
    pub diff: Option<Arc<str>>,
    /// The diff was longer than [`MAX_DIFF_LINES`] and its middle was cut.
    #[serde(default)]
    pub truncated: bool,
}

/// Everything the report says about one path.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PathDiff {
    pub path: WsPath,
    pub agreement: Agreement,
    /// The file in the parent, if it had one.
    pub parent: Option<FileInfo>,
    /// The branches that touched the path, sorted by branch index.
    pub changes: Vec<BranchChange>,
}

impl PathDiff {
    /// What branch `branch` (an index) did to this path.
    pub fn operation(&self, branch: u32) -> Operation {
        self.change(branch)
            .map(|c| c.operation)
            .unwrap_or(Operation::Untouched)
    }

    /// The change of branch `branch` (an index), if it touched this path.
    pub fn change(&self, branch: u32) -> Option<&BranchChange> {
        self.changes
            .binary_search_by_key(&branch, |c| c.branch)
            .ok()
            .and_then(|i| self.changes.get(i))
    }
}

/// Counts over all touched paths (the filter does not change them).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DiffSummary {
    pub total_paths_touched: usize,
    /// Paths whose agreement is `unanimous_change`.
    pub unanimous_paths: usize,
    pub split_paths: usize,
    /// Per branch label, how many paths only that branch touched (every label present).
    pub per_branch_unique: BTreeMap<String, usize>,
    /// `1 - split_paths / max(total_paths_touched, 1)`.
    pub agreement_score: f64,
    /// How many branches were compared.
    pub branches: usize,
}

/// The cross-branch diff report. See the module documentation for its JSON form.
#[derive(Debug, Clone, PartialEq)]
pub struct DiffReport {
    /// Branch labels; [`BranchChange::branch`] indexes this list.
    pub branches: Vec<String>,
    pub summary: DiffSummary,
    /// Sorted by path.
    pub paths: Vec<PathDiff>,
}

impl DiffReport {
    /// The label of branch index `i`.
    pub fn label(&self, i: u32) -> &str {
        self.branches
            .get(i as usize)
            .map(String::as_str)
            .unwrap_or("?")
    }

    /// The index of the branch labelled `label`.
    pub fn branch_index(&self, label: &str) -> Option<u32> {
        self.branches
            .iter()
            .position(|b| b == label)
            .and_then(|i| u32::try_from(i).ok())
    }

    /// The report entry for `path`, if the report lists it.
    pub fn path(&self, path: &WsPath) -> Option<&PathDiff> {
        self.paths
            .binary_search_by(|p| p.path.cmp(path))
            .ok()
            .and_then(|i| self.paths.get(i))
    }

    /// Per path, label -> operation for the branches that touched it.
    pub fn operations<'a>(&'a self, path: &'a PathDiff) -> BTreeMap<&'a str, Operation> {
        path.changes
            .iter()
            .map(|c| (self.label(c.branch), c.operation))
            .collect()
    }

    /// The report as JSON with branch labels (same as `serde_json::to_value(self)`).
    pub fn to_json_value(&self) -> serde_json::Value {
        serde_json::to_value(self).unwrap_or(serde_json::Value::Null)
    }
}

/// Build the report from per-branch net changes (`(label, net_changes)` in branch order).
/// `blobs` is only consulted when `opts.unified` is set.
pub fn diff_report<L: AsRef<str>>(
    parent: &Manifest,
    branches: &[(L, &BTreeMap<WsPath, NetChange>)],
    blobs: &dyn Fn(&BlobHash) -> Option<Bytes>,
    opts: &DiffOptions,
) -> DiffReport {
    let labels: Vec<String> = branches
        .iter()
        .map(|(l, _)| l.as_ref().to_string())
        .collect();

    // Every (path, branch, change) triple, grouped by path with branches in order. The
    // stable sort keeps branch order inside a path; one allocation for the whole set.
    let mut touched: Vec<Touch<'_>> =
        Vec::with_capacity(branches.iter().map(|(_, c)| c.len()).sum());
    for (i, (_, changes)) in branches.iter().enumerate() {
        let idx = u32::try_from(i).unwrap_or(u32::MAX);
        touched.extend(changes.iter().map(|(p, c)| (p, idx, c)));
    }
    touched.sort_by(|a, b| a.0.cmp(b.0));

    let mut unique_counts = vec![0usize; branches.len()];
    let mut total = 0usize;
    let mut unanimous = 0usize;
    let mut split = 0usize;
    let mut groups: Vec<(&[Touch<'_>], Agreement)> = Vec::new();
    for group in touched.chunk_by(|a, b| a.0 == b.0) {
        let agreement = classify(group);
        total += 1;
        match agreement {
            Agreement::Unique => {
                if let Some(n) = group
                    .first()
                    .and_then(|t| unique_counts.get_mut(t.1 as usize))
                {
                    *n += 1;
                }
            }
            Agreement::UnanimousChange => unanimous += 1,
            Agreement::Split => split += 1,
            Agreement::UnanimousNoChange => {}
        }
        groups.push((group, agreement));
    }

    let mut per_branch_unique: BTreeMap<String, usize> = BTreeMap::new();
    for (label, n) in labels.iter().zip(&unique_counts) {
        *per_branch_unique.entry(label.clone()).or_default() += n;
    }
    let summary = DiffSummary {
        total_paths_touched: total,
        unanimous_paths: unanimous,
        split_paths: split,
        per_branch_unique,
        agreement_score: 1.0 - split as f64 / total.max(1) as f64,
        branches: branches.len(),
    };

    let mut paths = Vec::new();
    match &opts.paths {
        None => {
            for (group, agreement) in &groups {
                paths.push(path_diff(parent, group, *agreement, blobs, opts));
            }
        }
        Some(filter) => {
            let mut matched = vec![false; filter.len()];
            for (group, agreement) in &groups {
                let Some((path, _, _)) = group.first() else {
                    continue;
                };
                let mut keep = false;
                for (f, m) in filter.iter().zip(matched.iter_mut()) {
                    if path.starts_with(f) {
                        *m = true;
                        keep = true;
                    }
                }
                if keep {
                    paths.push(path_diff(parent, group, *agreement, blobs, opts));
                }
            }
            let mut seen = std::collections::BTreeSet::new();
            for (f, m) in filter.iter().zip(&matched) {
                if !m && seen.insert(f) {
                    paths.push(PathDiff {
                        path: f.clone(),
                        agreement: Agreement::UnanimousNoChange,
                        parent: parent.files.get(f).map(FileInfo::from),
                        changes: Vec::new(),
                    });
                }
            }
            paths.sort_by(|a, b| a.path.cmp(&b.path));
        }
    }

    DiffReport {
        branches: labels,
        summary,
        paths,
    }
}

/// Build the report from the branches' overlays (computes each `net_changes()` once).
pub fn diff_overlays<L: AsRef<str>>(
    parent: &Manifest,
    branches: &[(L, &Overlay)],
    blobs: &dyn Fn(&BlobHash) -> Option<Bytes>,
    opts: &DiffOptions,
) -> DiffReport {
    let nets: Vec<BTreeMap<WsPath, NetChange>> =
        branches.iter().map(|(_, o)| o.net_changes()).collect();
    let inputs: Vec<(&str, &BTreeMap<WsPath, NetChange>)> = branches
        .iter()
        .zip(&nets)
        .map(|((l, _), n)| (l.as_ref(), n))
        .collect();
    diff_report(parent, &inputs, blobs, opts)
}

/// One branch's net change to a path, during the build.
type Touch<'a> = (&'a WsPath, u32, &'a NetChange);
/// An end state: operation and content hash.
type Outcome = (Operation, Option<BlobHash>);

/// The end state a branch reached: operation and content hash.
fn outcome(c: &NetChange) -> Outcome {
    match c {
        NetChange::Created(e) => (Operation::Created, Some(e.hash)),
        NetChange::Modified(e) => (Operation::Modified, Some(e.hash)),
        NetChange::Deleted => (Operation::Deleted, None),
    }
}

fn classify(group: &[Touch<'_>]) -> Agreement {
    match group {
        [] => Agreement::UnanimousNoChange,
        [_] => Agreement::Unique,
        [(_, _, first), rest @ ..] => {
            let want = outcome(first);
            if rest.iter().all(|(_, _, c)| outcome(c) == want) {
                Agreement::UnanimousChange
            } else {
                Agreement::Split
            }
        }
    }
}

fn path_diff(
    parent: &Manifest,
    group: &[Touch<'_>],
    agreement: Agreement,
    blobs: &dyn Fn(&BlobHash) -> Option<Bytes>,
    opts: &DiffOptions,
) -> PathDiff {
    let path = group.first().map(|t| t.0.clone()).unwrap_or_default();
    let old = parent.files.get(&path);
    let mut texts = DiffCache::new(&path, old, blobs, opts.context);
    let changes = group
        .iter()
        .map(|(_, branch, change)| {
            let (operation, _) = outcome(change);
            let entry = change.entry();
            let (diff, truncated) = if opts.unified {
                let (text, truncated) = texts.get(entry);
                (Some(text), truncated)
            } else {
                (None, false)
            };
            BranchChange {
                branch: *branch,
                operation,
                entry: entry.map(FileInfo::from),
                diff,
                truncated,
            }
        })
        .collect();
    PathDiff {
        path,
        agreement,
        parent: old.map(FileInfo::from),
        changes,
    }
}
