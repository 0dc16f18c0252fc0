//! The HTTP API (docs/HTTP.md) of a real coordinator process on NATS with a worker: every
//! declared operation routed, a fork created from uploaded blobs and followed, merged and
//! inspected over HTTP, problem+json errors, scopes and account limits, idempotency keys,
//! SSE resumption with `Last-Event-ID`, the audit log, and the OpenAPI document checked by
//! `openapi-spec-validator` against the routes served.

use super::fleet::{Fleet, Options, COMMAND_LIMIT, POLL};
use super::harness::{path_str, Example};
use forkfleet::http_api::auth::hash;
use forkfleet_shared::api::ROUTES;
use forkfleet_shared::blob::BlobHash;
use reqwest::blocking::{Client, RequestBuilder, Response};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::time::{Duration, Instant};

const ADMIN: &str = "ff_admin_token_for_tests";
const READER: &str = "ff_reader_token_for_tests";
const TEAM: &str = "ff_team_token_for_tests";

struct Api {
    fleet: Fleet,
    base: String,
    http: Client,
}

impl Api {
    fn start() -> Api {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("coordinator.toml");
        std::fs::write(
            &config,
            format!(
                "[http.tokens.\"ops\"]\nsha256 = \"{}\"\nscopes = [\"admin\"]\n\n\
                 [http.tokens.\"viewer\"]\nsha256 = \"{}\"\nscopes = [\"read\"]\n\n\
                 [http.tokens.\"team\"]\nsha256 = \"{}\"\nscopes = [\"write\"]\naccounts = [\"team-a\"]\n",
                hex::encode(hash(ADMIN)),
                hex::encode(hash(READER)),
                hex::encode(hash(TEAM)),
            ),
        )
        .unwrap();
        let addr = format!("127.0.0.1:{}", forkfleet_bus::testkit::free_port());
        let fleet = Fleet::start(
            1,
            8,
            Options {
                coordinator_args: &["--http-addr", &addr, "--config", path_str(&config)],
                ..Options::default()
            },
        );
        // The config file outlives the test's use of it: the coordinator read it at start.
        std::mem::forget(dir);
        let api = Api {
            fleet,
            base: format!("http://{addr}/api/v1"),
            http: Client::builder()
                .timeout(Duration::from_secs(60))
                .build()
                .unwrap(),
        };
        let deadline = Instant::now() + COMMAND_LIMIT;
        while api.get("/ping", ADMIN).map(|r| r.status().as_u16()).ok() != Some(200) {
            assert!(
                Instant::now() < deadline,
                "the HTTP API never answered\n{}",
                api.fleet.logs()
            );
            std::thread::sleep(POLL);
        }
        api
    }

    fn req(&self, method: &str, path: &str, token: &str) -> RequestBuilder {
        let url = format!("{}{path}", self.base);
        let m = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
        self.http.request(m, url).bearer_auth(token)
    }

    fn get(&self, path: &str, token: &str) -> reqwest::Result<Response> {
        self.req("GET", path, token).send()
    }

    /// Send a request with an optional JSON body: the status, the content type and the text.
    fn send(
        &self,
        method: &str,
        path: &str,
        token: &str,
        body: Option<Value>,
    ) -> (u16, String, String) {
        let mut r = self.req(method, path, token);
        if let Some(b) = body {
            r = r
                .header("content-type", "application/json")
                .body(b.to_string());
        }
        let resp = r.send().unwrap();
        let status = resp.status().as_u16();
        let ct = resp
            .headers()
            .get("content-type")
            .map(|v| v.to_str().unwrap().to_string())
            .unwrap_or_default();
        (status, ct, resp.text().unwrap())
    }

    /// A JSON answer with status 200.
    fn ok(&self, method: &str, path: &str, token: &str, body: Option<Value>) -> Value {
        let (status, _, text) = self.send(method, path, token, body);
        assert_eq!(status, 200, "{method} {path}: {text}");
        serde_json::from_str(&text).unwrap()
    }

    /// A problem document with `status`.
    fn problem(
        &self,
        method: &str,
        path: &str,
        token: &str,
        body: Option<Value>,
        status: u16,
    ) -> Value {
        let (got, ct, text) = self.send(method, path, token, body);
        assert_eq!(got, status, "{method} {path}: {text}");
        assert_eq!(ct, "application/problem+json", "{method} {path}: {text}");
        let doc: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(doc["status"], status);
        assert!(doc["type"]
            .as_str()
            .unwrap()
            .starts_with("urn:forkfleet:problem:"));
        assert!(!doc["detail"].as_str().unwrap().is_empty());
        doc
    }

    /// Upload the quickstart's workspace and scripts, then create its fork; its view.
    fn create_quickstart(
        &self,
        ex: &Example,
        key: Option<&str>,
    ) -> (Value, reqwest::header::HeaderMap) {
        create_from_spec(&self.http, &self.base, ADMIN, &ex.spec(), key)
    }
}

