//! OTLP trace export end to end: real `forkfleet` processes export to a real OTLP/HTTP
//! receiver (`tests/otlp_receiver.py`, on PyPI's `opentelemetry-proto`, which
//! scripts/setup installs), which writes every span it receives as a JSON line. The span
//! names and attributes asserted are those of docs/OBSERVABILITY.md, "Traces".

use super::fleet::{self, wait_bounded, Service, COMMAND_LIMIT, POLL, SERVICE_LIMIT};
use super::harness::{command, forkfleet_env, json, path_str, writes_then_done, Example};
use forkfleet_bus::testkit::NatsServer;
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::io::BufRead as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

/// Text of the spec's goal and steers: prompt text, which no span may carry by default.
const PROMPT_TEXT: &str = "PROMPT-SENTINEL-7f3a";

/// The receiver: a python process, its port, the file it writes; killed on drop.
struct Receiver {
    child: Child,
    port: u16,
    out: PathBuf,
    _dir: tempfile::TempDir,
}

impl Receiver {
    /// Start `tests/otlp_receiver.py` with `$FORKFLEET_PYTHON` (else `python3`) and read
    /// its port.
    fn start() -> Receiver {
        Self::start_with(&[])
    }

    /// [`Receiver::start`] with the receiver's options (`--tls CERT KEY`, ...).
    fn start_with(options: &[&str]) -> Receiver {
        let python = std::env::var("FORKFLEET_PYTHON").unwrap_or_else(|_| "python3".into());
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("otlp.jsonl");
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/otlp_receiver.py");
        let mut child = std::process::Command::new(&python)
            .arg(&script)
            .args(options)
            .arg(&out)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {python} (run scripts/setup): {e}"));
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let port = line.trim().parse().unwrap_or_else(|_| {
            let _ = child.kill();
            panic!(
                "the OTLP receiver did not start (is opentelemetry-proto installed for {python}? run scripts/setup): `{line}`"
            )
        });
        Receiver {
            child,
            port,
            out,
            _dir: dir,
        }
    }

    /// The base endpoint, for `OTEL_EXPORTER_OTLP_ENDPOINT`.
    fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Everything received so far, as written.
    fn text(&self) -> String {
        std::fs::read_to_string(&self.out).unwrap_or_default()
    }

    /// The spans received so far.
    fn spans(&self) -> Vec<Value> {
        self.text()
            .lines()
            .map(|l| serde_json::from_str::<Value>(l).unwrap())
            .filter(|v| v["signal"] == "span")
            .collect()
    }
}

impl Receiver {
    /// The metrics received so far (one line per metric per export).
    fn metrics(&self) -> Vec<Value> {
        self.text()
            .lines()
            .map(|l| serde_json::from_str::<Value>(l).unwrap())
            .filter(|v| v["signal"] == "metric")
            .collect()
    }
}

/// The string value of attribute `key` of an OTLP data point (protobuf's JSON mapping).
fn point_label<'a>(point: &'a Value, key: &str) -> Option<&'a str> {
    point["attributes"]
        .as_array()?
        .iter()
        .find(|kv| kv["key"] == key)?["value"]["stringValue"]
        .as_str()
}

impl Drop for Receiver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Until `n` workers are listed on the cluster at `url` (bounded; `logs` says why not).
fn wait_for_workers(dir: &Path, url: &str, n: usize, logs: impl Fn() -> String) {
    let deadline = Instant::now() + COMMAND_LIMIT;
    loop {
        let listed = fleet::run(dir, &["workers", "--json", "--nats", url]);
        if listed.code == Some(0) && listed.json().as_array().map(Vec::len) == Some(n) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the fleet did not come up\n{}",
            logs()
        );
        std::thread::sleep(POLL);
    }
}

/// The spans by span id.
fn by_id(spans: &[Value]) -> BTreeMap<String, &Value> {
    spans
        .iter()
        .map(|s| (s["span_id"].as_str().unwrap().to_string(), s))
        .collect()
}

/// The names of `span`'s ancestors among `spans`, nearest first.
fn ancestors<'a>(span: &Value, ids: &BTreeMap<String, &'a Value>) -> Vec<&'a Value> {
    let mut out = Vec::new();
    let mut parent = span["parent_span_id"].as_str().unwrap().to_string();
    while let Some(p) = ids.get(&parent) {
        out.push(*p);
        parent = p["parent_span_id"].as_str().unwrap().to_string();
    }
    out
}

fn named<'a>(spans: &'a [Value], prefix: &str) -> Vec<&'a Value> {
    spans
        .iter()
        .filter(|s| s["name"].as_str().unwrap().starts_with(prefix))
        .collect()
}

