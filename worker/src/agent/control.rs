//! Control commands (steer, terminate, stop, pause) as the agent reads them: decoded,
//! filed for the next turn or acted on at once, and raced against the work in flight.

use super::{Pending, Step};
use bytes::Bytes;
use forkfleet_shared::budget::OnExhausted;
use forkfleet_shared::ids::RunId;
use forkfleet_shared::protocol::{Control, ControlCommand};
use forkfleet_shared::state::BranchState;
use forkfleet_shared::wire;
use std::future::Future;
use tokio::sync::mpsc;

impl Pending {
    /// File the control message `bytes` (see [`command`]): a steer or a graceful stop is
    /// kept here (the first graceful stop is the one kept); a command that stops the branch
    /// now is returned.
    pub(super) fn file(&mut self, bytes: &Bytes, run_id: RunId, attempt: u32) -> Option<Step> {
        match command(bytes, run_id, attempt)? {
            Command::Steer(text) => self.steers.push(text),
            Command::Superseded(by) => {
                if by > attempt {
                    self.lease.lose(super::superseded(by, attempt));
                }
            }
            Command::HaltAfterCall(step) => {
                self.halt.get_or_insert(step);
            }
            Command::Halt(step) => return Some(step),
        }
        None
    }
}

/// What a control command asks of the branch.
enum Command {
    Steer(String),
    /// Stop now (terminate, stop for budget, pause), cancelling a call in flight.
    Halt(Step),
    /// Stop (or pause) once the call in flight, if any, is recorded.
    HaltAfterCall(Step),
    /// Attempt `by` took the branch over: the lease is lost (the call in flight finishes
    /// and its usage is published, then the branch stops unsettled).
    Superseded(u32),
}

/// Decode a control message for `run_id` and task attempt `attempt`; `None` (logged) when
/// it is not one, or is meant for an earlier attempt of the branch (the coordinator
/// addresses every command to the attempt that runs the branch, so a later attempt, or a
/// later turn's worker re-reading the run's control stream on NATS, ignores it).
fn command(bytes: &Bytes, run_id: RunId, attempt: u32) -> Option<Command> {
    match wire::decode::<Control>(bytes) {
        Ok(c) if c.run_id != run_id => {
            tracing::warn!(control.run_id = %c.run_id, "control message for another run dropped");
            None
        }
        Ok(Control {
            attempt: Some(for_attempt),
            ..
        }) if for_attempt < attempt => {
            tracing::debug!(
                for_attempt,
                attempt,
                "control message for an earlier attempt ignored"
            );
            None
        }
        Ok(Control { command, .. }) => Some(match command {
            ControlCommand::Steer { text } => Command::Steer(text),
            ControlCommand::Superseded { by } => Command::Superseded(by),
            ControlCommand::Terminate { reason } => {
                tracing::info!(reason = %reason, "branch terminated by control command");
                let reason = (!reason.is_empty()).then_some(reason);
                Command::Halt(Step::Finish(BranchState::Terminated, reason))
            }
            ControlCommand::Stop {
                state,
                reason,
                graceful,
            } => {
                tracing::info!(reason = %reason, branch.state = %state, graceful, "branch stopped by control command");
                let step = stopped(state, reason);
                if graceful {
                    Command::HaltAfterCall(step)
                } else {
                    Command::Halt(step)
                }
            }
            ControlCommand::Pause { reason, graceful } => {
                tracing::info!(reason = %reason, graceful, "branch paused by control command");
                let step = Step::Finish(BranchState::Paused, Some(reason));
                if graceful {
                    Command::HaltAfterCall(step)
                } else {
                    Command::Halt(step)
                }
            }
        }),
        Err(e) => {
            tracing::warn!(error = %e, "undecodable control message dropped");
            None
        }
    }
}

/// The step that ends a branch as `state` (a terminal state, or paused) for `reason`. A
/// state a branch cannot end in (pending, running) ends it as terminated.
fn stopped(state: BranchState, reason: String) -> Step {
    if state.is_stopped() {
        Step::Finish(state, Some(reason))
    } else {
        tracing::warn!(branch.state = %state, "asked to stop in a non-final state; terminating");
        Step::Finish(BranchState::Terminated, Some(reason))
    }
}

/// A budget cap has no room for the next call: stop as `state`, or pause.
pub(super) fn exhausted(on_exhausted: OnExhausted, state: BranchState, reason: String) -> Step {
    match on_exhausted {
        OnExhausted::Pause => Step::Finish(BranchState::Paused, Some(reason)),
        OnExhausted::Stop => stopped(state, reason),
    }
}

/// Run `work` unless a command that stops the branch arrives first (then `work` is dropped,
/// which cancels it, and the step the command asks for is returned). Steers and graceful
/// stops that arrive meanwhile are left in `pending` for the next turn. Work that is done
/// wins over a command that arrived at the same time: its result is kept, and the command
/// is read before the next call.
pub(super) async fn until_halted<F: Future>(
    work: F,
    control: &mut Option<mpsc::UnboundedReceiver<Bytes>>,
    run_id: RunId,
    attempt: u32,
    pending: &mut Pending,
    handback: Option<&tokio::sync::watch::Sender<bool>>,
) -> Result<F::Output, Step> {
    // A hand-back cuts model calls and tools short; a request to the coordinator finishes,
    // so its answer is acted on (its waits between requests end on a hand-back themselves).
    let mut handed_back = handback.map(|h| h.subscribe());
    let mut no_control = None;
    let (rx, mut open) = match control.as_mut() {
        Some(rx) => (rx, true),
        None => (
            no_control.get_or_insert_with(|| mpsc::unbounded_channel().1),
            false,
        ),
    };
    tokio::pin!(work);
    loop {
        tokio::select! {
            biased;
            out = &mut work => return Ok(out),
            Some(()) = async { handed_back.as_mut()?.wait_for(|back| *back).await.ok().map(|_| ()) } => return Err(Step::HandBack),
            msg = rx.recv(), if open => match msg {
                None => open = false,
                Some(bytes) => {
                    if let Some(step) = pending.file(&bytes, run_id, attempt) {
                        return Err(step);
                    }
                }
            },
        }
    }
}
