//! Lineage and replay over the store (docs/LINEAGE.md): the runs and their lineage (`runs
//! ls`, `runs show`), and `runs fork`: a child run from a prefix of any recorded run.
//!
//! A child is a one-branch fork (`plan.solo`) whose branch run is the child: its plan is the
//! parent's settings with `--set` applied, its snapshot the parent's workspace at the
//! cutoff, and its log the seq-0 `fork` lineage event, then the parent's replayable events
//! through the cutoff from seq 1 ([`forkfleet_shared::lineage::copy_plan`]), then a branch
//! summary when asked, then an `idle` status: no worker runs it until `runs resume`.
//!
//! With `--replay` the prefix is not copied but re-executed: the child's task carries the
//! parent's record ([`ReplayTask`], a blob the workers read from the bus), and its worker
//! serves each model call and tool call from it while the requests hash the same, on the
//! workspace the parent's own file changes apply to. The parent's log is never written.
//!
//! Planning ([`plan_child`]) reads only; [`write_child`] writes everything, the fork record
//! last, so a crash half-way leaves no reachable child.

use crate::checkpoint;
use crate::create::{branch_task, BranchIds};
use crate::error::CoordinatorError;
use crate::store::{encode, BranchRecord, ForkRecord, RunRecord, RunStore};
use bytes::Bytes;
use forkfleet_shared::api::{
    CopiedEvent, FileAt, Lineage, RunDetail, RunForkOptions, RunForkOutcome, RunKind, RunOrigin,
    RunView,
};
use forkfleet_shared::blob::BlobHash;
use forkfleet_shared::event::{history_at, Event, Usage};
use forkfleet_shared::ids::{ForkId, RunId};
use forkfleet_shared::lineage::{
    self as rules, apply_set, copy_plan, deterministic_summary, parse_set, RunSettings,
    SummaryMode, STRATEGY,
};
use forkfleet_shared::manifest::Manifest;
use forkfleet_shared::protocol::{BranchTask, ReplayTask};
use forkfleet_shared::spec::{check_label, BranchPlan, ForkPlan};
use forkfleet_shared::state::{BranchState, ForkState};
use std::collections::BTreeMap;

/// How far `settings_source` follows `checkpoint fork` origins before giving up.
const MAX_ORIGIN_HOPS: usize = 64;

/// A `runs fork` request, as the API carries it.
#[derive(Debug, Clone)]
pub(crate) struct ForkRunRequest {
    pub parent: RunId,
    pub options: RunForkOptions,
}

/// A planned child: what `runs fork --dry-run` answers, and what writing it needs.
pub(crate) struct ChildPlan {
    pub outcome: RunForkOutcome,
    parent: RunRecord,
    pub plan: ForkPlan,
    /// The copied prefix (copy mode), or nothing (replay).
    prefix: Vec<Event>,
    /// The events the child's own log starts with after the prefix (copy mode: the
    /// summary, then `idle`).
    tail: Vec<Event>,
    /// Replay: the parent's record (its seqs kept), the summary last.
    record: Option<Vec<(u64, Event)>>,
    /// The snapshot the child's branch starts from.
    snapshot: BlobHash,
    /// The workspace version at the cutoff, when it was built (stored only when written).
    version_blob: Option<(BlobHash, Bytes)>,
    /// A model-written summary is asked for: [`with_summary`] sets it before writing.
    pub wants_model_summary: bool,
    /// What the summary model is given (a model summary only).
    pub summary_source: Vec<Event>,
}

impl ChildPlan {
    /// The size of the child's plan encoded as its task carries it (MessagePack).
    pub(crate) fn plan_bytes(&self) -> Result<usize, CoordinatorError> {
        rmp_serde::to_vec_named(&self.plan)
            .map(|v| v.len())
            .map_err(|e| CoordinatorError::Internal(format!("cannot encode the child's plan: {e}")))
    }

