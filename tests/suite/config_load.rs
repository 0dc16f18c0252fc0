//! The configuration as a library (`forkfleet::config`): the layers' precedence, the
//! file, the environment, secrets, NATS auth and TLS mistakes, pricing and URL redaction.

use forkfleet::config::*;
use forkfleet_bus::nats::{redact_url, NatsAuth};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

fn env_of(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let map: HashMap<String, String> = vars
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    move |k| map.get(k).cloned()
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

#[test]
fn defaults_alone() {
    let c = Config::load(None, &env_of(&[]), Layer::default()).unwrap();
    assert_eq!(c.data.value, PathBuf::from(".forkfleet"));
    assert_eq!(c.pool.value, "default");
    assert_eq!(c.concurrency.value, 64);
    assert_eq!(c.drain_grace.value, Duration::from_secs(30));
    assert_eq!(c.nats.url, None);
    assert!(c.nats_config("x").is_none());
}

#[test]
fn each_layer_overrides_the_one_below_per_key() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(
        dir.path(),
        "ff.toml",
        "pool = \"file-pool\"\nconcurrency = 3\ndrain_grace_s = 5\ndata = \"store\"\n[nats]\nurl = \"nats://file:4222\"\nname = \"from-file\"\n[nats.tls]\nca_file = \"ca.pem\"\n",
    );
    let env = env_of(&[
        ("FORKFLEET_CONCURRENCY", "7"),
        ("FORKFLEET_NATS_URL", "nats://env:4222"),
        ("FORKFLEET_DRAIN_GRACE_S", "9"),
    ]);
    let flags = Layer {
        concurrency: Some(11),
        ..Layer::default()
    };
    let c = Config::load(Some(&file), &env, flags).unwrap();
    // file only
    assert_eq!(c.pool.value, "file-pool");
    assert_eq!(c.pool.origin, Origin::File(file.clone()));
    assert_eq!(
        c.data.value,
        dir.path().join("store"),
        "relative to the file"
    );
    assert_eq!(
        c.nats.tls_ca_file.as_ref().unwrap().value,
        dir.path().join("ca.pem")
    );
    assert_eq!(c.nats.name.as_ref().unwrap().value, "from-file");
    // env over file
    assert_eq!(c.nats.url.as_ref().unwrap().value, "nats://env:4222");
    assert_eq!(
        c.nats.url.as_ref().unwrap().origin,
        Origin::Env("FORKFLEET_NATS_URL".into())
    );
    assert_eq!(c.drain_grace.value, Duration::from_secs(9));
    // flag over env over file
    assert_eq!(c.concurrency.value, 11);
    assert_eq!(c.concurrency.origin, Origin::Flag("--concurrency"));
    let nats = c.nats_config("forkfleet-test").unwrap();
    assert_eq!(nats.url, "nats://env:4222");
    assert_eq!(nats.name.as_deref(), Some("from-file"));
    assert_eq!(nats.tls.ca_file, Some(dir.path().join("ca.pem")));
}

#[test]
fn config_file_from_the_environment() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(dir.path(), "c.toml", "pool = \"p\"\n");
    let path = file.to_str().unwrap().to_string();
    let c = Config::load(
        None,
        &env_of(&[("FORKFLEET_CONFIG", &path)]),
        Layer::default(),
    )
    .unwrap();
    assert_eq!(c.pool.value, "p");
    assert_eq!(c.file, Some(file));
}

#[test]
fn unknown_keys_list_the_valid_ones() {
    let dir = tempfile::tempdir().unwrap();
    for text in [
        "colour = 1\n",
        "[nats]\nurll = \"x\"\n",
        "[nats.tls]\nca = \"x\"\n",
    ] {
        let file = write(dir.path(), "bad.toml", text);
        let err = Config::load(Some(&file), &env_of(&[]), Layer::default())
            .unwrap_err()
            .to_string();
        assert!(err.contains("unknown field"), "{err}");
        assert!(err.contains("drain_grace_s"), "{err}");
        assert!(err.contains("nkey_seed_file"), "{err}");
    }
}

