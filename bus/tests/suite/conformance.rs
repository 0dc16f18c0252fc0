//! The same behavioural tests against both buses: [`LocalBus`] and [`NatsBus`] on a real
//! `nats-server` (started per test on a free port by the `testkit` fixture).
//!
//! Run: `cargo test -p forkfleet-bus --test all conformance` (needs `nats-server`:
//! `scripts/setup`).
//! Rates over loopback: `... --test all -- --ignored --nocapture measure_rates`.
//!
//! Every bus call is bounded by [`within`]; waiting for an ack-wait expiry is done by pulling
//! with a wait, never by sleeping.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use bytes::Bytes;
use forkfleet_bus::local::{LocalBus, LocalBusConfig};
use forkfleet_bus::nats::{NatsBus, NatsConfig};
use forkfleet_bus::testkit::NatsServer;
use forkfleet_bus::{Bus, BusError, EventConsumer};
use forkfleet_shared::blob::{BlobHash, MemBlobStore};
use forkfleet_shared::ids::{RunId, WorkerId};
use forkfleet_shared::protocol::{now_ms, WorkerInfo};
use forkfleet_shared::trace::traceparent_of;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;
use tracing::Instrument;

/// Ack wait of both buses in these tests.
const ACK_WAIT: Duration = Duration::from_secs(1);
/// Deliveries of a task that may take its branch over (the queue delivers past it).
const MAX_DELIVER: u32 = 3;
/// Bound of any single bus call in these tests.
const CALL_BOUND: Duration = Duration::from_secs(20);

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// Await `f`, failing the test if it takes longer than [`CALL_BOUND`].
async fn within<F: Future>(f: F) -> F::Output {
    tokio::time::timeout(CALL_BOUND, f)
        .await
        .expect("a bus call did not finish in time")
}

fn b(s: &'static str) -> Bytes {
    Bytes::from_static(s.as_bytes())
}

/// A bus under test, and the server behind it when there is one.
struct Fixture {
    bus: Arc<dyn Bus>,
    /// Kept alive for the test; killed on drop.
    _server: Option<NatsServer>,
}

async fn local() -> Fixture {
    let bus = LocalBus::with_config(
        Arc::new(MemBlobStore::new()),
        LocalBusConfig {
            ack_wait: ACK_WAIT,
            max_deliver: MAX_DELIVER,
        },
    );
    Fixture {
        bus: Arc::new(bus),
        _server: None,
    }
}

fn nats_config(server: &NatsServer) -> NatsConfig {
    let mut config = NatsConfig::new(server.url());
    config.name = Some("bus-conformance".into());
    config.ack_wait = ACK_WAIT;
    config.max_deliver = MAX_DELIVER;
    config.request_timeout = Duration::from_secs(5);
    config
}

async fn nats() -> Fixture {
    let server = NatsServer::start();
    let bus = within(NatsBus::connect(nats_config(&server)))
        .await
        .unwrap();
    Fixture {
        bus: Arc::new(bus),
        _server: Some(server),
    }
}

/// One `#[tokio::test]` per behaviour and per bus.
macro_rules! conformance {
    ($($name:ident),* $(,)?) => {
        mod local_bus {
            $(
                #[tokio::test]
                async fn $name() {
                    super::$name(super::local().await).await;
                }
            )*
        }
        mod nats_bus {
            $(
                #[tokio::test]
                async fn $name() {
                    super::$name(super::nats().await).await;
                }
            )*
        }
    };
}

conformance!(
    task_ack_removes_it,
    unacked_task_redelivered_after_ack_wait,
    nak_with_delay_then_without,
    in_progress_extends_the_ack_wait,
    a_task_is_delivered_past_max_deliver_until_acked,
    tasks_are_shared_by_concurrent_pullers,
    events_in_publish_order,
    a_batch_of_events_arrives_whole_and_in_order,
    unacked_events_return_to_the_next_consumer,
    control_sent_before_watch_arrives_in_order,
    blobs_put_get_missing_dedup,
    request_reply_no_responders_and_timeout,
    workers_listed_and_stale_ones_hidden,
    a_removed_worker_is_listed_no_more,
    payloads_are_opaque_bytes,
    tasks_carry_the_trace_context,
    a_task_is_found_at_its_position_until_settled,
    the_task_queue_counts_waiting_and_in_flight_tasks,
);

