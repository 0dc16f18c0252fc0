//! The run workflow as library functions, for every front end: create a fork from a
//! loaded spec (uploading the workspace), follow it, then merge a pick or resolve it by
//! the spec's tests and judges, and apply the winner to the workspace. [`run_fork`] is the
//! whole of `forkfleet run`; the pieces are for commands that do one step.

use crate::client::Client;
use crate::error::ClientError;
use crate::render::{awaiting_labels, count, paused_labels};
use crate::watch::Until;
use crate::{forkdir, git, workspace};
use forkfleet_shared::api::{ApiClient, CreateFork, ForkView, ParentRun, ResolveReport};
use forkfleet_shared::diff::{DiffOptions, DiffReport};
use forkfleet_shared::flush::{ConflictPolicy, FlushReport};
use forkfleet_shared::ids::{ForkId, RunId};
use forkfleet_shared::resolve::Strategy;
use forkfleet_shared::spec::{LoadedSpec, SOLO_LABEL};
use forkfleet_shared::state::BranchState;
use std::path::Path;
use std::time::Duration;

/// Nothing is left to wait for once every branch has finished or is paused: an embedded
/// run's paused branches wait for a top-up, which only a later command can give.
pub const AT_ONCE: Until = Until::Quiet {
    grace: Duration::ZERO,
};

/// Upload the spec's workspace (only the blobs the store lacks) and create the fork, or
/// fork the existing root run `from` (its conversation and workspace version); the spec's
/// scripts are uploaded either way. Returns the fork and a line saying where it came from.
pub async fn create_fork(
    coord: &Client,
    loaded: &LoadedSpec,
    from: Option<RunId>,
) -> Result<(ForkView, String), ClientError> {
    let blobs = coord.blobs();
    let (parent, snapshot, from_text, left_out, git) = match from {
        Some(run_id) => {
            let snapshot = coord.run_workspace(run_id).await?;
            for (hash, bytes) in &loaded.blobs {
                blobs
                    .put(*hash, bytes.clone())
                    .await
                    .map_err(|e| ClientError::blob("uploading the spec's scripts", e))?;
            }
            (
                ParentRun::Existing { run_id },
                snapshot,
                format!("from run {run_id}"),
                None,
                None,
            )
        }
        None => {
            let (_, upload) = workspace::upload_workspace(
                blobs.as_ref(),
                &loaded.workspace,
                &loaded.scan,
                loaded.blobs.clone(),
            )
            .await?;
            // The commit the workspace is at, when it is in a git repository (what
            // `fork merge --git-branch` commits on); nothing when git cannot say.
            let dir = loaded.workspace.clone();
            let git = tokio::task::spawn_blocking(move || git::head_at(&dir))
                .await
                .ok()
                .flatten();
            (
                ParentRun::New,
                upload.snapshot,
                format!(
                    "workspace {} ({}, {}, {} uploaded; {})",
                    loaded.workspace.display(),
                    count(upload.files, "file", "files"),
                    forkfleet_shared::scan::human_bytes(upload.bytes),
                    count(upload.blobs_sent, "new blob", "new blobs"),
                    upload.left_out.summary()
                ),
                Some(upload.left_out),
                git,
            )
        }
    };
    let view = coord
        .call(CreateFork {
            plan: loaded.plan.clone(),
            parent,
            snapshot,
            workspace: Some(loaded.workspace.display().to_string()),
            left_out,
            git,
        })
        .await?;
    Ok((view, from_text))
}

/// Merge `pick` in the store, then apply it to `dir` (if any), and remove the fork
/// directory unless the plan keeps it. `policy` overrides the plan's `conflict_policy`
/// for paths edited in `dir` since the fork. Returns the winner and the report of what
/// happened to the directory (or to the parent's snapshot without one).
pub async fn merge_and_apply(
    coord: &Client,
    fork_id: ForkId,
    pick: &str,
    dir: Option<&Path>,
    policy: Option<ConflictPolicy>,
) -> Result<(String, FlushReport), ClientError> {
    let outcome = coord.merge(fork_id, pick).await?;
    let policy = policy.unwrap_or(outcome.conflict_policy);
    let report = match dir {
        // A fork an agent made merges into its branch, not into a directory.
        Some(dir) if !outcome.into_branch => {
            workspace::apply_merge(coord.blobs().as_ref(), &outcome, dir, policy).await?
        }
        _ => outcome.report.clone(),
    };
    // The fork is resolved: its fork directory goes unless `keep_artifacts`.
    forkdir::cleanup_after_merge(coord, fork_id).await;
    Ok((outcome.winner.clone(), report))
}