#[test]
fn secrets_from_values_and_files_are_redacted() {
    let dir = tempfile::tempdir().unwrap();
    let pw = write(dir.path(), "pw", "hunter2\n");
    let file = write(
        dir.path(),
        "c.toml",
        "[nats]\nurl = \"nats://h:4222\"\nuser = \"alice\"\npassword = \"from-file-secret\"\n",
    );
    let env = env_of(&[("FORKFLEET_NATS_PASSWORD_FILE", pw.to_str().unwrap())]);
    let c = Config::load(Some(&file), &env, Layer::default()).unwrap();
    let p = c.nats.password.as_ref().unwrap();
    assert_eq!(p.value.expose(), "hunter2", "env file over file value");
    assert_eq!(p.file.as_deref(), Some(pw.as_path()));
    let shown = c.render();
    let debug = format!("{c:?} {:?}", c.nats_config("x").unwrap());
    for text in [&shown, &debug] {
        assert!(!text.contains("hunter2"), "{text}");
        assert!(!text.contains("from-file-secret"), "{text}");
    }
    assert!(shown.contains("password = \"<redacted>\""), "{shown}");
    assert!(shown.contains("FORKFLEET_NATS_PASSWORD_FILE"), "{shown}");
    assert!(shown.contains("user = \"alice\""), "{shown}");
    match c.nats_config("x").unwrap().auth {
        NatsAuth::UserPassword { user, password } => {
            assert_eq!((user.as_str(), password.as_str()), ("alice", "hunter2"))
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn auth_and_tls_mistakes_are_errors() {
    let cases: Vec<(Vec<(&str, &str)>, &str)> = vec![
        (
            vec![
                ("FORKFLEET_NATS_TOKEN", "t"),
                ("FORKFLEET_NATS_CREDS_FILE", "c"),
            ],
            "more than one NATS auth method",
        ),
        (vec![("FORKFLEET_NATS_USER", "u")], "has no password"),
        (vec![("FORKFLEET_NATS_PASSWORD", "p")], "no user"),
        (
            vec![
                ("FORKFLEET_NATS_TOKEN", "t"),
                ("FORKFLEET_NATS_TOKEN_FILE", "f"),
            ],
            "not both",
        ),
        (
            vec![("FORKFLEET_NATS_TLS_CERT_FILE", "c")],
            "without its key",
        ),
        (
            vec![("FORKFLEET_NATS_TLS_REQUIRE", "maybe")],
            "true or false",
        ),
        (
            vec![("FORKFLEET_CONCURRENCY", "lots")],
            "FORKFLEET_CONCURRENCY",
        ),
        (vec![("FORKFLEET_CONCURRENCY", "0")], "at least 1"),
        (vec![("FORKFLEET_POOL", "a.b")], "pool"),
        (
            vec![("FORKFLEET_NATS_NKEY_SEED_FILE", "/nonexistent/seed")],
            "/nonexistent/seed",
        ),
    ];
    for (vars, expect) in cases {
        let err = Config::load(None, &env_of(&vars), Layer::default())
            .unwrap_err()
            .to_string();
        assert!(err.contains(expect), "{vars:?}: {err}");
        for (_, v) in &vars {
            if *v == "t" || *v == "p" {
                assert!(!err.contains(&format!("`{v}`")), "secret in {err}");
            }
        }
    }
}

#[test]
fn a_higher_layer_replaces_a_secret_value_with_a_file() {
    let dir = tempfile::tempdir().unwrap();
    let tok = write(dir.path(), "tok", "tok-from-file\n");
    let env = env_of(&[("FORKFLEET_NATS_TOKEN", "tok-from-env")]);
    let flags = Layer {
        nats: NatsLayer {
            token_file: Some(tok.clone()),
            ..NatsLayer::default()
        },
        ..Layer::default()
    };
    let c = Config::load(None, &env, flags).unwrap();
    let t = c.nats.token.unwrap();
    assert_eq!(t.value.expose(), "tok-from-file");
    assert_eq!(t.origin, Origin::Flag("--nats-token-file"));
}

#[test]
fn pricing_layers_per_model_and_bad_entries_name_model_and_key() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(
        dir.path(),
        "p.toml",
        "[pricing.\"scripted:a\"]\ninput_per_mtok = 1\noutput_per_mtok = 2.5\n\
         [pricing.\"openai:gpt-x\"]\ninput_per_mtok = 0.5\noutput_per_mtok = 1.0\ncached_per_mtok = 0.1\n",
    );
    // The environment replaces one model's whole entry and adds another.
    let env = env_of(&[(
        "FORKFLEET_PRICING",
        "\"openai:gpt-x\" = { input_per_mtok = 3.0, output_per_mtok = 4.0 }\n\"scripted:b\" = { input_per_mtok = 0, output_per_mtok = 0 }",
    )]);
    let c = Config::load(Some(&file), &env, Layer::default()).unwrap();
    let a = c.pricing["scripted:a"];
    assert_eq!((a.input_per_mtok, a.output_per_mtok), (1.0, 2.5));
    assert_eq!(a.cached_per_mtok, None);
    assert_eq!(c.pricing_origins["scripted:a"], Origin::File(file.clone()));
    let x = c.pricing["openai:gpt-x"];
    assert_eq!((x.input_per_mtok, x.output_per_mtok), (3.0, 4.0));
    assert_eq!(x.cached_per_mtok, None, "replaced whole, not per key");
    assert_eq!(
        c.pricing_origins["openai:gpt-x"],
        Origin::Env("FORKFLEET_PRICING".into())
    );
    assert_eq!(c.pricing["scripted:b"].output_per_mtok, 0.0);
    let shown = c.render();
    assert!(shown.contains("[pricing.\"scripted:a\"]"), "{shown}");
    assert!(shown.contains("output_per_mtok = 2.5"), "{shown}");

    for (text, expect) in [
        (
            "[pricing.\"m:x\"]\ninput_per_mtok = -1\noutput_per_mtok = 1\n",
            &["[pricing.\"m:x\"]", "`input_per_mtok`", ">= 0", "-1"][..],
        ),
        (
            "[pricing.\"m:x\"]\ninput_per_mtok = nan\noutput_per_mtok = 1\n",
            &["m:x", "`input_per_mtok`", "finite"],
        ),
        (
            "[pricing.\"m:x\"]\ninput_per_mtok = 1\noutput_per_mtok = inf\n",
            &["m:x", "`output_per_mtok`", "finite"],
        ),
        (
            "[pricing.\"m:y\"]\ninput_per_mtok = 1\n",
            &["m:y", "missing field `output_per_mtok`"],
        ),
        (
            "[pricing.\"m:y\"]\ninput_per_mtok = 1\noutput_per_mtok = 1\ncached = 1\n",
            &["m:y", "unknown field `cached`", "cached_per_mtok"],
        ),
        (
            "[pricing.\"m:z\"]\ninput_per_mtok = \"cheap\"\noutput_per_mtok = 1\n",
            &["m:z", "invalid type", "\"cheap\""],
        ),
        (
            "[pricing]\n\"m:w\" = 3\n",
            &["m:w", "invalid type: integer `3`"],
        ),
    ] {
        let bad = write(dir.path(), "bad.toml", text);
        let err = Config::load(Some(&bad), &env_of(&[]), Layer::default())
            .unwrap_err()
            .to_string();
        for e in expect {
            assert!(err.contains(e), "{text}: expected `{e}` in {err}");
        }
        assert!(err.contains("bad.toml"), "{err}");
    }
    let err = Config::load(
        None,
        &env_of(&[("FORKFLEET_PRICING", "not toml at all")]),
        Layer::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("FORKFLEET_PRICING"), "{err}");
}

#[test]
fn urls_are_redacted() {
    assert_eq!(redact_url("nats://h:4222"), "nats://h:4222");
    assert_eq!(
        redact_url("nats://u:p@h:4222/x"),
        "nats://<redacted>@h:4222/x"
    );
    assert_eq!(redact_url("tls://tok@h"), "tls://<redacted>@h");
    // Every URL of a list: the second one's password must not show.
    assert_eq!(
        redact_url("nats://a:1,nats://u:p@b:2"),
        "nats://a:1,nats://<redacted>@b:2"
    );
}

#[test]
fn roles_identity_replicas_and_access() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(
        dir.path(),
        "ff.toml",
        "[nats]\nurl = \"nats://h:4222\"\nidentity = \"alice\"\nprovision = false\nreplicas = 3\n[access.\"bob\"]\naccounts = [\"team-a\", \"team-b\"]\n",
    );
    let c = Config::load(Some(&file), &env_of(&[]), Layer::default()).unwrap();
    assert_eq!(c.api_subject(), "client.alice");
    let client = c.nats_config_for(Role::Client).unwrap();
    assert_eq!(
        client.inbox_prefix.as_deref(),
        Some("_INBOX_ff.client.alice")
    );
    assert!(!client.provision);
    assert_eq!(client.replicas, 3);
    // The coordinator always provisions, with its own inbox.
    let coordinator = c.nats_config_for(Role::Coordinator).unwrap();
    assert!(coordinator.provision);
    assert_eq!(
        coordinator.inbox_prefix.as_deref(),
        Some("_INBOX_ff.coordinator")
    );
    assert_eq!(
        c.access["bob"].iter().cloned().collect::<Vec<_>>(),
        vec!["team-a".to_string(), "team-b".to_string()]
    );
    let shown = c.render();
    assert!(shown.contains("identity = \"alice\""), "{shown}");
    assert!(shown.contains("[access.\"bob\"]"), "{shown}");

    // No identity: the admin subject, the library's inboxes; the environment sets them.
    let plain = Config::load(
        None,
        &env_of(&[("FORKFLEET_NATS_URL", "nats://h")]),
        Layer::default(),
    )
    .unwrap();
    assert_eq!(plain.api_subject(), "coordinator");
    assert_eq!(
        plain.nats_config_for(Role::Client).unwrap().inbox_prefix,
        None
    );
    assert!(plain.nats_config_for(Role::Worker).unwrap().provision);
    let env = env_of(&[
        ("FORKFLEET_NATS_IDENTITY", "bob"),
        ("FORKFLEET_NATS_REPLICAS", "5"),
        ("FORKFLEET_NATS_PROVISION", "no"),
    ]);
    let c = Config::load(None, &env, Layer::default()).unwrap();
    assert_eq!(c.api_subject(), "client.bob");
    assert_eq!(c.nats.replicas.value, 5);
    assert!(!c.nats.provision.value);

    // Mistakes name the key, the value and where it came from.
    for (vars, key) in [
        (vec![("FORKFLEET_NATS_IDENTITY", "a.b")], "nats.identity"),
        (vec![("FORKFLEET_NATS_REPLICAS", "0")], "nats.replicas"),
        (vec![("FORKFLEET_NATS_REPLICAS", "6")], "nats.replicas"),
    ] {
        let err = Config::load(None, &env_of(&vars), Layer::default()).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains(key), "{msg}");
        assert!(msg.contains("FORKFLEET_NATS_"), "{msg}");
    }
    let err = Config::load(
        None,
        &env_of(&[("FORKFLEET_NATS_PROVISION", "maybe")]),
        Layer::default(),
    )
    .unwrap_err();
    assert!(err.to_string().contains("true or false"), "{err}");
    let bad = write(dir.path(), "bad.toml", "[access.\"a.b\"]\naccounts = []\n");
    let err = Config::load(Some(&bad), &env_of(&[]), Layer::default()).unwrap_err();
    assert!(err.to_string().contains("client identity `a.b`"), "{err}");
    let bad = write(
        dir.path(),
        "bad2.toml",
        "[access.\"a\"]\naccounts = [\"../x\"]\n",
    );
    let err = Config::load(Some(&bad), &env_of(&[]), Layer::default()).unwrap_err();
    assert!(err.to_string().contains("account name `../x`"), "{err}");
}

