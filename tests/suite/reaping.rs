//! Processes that reap (ADR 43), with real processes: forkfleet as PID 1 of a PID
//! namespace (as in a container with no init) reaps what its commands leave and ends as
//! its child does, passing signals on; a `forkfleet worker` keeps its commands' orphans in
//! its own tree (a subreaper) and reaps them.

use super::fleet::{Fleet, Options, COMMAND_LIMIT, POLL};
use super::harness::{command_under, stderr, Example};
use std::path::Path;
use std::time::Instant;

/// A branch that leaves an orphan: a `sleep` of 2 s that escapes its command's group
/// (`setsid`; the command waits on a FIFO until it has, or the group's end would kill it
/// first), so it outlives the command, then a ten-minute call that keeps forkfleet running
/// while the test watches the orphan end.
const ORPHANS: &str = r#"
[[turns.a]]
tool_calls = [
  { name = "run_command", args = { command = "sh -c 'd=$(mktemp -d) && mkfifo $d/r && (setsid sh -c \"echo > $d/r; exec sleep 2\" >/dev/null 2>&1 </dev/null &) && cat $d/r && rm -r $d && echo left'" } },
]

[[turns.a]]
text = "done"
latency_ms = 600000
"#;

/// A one-branch spec (`a`) playing `script` over a workspace of one file, in `dir`, with
/// `run_command` on.
fn project(dir: &Path, script: &str) {
    std::fs::create_dir_all(dir.join("ws")).unwrap();
    std::fs::write(dir.join("ws/seed.txt"), "seed\n").unwrap();
    std::fs::write(dir.join("script.toml"), script).unwrap();
    std::fs::write(
        dir.join("fork.toml"),
        "goal = \"leave orphans\"\nworkspace = \"ws\"\nmodel = \"scripted:orphans\"\n\
         [models.\"scripted:orphans\"]\nscript = \"script.toml\"\n[run_command]\n[[branches]]\nlabel = \"a\"\n",
    )
    .unwrap();
}

/// `forkfleet run` as PID 1 of a new PID namespace, started by `unshare` (bounded): the
/// `unshare` process and the namespace's PID 1 (its host pid), once forkfleet runs (under
/// the init, or as PID 1 itself).
fn start_as_pid_1(dir: &Path, env: &[(&str, &str)]) -> (std::process::Child, u32) {
    let mut child = command_under(&["unshare", "-rpf", "--mount-proc"])
        .current_dir(dir)
        .args(["run", "fork.toml"])
        .envs(env.iter().copied())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(dir.join("run.log")).unwrap())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + COMMAND_LIMIT;
    loop {
        if let Some(&pid1) = children_of(child.id()).first() {
            return (child, pid1);
        }
        if let Ok(Some(status)) = child.try_wait() {
            panic!("unshare ended at once ({status:?}): does this machine allow PID namespaces?");
        }
        assert!(Instant::now() < deadline, "no PID 1 under unshare");
        std::thread::sleep(POLL);
    }
}

/// The `sleep` the branch left, once it runs (bounded): its host pid and its parent.
fn find_orphan(under: u32, dir: &Path) -> (u32, u32) {
    let deadline = Instant::now() + COMMAND_LIMIT;
    loop {
        for pid in descendants(under) {
            if comm(pid).as_deref() == Some("sleep") {
                if let Some((parent, state)) = parent_and_state(pid) {
                    if state != 'Z' {
                        return (pid, parent);
                    }
                }
            }
        }
        assert!(
            Instant::now() < deadline,
            "the branch left no orphan: under {under}: {:?}\n{}",
            descendants(under)
                .into_iter()
                .map(|p| (p, comm(p)))
                .collect::<Vec<_>>(),
            std::fs::read_to_string(dir.join("run.log")).unwrap_or_default()
        );
        std::thread::sleep(POLL);
    }
}

/// Until `pid` has ended (bounded): `true` when it is gone (reaped), `false` when it is a
/// zombie that stays one for a second.
fn reaped(pid: u32) -> bool {
    let deadline = Instant::now() + COMMAND_LIMIT;
    loop {
        match parent_and_state(pid) {
            None => return true,
            Some((_, 'Z')) => {
                let since = Instant::now();
                while since.elapsed() < std::time::Duration::from_secs(1) {
                    if parent_and_state(pid).is_none() {
                        return true;
                    }
                    std::thread::sleep(POLL);
                }
                return false;
            }
            Some(_) => {}
        }
        assert!(Instant::now() < deadline, "the orphan did not end");
        std::thread::sleep(POLL);
    }
}

#[test]
fn forkfleet_as_pid_1_reaps_the_orphans_of_commands() {
    for (env, init) in [(&[][..], true), (&[("FORKFLEET_INIT", "off")][..], false)] {
        let dir = tempfile::tempdir().unwrap();
        project(dir.path(), ORPHANS);
        let (mut child, pid1) = start_as_pid_1(dir.path(), env);
        let (orphan, parent) = find_orphan(pid1, dir.path());
        // Its shell is gone: the namespace's PID 1 is its parent.
        assert_eq!(parent, pid1, "init={init}");
        let gone = reaped(orphan);
        // SAFETY: kill with a pid and a signal; the namespace ends with its PID 1.
        unsafe { libc::kill(pid1 as libc::pid_t, libc::SIGKILL) };
        super::fleet::wait_bounded(&mut child, COMMAND_LIMIT).expect("unshare did not end");
        if init {
            assert!(gone, "an orphan stayed a zombie under forkfleet as PID 1");
        } else {
            // Without the init PID 1 inherits it and nothing waits for it (what a container
            // with no init showed before), so the check above could fail.
            assert!(
                !gone,
                "reaped without the init: the test would prove nothing"
            );
        }
    }
}

