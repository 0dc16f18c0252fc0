//! The branch agent's requests to the coordinator: the branch's log when it takes a branch
//! over (`coord.resume`) and budget reservations in strict mode (`coord.budget`), each
//! tried again a few times with a growing backoff.

use crate::error::WorkerError;
use crate::lease::TaskLease;
use bytes::Bytes;
use forkfleet_bus::{Bus, BusError};
use forkfleet_shared::budget::{estimate_cost, BudgetReply, BudgetRequest, BUDGET_SUBJECT};
use forkfleet_shared::event::{Event, Usage};
use forkfleet_shared::ids::ReservationId;
use forkfleet_shared::protocol::{
    BranchTask, ResumeReply, ResumeRequest, TaskProof, RESUME_SUBJECT,
};
use forkfleet_shared::state::BranchState;
use forkfleet_shared::wire;
use std::sync::Arc;
use std::time::Duration;

/// How long one resume request may wait for the coordinator.
const RESUME_TIMEOUT: Duration = Duration::from_secs(15);

/// The coordinator's answer to a resume.
pub(super) enum Resumed {
    /// The branch's log as the coordinator has it, `(seq, event)` from the `fork` event.
    Log(Vec<(u64, Event)>),
    /// The fork or the branch is not known: nothing to resume.
    Gone(String),
    /// The coordinator refused the takeover (ADR 18): the task is not this worker's.
    Refused(String),
}

/// Ask the coordinator for the branch's log, fencing off earlier attempts; `proof` is the
/// delivery this worker holds (the coordinator refuses a resume it cannot check). A `retry`
/// answer, a timeout or a bus error is tried again (see [`ask_coordinator`]).
pub(super) async fn resume_log(
    bus: &Arc<dyn Bus>,
    lease: &TaskLease,
    task: &BranchTask,
    attempt: u32,
    proof: Option<TaskProof>,
) -> Result<Resumed, WorkerError> {
    let req = wire::encode(&ResumeRequest {
        fork_id: task.fork_id,
        run_id: task.run_id,
        attempt,
        task: proof,
    })?;
    let answer = ask_coordinator(
        bus,
        &mut Waits::lease(lease),
        RESUME_SUBJECT,
        req,
        RESUME_TIMEOUT,
        "branch log",
        |reply| match reply {
            ResumeReply::Log { events } => Ok(Ok(Resumed::Log(events))),
            // Too large for one message: in the blob store.
            ResumeReply::LogBlob { blob } => Ok(Err(blob)),
            ResumeReply::Gone { reason } => Ok(Ok(Resumed::Gone(reason))),
            ResumeReply::Retry { reason } => Err(reason),
            ResumeReply::Refused { reason } => Ok(Ok(Resumed::Refused(reason))),
        },
    )
    .await?;
    let blob = match answer {
        Some(Ok(resumed)) => return Ok(resumed),
        Some(Err(blob)) => blob,
        None => {
            return Err(WorkerError::Bus(BusError::Backend(
                "no branch log: handed back while waiting".into(),
            )))
        }
    };
    // A log too large for one message: the encoded answer is in the blob store.
    let bytes = forkfleet_shared::blob::fetch(bus.blobs().as_ref(), &blob)
        .await
        .map_err(BusError::from)?;
    match wire::decode::<ResumeReply>(&bytes)? {
        ResumeReply::Log { events } => Ok(Resumed::Log(events)),
        _ => Err(WorkerError::Bus(BusError::Backend(format!(
            "blob {blob} is not a branch's log"
        )))),
    }
}

/// How long one budget request may wait for the coordinator.
const BUDGET_TIMEOUT: Duration = Duration::from_secs(10);
/// Answers asking to try again later (the coordinator's store failed), or that do not
/// decode, tried before the task is handed back. An unreachable coordinator is not counted:
/// it is waited for (see [`ask_coordinator`]).
pub const COORDINATOR_TRIES: u32 = 5;
/// The wait after the first failed request to the coordinator; doubled after each, up to
/// [`COORDINATOR_BACKOFF_MAX`].
const COORDINATOR_BACKOFF: Duration = Duration::from_millis(100);
const COORDINATOR_BACKOFF_MAX: Duration = Duration::from_secs(2);
/// How often a worker waiting for an unreachable coordinator says so again.
const UNREACHABLE_LOG_EVERY: Duration = Duration::from_secs(30);

