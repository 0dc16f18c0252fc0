//! Branches end to end through the LocalBus: events, file changes, blobs, usage, endings.

use super::common::*;
use bytes::Bytes;
use forkfleet_shared::blob::BlobHash;
use forkfleet_shared::event::{messages_from_events, Event, Usage};
use forkfleet_shared::manifest::{FileEntry, Node, MODE_FILE};
use forkfleet_shared::overlay::{ChangeOp, Overlay};
use forkfleet_shared::path::WsPath;
use forkfleet_shared::pricing::Price;
use forkfleet_shared::state::BranchState;
use forkfleet_worker::provider::{estimate_tokens, message_chars};
use std::collections::BTreeMap;

const WRITER: &str = r#"
[defaults]
usage = { input_tokens = 1000, output_tokens = 200 }

[[turns."*"]]
tool_calls = [{ name = "write_file", args = { path = "notes/{label}-{repeat}.md", content = "note {repeat} of {label}\n" } }]
repeat = 3

[[turns."*"]]
tool_calls = [
  { name = "edit_file", args = { path = "README.md", old_string = "draft", new_string = "final {label}" } },
  { name = "delete_file", args = { path = "old" } },
  { name = "edit_file", args = { path = "README.md", old_string = "not there", new_string = "x" } },
]

[[turns."*"]]
text = "done on {label}"
"#;