fn dump(spans: &[Value]) -> String {
    spans
        .iter()
        .map(|s| {
            format!(
                "{} {} <- {} {}",
                s["span_id"], s["name"], s["parent_span_id"], s["attributes"]
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// A spec of `labels` branches in `ex` playing a script of one `write_file` tool call and
/// an answer, with usage (100 input and 10 output tokens a call) and `latency_ms` a call;
/// its goal and steers hold [`PROMPT_TEXT`].
fn traced_spec(ex: &Example, labels: &[&str], latency_ms: u64) -> PathBuf {
    std::fs::write(
        ex.dir.path().join("traced.toml"),
        writes_then_done(latency_ms, true, "traced/{label}.md", "x\\n", 1),
    )
    .unwrap();
    let mut spec = format!(
        "goal = \"{PROMPT_TEXT} goal\"\nworkspace = \"workspace\"\nmodel = \"scripted:traced\"\nmax_turns = 5\n\
         [models.\"scripted:traced\"]\nscript = \"traced.toml\"\n"
    );
    for label in labels {
        spec.push_str(&format!(
            "[[branches]]\nlabel = \"{label}\"\nsteer = \"{PROMPT_TEXT} steer {label}\"\n"
        ));
    }
    ex.write_spec(&spec)
}

/// The spans of the trace of the (one) `fork.create` span among `all`, after checking that
/// every branch span (`invoke_agent`, `branch.*`, `chat`, `execute_tool`) is in it: the
/// client's own requests (`fork.diff`, `fork watch`'s polls) are traces of their own.
fn fork_trace(all: &[Value]) -> Vec<Value> {
    let creates = named(all, "fork.create");
    assert_eq!(creates.len(), 1, "one fork.create span:\n{}", dump(all));
    let trace = &creates[0]["trace_id"];
    for s in all {
        let name = s["name"].as_str().unwrap();
        if ["invoke_agent", "branch.", "chat ", "execute_tool"]
            .iter()
            .any(|p| name.starts_with(p))
        {
            assert_eq!(
                &s["trace_id"], trace,
                "a branch span outside the fork's trace: {s}"
            );
        }
    }
    all.iter()
        .filter(|s| &s["trace_id"] == trace)
        .cloned()
        .collect()
}

/// What every fork's spans must show, whichever processes ran it: one trace; for each
/// branch label an `invoke_agent {label}` span under `root` (when given), with a `chat`
/// span under one of its turns carrying the GenAI attributes and the script's token
/// counts, and an `execute_tool write_file` span under it; `fork.id` on every span of the
/// fork. Returns the `invoke_agent` spans.
fn assert_fork_trace<'a>(
    spans: &'a [Value],
    labels: &[&str],
    root: Option<&str>,
) -> Vec<&'a Value> {
    let traces: BTreeSet<&str> = spans
        .iter()
        .map(|s| s["trace_id"].as_str().unwrap())
        .collect();
    assert_eq!(
        traces.len(),
        1,
        "one trace for the whole fork:\n{}",
        dump(spans)
    );
    let trace = traces.iter().next().unwrap();
    assert_eq!(trace.len(), 32);
    let ids = by_id(spans);
    let mut agents = Vec::new();
    for label in labels {
        let name = format!("invoke_agent {label}");
        let agent = spans
            .iter()
            .find(|s| s["name"] == name.as_str())
            .unwrap_or_else(|| panic!("no `{name}` span:\n{}", dump(spans)));
        let a = &agent["attributes"];
        assert_eq!(a["gen_ai.operation.name"], "invoke_agent", "{agent}");
        assert_eq!(a["gen_ai.agent.name"], *label, "{agent}");
        assert_eq!(a["branch.label"], *label, "{agent}");
        assert!(a["branch.id"].is_string(), "{agent}");
        assert!(a["fork.id"].is_string(), "{agent}");
        assert_eq!(a["gen_ai.provider.name"], "forkfleet.scripted", "{agent}");
        assert_eq!(a["gen_ai.agent.id"], a["branch.id"], "{agent}");
        assert_eq!(a["gen_ai.conversation.id"], a["branch.id"], "{agent}");
        if let Some(root) = root {
            assert!(
                ancestors(agent, &ids).iter().any(|p| p["name"] == root),
                "`{name}` is not under `{root}`:\n{}",
                dump(spans)
            );
        }
        let under_agent = |s: &&Value| {
            ancestors(s, &ids)
                .iter()
                .any(|p| p["span_id"] == agent["span_id"])
        };
        let chats: Vec<&Value> = named(spans, "chat ")
            .into_iter()
            .filter(under_agent)
            .collect();
        assert!(
            !chats.is_empty(),
            "no chat span under `{name}`:\n{}",
            dump(spans)
        );
        for chat in &chats {
            let c = &chat["attributes"];
            assert_eq!(chat["name"], "chat traced", "{chat}");
            assert_eq!(c["gen_ai.operation.name"], "chat", "{chat}");
            assert_eq!(c["gen_ai.request.model"], "traced", "{chat}");
            assert_eq!(c["gen_ai.provider.name"], "forkfleet.scripted", "{chat}");
            assert!(c["gen_ai.provider.name"].is_string(), "{chat}");
            assert_eq!(c["gen_ai.usage.input_tokens"], 100, "{chat}");
            assert_eq!(c["gen_ai.usage.output_tokens"], 10, "{chat}");
            assert!(c["gen_ai.response.finish_reasons"].is_array(), "{chat}");
            assert_eq!(c["fork.id"], a["fork.id"], "{chat}");
            assert_eq!(c["branch.id"], a["branch.id"], "{chat}");
            assert_eq!(c["gen_ai.conversation.id"], a["branch.id"], "{chat}");
            // The scripted model runs in the worker: no server to name.
            assert!(c["server.address"].is_null(), "{chat}");
            let parent = ids
                .get(chat["parent_span_id"].as_str().unwrap())
                .unwrap_or_else(|| panic!("the parent of {chat} did not arrive"));
            assert_eq!(parent["name"], "branch.turn", "{chat}");
        }
        let tools: Vec<&Value> = named(spans, "execute_tool ")
            .into_iter()
            .filter(under_agent)
            .collect();
        assert_eq!(
            tools.len(),
            1,
            "one tool call under `{name}`:\n{}",
            dump(spans)
        );
        let t = &tools[0]["attributes"];
        assert_eq!(tools[0]["name"], "execute_tool write_file");
        assert_eq!(t["gen_ai.operation.name"], "execute_tool");
        assert_eq!(t["gen_ai.tool.name"], "write_file");
        assert!(t["gen_ai.tool.call.id"].is_string(), "{}", tools[0]);
        assert_eq!(t["fork.id"], a["fork.id"]);
        agents.push(agent);
    }
    // Every span of the fork names it (not those of the request or command that asked
    // for it, which start its trace).
    let fork = agents[0]["attributes"]["fork.id"].clone();
    for s in spans {
        let name = s["name"].as_str().unwrap();
        if name != "api.request" && !name.starts_with("forkfleet ") {
            assert_eq!(
                s["attributes"]["fork.id"], fork,
                "a span without fork.id: {s}"
            );
        }
    }
    agents
}

#[test]
fn an_embedded_run_exports_all_its_spans_before_it_exits() {
    let receiver = Receiver::start();
    let ex = Example::quickstart();
    let spec = traced_spec(&ex, &["a", "b"], 0);
    let out = forkfleet_env(
        &["run", path_str(&spec), "--json", "--timeout-s", "120"],
        &[("OTEL_EXPORTER_OTLP_ENDPOINT", &receiver.endpoint())],
    );
    let doc = json(&out);
    for b in doc["branches"].as_array().unwrap() {
        assert_eq!(b["state"], "done", "{doc}");
    }
    // The process has exited: whatever it flushed is in the file, nothing is waited for.
    let spans = receiver.spans();
    for s in &spans {
        assert_eq!(s["resource"]["service.name"], "forkfleet", "{s}");
        assert!(s["resource"]["service.version"].is_string(), "{s}");
    }
    assert_fork_trace(&fork_trace(&spans), &["a", "b"], Some("fork.create"));
    assert!(
        !receiver.text().contains(PROMPT_TEXT),
        "prompt text was exported without capture enabled"
    );
}

#[test]
fn prompt_text_is_exported_only_when_capture_is_enabled() {
    let receiver = Receiver::start();
    let ex = Example::quickstart();
    let spec = traced_spec(&ex, &["a"], 0);
    let out = forkfleet_env(
        &["run", path_str(&spec), "--json", "--timeout-s", "120"],
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", &receiver.endpoint()),
            ("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", "true"),
        ],
    );
    json(&out);
    let spans = receiver.spans();
    let chat = named(&spans, "chat ")
        .into_iter()
        .next()
        .unwrap_or_else(|| panic!("no chat span:\n{}", dump(&spans)));
    let input = chat["attributes"]["gen_ai.input.messages"].to_string();
    assert!(input.contains(PROMPT_TEXT), "{chat}");
}

#[test]
fn a_fork_over_nats_is_one_trace_across_the_coordinator_and_two_workers() {
    let receiver = Receiver::start();
    let endpoint = receiver.endpoint();
    let nats = NatsServer::start();
    let url = nats.url();
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("coordinator-data");
    // Metrics every second (the default is a minute).
    let env = [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
        ("OTEL_METRIC_EXPORT_INTERVAL", "1000"),
    ];
    let mut coordinator = Service::spawn_env(
        "coordinator",
        &["coordinator", "--nats", &url, "--data", path_str(&data)],
        dir.path(),
        &env,
    );
    // One slot each and branches that take a while: both workers get some.
    let mut workers: Vec<Service> = (0..2)
        .map(|i| {
            Service::spawn_env(
                &format!("worker-{i}"),
                &["worker", "--nats", &url, "--concurrency", "1"],
                dir.path(),
                &env,
            )
        })
        .collect();
    let logs = |c: &Service, w: &[Service]| {
        let mut out = format!("coordinator:\n{}\n", c.log());
        for s in w {
            out.push_str(&format!("{}:\n{}\n", s.name, s.log()));
        }
        out
    };
    wait_for_workers(dir.path(), &url, 2, || logs(&coordinator, &workers));

    let ex = Example::quickstart();
    let labels = ["a", "b", "c", "d"];
    let spec = traced_spec(&ex, &labels, 200);
    let created = fleet::run(
        dir.path(),
        &["fork", "create", path_str(&spec), "--json", "--nats", &url],
    )
    .json();
    let id = created["fork_id"].as_str().unwrap().to_string();
    let watched = fleet::run(
        dir.path(),
        &[
            "fork",
            "watch",
            &id,
            "--json",
            "--timeout-s",
            "50",
            "--nats",
            &url,
        ],
    )
    .json();
    for label in labels {
        let b = super::harness::branch(&watched, label);
        assert_eq!(b["state"], "done", "{}", logs(&coordinator, &workers));
    }
    let cost = fleet::run(dir.path(), &["fork", "cost", &id, "--json", "--nats", &url]).json();
    let spent = cost["spent_usd"].as_f64().unwrap();
    let full_id = cost["fork_id"].as_str().unwrap().to_string();
    // Metrics go the same way, every second: the coordinator's spend gauge of the fork and
    // the GenAI token histograms of both workers.
    let spend_of = |metrics: &[Value]| {
        metrics
            .iter()
            .filter(|m| m["name"] == "forkfleet.fork.spent_usd")
            .filter(|m| m["resource"]["service.name"] == "forkfleet-coordinator")
            .flat_map(|m| m["data"]["gauge"]["dataPoints"].as_array().unwrap().clone())
            .filter(|p| point_label(p, "fork.id") == Some(full_id.as_str()))
            .filter_map(|p| p["asDouble"].as_f64())
            .any(|v| (v - spent).abs() < 1e-9)
    };
    let token_instances = |metrics: &[Value]| {
        metrics
            .iter()
            .filter(|m| m["name"] == "gen_ai.client.token.usage")
            .filter(|m| m["resource"]["service.name"] == "forkfleet-worker")
            .filter(|m| {
                m["data"]["histogram"]["dataPoints"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|p| point_label(p, "gen_ai.request.model") == Some("traced"))
            })
            .map(|m| m["resource"]["service.instance.id"].to_string())
            .collect::<BTreeSet<_>>()
            .len()
    };
    let deadline = Instant::now() + COMMAND_LIMIT;
    loop {
        let metrics = receiver.metrics();
        if spend_of(&metrics) && token_instances(&metrics) == 2 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no spend {spent} of {full_id}, or token usage not from both workers: {metrics:#?}"
        );
        std::thread::sleep(POLL);
    }
    // Clean shutdowns flush what each service still holds.
    for w in &mut workers {
        assert!(w.terminate().success());
    }
    assert!(coordinator.terminate().success());

    let all = receiver.spans();
    // The fork's own spans (the fleet's start-up requests are other traces).
    let spans = fork_trace(&all);
    let create = spans.iter().find(|s| s["name"] == "fork.create").unwrap();
    assert_eq!(create["resource"]["service.name"], "forkfleet-coordinator");
    assert_eq!(create["attributes"]["fork.id"], id.as_str());
    let agents = assert_fork_trace(&spans, &labels, Some("fork.create"));
    // Branch spans come from the two worker processes.
    let instances: BTreeSet<String> = agents
        .iter()
        .map(|a| {
            assert_eq!(a["resource"]["service.name"], "forkfleet-worker", "{a}");
            a["resource"]["service.instance.id"].to_string()
        })
        .collect();
    assert_eq!(
        instances.len(),
        2,
        "branches ran on both workers: {instances:?}"
    );
    assert!(
        !receiver.text().contains(PROMPT_TEXT),
        "prompt text was exported without capture enabled"
    );
}

/// A collector that accepts connections and never answers: holds every socket it accepts
/// until dropped.
struct Silent {
    port: u16,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// Connections accepted so far.
    accepted: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl Silent {
    fn start() -> Silent {
        use std::sync::atomic::{AtomicBool, Ordering};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        listener.set_nonblocking(true).unwrap();
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let accepted = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (stopped, count) = (stop.clone(), accepted.clone());
        // Non-blocking, so the thread sees `stop`; idle between tries.
        std::thread::spawn(move || {
            let mut held = Vec::new();
            while !stopped.load(Ordering::SeqCst) {
                match listener.accept() {
                    Ok((socket, _)) => {
                        held.push(socket);
                        count.fetch_add(1, Ordering::SeqCst);
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(20)),
                }
            }
        });
        Silent {
            port,
            stop,
            accepted,
        }
    }
}

impl Drop for Silent {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

#[test]
fn a_collector_that_never_answers_delays_no_fork_and_is_reported_once() {
    let silent = Silent::start();
    let ex = Example::quickstart();
    let spec = traced_spec(&ex, &["a", "b"], 0);
    let dir = tempfile::tempdir().unwrap();
    let (out_path, err_path) = (dir.path().join("out"), dir.path().join("err"));
    let mut child = command()
        .args(["run", path_str(&spec), "--json", "--timeout-s", "120"])
        .env(
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            format!("http://127.0.0.1:{}", silent.port),
        )
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out_path).unwrap())
        .stderr(std::fs::File::create(&err_path).unwrap())
        .spawn()
        .unwrap();
    // Generous: the run takes well under a second, the exit flush is bounded at 5 s.
    let status = wait_bounded(&mut child, SERVICE_LIMIT);
    if status.is_none() {
        let _ = child.kill();
        let _ = child.wait();
    }
    let stdout = std::fs::read_to_string(&out_path).unwrap();
    let stderr = std::fs::read_to_string(&err_path).unwrap();
    assert!(status.is_some(), "the run did not exit\n{stderr}");
    assert_eq!(status.unwrap().code(), Some(0), "{stderr}");
    let doc: Value = serde_json::from_str(&stdout).unwrap();
    for b in doc["branches"].as_array().unwrap() {
        assert_eq!(b["state"], "done", "{doc}");
    }
    // The exporter did reach the collector (else nothing here was tested), and was held.
    assert!(
        silent.accepted.load(std::sync::atomic::Ordering::SeqCst) >= 1,
        "the exporter never connected to the silent collector\n{stderr}"
    );
    let warnings = stderr
        .lines()
        .filter(|l| l.contains("cannot export spans"))
        .count();
    assert!(warnings <= 1, "more than one export warning:\n{stderr}");
    assert_eq!(
        stderr.lines().filter(|l| l.contains("WARN")).count(),
        warnings,
        "other warnings:\n{stderr}"
    );
}

#[test]
fn json_logs_are_one_object_a_line_with_the_trace_id_inside_a_fork() {
    let ex = Example::quickstart();
    let spec = traced_spec(&ex, &["a"], 0);
    let out = command()
        .args([
            "run",
            path_str(&spec),
            "--json",
            "--timeout-s",
            "120",
            "--log-format",
            "json",
            "-v",
        ])
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    json(&out);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<Value> = stderr
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not a JSON line ({e}): {l}")))
        .collect();
    assert!(!lines.is_empty());
    for l in &lines {
        assert!(l["timestamp"].is_string(), "{l}");
        assert!(l["level"].is_string(), "{l}");
        assert!(l["target"].is_string(), "{l}");
    }
    let in_fork = lines
        .iter()
        .find(|l| {
            l["spans"]
                .as_array()
                .is_some_and(|s| s.iter().any(|s| s["fork.id"].is_string()))
        })
        .unwrap_or_else(|| panic!("no line inside a fork's span:\n{stderr}"));
    let trace = in_fork["trace_id"].as_str().unwrap_or_default();
    assert_eq!(trace.len(), 32, "{in_fork}");
    assert!(trace.bytes().all(|b| b.is_ascii_hexdigit()), "{in_fork}");
    assert_ne!(trace, "0".repeat(32), "{in_fork}");
    assert_eq!(
        in_fork["span_id"].as_str().map(str::len),
        Some(16),
        "{in_fork}"
    );
}

/// Under `--log-format json` stderr holds nothing but JSON lines: `run`'s progress (no
/// `--json`, at the default log level) is log lines of `forkfleet::progress`, a branch's
/// state change with its figures as fields, and the error a command ends with is an ERROR
/// line with its exit code.
#[test]
fn under_json_logs_progress_and_the_fatal_error_are_json_lines_too() {
    let ex = Example::quickstart();
    let spec = traced_spec(&ex, &["a"], 0);
    let lines_of = |out: &std::process::Output| -> Vec<Value> {
        String::from_utf8_lossy(&out.stderr)
            .lines()
            .map(|l| {
                serde_json::from_str(l).unwrap_or_else(|e| panic!("not a JSON line ({e}): {l}"))
            })
            .collect()
    };
    let out = command()
        .args([
            "run",
            path_str(&spec),
            "--timeout-s",
            "120",
            "--log-format",
            "json",
        ])
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let lines = lines_of(&out);
    let progress: Vec<&Value> = lines
        .iter()
        .filter(|l| l["target"] == "forkfleet::progress")
        .collect();
    assert!(
        progress
            .iter()
            .any(|l| l["message"].as_str().unwrap().starts_with("fork ")),
        "{lines:?}"
    );
    let done = progress
        .iter()
        .find(|l| l["fields"]["state"] == "done")
        .unwrap_or_else(|| panic!("no state change of branch a: {lines:?}"));
    assert_eq!(done["fields"]["label"], "a", "{done}");
    assert_eq!(done["level"], "INFO");
    assert!(done["fields"]["cost_usd"].is_number(), "{done}");
    // In the command's span: its trace id on the line.
    assert_eq!(done["trace_id"].as_str().map(str::len), Some(32), "{done}");

    let failed = command()
        .args(["run", "no-such-spec.toml", "--log-format", "json"])
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    assert_eq!(failed.status.code(), Some(2), "{failed:?}");
    let lines = lines_of(&failed);
    let error = lines
        .iter()
        .find(|l| l["level"] == "ERROR")
        .unwrap_or_else(|| panic!("no ERROR line: {lines:?}"));
    assert!(
        error["message"].as_str().unwrap().starts_with("error: ")
            && error["message"]
                .as_str()
                .unwrap()
                .contains("no-such-spec.toml"),
        "{error}"
    );
    assert_eq!(error["fields"]["exit_code"], 2, "{error}");
}

/// A collector over HTTPS that asks for a client certificate: spans reach it with
/// `OTEL_EXPORTER_OTLP_CERTIFICATE` (its CA) and the client certificate and key; without
/// the client certificate, or without the CA, none do, the run still succeeds and the
/// failure is reported once.
#[test]
fn spans_reach_a_collector_over_mutual_tls_with_the_otlp_certificate_variables() {
    let certs = super::cluster_tls::Certs::make();
    let path = |n: &str| certs.path(n).display().to_string();
    let (server, key, ca) = (path("server.pem"), path("server.key"), path("ca.pem"));
    let receiver = Receiver::start_with(&["--tls", &server, &key, "--client-ca", &ca]);
    let endpoint = format!("https://127.0.0.1:{}", receiver.port);
    let ex = Example::quickstart();
    let spec = traced_spec(&ex, &["a"], 0);
    let run = |env: &[(&str, &str)]| {
        let mut all = vec![("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str())];
        all.extend_from_slice(env);
        let out = forkfleet_env(
            &["run", path_str(&spec), "--json", "--timeout-s", "120"],
            &all,
        );
        assert!(out.status.success(), "{out:?}");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let (client, client_key) = (path("client.pem"), path("client.key"));
    let said = run(&[
        ("OTEL_EXPORTER_OTLP_CERTIFICATE", &ca),
        ("OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE", &client),
        ("OTEL_EXPORTER_OTLP_CLIENT_KEY", &client_key),
    ]);
    assert!(!said.contains("cannot export"), "{said}");
    let spans = receiver.spans();
    assert_fork_trace(&fork_trace(&spans), &["a"], Some("fork.create"));
    let received = spans.len();

    for (what, env) in [
        (
            "no client certificate",
            vec![("OTEL_EXPORTER_OTLP_CERTIFICATE", ca.as_str())],
        ),
        (
            "no CA",
            vec![
                ("OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE", client.as_str()),
                ("OTEL_EXPORTER_OTLP_CLIENT_KEY", client_key.as_str()),
            ],
        ),
    ] {
        let said = run(&env);
        assert_eq!(
            said.matches("cannot export spans").count(),
            1,
            "{what}: reported once\n{said}"
        );
        assert_eq!(receiver.spans().len(), received, "{what}: nothing arrived");
    }
    // A certificate without its key is a configuration error naming the missing one.
    let out = forkfleet_env(
        &["worker", "--print-config"],
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
            ("OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE", client.as_str()),
        ],
    );
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("OTEL_EXPORTER_OTLP_CLIENT_KEY"),
        "{out:?}"
    );
}

#[test]
fn print_config_shows_the_telemetry_settings_with_headers_redacted() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("forkfleet.toml");
    std::fs::write(
        &file,
        "[telemetry]\notlp_endpoint = \"http://collector:4318\"\nservice_name = \"from-file\"\n\
         otlp_headers = { \"x-api-key\" = \"file-secret-123\" }\n",
    )
    .unwrap();
    let out = forkfleet_env(
        &[
            "worker",
            "--config",
            path_str(&file),
            "--print-config",
            "--log-format",
            "json",
        ],
        &[
            ("OTEL_EXPORTER_OTLP_HEADERS", "x-team=env-secret-456"),
            ("OTEL_TRACES_SAMPLER", "parentbased_traceidratio"),
            ("OTEL_TRACES_SAMPLER_ARG", "0.25"),
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        !text.contains("secret-123") && !text.contains("secret-456"),
        "{text}"
    );
    for expected in [
        "otlp_endpoint = \"http://collector:4318\"",
        "# traces are exported to http://collector:4318/v1/traces",
        "\"x-api-key\" = \"<redacted>\"",
        "\"x-team\" = \"<redacted>\"",
        "x-team: environment variable OTEL_EXPORTER_OTLP_HEADERS",
        "service_name = \"from-file\"",
        "sampler = \"parentbased_traceidratio 0.25\"  # environment variable OTEL_TRACES_SAMPLER",
        "log_format = \"json\"  # flag --log-format",
    ] {
        assert!(text.contains(expected), "no `{expected}` in:\n{text}");
    }
    // A bad value names what is valid.
    let bad = forkfleet_env(
        &["worker", "--print-config"],
        &[("OTEL_EXPORTER_OTLP_PROTOCOL", "http/xml")],
    );
    assert_eq!(bad.status.code(), Some(2));
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(err.contains("grpc or http/protobuf"), "{err}");
    let bad = forkfleet_env(
        &["worker", "--print-config"],
        &[("OTEL_TRACES_SAMPLER", "sometimes")],
    );
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(
        err.contains("`sometimes`") && err.contains("parentbased_always_on"),
        "{err}"
    );
}

#[test]
fn a_grpc_exporter_without_a_collector_is_reported_once_and_the_fork_finishes() {
    // A port nobody listens on.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let ex = Example::quickstart();
    let spec = traced_spec(&ex, &["a"], 0);
    let endpoint = format!("http://127.0.0.1:{port}");
    let out = forkfleet_env(
        &["run", path_str(&spec), "--json", "--timeout-s", "120"],
        &[
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
            ("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint),
        ],
    );
    let doc = json(&out);
    assert_eq!(doc["branches"][0]["state"], "done", "{doc}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let warnings: Vec<&str> = stderr.lines().filter(|l| l.contains("WARN")).collect();
    assert_eq!(warnings.len(), 1, "{stderr}");
    assert!(warnings[0].contains("cannot export spans"), "{stderr}");
    assert!(warnings[0].contains(&endpoint), "{stderr}");
}

/// A trace starts where the user acts: a client command is a span (`forkfleet fork
/// create`, the child of `TRACEPARENT` when the environment has one), an HTTP call is a
/// span (`POST /api/v1/forks/from-spec`, the child of its `traceparent` header), and the
/// coordinator's and the workers' spans of what each asked continue that trace: the
/// `fork.create` and every branch's `invoke_agent` are in it, under it. Whether it is
/// recorded is the coordinator's decision, not the caller's flag.
#[test]
fn a_client_command_and_an_http_call_each_start_the_trace_the_services_continue() {
    let receiver = Receiver::start();
    let endpoint = receiver.endpoint();
    let nats = NatsServer::start();
    let url = nats.url();
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("coordinator-data");
    let http_port = forkfleet_bus::testkit::free_port();
    let http_addr = format!("127.0.0.1:{http_port}");
    let env = [("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str())];
    let mut coordinator = Service::spawn_env(
        "coordinator",
        &[
            "coordinator",
            "--nats",
            &url,
            "--data",
            path_str(&data),
            "--http-addr",
            &http_addr,
        ],
        dir.path(),
        &env,
    );
    let mut worker = Service::spawn_env(
        "worker",
        &["worker", "--nats", &url, "--concurrency", "4"],
        dir.path(),
        &env,
    );
    wait_for_workers(dir.path(), &url, 1, || {
        format!("{}\n{}", coordinator.log(), worker.log())
    });
    let ex = Example::quickstart();
    let spec = traced_spec(&ex, &["a", "b"], 10);
    let watch = |id: &str| {
        let watched = fleet::run(
            dir.path(),
            &[
                "fork",
                "watch",
                id,
                "--json",
                "--timeout-s",
                "50",
                "--nats",
                &url,
            ],
        )
        .json();
        for b in watched["branches"].as_array().unwrap() {
            assert_eq!(b["state"], "done", "{watched}");
        }
    };

    // A client command, in a trace of the caller's.
    let (cli_trace, cli_parent) = ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7");
    let traceparent = format!("00-{cli_trace}-{cli_parent}-01");
    let created = forkfleet_env(
        &["fork", "create", path_str(&spec), "--json", "--nats", &url],
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
            ("TRACEPARENT", traceparent.as_str()),
        ],
    );
    let cli_fork = json(&created)["fork_id"].as_str().unwrap().to_string();
    watch(&cli_fork);
    // A command with no trace around it starts one.
    let listed = forkfleet_env(
        &["fork", "ls", "--json", "--nats", &url],
        &[("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str())],
    );
    assert!(listed.status.success());

    // An HTTP call with a traceparent header: a fork from the spec and the first fork's
    // snapshot.
    let (http_trace, http_parent) = ("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331");
    let api = |method: &str, path: &str| {
        reqwest::blocking::Client::new()
            .request(
                method.parse().unwrap(),
                format!("http://{http_addr}/api/v1{path}"),
            )
            .timeout(Duration::from_secs(30))
    };
    let shown: Value = serde_json::from_str(
        &api("GET", &format!("/forks/{cli_fork}"))
            .send()
            .unwrap()
            .text()
            .unwrap(),
    )
    .unwrap();
    let doc = serde_json::json!({
        "spec": std::fs::read_to_string(&spec).unwrap(),
        "files": {"traced.toml": std::fs::read_to_string(ex.dir.path().join("traced.toml")).unwrap()},
        "snapshot": shown["snapshot"],
        "workspace": "over-http",
    });
    let resp = api("POST", "/forks/from-spec")
        .header("content-type", "application/json")
        // Flagged "not sampled": a caller cannot hide a fork's trace, the coordinator
        // decides (its sampler keeps every trace here).
        .header("traceparent", format!("00-{http_trace}-{http_parent}-00"))
        .body(doc.to_string())
        .send()
        .unwrap();
    let status = resp.status().as_u16();
    let made: Value = serde_json::from_str(&resp.text().unwrap()).unwrap();
    assert_eq!(status, 200, "{made}");
    let http_fork = made["fork_id"].as_str().unwrap().to_string();
    watch(&http_fork);

    assert!(worker.terminate().success());
    assert!(coordinator.terminate().success());
    let all = receiver.spans();
    let ids = by_id(&all);
    let in_trace =
        |trace: &str| -> Vec<&Value> { all.iter().filter(|s| s["trace_id"] == trace).collect() };
    for (trace, parent, root_name, root_service, fork) in [
        (
            cli_trace,
            cli_parent,
            "forkfleet fork create",
            "forkfleet",
            &cli_fork,
        ),
        (
            http_trace,
            http_parent,
            "POST /api/v1/forks/from-spec",
            "forkfleet-coordinator",
            &http_fork,
        ),
    ] {
        let spans = in_trace(trace);
        let root = spans
            .iter()
            .find(|s| s["name"] == root_name)
            .unwrap_or_else(|| panic!("no {root_name} in trace {trace}:\n{}", dump(&all)));
        assert_eq!(root["parent_span_id"], parent, "{root}");
        assert_eq!(root["resource"]["service.name"], root_service, "{root}");
        let create = spans
            .iter()
            .find(|s| s["name"] == "fork.create")
            .unwrap_or_else(|| panic!("no fork.create in trace {trace}:\n{}", dump(&all)));
        assert_eq!(create["resource"]["service.name"], "forkfleet-coordinator");
        assert_eq!(create["attributes"]["fork.id"], fork.as_str());
        assert!(
            ancestors(create, &ids)
                .iter()
                .any(|a| a["span_id"] == root["span_id"]),
            "fork.create is not under {root_name}:\n{}",
            dump(&all)
        );
        let agents: Vec<_> = spans
            .iter()
            .filter(|s| s["name"].as_str().unwrap().starts_with("invoke_agent"))
            .collect();
        assert_eq!(agents.len(), 2, "{}", dump(&all));
        for a in agents {
            assert_eq!(a["resource"]["service.name"], "forkfleet-worker");
            assert!(
                ancestors(a, &ids)
                    .iter()
                    .any(|s| s["span_id"] == root["span_id"]),
                "{a} is not under {root_name}"
            );
        }
    }
    // `fork ls` with no TRACEPARENT: a root span, and the coordinator's answer in its trace.
    let ls = all
        .iter()
        .find(|s| s["name"] == "forkfleet fork ls")
        .unwrap_or_else(|| panic!("no forkfleet fork ls span:\n{}", dump(&all)));
    assert_eq!(ls["parent_span_id"], "", "{ls}");
    assert!(
        in_trace(ls["trace_id"].as_str().unwrap())
            .iter()
            .any(|s| s["name"] == "api.request"
                && s["resource"]["service.name"] == "forkfleet-coordinator"),
        "{}",
        dump(&all)
    );
}
