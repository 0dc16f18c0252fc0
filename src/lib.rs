//! # forkfleet
//!
//! Fork one agent run into many branches, run them on a fleet of workers, keep the spend
//! under caps, compare what every branch changed, and merge the winner back.
//!
//! ## Layout
//! - [`cli`]: the command line (`forkfleet run`, `coordinator`, `worker`, `fork ...`,
//!   `workers`, `log`, `bench`); thin: parse, configure, call the functions below.
//! - [`config`]: layered configuration (defaults < TOML file < `FORKFLEET_*` < flags),
//!   NATS auth and TLS, secrets redacted.
//! - [`service`]: the cluster services as library functions, `run_coordinator(config,
//!   shutdown)` and `run_worker(config, shutdown)`.
//! - [`remote`]: [`remote::Client`], which every client command uses: one
//!   method per API request, answered in process (embedded) or over the bus
//!   ([`remote::RemoteCoordinator`]).
//! - [`embedded`]: the single-machine mode: a coordinator and in-process workers on the
//!   local bus, with the run store under a data directory.
//! - [`client`]: what a client does around the coordinator: upload a workspace snapshot,
//!   apply a merge to a real directory.
//! - [`render`]: progress lines, tables and the `--json` documents.
//! - [`checkpoint_cmd`]: `checkpoint ...`: list, save, remove, rewind (a directory too),
//!   and new runs from a checkpoint.
//! - [`forkdir`]: the materialised fork directory (`.forkfleet/forks/<id>/` in the
//!   workspace: parent and every branch's version of the touched paths) and `fork open`.
//! - [`resolve_cmd`]: `fork resolve` and `run`'s resolve step: the report, the merge applied.
//! - [`bench`]: whole-system benchmarks.
//!
//! The crates below: `forkfleet-shared` (types and pure logic), `forkfleet-coordinator`
//! and `forkfleet-worker` (the two services, which never depend on each other).

pub mod config;
pub mod embedded;
pub mod service;
pub mod telemetry;

pub use forkfleet_client::BadInput;
