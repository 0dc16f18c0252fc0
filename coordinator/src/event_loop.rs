//! The event loop: consumes the branch event stream and routes events to fork actors.
//!
//! Three tasks, so that no stage waits on another's I/O:
//!
//! ```text
//!  bus.events(durable) ──▶ pump ──(bounded channel)──▶ apply ──(bounded)──▶ acker
//!                          next()                      decode, group by     flush_async,
//!                                                      fork, ForkMsg::      then ack every
//!                                                      ApplyEvents          delivery
//! ```
//!
//! - **apply** takes whatever is buffered (up to [`MAX_BATCH`] deliveries), decodes them
//!   (a delivery is one event, or a worker's batch of one run's events), and sends each
//!   fork one `ApplyEvents` call with its events in delivery order. The fork
//!   actor writes them to sled (not flushed) and applies them.
//! - **acker** takes every batch written so far, flushes the database once, and only then
//!   acks them: an acked event is durable. While it flushes, apply goes on with the next
//!   batch, so one fsync covers many batches under load.
//! - A malformed or wrong-version message is logged with `tracing::error!` and acked; an
//!   event of an unknown fork likewise. A batch a fork could not write is nak'ed for
//!   redelivery. Nothing stops the loop but [`EventLoop::stop`] or a closed bus.

use crate::blobs::Prefetch;
use crate::error::CoordinatorError;
use crate::fork::ForkHandle;
use crate::root::RootHandle;
use crate::store::RunStore;
use forkfleet_bus::{Bus, BusError, Delivery, EventConsumer};
use forkfleet_shared::blob::BlobHash;
use forkfleet_shared::ids::ForkId;
use forkfleet_shared::metrics::catalog as metrics;
use forkfleet_shared::protocol::{read_message, BranchEvent, EventMessage};
use futures::StreamExt;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

/// Most deliveries applied in one batch.
const MAX_BATCH: usize = 256;
/// Deliveries buffered between the pump and the apply task.
const PUMP_BUFFER: usize = 256;
/// Acks sent at once.
const ACKS_IN_FLIGHT: usize = 128;
/// Written batches waiting for the acker.
const ACK_BUFFER: usize = 2;
/// When a batch cannot be written, its redelivery waits this long.
const RETRY_DELAY: Duration = Duration::from_secs(1);
/// Back-off after a bus error other than a closed bus.
const BUS_ERROR_BACKOFF: Duration = Duration::from_millis(200);

pub(crate) struct EventLoop {
    stop: watch::Sender<bool>,
    pump: JoinHandle<Box<dyn EventConsumer>>,
    apply: JoinHandle<()>,
    acker: JoinHandle<()>,
    /// Copies the text blobs branches write into the run store (a cluster only).
    prefetch: Option<JoinHandle<()>>,
}

impl EventLoop {
    pub async fn start(
        bus: &Arc<dyn Bus>,
        durable: &str,
        root: RootHandle,
        store: RunStore,
    ) -> Result<EventLoop, CoordinatorError> {
        let consumer = bus.events(durable).await?;
        let (stop, stop_rx) = watch::channel(false);
        let (dtx, drx) = mpsc::channel(PUMP_BUFFER);
        let (atx, arx) = mpsc::channel(ACK_BUFFER);
        let (prefetch, prefetch_task) = Prefetch::start(&store, bus);
        Ok(EventLoop {
            pump: tokio::spawn(pump(consumer, dtx, stop_rx.clone())),
            apply: tokio::spawn(apply(drx, atx, root, prefetch, stop_rx)),
            acker: tokio::spawn(acker(arx, store)),
            prefetch: prefetch_task,
            stop,
        })
    }

    /// Signal a stop without waiting (used when the coordinator is dropped).
    pub fn signal_stop(&self) {
        let _ = self.stop.send(true);
    }

    /// Stop consuming: the batch being applied is finished, flushed and acked; what was
    /// buffered but not applied stays unacked and is redelivered to the next consumer.
    pub async fn stop(self) {
        let _ = self.stop.send(true);
        if let Err(e) = self.apply.await {
            tracing::error!(error = %e, "coordinator.events: apply task failed");
        }
        if let Err(e) = self.acker.await {
            tracing::error!(error = %e, "coordinator.events: acker task failed");
        }
        // The consumer is dropped last, after every ack.
        match self.pump.await {
            Ok(consumer) => drop(consumer),
            Err(e) => tracing::error!(error = %e, "coordinator.events: pump task failed"),
        }
        // Copies still queued are not needed: a diff copies what it lacks.
        if let Some(task) = self.prefetch {
            task.abort();
        }
    }
}

async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

async fn pump(
    mut consumer: Box<dyn EventConsumer>,
    tx: mpsc::Sender<Delivery>,
    mut stop: watch::Receiver<bool>,
) -> Box<dyn EventConsumer> {
    loop {
        let next = tokio::select! {
            biased;
            _ = stopped(&mut stop) => break,
            next = consumer.next() => next,
        };
        match next {
            Ok(d) => {
                let sent = tokio::select! {
                    biased;
                    _ = stopped(&mut stop) => false,
                    sent = tx.send(d) => sent.is_ok(),
                };
                if !sent {
                    break;
                }
            }
            Err(BusError::Closed) => {
                tracing::info!("coordinator.events: the event stream closed");
                break;
            }
            Err(e) => {
                tracing::error!(error = %e, "coordinator.events: cannot read the event stream; retrying");
                tokio::select! {
                    _ = stopped(&mut stop) => break,
                    _ = tokio::time::sleep(BUS_ERROR_BACKOFF) => {}
                }
            }
        }
    }
    consumer
}

