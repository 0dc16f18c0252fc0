//! Blobs belong to tenants (ADR 37). A scoped client has no
//! access to the bus's blob buckets: it uploads and reads blobs through the coordinator's
//! API (`missing_blobs`, `put_blob_part`, `get_blob_part`), which
//!
//! - hashes every upload once all its bytes arrived, so nothing is stored under a hash
//!   that is not its content's, and repairs a stored copy whose content is wrong (an
//!   earlier release let clients write the buckets directly);
//! - counts each identity's uploads against its quota (`blob_quota_bytes`), each blob once
//!   (and what its forks' branches write: `crate::fork` stops them past it); stages an
//!   upload in parts in a file of the data dir, never in memory;
//! - answers a read, or a "do you have it", only for a blob one of the caller's accounts
//!   owns (`crate::store` `blob_owners`): its own uploads, the files of its forks'
//!   snapshots, what its forks' branches and merges wrote. A blob another tenant stored
//!   is "missing" and uploaded again (proving the caller has its bytes); nothing says
//!   whether it exists.
//!
//! Operators and workers are not scoped: they see the whole store.

use crate::error::CoordinatorError;
use crate::handle::CoordinatorHandle;
use crate::store::charged;
use bytes::Bytes;
use forkfleet_bus::BusError;
use forkfleet_shared::api::limits::{MAX_BLOB_PART_BYTES, UPLOAD_RESTART};
use forkfleet_shared::api::{
    AgentFork, BlobPart, BlobUpload, Caller, CreateFork, GetBlobPart, PutBlobPart,
};
use forkfleet_shared::blob::BlobHash;
use forkfleet_shared::ids::RunId;
use forkfleet_shared::manifest::Manifest;
use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The largest blob one upload may carry (a workspace file, a stored request).
pub const MAX_BLOB_BYTES: u64 = 1 << 30;
/// An upload in parts that receives nothing for this long is dropped.
const STAGED_IDLE: Duration = Duration::from_secs(600);

/// An upload in parts, while its parts arrive: a file in the data dir's `uploads/`, so
/// uploads under way hold disk (bounded by each identity's quota), not memory.
struct Staged {
    file: std::fs::File,
    path: std::path::PathBuf,
    len: u64,
    total: u64,
    touched: Instant,
}

/// The directory of the data dir that holds uploads under way.
pub(crate) const UPLOADS_DIR: &str = "uploads";

/// What one part did to its upload.
enum Appended {
    /// Taken; more to come.
    Part(BlobUpload),
    /// The last bytes arrived.
    Last,
}

/// Add a part to upload `s` of `blob`: the bytes from where it stands on (parts of one blob
/// hold the same bytes at the same offsets, so a part sent twice, or by two uploads of the
/// same bytes at once, adds what is new only).
fn append(
    s: &mut Staged,
    blob: BlobHash,
    offset: u64,
    total: u64,
    bytes: &[u8],
) -> Result<Appended, CoordinatorError> {
    let have = s.len;
    let end = offset + bytes.len() as u64;
    if s.total != total {
        return Err(CoordinatorError::BadRequest(format!(
            "a part of blob {} says its total is {total}, its first said {}",
            blob.short(),
            s.total
        )));
    }
    if end <= have {
        return Ok(Appended::Part(BlobUpload {
            received: have,
            stored: false,
        }));
    }
    if offset > have {
        // Past what is here (another upload of the same bytes began this one again): the
        // answer names where the next part starts.
        return Ok(Appended::Part(BlobUpload {
            received: have,
            stored: false,
        }));
    }
    let fresh = &bytes[(have - offset) as usize..];
    std::io::Write::write_all(&mut s.file, fresh).map_err(|e| staging_error(&s.path, e))?;
    s.len = end;
    s.touched = Instant::now();
    if end < total {
        return Ok(Appended::Part(BlobUpload {
            received: end,
            stored: false,
        }));
    }
    Ok(Appended::Last)
}

fn staging_error(path: &std::path::Path, e: std::io::Error) -> CoordinatorError {
    CoordinatorError::Internal(format!("cannot stage an upload in {}: {e}", path.display()))
}

