//! Approvals (docs/APPROVALS.md) on both buses, through the real binary: a branch whose
//! tool call needs consent stops `awaiting_approval` holding no slot and no reservation;
//! answers (approve, deny with a reason, a timeout, a resolve's policy) resume it on any
//! worker; stale answers are refused; terminate clears a request; blocked calls are listed
//! in `fork show`, the diff and the merge result.

use super::fleet::{Fleet, Options, COMMAND_LIMIT, POLL, SHORT_ACK_WAIT_S};
use super::harness::{branch, forkfleet, json, path_str, stderr, Example, Tmux};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// `gated` reads and deletes `notes.md` (a gated tool), then writes a migration (a gated
/// path), then answers; every other branch writes three files and answers.
const SCRIPT: &str = r#"
[defaults]
usage = { input_tokens = 1000, output_tokens = 200 }

[[turns.gated]]
tool_calls = [
  { name = "read_file", args = { path = "notes.md" } },
  { name = "delete_file", args = { path = "notes.md" } },
]

[[turns.gated]]
tool_calls = [{ name = "write_file", args = { path = "migrations/001.sql", content = "CREATE TABLE t (id INTEGER);\n" } }]

[[turns.gated]]
text = "gated done"

[[turns."*"]]
tool_calls = [{ name = "write_file", args = { path = "free/{repeat}.txt", content = "x{repeat}\n" } }]
repeat = 3

[[turns."*"]]
text = "free done"
"#;

/// A judge that picks `gated`.
const JUDGE: &str = r#"
[[turns.judge]]
text = '{"winner": "gated", "confidence": 0.9, "reasoning": "It kept the notes.", "notes": {}}'
"#;

/// A spec `name.toml` of branches `gated` (under the fork's rules) and `free` (which lifts
/// them), with `top` added at the top level.
fn write_spec(dir: &Path, name: &str, timeout_s: u64, top: &str) -> PathBuf {
    std::fs::write(dir.join("ap.script.toml"), SCRIPT).unwrap();
    std::fs::write(dir.join("judge.toml"), JUDGE).unwrap();
    std::fs::write(
        dir.join("workspace/notes.md"),
        "# Notes\nThese notes are stale.\n",
    )
    .unwrap();
    let text = format!(
        r#"goal = "approvals"
workspace = "workspace"
model = "scripted:ap"
{top}

[approval]
tools = ["delete_file"]
run_command = ["git push*"]
paths = ["migrations/**"]
timeout_s = {timeout_s}
on_timeout = "deny"

[models."scripted:ap"]
script = "ap.script.toml"
price = {{ input_per_mtok = 0.15, output_per_mtok = 0.60 }}

[models."scripted:judge"]
script = "judge.toml"
spare = true

[[branches]]
label = "gated"
steer = "tidy"

[[branches]]
label = "free"
steer = "write"
approval = {{}}
"#
    );
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, text).unwrap();
    path
}

/// The fork's only id in an embedded data directory.
fn only_fork(data: &str) -> String {
    let forks = json(&forkfleet(&["fork", "ls", "--data", data, "--json"]));
    forks[0]["fork_id"].as_str().unwrap().to_string()
}

/// The requests that wait, as `forkfleet approvals --json` lists them.
fn approvals(args: &[&str]) -> Vec<Value> {
    let mut all = vec!["approvals", "--json"];
    all.extend_from_slice(args);
    json(&forkfleet(&all)).as_array().unwrap().clone()
}

/// A run's log's events of `kind`.
fn events<'a>(log: &'a [Value], kind: &str) -> Vec<&'a Value> {
    log.iter()
        .map(|e| &e["event"])
        .filter(|e| e["type"] == kind)
        .collect()
}

/// An embedded fork of [`write_spec`]'s `ap` spec run until `gated` waits (the run exits 1:
/// nothing merged): the example, its data directory, the run's stderr and the fork's id.
fn waiting_fork() -> (Example, String, String, String) {
    let ex = Example::quickstart();
    let spec = write_spec(ex.dir.path(), "ap", 600, "");
    let data = path_str(&ex.data()).to_string();
    let run = forkfleet(&["run", path_str(&spec), "--json", "--timeout-s", "120"]);
    assert_eq!(run.status.code(), Some(1), "{}", stderr(&run));
    let fork = only_fork(&data);
    (ex, data, stderr(&run), fork)
}