/// The backlog the coordinator's queue metrics read: waiting tasks, then held ones, none
/// once acked (polled: an ack reaches the server after `ack` returns); a bus that is up
/// says it is connected.
async fn the_task_queue_counts_waiting_and_in_flight_tasks(fx: Fixture) {
    let bus = &fx.bus;
    assert!(bus.connected());
    within(bus.enqueue_task("q", b("t1"))).await.unwrap();
    within(bus.enqueue_task("q", b("t2"))).await.unwrap();
    let q = within(bus.task_queue("q")).await.unwrap();
    assert_eq!((q.waiting, q.in_flight, q.depth()), (2, 0, 2));
    let d = within(bus.pull_task("q", ms(5000))).await.unwrap().unwrap();
    let q = within(bus.task_queue("q")).await.unwrap();
    assert_eq!((q.waiting, q.in_flight), (1, 1));
    within(d.ack()).await.unwrap();
    let deadline = std::time::Instant::now() + ms(5000);
    loop {
        let q = within(bus.task_queue("q")).await.unwrap();
        if (q.waiting, q.in_flight) == (1, 0) {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{q:?}");
        tokio::time::sleep(ms(20)).await;
    }
}

/// ADR 18: every delivery of a task names its queue position, the same on a redelivery;
/// `queued_task` finds the task there while it is queued or held, and not once acked.
async fn a_task_is_found_at_its_position_until_settled(fx: Fixture) {
    let bus = &fx.bus;
    assert_eq!(bus.max_deliver(), MAX_DELIVER);
    within(bus.enqueue_task("p", b("t1"))).await.unwrap();
    let d1 = within(bus.pull_task("p", ms(5000))).await.unwrap().unwrap();
    let seq = d1.seq.expect("a task's position");
    // A lease, when the bus has one, is its ack wait.
    assert!(d1.lease.is_none() || d1.lease == Some(ACK_WAIT), "{d1:?}");
    assert_eq!(
        within(bus.queued_task("p", seq)).await.unwrap(),
        Some(b("t1"))
    );
    assert_eq!(within(bus.queued_task("p", seq + 100)).await.unwrap(), None);
    // Not acked: delivered again, at the same position.
    let d2 = within(bus.pull_task("p", ms(5000))).await.unwrap().unwrap();
    assert_eq!(d2.attempt, 2);
    assert_eq!(d2.seq, Some(seq));
    within(d2.ack()).await.unwrap();
    assert_eq!(within(bus.queued_task("p", seq)).await.unwrap(), None);
}

async fn task_ack_removes_it(fx: Fixture) {
    let bus = &fx.bus;
    within(bus.enqueue_task("p", b("t1"))).await.unwrap();
    let d = within(bus.pull_task("p", ms(5000))).await.unwrap().unwrap();
    assert_eq!(d.payload, b("t1"));
    assert_eq!(d.attempt, 1);
    within(d.ack()).await.unwrap();
    // Gone for good: not even after the ack wait.
    let again = within(bus.pull_task("p", ACK_WAIT + ms(500)))
        .await
        .unwrap();
    assert!(again.is_none(), "{again:?}");
    // Another pool is another queue.
    within(bus.enqueue_task("other", b("o"))).await.unwrap();
    assert!(within(bus.pull_task("p", ms(200))).await.unwrap().is_none());
    let o = within(bus.pull_task("other", ms(5000)))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(o.payload, b("o"));
    within(o.ack()).await.unwrap();
}

async fn unacked_task_redelivered_after_ack_wait(fx: Fixture) {
    let bus = &fx.bus;
    within(bus.enqueue_task("p", b("t"))).await.unwrap();
    let d1 = within(bus.pull_task("p", ms(5000))).await.unwrap().unwrap();
    assert_eq!(d1.attempt, 1);
    let started = Instant::now();
    // Not acked: comes back once the ack wait has passed, as attempt 2.
    let d2 = within(bus.pull_task("p", ms(5000))).await.unwrap().unwrap();
    assert!(
        started.elapsed() >= ACK_WAIT - ms(100),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(d2.payload, b("t"));
    assert_eq!(d2.attempt, 2);
    within(d2.ack()).await.unwrap();
    assert!(within(bus.pull_task("p", ACK_WAIT + ms(500)))
        .await
        .unwrap()
        .is_none());
}

async fn nak_with_delay_then_without(fx: Fixture) {
    let bus = &fx.bus;
    within(bus.enqueue_task("p", b("n"))).await.unwrap();
    let d = within(bus.pull_task("p", ms(5000))).await.unwrap().unwrap();
    let naked = Instant::now();
    within(d.nak(Some(ms(1500)))).await.unwrap();
    // Held back for the delay...
    assert!(within(bus.pull_task("p", ms(500))).await.unwrap().is_none());
    // ...then delivered again.
    let d2 = within(bus.pull_task("p", ms(5000))).await.unwrap().unwrap();
    assert!(naked.elapsed() >= ms(1400), "{:?}", naked.elapsed());
    assert_eq!(d2.payload, b("n"));
    assert_eq!(d2.attempt, 2);
    // Without a delay it is back at once: well before the ack wait would have done it.
    let naked = Instant::now();
    within(d2.nak(None)).await.unwrap();
    let d3 = within(bus.pull_task("p", ms(5000))).await.unwrap().unwrap();
    assert!(naked.elapsed() < ACK_WAIT, "{:?}", naked.elapsed());
    assert_eq!(d3.attempt, 3);
    within(d3.ack()).await.unwrap();
}

async fn in_progress_extends_the_ack_wait(fx: Fixture) {
    let bus = &fx.bus;
    within(bus.enqueue_task("p", b("long"))).await.unwrap();
    let d = within(bus.pull_task("p", ms(5000))).await.unwrap().unwrap();
    // Three windows of 600 ms, each followed by a heartbeat: 1.8 s in all, well past the
    // 1 s ack wait, and never redelivered.
    for _ in 0..3 {
        let other = within(bus.pull_task("p", ms(600))).await.unwrap();
        assert!(
            other.is_none(),
            "redelivered despite in_progress: {other:?}"
        );
        within(d.in_progress()).await.unwrap();
    }
    within(d.ack()).await.unwrap();
    assert!(within(bus.pull_task("p", ACK_WAIT + ms(500)))
        .await
        .unwrap()
        .is_none());
}

/// ADR 38: the queue never gives a task up; the coordinator judges a delivery past
/// `max_deliver` by its count.
async fn a_task_is_delivered_past_max_deliver_until_acked(fx: Fixture) {
    let bus = &fx.bus;
    assert_eq!(bus.max_deliver(), MAX_DELIVER);
    within(bus.enqueue_task("p", b("doomed"))).await.unwrap();
    for attempt in 1..=MAX_DELIVER + 1 {
        let d = within(bus.pull_task("p", ACK_WAIT + ms(4000)))
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("delivery {attempt} never came"));
        assert_eq!((d.attempt, d.payload.clone()), (attempt, b("doomed")));
        if attempt == MAX_DELIVER + 1 {
            within(d.ack()).await.unwrap();
        }
        // Otherwise dropped without an ack.
    }
    assert!(within(bus.pull_task("p", ACK_WAIT + ms(500)))
        .await
        .unwrap()
        .is_none());
}

async fn tasks_are_shared_by_concurrent_pullers(fx: Fixture) {
    let bus = fx.bus.clone();
    const N: usize = 40;
    for i in 0..N {
        within(bus.enqueue_task("p", Bytes::from(i.to_string())))
            .await
            .unwrap();
    }
    let pull_all = |bus: Arc<dyn Bus>| async move {
        let mut got = Vec::new();
        while let Some(d) = within(bus.pull_task("p", ms(300))).await.unwrap() {
            within(d.ack()).await.unwrap();
            got.push(String::from_utf8(d.payload.to_vec()).unwrap());
        }
        got
    };
    let (a, c) = tokio::join!(
        tokio::spawn(pull_all(bus.clone())),
        tokio::spawn(pull_all(bus.clone()))
    );
    let mut all: Vec<String> = a.unwrap().into_iter().chain(c.unwrap()).collect();
    all.sort_by_key(|s| s.parse::<usize>().unwrap());
    let expected: Vec<String> = (0..N).map(|i| i.to_string()).collect();
    assert_eq!(all, expected, "each task exactly once");
    drop(fx);
}

async fn events_in_publish_order(fx: Fixture) {
    let bus = &fx.bus;
    const N: u32 = 600;
    for i in 0..N {
        within(bus.publish_event(Bytes::from(i.to_be_bytes().to_vec())))
            .await
            .unwrap();
    }
    let mut c = within(bus.events("coord")).await.unwrap();
    for i in 0..N {
        let d = within(c.next()).await.unwrap();
        assert_eq!(d.payload.as_ref(), i.to_be_bytes(), "event {i}");
        assert_eq!(d.attempt, 1);
        within(d.ack()).await.unwrap();
    }
}

async fn a_batch_of_events_arrives_whole_and_in_order(fx: Fixture) {
    let bus = &fx.bus;
    // Batches of one, of a few and of many, one after another: every event once, in the
    // order published.
    let mut next = 0u32;
    for size in [1u32, 3, 250, 2] {
        let batch: Vec<Bytes> = (next..next + size)
            .map(|i| Bytes::from(i.to_be_bytes().to_vec()))
            .collect();
        within(bus.publish_events(batch)).await.unwrap();
        next += size;
    }
    within(bus.publish_events(Vec::new())).await.unwrap();
    let mut c = within(bus.events("coord")).await.unwrap();
    for i in 0..next {
        let d = within(c.next()).await.unwrap();
        assert_eq!(d.payload.as_ref(), i.to_be_bytes(), "event {i}");
        within(d.ack()).await.unwrap();
    }
}

async fn unacked_events_return_to_the_next_consumer(fx: Fixture) {
    let bus = &fx.bus;
    for i in 0..5u8 {
        within(bus.publish_event(Bytes::from(vec![i])))
            .await
            .unwrap();
    }
    let mut c = within(bus.events("coord")).await.unwrap();
    let first = within(c.next()).await.unwrap();
    assert_eq!(first.payload[0], 0);
    within(first.ack()).await.unwrap();
    let second = within(c.next()).await.unwrap();
    assert_eq!(second.payload[0], 1);
    drop(second);
    drop(c);
    // The same durable name again (a restarted coordinator): 1..5 in order, 0 never again.
    let mut c2 = within(bus.events("coord")).await.unwrap();
    for i in 1..5u8 {
        let d = within(c2.next()).await.unwrap();
        assert_eq!(d.payload[0], i);
        if i == 1 {
            assert!(d.attempt >= 2, "redelivery counted: {}", d.attempt);
        }
        within(d.ack()).await.unwrap();
    }
    let more = tokio::time::timeout(ACK_WAIT + ms(500), c2.next()).await;
    assert!(more.is_err(), "all acked, yet got {more:?}");
}

async fn control_sent_before_watch_arrives_in_order(fx: Fixture) {
    let bus = &fx.bus;
    let run = RunId::new();
    let other = RunId::new();
    within(bus.send_control(run, b("first"))).await.unwrap();
    within(bus.send_control(other, b("not yours")))
        .await
        .unwrap();
    within(bus.send_control(run, b("second"))).await.unwrap();
    let mut rx = within(bus.watch_control(run)).await.unwrap();
    within(bus.send_control(run, b("third"))).await.unwrap();
    assert_eq!(within(rx.recv()).await.unwrap(), b("first"));
    assert_eq!(within(rx.recv()).await.unwrap(), b("second"));
    assert_eq!(within(rx.recv()).await.unwrap(), b("third"));
    let extra = tokio::time::timeout(ms(300), rx.recv()).await;
    assert!(extra.is_err(), "{extra:?}");
}

async fn blobs_put_get_missing_dedup(fx: Fixture) {
    let blobs = fx.bus.blobs();
    let small = Bytes::from(vec![7u8; 300]);
    // Larger than one object-store chunk: the other path on NATS.
    let large = Bytes::from((0..300_000u32).map(|i| (i % 251) as u8).collect::<Vec<_>>());
    let absent = BlobHash::of(b"never stored");
    let (hs, hl) = (BlobHash::of(&small), BlobHash::of(&large));
    assert_eq!(
        within(blobs.missing(&[hs, absent, hl])).await.unwrap(),
        vec![hs, absent, hl]
    );
    within(blobs.put(hs, small.clone())).await.unwrap();
    within(blobs.put(hl, large.clone())).await.unwrap();
    // Storing again is a no-op.
    within(blobs.put(hs, small.clone())).await.unwrap();
    within(blobs.put(hl, large.clone())).await.unwrap();
    assert_eq!(within(blobs.get(&hs)).await.unwrap(), Some(small.clone()));
    assert_eq!(within(blobs.get(&hl)).await.unwrap(), Some(large.clone()));
    assert_eq!(within(blobs.get(&absent)).await.unwrap(), None);
    assert_eq!(
        within(blobs.missing(&[absent, hl, hs])).await.unwrap(),
        vec![absent]
    );
    let fetched = within(forkfleet_shared::blob::fetch(blobs.as_ref(), &hl))
        .await
        .unwrap();
    assert_eq!(fetched.len(), large.len());
}

async fn request_reply_no_responders_and_timeout(fx: Fixture) {
    let bus = &fx.bus;
    let err = within(bus.request("nobody.home", b("?"), ms(500)))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, BusError::NoResponders(s) if s == "nobody.home"),
        "{err:?}"
    );

    let mut rx = within(bus.serve("echo.reverse")).await.unwrap();
    let service = tokio::spawn(async move {
        while let Some(req) = rx.recv().await {
            assert_eq!(req.subject, "echo.reverse");
            let mut out = req.payload.to_vec();
            out.reverse();
            req.respond(Bytes::from(out)).await.unwrap();
        }
    });
    let got = within(bus.request("echo.reverse", b("abc"), ms(5000)))
        .await
        .unwrap();
    assert_eq!(got, b("cba"));

    // A service that takes requests and never answers.
    let mut slow = within(bus.serve("slow")).await.unwrap();
    let hoard = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Some(req) = slow.recv().await {
            held.push(req);
        }
    });
    let started = Instant::now();
    let err = within(bus.request("slow", b("x"), ms(300)))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, BusError::Timeout { subject, ms: 300 } if subject == "slow"),
        "{err:?}"
    );
    assert!(started.elapsed() < ms(3000), "{:?}", started.elapsed());
    service.abort();
    hoard.abort();
}

