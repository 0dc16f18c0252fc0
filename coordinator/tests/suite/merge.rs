use super::support::*;
use bytes::Bytes;
use forkfleet_coordinator::CoordinatorError;
use forkfleet_shared::api::ParentRun;
use forkfleet_shared::diff::{Agreement, DiffOptions, Operation};
use forkfleet_shared::event::Event;
use forkfleet_shared::manifest::Manifest;
use forkfleet_shared::path::WsPath;
use forkfleet_shared::state::{BranchState, ForkState};

fn p(s: &str) -> WsPath {
    WsPath::parse(s).unwrap()
}

async fn manifest(fx: &Fixture, hash: &forkfleet_shared::blob::BlobHash) -> Manifest {
    let bytes = fx.blobs().get(hash).await.unwrap().expect("manifest blob");
    Manifest::from_blob(&bytes).unwrap()
}

async fn content(fx: &Fixture, m: &Manifest, path: &str) -> String {
    let e = m.files.get(&p(path)).expect("file in manifest");
    let bytes: Bytes = fx.blobs().get(&e.hash).await.unwrap().unwrap();
    String::from_utf8(bytes.to_vec()).unwrap()
}

#[tokio::test]
async fn diff_then_merge_the_winner() {
    let fx = Fixture::start().await;
    let h = fx.h();
    let snap = fx
        .upload(&[("src/lib.rs", "fn main() {}\n"), ("old.txt", "old\n")])
        .await;
    let view = fx
        .create(plan(&["a", "b", "c"]), ParentRun::New, snap)
        .await;
    let id = view.fork_id;
    fx.fake_worker(3, |t| {
        let mut steps = simple(t, "src/lib.rs");
        if t.label == "b" {
            steps.insert(3, Step::Delete("old.txt".into()));
            steps.insert(3, Step::Write("NEW.md".into(), "new\n".into()));
        }
        steps
    })
    .await;
    within(h.wait_settled(id, T)).await.unwrap();

    let diff = within(h.diff(id, DiffOptions::default())).await.unwrap();
    assert_eq!(diff.branches, ["a", "b", "c"]);
    assert_eq!(diff.summary.total_paths_touched, 3);
    let lib = diff.path(&p("src/lib.rs")).unwrap();
    assert_eq!(lib.agreement, Agreement::Split);
    assert_eq!(lib.operation(0), Operation::Modified);
    let new = diff.path(&p("NEW.md")).unwrap();
    assert_eq!(new.agreement, Agreement::Unique);
    assert_eq!(new.operation(1), Operation::Created);
    assert_eq!(
        diff.path(&p("old.txt")).unwrap().operation(1),
        Operation::Deleted
    );
    let text = lib.change(1).unwrap().diff.clone().expect("unified diff");
    assert!(text.contains("+b was here"), "{text}");

    // Unknown label: the error lists the valid ones.
    let err = within(h.merge(id, "zzz")).await.unwrap_err();
    assert!(
        matches!(err, CoordinatorError::UnknownLabel { .. }),
        "{err}"
    );
    assert!(err.to_string().contains("valid labels: a, b, c"), "{err}");
    assert!(err.is_bad_input());

    let out = within(h.merge(id, "b")).await.unwrap();
    assert_eq!(out.winner, "b");
    assert_eq!(out.fork_snapshot, snap);
    assert_eq!(out.parent_run, view.parent_run);
    assert_eq!(out.winner_run, view.branches[1].run_id);
    assert_eq!(out.changes.len(), 3);
    assert!(out.report.conflicts.is_empty());
    assert_eq!(out.report.applied_paths, [p("NEW.md"), p("src/lib.rs")]);
    assert_eq!(out.report.deleted_paths, [p("old.txt")]);
    assert_eq!(out.checkpoint, format!("post-fork:{id}"));

    let merged = manifest(&fx, &out.merged_snapshot).await;
    assert_eq!(content(&fx, &merged, "src/lib.rs").await, "b was here\n");
    assert_eq!(content(&fx, &merged, "NEW.md").await, "new\n");
    assert!(!merged.files.contains_key(&p("old.txt")));
    assert_eq!(
        within(h.workspace(view.parent_run)).await.unwrap(),
        out.merged_snapshot
    );

    // The parent adopted b's history (never usage), then a summary naming b.
    let log = within(h.run_events(view.parent_run)).await.unwrap();
    let kinds: Vec<&str> = log.iter().map(|(_, e)| e.kind()).collect();
    assert_eq!(
        kinds,
        [
            "system",
            "user_message",
            "model_response",
            "user_message",
            "steer",
            "model_response",
            "branch_summary"
        ]
    );
    assert_eq!(
        log[4].1,
        Event::Steer {
            text: "try b".into()
        }
    );
    match &log[6].1 {
        Event::BranchSummary { text } => assert!(text.contains("`b`"), "{text}"),
        other => panic!("{other:?}"),
    }
    let cps = within(h.checkpoints(view.parent_run)).await.unwrap();
    assert_eq!(cps.len(), 2);
    assert_eq!(cps[1].label, format!("post-fork:{id}"));
    assert_eq!(cps[1].seq, 6);
    assert_eq!(cps[1].snapshot, out.merged_snapshot);

    let v = within(h.fork(id)).await.unwrap();
    assert_eq!(v.state, ForkState::Merged { winner: "b".into() });
    // A fork merges once.
    let err = within(h.merge(id, "a")).await.unwrap_err();
    assert!(
        matches!(err, CoordinatorError::AlreadyMerged { .. }),
        "{err}"
    );
    assert!(err.is_bad_input());
}

