use super::command::{utf8_complete_prefix, Capped};
use super::materialize::{stays_inside, Stamp};
use super::*;
use bytes::Bytes;
use forkfleet_shared::blob::BlobHash;
use forkfleet_shared::manifest::{FileEntry, MODE_EXEC, MODE_FILE, MODE_SYMLINK};
use forkfleet_shared::overlay::ChangeOp;
use std::time::Duration;

#[test]
fn symlinks_must_stay_inside() {
    let at = WsPath::parse("a/b/link").unwrap();
    assert!(stays_inside(&at, "c.txt"));
    assert!(stays_inside(&at, "../c.txt"));
    assert!(stays_inside(&at, "../../top.txt"));
    assert!(stays_inside(&at, "./../c/../d.txt"));
    assert!(!stays_inside(&at, "../../../out.txt"));
    assert!(
        !stays_inside(&at, "../../../a/b/c.txt"),
        "leaves, then comes back"
    );
    assert!(!stays_inside(&at, "/etc/passwd"));
    // For the OS `x\y` is one name: four `..` leave the tree.
    assert!(!stays_inside(&at, "x\\y/../../../../out.txt"));
    let top = WsPath::parse("link").unwrap();
    assert!(stays_inside(&top, "a.txt"));
    assert!(!stays_inside(&top, "../a.txt"));
}

#[test]
fn capped_output_keeps_head_and_tail() {
    let mut c = Capped::new(10);
    c.push(b"0123456789");
    c.push(b"abcdefghij");
    let (text, dropped) = c.finish();
    assert_eq!(dropped, 10);
    assert!(text.starts_with("01234"), "{text}");
    assert!(text.ends_with("fghij"), "{text}");
    assert!(text.contains("10 bytes of output left out"));
}

fn capped(limit: usize, chunks: &[&[u8]]) -> (String, u64) {
    let mut c = Capped::new(limit);
    for chunk in chunks {
        c.push(chunk);
    }
    c.finish()
}

#[test]
fn output_within_the_limit_is_kept_whole() {
    assert_eq!(capped(10, &[b"0123456789"]), ("0123456789".into(), 0));
    assert_eq!(
        capped(10, &[b"01", b"234", b"56789"]),
        ("0123456789".into(), 0)
    );
    assert_eq!(capped(10, &[]), (String::new(), 0));
    // A character across the head/tail boundary is not split when nothing is cut.
    let text = "abcé€xyz"; // 1+1+1+2+3+1+1+1 = 11 bytes
    assert_eq!(capped(12, &[text.as_bytes()]), (text.into(), 0));
    for split in 0..text.len() {
        let (a, b) = text.as_bytes().split_at(split);
        assert_eq!(capped(11, &[a, b]), (text.into(), 0), "split at {split}");
    }
}

#[test]
fn long_output_is_cut_in_the_middle_with_the_count() {
    let input: Vec<u8> = (0..1000u32).map(|i| b'a' + (i % 26) as u8).collect();
    for chunk in [1usize, 7, 100, 1000] {
        let chunks: Vec<&[u8]> = input.chunks(chunk).collect();
        let (text, dropped) = capped(100, &chunks);
        assert_eq!(dropped, 900, "chunks of {chunk}");
        let (head, rest) = text
            .split_once("\n[... 900 bytes of output left out ...]\n")
            .unwrap();
        assert_eq!(head.as_bytes(), &input[..50]);
        assert_eq!(rest.as_bytes(), &input[950..]);
    }
}

#[test]
fn a_cut_never_breaks_a_character() {
    // Every cut position through runs of 2-, 3- and 4-byte characters.
    for ch in ["é", "€", "😀"] {
        let input = ch.repeat(100);
        for limit in 2..40 {
            let (text, dropped) = capped(limit, &[input.as_bytes()]);
            assert!(!text.contains('\u{FFFD}'), "{ch} limit {limit}: {text}");
            let marker = format!("\n[... {dropped} bytes of output left out ...]\n");
            let (head, tail) = text.split_once(&marker).unwrap();
            assert!(head.chars().all(|c| c.to_string() == ch));
            assert!(tail.chars().all(|c| c.to_string() == ch));
            assert!(head.len() <= limit / 2 && tail.len() <= limit - limit / 2);
            assert_eq!(head.len() + tail.len() + dropped as usize, input.len());
        }
    }
}

