//! One coordinator at a time, with real processes on a real nats-server: a second
//! coordinator on the same data dir waits as a standby (and says so) while the first
//! serves, and takes over when the first is killed; one with another data dir refuses to
//! serve. And client commands that start while NATS or the coordinator is briefly down
//! retry within their bound, or fail with a clear error after it. Every wait is bounded.

use super::fleet::{binary, wait_bounded, Fleet, Options, Service, COMMAND_LIMIT, POLL};
use super::harness::{path_str, Example};
use forkfleet_bus::apicall::{self, CallError};
use forkfleet_bus::nats::{NatsBus, NatsConfig};
use forkfleet_bus::testkit::{free_port, NatsServer};
use forkfleet_bus::Bus;
use forkfleet_shared::api::{ApiErrorKind, FindFork, API_SUBJECT};
use forkfleet_shared::protocol::RESOLVE_SUBJECT;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;
use std::time::Instant;

/// A short lease, so the takeover happens within the test.
const LEASE_TTL_S: &str = "2";

/// A spec of two branches playing twenty writes at 150 ms a call, in a fresh copy of the quickstart.
fn spec(ex: &Example) -> std::path::PathBuf {
    std::fs::write(
        ex.dir.path().join("standby.toml"),
        super::harness::writes_then_done(
            150,
            true,
            "out/{label}/{repeat}.txt",
            "{label} {repeat}\\n",
            20,
        ),
    )
    .unwrap();
    ex.write_spec(
        "goal = \"standby\"\nworkspace = \"workspace\"\nmodel = \"scripted:standby\"\n\
         [models.\"scripted:standby\"]\nscript = \"standby.toml\"\n\
         [[branches]]\nlabel = \"a\"\n[[branches]]\nlabel = \"b\"\n",
    )
}

/// Until `log()` contains `needle` (bounded), else fail showing `what` and the log.
fn wait_for_log(what: &str, needle: &str, log: impl Fn() -> String) {
    let deadline = Instant::now() + COMMAND_LIMIT;
    loop {
        let text = log();
        if text.contains(needle) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: no `{needle}` in the log:\n{text}"
        );
        std::thread::sleep(POLL);
    }
}

fn store_id(data: &Path) -> String {
    std::fs::read_to_string(data.join("store-id"))
        .unwrap()
        .trim()
        .to_string()
}

/// A 6 MB `find_fork` prefix is refused without being echoed; a malformed resolve job is
/// logged at WARN by the worker.
fn oversized_and_malformed_requests(fleet: &Fleet) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let wait = Duration::from_secs(20);
    rt.block_on(async {
        let bus = tokio::time::timeout(wait, NatsBus::connect(NatsConfig::new(fleet.nats.url())))
            .await
            .unwrap()
            .unwrap();
        let huge = FindFork {
            prefix: "f".repeat(6 * 1024 * 1024),
        };
        let err = apicall::call(&bus, API_SUBJECT, huge.into(), wait)
            .await
            .unwrap_err();
        let CallError::Api(e) = err else {
            panic!("{err}")
        };
        assert_eq!(e.kind, ApiErrorKind::BadInput, "{}", e.message);
        assert!(e.message.len() < 300, "{} bytes", e.message.len());
        assert!(e.message.contains("prefix"), "{}", e.message);
        assert!(!e.message.contains("ffff"), "{}", e.message);
        let garbage = bytes::Bytes::from_static(b"\xc1 not a resolve job");
        bus.request(RESOLVE_SUBJECT, garbage, wait).await.unwrap();
    });
    wait_for_log("the worker", "malformed job rejected", || {
        fleet.workers[0].log()
    });
    assert!(
        fleet.workers[0].log().contains("WARN"),
        "{}",
        fleet.workers[0].log()
    );
}

