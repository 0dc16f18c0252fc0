//! The in-process bus: tokio primitives with the semantics of the NATS one, so the embedded
//! mode needs no server.
//!
//! Like the NATS bus, it carries the publisher's trace context: a task or an event keeps the
//! `traceparent` of the span it was enqueued or published in ([`forkfleet_shared::trace`]) beside its
//! payload, and every delivery of it hands that out as [`Delivery::trace`].

use super::{Acker, Bus, BusError, BusResult, Delivery, EventConsumer, Replier, Request};
use async_trait::async_trait;
use bytes::Bytes;
use forkfleet_shared::blob::BlobStore;
use forkfleet_shared::ids::{RunId, WorkerId};
use forkfleet_shared::protocol::{now_ms, WorkerInfo, WORKER_TTL_MS};
use forkfleet_shared::trace::current_traceparent;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot, Notify};
use tokio::time::Instant;

#[derive(Debug, Clone, Copy)]
pub struct LocalBusConfig {
    /// A pulled task not acked or extended within this time is redelivered.
    pub ack_wait: Duration,
    /// Deliveries of one task that may take its branch over ([`Bus::max_deliver`]): the
    /// queue delivers a task until it is acked, and counts.
    pub max_deliver: u32,
}

impl Default for LocalBusConfig {
    fn default() -> Self {
        Self {
            ack_wait: Duration::from_secs(30),
            max_deliver: 5,
        }
    }
}

#[derive(Clone)]
pub struct LocalBus {
    inner: Arc<Inner>,
}

struct Inner {
    config: LocalBusConfig,
    queues: Mutex<HashMap<String, Arc<MsgQueue>>>,
    events: Arc<MsgQueue>,
    control: Mutex<HashMap<RunId, ControlSlot>>,
    /// Servers per subject; a request goes to the next live one in turn (a queue group).
    services: Mutex<HashMap<String, ServerGroup>>,
    workers: Mutex<HashMap<WorkerId, WorkerInfo>>,
    blobs: Arc<dyn BlobStore>,
}

/// The servers of one subject and the index of the one that answered last.
type ServerGroup = (usize, Vec<mpsc::Sender<Request>>);

struct ControlSlot {
    tx: mpsc::UnboundedSender<Bytes>,
    rx: Option<mpsc::UnboundedReceiver<Bytes>>,
}

fn lock<T>(m: &Mutex<T>) -> BusResult<MutexGuard<'_, T>> {
    m.lock()
        .map_err(|_| BusError::Backend("a bus lock was poisoned".into()))
}

impl LocalBus {
    pub fn new(blobs: Arc<dyn BlobStore>) -> Self {
        Self::with_config(blobs, LocalBusConfig::default())
    }

    pub fn with_config(blobs: Arc<dyn BlobStore>, config: LocalBusConfig) -> Self {
        Self {
            inner: Arc::new(Inner {
                config,
                queues: Mutex::new(HashMap::new()),
                events: Arc::new(MsgQueue::new(config.ack_wait)),
                control: Mutex::new(HashMap::new()),
                services: Mutex::new(HashMap::new()),
                workers: Mutex::new(HashMap::new()),
                blobs,
            }),
        }
    }

    fn queue(&self, pool: &str) -> BusResult<Arc<MsgQueue>> {
        let mut queues = lock(&self.inner.queues)?;
        Ok(queues
            .entry(pool.to_string())
            .or_insert_with(|| Arc::new(MsgQueue::new(self.inner.config.ack_wait)))
            .clone())
    }

    /// Tasks of `pool` waiting or in flight.
    pub fn pending_tasks(&self, pool: &str) -> BusResult<usize> {
        let q = self.queue(pool)?;
        let st = lock(&q.state)?;
        Ok(st.ready.len() + st.inflight.len())
    }
}

/// A queue with at-least-once delivery: the task queues and the event stream.
struct MsgQueue {
    state: Mutex<QueueState>,
    notify: Notify,
    ack_wait: Duration,
}

#[derive(Default)]
struct QueueState {
    next_id: u64,
    ready: VecDeque<Msg>,
    inflight: BTreeMap<u64, (Msg, Instant)>,
}

