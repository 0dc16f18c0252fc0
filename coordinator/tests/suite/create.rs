use super::support::*;
use forkfleet_coordinator::fork_checkpoint_label;
use forkfleet_shared::api::ParentRun;
use forkfleet_shared::event::Event;
use forkfleet_shared::state::{BranchState, ForkState};

#[tokio::test]
async fn branch_logs_start_with_the_fork_event_then_prefix_then_steer() {
    let fx = Fixture::start().await;
    let h = fx.h();
    let snap = fx.upload(&[("README.md", "hello\n")]).await;
    let mut p = plan(&["a", "b"]);
    p.branches[1].extra_instructions = Some("be brief".into());
    let view = fx.create(p, ParentRun::New, snap).await;

    assert_eq!(view.state, ForkState::Open);
    assert_eq!(view.snapshot, snap);
    assert_eq!(view.goal, "make it better");
    let labels: Vec<&str> = view.branches.iter().map(|b| b.label.as_str()).collect();
    assert_eq!(labels, ["a", "b"]);
    assert!(view
        .branches
        .iter()
        .all(|b| b.state == BranchState::Pending));

    // The root run: system prompt, history, goal.
    let parent = within(h.run_events(view.parent_run)).await.unwrap();
    let kinds: Vec<&str> = parent.iter().map(|(_, e)| e.kind()).collect();
    assert_eq!(
        kinds,
        ["system", "user_message", "model_response", "user_message"]
    );
    assert_eq!(
        parent[3].1,
        Event::UserMessage {
            text: "make it better".into()
        }
    );

    // Branch b: fork event, the copied prefix, extra instructions, steer.
    let b = &view.branches[1];
    let log = within(h.run_events(b.run_id)).await.unwrap();
    let seqs: Vec<u64> = log.iter().map(|(s, _)| *s).collect();
    assert_eq!(seqs, (0..log.len() as u64).collect::<Vec<_>>());
    match &log[0].1 {
        Event::Fork {
            fork_id,
            parent_run,
            fork_root,
            cutoff_seq,
            label,
            replay_event_count: 0,
            strategy: None,
            workspaces,
        } => {
            // Pixir's lineage field: the version the branch starts from.
            assert_eq!(workspaces, &vec![view.snapshot]);
            assert_eq!(*fork_id, view.fork_id);
            assert_eq!(*parent_run, view.parent_run);
            assert_eq!(*fork_root, view.parent_run);
            assert_eq!(*cutoff_seq, 3);
            assert_eq!(label, "b");
        }
        other => panic!("seq 0 is {other:?}"),
    }
    let copied: Vec<Event> = parent.iter().map(|(_, e)| e.clone()).collect();
    assert_eq!(
        log[1..5].iter().map(|(_, e)| e.clone()).collect::<Vec<_>>(),
        copied
    );
    assert_eq!(
        log[5].1,
        Event::System {
            text: "be brief".into()
        }
    );
    assert_eq!(
        log[6].1,
        Event::Steer {
            text: "try b".into()
        }
    );
    assert_eq!(log.len(), 7);
    assert_eq!(b.events, 7);

    // The tasks: the shared prefix blob + the tail reproduce the log after the fork event.
    let mut tasks = [fx.pull().await.0, fx.pull().await.0];
    tasks.sort_by_key(|t| t.index);
    assert_eq!(tasks[0].prefix, tasks[1].prefix);
    let t = &tasks[1];
    assert_eq!(t.run_id, b.run_id);
    assert_eq!(t.label, "b");
    assert_eq!(t.snapshot, snap);
    assert_eq!(t.first_seq, 7);
    assert!(t.price.is_some());
    let prefix_bytes = fx
        .blobs()
        .get(&t.prefix)
        .await
        .unwrap()
        .expect("prefix blob");
    let prefix: Vec<Event> = rmp_serde::from_slice(&prefix_bytes).unwrap();
    let mut worker_view = prefix.clone();
    worker_view.extend(t.tail.clone());
    assert_eq!(
        worker_view,
        log[1..].iter().map(|(_, e)| e.clone()).collect::<Vec<_>>()
    );
    assert_eq!(t.first_seq, 1 + prefix.len() as u64 + t.tail.len() as u64);
    // Branch a has no extra instructions: its tail is the steer alone.
    assert_eq!(
        tasks[0].tail,
        vec![Event::Steer {
            text: "try a".into()
        }]
    );
    assert_eq!(tasks[0].first_seq, 6);

    // Checkpoint fork:<id> on the parent, at the cutoff, on the fork snapshot.
    let cps = within(h.checkpoints(view.parent_run)).await.unwrap();
    assert_eq!(cps.len(), 1);
    assert_eq!(cps[0].label, fork_checkpoint_label(view.fork_id));
    assert_eq!(cps[0].label, format!("fork:{}", view.fork_id));
    assert_eq!(cps[0].seq, 3);
    assert_eq!(cps[0].snapshot, snap);
}

