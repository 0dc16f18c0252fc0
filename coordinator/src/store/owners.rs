//! Who owns which blobs (ADR 37): what a scoped client may read and what counts against
//! its quota.
//!
//! - `blob_owners`: key = account (u16 big-endian length, then its bytes) ++ hash; empty
//!   value. An account owns a blob its client identity uploaded, a file of a snapshot its
//!   forks started from, and what its forks' branches and merges wrote.
//! - `blob_uploads`: key = identity or account (same form) ++ hash; value = the blob's size
//!   (u64 big-endian): what each identity uploaded and each account's forks wrote, each
//!   blob counted once.
//! - `blob_usage`: key = identity or account; value = the sum of its sizes (u64
//!   big-endian).
//!
//! Each blob is charged its size plus [`BLOB_OVERHEAD_BYTES`]: what storing one costs
//! beside its bytes (a bucket entry, a run store record), so a flood of tiny blobs meets
//! the quota as soon as the bytes it really takes do.

use super::RunStore;
use crate::error::CoordinatorError;
use forkfleet_shared::blob::BlobHash;
use sled::transaction::{ConflictableTransactionError, TransactionError, Transactional};
use std::collections::{BTreeSet, HashSet};

/// What storing one blob costs beside its bytes (measured: about 460 bytes in the
/// small-blob bucket and the run store together).
pub(crate) const BLOB_OVERHEAD_BYTES: u64 = 512;

/// What a blob of `size` bytes counts against a quota.
pub(crate) fn charged(size: u64) -> u64 {
    size.saturating_add(BLOB_OVERHEAD_BYTES)
}

const OWNERS: &str = "blob_owners";
const UPLOADS: &str = "blob_uploads";
const USAGE: &str = "blob_usage";

fn prefix(name: &str) -> Vec<u8> {
    let bytes = name.as_bytes();
    let len = u16::try_from(bytes.len()).unwrap_or(u16::MAX);
    let mut k = Vec::with_capacity(2 + bytes.len() + 32);
    k.extend_from_slice(&len.to_be_bytes());
    k.extend_from_slice(&bytes[..usize::from(len)]);
    k
}

fn key(name: &str, hash: &BlobHash) -> Vec<u8> {
    let mut k = prefix(name);
    k.extend_from_slice(&hash.0);
    k
}

fn hash_of(key: &[u8]) -> Option<BlobHash> {
    let at = key.len().checked_sub(32)?;
    <[u8; 32]>::try_from(&key[at..]).ok().map(BlobHash)
}

fn u64_of(v: &[u8]) -> u64 {
    <[u8; 8]>::try_from(v).map(u64::from_be_bytes).unwrap_or(0)
}

/// An upload that would take an identity past its quota.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct OverQuota {
    pub used: u64,
}

impl RunStore {
    /// Record that `account` owns `hashes`. Written, not flushed.
    pub(crate) fn own_blobs(
        &self,
        account: &str,
        hashes: impl IntoIterator<Item = BlobHash>,
    ) -> Result<(), CoordinatorError> {
        let tree = self.inner.db.open_tree(OWNERS)?;
        let mut batch = sled::Batch::default();
        let mut any = false;
        for h in hashes {
            batch.insert(key(account, &h), &[] as &[u8]);
            any = true;
        }
        if any {
            tree.apply_batch(batch)?;
        }
        Ok(())
    }

