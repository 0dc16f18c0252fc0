//! Overlay behaviour, one test per rule, and property tests tying the overlay, its change
//! log, `net_changes` and `flush` together.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::common;

use common::{p, Blobs};
use forkfleet_shared::flush::{flush, ConflictPolicy, DirTarget, ManifestTarget};
use forkfleet_shared::manifest::{
    scan_dir, FileEntry, Manifest, Node, MODE_EXEC, MODE_FILE, MODE_SYMLINK,
};
use forkfleet_shared::overlay::{
    apply_edit, ChangeOp, EditError, NetChange, Overlay, OverlayError,
};
use forkfleet_shared::path::{PathError, WsPath};
use proptest::prelude::*;
use std::collections::BTreeMap;
use std::sync::Arc;

fn base() -> (Arc<Manifest>, Blobs) {
    let mut blobs = Blobs::new();
    let mut m = common::manifest(
        &mut blobs,
        &[
            ("README.md", "hello\n"),
            ("src/main.rs", "fn main() {}\n"),
            ("src/lib/a.rs", "a\n"),
            ("src/lib/b.rs", "b\n"),
            ("docs/guide.md", "guide\n"),
        ],
    );
    m.dirs.insert(p("src/empty"));
    (Arc::new(m), blobs)
}

fn files(ov: &Overlay) -> Vec<String> {
    ov.files()
        .into_iter()
        .map(|(p, _)| p.as_str().to_string())
        .collect()
}

fn dirs(ov: &Overlay) -> Vec<String> {
    ov.dirs()
        .into_iter()
        .map(|p| p.as_str().to_string())
        .collect()
}

fn e(s: &str) -> FileEntry {
    common::entry(s)
}

// ---------------------------------------------------------------------------------------
// behaviours

#[test]
fn reads_fall_through_to_the_base() {
    let (base, _) = base();
    let ov = Overlay::new(base.clone());
    assert_eq!(
        ov.file(&p("src/main.rs")).unwrap(),
        base.files[&p("src/main.rs")]
    );
    assert_eq!(ov.node(&p("src/lib")), Node::Dir);
    assert_eq!(ov.node(&p("src/empty")), Node::Dir);
    assert_eq!(ov.node(&p("nope")), Node::Missing);
    assert_eq!(ov.node(&WsPath::root()), Node::Dir);
    assert_eq!(
        files(&ov),
        base.files
            .keys()
            .map(|p| p.as_str().to_string())
            .collect::<Vec<_>>()
    );
    let names: Vec<_> = ov
        .list(&p("src"))
        .unwrap()
        .into_iter()
        .map(|d| (d.name, d.is_dir))
        .collect();
    assert_eq!(
        names,
        vec![
            ("empty".into(), true),
            ("lib".into(), true),
            ("main.rs".into(), false)
        ]
    );
    assert!(ov.net_changes().is_empty());
    assert!(ov.changes().is_empty());
    assert!(matches!(
        ov.list(&p("README.md")),
        Err(OverlayError::NotADirectory(_))
    ));
    assert!(matches!(
        ov.list(&p("nope")),
        Err(OverlayError::NotFound(_))
    ));
}

#[test]
fn writes_are_invisible_to_the_base_and_to_siblings() {
    let (base, _) = base();
    let snapshot = (*base).clone();
    let mut ov = Overlay::new(base.clone());
    let sibling = Overlay::new(base.clone());
    ov.write(&p("src/main.rs"), e("changed")).unwrap();
    ov.write(&p("new/deep/file.txt"), e("new")).unwrap();
    ov.delete(&p("README.md")).unwrap();
    assert_eq!(*base, snapshot);
    assert_eq!(ov.file(&p("src/main.rs")).unwrap(), e("changed"));
    assert_eq!(
        sibling.file(&p("src/main.rs")).unwrap(),
        snapshot.files[&p("src/main.rs")]
    );
    assert_eq!(sibling.node(&p("new")), Node::Missing);
    assert_eq!(
        sibling.node(&p("README.md")),
        Node::File(snapshot.files[&p("README.md")])
    );
    // the write created its parents
    assert_eq!(ov.node(&p("new/deep")), Node::Dir);
}

