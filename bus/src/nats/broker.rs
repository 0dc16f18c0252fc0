//! A scoped client's blobs, through the coordinator's API (ADR 37, "Blobs belong to
//! tenants"): the client may not touch the blob buckets; the coordinator verifies each
//! upload against its hash, counts it against the identity's quota, and answers reads and
//! "do you have it" only for blobs the identity's accounts own.
//!
//! Every request and answer stays within one message (`MAX_BLOB_PART_BYTES` a part,
//! `MAX_BLOBS_PER_CALL` hashes a check), so none goes through the blob store itself. A
//! request nobody answers (the coordinator briefly away) is asked again within
//! `connect_timeout`, as the client's other calls are.

use super::{backend, Client};
use async_trait::async_trait;
use bytes::Bytes;
use forkfleet_shared::api::limits::{MAX_BLOBS_PER_CALL, MAX_BLOB_PART_BYTES, UPLOAD_RESTART};
use forkfleet_shared::api::{
    ApiRequest, ApiResponse, GetBlobPart, MissingBlobs, Operation, PutBlobPart,
};
use forkfleet_shared::blob::{BlobError, BlobHash, BlobStore};
use forkfleet_shared::subjects;
use forkfleet_shared::wire;
use std::time::Duration;
use tokio::time::Instant;

/// Blobs uploaded and read through the coordinator serving `subject`.
pub(super) struct BrokeredBlobs {
    client: Client,
    /// The full subject (`ff.api.client.<identity>`).
    subject: String,
    /// How long a request nobody answers is asked again.
    retry_for: Duration,
}

impl BrokeredBlobs {
    pub(super) fn new(client: Client, subject: String, retry_for: Duration) -> Self {
        let subject = subjects::api_subject(&subject).unwrap_or(subject);
        Self {
            client,
            subject,
            retry_for,
        }
    }

    /// Send `op`, asking again while no coordinator answers (within `retry_for`).
    async fn call<O: Operation>(&self, op: O) -> Result<O::Reply, BlobError> {
        let name = O::NAME;
        let timeout = op.timeout();
        let req: ApiRequest = op.into();
        let payload =
            wire::encode(&req).map_err(|e| BlobError::Backend(format!("`{name}`: {e}")))?;
        let mut deadline = Instant::now() + self.retry_for;
        let mut pause = Duration::from_millis(100);
        let mut timeouts = 0u32;
        let answer = loop {
            let request = async_nats::Request::new()
                .payload(payload.clone())
                .timeout(Some(timeout));
            match self
                .client
                .send_request(self.subject.clone(), request)
                .await
            {
                Ok(msg) => break msg.payload,
                // A request in flight when the coordinator went away: once more, with the
                // whole window again (a restart, a takeover).
                Err(e) if e.kind() == async_nats::RequestErrorKind::TimedOut && timeouts < 1 => {
                    timeouts += 1;
                    deadline = Instant::now() + self.retry_for;
                    tracing::debug!(api.op = name, error = %e, "bus.blobs: no answer; asking again");
                }
                // Every blob operation is the same asked twice: while no coordinator
                // answers (it restarts, another takes over), ask again.
                Err(e)
                    if matches!(
                        e.kind(),
                        async_nats::RequestErrorKind::NoResponders
                            | async_nats::RequestErrorKind::TimedOut
                    ) && Instant::now() + pause < deadline =>
                {
                    tracing::debug!(
                        api.op = name,
                        error = %e,
                        "bus.blobs: no coordinator answers yet; asking again"
                    );
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(2));
                }
                Err(e) => {
                    return Err(BlobError::Backend(
                        backend(format!("`{name}` through the coordinator"), e).to_string(),
                    ))
                }
            }
        };
        let reply = match wire::decode::<ApiResponse>(&answer) {
            Ok(ApiResponse::Ok(reply)) => *reply,
            Ok(ApiResponse::Err(e)) => return Err(BlobError::Backend(e.message)),
            Err(e) => {
                return Err(BlobError::Backend(format!(
                    "the coordinator's answer to `{name}` does not decode: {e}"
                )))
            }
        };
        O::from_reply(reply).map_err(|got| {
            BlobError::Backend(format!(
                "the coordinator answered `{got}` to a `{name}` request"
            ))
        })
    }
}

#[async_trait]
impl BlobStore for BrokeredBlobs {
    async fn put(&self, hash: BlobHash, bytes: Bytes) -> Result<(), BlobError> {
        let total = bytes.len() as u64;
        let mut offset = 0u64;
        let (mut restarts, mut waits, mut parts) = (0u32, 0u32, 0u64);
        // Enough parts for the blob several times over: the coordinator may send an upload
        // back (another of the same bytes began it again), never forever.
        let most = 4 * (total / MAX_BLOB_PART_BYTES as u64 + 1) + 200;
        loop {
            parts += 1;
            if parts > most {
                return Err(BlobError::Backend(format!(
                    "blob {} did not finish uploading within {most} parts",
                    hash.short()
                )));
            }
            let start = offset as usize;
            let end = (start + MAX_BLOB_PART_BYTES).min(bytes.len());
            let up = match self
                .call(PutBlobPart {
                    blob: hash,
                    offset,
                    total,
                    bytes: bytes.slice(start..end),
                })
                .await
            {
                Ok(up) => up,
                // The coordinator lost the parts (it restarted): from the start, a few times.
                Err(BlobError::Backend(m)) if m.contains(UPLOAD_RESTART) && restarts < 10 => {
                    restarts += 1;
                    offset = 0;
                    continue;
                }
                Err(e) => return Err(e),
            };
            if up.stored {
                return Ok(());
            }
            if up.received == total && offset == total {
                // Another upload of the same bytes is storing them: ask again shortly.
                waits += 1;
                if waits > 100 {
                    return Err(BlobError::Backend(format!(
                        "blob {} was received whole but not stored within 5 s",
                        hash.short()
                    )));
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
            if up.received > total {
                return Err(BlobError::Backend(format!(
                    "the coordinator took blob {} to byte {} of {total}",
                    hash.short(),
                    up.received
                )));
            }
            // Onward, or back to where the coordinator's copy stands.
            offset = up.received;
        }
    }

    async fn get(&self, hash: &BlobHash) -> Result<Option<Bytes>, BlobError> {
        let mut out: Vec<u8> = Vec::new();
        loop {
            let offset = out.len() as u64;
            let part = self
                .call(GetBlobPart {
                    blob: *hash,
                    start: offset,
                    len: MAX_BLOB_PART_BYTES as u64,
                })
                .await?;
            let Some(part) = part else {
                return Ok(None);
            };
            if offset == 0 && part.bytes.len() as u64 == part.total {
                return Ok(Some(part.bytes));
            }
            if part.bytes.is_empty() && offset < part.total {
                return Err(BlobError::Backend(format!(
                    "the coordinator sent no bytes of blob {} from byte {offset} of {}",
                    hash.short(),
                    part.total
                )));
            }
            out.extend_from_slice(&part.bytes);
            if out.len() as u64 >= part.total {
                return Ok(Some(Bytes::from(out)));
            }
        }
    }

    async fn missing(&self, hashes: &[BlobHash]) -> Result<Vec<BlobHash>, BlobError> {
        let mut out = Vec::new();
        for chunk in hashes.chunks(MAX_BLOBS_PER_CALL) {
            out.extend(
                self.call(MissingBlobs {
                    blobs: chunk.to_vec(),
                })
                .await?,
            );
        }
        Ok(out)
    }
}
