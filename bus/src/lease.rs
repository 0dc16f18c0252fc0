//! The coordinator lease in NATS KV: one key (`lease` in the bucket `ff_coordinator`, see
//! [`forkfleet_shared::subjects`]) naming the coordinator that serves the API and consumes
//! the events. Every write is revision-checked: a take creates the key, or updates it from
//! the revision its taker read; a renewal updates it from the revision of the holder's last
//! write; a release deletes it at that revision. A write that finds another revision is a
//! [`LeaseError::Conflict`]: someone else wrote the lease in between.
//!
//! This module is the storage only; when to take, renew, wait or refuse is the
//! coordinator service's policy (`forkfleet::service::lease`).

use crate::nats::NatsBus;
use crate::{BusError, BusResult};
use async_nats::jetstream::kv;
use forkfleet_shared::subjects;
use serde::{Deserialize, Serialize};

/// What the lease says: who holds it, for which store, until when.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseRecord {
    /// The holder's id: one per coordinator process (a UUID).
    pub holder: String,
    /// The id of the run store the holder serves (`RunStore::id`).
    pub store_id: String,
    pub hostname: String,
    pub pid: u32,
    /// The holder's pid namespace (`/proc/self/ns/pid`, e.g. `pid:[4026531836]`): a
    /// coordinator on the same host and in the same namespace can tell whether the holder's
    /// process is gone. `None` from a holder that did not say (an earlier release).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid_ns: Option<String>,
    /// The holder renews every third of this.
    pub ttl_ms: u64,
    /// Wall-clock time (ms since the Unix epoch) after which the lease is free unless
    /// renewed.
    pub expires_at_ms: u64,
}

impl LeaseRecord {
    /// Whether the lease has expired by this machine's clock.
    pub fn expired_at(&self, now_ms: u64) -> bool {
        now_ms >= self.expires_at_ms
    }

    /// The same record, expiring `ttl_ms` after `now_ms` (the holder's clock).
    pub fn renewed_at(&self, now_ms: u64) -> LeaseRecord {
        LeaseRecord {
            expires_at_ms: now_ms.saturating_add(self.ttl_ms),
            ..self.clone()
        }
    }
}

/// The lease as read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaseState {
    /// Never taken, or released: take it from `revision` (`None`: the key never existed).
    Free { revision: Option<u64> },
    /// Written at `revision` (live or expired: see [`LeaseRecord::expired_at`]).
    Held { record: LeaseRecord, revision: u64 },
    /// A value that does not decode (written by something else): it may be taken from
    /// `revision` once it has not changed for a TTL.
    Unreadable { revision: u64 },
}

impl LeaseState {
    /// The revision a take must start from.
    pub fn revision(&self) -> Option<u64> {
        match self {
            LeaseState::Free { revision } => *revision,
            LeaseState::Held { revision, .. } | LeaseState::Unreadable { revision } => {
                Some(*revision)
            }
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    /// The lease was written by someone else since the revision given.
    #[error("the coordinator lease was written by another coordinator in between")]
    Conflict,
    #[error(transparent)]
    Bus(#[from] BusError),
}

/// The lease bucket. Cheap to clone.
#[derive(Clone)]
pub struct LeaseBucket {
    kv: kv::Store,
    url: String,
}

impl NatsBus {
    /// The coordinator lease bucket, created if missing.
    pub async fn lease_bucket(&self) -> BusResult<LeaseBucket> {
        let kv = crate::nats::ensure_kv(
            self.js(),
            kv::Config {
                bucket: subjects::COORDINATOR_BUCKET.into(),
                description: "forkfleet: the serving coordinator's lease".into(),
                history: 1,
                // One small record: a byte limit like every other bucket's.
                max_bytes: 1 << 20,
                storage: self.config().storage.into(),
                // Like every stream and bucket: `[nats] replicas` (3 on a NATS cluster).
                num_replicas: self.config().replicas,
                ..Default::default()
            },
            self.url(),
        )
        .await?;
        Ok(LeaseBucket {
            kv,
            url: self.url().to_string(),
        })
    }
}

fn backend(what: &str, url: &str, err: impl std::fmt::Display) -> BusError {
    BusError::Backend(format!("{what} on {url}: {err}"))
}

fn encode(record: &LeaseRecord) -> BusResult<bytes::Bytes> {
    serde_json::to_vec(record)
        .map(bytes::Bytes::from)
        .map_err(|e| BusError::Backend(format!("encode the coordinator lease: {e}")))
}

impl LeaseBucket {
    /// The lease as it is now.
    pub async fn read(&self) -> BusResult<LeaseState> {
        let entry = self
            .kv
            .entry(subjects::COORDINATOR_LEASE_KEY)
            .await
            .map_err(|e| backend("cannot read the coordinator lease", &self.url, e))?;
        Ok(match entry {
            None => LeaseState::Free { revision: None },
            Some(e) if e.operation != kv::Operation::Put => LeaseState::Free {
                revision: Some(e.revision),
            },
            Some(e) => match serde_json::from_slice::<LeaseRecord>(&e.value) {
                Ok(record) => LeaseState::Held {
                    record,
                    revision: e.revision,
                },
                Err(_) => LeaseState::Unreadable {
                    revision: e.revision,
                },
            },
        })
    }

    /// Write `record` over the lease read at `revision` (`None`: the key never existed):
    /// the new revision, or [`LeaseError::Conflict`] if it was written since.
    pub async fn write(
        &self,
        record: &LeaseRecord,
        revision: Option<u64>,
    ) -> Result<u64, LeaseError> {
        let value = encode(record)?;
        match revision {
            None => self
                .kv
                .create(subjects::COORDINATOR_LEASE_KEY, value)
                .await
                .map_err(|e| match e.kind() {
                    kv::CreateErrorKind::AlreadyExists => LeaseError::Conflict,
                    _ => backend("cannot take the coordinator lease", &self.url, e).into(),
                }),
            Some(rev) => self
                .kv
                .update(subjects::COORDINATOR_LEASE_KEY, value, rev)
                .await
                .map_err(|e| match e.kind() {
                    kv::UpdateErrorKind::WrongLastRevision => LeaseError::Conflict,
                    _ => backend("cannot write the coordinator lease", &self.url, e).into(),
                }),
        }
    }

    /// Release the lease written at `revision`, so a standby takes over at once; a lease
    /// written since (someone else's) is left alone ([`LeaseError::Conflict`]).
    pub async fn release(&self, revision: u64) -> Result<(), LeaseError> {
        self.kv
            .delete_expect_revision(subjects::COORDINATOR_LEASE_KEY, Some(revision))
            .await
            .map_err(|e| {
                let text = e.to_string();
                if text.contains("wrong last sequence") || text.contains("10071") {
                    LeaseError::Conflict
                } else {
                    backend("cannot release the coordinator lease", &self.url, e).into()
                }
            })
    }
}
