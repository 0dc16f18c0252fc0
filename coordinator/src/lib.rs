//! # forkfleet-coordinator
//!
//! The process that owns forks: validation, state, the run store, a replica of every
//! branch's change log, the diff and the merge. It never calls a model or runs a user
//! command: workers do, and stream their events back over the bus.
//!
//! ## Layout
//! - [`Coordinator`] (this file): start, handle, shutdown.
//! - [`handle`]: [`CoordinatorHandle`], the API the CLI and the cluster service call.
//! - [`api`]: the handler of every API operation (declared in `forkfleet_shared::api`),
//!   given the request's caller.
//! - [`access`]: who may act on what: the accounts a caller may use, the checks the
//!   handlers make (ADR 17).
//! - [`service`]: the API over the bus's request/reply ([`service::serve`]).
//! - [`store`]: [`RunStore`], sled under a data dir (runs, events, forks, branches,
//!   checkpoints, blobs).
//! - `create`: validation and the writes of a new fork (branch logs, prefix blob, tasks).
//! - `replica`: one branch's replica; events applied once, in seq order.
//! - `merge`: flushing a winner onto its parent and adopting its history.
//! - `checkpoint`: checkpoints (ADR 12): labels, versions, finding them, named ones and the
//!   API; `checkpoint/auto.rs` automatic checkpoints of branch runs, `checkpoint/rewind.rs`
//!   rewind, `checkpoint/new_run.rs` new runs from a checkpoint.
//! - `event_loop`: the consumer of the event stream (pump, apply, flush-then-ack).
//! - `resume`: hands a branch's log to a worker taking it over, fencing earlier attempts;
//!   a delivery past `max_deliver` is a dead task, queued again or failed (ADR 38).
//! - [`lease`]: one coordinator at a time on a NATS cluster: taking, standing by for,
//!   renewing and releasing the lease of `forkfleet_bus::lease`.
//! - `budget`: the ledger of branch, fork and account caps (spend, usage, stops);
//!   `budget/reserve.rs` reservations (grant, cancel, expiry), `budget/caps.rs` top-ups,
//!   moves and accounts, `budget/service.rs` the reservation service, `budget/metrics.rs`
//!   the ledger's gauges.
//! - `metrics`: publishes the ledger's gauges and samples the task queue's depth and lag.
//! - `serve`: answering a request/reply subject (resubscribing, bounded, drained).
//! - `root`, `fork`: the actors. `fork` holds the fork actor's messages, state and handler;
//!   `fork/handle.rs` its handle, `fork/events.rs` applying events and fences,
//!   `fork/control.rs` resume, follow-up, steer, terminate and abort, `fork/merging.rs`
//!   merge, resolve, adopt and rewind.
//! - `agentfork`: forks made by a branch's own agent, merged into its branch (ADR 14).
//! - `lineage`: the runs and their lineage, and `runs fork`: a child run from a prefix of
//!   any recorded run, copied or replayed (docs/LINEAGE.md).
//! - `blobs`: copying what the run store lacks from the bus's blob store.
//! - `resolve`: tests and judges on workers, the strategy's decision, the merge.
//! - `prefix`: finding a fork or a run by a prefix of its id, one rule for every lookup.
//! - `gc`: housekeeping (`fork rm`, `forkfleet gc`): finished forks deleted, and the blobs
//!   nothing refers to any more (ADR 28).
//! - `tenancy`: blobs belong to tenants (ADR 37): scoped uploads through the API, checked
//!   against their hash, owned by accounts, counted against quotas.
//! - [`error`]: the one error type, [`CoordinatorError`], and its kind (its tests in
//!   `error/tests.rs`).
//!
//! ## Actors
//!
//! ```text
//! RootActor ─────────────── owns ForkId -> ForkHandle, loads forks on start,
//!  │                        restarts a failed fork actor from the store
//!  ├── ForkActor (fork A) ── state, replicas, waiters, version counter;
//!  ├── ForkActor (fork B)    diffs and merges on blocking threads, results cast back
//!  └── ...
//!
//! event loop (tasks, not actors) ──ApplyEvents──▶ ForkActor
//! CoordinatorHandle ──▶ RootActor (route, list, find) ──▶ ForkActor (view, diff, merge)
//! ```
//!
//! ## Durability
//! An event is acked on the bus only after it is in sled and sled was flushed (the event
//! loop batches: write a run of events, one `flush_async`, then the acks). On start every
//! fork is reloaded and each branch's replica rebuilt from its stored log; unacked events
//! are redelivered and applied idempotently by (run, seq).

