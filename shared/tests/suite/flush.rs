//! Replaying a change log onto a parent.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::common;

use common::{p, Blobs};
use forkfleet_shared::flush::{
    flush, needed_blobs, ConflictPolicy, DirTarget, FlushReport, FlushTarget, ManifestTarget,
};
use forkfleet_shared::manifest::{scan_dir, FileEntry, Manifest, Node, MODE_EXEC, MODE_SYMLINK};
use forkfleet_shared::overlay::{ChangeOp, Overlay};
use forkfleet_shared::path::WsPath;
use std::cell::RefCell;
use std::sync::Arc;

fn write(path: &str, e: FileEntry) -> ChangeOp {
    ChangeOp::Write {
        path: p(path),
        entry: e,
    }
}
fn edit(path: &str, e: FileEntry) -> ChangeOp {
    ChangeOp::Edit {
        path: p(path),
        entry: e,
    }
}
fn delete(path: &str) -> ChangeOp {
    ChangeOp::Delete { path: p(path) }
}
fn rmdir(path: &str) -> ChangeOp {
    ChangeOp::Rmdir { path: p(path) }
}
fn mkdir(path: &str) -> ChangeOp {
    ChangeOp::Mkdir { path: p(path) }
}

fn paths(v: &[WsPath]) -> Vec<&str> {
    v.iter().map(|p| p.as_str()).collect()
}

/// A ManifestTarget that records every mutating call.
struct Recording {
    inner: ManifestTarget,
    calls: RefCell<Vec<String>>,
}

impl Recording {
    fn new(m: Manifest) -> Self {
        Self {
            inner: ManifestTarget::new(m),
            calls: RefCell::new(Vec::new()),
        }
    }
    fn log(&self, s: String) {
        self.calls.borrow_mut().push(s);
    }
}

impl FlushTarget for Recording {
    fn node(&self, path: &WsPath) -> Node {
        self.inner.node(path)
    }
    fn files_under(&self, dir: &WsPath) -> Vec<WsPath> {
        self.inner.files_under(dir)
    }
    fn dirs_under(&self, dir: &WsPath) -> Vec<WsPath> {
        self.inner.dirs_under(dir)
    }
    fn write(&mut self, path: &WsPath, entry: &FileEntry) -> Result<(), String> {
        self.log(format!("write {path} {}", entry.size));
        self.inner.write(path, entry)
    }
    fn delete_file(&mut self, path: &WsPath) -> Result<(), String> {
        self.log(format!("delete {path}"));
        self.inner.delete_file(path)
    }
    fn mkdir(&mut self, path: &WsPath) -> Result<(), String> {
        self.log(format!("mkdir {path}"));
        self.inner.mkdir(path)
    }
    fn remove_dir_if_empty(&mut self, path: &WsPath) -> Result<bool, String> {
        self.log(format!("rmdir {path}"));
        self.inner.remove_dir_if_empty(path)
    }
}

fn base(blobs: &mut Blobs) -> Manifest {
    common::manifest(
        blobs,
        &[
            ("a.txt", "a\n"),
            ("m.txt", "m\n"),
            ("g.txt", "g\n"),
            ("other.txt", "o\n"),
            ("d/x", "x\n"),
            ("d/y", "y\n"),
            ("d/sub/z", "z\n"),
        ],
    )
}

#[test]
fn replays_in_order_and_counts_every_op() {
    let mut blobs = Blobs::new();
    let snap = base(&mut blobs);
    let log = vec![
        write("a.txt", blobs.entry("1")),
        edit("a.txt", blobs.entry("22")),
        write("n/new.txt", blobs.entry("new")),
        write("a.txt", blobs.entry("333")),
        mkdir("empty/dir"),
    ];
    let mut t = Recording::new(snap.clone());
    let r = flush(&log, &snap, &mut t, ConflictPolicy::KeepParent);
    assert_eq!(
        *t.calls.borrow(),
        vec![
            "write a.txt 1",
            "write a.txt 2",
            "write n/new.txt 3",
            "write a.txt 3",
            "mkdir empty/dir"
        ]
    );
    assert_eq!(
        paths(&r.applied_paths),
        vec!["a.txt", "n/new.txt"],
        "once each, sorted"
    );
    assert_eq!(r.applied_changes, 5);
    assert!(r.conflicts.is_empty() && r.errors.is_empty() && r.deleted_paths.is_empty());
    let m = t.inner.manifest();
    assert_eq!(m.files[&p("a.txt")], blobs.entry("333"));
    assert!(m.dirs.contains(&p("empty/dir")) && m.dirs.contains(&p("n")));
}

