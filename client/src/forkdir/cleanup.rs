//! Removing the fork directory after a merge.

use super::*;
use forkfleet_shared::state::ForkState;

/// The winner of a merged fork whose plan does not keep its fork directory: the merge
/// removed the directory (or is about to), and nothing may make it again. `None` for a fork
/// that is not merged, or keeps its directory.
pub fn removed_after_merge(view: &ForkView) -> Option<&str> {
    match &view.state {
        ForkState::Merged { winner } if !view.keep_artifacts => Some(winner),
        _ => None,
    }
}

/// What [`remove_after_merge`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cleanup {
    /// The fork directory was removed (with `.forkfleet/forks` and `.forkfleet` when they
    /// were left empty).
    Removed(PathBuf),
    /// `keep_artifacts` is set: the directory stays.
    Kept(PathBuf),
    /// There was nothing to remove (no workspace, or no directory).
    Absent,
}

/// Remove the fork directory of a fork that has been **merged** (or **aborted**), unless
/// its plan says `keep_artifacts`.
///
/// Contract, for every path that merges (`fork merge`, `run --pick`, an automatic merge
/// by the resolve path):
/// - call it only after the merge has committed in the coordinator (and after any live
///   sync of the fork has finished: a sync running afterwards would recreate the
///   directory); `view` may be read before or after the merge, only its `fork_id`,
///   `workspace` and `keep_artifacts` are used;
/// - it touches nothing but `<workspace>/.forkfleet/forks/<fork id>/` (never following a
///   symbolic link) and then removes `.forkfleet/forks/` and `.forkfleet/` only if they
///   are empty;
/// - it is idempotent: a second call (or a fork without a workspace, or a workspace not
///   on this machine) answers [`Cleanup::Absent`];
/// - an error means the directory could not be removed; the merge itself stands, so
///   callers report it as a warning ([`cleanup_after_merge`] does) and never fail the
///   merge for it.
pub fn remove_after_merge(view: &ForkView) -> Result<Cleanup, ClientError> {
    let Some(ws) = view.workspace.as_deref() else {
        return Ok(Cleanup::Absent);
    };
    if view.keep_artifacts {
        let dir = fork_dir(Path::new(ws), view.fork_id)?;
        return Ok(if dir.is_dir() {
            Cleanup::Kept(dir)
        } else {
            Cleanup::Absent
        });
    }
    remove_fork_dir(ws, view.fork_id)
}

/// Remove `<workspace>/.forkfleet/forks/<fork>/` whatever the plan says (a deleted fork's,
/// `fork rm` and `gc`), as [`remove_after_merge`] does: never through a symbolic link,
/// `.forkfleet/forks` and `.forkfleet` only when left empty.
pub fn remove_fork_dir(workspace: &str, fork: ForkId) -> Result<Cleanup, ClientError> {
    let ws = Path::new(workspace);
    let dir = fork_dir(ws, fork)?;
    // Never through a link: every directory from the workspace down must be real.
    let id = fork.to_string();
    let mut cur = ws.to_path_buf();
    let mut chain = Vec::new();
    for part in FORKS_DIR
        .iter()
        .copied()
        .chain(std::iter::once(id.as_str()))
    {
        cur.push(part);
        match std::fs::symlink_metadata(&cur) {
            Ok(m) if m.is_dir() => chain.push(cur.clone()),
            Ok(m) if m.file_type().is_symlink() => {
                return Err(ClientError::Blocked {
                    path: cur,
                    why: "is a symbolic link; not removing the fork directory through it",
                })
            }
            _ => return Ok(Cleanup::Absent),
        }
    }
    std::fs::remove_dir_all(&dir)
        .map_err(|e| ClientError::io("remove the fork directory", &dir, e))?;
    // `.forkfleet/forks`, then `.forkfleet`: only when empty (a data dir keeps its files).
    chain.pop();
    for d in chain.iter().rev() {
        if std::fs::remove_dir(d).is_err() {
            break;
        }
    }
    Ok(Cleanup::Removed(dir))
}

/// After a merge of `fork` committed: [`remove_after_merge`] with the fork's view; a
/// directory the plan keeps is synced once more, so its `manifest.json` says merged and
/// names the winner. Any error is printed as a warning on stderr (the merge stands either
/// way).
pub async fn cleanup_after_merge(coord: &Client, fork: ForkId) -> Option<Cleanup> {
    let result = match coord.fork(fork).await {
        Ok(view) => match remove_after_merge(&view) {
            Ok(Cleanup::Kept(dir)) => super::sync::Materializer::new()
                .sync(coord, &view, false)
                .await
                .map(|_| Cleanup::Kept(dir)),
            other => other,
        },
        Err(e) => Err(e),
    };
    match result {
        Ok(c) => Some(c),
        Err(e) => {
            crate::render::say(&format!(
                "warning: the fork directory was not removed (or, kept, not brought up to date): {}",
                crate::render::error_chain(&e)
            ));
            None
        }
    }
}
