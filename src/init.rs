//! forkfleet as a container's first process (PID 1): an init that starts forkfleet again as
//! its only child, passes it every signal an operator or the runtime sends, reaps every
//! process that ends in the PID namespace (orphans of commands become its children), and
//! exits as its child did (ADR 43).
//!
//! Without it, a container that runs `forkfleet` with no init of its own keeps every
//! orphan that ends as a zombie: PID 1 inherits them and nothing waits for them. With a
//! real init in the image (tini, `--init`, `shareProcessNamespace`), forkfleet is not PID 1
//! and this does nothing. `FORKFLEET_INIT=off` turns it off.

use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::process::Command;

/// The signals the init keeps to itself, or cannot take: SIGCHLD is its own; SIGKILL and
/// SIGSTOP cannot be caught; the synchronous ones (a fault of the init itself) are not
/// anyone's to pass on; SIGTTIN and SIGTTOU concern its own terminal. Every other signal
/// (SIGTERM, a Dockerfile's STOPSIGNAL, `docker kill -s`, the real-time ones) goes to the
/// child: as PID 1 a signal the init neither blocks nor handles would be dropped.
const KEPT: [libc::c_int; 12] = [
    libc::SIGCHLD,
    libc::SIGKILL,
    libc::SIGSTOP,
    libc::SIGSEGV,
    libc::SIGBUS,
    libc::SIGILL,
    libc::SIGFPE,
    libc::SIGTRAP,
    libc::SIGSYS,
    libc::SIGABRT,
    libc::SIGTTIN,
    libc::SIGTTOU,
];

/// The environment variable that turns the init off (`off`).
pub const INIT_ENV: &str = "FORKFLEET_INIT";

/// When this process is PID 1 (and `FORKFLEET_INIT` is not `off`): run forkfleet again as
/// a child with the same arguments, serve as its init, and return the exit code to end
/// with. `None` otherwise (go on as usual). Call first in `main`, before any thread starts.
pub fn run_if_pid1() -> Option<u8> {
    // SAFETY: getpid has no preconditions.
    if unsafe { libc::getpid() } != 1 {
        return None;
    }
    if std::env::var_os(INIT_ENV).is_some_and(|v| v.eq_ignore_ascii_case("off")) {
        return None;
    }
    match serve() {
        Ok(code) => Some(code),
        Err(e) => {
            eprintln!("error: forkfleet is PID 1 and cannot serve as the init ({e}); set {INIT_ENV}=off to run without one");
            Some(1)
        }
    }
}

fn serve() -> std::io::Result<u8> {
    let set = signal_set()?;
    // Blocked before the child starts, so none is lost; the child starts with the mask
    // this process had (a blocked mask is inherited across `exec`: without this, the child
    // would never see SIGTERM).
    // SAFETY: an all-zero sigset_t is a valid value, overwritten by pthread_sigmask.
    let mut before: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is an initialised signal set; no other thread runs yet.
    let rc = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, &mut before) };
    if rc != 0 {
        return Err(std::io::Error::from_raw_os_error(rc));
    }
    // The running binary itself, even if its file was replaced or deleted since, under the
    // name it was started by.
    let mut argv = std::env::args_os();
    let arg0 = argv.next().unwrap_or_else(|| OsString::from("forkfleet"));
    let mut command = Command::new("/proc/self/exe");
    command.arg0(arg0).args(argv);
    // SAFETY: between fork and exec the closure calls only pthread_sigmask, which is
    // async-signal-safe, on a mask copied before the fork.
    unsafe {
        command.pre_exec(move || {
            match libc::pthread_sigmask(libc::SIG_SETMASK, &before, std::ptr::null_mut()) {
                0 => Ok(()),
                rc => Err(std::io::Error::from_raw_os_error(rc)),
            }
        });
    }
    let child = command.spawn()?;
    let pid = libc::pid_t::try_from(child.id())
        .map_err(|_| std::io::Error::other("the child's pid does not fit a pid_t"))?;
    // The child is waited for below, with every other process that ends.
    drop(child);
    loop {
        // SAFETY: `set` is initialised; a null info pointer is allowed.
        let sig = unsafe { libc::sigwaitinfo(&set, std::ptr::null_mut()) };
        if sig < 0 {
            let err = std::io::Error::last_os_error();
            if err.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(err);
        }
        if sig == libc::SIGCHLD {
            if let Some(code) = reap(pid) {
                return Ok(code);
            }
        } else {
            // SAFETY: kill with a valid pid and signal number.
            unsafe { libc::kill(pid, sig) };
        }
    }
}

/// Reap every process that has ended; the exit code to end with once `child` is among
/// them (its status, or 128 plus the signal that killed it).
fn reap(child: libc::pid_t) -> Option<u8> {
    let mut code = None;
    loop {
        let mut status: libc::c_int = 0;
        // SAFETY: waitpid writes the status to a valid pointer.
        let pid = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
        if pid <= 0 {
            return code;
        }
        if pid == child {
            code = Some(if libc::WIFEXITED(status) {
                u8::try_from(libc::WEXITSTATUS(status)).unwrap_or(1)
            } else if libc::WIFSIGNALED(status) {
                u8::try_from(128 + libc::WTERMSIG(status)).unwrap_or(1)
            } else {
                1
            });
        }
    }
}

/// Every signal but those of [`KEPT`]: what the init passes on.
fn forwarded_set() -> std::io::Result<libc::sigset_t> {
    let mut set = std::mem::MaybeUninit::<libc::sigset_t>::uninit();
    // SAFETY: sigfillset initialises the set it is given; sigdelset takes valid signals.
    unsafe {
        check(libc::sigfillset(set.as_mut_ptr()))?;
        for sig in KEPT {
            check(libc::sigdelset(set.as_mut_ptr(), sig))?;
        }
        Ok(set.assume_init())
    }
}

/// The signals the init waits for: those it passes on, and SIGCHLD.
fn signal_set() -> std::io::Result<libc::sigset_t> {
    let mut set = forwarded_set()?;
    // SAFETY: sigaddset on an initialised set with a valid signal.
    check(unsafe { libc::sigaddset(&mut set, libc::SIGCHLD) })?;
    Ok(set)
}

fn check(rc: libc::c_int) -> std::io::Result<()> {
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}
