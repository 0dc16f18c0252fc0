//! The coordinator's metrics beside the event loop's and the ledger's own: the ledger's
//! gauges, published by a collector while the coordinator runs (`budget/metrics.rs`), and
//! the task queue's depth and lag, sampled from the bus every [`QUEUE_SAMPLE_INTERVAL`]
//! (reading them is a NATS request, too slow for a collector).

use crate::budget::metrics::Published;
use crate::budget::Ledger;
use forkfleet_bus::Bus;
use forkfleet_shared::metrics::{catalog, register_collector};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// How often the task queue's depth and lag are read.
pub const QUEUE_SAMPLE_INTERVAL: Duration = Duration::from_secs(5);

/// Publish the ledger's gauges and sample `pool`'s queue until `stop` turns true; the
/// series are taken back then.
pub(crate) fn start(
    bus: &Arc<dyn Bus>,
    pool: &str,
    ledger: &Arc<Ledger>,
    mut stop: watch::Receiver<bool>,
) -> JoinHandle<()> {
    let (bus, pool) = (bus.clone(), pool.to_string());
    let published = Mutex::new(Published::default());
    let from = ledger.clone();
    let collector = register_collector(move || {
        let mut p = published.lock().unwrap_or_else(|e| e.into_inner());
        from.publish_metrics(&mut p);
    });
    tokio::spawn(async move {
        let _collector = collector;
        let mut tick = tokio::time::interval(QUEUE_SAMPLE_INTERVAL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut said = false;
        loop {
            tokio::select! {
                _ = stop.wait_for(|s| *s) => break,
                _ = tick.tick() => {}
            }
            match bus.task_queue(&pool).await {
                Ok(q) => {
                    catalog::QUEUE_DEPTH.set(&[&pool], q.depth() as f64);
                    catalog::QUEUE_LAG.set(&[&pool], q.waiting as f64);
                    said = false;
                }
                Err(e) => {
                    if !said {
                        tracing::warn!(pool = %pool, error = %e, "metrics: cannot read the task queue's depth; trying again");
                        said = true;
                    }
                }
            }
        }
        catalog::QUEUE_DEPTH.remove(&[&pool]);
        catalog::QUEUE_LAG.remove(&[&pool]);
    })
}