/// Create the fork of the spec at `spec` through the HTTP API at `base` as a client in
/// another language would: upload the workspace's files and the spec's scripts, then the
/// snapshot, then `POST /forks` (with an idempotency key when given). Its view and the
/// answer's headers.
pub(super) fn create_from_spec(
    http: &Client,
    base: &str,
    token: &str,
    spec: &std::path::Path,
    key: Option<&str>,
) -> (Value, reqwest::header::HeaderMap) {
    let loaded = forkfleet_shared::spec::load(spec).unwrap();
    let scan =
        forkfleet_shared::manifest::scan_dir(&loaded.workspace, &[".forkfleet".into()]).unwrap();
    let put = |hash: BlobHash, bytes: Vec<u8>| {
        let resp = http
            .put(format!("{base}/blobs/{hash}"))
            .bearer_auth(token)
            .body(bytes)
            .send()
            .unwrap();
        assert_eq!(resp.status().as_u16(), 204, "{}", resp.text().unwrap());
    };
    for (h, b) in scan.blobs.iter().chain(loaded.blobs.iter()) {
        put(*h, b.to_vec());
    }
    let manifest = scan.manifest.to_blob().unwrap().to_vec();
    let snapshot = BlobHash::of(&manifest);
    put(snapshot, manifest);
    let body = json!({
        "plan": loaded.plan,
        "parent": { "kind": "new" },
        "snapshot": snapshot.to_string(),
        "workspace": path_str(&loaded.workspace),
    });
    let mut r = http
        .post(format!("{base}/forks"))
        .bearer_auth(token)
        .header("content-type", "application/json")
        .body(body.to_string());
    if let Some(k) = key {
        r = r.header("Idempotency-Key", k);
    }
    let resp = r.send().unwrap();
    let headers = resp.headers().clone();
    let status = resp.status().as_u16();
    let text = resp.text().unwrap();
    assert_eq!(status, 200, "{text}");
    (serde_json::from_str(&text).unwrap(), headers)
}

/// The next SSE event of `lines`: its id, name and data.
fn next_event(
    lines: &mut impl Iterator<Item = std::io::Result<String>>,
) -> (Option<String>, String, String) {
    try_next_event(lines).expect("the stream ended")
}

/// The next SSE event of `lines`, or `None` once the stream has ended.
fn try_next_event(
    lines: &mut impl Iterator<Item = std::io::Result<String>>,
) -> Option<(Option<String>, String, String)> {
    let (mut id, mut name, mut data) = (None, String::new(), String::new());
    for line in lines {
        let Ok(line) = line else {
            return None;
        };
        if line.is_empty() {
            if !data.is_empty() {
                return Some((id, name, data));
            }
            continue;
        }
        if let Some(v) = line.strip_prefix("id:") {
            id = Some(v.trim().to_string());
        } else if let Some(v) = line.strip_prefix("event:") {
            name = v.trim().to_string();
        } else if let Some(v) = line.strip_prefix("data:") {
            data.push_str(v.trim_start());
        }
    }
    None
}

