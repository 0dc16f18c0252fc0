//! Steering running branches and follow-up turns of finished ones (ADR 13), end to end:
//! the embedded system (coordinator, real workers, the scripted model) through the client
//! every CLI command uses, and the `forkfleet fork steer` / `fork continue` commands.

use super::fleet::{Fleet, Options, COMMAND_LIMIT, POLL};
use super::harness::{branch, forkfleet, json, path_str, stderr, Example};
use forkfleet::embedded::{Embedded, EmbeddedOptions};
use forkfleet_client::workspace as ws;
use forkfleet_client::{ApiClient, Client, ClientError};
use forkfleet_shared::api::{ApiErrorKind, CreateFork, ForkView, LoggedEvent, ParentRun};
use forkfleet_shared::diff::DiffOptions;
use forkfleet_shared::event::{messages_from_events, Event, Message};
use forkfleet_shared::ids::ForkId;
use forkfleet_shared::spec;
use forkfleet_shared::state::{BranchState, ForkState};
use forkfleet_worker::provider::{estimate_tokens, message_chars};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Bound of every wait in these tests.
const LIMIT: Duration = Duration::from_secs(60);

/// Branch `a` answers in two calls a turn (a write, then a text): two turns' worth. `slow`
/// writes a file every 50 ms `SLOW_CALLS` times, then answers. No
/// usage in the script: the model measures each call's input over the messages it gets.
const SCRIPT: &str = r#"
[[turns.a]]
tool_calls = [{ name = "write_file", args = { path = "a/first.txt", content = "1\n" } }]

[[turns.a]]
text = "a: first turn done"

[[turns.a]]
tool_calls = [{ name = "write_file", args = { path = "a/second.txt", content = "2\n" } }]

[[turns.a]]
text = "a: second turn done"

[[turns.slow]]
tool_calls = [{ name = "write_file", args = { path = "slow/{repeat}.txt", content = "x\n" } }]
repeat = SLOW_CALLS
latency_ms = 50

[[turns.slow]]
text = "slow done"
"#;

/// A spec of branches `a` and `slow` playing [`SCRIPT`] in `ex`: `slow` makes 60 calls
/// (3 s) and answers.
fn spec(ex: &Example) -> PathBuf {
    spec_with(ex, 60)
}

/// [`spec`] with `slow` making `calls` calls (at 50 ms each) before it answers.
fn spec_with(ex: &Example, calls: u32) -> PathBuf {
    let script = SCRIPT.replace("SLOW_CALLS", &calls.to_string());
    std::fs::write(ex.dir.path().join("turns.toml"), script).unwrap();
    ex.write_spec(&format!(
        "goal = \"two turns\"\nworkspace = \"workspace\"\nmodel = \"scripted:turns\"\nmax_turns = 2\n\
         [models.\"scripted:turns\"]\nscript = \"turns.toml\"\n\
         [[branches]]\nlabel = \"a\"\nsteer = \"go\"\n\
         [[branches]]\nlabel = \"slow\"\nsteer = \"go slowly\"\nmax_turns = {}\n",
        calls + 2
    ))
}

async fn create(coord: &Client, spec_path: &Path) -> ForkView {
    let loaded = spec::load(spec_path).unwrap();
    let (_, upload) = ws::upload_workspace(
        coord.blobs().as_ref(),
        &loaded.workspace,
        &loaded.scan,
        loaded.blobs.clone(),
    )
    .await
    .unwrap();
    coord
        .call(CreateFork {
            plan: loaded.plan,
            parent: ParentRun::New,
            snapshot: upload.snapshot,
            workspace: Some(loaded.workspace.display().to_string()),
            left_out: None,
            git: None,
        })
        .await
        .unwrap()
}

/// Follow the fork until `done` holds for its view (bounded by [`LIMIT`]).
async fn until(coord: &Client, id: ForkId, done: impl Fn(&ForkView) -> bool) -> ForkView {
    tokio::time::timeout(LIMIT, async {
        let mut seen = None;
        loop {
            let w = coord.watch(id, seen, Duration::from_secs(5)).await.unwrap();
            seen = Some(w.version);
            if done(&w.view) {
                return w.view;
            }
        }
    })
    .await
    .expect("the fork got there in time")
}

fn state(v: &ForkView, label: &str) -> BranchState {
    v.branch(label).unwrap().state
}

