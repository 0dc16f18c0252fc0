//! Blobs on JetStream: small ones as KV values, large ones in the object store.

use super::*;

/// A failed put as an error: a full bucket says so and what to do (JetStream's own words,
/// "maximum bytes exceeded", name neither), anything else as it is.
fn full_or(bucket: &str, key: &str, e: impl fmt::Display) -> BlobError {
    let message = e.to_string();
    if message.contains("maximum bytes exceeded") {
        return BlobError::Backend(format!(
            "the blob store is full: bucket `{bucket}` reached its max_bytes (`[nats] blob_store_mb` when the coordinator created it); an operator frees room with `forkfleet gc`, or raises the bucket's limit"
        ));
    }
    blob_backend(format!("put of blob {key}"), message)
}

/// Blobs on JetStream: small ones as KV values, large ones in the object store.
pub(super) struct NatsBlobStore {
    pub(super) small: kv::Store,
    pub(super) large: object_store::ObjectStore,
}

impl NatsBlobStore {
    pub(super) async fn has(&self, key: &str) -> Result<bool, BlobError> {
        match self.small.entry(key).await {
            Ok(Some(entry)) if entry.operation == kv::Operation::Put => return Ok(true),
            Ok(_) => {}
            Err(e) => return Err(blob_backend(format!("lookup of blob {key}"), e)),
        }
        match self.large.info(key).await {
            Ok(info) => Ok(!info.deleted),
            Err(e) if e.kind() == object_store::InfoErrorKind::NotFound => Ok(false),
            Err(e) => Err(blob_backend(format!("lookup of blob {key}"), e)),
        }
    }
}

#[async_trait]
impl BlobStore for NatsBlobStore {
    async fn put(&self, hash: BlobHash, bytes: Bytes) -> Result<(), BlobError> {
        let key = subjects::blob_key(&hash);
        if bytes.len() <= SMALL_BLOB_MAX {
            return match self.small.create(&key, bytes).await {
                Ok(_) => Ok(()),
                Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => Ok(()),
                Err(e) => Err(full_or(subjects::SMALL_BLOB_BUCKET, &key, e)),
            };
        }
        match self.large.info(&key).await {
            Ok(info) if !info.deleted => return Ok(()),
            Ok(_) => {}
            Err(e) if e.kind() == object_store::InfoErrorKind::NotFound => {}
            Err(e) => return Err(blob_backend(format!("lookup of blob {key}"), e)),
        }
        let mut reader: &[u8] = &bytes;
        self.large
            .put(key.as_str(), &mut reader)
            .await
            .map(|_| ())
            .map_err(|e| full_or(subjects::BLOB_BUCKET, &key, e))
    }

    async fn get(&self, hash: &BlobHash) -> Result<Option<Bytes>, BlobError> {
        let key = subjects::blob_key(hash);
        match self.small.get(&key).await {
            Ok(Some(bytes)) => return Ok(Some(bytes)),
            Ok(None) => {}
            Err(e) => return Err(blob_backend(format!("get of blob {key}"), e)),
        }
        let mut object = match self.large.get(&key).await {
            Ok(object) => object,
            Err(e) if e.kind() == object_store::GetErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(blob_backend(format!("get of blob {key}"), e)),
        };
        let mut out = Vec::with_capacity(object.info().size);
        tokio::io::AsyncReadExt::read_to_end(&mut object, &mut out)
            .await
            .map_err(|e| blob_backend(format!("read of blob {key}"), e))?;
        Ok(Some(Bytes::from(out)))
    }

    async fn list(&self) -> Result<Vec<(BlobHash, Option<std::time::SystemTime>)>, BlobError> {
        use futures::TryStreamExt;
        let at = |secs: i64| {
            u64::try_from(secs)
                .ok()
                .map(|s| std::time::UNIX_EPOCH + std::time::Duration::from_secs(s))
        };
        let mut out = Vec::new();
        let keys: Vec<String> = self
            .small
            .keys()
            .await
            .map_err(|e| blob_backend("listing the small blobs".to_string(), e))?
            .try_collect()
            .await
            .map_err(|e| blob_backend("listing the small blobs".to_string(), e))?;
        for key in keys {
            let Some(hash) = BlobHash::from_hex(&key) else {
                continue;
            };
            match self.small.entry(&key).await {
                Ok(Some(e)) if e.operation == kv::Operation::Put => {
                    out.push((hash, at(e.created.unix_timestamp())))
                }
                Ok(_) => {}
                Err(e) => return Err(blob_backend(format!("lookup of blob {key}"), e)),
            }
        }
        let mut objects = self
            .large
            .list()
            .await
            .map_err(|e| blob_backend("listing the large blobs".to_string(), e))?;
        while let Some(info) = objects.next().await {
            let info = info.map_err(|e| blob_backend("listing the large blobs".to_string(), e))?;
            if info.deleted {
                continue;
            }
            if let Some(hash) = BlobHash::from_hex(&info.name) {
                out.push((hash, info.modified.and_then(|m| at(m.unix_timestamp()))));
            }
        }
        Ok(out)
    }

    async fn delete(&self, hash: &BlobHash) -> Result<(), BlobError> {
        let key = subjects::blob_key(hash);
        if let Err(e) = self.small.purge(&key).await {
            return Err(blob_backend(format!("delete of blob {key}"), e));
        }
        match self.large.delete(&key).await {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == object_store::DeleteErrorKind::NotFound => Ok(()),
            Err(e) => Err(blob_backend(format!("delete of blob {key}"), e)),
        }
    }

    async fn missing(&self, hashes: &[BlobHash]) -> Result<Vec<BlobHash>, BlobError> {
        let found: Vec<Result<bool, BlobError>> = futures::stream::iter(hashes.iter().copied())
            .map(|h| async move { self.has(&subjects::blob_key(&h)).await })
            .buffered(BLOB_LOOKUPS_IN_FLIGHT)
            .collect()
            .await;
        let mut out = Vec::new();
        for (hash, found) in hashes.iter().zip(found) {
            if !found? {
                out.push(*hash);
            }
        }
        Ok(out)
    }
}
