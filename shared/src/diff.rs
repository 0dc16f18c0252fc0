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

use crate::blob::BlobHash;
use crate::manifest::{FileEntry, Manifest};
use crate::overlay::{NetChange, Overlay};
use crate::path::WsPath;
use bytes::Bytes;
use serde::ser::{SerializeMap, SerializeSeq, SerializeStruct};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use similar::TextDiff;
use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

/// A diff longer than this many lines is truncated.
pub const MAX_DIFF_LINES: usize = 500;
/// How many lines a truncated diff keeps at its start and at its end.
pub const KEEP_DIFF_LINES: usize = 200;
/// The longest a single text diff may compute before `similar` approximates.
const DIFF_TIMEOUT: Duration = Duration::from_millis(500);

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
    #[serde(with = "hex_hash")]
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
    #[serde(with = "arc_str_opt", default)]
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
/// A cached diff text and whether it was truncated.
type CachedDiff = (Arc<str>, bool);

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

/// Unified diffs of one path, computed once per distinct outcome. The old side is fixed
/// per path, so keying by the new side's (hash, mode) is keying by (old, new).
struct DiffCache<'a> {
    path: &'a WsPath,
    old: Option<&'a FileEntry>,
    old_text: Option<Option<Bytes>>,
    blobs: &'a dyn Fn(&BlobHash) -> Option<Bytes>,
    context: usize,
    done: HashMap<Option<(BlobHash, u32)>, CachedDiff>,
}

impl<'a> DiffCache<'a> {
    fn new(
        path: &'a WsPath,
        old: Option<&'a FileEntry>,
        blobs: &'a dyn Fn(&BlobHash) -> Option<Bytes>,
        context: usize,
    ) -> Self {
        Self {
            path,
            old,
            old_text: None,
            blobs,
            context,
            done: HashMap::new(),
        }
    }

    fn get(&mut self, new: Option<&FileEntry>) -> CachedDiff {
        let key = new.map(|e| (e.hash, e.mode));
        if let Some((text, truncated)) = self.done.get(&key) {
            return (Arc::clone(text), *truncated);
        }
        let (text, truncated) = self.compute(new);
        let text: Arc<str> = Arc::from(text);
        self.done.insert(key, (Arc::clone(&text), truncated));
        (text, truncated)
    }

    fn old_bytes(&mut self) -> Option<Bytes> {
        let old = self.old?;
        let blobs = self.blobs;
        self.old_text
            .get_or_insert_with(|| blobs(&old.hash))
            .clone()
    }

    fn compute(&mut self, new: Option<&FileEntry>) -> (String, bool) {
        let old = self.old;
        if let Some(n) = new.filter(|n| n.binary) {
            return match old.filter(|o| !o.binary) {
                Some(o) => (
                    format!("{} → {}", text_placeholder(o), binary_placeholder(n)),
                    false,
                ),
                None => (binary_placeholder(n), false),
            };
        }
        if let Some(o) = old.filter(|o| o.binary) {
            return match new {
                Some(n) => (
                    format!("{} → {}", binary_placeholder(o), text_placeholder(n)),
                    false,
                ),
                None => (binary_placeholder(o), false),
            };
        }
        let a = match old {
            Some(_) => format!("a/{}", self.path.as_str()),
            None => "/dev/null".to_string(),
        };
        let b = match new {
            Some(_) => format!("b/{}", self.path.as_str()),
            None => "/dev/null".to_string(),
        };
        let old_bytes = match old {
            Some(o) => match self.old_bytes() {
                Some(b) => b,
                None => return (unavailable(o), false),
            },
            None => Bytes::new(),
        };
        let new_bytes = match new {
            Some(n) => match (self.blobs)(&n.hash) {
                Some(b) => b,
                None => return (unavailable(n), false),
            },
            None => Bytes::new(),
        };
        let old_text = String::from_utf8_lossy(&old_bytes);
        let new_text = String::from_utf8_lossy(&new_bytes);
        let mut text = TextDiff::configure()
            .timeout(DIFF_TIMEOUT)
            .diff_lines(old_text.as_ref(), new_text.as_ref())
            .unified_diff()
            .context_radius(self.context)
            .header(&a, &b)
            .to_string();
        if text.is_empty() {
            // No hunks: an empty file created or deleted, or a mode-only change.
            text = format!("--- {a}\n+++ {b}\n");
            if let (Some(o), Some(n)) = (old, new) {
                if o.mode != n.mode {
                    let _ = writeln!(text, "mode {:o} → {:o}", o.mode, n.mode);
                }
            }
        }
        truncate_lines(text)
    }
}

/// `[binary · {size} bytes · sha256:{first 12 hex}]`
pub fn binary_placeholder(e: &FileEntry) -> String {
    format!("[binary · {} bytes · sha256:{}]", e.size, e.hash.short())
}

