//! Test fixture: a real sled store in a temp dir, a real bus, and a fake worker that pulls
//! branch tasks from the bus and publishes scripted events.
//!
//! The bus is the in-process LocalBus, or with `FORKFLEET_TEST_BUS=nats` a NatsBus on a
//! real nats-server started per test: the same suite runs on both (`scripts/test` runs it
//! twice).

use async_trait::async_trait;
use bytes::Bytes;
use forkfleet_bus::local::{LocalBus, LocalBusConfig};
use forkfleet_bus::nats::{NatsBus, NatsConfig};
use forkfleet_bus::testkit::NatsServer;
use forkfleet_bus::Bus;
use forkfleet_coordinator::{Coordinator, CoordinatorConfig, CoordinatorHandle, RunStore};
use forkfleet_shared::api::{CreateFork, ForkView, ParentRun};
use forkfleet_shared::blob::{BlobError, BlobHash, BlobStore};
use forkfleet_shared::event::{Event, Message, Usage};
use forkfleet_shared::flush::ConflictPolicy;
use forkfleet_shared::ids::{ForkId, RunId};
use forkfleet_shared::manifest::{FileEntry, Manifest, MODE_FILE};
use forkfleet_shared::overlay::ChangeOp;
use forkfleet_shared::path::WsPath;
use forkfleet_shared::pricing::Price;
use forkfleet_shared::protocol::{BranchEvent, BranchTask, DEFAULT_POOL};
use forkfleet_shared::spec::{BranchPlan, ForkPlan, Limits, ModelPlan};
use forkfleet_shared::state::BranchState;
use forkfleet_shared::wire;
use std::collections::BTreeMap;
use std::future::Future;
use std::sync::{Arc, RwLock};
use std::time::Duration;
use tempfile::TempDir;

/// Every await in the tests is bounded by this.
pub const T: Duration = Duration::from_secs(20);
pub const MODEL: &str = "scripted:demo";

pub async fn within<F: Future>(f: F) -> F::Output {
    tokio::time::timeout(T, f).await.expect("timed out")
}

/// A blob store whose backing store can be swapped: the bus outlives a coordinator
/// restart while the sled store (which holds the data dir's lock) is closed and reopened.
#[derive(Clone)]
pub struct SwitchBlobs(Arc<RwLock<Arc<dyn BlobStore>>>);

impl SwitchBlobs {
    fn new(inner: Arc<dyn BlobStore>) -> Self {
        Self(Arc::new(RwLock::new(inner)))
    }
    fn set(&self, inner: Arc<dyn BlobStore>) {
        *self.0.write().unwrap() = inner;
    }
    fn inner(&self) -> Arc<dyn BlobStore> {
        self.0.read().unwrap().clone()
    }
}

#[async_trait]
impl BlobStore for SwitchBlobs {
    async fn put(&self, hash: BlobHash, bytes: Bytes) -> Result<(), BlobError> {
        self.inner().put(hash, bytes).await
    }
    async fn get(&self, hash: &BlobHash) -> Result<Option<Bytes>, BlobError> {
        self.inner().get(hash).await
    }
    async fn missing(&self, hashes: &[BlobHash]) -> Result<Vec<BlobHash>, BlobError> {
        self.inner().missing(hashes).await
    }
}

/// The bus under test; a NATS one holds its server, which stops when the fixture drops.
enum BusKind {
    Local(LocalBus),
    Nats(NatsBus, #[allow(dead_code)] NatsServer),
}

pub struct Fixture {
    pub dir: TempDir,
    pub bus: Arc<dyn Bus>,
    kind: BusKind,
    blobs: SwitchBlobs,
    pub coord: Option<Coordinator>,
}

impl Fixture {
    pub async fn start() -> Fixture {
        Self::start_with(LocalBusConfig::default()).await
    }

    /// A coordinator on the test bus with this ack wait and max deliver.
    pub async fn start_with(config: LocalBusConfig) -> Fixture {
        Self::start_full(config, CoordinatorConfig::default()).await
    }

    /// A coordinator configured as `coordinator` on the test bus configured as `config`.
    pub async fn start_full(config: LocalBusConfig, coordinator: CoordinatorConfig) -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        let store = RunStore::open(dir.path()).unwrap();
        let blobs = SwitchBlobs::new(store.blob_store());
        let (bus, kind): (Arc<dyn Bus>, BusKind) =
            if std::env::var("FORKFLEET_TEST_BUS").as_deref() == Ok("nats") {
                let server = NatsServer::start();
                let nats = within(NatsBus::connect(NatsConfig {
                    ack_wait: config.ack_wait,
                    max_deliver: config.max_deliver,
                    ..NatsConfig::new(server.url())
                }))
                .await
                .unwrap();
                (Arc::new(nats.clone()), BusKind::Nats(nats, server))
            } else {
                let local = LocalBus::with_config(Arc::new(blobs.clone()), config);
                (Arc::new(local.clone()), BusKind::Local(local))
            };
        let coord = within(Coordinator::start(coordinator, store, bus.clone()))
            .await
            .unwrap();
        Fixture {
            dir,
            bus,
            kind,
            blobs,
            coord: Some(coord),
        }
    }

