//! Fixtures: a bus, tasks whose blobs are in its store, and an event collector.
//!
//! The bus is a LocalBus over a MemBlobStore, or with `FORKFLEET_TEST_BUS=nats` a NatsBus on
//! a real nats-server started per test: the same suite runs on both (`scripts/test` runs it
//! twice). Blobs are staged in the MemBlobStore and copied to a NATS bus's store when a task
//! is enqueued.
#![allow(dead_code)]

use bytes::Bytes;
use forkfleet_bus::local::{LocalBus, LocalBusConfig};
use forkfleet_bus::nats::{NatsBus, NatsConfig};
use forkfleet_bus::testkit::NatsServer;
use forkfleet_bus::{Bus, EventConsumer};
use forkfleet_shared::blob::{BlobHash, MemBlobStore};
use forkfleet_shared::budget::OnExhausted;
use forkfleet_shared::event::Event;
use forkfleet_shared::ids::{ForkId, RunId};
use forkfleet_shared::manifest::{FileEntry, Manifest, MODE_FILE, MODE_SYMLINK};
use forkfleet_shared::path::WsPath;
use forkfleet_shared::protocol::{
    BranchEvent, BranchTask, Control, ControlCommand, ResumeReply, ResumeRequest, DEFAULT_POOL,
    RESUME_SUBJECT,
};
use forkfleet_shared::state::BranchState;
use forkfleet_shared::wire;
use forkfleet_worker::{WorkerConfig, WorkerHandle};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

/// Longest any single wait in these tests may take.
pub const WAIT: Duration = Duration::from_secs(10);

pub struct Fixture {
    pub bus: Arc<dyn Bus>,
    kind: BusKind,
    /// The blobs of snapshots, scripts and prefixes (a local bus's own store).
    pub store: MemBlobStore,
    pub fork_id: ForkId,
}

/// The bus under test; a NATS one holds its server, which stops when the fixture drops.
enum BusKind {
    Local(LocalBus),
    Nats(NatsBus, #[allow(dead_code)] NatsServer),
}

impl Fixture {
    pub async fn new() -> Self {
        Self::with_config(LocalBusConfig::default()).await
    }

    pub async fn with_config(config: LocalBusConfig) -> Self {
        let store = MemBlobStore::new();
        let (bus, kind): (Arc<dyn Bus>, BusKind) =
            if std::env::var("FORKFLEET_TEST_BUS").as_deref() == Ok("nats") {
                let server = NatsServer::start();
                let nats = tokio::time::timeout(
                    WAIT,
                    NatsBus::connect(NatsConfig {
                        ack_wait: config.ack_wait,
                        max_deliver: config.max_deliver,
                        ..NatsConfig::new(server.url())
                    }),
                )
                .await
                .unwrap()
                .unwrap();
                (Arc::new(nats.clone()), BusKind::Nats(nats, server))
            } else {
                let local = LocalBus::with_config(Arc::new(store.clone()), config);
                (Arc::new(local.clone()), BusKind::Local(local))
            };
        Self {
            bus,
            kind,
            store,
            fork_id: ForkId::new(),
        }
    }

    /// A fixture on a local bus whatever the test bus (for tests that use only the store).
    pub fn store_only() -> Self {
        let store = MemBlobStore::new();
        let local = LocalBus::new(Arc::new(store.clone()));
        Self {
            bus: Arc::new(local.clone()),
            kind: BusKind::Local(local),
            store,
            fork_id: ForkId::new(),
        }
    }

    pub fn dyn_bus(&self) -> Arc<dyn Bus> {
        self.bus.clone()
    }

    /// The local bus, when the test runs on one.
    pub fn local(&self) -> Option<&LocalBus> {
        match &self.kind {
            BusKind::Local(b) => Some(b),
            BusKind::Nats(..) => None,
        }
    }