#[test]
fn a_user_in_the_url_and_another_auth_method_is_an_error_naming_both() {
    let env = env_of(&[
        ("FORKFLEET_NATS_URL", "nats://u:pw@h:4222"),
        ("FORKFLEET_NATS_TOKEN", "tok"),
    ]);
    let err = Config::load(None, &env, Layer::default())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("a user in the URL from environment variable FORKFLEET_NATS_URL"),
        "{err}"
    );
    assert!(
        err.contains("token from environment variable FORKFLEET_NATS_TOKEN"),
        "{err}"
    );
    assert!(!err.contains("pw@"), "{err}");
    let env = env_of(&[
        ("FORKFLEET_NATS_URL", "nats://u:pw@h:4222"),
        ("FORKFLEET_NATS_USER", "v"),
    ]);
    let err = Config::load(None, &env, Layer::default())
        .unwrap_err()
        .to_string();
    assert!(err.contains("user `v` from"), "{err}");
    // The URL's user alone is fine, and redacted.
    let env = env_of(&[("FORKFLEET_NATS_URL", "nats://u:urlsecret@h:4222")]);
    let c = Config::load(None, &env, Layer::default()).unwrap();
    let shown = c.render();
    assert!(!shown.contains("urlsecret"), "{shown}");
}

#[test]
fn the_model_catalogue_is_layered_checked_and_printed_without_keys() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(
        dir.path(),
        "ff.toml",
        "[models.\"openai:gpt-4o\"]\nbase_url = \"https://api.openai.com/v1\"\napi_key_env = \"OPENAI_API_KEY\"\nmodel = \"gpt-4o-2024-08-06\"\ntimeout_s = 60\nmax_retries = 3\n\
         [models.\"anthropic:claude\"]\napi_key_file = \"secrets/anthropic\"\n\
         [model_hosts]\nallow = [\"127.0.0.1\", \"llm.internal:8080\"]\n",
    );
    let env = env_of(&[
        (
            "FORKFLEET_MODELS",
            "\"openai:local\" = { base_url = \"http://127.0.0.1:8080/v1\" }",
        ),
        ("OPENAI_API_KEY", "sk-never-printed"),
    ]);
    let c = Config::load(Some(&file), &env, Layer::default()).unwrap();
    let cat = c.catalogue();
    assert_eq!(
        cat.models.keys().collect::<Vec<_>>(),
        ["anthropic:claude", "openai:gpt-4o", "openai:local"]
    );
    let gpt = &cat.models["openai:gpt-4o"];
    assert_eq!(gpt.model.as_deref(), Some("gpt-4o-2024-08-06"));
    assert_eq!((gpt.timeout_s, gpt.max_retries), (Some(60.0), Some(3)));
    assert_eq!(
        cat.models["anthropic:claude"].api_key_file,
        Some(dir.path().join("secrets/anthropic")),
        "relative to the file"
    );
    assert_eq!(cat.allowed_hosts, ["127.0.0.1", "llm.internal:8080"]);
    assert_eq!(
        c.models_origins["openai:local"],
        Origin::Env("FORKFLEET_MODELS".into())
    );
    let printed = c.render();
    for says in [
        "[models.\"openai:gpt-4o\"]",
        "api_key_env = \"OPENAI_API_KEY\"  # the key's source",
        "[model_hosts]",
        "allow = [\"127.0.0.1\", \"llm.internal:8080\"]",
    ] {
        assert!(printed.contains(says), "{says:?} not in {printed}");
    }
    assert!(!printed.contains("sk-never-printed"));
    // The environment's allow-list replaces the file's.
    let env = env_of(&[("FORKFLEET_ALLOWED_MODEL_HOSTS", "10.0.0.1:80, gpu-box")]);
    let c = Config::load(Some(&file), &env, Layer::default()).unwrap();
    assert_eq!(c.model_hosts.value, ["10.0.0.1:80", "gpu-box"]);
    assert_eq!(
        c.model_hosts.origin,
        Origin::Env("FORKFLEET_ALLOWED_MODEL_HOSTS".into())
    );
}

