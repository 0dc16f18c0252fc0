//! Checkpoints through the coordinator's API: automatic ones as branch events are applied
//! (eviction, redelivery, restart repair), rewinding a finished branch (its diff and its
//! merge follow) and a root run (a later fork copies the rewound history), and a new run
//! from a checkpoint.

use super::support::*;
use forkfleet_shared::api::{CheckpointKind, CheckpointView, ParentRun};
use forkfleet_shared::diff::DiffOptions;
use forkfleet_shared::event::{Event, ToolCall};
use forkfleet_shared::ids::{ForkId, RunId};
use forkfleet_shared::protocol::BranchTask;
use forkfleet_shared::spec::{CheckpointFrequency, CheckpointPolicy, ForkPlan};
use forkfleet_shared::state::BranchState;

fn with_policy(mut p: ForkPlan, frequency: CheckpointFrequency, max: u32) -> ForkPlan {
    p.limits.checkpoints = CheckpointPolicy {
        frequency,
        max_checkpoints: max,
    };
    p
}

fn response(text: &str, tool: Option<&str>) -> Event {
    Event::ModelResponse {
        model: MODEL.into(),
        text: Some(text.into()),
        tool_calls: tool
            .map(|name| ToolCall {
                id: format!("c-{text}"),
                name: name.into(),
                args: serde_json::json!({}),
            })
            .into_iter()
            .collect(),
        request: None,
        finish_reason: None,
        reasoning: None,
    }
}

fn tool_result(text: &str, name: &str) -> Event {
    Event::ToolResult {
        call_id: format!("c-{text}"),
        name: name.into(),
        ok: true,
        output: "ok".into(),
        request: None,
    }
}

/// `n` turns, each a response calling `write_file`, the file change (`f{i}.txt`) and the
/// tool's result; then a final answer and `done`. Returns the events from `first_seq`.
async fn tool_turns(fx: &Fixture, n: usize) -> Vec<Event> {
    let mut events = vec![Event::Status {
        state: BranchState::Running,
        error: None,
    }];
    for i in 1..=n {
        let text = format!("step {i}");
        events.push(response(&text, Some("write_file")));
        let write = Step::Write(format!("f{i}.txt"), format!("{i}\n"))
            .into_event(&fx.blobs())
            .await;
        events.push(write);
        events.push(tool_result(&text, "write_file"));
    }
    events.push(response("all done", None));
    events.push(Event::Status {
        state: BranchState::Done,
        error: None,
    });
    events
}

async fn publish_all(fx: &Fixture, task: &BranchTask, events: &[Event]) {
    for (seq, e) in (task.first_seq..).zip(events) {
        fx.publish(task.fork_id, task.run_id, seq, e.clone()).await;
    }
}

async fn finished(fx: &Fixture, id: ForkId, label: &str) {
    wait_view(&fx.h(), id, |v| {
        v.branch(label).is_some_and(|b| b.state.is_terminal())
    })
    .await;
}

async fn checkpoints(fx: &Fixture, run: RunId) -> Vec<CheckpointView> {
    within(fx.h().checkpoints(run)).await.unwrap()
}

fn labels(cps: &[CheckpointView]) -> Vec<String> {
    cps.iter().map(|c| c.label.clone()).collect()
}

