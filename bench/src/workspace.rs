//! `forkfleet bench workspace`: forks of a large real tree (issue 18).
//!
//! On a tree (`--dir`, e.g. the crate sources in the local cargo registry, or one
//! generated with `--files` and `--mb`: 14,000 files, 233 MB by default), in one run, side
//! by side:
//! - **snapshot**: listing and hashing the tree cold (no stat cache) and again warm (the
//!   stat cache serves unchanged files), in this process;
//! - **per-call command overhead**: a branch's `run_command` calls (`true`) through the
//!   worker's own tool code, with kept trees (now) and with a fresh copy per call (before),
//!   p50 and p90 over `--commands` calls;
//! - **whole runs**: `forkfleet run` of a spec forking the tree into each `--branches`
//!   count, every branch making `--commands` `run_command` calls and writing one file, as a
//!   child process whose wall time and peak RSS (`/usr/bin/time`) are reported;
//! - **git worktrees**: the same work done the way users do it without forkfleet, one
//!   `git worktree add` per branch (one after the other: concurrent adds race on the
//!   repository), then the commands run in place, every branch at once. The repository is
//!   made first and timed apart (`git init`, `add`, `commit`: what a forkfleet first run's
//!   storing of the workspace compares with).
//!
//! Every timed step starts on a settled disk: `sync` writes out what the steps before it
//! left dirty (the tree's copy, a first run's store, git's objects), so no side pays for
//! the other's writeback. With `--repeat N` the run over the first run's store and the git
//! worktrees alternate N times and each side's best is reported (every time is kept in the
//! JSON): removing a round's worktrees slows the next round's (ext4 allocates inodes more
//! slowly after many were freed), so a median would count that against git.

use super::*;
use forkfleet_shared::scan::{self, ScanOptions, StatCache};
use forkfleet_worker::cache::BlobCache;
use forkfleet_worker::runner::{TreeKey, Trees};
use forkfleet_worker::tools::{ToolBox, TreeSlot, RUN_COMMAND};
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Debug, Args)]
pub struct WorkspaceArgs {
    /// A tree to fork (read, never changed: it is copied into a scratch directory first).
    /// Default: a generated one of `--files` files and `--mb` megabytes.
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Files of the generated tree.
    #[arg(long, default_value_t = 14_000)]
    pub files: usize,
    /// Megabytes of the generated tree.
    #[arg(long, default_value_t = 233)]
    pub mb: u64,
    /// Branch counts to run, one whole run each.
    #[arg(long, value_delimiter = ',', default_value = "4,32")]
    pub branches: Vec<usize>,
    /// `run_command` calls per branch.
    #[arg(long, default_value_t = 10)]
    pub commands: usize,
    /// Skip the git-worktree comparison.
    #[arg(long)]
    pub no_git: bool,
    /// Run forkfleet's run over the first run's store, and git's worktrees, this many times
    /// each (alternating), and report each side's best.
    #[arg(long, default_value_t = 1)]
    pub repeat: usize,
    /// Give up on a whole run after this many seconds.
    #[arg(long, default_value_t = 1200)]
    pub timeout_s: u64,
    /// Print one JSON document instead of text.
    #[arg(long)]
    pub json: bool,
}

/// One whole run, forkfleet's and git worktrees'.
#[derive(Debug, Serialize)]
struct RunRow {
    branches: usize,
    /// A first run: no stat cache, an empty run store (the workspace hashed and stored).
    forkfleet_wall_s: f64,
    forkfleet_peak_rss_mb: f64,
    /// The same run again over the same store and stat cache (as a user's next fork of a
    /// workspace, and as git's side, whose repository exists before it is timed): the
    /// best of `--repeat` runs, and the largest peak RSS.
    forkfleet_warm_wall_s: f64,
    forkfleet_warm_peak_rss_mb: f64,
    /// Every run over the first run's store, in order.
    forkfleet_warm_walls_s: Vec<f64>,
    /// Making git's repository (`git init`, `add -A`, `commit`), timed apart.
    git_repo_s: Option<f64>,
    /// What git's objects take on disk (every file deflated): how well the tree compresses.
    git_objects_mb: Option<f64>,
    /// One worktree per branch and the commands in them: the best of `--repeat`.
    git_worktree_wall_s: Option<f64>,
    git_worktree_walls_s: Vec<f64>,
    git_peak_rss_mb: Option<f64>,
    /// forkfleet's first run against git's repository and worktrees together.
    ratio: Option<f64>,
    /// forkfleet's run over its store against git's worktrees over its repository.
    ratio_warm: Option<f64>,
}

