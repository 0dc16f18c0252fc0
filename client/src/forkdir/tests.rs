use super::*;

#[test]
fn components_that_could_escape_are_refused() {
    for bad in [
        "", ".", "..", "../x", "a/b", "a\\b", "\\", "/", "/etc", "a\0b", "a\nb",
    ] {
        assert!(check_component(bad).is_err(), "{bad:?} must be refused");
    }
    assert!(check_component(&"x".repeat(256)).is_err());
    for good in [
        "a",
        "approach_a",
        "x.y",
        "-dash",
        ".hidden",
        "..dots",
        "ünï",
    ] {
        assert!(check_component(good).is_ok(), "{good:?} must be accepted");
    }
}

#[test]
fn confined_paths_stay_under_the_root() {
    let root = Path::new("/tmp/fork");
    assert_eq!(
        confined(root, "a/b.txt").unwrap(),
        PathBuf::from("/tmp/fork/a/b.txt")
    );
    for bad in ["", "../x", "a/../../x", "/abs", "a//b", "a/./b", "a\\..\\x"] {
        assert!(confined(root, bad).is_err(), "{bad:?} must be refused");
    }
}

#[test]
fn hostile_labels_get_an_encoded_directory_name() {
    assert_eq!(branch_dir_name("approach_a"), "approach_a");
    for bad in [
        "../../x", "..", ".", "", "a/b", "a\\b", "~x", "a b", ".hidden",
    ] {
        let name = branch_dir_name(bad);
        assert!(name.starts_with('~'), "{bad:?} -> {name}");
        assert_eq!(name.len(), 17, "{bad:?} -> {name}");
        check_component(&name).unwrap();
    }
    assert_ne!(branch_dir_name("../../x"), branch_dir_name("../../y"));
}

#[test]
fn fork_ids_make_one_component() {
    let id = ForkId::new();
    let dir = fork_dir(Path::new("/ws"), id).unwrap();
    assert_eq!(dir, Path::new("/ws/.forkfleet/forks").join(id.to_string()));
}

#[test]
fn detect_prefers_the_template_then_pycharm_then_code() {
    let bin = tempfile::tempdir().unwrap();
    let path = bin.path().as_os_str().to_owned();
    assert_eq!(detect(None, Some(&path)).unwrap(), Tool::Terminal);
    assert_eq!(detect(None, None).unwrap(), Tool::Terminal);
    make_exe(&bin.path().join("code"));
    assert_eq!(
        detect(None, Some(&path)).unwrap(),
        Tool::VsCode(bin.path().join("code"))
    );
    make_exe(&bin.path().join("charm"));
    assert_eq!(
        detect(None, Some(&path)).unwrap(),
        Tool::PyCharm(bin.path().join("charm"))
    );
    assert_eq!(
        detect(Some(OsStr::new("meld '{parent}' {branches}")), Some(&path)).unwrap(),
        Tool::Custom(vec!["meld".into(), "{parent}".into(), "{branches}".into()])
    );
    assert_eq!(
        detect(Some(OsStr::new("  ")), Some(&path)).unwrap(),
        Tool::PyCharm(bin.path().join("charm"))
    );
    assert!(detect(Some(OsStr::new("meld \"open")), None).is_err());
}

fn make_exe(p: &Path) {
    std::fs::write(p, "#!/bin/sh\n").unwrap();
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
}

fn targets_of(n: usize) -> Targets {
    Targets {
        parent: PathBuf::from("/f/parent"),
        branches: (0..n)
            .map(|i| {
                (
                    format!("b{i}"),
                    Some(PathBuf::from(format!("/f/branches/b{i}"))),
                )
            })
            .collect(),
        pairs: (0..n)
            .map(|i| Pair {
                label: format!("b{i}"),
                shown: format!("branches/b{i}/x"),
                path: "x".into(),
                parent: None,
                branch: Some(PathBuf::from(format!("/f/branches/b{i}/x"))),
                diff: None,
            })
            .collect(),
    }
}