#[test]
fn utf8_prefixes() {
    assert_eq!(utf8_complete_prefix(b"abc"), 3);
    assert_eq!(utf8_complete_prefix("a€".as_bytes()), 4);
    assert_eq!(utf8_complete_prefix(&"a€".as_bytes()[..3]), 1);
    assert_eq!(utf8_complete_prefix(&"a😀".as_bytes()[..4]), 1);
    // Invalid bytes earlier on: only a cut character at the end is taken off.
    assert_eq!(utf8_complete_prefix(b"\xff\xfeab"), 4);
    assert_eq!(utf8_complete_prefix(b"\xffa\xe2\x82"), 2);
}

fn ws(p: &str) -> WsPath {
    WsPath::parse(p).unwrap()
}

/// `(kind, path)` of each op.
fn summary(ch: &TreeChanges) -> Vec<(&'static str, &str)> {
    ch.ops
        .iter()
        .map(|op| (op.kind(), op.path().as_str()))
        .collect()
}

fn written_entry<'a>(ch: &'a TreeChanges, path: &str) -> &'a FileEntry {
    ch.ops
        .iter()
        .find(|op| op.path().as_str() == path)
        .and_then(ChangeOp::written)
        .unwrap()
}

#[test]
fn tree_changes_finds_what_a_command_did() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    for (p, c) in [
        ("README.md", "draft\n"),
        ("same.txt", "same\n"),
        ("run.sh", "echo hi\n"),
        ("gone/a.txt", "a\n"),
        ("gone/deep/b.txt", "b\n"),
        ("was_file", "f\n"),
        ("was_dir/x.txt", "x\n"),
        ("old.txt", "old\n"),
        ("src/keep.rs", "k\n"),
    ] {
        std::fs::create_dir_all(d.join(p).parent().unwrap()).unwrap();
        std::fs::write(d.join(p), c).unwrap();
    }
    std::fs::create_dir_all(d.join("empty_before")).unwrap();
    std::os::unix::fs::symlink("README.md", d.join("link")).unwrap();
    let tree = forkfleet_shared::manifest::scan_dir(d, &[])
        .unwrap()
        .manifest;

    // What the command does.
    std::fs::write(d.join("README.md"), "final\n").unwrap();
    std::fs::set_permissions(d.join("run.sh"), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::remove_dir_all(d.join("gone")).unwrap();
    std::fs::remove_file(d.join("was_file")).unwrap();
    std::fs::create_dir_all(d.join("was_file")).unwrap();
    std::fs::write(d.join("was_file/in.txt"), "in\n").unwrap();
    std::fs::remove_dir_all(d.join("was_dir")).unwrap();
    std::fs::write(d.join("was_dir"), "now a file\n").unwrap();
    std::fs::remove_file(d.join("old.txt")).unwrap();
    std::fs::write(d.join("new.bin"), [0u8, 1, 2, 255]).unwrap();
    std::fs::create_dir_all(d.join("made/empty")).unwrap();
    std::fs::remove_file(d.join("link")).unwrap();
    std::os::unix::fs::symlink("same.txt", d.join("link")).unwrap();
    std::os::unix::fs::symlink("src/keep.rs", d.join("inside")).unwrap();
    std::os::unix::fs::symlink("/etc/passwd", d.join("escape")).unwrap();
    std::os::unix::fs::symlink("../../x", d.join("src/escape2")).unwrap();
    std::fs::write(d.join("big.dat"), vec![b'x'; 2000]).unwrap();
    let _socket = std::os::unix::net::UnixListener::bind(d.join("sock")).unwrap();

    let ch = tree_changes(d, &tree, &Materialized::default(), 1000);
    assert_eq!(
        summary(&ch),
        [
            ("delete", "old.txt"),
            ("delete", "was_file"),
            ("rmdir", "gone"),
            ("rmdir", "was_dir"),
            ("mkdir", "made/empty"),
            ("write", "README.md"),
            ("write", "inside"),
            ("write", "link"),
            ("write", "new.bin"),
            ("write", "run.sh"),
            ("write", "was_dir"),
            ("write", "was_file/in.txt"),
        ]
    );
    let bin = written_entry(&ch, "new.bin");
    assert!(bin.binary);
    assert_eq!(bin.hash, BlobHash::of(&[0u8, 1, 2, 255]));
    assert_eq!(&ch.blobs[&bin.hash][..], &[0u8, 1, 2, 255]);
    let inside = written_entry(&ch, "inside");
    assert!(inside.is_symlink());
    assert_eq!(&ch.blobs[&inside.hash][..], b"src/keep.rs");
    assert_eq!(written_entry(&ch, "README.md").mode, MODE_FILE);
    assert_eq!(
        &ch.blobs[&written_entry(&ch, "README.md").hash][..],
        b"final\n"
    );
    assert_eq!(written_entry(&ch, "link").mode, MODE_SYMLINK);
    let run_sh = written_entry(&ch, "run.sh");
    assert_eq!(run_sh.mode, MODE_EXEC);
    assert_eq!(run_sh.hash, tree.files[&ws("run.sh")].hash);
    let refused: Vec<&str> = ch.not_imported.iter().map(|(p, _)| p.as_str()).collect();
    assert_eq!(refused, ["big.dat", "escape", "sock", "src/escape2"]);
    assert!(ch.not_imported[1].1.contains("outside the workspace"));
    assert!(ch.not_imported[0].1.contains("over the limit"));
}

