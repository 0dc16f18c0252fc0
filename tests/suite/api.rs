//! The coordinator's API over request/reply: `forkfleet_coordinator::service::serve` and
//! a `forkfleet_client::Client` on a `LocalBus`, with real workers. Every declared
//! operation has a handler and answers the same through both transports (in process and
//! over the bus); errors keep their kind; garbage and wrong versions are answered, never
//! fatal.

use super::harness::{slow_spec, Example};
use forkfleet::config::{Config, Layer};
use forkfleet_bus::local::LocalBus;
use forkfleet_bus::Bus;
use forkfleet_client::workspace as ws;
use forkfleet_client::{ApiClient, Client, ClientError};
use forkfleet_coordinator::service::ApiServer;
use forkfleet_coordinator::{Coordinator, CoordinatorConfig, CoordinatorHandle, RunStore};
use forkfleet_shared::api::{
    self, ApiError, ApiErrorKind, ApiReply, ApiRequest, ApiResponse, CreateFork, ForkView,
    ParentRun, API_SUBJECT,
};
use forkfleet_shared::diff::DiffOptions;
use forkfleet_shared::path::WsPath;
use forkfleet_shared::spec;
use forkfleet_shared::state::{BranchState, ForkState};
use forkfleet_shared::wire;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// Bound of every wait in these tests.
const LIMIT: Duration = Duration::from_secs(60);

/// A coordinator serving the API and `workers` worker services, on one local bus.
struct System {
    _dir: tempfile::TempDir,
    bus: Arc<dyn Bus>,
    handle: CoordinatorHandle,
    remote: Client,
    coordinator: Option<Coordinator>,
    stops: Vec<oneshot::Sender<()>>,
    tasks: Vec<JoinHandle<()>>,
}

impl System {
    async fn start(workers: usize) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let store = RunStore::open(dir.path()).unwrap();
        let bus: Arc<dyn Bus> = Arc::new(LocalBus::new(store.blob_store()));
        let coordinator = Coordinator::start(CoordinatorConfig::default(), store, bus.clone())
            .await
            .unwrap();
        let handle = coordinator.handle();
        let mut stops = Vec::new();
        let mut tasks = Vec::new();
        let (stop, stopped) = oneshot::channel::<()>();
        stops.push(stop);
        // Bound before it runs: requests from here on are answered.
        let server = ApiServer::bind(handle.clone(), bus.clone()).await.unwrap();
        tasks.push(tokio::spawn(async move {
            server
                .run(async {
                    let _ = stopped.await;
                })
                .await
                .unwrap();
        }));
        let config = Config::load(
            None,
            &|_| None,
            Layer {
                concurrency: Some(8),
                drain_grace_s: Some(0),
                ..Layer::default()
            },
        )
        .unwrap();
        for _ in 0..workers {
            let (stop, stopped) = oneshot::channel::<()>();
            stops.push(stop);
            let (b, c) = (bus.clone(), config.clone());
            tasks.push(tokio::spawn(async move {
                forkfleet::service::serve_worker(b, &c, async {
                    let _ = stopped.await;
                })
                .await
                .unwrap();
            }));
        }
        Self {
            _dir: dir,
            remote: Client::remote(bus.clone()),
            bus,
            handle,
            coordinator: Some(coordinator),
            stops,
            tasks,
        }
    }

    /// Upload the spec's workspace to the bus's blob store and create the fork remotely.
    async fn create(&self, spec_path: &Path) -> ForkView {
        let loaded = spec::load(spec_path).unwrap();
        let blobs = self.bus.blobs();
        let (_, upload) = ws::upload_workspace(
            blobs.as_ref(),
            &loaded.workspace,
            &loaded.scan,
            loaded.blobs.clone(),
        )
        .await
        .unwrap();
        self.remote
            .call(CreateFork {
                plan: loaded.plan,
                parent: ParentRun::New,
                snapshot: upload.snapshot,
                workspace: Some(loaded.workspace.display().to_string()),
                left_out: None,
                git: None,
            })
            .await
            .unwrap()
    }

    async fn stop(mut self) {
        for s in self.stops.drain(..) {
            let _ = s.send(());
        }
        for t in self.tasks.drain(..) {
            tokio::time::timeout(LIMIT, t).await.unwrap().unwrap();
        }
        if let Some(c) = self.coordinator.take() {
            c.shutdown().await.unwrap();
        }
    }
}

