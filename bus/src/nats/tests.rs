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

#[test]
fn url_credentials_are_taken_out_of_the_url() {
    let (creds, urls) = config::url_credentials("nats://u:p%40ss@h:4222").unwrap();
    assert_eq!(creds, Some(("u".to_string(), "p@ss".to_string())));
    assert_eq!(urls, "nats://h:4222");
    let (creds, urls) =
        config::url_credentials("nats://u:p@a:1, nats://u:p@b:2,nats://c:3").unwrap();
    assert_eq!(creds, Some(("u".to_string(), "p".to_string())));
    assert_eq!(urls, "nats://a:1,nats://b:2,nats://c:3");
    let (creds, urls) = config::url_credentials("nats://h:4222").unwrap();
    assert_eq!(creds, None);
    assert_eq!(urls, "nats://h:4222");
    let err = config::url_credentials("nats://u:p@a:1,nats://v:q@b:2").unwrap_err();
    assert!(err.contains("different users"), "{err}");
    assert!(!err.contains(":q@"), "{err}");
    let err = config::url_credentials("nats://:secret@a:1").unwrap_err();
    assert!(!err.contains("secret"), "{err}");
    // A malformed escape is refused, not taken as written (and the password not shown).
    let err = config::url_credentials("nats://u:50%off@a:1").unwrap_err();
    assert!(err.contains("malformed %-escape in its password"), "{err}");
    assert!(!err.contains("50%off"), "{err}");
}

#[tokio::test]
async fn a_url_user_and_another_auth_method_is_an_error_naming_both() {
    let mut config = NatsConfig::new("nats://alice:hunter2@127.0.0.1:1");
    config.auth = NatsAuth::Token("tok".into());
    let err = NatsBus::connect(config).await.unwrap_err().to_string();
    assert!(
        err.contains("user `alice`") && err.contains("a token"),
        "{err}"
    );
    assert!(!err.contains("hunter2"), "{err}");
    let mut config = NatsConfig::new("nats://127.0.0.1:1");
    config.replicas = 6;
    let err = NatsBus::connect(config).await.unwrap_err().to_string();
    assert!(err.contains("replicas must be 1 to 5"), "{err}");
}
