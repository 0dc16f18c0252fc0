//! A cluster of real processes for the tests: a `nats-server`, a `forkfleet coordinator`
//! and `forkfleet worker`s, driven by client commands (`forkfleet fork ...`,
//! `forkfleet workers`, `forkfleet log`) with `--nats`. Every wait is bounded; every child
//! process is killed on drop.

use super::harness::{command, path_str};
use forkfleet_bus::testkit::NatsServer;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// Bound of one client command.
pub(super) const COMMAND_LIMIT: Duration = Duration::from_secs(60);
/// Bound of a service's start or stop.
pub(super) const SERVICE_LIMIT: Duration = Duration::from_secs(30);
/// Pause between two rounds of a polling loop, so that the client commands it runs leave
/// the CPU to the processes under test.
pub(super) const POLL: Duration = Duration::from_millis(100);
/// A short ack wait (`--nats-ack-wait-s`), so a lost worker's tasks come back within a test.
pub(super) const SHORT_ACK_WAIT_S: &str = "2";

/// The binary in a clean environment (see [`command`]), logging the services' events.
pub(super) fn binary() -> Command {
    let mut cmd = command();
    cmd.env("RUST_LOG", "info,async_nats=warn");
    cmd
}

/// A service process (`forkfleet coordinator` or `forkfleet worker`), its output in a log
/// file; killed on drop.
pub(super) struct Service {
    pub(super) name: String,
    pub(super) child: Option<Child>,
    pub(super) log: PathBuf,
}

impl Service {
    pub(super) fn spawn(name: &str, args: &[&str], dir: &Path) -> Service {
        Self::spawn_env(name, args, dir, &[])
    }

    /// [`Service::spawn`] with these environment variables set.
    pub(super) fn spawn_env(
        name: &str,
        args: &[&str],
        dir: &Path,
        env: &[(&str, &str)],
    ) -> Service {
        let log = dir.join(format!("{name}.log"));
        let out = std::fs::File::create(&log).unwrap();
        let child = binary()
            .envs(env.iter().copied())
            .args(args)
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .unwrap();
        Service {
            name: name.to_string(),
            child: Some(child),
            log,
        }
    }

    pub(super) fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGTERM by pid, then wait for the exit (bounded).
    pub(super) fn terminate(&mut self) -> ExitStatus {
        let child = self.child.as_mut().unwrap();
        let sent = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status()
            .unwrap();
        assert!(sent.success());
        let status = wait_bounded(child, SERVICE_LIMIT)
            .unwrap_or_else(|| panic!("{} did not stop on SIGTERM:\n{}", self.name, self.log()));
        self.child = None;
        status
    }

    /// SIGKILL, and wait for the exit.
    pub(super) fn kill(&mut self) {
        let mut child = self.child.take().unwrap();
        child.kill().unwrap();
        child.wait().unwrap();
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

pub(super) fn wait_bounded(child: &mut Child, limit: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return Some(status);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// What a client command did.
pub(super) struct Ran {
    pub(super) code: Option<i32>,
    pub(super) stdout: String,
    pub(super) stderr: String,
}

impl Ran {
    pub(super) fn json(&self) -> Value {
        self.json_exit(0)
    }

    /// The JSON document a command printed before exiting with `code`.
    pub(super) fn json_exit(&self, code: i32) -> Value {
        assert_eq!(
            self.code,
            Some(code),
            "stderr: {}\nstdout: {}",
            self.stderr,
            self.stdout
        );
        serde_json::from_str(&self.stdout)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.stdout))
    }
}

/// Run a client command, bounded by [`COMMAND_LIMIT`] (killed past it).
pub(super) fn run(dir: &Path, args: &[&str]) -> Ran {
    let id = uuid_like();
    let (out_path, err_path) = (dir.join(format!("{id}.out")), dir.join(format!("{id}.err")));
    let mut child = binary()
        .args(args)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out_path).unwrap())
        .stderr(std::fs::File::create(&err_path).unwrap())
        .spawn()
        .unwrap();
    let status = wait_bounded(&mut child, COMMAND_LIMIT);
    if status.is_none() {
        let _ = child.kill();
        let _ = child.wait();
    }
    let ran = Ran {
        code: status.and_then(|s| s.code()),
        stdout: std::fs::read_to_string(&out_path).unwrap_or_default(),
        stderr: std::fs::read_to_string(&err_path).unwrap_or_default(),
    };
    assert!(
        status.is_some(),
        "`forkfleet {}` did not finish: {}",
        args.join(" "),
        ran.stderr
    );
    ran
}

fn uuid_like() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    format!("cmd-{}", N.fetch_add(1, Ordering::Relaxed))
}

fn spawn_coordinator(args: &[String], name: &str, dir: &Path) -> Service {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Service::spawn(name, &args, dir)
}

