//! A delivered task, settled exactly once, and this worker's lease on it.
//!
//! The node wraps each task it pulls in a [`TaskLease`] and shares it with the task's
//! agent. Whoever finishes with the task settles it: the agent acks it after publishing the
//! branch's terminal (or `paused`) status, the node naks it when the agent ended without
//! settling. Until then the node extends its ack deadline (confirmed progress acks) every
//! [`TaskLease::extend_every`]. Settling again is a no-op, so the task is answered on the
//! bus once.
//!
//! **The lease** (ADR 18): a delivery with a [`Delivery::lease`] (the queue's ack wait)
//! belongs to this worker until that long after the last extension the bus confirmed
//! (timed from when the extension was sent, on the monotonic clock, which keeps running
//! while the process is stopped). Past it the bus may have handed the task to another
//! worker, so the lease is *lost*: so it is too when the coordinator says another attempt
//! took the branch over ([`TaskLease::lose`]). A lost lease is never extended again and
//! counts as settled: the task is neither acked nor naked here (another worker holds it).
//! The agent checks the lease ([`TaskLease::check`]) before every model call and tool call.

use forkfleet_bus::{BusResult, Delivery};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Duration;
// tokio's `Instant` is the monotonic clock (std's) in a service, and a test's paused clock
// under `start_paused`, so a test advances the lease's time instead of sleeping.
use tokio::time::Instant;

/// The shortest time between two extensions.
const MIN_EXTEND_EVERY: Duration = Duration::from_millis(100);

/// One delivered task, settled exactly once by whoever finishes with it.
pub(crate) struct TaskLease {
    delivery: Delivery,
    settled: AtomicBool,
    /// When the last extension the bus confirmed was sent (at first: when the task was
    /// pulled).
    extended: Mutex<Instant>,
    /// Why the lease is lost, once it is.
    lost: Mutex<Option<String>>,
}

impl TaskLease {
    pub fn new(delivery: Delivery) -> Self {
        Self {
            delivery,
            settled: AtomicBool::new(false),
            extended: Mutex::new(Instant::now()),
            lost: Mutex::new(None),
        }
    }

    /// The bus's delivery count (1 on the first delivery).
    pub fn attempt(&self) -> u32 {
        self.delivery.attempt
    }

    /// The task's position in its queue, when the bus has one (see [`Delivery::seq`]).
    pub fn seq(&self) -> Option<u64> {
        self.delivery.seq
    }

    /// The W3C `traceparent` the task was enqueued with (the coordinator's `fork.create`
    /// span): the parent of the branch's `branch.run` span.
    pub fn trace(&self) -> Option<&str> {
        self.delivery.trace.as_deref()
    }

    pub fn is_settled(&self) -> bool {
        self.settled.load(Ordering::SeqCst)
    }

    /// How often to extend the lease: every `heartbeat`, or every third of the lease when
    /// that is shorter (so two extensions in a row may fail before it expires).
    pub fn extend_every(&self, heartbeat: Duration) -> Duration {
        let every = match self.delivery.lease {
            Some(lease) => heartbeat.min(lease / 3),
            None => heartbeat,
        };
        every.max(MIN_EXTEND_EVERY)
    }

    /// `Err(why)` once the lease is lost: it expired (no confirmed extension within the
    /// lease, less a margin for the time the delivery took to arrive), or [`TaskLease::lose`]
    /// was called.
    pub fn check(&self) -> Result<(), String> {
        if let Some(why) = self.lost_reason() {
            return Err(why);
        }
        let Some(lease) = self.delivery.lease else {
            return Ok(());
        };
        let since = self
            .extended
            .lock()
            .map(|at| at.elapsed())
            .unwrap_or(Duration::MAX);
        let margin = (lease / 10).min(Duration::from_secs(1));
        if since + margin >= lease {
            let why = format!(
                "lease expired: not extended for {} ms, the task's ack wait is {} ms (the process was paused or the bus unreachable)",
                since.as_millis(),
                lease.as_millis()
            );
            return Err(self.lose(why));
        }
        Ok(())
    }

    /// The lease is lost (`why`): the task is this worker's no more. Nothing settles it
    /// from now on. The first reason is kept, and returned.
    pub fn lose(&self, why: String) -> String {
        self.settled.store(true, Ordering::SeqCst);
        match self.lost.lock() {
            Ok(mut lost) => lost.get_or_insert(why).clone(),
            Err(_) => why,
        }
    }

    fn lost_reason(&self) -> Option<String> {
        self.lost.lock().ok().and_then(|l| l.clone())
    }

    /// The task is done: remove it from the queue.
    pub async fn ack(&self) -> BusResult<()> {
        if self.settled.swap(true, Ordering::SeqCst) {
            return Ok(());
        }
        self.delivery.ack().await
    }