#[test]
fn the_http_api_serves_every_operation_with_scopes_problems_streams_and_a_valid_openapi() {
    let api = Api::start();

    // Every declared route is served (a bad request gets a problem from its handler, never
    // the fallback's "no route" or a 405).
    for r in ROUTES {
        let path = r
            .path
            .replace("{fork}", "not-a-fork")
            .replace(['{', '}'], "");
        let resp = api.req(r.method, &path, ADMIN).send().unwrap();
        let status = resp.status().as_u16();
        let text = resp.text().unwrap();
        assert_ne!(status, 405, "{} {}: {text}", r.method, r.path);
        assert!(
            !text.contains("no route"),
            "{} {} is not routed: {text}",
            r.method,
            r.path
        );
    }

    // A path no route has: a problem, from the router's one fallback.
    let resp = api.req("GET", "/no/such/route", ADMIN).send().unwrap();
    assert_eq!(resp.status().as_u16(), 404);
    assert_eq!(
        resp.headers()["content-type"].to_str().unwrap(),
        "application/problem+json"
    );
    let text = resp.text().unwrap();
    assert!(text.contains("no route /api/v1/no/such/route"), "{text}");

    // Create from uploaded blobs, with an idempotency key: asked twice, made once.
    let ex = Example::quickstart();
    let (view, _) = api.create_quickstart(&ex, Some("create-1"));
    let fork = view["fork_id"].as_str().unwrap().to_string();
    let (again, headers) = api.create_quickstart(&ex, Some("create-1"));
    assert_eq!(again["fork_id"], view["fork_id"]);
    assert_eq!(headers.get("idempotent-replayed").unwrap(), "true");

    // From a spec document and the snapshot already uploaded.
    let spec_text = std::fs::read_to_string(ex.spec()).unwrap();
    let script = std::fs::read_to_string(ex.dir.path().join("script.toml")).unwrap();
    let second = api.ok(
        "POST",
        "/forks/from-spec",
        ADMIN,
        Some(json!({"spec": spec_text, "files": {"script.toml": script}, "snapshot": view["snapshot"], "workspace": "from-spec"})),
    );
    assert_ne!(second["fork_id"], view["fork_id"]);
    assert_eq!(second["branches"].as_array().unwrap().len(), 3);
    // Six copies of one creating request with one Idempotency-Key, sent at once: one fork
    // is made, and every copy answers it.
    let forks_before = api
        .ok("GET", "/forks", ADMIN, None)
        .as_array()
        .unwrap()
        .len();
    let doc = json!({"spec": spec_text, "files": {"script.toml": script}, "snapshot": view["snapshot"], "workspace": "keyed"});
    let answers: Vec<Value> = std::thread::scope(|scope| {
        let sent: Vec<_> = (0..6)
            .map(|_| {
                scope.spawn(|| {
                    let resp = api
                        .req("POST", "/forks/from-spec", ADMIN)
                        .header("idempotency-key", "spec-once")
                        .header("content-type", "application/json")
                        .body(doc.to_string())
                        .send()
                        .unwrap();
                    assert_eq!(resp.status().as_u16(), 200);
                    serde_json::from_str::<Value>(&resp.text().unwrap()).unwrap()
                })
            })
            .collect();
        sent.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(
        answers
            .iter()
            .all(|a| a["fork_id"] == answers[0]["fork_id"]),
        "{answers:?}"
    );
    let forks_after = api
        .ok("GET", "/forks", ADMIN, None)
        .as_array()
        .unwrap()
        .len();
    assert_eq!(forks_after, forks_before + 1);
    let p = api.problem(
        "POST",
        "/forks/from-spec",
        ADMIN,
        Some(json!({"spec": "goal = 1", "snapshot": view["snapshot"]})),
        400,
    );
    assert!(p["detail"].as_str().unwrap().contains("the spec"), "{p}");
    api.problem(
        "POST",
        "/forks/from-spec",
        ADMIN,
        Some(json!({"spec": spec_text, "files": {"../x": "y"}, "snapshot": view["snapshot"]})),
        400,
    );
    // A spec naming files on the coordinator's host (absolute, `../`, not uploaded) reads
    // none of them: refused, naming the key, quoting nothing of the file.
    let secret = ex.dir.path().join("host-secret.txt");
    std::fs::write(&secret, "SEED-never-read\n").unwrap();
    let secret = path_str(&secret).to_string();
    let attacks = [
        (format!("history = \"{secret}\"\n"), "history"),
        ("history = \"../host-secret.txt\"\n".to_string(), "history"),
        ("history = \"history.json\"\n".to_string(), "history"),
    ];
    for (extra, key) in attacks {
        let p = api.problem(
            "POST",
            "/forks/from-spec",
            ADMIN,
            Some(json!({"spec": format!("{extra}{spec_text}"), "files": {"script.toml": script}, "snapshot": view["snapshot"]})),
            400,
        );
        let detail = p["detail"].as_str().unwrap();
        assert!(
            detail.contains(key) && detail.contains("does not carry"),
            "{p}"
        );
        assert!(!p.to_string().contains("SEED-never-read"), "{p}");
    }
    let p = api.problem(
        "POST",
        "/forks/from-spec",
        ADMIN,
        Some(json!({"spec": spec_text.replace("script = \"script.toml\"", &format!("script = \"{secret}\"")), "files": {"script.toml": script}, "snapshot": view["snapshot"]})),
        400,
    );
    assert!(p["detail"].as_str().unwrap().contains("script"), "{p}");
    assert!(!p.to_string().contains("SEED-never-read"), "{p}");
    // The same host path named in `files` too (a hostile test read /etc/shadow so), and
    // /dev/zero (which ran a coordinator out of memory): refused all the same.
    for host in [secret.as_str(), "/dev/zero", "//dev/zero"] {
        let p = api.problem(
            "POST",
            "/forks/from-spec",
            ADMIN,
            Some(json!({"spec": spec_text.replace("script = \"script.toml\"", &format!("script = \"{host}\"")), "files": {"script.toml": script, host: "x"}, "snapshot": view["snapshot"]})),
            400,
        );
        assert!(
            p["detail"].as_str().unwrap().contains("does not carry"),
            "{p}"
        );
        assert!(!p.to_string().contains("SEED-never-read"), "{p}");
    }

    // SSE: the first event, a dropped connection, then resumption after it.
    let resp = api
        .req("GET", &format!("/forks/{fork}/stream"), READER)
        .timeout(Duration::from_secs(30))
        .send()
        .unwrap();
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    let mut lines = BufReader::new(resp).lines();
    let (id, name, data) = next_event(&mut lines);
    assert_eq!(name, "fork");
    let first: u64 = id.unwrap().parse().unwrap();
    let doc: Value = serde_json::from_str(&data).unwrap();
    assert_eq!(doc["view"]["fork_id"], fork.as_str());
    drop(lines);
    let settled = api.ok(
        "GET",
        &format!("/forks/{fork}/settled?timeout_ms=30000"),
        READER,
        None,
    );
    assert_eq!(settled["branches"].as_array().unwrap().len(), 3);
    // A change after the event seen (the fork may have settled before it was sent).
    api.ok(
        "POST",
        &format!("/forks/{fork}/branches/tidy/continue"),
        ADMIN,
        Some(json!({"text": "and?"})),
    );
    let resp = api
        .req("GET", &format!("/forks/{fork}/stream"), READER)
        .timeout(Duration::from_secs(30))
        .header("Last-Event-ID", first.to_string())
        .send()
        .unwrap();
    let (id, _, data) = next_event(&mut BufReader::new(resp).lines());
    assert!(id.unwrap().parse::<u64>().unwrap() > first, "{data}");

    // A run's events, resumed after seq 2.
    let run = settled["branches"][0]["run_id"]
        .as_str()
        .unwrap()
        .to_string();
    let events = api.ok(
        "GET",
        &format!("/runs/{run}/events?limit=5&offset=1"),
        READER,
        None,
    );
    assert_eq!(events.as_array().unwrap().len(), 5);
    assert_eq!(events[0]["seq"], 1);
    let resp = api
        .req("GET", &format!("/runs/{run}/stream"), READER)
        .timeout(Duration::from_secs(30))
        .header("Last-Event-ID", "2")
        .send()
        .unwrap();
    let (id, name, _) = next_event(&mut BufReader::new(resp).lines());
    assert_eq!((id.as_deref(), name.as_str()), (Some("3"), "event"));

    // Lists page and filter.
    let resp = api.get("/forks?limit=1", READER).unwrap();
    // The quickstart's, the spec document's and the keyed one.
    assert_eq!(resp.headers()["x-total-count"], "3");
    let listed: Value = serde_json::from_str(&resp.text().unwrap()).unwrap();
    assert_eq!(listed.as_array().unwrap().len(), 1);
    let none = api.ok("GET", "/forks?state=aborted", READER, None);
    assert_eq!(none, json!([]));
    api.problem("GET", "/forks?colour=red", READER, None, 400);

    // Reads of every kind.
    let diff = api.ok(
        "GET",
        &format!(
            "/forks/{fork}/diff?options={}",
            "%7B%22unified%22%3Atrue%7D"
        ),
        READER,
        None,
    );
    assert!(
        diff["paths"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["path"] == "greet.py"),
        "{diff}"
    );
    let cost = api.ok("GET", &format!("/forks/{fork}/cost"), READER, None);
    assert_eq!(cost["branches"].as_array().unwrap().len(), 3);
    api.ok("GET", &format!("/runs/{run}"), READER, None);
    api.ok("GET", &format!("/runs/{run}/checkpoints"), READER, None);
    api.ok("GET", "/runs", READER, None);
    api.ok("GET", "/accounts", READER, None);
    api.ok("GET", "/approvals", READER, None);
    let workers = api.ok("GET", "/workers", READER, None);
    assert_eq!(workers.as_array().unwrap().len(), 1);
    // An operator's slow fork runs: an operator sees its branches on the worker, a token
    // limited to another account sees none of them.
    let slow_ex = Example::quickstart();
    let slow = api.fleet.create(&super::harness::slow_spec(&slow_ex));
    api.fleet.wait_progress(&slow, 1);
    let running = |token: &str| -> usize {
        api.ok("GET", "/workers", token, None).as_array().unwrap()[0]["running"]
            .as_array()
            .unwrap()
            .len()
    };
    // The worker's list of running branches comes with its heartbeat: until it shows one.
    let deadline = Instant::now() + COMMAND_LIMIT;
    while running(READER) == 0 {
        assert!(
            Instant::now() < deadline,
            "no running branch listed\n{}",
            api.fleet.logs()
        );
        std::thread::sleep(POLL);
    }
    assert_eq!(running(TEAM), 0);
    api.fleet.client(&["fork", "abort", &slow]);
    let found = api.ok(
        "GET",
        &format!("/fork-prefixes/{}", &fork[..13]),
        READER,
        None,
    );
    assert_eq!(found, json!(fork));

    // Scopes and account limits.
    let merge = format!("/forks/{fork}/merge");
    let p = api.problem(
        "POST",
        &merge,
        READER,
        Some(json!({"pick": "concise"})),
        403,
    );
    assert!(p["detail"].as_str().unwrap().contains("`write`"), "{p}");
    api.problem("GET", &format!("/forks/{fork}"), TEAM, None, 404);
    api.problem("GET", "/forks", "not-a-token", None, 401);
    api.problem("POST", "/gc", TEAM, Some(json!({"dry_run": true})), 403);

    // Bad input names what was wrong.
    let p = api.problem("POST", &merge, ADMIN, Some(json!({"pick": 3})), 400);
    assert!(p["detail"].as_str().unwrap().contains("pick"), "{p}");
    let p = api.problem("POST", &merge, ADMIN, Some(json!({"pick": "nope"})), 404);
    assert!(
        p["detail"]
            .as_str()
            .unwrap()
            .contains("valid labels: concise, thorough, tidy"),
        "{p}"
    );
    api.problem("GET", "/nothing-here", ADMIN, None, 404);

    // A write: merged, and recorded in the audit log.
    let merged = api.ok("POST", &merge, ADMIN, Some(json!({"pick": "concise"})));
    assert_eq!(merged["winner"], "concise");
    let verdict = api.ok("GET", &format!("/forks/{fork}/verdict"), READER, None);
    assert_eq!(verdict, Value::Null);
    let audit =
        std::fs::read_to_string(api.fleet.dir.path().join("coordinator-data/audit.log")).unwrap();
    let lines: Vec<Value> = audit
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(
        lines
            .iter()
            .any(|l| l["op"] == "merge" && l["who"] == "ops" && l["status"] == 200),
        "{audit}"
    );
    // Writes that are not one operation are recorded too.
    assert!(
        lines
            .iter()
            .any(|l| l["op"] == "put_blob" && l["status"] == 204),
        "{audit}"
    );
    assert!(
        lines.iter().any(|l| l["op"] == "create_fork_from_spec"),
        "{audit}"
    );

    // More operations, as any client would send them.
    let acc = api.ok(
        "PUT",
        "/accounts/team-a",
        ADMIN,
        Some(json!({"cap_usd": 5.0})),
    );
    assert_eq!(
        (acc["name"].clone(), acc["cap_usd"].clone()),
        (json!("team-a"), json!(5.0))
    );
    api.problem(
        "PUT",
        "/accounts/team-a",
        TEAM,
        Some(json!({"cap_usd": 50.0})),
        403,
    );
    let cp = api.ok(
        "POST",
        &format!("/runs/{run}/checkpoints"),
        ADMIN,
        Some(json!({"label": "http-cp"})),
    );
    assert_eq!(cp["label"], "http-cp");
    let cps = api.ok("GET", &format!("/runs/{run}/checkpoints"), READER, None);
    assert!(
        cps.as_array()
            .unwrap()
            .iter()
            .any(|c| c["label"] == "http-cp"),
        "{cps}"
    );
    api.ok(
        "DELETE",
        &format!("/runs/{run}/checkpoints/http-cp"),
        ADMIN,
        None,
    );
    let gc = api.ok("POST", "/gc", ADMIN, Some(json!({"dry_run": true})));
    assert!(gc.is_object(), "{gc}");
    let second_id = second["fork_id"].as_str().unwrap();
    api.ok(
        "GET",
        &format!("/forks/{second_id}/settled?timeout_ms=30000"),
        READER,
        None,
    );
    let cont = api.ok(
        "POST",
        &format!("/forks/{second_id}/branches/tidy/continue"),
        ADMIN,
        Some(json!({"text": "one more thing"})),
    );
    assert_eq!(cont["label"], "tidy", "{cont}");
    let aborted = api.ok("POST", &format!("/forks/{second_id}/abort"), ADMIN, None);
    assert!(aborted.is_object(), "{aborted}");
    let listed = api.ok("GET", "/forks?state=aborted", READER, None);
    // This one, and the slow fork aborted after the workers' check.
    assert_eq!(listed.as_array().unwrap().len(), 2, "{listed}");

    // The OpenAPI document: valid, and every path and method in it is served.
    let doc = api.ok("GET", "/openapi.json", READER, None);
    let file = api.fleet.dir.path().join("openapi.json");
    std::fs::write(&file, doc.to_string()).unwrap();
    let python = std::env::var("FORKFLEET_PYTHON").unwrap_or_else(|_| "python3".into());
    let out = std::process::Command::new(python)
        .args(["-m", "openapi_spec_validator", path_str(&file)])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    for (path, methods) in doc["paths"].as_object().unwrap() {
        let path = path
            .strip_prefix("/api/v1")
            .unwrap()
            .replace(['{', '}'], "");
        for method in methods.as_object().unwrap().keys() {
            let resp = api
                .req(&method.to_uppercase(), &path, ADMIN)
                .send()
                .unwrap();
            assert_ne!(resp.status().as_u16(), 405, "{method} {path}");
            let text = resp.text().unwrap_or_default();
            assert!(!text.contains("no route"), "{method} {path}: {text}");
        }
    }
}

#[test]
fn cluster_token_prints_a_token_once_and_the_entry_that_admits_it() {
    let out = super::harness::forkfleet(&[
        "cluster",
        "token",
        "ci",
        "--scope",
        "write",
        "--account",
        "team-a",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let said = String::from_utf8_lossy(&out.stderr);
    let token = said
        .lines()
        .find_map(|l| l.split("keep it secret): ").nth(1))
        .unwrap()
        .trim()
        .to_string();
    assert!(
        !text.contains(&token),
        "the token is not in the entry: {text}"
    );
    // stdout is the entry alone: appended to a file, it is a tokens file.
    let entry: forkfleet::config::Layer = toml::from_str(&text).unwrap();
    assert_eq!(entry.http.tokens.len(), 1, "{text}");
    assert!(token.starts_with("ff_") && token.len() == 67, "{text}");
    assert!(
        text.contains(&format!("sha256 = \"{}\"", hex::encode(hash(&token)))),
        "{text}"
    );
    assert!(
        text.contains("scopes = [\"write\"]") && text.contains("accounts = [\"team-a\"]"),
        "{text}"
    );
    let bad = super::harness::forkfleet(&["cluster", "token", "a b"]);
    assert_eq!(bad.status.code(), Some(2));
}

#[test]
fn forkfleet_ui_serves_an_embedded_store_under_a_token_of_its_own() {
    let ex = Example::quickstart();
    let ran = super::harness::run_spec(&ex.spec());
    assert!(
        ran.status.success(),
        "{}",
        String::from_utf8_lossy(&ran.stderr)
    );
    let ui = Ui::start(&ex.data());
    let (base, token) = (ui.base.clone(), ui.token.clone());
    let http = Client::new();
    let forks: Value = serde_json::from_str(
        &http
            .get(format!("{base}/forks"))
            .bearer_auth(&token)
            .send()
            .unwrap()
            .text()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(forks.as_array().unwrap().len(), 1, "{forks}");
    let denied = http.get(format!("{base}/forks")).send().unwrap();
    assert_eq!(denied.status().as_u16(), 401);
    // Ctrl-C: it stops and lets the store go.
    ui.stop();
}

/// `forkfleet ui` on a data directory: its API's base URL, its token, its console's URL.
pub(super) struct Ui {
    child: std::process::Child,
    pub base: String,
    pub token: String,
    pub console: String,
}

impl Ui {
    pub fn start(data: &std::path::Path) -> Ui {
        let mut child = super::harness::command()
            .args(["ui", "--data", path_str(data)])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let (mut base, mut token, mut console) = (None, None, None);
        while base.is_none() || token.is_none() || console.is_none() {
            let line = rx
                .recv_timeout(COMMAND_LIMIT)
                .expect("forkfleet ui printed its address and token");
            if let Some(rest) = line
                .split(" on ")
                .nth(1)
                .filter(|_| line.starts_with("forkfleet ui:"))
            {
                base = Some(rest.trim().to_string());
            }
            if let Some(t) = line.strip_prefix("token (this run only): ") {
                token = Some(t.trim().to_string());
            }
            if let Some(c) = line.strip_prefix("console: ") {
                console = Some(c.trim().to_string());
            }
        }
        Ui {
            child,
            base: base.unwrap(),
            token: token.unwrap(),
            console: console.unwrap(),
        }
    }

    /// Ctrl-C, and it exits cleanly (bounded).
    pub fn stop(mut self) {
        unsafe { libc::kill(self.child.id() as i32, libc::SIGINT) };
        let status = super::fleet::wait_bounded(&mut self.child, COMMAND_LIMIT)
            .expect("forkfleet ui stopped");
        assert!(status.success(), "{status:?}");
    }
}

impl Drop for Ui {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What a web page in a browser can send, refused by a coordinator whose API has no token
/// (loopback callers are its operator): a cross-origin write (a `no-cors` POST carries its
/// `Origin`), a body that is not JSON, a name that is not this machine's loopback (DNS
/// rebinding), a token in a URL. A same-origin page gets a stream ticket and the stream.
#[test]
fn browser_attacks_on_a_tokenless_api_are_refused() {
    let addr = format!("127.0.0.1:{}", forkfleet_bus::testkit::free_port());
    let fleet = Fleet::start(
        1,
        4,
        Options {
            coordinator_args: &["--http-addr", &addr],
            ..Options::default()
        },
    );
    let base = format!("http://{addr}/api/v1");
    let http = Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    let deadline = Instant::now() + COMMAND_LIMIT;
    while http
        .get(format!("{base}/ping"))
        .send()
        .map(|r| r.status().as_u16())
        .ok()
        != Some(200)
    {
        assert!(
            Instant::now() < deadline,
            "the HTTP API never answered\n{}",
            fleet.logs()
        );
        std::thread::sleep(POLL);
    }
    let ex = Example::quickstart();
    let fork = fleet.create(&ex.spec());
    let problem = |resp: Response, status: u16| {
        assert_eq!(resp.status().as_u16(), status);
        assert_eq!(resp.headers()["content-type"], "application/problem+json");
        serde_json::from_str::<Value>(&resp.text().unwrap()).unwrap()
    };
    let abort = format!("{base}/forks/{fork}/abort");

    // A page on another origin: refused, the fork untouched.
    let p = problem(
        http.post(&abort)
            .header("origin", "http://evil.example")
            .send()
            .unwrap(),
        403,
    );
    assert!(
        p["detail"].as_str().unwrap().contains("another origin"),
        "{p}"
    );
    let p = problem(
        http.post(&abort).header("origin", "null").send().unwrap(),
        403,
    );
    assert!(
        p["detail"].as_str().unwrap().contains("another origin"),
        "{p}"
    );
    // A body a page may send without asking (text/plain, a form): 415.
    for kind in [
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
    ] {
        let p = problem(
            http.post(&abort)
                .header("content-type", kind)
                .body("{}")
                .send()
                .unwrap(),
            415,
        );
        assert!(
            p["detail"].as_str().unwrap().contains("application/json"),
            "{p}"
        );
    }
    // DNS rebinding: the page's own name pointing at 127.0.0.1.
    let p = problem(
        http.get(format!("{base}/forks"))
            .header("host", "evil.example")
            .send()
            .unwrap(),
        403,
    );
    assert!(p["detail"].as_str().unwrap().contains("loopback"), "{p}");
    // A blob uploaded to the cluster is readable where it was uploaded.
    let bytes = b"a blob put over HTTP\n".to_vec();
    let hash = BlobHash::of(&bytes);
    let put = http
        .put(format!("{base}/blobs/{hash}"))
        .body(bytes.clone())
        .send()
        .unwrap();
    assert_eq!(put.status().as_u16(), 204);
    let got = http.get(format!("{base}/blobs/{hash}")).send().unwrap();
    assert_eq!(got.status().as_u16(), 200);
    assert_eq!(got.bytes().unwrap().to_vec(), bytes);
    // ... and a part of it, named in the query.
    let part: serde_json::Value = serde_json::from_str(
        &http
            .get(format!("{base}/blobs/{hash}/parts?start=2&len=4"))
            .send()
            .unwrap()
            .text()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(part["total"], bytes.len(), "{part}");
    assert_eq!(
        part["bytes"],
        serde_json::json!(bytes[2..6].to_vec()),
        "{part}"
    );
    // A PUT takes JSON too (a blob's bytes aside).
    let p = problem(
        http.put(format!("{base}/accounts/x"))
            .header("content-type", "text/plain")
            .body("{\"cap_usd\": 1}")
            .send()
            .unwrap(),
        415,
    );
    assert!(p["detail"].as_str().unwrap().contains("PUT body"), "{p}");
    // Outside the API too, an unknown path is a problem.
    problem(
        http.get(format!("http://{addr}/api/v2/forks"))
            .send()
            .unwrap(),
        404,
    );
    // The framework's own refusals are problems too: a method a route does not take, a
    // body over the limit.
    let p = problem(http.delete(format!("{base}/ping")).send().unwrap(), 405);
    assert!(
        p["detail"]
            .as_str()
            .unwrap()
            .contains("does not take DELETE"),
        "{p}"
    );
    // (On a connection of its own: the server answers before reading the whole body and
    // closes it.)
    let once = Client::builder()
        .pool_max_idle_per_host(0)
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    let p = problem(
        once.post(format!("{base}/forks/{fork}/branches/x/steer"))
            .header("content-type", "application/json")
            .body(format!("{{\"text\": \"{}\"}}", "s".repeat(3 << 20)))
            .send()
            .unwrap(),
        413,
    );
    assert!(p["detail"].as_str().unwrap().contains("2 MiB"), "{p}");
    // Within the body limit but over what a steer may carry: refused, naming the field
    // and its bound (not an error of the bus it would not fit on).
    let p = problem(
        once.post(format!("{base}/forks/{fork}/branches/x/steer"))
            .header("content-type", "application/json")
            .body(format!("{{\"text\": \"{}\"}}", "s".repeat(1 << 20)))
            .send()
            .unwrap(),
        400,
    );
    let detail = p["detail"].as_str().unwrap();
    assert!(
        detail.contains("`text` is 1048576 bytes long") && !detail.contains("ff."),
        "{p}"
    );
    // A token in a URL, anywhere.
    let p = problem(
        http.get(format!("{base}/forks?access_token=anything"))
            .send()
            .unwrap(),
        400,
    );
    assert!(
        p["detail"]
            .as_str()
            .unwrap()
            .contains("never taken from a URL"),
        "{p}"
    );
    let shown = fleet.client(&["fork", "show", &fork, "--json"]).json();
    assert_ne!(shown["state"], "aborted", "{shown}");

    // The console's own origin: a ticket, then the stream under it; a ticket is taken by a
    // stream only.
    let ticket: Value = serde_json::from_str(
        &http
            .post(format!("{base}/stream-tickets"))
            .header("origin", format!("http://{addr}"))
            .send()
            .unwrap()
            .text()
            .unwrap(),
    )
    .unwrap();
    let ticket = ticket["ticket"].as_str().unwrap().to_string();
    let resp = http
        .get(format!("{base}/forks/{fork}/stream?ticket={ticket}"))
        .send()
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    drop(resp);
    problem(
        http.get(format!("{base}/forks?ticket={ticket}"))
            .send()
            .unwrap(),
        400,
    );
    // A same-origin write is served.
    let resp = http
        .post(&abort)
        .header("origin", format!("http://{addr}"))
        .header("content-type", "application/json")
        .body("{}")
        .send()
        .unwrap();
    assert_eq!(
        resp.status().as_u16(),
        200,
        "{}",
        resp.text().unwrap_or_default()
    );
}

/// `forkfleet ui` on a store under `dir`, a client of its API, and the id of the fork of
/// [`thousand_branch_spec`] it created.
pub(super) fn thousand_branch_fork(dir: &std::path::Path, script: &str) -> (Ui, Client, String) {
    let spec_path = thousand_branch_spec(dir, script);
    let ui = Ui::start(&dir.join(".forkfleet"));
    let http = Client::builder()
        .timeout(Duration::from_secs(120))
        .build()
        .unwrap();
    let (view, _) = create_from_spec(&http, &ui.base, &ui.token, &spec_path, None);
    let fork = view["fork_id"].as_str().unwrap().to_string();
    (ui, http, fork)
}

/// A fork of 1,000 branches (`b0000` to `b0999`, each with a steer) on the scripted model
/// `scripted:many` playing `script` (TOML), its workspace beside it under `dir`: the spec's
/// path.
fn thousand_branch_spec(dir: &std::path::Path, script: &str) -> std::path::PathBuf {
    std::fs::create_dir_all(dir.join("workspace")).unwrap();
    std::fs::write(dir.join("workspace/README.md"), "hi\n").unwrap();
    std::fs::write(dir.join("script.toml"), script).unwrap();
    let mut spec = String::from(
        "goal = \"many\"\nworkspace = \"workspace\"\nmodel = \"scripted:many\"\nmax_branches = 1000\n\n[models.\"scripted:many\"]\nscript = \"script.toml\"\nprice = { input_per_mtok = 0.15, output_per_mtok = 0.60 }\n",
    );
    for i in 0..1000 {
        spec.push_str(&format!(
            "\n[[branches]]\nlabel = \"b{i:04}\"\nsteer = \"try {i}\"\n"
        ));
    }
    let path = dir.join("fork.toml");
    std::fs::write(&path, spec).unwrap();
    path
}

/// Applies a fork stream's `delta` as the console does (http/src/console/app.js `patch`).
fn patch(target: &mut Value, d: &Value) {
    for (k, v) in d.as_object().unwrap() {
        match (k.as_str(), v) {
            ("branches", Value::Object(rows)) => {
                let list = target["branches"].as_array_mut().unwrap();
                for (i, row) in rows {
                    list[i.parse::<usize>().unwrap()] = row.clone();
                }
            }
            _ => target[k] = v.clone(),
        }
    }
}

/// A live fork of 1,000 branches streams its whole view once, then only what changes: the
/// deltas, applied in order, give the view the API serves at the end, and no event after the
/// first carries every row (a change of one branch is one row, not 1,000).
#[test]
fn a_thousand_branch_fork_streams_deltas_that_rebuild_its_view() {
    let dir = tempfile::tempdir().unwrap();
    // Turns that take a while, unevenly, so the fork changes over many events.
    let (ui, http, fork) = thousand_branch_fork(
        dir.path(),
        "[defaults]\nlatency_ms = 20\nlatency_jitter_ms = 400\n\n[[turns.\"*\"]]\ntool_calls = [{ name = \"write_file\", args = { path = \"{label}.txt\", content = \"x\" } }]\n\n[[turns.\"*\"]]\ntext = \"done {label}\"\n",
    );
    let resp = http
        .get(format!("{}/forks/{fork}/stream", ui.base))
        .bearer_auth(&ui.token)
        .send()
        .unwrap();
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    // Read on a thread, so that every wait here is bounded.
    let (tx, events) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut lines = BufReader::new(resp).lines();
        while let Some((_, name, data)) = try_next_event(&mut lines) {
            if tx.send((name, data)).is_err() {
                return;
            }
        }
    });
    let next = || events.recv_timeout(COMMAND_LIMIT).expect("a stream event");
    let (name, data) = next();
    assert_eq!(name, "fork", "a connection starts with the whole view");
    let mut doc: Value = serde_json::from_str(&data).unwrap();
    assert_eq!(doc["view"]["branches"].as_array().unwrap().len(), 1000);
    let (mut deltas, mut rows_sent, mut largest) = (0, 0, 0);
    while doc["view"]["state"]["state"] != "settled" {
        let (name, data) = next();
        assert_eq!(name, "delta", "{data}");
        let d: Value = serde_json::from_str(&data).unwrap();
        let rows = d["view"]["branches"].as_object().map_or(0, |r| r.len());
        rows_sent += rows;
        largest = largest.max(rows);
        deltas += 1;
        patch(&mut doc["view"], &d["view"]);
        patch(&mut doc["cost"], &d["cost"]);
        doc["version"] = d["version"].clone();
    }
    let get = |path: &str| -> Value {
        let text = http
            .get(format!("{}{path}", ui.base))
            .bearer_auth(&ui.token)
            .send()
            .unwrap()
            .text()
            .unwrap();
        serde_json::from_str(&text).unwrap()
    };
    assert_eq!(
        doc["view"],
        get(&format!("/forks/{fork}")),
        "the deltas did not rebuild the served view"
    );
    let cost = get(&format!("/forks/{fork}/cost"));
    assert_eq!(
        doc["cost"], cost,
        "the deltas did not rebuild the served cost"
    );
    assert!(
        deltas >= 2,
        "{deltas} deltas: the fork changed over too few events"
    );
    assert!(largest < 1000, "a delta carried every row: {largest}");
    eprintln!("stream: {deltas} deltas, {rows_sent} rows sent, largest {largest}");
    ui.stop();
}
