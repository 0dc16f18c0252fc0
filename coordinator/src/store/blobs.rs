//! Blobs in the run store (tree `blobs`): the coordinator's copy of workspace files,
//! scripts, history prefixes and manifests.

use crate::error::CoordinatorError;
use async_trait::async_trait;
use bytes::Bytes;
use forkfleet_shared::blob::{BlobError, BlobHash, BlobStore};

/// A [`BlobStore`] over a sled tree. `put` verifies the hash, so a blob stored under a
/// hash always has that content.
#[derive(Clone)]
pub struct SledBlobStore {
    tree: sled::Tree,
}

fn backend(e: sled::Error) -> BlobError {
    BlobError::Backend(e.to_string())
}

impl SledBlobStore {
    pub(crate) fn new(tree: sled::Tree) -> Self {
        Self { tree }
    }

    /// The bytes of a blob, synchronously.
    pub fn get_sync(&self, hash: &BlobHash) -> Result<Option<Bytes>, CoordinatorError> {
        Ok(self.tree.get(hash.0)?.map(|v| Bytes::copy_from_slice(&v)))
    }

    pub fn contains(&self, hash: &BlobHash) -> Result<bool, CoordinatorError> {
        Ok(self.tree.contains_key(hash.0)?)
    }

    /// Blobs stored.
    pub fn len(&self) -> usize {
        self.tree.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tree.is_empty()
    }

    /// Store bytes whose hash the caller computed (no re-hashing).
    pub(crate) fn put_trusted(&self, hash: BlobHash, bytes: &[u8]) -> Result<(), CoordinatorError> {
        if !self.tree.contains_key(hash.0)? {
            self.tree.insert(hash.0, bytes)?;
        }
        Ok(())
    }
}

#[async_trait]
impl BlobStore for SledBlobStore {
    async fn put(&self, hash: BlobHash, bytes: Bytes) -> Result<(), BlobError> {
        let actual = BlobHash::of(&bytes);
        if actual != hash {
            return Err(BlobError::Corrupt {
                expected: hash,
                actual,
            });
        }
        if !self.tree.contains_key(hash.0).map_err(backend)? {
            self.tree.insert(hash.0, &bytes[..]).map_err(backend)?;
        }
        Ok(())
    }

    async fn get(&self, hash: &BlobHash) -> Result<Option<Bytes>, BlobError> {
        Ok(self
            .tree
            .get(hash.0)
            .map_err(backend)?
            .map(|v| Bytes::copy_from_slice(&v)))
    }

    async fn missing(&self, hashes: &[BlobHash]) -> Result<Vec<BlobHash>, BlobError> {
        let mut out = Vec::new();
        for h in hashes {
            if !self.tree.contains_key(h.0).map_err(backend)? {
                out.push(*h);
            }
        }
        Ok(out)
    }
}
