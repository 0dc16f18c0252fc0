//! The budget commands of the CLI, embedded (no NATS): flag validation, `fork cost`,
//! `fork topup` of a paused run, `account set` / `account show`, and model prices from the
//! config's `[pricing]`.

use super::fleet::{Fleet, Options, SHORT_ACK_WAIT_S};
use super::harness::{forkfleet, forkfleet_env, json, path_str, stderr, Example};
use forkfleet_shared::budget::{AccountView, ForkCost};
use forkfleet_shared::state::BranchState;
use serde_json::Value;
use std::path::Path;
use std::process::Output;

/// Exit 2, and every one of `expect` in stderr.
fn bad(out: &Output, expect: &[&str]) {
    let err = stderr(out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    for e in expect {
        assert!(err.contains(e), "expected `{e}` in: {err}");
    }
}

/// The quickstart spec with `top` keys added (before its tables).
fn quickstart_with(ex: &Example, top: &str) -> std::path::PathBuf {
    let spec = std::fs::read_to_string(ex.spec()).unwrap();
    ex.write_spec(&format!("{top}\n{spec}"))
}

/// The quickstart spec without its model price, with `top` keys added.
fn unpriced_with(ex: &Example, top: &str) -> std::path::PathBuf {
    let spec = std::fs::read_to_string(ex.spec()).unwrap();
    let spec: String = spec
        .lines()
        .filter(|l| !l.starts_with("price ="))
        .map(|l| format!("{l}\n"))
        .collect();
    ex.write_spec(&format!("{top}\n{spec}"))
}

fn run_json(spec: &Path, data: &Path, extra: &[&str]) -> Value {
    let mut args = vec![
        "run",
        path_str(spec),
        "--data",
        path_str(data),
        "--json",
        "--timeout-s",
        "120",
    ];
    args.extend_from_slice(extra);
    json(&forkfleet(&args))
}

fn cost_of(id: &str, data: &Path) -> ForkCost {
    let doc = json(&forkfleet(&[
        "fork",
        "cost",
        id,
        "--data",
        path_str(data),
        "--json",
    ]));
    serde_json::from_value(doc.clone()).unwrap_or_else(|e| panic!("not a ForkCost ({e}): {doc}"))
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-12
}

#[test]
fn bad_budget_flags_are_exit_2_naming_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("store");
    let data = path_str(&data);
    let fork = "00000000-0000-7000-8000-000000000000";
    for usd in ["-1", "0", "nan", "inf", "-inf", "lots"] {
        let out = forkfleet(&["fork", "topup", fork, "--usd", usd, "--data", data]);
        bad(&out, &["--usd", "greater than 0"]);
        let out = forkfleet(&[
            "fork",
            "move-budget",
            fork,
            "--from",
            "a",
            "--to",
            "b",
            "--usd",
            usd,
            "--data",
            data,
        ]);
        bad(&out, &["--usd", "greater than 0"]);
    }
    for cap in ["-0.5", "NaN", "infinity", "ten"] {
        let out = forkfleet(&["account", "set", "team-a", "--cap", cap, "--data", data]);
        bad(&out, &["--cap", "0 or more"]);
    }
    // Exactly one of --cap and --no-cap.
    bad(
        &forkfleet(&["account", "set", "team-a", "--data", data]),
        &["--cap", "--no-cap"],
    );
    bad(
        &forkfleet(&[
            "account", "set", "team-a", "--cap", "1", "--no-cap", "--data", data,
        ]),
        &["--cap", "--no-cap"],
    );
    // An account name follows the label rules.
    bad(
        &forkfleet(&["account", "set", "../x", "--cap", "1", "--data", data]),
        &["account name `../x`"],
    );
    // Moving budget needs two different branches.
    bad(
        &forkfleet(&[
            "fork",
            "move-budget",
            fork,
            "--from",
            "a",
            "--to",
            "a",
            "--usd",
            "1",
            "--data",
            data,
        ]),
        &["--from and --to", "`a`"],
    );
    assert!(!Path::new(data).exists(), "bad input must create nothing");
}

