//! The command sandbox with real processes and real files: what a command may read, write
//! and connect to, and its limits, each with a control (the same command with the sandbox
//! off, or with the network on) showing the test could fail. The kernel must have Landlock
//! with network rules (ABI 4 and later); on one without, these tests say so and fail.

use forkfleet_shared::endpoint::{CommandSandbox, SandboxMode};
use forkfleet_worker::runner::sandbox::{self, ABI_OVERRIDE_ENV};
use forkfleet_worker::runner::{run_command, CommandOutcome, CommandRun, CommandSpec, SandboxSpec};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(60);

/// A command's directories as a `Workdir` lays them out: the tree, `HOME`, `TMPDIR`.
struct Dirs {
    _root: tempfile::TempDir,
    ws: PathBuf,
    home: PathBuf,
    tmp: PathBuf,
}

fn dirs() -> Dirs {
    let root = tempfile::tempdir().unwrap();
    let [ws, home, tmp] = ["ws", "home", "tmp"].map(|d| root.path().join(d));
    for d in [&ws, &home, &tmp] {
        std::fs::create_dir(d).unwrap();
    }
    Dirs {
        _root: root,
        ws,
        home,
        tmp,
    }
}

fn needs_landlock() {
    let s = sandbox::support();
    assert!(
        s.network_rules(),
        "these tests need a kernel with Landlock ABI 4 or later (found {}; {ABI_OVERRIDE_ENV} lowers it)",
        s.abi
    );
}

fn settings(mode: SandboxMode) -> CommandSandbox {
    CommandSandbox {
        mode,
        ..CommandSandbox::default()
    }
}

/// Run `argv` in `d`'s tree, sandboxed by `settings` with the tree, HOME and TMPDIR
/// writable, as `Workdir::run` does.
async fn run_in(d: &Dirs, argv: &[&str], settings: CommandSandbox) -> CommandRun {
    let mut env = BTreeMap::new();
    env.insert("HOME".to_string(), d.home.display().to_string());
    env.insert("TMPDIR".to_string(), d.tmp.display().to_string());
    run_env(d, argv, settings, env).await
}

async fn run_env(
    d: &Dirs,
    argv: &[&str],
    settings: CommandSandbox,
    env: BTreeMap<String, String>,
) -> CommandRun {
    run_exec(d, argv, settings, env, Vec::new()).await
}

/// [`run_env`] with `exec` the directories the command may read and run programs from
/// besides the system ones (empty: the worker's `PATH`).
async fn run_exec(
    d: &Dirs,
    argv: &[&str],
    settings: CommandSandbox,
    env: BTreeMap<String, String>,
    exec: Vec<PathBuf>,
) -> CommandRun {
    let spec = CommandSpec {
        argv: argv.iter().map(|s| s.to_string()).collect(),
        env,
        timeout: Duration::from_secs(30),
        max_output_bytes: 64 * 1024,
        sandbox: SandboxSpec {
            settings,
            writable: vec![d.ws.clone(), d.home.clone(), d.tmp.clone()],
            exec,
            layers: None,
        },
    };
    tokio::time::timeout(WAIT, run_command(&d.ws, &spec, std::future::pending()))
        .await
        .unwrap()
}

fn exited(run: &CommandRun) -> i32 {
    match run.outcome {
        CommandOutcome::Exited { code } => code,
        ref other => panic!("{other:?}: {}", run.output),
    }
}

/// The worker's secrets: a key file (as a catalogue's `api_key_file`) and a blob store
/// directory, outside every command's tree.
struct Secrets {
    _dir: tempfile::TempDir,
    key: PathBuf,
    store: PathBuf,
}