#[test]
fn tree_changes_leaves_what_it_cannot_read_or_did_not_write() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::create_dir_all(d.join("sub")).unwrap();
    std::fs::write(d.join("sub/a.txt"), "a\n").unwrap();
    std::fs::write(d.join("big.dat"), vec![b'y'; 2000]).unwrap();
    let mut tree = forkfleet_shared::manifest::scan_dir(d, &[])
        .unwrap()
        .manifest;
    // A symlink that leaves the tree was never materialised: it is not deleted.
    tree.insert_file(
        ws("escape"),
        FileEntry::for_bytes(b"/etc/passwd", MODE_SYMLINK),
    );
    let written = Materialized {
        skipped: vec![ws("escape")],
        ..Materialized::default()
    };
    // Unchanged big files from the tree are compared whatever the limit.
    let ch = tree_changes(d, &tree, &written, 1000);
    assert!(ch.ops.is_empty(), "{ch:?}");
    assert!(ch.not_imported.is_empty());

    // A big file changed past the limit is left as it was, not deleted.
    std::fs::write(d.join("big.dat"), vec![b'y'; 3000]).unwrap();
    let ch = tree_changes(d, &tree, &written, 1000);
    assert!(ch.ops.is_empty(), "{ch:?}");
    assert_eq!(ch.not_imported.len(), 1);

    // A command that replaced the escaping link, and changed big.dat (now within the
    // limit).
    std::fs::write(d.join("escape"), "plain\n").unwrap();
    let ch = tree_changes(d, &tree, &written, 1 << 20);
    assert_eq!(summary(&ch), [("write", "big.dat"), ("write", "escape")]);

    // The directory of the escaping link removed: one rmdir stands for both.
    std::fs::create_dir(d.join("sub/deeper")).unwrap();
    tree.insert_file(
        ws("sub/deeper/out"),
        FileEntry::for_bytes(b"../../..", MODE_SYMLINK),
    );
    tree.dirs.insert(ws("sub/deeper"));
    let written = Materialized {
        skipped: vec![ws("escape"), ws("sub/deeper/out")],
        ..Materialized::default()
    };
    std::fs::remove_file(d.join("escape")).unwrap();
    std::fs::write(d.join("big.dat"), vec![b'y'; 2000]).unwrap();
    assert!(tree_changes(d, &tree, &written, 1000).ops.is_empty());
    std::fs::remove_dir_all(d.join("sub")).unwrap();
    let ch = tree_changes(d, &tree, &written, 1000);
    assert_eq!(summary(&ch), [("rmdir", "sub")]);
}

