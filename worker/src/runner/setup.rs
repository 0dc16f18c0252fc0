//! What this worker can give a command, decided once per process by starting one.
//!
//! A command may run in a layered tree ([`super::layered`]: overlayfs mounted by the
//! command's child in a user namespace) and under Landlock ([`super::sandbox`]). Each works
//! alone on most kernels; whether they work together, with this kernel's and this
//! container's rules, is only known by trying. So before the first command the worker
//! starts `test -f` (found on `PATH`, as a command's program is) through the exact path a
//! command takes ([`super::spawn`]: the mount, the confinement, the `execve`), in a scratch
//! layout of a tree, and keeps the strongest set-up under which it ran and saw the tree:
//!
//! 1. layered trees under Landlock;
//! 2. whole trees under Landlock;
//! 3. layered trees with the limits only;
//! 4. whole trees with the limits only (nothing left to try).
//!
//! Confinement comes before speed: a worker never drops Landlock to keep layered trees.
//! The choice is said in one INFO line and advertised in the worker's heartbeat
//! (`forkfleet workers --json`, `commands`). With Landlock unusable, a spec's
//! `sandbox = "required"` has its commands refused, naming why.

use super::layered::{self, Dirs, Mount};
use super::sandbox::{self, SandboxSpec, Support};
use forkfleet_shared::endpoint::{CommandSandbox, SandboxMode};
use forkfleet_shared::protocol::CommandSetupInfo;
use std::path::Path;
use std::sync::OnceLock;
use std::time::Duration;

/// How long one probe's command may take.
const PROBE_TIMEOUT: Duration = Duration::from_secs(10);

/// The set-up commands get on this worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommandSetup {
    /// Trees are layered over a base per fork.
    pub layered: bool,
    /// The Landlock ABI commands are confined with; 0: limits only.
    pub landlock_abi: i32,
    /// The kernel's Landlock ABI (after `FORKFLEET_SANDBOX_ABI`).
    pub kernel_abi: i32,
    /// Why a stronger set-up was not taken (`None`: the strongest the kernel offers).
    pub fallback: Option<String>,
}

impl CommandSetup {
    /// What the heartbeat says of it.
    pub fn info(&self) -> CommandSetupInfo {
        CommandSetupInfo {
            layered: self.layered,
            landlock_abi: self.landlock_abi,
            kernel_landlock_abi: self.kernel_abi,
            fallback: self.fallback.clone(),
        }
    }
}

/// The set-up of this process, probed at the first call.
pub fn setup() -> &'static CommandSetup {
    static SETUP: OnceLock<CommandSetup> = OnceLock::new();
    SETUP.get_or_init(|| {
        // Without a `test` program to start there is nothing to try: the strongest set-up
        // is assumed (a command names its own failure).
        let can_probe = on_path("test");
        let no_landlock = if sandbox::kernel_abi() > 0 {
            format!("Landlock turned off ({}=0)", sandbox::ABI_OVERRIDE_ENV)
        } else {
            "no Landlock in this kernel".to_string()
        };
        let setup = decide(
            sandbox::kernel_support(),
            layered::overlay_works(),
            |l, s| {
                if can_probe {
                    probe(l, s)
                } else {
                    Ok(())
                }
            },
            &no_landlock,
        );
        log(&setup);
        setup
    })
}

/// The set-up chosen from the kernel's `support` and whether overlays work (`overlay`), by
/// trying each candidate, strongest first, with `try_start` (an `Err` is why it failed);
/// `no_landlock` says why there is none, when `support` has none.
pub(crate) fn decide(
    support: Support,
    overlay: Result<(), String>,
    try_start: impl Fn(bool, Support) -> Result<(), String>,
    no_landlock: &str,
) -> CommandSetup {
    let mut why: Vec<String> = Vec::new();
    if let Err(e) = &overlay {
        why.push(format!("no layered trees: {e}"));
    }
    if !support.landlock() {
        why.push(no_landlock.to_string());
    }
    let mut candidates: Vec<(bool, i32)> = Vec::new();
    if support.landlock() {
        if overlay.is_ok() {
            candidates.push((true, support.abi));
        }
        candidates.push((false, support.abi));
    }
    if overlay.is_ok() {
        candidates.push((true, 0));
    }
    for (layered, abi) in candidates {
        match try_start(layered, Support { abi }) {
            Ok(()) => {
                return CommandSetup {
                    layered,
                    landlock_abi: abi,
                    kernel_abi: support.abi,
                    fallback: (!why.is_empty()).then(|| why.join("; ")),
                }
            }
            Err(e) => why.push(format!(
                "{} trees {}: {e}",
                if layered { "layered" } else { "whole" },
                if abi > 0 {
                    "under Landlock"
                } else {
                    "with limits only"
                }
            )),
        }
    }
    CommandSetup {
        layered: false,
        landlock_abi: 0,
        kernel_abi: support.abi,
        fallback: (!why.is_empty()).then(|| why.join("; ")),
    }
}

