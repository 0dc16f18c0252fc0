//! # forkfleet-node
//!
//! The services assembled in one process, from their crates and without the CLI's
//! configuration (the `forkfleet` package turns its settings into the arguments here):
//!
//! ## Layout
//! - [`embedded`]: the single-machine mode: a coordinator and in-process workers on the
//!   local bus, the run store under a data directory, and a `forkfleet_client::Client`
//!   that calls the coordinator in process.
//! - [`serve`]: opening a run store, connecting to NATS, and serving a coordinator's API
//!   over a bus until told to stop ([`serve::Watch`] hears when it starts and stops).
//!
//! The benchmarks (`forkfleet-bench`) and the binary both start systems through it; the
//! coordinator and worker crates never depend on each other, and this one joins them.

pub mod embedded;
pub mod serve;