/// Waits on the coordinator's `account_set` and `accounts`.
#[test]
fn accounts_are_set_shown_and_unknown_ones_listed() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("store");
    let data = path_str(&data);

    // An unknown name on an empty store says how to make one.
    std::fs::create_dir_all(data).unwrap();
    bad(
        &forkfleet(&["account", "show", "team-a", "--data", data]),
        &[
            "no account named `team-a`",
            "forkfleet account set NAME --cap USD",
        ],
    );
    let set = json(&forkfleet(&[
        "account", "set", "team-a", "--cap", "5", "--data", data, "--json",
    ]));
    let a: AccountView = serde_json::from_value(set).unwrap();
    assert_eq!(a.name, "team-a");
    assert_eq!(a.cap_usd, Some(5.0));
    assert_eq!(a.spent_usd, 0.0);
    assert_eq!(a.remaining_usd, Some(5.0));

    let shown = json(&forkfleet(&[
        "account", "show", "team-a", "--data", data, "--json",
    ]));
    let b: AccountView = serde_json::from_value(shown).unwrap();
    assert_eq!(b, a);

    json(&forkfleet(&[
        "account", "set", "team-b", "--no-cap", "--data", data, "--json",
    ]));
    let all: Vec<AccountView> = serde_json::from_value(json(&forkfleet(&[
        "account", "show", "--data", data, "--json",
    ])))
    .unwrap();
    let names: Vec<&str> = all.iter().map(|a| a.name.as_str()).collect();
    assert_eq!(names, ["team-a", "team-b"]);
    assert_eq!(all[1].cap_usd, None);
    assert_eq!(all[1].remaining_usd, None);

    // A cap is changed in place, and removed with --no-cap.
    let changed = json(&forkfleet(&[
        "account", "set", "team-a", "--no-cap", "--data", data, "--json",
    ]));
    assert_eq!(changed["cap_usd"], Value::Null, "{changed}");

    // Text output.
    let out = forkfleet(&["account", "show", "--data", data]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("ACCOUNT") && text.contains("team-b"),
        "{text}"
    );

    // An unknown account: exit 2, the known ones listed.
    bad(
        &forkfleet(&["account", "show", "nobody", "--data", data]),
        &["no account named `nobody`", "team-a, team-b"],
    );
}