    /// Hand the task back for another worker.
    pub async fn nak(&self, delay: Option<Duration>) -> BusResult<()> {
        if self.settled.swap(true, Ordering::SeqCst) {
            return Ok(());
        }
        self.delivery.nak(delay).await
    }

    /// Still working on it: extend the ack deadline, unless the lease is lost (an expired
    /// lease is not extended: the task may be another worker's already). `Err(why)` when
    /// it is lost or the extension failed; a failed extension does not renew the lease.
    pub async fn extend(&self) -> Result<(), String> {
        if self.is_settled() {
            return match self.lost_reason() {
                Some(why) => Err(why),
                None => Ok(()),
            };
        }
        self.check()?;
        let sent = Instant::now();
        match self.delivery.in_progress().await {
            Ok(()) => {
                if let Ok(mut at) = self.extended.lock() {
                    *at = sent;
                }
                Ok(())
            }
            Err(e) => Err(format!("could not extend the lease: {e}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use async_trait::async_trait;
    use bytes::Bytes;
    use forkfleet_bus::{Acker, BusError};
    use std::sync::atomic::AtomicU32;
    use std::sync::Arc;

    #[derive(Default)]
    struct Counts {
        acks: AtomicU32,
        naks: AtomicU32,
        progress: AtomicU32,
        refuse: AtomicBool,
    }

    struct TestAcker(Arc<Counts>);

    #[async_trait]
    impl Acker for TestAcker {
        async fn ack(&self) -> BusResult<()> {
            self.0.acks.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }
        async fn nak(&self, _delay: Option<Duration>) -> BusResult<()> {
            self.0.naks.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }
        async fn in_progress(&self) -> BusResult<()> {
            if self.0.refuse.load(Ordering::SeqCst) {
                return Err(BusError::Backend("refused".into()));
            }
            self.0.progress.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }
    }

    fn lease(lease: Option<Duration>) -> (TaskLease, Arc<Counts>) {
        let counts = Arc::new(Counts::default());
        let d = Delivery::new(Bytes::new(), 1, None, Box::new(TestAcker(counts.clone())))
            .with_position(lease, Some(7));
        (TaskLease::new(d), counts)
    }

    #[test]
    fn extensions_come_at_a_third_of_the_lease_at_most_every_heartbeat() {
        let hb = Duration::from_secs(10);
        assert_eq!(lease(None).0.extend_every(hb), hb);
        let (l, _) = lease(Some(Duration::from_secs(3)));
        assert_eq!(l.extend_every(hb), Duration::from_secs(1));
        let (l, _) = lease(Some(Duration::from_secs(60)));
        assert_eq!(l.extend_every(hb), hb);
    }

    #[tokio::test(start_paused = true)]
    async fn an_expired_lease_is_lost_never_extended_and_never_settled() {
        let (l, counts) = lease(Some(Duration::from_millis(200)));
        assert_eq!(l.check(), Ok(()));
        assert_eq!(l.extend().await, Ok(()));
        assert_eq!(counts.progress.load(Ordering::SeqCst), 1);
        // No extension for longer than the lease (as after a SIGSTOP); just inside the
        // lease (less its margin), still held.
        tokio::time::advance(Duration::from_millis(179)).await;
        assert_eq!(l.check(), Ok(()));
        tokio::time::advance(Duration::from_millis(71)).await;
        let why = l.check().unwrap_err();
        assert!(why.contains("lease expired"), "{why}");
        assert!(l.extend().await.is_err());
        assert_eq!(
            counts.progress.load(Ordering::SeqCst),
            1,
            "not extended once lost"
        );
        l.ack().await.unwrap();
        l.nak(None).await.unwrap();
        assert_eq!(counts.acks.load(Ordering::SeqCst), 0);
        assert_eq!(counts.naks.load(Ordering::SeqCst), 0);
        assert!(l.is_settled());
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_extension_does_not_renew_the_lease() {
        let (l, counts) = lease(Some(Duration::from_millis(300)));
        counts.refuse.store(true, Ordering::SeqCst);
        assert!(l.extend().await.unwrap_err().contains("could not extend"));
        // Still held until the lease runs out since the last confirmed extension.
        assert_eq!(l.check(), Ok(()));
        tokio::time::advance(Duration::from_millis(350)).await;
        assert!(l.check().is_err());
    }

    #[tokio::test]
    async fn a_superseded_lease_is_lost_with_the_first_reason() {
        let (l, counts) = lease(None);
        l.lose("superseded by attempt 3".into());
        l.lose("another reason".into());
        assert_eq!(l.check(), Err("superseded by attempt 3".to_string()));
        l.ack().await.unwrap();
        assert_eq!(counts.acks.load(Ordering::SeqCst), 0);
        // Without a lease duration (the local bus) the lease never expires by itself.
        let (l, _) = lease(None);
        assert_eq!(l.check(), Ok(()));
    }
}
