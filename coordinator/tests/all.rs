//! The coordinator through its public API, on a real sled store in a temp dir and the real
//! LocalBus; a fake worker in the tests plays the workers' side of the bus. One test binary,
//! modules under `tests/suite/`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod suite {
    pub mod support;

    mod budget;
    mod checkpoints;
    mod clock;
    mod create;
    mod events;
    mod merge;
    mod perf;
    mod restart;
    mod resume;
    mod tenancy;
    mod trace;
    mod turns;
    mod validation;
}