/// What ends a worker's waits for the coordinator: its task's lease lost, or a hand-back
/// (a drain, a shutdown, `--timeout-s`). A hand-back ends the pauses between requests,
/// never a request in flight (whose answer is acted on).
pub(super) struct Waits<'a> {
    lease: &'a TaskLease,
    handback: Option<tokio::sync::watch::Receiver<bool>>,
}

impl<'a> Waits<'a> {
    /// Waits that `lease` lost or a hand-back through `handback` end.
    pub(super) fn until(lease: &'a TaskLease, handback: &tokio::sync::watch::Sender<bool>) -> Self {
        Self {
            lease,
            handback: Some(handback.subscribe()),
        }
    }

    /// Waits that only `lease` lost ends (the caller watches for a hand-back itself).
    pub(super) fn lease(lease: &'a TaskLease) -> Self {
        Self {
            lease,
            handback: None,
        }
    }

    /// Sleep `d`; false when handed back first.
    async fn sleep(&mut self, d: Duration) -> bool {
        let Some(rx) = self.handback.as_mut() else {
            tokio::time::sleep(d).await;
            return true;
        };
        tokio::select! {
            _ = tokio::time::sleep(d) => true,
            _ = rx.wait_for(|back| *back) => false,
        }
    }
}

/// Ask the coordinator: send `req` on `subject`, decode the reply and `classify` it (`Ok`:
/// the answer; `Err(reason)`: a reply asking to try again later). A retry reply or an
/// undecodable one is tried again, up to [`COORDINATOR_TRIES`] times with a growing
/// backoff, then becomes an error (the task is handed back). A coordinator that does not
/// answer (none serving, a timeout, the bus unreachable) is waited out: asked again with a
/// backoff up to [`COORDINATOR_BACKOFF_MAX`] for as long as the lease holds (its extensions
/// go to the queue, not to the coordinator), so an outage burns no delivery of the task;
/// once the lease is lost the wait ends in an error, and a hand-back (`waits`) ends it
/// with `None`. `what` names the answer in logs and errors.
async fn ask_coordinator<R: wire::WireMessage, T>(
    bus: &Arc<dyn Bus>,
    waits: &mut Waits<'_>,
    subject: &str,
    req: Bytes,
    timeout: Duration,
    what: &str,
    classify: impl Fn(R) -> Result<T, String>,
) -> Result<Option<T>, WorkerError> {
    let mut backoff = COORDINATOR_BACKOFF;
    let mut tried = 0;
    let mut unreachable_since: Option<std::time::Instant> = None;
    let mut said_at: Option<std::time::Instant> = None;
    loop {
        let last = match bus.request(subject, req.clone(), timeout).await {
            Ok(bytes) => match wire::decode::<R>(&bytes) {
                Ok(reply) => match classify(reply) {
                    Ok(answer) => {
                        if let Some(since) = unreachable_since {
                            tracing::info!(
                                waited_ms = since.elapsed().as_millis() as u64,
                                "the coordinator answers again"
                            );
                        }
                        return Ok(Some(answer));
                    }
                    Err(reason) => reason,
                },
                Err(e) => format!("undecodable reply: {e}"),
            },
            Err(BusError::Closed) => return Err(WorkerError::Bus(BusError::Closed)),
            Err(e) => {
                // Unreachable: waited out while the lease holds.
                if let Err(lost) = waits.lease.check() {
                    return Err(WorkerError::Bus(BusError::Backend(format!(
                        "no {what}: the coordinator is unreachable ({e}) and the task's lease is lost ({lost})"
                    ))));
                }
                let since = *unreachable_since.get_or_insert_with(std::time::Instant::now);
                if said_at.is_none_or(|at| at.elapsed() >= UNREACHABLE_LOG_EVERY) {
                    said_at = Some(std::time::Instant::now());
                    tracing::warn!(
                        error = %e,
                        waited_ms = since.elapsed().as_millis() as u64,
                        "the coordinator is unreachable: waiting for it (the task's lease is kept)"
                    );
                }
                if !waits.sleep(backoff).await {
                    return Ok(None);
                }
                backoff = (backoff * 2).min(COORDINATOR_BACKOFF_MAX);
                continue;
            }
        };
        tried += 1;
        tracing::warn!(tried, error = %last, "no {what} from the coordinator yet");
        if tried >= COORDINATOR_TRIES {
            return Err(WorkerError::Bus(BusError::Backend(format!(
                "no {what} after {COORDINATOR_TRIES} tries: {last}"
            ))));
        }
        if !waits.sleep(backoff).await {
            return Ok(None);
        }
        backoff = (backoff * 2).min(COORDINATOR_BACKOFF_MAX);
    }
}

