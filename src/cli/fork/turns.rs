//! `fork steer` and `fork continue`: a user message to a running or a finished branch.

use super::*;

/// The label and message of `fork steer` and `fork continue`, checked before connecting.
pub(crate) fn check_turn_args(label: &str, message: &str) -> anyhow::Result<()> {
    spec::check_label(label).map_err(|e| BadInput(format!("LABEL: {e}")))?;
    if message.trim().is_empty() {
        return Err(BadInput("MESSAGE is empty; give the text to send the branch".into()).into());
    }
    Ok(())
}

pub(crate) async fn fork_steer(
    coord: &Client,
    fork: &str,
    label: &str,
    message: &str,
    timeout: Option<Duration>,
    json: bool,
) -> anyhow::Result<()> {
    let id = coord.find_fork(fork).await?;
    let outcome = coord.steer(id, label, message).await?;
    if json {
        print_json(&render::steer_json(&outcome))?;
    } else {
        print!("{}", render::steer_text(&outcome));
    }
    // Embedded, the steered branch runs in this process: until nothing runs.
    if !coord.is_remote() {
        forkdir::follow(coord, id, timeout, AT_ONCE, !json).await?;
    }
    Ok(())
}

/// Start a new turn of a finished branch; wait for it (embedded always, on a cluster with
/// `wait`) and show how it ended with its final text.
pub(crate) async fn fork_continue(
    coord: &Client,
    fork: &str,
    label: &str,
    message: &str,
    wait: bool,
    timeout: Option<Duration>,
    json: bool,
) -> anyhow::Result<()> {
    let id = coord.find_fork(fork).await?;
    let outcome = coord.continue_branch(id, label, message).await?;
    if !wait && coord.is_remote() {
        if json {
            return print_json(&render::continue_json(&outcome, None));
        }
        print!("{}", render::continue_text(&outcome));
        println!(
            "follow it with `forkfleet fork watch {id}{}`, or wait with `fork continue --wait`",
            coord.reach()
        );
        return Ok(());
    }
    if !json {
        print!("{}", render::continue_text(&outcome));
    }
    let view = if coord.is_remote() {
        wait_for_branch(coord, id, label, timeout).await?
    } else {
        // Embedded, the workers live in this process: the turn runs here to its end (the
        // fork directory follows it).
        forkdir::follow(coord, id, timeout, AT_ONCE, !json).await?
    };
    let Some(branch) = view.branch(label) else {
        return Err(anyhow::anyhow!(
            "fork {id} has no branch `{label}` any more"
        ));
    };
    let events = coord.run_events(outcome.run_id).await?;
    let text = events
        .iter()
        .filter(|e| e.seq > outcome.seq)
        .filter_map(|e| match &e.event {
            forkfleet_shared::event::Event::ModelResponse {
                text: Some(text), ..
            } => Some(text.as_str()),
            _ => None,
        })
        .next_back();
    let end = render::TurnEnd { branch, text };
    if json {
        print_json(&render::continue_json(&outcome, Some(&end)))?;
    } else {
        print!("{}", render::turn_end_text(&end));
    }
    if branch.state == forkfleet_shared::state::BranchState::Paused {
        let cost = coord.fork_cost(id).await.ok();
        return Err(Incomplete::Failed(
            render::paused_hint(
                id,
                &[label],
                view.branches.len(),
                cost.as_ref(),
                coord.reach(),
            )
            .trim_end()
            .to_string(),
        )
        .into());
    }
    // The turn ran but did not end well (failed, terminated, stopped by a cap).
    if branch.state != forkfleet_shared::state::BranchState::Done {
        return Err(Incomplete::Failed(format!(
            "the turn of branch `{label}` ended {}{}",
            branch.state,
            branch
                .error
                .as_deref()
                .map(|e| format!(": {e}"))
                .unwrap_or_default()
        ))
        .into());
    }
    Ok(())
}

/// Follow fork `id` until branch `label` has finished or paused (or the fork was merged or
/// aborted), giving up after `timeout`.
pub(crate) async fn wait_for_branch(
    coord: &Client,
    id: ForkId,
    label: &str,
    timeout: Option<Duration>,
) -> anyhow::Result<ForkView> {
    const ROUND: Duration = Duration::from_secs(10);
    let started = std::time::Instant::now();
    let mut seen = None;
    loop {
        let wait = timeout.map_or(ROUND, |t| t.saturating_sub(started.elapsed()).min(ROUND));
        let watched = coord.watch(id, seen, wait).await?;
        seen = Some(watched.version);
        let Some(b) = watched.view.branch(label) else {
            return Err(anyhow::anyhow!(
                "fork {id} has no branch `{label}` any more"
            ));
        };
        if b.state.is_stopped() || watched.view.state.is_resolved() {
            return Ok(watched.view);
        }
        if let Some(t) = timeout {
            if started.elapsed() >= t {
                return Err(anyhow::anyhow!(
                    "gave up waiting after {} s: branch `{label}` is {} (it keeps running; `forkfleet fork watch {id}{}`)",
                    t.as_secs(),
                    b.state,
                    coord.reach()
                ));
            }
        }
    }
}
