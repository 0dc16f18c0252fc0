//! Content-addressed blobs: a SHA-256 hash names the bytes, and a store keeps them once.

use async_trait::async_trait;
use bytes::Bytes;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, RwLock};

/// SHA-256 of a blob's bytes. In MessagePack (the wire, the store) 32 bytes; in JSON 64
/// hex digits, as people and other languages expect (the HTTP API, `--json` output). Both
/// formats call themselves human-readable, so JSON is told apart by its serializer's type;
/// reading takes any of the three forms (hex, bytes, an array of 32 numbers).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlobHash(pub [u8; 32]);

impl Serialize for BlobHash {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if std::any::type_name::<S>().contains("serde_json") {
            s.serialize_str(&self.to_hex())
        } else {
            s.serialize_bytes(&self.0)
        }
    }
}

impl<'de> Deserialize<'de> for BlobHash {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = BlobHash;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a blob hash: 64 hex digits or 32 bytes of SHA-256")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<BlobHash, E> {
                BlobHash::from_hex(v).ok_or_else(|| {
                    E::custom(format!(
                        "`{v}` is not a blob hash (64 hex digits of SHA-256)"
                    ))
                })
            }
            fn visit_bytes<E: serde::de::Error>(self, v: &[u8]) -> Result<BlobHash, E> {
                <[u8; 32]>::try_from(v)
                    .map(BlobHash)
                    .map_err(|_| E::invalid_length(v.len(), &self))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<BlobHash, A::Error> {
                let mut out = [0u8; 32];
                for (i, b) in out.iter_mut().enumerate() {
                    *b = seq
                        .next_element()?
                        .ok_or_else(|| serde::de::Error::invalid_length(i, &self))?;
                }
                if seq.next_element::<u8>()?.is_some() {
                    return Err(serde::de::Error::invalid_length(33, &self));
                }
                Ok(BlobHash(out))
            }
        }
        d.deserialize_any(Visit)
    }
}

impl BlobHash {
    pub fn of(bytes: &[u8]) -> Self {
        Self(Sha256::digest(bytes).into())
    }

    /// The hash of bytes digested in parts (SHA-256, as [`BlobHash::of`]).
    pub fn from_digest(digest: [u8; 32]) -> Self {
        Self(digest)
    }

    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }

    /// The first 12 hex digits, as shown in binary placeholders and tables.
    pub fn short(&self) -> String {
        hex::encode(&self.0[..6])
    }

    pub fn from_hex(s: &str) -> Option<Self> {
        let v = hex::decode(s).ok()?;
        Some(Self(v.try_into().ok()?))
    }
}

impl fmt::Display for BlobHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl fmt::Debug for BlobHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sha256:{}", self.short())
    }
}

/// A failure of a blob store.
#[derive(Debug, Clone, thiserror::Error)]
pub enum BlobError {
    #[error("blob {0} is not in the store")]
    Missing(BlobHash),
    #[error("blob {expected} arrived with the wrong content (hash {actual})")]
    Corrupt {
        expected: BlobHash,
        actual: BlobHash,
    },
    #[error("blob store failed: {0}")]
    Backend(String),
}

/// Where blobs live. The local bus wraps one; the coordinator's is backed by its store.
#[async_trait]
pub trait BlobStore: Send + Sync + 'static {
    /// Store `bytes` under their hash. Storing the same bytes twice is a no-op.
    async fn put(&self, hash: BlobHash, bytes: Bytes) -> Result<(), BlobError>;
    async fn get(&self, hash: &BlobHash) -> Result<Option<Bytes>, BlobError>;
    /// Which of `hashes` the store lacks, in the order given.
    async fn missing(&self, hashes: &[BlobHash]) -> Result<Vec<BlobHash>, BlobError>;

    /// Every blob stored, with when it was stored when the store knows (a garbage
    /// collector's listing). A store that cannot list says so.
    async fn list(&self) -> Result<Vec<(BlobHash, Option<std::time::SystemTime>)>, BlobError> {
        Err(BlobError::Backend(
            "this blob store cannot list its blobs".into(),
        ))
    }

    /// Delete a blob (one already gone is not an error).
    async fn delete(&self, _hash: &BlobHash) -> Result<(), BlobError> {
        Err(BlobError::Backend(
            "this blob store cannot delete blobs".into(),
        ))
    }

    /// A file on this machine holding exactly the blob's bytes, when the store keeps the
    /// blob as one (the run store's larger blobs, read by an embedded worker): a caller may
    /// hard-link it where nothing will write through the link, and must never write it.
    /// `None` (the default): the bytes are only to be had through [`BlobStore::get`].
    fn local_file(&self, _hash: &BlobHash) -> Option<std::path::PathBuf> {
        None
    }

    /// A directory on the filesystem of [`BlobStore::local_file`]'s files where a worker
    /// may keep the trees it links from them, named by the hash of their manifest, from
    /// one process's run to the next (ADR 32); the store removes the one named by a blob it
    /// deletes. `None` (the default): nothing is kept.
    fn kept_trees_dir(&self) -> Option<std::path::PathBuf> {
        None
    }
}

