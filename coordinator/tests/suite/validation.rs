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
        left_out: None,
        git: None,
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

/// `plan(&["a"])` with its model renamed `model`, and the spec's own `base_url`.
fn real_plan(model: &str, base_url: Option<&str>) -> forkfleet_shared::spec::ForkPlan {
    let mut p = plan(&["a"]);
    let mut m = p.models.remove(MODEL).unwrap();
    m.endpoint = base_url.map(|u| forkfleet_shared::endpoint::Endpoint {
        base_url: Some(u.into()),
        ..Default::default()
    });
    p.models.insert(model.into(), m);
    p.model = model.into();
    for b in &mut p.branches {
        b.model = model.into();
    }
    p
}

/// A live worker of `pool` offering `openai:gpt-4o` and allowing `llm.internal:8080`.
fn live_worker(pool: &str) -> forkfleet_shared::protocol::WorkerInfo {
    use forkfleet_shared::protocol::now_ms;
    forkfleet_shared::protocol::WorkerInfo {
        worker_id: forkfleet_shared::ids::WorkerId::new(),
        pool: pool.into(),
        concurrency: 1,
        running: Vec::new(),
        hostname: "w".into(),
        version: "test".into(),
        started_at_ms: now_ms(),
        heartbeat_at_ms: now_ms(),
        models: vec![forkfleet_shared::catalogue::OfferedModel {
            name: "openai:gpt-4o".into(),
            dialect: "openai".into(),
            base_url: Some("https://api.openai.com/v1".into()),
        }],
        allowed_model_hosts: vec!["llm.internal:8080".into()],
        commands: None,
    }
}

#[tokio::test]
async fn real_models_are_checked_against_the_live_workers_catalogues() {
    let fx = Fixture::start().await;
    let snap = fx.upload(&[("a.txt", "a\n")]).await;
    within(fx.bus.put_worker(live_worker("default")))
        .await
        .unwrap();
    let err = refused(&fx, real_plan("openai:other", None), ParentRun::New, snap).await;
    assert!(matches!(err, CoordinatorError::ModelNotOffered(_)), "{err}");
    assert!(
        err.to_string().contains(
            "model `openai:other` is not in the model catalogue of any live worker of pool `default` (offered: openai:gpt-4o)"
        ),
        "{err}"
    );
    let capture = real_plan("openai:gpt-4o", Some("http://capture.example:9/v1"));
    let err = refused(&fx, capture, ParentRun::New, snap).await;
    for says in [
        "model `openai:gpt-4o`",
        "host `capture.example:9`",
        "allowed: llm.internal:8080",
    ] {
        assert!(err.to_string().contains(says), "{says:?} not in {err}");
    }
    // A spec naming a key source is refused before the workers are even asked.
    let mut keyed = real_plan("openai:gpt-4o", Some("http://llm.internal:8080/v1"));
    keyed.models.get_mut("openai:gpt-4o").unwrap().endpoint =
        Some(forkfleet_shared::endpoint::Endpoint {
            api_key_env: Some("OPENAI_API_KEY".into()),
            ..Default::default()
        });
    let err = refused(&fx, keyed, ParentRun::New, snap).await;
    assert!(
        err.to_string()
            .contains("api_key_env is not allowed in a spec"),
        "{err}"
    );
    // Offered, or on an allowed host: created.
    fx.create(real_plan("openai:gpt-4o", None), ParentRun::New, snap)
        .await;
    fx.create(
        real_plan("openai:local", Some("http://llm.internal:8080/v1")),
        ParentRun::New,
        snap,
    )
    .await;

    // No live worker in the pool (one of another pool only): accepted, the workers check.
    let other = Fixture::start().await;
    let snap = other.upload(&[("a.txt", "a\n")]).await;
    within(other.bus.put_worker(live_worker("gpu")))
        .await
        .unwrap();
    other
        .create(real_plan("openai:nowhere", None), ParentRun::New, snap)
        .await;
}
