//! Handing a branch over to the worker that took its task after another worker was lost.
//!
//! A task is delivered again when its worker stopped heartbeating (killed, partitioned,
//! out of memory). The new worker asks, on [`RESUME_SUBJECT`], for the branch's log; the
//! fork actor first *fences* the branch at the new attempt (events of earlier attempts are
//! dropped from then on, so a worker presumed dead cannot interleave with its successor),
//! then answers with the log as stored. The worker continues at the next seq.
//!
//! A task delivered `max_deliver` times without finishing comes back as a dead task: its
//! branch is failed with an error that says so (its partial work stays mergeable).

use crate::error::CoordinatorError;
use crate::root::RootHandle;
use forkfleet_bus::{Bus, Request};
use forkfleet_shared::protocol::{BranchTask, ResumeReply, ResumeRequest, RESUME_SUBJECT};
use forkfleet_shared::wire;
use std::sync::Arc;
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// Serve resume requests until `stop` turns true.
pub(crate) async fn start(
    bus: &Arc<dyn Bus>,
    root: RootHandle,
    stop: watch::Receiver<bool>,
) -> Result<JoinHandle<()>, CoordinatorError> {
    crate::serve::serve(bus, RESUME_SUBJECT, stop, move |req| {
        answer(root.clone(), req)
    })
    .await
}

async fn answer(root: RootHandle, req: Request) {
    let reply = match wire::decode::<ResumeRequest>(&req.payload) {
        Ok(r) => resume(&root, &r).await,
        Err(e) => {
            tracing::error!(error = %e, "coordinator.resume: malformed request");
            ResumeReply::Retry {
                reason: format!("malformed resume request: {e}"),
            }
        }
    };
    match wire::encode(&reply) {
        Ok(bytes) => {
            if let Err(e) = req.respond(bytes).await {
                tracing::warn!(error = %e, "coordinator.resume: could not answer");
            }
        }
        Err(e) => tracing::error!(error = %e, "coordinator.resume: cannot encode the answer"),
    }
}

async fn resume(root: &RootHandle, r: &ResumeRequest) -> ResumeReply {
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
    match fork.fence(r.run_id, r.attempt).await {
        Ok(events) => ResumeReply::Log { events },
        Err(CoordinatorError::UnknownRun(run)) => ResumeReply::Gone {
            reason: format!("run {run} is not a branch of fork {}", r.fork_id),
        },
        Err(e) => ResumeReply::Retry {
            reason: e.to_string(),
        },
    }
}

/// Fail the branches whose tasks exhausted their deliveries, until `stop` turns true.
pub(crate) async fn start_dead_tasks(
    bus: &Arc<dyn Bus>,
    pool: &str,
    root: RootHandle,
    mut stop: watch::Receiver<bool>,
) -> Result<JoinHandle<()>, CoordinatorError> {
    let mut dead = bus.dead_tasks(pool).await?;
    Ok(tokio::spawn(async move {
        loop {
            let payload = tokio::select! {
                _ = stop.wait_for(|s| *s) => break,
                p = dead.recv() => match p {
                    Some(p) => p,
                    None => break,
                },
            };
            let task = match wire::decode::<BranchTask>(&payload) {
                Ok(t) => t,
                Err(e) => {
                    tracing::error!(error = %e, "coordinator.dead_task: undecodable dead task dropped");
                    continue;
                }
            };
            let error = "the branch's task was delivered the maximum number of times and no worker finished it (workers lost or crashing on it); its partial work is kept".to_string();
            match root.lookup(task.fork_id).await {
                Ok(Some(fork)) => {
                    if let Err(e) = fork.fail_branch(task.run_id, error) {
                        tracing::error!(run.id = %task.run_id, error = %e, "coordinator.dead_task: cannot fail the branch");
                    }
                }
                Ok(None) => {
                    tracing::warn!(fork.id = %task.fork_id, "coordinator.dead_task: unknown fork")
                }
                Err(e) => {
                    tracing::error!(error = %e, "coordinator.dead_task: cannot look the fork up")
                }
            }
        }
    }))
}
