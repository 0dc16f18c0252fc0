//! The command sandbox (ADR 22): what a `run_command` call or a resolve's test command may
//! reach, applied to the command's process between its start and exec
//! ([`super::spawn`]).
//!
//! - **Filesystem** (Landlock): read, write and execute in the command's writable
//!   directories (the tree, its scratch `HOME` and `TMPDIR`); read and execute in the system
//!   directories ([`SYSTEM_EXEC`]) and the directories on the worker's `PATH` with the toolchains they belong to
//!   ([`toolchain_dirs`]; never a spec's `env.PATH`); read only
//!   in [`SYSTEM_READ`] (`/etc`, `/sys`), the system-wide entries of `/proc` (`cpuinfo`,
//!   `meminfo`, `sys/`, ...: every entry but the per-process directories) and the command's
//!   own `/proc/<pid>` (granted in the child, see below); read and write (not list) the
//!   character devices in [`DEVICES`]. Nothing else: not the worker's other temporary directories
//!   (other branches' trees), not its key files, not the home directory it runs in. A path
//!   the worker protects ([`protect`]: its catalogue's key files) is left out even when it
//!   lies below one of those directories: the directory is granted entry by entry around it.
//!   `/proc/<pid>` of any other process stays closed: the worker's `environ` (its API keys
//!   when they come from the environment) would otherwise be readable, since Landlock's
//!   ptrace check guards only attaching (`mem`), not reading `environ` or `maps`. The
//!   processes a command starts do not see their own `/proc/<pid>` either (`/proc/self/fd`
//!   cannot be listed there; reading the links, `readlink /proc/self/exe`, works).
//! - **Network**: with `network = false`, TCP bind and connect are refused (Landlock network
//!   rules, ABI 4 and later; a newer kernel's UDP rules too). Connecting to an abstract unix
//!   socket made outside the sandbox and signalling a process outside it are refused
//!   whatever `network` says (Landlock scopes, ABI 6).
//! - **Limits** (`setrlimit`, soft and hard, never above the worker's own hard limit):
//!   `RLIMIT_NPROC` (`max_processes`; the kernel counts every process of the user, and not
//!   for root), `RLIMIT_DATA` (`max_memory_mb`, per process: heap and private writable
//!   mappings, not the address space reserved by runtimes such as V8 or Go), `RLIMIT_FSIZE`
//!   (`max_file_size_mb`: a write past it raises `SIGXFSZ`, which kills the process unless
//!   it ignores the signal, and then fails with `EFBIG`), and `RLIMIT_CORE` 0 (no core
//!   files in the tree).
//!
//! The ruleset is built in the worker ([`prepare`]): paths opened, rules added, limits
//! computed, everything that allocates or may fail in an interesting way. Between fork and
//! exec the child only makes plain system calls ([`Confinement::apply`]): `setrlimit`,
//! `open("/proc/self")` and `landlock_add_rule` (its own `/proc/<pid>`, which only the
//! child can name), `close`, `prctl(PR_SET_NO_NEW_PRIVS)` and `landlock_restrict_self` on
//! the ruleset's descriptor (inherited through the fork, closed by the exec: Landlock
//! ruleset descriptors are close-on-exec); all async-signal-safe, no allocation, no lock. The `landlock` crate's
//! own `restrict_self` is not called there: it builds a status and error values; the raw
//! call is the same system call.
//!
//! Support is checked once ([`support`]): the kernel's Landlock ABI, lowered by
//! [`ABI_OVERRIDE_ENV`] when set (`FORKFLEET_SANDBOX_ABI=0` makes a worker behave as on a
//! kernel without Landlock, for tests and for trying `sandbox = "required"`). With
//! `sandbox = "auto"` a kernel without Landlock runs commands with the limits only; with
//! `"required"` the command is refused, naming why; with `"off"` nothing is applied.
//! A command blocked by the sandbox sees the system call fail (`EACCES`, `EPERM`): the model
//! reads that as the command's own error output.

use forkfleet_shared::endpoint::{CommandSandbox, SandboxMode};
use landlock::{
    Access, AccessFs, AccessNet, BitFlags, PathBeneath, PathFd, Ruleset, RulesetAttr,
    RulesetCreatedAttr, Scope, ABI,
};
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, Once, OnceLock};

