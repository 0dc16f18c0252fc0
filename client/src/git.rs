//! The user's git repository, through the `git` command line (docs/GIT.md, ADR 23):
//!
//! - [`head_at`]: where a workspace stands when a fork is made (the commit `HEAD` names,
//!   the workspace's directory inside the repository, uncommitted changes or not);
//! - [`open_for_branch`] then [`GitRepo::write_commit`] then [`GitRepo::create_branch`]:
//!   a winner's changes committed on a *new* branch from that commit, with plumbing only
//!   (a temporary index, `read-tree`, `hash-object -w`, `update-index`, `write-tree`,
//!   `commit-tree`, `update-ref` with an empty old value). The user's working tree, index
//!   and `HEAD` are never read or written, no hook runs, and the branch is the last thing
//!   written: a failure before it leaves no ref (only unreferenced objects `git gc` drops).
//!
//! Every function here blocks (it runs `git`): call it from a blocking task.

use forkfleet_shared::api::GitHead;
use forkfleet_shared::diff::patch::git_mode;
use forkfleet_shared::error::ErrorKind;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

/// The identity a commit gets when the repository's configuration and the environment
/// name none (`git var GIT_AUTHOR_IDENT` fails).
pub const FALLBACK_NAME: &str = "forkfleet";
pub const FALLBACK_EMAIL: &str = "forkfleet@localhost";

/// Why a git step failed; each message says what was wrong and what would work.
#[derive(Debug, thiserror::Error)]
pub enum GitError {
    #[error("git is not installed or not on PATH (running `git`: {0}); --git-branch needs the git command line")]
    NotInstalled(#[source] std::io::Error),
    #[error("`{}` is not in a git repository; --git-branch commits into the repository the fork's workspace was in when the fork was made", dir.display())]
    NotARepo { dir: PathBuf },
    #[error("fork {fork} has no git commit recorded: its workspace was not in a git repository with a commit when it was made (or it was forked from a run, by an agent, or by an older forkfleet); merge into a directory, or write a patch with `forkfleet fork diff {fork} --patch FILE` and `git apply` it")]
    NoHead { fork: String },
    #[error(
        "fork {fork} has no workspace directory recorded, so there is no repository to commit to"
    )]
    NoWorkspace { fork: String },
    #[error("commit {commit}, where the fork was made, is not in the repository `{}` (was the history rewritten?)", repo.display())]
    MissingCommit { commit: String, repo: PathBuf },
    #[error("--git-branch `{name}` is not a valid branch name ({why}); use a name such as `forkfleet/fix-1`")]
    BadBranch { name: String, why: String },
    #[error("branch `{name}` already exists in `{}` (at {at}); --git-branch makes a new branch: pick another name, or delete it first (`git branch -D {name}`)", repo.display())]
    BranchExists {
        name: String,
        at: String,
        repo: PathBuf,
    },
    #[error("`git {args}` failed in `{}`: {message}", repo.display())]
    Command {
        args: String,
        repo: PathBuf,
        message: String,
    },
    #[error("cannot {what}: {source}")]
    Io {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
}

impl GitError {
    /// The error's kind (the CLI's exit code).
    pub fn kind(&self) -> ErrorKind {
        match self {
            GitError::NotARepo { .. } | GitError::NoHead { .. } | GitError::BadBranch { .. } => {
                ErrorKind::BadInput
            }
            GitError::NoWorkspace { .. } | GitError::MissingCommit { .. } => ErrorKind::NotFound,
            GitError::BranchExists { .. } => ErrorKind::Conflict,
            GitError::NotInstalled(_) => ErrorKind::Unavailable,
            GitError::Command { .. } | GitError::Io { .. } => ErrorKind::Failure,
        }
    }
}

/// `git -C dir ARGS`, in an environment that cannot redirect it to another repository or
/// index than the ones asked for.
fn git_command(dir: &Path) -> Command {
    let mut cmd = Command::new("git");
    cmd.arg("-C").arg(dir);
    for var in [
        "GIT_DIR",
        "GIT_WORK_TREE",
        "GIT_INDEX_FILE",
        "GIT_OBJECT_DIRECTORY",
    ] {
        cmd.env_remove(var);
    }
    cmd.env("GIT_TERMINAL_PROMPT", "0");
    cmd.stdin(Stdio::null());
    cmd
}

