//! Test signals: turning a branch's test command output and exit status into a pass ratio.
//!
//! [`parse_counts`] recognises the summary lines of the common test runners in the combined
//! stdout and stderr of a test command (ANSI colour codes stripped first):
//!
//! | runner | what is read |
//! |---|---|
//! | `cargo test` (libtest) | every `test result: ok. N passed; M failed; K ignored; ...` line, summed over the test binaries and doc-tests |
//! | `cargo nextest run` | the last `Summary [ 0.1s] N tests run: P passed (R flaky), F failed, T timed out, S skipped` line |
//! | pytest | the last `=== 3 passed, 1 failed, 2 skipped, 1 error in 0.12s ===` line (with or without the `=`), or `no tests ran` |
//! | `go test` | per package: the `--- PASS:` / `--- FAIL:` / `--- SKIP:` lines (subtests included) before its `ok` / `FAIL` line, else the package line itself as one result |
//! | jest | the last `Tests:       1 failed, 3 passed, 4 total` line, or `No tests found` |
//! | vitest | the last `Tests  3 passed \| 1 failed (4)` line, or `No test files found` |
//! | plain | the last line made only of `N passed`, `M failed` and `K skipped` parts (any order, an optional `Label:` before) |
//!
//! When several runners' lines are present the most specific wins, in the order of the
//! table: nextest before cargo (nextest repeats libtest's `test result:` lines in the output
//! of failing tests), the plain line last.
//!
//! How results fold into [`TestCounts`]:
//! - failed: failures, pytest errors (a collection or fixture error is a failure), nextest
//!   timeouts and `exec failed`, a go package that failed without a failing test line (build
//!   failed, a panic in `TestMain`, the test binary's own timeout), and jest / vitest test
//!   files that failed to run when no test failed (a test file whose import fails counts no
//!   tests at all, so the failed file stands for them);
//! - skipped: ignored, skipped, todo and pending tests, and pytest's `xfailed` (an expected
//!   failure is neither a pass nor a fail);
//! - passed: passes, including nextest's flaky passes and pytest's `xpassed` (a strict
//!   `xpass` is reported by pytest as failed).
//!
//! Deselected and filtered-out tests, warnings and reruns are not results.
//!
//! [`test_signal`] applies the resolve rule: counts give `passed / (passed + failed)`; zero
//! tests collected, a timeout, a signal or a failure to start give no signal (never a pass);
//! with no counts in the output the exit code decides, 0 as 1.0 and anything else as 0.0.
//! `cargo test` stops at the first failing test binary unless run with `--no-fail-fast`, so
//! its counts then cover the binaries that ran.

use serde::{Deserialize, Serialize};

/// Which runner's summary the counts were read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Runner {
    Cargo,
    Nextest,
    Pytest,
    GoTest,
    Jest,
    Vitest,
    Plain,
}

impl Runner {
    /// A short name for people: `cargo test`, `pytest`, ...
    pub fn display_name(self) -> &'static str {
        match self {
            Runner::Cargo => "cargo test",
            Runner::Nextest => "cargo nextest",
            Runner::Pytest => "pytest",
            Runner::GoTest => "go test",
            Runner::Jest => "jest",
            Runner::Vitest => "vitest",
            Runner::Plain => "summary line",
        }
    }
}

impl std::fmt::Display for Runner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.display_name())
    }
}

/// Counted test results.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TestCounts {
    pub passed: u64,
    pub failed: u64,
    pub skipped: u64,
}

impl TestCounts {
    /// Tests that ran to a verdict: `passed + failed`.
    pub fn ran(&self) -> u64 {
        self.passed.saturating_add(self.failed)
    }

    fn add(&mut self, other: TestCounts) {
        self.passed = self.passed.saturating_add(other.passed);
        self.failed = self.failed.saturating_add(other.failed);
        self.skipped = self.skipped.saturating_add(other.skipped);
    }