#[tokio::test]
async fn keep_parent_keeps_a_parent_change_made_since_the_fork() {
    let fx = Fixture::start().await;
    let h = fx.h();
    let snap = fx
        .upload(&[("shared.txt", "original\n"), ("other.txt", "other\n")])
        .await;
    // Fork A and fork B of the same parent, from the same snapshot.
    let a = fx.create(plan(&["a1"]), ParentRun::New, snap).await;
    let b = fx
        .create(
            plan(&["b1"]),
            ParentRun::Existing {
                run_id: a.parent_run,
            },
            snap,
        )
        .await;
    fx.fake_worker(2, |t| {
        let mut steps = simple(t, "shared.txt");
        if t.label == "b1" {
            steps.insert(3, Step::Write("other.txt".into(), "b1 other\n".into()));
        }
        steps
    })
    .await;
    within(h.wait_settled(a.fork_id, T)).await.unwrap();
    within(h.wait_settled(b.fork_id, T)).await.unwrap();

    // A merges first: the parent's shared.txt changes after B forked.
    let out_a = within(h.merge(a.fork_id, "a1")).await.unwrap();
    assert!(out_a.report.conflicts.is_empty());
    let out_b = within(h.merge(b.fork_id, "b1")).await.unwrap();
    assert_eq!(out_b.report.conflicts, [p("shared.txt")]);
    let merged = manifest(&fx, &out_b.merged_snapshot).await;
    assert_eq!(content(&fx, &merged, "shared.txt").await, "a1 was here\n");
    assert_eq!(content(&fx, &merged, "other.txt").await, "b1 other\n");
    assert_eq!(
        within(h.workspace(a.parent_run)).await.unwrap(),
        out_b.merged_snapshot
    );

    // Both merges adopted history into the one parent, in merge order.
    let log = within(h.run_events(a.parent_run)).await.unwrap();
    let summaries: Vec<String> = log
        .iter()
        .filter_map(|(_, e)| match e {
            Event::BranchSummary { text } => Some(text.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(summaries.len(), 2);
    assert!(summaries[0].contains("`a1`") && summaries[1].contains("`b1`"));
    assert!(
        summaries[1].contains("1 conflict(s) under keep-parent"),
        "{}",
        summaries[1]
    );
}

#[tokio::test]
async fn a_running_branch_is_not_a_winner_but_a_stopped_one_is() {
    let fx = Fixture::start().await;
    let h = fx.h();
    let snap = fx.upload(&[("a.txt", "a\n")]).await;
    let view = fx
        .create(plan(&["fast", "slow"]), ParentRun::New, snap)
        .await;
    let id = view.fork_id;
    let mut slow = None;
    for _ in 0..2 {
        let (task, d) = fx.pull().await;
        let steps = if task.label == "fast" {
            vec![
                Step::Status(BranchState::Running),
                Step::Write("partial.txt".into(), "half done\n".into()),
                Step::Fail(BranchState::Terminated, "terminated by the user"),
            ]
        } else {
            slow = Some(task.clone());
            vec![Step::Status(BranchState::Running)]
        };
        fx.play(&task, steps).await;
        d.ack().await.unwrap();
    }
    let slow = slow.unwrap();
    let mut control = fx.bus.watch_control(slow.run_id).await.unwrap();
    wait_view(&h, id, |v| {
        v.branch("fast").unwrap().state == BranchState::Terminated
            && v.branch("slow").unwrap().state == BranchState::Running
    })
    .await;

    let err = within(h.merge(id, "slow")).await.unwrap_err();
    assert!(
        matches!(err, CoordinatorError::StillRunning { .. }),
        "{err}"
    );
    assert!(
        err.to_string()
            .contains("still running; wait for it or terminate it"),
        "{err}"
    );

    // The terminated branch's partial work merges; the running loser is told to stop.
    let out = within(h.merge(id, "fast")).await.unwrap();
    assert_eq!(out.report.applied_paths, [p("partial.txt")]);
    let cmd = within(control.recv()).await.unwrap();
    let control: forkfleet_shared::protocol::Control =
        forkfleet_shared::wire::decode(&cmd).unwrap();
    assert_eq!(control.run_id, slow.run_id);
    assert!(matches!(
        control.command,
        forkfleet_shared::protocol::ControlCommand::Terminate { .. }
    ));
    // The loser reports its stop; the fork stays merged and settles its branches.
    fx.publish(
        slow.fork_id,
        slow.run_id,
        slow.first_seq + 1,
        Event::Status {
            state: BranchState::Terminated,
            error: None,
        },
    )
    .await;
    let v = within(h.wait_settled(id, T)).await.unwrap();
    assert_eq!(
        v.state,
        ForkState::Merged {
            winner: "fast".into()
        }
    );
}
