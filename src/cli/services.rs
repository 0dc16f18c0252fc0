//! `forkfleet coordinator` and `forkfleet worker`: the cluster services, until a signal.

use super::*;

#[derive(Debug, Args)]
pub struct CoordinatorArgs {
    /// The data directory of the run store (default: .forkfleet; $FORKFLEET_DATA).
    #[arg(long, value_name = "DIR")]
    pub data: Option<PathBuf>,
    /// The task queue branch tasks go to (default: default; $FORKFLEET_POOL).
    #[arg(long, value_name = "NAME")]
    pub pool: Option<String>,
    /// Seconds the coordinator lease lasts unless renewed; a standby takes over this long
    /// after the serving coordinator stops renewing it (default: 15;
    /// $FORKFLEET_COORDINATOR_LEASE_TTL_S).
    #[arg(long, value_name = "SECONDS")]
    pub lease_ttl_s: Option<u64>,
    /// Serve GET /metrics, /healthz and /readyz on HOST:PORT (default: off;
    /// $FORKFLEET_HTTP_ADDR).
    #[arg(long, value_name = "HOST:PORT")]
    pub http_addr: Option<String>,
    #[command(flatten)]
    pub config: ConfigArgs,
}

#[derive(Debug, Args)]
pub struct WorkerArgs {
    /// The task queue to pull from (default: default; $FORKFLEET_POOL).
    #[arg(long, value_name = "NAME")]
    pub pool: Option<String>,
    /// Branches run at once (default: 64; $FORKFLEET_CONCURRENCY).
    #[arg(long, value_name = "N")]
    pub concurrency: Option<usize>,
    /// On SIGTERM, seconds running branches get to finish before they are handed back
    /// (default: 30; $FORKFLEET_DRAIN_GRACE_S).
    #[arg(long, value_name = "SECONDS")]
    pub drain_grace_s: Option<u64>,
    /// Megabytes of branches' command trees kept on disk between `run_command` calls, least
    /// recently used removed first; 0 keeps none (default: 2048; $FORKFLEET_TREE_CACHE_MB).
    #[arg(long, value_name = "MB")]
    pub tree_cache_mb: Option<u64>,
    /// Serve GET /metrics, /healthz and /readyz on HOST:PORT (default: off;
    /// $FORKFLEET_HTTP_ADDR).
    #[arg(long, value_name = "HOST:PORT")]
    pub http_addr: Option<String>,
    #[command(flatten)]
    pub config: ConfigArgs,
}

pub(crate) async fn cmd_coordinator(args: CoordinatorArgs) -> anyhow::Result<()> {
    let config = args.config.load(Layer {
        data: args.data,
        pool: args.pool,
        coordinator: CoordinatorLayer {
            lease_ttl_s: args.lease_ttl_s,
            ..CoordinatorLayer::default()
        },
        http_addr: args.http_addr,
        ..Layer::default()
    })?;
    if args.config.print_config {
        print!("{}", config.render());
        return Ok(());
    }
    service::run_coordinator(&config, service::shutdown_signal()).await
}

pub(crate) async fn cmd_worker(args: WorkerArgs) -> anyhow::Result<()> {
    let config = args.config.load(Layer {
        pool: args.pool,
        concurrency: args.concurrency,
        drain_grace_s: args.drain_grace_s,
        tree_cache_mb: args.tree_cache_mb,
        http_addr: args.http_addr,
        ..Layer::default()
    })?;
    if args.config.print_config {
        print!("{}", config.render());
        return Ok(());
    }
    service::run_worker(&config, service::shutdown_signal()).await
}