    /// Copy the staged blobs to a NATS bus's store (a local bus reads the staging store).
    pub async fn publish_blobs(&self) {
        if let BusKind::Nats(..) = self.kind {
            let to = self.bus.blobs();
            let hashes = self.store.hashes();
            let missing = tokio::time::timeout(WAIT, to.missing(&hashes))
                .await
                .unwrap()
                .unwrap();
            for h in missing {
                let bytes = self.store.get_now(&h).unwrap();
                tokio::time::timeout(WAIT, to.put(h, bytes))
                    .await
                    .unwrap()
                    .unwrap();
            }
        }
    }

    /// A snapshot of text files (and `->target` symlinks), its blobs in the store.
    pub fn snapshot(&self, files: &[(&str, &str)]) -> (Arc<Manifest>, BlobHash) {
        let mut m = Manifest::default();
        for (path, content) in files {
            let (bytes, mode) = match content.strip_prefix("->") {
                Some(target) => (Bytes::from(target.to_string()), MODE_SYMLINK),
                None => (Bytes::from(content.to_string()), MODE_FILE),
            };
            let entry = FileEntry::for_bytes(&bytes, mode);
            self.store.insert(bytes);
            m.insert_file(WsPath::parse(path).unwrap(), entry);
        }
        let hash = self.store.insert(m.to_blob().unwrap());
        (Arc::new(m), hash)
    }

    pub fn script(&self, toml: &str) -> BlobHash {
        self.store.insert(Bytes::from(toml.to_string()))
    }

    pub fn prefix(&self, events: &[Event]) -> BlobHash {
        self.store
            .insert(Bytes::from(rmp_serde::to_vec_named(events).unwrap()))
    }

    /// A task for branch `label` with a standard prefix (fork, system, goal) and a steer
    /// tail, over `snapshot`, playing `script`.
    pub fn task(
        &self,
        label: &str,
        index: u32,
        snapshot: BlobHash,
        script: BlobHash,
    ) -> BranchTask {
        let prefix = vec![
            Event::Fork {
                fork_id: self.fork_id,
                parent_run: RunId::new(),
                fork_root: RunId::new(),
                cutoff_seq: 1,
                label: label.to_string(),
                replay_event_count: 0,
                strategy: None,
                workspaces: Vec::new(),
            },
            Event::System {
                text: "You are a careful engineer.".into(),
            },
            Event::UserMessage {
                text: "Write the notes.".into(),
            },
        ];
        let tail = vec![Event::Steer {
            text: format!("Take approach {label}."),
        }];
        BranchTask {
            approval: None,
            fork_id: self.fork_id,
            run_id: RunId::new(),
            label: label.to_string(),
            index,
            model: "scripted:test".into(),
            price: None,
            script: Some(script),
            prefix: self.prefix(&prefix),
            first_seq: (prefix.len() + tail.len()) as u64,
            tail,
            snapshot,
            max_turns: 50,
            max_output_tokens: 1000,
            budget_usd: None,
            reserve: false,
            on_exhausted: OnExhausted::Stop,
            attempt_base: 0,
            endpoint: None,
            tools: Default::default(),
            temperature: None,
            replay: None,
            fork_root: None,
            on_truncated: Default::default(),
            event_batches: true,
        }
    }

    pub async fn enqueue(&self, task: &BranchTask) {
        self.publish_blobs().await;
        self.bus
            .enqueue_task(DEFAULT_POOL, wire::encode(task).unwrap())
            .await
            .unwrap();
    }

    /// The initial log of a task (prefix blob + tail).
    pub fn initial_log(&self, task: &BranchTask) -> Vec<Event> {
        let bytes = self.store.get_now(&task.prefix).unwrap();
        let mut log: Vec<Event> = rmp_serde::from_slice(&bytes).unwrap();
        log.extend(task.tail.iter().cloned());
        log
    }

    pub async fn send(&self, run_id: RunId, command: ControlCommand) {
        let msg = Control {
            run_id,
            command,
            attempt: None,
        };
        self.bus
            .send_control(run_id, wire::encode(&msg).unwrap())
            .await
            .unwrap();
    }

