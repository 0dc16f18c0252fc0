//! Count parsing and test signals on real captured runner outputs.
//!
//! Every `tests/fixtures/test-output/<runner>-<case>.txt` is the combined stdout and stderr of
//! a real run of that runner on a small sample project, captured as a worker captures it
//! (not a terminal: colour only where forced). `README.md` there says how each was made and
//! with which versions. The table below gives, per fixture, the exit status the run had and
//! the counts and signal it must give; a fixture without a row fails the test.
//!
//! Run: `cargo test -p forkfleet-shared --test all testsignal`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use forkfleet_shared::testsignal::{
    parse_counts, strip_ansi, test_signal, Runner, TestCounts, TestOutcome,
};
use std::collections::BTreeSet;
use std::path::PathBuf;

/// What a fixture must give.
struct Case {
    /// File name without `.txt`.
    name: &'static str,
    /// The exit code the captured run had.
    code: i32,
    /// `(runner, passed, failed, skipped)`, or `None` when no runner's summary is in it.
    counts: Option<(Runner, u64, u64, u64)>,
    /// The signal: `None` is no signal.
    ratio: Option<f64>,
}

const fn case(
    name: &'static str,
    code: i32,
    counts: Option<(Runner, u64, u64, u64)>,
    ratio: Option<f64>,
) -> Case {
    Case {
        name,
        code,
        counts,
        ratio,
    }
}

use Runner::*;

