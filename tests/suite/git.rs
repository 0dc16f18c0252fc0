//! Git integration (issue 18), with real git and real files: a fork of a workspace that is
//! a git repository records its HEAD; `fork merge --git-branch` commits the winner on a new
//! branch from that commit and leaves the checkout alone; `fork diff --patch` writes a
//! patch `git apply` takes; the refusals name what was wrong.

use super::harness::{forkfleet_env, json, path_str, run_spec, stderr, Example};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;

/// The identity every git command of these tests (and the merges they run) uses; nothing
/// of the machine's git configuration is read, so a fresh CI machine behaves the same.
const IDENTITY: &[(&str, &str)] = &[
    ("GIT_AUTHOR_NAME", "Ada Tester"),
    ("GIT_AUTHOR_EMAIL", "ada@example.invalid"),
    ("GIT_COMMITTER_NAME", "Ada Tester"),
    ("GIT_COMMITTER_EMAIL", "ada@example.invalid"),
    ("GIT_CONFIG_NOSYSTEM", "1"),
    ("GIT_CONFIG_GLOBAL", "/dev/null"),
];

fn git(dir: &Path, args: &[&str]) -> String {
    let out = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(args)
        .envs(IDENTITY.iter().copied())
        .env_remove("GIT_DIR")
        .env_remove("GIT_INDEX_FILE")
        .env_remove("GIT_WORK_TREE")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "git {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn forkfleet(args: &[&str]) -> std::process::Output {
    forkfleet_env(args, IDENTITY)
}

/// The winner `w`: creates `added.txt`, edits the README, deletes `docs/legacy.md`, makes
/// `greet.py` executable, adds a symlink and a binary file. `other` writes one file.
const SCRIPT: &str = r#"
[[turns.w]]
tool_calls = [
  { name = "write_file", args = { path = "added.txt", content = "a new file\nwith two lines\n" } },
  { name = "edit_file", args = { path = "README.md", old_string = "TODO: describe usage.", new_string = "Run `python greet.py NAME`." } },
  { name = "delete_file", args = { path = "docs/legacy.md" } },
  { name = "run_command", args = { command = ["chmod", "+x", "greet.py"] } },
  { name = "run_command", args = { command = ["ln", "-s", "greet.py", "greet-link"] } },
  { name = "run_command", args = { command = ["sh", "-c", "printf 'BIN\\000\\001\\002\\377' > data.bin"] } },
]

[[turns.w]]
text = "done"

[[turns.other]]
tool_calls = [{ name = "write_file", args = { path = "other.txt", content = "other\n" } }]

[[turns.other]]
text = "done"
"#;

/// A judge for `fork resolve --strategy auto`: it picks `w`.
const JUDGE: &str = r#"
[[turns.judge]]
text = '{"winner": "w", "confidence": 0.9, "reasoning": "It does what the goal asks."}'
"#;

fn spec(ex: &Example) -> std::path::PathBuf {
    std::fs::write(ex.dir.path().join("git.toml"), SCRIPT).unwrap();
    std::fs::write(ex.dir.path().join("judge.toml"), JUDGE).unwrap();
    ex.write_spec(
        "goal = \"Tidy the greet tool.\"\nworkspace = \"workspace\"\nmodel = \"scripted:git\"\n\
         judge_model = \"scripted:judge\"\n\
         [models.\"scripted:git\"]\nscript = \"git.toml\"\n\
         [models.\"scripted:judge\"]\nscript = \"judge.toml\"\n\
         [run_command]\ntimeout_s = 30\n\
         [[branches]]\nlabel = \"w\"\nsteer = \"go\"\n\
         [[branches]]\nlabel = \"other\"\nsteer = \"go\"\n",
    )
}