/// Uploads in parts under way.
#[derive(Default)]
pub(crate) struct Transfers {
    staged: Mutex<HashMap<(String, BlobHash), Staged>>,
    /// Numbers the staging files: an upload that begins as another of the same blob ends
    /// gets a file of its own (the other's is being read and removed).
    files: std::sync::atomic::AtomicU64,
}

/// At most `len` bytes of `bytes` from `offset` (and at most a part's).
fn part_of(bytes: &Bytes, offset: u64, len: u64) -> BlobPart {
    let total = bytes.len() as u64;
    let start = offset.min(total) as usize;
    let len = len.min(MAX_BLOB_PART_BYTES as u64) as usize;
    let end = start.saturating_add(len).min(bytes.len());
    BlobPart {
        total,
        bytes: bytes.slice(start..end),
    }
}

/// A size as people read it: bytes, KiB or MiB.
pub(crate) fn size_text(bytes: u64) -> String {
    match bytes {
        b if b < 1024 => format!("{b} bytes"),
        b if b < 1024 * 1024 => format!("{:.1} KiB", b as f64 / 1024.0),
        b => format!("{:.1} MiB", b as f64 / (1024.0 * 1024.0)),
    }
}

impl CoordinatorHandle {
    /// Which of `blobs` `caller` must upload ([`forkfleet_shared::api::MissingBlobs`]).
    pub(crate) async fn missing_blobs_for(
        &self,
        caller: &Caller,
        blobs: Vec<BlobHash>,
    ) -> Result<Vec<BlobHash>, CoordinatorError> {
        let absent: HashSet<BlobHash> = self
            .bus()
            .blobs()
            .missing(&blobs)
            .await
            .map_err(BusError::from)?
            .into_iter()
            .collect();
        let Some(accounts) = self.usable_accounts(caller) else {
            return Ok(blobs.into_iter().filter(|h| absent.contains(h)).collect());
        };
        self.blocking(move |s| {
            let mut out = Vec::new();
            for h in blobs {
                if absent.contains(&h) || !s.blob_owned(&accounts, &h)? {
                    out.push(h);
                }
            }
            Ok(out)
        })
        .await
    }

    /// True when `caller` may read `hash`: an operator or worker always, a scoped client
    /// when one of its accounts owns it.
    pub(crate) async fn may_read_blob(
        &self,
        caller: &Caller,
        hash: BlobHash,
    ) -> Result<bool, CoordinatorError> {
        let Some(accounts) = self.usable_accounts(caller) else {
            return Ok(true);
        };
        self.blocking(move |s| s.blob_owned(&accounts, &hash)).await
    }

    /// A blob `caller` may read ([`forkfleet_shared::api::GetBlob`]): `None` when the store
    /// lacks it or the caller may not read it (the same answer).
    pub(crate) async fn blob_for(
        &self,
        caller: &Caller,
        hash: &BlobHash,
    ) -> Result<Option<Bytes>, CoordinatorError> {
        if !self.may_read_blob(caller, *hash).await? {
            return Ok(None);
        }
        self.blob(hash).await
    }

    /// Part of a blob `caller` may read ([`GetBlobPart`]).
    pub(crate) async fn blob_part_for(
        &self,
        caller: &Caller,
        op: GetBlobPart,
    ) -> Result<Option<BlobPart>, CoordinatorError> {
        if !self.may_read_blob(caller, op.blob).await? {
            return Ok(None);
        }
        let local = self.store().blob_store();
        let mut path = local.local_file(&op.blob);
        if path.is_none() {
            // Small (held in the store's tree), or on the bus only: a large one is copied
            // into the run store, whose file is read a part at a time.
            let held = match self.store().blob(&op.blob)? {
                Some(b) => Some(b),
                None => self
                    .bus()
                    .blobs()
                    .get(&op.blob)
                    .await
                    .map_err(BusError::from)?
                    .filter(|b| BlobHash::of(b) == op.blob),
            };
            let Some(bytes) = held else {
                return Ok(None);
            };
            if bytes.len() <= MAX_BLOB_PART_BYTES {
                return Ok(Some(part_of(&bytes, op.start, op.len)));
            }
            local
                .put(op.blob, bytes.clone())
                .await
                .map_err(BusError::from)?;
            path = local.local_file(&op.blob);
            if path.is_none() {
                return Ok(Some(part_of(&bytes, op.start, op.len)));
            }
        }
        let Some(path) = path else {
            return Ok(None);
        };
        let read = async {
            use tokio::io::{AsyncReadExt, AsyncSeekExt};
            let mut file = tokio::fs::File::open(&path).await?;
            let total = file.metadata().await?.len();
            let start = op.start.min(total);
            let len = op.len.min(MAX_BLOB_PART_BYTES as u64).min(total - start);
            file.seek(std::io::SeekFrom::Start(start)).await?;
            let mut buf = vec![0u8; len as usize];
            file.read_exact(&mut buf).await?;
            Ok::<_, std::io::Error>(BlobPart {
                total,
                bytes: Bytes::from(buf),
            })
        };
        read.await.map(Some).map_err(|e| {
            CoordinatorError::Internal(format!("cannot read blob file {}: {e}", path.display()))
        })
    }