#[test]
fn bad_catalogue_entries_name_the_model_and_the_key() {
    let dir = tempfile::tempdir().unwrap();
    for (text, says) in [
        (
            "[models.\"openai:x\"]\napi_key_env = \"A\"\napi_key_file = \"/k\"\n",
            &["[models.\"openai:x\"]", "not both"][..],
        ),
        (
            "[models.\"openai:x\"]\nbase_url = \"api.openai.com\"\n",
            &["[models.\"openai:x\"]", "base_url"],
        ),
        (
            "[models.\"openai:x\"]\napi_key = \"sk-inline\"\n",
            &["[models.\"openai:x\"]", "api_key"],
        ),
        (
            "[models.\"scripted:x\"]\nbase_url = \"http://x\"\n",
            &["[models.\"scripted:x\"]", "openai:NAME"],
        ),
        (
            "[model_hosts]\nallow = [\"http://evil.example/\"]\n",
            &["[model_hosts] allow", "host:port"],
        ),
    ] {
        let f = write(dir.path(), "bad.toml", text);
        let err = Config::load(Some(&f), &env_of(&[]), Layer::default())
            .unwrap_err()
            .to_string();
        for s in says {
            assert!(err.contains(s), "{s:?} not in {err}");
        }
    }
    let err = Config::load(
        None,
        &env_of(&[("FORKFLEET_MODELS", "not toml")]),
        Layer::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("FORKFLEET_MODELS"), "{err}");
}

