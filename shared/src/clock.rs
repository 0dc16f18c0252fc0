//! The time that decides behaviour: when a budget reservation expires, how old a worker's
//! heartbeat is. Code that decides by the time asks a [`Clock`] it was given, so a test
//! can hand it a [`ManualClock`] and move time on without sleeping.
//!
//! Timestamps that are only shown (`created_at_ms` and the like) read
//! [`crate::protocol::now_ms`] directly.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// A source of wall-clock time in milliseconds since the Unix epoch.
pub trait Clock: Send + Sync + fmt::Debug {
    /// Milliseconds since the Unix epoch, now.
    fn now_ms(&self) -> u64;
}

/// The system's wall clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ms(&self) -> u64 {
        crate::protocol::now_ms()
    }
}

/// The system clock, shared: the default of everything that takes a clock.
pub fn system() -> Arc<dyn Clock> {
    Arc::new(SystemClock)
}

/// A clock that moves only when told to (for tests). Clones share one time.
#[derive(Debug, Clone, Default)]
pub struct ManualClock {
    now: Arc<AtomicU64>,
}

impl ManualClock {
    /// A clock that reads `now_ms` until it is moved.
    pub fn new(now_ms: u64) -> Self {
        Self {
            now: Arc::new(AtomicU64::new(now_ms)),
        }
    }

    /// Move the time on by `ms` (saturating at `u64::MAX`); the new time.
    pub fn advance(&self, ms: u64) -> u64 {
        let mut cur = self.now.load(Ordering::SeqCst);
        loop {
            let next = cur.saturating_add(ms);
            match self
                .now
                .compare_exchange(cur, next, Ordering::SeqCst, Ordering::SeqCst)
            {
                Ok(_) => return next,
                Err(seen) => cur = seen,
            }
        }
    }

    /// Set the time to `now_ms` (it may go back: a wall clock can).
    pub fn set(&self, now_ms: u64) {
        self.now.store(now_ms, Ordering::SeqCst);
    }

    /// This clock as the shared trait object code takes.
    pub fn shared(&self) -> Arc<dyn Clock> {
        Arc::new(self.clone())
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> u64 {
        self.now.load(Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manual_clock_moves_only_when_told_and_clones_share_it() {
        let clock = ManualClock::new(1_000);
        let shared = clock.shared();
        assert_eq!(shared.now_ms(), 1_000);
        assert_eq!(clock.advance(250), 1_250);
        assert_eq!(shared.now_ms(), 1_250);
        clock.set(10);
        assert_eq!(shared.now_ms(), 10);
        clock.set(u64::MAX - 1);
        assert_eq!(clock.advance(5), u64::MAX);
    }

    #[test]
    fn system_clock_reads_the_wall_clock() {
        // Some time after 2020-01-01, in milliseconds (not seconds).
        let read = system().now_ms();
        assert!(read > 1_577_836_800_000, "{read}");
    }
}