#[tokio::test]
async fn forking_a_branch_run_goes_one_level_deeper_and_copies_only_conversation() {
    let fx = Fixture::start().await;
    let h = fx.h();
    let snap = fx.upload(&[("a.txt", "a\n")]).await;
    let top = fx.create(plan(&["x"]), ParentRun::New, snap).await;
    fx.fake_worker(1, |t| simple(t, "a.txt")).await;
    let top = within(h.wait_settled(top.fork_id, T)).await.unwrap();
    let x = &top.branches[0];

    let mut p = plan(&["deep"]);
    p.limits.max_depth = 2;
    let sub = fx
        .create(p.clone(), ParentRun::Existing { run_id: x.run_id }, snap)
        .await;
    let log = within(h.run_events(sub.branches[0].run_id)).await.unwrap();
    // Copied: x's conversation (no fork event, no file change, usage or status).
    let kinds: Vec<&str> = log.iter().map(|(_, e)| e.kind()).collect();
    assert_eq!(
        kinds,
        [
            "fork",
            "system",
            "user_message",
            "model_response",
            "user_message",
            "steer",
            "model_response",
            "steer"
        ]
    );
    match &log[0].1 {
        Event::Fork {
            parent_run,
            fork_root,
            cutoff_seq,
            ..
        } => {
            assert_eq!(*parent_run, x.run_id);
            assert_eq!(*fork_root, top.parent_run);
            assert_eq!(*cutoff_seq, x.events - 1);
        }
        other => panic!("{other:?}"),
    }

    // Depth: the branch of a branch is at depth 2 = max_depth, so it cannot fork.
    let deep_run = sub.branches[0].run_id;
    let err = within(h.create_fork(forkfleet_shared::api::CreateFork {
        plan: p,
        parent: ParentRun::Existing { run_id: deep_run },
        snapshot: snap,
        workspace: None,
        left_out: None,
        git: None,
    }))
    .await
    .unwrap_err();
    assert!(err.is_bad_input(), "{err}");
    assert!(err.to_string().contains("max_depth"), "{err}");
}

#[tokio::test]
async fn find_fork_by_full_id_or_unique_prefix() {
    let fx = Fixture::start().await;
    let h = fx.h();
    let snap = fx.upload(&[("a", "1")]).await;
    let f1 = fx.create(plan(&["a"]), ParentRun::New, snap).await.fork_id;
    let f2 = fx.create(plan(&["a"]), ParentRun::New, snap).await.fork_id;
    let (s1, s2) = (f1.to_string(), f2.to_string());

    assert_eq!(within(h.find_fork(&s1)).await.unwrap(), f1);
    assert_eq!(within(h.find_fork(&s2.to_uppercase())).await.unwrap(), f2);
    let common = s1
        .chars()
        .zip(s2.chars())
        .take_while(|(a, b)| a == b)
        .count();
    assert_eq!(within(h.find_fork(&s2[..common + 1])).await.unwrap(), f2);
    let err = within(h.find_fork(&s1[..common])).await.unwrap_err();
    assert!(err.to_string().contains("matches 2 forks"), "{err}");
    assert!(err.is_bad_input());
    let err = within(h.find_fork("zzzz")).await.unwrap_err();
    assert!(
        err.to_string()
            .contains("no fork has the id, id prefix or name `zzzz`"),
        "{err}"
    );
    assert!(err.is_bad_input());

    // Newest first.
    let all = within(h.forks()).await.unwrap();
    assert_eq!(all.iter().map(|f| f.fork_id).collect::<Vec<_>>(), [f2, f1]);
}
