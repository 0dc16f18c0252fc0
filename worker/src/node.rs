//! The worker node: pulls branch tasks and supervises one branch agent per task.
//!
//! ```text
//!   puller task ──TaskPulled──▶ NodeActor ──spawn_linked──▶ BranchAgent (one per task)
//!   (one permit per branch)        │  ▲                          │
//!                                  │  └── ActorTerminated/Failed ┘
//!                                  └── Heartbeat: the worker's info on the bus
//! ```
//!
//! - The **puller** holds a semaphore of `concurrency` permits: it takes a permit, then pulls
//!   with the bus's bounded wait (never spinning), and casts the delivery with its permit to
//!   the node. The permit lives as long as the branch, so never more than `concurrency`
//!   branches run at once.
//! - A task that does not decode is logged and acked (dropped): it can never run.
//! - Each task is held in a [`TaskLease`] shared with its agent, extended by a task of its
//!   own every [`TaskLease::extend_every`] (a third of the ack wait, at most the heartbeat
//!   interval) while it is held. A lease lost (expired, or superseded) is neither acked nor
//!   naked: another worker holds the task (ADR 18). The agent acks it right
//!   after publishing the branch's terminal (or `paused`) status; when an agent ends without having
//!   settled its lease (handed back at shutdown, or failed on a bus error), the node naks.
//! - **Drain** (a graceful stop, e.g. SIGTERM): stop pulling, let running branches finish,
//!   stop when none is left. The caller bounds it with a grace period and then shuts down.
//! - **Shutdown**: stop pulling, stop every agent at its next turn boundary, nak what did not
//!   finish, wait for the puller to exit, then stop.
//! - Every heartbeat also publishes the worker's [`WorkerInfo`] (for `forkfleet workers`),
//!   stamped by the config's clock: a heartbeat older than `WORKER_TTL_MS` means the
//!   worker is gone.
//! - A task's trace context ([`TaskLease::trace`]) becomes the parent of its agent's
//!   `branch.run` span, so branches join the trace of the fork that enqueued them.

use crate::agent::{AgentArgs, BranchAgent};
use crate::context::WorkerCtx;
use crate::lease::TaskLease;
use crate::WorkerConfig;
use forkfleet_bus::{BusError, Delivery};
use forkfleet_shared::ids::RunId;
use forkfleet_shared::metrics::{catalog, GaugeHold};
use forkfleet_shared::protocol::{BranchTask, WorkerInfo};
use forkfleet_shared::wire;
use ractor::{
    Actor, ActorCell, ActorId, ActorProcessingErr, ActorRef, MessagingErr, RpcReplyPort,
    SupervisionEvent,
};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};

/// How long a task handed back after an agent failure waits before redelivery.
const FAILED_NAK_DELAY: Duration = Duration::from_secs(1);

/// How the node stopped: `Ok` after a shutdown, `Err` when it had to stop on its own.
/// Still `None` after the node is gone means it crashed.
pub(crate) type NodeExit = Arc<Mutex<Option<Result<(), String>>>>;

/// The node actor (all data lives in [`NodeState`]).
pub(crate) struct NodeActor;

pub(crate) struct NodeArgs {
    pub config: WorkerConfig,
    pub ctx: Arc<WorkerCtx>,
    /// Where the node says how it stopped.
    pub exit: NodeExit,
}

pub(crate) enum NodeMsg {
    /// The puller took a task (and a permit for it).
    TaskPulled {
        delivery: Delivery,
        permit: OwnedSemaphorePermit,
    },
    /// The puller exited; `error` when the bus went away.
    PullerStopped { error: Option<String> },
    /// Time to extend the ack deadline of every running task.
    Heartbeat,
    /// Stop pulling, hand back running branches, reply when all are gone.
    Shutdown(RpcReplyPort<()>),
    /// Stop pulling and let running branches finish; reply when none is left.
    Drain(RpcReplyPort<()>),
    /// How many branches run now.
    Running(RpcReplyPort<usize>),
}