#[test]
fn writes_deleted_later_are_skipped() {
    let mut blobs = Blobs::new();
    let snap = base(&mut blobs);
    let tmp = blobs.entry("temporary");
    let under = blobs.entry("under d");
    let kept = blobs.entry("kept");
    let log = vec![
        write("tmp/t.txt", tmp),
        write("m.txt", tmp),
        write("d/new", under),
        edit("d/x", under),
        delete("tmp/t.txt"),
        delete("m.txt"),
        rmdir("d"),
        write("m.txt", kept),
    ];
    let mut t = Recording::new(snap.clone());
    let r = flush(&log, &snap, &mut t, ConflictPolicy::KeepParent);
    let calls = t.calls.borrow();
    assert!(
        !calls
            .iter()
            .any(|c| c.starts_with("write tmp/") || c.starts_with("write d/")),
        "{calls:?}"
    );
    assert_eq!(
        calls
            .iter()
            .filter(|c| c.starts_with("write m.txt"))
            .count(),
        1,
        "{calls:?}"
    );
    assert_eq!(paths(&r.applied_paths), vec!["m.txt"]);
    // delete tmp/t.txt (tolerated), delete m.txt, rmdir d, write m.txt
    assert_eq!(r.applied_changes, 4);
    assert_eq!(
        paths(&r.deleted_paths),
        vec!["d", "d/sub/z", "d/x", "d/y", "m.txt"]
    );
    let m = t.inner.manifest();
    assert_eq!(m.files[&p("m.txt")], kept);
    assert!(!m.files.contains_key(&p("tmp/t.txt")));
    assert!(
        m.dirs.contains(&p("tmp")),
        "the skipped write's directory exists, as in the branch"
    );
    assert!(!m.dirs.contains(&p("d")) && !m.dirs.contains(&p("d/sub")));
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    // the superseded blobs are not needed
    assert_eq!(needed_blobs(&log), vec![kept.hash]);
}

#[test]
fn needed_blobs_is_sorted_and_deduplicated() {
    let mut blobs = Blobs::new();
    let (a, b, c) = (blobs.entry("a"), blobs.entry("b"), blobs.entry("c"));
    let log = vec![
        write("1", b),
        write("2", a),
        edit("1", b),
        write("3", c),
        delete("3"),
        mkdir("q"),
    ];
    let mut want = vec![a.hash, b.hash];
    want.sort();
    assert_eq!(needed_blobs(&log), want);
}

#[test]
fn deleting_what_is_gone_is_tolerated() {
    let mut blobs = Blobs::new();
    let snap = base(&mut blobs);
    let log = vec![
        delete("never.txt"),
        rmdir("no/such/dir"),
        delete("a.txt"),
        delete("a.txt"),
    ];
    let mut t = ManifestTarget::new(snap.clone());
    let r = flush(&log, &snap, &mut t, ConflictPolicy::KeepParent);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    assert!(r.conflicts.is_empty());
    assert_eq!(r.applied_changes, 4);
    assert_eq!(paths(&r.deleted_paths), vec!["a.txt"]);
    assert!(!t.manifest().files.contains_key(&p("a.txt")));
}

/// The parent after a third party, since the fork: modified m.txt, deleted g.txt,
/// created c.txt, modified other.txt (which the branch does not touch).
fn third_party(blobs: &mut Blobs, snap: &Manifest) -> Manifest {
    let mut parent = snap.clone();
    parent.files.insert(p("m.txt"), blobs.entry("theirs m\n"));
    parent.files.remove(&p("g.txt"));
    parent.insert_file(p("c.txt"), blobs.entry("theirs c\n"));
    parent
        .files
        .insert(p("other.txt"), blobs.entry("theirs o\n"));
    parent
}

fn branch_log(blobs: &mut Blobs) -> Vec<ChangeOp> {
    vec![
        write("m.txt", blobs.entry("ours m 1\n")),
        write("m.txt", blobs.entry("ours m 2\n")),
        edit("g.txt", blobs.entry("ours g\n")),
        write("c.txt", blobs.entry("ours c\n")),
        write("a.txt", blobs.entry("ours a 1\n")),
        write("a.txt", blobs.entry("ours a 2\n")),
    ]
}