/// Every process under `pid`, its descendants' too.
fn descendants(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    let mut next = vec![pid];
    while let Some(p) = next.pop() {
        for c in children_of(p) {
            out.push(c);
            next.push(c);
        }
    }
    out
}

/// A process's command name.
fn comm(pid: u32) -> Option<String> {
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .ok()
        .map(|s| s.trim_end().to_string())
}

#[test]
fn forkfleet_as_pid_1_ends_as_its_child_does_and_passes_signals_on() {
    // Bad input: the child's exit code 2, through the init.
    let dir = tempfile::tempdir().unwrap();
    let out = command_under(&["unshare", "-rpf"])
        .current_dir(dir.path())
        .args(["run", "missing.toml"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("missing.toml"), "{}", stderr(&out));

    // A call of ten minutes, then SIGTERM to PID 1 (as a container runtime stops a container): the
    // init passes it to forkfleet, which stops, and the namespace ends (bounded).
    project(
        dir.path(),
        "[defaults]\nlatency_ms = 600000\n[[turns.a]]\ntext = \"slow\"\n",
    );
    let mut child = command_under(&["unshare", "-rpf"])
        .current_dir(dir.path())
        .args(["run", "fork.toml"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // PID 1 of the namespace: the child `unshare -f` forked (bounded wait for it, and for
    // the forkfleet it starts under itself, so the signal finds the init serving).
    let deadline = Instant::now() + COMMAND_LIMIT;
    let pid1 = loop {
        let init = children_of(child.id());
        if let Some(&init) = init.first() {
            if !children_of(init).is_empty() {
                break init;
            }
        }
        assert!(Instant::now() < deadline, "no forkfleet under the init");
        std::thread::sleep(POLL);
    };
    // SAFETY: kill with a pid and a signal.
    assert_eq!(unsafe { libc::kill(pid1 as libc::pid_t, libc::SIGTERM) }, 0);
    // Stopped by the signal (its call would take ten minutes).
    super::fleet::wait_bounded(&mut child, COMMAND_LIMIT)
        .expect("forkfleet as PID 1 did not stop on SIGTERM");
}

/// The processes whose parent is `pid`.
fn children_of(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten()
    {
        if let Ok(text) = std::fs::read_to_string(task.path().join("children")) {
            out.extend(
                text.split_whitespace()
                    .filter_map(|p| p.parse::<u32>().ok()),
            );
        }
    }
    out
}

/// A process's parent and state letter, while it exists.
fn parent_and_state(pid: u32) -> Option<(u32, char)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let mut f = text[text.rfind(')')? + 1..].split_whitespace();
    let state = f.next()?.chars().next()?;
    Some((f.next()?.parse().ok()?, state))
}

/// A branch on a `forkfleet worker` leaves a process that escapes its command's group
/// (`setsid`) and outlives it: the worker is its parent once its shell exits (a
/// subreaper), and reaps it when it ends (it is gone, not a zombie).
#[test]
fn a_worker_keeps_the_orphans_of_commands_and_reaps_them() {
    let fleet = Fleet::start(1, 1, Options::default());
    let ex = Example::quickstart();
    std::fs::write(
        ex.dir.path().join("orphans.toml"),
        r#"
[[turns."*"]]
tool_calls = [
  { name = "run_command", args = { command = "sh -c 'd=$(mktemp -d) && mkfifo $d/r && (setsid sh -c \"echo \\$\\$ > $d/r; exec sleep 5\" >/dev/null 2>&1 </dev/null &) && echo orphan=$(cat $d/r) && rm -r $d'" } },
]

[[turns."*"]]
text = "done"
"#,
    )
    .unwrap();
    let spec = ex.write_spec(
        "goal = \"orphans\"\nworkspace = \"workspace\"\nmodel = \"scripted:orphans\"\n\
         [models.\"scripted:orphans\"]\nscript = \"orphans.toml\"\n[run_command]\n[[branches]]\nlabel = \"a\"\n",
    );
    let id = fleet.create(&spec);
    let view = fleet.watch(&id);
    let run = view["branches"][0]["id"].as_str().unwrap().to_string();
    let log = serde_json::to_string(&fleet.log(&run)).unwrap();
    // The pid the command printed (the first `orphan=` is the call's own text).
    let orphan: u32 = log
        .match_indices("orphan=")
        .map(|(at, m)| {
            log[at + m.len()..]
                .chars()
                .take_while(char::is_ascii_digit)
                .collect::<String>()
        })
        .find(|digits| !digits.is_empty())
        .unwrap_or_else(|| panic!("no orphan's pid in the log: {log}"))
        .parse()
        .unwrap();
    let worker = fleet.workers[0].child.as_ref().unwrap().id();
    // Alive for 5 s after its command: its parent is the worker.
    let (parent, _) = parent_and_state(orphan).expect("the orphan ended before it was seen");
    assert_eq!(
        parent, worker,
        "the orphan went to {parent}, not to the worker"
    );
    // Then it ends and is reaped: gone, never left a zombie (bounded).
    let deadline = Instant::now() + COMMAND_LIMIT;
    while let Some((_, state)) = parent_and_state(orphan) {
        assert!(
            Instant::now() < deadline,
            "the orphan is still there ({state}) after its end"
        );
        std::thread::sleep(POLL);
    }
}
