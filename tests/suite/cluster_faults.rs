//! A cluster losing a part mid-fork: a worker killed with SIGKILL, the NATS server
//! restarted, garbage sent to every subject the services consume. Real processes on a real
//! nats-server; every wait bounded; children killed on drop.

use super::fleet::{Fleet, Options, SHORT_ACK_WAIT_S};
use super::harness::{branch, path_str, Example};
use forkfleet_bus::nats::{NatsBus, NatsConfig};
use forkfleet_bus::Bus;
use forkfleet_shared::api::API_SUBJECT;
use forkfleet_shared::budget::{BudgetReply, BUDGET_SUBJECT};
use forkfleet_shared::ids::RunId;
use forkfleet_shared::protocol::{ResumeReply, DEFAULT_POOL, RESUME_SUBJECT};
use forkfleet_shared::wire;
use serde_json::Value;
use std::path::PathBuf;
use std::time::Duration;

/// Turns of the test script: eight writes and an answer.
pub(super) const TURNS: u64 = 9;
/// The test model's price per call: 100 input and 10 output tokens at $1 and $10 per Mtok.
const COST_PER_CALL: f64 = 0.0002;

/// A fleet of `workers` workers of `concurrency` slots, with a short ack wait.
fn start(workers: usize, concurrency: usize) -> Fleet {
    Fleet::start(
        workers,
        concurrency,
        Options {
            ack_wait_s: Some(SHORT_ACK_WAIT_S),
            ..Options::default()
        },
    )
}

/// A spec of `n` branches playing eight writes at 150 ms a call, in a fresh copy of the quickstart.
fn faults_spec(ex: &Example, n: usize) -> PathBuf {
    faults_spec_at(ex, n, 150)
}

/// A spec of `n` branches playing eight writes (then an answer, [`TURNS`] calls) at
/// `latency_ms` a call, in a fresh copy of the quickstart.
pub(super) fn faults_spec_at(ex: &Example, n: usize, latency_ms: u64) -> PathBuf {
    std::fs::write(
        ex.dir.path().join("faults.toml"),
        super::harness::writes_then_done(
            latency_ms,
            true,
            "out/{label}/{repeat}.txt",
            "{label} {repeat}\\n",
            8,
        ),
    )
    .unwrap();
    ex.write_spec(&format!(
        "goal = \"faults\"\nworkspace = \"workspace\"\nmodel = \"scripted:faults\"\nmax_branches = {n}\n\
         [models.\"scripted:faults\"]\nscript = \"faults.toml\"\n\
         price = {{ input_per_mtok = 1.0, output_per_mtok = 10.0 }}\n{}",
        "[[branches]]\n".repeat(n)
    ))
}

