//! Starting a command without copying the worker: `clone(CLONE_VM | CLONE_VFORK)`, as
//! `posix_spawn` does, with the sandbox applied in the child before `exec` (ADR 33).
//!
//! `std::process::Command` forks as soon as code must run between fork and exec (the
//! mount and the confinement of [`super::layered::Mount`] and [`super::sandbox`]). A fork
//! copies the worker's page tables and marks its memory copy-on-write: every page the
//! worker's other threads then write is faulted and copied once per command, which in a
//! worker holding a 14,000-file manifest was most of a sandboxed command's cost. A child
//! sharing the worker's memory until its `exec` copies nothing; the calling thread waits
//! for the `exec` (or the child's exit), the others run on.
//!
//! The child runs on a stack of its own, with every signal blocked, and makes only system
//! calls on memory made before the `clone` (no allocation, no lock): its standard streams,
//! its own process group, the working directory, the mount and the confinement, the
//! signal dispositions reset, then `execve` of each candidate path in turn, as `execvp`
//! does. A failure is written to memory the caller reads after the `clone` returns.

use super::layered::Mount;
use super::sandbox::Confinement;
use std::collections::BTreeMap;
use std::ffi::{CStr, CString};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::ExitStatus;
use std::sync::atomic::{AtomicI32, Ordering};
use tokio::io::unix::AsyncFd;
use tokio::net::unix::pipe;

/// Held for reading by every `spawn` from before its `clone` until the child is
/// registered (spawns run side by side), and for writing by `crate::reaper` while it decides
/// whether to reap a process: a command is always registered before a reaper can see it.
static GATE: std::sync::RwLock<()> = std::sync::RwLock::new(());

/// The commands this process started and reaps itself (by their pidfd), counted by pid
/// (a pid reused by a new command before the old one is forgotten stays registered), from
/// the `clone` until they are reaped: `crate::reaper` never reaps one of them.
static STARTED: std::sync::Mutex<BTreeMap<libc::pid_t, u32>> =
    std::sync::Mutex::new(BTreeMap::new());

fn registry() -> std::sync::MutexGuard<'static, BTreeMap<libc::pid_t, u32>> {
    STARTED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// While the returned guard is held no command starts, and [`started`] says whether a
/// process is a command this process reaps itself.
pub(crate) fn exclusive() -> std::sync::RwLockWriteGuard<'static, ()> {
    GATE.write()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Whether `pid` is a command this process started and has not reaped.
pub(crate) fn started(pid: libc::pid_t) -> bool {
    registry().contains_key(&pid)
}

fn register(pid: libc::pid_t) {
    *registry().entry(pid).or_insert(0) += 1;
}

/// A reaped command is no longer this process's to reap.
fn forget(pid: libc::pid_t) {
    let mut started = registry();
    if let Some(n) = started.get_mut(&pid) {
        *n -= 1;
        if *n == 0 {
            started.remove(&pid);
        }
    }
}

/// The child's stack. It runs a few system calls; the pages it does not touch are never
/// allocated.
const CHILD_STACK_BYTES: usize = 256 << 10;

/// What to start.
pub struct Start<'a> {
    pub program: &'a str,
    pub args: &'a [String],
    /// Where the child starts (before a mount enters the tree again).
    pub dir: &'a Path,
    /// The whole environment.
    pub env: &'a [(String, String)],
    pub mount: Option<&'a Mount>,
    pub confinement: Option<&'a Confinement>,
}

/// A started command: the leader of its own process group, its stdout and stderr.
pub struct Child {
    pid: u32,
    pidfd: AsyncFd<OwnedFd>,
    pub stdout: Option<pipe::Receiver>,
    pub stderr: Option<pipe::Receiver>,
    status: Option<ExitStatus>,
}

/// Everything the child reads, made before the `clone`; `error` is what it writes.
struct Plan<'a> {
    argv: *const *const libc::c_char,
    envp: *const *const libc::c_char,
    /// The paths to `execve`, in order (one, or one per `PATH` directory).
    candidates: &'a [CString],
    dir: &'a CStr,
    stdin: RawFd,
    stdout: RawFd,
    stderr: RawFd,
    mount: Option<&'a Mount>,
    confinement: Option<&'a Confinement>,
    /// The `errno` of the step that failed (0: none).
    error: AtomicI32,
    /// The step the child was at ([`Step`]), for the error the caller reports.
    step: AtomicI32,
}

/// The steps of the child before its `exec`, named in the error when one fails: a
/// missing file reads differently when the mount failed than when the program is missing.
#[derive(Clone, Copy)]
#[repr(i32)]
enum Step {
    Streams = 1,
    Directory,
    Group,
    Mount,
    Confine,
    Exec,
}

