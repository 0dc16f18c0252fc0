//! The services' HTTP endpoint (`--http-addr`) over real processes: `/metrics` of a
//! coordinator and a worker after a fork, `/readyz` and `/healthz` across a NATS outage,
//! and the endpoint's configuration and binding errors.

use super::fleet::{Fleet, Options, Service, COMMAND_LIMIT, POLL};
use super::harness::{forkfleet, forkfleet_env, path_str, stderr, Example};
use forkfleet_bus::testkit::free_port;
use serde_json::Value;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// A response: status, headers (lower-case names) and body.
pub(super) struct Response {
    pub(super) status: u16,
    pub(super) head: String,
    pub(super) body: String,
}

/// `GET path` from `addr` over HTTP/1.1 (bounded); `None` when nothing answers.
pub(super) fn get(addr: &str, path: &str) -> Option<Response> {
    get_with(addr, path, "")
}

/// [`get`] with more header lines (each ending `\r\n`).
pub(super) fn get_with(addr: &str, path: &str, headers: &str) -> Option<Response> {
    let mut s = TcpStream::connect_timeout(&addr.parse().unwrap(), Duration::from_secs(5)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n{headers}\r\n"
    )
    .ok()?;
    let mut raw = String::new();
    s.read_to_string(&mut raw).ok()?;
    let (head, body) = raw.split_once("\r\n\r\n")?;
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    Some(Response {
        status,
        head: head.to_ascii_lowercase(),
        body: body.to_string(),
    })
}

/// The value of the sample `name{labels}` (every label given must match) in `text`.
fn sample(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    text.lines().find_map(|line| {
        let (series, value) = line.rsplit_once(' ')?;
        let (n, rest) = match series.split_once('{') {
            Some((n, rest)) => (n, rest),
            None => (series, ""),
        };
        if n != name
            || !labels
                .iter()
                .all(|(k, v)| rest.contains(&format!("{k}=\"{v}\"")))
        {
            return None;
        }
        value.parse().ok()
    })
}

/// The sum of every sample of `name` in `text` (0 when there is none).
pub(super) fn sample_sum(text: &str, name: &str) -> f64 {
    text.lines()
        .filter_map(|line| {
            let (series, value) = line.rsplit_once(' ')?;
            let n = series.split_once('{').map_or(series, |(n, _)| n);
            (n == name).then(|| value.parse::<f64>().ok()).flatten()
        })
        .sum()
}

/// Poll `GET path` until `done` accepts the response (bounded); the last response.
fn until(addr: &str, path: &str, what: &str, done: impl Fn(&Response) -> bool) -> Response {
    let deadline = Instant::now() + COMMAND_LIMIT;
    loop {
        let last = get(addr, path);
        match last {
            Some(r) if done(&r) => return r,
            _ => {}
        }
        assert!(
            Instant::now() < deadline,
            "{what}: GET {path} on {addr} last answered {:?}",
            last.map(|r| (r.status, r.body))
        );
        std::thread::sleep(POLL);
    }
}

