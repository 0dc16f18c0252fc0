//! The configuration's tests: the layers' precedence, the file, the environment, secrets,
//! NATS auth and TLS mistakes, pricing and URL redaction.

use super::*;
use forkfleet_bus::nats::{redact_url, NatsAuth};
use std::collections::HashMap;

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
        "[nats]\nurl = \"nats://u:urlsecret@h:4222\"\nuser = \"alice\"\npassword = \"from-file-secret\"\n",
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
    assert!(!shown.contains("urlsecret"), "{shown}");
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