impl Step {
    fn of(n: i32) -> Option<Self> {
        [
            Self::Streams,
            Self::Directory,
            Self::Group,
            Self::Mount,
            Self::Confine,
            Self::Exec,
        ]
        .into_iter()
        .find(|s| *s as i32 == n)
    }

    /// What failed, for the message (`None`: the program itself, as `Command` says it).
    fn doing(self) -> Option<&'static str> {
        match self {
            Self::Streams => Some("setting up its output"),
            Self::Directory => Some("entering its directory"),
            Self::Group => Some("starting its process group"),
            Self::Mount => Some("mounting its layered tree (overlayfs in a user namespace)"),
            Self::Confine => Some("applying the sandbox (Landlock and limits)"),
            Self::Exec => None,
        }
    }
}

fn cstring(s: impl AsRef<[u8]>, what: &str) -> std::io::Result<CString> {
    CString::new(s.as_ref().to_vec()).map_err(|_| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("{what} has a NUL byte"),
        )
    })
}

/// The paths `execvp` would try for `program`: itself when it names a path, else each
/// directory of the command's `PATH` (relative ones from `dir`, where the child runs).
fn candidates(
    program: &str,
    env: &[(String, String)],
    dir: &Path,
) -> std::io::Result<Vec<CString>> {
    if program.contains('/') {
        return Ok(vec![cstring(program, "the program")?]);
    }
    let path = env
        .iter()
        .find(|(k, _)| k == "PATH")
        .map_or("/usr/local/bin:/usr/bin:/bin", |(_, v)| v.as_str());
    path.split(':')
        .map(|d| {
            let d = if d.is_empty() { "." } else { d };
            let full = dir.join(d).join(program);
            cstring(full.as_os_str().as_bytes(), "the program's path")
        })
        .collect()
}

/// A pipe, both ends close-on-exec: (read, write).
fn pipe_pair() -> std::io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as RawFd; 2];
    // SAFETY: `fds` is a valid array of two descriptors to fill.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: both descriptors were just opened and are owned here alone.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Start `start`: stdin `/dev/null`, stdout and stderr piped, in a process group of its
/// own. `Err`: it could not be started (no such program, the mount or the confinement
/// failed), as `std::process::Command::spawn` says it.
pub fn spawn(start: &Start<'_>) -> std::io::Result<Child> {
    let candidates = candidates(start.program, start.env, start.dir)?;
    let mut words = Vec::with_capacity(start.args.len() + 1);
    words.push(cstring(start.program, "the program")?);
    for a in start.args {
        words.push(cstring(a, "an argument")?);
    }
    let env: Vec<CString> = start
        .env
        .iter()
        .map(|(k, v)| cstring(format!("{k}={v}"), "the environment"))
        .collect::<Result<_, _>>()?;
    let mut argv: Vec<*const libc::c_char> = words.iter().map(|w| w.as_ptr()).collect();
    argv.push(std::ptr::null());
    let mut envp: Vec<*const libc::c_char> = env.iter().map(|e| e.as_ptr()).collect();
    envp.push(std::ptr::null());
    let dir = cstring(start.dir.as_os_str().as_bytes(), "the directory")?;
    let stdin = std::fs::File::open("/dev/null")?;
    let (out_r, out_w) = pipe_pair()?;
    let (err_r, err_w) = pipe_pair()?;
    let plan = Plan {
        argv: argv.as_ptr(),
        envp: envp.as_ptr(),
        candidates: &candidates,
        dir: &dir,
        stdin: stdin.as_raw_fd(),
        stdout: out_w.as_raw_fd(),
        stderr: err_w.as_raw_fd(),
        mount: start.mount,
        confinement: start.confinement,
        error: AtomicI32::new(0),
        step: AtomicI32::new(0),
    };
    let stack = Stack::new()?;
    let mut pidfd: RawFd = -1;
    // SAFETY: every signal blocked in this thread while the child shares its memory (no
    // handler of the worker's runs in the child), restored afterwards; `clone` runs
    // `child` on a stack of its own with `plan`, which outlives it: with CLONE_VFORK this
    // thread resumes only once the child has called `execve` or `_exit`.
    // Registered before any reaper can see it end.
    let gate = GATE
        .read()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let pid = unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        let mut old: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut old);
        let pid = libc::clone(
            child,
            stack.top(),
            libc::CLONE_VM | libc::CLONE_VFORK | libc::CLONE_PIDFD | libc::SIGCHLD,
            (&plan as *const Plan<'_>).cast_mut().cast(),
            &mut pidfd as *mut RawFd,
        );
        let cloned = std::io::Error::last_os_error();
        libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut());
        if pid < 0 {
            return Err(cloned);
        }
        pid
    };
    register(pid);
    drop(gate);
    drop(stack);
    drop((out_w, err_w, stdin));
    // SAFETY: CLONE_PIDFD gave this descriptor to the caller alone.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd) };
    let error = plan.error.load(Ordering::SeqCst);
    if error != 0 {
        // The child has exited: reap it.
        let _ = reap(&pidfd, 0);
        forget(pid);
        let cause = std::io::Error::from_raw_os_error(error);
        return Err(
            match Step::of(plan.step.load(Ordering::SeqCst)).and_then(Step::doing) {
                Some(doing) => std::io::Error::new(cause.kind(), format!("{doing}: {cause}")),
                None => cause,
            },
        );
    }
    // SAFETY: an `OwnedFd` stays open, the same descriptor, while the `AsyncFd` holds it.
    let pidfd =
        match unsafe { AsyncFd::register_with_interest(pidfd, tokio::io::Interest::READABLE) } {
            Ok(fd) => fd,
            Err(e) => {
                let (pidfd, cause) = e.into_parts();
                // SAFETY: signalling the child just started, not yet reaped.
                unsafe { libc::kill(pid, libc::SIGKILL) };
                let _ = reap(&pidfd, 0);
                forget(pid);
                return Err(cause);
            }
        };
    // From here the child is killed and reaped if dropped.
    let mut child = Child {
        pid: pid as u32,
        pidfd,
        stdout: None,
        stderr: None,
        status: None,
    };
    child.stdout = Some(pipe::Receiver::from_owned_fd(out_r)?);
    child.stderr = Some(pipe::Receiver::from_owned_fd(err_r)?);
    Ok(child)
}