#[tokio::test]
async fn a_branch_runs_end_to_end() {
    let fx = Fixture::new().await;
    let (base, snap) = fx.snapshot(&[
        ("README.md", "# project\nstatus: draft\n"),
        ("old/a.txt", "a\n"),
        ("old/b.txt", "b\n"),
    ]);
    let script = fx.script(WRITER);
    let mut task = fx.task("alpha", 0, snap, script);
    task.price = Some(Price {
        input_per_mtok: 1.0,
        output_per_mtok: 2.0,
        cached_per_mtok: None,
        cache_write_per_mtok: None,
    });
    fx.enqueue(&task).await;
    let mut events = fx.events().await;
    let worker = start(&fx, config(4)).await;
    events.until_terminal(&[task.run_id]).await;
    shutdown(worker).await;

    let published = &events.by_run[&task.run_id];
    // Seqs contiguous from first_seq; all of this fork; running first, terminal last.
    for (i, e) in published.iter().enumerate() {
        assert_eq!(e.seq, task.first_seq + i as u64, "seq gap at {i}");
        assert_eq!(e.fork_id, task.fork_id);
        assert!(e.at_ms > 0);
    }
    assert!(matches!(
        published[0].event,
        Event::Status {
            state: BranchState::Running,
            error: None
        }
    ));
    assert_eq!(
        events.terminal(task.run_id),
        Some((BranchState::Done, None))
    );
    assert!(matches!(
        published.last().unwrap().event,
        Event::Status {
            state: BranchState::Done,
            ..
        }
    ));

    // Every model call is followed by its usage, priced.
    let log = events.of(task.run_id);
    assert_eq!(events.count(task.run_id, "model_response"), 5);
    assert_eq!(events.count(task.run_id, "usage"), 5);
    let price = task.price.unwrap();
    for (i, e) in log.iter().enumerate() {
        if let Event::ModelResponse { model, .. } = e {
            assert_eq!(model, "scripted:test");
            // The call's usage is recorded first, so a lost response still counts.
            match &log[i - 1] {
                Event::Usage {
                    model,
                    usage,
                    cost_usd,
                    reservation,
                    cached: false,
                } => {
                    assert_eq!(*reservation, None, "no reservation without strict mode");
                    assert_eq!(model, "scripted:test");
                    assert_eq!(usage.input_tokens, 1000);
                    assert_eq!(usage.output_tokens, 200);
                    assert!((cost_usd - price.cost(usage)).abs() < 1e-12);
                }
                other => panic!("expected usage before a model response, got {other:?}"),
            }
        }
    }
    assert!(matches!(&log[log.len() - 3], Event::Usage { .. }));
    assert!(matches!(&log[log.len() - 2], Event::ModelResponse { .. }));

    // Tool results: three writes, two good edits/deletes, one failed edit.
    let results: Vec<(String, bool, String)> = log
        .iter()
        .filter_map(|e| match e {
            Event::ToolResult {
                name, ok, output, ..
            } => Some((name.clone(), *ok, output.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(results.len(), 6);
    assert!(results[..5].iter().all(|r| r.1), "{results:?}");
    assert!(!results[5].1);
    assert!(results[5].2.contains("not found"), "{}", results[5].2);

    // Each tool's file changes come right before its result.
    let kinds: Vec<&str> = log.iter().map(|e| e.kind()).collect();
    let first_write = kinds.iter().position(|k| *k == "file_change").unwrap();
    assert_eq!(kinds[first_write + 1], "tool_result");

    // Replaying the published file changes reproduces the branch's workspace.
    let changes: Vec<ChangeOp> = log
        .iter()
        .filter_map(|e| match e {
            Event::FileChange { change } => Some(change.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(changes.len(), 5);
    let replica = Overlay::from_log(base, &changes).unwrap();
    let mut files = BTreeMap::new();
    for (path, entry) in replica.files() {
        // Every written blob is in the store.
        let bytes = fx
            .bus
            .blobs()
            .get(&entry.hash)
            .await
            .unwrap()
            .expect("blob stored");
        files.insert(path.to_string(), String::from_utf8(bytes.to_vec()).unwrap());
    }
    let expected: BTreeMap<String, String> = [
        ("README.md", "# project\nstatus: final alpha\n"),
        ("notes/alpha-0.md", "note 0 of alpha\n"),
        ("notes/alpha-1.md", "note 1 of alpha\n"),
        ("notes/alpha-2.md", "note 2 of alpha\n"),
    ]
    .into_iter()
    .map(|(a, b)| (a.to_string(), b.to_string()))
    .collect();
    assert_eq!(files, expected);
    assert_eq!(replica.node(&WsPath::parse("old").unwrap()), Node::Missing);

    // The task was acked.
    assert_eq!(fx.pending().await, 0);
}

#[tokio::test]
async fn usage_is_estimated_from_the_history_the_model_saw() {
    let fx = Fixture::new().await;
    let (_, snap) = fx.snapshot(&[]);
    let script = fx.script(
        r#"
[[turns."*"]]
tool_calls = [{ name = "write_file", args = { path = "a.txt", content = "0123456789" } }]

[[turns."*"]]
text = "finished"
"#,
    );
    let task = fx.task("est", 0, snap, script);
    fx.enqueue(&task).await;
    let mut events = fx.events().await;
    let worker = start(&fx, config(1)).await;
    events.until_terminal(&[task.run_id]).await;
    shutdown(worker).await;

    let mut seen = fx.initial_log(&task);
    let mut checked = 0;
    for e in events.of(task.run_id) {
        if let Event::Usage {
            usage, cost_usd, ..
        } = &e
        {
            // The usage comes before its response; the request was everything before it.
            let request = &seen[..];
            let chars = message_chars(&messages_from_events(request));
            assert_eq!(usage.input_tokens, estimate_tokens(chars));
            assert_eq!(*cost_usd, 0.0, "no price, no cost");
            checked += 1;
        }
        seen.push(e);
    }
    assert_eq!(checked, 2);
    let first = events
        .of(task.run_id)
        .into_iter()
        .find_map(|e| match e {
            Event::Usage { usage, .. } => Some(usage),
            _ => None,
        })
        .unwrap();
    assert!(first.output_tokens > 0);
}

#[tokio::test]
async fn an_exhausted_script_fails_the_branch_with_a_clear_error() {
    let fx = Fixture::new().await;
    let (_, snap) = fx.snapshot(&[]);
    let script = fx.script(
        r#"
[[turns."*"]]
tool_calls = [{ name = "list_files", args = {} }]
"#,
    );
    let task = fx.task("short", 0, snap, script);
    fx.enqueue(&task).await;
    let mut events = fx.events().await;
    let worker = start(&fx, config(1)).await;
    events.until_terminal(&[task.run_id]).await;
    shutdown(worker).await;
    let (state, error) = events.terminal(task.run_id).unwrap();
    assert_eq!(state, BranchState::Failed);
    let error = error.unwrap();
    assert!(error.contains("model call failed"), "{error}");
    assert!(
        error.contains("`short`") && error.contains("after the script ended"),
        "{error}"
    );
    assert_eq!(events.count(task.run_id, "model_response"), 1);
    assert_eq!(fx.pending().await, 0);
}

#[tokio::test]
async fn max_turns_stops_the_branch_and_keeps_its_work() {
    let fx = Fixture::new().await;
    let (_, snap) = fx.snapshot(&[]);
    let script = fx.script(
        r#"
[[turns."*"]]
tool_calls = [{ name = "write_file", args = { path = "t{turn}.txt", content = "x" } }]
repeat = 10
"#,
    );
    let mut task = fx.task("capped", 0, snap, script);
    task.max_turns = 2;
    fx.enqueue(&task).await;
    let mut events = fx.events().await;
    let worker = start(&fx, config(1)).await;
    events.until_terminal(&[task.run_id]).await;
    shutdown(worker).await;
    assert_eq!(
        events.terminal(task.run_id),
        Some((BranchState::Failed, Some("max_turns (2) reached".into())))
    );
    assert_eq!(events.count(task.run_id, "model_response"), 2);
    assert_eq!(events.count(task.run_id, "file_change"), 2);
}

#[tokio::test]
async fn a_branch_budget_stops_the_branch_before_the_next_call() {
    let fx = Fixture::new().await;
    let (_, snap) = fx.snapshot(&[]);
    let script = fx.script(
        r#"
[defaults]
usage = { input_tokens = 1000000, output_tokens = 0 }

[[turns."*"]]
tool_calls = [{ name = "write_file", args = { path = "t{turn}.txt", content = "x" } }]
repeat = 10
"#,
    );
    let mut task = fx.task("spender", 0, snap, script);
    // $1 per call; a $1.50 budget allows two calls.
    task.price = Some(Price {
        input_per_mtok: 1.0,
        output_per_mtok: 1.0,
        cached_per_mtok: None,
        cache_write_per_mtok: None,
    });
    task.budget_usd = Some(1.5);
    fx.enqueue(&task).await;
    let mut events = fx.events().await;
    let worker = start(&fx, config(1)).await;
    events.until_terminal(&[task.run_id]).await;
    shutdown(worker).await;
    let (state, error) = events.terminal(task.run_id).unwrap();
    assert_eq!(state, BranchState::BudgetExhausted);
    assert!(error.unwrap().contains("budget"));
    assert_eq!(events.count(task.run_id, "model_response"), 2);
}

#[tokio::test]
async fn a_task_that_cannot_load_fails_with_the_reason() {
    let fx = Fixture::new().await;
    let (_, snap) = fx.snapshot(&[]);
    let script = fx.script("[[turns.\"*\"]]\ntext = \"hi\"");
    let mut missing_prefix = fx.task("noprefix", 0, snap, script);
    missing_prefix.prefix = BlobHash::of(b"never stored");
    let mut unknown_model = fx.task("nomodel", 1, snap, script);
    unknown_model.model = "mystery:big".into();
    let bad_script = fx.task("badscript", 2, snap, fx.script("[[turns.x]]\ntxt = 1"));
    for t in [&missing_prefix, &unknown_model, &bad_script] {
        fx.enqueue(t).await;
    }
    let mut events = fx.events().await;
    let worker = start(&fx, config(4)).await;
    let runs = [
        missing_prefix.run_id,
        unknown_model.run_id,
        bad_script.run_id,
    ];
    events.until_terminal(&runs).await;
    shutdown(worker).await;

    let err = |run| {
        let (state, error) = events.terminal(run).unwrap();
        assert_eq!(state, BranchState::Failed);
        error.unwrap()
    };
    let e = err(missing_prefix.run_id);
    assert!(
        e.contains("history prefix") && e.contains("not in the store"),
        "{e}"
    );
    let e = err(unknown_model.run_id);
    assert!(
        e.contains("unknown provider `mystery`") && e.contains("scripted"),
        "{e}"
    );
    let e = err(bad_script.run_id);
    assert!(e.contains("invalid script"), "{e}");
    // Running first, then the failure: two events each, from first_seq.
    for run in runs {
        assert_eq!(events.by_run[&run].len(), 2);
    }
    assert_eq!(fx.pending().await, 0);
}

#[tokio::test]
async fn a_resumed_branch_continues_from_its_log() {
    let fx = Fixture::new().await;
    let (_, snap) = fx.snapshot(&[("keep.txt", "kept\n")]);
    let script = fx.script(
        r#"
[[turns."*"]]
tool_calls = [{ name = "write_file", args = { path = "first.txt", content = "one" } }]

[[turns."*"]]
tool_calls = [{ name = "read_file", args = { path = "first.txt" } }]

[[turns."*"]]
text = "resumed at turn {turn}"
"#,
    );
    let mut task = fx.task("resume", 0, snap, script);
    // The log already holds the first turn, as the coordinator would send it.
    let bytes = Bytes::from_static(b"one");
    fx.store.insert(bytes.clone());
    let entry = FileEntry::for_bytes(&bytes, MODE_FILE);
    task.tail.extend([
        Event::Status {
            state: BranchState::Running,
            error: None,
        },
        Event::ModelResponse {
            model: "scripted:test".into(),
            text: None,
            tool_calls: vec![],
            request: None,
            finish_reason: None,
            reasoning: None,
        },
        Event::Usage {
            model: "scripted:test".into(),
            usage: Usage::default(),
            cost_usd: 0.25,
            reservation: None,
            cached: false,
        },
        Event::FileChange {
            change: ChangeOp::Write {
                path: WsPath::parse("first.txt").unwrap(),
                entry,
            },
        },
    ]);
    task.first_seq += 4;
    fx.enqueue(&task).await;
    let mut events = fx.events().await;
    let worker = start(&fx, config(1)).await;
    events.until_terminal(&[task.run_id]).await;
    shutdown(worker).await;

    let log = events.of(task.run_id);
    let read = log
        .iter()
        .find_map(|e| match e {
            Event::ToolResult {
                name, ok, output, ..
            } if name == "read_file" => Some((*ok, output.clone())),
            _ => None,
        })
        .unwrap();
    assert!(read.0 && read.1.contains("one"), "{read:?}");
    let last_text = log
        .iter()
        .rev()
        .find_map(|e| match e {
            Event::ModelResponse { text, .. } => text.clone(),
            _ => None,
        })
        .unwrap();
    assert_eq!(last_text, "resumed at turn 2");
    assert_eq!(events.by_run[&task.run_id][0].seq, task.first_seq);
}

/// A coordinator that reads batches (the task's `event_batches`) gets what a branch
/// publishes between two flushes as one message; one that predates them gets one message
/// per event. The events, and their order, are the same. On a cluster the texts a turn
/// writes travel with its events.
#[tokio::test]
async fn a_flushs_events_are_one_message_when_the_coordinator_reads_batches() {
    let mut logs = Vec::new();
    for batches in [true, false] {
        let fx = Fixture::new().await;
        let (_, snap) = fx.snapshot(&[("README.md", "# project\nstatus: draft\n")]);
        let mut task = fx.task("alpha", 0, snap, fx.script(WRITER));
        task.event_batches = batches;
        fx.enqueue(&task).await;
        let mut events = fx.events().await;
        let worker = start(&fx, config(1)).await;
        events.until_terminal(&[task.run_id]).await;
        shutdown(worker).await;
        let published = &events.by_run[&task.run_id];
        for (i, e) in published.iter().enumerate() {
            assert_eq!(e.seq, task.first_seq + i as u64, "seq gap at {i}");
        }
        let n = published.len();
        // The texts the branch wrote, each sent along with its events on a cluster.
        let written: std::collections::BTreeSet<BlobHash> = published
            .iter()
            .filter_map(|e| match &e.event {
                Event::FileChange { change } => change.written().map(|w| w.hash),
                _ => None,
            })
            .collect();
        let sent: std::collections::BTreeSet<BlobHash> =
            events.sent_blobs.iter().map(|b| BlobHash::of(b)).collect();
        if batches {
            // Five model turns: a turn's usage, answer, changes and results go together.
            assert!(
                events.messages * 2 < n,
                "{} messages for {n} events",
                events.messages
            );
            if fx.bus.remote() {
                assert_eq!(sent, written);
            } else {
                assert!(sent.is_empty());
            }
        } else {
            assert_eq!(events.messages, n);
            assert!(sent.is_empty());
        }
        logs.push(
            published
                .iter()
                .map(|e| e.event.kind().to_string())
                .collect::<Vec<_>>(),
        );
    }
    assert_eq!(logs[0], logs[1]);
}
