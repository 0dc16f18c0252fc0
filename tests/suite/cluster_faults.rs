//! A cluster losing a part mid-fork: a worker killed with SIGKILL, the NATS server
//! restarted, garbage sent to every subject the services consume. Real processes on a real
//! nats-server; every wait bounded; children killed on drop.

use super::cluster_cli::{branch, run, Ran, Service, COMMAND_LIMIT};
use super::harness::{path_str, Example};
use forkfleet_shared::api::API_SUBJECT;
use forkfleet_shared::budget::{BudgetReply, BUDGET_SUBJECT};
use forkfleet_shared::bus::nats::{NatsBus, NatsConfig};
use forkfleet_shared::bus::Bus;
use forkfleet_shared::ids::RunId;
use forkfleet_shared::protocol::{ResumeReply, DEFAULT_POOL, RESUME_SUBJECT};
use forkfleet_shared::testkit::NatsServer;
use forkfleet_shared::wire;
use serde_json::Value;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// A short ack wait, so a lost worker's tasks come back within the test.
const ACK_WAIT_S: &str = "2";
/// Turns of the test script: eight writes and an answer.
const TURNS: u64 = 9;
/// The test model's price per call: 100 input and 10 output tokens at $1 and $10 per Mtok.
const COST_PER_CALL: f64 = 0.0002;

const SCRIPT: &str = r#"
[defaults]
latency_ms = 150
usage = { input_tokens = 100, output_tokens = 10 }

[[turns."*"]]
tool_calls = [{ name = "write_file", args = { path = "out/{label}/{repeat}.txt", content = "{label} {repeat}\n" } }]
repeat = 8

[[turns."*"]]
text = "done"
"#;

/// A nats-server, a coordinator and `n` workers.
pub(super) struct Fleet {
    pub(super) nats: NatsServer,
    pub(super) coordinator: Service,
    pub(super) workers: Vec<Service>,
    pub(super) dir: tempfile::TempDir,
}

impl Fleet {
    fn start(workers: usize, concurrency: usize) -> Fleet {
        Self::start_env(workers, concurrency, &[])
    }

    /// `workers` worker processes of `concurrency` slots each, with `env` set.
    pub(super) fn start_env(workers: usize, concurrency: usize, env: &[(&str, &str)]) -> Fleet {
        let nats = NatsServer::start();
        let dir = tempfile::tempdir().unwrap();
        let url = nats.url();
        let data = dir.path().join("coordinator-data");
        let coordinator = Service::spawn(
            "coordinator",
            &[
                "coordinator",
                "--nats",
                &url,
                "--data",
                path_str(&data),
                "--nats-ack-wait-s",
                ACK_WAIT_S,
            ],
            dir.path(),
        );
        let concurrency = concurrency.to_string();
        let workers = (0..workers)
            .map(|i| {
                Service::spawn_env(
                    &format!("worker-{i}"),
                    &[
                        "worker",
                        "--nats",
                        &url,
                        "--concurrency",
                        &concurrency,
                        "--nats-ack-wait-s",
                        ACK_WAIT_S,
                    ],
                    dir.path(),
                    env,
                )
            })
            .collect();
        let fleet = Fleet {
            nats,
            coordinator,
            workers,
            dir,
        };
        fleet.wait_ready();
        fleet
    }

