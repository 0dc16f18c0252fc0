//! The Helm chart's own pods, run as processes on this machine (no cluster here):
//! `scripts/chart-pods` renders `deploy/helm/forkfleet` with its default values (roles and
//! TLS on) and lays out what each pod would see: its ConfigMaps and Secrets as files at
//! their mount paths, its arguments and environment. Then, as Kubernetes would start them:
//! the NATS pod's init container writes `auth.conf` from the roles' password hashes, the
//! NATS container runs with the rendered `nats.conf` (its TLS and users), the coordinator
//! and the worker with their pods' environment (each its own role's credentials and client
//! certificate), and `helm test`'s pod runs its one-branch fork as the admin. The only
//! changes to what the chart rendered are the ports and the server's address (`localhost`,
//! which the chart's certificate holds by default, for `kubectl port-forward`).

use super::fleet::{binary, wait_bounded, Service, COMMAND_LIMIT, SERVICE_LIMIT};
use super::metrics::{get, get_with};
use forkfleet_bus::testkit::{find_nats_server, free_port};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// One container as `scripts/chart-pods` laid it out.
struct Container {
    program: Vec<String>,
    env: BTreeMap<String, String>,
}

/// The pods of one rendering, laid out in `dir`.
struct Pods {
    dir: tempfile::TempDir,
    spec: Value,
}