#[test]
fn deleting_a_directory_hides_its_subtree() {
    let (base, _) = base();
    let mut ov = Overlay::new(base);
    ov.delete(&p("src")).unwrap();
    assert_eq!(ov.changes(), &[ChangeOp::Rmdir { path: p("src") }]);
    for gone in ["src", "src/main.rs", "src/lib", "src/lib/a.rs", "src/empty"] {
        assert_eq!(ov.node(&p(gone)), Node::Missing, "{gone}");
    }
    assert_eq!(files(&ov), vec!["README.md", "docs/guide.md"]);
    assert_eq!(dirs(&ov), vec!["docs"]);
    let names: Vec<_> = ov
        .list(&WsPath::root())
        .unwrap()
        .into_iter()
        .map(|d| d.name)
        .collect();
    assert_eq!(names, vec!["README.md", "docs"]);
    let net = ov.net_changes();
    assert_eq!(net.len(), 3);
    assert!(net.values().all(|c| *c == NetChange::Deleted));
}

#[test]
fn a_directory_recreated_after_a_delete_is_empty() {
    let (base, _) = base();
    let mut ov = Overlay::new(base.clone());
    ov.rmdir(&p("src")).unwrap();
    ov.mkdir(&p("src")).unwrap();
    assert_eq!(ov.node(&p("src")), Node::Dir);
    assert!(ov.list(&p("src")).unwrap().is_empty());
    assert_eq!(ov.node(&p("src/main.rs")), Node::Missing);
    assert_eq!(ov.node(&p("src/lib")), Node::Missing);
    // recreating through a write is opaque too
    let mut ov2 = Overlay::new(base);
    ov2.delete(&p("src")).unwrap();
    ov2.write(&p("src/lib/c.rs"), e("c")).unwrap();
    assert_eq!(
        files(&ov2),
        vec!["README.md", "docs/guide.md", "src/lib/c.rs"]
    );
    assert_eq!(dirs(&ov2), vec!["docs", "src", "src/lib"]);
    let net = ov2.net_changes();
    assert_eq!(net[&p("src/lib/a.rs")], NetChange::Deleted);
    assert_eq!(net[&p("src/lib/c.rs")], NetChange::Created(e("c")));
}

#[test]
fn type_clashes_are_errors_and_record_nothing() {
    let (base, _) = base();
    let mut ov = Overlay::new(base);
    assert_eq!(
        ov.write(&p("src"), e("x")),
        Err(OverlayError::IsADirectory(p("src")))
    );
    assert_eq!(
        ov.mkdir(&p("README.md")),
        Err(OverlayError::FileExists(p("README.md")))
    );
    assert_eq!(
        ov.write(&p("README.md/x"), e("x")),
        Err(OverlayError::NotADirectory(p("README.md")))
    );
    assert_eq!(
        ov.rmdir(&p("README.md")),
        Err(OverlayError::NotADirectory(p("README.md")))
    );
    assert_eq!(
        ov.delete(&p("nope")),
        Err(OverlayError::NotFound(p("nope")))
    );
    assert_eq!(ov.rmdir(&p("nope")), Err(OverlayError::NotFound(p("nope"))));
    assert_eq!(ov.write(&WsPath::root(), e("x")), Err(OverlayError::Root));
    assert_eq!(ov.delete(&WsPath::root()), Err(OverlayError::Root));
    assert!(ov.changes().is_empty());
    assert!(ov.net_changes().is_empty());
}

#[test]
fn edit_requires_an_existing_file() {
    let (base, _) = base();
    let mut ov = Overlay::new(base);
    assert_eq!(
        ov.edit(&p("nope.txt"), e("x")),
        Err(OverlayError::NotFound(p("nope.txt")))
    );
    assert_eq!(
        ov.edit(&p("src"), e("x")),
        Err(OverlayError::IsADirectory(p("src")))
    );
    ov.delete(&p("README.md")).unwrap();
    assert_eq!(
        ov.edit(&p("README.md"), e("x")),
        Err(OverlayError::NotFound(p("README.md")))
    );
    ov.edit(&p("src/main.rs"), e("edited")).unwrap();
    assert_eq!(ov.file(&p("src/main.rs")).unwrap(), e("edited"));
    assert_eq!(
        ov.changes().last(),
        Some(&ChangeOp::Edit {
            path: p("src/main.rs"),
            entry: e("edited")
        })
    );
}

