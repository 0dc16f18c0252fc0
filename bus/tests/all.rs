//! The bus's integration tests: one test binary, modules under `tests/suite/`. They start a
//! real `nats-server` (the `testkit` fixture): run `scripts/setup` first.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod suite {
    mod conformance;
    mod lease;
}