fn worker(heartbeat_at_ms: u64, running: Vec<RunId>) -> WorkerInfo {
    WorkerInfo {
        worker_id: WorkerId::new(),
        pool: "default".into(),
        concurrency: 4,
        running,
        hostname: "host-a".into(),
        version: "test".into(),
        started_at_ms: heartbeat_at_ms,
        heartbeat_at_ms,
        models: Vec::new(),
        allowed_model_hosts: Vec::new(),
        commands: None,
    }
}

async fn workers_listed_and_stale_ones_hidden(fx: Fixture) {
    let bus = &fx.bus;
    assert!(within(bus.workers()).await.unwrap().is_empty());
    let mut live = worker(now_ms(), vec![]);
    let stale = worker(now_ms() - 120_000, vec![]);
    within(bus.put_worker(live.clone())).await.unwrap();
    within(bus.put_worker(stale)).await.unwrap();
    assert_eq!(within(bus.workers()).await.unwrap(), vec![live.clone()]);
    // A new heartbeat replaces the previous one.
    live.running = vec![RunId::new()];
    live.heartbeat_at_ms = now_ms();
    within(bus.put_worker(live.clone())).await.unwrap();
    assert_eq!(within(bus.workers()).await.unwrap(), vec![live]);
}

async fn a_removed_worker_is_listed_no_more(fx: Fixture) {
    let bus = &fx.bus;
    let (a, b) = (worker(now_ms(), vec![]), worker(now_ms(), vec![]));
    within(bus.put_worker(a.clone())).await.unwrap();
    within(bus.put_worker(b.clone())).await.unwrap();
    assert_eq!(within(bus.workers()).await.unwrap().len(), 2);
    within(bus.remove_worker(a.worker_id)).await.unwrap();
    assert_eq!(within(bus.workers()).await.unwrap(), vec![b.clone()]);
    // Removing one that is gone already is fine.
    within(bus.remove_worker(a.worker_id)).await.unwrap();
    // A worker that comes back is listed again.
    within(bus.put_worker(a.clone())).await.unwrap();
    assert_eq!(within(bus.workers()).await.unwrap().len(), 2);
}

