//! Secrets belong to workers (ADR 16), shown with real processes: a `nats-server`, a
//! `forkfleet coordinator` and a `forkfleet worker` whose environment holds an OpenAI key
//! and whose directory holds a password file. A capture server (a plain TCP listener that
//! records every connection) stands for an attacker's endpoint:
//!
//! - (a) a spec naming a key source (`api_key_env`, `api_key_file`) is refused at
//!   `fork create` (exit 2, the field named);
//! - (b) a spec whose own `base_url` points at the capture server, a host the worker does
//!   not allow, is refused at `fork create` against the catalogue the worker advertises;
//! - (c) the same plan created while no worker is live (the coordinator accepts it with a
//!   warning) fails its branch on the worker, with a clear error and no connection made;
//! - (d) a model of the worker's catalogue at a local OpenAI-wire server gets
//!   `Authorization: Bearer <the key>` and the branch finishes `done`.
//!
//! The capture server receives no connection at all, and the secrets appear in no output.

use super::fleet::{Fleet, Options, Service, COMMAND_LIMIT, POLL};
use super::harness::{branch, path_str, Example};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::Instant;

const SECRET_KEY: &str = "sk-secret-4f1c9a7be2d04c88";
const PASSWORD: &str = "nats-password-7d3e51a0c9";

/// A listener on 127.0.0.1 that records every connection (and what was sent on it).
struct Capture {
    url: String,
    seen: Arc<Mutex<Vec<String>>>,
}

impl Capture {
    fn start() -> Capture {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/v1", listener.local_addr().unwrap());
        let seen = Arc::new(Mutex::new(Vec::new()));
        let record = seen.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let mut text = String::new();
                let _ = stream.set_read_timeout(Some(std::time::Duration::from_secs(2)));
                let _ = (&stream).take(64 * 1024).read_to_string(&mut text);
                record.lock().unwrap().push(text);
            }
        });
        Capture { url, seen }
    }

    fn connections(&self) -> Vec<String> {
        self.seen.lock().unwrap().clone()
    }
}

/// A local OpenAI-wire server: answers every chat completion with a short text (no tool
/// calls, so a branch ends after one turn) and records each request's `authorization`.
struct OpenAiWire {
    url: String,
    authorizations: Arc<Mutex<Vec<Option<String>>>>,
}

impl OpenAiWire {
    fn start() -> OpenAiWire {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/v1", listener.local_addr().unwrap());
        let authorizations = Arc::new(Mutex::new(Vec::new()));
        let record = authorizations.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let record = record.clone();
                std::thread::spawn(move || answer(stream, &record));
            }
        });
        OpenAiWire {
            url,
            authorizations,
        }
    }
}

/// Read one HTTP request, record its authorization header, answer a chat completion.
fn answer(stream: TcpStream, record: &Mutex<Vec<Option<String>>>) {
    let mut reader = BufReader::new(&stream);
    let mut length = 0usize;
    let mut auth = None;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        let line = line.trim_end();
        if line.is_empty() {
            break;
        }
        if let Some((name, value)) = line.split_once(':') {
            match name.trim().to_ascii_lowercase().as_str() {
                "content-length" => length = value.trim().parse().unwrap_or(0),
                "authorization" => auth = Some(value.trim().to_string()),
                _ => {}
            }
        }
    }
    let mut body = vec![0u8; length];
    if reader.read_exact(&mut body).is_err() {
        return;
    }
    record.lock().unwrap().push(auth);
    let reply = serde_json::json!({
        "id": "c1", "object": "chat.completion", "model": "gpt-test",
        "choices": [{"index": 0, "finish_reason": "stop",
                     "message": {"role": "assistant", "content": "Done, nothing to change."}}],
        "usage": {"prompt_tokens": 50, "completion_tokens": 6, "total_tokens": 56},
    })
    .to_string();
    let _ = write!(
        &stream,
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{reply}",
        reply.len()
    );
}

