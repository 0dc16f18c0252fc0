//! A worker reaps what its commands leave behind (ADR 43).
//!
//! A command may leave processes running: `sh -c 'daemon &'`, a test runner's helpers, a
//! process that called `setsid`. The worker kills a command's process group when it ends,
//! but what left the group, and what its parent left when it died, is an orphan: the
//! kernel hands it to the nearest subreaper, else to PID 1. [`install`] makes the worker a
//! subreaper (`PR_SET_CHILD_SUBREAPER`), so orphans stay in its tree instead of escaping to
//! the host or the container's first process, and reaps each that ends, on every
//! `SIGCHLD`. It never reaps a command the worker started itself (those are reaped by their
//! pidfd, `crate::runner::spawn`), nor a child in the worker's own process group.

use std::collections::BTreeSet;
use std::time::Duration;

/// A sweep for ended orphans when no SIGCHLD came for this long.
const SWEEP: Duration = Duration::from_secs(30);

/// Make this process a subreaper and reap its orphans as they end, on the runtime. A
/// process that is not a worker (the embedded system, the client) leaves orphans to its
/// parent's init, as any program does.
pub fn install() -> std::io::Result<tokio::task::JoinHandle<()>> {
    // SAFETY: prctl with PR_SET_CHILD_SUBREAPER takes one integer argument.
    if unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut sigchld = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::child())?;
    Ok(tokio::spawn(async move {
        loop {
            // Off the runtime: reading /proc, and the moments no command may start.
            if let Ok(n) = tokio::task::spawn_blocking(reap_orphans).await {
                if n > 0 {
                    tracing::debug!(reaped = n, "worker.reaper: orphans of commands reaped");
                }
            }
            // On SIGCHLD, and a sweep now and then: the kernel's list of children can miss
            // one that is ending while it is read.
            tokio::select! {
                got = sigchld.recv() => if got.is_none() { break },
                _ = tokio::time::sleep(SWEEP) => {}
            }
        }
    }))
}

/// Reap every child of this process that has ended and that nothing else here waits for:
/// not a command this process started, not a child in its own process group. How many.
pub fn reap_orphans() -> usize {
    // SAFETY: getpgrp has no preconditions.
    let own_group = unsafe { libc::getpgrp() };
    let mut reaped = 0;
    for pid in children() {
        let Some((state, group)) = state_and_group(pid) else {
            continue;
        };
        if state != 'Z' || group == own_group {
            continue;
        }
        // Decided while no command starts, so every command started is registered.
        let _gate = crate::runner::spawn::exclusive();
        if crate::runner::spawn::started(pid) {
            continue;
        }
        let mut status = 0;
        // SAFETY: waitpid on a child of ours that has ended, with a valid status pointer.
        if unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) } == pid {
            reaped += 1;
        }
    }
    reaped
}

/// The children of this process: what `/proc/self/task/*/children` lists, else (a kernel
/// without it) every process whose parent this one is.
fn children() -> BTreeSet<libc::pid_t> {
    let mut out = BTreeSet::new();
    let mut listed = false;
    if let Ok(tasks) = std::fs::read_dir("/proc/self/task") {
        for task in tasks.flatten() {
            if let Ok(text) = std::fs::read_to_string(task.path().join("children")) {
                listed = true;
                out.extend(
                    text.split_whitespace()
                        .filter_map(|p| p.parse::<libc::pid_t>().ok()),
                );
            }
        }
    }
    if listed {
        return out;
    }
    // SAFETY: getpid has no preconditions.
    let me = unsafe { libc::getpid() };
    if let Ok(procs) = std::fs::read_dir("/proc") {
        for p in procs.flatten() {
            let Some(pid) = p.file_name().to_str().and_then(|s| s.parse().ok()) else {
                continue;
            };
            if parent_of(pid) == Some(me) {
                out.insert(pid);
            }
        }
    }
    out
}

/// The fields of `/proc/<pid>/stat` after the command name (which may hold spaces and
/// parentheses: it ends at the last `)`).
fn stat_fields(pid: libc::pid_t) -> Option<Vec<String>> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &text[text.rfind(')')? + 1..];
    Some(rest.split_whitespace().map(str::to_string).collect())
}

/// A process's state letter and process group.
fn state_and_group(pid: libc::pid_t) -> Option<(char, libc::pid_t)> {
    let f = stat_fields(pid)?;
    Some((f.first()?.chars().next()?, f.get(2)?.parse().ok()?))
}

fn parent_of(pid: libc::pid_t) -> Option<libc::pid_t> {
    stat_fields(pid)?.get(1)?.parse().ok()
}