const CASES: &[Case] = &[
    // cargo test: lib tests, an integration test binary and doc-tests, summed.
    case("cargo-passing", 0, Some((Cargo, 9, 0, 0)), Some(1.0)),
    case("cargo-mixed", 0, Some((Cargo, 7, 0, 2)), Some(1.0)),
    case(
        "cargo-failing",
        101,
        Some((Cargo, 5, 2, 2)),
        Some(5.0 / 7.0),
    ),
    case(
        "cargo-failing-color",
        101,
        Some((Cargo, 5, 2, 2)),
        Some(5.0 / 7.0),
    ),
    // Without --no-fail-fast cargo stops after the first failing binary.
    case(
        "cargo-failing-fail-fast",
        101,
        Some((Cargo, 2, 1, 1)),
        Some(2.0 / 3.0),
    ),
    case("cargo-zero", 0, Some((Cargo, 0, 0, 0)), None),
    // Does not compile: no counts, the exit code decides.
    case("cargo-compile-error", 101, None, Some(0.0)),
    // cargo nextest (its failure output repeats libtest's `test result:` lines: nextest wins).
    case("nextest-passing", 0, Some((Nextest, 7, 0, 0)), Some(1.0)),
    case("nextest-mixed", 0, Some((Nextest, 5, 0, 2)), Some(1.0)),
    case("nextest-failing", 100, Some((Nextest, 3, 2, 2)), Some(0.6)),
    case(
        "nextest-failing-color",
        100,
        Some((Nextest, 3, 2, 2)),
        Some(0.6),
    ),
    case(
        "nextest-failing-fail-fast",
        100,
        Some((Nextest, 1, 1, 2)),
        Some(0.5),
    ),
    case("nextest-flaky", 0, Some((Nextest, 3, 0, 0)), Some(1.0)),
    case(
        "nextest-timeout",
        100,
        Some((Nextest, 2, 1, 0)),
        Some(2.0 / 3.0),
    ),
    case("nextest-zero", 4, Some((Nextest, 0, 0, 0)), None),
    case("nextest-zero-allowed", 0, Some((Nextest, 0, 0, 0)), None),
    // pytest: errors are failures, xpassed a pass, xfailed a skip, warnings nothing.
    case("pytest-passing", 0, Some((Pytest, 3, 0, 0)), Some(1.0)),
    case("pytest-failing", 1, Some((Pytest, 1, 1, 0)), Some(0.5)),
    case("pytest-mixed", 1, Some((Pytest, 3, 2, 3)), Some(0.6)),
    case("pytest-mixed-color", 1, Some((Pytest, 3, 2, 3)), Some(0.6)),
    case("pytest-mixed-quiet", 1, Some((Pytest, 3, 2, 3)), Some(0.6)),
    case("pytest-zero", 5, Some((Pytest, 0, 0, 0)), None),
    case(
        "pytest-collection-error",
        2,
        Some((Pytest, 0, 1, 0)),
        Some(0.0),
    ),
    case(
        "pytest-collection-error-continue",
        1,
        Some((Pytest, 1, 1, 0)),
        Some(0.5),
    ),
    // go test -v: every --- PASS/FAIL/SKIP line, subtests included.
    case("go-verbose-mixed", 0, Some((GoTest, 6, 0, 1)), Some(1.0)),
    case(
        "go-verbose-failing",
        1,
        Some((GoTest, 5, 1, 1)),
        Some(5.0 / 6.0),
    ),
    case(
        "go-verbose-build-failed",
        2,
        Some((GoTest, 6, 1, 1)),
        Some(6.0 / 7.0),
    ),
    case("go-verbose-zero", 0, Some((GoTest, 0, 0, 0)), None),
    // go test without -v: a package is one result unless it printed failing tests.
    case("go-passing", 0, Some((GoTest, 2, 0, 0)), Some(1.0)),
    case("go-failing", 1, Some((GoTest, 1, 1, 0)), Some(0.5)),
    case(
        "go-build-failed",
        2,
        Some((GoTest, 2, 1, 0)),
        Some(2.0 / 3.0),
    ),
    case("go-zero", 0, Some((GoTest, 0, 0, 0)), None),
    case("go-no-tests-to-run", 0, Some((GoTest, 0, 0, 0)), None),
    // jest: todo is a skip; a suite that failed to load is a failure when no test failed.
    case("jest-passing", 0, Some((Jest, 1, 0, 0)), Some(1.0)),
    case("jest-mixed", 0, Some((Jest, 4, 0, 2)), Some(1.0)),
    case("jest-failing", 1, Some((Jest, 3, 1, 2)), Some(0.75)),
    case("jest-failing-color", 1, Some((Jest, 3, 1, 2)), Some(0.75)),
    case("jest-suite-error", 1, Some((Jest, 1, 1, 0)), Some(0.5)),
    case("jest-zero", 1, Some((Jest, 0, 0, 0)), None),
    case("jest-zero-pass", 0, Some((Jest, 0, 0, 0)), None),
    // vitest: the same rules; a test file with no tests is a failed file to vitest (exit 1).
    case("vitest-passing", 0, Some((Vitest, 1, 0, 0)), Some(1.0)),
    case("vitest-mixed", 0, Some((Vitest, 4, 0, 2)), Some(1.0)),
    case("vitest-failing", 1, Some((Vitest, 3, 1, 2)), Some(0.75)),
    case(
        "vitest-failing-color",
        1,
        Some((Vitest, 3, 1, 2)),
        Some(0.75),
    ),
    case(
        "vitest-no-tests-in-file",
        1,
        Some((Vitest, 0, 1, 0)),
        Some(0.0),
    ),
    case("vitest-zero", 1, Some((Vitest, 0, 0, 0)), None),
    // A hand-rolled test script's `N passed, M failed, K skipped` line.
    case("plain-script", 1, Some((Plain, 3, 1, 1)), Some(0.75)),
    // unittest's `Ran 2 tests ... OK` is not a recognised summary: the exit code decides.
    case("unrecognised-unittest", 0, None, Some(1.0)),
];

fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/test-output")
}

