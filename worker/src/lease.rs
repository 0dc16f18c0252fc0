//! A delivered task, settled exactly once.
//!
//! The node wraps each task it pulls in a [`TaskLease`] and shares it with the task's
//! agent. Whoever finishes with the task settles it: the agent acks it after publishing the
//! branch's terminal (or `paused`) status, the node naks it when the agent ended without
//! settling. Until then the node's heartbeats extend its ack deadline. Settling again is a
//! no-op, so the task is answered on the bus once.

use forkfleet_bus::{BusResult, Delivery};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// One delivered task, settled exactly once by whoever finishes with it.
pub(crate) struct TaskLease {
    delivery: Delivery,
    settled: AtomicBool,
}

impl TaskLease {
    pub fn new(delivery: Delivery) -> Self {
        Self {
            delivery,
            settled: AtomicBool::new(false),
        }
    }

    pub fn attempt(&self) -> u32 {
        self.delivery.attempt
    }

    /// The W3C `traceparent` the task was enqueued with (the coordinator's `fork.create`
    /// span): the parent of the branch's `branch.run` span.
    pub fn trace(&self) -> Option<&str> {
        self.delivery.trace.as_deref()
    }

    pub fn is_settled(&self) -> bool {
        self.settled.load(Ordering::SeqCst)
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

    /// Still working on it: extend the ack deadline.
    pub async fn in_progress(&self) -> BusResult<()> {
        if self.is_settled() {
            return Ok(());
        }
        self.delivery.in_progress().await
    }
}
