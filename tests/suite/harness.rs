//! Helpers: a copy of the quickstart example in a temporary directory, the binary in a clean
//! environment, and what several test modules read or write.

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub struct Example {
    pub dir: tempfile::TempDir,
}

impl Example {
    /// A fresh copy of `examples/quickstart` (spec, script and workspace).
    pub fn quickstart() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/quickstart");
        copy_dir(&src, dir.path());
        Self { dir }
    }

    /// A fresh copy of `examples/NAME`.
    pub fn named(name: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let src = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("examples")
            .join(name);
        copy_dir(&src, dir.path());
        Self { dir }
    }

    pub fn spec(&self) -> PathBuf {
        self.dir.path().join("fork.toml")
    }

    pub fn workspace(&self) -> PathBuf {
        self.dir.path().join("workspace")
    }

    pub fn data(&self) -> PathBuf {
        self.dir.path().join(".forkfleet")
    }

    pub fn read(&self, rel: &str) -> Option<String> {
        std::fs::read_to_string(self.workspace().join(rel)).ok()
    }

    pub fn write_spec(&self, text: &str) -> PathBuf {
        let p = self.dir.path().join("custom.toml");
        std::fs::write(&p, text).unwrap();
        p
    }
}

fn copy_dir(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for entry in std::fs::read_dir(src).unwrap() {
        let entry = entry.unwrap();
        let name = entry.file_name();
        if name == ".forkfleet" {
            continue;
        }
        let to = dst.join(&name);
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &to);
        } else {
            std::fs::copy(entry.path(), &to).unwrap();
        }
    }
}

/// The environment variables a test process keeps of the `FORKFLEET_*` ones: the binary the
/// nats tests start (`forkfleet_bus::testkit::NATS_SERVER_ENV`).
const KEPT_ENV: &[&str] = &["FORKFLEET_NATS_SERVER"];

/// The binary, to be given its arguments: every `FORKFLEET_*` variable of the test's
/// environment removed (but [`KEPT_ENV`]), and every `OTEL_*` one, `RUST_LOG=warn`.
pub fn command() -> Command {
    command_under(&[])
}

/// [`command`], started by `wrapper` (its program and arguments, then the binary's path):
/// `["unshare", "-rpf"]` runs it as PID 1 of a PID namespace of its own.
pub fn command_under(wrapper: &[&str]) -> Command {
    let bin = env!("CARGO_BIN_EXE_forkfleet");
    let mut cmd = match wrapper.split_first() {
        Some((program, args)) => {
            let mut cmd = Command::new(program);
            cmd.args(args).arg(bin);
            cmd
        }
        None => Command::new(bin),
    };
    for (k, _) in std::env::vars_os() {
        if let Some(k) = k.to_str() {
            // OTEL_*: no test exports unless it says so.
            if (k.starts_with("FORKFLEET_") && !KEPT_ENV.contains(&k)) || k.starts_with("OTEL_") {
                cmd.env_remove(k);
            }
        }
    }
    cmd.env("RUST_LOG", "warn");
    cmd
}

/// Run the binary with `args` and `env` set, every other `FORKFLEET_*` variable removed
/// (see [`command`]); bounded by a generous timeout through the fork commands' own
/// `--timeout-s` where they wait.
pub fn forkfleet_env(args: &[&str], env: &[(&str, &str)]) -> Output {
    command()
        .args(args)
        .envs(env.iter().copied())
        .output()
        .unwrap()
}

/// `forkfleet run SPEC --json`, bounded by `--timeout-s 120`.
pub fn run_spec(spec: &Path) -> Output {
    forkfleet(&["run", path_str(spec), "--json", "--timeout-s", "120"])
}

/// [`forkfleet_env`] with no variable set.
pub fn forkfleet(args: &[&str]) -> Output {
    forkfleet_env(args, &[])
}