fn text_placeholder(e: &FileEntry) -> String {
    format!("[text · {} bytes · sha256:{}]", e.size, e.hash.short())
}

fn unavailable(e: &FileEntry) -> String {
    format!(
        "[content unavailable · {} bytes · sha256:{}]",
        e.size,
        e.hash.short()
    )
}

/// Keep the first and last [`KEEP_DIFF_LINES`] lines of a diff longer than
/// [`MAX_DIFF_LINES`], with a `... [N lines truncated] ...` marker between them.
pub fn truncate_lines(text: String) -> (String, bool) {
    let total = text.lines().count();
    if total <= MAX_DIFF_LINES {
        return (text, false);
    }
    // Byte offset just past the KEEP-th newline, and the start of line total-KEEP.
    let newline_ends: Vec<usize> = text.match_indices('\n').map(|(i, _)| i + 1).collect();
    let head_end = newline_ends
        .get(KEEP_DIFF_LINES - 1)
        .copied()
        .unwrap_or(text.len());
    let tail_start = newline_ends
        .get(total - KEEP_DIFF_LINES - 1)
        .copied()
        .unwrap_or(head_end);
    let cut = total - 2 * KEEP_DIFF_LINES;
    let mut out = String::with_capacity(head_end + (text.len() - tail_start) + 40);
    out.push_str(&text[..head_end]);
    let _ = writeln!(out, "... [{cut} lines truncated] ...");
    out.push_str(&text[tail_start..]);
    (out, true)
}

/// A short table for terminals: a summary line, one row per reported path (path,
/// agreement, which branches did what), and the per-branch unique counts.
pub fn render_summary(report: &DiffReport) -> String {
    const MAX_LABELS: usize = 6;
    const MAX_GROUPS: usize = 4;
    const MAX_UNIQUE: usize = 12;
    let s = &report.summary;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{} branches · {} paths touched · {} unanimous · {} split · agreement {:.2}",
        s.branches, s.total_paths_touched, s.unanimous_paths, s.split_paths, s.agreement_score
    );
    if report.paths.is_empty() {
        out.push_str("no changes\n");
    } else {
        let width = report
            .paths
            .iter()
            .map(|p| p.path.as_str().chars().count())
            .max()
            .unwrap_or(4)
            .clamp(4, 60);
        let _ = writeln!(out, "{:<width$}  {:<19}  BRANCHES", "PATH", "AGREEMENT");
        for p in &report.paths {
            let mut path = p.path.to_string();
            if path.chars().count() > width {
                let skip = path.chars().count() - (width - 1);
                path = format!("…{}", path.chars().skip(skip).collect::<String>());
            }
            let _ = writeln!(
                out,
                "{:<width$}  {:<19}  {}",
                path,
                p.agreement.as_str(),
                who_did_what(report, p, MAX_LABELS, MAX_GROUPS)
            );
        }
    }
    if !report.branches.is_empty() {
        out.push_str("unique paths per branch:");
        for (i, (label, n)) in s.per_branch_unique.iter().enumerate() {
            if i == MAX_UNIQUE {
                let _ = write!(out, " … (+{} more)", s.per_branch_unique.len() - MAX_UNIQUE);
                break;
            }
            let _ = write!(out, " {label}={n}");
        }
        out.push('\n');
    }
    out
}

/// `modified: a, b · deleted: c`; on a split, outcomes that differ only by content carry
/// the content's short hash.
fn who_did_what(report: &DiffReport, p: &PathDiff, max_labels: usize, max_groups: usize) -> String {
    if p.changes.is_empty() {
        return "(no branch)".to_string();
    }
    // Outcomes in first-seen order, with the branches that reached each.
    let mut outcomes: Vec<(Outcome, Vec<u32>)> = Vec::new();
    for c in &p.changes {
        let key = (c.operation, c.entry.map(|e| e.hash));
        match outcomes.iter_mut().find(|(k, _)| *k == key) {
            Some((_, v)) => v.push(c.branch),
            None => outcomes.push((key, vec![c.branch])),
        }
    }
    let show_hash = p.agreement == Agreement::Split;
    let mut parts = Vec::new();
    for ((op, hash), members) in outcomes.iter().take(max_groups) {
        let mut s = op.as_str().to_string();
        if let (true, Some(h)) = (show_hash, hash) {
            let short = h.short();
            let _ = write!(s, "#{}", short.get(..6).unwrap_or(&short));
        }
        s.push_str(": ");
        let names: Vec<&str> = members
            .iter()
            .take(max_labels)
            .map(|b| report.label(*b))
            .collect();
        s.push_str(&names.join(", "));
        if members.len() > max_labels {
            let _ = write!(s, " +{} more", members.len() - max_labels);
        }
        parts.push(s);
    }
    let mut line = parts.join(" · ");
    if outcomes.len() > max_groups {
        let _ = write!(line, " · +{} other outcomes", outcomes.len() - max_groups);
    }
    line
}

