//! Idempotency keys: a creating request (one whose operation is not idempotent) sent again
//! with the same `Idempotency-Key` by the same caller gets the first answer back, marked
//! `Idempotent-Replayed: true`, and nothing is done twice, also when the copies arrive at
//! once (one runs, the others wait for its answer); the same key with another request is
//! refused. Answers are kept for 24 hours, at most 10,000, in this process.

use super::problem::Problem;
use super::Kept;
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

const KEEP: Duration = Duration::from_secs(24 * 3600);
const MAX: usize = 10_000;

/// A caller and its key.
type Key = (String, String);

/// A key's state: its request running (the answer comes on the channel), or answered.
enum Slot {
    Running([u8; 32], tokio::sync::watch::Receiver<Option<Kept>>),
    Done(Instant, [u8; 32], Kept),
}

#[derive(Default)]
pub struct Cache {
    kept: Mutex<HashMap<Key, Slot>>,
}

/// What identifies a request: its operation, path values, query and body.
pub fn fingerprint(op: &str, params: &[String], query: Option<&str>, body: &[u8]) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(op.as_bytes());
    for p in params {
        h.update([0]);
        h.update(p.as_bytes());
    }
    h.update([1]);
    h.update(query.unwrap_or_default().as_bytes());
    h.update([2]);
    h.update(body);
    h.finalize().into()
}

/// A request with a key that runs: [`Running::finish`] keeps its answer for the key and
/// hands it to the requests that waited; dropped unfinished, the key is free again and
/// they are told to send theirs again.
pub struct Running<'a> {
    cache: &'a Cache,
    key: Key,
    fp: [u8; 32],
    answer: tokio::sync::watch::Sender<Option<Kept>>,
    finished: bool,
}

impl Running<'_> {
    pub fn finish(mut self, answer: Kept) {
        self.finished = true;
        let mut kept = self.cache.lock();
        kept.insert(
            self.key.clone(),
            Slot::Done(Instant::now(), self.fp, answer.clone()),
        );
        drop(kept);
        self.answer.send_replace(Some(answer));
    }
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        if !self.finished {
            let mut kept = self.cache.lock();
            if matches!(kept.get(&self.key), Some(Slot::Running(..))) {
                kept.remove(&self.key);
            }
        }
    }
}

impl Cache {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Key, Slot>> {
        self.kept.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Start the request `fp` with `key` of `who`, or get the answer it already had. One
    /// request runs per key at a time: a duplicate sent while the first runs waits for its
    /// answer (and replays it), so a key is acted on once however many times it is sent at
    /// once. A key used for another request is a conflict.
    pub async fn begin<'a>(
        &'a self,
        who: &str,
        key: &str,
        fp: &[u8; 32],
    ) -> Result<Result<Kept, Running<'a>>, Problem> {
        let id = (who.to_string(), key.to_string());
        let waiting = {
            let mut kept = self.lock();
            match kept.get(&id) {
                Some(Slot::Done(at, f, k)) if at.elapsed() <= KEEP => {
                    if f == fp {
                        return Ok(Ok(k.clone()));
                    }
                    return Err(reused(key));
                }
                Some(Slot::Running(f, rx)) => {
                    if f != fp {
                        return Err(reused(key));
                    }
                    rx.clone()
                }
                _ => {
                    if kept.len() >= MAX {
                        evict(&mut kept);
                    }
                    let (tx, rx) = tokio::sync::watch::channel(None);
                    kept.insert(id.clone(), Slot::Running(*fp, rx));
                    return Ok(Err(Running {
                        cache: self,
                        key: id,
                        fp: *fp,
                        answer: tx,
                        finished: false,
                    }));
                }
            }
        };
        let mut rx = waiting;
        let answer = match rx.wait_for(Option::is_some).await {
            Ok(answer) => answer.clone(),
            Err(_) => None,
        };
        answer.map(Ok).ok_or_else(|| {
            Problem::conflict(format!(
                "a request with Idempotency-Key `{key}` was running and did not finish: send it again"
            ))
        })
    }
}

fn reused(key: &str) -> Problem {
    Problem::bad_input(format!(
        "Idempotency-Key `{key}` was used for another request; use a new key for a new request"
    ))
}

/// Make room: answers past their time first, then the oldest (a running request's slot
/// is never taken).
fn evict(kept: &mut HashMap<Key, Slot>) {
    kept.retain(|_, s| match s {
        Slot::Done(at, ..) => at.elapsed() <= KEEP,
        Slot::Running(..) => true,
    });
    if kept.len() >= MAX {
        let oldest = kept
            .iter()
            .filter_map(|(k, s)| match s {
                Slot::Done(at, ..) => Some((k, *at)),
                Slot::Running(..) => None,
            })
            .min_by_key(|(_, at)| *at)
            .map(|(k, _)| k.clone());
        if let Some(oldest) = oldest {
            kept.remove(&oldest);
        }
    }
}