fn fixture(name: &str) -> String {
    let path = fixture_dir().join(format!("{name}.txt"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn every_fixture_has_a_case_and_every_case_a_fixture() {
    let files: BTreeSet<String> = std::fs::read_dir(fixture_dir())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter_map(|n| n.strip_suffix(".txt").map(str::to_owned))
        .collect();
    let cases: BTreeSet<String> = CASES.iter().map(|c| c.name.to_owned()).collect();
    assert_eq!(CASES.len(), cases.len(), "a fixture is listed twice");
    assert_eq!(files, cases);
}

#[test]
fn counts_of_every_fixture() {
    for c in CASES {
        let got = parse_counts(&fixture(c.name)).map(|(r, t)| (r, t.passed, t.failed, t.skipped));
        assert_eq!(got, c.counts, "{}", c.name);
    }
}

#[test]
fn signal_of_every_fixture() {
    for c in CASES {
        let s = test_signal(&TestOutcome::Exited { code: c.code }, &fixture(c.name));
        assert_eq!(s.pass_ratio, c.ratio, "{}: {}", c.name, s.reason);
        assert_eq!(s.runner, c.counts.map(|t| t.0), "{}", c.name);
        if c.ratio.is_none() {
            assert!(
                s.reason.starts_with("no tests collected"),
                "{}: {}",
                c.name,
                s.reason
            );
        }
    }
}

#[test]
fn every_runner_has_a_passing_a_failing_and_a_zero_fixture() {
    for runner in [Cargo, Nextest, Pytest, GoTest, Jest, Vitest] {
        let of = |pred: &dyn Fn(&Case) -> bool| {
            CASES
                .iter()
                .any(|c| c.counts.is_some_and(|t| t.0 == runner) && pred(c))
        };
        assert!(
            of(&|c| c.ratio == Some(1.0)),
            "{runner:?}: no passing fixture"
        );
        assert!(
            of(&|c| c.ratio.is_some_and(|r| r < 1.0)),
            "{runner:?}: no failing fixture"
        );
        assert!(
            of(&|c| c.ratio.is_none()),
            "{runner:?}: no zero-tests fixture"
        );
        assert!(
            of(&|c| c.counts.is_some_and(|t| t.3 > 0)),
            "{runner:?}: no fixture with skips"
        );
    }
}

#[test]
fn colour_fixtures_have_colour_and_parse_like_the_plain_ones() {
    for (colour, plain) in [
        ("cargo-failing-color", "cargo-failing"),
        ("nextest-failing-color", "nextest-failing"),
        ("pytest-mixed-color", "pytest-mixed"),
        ("jest-failing-color", "jest-failing"),
        ("vitest-failing-color", "vitest-failing"),
    ] {
        let text = fixture(colour);
        assert!(text.contains("\u{1b}["), "{colour} has no escape codes");
        assert!(!strip_ansi(&text).contains('\u{1b}'), "{colour}");
        assert_eq!(
            parse_counts(&text),
            parse_counts(&fixture(plain)),
            "{colour}"
        );
    }
}

#[test]
fn reasons_read_well() {
    let reason = |name: &str, outcome: TestOutcome| test_signal(&outcome, &fixture(name)).reason;
    assert_eq!(
        reason("cargo-failing", TestOutcome::Exited { code: 101 }),
        "5 passed, 2 failed, 2 skipped (cargo test)"
    );
    assert_eq!(
        reason("pytest-zero", TestOutcome::Exited { code: 5 }),
        "no tests collected (pytest): no signal"
    );
    assert_eq!(
        reason("go-verbose-mixed", TestOutcome::TimedOut),
        "timed out after the limit: no signal"
    );
    assert_eq!(
        reason("cargo-compile-error", TestOutcome::Exited { code: 101 }),
        "no test counts in the output; exited with code 101"
    );
    // A run that ends with output in CRLF lines parses the same.
    let crlf = fixture("pytest-failing").replace('\n', "\r\n");
    assert_eq!(
        parse_counts(&crlf),
        Some((
            Pytest,
            TestCounts {
                passed: 1,
                failed: 1,
                skipped: 0
            }
        ))
    );
}