    /// True when one of `accounts` owns `hash`.
    pub(crate) fn blob_owned(
        &self,
        accounts: &BTreeSet<String>,
        hash: &BlobHash,
    ) -> Result<bool, CoordinatorError> {
        let tree = self.inner.db.open_tree(OWNERS)?;
        for a in accounts {
            if tree.contains_key(key(a, hash))? {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// The bytes `identity`'s uploads hold.
    pub(crate) fn upload_usage(&self, identity: &str) -> Result<u64, CoordinatorError> {
        let usage = self.inner.db.open_tree(USAGE)?;
        Ok(usage.get(prefix(identity))?.map_or(0, |v| u64_of(&v)))
    }

    /// Count `identity`'s upload of `hash` (`size` bytes) against `quota`, once per blob,
    /// and make its account an owner. `Err(OverQuota)` when it would pass the quota: then
    /// nothing is written. Written, not flushed.
    pub(crate) fn record_upload(
        &self,
        identity: &str,
        hash: &BlobHash,
        size: u64,
        quota: u64,
    ) -> Result<Result<(), OverQuota>, CoordinatorError> {
        let size = charged(size);
        let uploads = self.inner.db.open_tree(UPLOADS)?;
        let usage = self.inner.db.open_tree(USAGE)?;
        let (upload_key, usage_key) = (key(identity, hash), prefix(identity));
        let done = (&uploads, &usage).transaction(|(uploads, usage)| {
            if uploads.get(&upload_key)?.is_some() {
                return Ok(());
            }
            let used = usage.get(&usage_key)?.map_or(0, |v| u64_of(&v));
            if used.saturating_add(size) > quota {
                return Err(ConflictableTransactionError::Abort(OverQuota { used }));
            }
            uploads.insert(upload_key.as_slice(), &size.to_be_bytes())?;
            usage.insert(usage_key.as_slice(), &(used + size).to_be_bytes())?;
            Ok(())
        });
        match done {
            Ok(()) => {}
            Err(TransactionError::Abort(over)) => return Ok(Err(over)),
            Err(TransactionError::Storage(e)) => return Err(e.into()),
        }
        self.own_blobs(identity, [*hash])?;
        Ok(Ok(()))
    }

    /// The quota [`RunStore::record_written`] holds accounts to.
    pub(crate) fn set_blob_quota(&self, bytes: u64) {
        self.inner
            .blob_quota
            .store(bytes, std::sync::atomic::Ordering::Relaxed);
    }

    /// Count the files a fork of `account` wrote (`(hash, size)`, each blob once) against
    /// the account's quota, as uploads are: what its branches write goes to the same
    /// buckets. `Some((used, quota))` once the account is past it. Written, not flushed.
    pub(crate) fn record_written(
        &self,
        account: &str,
        files: &[(BlobHash, u64)],
    ) -> Result<Option<(u64, u64)>, CoordinatorError> {
        let uploads = self.inner.db.open_tree(UPLOADS)?;
        let usage = self.inner.db.open_tree(USAGE)?;
        let usage_key = prefix(account);
        let mut added = 0u64;
        let mut batch = sled::Batch::default();
        for (hash, size) in files {
            let k = key(account, hash);
            if uploads.get(&k)?.is_none() {
                let size = charged(*size);
                batch.insert(k, &size.to_be_bytes());
                added += size;
            }
        }
        uploads.apply_batch(batch)?;
        let used = usage
            .update_and_fetch(&usage_key, |v| {
                let now = v.map_or(0, u64_of).saturating_add(added);
                Some(now.to_be_bytes().to_vec())
            })?
            .map_or(0, |v| u64_of(&v));
        let quota = self
            .inner
            .blob_quota
            .load(std::sync::atomic::Ordering::Relaxed);
        Ok((used > quota).then_some((used, quota)))
    }

    /// Forget every owner and upload of `gone` (blobs a collection deleted): their bytes
    /// no longer count against anyone's quota. Written, not flushed.
    pub(crate) fn forget_blobs(&self, gone: &HashSet<BlobHash>) -> Result<(), CoordinatorError> {
        if gone.is_empty() {
            return Ok(());
        }
        let owners = self.inner.db.open_tree(OWNERS)?;
        for kv in owners.iter() {
            let (k, _) = kv?;
            if hash_of(&k).is_some_and(|h| gone.contains(&h)) {
                owners.remove(k)?;
            }
        }
        let uploads = self.inner.db.open_tree(UPLOADS)?;
        let usage = self.inner.db.open_tree(USAGE)?;
        for kv in uploads.iter() {
            let (k, v) = kv?;
            if !hash_of(&k).is_some_and(|h| gone.contains(&h)) {
                continue;
            }
            let identity_key = &k[..k.len() - 32];
            let size = u64_of(&v);
            (&uploads, &usage)
                .transaction(|(uploads, usage)| {
                    if uploads.remove(&*k)?.is_none() {
                        return Ok(());
                    }
                    let used = usage.get(identity_key)?.map_or(0, |v| u64_of(&v));
                    usage.insert(identity_key, &used.saturating_sub(size).to_be_bytes())?;
                    Ok::<_, ConflictableTransactionError<()>>(())
                })
                .map_err(|e| super::transaction_error("forgetting an upload", e))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uploads_count_once_within_the_quota_and_go_with_their_blobs() {
        let dir = tempfile::tempdir().unwrap();
        let store = RunStore::open(dir.path()).unwrap();
        let (a, b, c) = (BlobHash::of(b"a"), BlobHash::of(b"b"), BlobHash::of(b"c"));
        // Each blob is charged its size and the cost of storing one.
        let (quota, sa, sb) = (1200, 300, 200);
        assert_eq!(store.record_upload("alice", &a, sa, quota).unwrap(), Ok(()));
        // The same blob again is not counted twice.
        assert_eq!(store.record_upload("alice", &a, sa, quota).unwrap(), Ok(()));
        assert_eq!(
            store.record_upload("alice", &b, sb, quota).unwrap(),
            Err(OverQuota { used: charged(sa) })
        );
        assert_eq!(store.upload_usage("alice").unwrap(), charged(sa));
        // Another identity's quota is its own.
        assert_eq!(store.record_upload("bob", &b, sb, quota).unwrap(), Ok(()));
        let alice: BTreeSet<String> = ["alice".to_string()].into();
        let bob: BTreeSet<String> = ["bob".to_string()].into();
        assert!(store.blob_owned(&alice, &a).unwrap());
        assert!(!store.blob_owned(&alice, &b).unwrap());
        assert!(store.blob_owned(&bob, &b).unwrap());
        // A name that is a prefix of another owns nothing of the other's.
        store.own_blobs("team", [c]).unwrap();
        let tea: BTreeSet<String> = ["tea".to_string()].into();
        assert!(!store.blob_owned(&tea, &c).unwrap());
        store.forget_blobs(&[a].into()).unwrap();
        assert_eq!(store.upload_usage("alice").unwrap(), 0);
        assert!(!store.blob_owned(&alice, &a).unwrap());
        assert_eq!(store.record_upload("alice", &b, sb, quota).unwrap(), Ok(()));
        // What a fork's branches write counts too, and says when it passes the quota.
        store.set_blob_quota(quota);
        assert_eq!(store.record_written("alice", &[(b, sb)]).unwrap(), None);
        let over = store.record_written("alice", &[(c, 600)]).unwrap();
        assert_eq!(over, Some((charged(sb) + charged(600), quota)));
    }
}