/// The request failed with an API error of `kind` whose message mentions `hint`.
fn refused<T: std::fmt::Debug>(result: Result<T, ClientError>, kind: ApiErrorKind, hint: &str) {
    match result.unwrap_err() {
        ClientError::Call(forkfleet_bus::apicall::CallError::Api(e)) => {
            assert_eq!(e.kind, kind, "{e:?}");
            assert!(e.message.contains(hint), "{}", e.message);
        }
        other => panic!("expected an API error, got {other:?}"),
    }
}

/// An embedded system (real workers, the scripted model) over `ex`'s data, its client,
/// and a fork of [`spec`] made through it.
async fn start(ex: &Example) -> (Embedded, Client, ForkId) {
    let system = Embedded::start_with_usage_log(&ex.data(), EmbeddedOptions::default(), None)
        .await
        .unwrap();
    let coord = system.client();
    // `slow` would run for five minutes: it is running whenever the test acts, until the
    // test terminates it.
    let id = create(&coord, &spec_with(ex, 6000)).await.fork_id;
    (system, coord, id)
}

/// Every `usage` event of a log measured its call's input over the history before it (the
/// log from seq 1): the messages the model got. Returns those histories, one per call.
fn requests(log: &[LoggedEvent]) -> Vec<Vec<Message>> {
    let mut out = Vec::new();
    for (k, e) in log.iter().enumerate() {
        if let Event::Usage { usage, .. } = &e.event {
            let messages = messages_from_events(log[1..k].iter().map(|e| &e.event));
            assert_eq!(
                usage.input_tokens,
                estimate_tokens(message_chars(&messages)),
                "call at seq {}: its request was not the history before it",
                e.seq
            );
            out.push(messages);
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_steer_reaches_the_running_branch_before_its_next_call() {
    let ex = Example::quickstart();
    let (system, coord, id) = start(&ex).await;
    // Once `slow` has made a call it is mid-run: steer it.
    until(&coord, id, |v| v.branch("slow").unwrap().turns >= 1).await;
    let text = "stop writing numbered files and summarise instead";
    let sent = coord.steer(id, "slow", text).await.unwrap();
    assert_eq!(sent.state, BranchState::Running);
    let steered_at = coord.fork(id).await.unwrap().branch("slow").unwrap().turns;
    // An unknown label is not found (the valid ones named) and goes nowhere.
    refused(
        coord.steer(id, "nope", "lost").await,
        ApiErrorKind::NotFound,
        "a, slow",
    );

    // Two calls later the steer has been applied: stop the branch and read its log.
    until(&coord, id, |v| {
        v.branch("slow").unwrap().turns >= steered_at + 2
    })
    .await;
    coord.terminate(id, "slow").await.unwrap();
    let view = until(&coord, id, ForkView::settled).await;
    assert_eq!(state(&view, "slow"), BranchState::Terminated);
    let slow = coord
        .run_events(view.branch("slow").unwrap().run_id)
        .await
        .unwrap();
    let at = slow
        .iter()
        .position(|e| matches!(&e.event, Event::Steer { text: t } if t == text))
        .expect("the steer is in the branch's log");
    assert!(
        slow[at..]
            .iter()
            .any(|e| e.event.kind() == "model_response"),
        "a model call followed the steer"
    );
    // The next request after it held it, as a user message, last.
    let next_usage = slow[at..]
        .iter()
        .position(|e| e.event.kind() == "usage")
        .map(|i| at + i)
        .expect("a call after the steer");
    let calls = requests(&slow);
    let index = slow[..next_usage]
        .iter()
        .filter(|e| e.event.kind() == "usage")
        .count();
    assert_eq!(
        calls[index].last(),
        Some(&Message::User { text: text.into() })
    );
    // Nothing reached the other branch (its only steer is the spec's).
    let a = coord
        .run_events(view.branch("a").unwrap().run_id)
        .await
        .unwrap();
    let steers: Vec<&str> = a
        .iter()
        .filter_map(|e| match &e.event {
            Event::Steer { text } => Some(text.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(steers, ["go"]);
    // A finished branch is not steered: it is continued.
    refused(
        coord.steer(id, "slow", "late").await,
        ApiErrorKind::Conflict,
        "fork continue",
    );
    system.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follow_up_turn_runs_on_the_whole_history_and_merges_with_the_first() {
    let ex = Example::quickstart();
    let (system, coord, id) = start(&ex).await;
    let view = until(&coord, id, |v| state(v, "a") == BranchState::Done).await;
    assert_eq!(view.branch("a").unwrap().turns, 2);
    // `slow` still runs: it cannot be continued (it is steered).
    assert!(!state(&view, "slow").is_terminal());
    refused(
        coord.continue_branch(id, "slow", "more").await,
        ApiErrorKind::Conflict,
        "steer",
    );
    coord.terminate(id, "slow").await.unwrap();
    until(&coord, id, |v| v.state == ForkState::Settled).await;

    let text = "now write the second file";
    let out = coord.continue_branch(id, "a", text).await.unwrap();
    assert_eq!(out.previous, BranchState::Done);
    assert_eq!(out.branch.state, BranchState::Pending);
    assert_eq!(out.fork_state, ForkState::Open);
    let view = until(&coord, id, |v| v.state == ForkState::Settled).await;
    let a = view.branch("a").unwrap().clone();
    assert_eq!((a.state, a.turns, a.changes), (BranchState::Done, 4, 2));

    // The log: the first turn, the follow-up, the second turn; the second turn's first
    // call got the whole history with the follow-up last.
    let log = coord.run_events(a.run_id).await.unwrap();
    let follow = log
        .iter()
        .position(|e| matches!(&e.event, Event::FollowUp { text: t } if t == text))
        .expect("the follow-up is in the log");
    assert_eq!(log[follow].seq, out.seq);
    assert_eq!(log[follow + 1].event.kind(), "status", "running again");
    let calls = requests(&log);
    assert_eq!(calls.len(), 4);
    assert_eq!(calls[2].last(), Some(&Message::User { text: text.into() }));
    assert!(calls[2].starts_with(&calls[1]), "the whole history");
    assert!(matches!(
        &log.last().unwrap().event,
        Event::Status {
            state: BranchState::Done,
            ..
        }
    ));

    // One overlay: the diff and the merge hold both turns' files.
    let diff = coord.diff(id, DiffOptions::default()).await.unwrap();
    let paths: Vec<String> = diff.paths.iter().map(|p| p.path.to_string()).collect();
    assert!(paths.contains(&"a/first.txt".to_string()), "{paths:?}");
    assert!(paths.contains(&"a/second.txt".to_string()), "{paths:?}");
    let merged = coord.merge(id, "a").await.unwrap();
    let changed: Vec<String> = merged
        .changes
        .iter()
        .map(|c| c.path().to_string())
        .collect();
    assert_eq!(changed, ["a/first.txt", "a/second.txt"]);
    refused(
        coord.continue_branch(id, "slow", "more").await,
        ApiErrorKind::Conflict,
        "merged",
    );
    // (The client holds the store open: drop it before the system goes.)
    drop(coord);
    system.shutdown().await.unwrap();

    // Another process over the same store sees the same fork.
    let again = Embedded::start(
        &ex.data(),
        EmbeddedOptions {
            workers: 0,
            concurrency: 1,
            requeue_unfinished: false,
            ..EmbeddedOptions::default()
        },
    )
    .await
    .unwrap();
    let reloaded = again.client().fork(id).await.unwrap();
    assert_eq!(reloaded.branch("a").unwrap(), &a);
    assert!(matches!(reloaded.state, ForkState::Merged { .. }));
    again.shutdown().await.unwrap();
}

#[test]
fn fork_continue_runs_the_new_turn_here_and_prints_its_final_text() {
    let ex = Example::quickstart();
    let spec_path = spec(&ex);
    let data = ex.data();
    let data = path_str(&data);
    let created = json(&forkfleet(&[
        "run",
        path_str(&spec_path),
        "--json",
        "--timeout-s",
        "60",
    ]));
    assert_eq!(created["state"], "settled");
    let id = created["fork_id"].as_str().unwrap().to_string();
    let run = created["branches"][0]["id"].as_str().unwrap().to_string();
    assert_eq!(created["branches"][0]["label"], "a");

    // Refused before anything runs: an empty message, an unknown label, a steer of a
    // finished branch.
    let out = forkfleet(&["fork", "continue", &id, "a", " ", "--data", data]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let out = forkfleet(&["fork", "steer", &id, "zz", "hi", "--data", data]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("a, slow"), "{}", stderr(&out));
    let out = forkfleet(&["fork", "steer", &id, "a", "hi", "--data", data]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("fork continue"), "{}", stderr(&out));

    // Embedded, the turn runs in the command, which prints how it ended.
    let done = json(&forkfleet(&[
        "fork",
        "continue",
        &id[..13],
        "a",
        "now write the second file",
        "--data",
        data,
        "--json",
        "--timeout-s",
        "60",
    ]));
    assert_eq!(done["previous"], "done");
    assert_eq!(done["state"], "pending");
    assert_eq!(done["final"]["state"], "done", "{done}");
    assert_eq!(done["final"]["text"], "a: second turn done");
    assert_eq!(done["final"]["turns"], 4);
    assert_eq!(done["final"]["changes"], 2);
    let log = json(&forkfleet(&["log", &run, "--data", data, "--json"]));
    let kinds: Vec<&str> = log
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["event"]["type"].as_str().unwrap())
        .collect();
    assert_eq!(kinds.iter().filter(|k| **k == "follow_up").count(), 1);
    let text = forkfleet(&["log", &run, "--data", data]);
    assert!(
        String::from_utf8_lossy(&text.stdout).contains("follow-up  now write the second file"),
        "{}",
        String::from_utf8_lossy(&text.stdout)
    );

    // In text: the turn runs here and fails (the script has no third turn): exit 1.
    let out = forkfleet(&["fork", "continue", &id, "a", "a third turn", "--data", data]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("continued: was done, now pending"),
        "{stdout}"
    );
    assert!(
        stdout.contains("branch `a` failed"),
        "the script has no third turn: {stdout}"
    );
    let merged = forkfleet(&[
        "fork",
        "merge",
        &id,
        "--pick",
        "a",
        "--no-apply",
        "--data",
        data,
    ]);
    assert_eq!(merged.status.code(), Some(0), "{}", stderr(&merged));
    let out = forkfleet(&["fork", "continue", &id, "slow", "more", "--data", data]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("merged"), "{}", stderr(&out));
}

/// Until `run`'s log holds an event `pred` accepts (bounded, polling the cluster).
fn wait_log(fleet: &Fleet, run: &str, pred: impl Fn(&Value) -> bool) -> Vec<Value> {
    let deadline = Instant::now() + COMMAND_LIMIT;
    loop {
        let log = fleet.log(run);
        if log.iter().any(&pred) {
            return log;
        }
        assert!(
            Instant::now() < deadline,
            "not in the log\n{}",
            fleet.logs()
        );
        std::thread::sleep(POLL);
    }
}

#[test]
fn on_a_cluster_a_steered_then_terminated_branch_is_continued_to_its_end() {
    let fleet = Fleet::start(1, 8, Options::default());
    let ex = Example::quickstart();
    let id = fleet.create(&spec(&ex));
    fleet.wait_progress(&id, 1);
    let shown = fleet.client(&["fork", "show", &id, "--json"]).json();
    let run = branch(&shown, "slow")["id"].as_str().unwrap().to_string();

    let text = "wrap it up soon";
    let sent = fleet
        .client(&["fork", "steer", &id, "slow", text, "--json"])
        .json();
    assert_eq!(sent["state"], "running", "{sent}");
    let is_steer = |e: &Value| e["event"]["type"] == "steer" && e["event"]["text"] == text;
    wait_log(&fleet, &run, is_steer);
    let t = fleet.client(&["fork", "terminate", &id, "slow"]);
    assert_eq!(t.code, Some(0), "{}", t.stderr);
    let settled = fleet.watch(&id);
    assert_eq!(branch(&settled, "slow")["state"], "terminated");

    // The new turn's worker reads the run's control stream from its start: neither the
    // terminate nor the steer of the first turn is for it.
    let done = fleet
        .client(&[
            "fork",
            "continue",
            &id,
            "slow",
            "go on to the end",
            "--wait",
            "--json",
            "--timeout-s",
            "50",
        ])
        .json();
    assert_eq!(done["previous"], "terminated");
    assert_eq!(done["final"]["state"], "done", "{done}\n{}", fleet.logs());
    assert_eq!(done["final"]["text"], "slow done");
    let log = fleet.log(&run);
    assert_eq!(
        log.iter().filter(|e| is_steer(e)).count(),
        1,
        "applied once"
    );
    let follow = log
        .iter()
        .position(|e| e["event"]["type"] == "follow_up")
        .expect("the follow-up");
    assert!(log[follow..]
        .iter()
        .any(|e| e["event"]["type"] == "model_response"));
    assert_eq!(fleet.watch(&id)["state"], "settled");
}