/// The quickstart's workspace as a git repository with one commit (the fork directory
/// ignored, as a user would), forked by [`SCRIPT`]'s branches and left unresolved.
/// Returns the example, the fork id and the fork-time commit.
fn forked_repo() -> (Example, String, String) {
    let ex = Example::quickstart();
    let ws = ex.workspace();
    git(&ws, &["init", "-q", "-b", "main"]);
    std::fs::write(ws.join(".gitignore"), ".forkfleet/\n").unwrap();
    git(&ws, &["add", "-A"]);
    git(&ws, &["commit", "-q", "-m", "init"]);
    let head = git(&ws, &["rev-parse", "HEAD"]).trim().to_string();
    let doc = json(&run_spec(&spec(&ex)));
    let fork = doc["fork_id"].as_str().unwrap().to_string();
    (ex, fork, head)
}

fn data(ex: &Example) -> String {
    path_str(&ex.data()).to_string()
}

#[test]
fn a_fork_records_the_head_and_git_branch_commits_the_winner_on_it_leaving_the_checkout_alone() {
    let (ex, fork, fork_head) = forked_repo();
    let ws = ex.workspace();
    let data = data(&ex);

    // The fork's record names the fork-time commit.
    let show = json(&forkfleet(&[
        "fork", "show", &fork, "--data", &data, "--json",
    ]));
    assert_eq!(show["git"]["commit"], fork_head.as_str(), "{show}");
    assert_eq!(show["git"]["prefix"], "", "{show}");

    // The user goes on: a second commit, an uncommitted edit, an untracked file.
    std::fs::write(ws.join("notes/todo.md"), "# To do\n\nmoved on\n").unwrap();
    git(&ws, &["commit", "-q", "-am", "second"]);
    let second = git(&ws, &["rev-parse", "HEAD"]).trim().to_string();
    std::fs::write(ws.join("README.md"), "my uncommitted edit\n").unwrap();
    std::fs::write(ws.join("scratch.txt"), "untracked\n").unwrap();
    let status = git(&ws, &["status", "--porcelain"]);
    assert!(
        status.contains(" M README.md") && status.contains("?? scratch.txt"),
        "{status}"
    );

    let out = forkfleet(&[
        "fork",
        "merge",
        &fork,
        "--pick",
        "w",
        "--git-branch",
        "ff/w",
        "--data",
        &data,
        "--json",
    ]);
    let doc = json(&out);
    let commit = doc["git_branch"]["commit"].as_str().unwrap().to_string();
    assert_eq!(doc["state"], "merged", "{doc}");
    assert_eq!(doc["git_branch"]["parent"], fork_head.as_str(), "{doc}");

    // The branch: one commit on the fork-time commit, not on the user's second one.
    assert_eq!(git(&ws, &["rev-parse", "ff/w"]).trim(), commit);
    assert_eq!(
        git(&ws, &["log", "-1", "--format=%P", "ff/w"]).trim(),
        fork_head
    );
    assert_eq!(
        git(&ws, &["rev-list", "--count", &format!("{fork_head}..ff/w")]).trim(),
        "1"
    );
    let message = git(&ws, &["log", "-1", "--format=%B", "ff/w"]);
    assert!(
        message.starts_with(&format!("forkfleet: branch `w` of fork {fork}\n")),
        "{message}"
    );
    assert_eq!(
        git(
            &ws,
            &[
                "log",
                "-1",
                "--format=%(trailers:key=Forkfleet-Fork,valueonly)",
                "ff/w"
            ]
        )
        .trim(),
        fork
    );
    // The user's identity (here from the environment), not the fallback.
    assert_eq!(
        git(&ws, &["log", "-1", "--format=%an <%ae>", "ff/w"]).trim(),
        "Ada Tester <ada@example.invalid>"
    );

    // Its tree: the fork-time files with the winner's changes, nothing of `other`'s nor
    // of the user's later work.
    let files = git(&ws, &["ls-tree", "-r", "ff/w"]);
    let mode = |p: &str| {
        files
            .lines()
            .find(|l| l.ends_with(&format!("\t{p}")))
            .map(|l| l.split(' ').next().unwrap().to_string())
    };
    assert_eq!(mode("greet.py").as_deref(), Some("100755"), "{files}");
    assert_eq!(mode("greet-link").as_deref(), Some("120000"), "{files}");
    assert_eq!(mode("added.txt").as_deref(), Some("100644"), "{files}");
    assert_eq!(mode("docs/legacy.md"), None, "{files}");
    assert_eq!(mode("other.txt"), None, "{files}");
    assert_eq!(mode("scratch.txt"), None, "{files}");
    assert_eq!(git(&ws, &["show", "ff/w:greet-link"]), "greet.py");
    assert_eq!(
        git(&ws, &["show", "ff/w:added.txt"]),
        "a new file\nwith two lines\n"
    );
    assert!(git(&ws, &["show", "ff/w:README.md"]).contains("Run `python greet.py NAME`."));
    assert_eq!(
        git(&ws, &["show", "ff/w:notes/todo.md"]),
        git(&ws, &["show", &format!("{fork_head}:notes/todo.md")])
    );
    let bin = Command::new("git")
        .arg("-C")
        .arg(&ws)
        .args(["cat-file", "blob", "ff/w:data.bin"])
        .output()
        .unwrap();
    assert_eq!(bin.stdout, b"BIN\x00\x01\x02\xff");

    // The checkout: same status, branch, HEAD; the edit is still there, nothing applied.
    assert_eq!(git(&ws, &["status", "--porcelain"]), status);
    assert_eq!(
        git(&ws, &["symbolic-ref", "--short", "HEAD"]).trim(),
        "main"
    );
    assert_eq!(git(&ws, &["rev-parse", "HEAD"]).trim(), second);
    assert_eq!(ex.read("README.md").unwrap(), "my uncommitted edit\n");
    assert!(!ws.join("added.txt").exists());
    assert!(ws.join("docs/legacy.md").exists());
}