// ---------------------------------------------------------------------------------------
// serde

mod hex_hash {
    use crate::blob::BlobHash;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(h: &BlobHash, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&h.to_hex())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<BlobHash, D::Error> {
        let s = String::deserialize(d)?;
        BlobHash::from_hex(&s).ok_or_else(|| serde::de::Error::custom("invalid sha256 hex"))
    }
}

mod arc_str_opt {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::sync::Arc;

    pub fn serialize<S: Serializer>(v: &Option<Arc<str>>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            Some(t) => s.serialize_some(t.as_ref()),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Arc<str>>, D::Error> {
        Ok(Option::<String>::deserialize(d)?.map(Arc::from))
    }
}

struct PathsView<'a>(&'a DiffReport);
struct PathView<'a>(&'a DiffReport, &'a PathDiff);
struct OperationsView<'a>(&'a DiffReport, &'a PathDiff);
struct ChangesView<'a>(&'a DiffReport, &'a PathDiff);
struct ChangeView<'a>(&'a DiffReport, &'a BranchChange);

impl Serialize for DiffReport {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut st = s.serialize_struct("DiffReport", 3)?;
        st.serialize_field("branches", &self.branches)?;
        st.serialize_field("summary", &self.summary)?;
        st.serialize_field("paths", &PathsView(self))?;
        st.end()
    }
}

impl Serialize for PathsView<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut seq = s.serialize_seq(Some(self.0.paths.len()))?;
        for p in &self.0.paths {
            seq.serialize_element(&PathView(self.0, p))?;
        }
        seq.end()
    }
}

impl Serialize for PathView<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let p = self.1;
        let mut st = s.serialize_struct("PathDiff", 5)?;
        st.serialize_field("path", &p.path)?;
        st.serialize_field("agreement", &p.agreement)?;
        st.serialize_field("parent", &p.parent)?;
        st.serialize_field("operations", &OperationsView(self.0, p))?;
        st.serialize_field("changes", &ChangesView(self.0, p))?;
        st.end()
    }
}

impl Serialize for OperationsView<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(Some(self.1.changes.len()))?;
        for c in &self.1.changes {
            map.serialize_entry(self.0.label(c.branch), &c.operation)?;
        }
        map.end()
    }
}

impl Serialize for ChangesView<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut seq = s.serialize_seq(Some(self.1.changes.len()))?;
        for c in &self.1.changes {
            seq.serialize_element(&ChangeView(self.0, c))?;
        }
        seq.end()
    }
}

impl Serialize for ChangeView<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let c = self.1;
        let mut st = s.serialize_struct("BranchChange", 5)?;
        st.serialize_field("branch", self.0.label(c.branch))?;
        st.serialize_field("operation", &c.operation)?;
        st.serialize_field("entry", &c.entry)?;
        st.serialize_field("diff", &c.diff.as_deref())?;
        st.serialize_field("truncated", &c.truncated)?;
        st.end()
    }
}

#[derive(Deserialize)]
struct RawReport {
    branches: Vec<String>,
    summary: DiffSummary,
    paths: Vec<RawPath>,
}

#[derive(Deserialize)]
struct RawPath {
    path: WsPath,
    agreement: Agreement,
    parent: Option<FileInfo>,
    #[serde(default)]
    changes: Vec<RawChange>,
}

#[derive(Deserialize)]
struct RawChange {
    branch: RawBranch,
    operation: Operation,
    entry: Option<FileInfo>,
    #[serde(default)]
    diff: Option<String>,
    #[serde(default)]
    truncated: bool,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum RawBranch {
    Index(u32),
    Label(String),
}

impl<'de> Deserialize<'de> for DiffReport {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let raw = RawReport::deserialize(d)?;
        let mut index: HashMap<&str, u32> = HashMap::new();
        for (i, b) in raw.branches.iter().enumerate() {
            let i = u32::try_from(i).map_err(serde::de::Error::custom)?;
            index.entry(b.as_str()).or_insert(i);
        }
        let mut paths = Vec::with_capacity(raw.paths.len());
        for p in raw.paths {
            let mut changes = Vec::with_capacity(p.changes.len());
            for c in p.changes {
                let branch = match c.branch {
                    RawBranch::Index(i) => i,
                    RawBranch::Label(l) => *index.get(l.as_str()).ok_or_else(|| {
                        serde::de::Error::custom(format!("unknown branch label `{l}`"))
                    })?,
                };
                changes.push(BranchChange {
                    branch,
                    operation: c.operation,
                    entry: c.entry,
                    diff: c.diff.map(Arc::from),
                    truncated: c.truncated,
                });
            }
            changes.sort_by_key(|c| c.branch);
            paths.push(PathDiff {
                path: p.path,
                agreement: p.agreement,
                parent: p.parent,
                changes,
            });
        }
        Ok(DiffReport {
            branches: raw.branches,
            summary: raw.summary,
            paths,
        })
    }
}