/// Every branch finished its whole script exactly once: a contiguous log, every turn
/// made once, every paid call counted once. Returns how many branches were taken over.
pub(super) fn check_branches(fleet: &Fleet, view: &Value, n: usize) -> usize {
    let branches = view["branches"].as_array().unwrap();
    assert_eq!(branches.len(), n);
    let mut taken_over = 0;
    let fork_id = view["fork_id"].as_str().unwrap();
    let cost = fleet.client(&["fork", "cost", fork_id, "--json"]).json();
    for b in branches {
        assert_eq!(b["state"], "done", "{b}\n{}", fleet.logs());
        let log = fleet.log(b["id"].as_str().unwrap());
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
        // Every paid call counted once: the ledger's calls are the log's usage events plus
        // those of fenced attempts (ADR 18: an attempt taken over, e.g. when its ack was
        // lost to a NATS restart, may have paid for a call its log never shows), and the
        // spend is exactly those calls', no more.
        let logged = count("usage");
        assert!(logged >= TURNS, "{kinds:?}");
        let paid = cost["branches"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["label"] == b["label"])
            .unwrap_or_else(|| panic!("no cost of {}: {cost}", b["label"]));
        let calls = paid["calls"].as_u64().unwrap();
        assert!(
            calls >= logged,
            "{calls} calls paid, {logged} logged: {paid}"
        );
        let spent = paid["spent_usd"].as_f64().unwrap();
        assert!(
            (spent - calls as f64 * COST_PER_CALL).abs() < 1e-9,
            "{spent} for {calls} calls"
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

#[test]
fn killed_workers_branches_are_taken_over_and_finish_once() {
    let mut fleet = start(3, 3);
    let ex = Example::quickstart();
    let spec = faults_spec(&ex, 12);
    let id = fleet.create(&spec);

    // With 12 branches on 3 x 3 slots, the first nine run at once: kill two workers
    // (SIGKILL) once seven are under way, so their branches are lost mid-run.
    fleet.wait_progress(&id, 7);
    for w in fleet.workers.iter_mut().take(2) {
        w.kill();
    }

    let view = fleet.watch(&id);
    let taken_over = check_branches(&fleet, &view, 12);
    assert!(
        taken_over >= 1,
        "a killed worker's branch was taken over\n{}",
        fleet.logs()
    );
}

#[test]
fn a_nats_server_restart_mid_fork_loses_nothing() {
    let mut fleet = start(2, 4);
    let ex = Example::quickstart();
    let spec = faults_spec(&ex, 6);
    let id = fleet.create(&spec);
    fleet.wait_progress(&id, 4);
    fleet.nats.restart();
    let view = fleet.watch(&id);
    check_branches(&fleet, &view, 6);
    // The services are still there.
    for s in std::iter::once(&mut fleet.coordinator).chain(fleet.workers.iter_mut()) {
        assert!(
            s.child.as_mut().unwrap().try_wait().unwrap().is_none(),
            "{} exited",
            s.name
        );
    }
}

/// NATS down for 30 s mid-fork, longer than the coordinator's lease (15 s): the
/// coordinator stops serving, waits for NATS and takes its lease again instead of exiting,
/// the workers' branches are delivered again, and every branch finishes its script once.
/// With `max_deliver` 1 the outage uses up every task's deliveries: they are queued again,
/// not failed, since the outage, not the branch, lost them (ADR 38).
/// The outage's length is the fault itself, not a wait for something to happen.
#[test]
fn a_thirty_second_nats_outage_is_ridden_out_by_every_service() {
    let mut fleet = Fleet::start(
        2,
        4,
        Options {
            ack_wait_s: Some(SHORT_ACK_WAIT_S),
            max_deliver: Some("1"),
            ..Options::default()
        },
    );
    let ex = Example::quickstart();
    let spec = faults_spec(&ex, 6);
    let id = fleet.create(&spec);
    fleet.wait_progress(&id, 4);
    fleet.nats.stop();
    std::thread::sleep(std::time::Duration::from_secs(30));
    fleet.nats.resume();
    let view = fleet.watch(&id);
    check_branches(&fleet, &view, 6);
    for s in std::iter::once(&mut fleet.coordinator).chain(fleet.workers.iter_mut()) {
        assert!(
            s.child.as_mut().unwrap().try_wait().unwrap().is_none(),
            "{} exited:\n{}",
            s.name,
            s.log()
        );
    }
    let log = fleet.coordinator.log();
    assert!(
        log.contains("standing by to take the lease again")
            && log.contains("coordinator lease taken"),
        "{log}"
    );
    assert!(
        log.contains("fork.dead_task") && log.contains("queued again"),
        "{log}"
    );
    // A fleet without roles: each service said so at start.
    assert!(
        log.contains("UNRESTRICTED CLUSTER: this coordinator"),
        "{log}"
    );
    assert!(fleet.workers[0]
        .log()
        .contains("UNRESTRICTED CLUSTER: this worker"));
}

/// NATS frozen (SIGSTOP, its connections left open) twice for 12 s, half a second apart,
/// with `max_deliver` 1: each freeze outlasts the 2 s leases, so every task in flight dies,
/// the second time before the requeued tasks made a turn. The coordinator sees a freeze by
/// its pulls' missed heartbeats (no reconnect happens), so the tasks are queued again, not
/// failed, and every branch finishes its script once (ADR 38). The freezes are the fault
/// itself, not waits for something to happen.
#[test]
fn a_nats_server_frozen_twice_loses_no_branch() {
    let fleet = Fleet::start(
        2,
        4,
        Options {
            ack_wait_s: Some(SHORT_ACK_WAIT_S),
            max_deliver: Some("1"),
            ..Options::default()
        },
    );
    let ex = Example::quickstart();
    let spec = faults_spec_at(&ex, 3, 1000);
    let id = fleet.create(&spec);
    fleet.wait_progress(&id, 3);
    let pid = fleet.nats.pid().expect("a running nats-server") as i32;
    for _ in 0..2 {
        // SAFETY: signals to the child process this test started.
        unsafe { libc::kill(pid, libc::SIGSTOP) };
        std::thread::sleep(Duration::from_secs(12));
        unsafe { libc::kill(pid, libc::SIGCONT) };
        std::thread::sleep(Duration::from_millis(500));
    }
    let view = fleet.watch(&id);
    check_branches(&fleet, &view, 3);
    let log = fleet.coordinator.log();
    assert!(
        log.contains("fork.dead_task") && log.contains("queued again"),
        "{log}"
    );
}

/// A coordinator killed (SIGKILL) and started again on the same host: the lease names a
/// process of this host and pid namespace that is gone, so it is taken at once rather
/// than after its TTL, and the fork finishes.
#[test]
fn a_coordinator_restarted_after_a_kill_takes_its_dead_predecessors_lease_at_once() {
    let mut fleet = start(1, 4);
    let ex = Example::quickstart();
    let spec = faults_spec(&ex, 3);
    let id = fleet.create(&spec);
    fleet.wait_progress(&id, 2);
    fleet.coordinator.kill();
    fleet.coordinator = fleet.spawn_coordinator("coordinator-2");
    let view = fleet.watch(&id);
    check_branches(&fleet, &view, 3);
    let log = fleet.coordinator.log();
    assert!(
        log.contains("taken over at once: its holder was a process of this host that is gone"),
        "{log}"
    );
    assert!(
        !log.contains("standby:"),
        "it stood by for a dead holder:\n{log}"
    );
}

#[test]
fn garbage_on_every_subject_is_rejected_and_the_services_go_on() {
    let fleet = start(1, 4);
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
    let fleet = start(3, 3);
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

/// A 3-node NATS cluster on loopback (routes), every stream and bucket with 3 replicas:
/// one node killed mid-fork loses nothing; the services reconnect to the others and every
/// branch's script runs once.
#[test]
fn a_three_node_nats_cluster_loses_a_node_mid_fork_and_nothing_is_lost() {
    use forkfleet_bus::testkit::{free_port, NatsServer};
    let routes: Vec<u16> = (0..3).map(|_| free_port()).collect();
    let all_routes = routes
        .iter()
        .map(|p| format!("nats://127.0.0.1:{p}"))
        .collect::<Vec<_>>()
        .join(",");
    // JetStream's own limit: by default 75 % of the disk's free space, which three servers
    // on one disk, each reserving every R3 stream's and bucket's max_bytes (about 19 GiB by
    // default), fall below once the disk is a quarter full ("insufficient storage").
    let conf_dir = tempfile::tempdir().unwrap();
    let conf = conf_dir.path().join("js.conf");
    std::fs::write(&conf, "jetstream { max_file_store: 256GB }\n").unwrap();
    let mut nodes: Vec<NatsServer> = routes
        .iter()
        .enumerate()
        .map(|(i, port)| {
            NatsServer::start_with(&[
                "-c",
                path_str(&conf),
                "--server_name",
                &format!("n{i}"),
                "--cluster_name",
                "ff",
                "--cluster",
                &format!("nats://127.0.0.1:{port}"),
                "--routes",
                &all_routes,
            ])
        })
        .collect();
    let urls = nodes.iter().map(|n| n.url()).collect::<Vec<_>>().join(",");
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("coordinator-data");
    let common = [
        "--nats",
        urls.as_str(),
        "--nats-replicas",
        "3",
        // Three servers form their JetStream group slowly on a loaded machine: the
        // services wait for it longer than the default 15 s.
        "--nats-connect-timeout-s",
        "90",
        // The default ack wait (30 s): a node's loss stalls the acks routed through it
        // while the streams elect new leaders, which on a loaded machine takes longer than
        // a short test ack wait (each lapse is a delivery; issue 36's note says so).
    ];
    let mut coordinator_args = vec!["coordinator", "--data", path_str(&data)];
    coordinator_args.extend(common);
    let _coordinator = super::fleet::Service::spawn("coordinator", &coordinator_args, dir.path());
    let mut worker_args = vec!["worker", "--concurrency", "4"];
    worker_args.extend(common);
    let workers: Vec<_> = (0..2)
        .map(|i| super::fleet::Service::spawn(&format!("worker-{i}"), &worker_args, dir.path()))
        .collect();
    let logs = || {
        let mut out = String::new();
        for s in std::iter::once(&_coordinator).chain(workers.iter()) {
            out.push_str(&format!("{}:\n{}\n", s.name, s.log()));
        }
        out
    };
    let client = |args: &[&str]| {
        let mut all = args.to_vec();
        // The client creates what is missing too (`[nats] provision`): with the services'
        // replicas, or a stream it makes first would live on one node, lost with it.
        all.extend(["--nats", urls.as_str(), "--nats-replicas", "3"]);
        super::fleet::run(dir.path(), &all)
    };
    // Until the coordinator answers (JetStream's meta group forms first).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while client(&["fork", "ls", "--json"]).code != Some(0) {
        assert!(
            std::time::Instant::now() < deadline,
            "no coordinator\n{}",
            logs()
        );
        std::thread::sleep(super::fleet::POLL);
    }
    let ex = Example::quickstart();
    let spec = faults_spec(&ex, 6);
    let created = client(&["fork", "create", path_str(&spec)]);
    assert_eq!(created.code, Some(0), "{}\n{}", created.stderr, logs());
    let id = created.stdout.trim().to_string();
    // Once branches are under way, one node goes.
    let deadline = std::time::Instant::now() + super::fleet::COMMAND_LIMIT;
    loop {
        let shown = client(&["fork", "show", &id, "--json"]);
        if shown.code == Some(0)
            && shown.json()["branches"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|b| b["turns"].as_u64() >= Some(1))
                .count()
                >= 3
        {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no progress\n{}",
            logs()
        );
        std::thread::sleep(super::fleet::POLL);
    }
    nodes[1].kill();
    // Until every branch has ended (bounded): the streams elect new leaders first, which
    // takes longer on a loaded machine than one command's bound.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(180);
    let view = loop {
        let shown = client(&["fork", "show", &id, "--json"]);
        if shown.code == Some(0) {
            let view = shown.json();
            let ended = view["branches"]
                .as_array()
                .unwrap()
                .iter()
                .all(|b| !matches!(b["state"].as_str(), Some("pending" | "running")));
            if ended {
                break view;
            }
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the fork did not end\n{}",
            logs()
        );
        std::thread::sleep(std::time::Duration::from_millis(500));
    };
    for b in view["branches"].as_array().unwrap() {
        assert_eq!(b["state"], "done", "{b}\n{}", logs());
        assert_eq!(b["turns"], TURNS, "{b}");
        // Its log is contiguous: nothing lost, nothing twice.
        let log = client(&["log", b["id"].as_str().unwrap(), "--json"]).json();
        let seqs: Vec<u64> = log
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["seq"].as_u64().unwrap())
            .collect();
        assert_eq!(seqs, (0..seqs.len() as u64).collect::<Vec<_>>());
    }
}

/// A branch whose log is larger than NATS carries in one message (1 MiB: six writes of
/// 300 KB) is taken over after its worker dies: the coordinator answers the takeover with
/// the log in the blob store, and the branch finishes. (It used to wait for ever, its
/// worker taking the unanswered request for an unreachable coordinator.)
#[test]
fn a_branch_whose_log_passes_the_message_limit_is_taken_over() {
    let mut fleet = start(1, 1);
    let ex = Example::quickstart();
    let big = "y".repeat(300_000);
    std::fs::write(
        ex.dir.path().join("big.toml"),
        super::harness::writes_then_done(300, true, "big/{repeat}.txt", &big, 6),
    )
    .unwrap();
    let spec = ex.write_spec(
        "goal = \"big\"\nworkspace = \"workspace\"\nmodel = \"scripted:big\"\n\
         [models.\"scripted:big\"]\nscript = \"big.toml\"\n\
         price = { input_per_mtok = 1.0, output_per_mtok = 10.0 }\n[[branches]]\nlabel = \"a\"\n",
    );
    let id = fleet.create(&spec);
    // Once its log is past the limit (four calls), its only worker dies; another comes.
    let deadline = std::time::Instant::now() + super::fleet::COMMAND_LIMIT;
    loop {
        let shown = fleet.client(&["fork", "show", &id, "--json"]);
        if shown.code == Some(0) && shown.json()["branches"][0]["turns"].as_u64() >= Some(4) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no progress\n{}",
            fleet.logs()
        );
        std::thread::sleep(super::fleet::POLL);
    }
    fleet.workers[0].kill();
    fleet.workers.push(fleet.spawn_worker("worker-1"));
    let view = fleet.watch(&id);
    assert_eq!(
        view["branches"][0]["state"],
        "done",
        "{view}\n{}",
        fleet.logs()
    );
    assert!(
        fleet
            .coordinator
            .log()
            .contains("the branch's log goes as a blob"),
        "{}",
        fleet.logs()
    );
}
