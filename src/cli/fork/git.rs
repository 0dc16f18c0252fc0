//! `fork diff --patch` and the `--git-branch` step of `fork merge` / `fork resolve`
//! (docs/GIT.md): a branch's changes as a git patch, or committed on a new branch of the
//! workspace's git repository from the commit the fork was made at.

use super::*;
use forkfleet_client::changes;
use forkfleet_client::git::{GitCommit, GitRepo, FALLBACK_EMAIL, FALLBACK_NAME};
use serde_json::{json, Value};

/// Where `--patch` writes.
pub(crate) enum PatchTo {
    Stdout,
    File(PathBuf),
}

impl PatchTo {
    /// `-` is stdout; stdout cannot also carry `--json`'s document.
    pub(crate) fn parse(out: PathBuf, json: bool) -> Result<Self, BadInput> {
        if out.as_os_str() == "-" {
            if json {
                return Err(BadInput(
                    "--patch writes the patch to stdout, where --json's document would go: give it a FILE (--patch FILE --json)".to_string(),
                ));
            }
            return Ok(PatchTo::Stdout);
        }
        if out.is_dir() {
            return Err(BadInput(format!(
                "--patch `{}` is a directory; give a file to write",
                out.display()
            )));
        }
        Ok(PatchTo::File(out))
    }
}

/// `fork diff FORK --patch [FILE] [--branch LABEL] [--path P]...`
pub(crate) async fn fork_diff_patch(
    coord: &Client,
    fork: &str,
    branch: Option<&str>,
    paths: Option<Vec<WsPath>>,
    to: &PatchTo,
    json: bool,
) -> anyhow::Result<()> {
    let id = coord.find_fork(fork).await?;
    let view = coord.fork(id).await?;
    let label = changes::pick_branch(&view, branch)?;
    let files = changes::branch_files(coord, id, &label, paths).await?;
    let patch = changes::patch(&files);
    let binary = files
        .iter()
        .filter(|f| {
            f.old.as_ref().is_some_and(|(i, _)| i.binary)
                || f.new.as_ref().is_some_and(|(i, _)| i.binary)
        })
        .count();
    match to {
        PatchTo::Stdout => {
            use std::io::Write as _;
            let mut out = std::io::stdout().lock();
            out.write_all(&patch)?;
            out.flush()?;
            if files.is_empty() {
                forkfleet_client::render::say(&format!(
                    "branch `{label}` of fork {id} changed nothing: the patch is empty"
                ));
            }
        }
        PatchTo::File(path) => {
            changes::write_whole(path, &patch)?;
            if json {
                print_json(&json!({
                    "fork_id": id.to_string(),
                    "branch": label,
                    "patch": path.display().to_string(),
                    "files": files.len(),
                    "binary_files": binary,
                    "bytes": patch.len(),
                }))?;
            } else {
                println!(
                    "wrote the changes of branch `{label}` of fork {id} ({}{}) to {}\n  apply them to a checkout of the fork's commit with: git apply {}",
                    render::count(files.len(), "file", "files"),
                    if binary > 0 {
                        format!(", {binary} binary")
                    } else {
                        String::new()
                    },
                    path.display(),
                    render::shell_word(&path.display().to_string())
                );
            }
        }
    }
    Ok(())
}

/// What `--git-branch` made, for the report.
pub(crate) struct GitDone {
    pub name: String,
    pub repo: GitRepo,
    pub commit: GitCommit,
}

impl GitDone {
    pub(crate) fn text(&self) -> String {
        let mut out = format!(
            "\ncommitted on new branch `{}` of {}: {} ({}; parent {}, the commit the fork was made at)\n",
            self.name,
            self.repo.top.display(),
            self.commit.commit,
            render::count(self.commit.files, "file", "files"),
            self.repo.head.commit
        );
        if !self.commit.ignored.is_empty() {
            out.push_str(&format!(
                "  left out, ignored by the repository: {}\n",
                self.commit.ignored.join(", ")
            ));
        }
        if self.repo.head.dirty {
            out.push_str("  note: the workspace had uncommitted changes when the fork was made; only the files the winner changed carry them\n");
        }
        if self.commit.fallback_identity {
            out.push_str(&format!(
                "  note: git has no user.name/user.email here: committed as {FALLBACK_NAME} <{FALLBACK_EMAIL}>\n"
            ));
        }
        out
    }

    pub(crate) fn json(&self) -> Value {
        json!({
            "name": self.name,
            "repository": self.repo.top.display().to_string(),
            "commit": self.commit.commit,
            "parent": self.repo.head.commit,
            "files": self.commit.files,
            "ignored": self.commit.ignored,
            "fallback_identity": self.commit.fallback_identity,
        })
    }
}

/// After the merge is recorded: point the branch at the written commit. A failure now
/// says that the merge stands and how to make the branch by hand.
pub(crate) async fn finish_branch(
    repo: GitRepo,
    commit: GitCommit,
    fork: ForkId,
    winner: &str,
) -> anyhow::Result<GitDone> {
    if let Err(e) = changes::create_branch(&repo, &commit, fork, winner).await {
        return Err(anyhow::Error::from(e).context(format!(
            "the merge of `{winner}` is recorded, but branch `{}` was not made; its commit is {} (`git branch NEWNAME {}` in {} makes a branch of it)",
            repo.branch,
            commit.commit,
            commit.commit,
            repo.top.display()
        )));
    }
    Ok(GitDone {
        name: repo.branch.clone(),
        repo,
        commit,
    })
}