/// Fetch a blob that must exist, verifying its hash.
pub async fn fetch(store: &dyn BlobStore, hash: &BlobHash) -> Result<Bytes, BlobError> {
    let bytes = store.get(hash).await?.ok_or(BlobError::Missing(*hash))?;
    let actual = BlobHash::of(&bytes);
    if actual != *hash {
        return Err(BlobError::Corrupt {
            expected: *hash,
            actual,
        });
    }
    Ok(bytes)
}

/// Blobs in memory: tests, and the worker's cache.
#[derive(Default, Clone)]
pub struct MemBlobStore {
    inner: Arc<RwLock<HashMap<BlobHash, Bytes>>>,
}

impl MemBlobStore {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn insert(&self, bytes: Bytes) -> BlobHash {
        let hash = BlobHash::of(&bytes);
        if let Ok(mut map) = self.inner.write() {
            map.entry(hash).or_insert(bytes);
        }
        hash
    }

    pub fn get_now(&self, hash: &BlobHash) -> Option<Bytes> {
        self.inner.read().ok()?.get(hash).cloned()
    }

    pub fn len(&self) -> usize {
        self.inner.read().map(|m| m.len()).unwrap_or(0)
    }

    /// Every blob held, by hash.
    pub fn hashes(&self) -> Vec<BlobHash> {
        self.inner
            .read()
            .map(|m| m.keys().copied().collect())
            .unwrap_or_default()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[async_trait]
impl BlobStore for MemBlobStore {
    async fn put(&self, hash: BlobHash, bytes: Bytes) -> Result<(), BlobError> {
        let mut map = self
            .inner
            .write()
            .map_err(|_| BlobError::Backend("poisoned lock".into()))?;
        map.entry(hash).or_insert(bytes);
        Ok(())
    }

    async fn get(&self, hash: &BlobHash) -> Result<Option<Bytes>, BlobError> {
        Ok(self.get_now(hash))
    }

    async fn missing(&self, hashes: &[BlobHash]) -> Result<Vec<BlobHash>, BlobError> {
        let map = self
            .inner
            .read()
            .map_err(|_| BlobError::Backend("poisoned lock".into()))?;
        Ok(hashes
            .iter()
            .filter(|h| !map.contains_key(h))
            .copied()
            .collect())
    }
}

/// True when the bytes look binary: a NUL byte in the first 8192 bytes.
pub fn is_binary(bytes: &[u8]) -> bool {
    bytes.iter().take(8192).any(|b| *b == 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hash_is_hex_in_json_and_bytes_on_the_wire() {
        let h = BlobHash::of(b"hello");
        let json = serde_json::to_value(h).unwrap();
        assert_eq!(json, serde_json::json!(h.to_hex()));
        assert_eq!(serde_json::from_value::<BlobHash>(json).unwrap(), h);
        let numbers = serde_json::to_value(h.0.to_vec()).unwrap();
        assert_eq!(serde_json::from_value::<BlobHash>(numbers).unwrap(), h);
        assert!(serde_json::from_value::<BlobHash>(serde_json::json!("abc")).is_err());
        let packed = rmp_serde::to_vec(&h).unwrap();
        assert_eq!(packed.len(), 2 + 32, "bin 8: a tag, a length, the bytes");
        assert_eq!(rmp_serde::from_slice::<BlobHash>(&packed).unwrap(), h);
    }

    #[test]
    fn hash_hex_round_trip() {
        let h = BlobHash::of(b"hello");
        assert_eq!(
            h.to_hex(),
            "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824"
        );
        assert_eq!(BlobHash::from_hex(&h.to_hex()), Some(h));
        assert_eq!(h.short(), "2cf24dba5fb0");
    }

    #[tokio::test]
    async fn mem_store_dedups_and_verifies() {
        let s = MemBlobStore::new();
        let h = s.insert(Bytes::from_static(b"x"));
        s.insert(Bytes::from_static(b"x"));
        assert_eq!(s.len(), 1);
        assert_eq!(fetch(&s, &h).await.unwrap(), Bytes::from_static(b"x"));
        let other = BlobHash::of(b"y");
        assert_eq!(s.missing(&[h, other]).await.unwrap(), vec![other]);
        s.put(other, Bytes::from_static(b"not y")).await.unwrap();
        assert!(matches!(
            fetch(&s, &other).await,
            Err(BlobError::Corrupt { .. })
        ));
    }

    #[test]
    fn binary_detection() {
        assert!(!is_binary(b"plain text\n"));
        assert!(is_binary(b"a\0b"));
        let mut late = vec![b'a'; 9000];
        late[8500] = 0;
        assert!(!is_binary(&late));
    }
}