    /// Tasks waiting or in flight in the default pool.
    pub async fn pending_tasks(&self) -> u64 {
        match &self.kind {
            BusKind::Local(b) => b.pending_tasks(DEFAULT_POOL).unwrap() as u64,
            BusKind::Nats(b, _) => within(b.pending_tasks(DEFAULT_POOL)).await.unwrap(),
        }
    }

    /// A handle to the running coordinator. Drop it before a restart: it keeps the store
    /// (and its directory lock) open.
    pub fn h(&self) -> CoordinatorHandle {
        self.coord.as_ref().expect("running").handle()
    }

    /// Shut the coordinator down and close the store (the bus stays up).
    pub async fn stop(&mut self) {
        let coord = self.coord.take().expect("running");
        within(coord.shutdown()).await.unwrap();
        // The bus must not keep the old store (and its lock) alive.
        self.blobs
            .set(Arc::new(forkfleet_shared::blob::MemBlobStore::new()));
    }

    /// Reopen the store in the same dir and start a new coordinator on the same bus.
    pub async fn restart(&mut self) {
        if self.coord.is_some() {
            self.stop().await;
        }
        let store = RunStore::open(self.dir.path()).unwrap();
        self.blobs.set(store.blob_store());
        let coord = within(Coordinator::start(
            CoordinatorConfig::default(),
            store,
            self.bus.clone(),
        ))
        .await
        .unwrap();
        self.coord = Some(coord);
    }

    pub fn blobs(&self) -> Arc<dyn BlobStore> {
        self.bus.blobs()
    }

    /// Upload files and their manifest; the manifest's hash.
    pub async fn upload(&self, files: &[(&str, &str)]) -> BlobHash {
        let mut m = Manifest::default();
        for (p, content) in files {
            let bytes = Bytes::from(content.to_string());
            let e = FileEntry::for_bytes(&bytes, MODE_FILE);
            self.blobs().put(e.hash, bytes).await.unwrap();
            m.insert_file(WsPath::parse(p).unwrap(), e);
        }
        let bytes = m.to_blob().unwrap();
        let h = BlobHash::of(&bytes);
        self.blobs().put(h, bytes).await.unwrap();
        h
    }

    pub async fn create(&self, plan: ForkPlan, parent: ParentRun, snapshot: BlobHash) -> ForkView {
        within(self.h().create_fork(CreateFork {
            plan,
            parent,
            snapshot,
            workspace: Some("/tmp/ws".into()),
            left_out: None,
            git: None,
        }))
        .await
        .unwrap()
    }

    /// Pull one task from the pool (there must be one).
    pub async fn pull(&self) -> (BranchTask, forkfleet_bus::Delivery) {
        let d = within(self.bus.pull_task(DEFAULT_POOL, T))
            .await
            .unwrap()
            .expect("a task");
        (wire::decode::<BranchTask>(&d.payload).unwrap(), d)
    }

    /// The delivery proof a worker holding `delivery` of `task` sends with a takeover under
    /// `attempt` (ADR 18): the coordinator checks the task is queued at that position and
    /// that the delivery count is within `max_deliver`, not that it is the bus's count.
    pub fn proof(
        task: &BranchTask,
        delivery: &forkfleet_bus::Delivery,
        attempt: u32,
    ) -> forkfleet_shared::protocol::TaskProof {
        forkfleet_shared::protocol::TaskProof {
            seq: delivery.seq.expect("a task's queue position"),
            delivered: attempt - task.attempt_base,
        }
    }

    pub async fn publish(&self, fork: ForkId, run: RunId, seq: u64, event: Event) {
        self.publish_as(fork, run, seq, event, 1).await
    }

    /// Publish an event as task attempt `attempt` produced it.
    pub async fn publish_as(&self, fork: ForkId, run: RunId, seq: u64, event: Event, attempt: u32) {
        self.bus
            .publish_event(encoded_as(fork, run, seq, event, attempt))
            .await
            .unwrap();
    }

    /// Publish `steps` as the events of `task`, from its first seq.
    pub async fn play(&self, task: &BranchTask, steps: Vec<Step>) {
        let blobs = self.blobs();
        for (seq, step) in (task.first_seq..).zip(steps) {
            let event = step.into_event(&blobs).await;
            self.publish(task.fork_id, task.run_id, seq, event).await;
        }
    }

    /// Run `n` tasks like a worker: per task, the events `script` returns.
    pub async fn fake_worker(
        &self,
        n: usize,
        script: impl Fn(&BranchTask) -> Vec<Step>,
    ) -> Vec<BranchTask> {
        let mut tasks = Vec::new();
        for _ in 0..n {
            let (task, delivery) = self.pull().await;
            self.play(&task, script(&task)).await;
            delivery.ack().await.unwrap();
            tasks.push(task);
        }
        tasks
    }
}

