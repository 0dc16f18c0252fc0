//! Follow-up turns (ADR 13): a finished branch whose log ends with a `follow_up` is taken
//! over like a resumed one and runs a new turn of up to `max_turns` calls, the follow-up a
//! user message of its history; commands of the earlier turn are not for it.

use super::common::*;
use forkfleet_shared::event::{messages_from_events, Event, Message};
use forkfleet_shared::protocol::{Control, ControlCommand};
use forkfleet_shared::state::BranchState;
use forkfleet_shared::wire;
use forkfleet_worker::provider::{estimate_tokens, message_chars};

/// Two calls a turn (the branch's `max_turns`): a write, then an answer.
const TWO_TURNS: &str = r#"
[[turns."*"]]
tool_calls = [{ name = "write_file", args = { path = "one.txt", content = "1\n" } }]

[[turns."*"]]
text = "first done"

[[turns."*"]]
tool_calls = [{ name = "write_file", args = { path = "two.txt", content = "2\n" } }]

[[turns."*"]]
text = "second done"
"#;

#[tokio::test]
async fn a_follow_up_runs_a_new_turn_with_the_whole_history() {
    let fx = Fixture::new().await;
    let (_, snap) = fx.snapshot(&[]);
    let mut task = fx.task("cont", 0, snap, fx.script(TWO_TURNS));
    task.max_turns = 2;
    fx.enqueue(&task).await;
    let mut events = fx.events().await;
    let worker = start(&fx, config(1)).await;
    events.until_terminal(&[task.run_id]).await;
    assert_eq!(events.terminal(task.run_id).unwrap().0, BranchState::Done);
    // A terminate for the attempt that ran the first turn, as the coordinator sends it,
    // sent after that turn: on NATS the follow-up's watcher reads it again, and must not
    // obey it.
    let earlier = Control {
        run_id: task.run_id,
        command: ControlCommand::Terminate {
            reason: "an earlier turn's".into(),
        },
        attempt: Some(1),
    };
    fx.bus
        .send_control(task.run_id, wire::encode(&earlier).unwrap())
        .await
        .unwrap();

    // The coordinator appends the follow-up and enqueues the task again (above attempt 1).
    let text = "now write two.txt as well";
    let mut seen: Vec<(u64, Event)> = events.by_run[&task.run_id]
        .iter()
        .map(|e| (e.seq, e.event.clone()))
        .collect();
    let follow_seq = seen.last().unwrap().0 + 1;
    seen.push((follow_seq, Event::FollowUp { text: text.into() }));
    let resume = fx.serve_resume(&task, seen.clone()).await;
    let mut again = task.clone();
    again.attempt_base = 1;
    fx.enqueue(&again).await;
    let end = events
        .until(|e| {
            e.run_id == task.run_id
                && e.seq > follow_seq
                && matches!(&e.event, Event::Status { state, .. } if state.is_terminal())
        })
        .await;
    shutdown(worker).await;

    let asked = tokio::time::timeout(WAIT, resume).await.unwrap().unwrap();
    assert_eq!(asked.attempt, 2);
    assert!(
        matches!(
            &end.event,
            Event::Status {
                state: BranchState::Done,
                error: None
            }
        ),
        "{end:?}"
    );
    let second: Vec<_> = events.by_run[&task.run_id]
        .iter()
        .filter(|e| e.seq > follow_seq)
        .collect();
    assert!(second.iter().all(|e| e.attempt == 2));
    assert_eq!(
        second[0].seq,
        follow_seq + 1,
        "seqs go on after the follow-up"
    );
    assert!(is_status(second[0], task.run_id, BranchState::Running));
    // max_turns counts from the follow-up: two more calls, playing the script's next turns.
    let responses: Vec<Option<String>> = second
        .iter()
        .filter_map(|e| match &e.event {
            Event::ModelResponse { text, .. } => Some(text.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(responses, [None, Some("second done".to_string())]);
    assert!(second.iter().any(|e| matches!(
        &e.event,
        Event::FileChange { change } if change.path().as_str() == "two.txt"
    )));
    // The first call of the turn saw the whole history, the follow-up last, as a user
    // message (the scripted model measures its input over the messages it gets).
    let mut history = fx.initial_log(&task);
    history.extend(seen.into_iter().map(|(_, e)| e));
    let messages = messages_from_events(&history);
    assert_eq!(messages.last(), Some(&Message::User { text: text.into() }));
    let first_usage = second
        .iter()
        .find_map(|e| match &e.event {
            Event::Usage { usage, .. } => Some(usage.input_tokens),
            _ => None,
        })
        .unwrap();
    assert_eq!(first_usage, estimate_tokens(message_chars(&messages)));
    assert_eq!(fx.pending().await, 0);
}

#[tokio::test]
async fn a_log_finished_after_its_follow_up_is_not_run_again() {
    let fx = Fixture::new().await;
    let (_, snap) = fx.snapshot(&[]);
    let task = fx.task("twice", 0, snap, fx.script(TWO_TURNS));
    // The log a redelivered task gets: two turns, the second finished too.
    let s = task.first_seq;
    let seen = vec![
        (s, running()),
        (s + 1, done()),
        (
            s + 2,
            Event::FollowUp {
                text: "more".into(),
            },
        ),
        (s + 3, running()),
        (s + 4, done()),
    ];
    let mut events = fx.events().await;
    let resume = fx.serve_resume(&task, seen).await;
    let mut again = task.clone();
    again.attempt_base = 2;
    fx.enqueue(&again).await;
    // One slot: the next task is taken once the first has been dealt with.
    let after = fx.task(
        "after",
        1,
        snap,
        fx.script("[[turns.\"*\"]]\ntext = \"ok\""),
    );
    fx.enqueue(&after).await;
    let worker = start(&fx, config(1)).await;
    tokio::time::timeout(WAIT, resume).await.unwrap().unwrap();
    events.until_terminal(&[after.run_id]).await;
    shutdown(worker).await;
    settle(&fx, &mut events).await;
    // The task was dropped without publishing anything, and not handed back.
    assert!(!events.by_run.contains_key(&task.run_id));
    assert_eq!(fx.pending().await, 0);
}

fn running() -> Event {
    Event::Status {
        state: BranchState::Running,
        error: None,
    }
}

fn done() -> Event {
    Event::Status {
        state: BranchState::Done,
        error: None,
    }
}