/// The child's stack: anonymous memory below which a page is left inaccessible (an
/// overflow faults rather than writing into the worker's memory), freed when dropped.
struct Stack(*mut libc::c_void);

/// The inaccessible page below the stack.
const GUARD_BYTES: usize = 4096;

impl Stack {
    fn new() -> std::io::Result<Self> {
        // SAFETY: a fresh private anonymous mapping, checked, then its lowest page made
        // inaccessible.
        unsafe {
            let p = libc::mmap(
                std::ptr::null_mut(),
                GUARD_BYTES + CHILD_STACK_BYTES,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_STACK,
                -1,
                0,
            );
            if p == libc::MAP_FAILED {
                return Err(std::io::Error::last_os_error());
            }
            let stack = Self(p);
            if libc::mprotect(p, GUARD_BYTES, libc::PROT_NONE) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(stack)
        }
    }

    /// Its highest address (stacks grow down), page-aligned.
    fn top(&self) -> *mut libc::c_void {
        // SAFETY: one past the end of the mapping, which `clone` takes as the stack's top.
        unsafe {
            self.0
                .cast::<u8>()
                .add(GUARD_BYTES + CHILD_STACK_BYTES)
                .cast()
        }
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, no longer used (the child has exec'd or exited).
        unsafe { libc::munmap(self.0, GUARD_BYTES + CHILD_STACK_BYTES) };
    }
}

/// Descriptor `fd` as `target` in the child, without close-on-exec.
///
/// # Safety
/// Only in the child: plain system calls on integers.
unsafe fn install(fd: RawFd, target: RawFd) -> bool {
    // SAFETY: plain system calls on integers.
    unsafe {
        if fd == target {
            libc::fcntl(fd, libc::F_SETFD, 0) == 0
        } else {
            libc::dup2(fd, target) == target
        }
    }
}

/// The child, between `clone` and `execve`: only system calls on memory made before the
/// `clone`, no allocation, no lock.
extern "C" fn child(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: `arg` is the caller's `Plan`, alive until this child execs or exits.
    let plan = unsafe { &*(arg as *const Plan<'_>) };
    let errno = || {
        std::io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EIO)
    };
    let at = |step: Step| plan.step.store(step as i32, Ordering::SeqCst);
    // SAFETY: plain system calls on descriptors and C strings made before the clone.
    unsafe {
        at(Step::Streams);
        if !install(plan.stdin, 0) || !install(plan.stdout, 1) || !install(plan.stderr, 2) {
            fail(plan, errno());
        }
        at(Step::Directory);
        if libc::chdir(plan.dir.as_ptr()) != 0 {
            fail(plan, errno());
        }
        at(Step::Group);
        if libc::setpgid(0, 0) != 0 {
            fail(plan, errno());
        }
    }
    at(Step::Mount);
    if let Some(m) = plan.mount {
        if let Err(e) = m.apply() {
            fail(plan, e.raw_os_error().unwrap_or(libc::EIO));
        }
    }
    at(Step::Confine);
    if let Some(c) = plan.confinement {
        if let Err(e) = c.apply() {
            fail(plan, e.raw_os_error().unwrap_or(libc::EIO));
        }
    }
    // SAFETY: the dispositions of this child alone (no CLONE_SIGHAND): handlers back to
    // the default (the worker's must not run here), SIGPIPE too (the Rust runtime ignores
    // it; a command expects the default), then nothing blocked, as `Command` leaves it.
    unsafe {
        for sig in 1..65 {
            let mut now: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(sig, std::ptr::null(), &mut now) != 0 {
                continue;
            }
            if now.sa_sigaction != libc::SIG_DFL
                && (now.sa_sigaction != libc::SIG_IGN || sig == libc::SIGPIPE)
            {
                let mut dfl: libc::sigaction = std::mem::zeroed();
                dfl.sa_sigaction = libc::SIG_DFL;
                libc::sigaction(sig, &dfl, std::ptr::null_mut());
            }
        }
        let mut none: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut none);
        libc::pthread_sigmask(libc::SIG_SETMASK, &none, std::ptr::null_mut());
    }
    at(Step::Exec);
    // As `execvp`: the first candidate that runs; a permission error remembered over a
    // missing file.
    let mut first = libc::ENOENT;
    for path in plan.candidates {
        // SAFETY: NUL-terminated arrays of C strings made before the clone.
        unsafe { libc::execve(path.as_ptr(), plan.argv, plan.envp) };
        let e = errno();
        match e {
            libc::ENOENT | libc::ENOTDIR => {}
            libc::EACCES => first = libc::EACCES,
            other => fail(plan, other),
        }
    }
    fail(plan, first)
}

/// In the child: report `errno` to the caller and end, running nothing of the worker's.
fn fail(plan: &Plan<'_>, errno: i32) -> ! {
    plan.error.store(errno.max(1), Ordering::SeqCst);
    // SAFETY: `_exit` ends the child at once.
    unsafe { libc::_exit(127) }
}

/// Reap the child behind `pidfd` with `waitid` and `flags`: waiting for it to exit, or
/// with `WNOHANG` `None` while it runs. Asks again when a signal interrupts.
fn reap(pidfd: &OwnedFd, flags: libc::c_int) -> std::io::Result<Option<ExitStatus>> {
    loop {
        // SAFETY: `info` is written by waitid; the descriptor is a pidfd.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        let r = unsafe {
            libc::waitid(
                libc::P_PIDFD,
                pidfd.as_raw_fd() as libc::id_t,
                &mut info,
                libc::WEXITED | flags,
            )
        };
        if r != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return Err(e);
        }
        // SAFETY: waitid filled `info`; a zero pid means not exited yet (`WNOHANG`).
        return Ok((unsafe { info.si_pid() } != 0).then(|| status_of(&info)));
    }
}