#[tokio::test]
async fn every_tool_saves_after_each_tool_call_evicts_the_oldest_and_ignores_redelivery() {
    let mut fx = Fixture::start().await;
    let snap = fx.upload(&[("a.txt", "a\n")]).await;
    let plan = with_policy(plan(&["a"]), CheckpointFrequency::EveryTool, 3);
    let view = fx.create(plan, ParentRun::New, snap).await;
    let (task, d) = fx.pull().await;
    let events = tool_turns(&fx, 5).await;
    publish_all(&fx, &task, &events).await;
    // Every event delivered again (a worker's retry, a redelivery): applied once.
    publish_all(&fx, &task, &events).await;
    d.ack().await.unwrap();
    finished(&fx, view.fork_id, "a").await;
    let run = task.run_id;

    let cps = checkpoints(&fx, run).await;
    // Five tool calls, three kept: the two oldest were evicted.
    assert_eq!(
        labels(&cps),
        [
            "tool-3-write_file",
            "tool-4-write_file",
            "tool-5-write_file"
        ]
    );
    for (i, c) in cps.iter().enumerate() {
        let n = i as u64 + 3;
        // At the tool's result: running@first, then 3 events per turn.
        assert_eq!(c.seq, task.first_seq + 3 * n, "{c:?}");
        assert_eq!(c.kind, CheckpointKind::Auto);
        assert_eq!(c.turn, n as u32, "model calls made by then");
        assert_eq!(c.snapshot, view.snapshot);
        assert_eq!(c.base_seq, 0);
        assert_eq!(
            c.metadata.get("tool").map(String::as_str),
            Some("write_file")
        );
    }

    // A restart saves nothing twice and brings back nothing evicted.
    fx.restart().await;
    assert_eq!(checkpoints(&fx, run).await, cps);

    // A checkpoint lost between the events and its own write (a crash) is saved again on
    // load; one removed by hand is not.
    let store = fx.h().store().clone();
    assert!(store.remove_checkpoint(run, cps[2].id).unwrap());
    let removed = within(fx.h().checkpoint_remove(run, "tool-4-write_file"))
        .await
        .unwrap();
    assert_eq!(removed.id, cps[1].id);
    drop(store);
    fx.restart().await;
    let after = checkpoints(&fx, run).await;
    assert_eq!(labels(&after), ["tool-3-write_file", "tool-5-write_file"]);
    assert_eq!(after[1].seq, cps[2].seq);
    fx.restart().await;
    assert_eq!(labels(&checkpoints(&fx, run).await).len(), 2);
}

#[tokio::test]
async fn every_turn_saves_before_each_model_call_and_manual_only_saves_none() {
    let fx = Fixture::start().await;
    let snap = fx.upload(&[("a.txt", "a\n")]).await;
    let turns = with_policy(plan(&["a"]), CheckpointFrequency::EveryTurn, 20);
    let view = fx.create(turns, ParentRun::New, snap).await;
    let (task, d) = fx.pull().await;
    publish_all(&fx, &task, &tool_turns(&fx, 2).await).await;
    d.ack().await.unwrap();
    finished(&fx, view.fork_id, "a").await;
    let cps = checkpoints(&fx, task.run_id).await;
    assert_eq!(labels(&cps), ["turn-1", "turn-2", "turn-3"]);
    // Just before each response: running@first, then 3 events per turn.
    let seqs: Vec<u64> = cps.iter().map(|c| c.seq).collect();
    let f = task.first_seq;
    assert_eq!(seqs, [f, f + 3, f + 6]);
    let turns: Vec<u32> = cps.iter().map(|c| c.turn).collect();
    assert_eq!(turns, [0, 1, 2]);

    let manual = with_policy(plan(&["b"]), CheckpointFrequency::ManualOnly, 20);
    let view = fx.create(manual, ParentRun::New, snap).await;
    let (task, d) = fx.pull().await;
    publish_all(&fx, &task, &tool_turns(&fx, 2).await).await;
    d.ack().await.unwrap();
    finished(&fx, view.fork_id, "b").await;
    assert!(checkpoints(&fx, task.run_id).await.is_empty());
}

