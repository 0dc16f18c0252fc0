//! Handing a branch over to the worker that took its task after another worker was lost.
//!
//! A task is delivered again when its worker stopped heartbeating (killed, partitioned,
//! out of memory). The new worker asks, on [`RESUME_SUBJECT`], for the branch's log; the
//! fork actor first *fences* the branch at the new attempt (events of earlier attempts are
//! dropped from then on, so a worker presumed dead cannot interleave with its successor),
//! then answers with the log as stored. The worker continues at the next seq.
//!
//! A resume request is accepted only from the worker holding the branch's task (ADR 18): it
//! carries the delivery's proof ([`TaskProof`]: the task's queue position and delivery
//! count), and the task at that position must still be queued or held, be this branch's,
//! and `attempt_base + delivered` must be the request's attempt, with `delivered` within
//! the queue's `max_deliver`. Anything else (a forged request, one without a proof, a late
//! one from a delivery an acked task outlived) is refused with a WARN log, and nothing is
//! fenced. So is a takeover by an attempt below the branch's fence.
//!
//! A delivery past `max_deliver` (the queue delivers a task until it is acked) makes the
//! task dead: its worker is answered `Gone` and drops it. When its deliveries made a turn,
//! or a disruption (the bus's connection lost or back, a pull that missed the server's
//! heartbeats, this coordinator starting) came after it was queued, they were not workers
//! lost on the branch: it is queued again as a new task. Otherwise its branch is failed
//! with an error that says so (its partial work stays mergeable). See ADR 38.

use crate::error::CoordinatorError;
use crate::root::RootHandle;
use forkfleet_bus::{Bus, Request};
use forkfleet_shared::protocol::{
    BranchTask, ResumeReply, ResumeRequest, TaskProof, RESUME_SUBJECT,
};
use forkfleet_shared::wire;
use std::sync::Arc;
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// Serve resume requests until `stop` turns true.
/// Tasks are read from `pool`'s queue to check a request's proof.
pub(crate) async fn start(
    bus: &Arc<dyn Bus>,
    pool: &str,
    root: RootHandle,
    stop: watch::Receiver<bool>,
) -> Result<JoinHandle<()>, CoordinatorError> {
    let (tasks, pool) = (bus.clone(), pool.to_string());
    // Deliveries of a task queued before this coordinator served were lost while none did.
    let started_ms = forkfleet_shared::protocol::now_ms();
    crate::serve::serve(bus, RESUME_SUBJECT, stop, move |req| {
        answer(tasks.clone(), pool.clone(), root.clone(), started_ms, req)
    })
    .await
}

async fn answer(bus: Arc<dyn Bus>, pool: String, root: RootHandle, started_ms: u64, req: Request) {
    let reply = match wire::decode::<ResumeRequest>(&req.payload) {
        Ok(r) => resume(bus.as_ref(), &pool, &root, started_ms, &r).await,
        Err(e) => {
            tracing::error!(error = %e, "coordinator.resume: malformed request");
            ResumeReply::Retry {
                reason: format!("malformed resume request: {e}"),
            }
        }
    };
    match wire::encode(&reply) {
        Ok(bytes) => {
            let bytes = match through_blob(bus.as_ref(), bytes).await {
                Ok(bytes) => bytes,
                Err(e) => {
                    tracing::error!(error = %e, "coordinator.resume: the branch's log is larger than the bus carries and cannot be stored as a blob");
                    // Answered, so the worker's bounded tries apply (no answer would read
                    // as a coordinator away, waited for as long as its lease holds).
                    let retry = ResumeReply::Retry {
                        reason: format!("the branch's log could not be stored for the worker: {e}"),
                    };
                    match wire::encode(&retry) {
                        Ok(b) => b,
                        Err(_) => return,
                    }
                }
            };
            if let Err(e) = req.respond(bytes).await {
                tracing::warn!(error = %e, "coordinator.resume: could not answer");
            }
        }
        Err(e) => tracing::error!(error = %e, "coordinator.resume: cannot encode the answer"),
    }
}

/// An answer too large for one message (a long branch's log) goes into the blob store, and
/// the answer names it instead: past [`MAX_INLINE_BYTES`], as the API's replies do.
async fn through_blob(
    bus: &dyn Bus,
    bytes: bytes::Bytes,
) -> Result<bytes::Bytes, CoordinatorError> {
    if bytes.len() <= forkfleet_shared::api::MAX_INLINE_BYTES {
        return Ok(bytes);
    }
    let blob = forkfleet_shared::blob::BlobHash::of(&bytes);
    let size = bytes.len();
    bus.blobs()
        .put(blob, bytes)
        .await
        .map_err(forkfleet_bus::BusError::from)?;
    tracing::info!(bytes = size, blob = %blob, "coordinator.resume: the branch's log goes as a blob (larger than the bus carries)");
    Ok(wire::encode(&ResumeReply::LogBlob { blob })?)
}