fn secrets() -> Secrets {
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("openai.key");
    std::fs::write(&key, "sk-forkfleet-secret-key\n").unwrap();
    let store = dir.path().join("store");
    std::fs::create_dir_all(store.join("blob-files/ab")).unwrap();
    std::fs::write(store.join("blob-files/ab/12"), "stored-blob-secret\n").unwrap();
    Secrets {
        _dir: dir,
        key,
        store,
    }
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[tokio::test]
async fn a_command_cannot_read_the_workers_secrets_but_reads_its_tree() {
    needs_landlock();
    let d = dirs();
    std::fs::write(d.ws.join("mine.txt"), "tree-file\n").unwrap();
    let sec = secrets();
    let script = "cat mine.txt; cat \"$1\"; echo key=$?; cat \"$2/blob-files/ab/12\"; echo blob=$?; ls \"$2\"; echo ls=$?";
    let argv = ["sh", "-c", script, "sh", s(&sec.key), s(&sec.store)];

    let run = run_in(&d, &argv, CommandSandbox::default()).await;
    assert_eq!(exited(&run), 0, "{}", run.output);
    assert!(run.output.contains("tree-file"), "{}", run.output);
    assert!(run.output.contains("key=1"), "{}", run.output);
    assert!(run.output.contains("blob=1"), "{}", run.output);
    assert!(!run.output.contains("ls=0"), "{}", run.output);
    assert!(run.output.contains("Permission denied"), "{}", run.output);
    assert!(
        !run.output.contains("sk-forkfleet-secret-key"),
        "{}",
        run.output
    );
    assert!(!run.output.contains("stored-blob-secret"), "{}", run.output);

    // Control: the same command without the sandbox reads them.
    let open = run_in(&d, &argv, settings(SandboxMode::Off)).await;
    assert!(
        open.output.contains("sk-forkfleet-secret-key"),
        "{}",
        open.output
    );
    assert!(
        open.output.contains("stored-blob-secret"),
        "{}",
        open.output
    );
    assert!(open.output.contains("key=0"), "{}", open.output);
}

#[tokio::test]
async fn a_command_cannot_read_the_workers_environment_through_proc() {
    needs_landlock();
    let d = dirs();
    // The command's parent is this test process: its environ holds the worker's variables.
    let script = "tr '\\0' '\\n' < /proc/$PPID/environ | grep -c '^PATH=' ; echo environ=$?; cat /proc/$PPID/maps > /dev/null; echo maps=$?";
    let run = run_in(&d, &["sh", "-c", script], CommandSandbox::default()).await;
    assert!(run.output.contains("environ=1"), "{}", run.output);
    assert!(run.output.contains("maps=1"), "{}", run.output);
    assert!(run.output.contains("Permission denied"), "{}", run.output);
    // Its own /proc entries, and the system-wide ones, stay readable.
    let own = run_in(
        &d,
        &[
            "cat",
            "/proc/self/status",
            "/proc/cpuinfo",
            "/proc/sys/kernel/ostype",
        ],
        CommandSandbox::default(),
    )
    .await;
    assert_eq!(exited(&own), 0, "{}", own.output);
    assert!(own.output.contains("Linux"), "{}", own.output);
    let open = run_in(&d, &["sh", "-c", script], settings(SandboxMode::Off)).await;
    assert!(open.output.contains("environ=0"), "{}", open.output);
}

#[tokio::test]
async fn a_command_writes_only_in_its_tree_home_and_tmpdir() {
    needs_landlock();
    let d = dirs();
    let outside = tempfile::tempdir().unwrap();
    let evil = outside.path().join("evil.txt");
    let script = "echo t > made.txt && mkdir -p sub && echo s > sub/x && echo h > \"$HOME/h\" && echo t > \"$TMPDIR/t\" && echo inside-ok; echo e > \"$1\"; echo outside=$?";
    let argv = ["sh", "-c", script, "sh", s(&evil)];
    let run = run_in(&d, &argv, CommandSandbox::default()).await;
    assert!(run.output.contains("inside-ok"), "{}", run.output);
    assert!(run.output.contains("outside=2"), "{}", run.output);
    assert!(run.output.contains("Permission denied"), "{}", run.output);
    assert!(!evil.exists());
    assert_eq!(std::fs::read_to_string(d.ws.join("sub/x")).unwrap(), "s\n");
    assert_eq!(std::fs::read_to_string(d.home.join("h")).unwrap(), "h\n");
    assert_eq!(std::fs::read_to_string(d.tmp.join("t")).unwrap(), "t\n");
    // Nor in the system directories, root or not.
    let etc = run_in(
        &d,
        &[
            "sh",
            "-c",
            "echo x > /etc/forkfleet-sandbox-test; echo etc=$?",
        ],
        CommandSandbox::default(),
    )
    .await;
    assert!(etc.output.contains("etc=2"), "{}", etc.output);
    assert!(!Path::new("/etc/forkfleet-sandbox-test").exists());

    // Control: without the sandbox the write lands.
    let open = run_in(&d, &argv, settings(SandboxMode::Off)).await;
    assert!(open.output.contains("outside=0"), "{}", open.output);
    assert!(evil.exists());
}

#[tokio::test]
async fn tcp_is_refused_without_network_and_allowed_with_it() {
    needs_landlock();
    let d = dirs();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port().to_string();
    // bash's /dev/tcp: a plain connect(2), no file involved.
    let script = "exec 3<>/dev/tcp/127.0.0.1/$1 && echo connected";
    let argv = ["bash", "-c", script, "bash", port.as_str()];

    let run = run_in(&d, &argv, CommandSandbox::default()).await;
    assert_ne!(exited(&run), 0, "{}", run.output);
    assert!(!run.output.contains("connected"), "{}", run.output);
    assert!(run.output.contains("Permission denied"), "{}", run.output);

    let allowed = CommandSandbox {
        network: true,
        ..CommandSandbox::default()
    };
    let run = run_in(&d, &argv, allowed).await;
    assert_eq!(exited(&run), 0, "{}", run.output);
    assert!(run.output.contains("connected"), "{}", run.output);
    // The connection reached this listener.
    listener.set_nonblocking(true).unwrap();
    assert!(listener.accept().is_ok());
}

#[tokio::test]
async fn the_limits_apply() {
    needs_landlock();
    let d = dirs();
    let limited = CommandSandbox {
        max_processes: 64,
        max_memory_mb: 128,
        max_file_size_mb: 1,
        ..CommandSandbox::default()
    };
    // The limits as the command's process sees them.
    let run = run_in(&d, &["cat", "/proc/self/limits"], limited.clone()).await;
    assert_eq!(exited(&run), 0, "{}", run.output);
    let limit = |name: &str| -> Vec<String> {
        let line = run
            .output
            .lines()
            .find(|l| l.starts_with(name))
            .unwrap_or_else(|| panic!("{name} in {}", run.output));
        line[name.len()..]
            .split_whitespace()
            .map(str::to_string)
            .collect()
    };
    assert_eq!(limit("Max processes")[..2], ["64", "64"]);
    assert_eq!(limit("Max data size")[..2], ["134217728", "134217728"]);
    assert_eq!(limit("Max file size")[..2], ["1048576", "1048576"]);
    assert_eq!(limit("Max core file size")[..2], ["0", "0"]);

    // A write past the file size limit stops at it (SIGXFSZ kills `head`).
    let big = run_in(
        &d,
        &[
            "sh",
            "-c",
            "head -c 3000000 /dev/zero > big.bin; echo status=$?",
        ],
        limited.clone(),
    )
    .await;
    assert!(!big.output.contains("status=0"), "{}", big.output);
    let size = std::fs::metadata(d.ws.join("big.bin")).unwrap().len();
    assert!(size <= 1024 * 1024, "{size}");

    // Memory past the data limit is refused.
    let mem = run_in(
        &d,
        &[
            "/usr/bin/python3",
            "-c",
            "b = bytearray(512 * 1024 * 1024); print('allocated')",
        ],
        limited.clone(),
    )
    .await;
    assert_ne!(exited(&mem), 0, "{}", mem.output);
    assert!(mem.output.contains("MemoryError"), "{}", mem.output);

    // Control: the default limits let both through.
    let fine = run_in(
        &d,
        &[
            "sh",
            "-c",
            "head -c 3000000 /dev/zero > big.bin && /usr/bin/python3 -c \"b = bytearray(512 * 1024 * 1024); print('allocated')\"",
        ],
        CommandSandbox::default(),
    )
    .await;
    assert_eq!(exited(&fine), 0, "{}", fine.output);
    assert!(fine.output.contains("allocated"), "{}", fine.output);
}

#[tokio::test]
async fn a_protected_path_stays_closed_below_a_readable_directory() {
    needs_landlock();
    let d = dirs();
    // A directory of the worker's PATH (readable and executable) holding a key file the
    // worker protects, beside a program.
    let bin = tempfile::tempdir().unwrap();
    std::fs::create_dir(bin.path().join("keys")).unwrap();
    let key = bin.path().join("keys/model.key");
    std::fs::write(&key, "protected-key\n").unwrap();
    std::fs::write(bin.path().join("keys/readme"), "readme-text\n").unwrap();
    std::fs::write(bin.path().join("notes.txt"), "notes-text\n").unwrap();
    sandbox::protect([key.clone()]);
    let mut env = BTreeMap::new();
    env.insert(
        "PATH".to_string(),
        format!("{}:/usr/bin:/bin", bin.path().display()),
    );
    let script = "cat \"$1/notes.txt\" \"$1/keys/readme\"; cat \"$1/keys/model.key\"; echo key=$?";
    let argv = ["sh", "-c", script, "sh", s(bin.path())];
    let exec = vec![bin.path().to_path_buf(), "/usr/bin".into(), "/bin".into()];
    let run = run_exec(&d, &argv, CommandSandbox::default(), env.clone(), exec).await;
    assert!(run.output.contains("notes-text"), "{}", run.output);
    assert!(run.output.contains("readme-text"), "{}", run.output);
    assert!(run.output.contains("key=1"), "{}", run.output);
    assert!(!run.output.contains("protected-key"), "{}", run.output);
    let open = run_env(&d, &argv, settings(SandboxMode::Off), env).await;
    assert!(open.output.contains("protected-key"), "{}", open.output);
}

#[tokio::test]
async fn required_is_refused_on_a_kernel_without_landlock() {
    // A process of this test binary of its own, where FORKFLEET_SANDBOX_ABI=0 makes the
    // worker see no Landlock (support is read once per process).
    let exe = std::env::current_exe().unwrap();
    let child = tokio::process::Command::new(exe)
        .args([
            "--exact",
            "suite::sandbox::without_landlock",
            "--ignored",
            "--nocapture",
        ])
        .env(ABI_OVERRIDE_ENV, "0")
        .env("FORKFLEET_SANDBOX_TEST_CHILD", "1")
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(WAIT, child).await.unwrap().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{text}");
    assert!(text.contains("1 passed"), "{text}");
    assert!(text.contains("refused as expected"), "{text}");
}

#[tokio::test]
#[ignore = "run by required_is_refused_on_a_kernel_without_landlock, in a process of its own"]
async fn without_landlock() {
    if std::env::var("FORKFLEET_SANDBOX_TEST_CHILD").is_err() {
        return;
    }
    assert!(!sandbox::support().landlock());
    let d = dirs();
    let sec = secrets();
    let argv = ["cat", s(&sec.key)];
    let run = run_in(&d, &argv, settings(SandboxMode::Required)).await;
    match &run.outcome {
        CommandOutcome::SpawnFailed { error } => {
            assert!(error.contains("the sandbox is required"), "{error}");
            assert!(error.contains("no Landlock"), "{error}");
            assert!(error.contains(ABI_OVERRIDE_ENV), "{error}");
        }
        other => panic!("{other:?}: {}", run.output),
    }
    assert!(!run.output.contains("sk-forkfleet-secret-key"));
    // `auto` runs it, unconfined (with the limits): the kernel offers nothing more.
    let auto = run_in(&d, &argv, CommandSandbox::default()).await;
    assert_eq!(exited(&auto), 0, "{}", auto.output);
    println!("refused as expected");
}

/// A spec's `env.PATH` chooses where programs are looked up, not what becomes readable: a
/// directory of the worker's named on it stays closed.
#[tokio::test]
async fn a_specs_path_does_not_open_the_workers_directories() {
    needs_landlock();
    let d = dirs();
    let sec = secrets();
    let key_dir = sec.key.parent().unwrap().to_path_buf();
    let mut env = BTreeMap::new();
    env.insert("HOME".to_string(), d.home.display().to_string());
    env.insert("TMPDIR".to_string(), d.tmp.display().to_string());
    env.insert(
        "PATH".to_string(),
        format!("{}:/usr/bin:/bin", key_dir.display()),
    );
    let argv = ["sh", "-c", "cat \"$1\"; echo key=$?", "sh", s(&sec.key)];
    let run = run_env(&d, &argv, CommandSandbox::default(), env.clone()).await;
    assert!(run.output.contains("key=1"), "{}", run.output);
    assert!(
        !run.output.contains("sk-forkfleet-secret-key"),
        "{}",
        run.output
    );
    // Control: unsandboxed, the same read works.
    let open = run_env(&d, &argv, settings(SandboxMode::Off), env).await;
    assert!(
        open.output.contains("sk-forkfleet-secret-key"),
        "{}",
        open.output
    );
}

#[test]
fn toolchains_under_the_home_are_readable_the_rest_of_it_is_not() {
    let home = Path::new("/home/w");
    let dirs = sandbox::toolchain_dirs(
        "/home/w/.pyenv/shims:/usr/bin:relative:/:/home/w/.cargo/bin:/home/w/.local/bin:/home/w/bin:/opt/tool/bin",
        Some(home),
    );
    let got: Vec<&str> = dirs.iter().map(|p| p.to_str().unwrap()).collect();
    assert_eq!(
        got,
        [
            "/home/w/.pyenv/shims",
            "/home/w/.pyenv",
            "/usr/bin",
            "/home/w/.cargo/bin",
            "/home/w/.cargo",
            "/home/w/.rustup",
            "/home/w/.local/bin",
            "/home/w/.local/lib",
            "/home/w/.local/pipx",
            "/home/w/bin",
            "/opt/tool/bin",
        ]
    );
    // A home of `/` opens nothing beyond the PATH itself.
    let root = sandbox::toolchain_dirs("/.x/bin", Some(Path::new("/")));
    assert_eq!(root, [PathBuf::from("/.x/bin")]);
}

/// A virtual environment the snapshot skips stays usable by commands: its `bin` on the
/// worker's `PATH` opens the whole environment read-only (a `node_modules/.bin` its
/// `node_modules`); a plain `bin` opens itself only.
#[test]
fn a_virtual_environment_on_the_path_is_readable_whole() {
    let tmp = tempfile::tempdir().unwrap();
    let venv = tmp.path().join("proj/.venv");
    std::fs::create_dir_all(venv.join("bin")).unwrap();
    std::fs::write(venv.join("pyvenv.cfg"), "home = /usr/bin\n").unwrap();
    let node = tmp.path().join("proj/node_modules/.bin");
    std::fs::create_dir_all(&node).unwrap();
    let plain = tmp.path().join("tools/bin");
    std::fs::create_dir_all(&plain).unwrap();
    let path = format!(
        "{}:{}:{}",
        venv.join("bin").display(),
        node.display(),
        plain.display()
    );
    let dirs = sandbox::toolchain_dirs(&path, None);
    assert_eq!(
        dirs,
        [
            venv.join("bin"),
            venv.clone(),
            node.clone(),
            tmp.path().join("proj/node_modules"),
            plain.clone(),
        ]
    );
}
