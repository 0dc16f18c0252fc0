use super::support::*;
use bytes::Bytes;
use forkfleet_shared::api::ParentRun;
use forkfleet_shared::event::Event;
use forkfleet_shared::state::{BranchState, ForkState};

#[tokio::test]
async fn duplicate_and_out_of_order_events_apply_once_in_order() {
    let fx = Fixture::start().await;
    let h = fx.h();
    let snap = fx.upload(&[("a.txt", "a\n")]).await;
    let view = fx.create(plan(&["solo"]), ParentRun::New, snap).await;
    let (task, _d) = fx.pull().await;
    let (fork, run, s) = (task.fork_id, task.run_id, task.first_seq);
    let blobs = fx.blobs();
    let w1 = Step::Write("one.txt".into(), "1".into())
        .into_event(&blobs)
        .await;
    let w2 = Step::Write("two.txt".into(), "2".into())
        .into_event(&blobs)
        .await;
    let running = Step::Status(BranchState::Running).into_event(&blobs).await;

    // Pending -> Running.
    assert_eq!(view.branches[0].state, BranchState::Pending);
    fx.publish(fork, run, s, running.clone()).await;
    let v = wait_view(&h, fork, |v| v.branches[0].state == BranchState::Running).await;
    assert_eq!(v.branches[0].events, s + 1);

    // s+2 before s+1, duplicates of both and of s.
    fx.publish(fork, run, s + 2, w2.clone()).await;
    fx.publish(fork, run, s + 2, w2.clone()).await;
    fx.publish(fork, run, s, running.clone()).await;
    fx.publish(fork, run, s + 1, w1.clone()).await;
    fx.publish(fork, run, s + 1, w1.clone()).await;
    let v = wait_view(&h, fork, |v| v.branches[0].events == s + 3).await;
    assert_eq!(v.branches[0].changes, 2);

    // Running -> Done; a later status never changes a terminal state.
    fx.publish(
        fork,
        run,
        s + 3,
        Event::Status {
            state: BranchState::Done,
            error: None,
        },
    )
    .await;
    fx.publish(
        fork,
        run,
        s + 4,
        Event::Status {
            state: BranchState::Failed,
            error: Some("late".into()),
        },
    )
    .await;
    let v = within(h.wait_settled(fork, T)).await.unwrap();
    assert_eq!(v.state, ForkState::Settled);
    assert_eq!(v.branches[0].state, BranchState::Done);
    assert_eq!(v.branches[0].error, None);
    // The Failed event is still recorded once the fork has settled.
    let v = wait_view(&h, fork, |v| v.branches[0].events == s + 5).await;
    assert_eq!(v.branches[0].state, BranchState::Done);

    let log = within(h.run_events(run)).await.unwrap();
    let tail: Vec<Event> = log[s as usize..].iter().map(|(_, e)| e.clone()).collect();
    assert_eq!(tail.len(), 5);
    assert_eq!(tail[0], running);
    assert_eq!(tail[1], w1);
    assert_eq!(tail[2], w2);
    assert_eq!(
        log.iter().map(|(q, _)| *q).collect::<Vec<_>>(),
        (0..s + 5).collect::<Vec<_>>()
    );

    // The replica applied the writes in order: the diff sees both files.
    let diff = within(h.diff(fork, Default::default())).await.unwrap();
    let paths: Vec<&str> = diff.paths.iter().map(|p| p.path.as_str()).collect();
    assert_eq!(paths, ["one.txt", "two.txt"]);
}

#[tokio::test]
async fn garbage_on_the_event_stream_does_not_stop_the_loop() {
    let fx = Fixture::start().await;
    let h = fx.h();
    let snap = fx.upload(&[("a.txt", "a\n")]).await;
    fx.create(plan(&["solo"]), ParentRun::New, snap).await;
    let (task, _d) = fx.pull().await;

    fx.bus
        .publish_event(Bytes::from_static(b"\xff\x00 definitely not msgpack"))
        .await
        .unwrap();
    // A well-formed envelope of a future version, and one of the wrong kind.
    #[derive(serde::Serialize)]
    struct Env<'a> {
        v: u16,
        kind: &'a str,
        body: u32,
    }
    for env in [
        Env {
            v: 99,
            kind: "branch_event",
            body: 1,
        },
        Env {
            v: 1,
            kind: "branch_task",
            body: 1,
        },
        Env {
            v: 1,
            kind: "branch_event",
            body: 1,
        },
    ] {
        let bytes = rmp_serde::to_vec_named(&env).unwrap();
        fx.bus.publish_event(Bytes::from(bytes)).await.unwrap();
    }
    // An event of a fork that does not exist.
    fx.publish(
        forkfleet_shared::ids::ForkId::new(),
        task.run_id,
        task.first_seq,
        Event::Status {
            state: BranchState::Failed,
            error: None,
        },
    )
    .await;

    fx.publish(
        task.fork_id,
        task.run_id,
        task.first_seq,
        Event::Status {
            state: BranchState::Running,
            error: None,
        },
    )
    .await;
    fx.publish(
        task.fork_id,
        task.run_id,
        task.first_seq + 1,
        Event::Status {
            state: BranchState::Done,
            error: None,
        },
    )
    .await;
    let v = within(h.wait_settled(task.fork_id, T)).await.unwrap();
    assert_eq!(v.branches[0].state, BranchState::Done);
}