/// Waits on the coordinator's ledger (`fork_cost`, `account_set`, accounts charged by forks).
#[test]
fn fork_cost_adds_up_the_branches_usage() {
    let ex = Example::quickstart();
    let data = ex.data();
    json(&forkfleet(&[
        "account",
        "set",
        "team-a",
        "--cap",
        "5",
        "--data",
        path_str(&data),
        "--json",
    ]));
    let spec = quickstart_with(&ex, "aggregate_budget_usd = 10.0\naccount = \"team-a\"");
    let doc = run_json(&spec, &data, &[]);
    let id = doc["fork_id"].as_str().unwrap();
    let cost = cost_of(id, &data);

    assert_eq!(cost.fork_id.to_string(), id);
    assert_eq!(cost.branches.len(), 3);
    let mut sum = 0.0;
    for b in &cost.branches {
        let run = doc["branches"]
            .as_array()
            .unwrap()
            .iter()
            .find(|x| x["label"] == b.label.as_str())
            .unwrap();
        assert_eq!(b.state, BranchState::Done, "{b:?}");
        assert!(b.spent_usd > 0.0, "{b:?}");
        assert!(
            close(b.spent_usd, run["cost_usd"].as_f64().unwrap()),
            "{b:?} vs {run}"
        );
        assert_eq!(b.calls as u64, run["turns"].as_u64().unwrap(), "{b:?}");
        assert_eq!(b.reserved_usd, 0.0);
        assert_eq!(b.cap_usd, None);
        // The branch's spend is the sum of its usage events' costs.
        let log = json(&forkfleet(&[
            "log",
            run["id"].as_str().unwrap(),
            "--data",
            path_str(&data),
            "--json",
        ]));
        let logged: f64 = log
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["event"]["type"] == "usage")
            .filter_map(|e| e["event"]["cost_usd"].as_f64())
            .sum();
        assert!(close(b.spent_usd, logged), "{b:?}: log says {logged}");
        sum += b.spent_usd;
    }
    assert!(close(cost.spent_usd, sum), "{cost:?}");
    assert!(close(
        cost.spent_usd,
        doc["total_cost_usd"].as_f64().unwrap()
    ));
    assert_eq!(cost.reserved_usd, 0.0);
    assert_eq!(cost.cap_usd, Some(10.0));
    assert!(close(cost.remaining_usd.unwrap(), 10.0 - sum));
    assert_eq!(cost.mode.as_str(), "strict");
    assert_eq!(cost.on_exhausted.as_str(), "stop");
    let account = cost.account.as_ref().expect("the fork charges team-a");
    assert_eq!(account.name, "team-a");
    assert!(close(account.spent_usd, sum), "{account:?}");
    assert!(close(account.remaining_usd.unwrap(), 5.0 - sum));
    assert_eq!(account.forks, 1);

    // The account's own view agrees.
    let shown: AccountView = serde_json::from_value(json(&forkfleet(&[
        "account",
        "show",
        "team-a",
        "--data",
        path_str(&data),
        "--json",
    ])))
    .unwrap();
    assert!(close(shown.spent_usd, sum));

    // Text: a line per branch, the fork's totals, the account's.
    let out = forkfleet(&["fork", "cost", &id[..13], "--data", path_str(&data)]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    for want in [
        "LABEL",
        "REMAINING_USD",
        "concise",
        "thorough",
        "mode strict",
        "on_exhausted stop",
        "cap $10.000000",
        "account team-a",
    ] {
        assert!(text.contains(want), "expected `{want}` in:\n{text}");
    }
}

/// Waits on the coordinator's pause and top-up (and the worker's reservations).
#[test]
fn a_paused_run_exits_1_and_a_top_up_resumes_it() {
    let ex = Example::quickstart();
    let data = ex.data();
    // Room for a call or two of the ten the branches make; then they pause.
    let spec = quickstart_with(
        &ex,
        "aggregate_budget_usd = 0.0005\non_exhausted = \"pause\"\nmax_output_tokens = 200",
    );
    let out = forkfleet(&[
        "run",
        path_str(&spec),
        "--data",
        path_str(&data),
        "--timeout-s",
        "120",
        "--pick",
        "thorough",
    ]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        !err.contains("gave up waiting"),
        "run must not wait on paused branches: {err}"
    );
    assert!(err.contains("paused by a budget cap"), "{err}");
    assert!(err.contains("forkfleet fork topup"), "{err}");
    assert!(err.contains("--data"), "{err}");
    assert!(err.contains("--pick `thorough` is paused"), "{err}");
    assert!(ex.read("docs/legacy.md").is_some(), "nothing merged");

    let list = json(&forkfleet(&[
        "fork",
        "ls",
        "--data",
        path_str(&data),
        "--json",
    ]));
    let id = list[0]["fork_id"].as_str().unwrap().to_string();
    let cost = cost_of(&id, &data);
    let paused = cost
        .branches
        .iter()
        .filter(|b| b.state == BranchState::Paused)
        .count();
    assert!(paused > 0, "{cost:?}");
    assert_eq!(cost.reserved_usd, 0.0, "{cost:?}");

    // `fork show` says how to resume them.
    let out = forkfleet(&["fork", "show", &id, "--data", path_str(&data)]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("paused"), "{text}");
    assert!(text.contains("forkfleet fork topup"), "{text}");

    // Embedded, the top-up runs the resumed branches here to the end.
    let topped = json(&forkfleet(&[
        "fork",
        "topup",
        &id,
        "--usd",
        "1",
        "--data",
        path_str(&data),
        "--json",
        "--timeout-s",
        "120",
    ]));
    let topped: ForkCost = serde_json::from_value(topped).unwrap();
    for b in &topped.branches {
        assert_eq!(b.state, BranchState::Done, "{b:?}");
    }
    assert!(close(topped.cap_usd.unwrap(), 1.0005), "{topped:?}");
    assert_eq!(topped.reserved_usd, 0.0);

    let merged = forkfleet(&[
        "fork",
        "merge",
        &id,
        "--pick",
        "thorough",
        "--data",
        path_str(&data),
    ]);
    assert_eq!(merged.status.code(), Some(0), "{}", stderr(&merged));
    assert!(ex.read("tests/test_greet.py").is_some());
}

