//! `deploy/compose.yaml`'s services, run as processes on this machine (no Docker here):
//! `scripts/compose-services` lays out its volumes and rewrites the paths its services
//! mount. Then, in the order of its `depends_on`: the one-shot `auth` writes the roles'
//! credentials and certificates (and keeps them when run again), NATS starts with their
//! users and mutual TLS, the coordinator and a worker start with their roles' config
//! files, and the admin's fork completes. The only changes to the file are the ports, the
//! server's address (`localhost`, which the certificate `auth` makes holds) and no OTLP
//! export (no collector here).

use super::chart_pods::start_nats;
use super::fleet::{fork_to_done, run, Service};
use super::harness::{path_str, Example};
use forkfleet_bus::testkit::{find_nats_server, free_port};
use serde_json::Value;
use std::process::Command;

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap().to_string())
        .collect()
}

/// `args` with the value after `flag` replaced.
fn with_flag(mut args: Vec<String>, flag: &str, value: &str) -> Vec<String> {
    let at = args.iter().position(|a| a == flag).unwrap() + 1;
    args[at] = value.to_string();
    args
}

#[test]
fn the_compose_file_runs_a_cluster_with_roles_and_tls() {
    let nats_server = find_nats_server().expect("nats-server (scripts/setup installs it)");
    let dir = tempfile::tempdir().unwrap();
    let python = std::env::var("FORKFLEET_PYTHON").unwrap_or_else(|_| "python3".into());
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = Command::new(python)
        .arg(root.join("scripts/compose-services"))
        .args(["--out", path_str(dir.path())])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let spec: Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("services.json")).unwrap()).unwrap();
    let service = |name: &str| &spec[name];
    assert_eq!(
        service("nats")["depends_on"]["auth"],
        "service_completed_successfully"
    );

    // `auth`, at the first start and at a later one.
    let auth_args = strings(&service("auth")["command"]);
    let auth_args: Vec<&str> = auth_args.iter().map(String::as_str).collect();
    let first = run(dir.path(), &auth_args);
    assert_eq!(first.code, Some(0), "{}", first.stderr);
    let auth = dir.path().join("volumes/auth");
    let seed = std::fs::read_to_string(auth.join("worker.nk")).unwrap();
    let again = run(dir.path(), &auth_args);
    assert_eq!(again.code, Some(0), "{}", again.stderr);
    assert!(again.stderr.contains("kept"), "{}", again.stderr);
    assert_eq!(
        std::fs::read_to_string(auth.join("worker.nk")).unwrap(),
        seed
    );

    // NATS, with its health check.
    let (port, monitor) = (free_port(), free_port());
    let mut args = with_flag(
        strings(&service("nats")["command"]),
        "-m",
        &monitor.to_string(),
    );
    args.extend([
        "-p".to_string(),
        port.to_string(),
        "-a".into(),
        "127.0.0.1".into(),
    ]);
    let _nats = start_nats(
        &nats_server,
        &args,
        &Default::default(),
        monitor,
        dir.path(),
    );

    let url = format!("tls://localhost:{port}");
    let start = |name: &str| {
        let s = service(name);
        let args = with_flag(
            strings(&s["command"]),
            "--http-addr",
            &format!("127.0.0.1:{}", free_port()),
        );
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let mut env: Vec<(String, String)> = s["env"]
            .as_object()
            .unwrap()
            .iter()
            .filter(|(k, _)| !k.starts_with("OTEL_"))
            .map(|(k, v)| (k.clone(), v.as_str().unwrap().to_string()))
            .collect();
        env.push(("FORKFLEET_NATS_URL".into(), url.clone()));
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        Service::spawn_env(name, &args, dir.path(), &env)
    };
    let coordinator = start("coordinator");
    let worker = start("worker-1");

    // The admin's fork, with the admin's config file of `auth`.
    let admin = auth.join("admin.toml");
    let client = |args: &[&str]| {
        let mut all = args.to_vec();
        all.extend(["--config", path_str(&admin), "--nats", &url]);
        run(dir.path(), &all)
    };
    let ex = Example::quickstart();
    fork_to_done(client, &ex.spec(), || {
        format!(
            "coordinator:\n{}\nworker:\n{}",
            coordinator.log(),
            worker.log()
        )
    });
    // The worker registered under its role: the one started here is listed.
    let workers = client(&["workers", "--json"]);
    assert_eq!(workers.json().as_array().map(Vec::len), Some(1));
}