#[test]
fn conflicts_are_against_the_fork_snapshot_keep_parent() {
    let mut blobs = Blobs::new();
    let snap = base(&mut blobs);
    let parent = third_party(&mut blobs, &snap);
    let log = branch_log(&mut blobs);
    let mut t = ManifestTarget::new(parent.clone());
    let r = flush(&log, &snap, &mut t, ConflictPolicy::KeepParent);
    // a.txt is written twice: the second write sees our own first write, which must not
    // count as a conflict (decided against the snapshot, not at first touch).
    assert_eq!(paths(&r.conflicts), vec!["c.txt", "g.txt", "m.txt"]);
    assert_eq!(paths(&r.applied_paths), vec!["a.txt"]);
    assert_eq!(r.applied_changes, 2);
    let m = t.manifest();
    assert_eq!(
        m.files[&p("m.txt")],
        parent.files[&p("m.txt")],
        "parent keeps its content"
    );
    assert!(!m.files.contains_key(&p("g.txt")), "stays deleted");
    assert_eq!(m.files[&p("c.txt")], parent.files[&p("c.txt")]);
    assert_eq!(m.files[&p("a.txt")], blobs.entry("ours a 2\n"));
    assert_eq!(
        m.files[&p("other.txt")],
        parent.files[&p("other.txt")],
        "untouched by the branch"
    );
}

#[test]
fn conflicts_are_against_the_fork_snapshot_overwrite() {
    let mut blobs = Blobs::new();
    let snap = base(&mut blobs);
    let parent = third_party(&mut blobs, &snap);
    let log = branch_log(&mut blobs);
    let mut t = ManifestTarget::new(parent.clone());
    let r = flush(&log, &snap, &mut t, ConflictPolicy::Overwrite);
    // Each path once, as what happened: the conflicting ones were overwritten.
    assert_eq!(paths(&r.overwritten), vec!["c.txt", "g.txt", "m.txt"]);
    assert!(r.conflicts.is_empty(), "{r:?}");
    assert_eq!(paths(&r.applied_paths), vec!["a.txt"]);
    assert_eq!(r.applied_changes, 6);
    let m = t.manifest();
    assert_eq!(m.files[&p("m.txt")], blobs.entry("ours m 2\n"));
    assert_eq!(m.files[&p("g.txt")], blobs.entry("ours g\n"));
    assert_eq!(m.files[&p("c.txt")], blobs.entry("ours c\n"));
    assert_eq!(m.files[&p("other.txt")], parent.files[&p("other.txt")]);
}

#[test]
fn third_party_delete_of_a_file_the_branch_deletes() {
    let mut blobs = Blobs::new();
    let snap = base(&mut blobs);
    let mut parent = snap.clone();
    parent.files.remove(&p("g.txt"));
    let mut t = ManifestTarget::new(parent);
    let r = flush(&[delete("g.txt")], &snap, &mut t, ConflictPolicy::Overwrite);
    assert_eq!(paths(&r.conflicts), vec!["g.txt"]);
    assert!(r.errors.is_empty());
    assert!(r.deleted_paths.is_empty(), "nothing was there to remove");
}

fn rmdir_case(policy: ConflictPolicy) -> (FlushReport, Manifest, Manifest, Blobs) {
    let mut blobs = Blobs::new();
    let snap = base(&mut blobs);
    let mut parent = snap.clone();
    parent.files.insert(p("d/x"), blobs.entry("theirs x\n"));
    parent.insert_file(p("d/added/new"), blobs.entry("theirs new\n"));
    parent.dirs.insert(p("d/emptied"));
    let mut t = ManifestTarget::new(parent.clone());
    let r = flush(&[rmdir("d")], &snap, &mut t, policy);
    (r, t.into_manifest(), parent, blobs)
}

#[test]
fn rmdir_keep_parent_keeps_conflicting_files_and_the_directory() {
    let (r, m, parent, _) = rmdir_case(ConflictPolicy::KeepParent);
    assert_eq!(paths(&r.conflicts), vec!["d/added/new", "d/x"]);
    assert_eq!(paths(&r.deleted_paths), vec!["d/sub/z", "d/y"]);
    assert_eq!(m.files[&p("d/x")], parent.files[&p("d/x")]);
    assert!(m.files.contains_key(&p("d/added/new")));
    assert!(m.dirs.contains(&p("d")) && m.dirs.contains(&p("d/added")));
    assert!(!m.dirs.contains(&p("d/sub")) && !m.dirs.contains(&p("d/emptied")));
    assert_eq!(r.applied_changes, 1);
    assert!(r.errors.is_empty());
}