/// Set to a number, the Landlock ABI the worker assumes at most (read once); `0`: behave as
/// on a kernel without Landlock.
pub const ABI_OVERRIDE_ENV: &str = "FORKFLEET_SANDBOX_ABI";

/// Read and execute: programs and their libraries.
pub const SYSTEM_EXEC: &[&str] = &[
    "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32",
];
/// Read only. `/etc` holds the dynamic linker's cache, users, locales and certificates a
/// command needs; a worker keeps no secret there (a key file it is told about is left out
/// all the same, see [`protect`]).
pub const SYSTEM_READ: &[&str] = &["/etc", "/sys"];
/// Character devices a command may open for reading and writing.
pub const DEVICES: &[&str] = &[
    "/dev/null",
    "/dev/zero",
    "/dev/full",
    "/dev/random",
    "/dev/urandom",
];
/// Files read through symlinks that may leave [`SYSTEM_READ`] (`/etc/resolv.conf` often
/// points into `/run`), granted when the network is on.
const NETWORK_FILES: &[&str] = &["/etc/resolv.conf", "/etc/hosts"];

/// What the kernel offers (after [`ABI_OVERRIDE_ENV`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Support {
    /// The Landlock ABI version; 0: no Landlock.
    pub abi: i32,
}

impl Support {
    pub fn landlock(self) -> bool {
        self.abi >= 1
    }

    /// TCP bind and connect rules (ABI 4, Linux 6.7).
    pub fn network_rules(self) -> bool {
        self.abi >= 4
    }

    fn abi(self) -> ABI {
        ABI::from(self.abi)
    }
}

/// The kernel's Landlock ABI, 0 when it has none (not built in, or not enabled at boot).
pub(super) fn kernel_abi() -> i32 {
    // SAFETY: `landlock_create_ruleset(NULL, 0, LANDLOCK_CREATE_RULESET_VERSION)` only
    // returns the ABI version (or -1); it reads no memory.
    let v = unsafe {
        libc::syscall(
            libc::SYS_landlock_create_ruleset,
            std::ptr::null::<libc::c_void>(),
            0usize,
            1u32,
        )
    };
    i32::try_from(v).unwrap_or(0).max(0)
}

/// A value of [`ABI_OVERRIDE_ENV`]: a non-negative number.
pub fn parse_abi_override(value: &str) -> Option<i32> {
    value.trim().parse::<i32>().ok().filter(|n| *n >= 0)
}

/// What commands are confined with on this worker: the kernel's Landlock
/// ([`kernel_support`]) when a command started under it ran (`super::setup`), else none.
pub fn support() -> Support {
    Support {
        abi: super::setup::setup().landlock_abi,
    }
}

/// What this worker's kernel offers, checked once per process.
pub fn kernel_support() -> Support {
    static SUPPORT: OnceLock<Support> = OnceLock::new();
    *SUPPORT.get_or_init(|| {
        let kernel = kernel_abi();
        let abi = match std::env::var(ABI_OVERRIDE_ENV)
            .ok()
            .as_deref()
            .and_then(parse_abi_override)
        {
            Some(n) => n.min(kernel),
            None => kernel,
        };
        Support { abi }
    })
}

/// True when a command run with `settings` is confined by Landlock here (the sandbox is
/// not off and the kernel has it): it then reaches no file outside its tree, `HOME`,
/// `TMPDIR` and the read-only system paths.
pub fn confines(settings: &CommandSandbox) -> bool {
    settings.mode != SandboxMode::Off && support().landlock()
}

/// Say once per process what the sandbox can enforce here (the probe of `super::setup`
/// says what commands get, in one info line): a warning when commands are not confined,
/// or are not kept off the network.
pub fn log_support() {
    static LOGGED: Once = Once::new();
    LOGGED.call_once(|| {
        let s = support();
        let overridden = std::env::var(ABI_OVERRIDE_ENV).is_ok();
        if !s.landlock() {
            tracing::warn!(
                landlock.abi = s.abi,
                overridden,
                "command sandbox: no usable Landlock here ({}); commands run with resource limits only, and a spec with `[run_command] sandbox = \"required\"` has its commands refused",
                no_landlock_reason()
            );
        } else if !s.network_rules() {
            tracing::warn!(
                landlock.abi = s.abi,
                overridden,
                "command sandbox: Landlock ABI {} confines the filesystem but has no network rules (ABI 4); commands are not kept off the network, and `sandbox = \"required\"` with `network = false` is refused",
                s.abi
            );
        }
    });
}