#[test]
fn embedded_requests_wait_and_answers_run_deny_and_are_checked() {
    let (ex, data, err, fork) = waiting_fork();
    let data = data.as_str();
    // The run stopped with `gated` waiting and says how to answer.
    assert!(
        err.contains("wait for approval") && err.contains("forkfleet fork approve"),
        "{err}"
    );
    let waiting = approvals(&["--data", data]);
    assert_eq!(waiting.len(), 1, "{waiting:?}");
    let request = &waiting[0];
    assert_eq!(request["label"], "gated");
    assert_eq!(request["tool"], "delete_file");
    assert_eq!(request["rule"], "tools: delete_file");
    assert_eq!(request["args"]["path"], "notes.md");
    let call = request["call_id"].as_str().unwrap().to_string();
    // The free branch, whose table lifts the rules, finished.
    let shown = json(&forkfleet(&[
        "fork", "show", &fork, "--data", data, "--json",
    ]));
    assert_eq!(branch(&shown, "free")["state"], "done", "{shown}");
    assert_eq!(branch(&shown, "gated")["state"], "awaiting_approval");

    // Answers that cannot be: a branch that does not wait, a call that does not, a steer.
    let not_waiting = forkfleet(&["fork", "approve", &fork, "free", "--data", data]);
    assert_eq!(not_waiting.status.code(), Some(2));
    assert!(
        stderr(&not_waiting).contains("is not waiting for approval (it is done)"),
        "{}",
        stderr(&not_waiting)
    );
    let stale = forkfleet(&["fork", "deny", &fork, "gated", "call_9_9", "--data", data]);
    assert_eq!(stale.status.code(), Some(2));
    assert!(
        stderr(&stale).contains(&format!(
            "waits for call {call} (delete_file), not call_9_9"
        )),
        "{}",
        stderr(&stale)
    );
    let steer = forkfleet(&["fork", "steer", &fork, "gated", "go on", "--data", data]);
    assert_eq!(steer.status.code(), Some(2));
    assert!(stderr(&steer).contains("waits for approval of its `delete_file` call"));

    // Approved: the delete runs, and the next gated call (a migration path) waits.
    let approved = json(&forkfleet(&[
        "fork", "approve", &fork, "gated", &call, "--data", data, "--json",
    ]));
    assert_eq!(approved["approved"], true);
    assert_eq!(approved["by"], "admin");
    let waiting = approvals(&[&fork, "--data", data]);
    assert_eq!(waiting.len(), 1, "{waiting:?}");
    assert_eq!(waiting[0]["tool"], "write_file");
    assert_eq!(waiting[0]["rule"], "paths: migrations/**");
    // The same call id again: answered already.
    let again = forkfleet(&["fork", "approve", &fork, "gated", &call, "--data", data]);
    assert_eq!(again.status.code(), Some(2));

    // Denied: the model reads why, the branch finishes, the call is listed as blocked.
    let denied = json(&forkfleet(&[
        "fork",
        "deny",
        &fork,
        "gated",
        "--reason",
        "no migrations today",
        "--data",
        data,
        "--json",
    ]));
    assert_eq!(denied["approved"], false);
    assert!(approvals(&["--data", data]).is_empty());
    let shown = json(&forkfleet(&[
        "fork", "show", &fork, "--data", data, "--json",
    ]));
    let gated = branch(&shown, "gated");
    assert_eq!(gated["state"], "done", "{shown}");
    assert!(gated["approval"].is_null());
    let blocked = gated["blocked"].as_array().unwrap();
    assert_eq!(blocked.len(), 1, "{gated}");
    assert_eq!(blocked[0]["tool"], "write_file");
    assert_eq!(blocked[0]["by"], "admin");
    assert_eq!(blocked[0]["reason"], "no migrations today");
    let run_id = gated["id"].as_str().unwrap();
    let log = json(&forkfleet(&["log", run_id, "--data", data, "--json"]));
    let log = log.as_array().unwrap();
    let results = events(log, "tool_result");
    let refused = results.iter().find(|r| r["name"] == "write_file").unwrap();
    assert_eq!(refused["ok"], false);
    let output = refused["output"].as_str().unwrap();
    assert!(
        output.starts_with("denied:") && output.contains("no migrations today"),
        "{output}"
    );
    // The model's next call saw the denial (the answer after it is the branch's last).
    assert_eq!(events(log, "approval_requested").len(), 2);
    assert_eq!(events(log, "approval_decided").len(), 2);
    let text = forkfleet(&["fork", "show", &fork, "--data", data]);
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains("blocked calls (not run)") && text.contains("denied by admin"),
        "{text}"
    );

    // The diff and the merge list it too; the merge applied what did run.
    let diff = json(&forkfleet(&[
        "fork", "diff", &fork, "--data", data, "--json",
    ]));
    assert_eq!(diff["blocked"]["gated"][0]["tool"], "write_file", "{diff}");
    let merged = json(&forkfleet(&[
        "fork", "merge", &fork, "--pick", "gated", "--data", data, "--json",
    ]));
    assert_eq!(
        merged["blocked"][0]["reason"], "no migrations today",
        "{merged}"
    );
    assert!(
        ex.read("notes.md").is_none(),
        "the approved delete is merged"
    );
    assert!(ex.read("migrations/001.sql").is_none());
}