    /// Take one part of an upload ([`PutBlobPart`]); the last one stores the blob.
    pub(crate) async fn put_blob_part_for(
        &self,
        caller: &Caller,
        op: PutBlobPart,
    ) -> Result<BlobUpload, CoordinatorError> {
        let PutBlobPart {
            blob,
            offset,
            total,
            bytes,
        } = op;
        if total > MAX_BLOB_BYTES {
            return Err(CoordinatorError::BadRequest(format!(
                "blob {} is {} bytes, more than the {MAX_BLOB_BYTES} one blob may be",
                blob.short(),
                total
            )));
        }
        let end = offset.saturating_add(bytes.len() as u64);
        if end > total {
            return Err(CoordinatorError::BadRequest(format!(
                "a part of blob {} ends at byte {end}, past its total of {total}",
                blob.short()
            )));
        }
        if offset == 0 && end == total {
            self.store_upload(caller, blob, bytes).await?;
            return Ok(BlobUpload {
                received: total,
                stored: true,
            });
        }
        let key = (caller.name().to_string(), blob);
        let fresh = self
            .transfers()
            .staged
            .lock()
            .map(|m| !m.contains_key(&key))
            .unwrap_or(true);
        if offset == 0 && fresh {
            self.check_quota(caller, charged(total), true).await?;
        }
        let dir = self.store().dir().join(UPLOADS_DIR);
        let done = {
            let mut staged =
                self.transfers().staged.lock().map_err(|_| {
                    CoordinatorError::Internal("upload staging lock poisoned".into())
                })?;
            staged.retain(|_, s| {
                let keep = s.touched.elapsed() < STAGED_IDLE;
                if !keep {
                    let _ = std::fs::remove_file(&s.path);
                }
                keep
            });
            if offset == 0 && !staged.contains_key(&key) {
                std::fs::create_dir_all(&dir).map_err(|e| staging_error(&dir, e))?;
                let n = self
                    .transfers()
                    .files
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let path = dir.join(format!(
                    "{}-{}-{n}.part",
                    BlobHash::of(caller.name().as_bytes()).short(),
                    blob.to_hex()
                ));
                let file = std::fs::File::create(&path).map_err(|e| staging_error(&path, e))?;
                staged.insert(
                    key.clone(),
                    Staged {
                        file,
                        path,
                        len: 0,
                        total,
                        touched: Instant::now(),
                    },
                );
            }
            match staged.get_mut(&key) {
                None => None,
                Some(s) => Some(append(s, blob, offset, total, &bytes)?),
            }
        };
        let staged = match done {
            Some(Appended::Part(up)) => return Ok(up),
            Some(Appended::Last) => self
                .transfers()
                .staged
                .lock()
                .ok()
                .and_then(|mut m| m.remove(&key)),
            None => {
                // Finished meanwhile by another upload of the same bytes (two commands of
                // one identity uploading one workspace): stored, and the caller's.
                let stored = self
                    .bus()
                    .blobs()
                    .missing(&[blob])
                    .await
                    .map_err(BusError::from)?
                    .is_empty();
                if stored && self.may_read_blob(caller, blob).await? {
                    return Ok(BlobUpload {
                        received: total,
                        stored: true,
                    });
                }
                return Err(CoordinatorError::BadRequest(format!(
                    "no upload of blob {} is under way (or it was idle for {} s): {UPLOAD_RESTART}",
                    blob.short(),
                    STAGED_IDLE.as_secs()
                )));
            }
        };
        let Some(staged) = staged else {
            return Err(CoordinatorError::Internal(
                "a finished upload vanished".into(),
            ));
        };
        let path = staged.path.clone();
        drop(staged);
        let read = tokio::fs::read(&path).await;
        let _ = tokio::fs::remove_file(&path).await;
        let whole = Bytes::from(read.map_err(|e| staging_error(&path, e))?);
        self.store_upload(caller, blob, whole).await?;
        Ok(BlobUpload {
            received: total,
            stored: true,
        })
    }

