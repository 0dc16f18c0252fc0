//! The rolling restart a Kubernetes Deployment does, with real processes on a real
//! nats-server: every worker replaced one by one mid-fork (a new one started, the old one
//! sent SIGTERM and drained), and no branch lost or run twice. The OOM kill (SIGKILL) of a
//! worker mid-fork is `cluster_faults::killed_workers_branches_are_taken_over_and_finish_once`,
//! with the same checks. Also: the KEDA trigger of `deploy/kubernetes/base` names the task
//! stream and the worker consumer the bus really creates.

use super::cluster_faults::{check_branches, faults_spec_at};
use super::fleet::{Fleet, Options, COMMAND_LIMIT, POLL, SHORT_ACK_WAIT_S};
use super::harness::Example;
use std::path::{Path, PathBuf};
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

/// The YAML files under `dir`, recursively, sorted.
fn yaml_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let entries = std::fs::read_dir(&d).unwrap_or_else(|e| {
            panic!(
                "{}: {e} (the Kustomize manifests holding the KEDA ScaledObject)",
                d.display()
            )
        });
        for e in entries {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else if matches!(p.extension().and_then(|e| e.to_str()), Some("yaml" | "yml")) {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

/// The `stream` and `consumer` of every `ScaledObject` in the YAML files under `dir`, read
/// line by line: the documents are split at `---`, and in one of `kind: ScaledObject` the
/// first `stream:` and `consumer:` keys are taken, their values unquoted. A document with
/// neither (an overlay's patch of the replica counts) is passed over. No YAML parser is a
/// dependency, and the manifests are plain block YAML.
fn keda_trigger_names(dir: &Path) -> Vec<(PathBuf, String, String)> {
    let value = |line: &str, key: &str| -> Option<String> {
        let rest = line.trim().strip_prefix(key)?.strip_prefix(':')?;
        let v = rest.split(" #").next().unwrap_or("").trim();
        Some(v.trim_matches(|c| c == '"' || c == '\'').to_string())
    };
    let mut found = Vec::new();
    for file in yaml_files(dir) {
        let text = std::fs::read_to_string(&file).unwrap();
        for doc in text.split("\n---") {
            if !doc
                .lines()
                .any(|l| value(l, "kind").as_deref() == Some("ScaledObject"))
            {
                continue;
            }
            let first = |key: &str| doc.lines().find_map(|l| value(l, key));
            match (first("stream"), first("consumer")) {
                (None, None) => {}
                (Some(stream), Some(consumer)) => found.push((file.clone(), stream, consumer)),
                _ => panic!(
                    "{}: a ScaledObject trigger needs both `stream` and `consumer`:\n{doc}",
                    file.display()
                ),
            }
        }
    }
    found
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
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/kubernetes");
    let triggers = keda_trigger_names(&root);
    assert!(
        triggers
            .iter()
            .any(|(file, _, _)| file.starts_with(root.join("base"))),
        "no ScaledObject with a trigger in {}/base",
        root.display()
    );
    for (file, s, c) in triggers {
        assert_eq!(
            (s.as_str(), c.as_str()),
            (stream.as_str(), consumer.as_str()),
            "the ScaledObject trigger's (stream, consumer) in {} are not the bus's",
            file.display()
        );
    }
}
