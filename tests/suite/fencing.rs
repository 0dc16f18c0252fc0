//! Leases that fence on both sides (ADR 18), with real processes on a real nats-server: a
//! forged resume request fences nothing; a worker paused (SIGSTOP) past the ack wait stops
//! its branches when it resumes, and every model call the provider saw is counted, under a
//! strict cap that holds; `fork terminate` and `fork abort` end branches no worker runs.

use super::fleet::{Fleet, Options, Service, COMMAND_LIMIT, POLL, SHORT_ACK_WAIT_S};
use super::harness::Example;
use forkfleet_bus::nats::{NatsBus, NatsConfig};
use forkfleet_bus::Bus;
use forkfleet_shared::ids::{ForkId, RunId};
use forkfleet_shared::protocol::{ResumeReply, ResumeRequest, TaskProof, RESUME_SUBJECT};
use forkfleet_shared::wire;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The allow-list variable of the worker-side model catalogue (another change): harmless
/// until it exists, and it lets the test's loopback model through once it does.
const ALLOW_LOOPBACK: &[(&str, &str)] = &[("FORKFLEET_ALLOWED_MODEL_HOSTS", "127.0.0.1")];

/// Poll `f` until it gives `Some`, at most [`COMMAND_LIMIT`]; `what` names the wait.
fn poll<T>(fleet: &Fleet, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + COMMAND_LIMIT;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out: {what}\n{}",
            fleet.logs()
        );
        std::thread::sleep(POLL);
    }
}

/// A spec of `labels` playing a slow script in `ex` (a file every 100 ms for 15 s).
fn slow_spec(ex: &Example, labels: &[&str]) -> PathBuf {
    std::fs::write(
        ex.dir.path().join("slow.toml"),
        super::harness::slow_script(),
    )
    .unwrap();
    let branches: String = labels
        .iter()
        .map(|l| format!("[[branches]]\nlabel = \"{l}\"\nsteer = \"go\"\n"))
        .collect();
    ex.write_spec(&format!(
        "goal = \"slow\"\nworkspace = \"workspace\"\nmodel = \"scripted:slow\"\nmax_turns = 200\n\
         [models.\"scripted:slow\"]\nscript = \"slow.toml\"\n{branches}"
    ))
}

fn run_id(view: &Value, label: &str) -> String {
    super::harness::branch(view, label)["id"]
        .as_str()
        .unwrap()
        .to_string()
}

/// A forged takeover of a running branch (attempt 99, with and without a made-up proof)
/// is refused with a WARN and fences nothing. A proof that claims a delivery count past
/// `max_deliver` for the branch's real task makes it dead (ADR 38: the count is the
/// worker's word): since the branch made turns, it is queued again, not failed. Either
/// way the branch finishes `done` with a contiguous log, each turn once.
#[test]
fn a_forged_resume_request_is_refused_and_the_branch_finishes() {
    let fleet = Fleet::start(1, 2, Options::default());
    let ex = Example::quickstart();
    std::fs::write(
        ex.dir.path().join("short.toml"),
        super::harness::writes_then_done(
            50,
            false,
            "out/{label}/{repeat}.txt",
            "{label} {repeat}\\n",
            6,
        ),
    )
    .unwrap();
    let spec = ex.write_spec(
        "goal = \"short\"\nworkspace = \"workspace\"\nmodel = \"scripted:short\"\n\
         [models.\"scripted:short\"]\nscript = \"short.toml\"\n[[branches]]\nlabel = \"a\"\n",
    );
    let id = fleet.create(&spec);
    fleet.wait_progress(&id, 1);
    let view = fleet.client(&["fork", "show", &id, "--json"]).json();
    let fork_id: ForkId = id.parse().unwrap();
    let run_id: RunId = run_id(&view, "a").parse().unwrap();

    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let bus = NatsBus::connect(NatsConfig::new(fleet.nats.url()))
            .await
            .unwrap();
        let forged = [
            None,
            Some(TaskProof {
                seq: 1,
                delivered: 99,
            }),
            Some(TaskProof {
                seq: 1,
                delivered: 1,
            }),
        ];
        for task in forged {
            let req = ResumeRequest {
                fork_id,
                run_id,
                attempt: 99,
                task,
            };
            let reply = bus
                .request(
                    RESUME_SUBJECT,
                    wire::encode(&req).unwrap(),
                    Duration::from_secs(20),
                )
                .await
                .unwrap();
            let reply: ResumeReply = wire::decode(&reply).unwrap();
            if task.is_some_and(|t| t.delivered == 99) {
                assert!(
                    matches!(&reply, ResumeReply::Gone { reason } if reason.contains("queued again")),
                    "{task:?}: {reply:?}"
                );
            } else {
                assert!(
                    matches!(reply, ResumeReply::Refused { .. }),
                    "{task:?}: {reply:?}"
                );
            }
        }
    });

    let view = fleet.watch(&id);
    let b = super::harness::branch(&view, "a");
    assert_eq!(b["state"], "done", "{view}\n{}", fleet.logs());
    assert_eq!(b["turns"], 7);
    let log = fleet.log(&run_id.to_string());
    let seqs: Vec<u64> = log.iter().map(|e| e["seq"].as_u64().unwrap()).collect();
    assert_eq!(
        seqs,
        (0..log.len() as u64).collect::<Vec<_>>(),
        "contiguous"
    );
    assert_eq!(log.last().unwrap()["event"]["state"], "done");
    let coordinator = fleet.coordinator.log();
    assert_eq!(
        coordinator.matches("coordinator.resume: refused").count(),
        2,
        "{coordinator}"
    );
    assert_eq!(
        coordinator.matches("fork.dead_task").count(),
        1,
        "{coordinator}"
    );
}