    fn wait_ready(&self) {
        let deadline = Instant::now() + COMMAND_LIMIT;
        loop {
            let workers = self.client(&["workers", "--json"]);
            let ls = self.client(&["fork", "ls", "--json"]);
            if ls.code == Some(0)
                && workers.code == Some(0)
                && workers.json().as_array().map(Vec::len) == Some(self.workers.len())
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the fleet did not come up\n{}",
                self.logs()
            );
        }
    }

    pub(super) fn client(&self, args: &[&str]) -> Ran {
        let url = self.nats.url();
        let mut all = args.to_vec();
        all.extend(["--nats", &url]);
        run(self.dir.path(), &all)
    }

    pub(super) fn logs(&self) -> String {
        let mut out = format!("coordinator:\n{}\n", self.coordinator.log());
        for w in &self.workers {
            out.push_str(&format!("{}:\n{}\n", w.name, w.log()));
        }
        out
    }

    /// A spec of `n` branches playing [`SCRIPT`], in a fresh copy of the quickstart.
    fn spec(&self, ex: &Example, n: usize) -> PathBuf {
        std::fs::write(ex.dir.path().join("faults.toml"), SCRIPT).unwrap();
        ex.write_spec(&format!(
            "goal = \"faults\"\nworkspace = \"workspace\"\nmodel = \"scripted:faults\"\nmax_branches = {n}\n\
             [models.\"scripted:faults\"]\nscript = \"faults.toml\"\n\
             price = {{ input_per_mtok = 1.0, output_per_mtok = 10.0 }}\n{}",
            "[[branches]]\n".repeat(n)
        ))
    }

    pub(super) fn create(&self, spec: &std::path::Path) -> String {
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
        }
    }

    /// `fork watch` to the end: the final view.
    pub(super) fn watch(&self, id: &str) -> Value {
        let watched = self.client(&["fork", "watch", id, "--json", "--timeout-s", "50"]);
        assert_eq!(watched.code, Some(0), "{}\n{}", watched.stderr, self.logs());
        watched.json()
    }

    pub(super) fn log(&self, run: &str) -> Vec<Value> {
        self.client(&["log", run, "--json"])
            .json()
            .as_array()
            .unwrap()
            .clone()
    }

    /// Every branch finished its whole script exactly once: a contiguous log, every turn
    /// made once, every paid call counted once. Returns how many branches were taken over.
    fn check_branches(&self, view: &Value, n: usize) -> usize {
        let branches = view["branches"].as_array().unwrap();
        assert_eq!(branches.len(), n);
        let mut taken_over = 0;
        for b in branches {
            assert_eq!(b["state"], "done", "{b}\n{}", self.logs());
            let log = self.log(b["id"].as_str().unwrap());
            let seqs: Vec<u64> = log.iter().map(|e| e["seq"].as_u64().unwrap()).collect();
            assert_eq!(
                seqs,
                (0..log.len() as u64).collect::<Vec<_>>(),
                "contiguous"
            );
            let kinds: Vec<&str> = log
                .iter()
                .map(|e| e["event"]["type"].as_str().unwrap())
                .collect();
            let count = |k: &str| kinds.iter().filter(|x| **x == k).count() as u64;
            // The parent's goal is the only model_response-free prefix; every turn once.
            assert_eq!(count("model_response"), TURNS, "{}: {kinds:?}", b["label"]);
            assert_eq!(b["turns"], TURNS);
            // Every paid call counted once: the cost is the usage events', no more.
            let calls = count("usage");
            assert!(calls >= TURNS, "{kinds:?}");
            let cost = b["cost_usd"].as_f64().unwrap();
            assert!(
                (cost - calls as f64 * COST_PER_CALL).abs() < 1e-9,
                "{cost} for {calls} calls"
            );
            let runnings = log
                .iter()
                .filter(|e| e["event"]["type"] == "status" && e["event"]["state"] == "running")
                .count();
            if runnings > 1 {
                taken_over += 1;
            }
            let last = log.last().unwrap();
            assert_eq!(
                last["event"]["state"], "done",
                "the terminal status is last"
            );
        }
        taken_over
    }
}

#[test]
fn killed_workers_branches_are_taken_over_and_finish_once() {
    let mut fleet = Fleet::start(3, 3);
    let ex = Example::quickstart();
    let spec = fleet.spec(&ex, 12);
    let id = fleet.create(&spec);

    // With 12 branches on 3 x 3 slots, the first nine run at once: kill two workers
    // (SIGKILL) once seven are under way, so their branches are lost mid-run.
    fleet.wait_progress(&id, 7);
    for w in fleet.workers.iter_mut().take(2) {
        let child = w.child.as_mut().unwrap();
        child.kill().unwrap();
        child.wait().unwrap();
        w.child = None;
    }

    let view = fleet.watch(&id);
    let taken_over = fleet.check_branches(&view, 12);
    assert!(
        taken_over >= 1,
        "a killed worker's branch was taken over\n{}",
        fleet.logs()
    );
}

#[test]
fn a_nats_server_restart_mid_fork_loses_nothing() {
    let mut fleet = Fleet::start(2, 4);
    let ex = Example::quickstart();
    let spec = fleet.spec(&ex, 6);
    let id = fleet.create(&spec);
    fleet.wait_progress(&id, 4);
    fleet.nats.restart();
    let view = fleet.watch(&id);
    fleet.check_branches(&view, 6);
    // The services are still there.
    for s in std::iter::once(&mut fleet.coordinator).chain(fleet.workers.iter_mut()) {
        assert!(
            s.child.as_mut().unwrap().try_wait().unwrap().is_none(),
            "{} exited",
            s.name
        );
    }
}

