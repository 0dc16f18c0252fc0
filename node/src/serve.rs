//! A coordinator served over a bus: open its run store, start it, answer its API until
//! `shutdown`, then stop cleanly (events applied so far flushed and acked, store flushed).

use anyhow::Context;
use forkfleet_bus::nats::{NatsBus, NatsConfig};
use forkfleet_bus::Bus;
use forkfleet_coordinator::service::ApiServer;
use forkfleet_coordinator::{Coordinator, CoordinatorConfig, CoordinatorHandle, RunStore};
use std::future::Future;
use std::path::Path;
use std::sync::Arc;

/// Open (or create) the run store under `data`.
pub fn open_store(data: &Path) -> anyhow::Result<RunStore> {
    std::fs::create_dir_all(data)
        .with_context(|| format!("cannot create data dir `{}`", data.display()))?;
    Ok(RunStore::open(data)?)
}

/// Connect to NATS (streams, buckets and consumers are created if missing).
pub async fn connect_nats(nats: NatsConfig) -> anyhow::Result<Arc<dyn Bus>> {
    // Its errors name the (redacted) URL already.
    Ok(Arc::new(NatsBus::connect(nats).await?))
}

/// Who hears that a served coordinator answers its API, and that it stops answering (a
/// service's readiness, the HTTP API's handle on it). `()` hears nothing.
pub trait Watch: Sync {
    /// The coordinator answers its API now.
    fn serving(&self, _coordinator: CoordinatorHandle, _bus: &Arc<dyn Bus>) {}
    /// `shutdown` completed: the coordinator stops answering.
    fn stopping(&self) {}
}

impl Watch for () {}

/// Run a coordinator with `config` over `store` and `bus`, answering the API until
/// `shutdown`, then stop it.
pub async fn serve_coordinator(
    store: RunStore,
    bus: Arc<dyn Bus>,
    config: CoordinatorConfig,
    shutdown: impl Future<Output = ()>,
    watch: &dyn Watch,
) -> anyhow::Result<()> {
    let dir = store.dir().to_path_buf();
    let pool = config.pool.clone();
    let coordinator = Coordinator::start(config, store, bus.clone()).await?;
    let served = match ApiServer::bind(coordinator.handle(), bus.clone()).await {
        Ok(server) => {
            tracing::info!(data = %dir.display(), pool = %pool, "coordinator.ready");
            watch.serving(coordinator.handle(), &bus);
            server
                .run(async {
                    shutdown.await;
                    watch.stopping();
                })
                .await
        }
        Err(e) => Err(e),
    };
    tracing::info!("coordinator.stopping");
    let stopped = coordinator.shutdown().await;
    served?;
    stopped?;
    Ok(())
}