#[tokio::test]
async fn a_finished_branch_rewinds_its_history_and_files_and_a_merge_takes_the_rewound_work() {
    let mut fx = Fixture::start().await;
    let snap = fx.upload(&[("a.txt", "a\n")]).await;
    let plan = with_policy(plan(&["a", "b"]), CheckpointFrequency::EveryTool, 20);
    let view = fx.create(plan, ParentRun::New, snap).await;
    let id = view.fork_id;
    let mut tasks = Vec::new();
    for _ in 0..2 {
        let (task, d) = fx.pull().await;
        if task.label == "a" {
            publish_all(&fx, &task, &tool_turns(&fx, 2).await).await;
        } else {
            // `b` keeps running.
            fx.play(&task, vec![Step::Status(BranchState::Running)])
                .await;
        }
        d.ack().await.unwrap();
        tasks.push(task);
    }
    tasks.sort_by(|x, y| x.label.cmp(&y.label));
    let (a, b) = (&tasks[0], &tasks[1]);
    finished(&fx, id, "a").await;
    let h = fx.h();

    // A running branch cannot be rewound (a checkpoint can be saved on it).
    wait_view(&h, id, |v| {
        v.branch("b").unwrap().state == BranchState::Running
    })
    .await;
    within(h.checkpoint_save(b.run_id, "early", None))
        .await
        .unwrap();
    let err = within(h.rewind(b.run_id, "early", false))
        .await
        .unwrap_err();
    assert!(err.is_bad_input(), "{err}");
    assert!(err.to_string().contains("running"), "{err}");
    // An unknown label lists the valid ones.
    let err = within(h.rewind(a.run_id, "nope", true)).await.unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("tool-1-write_file") && msg.contains("tool-2-write_file"),
        "{msg}"
    );

    // A dry run says what would change and changes nothing.
    let log_before = within(h.run_events(a.run_id)).await.unwrap();
    let dry = within(h.rewind(a.run_id, "tool-1-write_file", true))
        .await
        .unwrap();
    assert!(!dry.rewound);
    let paths: Vec<String> = dry
        .changes
        .iter()
        .map(|c| format!("{} {}", c.kind(), c.path()))
        .collect();
    assert_eq!(paths, ["delete f2.txt"]);
    // The second turn (response, change, result), the answer and the status.
    assert_eq!(dry.dropped_events, 5);
    assert_eq!(within(h.run_events(a.run_id)).await.unwrap(), log_before);

    let done = within(h.rewind(a.run_id, "tool-1-write_file", false))
        .await
        .unwrap();
    assert!(done.rewound);
    let log = within(h.run_events(a.run_id)).await.unwrap();
    assert_eq!(log.len(), log_before.len() + 1);
    assert!(matches!(log.last().unwrap().1, Event::Rewind { .. }));
    assert_eq!(done.marker_seq, Some(log.len() as u64 - 1));
    // The replica follows: one change left, and the diff shows only f1.txt for `a`.
    let v = wait_view(&h, id, |v| v.branch("a").unwrap().changes == 1).await;
    assert_eq!(v.branch("a").unwrap().state, BranchState::Done);
    let diff = within(h.diff(id, DiffOptions::default())).await.unwrap();
    let touched: Vec<&str> = diff.paths.iter().map(|p| p.path.as_str()).collect();
    assert_eq!(touched, ["f1.txt"]);

    // And so does a restart.
    drop(h);
    fx.restart().await;
    let h = fx.h();
    let diff = within(h.diff(id, DiffOptions::default())).await.unwrap();
    let touched: Vec<&str> = diff.paths.iter().map(|p| p.path.as_str()).collect();
    assert_eq!(touched, ["f1.txt"]);

    // The merge takes the rewound branch: its files and its conversation up to tool 1.
    within(h.terminate(id, "b")).await.unwrap();
    let out = within(h.merge(id, "a")).await.unwrap();
    let written: Vec<&str> = out.changes.iter().map(|c| c.path().as_str()).collect();
    assert_eq!(written, ["f1.txt"]);
    let parent = within(h.run_events(view.parent_run)).await.unwrap();
    let texts: Vec<String> = parent
        .iter()
        .filter_map(|(_, e)| match e {
            Event::ModelResponse { text, .. } => text.clone(),
            _ => None,
        })
        .collect();
    assert!(texts.contains(&"step 1".to_string()), "{texts:?}");
    assert!(!texts.contains(&"step 2".to_string()), "{texts:?}");
    assert!(!texts.contains(&"all done".to_string()), "{texts:?}");
}