    pub async fn events(&self) -> Events {
        Events {
            consumer: self.bus.events("test").await.unwrap(),
            by_run: HashMap::new(),
            order: Vec::new(),
            queued: Default::default(),
            messages: 0,
            sent_blobs: Vec::new(),
        }
    }

    /// Tasks waiting or in flight in the default pool.
    pub async fn pending(&self) -> usize {
        match &self.kind {
            BusKind::Local(b) => b.pending_tasks(DEFAULT_POOL).unwrap(),
            BusKind::Nats(b, _) => tokio::time::timeout(WAIT, b.pending_tasks(DEFAULT_POOL))
                .await
                .unwrap()
                .unwrap() as usize,
        }
    }

    /// Answer one resume request as the coordinator does: the branch's log as it has it
    /// (the `fork` event at seq 0, the initial log, then `seen`, the events it applied).
    pub async fn serve_resume(
        &self,
        task: &BranchTask,
        seen: Vec<(u64, Event)>,
    ) -> tokio::task::JoinHandle<ResumeRequest> {
        let asked = self.serve_resume_busy(task, seen, 0).await;
        tokio::spawn(async move { asked.await.unwrap().remove(0) })
    }

    /// Like [`Fixture::serve_resume`], after answering the first `busy` requests as a busy
    /// coordinator does (`retry`); returns every request asked.
    pub async fn serve_resume_busy(
        &self,
        task: &BranchTask,
        seen: Vec<(u64, Event)>,
        busy: usize,
    ) -> tokio::task::JoinHandle<Vec<ResumeRequest>> {
        let mut rx = self.bus.serve(RESUME_SUBJECT).await.unwrap();
        let mut log = vec![(
            0,
            Event::Fork {
                fork_id: task.fork_id,
                parent_run: RunId::new(),
                fork_root: RunId::new(),
                cutoff_seq: 0,
                label: task.label.clone(),
                replay_event_count: 0,
                strategy: None,
                workspaces: Vec::new(),
            },
        )];
        log.extend((1u64..).zip(self.initial_log(task)));
        log.extend(seen);
        tokio::spawn(async move {
            let mut asked = Vec::new();
            loop {
                let req = tokio::time::timeout(WAIT, rx.recv())
                    .await
                    .expect("no resume request within the wait")
                    .expect("resume service closed");
                asked.push(wire::decode::<ResumeRequest>(&req.payload).unwrap());
                let done = asked.len() > busy;
                let reply = if done {
                    ResumeReply::Log {
                        events: std::mem::take(&mut log),
                    }
                } else {
                    ResumeReply::Retry {
                        reason: "store busy".into(),
                    }
                };
                req.respond(wire::encode(&reply).unwrap()).await.unwrap();
                if done {
                    return asked;
                }
            }
        })
    }
}

pub fn config(concurrency: usize) -> WorkerConfig {
    WorkerConfig {
        concurrency,
        pull_wait: Duration::from_millis(50),
        ..WorkerConfig::default()
    }
}

pub async fn start(fx: &Fixture, config: WorkerConfig) -> WorkerHandle {
    tokio::time::timeout(WAIT, forkfleet_worker::start(config, fx.dyn_bus()))
        .await
        .expect("worker start timed out")
        .expect("worker start failed")
}

pub async fn shutdown(handle: WorkerHandle) {
    tokio::time::timeout(WAIT, handle.shutdown())
        .await
        .expect("worker shutdown timed out")
        .expect("worker shutdown failed");
}

/// Consumes the event stream, keeping every branch event by run and in arrival order.
pub struct Events {
    consumer: Box<dyn EventConsumer>,
    pub by_run: HashMap<RunId, Vec<BranchEvent>>,
    pub order: Vec<BranchEvent>,
    /// The rest of a batch read off the stream.
    queued: std::collections::VecDeque<BranchEvent>,
    /// Messages read off the stream (a batch is one).
    pub messages: usize,
    /// The texts batches carried along with their events.
    pub sent_blobs: Vec<Bytes>,
}

impl Events {
    /// The next event (acked), or a panic after [`WAIT`].
    pub async fn next(&mut self) -> BranchEvent {
        let ev = self.next_raw().await;
        self.by_run.entry(ev.run_id).or_default().push(ev.clone());
        self.order.push(ev.clone());
        ev
    }