async fn payloads_are_opaque_bytes(fx: Fixture) {
    let bus = &fx.bus;
    let noise: Vec<u8> = (0..65_536u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    let payloads = [
        Bytes::new(),
        Bytes::from_static(b"\x00garbage\xff\xfe"),
        Bytes::from_static(b"\r\nPUB x 1\r\n"),
        Bytes::from(noise),
    ];
    let run = RunId::new();
    let mut control = within(bus.watch_control(run)).await.unwrap();
    let mut echo = within(bus.serve("echo")).await.unwrap();
    let service = tokio::spawn(async move {
        while let Some(req) = echo.recv().await {
            let payload = req.payload.clone();
            req.respond(payload).await.unwrap();
        }
    });
    let mut events = within(bus.events("opaque")).await.unwrap();
    for p in &payloads {
        within(bus.enqueue_task("p", p.clone())).await.unwrap();
        let d = within(bus.pull_task("p", ms(5000))).await.unwrap().unwrap();
        assert_eq!(&d.payload, p);
        within(d.ack()).await.unwrap();

        within(bus.publish_event(p.clone())).await.unwrap();
        let e = within(events.next()).await.unwrap();
        assert_eq!(&e.payload, p);
        within(e.ack()).await.unwrap();

        within(bus.send_control(run, p.clone())).await.unwrap();
        assert_eq!(&within(control.recv()).await.unwrap(), p);

        let back = within(bus.request("echo", p.clone(), ms(5000)))
            .await
            .unwrap();
        assert_eq!(&back, p);
    }
    service.abort();
}

/// A subscriber with an OpenTelemetry layer (an SDK tracer, no exporter), as the binary has.
fn otel_subscriber() -> impl tracing::Subscriber + Send + Sync {
    use opentelemetry::trace::TracerProvider as _;
    use tracing_subscriber::layer::SubscriberExt;
    let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder().build();
    tracing_subscriber::registry()
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("bus-conformance")))
}