/// A worker's batch (one message of a run's events) applies as its events would: once,
/// in seq order, with a duplicate batch and an overlapping single event applied once. A
/// batch that is empty or names two forks is dropped whole, and the loop goes on.
#[tokio::test]
async fn a_batch_of_events_applies_once_and_a_malformed_batch_is_dropped() {
    use forkfleet_shared::protocol::{pack_events, BranchEventBatch};
    let fx = Fixture::start().await;
    let h = fx.h();
    let snap = fx.upload(&[("a.txt", "a\n")]).await;
    fx.create(plan(&["solo"]), ParentRun::New, snap).await;
    let (task, _d) = fx.pull().await;
    let (fork, run, s) = (task.fork_id, task.run_id, task.first_seq);
    let blobs = fx.blobs();
    let running = Step::Status(BranchState::Running).into_event(&blobs).await;
    let w1 = Step::Write("one.txt".into(), "1".into())
        .into_event(&blobs)
        .await;
    let w2 = Step::Write("two.txt".into(), "2".into())
        .into_event(&blobs)
        .await;
    let batch = pack_events(
        &[
            encoded(fork, run, s, running.clone()),
            encoded(fork, run, s + 1, w1.clone()),
            encoded(fork, run, s + 2, w2.clone()),
        ],
        fx.bus.max_payload(),
    )
    .unwrap();
    assert_eq!(batch.len(), 1);

    // Malformed batches first: empty, and one naming another fork beside this one.
    let empty = forkfleet_shared::wire::encode_kind(
        BranchEventBatch::KIND,
        &BranchEventBatch {
            events: vec![],
            blobs: vec![],
        },
    )
    .unwrap();
    let failed = Step::Status(BranchState::Failed).into_event(&blobs).await;
    let other_fork = forkfleet_shared::ids::ForkId::new();
    let mixed = pack_events(
        &[
            encoded(fork, run, s + 3, failed),
            encoded(other_fork, run, s + 4, running.clone()),
        ],
        None,
    )
    .unwrap();
    for bad in [empty, mixed[0].clone()] {
        fx.bus.publish_event(bad).await.unwrap();
    }
    // The batch twice, and its middle event alone.
    fx.bus
        .publish_events(vec![batch[0].clone(), batch[0].clone()])
        .await
        .unwrap();
    fx.publish(fork, run, s + 1, w1.clone()).await;
    let v = wait_view(&h, fork, |v| v.branches[0].events == s + 3).await;
    assert_eq!(v.branches[0].state, BranchState::Running);
    assert_eq!(v.branches[0].changes, 2);
    let done = Step::Status(BranchState::Done).into_event(&blobs).await;
    fx.publish(fork, run, s + 3, done).await;
    let v = within(h.wait_settled(fork, T)).await.unwrap();
    // The mixed batch's `failed` never applied.
    assert_eq!(v.branches[0].state, BranchState::Done);
    let log = within(h.run_events(run)).await.unwrap();
    let tail: Vec<Event> = log[s as usize..].iter().map(|(_, e)| e.clone()).collect();
    assert_eq!(tail[..3], [running, w1, w2]);
    assert_eq!(tail.len(), 4);
}

#[tokio::test]
async fn a_fork_settles_when_every_branch_is_terminal_and_counts_add_up() {
    let fx = Fixture::start().await;
    let h = fx.h();
    let snap = fx.upload(&[("a.txt", "a\n")]).await;
    let view = fx
        .create(plan(&["a", "b", "c"]), ParentRun::New, snap)
        .await;
    let waiter = {
        let h = h.clone();
        let id = view.fork_id;
        tokio::spawn(async move { h.wait_settled(id, T).await })
    };
    fx.fake_worker(3, |t| match t.label.as_str() {
        "c" => vec![
            Step::Status(BranchState::Running),
            Step::Respond("one".into()),
            Step::Usage(10, 5, 0.5),
            Step::Respond("two".into()),
            Step::Usage(10, 5, 0.25),
            Step::Fail(
                BranchState::BudgetExhausted,
                "branch budget of $0.70 reached",
            ),
        ],
        _ => simple(t, "a.txt"),
    })
    .await;
    let v = within(waiter).await.unwrap().unwrap();
    assert_eq!(v.state, ForkState::Settled);
    assert!(v.settled());
    let c = v.branch("c").unwrap();
    assert_eq!(c.state, BranchState::BudgetExhausted);
    assert_eq!(c.error.as_deref(), Some("branch budget of $0.70 reached"));
    assert_eq!(c.turns, 2);
    assert_eq!(c.usage.input_tokens, 20);
    assert_eq!(c.usage.output_tokens, 10);
    assert!((c.cost_usd - 0.75).abs() < 1e-9);
    let a = v.branch("a").unwrap();
    assert_eq!((a.state, a.turns, a.changes), (BranchState::Done, 1, 1));
    assert!((v.total_cost_usd() - 0.77).abs() < 1e-9);
    // The fork's state is durable: a new view agrees.
    assert_eq!(
        within(h.fork(view.fork_id)).await.unwrap().state,
        ForkState::Settled
    );
}

