//! # forkfleet-worker
//!
//! A worker pulls branch tasks from the bus, runs each branch as an agent loop against a
//! copy-on-write overlay of the fork's workspace snapshot, and streams every event of the
//! branch back over the bus to the coordinator.
//!
//! ## Layout
//! - [`run`] / [`start`]: the service entry points (`run(config, bus, shutdown)` for the
//!   `forkfleet worker` command, [`start`] + [`WorkerHandle::shutdown`] for embedding).
//! - `node`: the node actor. Pulls tasks under a concurrency limit, spawns one branch
//!   agent per task, keeps tasks alive with confirmed `in_progress` extensions (its lease,
//!   `lease`), acks finished tasks and naks the ones it hands back.
//! - `agent`: the branch agent actor: the agent loop (budget reservation in strict mode,
//!   model call cancellable by control commands, usage, tools, terminal or paused status),
//!   publishing events with consecutive seqs. Its requests to the coordinator are tried
//!   up to [`COORDINATOR_TRIES`] times. In `agent/`: `turn` (one turn of the loop),
//!   `control` (control commands), `load` (loading and replaying a branch),
//!   `coordinator` (`coord.resume` and `coord.budget` requests and their retries).
//! - [`provider`]: the [`provider::ModelProvider`] trait, the scripted provider, and the
//!   OpenAI-compatible and Anthropic providers over one shared HTTP client
//!   (`provider::http`: the client, key, retries and errors; `provider::openai`,
//!   `provider::anthropic`, `provider::scripted`).
//! - `lease`: a delivered task (`TaskLease`), shared by the node and the task's agent and
//!   settled (acked or nak'ed) exactly once.
//! - [`forktools`]: the fork tools of an agent whose task has `forking` (ADR 14).
//! - `resolve`: resolve jobs served on `worker.resolve`: a test command on a branch's
//!   materialised tree, a judge's call with one retry of an invalid verdict.
//! - [`tools`]: read, write, edit, delete, list, glob and grep over the overlay, and
//!   `run_command`. In `tools/`: `files` (read, write, edit, delete, list), `search` (glob,
//!   grep), `command` (`run_command`, and taking back what the command changed).
//! - [`toolspec`]: what the model is offered and what a tool answers: every tool's
//!   definition ([`toolspec::ToolSpec`]) as data, the static tool lists a branch is offered
//!   with their JSON sizes measured once, and [`toolspec::ToolOutcome`]. `provider`, `tools`
//!   and `forktools` use it; it uses none of them.
//! - [`runner`]: materialise a branch's tree in a temporary directory and run a command in
//!   it (no shell, cleared environment, timeout and cancel kill the process group), then
//!   read back what the command changed. In `runner/`: `materialize` (write a tree),
//!   `command` (run a command), `changes` (compare the directory with the tree).
//! - `metrics`: a model call's count, duration and tokens (the GenAI metrics); the node
//!   holds the running branches' and the slots' gauges.
//! - `context`: what every branch of a worker shares: the bus, the blob cache, the
//!   providers, and the decoded prefixes and manifests (one decode per fork).
//! - [`genai`]: the GenAI spans of a model call (`chat {model}`) and a tool call
//!   (`execute_tool {name}`), after the OpenTelemetry GenAI conventions.
//! - `warmup`: the first call of a fork's branches on this worker goes alone, so the rest
//!   hit the provider's prompt cache (ADR 26).
//! - [`cache`]: the per-worker blob cache and the decoded-blob memo shared by branches.
//! - [`reaper`]: a `forkfleet worker` process is a subreaper and reaps the orphans its
//!   commands leave (never a command it started itself; ADR 43).
//! - [`error`]: the one error type, [`WorkerError`].
//!
//! ## Supervision tree
//!
//! ```text
//! WorkerHandle ──▶ NodeActor                    (one per worker; unsupervised)
//!                   ├── puller task             (pulls tasks, one semaphore permit each)
//!                   ├── heartbeat timer         (the worker's info on the bus)
//!                   ├── lease extenders         (in_progress, one per running task)
//!                   ├── BranchAgent  run A      (spawn_linked: the node sees it end)
//!                   ├── BranchAgent  run B
//!                   └── ...                     (at most `concurrency` at once)
//! ```
//!
//! An agent that ends without having finished its branch (handed back at shutdown, or
//! failed on a bus or blob store error) has its task nak'ed by the node, so another
//! attempt picks it up; a finished branch's task is acked right after its terminal status
//! is published, and a paused branch's right after its `paused` status (a top-up enqueues
//! a new task for it).

pub mod cache;
pub mod error;
pub mod forktools;
pub mod genai;
pub mod provider;
pub mod reaper;
pub mod runner;
pub mod tools;
pub mod toolspec;

mod agent;
mod context;
mod lease;
mod metrics;
mod node;
mod resolve;
mod warmup;

