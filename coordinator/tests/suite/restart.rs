use super::support::*;
use forkfleet_shared::api::ParentRun;
use forkfleet_shared::diff::DiffOptions;
use forkfleet_shared::event::Event;
use forkfleet_shared::state::{BranchState, ForkState};

#[tokio::test]
async fn a_restart_reloads_forks_replicas_and_events_and_resumes_the_stream() {
    let mut fx = Fixture::start().await;
    let snap = fx.upload(&[("a.txt", "a\n")]).await;
    let view = fx.create(plan(&["a", "b"]), ParentRun::New, snap).await;
    let id = view.fork_id;

    // Both branches run and write; only `a` finishes before the coordinator stops.
    let mut b_task = None;
    for _ in 0..2 {
        let (task, d) = fx.pull().await;
        let mut steps = vec![
            Step::Status(BranchState::Running),
            Step::Respond("hi".into()),
            Step::Write(format!("{}.txt", task.label), format!("{}\n", task.label)),
            Step::Usage(10, 10, 0.5),
        ];
        if task.label == "a" {
            steps.push(Step::Status(BranchState::Done));
        } else {
            b_task = Some(task.clone());
        }
        fx.play(&task, steps).await;
        d.ack().await.unwrap();
    }
    let b_task = b_task.unwrap();
    let before = {
        let h = fx.h();
        let v = wait_view(&h, id, |v| {
            v.branches.iter().all(|b| b.changes == 1 && b.turns == 1)
        })
        .await;
        let diff = within(h.diff(id, DiffOptions::default())).await.unwrap();
        let log = within(h.run_events(b_task.run_id)).await.unwrap();
        (v, diff, log)
    };
    assert_eq!(before.0.branch("a").unwrap().state, BranchState::Done);
    assert_eq!(before.0.state, ForkState::Open);

    fx.stop().await;
    // While the coordinator is down, `b` finishes (the bus keeps the event).
    let done_seq = b_task.first_seq + 4;
    fx.publish(
        b_task.fork_id,
        b_task.run_id,
        done_seq,
        Event::Status {
            state: BranchState::Done,
            error: None,
        },
    )
    .await;
    fx.restart().await;
    let h = fx.h();

    let v = within(h.wait_settled(id, T)).await.unwrap();
    assert_eq!(v.state, ForkState::Settled);
    for (old, new) in before.0.branches.iter().zip(&v.branches) {
        assert_eq!(old.label, new.label);
        assert_eq!(old.run_id, new.run_id);
        assert_eq!(new.state, BranchState::Done);
        assert_eq!(new.turns, 1);
        assert_eq!(new.changes, 1);
        assert!((new.cost_usd - 0.5).abs() < 1e-9);
    }
    // The replicas came back: the same diff.
    let diff = within(h.diff(id, DiffOptions::default())).await.unwrap();
    assert_eq!(diff, before.1);
    // The log came back, plus the event consumed after the restart.
    let log = within(h.run_events(b_task.run_id)).await.unwrap();
    assert_eq!(log[..before.2.len()], before.2[..]);
    assert_eq!(log.len() as u64, done_seq + 1);
    assert_eq!(within(h.find_fork(&id.to_string())).await.unwrap(), id);

    let out = within(h.merge(id, "b")).await.unwrap();
    assert_eq!(out.report.applied_paths.len(), 1);
    assert_eq!(out.report.applied_paths[0].as_str(), "b.txt");
    drop(h);

    // And the merge itself survives another restart.
    fx.restart().await;
    let h = fx.h();
    let v = within(h.fork(id)).await.unwrap();
    assert_eq!(v.state, ForkState::Merged { winner: "b".into() });
    let err = within(h.merge(id, "a")).await.unwrap_err();
    assert!(err.is_bad_input(), "{err}");
    let cps = within(h.checkpoints(view.parent_run)).await.unwrap();
    let labels: Vec<&str> = cps.iter().map(|c| c.label.as_str()).collect();
    assert_eq!(labels, [format!("fork:{id}"), format!("post-fork:{id}")]);
    assert_eq!(
        within(h.workspace(view.parent_run)).await.unwrap(),
        out.merged_snapshot
    );
}