/// Run `cmd` (whose arguments `args` name in errors), feeding it `input`.
fn run(mut cmd: Command, args: &[&str], input: Option<&[u8]>) -> Result<Output, GitError> {
    cmd.args(args);
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    if input.is_some() {
        cmd.stdin(Stdio::piped());
    }
    let mut child = cmd.spawn().map_err(spawn_error)?;
    if let (Some(bytes), Some(mut stdin)) = (input, child.stdin.take()) {
        // The child reads all of its input before it writes much: no deadlock on pipes.
        stdin.write_all(bytes).map_err(|source| GitError::Io {
            what: "write to git's input",
            source,
        })?;
    }
    let out = child.wait_with_output().map_err(|source| GitError::Io {
        what: "read git's output",
        source,
    })?;
    Ok(out)
}

fn spawn_error(e: std::io::Error) -> GitError {
    match e.kind() {
        std::io::ErrorKind::NotFound | std::io::ErrorKind::PermissionDenied => {
            GitError::NotInstalled(e)
        }
        _ => GitError::Io {
            what: "run git",
            source: e,
        },
    }
}

/// Run and require success; its stdout, trimmed of the final newline.
fn checked(
    cmd: Command,
    repo: &Path,
    args: &[&str],
    input: Option<&[u8]>,
) -> Result<String, GitError> {
    let out = run(cmd, args, input)?;
    if !out.status.success() {
        return Err(failed(repo, args, &out));
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .trim_end_matches(['\n', '\r'])
        .to_string())
}

fn failed(repo: &Path, args: &[&str], out: &Output) -> GitError {
    let stderr = String::from_utf8_lossy(&out.stderr).trim().to_string();
    GitError::Command {
        args: args.join(" "),
        repo: repo.to_path_buf(),
        message: if stderr.is_empty() {
            format!("exit status {}", out.status)
        } else {
            stderr
        },
    }
}

/// Where `dir` stands in its git repository: `None` when git is missing, `dir` is not in
/// a work tree, or the repository has no commit yet (nothing is recorded then, and
/// `--git-branch` says so).
pub fn head_at(dir: &Path) -> Option<GitHead> {
    let ask = |args: &[&str]| -> Option<String> {
        let out = run(git_command(dir), args, None).ok()?;
        out.status.success().then(|| {
            String::from_utf8_lossy(&out.stdout)
                .trim_end_matches(['\n', '\r'])
                .to_string()
        })
    };
    if ask(&["rev-parse", "--is-inside-work-tree"])? != "true" {
        return None;
    }
    let commit = ask(&["rev-parse", "--verify", "--quiet", "HEAD^{commit}"])?;
    let prefix = ask(&["rev-parse", "--show-prefix"])?;
    // Tracked files changed and not committed, below the workspace only.
    let dirty = ask(&["status", "--porcelain", "--untracked-files=no", "--", "."])
        .is_some_and(|s| !s.trim().is_empty());
    Some(GitHead {
        commit,
        prefix,
        dirty,
    })
}

/// A repository a branch is about to be made in, checked: git runs, the directory is in
/// a work tree, the fork's commit is there, the branch name is valid and free.
#[derive(Debug, Clone)]
pub struct GitRepo {
    /// The work tree's top level.
    pub top: PathBuf,
    pub head: GitHead,
    /// The branch to make (`NAME`, not `refs/heads/NAME`).
    pub branch: String,
}

/// Check everything a `--git-branch NAME` commit needs before anything is merged or
/// written. `dir` is the fork's workspace; `fork` names the fork in errors.
pub fn open_for_branch(
    dir: &Path,
    head: Option<&GitHead>,
    branch: &str,
    fork: &str,
) -> Result<GitRepo, GitError> {
    check_branch_name(branch)?;
    let head = head.ok_or_else(|| GitError::NoHead {
        fork: fork.to_string(),
    })?;
    let out = run(git_command(dir), &["--version"], None)?;
    if !out.status.success() {
        return Err(failed(dir, &["--version"], &out));
    }
    let out = run(git_command(dir), &["rev-parse", "--show-toplevel"], None)?;
    if !out.status.success() {
        return Err(GitError::NotARepo {
            dir: dir.to_path_buf(),
        });
    }
    let top = PathBuf::from(
        String::from_utf8_lossy(&out.stdout)
            .trim_end_matches(['\n', '\r'])
            .to_string(),
    );
    let object = format!("{}^{{commit}}", head.commit);
    let out = run(git_command(&top), &["cat-file", "-e", &object], None)?;
    if !out.status.success() {
        return Err(GitError::MissingCommit {
            commit: head.commit.clone(),
            repo: top,
        });
    }
    let refname = format!("refs/heads/{branch}");
    let out = run(git_command(&top), &["check-ref-format", &refname], None)?;
    if !out.status.success() {
        return Err(GitError::BadBranch {
            name: branch.to_string(),
            why: "git check-ref-format refuses it".to_string(),
        });
    }
    let repo = GitRepo {
        top,
        head: head.clone(),
        branch: branch.to_string(),
    };
    repo.check_free()?;
    Ok(repo)
}