#[test]
fn rmdir_overwrite_removes_everything_and_reports_the_overwritten() {
    let (r, m, _, _) = rmdir_case(ConflictPolicy::Overwrite);
    assert_eq!(paths(&r.overwritten), vec!["d/added/new", "d/x"]);
    assert!(r.conflicts.is_empty(), "{r:?}");
    assert_eq!(paths(&r.deleted_paths), vec!["d", "d/sub/z", "d/y"]);
    assert!(m.files.keys().all(|f| !f.starts_with(&p("d"))));
    assert!(m.dirs.iter().all(|f| !f.starts_with(&p("d"))));
}

#[test]
fn a_failing_op_is_recorded_and_the_flush_goes_on() {
    let mut blobs = Blobs::new();
    let snap = base(&mut blobs);
    let mut parent = snap.clone();
    parent.insert_file(p("blocker"), blobs.entry("a file where a dir is needed"));
    let log = vec![
        write("blocker/inner.txt", blobs.entry("x")),
        mkdir("a.txt"),
        delete("d"),
        write("ok.txt", blobs.entry("ok")),
    ];
    let mut t = ManifestTarget::new(parent);
    let r = flush(&log, &snap, &mut t, ConflictPolicy::KeepParent);
    let errs: Vec<(&str, &str)> = r
        .errors
        .iter()
        .map(|e| (e.path.as_str(), e.op.as_str()))
        .collect();
    assert_eq!(
        errs,
        vec![
            ("blocker/inner.txt", "write"),
            ("a.txt", "mkdir"),
            ("d", "delete")
        ]
    );
    assert!(
        r.errors[0].message.contains("blocker"),
        "{}",
        r.errors[0].message
    );
    assert_eq!(paths(&r.applied_paths), vec!["ok.txt"]);
    assert_eq!(r.applied_changes, 1);
}

#[test]
fn policy_and_report_serde() {
    assert_eq!(ConflictPolicy::default(), ConflictPolicy::KeepParent);
    assert_eq!(
        serde_json::to_string(&ConflictPolicy::KeepParent).unwrap(),
        "\"keep-parent\""
    );
    assert_eq!(
        serde_json::to_string(&ConflictPolicy::Overwrite).unwrap(),
        "\"overwrite\""
    );
    assert_eq!(
        serde_json::from_str::<ConflictPolicy>("\"overwrite\"").unwrap(),
        ConflictPolicy::Overwrite
    );
    assert_eq!(
        "keep-parent".parse::<ConflictPolicy>().unwrap(),
        ConflictPolicy::KeepParent
    );
    assert!("keep_parent".parse::<ConflictPolicy>().is_err());
    let (r, _, _, _) = rmdir_case(ConflictPolicy::KeepParent);
    let v = serde_json::to_value(&r).unwrap();
    assert_eq!(v["conflicts"], serde_json::json!(["d/added/new", "d/x"]));
    let back: FlushReport = serde_json::from_value(v).unwrap();
    assert_eq!(back, r);
}

// ---------------------------------------------------------------------------------------
// DirTarget

fn seed(dir: &std::path::Path, files: &[(&str, &str)]) {
    for (path, content) in files {
        let full = dir.join(path);
        std::fs::create_dir_all(full.parent().unwrap()).unwrap();
        std::fs::write(full, content).unwrap();
    }
}

#[cfg(unix)]
fn mode_of(path: &std::path::Path) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).unwrap().permissions().mode() & 0o777
}

