//! The client commands against a cluster of real processes: a `nats-server`, a
//! `forkfleet coordinator` and a `forkfleet worker`, driven by `forkfleet fork ...`,
//! `forkfleet workers` and `forkfleet log` with `--nats`. Every wait is bounded; every
//! child process is killed on drop.

use super::fleet::{binary, wait_bounded, Fleet, Options, Service, COMMAND_LIMIT, POLL};
use super::harness::{branch, path_str, slow_spec, Example};
use serde_json::Value;
use std::process::Stdio;
use std::time::{Duration, Instant};

/// One worker of 8 slots in pool `default`, draining for 5 s at most.
fn start() -> Fleet {
    Fleet::start(
        1,
        8,
        Options {
            pool: Some("default"),
            drain_grace_s: Some("5"),
            ..Options::default()
        },
    )
}

#[test]
fn create_watch_diff_merge_and_workers_on_a_cluster() {
    let mut cluster = start();
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
        // Applied, with the local edit kept as a conflict: exit 3.
        .json_exit(3);
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
        unknown
            .stderr
            .contains("no fork has the id, id prefix or name"),
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
    // What its commands run in, as its probe at start found: on this kernel, with
    // nothing overridden, the strongest set-up.
    let kernel = forkfleet_worker::runner::sandbox::kernel_support().abi;
    assert_eq!(w["commands"]["kernel_landlock_abi"], kernel, "{w}");
    assert_eq!(w["commands"]["landlock_abi"], kernel, "{w}");
    let text = cluster.client(&["workers"]);
    assert!(text.stdout.contains("LAST_HEARTBEAT"), "{}", text.stdout);
    let cell = if kernel > 0 {
        format!("+landlock{kernel}")
    } else {
        "+limits".to_string()
    };
    assert!(text.stdout.contains(&cell), "{}", text.stdout);

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
    assert!(
        cluster.workers[0].terminate().success(),
        "{}",
        cluster.logs()
    );
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

#[test]
fn terminate_and_abort_on_a_cluster() {
    let cluster = start();
    let ex = Example::quickstart();
    let spec = slow_spec(&ex);
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
        std::thread::sleep(POLL);
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
        std::thread::sleep(POLL);
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
    // Terminating and aborting are quiet: the stopped attempts' events in flight are
    // expected, not a warning each (a takeover's still is).
    assert!(
        !cluster
            .coordinator
            .log()
            .contains("an earlier task attempt's event after a takeover"),
        "{}",
        cluster.coordinator.log()
    );
}

#[test]
fn watch_rides_out_a_coordinator_restart() {
    let mut cluster = start();
    let ex = Example::quickstart();
    std::fs::write(
        ex.dir.path().join("medium.toml"),
        super::harness::writes_then_done(100, true, "medium/{label}-{repeat}.md", "x\\n", 30),
    )
    .unwrap();
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
        std::thread::sleep(POLL);
    }
    cluster.coordinator.kill();
    cluster.coordinator = cluster.spawn_coordinator("coordinator-2");

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

/// A child run whose task would be larger than NATS carries in one message (1 MiB by
/// default: a 1.5 MB system prompt) is refused when asked for, naming the limit, instead of
/// left pending until its deliveries run out ("workers lost or crashing"). Asked over the
/// HTTP API: a command line cannot carry an argument that long. Every transport bounds a
/// `set` value (256 KiB) before the coordinator builds the child; a smaller bus limit
/// (`max_payload`) is checked when the child's task is made.
#[test]
fn a_child_run_larger_than_the_bus_carries_is_refused_when_asked_for() {
    let addr = format!("127.0.0.1:{}", forkfleet_bus::testkit::free_port());
    let fleet = Fleet::start(
        1,
        4,
        Options {
            coordinator_args: &["--http-addr", &addr],
            ..Options::default()
        },
    );
    let ex = Example::quickstart();
    let id = fleet.create(&ex.spec());
    let view = fleet
        .client(&["fork", "watch", &id, "--json", "--timeout-s", "60"])
        .json();
    let run = view["branches"][0]["id"].as_str().unwrap().to_string();
    let runs_before = fleet.client(&["runs", "ls", "--json"]).json();
    let body = serde_json::json!({"options": {"set": [format!("system_prompt={}", "x".repeat(1_500_000))], "replay": false, "record": false, "dry_run": false}});
    let http = reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap();
    let resp = http
        .post(format!("http://{addr}/api/v1/runs/{run}/fork"))
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .unwrap();
    let status = resp.status().as_u16();
    let text = resp.text().unwrap();
    assert_eq!(status, 400, "{text}\n{}", fleet.logs());
    assert!(
        text.contains("`set` is 1500014 bytes long, more than the 262144 it can be"),
        "{text}"
    );
    // Nothing was made.
    let runs_after = fleet.client(&["runs", "ls", "--json"]).json();
    assert_eq!(runs_after, runs_before);
}