fn reply(r: ApiResponse) -> Result<ApiReply, ApiError> {
    r.into()
}

fn api_kind(e: ClientError) -> (ApiErrorKind, String) {
    match e {
        ClientError::Call(forkfleet_bus::apicall::CallError::Api(e)) => (e.kind, e.message),
        other => panic!("expected an API error, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_request_kind_round_trips() {
    let sys = System::start(2).await;
    let ex = Example::quickstart();
    let r = &sys.remote;

    let info = r.ping().await.unwrap();
    assert_eq!(info.wire_version, wire::WIRE_VERSION);
    assert!(!info.version.is_empty());

    let created = sys.create(&ex.spec()).await;
    let id = created.fork_id;
    assert_eq!(created.branches.len(), 3);
    assert_eq!(created.state, ForkState::Open);

    assert_eq!(r.find_fork(&id.to_string()[..13]).await.unwrap(), id);
    let first = r.watch(id, None, Duration::from_secs(5)).await.unwrap();
    let settled = r.wait_settled(id, LIMIT).await.unwrap();
    assert!(settled.settled(), "{settled:?}");
    assert_eq!(settled.state, ForkState::Settled);
    assert!(settled
        .branches
        .iter()
        .all(|b| b.state == BranchState::Done));

    // The same answers as the handle gives in-process.
    assert_eq!(
        r.fork(id).await.unwrap(),
        sys.handle.fork(id).await.unwrap()
    );
    assert_eq!(r.forks().await.unwrap(), sys.handle.forks().await.unwrap());
    let opts = DiffOptions {
        unified: true,
        ..DiffOptions::default()
    };
    let diff = r.diff(id, opts.clone()).await.unwrap();
    assert_eq!(diff, sys.handle.diff(id, opts).await.unwrap());
    assert_eq!(diff.summary.total_paths_touched, 5);
    let filtered = r
        .diff(
            id,
            DiffOptions {
                paths: Some(vec![WsPath::parse("tests").unwrap()]),
                ..DiffOptions::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(filtered.paths.len(), 1);

    // Watch: a stale version answers at once; the current one waits out its bound.
    let now = r.watch(id, None, Duration::ZERO).await.unwrap();
    assert_eq!(now.view, settled);
    if first.version != now.version {
        let again = r.watch(id, Some(first.version), LIMIT).await.unwrap();
        assert_eq!(again.version, now.version);
    }
    let t0 = std::time::Instant::now();
    let same = r
        .watch(id, Some(now.version), Duration::from_millis(300))
        .await
        .unwrap();
    assert_eq!(same.version, now.version);
    assert!(t0.elapsed() >= Duration::from_millis(250));

    let concise = settled.branch("concise").unwrap().run_id;
    let events = r.run_events(concise).await.unwrap();
    let direct = sys.handle.run_events(concise).await.unwrap();
    assert_eq!(events.len(), direct.len());
    assert!(events
        .iter()
        .zip(&direct)
        .all(|(a, (seq, e))| a.seq == *seq && &a.event == e));
    let cps = r.checkpoints(settled.parent_run).await.unwrap();
    assert_eq!(
        cps,
        sys.handle.checkpoints(settled.parent_run).await.unwrap()
    );
    assert!(cps.iter().any(|c| c.label.starts_with("fork:")), "{cps:?}");

    // Terminating a finished branch sends nothing.
    let t = r.terminate(id, "tidy").await.unwrap();
    assert!(!t.sent);
    assert_eq!(t.state, BranchState::Done);

    let merged = r.merge(id, "concise").await.unwrap();
    assert_eq!(merged.winner, "concise");
    assert_eq!(merged.report.applied_paths.len(), 2);
    let cps = r.checkpoints(settled.parent_run).await.unwrap();
    assert!(cps.iter().any(|c| c.label.starts_with("post-fork:")));

    // Errors keep their kind.
    let (kind, msg) = api_kind(r.merge(id, "thorough").await.unwrap_err());
    assert_eq!(kind, ApiErrorKind::Conflict);
    assert!(msg.contains("already merged"), "{msg}");
    let (kind, _) = api_kind(r.abort(id).await.unwrap_err());
    assert_eq!(kind, ApiErrorKind::Conflict);
    let (kind, msg) = api_kind(r.terminate(id, "nope").await.unwrap_err());
    assert_eq!(kind, ApiErrorKind::NotFound);
    assert!(msg.contains("concise, thorough, tidy"), "{msg}");
    let (kind, msg) = api_kind(r.find_fork("ffffffff").await.unwrap_err());
    assert_eq!(kind, ApiErrorKind::NotFound);
    assert!(msg.contains("forkfleet fork ls"), "{msg}");
    let (kind, _) = api_kind(
        r.run_events(forkfleet_shared::ids::RunId::new())
            .await
            .unwrap_err(),
    );
    assert_eq!(kind, ApiErrorKind::NotFound);
    let err = r
        .wait_settled(forkfleet_shared::ids::ForkId::new(), Duration::from_secs(1))
        .await
        .unwrap_err();
    assert!(err.is_bad_input(), "{err}");

    sys.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminate_and_abort_stop_running_branches() {
    let sys = System::start(1).await;
    let ex = Example::quickstart();
    let r = &sys.remote;
    let id = sys.create(&slow_spec(&ex)).await.fork_id;

    // Wait until `a` has made a few turns, then stop it.
    let mut seen = None;
    tokio::time::timeout(LIMIT, async {
        loop {
            let w = r.watch(id, seen, Duration::from_secs(5)).await.unwrap();
            seen = Some(w.version);
            if w.view.branch("a").unwrap().turns >= 2 {
                break;
            }
        }
    })
    .await
    .expect("`a` made two turns in time");
    let t = r.terminate(id, "a").await.unwrap();
    assert!(t.sent, "{t:?}");
    assert_eq!(t.state, BranchState::Running);
    tokio::time::timeout(LIMIT, async {
        loop {
            let w = r.watch(id, seen, Duration::from_secs(5)).await.unwrap();
            seen = Some(w.version);
            if w.view.branch("a").unwrap().state == BranchState::Terminated {
                assert!(!w.view.settled(), "the others still run");
                break;
            }
        }
    })
    .await
    .expect("`a` was terminated in time");

    let aborted = r.abort(id).await.unwrap();
    assert!(aborted.changed);
    assert_eq!(aborted.view.state, ForkState::Aborted);
    let mut stopped = aborted.terminated.clone();
    stopped.sort();
    assert_eq!(stopped, ["b", "c"]);
    let view = r.wait_settled(id, LIMIT).await.unwrap();
    assert_eq!(view.state, ForkState::Aborted, "aborted stays aborted");
    for b in &view.branches {
        assert_eq!(b.state, BranchState::Terminated, "{b:?}");
        assert!(b.turns < 150, "stopped early: {b:?}");
    }
    // Aborting again changes nothing; merging an aborted fork is refused.
    let again = r.abort(id).await.unwrap();
    assert!(!again.changed && again.terminated.is_empty());
    let (kind, msg) = api_kind(r.merge(id, "a").await.unwrap_err());
    assert_eq!(kind, ApiErrorKind::Conflict);
    assert!(msg.contains("aborted"), "{msg}");

    sys.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_and_wrong_versions_are_answered_not_fatal() {
    let sys = System::start(0).await;
    let ask = |payload: Vec<u8>| {
        let bus = sys.bus.clone();
        async move {
            let bytes = bus
                .request(API_SUBJECT, payload.into(), Duration::from_secs(10))
                .await
                .unwrap();
            wire::decode::<ApiResponse>(&bytes).unwrap()
        }
    };
    let expect_bad = |resp: ApiResponse, needle: &str| match resp {
        ApiResponse::Err(e) => {
            assert_eq!(e.kind, ApiErrorKind::BadInput);
            assert!(e.message.contains(needle), "{needle} not in {}", e.message);
        }
        other => panic!("expected an error, got {other:?}"),
    };
    expect_bad(
        ask(b"\x00garbage".to_vec()).await,
        "not a forkfleet message",
    );
    expect_bad(ask(Vec::new()).await, "malformed");
    // A future wire version.
    #[derive(serde::Serialize)]
    struct Env<'a> {
        v: u16,
        kind: &'a str,
        body: &'a ApiRequest,
    }
    let future = rmp_serde::to_vec_named(&Env {
        v: 99,
        kind: "api_request",
        body: &ApiRequest::Ping,
    })
    .unwrap();
    expect_bad(ask(future).await, "version 99");
    // Another message kind, and a body that is not a request.
    let other = wire::encode(&ApiResponse::Ok(Box::new(ApiReply::Forks(vec![])))).unwrap();
    expect_bad(ask(other.to_vec()).await, "api_request");
    // The same envelope at the right version, for contrast.
    let valid = rmp_serde::to_vec_named(&Env {
        v: wire::WIRE_VERSION,
        kind: "api_request",
        body: &ApiRequest::Ping,
    })
    .unwrap();
    assert!(matches!(reply(ask(valid).await), Ok(ApiReply::Info(_))));
    let mut bogus_op = std::collections::BTreeMap::new();
    bogus_op.insert("op", "explode");
    #[derive(serde::Serialize)]
    struct EnvMap<'a> {
        v: u16,
        kind: &'a str,
        body: &'a std::collections::BTreeMap<&'a str, &'a str>,
    }
    let bogus = rmp_serde::to_vec_named(&EnvMap {
        v: wire::WIRE_VERSION,
        kind: "api_request",
        body: &bogus_op,
    })
    .unwrap();
    expect_bad(ask(bogus).await, "malformed");
    // The service still answers.
    assert!(sys.remote.ping().await.is_ok());
    assert!(sys.remote.forks().await.unwrap().is_empty());
    sys.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_requests_and_replies_travel_as_blobs() {
    let sys = System::start(1).await;
    let ex = Example::quickstart();
    // A goal of 700 KB: the request and every reply naming the fork exceed one message.
    let goal = "g".repeat(700 * 1024);
    let spec = ex.write_spec(&format!(
        "goal = \"{goal}\"\nworkspace = \"workspace\"\nmodel = \"scripted:quickstart\"\n\
         [models.\"scripted:quickstart\"]\nscript = \"script.toml\"\n\
         [[branches]]\nlabel = \"concise\"\n"
    ));
    let view = sys.create(&spec).await;
    assert_eq!(view.goal.len(), goal.len());
    let settled = sys.remote.wait_settled(view.fork_id, LIMIT).await.unwrap();
    assert_eq!(settled.goal, goal);
    assert_eq!(sys.remote.forks().await.unwrap().len(), 1);

    // On the wire: the reply is a `stored` reference to a blob ...
    let raw = sys
        .bus
        .request(
            API_SUBJECT,
            wire::encode(&ApiRequest::from(api::GetFork { fork: view.fork_id })).unwrap(),
            Duration::from_secs(10),
        )
        .await
        .unwrap();
    assert!(raw.len() < 1024);
    let Ok(ApiReply::Stored { blob, bytes }) = reply(wire::decode(&raw).unwrap()) else {
        panic!("expected a stored reply");
    };
    assert!(bytes > 700 * 1024);
    let stored = sys.bus.blobs().get(&blob).await.unwrap().unwrap();
    assert!(matches!(
        reply(wire::decode(&stored).unwrap()),
        Ok(ApiReply::Fork(_))
    ));
    // ... and a stored request is read from its blob.
    let inner = wire::encode(&ApiRequest::from(api::FindFork {
        prefix: view.fork_id.to_string(),
    }))
    .unwrap();
    let hash = forkfleet_shared::blob::BlobHash::of(&inner);
    sys.bus.blobs().put(hash, inner).await.unwrap();
    let raw = sys
        .bus
        .request(
            API_SUBJECT,
            wire::encode(&ApiRequest::Stored { blob: hash }).unwrap(),
            Duration::from_secs(10),
        )
        .await
        .unwrap();
    assert_eq!(
        reply(wire::decode(&raw).unwrap()),
        Ok(ApiReply::ForkId(view.fork_id))
    );
    sys.stop().await;
}

/// One request of every declared operation, sent through both transports (in process, and
/// request/reply over a bus: the in-process bus and a real NATS server): the answers
/// (replies or errors) are equal, none is a decode error or an unknown operation, and a
/// new operation without a sample here fails the test.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_declared_operation_answers_alike_through_both_transports() {
    use forkfleet_shared::ids::{ForkId, RunId};
    let sys = System::start(1).await;
    let ex = Example::quickstart();
    let view = sys.create(&ex.spec()).await;
    let settled = sys.remote.wait_settled(view.fork_id, LIMIT).await.unwrap();
    let fork = settled.fork_id;
    let run = settled.branches[0].run_id;
    let (nofork, norun) = (ForkId::new(), RunId::new());
    let bad_plan = {
        let mut plan = spec::load(&ex.spec()).unwrap().plan;
        plan.branches.clear();
        plan
    };
    let samples: Vec<ApiRequest> = vec![
        api::Ping.into(),
        api::Forks.into(),
        api::Accounts.into(),
        api::CreateFork {
            plan: bad_plan,
            parent: ParentRun::New,
            snapshot: view.snapshot,
            workspace: None,
            left_out: None,
            git: Some(api::GitHead {
                commit: "0123456789abcdef0123456789abcdef01234567".into(),
                prefix: "sub/".into(),
                dirty: true,
            }),
        }
        .into(),
        api::AgentFork {
            parent_run: norun,
            cutoff_seq: 0,
            snapshot: view.snapshot,
            branches: vec![],
            strategy: None,
            aggregate_budget_usd: None,
        }
        .into(),
        api::AgentMerge {
            fork: nofork,
            pick: "a".into(),
            parent_run: norun,
        }
        .into(),
        api::GetFork { fork }.into(),
        api::FindFork {
            prefix: fork.to_string()[..8].to_string(),
        }
        .into(),
        api::WaitSettled {
            fork,
            timeout_ms: 1_000,
        }
        .into(),
        api::Watch {
            fork: nofork,
            seen: None,
            timeout_ms: 0,
        }
        .into(),
        api::Diff {
            fork,
            options: DiffOptions::default(),
        }
        .into(),
        api::Merge {
            fork,
            pick: "no-such-branch".into(),
        }
        .into(),
        api::Terminate {
            fork,
            label: settled.branches[0].label.clone(),
        }
        .into(),
        api::Abort { fork: nofork }.into(),
        api::Steer {
            fork,
            label: "no-such-branch".into(),
            text: "x".into(),
        }
        .into(),
        api::Continue {
            fork: nofork,
            label: "a".into(),
            text: "x".into(),
        }
        .into(),
        api::Approvals { fork: None }.into(),
        api::Decide {
            fork,
            label: "no-such-branch".into(),
            call_id: None,
            approve: true,
            reason: None,
        }
        .into(),
        api::RunEvents { run }.into(),
        api::Checkpoints { run }.into(),
        api::GetForkCost { fork }.into(),
        api::Topup {
            fork: nofork,
            branch: None,
            usd: 1.0,
        }
        .into(),
        api::MoveBudget {
            fork: nofork,
            from: "a".into(),
            to: "b".into(),
            usd: 1.0,
        }
        .into(),
        api::AccountSet {
            name: "team".into(),
            cap_usd: Some(5.0),
        }
        .into(),
        api::Resolve {
            fork: nofork,
            strategy: None,
            no_commit: false,
            judge_models: Vec::new(),
        }
        .into(),
        api::Verdict { fork: nofork }.into(),
        api::Gc {
            older_than_ms: Some(u64::MAX),
            dry_run: true,
            grace_ms: None,
        }
        .into(),
        api::RemoveFork {
            fork: nofork,
            dry_run: true,
        }
        .into(),
        api::FindRun {
            prefix: run.to_string(),
        }
        .into(),
        api::CheckpointSave {
            run: norun,
            label: "mine".into(),
            at: None,
        }
        .into(),
        api::CheckpointRemove {
            run: norun,
            checkpoint: "mine".into(),
        }
        .into(),
        api::CheckpointClear { run: norun }.into(),
        api::Rewind {
            run: norun,
            checkpoint: "mine".into(),
            dry_run: true,
        }
        .into(),
        api::ForkCheckpoint {
            run: norun,
            checkpoint: "mine".into(),
        }
        .into(),
        api::RunWorkspace { run: norun }.into(),
        api::GetBlob {
            blob: forkfleet_shared::blob::BlobHash::of(b"no such blob"),
        }
        .into(),
        api::MissingBlobs {
            blobs: vec![forkfleet_shared::blob::BlobHash::of(b"no such blob")],
        }
        .into(),
        api::PutBlobPart {
            blob: forkfleet_shared::blob::BlobHash::of(b"a blob"),
            offset: 0,
            total: 6,
            bytes: bytes::Bytes::from_static(b"a blob"),
        }
        .into(),
        api::GetBlobPart {
            blob: forkfleet_shared::blob::BlobHash::of(b"no such blob"),
            start: 0,
            len: 10,
        }
        .into(),
        api::Runs.into(),
        api::ListWorkers.into(),
        api::GetRun { run }.into(),
        api::RunFork {
            parent: run,
            options: api::RunForkOptions {
                dry_run: true,
                ..Default::default()
            },
        }
        .into(),
        api::RunResume {
            run: norun,
            text: None,
        }
        .into(),
    ];
    let mut covered: Vec<&str> = samples.iter().map(ApiRequest::op).collect();
    covered.sort_unstable();
    let mut declared = api::OPERATIONS.to_vec();
    declared.sort_unstable();
    assert_eq!(
        covered, declared,
        "every declared operation needs a sample here"
    );

    // The same coordinator served on a real NATS server too: request/reply over NATS, the
    // transport a cluster uses.
    let nats = forkfleet_bus::testkit::NatsServer::start();
    let nats_bus: Arc<dyn Bus> = Arc::new(
        forkfleet_bus::nats::NatsBus::connect(forkfleet_bus::nats::NatsConfig::new(nats.url()))
            .await
            .unwrap(),
    );
    let server = ApiServer::bind(sys.handle.clone(), nats_bus.clone())
        .await
        .unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let served = tokio::spawn(server.run(async {
        let _ = stopped.await;
    }));
    let over_nats = Client::remote(nats_bus);

    let local = Client::in_process(sys.handle.clone(), sys.bus.clone());
    for req in samples {
        let op = req.op();
        let here = as_result(local.request(req.clone(), LIMIT).await);
        let there = as_result(sys.remote.request(req.clone(), LIMIT).await);
        let on_nats = as_result(over_nats.request(req, LIMIT).await);
        if op == "workers" {
            // Heartbeats move on between the three asks: the same kind of answer.
            for r in [&here, &there, &on_nats] {
                assert!(matches!(r, Ok(ApiReply::Workers(_))), "{r:?}");
            }
            continue;
        }
        assert_eq!(
            here, there,
            "`{op}` answers differently in process and over the bus"
        );
        assert_eq!(
            here, on_nats,
            "`{op}` answers differently in process and over NATS"
        );
        if let Err(e) = &here {
            assert!(
                !e.message.contains("malformed") && !e.message.contains("unknown variant"),
                "`{op}` did not reach its handler: {e:?}"
            );
        }
    }
    let _ = stop.send(());
    tokio::time::timeout(LIMIT, served)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    sys.stop().await;
}

fn as_result(r: Result<ApiReply, ClientError>) -> Result<ApiReply, ApiError> {
    r.map_err(|e| match e.api() {
        Some(e) => e.clone(),
        None => panic!("a transport error: {e}"),
    })
}

/// Every declared operation, asked by a scoped client (`mallory`) about a fork and a run
/// of another account, answers as if they did not exist (or, for changing a cap, is
/// refused): a handler that forgets its scope check (`coordinator/src/api.rs`) fails
/// here, and a new operation without a sample fails the coverage check. The same requests
/// from an operator find the fork, so the refusals are the scope's, not missing objects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_declared_operation_is_scoped_to_the_callers_accounts() {
    use forkfleet_shared::api::{dispatch, Caller};
    let sys = System::start(1).await;
    let ex = Example::quickstart();
    let view = sys.create(&ex.spec()).await;
    let settled = sys.remote.wait_settled(view.fork_id, LIMIT).await.unwrap();
    let fork = settled.fork_id;
    let run = settled.branches[0].run_id;
    let label = settled.branches[0].label.clone();
    let plan = spec::load(&ex.spec()).unwrap().plan;
    // Operations a scoped client may send about anything: they answer for what it may use
    // only (checked below), or name nothing of another account's.
    let unscoped = ["ping", "forks", "accounts", "create_fork", "put_blob_part"];
    let samples: Vec<ApiRequest> = vec![
        api::Ping.into(),
        api::Forks.into(),
        api::Accounts.into(),
        // Before mallory uploads the same workspace for her own fork (below).
        api::GetBlob {
            blob: view.snapshot,
        }
        .into(),
        api::MissingBlobs {
            blobs: vec![view.snapshot],
        }
        .into(),
        api::GetBlobPart {
            blob: view.snapshot,
            start: 0,
            len: 100,
        }
        .into(),
        api::CreateFork {
            plan,
            parent: ParentRun::New,
            snapshot: view.snapshot,
            workspace: None,
            left_out: None,
            git: None,
        }
        .into(),
        api::AgentFork {
            parent_run: run,
            cutoff_seq: 0,
            snapshot: view.snapshot,
            branches: vec![],
            strategy: None,
            aggregate_budget_usd: None,
        }
        .into(),
        api::AgentMerge {
            fork,
            pick: label.clone(),
            parent_run: run,
        }
        .into(),
        api::GetFork { fork }.into(),
        api::FindFork {
            prefix: fork.to_string(),
        }
        .into(),
        api::WaitSettled {
            fork,
            timeout_ms: 0,
        }
        .into(),
        api::Watch {
            fork,
            seen: None,
            timeout_ms: 0,
        }
        .into(),
        api::Diff {
            fork,
            options: DiffOptions::default(),
        }
        .into(),
        api::Merge {
            fork,
            pick: label.clone(),
        }
        .into(),
        api::Terminate {
            fork,
            label: label.clone(),
        }
        .into(),
        api::Abort { fork }.into(),
        api::Steer {
            fork,
            label: label.clone(),
            text: "x".into(),
        }
        .into(),
        api::Continue {
            fork,
            label: label.clone(),
            text: "x".into(),
        }
        .into(),
        api::Approvals { fork: Some(fork) }.into(),
        api::Decide {
            fork,
            label: label.clone(),
            call_id: None,
            approve: true,
            reason: Some("mine now".into()),
        }
        .into(),
        api::RunEvents { run }.into(),
        api::Checkpoints { run }.into(),
        api::GetForkCost { fork }.into(),
        api::Topup {
            fork,
            branch: None,
            usd: 1.0,
        }
        .into(),
        api::MoveBudget {
            fork,
            from: label.clone(),
            to: label.clone(),
            usd: 1.0,
        }
        .into(),
        api::AccountSet {
            name: "mallory".into(),
            cap_usd: Some(1_000.0),
        }
        .into(),
        api::Resolve {
            fork,
            strategy: None,
            no_commit: false,
            judge_models: Vec::new(),
        }
        .into(),
        api::Verdict { fork }.into(),
        api::Gc {
            older_than_ms: None,
            dry_run: false,
            grace_ms: None,
        }
        .into(),
        api::RemoveFork {
            fork,
            dry_run: false,
        }
        .into(),
        api::FindRun {
            prefix: run.to_string(),
        }
        .into(),
        api::CheckpointSave {
            run,
            label: "mine".into(),
            at: None,
        }
        .into(),
        api::CheckpointRemove {
            run,
            checkpoint: format!("fork:{fork}"),
        }
        .into(),
        api::CheckpointClear { run }.into(),
        api::Rewind {
            run,
            checkpoint: format!("fork:{fork}"),
            dry_run: true,
        }
        .into(),
        api::ForkCheckpoint {
            run,
            checkpoint: format!("fork:{fork}"),
        }
        .into(),
        api::RunWorkspace { run }.into(),
        api::PutBlobPart {
            blob: forkfleet_shared::blob::BlobHash::of(b"mallory's"),
            offset: 0,
            total: 9,
            bytes: bytes::Bytes::from_static(b"mallory's"),
        }
        .into(),
        api::Runs.into(),
        api::ListWorkers.into(),
        api::GetRun { run }.into(),
        api::RunFork {
            parent: run,
            options: api::RunForkOptions::default(),
        }
        .into(),
        api::RunResume { run, text: None }.into(),
    ];
    let mut covered: Vec<&str> = samples.iter().map(ApiRequest::op).collect();
    covered.sort_unstable();
    let mut declared = api::OPERATIONS.to_vec();
    declared.sort_unstable();
    assert_eq!(
        covered, declared,
        "every declared operation needs a sample here"
    );

    let mallory = Caller::Client("mallory".into());
    for req in samples {
        let op = req.op();
        if op == "create_fork" {
            // Her fork names only blobs she uploaded (ADR 37): the same workspace's.
            let manifest = sys.handle.blob(&view.snapshot).await.unwrap().unwrap();
            let files = forkfleet_shared::manifest::Manifest::from_blob(&manifest).unwrap();
            let mut hashes = vec![view.snapshot];
            hashes.extend(files.files.values().map(|f| f.hash));
            if let ApiRequest::CreateFork(c) = &req {
                hashes.extend(c.plan.models.values().filter_map(|m| m.script));
            }
            for h in hashes {
                let bytes = sys.handle.blob(&h).await.unwrap().unwrap();
                let up = api::PutBlobPart {
                    blob: h,
                    offset: 0,
                    total: bytes.len() as u64,
                    bytes,
                };
                dispatch(&sys.handle, &mallory, up.into()).await.unwrap();
            }
        }
        let answer = dispatch(&sys.handle, &mallory, req).await;
        match op {
            "forks" => match answer {
                Ok(ApiReply::Forks(forks)) => assert!(forks.is_empty(), "{forks:?}"),
                other => panic!("`forks`: {other:?}"),
            },
            "accounts" => match answer {
                Ok(ApiReply::Accounts(accounts)) => {
                    assert!(accounts.iter().all(|a| a.name == "mallory"), "{accounts:?}")
                }
                other => panic!("`accounts`: {other:?}"),
            },
            "workers" => match answer {
                Ok(ApiReply::Workers(workers)) => assert!(
                    workers.iter().all(|w| !w.running.contains(&run)),
                    "{workers:?}"
                ),
                other => panic!("`workers`: {other:?}"),
            },
            "runs" => match answer {
                Ok(ApiReply::Runs(runs)) => assert!(
                    runs.iter()
                        .all(|r| r.fork_id != Some(fork) && r.run_id != run),
                    "{runs:?}"
                ),
                other => panic!("`runs`: {other:?}"),
            },
            // Another account's blob (the fork's snapshot) is absent to it (ADR 37).
            "get_blob" => assert_eq!(answer.unwrap(), ApiReply::Blob(None)),
            "get_blob_part" => assert_eq!(answer.unwrap(), ApiReply::BlobPart(None)),
            "missing_blobs" => {
                assert_eq!(answer.unwrap(), ApiReply::Blobs(vec![view.snapshot]))
            }
            "account_set" | "gc" => {
                let e = answer.unwrap_err();
                assert_eq!(e.kind, ApiErrorKind::BadInput, "{e:?}");
                assert!(e.message.contains("operators only"), "{e:?}");
            }
            op if unscoped.contains(&op) => {}
            op => {
                let e = answer.expect_err(op);
                assert_eq!(
                    e.kind,
                    ApiErrorKind::NotFound,
                    "`{op}` answered a scoped client about another account's fork with {e:?}"
                );
            }
        }
    }
    // Nor may her fork start from another account's run (its conversation, and a merge
    // into its files).
    let theirs = api::CreateFork {
        plan: spec::load(&ex.spec()).unwrap().plan,
        parent: ParentRun::Existing { run_id: run },
        snapshot: view.snapshot,
        workspace: None,
        left_out: None,
        git: None,
    };
    let e = dispatch(&sys.handle, &mallory, theirs.into())
        .await
        .unwrap_err();
    assert_eq!(e.kind, ApiErrorKind::NotFound, "{e:?}");
    // A short prefix both forks share (ids begin with their time) finds mallory's own
    // fork, created above: another account's forks are not even an ambiguity.
    let short = api::FindFork {
        prefix: fork.to_string()[..8].to_string(),
    };
    match dispatch(&sys.handle, &mallory, short.into()).await {
        Ok(ApiReply::ForkId(own)) => assert_ne!(own, fork),
        other => panic!("{other:?}"),
    }
    // The fork was not touched, and an operator finds it.
    let admin = dispatch(&sys.handle, &Caller::Admin, api::GetFork { fork }.into())
        .await
        .unwrap();
    match admin {
        ApiReply::Fork(v) => {
            assert_eq!(v.state, settled.state);
            assert!(v.branches.iter().all(|b| b.state == BranchState::Done));
        }
        other => panic!("{other:?}"),
    }
    sys.stop().await;
}
