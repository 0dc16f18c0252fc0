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
    write_project(dir.path(), mode);
    dir
}

/// [`project`]'s files in `dir`.
fn write_project(dir: &Path, mode: &str) {
    std::fs::create_dir(dir.join("ws")).unwrap();
    std::fs::write(dir.join("ws/seed.txt"), "seed\n").unwrap();
    std::fs::write(dir.join("script.toml"), SCRIPT).unwrap();
    std::fs::write(
        dir.join("fork.toml"),
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

#[test]
fn a_sandboxed_command_cannot_read_the_live_runs_socket_token() {
    if !forkfleet_worker::runner::sandbox::kernel_support().landlock() {
        eprintln!("skipped: no Landlock on this kernel");
        return;
    }
    let dir = project("auto");
    let data = std::fs::canonicalize(dir.path())
        .unwrap()
        .join(".forkfleet");
    // The branch tries to read the token of the run serving it, by its absolute path.
    std::fs::write(
        dir.path().join("script.toml"),
        format!(
            r#"
[[turns.a]]
tool_calls = [
  {{ name = "run_command", args = {{ command = ["sh", "-c", "cat {0}/api.token > got.txt; echo $? > rc.txt; ls {0} > ls.txt; echo $? >> rc.txt"] }} }},
]

[[turns.a]]
text = "done"
"#,
            data.display()
        ),
    )
    .unwrap();
    let out = command()
        .current_dir(dir.path())
        .args(["run", "fork.toml", "--pick", "a"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let got = std::fs::read_to_string(dir.path().join("ws/got.txt")).unwrap();
    let rc = std::fs::read_to_string(dir.path().join("ws/rc.txt")).unwrap();
    assert!(got.is_empty(), "the token leaked: {got}");
    assert!(
        rc.lines().all(|l| l.trim() != "0"),
        "the data dir was readable: {rc}"
    );
}

#[test]
fn commands_run_when_the_data_dir_has_characters_an_overlay_cannot_take() {
    let top = tempfile::tempdir().unwrap();
    for name in ["com,ma", "co:lon", "back\\slash"] {
        let dir = top.path().join(name);
        std::fs::create_dir(&dir).unwrap();
        write_project(&dir, "auto");
        let (paths, log) = run_in(&dir, &[]);
        assert_eq!(paths, created(), "{name}: {log}");
    }
}

#[test]
fn a_data_dir_inside_the_workspace_never_reaches_a_branchs_tree() {
    let dir = project("auto");
    std::fs::write(
        dir.path().join("script.toml"),
        r#"
[[turns.a]]
tool_calls = [
  { name = "run_command", args = { command = ["sh", "-c", "ls -a > seen.txt; cat .ff/api.token > got.txt; echo $? > rc.txt"] } },
]

[[turns.a]]
text = "done"
"#,
    )
    .unwrap();
    // The data dir under the workspace, under a name no rule knows.
    let out = command()
        .current_dir(dir.path())
        .args(["run", "fork.toml", "--data", "ws/.ff", "--pick", "a"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let seen = std::fs::read_to_string(dir.path().join("ws/seen.txt")).unwrap();
    assert!(!seen.lines().any(|l| l == ".ff"), "{seen}");
    assert!(std::fs::read_to_string(dir.path().join("ws/got.txt"))
        .unwrap()
        .is_empty());
    assert_ne!(
        std::fs::read_to_string(dir.path().join("ws/rc.txt"))
            .unwrap()
            .trim(),
        "0"
    );
}
