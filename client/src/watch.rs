//! Following a fork while it runs: one bounded `watch` per round (the view once it
//! changes), progress on stderr (redrawn in place on a terminal, a line per state change
//! otherwise), a coordinator that does not answer retried for a while.

use crate::client::Client;
use crate::error::ClientError;
use crate::render::{approvals_hint, awaiting_labels, label_width, paused_hint, paused_labels};
use forkfleet_shared::api::ForkView;
use forkfleet_shared::ids::ForkId;
use forkfleet_shared::state::BranchState;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

/// Above this many branches, progress is one aggregate line instead of a line per branch.
const MAX_PROGRESS_LINES: usize = 20;
/// The fastest the progress display redraws.
const REDRAW_EVERY: Duration = Duration::from_millis(100);
/// The fastest a watch that shows nothing asks again (bounding the views a fast-changing
/// large fork sends; the fork's end is seen at most this late).
const QUIET_EVERY: Duration = Duration::from_millis(20);
/// How long one watch round waits for a change on a terminal (the clock redraws).
const TTY_POLL: Duration = Duration::from_secs(1);
/// How long one watch round waits for a change otherwise.
const LOG_POLL: Duration = Duration::from_secs(5);
/// How long `follow` keeps retrying a coordinator that does not answer.
const RETRY_FOR: Duration = Duration::from_secs(60);
/// The pause between those retries.
const RETRY_PAUSE: Duration = Duration::from_millis(500);

/// When [`follow`] stops (besides the fork being merged or aborted, or the timeout).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Until {
    /// Every branch has finished. Branches paused by a budget cap are waited for (a top-up
    /// from another client resumes them); the wait says so once.
    Finished,
    /// Nothing runs: every branch has finished, is paused or waits for approval. A fork
    /// seen quiet with such branches must stay so for `grace` (resumed branches are still
    /// `paused` until a worker picks them up); with zero grace it stops at once.
    Quiet { grace: Duration },
    /// As [`Until::Finished`], but stop once nothing runs and a branch waits for approval
    /// (`fork watch` on a terminal then asks the person for the answer).
    Asking,
}

/// Follow a fork until `until` (or the fork is merged or aborted), showing progress on
/// stderr when `show`. On a terminal the lines redraw in place; otherwise a line is
/// printed per state change. Works the same against an embedded or a remote coordinator:
/// each round is one bounded `watch` (the view once it changes). A coordinator that does
/// not answer (restarting, NATS reconnecting) is retried for up to a minute.
pub async fn follow(
    coord: &Client,
    fork: ForkId,
    timeout: Option<Duration>,
    until: Until,
    show: bool,
) -> Result<ForkView, ClientError> {
    follow_with(coord, fork, timeout, until, show, &mut |_| {}).await
}