pub(crate) struct NodeState {
    config: WorkerConfig,
    ctx: Arc<WorkerCtx>,
    exit: NodeExit,
    running: HashMap<ActorId, RunningBranch>,
    stop_pull: watch::Sender<bool>,
    stop_rx: Option<watch::Receiver<bool>>,
    puller_done: bool,
    draining: bool,
    /// Pulling stopped for a graceful drain; running branches go on.
    quiescing: bool,
    waiters: Vec<RpcReplyPort<()>>,
    started_at_ms: u64,
    /// The host and the worker's version, as every heartbeat reports them.
    hostname: String,
    version: String,
    heartbeat: Option<tokio::task::JoinHandle<()>>,
    /// The node's `concurrency` in `forkfleet.worker.slots` while it runs.
    _slots: GaugeHold,
}

struct RunningBranch {
    lease: Arc<TaskLease>,
    run_id: RunId,
    label: String,
    agent: ActorCell,
    _permit: OwnedSemaphorePermit,
    /// Counts the branch in `forkfleet.worker.branches.running` while it runs.
    _running: GaugeHold,
}

/// Handle to a running node; the only way other modules talk to it.
#[derive(Clone)]
pub(crate) struct NodeHandle(ActorRef<NodeMsg>);

impl NodeHandle {
    pub fn new(actor: ActorRef<NodeMsg>) -> Self {
        Self(actor)
    }

    /// Hand back running branches and wait until the node has stopped them all.
    pub async fn shutdown(&self) -> Result<(), String> {
        match self.0.call(NodeMsg::Shutdown, None).await {
            Ok(ractor::rpc::CallResult::Success(())) => Ok(()),
            Ok(other) => Err(format!("shutdown got no answer ({other:?})")),
            Err(e) => Err(e.to_string()),
        }
    }

    /// Stop pulling and wait until the running branches have finished.
    pub async fn drain(&self) -> Result<(), String> {
        match self.0.call(NodeMsg::Drain, None).await {
            Ok(ractor::rpc::CallResult::Success(())) => Ok(()),
            Ok(other) => Err(format!("drain got no answer ({other:?})")),
            Err(e) => Err(e.to_string()),
        }
    }

    pub async fn running(&self) -> Result<usize, String> {
        match self.0.call(NodeMsg::Running, None).await {
            Ok(ractor::rpc::CallResult::Success(n)) => Ok(n),
            Ok(other) => Err(format!("no answer ({other:?})")),
            Err(e) => Err(e.to_string()),
        }
    }
}

