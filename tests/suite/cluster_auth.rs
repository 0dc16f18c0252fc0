//! `forkfleet cluster auth`'s files (`forkfleet_bus::auth`): every role's, the seeds secret,
//! the config files loadable as forkfleet's own, nothing overwritten without `--force`.

use forkfleet::auth::{generate, AuthError, AuthPlan};

fn plan() -> AuthPlan {
    AuthPlan {
        clients: vec!["alice".into(), "bob".into()],
        pools: vec!["default".into()],
        url: Some("nats://nats:4222".into()),
        passwords_from: None,
        tls_names: Vec::new(),
        keep_existing: false,
    }
}

#[test]
fn writes_every_role_and_refuses_to_overwrite() {
    let dir = tempfile::tempdir().unwrap();
    let files = generate(&plan(), dir.path(), false).unwrap();
    let names: Vec<String> = files
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    for want in [
        "auth.conf",
        "coordinator.nk",
        "coordinator.toml",
        "worker.nk",
        "worker.toml",
        "admin.nk",
        "client-alice.nk",
        "client-alice.toml",
        "client-bob.toml",
    ] {
        assert!(names.contains(&want.to_string()), "{want} in {names:?}");
    }
    let conf = std::fs::read_to_string(dir.path().join("auth.conf")).unwrap();
    assert_eq!(conf.matches("nkey: \"U").count(), 5, "{conf}");
    assert!(conf.contains("\"ff.api.client.alice\""), "{conf}");
    assert!(conf.contains("\"_INBOX_ff.client.bob.>\""), "{conf}");
    // Seeds are secrets: mode 0600, and never in auth.conf.
    let seed = std::fs::read_to_string(dir.path().join("client-alice.nk")).unwrap();
    assert!(seed.starts_with("SU"), "{seed}");
    assert!(!conf.contains(seed.trim()));
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt as _;
        let mode = std::fs::metadata(dir.path().join("worker.nk"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
    }
    let alice = std::fs::read_to_string(dir.path().join("client-alice.toml")).unwrap();
    let layer: forkfleet::config::Layer = toml::from_str(&alice).unwrap();
    assert_eq!(layer.nats.identity.as_deref(), Some("alice"));
    assert_eq!(layer.nats.provision, Some(false));
    assert_eq!(layer.nats.url.as_deref(), Some("nats://nats:4222"));
    let worker: forkfleet::config::Layer =
        toml::from_str(&std::fs::read_to_string(dir.path().join("worker.toml")).unwrap()).unwrap();
    assert_eq!(worker.pool.as_deref(), Some("default"));
    // A second run refuses, and changes nothing; --force replaces.
    let err = generate(&plan(), dir.path(), false).unwrap_err();
    assert!(matches!(err, AuthError::Exists(_)), "{err}");
    assert!(err.to_string().contains("--force"), "{err}");
    assert_eq!(
        std::fs::read_to_string(dir.path().join("client-alice.nk")).unwrap(),
        seed
    );
    generate(&plan(), dir.path(), true).unwrap();
    assert_ne!(
        std::fs::read_to_string(dir.path().join("client-alice.nk")).unwrap(),
        seed
    );
}

#[test]
fn bad_identities_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    for bad in ["a.b", "", "x y"] {
        let p = AuthPlan {
            clients: vec![bad.into()],
            ..plan()
        };
        let err = generate(&p, dir.path(), false).unwrap_err();
        assert!(err.to_string().contains("client identity"), "{err}");
    }
    let twice = AuthPlan {
        clients: vec!["a".into(), "a".into()],
        ..plan()
    };
    assert!(generate(&twice, dir.path(), false)
        .unwrap_err()
        .to_string()
        .contains("twice"));
    assert!(std::fs::read_dir(dir.path()).unwrap().next().is_none());
}

#[test]
fn passwords_from_a_directory_write_only_auth_conf_with_every_roles_permissions() {
    let dir = tempfile::tempdir().unwrap();
    let secrets = dir.path().join("users");
    std::fs::create_dir(&secrets).unwrap();
    let hash = "$2a$10$WEylJbGBirvyUuS644Bw.uUQj2EQirDXEaLskpZK7Q4KdhKBBLifa";
    for (who, pw) in [
        ("coordinator", "c0ord\n"),
        ("worker", hash),
        ("admin", "adm1n\r\n"),
        ("client-alice", "al1ce"),
        ("client-bob", "b0b"),
    ] {
        std::fs::write(secrets.join(who), pw).unwrap();
    }
    let out = dir.path().join("out");
    let p = AuthPlan {
        url: None,
        passwords_from: Some(secrets.clone()),
        ..plan()
    };
    let files = generate(&p, &out, false).unwrap();
    assert_eq!(files, vec![out.join("auth.conf")]);
    assert_eq!(std::fs::read_dir(&out).unwrap().count(), 1);
    let conf = std::fs::read_to_string(out.join("auth.conf")).unwrap();
    assert!(!conf.contains("nkey"), "{conf}");
    assert!(
        conf.contains("{ user: \"coordinator\", password: \"c0ord\", permissions: {"),
        "{conf}"
    );
    assert!(
        conf.contains(&format!(
            "{{ user: \"worker\", password: \"{hash}\", permissions"
        )),
        "{conf}"
    );
    assert!(
        conf.contains("{ user: \"admin\", password: \"adm1n\" }"),
        "{conf}"
    );
    assert!(conf.contains("\"ff.api.client.alice\""), "{conf}");
    assert!(conf.contains("\"_INBOX_ff.client.bob.>\""), "{conf}");
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt as _;
        let mode = std::fs::metadata(out.join("auth.conf"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600, "it holds the passwords");
    }
    // A missing identity's file, or a password that auth.conf could not hold as written,
    // is refused naming it, and nothing is written.
    let empty = dir.path().join("empty");
    std::fs::remove_file(secrets.join("client-bob")).unwrap();
    let err = generate(&p, &empty, false).unwrap_err();
    assert!(err.to_string().contains("`client-bob`"), "{err}");
    assert!(err.to_string().contains("--passwords-from"), "{err}");
    for bad in ["a\"b", "a b", "a\\b", "", "\n", "two\nlines", "é"] {
        std::fs::write(secrets.join("client-bob"), bad).unwrap();
        let err = generate(&p, &empty, false).unwrap_err();
        assert!(
            matches!(err, AuthError::Invalid(_)) && err.to_string().contains("`client-bob`"),
            "{bad:?}: {err}"
        );
    }
    assert!(!empty.exists());
}
