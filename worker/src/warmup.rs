//! Prompt-cache warm-up: the first call of a fork's branches on this worker goes alone.
//!
//! Every branch of a fork starts by sending the same shared history. Sent at once, the
//! calls all miss the provider's prompt cache (an entry exists only once a call that wrote
//! it has been answered) and each pays to write it (Anthropic: 1.25x the input price). So
//! the first call of a branch whose provider caches prompts takes a turn per (cache
//! family, shared history) on this worker: the first to come makes its call at once and
//! holds the turn until it is answered (or fails, or is cancelled); the others wait for
//! that, at most [`MAX_WAIT`], then make theirs, which read what it wrote. Workers do not
//! coordinate: with W workers running a fork, at most W first calls write it.

use forkfleet_shared::blob::BlobHash;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;

/// The longest a first call waits for another's to be answered.
pub const MAX_WAIT: Duration = Duration::from_secs(120);

/// A cache family and its shared history.
type Key = (String, BlobHash);

/// The first calls in flight, by what they warm.
#[derive(Default)]
pub(crate) struct Warmups {
    in_flight: Mutex<HashMap<Key, watch::Receiver<()>>>,
}

/// What a first call does.
pub(crate) enum Turn {
    /// Go now; the turn is held until this is dropped.
    Go(Held),
    /// Wait for the call in flight (then go).
    Wait(watch::Receiver<()>),
}

/// A turn held: dropping it (the call answered, failed or cancelled) lets the others go.
pub(crate) struct Held {
    warmups: Arc<Warmups>,
    key: Key,
    /// Dropped with the turn: its receivers see the channel closed.
    _done: watch::Sender<()>,
}

impl Drop for Held {
    fn drop(&mut self) {
        if let Ok(mut m) = self.warmups.in_flight.lock() {
            m.remove(&self.key);
        }
    }
}

impl Warmups {
    /// The turn of a first call warming `family`'s shared history `prefix`.
    pub(crate) fn enter(self: &Arc<Self>, family: &str, prefix: BlobHash) -> Turn {
        let key = (family.to_string(), prefix);
        let Ok(mut m) = self.in_flight.lock() else {
            // A poisoned map: no warm-up, every call goes.
            let (done, _) = watch::channel(());
            return Turn::Go(Held {
                warmups: self.clone(),
                key,
                _done: done,
            });
        };
        if let Some(rx) = m.get(&key) {
            return Turn::Wait(rx.clone());
        }
        let (done, rx) = watch::channel(());
        m.insert(key.clone(), rx);
        Turn::Go(Held {
            warmups: self.clone(),
            key,
            _done: done,
        })
    }
}

/// Wait until the call holding the turn `rx` belongs to is over, at most [`MAX_WAIT`].
pub(crate) async fn wait(mut rx: watch::Receiver<()>) {
    // `changed` fails once the sender is dropped: the call is over.
    let _ = tokio::time::timeout(MAX_WAIT, async { while rx.changed().await.is_ok() {} }).await;
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_first_goes_and_the_others_wait_for_it() {
        let w = Arc::new(Warmups::default());
        let prefix = BlobHash::of(b"history");
        let Turn::Go(held) = w.enter("root", prefix) else {
            panic!("the first call goes")
        };
        let Turn::Wait(rx) = w.enter("root", prefix) else {
            panic!("the second waits")
        };
        // Another family, or another history, goes at once.
        assert!(matches!(w.enter("other", prefix), Turn::Go(_)));
        assert!(matches!(
            w.enter("root", BlobHash::of(b"other history")),
            Turn::Go(_)
        ));
        let waiting = tokio::spawn(wait(rx));
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished());
        drop(held);
        tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("the waiter goes once the first call is over")
            .unwrap();
        // Once it is over, the next first call goes at once.
        assert!(matches!(w.enter("root", prefix), Turn::Go(_)));
    }
}
