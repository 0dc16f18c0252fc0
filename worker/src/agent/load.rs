//! Loading a branch: its history (the fork-time prefix and tail, or the coordinator's log
//! of a branch taken over), its workspace overlay, its provider, and what it already did.

use super::replay::Replay;
use super::Run;
use crate::context::WorkerCtx;
use crate::error::WorkerError;
use crate::forktools::AgentForks;
use forkfleet_shared::event::{history_events, messages_from_events, Event};
use forkfleet_shared::manifest::Manifest;
use forkfleet_shared::overlay::Overlay;
use forkfleet_shared::protocol::BranchTask;
use forkfleet_shared::state::BranchState;

/// The terminal state a log ends in, if it does: a `follow_up` after the last terminal
/// status started a new turn (ADR 13), so that log has not finished.
pub(super) fn terminal_state(events: &[(u64, Event)]) -> Option<BranchState> {
    events
        .iter()
        .rev()
        .find_map(|(_, e)| match e {
            Event::FollowUp { .. } => Some(None),
            Event::Status { state, .. } if state.is_terminal() => Some(Some(*state)),
            _ => None,
        })
        .flatten()
}

/// The fork-time workspace snapshot of `task` (decoded once per worker).
pub(super) async fn snapshot(
    ctx: &WorkerCtx,
    task: &BranchTask,
) -> Result<std::sync::Arc<Manifest>, WorkerError> {
    let blobs = &ctx.blobs;
    ctx.manifests
        .get_or_try_init(task.snapshot, || async {
            let bytes = blobs
                .get(&task.snapshot)
                .await
                .map_err(|error| WorkerError::TaskBlob {
                    what: "workspace snapshot",
                    hash: task.snapshot,
                    error,
                })?;
            Manifest::from_blob(&bytes).map_err(|e| WorkerError::BadSnapshot {
                hash: task.snapshot,
                message: e.to_string(),
            })
        })
        .await
}

/// Load the branch `task` runs: from its fork-time history, or from `resumed`, the
/// coordinator's log of a branch taken over.
pub(super) async fn load(
    ctx: &WorkerCtx,
    task: &BranchTask,
    resumed: Option<Vec<(u64, Event)>>,
) -> Result<Run, WorkerError> {
    let blobs = &ctx.blobs;
    let prefix = ctx
        .prefixes
        .get_or_try_init(task.prefix, || async {
            let bytes = blobs
                .get(&task.prefix)
                .await
                .map_err(|error| WorkerError::TaskBlob {
                    what: "history prefix",
                    hash: task.prefix,
                    error,
                })?;
            rmp_serde::from_slice::<Vec<Event>>(&bytes).map_err(|e| WorkerError::BadPrefix {
                hash: task.prefix,
                message: e.to_string(),
            })
        })
        .await?;
    let manifest = snapshot(ctx, task).await?;
    let provider =
        ctx.providers
            .provider_for(task)
            .await
            .map_err(|e| WorkerError::ModelUnusable {
                model: task.model.clone(),
                error: Box::new(e),
            })?;

    // A resumed branch's log holds what it already did, after its first `running` status
    // (the copied fork-time prefix never holds a status, a usage or a file change). A task
    // resumed from the coordinator's copy uses that log (after the seq-0 `fork` event), as
    // its history: a finished branch rewound (ADR 12) and then continued (ADR 13) goes on
    // from the rewound conversation and workspace.
    let log: Vec<&Event> = match &resumed {
        Some(events) => history_events(events, None)
            .into_iter()
            .filter(|(seq, _)| *seq > 0)
            .map(|(_, e)| e)
            .collect(),
        None => prefix.iter().chain(task.tail.iter()).collect(),
    };
    let log = || log.iter().copied();
    let mut overlay = Overlay::new(manifest);
    let mut own = false;
    let mut turns = 0u32;
    let mut turn_base = 0u32;
    for event in log() {
        match event {
            Event::Status {
                state: BranchState::Running,
                ..
            } => own = true,
            Event::ModelResponse { .. } if own => turns += 1,
            Event::FollowUp { .. } => turn_base = turns,
            Event::FileChange { change } => {
                overlay
                    .apply(change.clone())
                    .map_err(|e| WorkerError::Replay {
                        change: change.kind(),
                        path: change.path().to_string(),
                        message: e.to_string(),
                    })?
            }
            _ => {}
        }
    }
    // A replaying child: the parent's record, after what its log already holds.
    let replay = match &task.replay {
        None => None,
        Some(r) => {
            let bytes = blobs
                .get(&r.record)
                .await
                .map_err(|error| WorkerError::TaskBlob {
                    what: "replay record",
                    hash: r.record,
                    error,
                })?;
            let own: Vec<&Event> = match &resumed {
                Some(events) => events
                    .iter()
                    .filter(|(seq, _)| *seq >= task.first_seq)
                    .map(|(_, e)| e)
                    .collect(),
                None => Vec::new(),
            };
            Replay::new(r, &bytes, &own)?
        }
    };
    // Money spent stays spent, whatever a rewind left out of the history.
    let spent_usd = match &resumed {
        Some(events) => events.iter().map(|(_, e)| cost_of(e)).sum(),
        None => log().map(cost_of).sum(),
    };
    // A branch that stopped to ask for consent: the answers, and the calls left to run.
    let (approvals, parked) = match &resumed {
        Some(events) => {
            let own: Vec<(u64, &Event)> = history_events(events, None)
                .into_iter()
                .filter(|(seq, _)| *seq >= task.first_seq)
                .map(|(seq, e)| (*seq, e))
                .collect();
            super::approval::read(&own)
        }
        None => Default::default(),
    };
    let gate = match &task.approval {
        Some(rules) => Some(rules.gate().map_err(|message| WorkerError::BadTask {
            what: "approval rules",
            message,
        })?),
        None => None,
    };
    let history = messages_from_events(log());
    // The fork's shared history (every branch's first messages): the prefix's
    // conversation, as long as the history still starts with it (a rewind may cut it).
    let shared = messages_from_events(prefix.iter());
    let shared_prefix = if history.starts_with(&shared) {
        shared.len()
    } else {
        0
    };
    Ok(Run {
        provider,
        overlay,
        history,
        cache_key: task
            .fork_root
            .map_or_else(|| task.fork_id.to_string(), |root| root.to_string()),
        shared_prefix,
        turns,
        turn_base,
        spent_usd,
        last_settle: None,
        learned: match &resumed {
            Some(events) => {
                super::learn::Learned::from_usages(events.iter().filter_map(|(_, e)| usage_of(e)))
            }
            None => super::learn::Learned::from_usages(log().filter_map(usage_of)),
        },
        forks: AgentForks::from_log(log()),
        messages_hash: Default::default(),
        hasher: None,
        replay,
        tools: std::sync::Arc::new(crate::tools::ToolBox::for_task(task).with_trees(
            crate::tools::TreeSlot {
                trees: ctx.trees.clone(),
                key: crate::runner::TreeKey {
                    fork: task.fork_id,
                    label: task.label.clone(),
                },
                snapshot: task.snapshot,
            },
        )),
        gate,
        approvals,
        parked,
    })
}

/// The usage a `usage` event records.
fn usage_of(event: &Event) -> Option<&forkfleet_shared::event::Usage> {
    match event {
        Event::Usage { usage, .. } => Some(usage),
        _ => None,
    }
}

/// The cost a `usage` event records (0 for any other event).
fn cost_of(event: &Event) -> f64 {
    match event {
        Event::Usage { cost_usd, .. } => *cost_usd,
        _ => 0.0,
    }
}