struct Msg {
    id: u64,
    payload: Bytes,
    /// The publisher's `traceparent`.
    trace: Option<String>,
    deliveries: u32,
    not_before: Option<Instant>,
}

/// What `try_take` hands out for one delivery.
struct Taken {
    id: u64,
    payload: Bytes,
    trace: Option<String>,
    attempt: u32,
}

impl MsgQueue {
    fn new(ack_wait: Duration) -> Self {
        Self {
            state: Mutex::new(QueueState::default()),
            notify: Notify::new(),
            ack_wait,
        }
    }

    fn push(&self, payload: Bytes, trace: Option<String>) -> BusResult<()> {
        let mut st = lock(&self.state)?;
        let id = st.next_id;
        st.next_id += 1;
        st.ready.push_back(Msg {
            id,
            payload,
            trace,
            deliveries: 0,
            not_before: None,
        });
        drop(st);
        self.notify.notify_one();
        Ok(())
    }

    /// Take the next deliverable message, or say when to look again.
    fn try_take(&self, now: Instant) -> BusResult<Result<Taken, Option<Instant>>> {
        let mut st = lock(&self.state)?;
        // Redeliver what was not acked in time, oldest first.
        let expired: Vec<u64> = st
            .inflight
            .iter()
            .filter(|(_, (_, deadline))| *deadline <= now)
            .map(|(id, _)| *id)
            .collect();
        for id in expired.into_iter().rev() {
            if let Some((msg, _)) = st.inflight.remove(&id) {
                st.ready.push_front(msg);
            }
        }
        let mut wake: Option<Instant> = st.inflight.values().map(|(_, d)| *d).min();
        let mut i = 0;
        while i < st.ready.len() {
            let nb = st.ready[i].not_before;
            match nb {
                Some(t) if t > now => {
                    wake = Some(wake.map_or(t, |w| w.min(t)));
                    i += 1;
                }
                _ => {
                    let Some(mut msg) = st.ready.remove(i) else {
                        break;
                    };
                    msg.deliveries = msg.deliveries.saturating_add(1);
                    let out = Taken {
                        id: msg.id,
                        payload: msg.payload.clone(),
                        trace: msg.trace.clone(),
                        attempt: msg.deliveries,
                    };
                    msg.not_before = None;
                    st.inflight.insert(msg.id, (msg, now + self.ack_wait));
                    return Ok(Ok(out));
                }
            }
        }
        Ok(Err(wake))
    }

    async fn take(self: &Arc<Self>, until: Option<Instant>) -> BusResult<Option<Delivery>> {
        loop {
            let notified = self.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let now = Instant::now();
            match self.try_take(now)? {
                Ok(Taken {
                    id,
                    payload,
                    trace,
                    attempt,
                }) => {
                    let acker = Box::new(LocalAcker {
                        queue: self.clone(),
                        id,
                    });
                    return Ok(Some(
                        Delivery::new(payload, attempt, trace, acker).with_position(None, Some(id)),
                    ));
                }
                Err(wake) => {
                    if until.is_some_and(|u| u <= now) {
                        return Ok(None);
                    }
                    let next = match (wake, until) {
                        (Some(w), Some(u)) => Some(w.min(u)),
                        (w, u) => w.or(u),
                    };
                    match next {
                        Some(t) => {
                            tokio::select! {
                                _ = &mut notified => {}
                                _ = tokio::time::sleep_until(t) => {}
                            }
                        }
                        None => notified.await,
                    }
                }
            }
        }
    }

    fn settle(&self, id: u64, requeue: Option<Option<Duration>>, extend: bool) -> BusResult<()> {
        let mut st = lock(&self.state)?;
        if extend {
            if let Some((_, deadline)) = st.inflight.get_mut(&id) {
                *deadline = Instant::now() + self.ack_wait;
            }
            return Ok(());
        }
        let Some((mut msg, _)) = st.inflight.remove(&id) else {
            return Ok(());
        };
        if let Some(delay) = requeue {
            msg.not_before = delay.map(|d| Instant::now() + d);
            st.ready.push_front(msg);
            drop(st);
            self.notify.notify_one();
        }
        Ok(())
    }

