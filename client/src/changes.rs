//! One branch's net changes against its fork's snapshot, with the files' bytes: what
//! `fork diff --patch` writes as a git patch and `fork merge --git-branch` commits
//! (docs/GIT.md).

use crate::client::Client;
use crate::error::ClientError;
use crate::git::{self, FileChange, GitCommit, GitRepo};
use bytes::Bytes;
use forkfleet_shared::api::{ApiClient, ForkView};
use forkfleet_shared::blob::{self, BlobHash};
use forkfleet_shared::diff::patch::{git_patch, PatchSide};
use forkfleet_shared::diff::{DiffOptions, FileInfo};
use forkfleet_shared::ids::ForkId;
use forkfleet_shared::path::WsPath;
use forkfleet_shared::state::ForkState;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// One file a branch changed: before (the fork snapshot's) and after (`None`: absent).
#[derive(Debug, Clone)]
pub struct BranchFile {
    pub path: WsPath,
    pub old: Option<(FileInfo, Bytes)>,
    pub new: Option<(FileInfo, Bytes)>,
}

/// The branch a one-branch command works on: `requested` when given (checked against
/// the fork), else the merged winner, else the fork's only branch. More than one branch
/// and none named is an error listing them.
pub fn pick_branch(view: &ForkView, requested: Option<&str>) -> Result<String, ClientError> {
    let labels = || {
        view.branches
            .iter()
            .map(|b| b.label.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    };
    match requested {
        Some(l) if view.branch(l).is_some() => Ok(l.to_string()),
        Some(l) => Err(crate::render::no_branch(view, l)),
        None => match (&view.state, view.branches.as_slice()) {
            (ForkState::Merged { winner }, _) => Ok(winner.clone()),
            (_, [only]) => Ok(only.label.clone()),
            _ => Err(ClientError::BadInput(format!(
                "fork {} has {} branches ({}): name one with --branch LABEL",
                view.fork_id,
                view.branches.len(),
                labels()
            ))),
        },
    }
}

/// What branch `label` of `fork` changed (below `paths`, when given), with the bytes of
/// both sides, sorted by path.
pub async fn branch_files(
    coord: &Client,
    fork: ForkId,
    label: &str,
    paths: Option<Vec<WsPath>>,
) -> Result<Vec<BranchFile>, ClientError> {
    let report = coord
        .diff(
            fork,
            DiffOptions {
                paths,
                unified: false,
                ..DiffOptions::default()
            },
        )
        .await?;
    let Some(index) = report.branch_index(label) else {
        return Err(ClientError::BadInput(format!(
            "fork {fork} has no branch `{label}`; its branches: {}",
            report.branches.join(", ")
        )));
    };
    let store = coord.blobs();
    let mut cache: HashMap<BlobHash, Bytes> = HashMap::new();
    let mut files = Vec::new();
    for p in &report.paths {
        let Some(change) = p.change(index) else {
            continue;
        };
        let mut read = async |info: Option<FileInfo>| match info {
            None => Ok::<_, ClientError>(None),
            Some(info) => {
                if let Some(b) = cache.get(&info.hash) {
                    return Ok(Some((info, b.clone())));
                }
                let bytes = blob::fetch(store.as_ref(), &info.hash).await.map_err(|e| {
                    ClientError::blob(format!("reading `{}` of branch `{label}`", p.path), e)
                })?;
                cache.insert(info.hash, bytes.clone());
                Ok(Some((info, bytes)))
            }
        };
        let old = read(p.parent).await?;
        let new = read(change.entry).await?;
        files.push(BranchFile {
            path: p.path.clone(),
            old,
            new,
        });
    }
    Ok(files)
}

/// The files as one git patch (`git apply` accepts it; see
/// `forkfleet_shared::diff::patch`).
pub fn patch(files: &[BranchFile]) -> Vec<u8> {
    fn side(s: &Option<(FileInfo, Bytes)>) -> Option<PatchSide<'_>> {
        s.as_ref().map(|(i, b)| PatchSide {
            mode: i.mode,
            bytes: b.as_ref(),
            binary: i.binary,
        })
    }
    let mut out = Vec::new();
    for f in files {
        out.extend(git_patch(f.path.as_str(), side(&f.old), side(&f.new)));
    }
    out
}

/// Write `bytes` to `path` whole or not at all: a temporary file beside it, renamed.
pub fn write_whole(path: &Path, bytes: &[u8]) -> Result<(), ClientError> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "patch".to_string());
    let tmp = dir.join(format!(".{name}.forkfleet-{}.tmp", std::process::id()));
    std::fs::write(&tmp, bytes).map_err(|e| ClientError::io("write", &tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        ClientError::io("write", path, e)
    })
}

/// Check, before anything is merged, that branch `branch_name` can be made in the
/// repository of `view`'s workspace from the commit recorded at fork time.
pub async fn open_repo(view: &ForkView, branch_name: &str) -> Result<GitRepo, ClientError> {
    let fork = view.fork_id.to_string();
    let Some(dir) = view.workspace.as_deref().map(PathBuf::from) else {
        return Err(git::GitError::NoWorkspace { fork }.into());
    };
    if view.git.is_some() && !dir.is_dir() {
        return Err(ClientError::WorkspaceNotHere { path: dir });
    }
    let head = view.git.clone();
    let name = branch_name.to_string();
    Ok(
        tokio::task::spawn_blocking(move || {
            git::open_for_branch(&dir, head.as_ref(), &name, &fork)
        })
        .await??,
    )
}

/// Write the commit of branch `label`'s changes on top of the fork's commit (no ref yet).
pub async fn write_commit(
    coord: &Client,
    view: &ForkView,
    label: &str,
    repo: &GitRepo,
) -> Result<GitCommit, ClientError> {
    let files = branch_files(coord, view.fork_id, label, None).await?;
    let changes: Vec<FileChange> = files
        .into_iter()
        .map(|f| FileChange {
            path: f.path.as_str().to_string(),
            new: f.new.map(|(i, b)| (i.mode, b.to_vec())),
        })
        .collect();
    let message = GitRepo::message(&view.fork_id.to_string(), label, &view.goal);
    let repo = repo.clone();
    Ok(tokio::task::spawn_blocking(move || repo.write_commit(&changes, &message)).await??)
}

/// Point the new branch at `commit` (refused if it exists by now).
pub async fn create_branch(
    repo: &GitRepo,
    commit: &GitCommit,
    fork: ForkId,
    label: &str,
) -> Result<(), ClientError> {
    let repo = repo.clone();
    let id = commit.commit.clone();
    let reflog = format!("forkfleet: branch `{label}` of fork {fork}");
    Ok(tokio::task::spawn_blocking(move || repo.create_branch(&id, &reflog)).await??)
}