#[derive(Debug, Serialize)]
struct WorkspaceResult {
    files: usize,
    mb: f64,
    snapshot_cold_s: f64,
    snapshot_warm_s: f64,
    snapshot_warm_files_read: usize,
    /// A branch's kept tree, layered over the fork's base (the default where the kernel
    /// allows it).
    call_kept_p50_ms: f64,
    call_kept_p90_ms: f64,
    /// A branch's kept tree, whole (where trees cannot be layered).
    call_whole_p50_ms: f64,
    call_whole_p90_ms: f64,
    call_fresh_p50_ms: f64,
    call_fresh_p90_ms: f64,
    runs: Vec<RunRow>,
}

pub async fn cmd_workspace(args: WorkspaceArgs) -> anyhow::Result<()> {
    let scratch = tempfile::Builder::new()
        .prefix("forkfleet-bench-ws-")
        .tempdir()?;
    let tree = scratch.path().join("workspace");
    match &args.dir {
        Some(src) => copy_tree(src, &tree)?,
        None => generate(&tree, args.files, args.mb * 1_000_000)?,
    }
    let opts = ScanOptions::names_only(&[".git".to_string()]);

    // Snapshot, cold then warm.
    settle()?;
    let t = Instant::now();
    let listing = scan::list(&tree, &opts)?;
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let (manifest, _) = scan::hash(&listing, &StatCache::default(), threads)?;
    let snapshot_cold_s = t.elapsed().as_secs_f64();
    let cache_file = scratch.path().join("stat-cache");
    StatCache::save(&cache_file, &listing, &manifest)?;
    let cache = StatCache::load(&cache_file);
    let t = Instant::now();
    let (_, warm) = scan::hash(&scan::list(&tree, &opts)?, &cache, threads)?;
    let snapshot_warm_s = t.elapsed().as_secs_f64();
    let (files, bytes) = (manifest.files.len(), manifest.total_bytes());
    eprintln!(
        "tree: {files} files, {:.1} MB; snapshot {snapshot_cold_s:.2} s cold, {snapshot_warm_s:.2} s warm",
        bytes as f64 / 1e6
    );

    // Whole runs.
    let mut runs = Vec::new();
    for &n in &args.branches {
        settle()?;
        let (wall, rss) = forkfleet_run(scratch.path(), &tree, n, args.commands, args.timeout_s)?;
        let repo = if args.no_git {
            None
        } else {
            Some(git_repo(scratch.path(), &tree, n)?)
        };
        let (mut warm_walls, mut warm_rss) = (Vec::new(), 0.0_f64);
        let (mut git_walls, mut git_rss) = (Vec::new(), 0.0_f64);
        for round in 0..args.repeat.max(1) {
            settle()?;
            let (w, r) = forkfleet_run(scratch.path(), &tree, n, args.commands, args.timeout_s)?;
            warm_walls.push(w);
            warm_rss = warm_rss.max(r);
            if let Some((repo, _, _)) = &repo {
                settle()?;
                let (w, r) = git_worktrees(repo, n, args.commands, round)?;
                git_walls.push(w);
                git_rss = git_rss.max(r);
            }
        }
        let warm = best(&warm_walls);
        let git = repo
            .as_ref()
            .map(|(_, repo_s, _)| (*repo_s, best(&git_walls)));
        let git_objects_mb = repo.as_ref().map(|(_, _, b)| *b as f64 / 1e6);
        eprintln!(
            "{n} branches x {} commands: forkfleet {wall:.2} s (peak RSS {rss:.0} MB), again {warm:.2} s ({warm_rss:.0} MB){}",
            args.commands,
            git.map(|(repo_s, w)| format!(
                "; git repository {repo_s:.2} s ({:.1} MB of objects), worktrees {w:.2} s (peak RSS {git_rss:.0} MB)",
                git_objects_mb.unwrap_or_default()
            ))
            .unwrap_or_default()
        );
        runs.push(RunRow {
            branches: n,
            forkfleet_wall_s: wall,
            forkfleet_peak_rss_mb: rss,
            forkfleet_warm_wall_s: warm,
            forkfleet_warm_peak_rss_mb: warm_rss,
            forkfleet_warm_walls_s: warm_walls,
            git_repo_s: git.map(|g| g.0),
            git_objects_mb,
            git_worktree_wall_s: git.map(|g| g.1),
            git_worktree_walls_s: git_walls,
            git_peak_rss_mb: git.map(|_| git_rss),
            ratio: git.map(|(repo_s, w)| wall / (repo_s + w)),
            ratio_warm: git.map(|(_, w)| warm / w),
        });
    }
    // Per-call overhead through the worker's tool code: after the whole runs, since its
    // fresh copies make and remove a tree per call (ext4 then allocates inodes more
    // slowly for a while, which would slow whichever side came next).
    let CallFigures { kept, whole, fresh } =
        call_overhead(scratch.path(), &listing, &manifest, args.commands.max(2)).await?;
    eprintln!(
        "run_command overhead: layered kept tree p50 {:.1} ms p90 {:.1} ms; whole kept tree p50 {:.1} ms p90 {:.1} ms; fresh copy p50 {:.1} ms p90 {:.1} ms",
        kept.0, kept.1, whole.0, whole.1, fresh.0, fresh.1
    );

    let result = WorkspaceResult {
        files,
        mb: bytes as f64 / 1e6,
        snapshot_cold_s,
        snapshot_warm_s,
        snapshot_warm_files_read: warm.read,
        call_kept_p50_ms: kept.0,
        call_kept_p90_ms: kept.1,
        call_whole_p50_ms: whole.0,
        call_whole_p90_ms: whole.1,
        call_fresh_p50_ms: fresh.0,
        call_fresh_p90_ms: fresh.1,
        runs,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&result)?);
    } else {
        print!("{}", table(&result, args.commands));
    }
    Ok(())
}

