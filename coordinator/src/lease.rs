//! One coordinator at a time on a NATS cluster: the policy over the lease of
//! [`forkfleet_bus::lease`].
//!
//! - [`acquire`]: read the lease. Free or expired: take it (a take that loses the race
//!   means someone else just took it: stand by). Held and live for this store: stand by,
//!   subscribed to nothing, saying so at WARN, until it expires or is released, then take
//!   it. Held and live for another store: refuse ([`CoordinatorError::BadRequest`], exit
//!   code 2), naming both
//!   store ids.
//! - [`Lease`]: the lease held, renewed every third of its TTL in the background. When a
//!   renewal finds the lease written by someone else, or none succeeds before the lease
//!   would expire, it is lost: [`Lease::lost`] completes and the coordinator stops serving.
//!   [`Lease::release`] on a clean stop deletes it, so a standby takes over at once.
//!
//! A lease is expired when the coordinator's [`Clock`] (this machine's system clock unless
//! [`acquire_with_clock`] is given another) passes its `expires_at_ms` ([`expired`]), or
//! when its revision has not changed for its TTL as this process watched it (on the
//! monotonic clock, so a standby whose clock is behind still takes over within a TTL of the
//! holder's last renewal). The same clock stamps the `expires_at_ms` of the records this
//! coordinator writes; the monotonic clock paces the polls and renewals.

use crate::CoordinatorError;
use forkfleet_bus::lease::{LeaseBucket, LeaseError, LeaseRecord, LeaseState};
use forkfleet_bus::nats::NatsBus;
use forkfleet_shared::clock::Clock;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;

/// The longest pause between two reads of a standby.
const STANDBY_POLL_MAX: Duration = Duration::from_secs(1);
/// The pause before a failed renewal is tried again.
const RENEW_RETRY: Duration = Duration::from_millis(200);

/// Who this coordinator is, as the lease records it.
#[derive(Debug, Clone)]
pub struct Candidate {
    pub store_id: String,
    pub ttl: Duration,
}

impl Candidate {
    /// The record of `holder` taking the lease now, by `clock`.
    fn record(&self, holder: &str, clock: &dyn Clock) -> LeaseRecord {
        let ttl_ms = u64::try_from(self.ttl.as_millis()).unwrap_or(u64::MAX);
        LeaseRecord {
            holder: holder.to_string(),
            store_id: self.store_id.clone(),
            hostname: hostname(),
            pid: std::process::id(),
            pid_ns: pid_namespace(),
            ttl_ms,
            expires_at_ms: clock.now_ms().saturating_add(ttl_ms),
        }
    }
}

/// Whether `record` has expired by `clock`: its `expires_at_ms` has come.
pub fn expired(record: &LeaseRecord, clock: &dyn Clock) -> bool {
    record.expired_at(clock.now_ms())
}

/// This machine's host name (`/proc/sys/kernel/hostname`, else `$HOSTNAME`), or `unknown`.
fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok().filter(|s| !s.is_empty()))
        .unwrap_or_else(|| "unknown".to_string())
}

/// Whether `record` was written by this very process (it served before, then lost the
/// lease): its host, pid namespace and pid are this process's.
fn held_here(record: &LeaseRecord) -> bool {
    record.pid == std::process::id()
        && record.hostname == hostname()
        && record.pid_ns.is_some()
        && record.pid_ns == pid_namespace()
}

/// This process's pid namespace, as `/proc/self/ns/pid` links it (`pid:[INODE]`).
fn pid_namespace() -> Option<String> {
    std::fs::read_link("/proc/self/ns/pid")
        .ok()
        .map(|p| p.to_string_lossy().into_owned())
}

/// True when `record`'s holder is a process of this host and pid namespace that no longer
/// exists: its pid is this process's own, or no process has it. A holder that did not
/// record its namespace, or another host's, is never judged gone (its lease expires).
fn holder_gone(record: &LeaseRecord) -> bool {
    let here = record.hostname == hostname()
        && record.pid_ns.is_some()
        && record.pid_ns == pid_namespace();
    here && (record.pid == std::process::id()
        || !std::path::Path::new(&format!("/proc/{}", record.pid)).exists())
}

/// The lease as one reader watched it: its revision and when that revision was first seen.
struct Watched {
    revision: Option<u64>,
    since: Instant,
}