fn words(cmds: &[Vec<OsString>]) -> Vec<Vec<String>> {
    cmds.iter()
        .map(|c| c.iter().map(|w| w.to_string_lossy().into_owned()).collect())
        .collect()
}

#[test]
fn commands_follow_each_tools_convention() {
    let t = targets_of(3);
    let (c, notes) = commands(&Tool::PyCharm(PathBuf::from("charm")), &t);
    assert_eq!(
        words(&c),
        vec![vec![
            "charm",
            "diff",
            "/f/branches/b0",
            "/f/parent",
            "/f/branches/b1"
        ]]
    );
    assert!(notes[0].contains("b2"), "{notes:?}");
    let (c, _) = commands(&Tool::PyCharm(PathBuf::from("charm")), &targets_of(1));
    assert_eq!(
        words(&c),
        vec![vec!["charm", "diff", "/f/parent", "/f/branches/b0"]]
    );
    let (c, _) = commands(&Tool::VsCode(PathBuf::from("code")), &targets_of(2));
    assert_eq!(
        words(&c),
        vec![
            vec!["code", "--diff", "/dev/null", "/f/branches/b0/x"],
            vec!["code", "--diff", "/dev/null", "/f/branches/b1/x"],
        ]
    );
    let tool = Tool::Custom(vec![
        "tool".into(),
        "--base={parent}".into(),
        "{branches}".into(),
        "--each={branches}".into(),
    ]);
    let (c, _) = commands(&tool, &targets_of(2));
    assert_eq!(
        words(&c),
        vec![vec![
            "tool",
            "--base=/f/parent",
            "/f/branches/b0",
            "/f/branches/b1",
            "--each=/f/branches/b0",
            "--each=/f/branches/b1",
        ]]
    );
    let (c, _) = commands(&Tool::Custom(vec!["t".into()]), &targets_of(1));
    assert_eq!(words(&c), vec![vec!["t", "/f/parent", "/f/branches/b0"]]);
}

#[test]
fn the_terminal_diff_names_the_files_of_the_fork_directory() {
    let pair = |parent: bool, branch: bool, diff: &str| Pair {
        label: "b0".into(),
        shown: "branches/b0/x".into(),
        path: "x".into(),
        parent: parent.then(|| PathBuf::from("/f/parent/x")),
        branch: branch.then(|| PathBuf::from("/f/branches/b0/x")),
        diff: Some(Arc::from(diff)),
    };
    let pairs = [
        pair(true, true, "--- a/x\n+++ b/x\n@@ -1 +1 @@\n-old\n+new\n"),
        pair(true, false, "--- a/x\n+++ /dev/null\n@@ -1 +0,0 @@\n-old\n"),
        pair(false, true, "[binary · 3 bytes · sha256:abc]"),
    ];
    assert_eq!(
        terminal_diff(&pairs, false),
        "diff parent/x branches/b0/x\n--- parent/x\n+++ branches/b0/x\n@@ -1 +1 @@\n-old\n+new\n\n\
         diff parent/x branches/b0/x (deleted by b0)\n--- parent/x\n+++ /dev/null\n@@ -1 +0,0 @@\n-old\n\n\
         diff parent/x branches/b0/x (created by b0)\n[binary · 3 bytes · sha256:abc]\n\n"
    );
    let coloured = terminal_diff(&pairs[..1], true);
    assert!(
        coloured.contains("\x1b[1m--- parent/x\x1b[0m\n"),
        "{coloured}"
    );
    assert!(
        coloured.contains("\x1b[36m@@ -1 +1 @@\x1b[0m\n"),
        "{coloured}"
    );
    assert!(coloured.contains("\x1b[31m-old\x1b[0m\n"), "{coloured}");
    assert!(coloured.contains("\x1b[32m+new\x1b[0m\n"), "{coloured}");
}

#[test]
fn shell_lines_quote_what_needs_it() {
    let argv: Vec<OsString> = vec!["code".into(), "--diff".into(), "a b".into(), "it's".into()];
    assert_eq!(shell_line(&argv), r"code --diff 'a b' 'it'\''s'");
}