/// [`follow`], calling `on_version` with the view each time the fork's watch version
/// changes (the first view included). The hook runs inside the loop: it must return at
/// once (hand slow work to a task, as `forkdir::LiveSync` does).
pub async fn follow_with(
    coord: &Client,
    fork: ForkId,
    timeout: Option<Duration>,
    until: Until,
    show: bool,
    on_version: &mut (dyn FnMut(&ForkView) + Send),
) -> Result<ForkView, ClientError> {
    let started = Instant::now();
    // Redrawn in place on a terminal, unless log lines are JSON (each change a log line).
    let tty = show && std::io::stderr().is_terminal() && !crate::render::json_logs();
    // A terminal redraws the elapsed time every second; a log only needs the changes.
    let poll = if tty { TTY_POLL } else { LOG_POLL };
    let mut drawn_lines = 0usize;
    let mut last_states: BTreeMap<String, BranchState> = BTreeMap::new();
    let mut seen = None;
    let mut failing_since: Option<Instant> = None;
    // Since when the fork has been quiet with paused branches.
    let mut paused_since: Option<Instant> = None;
    let mut hinted = false;
    loop {
        let mut wait = match timeout {
            Some(t) => t.saturating_sub(started.elapsed()).min(poll),
            None => poll,
        };
        if let (Until::Quiet { grace }, Some(since)) = (until, paused_since) {
            wait = wait.min(grace.saturating_sub(since.elapsed()));
        }
        // Rate-limit rounds: at most one per REDRAW_EVERY when showing progress, one per
        // QUIET_EVERY otherwise.
        let next = tokio::time::sleep(if show { REDRAW_EVERY } else { QUIET_EVERY });
        let watched = match coord.watch(fork, seen, wait).await {
            Ok(w) => {
                failing_since = None;
                w
            }
            // A coordinator restarting, or NATS reconnecting: keep trying for a while.
            Err(e) if !e.is_bad_input() => {
                let since = *failing_since.get_or_insert_with(Instant::now);
                let out_of_time = timeout.is_some_and(|t| started.elapsed() >= t);
                if since.elapsed() >= RETRY_FOR || out_of_time {
                    return Err(e);
                }
                if show && since.elapsed() < RETRY_PAUSE {
                    crate::render::say(&format!(
                        "  (the coordinator does not answer: {e}; retrying)"
                    ));
                }
                tokio::time::sleep(RETRY_PAUSE).await;
                continue;
            }
            Err(e) => return Err(e),
        };
        if seen != Some(watched.version) {
            on_version(&watched.view);
        }
        seen = Some(watched.version);
        let view = watched.view;
        if show {
            if tty {
                drawn_lines = redraw(&view, drawn_lines, started.elapsed());
            } else {
                print_state_changes(&view, &mut last_states);
            }
        }
        if view.settled() || view.state.is_resolved() {
            return Ok(view);
        }
        let paused = paused_labels(&view);
        let asking = !awaiting_labels(&view).is_empty();
        if view.quiet() && (!paused.is_empty() || asking) {
            let since = *paused_since.get_or_insert_with(Instant::now);
            match until {
                Until::Quiet { grace } if since.elapsed() >= grace => return Ok(view),
                Until::Quiet { .. } => {}
                Until::Asking if asking => return Ok(view),
                Until::Finished | Until::Asking => {
                    if show && !hinted {
                        if asking {
                            crate::render::say(
                                format!(
                                    "  waiting for approval: {}",
                                    approvals_hint(&view, coord.reach())
                                )
                                .trim_end(),
                            );
                        }
                        if !paused.is_empty() {
                            crate::render::say(
                                format!(
                                    "  waiting for a top-up: {}",
                                    paused_hint(
                                        fork,
                                        &paused,
                                        view.branches.len(),
                                        None,
                                        coord.reach()
                                    )
                                )
                                .trim_end(),
                            );
                        }
                        drawn_lines = 0;
                    }
                    hinted = true;
                }
            }
        } else {
            paused_since = None;
            hinted = false;
        }
        if let Some(t) = timeout {
            if started.elapsed() >= t {
                return Err(gave_up(coord, &view, t));
            }
        }
        next.await;
    }
}

fn redraw(view: &ForkView, previous: usize, elapsed: Duration) -> usize {
    let mut out = String::new();
    if previous > 0 {
        let _ = write!(out, "\x1b[{previous}A");
    }
    let lines = progress_lines(view, elapsed);
    for l in &lines {
        let _ = writeln!(out, "\x1b[2K{l}");
    }
    let mut err = std::io::stderr().lock();
    let _ = err.write_all(out.as_bytes());
    let _ = err.flush();
    lines.len()
}

/// The progress block: a line per branch, or one aggregate line for many branches.
pub fn progress_lines(view: &ForkView, elapsed: Duration) -> Vec<String> {
    let mut lines = Vec::new();
    if view.branches.len() <= MAX_PROGRESS_LINES {
        let width = label_width(view);
        for b in &view.branches {
            lines.push(format!(
                "  {:<width$}  {:<26}  turns {:>3}  ${:.6}{}",
                b.label,
                b.state.as_str(),
                b.turns,
                b.cost_usd,
                b.last_message_preview
                    .as_deref()
                    .map(|p| format!("  {}", crate::render::one_line(p, 48)))
                    .unwrap_or_default()
            ));
        }
    }
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    for b in &view.branches {
        *counts.entry(b.state.as_str()).or_default() += 1;
    }
    let states: Vec<String> = counts.iter().map(|(s, n)| format!("{n} {s}")).collect();
    let turns: u64 = view.branches.iter().map(|b| b.turns as u64).sum();
    lines.push(format!(
        "  [{:.1}s] {} · {} turns · ${:.6}",
        elapsed.as_secs_f64(),
        states.join(", "),
        turns,
        view.total_cost_usd()
    ));
    lines
}

