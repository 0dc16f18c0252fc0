//! The time that decides, from the coordinator's clock (issue 37): a request for consent
//! times out when a manual clock passes its deadline, not before, without waiting for it.
//!
//! The coordinator here runs on the in-process LocalBus with a manual clock (the fixture
//! of `support.rs` starts it on the system clock).

use super::support::*;
use bytes::Bytes;
use forkfleet_bus::local::{LocalBus, LocalBusConfig};
use forkfleet_bus::Bus;
use forkfleet_coordinator::{Coordinator, CoordinatorConfig, CoordinatorHandle, RunStore};
use forkfleet_shared::api::{CreateFork, ParentRun};
use forkfleet_shared::approval::{OnTimeout, BY_TIMEOUT};
use forkfleet_shared::blob::BlobHash;
use forkfleet_shared::clock::ManualClock;
use forkfleet_shared::event::Event;
use forkfleet_shared::ids::ForkId;
use forkfleet_shared::manifest::{FileEntry, Manifest, MODE_FILE};
use forkfleet_shared::path::WsPath;
use forkfleet_shared::protocol::{BranchEvent, BranchTask, DEFAULT_POOL};
use forkfleet_shared::state::BranchState;
use forkfleet_shared::wire;
use std::sync::Arc;

/// The manual clock's start: far from the wall clock's now, so only it can decide.
const START_MS: u64 = 1_000_000_000;
const TIMEOUT_S: u64 = 60;

/// A coordinator timed by `clock`, on a LocalBus, over a store in `dir`.
struct Clocked {
    _dir: tempfile::TempDir,
    bus: LocalBus,
    /// Dropped with the test: it winds down in the background.
    coord: Option<Coordinator>,
}

impl Clocked {
    async fn start(clock: &ManualClock) -> Clocked {
        let dir = tempfile::tempdir().unwrap();
        let store = RunStore::open(dir.path()).unwrap();
        let bus = LocalBus::with_config(store.blob_store(), LocalBusConfig::default());
        let coord = within(Coordinator::start_with_clock(
            CoordinatorConfig::default(),
            store,
            Arc::new(bus.clone()),
            clock.shared(),
        ))
        .await
        .unwrap();
        Clocked {
            _dir: dir,
            bus,
            coord: Some(coord),
        }
    }

    fn h(&self) -> CoordinatorHandle {
        self.coord.as_ref().expect("running").handle()
    }

    /// A snapshot of one file; its manifest's hash.
    async fn snapshot(&self) -> BlobHash {
        let blobs = self.bus.blobs();
        let bytes = Bytes::from_static(b"hello\n");
        let entry = FileEntry::for_bytes(&bytes, MODE_FILE);
        blobs.put(entry.hash, bytes).await.unwrap();
        let mut m = Manifest::default();
        m.insert_file(WsPath::parse("a.txt").unwrap(), entry);
        let bytes = m.to_blob().unwrap();
        let hash = BlobHash::of(&bytes);
        blobs.put(hash, bytes).await.unwrap();
        hash
    }

    /// Pull one task from the pool and ack it (there must be one).
    async fn pull(&self) -> BranchTask {
        let d = within(self.bus.pull_task(DEFAULT_POOL, T))
            .await
            .unwrap()
            .expect("a task");
        let task = wire::decode::<BranchTask>(&d.payload).unwrap();
        d.ack().await.unwrap();
        task
    }

    /// Publish `events` as the worker of `task` produced them, from its first seq.
    async fn play(&self, task: &BranchTask, events: Vec<Event>) {
        for (seq, event) in (task.first_seq..).zip(events) {
            let ev = BranchEvent {
                fork_id: task.fork_id,
                run_id: task.run_id,
                seq,
                at_ms: 0,
                event,
                attempt: 1,
            };
            self.bus
                .publish_event(wire::encode(&ev).unwrap())
                .await
                .unwrap();
        }
    }

    async fn branch_state(&self, id: ForkId) -> BranchState {
        within(self.h().fork(id)).await.unwrap().branches[0].state
    }
}

#[tokio::test]
async fn an_approval_times_out_exactly_when_the_manual_clock_passes_its_deadline() {
    let clock = ManualClock::new(START_MS);
    let cx = Clocked::start(&clock).await;
    let snap = cx.snapshot().await;
    let view = within(cx.h().create_fork(CreateFork {
        plan: plan(&["a"]),
        parent: ParentRun::New,
        snapshot: snap,
        workspace: Some("/tmp/ws".into()),
        left_out: None,
        git: None,
    }))
    .await
    .unwrap();
    let id = view.fork_id;
    let task = cx.pull().await;
    let requested = Event::ApprovalRequested {
        call_id: "call-1".into(),
        tool: "delete_file".into(),
        args: serde_json::json!({"path": "a.txt"}),
        rule: "tools: delete_file".into(),
        requested_at_ms: START_MS,
        timeout_s: TIMEOUT_S,
        on_timeout: OnTimeout::Deny,
    };
    cx.play(
        &task,
        vec![
            Event::Status {
                state: BranchState::Running,
                error: None,
            },
            requested,
            Event::Status {
                state: BranchState::AwaitingApproval,
                error: None,
            },
        ],
    )
    .await;
    let deadline = START_MS + TIMEOUT_S * 1000;
    let waiting = wait_view(&cx.h(), id, |v| {
        v.branches[0].state == BranchState::AwaitingApproval && v.branches[0].approval.is_some()
    })
    .await;
    assert_eq!(
        waiting.branches[0].approval.as_ref().unwrap().deadline_ms,
        deadline
    );

    // One millisecond before the deadline: the step reached the fork actor before this
    // view (its mailbox is in order), and it left the request waiting.
    clock.advance(TIMEOUT_S * 1000 - 1);
    assert_eq!(cx.branch_state(id).await, BranchState::AwaitingApproval);
    assert_eq!(
        cx.bus.pending_tasks(DEFAULT_POOL).unwrap(),
        0,
        "nothing enqueued"
    );
    let log = within(cx.h().run_events(task.run_id)).await.unwrap();
    assert!(
        !log.iter()
            .any(|(_, e)| matches!(e, Event::ApprovalDecided { .. })),
        "not decided before its deadline"
    );

    // At the deadline: answered by the rule's `on_timeout` (deny), stamped by the clock,
    // and the branch enqueued again for a worker to take it over.
    clock.advance(1);
    let decided = wait_view(&cx.h(), id, |v| v.branches[0].state == BranchState::Pending).await;
    assert!(decided.branches[0].approval.is_none());
    let log = within(cx.h().run_events(task.run_id)).await.unwrap();
    let answers: Vec<_> = log
        .iter()
        .filter_map(|(_, e)| match e {
            Event::ApprovalDecided {
                call_id,
                approved,
                by,
                decided_at_ms,
                ..
            } => Some((call_id.clone(), *approved, by.clone(), *decided_at_ms)),
            _ => None,
        })
        .collect();
    assert_eq!(
        answers,
        vec![(
            "call-1".to_string(),
            false,
            BY_TIMEOUT.to_string(),
            deadline
        )]
    );
    let again = cx.pull().await;
    assert_eq!((again.run_id, again.label.as_str()), (task.run_id, "a"));

    // Later steps find nothing waiting: answered once.
    clock.advance(TIMEOUT_S * 1000);
    assert_eq!(cx.branch_state(id).await, BranchState::Pending);
    let log = within(cx.h().run_events(task.run_id)).await.unwrap();
    let n = log
        .iter()
        .filter(|(_, e)| matches!(e, Event::ApprovalDecided { .. }))
        .count();
    assert_eq!(n, 1);
}
