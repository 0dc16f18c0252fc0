//! The shared crate's integration tests: one test binary, modules under `tests/suite/`
//! (`common` holds their helpers; the runner outputs `testsignal` reads stay in
//! `tests/fixtures/`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod suite {
    pub mod common;

    mod diff;
    mod diff_props;
    mod flush;
    mod overlay_props;
    mod testsignal;
    mod wire_props;
}