impl Pods {
    /// `scripts/chart-pods` with `values` and its other arguments (`--replace=...`,
    /// `--secret=...`).
    fn lay_out(values: &str, args: &[String]) -> Pods {
        let dir = tempfile::tempdir().unwrap();
        let python = std::env::var("FORKFLEET_PYTHON").unwrap_or_else(|_| "python3".into());
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let mut cmd = Command::new(python);
        cmd.arg(root.join("scripts/chart-pods"))
            .args(["--out", super::harness::path_str(dir.path())])
            .args(["--values", values]);
        for a in args {
            let (flag, value) = a.split_once('=').unwrap();
            cmd.args([flag, value]);
        }
        let out = cmd.output().unwrap();
        assert!(
            out.status.success(),
            "scripts/chart-pods: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let spec =
            serde_json::from_slice(&std::fs::read(dir.path().join("pods.json")).unwrap()).unwrap();
        Pods { dir, spec }
    }

    fn container(&self, workload: &str, init: bool) -> Container {
        let key = if init { "initContainers" } else { "containers" };
        let c = &self.spec[workload][key][0];
        assert!(c.is_object(), "no {key} in {workload}: {}", self.spec);
        let strings = |v: &Value| -> Vec<String> {
            v.as_array()
                .unwrap()
                .iter()
                .map(|s| s.as_str().unwrap().to_string())
                .collect()
        };
        let mut program = strings(&c["command"]);
        program.extend(strings(&c["args"]));
        let env = c["env"]
            .as_object()
            .unwrap()
            .iter()
            .map(|(k, v)| (k.clone(), v.as_str().unwrap().to_string()))
            .collect();
        Container { program, env }
    }

    /// A file of a pod's volume, as the pod sees it.
    fn volume_file(&self, workload: &str, volume: &str, file: &str) -> String {
        let path = self
            .dir
            .path()
            .join(workload)
            .join("volumes")
            .join(volume)
            .join(file);
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    }

    /// A rendered Secret's key (one no pod mounts: a client identity's).
    fn secret(&self, name: &str, key: &str) -> PathBuf {
        self.dir.path().join("secrets").join(name).join(key)
    }
}

/// `nats-server` with `args` and `env` (a pod's or a compose service's), its output in
/// `dir`, once its monitoring port (`monitor`) answers the startup probe, as a pod's does.
pub(super) fn start_nats(
    nats_server: &Path,
    args: &[String],
    env: &BTreeMap<String, String>,
    monitor: u16,
    dir: &Path,
) -> Killed {
    let (log, err) = (dir.join("nats.log"), dir.join("nats.err"));
    let server = Killed(
        Command::new(nats_server)
            .args(args)
            .envs(env)
            .stdout(std::fs::File::create(&log).unwrap())
            .stderr(std::fs::File::create(&err).unwrap())
            .spawn()
            .unwrap(),
    );
    let deadline = Instant::now() + SERVICE_LIMIT;
    let probe = format!("127.0.0.1:{monitor}");
    while get(&probe, "/healthz?js-enabled-only=true").map(|r| r.status) != Some(200) {
        assert!(
            Instant::now() < deadline,
            "NATS did not start: {}{}",
            std::fs::read_to_string(&log).unwrap_or_default(),
            std::fs::read_to_string(&err).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    server
}

/// A child killed on drop.
pub(super) struct Killed(pub(super) Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A client command with a pod's (or a Secret's) environment, bounded.
fn client(env: &BTreeMap<String, String>, extra: &[(&str, &str)], args: &[&str]) -> Output {
    let mut child = binary()
        .envs(env)
        .envs(extra.iter().copied())
        .env("RUST_LOG", "warn")
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let status = wait_bounded(&mut child, COMMAND_LIMIT);
    if status.is_none() {
        let _ = child.kill();
    }
    child.wait_with_output().unwrap()
}

#[test]
fn the_charts_default_values_run_a_cluster_with_roles_and_tls() {
    let Some(nats_server) = find_nats_server() else {
        panic!("no nats-server: set FORKFLEET_NATS_SERVER (scripts/setup installs it)");
    };
    let (port, monitor) = (free_port(), free_port());
    // The API's tokens, as an operator makes them, for the Secret the chart mounts.
    let scratch = tempfile::tempdir().unwrap();
    let made = binary()
        .args(["cluster", "token", "dashboards", "--scope", "read"])
        .output()
        .unwrap();
    assert!(made.status.success(), "{made:?}");
    let tokens = scratch.path().join("tokens.toml");
    std::fs::write(&tokens, &made.stdout).unwrap();
    let token = String::from_utf8_lossy(&made.stderr)
        .lines()
        .find_map(|l| l.split("keep it secret): ").nth(1).map(str::to_string))
        .unwrap();
    let pods = Pods::lay_out(
        r#"{"auth": {"clients": ["alice"]}, "api": {"tokensSecret": "forkfleet-api-tokens"}}"#,
        &[
            format!("--replace=port: 4222=port: {port}"),
            format!("--replace=http_port: 8222=http_port: {monitor}"),
            format!("--replace=forkfleet-nats:4222=localhost:{port}"),
            format!(
                "--secret=forkfleet-api-tokens/tokens.toml={}",
                tokens.display()
            ),
        ],
    );
    let dir = pods.dir.path();

    // Each pod mounts its own role's credentials, and they differ.
    let mut passwords = Vec::new();
    for (workload, role) in [
        ("forkfleet-coordinator", "coordinator"),
        ("forkfleet-worker", "worker"),
        ("forkfleet-smoke", "admin"),
    ] {
        assert_eq!(pods.volume_file(workload, "nats-role", "user"), role);
        let password = pods.volume_file(workload, "nats-role", "password");
        assert!(password.len() >= 32, "{workload}");
        assert!(
            pods.volume_file(workload, "nats-role", "tls.key")
                .contains("PRIVATE KEY"),
            "{workload}"
        );
        passwords.push(password);
    }
    let distinct: std::collections::BTreeSet<&String> = passwords.iter().collect();
    assert_eq!(distinct.len(), 3, "one password per role");
    // The server holds bcrypt hashes only.
    let users = pods.volume_file("forkfleet-nats", "users", "worker");
    assert!(users.starts_with("$2a$"), "{users}");
    assert!(!passwords.contains(&users));

    // The NATS pod: its init container writes auth.conf, then the server starts.
    let init = pods.container("forkfleet-nats", true);
    let out = client(
        &init.env,
        &[],
        &init.program.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    assert!(out.status.success(), "{out:?}");
    let auth = pods.volume_file("forkfleet-nats", "auth", "auth.conf");
    assert!(auth.contains("user: \"client-alice\""), "{auth}");
    let nats = pods.container("forkfleet-nats", false);
    assert_eq!(nats.program[0], "nats-server");
    let _server = start_nats(&nats_server, &nats.program[1..], &nats.env, monitor, dir);

    let service = |workload: &str, name: &str, http_port: u16| {
        let c = pods.container(workload, false);
        let http = format!("127.0.0.1:{http_port}");
        let mut env: Vec<(&str, &str)> = c
            .env
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        env.push(("FORKFLEET_HTTP_ADDR", &http));
        env.push(("FORKFLEET_LOG_FORMAT", "text"));
        let args: Vec<&str> = c.program.iter().map(String::as_str).collect();
        Service::spawn_env(name, &args, dir, &env)
    };
    let api = free_port();
    let coordinator = service("forkfleet-coordinator", "coordinator", api);
    let worker = service("forkfleet-worker", "worker", free_port());

    // `helm test`'s pod, as the admin.
    let smoke = pods.container("forkfleet-smoke", false);
    assert_eq!(smoke.program[0], "sh");
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_forkfleet"));
    let path = format!(
        "{}:{}",
        bin.parent().unwrap().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    std::fs::create_dir_all(dir.join("forkfleet-smoke/volumes/tmp")).unwrap();
    let out = Command::new("sh")
        .env_clear()
        .args(&smoke.program[1..])
        .envs(&smoke.env)
        .env("PATH", path)
        .env("SMOKE_TIMEOUT_S", "120")
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && said.contains("smoke.txt written by a worker"),
        "{said}\ncoordinator:\n{}\nworker:\n{}",
        coordinator.log(),
        worker.log()
    );
    // The chart's stream and bucket limits fit the store it gives NATS.
    assert!(
        !coordinator.log().contains("has no room"),
        "{}",
        coordinator.log()
    );

    // The HTTP API takes the tokens of the Secret (api.tokensSecret), and only them.
    let api = format!("127.0.0.1:{api}");
    let answer = get_with(
        &api,
        "/api/v1/forks",
        &format!("Authorization: Bearer {token}\r\n"),
    )
    .unwrap();
    assert_eq!(answer.status, 200, "{}", answer.body);
    let answer = answer.body;
    let fork = said
        .lines()
        .find_map(|l| l.strip_prefix("smoke: fork ")?.strip_suffix(" created"))
        .unwrap();
    assert!(answer.contains(fork), "the smoke fork {fork}: {answer}");
    let none = get(&api, "/api/v1/forks").unwrap();
    assert_eq!(none.status, 401, "{}", none.body);
    let wrong = get_with(
        &api,
        "/api/v1/forks",
        "Authorization: Bearer ff_not_a_token\r\n",
    )
    .unwrap();
    assert_eq!(wrong.status, 401, "{}", wrong.body);

    // alice, with the Secret the chart made for her: her own forks only (the admin's smoke
    // fork is not hers).
    let alice_secret = |key: &str| {
        pods.secret("forkfleet-nats-client-alice", key)
            .display()
            .to_string()
    };
    let mut alice: BTreeMap<String, String> = smoke
        .env
        .iter()
        .filter(|(k, _)| k.starts_with("FORKFLEET_NATS_TLS_REQUIRE") || *k == "FORKFLEET_CONFIG")
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    for (k, v) in [
        ("FORKFLEET_NATS_USER", "client-alice".to_string()),
        ("FORKFLEET_NATS_PASSWORD_FILE", alice_secret("password")),
        ("FORKFLEET_NATS_TLS_CA_FILE", alice_secret("ca.crt")),
        ("FORKFLEET_NATS_TLS_CERT_FILE", alice_secret("tls.crt")),
        ("FORKFLEET_NATS_TLS_KEY_FILE", alice_secret("tls.key")),
        ("FORKFLEET_NATS_IDENTITY", "alice".to_string()),
        ("FORKFLEET_NATS_PROVISION", "false".to_string()),
        ("FORKFLEET_NATS_CONNECT_TIMEOUT_S", "5".to_string()),
    ] {
        alice.insert(k.to_string(), v);
    }
    let mine = client(&alice, &[], &["fork", "ls", "--json"]);
    assert!(mine.status.success(), "{mine:?}");
    let listed: Value = serde_json::from_slice(&mine.stdout).unwrap();
    assert_eq!(listed.as_array().map(Vec::len), Some(0), "{listed}");
    let all = client(&smoke.env, &[], &["fork", "ls", "--json"]);
    let listed: Value = serde_json::from_slice(&all.stdout).unwrap();
    assert_eq!(listed.as_array().map(Vec::len), Some(1), "{listed}");

    // Without her client certificate the server refuses her (mutual TLS), and with
    // another role's user name her password is wrong.
    let no_cert = client(
        &alice,
        &[
            ("FORKFLEET_NATS_TLS_CERT_FILE", ""),
            ("FORKFLEET_NATS_TLS_KEY_FILE", ""),
        ],
        &["fork", "ls", "--json"],
    );
    assert!(!no_cert.status.success(), "{no_cert:?}");
    let said = String::from_utf8_lossy(&no_cert.stderr);
    assert!(said.contains("CertificateRequired"), "{said}");
    let wrong_user = client(
        &alice,
        &[("FORKFLEET_NATS_USER", "worker")],
        &["fork", "ls", "--json"],
    );
    assert!(!wrong_user.status.success(), "{wrong_user:?}");
    let said = String::from_utf8_lossy(&wrong_user.stderr);
    assert!(said.to_lowercase().contains("authoriz"), "{said}");
}