    /// The payload of message `id` while it is queued or in flight.
    fn queued(&self, id: u64) -> BusResult<Option<Bytes>> {
        let st = lock(&self.state)?;
        if let Some((msg, _)) = st.inflight.get(&id) {
            return Ok(Some(msg.payload.clone()));
        }
        Ok(st
            .ready
            .iter()
            .find(|m| m.id == id)
            .map(|m| m.payload.clone()))
    }

    /// Hand every in-flight message back (a consumer went away).
    fn requeue_inflight(&self) {
        if let Ok(mut st) = self.state.lock() {
            let inflight = std::mem::take(&mut st.inflight);
            for (_, (msg, _)) in inflight.into_iter().rev() {
                st.ready.push_front(msg);
            }
        }
        self.notify.notify_one();
    }
}

struct LocalAcker {
    queue: Arc<MsgQueue>,
    id: u64,
}

#[async_trait]
impl Acker for LocalAcker {
    async fn ack(&self) -> BusResult<()> {
        self.queue.settle(self.id, None, false)
    }

    async fn nak(&self, delay: Option<Duration>) -> BusResult<()> {
        self.queue.settle(self.id, Some(delay), false)
    }

    async fn in_progress(&self) -> BusResult<()> {
        self.queue.settle(self.id, None, true)
    }
}

struct LocalEventConsumer {
    queue: Arc<MsgQueue>,
}

#[async_trait]
impl EventConsumer for LocalEventConsumer {
    async fn next(&mut self) -> BusResult<Delivery> {
        match self.queue.take(None).await? {
            Some(d) => Ok(d),
            None => Err(BusError::Closed),
        }
    }
}

impl Drop for LocalEventConsumer {
    fn drop(&mut self) {
        self.queue.requeue_inflight();
    }
}

struct LocalReplier(oneshot::Sender<Bytes>);

#[async_trait]
impl Replier for LocalReplier {
    async fn respond(self: Box<Self>, payload: Bytes) -> BusResult<()> {
        self.0.send(payload).map_err(|_| BusError::Closed)
    }
}

#[async_trait]
impl Bus for LocalBus {
    async fn enqueue_task(&self, pool: &str, payload: Bytes) -> BusResult<()> {
        self.queue(pool)?.push(payload, current_traceparent())
    }

    async fn pull_task(&self, pool: &str, wait: Duration) -> BusResult<Option<Delivery>> {
        let q = self.queue(pool)?;
        q.take(Some(Instant::now() + wait)).await
    }

    /// A task is taken from the queue only in the step that returns it.
    fn pull_cancel_safe(&self) -> bool {
        true
    }

    async fn queued_task(&self, pool: &str, seq: u64) -> BusResult<Option<Bytes>> {
        self.queue(pool)?.queued(seq)
    }

    async fn task_queue(&self, pool: &str) -> BusResult<crate::TaskQueue> {
        let q = self.queue(pool)?;
        let st = lock(&q.state)?;
        Ok(crate::TaskQueue {
            waiting: st.ready.len() as u64,
            in_flight: st.inflight.len() as u64,
        })
    }

    fn max_deliver(&self) -> u32 {
        self.inner.config.max_deliver
    }

    async fn publish_event(&self, payload: Bytes) -> BusResult<()> {
        self.inner.events.push(payload, None)
    }

    async fn events(&self, _durable: &str) -> BusResult<Box<dyn EventConsumer>> {
        Ok(Box::new(LocalEventConsumer {
            queue: self.inner.events.clone(),
        }))
    }

    async fn send_control(&self, run: RunId, payload: Bytes) -> BusResult<()> {
        let mut control = lock(&self.inner.control)?;
        let slot = control.entry(run).or_insert_with(|| {
            let (tx, rx) = mpsc::unbounded_channel();
            ControlSlot { tx, rx: Some(rx) }
        });
        if slot.tx.send(payload).is_err() {
            // The branch stopped watching: it has finished, so the command has no target.
            control.remove(&run);
        }
        Ok(())
    }

