//! The agents' checkpoint tools (`checkpoint_tools = true`): `save_checkpoint`,
//! `list_checkpoints` and `rewind_to`, through the coordinator's API on the workers'
//! subject, as `forkfleet checkpoint save/ls/rewind` do for a person.
//!
//! - `save_checkpoint` saves a named checkpoint at the last event before the answer that
//!   asked for it (the coordinator waits, bounded, for its log to get there).
//! - `rewind_to` rewinds the running agent: it publishes a `rewind` marker to the
//!   checkpoint's seq and a user message saying so, waits for the coordinator's log to hold
//!   both, then takes its history and its overlay from that log, as a branch taken over
//!   does. The coordinator's replica rebuilds its overlay from the rewound history when it
//!   applies the marker. The answer's other calls belong to the abandoned timeline and are
//!   not run.

use super::{Publisher, Run};
use crate::context::WorkerCtx;
use crate::error::WorkerError;
use crate::toolspec::{ToolOutcome, LIST_CHECKPOINTS, REWIND_TO, SAVE_CHECKPOINT};
use forkfleet_bus::apicall::BusApi;
use forkfleet_shared::api::{ApiClient, CheckpointView};
use forkfleet_shared::event::{history_events, messages_from_events, Event, ToolCall};
use forkfleet_shared::overlay::Overlay;
use forkfleet_shared::protocol::BranchTask;
use std::time::Duration;

/// How long `rewind_to` waits for the coordinator's log to hold its marker.
const LOG_WAIT: Duration = Duration::from_secs(30);

/// What a checkpoint tool call did.
pub(super) enum Done {
    /// A result for the model.
    Result(ToolOutcome),
    /// The run was rewound: its history and overlay are the checkpoint's; the answer's
    /// other calls are not run.
    Rewound,
}

fn arg<'a>(call: &'a ToolCall, key: &str) -> Option<&'a str> {
    call.args
        .get(key)
        .and_then(|v| v.as_str())
        .map(str::trim)
        .filter(|s| !s.is_empty())
}

/// Run checkpoint tool `call` of `task`'s agent; `cutoff_seq` is the last event before the
/// answer that made it.
pub(super) async fn run(
    ctx: &WorkerCtx,
    task: &BranchTask,
    out: &mut Publisher,
    run: &mut Run,
    call: &ToolCall,
    cutoff_seq: u64,
) -> Result<Done, WorkerError> {
    let api = BusApi::worker(ctx.bus.as_ref());
    match call.name.as_str() {
        SAVE_CHECKPOINT => {
            let Some(label) = arg(call, "label") else {
                return Ok(Done::Result(ToolOutcome::err(
                    "save_checkpoint needs a `label`",
                )));
            };
            Ok(Done::Result(
                match api
                    .checkpoint_save(task.run_id, label, Some(cutoff_seq))
                    .await
                {
                    Ok(c) => ToolOutcome::ok(format!(
                        "saved checkpoint `{}` (turn {}); rewind_to(\"{}\") brings this point back",
                        c.label, c.turn, c.label
                    )),
                    Err(e) => ToolOutcome::err(format!("checkpoint not saved: {e}")),
                },
            ))
        }
        LIST_CHECKPOINTS => Ok(Done::Result(match api.checkpoints(task.run_id).await {
            Ok(list) if list.is_empty() => ToolOutcome::ok("no checkpoints yet".to_string()),
            Ok(list) => ToolOutcome::ok(
                list.iter()
                    .map(|c| {
                        format!(
                            "{} · turn {} · {} · id {}",
                            c.label,
                            c.turn,
                            if c.kind == forkfleet_shared::api::CheckpointKind::Named {
                                "named"
                            } else {
                                "automatic"
                            },
                            c.id
                        )
                    })
                    .collect::<Vec<_>>()
                    .join("\n"),
            ),
            Err(e) => ToolOutcome::err(format!("cannot list the checkpoints: {e}")),
        })),
        REWIND_TO => {
            let Some(wanted) = arg(call, "checkpoint") else {
                return Ok(Done::Result(ToolOutcome::err(
                    "rewind_to needs a `checkpoint` (a label from list_checkpoints)",
                )));
            };
            let list = match api.checkpoints(task.run_id).await {
                Ok(list) => list,
                Err(e) => {
                    return Ok(Done::Result(ToolOutcome::err(format!(
                        "cannot list the checkpoints: {e}"
                    ))))
                }
            };
            let found: Option<&CheckpointView> = list
                .iter()
                .find(|c| c.label == wanted)
                .or_else(|| list.iter().find(|c| c.id.to_string().starts_with(wanted)));
            let Some(c) = found.filter(|c| c.seq < out.seq) else {
                let labels: Vec<&str> = list.iter().map(|c| c.label.as_str()).collect();
                return Ok(Done::Result(ToolOutcome::err(format!(
                    "no checkpoint `{wanted}`; this run's: {}",
                    if labels.is_empty() {
                        "none".to_string()
                    } else {
                        labels.join(", ")
                    }
                ))));
            };
            rewind(ctx, task, out, run, c).await?;
            Ok(Done::Rewound)
        }
        other => Ok(Done::Result(ToolOutcome::err(format!(
            "`{other}` is not a checkpoint tool"
        )))),
    }
}

/// Rewind the running agent to checkpoint `c` (see the module's documentation).
async fn rewind(
    ctx: &WorkerCtx,
    task: &BranchTask,
    out: &mut Publisher,
    run: &mut Run,
    c: &CheckpointView,
) -> Result<(), WorkerError> {
    tracing::info!(checkpoint = %c.label, seq = c.seq, "rewind_to: the agent rewinds itself");
    out.publish(Event::Rewind {
        to_seq: c.seq,
        checkpoint: c.id,
        label: c.label.clone(),
    })
    .await?;
    out.publish(Event::UserMessage {
        text: format!(
            "[forkfleet] You rewound to checkpoint `{}`: the conversation and the files are as they were then; what came after it is gone.",
            c.label
        ),
    })
    .await?;
    // Read back below: stored first.
    out.flush().await?;
    let last = out.seq.saturating_sub(1);
    let api = BusApi::worker(ctx.bus.as_ref());
    let deadline = tokio::time::Instant::now() + LOG_WAIT;
    let mut pause = Duration::from_millis(20);
    let log = loop {
        let events = api.run_events(task.run_id).await.map_err(|e| {
            WorkerError::Rewind(format!("reading the log back after a rewind: {e}"))
        })?;
        if events.last().is_some_and(|e| e.seq >= last) {
            break events;
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(WorkerError::Rewind(format!(
                "the coordinator's log did not reach the rewind (seq {last}) within {} s",
                LOG_WAIT.as_secs()
            )));
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_millis(500));
    };
    let log: Vec<(u64, Event)> = log.into_iter().map(|e| (e.seq, e.event)).collect();
    let history: Vec<&Event> = history_events(&log, None)
        .into_iter()
        .filter(|(seq, _)| *seq > 0)
        .map(|(_, e)| e)
        .collect();
    let mut overlay = Overlay::new(super::load::snapshot(ctx, task).await?);
    for e in &history {
        if let Event::FileChange { change } = e {
            overlay
                .apply(change.clone())
                .map_err(|err| WorkerError::Replay {
                    change: change.kind(),
                    path: change.path().to_string(),
                    message: err.to_string(),
                })?;
        }
    }
    run.history = messages_from_events(history.iter().copied());
    run.overlay = overlay;
    run.shared_prefix = run.shared_prefix.min(run.history.len());
    run.approvals.clear();
    run.parked = None;
    Ok(())
}
