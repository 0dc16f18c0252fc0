//! # forkfleet-client
//!
//! Everything a front end (the CLI, the terminal UI, the HTTP API and its console) does
//! around a coordinator, on top of `forkfleet-shared` alone: it never
//! reaches into the coordinator's or the workers' crates.
//!
//! ## Layout
//! - [`client`]: [`Client`], one method per API operation (the [`ApiClient`] trait the
//!   API declaration generates), over a [`Transport`]: the bus's request/reply
//!   ([`client::BusTransport`]) or a handler in this process ([`client::InProcess`], the
//!   embedded mode).
//! - [`local`]: the API over a Unix socket in the data directory, so other processes reach
//!   an embedded coordinator while it holds the run store (server loop, transport, blobs).
//! - [`error`]: [`ClientError`], the crate's one error enum, and its kind (which gives
//!   the CLI's exit code).
//! - [`workspace`]: snapshot and upload a workspace; apply a merge or a rewind to a real
//!   directory.
//! - [`forkdir`]: the materialised fork directory (`.forkfleet/forks/<id>/`), split by job:
//!   names and paths, layout, sync, live sync, cleanup after a merge, `fork open` with its
//!   diff tools, the terminal diff.
//! - [`watch`]: following a fork while it runs (bounded watches, progress lines).
//! - [`render`]: tables, texts and `--json` documents of forks, costs, diffs and merges.
//! - [`git`]: the user's git repository: the commit a workspace is at when a fork is made,
//!   a winner committed on a new branch from it (plumbing only).
//! - [`changes`]: one branch's changes with their bytes, as a git patch or a commit.
//! - [`prompt`]: one line from the person at the terminal, off the async runtime.
//! - [`run`]: the run workflow (create from a spec, follow, merge or resolve, apply) as
//!   library functions; [`run::run_fork`] is the whole of `forkfleet run`.
//! - [`rundiff`]: `runs diff A B`: where two runs' events part and how their files differ.
//!
//! A typical embedded front end: `Client::in_process(coordinator_handle, bus)`; a cluster
//! one: `Client::remote(nats_bus)`. Then `client.create_fork(..)`, `watch::follow(..)`,
//! `client.merge(fork, "label")`, `workspace::apply_merge(..)`.

pub mod changes;
pub mod client;
pub mod error;
pub mod forkdir;
pub mod git;
#[cfg(unix)]
pub mod local;
pub mod prompt;
pub mod render;
pub mod run;
pub mod rundiff;
pub mod watch;
pub mod workspace;

pub use client::{Client, Transport};
pub use error::ClientError;
pub use forkfleet_shared::api::ApiClient;