    /// The parent's fork (a root run has none).
    pub(crate) fn parent_fork(&self) -> Option<ForkId> {
        self.parent.fork_id
    }

    /// The child plan's settings of `model`.
    pub(crate) fn plan_model(&self, model: &str) -> Option<&forkfleet_shared::spec::ModelPlan> {
        self.plan.models.get(model)
    }
}

/// The settings a run's plan gives it.
pub(crate) fn settings_of(plan: &ForkPlan, branch: &BranchPlan) -> RunSettings {
    RunSettings {
        model: branch.model.clone(),
        temperature: branch.temperature,
        system_prompt: plan.system_prompt.clone(),
        max_turns: branch.max_turns,
        max_output_tokens: branch
            .max_output_tokens
            .unwrap_or(plan.limits.max_output_tokens),
        budget_usd: branch.budget_usd,
        run_command: plan.tools.run_command.is_some(),
        forking: plan.tools.forking,
    }
}

/// The plan and branch plan a run's settings come from: a branch run's own; a root run's,
/// the plan of the first fork made from it (or, for a `checkpoint fork` run never forked,
/// its source run's). `None`: no plan holds them.
fn settings_source(
    store: &RunStore,
    run: &RunRecord,
) -> Result<Option<(ForkPlan, BranchPlan)>, CoordinatorError> {
    let mut run = run.clone();
    for _ in 0..MAX_ORIGIN_HOPS {
        if let Some(fork_id) = run.fork_id {
            let fork = store
                .fork(fork_id)?
                .ok_or_else(|| CoordinatorError::UnknownFork(fork_id.to_string()))?;
            let index = store
                .branches(fork_id)?
                .into_iter()
                .find(|b| b.run_id == run.run_id)
                .map_or(0, |b| b.index as usize);
            let branch = fork.plan.branches.get(index).cloned();
            return Ok(branch.map(|b| (fork.plan, b)));
        }
        let first = store
            .forks()?
            .into_iter()
            .filter(|f| f.parent_run == run.run_id)
            .min_by_key(|f| f.created_at_ms);
        if let Some(f) = first {
            let plan = f.plan;
            let branch = BranchPlan {
                label: "root".to_string(),
                steer: String::new(),
                model: plan.model.clone(),
                budget_usd: None,
                extra_instructions: None,
                max_turns: plan.limits.max_turns,
                max_output_tokens: None,
                temperature: plan.branches.first().and_then(|b| b.temperature),
                approval: None,
            };
            return Ok(Some((plan, branch)));
        }
        match origin(store, run.run_id)? {
            Some(o) => match store.run(o.run)? {
                Some(source) => run = source,
                None => return Ok(None),
            },
            None => return Ok(None),
        }
    }
    Ok(None)
}

/// Where a `checkpoint fork` root run came from (its `from:<run>` checkpoint).
fn origin(store: &RunStore, run: RunId) -> Result<Option<RunOrigin>, CoordinatorError> {
    Ok(store.checkpoints(run)?.into_iter().find_map(|c| {
        let source = c.metadata.get("source_run")?.parse::<RunId>().ok()?;
        (c.label == checkpoint::origin_label(source)).then(|| RunOrigin {
            run: source,
            checkpoint: c
                .metadata
                .get("source_checkpoint")
                .cloned()
                .unwrap_or_default(),
            seq: c
                .metadata
                .get("source_seq")
                .and_then(|s| s.parse().ok())
                .unwrap_or_default(),
        })
    }))
}