#[test]
fn dir_target_end_to_end() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    seed(
        root,
        &[
            ("README.md", "hi\n"),
            ("src/main.rs", "main\n"),
            ("old/a", "a\n"),
            ("old/b/c", "c\n"),
        ],
    );
    std::fs::create_dir_all(root.join(".git")).unwrap();
    std::fs::write(root.join(".git/HEAD"), "ref").unwrap();
    let exclude = vec![".git".to_string()];
    let scan = scan_dir(root, &exclude).unwrap();
    let snap = Arc::new(scan.manifest.clone());

    let mut blobs = Blobs::new();
    let mut ov = Overlay::new(snap.clone());
    ov.write(&p("src/main.rs"), blobs.entry("main v2\n"))
        .unwrap();
    ov.write(
        &p("bin/run.sh"),
        blobs.entry_mode(b"#!/bin/sh\necho\n", MODE_EXEC),
    )
    .unwrap();
    ov.write(&p("link"), blobs.entry_mode(b"src/main.rs", MODE_SYMLINK))
        .unwrap();
    ov.write(&p("deep/er/file.txt"), blobs.entry("deep\n"))
        .unwrap();
    ov.delete(&p("README.md")).unwrap();
    ov.rmdir(&p("old")).unwrap();
    ov.mkdir(&p("empty")).unwrap();
    ov.write(&p("scratch.txt"), blobs.entry("scratch\n"))
        .unwrap();
    ov.delete(&p("scratch.txt")).unwrap();

    let log = ov.changes().to_vec();
    let wanted = needed_blobs(&log);
    assert!(!wanted.contains(&blobs.entry("scratch\n").hash));
    let store: std::collections::HashMap<_, _> =
        wanted.iter().map(|h| (*h, blobs.get(h).unwrap())).collect();
    let mut target = DirTarget::new(root, store)
        .unwrap()
        .exclude(exclude.clone());
    let r = flush(&log, &snap, &mut target, ConflictPolicy::KeepParent);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    assert!(r.conflicts.is_empty(), "{:?}", r.conflicts);
    assert_eq!(
        paths(&r.applied_paths),
        vec!["bin/run.sh", "deep/er/file.txt", "link", "src/main.rs"]
    );
    assert_eq!(
        paths(&r.deleted_paths),
        vec!["README.md", "old", "old/a", "old/b/c"]
    );

    let after = scan_dir(root, &exclude).unwrap().manifest;
    assert_eq!(
        after,
        ov.to_manifest(),
        "no temp files left, same tree as the branch"
    );
    assert_eq!(
        std::fs::read_to_string(root.join("src/main.rs")).unwrap(),
        "main v2\n"
    );
    assert_eq!(
        std::fs::read_link(root.join("link")).unwrap().to_str(),
        Some("src/main.rs")
    );
    assert_eq!(
        std::fs::read_to_string(root.join(".git/HEAD")).unwrap(),
        "ref"
    );
    #[cfg(unix)]
    {
        assert_eq!(mode_of(&root.join("bin/run.sh")), 0o755);
        assert_eq!(mode_of(&root.join("src/main.rs")), 0o644);
    }
    // the target reports what it holds
    assert_eq!(
        target.node(&p("deep/er/file.txt")),
        Node::File(blobs.entry("deep\n"))
    );
    assert_eq!(target.node(&p("empty")), Node::Dir);
    assert_eq!(target.node(&p("README.md")), Node::Missing);
    assert!(target.node(&p("link")) == Node::File(blobs.entry_mode(b"src/main.rs", MODE_SYMLINK)));
}

#[test]
fn dir_target_detects_third_party_changes() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    seed(
        root,
        &[
            ("same_size.txt", "aaaa\n"),
            ("mode.sh", "x\n"),
            ("gone.txt", "g\n"),
            ("d/k", "k\n"),
            ("d/o", "o\n"),
        ],
    );
    let snap = scan_dir(root, &[]).unwrap().manifest;
    // third party: same size, different content; exec bit only; delete; create
    std::fs::write(root.join("same_size.txt"), "bbbb\n").unwrap();
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(root.join("mode.sh"), std::fs::Permissions::from_mode(0o755))
            .unwrap();
    }
    std::fs::remove_file(root.join("gone.txt")).unwrap();
    std::fs::write(root.join("created.txt"), "theirs\n").unwrap();
    std::fs::write(root.join("d/theirs"), "theirs\n").unwrap();

    let mut blobs = Blobs::new();
    let ours = blobs.entry("ours\n");
    let log = vec![
        write("same_size.txt", ours),
        write("mode.sh", ours),
        edit("gone.txt", ours),
        write("created.txt", ours),
        rmdir("d"),
    ];
    let mut target = DirTarget::new(root, blobs.0.clone()).unwrap();
    let r = flush(&log, &snap, &mut target, ConflictPolicy::KeepParent);
    let mut want = vec!["created.txt", "d/theirs", "gone.txt", "same_size.txt"];
    if cfg!(unix) {
        want.push("mode.sh");
        want.sort();
    }
    assert_eq!(paths(&r.conflicts), want);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    assert_eq!(
        std::fs::read_to_string(root.join("same_size.txt")).unwrap(),
        "bbbb\n"
    );
    assert_eq!(
        std::fs::read_to_string(root.join("created.txt")).unwrap(),
        "theirs\n"
    );
    assert!(!root.join("gone.txt").exists());
    assert!(root.join("d/theirs").exists() && !root.join("d/k").exists());
    assert_eq!(paths(&r.deleted_paths), vec!["d/k", "d/o"]);
}

