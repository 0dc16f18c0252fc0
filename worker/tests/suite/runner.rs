//! Running commands against a branch's tree: materialising it from blobs, then running a
//! real process with a cleared environment, a timeout that kills its whole process group,
//! cancellation, and capped output.

use bytes::Bytes;
use forkfleet_shared::blob::{BlobHash, BlobStore, MemBlobStore};
use forkfleet_shared::endpoint::SandboxMode;
use forkfleet_shared::error::ErrorKind;
use forkfleet_shared::manifest::{FileEntry, Manifest, MODE_FILE, MODE_SYMLINK};
use forkfleet_shared::path::WsPath;
use forkfleet_worker::cache::BlobCache;
use forkfleet_worker::runner::{materialize, run_command, CommandOutcome, CommandSpec, Make};
use forkfleet_worker::WorkerError;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

const WAIT: Duration = Duration::from_secs(20);

async fn put(blobs: &MemBlobStore, m: &mut Manifest, path: &str, content: &[u8], mode: u32) {
    let e = FileEntry::for_bytes(content, mode);
    blobs
        .put(BlobHash::of(content), Bytes::copy_from_slice(content))
        .await
        .unwrap();
    m.insert_file(WsPath::parse(path).unwrap(), e);
}

/// The worker's cache over `blobs` (what a tree is materialised from).
fn cache(blobs: MemBlobStore) -> BlobCache {
    BlobCache::new(Arc::new(blobs), 1 << 20)
}

fn sh(script: &str, timeout: Duration) -> CommandSpec {
    CommandSpec {
        argv: vec!["sh".into(), "-c".into(), script.into()],
        env: BTreeMap::new(),
        timeout,
        max_output_bytes: 64 * 1024,
        sandbox: Default::default(),
    }
}

/// The command exited with code 0 (its output shown if not).
fn exited_ok(out: &forkfleet_worker::runner::CommandRun) {
    assert_eq!(
        out.outcome,
        CommandOutcome::Exited { code: 0 },
        "{}",
        out.output
    );
}

async fn run(dir: &std::path::Path, spec: &CommandSpec) -> forkfleet_worker::runner::CommandRun {
    tokio::time::timeout(WAIT, run_command(dir, spec, std::future::pending()))
        .await
        .unwrap()
}

#[tokio::test]
async fn a_tree_is_written_with_modes_dirs_and_only_safe_symlinks() {
    let blobs = MemBlobStore::new();
    let mut m = Manifest::default();
    put(&blobs, &mut m, "src/lib.rs", b"pub fn f() {}\n", MODE_FILE).await;
    put(&blobs, &mut m, "run.sh", b"#!/bin/sh\necho ran\n", 0o100755).await;
    put(&blobs, &mut m, "src/inner.txt", b"inner\n", MODE_FILE).await;
    put(&blobs, &mut m, "src/link", b"inner.txt", MODE_SYMLINK).await;
    put(&blobs, &mut m, "src/escape", b"../../outside", MODE_SYMLINK).await;
    m.dirs.insert(WsPath::parse("src").unwrap());
    m.dirs.insert(WsPath::parse("empty/dir").unwrap());
    let dir = tempfile::tempdir().unwrap();
    let stats = materialize(&m, &cache(blobs), dir.path(), Make::Write)
        .await
        .unwrap();
    assert_eq!(stats.files, 4);
    assert_eq!(stats.skipped, [WsPath::parse("src/escape").unwrap()]);
    let p = dir.path();
    assert_eq!(
        std::fs::read_to_string(p.join("src/lib.rs")).unwrap(),
        "pub fn f() {}\n"
    );
    assert_eq!(
        std::fs::read_to_string(p.join("src/link")).unwrap(),
        "inner\n"
    );
    assert!(std::fs::symlink_metadata(p.join("src/escape")).is_err());
    assert!(p.join("empty/dir").is_dir());
    // The executable bit is kept: the script runs by its own path.
    let out = run(
        p,
        &CommandSpec {
            argv: vec!["./run.sh".into()],
            ..sh("", Duration::from_secs(10))
        },
    )
    .await;
    exited_ok(&out);
    assert_eq!(out.output, "ran\n");
}

