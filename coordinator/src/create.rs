//! Creating a fork: validate, build every run's log, write, and prepare the branch tasks.
//! Runs on a blocking thread (it reads the blob store and writes a few thousand keys).
//!
//! # Branch logs and tasks
//! A branch run's log is:
//!
//! | seq                          | event                                         |
//! |------------------------------|-----------------------------------------------|
//! | 0                            | `Fork { fork_id, parent_run, fork_root, cutoff_seq, label }` |
//! | 1 ..= P                      | the parent's conversational events (the prefix) |
//! | P+1 ..                       | `System { extra_instructions }` if any, `Steer { steer }` if not empty (the tail) |
//! | `first_seq` = 1 + P + tail   | the worker's first event                      |
//!
//! The prefix is one rmp blob `Vec<Event>` shared by every branch ([`BranchTask::prefix`]);
//! the tail is per branch ([`BranchTask::tail`]). The `Fork` lineage event differs per
//! branch and the model never needs it, so it lives in the store only: a worker's log is
//! `[fork] ++ prefix ++ tail`, and it numbers its own events from `first_seq`.
//!
//! Nothing is written until everything is validated. The fork record is written last, so a
//! crash half-way leaves only unreachable runs, never a half-made fork.

use crate::error::CoordinatorError;
use crate::store::{encode, BranchRecord, ForkRecord, Queued, RunRecord, RunStore};
use bytes::Bytes;
use forkfleet_shared::api::{CheckpointKind, CheckpointView, CreateFork, ParentRun};
use forkfleet_shared::blob::BlobHash;
use forkfleet_shared::budget::BudgetMode;
use forkfleet_shared::event::{events_from_messages, history_at, Event, Usage};
use forkfleet_shared::ids::{CheckpointId, ForkId, RunId};
use forkfleet_shared::manifest::Manifest;
use forkfleet_shared::protocol::BranchTask;
use forkfleet_shared::spec::{check_depth, BranchPlan, ForkPlan, SpecError};
use forkfleet_shared::state::{BranchState, ForkState};
use std::collections::BTreeSet;
use std::sync::Arc;

/// A fork written to the store, ready for its actor and its tasks.
pub(crate) struct PreparedFork {
    pub fork: ForkRecord,
    pub branches: Vec<BranchRecord>,
    pub tasks: Vec<BranchTask>,
    /// The fork-time snapshot, decoded once and shared by every replica.
    pub base: Arc<Manifest>,
    /// The prefix blob's bytes (also put on the bus's blob store for workers).
    pub prefix_bytes: Bytes,
}

/// The checkpoint saved on the parent when a fork is created.
pub fn fork_checkpoint_label(fork: ForkId) -> String {
    format!("fork:{fork}")
}

/// The checkpoint saved on the parent after a merge.
pub fn post_fork_checkpoint_label(fork: ForkId) -> String {
    format!("post-fork:{fork}")
}

/// Checks that need no store: the plan's rules ([`ForkPlan::validate`], the same the spec
/// loader applies), for a plan from any client.
pub(crate) fn validate_plan(plan: &ForkPlan) -> Result<(), CoordinatorError> {
    plan.validate().map_err(|e| match e {
        // The coordinator's callers match on this one by name.
        SpecError::DuplicateLabel { label, .. } => CoordinatorError::DuplicateLabel(label),
        other => CoordinatorError::InvalidPlan(other),
    })
}

/// The snapshot manifest, after checking that it and every blob the fork needs (files,
/// scripts) are in the store.
fn check_blobs(store: &RunStore, req: &CreateFork) -> Result<Arc<Manifest>, CoordinatorError> {
    let blobs = store.blobs();
    let Some(manifest) = store.manifest(&req.snapshot)? else {
        return Err(CoordinatorError::missing_blobs(&[req.snapshot]));
    };
    let mut needed: BTreeSet<BlobHash> = manifest.files.values().map(|e| e.hash).collect();
    needed.extend(req.plan.models.values().filter_map(|m| m.script));
    let needed: Vec<BlobHash> = needed.into_iter().collect();
    let missing = blobs.missing_sync(&needed)?;
    if !missing.is_empty() {
        return Err(CoordinatorError::missing_blobs(&missing));
    }
    Ok(manifest)
}

