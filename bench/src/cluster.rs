//! `forkfleet bench fanout --bus nats`: the fan-out on a cluster on this machine.
//!
//! 1. Start a `nats-server -js` of its own ([`NatsServerGuard`]: free loopback port,
//!    JetStream store and log in a temporary directory, killed on every exit path).
//! 2. Run the coordinator in this process on a NATS bus ([`serve::serve_coordinator`]:
//!    the run store in the temporary directory, the API answered over request/reply), and
//!    reach it as a client does ([`RemoteCoordinator`], its own connection). So the fork's
//!    blobs take the cluster's path: the client uploads to the bus's blob store, and the
//!    API copies what the fork names into the run store on `create_fork` (and the text
//!    files a unified diff shows on `diff`).
//! 3. Start `--workers` `forkfleet worker --nats URL --concurrency C` processes (this
//!    binary), and wait until the bus lists them all.
//! 4. Measure ([`super::run_fanout`]), then read the branch events back from the stream
//!    (a durable consumer of the bench's own, after the measurement, so it costs the
//!    measured run nothing) for each branch's time by the workers' clocks.
//! 5. Read each worker's and the server's peak RSS, stop the workers with SIGTERM (they
//!    drain; SIGKILL after 10 s), stop the coordinator, kill the server.

use super::nats_server::{tail, NatsServerGuard};
use super::{proc_peak_rss_mb, run_fanout, seed_workspace, FanoutArgs, FanoutResult};
use anyhow::{bail, Context};
use forkfleet_bus::nats::NatsConfig;
use forkfleet_bus::Bus;
use forkfleet_client::{ApiClient, Client};
use forkfleet_coordinator::CoordinatorConfig;
use forkfleet_node::serve;
use forkfleet_shared::api::ForkView;
use forkfleet_shared::event::Event;
use forkfleet_shared::ids::RunId;
use forkfleet_shared::protocol::{read_events, DEFAULT_POOL};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::task::JoinSet;

/// How long the coordinator's API may take to answer its first ping.
const API_READY_TIMEOUT: Duration = Duration::from_secs(15);
/// How long the workers may take to announce themselves on the bus.
const WORKERS_READY_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a worker may drain after SIGTERM before it is killed.
const WORKER_STOP_TIMEOUT: Duration = Duration::from_secs(10);
/// The drain grace the workers are given (below [`WORKER_STOP_TIMEOUT`]).
const WORKER_DRAIN_GRACE_S: u64 = 5;
/// How long the coordinator may take to stop.
const COORDINATOR_STOP_TIMEOUT: Duration = Duration::from_secs(15);
/// Reading the events back: give up when none arrives for this long.
const EVENTS_IDLE: Duration = Duration::from_secs(3);
/// Acks of read-back events in flight at once.
const ACKS_IN_FLIGHT: usize = 256;
/// The bench's own durable consumer of the event stream.
const TIMING_DURABLE: &str = "bench-timing";

/// A cluster on this machine: its own nats-server, the coordinator in this process (on
/// its own NATS connection), worker processes, and a client of the coordinator (another
/// connection). [`Cluster::stop`] stops everything; dropping it kills what still runs.
pub(super) struct Cluster {
    server: NatsServerGuard,
    coordinator: tokio::task::JoinHandle<anyhow::Result<()>>,
    stop_tx: Option<tokio::sync::oneshot::Sender<()>>,
    workers: WorkerProcs,
    client: Option<(Arc<dyn Bus>, Client)>,
}

/// What stopping a cluster found.
pub(super) struct Stopped {
    /// Each worker's peak RSS (read before they stopped).
    pub workers_rss: Vec<f64>,
    pub server_rss: Option<f64>,
    /// Workers that did not exit within 10 s of SIGTERM.
    pub killed: usize,
    /// How the coordinator stopped.
    pub coordinator: anyhow::Result<()>,
}

impl Cluster {
    /// Start a cluster whose files (server store, run store, worker logs) live in `dir`,
    /// with `workers` worker processes of `concurrency` slots each and `env` set for them,
    /// for the bench named `bench` (`fanout`, `budget`).
    pub async fn start(
        bench: &'static str,
        dir: &Path,
        workers: usize,
        concurrency: usize,
        env: &[(String, String)],
    ) -> anyhow::Result<Cluster> {
        let server_dir = dir.to_path_buf();
        let server =
            tokio::task::spawn_blocking(move || NatsServerGuard::start(&server_dir, bench))
                .await
                .context("the nats-server start task failed")??;
        let url = server.url();
        tracing::info!(nats.url = %url, "bench: nats-server ready");
        let coord_bus = connect(&url, "forkfleet-bench-coordinator").await?;
        let store = serve::open_store(&dir.join("data"))?;
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let config = CoordinatorConfig {
            pool: DEFAULT_POOL.to_string(),
            ..CoordinatorConfig::default()
        };
        let coordinator = tokio::spawn(serve::serve_coordinator(
            store,
            coord_bus,
            config,
            async move {
                let _ = stop_rx.await;
            },
            &(),
        ));
        let mut cluster = Cluster {
            server,
            coordinator,
            stop_tx: Some(stop_tx),
            workers: WorkerProcs::default(),
            client: None,
        };
        match cluster.bring_up(&url, dir, workers, concurrency, env).await {
            Ok(()) => Ok(cluster),
            Err(e) => {
                cluster.stop().await;
                Err(e)
            }
        }
    }

