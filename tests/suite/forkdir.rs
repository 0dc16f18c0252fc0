//! The materialised fork directory (`<workspace>/.forkfleet/forks/<id>/`) and
//! `forkfleet fork open`: the layout after a run, live updates, removal after a merge (kept
//! with `keep_artifacts`), confinement against hostile labels, and each diff tool.

use super::harness::{branch, forkfleet, forkfleet_env, json, path_str, run_spec, stderr, Example};
use bytes::Bytes;
use forkfleet_client::forkdir;
use forkfleet_shared::api::{BranchView, ForkView};
use forkfleet_shared::blob::{BlobHash, MemBlobStore};
use forkfleet_shared::diff::{
    Agreement, BranchChange, DiffReport, DiffSummary, FileInfo, Operation, PathDiff,
};
use forkfleet_shared::event::Usage;
use forkfleet_shared::ids::{ForkId, RunId};
use forkfleet_shared::manifest::MODE_FILE;
use forkfleet_shared::path::WsPath;
use forkfleet_shared::state::{BranchState, ForkState};
use serde_json::Value;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::{Duration, Instant};

/// A file of the quickstart workspace as shipped.
fn shipped(rel: &str) -> String {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("examples/quickstart/workspace")
        .join(rel);
    std::fs::read_to_string(p).unwrap()
}

/// Run the quickstart fork (no pick) and return the example and the fork id.
fn run_quickstart() -> (Example, String) {
    let ex = Example::quickstart();
    let doc = json(&run_spec(&ex.spec()));
    let id = doc["fork_id"].as_str().unwrap().to_string();
    (ex, id)
}

fn fork_dir(ex: &Example, id: &str) -> PathBuf {
    ex.workspace().join(".forkfleet/forks").join(id)
}

fn read(p: &Path) -> Option<String> {
    std::fs::read_to_string(p).ok()
}

/// Every non-directory under `root`, relative, `/`-separated (symbolic links included).
fn files_under(root: &Path) -> BTreeSet<String> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeSet<String>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return; // Replaced by a sync meanwhile.
        };
        for e in entries {
            let Ok(e) = e else { continue };
            // A file a sync is writing (a temporary name, renamed into place once whole).
            if e.file_name().to_string_lossy().starts_with(".ff-tmp-") {
                continue;
            }
            let Ok(ft) = e.file_type() else { continue };
            if ft.is_dir() {
                walk(root, &e.path(), out);
            } else {
                let rel = e.path().strip_prefix(root).unwrap().to_path_buf();
                out.insert(rel.to_string_lossy().replace('\\', "/"));
            }
        }
    }
    let mut out = BTreeSet::new();
    if root.exists() {
        walk(root, root, &mut out);
    }
    out
}

fn manifest(dir: &Path) -> Value {
    serde_json::from_str(&read(&dir.join("manifest.json")).expect("manifest.json")).unwrap()
}

fn manifest_path<'a>(m: &'a Value, p: &str) -> &'a Value {
    m["paths"]
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["path"] == p)
        .unwrap_or_else(|| panic!("no path {p} in {m}"))
}