/// How [`Fleet::start`] runs its services; each `None` leaves the services' default.
#[derive(Clone, Copy, Default)]
pub(super) struct Options<'a> {
    /// `--nats-ack-wait-s` of the coordinator and the workers.
    pub(super) ack_wait_s: Option<&'a str>,
    /// `--nats-max-deliver` of the coordinator and the workers.
    pub(super) max_deliver: Option<&'a str>,
    /// `--drain-grace-s` of the workers.
    pub(super) drain_grace_s: Option<&'a str>,
    /// `--pool` of the workers.
    pub(super) pool: Option<&'a str>,
    /// Environment variables of the workers.
    pub(super) env: &'a [(&'a str, &'a str)],
    /// More arguments of the coordinator (and of those [`Fleet::spawn_coordinator`] starts).
    pub(super) coordinator_args: &'a [&'a str],
    /// More arguments of the nats-server (`--tls ...`).
    pub(super) nats_args: &'a [&'a str],
    /// More arguments of every forkfleet process on the bus, services and clients
    /// (`--tls-ca ...`).
    pub(super) connect_args: &'a [&'a str],
    /// The URL's scheme (`tls`); `None`: `nats`.
    pub(super) scheme: Option<&'a str>,
}

/// A nats-server, a coordinator and workers, with the client's working directory.
pub(super) struct Fleet {
    pub(super) nats: NatsServer,
    pub(super) coordinator: Service,
    pub(super) workers: Vec<Service>,
    pub(super) dir: tempfile::TempDir,
    /// The bus's URL as every process is given it.
    url: String,
    /// [`Options::connect_args`].
    connect_args: Vec<String>,
    /// The coordinator's arguments, to start it again.
    coordinator_args: Vec<String>,
    /// The workers' arguments and environment, to start more.
    worker_args: Vec<String>,
    worker_env: Vec<(String, String)>,
}

impl Fleet {
    /// `workers` worker processes of `concurrency` slots each, run as `options` says; once
    /// the coordinator answers and lists every worker (bounded).
    pub(super) fn start(workers: usize, concurrency: usize, options: Options) -> Fleet {
        let nats = NatsServer::start_with(options.nats_args);
        let dir = tempfile::tempdir().unwrap();
        let url = match options.scheme {
            Some(scheme) => format!("{scheme}://127.0.0.1:{}", nats.port()),
            None => nats.url(),
        };
        let connect_args: Vec<String> =
            options.connect_args.iter().map(|s| s.to_string()).collect();
        let data = dir.path().join("coordinator-data");
        let mut coordinator_args: Vec<String> = ["coordinator", "--nats", &url, "--data"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        coordinator_args.push(path_str(&data).to_string());
        coordinator_args.extend(options.coordinator_args.iter().map(|s| s.to_string()));
        coordinator_args.extend(connect_args.iter().cloned());
        let mut worker_args: Vec<String> = ["worker", "--nats", &url]
            .iter()
            .map(|s| s.to_string())
            .collect();
        worker_args.extend(connect_args.iter().cloned());
        if let Some(pool) = options.pool {
            worker_args.extend(["--pool".to_string(), pool.to_string()]);
        }
        worker_args.extend(["--concurrency".to_string(), concurrency.to_string()]);
        if let Some(grace) = options.drain_grace_s {
            worker_args.extend(["--drain-grace-s".to_string(), grace.to_string()]);
        }
        if let Some(ack_wait) = options.ack_wait_s {
            for args in [&mut coordinator_args, &mut worker_args] {
                args.extend(["--nats-ack-wait-s".to_string(), ack_wait.to_string()]);
            }
        }
        if let Some(max) = options.max_deliver {
            for args in [&mut coordinator_args, &mut worker_args] {
                args.extend(["--nats-max-deliver".to_string(), max.to_string()]);
            }
        }
        let coordinator = spawn_coordinator(&coordinator_args, "coordinator", dir.path());
        let mut fleet = Fleet {
            nats,
            coordinator,
            workers: Vec::new(),
            dir,
            url,
            connect_args,
            coordinator_args,
            worker_args,
            worker_env: options
                .env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        };
        fleet.workers = (0..workers)
            .map(|i| fleet.spawn_worker(&format!("worker-{i}")))
            .collect();
        fleet.wait_ready();
        fleet
    }

    /// The bus's URL, as every process is given it.
    pub(super) fn url(&self) -> &str {
        &self.url
    }

    /// A worker process named `name`, started as [`Fleet::start`] started the first ones
    /// (not added to [`Fleet::workers`]).
    pub(super) fn spawn_worker(&self, name: &str) -> Service {
        let args: Vec<&str> = self.worker_args.iter().map(String::as_str).collect();
        let env: Vec<(&str, &str)> = self
            .worker_env
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        Service::spawn_env(name, &args, self.dir.path(), &env)
    }

    /// A coordinator process named `name` on this fleet's NATS server and data directory.
    pub(super) fn spawn_coordinator(&self, name: &str) -> Service {
        spawn_coordinator(&self.coordinator_args, name, self.dir.path())
    }

    /// A coordinator process named `name` like [`Fleet::spawn_coordinator`]'s, with `data`
    /// as its data directory.
    pub(super) fn spawn_coordinator_on(&self, name: &str, data: &Path) -> Service {
        let mut args = self.coordinator_args.clone();
        let at = args.iter().position(|a| a == "--data").unwrap() + 1;
        args[at] = path_str(data).to_string();
        spawn_coordinator(&args, name, self.dir.path())
    }

    /// Until the coordinator answers and lists every worker (bounded).
    fn wait_ready(&self) {
        let deadline = Instant::now() + COMMAND_LIMIT;
        loop {
            let ls = self.client(&["fork", "ls", "--json"]);
            let workers = self.client(&["workers", "--json"]);
            if ls.code == Some(0)
                && workers.code == Some(0)
                && workers.json().as_array().map(Vec::len) == Some(self.workers.len())
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the fleet did not come up\nfork ls: {}\nworkers: {}\n{}",
                ls.stderr,
                workers.stderr,
                self.logs()
            );
            std::thread::sleep(POLL);
        }
    }