    async fn watch_control(&self, run: RunId) -> BusResult<mpsc::UnboundedReceiver<Bytes>> {
        let mut control = lock(&self.inner.control)?;
        let slot = control.entry(run).or_insert_with(|| {
            let (tx, rx) = mpsc::unbounded_channel();
            ControlSlot { tx, rx: Some(rx) }
        });
        match slot.rx.take() {
            Some(rx) => Ok(rx),
            None => {
                // A second watcher (a resumed branch) takes over with a fresh channel.
                let (tx, rx) = mpsc::unbounded_channel();
                slot.tx = tx;
                Ok(rx)
            }
        }
    }

    fn blobs(&self) -> Arc<dyn BlobStore> {
        self.inner.blobs.clone()
    }

    async fn put_worker(&self, info: WorkerInfo) -> BusResult<()> {
        lock(&self.inner.workers)?.insert(info.worker_id, info);
        Ok(())
    }

    async fn remove_worker(&self, worker: forkfleet_shared::ids::WorkerId) -> BusResult<()> {
        lock(&self.inner.workers)?.remove(&worker);
        Ok(())
    }

    async fn workers(&self) -> BusResult<Vec<WorkerInfo>> {
        let now = now_ms();
        let mut workers = lock(&self.inner.workers)?;
        workers.retain(|_, w| now.saturating_sub(w.heartbeat_at_ms) < WORKER_TTL_MS);
        let mut out: Vec<WorkerInfo> = workers.values().cloned().collect();
        out.sort_by_key(|w| w.worker_id);
        Ok(out)
    }

    async fn request(&self, subject: &str, payload: Bytes, timeout: Duration) -> BusResult<Bytes> {
        let service = {
            let mut services = lock(&self.inner.services)?;
            services.get_mut(subject).and_then(|(next, servers)| {
                servers.retain(|s| !s.is_closed());
                if servers.is_empty() {
                    return None;
                }
                *next = (*next + 1) % servers.len();
                Some(servers[*next].clone())
            })
        };
        let service = service.ok_or_else(|| BusError::NoResponders(subject.to_string()))?;
        let (tx, rx) = oneshot::channel();
        let req = Request::new(subject.to_string(), payload, Box::new(LocalReplier(tx)))
            .with_traceparent(current_traceparent());
        let timed_out = || BusError::Timeout {
            subject: subject.to_string(),
            ms: timeout.as_millis() as u64,
        };
        tokio::time::timeout(timeout, service.send(req))
            .await
            .map_err(|_| timed_out())?
            .map_err(|_| BusError::NoResponders(subject.to_string()))?;
        tokio::time::timeout(timeout, rx)
            .await
            .map_err(|_| timed_out())?
            .map_err(|_| BusError::NoResponders(subject.to_string()))
    }

