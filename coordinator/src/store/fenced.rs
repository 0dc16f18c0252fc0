//! The `fenced_usage` tree: the `usage` events of fenced task attempts, counted once each
//! (ADR 18). Key: run id ++ attempt (u32 big-endian) ++ seq (u64 big-endian); value: the
//! call's cost (rmp `f64`). The events themselves are not in the log.

use super::{decode, encode, RunStore};
use crate::error::CoordinatorError;
use forkfleet_shared::ids::RunId;

const TREE: &str = "fenced_usage";

fn key(run: RunId, attempt: u32, seq: u64) -> [u8; 28] {
    let mut k = [0u8; 28];
    k[..16].copy_from_slice(run.as_bytes());
    k[16..20].copy_from_slice(&attempt.to_be_bytes());
    k[20..].copy_from_slice(&seq.to_be_bytes());
    k
}

impl RunStore {
    /// Record the usage event `(run, attempt, seq)` of a fenced attempt costing `cost_usd`:
    /// true the first time, false when it was recorded before (a redelivery). Written, not
    /// flushed.
    pub(crate) fn put_fenced_usage(
        &self,
        run: RunId,
        attempt: u32,
        seq: u64,
        cost_usd: f64,
    ) -> Result<bool, CoordinatorError> {
        let tree = self.inner.db.open_tree(TREE)?;
        let value = encode("fenced usage", &cost_usd)?;
        let previous =
            tree.compare_and_swap(key(run, attempt, seq), None as Option<&[u8]>, Some(value))?;
        Ok(previous.is_ok())
    }

    /// The costs of `run`'s fenced attempts' calls, one per call.
    pub(crate) fn fenced_usage(&self, run: RunId) -> Result<Vec<f64>, CoordinatorError> {
        let tree = self.inner.db.open_tree(TREE)?;
        let mut out = Vec::new();
        for kv in tree.scan_prefix(run.as_bytes()) {
            let (_, v) = kv?;
            out.push(decode("fenced usage", &v)?);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fenced_call_is_recorded_once_per_run_attempt_and_seq() {
        let dir = tempfile::tempdir().unwrap();
        let store = RunStore::open(dir.path()).unwrap();
        let (run, other) = (RunId::new(), RunId::new());
        assert!(store.put_fenced_usage(run, 1, 7, 0.25).unwrap());
        assert!(
            !store.put_fenced_usage(run, 1, 7, 0.25).unwrap(),
            "a redelivery"
        );
        assert!(
            store.put_fenced_usage(run, 2, 7, 0.5).unwrap(),
            "another attempt"
        );
        assert!(store.put_fenced_usage(other, 1, 7, 1.0).unwrap());
        assert_eq!(store.fenced_usage(run).unwrap(), vec![0.25, 0.5]);
        assert_eq!(store.fenced_usage(other).unwrap(), vec![1.0]);
    }
}