fn table(r: &WorkspaceResult, commands: usize) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "tree: {} files, {:.1} MB", r.files, r.mb);
    let _ = writeln!(
        out,
        "snapshot: {:.2} s cold, {:.2} s warm ({} files read)",
        r.snapshot_cold_s, r.snapshot_warm_s, r.snapshot_warm_files_read
    );
    let _ = writeln!(
        out,
        "run_command overhead per call: layered kept tree p50 {:.1} ms, p90 {:.1} ms; whole kept tree p50 {:.1} ms, p90 {:.1} ms; fresh copy p50 {:.1} ms, p90 {:.1} ms",
        r.call_kept_p50_ms,
        r.call_kept_p90_ms,
        r.call_whole_p50_ms,
        r.call_whole_p90_ms,
        r.call_fresh_p50_ms,
        r.call_fresh_p90_ms
    );
    let _ = writeln!(
        out,
        "first run, storing the workspace (against git's repository made and its worktrees):"
    );
    let _ = writeln!(
        out,
        "{:>8}  {:>13}  {:>12}  {:>12}  {:>13}  {:>12}  {:>7}",
        "BRANCHES",
        "FORKFLEET_S",
        "PEAK_RSS_MB",
        "GIT_REPO_S",
        "WORKTREES_S",
        "PEAK_RSS_MB",
        "RATIO"
    );
    let secs = |s: Option<f64>| s.map(|s| format!("{s:.2}")).unwrap_or_else(|| "-".into());
    let ratio = |r: Option<f64>| r.map(|s| format!("{s:.3}")).unwrap_or_else(|| "-".into());
    for row in &r.runs {
        let _ = writeln!(
            out,
            "{:>8}  {:>13.2}  {:>12.0}  {:>12}  {:>13}  {:>12}  {:>7}",
            row.branches,
            row.forkfleet_wall_s,
            row.forkfleet_peak_rss_mb,
            secs(row.git_repo_s),
            secs(row.git_worktree_wall_s),
            row.git_peak_rss_mb
                .map(|s| format!("{s:.0}"))
                .unwrap_or_else(|| "-".into()),
            ratio(row.ratio),
        );
    }
    if let Some(objects) = r.runs.iter().find_map(|row| row.git_objects_mb) {
        let _ = writeln!(
            out,
            "(git's objects take {objects:.1} MB: the tree deflates {:.1}:1)",
            r.mb / objects.max(f64::MIN_POSITIVE)
        );
    }
    let _ = writeln!(
        out,
        "again, over the first run's store and stat cache (against git's worktrees over its repository; each side's best):"
    );
    let _ = writeln!(
        out,
        "{:>8}  {:>13}  {:>12}  {:>13}  {:>7}",
        "BRANCHES", "FORKFLEET_S", "PEAK_RSS_MB", "WORKTREES_S", "RATIO"
    );
    for row in &r.runs {
        let _ = writeln!(
            out,
            "{:>8}  {:>13.2}  {:>12.0}  {:>13}  {:>7}",
            row.branches,
            row.forkfleet_warm_wall_s,
            row.forkfleet_warm_peak_rss_mb,
            secs(row.git_worktree_wall_s),
            ratio(row.ratio_warm),
        );
    }
    let _ = writeln!(
        out,
        "({commands} run_command calls and one write per branch)"
    );
    out
}

