//! The reservation service: answers [`BudgetRequest`]s on [`BUDGET_SUBJECT`] and expires
//! reservations whose worker never settled them.
//!
//! A grant is answered only after the reservation is flushed to the store, so a
//! coordinator that restarts still counts the money held for calls in flight.

use super::Ledger;
use crate::error::CoordinatorError;
use crate::store::RunStore;
use forkfleet_bus::{Bus, BusError, Request};
use forkfleet_shared::budget::{BudgetReply, BudgetRequest, BUDGET_SUBJECT};
use forkfleet_shared::wire;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::Instrument;

/// How often expired reservations are looked for, at the most (a short ttl is looked at
/// twice per ttl).
const EXPIRE_EVERY: Duration = Duration::from_millis(500);

/// Serve reservations and expire stale ones until `stop` turns true.
pub(crate) async fn start(
    bus: &Arc<dyn Bus>,
    ledger: Arc<Ledger>,
    store: RunStore,
    mut stop: watch::Receiver<bool>,
) -> Result<JoinHandle<()>, CoordinatorError> {
    let served = {
        let ledger = ledger.clone();
        crate::serve::serve(bus, BUDGET_SUBJECT, stop.clone(), move |req| {
            answer(ledger.clone(), store.clone(), req)
        })
        .await?
    };
    Ok(tokio::spawn(async move {
        let every = EXPIRE_EVERY.min(Duration::from_millis((ledger.ttl_ms() / 2).max(1)));
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = stop.wait_for(|s| *s) => break,
                _ = tick.tick() => {
                    ledger.expire_due();
                }
            }
        }
        if let Err(e) = served.await {
            tracing::error!(error = %e, "coordinator.budget: the service task failed");
        }
    }))
}

async fn answer(ledger: Arc<Ledger>, store: RunStore, req: Request) {
    let reply = match wire::decode::<BudgetRequest>(&req.payload) {
        Ok(r) => {
            // A child of the worker's `branch.turn` that asks, when the request carries its
            // context: the decision is in the fork's trace.
            let span = tracing::info_span!(
                "budget.reserve",
                fork.id = %r.fork_id,
                branch.id = %r.run_id,
                budget.usd = r.estimate_usd,
                budget.granted = tracing::field::Empty,
            );
            // The request's own header (every bus request carries its sender's), else the
            // payload's `trace` (a worker from before the header).
            let trace = req.traceparent.as_deref().or(r.trace.as_deref());
            forkfleet_shared::trace::set_parent(&span, trace);
            let reply = decide(&ledger, &store, &r).instrument(span.clone()).await;
            span.record(
                "budget.granted",
                matches!(
                    reply,
                    BudgetReply::Granted { .. } | BudgetReply::Partial { .. }
                ),
            );
            reply
        }
        Err(e) => {
            tracing::error!(error = %e, bytes = req.payload.len(), "coordinator.budget: malformed request");
            BudgetReply::Retry {
                reason: format!("malformed budget request: {e}"),
            }
        }
    };
    match wire::encode(&reply) {
        Ok(bytes) => {
            match req.respond(bytes).await {
                Ok(()) => {}
                // Shutting down: the worker asks again, of the next coordinator.
                Err(BusError::Closed) => {
                    tracing::debug!("coordinator.budget: closed before answering")
                }
                Err(e) => tracing::warn!(error = %e, "coordinator.budget: could not answer"),
            }
        }
        Err(e) => tracing::error!(error = %e, "coordinator.budget: cannot encode the answer"),
    }
}

/// The ledger's answer to a request, a grant only once its reservation is durable.
async fn decide(ledger: &Ledger, store: &RunStore, r: &BudgetRequest) -> BudgetReply {
    let (reply, actions) = ledger.reserve(r);
    ledger.send(actions);
    match reply {
        BudgetReply::Granted { reservation } | BudgetReply::Partial { reservation, .. } => {
            match store.flush_async().await {
                Ok(()) => reply,
                Err(e) => {
                    // Not durable: do not let the call run on it.
                    ledger.cancel(reservation);
                    BudgetReply::Retry {
                        reason: format!("cannot persist the reservation: {e}"),
                    }
                }
            }
        }
        BudgetReply::Refused { state, reason } => {
            tracing::info!(run.id = %r.run_id, state = %state, reason = %reason, "budget.refused");
            BudgetReply::Refused { state, reason }
        }
        other => other,
    }
}