#[test]
fn the_log_is_append_only_and_replays_to_the_same_view() {
    let (base, _) = base();
    let mut ov = Overlay::new(base.clone());
    let mut seen: Vec<ChangeOp> = Vec::new();
    type Step = Box<dyn Fn(&mut Overlay) -> Result<(), OverlayError>>;
    let steps: Vec<Step> = vec![
        Box::new(|o| o.write(&p("a/b.txt"), e("1"))),
        Box::new(|o| o.mkdir(&p("src"))), // existing: records nothing
        Box::new(|o| o.edit(&p("a/b.txt"), e("2"))),
        Box::new(|o| o.delete(&p("src/lib"))),
        Box::new(|o| o.mkdir(&p("src/lib"))),
        Box::new(|o| o.write(&p("src/lib/z.rs"), e("z"))),
        Box::new(|o| o.delete(&p("README.md"))),
        Box::new(|o| o.write(&p("README.md"), e("hello\n"))), // back to the original
        Box::new(|o| o.mkdir(&p("x/y/z"))),
        Box::new(|o| o.rmdir(&p("docs"))),
    ];
    for (i, step) in steps.iter().enumerate() {
        let before = ov.changes().len();
        step(&mut ov).unwrap();
        let after = ov.changes().len();
        assert_eq!(
            &ov.changes()[..before],
            &seen[..],
            "step {i} rewrote history"
        );
        assert!(
            after - before <= 1,
            "step {i} appended {} ops",
            after - before
        );
        if i == 1 {
            assert_eq!(after, before, "mkdir of an existing dir records nothing");
        } else {
            assert_eq!(after, before + 1, "step {i}");
        }
        seen = ov.changes().to_vec();
    }
    let replica = Overlay::from_log(base.clone(), ov.changes()).unwrap();
    assert_eq!(replica.files(), ov.files());
    assert_eq!(replica.dirs(), ov.dirs());
    assert_eq!(replica.net_changes(), ov.net_changes());
    assert_eq!(replica.changes(), ov.changes());
    // README.md was written back with its original content: not a change.
    assert!(!ov.net_changes().contains_key(&p("README.md")));
    // A log that does not fit the base is refused.
    let bad = [ChangeOp::Edit {
        path: p("nope"),
        entry: e("x"),
    }];
    assert!(Overlay::from_log(base, bad.iter()).is_err());
}

#[test]
fn mode_only_change_is_a_modification() {
    let (base, _) = base();
    let mut ov = Overlay::new(base.clone());
    let mut exec = base.files[&p("README.md")];
    exec.mode = MODE_EXEC;
    ov.write(&p("README.md"), exec).unwrap();
    assert_eq!(ov.net_changes()[&p("README.md")], NetChange::Modified(exec));
}

#[test]
fn a_file_replacing_a_directory_deletes_the_directory_files() {
    // Regression: net_changes missed base files hidden below a file that replaced
    // their directory.
    let (base, _) = base();
    let mut ov = Overlay::new(base);
    ov.delete(&p("src/lib")).unwrap();
    ov.write(&p("src/lib"), e("now a file")).unwrap();
    let net = ov.net_changes();
    assert_eq!(net[&p("src/lib")], NetChange::Created(e("now a file")));
    assert_eq!(net[&p("src/lib/a.rs")], NetChange::Deleted);
    assert_eq!(net[&p("src/lib/b.rs")], NetChange::Deleted);
}

fn link_store(ov_blobs: &Blobs) -> impl Fn(&FileEntry) -> Option<String> + '_ {
    move |fe: &FileEntry| {
        ov_blobs
            .get(&fe.hash)
            .map(|b| String::from_utf8_lossy(&b).into_owned())
    }
}

