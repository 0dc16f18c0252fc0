//! Processes that reap (ADR 43), with real processes: forkfleet as PID 1 of a PID
//! namespace (as in a container with no init) reaps what its commands leave and ends as
//! its child does, passing signals on; a `forkfleet worker` keeps its commands' orphans in
//! its own tree (a subreaper) and reaps them.
//!
//! Each orphan is a `sleep 600` that escaped its command's process group (`setsid`; the
//! command waits on a FIFO until it has, or the group's end would kill it first): the test
//! checks its parent while it runs, then kills it and watches whether it is reaped.

use super::fleet::{wait_bounded, Fleet, Options, COMMAND_LIMIT, POLL};
use super::harness::{command_under, Example};
use std::path::Path;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

/// A command that leaves a `sleep 600` behind, out of its process group, and prints
/// `orphan=<its pid>` (as the command's PID namespace numbers it).
const LEAVE_ORPHAN: &str = r#"sh -c 'd=$(mktemp -d) && mkfifo $d/r && (setsid sh -c "echo \$\$ > $d/r; exec sleep 600" >/dev/null 2>&1 </dev/null &) && echo orphan=$(cat $d/r) && rm -r $d'"#;

/// A branch `a` that leaves an orphan, then makes a ten-minute call (forkfleet keeps running
/// while the test watches the orphan).
fn orphans_then_wait() -> String {
    format!(
        "[[turns.a]]\ntool_calls = [{{ name = \"run_command\", args = {{ command = \"{}\" }} }}]\n\n\
         [[turns.a]]\ntext = \"done\"\nlatency_ms = 600000\n",
        LEAVE_ORPHAN.replace('\\', "\\\\").replace('"', "\\\"")
    )
}

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

/// Whether this machine lets a process start a PID namespace of its own (`unshare -rpf`):
/// a container under a seccomp profile that refuses it cannot run these tests.
fn pid_namespaces() -> bool {
    let ok = std::process::Command::new("unshare")
        .args(["-rpf", "--mount-proc", "true"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        eprintln!("skipped: `unshare -rpf --mount-proc true` fails here (no PID namespaces for this process)");
    }
    ok
}

/// `forkfleet ARGS` as PID 1 of a new PID namespace, started by `unshare`; killed (its
/// whole namespace) when dropped.
struct Pid1 {
    unshare: Child,
    /// The namespace's PID 1, by its pid outside (0: it ended before it was seen).
    pid: u32,
    /// `unshare`'s status, once it ended.
    ended: Option<std::process::ExitStatus>,
}

impl Pid1 {
    /// Started, once the namespace's PID 1 is seen (bounded), or it has already ended.
    fn start(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Pid1 {
        let unshare = command_under(&["unshare", "-rpf", "--mount-proc"])
            .current_dir(dir)
            .args(args)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("run.log")).unwrap())
            .spawn()
            .unwrap();
        let mut me = Pid1 {
            unshare,
            pid: 0,
            ended: None,
        };
        let deadline = Instant::now() + COMMAND_LIMIT;
        loop {
            if let Some(&pid) = children_of(me.unshare.id()).first() {
                me.pid = pid;
                return me;
            }
            if let Ok(Some(status)) = me.unshare.try_wait() {
                me.ended = Some(status);
                return me;
            }
            assert!(Instant::now() < deadline, "no PID 1 under unshare");
            std::thread::sleep(POLL);
        }
    }

    /// `unshare`'s exit status once it ends (bounded).
    fn wait(&mut self) -> std::process::ExitStatus {
        if let Some(status) = self.ended {
            return status;
        }
        wait_bounded(&mut self.unshare, COMMAND_LIMIT).expect("forkfleet as PID 1 did not end")
    }
}

impl Drop for Pid1 {
    fn drop(&mut self) {
        if self.pid != 0 && self.ended.is_none() {
            // SAFETY: kill with a pid and a signal; the namespace ends with its PID 1.
            unsafe { libc::kill(self.pid as libc::pid_t, libc::SIGKILL) };
        }
        let _ = wait_bounded(&mut self.unshare, COMMAND_LIMIT);
    }
}

/// A process the test must not leave behind: killed when dropped.
struct Orphan(u32);

impl Drop for Orphan {
    fn drop(&mut self) {
        if comm(self.0).as_deref() == Some("sleep") {
            // SAFETY: kill with a pid and a signal.
            unsafe { libc::kill(self.0 as libc::pid_t, libc::SIGKILL) };
        }
    }
}

