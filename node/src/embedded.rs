//! The embedded mode: coordinator and workers in one process on the local bus. Its
//! coordinator is reached through [`Embedded::client`], like a remote one, and by other
//! processes on this machine through the Unix socket `<data>/api.sock`
//! (`forkfleet_client::local`), since the run store is locked to this process while it
//! runs.

use anyhow::Context;
use forkfleet_bus::local::LocalBus;
use forkfleet_bus::Bus;
use forkfleet_client::Client;
use forkfleet_coordinator::service::ApiServer;
use forkfleet_coordinator::{Coordinator, CoordinatorConfig, CoordinatorHandle, RunStore};
use forkfleet_shared::catalogue::ModelCatalogue;
use forkfleet_shared::ids::WorkerId;
use forkfleet_worker::provider::scripted;
use forkfleet_worker::{WorkerConfig, WorkerHandle};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Bytes of blobs each in-process worker keeps in memory (16 MiB): the store it reads them
/// from is in this process (see [`Embedded::start`]).
pub const EMBEDDED_BLOB_CACHE_BYTES: u64 = 16 << 20;

/// How many in-process workers, and how many branches each runs at once.
#[derive(Debug, Clone)]
pub struct EmbeddedOptions {
    pub workers: usize,
    pub concurrency: usize,
    /// Enqueue again the unfinished branches of forks a stopped process left behind (the
    /// local bus's queue lives in memory), so these workers finish them.
    pub requeue_unfinished: bool,
    /// The workers' model catalogue and allow-list (the configuration's, ADR 16).
    pub catalogue: Arc<ModelCatalogue>,
    /// The workers' prompt-cache warm-up (`WorkerConfig::prompt_cache_warmup`).
    pub prompt_cache_warmup: bool,
}

impl Default for EmbeddedOptions {
    fn default() -> Self {
        Self {
            workers: 2,
            concurrency: 64,
            requeue_unfinished: false,
            catalogue: Arc::default(),
            prompt_cache_warmup: true,
        }
    }
}

/// What stops a service task of [`Embedded`], and the task.
type Service = (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<()>,
);

/// A running embedded system.
pub struct Embedded {
    pub data_dir: PathBuf,
    pub bus: Arc<dyn Bus>,
    coordinator: Coordinator,
    workers: Vec<WorkerHandle>,
    /// The API served on the local bus, for agents' fork tools; ends when this is dropped.
    api: Option<Service>,
    /// The API served on `<data>/api.sock`, for other processes' client commands; ends (and
    /// removes the socket file) when this is dropped.
    socket: Option<Service>,
}

impl Embedded {
    /// Open the store under `data_dir` and start the coordinator and `opts.workers` workers.
    /// With `workers == 0` only the coordinator runs (enough to read or merge a fork). The
    /// workers' scripted models log their calls where `FORKFLEET_SCRIPTED_USAGE_LOG` says
    /// (read once, now), if it is set.
    pub async fn start(data_dir: &Path, opts: EmbeddedOptions) -> anyhow::Result<Self> {
        Self::start_with_usage_log(data_dir, opts, scripted::usage_log_from_env()).await
    }