#[test]
fn lease_ttl_and_connect_timeout_are_layered_and_checked() {
    let c = Config::load(None, &env_of(&[]), Layer::default()).unwrap();
    assert_eq!(c.lease_ttl.value, DEFAULT_LEASE_TTL);
    assert_eq!(c.nats.connect_timeout.value, DEFAULT_CONNECT_TIMEOUT);
    let dir = tempfile::tempdir().unwrap();
    let file = write(
        dir.path(),
        "c.toml",
        "[nats]\nurl = \"nats://h:4222\"\nconnect_timeout_s = 7\n[coordinator]\nlease_ttl_s = 5\n",
    );
    let env = env_of(&[("FORKFLEET_COORDINATOR_LEASE_TTL_S", "3")]);
    let c = Config::load(Some(&file), &env, Layer::default()).unwrap();
    assert_eq!(c.lease_ttl.value, Duration::from_secs(3));
    assert_eq!(
        c.lease_ttl.origin,
        Origin::Env("FORKFLEET_COORDINATOR_LEASE_TTL_S".into())
    );
    assert_eq!(
        c.nats_config("x").unwrap().connect_timeout,
        Duration::from_secs(7)
    );
    let rendered = c.render();
    assert!(
        rendered.contains("[coordinator]\nlease_ttl_s = 3"),
        "{rendered}"
    );
    assert!(rendered.contains("connect_timeout_s = 7"), "{rendered}");
    let zero = env_of(&[("FORKFLEET_COORDINATOR_LEASE_TTL_S", "0")]);
    let err = Config::load(None, &zero, Layer::default())
        .unwrap_err()
        .to_string();
    assert!(err.contains("coordinator.lease_ttl_s"), "{err}");
    assert!(err.contains("at least 1 second"), "{err}");
}