/// A branch whose only worker is gone ends `terminated` at once on `fork terminate`, and
/// the rest on `fork abort`, without waiting for its task to be delivered again (the ack
/// wait is 30 s here; no other worker exists).
#[test]
fn terminate_and_abort_end_branches_no_worker_runs() {
    let mut fleet = Fleet::start(1, 2, Options::default());
    let ex = Example::quickstart();
    let spec = slow_spec(&ex, &["a", "b"]);
    let id = fleet.create(&spec);
    fleet.wait_progress(&id, 2);
    fleet.workers[0].kill();

    let stopped = fleet
        .client(&["fork", "terminate", &id, "a", "--json"])
        .json();
    assert_eq!(stopped["sent"], true, "{stopped}");
    let view = fleet.client(&["fork", "show", &id, "--json"]).json();
    let a = super::harness::branch(&view, "a");
    assert_eq!(a["state"], "terminated", "{view}");
    assert_eq!(super::harness::branch(&view, "b")["state"], "running");

    let aborted = fleet.client(&["fork", "abort", &id, "--json"]).json();
    assert_eq!(aborted["terminated"], json!(["b"]), "{aborted}");
    let view = fleet.client(&["fork", "show", &id, "--json"]).json();
    assert_eq!(view["state"], "aborted", "{view}");
    for label in ["a", "b"] {
        let b = super::harness::branch(&view, label);
        assert_eq!(b["state"], "terminated", "{view}");
        let log = fleet.log(b["id"].as_str().unwrap());
        let last = &log.last().unwrap()["event"];
        assert_eq!(last["state"], "terminated", "the terminal status is last");
        let seqs: Vec<u64> = log.iter().map(|e| e["seq"].as_u64().unwrap()).collect();
        assert_eq!(
            seqs,
            (0..log.len() as u64).collect::<Vec<_>>(),
            "contiguous"
        );
    }
}

/// A local model speaking the OpenAI chat-completions wire format, counting every request
/// it receives: each branch writes `writes` files, then answers.
struct FakeModel {
    port: u16,
    requests: Arc<AtomicUsize>,
}

impl FakeModel {
    fn start(writes: usize, latency: Duration) -> FakeModel {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let requests = Arc::new(AtomicUsize::new(0));
        let counted = requests.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { return };
                let counted = counted.clone();
                std::thread::spawn(move || serve(stream, &counted, writes, latency));
            }
        });
        FakeModel { port, requests }
    }

    fn requests(&self) -> usize {
        self.requests.load(Ordering::SeqCst)
    }
}

/// Answer the HTTP/1.1 requests of one connection (keep-alive) until it closes.
fn serve(stream: TcpStream, counted: &AtomicUsize, writes: usize, latency: Duration) {
    let mut out = stream.try_clone().unwrap();
    let mut reader = BufReader::new(stream);
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        let mut length = 0;
        loop {
            let mut header = String::new();
            if reader.read_line(&mut header).unwrap_or(0) == 0 {
                return;
            }
            let header = header.trim();
            if header.is_empty() {
                break;
            }
            if let Some((name, value)) = header.split_once(':') {
                if name.eq_ignore_ascii_case("content-length") {
                    length = value.trim().parse().unwrap();
                }
            }
        }
        let mut body = vec![0; length];
        if reader.read_exact(&mut body).is_err() {
            return;
        }
        counted.fetch_add(1, Ordering::SeqCst);
        // The model's latency: long enough for calls to be in flight when a worker stops.
        std::thread::sleep(latency);
        let request: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        let made = request["messages"]
            .as_array()
            .map_or(0, |m| m.iter().filter(|m| m["role"] == "assistant").count());
        let message = if made < writes {
            json!({
                "role": "assistant",
                "content": "",
                "tool_calls": [{
                    "id": format!("call_{made}"),
                    "type": "function",
                    "function": {
                        "name": "write_file",
                        "arguments": json!({"path": format!("out/{made}.txt"), "content": "x\n"}).to_string(),
                    },
                }],
            })
        } else {
            json!({"role": "assistant", "content": "done"})
        };
        let answer = json!({
            "id": "chatcmpl-test",
            "object": "chat.completion",
            "model": "fake",
            "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 100, "completion_tokens": 10, "total_tokens": 110},
        })
        .to_string();
        let head = format!(
            "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            answer.len()
        );
        if out.write_all(head.as_bytes()).is_err() || out.write_all(answer.as_bytes()).is_err() {
            return;
        }
    }
}