    /// [`Embedded::start`], the workers' scripted models logging their calls to
    /// `scripted_usage_log` (`None`: nowhere), whatever the environment says.
    pub async fn start_with_usage_log(
        data_dir: &Path,
        opts: EmbeddedOptions,
        scripted_usage_log: Option<PathBuf>,
    ) -> anyhow::Result<Self> {
        std::fs::create_dir_all(data_dir)
            .with_context(|| format!("cannot create data dir `{}`", data_dir.display()))?;
        let store = RunStore::open(data_dir)?;
        let bus: Arc<dyn Bus> = Arc::new(LocalBus::new(store.blob_store()));
        let coordinator = Coordinator::start(
            CoordinatorConfig {
                // Its workers are in this process: the calls a previous run's
                // reservations held died with it.
                release_reservations_at_start: true,
                // Its workers' catalogue, for the commands that start none.
                idle_offer: Some(opts.catalogue.offer()),
                ..CoordinatorConfig::default()
            },
            store,
            bus.clone(),
        )
        .await?;
        // Agents with the fork tools call the coordinator's API over the bus, as in a
        // cluster.
        let server = ApiServer::bind(coordinator.handle(), bus.clone()).await?;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let api = tokio::spawn(async move {
            if let Err(e) = server
                .run(async {
                    let _ = stopped.await;
                })
                .await
            {
                tracing::warn!(error = %e, "the embedded API service stopped");
            }
        });
        // Other processes' client commands (`fork steer`, `fork watch`, ... with the same
        // --data) cannot open the store this process holds: they come through the socket.
        let socket = serve_socket(data_dir, coordinator.handle());
        let mut workers = Vec::with_capacity(opts.workers);
        // One set of command trees for the process: a fork's base is made once, not once
        // per worker (ADR 31).
        let trees = (opts.workers > 0).then(|| {
            std::sync::Arc::new(forkfleet_worker::runner::Trees::new(
                forkfleet_worker::runner::DEFAULT_TREE_CACHE_BYTES,
            ))
        });
        for _ in 0..opts.workers {
            let config = WorkerConfig {
                concurrency: opts.concurrency,
                worker_id: WorkerId::new(),
                scripted_usage_log: scripted_usage_log.clone(),
                catalogue: opts.catalogue.clone(),
                prompt_cache_warmup: opts.prompt_cache_warmup,
                // The blobs are in this process's store already (sled, with its own
                // cache): a worker's copy of them would only double the memory a large
                // workspace takes.
                blob_cache_bytes: EMBEDDED_BLOB_CACHE_BYTES,
                // A pull on the in-process bus wakes as soon as a task is queued, and is
                // dropped as soon as the worker stops: its wait bounds nothing a user sees.
                pull_wait: std::time::Duration::from_millis(50),
                trees: trees.clone(),
                ..WorkerConfig::default()
            };
            workers.push(forkfleet_worker::start(config, bus.clone()).await?);
        }
        if opts.requeue_unfinished && opts.workers > 0 {
            coordinator.handle().requeue_unfinished().await?;
        }
        Ok(Self {
            data_dir: data_dir.to_path_buf(),
            bus,
            coordinator,
            workers,
            api: Some((stop, api)),
            socket,
        })
    }

    pub fn coordinator(&self) -> CoordinatorHandle {
        self.coordinator.handle()
    }

    /// The coordinator as the CLI commands use it (the same calls as a remote one); its
    /// hints name this data directory.
    pub fn client(&self) -> Client {
        Client::in_process(self.coordinator.handle(), self.bus.clone())
            .with_reach(data_reach(&self.data_dir))
    }

    /// Stop serving other processes, then the workers, then the coordinator (which flushes
    /// the store).
    pub async fn shutdown(mut self) -> anyhow::Result<()> {
        if let Some((stop, socket)) = self.socket.take() {
            let _ = stop.send(());
            let _ = socket.await;
        }
        // All at once: each drops its pull at once (the in-process bus's pulls take no
        // task until they return).
        for stopped in
            futures::future::join_all(self.workers.into_iter().map(|w| w.shutdown())).await
        {
            stopped?;
        }
        if let Some((stop, api)) = self.api.take() {
            let _ = stop.send(());
            let _ = api.await;
        }
        self.coordinator.shutdown().await?;
        Ok(())
    }
}

/// ` --data DIR`, the directory absolute and shell-quoted: what a printed command needs to
/// reach the same run store from any directory.
pub fn data_reach(dir: &Path) -> String {
    let dir = std::path::absolute(dir).unwrap_or_else(|_| dir.to_path_buf());
    format!(
        " --data {}",
        forkfleet_client::render::shell_word(&dir.to_string_lossy())
    )
}

/// Serve the coordinator's API on `<data_dir>/api.sock` (mode 0600) for the client commands
/// of other processes; the server stops, and removes the socket file, when the returned
/// sender is used or dropped. A socket that cannot be bound (e.g. a path too long for a
/// Unix socket) is logged and skipped: this process works as before, others get the lock
/// error.
#[cfg(unix)]
fn serve_socket(data_dir: &Path, handle: CoordinatorHandle) -> Option<Service> {
    use forkfleet_client::local::{socket_path, SocketServer};
    let path = socket_path(data_dir);
    match SocketServer::bind(&path) {
        Ok(server) => {
            let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
            let task = tokio::spawn(server.run(handle, async {
                let _ = stopped.await;
            }));
            Some((stop, task))
        }
        Err(e) => {
            tracing::warn!(
                api.socket = %path.display(),
                error = %e,
                "cannot serve the API on the local socket; other processes cannot reach this one"
            );
            None
        }
    }
}

/// No Unix sockets: other processes cannot reach this one.
#[cfg(not(unix))]
fn serve_socket(_data_dir: &Path, _handle: CoordinatorHandle) -> Option<Service> {
    None
}
