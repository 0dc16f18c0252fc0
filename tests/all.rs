//! Integration tests of the `forkfleet` binary and library: one test binary, modules under
//! `tests/suite/`.

mod suite;