/// The parent run (existing, or the new root run, not yet written), its history (an
/// existing run's log with its rewinds honoured, see `history_at`), its last seq, and
/// whether it is new.
fn parent_run(
    store: &RunStore,
    req: &CreateFork,
    now_ms: u64,
) -> Result<(RunRecord, Vec<Event>, u64, bool), CoordinatorError> {
    match &req.parent {
        ParentRun::New => {
            let plan = &req.plan;
            let mut log = Vec::new();
            if let Some(text) = &plan.system_prompt {
                log.push(Event::System { text: text.clone() });
            }
            log.extend(events_from_messages(&plan.history, &plan.model));
            log.push(Event::UserMessage {
                text: plan.goal.clone(),
            });
            let run_id = RunId::new();
            let run = RunRecord {
                run_id,
                parent: None,
                fork_id: None,
                fork_root: run_id,
                depth: 0,
                workspace: req.snapshot,
                next_seq: log.len() as u64,
                created_at_ms: now_ms,
            };
            let last = (log.len() as u64).saturating_sub(1);
            Ok((run, log, last, true))
        }
        ParentRun::Existing { run_id } | ParentRun::Branch { run_id, .. } => {
            let run = store
                .run(*run_id)?
                .ok_or(CoordinatorError::UnknownRun(*run_id))?;
            let mut full = store.run_log(*run_id)?;
            if let ParentRun::Branch { cutoff_seq, .. } = &req.parent {
                // An agent's fork: its history up to the response that asked for it.
                if full.last().is_none_or(|(seq, _)| seq < cutoff_seq) {
                    return Err(CoordinatorError::BadRequest(format!(
                        "run {run_id}'s log does not reach seq {cutoff_seq} yet"
                    )));
                }
                full.retain(|(seq, _)| seq <= cutoff_seq);
            }
            let last = full.last().map_or(0, |(seq, _)| *seq);
            let history: Vec<Event> = history_at(&full, None)
                .into_iter()
                .map(|i| full[i].1.clone())
                .collect();
            Ok((run, history, last, false))
        }
    }
}

/// The events of a branch's log between the copied prefix and its worker's first event:
/// its extra instructions and its steer.
pub(crate) fn branch_tail(b: &BranchPlan) -> Vec<Event> {
    let mut tail = Vec::new();
    if let Some(text) = &b.extra_instructions {
        tail.push(Event::System { text: text.clone() });
    }
    if !b.steer.is_empty() {
        tail.push(Event::Steer {
            text: b.steer.clone(),
        });
    }
    tail
}

/// Which branch a task is for.
pub(crate) struct BranchIds {
    pub fork_id: ForkId,
    pub run_id: RunId,
    pub index: u32,
}

/// The task that runs branch `ids.index` of `plan` (its budget as planned; a resumed task
/// carries the cap after top-ups).
pub(crate) fn branch_task(
    plan: &ForkPlan,
    b: &BranchPlan,
    ids: BranchIds,
    prefix: BlobHash,
    snapshot: BlobHash,
    first_seq: u64,
) -> BranchTask {
    let model = plan.models.get(&b.model);
    BranchTask {
        fork_id: ids.fork_id,
        run_id: ids.run_id,
        label: b.label.clone(),
        index: ids.index,
        model: b.model.clone(),
        price: model.and_then(|m| m.price),
        script: model.and_then(|m| m.script),
        prefix,
        tail: branch_tail(b),
        snapshot,
        first_seq,
        max_turns: b.max_turns,
        max_output_tokens: b.max_output_tokens.unwrap_or(plan.limits.max_output_tokens),
        budget_usd: b.budget_usd,
        reserve: plan.budget.mode == BudgetMode::Strict
            && (b.budget_usd.is_some()
                || plan.aggregate_budget_usd.is_some()
                || plan.budget.account.is_some()),
        on_exhausted: plan.budget.on_exhausted,
        attempt_base: 0,
        endpoint: model.and_then(|m| m.endpoint.clone()),
        tools: plan.tools.clone(),
        temperature: b.temperature,
        replay: None,
        fork_root: None,
        on_truncated: plan.limits.on_truncated,
        approval: plan.approval_for(b).cloned(),
        event_batches: true,
    }
}