fn ok(out: &Output) -> String {
    assert!(
        out.status.success(),
        "exit {:?}\nstdout: {}\nstderr: {}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        stderr(out)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn run_materializes_the_parent_and_every_branch() {
    let (ex, id) = run_quickstart();
    let dir = fork_dir(&ex, &id);
    let original = |rel: &str| shipped(rel);
    assert!(original("README.md").contains("TODO: describe usage."));

    // Exactly the touched paths, in the parent and in every branch (a deleted path absent,
    // an untouched one the parent's).
    let mut expect: BTreeSet<String> = ["manifest.json"].iter().map(|s| s.to_string()).collect();
    for p in ["README.md", "greet.py", "docs/legacy.md", "notes/todo.md"] {
        expect.insert(format!("parent/{p}"));
    }
    for p in ["README.md", "greet.py", "notes/todo.md"] {
        expect.insert(format!("branches/concise/{p}"));
    }
    for p in [
        "README.md",
        "greet.py",
        "docs/legacy.md",
        "notes/todo.md",
        "tests/test_greet.py",
    ] {
        expect.insert(format!("branches/thorough/{p}"));
    }
    for p in ["README.md", "greet.py", "notes/todo.md"] {
        expect.insert(format!("branches/tidy/{p}"));
    }
    assert_eq!(files_under(&dir), expect);

    // parent/: the fork-time versions.
    for p in ["README.md", "greet.py", "docs/legacy.md", "notes/todo.md"] {
        assert_eq!(
            read(&dir.join("parent").join(p)).unwrap(),
            original(p),
            "{p}"
        );
    }
    // branches/<label>/: each branch's version.
    let b = |label: &str, p: &str| read(&dir.join("branches").join(label).join(p));
    assert!(b("concise", "greet.py").unwrap().contains("Hello, {name}!"));
    assert!(b("concise", "README.md")
        .unwrap()
        .contains("Run `python greet.py NAME`."));
    assert_eq!(
        b("concise", "notes/todo.md").unwrap(),
        original("notes/todo.md")
    );
    assert!(
        b("concise", "docs/legacy.md").is_none(),
        "deleted by concise"
    );
    assert!(b("thorough", "greet.py")
        .unwrap()
        .contains("name or 'world'"));
    assert!(b("thorough", "tests/test_greet.py")
        .unwrap()
        .contains("def test_missing_name"));
    assert!(b("thorough", "notes/todo.md")
        .unwrap()
        .contains("- [x] handle a missing name"));
    assert_eq!(
        b("thorough", "docs/legacy.md").unwrap(),
        original("docs/legacy.md")
    );
    assert_eq!(
        b("tidy", "notes/todo.md").unwrap(),
        "# To do\n\nNothing open.\n"
    );
    assert_eq!(b("tidy", "greet.py").unwrap(), original("greet.py"));

    // manifest.json: the fork, its branches and the touched paths.
    let m = manifest(&dir);
    assert_eq!(m["fork_id"], id.as_str());
    assert_eq!(m["state"], "settled");
    assert_eq!(m["keep_artifacts"], false);
    assert_eq!(m["parent_dir"], "parent");
    assert!(m["goal"].as_str().unwrap().contains("greet tool"));
    let concise = branch(&m, "concise");
    assert_eq!(concise["dir"], "branches/concise");
    assert_eq!(concise["state"], "done");
    assert!(concise["cost_usd"].as_f64().unwrap() > 0.0);
    assert_eq!(concise["turns"], 3);
    assert_eq!(concise["changes"], 3);
    assert_eq!(
        concise["modified"],
        serde_json::json!(["README.md", "greet.py"])
    );
    assert_eq!(concise["deleted"], serde_json::json!(["docs/legacy.md"]));
    assert_eq!(
        branch(&m, "thorough")["created"],
        serde_json::json!(["tests/test_greet.py"])
    );
    assert_eq!(m["paths"].as_array().unwrap().len(), 5);
    let legacy = manifest_path(&m, "docs/legacy.md");
    assert_eq!(legacy["agreement"], "unanimous_change");
    assert_eq!(legacy["branches"]["concise"]["operation"], "deleted");
    assert_eq!(legacy["branches"]["concise"]["file"], Value::Null);
    assert!(legacy["branches"].get("thorough").is_none());
    assert!(legacy["parent"]["hash"].as_str().unwrap().len() == 64);
    assert_eq!(
        manifest_path(&m, "tests/test_greet.py")["parent"],
        Value::Null
    );

    // The workspace itself is untouched but for `.forkfleet/`.
    for p in ["README.md", "greet.py", "docs/legacy.md", "notes/todo.md"] {
        assert_eq!(ex.read(p).unwrap(), original(p), "{p}");
    }

    // A merge removes the fork directory, and the `.forkfleet/` it left empty.
    let out = forkfleet(&[
        "fork",
        "merge",
        &id,
        "--pick",
        "concise",
        "--data",
        path_str(&ex.data()),
    ]);
    ok(&out);
    assert!(!dir.exists(), "the fork directory must go after the merge");
    assert!(!ex.workspace().join(".forkfleet").exists());
    assert!(ex.read("greet.py").unwrap().contains("Hello, {name}!"));
}

#[test]
fn keep_artifacts_keeps_the_directory_after_a_merge_and_run_pick_removes_it_otherwise() {
    // keep_artifacts = true: `run --pick` merges and the directory stays.
    let ex = Example::quickstart();
    let text = std::fs::read_to_string(ex.spec()).unwrap();
    let kept = ex.write_spec(&text.replacen("\n[models.", "\nkeep_artifacts = true\n[models.", 1));
    let doc = json(&forkfleet(&[
        "run",
        path_str(&kept),
        "--pick",
        "concise",
        "--json",
        "--timeout-s",
        "120",
    ]));
    assert_eq!(doc["state"], "merged");
    let id = doc["fork_id"].as_str().unwrap();
    let dir = fork_dir(&ex, id);
    assert!(
        read(&dir.join("branches/thorough/tests/test_greet.py")).is_some(),
        "kept: {:?}",
        files_under(&dir)
    );
    assert_eq!(manifest(&dir)["keep_artifacts"], true);
    // Brought up to date at the merge: it said `settled`, winner null.
    assert_eq!(manifest(&dir)["state"], "merged");
    assert_eq!(manifest(&dir)["winner"], "concise");

    // Without it, `run --pick` removes the directory once merged.
    let ex = Example::quickstart();
    let doc = json(&forkfleet(&[
        "run",
        path_str(&ex.spec()),
        "--pick",
        "tidy",
        "--json",
        "--timeout-s",
        "120",
    ]));
    assert_eq!(doc["state"], "merged");
    assert!(!fork_dir(&ex, doc["fork_id"].as_str().unwrap()).exists());
    assert!(!ex.workspace().join(".forkfleet").exists());
    assert_eq!(
        ex.read("notes/todo.md").unwrap(),
        "# To do\n\nNothing open.\n"
    );
}

/// A child process killed (and waited for) when dropped, a failed assertion included.
struct Killed(std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn the_directory_follows_a_running_fork() {
    let ex = Example::quickstart();
    let spec = super::harness::slow_spec(&ex);
    let mut child = Killed(
        super::harness::command()
            .args(["run", path_str(&spec), "--json", "--timeout-s", "120"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    // Branch a's files as the fork directory shows them, once it has a manifest, polled
    // until `done` says so; the run must still be going (each branch writes for 15 s).
    let forks = ex.workspace().join(".forkfleet/forks");
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut poll = |what: &str, done: &dyn Fn(&BTreeSet<String>) -> bool| loop {
        let found = std::fs::read_dir(&forks).ok().and_then(|mut it| {
            let dir = it.next()?.ok()?.path();
            let files = files_under(&dir.join("branches/a/slow"));
            dir.join("manifest.json").is_file().then_some((dir, files))
        });
        let running = child.0.try_wait().unwrap().is_none();
        if let Some((dir, files)) = found.filter(|(_, f)| done(f)) {
            assert!(running, "the run ended before {what}");
            break (dir, files);
        }
        assert!(running, "the run ended without {what}");
        assert!(Instant::now() < deadline, "no {what} in 60 s");
        std::thread::sleep(Duration::from_millis(50));
    };
    let (dir, first) = poll("a live update", &|f| !f.is_empty());
    assert!(first.iter().all(|f| f.starts_with("a-")), "{first:?}");
    // The manifest written with them says the fork is still open.
    let m = manifest(&dir);
    assert_eq!(m["state"], "open", "{m}");
    // And it keeps following: a later sync, while the fork is still open (not the final
    // sync after it settled), brings the files written since.
    let (dir, later) = poll("a second live update", &|f| f.len() > first.len());
    assert!(later.is_superset(&first), "{first:?} then {later:?}");
    let m = manifest(&dir);
    assert_eq!(
        m["state"], "open",
        "only the final sync updated the directory: {m}"
    );
}

// ---- confinement ---------------------------------------------------------------------

fn info(bytes: &[u8]) -> FileInfo {
    FileInfo {
        hash: BlobHash::of(bytes),
        size: bytes.len() as u64,
        binary: false,
        mode: MODE_FILE,
    }
}

fn branch_view(label: &str) -> BranchView {
    BranchView {
        label: label.to_string(),
        run_id: RunId::new(),
        state: BranchState::Done,
        error: None,
        turns: 1,
        usage: Usage::default(),
        cost_usd: 0.5,
        changes: 1,
        events: 3,
        approval: None,
        blocked: Vec::new(),
        last_message_preview: None,
        first_seq: 1,
        unpriced_model: None,
    }
}

fn view(labels: &[&str], workspace: &Path) -> ForkView {
    ForkView {
        fork_id: ForkId::new(),
        name: None,
        parent_run: RunId::new(),
        goal: "g".into(),
        state: ForkState::Settled,
        created_at_ms: 0,
        snapshot: BlobHash::of(b""),
        workspace: Some(workspace.display().to_string()),
        left_out: None,
        branches: labels.iter().map(|l| branch_view(l)).collect(),
        keep_artifacts: false,
        git: None,
    }
}

/// A report: every branch modified `src/x.txt` (branch `i` wrote `v{i}`), the first one
/// also created `new.txt` when `created`.
fn report(labels: &[&str], store: &MemBlobStore, created: bool) -> DiffReport {
    let parent = store.insert(Bytes::from_static(b"parent\n"));
    assert_eq!(parent, info(b"parent\n").hash);
    let mut changes = Vec::new();
    for i in 0..labels.len() {
        let content = format!("v{i}\n");
        store.insert(Bytes::from(content.clone()));
        changes.push(BranchChange {
            branch: i as u32,
            operation: Operation::Modified,
            entry: Some(info(content.as_bytes())),
            diff: None,
            truncated: false,
        });
    }
    let mut paths = vec![PathDiff {
        path: WsPath::parse("src/x.txt").unwrap(),
        agreement: Agreement::Split,
        parent: Some(info(b"parent\n")),
        changes,
    }];
    if created {
        store.insert(Bytes::from_static(b"new\n"));
        paths.insert(
            0,
            PathDiff {
                path: WsPath::parse("new.txt").unwrap(),
                agreement: Agreement::Unique,
                parent: None,
                changes: vec![BranchChange {
                    branch: 0,
                    operation: Operation::Created,
                    entry: Some(info(b"new\n")),
                    diff: None,
                    truncated: false,
                }],
            },
        );
    }
    DiffReport {
        branches: labels.iter().map(|l| l.to_string()).collect(),
        summary: DiffSummary {
            total_paths_touched: paths.len(),
            unanimous_paths: 0,
            split_paths: 1,
            per_branch_unique: Default::default(),
            agreement_score: 0.0,
            branches: labels.len(),
        },
        paths,
    }
}

#[tokio::test]
async fn a_hostile_label_never_writes_outside_the_fork_directory() {
    let tmp = tempfile::tempdir().unwrap();
    // The workspace is nested so that `../../x` from a branch directory would land inside
    // `tmp` (where we look), were it followed.
    let ws = tmp.path().join("a/b/ws");
    std::fs::create_dir_all(&ws).unwrap();
    let labels = ["../../x", "..", ".", "", "a/b", "..\\..\\y", "/abs", "ok"];
    let v = view(&labels, &ws);
    let store = MemBlobStore::new();
    let r = report(&labels, &store, false);
    let dir = forkdir::fork_dir(&ws, v.fork_id).unwrap();
    // A link planted where a branch directory goes is replaced, never followed.
    let outside = tmp.path().join("outside");
    std::fs::create_dir_all(&outside).unwrap();
    std::fs::create_dir_all(dir.join("branches")).unwrap();
    #[cfg(unix)]
    std::os::unix::fs::symlink(&outside, dir.join("branches/ok")).unwrap();

    let stats = forkdir::materialize(&dir, &v, &r, &store).await.unwrap();
    assert_eq!(stats.branches, labels.len());

    // Nothing outside the fork directory: the only files under tmp are inside it.
    for f in files_under(tmp.path()) {
        assert!(
            tmp.path().join(&f).starts_with(&dir),
            "{f} was written outside {}",
            dir.display()
        );
    }
    assert!(files_under(&outside).is_empty());
    assert!(!Path::new("/abs").exists());
    // Every branch got its own directory right under branches/, the hostile ones encoded.
    let m = manifest(&dir);
    let mut dirs = BTreeSet::new();
    for (i, b) in m["branches"].as_array().unwrap().iter().enumerate() {
        let d = b["dir"].as_str().unwrap();
        let name = d.strip_prefix("branches/").unwrap();
        forkdir::check_component(name).unwrap();
        assert!(dirs.insert(name.to_string()), "{name} used twice");
        assert_eq!(b["label"], labels[i]);
        assert_eq!(
            read(&dir.join(d).join("src/x.txt")).unwrap(),
            format!("v{i}\n"),
            "{d}"
        );
        if labels[i] == "ok" {
            assert_eq!(d, "branches/ok");
            assert!(!std::fs::symlink_metadata(dir.join(d))
                .unwrap()
                .file_type()
                .is_symlink());
        } else {
            assert!(name.starts_with('~'), "{name}");
        }
    }
    assert_eq!(m["skipped"].as_array().unwrap().len(), labels.len() - 1);
}

#[tokio::test]
async fn sync_is_incremental_and_follows_reverted_changes() {
    let tmp = tempfile::tempdir().unwrap();
    let labels = ["a", "b"];
    let v = view(&labels, tmp.path());
    let store = MemBlobStore::new();
    let dir = forkdir::fork_dir(tmp.path(), v.fork_id).unwrap();

    let first = report(&labels, &store, true);
    let s = forkdir::materialize(&dir, &v, &first, &store)
        .await
        .unwrap();
    // parent/src/x.txt, a: x + new, b: x.
    assert_eq!((s.written, s.removed, s.unchanged), (4, 0, 0), "{s:?}");
    assert!(s.manifest_written);
    assert_eq!(read(&dir.join("branches/a/new.txt")).unwrap(), "new\n");
    assert!(read(&dir.join("parent/new.txt")).is_none());

    // The same view again: nothing written.
    let again = forkdir::materialize(&dir, &v, &first, &store)
        .await
        .unwrap();
    assert_eq!((again.written, again.removed, again.unchanged), (0, 0, 4));
    assert!(!again.manifest_written);

    // A file edited in the mirror is put back, whether its size changed or not.
    for edit in ["edited\n", "v9\n"] {
        std::fs::write(dir.join("branches/b/src/x.txt"), edit).unwrap();
        let fixed = forkdir::materialize(&dir, &v, &first, &store)
            .await
            .unwrap();
        assert_eq!((fixed.written, fixed.unchanged), (1, 3), "{edit:?}");
        assert_eq!(read(&dir.join("branches/b/src/x.txt")).unwrap(), "v1\n");
    }

    // Branch a reverts: no new.txt, x.txt back to the parent's. Its files follow.
    let mut second = report(&labels, &store, false);
    second.paths[0].changes.retain(|c| c.branch != 0);
    let s = forkdir::materialize(&dir, &v, &second, &store)
        .await
        .unwrap();
    assert_eq!((s.written, s.removed), (1, 1), "{s:?}");
    assert!(!dir.join("branches/a/new.txt").exists());
    assert_eq!(read(&dir.join("branches/a/src/x.txt")).unwrap(), "parent\n");
    let m = manifest(&dir);
    assert_eq!(m["paths"].as_array().unwrap().len(), 1);
    assert!(branch(&m, "a")["modified"].as_array().unwrap().is_empty());

    // Nothing touched at all: the trees are empty directories, still there for tools.
    let mut none = report(&labels, &store, false);
    none.paths.clear();
    forkdir::materialize(&dir, &v, &none, &store).await.unwrap();
    assert_eq!(
        files_under(&dir),
        ["manifest.json".to_string()].into_iter().collect()
    );
    for d in ["parent", "branches/a", "branches/b"] {
        assert!(dir.join(d).is_dir(), "{d}");
    }
    // The directories left empty are gone.
    assert!(!dir.join("parent/src").exists());
    assert!(!dir.join("branches/a/src").exists());

    // Removal after a merge: gone, with the `.forkfleet/` it leaves empty.
    assert_eq!(
        forkdir::remove_after_merge(&v).unwrap(),
        forkdir::Cleanup::Removed(dir.clone())
    );
    assert!(!tmp.path().join(".forkfleet").exists());
    assert_eq!(
        forkdir::remove_after_merge(&v).unwrap(),
        forkdir::Cleanup::Absent
    );
}

// ---- fork open -----------------------------------------------------------------------

#[cfg(unix)]
fn script(path: &Path, body: &str) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, format!("#!/bin/sh\n{body}")).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

#[cfg(unix)]
#[test]
fn fork_open_runs_the_difftool_template() {
    let (ex, id) = run_quickstart();
    let dir = fork_dir(&ex, &id);
    let tool = ex.dir.path().join("tool.sh");
    let log = ex.dir.path().join("tool.args");
    script(
        &tool,
        &format!(
            "for a in \"$@\"; do printf '%s\\n' \"$a\"; done > '{}'\n",
            log.display()
        ),
    );
    let template = format!("'{}' --base {{parent}} {{branches}}", tool.display());
    let data = ex.data();
    let open = |extra: &[&str]| {
        let mut args = vec!["fork", "open", &id, "--data", path_str(&data)];
        args.extend_from_slice(extra);
        forkfleet_env(&args, &[("FORKFLEET_DIFFTOOL", template.as_str())])
    };

    // The whole directories: the parent, then every branch that changed something.
    std::fs::remove_dir_all(&dir).unwrap();
    let stdout = ok(&open(&[]));
    assert!(stdout.contains("launched:"), "{stdout}");
    let d = dir.display();
    let args: Vec<String> = read(&log).unwrap().lines().map(String::from).collect();
    assert_eq!(
        args,
        vec![
            "--base".to_string(),
            format!("{d}/parent"),
            format!("{d}/branches/concise"),
            format!("{d}/branches/thorough"),
            format!("{d}/branches/tidy"),
        ]
    );
    // It synced first (the directory was gone).
    assert!(dir.join("branches/thorough/tests/test_greet.py").is_file());

    // One path: the parent's file and the file of each branch that touched it.
    ok(&open(&["greet.py"]));
    let args: Vec<String> = read(&log).unwrap().lines().map(String::from).collect();
    assert_eq!(
        args,
        vec![
            "--base".to_string(),
            format!("{d}/parent/greet.py"),
            format!("{d}/branches/concise/greet.py"),
            format!("{d}/branches/thorough/greet.py"),
        ]
    );

    // `--branch`: only those branches against the parent.
    ok(&open(&["--branch", "tidy", "--branch", "concise"]));
    let args: Vec<String> = read(&log).unwrap().lines().map(String::from).collect();
    assert_eq!(
        args,
        vec![
            "--base".to_string(),
            format!("{d}/parent"),
            format!("{d}/branches/concise"),
            format!("{d}/branches/tidy"),
        ]
    );
    let out = open(&["--branch", "nope"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("--branch `nope` is not a branch of fork"),
        "{}",
        stderr(&out)
    );
    // The mirror is read-only: an edit there would be lost at the next sync.
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&dir.join("branches/concise/greet.py")), 0o444);
        assert_eq!(mode(&dir.join("parent/README.md")), 0o444);
    }

    // A path the fork did not touch: bad input listing the touched paths.
    let out = open(&["nope.py"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(err.contains("did not touch `nope.py`"), "{err}");
    assert!(err.contains("README.md, docs/legacy.md, greet.py"), "{err}");
    let out = open(&["../outside"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
}

#[cfg(unix)]
#[test]
fn fork_open_with_code_on_path_diffs_pairwise() {
    let (ex, id) = run_quickstart();
    let dir = fork_dir(&ex, &id);
    let bin = ex.dir.path().join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let log = ex.dir.path().join("code.log");
    script(
        &bin.join("code"),
        &format!("printf '%s\\n' \"$*\" >> '{}'\n", log.display()),
    );
    let data = ex.data();
    let path_var = bin.display().to_string();
    for p in ["README.md", "docs/legacy.md"] {
        let out = forkfleet_env(
            &["fork", "open", &id, p, "--data", path_str(&data)],
            &[("PATH", path_var.as_str())],
        );
        let stdout = ok(&out);
        assert_eq!(stdout.matches("launched:").count(), 2, "{stdout}");
    }
    let d = dir.display();
    let lines: Vec<String> = read(&log).unwrap().lines().map(String::from).collect();
    assert_eq!(
        lines,
        vec![
            format!("--diff {d}/parent/README.md {d}/branches/concise/README.md"),
            format!("--diff {d}/parent/README.md {d}/branches/thorough/README.md"),
            // Deleted by both: the null device stands for the missing file.
            format!("--diff {d}/parent/docs/legacy.md /dev/null"),
            format!("--diff {d}/parent/docs/legacy.md /dev/null"),
        ]
    );
}

#[test]
fn fork_open_without_a_tool_prints_a_coloured_diff() {
    let (ex, id) = run_quickstart();
    let data = ex.data();
    let open = |extra: &[&str]| {
        let mut args = vec!["fork", "open", &id, "--data", path_str(&data)];
        args.extend_from_slice(extra);
        forkfleet_env(&args, &[("PATH", "")])
    };
    // Not a terminal: no colour.
    let stdout = ok(&open(&["README.md"]));
    assert!(stdout.contains("--- parent/README.md"), "{stdout}");
    assert!(!stdout.contains("--- a/"), "{stdout}");
    assert!(
        stdout.contains("+++ branches/concise/README.md"),
        "{stdout}"
    );
    assert!(stdout.contains("-TODO: describe usage."), "{stdout}");
    assert!(stdout.contains("+Run `python greet.py NAME`."), "{stdout}");
    assert!(
        stdout.contains("+Without a name it greets the world."),
        "{stdout}"
    );
    assert!(!stdout.contains('\x1b'), "{stdout}");
    assert!(
        !stdout.contains("tidy"),
        "tidy did not touch README.md: {stdout}"
    );

    // The whole fork, coloured on request: additions green, deletions red, the created
    // and deleted files against nothing.
    let stdout = ok(&open(&["--color", "always"]));
    assert!(
        stdout.contains("\x1b[32m+def test_missing_name():\x1b[0m"),
        "{stdout}"
    );
    assert!(
        stdout.contains("\x1b[31m-TODO: describe usage.\x1b[0m"),
        "{stdout}"
    );
    assert!(stdout.contains("+++ /dev/null"), "{stdout}");
    assert!(stdout.contains("(deleted by tidy)"), "{stdout}");
    assert!(stdout.contains("+Nothing open."), "{stdout}");
}

/// A merge removes the fork directory, and nothing makes it again (issue 13): `run
/// --pick` does not point at a directory it is about to remove, and `fork watch` or
/// `fork open` on the merged fork leave it gone (`open` says why).
#[test]
fn an_aborted_forks_directory_is_removed() {
    let (ex, id) = run_quickstart();
    let dir = fork_dir(&ex, &id);
    assert!(dir.is_dir());
    let data = ex.data();
    ok(&forkfleet(&[
        "fork",
        "abort",
        &id,
        "--data",
        path_str(&data),
    ]));
    assert!(!dir.exists(), "the fork directory of an aborted fork stays");
}

#[test]
fn a_merged_forks_directory_stays_removed() {
    let ex = Example::quickstart();
    let out = forkfleet(&[
        "run",
        path_str(&ex.spec()),
        "--pick",
        "concise",
        "--timeout-s",
        "120",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(!err.contains("fork directory:"), "{err}");
    assert!(!err.contains("fork open"), "{err}");
    let data = ex.data();
    let listed = json(&forkfleet(&[
        "fork",
        "ls",
        "--data",
        path_str(&data),
        "--json",
    ]));
    let id = listed[0]["fork_id"].as_str().unwrap().to_string();
    assert!(!fork_dir(&ex, &id).exists());

    let out = forkfleet(&["fork", "watch", &id, "--data", path_str(&data)]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(!fork_dir(&ex, &id).exists(), "fork watch made it again");

    let out = forkfleet(&["fork", "open", &id, "--data", path_str(&data)]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(err.contains("was merged (winner `concise`)"), "{err}");
    assert!(!fork_dir(&ex, &id).exists(), "fork open made it again");
    assert!(!ex.workspace().join(".forkfleet").exists());
}

/// Without a pick, the run says where the fork directory is: it stays.
#[test]
fn an_unresolved_run_points_at_its_fork_directory() {
    let ex = Example::quickstart();
    let out = forkfleet(&["run", path_str(&ex.spec()), "--timeout-s", "120"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stderr(&out).contains("fork directory:"), "{}", stderr(&out));
}