/// Why commands are not confined by Landlock on this worker.
fn no_landlock_reason() -> String {
    let setup = super::setup::setup();
    let overridden = if std::env::var(ABI_OVERRIDE_ENV).is_ok() {
        format!(", {ABI_OVERRIDE_ENV} is set")
    } else {
        String::new()
    };
    if setup.kernel_abi == 0 {
        format!("this worker's kernel has no Landlock{overridden}")
    } else {
        format!(
            "a command could not be started under Landlock ABI {} here: {}",
            setup.kernel_abi,
            setup.fallback.as_deref().unwrap_or("the probe failed")
        )
    }
}

fn protected() -> &'static Mutex<Vec<PathBuf>> {
    static PROTECTED: OnceLock<Mutex<Vec<PathBuf>>> = OnceLock::new();
    PROTECTED.get_or_init(Mutex::default)
}

/// Keep `paths` (the worker's key files, its data) out of every command's reach, even when
/// they lie below a system directory a command may read. Paths that do not exist are
/// ignored; outside the system directories nothing is granted anyway.
pub fn protect(paths: impl IntoIterator<Item = PathBuf>) {
    let mut canonical: Vec<PathBuf> = paths
        .into_iter()
        .filter_map(|p| std::fs::canonicalize(p).ok())
        .collect();
    if let Ok(mut list) = protected().lock() {
        list.append(&mut canonical);
        list.sort();
        list.dedup();
    }
}

/// The sandbox of one command.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SandboxSpec {
    /// The spec's settings.
    pub settings: CommandSandbox,
    /// The directories the command may write in (the tree, its `HOME` and `TMPDIR`); empty:
    /// the directory it runs in.
    pub writable: Vec<PathBuf>,
    /// The directories it may read and run programs from besides the system ones; empty:
    /// the worker's own `PATH` and the toolchains it names ([`toolchain_dirs`]).
    pub exec: Vec<PathBuf>,
    /// A layered tree: the mount the command's child makes before it is confined
    /// ([`super::layered::Mount`]); the tree's directory is then granted as mounted.
    pub layers: Option<super::layered::Dirs>,
}

/// A confinement ready to apply in a forked child.
#[derive(Debug)]
pub struct Confinement {
    /// The Landlock ruleset; `None`: limits only (no Landlock here).
    ruleset: Option<OwnedFd>,
    /// The rights on the child's own `/proc/<pid>` (Landlock access bits).
    own_proc: u64,
    nproc: libc::rlim_t,
    data: libc::rlim_t,
    fsize: libc::rlim_t,
    /// A layered tree's directory and the rights on it, granted after the mount (a rule
    /// made before it would name the directory under the mount).
    mounted: Option<(std::ffi::CString, u64)>,
}

impl Confinement {
    /// True when Landlock rules are applied (not only the limits).
    pub fn landlocked(&self) -> bool {
        self.ruleset.is_some()
    }