fn log(setup: &CommandSetup) {
    let trees = if setup.layered {
        "layered trees (one base per fork, an overlay per branch)"
    } else {
        "a whole tree per branch"
    };
    let confinement = if setup.landlock_abi > 0 {
        format!("Landlock ABI {}", setup.landlock_abi)
    } else {
        "resource limits only (no Landlock)".to_string()
    };
    match &setup.fallback {
        None => tracing::info!(
            layered = setup.layered,
            landlock.abi = setup.landlock_abi,
            "commands: {trees}, {confinement}"
        ),
        Some(why) => tracing::info!(
            layered = setup.layered,
            landlock.abi = setup.landlock_abi,
            kernel.landlock_abi = setup.kernel_abi,
            fallback = %why,
            "commands: {trees}, {confinement}; nothing stronger here (see fallback)"
        ),
    }
}

/// Start `test -f probe` in a scratch tree, layered or whole, confined by `support`'s
/// Landlock (none at ABI 0), as a command would be; `Ok` when it ran and saw the tree's
/// file. Runs on a thread of its own with its own small runtime (the caller may be on an
/// async runtime's thread, and is waited for: once per process).
fn probe(layered: bool, support: Support) -> Result<(), String> {
    std::thread::Builder::new()
        .name("forkfleet-probe".into())
        .spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| format!("no runtime for the probe: {e}"))?;
            rt.block_on(async {
                tokio::time::timeout(PROBE_TIMEOUT, probe_async(layered, support))
                    .await
                    .map_err(|_| format!("the probe did not end within {PROBE_TIMEOUT:?}"))?
            })
        })
        .map_err(|e| format!("cannot start the probe: {e}"))?
        .join()
        .map_err(|_| "the probe panicked".to_string())?
}

async fn probe_async(layered: bool, support: Support) -> Result<(), String> {
    let scratch = tempfile::Builder::new()
        .prefix("forkfleet-command-probe-")
        .tempdir()
        .map_err(|e| format!("no temporary directory: {e}"))?;
    let root = scratch.path();
    let dirs = Dirs {
        lower: root.join("base"),
        upper: root.join("upper"),
        work: root.join("work"),
        merged: root.join("ws"),
    };
    for d in [&dirs.lower, &dirs.upper, &dirs.work, &dirs.merged] {
        std::fs::create_dir(d).map_err(|e| e.to_string())?;
    }
    for d in ["home", "tmp"] {
        std::fs::create_dir(root.join(d)).map_err(|e| e.to_string())?;
    }
    // The file the program must see: in the base when layered, in the tree otherwise.
    let holder = if layered { &dirs.lower } else { &dirs.merged };
    std::fs::write(holder.join("probe"), b"").map_err(|e| e.to_string())?;
    let spec = SandboxSpec {
        settings: CommandSandbox {
            mode: SandboxMode::Auto,
            ..CommandSandbox::default()
        },
        writable: ["ws", "home", "tmp"].iter().map(|d| root.join(d)).collect(),
        exec: Vec::new(),
        layers: layered.then(|| dirs.clone()),
    };
    let confinement = sandbox::prepare(&spec, support)?;
    let mount = if layered {
        Some(Mount::new(&dirs, &dirs.merged)?)
    } else {
        None
    };
    let env: Vec<(String, String)> = super::base_env(root).into_iter().collect();
    let args = ["-f".to_string(), "probe".to_string()];
    let start = super::spawn::Start {
        program: "test",
        args: &args,
        dir: &dirs.merged,
        env: &env,
        mount: mount.as_ref(),
        confinement: confinement.as_ref(),
    };
    let mut child = super::spawn::spawn(&start).map_err(|e| format!("`test`: {e}"))?;
    let status = child.wait().await.map_err(|e| e.to_string())?;
    // The tree (layered: the overlay's work directory) is removed with the scratch
    // directory; overlayfs leaves directories there without permissions.
    super::make_writable(&dirs.work);
    if status.success() {
        Ok(())
    } else {
        Err(format!(
            "`test -f probe` in the tree ended with {status} (the tree's file was not seen)"
        ))
    }
}

/// True when `program` is found on the worker's own `PATH`.
fn on_path(program: &str) -> bool {
    std::env::var("PATH")
        .unwrap_or_default()
        .split(':')
        .any(|d| !d.is_empty() && Path::new(d).join(program).is_file())
}