/// Waits on budgets working end to end (a capped fork runs).
#[test]
fn config_prices_an_unpriced_scripted_model() {
    let ex = Example::quickstart();
    let spec = unpriced_with(&ex, "aggregate_budget_usd = 1.0");
    let data = ex.data();

    // Without a price the cap cannot be enforced: exit 2 naming the model and the fix.
    let out = forkfleet_env(&["run", path_str(&spec), "--json"], &[]);
    bad(
        &out,
        &[
            "no known price",
            "scripted:quickstart",
            "[pricing.\"scripted:quickstart\"]",
        ],
    );
    assert!(!data.exists(), "bad input must create nothing");

    // A bad config entry names the model and the key.
    let cfg = ex.dir.path().join("ff.toml");
    std::fs::write(
        &cfg,
        "[pricing.\"scripted:quickstart\"]\ninput_per_mtok = -0.15\noutput_per_mtok = 0.60\n",
    )
    .unwrap();
    let out = forkfleet_env(&["run", path_str(&spec), "--config", path_str(&cfg)], &[]);
    bad(&out, &["scripted:quickstart", "input_per_mtok", ">= 0"]);

    // The config's price makes it run, and prices its usage.
    std::fs::write(
        &cfg,
        "[pricing.\"scripted:quickstart\"]\ninput_per_mtok = 0.15\noutput_per_mtok = 0.60\n",
    )
    .unwrap();
    let out = forkfleet_env(
        &[
            "run",
            path_str(&spec),
            "--config",
            path_str(&cfg),
            "--json",
            "--timeout-s",
            "120",
        ],
        &[],
    );
    let doc = json(&out);
    for b in doc["branches"].as_array().unwrap() {
        assert_eq!(b["state"], "done", "{b}");
        assert!(b["cost_usd"].as_f64().unwrap() > 0.0, "{b}");
    }

    // `fork create` too, with the price from the environment.
    let store = ex.dir.path().join("store2");
    let out = forkfleet_env(
        &[
            "fork",
            "create",
            path_str(&spec),
            "--data",
            path_str(&store),
            "--json",
            "--timeout-s",
            "120",
        ],
        &[(
            "FORKFLEET_PRICING",
            "\"scripted:quickstart\" = { input_per_mtok = 0.15, output_per_mtok = 0.60 }",
        )],
    );
    let doc = json(&out);
    assert_eq!(doc["state"], "settled", "{doc}");
    assert!(doc["total_cost_usd"].as_f64().unwrap() > 0.0);
}