/// The wait status `waitpid` would have given, from `waitid`'s report.
fn status_of(info: &libc::siginfo_t) -> ExitStatus {
    // SAFETY: a report of an exited child: `si_status` is set.
    let status = unsafe { info.si_status() };
    let raw = match info.si_code {
        libc::CLD_EXITED => (status & 0xff) << 8,
        libc::CLD_DUMPED => (status & 0x7f) | 0x80,
        _ => status & 0x7f,
    };
    ExitStatus::from_raw(raw)
}

impl Child {
    /// The leader's process ID, also its group's.
    pub fn id(&self) -> u32 {
        self.pid
    }

    /// Wait for the leader to exit (cancel-safe; again after it did: the same status).
    pub async fn wait(&mut self) -> std::io::Result<ExitStatus> {
        if let Some(s) = self.status {
            return Ok(s);
        }
        loop {
            let mut ready = self.pidfd.readable().await?;
            match reap(self.pidfd.get_ref(), libc::WNOHANG)? {
                Some(s) => {
                    self.status = Some(s);
                    forget(self.pid as libc::pid_t);
                    return Ok(s);
                }
                None => ready.clear_ready(),
            }
        }
    }
}

impl Drop for Child {
    /// Not waited for: killed (its group is the caller's to kill) and reaped off this
    /// thread.
    fn drop(&mut self) {
        if self.status.is_some() {
            return;
        }
        // SAFETY: signalling the child this value started, not yet reaped (its ID is ours).
        unsafe { libc::kill(self.pid as libc::pid_t, libc::SIGKILL) };
        let fd = match self.pidfd.get_ref().try_clone() {
            Ok(fd) => fd,
            Err(_) => {
                // Left to a reaper of orphans, if this process has one.
                forget(self.pid as libc::pid_t);
                return;
            }
        };
        let pid = self.pid as libc::pid_t;
        let spawned = std::thread::Builder::new()
            .name("forkfleet-reap".into())
            .spawn(move || {
                let _ = reap(&fd, 0);
                forget(pid);
            });
        if spawned.is_err() {
            // Left to a reaper of orphans, if this process has one.
            forget(pid);
        }
    }
}