pub use agent::COORDINATOR_TRIES;
pub use error::WorkerError;

use forkfleet_bus::Bus;
use forkfleet_shared::clock::Clock;
use forkfleet_shared::ids::WorkerId;
use forkfleet_shared::protocol::DEFAULT_POOL;
use node::{NodeActor, NodeArgs, NodeHandle};
use ractor::Actor;
use std::future::Future;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Resolve jobs a worker runs at once by default: test commands are CPU-bound.
pub const DEFAULT_RESOLVE_CONCURRENCY: usize = 4;

/// How a worker runs.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// The task queue to pull from.
    pub pool: String,
    /// Most branches run at once.
    pub concurrency: usize,
    pub worker_id: WorkerId,
    /// How long one pull waits for a task before looking again.
    pub pull_wait: Duration,
    /// How often the worker's info is published, and running tasks' ack deadlines are
    /// extended at most (at least three times per ack wait, ADR 18).
    pub heartbeat: Duration,
    /// Bytes of blobs the worker keeps in memory.
    pub blob_cache_bytes: u64,
    /// Bytes of branches' command trees the worker keeps on disk between `run_command`
    /// calls (`runner::Trees`); 0 keeps none (every call starts from a fresh copy).
    pub tree_cache_bytes: u64,
    /// Command trees shared with the other workers of this process, instead of the
    /// worker's own (`tree_cache_bytes` is then theirs): the embedded workers of one
    /// process make one base per fork between them, not one each.
    pub trees: Option<Arc<runner::Trees>>,
    /// On a graceful stop (SIGTERM), how long running branches may take to finish before
    /// the rest are handed back to the queue for another worker.
    pub drain_grace: Duration,
    /// Where the scripted models append every call they complete (see
    /// [`provider::scripted`]); `None`: nowhere. The services set it from
    /// [`provider::scripted::USAGE_LOG_ENV`] when they start.
    pub scripted_usage_log: Option<PathBuf>,
    /// Resolve jobs (tests on branch trees, judge calls) run at once.
    pub resolve_concurrency: usize,
    /// The time the worker's heartbeats are stamped with (the system clock; tests may give
    /// a manual one).
    pub clock: Arc<dyn Clock>,
    /// The real models this worker offers, where their keys are, and the hosts a spec's own
    /// `base_url` may point at (ADR 16); advertised in the heartbeat, keys never.
    pub catalogue: Arc<forkfleet_shared::catalogue::ModelCatalogue>,
    /// The first call of a fork's branches that use a prompt cache goes alone on this
    /// worker, the others waiting for it to warm the cache (`warmup`, ADR 26); `false`: every
    /// branch calls at once.
    pub prompt_cache_warmup: bool,
}

impl Default for WorkerConfig {
    fn default() -> Self {
        Self {
            pool: DEFAULT_POOL.to_string(),
            concurrency: 64,
            worker_id: WorkerId::new(),
            pull_wait: Duration::from_millis(200),
            heartbeat: Duration::from_secs(10),
            blob_cache_bytes: cache::DEFAULT_BLOB_CACHE_BYTES,
            tree_cache_bytes: runner::DEFAULT_TREE_CACHE_BYTES,
            trees: None,
            drain_grace: Duration::from_secs(30),
            scripted_usage_log: None,
            resolve_concurrency: DEFAULT_RESOLVE_CONCURRENCY,
            clock: forkfleet_shared::clock::system(),
            catalogue: Arc::default(),
            prompt_cache_warmup: true,
        }
    }
}

impl WorkerConfig {
    fn validate(&self) -> Result<(), WorkerError> {
        if self.concurrency == 0 {
            return Err(WorkerError::Config("concurrency must be at least 1".into()));
        }
        if self.pool.is_empty() {
            return Err(WorkerError::Config("pool must not be empty".into()));
        }
        if self.pull_wait.is_zero() {
            return Err(WorkerError::Config(
                "pull_wait must be more than 0 (a zero wait would spin)".into(),
            ));
        }
        if self.resolve_concurrency == 0 {
            return Err(WorkerError::Config(
                "resolve_concurrency must be at least 1".into(),
            ));
        }
        if self.heartbeat.is_zero() {
            return Err(WorkerError::Config("heartbeat must be more than 0".into()));
        }
        Ok(())
    }
}

/// A worker running in this process.
pub struct WorkerHandle {
    worker_id: WorkerId,
    node: NodeHandle,
    join: tokio::task::JoinHandle<()>,
    exit: node::NodeExit,
    /// The resolve job server ([`resolve`]); aborted when the worker stops.
    resolve: tokio::task::JoinHandle<()>,
}

impl WorkerHandle {
    pub fn worker_id(&self) -> WorkerId {
        self.worker_id
    }