pub fn json(out: &Output) -> Value {
    assert!(
        out.status.success(),
        "exit {:?}\nstdout: {}\nstderr: {}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&out.stdout)))
}

/// The JSON document a command printed before exiting with `code` (one that did not do
/// all it was asked prints its document too).
pub fn json_exit(out: &Output, code: i32) -> Value {
    assert_eq!(
        out.status.code(),
        Some(code),
        "stdout: {}\nstderr: {}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&out.stdout)))
}

pub fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

pub fn path_str(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// The branch labelled `label` of a fork view (JSON).
pub fn branch<'a>(doc: &'a Value, label: &str) -> &'a Value {
    doc["branches"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["label"] == label)
        .unwrap_or_else(|| panic!("no branch {label} in {doc}"))
}

/// A scripted model's turn file: `repeat` turns each writing one file (`path`, with
/// `{label}` and `{repeat}` filled in, holding `content`, TOML-escaped), then an answer;
/// `latency_ms` a call, and, with `usage`, 100 input and 10 output tokens a call.
pub fn writes_then_done(
    latency_ms: u64,
    usage: bool,
    path: &str,
    content: &str,
    repeat: u32,
) -> String {
    let usage = if usage {
        "usage = { input_tokens = 100, output_tokens = 10 }\n"
    } else {
        ""
    };
    format!(
        "[defaults]\nlatency_ms = {latency_ms}\n{usage}\n[[turns.\"*\"]]\n\
         tool_calls = [{{ name = \"write_file\", args = {{ path = \"{path}\", content = \"{content}\" }} }}]\n\
         repeat = {repeat}\n\n[[turns.\"*\"]]\ntext = \"done\"\n"
    )
}

/// 150 writes at 100 ms a call.
pub fn slow_script() -> String {
    writes_then_done(100, true, "slow/{label}-{repeat}.md", "x\\n", 150)
}

/// A spec of three branches, `a`, `b` and `c`, playing [`slow_script`] in `ex`.
pub fn slow_spec(ex: &Example) -> PathBuf {
    std::fs::write(ex.dir.path().join("slow.toml"), slow_script()).unwrap();
    ex.write_spec(
        "goal = \"slow\"\nworkspace = \"workspace\"\nmodel = \"scripted:slow\"\nmax_turns = 200\n\
         [models.\"scripted:slow\"]\nscript = \"slow.toml\"\n\
         [[branches]]\nlabel = \"a\"\nsteer = \"go\"\n\
         [[branches]]\nlabel = \"b\"\nsteer = \"go\"\n\
         [[branches]]\nlabel = \"c\"\nsteer = \"go\"\n",
    )
}

/// A tmux server of its own (its own socket), killed when dropped.
pub struct Tmux {
    socket: String,
}

impl Tmux {
    /// A detached session running `command` in a 200x60 terminal.
    pub fn start(command: &str) -> Tmux {
        Self::start_sized(command, 200, 60)
    }

    /// A detached session running `command` in a `width`x`height` terminal.
    pub fn start_sized(command: &str, width: u16, height: u16) -> Tmux {
        // One server per session: tests run side by side in one process.
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let socket = format!("forkfleet-test-{}-{n}", std::process::id());
        let t = Tmux { socket };
        let ok = t
            .cmd(&[
                "new-session",
                "-d",
                "-s",
                "main",
                "-x",
                &width.to_string(),
                "-y",
                &height.to_string(),
                command,
            ])
            .status()
            .unwrap();
        assert!(ok.success(), "tmux could not start");
        t
    }

    fn cmd(&self, args: &[&str]) -> std::process::Command {
        let mut c = std::process::Command::new("tmux");
        c.args(["-L", &self.socket]).args(args);
        c
    }

    /// The screen and its scrollback.
    pub fn screen(&self) -> String {
        let out = self
            .cmd(&["capture-pane", "-p", "-J", "-S", "-500", "-t", "main"])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Until `done(screen)` holds (bounded); the screen then.
    pub fn wait_for(&self, what: &str, done: impl Fn(&str) -> bool) -> String {
        let deadline = std::time::Instant::now() + super::fleet::COMMAND_LIMIT;
        loop {
            let screen = self.screen();
            if done(&screen) {
                return screen;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{what} never showed:\n{screen}"
            );
            std::thread::sleep(super::fleet::POLL);
        }
    }

    pub fn type_line(&self, text: &str) {
        self.type_text(text);
        self.keys(&["Enter"]);
    }

    /// Type `text` as it is (no key names).
    pub fn type_text(&self, text: &str) {
        let ok = self
            .cmd(&["send-keys", "-t", "main", "-l", text])
            .status()
            .unwrap();
        assert!(ok.success());
    }

    /// Press keys by tmux's names (`Enter`, `Escape`, `Tab`, `C-c`).
    pub fn keys(&self, keys: &[&str]) {
        let mut args = vec!["send-keys", "-t", "main"];
        args.extend(keys);
        let ok = self.cmd(&args).status().unwrap();
        assert!(ok.success());
    }

    /// The visible screen with its colours and attributes as escape sequences.
    pub fn visible_styled(&self) -> String {
        let out = self
            .cmd(&["capture-pane", "-p", "-e", "-t", "main"])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// The visible screen only (no scrollback): what a person sees now.
    pub fn visible(&self) -> String {
        let out = self
            .cmd(&["capture-pane", "-p", "-t", "main"])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = self.cmd(&["kill-server"]).status();
    }
}