/// A tree of `files` and a cache holding their blobs.
fn stored(files: &[(&str, &str)]) -> (Manifest, BlobCache) {
    let store = forkfleet_shared::blob::MemBlobStore::new();
    let mut tree = Manifest::default();
    for (p, c) in files {
        store.insert(Bytes::copy_from_slice(c.as_bytes()));
        tree.insert_file(ws(p), FileEntry::for_bytes(c.as_bytes(), MODE_FILE));
    }
    (tree, BlobCache::new(std::sync::Arc::new(store), 1 << 20))
}

async fn materialized(files: &[(&str, &str)]) -> (tempfile::TempDir, Manifest, Materialized) {
    let (tree, cache) = stored(files);
    let dir = tempfile::tempdir().unwrap();
    let written = materialize(&tree, &cache, dir.path(), Make::Write)
        .await
        .unwrap();
    (dir, tree, written)
}

#[tokio::test]
async fn files_as_materialised_are_not_read_again() {
    let (dir, tree, mut written) = materialized(&[
        ("a.txt", "aaaa\n"),
        ("d/b.txt", "bbbb\n"),
        ("d/c.txt", "cc\n"),
    ])
    .await;
    let d = dir.path();
    // Nothing touched, and every stamp older than the last clock tick of the writing:
    // nothing is read.
    written.fence = None;
    let ch = tree_changes(d, &tree, &written, 1 << 20);
    assert!(ch.ops.is_empty(), "{ch:?}");
    assert_eq!(ch.read, 0);

    // A file rewritten with as many bytes and its mtime set back: its ctime moved.
    let mtime = std::fs::metadata(d.join("a.txt"))
        .unwrap()
        .modified()
        .unwrap();
    std::fs::write(d.join("a.txt"), "AAAA\n").unwrap();
    let file = std::fs::File::options()
        .write(true)
        .open(d.join("a.txt"))
        .unwrap();
    file.set_modified(mtime).unwrap();
    let now = Stamp::of(&std::fs::metadata(d.join("a.txt")).unwrap());
    let moved = now != written.stamps[&ws("a.txt")].0;
    if !moved {
        // Changed within the clock tick it was written in (a kernel without fine-grained
        // ctimes): only the last-tick rule tells.
        written.fence = Some(now.ctime);
    }
    let ch = tree_changes(d, &tree, &written, 1 << 20);
    assert_eq!(summary(&ch), [("write", "a.txt")]);
    if moved {
        assert_eq!(ch.read, 1);
    }
}

#[tokio::test]
async fn a_file_stamped_in_the_last_tick_is_read() {
    let (dir, tree, mut written) = materialized(&[("a.txt", "aaaa\n"), ("b.txt", "bbbb\n")]).await;
    let d = dir.path();
    // The command changed a.txt without its stamp showing it (as within the tick it was
    // written in): trusted, the stamp would hide the change; as the last tick's, it is read.
    std::fs::write(d.join("a.txt"), "AAAA\n").unwrap();
    let now = Stamp::of(&std::fs::metadata(d.join("a.txt")).unwrap());
    let entry = tree.files[&ws("a.txt")];
    written.stamps.insert(ws("a.txt"), (now, entry));
    written.fence = Some(now.ctime);
    let ch = tree_changes(d, &tree, &written, 1 << 20);
    assert_eq!(summary(&ch), [("write", "a.txt")]);
    written.fence = None;
    let ch = tree_changes(d, &tree, &written, 1 << 20);
    assert!(ch.ops.is_empty(), "a trusted stamp is not read: {ch:?}");
}

