//! Roles on the bus (ADR 17), against a nats-server started with the permissions that
//! `forkfleet cluster auth` generated (the real binary), a real `forkfleet coordinator` and
//! `forkfleet worker` using the generated config files, and client commands as `alice`,
//! `bob` and `admin`:
//!
//! - a worker started before the coordinator waits for its streams and buckets (it may not
//!   create them), then a scripted fork completes under the roles;
//! - a client sees and acts on the forks of its accounts only: another account's fork is
//!   `not_found` to `fork show`, `terminate`, `abort`, `cost` and `merge`, and missing from
//!   `fork ls`; `account show` lists its accounts only; `account set` is refused;
//! - a client cannot publish a task, an event, a control command or a resolve job, nor
//!   subscribe to the API or to another identity's replies: the server refuses (a
//!   permissions violation) and nothing reaches an admin subscriber;
//! - credentials in the URL authenticate, and no password reaches the logs at `-vv` or
//!   `RUST_LOG=trace`.

use super::fleet::{fork_to_done, run, Ran, Service, COMMAND_LIMIT, POLL};
use super::harness::{command, path_str, Example};
use forkfleet_bus::testkit::NatsServer;
use futures::StreamExt as _;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// A nats-server with the generated permissions, a coordinator and a worker, each with its
/// generated config file.
pub(super) struct Roles {
    pub(super) nats: NatsServer,
    pub(super) auth: PathBuf,
    pub(super) coordinator: Service,
    worker: Service,
    pub(super) dir: tempfile::TempDir,
}

/// `forkfleet cluster auth --out DIR/auth --client alice --client bob`, and a nats-server
/// whose config includes its `auth.conf`.
fn generated_server(dir: &Path) -> (NatsServer, PathBuf) {
    let auth = dir.join("auth");
    let out = run(
        dir,
        &[
            "cluster",
            "auth",
            "--out",
            path_str(&auth),
            "--client",
            "alice",
            "--client",
            "bob",
        ],
    );
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert!(out.stdout.contains("auth.conf"), "{}", out.stdout);
    // Generating again refuses to overwrite.
    let again = run(
        dir,
        &[
            "cluster",
            "auth",
            "--out",
            path_str(&auth),
            "--client",
            "alice",
        ],
    );
    assert_eq!(again.code, Some(2), "{}", again.stderr);
    assert!(again.stderr.contains("--force"), "{}", again.stderr);
    let conf = auth.join("nats.conf");
    std::fs::write(&conf, "include ./auth.conf\n").unwrap();
    (NatsServer::start_with_config(&conf), auth)
}

impl Roles {
    fn start() -> Roles {
        Self::start_with("")
    }

    /// [`Roles::start`], `extra` appended to the coordinator's config file.
    pub(super) fn start_with(extra: &str) -> Roles {
        let dir = tempfile::tempdir().unwrap();
        let (nats, auth) = generated_server(dir.path());
        // bob may also use the account `shared`.
        let coordinator_toml = auth.join("coordinator.toml");
        let mut text = std::fs::read_to_string(&coordinator_toml).unwrap();
        text.push_str("\n[access.\"bob\"]\naccounts = [\"shared\"]\n");
        text.push_str(extra);
        std::fs::write(&coordinator_toml, text).unwrap();
        let url = nats.url();
        let data = dir.path().join("data");
        let worker = Service::spawn(
            "worker",
            &[
                "worker",
                "--config",
                path_str(&auth.join("worker.toml")),
                "--nats",
                &url,
                "--concurrency",
                "6",
            ],
            dir.path(),
        );
        // The worker started first binds to nothing yet: it waits, and says why.
        let deadline = Instant::now() + COMMAND_LIMIT;
        while !worker.log().contains("is the coordinator running?") {
            assert!(
                Instant::now() < deadline,
                "the worker did not wait:\n{}",
                worker.log()
            );
            std::thread::sleep(POLL);
        }
        let coordinator = Service::spawn(
            "coordinator",
            &[
                "coordinator",
                "--config",
                path_str(&coordinator_toml),
                "--nats",
                &url,
                "--data",
                path_str(&data),
            ],
            dir.path(),
        );
        let roles = Roles {
            nats,
            auth,
            coordinator,
            worker,
            dir,
        };
        roles.wait_ready();
        roles
    }

