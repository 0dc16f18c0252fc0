//! Output that goes to a pipe or a file, as a script sees it: no colour codes, and a
//! reader that goes away (`| head`) ends the command quietly (issue 13, defect 7).

use super::harness::{command, json, path_str, run_spec, stderr, Example};
use std::os::fd::FromRawFd;
use std::process::Stdio;

/// Log lines on a stderr that is not a terminal carry no ANSI codes.
#[test]
fn log_lines_on_a_pipe_have_no_colour_codes() {
    let ex = Example::quickstart();
    let out = command()
        .env("RUST_LOG", "info")
        .args(["run", path_str(&ex.spec()), "--json", "--timeout-s", "120"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(err.contains(" INFO "), "expected info lines: {err}");
    assert!(!err.contains('\u{1b}'), "colour codes on a pipe: {err:?}");
}

/// `forkfleet log RUN` into a pipe whose reader has gone: no panic, no error message,
/// ended by the broken pipe as a Unix filter is.
#[test]
fn a_closed_pipe_ends_the_command_quietly() {
    let ex = Example::quickstart();
    let doc = json(&run_spec(&ex.spec()));
    let run = doc["branches"][0]["id"].as_str().unwrap().to_string();
    // A pipe whose read end is closed before the command writes: its first write fails.
    let mut fds = [0; 2];
    // SAFETY: `pipe` fills two new descriptors; the read end is closed at once and the
    // write end is owned by the `Stdio` from here on.
    let stdout = unsafe {
        assert_eq!(libc::pipe(fds.as_mut_ptr()), 0);
        libc::close(fds[0]);
        Stdio::from_raw_fd(fds[1])
    };
    let out = command()
        .args(["log", &run, "--data", path_str(&ex.data())])
        .stdout(stdout)
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    let err = stderr(&out);
    assert!(!err.contains("panicked"), "{err}");
    assert!(
        err.is_empty(),
        "nothing to say about a reader that left: {err}"
    );
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(out.status.signal(), Some(libc::SIGPIPE), "{:?}", out.status);
}