fn signal(service: &Service, sig: &str) {
    let pid = service.child.as_ref().unwrap().id().to_string();
    let sent = Command::new("kill").args([sig, &pid]).status().unwrap();
    assert!(sent.success(), "kill {sig} {pid}");
}

/// Files each branch writes before it answers.
const WRITES: usize = 14;
/// A call's cost: 100 input tokens at $0.01 and 10 output tokens at $20 per Mtok (the
/// output price dominates, so a reservation, which counts `max_output_tokens`, is close to
/// the cost).
const COST_PER_CALL: f64 = 0.000_201;
/// The fork's cap: below what the branches would spend (3 x 15 calls), so it is reached
/// after the takeovers, and strict reservations must hold it across them.
const CAP_USD: f64 = 0.0075;

/// Worker 1 runs three branches of a real-model (HTTP) fork; it is stopped (SIGSTOP) until
/// worker 2 has taken all three over after the ack wait, then continued (SIGCONT). Worker 1
/// stops the branches (its lease is lost) instead of calling the model for them; every
/// request the model server received is a call `fork cost` counts (fenced ones included);
/// every branch ends; the strict cap holds.
#[test]
fn a_worker_paused_past_its_lease_stops_and_every_call_is_counted() {
    let model = FakeModel::start(WRITES, Duration::from_millis(150));
    let mut fleet = Fleet::start(
        1,
        4,
        Options {
            ack_wait_s: Some(SHORT_ACK_WAIT_S),
            env: ALLOW_LOOPBACK,
            ..Options::default()
        },
    );
    let ex = Example::quickstart();
    let spec = ex.write_spec(&format!(
        "goal = \"lease\"\nworkspace = \"workspace\"\nmodel = \"openai:fake\"\nmax_turns = 40\n\
         max_output_tokens = 32\naggregate_budget_usd = {CAP_USD}\nbudget_mode = \"strict\"\n\
         [models.\"openai:fake\"]\nbase_url = \"http://127.0.0.1:{}/v1\"\nmax_retries = 0\n\
         price = {{ input_per_mtok = 0.01, output_per_mtok = 20.0 }}\n{}",
        model.port,
        "[[branches]]\n".repeat(3)
    ));
    let id = fleet.create(&spec);
    fleet.wait_progress(&id, 3);

    // A second worker, with the same settings, that takes the branches over.
    let url = fleet.nats.url();
    let args = [
        "worker",
        "--nats",
        &url,
        "--concurrency",
        "4",
        "--nats-ack-wait-s",
        SHORT_ACK_WAIT_S,
    ];
    let second = Service::spawn_env("worker-1", &args, fleet.dir.path(), ALLOW_LOOPBACK);
    fleet.workers.push(second);

    // Stopped until the coordinator has fenced all three branches for the second worker:
    // longer than the ack wait, by construction.
    signal(&fleet.workers[0], "-STOP");
    poll(&fleet, "three takeovers", || {
        let log = fleet.coordinator.log();
        (log.matches("fork.fence: a worker took the branch over")
            .count()
            >= 3)
            .then_some(())
    });
    signal(&fleet.workers[0], "-CONT");

    // The first worker noticed, for each of its branches, and stopped it.
    poll(&fleet, "the paused worker stops its branches", || {
        let log = fleet.workers[0].log();
        (log.matches("lease on the task is lost").count() >= 3).then_some(())
    });
    let view = fleet.watch(&id);
    for b in view["branches"].as_array().unwrap() {
        let state = b["state"].as_str().unwrap();
        assert!(
            ["done", "aggregate_budget_exhausted"].contains(&state),
            "{b}\n{}",
            fleet.logs()
        );
    }
    // Every request the server saw is a call counted (a fenced call's usage may land a
    // moment after the fork settles).
    let counted = |cost: &Value| -> u64 {
        cost["branches"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b["calls"].as_u64().unwrap())
            .sum()
    };
    let cost = poll(&fleet, "every call counted", || {
        let cost = fleet.client(&["fork", "cost", &id, "--json"]).json();
        (counted(&cost) == model.requests() as u64).then_some(cost)
    });
    assert_eq!(counted(&cost), model.requests() as u64, "{cost}");
    let spent = cost["spent_usd"].as_f64().unwrap();
    assert!(
        (spent - model.requests() as f64 * COST_PER_CALL).abs() < 1e-9,
        "{spent} for {} requests",
        model.requests()
    );
    assert!(spent <= CAP_USD + 1e-12, "the cap holds: {cost}");
    // What a superseded attempt reserved and never spent stays held until it expires.
    let reserved = cost["reserved_usd"].as_f64().unwrap();
    assert!(spent + reserved <= CAP_USD + 1e-12, "{cost}");
}