fn print_state_changes(view: &ForkView, last: &mut BTreeMap<String, BranchState>) {
    if crate::render::json_logs() {
        // Each change a log line with its figures as fields.
        for b in &view.branches {
            if last.get(&b.label) != Some(&b.state) {
                tracing::info!(
                    target: "forkfleet::progress",
                    fork_id = %view.fork_id,
                    label = %b.label,
                    state = %b.state,
                    turns = b.turns,
                    cost_usd = b.cost_usd,
                    "branch {}: {}",
                    b.label,
                    b.state
                );
                last.insert(b.label.clone(), b.state);
            }
        }
        return;
    }
    let mut err = std::io::stderr().lock();
    for b in &view.branches {
        if last.get(&b.label) != Some(&b.state) {
            if view.branches.len() <= MAX_PROGRESS_LINES {
                // A finished branch's answer, shortened.
                let answer = b
                    .last_message_preview
                    .as_deref()
                    .filter(|_| b.state.is_terminal())
                    .map(|p| format!(": {}", crate::render::one_line(p, 80)))
                    .unwrap_or_default();
                let _ = writeln!(
                    err,
                    "  {}: {} (turns {}, ${:.6}){answer}",
                    b.label, b.state, b.turns, b.cost_usd
                );
            }
            last.insert(b.label.clone(), b.state);
        }
    }
    if view.branches.len() > MAX_PROGRESS_LINES && view.settled() {
        let _ = writeln!(err, "  all {} branches settled", view.branches.len());
    }
}

/// Follow the logs of a fork's branches (every one, or the one labelled `only`), calling
/// `each` with every event as it lands (from seq 0: the events already logged first),
/// until the branches followed have stopped (finished, paused, waiting for approval) or
/// the fork is merged or aborted; `timeout` bounds it. Each round is one bounded `watch`
/// (the view once it changes), then the logs of the branches that grew: the same on an
/// embedded or a remote coordinator. The answer is the last view.
pub async fn follow_events(
    coord: &Client,
    fork: ForkId,
    only: Option<&str>,
    timeout: Option<Duration>,
    each: &mut (dyn FnMut(&str, &forkfleet_shared::api::LoggedEvent) + Send),
) -> Result<ForkView, ClientError> {
    use forkfleet_shared::api::ApiClient;
    let started = Instant::now();
    let mut next: BTreeMap<forkfleet_shared::ids::RunId, u64> = BTreeMap::new();
    let mut seen = None;
    loop {
        let wait = match timeout {
            Some(t) => t.saturating_sub(started.elapsed()).min(LOG_POLL),
            None => LOG_POLL,
        };
        let watched = coord.watch(fork, seen, wait).await?;
        seen = Some(watched.version);
        let view = watched.view;
        let followed: Vec<&forkfleet_shared::api::BranchView> = view
            .branches
            .iter()
            .filter(|b| only.is_none_or(|l| l == b.label))
            .collect();
        if followed.is_empty() {
            return Err(crate::render::no_branch(&view, only.unwrap_or_default()));
        }
        for b in &followed {
            let from = next.get(&b.run_id).copied().unwrap_or(0);
            if b.events <= from {
                continue;
            }
            let events = coord.run_events(b.run_id).await?;
            for e in events.iter().filter(|e| e.seq >= from) {
                each(&b.label, e);
            }
            if let Some(last) = events.last() {
                next.insert(b.run_id, last.seq + 1);
            }
        }
        // Stopped, and every event of it shown (a view may be newer than the log read).
        let done = followed
            .iter()
            .all(|b| b.state.is_stopped() && next.get(&b.run_id).copied().unwrap_or(0) >= b.events);
        if view.state.is_resolved() || done {
            return Ok(view);
        }
        if let Some(t) = timeout {
            if started.elapsed() >= t {
                return Err(gave_up(coord, &view, t));
            }
        }
    }
}

/// The error of a follow that gave up after `t` with the fork as `view` says.
fn gave_up(coord: &Client, view: &ForkView, t: Duration) -> ClientError {
    ClientError::GaveUp {
        fork: view.fork_id,
        after_s: t.as_secs(),
        finished: view
            .branches
            .iter()
            .filter(|b| b.state.is_terminal())
            .count(),
        total: view.branches.len(),
        paused: paused_labels(view).len(),
        reach: coord.reach().to_string(),
    }
}