/// Why a resume request is not acted on.
#[derive(Debug, PartialEq)]
pub(crate) enum Refusal {
    /// It does not come from the worker holding the branch's task.
    Refused(String),
    /// The queue could not be read: the worker asks again.
    Retry(String),
    /// It comes from the worker holding the task, under a delivery past `max_deliver`:
    /// the task is dead (ADR 38).
    Dead(Box<BranchTask>),
}

/// Check that `r` comes from the worker holding the branch's current task (see the module
/// doc); the answer is the task's queue position.
pub(crate) async fn check_proof(
    bus: &dyn Bus,
    pool: &str,
    r: &ResumeRequest,
) -> Result<u64, Refusal> {
    let Some(TaskProof { seq, delivered }) = r.task else {
        return Err(Refusal::Refused(
            "the request carries no delivery proof (the task's queue position and delivery count)"
                .into(),
        ));
    };
    if delivered == 0 {
        return Err(Refusal::Refused(
            "delivery count 0: deliveries count from 1".into(),
        ));
    }
    let payload = match bus.queued_task(pool, seq).await {
        Ok(Some(p)) => p,
        Ok(None) => {
            return Err(Refusal::Refused(format!(
                "task {seq} of pool `{pool}` is not queued (acked, or never enqueued)"
            )))
        }
        Err(e) => return Err(Refusal::Retry(format!("cannot read task {seq}: {e}"))),
    };
    let task = wire::decode::<BranchTask>(&payload)
        .map_err(|e| Refusal::Refused(format!("task {seq} is not a branch task: {e}")))?;
    if task.fork_id != r.fork_id || task.run_id != r.run_id {
        return Err(Refusal::Refused(format!(
            "task {seq} runs branch {} of fork {}, not the one named",
            task.run_id, task.fork_id
        )));
    }
    let expected = task.attempt_base.saturating_add(delivered);
    if expected != r.attempt {
        return Err(Refusal::Refused(format!(
            "attempt {} is not task {seq}'s attempt_base {} plus its delivery count {delivered}",
            r.attempt, task.attempt_base
        )));
    }
    if delivered > bus.max_deliver() {
        return Err(Refusal::Dead(Box::new(task)));
    }
    Ok(seq)
}

async fn resume(
    bus: &dyn Bus,
    pool: &str,
    root: &RootHandle,
    started_ms: u64,
    r: &ResumeRequest,
) -> ResumeReply {
    // The task's queue position, or the task when the delivery is past `max_deliver`.
    let proof = match check_proof(bus, pool, r).await {
        Ok(seq) => Ok(seq),
        Err(Refusal::Dead(task)) => Err(task),
        Err(Refusal::Refused(reason)) => {
            tracing::warn!(fork.id = %r.fork_id, run.id = %r.run_id, attempt = r.attempt, reason = %reason, "coordinator.resume: refused, nothing fenced: the request does not come from the worker holding the branch's task");
            return ResumeReply::Refused { reason };
        }
        Err(Refusal::Retry(reason)) => return ResumeReply::Retry { reason },
    };
    let fork = match root.lookup(r.fork_id).await {
        Ok(Some(f)) => f,
        Ok(None) => {
            return ResumeReply::Gone {
                reason: format!("fork {} is not known to the coordinator", r.fork_id),
            }
        }
        Err(e) => {
            return ResumeReply::Retry {
                reason: e.to_string(),
            }
        }
    };
    let seq = match proof {
        Ok(seq) => seq,
        Err(task) => return dead_task(bus, pool, &fork, started_ms, &task).await,
    };
    match fork.fence(r.run_id, r.attempt, pool.to_string(), seq).await {
        Ok(events) => ResumeReply::Log { events },
        Err(CoordinatorError::Superseded { attempt, fence }) => {
            let reason = format!(
                "task attempt {attempt} is below the branch's fence: attempt {fence} took it over"
            );
            tracing::warn!(fork.id = %r.fork_id, run.id = %r.run_id, attempt, fence, "coordinator.resume: refused: {reason}");
            ResumeReply::Refused { reason }
        }
        Err(CoordinatorError::UnknownRun(run)) => ResumeReply::Gone {
            reason: format!("run {run} is not a branch of fork {}", r.fork_id),
        },
        Err(e) => ResumeReply::Retry {
            reason: e.to_string(),
        },
    }
}

/// A delivery of `task` past `max_deliver`: the fork queues the branch again or fails it,
/// and the worker is told to drop the task (`Gone`, with what became of the branch).
async fn dead_task(
    bus: &dyn Bus,
    pool: &str,
    fork: &crate::fork::ForkHandle,
    started_ms: u64,
    task: &BranchTask,
) -> ResumeReply {
    let dead = crate::fork::DeadTask {
        run: task.run_id,
        attempt_base: task.attempt_base,
        pool: pool.to_string(),
        outage_ms: started_ms.max(bus.disrupted_at_ms()),
    };
    match fork.dead_task(dead).await {
        Ok(reason) => ResumeReply::Gone { reason },
        Err(e) => ResumeReply::Retry {
            reason: e.to_string(),
        },
    }
}