/// A run's workspace version at `seq`: a branch run's fork snapshot with its file changes
/// on its history through `seq`; a root run's (which changes files only by merges and
/// rewinds, each with a checkpoint) the version of its last checkpoint at or before `seq`,
/// else its first one's (nothing changed before it), else its current one.
///
/// Nothing is stored: the answer holds the version's manifest blob when the store may lack
/// it (built from changes), for the caller to store once it writes.
fn workspace_at(
    store: &RunStore,
    run: &RunRecord,
    log: &[(u64, Event)],
    seq: u64,
) -> Result<(BlobHash, Manifest, Option<Bytes>), CoordinatorError> {
    if let Some(fork_id) = run.fork_id {
        let fork = store
            .fork(fork_id)?
            .ok_or_else(|| CoordinatorError::UnknownFork(fork_id.to_string()))?;
        return checkpoint::version_unstored(store, log, fork.snapshot, 0, seq);
    }
    let mut all = store.checkpoints(run.run_id)?;
    all.sort_by_key(|c| (c.seq, c.created_at_ms));
    let at = all.iter().rev().find(|c| c.seq <= seq).or(all.first());
    match at {
        Some(c) => checkpoint::version_unstored(store, log, c.snapshot, c.base_seq, c.seq),
        None => Ok((run.workspace, manifest(store, run.workspace)?, None)),
    }
}

fn manifest(store: &RunStore, hash: BlobHash) -> Result<Manifest, CoordinatorError> {
    let bytes = store
        .blobs()
        .get_sync(&hash)?
        .ok_or_else(|| CoordinatorError::missing_blobs(&[hash]))?;
    Manifest::from_blob(&bytes).map_err(|e| CoordinatorError::BadSnapshot {
        hash,
        message: e.to_string(),
    })
}

fn files_of(m: &Manifest) -> Vec<FileAt> {
    m.files
        .iter()
        .map(|(path, e)| FileAt {
            path: path.to_string(),
            bytes: e.size,
            hash: e.hash,
        })
        .collect()
}

/// Replace the system prompt in `events` (the `system` events that are the old prompt, or
/// a new first event) when `--set system_prompt` changed it.
fn set_system_prompt<T>(
    events: &mut Vec<T>,
    old: Option<&str>,
    new: Option<&str>,
    event: impl Fn(&mut T) -> &mut Event,
    make: impl Fn(Event) -> T,
) {
    if old == new {
        return;
    }
    let is_old = |e: &Event| matches!(e, Event::System { text } if Some(text.as_str()) == old);
    match new {
        Some(text) => {
            let mut replaced = false;
            for e in events.iter_mut() {
                let e = event(e);
                if old.is_some() && is_old(e) {
                    *e = Event::System {
                        text: text.to_string(),
                    };
                    replaced = true;
                }
            }
            if !replaced {
                events.insert(
                    0,
                    make(Event::System {
                        text: text.to_string(),
                    }),
                );
            }
        }
        None => events.retain_mut(|e| !is_old(event(e))),
    }
}

/// The `file_change` events of the histories `run` was forked from, oldest first: its
/// fork's parent run through the fork's cutoff, that run's own fork's parent through its
/// cutoff, and so on up to a run no fork made. A branch's copied prefix holds the
/// conversation only; the files it changed are in the fork's snapshot, so a summary of a
/// fork of a child would otherwise say no file was touched.
fn inherited_file_changes(
    store: &RunStore,
    run: &RunRecord,
) -> Result<Vec<Event>, CoordinatorError> {
    let mut generations = Vec::new();
    let mut fork_id = run.fork_id;
    // A lineage is as deep as forks nest (`max_depth`); the bound only guards the walk.
    for _ in 0..=u8::MAX {
        let Some(fork) = fork_id.map(|f| store.fork(f)).transpose()?.flatten() else {
            break;
        };
        let log = store.run_log(fork.parent_run)?;
        let changes: Vec<Event> = history_at(&log, Some(fork.cutoff_seq))
            .into_iter()
            .filter_map(|i| match &log[i].1 {
                e @ Event::FileChange { .. } => Some(e.clone()),
                _ => None,
            })
            .collect();
        generations.push(changes);
        fork_id = store.run(fork.parent_run)?.and_then(|r| r.fork_id);
    }
    Ok(generations.into_iter().rev().flatten().collect())
}