impl Actor for NodeActor {
    type Msg = NodeMsg;
    type State = NodeState;
    type Arguments = NodeArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<Self::Msg>,
        args: NodeArgs,
    ) -> Result<Self::State, ActorProcessingErr> {
        let (stop_pull, stop_rx) = watch::channel(false);
        let started_at_ms = args.config.clock.now_ms();
        let slots = catalog::WORKER_SLOTS.hold(&[], args.config.concurrency as f64);
        Ok(NodeState {
            config: args.config,
            ctx: args.ctx,
            exit: args.exit,
            running: HashMap::new(),
            stop_pull,
            stop_rx: Some(stop_rx),
            puller_done: false,
            draining: false,
            quiescing: false,
            waiters: Vec::new(),
            started_at_ms,
            hostname: hostname(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            heartbeat: None,
            _slots: slots,
        })
    }

    async fn post_start(
        &self,
        myself: ActorRef<Self::Msg>,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        let puller = Puller {
            bus: state.ctx.bus.clone(),
            pool: state.config.pool.clone(),
            wait: state.config.pull_wait,
            permits: Arc::new(Semaphore::new(state.config.concurrency)),
            node: myself.clone(),
            stop: state.stop_rx.take().ok_or("the puller was started twice")?,
        };
        tokio::spawn(puller.run());
        state.heartbeat = Some(myself.send_interval(state.config.heartbeat, || NodeMsg::Heartbeat));
        announce(state);
        tracing::info!(
            worker.id = %state.config.worker_id,
            worker.pool = %state.config.pool,
            worker.concurrency = state.config.concurrency,
            "worker node started"
        );
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<Self::Msg>,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        if let Some(h) = state.heartbeat.take() {
            h.abort();
        }
        let _ = state.stop_pull.send(true);
        tracing::info!(worker.id = %state.config.worker_id, "worker node stopped");
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            NodeMsg::TaskPulled { delivery, permit } => {
                task_pulled(&myself, state, delivery, permit).await;
            }
            NodeMsg::PullerStopped { error } => {
                state.puller_done = true;
                if let Some(error) = error {
                    tracing::error!(worker.id = %state.config.worker_id, error = %error, "task pulling stopped; the worker stops");
                    if let Ok(mut exit) = state.exit.lock() {
                        exit.get_or_insert(Err(error));
                    }
                    begin_drain(state);
                }
            }
            NodeMsg::Heartbeat => {
                announce(state);
            }
            NodeMsg::Shutdown(reply) => {
                state.waiters.push(reply);
                begin_drain(state);
            }
            NodeMsg::Drain(reply) => {
                state.waiters.push(reply);
                if !state.quiescing {
                    state.quiescing = true;
                    let _ = state.stop_pull.send(true);
                    tracing::info!(worker.id = %state.config.worker_id, running = state.running.len(), "worker draining: no new tasks, running branches go on");
                }
            }
            NodeMsg::Running(reply) => {
                let _ = reply.send(state.running.len());
            }
        }
        maybe_stop(&myself, state);
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<Self::Msg>,
        event: SupervisionEvent,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match event {
            SupervisionEvent::ActorTerminated(cell, _, _) => {
                agent_ended(state, &cell, None).await;
            }
            SupervisionEvent::ActorFailed(cell, err) => {
                agent_ended(state, &cell, Some(err.to_string())).await;
            }
            _ => {}
        }
        maybe_stop(&myself, state);
        Ok(())
    }
}

async fn task_pulled(
    myself: &ActorRef<NodeMsg>,
    state: &mut NodeState,
    delivery: Delivery,
    permit: OwnedSemaphorePermit,
) {
    if state.draining || state.quiescing {
        if let Err(e) = delivery.nak(None).await {
            tracing::warn!(error = %e, "could not hand back a task pulled during shutdown");
        }
        return;
    }
    let task = match wire::decode::<BranchTask>(&delivery.payload) {
        Ok(t) => t,
        Err(e) => {
            tracing::error!(
                worker.id = %state.config.worker_id,
                task.bytes = delivery.payload.len(),
                task.attempt = delivery.attempt,
                error = %e,
                "undecodable branch task dropped"
            );
            if let Err(e) = delivery.ack().await {
                tracing::warn!(error = %e, "could not ack an undecodable task");
            }
            return;
        }
    };
    let lease = Arc::new(TaskLease::new(delivery));
    tokio::spawn(keep_extended(
        lease.clone(),
        lease.extend_every(state.config.heartbeat),
    ));
    let run_id = task.run_id;
    let label = task.label.clone();
    let args = AgentArgs {
        task,
        lease: lease.clone(),
        ctx: state.ctx.clone(),
    };
    match Actor::spawn_linked(None, BranchAgent, args, myself.get_cell()).await {
        Ok((agent, _join)) => {
            state.running.insert(
                agent.get_id(),
                RunningBranch {
                    lease,
                    run_id,
                    label,
                    agent: agent.get_cell(),
                    _permit: permit,
                    _running: catalog::WORKER_RUNNING.hold(&[], 1.0),
                },
            );
        }
        Err(e) => {
            tracing::error!(run.id = %run_id, branch.label = %label, error = %e, "could not start a branch agent; task handed back");
            if let Err(e) = lease.nak(Some(FAILED_NAK_DELAY)).await {
                tracing::warn!(error = %e, "could not hand back a task");
            }
        }
    }
}

