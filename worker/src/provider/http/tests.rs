use super::*;

/// OpenAI's: the vendor these tests build requests for.
use crate::provider::openai::VENDOR as TEST_VENDOR;

/// `None`: the vendor's API with a key from an unset variable.
fn api(route: Option<&ModelRoute>) -> Result<Api, WorkerError> {
    let vendor = ModelRoute {
        key: Some(KeySource::Env("FORKFLEET_HTTP_UNIT_TEST_UNSET_KEY".into())),
        ..ModelRoute::default()
    };
    Api::new(
        &TEST_VENDOR,
        "openai:m",
        route.unwrap_or(&vendor),
        reqwest::Client::new(),
    )
}

#[test]
fn retry_after_takes_ms_seconds_and_dates() {
    let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
    let mut h = HeaderMap::new();
    assert_eq!(retry_after(&h, now), None);
    h.insert("retry-after", HeaderValue::from_static("7"));
    assert_eq!(retry_after(&h, now), Some(Duration::from_secs(7)));
    h.insert("retry-after", HeaderValue::from_static("1.5"));
    assert_eq!(retry_after(&h, now), Some(Duration::from_millis(1500)));
    let date = httpdate::fmt_http_date(now + Duration::from_secs(30));
    h.insert("retry-after", HeaderValue::from_str(&date).unwrap());
    assert_eq!(retry_after(&h, now), Some(Duration::from_secs(30)));
    let past = httpdate::fmt_http_date(now - Duration::from_secs(30));
    h.insert("retry-after", HeaderValue::from_str(&past).unwrap());
    assert_eq!(retry_after(&h, now), Some(Duration::ZERO));
    h.insert("retry-after", HeaderValue::from_static("soon"));
    assert_eq!(retry_after(&h, now), None);
    h.insert("retry-after-ms", HeaderValue::from_static("250"));
    assert_eq!(retry_after(&h, now), Some(Duration::from_millis(250)));
    h.insert("retry-after-ms", HeaderValue::from_static("-1"));
    assert_eq!(retry_after(&h, now), None);
}

#[test]
fn backoff_is_full_jitter_under_a_growing_bound() {
    let b = Backoff {
        base: Duration::from_millis(100),
        cap: Duration::from_millis(350),
        max_retry_after: Duration::from_secs(60),
    };
    for _ in 0..200 {
        assert!(b.jittered(1) <= Duration::from_millis(100));
        assert!(b.jittered(2) <= Duration::from_millis(200));
        assert!(b.jittered(8) <= Duration::from_millis(350));
    }
    // Not a constant.
    let waits: std::collections::HashSet<_> = (0..50).map(|_| b.jittered(8)).collect();
    assert!(waits.len() > 10, "{waits:?}");
    assert_eq!(random_up_to(Duration::ZERO), Duration::ZERO);
}