/// A tree shaped like a crate registry's sources: `files` files over directories of about
/// 20, sizes spread around the mean (a few large ones), and text that compresses as source
/// code does.
///
/// The text is lines of tokens (keywords, punctuation and 200 made-up identifiers), 88 lines
/// in 100 a repeat of one of the last 64: git stores the default 14,000 files (256 MB) in
/// 47.9 MB of objects (5.4:1), the crates of this machine's cargo registry in 83.1 MB of
/// 465.9 MB (5.6:1). How well
/// the content compresses is what git's side pays for: it stores every file deflated and
/// inflates it at each checkout. A tree of one repeated line (this generator before,
/// 74:1) let git store 257 MB in 3 MB and check it out several times faster than real
/// sources of the same size.
fn generate(dir: &Path, files: usize, bytes: u64) -> anyhow::Result<()> {
    let mean = bytes / files.max(1) as u64;
    let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    const KEYWORDS: [&str; 31] = [
        "fn", "let", "mut", "pub", "impl", "struct", "enum", "match", "if", "else", "return",
        "self", "Self", "use", "mod", "for", "in", "where", "async", "await", "Option", "Result",
        "Vec", "String", "u64", "usize", "&str", "Ok", "Err", "Some", "None",
    ];
    const PUNCTUATION: [&str; 18] = [
        "(", ")", "{", "}", ";", ",", ".", "::", "->", "=>", "=", "&", "<", ">", "[", "]", "?", ":",
    ];
    const LETTERS: &[u8] = b"abcdefghijklmnopqrstuvwxyz_";
    let words: Vec<String> = (0..200)
        .map(|_| {
            let len = 2 + next() % 11;
            (0..len)
                .map(|_| LETTERS[(next() % LETTERS.len() as u64) as usize] as char)
                .collect()
        })
        .collect();
    let mut recent: std::collections::VecDeque<String> = std::collections::VecDeque::new();
    let mut line = |next: &mut dyn FnMut() -> u64| -> String {
        if !recent.is_empty() && next() % 100 < 88 {
            return recent[(next() % recent.len() as u64) as usize].clone();
        }
        let mut l = "    ".repeat((next() % 5) as usize);
        for i in 0..next() % 13 {
            if i > 0 {
                l.push(' ');
            }
            let pick = next() % 10;
            l.push_str(match pick {
                0..=2 => KEYWORDS[(next() % KEYWORDS.len() as u64) as usize],
                3..=5 => PUNCTUATION[(next() % PUNCTUATION.len() as u64) as usize],
                _ => &words[(next() % words.len() as u64) as usize],
            });
        }
        l.push('\n');
        recent.push_back(l.clone());
        if recent.len() > 64 {
            recent.pop_front();
        }
        l
    };
    for i in 0..files {
        let d = dir.join(format!("crate{}/src/m{}", i / 200, (i / 20) % 10));
        std::fs::create_dir_all(&d)?;
        // Sizes from 1/8 to ~2x the mean, and every 500th file 20x.
        let r = next();
        let mut size = mean / 8 + (r % (mean * 15 / 8 + 1));
        if i % 500 == 0 {
            size = mean * 20;
        }
        let mut text = String::with_capacity(size as usize + 128);
        let _ = writeln!(text, "// file {i} seed {r}");
        while (text.len() as u64) < size {
            text.push_str(&line(&mut next));
        }
        std::fs::write(d.join(format!("f{i}.rs")), text)?;
    }
    Ok(())
}