#[test]
fn telemetry_is_off_without_an_endpoint_and_disabled_wins() {
    let c = Config::load(None, &env_of(&[]), Layer::default()).unwrap();
    assert_eq!(c.telemetry.traces_endpoint(), None);
    assert_eq!(c.telemetry.log_format.value, LogFormat::Text);
    assert_eq!(
        c.telemetry.sampler.value,
        SamplerSetting::ParentBased(RootSampler::AlwaysOn)
    );
    let env = env_of(&[
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318/"),
        ("OTEL_SDK_DISABLED", "true"),
    ]);
    let c = Config::load(None, &env, Layer::default()).unwrap();
    assert_eq!(c.telemetry.traces_endpoint(), None);
}

#[test]
fn metrics_are_pushed_unless_the_metrics_exporter_says_they_are_scraped() {
    let with = |exporter: &str| {
        let env = env_of(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318"),
            ("OTEL_METRICS_EXPORTER", exporter),
        ]);
        Config::load(None, &env, Layer::default())
    };
    let c = with("").unwrap();
    assert_eq!(
        c.telemetry.metrics_endpoint().as_deref(),
        Some("http://c:4318/v1/metrics")
    );
    assert!(with("otlp").unwrap().telemetry.metrics_endpoint().is_some());
    for scraped in ["none", "prometheus", "NONE"] {
        let c = with(scraped).unwrap();
        assert_eq!(c.telemetry.metrics_endpoint(), None, "{scraped}");
        // Traces still go.
        assert!(c.telemetry.traces_endpoint().is_some(), "{scraped}");
    }
    assert!(with("otlp,prometheus")
        .unwrap()
        .telemetry
        .metrics_endpoint()
        .is_some());
    assert!(with("prometheus, console")
        .unwrap()
        .telemetry
        .metrics_endpoint()
        .is_none());
    let err = with("jaeger").unwrap_err().to_string();
    assert!(
        err.contains("OTEL_METRICS_EXPORTER") && err.contains("otlp") && err.contains("none"),
        "{err}"
    );
}

