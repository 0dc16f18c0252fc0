//! Answering a request/reply subject until told to stop: what the coordinator's internal
//! services (`coord.resume`, `coord.budget`) share.
//!
//! - Each request is answered in a task of its own, at most [`MAX_IN_FLIGHT`] at once
//!   (more wait in the subscription).
//! - When the bus ends the subscription (a reconnect), it subscribes again after a pause,
//!   for as long as it is not stopped: a service that silently stopped answering would stall
//!   every worker that needs it.
//! - On stop, requests in flight get [`DRAIN`] to finish.

use crate::error::CoordinatorError;
use forkfleet_bus::{Bus, Request};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};

/// Requests answered at once.
const MAX_IN_FLIGHT: usize = 1024;
/// Pause before subscribing again when the bus ends the subscription (or refuses one).
const RESUBSCRIBE_AFTER: Duration = Duration::from_millis(500);
/// How long requests in flight may finish after the stop.
const DRAIN: Duration = Duration::from_secs(5);

/// Subscribe to `subject` now (an error if the bus refuses), then answer each request with
/// `handler` until `stop` turns true.
pub(crate) async fn serve<H, F>(
    bus: &Arc<dyn Bus>,
    subject: &'static str,
    mut stop: watch::Receiver<bool>,
    handler: H,
) -> Result<JoinHandle<()>, CoordinatorError>
where
    H: Fn(Request) -> F + Send + 'static,
    F: Future<Output = ()> + Send + 'static,
{
    let mut requests = Some(bus.serve(subject).await?);
    let bus = bus.clone();
    Ok(tokio::spawn(async move {
        let mut tasks = JoinSet::new();
        loop {
            let Some(rx) = requests.as_mut() else {
                tokio::select! {
                    _ = stop.wait_for(|s| *s) => break,
                    _ = tokio::time::sleep(RESUBSCRIBE_AFTER) => {}
                }
                match bus.serve(subject).await {
                    Ok(rx) => requests = Some(rx),
                    Err(e) => {
                        tracing::warn!(subject, error = %e, "coordinator.serve: cannot subscribe again; retrying")
                    }
                }
                continue;
            };
            tokio::select! {
                _ = stop.wait_for(|s| *s) => break,
                req = rx.recv(), if tasks.len() < MAX_IN_FLIGHT => match req {
                    Some(req) => {
                        tasks.spawn(handler(req));
                    }
                    None => {
                        tracing::warn!(subject, "coordinator.serve: the subscription ended; subscribing again");
                        requests = None;
                    }
                },
                Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
            }
        }
        drop(requests);
        if tokio::time::timeout(DRAIN, async { while tasks.join_next().await.is_some() {} })
            .await
            .is_err()
        {
            tracing::warn!(
                subject,
                requests = tasks.len(),
                "coordinator.serve: requests still running were dropped"
            );
            tasks.abort_all();
        }
    }))
}