/// The same commands against a cluster (`--nats`): the API operations end to end.
/// Waits on the coordinator's ledger.
#[test]
fn budget_commands_over_nats() {
    let fleet = Fleet::start(
        1,
        8,
        Options {
            ack_wait_s: Some(SHORT_ACK_WAIT_S),
            ..Options::default()
        },
    );
    let set = fleet.client(&["account", "set", "team-a", "--cap", "5", "--json"]);
    let a: AccountView = serde_json::from_value(set.json()).unwrap();
    assert_eq!((a.name.as_str(), a.cap_usd), ("team-a", Some(5.0)));
    let unknown = fleet.client(&["account", "show", "nobody"]);
    assert_eq!(unknown.code, Some(2), "{}", unknown.stderr);
    assert!(
        unknown.stderr.contains("accounts: team-a"),
        "{}",
        unknown.stderr
    );

    let ex = Example::quickstart();
    let spec = quickstart_with(&ex, "aggregate_budget_usd = 1.0\naccount = \"team-a\"");
    let id = fleet.create(&spec);
    let view = fleet.watch(&id);
    let total: f64 = view["branches"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["cost_usd"].as_f64().unwrap())
        .sum();
    let cost: ForkCost =
        serde_json::from_value(fleet.client(&["fork", "cost", &id, "--json"]).json()).unwrap();
    assert!(close(cost.spent_usd, total), "{cost:?} vs {total}");
    assert_eq!(cost.reserved_usd, 0.0);
    assert_eq!(
        cost.account.as_ref().map(|a| a.name.as_str()),
        Some("team-a")
    );
    let text = fleet.client(&["fork", "cost", &id]);
    assert_eq!(text.code, Some(0), "{}", text.stderr);
    assert!(text.stdout.contains("account team-a"), "{}", text.stdout);

    // A top-up answers at once with the new cap.
    let topped: ForkCost = serde_json::from_value(
        fleet
            .client(&["fork", "topup", &id, "--usd", "0.5", "--json"])
            .json(),
    )
    .unwrap();
    assert!(close(topped.cap_usd.unwrap(), 1.5), "{topped:?}");
    // An unknown branch is bad input.
    let bad_branch = fleet.client(&["fork", "topup", &id, "--branch", "nope", "--usd", "1"]);
    assert_eq!(bad_branch.code, Some(2), "{}", bad_branch.stderr);
    assert!(bad_branch.stderr.contains("nope"), "{}", bad_branch.stderr);

    let shown: AccountView = serde_json::from_value(
        fleet
            .client(&["account", "show", "team-a", "--json"])
            .json(),
    )
    .unwrap();
    assert!(close(shown.spent_usd, total), "{shown:?}");
    assert_eq!(shown.forks, 1);
}

/// A model server that ignores `max_tokens`: every chat completion streams text until the
/// client goes away. Its port.
fn endless_model() -> u16 {
    use std::io::Write;
    serve_model(|_, out| {
        let head =
            "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n";
        if out.write_all(head.as_bytes()).is_err() {
            return;
        }
        let chunk =
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"tokentokentoken \"}}]}\n\n";
        // Bounded: 200,000 chunks, or until the client closes the connection.
        for _ in 0..200_000 {
            if out.write_all(chunk.as_bytes()).is_err() {
                return;
            }
        }
    })
}

/// A model server on a free loopback port: each request (HTTP/1.1, its body read by
/// `Content-Length`) is handed to `answer` with the connection to write the answer to, on
/// a thread of its own. Its port.
fn serve_model(answer: impl Fn(Vec<u8>, &mut std::net::TcpStream) + Send + Sync + 'static) -> u16 {
    use std::io::{BufRead, BufReader, Read};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let answer = std::sync::Arc::new(answer);
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(stream) = stream else { return };
            let answer = answer.clone();
            std::thread::spawn(move || {
                let mut out = stream.try_clone().unwrap();
                let mut reader = BufReader::new(stream);
                let mut length = 0;
                loop {
                    let mut line = String::new();
                    if reader.read_line(&mut line).unwrap_or(0) == 0 {
                        return;
                    }
                    let line = line.trim();
                    if line.is_empty() {
                        break;
                    }
                    if let Some((k, v)) = line.split_once(':') {
                        if k.eq_ignore_ascii_case("content-length") {
                            length = v.trim().parse().unwrap();
                        }
                    }
                }
                let mut body = vec![0; length];
                if reader.read_exact(&mut body).is_err() {
                    return;
                }
                answer(body, &mut out);
            });
        }
    });
    port
}

