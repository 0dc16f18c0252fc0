//! The two cluster services as library functions, so `main` stays thin and tests (and the
//! embedded mode) can start them in-process:
//!
//! - [`run_coordinator`]: connect to NATS, take the coordinator lease ([`forkfleet_coordinator::lease`]: standing
//!   by while another coordinator of the same store holds it, refusing to serve beside one
//!   of another store), open the run store under `data`, start the coordinator, answer the
//!   API ([`forkfleet_coordinator::service::serve`]) until `shutdown`, then stop cleanly
//!   (events applied so far flushed and acked, store flushed) and release the lease. A
//!   lease lost (NATS unreachable for a TTL) stops serving the same way and goes back to
//!   standing by until it can be taken again: an outage of NATS never ends the process.
//! - [`run_worker`]: connect to NATS and run a worker node on `pool` until `shutdown`, then
//!   drain (running branches get `drain_grace` to finish; the rest go back to the queue).
//!
//! [`serve_coordinator_with`] and [`serve_worker`] are the same over a bus the caller
//! already has (a `LocalBus` in tests); what needs no configuration is `forkfleet-node`'s.
//!
//! Both services serve `GET /metrics`, `/healthz` and `/readyz` on `http_addr` when it is
//! set ([`http`]).

use crate::config::{Config, Role};
use crate::BadInput;
use forkfleet_bus::nats::{NatsBus, NatsConfig};
use forkfleet_bus::Bus;
use forkfleet_coordinator::{CoordinatorConfig, CoordinatorHandle, RunStore};
pub use forkfleet_node::serve::{connect_nats, open_store};
use forkfleet_shared::ids::WorkerId;
use forkfleet_worker::provider::scripted;
use forkfleet_worker::WorkerConfig;
use std::future::Future;
use std::path::Path;
use std::sync::Arc;

pub use forkfleet_http::endpoint as http;
pub use forkfleet_http::endpoint::Readiness;

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
    if role == Role::Worker {
        warn_if_unrestricted(&nats, "worker");
    }
    connect_nats(nats).await
}

/// Say loudly, at start, that a service connects to NATS with no identity: on a server
/// without roles (`forkfleet cluster auth`) anyone who reaches it can do anything.
fn warn_if_unrestricted(nats: &NatsConfig, role: &str) {
    use forkfleet_bus::nats::{redact_url, NatsAuth};
    let anonymous = matches!(nats.auth, NatsAuth::None)
        && redact_url(&nats.url) == nats.url
        && nats.tls.client_cert.is_none();
    if anonymous {
        tracing::warn!(
            nats.url = %nats.url,
            "UNRESTRICTED CLUSTER: this {role} connects to NATS without credentials. Unless the server maps anonymous clients to a restricted user, anyone who can reach it can enqueue tasks, steer, take over or fail any branch, and read every event and blob. Give each role its own permissions with `forkfleet cluster auth` (docs/CLUSTER.md, \"Security\")"
        );
    }
}

/// `forkfleet coordinator`: see the module documentation. With `http_addr`, the HTTP
/// endpoint ([`http`]) runs from start to stop; the coordinator is ready once it serves
/// (not while it connects, stands by for the lease, opens its store or stops) and while
/// its NATS connection is up.
pub async fn run_coordinator(
    config: &Config,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    let nats = config.nats_config_for(Role::Coordinator).ok_or_else(|| {
        BadInput(
            "forkfleet coordinator needs a NATS server: pass --nats URL (or set FORKFLEET_NATS_URL, or [nats] url in the --config file)".to_string(),
        )
    })?;
    let readiness = Readiness::new("connecting to NATS");
    let api = api_http(config);
    let endpoint = http::start_if(config.http_addr.value, &readiness, Some(api.clone())).await?;
    let result = coordinate(config, nats, &readiness, &api.slot, shutdown).await;
    http::stop(endpoint).await;
    result
}

/// The coordinator's HTTP API: its tokens and audit log from `config`; it answers once
/// the coordinator serves.
pub fn api_http(config: &Config) -> std::sync::Arc<crate::http_api::ApiHttp> {
    use crate::http_api::{audit::Audit, auth::Tokens, ApiHttp, Slot};
    let audit = config
        .audit_log
        .clone()
        .unwrap_or_else(|| config.data.value.join("audit.log"));
    ApiHttp::new(
        Slot::default(),
        Tokens::new(config.http_tokens.clone()),
        Audit::new(Some(audit)),
    )
}

