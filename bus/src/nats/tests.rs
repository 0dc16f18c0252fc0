//! Unit tests of the NATS bus's connection settings and its retry backoff.

use super::*;

#[test]
fn debug_never_shows_secrets() {
    let mut config = NatsConfig::new("nats://alice:hunter2@nats.example:4222");
    config.auth = NatsAuth::UserPassword {
        user: "alice".into(),
        password: "hunter2".into(),
    };
    let shown = format!("{config:?}");
    assert!(!shown.contains("hunter2"), "{shown}");
    assert!(
        shown.contains("nats://<redacted>@nats.example:4222"),
        "{shown}"
    );
    for auth in [
        NatsAuth::Token("s3cret-token".into()),
        NatsAuth::NkeySeed("SUACSSL3UAHUDXKFSNVUZRF5UHPMWZ6BFDTJ7M6USDXIEDNPPQYYYCU3VY".into()),
    ] {
        let shown = format!("{auth:?}");
        assert!(!shown.contains("s3cret"), "{shown}");
        assert!(!shown.contains("SUACSSL3"), "{shown}");
    }
    assert_eq!(
        format!("{:?}", NatsAuth::CredsFile("/etc/ff.creds".into())),
        "CredsFile(\"/etc/ff.creds\")"
    );
}

#[test]
fn redacts_user_info_only() {
    assert_eq!(redact_url("nats://h:4222"), "nats://h:4222");
    assert_eq!(redact_url("tls://tok@h:4222"), "tls://<redacted>@h:4222");
    assert_eq!(redact_url("u:p@h"), "<redacted>@h");
    assert_eq!(
        redact_url("nats://a:1, nats://u:p@b:2"),
        "nats://a:1,nats://<redacted>@b:2"
    );
}

#[test]
fn backoff_grows_and_caps() {
    let mut b = Backoff::new();
    assert_eq!(b.next(), RETRY_MIN);
    assert_eq!(b.next(), RETRY_MIN * 2);
    for _ in 0..20 {
        b.next();
    }
    assert_eq!(b.next(), RETRY_MAX);
    b.reset();
    assert_eq!(b.next(), RETRY_MIN);
}