    async fn bring_up(
        &mut self,
        url: &str,
        dir: &Path,
        workers: usize,
        concurrency: usize,
        env: &[(String, String)],
    ) -> anyhow::Result<()> {
        let client_bus = connect(url, "forkfleet-bench-client").await?;
        let remote = Client::remote(client_bus.clone());
        wait_api(&remote, &self.coordinator).await?;
        let n = workers.max(1);
        let exe = std::env::current_exe().context("cannot find this forkfleet binary")?;
        for i in 0..n {
            self.workers.spawn(
                &exe,
                url,
                concurrency.max(1),
                &dir.join(format!("worker-{i}.log")),
                env,
            )?;
        }
        wait_workers(client_bus.as_ref(), &mut self.workers, n).await?;
        tracing::info!(workers = n, "bench: workers ready");
        self.client = Some((client_bus, remote));
        Ok(())
    }

    /// The coordinator, as a client reaches it.
    pub fn client(&self) -> anyhow::Result<&Client> {
        self.client
            .as_ref()
            .map(|(_, c)| c)
            .context("the cluster is not up")
    }

    /// The client's own connection to the bus.
    pub fn bus(&self) -> anyhow::Result<&Arc<dyn Bus>> {
        self.client
            .as_ref()
            .map(|(b, _)| b)
            .context("the cluster is not up")
    }

    pub fn workers(&self) -> usize {
        self.workers.children.len()
    }

    /// Peak RSS first (the workers are idle now), then SIGTERM the workers (SIGKILL after
    /// 10 s), stop the coordinator, kill the server.
    pub async fn stop(mut self) -> Stopped {
        let workers_rss = self.workers.peak_rss_mb();
        let server_rss = self
            .server
            .pid()
            .and_then(|pid| proc_peak_rss_mb(&pid.to_string()));
        let killed = self.workers.stop(WORKER_STOP_TIMEOUT).await;
        if killed > 0 {
            tracing::warn!(
                killed,
                "bench: worker processes did not exit within 10 s of SIGTERM and were killed"
            );
        }
        if let Some(tx) = self.stop_tx.take() {
            let _ = tx.send(());
        }
        let coordinator =
            match tokio::time::timeout(COORDINATOR_STOP_TIMEOUT, &mut self.coordinator).await {
                Ok(Ok(r)) => r,
                Ok(Err(e)) => Err(anyhow::anyhow!("the coordinator task failed: {e}")),
                Err(_) => {
                    self.coordinator.abort();
                    Err(anyhow::anyhow!(
                        "the coordinator did not stop within {} s",
                        COORDINATOR_STOP_TIMEOUT.as_secs()
                    ))
                }
            };
        Stopped {
            workers_rss,
            server_rss,
            killed,
            coordinator,
        }
    }
}

/// Combine a measurement with how its cluster stopped: a measurement stands when the
/// coordinator stopped with an error (logged); two errors report the measurement's.
pub(super) fn settle<T>(measured: anyhow::Result<T>, stopped: &mut Stopped) -> anyhow::Result<T> {
    let coordinator = std::mem::replace(&mut stopped.coordinator, Ok(()));
    match (measured, coordinator) {
        (Ok(result), Ok(())) => Ok(result),
        (Ok(result), Err(e)) => {
            tracing::warn!(error = %e, "bench: the coordinator stopped with an error");
            Ok(result)
        }
        (Err(e), Ok(())) => Err(e),
        (Err(e), Err(coord)) => {
            tracing::error!(error = %format!("{coord:#}"), "bench: the coordinator failed too");
            Err(e)
        }
    }
}

/// See the module documentation.
pub async fn fanout(args: &FanoutArgs) -> anyhow::Result<FanoutResult> {
    let tmp = tempfile::Builder::new()
        .prefix("forkfleet-bench-")
        .tempdir()
        .context("temporary directory")?;
    let workspace = tmp.path().join("workspace");
    seed_workspace(&workspace, args.writes)?;
    let cluster = Cluster::start("fanout", tmp.path(), args.workers, args.concurrency, &[]).await?;
    let measured = measure(args, &workspace, &cluster).await;
    let mut stopped = cluster.stop().await;
    let mut result = settle(measured, &mut stopped)?;
    result.worker_peak_rss_mb = stopped.workers_rss.iter().copied().reduce(f64::max);
    result.workers_peak_rss_mb = stopped.workers_rss;
    result.nats_server_peak_rss_mb = stopped.server_rss;
    result.workers_killed = Some(stopped.killed);
    Ok(result)
}

