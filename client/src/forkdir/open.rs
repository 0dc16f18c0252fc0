//! `forkfleet fork open`: picking a diff tool and launching it on the fork directory.

use super::*;

/// When the terminal diff is coloured.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
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
/// terminal. A template that does not split into words is bad input
/// ([`ClientError::BadInput`]).
pub fn detect(difftool: Option<&OsStr>, path_var: Option<&OsStr>) -> Result<Tool, ClientError> {
    if let Some(t) = difftool {
        let t = t
            .to_str()
            .ok_or_else(|| ClientError::BadInput(format!("{DIFFTOOL_ENV} is not valid UTF-8")))?;
        if !t.trim().is_empty() {
            let words = spec::split_words(t)
                .map_err(|e| ClientError::BadInput(format!("{DIFFTOOL_ENV} `{t}`: {e}")))?;
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
pub(crate) fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

#[cfg(not(unix))]
pub(crate) fn is_executable(p: &Path) -> bool {
    p.is_file()
}

/// One file of the parent against one branch's (absent: `None`).
#[derive(Debug, Clone)]
pub(crate) struct Pair {
    pub(crate) label: String,
    /// The branch's file relative to the fork directory, for display.
    pub(crate) shown: String,
    pub(crate) path: String,
    pub(crate) parent: Option<PathBuf>,
    pub(crate) branch: Option<PathBuf>,
    /// The coordinator's unified diff of the two (when the report was asked for them).
    pub(crate) diff: Option<Arc<str>>,
}

/// What `fork open` compares: the parent (a directory, or the parent's file at PATH) and
/// each branch that changed something (at PATH), plus file pairs.
#[derive(Debug, Clone)]
pub(crate) struct Targets {
    pub(crate) parent: PathBuf,
    /// (label, directory or file; `None` for a file the branch deleted)
    pub(crate) branches: Vec<(String, Option<PathBuf>)>,
    pub(crate) pairs: Vec<Pair>,
}

/// The null device, standing for a file that does not exist (git difftool's convention).
pub(crate) fn null_device() -> PathBuf {
    PathBuf::from(if cfg!(windows) { "NUL" } else { "/dev/null" })
}

pub(crate) fn touched_list(report: &DiffReport) -> String {
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

pub(crate) fn targets(
    dir: &Path,
    synced: &Synced,
    path: Option<&WsPath>,
) -> Result<Targets, ClientError> {
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
                return Err(ClientError::BadInput(format!(
                    "the fork did not touch `{p}`; {}",
                    touched_list(report)
                )));
            };
            let local = confined(Path::new(""), pd.path.as_str())?;
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
pub(crate) fn commands(tool: &Tool, t: &Targets) -> (Vec<Vec<OsString>>, Vec<String>) {
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

/// What `fork open` did, as the pretty JSON document `--json` prints.
fn pretty(opened: &Opened) -> Result<String, ClientError> {
    serde_json::to_string_pretty(opened)
        .map_err(|e| ClientError::encode("the `fork open` document", e))
}

/// A command line as a shell would read it back.
pub(crate) fn shell_line(argv: &[OsString]) -> String {
    argv.iter()
        .map(|a| crate::render::shell_word(&a.to_string_lossy()))
        .collect::<Vec<_>>()
        .join(" ")
}

/// `forkfleet fork open FORK [PATH]`: sync the fork directory, then open it with the
/// diff tool [`detect`] picks from the environment (each launched tool is waited for) or
/// print the diff. Prints what it launched; with `json`, one document instead.
pub async fn open(
    coord: &Client,
    fork: ForkId,
    path: Option<&str>,
    only: &[String],
    color: ColorChoice,
    json: bool,
) -> Result<(), ClientError> {
    let path = path
        .map(|p| WsPath::parse_file(p).map_err(|e| ClientError::BadInput(format!("PATH: {e}"))))
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
    let mut t = targets(&dir, &synced, path.as_ref())?;
    // `--branch A --branch B`: only these against the parent (a 3-way or pairwise diff).
    if !only.is_empty() {
        for label in only {
            if view.branch(label).is_none() {
                return Err(ClientError::BadInput(format!(
                    "--branch `{label}` is not a branch of fork {fork}; its branches: {}",
                    view.branches
                        .iter()
                        .map(|b| b.label.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                )));
            }
        }
        t.branches.retain(|(label, _)| only.contains(label));
        t.pairs.retain(|p| only.contains(&p.label));
    }
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
            println!("{}", pretty(&opened)?);
        } else {
            println!("no branch changed anything: nothing to compare");
        }
        return Ok(());
    }
    if !json {
        let s = &synced.stats;
        crate::render::say(&format!(
            "fork directory: {} ({} written, {} removed, {} unchanged)",
            dir.display(),
            s.written,
            s.removed,
            s.unchanged
        ));
        for n in &opened.notes {
            crate::render::say(&format!("note: {n}"));
        }
    }
    if tool == Tool::Terminal {
        if json {
            opened.diff = Some(terminal_diff(&t.pairs, false));
            println!("{}", pretty(&opened)?);
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
        println!("{}", pretty(&opened)?);
    }
    if !failed.is_empty() {
        return Err(ClientError::DiffTool { failed });
    }
    Ok(())
}