#[tokio::test]
async fn a_missing_blob_is_an_error_naming_the_path() {
    let mut m = Manifest::default();
    m.insert_file(
        WsPath::parse("gone.txt").unwrap(),
        FileEntry::for_bytes(b"never stored", MODE_FILE),
    );
    let dir = tempfile::tempdir().unwrap();
    let err = materialize(&m, &cache(MemBlobStore::new()), dir.path(), Make::Write)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("gone.txt"), "{err}");
    assert!(
        matches!(&err, WorkerError::ReadBlob { path, .. } if path == "gone.txt"),
        "{err}"
    );
    assert_eq!(err.kind(), ErrorKind::NotFound);
}

#[tokio::test]
async fn exit_code_and_both_streams_are_reported() {
    let dir = tempfile::tempdir().unwrap();
    let out = run(
        dir.path(),
        &sh("echo out; echo err >&2; exit 3", Duration::from_secs(10)),
    )
    .await;
    assert_eq!(out.outcome, CommandOutcome::Exited { code: 3 });
    assert!(
        out.output.contains("out\n") && out.output.contains("err\n"),
        "{}",
        out.output
    );
    assert_eq!(out.truncated_bytes, 0);
}

#[tokio::test]
async fn the_environment_is_cleared_to_path_home_and_what_is_passed() {
    let dir = tempfile::tempdir().unwrap();
    // `env` found through the PATH given to the command, its output NUL-separated.
    let mut spec = CommandSpec {
        argv: vec!["env".into(), "-0".into()],
        ..sh("", Duration::from_secs(10))
    };
    spec.env.insert("MINE".into(), "1".into());
    let out = run(dir.path(), &spec).await;
    exited_ok(&out);
    let seen: BTreeMap<&str, &str> = out
        .output
        .split('\0')
        .filter(|v| !v.is_empty())
        .map(|v| v.split_once('=').unwrap())
        .collect();
    let home = dir.path().display().to_string();
    assert_eq!(seen.get("MINE"), Some(&"1"));
    assert_eq!(seen.get("HOME"), Some(&home.as_str()));
    assert_eq!(seen.get("TMPDIR"), Some(&home.as_str()));
    assert_eq!(seen.get("LANG"), Some(&"C.UTF-8"));
    assert!(seen.contains_key("PATH"));
    // Nothing else of the test process's own environment (cargo sets plenty) gets through.
    let own: Vec<String> = std::env::vars_os()
        .map(|(k, _)| k.to_string_lossy().into_owned())
        .filter(|k| !["PATH", "HOME", "TMPDIR", "LANG", "MINE"].contains(&k.as_str()))
        .collect();
    assert!(!own.is_empty(), "the test process has variables of its own");
    let leaked: Vec<&String> = own
        .iter()
        .filter(|k| seen.contains_key(k.as_str()))
        .collect();
    assert!(leaked.is_empty(), "leaked: {leaked:?}");
    assert_eq!(seen.len(), 5, "{seen:?}");
}

/// A FIFO `held` in `dir` that a script opens as its fd 3 (`exec 3>held`), and every
/// process it starts inherits. `opened` completes once the script opened it; `closed` once
/// every process holding it has exited (the read end sees end of file): no polling.
struct Held {
    opened: tokio::sync::oneshot::Receiver<()>,
    closed: tokio::sync::oneshot::Receiver<()>,
}

const HOLD: &str = "exec 3>held; ";

fn held(dir: &std::path::Path) -> Held {
    let fifo = dir.join("held");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap();
    assert!(made.success());
    let (opened_tx, opened) = tokio::sync::oneshot::channel();
    let (closed_tx, closed) = tokio::sync::oneshot::channel();
    // A plain thread: opening a FIFO blocks until a writer opens it, which a script killed
    // early never does (the thread is then left blocked, harmlessly).
    std::thread::spawn(move || {
        use std::io::Read;
        let Ok(mut reader) = std::fs::File::open(&fifo) else {
            return;
        };
        let _ = opened_tx.send(());
        let _ = reader.read_to_end(&mut Vec::new());
        let _ = closed_tx.send(());
    });
    Held { opened, closed }
}

/// Every process the command started has exited.
async fn assert_all_exited(closed: tokio::sync::oneshot::Receiver<()>) {
    tokio::time::timeout(Duration::from_secs(5), closed)
        .await
        .expect("a process the command started outlived it")
        .unwrap();
}

/// The pid a script wrote to `bg.pid` in `dir`, once it wrote all of it.
fn bg_pid(dir: &std::path::Path) -> Option<u32> {
    let text = std::fs::read_to_string(dir.join("bg.pid")).ok()?;
    text.strip_suffix('\n')?.parse().ok()
}