/// Plan a child of `req.parent` (reads only): every check a `runs fork` makes, and the
/// outcome a dry run answers.
pub(crate) fn plan_child(
    store: &RunStore,
    req: &ForkRunRequest,
) -> Result<ChildPlan, CoordinatorError> {
    let bad = CoordinatorError::BadRequest;
    let o = &req.options;
    if o.record && !o.replay {
        return Err(bad(
            "--record goes with --replay: it records the live answers of a replay that diverged"
                .into(),
        ));
    }
    let parent = store
        .run(req.parent)?
        .ok_or(CoordinatorError::UnknownRun(req.parent))?;
    let log = store.run_log(req.parent)?;
    let cutoff =
        rules::cutoff(&log, o.at_event).map_err(|e| bad(format!("run {}: {e}", req.parent)))?;
    let Some((source_plan, source_branch)) = settings_source(store, &parent)? else {
        return Err(bad(format!(
            "run {} has no settings to start a child from: no fork was made from it; fork it with `forkfleet fork create SPEC --from-run {}`",
            req.parent, req.parent
        )));
    };
    let original = settings_of(&source_plan, &source_branch);
    let mut settings = original.clone();
    let mut changed = Vec::new();
    for arg in &o.set {
        let (key, value) = parse_set(arg).map_err(|e| bad(e.to_string()))?;
        apply_set(&mut settings, &key, &value).map_err(|e| bad(e.to_string()))?;
        if !changed.contains(&key) {
            changed.push(key);
        }
    }
    let label = o.label.clone().unwrap_or_else(|| format!("at-{cutoff}"));
    check_label(&label).map_err(|e| bad(format!("--label: {e}")))?;
    if !source_plan.models.contains_key(&settings.model) && settings.model.starts_with("scripted:")
    {
        return Err(bad(format!(
            "--set model={}: a scripted model needs its script, and the parent's plan configures none for it; configured: {}; add it to the spec as [models.\"{}\"] with `spare = true`",
            settings.model,
            source_plan.models.keys().cloned().collect::<Vec<_>>().join(", "),
            settings.model
        )));
    }
    let plan = child_plan(&source_plan, &settings, &label);
    crate::create::validate_plan(&plan)?;

    // The parent's history through the cutoff (file changes included), and what is copied.
    let history: Vec<(u64, Event)> = history_at(&log, Some(cutoff))
        .into_iter()
        .map(|i| log[i].clone())
        .collect();
    let copy = copy_plan(&log, cutoff);
    let (summary, wants_model_summary) = match o.summarize {
        None => (None, false),
        Some(SummaryMode::Deterministic) => {
            // The files of the histories the parent was forked from come first: its
            // copied prefix holds none of their changes (its fork snapshot does). Read
            // only for a summary: a walk up the lineage, each ancestor's log.
            let inherited = inherited_file_changes(store, &parent)?;
            let summary_history: Vec<&Event> = inherited
                .iter()
                .chain(history.iter().map(|(_, e)| e))
                .collect();
            (
                Some(deterministic_summary(
                    &req.parent.to_string(),
                    cutoff,
                    &summary_history,
                )),
                false,
            )
        }
        Some(SummaryMode::Model) => (None, true),
    };
    let (at_cutoff, cutoff_manifest, version_blob) = workspace_at(store, &parent, &log, cutoff)?;
    let (prefix, record, snapshot) = if o.replay {
        // The workspace the parent's own file changes apply to: a branch's fork snapshot
        // (its copied prefix's effects are in it), a root run's version at the cutoff.
        let base = match parent.fork_id {
            Some(f) => {
                store
                    .fork(f)?
                    .ok_or_else(|| CoordinatorError::UnknownFork(f.to_string()))?
                    .snapshot
            }
            None => at_cutoff,
        };
        let mut record: Vec<(u64, Event)> = history
            .iter()
            .filter(|(_, e)| rules::is_replayable(e) || matches!(e, Event::FileChange { .. }))
            .cloned()
            .collect();
        set_system_prompt(
            &mut record,
            original.system_prompt.as_deref(),
            settings.system_prompt.as_deref(),
            |(_, e)| e,
            |e| (0, e),
        );
        (Vec::new(), Some(record), base)
    } else {
        let mut prefix: Vec<(Option<u64>, Event)> = copy
            .copied
            .iter()
            .map(|(s, e)| (Some(*s), e.clone()))
            .collect();
        set_system_prompt(
            &mut prefix,
            original.system_prompt.as_deref(),
            settings.system_prompt.as_deref(),
            |(_, e)| e,
            |e| (None, e),
        );
        (prefix, None, at_cutoff)
    };
    let replay_event_count = match &record {
        Some(r) => r.iter().filter(|(_, e)| rules::is_replayable(e)).count() as u64,
        None => prefix.len() as u64,
    };
    let copied = prefix
        .iter()
        .enumerate()
        .map(|(i, (parent_seq, e))| CopiedEvent {
            parent_seq: *parent_seq,
            seq: 1 + i as u64,
            kind: e.kind().to_string(),
        })
        .collect();
    let prefix: Vec<Event> = prefix.into_iter().map(|(_, e)| e).collect();
    let files = files_of(&cutoff_manifest);
    let summary_source = if wants_model_summary {
        history.iter().map(|(_, e)| e.clone()).collect()
    } else {
        Vec::new()
    };
    let mut child = ChildPlan {
        outcome: RunForkOutcome {
            dry_run: true,
            parent_run: req.parent,
            fork_root: parent.fork_root,
            cutoff_seq: cutoff,
            label,
            strategy: STRATEGY.to_string(),
            copied,
            replay_event_count,
            skipped: copy.skipped,
            summary: None,
            settings,
            changed,
            workspace: at_cutoff,
            files,
            replay: o.replay,
            record: o.record,
            run_id: None,
            fork_id: None,
            state: None,
        },
        parent,
        plan,
        prefix,
        tail: Vec::new(),
        record,
        snapshot,
        version_blob: version_blob.map(|b| (at_cutoff, b)),
        wants_model_summary,
        summary_source,
    };
    if let Some(text) = summary {
        with_summary(&mut child, text);
    }
    Ok(child)
}