#[test]
fn garbage_on_every_subject_is_rejected_and_the_services_go_on() {
    let fleet = Fleet::start(1, 4);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let bus = tokio::time::timeout(
            Duration::from_secs(20),
            NatsBus::connect(NatsConfig::new(fleet.nats.url())),
        )
        .await
        .unwrap()
        .unwrap();
        let garbage = bytes::Bytes::from_static(b"\xc1 not a forkfleet message");
        let wait = Duration::from_secs(20);
        // Consumed by workers.
        tokio::time::timeout(wait, bus.enqueue_task(DEFAULT_POOL, garbage.clone()))
            .await
            .unwrap()
            .unwrap();
        tokio::time::timeout(wait, bus.send_control(RunId::new(), garbage.clone()))
            .await
            .unwrap()
            .unwrap();
        // Consumed by the coordinator.
        tokio::time::timeout(wait, bus.publish_event(garbage.clone()))
            .await
            .unwrap()
            .unwrap();
        let api = bus
            .request(API_SUBJECT, garbage.clone(), wait)
            .await
            .unwrap();
        let reply = String::from_utf8_lossy(&api).to_string();
        assert!(reply.contains("bad_input"), "{reply}");
        let resume = bus
            .request(RESUME_SUBJECT, garbage.clone(), wait)
            .await
            .unwrap();
        assert!(matches!(
            wire::decode::<ResumeReply>(&resume).unwrap(),
            ResumeReply::Retry { .. }
        ));
        let budget = bus
            .request(BUDGET_SUBJECT, garbage.clone(), wait)
            .await
            .unwrap();
        assert!(matches!(
            wire::decode::<BudgetReply>(&budget).unwrap(),
            BudgetReply::Retry { .. }
        ));
    });

    // A fork still runs to the end on the same services.
    let ex = Example::quickstart();
    let created = fleet
        .client(&["fork", "create", path_str(&ex.spec()), "--json"])
        .json();
    let id = created["fork_id"].as_str().unwrap();
    let view = fleet.watch(id);
    for label in ["concise", "thorough", "tidy"] {
        assert_eq!(
            branch(&view, label)["state"],
            "done",
            "{view}\n{}",
            fleet.logs()
        );
    }
    let logs = fleet.logs();
    assert!(logs.contains("undecodable branch task"), "{logs}");
    assert!(
        logs.contains("undecodable message on the event stream"),
        "{logs}"
    );
}

const TWENTY_SCRIPT: &str = r#"
[defaults]
latency_ms = 20

[[turns."*"]]
tool_calls = [
  { name = "write_file", args = { path = "out/{label}.txt", content = "{label}\n" } },
  { name = "write_file", args = { path = "agree.txt", content = "same\n" } },
]

[[turns."*"]]
tool_calls = [
  { name = "delete_file", args = { path = "docs/legacy.md" } },
  { name = "edit_file", args = { path = "README.md", old_string = "TODO: describe usage.", new_string = "Usage by {label}." } },
]

[[turns."*"]]
text = "done"
"#;

/// The files under `dir`, path -> content.
fn tree(dir: &std::path::Path) -> std::collections::BTreeMap<String, String> {
    let mut out = std::collections::BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                let rel = p.strip_prefix(dir).unwrap().to_string_lossy().to_string();
                out.insert(rel, std::fs::read_to_string(&p).unwrap());
            }
        }
    }
    out
}

#[test]
fn twenty_branches_on_three_workers_match_the_embedded_mode() {
    let spec_text = |dir: &std::path::Path| {
        std::fs::write(dir.join("twenty.toml"), TWENTY_SCRIPT).unwrap();
        format!(
            "goal = \"twenty\"\nworkspace = \"workspace\"\nmodel = \"scripted:twenty\"\nmax_branches = 20\n\
             [models.\"scripted:twenty\"]\nscript = \"twenty.toml\"\n{}",
            "[[branches]]\n".repeat(20)
        )
    };
    // Embedded.
    let local = Example::quickstart();
    let local_spec = local.write_spec(&spec_text(local.dir.path()));
    let embedded = super::harness::json(&super::harness::forkfleet(&[
        "run",
        path_str(&local_spec),
        "--pick",
        "branch-7",
        "--json",
        "--timeout-s",
        "120",
    ]));

    // The cluster: one coordinator, three workers.
    let fleet = Fleet::start(3, 3);
    let remote = Example::quickstart();
    let remote_spec = remote.write_spec(&spec_text(remote.dir.path()));
    let id = fleet.create(&remote_spec);
    let view = fleet.watch(&id);
    for b in view["branches"].as_array().unwrap() {
        assert_eq!(b["state"], "done", "{b}\n{}", fleet.logs());
    }
    let diff = fleet.client(&["fork", "diff", &id, "--json"]).json();
    assert_eq!(diff["summary"], embedded["diff"]["summary"]);
    assert_eq!(diff["summary"]["total_paths_touched"], 23);
    let shape = |paths: &Value| -> Vec<(Value, Value, Value)> {
        paths
            .as_array()
            .unwrap()
            .iter()
            .map(|p| {
                (
                    p["path"].clone(),
                    p["agreement"].clone(),
                    p["operations"].clone(),
                )
            })
            .collect()
    };
    assert_eq!(shape(&diff["paths"]), shape(&embedded["diff"]["paths"]));

    let workspace = remote.workspace();
    let merged = fleet
        .client(&[
            "fork",
            "merge",
            &id,
            "--pick",
            "branch-7",
            "--apply",
            path_str(&workspace),
            "--json",
        ])
        .json();
    for key in [
        "applied_paths",
        "applied_changes",
        "deleted_paths",
        "conflicts",
        "errors",
    ] {
        assert_eq!(merged["merge"][key], embedded["merge"][key], "{key}");
    }
    assert_eq!(tree(&workspace), tree(&local.workspace()));
    assert_eq!(
        tree(&workspace)
            .get("README.md")
            .map(|s| s.contains("Usage by branch-7.")),
        Some(true)
    );
}