impl Watched {
    /// Note `revision`; true when it has not changed for `ttl`.
    fn unchanged_for(&mut self, revision: Option<u64>, ttl: Duration) -> bool {
        if self.revision != revision {
            self.revision = revision;
            self.since = Instant::now();
        }
        self.since.elapsed() >= ttl
    }
}

/// Take the lease for `me`, standing by while a live coordinator of the same store holds
/// it. `None` when `shutdown` completes first (a standby stopped: nothing to release).
/// Expiry is judged by the system clock.
pub async fn acquire(
    bus: &NatsBus,
    me: &Candidate,
    shutdown: impl Future<Output = ()>,
) -> Result<Option<Lease>, CoordinatorError> {
    acquire_with_clock(bus, me, forkfleet_shared::clock::system(), shutdown).await
}

/// [`acquire`], with the lease's expiry judged, and the records written (and renewed)
/// stamped, by `clock`.
pub async fn acquire_with_clock(
    bus: &NatsBus,
    me: &Candidate,
    clock: Arc<dyn Clock>,
    shutdown: impl Future<Output = ()>,
) -> Result<Option<Lease>, CoordinatorError> {
    let holder = uuid::Uuid::now_v7().to_string();
    let poll = (me.ttl / 4).clamp(Duration::from_millis(50), STANDBY_POLL_MAX);
    let mut watched = Watched {
        revision: None,
        since: Instant::now(),
    };
    // The holder last reported, so standing by is said once per holder.
    let mut reported: Option<String> = None;
    // NATS unreachable: said once per outage, and when it answers again.
    let mut unreachable: Option<Instant> = None;
    let mut bucket: Option<LeaseBucket> = None;
    tokio::pin!(shutdown);
    loop {
        // NATS may be away (a restart, an outage): a coordinator waits for it, whether it
        // stands by or served until its lease was lost, and never exits for it.
        let read = match &bucket {
            Some(b) => b.read().await.map(|state| (b.clone(), state)),
            None => match bus.lease_bucket().await {
                Ok(b) => {
                    bucket = Some(b.clone());
                    b.read().await.map(|state| (b, state))
                }
                Err(e) => Err(e),
            },
        };
        let (lease_bucket, state) = match read {
            Ok(read) => {
                if let Some(since) = unreachable.take() {
                    tracing::info!(
                        waited_ms = since.elapsed().as_millis() as u64,
                        "NATS answers again: reading the coordinator lease"
                    );
                }
                read
            }
            Err(e) => {
                if unreachable.is_none() {
                    unreachable = Some(Instant::now());
                    tracing::warn!(error = %e, "cannot read the coordinator lease (NATS unreachable?): waiting for NATS");
                }
                tokio::select! {
                    _ = &mut shutdown => {
                        tracing::info!("stopped while waiting for NATS");
                        return Ok(None);
                    }
                    _ = tokio::time::sleep(poll) => continue,
                }
            }
        };
        let revision = state.revision();
        let mut gone = false;
        let take = match &state {
            LeaseState::Free { .. } => true,
            LeaseState::Unreadable { .. } => watched.unchanged_for(revision, me.ttl),
            LeaseState::Held { record, .. } => {
                let stale = watched.unchanged_for(revision, Duration::from_millis(record.ttl_ms));
                gone = record.holder != holder && holder_gone(record);
                let expired = stale || expired(record, clock.as_ref()) || gone;
                if !expired && record.store_id != me.store_id {
                    return Err(CoordinatorError::BadRequest(format!(
                        "another coordinator ({} on {}, pid {}) serves the run store {} on this NATS server; this one's data dir holds the store {}. Two stores cannot serve one cluster: point this coordinator at that store's data dir (it then waits as a standby), stop the other one, or use another NATS server",
                        record.holder, record.hostname, record.pid, record.store_id, me.store_id
                    )));
                }
                if !expired && reported.as_deref() != Some(record.holder.as_str()) {
                    tracing::warn!(
                        lease.holder = %record.holder,
                        lease.host = %record.hostname,
                        lease.pid = record.pid,
                        store.id = %record.store_id,
                        "standby: coordinator {} on {} serves store {}; waiting to take over",
                        record.holder,
                        record.hostname,
                        record.store_id
                    );
                    reported = Some(record.holder.clone());
                }
                expired
            }
        };
        if take {
            let record = me.record(&holder, clock.as_ref());
            match lease_bucket.write(&record, revision).await {
                Ok(revision) => {
                    if let LeaseState::Held { record: old, .. } = &state {
                        if held_here(old) {
                            tracing::info!(
                                lease.previous = %old.holder,
                                "coordinator lease taken again: it was this process's own, from before it stopped serving"
                            );
                        } else if gone {
                            tracing::warn!(
                                lease.previous = %old.holder,
                                lease.previous_pid = old.pid,
                                "coordinator lease taken over at once: its holder was a process of this host that is gone"
                            );
                        } else {
                            tracing::warn!(
                                lease.previous = %old.holder,
                                lease.previous_host = %old.hostname,
                                "coordinator lease taken over from an expired holder"
                            );
                        }
                    }
                    tracing::info!(
                        lease.holder = %holder,
                        store.id = %me.store_id,
                        lease.ttl_ms = record.ttl_ms,
                        "coordinator lease taken"
                    );
                    return Ok(Some(Lease::hold(lease_bucket, record, revision, clock)));
                }
                // Someone else just took it: read it again, and stand by.
                Err(LeaseError::Conflict) => continue,
                Err(LeaseError::Bus(e)) => {
                    tracing::warn!(error = %e, "cannot take the coordinator lease (NATS unreachable?): trying again");
                }
            }
        }
        tokio::select! {
            _ = &mut shutdown => {
                tracing::info!("standby stopped before taking over");
                return Ok(None);
            }
            _ = tokio::time::sleep(poll) => {}
        }
    }
}

