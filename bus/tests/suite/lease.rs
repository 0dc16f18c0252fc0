//! The coordinator lease's storage rules on a real `nats-server`: every write is
//! revision-checked, so of two writers from one revision exactly one wins, and a release
//! only deletes the lease it wrote.

use forkfleet_bus::lease::{LeaseError, LeaseRecord, LeaseState};
use forkfleet_bus::nats::{NatsBus, NatsConfig};
use forkfleet_bus::testkit::NatsServer;
use forkfleet_shared::protocol::now_ms;
use std::time::Duration;

async fn connect(server: &NatsServer) -> NatsBus {
    let mut config = NatsConfig::new(server.url());
    config.request_timeout = Duration::from_secs(5);
    tokio::time::timeout(Duration::from_secs(20), NatsBus::connect(config))
        .await
        .unwrap()
        .unwrap()
}

fn record(holder: &str, store: &str, ttl_ms: u64) -> LeaseRecord {
    LeaseRecord {
        pid_ns: None,
        holder: holder.into(),
        store_id: store.into(),
        hostname: "host-a".into(),
        pid: 42,
        ttl_ms,
        expires_at_ms: now_ms() + ttl_ms,
    }
}

#[tokio::test]
async fn writes_are_revision_checked() {
    let server = NatsServer::start();
    let (a, b) = (connect(&server).await, connect(&server).await);
    let (la, lb) = (
        a.lease_bucket().await.unwrap(),
        b.lease_bucket().await.unwrap(),
    );
    assert_eq!(
        la.read().await.unwrap(),
        LeaseState::Free { revision: None }
    );

    // Two coordinators take a free lease at once: one wins, the other conflicts.
    let first = la.write(&record("a", "s1", 1000), None).await.unwrap();
    let lost = lb.write(&record("b", "s1", 1000), None).await;
    assert!(matches!(lost, Err(LeaseError::Conflict)), "{lost:?}");
    let LeaseState::Held {
        record: held,
        revision,
    } = lb.read().await.unwrap()
    else {
        panic!("the lease is held")
    };
    assert_eq!((held.holder.as_str(), revision), ("a", first));
    assert!(!held.expired_at(now_ms()));
    assert!(held.expired_at(held.expires_at_ms));

    // The holder renews from its revision; a stale revision conflicts.
    let renewed = la
        .write(
            &held.renewed_at(forkfleet_shared::protocol::now_ms()),
            Some(first),
        )
        .await
        .unwrap();
    assert!(renewed > first);
    let stale = lb.write(&record("b", "s1", 1000), Some(first)).await;
    assert!(matches!(stale, Err(LeaseError::Conflict)), "{stale:?}");

    // Taking over from the current revision (an expired lease) wins once.
    let taken = lb
        .write(&record("b", "s1", 1000), Some(renewed))
        .await
        .unwrap();
    let late = la
        .write(
            &held.renewed_at(forkfleet_shared::protocol::now_ms()),
            Some(renewed),
        )
        .await;
    assert!(matches!(late, Err(LeaseError::Conflict)), "{late:?}");

    // A release deletes only the lease its writer holds.
    let wrong = la.release(renewed).await;
    assert!(matches!(wrong, Err(LeaseError::Conflict)), "{wrong:?}");
    assert!(matches!(la.read().await.unwrap(), LeaseState::Held { .. }));
    lb.release(taken).await.unwrap();
    let LeaseState::Free {
        revision: Some(free),
    } = la.read().await.unwrap()
    else {
        panic!("released")
    };
    // Released, it is taken from the deletion's revision, once.
    la.write(&record("a", "s1", 1000), Some(free))
        .await
        .unwrap();
    let again = lb.write(&record("b", "s1", 1000), Some(free)).await;
    assert!(matches!(again, Err(LeaseError::Conflict)), "{again:?}");
}