    /// Until alice's `fork ls` answers and she lists the worker (bounded).
    fn wait_ready(&self) {
        let deadline = Instant::now() + COMMAND_LIMIT;
        loop {
            let ls = self.client("client-alice", &["fork", "ls", "--json"]);
            let workers = self.client("client-alice", &["workers", "--json"]);
            if ls.code == Some(0)
                && workers.code == Some(0)
                && workers.json().as_array().map(Vec::len) == Some(1)
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the cluster did not come up\nfork ls: {}\nworkers: {}\n{}",
                ls.stderr,
                workers.stderr,
                self.logs()
            );
            std::thread::sleep(POLL);
        }
    }

    /// A client command as `who` (`client-alice`, `admin`, ...): its generated config file.
    pub(super) fn client(&self, who: &str, args: &[&str]) -> Ran {
        let config = self.auth.join(format!("{who}.toml"));
        let url = self.nats.url();
        let mut all = args.to_vec();
        all.extend(["--config", path_str(&config), "--nats", &url]);
        run(self.dir.path(), &all)
    }

    pub(super) fn logs(&self) -> String {
        format!(
            "coordinator:\n{}\nworker:\n{}\nnats-server:\n{}",
            self.coordinator.log(),
            self.worker.log(),
            self.nats.log_tail()
        )
    }

    pub(super) fn create(&self, who: &str, spec: &Path) -> String {
        let created = self.client(who, &["fork", "create", path_str(spec), "--json"]);
        assert_eq!(created.code, Some(0), "{}\n{}", created.stderr, self.logs());
        created.json()["fork_id"].as_str().unwrap().to_string()
    }

    pub(super) fn watch(&self, who: &str, id: &str) -> Value {
        let watched = self.client(who, &["fork", "watch", id, "--json", "--timeout-s", "50"]);
        assert_eq!(watched.code, Some(0), "{}\n{}", watched.stderr, self.logs());
        watched.json()
    }

    /// Fork ids `who` lists.
    fn listed(&self, who: &str) -> Vec<String> {
        let ls = self.client(who, &["fork", "ls", "--json"]);
        ls.json()
            .as_array()
            .unwrap()
            .iter()
            .map(|f| f["fork_id"].as_str().unwrap().to_string())
            .collect()
    }
}

fn sorted(mut v: Vec<String>) -> Vec<String> {
    v.sort();
    v
}