/// Extend `lease` every `every` until it is settled or lost (off the mailbox: a slow bus
/// must not delay branch bookkeeping). A failed extension is tried again at the next tick;
/// the lease is lost once it expires since the last confirmed one (see [`TaskLease`]).
async fn keep_extended(lease: Arc<TaskLease>, every: Duration) {
    loop {
        tokio::time::sleep(every).await;
        if lease.is_settled() {
            return;
        }
        if let Err(e) = lease.extend().await {
            if lease.is_settled() {
                return;
            }
            tracing::warn!(error = %e, task.attempt = lease.attempt(), "could not extend a task's ack deadline");
        }
    }
}

/// An agent stopped: settle its task if it did not, and free its permit.
async fn agent_ended(state: &mut NodeState, cell: &ActorCell, failure: Option<String>) {
    let Some(branch) = state.running.remove(&cell.get_id()) else {
        return;
    };
    if branch.lease.is_settled() {
        return;
    }
    let delay = match &failure {
        Some(err) => {
            tracing::error!(run.id = %branch.run_id, branch.label = %branch.label, error = %err, "branch agent failed; task handed back");
            Some(FAILED_NAK_DELAY)
        }
        None => {
            tracing::info!(run.id = %branch.run_id, branch.label = %branch.label, "branch handed back");
            None
        }
    };
    if let Err(e) = branch.lease.nak(delay).await {
        tracing::warn!(run.id = %branch.run_id, error = %e, "could not hand back a task");
    }
}

fn begin_drain(state: &mut NodeState) {
    if state.draining {
        return;
    }
    state.draining = true;
    let _ = state.stop_pull.send(true);
    // A model call in flight (an HTTP request, a backoff) or a tool waiting on other
    // branches ends at once; what it had not published is lost, as when a worker dies, and
    // the next worker takes the branch over from its log (ADR 7). Other steps finish.
    state.ctx.handback.send_replace(true);
    for branch in state.running.values() {
        branch.agent.stop(Some("worker shutting down".into()));
    }
}

/// This worker's heartbeat: what it runs, stamped with its clock's time.
fn worker_info(state: &NodeState) -> WorkerInfo {
    let offer = state.config.catalogue.offer();
    WorkerInfo {
        worker_id: state.config.worker_id,
        pool: state.config.pool.clone(),
        concurrency: state.config.concurrency,
        running: state.running.values().map(|r| r.run_id).collect(),
        hostname: state.hostname.clone(),
        version: state.version.clone(),
        started_at_ms: state.started_at_ms,
        heartbeat_at_ms: state.config.clock.now_ms(),
        models: offer.models,
        allowed_model_hosts: offer.allowed_hosts,
        commands: Some(crate::runner::setup::setup().info()),
    }
}

/// Put this worker's heartbeat on the bus (off the mailbox).
fn announce(state: &NodeState) {
    let info = worker_info(state);
    let bus = state.ctx.bus.clone();
    tokio::spawn(async move {
        if let Err(e) = bus.put_worker(info).await {
            tracing::warn!(error = %e, "could not publish the worker heartbeat");
        }
    });
}

fn hostname() -> String {
    std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/etc/hostname").ok())
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "unknown".to_string())
}

fn maybe_stop(myself: &ActorRef<NodeMsg>, state: &mut NodeState) {
    if (state.draining || state.quiescing) && state.puller_done && state.running.is_empty() {
        if let Ok(mut exit) = state.exit.lock() {
            exit.get_or_insert(Ok(()));
        }
        for w in state.waiters.drain(..) {
            let _ = w.send(());
        }
        myself.stop(None);
    }
}

/// Pulls tasks while permits are free; see the module docs.
struct Puller {
    bus: Arc<dyn forkfleet_bus::Bus>,
    pool: String,
    wait: Duration,
    permits: Arc<Semaphore>,
    node: ActorRef<NodeMsg>,
    stop: watch::Receiver<bool>,
}

impl Puller {
    async fn run(mut self) {
        let error = self.pull_loop().await;
        let _ = self.node.cast(NodeMsg::PullerStopped { error });
    }