#[test]
fn metrics_of_a_finished_fork_and_readiness_across_a_nats_outage() {
    let coordinator = format!("127.0.0.1:{}", free_port());
    let worker = format!("127.0.0.1:{}", free_port());
    let mut fleet = Fleet::start(
        1,
        4,
        Options {
            coordinator_args: &["--http-addr", &coordinator],
            env: &[("FORKFLEET_HTTP_ADDR", &worker)],
            ..Options::default()
        },
    );
    assert!(
        fleet
            .coordinator
            .log()
            .contains(&format!("http endpoint listening on {coordinator}")),
        "{}",
        fleet.logs()
    );
    // Before any fork: every counter a dashboard or an alert rates is served at zero, with
    // the build and the process's figures.
    let fresh = until(&coordinator, "/metrics", "the endpoint", |r| {
        r.status == 200
    });
    for (name, labels) in [
        ("forkfleet_events_applied_total", &[][..]),
        ("forkfleet_bus_reconnects_total", &[]),
        ("forkfleet_branches_ended_total", &[("state", "failed")]),
        ("forkfleet_branches_ended_total", &[("state", "done")]),
        ("forkfleet_budget_refusals_total", &[("scope", "account")]),
    ] {
        assert_eq!(
            sample(&fresh.body, name, labels),
            Some(0.0),
            "{name} {labels:?}\n{}",
            fresh.body
        );
    }
    assert_eq!(
        sample(
            &fresh.body,
            "forkfleet_build_info",
            &[("service", "forkfleet-coordinator")]
        ),
        Some(1.0),
        "{}",
        fresh.body
    );
    assert!(sample(&fresh.body, "process_resident_memory_bytes", &[]).unwrap() > 1e6);
    assert!(sample(&fresh.body, "process_cpu_seconds_total", &[]).unwrap() > 0.0);

    let ex = Example::quickstart();
    let id = fleet.create(&ex.spec());
    let view = fleet.watch(&id);
    let branches = view["branches"].as_array().unwrap();
    assert!(branches.iter().all(|b| b["state"] == "done"), "{view}");
    let cost: Value = fleet.client(&["fork", "cost", &id, "--json"]).json();
    let spent = cost["spent_usd"].as_f64().unwrap();
    let id = cost["fork_id"].as_str().unwrap().to_string();
    assert!(spent > 0.0, "{cost}");

    // The coordinator: branches by state, the fork's spend, events applied, queue depth.
    let metrics = until(&coordinator, "/metrics", "three done branches", |r| {
        sample(&r.body, "forkfleet_branches", &[("state", "done")]) == Some(3.0)
    });
    assert_eq!(metrics.status, 200);
    assert!(
        metrics
            .head
            .contains("content-type: text/plain; version=0.0.4"),
        "{}",
        metrics.head
    );
    let text = &metrics.body;
    assert_eq!(
        sample(text, "forkfleet_branches", &[("state", "running")]),
        Some(0.0),
        "{text}"
    );
    assert_eq!(
        sample(text, "forkfleet_branches_ended_total", &[("state", "done")]),
        Some(3.0),
        "{text}"
    );
    let shown = sample(text, "forkfleet_fork_spent_usd", &[("fork_id", &id)])
        .unwrap_or_else(|| panic!("no spend of fork {id}:\n{text}"));
    assert!((shown - spent).abs() < 1e-9, "{shown} != {spent}\n{text}");
    assert_eq!(
        sample(text, "forkfleet_fork_reserved_usd", &[("fork_id", &id)]),
        Some(0.0),
        "{text}"
    );
    // The monotonic spend by account and model: the fork's, which has no account.
    assert_eq!(
        sample(
            text,
            "forkfleet_cost_usd_total",
            &[("account", ""), ("model", "scripted:quickstart")]
        )
        .map(|v| (v - spent).abs() < 1e-9),
        Some(true),
        "{spent}\n{text}"
    );
    // Uncapped: no cap series.
    assert_eq!(
        sample(text, "forkfleet_fork_cap_usd", &[("fork_id", &id)]),
        None
    );
    assert!(sample(text, "forkfleet_events_applied_total", &[]).unwrap() > 0.0);
    assert!(sample(text, "forkfleet_events_apply_duration_seconds_count", &[]).unwrap() > 0.0);
    assert!(
        sample(text, "forkfleet_queue_depth", &[("pool", "default")]).is_some(),
        "{text}"
    );

    // The worker: its slots, nothing running, and every model call with its tokens.
    let calls: u64 = cost["branches"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["calls"].as_u64().unwrap())
        .sum();
    let input: u64 = branches
        .iter()
        .map(|b| b["usage"]["input_tokens"].as_u64().unwrap())
        .sum();
    let output: u64 = branches
        .iter()
        .map(|b| b["usage"]["output_tokens"].as_u64().unwrap())
        .sum();
    assert!(calls > 0 && input > 0 && output > 0, "{cost}\n{view}");
    let w = get(&worker, "/metrics").unwrap();
    assert_eq!(w.status, 200);
    let text = &w.body;
    let model = [
        ("gen_ai_provider_name", "forkfleet.scripted"),
        ("gen_ai_request_model", "quickstart"),
    ];
    assert_eq!(
        sample(text, "forkfleet_worker_slots", &[]),
        Some(4.0),
        "{text}"
    );
    assert_eq!(
        sample(text, "forkfleet_worker_branches_running", &[]),
        Some(0.0),
        "{text}"
    );
    assert_eq!(
        sample(
            text,
            "forkfleet_model_calls_total",
            &[model[0], model[1], ("outcome", "ok")]
        ),
        Some(calls as f64),
        "{text}"
    );
    for (kind, tokens) in [("input", input), ("output", output)] {
        let labels = [
            model[0],
            model[1],
            ("gen_ai_operation_name", "chat"),
            ("gen_ai_token_type", kind),
        ];
        assert_eq!(
            sample(text, "gen_ai_client_token_usage_sum", &labels),
            Some(tokens as f64),
            "{text}"
        );
        assert_eq!(
            sample(text, "gen_ai_client_token_usage_count", &labels),
            Some(calls as f64),
            "{text}"
        );
    }
    assert_eq!(
        sample(
            text,
            "gen_ai_client_operation_duration_seconds_count",
            &[model[0], model[1], ("gen_ai_operation_name", "chat")]
        ),
        Some(calls as f64),
        "{text}"
    );

    // A second coordinator of the same store stands by: alive, not ready.
    let standby_addr = format!("127.0.0.1:{}", free_port());
    let data = fleet.dir.path().join("coordinator-data");
    let url = fleet.nats.url();
    let standby = Service::spawn(
        "standby",
        &[
            "coordinator",
            "--nats",
            &url,
            "--data",
            path_str(&data),
            "--http-addr",
            &standby_addr,
        ],
        fleet.dir.path(),
    );
    let r = until(&standby_addr, "/readyz", "a standby is not ready", |r| {
        r.status == 503 && r.body.contains("standby")
    });
    assert_eq!(
        r.body,
        "not ready: standby: waiting for the coordinator lease\n"
    );
    assert_eq!(get(&standby_addr, "/healthz").unwrap().status, 200);
    drop(standby);

    // Ready and alive; not ready while NATS is down (alive all the same); ready again
    // once it is back on the same port and store.
    for addr in [&coordinator, &worker] {
        let r = get(addr, "/readyz").unwrap();
        assert_eq!((r.status, r.body.as_str()), (200, "ready\n"), "{addr}");
        let r = get(addr, "/healthz").unwrap();
        assert_eq!((r.status, r.body.as_str()), (200, "ok\n"), "{addr}");
    }
    fleet.nats.stop();
    for addr in [&coordinator, &worker] {
        let r = until(addr, "/readyz", "not ready without NATS", |r| {
            r.status == 503
        });
        assert!(r.body.contains("not connected to NATS"), "{}", r.body);
        assert_eq!(get(addr, "/healthz").unwrap().status, 200);
    }
    fleet.nats.resume();
    for addr in [&coordinator, &worker] {
        until(addr, "/readyz", "ready once NATS is back", |r| {
            r.status == 200
        });
        assert_eq!(get(addr, "/healthz").unwrap().status, 200);
    }
    let text = get(&coordinator, "/metrics").unwrap().body;
    assert!(
        sample(&text, "forkfleet_bus_reconnects_total", &[]).unwrap_or(0.0) >= 1.0,
        "{text}"
    );
}