/// The fan-out on an up cluster, plus each branch's time by the workers' clocks.
async fn measure(
    args: &FanoutArgs,
    workspace: &Path,
    cluster: &Cluster,
) -> anyhow::Result<FanoutResult> {
    let (mut result, view) = run_fanout(cluster.client()?, workspace, args).await?;
    result.workers = cluster.workers();

    let timing = branch_times(cluster.bus()?, &view).await?;
    let mut per_turn: Vec<f64> = view
        .branches
        .iter()
        .filter(|b| b.turns > 0)
        .filter_map(|b| {
            let (first, last) = timing.spans.get(&b.run_id)?;
            Some(last.saturating_sub(*first) as f64 / b.turns as f64)
        })
        .collect();
    per_turn.sort_by(f64::total_cmp);
    if per_turn.len() < view.branches.len() {
        tracing::warn!(
            timed = per_turn.len(),
            branches = view.branches.len(),
            "bench: some branches have no timing (no events read back)"
        );
    }
    result.per_turn_ms = percentile(&per_turn, 0.5).unwrap_or(0.0);
    result.per_turn_ms_p90 = percentile(&per_turn, 0.9);
    result.events = Some(timing.events);
    Ok(result)
}

async fn connect(url: &str, name: &str) -> anyhow::Result<Arc<dyn Bus>> {
    serve::connect_nats(NatsConfig {
        name: Some(name.to_string()),
        ..NatsConfig::new(url)
    })
    .await
}