#[test]
fn a_strict_cap_holds_against_a_provider_that_ignores_max_tokens() {
    let port = endless_model();
    // $100 a million output tokens: a call reserves about 100 tokens' worth ($0.01) and
    // its input; the $0.05 cap holds a few calls.
    let (cost, _) = run_capped(
        port,
        "max_turns = 40\nmax_output_tokens = 100",
        "",
        (0.01, 100.0),
    );
    let b = &cost;
    eprintln!(
        "strict $0.05 against an endless stream: {} calls, spent ${:.6}, overrun ${:.6}",
        b.calls, b.spent_usd, b.overrun_usd
    );
    assert_eq!(b.state, BranchState::BudgetExhausted, "{b:?}");
    // Every call was cut at its reservation (1.25 times it, plus a chunk): the spend stays
    // within one call's reservation of the cap, and what passed it is reported.
    let reservation = 0.0125;
    assert!(b.calls >= 2, "{b:?}");
    assert!(
        b.spent_usd <= 0.05 + reservation,
        "spent {} of a $0.05 cap",
        b.spent_usd
    );
    assert!(
        (b.overrun_usd - (b.spent_usd - 0.05).max(0.0)).abs() < 1e-9,
        "{b:?}"
    );
}

/// One call a [`thrifty_model`] answered: the output cap asked for and the tokens billed.
#[derive(Debug, Clone, Copy)]
struct Billed {
    max_tokens: u64,
    input_tokens: u64,
    output_tokens: u64,
}

/// A model server that honours the output cap and answers briefly: every chat completion is
/// a `list_files` call of 30 output tokens (fewer when the cap is lower: then a cut text),
/// its input counted at four bytes a token. Streams when asked. Its port, and what it
/// billed.
fn thrifty_model() -> (u16, std::sync::Arc<std::sync::Mutex<Vec<Billed>>>) {
    thrifty_model_saying(true)
}