/// Send a task and an event in `span`; the traces their deliveries carry.
async fn trace_round_trip(
    bus: &dyn Bus,
    events: &mut dyn EventConsumer,
    span: tracing::Span,
) -> (Option<String>, Option<String>) {
    within(bus.enqueue_task("p", b("t")))
        .instrument(span.clone())
        .await
        .unwrap();
    within(bus.publish_event(b("e")))
        .instrument(span)
        .await
        .unwrap();
    let task = within(bus.pull_task("p", ms(5000))).await.unwrap().unwrap();
    within(task.ack()).await.unwrap();
    let event = within(events.next()).await.unwrap();
    within(event.ack()).await.unwrap();
    (task.trace, event.trace)
}

async fn tasks_carry_the_trace_context(fx: Fixture) {
    let bus = fx.bus.as_ref();
    let mut events = within(bus.events("traced")).await.unwrap();
    let events = events.as_mut();

    // No subscriber on this thread, then one without an OpenTelemetry layer: no context.
    let none = tracing::info_span!("none");
    assert_eq!(trace_round_trip(bus, events, none).await, (None, None));
    {
        let _plain = tracing::subscriber::set_default(tracing_subscriber::registry());
        let plain = tracing::info_span!("plain");
        assert_eq!(trace_round_trip(bus, events, plain).await, (None, None));
    }

    let _otel = tracing::subscriber::set_default(otel_subscriber());
    // Outside any span: none.
    let outside = tracing::Span::none();
    assert_eq!(trace_round_trip(bus, events, outside).await, (None, None));
    // Inside a span: that span's context on the task; events carry none (nothing reads
    // it, and every model turn publishes several).
    let span = tracing::info_span!("fork.create");
    let want = traceparent_of(&span).expect("the OpenTelemetry layer gives the span a context");
    let (task, event) = trace_round_trip(bus, events, span.clone()).await;
    assert_eq!(task.as_deref(), Some(want.as_str()));
    assert_eq!(event, None);

    // A redelivered task keeps it.
    within(bus.enqueue_task("p", b("again")))
        .instrument(span)
        .await
        .unwrap();
    let first = within(bus.pull_task("p", ms(5000))).await.unwrap().unwrap();
    within(first.nak(None)).await.unwrap();
    let second = within(bus.pull_task("p", ms(5000))).await.unwrap().unwrap();
    assert_eq!(second.attempt, 2);
    assert_eq!(second.trace.as_deref(), Some(want.as_str()));
    within(second.ack()).await.unwrap();
}

// ---- NATS only ----------------------------------------------------------------------------

/// A restart of nats-server (same port, same store) between publish and consume loses
/// nothing that was acknowledged, and every part of the bus keeps working afterwards, with
/// the consumers, watchers and services opened before the restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_restart_loses_nothing_and_the_bus_keeps_working() {
    survives_restart(false).await;
}

/// The same across a crash (SIGKILL): nothing whose publish was acknowledged is lost. A
/// consumer's acks may be lost with the server's unflushed state, so an acked task or event
/// may come again: at least once, as the bus promises.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_crash_loses_nothing_published_and_the_bus_keeps_working() {
    survives_restart(true).await;
}

async fn survives_restart(crash: bool) {
    let mut server = NatsServer::start();
    let bus = within(NatsBus::connect(nats_config(&server)))
        .await
        .unwrap();
    for i in 0..5 {
        within(bus.enqueue_task("p", Bytes::from(format!("t{i}"))))
            .await
            .unwrap();
    }
    for i in 0..10u8 {
        within(bus.publish_event(Bytes::from(vec![i])))
            .await
            .unwrap();
    }
    let t0 = within(bus.pull_task("p", ms(5000))).await.unwrap().unwrap();
    assert_eq!(t0.payload, b("t0"));
    within(t0.ack()).await.unwrap();
    let t1 = within(bus.pull_task("p", ms(5000))).await.unwrap().unwrap();
    assert_eq!(t1.payload, b("t1")); // in flight across the restart, never acked
    let mut events = within(bus.events("coord")).await.unwrap();
    for i in 0..5u8 {
        let e = within(events.next()).await.unwrap();
        assert_eq!(e.payload[0], i);
        within(e.ack()).await.unwrap();
    }
    let run = RunId::new();
    let mut control = within(bus.watch_control(run)).await.unwrap();
    within(bus.send_control(run, b("before"))).await.unwrap();
    assert_eq!(within(control.recv()).await.unwrap(), b("before"));
    let mut svc = within(bus.serve("ping")).await.unwrap();
    let service = tokio::spawn(async move {
        while let Some(req) = svc.recv().await {
            req.respond(b("pong")).await.unwrap();
        }
    });
    let blob = Bytes::from_static(b"kept across the restart");
    let hash = BlobHash::of(&blob);
    within(bus.blobs().put(hash, blob.clone())).await.unwrap();

    let old_pid = server.pid();
    if crash {
        server.crash_restart();
    } else {
        server.restart();
    }
    assert_ne!(server.pid(), old_pid);

    // Tasks: t1 (in flight, so redelivered) and t2..t4; t0 only after a crash.
    let mut tasks = Vec::new();
    while let Some(d) = within(bus.pull_task("p", ACK_WAIT + ms(3000)))
        .await
        .unwrap()
    {
        within(d.ack()).await.unwrap();
        tasks.push(String::from_utf8(d.payload.to_vec()).unwrap());
    }
    tasks.sort();
    if crash {
        tasks.retain(|t| t != "t0");
    }
    assert_eq!(tasks, ["t1", "t2", "t3", "t4"]);

    // Events: the consumer opened before the restart delivers 5..10 (perhaps twice, if a
    // prefetched one outlived its ack wait), and an acked one only after a crash.
    within(bus.publish_event(Bytes::from(vec![10u8])))
        .await
        .unwrap();
    let mut seen = std::collections::BTreeSet::new();
    while seen.len() < 6 {
        let e = within(events.next()).await.unwrap();
        let i = e.payload[0];
        assert!(crash || i >= 5, "event {i} was acked before the restart");
        within(e.ack()).await.unwrap();
        if i >= 5 {
            seen.insert(i);
        }
    }
    assert_eq!(
        seen.into_iter().collect::<Vec<_>>(),
        vec![5, 6, 7, 8, 9, 10]
    );

    // Control: the watcher opened before the restart gets what is sent after it.
    within(bus.send_control(run, b("after"))).await.unwrap();
    assert_eq!(within(control.recv()).await.unwrap(), b("after"));

    // Request/reply, blobs, workers, dead tasks.
    let pong = within(bus.request("ping", Bytes::new(), ms(5000)))
        .await
        .unwrap();
    assert_eq!(pong, b("pong"));
    assert_eq!(within(bus.blobs().get(&hash)).await.unwrap(), Some(blob));
    let w = worker(now_ms(), vec![run]);
    within(bus.put_worker(w.clone())).await.unwrap();
    assert_eq!(within(bus.workers()).await.unwrap(), vec![w]);
    service.abort();
}

