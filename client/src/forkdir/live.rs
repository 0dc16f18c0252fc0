//! Keeping a fork directory in step with a running fork.

use super::*;

/// Prints a warning, but not the same one twice in a row.
#[derive(Debug, Default)]
pub(crate) struct Warner {
    pub(crate) last: Option<String>,
}

impl Warner {
    pub(crate) fn warn(&mut self, e: &ClientError) {
        let msg = crate::render::error_chain(e);
        if self.last.as_deref() != Some(msg.as_str()) {
            crate::render::say(&format!(
                "warning: the fork directory is not up to date: {msg}"
            ));
            self.last = Some(msg);
        }
    }
}

/// What [`LiveSync`] tells its task.
#[derive(Debug, Clone)]
pub(crate) struct Signal {
    /// Versions of the fork notified so far.
    pub(crate) changes: u64,
    /// The latest of them.
    pub(crate) view: ForkView,
    pub(crate) closing: bool,
}

pub(crate) struct LiveInner {
    pub(crate) tx: watch::Sender<Signal>,
    pub(crate) task: JoinHandle<Option<SyncStats>>,
}

/// Keeps a fork directory in step with a running fork: [`LiveSync::notify`] with each new
/// version of the fork; a background task syncs at most once per [`LIVE_SYNC_EVERY`]
/// (versions in between are folded into one sync); [`LiveSync::finish`] makes the final
/// sync. Errors are warnings on stderr (each once), never failures.
pub struct LiveSync {
    pub(crate) inner: Option<LiveInner>,
}

impl LiveSync {
    /// Start for `view`'s fork. A fork without a workspace on this machine gets a disabled
    /// one (with a warning when it has a workspace that is not here).
    pub fn start(coord: &Client, view: &ForkView) -> Self {
        match (&view.workspace, locate(view)) {
            (None, _) => return Self { inner: None },
            (Some(_), Err(e)) => {
                crate::render::say(&format!(
                    "warning: no fork directory: {}",
                    crate::render::error_chain(&e)
                ));
                return Self { inner: None };
            }
            (Some(_), Ok(_)) => {}
        }
        let (tx, rx) = watch::channel(Signal {
            changes: 0,
            view: view.clone(),
            closing: false,
        });
        let task = tokio::spawn(live_loop(coord.clone(), rx, LIVE_SYNC_EVERY));
        Self {
            inner: Some(LiveInner { tx, task }),
        }
    }

    /// The fork changed to `view`: sync soon. Returns at once.
    pub fn notify(&self, view: &ForkView) {
        if let Some(inner) = &self.inner {
            inner.tx.send_modify(|s| {
                s.changes += 1;
                s.view = view.clone();
            });
        }
    }

    /// Sync the latest version at once unless the last sync had it, stop the background
    /// task, and answer the last sync's stats (none when it failed).
    pub async fn finish(self) -> Option<SyncStats> {
        let inner = self.inner?;
        inner.tx.send_modify(|s| s.closing = true);
        inner.task.await.ok().flatten()
    }
}

/// The task of a [`LiveSync`]: syncs the view notified last (the view is not read again),
/// at most once per `every`; once closing, syncs a last time when the latest version is
/// not synced (or its sync failed). Answers the last sync's stats.
pub(crate) async fn live_loop(
    coord: Client,
    mut rx: watch::Receiver<Signal>,
    every: Duration,
) -> Option<SyncStats> {
    let mut mat = Materializer::new();
    let mut warner = Warner::default();
    // The version synced last, and its outcome.
    let mut done = 0u64;
    let mut synced: Option<SyncStats> = None;
    let mut last: Option<tokio::time::Instant> = None;
    loop {
        let (changes, closing) = {
            let s = rx.borrow_and_update();
            (s.changes, s.closing)
        };
        let pending = changes != done || (closing && synced.is_none());
        if !pending {
            if closing || rx.changed().await.is_err() {
                return synced;
            }
            continue;
        }
        if let (false, Some(at)) = (closing, last) {
            let due = at + every;
            if tokio::time::Instant::now() < due {
                tokio::select! {
                    _ = tokio::time::sleep_until(due) => {}
                    r = rx.changed() => {
                        if r.is_err() {
                            return synced;
                        }
                        continue;
                    }
                }
            }
        }
        let (changes, view) = {
            let s = rx.borrow_and_update();
            (s.changes, s.view.clone())
        };
        done = changes;
        synced = match mat.sync(&coord, &view, false).await {
            Ok(s) => Some(s.stats),
            Err(e) => {
                warner.warn(&e);
                None
            }
        };
        if closing {
            return synced;
        }
        last = Some(tokio::time::Instant::now());
    }
}

/// [`crate::watch::follow`], keeping the fork directory in step as the fork changes: from the
/// first view `follow` sees, at most once per [`LIVE_SYNC_EVERY`], and once more at the
/// end unless the last sync had the latest view.
pub async fn follow(
    coord: &Client,
    fork: ForkId,
    timeout: Option<Duration>,
    until: Until,
    show: bool,
) -> Result<ForkView, ClientError> {
    let (view, dir) = follow_quietly(coord, fork, timeout, until, show).await?;
    if let (true, Some(dir)) = (show, dir) {
        announce(coord, fork, &dir);
    }
    Ok(view)
}

/// Say where the fork directory is, and how to open it.
pub fn announce(coord: &Client, fork: ForkId, dir: &Path) {
    crate::render::say(&format!(
        "fork directory: {} (`forkfleet fork open {fork}{}` opens it in a diff tool)",
        dir.display(),
        coord.reach()
    ));
}

/// [`follow`], without saying where the fork directory is: the directory (when a sync
/// made it) comes back with the view, for a caller that announces it only if it stays
/// (a run that merges at once does not). A merged fork whose plan does not keep its
/// directory is not synced: the merge removed it.
pub async fn follow_quietly(
    coord: &Client,
    fork: ForkId,
    timeout: Option<Duration>,
    until: Until,
    show: bool,
) -> Result<(ForkView, Option<PathBuf>), ClientError> {
    let mut live: Option<LiveSync> = None;
    let result = follow_with(coord, fork, timeout, until, show, &mut |view| {
        if removed_after_merge(view).is_none() {
            live.get_or_insert_with(|| LiveSync::start(coord, view))
                .notify(view);
        }
    })
    .await;
    let stats = match live {
        Some(live) => live.finish().await,
        None => None,
    };
    let view = result?;
    if removed_after_merge(&view).is_some() {
        // Merged by another client while this one watched: its last sync may have run
        // after that merge's cleanup, so clean up again.
        cleanup_after_merge(coord, view.fork_id).await;
        return Ok((view, None));
    }
    Ok((view, stats.map(|s| s.dir)))
}