/// The `sleep` the branch left under `under`, once it runs (bounded): its pid and parent.
fn find_orphan(under: u32, dir: &Path) -> (Orphan, u32) {
    let deadline = Instant::now() + COMMAND_LIMIT;
    loop {
        for pid in descendants(under) {
            if comm(pid).as_deref() == Some("sleep") {
                if let Some((parent, state)) = parent_and_state(pid) {
                    if state != 'Z' {
                        return (Orphan(pid), parent);
                    }
                }
            }
        }
        assert!(
            Instant::now() < deadline,
            "the branch left no orphan\n{}",
            std::fs::read_to_string(dir.join("run.log")).unwrap_or_default()
        );
        std::thread::sleep(POLL);
    }
}

/// Kill `orphan` and watch it end (bounded): `true` when it is gone (reaped), `false` when
/// it is a zombie that stays one for two seconds.
fn killed_and_reaped(orphan: &Orphan) -> bool {
    // SAFETY: kill with a pid and a signal.
    unsafe { libc::kill(orphan.0 as libc::pid_t, libc::SIGKILL) };
    let deadline = Instant::now() + COMMAND_LIMIT;
    loop {
        match parent_and_state(orphan.0) {
            None => return true,
            Some((_, 'Z')) => {
                let since = Instant::now();
                while since.elapsed() < Duration::from_secs(2) {
                    if parent_and_state(orphan.0).is_none() {
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
    if !pid_namespaces() {
        return;
    }
    for (env, init) in [(&[][..], true), (&[("FORKFLEET_INIT", "off")][..], false)] {
        let dir = tempfile::tempdir().unwrap();
        project(dir.path(), &orphans_then_wait());
        let pid1 = Pid1::start(dir.path(), &["run", "fork.toml"], env);
        assert!(
            pid1.ended.is_none(),
            "forkfleet ended at once: {:?}",
            pid1.ended
        );
        let (orphan, parent) = find_orphan(pid1.pid, dir.path());
        // Its shell is gone: the namespace's PID 1 is its parent.
        assert_eq!(parent, pid1.pid, "init={init}");
        let gone = killed_and_reaped(&orphan);
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

#[test]
fn forkfleet_as_pid_1_ends_as_its_child_does_and_passes_signals_on() {
    if !pid_namespaces() {
        return;
    }
    // Bad input: the child's exit code 2, through the init.
    let dir = tempfile::tempdir().unwrap();
    let mut bad = Pid1::start(dir.path(), &["run", "missing.toml"], &[]);
    assert_eq!(bad.wait().code(), Some(2));
    let said = std::fs::read_to_string(dir.path().join("run.log")).unwrap();
    assert!(said.contains("missing.toml"), "{said}");

    // A call of ten minutes, then SIGTERM and SIGUSR1 to PID 1 (as a runtime stops a
    // container, and as an operator signals it): the init passes them on; forkfleet ends
    // on SIGTERM, and the init exits as a process killed by it (128 + 15).
    project(
        dir.path(),
        "[[turns.a]]\ntext = \"slow\"\nlatency_ms = 600000\n",
    );
    let mut slow = Pid1::start(dir.path(), &["run", "fork.toml"], &[]);
    assert!(
        slow.ended.is_none(),
        "forkfleet ended at once: {:?}",
        slow.ended
    );
    // The init serves once its child runs (bounded).
    let deadline = Instant::now() + COMMAND_LIMIT;
    while children_of(slow.pid).is_empty() {
        assert!(Instant::now() < deadline, "no forkfleet under the init");
        std::thread::sleep(POLL);
    }
    // SAFETY: kill with a pid and a signal.
    assert_eq!(
        unsafe { libc::kill(slow.pid as libc::pid_t, libc::SIGTERM) },
        0
    );
    assert_eq!(slow.wait().code(), Some(128 + libc::SIGTERM));
}

/// A branch on a `forkfleet worker` leaves a process that escapes its command's group and
/// outlives it: the worker is its parent once its shell exits (a subreaper), and reaps it
/// when it ends (it is gone, not a zombie).
#[test]
fn a_worker_keeps_the_orphans_of_commands_and_reaps_them() {
    let fleet = Fleet::start(1, 1, Options::default());
    let ex = Example::quickstart();
    std::fs::write(
        ex.dir.path().join("orphans.toml"),
        orphans_then_wait()
            .replace("turns.a", "turns.\"*\"")
            .replace("latency_ms = 600000\n", ""),
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
    let pid: u32 = log
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
    let orphan = Orphan(pid);
    let worker = fleet.workers[0].child.as_ref().unwrap().id();
    let (parent, _) = parent_and_state(pid).expect("the orphan ended before it was seen");
    assert_eq!(
        parent, worker,
        "the orphan went to {parent}, not to the worker"
    );
    assert!(
        killed_and_reaped(&orphan),
        "the worker left its orphan a zombie"
    );
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

/// A process's parent and state letter, while it exists.
fn parent_and_state(pid: u32) -> Option<(u32, char)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let mut f = text[text.rfind(')')? + 1..].split_whitespace();
    let state = f.next()?.chars().next()?;
    Some((f.next()?.parse().ok()?, state))
}
