//! The chat's background work. Nothing here runs on the UI loop: each fork the chat shows
//! has one task that follows it (bounded `watch`es, then the logs that grew, the costs,
//! the diff, the agent's own forks, the workspace kept in step), and each action (a
//! message, a fork, a merge, a resolve) is a task of its own. They report to the UI loop
//! as [`Msg`]s; a failed call shows in the status line and the follower tries again.

use forkfleet_client::workspace;
use forkfleet_client::{ApiClient, Client};
use forkfleet_shared::api::{ForkView, LoggedEvent, ResolveReport};
use forkfleet_shared::blob::BlobHash;
use forkfleet_shared::budget::ForkCost;
use forkfleet_shared::diff::{DiffOptions, DiffReport};
use forkfleet_shared::flush::{ConflictPolicy, FlushReport};
use forkfleet_shared::ids::{ForkId, RunId};
use forkfleet_shared::spec::SOLO_LABEL;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;
use tokio::sync::mpsc::UnboundedSender;

/// How long one `watch` waits for a change.
const WATCH_WAIT: Duration = Duration::from_secs(10);
/// The longest pause between tries after a failed call.
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// What the background tasks tell the UI loop.
#[derive(Debug)]
pub enum Msg {
    /// A fork's view changed (with its costs when they could be read).
    View {
        view: ForkView,
        cost: Option<ForkCost>,
    },
    /// New events of a run (from the seq after the last ones sent).
    Events {
        run: RunId,
        events: Vec<LoggedEvent>,
    },
    /// The diff report of a fork, after its branches changed files.
    Diff { fork: ForkId, report: DiffReport },
    /// Unresolved forks the chat's agent made itself (`fork_run`).
    AgentForks(Vec<ForkView>),
    /// The workspace directory was brought to the agent's version `version`.
    Synced {
        version: BlobHash,
        report: FlushReport,
    },
    /// Calls go through again, or fail (the text says why).
    Connection(Result<(), String>),
    /// The bus's connection went down (false) or came back (true).
    Bus(bool),
    /// The chat's fork was created (its first message sent).
    Started(ForkView),
    /// A fork was made from the chat.
    Forked(ForkView),
    /// A resolve decided (nothing merged yet: the chat asks first).
    Resolved(ResolveReport),
    /// A branch was merged into the chat.
    Merged {
        fork: ForkId,
        winner: String,
        applied: usize,
    },
    /// A diff to show (the lines of its text).
    DiffText(Vec<String>),
    /// An action finished: a line for the notice bar.
    Note(String),
    /// An action failed: what was wrong.
    Failed(String),
}

/// Send `msg`; false when the UI has gone (the task ends).
fn send(tx: &UnboundedSender<Msg>, msg: Msg) -> bool {
    tx.send(msg).is_ok()
}

/// What the follower of the chat's own fork also does.
pub struct ChatDuty {
    /// The workspace directory kept at the agent's version.
    pub dir: PathBuf,
    /// The version the directory holds now.
    pub synced: BlobHash,
    pub policy: ConflictPolicy,
    /// How long the agent's log was when its version was last compared (its files change
    /// only with events: a turn's, or a merge's).
    pub checked_at: u64,
}

/// Follow fork `fork` until it is merged or aborted (the chat's own fork: until the UI
/// goes), reporting every change. With `chat`, also look for the agent's own forks when
/// its log grows and keep the workspace at its version whenever it stops.
pub async fn follow(
    client: Client,
    fork: ForkId,
    tx: UnboundedSender<Msg>,
    mut chat: Option<ChatDuty>,
) {
    let mut seen: Option<u64> = None;
    let mut next: BTreeMap<RunId, u64> = BTreeMap::new();
    let mut changes_seen: Option<Vec<usize>> = None;
    let mut backoff = Duration::from_millis(250);
    let mut lost = false;
    loop {
        if tx.is_closed() {
            return;
        }
        let round = round(
            &client,
            fork,
            &mut seen,
            &mut next,
            &mut changes_seen,
            &tx,
            chat.as_mut(),
        )
        .await;
        match round {
            Ok(finished) => {
                if lost {
                    lost = false;
                    if !send(&tx, Msg::Connection(Ok(()))) {
                        return;
                    }
                }
                backoff = Duration::from_millis(250);
                if finished {
                    return;
                }
            }
            Err(e) => {
                lost = true;
                if !send(&tx, Msg::Connection(Err(e))) {
                    return;
                }
                // A pause before trying again, longer each time, bounded.
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(MAX_BACKOFF);
            }
        }
    }
}

