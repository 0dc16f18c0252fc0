//! The time that decides behaviour: when a budget reservation expires, how old a worker's
//! heartbeat is. Code that decides by the time asks a [`Clock`] it was given, so a test
//! can hand it a [`ManualClock`] and move time on without sleeping.
//!
//! Code that waits for a time on a real timer also asks to be told when its clock is
//! stepped ([`Clock::on_step`]): a manual clock moved past the time wakes it at once.
//!
//! Timestamps that are only shown (`created_at_ms` and the like) read
//! [`crate::protocol::now_ms`] directly.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

/// What [`Clock::on_step`] is given: called after each step of the clock, and forgotten
/// once it returns false (whoever it wakes is gone).
pub type StepWaker = Box<dyn Fn() -> bool + Send + Sync>;

/// A source of wall-clock time in milliseconds since the Unix epoch.
pub trait Clock: Send + Sync + fmt::Debug {
    /// Milliseconds since the Unix epoch, now.
    fn now_ms(&self) -> u64;

    /// Call `wake` after each step of this clock (its time set or moved on at once, as a
    /// test's [`ManualClock`] is), until it returns false. Code that waits for a time on a
    /// real timer asks for this, so a step past that time is noticed without waiting for
    /// the timer. `wake` must not step the clock or ask for steps itself.
    ///
    /// The default never calls it: the system clock's time passes with the real timers'.
    fn on_step(&self, wake: StepWaker) {
        drop(wake);
    }
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

/// A clock that moves only when told to (for tests). Clones share one time, and each
/// move wakes those that asked ([`Clock::on_step`]).
#[derive(Clone, Default)]
pub struct ManualClock {
    now: Arc<AtomicU64>,
    wakers: Arc<Mutex<Vec<StepWaker>>>,
}

impl fmt::Debug for ManualClock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ManualClock")
            .field("now_ms", &self.now.load(Ordering::SeqCst))
            .finish_non_exhaustive()
    }
}

impl ManualClock {
    /// A clock that reads `now_ms` until it is moved.
    pub fn new(now_ms: u64) -> Self {
        Self {
            now: Arc::new(AtomicU64::new(now_ms)),
            wakers: Arc::default(),
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
                Ok(_) => {
                    self.wake();
                    return next;
                }
                Err(seen) => cur = seen,
            }
        }
    }

    /// Set the time to `now_ms` (it may go back: a wall clock can).
    pub fn set(&self, now_ms: u64) {
        self.now.store(now_ms, Ordering::SeqCst);
        self.wake();
    }

    /// Call every waker, after a step; forget those that say they are done.
    fn wake(&self) {
        let mut wakers = self.wakers.lock().unwrap_or_else(PoisonError::into_inner);
        wakers.retain(|wake| wake());
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

    fn on_step(&self, wake: StepWaker) {
        self.wakers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(wake);
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
    fn a_manual_clock_wakes_on_each_step_until_the_waker_is_done() {
        use std::sync::atomic::AtomicUsize;
        let clock = ManualClock::new(0);
        let woken = Arc::new(AtomicUsize::new(0));
        let w = woken.clone();
        // Through the trait object, as code that waits holds it; done after two wakes.
        clock
            .shared()
            .on_step(Box::new(move || w.fetch_add(1, Ordering::SeqCst) < 1));
        clock.advance(1);
        assert_eq!(woken.load(Ordering::SeqCst), 1);
        clock.set(100);
        assert_eq!(woken.load(Ordering::SeqCst), 2);
        // It said it was done: forgotten.
        clock.advance(1);
        assert_eq!(woken.load(Ordering::SeqCst), 2);
        // The system clock never steps: asking is harmless.
        system().on_step(Box::new(|| unreachable!("the system clock never steps")));
    }

    #[test]
    fn system_clock_reads_the_wall_clock() {
        // Some time after 2020-01-01, in milliseconds (not seconds).
        let read = system().now_ms();
        assert!(read > 1_577_836_800_000, "{read}");
    }
}