#[test]
fn clients_see_and_act_on_the_forks_of_their_accounts_only() {
    let roles = Roles::start();
    // Services with their roles' credentials are not warned about.
    assert!(
        !roles.logs().contains("UNRESTRICTED CLUSTER"),
        "{}",
        roles.logs()
    );
    let ex = Example::quickstart();
    // A file too large for the small-blob bucket: the object store is used too.
    std::fs::write(
        ex.workspace().join("big.txt"),
        "0123456789abcdef\n".repeat(16 * 1024),
    )
    .unwrap();

    // A scripted fork completes under the roles; a fork without an account charges the
    // client's own.
    let a = roles.create("client-alice", &ex.spec());
    let b = roles.create("client-bob", &ex.spec());
    let watched = roles.watch("client-alice", &a);
    assert_eq!(watched["state"], "settled", "{watched}\n{}", roles.logs());
    for branch in watched["branches"].as_array().unwrap() {
        assert_eq!(branch["state"], "done", "{watched}\n{}", roles.logs());
    }
    let cost = roles
        .client("client-alice", &["fork", "cost", &a, "--json"])
        .json();
    assert_eq!(cost["account"]["name"], "alice", "{cost}");

    // Listings: each client its own, the admin everything.
    assert_eq!(roles.listed("client-alice"), vec![a.clone()]);
    assert_eq!(roles.listed("client-bob"), vec![b.clone()]);
    assert_eq!(
        sorted(roles.listed("admin")),
        sorted(vec![a.clone(), b.clone()])
    );

    // bob's fork does not exist for alice, whatever she tries (by id or by prefix).
    for args in [
        vec!["fork", "show", b.as_str()],
        vec!["fork", "show", &b[..13]],
        vec!["fork", "cost", b.as_str()],
        vec!["fork", "terminate", b.as_str(), "concise"],
        vec!["fork", "abort", b.as_str()],
        vec![
            "fork",
            "merge",
            b.as_str(),
            "--pick",
            "concise",
            "--no-apply",
        ],
    ] {
        let refused = roles.client("client-alice", &args);
        assert_eq!(refused.code, Some(2), "{args:?}: {}", refused.stderr);
        assert!(
            refused
                .stderr
                .contains("no fork has the id, id prefix or name"),
            "{args:?}: {}",
            refused.stderr
        );
    }
    // ... and it went on untouched: every branch done, nothing merged or aborted.
    let theirs = roles.watch("client-bob", &b);
    assert_eq!(theirs["state"], "settled", "{theirs}");
    for branch in theirs["branches"].as_array().unwrap() {
        assert_eq!(branch["state"], "done", "{theirs}");
    }
    // Nor do its runs.
    let their_run = theirs["branches"][0]["id"].as_str().unwrap();
    let refused = roles.client("client-alice", &["log", their_run]);
    assert_eq!(refused.code, Some(2), "{}", refused.stderr);
    assert!(
        refused.stderr.contains("does not exist"),
        "{}",
        refused.stderr
    );
    let mine = roles.client("client-bob", &["log", their_run, "--json"]);
    assert!(!mine.json().as_array().unwrap().is_empty());
    // alice acts on her own.
    let own = roles.client(
        "client-alice",
        &["fork", "terminate", &a, "concise", "--json"],
    );
    assert_eq!(own.json()["sent"], false, "finished already");
    let shown = roles.client("client-alice", &["fork", "show", &a[..13], "--json"]);
    assert_eq!(shown.json()["fork_id"], a.as_str());
    let merged = roles.client(
        "client-alice",
        &[
            "fork",
            "merge",
            &a,
            "--pick",
            "concise",
            "--no-apply",
            "--json",
        ],
    );
    assert_eq!(merged.code, Some(0), "{}", merged.stderr);

    // Accounts: changing a cap is an operator's; each client sees its own accounts.
    let refused = roles.client("client-alice", &["account", "set", "alice", "--cap", "5"]);
    assert_eq!(refused.code, Some(2), "{}", refused.stderr);
    assert!(
        refused.stderr.contains("operators only"),
        "{}",
        refused.stderr
    );
    let set = roles.client("admin", &["account", "set", "shared", "--cap", "50"]);
    assert_eq!(set.code, Some(0), "{}", set.stderr);
    let names = |who: &str| -> Vec<String> {
        let shown = roles.client(who, &["account", "show", "--json"]).json();
        let list = shown
            .as_array()
            .cloned()
            .unwrap_or_else(|| vec![shown.clone()]);
        sorted(
            list.iter()
                .map(|a| a["name"].as_str().unwrap().to_string())
                .collect(),
        )
    };
    assert_eq!(names("client-alice"), vec!["alice".to_string()]);
    assert_eq!(
        names("client-bob"),
        vec!["bob".to_string(), "shared".into()]
    );

    // An account the client may not use is refused; a granted one is fine.
    let spec = std::fs::read_to_string(ex.spec()).unwrap();
    let shared = ex.write_spec(&format!("account = \"shared\"\n{spec}"));
    let refused = roles.client("client-alice", &["fork", "create", path_str(&shared)]);
    assert_eq!(refused.code, Some(2), "{}", refused.stderr);
    assert!(
        refused.stderr.contains("may not charge account `shared`"),
        "{}",
        refused.stderr
    );
    let granted = roles.create("client-bob", &shared);
    assert!(!roles.listed("client-alice").contains(&granted));
    assert!(roles.listed("client-bob").contains(&granted));
    roles.watch("client-bob", &granted);

    // A resolve under the roles: test jobs and the judge on the worker (which may only
    // answer `worker.resolve`), the decision and the merge on the coordinator.
    let fix = Example::named("fix-a-bug");
    let id = roles.create("client-alice", &fix.spec());
    roles.watch("client-alice", &id);
    let resolved = roles.client(
        "client-alice",
        &["fork", "resolve", &id, "--no-apply", "--json"],
    );
    let doc = resolved.json();
    assert_eq!(doc["decision"]["kind"], "commit", "{doc}\n{}", roles.logs());
    assert!(doc["merge"]["winner"].is_string(), "{doc}");

    // An agent forks itself through the workers' API subject; the fork it makes charges
    // the same account, so alice sees it.
    let agent = Example::quickstart();
    std::fs::write(agent.dir.path().join("agent.toml"), AGENT_SCRIPT).unwrap();
    let spec = agent.write_spec(
        "goal = \"fork\"\nworkspace = \"workspace\"\nmodel = \"scripted:agent\"\nforking = true\n\
         [models.\"scripted:agent\"]\nscript = \"agent.toml\"\n\
         price = { input_per_mtok = 0.15, output_per_mtok = 0.60 }\n",
    );
    let before = roles.listed("client-alice").len();
    let id = roles.create("client-alice", &spec);
    let view = roles.watch("client-alice", &id);
    assert_eq!(
        view["branches"][0]["state"],
        "done",
        "{view}\n{}",
        roles.logs()
    );
    assert_eq!(
        roles.listed("client-alice").len(),
        before + 2,
        "the agent's fork is hers"
    );
    assert_eq!(roles.listed("client-bob").len(), 2);

    // Everything above needed no permission a role lacks.
    let log = roles.nats.log();
    assert!(!log.contains("Violation"), "{log}");
}