async fn apply(
    mut rx: mpsc::Receiver<Delivery>,
    acks: mpsc::Sender<Vec<Delivery>>,
    root: RootHandle,
    prefetch: Prefetch,
    mut stop: watch::Receiver<bool>,
) {
    let mut routes: HashMap<ForkId, ForkHandle> = HashMap::new();
    loop {
        let first = tokio::select! {
            biased;
            _ = stopped(&mut stop) => break,
            d = rx.recv() => match d {
                Some(d) => d,
                None => break,
            },
        };
        let mut batch = Vec::with_capacity(rx.len().min(MAX_BATCH) + 1);
        batch.push(first);
        while batch.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(d) => batch.push(d),
                Err(_) => break,
            }
        }
        let done = apply_batch(batch, &mut routes, &root, &prefetch).await;
        if acks.send(done).await.is_err() {
            break;
        }
    }
}

/// A blob sent along with events, under the hash it claims.
type Sent = (BlobHash, bytes::Bytes);

/// One fork's share of a batch: its events, their deliveries, the blobs sent with them.
type Group = (ForkId, Vec<BranchEvent>, Vec<Delivery>, Vec<Sent>);

/// Decode, route and apply one batch; the deliveries to ack once the store is flushed.
async fn apply_batch(
    batch: Vec<Delivery>,
    routes: &mut HashMap<ForkId, ForkHandle>,
    root: &RootHandle,
    prefetch: &Prefetch,
) -> Vec<Delivery> {
    let mut done = Vec::with_capacity(batch.len());
    let mut groups: Vec<Group> = Vec::new();
    for d in batch {
        match read_message(&d.payload) {
            Ok(EventMessage { events, blobs }) => {
                // A batch is one run's events: one fork's.
                let Some(fork_id) = events.first().map(|e| e.fork_id) else {
                    tracing::error!(
                        attempt = d.attempt,
                        "coordinator.events: an empty event batch; acked"
                    );
                    done.push(d);
                    continue;
                };
                if events.iter().any(|e| e.fork_id != fork_id) {
                    tracing::error!(
                        attempt = d.attempt,
                        events = events.len(),
                        "coordinator.events: an event batch names more than one fork; acked and dropped"
                    );
                    done.push(d);
                    continue;
                }
                match groups.iter_mut().find(|g| g.0 == fork_id) {
                    Some(g) => {
                        g.1.extend(events);
                        g.2.push(d);
                        g.3.extend(blobs);
                    }
                    None => groups.push((fork_id, events, vec![d], blobs)),
                }
            }
            Err(e) => {
                tracing::error!(
                    error = %e,
                    attempt = d.attempt,
                    bytes = d.payload.len(),
                    "coordinator.events: undecodable message on the event stream; acked and dropped"
                );
                done.push(d);
            }
        }
    }
    for (fork_id, events, deliveries, sent) in groups {
        let handle = match routes.get(&fork_id) {
            Some(h) => Some(h.clone()),
            None => match root.lookup(fork_id).await {
                Ok(h) => h,
                Err(e) => {
                    tracing::error!(fork.id = %fork_id, error = %e, "coordinator.events: cannot route events");
                    nak_all(&deliveries).await;
                    continue;
                }
            },
        };
        let Some(handle) = handle else {
            tracing::error!(fork.id = %fork_id, events = events.len(), "coordinator.events: events of an unknown fork; acked and dropped");
            done.extend(deliveries);
            continue;
        };
        routes.insert(fork_id, handle.clone());
        let (n, started) = (events.len(), std::time::Instant::now());
        match handle.apply(events).await {
            Ok(texts) => {
                metrics::EVENTS_APPLIED.add(&[], n as f64);
                metrics::EVENTS_APPLY_DURATION.observe(&[], started.elapsed().as_secs_f64());
                // Only what the fork wrote: never the texts of fenced, duplicate or
                // unknown runs' events, nor of a batch that is redelivered.
                prefetch.written(texts, sent);
                done.extend(deliveries)
            }
            Err(e) => {
                tracing::error!(fork.id = %fork_id, error = %e, "coordinator.events: events not applied; redelivery requested");
                routes.remove(&fork_id);
                nak_all(&deliveries).await;
            }
        }
    }
    done
}

async fn nak_all(deliveries: &[Delivery]) {
    for d in deliveries {
        if let Err(e) = d.nak(Some(RETRY_DELAY)).await {
            tracing::warn!(error = %e, "coordinator.events: nak failed");
        }
    }
}

async fn acker(mut rx: mpsc::Receiver<Vec<Delivery>>, store: RunStore) {
    while let Some(mut batch) = rx.recv().await {
        while let Ok(more) = rx.try_recv() {
            batch.extend(more);
        }
        if batch.is_empty() {
            continue;
        }
        match store.flush_async().await {
            Ok(()) => {
                // Concurrently (over NATS each ack is a round trip), a window in flight.
                let pending: Vec<_> = batch.iter().map(Delivery::ack).collect();
                let mut acks = futures::stream::iter(pending).buffer_unordered(ACKS_IN_FLIGHT);
                while let Some(result) = acks.next().await {
                    if let Err(e) = result {
                        tracing::warn!(error = %e, "coordinator.events: ack failed; the event will be redelivered");
                    }
                }
            }
            Err(e) => {
                tracing::error!(error = %e, events = batch.len(), "coordinator.events: flush failed; redelivery requested");
                nak_all(&batch).await;
            }
        }
    }
}