    /// Refuse an upload of `size` bytes that would take a scoped `caller` past its quota
    /// (`staging`: count the uploads in parts under way too).
    async fn check_quota(
        &self,
        caller: &Caller,
        size: u64,
        staging: bool,
    ) -> Result<(), CoordinatorError> {
        let Some(identity) = caller.identity() else {
            return Ok(());
        };
        let quota = self.config().blob_quota_bytes;
        let id = identity.to_string();
        let used = self.blocking(move |s| s.upload_usage(&id)).await?;
        let staged: u64 = if staging {
            self.transfers()
                .staged
                .lock()
                .map(|m| {
                    m.iter()
                        // An abandoned upload stops counting once it is idle too long.
                        .filter(|((who, _), s)| {
                            who == identity && s.touched.elapsed() < STAGED_IDLE
                        })
                        .map(|(_, s)| s.total)
                        .sum()
                })
                .unwrap_or(0)
        } else {
            0
        };
        if used.saturating_add(staged).saturating_add(size) > quota {
            return Err(over_quota(
                identity,
                used.saturating_add(staged),
                size,
                quota,
            ));
        }
        Ok(())
    }

    /// Store an upload once its bytes hash to `blob`, repairing a stored copy with the
    /// wrong content, and count it for a scoped caller.
    async fn store_upload(
        &self,
        caller: &Caller,
        blob: BlobHash,
        bytes: Bytes,
    ) -> Result<(), CoordinatorError> {
        let actual = BlobHash::of(&bytes);
        if actual != blob {
            return Err(CoordinatorError::BadRequest(format!(
                "the bytes uploaded as blob {blob} hash to {actual}: a blob is stored under its own SHA-256"
            )));
        }
        let size = bytes.len() as u64;
        let identity = caller.identity().map(str::to_string);
        if identity.is_some() {
            self.check_quota(caller, charged(size), false).await?;
        }
        let store = self.bus().blobs();
        match store.get(&blob).await.map_err(BusError::from)? {
            Some(held) if BlobHash::of(&held) == blob => {}
            Some(held) => {
                tracing::warn!(blob = %blob.short(), bytes = held.len(), by = %caller, "blobs.repair: the stored copy had the wrong content; replaced by this upload");
                store.delete(&blob).await.map_err(BusError::from)?;
                store.put(blob, bytes).await.map_err(BusError::from)?;
            }
            None => store.put(blob, bytes).await.map_err(BusError::from)?,
        }
        if let Some(identity) = identity {
            let quota = self.config().blob_quota_bytes;
            let id = identity.clone();
            let counted = self
                .blocking(move |s| s.record_upload(&id, &blob, size, quota))
                .await?;
            if let Err(over) = counted {
                return Err(over_quota(&identity, over.used, size, quota));
            }
        }
        Ok(())
    }

    /// Refuse a scoped caller's fork whose snapshot names blobs none of its accounts owns
    /// (a hash of another tenant's file would otherwise reach its branches); then the
    /// fork's account owns them all, so every identity that may use the account reads them.
    pub(crate) async fn admit_snapshot(
        &self,
        caller: &Caller,
        req: &CreateFork,
    ) -> Result<(), CoordinatorError> {
        let scripts = req.plan.models.values().filter_map(|m| m.script).collect();
        self.admit_blobs(
            caller,
            req.snapshot,
            scripts,
            req.plan.budget.account.clone(),
        )
        .await
    }