/// An agent that forks one branch, waits for it and merges it.
const AGENT_SCRIPT: &str = r#"
[defaults]
usage = { input_tokens = 100, output_tokens = 10 }
[[turns.main]]
tool_calls = [{ name = "fork_run", args = { branches = [{ label = "x", steer = "write x" }] } }]
[[turns.main]]
tool_calls = [{ name = "inspect_branches", args = { wait_s = 60 } }]
[[turns.main]]
tool_calls = [{ name = "merge_or_select", args = { action = "pick:x" } }]
[[turns.main]]
text = "merged x"
[[turns.x]]
tool_calls = [{ name = "write_file", args = { path = "x.txt", content = "x\n" } }]
[[turns.x]]
text = "x done"
"#;

/// A raw NATS connection as one of the generated identities, with every server error it
/// is told about.
pub(super) struct Raw {
    pub(super) client: async_nats::Client,
    errors: tokio::sync::mpsc::UnboundedReceiver<String>,
}

pub(super) async fn connect_as(url: &str, auth: &Path, who: &str, inbox: Option<&str>) -> Raw {
    let seed = std::fs::read_to_string(auth.join(format!("{who}.nk"))).unwrap();
    let (tx, errors) = tokio::sync::mpsc::unbounded_channel();
    let mut opts = async_nats::ConnectOptions::with_nkey(seed.trim().to_string()).event_callback(
        move |event| {
            let tx = tx.clone();
            async move {
                if let async_nats::Event::ServerError(e) = event {
                    let _ = tx.send(e.to_string());
                }
            }
        },
    );
    if let Some(prefix) = inbox {
        opts = opts.custom_inbox_prefix(prefix);
    }
    let client = opts.connect(url).await.unwrap();
    Raw { client, errors }
}

impl Raw {
    /// Until the server says it refused `what` on `subject` (bounded).
    pub(super) async fn refused(&mut self, what: &str, subject: &str) {
        let want = format!("permissions violation for {what} to \"{subject}\"").to_lowercase();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, self.errors.recv()).await {
                Ok(Some(e)) if e.to_lowercase().contains(&want) => return,
                Ok(Some(_)) => {}
                _ => panic!("the server did not refuse {what} to {subject}"),
            }
        }
    }
}

