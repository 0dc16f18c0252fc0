//! Blobs through the coordinator's API (ADR 36): uploads in parts, verified against their
//! hash; reads and "missing" scoped to what a client's accounts own; quotas.

use super::support::*;
use bytes::Bytes;
use forkfleet_bus::local::LocalBusConfig;
use forkfleet_coordinator::CoordinatorConfig;
use forkfleet_shared::api::{
    dispatch, ApiErrorKind, ApiReply, ApiRequest, BlobUpload, Caller, GetBlobPart, MissingBlobs,
    PutBlobPart,
};
use forkfleet_shared::blob::BlobHash;

fn alice() -> Caller {
    Caller::Client("alice".into())
}

fn part(blob: BlobHash, offset: u64, total: u64, bytes: &[u8]) -> ApiRequest {
    PutBlobPart {
        blob,
        offset,
        total,
        bytes: Bytes::copy_from_slice(bytes),
    }
    .into()
}

#[tokio::test]
async fn uploads_in_parts_are_checked_and_reads_are_scoped() {
    let f = Fixture::start_full(
        LocalBusConfig::default(),
        CoordinatorConfig {
            // A blob is charged its size and 512 bytes for storing one.
            blob_quota_bytes: 1500,
            ..CoordinatorConfig::default()
        },
    )
    .await;
    let h = f.h();
    let bytes = b"0123456789abcdefghij";
    let hash = BlobHash::of(bytes);
    let call = |caller: Caller, req: ApiRequest| {
        let h = h.clone();
        async move { within(dispatch(&h, &caller, req)).await }
    };
    let up = |r: Result<ApiReply, _>| match r {
        Ok(ApiReply::BlobUpload(u)) => u,
        other => panic!("{other:?}"),
    };
    // Parts in order; a part sent again (a lost answer) is taken once.
    let first = up(call(alice(), part(hash, 0, 20, &bytes[..8])).await);
    assert_eq!(
        first,
        BlobUpload {
            received: 8,
            stored: false
        }
    );
    // A part at offset 0 begins the upload again.
    let again = up(call(alice(), part(hash, 0, 20, &bytes[..8])).await);
    assert_eq!(again, first);
    let second = up(call(alice(), part(hash, 8, 20, &bytes[8..14])).await);
    assert_eq!(second.received, 14);
    let repeated = up(call(alice(), part(hash, 8, 20, &bytes[8..14])).await);
    assert_eq!(
        repeated,
        BlobUpload {
            received: 14,
            stored: false
        }
    );
    // A gap, a part past the end, a changed total: refused, saying what is expected.
    // A gap is answered with where the next part must start.
    let gap = up(call(alice(), part(hash, 16, 20, &bytes[16..])).await);
    assert_eq!(
        gap,
        BlobUpload {
            received: 14,
            stored: false
        }
    );
    let past = call(alice(), part(hash, 14, 20, &[0u8; 10]))
        .await
        .unwrap_err();
    assert!(past.message.contains("past its total"), "{}", past.message);
    let total = call(alice(), part(hash, 14, 21, &bytes[14..]))
        .await
        .unwrap_err();
    assert!(
        total.message.contains("its total is 21"),
        "{}",
        total.message
    );
    let last = up(call(alice(), part(hash, 14, 20, &bytes[14..])).await);
    assert_eq!(
        last,
        BlobUpload {
            received: 20,
            stored: true
        }
    );

    // Bytes that are not the hash's, whole or in parts, are never stored.
    let other = BlobHash::of(b"other");
    let wrong = call(alice(), part(other, 0, 5, b"wrong"))
        .await
        .unwrap_err();
    assert_eq!(wrong.kind, ApiErrorKind::BadInput);
    assert!(wrong.message.contains("hash to"), "{}", wrong.message);
    up(call(alice(), part(other, 0, 5, b"wro")).await);
    let wrong = call(alice(), part(other, 3, 5, b"ng")).await.unwrap_err();
    assert!(wrong.message.contains("hash to"), "{}", wrong.message);
    let missing = |caller: Caller, blobs: Vec<BlobHash>| async move {
        match call(caller, MissingBlobs { blobs }.into()).await {
            Ok(ApiReply::Blobs(b)) => b,
            other => panic!("{other:?}"),
        }
    };
    assert_eq!(missing(Caller::Admin, vec![hash, other]).await, vec![other]);

    // Hers to read, in parts; another client's missing, as is what no one has.
    let read = |caller: Caller, offset: u64, len: u64| async move {
        match call(
            caller,
            GetBlobPart {
                blob: hash,
                start: offset,
                len,
            }
            .into(),
        )
        .await
        {
            Ok(ApiReply::BlobPart(p)) => p,
            other => panic!("{other:?}"),
        }
    };
    let p = read(alice(), 5, 10).await.unwrap();
    assert_eq!((p.total, p.bytes.as_ref()), (20, &bytes[5..15]));
    let end = read(alice(), 15, 100).await.unwrap();
    assert_eq!(end.bytes.as_ref(), &bytes[15..]);
    assert_eq!(read(Caller::Client("bob".into()), 0, 10).await, None);
    assert!(read(Caller::Admin, 0, 10).await.is_some());
    let bob = Caller::Client("bob".into());
    assert_eq!(missing(bob.clone(), vec![hash]).await, vec![hash]);
    assert!(missing(alice(), vec![hash]).await.is_empty());

    // The quota (1500 bytes here) counts each blob once, and says what it is.
    up(call(alice(), part(hash, 0, 20, bytes)).await);
    let big = vec![7u8; 700];
    let over = call(alice(), part(BlobHash::of(&big), 0, 700, &big))
        .await
        .unwrap_err();
    assert_eq!(over.kind, ApiErrorKind::Conflict);
    assert!(over.message.contains("blob_quota_mb"), "{}", over.message);
    // ... in parts too, refused at the first.
    let over = call(alice(), part(BlobHash::of(&big), 0, 700, &big[..10]))
        .await
        .unwrap_err();
    assert_eq!(over.kind, ApiErrorKind::Conflict);
    // Two uploads of the same new bytes at once (two commands of one identity) both end
    // stored: a part one of them sent already is taken as received.
    let shared = b"the same bytes from two commands at once";
    let sh = BlobHash::of(shared);
    let bob2 = Caller::Client("carol".into());
    up(call(bob2.clone(), part(sh, 0, 40, &shared[..10])).await);
    up(call(bob2.clone(), part(sh, 0, 40, &shared[..10])).await);
    let a = up(call(bob2.clone(), part(sh, 10, 40, &shared[10..25])).await);
    let b = up(call(bob2.clone(), part(sh, 10, 40, &shared[10..20])).await);
    assert_eq!((a.received, b.received), (25, 25));
    let done = up(call(bob2.clone(), part(sh, 25, 40, &shared[25..])).await);
    assert!(done.stored);
    let late = up(call(bob2.clone(), part(sh, 25, 40, &shared[25..])).await);
    assert!(late.stored, "finished by the other: {late:?}");
    // Parts of an upload the coordinator no longer holds say to start over.
    let lost = BlobHash::of(b"never started");
    let e = call(bob2, part(lost, 4, 13, b"r st")).await.unwrap_err();
    assert!(
        e.message
            .contains(forkfleet_shared::api::limits::UPLOAD_RESTART),
        "{}",
        e.message
    );
    // Another identity's quota is its own.
    up(call(bob, part(BlobHash::of(&big), 0, 700, &big)).await);
}
