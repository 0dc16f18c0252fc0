//! TLS to NATS with real processes: a nats-server with `--tls` (and `--tlsverify`, which
//! asks every client for a certificate), certificates made by `openssl` for the test, a
//! coordinator, workers and clients given `tls://` URLs. Any `tls://` URL used to panic
//! every process (rustls found two crypto providers and chose none).

use super::fleet::{Fleet, Options};
use super::harness::{path_str, Example};
use std::path::PathBuf;
use std::process::Command;

/// A CA, a server certificate for 127.0.0.1 and a client certificate, all PEM.
pub(super) struct Certs {
    dir: tempfile::TempDir,
}

impl Certs {
    pub(super) fn make() -> Certs {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let openssl = |args: &[&str]| {
            let out = Command::new("openssl")
                .args(args)
                .current_dir(d)
                .output()
                .expect("openssl runs (Debian: apt-get install openssl)");
            assert!(
                out.status.success(),
                "openssl {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        openssl(&[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=forkfleet test CA",
            "-keyout",
            "ca.key",
            "-out",
            "ca.pem",
        ]);
        std::fs::write(
            d.join("server.ext"),
            "subjectAltName=IP:127.0.0.1,DNS:localhost\n",
        )
        .unwrap();
        std::fs::write(d.join("client.ext"), "extendedKeyUsage=clientAuth\n").unwrap();
        for (name, ext) in [("server", "server.ext"), ("client", "client.ext")] {
            openssl(&[
                "req",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-subj",
                &format!("/CN={name}"),
                "-keyout",
                &format!("{name}.key"),
                "-out",
                &format!("{name}.csr"),
            ]);
            openssl(&[
                "x509",
                "-req",
                "-in",
                &format!("{name}.csr"),
                "-CA",
                "ca.pem",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-days",
                "2",
                "-extfile",
                ext,
                "-out",
                &format!("{name}.pem"),
            ]);
        }
        Certs { dir }
    }

    pub(super) fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn arg(&self, name: &str) -> String {
        path_str(&self.path(name)).to_string()
    }
}

/// A fork of the quickstart on `fleet`, to the end: every branch `done`.
fn a_fork_finishes(fleet: &Fleet) {
    let ex = Example::quickstart();
    let id = fleet.create(&ex.spec());
    let doc = fleet.watch(&id);
    let states: Vec<&str> = doc["branches"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["state"].as_str().unwrap())
        .collect();
    assert!(
        !states.is_empty() && states.iter().all(|s| *s == "done"),
        "{states:?}\n{}",
        fleet.logs()
    );
}

fn no_panic(fleet: &Fleet) {
    let logs = fleet.logs();
    assert!(!logs.contains("panicked"), "{logs}");
}

#[test]
fn a_tls_cluster_runs_a_fork() {
    let certs = Certs::make();
    let (cert, key, ca) = (
        certs.arg("server.pem"),
        certs.arg("server.key"),
        certs.arg("ca.pem"),
    );
    let fleet = Fleet::start(
        2,
        2,
        Options {
            nats_args: &["--tls", "--tlscert", &cert, "--tlskey", &key],
            connect_args: &["--tls-ca", &ca],
            scheme: Some("tls"),
            ..Options::default()
        },
    );
    a_fork_finishes(&fleet);
    no_panic(&fleet);

    // A client that does not trust the server's CA is refused with an error naming TLS,
    // not a panic.
    let out = tls_client(&fleet, &["--nats-connect-timeout-s", "2"]);
    assert_ne!(out.code, Some(0), "{}", out.stderr);
    assert!(!out.stderr.contains("panicked"), "{}", out.stderr);
    assert!(
        out.stderr.to_lowercase().contains("tls") || out.stderr.contains("certificate"),
        "{}",
        out.stderr
    );
}

/// `fork ls` on `fleet` by its `tls://` URL, with `extra` arguments only (no TLS settings
/// of the fleet's).
fn tls_client(fleet: &Fleet, extra: &[&str]) -> super::fleet::Ran {
    let url = format!("tls://127.0.0.1:{}", fleet.nats.port());
    let mut args = vec!["fork", "ls", "--nats", url.as_str()];
    args.extend_from_slice(extra);
    super::fleet::run(fleet.dir.path(), &args)
}

#[test]
fn a_mutual_tls_cluster_runs_a_fork_and_refuses_a_client_without_a_certificate() {
    let certs = Certs::make();
    let (cert, key, ca) = (
        certs.arg("server.pem"),
        certs.arg("server.key"),
        certs.arg("ca.pem"),
    );
    let (client_cert, client_key) = (certs.arg("client.pem"), certs.arg("client.key"));
    let fleet = Fleet::start(
        1,
        2,
        Options {
            nats_args: &[
                "--tls",
                "--tlscert",
                &cert,
                "--tlskey",
                &key,
                "--tlsverify",
                "--tlscacert",
                &ca,
            ],
            connect_args: &[
                "--tls-ca",
                &ca,
                "--tls-cert",
                &client_cert,
                "--tls-key",
                &client_key,
            ],
            scheme: Some("tls"),
            ..Options::default()
        },
    );
    a_fork_finishes(&fleet);
    no_panic(&fleet);

    // Trusting the CA but holding no certificate: refused by the server, a clear error.
    let out = tls_client(&fleet, &["--tls-ca", &ca, "--nats-connect-timeout-s", "2"]);
    assert_ne!(out.code, Some(0), "{}", out.stderr);
    assert!(!out.stderr.contains("panicked"), "{}", out.stderr);
    // A key without its certificate is bad input, named.
    let out = tls_client(&fleet, &["--tls-ca", &ca, "--tls-key", &client_key]);
    assert_eq!(out.code, Some(2), "{}", out.stderr);
    assert!(
        out.stderr.contains("--tls-cert") || out.stderr.contains("client_cert"),
        "{}",
        out.stderr
    );
}