#[test]
fn the_server_refuses_what_a_role_may_not_do() {
    let dir = tempfile::tempdir().unwrap();
    let (nats, auth) = generated_server(dir.path());
    let url = nats.url();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        // An admin listens on everything only the coordinator may publish.
        let admin = connect_as(&url, &auth, "admin", None).await;
        let mut seen = admin.client.subscribe("ff.>").await.unwrap();
        admin.client.flush().await.unwrap();

        let mut alice =
            connect_as(&url, &auth, "client-alice", Some("_INBOX_ff.client.alice")).await;
        for subject in [
            "ff.task.default",
            "ff.event.branch",
            "ff.control.x",
            "ff.api.worker.resolve",
            "ff.api.coordinator",
            "ff.api.worker",
            "ff.api.client.bob",
            "ff.api.coord.budget",
        ] {
            alice
                .client
                .publish(subject, "forged".into())
                .await
                .unwrap();
            alice.client.flush().await.unwrap();
            alice.refused("publish", subject).await;
        }
        // Nor may she read the API's requests or anyone's replies but hers.
        for subject in [
            "ff.api.coordinator",
            "ff.api.client.alice",
            "_INBOX_ff.client.bob.>",
            "_INBOX.>",
            "ff.api.worker.resolve",
        ] {
            let _sub = alice.client.subscribe(subject).await.unwrap();
            alice.client.flush().await.unwrap();
            alice.refused("subscription", subject).await;
        }
        // A worker may not publish tasks or resolve jobs either.
        let mut worker = connect_as(&url, &auth, "worker", Some("_INBOX_ff.worker")).await;
        for subject in [
            "ff.task.default",
            "ff.api.worker.resolve",
            "ff.control.x",
            "ff.api.coordinator",
        ] {
            worker
                .client
                .publish(subject, "forged".into())
                .await
                .unwrap();
            worker.client.flush().await.unwrap();
            worker.refused("publish", subject).await;
        }
        // Her own API subject is hers to publish on: the admin sees that one only.
        alice
            .client
            .publish("ff.api.client.alice", "mine".into())
            .await
            .unwrap();
        alice.client.flush().await.unwrap();
        let first = tokio::time::timeout(Duration::from_secs(10), seen.next())
            .await
            .expect("the admin saw nothing")
            .unwrap();
        assert_eq!(first.subject.as_str(), "ff.api.client.alice");
        assert_eq!(first.payload.as_ref(), b"mine");
    });
    let log = nats.log_tail();
    assert!(
        log.contains("Publish Violation - Subject \"ff.task.default\""),
        "{log}"
    );
}

#[test]
fn url_credentials_authenticate_and_no_password_reaches_the_logs() {
    const PASSWORD: &str = "pw-Zk3q9-never-logged";
    let nats = NatsServer::start_with(&["--user", "ffuser", "--pass", PASSWORD]);
    let url = format!("nats://ffuser:{PASSWORD}@127.0.0.1:{}", nats.port());
    for (verbose, rust_log) in [("-vv", None), ("-v", Some("trace"))] {
        let mut cmd = command();
        cmd.env_remove("RUST_LOG");
        if let Some(level) = rust_log {
            cmd.env("RUST_LOG", level);
        }
        // No coordinator here: the command makes the streams itself (a client only binds
        // to the coordinator's unless told to provision).
        let out = cmd
            .env("FORKFLEET_NATS_URL", &url)
            .env("FORKFLEET_NATS_PROVISION", "true")
            .args(["workers", "--json", verbose])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "{stderr}");
        // The logs are on, and say nothing of the password.
        assert!(stderr.contains("bus.nats ready"), "{stderr}");
        assert!(
            !stderr.contains(PASSWORD),
            "{verbose} {rust_log:?}: {stderr}"
        );
    }
    // On the command line (visible in `ps`), a URL with credentials is refused, named,
    // and the password not echoed.
    let out = command()
        .args(["workers", "--nats", &url])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("flag --nats carries credentials")
            && stderr.contains("--nats-password-file"),
        "{stderr}"
    );
    assert!(!stderr.contains(PASSWORD), "{stderr}");
    // A user in the URL and another auth method: an error naming both.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("pw");
    std::fs::write(&file, "other-password\n").unwrap();
    let out = command()
        .env("FORKFLEET_NATS_URL", &url)
        .args([
            "workers",
            "--nats-user",
            "someone",
            "--nats-password-file",
            path_str(&file),
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("a user in the URL from")
            && stderr.contains("FORKFLEET_NATS_URL")
            && stderr.contains("user + password from flag --nats-user"),
        "{stderr}"
    );
    assert!(
        !stderr.contains(PASSWORD) && !stderr.contains("other-password"),
        "{stderr}"
    );
}