#[tokio::test]
async fn a_hanging_command_is_killed_with_its_children_at_the_timeout() {
    // The timeout must come after the script started its background child and wrote its
    // pid; a run whose timeout came first (a slow machine) is tried with a longer one.
    for timeout_ms in [300, 1_000, 3_000, 10_000] {
        let dir = tempfile::tempdir().unwrap();
        let held = held(dir.path());
        let started = Instant::now();
        let out = run(
            dir.path(),
            &sh(
                &format!("{HOLD}sleep 60 & echo $! > bg.pid; sleep 60"),
                Duration::from_millis(timeout_ms),
            ),
        )
        .await;
        assert_eq!(out.outcome, CommandOutcome::TimedOut);
        assert!(started.elapsed() < Duration::from_millis(timeout_ms) + Duration::from_secs(5));
        if bg_pid(dir.path()).is_some() {
            assert_all_exited(held.closed).await;
            return;
        }
    }
    panic!("the script never wrote its background child's pid before the timeout");
}

#[tokio::test]
async fn stragglers_left_after_a_normal_exit_are_killed() {
    let dir = tempfile::tempdir().unwrap();
    let held = held(dir.path());
    let out = run(
        dir.path(),
        &sh(
            &format!("{HOLD}sleep 60 & echo $! > bg.pid; echo done"),
            Duration::from_secs(10),
        ),
    )
    .await;
    assert_eq!(out.outcome, CommandOutcome::Exited { code: 0 });
    assert!(out.output.contains("done"));
    assert!(bg_pid(dir.path()).is_some());
    assert_all_exited(held.closed).await;
}

#[tokio::test]
async fn cancelling_kills_the_command() {
    let dir = tempfile::tempdir().unwrap();
    let held = held(dir.path());
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let spec = sh(
        &format!("{HOLD}sleep 60 & sleep 60"),
        Duration::from_secs(60),
    );
    let path = dir.path().to_path_buf();
    let running = tokio::spawn(async move {
        run_command(&path, &spec, async {
            let _ = rx.await;
        })
        .await
    });
    // Cancelled once it runs: it and its child are killed.
    tokio::time::timeout(WAIT, held.opened)
        .await
        .unwrap()
        .unwrap();
    tx.send(()).unwrap();
    let out = tokio::time::timeout(WAIT, running).await.unwrap().unwrap();
    assert_eq!(out.outcome, CommandOutcome::Cancelled);
    assert_all_exited(held.closed).await;
}

#[tokio::test]
async fn a_program_that_cannot_start_is_reported() {
    let dir = tempfile::tempdir().unwrap();
    let out = run(
        dir.path(),
        &CommandSpec {
            argv: vec!["/nonexistent/forkfleet-test-program".into()],
            ..sh("", Duration::from_secs(10))
        },
    )
    .await;
    assert!(
        matches!(&out.outcome, CommandOutcome::SpawnFailed { error } if error.contains("/nonexistent/forkfleet-test-program")),
        "{:?}",
        out.outcome
    );
    let empty = run(
        dir.path(),
        &CommandSpec {
            argv: vec![],
            ..sh("", Duration::from_secs(10))
        },
    )
    .await;
    assert!(matches!(empty.outcome, CommandOutcome::SpawnFailed { .. }));
}

#[tokio::test]
async fn long_output_keeps_its_head_and_tail() {
    let dir = tempfile::tempdir().unwrap();
    let mut spec = sh(
        "echo FIRST; i=0; while [ $i -lt 20000 ]; do echo line $i; i=$((i+1)); done; echo LAST",
        Duration::from_secs(30),
    );
    spec.max_output_bytes = 4096;
    let out = run(dir.path(), &spec).await;
    assert_eq!(out.outcome, CommandOutcome::Exited { code: 0 });
    assert!(out.truncated_bytes > 100_000, "{}", out.truncated_bytes);
    assert!(out.output.starts_with("FIRST\n"));
    assert!(out.output.ends_with("LAST\n"));
    assert!(out.output.contains("bytes of output left out"));
    assert!(out.output.len() < 4096 + 100);
}