#[test]
fn a_standby_waits_then_takes_over_and_another_store_is_refused() {
    let mut fleet = Fleet::start(
        1,
        4,
        Options {
            ack_wait_s: Some("2"),
            coordinator_args: &["--lease-ttl-s", LEASE_TTL_S],
            ..Options::default()
        },
    );
    let data = fleet.dir.path().join("coordinator-data");
    let ex = Example::quickstart();
    let id = fleet.create(&spec(&ex));
    oversized_and_malformed_requests(&fleet);

    // Another data dir: refused at once, naming both stores, exit code 2.
    let other_data = fleet.dir.path().join("other-data");
    let mut other = fleet.spawn_coordinator_on("other", &other_data);
    let status = wait_bounded(other.child.as_mut().unwrap(), COMMAND_LIMIT).unwrap_or_else(|| {
        panic!(
            "the other store's coordinator did not exit:\n{}",
            other.log()
        )
    });
    other.child = None;
    let log = other.log();
    assert_eq!(status.code(), Some(2), "{log}");
    assert!(log.contains(&store_id(&data)), "{log}");
    assert!(log.contains(&store_id(&other_data)), "{log}");
    assert!(log.contains("serves the run store"), "{log}");

    // The same data dir: a standby, saying so, while the first serves.
    let standby = fleet.spawn_coordinator("standby");
    wait_for_log("the standby", "standby: coordinator", || standby.log());
    assert!(
        !standby.log().contains("coordinator.ready"),
        "{}",
        standby.log()
    );
    let shown = fleet.client(&["fork", "show", &id, "--json"]);
    assert_eq!(shown.code, Some(0), "{}", shown.stderr);

    // The first dies: the standby takes over and serves the fork to its end.
    fleet.coordinator.kill();
    wait_for_log("the standby", "coordinator.ready", || standby.log());
    let ls = fleet.client(&["fork", "ls", "--json"]).json();
    let ids: Vec<&str> = ls
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["fork_id"].as_str().unwrap())
        .collect();
    assert!(ids.contains(&id.as_str()), "{ls}\n{}", standby.log());
    let view = fleet.watch(&id);
    for b in view["branches"].as_array().unwrap() {
        assert_eq!(b["state"], "done", "{b}\n{}", standby.log());
    }

    // A worker stopped cleanly is listed no more, at once.
    let listed = fleet.client(&["workers", "--json"]).json();
    assert_eq!(listed.as_array().unwrap().len(), 1, "{listed}");
    let status = fleet.workers[0].terminate();
    assert!(status.success(), "{}", fleet.workers[0].log());
    let listed = fleet.client(&["workers", "--json"]).json();
    assert_eq!(listed, serde_json::json!([]), "{}", fleet.workers[0].log());
}

/// A client command started before NATS and the coordinator: it retries connecting, then
/// asking, and succeeds once both are up.
#[test]
fn a_client_command_waits_for_nats_and_the_coordinator_within_its_bound() {
    let mut nats = NatsServer::start();
    nats.stop();
    let dir = tempfile::tempdir().unwrap();
    let url = nats.url();
    let (out, err) = (dir.path().join("ls.out"), dir.path().join("ls.err"));
    let mut client = binary()
        .env("RUST_LOG", "warn,forkfleet_bus=debug")
        .args(["fork", "ls", "--json", "--nats", &url])
        .args(["--nats-connect-timeout-s", "50"])
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .unwrap();
    let client_log = || std::fs::read_to_string(&err).unwrap_or_default();
    wait_for_log("the client", "bus.nats connect retry", client_log);
    nats.resume();
    // Connected, it waits for the streams and buckets the coordinator makes (a client
    // does not make them: they would have its replicas, not the cluster's).
    wait_for_log("the client", "is the coordinator running?", client_log);
    // And has made none of them.
    let made = tokio::runtime::Runtime::new().unwrap().block_on(async {
        let raw = async_nats::connect(url.as_str()).await.unwrap();
        let js = async_nats::jetstream::new(raw);
        js.get_stream(forkfleet_shared::subjects::TASK_STREAM)
            .await
            .is_ok()
    });
    assert!(!made, "a client command made the task stream");
    let data = dir.path().join("data");
    let _coordinator = Service::spawn(
        "coordinator",
        &["coordinator", "--nats", &url, "--data", path_str(&data)],
        dir.path(),
    );
    let status = wait_bounded(&mut client, COMMAND_LIMIT).expect("the client did not finish");
    assert_eq!(status.code(), Some(0), "{}", client_log());
    let listed: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    assert_eq!(listed, serde_json::json!([]));
}

/// Nothing listening: a clear error after the bound, naming the URL without its password.
#[test]
fn nothing_listening_is_a_clear_error_after_the_bound() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let url = format!("nats://user:s3cret-pw@127.0.0.1:{port}");
    let ran = binary()
        .current_dir(dir.path())
        .env("FORKFLEET_NATS_URL", &url)
        .args(["fork", "ls", "--nats-connect-timeout-s", "2"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&ran.stderr);
    assert_eq!(ran.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "cannot reach NATS at nats://<redacted>@127.0.0.1:{port}"
        )),
        "{stderr}"
    );
    assert!(stderr.contains("tried for 2 s"), "{stderr}");
    assert!(!stderr.contains("s3cret-pw"), "{stderr}");
}