/// What git's `check-ref-format` would refuse for sure, said before git is even run.
fn check_branch_name(name: &str) -> Result<(), GitError> {
    let bad = |why: &str| {
        Err(GitError::BadBranch {
            name: name.to_string(),
            why: why.to_string(),
        })
    };
    if name.is_empty() {
        return bad("it is empty");
    }
    if name.starts_with('-') {
        return bad("it starts with `-`");
    }
    if name == "HEAD" || name.starts_with("refs/") {
        return bad("give the branch's short name, not `HEAD` or a `refs/` path");
    }
    if name
        .chars()
        .any(|c| c.is_control() || " ~^:?*[\\".contains(c))
    {
        return bad("it has a space, a control character or one of ~ ^ : ? * [ \\");
    }
    Ok(())
}

/// What [`GitRepo::write_commit`] made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GitCommit {
    /// The new commit's id.
    pub commit: String,
    /// Paths (repository-relative) written or removed.
    pub files: usize,
    /// Paths the winner created that the repository ignores (`.gitignore`): left out.
    pub ignored: Vec<String>,
    /// The identity git would not give (no `user.name`/`user.email` configured): the
    /// commit was made as `forkfleet <forkfleet@localhost>`.
    pub fallback_identity: bool,
}

/// One file of a winner's changes, by workspace-relative path: its new manifest mode and
/// bytes, or `None` when deleted.
pub struct FileChange {
    pub path: String,
    pub new: Option<(u32, Vec<u8>)>,
}

/// A temporary index file, removed when dropped.
struct TempIndex(PathBuf);

impl Drop for TempIndex {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
        let _ = std::fs::remove_file(self.0.with_extension("lock"));
    }
}

impl GitRepo {
    fn git(&self) -> Command {
        git_command(&self.top)
    }

    /// Refuse a branch that exists.
    fn check_free(&self) -> Result<(), GitError> {
        let refname = format!("refs/heads/{}", self.branch);
        let out = run(
            self.git(),
            &["rev-parse", "--verify", "--quiet", &refname],
            None,
        )?;
        if out.status.success() {
            return Err(GitError::BranchExists {
                name: self.branch.clone(),
                at: String::from_utf8_lossy(&out.stdout).trim().to_string(),
                repo: self.top.clone(),
            });
        }
        Ok(())
    }

