//! The layout a fork view and a diff report ask for: which files, which directories,
//! and `manifest.json`.

use super::*;

/// One branch's directory and what the manifest says about it.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct BranchDoc {
    pub(crate) label: String,
    /// Relative to the fork directory: `branches/<name>`.
    pub(crate) dir: String,
    pub(crate) state: String,
    pub(crate) error: Option<String>,
    pub(crate) cost_usd: f64,
    pub(crate) turns: u32,
    /// Entries in the branch's change log.
    pub(crate) changes: usize,
    pub(crate) created: Vec<String>,
    pub(crate) modified: Vec<String>,
    pub(crate) deleted: Vec<String>,
}

/// What one branch did to one path.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct TouchDoc {
    pub(crate) operation: Operation,
    /// The file it ended with; none when deleted.
    pub(crate) file: Option<FileInfo>,
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct PathDoc {
    pub(crate) path: String,
    pub(crate) agreement: String,
    /// The fork-time file; none when the path did not exist.
    pub(crate) parent: Option<FileInfo>,
    /// Per label, the branches that touched the path (the others have the parent's).
    pub(crate) branches: BTreeMap<String, TouchDoc>,
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct SkippedDoc {
    pub(crate) what: String,
    pub(crate) reason: String,
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct ManifestDoc {
    pub(crate) format: u32,
    pub(crate) fork_id: String,
    pub(crate) goal: String,
    pub(crate) state: String,
    pub(crate) winner: Option<String>,
    pub(crate) workspace: Option<String>,
    pub(crate) keep_artifacts: bool,
    pub(crate) parent_dir: &'static str,
    pub(crate) branches: Vec<BranchDoc>,
    pub(crate) paths: Vec<PathDoc>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub(crate) skipped: Vec<SkippedDoc>,
}

/// The files a fork directory must hold (relative paths), the directories that must exist
/// even when empty, and the manifest.
#[derive(Debug)]
pub(crate) struct Layout {
    pub(crate) files: BTreeMap<PathBuf, FileInfo>,
    pub(crate) trees: Vec<PathBuf>,
    pub(crate) manifest: ManifestDoc,
    /// Per branch index of the report: its directory name.
    pub(crate) dirs: Vec<String>,
}

pub(crate) fn layout(view: &ForkView, report: &DiffReport) -> Layout {
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