async fn coordinate(
    config: &Config,
    nats: NatsConfig,
    readiness: &Readiness,
    slot: &crate::http_api::Slot,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    let data = &config.data.value;
    // Read without opening the store: a standby's data dir is locked by the serving one.
    let store_id = forkfleet_coordinator::store::store_id(data)?;
    warn_if_unrestricted(&nats, "coordinator");
    // Its errors name the (redacted) URL already.
    let nats = NatsBus::connect(nats).await?;
    let probe = nats.clone();
    readiness.watch_bus(move || probe.connected());
    readiness.not_ready("standby: waiting for the coordinator lease");
    let me = forkfleet_coordinator::lease::Candidate {
        store_id,
        ttl: config.lease_ttl.value,
    };
    tokio::pin!(shutdown);
    // Serve while the lease is held; a lease lost (NATS unreachable for a TTL, or taken
    // by a standby while this process was stalled) stops serving and goes back to
    // standing by, with the store closed, until the lease can be taken again.
    loop {
        let Some(lease) = forkfleet_coordinator::lease::acquire(&nats, &me, &mut shutdown).await?
        else {
            return Ok(());
        };
        readiness.not_ready("opening the run store");
        let store = tokio::select! {
            store = open_store_when_free(data, &lease) => store,
            _ = &mut shutdown => {
                lease.release().await;
                return Ok(());
            }
        };
        let store = match store {
            Ok(store) => store,
            Err(e) => {
                if let Some(why) = lease.lost_reason() {
                    tracing::warn!(reason = %why, "coordinator lease lost before serving: standing by");
                    readiness.not_ready("standby: waiting for the coordinator lease");
                    continue;
                }
                lease.release().await;
                return Err(e);
            }
        };
        let lost = lease.lost();
        let stop = async {
            tokio::select! {
                _ = &mut shutdown => {}
                why = lost => tracing::error!(reason = %why, "coordinator lease lost: stopping serving at once"),
            }
        };
        let bus: Arc<dyn Bus> = Arc::new(nats.clone());
        let served = serve_coordinator_on(store, bus, config, stop, readiness, Some(slot)).await;
        if let Some(why) = lease.lost_reason() {
            // Stopping without NATS may fail to ack what it applied: those events come
            // again and are applied once, by run and seq.
            if let Err(e) = served {
                tracing::warn!(error = %e, "stopping without the lease did not end cleanly");
            }
            tracing::warn!(
                reason = %why,
                "stopped serving (only the lease holder may serve); standing by to take the lease again"
            );
            readiness.not_ready("standby: waiting for the coordinator lease");
            continue;
        }
        lease.release().await;
        return served;
    }
}

/// Open the run store under `data` once its previous holder has let go of it (a holder
/// whose lease expired but that still runs keeps sled's lock until it notices and stops).
async fn open_store_when_free(
    data: &Path,
    lease: &forkfleet_coordinator::lease::Lease,
) -> anyhow::Result<RunStore> {
    let mut said = false;
    loop {
        if let Some(why) = lease.lost_reason() {
            anyhow::bail!("{why}");
        }
        let dir = data.to_path_buf();
        let opened = tokio::task::spawn_blocking(move || open_store(&dir)).await?;
        match opened {
            Ok(store) => {
                if store.id() != lease.store_id() {
                    anyhow::bail!(
                        "the run store in `{}` changed under this coordinator: its id is now {}, the lease names {}",
                        data.display(),
                        store.id(),
                        lease.store_id()
                    );
                }
                return Ok(store);
            }
            Err(e) => {
                let locked = e.chain().any(|c| {
                    matches!(
                        c.downcast_ref::<forkfleet_coordinator::CoordinatorError>(),
                        Some(forkfleet_coordinator::CoordinatorError::StoreLocked { .. })
                    )
                });
                if !locked {
                    return Err(e);
                }
                if !said {
                    tracing::warn!(data = %data.display(), "the run store is still locked by the previous coordinator; waiting for it to stop");
                    said = true;
                }
            }
        }
    }
}

/// Serve a coordinator ([`forkfleet_node::serve::serve_coordinator`]) with the pool and the `[access]` grants of `config`, ready (for
/// `readiness`) once it answers the API and until `shutdown`.
pub async fn serve_coordinator_with(
    store: RunStore,
    bus: Arc<dyn Bus>,
    config: &Config,
    shutdown: impl Future<Output = ()>,
    readiness: &Readiness,
) -> anyhow::Result<()> {
    serve_coordinator_on(store, bus, config, shutdown, readiness, None).await
}

