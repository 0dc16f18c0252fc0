//! Layered configuration through the binary: file < environment < flags, secrets never
//! printed, unknown keys listed; and the client commands without a cluster (embedded).

use super::harness::{forkfleet_env, json, path_str, stderr, Example};

#[test]
fn print_config_layers_and_redacts() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("ff.toml");
    std::fs::write(
        &file,
        "pool = \"from-file\"\nconcurrency = 3\n[nats]\nurl = \"nats://file:4222\"\ntoken = \"file-token-secret\"\n",
    )
    .unwrap();
    let seed = dir.path().join("seed");
    std::fs::write(&seed, "SUSEEDSECRET\n").unwrap();
    let out = forkfleet_env(
        &[
            "worker",
            "--config",
            path_str(&file),
            "--concurrency",
            "9",
            "--print-config",
        ],
        &[
            ("FORKFLEET_CONCURRENCY", "5"),
            ("FORKFLEET_NATS_URL", "nats://env:4222"),
            ("FORKFLEET_DRAIN_GRACE_S", "12"),
        ],
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("pool = \"from-file\""), "{text}");
    assert!(
        text.contains("url = \"nats://env:4222\"  # environment variable FORKFLEET_NATS_URL"),
        "{text}"
    );
    assert!(
        text.contains("concurrency = 9  # flag --concurrency"),
        "{text}"
    );
    assert!(text.contains("drain_grace_s = 12"), "{text}");
    assert!(text.contains("token = \"<redacted>\""), "{text}");
    assert!(!text.contains("file-token-secret"), "{text}");

    // Two auth methods from different layers: an error naming both, no secret shown.
    let out = forkfleet_env(
        &[
            "coordinator",
            "--config",
            path_str(&file),
            "--nats-nkey-seed-file",
            path_str(&seed),
        ],
        &[],
    );
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(err.contains("more than one NATS auth method"), "{err}");
    assert!(err.contains("--nats-nkey-seed-file"), "{err}");
    assert!(
        !err.contains("SUSEEDSECRET") && !err.contains("file-token-secret"),
        "{err}"
    );

    // An unknown key lists the valid ones.
    std::fs::write(&file, "[nats]\nadress = \"x\"\n").unwrap();
    let out = forkfleet_env(&["fork", "ls", "--config", path_str(&file)], &[]);
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(
        err.contains("unknown field `adress`") && err.contains("creds_file"),
        "{err}"
    );

    // The services need a NATS URL.
    let out = forkfleet_env(&["worker"], &[]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("--nats URL"), "{}", stderr(&out));
}

#[test]
fn client_commands_on_the_embedded_store() {
    let ex = Example::quickstart();
    let data = ex.data();
    let data = path_str(&data);
    let env = [("FORKFLEET_DATA", data)];
    // Embedded, `fork create` runs the fork to the end here (the data dir from the env).
    let created = json(&forkfleet_env(
        &[
            "fork",
            "create",
            path_str(&ex.spec()),
            "--json",
            "--timeout-s",
            "60",
        ],
        &env,
    ));
    assert_eq!(created["state"], "settled");
    let id = created["fork_id"].as_str().unwrap();

    let watched = json(&forkfleet_env(&["fork", "watch", id, "--json"], &env));
    assert_eq!(watched["fork_id"], id);

    let t = json(&forkfleet_env(
        &["fork", "terminate", id, "tidy", "--json"],
        &env,
    ));
    assert_eq!(t["sent"], false);
    assert_eq!(t["state"], "done");

    let aborted = json(&forkfleet_env(&["fork", "abort", id, "--json"], &env));
    assert_eq!(aborted["state"], "aborted");
    assert_eq!(aborted["changed"], true);
    let out = forkfleet_env(&["fork", "abort", id], &env);
    assert_eq!(out.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&out.stdout).contains("already aborted"));

    let merge = forkfleet_env(&["fork", "merge", id, "--pick", "concise"], &env);
    assert_eq!(merge.status.code(), Some(2));
    assert!(stderr(&merge).contains("aborted"), "{}", stderr(&merge));
    assert!(ex.read("docs/legacy.md").is_some(), "nothing applied");

    // `workers` needs a cluster.
    let out = forkfleet_env(&["workers"], &env);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("--nats URL"), "{}", stderr(&out));
}