#[test]
fn resolve_follows_symlinks_inside_the_root() {
    let (base, mut blobs) = base();
    let mut ov = Overlay::new(base);
    ov.write(&p("link"), blobs.entry_mode(b"src/main.rs", MODE_SYMLINK))
        .unwrap();
    ov.write(&p("libdir"), blobs.entry_mode(b"src/lib", MODE_SYMLINK))
        .unwrap();
    ov.write(&p("src/up"), blobs.entry_mode(b"../docs", MODE_SYMLINK))
        .unwrap();
    ov.write(&p("chain"), blobs.entry_mode(b"libdir", MODE_SYMLINK))
        .unwrap();
    let rl = link_store(&blobs);
    assert_eq!(ov.resolve(&p("link"), &rl).unwrap(), p("src/main.rs"));
    assert_eq!(
        ov.resolve(&p("libdir/a.rs"), &rl).unwrap(),
        p("src/lib/a.rs")
    );
    assert_eq!(
        ov.resolve(&p("src/up/guide.md"), &rl).unwrap(),
        p("docs/guide.md")
    );
    assert_eq!(
        ov.resolve(&p("chain/b.rs"), &rl).unwrap(),
        p("src/lib/b.rs")
    );
    assert_eq!(
        ov.resolve(&p("src/main.rs"), &rl).unwrap(),
        p("src/main.rs")
    );
    // the symlink itself is a file with the symlink mode
    assert!(ov.file(&p("link")).unwrap().is_symlink());
}

#[test]
fn resolve_rejects_escapes_and_loops() {
    let (base, mut blobs) = base();
    let mut ov = Overlay::new(base);
    ov.write(
        &p("out"),
        blobs.entry_mode(b"../../etc/passwd", MODE_SYMLINK),
    )
    .unwrap();
    ov.write(&p("abs"), blobs.entry_mode(b"/etc", MODE_SYMLINK))
        .unwrap();
    ov.write(&p("src/esc"), blobs.entry_mode(b"../..", MODE_SYMLINK))
        .unwrap();
    ov.write(&p("loop1"), blobs.entry_mode(b"loop2", MODE_SYMLINK))
        .unwrap();
    ov.write(&p("loop2"), blobs.entry_mode(b"loop1", MODE_SYMLINK))
        .unwrap();
    let rl = link_store(&blobs);
    assert!(matches!(
        ov.resolve(&p("out"), &rl),
        Err(OverlayError::Path(PathError::SymlinkEscapes { .. }))
    ));
    assert!(matches!(
        ov.resolve(&p("abs/passwd"), &rl),
        Err(OverlayError::Path(PathError::SymlinkEscapes { .. }))
    ));
    assert!(matches!(
        ov.resolve(&p("src/esc/x"), &rl),
        Err(OverlayError::Path(PathError::SymlinkEscapes { .. }))
    ));
    assert!(matches!(
        ov.resolve(&p("loop1"), &rl),
        Err(OverlayError::SymlinkLoop(_))
    ));
    // a link whose target cannot be read
    let none = |_: &FileEntry| None;
    assert!(matches!(
        ov.resolve(&p("out"), &none),
        Err(OverlayError::NotFound(_))
    ));
}

#[test]
fn apply_edit_rules() {
    assert_eq!(apply_edit("a b a", "b", "c", false).unwrap(), "a c a");
    assert_eq!(
        apply_edit("a b a", "x", "c", false),
        Err(EditError::NotFound)
    );
    assert_eq!(
        apply_edit("a b a", "a", "c", false),
        Err(EditError::NotUnique { count: 2 })
    );
    assert_eq!(apply_edit("a b a", "a", "c", true).unwrap(), "c b c");
    assert_eq!(apply_edit("abc", "", "x", true), Err(EditError::EmptyOld));
    // occurrences are counted without overlap
    assert_eq!(apply_edit("aaa", "aa", "b", false).unwrap(), "ba");
}

// ---------------------------------------------------------------------------------------
// properties

