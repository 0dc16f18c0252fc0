//! The client commands against a cluster of real processes: a `nats-server`, a
//! `forkfleet coordinator` and a `forkfleet worker`, driven by `forkfleet fork ...`,
//! `forkfleet workers` and `forkfleet log` with `--nats`. Every wait is bounded; every
//! child process is killed on drop.

use super::harness::{path_str, Example};
use forkfleet_shared::testkit::NatsServer;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// Bound of one client command.
pub(super) const COMMAND_LIMIT: Duration = Duration::from_secs(60);
/// Bound of a service's start or stop.
pub(super) const SERVICE_LIMIT: Duration = Duration::from_secs(30);

pub(super) fn binary() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_forkfleet"));
    for (k, _) in std::env::vars() {
        if k.starts_with("FORKFLEET_") {
            cmd.env_remove(k);
        }
    }
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
        assert_eq!(
            self.code,
            Some(0),
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

/// A nats-server, a coordinator and a worker, with the client's working directory.
struct Cluster {
    nats: NatsServer,
    coordinator: Service,
    worker: Service,
    dir: tempfile::TempDir,
}

impl Cluster {
    fn start() -> Cluster {
        let nats = NatsServer::start();
        let dir = tempfile::tempdir().unwrap();
        let url = nats.url();
        let data = dir.path().join("coordinator-data");
        let coordinator = Service::spawn(
            "coordinator",
            &["coordinator", "--nats", &url, "--data", path_str(&data)],
            dir.path(),
        );
        let worker = Service::spawn(
            "worker",
            &[
                "worker",
                "--nats",
                &url,
                "--pool",
                "default",
                "--concurrency",
                "8",
                "--drain-grace-s",
                "5",
            ],
            dir.path(),
        );
        let cluster = Cluster {
            nats,
            coordinator,
            worker,
            dir,
        };
        cluster.wait_ready();
        cluster
    }

    /// Until the coordinator answers and the worker is listed (bounded).
    fn wait_ready(&self) {
        let deadline = Instant::now() + SERVICE_LIMIT;
        loop {
            let ls = self.client(&["fork", "ls", "--json"]);
            let workers = self.client(&["workers", "--json"]);
            if ls.code == Some(0)
                && workers.code == Some(0)
                && workers.json().as_array().is_some_and(|w| w.len() == 1)
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the cluster did not come up\nfork ls: {}\nworkers: {}\ncoordinator:\n{}\nworker:\n{}",
                ls.stderr,
                workers.stderr,
                self.coordinator.log(),
                self.worker.log()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// A client command with `--nats` to this cluster.
    fn client(&self, args: &[&str]) -> Ran {
        let url = self.nats.url();
        let mut all: Vec<&str> = args.to_vec();
        all.extend(["--nats", &url]);
        run(self.dir.path(), &all)
    }

    /// Show the services' logs when a test fails.
    fn logs(&self) -> String {
        format!(
            "coordinator:\n{}\nworker:\n{}",
            self.coordinator.log(),
            self.worker.log()
        )
    }
}

pub(super) fn branch<'a>(doc: &'a Value, label: &str) -> &'a Value {
    doc["branches"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["label"] == label)
        .unwrap_or_else(|| panic!("no branch {label} in {doc}"))
}

#[test]
fn create_watch_diff_merge_and_workers_on_a_cluster() {
    let mut cluster = Cluster::start();
    let ex = Example::quickstart();

    let created = cluster
        .client(&["fork", "create", path_str(&ex.spec()), "--json"])
        .json();
    let id = created["fork_id"].as_str().unwrap().to_string();
    assert_eq!(created["branches"].as_array().unwrap().len(), 3);

    // Watch until settled: the final view, every branch done.
    let watched = cluster
        .client(&["fork", "watch", &id[..13], "--json", "--timeout-s", "60"])
        .json();
    for label in ["concise", "thorough", "tidy"] {
        assert_eq!(
            branch(&watched, label)["state"],
            "done",
            "{}",
            cluster.logs()
        );
        assert!(branch(&watched, label)["cost_usd"].as_f64().unwrap() > 0.0);
    }
    assert_eq!(watched["state"], "settled");
    // Text mode prints the progress and the table.
    let text = cluster.client(&["fork", "watch", &id, "--timeout-s", "60"]);
    assert_eq!(text.code, Some(0), "{}", text.stderr);
    assert!(text.stdout.contains("LABEL"), "{}", text.stdout);

    // The same fork again: every blob is already in the store.
    let again = cluster.client(&["fork", "create", path_str(&ex.spec())]);
    assert_eq!(again.code, Some(0), "{}", again.stderr);
    assert!(
        again.stderr.contains("0 new blobs uploaded"),
        "{}",
        again.stderr
    );
    let second = again.stdout.trim().to_string();
    assert_eq!(second.len(), 36, "{}", again.stdout);
    let listed = cluster.client(&["fork", "ls", "--json"]).json();
    assert_eq!(listed.as_array().unwrap().len(), 2);

    // The diff, with contents the workers wrote (copied from NATS by the coordinator).
    let diff = cluster.client(&["fork", "diff", &id, "--json"]).json();
    assert_eq!(diff["summary"]["total_paths_touched"], 5, "{diff}");
    let text = cluster.client(&["fork", "diff", &id, "--unified", "--path", "greet.py"]);
    assert_eq!(text.code, Some(0), "{}", text.stderr);
    assert!(
        text.stdout.contains("+    return f\"Hello, {name}!\""),
        "{}",
        text.stdout
    );
    assert!(
        !text.stdout.contains("content unavailable"),
        "{}",
        text.stdout
    );

    // The user edits a file after the fork; the merge keeps it and applies the rest.
    std::fs::write(ex.workspace().join("README.md"), "# greet\n\nmine\n").unwrap();
    let merged = cluster
        .client(&[
            "fork",
            "merge",
            &id,
            "--pick",
            "thorough",
            "--apply",
            path_str(&ex.workspace()),
            "--json",
        ])
        .json();
    assert_eq!(
        merged["merge"]["conflicts"],
        serde_json::json!(["README.md"])
    );
    assert_eq!(merged["state"], "merged");
    assert_eq!(ex.read("README.md").unwrap(), "# greet\n\nmine\n");
    assert!(ex
        .read("tests/test_greet.py")
        .unwrap()
        .contains("test_missing_name"));
    assert!(ex.read("greet.py").unwrap().contains("name or 'world'"));

    // Merging twice, an unknown fork, an unknown label: exit 2 with a clear message.
    let twice = cluster.client(&["fork", "merge", &id, "--pick", "concise", "--no-apply"]);
    assert_eq!(twice.code, Some(2), "{}", twice.stderr);
    assert!(twice.stderr.contains("already merged"), "{}", twice.stderr);
    let unknown = cluster.client(&["fork", "show", "00000000-0000-7000-8000-000000000000"]);
    assert_eq!(unknown.code, Some(2), "{}", unknown.stderr);
    assert!(
        unknown.stderr.contains("no fork matches"),
        "{}",
        unknown.stderr
    );
    let label = cluster.client(&["fork", "merge", &second, "--pick", "nope", "--no-apply"]);
    assert_eq!(label.code, Some(2), "{}", label.stderr);
    assert!(
        label.stderr.contains("concise, thorough, tidy"),
        "{}",
        label.stderr
    );

    // Workers: one, in pool default, with a fresh heartbeat.
    let workers = cluster.client(&["workers", "--json"]).json();
    let w = &workers.as_array().unwrap()[0];
    assert_eq!(w["pool"], "default");
    assert_eq!(w["concurrency"], 8);
    assert!(w["heartbeat_age_ms"].as_u64().unwrap() < 30_000);
    let text = cluster.client(&["workers"]);
    assert!(text.stdout.contains("LAST_HEARTBEAT"), "{}", text.stdout);

    // A branch's log, from its lineage event on.
    let run_id = branch(&watched, "concise")["id"]
        .as_str()
        .unwrap()
        .to_string();
    let log = cluster.client(&["log", &run_id, "--json"]).json();
    let events = log.as_array().unwrap();
    assert_eq!(events[0]["seq"], 0);
    assert_eq!(events[0]["event"]["type"], "fork");
    assert!(events.len() > 5);

    // Both services stop cleanly on SIGTERM.
    assert!(cluster.worker.terminate().success(), "{}", cluster.logs());
    assert!(
        cluster.coordinator.terminate().success(),
        "{}",
        cluster.logs()
    );
    assert!(
        cluster.coordinator.log().contains("coordinator.stopped"),
        "{}",
        cluster.logs()
    );
}

/// A script whose branches write a file every 100 ms for 15 s: slow enough to stop.
const SLOW_SCRIPT: &str = r#"
[defaults]
latency_ms = 100
usage = { input_tokens = 100, output_tokens = 10 }

[[turns."*"]]
tool_calls = [{ name = "write_file", args = { path = "slow/{label}-{repeat}.md", content = "x\n" } }]
repeat = 150

[[turns."*"]]
text = "done"
"#;

#[test]
fn terminate_and_abort_on_a_cluster() {
    let cluster = Cluster::start();
    let ex = Example::quickstart();
    std::fs::write(ex.dir.path().join("slow.toml"), SLOW_SCRIPT).unwrap();
    let spec = ex.write_spec(
        "goal = \"slow\"\nworkspace = \"workspace\"\nmodel = \"scripted:slow\"\nmax_turns = 200\n\
         [models.\"scripted:slow\"]\nscript = \"slow.toml\"\n\
         [[branches]]\nlabel = \"a\"\nsteer = \"go\"\n\
         [[branches]]\nlabel = \"b\"\nsteer = \"go\"\n\
         [[branches]]\nlabel = \"c\"\nsteer = \"go\"\n",
    );
    let created = cluster.client(&["fork", "create", path_str(&spec)]);
    assert_eq!(created.code, Some(0), "{}", created.stderr);
    let id = created.stdout.trim().to_string();

    // Wait until every branch runs.
    let deadline = Instant::now() + COMMAND_LIMIT;
    loop {
        let view = cluster.client(&["fork", "show", &id, "--json"]).json();
        if ["a", "b", "c"]
            .iter()
            .all(|l| branch(&view, l)["turns"].as_u64().unwrap() >= 1)
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "branches did not start: {view}\n{}",
            cluster.logs()
        );
        std::thread::sleep(Duration::from_millis(100));
    }

    let stopped = cluster.client(&["fork", "terminate", &id, "a"]);
    assert_eq!(stopped.code, Some(0), "{}", stopped.stderr);
    assert!(
        stopped.stdout.contains("terminate sent to branch `a`"),
        "{}",
        stopped.stdout
    );
    let nope = cluster.client(&["fork", "terminate", &id, "nope"]);
    assert_eq!(nope.code, Some(2), "{}", nope.stderr);
    assert!(
        nope.stderr.contains("valid labels: a, b, c"),
        "{}",
        nope.stderr
    );

    let aborted = cluster.client(&["fork", "abort", &id, "--json"]).json();
    assert_eq!(aborted["state"], "aborted");
    let terminated: Vec<&str> = aborted["terminated"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert!(
        terminated.contains(&"b") && terminated.contains(&"c"),
        "{aborted}"
    );

    // `watch` ends at once on an aborted fork; the branches stop at their next turn.
    let watched = cluster
        .client(&["fork", "watch", &id, "--json", "--timeout-s", "60"])
        .json();
    assert_eq!(watched["state"], "aborted");
    let deadline = Instant::now() + COMMAND_LIMIT;
    let view = loop {
        let view = cluster.client(&["fork", "show", &id, "--json"]).json();
        if ["a", "b", "c"].iter().all(|l| {
            branch(&view, l)["state"] != "running" && branch(&view, l)["state"] != "pending"
        }) {
            break view;
        }
        assert!(
            Instant::now() < deadline,
            "branches did not stop: {view}\n{}",
            cluster.logs()
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    for label in ["a", "b", "c"] {
        assert_eq!(
            branch(&view, label)["state"],
            "terminated",
            "{view}\n{}",
            cluster.logs()
        );
        assert!(branch(&view, label)["turns"].as_u64().unwrap() < 150);
    }

    let merge = cluster.client(&["fork", "merge", &id, "--pick", "a", "--no-apply"]);
    assert_eq!(merge.code, Some(2), "{}", merge.stderr);
    assert!(merge.stderr.contains("aborted"), "{}", merge.stderr);
    assert_eq!(ex.read("slow/a-0.md"), None, "nothing applied");
}

/// A script of 30 turns of 100 ms per branch: about 3 s.
const MEDIUM_SCRIPT: &str = r#"
[defaults]
latency_ms = 100
usage = { input_tokens = 100, output_tokens = 10 }

[[turns."*"]]
tool_calls = [{ name = "write_file", args = { path = "medium/{label}-{repeat}.md", content = "x\n" } }]
repeat = 30

[[turns."*"]]
text = "done"
"#;

#[test]
fn watch_rides_out_a_coordinator_restart() {
    let mut cluster = Cluster::start();
    let ex = Example::quickstart();
    std::fs::write(ex.dir.path().join("medium.toml"), MEDIUM_SCRIPT).unwrap();
    let spec = ex.write_spec(
        "goal = \"medium\"\nworkspace = \"workspace\"\nmodel = \"scripted:medium\"\nmax_turns = 50\n\
         [models.\"scripted:medium\"]\nscript = \"medium.toml\"\n\
         [[branches]]\nlabel = \"a\"\nsteer = \"go\"\n\
         [[branches]]\nlabel = \"b\"\nsteer = \"go\"\n",
    );
    let created = cluster.client(&["fork", "create", path_str(&spec)]);
    assert_eq!(created.code, Some(0), "{}", created.stderr);
    let id = created.stdout.trim().to_string();

    // `fork watch` in the background, while the coordinator is killed and restarted.
    let url = cluster.nats.url();
    let watch_out = cluster.dir.path().join("watch.out");
    let mut watch = Service {
        name: "watch".into(),
        child: Some(
            binary()
                .args([
                    "fork",
                    "watch",
                    &id,
                    "--json",
                    "--timeout-s",
                    "90",
                    "--nats",
                    &url,
                ])
                .stdin(Stdio::null())
                .stdout(std::fs::File::create(&watch_out).unwrap())
                .stderr(std::fs::File::create(cluster.dir.path().join("watch.err")).unwrap())
                .spawn()
                .unwrap(),
        ),
        log: cluster.dir.path().join("watch.err"),
    };
    // Kill it once the branches are under way (bounded wait on the fork's progress).
    let deadline = Instant::now() + COMMAND_LIMIT;
    loop {
        let shown = cluster.client(&["fork", "show", &id, "--json"]);
        if shown.code == Some(0)
            && shown.json()["branches"]
                .as_array()
                .is_some_and(|b| b.iter().any(|b| b["turns"].as_u64() >= Some(3)))
        {
            break;
        }
        assert!(Instant::now() < deadline, "no progress: {}", cluster.logs());
    }
    cluster.coordinator.child.as_mut().unwrap().kill().unwrap();
    cluster.coordinator.child.as_mut().unwrap().wait().unwrap();
    let data = cluster.dir.path().join("coordinator-data");
    cluster.coordinator = Service::spawn(
        "coordinator-2",
        &["coordinator", "--nats", &url, "--data", path_str(&data)],
        cluster.dir.path(),
    );

    let status = wait_bounded(watch.child.as_mut().unwrap(), Duration::from_secs(100))
        .unwrap_or_else(|| panic!("watch did not finish: {}\n{}", watch.log(), cluster.logs()));
    watch.child = None;
    assert!(status.success(), "{}\n{}", watch.log(), cluster.logs());
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(&watch_out).unwrap()).unwrap();
    for label in ["a", "b"] {
        assert_eq!(
            branch(&doc, label)["state"],
            "done",
            "{doc}\n{}",
            cluster.logs()
        );
        assert_eq!(branch(&doc, label)["turns"], 31, "{doc}");
    }
}