/// Validate `req` and write the fork: the root run (for [`ParentRun::New`]), the prefix
/// blob, every branch run with its log and record, checkpoint `fork:<id>` on the parent,
/// and the fork record (with `trace`, the `traceparent` of its `fork.create` span).
/// Nothing is written on error.
pub(crate) fn create_fork(
    store: &RunStore,
    req: CreateFork,
    now_ms: u64,
    trace: Option<String>,
) -> Result<PreparedFork, CoordinatorError> {
    validate_plan(&req.plan)?;
    // A merge into an existing parent must not append while its log is read here.
    let _parents = store.lock_parents();
    let (parent, parent_log, cutoff_seq, new_root) = parent_run(store, &req, now_ms)?;
    if !req.plan.solo {
        check_depth(parent.depth, req.plan.limits.max_depth)?;
    }
    let base = check_blobs(store, &req)?;

    let prefix: Vec<Event> = parent_log
        .iter()
        .filter(|e| e.is_conversational())
        .cloned()
        .collect();
    let prefix_bytes = Bytes::from(encode("history prefix", &prefix)?);
    let prefix_hash = BlobHash::of(&prefix_bytes);
    let prefix_len = prefix.len() as u64;
    let fork_id = ForkId::new();
    let plan = &req.plan;

    let mut branches = Vec::with_capacity(plan.branches.len());
    let mut tasks = Vec::with_capacity(plan.branches.len());
    let mut runs = Vec::with_capacity(plan.branches.len());
    let mut logs: Vec<(RunId, Event, Vec<Event>)> = Vec::with_capacity(plan.branches.len());
    for (i, b) in plan.branches.iter().enumerate() {
        let run_id = RunId::new();
        let tail = branch_tail(b);
        let first_seq = 1 + prefix_len + tail.len() as u64;
        let index = u32::try_from(i).unwrap_or(u32::MAX);
        let mut task = branch_task(
            plan,
            b,
            BranchIds {
                fork_id,
                run_id,
                index,
            },
            prefix_hash,
            req.snapshot,
            first_seq,
        );
        task.fork_root = Some(parent.fork_root);
        tasks.push(task);
        runs.push(RunRecord {
            run_id,
            parent: Some(parent.run_id),
            fork_id: Some(fork_id),
            fork_root: parent.fork_root,
            // A root run's single agent works at the root's depth (its forks are the
            // root's forks).
            depth: if plan.solo {
                parent.depth
            } else {
                parent.depth + 1
            },
            workspace: req.snapshot,
            next_seq: first_seq,
            created_at_ms: now_ms,
        });
        branches.push(BranchRecord {
            fork_id,
            run_id,
            index,
            label: b.label.clone(),
            model: b.model.clone(),
            first_seq,
            state: BranchState::Pending,
            error: None,
            turns: 0,
            usage: Usage::default(),
            cost_usd: 0.0,
            changes: 0,
            next_seq: first_seq,
            min_attempt: 0,
            calls: 0,
            task: None,
            cached_calls: 0,
            approval: None,
            blocked: Vec::new(),
            answer: None,
            queued: Some(Queued {
                at_ms: now_ms,
                turns: 0,
                requeues: 0,
                attempt_base: 0,
            }),
        });
        let lineage = Event::Fork {
            fork_id,
            parent_run: parent.run_id,
            fork_root: parent.fork_root,
            cutoff_seq,
            label: b.label.clone(),
            replay_event_count: 0,
            strategy: None,
            workspaces: vec![req.snapshot],
        };
        logs.push((run_id, lineage, tail));
    }
    let fork = ForkRecord {
        fork_id,
        plan: req.plan.clone(),
        parent_run: parent.run_id,
        snapshot: req.snapshot,
        workspace: req.workspace.clone(),
        left_out: req.left_out.clone(),
        state: ForkState::Open,
        created_at_ms: now_ms,
        cutoff_seq,
        prefix: prefix_hash,
        prefix_len,
        trace,
        replay: None,
        // A fork of an existing run starts from that run's workspace, not the client's
        // checkout: a commit recorded for it would not be the snapshot's.
        git: match req.parent {
            ParentRun::New => req.git.clone(),
            _ => None,
        },
    };

    // ---- writes: everything is valid ----
    if new_root {
        store.put_events(
            parent_log
                .iter()
                .enumerate()
                .map(|(seq, e)| (parent.run_id, seq as u64, e)),
        )?;
        store.put_run(&parent)?;
    }
    store.blobs().put_trusted(prefix_hash, &prefix_bytes)?;
    for (run_id, lineage, tail) in &logs {
        let copied = prefix
            .iter()
            .enumerate()
            .map(|(i, e)| (*run_id, 1 + i as u64, e));
        let tail_events = tail
            .iter()
            .enumerate()
            .map(|(i, e)| (*run_id, 1 + prefix_len + i as u64, e));
        store.put_events(
            std::iter::once((*run_id, 0u64, lineage))
                .chain(copied)
                .chain(tail_events),
        )?;
    }
    for r in &runs {
        store.put_run(r)?;
    }
    for b in &branches {
        store.put_branch(b)?;
    }
    // The parent's history and the workspace the branches start from.
    store.save_checkpoint(&CheckpointView {
        id: CheckpointId::new(),
        run_id: parent.run_id,
        label: fork_checkpoint_label(fork_id),
        seq: cutoff_seq,
        snapshot: req.snapshot,
        created_at_ms: now_ms,
        base_seq: cutoff_seq,
        turn: parent_log
            .iter()
            .filter(|e| matches!(e, Event::ModelResponse { .. }))
            .count() as u32,
        kind: CheckpointKind::Named,
        metadata: Default::default(),
    })?;
    store.put_fork(&fork)?;
    store.flush()?;

    Ok(PreparedFork {
        fork,
        branches,
        tasks,
        base,
        prefix_bytes,
    })
}