const NAMES: [&str; 3] = ["a", "b", "c"];
const CONTENTS: [&str; 4] = ["", "one\n", "two\n", "three\nlines\nhere\n"];

fn path_strategy() -> impl Strategy<Value = WsPath> {
    prop::collection::vec(0..NAMES.len(), 1..=3).prop_map(|ix| {
        let s: Vec<&str> = ix.into_iter().map(|i| NAMES[i]).collect();
        p(&s.join("/"))
    })
}

#[derive(Debug, Clone)]
enum Op {
    Write(WsPath, usize, bool),
    Edit(WsPath, usize),
    Delete(WsPath),
    Mkdir(WsPath),
    Rmdir(WsPath),
}

fn op_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (path_strategy(), 0..CONTENTS.len(), any::<bool>()).prop_map(|(p, c, x)| Op::Write(p, c, x)),
        2 => (path_strategy(), 0..CONTENTS.len()).prop_map(|(p, c)| Op::Edit(p, c)),
        2 => path_strategy().prop_map(Op::Delete),
        1 => path_strategy().prop_map(Op::Mkdir),
        2 => path_strategy().prop_map(Op::Rmdir),
    ]
}

fn file_entry(c: usize, exec: bool) -> FileEntry {
    FileEntry::for_bytes(
        CONTENTS[c].as_bytes(),
        if exec { MODE_EXEC } else { MODE_FILE },
    )
}

fn run(ov: &mut Overlay, op: &Op) {
    let _ = match op {
        Op::Write(p, c, x) => ov.write(p, file_entry(*c, *x)),
        Op::Edit(p, c) => ov.edit(p, file_entry(*c, false)),
        Op::Delete(p) => ov.delete(p),
        Op::Mkdir(p) => ov.mkdir(p),
        Op::Rmdir(p) => ov.rmdir(p),
    };
}

/// A random small base: random writes and mkdirs over an empty workspace.
fn base_strategy() -> impl Strategy<Value = Manifest> {
    prop::collection::vec(
        prop_oneof![
            4 => (path_strategy(), 0..CONTENTS.len(), any::<bool>()).prop_map(|(p, c, x)| Op::Write(p, c, x)),
            1 => path_strategy().prop_map(Op::Mkdir),
        ],
        0..8,
    )
    .prop_map(|ops| {
        let mut ov = Overlay::new(Arc::new(Manifest::default()));
        for op in &ops {
            run(&mut ov, op);
        }
        ov.to_manifest()
    })
}

/// `PROPTEST_CASES` overrides the default case count (for stress runs).
fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

fn scenario() -> impl Strategy<Value = (Manifest, Vec<Op>)> {
    (base_strategy(), prop::collection::vec(op_strategy(), 0..24))
}