#[tokio::test]
async fn a_workdir_is_removed_after_use_or_when_dropped() {
    let (tree, cache) = stored(&[("a.txt", "a\n")]);
    let work = Workdir::create("forkfleet-test-", tree.clone(), &cache)
        .await
        .unwrap();
    let path = work.root.0.clone();
    let spec = CommandSpec {
        argv: vec![
            "sh".into(),
            "-c".into(),
            "cat a.txt > made.txt && echo c > \"$HOME/cache\" && echo t > \"$TMPDIR/t\"".into(),
        ],
        env: BTreeMap::new(),
        timeout: Duration::from_secs(30),
        max_output_bytes: 1024,
        sandbox: Default::default(),
    };
    let run = work
        .run(&WsPath::root(), &spec, std::future::pending())
        .await;
    assert_eq!(
        run.outcome,
        CommandOutcome::Exited { code: 0 },
        "{}",
        run.output
    );
    // HOME and TMPDIR are beside the tree: what goes there is no change.
    let ch = work.changes(1 << 20).await;
    assert_eq!(summary(&ch), [("write", "made.txt")]);
    assert!(!path.exists());

    // Given up (dropped) where no runtime runs: removed at once.
    let work = Workdir::create("forkfleet-test-", tree, &cache)
        .await
        .unwrap();
    let path = work.root.0.clone();
    assert!(path.join("ws/a.txt").exists());
    std::thread::spawn(move || drop(work)).join().unwrap();
    assert!(!path.exists());
}

#[tokio::test]
async fn a_workdir_command_is_confined_to_its_tree_home_and_tmp() {
    assert!(
        sandbox::support().landlock(),
        "this test needs a kernel with Landlock"
    );
    let (tree, cache) = stored(&[("a.txt", "in-tree\n")]);
    let secret = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(secret.path(), "workdir-secret\n").unwrap();
    let work = Workdir::create("forkfleet-test-", tree, &cache)
        .await
        .unwrap();
    let root = work.root.0.clone();
    let spec = CommandSpec {
        argv: vec![
            "sh".into(),
            "-c".into(),
            "cat a.txt; cat \"$1\"; echo read=$?; echo x > \"$HOME/../escape\"; echo wrote=$?; echo h > \"$HOME/h\" && echo t > \"$TMPDIR/t\" && echo scratch-ok".into(),
            "sh".into(),
            secret.path().display().to_string(),
        ],
        env: BTreeMap::new(),
        timeout: Duration::from_secs(30),
        max_output_bytes: 4096,
        sandbox: SandboxSpec::default(),
    };
    let run = work
        .run(&WsPath::root(), &spec, std::future::pending())
        .await;
    assert_eq!(
        run.outcome,
        CommandOutcome::Exited { code: 0 },
        "{}",
        run.output
    );
    assert!(run.output.contains("in-tree"), "{}", run.output);
    assert!(run.output.contains("read=1"), "{}", run.output);
    assert!(!run.output.contains("workdir-secret"), "{}", run.output);
    assert!(run.output.contains("wrote=2"), "{}", run.output);
    assert!(run.output.contains("scratch-ok"), "{}", run.output);
    assert!(!root.join("escape").exists());
    work.remove().await;
}

mod sandbox_prepare {
    use super::super::sandbox::{around, prepare, SandboxSpec, Support};
    use forkfleet_shared::endpoint::{CommandSandbox, SandboxMode};

    fn spec(mode: SandboxMode, network: bool) -> SandboxSpec {
        SandboxSpec {
            settings: CommandSandbox {
                mode,
                network,
                ..CommandSandbox::default()
            },
            writable: vec![std::env::temp_dir()],
            exec: Vec::new(),
            layers: None,
        }
    }

    #[test]
    fn off_is_nothing_and_auto_without_landlock_is_limits_only() {
        let none = Support { abi: 0 };
        assert!(prepare(&spec(SandboxMode::Off, false), none)
            .unwrap()
            .is_none());
        let auto = prepare(&spec(SandboxMode::Auto, false), none)
            .unwrap()
            .unwrap();
        assert!(!auto.landlocked());
    }