    /// Apply in the child, between its start and exec. Only async-signal-safe system calls: no
    /// allocation, no lock (`std::io::Error::last_os_error` allocates nothing).
    pub fn apply(&self) -> std::io::Result<()> {
        for (resource, value) in [
            (libc::RLIMIT_NPROC, self.nproc),
            (libc::RLIMIT_DATA, self.data),
            (libc::RLIMIT_FSIZE, self.fsize),
            (libc::RLIMIT_CORE, 0),
        ] {
            let limit = libc::rlimit {
                rlim_cur: value,
                rlim_max: value,
            };
            // SAFETY: `limit` is a valid rlimit for the duration of the call.
            if unsafe { libc::setrlimit(resource, &limit) } != 0 {
                return Err(std::io::Error::last_os_error());
            }
        }
        if let Some(fd) = &self.ruleset {
            // SAFETY: plain system calls on integers, a NUL-terminated literal, a stack
            // value and descriptors this value owns or opens.
            unsafe {
                if let Some((dir, access)) = &self.mounted {
                    if !grant_in_child(fd.as_raw_fd(), dir, *access)? {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                // Its own `/proc/<pid>`, which only the child can name (absent: no rule).
                grant_in_child(fd.as_raw_fd(), c"/proc/self", self.own_proc)?;
                if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if libc::syscall(libc::SYS_landlock_restrict_self, fd.as_raw_fd(), 0u32) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
        }
        Ok(())
    }
}

/// In a forked child: add a rule to the ruleset `ruleset` granting `access` below the
/// directory `dir`. `Ok(false)` when `dir` cannot be opened; only system calls, no
/// allocation.
///
/// # Safety
/// `ruleset` is a Landlock ruleset descriptor.
unsafe fn grant_in_child(
    ruleset: libc::c_int,
    dir: &std::ffi::CStr,
    access: u64,
) -> std::io::Result<bool> {
    // SAFETY: plain system calls on a C string, a stack value and a descriptor opened here.
    unsafe {
        let fd = libc::open(
            dir.as_ptr(),
            libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC,
        );
        if fd < 0 {
            return Ok(false);
        }
        let attr = PathBeneathAttr {
            allowed_access: access,
            parent_fd: fd,
        };
        let added = libc::syscall(
            libc::SYS_landlock_add_rule,
            ruleset,
            LANDLOCK_RULE_PATH_BENEATH,
            &attr as *const PathBeneathAttr,
            0u32,
        );
        libc::close(fd);
        if added != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(true)
}

/// The worker's own hard limit of `resource` (`RLIM_INFINITY` when unknown). A macro: the
/// resource's type differs between C libraries.
macro_rules! hard_limit {
    ($resource:expr) => {{
        let mut now = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: `now` is a valid rlimit to write into.
        if unsafe { libc::getrlimit($resource, &mut now) } == 0 {
            now.rlim_max
        } else {
            libc::RLIM_INFINITY
        }
    }};
}

/// `want`, but not above `hard` (raising a hard limit would fail).
fn capped(hard: libc::rlim_t, want: u64) -> libc::rlim_t {
    if hard == libc::RLIM_INFINITY {
        want
    } else {
        want.min(hard)
    }
}

/// `struct landlock_path_beneath_attr` of `<linux/landlock.h>` (packed).
#[repr(C, packed)]
struct PathBeneathAttr {
    allowed_access: u64,
    parent_fd: i32,
}

/// `LANDLOCK_RULE_PATH_BENEATH`.
const LANDLOCK_RULE_PATH_BENEATH: libc::c_int = 1;

/// The confinement of a command run with `spec`, on a kernel
/// offering `support`: `Ok(None)` when the sandbox is off, `Err` (the reason, for the
/// model) when it is required and cannot be applied or the ruleset cannot be built.
pub fn prepare(spec: &SandboxSpec, support: Support) -> Result<Option<Confinement>, String> {
    let settings = &spec.settings;
    if settings.mode == SandboxMode::Off {
        return Ok(None);
    }
    let mb = |n: u64| n.saturating_mul(1024 * 1024);
    let mut conf = Confinement {
        ruleset: None,
        own_proc: (AccessFs::ReadFile | AccessFs::ReadDir).bits(),
        nproc: capped(
            hard_limit!(libc::RLIMIT_NPROC),
            u64::from(settings.max_processes),
        ),
        data: capped(hard_limit!(libc::RLIMIT_DATA), mb(settings.max_memory_mb)),
        fsize: capped(
            hard_limit!(libc::RLIMIT_FSIZE),
            mb(settings.max_file_size_mb),
        ),
        mounted: None,
    };
    let required = settings.mode == SandboxMode::Required;
    if !support.landlock() {
        if required {
            return Err(format!(
                "the sandbox is required (`[run_command] sandbox = \"required\"`) but {}; the command was not run",
                no_landlock_reason()
            ));
        }
        return Ok(Some(conf));
    }
    if required && !settings.network && !support.network_rules() {
        return Err(format!(
            "the sandbox is required with `network = false` but this worker's kernel has Landlock ABI {} without network rules (ABI 4, Linux 6.7); the command was not run",
            support.abi
        ));
    }
    let fd = ruleset(spec, support)
        .map_err(|e| format!("the command sandbox could not be set up: {e}"))?;
    if let Some(layers) = &spec.layers {
        // Absolute: the child names it after entering the tree.
        let merged = std::path::absolute(&layers.merged)
            .map_err(|e| format!("the tree's directory cannot be made absolute: {e}"))?;
        let dir = std::ffi::CString::new(merged.as_os_str().as_encoded_bytes())
            .map_err(|_| "the tree's directory has a NUL byte".to_string())?;
        conf.mounted = Some((dir, AccessFs::from_all(support.abi()).bits()));
    }
    conf.ruleset = fd;
    Ok(Some(conf))
}

/// One rule: a path and what may be done below it.
struct Grant {
    path: PathBuf,
    access: BitFlags<AccessFs>,
}

/// The rules of a command's sandbox, in order: system paths, `PATH`, devices, the writable
/// directories.
fn grants(spec: &SandboxSpec, abi: ABI) -> Vec<Grant> {
    let read = AccessFs::ReadFile | AccessFs::ReadDir;
    let exec = AccessFs::from_read(abi);
    let file_rw = AccessFs::from_file(abi) & !BitFlags::from(AccessFs::Execute);
    let mut out = Vec::new();
    let mut push = |path: &Path, access: BitFlags<AccessFs>| {
        out.push(Grant {
            path: path.to_path_buf(),
            access,
        })
    };
    for p in SYSTEM_EXEC {
        push(Path::new(p), exec);
    }
    // The worker's own `PATH` only: a spec's `env.PATH` chooses where programs are looked
    // up, never what becomes readable (it could name any directory of the worker's).
    let dirs = if spec.exec.is_empty() {
        toolchain_dirs(
            &std::env::var("PATH").unwrap_or_default(),
            std::env::var_os("HOME").map(PathBuf::from).as_deref(),
        )
    } else {
        spec.exec.clone()
    };
    for dir in dirs {
        push(&dir, exec);
    }
    for p in SYSTEM_READ.iter().map(PathBuf::from).chain(proc_entries()) {
        push(&p, read);
    }
    if spec.settings.network {
        for p in NETWORK_FILES {
            push(Path::new(p), AccessFs::ReadFile.into());
        }
    }
    for p in DEVICES {
        push(Path::new(p), file_rw);
    }
    for dir in &spec.writable {
        push(dir, AccessFs::from_all(abi));
    }
    out
}

/// The directories a command may read and run programs from besides the system ones: every
/// absolute directory of the worker's `PATH` and, for one under the worker's home, the
/// toolchain it belongs to: the first directory below the home (`~/.pyenv` for
/// `~/.pyenv/shims`, whose shims run `~/.pyenv/libexec`; `~/.cargo`, with `~/.rustup`
/// that its proxies read; `~/.nvm`), except `~/.local`, of which only `bin`, `lib` and
/// `pipx` (`~/.local/share` may hold keyrings); and for a Python virtual environment's
/// `bin` (its parent holds `pyvenv.cfg`) or a `node_modules/.bin`, wherever they are, the
/// environment itself (how commands use an environment the snapshot skips: put its `bin`
/// on the worker's `PATH`, e.g. activate it before `forkfleet run`). The rest of the home
/// (`~/.ssh`, `~/.aws`, ...) stays closed.
pub fn toolchain_dirs(path_var: &str, home: Option<&Path>) -> Vec<PathBuf> {
    let home = home.filter(|h| h.is_absolute() && *h != Path::new("/"));
    let mut out: Vec<PathBuf> = Vec::new();
    let mut add = |p: PathBuf| {
        if !out.contains(&p) {
            out.push(p);
        }
    };
    for dir in path_var.split(':') {
        // Relative entries mean nothing here; `/` would open everything.
        if !dir.starts_with('/') || Path::new(dir) == Path::new("/") {
            continue;
        }
        let dir = PathBuf::from(dir);
        add(dir.clone());
        // A Python virtual environment's `bin` (its root holds `pyvenv.cfg`) or a
        // `node_modules/.bin`: the whole environment, its libraries included, read-only.
        if let Some(root) = dir.parent() {
            let venv =
                dir.file_name().is_some_and(|n| n == "bin") && root.join("pyvenv.cfg").is_file();
            let node = dir.file_name().is_some_and(|n| n == ".bin")
                && root.file_name().is_some_and(|n| n == "node_modules");
            if venv || node {
                add(root.to_path_buf());
            }
        }
        let Some(home) = home else { continue };
        let Ok(rel) = dir.strip_prefix(home) else {
            continue;
        };
        let Some(std::path::Component::Normal(first)) = rel.components().next() else {
            continue;
        };
        let first = first.to_string_lossy();
        match first.as_ref() {
            ".local" => {
                for sub in ["bin", "lib", "pipx"] {
                    add(home.join(".local").join(sub));
                }
            }
            // `~/bin` and such: the directory itself only.
            name if !name.starts_with('.') => {}
            name => {
                add(home.join(name));
                if name == ".cargo" {
                    add(home.join(".rustup"));
                }
            }
        }
    }
    out
}

/// The entries of `/proc` that are not a process's directory (nor a symlink such as
/// `self`), listed once: `cpuinfo`, `meminfo`, `sys`, ...
fn proc_entries() -> Vec<PathBuf> {
    static ENTRIES: OnceLock<Vec<PathBuf>> = OnceLock::new();
    ENTRIES
        .get_or_init(|| {
            let Ok(dir) = std::fs::read_dir("/proc") else {
                return Vec::new();
            };
            let mut out: Vec<PathBuf> = dir
                .flatten()
                .filter(|e| {
                    let name = e.file_name();
                    let name = name.to_string_lossy();
                    !name.bytes().all(|b| b.is_ascii_digit())
                        && !e.file_type().map(|t| t.is_symlink()).unwrap_or(true)
                })
                .map(|e| e.path())
                .collect();
            out.sort();
            out
        })
        .clone()
}

/// Build the Landlock ruleset: handled what the ABI knows, the grants added (around the
/// protected paths). `None` when nothing could be handled.
fn ruleset(
    spec: &SandboxSpec,
    support: Support,
) -> Result<Option<OwnedFd>, landlock::RulesetError> {
    let abi = support.abi();
    let mut rs = Ruleset::default().handle_access(AccessFs::from_all(abi))?;
    if !spec.settings.network && support.network_rules() {
        rs = rs.handle_access(AccessNet::from_all(abi))?;
    }
    if !Scope::from_all(abi).is_empty() {
        rs = rs.scope(Scope::from_all(abi))?;
    }
    let mut created = rs.create()?;
    let protected = protected().lock().map(|l| l.clone()).unwrap_or_default();
    let writable: Vec<PathBuf> = spec
        .writable
        .iter()
        .filter_map(|p| std::fs::canonicalize(p).ok())
        .collect();
    for g in grants(spec, abi) {
        let Ok(path) = std::fs::canonicalize(&g.path) else {
            continue; // Not on this system.
        };
        let is_file = !path.is_dir();
        let access = if is_file {
            g.access & AccessFs::from_file(abi)
        } else {
            g.access
        };
        // The command's own directories are never narrowed.
        let keep_out: Vec<&PathBuf> = if writable.contains(&path) {
            Vec::new()
        } else {
            protected.iter().filter(|p| p.starts_with(&path)).collect()
        };
        for target in around(&path, &keep_out) {
            let Ok(fd) = PathFd::new(&target) else {
                continue;
            };
            let access = if target.is_dir() {
                access
            } else {
                access & AccessFs::from_file(abi)
            };
            if access.is_empty() {
                continue;
            }
            created = created.add_rule(PathBeneath::new(fd, access))?;
        }
    }
    Ok(created.into())
}

/// The paths to grant so that `root` is covered except `keep_out` (paths below it): `root`
/// itself when nothing is kept out; otherwise its entries, each granted whole unless it is
/// kept out (left out) or holds something kept out (split the same way). Symlinks among the
/// entries are left out (granting one would grant its target).
pub(super) fn around(root: &Path, keep_out: &[&PathBuf]) -> Vec<PathBuf> {
    if keep_out.is_empty() {
        return vec![root.to_path_buf()];
    }
    if keep_out.iter().any(|p| p.as_path() == root) {
        return Vec::new();
    }
    let Ok(entries) = std::fs::read_dir(root) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for e in entries.flatten() {
        if e.file_type().map(|t| t.is_symlink()).unwrap_or(true) {
            continue;
        }
        let path = e.path();
        let below: Vec<&PathBuf> = keep_out
            .iter()
            .copied()
            .filter(|p| p.starts_with(&path))
            .collect();
        out.extend(around(&path, &below));
    }
    out
}