    fn is_empty(&self) -> bool {
        self.passed == 0 && self.failed == 0 && self.skipped == 0
    }
}

/// How a test command ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum TestOutcome {
    /// The process exited with this code.
    Exited { code: i32 },
    /// The process was killed by a signal it did not ask for (not our timeout).
    Signalled,
    /// The command ran past its timeout and its process group was killed.
    TimedOut,
    /// The command could not be started (not found, not executable, ...).
    SpawnFailed { error: String },
}

/// What a test run says about a branch.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TestSignal {
    /// `passed / (passed + failed)`, or from the exit code; `None` is no signal (not a pass).
    pub pass_ratio: Option<f64>,
    /// The counts read from the output, when there were any.
    pub counts: Option<TestCounts>,
    /// The runner the counts were read from.
    pub runner: Option<Runner>,
    /// A short sentence for people, e.g. `12 passed, 1 failed (cargo test)`.
    pub reason: String,
}

/// The signal of one test run: see the module documentation for the rule.
pub fn test_signal(outcome: &TestOutcome, output: &str) -> TestSignal {
    let parsed = parse_counts(output);
    let (runner, counts) = match parsed {
        Some((r, c)) => (Some(r), Some(c)),
        None => (None, None),
    };
    let no_signal = |reason: String| TestSignal {
        pass_ratio: None,
        counts,
        runner,
        reason,
    };
    let code = match outcome {
        TestOutcome::TimedOut => return no_signal("timed out after the limit: no signal".into()),
        TestOutcome::Signalled => return no_signal("killed by a signal: no signal".into()),
        TestOutcome::SpawnFailed { error } => {
            return TestSignal {
                pass_ratio: None,
                counts: None,
                runner: None,
                reason: format!("failed to start ({error}): no signal"),
            }
        }
        TestOutcome::Exited { code } => *code,
    };
    match (runner, counts) {
        (Some(runner), Some(c)) => {
            if c.ran() == 0 {
                return no_signal(format!("no tests collected ({runner}): no signal"));
            }
            let mut reason = format!("{} passed, {} failed", c.passed, c.failed);
            if c.skipped > 0 {
                reason.push_str(&format!(", {} skipped", c.skipped));
            }
            reason.push_str(&format!(" ({runner})"));
            if c.failed == 0 && code != 0 {
                reason.push_str(&format!("; the command exited with code {code}"));
            }
            TestSignal {
                pass_ratio: Some(c.passed as f64 / c.ran() as f64),
                counts: Some(c),
                runner: Some(runner),
                reason,
            }
        }
        _ => TestSignal {
            pass_ratio: Some(if code == 0 { 1.0 } else { 0.0 }),
            counts: None,
            runner: None,
            reason: if code == 0 {
                "no test counts in the output; exited with code 0".into()
            } else {
                format!("no test counts in the output; exited with code {code}")
            },
        },
    }
}

/// The counts in a test command's combined output, and the runner they were read from.
pub fn parse_counts(output: &str) -> Option<(Runner, TestCounts)> {
    let text = strip_ansi(output);
    let lines: Vec<&str> = text
        .split(['\n', '\r'])
        .map(str::trim_end)
        .filter(|l| !l.is_empty())
        .collect();
    type Parser = fn(&[&str]) -> Option<TestCounts>;
    let parsers: [(Runner, Parser); 7] = [
        (Runner::Nextest, parse_nextest),
        (Runner::Cargo, parse_cargo),
        (Runner::Pytest, parse_pytest),
        (Runner::Jest, parse_jest),
        (Runner::Vitest, parse_vitest),
        (Runner::GoTest, parse_go),
        (Runner::Plain, parse_plain),
    ];
    parsers
        .iter()
        .find_map(|(runner, parse)| parse(&lines).map(|c| (*runner, c)))
}

