//! Control commands to running branches: terminate and steer.

use super::common::*;
use forkfleet_shared::event::{messages_from_events, Event, Message};
use forkfleet_shared::protocol::ControlCommand;
use forkfleet_shared::state::BranchState;
use forkfleet_worker::provider::{estimate_tokens, message_chars};

const SLOW: &str = r#"
[defaults]
latency_ms = 40

[[turns."*"]]
tool_calls = [{ name = "write_file", args = { path = "t{turn}.txt", content = "x" } }]
repeat = 100

[[turns."*"]]
text = "done"
"#;

#[tokio::test]
async fn terminate_stops_a_running_branch_and_keeps_its_work() {
    let fx = Fixture::new().await;
    let (_, snap) = fx.snapshot(&[]);
    let task = fx.task("long", 0, snap, fx.script(SLOW));
    fx.enqueue(&task).await;
    let mut events = fx.events().await;
    let worker = start(&fx, config(1)).await;
    // Once the branch has made a model call it is mid-run.
    events
        .until(|e| e.run_id == task.run_id && e.event.kind() == "model_response")
        .await;
    fx.send(
        task.run_id,
        ControlCommand::Terminate {
            reason: "user asked".into(),
        },
    )
    .await;
    events.until_terminal(&[task.run_id]).await;
    shutdown(worker).await;

    assert_eq!(
        events.terminal(task.run_id),
        Some((BranchState::Terminated, Some("user asked".into())))
    );
    let calls = events.count(task.run_id, "model_response");
    assert!((1..100).contains(&calls), "{calls} calls");
    // The work done so far was published, and the status is the last event.
    assert!(events.count(task.run_id, "file_change") >= 1);
    let published = &events.by_run[&task.run_id];
    assert_eq!(published.last().unwrap().event.kind(), "status");
    for (i, e) in published.iter().enumerate() {
        assert_eq!(e.seq, task.first_seq + i as u64);
    }
    assert_eq!(fx.pending().await, 0);
}

#[tokio::test]
async fn a_steer_enters_the_history_before_the_next_call() {
    let fx = Fixture::new().await;
    let (_, snap) = fx.snapshot(&[]);
    let script = fx.script(
        r#"
[defaults]
latency_ms = 40

[[turns."*"]]
tool_calls = [{ name = "write_file", args = { path = "t{turn}.txt", content = "x" } }]
repeat = 3

[[turns."*"]]
text = "done"
"#,
    );
    let task = fx.task("steered", 0, snap, script);
    fx.enqueue(&task).await;
    let mut events = fx.events().await;
    let worker = start(&fx, config(1)).await;
    events
        .until(|e| e.run_id == task.run_id && e.event.kind() == "model_response")
        .await;
    let steer = "focus on the tests, and be brief about it please";
    fx.send(task.run_id, ControlCommand::Steer { text: steer.into() })
        .await;
    events.until_terminal(&[task.run_id]).await;
    shutdown(worker).await;

    let log = events.of(task.run_id);
    assert_eq!(events.terminal(task.run_id).unwrap().0, BranchState::Done);
    let at = log
        .iter()
        .position(|e| matches!(e, Event::Steer { text } if text == steer))
        .expect("the steer was published");
    assert!(
        log[at..].iter().any(|e| e.kind() == "model_response"),
        "a model call followed the steer"
    );
    // The model's history holds it, and the next call's input was measured over it.
    let mut seen = fx.initial_log(&task);
    for e in &log {
        if let Event::Usage { usage, .. } = e {
            // The usage is recorded before its response: the request is all before it.
            let request = &seen[..];
            assert_eq!(
                usage.input_tokens,
                estimate_tokens(message_chars(&messages_from_events(request)))
            );
        }
        seen.push(e.clone());
    }
    assert!(messages_from_events(&seen).contains(&Message::User { text: steer.into() }));
}

#[tokio::test]
async fn control_for_a_finished_branch_is_harmless() {
    let fx = Fixture::new().await;
    let (_, snap) = fx.snapshot(&[]);
    let task = fx.task(
        "quick",
        0,
        snap,
        fx.script("[[turns.\"*\"]]\ntext = \"hi\""),
    );
    fx.enqueue(&task).await;
    let mut events = fx.events().await;
    let worker = start(&fx, config(1)).await;
    events.until_terminal(&[task.run_id]).await;
    fx.send(
        task.run_id,
        ControlCommand::Terminate {
            reason: String::new(),
        },
    )
    .await;
    shutdown(worker).await;
    assert_eq!(events.terminal(task.run_id).unwrap().0, BranchState::Done);
}