#[test]
fn fork_diff_patch_applies_to_a_clean_checkout_of_the_fork_commit() {
    let (ex, fork, fork_head) = forked_repo();
    let data = data(&ex);
    let patch = ex.dir.path().join("w.patch");

    // Two branches and none named: refused, naming them.
    let out = forkfleet(&["fork", "diff", &fork, "--patch", "--data", &data]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("name one with --branch LABEL"),
        "{}",
        stderr(&out)
    );

    let out = forkfleet(&[
        "fork",
        "diff",
        &fork,
        "--branch",
        "w",
        "--patch",
        path_str(&patch),
        "--data",
        &data,
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = std::fs::read(&patch).unwrap();
    // To stdout, the same bytes.
    let out = forkfleet(&[
        "fork", "diff", &fork, "--branch", "w", "--patch", "--data", &data,
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(out.stdout, text);
    let shown = String::from_utf8_lossy(&text);
    for header in [
        "diff --git a/added.txt b/added.txt\nnew file mode 100644\n",
        "diff --git a/docs/legacy.md b/docs/legacy.md\ndeleted file mode 100644\n",
        "diff --git a/greet.py b/greet.py\nold mode 100644\nnew mode 100755\n",
        "diff --git a/greet-link b/greet-link\nnew file mode 120000\n",
        "GIT binary patch\nliteral 7\n",
    ] {
        assert!(shown.contains(header), "no {header:?} in\n{shown}");
    }

    // A clean checkout of the fork-time commit takes it.
    let clean = ex.dir.path().join("clean");
    git(
        ex.dir.path(),
        &["clone", "-q", path_str(&ex.workspace()), path_str(&clean)],
    );
    git(&clean, &["checkout", "-q", &fork_head]);
    git(&clean, &["apply", "--check", path_str(&patch)]);
    git(&clean, &["apply", path_str(&patch)]);
    let read = |p: &str| std::fs::read_to_string(clean.join(p)).unwrap();
    assert_eq!(read("added.txt"), "a new file\nwith two lines\n");
    assert!(read("README.md").contains("Run `python greet.py NAME`."));
    assert!(!clean.join("docs/legacy.md").exists());
    let mode = std::fs::metadata(clean.join("greet.py"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o111, 0o111, "{mode:o}");
    assert_eq!(
        std::fs::read_link(clean.join("greet-link")).unwrap(),
        Path::new("greet.py")
    );
    assert_eq!(
        std::fs::read(clean.join("data.bin")).unwrap(),
        b"BIN\x00\x01\x02\xff"
    );
    assert!(!clean.join("other.txt").exists());
}

#[test]
fn git_branch_refuses_an_existing_branch_a_bad_name_and_a_fork_made_outside_git() {
    let (ex, fork, fork_head) = forked_repo();
    let ws = ex.workspace();
    let data = data(&ex);
    git(&ws, &["branch", "taken"]);

    // `fork merge FORK --pick w --git-branch BRANCH`: refused with exit 2, saying `says`.
    let refused = |fork: &str, data: &str, branch: &str, says: &str| {
        let out = forkfleet(&[
            "fork",
            "merge",
            fork,
            "--pick",
            "w",
            "--git-branch",
            branch,
            "--data",
            data,
        ]);
        assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
        assert!(stderr(&out).contains(says), "{}", stderr(&out));
    };
    refused(&fork, &data, "taken", "branch `taken` already exists");
    refused(&fork, &data, "a b", "not a valid branch name");
    // Refused before anything happened: not merged, the branch where it was, no new ref.
    let show = json(&forkfleet(&[
        "fork", "show", &fork, "--data", &data, "--json",
    ]));
    assert_eq!(show["state"], "settled", "{show}");
    assert_eq!(git(&ws, &["rev-parse", "taken"]).trim(), fork_head);
    assert_eq!(
        git(&ws, &["for-each-ref", "--format=%(refname)", "refs/heads/"]).trim(),
        "refs/heads/main\nrefs/heads/taken"
    );
    assert!(!ws.join("added.txt").exists());

    // A workspace that was no git repository at fork time has no commit to start from.
    let plain = Example::quickstart();
    let doc = json(&run_spec(&spec(&plain)));
    let plain_fork = doc["fork_id"].as_str().unwrap().to_string();
    let plain_data = path_str(&plain.data()).to_string();
    let show = json(&forkfleet(&[
        "fork",
        "show",
        &plain_fork,
        "--data",
        &plain_data,
        "--json",
    ]));
    assert!(show.get("git").is_none(), "{show}");
    refused(&plain_fork, &plain_data, "x", "has no git commit recorded");
    let show = json(&forkfleet(&[
        "fork",
        "show",
        &plain_fork,
        "--data",
        &plain_data,
        "--json",
    ]));
    assert_eq!(show["state"], "settled", "{show}");
}

/// `fork resolve --git-branch`: the judge's pick is committed on the new branch from the
/// fork-time commit, and the checkout is left alone.
#[test]
fn resolve_with_git_branch_commits_the_judges_pick() {
    let (ex, fork, fork_head) = forked_repo();
    let ws = ex.workspace();
    let data = data(&ex);
    let status = git(&ws, &["status", "--porcelain"]);
    let doc = json(&forkfleet(&[
        "fork",
        "resolve",
        &fork,
        "--strategy",
        "auto",
        "--git-branch",
        "ff/resolved",
        "--data",
        &data,
        "--json",
    ]));
    assert_eq!(doc["decision"]["kind"], "commit", "{doc}");
    assert_eq!(doc["decision"]["winner"], "w", "{doc}");
    let commit = doc["git_branch"]["commit"].as_str().unwrap();
    assert_eq!(git(&ws, &["rev-parse", "ff/resolved"]).trim(), commit);
    assert_eq!(
        git(&ws, &["log", "-1", "--format=%P", "ff/resolved"]).trim(),
        fork_head
    );
    assert!(git(&ws, &["log", "-1", "--format=%B", "ff/resolved"])
        .starts_with(&format!("forkfleet: branch `w` of fork {fork}\n")));
    assert_eq!(
        git(&ws, &["show", "ff/resolved:added.txt"]),
        "a new file\nwith two lines\n"
    );
    // Nothing applied to the checkout.
    assert_eq!(git(&ws, &["status", "--porcelain"]), status);
    assert!(!ws.join("added.txt").exists());
}