pub mod access;
pub mod api;
pub mod error;
pub mod handle;
pub mod lease;
pub mod service;
pub mod store;

mod agentfork;
mod blobs;
mod budget;
mod checkpoint;
mod create;
mod event_loop;
mod fork;
mod gc;
mod lineage;
mod merge;
mod metrics;
mod prefix;
mod replica;
mod resolve;
mod resume;
mod root;
mod serve;
mod tenancy;

pub use checkpoint::{origin_label, tool_label, turn_label};
pub use create::{fork_checkpoint_label, post_fork_checkpoint_label};
pub use error::CoordinatorError;
pub use handle::CoordinatorHandle;
pub use store::{RunStore, SledBlobStore, StoreCounts};

use budget::Ledger;
use event_loop::EventLoop;
use forkfleet_bus::Bus;
use forkfleet_shared::protocol::DEFAULT_POOL;
use ractor::{Actor, ActorRef};
use root::{RootActor, RootArgs, RootHandle, RootMsg};
use std::sync::Arc;
use std::time::Duration;

/// How long shutdown waits for the actors to stop.
const STOP_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CoordinatorConfig {
    /// The task queue branch tasks go to.
    pub pool: String,
    /// The durable consumer name of the event stream.
    pub durable: String,
    /// How long a budget reservation holds money before it is released unsettled (its
    /// worker is presumed gone). Longer than the slowest model call.
    pub reservation_ttl_ms: u64,
    /// The accounts each scoped client identity may use besides its own (`[access."ID"]
    /// accounts`; see `crate::access`).
    pub access: access::Grants,
    /// Release every reservation the store holds when starting: the workers that held
    /// them lived in the process that wrote them and died with it (the embedded system),
    /// so no call of theirs is in flight. A cluster's coordinator keeps them: its workers
    /// outlive it.
    pub release_reservations_at_start: bool,
    /// The bytes each scoped client identity's blob uploads may hold
    /// (`[coordinator] blob_quota_mb`; see `crate::tenancy`).
    pub blob_quota_bytes: u64,
    /// What the workers this process starts when it needs them offer (the embedded
    /// system's, from the same configuration): a fork's real models are checked against
    /// it when no live worker is listed (a command that reads or writes the store starts
    /// none), so a model no worker would take is refused at creation, not when it runs.
    /// `None` (a cluster's coordinator): with no live worker the check is left to them.
    pub idle_offer: Option<forkfleet_shared::catalogue::Offer>,
}

/// The default of [`CoordinatorConfig::blob_quota_bytes`]: 4 GiB.
pub const DEFAULT_BLOB_QUOTA_BYTES: u64 = 4 << 30;

/// The default of [`CoordinatorConfig::reservation_ttl_ms`]: ten minutes.
pub const DEFAULT_RESERVATION_TTL_MS: u64 = 600_000;

impl Default for CoordinatorConfig {
    fn default() -> Self {
        Self {
            pool: DEFAULT_POOL.to_string(),
            durable: "coordinator".to_string(),
            reservation_ttl_ms: DEFAULT_RESERVATION_TTL_MS,
            access: access::Grants::new(),
            release_reservations_at_start: false,
            blob_quota_bytes: DEFAULT_BLOB_QUOTA_BYTES,
            idle_offer: None,
        }
    }
}

/// A running coordinator: the actors and the event loop over one store and one bus.
pub struct Coordinator {
    handle: CoordinatorHandle,
    root: ActorRef<RootMsg>,
    root_join: Option<tokio::task::JoinHandle<()>>,
    events: Option<EventLoop>,
    services: Vec<tokio::task::JoinHandle<()>>,
    stop_services: tokio::sync::watch::Sender<bool>,
    store: RunStore,
}

impl Coordinator {
    /// Load every fork from `store`, then start consuming the event stream.
    pub async fn start(
        config: CoordinatorConfig,
        store: RunStore,
        bus: Arc<dyn Bus>,
    ) -> Result<Coordinator, CoordinatorError> {
        Self::start_with_clock(config, store, bus, forkfleet_shared::clock::system()).await
    }