/// A one-branch spec of `model` in the quickstart's workspace, with `section` as the
/// model's `[models."MODEL"]` keys.
fn spec(ex: &Example, name: &str, model: &str, section: &str) -> std::path::PathBuf {
    let text = format!(
        "goal = \"Look at the tool.\"\nworkspace = \"workspace\"\nmodel = \"{model}\"\nmax_turns = 2\n\
         [models.\"{model}\"]\n{section}\n[[branches]]\nlabel = \"only\"\n"
    );
    let p = ex.dir.path().join(name);
    std::fs::write(&p, text).unwrap();
    p
}

/// Until `forkfleet workers` lists `n` workers (bounded).
fn until_workers(fleet: &Fleet, n: usize) {
    let deadline = Instant::now() + COMMAND_LIMIT;
    loop {
        let listed = fleet.client(&["workers", "--json"]);
        if listed.code == Some(0) && listed.json().as_array().map(Vec::len) == Some(n) {
            return;
        }
        assert!(Instant::now() < deadline, "no worker\n{}", fleet.logs());
        std::thread::sleep(POLL);
    }
}

#[test]
fn a_spec_cannot_send_the_workers_secrets_anywhere() {
    let capture = Capture::start();
    let wire = OpenAiWire::start();
    let ex = Example::quickstart();
    let password_file = ex.dir.path().join("nats-password");
    std::fs::write(&password_file, format!("{PASSWORD}\n")).unwrap();
    // No worker yet: the coordinator cannot check, and the worker will.
    let mut fleet = Fleet::start(0, 1, Options::default());
    let mut outputs = String::new();

    // (a) A key source in a spec: refused by `fork create`, the field named.
    for (field, line) in [
        (
            "api_key_env",
            "api_key_env = \"OPENAI_API_KEY\"".to_string(),
        ),
        (
            "api_key_file",
            format!("api_key_file = \"{}\"", path_str(&password_file)),
        ),
    ] {
        let s = spec(
            &ex,
            &format!("{field}.toml"),
            "openai:gpt-test",
            &format!("base_url = \"{}\"\n{line}", capture.url),
        );
        let out = fleet.client(&["fork", "create", path_str(&s)]);
        assert_eq!(out.code, Some(2), "{}", out.stderr);
        for says in [
            format!("{field} is not allowed in a spec"),
            "key sources belong to the workers' catalogue".to_string(),
            "[models.\"openai:gpt-test\"]".to_string(),
        ] {
            assert!(out.stderr.contains(&says), "{says:?} not in {}", out.stderr);
        }
        outputs.push_str(&out.stdout);
        outputs.push_str(&out.stderr);
    }

    // (c) The capture server's URL as the spec's own base_url, created while no worker is
    // live: accepted (start order must not matter) ...
    let exfil = spec(
        &ex,
        "exfil.toml",
        "openai:gpt-test",
        &format!("base_url = \"{}\"", capture.url),
    );
    let unchecked = fleet.create(&exfil);
    // ... the worker starts, with the key in its environment and a catalogue ...
    let catalogue = format!(
        "\"openai:catalogued\" = {{ base_url = \"{}\", api_key_env = \"OPENAI_API_KEY\", model = \"gpt-test\" }}",
        wire.url
    );
    let env = [
        ("OPENAI_API_KEY", SECRET_KEY),
        ("FORKFLEET_MODELS", catalogue.as_str()),
        ("FORKFLEET_ALLOWED_MODEL_HOSTS", "llm.internal:8080"),
    ];
    let url = fleet.nats.url();
    let worker = Service::spawn_env(
        "worker-0",
        &["worker", "--nats", &url, "--concurrency", "2"],
        fleet.dir.path(),
        &env,
    );
    fleet.workers.push(worker);
    // ... and fails the branch without connecting anywhere.
    let watched = fleet.watch(&unchecked);
    let only = branch(&watched, "only");
    assert_eq!(only["state"], "failed", "{watched}\n{}", fleet.logs());
    let error = only["error"].as_str().unwrap_or_default();
    let host = capture
        .url
        .trim_start_matches("http://")
        .trim_end_matches("/v1");
    for says in [
        "refused by the worker's model catalogue",
        "model `openai:gpt-test`",
        &format!("host `{host}`"),
        "allowed: llm.internal:8080",
    ] {
        assert!(error.contains(says), "{says:?} not in {error}");
    }
    outputs.push_str(&watched.to_string());

    // (b) The same spec with the worker live: refused at `fork create`, against the
    // catalogue the worker advertises.
    until_workers(&fleet, 1);
    let out = fleet.client(&["fork", "create", path_str(&exfil)]);
    assert_eq!(out.code, Some(2), "{}\n{}", out.stderr, fleet.logs());
    for says in [
        "model `openai:gpt-test`",
        &format!("host `{host}`"),
        "allowed: llm.internal:8080",
        "[model_hosts] allow",
    ] {
        assert!(out.stderr.contains(says), "{says:?} not in {}", out.stderr);
    }
    outputs.push_str(&out.stderr);
    // A model no worker offers, too.
    let unknown = spec(&ex, "unknown.toml", "openai:gpt-other", "");
    let out = fleet.client(&["fork", "create", path_str(&unknown)]);
    assert_eq!(out.code, Some(2), "{}", out.stderr);
    assert!(
        out.stderr
            .contains("model `openai:gpt-other` is not in the model catalogue of any live worker of pool `default` (offered: openai:catalogued)"),
        "{}",
        out.stderr
    );
    outputs.push_str(&out.stderr);

    // (d) A catalogue model: the worker sends its key to the catalogue's server only.
    let good = spec(&ex, "good.toml", "openai:catalogued", "");
    let id = fleet.create(&good);
    let watched = fleet.watch(&id);
    assert_eq!(
        branch(&watched, "only")["state"],
        "done",
        "{watched}\n{}",
        fleet.logs()
    );
    // A resolve that needs a judge, with none in the spec or on the command line: the
    // default judge is the fork's own model, which the worker offers (its answer is not a
    // verdict, so nothing is merged).
    let judged = fleet.client(&[
        "fork",
        "resolve",
        &id,
        "--strategy",
        "auto",
        "--no-apply",
        "--json",
    ]);
    let report: serde_json::Value = serde_json::from_str(&judged.stdout).unwrap_or_default();
    assert_eq!(
        report["judges"][0]["run"]["model"], "openai:catalogued",
        "{}\n{}",
        judged.stdout, judged.stderr
    );
    outputs.push_str(&judged.stdout);
    outputs.push_str(&judged.stderr);
    let auths = wire.authorizations.lock().unwrap().clone();
    assert!(!auths.is_empty());
    for a in &auths {
        assert_eq!(a.as_deref(), Some(format!("Bearer {SECRET_KEY}").as_str()));
    }
    // `forkfleet workers` shows what the worker offers, never where its key is.
    let workers = fleet.client(&["workers", "--json"]);
    let listed = workers.json();
    assert_eq!(
        listed[0]["models"][0]["name"], "openai:catalogued",
        "{listed}"
    );
    assert_eq!(listed[0]["models"][0]["base_url"], wire.url.as_str());
    assert_eq!(listed[0]["allowed_model_hosts"][0], "llm.internal:8080");
    assert!(
        !workers.stdout.contains("OPENAI_API_KEY"),
        "{}",
        workers.stdout
    );
    outputs.push_str(&workers.stdout);

    // Nothing ever reached the capture server; no secret in any output or log.
    assert_eq!(capture.connections(), Vec::<String>::new());
    let everything = format!("{outputs}\n{}", fleet.logs());
    for secret in [SECRET_KEY, PASSWORD] {
        assert!(
            !everything.contains(secret),
            "{secret} leaked:\n{everything}"
        );
    }
}
