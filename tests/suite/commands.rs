//! `run_command` as a new user meets it: the release binary's defaults, a spec run from its
//! own directory (so the store is the relative `.forkfleet`), nothing in the environment;
//! then every set-up a worker can fall back to (layered trees on and off, Landlock on and
//! off, `sandbox` auto, required and off).

use super::harness::{command, stderr};
use serde_json::Value;
use std::collections::BTreeSet;
use std::path::Path;

const SCRIPT: &str = r#"
[[turns.a]]
tool_calls = [
  { name = "run_command", args = { command = "sh -c 'cat seed.txt > via-path.txt'" } },
  { name = "run_command", args = { command = ["/bin/sh", "-c", "echo ok > via-bin.txt"] } },
  { name = "run_command", args = { command = "test -f seed.txt" } },
]

[[turns.a]]
tool_calls = [
  { name = "run_command", args = { command = "sh -c 'test -f via-path.txt && echo again > second.txt'" } },
]

[[turns.a]]
text = "done"
"#;

/// A spec whose one branch runs four commands (`sh` on `PATH`, `/bin/sh`, `test` on the
/// workspace's file, and `sh` again on the tree the first call left), `sandbox` set to
/// `mode`.
fn project(mode: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("ws")).unwrap();
    std::fs::write(dir.path().join("ws/seed.txt"), "seed\n").unwrap();
    std::fs::write(dir.path().join("script.toml"), SCRIPT).unwrap();
    std::fs::write(
        dir.path().join("fork.toml"),
        format!(
            r#"goal = "run commands"
workspace = "ws"
model = "scripted:cmd"

[models."scripted:cmd"]
script = "script.toml"

[run_command]
sandbox = "{mode}"

[[branches]]
label = "a"
"#
        ),
    )
    .unwrap();
    dir
}

/// `forkfleet run fork.toml --json` in `dir` (the store is `.forkfleet` there, relative),
/// with `env` set and no other `FORKFLEET_*` variable: the paths the branch created, and
/// its log as text.
fn run_in(dir: &Path, env: &[(&str, &str)]) -> (BTreeSet<String>, String) {
    let out = command()
        .current_dir(dir)
        .args(["run", "fork.toml", "--json"])
        .envs(env.iter().copied())
        .output()
        .unwrap();
    let doc: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "not JSON ({e}): {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            stderr(&out)
        )
    });
    let paths = doc["diff"]["paths"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["path"].as_str().unwrap().to_string())
        .collect();
    let fork = doc["fork_id"].as_str().unwrap();
    let log = command()
        .current_dir(dir)
        .args(["log", &format!("{fork}/a"), "--json"])
        .output()
        .unwrap();
    (paths, String::from_utf8_lossy(&log.stdout).into_owned())
}

fn created() -> BTreeSet<String> {
    ["second.txt", "via-bin.txt", "via-path.txt"]
        .iter()
        .map(|s| s.to_string())
        .collect()
}

#[test]
fn commands_run_with_the_defaults_from_a_relative_store() {
    let dir = project("auto");
    let (paths, log) = run_in(dir.path(), &[]);
    assert_eq!(paths, created(), "{log}");
    assert!(!log.contains("could not start"), "{log}");
    assert_eq!(
        std::fs::read_to_string(dir.path().join("ws/seed.txt")).unwrap(),
        "seed\n"
    );
}

#[test]
fn commands_run_under_every_set_up_a_worker_can_fall_back_to() {
    let landlock = forkfleet_worker::runner::sandbox::kernel_support().landlock();
    for layered in ["on", "off"] {
        for abi in [None, Some("0")] {
            for mode in ["auto", "required", "off"] {
                let dir = project(mode);
                let mut env = vec![("FORKFLEET_LAYERED_TREES", layered)];
                if let Some(abi) = abi {
                    env.push(("FORKFLEET_SANDBOX_ABI", abi));
                }
                let (paths, log) = run_in(dir.path(), &env);
                let cell = format!("layered={layered} abi={abi:?} sandbox={mode}");
                let confined = landlock && abi.is_none();
                if mode == "required" && !confined {
                    assert!(paths.is_empty(), "{cell}: {paths:?}");
                    assert!(
                        log.contains("the sandbox is required") && log.contains("no Landlock"),
                        "{cell}: {log}"
                    );
                } else {
                    assert_eq!(paths, created(), "{cell}: {log}");
                    assert!(!log.contains("could not start"), "{cell}: {log}");
                }
            }
        }
    }
}