#[test]
fn the_traces_endpoint_wins_over_the_base_one_which_gets_the_http_path() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(
        dir.path(),
        "c.toml",
        "[telemetry]\notlp_endpoint = \"http://file:4318\"\nservice_name = \"svc\"\n",
    );
    let c = Config::load(Some(&file), &env_of(&[]), Layer::default()).unwrap();
    assert_eq!(
        c.telemetry.traces_endpoint().as_deref(),
        Some("http://file:4318/v1/traces")
    );
    assert_eq!(
        c.telemetry.metrics_endpoint().as_deref(),
        Some("http://file:4318/v1/metrics")
    );
    let env = env_of(&[
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://env:4318"),
        (
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            "http://tempo:4318/custom",
        ),
    ]);
    let c = Config::load(Some(&file), &env, Layer::default()).unwrap();
    assert_eq!(
        c.telemetry.traces_endpoint().as_deref(),
        Some("http://tempo:4318/custom")
    );
    assert_eq!(
        c.telemetry.metrics_endpoint().as_deref(),
        Some("http://env:4318/v1/metrics")
    );
    assert_eq!(
        c.telemetry.otlp_endpoint.as_ref().unwrap().origin,
        Origin::Env("OTEL_EXPORTER_OTLP_ENDPOINT".into())
    );
    assert_eq!(c.telemetry.service_name_or("x"), "svc");
    // gRPC takes the base endpoint as it is.
    let env = env_of(&[
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://env:4317"),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
    ]);
    let c = Config::load(None, &env, Layer::default()).unwrap();
    assert_eq!(
        c.telemetry.traces_endpoint().as_deref(),
        Some("http://env:4317")
    );
}

#[test]
fn otlp_headers_and_resource_attributes_merge_by_key_and_headers_never_render() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(
        dir.path(),
        "c.toml",
        "[telemetry]\notlp_headers = { \"x-a\" = \"file-a\", \"x-b\" = \"file-b\" }\nresource_attributes = { team = \"t\" }\n",
    );
    let env = env_of(&[
        ("OTEL_EXPORTER_OTLP_HEADERS", "x-b=env%20b, x-c=env-c"),
        ("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=prod"),
    ]);
    let c = Config::load(Some(&file), &env, Layer::default()).unwrap();
    let h = &c.telemetry.otlp_headers;
    assert_eq!(h["x-a"].value.expose(), "file-a");
    assert_eq!(h["x-b"].value.expose(), "env b");
    assert_eq!(h["x-c"].value.expose(), "env-c");
    assert_eq!(c.telemetry.resource_attributes.len(), 2);
    let text = c.render();
    for secret in ["file-a", "file-b", "env b", "env-c", "env%20b"] {
        assert!(!text.contains(secret), "{text}");
    }
    assert!(text.contains("\"x-b\" = \"<redacted>\""), "{text}");
}