/// `forkfleet cluster auth --tls-name`: the certificates of mutual TLS with the roles. A
/// nats-server that includes the generated `auth.conf` and `tls.conf`, a coordinator and a
/// worker with their generated config files, and alice's fork completes; without her
/// client certificate the server refuses her. `--keep-existing` keeps a previous run's
/// files (compose's `auth` service runs it at every start).
#[test]
fn generated_certificates_make_a_mutual_tls_cluster_under_the_roles() {
    let dir = tempfile::tempdir().unwrap();
    let auth = dir.path().join("auth");
    let generate = |extra: &[&str]| {
        let mut args = vec![
            "cluster",
            "auth",
            "--out",
            path_str(&auth),
            "--client",
            "alice",
            "--tls-name",
            "localhost",
            "--tls-name",
            "127.0.0.1",
        ];
        args.extend(extra);
        run(dir.path(), &args)
    };
    let made = generate(&[]);
    assert_eq!(made.code, Some(0), "{}", made.stderr);
    for f in [
        "ca.crt",
        "tls.conf",
        "nats-server.crt",
        "worker.crt",
        "client-alice.crt",
    ] {
        assert!(made.stdout.contains(f), "{f}: {}", made.stdout);
    }
    #[cfg(unix)]
    for key in [
        "ca.key",
        "nats-server.key",
        "worker.key",
        "client-alice.key",
    ] {
        use std::os::unix::fs::PermissionsExt as _;
        let mode = std::fs::metadata(auth.join(key))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600, "{key}");
    }
    let ca = std::fs::read_to_string(auth.join("ca.crt")).unwrap();
    let kept = generate(&["--keep-existing"]);
    assert_eq!(kept.code, Some(0), "{}", kept.stderr);
    assert!(kept.stderr.contains("kept"), "{}", kept.stderr);
    assert_eq!(std::fs::read_to_string(auth.join("ca.crt")).unwrap(), ca);
    let both = generate(&["--keep-existing", "--force"]);
    assert_eq!(both.code, Some(2), "{}", both.stderr);

    let conf = auth.join("nats.conf");
    std::fs::write(&conf, "include ./auth.conf\ninclude ./tls.conf\n").unwrap();
    let nats = NatsServer::start_with_config(&conf);
    let url = format!("tls://localhost:{}", nats.port());
    let service = |name: &str, args: &[&str]| {
        let mut all = vec![name, "--config"];
        let config = auth.join(format!("{name}.toml"));
        all.push(path_str(&config));
        all.extend(["--nats", &url]);
        all.extend(args);
        Service::spawn(name, &all, dir.path())
    };
    let data = dir.path().join("data");
    let coordinator = service("coordinator", &["--data", path_str(&data)]);
    let worker = service("worker", &["--concurrency", "2"]);
    let client = |who: &str, args: &[&str]| {
        let config = auth.join(format!("{who}.toml"));
        let mut all = args.to_vec();
        all.extend(["--config", path_str(&config), "--nats", &url]);
        run(dir.path(), &all)
    };
    let ex = Example::quickstart();
    fork_to_done(
        |args| client("client-alice", args),
        &ex.spec(),
        || {
            format!(
                "coordinator:\n{}\nworker:\n{}\n{}",
                coordinator.log(),
                worker.log(),
                nats.log_tail()
            )
        },
    );

    // Her config without its client certificate: the server asks for one.
    let alice = std::fs::read_to_string(auth.join("client-alice.toml")).unwrap();
    let no_cert = auth.join("alice-no-cert.toml");
    std::fs::write(
        &no_cert,
        alice
            .lines()
            .filter(|l| !l.starts_with("cert_file") && !l.starts_with("key_file"))
            .collect::<Vec<_>>()
            .join("\n"),
    )
    .unwrap();
    let refused = run(
        dir.path(),
        &[
            "fork",
            "ls",
            "--config",
            path_str(&no_cert),
            "--nats",
            &url,
            "--nats-connect-timeout-s",
            "3",
        ],
    );
    assert_ne!(refused.code, Some(0));
    assert!(
        refused.stderr.contains("CertificateRequired"),
        "{}",
        refused.stderr
    );
}