/// A resolve and what applying its merge did to a directory.
pub struct Resolved {
    pub report: ResolveReport,
    /// The merge applied to the directory (or the store's report without one).
    pub applied: Option<FlushReport>,
}

/// What a resolve asks beyond the plan (`fork resolve`'s flags).
#[derive(Debug, Clone, Default)]
pub struct ResolveAsk {
    /// The plan's strategy when absent.
    pub strategy: Option<Strategy>,
    /// Decide without merging.
    pub no_commit: bool,
    /// The judges' models instead of the plan's.
    pub judge_models: Vec<String>,
}

/// Resolve `fork` (tests on every branch and the judges run on workers); on a commit,
/// apply the merge to `dir` (if any), `policy` overriding the plan's `conflict_policy`.
pub async fn resolve_and_apply(
    coord: &Client,
    fork: ForkId,
    ask: ResolveAsk,
    dir: Option<&Path>,
    policy: Option<ConflictPolicy>,
) -> Result<Resolved, ClientError> {
    let report = coord
        .resolve(fork, ask.strategy, ask.no_commit, ask.judge_models)
        .await?;
    let applied = match &report.merge {
        Some(outcome) => Some(apply_outcome(coord, outcome, dir, policy).await?),
        None => None,
    };
    Ok(Resolved { report, applied })
}

/// What a committed merge did to `dir` (if any; the store's report without one, or for a
/// merge into an agent's branch), `policy` overriding the plan's `conflict_policy`.
pub async fn apply_outcome(
    coord: &Client,
    outcome: &forkfleet_shared::api::MergeOutcome,
    dir: Option<&Path>,
    policy: Option<ConflictPolicy>,
) -> Result<FlushReport, ClientError> {
    match dir {
        Some(dir) if !outcome.into_branch => {
            let policy = policy.unwrap_or(outcome.conflict_policy);
            workspace::apply_merge(coord.blobs().as_ref(), outcome, dir, policy).await
        }
        _ => Ok(outcome.report.clone()),
    }
}

/// The forks a single agent run's agent made and left unresolved; empty when its work can
/// be merged. `None` when the run has no agent that is `done`.
pub async fn solo_open_forks(
    coord: &Client,
    view: &ForkView,
) -> Result<Option<Vec<ForkId>>, ClientError> {
    let Some(agent) = view.branch(SOLO_LABEL) else {
        return Ok(None);
    };
    if agent.state != BranchState::Done {
        return Ok(None);
    }
    Ok(Some(
        coord
            .forks()
            .await?
            .into_iter()
            .filter(|f| f.parent_run == agent.run_id && !f.state.is_resolved())
            .map(|f| f.fork_id)
            .collect(),
    ))
}

/// What `forkfleet run` asks for.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Merge this branch once the fork settles.
    pub pick: Option<String>,
    /// Give up following the fork after this long.
    pub timeout: Option<Duration>,
    /// Progress lines on stderr.
    pub show: bool,
}

/// What a run did.
pub struct RunOutcome {
    /// The fork after the run (after the merge, when one happened).
    pub view: ForkView,
    pub diff: DiffReport,
    /// The branches paused by a budget cap.
    pub paused: Vec<String>,
    /// The merge applied to the workspace: the winner and what happened to each path.
    pub merge: Option<(String, FlushReport)>,
    /// The spec's resolve path, when it ran.
    pub resolved: Option<Resolved>,
    /// A single agent run whose agent left forks of its own unresolved: its work is not
    /// merged until they are.
    pub solo_unresolved: Vec<ForkId>,
}