/// One scripted worker step.
pub enum Step {
    Status(BranchState),
    Fail(BranchState, &'static str),
    Respond(String),
    Write(String, String),
    Delete(String),
    Usage(u64, u64, f64),
    /// The worker applied a steer (its `steer` event).
    Steer(&'static str),
}

impl Step {
    pub async fn into_event(self, blobs: &Arc<dyn BlobStore>) -> Event {
        match self {
            Step::Status(state) => Event::Status { state, error: None },
            Step::Steer(text) => Event::Steer { text: text.into() },
            Step::Fail(state, e) => Event::Status {
                state,
                error: Some(e.into()),
            },
            Step::Respond(text) => Event::ModelResponse {
                model: MODEL.into(),
                text: Some(text),
                tool_calls: vec![],
                request: None,
                finish_reason: None,
                reasoning: None,
            },
            Step::Write(path, content) => {
                let bytes = Bytes::from(content);
                let entry = FileEntry::for_bytes(&bytes, MODE_FILE);
                // Blob first, then the event.
                blobs.put(entry.hash, bytes).await.unwrap();
                Event::FileChange {
                    change: ChangeOp::Write {
                        path: WsPath::parse(&path).unwrap(),
                        entry,
                    },
                }
            }
            Step::Delete(path) => Event::FileChange {
                change: ChangeOp::Delete {
                    path: WsPath::parse(&path).unwrap(),
                },
            },
            Step::Usage(input, output, cost) => Event::Usage {
                model: MODEL.into(),
                usage: Usage {
                    input_tokens: input,
                    output_tokens: output,
                    cached_tokens: 0,
                    cache_write_tokens: 0,
                    reasoning_tokens: 0,
                },
                cost_usd: cost,
                reservation: None,
                cached: false,
            },
        }
    }
}

/// The standard branch: running, a response, one write of `file` with a label-specific
/// content, usage, done.
pub fn simple(task: &BranchTask, file: &str) -> Vec<Step> {
    vec![
        Step::Status(BranchState::Running),
        Step::Respond(format!("working on {}", task.label)),
        Step::Write(file.into(), format!("{} was here\n", task.label)),
        Step::Usage(100, 20, 0.01),
        Step::Status(BranchState::Done),
    ]
}

pub fn plan(labels: &[&str]) -> ForkPlan {
    let mut models = BTreeMap::new();
    models.insert(
        MODEL.to_string(),
        ModelPlan {
            price: Some(Price {
                input_per_mtok: 1.0,
                output_per_mtok: 2.0,
                cached_per_mtok: None,
                cache_write_per_mtok: None,
            }),
            script: None,
            endpoint: None,
        },
    );
    ForkPlan {
        name: None,
        approval: None,
        goal: "make it better".into(),
        system_prompt: Some("you are careful".into()),
        history: vec![
            Message::User {
                text: "earlier question".into(),
            },
            Message::Assistant {
                text: Some("earlier answer".into()),
                tool_calls: vec![],
                reasoning: None,
            },
        ],
        model: MODEL.into(),
        limits: Limits::default(),
        conflict_policy: ConflictPolicy::KeepParent,
        aggregate_budget_usd: None,
        budget: Default::default(),
        resolve: Default::default(),
        models,
        branches: labels
            .iter()
            .map(|l| BranchPlan {
                approval: None,
                label: l.to_string(),
                steer: format!("try {l}"),
                model: MODEL.into(),
                budget_usd: None,
                extra_instructions: None,
                max_turns: 10,
                max_output_tokens: None,
                temperature: None,
            })
            .collect(),
        tools: Default::default(),
        solo: false,
    }
}

/// Wait until the fork's view satisfies `done`, woken by the fork's change counter.
pub async fn wait_view(
    h: &CoordinatorHandle,
    id: ForkId,
    done: impl Fn(&ForkView) -> bool,
) -> ForkView {
    within(async {
        let mut rx = h.changes(id).await.unwrap();
        loop {
            let v = h.fork(id).await.unwrap();
            if done(&v) {
                return v;
            }
            rx.changed().await.unwrap();
        }
    })
    .await
}

/// An event as a worker's first attempt publishes it: a wire-encoded `branch_event`.
pub fn encoded(fork: ForkId, run: RunId, seq: u64, event: Event) -> Bytes {
    encoded_as(fork, run, seq, event, 1)
}

/// [`encoded`], as task attempt `attempt` produced it.
pub fn encoded_as(fork: ForkId, run: RunId, seq: u64, event: Event, attempt: u32) -> Bytes {
    wire::encode(&BranchEvent {
        fork_id: fork,
        run_id: run,
        seq,
        at_ms: 0,
        event,
        attempt,
    })
    .unwrap()
}