#[test]
fn http_addr_is_layered_shown_and_checked() {
    // A flag wins over the environment; --print-config names where it came from.
    let out = forkfleet_env(
        &["worker", "--http-addr", "127.0.0.1:9464", "--print-config"],
        &[("FORKFLEET_HTTP_ADDR", "0.0.0.0:1")],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("http_addr = \"127.0.0.1:9464\"  # flag --http-addr"),
        "{text}"
    );
    let out = forkfleet_env(
        &["coordinator", "--print-config"],
        &[("FORKFLEET_HTTP_ADDR", "localhost:9465")],
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("http_addr = \"127.0.0.1:9465\"  # environment variable FORKFLEET_HTTP_ADDR"),
        "{text}"
    );
    // Off by default.
    let out = forkfleet(&["coordinator", "--print-config"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("# http_addr: not set"), "{text}");

    // Not an address: the key, the value and what is valid.
    let out = forkfleet(&[
        "worker",
        "--http-addr",
        "metrics.example:80",
        "--print-config",
    ]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("http_addr")
            && err.contains("metrics.example:80")
            && err.contains("HOST:PORT"),
        "{err}"
    );

    // An address in use: a clear error, before anything else starts.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let out = forkfleet(&[
        "coordinator",
        "--nats",
        "nats://127.0.0.1:1",
        "--data",
        path_str(&data),
        "--http-addr",
        &addr,
    ]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains(&format!(
            "cannot listen on {addr} (http_addr): address in use"
        )),
        "{err}"
    );
}