/// `text` without ANSI escape sequences (CSI such as colours, OSC such as hyperlinks,
/// character-set selections and other two-byte escapes).
pub fn strip_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '\u{1b}' {
            out.push(c);
            continue;
        }
        match chars.next() {
            // CSI: parameters and intermediates up to a final byte in @..~.
            Some('[') => {
                for c in chars.by_ref() {
                    if ('@'..='~').contains(&c) {
                        break;
                    }
                }
            }
            // OSC: up to BEL or ST (ESC \).
            Some(']') => {
                while let Some(c) = chars.next() {
                    if c == '\u{7}' {
                        break;
                    }
                    if c == '\u{1b}' {
                        if chars.peek() == Some(&'\\') {
                            chars.next();
                        }
                        break;
                    }
                }
            }
            // Character-set designation: one more character.
            Some('(' | ')' | '*' | '+' | '-' | '.' | '/') => {
                chars.next();
            }
            // Any other escape is two characters long.
            _ => {}
        }
    }
    out
}

/// `"12"` → 12.
fn number(s: &str) -> Option<u64> {
    let s = s.trim();
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

/// `"3 passed"` → `(3, "passed")`; the word may have several words (`"1 timed out"`).
fn count_part(part: &str) -> Option<(u64, &str)> {
    let part = part.trim();
    let (n, word) = part.split_once(' ')?;
    Some((number(n)?, word.trim()))
}

/// `part` without parenthesised asides: `"3 passed (1 flaky)"` → `"3 passed "`.
fn without_parens(part: &str) -> String {
    let mut depth = 0usize;
    let mut out = String::with_capacity(part.len());
    for c in part.chars() {
        match c {
            '(' => depth += 1,
            ')' => depth = depth.saturating_sub(1),
            _ if depth == 0 => out.push(c),
            _ => {}
        }
    }
    out
}

/// libtest: `test result: ok. 3 passed; 0 failed; 1 ignored; 0 measured; 0 filtered out; ...`,
/// summed over every line.
fn parse_cargo(lines: &[&str]) -> Option<TestCounts> {
    let mut total: Option<TestCounts> = None;
    for line in lines {
        let Some(rest) = line.strip_prefix("test result: ") else {
            continue;
        };
        let Some((_status, rest)) = rest.split_once(". ") else {
            continue;
        };
        let mut counts = TestCounts::default();
        let (mut saw_passed, mut saw_failed) = (false, false);
        for part in rest.split(';') {
            match count_part(part) {
                Some((n, "passed")) => {
                    counts.passed = n;
                    saw_passed = true;
                }
                Some((n, "failed")) => {
                    counts.failed = n;
                    saw_failed = true;
                }
                Some((n, "ignored")) => counts.skipped = n,
                _ => {}
            }
        }
        if saw_passed && saw_failed {
            total.get_or_insert_with(TestCounts::default).add(counts);
        }
    }
    total
}

/// nextest: `Summary [   0.1s] 5 tests run: 3 passed (1 flaky), 1 failed, 1 timed out, 2 skipped`
/// (or `2/5 tests run` when cancelled); the last one.
fn parse_nextest(lines: &[&str]) -> Option<TestCounts> {
    lines.iter().rev().find_map(|line| {
        let rest = line.trim_start().strip_prefix("Summary [")?;
        let (_, rest) = rest.split_once(']')?;
        let (head, results) = rest.split_once(':')?;
        let mut head = head.split_whitespace();
        let ran = head.next()?;
        let ran_ok = ran.split('/').all(|n| number(n).is_some());
        if !ran_ok || !matches!(head.next(), Some("test" | "tests")) || head.next() != Some("run") {
            return None;
        }
        let mut counts = TestCounts::default();
        for part in results.split(',') {
            let part = without_parens(part);
            let Some((n, word)) = count_part(&part) else {
                continue;
            };
            match word {
                "passed" => counts.passed = counts.passed.saturating_add(n),
                "failed" | "exec failed" | "timed out" => {
                    counts.failed = counts.failed.saturating_add(n)
                }
                "skipped" => counts.skipped = counts.skipped.saturating_add(n),
                _ => {}
            }
        }
        Some(counts)
    })
}

/// pytest: `==== 1 failed, 2 passed, 1 xfailed, 1 warning, 1 error in 0.04s ====`, with or
/// without the `=` (`-q`), or `no tests ran in 0.01s`; the last one.
fn parse_pytest(lines: &[&str]) -> Option<TestCounts> {
    lines.iter().rev().find_map(|line| {
        let body = line.trim().trim_matches('=').trim();
        let (parts, duration) = body.rsplit_once(" in ")?;
        if !duration.starts_with(|c: char| c.is_ascii_digit()) || !duration.contains('s') {
            return None;
        }
        let mut counts = TestCounts::default();
        for part in parts.split(',') {
            let part = part.trim();
            if part == "no tests ran" {
                continue;
            }
            let (n, word) = count_part(part)?;
            match word {
                "passed" | "xpassed" => counts.passed = counts.passed.saturating_add(n),
                "failed" | "error" | "errors" => counts.failed = counts.failed.saturating_add(n),
                "skipped" | "xfailed" => counts.skipped = counts.skipped.saturating_add(n),
                "deselected" | "warning" | "warnings" | "rerun" | "reruns" => {}
                _ => return None,
            }
        }
        Some(counts)
    })
}

/// `"1 failed, 3 passed, 4 total"` with runner-specific separators; unknown words ignored.
fn js_counts(parts: &str, separator: char) -> Option<TestCounts> {
    let mut counts = TestCounts::default();
    let mut any = false;
    for part in parts.split(separator) {
        let part = without_parens(part);
        let (n, word) = count_part(&part)?;
        any = true;
        match word {
            "passed" => counts.passed = counts.passed.saturating_add(n),
            "failed" => counts.failed = counts.failed.saturating_add(n),
            "skipped" | "todo" | "pending" => counts.skipped = counts.skipped.saturating_add(n),
            _ => {}
        }
    }
    any.then_some(counts)
}

/// Applies the suite rule: files that failed to run stand for failures when no test failed.
fn with_failed_files(mut tests: TestCounts, files: Option<TestCounts>) -> TestCounts {
    if let Some(files) = files {
        if tests.failed == 0 && files.failed > 0 {
            tests.failed = files.failed;
        }
    }
    tests
}

/// jest: `Tests:       1 failed, 1 skipped, 1 todo, 3 passed, 6 total` (the last one, with
/// the `Test Suites:` line just before it), or `No tests found, exiting with code N`.
fn parse_jest(lines: &[&str]) -> Option<TestCounts> {
    let mut suites: Option<TestCounts> = None;
    let mut last: Option<TestCounts> = None;
    for line in lines {
        let line = line.trim();
        if let Some(rest) = line.strip_prefix("Test Suites:") {
            suites = js_counts(rest, ',');
        } else if let Some(rest) = line.strip_prefix("Tests:") {
            if let Some(tests) = js_counts(rest, ',') {
                last = Some(with_failed_files(tests, suites.take()));
            }
        }
    }
    last.or_else(|| {
        lines
            .iter()
            .any(|l| l.trim().starts_with("No tests found, exiting with code"))
            .then(TestCounts::default)
    })
}

/// vitest: ` Tests  1 failed | 3 passed | 1 skipped (5)` (the last one, with the
/// `Test Files` line just before it), `Tests  no tests`, or `No test files found`.
fn parse_vitest(lines: &[&str]) -> Option<TestCounts> {
    let mut files: Option<TestCounts> = None;
    let mut last: Option<TestCounts> = None;
    for line in lines {
        let line = line.trim();
        if let Some(rest) = line.strip_prefix("Test Files ") {
            files = js_counts(rest, '|');
        } else if let Some(rest) = line.strip_prefix("Tests ") {
            let rest = rest.trim();
            let tests = if rest == "no tests" {
                Some(TestCounts::default())
            } else {
                js_counts(rest, '|')
            };
            if let Some(tests) = tests {
                last = Some(with_failed_files(tests, files.take()));
            }
        }
    }
    last.or_else(|| {
        lines
            .iter()
            .any(|l| {
                l.trim()
                    .starts_with("No test files found, exiting with code")
            })
            .then(TestCounts::default)
    })
}

/// go test: per package, the `--- PASS/FAIL/SKIP:` lines before its `ok` / `FAIL` line, or the
/// package line as one result when there were none; summed over packages.
fn parse_go(lines: &[&str]) -> Option<TestCounts> {
    let mut total = TestCounts::default();
    let mut pending = TestCounts::default();
    let mut seen = false;
    for line in lines {
        let trimmed = line.trim_start();
        if trimmed.starts_with("--- PASS: ") {
            pending.passed += 1;
            seen = true;
        } else if trimmed.starts_with("--- FAIL: ") {
            pending.failed += 1;
            seen = true;
        } else if trimmed.starts_with("--- SKIP: ") {
            pending.skipped += 1;
            seen = true;
        } else if go_package_line(line, "ok") {
            seen = true;
            if pending.is_empty() && !line.contains("[no tests to run]") {
                pending.passed = 1;
            }
            total.add(std::mem::take(&mut pending));
        } else if go_package_line(line, "FAIL") {
            seen = true;
            if pending.failed == 0 {
                pending.failed += 1;
            }
            total.add(std::mem::take(&mut pending));
        } else if go_package_line(line, "?") {
            seen = true;
            total.add(std::mem::take(&mut pending));
        }
    }
    total.add(pending);
    seen.then_some(total)
}

/// `ok  \texample.com/pkg\t0.01s`, `FAIL\texample.com/pkg [build failed]`,
/// `?   \texample.com/pkg\t[no test files]`.
fn go_package_line(line: &str, status: &str) -> bool {
    let Some(rest) = line.strip_prefix(status) else {
        return false;
    };
    let pad = rest.len() - rest.trim_start_matches(' ').len();
    rest[pad..].starts_with('\t') && rest[pad..].trim().len() > 1
}

/// A line made only of `N passed`, `M failed`, `K skipped` parts (`,` or `;` between them,
/// any order, a trailing `.`), optionally after a `Label:`; the last one.
fn parse_plain(lines: &[&str]) -> Option<TestCounts> {
    lines.iter().rev().find_map(|line| {
        let line = line.trim().trim_end_matches('.');
        let body = match line.rsplit_once(':') {
            Some((_, body)) => body,
            None => line,
        };
        let mut counts = TestCounts::default();
        let (mut saw_passed, mut saw_failed) = (false, false);
        for part in body.split([',', ';']) {
            match count_part(part)? {
                (n, "passed") => {
                    counts.passed = counts.passed.saturating_add(n);
                    saw_passed = true;
                }
                (n, "failed") => {
                    counts.failed = counts.failed.saturating_add(n);
                    saw_failed = true;
                }
                (n, "skipped") => counts.skipped = counts.skipped.saturating_add(n),
                _ => return None,
            }
        }
        (saw_passed || saw_failed).then_some(counts)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exited(code: i32) -> TestOutcome {
        TestOutcome::Exited { code }
    }

    #[test]
    fn ratio_from_counts() {
        let s = test_signal(
            &exited(101),
            "test result: FAILED. 12 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.01s\n\
             test result: ok. 3 passed; 0 failed; 2 ignored; 0 measured; 0 filtered out; finished in 0.00s\n",
        );
        assert_eq!(s.runner, Some(Runner::Cargo));
        assert_eq!(
            s.counts,
            Some(TestCounts {
                passed: 15,
                failed: 1,
                skipped: 2
            })
        );
        assert_eq!(s.pass_ratio, Some(15.0 / 16.0));
        assert_eq!(s.reason, "15 passed, 1 failed, 2 skipped (cargo test)");
    }

    #[test]
    fn counts_win_over_the_exit_code() {
        // All passed but the command failed (a coverage threshold, a leaky test): the counts
        // decide, the reason says the exit code.
        let s = test_signal(&exited(1), "Tests:       4 passed, 4 total\n");
        assert_eq!(s.pass_ratio, Some(1.0));
        assert_eq!(
            s.reason,
            "4 passed, 0 failed (jest); the command exited with code 1"
        );
        // Failures counted though the command exited 0.
        let s = test_signal(&exited(0), "3 passed, 1 failed\n");
        assert_eq!(s.pass_ratio, Some(0.75));
        assert_eq!(s.runner, Some(Runner::Plain));
    }

    #[test]
    fn zero_collected_is_no_signal() {
        for (code, out) in [
            (
                0,
                "test result: ok. 0 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.00s\n",
            ),
            (5, "============================ no tests ran in 0.00s =============================\n"),
            (0, "= 3 deselected in 0.01s =\n"),
            (4, "     Summary [   0.000s] 0 tests run: 0 passed, 0 skipped\nerror: no tests to run\n"),
            (1, "No tests found, exiting with code 1\n"),
            (0, "No test files found, exiting with code 0\n"),
            (0, "?   \texample.com/x\t[no test files]\n"),
            (0, "ok  \texample.com/x\t0.003s [no tests to run]\n"),
            // Everything skipped is nothing collected to a verdict.
            (0, "Tests:       2 skipped, 2 total\n"),
        ] {
            let s = test_signal(&exited(code), out);
            assert_eq!(s.pass_ratio, None, "{out}");
            assert!(s.reason.starts_with("no tests collected ("), "{}", s.reason);
            assert!(s.reason.ends_with(": no signal"), "{}", s.reason);
            assert!(s.counts.is_some());
        }
    }

    #[test]
    fn timeout_signal_and_spawn_failure_are_no_signal() {
        let out = "test result: ok. 3 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.00s\n";
        let s = test_signal(&TestOutcome::TimedOut, out);
        assert_eq!(s.pass_ratio, None);
        assert_eq!(s.reason, "timed out after the limit: no signal");
        // What was counted before the kill is kept for the report.
        assert_eq!(s.runner, Some(Runner::Cargo));

        let s = test_signal(&TestOutcome::Signalled, "");
        assert_eq!(s.pass_ratio, None);
        assert_eq!(s.reason, "killed by a signal: no signal");

        let s = test_signal(
            &TestOutcome::SpawnFailed {
                error: "No such file or directory (os error 2)".into(),
            },
            "",
        );
        assert_eq!(s.pass_ratio, None);
        assert_eq!(s.counts, None);
        assert_eq!(
            s.reason,
            "failed to start (No such file or directory (os error 2)): no signal"
        );
    }

    #[test]
    fn exit_code_fallback() {
        let s = test_signal(&exited(0), "Ran 2 tests in 0.000s\n\nOK\n");
        assert_eq!(s.pass_ratio, Some(1.0));
        assert_eq!(s.runner, None);
        assert_eq!(s.reason, "no test counts in the output; exited with code 0");
        let s = test_signal(&exited(2), "make: *** [check] Error 2\n");
        assert_eq!(s.pass_ratio, Some(0.0));
        assert_eq!(s.reason, "no test counts in the output; exited with code 2");
        let s = test_signal(&exited(-1), "");
        assert_eq!(s.pass_ratio, Some(0.0));
    }

    #[test]
    fn strips_ansi() {
        assert_eq!(
            strip_ansi("\u{1b}[1m\u{1b}[32mok\u{1b}(B\u{1b}[m. \u{1b}]8;;http://x\u{7}link\u{1b}]8;;\u{1b}\\ done\u{1b}7"),
            "ok. link done"
        );
        assert_eq!(strip_ansi("plain ✓ text"), "plain ✓ text");
        assert_eq!(strip_ansi("cut \u{1b}["), "cut ");
    }

    #[test]
    fn progressive_summaries_last_wins() {
        let out = "Tests:       1 failed, 1 total\n...\nTests:       1 failed, 2 passed, 3 total\n\
                   \r\u{1b}[2KTests:       3 passed, 3 total\n";
        assert_eq!(
            parse_counts(out),
            Some((
                Runner::Jest,
                TestCounts {
                    passed: 3,
                    failed: 0,
                    skipped: 0
                }
            ))
        );
        let out = "= 1 failed in 0.1s =\nsome more\n= 2 passed in 0.2s (0:00:00) =\n";
        assert_eq!(
            parse_counts(out),
            Some((
                Runner::Pytest,
                TestCounts {
                    passed: 2,
                    failed: 0,
                    skipped: 0
                }
            ))
        );
    }

    #[test]
    fn plain_lines() {
        let c = |passed, failed, skipped| TestCounts {
            passed,
            failed,
            skipped,
        };
        for (line, want) in [
            ("3 passed, 1 failed", Some(c(3, 1, 0))),
            ("1 failed; 3 passed; 2 skipped.", Some(c(3, 1, 2))),
            ("Results: 5 passed", Some(c(5, 0, 0))),
            ("0 failed", Some(c(0, 0, 0))),
            ("3 passed, 1 failed, 4 total", None),
            ("we passed 3 checks", None),
            ("2 skipped", None),
            ("passed, failed", None),
        ] {
            let got = parse_counts(line);
            assert_eq!(got.map(|(_, c)| c), want, "{line}");
            if let Some((runner, _)) = got {
                assert_eq!(runner, Runner::Plain);
            }
        }
    }

    #[test]
    fn nextest_variants() {
        let parse = |s: &str| parse_counts(s).map(|(r, c)| (r, c.passed, c.failed, c.skipped));
        assert_eq!(
            parse(
                "     Summary [   4.022s] 3 tests run: 2 passed (1 flaky), 1 timed out, 0 skipped"
            ),
            Some((Runner::Nextest, 2, 1, 0))
        );
        assert_eq!(
            parse("     Summary [   0.1s] 1 test run: 1 passed (1 slow, 1 leaky), 1 exec failed, 3 skipped"),
            Some((Runner::Nextest, 1, 1, 3))
        );
        assert_eq!(
            parse("     Summary [   0.101s] 2/5 tests run: 1 passed, 1 failed, 2 skipped"),
            Some((Runner::Nextest, 1, 1, 2))
        );
    }

    #[test]
    fn go_packages_without_verbose() {
        // A failing package without -v prints only its failing tests; passing packages print
        // their package line only.
        let out = "--- FAIL: TestA (0.00s)\n    a_test.go:3: bad\nFAIL\nFAIL\tex.com/a\t0.01s\n\
                   ok  \tex.com/b\t0.02s\nok  \tex.com/c\t(cached)\n\
                   FAIL\tex.com/d [build failed]\npanic: test timed out after 1s\nFAIL\tex.com/e\t1.01s\nFAIL\n";
        assert_eq!(
            parse_counts(out),
            Some((
                Runner::GoTest,
                TestCounts {
                    passed: 2,
                    failed: 3,
                    skipped: 0
                }
            ))
        );
        // Bare PASS / FAIL / ok words are not package lines.
        assert_eq!(parse_counts("PASS\nFAIL\nok\n"), None);
    }

    #[test]
    fn serde_shapes() {
        assert_eq!(
            serde_json::to_string(&Runner::GoTest).unwrap(),
            "\"go_test\""
        );
        assert_eq!(
            serde_json::to_string(&TestOutcome::Exited { code: 1 }).unwrap(),
            r#"{"kind":"exited","code":1}"#
        );
        let s = test_signal(&exited(0), "3 passed, 1 failed");
        let back: TestSignal = serde_json::from_str(&serde_json::to_string(&s).unwrap()).unwrap();
        assert_eq!(back, s);
    }
}
