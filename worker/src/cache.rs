//! Per-worker caches shared by every branch the worker runs.
//!
//! - [`BlobCache`]: blob bytes, in front of the bus's blob store. Reads are verified
//!   against their hash once, when they enter the cache; a blob the cache holds is known to
//!   be in the remote store too (it came from there or was put there), so putting it again
//!   is skipped. Bounded by bytes, oldest entries evicted first.
//! - [`Memo`]: values decoded from a blob (a prefix's events, a manifest, a parsed
//!   script), decoded once per hash even when many branches of a fork ask at once.

use bytes::Bytes;
use forkfleet_shared::blob::{fetch, BlobError, BlobHash, BlobStore};
use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};
use tokio::sync::OnceCell;

/// Default byte budget of a worker's blob cache.
pub const DEFAULT_BLOB_CACHE_BYTES: u64 = 256 << 20;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding one of these locks cannot leave the maps inconsistent (every
    // critical section is a few map operations), so a poisoned lock is still usable.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Blob bytes in memory, in front of a remote [`BlobStore`].
pub struct BlobCache {
    remote: Arc<dyn BlobStore>,
    capacity: u64,
    inner: Mutex<CacheInner>,
}

#[derive(Default)]
struct CacheInner {
    map: HashMap<BlobHash, Bytes>,
    order: VecDeque<BlobHash>,
    bytes: u64,
}

impl BlobCache {
    pub fn new(remote: Arc<dyn BlobStore>, capacity_bytes: u64) -> Self {
        Self {
            remote,
            capacity: capacity_bytes,
            inner: Mutex::new(CacheInner::default()),
        }
    }

    /// The store behind the cache.
    pub fn remote(&self) -> &Arc<dyn BlobStore> {
        &self.remote
    }

    /// The blob if the cache holds it; never goes to the remote store.
    pub fn get_now(&self, hash: &BlobHash) -> Option<Bytes> {
        lock(&self.inner).map.get(hash).cloned()
    }

    /// The blob, from the cache or else fetched (and verified) from the remote store.
    pub async fn get(&self, hash: &BlobHash) -> Result<Bytes, BlobError> {
        if let Some(b) = self.get_now(hash) {
            return Ok(b);
        }
        let bytes = fetch(self.remote.as_ref(), hash).await?;
        self.insert(*hash, bytes.clone());
        Ok(bytes)
    }

    /// Store bytes whose hash the caller computed (e.g. in a `FileEntry`): in the remote
    /// store first, then in the cache. Bytes already cached are not put again.
    pub async fn put_known(&self, hash: BlobHash, bytes: Bytes) -> Result<(), BlobError> {
        if lock(&self.inner).map.contains_key(&hash) {
            return Ok(());
        }
        self.remote.put(hash, bytes.clone()).await?;
        self.insert(hash, bytes);
        Ok(())
    }

    /// Store bytes, returning their hash.
    pub async fn put(&self, bytes: Bytes) -> Result<BlobHash, BlobError> {
        let hash = BlobHash::of(&bytes);
        self.put_known(hash, bytes).await?;
        Ok(hash)
    }

    /// Blobs held.
    pub fn len(&self) -> usize {
        lock(&self.inner).map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        lock(&self.inner).bytes
    }

    fn insert(&self, hash: BlobHash, bytes: Bytes) {
        let size = bytes.len() as u64;
        if size > self.capacity {
            return;
        }
        let mut inner = lock(&self.inner);
        if inner.map.contains_key(&hash) {
            return;
        }
        while inner.bytes + size > self.capacity {
            let Some(old) = inner.order.pop_front() else {
                break;
            };
            if let Some(b) = inner.map.remove(&old) {
                inner.bytes -= b.len() as u64;
            }
        }
        inner.bytes += size;
        inner.order.push_back(hash);
        inner.map.insert(hash, bytes);
    }
}

#[async_trait::async_trait]
impl BlobStore for BlobCache {
    async fn put(&self, hash: BlobHash, bytes: Bytes) -> Result<(), BlobError> {
        self.put_known(hash, bytes).await
    }

    async fn get(&self, hash: &BlobHash) -> Result<Option<Bytes>, BlobError> {
        match BlobCache::get(self, hash).await {
            Ok(b) => Ok(Some(b)),
            Err(BlobError::Missing(_)) => Ok(None),
            Err(e) => Err(e),
        }
    }

    async fn missing(&self, hashes: &[BlobHash]) -> Result<Vec<BlobHash>, BlobError> {
        let unknown: Vec<BlobHash> = {
            let inner = lock(&self.inner);
            hashes
                .iter()
                .filter(|h| !inner.map.contains_key(h))
                .copied()
                .collect()
        };
        if unknown.is_empty() {
            return Ok(unknown);
        }
        self.remote.missing(&unknown).await
    }

    fn local_file(&self, hash: &BlobHash) -> Option<std::path::PathBuf> {
        self.remote.local_file(hash)
    }

    fn kept_trees_dir(&self) -> Option<std::path::PathBuf> {
        self.remote.kept_trees_dir()
    }
}

/// Values derived from blobs, computed once per hash and shared. Keeps at most `capacity`
/// values, forgetting the oldest first.
pub struct Memo<T> {
    capacity: usize,
    inner: Mutex<MemoInner<T>>,
}

struct MemoInner<T> {
    map: HashMap<BlobHash, Arc<OnceCell<Arc<T>>>>,
    order: VecDeque<BlobHash>,
}

impl<T: Send + Sync + 'static> Memo<T> {
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            inner: Mutex::new(MemoInner {
                map: HashMap::new(),
                order: VecDeque::new(),
            }),
        }
    }

    /// The value for `key`, computing it with `init` if nobody has. Concurrent callers for
    /// the same key wait for one computation; a failed one is not remembered.
    pub async fn get_or_try_init<E, F, Fut>(&self, key: BlobHash, init: F) -> Result<Arc<T>, E>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let cell = {
            let mut inner = lock(&self.inner);
            match inner.map.get(&key) {
                Some(c) => c.clone(),
                None => {
                    while inner.map.len() >= self.capacity {
                        let Some(old) = inner.order.pop_front() else {
                            break;
                        };
                        inner.map.remove(&old);
                    }
                    let c = Arc::new(OnceCell::new());
                    inner.map.insert(key, c.clone());
                    inner.order.push_back(key);
                    c
                }
            }
        };
        cell.get_or_try_init(|| async { init().await.map(Arc::new) })
            .await
            .cloned()
    }

    pub fn len(&self) -> usize {
        lock(&self.inner).map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use forkfleet_shared::blob::MemBlobStore;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[tokio::test]
    async fn cache_fetches_once_puts_once_and_evicts_by_bytes() {
        let remote = MemBlobStore::new();
        let a = remote.insert(Bytes::from_static(b"aaaa"));
        let cache = BlobCache::new(Arc::new(remote.clone()), 8);
        assert!(cache.get_now(&a).is_none());
        assert_eq!(cache.get(&a).await.unwrap(), Bytes::from_static(b"aaaa"));
        assert!(cache.get_now(&a).is_some());
        let b = cache.put(Bytes::from_static(b"bbbb")).await.unwrap();
        assert_eq!(remote.get_now(&b), Some(Bytes::from_static(b"bbbb")));
        assert_eq!(cache.bytes(), 8);
        // A third blob evicts the oldest.
        cache.put(Bytes::from_static(b"cccc")).await.unwrap();
        assert!(cache.get_now(&a).is_none());
        assert_eq!(cache.len(), 2);
        // Missing blobs are errors, not panics.
        let nope = BlobHash::of(b"nope");
        assert!(matches!(cache.get(&nope).await, Err(BlobError::Missing(_))));
    }

    #[tokio::test]
    async fn memo_computes_once_and_forgets_failures() {
        let memo: Memo<String> = Memo::new(2);
        let calls = AtomicUsize::new(0);
        let key = BlobHash::of(b"k");
        for _ in 0..3 {
            let v = memo
                .get_or_try_init(key, || async {
                    calls.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, String>("v".to_string())
                })
                .await
                .unwrap();
            assert_eq!(*v, "v");
        }
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        let other = BlobHash::of(b"o");
        let err = memo
            .get_or_try_init(other, || async { Err::<String, _>("bad".to_string()) })
            .await;
        assert!(err.is_err());
        let ok = memo
            .get_or_try_init(other, || async { Ok::<_, String>("good".to_string()) })
            .await
            .unwrap();
        assert_eq!(*ok, "good");
        memo.get_or_try_init(BlobHash::of(b"third"), || async {
            Ok::<_, String>("3".to_string())
        })
        .await
        .unwrap();
        assert_eq!(memo.len(), 2);
    }
}
