//! `forkfleet checkpoint ...`: a run's checkpoints (list, save, remove, clear), rewinding
//! a run to one (its conversation and its workspace version, and a directory with
//! `--apply`), and starting a new run from one.
//!
//! Rewinding a directory replays the change log from the run's current workspace version
//! to the checkpoint's onto it, with conflicts detected against the current version: a
//! file edited in the directory since is kept and reported (unless `--overwrite`), like a
//! merge keeps local edits.

use super::{ClientArgs, Local, Session};
use anyhow::Context;
use clap::Subcommand;
use forkfleet::BadInput;
use forkfleet_client::workspace as ws;
use forkfleet_client::{render, ApiClient, Client};
use forkfleet_shared::api::{CheckpointView, NewRunOutcome, RewindOutcome};
use forkfleet_shared::blob::BlobStore;
use forkfleet_shared::flush::{self, ConflictPolicy, DirTarget, FlushReport, FlushTarget};
use forkfleet_shared::ids::RunId;
use forkfleet_shared::manifest::Node;
use forkfleet_shared::overlay::ChangeOp;
use forkfleet_shared::protocol::now_ms;
use serde_json::{json, Value};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// Names a rewind never touches in a directory (nor deletes with a removed directory): what
/// a snapshot leaves out by default.
const KEEP_NAMES: &[&str] = forkfleet_shared::spec::DEFAULT_EXCLUDE;

