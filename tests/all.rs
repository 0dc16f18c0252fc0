//! Integration tests of the `forkfleet` binary and library: one test binary, modules under
//! `tests/suite/`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod suite;