    /// [`CoordinatorHandle::admit_snapshot`] for an agent's fork: its snapshot (the agent's
    /// workspace) charged to the account of the agent's fork. Refused the same way: a
    /// scoped client asking for one could otherwise name another tenant's hashes.
    pub(crate) async fn admit_agent_snapshot(
        &self,
        caller: &Caller,
        req: &AgentFork,
    ) -> Result<(), CoordinatorError> {
        let account = self.account_of_run(req.parent_run).await?;
        self.admit_blobs(caller, req.snapshot, Vec::new(), account)
            .await
    }

    /// Refuse `snapshot` (a manifest), its files and `scripts` when a scoped `caller`'s
    /// accounts do not own them all; then `account` owns them.
    async fn admit_blobs(
        &self,
        caller: &Caller,
        snapshot: BlobHash,
        scripts: Vec<BlobHash>,
        account: Option<String>,
    ) -> Result<(), CoordinatorError> {
        let scoped = self.usable_accounts(caller);
        if scoped.is_none() && account.is_none() {
            // An operator's fork charging no account: nothing to check or to own.
            return Ok(());
        }
        let mut wanted = vec![snapshot];
        wanted.extend(scripts);
        if let Some(bytes) = self.blob_for(caller, &snapshot).await? {
            if let Ok(manifest) = Manifest::from_blob(&bytes) {
                wanted.extend(manifest.files.values().map(|f| f.hash));
            }
        }
        if let Some(accounts) = scoped {
            let check = wanted.clone();
            let foreign = self
                .blocking(move |s| {
                    let mut out = Vec::new();
                    for h in check {
                        if !s.blob_owned(&accounts, &h)? {
                            out.push(h);
                        }
                    }
                    Ok(out)
                })
                .await?;
            if let Some(first) = foreign.first() {
                return Err(CoordinatorError::BadRequest(format!(
                    "the fork names {} blob(s) that {caller} has not uploaded (the first: {first}); upload them (`missing_blobs`, then `put_blob_part`; forkfleet's client does) and create it again",
                    foreign.len()
                )));
            }
        }
        if let Some(account) = account {
            self.blocking(move |s| s.own_blobs(&account, wanted))
                .await?;
        }
        Ok(())
    }
}

impl CoordinatorHandle {
    /// Refuse new work for `account` (a fork, a follow-up, a resumed or forked run) while
    /// what it holds is past the blob quota: its branches would be stopped at their first
    /// write, after spending on the model.
    pub(crate) async fn admit_room(&self, account: Option<String>) -> Result<(), CoordinatorError> {
        let Some(account) = account else {
            return Ok(());
        };
        // Branch writes are counted on a cluster only (see `crate::fork`'s events).
        if crate::blobs::shared_with_bus(self.store(), &self.bus()) {
            return Ok(());
        }
        let quota = self.config().blob_quota_bytes;
        let id = account.clone();
        let used = self.blocking(move |s| s.upload_usage(&id)).await?;
        if used > quota {
            return Err(CoordinatorError::BlobQuota(format!(
                "account `{account}` is past its blob quota ({} held of {}): nothing new runs for it until an operator raises `[coordinator] blob_quota_mb` or `forkfleet gc` frees what no fork refers to",
                size_text(used),
                size_text(quota)
            )));
        }
        Ok(())
    }

    /// [`CoordinatorHandle::admit_room`] for the account of the fork `run` belongs to.
    pub(crate) async fn admit_room_of_run(&self, run: RunId) -> Result<(), CoordinatorError> {
        let account = self.account_of_run(run).await?;
        self.admit_room(account).await
    }
}

fn over_quota(identity: &str, used: u64, wanted: u64, quota: u64) -> CoordinatorError {
    CoordinatorError::BlobQuota(format!(
        "`{identity}`'s blobs would pass its quota: {} stored of {}, and this upload is {}; an operator raises `[coordinator] blob_quota_mb`, or frees what no fork refers to with `forkfleet gc`",
        size_text(used),
        size_text(quota),
        size_text(wanted)
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_read_as_size_text() {
        assert_eq!(size_text(3 * 1024 * 1024 / 2), "1.5 MiB");
    }
}