#[test]
fn embedded_auto_resolve_denies_what_waits_and_terminate_clears_a_request() {
    let ex = Example::quickstart();
    let spec = write_spec(
        ex.dir.path(),
        "auto",
        600,
        "strategy = \"auto\"\njudge_model = \"scripted:judge\"",
    );
    // The resolve does not wait for a person: both gated calls are denied by policy and
    // the judge's pick is merged.
    let run = forkfleet(&["run", path_str(&spec), "--json", "--timeout-s", "120"]);
    let doc = json(&run);
    assert_eq!(doc["state"], "merged", "{doc}");
    assert_eq!(doc["winner"], "gated");
    let gated = branch(&doc, "gated");
    assert_eq!(gated["state"], "done");
    let blocked = gated["blocked"].as_array().unwrap();
    assert_eq!(blocked.len(), 2, "{gated}");
    assert!(blocked.iter().all(|b| b["by"] == "policy"), "{gated}");
    assert!(blocked[0]["reason"]
        .as_str()
        .unwrap()
        .contains("does not wait for a person"));
    assert!(
        ex.read("notes.md").is_some(),
        "the denied delete did not run"
    );

    // A manual fork: terminate a waiting branch and its request goes with it.
    let (_manual, data, _, fork) = waiting_fork();
    let data = data.as_str();
    assert_eq!(approvals(&["--data", data]).len(), 1);
    // A manual resolve leaves the request to the person and says what waits.
    let resolve = forkfleet(&["fork", "resolve", &fork, "--data", data]);
    assert_eq!(resolve.status.code(), Some(2), "{}", stderr(&resolve));
    assert!(
        stderr(&resolve).contains("`gated` (awaiting_approval)"),
        "{}",
        stderr(&resolve)
    );
    let ended = json(&forkfleet(&[
        "fork",
        "terminate",
        &fork,
        "gated",
        "--data",
        data,
        "--json",
    ]));
    assert_eq!(ended["state"], "awaiting_approval", "{ended}");
    assert!(approvals(&["--data", data]).is_empty());
    let shown = json(&forkfleet(&[
        "fork", "show", &fork, "--data", data, "--json",
    ]));
    assert_eq!(branch(&shown, "gated")["state"], "terminated");
    assert!(branch(&shown, "gated")["approval"].is_null());
    let late = forkfleet(&["fork", "approve", &fork, "gated", "--data", data]);
    assert_eq!(late.status.code(), Some(2));
    assert!(stderr(&late).contains("is not waiting for approval (it is terminated)"));
}

/// `fork show --json` of `id` once `done(doc)` holds (bounded).
fn wait_for(fleet: &Fleet, id: &str, what: &str, done: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + COMMAND_LIMIT;
    loop {
        let shown = fleet.client(&["fork", "show", id, "--json"]);
        if shown.code == Some(0) {
            let doc = shown.json();
            if done(&doc) {
                return doc;
            }
        }
        assert!(
            Instant::now() < deadline,
            "{what} did not happen: {}\n{}",
            shown.stdout,
            fleet.logs()
        );
        std::thread::sleep(POLL);
    }
}

fn state_of(doc: &Value, label: &str) -> String {
    branch(doc, label)["state"]
        .as_str()
        .unwrap_or("")
        .to_string()
}