/// `forkfleet run`: create the fork from the spec, follow it (the fork directory kept in
/// step) until nothing runs, then merge `pick` (a single agent run: its agent, once done),
/// or resolve by the spec's tests and judges when it has any, and apply the winner to the
/// spec's workspace. A pick that is paused, not finished, is not merged.
pub async fn run_fork(
    coord: &Client,
    loaded: &LoadedSpec,
    opts: &RunOptions,
) -> Result<RunOutcome, ClientError> {
    let (view, from_text) = create_fork(coord, loaded, None).await?;
    if opts.show {
        crate::render::say(&format!(
            "fork {}: {} · {from_text}",
            view.fork_id,
            count(view.branches.len(), "branch", "branches")
        ));
    }
    let fork_id = view.fork_id;
    // The fork directory is announced only if it stays: a merge below removes it.
    let (view, fork_dir) =
        forkdir::follow_quietly(coord, fork_id, opts.timeout, AT_ONCE, opts.show).await?;
    // Aborted while it ran (`fork abort` from another terminal or process): nothing is
    // merged or resolved, and the fork directory goes as after a merge (the live sync
    // that kept it has ended, so nothing makes it again).
    let aborted = matches!(view.state, forkfleet_shared::state::ForkState::Aborted);
    if aborted {
        forkdir::cleanup_after_merge(coord, fork_id).await;
    }
    let diff = coord.diff(fork_id, DiffOptions::default()).await?;
    let paused: Vec<String> = paused_labels(&view)
        .into_iter()
        .map(str::to_string)
        .collect();
    // A single agent run merges its agent's work once the agent is done.
    let mut solo_unresolved = Vec::new();
    let solo_pick = if loaded.plan.solo && opts.pick.is_none() {
        match solo_open_forks(coord, &view).await? {
            Some(open) if open.is_empty() => Some(SOLO_LABEL),
            Some(open) => {
                solo_unresolved = open;
                None
            }
            None => None,
        }
    } else {
        None
    };
    let requested = opts.pick.as_deref().or(solo_pick);
    let awaiting = !awaiting_labels(&view).is_empty();
    // Nothing runs now: merge the pick only if it finished (not paused, not waiting) and
    // did not fail or refuse (its partial work stays in the fork, for `fork merge`).
    let pick = requested.filter(|p| {
        !aborted
            && view.branch(p).is_some_and(|b| {
                use forkfleet_shared::state::BranchState;
                b.state.is_terminal()
                    && !matches!(b.state, BranchState::Failed | BranchState::Refused)
            })
    });
    let merge = match pick {
        Some(pick) => {
            Some(merge_and_apply(coord, fork_id, pick, Some(&loaded.workspace), None).await?)
        }
        None => None,
    };
    // Without a pick, the spec's resolve path: tests and judges when it has any.
    let plan_resolves =
        loaded.plan.resolve.strategy.needs_judge() || loaded.plan.resolve.test.is_some();
    // A resolve by a judge does not wait for a person: it denies the requests that wait
    // (docs/APPROVALS.md); a manual one leaves them to the person.
    let resolves = plan_resolves
        && (!awaiting || loaded.plan.resolve.strategy.needs_judge())
        && requested.is_none()
        && paused.is_empty()
        && !loaded.plan.solo
        && !aborted;
    let resolved = if resolves {
        Some(
            resolve_and_apply(
                coord,
                fork_id,
                ResolveAsk::default(),
                Some(&loaded.workspace),
                None,
            )
            .await?,
        )
    } else {
        None
    };
    // The branches whose requests the resolve denied went on: their changes count.
    let diff = if resolved.is_some() && awaiting {
        coord.diff(fork_id, DiffOptions::default()).await?
    } else {
        diff
    };
    if resolved.as_ref().is_some_and(|r| r.report.merge.is_some()) {
        forkdir::cleanup_after_merge(coord, fork_id).await;
    }
    let merge = match (merge, &resolved) {
        (Some(m), _) => Some(m),
        (None, Some(r)) => match (&r.report.merge, &r.applied) {
            (Some(outcome), Some(applied)) => Some((outcome.winner.clone(), applied.clone())),
            _ => None,
        },
        (None, None) => None,
    };
    let view = if merge.is_some() || resolved.is_some() {
        coord.fork(fork_id).await?
    } else {
        view
    };
    if let (true, Some(dir)) = (opts.show, fork_dir) {
        if forkdir::removed_after_merge(&view).is_none() {
            forkdir::announce(coord, fork_id, &dir);
        }
    }
    Ok(RunOutcome {
        view,
        diff,
        paused,
        merge,
        resolved,
        solo_unresolved,
    })
}
