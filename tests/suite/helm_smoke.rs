//! The chart's `helm test` (`deploy/helm/forkfleet/templates/tests/smoke.yaml`) runs
//! `files/smoke/smoke.sh` in a pod; here the same script runs against a real cluster on
//! this machine (a nats-server, a coordinator, a worker), as that pod would: the cluster
//! from `$FORKFLEET_CONFIG`, `forkfleet` on the `PATH`.

use super::fleet::{Fleet, Options};
use std::path::{Path, PathBuf};
use std::process::Output;

/// `sh smoke.sh` with `FORKFLEET_CONFIG` naming a config file of `fleet`'s NATS URL, the
/// test binary's directory first on the `PATH`, and `SMOKE_TIMEOUT_S`.
fn smoke(fleet: &Fleet, timeout_s: &str) -> Output {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let script = root.join("deploy/helm/forkfleet/files/smoke/smoke.sh");
    let config = fleet.dir.path().join("smoke-config.toml");
    std::fs::write(&config, format!("[nats]\nurl = \"{}\"\n", fleet.url())).unwrap();
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_forkfleet"));
    let path = format!(
        "{}:{}",
        bin.parent().unwrap().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    std::process::Command::new("sh")
        .env_clear()
        .arg(&script)
        .env("PATH", path)
        .env("HOME", fleet.dir.path())
        .env("TMPDIR", fleet.dir.path())
        .env("FORKFLEET_CONFIG", &config)
        .env("SMOKE_TIMEOUT_S", timeout_s)
        .env("RUST_LOG", "warn")
        .output()
        .unwrap()
}

#[test]
fn the_charts_helm_test_passes_on_a_working_cluster_and_fails_without_workers() {
    let mut fleet = Fleet::start(1, 2, Options::default());
    let out = smoke(&fleet, "120");
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(out.status.code(), Some(0), "{said}\n{}", fleet.logs());
    assert!(said.contains("smoke.txt written by a worker"), "{said}");

    // No worker: the fork never ends, the watch gives up, the test fails.
    for w in &mut fleet.workers {
        w.kill();
    }
    let out = smoke(&fleet, "3");
    assert_ne!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}