/// The lease held by this coordinator, renewed in the background until released or lost.
pub struct Lease {
    lost: watch::Receiver<Option<String>>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    renewer: tokio::task::JoinHandle<Option<u64>>,
    bucket: LeaseBucket,
    store_id: String,
}

impl Lease {
    fn hold(
        bucket: LeaseBucket,
        record: LeaseRecord,
        revision: u64,
        clock: Arc<dyn Clock>,
    ) -> Lease {
        let (lost_tx, lost) = watch::channel(None);
        let (stop, stopped) = tokio::sync::oneshot::channel();
        let store_id = record.store_id.clone();
        let renewer = tokio::spawn(renew(
            bucket.clone(),
            record,
            revision,
            clock,
            lost_tx,
            stopped,
        ));
        Lease {
            lost,
            stop: Some(stop),
            renewer,
            bucket,
            store_id,
        }
    }

    /// The store id this lease is for.
    pub fn store_id(&self) -> &str {
        &self.store_id
    }

    /// Completes when the lease is lost, with why.
    pub fn lost(&self) -> impl Future<Output = String> + Send + 'static {
        let mut lost = self.lost.clone();
        async move {
            loop {
                if let Some(why) = lost.borrow_and_update().clone() {
                    return why;
                }
                if lost.changed().await.is_err() {
                    // The renewer ended without losing it: released; never completes.
                    std::future::pending::<()>().await;
                }
            }
        }
    }

    /// Why the lease was lost, if it was.
    pub fn lost_reason(&self) -> Option<String> {
        self.lost.borrow().clone()
    }

    /// Stop renewing and delete the lease (if it is still ours), so a standby takes over
    /// at once.
    pub async fn release(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let revision = match (&mut self.renewer).await {
            Ok(Some(revision)) => revision,
            _ => return,
        };
        match self.bucket.release(revision).await {
            Ok(()) => tracing::info!("coordinator lease released"),
            Err(LeaseError::Conflict) => {
                tracing::warn!("coordinator lease not released: another coordinator holds it")
            }
            Err(LeaseError::Bus(e)) => {
                tracing::warn!(error = %e, "coordinator lease not released; a standby takes over when it expires")
            }
        }
    }
}