/// One bounded watch and what follows from it. `Ok(true)`: the fork is resolved and
/// everything of it was sent.
async fn round(
    client: &Client,
    fork: ForkId,
    seen: &mut Option<u64>,
    next: &mut BTreeMap<RunId, u64>,
    changes_seen: &mut Option<Vec<usize>>,
    tx: &UnboundedSender<Msg>,
    chat: Option<&mut ChatDuty>,
) -> Result<bool, String> {
    let err = |e: forkfleet_client::ClientError| forkfleet_client::render::error_chain(&e);
    let watched = client.watch(fork, *seen, WATCH_WAIT).await.map_err(err)?;
    if *seen == Some(watched.version) {
        return Ok(false);
    }
    let view = watched.view;
    let cost = client.fork_cost(fork).await.ok();
    let mut grew = false;
    for b in &view.branches {
        let from = next.get(&b.run_id).copied().unwrap_or(0);
        if b.events <= from {
            continue;
        }
        let events = client.run_events(b.run_id).await.map_err(err)?;
        let new: Vec<LoggedEvent> = events.into_iter().filter(|e| e.seq >= from).collect();
        if let Some(last) = new.last() {
            next.insert(b.run_id, last.seq + 1);
            grew = true;
            if !send(
                tx,
                Msg::Events {
                    run: b.run_id,
                    events: new,
                },
            ) {
                return Ok(true);
            }
        }
    }
    let changes: Vec<usize> = view.branches.iter().map(|b| b.changes).collect();
    let resolved = view.state.is_resolved();
    let main = view.branch(SOLO_LABEL).cloned();
    if chat.is_none() && changes_seen.as_ref() != Some(&changes) && !view.branches.is_empty() {
        let report = client
            .diff(fork, DiffOptions::default())
            .await
            .map_err(err)?;
        *changes_seen = Some(changes);
        send(tx, Msg::Diff { fork, report });
    }
    if !send(tx, Msg::View { view, cost }) {
        return Ok(true);
    }
    *seen = Some(watched.version);
    if let (Some(duty), Some(main)) = (chat, main) {
        if grew {
            let mine: Vec<ForkView> = client
                .forks()
                .await
                .map_err(err)?
                .into_iter()
                .filter(|f| f.parent_run == main.run_id && !f.state.is_resolved())
                .collect();
            send(tx, Msg::AgentForks(mine));
        }
        if main.state.is_stopped() && main.events != duty.checked_at {
            duty.checked_at = main.events;
            let version = client.run_workspace(main.run_id).await.map_err(err)?;
            if version != duty.synced {
                let report = workspace::apply_version(
                    client.blobs().as_ref(),
                    &duty.synced,
                    &version,
                    &duty.dir,
                    duty.policy,
                )
                .await
                .map_err(err)?;
                duty.synced = version;
                send(tx, Msg::Synced { version, report });
            }
        }
        return Ok(false);
    }
    Ok(resolved)
}

/// Tell the UI when the bus's connection drops and comes back (a NATS client reconnects
/// by itself; the in-process bus never drops), looking every half second.
pub async fn watch_bus(client: Client, tx: UnboundedSender<Msg>) {
    let mut up = true;
    loop {
        let now = client.bus().connected();
        if now != up {
            up = now;
            if !send(&tx, Msg::Bus(now)) {
                return;
            }
        }
        if tx.is_closed() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Run `work` as a task of its own, sending what it returns (or its error) to the UI.
pub fn spawn<F>(tx: &UnboundedSender<Msg>, what: &'static str, work: F)
where
    F: std::future::Future<Output = anyhow::Result<Msg>> + Send + 'static,
{
    let tx = tx.clone();
    tokio::spawn(async move {
        let msg = match work.await {
            Ok(msg) => msg,
            Err(e) => Msg::Failed(format!(
                "{what}: {}",
                forkfleet_client::render::error_chain(&*e)
            )),
        };
        let _ = tx.send(msg);
    });
}