/// [`serve_coordinator_with`], the coordinator put in `slot` (the HTTP API's) while it
/// serves. The identities of account-limited HTTP tokens get their accounts as grants.
async fn serve_coordinator_on(
    store: RunStore,
    bus: Arc<dyn Bus>,
    config: &Config,
    shutdown: impl Future<Output = ()>,
    readiness: &Readiness,
    slot: Option<&crate::http_api::Slot>,
) -> anyhow::Result<()> {
    let mut access = config.access.clone();
    for (identity, accounts) in
        crate::http_api::auth::Tokens::new(config.http_tokens.clone()).grants()
    {
        access.entry(identity).or_default().extend(accounts);
    }
    let coordinator = CoordinatorConfig {
        pool: config.pool.value.clone(),
        access,
        blob_quota_bytes: config.blob_quota_mb.value.saturating_mul(1 << 20),
        ..CoordinatorConfig::default()
    };
    forkfleet_node::serve::serve_coordinator(
        store,
        bus,
        coordinator,
        shutdown,
        &Served { readiness, slot },
    )
    .await
}

/// A served coordinator's readiness and the HTTP API's handle on it.
struct Served<'a> {
    readiness: &'a Readiness,
    slot: Option<&'a crate::http_api::Slot>,
}

impl forkfleet_node::serve::Watch for Served<'_> {
    fn serving(&self, coordinator: CoordinatorHandle, bus: &Arc<dyn Bus>) {
        if let Some(slot) = self.slot {
            slot.set(Some(crate::http_api::Serving::new(
                coordinator,
                bus.clone(),
            )));
        }
        self.readiness.ready();
    }

    fn stopping(&self) {
        self.readiness.not_ready("stopping");
        if let Some(slot) = self.slot {
            slot.set(None);
        }
    }
}

/// `forkfleet worker`: see the module documentation. With `http_addr`, the HTTP endpoint
/// ([`http`]) runs from start to stop; the worker is ready while its node runs (not while
/// it connects or drains) and its NATS connection is up.
pub async fn run_worker(
    config: &Config,
    shutdown: impl Future<Output = ()> + Send,
) -> anyhow::Result<()> {
    // What its commands leave behind stays in its tree and is reaped here (ADR 43).
    let reaper = match forkfleet_worker::reaper::install() {
        Ok(task) => Some(task),
        Err(e) => {
            tracing::warn!(error = %e, "worker: cannot become a subreaper; orphans of commands go to the init");
            None
        }
    };
    let readiness = Readiness::new("connecting to NATS");
    let endpoint = http::start_if(config.http_addr.value, &readiness, None).await?;
    let result = async {
        let bus = connect(config, Role::Worker).await?;
        let probe = bus.clone();
        readiness.watch_bus(move || probe.connected());
        serve_worker_with(bus, config, shutdown, &readiness).await
    }
    .await;
    http::stop(endpoint).await;
    if let Some(task) = reaper {
        task.abort();
    }
    result
}

/// Run a worker node on `bus` with the pool, concurrency and drain grace of `config`; its
/// scripted models log their calls where `FORKFLEET_SCRIPTED_USAGE_LOG` says (read once,
/// now), if it is set.
pub async fn serve_worker(
    bus: Arc<dyn Bus>,
    config: &Config,
    shutdown: impl Future<Output = ()> + Send,
) -> anyhow::Result<()> {
    serve_worker_with(bus, config, shutdown, &Readiness::new("starting")).await
}

/// [`serve_worker`], ready (for `readiness`) from the node's start until `shutdown`.
pub async fn serve_worker_with(
    bus: Arc<dyn Bus>,
    config: &Config,
    shutdown: impl Future<Output = ()> + Send,
    readiness: &Readiness,
) -> anyhow::Result<()> {
    let worker = WorkerConfig {
        pool: config.pool.value.clone(),
        concurrency: config.concurrency.value,
        drain_grace: config.drain_grace.value,
        tree_cache_bytes: config.tree_cache_mb.value.saturating_mul(1 << 20),
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
    readiness.ready();
    let draining = readiness.clone();
    let shutdown = async move {
        shutdown.await;
        draining.not_ready("stopping: draining running branches");
    };
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