/// Record `text` as the child's branch summary: after the copied prefix, or last in a
/// replay's record (the worker appends it once the replay is done).
///
/// A cutoff between an assistant's tool calls and their results leaves those calls
/// unanswered: in a copy they are answered as interrupted first (`interrupted_results`),
/// so the summary never sits between a call and its result, which every model API
/// refuses; a replay runs them again, and the worker appends the summary after.
pub(crate) fn with_summary(child: &mut ChildPlan, text: String) {
    let event = Event::BranchSummary { text: text.clone() };
    match &mut child.record {
        // A replay runs the record's last calls again before the summary is appended.
        Some(record) => record.push((child.outcome.cutoff_seq, event)),
        None => {
            let history = forkfleet_shared::event::messages_from_events(
                child.prefix.iter().chain(child.tail.iter()),
            );
            child
                .tail
                .extend(forkfleet_shared::event::interrupted_results(&history));
            child.tail.push(event);
        }
    }
    child.outcome.summary = Some(text);
}

/// The child's plan: the parent's with one branch, the child, and the settings applied.
fn child_plan(source: &ForkPlan, s: &RunSettings, label: &str) -> ForkPlan {
    let mut plan = source.clone();
    // The source fork's name stays its own: a name finds the newest fork that has it.
    plan.name = None;
    plan.solo = true;
    plan.system_prompt = s.system_prompt.clone();
    // The child's history is its log; its parent is an existing run.
    plan.history = Vec::new();
    plan.aggregate_budget_usd = None;
    plan.tools.forking = s.forking;
    plan.tools.run_command = match (s.run_command, &source.tools.run_command) {
        (false, _) => None,
        (true, Some(t)) => Some(t.clone()),
        // The defaults always validate.
        (true, None) => forkfleet_shared::endpoint::CommandToolSection::default()
            .validate()
            .ok(),
    };
    if !plan.models.contains_key(&s.model) {
        // A real model the source plan did not name: priced from the built-in table (a
        // scripted one needs a script, which the plan's validation says).
        plan.models.insert(
            s.model.clone(),
            forkfleet_shared::spec::ModelPlan {
                price: forkfleet_shared::pricing::builtin_price(&s.model),
                script: None,
                endpoint: None,
            },
        );
    }
    plan.branches = vec![BranchPlan {
        label: label.to_string(),
        steer: String::new(),
        model: s.model.clone(),
        budget_usd: s.budget_usd,
        extra_instructions: None,
        max_turns: s.max_turns,
        max_output_tokens: Some(s.max_output_tokens),
        temperature: s.temperature,
        approval: None,
    }];
    plan
}