    #[test]
    fn required_without_landlock_is_refused_naming_why() {
        let err = prepare(&spec(SandboxMode::Required, true), Support { abi: 0 }).unwrap_err();
        assert!(
            err.starts_with(
                "the sandbox is required (`[run_command] sandbox = \"required\"`) but "
            ) && err.contains("Landlock")
                && err.ends_with("the command was not run"),
            "{err}"
        );
        // Landlock without network rules: refused only while the network is to be off.
        let err = prepare(&spec(SandboxMode::Required, false), Support { abi: 3 }).unwrap_err();
        assert!(err.contains("ABI 3 without network rules"), "{err}");
        if super::super::sandbox::support().landlock() {
            let ok = prepare(&spec(SandboxMode::Required, true), Support { abi: 3 })
                .unwrap()
                .unwrap();
            assert!(ok.landlocked());
        }
    }

    #[test]
    fn a_directory_is_granted_around_what_is_kept_out() {
        let dir = tempfile::tempdir().unwrap();
        let root = std::fs::canonicalize(dir.path()).unwrap();
        for d in ["a/b", "c"] {
            std::fs::create_dir_all(root.join(d)).unwrap();
        }
        for f in ["a/key", "a/b/x", "a/y", "z"] {
            std::fs::write(root.join(f), "").unwrap();
        }
        std::os::unix::fs::symlink("/", root.join("a/link")).unwrap();
        assert_eq!(around(&root, &[]), vec![root.clone()]);
        let key = root.join("a/key");
        let mut got = around(&root, &[&key]);
        got.sort();
        let want: Vec<_> = ["a/b", "a/y", "c", "z"]
            .iter()
            .map(|p| root.join(p))
            .collect();
        assert_eq!(got, want);
        assert!(around(&root, &[&root]).is_empty());
    }

    #[test]
    fn the_strongest_set_up_that_starts_a_command_is_chosen() {
        use super::super::setup::decide;
        use std::cell::RefCell;
        let lands = Support { abi: 7 };
        // Everything works: layered under Landlock, and only that is tried.
        let tried = RefCell::new(Vec::new());
        let s = decide(
            lands,
            Ok(()),
            |l, s| {
                tried.borrow_mut().push((l, s.abi));
                Ok(())
            },
            "no Landlock in this kernel",
        );
        assert_eq!((s.layered, s.landlock_abi, s.fallback), (true, 7, None));
        assert_eq!(tried.take(), vec![(true, 7)]);
        // The pair fails (the bug of a relative store): Landlock is kept, the trees go whole.
        let s = decide(
            lands,
            Ok(()),
            |l, s| {
                tried.borrow_mut().push((l, s.abi));
                if l && s.abi > 0 {
                    Err("`test`: No such file or directory".into())
                } else {
                    Ok(())
                }
            },
            "no Landlock in this kernel",
        );
        assert_eq!((s.layered, s.landlock_abi), (false, 7));
        assert!(s
            .fallback
            .unwrap()
            .contains("layered trees under Landlock: `test`"));
        assert_eq!(tried.take(), vec![(true, 7), (false, 7)]);
        // Landlock fails whatever the tree: layered trees with the limits only.
        let s = decide(
            lands,
            Ok(()),
            |_, s| {
                if s.abi > 0 {
                    Err("EPERM".into())
                } else {
                    Ok(())
                }
            },
            "no Landlock in this kernel",
        );
        assert_eq!((s.layered, s.landlock_abi, s.kernel_abi), (true, 0, 7));
        // No overlay, no Landlock: nothing to try.
        let s = decide(
            Support { abi: 0 },
            Err("no user namespaces".into()),
            |l, s| {
                tried.borrow_mut().push((l, s.abi));
                Ok(())
            },
            "no Landlock in this kernel",
        );
        assert_eq!((s.layered, s.landlock_abi), (false, 0));
        assert!(tried.take().is_empty());
        let why = s.fallback.unwrap();
        assert!(
            why.contains("no user namespaces") && why.contains("no Landlock"),
            "{why}"
        );
    }
}