    /// Write the commit of `changes` on top of the fork's commit, with `message`; no ref
    /// is touched.
    pub fn write_commit(
        &self,
        changes: &[FileChange],
        message: &str,
    ) -> Result<GitCommit, GitError> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default();
        let index = TempIndex(std::env::temp_dir().join(format!(
            "forkfleet-git-index-{}-{nanos}",
            std::process::id()
        )));
        let with_index = || {
            let mut cmd = self.git();
            cmd.env("GIT_INDEX_FILE", &index.0);
            cmd
        };
        let base = &self.head.commit;
        checked(with_index(), &self.top, &["read-tree", base], None)?;
        // What the fork's commit tracks below the workspace: a path it lacks is new to git.
        let tracked: std::collections::BTreeSet<String> = checked(
            with_index(),
            &self.top,
            &["ls-files", "-z", "--full-name"],
            None,
        )?
        .split('\0')
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect();
        let full = |p: &str| format!("{}{p}", self.head.prefix);
        // New paths the repository ignores are left out.
        let new_paths: Vec<String> = changes
            .iter()
            .filter(|c| c.new.is_some() && !tracked.contains(&full(&c.path)))
            .map(|c| full(&c.path))
            .collect();
        let ignored = self.ignored(&with_index, &new_paths)?;
        let mut info = Vec::new();
        let mut files = 0;
        for c in changes {
            let path = full(&c.path);
            match &c.new {
                Some(_) if ignored.contains(&path) => continue,
                Some((mode, bytes)) => {
                    // A file goes through the clean filters its attributes name (line
                    // endings, LFS), as `git add` would; a symlink's target does not.
                    let mut args = vec!["hash-object", "-w", "--stdin"];
                    if git_mode(*mode) == 0o120000 {
                        args.push("--no-filters");
                    } else {
                        args.extend(["--path", path.as_str()]);
                    }
                    let id = checked(self.git(), &self.top, &args, Some(bytes))?;
                    info.extend_from_slice(
                        format!("{:o} {id}\t{path}\0", git_mode(*mode)).as_bytes(),
                    );
                }
                None if !tracked.contains(&path) => continue,
                None => {
                    info.extend_from_slice(format!("0 {}\t{path}\0", "0".repeat(40)).as_bytes());
                }
            }
            files += 1;
        }
        if !info.is_empty() {
            checked(
                with_index(),
                &self.top,
                &["update-index", "-z", "--index-info"],
                Some(&info),
            )?;
        }
        let tree = checked(with_index(), &self.top, &["write-tree"], None)?;
        let fallback_identity = !self.has_identity();
        let mut cmd = self.git();
        if fallback_identity {
            for (k, v) in [
                ("GIT_AUTHOR_NAME", FALLBACK_NAME),
                ("GIT_AUTHOR_EMAIL", FALLBACK_EMAIL),
                ("GIT_COMMITTER_NAME", FALLBACK_NAME),
                ("GIT_COMMITTER_EMAIL", FALLBACK_EMAIL),
            ] {
                cmd.env(k, v);
            }
        }
        let commit = checked(
            cmd,
            &self.top,
            &["commit-tree", &tree, "-p", base, "-F", "-"],
            Some(message.as_bytes()),
        )?;
        let mut ignored: Vec<String> = ignored.into_iter().collect();
        ignored.sort();
        Ok(GitCommit {
            commit,
            files,
            ignored,
            fallback_identity,
        })
    }

    /// The paths of `paths` the repository's ignore rules match.
    fn ignored(
        &self,
        with_index: &dyn Fn() -> Command,
        paths: &[String],
    ) -> Result<std::collections::BTreeSet<String>, GitError> {
        if paths.is_empty() {
            return Ok(Default::default());
        }
        let mut input = Vec::new();
        for p in paths {
            input.extend_from_slice(p.as_bytes());
            input.push(0);
        }
        let args = ["check-ignore", "-z", "--stdin"];
        let out = run(with_index(), &args, Some(&input))?;
        // 0: some are ignored, 1: none is.
        match out.status.code() {
            Some(0) | Some(1) => Ok(String::from_utf8_lossy(&out.stdout)
                .split('\0')
                .filter(|s| !s.is_empty())
                .map(str::to_string)
                .collect()),
            _ => Err(failed(&self.top, &args, &out)),
        }
    }

    /// Git can name an author and a committer from its configuration or environment.
    fn has_identity(&self) -> bool {
        ["GIT_AUTHOR_IDENT", "GIT_COMMITTER_IDENT"]
            .iter()
            .all(|v| run(self.git(), &["var", v], None).is_ok_and(|o| o.status.success()))
    }

    /// Point the new branch at `commit`: refused, with nothing changed, if the branch
    /// exists by now (`update-ref` with an empty old value).
    pub fn create_branch(&self, commit: &str, reflog: &str) -> Result<(), GitError> {
        let refname = format!("refs/heads/{}", self.branch);
        let args = ["update-ref", "-m", reflog, &refname, commit, ""];
        let out = run(self.git(), &args, None)?;
        if !out.status.success() {
            // Someone made it meanwhile: say so plainly.
            self.check_free()?;
            return Err(failed(&self.top, &args, &out));
        }
        Ok(())
    }

    /// The commit's subject line and the fork's trailers.
    pub fn message(fork: &str, label: &str, goal: &str) -> String {
        let goal = goal.trim();
        let mut m = format!("forkfleet: branch `{label}` of fork {fork}\n\n");
        if !goal.is_empty() {
            m.push_str(goal);
            m.push_str("\n\n");
        }
        m.push_str(&format!(
            "Forkfleet-Fork: {fork}\nForkfleet-Branch: {label}\n"
        ));
        m
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn branch_names_git_refuses_are_refused_first() {
        for bad in [
            "",
            "-x",
            "HEAD",
            "refs/heads/x",
            "a b",
            "a~1",
            "a:b",
            "a\\b",
        ] {
            assert!(
                matches!(check_branch_name(bad), Err(GitError::BadBranch { .. })),
                "{bad:?}"
            );
        }
        assert!(check_branch_name("forkfleet/fix-1").is_ok());
    }

    #[test]
    fn the_message_names_fork_and_branch_and_ends_with_trailers() {
        let m = GitRepo::message("f-1", "a", "Do it.\n");
        assert_eq!(
            m,
            "forkfleet: branch `a` of fork f-1\n\nDo it.\n\nForkfleet-Fork: f-1\nForkfleet-Branch: a\n"
        );
    }
}