    /// Branches running now.
    pub async fn running(&self) -> Result<usize, WorkerError> {
        self.node.running().await.map_err(WorkerError::NodeStopped)
    }

    /// True once the node has stopped (after a shutdown, or on its own).
    pub fn is_stopped(&self) -> bool {
        self.join.is_finished()
    }

    /// Stop pulling, hand back the branches still running (a model call in flight is
    /// dropped, other steps finish; each task is nak'ed), and wait until the node has
    /// stopped.
    pub async fn shutdown(mut self) -> Result<(), WorkerError> {
        if !self.join.is_finished() {
            // An error here means the node stopped meanwhile; the join below tells why.
            let _ = self.node.shutdown().await;
        }
        self.wait().await
    }

    /// Stop gracefully: pull nothing more, let running branches finish for up to `grace`,
    /// then hand back (nak) whatever still runs, and wait until the node has stopped.
    pub async fn drain(mut self, grace: Duration) -> Result<(), WorkerError> {
        if !self.join.is_finished() {
            match tokio::time::timeout(grace, self.node.drain()).await {
                Ok(_) => {}
                Err(_) => {
                    tracing::info!(worker.id = %self.worker_id, grace_s = grace.as_secs_f64(), "drain grace over: handing back the branches still running");
                    let _ = self.node.shutdown().await;
                }
            }
        }
        self.wait().await
    }

    /// Wait for the node to stop, and say whether it stopped cleanly.
    async fn wait(&mut self) -> Result<(), WorkerError> {
        let joined = (&mut self.join).await;
        self.resolve.abort();
        let exit = match self.exit.lock() {
            Ok(mut exit) => exit.take(),
            Err(_) => None,
        };
        match (exit, joined) {
            (Some(Ok(())), _) => Ok(()),
            (Some(Err(reason)), _) => Err(WorkerError::NodeStopped(reason)),
            (None, Err(e)) => Err(WorkerError::NodeStopped(e.to_string())),
            (None, Ok(())) => Err(WorkerError::NodeStopped("the worker node crashed".into())),
        }
    }
}

/// Start a worker in this process.
pub async fn start(config: WorkerConfig, bus: Arc<dyn Bus>) -> Result<WorkerHandle, WorkerError> {
    config.validate()?;
    // What the command sandbox can enforce on this kernel, said once; the catalogue's key
    // files are kept out of every command's reach.
    runner::sandbox::log_support();
    runner::sandbox::protect(
        config
            .catalogue
            .models
            .values()
            .filter_map(|m| m.api_key_file.clone()),
    );
    let worker_id = config.worker_id;
    let mut ctx = context::WorkerCtx::new(
        worker_id,
        bus,
        config.blob_cache_bytes,
        config
            .trees
            .clone()
            .unwrap_or_else(|| Arc::new(runner::Trees::new(config.tree_cache_bytes))),
        config.scripted_usage_log.clone(),
        config.catalogue.clone(),
    );
    if !config.prompt_cache_warmup {
        ctx.warmups = None;
    }
    let ctx = Arc::new(ctx);
    let exit = Arc::new(Mutex::new(None));
    let resolve = tokio::spawn(resolve::serve(ctx.clone(), config.resolve_concurrency));
    let args = NodeArgs {
        config,
        ctx,
        exit: exit.clone(),
    };
    let (node, join) = match Actor::spawn(None, NodeActor, args).await {
        Ok(spawned) => spawned,
        Err(e) => {
            resolve.abort();
            return Err(WorkerError::Spawn(e.to_string()));
        }
    };
    Ok(WorkerHandle {
        worker_id,
        node: NodeHandle::new(node),
        join,
        exit,
        resolve,
    })
}

/// Run a worker until `shutdown` completes, then drain: no new tasks, running branches get
/// `config.drain_grace` to finish, and what still runs is handed back to the queue.
/// Returns early with an error if the node stops on its own (e.g. the bus went away).
pub async fn run(
    config: WorkerConfig,
    bus: Arc<dyn Bus>,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), WorkerError> {
    let grace = config.drain_grace;
    let heartbeats = bus.clone();
    let mut handle = start(config, bus).await?;
    tokio::select! {
        _ = shutdown => {}
        res = handle.wait() => {
            return match res {
                Ok(()) => Err(WorkerError::NodeStopped("the node stopped without a shutdown".into())),
                Err(e) => Err(e),
            };
        }
    }
    let worker_id = handle.worker_id;
    tracing::info!(worker.id = %worker_id, "worker draining");
    let drained = handle.drain(grace).await;
    // Stopped cleanly: leave the list of live workers now, not when the heartbeat expires.
    if let Err(e) = heartbeats.remove_worker(worker_id).await {
        tracing::warn!(worker.id = %worker_id, error = %e, "could not remove the worker heartbeat; it expires on its own");
    }
    drained
}