#[test]
fn dir_target_errors_are_recorded_and_the_flush_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    seed(root, &[("blocker", "file\n")]);
    let snap = scan_dir(root, &[]).unwrap().manifest;
    let mut blobs = Blobs::new();
    let ok = blobs.entry("ok\n");
    let unknown = FileEntry::for_bytes(b"not in the store", 0o644);
    let log = vec![
        write("blocker/x.txt", ok),
        write("missing-blob.txt", unknown),
        mkdir("blocker"),
        write("fine/ok.txt", ok),
    ];
    let mut target = DirTarget::new(root, blobs.0.clone()).unwrap();
    let r = flush(&log, &snap, &mut target, ConflictPolicy::KeepParent);
    let errs: Vec<(&str, &str)> = r
        .errors
        .iter()
        .map(|e| (e.path.as_str(), e.op.as_str()))
        .collect();
    assert_eq!(
        errs,
        vec![
            ("blocker/x.txt", "write"),
            ("missing-blob.txt", "write"),
            ("blocker", "mkdir")
        ]
    );
    assert!(
        r.errors[1].message.contains("not available"),
        "{}",
        r.errors[1].message
    );
    assert_eq!(paths(&r.applied_paths), vec!["fine/ok.txt"]);
    assert_eq!(
        std::fs::read_to_string(root.join("fine/ok.txt")).unwrap(),
        "ok\n"
    );
    assert_eq!(
        std::fs::read_to_string(root.join("blocker")).unwrap(),
        "file\n"
    );
    assert!(!root.join("missing-blob.txt").exists());
}

#[cfg(unix)]
#[test]
fn dir_target_refuses_symlinks_that_leave_the_root() {
    let outside = tempfile::tempdir().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    seed(root, &[("inside/keep.txt", "k\n")]);
    std::os::unix::fs::symlink(outside.path(), root.join("escape")).unwrap();
    std::os::unix::fs::symlink("inside", root.join("alias")).unwrap();
    let snap = Manifest::default();
    let mut blobs = Blobs::new();
    let e = blobs.entry("payload\n");
    let log = vec![
        write("escape/pwned.txt", e),
        write("escape/deeper/pwned.txt", e),
        mkdir("escape/newdir"),
        write("alias/ok.txt", e),
    ];
    let mut target = DirTarget::new(root, blobs.0.clone()).unwrap();
    let r = flush(&log, &snap, &mut target, ConflictPolicy::Overwrite);
    let errs: Vec<&str> = r.errors.iter().map(|e| e.path.as_str()).collect();
    assert_eq!(
        errs,
        vec![
            "escape/pwned.txt",
            "escape/deeper/pwned.txt",
            "escape/newdir"
        ]
    );
    assert!(
        r.errors[0].message.contains("outside"),
        "{}",
        r.errors[0].message
    );
    assert_eq!(
        std::fs::read_dir(outside.path()).unwrap().count(),
        0,
        "nothing written outside"
    );
    assert_eq!(
        std::fs::read_to_string(root.join("inside/ok.txt")).unwrap(),
        "payload\n"
    );
    assert_eq!(target.node(&p("escape/x")), Node::Missing);
    // removing through the escaping link is refused too
    std::fs::write(outside.path().join("victim"), "v").unwrap();
    let r = flush(
        &[delete("escape/victim"), rmdir("escape")],
        &snap,
        &mut target,
        ConflictPolicy::Overwrite,
    );
    assert!(outside.path().join("victim").exists());
    assert!(
        !r.deleted_paths
            .iter()
            .any(|p| p.as_str().starts_with("escape/")),
        "{r:?}"
    );
}

#[test]
fn dir_target_can_move_to_another_thread() {
    fn assert_send<T: Send>(_: &T) {}
    let dir = tempfile::tempdir().unwrap();
    let t = DirTarget::new(dir.path(), std::collections::HashMap::new()).unwrap();
    assert_send(&t);
    let store = forkfleet_shared::blob::MemBlobStore::new();
    let t2 = DirTarget::with_lookup(dir.path(), move |h| store.get_now(h)).unwrap();
    assert_send(&t2);
}