/// A command starts as from a shell: no signal blocked, SIGPIPE at its default (a pipe's
/// writer ends quietly when the reader has gone), a program found on `PATH`; how it ended
/// is told as `waitpid` tells it.
#[tokio::test]
async fn a_command_starts_with_default_signals_and_is_found_on_path() {
    let dir = tempfile::tempdir().unwrap();
    let out = run(dir.path(), &sh("yes | head -c 4", Duration::from_secs(20))).await;
    exited_ok(&out);
    assert_eq!(out.output, "y\ny\n");
    // The sandbox keeps `/proc/self/status` from the command: read it unconfined.
    let mut open = sh(
        "grep -E '^Sig(Blk|Ign)' /proc/self/status",
        Duration::from_secs(20),
    );
    open.sandbox.settings.mode = SandboxMode::Off;
    let out = run(dir.path(), &open).await;
    exited_ok(&out);
    let field = |name: &str| {
        let line = out.output.lines().find(|l| l.starts_with(name)).unwrap();
        u64::from_str_radix(line.split_whitespace().nth(1).unwrap(), 16).unwrap()
    };
    assert_eq!(field("SigBlk:"), 0, "{}", out.output);
    assert_eq!(
        field("SigIgn:") & (1 << (libc::SIGPIPE - 1)),
        0,
        "{}",
        out.output
    );

    let killed = run(dir.path(), &sh("kill -TERM $$", Duration::from_secs(20))).await;
    assert_eq!(
        killed.outcome,
        CommandOutcome::Signalled {
            signal: libc::SIGTERM
        }
    );
    let code = run(dir.path(), &sh("exit 3", Duration::from_secs(20))).await;
    assert_eq!(code.outcome, CommandOutcome::Exited { code: 3 });

    for (argv0, says) in [
        ("forkfleet-no-such-program", "No such file"),
        ("./not-executable", "Permission denied"),
    ] {
        std::fs::write(dir.path().join("not-executable"), "#!/bin/sh\n").unwrap();
        let out = run(
            dir.path(),
            &CommandSpec {
                argv: vec![argv0.into()],
                ..sh("", Duration::from_secs(10))
            },
        )
        .await;
        assert!(
            matches!(&out.outcome, CommandOutcome::SpawnFailed { error } if error.contains(argv0) && error.contains(says)),
            "{argv0}: {:?}",
            out.outcome
        );
    }
}

/// Every command is reaped: those that ran to the end, those cancelled, and those whose
/// future was dropped (killed and reaped off the runtime). None is left a zombie.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_command_is_reaped_however_it_ends() {
    let dir = tempfile::tempdir().unwrap();
    // A program of a name of its own, to tell its zombies from other tests' children.
    let name = format!("ffreap{}", std::process::id() % 1_000_000);
    let program = dir.path().join(&name);
    std::fs::copy("/bin/sh", &program).unwrap();
    let spec = |script: &str| {
        let mut s = sh(script, Duration::from_secs(30));
        s.argv[0] = program.display().to_string();
        s.sandbox.settings.mode = SandboxMode::Off;
        s
    };
    let ran = futures::future::join_all((0..20).map(|i| {
        let spec = spec(&format!("exit {}", i % 3));
        let dir = dir.path().to_path_buf();
        async move { run(&dir, &spec).await }
    }))
    .await;
    for (i, out) in ran.iter().enumerate() {
        assert_eq!(out.outcome, CommandOutcome::Exited { code: i as i32 % 3 });
    }
    // `; exit`: the shell, not a `sleep` it could exec into, stays the child.
    let cancelled = run_command(dir.path(), &spec("sleep 30; exit 0"), async {}).await;
    assert_eq!(cancelled.outcome, CommandOutcome::Cancelled);
    for _ in 0..5 {
        let dropped = tokio::time::timeout(
            Duration::from_millis(50),
            run_command(
                dir.path(),
                &spec("sleep 30; exit 0"),
                std::future::pending(),
            ),
        )
        .await;
        assert!(dropped.is_err(), "a 30 s command ended within 50 ms");
    }
    let zombies = || {
        let me = std::process::id().to_string();
        std::fs::read_dir("/proc")
            .unwrap()
            .filter_map(|e| std::fs::read_to_string(e.ok()?.path().join("stat")).ok())
            .filter(|stat| {
                // pid (comm) state ppid ...
                let Some((comm, rest)) = stat.split_once(") ") else {
                    return false;
                };
                let fields: Vec<&str> = rest.split(' ').collect();
                comm.ends_with(&format!("({name}"))
                    && fields.first() == Some(&"Z")
                    && fields.get(1) == Some(&me.as_str())
            })
            .count()
    };
    let deadline = Instant::now() + WAIT;
    while zombies() > 0 {
        assert!(
            Instant::now() < deadline,
            "{} commands left unreaped",
            zombies()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