    /// The next event (acked), not kept: the next of a batch already read, or of the next
    /// message (an event or a batch).
    pub async fn next_raw(&mut self) -> BranchEvent {
        if let Some(ev) = self.queued.pop_front() {
            return ev;
        }
        let d = tokio::time::timeout(WAIT, self.consumer.next())
            .await
            .expect("no event within the wait")
            .expect("event stream closed");
        d.ack().await.unwrap();
        self.messages += 1;
        let message = forkfleet_shared::protocol::read_message(&d.payload).expect("branch events");
        self.sent_blobs
            .extend(message.blobs.into_iter().map(|(_, bytes)| bytes));
        self.queued.extend(message.events);
        self.queued.pop_front().expect("a message of no events")
    }

    /// Read until `pred` holds for an event; returns it.
    pub async fn until(&mut self, mut pred: impl FnMut(&BranchEvent) -> bool) -> BranchEvent {
        loop {
            let ev = self.next().await;
            if pred(&ev) {
                return ev;
            }
        }
    }

    /// Read until every run in `runs` has published a terminal status.
    pub async fn until_terminal(&mut self, runs: &[RunId]) {
        while !runs.iter().all(|r| self.terminal(*r).is_some()) {
            self.next().await;
        }
    }

    /// The terminal status of a run, if seen.
    pub fn terminal(&self, run: RunId) -> Option<(BranchState, Option<String>)> {
        self.by_run.get(&run)?.iter().find_map(|e| match &e.event {
            Event::Status { state, error } if state.is_terminal() => Some((*state, error.clone())),
            _ => None,
        })
    }

    pub fn of(&self, run: RunId) -> Vec<Event> {
        self.by_run
            .get(&run)
            .map(|v| v.iter().map(|e| e.event.clone()).collect())
            .unwrap_or_default()
    }

    pub fn count(&self, run: RunId, kind: &str) -> usize {
        self.of(run).iter().filter(|e| e.kind() == kind).count()
    }
}

/// Read every event published so far: publish a marker event and read until it (the event
/// stream keeps publish order). Call after the workers have stopped.
pub async fn settle(fx: &Fixture, events: &mut Events) {
    let marker = RunId::new();
    let msg = BranchEvent {
        fork_id: fx.fork_id,
        run_id: marker,
        seq: 0,
        at_ms: 1,
        event: Event::UserMessage {
            text: "marker".into(),
        },
        attempt: 1,
    };
    fx.bus
        .publish_event(wire::encode(&msg).unwrap())
        .await
        .unwrap();
    events.until(|e| e.run_id == marker).await;
}

pub fn is_status(ev: &BranchEvent, run: RunId, want: BranchState) -> bool {
    ev.run_id == run && matches!(&ev.event, Event::Status { state, .. } if *state == want)
}

/// Send `job` until a worker serves resolve jobs (its service task subscribes after it
/// starts), and return its reply.
pub async fn ask_resolve(
    fx: &Fixture,
    job: &forkfleet_shared::protocol::ResolveJob,
) -> forkfleet_shared::protocol::ResolveJobReply {
    let payload = wire::encode(job).unwrap();
    let reply = tokio::time::timeout(WAIT, async {
        loop {
            match fx
                .bus
                .request(
                    forkfleet_shared::protocol::RESOLVE_SUBJECT,
                    payload.clone(),
                    WAIT,
                )
                .await
            {
                Err(forkfleet_bus::BusError::NoResponders(_)) => {
                    tokio::time::sleep(Duration::from_millis(5)).await
                }
                other => return other.unwrap(),
            }
        }
    })
    .await
    .expect("no worker answered the resolve job");
    wire::decode(&reply).unwrap()
}
