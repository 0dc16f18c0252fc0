//! The rolling restart a Kubernetes Deployment does, with real processes on a real
//! nats-server: every worker replaced one by one mid-fork (a new one started, the old one
//! sent SIGTERM and drained), and no branch lost or run twice. The OOM kill (SIGKILL) of a
//! worker mid-fork is `cluster_faults::killed_workers_branches_are_taken_over_and_finish_once`,
//! with the same checks. Also: the KEDA trigger of every Kustomize and Helm rendering names
//! the task stream and the worker consumer the bus really creates.

use super::cluster_faults::{check_branches, faults_spec_at};
use super::fleet::{Fleet, Options, COMMAND_LIMIT, POLL, SHORT_ACK_WAIT_S};
use super::harness::Example;
use serde_json::Value;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Instant;

/// The workers' `--drain-grace-s`: well under a branch's length, so a drain hands some back.
const DRAIN_GRACE_S: &str = "1";
/// A scripted call's latency: nine calls make a branch of about 4.5 s.
const LATENCY_MS: u64 = 500;

/// Until `forkfleet workers` lists `n` workers (bounded).
fn wait_workers(fleet: &Fleet, n: usize) {
    let deadline = Instant::now() + COMMAND_LIMIT;
    loop {
        let listed = fleet.client(&["workers", "--json"]);
        if listed.code == Some(0) && listed.json().as_array().map(Vec::len) == Some(n) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "not {n} workers: {}\n{}",
            listed.stdout,
            fleet.logs()
        );
        std::thread::sleep(POLL);
    }
}

/// A rolling update with `maxSurge: 1, maxUnavailable: 0`: for each of the three workers, a
/// new worker is started and listed first, then the old one gets SIGTERM and drains (its
/// running branches have 1 s to finish, then are handed back) before the next is replaced.
#[test]
fn a_rolling_restart_of_every_worker_loses_no_branch_and_runs_none_twice() {
    let mut fleet = Fleet::start(
        3,
        2,
        Options {
            ack_wait_s: Some(SHORT_ACK_WAIT_S),
            drain_grace_s: Some(DRAIN_GRACE_S),
            ..Options::default()
        },
    );
    let ex = Example::quickstart();
    let spec = faults_spec_at(&ex, 12, LATENCY_MS);
    let id = fleet.create(&spec);
    // Every slot busy (3 x 2) before the first worker is replaced.
    fleet.wait_progress(&id, 6);

    for old in 0..3 {
        let new = fleet.spawn_worker(&format!("worker-{}", old + 3));
        fleet.workers.push(new);
        wait_workers(&fleet, 4);
        let status = fleet.workers[old].terminate();
        assert!(
            status.success(),
            "{} drained and exited cleanly: {status}\n{}",
            fleet.workers[old].name,
            fleet.workers[old].log()
        );
        wait_workers(&fleet, 3);
    }

    let view = fleet.watch(&id);
    let taken_over = check_branches(&fleet, &view, 12);
    let handed_back: usize = fleet.workers[..3]
        .iter()
        .map(|w| w.log().matches("branch handed back").count())
        .sum();
    assert!(
        handed_back >= 1 && taken_over >= 1,
        "a drained worker handed back a branch ({handed_back}) and another resumed it \
         ({taken_over})\n{}",
        fleet.logs()
    );
}

/// The `nats-jetstream` triggers of every rendering of `deploy/kubernetes` and
/// `deploy/helm/forkfleet` (`scripts/check-kubernetes --print-keda`, which renders them as
/// the suite's check does), each as `{rendering, pool, stream, consumer}`.
fn rendered_keda_triggers() -> Vec<Value> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    // scripts/test exports the Python scripts/setup found; python3 otherwise.
    let python = std::env::var("FORKFLEET_PYTHON").unwrap_or_else(|_| "python3".to_string());
    let out = Command::new(&python)
        .arg(root.join("scripts/check-kubernetes"))
        .arg("--print-keda")
        .current_dir(root)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("{python} scripts/check-kubernetes: {e}"));
    assert!(
        out.status.success(),
        "scripts/check-kubernetes --print-keda: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let doc: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "scripts/check-kubernetes --print-keda printed no JSON ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        )
    });
    doc.as_array().unwrap().clone()
}

/// The stream holding the tasks of pool `default` and the durable consumer filtered on it,
/// as the running bus created them (read from the JetStream API, bounded).
fn task_stream_and_consumer(url: &str) -> (String, String) {
    use futures::StreamExt;
    let subject = forkfleet_shared::subjects::task_subject("default").unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let client = async_nats::connect(url).await.unwrap();
        let js = async_nats::jetstream::new(client);
        let deadline = Instant::now() + COMMAND_LIMIT;
        loop {
            let mut streams = js.streams();
            while let Some(info) = streams.next().await {
                let info = info.unwrap();
                let covers = info.config.subjects.iter().any(|s| {
                    s == &subject || (s.ends_with(".*") && subject.starts_with(&s[..s.len() - 1]))
                });
                if !covers {
                    continue;
                }
                let stream = js.get_stream(&info.config.name).await.unwrap();
                let mut consumers = stream.consumers();
                while let Some(c) = consumers.next().await {
                    let c = c.unwrap();
                    if c.config.filter_subject == subject && c.config.durable_name.is_some() {
                        return (info.config.name.clone(), c.name);
                    }
                }
            }
            assert!(
                Instant::now() < deadline,
                "no stream and durable consumer for {subject}"
            );
            tokio::time::sleep(POLL).await;
        }
    })
}

#[test]
fn the_keda_trigger_names_the_stream_and_consumer_the_bus_creates() {
    let fleet = Fleet::start(1, 1, Options::default());
    let (stream, consumer) = task_stream_and_consumer(&fleet.nats.url());
    let triggers = rendered_keda_triggers();
    for want in ["deploy/kubernetes/", "deploy/helm/forkfleet"] {
        assert!(
            triggers
                .iter()
                .any(|t| t["rendering"].as_str().unwrap().starts_with(want)),
            "no rendering of {want} has a KEDA trigger: {triggers:?}"
        );
    }
    for t in &triggers {
        // The worker above runs in pool `default`, as the renderings' workers do.
        assert_eq!(t["pool"], "default", "{t}");
        assert_eq!(
            (t["stream"].as_str(), t["consumer"].as_str()),
            (Some(stream.as_str()), Some(consumer.as_str())),
            "the KEDA trigger's (stream, consumer) of {} are not the bus's",
            t["rendering"]
        );
    }
}