/// Publishes made while the server is down (shorter than the request timeout) land once it
/// is back, exactly once, and reach the consumers and watchers opened before the outage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_publishes_during_an_outage_land_after_it() {
    let mut server = NatsServer::start();
    let bus = within(NatsBus::connect(nats_config(&server)))
        .await
        .unwrap();
    let run = RunId::new();
    let mut control = within(bus.watch_control(run)).await.unwrap();
    let mut events = within(bus.events("coord")).await.unwrap();
    within(bus.enqueue_task("p", b("warm"))).await.unwrap();
    let warm = within(bus.pull_task("p", ms(5000))).await.unwrap().unwrap();
    within(warm.ack()).await.unwrap();

    server.stop();
    let publisher = {
        let bus = bus.clone();
        tokio::spawn(async move {
            bus.enqueue_task("p", b("during")).await.unwrap();
            bus.publish_event(b("during")).await.unwrap();
            bus.send_control(run, b("during")).await.unwrap();
        })
    };
    server.resume();
    within(publisher).await.unwrap();

    let t = within(bus.pull_task("p", ms(5000))).await.unwrap().unwrap();
    assert_eq!(t.payload, b("during"));
    within(t.ack()).await.unwrap();
    let e = within(events.next()).await.unwrap();
    assert_eq!(e.payload, b("during"));
    within(e.ack()).await.unwrap();
    assert_eq!(within(control.recv()).await.unwrap(), b("during"));
    // Exactly once: no second copy of any of them.
    assert!(within(bus.pull_task("p", ACK_WAIT + ms(500)))
        .await
        .unwrap()
        .is_none());
    assert!(tokio::time::timeout(ms(500), events.next()).await.is_err());
    assert!(tokio::time::timeout(ms(300), control.recv()).await.is_err());
}

/// Blobs on both sides of the KV / object store boundary, and a dead task leaves nothing
/// behind in the queue.
#[tokio::test]
async fn nats_blob_size_boundary() {
    use forkfleet_bus::nats::SMALL_BLOB_MAX;
    let server = NatsServer::start();
    let bus = within(NatsBus::connect(nats_config(&server)))
        .await
        .unwrap();
    let blobs = bus.blobs();
    for len in [0, 1, SMALL_BLOB_MAX - 1, SMALL_BLOB_MAX, SMALL_BLOB_MAX + 1] {
        let bytes = Bytes::from(vec![(len % 251) as u8; len]);
        let hash = BlobHash::of(&bytes);
        within(blobs.put(hash, bytes.clone())).await.unwrap();
        assert_eq!(
            within(blobs.get(&hash)).await.unwrap(),
            Some(bytes),
            "{len}"
        );
        assert!(within(blobs.missing(&[hash])).await.unwrap().is_empty());
    }
}

/// A task whose deliveries reached `max_deliver` when the server stopped is delivered
/// again after the restart (a server-side limit dropped it then, with no advisory, and it
/// stayed in the work queue for ever: ADR 38).
#[tokio::test]
async fn nats_a_task_at_max_deliver_survives_a_server_restart() {
    let mut server = NatsServer::start();
    let mut config = nats_config(&server);
    config.max_deliver = 1;
    let bus = within(NatsBus::connect(config)).await.unwrap();
    within(bus.enqueue_task("p", b("held"))).await.unwrap();
    let d = within(bus.pull_task("p", ms(5000))).await.unwrap().unwrap();
    assert_eq!(d.attempt, 1);
    drop(d); // lost with its worker
    server.restart();
    // Pulled as a worker does, a few seconds at a time (bounded).
    let deadline = Instant::now() + ACK_WAIT + ms(30_000);
    let again = loop {
        if let Some(d) = within(bus.pull_task("p", ms(2000))).await.unwrap() {
            break d;
        }
        assert!(
            Instant::now() < deadline,
            "the task is never delivered again"
        );
    };
    assert_eq!((again.attempt, again.payload.clone()), (2, b("held")));
    within(again.ack()).await.unwrap();
}