#[tokio::test]
async fn a_root_run_rewinds_across_a_merge_and_a_later_fork_copies_the_rewound_history() {
    let fx = Fixture::start().await;
    let snap = fx.upload(&[("a.txt", "a\n")]).await;
    let view = fx.create(plan(&["a"]), ParentRun::New, snap).await;
    let id = view.fork_id;
    fx.fake_worker(1, |t| simple(t, "new.txt")).await;
    finished(&fx, id, "a").await;
    let h = fx.h();
    let merged = within(h.merge(id, "a")).await.unwrap();
    let parent = view.parent_run;
    let cps = checkpoints(&fx, parent).await;
    let fork_label = forkfleet_coordinator::fork_checkpoint_label(id);
    let post_label = forkfleet_coordinator::post_fork_checkpoint_label(id);
    assert_eq!(labels(&cps), [fork_label.clone(), post_label.clone()]);
    assert_eq!(cps[1].snapshot, merged.merged_snapshot);
    assert_eq!(
        within(h.workspace(parent)).await.unwrap(),
        merged.merged_snapshot
    );

    let out = within(h.rewind(parent, &fork_label, false)).await.unwrap();
    assert_eq!(out.from_snapshot, merged.merged_snapshot);
    assert_eq!(out.to_snapshot, snap);
    let paths: Vec<String> = out
        .changes
        .iter()
        .map(|c| format!("{} {}", c.kind(), c.path()))
        .collect();
    assert_eq!(paths, ["delete new.txt"]);
    assert_eq!(within(h.workspace(parent)).await.unwrap(), snap);

    // A fork of the rewound run starts from the history at `fork:<id>`: no merged
    // conversation, no branch summary.
    let again = fx
        .create(plan(&["c"]), ParentRun::Existing { run_id: parent }, snap)
        .await;
    let c_run = again.branches[0].run_id;
    let c_log = within(h.run_events(c_run)).await.unwrap();
    assert!(
        !c_log
            .iter()
            .any(|(_, e)| matches!(e, Event::BranchSummary { .. })),
        "{c_log:?}"
    );
    assert!(!c_log.iter().any(
        |(_, e)| matches!(e, Event::ModelResponse { text: Some(t), .. } if t.starts_with("working on"))
    ));

    // Undo: back to `post-fork:<id>`, the merged version and conversation again.
    let redo = within(h.rewind(parent, &post_label, false)).await.unwrap();
    assert_eq!(redo.to_snapshot, merged.merged_snapshot);
    let paths: Vec<String> = redo
        .changes
        .iter()
        .map(|c| format!("{} {}", c.kind(), c.path()))
        .collect();
    assert_eq!(paths, ["write new.txt"]);

    // A new run from `post-fork:<id>`: the conversation up to it, the merged version.
    let new = within(h.fork_checkpoint(parent, &post_label))
        .await
        .unwrap();
    assert_eq!(new.snapshot, merged.merged_snapshot);
    let new_log = within(h.run_events(new.run_id)).await.unwrap();
    let parent_log = within(h.run_events(parent)).await.unwrap();
    let conversation: Vec<&Event> = parent_log
        .iter()
        .filter(|(s, e)| *s <= cps[1].seq && e.is_conversational())
        .map(|(_, e)| e)
        .collect();
    let copied: Vec<&Event> = new_log.iter().map(|(_, e)| e).collect();
    assert_eq!(copied, conversation);
    assert_eq!(new.events, new_log.len() as u64);
    let origin = checkpoints(&fx, new.run_id).await;
    assert_eq!(
        labels(&origin),
        [forkfleet_coordinator::origin_label(parent)]
    );
    assert_eq!(origin[0].seq, new.events - 1);
    assert_eq!(
        within(h.workspace(new.run_id)).await.unwrap(),
        merged.merged_snapshot
    );
}

/// What automatic checkpoints cost the coordinator: 500 branches x 10 tool calls already on
/// the stream when it starts (the apply path alone), with `every_tool` (evicting beyond 5)
/// and with `manual_only`. Ignored by default; run with
/// `cargo test -p forkfleet-coordinator --release -- --ignored --nocapture perf_auto`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore]
async fn perf_auto_checkpoints_on_the_apply_path() {
    let mut took = Vec::new();
    for frequency in [
        CheckpointFrequency::ManualOnly,
        CheckpointFrequency::EveryTool,
        CheckpointFrequency::ManualOnly,
        CheckpointFrequency::EveryTool,
    ] {
        let mut fx = Fixture::start().await;
        let snap = fx.upload(&[("README.md", "hello\n")]).await;
        let labels: Vec<String> = (0..500).map(|i| format!("b{i:04}")).collect();
        let refs: Vec<&str> = labels.iter().map(String::as_str).collect();
        let mut p = with_policy(plan(&refs), frequency, 5);
        p.limits.max_branches = 500;
        let view = fx.create(p, ParentRun::New, snap).await;
        let mut tasks = Vec::new();
        for _ in 0..500 {
            let (task, d) = fx.pull().await;
            d.ack().await.unwrap();
            tasks.push(task);
        }
        fx.stop().await;
        let events = tool_turns(&fx, 10).await;
        for task in &tasks {
            publish_all(&fx, task, &events).await;
        }
        let t0 = std::time::Instant::now();
        fx.restart().await;
        let h = fx.h();
        within(h.wait_settled(view.fork_id, T)).await.unwrap();
        let elapsed = t0.elapsed();
        let cps = within(h.checkpoints(tasks[0].run_id)).await.unwrap();
        let expected = if frequency == CheckpointFrequency::EveryTool {
            5
        } else {
            0
        };
        assert_eq!(cps.len(), expected);
        eprintln!(
            "perf_auto: {} events, {:?}: drained in {elapsed:?}",
            500 * events.len(),
            frequency
        );
        took.push((frequency, elapsed));
    }
    eprintln!("perf_auto: {took:?}");
}