/// A child written to the store: what to answer, the fork whose actor to start, the task
/// to enqueue (a replay), and the blobs workers read from the bus.
pub(crate) struct WrittenChild {
    pub outcome: RunForkOutcome,
    pub fork_id: ForkId,
    /// The child's snapshot (a manifest the coordinator may have built).
    pub snapshot: BlobHash,
    pub task: Option<BranchTask>,
    pub blobs: Vec<(BlobHash, Bytes)>,
}

/// Write the child `plan_child` planned: its run, log, branch and fork records (the fork
/// record last), and the prefix (and replay record) blobs. Returns the fork for its actor
/// and the task to enqueue (a replay starts at once; a copy waits, idle).
pub(crate) fn write_child(
    store: &RunStore,
    mut child: ChildPlan,
    now_ms: u64,
) -> Result<WrittenChild, CoordinatorError> {
    // What a model will be given must be in an order every model API takes: checked
    // before anything is written (a child that breaks it could never be resumed).
    let events: Vec<&Event> = match &child.record {
        // A replay's summary is appended by the worker once the record's calls ran again.
        Some(record) => match record.split_last() {
            Some(((_, Event::BranchSummary { .. }), rest)) => rest.iter().map(|(_, e)| e).collect(),
            _ => record.iter().map(|(_, e)| e).collect(),
        },
        None => child.prefix.iter().chain(child.tail.iter()).collect(),
    };
    let history = forkfleet_shared::event::messages_from_events(events);
    if let Some((at, calls)) = forkfleet_shared::event::ordering_break(&history) {
        return Err(CoordinatorError::Internal(format!(
            "the child's history would put message {at} between tool call(s) {} and their results, which model APIs refuse; nothing was written",
            calls.join(", ")
        )));
    }
    let fork_id = ForkId::new();
    let run_id = RunId::new();
    let parent = &child.parent;
    let prefix_bytes = Bytes::from(encode("history prefix", &child.prefix)?);
    let prefix_hash = BlobHash::of(&prefix_bytes);
    let prefix_len = child.prefix.len() as u64;
    let mut blobs = vec![(prefix_hash, prefix_bytes)];
    blobs.extend(child.version_blob.take());
    let replay = match &child.record {
        Some(record) => {
            let bytes = Bytes::from(encode("replay record", record)?);
            let hash = BlobHash::of(&bytes);
            blobs.push((hash, bytes));
            Some(ReplayTask {
                record: hash,
                parent_run: parent.run_id,
                record_live: child.outcome.record,
            })
        }
        None => None,
    };
    let idle = replay.is_none();
    if idle {
        child.tail.push(Event::Status {
            state: BranchState::Idle,
            error: None,
        });
    }
    let lineage = Event::Fork {
        fork_id,
        parent_run: parent.run_id,
        fork_root: parent.fork_root,
        cutoff_seq: child.outcome.cutoff_seq,
        label: child.outcome.label.clone(),
        replay_event_count: child.outcome.replay_event_count,
        strategy: Some(STRATEGY.to_string()),
        workspaces: vec![child.snapshot],
    };
    let first_seq = 1 + prefix_len;
    let next_seq = first_seq + child.tail.len() as u64;
    let state = if idle {
        BranchState::Idle
    } else {
        BranchState::Pending
    };
    let branch_plan = child.plan.branches[0].clone();
    let mut task = branch_task(
        &child.plan,
        &branch_plan,
        BranchIds {
            fork_id,
            run_id,
            index: 0,
        },
        prefix_hash,
        child.snapshot,
        first_seq,
    );
    task.replay = replay.clone();
    task.fork_root = Some(parent.fork_root);

    for (hash, bytes) in &blobs {
        store.blobs().put_trusted(*hash, bytes)?;
    }
    let prefix_events = child
        .prefix
        .iter()
        .enumerate()
        .map(|(i, e)| (run_id, 1 + i as u64, e));
    let tail_events = child
        .tail
        .iter()
        .enumerate()
        .map(|(i, e)| (run_id, first_seq + i as u64, e));
    store.put_events(
        std::iter::once((run_id, 0u64, &lineage))
            .chain(prefix_events)
            .chain(tail_events),
    )?;
    store.put_run(&RunRecord {
        run_id,
        parent: Some(parent.run_id),
        fork_id: Some(fork_id),
        fork_root: parent.fork_root,
        // A child re-runs its parent: it works at the parent's depth.
        depth: parent.depth,
        workspace: child.snapshot,
        next_seq,
        created_at_ms: now_ms,
    })?;
    store.put_branch(&BranchRecord {
        fork_id,
        run_id,
        index: 0,
        label: branch_plan.label.clone(),
        model: branch_plan.model.clone(),
        first_seq,
        state,
        error: None,
        turns: 0,
        usage: Usage::default(),
        cost_usd: 0.0,
        changes: 0,
        next_seq,
        min_attempt: 0,
        calls: 0,
        task: None,
        cached_calls: 0,
        approval: None,
        blocked: Vec::new(),
        answer: None,
        queued: None,
    })?;
    let fork = ForkRecord {
        fork_id,
        plan: child.plan,
        parent_run: parent.run_id,
        snapshot: child.snapshot,
        workspace: None,
        left_out: None,
        state: ForkState::Open,
        created_at_ms: now_ms,
        cutoff_seq: child.outcome.cutoff_seq,
        prefix: prefix_hash,
        prefix_len,
        trace: forkfleet_shared::trace::current_traceparent(),
        replay,
        git: None,
    };
    store.put_fork(&fork)?;
    store.flush()?;
    let mut outcome = child.outcome;
    outcome.dry_run = false;
    outcome.run_id = Some(run_id);
    outcome.fork_id = Some(fork_id);
    outcome.state = Some(state);
    tracing::info!(run.id = %run_id, parent.run = %parent.run_id, cutoff = outcome.cutoff_seq, replay = outcome.replay, "runs.fork: a child run");
    Ok(WrittenChild {
        outcome,
        fork_id,
        snapshot: fork.snapshot,
        task: (!idle).then_some(task),
        blobs,
    })
}

