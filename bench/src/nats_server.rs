//! A `nats-server -js` of the bench's own: on a free loopback port, its JetStream store and
//! log in the bench's directory, killed when the guard is dropped (error paths included).
//!
//! The launcher is the shared one ([`forkfleet_bus::nats_server`], also behind the test
//! fixture); this adds the bench's context to its errors.

use anyhow::Context;
use forkfleet_bus::nats_server::LocalNatsServer;
use std::path::Path;

pub use forkfleet_bus::nats_server::tail;

/// A running `nats-server`; killed (and waited for) on drop.
#[derive(Debug)]
pub struct NatsServerGuard(LocalNatsServer);

impl NatsServerGuard {
    /// Start `nats-server -js -sd <dir>/nats-store -a 127.0.0.1 -p <free port>`, its log in
    /// `<dir>/nats-server.log`; returns once it greets a client (bounded). `bench` is the
    /// bench that asked (`fanout`, `budget`), named in the error.
    pub fn start(dir: &Path, bench: &str) -> anyhow::Result<NatsServerGuard> {
        LocalNatsServer::start(dir)
            .map(NatsServerGuard)
            .with_context(|| {
                format!(
                    "`forkfleet bench {bench} --bus nats` needs a nats-server of its own \
                 (`scripts/setup` installs one; or set FORKFLEET_NATS_SERVER); \
                 `forkfleet bench {bench} --bus local` runs without one"
                )
            })
    }

    /// `nats://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        self.0.url()
    }

    /// The server's process id.
    pub fn pid(&self) -> Option<u32> {
        self.0.pid()
    }
}