/// With a short worker TTL, a heartbeat that is not renewed disappears.
#[tokio::test]
async fn nats_worker_heartbeat_expires() {
    let server = NatsServer::start();
    let mut config = nats_config(&server);
    config.worker_ttl = ms(1500);
    let bus = within(NatsBus::connect(config)).await.unwrap();
    let w = worker(now_ms(), vec![]);
    within(bus.put_worker(w.clone())).await.unwrap();
    assert_eq!(within(bus.workers()).await.unwrap(), vec![w]);
    // Polled (bounded): the entry goes once the TTL has passed.
    let deadline = Instant::now() + ms(10_000);
    loop {
        if within(bus.workers()).await.unwrap().is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "the heartbeat never expired");
        tokio::time::sleep(ms(100)).await; // poll interval, not synchronisation
    }
}

/// Two processes starting together against a fresh server both get a working bus.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_concurrent_start_is_idempotent() {
    let server = NatsServer::start();
    let (a, c) = tokio::join!(
        NatsBus::connect(nats_config(&server)),
        NatsBus::connect(nats_config(&server))
    );
    let (a, c) = (a.unwrap(), c.unwrap());
    let (ea, ec) = tokio::join!(a.events("coord"), c.events("coord"));
    ea.unwrap();
    ec.unwrap();
    within(a.enqueue_task("p", b("x"))).await.unwrap();
    let d = within(c.pull_task("p", ms(5000))).await.unwrap().unwrap();
    within(d.ack()).await.unwrap();
    // And a third, later, finds everything in place.
    within(NatsBus::connect(nats_config(&server)))
        .await
        .unwrap();
}

/// An unreachable server is a prompt error that names the URL.
#[tokio::test]
async fn nats_unreachable_server_is_a_clear_error() {
    let port = forkfleet_bus::testkit::free_port();
    let mut config = NatsConfig::new(format!("nats://127.0.0.1:{port}"));
    config.connect_timeout = ms(2000);
    let started = Instant::now();
    let err = within(NatsBus::connect(config)).await.unwrap_err();
    assert!(started.elapsed() < ms(5000), "{:?}", started.elapsed());
    let msg = err.to_string();
    assert!(msg.contains(&format!("127.0.0.1:{port}")), "{msg}");
}

/// Credentials reach the server; a wrong one is refused without being echoed.
#[tokio::test]
async fn nats_token_auth_is_passed_through() {
    use forkfleet_bus::nats::NatsAuth;
    let server = NatsServer::start_with(&["--auth", "s3cret-token"]);
    let mut config = nats_config(&server);
    config.auth = NatsAuth::Token("s3cret-token".into());
    let bus = within(NatsBus::connect(config.clone())).await.unwrap();
    within(bus.publish_event(b("authorised"))).await.unwrap();
    assert!(!format!("{bus:?}").contains("s3cret"));

    config.auth = NatsAuth::Token("wrong-token".into());
    let err = within(NatsBus::connect(config)).await.unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains(&server.url()), "{msg}");
    assert!(!msg.contains("wrong-token"), "{msg}");
}

/// Names that cannot be subjects are refused with the reason, not sent to the server.
#[tokio::test]
async fn nats_invalid_names_are_refused() {
    let server = NatsServer::start();
    let bus = within(NatsBus::connect(nats_config(&server)))
        .await
        .unwrap();
    let err = within(bus.enqueue_task("a.b", b("x"))).await.unwrap_err();
    assert!(err.to_string().contains("pool name `a.b`"), "{err}");
    let err = within(bus.request("a.*", b("x"), ms(100)))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("service subject"), "{err}");
    assert!(within(bus.events("a b")).await.is_err());
}

// ---- measurements ---------------------------------------------------------------------------

fn rate(n: usize, elapsed: Duration) -> String {
    format!(
        "{n} in {:.3} s = {:.0}/s",
        elapsed.as_secs_f64(),
        n as f64 / elapsed.as_secs_f64()
    )
}

/// Publish+ack rates over loopback, for the cluster benchmark's budget (1,000 branches x 10
/// writes: 10,000 blobs, ~45,000 events, 1,000 tasks in under 10 s on 2 cores).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "measurement; run with --ignored --nocapture"]
async fn measure_rates() {
    tokio::time::timeout(Duration::from_secs(300), measure())
        .await
        .expect("the measurement did not finish in 5 minutes");
}