/// Everything the store knows of every run, for [`RunView`]s (reads only); the caller
/// completes each branch's state and money from the ledger.
pub(crate) fn run_views(store: &RunStore) -> Result<Vec<RunView>, CoordinatorError> {
    let forks: BTreeMap<ForkId, ForkRecord> =
        store.forks()?.into_iter().map(|f| (f.fork_id, f)).collect();
    let mut branches: BTreeMap<RunId, BranchRecord> = BTreeMap::new();
    for f in forks.keys() {
        for b in store.branches(*f)? {
            branches.insert(b.run_id, b);
        }
    }
    let mut out = Vec::new();
    for run in store.runs()? {
        out.push(view_of(store, &run, &forks, &branches)?);
    }
    Ok(out)
}

fn view_of(
    store: &RunStore,
    run: &RunRecord,
    forks: &BTreeMap<ForkId, ForkRecord>,
    branches: &BTreeMap<RunId, BranchRecord>,
) -> Result<RunView, CoordinatorError> {
    let lineage = match store.event(run.run_id, 0)? {
        Some(Event::Fork {
            fork_id,
            parent_run,
            fork_root,
            cutoff_seq,
            label,
            replay_event_count,
            strategy,
            workspaces,
        }) => Some(Lineage {
            fork_id,
            parent_run,
            fork_root,
            cutoff_seq,
            label,
            replay_event_count,
            strategy,
            workspaces,
        }),
        _ => None,
    };
    let branch = branches.get(&run.run_id);
    let fork = run.fork_id.and_then(|f| forks.get(&f));
    let kind = match (&lineage, run.fork_id) {
        (Some(l), _) if l.strategy.is_some() => RunKind::Child,
        (_, Some(_)) => RunKind::Branch,
        _ => RunKind::Root,
    };
    let origin = if run.fork_id.is_none() {
        origin(store, run.run_id)?
    } else {
        None
    };
    let merged = match (fork, branch) {
        (Some(f), Some(b)) => {
            matches!(&f.state, ForkState::Merged { winner } if *winner == b.label)
        }
        _ => false,
    };
    Ok(RunView {
        run_id: run.run_id,
        kind,
        parent: run.parent.or(origin.as_ref().map(|o| o.run)),
        fork_root: run.fork_root,
        fork_id: run.fork_id,
        label: branch.map(|b| b.label.clone()),
        state: branch.map(|b| b.state),
        error: branch.and_then(|b| b.error.clone()),
        model: branch.map(|b| b.model.clone()),
        events: branch.map_or(run.next_seq, |b| b.next_seq),
        cost_usd: branch.map_or(0.0, |b| b.cost_usd),
        calls: branch.map_or(0, |b| b.calls),
        cached_calls: branch.map_or(0, |b| b.cached_calls),
        created_at_ms: run.created_at_ms,
        lineage,
        origin,
        merged,
        workspace: run.workspace,
    })
}

