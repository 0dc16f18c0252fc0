//! The two cluster services as library functions, so `main` stays thin and tests (and the
//! embedded mode) can start them in-process:
//!
//! - [`run_coordinator`]: open the run store under `data`, connect to NATS, start the
//!   coordinator, answer the API ([`forkfleet_coordinator::service::serve`]) until
//!   `shutdown`, then stop cleanly (events applied so far flushed and acked, store flushed).
//! - [`run_worker`]: connect to NATS and run a worker node on `pool` until `shutdown`, then
//!   drain (running branches get `drain_grace` to finish; the rest go back to the queue).
//!
//! [`serve_coordinator`] and [`serve_worker`] are the same over a bus the caller already
//! has (a `LocalBus` in tests).

use crate::config::{Config, Role};
use crate::BadInput;
use anyhow::Context;
use forkfleet_bus::nats::{NatsBus, NatsConfig};
use forkfleet_bus::Bus;
use forkfleet_coordinator::service::ApiServer;
use forkfleet_coordinator::{Coordinator, CoordinatorConfig, RunStore};
use forkfleet_shared::ids::WorkerId;
use forkfleet_worker::provider::scripted;
use forkfleet_worker::WorkerConfig;
use std::future::Future;
use std::path::Path;
use std::sync::Arc;

/// Connect to NATS with the configured settings for `role` (ADR 17: its reply inboxes,
/// whether it creates streams and buckets); without a URL, say how to give one.
pub async fn connect(config: &Config, role: Role) -> anyhow::Result<Arc<dyn Bus>> {
    let nats = config.nats_config_for(role).ok_or_else(|| {
        let role = match role {
            Role::Coordinator => "coordinator",
            Role::Worker => "worker",
            Role::Client => "client",
        };
        BadInput(format!(
            "forkfleet {role} needs a NATS server: pass --nats URL (or set FORKFLEET_NATS_URL, or [nats] url in the --config file)"
        ))
    })?;
    connect_nats(nats).await
}

/// Connect to NATS (streams, buckets and consumers are created if missing).
pub async fn connect_nats(nats: NatsConfig) -> anyhow::Result<Arc<dyn Bus>> {
    // Its errors name the (redacted) URL already.
    Ok(Arc::new(NatsBus::connect(nats).await?))
}

/// `forkfleet coordinator`: see the module documentation.
pub async fn run_coordinator(
    config: &Config,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    let store = open_store(&config.data.value)?;
    let bus = connect(config, Role::Coordinator).await?;
    serve_coordinator_with(store, bus, config, shutdown).await
}

/// Open (or create) the run store under `data`.
pub fn open_store(data: &Path) -> anyhow::Result<RunStore> {
    std::fs::create_dir_all(data)
        .with_context(|| format!("cannot create data dir `{}`", data.display()))?;
    Ok(RunStore::open(data)?)
}

/// Run a coordinator over `store` and `bus`, answering the API until `shutdown`.
pub async fn serve_coordinator(
    store: RunStore,
    bus: Arc<dyn Bus>,
    pool: &str,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    let config = CoordinatorConfig {
        pool: pool.to_string(),
        ..CoordinatorConfig::default()
    };
    serve_coordinator_config(store, bus, config, shutdown).await
}

/// [`serve_coordinator`] with the pool and the `[access]` grants of `config`.
pub async fn serve_coordinator_with(
    store: RunStore,
    bus: Arc<dyn Bus>,
    config: &Config,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    let coordinator = CoordinatorConfig {
        pool: config.pool.value.clone(),
        access: config.access.clone(),
        ..CoordinatorConfig::default()
    };
    serve_coordinator_config(store, bus, coordinator, shutdown).await
}

async fn serve_coordinator_config(
    store: RunStore,
    bus: Arc<dyn Bus>,
    config: CoordinatorConfig,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    let dir = store.dir().to_path_buf();
    let pool = config.pool.clone();
    let coordinator = Coordinator::start(config, store, bus.clone()).await?;
    let served = match ApiServer::bind(coordinator.handle(), bus).await {
        Ok(server) => {
            tracing::info!(data = %dir.display(), pool = %pool, "coordinator.ready");
            server.run(shutdown).await
        }
        Err(e) => Err(e),
    };
    tracing::info!("coordinator.stopping");
    let stopped = coordinator.shutdown().await;
    served?;
    stopped?;
    Ok(())
}

/// `forkfleet worker`: see the module documentation.
pub async fn run_worker(
    config: &Config,
    shutdown: impl Future<Output = ()> + Send,
) -> anyhow::Result<()> {
    let bus = connect(config, Role::Worker).await?;
    serve_worker(bus, config, shutdown).await
}

/// Run a worker node on `bus` with the pool, concurrency and drain grace of `config`; its
/// scripted models log their calls where `FORKFLEET_SCRIPTED_USAGE_LOG` says (read once,
/// now), if it is set.
pub async fn serve_worker(
    bus: Arc<dyn Bus>,
    config: &Config,
    shutdown: impl Future<Output = ()> + Send,
) -> anyhow::Result<()> {
    let worker = WorkerConfig {
        pool: config.pool.value.clone(),
        concurrency: config.concurrency.value,
        drain_grace: config.drain_grace.value,
        worker_id: WorkerId::new(),
        scripted_usage_log: scripted::usage_log_from_env(),
        catalogue: Arc::new(config.catalogue()),
        ..WorkerConfig::default()
    };
    tracing::info!(
        worker.id = %worker.worker_id,
        pool = %worker.pool,
        concurrency = worker.concurrency,
        drain_grace_s = worker.drain_grace.as_secs_f64(),
        models = worker.catalogue.models.len(),
        allowed_model_hosts = worker.catalogue.allowed_hosts.len(),
        "worker.ready"
    );
    forkfleet_worker::run(worker, bus, shutdown).await?;
    Ok(())
}

/// Completes on SIGINT or SIGTERM (Ctrl-C elsewhere). If the handlers cannot be
/// installed, it never completes and the signals keep their default effect.
pub async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match (
            signal(SignalKind::interrupt()),
            signal(SignalKind::terminate()),
        ) {
            (Ok(mut int), Ok(mut term)) => {
                let name = tokio::select! {
                    _ = int.recv() => "SIGINT",
                    _ = term.recv() => "SIGTERM",
                };
                tracing::info!(signal = name, "shutdown requested");
            }
            (Err(e), _) | (_, Err(e)) => {
                tracing::warn!(error = %e, "cannot install signal handlers");
                std::future::pending::<()>().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}