    async fn pull_loop(&mut self) -> Option<String> {
        loop {
            let permit = tokio::select! {
                biased;
                _ = self.stop.wait_for(|s| *s) => return None,
                p = self.permits.clone().acquire_owned() => match p {
                    Ok(p) => p,
                    Err(_) => return None,
                },
            };
            let delivery = loop {
                if *self.stop.borrow() {
                    return None;
                }
                let pulled = if self.bus.pull_cancel_safe() {
                    // Dropped as soon as the worker stops (no task is lost).
                    tokio::select! {
                        biased;
                        _ = self.stop.wait_for(|s| *s) => return None,
                        p = self.bus.pull_task(&self.pool, self.wait) => p,
                    }
                } else {
                    self.bus.pull_task(&self.pool, self.wait).await
                };
                match pulled {
                    Ok(Some(d)) => break d,
                    Ok(None) => {}
                    Err(BusError::Closed) => return Some(BusError::Closed.to_string()),
                    Err(e) => {
                        tracing::warn!(worker.pool = %self.pool, error = %e, "pulling a task failed; retrying");
                        tokio::time::sleep(self.wait.max(Duration::from_millis(100))).await;
                    }
                }
            };
            if *self.stop.borrow() {
                let _ = delivery.nak(None).await;
                return None;
            }
            match self.node.cast(NodeMsg::TaskPulled { delivery, permit }) {
                Ok(()) => {}
                Err(MessagingErr::SendErr(NodeMsg::TaskPulled { delivery, .. })) => {
                    // The node is gone: hand the task straight back.
                    let _ = delivery.nak(None).await;
                    return None;
                }
                Err(_) => return None,
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use forkfleet_bus::local::LocalBus;
    use forkfleet_bus::Bus;
    use forkfleet_shared::blob::MemBlobStore;
    use forkfleet_shared::clock::{Clock, ManualClock};
    use forkfleet_shared::protocol::{now_ms, WORKER_TTL_MS};

    /// A node's state as `pre_start` makes it, without starting the node.
    fn state(config: WorkerConfig, bus: Arc<dyn Bus>) -> NodeState {
        let ctx = Arc::new(WorkerCtx::new(
            config.worker_id,
            bus,
            1 << 20,
            Arc::new(crate::runner::Trees::new(0)),
            None,
            config.catalogue.clone(),
        ));
        NodeState {
            started_at_ms: config.clock.now_ms(),
            config,
            ctx,
            exit: Arc::new(Mutex::new(None)),
            running: HashMap::new(),
            stop_pull: watch::channel(false).0,
            stop_rx: None,
            puller_done: false,
            draining: false,
            quiescing: false,
            waiters: Vec::new(),
            hostname: "h".into(),
            version: "v".into(),
            heartbeat: None,
            _slots: catalog::WORKER_SLOTS.hold(&[], 0.0),
        }
    }

    /// A worker whose clock is more than the heartbeat ttl behind is not live; once its
    /// clock catches up, its next heartbeat is (the bus judges by its own wall clock).
    #[tokio::test]
    async fn heartbeats_are_stamped_by_the_worker_clock() {
        let behind = 2 * WORKER_TTL_MS;
        let clock = ManualClock::new(now_ms() - behind);
        let bus: Arc<dyn Bus> = Arc::new(LocalBus::new(Arc::new(MemBlobStore::new())));
        let config = WorkerConfig {
            clock: clock.shared(),
            ..WorkerConfig::default()
        };
        let id = config.worker_id;
        let state = state(config, bus.clone());
        let started = state.started_at_ms;

        let stale = worker_info(&state);
        assert_eq!(stale.heartbeat_at_ms, clock.now_ms());
        bus.put_worker(stale).await.unwrap();
        assert!(bus.workers().await.unwrap().is_empty());

        clock.advance(behind);
        let fresh = worker_info(&state);
        assert_eq!(fresh.heartbeat_at_ms, started + behind);
        assert_eq!(fresh.started_at_ms, started);
        bus.put_worker(fresh).await.unwrap();
        let live = bus.workers().await.unwrap();
        assert_eq!(live.iter().map(|w| w.worker_id).collect::<Vec<_>>(), [id]);
    }
}