#[derive(Debug, Subcommand)]
pub enum CheckpointCommand {
    /// List a run's checkpoints in creation order: label, seq, turn, kind, age, id.
    Ls {
        /// The run: its id, a unique prefix of one, or a fork's branch as FORK/LABEL.
        run: String,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Save a checkpoint at the run's current end (a named one: never evicted).
    Save {
        /// The run: its id, a unique prefix of one, or a fork's branch as FORK/LABEL.
        run: String,
        /// 1 to 64 letters, digits, `-`, `_`, `.`; not `turn-...` or `tool-...`.
        label: String,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Remove one checkpoint.
    Rm {
        /// The run: its id, a unique prefix of one, or a fork's branch as FORK/LABEL.
        run: String,
        /// The checkpoint's label, id, or a unique prefix of its id.
        checkpoint: String,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Remove every checkpoint of a run.
    Clear {
        /// The run: its id, a unique prefix of one, or a fork's branch as FORK/LABEL.
        run: String,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Rewind a run to a checkpoint: its conversation and its workspace version, and with
    /// --apply a directory too.
    ///
    /// Without --apply or --no-apply nothing changes: it prints what the rewind would
    /// change. A branch run must have finished. Files of DIR edited since the run's
    /// current version are kept and reported as conflicts (unless --overwrite, or the
    /// fork plan's `conflict_policy = "overwrite"` for a branch run).
    Rewind {
        /// The run: its id, a unique prefix of one, or a fork's branch as FORK/LABEL.
        run: String,
        /// The checkpoint's label, id, or a unique prefix of its id.
        checkpoint: String,
        /// Rewind the run and restore this directory to the checkpoint's files.
        #[arg(long, value_name = "DIR", conflicts_with = "no_apply")]
        apply: Option<PathBuf>,
        /// Rewind the run in the store only; leave every directory alone.
        #[arg(long)]
        no_apply: bool,
        /// Overwrite files of DIR changed since the run's current version (default: keep
        /// them and report them as conflicts).
        #[arg(long, requires = "apply")]
        overwrite: bool,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Start a new run from a checkpoint: its conversation up to the checkpoint, on the
    /// checkpoint's workspace version. Prints the new run's id.
    Fork {
        /// The run: its id, a unique prefix of one, or a fork's branch as FORK/LABEL.
        run: String,
        /// The checkpoint's label, id, or a unique prefix of its id.
        checkpoint: String,
        #[command(flatten)]
        client: ClientArgs,
    },
}

impl CheckpointCommand {
    /// Where the runs are and how to print.
    pub fn client(&self) -> &ClientArgs {
        match self {
            CheckpointCommand::Ls { client, .. }
            | CheckpointCommand::Save { client, .. }
            | CheckpointCommand::Rm { client, .. }
            | CheckpointCommand::Clear { client, .. }
            | CheckpointCommand::Rewind { client, .. }
            | CheckpointCommand::Fork { client, .. } => client,
        }
    }
}

/// Run a checkpoint command against `coord`.
pub async fn run(coord: &Client, command: &CheckpointCommand) -> anyhow::Result<()> {
    let json_out = command.client().json;
    match command {
        CheckpointCommand::Ls { run, .. } => {
            let run = coord.find_run(run).await?;
            let all = coord.checkpoints(run).await?;
            if json_out {
                print_json(&Value::Array(all.iter().map(checkpoint_json).collect()))
            } else {
                print!("{}", checkpoint_table(run, &all, now_ms(), coord.reach()));
                Ok(())
            }
        }
        CheckpointCommand::Save { run, label, .. } => {
            let run = coord.find_run(run).await?;
            let c = coord.checkpoint_save(run, label, None::<u64>).await?;
            if json_out {
                print_json(&checkpoint_json(&c))
            } else {
                println!(
                    "saved checkpoint `{}` of run {run} at seq {} ({})",
                    c.label, c.seq, c.id
                );
                Ok(())
            }
        }
        CheckpointCommand::Rm {
            run, checkpoint, ..
        } => {
            let run = coord.find_run(run).await?;
            let c = coord.checkpoint_remove(run, checkpoint).await?;
            if json_out {
                print_json(&checkpoint_json(&c))
            } else {
                println!(
                    "removed checkpoint `{}` of run {run} (seq {}, {})",
                    c.label, c.seq, c.id
                );
                Ok(())
            }
        }
        CheckpointCommand::Clear { run, .. } => {
            let run = coord.find_run(run).await?;
            let removed = coord.checkpoint_clear(run).await?;
            if json_out {
                print_json(&Value::Array(removed.iter().map(checkpoint_json).collect()))
            } else {
                println!(
                    "removed {} of run {run}",
                    render::count(removed.len(), "checkpoint", "checkpoints")
                );
                Ok(())
            }
        }
        CheckpointCommand::Rewind {
            run,
            checkpoint,
            apply,
            no_apply,
            overwrite,
            ..
        } => {
            let run = coord.find_run(run).await?;
            rewind(
                coord,
                run,
                checkpoint,
                apply.as_deref(),
                *no_apply,
                *overwrite,
                json_out,
            )
            .await
        }
        CheckpointCommand::Fork {
            run, checkpoint, ..
        } => {
            let run = coord.find_run(run).await?;
            let outcome = coord.fork_checkpoint(run, checkpoint).await?;
            if json_out {
                print_json(&new_run_json(&outcome))
            } else {
                forkfleet_client::render::say(&format!(
                    "new run from checkpoint `{}` of run {} (seq {}): {}",
                    outcome.source.label,
                    outcome.source_run,
                    outcome.source.seq,
                    render::count(outcome.events as usize, "event", "events")
                ));
                println!("{}", outcome.run_id);
                Ok(())
            }
        }
    }
}

async fn rewind(
    coord: &Client,
    run: RunId,
    checkpoint: &str,
    apply: Option<&Path>,
    no_apply: bool,
    overwrite: bool,
    json_out: bool,
) -> anyhow::Result<()> {
    // Checked before the rewind: its result must land somewhere.
    if let Some(dir) = apply {
        if !dir.is_dir() {
            return Err(BadInput(format!(
                "cannot apply the rewind: `{}` is not a directory (pass --apply DIR or --no-apply)",
                dir.display()
            ))
            .into());
        }
    }
    let dry_run = apply.is_none() && !no_apply;
    let outcome = coord.rewind(run, checkpoint, dry_run).await?;
    // --overwrite, else the run's fork plan's policy (keep-parent for a root run).
    let policy = if overwrite {
        ConflictPolicy::Overwrite
    } else {
        outcome.conflict_policy
    };
    let applied = match apply {
        Some(dir) => Some(apply_rewind(coord.blobs().as_ref(), &outcome, dir, policy).await?),
        None => None,
    };
    if json_out {
        print_json(&rewind_json(&outcome, applied.as_ref(), apply))?;
    } else {
        print!("{}", rewind_text(&outcome, applied.as_ref(), apply));
    }
    match &applied {
        Some(report) => super::applied_in_full("the rewind", report, None),
        None => Ok(()),
    }
}

/// Replay a rewind's change log onto `dir`, with conflicts against the run's version before
/// the rewind: a path of `dir` that differs from it is kept (unless the policy is
/// `overwrite`). Paths already as the checkpoint has them are left alone. `.git` and
/// `.forkfleet` are never touched.
pub async fn apply_rewind(
    store: &dyn BlobStore,
    outcome: &RewindOutcome,
    dir: &Path,
    policy: ConflictPolicy,
) -> anyhow::Result<FlushReport> {
    let (from, contents) = ws::replay_inputs(
        store,
        &outcome.from_snapshot,
        &outcome.changes,
        "the run's workspace version",
    )
    .await?;
    let dir = dir.to_path_buf();
    let changes = outcome.changes.clone();
    let report = tokio::task::spawn_blocking(move || {
        let mut target = DirTarget::new(&dir, contents)
            .with_context(|| format!("cannot apply the rewind to `{}`", dir.display()))?
            .exclude(KEEP_NAMES.iter().map(|s| s.to_string()).collect());
        let todo: Vec<ChangeOp> = changes
            .into_iter()
            .filter(|op| !already_done(&target, op))
            .collect();
        Ok::<_, anyhow::Error>(flush::flush(&todo, &from, &mut target, policy))
    })
    .await??;
    Ok(report)
}

/// True when `dir` already is as `op` would leave it (restored by hand, or a rewind
/// applied before): such a path is neither written nor a conflict.
fn already_done(target: &DirTarget<'_>, op: &ChangeOp) -> bool {
    match op {
        ChangeOp::Write { path, entry } | ChangeOp::Edit { path, entry } => {
            target.matches(path, &Node::File(*entry))
        }
        ChangeOp::Delete { path } | ChangeOp::Rmdir { path } => target.node(path) == Node::Missing,
        ChangeOp::Mkdir { path } => target.node(path) == Node::Dir,
    }
}

// ---- output ---------------------------------------------------------------------------

fn print_json(value: &Value) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(value)?);
    Ok(())
}

/// One checkpoint as JSON.
pub fn checkpoint_json(c: &CheckpointView) -> Value {
    json!({
        "id": c.id.to_string(),
        "run_id": c.run_id.to_string(),
        "label": c.label,
        "seq": c.seq,
        "base_seq": c.base_seq,
        "turn": c.turn,
        "kind": c.kind.as_str(),
        "snapshot": c.snapshot.to_string(),
        "created_at_ms": c.created_at_ms,
        "metadata": c.metadata,
    })
}

fn age(now: u64, then: u64) -> String {
    let s = now.saturating_sub(then) / 1000;
    match s {
        0..=59 => format!("{s}s ago"),
        60..=3599 => format!("{}m ago", s / 60),
        3600..=86_399 => format!("{}h ago", s / 3600),
        _ => format!("{}d ago", s / 86_400),
    }
}

/// A run's checkpoints, one line each.
/// A run's checkpoints, one line each; `reach` (see `Client::reach`) ends the command the
/// empty table suggests.
pub fn checkpoint_table(run: RunId, all: &[CheckpointView], now: u64, reach: &str) -> String {
    let mut out = String::new();
    if all.is_empty() {
        let _ = writeln!(
            out,
            "run {run} has no checkpoints; save one with `forkfleet checkpoint save {run} LABEL{reach}`"
        );
        return out;
    }
    let width = all.iter().map(|c| c.label.len()).max().unwrap_or(5).max(5);
    let _ = writeln!(
        out,
        "{:<width$}  {:>6}  {:>5}  {:<5}  {:>9}  ID",
        "LABEL", "SEQ", "TURN", "KIND", "CREATED"
    );
    for c in all {
        let _ = writeln!(
            out,
            "{:<width$}  {:>6}  {:>5}  {:<5}  {:>9}  {}",
            c.label,
            c.seq,
            c.turn,
            c.kind.as_str(),
            age(now, c.created_at_ms),
            c.id
        );
    }
    out
}

fn op_line(op: &ChangeOp) -> String {
    let verb = match op {
        ChangeOp::Write { .. } | ChangeOp::Edit { .. } => "write",
        ChangeOp::Delete { .. } => "delete",
        ChangeOp::Mkdir { .. } => "mkdir",
        ChangeOp::Rmdir { .. } => "rmdir",
    };
    format!("{verb:<7} {}", op.path())
}

fn rewind_text(
    outcome: &RewindOutcome,
    applied: Option<&FlushReport>,
    dir: Option<&Path>,
) -> String {
    let mut out = String::new();
    let c = &outcome.checkpoint;
    let head = if outcome.rewound {
        "rewound"
    } else {
        "would rewind"
    };
    let _ = writeln!(
        out,
        "{head} run {} to checkpoint `{}` (seq {}): {} of its history left out, {}",
        outcome.run_id,
        c.label,
        c.seq,
        render::count(outcome.dropped_events as usize, "event", "events"),
        render::count(outcome.changes.len(), "file change", "file changes")
    );
    match (applied, dir) {
        (Some(r), Some(dir)) => {
            let _ = write!(
                out,
                "applied to {}: {}",
                dir.display(),
                render::flush_text(r, "restored", "edited since the run's current version")
            );
        }
        _ => {
            for op in &outcome.changes {
                let _ = writeln!(out, "  {}", op_line(op));
            }
            if !outcome.rewound {
                let _ = writeln!(
                    out,
                    "nothing changed: pass --apply DIR to rewind the run and restore DIR, or --no-apply to rewind the run only"
                );
            }
        }
    }
    out
}

fn rewind_json(
    outcome: &RewindOutcome,
    applied: Option<&FlushReport>,
    dir: Option<&Path>,
) -> Value {
    let changes: Vec<Value> = outcome
        .changes
        .iter()
        .map(|op| json!({"op": op.kind(), "path": op.path().as_str()}))
        .collect();
    let mut doc = json!({
        "run_id": outcome.run_id.to_string(),
        "checkpoint": checkpoint_json(&outcome.checkpoint),
        "rewound": outcome.rewound,
        "marker_seq": outcome.marker_seq,
        "dropped_events": outcome.dropped_events,
        "from_snapshot": outcome.from_snapshot.to_string(),
        "to_snapshot": outcome.to_snapshot.to_string(),
        "changes": changes,
    });
    if let (Some(r), Some(dir)) = (applied, dir) {
        doc["applied"] = json!({
            "dir": dir.display().to_string(),
            "applied_paths": r.applied_paths,
            "deleted_paths": r.deleted_paths,
            "conflicts": r.conflicts,
            "overwritten": r.overwritten,
            "errors": r.errors,
            "applied_changes": r.applied_changes,
        });
    }
    doc
}

fn new_run_json(o: &NewRunOutcome) -> Value {
    json!({
        "run_id": o.run_id.to_string(),
        "source_run": o.source_run.to_string(),
        "source": checkpoint_json(&o.source),
        "events": o.events,
        "snapshot": o.snapshot.to_string(),
    })
}

pub(crate) async fn cmd_checkpoint(command: CheckpointCommand) -> anyhow::Result<()> {
    with_session!(command.client(), Local::Read, |coord| {
        run(coord, &command)
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use forkfleet_shared::api::CheckpointKind;
    use forkfleet_shared::blob::BlobHash;
    use forkfleet_shared::ids::CheckpointId;

    #[test]
    fn table_lists_in_order_with_kind_and_age() {
        let run = RunId::new();
        let c = |label: &str, kind| CheckpointView {
            id: CheckpointId::new(),
            run_id: run,
            label: label.into(),
            seq: 4,
            snapshot: BlobHash::of(b"m"),
            created_at_ms: 1_000,
            base_seq: 0,
            turn: 2,
            kind,
            metadata: Default::default(),
        };
        let t = checkpoint_table(
            run,
            &[
                c("fork:x", CheckpointKind::Named),
                c("tool-1-grep", CheckpointKind::Auto),
            ],
            121_000,
            "",
        );
        let lines: Vec<&str> = t.lines().collect();
        assert!(lines[0].starts_with("LABEL"), "{t}");
        assert!(
            lines[1].starts_with("fork:x") && lines[1].contains("named"),
            "{t}"
        );
        assert!(
            lines[2].contains("auto") && lines[2].contains("2m ago"),
            "{t}"
        );
        assert!(checkpoint_table(run, &[], 0, "").contains("has no checkpoints"));
    }
}