    /// A client command with `--nats` to this fleet.
    pub(super) fn client(&self, args: &[&str]) -> Ran {
        let mut all = args.to_vec();
        all.extend(["--nats", &self.url]);
        all.extend(self.connect_args.iter().map(String::as_str));
        run(self.dir.path(), &all)
    }

    /// The services' logs, to show when a test fails.
    pub(super) fn logs(&self) -> String {
        let mut out = format!("coordinator:\n{}\n", self.coordinator.log());
        for w in &self.workers {
            out.push_str(&format!("{}:\n{}\n", w.name, w.log()));
        }
        out
    }

    /// `fork create` of `spec`: the fork's id.
    pub(super) fn create(&self, spec: &Path) -> String {
        let created = self.client(&["fork", "create", path_str(spec)]);
        assert_eq!(created.code, Some(0), "{}\n{}", created.stderr, self.logs());
        created.stdout.trim().to_string()
    }

    /// Until at least `running` branches have made a model call (bounded).
    pub(super) fn wait_progress(&self, id: &str, running: usize) {
        let deadline = Instant::now() + COMMAND_LIMIT;
        loop {
            let shown = self.client(&["fork", "show", id, "--json"]);
            if shown.code == Some(0) {
                let doc = shown.json();
                let busy = doc["branches"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .filter(|b| b["state"] == "running" && b["turns"].as_u64() >= Some(1))
                    .count();
                if busy >= running {
                    return;
                }
            }
            assert!(Instant::now() < deadline, "no progress\n{}", self.logs());
            std::thread::sleep(POLL);
        }
    }

    /// `fork watch` to the end: the final view (exit 0, or 1 when a branch failed).
    pub(super) fn watch(&self, id: &str) -> Value {
        let watched = self.client(&["fork", "watch", id, "--json", "--timeout-s", "50"]);
        let doc: Value = serde_json::from_str(&watched.stdout).unwrap_or_else(|e| {
            panic!(
                "not JSON ({e}): {}\n{}\n{}",
                watched.stdout,
                watched.stderr,
                self.logs()
            )
        });
        let failed = doc["branches"]
            .as_array()
            .is_some_and(|bs| bs.iter().any(|b| b["state"] == "failed"));
        let want = if failed { 1 } else { 0 };
        assert_eq!(
            watched.code,
            Some(want),
            "{}\n{}",
            watched.stderr,
            self.logs()
        );
        doc
    }

    /// A run's log (`forkfleet log --json`).
    pub(super) fn log(&self, run: &str) -> Vec<Value> {
        self.client(&["log", run, "--json"])
            .json()
            .as_array()
            .unwrap()
            .clone()
    }
}

/// `fork create SPEC --json` through `client` (a command with the cluster's own flags
/// added), asked again while the coordinator does not answer yet (bounded), then `fork
/// watch` to the end: every branch `done`. Returns the fork's id. `logs` says why not.
pub(super) fn fork_to_done(
    client: impl Fn(&[&str]) -> Ran,
    spec: &Path,
    logs: impl Fn() -> String,
) -> String {
    let deadline = Instant::now() + COMMAND_LIMIT;
    let created = loop {
        let created = client(&["fork", "create", path_str(spec), "--json"]);
        if created.code == Some(0) {
            break created;
        }
        assert!(Instant::now() < deadline, "{}\n{}", created.stderr, logs());
        std::thread::sleep(POLL);
    };
    let id = created.json()["fork_id"].as_str().unwrap().to_string();
    let watched = client(&["fork", "watch", &id, "--json", "--timeout-s", "60"]);
    assert_eq!(watched.code, Some(0), "{}\n{}", watched.stderr, logs());
    let doc = watched.json();
    let branches = doc["branches"].as_array().unwrap();
    assert!(
        !branches.is_empty() && branches.iter().all(|b| b["state"] == "done"),
        "{doc}\n{}",
        logs()
    );
    id
}
