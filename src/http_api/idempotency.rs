//! Idempotency keys: a creating request (one whose operation is not idempotent) sent again
//! with the same `Idempotency-Key` by the same caller gets the first answer back, marked
//! `Idempotent-Replayed: true`, and nothing is done twice; the same key with another
//! request is refused. Answers are kept for 24 hours, at most 10,000, in this process.

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
/// When an answer was kept, the request it answered, and the answer.
type Entry = (Instant, [u8; 32], Kept);

#[derive(Default)]
pub struct Cache {
    kept: Mutex<HashMap<Key, Entry>>,
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

impl Cache {
    /// The answer kept for `key` of `who`, if any; a conflict when the key was used for
    /// another request.
    pub fn get(&self, who: &str, key: &str, fp: &[u8; 32]) -> Result<Option<Kept>, Problem> {
        let kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        match kept.get(&(who.to_string(), key.to_string())) {
            Some((at, _, _)) if at.elapsed() > KEEP => Ok(None),
            Some((_, f, k)) if f == fp => Ok(Some(k.clone())),
            Some(_) => Err(Problem::bad_input(format!(
                "Idempotency-Key `{key}` was used for another request; use a new key for a new request"
            ))),
            None => Ok(None),
        }
    }

    pub fn put(&self, who: &str, key: String, fp: [u8; 32], answer: Kept) {
        let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        if kept.len() >= MAX {
            kept.retain(|_, (at, _, _)| at.elapsed() <= KEEP);
            if kept.len() >= MAX {
                if let Some(oldest) = kept
                    .iter()
                    .min_by_key(|(_, (at, _, _))| *at)
                    .map(|(k, _)| k.clone())
                {
                    kept.remove(&oldest);
                }
            }
        }
        kept.insert((who.to_string(), key), (Instant::now(), fp, answer));
    }
}