/// Copy `src` into `dst` (files, directories and symlinks; `.git` left out).
fn copy_tree(src: &Path, dst: &Path) -> anyhow::Result<()> {
    let listing = scan::list(src, &ScanOptions::names_only(&[".git".to_string()]))?;
    std::fs::create_dir_all(dst)?;
    for d in &listing.dirs {
        std::fs::create_dir_all(d.to_os_path(dst))?;
    }
    for f in &listing.files {
        let to = f.path.to_os_path(dst);
        match &f.link {
            Some(target) => std::os::unix::fs::symlink(target, &to)?,
            None => {
                std::fs::copy(&f.full, &to)?;
            }
        }
    }
    Ok(())
}

/// p50 and p90 of a branch's `run_command` calls through the worker's tool code, with a
/// kept tree and with a fresh copy per call, in ms.
async fn call_overhead(
    scratch: &Path,
    listing: &scan::Listing,
    manifest: &forkfleet_shared::manifest::Manifest,
    calls: usize,
) -> anyhow::Result<CallFigures> {
    // The blobs in a run store on disk, as an embedded worker reads them: this process
    // stays the size of a worker.
    let store = forkfleet_coordinator::store::RunStore::open(&scratch.join("store"))?;
    let blobs = store.blob_store();
    for f in &listing.files {
        if let Some(e) = manifest.files.get(&f.path) {
            let bytes = scan::read_checked(f, e)?;
            blobs.put(e.hash, bytes::Bytes::from(bytes)).await?;
        }
    }
    let cache = BlobCache::new(blobs, forkfleet_node::embedded::EMBEDDED_BLOB_CACHE_BYTES);
    let base = Arc::new(manifest.clone());
    let snapshot = forkfleet_shared::blob::BlobHash::of(&manifest.to_blob()?);
    let tool = forkfleet_shared::endpoint::CommandTool {
        timeout_s: 60.0,
        env: BTreeMap::new(),
        max_output_bytes: 4096,
        sandbox: Default::default(),
    };
    let kept_in = |trees: Trees| {
        ToolBox::with_command(Some(tool.clone())).with_trees(TreeSlot {
            trees: Arc::new(trees),
            key: TreeKey {
                fork: forkfleet_shared::ids::ForkId::new(),
                label: "bench".into(),
            },
            snapshot,
        })
    };
    let layered = Trees::new(4 << 30);
    anyhow::ensure!(
        layered.layered(),
        "command trees are not layered here (no overlayfs in a user namespace): the bench compares a layered tree with a whole one"
    );
    let kept = kept_in(layered);
    let whole = kept_in(Trees::new(4 << 30).whole_trees());
    let fresh = ToolBox::with_command(Some(tool));
    let mut out = Vec::new();
    for tools in [&kept, &whole, &fresh] {
        let mut ov = forkfleet_shared::overlay::Overlay::new(base.clone());
        let mut ms = Vec::new();
        // The first call of a kept tree materialises it: not counted (every call of a
        // fresh copy does, and is counted).
        for i in 0..=calls {
            let call = forkfleet_shared::event::ToolCall {
                id: format!("c{i}"),
                name: RUN_COMMAND.into(),
                args: serde_json::json!({ "command": "true" }),
            };
            let t = Instant::now();
            let r = tools.run(&call, &mut ov, &cache).await?;
            anyhow::ensure!(r.ok, "the bench's command failed: {}", r.output);
            if i > 0 {
                ms.push(t.elapsed().as_secs_f64() * 1000.0);
            }
            if std::ptr::eq(tools, &fresh) && ms.len() >= 3 {
                break; // A fresh copy per call takes seconds: three calls tell.
            }
        }
        ms.sort_by(|a, b| a.total_cmp(b));
        out.push((pct(&ms, 0.5), pct(&ms, 0.9)));
    }
    match out[..] {
        [kept, whole, fresh] => Ok(CallFigures { kept, whole, fresh }),
        _ => anyhow::bail!("the per-call bench measured {} ways, not 3", out.len()),
    }
}