/// Renew every third of the TTL (each renewal expiring a TTL from then by `clock`) until
/// `stop` (the last revision: ours to release) or the lease is lost (`None`, and `lost`
/// says why).
async fn renew(
    bucket: LeaseBucket,
    mut record: LeaseRecord,
    mut revision: u64,
    clock: Arc<dyn Clock>,
    lost: watch::Sender<Option<String>>,
    mut stop: tokio::sync::oneshot::Receiver<()>,
) -> Option<u64> {
    let ttl = Duration::from_millis(record.ttl_ms);
    let every = ttl / 3;
    // The lease lasts a TTL from the start of the last write that succeeded.
    let mut valid_until = Instant::now() + ttl;
    let mut next = Instant::now() + every;
    loop {
        tokio::select! {
            _ = &mut stop => return Some(revision),
            _ = tokio::time::sleep_until(next.min(valid_until)) => {}
        }
        if Instant::now() >= valid_until {
            let why = format!(
                "the coordinator lease could not be renewed within its TTL ({} ms); a standby may take over",
                record.ttl_ms
            );
            let _ = lost.send(Some(why));
            return None;
        }
        let started = Instant::now();
        record = record.renewed_at(clock.now_ms());
        let written = tokio::time::timeout(
            valid_until.saturating_duration_since(started),
            bucket.write(&record, Some(revision)),
        )
        .await;
        match written {
            Ok(Ok(r)) => {
                revision = r;
                valid_until = started + ttl;
                next = started + every;
            }
            Ok(Err(LeaseError::Conflict)) => {
                let holder = match bucket.read().await {
                    Ok(LeaseState::Held { record: other, .. }) => {
                        format!("coordinator {} on {}", other.holder, other.hostname)
                    }
                    _ => "another coordinator".to_string(),
                };
                let _ = lost.send(Some(format!("the coordinator lease was taken by {holder}")));
                return None;
            }
            Ok(Err(LeaseError::Bus(e))) => {
                tracing::warn!(error = %e, "coordinator lease renewal failed; trying again");
                next = Instant::now() + RENEW_RETRY;
            }
            Err(_) => next = Instant::now(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use forkfleet_shared::clock::ManualClock;

    /// Some time long ago, far from the wall clock: only the manual clock can decide.
    const START_MS: u64 = 1_000_000;

    fn candidate() -> Candidate {
        Candidate {
            store_id: "store-a".into(),
            ttl: Duration::from_millis(3_000),
        }
    }

    #[test]
    fn a_lease_record_expires_exactly_when_the_clock_passes_it() {
        let clock = ManualClock::new(START_MS);
        let record = candidate().record("holder-1", &clock);
        assert_eq!(record.expires_at_ms, START_MS + 3_000);
        assert_eq!(record.ttl_ms, 3_000);
        // Long before the wall clock's now: still live by the manual clock.
        assert!(!expired(&record, &clock));
        clock.advance(2_999);
        assert!(
            !expired(&record, &clock),
            "one millisecond before its expiry"
        );
        clock.advance(1);
        assert!(expired(&record, &clock), "at its expiry");
        // A clock stepped back: live again (the wall clock is never read).
        clock.set(START_MS);
        assert!(!expired(&record, &clock));
    }

    #[test]
    fn a_lease_record_far_in_the_future_is_judged_by_the_clock_given() {
        // Live by the wall clock for years to come, expired by this clock.
        let far = Candidate {
            ttl: Duration::from_secs(10 * 365 * 24 * 3600),
            ..candidate()
        };
        let wall = forkfleet_shared::clock::system();
        let record = far.record("holder-2", wall.as_ref());
        assert!(!expired(&record, wall.as_ref()));
        let clock = ManualClock::new(record.expires_at_ms);
        assert!(expired(&record, &clock));
        clock.set(record.expires_at_ms - 1);
        assert!(!expired(&record, &clock));
    }

    #[test]
    fn a_renewal_expires_a_ttl_from_the_clocks_now() {
        let clock = ManualClock::new(START_MS);
        let record = candidate().record("holder-3", &clock);
        clock.advance(2_500);
        let again = record.renewed_at(clock.now_ms());
        assert_eq!(again.expires_at_ms, START_MS + 2_500 + 3_000);
        assert_eq!(
            LeaseRecord {
                expires_at_ms: record.expires_at_ms,
                ..again.clone()
            },
            record,
            "only the expiry changes"
        );
        clock.advance(2_999);
        assert!(!expired(&again, &clock));
        assert!(
            expired(&record, &clock),
            "the record before the renewal has expired"
        );
        clock.advance(1);
        assert!(expired(&again, &clock));
    }
}