/// A run's current workspace version: a root run's record, a branch run's fork snapshot
/// with the file changes on its history.
/// With `keep`, the version's manifest is stored (a snapshot a fork will name).
pub(crate) fn current_workspace(
    store: &RunStore,
    run_id: RunId,
    keep: bool,
) -> Result<(BlobHash, Manifest), CoordinatorError> {
    let run = store
        .run(run_id)?
        .ok_or(CoordinatorError::UnknownRun(run_id))?;
    let log = store.run_log(run_id)?;
    match log.last() {
        Some((last, _)) if run.fork_id.is_some() => {
            let (hash, m, bytes) = workspace_at(store, &run, &log, *last)?;
            if let (true, Some(bytes)) = (keep, bytes) {
                store.blobs().put_trusted(hash, &bytes)?;
            }
            Ok((hash, m))
        }
        _ => Ok((run.workspace, manifest(store, run.workspace)?)),
    }
}

/// One run with its settings, current workspace and children (reads only).
pub(crate) fn run_detail(store: &RunStore, run_id: RunId) -> Result<RunDetail, CoordinatorError> {
    let run = store
        .run(run_id)?
        .ok_or(CoordinatorError::UnknownRun(run_id))?;
    let views = run_views(store)?;
    let view = views
        .iter()
        .find(|v| v.run_id == run_id)
        .cloned()
        .ok_or(CoordinatorError::UnknownRun(run_id))?;
    let settings = settings_source(store, &run)?.map(|(p, b)| settings_of(&p, &b));
    let (workspace, m) = current_workspace(store, run_id, false)?;
    let children = views
        .iter()
        .filter(|v| v.parent == Some(run_id))
        .map(|v| v.run_id)
        .collect();
    Ok(RunDetail {
        run: view,
        settings,
        workspace,
        files: m.files.len() as u64,
        bytes: m.files.values().map(|e| e.size).sum(),
        children,
    })
}