    /// [`Coordinator::start`], with budget reservations and the deadlines of requests for
    /// consent timed by `clock` (a test's manual clock makes them expire without waiting).
    pub async fn start_with_clock(
        config: CoordinatorConfig,
        store: RunStore,
        bus: Arc<dyn Bus>,
        clock: Arc<dyn forkfleet_shared::clock::Clock>,
    ) -> Result<Coordinator, CoordinatorError> {
        let ledger = Ledger::open(
            store.clone(),
            bus.clone(),
            config.reservation_ttl_ms,
            clock.clone(),
        )?;
        if config.release_reservations_at_start {
            ledger.release_all();
        }
        let (root, root_join) = Actor::spawn(
            None,
            RootActor,
            RootArgs {
                pool: config.pool.clone(),
                store: store.clone(),
                bus: bus.clone(),
                ledger: ledger.clone(),
                clock,
            },
        )
        .await
        .map_err(|e| CoordinatorError::Internal(format!("cannot start the root actor: {e}")))?;
        let root_handle = RootHandle::new(root.clone());
        let events =
            match EventLoop::start(&bus, &config.durable, root_handle.clone(), store.clone()).await
            {
                Ok(ev) => ev,
                Err(e) => {
                    stop_actors(&root).await;
                    return Err(e);
                }
            };
        let (stop_services, _) = tokio::sync::watch::channel(false);
        let services = match start_services(
            &bus,
            &config,
            &root_handle,
            &ledger,
            &store,
            &stop_services,
        )
        .await
        {
            Ok(s) => s,
            Err(e) => {
                // The services already started watch this and stop.
                let _ = stop_services.send(true);
                events.stop().await;
                stop_actors(&root).await;
                return Err(e);
            }
        };
        store.set_blob_quota(config.blob_quota_bytes);
        // Uploads under way when an earlier process stopped: their clients start them again.
        let uploads = store.dir().join(tenancy::UPLOADS_DIR);
        if uploads.exists() {
            if let Err(e) = std::fs::remove_dir_all(&uploads) {
                tracing::warn!(dir = %uploads.display(), error = %e, "coordinator.uploads: cannot clear the uploads an earlier process left");
            }
        }
        tracing::info!(pool = %config.pool, durable = %config.durable, dir = %store.dir().display(), "coordinator.started");
        Ok(Coordinator {
            services,
            stop_services,
            handle: CoordinatorHandle::new(root_handle, store.clone(), bus, config, ledger),
            root,
            root_join: Some(root_join),
            events: Some(events),
            store,
        })
    }

    pub fn handle(&self) -> CoordinatorHandle {
        self.handle.clone()
    }

    /// Stop consuming events (what was applied is flushed and acked), stop the actors,
    /// and flush the store.
    pub async fn shutdown(mut self) -> Result<(), CoordinatorError> {
        let _ = self.stop_services.send(true);
        for s in self.services.drain(..) {
            let _ = s.await;
        }
        if let Some(events) = self.events.take() {
            events.stop().await;
        }
        stop_actors(&self.root).await;
        if let Some(join) = self.root_join.take() {
            let _ = join.await;
        }
        self.store.flush_async().await?;
        tracing::info!("coordinator.stopped");
        Ok(())
    }
}

/// The services beside the event loop, each stopping when `stop` turns true: branch
/// takeovers and dead tasks (`coord.resume`), budget reservations (`coord.budget`), metrics.
async fn start_services(
    bus: &Arc<dyn Bus>,
    config: &CoordinatorConfig,
    root: &RootHandle,
    ledger: &Arc<Ledger>,
    store: &RunStore,
    stop: &tokio::sync::watch::Sender<bool>,
) -> Result<Vec<tokio::task::JoinHandle<()>>, CoordinatorError> {
    bus.open_pool(&config.pool).await?;
    Ok(vec![
        resume::start(bus, &config.pool, root.clone(), stop.subscribe()).await?,
        budget::start(bus, ledger.clone(), store.clone(), stop.subscribe()).await?,
        metrics::start(bus, &config.pool, ledger, stop.subscribe()),
    ])
}

async fn stop_actors(root: &ActorRef<RootMsg>) {
    root.stop_children_and_wait(None, Some(STOP_TIMEOUT)).await;
    if let Err(e) = root.stop_and_wait(None, Some(STOP_TIMEOUT)).await {
        tracing::warn!(error = %e, "coordinator: root actor did not stop in time");
    }
}

impl Drop for Coordinator {
    fn drop(&mut self) {
        // Dropped without `shutdown`: wind down in the background.
        let _ = self.stop_services.send(true);
        if let Some(events) = &self.events {
            events.signal_stop();
            self.root.stop_children(None);
            self.root.stop(None);
        }
    }
}
