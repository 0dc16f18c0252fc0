//! What every branch of a worker shares: the bus, the blob cache, the providers, and the
//! decoded prefixes and manifests (one decode per fork, not per branch).

use crate::cache::{BlobCache, Memo};
use crate::provider::Providers;
use crate::runner::Trees;
use forkfleet_bus::Bus;
use forkfleet_shared::catalogue::ModelCatalogue;
use forkfleet_shared::event::Event;
use forkfleet_shared::ids::WorkerId;
use forkfleet_shared::manifest::Manifest;
use std::path::PathBuf;
use std::sync::Arc;

/// Decoded prefixes and manifests kept per worker.
const MEMO_CAPACITY: usize = 64;

pub(crate) struct WorkerCtx {
    pub worker_id: WorkerId,
    pub bus: Arc<dyn Bus>,
    pub blobs: Arc<BlobCache>,
    pub providers: Providers,
    pub prefixes: Memo<Vec<Event>>,
    pub manifests: Memo<Manifest>,
    /// Set when the node hands its branches back: model calls and waits in flight end.
    pub handback: tokio::sync::watch::Sender<bool>,
    /// Branches' command trees kept between calls (`crate::runner::Trees`).
    pub trees: Arc<Trees>,
    /// First calls of a fork's branches warming the prompt cache (`crate::warmup`).
    pub warmups: Option<Arc<crate::warmup::Warmups>>,
}

impl WorkerCtx {
    pub fn new(
        worker_id: WorkerId,
        bus: Arc<dyn Bus>,
        blob_cache_bytes: u64,
        trees: Arc<Trees>,
        scripted_usage_log: Option<PathBuf>,
        catalogue: Arc<ModelCatalogue>,
    ) -> Self {
        let blobs = Arc::new(BlobCache::new(bus.blobs(), blob_cache_bytes));
        Self {
            worker_id,
            bus,
            providers: Providers::new(blobs.clone(), scripted_usage_log, catalogue),
            blobs,
            prefixes: Memo::new(MEMO_CAPACITY),
            manifests: Memo::new(MEMO_CAPACITY),
            handback: tokio::sync::watch::Sender::new(false),
            trees,
            warmups: Some(Arc::default()),
        }
    }
}