/// The text blobs branches write reach the coordinator's run store as their events are
/// applied, before any diff asks for them (on NATS, where the run store is not the bus's
/// blob store; embedded they are one store, and this holds trivially).
#[tokio::test]
async fn written_text_blobs_are_copied_into_the_run_store_as_their_events_arrive() {
    let fx = Fixture::start().await;
    let h = fx.h();
    let snap = fx.upload(&[("a.txt", "a\n")]).await;
    fx.create(plan(&["solo"]), ParentRun::New, snap).await;
    let (task, _d) = fx.pull().await;
    let (fork, run, s) = (task.fork_id, task.run_id, task.first_seq);
    let blobs = fx.blobs();
    let running = Step::Status(BranchState::Running).into_event(&blobs).await;
    let write = Step::Write("notes.txt".into(), "written by the branch\n".into())
        .into_event(&blobs)
        .await;
    let Event::FileChange { change } = &write else {
        unreachable!()
    };
    let hash = change.written().unwrap().hash;
    fx.publish(fork, run, s, running).await;
    fx.publish(fork, run, s + 1, write).await;
    wait_view(&h, fork, |v| v.branches[0].changes == 1).await;
    // No diff was asked for: the copy is the prefetch's (bounded wait).
    within(async {
        while h.store().blob(&hash).unwrap().is_none() {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    })
    .await;
    assert_eq!(
        h.store().blob(&hash).unwrap().as_deref(),
        Some(&b"written by the branch\n"[..])
    );
}

/// On a cluster a worker sends the small texts a turn writes along with its events: the
/// coordinator keeps those its applied events name, checked against their hash, without
/// fetching them from the bus; it keeps nothing else a message brings: not a text no event
/// names, not bytes under a hash they do not have, not the text of an event it did not
/// apply (a run that is not the fork's).
#[tokio::test]
async fn texts_sent_along_with_a_batch_are_kept_when_its_applied_events_name_them() {
    use forkfleet_shared::blob::BlobHash;
    use forkfleet_shared::ids::RunId;
    use forkfleet_shared::manifest::FileEntry;
    use forkfleet_shared::overlay::ChangeOp;
    use forkfleet_shared::path::WsPath;
    use forkfleet_shared::protocol::pack_events_with;
    let fx = Fixture::start().await;
    if !fx.bus.remote() {
        // Embedded, the run store is the bus's store: nothing travels.
        return;
    }
    let h = fx.h();
    let snap = fx.upload(&[("a.txt", "a\n")]).await;
    fx.create(plan(&["solo"]), ParentRun::New, snap).await;
    let (task, _d) = fx.pull().await;
    let text = Bytes::from_static(b"sent along, never put in the bus's store\n");
    let junk = Bytes::from_static(b"named by no event\n");
    let stranger = Bytes::from_static(b"written by a run that is not the fork's\n");
    let forged = Bytes::from_static(b"forged\n");
    let forged_claim = FileEntry::for_bytes(b"what the forger claims\n", 0o644);
    let write = |path: &str, entry: FileEntry| Event::FileChange {
        change: ChangeOp::Write {
            path: WsPath::parse(path).unwrap(),
            entry,
        },
    };
    let entry = FileEntry::for_bytes(&text, 0o644);
    let stranger_entry = FileEntry::for_bytes(&stranger, 0o644);
    let (fork, run, s) = (task.fork_id, task.run_id, task.first_seq);
    let running = Event::Status {
        state: BranchState::Running,
        error: None,
    };
    let message = pack_events_with(
        &[
            encoded(fork, run, s, running),
            encoded(fork, run, s + 1, write("forged.txt", forged_claim)),
            encoded(fork, RunId::new(), 0, write("stranger.txt", stranger_entry)),
            encoded(fork, run, s + 2, write("notes.txt", entry)),
        ],
        &[
            (BlobHash::of(&junk), junk.clone()),
            (forged_claim.hash, forged.clone()),
            (stranger_entry.hash, stranger.clone()),
            (entry.hash, text.clone()),
        ],
        None,
    )
    .unwrap();
    assert!(fx.bus.blobs().get(&entry.hash).await.unwrap().is_none());
    fx.bus.publish_events(message).await.unwrap();
    wait_view(&h, task.fork_id, |v| v.branches[0].changes == 2).await;
    // Kept by the prefetch, which takes a message's texts in order (bounded wait).
    within(async {
        while h.store().blob(&entry.hash).unwrap().is_none() {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    })
    .await;
    assert_eq!(h.store().blob(&entry.hash).unwrap(), Some(text));
    for (what, hash) in [
        ("a text no event names", BlobHash::of(&junk)),
        ("bytes under another hash", forged_claim.hash),
        ("the forged bytes", BlobHash::of(&forged)),
        ("a stranger run's text", stranger_entry.hash),
    ] {
        assert_eq!(h.store().blob(&hash).unwrap(), None, "{what} was kept");
    }
}