/// Per-call overhead (p50, p90 in ms) of a layered kept tree, a whole kept tree and a
/// fresh copy per call.
struct CallFigures {
    kept: (f64, f64),
    whole: (f64, f64),
    fresh: (f64, f64),
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// `forkfleet run` of a spec forking `tree` into `n` branches, each making `commands`
/// `run_command` calls then writing a file; wall seconds and peak RSS (MB) of the process.
/// Called again for the same `n`, it runs over the store and stat cache the first call
/// left.
fn forkfleet_run(
    scratch: &Path,
    tree: &Path,
    n: usize,
    commands: usize,
    timeout_s: u64,
) -> anyhow::Result<(f64, f64)> {
    let dir = scratch.join(format!("run-{n}"));
    std::fs::create_dir_all(&dir)?;
    let mut script = String::new();
    for i in 0..commands {
        let _ = writeln!(
            script,
            "[[turns.\"*\"]]\ntool_calls = [{{ name = \"run_command\", args = {{ command = [\"sh\", \"-c\", \"ls | wc -l # {i}\"] }} }}]\n"
        );
    }
    script.push_str("[[turns.\"*\"]]\ntool_calls = [{ name = \"write_file\", args = { path = \"BRANCH.txt\", content = \"done\\n\" } }]\n\n[[turns.\"*\"]]\ntext = \"done\"\n");
    std::fs::write(dir.join("script.toml"), script)?;
    let mut spec = format!(
        "goal = \"bench workspace\"\nworkspace = {:?}\nmodel = \"scripted:bench\"\nmax_turns = {}\nmax_branches = {n}\n\n[models.\"scripted:bench\"]\nscript = \"script.toml\"\n\n[run_command]\ntimeout_s = 60\n\n",
        tree.display().to_string(),
        commands + 5
    );
    for b in 0..n {
        let _ = writeln!(
            spec,
            "[[branches]]\nlabel = \"b{b}\"\nsteer = \"branch {b}\"\n"
        );
    }
    std::fs::write(dir.join("fork.toml"), spec)?;
    let exe = std::env::current_exe()?;
    let t = Instant::now();
    let out = std::process::Command::new("/usr/bin/time")
        .arg("-f")
        .arg("%M")
        .arg(exe)
        .args(["run", "fork.toml", "--json", "--timeout-s"])
        .arg(timeout_s.to_string())
        .arg("--data")
        .arg(dir.join("data"))
        .current_dir(&dir)
        // The stat cache in the run's directory: empty for the first run, the first run's
        // for the next.
        .env("XDG_CACHE_HOME", dir.join("cache"))
        .output()
        .context("running forkfleet under /usr/bin/time (Debian package `time`)")?;
    let wall = t.elapsed().as_secs_f64();
    let stderr = String::from_utf8_lossy(&out.stderr);
    anyhow::ensure!(
        out.status.success(),
        "forkfleet run failed: {}",
        stderr.lines().rev().take(5).collect::<Vec<_>>().join(" / ")
    );
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    let done = doc["branches"]
        .as_array()
        .map(|b| b.iter().filter(|b| b["state"] == "done").count())
        .unwrap_or(0);
    anyhow::ensure!(done == n, "only {done} of {n} branches finished done");
    Ok((wall, max_rss_mb(&stderr)))
}

/// The last number `/usr/bin/time -f %M` printed (KB), in MB.
fn max_rss_mb(stderr: &str) -> f64 {
    stderr
        .lines()
        .rev()
        .find_map(|l| l.trim().parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0)
}

/// Write out what earlier steps left dirty in the page cache, so that the next timed step
/// does not pay for their writeback (a first run's store, the tree's copy, git's objects).
fn settle() -> anyhow::Result<()> {
    let status = std::process::Command::new("sync")
        .status()
        .context("running sync")?;
    anyhow::ensure!(status.success(), "sync failed: {status}");
    Ok(())
}

/// The shortest of `walls` (0 for none).
fn best(walls: &[f64]) -> f64 {
    walls.iter().copied().reduce(f64::min).unwrap_or(0.0)
}

/// Run git in `dir` under `/usr/bin/time`; its peak RSS (MB).
fn git(dir: &Path, args: &[&str]) -> anyhow::Result<f64> {
    let out = std::process::Command::new("/usr/bin/time")
        .args([
            "-f",
            "%M",
            "git",
            "-c",
            "user.name=bench",
            "-c",
            "user.email=bench@invalid",
        ])
        .args(args)
        .current_dir(dir)
        .output()
        .context("running git")?;
    anyhow::ensure!(
        out.status.success(),
        "git {} failed: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(max_rss_mb(&String::from_utf8_lossy(&out.stderr)))
}

/// A git repository of `tree` (a copy of it, committed), for `n` branches' worktrees, the
/// seconds that `git init`, `add -A` and `commit` took, timed on a settled disk, and the
/// bytes of its objects.
fn git_repo(scratch: &Path, tree: &Path, n: usize) -> anyhow::Result<(PathBuf, f64, u64)> {
    let repo = scratch.join(format!("git-{n}"));
    copy_tree(tree, &repo)?;
    settle()?;
    let t = Instant::now();
    git(&repo, &["init", "-q"])?;
    git(&repo, &["add", "-A"])?;
    git(&repo, &["commit", "-qm", "base"])?;
    let took = t.elapsed().as_secs_f64();
    let objects = scan::list(&repo.join(".git/objects"), &ScanOptions::names_only(&[]))?
        .files
        .iter()
        .map(|f| f.stat.size)
        .sum();
    Ok((repo, took, objects))
}

/// The same work with one git worktree per branch, every branch at once: `git worktree
/// add`, the commands in place, one file written. Wall seconds and the largest peak RSS of
/// the git processes (MB). The worktrees are removed afterwards (not timed).
fn git_worktrees(
    repo: &Path,
    n: usize,
    commands: usize,
    round: usize,
) -> anyhow::Result<(f64, f64)> {
    let t = Instant::now();
    // `git worktree add` one after the other (concurrent adds race on the repository's
    // worktree list), then every branch's work at once.
    let mut rss = 0.0_f64;
    let mut trees = Vec::new();
    for b in 0..n {
        let wt = repo.with_file_name(format!("{}-r{round}-wt{b}", repo.display()));
        let wt_s = wt.display().to_string();
        rss = rss.max(git(repo, &["worktree", "add", "-q", "--detach", &wt_s])?);
        trees.push(wt);
    }
    std::thread::scope(|s| {
        let handles: Vec<_> = trees
            .iter()
            .map(|wt| {
                s.spawn(move || -> anyhow::Result<()> {
                    for i in 0..commands {
                        let out = std::process::Command::new("sh")
                            .args(["-c", &format!("ls | wc -l # {i}")])
                            .current_dir(wt)
                            .output()?;
                        anyhow::ensure!(out.status.success(), "a command failed");
                    }
                    std::fs::write(wt.join("BRANCH.txt"), "done\n")?;
                    Ok(())
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("a worktree thread panicked")))
            })
            .collect::<anyhow::Result<Vec<()>>>()
    })?;
    let wall = t.elapsed().as_secs_f64();
    for wt in &trees {
        std::fs::remove_dir_all(wt)?;
    }
    git(repo, &["worktree", "prune"])?;
    Ok((wall, rss))
}