async fn measure() {
    use futures::StreamExt;
    let server = NatsServer::start();
    let bus = Arc::new(
        within(NatsBus::connect(nats_config(&server)))
            .await
            .unwrap(),
    );
    let payload = Bytes::from(vec![b'e'; 300]);

    // Events, one publisher awaiting each ack.
    let n = 3_000;
    let t = Instant::now();
    for _ in 0..n {
        bus.publish_event(payload.clone()).await.unwrap();
    }
    println!(
        "events publish, sequential:        {}",
        rate(n, t.elapsed())
    );

    // Events, 64 publishes in flight (many branches publishing at once).
    let n = 42_000;
    let t = Instant::now();
    futures::stream::iter(0..n)
        .map(|_| {
            let bus = bus.clone();
            let p = payload.clone();
            async move { bus.publish_event(p).await }
        })
        .buffer_unordered(64)
        .for_each(|r| async move { r.unwrap() })
        .await;
    println!(
        "events publish, 64 in flight:      {}",
        rate(n, t.elapsed())
    );

    // Consume, one double ack at a time.
    let total = 45_000;
    let mut c = bus.events("measure").await.unwrap();
    let n = 5_000;
    let t = Instant::now();
    for _ in 0..n {
        let d = c.next().await.unwrap();
        d.ack().await.unwrap();
    }
    println!(
        "events consume + double ack, seq:  {}",
        rate(n, t.elapsed())
    );

    // Consume, acks in flight (64 at once).
    let n = total - 5_000;
    let t = Instant::now();
    let mut acks = futures::stream::FuturesUnordered::new();
    for _ in 0..n {
        let d = c.next().await.unwrap();
        acks.push(async move { d.ack().await });
        if acks.len() >= 64 {
            acks.next().await.unwrap().unwrap();
        }
    }
    while let Some(r) = acks.next().await {
        r.unwrap();
    }
    println!(
        "events consume + double ack, 64:   {}",
        rate(n, t.elapsed())
    );

    // Blobs of 300 bytes through the bus (KV path).
    let blobs = bus.blobs();
    let n = 2_000;
    let t = Instant::now();
    for i in 0..n {
        let bytes = Bytes::from(format!("{i:0>300}"));
        blobs.put(BlobHash::of(&bytes), bytes).await.unwrap();
    }
    println!(
        "blob put 300 B (KV), sequential:   {}",
        rate(n, t.elapsed())
    );
    let n = 10_000;
    let t = Instant::now();
    futures::stream::iter(0..n)
        .map(|i| {
            let blobs = blobs.clone();
            async move {
                let bytes = Bytes::from(format!("b{i:0>299}"));
                blobs.put(BlobHash::of(&bytes), bytes).await
            }
        })
        .buffer_unordered(64)
        .for_each(|r| async move { r.unwrap() })
        .await;
    println!(
        "blob put 300 B (KV), 64 in flight: {}",
        rate(n, t.elapsed())
    );

    // The same through the object store, for comparison.
    let client = async_nats::connect(server.url()).await.unwrap();
    let js = async_nats::jetstream::new(client);
    let store = js
        .create_object_store(async_nats::jetstream::object_store::Config {
            bucket: "measure_obj".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    let n = 2_000;
    let t = Instant::now();
    for i in 0..n {
        let bytes = format!("o{i:0>299}").into_bytes();
        let name = BlobHash::of(&bytes).to_hex();
        if store.info(&name).await.is_err() {
            store
                .put(name.as_str(), &mut bytes.as_slice())
                .await
                .unwrap();
        }
    }
    println!(
        "blob put 300 B (object store), seq: {}",
        rate(n, t.elapsed())
    );
    let n = 10_000;
    let t = Instant::now();
    futures::stream::iter(0..n)
        .map(|i| {
            let store = store.clone();
            async move {
                let bytes = format!("p{i:0>299}").into_bytes();
                let name = BlobHash::of(&bytes).to_hex();
                if store.info(&name).await.is_err() {
                    store
                        .put(name.as_str(), &mut bytes.as_slice())
                        .await
                        .map(|_| ())
                } else {
                    Ok(())
                }
            }
        })
        .buffer_unordered(64)
        .for_each(|r| async move { r.unwrap() })
        .await;
    println!(
        "blob put 300 B (object store), 64: {}",
        rate(n, t.elapsed())
    );

    // Tasks: 1,000 enqueued, pulled and acked.
    let n = 1_000;
    let t = Instant::now();
    for i in 0..n {
        bus.enqueue_task("bench", Bytes::from(format!("task {i}")))
            .await
            .unwrap();
    }
    println!(
        "task enqueue, sequential:          {}",
        rate(n, t.elapsed())
    );
    let t = Instant::now();
    for _ in 0..n {
        let d = bus.pull_task("bench", ms(1000)).await.unwrap().unwrap();
        d.ack().await.unwrap();
    }
    println!(
        "task pull + ack, sequential:       {}",
        rate(n, t.elapsed())
    );
}

/// Who asks is read from the subject a request names (ADR 17). A stream's push consumer
/// can deliver a stored message onto a service's subject (a worker may write the blob
/// buckets and create consumers on them); it arrives under the stream's subject and with a
/// `$JS.ACK` reply, and must not count as a request (it would be an admin's). A request
/// sent after it is the first the service sees.
#[tokio::test]
async fn nats_a_stream_delivery_onto_a_service_subject_is_not_a_request() {
    use async_nats::jetstream::{consumer::push, stream};
    let server = NatsServer::start();
    let bus = within(NatsBus::connect(nats_config(&server)))
        .await
        .unwrap();
    let mut svc = within(bus.serve("coordinator")).await.unwrap();
    let raw = within(async_nats::connect(server.url())).await.unwrap();
    let js = async_nats::jetstream::new(raw);
    let forged = within(js.create_stream(stream::Config {
        name: "FORGED".into(),
        subjects: vec!["forged.>".into()],
        ..Default::default()
    }))
    .await
    .unwrap();
    within(async { js.publish("forged.x", b("forged")).await.unwrap().await })
        .await
        .unwrap();
    let mut consumer = within(forged.create_consumer(push::Config {
        durable_name: Some("deliver-to-api".into()),
        deliver_subject: "ff.api.coordinator".into(),
        deliver_group: Some("ff".into()),
        ..Default::default()
    }))
    .await
    .unwrap();
    // Until the server has delivered the stored message onto the service's subject.
    let deadline = Instant::now() + Duration::from_secs(10);
    while within(consumer.info())
        .await
        .unwrap()
        .delivered
        .stream_sequence
        < 1
    {
        assert!(Instant::now() < deadline, "the consumer never delivered");
        tokio::time::sleep(ms(20)).await;
    }
    let bus = Arc::new(bus);
    let asker = bus.clone();
    let asked =
        tokio::spawn(async move { asker.request("coordinator", b("genuine"), ms(5000)).await });
    let first = within(svc.recv()).await.unwrap();
    assert_eq!(first.payload, b("genuine"), "the forged delivery was taken");
    assert_eq!(first.subject, "coordinator");
    first.respond(b("ok")).await.unwrap();
    assert_eq!(within(asked).await.unwrap().unwrap(), b("ok"));
}
