use super::support::*;
use forkfleet_coordinator::{CoordinatorError, StoreCounts};
use forkfleet_shared::api::{CreateFork, ParentRun};
use forkfleet_shared::blob::BlobHash;
use forkfleet_shared::ids::RunId;
use forkfleet_shared::manifest::{FileEntry, Manifest, MODE_FILE};
use forkfleet_shared::path::WsPath;
use forkfleet_shared::spec::SpecError;

async fn refused(
    fx: &Fixture,
    plan: forkfleet_shared::spec::ForkPlan,
    parent: ParentRun,
    snap: BlobHash,
) -> CoordinatorError {
    let h = fx.h();
    let before = h.store().counts().unwrap();
    let err = within(h.create_fork(CreateFork {
        plan,
        parent,
        snapshot: snap,
        workspace: None,
    }))
    .await
    .unwrap_err();
    assert!(err.is_bad_input(), "{err}");
    // Nothing created: no record, no event, no checkpoint, no task, no fork.
    let after = h.store().counts().unwrap();
    assert_eq!(
        StoreCounts {
            blobs: before.blobs,
            ..after
        },
        before,
        "{err}"
    );
    assert_eq!(fx.pending_tasks().await, 0);
    assert!(within(h.forks()).await.unwrap().is_empty());
    err
}

#[tokio::test]
async fn invalid_forks_create_nothing() {
    let fx = Fixture::start().await;
    let snap = fx.upload(&[("a.txt", "a\n")]).await;

    let err = refused(&fx, plan(&[]), ParentRun::New, snap).await;
    assert!(
        matches!(err, CoordinatorError::InvalidPlan(SpecError::NoBranches)),
        "{err}"
    );

    let mut many = plan(&["a", "b", "c"]);
    many.limits.max_branches = 2;
    let err = refused(&fx, many, ParentRun::New, snap).await;
    assert!(
        matches!(
            err,
            CoordinatorError::InvalidPlan(SpecError::TooManyBranches {
                requested: 3,
                max: 2
            })
        ),
        "{err}"
    );

    let err = refused(&fx, plan(&["a", "b", "a"]), ParentRun::New, snap).await;
    assert!(
        matches!(err, CoordinatorError::DuplicateLabel(ref l) if l == "a"),
        "{err}"
    );

    let err = refused(&fx, plan(&["../x"]), ParentRun::New, snap).await;
    assert!(
        matches!(
            err,
            CoordinatorError::InvalidPlan(SpecError::BadLabel { .. })
        ),
        "{err}"
    );

    let mut unknown_model = plan(&["a"]);
    unknown_model.branches[0].model = "scripted:other".into();
    let err = refused(&fx, unknown_model, ParentRun::New, snap).await;
    assert!(err.to_string().contains("scripted:demo"), "{err}");

    let err = refused(
        &fx,
        plan(&["a"]),
        ParentRun::Existing {
            run_id: RunId::new(),
        },
        snap,
    )
    .await;
    assert!(matches!(err, CoordinatorError::UnknownRun(_)), "{err}");

    let mut shallow = plan(&["a"]);
    shallow.limits.max_depth = 0;
    let err = refused(&fx, shallow, ParentRun::New, snap).await;
    assert!(
        matches!(
            err,
            CoordinatorError::InvalidPlan(SpecError::DepthExceeded { .. })
        ),
        "{err}"
    );
}

#[tokio::test]
async fn missing_blobs_are_counted_and_named() {
    let fx = Fixture::start().await;

    // The manifest itself is missing.
    let absent = BlobHash::of(b"never uploaded");
    let err = refused(&fx, plan(&["a"]), ParentRun::New, absent).await;
    assert!(
        matches!(err, CoordinatorError::MissingBlobs { count: 1, .. }),
        "{err}"
    );
    assert!(err.to_string().contains(&absent.short()), "{err}");

    // The manifest is there, two of its three files are not.
    let mut m = Manifest::default();
    let present = fx.upload(&[("p.txt", "present\n")]).await;
    let _ = present;
    let mut missing = Vec::new();
    for (p, c) in [("p.txt", "present\n"), ("x.txt", "x\n"), ("y.txt", "y\n")] {
        let e = FileEntry::for_bytes(c.as_bytes(), MODE_FILE);
        if p != "p.txt" {
            missing.push(e.hash);
        }
        m.insert_file(WsPath::parse(p).unwrap(), e);
    }
    let bytes = m.to_blob().unwrap();
    let snap = BlobHash::of(&bytes);
    fx.blobs().put(snap, bytes).await.unwrap();
    let err = refused(&fx, plan(&["a"]), ParentRun::New, snap).await;
    assert!(
        matches!(err, CoordinatorError::MissingBlobs { count: 2, .. }),
        "{err}"
    );
    for h in missing {
        assert!(err.to_string().contains(&h.short()), "{err}");
    }

    // Not a manifest.
    let junk = bytes::Bytes::from_static(b"\xc1 not a manifest");
    let junk_hash = BlobHash::of(&junk);
    fx.blobs().put(junk_hash, junk).await.unwrap();
    let err = refused(&fx, plan(&["a"]), ParentRun::New, junk_hash).await;
    assert!(matches!(err, CoordinatorError::BadSnapshot { .. }), "{err}");
}

#[tokio::test]
async fn unknown_forks_and_runs_are_bad_input() {
    let fx = Fixture::start().await;
    let h = fx.h();
    let id = forkfleet_shared::ids::ForkId::new();
    for err in [
        within(h.fork(id)).await.unwrap_err(),
        within(h.merge(id, "a")).await.unwrap_err(),
        within(h.diff(id, Default::default())).await.unwrap_err(),
        within(h.changes(id)).await.unwrap_err(),
        within(h.run_events(RunId::new())).await.unwrap_err(),
        within(h.checkpoints(RunId::new())).await.unwrap_err(),
    ] {
        assert!(err.is_bad_input(), "{err}");
    }
}