/// Until the coordinator's API answers a ping (it binds its subject as it starts).
async fn wait_api(
    remote: &Client,
    coordinator: &tokio::task::JoinHandle<anyhow::Result<()>>,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + API_READY_TIMEOUT;
    loop {
        if coordinator.is_finished() {
            bail!("the bench's coordinator stopped before it answered");
        }
        match remote.ping().await {
            Ok(_) => return Ok(()),
            Err(e) if Instant::now() >= deadline => {
                return Err(anyhow::Error::new(e).context(format!(
                    "the bench's coordinator did not answer within {} s",
                    API_READY_TIMEOUT.as_secs()
                )))
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

/// Until `n` workers of the default pool are listed on the bus; fails at once when a
/// worker process exits.
async fn wait_workers(bus: &dyn Bus, workers: &mut WorkerProcs, n: usize) -> anyhow::Result<()> {
    let deadline = Instant::now() + WORKERS_READY_TIMEOUT;
    loop {
        workers.check_running()?;
        let listed = bus
            .workers()
            .await?
            .iter()
            .filter(|w| w.pool == DEFAULT_POOL)
            .count();
        if listed >= n {
            return Ok(());
        }
        if Instant::now() >= deadline {
            bail!(
                "only {listed} of {n} worker processes announced themselves within {} s; last lines of worker-0's log:\n{}",
                WORKERS_READY_TIMEOUT.as_secs(),
                workers.log_tail(0)
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The `q` quantile of sorted values (nearest rank).
fn percentile(sorted: &[f64], q: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((sorted.len() as f64 * q).ceil() as usize).clamp(1, sorted.len());
    Some(sorted[rank - 1])
}

/// Per branch run: the workers' timestamps (ms) of its first event and its terminal
/// status.
struct BranchTimes {
    spans: HashMap<RunId, (u64, u64)>,
    events: u64,
}

/// Read the fork's events back from the stream with a durable consumer of the bench's own
/// (it starts at the stream's first message), until every branch's terminal status is in
/// or none arrives for [`EVENTS_IDLE`].
async fn branch_times(bus: &Arc<dyn Bus>, view: &ForkView) -> anyhow::Result<BranchTimes> {
    let mut consumer = bus.events(TIMING_DURABLE).await?;
    let mut first: HashMap<RunId, u64> = HashMap::new();
    let mut last: HashMap<RunId, u64> = HashMap::new();
    let mut events = 0u64;
    let mut acks = JoinSet::new();
    while last.len() < view.branches.len() {
        let delivery = match tokio::time::timeout(EVENTS_IDLE, consumer.next()).await {
            Ok(d) => d?,
            Err(_) => break,
        };
        match read_events(&delivery.payload) {
            Ok(batch) => {
                for ev in batch.into_iter().filter(|ev| ev.fork_id == view.fork_id) {
                    events += 1;
                    let at = first.entry(ev.run_id).or_insert(ev.at_ms);
                    *at = (*at).min(ev.at_ms);
                    if let Event::Status { state, .. } = ev.event {
                        if state.is_terminal() {
                            let at = last.entry(ev.run_id).or_insert(ev.at_ms);
                            *at = (*at).max(ev.at_ms);
                        }
                    }
                }
            }
            Err(e) => tracing::warn!(error = %e, "bench: an event does not decode"),
        }
        acks.spawn(async move { delivery.ack().await });
        while acks.len() >= ACKS_IN_FLIGHT {
            let _ = acks.join_next().await;
        }
    }
    while acks.join_next().await.is_some() {}
    drop(consumer);
    let spans = last
        .into_iter()
        .filter_map(|(run, end)| first.get(&run).map(|start| (run, (*start, end))))
        .collect();
    Ok(BranchTimes { spans, events })
}

/// The worker processes; any still running are killed (SIGKILL) on drop.
#[derive(Default)]
struct WorkerProcs {
    children: Vec<Child>,
    logs: Vec<PathBuf>,
}

impl WorkerProcs {
    /// Start `forkfleet worker --nats URL --concurrency C`, its log (stderr) in `log`.
    /// The bench's `FORKFLEET_*` environment is not passed on: the worker must serve the
    /// bench's pool on the bench's server, whatever this shell configures; `env` is set
    /// after that.
    fn spawn(
        &mut self,
        exe: &Path,
        url: &str,
        concurrency: usize,
        log: &Path,
        env: &[(String, String)],
    ) -> anyhow::Result<()> {
        let err = std::fs::File::create(log)
            .with_context(|| format!("cannot create `{}`", log.display()))?;
        let mut cmd = Command::new(exe);
        cmd.arg("worker")
            .args(["--nats", url])
            .args(["--pool", DEFAULT_POOL])
            .args(["--concurrency", &concurrency.to_string()])
            .args(["--drain-grace-s", &WORKER_DRAIN_GRACE_S.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(err));
        for (key, _) in std::env::vars_os() {
            if key
                .to_string_lossy()
                .starts_with(forkfleet_shared::ENV_PREFIX)
            {
                cmd.env_remove(key);
            }
        }
        cmd.envs(env.iter().map(|(k, v)| (k, v)));
        let child = cmd
            .spawn()
            .with_context(|| format!("cannot start the worker process {}", exe.display()))?;
        self.children.push(child);
        self.logs.push(log.to_path_buf());
        Ok(())
    }

    /// An error (with its log) when a worker process has exited.
    fn check_running(&mut self) -> anyhow::Result<()> {
        for (i, child) in self.children.iter_mut().enumerate() {
            if let Ok(Some(status)) = child.try_wait() {
                bail!(
                    "worker process {i} exited with {status}; its log:\n{}",
                    tail(&self.logs[i], 20)
                );
            }
        }
        Ok(())
    }

    fn log_tail(&self, i: usize) -> String {
        self.logs.get(i).map(|l| tail(l, 20)).unwrap_or_default()
    }

    /// Each worker's peak RSS (VmHWM) while it still runs.
    fn peak_rss_mb(&self) -> Vec<f64> {
        self.children
            .iter()
            .filter_map(|c| proc_peak_rss_mb(&c.id().to_string()))
            .collect()
    }

    /// SIGTERM every worker (they drain), wait up to `timeout` for all to exit, SIGKILL
    /// the rest. Returns how many had to be killed.
    async fn stop(&mut self, timeout: Duration) -> usize {
        for child in &self.children {
            let sent = Command::new("kill")
                .args(["-TERM", &child.id().to_string()])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
            if !sent.is_ok_and(|s| s.success()) {
                tracing::warn!(pid = child.id(), "bench: cannot send SIGTERM to a worker");
            }
        }
        let deadline = Instant::now() + timeout;
        loop {
            self.children
                .retain_mut(|c| !matches!(c.try_wait(), Ok(Some(_))));
            if self.children.is_empty() || Instant::now() >= deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let killed = self.children.len();
        self.kill_all();
        killed
    }

    fn kill_all(&mut self) {
        for mut child in self.children.drain(..) {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for WorkerProcs {
    fn drop(&mut self) {
        self.kill_all();
    }
}

#[cfg(test)]
mod tests {
    use super::percentile;

    #[test]
    fn percentiles_by_nearest_rank() {
        let v = [1.0, 2.0, 3.0, 4.0];
        assert_eq!(percentile(&v, 0.5), Some(2.0));
        assert_eq!(percentile(&v, 0.9), Some(4.0));
        assert_eq!(percentile(&[5.0], 0.5), Some(5.0));
        assert_eq!(percentile(&[], 0.5), None);
    }
}
