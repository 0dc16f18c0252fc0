//! The crate's one error type.
//!
//! A branch's own failures (a model error, a missing script turn, a tool error) are not
//! errors of the worker: they end the branch with a `failed` status or become tool results
//! the model sees. [`WorkerError`] is for what the worker itself cannot do: a bad
//! configuration, an actor that would not start, or an infrastructure failure (bus, blob
//! store) that makes a branch hand its task back for another attempt.

use forkfleet_bus::BusError;
use forkfleet_shared::blob::BlobError;
use forkfleet_shared::wire::WireError;

#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// The configuration cannot work (e.g. a concurrency of 0).
    #[error("invalid worker configuration: {0}")]
    Config(String),
    /// The node actor could not be started.
    #[error("the worker node could not start: {0}")]
    Spawn(String),
    /// The node stopped on its own (it panicked, or the bus went away).
    #[error("the worker node stopped unexpectedly: {0}")]
    NodeStopped(String),
    #[error("bus: {0}")]
    Bus(#[from] BusError),
    #[error("wire: {0}")]
    Wire(#[from] WireError),
    #[error("blob store: {0}")]
    Blob(#[from] BlobError),
}