/// [`thrifty_model`], reporting its usage (`honest`) or 0 tokens in and out.
fn thrifty_model_saying(honest: bool) -> (u16, std::sync::Arc<std::sync::Mutex<Vec<Billed>>>) {
    use std::io::Write;
    let billed = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let log = billed.clone();
    let port = serve_model(move |request, out| {
        let req: Value = serde_json::from_slice(&request).unwrap();
        let max_tokens = req["max_tokens"]
            .as_u64()
            .or_else(|| req["max_completion_tokens"].as_u64())
            .unwrap();
        let input_tokens = request.len() as u64 / 4;
        let output_tokens = max_tokens.min(30);
        log.lock().unwrap().push(Billed {
            max_tokens,
            input_tokens,
            output_tokens,
        });
        let usage = if honest {
            serde_json::json!({
                "prompt_tokens": input_tokens,
                "completion_tokens": output_tokens,
                "total_tokens": input_tokens + output_tokens,
            })
        } else {
            serde_json::json!({"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0})
        };
        let (message, delta, finish) = if output_tokens == 30 {
            let call = serde_json::json!([{"index": 0, "id": format!("c{}", req["messages"].as_array().map_or(0, Vec::len)), "type": "function", "function": {"name": "list_files", "arguments": "{}"}}]);
            (
                serde_json::json!({"role": "assistant", "content": null, "tool_calls": call}),
                serde_json::json!({"tool_calls": call}),
                "tool_calls",
            )
        } else {
            let text = "x".repeat(output_tokens as usize * 4);
            (
                serde_json::json!({"role": "assistant", "content": text}),
                serde_json::json!({"content": text}),
                "length",
            )
        };
        let (kind, body) = if req["stream"].as_bool() == Some(true) {
            let chunks = [
                serde_json::json!({"choices": [{"index": 0, "delta": delta}]}),
                serde_json::json!({"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]}),
                serde_json::json!({"choices": [], "usage": usage}),
            ];
            let mut sse: String = chunks.iter().map(|c| format!("data: {c}\n\n")).collect();
            sse.push_str("data: [DONE]\n\n");
            ("text/event-stream", sse)
        } else {
            let doc = serde_json::json!({
                "model": "fake",
                "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                "usage": usage,
            });
            ("application/json", doc.to_string())
        };
        let head = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: {kind}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
            body.len()
        );
        let _ = out.write_all(head.as_bytes());
        let _ = out.write_all(body.as_bytes());
    });
    (port, billed)
}

#[test]
fn a_strict_cap_is_used_up_to_less_than_one_call() {
    // Calls bounded at a whole 4,096-token answer ($0.041 of output at $10 a million)
    // that use 30 tokens: holding only bounds, a $0.05 cap would stop the branch with
    // four fifths of it unused. Learning from its calls, the branch goes on until less
    // than one call's worth is left, its last call's output cap lowered to fit the room.
    for stream in [true, false] {
        let (port, billed) = thrifty_model();
        let (b, _) = run_capped(
            port,
            "max_turns = 1000\nmax_output_tokens = 4096",
            &format!("stream = {stream}"),
            (1.0, 10.0),
        );
        let billed = billed.lock().unwrap().clone();
        let cost = |c: &Billed| (c.input_tokens as f64 + c.output_tokens as f64 * 10.0) / 1e6;
        let largest = billed.iter().map(cost).fold(0.0, f64::max);
        let sum: f64 = billed.iter().map(cost).sum();
        let last = billed.last().unwrap();
        eprintln!(
            "strict $0.05 (stream {stream}): {} calls, spent ${:.6}, left ${:.6}, largest call ${largest:.6}, last max_tokens {}",
            billed.len(),
            b.spent_usd,
            0.05 - b.spent_usd,
            last.max_tokens
        );
        assert_eq!(b.state, BranchState::BudgetExhausted, "{b:?}");
        assert_eq!(b.calls as usize, billed.len(), "{b:?}");
        assert!(close(b.spent_usd, sum), "{b:?} against ${sum} billed");
        // Never past the cap; less than one call's worth left (the call refused needs its
        // input at the ratio the provider counted, a tenth more for margin, and the
        // largest answer: the history grows, so that is up to a tenth over the largest).
        assert!(b.spent_usd <= 0.05 + 1e-9, "{b:?}");
        assert_eq!(b.overrun_usd, 0.0, "{b:?}");
        assert!(
            0.05 - b.spent_usd < largest * 1.1,
            "{b:?}: left more than one call (${largest})"
        );
        // The calls near the cap asked for less than the whole answer cap.
        assert!(last.max_tokens < 4096, "{last:?}");
        assert!(billed[0].max_tokens == 4096, "{:?}", billed[0]);
    }
}

#[test]
fn a_provider_that_reports_no_tokens_does_not_pass_a_strict_cap() {
    // Usage of 0 in and 0 out for every call: taken at its word, every call was free and
    // the branch ran until max_turns. Estimated from sizes (the input at the bound a
    // reservation holds), the cap stops it and what it tracked covers the bill.
    let (port, billed) = thrifty_model_saying(false);
    let (b, out) = run_capped(
        port,
        "max_turns = 300\nmax_output_tokens = 4096",
        "",
        (1.0, 10.0),
    );
    let billed = billed.lock().unwrap().clone();
    let truth: f64 = billed
        .iter()
        .map(|c| (c.input_tokens as f64 + c.output_tokens as f64 * 10.0) / 1e6)
        .sum();
    assert_eq!(b.state, BranchState::BudgetExhausted, "{b:?}");
    assert!(truth <= 0.05 + 1e-9, "billed ${truth} against a $0.05 cap");
    assert!(
        b.spent_usd >= truth,
        "tracked ${} of ${truth} billed",
        b.spent_usd
    );
    assert!(
        stderr(&out).contains("reported 0 input tokens"),
        "{}",
        stderr(&out)
    );
}

/// `forkfleet run` of a one-branch strict fork (branch cap $0.05) on the OpenAI-wire model
/// at `port`, with `settings` among its top-level keys and `model` among the model's
/// (`input`, `output`: USD per million tokens): the branch's cost and the run's output.
fn run_capped(
    port: u16,
    settings: &str,
    model: &str,
    (input, output): (f64, f64),
) -> (forkfleet_shared::budget::BranchCost, Output) {
    let ex = Example::quickstart();
    let spec = ex.write_spec(&format!(
        "goal = \"g\"\nworkspace = \"workspace\"\nmodel = \"openai:fake\"\n{settings}\nbudget_mode = \"strict\"\n\
         [models.\"openai:fake\"]\nbase_url = \"http://127.0.0.1:{port}/v1\"\nmax_retries = 0\n{model}\n\
         price = {{ input_per_mtok = {input}, output_per_mtok = {output} }}\n\
         [[branches]]\nlabel = \"capped\"\nbudget_usd = 0.05\n"
    ));
    let data = ex.data();
    let out = forkfleet_env(
        &[
            "run",
            path_str(&spec),
            "--data",
            path_str(&data),
            "--json",
            "--timeout-s",
            "120",
        ],
        &[("FORKFLEET_ALLOWED_MODEL_HOSTS", "127.0.0.1")],
    );
    let doc: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", stderr(&out)));
    let b = cost_of(doc["fork_id"].as_str().unwrap(), &data).branches[0].clone();
    (b, out)
}

/// A provider's model with no price (no cap asks for one): what its calls cost is unknown,
/// and `fork show` says so, where it said `$0.000000` spent.
#[test]
fn a_model_with_no_price_shows_its_cost_as_unknown() {
    use std::io::Write;
    let port = serve_model(|_, out| {
        let chunks = [
            serde_json::json!({"choices": [{"index": 0, "delta": {"content": "done"}}]}),
            serde_json::json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}),
            serde_json::json!({"choices": [], "usage": {"prompt_tokens": 1200, "completion_tokens": 3, "total_tokens": 1203}}),
        ];
        let mut sse: String = chunks.iter().map(|c| format!("data: {c}\n\n")).collect();
        sse.push_str("data: [DONE]\n\n");
        let head = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
            sse.len()
        );
        let _ = out.write_all(head.as_bytes());
        let _ = out.write_all(sse.as_bytes());
    });
    let ex = Example::quickstart();
    let spec = ex.write_spec(&format!(
        "goal = \"g\"\nworkspace = \"workspace\"\nmodel = \"openai:unpriced\"\n\
         [models.\"openai:unpriced\"]\nbase_url = \"http://127.0.0.1:{port}/v1\"\nmax_retries = 0\n\
         [[branches]]\nlabel = \"free\"\n"
    ));
    let data = path_str(&ex.data()).to_string();
    let env = [("FORKFLEET_ALLOWED_MODEL_HOSTS", "127.0.0.1")];
    let out = forkfleet_env(
        &[
            "run",
            path_str(&spec),
            "--data",
            &data,
            "--json",
            "--timeout-s",
            "120",
        ],
        &env,
    );
    let doc: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", stderr(&out)));
    let fork = doc["fork_id"].as_str().unwrap();
    assert_eq!(doc["branches"][0]["turns"], 1, "{doc}");
    assert_eq!(doc["branches"][0]["cost_unknown"], true, "{doc}");
    assert_eq!(doc["cost_unknown"], true, "{doc}");
    let text = forkfleet_env(&["fork", "show", fork, "--data", &data], &env);
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains("at least $0.000000 (unknown: no price for openai:unpriced)"),
        "{text}"
    );
    assert!(text.contains("unknown"), "{text}");
    let one = forkfleet_env(&["fork", "show", fork, "free", "--data", &data], &env);
    let one = String::from_utf8_lossy(&one.stdout);
    assert!(
        one.contains("cost unknown (its model has no price)"),
        "{one}"
    );
    // `fork cost` says it too: the branch's spend, and the fork's as a lower bound.
    let cost = cost_of(fork, &ex.data());
    assert_eq!(
        cost.branches[0].unpriced_model.as_deref(),
        Some("openai:unpriced")
    );
    let text = forkfleet_env(&["fork", "cost", fork, "--data", &data], &env);
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains("spent at least $0.000000 (unknown: no price for openai:unpriced)"),
        "{text}"
    );
}