#[test]
fn cluster_requests_hold_nothing_survive_a_coordinator_restart_and_resume_anywhere() {
    // One worker with one slot: the free branch can only run once the gated one gave its
    // slot up.
    let mut fleet = Fleet::start(
        1,
        1,
        Options {
            ack_wait_s: Some(SHORT_ACK_WAIT_S),
            ..Options::default()
        },
    );
    let dir = fleet.dir.path().to_path_buf();
    std::fs::create_dir_all(dir.join("workspace")).unwrap();
    // A strict cap: every call reserves first.
    let spec = write_spec(&dir, "ap", 600, "aggregate_budget_usd = 1.0");
    let id = fleet.create(&spec);
    let doc = wait_for(&fleet, &id, "gated waits, free finishes", |d| {
        state_of(d, "gated") == "awaiting_approval" && state_of(d, "free") == "done"
    });
    assert_eq!(branch(&doc, "gated")["approval"]["tool"], "delete_file");
    // Nothing is held while it waits: no reservation, no running branch on the worker.
    let cost = fleet.client(&["fork", "cost", &id, "--json"]).json();
    assert_eq!(cost["reserved_usd"].as_f64(), Some(0.0), "{cost}");
    // The worker's first heartbeat after the branch stopped says it runs nothing (an
    // earlier one could predate the request).
    let stopped_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let deadline = Instant::now() + COMMAND_LIMIT;
    let workers = loop {
        let w = fleet.client(&["workers", "--json"]).json();
        if w[0]["heartbeat_at_ms"].as_u64() > Some(stopped_ms) {
            break w;
        }
        assert!(Instant::now() < deadline, "no heartbeat\n{}", fleet.logs());
        std::thread::sleep(POLL);
    };
    assert_eq!(
        workers[0]["running"].as_array().map(Vec::len),
        Some(0),
        "{workers}"
    );

    // The coordinator is killed and started again: the request is still there.
    fleet.coordinator.kill();
    fleet.coordinator = fleet.spawn_coordinator("coordinator-2");
    let deadline = Instant::now() + COMMAND_LIMIT;
    let request = loop {
        let listed = fleet.client(&["approvals", "--json"]);
        if listed.code == Some(0) {
            let list = listed.json();
            if let Some(first) = list.as_array().and_then(|l| l.first()) {
                break first.clone();
            }
        }
        assert!(
            Instant::now() < deadline,
            "no request after the restart\n{}",
            fleet.logs()
        );
        std::thread::sleep(POLL);
    };
    assert_eq!(request["label"], "gated");
    assert_eq!(request["fork_id"], id.as_str());
    let call = request["call_id"].as_str().unwrap().to_string();

    // Another worker takes over; the first goes away. The approved call runs there.
    let other = fleet.spawn_worker("worker-b");
    fleet.workers[0].kill();
    fleet.workers = vec![other];
    let approved = fleet.client(&["fork", "approve", &id, "gated", &call, "--json"]);
    assert_eq!(
        approved.code,
        Some(0),
        "{}\n{}",
        approved.stderr,
        fleet.logs()
    );
    let doc = wait_for(&fleet, &id, "the delete ran and the migration waits", |d| {
        state_of(d, "gated") == "awaiting_approval"
            && branch(d, "gated")["approval"]["tool"] == "write_file"
    });
    assert_eq!(branch(&doc, "gated")["changes"], 1, "{doc}");
    // A stale answer is refused.
    let stale = fleet.client(&["fork", "approve", &id, "gated", &call]);
    assert_eq!(stale.code, Some(2), "{}", stale.stderr);
    assert!(stale.stderr.contains("waits for call"), "{}", stale.stderr);
    let denied = fleet.client(&["fork", "deny", &id, "gated", "--reason", "not now"]);
    assert_eq!(denied.code, Some(0), "{}", denied.stderr);
    let doc = wait_for(&fleet, &id, "gated finishes", |d| {
        state_of(d, "gated") == "done"
    });
    assert_eq!(branch(&doc, "gated")["blocked"][0]["reason"], "not now");
    let merged = fleet.client(&[
        "fork",
        "merge",
        &id,
        "--pick",
        "gated",
        "--no-apply",
        "--json",
    ]);
    assert_eq!(merged.code, Some(0), "{}", merged.stderr);
    assert_eq!(merged.json()["blocked"][0]["tool"], "write_file");

    // A request nobody answers is decided by its timeout.
    let spec = write_spec(&dir, "timeout", 1, "");
    let id = fleet.create(&spec);
    let doc = wait_for(&fleet, &id, "both requests time out", |d| {
        state_of(d, "gated") == "done"
    });
    let blocked = branch(&doc, "gated")["blocked"].as_array().unwrap().clone();
    assert_eq!(blocked.len(), 2, "{doc}");
    assert!(blocked.iter().all(|b| b["by"] == "timeout"), "{doc}");

    // An auto resolve denies what waits rather than wait.
    let spec = write_spec(
        &dir,
        "auto",
        600,
        "strategy = \"auto\"\njudge_model = \"scripted:judge\"",
    );
    let id = fleet.create(&spec);
    wait_for(&fleet, &id, "gated waits", |d| {
        state_of(d, "gated") == "awaiting_approval" && state_of(d, "free") == "done"
    });
    let resolved = fleet.client(&["fork", "resolve", &id, "--no-apply", "--json"]);
    assert_eq!(
        resolved.code,
        Some(0),
        "{}\n{}",
        resolved.stderr,
        fleet.logs()
    );
    let doc = wait_for(&fleet, &id, "the fork is merged", |d| {
        d["state"] == "merged"
    });
    let blocked = branch(&doc, "gated")["blocked"].as_array().unwrap().clone();
    assert!(
        !blocked.is_empty() && blocked.iter().all(|b| b["by"] == "policy"),
        "{doc}"
    );

    // Terminate while waiting clears the request.
    let spec = write_spec(&dir, "stop", 600, "");
    let id = fleet.create(&spec);
    wait_for(&fleet, &id, "gated waits", |d| {
        state_of(d, "gated") == "awaiting_approval"
    });
    let ended = fleet.client(&["fork", "terminate", &id, "gated"]);
    assert_eq!(ended.code, Some(0), "{}", ended.stderr);
    let listed = fleet.client(&["approvals", &id, "--json"]);
    assert_eq!(listed.json().as_array().map(Vec::len), Some(0));
}

