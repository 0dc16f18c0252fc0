//! The worker's integration tests: one binary, real parts (LocalBus over a MemBlobStore),
//! every await that could hang under a timeout.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod suite {
    pub mod common;

    mod bench;
    mod branch;
    mod budget;
    mod control;
    mod dialects;
    mod http_get;
    mod mock_api;
    mod node;
    mod providers;
    mod run_command;
    mod runner;
    mod sandbox;
    mod streams;
    mod tools;
    mod trace;
    mod turns;
}
