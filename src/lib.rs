//! # forkfleet
//!
//! Fork one agent run into many branches, run them on a fleet of workers, keep the spend
//! under caps, compare what every branch changed, and merge the winner back.
//!
//! The `forkfleet` package is the binary (`src/main.rs` and `src/cli/`, one file per
//! command group: `fork` with `fork/turns` and `fork/resolve`, `run`, `runs`, `account`,
//! `checkpoint`, `workers`, `log`, `services`; `bench` is `forkfleet-bench`'s) and this
//! thin library, which holds what the binary and the integration tests both start:
//!
//! ## Layout
//! - [`config`]: layered configuration (defaults < TOML file < `FORKFLEET_*` < flags),
//!   NATS auth and TLS, secrets redacted; in `config/`: `layer` (the file, environment and
//!   flag layers as written), `secret`, `nats` (the NATS settings' checks and connection),
//!   `pricing`, `render` (`--print-config`) and `telemetry`.
//! - [`service`]: the cluster services' start-up from the configuration,
//!   `run_coordinator(config, shutdown)` (its NATS role, the lease loop, readiness) and
//!   `run_worker(config, shutdown)`.
//! - [`embedded`]: the `forkfleet-node` crate's: the single-machine mode, a coordinator
//!   and in-process workers on the local bus, the run store under a data directory, and a
//!   `forkfleet_client::Client` that calls the coordinator in process.
//! - [`http_api`]: the `forkfleet-http` crate: the HTTP API (`/api/v1`, docs/HTTP.md) and
//!   the console, every declared operation as a route, tokens and scopes, problem+json
//!   errors, SSE streams, the OpenAPI document, and a service's `/metrics`, `/healthz`
//!   and `/readyz` (`endpoint`).
//! - [`telemetry`]: the process's log lines and trace context.
//! - [`init`]: forkfleet as a container's PID 1: an init that runs forkfleet again as its
//!   child, passes it signals and reaps every orphan (ADR 43).
//! - [`auth`]: the `forkfleet-bus` crate's `forkfleet cluster auth`: the nats-server
//!   permissions and the credentials of each role (ADR 17).
//!
//! Everything a front end does around a coordinator (the API client, the workspace
//! upload, the fork directory, watching, rendering, the run workflow) is the
//! `forkfleet-client` crate; the types and pure logic are `forkfleet-shared`; the bus is
//! `forkfleet-bus`; the two services are `forkfleet-coordinator` and `forkfleet-worker`,
//! which never depend on each other; `forkfleet-node` joins them in one process.

pub use forkfleet_bus::auth;
pub mod config;
pub use forkfleet_http as http_api;
pub use forkfleet_node::embedded;
pub mod init;
pub mod service;
pub mod telemetry;

/// An error in the command line's input (an argument, a flag, a missing setting) that
/// the command itself found: exit code 2. Errors the client crate finds in the user's
/// input are `forkfleet_client::ClientError::BadInput`.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct BadInput(pub String);