/// The coordinator's answer to a reservation.
pub(super) enum Reserved {
    /// Granted: the reservation, and the USD it holds when that is less than the
    /// estimate (the call's output cap must fit it).
    Granted(ReservationId, Option<f64>),
    Refused {
        state: BranchState,
        reason: String,
    },
    Gone(String),
    /// Task attempt `by` took the branch over.
    Superseded(u32),
    /// The worker handed its task back while waiting (for room, or for a coordinator that
    /// is away): no reservation is held.
    HandedBack,
}

/// The first wait after a `wait` answer (room held by other calls); doubled after each,
/// up to [`ROOM_WAIT_MAX`].
const ROOM_WAIT: Duration = Duration::from_millis(50);
const ROOM_WAIT_MAX: Duration = Duration::from_secs(1);

/// Reserve the upper bound `estimate` of the next call's cost (strict mode), or at least
/// `least` of it (what the branch's calls say it needs: the ledger may grant the room a
/// cap has left). A `retry` answer, a timeout or a bus error is tried again (see
/// [`ask_coordinator`]); a `wait` answer (other calls hold the room) is asked again until
/// it changes, which the calls' settling or their reservations' expiry bounds.
pub(super) async fn reserve(
    bus: &Arc<dyn Bus>,
    mut waits: Waits<'_>,
    task: &BranchTask,
    attempt: u32,
    estimate: Usage,
    least: Usage,
    settles: Option<forkfleet_shared::budget::Settle>,
) -> Result<Reserved, WorkerError> {
    let estimate_usd = task.price.map_or(0.0, |p| estimate_cost(&p, &estimate));
    let least_usd = task.price.map_or(0.0, |p| estimate_cost(&p, &least));
    let req = wire::encode(&BudgetRequest {
        fork_id: task.fork_id,
        run_id: task.run_id,
        attempt,
        estimate_usd,
        estimate,
        // The bus request carries the turn's trace context as a header: not computed twice.
        trace: None,
        settles,
        least_usd: Some(least_usd.min(estimate_usd)),
    })?;
    let mut wait = ROOM_WAIT;
    loop {
        let reserved = ask_coordinator(
            bus,
            &mut waits,
            BUDGET_SUBJECT,
            req.clone(),
            BUDGET_TIMEOUT,
            "budget reservation",
            |reply| match reply {
                BudgetReply::Granted { reservation } => {
                    Ok(Some(Reserved::Granted(reservation, None)))
                }
                BudgetReply::Partial { reservation, usd } => {
                    Ok(Some(Reserved::Granted(reservation, Some(usd))))
                }
                BudgetReply::Refused { state, reason } => {
                    Ok(Some(Reserved::Refused { state, reason }))
                }
                BudgetReply::Gone { reason } => Ok(Some(Reserved::Gone(reason))),
                BudgetReply::Superseded { by } => Ok(Some(Reserved::Superseded(by))),
                BudgetReply::Wait { reason } => {
                    tracing::debug!(reason = %reason, "budget: waiting for room");
                    Ok(None)
                }
                BudgetReply::Retry { reason } => Err(reason),
            },
        )
        .await?;
        let Some(reserved) = reserved else {
            return Ok(Reserved::HandedBack);
        };
        match reserved {
            Some(reserved) => {
                if let Reserved::Granted(reservation, usd) = &reserved {
                    tracing::debug!(reservation = %reservation, estimate_usd, granted_usd = usd.unwrap_or(estimate_usd), "budget reserved");
                }
                return Ok(reserved);
            }
            None => {
                if let Err(lost) = waits.lease.check() {
                    return Err(WorkerError::Bus(BusError::Backend(format!(
                        "waiting for room under a budget cap, the task's lease was lost ({lost})"
                    ))));
                }
                if !waits.sleep(wait).await {
                    return Ok(Reserved::HandedBack);
                }
                wait = (wait * 2).min(ROOM_WAIT_MAX);
            }
        }
    }
}