    async fn serve(&self, subject: &str) -> BusResult<mpsc::Receiver<Request>> {
        let (tx, rx) = mpsc::channel(1024);
        lock(&self.inner.services)?
            .entry(subject.to_string())
            .or_default()
            .1
            .push(tx);
        Ok(rx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use forkfleet_shared::blob::MemBlobStore;

    fn bus(ack_wait_ms: u64, max_deliver: u32) -> LocalBus {
        LocalBus::with_config(
            Arc::new(MemBlobStore::new()),
            LocalBusConfig {
                ack_wait: Duration::from_millis(ack_wait_ms),
                max_deliver,
            },
        )
    }

    #[tokio::test(start_paused = true)]
    async fn task_redelivered_after_ack_wait_with_its_count_past_max_deliver() {
        let b = bus(1000, 2);
        b.enqueue_task("p", Bytes::from_static(b"t")).await.unwrap();
        let d1 = b
            .pull_task("p", Duration::from_secs(1))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(d1.attempt, 1);
        // Not acked: comes back after the ack wait.
        let d2 = b
            .pull_task("p", Duration::from_secs(5))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(d2.attempt, 2);
        assert_eq!(d2.payload, Bytes::from_static(b"t"));
        // Past max_deliver = 2 it is still delivered (the coordinator decides what a task
        // delivered too often means, ADR 38), with its count, until it is acked.
        let d3 = b
            .pull_task("p", Duration::from_secs(5))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(d3.attempt, 3);
        d3.ack().await.unwrap();
        assert!(b
            .pull_task("p", Duration::from_secs(5))
            .await
            .unwrap()
            .is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn ack_nak_and_in_progress() {
        let b = bus(1000, 5);
        b.enqueue_task("p", Bytes::from_static(b"a")).await.unwrap();
        let d = b
            .pull_task("p", Duration::from_secs(1))
            .await
            .unwrap()
            .unwrap();
        tokio::time::sleep(Duration::from_millis(800)).await;
        d.in_progress().await.unwrap();
        // Extended: not redelivered at the original deadline.
        assert!(b
            .pull_task("p", Duration::from_millis(500))
            .await
            .unwrap()
            .is_none());
        d.nak(Some(Duration::from_millis(300))).await.unwrap();
        let again = b
            .pull_task("p", Duration::from_secs(1))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(again.attempt, 2);
        again.ack().await.unwrap();
        assert!(b
            .pull_task("p", Duration::from_secs(5))
            .await
            .unwrap()
            .is_none());
        assert_eq!(b.pending_tasks("p").unwrap(), 0);
    }

    #[tokio::test]
    async fn unacked_events_return_to_a_new_consumer_in_order() {
        let b = bus(30_000, 5);
        for i in 0..3u8 {
            b.publish_event(Bytes::from(vec![i])).await.unwrap();
        }
        let mut c = b.events("coord").await.unwrap();
        let first = c.next().await.unwrap();
        first.ack().await.unwrap();
        let _second = c.next().await.unwrap();
        drop(c);
        let mut c2 = b.events("coord").await.unwrap();
        assert_eq!(c2.next().await.unwrap().payload[0], 1);
        assert_eq!(c2.next().await.unwrap().payload[0], 2);
    }

    #[tokio::test]
    async fn control_reaches_the_watcher() {
        let b = bus(1000, 5);
        let run = RunId::new();
        b.send_control(run, Bytes::from_static(b"early"))
            .await
            .unwrap();
        let mut rx = b.watch_control(run).await.unwrap();
        b.send_control(run, Bytes::from_static(b"late"))
            .await
            .unwrap();
        assert_eq!(rx.recv().await.unwrap(), Bytes::from_static(b"early"));
        assert_eq!(rx.recv().await.unwrap(), Bytes::from_static(b"late"));
    }

    #[tokio::test]
    async fn request_reply_and_errors() {
        let b = bus(1000, 5);
        let err = b
            .request("svc", Bytes::new(), Duration::from_millis(50))
            .await
            .unwrap_err();
        assert!(matches!(err, BusError::NoResponders(_)));
        let mut rx = b.serve("svc").await.unwrap();
        tokio::spawn(async move {
            while let Some(req) = rx.recv().await {
                let mut out = req.payload.to_vec();
                out.reverse();
                let _ = req.respond(Bytes::from(out)).await;
            }
        });
        let got = b
            .request("svc", Bytes::from_static(b"ab"), Duration::from_secs(5))
            .await
            .unwrap();
        assert_eq!(got, Bytes::from_static(b"ba"));
    }

    #[tokio::test]
    async fn several_servers_take_turns_and_a_gone_one_is_skipped() {
        let b = bus(1000, 5);
        let serve = |name: &'static str, mut rx: mpsc::Receiver<Request>| {
            tokio::spawn(async move {
                while let Some(req) = rx.recv().await {
                    let _ = req.respond(Bytes::from_static(name.as_bytes())).await;
                }
            })
        };
        let one = serve("one", b.serve("svc").await.unwrap());
        let _two = serve("two", b.serve("svc").await.unwrap());
        let ask = || b.request("svc", Bytes::new(), Duration::from_secs(5));
        let mut got = vec![ask().await.unwrap(), ask().await.unwrap()];
        got.sort();
        assert_eq!(
            got,
            vec![Bytes::from_static(b"one"), Bytes::from_static(b"two")]
        );
        // A server that stopped is dropped from the group; the other answers everything.
        one.abort();
        let _ = one.await;
        for _ in 0..3 {
            assert_eq!(ask().await.unwrap(), Bytes::from_static(b"two"));
        }
    }
}