fn all_blobs() -> std::collections::HashMap<forkfleet_shared::blob::BlobHash, bytes::Bytes> {
    CONTENTS
        .iter()
        .map(|c| {
            (
                forkfleet_shared::blob::BlobHash::of(c.as_bytes()),
                bytes::Bytes::from_static(c.as_bytes()),
            )
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases(256)))]

    /// The listings (made a directory at a time) are what asking every path says.
    #[test]
    fn the_listings_are_what_each_path_says((base, ops) in scenario()) {
        let base = Arc::new(base);
        let mut ov = Overlay::new(base.clone());
        for op in &ops {
            run(&mut ov, op);
        }
        let mut paths: std::collections::BTreeSet<WsPath> = base.files.keys().cloned().collect();
        paths.extend(base.dirs.iter().cloned());
        for op in ov.changes() {
            paths.extend(op.path().ancestors());
            paths.insert(op.path().clone());
        }
        let mut want_files = Vec::new();
        let mut want_dirs = Vec::new();
        for p in paths.iter().filter(|p| !p.is_root()) {
            match ov.node(p) {
                Node::File(e) => want_files.push((p.clone(), e)),
                Node::Dir => want_dirs.push(p.clone()),
                Node::Missing => {}
            }
        }
        // Read off the view's manifest (the snapshot with the branch's own paths applied).
        prop_assert_eq!(ov.files(), want_files);
        prop_assert_eq!(ov.dirs(), want_dirs);
    }

    #[test]
    fn from_log_reproduces_the_view((base, ops) in scenario()) {
        let base = Arc::new(base);
        let mut ov = Overlay::new(base.clone());
        for op in &ops {
            run(&mut ov, op);
        }
        let replica = Overlay::from_log(base, ov.changes()).unwrap();
        prop_assert_eq!(replica.files(), ov.files());
        prop_assert_eq!(replica.dirs(), ov.dirs());
        prop_assert_eq!(replica.net_changes(), ov.net_changes());
    }

    #[test]
    fn flushing_the_log_onto_the_snapshot_gives_the_view((base, ops) in scenario()) {
        let base_arc = Arc::new(base.clone());
        let mut ov = Overlay::new(base_arc);
        for op in &ops {
            run(&mut ov, op);
        }
        let mut target = ManifestTarget::new(base.clone());
        let report = flush(ov.changes(), &base, &mut target, ConflictPolicy::KeepParent);
        prop_assert!(report.conflicts.is_empty(), "conflicts: {:?}", report.conflicts);
        prop_assert!(report.errors.is_empty(), "errors: {:?}", report.errors);
        let view = ov.to_manifest();
        prop_assert_eq!(&target.manifest().files, &view.files);
        prop_assert_eq!(&target.manifest().dirs, &view.dirs);
        // overwrite behaves the same without third parties
        let mut target2 = ManifestTarget::new(base.clone());
        let report2 = flush(ov.changes(), &base, &mut target2, ConflictPolicy::Overwrite);
        prop_assert_eq!(report2, report);
        prop_assert_eq!(target2, target);
    }

    #[test]
    fn net_changes_agrees_with_comparing_files((base, ops) in scenario()) {
        let base = Arc::new(base);
        let mut ov = Overlay::new(base.clone());
        for op in &ops {
            run(&mut ov, op);
        }
        let after: BTreeMap<WsPath, FileEntry> = ov.files().into_iter().collect();
        let mut want = BTreeMap::new();
        for (path, b) in &base.files {
            match after.get(path) {
                None => { want.insert(path.clone(), NetChange::Deleted); }
                Some(a) if !a.same_as(b) => { want.insert(path.clone(), NetChange::Modified(*a)); }
                Some(_) => {}
            }
        }
        for (path, a) in &after {
            if !base.files.contains_key(path) {
                want.insert(path.clone(), NetChange::Created(*a));
            }
        }
        prop_assert_eq!(ov.net_changes(), want);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases(24)))]

    #[test]
    fn flushing_onto_a_real_directory_gives_the_view((base, ops) in scenario()) {
        let dir = tempfile::tempdir().unwrap();
        let mut seed = DirTarget::new(dir.path(), all_blobs()).unwrap();
        let seeded = flush(
            &base.dirs.iter().map(|d| ChangeOp::Mkdir { path: d.clone() })
                .chain(base.files.iter().map(|(p, e)| ChangeOp::Write { path: p.clone(), entry: *e }))
                .collect::<Vec<_>>(),
            &Manifest::default(),
            &mut seed,
            ConflictPolicy::KeepParent,
        );
        prop_assert!(seeded.errors.is_empty(), "{:?}", seeded.errors);
        prop_assert_eq!(&scan_dir(dir.path(), &[]).unwrap().manifest, &base);

        let mut ov = Overlay::new(Arc::new(base.clone()));
        for op in &ops {
            run(&mut ov, op);
        }
        let mut target = DirTarget::new(dir.path(), all_blobs()).unwrap();
        let report = flush(ov.changes(), &base, &mut target, ConflictPolicy::KeepParent);
        prop_assert!(report.conflicts.is_empty(), "conflicts: {:?}", report.conflicts);
        prop_assert!(report.errors.is_empty(), "errors: {:?}", report.errors);
        prop_assert_eq!(scan_dir(dir.path(), &[]).unwrap().manifest, ov.to_manifest());
    }
}