#[test]
fn fork_watch_on_a_terminal_asks_for_the_answers_inline() {
    let (_ex, data, _, fork) = waiting_fork();
    let data = data.as_str();
    // The pane stays after the watch ends, so its last lines can be read.
    let tmux = Tmux::start(&format!(
        "env RUST_LOG=warn {} fork watch {fork} --data {data} --timeout-s 120; echo WATCH-EXIT-$?; sleep 600",
        env!("CARGO_BIN_EXE_forkfleet")
    ));
    let prompt = "approve? [y]es / [n]o / [s]kip:";
    let screen = tmux.wait_for("the first request", |s| s.contains(prompt));
    assert!(
        screen.contains("branch `gated` asks to run delete_file"),
        "{screen}"
    );
    tmux.type_line("y");
    let screen = tmux.wait_for("the second request", |s| s.matches(prompt).count() == 2);
    assert!(screen.contains("approved `delete_file`"), "{screen}");
    assert!(
        screen.contains("branch `gated` asks to run write_file"),
        "{screen}"
    );
    tmux.type_line("n");
    tmux.wait_for("the reason's prompt", |s| {
        s.contains("reason (the model reads it")
    });
    tmux.type_line("not today");
    let screen = tmux.wait_for("the watch's end", |s| s.contains("WATCH-EXIT-"));
    assert!(screen.contains("WATCH-EXIT-0"), "{screen}");
    assert!(screen.contains("denied `write_file`"), "{screen}");
    let shown = json(&forkfleet(&[
        "fork", "show", &fork, "--data", data, "--json",
    ]));
    let gated = branch(&shown, "gated");
    assert_eq!(gated["state"], "done", "{shown}");
    assert_eq!(gated["blocked"][0]["reason"], "not today");
    assert_eq!(gated["blocked"][0]["by"], "admin");
}

/// `examples/approvals`, as docs/APPROVALS.md walks a new user through it.
#[test]
fn the_approvals_example_runs_as_documented() {
    let ex = Example::named("approvals");
    let data = path_str(&ex.data()).to_string();
    let data = data.as_str();
    let run = forkfleet(&["run", path_str(&ex.spec())]);
    assert_eq!(run.status.code(), Some(1), "{}", stderr(&run));
    assert!(
        stderr(&run).contains("careful: delete_file"),
        "{}",
        stderr(&run)
    );
    let fork = only_fork(data);
    let waiting = approvals(&["--data", data]);
    assert_eq!(waiting.len(), 1);
    assert_eq!(waiting[0]["label"], "careful");
    let approved = forkfleet(&["fork", "approve", &fork, "careful", "--data", data]);
    assert!(approved.status.success(), "{}", stderr(&approved));
    let waiting = approvals(&["--data", data]);
    assert_eq!(waiting[0]["rule"], "paths: migrations/**");
    let denied = forkfleet(&[
        "fork",
        "deny",
        &fork,
        "careful",
        "--reason",
        "no migrations today",
        "--data",
        data,
    ]);
    assert!(denied.status.success(), "{}", stderr(&denied));
    let shown = json(&forkfleet(&[
        "fork", "show", &fork, "--data", data, "--json",
    ]));
    for label in ["careful", "trusted"] {
        assert_eq!(branch(&shown, label)["state"], "done", "{shown}");
    }
    assert_eq!(
        branch(&shown, "careful")["blocked"][0]["reason"],
        "no migrations today"
    );
    assert_eq!(branch(&shown, "careful")["changes"], 1);
    assert_eq!(branch(&shown, "trusted")["changes"], 2);
}