#[test]
fn bad_telemetry_values_name_what_is_valid() {
    for (var, value, expected) in [
        (
            "OTEL_EXPORTER_OTLP_PROTOCOL",
            "http/json",
            "grpc or http/protobuf",
        ),
        (
            "OTEL_TRACES_SAMPLER",
            "jaeger_remote",
            "parentbased_traceidratio",
        ),
        ("OTEL_TRACES_SAMPLER_ARG", "2", "a ratio from 0 to 1"),
        ("OTEL_EXPORTER_OTLP_HEADERS", "x-key", "name=value pairs"),
        ("OTEL_RESOURCE_ATTRIBUTES", "=v", "key=value pairs"),
        (
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "collector:4318",
            "an http:// or https:// URL",
        ),
        ("FORKFLEET_LOG_FORMAT", "xml", "text or json"),
        ("OTEL_SDK_DISABLED", "maybe", "true or false"),
    ] {
        let e = Config::load(None, &env_of(&[(var, value)]), Layer::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains(expected), "{var}={value}: {e}");
    }
    // A header's value never shows in an error.
    let e = Config::load(
        None,
        &env_of(&[("OTEL_EXPORTER_OTLP_HEADERS", "x-key=sec%zzret")]),
        Layer::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(!e.contains("sec"), "{e}");
}

#[test]
fn api_tokens_come_from_a_tokens_file_too() {
    let dir = tempfile::tempdir().unwrap();
    let hash = |c: char| c.to_string().repeat(64);
    // As `forkfleet cluster token` prints entries, appended to a file (a mounted Secret).
    write(
        dir.path(),
        "tokens.toml",
        &format!(
            "[http.tokens.\"ci\"]\nsha256 = \"{}\"\nscopes = [\"write\"]\naccounts = [\"team-a\"]\n\n[http.tokens.\"ops\"]\nsha256 = \"{}\"\nscopes = [\"admin\"]\n",
            hash('a'),
            hash('b')
        ),
    );
    let file = write(
        dir.path(),
        "forkfleet.toml",
        &format!(
            "[http]\ntokens_file = \"tokens.toml\"\n\n[http.tokens.\"dash\"]\nsha256 = \"{}\"\nscopes = [\"read\"]\n",
            hash('c')
        ),
    );
    let c = Config::load(Some(&file), &env_of(&[]), Layer::default()).unwrap();
    assert_eq!(
        c.http_tokens.keys().collect::<Vec<_>>(),
        ["ci", "dash", "ops"],
        "the file's entries join the config's (its path relative to the config file)"
    );
    assert!(c.http_tokens["ci"].accounts.is_some());

    // From the environment (the chart's coordinator pod), without a config file.
    let tokens = dir.path().join("tokens.toml");
    let c = Config::load(
        None,
        &env_of(&[("FORKFLEET_HTTP_TOKENS_FILE", tokens.to_str().unwrap())]),
        Layer::default(),
    )
    .unwrap();
    assert_eq!(c.http_tokens.keys().collect::<Vec<_>>(), ["ci", "ops"]);

    // A name in both is refused, naming it and both places.
    let both = write(
        dir.path(),
        "both.toml",
        &format!(
            "[http]\ntokens_file = \"tokens.toml\"\n\n[http.tokens.\"ci\"]\nsha256 = \"{}\"\nscopes = [\"read\"]\n",
            hash('d')
        ),
    );
    let err = Config::load(Some(&both), &env_of(&[]), Layer::default())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("[http.tokens.\"ci\"]") && err.contains("tokens.toml"),
        "{err}"
    );

    // Anything but token entries, a bad entry, a missing file: errors naming the file.
    for (text, words) in [
        ("data = \"x\"\n", "unknown field `data`"),
        ("[http]\naudit_log = \"x\"\n", "unknown field `audit_log`"),
        (
            "[http.tokens.\"x\"]\nsha256 = \"nothex\"\nscopes = [\"read\"]\n",
            "64 hex digits",
        ),
    ] {
        write(dir.path(), "bad-tokens.toml", text);
        let err = Config::load(
            None,
            &env_of(&[(
                "FORKFLEET_HTTP_TOKENS_FILE",
                dir.path().join("bad-tokens.toml").to_str().unwrap(),
            )]),
            Layer::default(),
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains(words), "{text}: {err}");
    }
    let err = Config::load(
        None,
        &env_of(&[("FORKFLEET_HTTP_TOKENS_FILE", "/nonexistent/tokens.toml")]),
        Layer::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("/nonexistent/tokens.toml"), "{err}");
}