#[test]
fn messages_are_extracted_truncated_and_redacted() {
    assert_eq!(
        api_message(r#"{"error": {"message": "bad thing", "type": "x"}}"#),
        "bad thing"
    );
    assert_eq!(api_message(r#"{"error": "plain"}"#), "plain");
    assert_eq!(api_message(r#"{"detail": "d"}"#), "d");
    assert_eq!(api_message("  not json "), "not json");
    assert_eq!(api_message(""), "(no message)");
    let long = "é".repeat(MAX_MESSAGE_CHARS + 10);
    let cut = api_message(&long);
    assert!(cut.ends_with("(truncated)"));
    assert_eq!(cut.chars().filter(|c| *c == 'é').count(), MAX_MESSAGE_CHARS);
    let key = ApiKey("sk-secret".into());
    assert_eq!(
        redact("echo: Bearer sk-secret, sk-secret", Some(&key)),
        "echo: Bearer [redacted], [redacted]"
    );
    assert_eq!(format!("{key:?}"), "ApiKey(<redacted>)");
    assert!(!format!("{:?}", key.header("Bearer ").unwrap()).contains("sk-secret"));
}

#[test]
fn arguments_are_parsed_or_kept() {
    assert_eq!(parse_arguments(None), serde_json::json!({}));
    assert_eq!(
        parse_arguments(Some(serde_json::json!(""))),
        serde_json::json!({})
    );
    assert_eq!(
        parse_arguments(Some(serde_json::json!("{\"a\": 1}"))),
        serde_json::json!({"a": 1})
    );
    assert_eq!(
        parse_arguments(Some(serde_json::json!("{oops"))),
        serde_json::json!("{oops")
    );
    assert_eq!(
        parse_arguments(Some(serde_json::json!({"b": 2}))),
        serde_json::json!({"b": 2})
    );
}

#[test]
fn settings_have_defaults_and_keys_come_from_the_route() {
    let a = api(None).unwrap();
    assert_eq!(a.name, "m");
    assert_eq!(a.base_url, "https://api.openai.com/v1");
    assert_eq!(a.timeout, Duration::from_secs(120));
    assert_eq!(a.max_retries, DEFAULT_MAX_RETRIES);
    let err = a.load_key().unwrap_err().to_string();
    assert!(err.contains("FORKFLEET_HTTP_UNIT_TEST_UNSET_KEY"), "{err}");
    // The vendor's own API with no key: refused before any request.
    let err = Api::new(
        &TEST_VENDOR,
        "openai:m",
        &ModelRoute::default(),
        reqwest::Client::new(),
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("vendor's own API") && err.contains("[models.\"openai:m\"]"),
        "{err}"
    );
    // A local server with no key (a spec's base_url on an allowed host, or a catalogue
    // entry without a key source): no key header.
    let local = ModelRoute {
        base_url: Some("http://127.0.0.1:8080/v1/".into()),
        model: Some("provider-id".into()),
        timeout_s: Some(2.5),
        max_retries: Some(0),
        key: None,
    };
    let a = api(Some(&local)).unwrap();
    assert_eq!(a.base_url, "http://127.0.0.1:8080/v1");
    // The model call's span names the server (`server.address`, `server.port`): the
    // written port, else the scheme's.
    assert_eq!(a.server, ("127.0.0.1".to_string(), 8080));
    assert_eq!(
        api(None).unwrap().server,
        ("api.openai.com".to_string(), 443)
    );
    assert_eq!(a.name, "provider-id", "the catalogue's model id is sent");
    assert_eq!(a.timeout, Duration::from_millis(2500));
    assert_eq!(a.max_retries, 0);
    assert_eq!(a.load_key().unwrap(), None);
    // A local server gets `max_tokens`, OpenAI's own API `max_completion_tokens` (its
    // reasoning models refuse the other); the spec's token_param chooses either.
    assert_eq!(a.token_param(), TokenParam::MaxTokens);
    assert_eq!(
        api(None).unwrap().token_param(),
        TokenParam::MaxCompletionTokens
    );
    let mut chosen = api(None).unwrap();
    chosen.settings.token_param = Some(TokenParam::MaxTokens);
    assert_eq!(chosen.token_param(), TokenParam::MaxTokens);
    // A named variable must be set, even for a local server.
    let named = ModelRoute {
        key: Some(KeySource::Env(
            "FORKFLEET_HTTP_UNIT_TEST_NAMED_UNSET".into(),
        )),
        ..local.clone()
    };
    let err = api(Some(&named))
        .unwrap()
        .load_key()
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("FORKFLEET_HTTP_UNIT_TEST_NAMED_UNSET"),
        "{err}"
    );
    // A key file: trimmed; missing or empty named.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("key");
    std::fs::write(&path, "  sk-file\n").unwrap();
    let file = ModelRoute {
        key: Some(KeySource::File(path.clone())),
        ..local.clone()
    };
    let a = api(Some(&file)).unwrap();
    assert_eq!(a.load_key().unwrap(), Some(ApiKey("sk-file".into())));
    assert!(!format!("{a:?}").contains("sk-file"));
    std::fs::write(&path, "\n").unwrap();
    let err = a.load_key().unwrap_err().to_string();
    assert!(err.contains("is empty") && err.contains("key"), "{err}");
    std::fs::remove_file(&path).unwrap();
    let err = a.load_key().unwrap_err().to_string();
    assert!(err.contains(&path.display().to_string()), "{err}");
    // An unusable timeout is refused.
    let bad = ModelRoute {
        timeout_s: Some(f64::NAN),
        ..local
    };
    assert!(api(Some(&bad)).is_err());
}

#[test]
fn final_answers_are_classified() {
    let a = api(None).unwrap();
    let s = |c: u16| StatusCode::from_u16(c).unwrap();
    let e = a.failure(
        s(400),
        r#"{"error":{"code":"context_length_exceeded","message":"This model's maximum context length is 8192 tokens"}}"#,
        true,
        12,
    );
    assert!(
        matches!(e, WorkerError::ContextOverflow { messages: 12, .. }),
        "{e}"
    );
    let e = a.failure(
        s(401),
        r#"{"error":{"message":"Incorrect API key"}}"#,
        true,
        1,
    );
    let text = e.to_string();
    assert!(
        text.contains("rejected the key from env `FORKFLEET_HTTP_UNIT_TEST_UNSET_KEY`"),
        "{text}"
    );
    let e = a.failure(s(401), "nope", false, 1).to_string();
    assert!(e.contains("no key was sent"), "{e}");
    let e = a.failure(
        s(404),
        r#"{"error":{"message":"The model `m` does not exist"}}"#,
        true,
        1,
    );
    assert!(matches!(e, WorkerError::UnknownModel { .. }), "{e}");
    let e = a.failure(s(400), r#"{"error":{"code":"model_not_found"}}"#, true, 1);
    assert!(matches!(e, WorkerError::UnknownModel { .. }), "{e}");
    let e = a.failure(
        s(400),
        r#"{"error":{"message":"temperature is wrong"}}"#,
        true,
        1,
    );
    assert!(
        matches!(&e, WorkerError::Api { status: 400, message, .. } if message == "temperature is wrong"),
        "{e}"
    );
    assert!(retryable(s(429), "slow down"));
    assert!(!retryable(
        s(429),
        r#"{"error":{"code":"insufficient_quota"}}"#
    ));
    assert!(retryable(s(503), ""));
    assert!(retryable(s(529), ""));
    assert!(!retryable(s(400), ""));
}
