//! A live `forkfleet run` serves the client commands of other processes on its data dir
//! through `<data>/api.sock` (issue 13, defect 8): a second terminal costs, steers,
//! terminates, tops up and watches its fork while it runs; a socket file nobody listens on
//! is removed and ignored.

use super::harness::{branch, command, forkfleet, json, path_str, stderr, Example};
use forkfleet_client::local;
use forkfleet_client::{ApiClient, Client};
use forkfleet_coordinator::RunStore;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Child, Output, Stdio};
use std::time::{Duration, Instant};

/// Every wait of these tests gives up after this long.
const LIMIT: Duration = Duration::from_secs(90);
/// The pause between two looks at something awaited.
const POLL: Duration = Duration::from_millis(50);

/// Three long branches `a`, `b`, `c`, and `p`, whose own cap pauses it after a call or
/// two.
fn live_spec(ex: &Example) -> PathBuf {
    std::fs::write(
        ex.dir.path().join("long.toml"),
        super::harness::writes_then_done(100, true, "slow/{label}-{repeat}.md", "x\\n", 600),
    )
    .unwrap();
    ex.write_spec(
        "goal = \"long\"\nworkspace = \"workspace\"\nmodel = \"scripted:long\"\nmax_turns = 700\n\
         on_exhausted = \"pause\"\nmax_output_tokens = 200\n\
         [models.\"scripted:long\"]\nscript = \"long.toml\"\n\
         price = { input_per_mtok = 0.15, output_per_mtok = 0.60 }\n\
         [[branches]]\nlabel = \"a\"\nsteer = \"go\"\n\
         [[branches]]\nlabel = \"b\"\nsteer = \"go\"\n\
         [[branches]]\nlabel = \"c\"\nsteer = \"go\"\n\
         [[branches]]\nlabel = \"p\"\nsteer = \"go\"\nbudget_usd = 0.0005\n",
    )
}

/// `forkfleet run SPEC --data DATA --timeout-s 120 EXTRA...`, started with its output
/// piped.
fn spawn_run(spec: &Path, data: &Path, extra: &[&str]) -> Child {
    let mut args = vec![
        "run",
        path_str(spec),
        "--data",
        path_str(data),
        "--timeout-s",
        "120",
    ];
    args.extend_from_slice(extra);
    command()
        .args(&args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// `forkfleet ARGS --data DATA --json`, which must succeed, as JSON.
fn ok_json(args: &[&str], data: &Path) -> Value {
    let mut all = args.to_vec();
    all.extend(["--data", path_str(data), "--json"]);
    json(&forkfleet(&all))
}

/// Look at `probe` until it answers `Some`, at most [`LIMIT`]; `what` names what is
/// awaited. Fails at once if `run` has ended, since everything awaited must happen while
/// it runs.
fn wait_for<T>(run: &mut Child, what: &str, mut probe: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + LIMIT;
    loop {
        if let Some(found) = probe() {
            return found;
        }
        still_running(run, what);
        assert!(Instant::now() < deadline, "gave up waiting for {what}");
        std::thread::sleep(POLL);
    }
}

fn still_running(run: &mut Child, when: &str) {
    if let Some(status) = run.try_wait().unwrap() {
        panic!("`forkfleet run` ended ({status}) before {when}");
    }
}

/// The state of branch `label` in a fork view.
fn state<'a>(view: &'a Value, label: &str) -> &'a str {
    branch(view, label)["state"].as_str().unwrap()
}

/// The lines `from` yields, read on a thread of their own.
fn lines_of(from: impl std::io::Read + Send + 'static) -> std::sync::mpsc::Receiver<String> {
    use std::io::BufRead;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(from).lines() {
            let Ok(line) = line else { return };
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    rx
}

/// The process's output, once it has ended (bounded by its own `--timeout-s`).
fn finish(run: Child) -> Output {
    run.wait_with_output().unwrap()
}

#[test]
fn a_second_process_costs_steers_terminates_tops_up_and_watches_a_live_run() {
    let ex = Example::quickstart();
    let spec = live_spec(&ex);
    let data = ex.data();
    let socket = local::socket_path(&data);
    let mut run = spawn_run(&spec, &data, &["--json"]);

    // The socket appears once the first process holds the store (before that a client
    // would open the store itself).
    wait_for(&mut run, "the socket", || socket.exists().then_some(()));
    let mode = {
        use std::os::unix::fs::PermissionsExt;
        std::fs::metadata(&socket).unwrap().permissions().mode() & 0o777
    };
    assert_eq!(mode, 0o600, "socket mode {mode:o}");

    // Every command below runs while `run` holds the store: it is served over the socket.
    let view = wait_for(&mut run, "`p` paused by its cap, `a` running", || {
        let list = ok_json(&["fork", "ls"], &data);
        let view = list.as_array()?.first()?.clone();
        (state(&view, "p") == "paused" && state(&view, "a") == "running").then_some(view)
    });
    let fork = view["fork_id"].as_str().unwrap().to_string();

    // `fork cost` answers.
    let cost = ok_json(&["fork", "cost", &fork], &data);
    assert_eq!(cost["fork_id"], fork.as_str(), "{cost}");
    assert_eq!(cost["branches"].as_array().unwrap().len(), 4, "{cost}");
    still_running(&mut run, "`fork cost` answered");

    // `fork steer` reaches a running branch: its log shows the message.
    let steered = ok_json(
        &["fork", "steer", &fork, "a", "also write a summary"],
        &data,
    );
    assert_eq!(steered["label"], "a", "{steered}");
    let run_a = steered["run_id"].as_str().unwrap().to_string();
    wait_for(&mut run, "the steer in `a`'s log", || {
        let log = ok_json(&["log", &run_a], &data);
        log.as_array()
            .unwrap()
            .iter()
            .any(|e| e["event"]["type"] == "steer" && e["event"]["text"] == "also write a summary")
            .then_some(())
    });

    // `fork terminate` stops one.
    let terminated = ok_json(&["fork", "terminate", &fork, "b"], &data);
    assert_eq!(terminated["label"], "b", "{terminated}");
    wait_for(&mut run, "`b` terminated", || {
        let view = ok_json(&["fork", "show", &fork], &data);
        (state(&view, "b") == "terminated").then_some(())
    });

    // `fork topup` resumes the paused branch; the first process's workers run it.
    let topped = ok_json(
        &["fork", "topup", &fork, "--branch", "p", "--usd", "1"],
        &data,
    );
    let p = topped["branches"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["label"] == "p")
        .unwrap();
    assert!(p["cap_usd"].as_f64().unwrap() > 1.0, "{topped}");
    wait_for(&mut run, "`p` running again", || {
        let view = ok_json(&["fork", "show", &fork], &data);
        (state(&view, "p") == "running").then_some(())
    });

    // The run store's blobs are read through the socket (`get_blob`), hash-checked.
    let snapshot = view["snapshot"].as_str().map(str::to_string);
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let transport = local::connect(&socket)
            .await
            .unwrap()
            .expect("a live socket");
        let client = Client::over_socket(transport);
        let id = client.find_fork(&fork).await.unwrap();
        let shown = client.fork(id).await.unwrap();
        if let Some(hex) = &snapshot {
            assert_eq!(&shown.snapshot.to_hex(), hex);
        }
        let bytes = forkfleet_shared::blob::fetch(client.blobs().as_ref(), &shown.snapshot)
            .await
            .unwrap();
        assert!(!bytes.is_empty());
        let absent = forkfleet_shared::blob::BlobHash::of(b"not in the store");
        assert!(client.blobs().get(&absent).await.unwrap().is_none());
    });
    still_running(&mut run, "the blobs were read");

    // `fork watch` follows the fork over the socket (its fork directory synced from the
    // run store's blobs): its first progress lines say so. Then it is stopped, since a
    // watch outliving the run would lose its connection when the run ends.
    let mut watch = command()
        .args([
            "fork",
            "watch",
            &fork,
            "--data",
            path_str(&data),
            "--timeout-s",
            "120",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let lines = lines_of(watch.stderr.take().unwrap());
    let first = lines
        .recv_timeout(LIMIT)
        .expect("`fork watch` shows progress");
    assert!(!first.contains("error"), "{first}");
    still_running(&mut run, "`fork watch` showed progress");
    watch.kill().unwrap();
    watch.wait().unwrap();
    let shown: Vec<String> = std::iter::once(first).chain(lines.try_iter()).collect();
    assert!(
        shown
            .iter()
            .all(|l| !l.contains("error") && !l.contains("does not answer")),
        "{shown:?}"
    );

    for label in ["a", "c", "p"] {
        let out = ok_json(&["fork", "terminate", &fork, label], &data);
        assert_eq!(out["label"], label, "{out}");
    }
    let out = finish(run);
    let ran = json(&out);
    assert_eq!(ran["fork_id"], fork.as_str(), "{ran}");
    assert!(!socket.exists(), "the socket is removed when the run ends");

    // With nobody holding the store, a command opens it itself.
    let view = ok_json(&["fork", "show", &fork], &data);
    assert_eq!(state(&view, "b"), "terminated");
    assert!(!socket.exists());
}

/// A socket file bound and left behind, as by a killed process.
fn stale_socket(path: &Path) {
    drop(std::os::unix::net::UnixListener::bind(path).unwrap());
    assert!(path.exists());
}

#[test]
fn a_stale_socket_is_removed_and_ignored() {
    let ex = Example::quickstart();
    let data = ex.data();
    std::fs::create_dir_all(&data).unwrap();
    let socket = local::socket_path(&data);

    // Nobody holds the store: it opens normally (and the stale file is replaced, then
    // removed when the command ends).
    stale_socket(&socket);
    let list = ok_json(&["fork", "ls"], &data);
    assert_eq!(list, Value::Array(vec![]));
    assert!(!socket.exists(), "{}", socket.display());

    // Another process holds the store but serves no socket: the stale file is removed and
    // the command reports the lock.
    let store = RunStore::open(&data).unwrap();
    stale_socket(&socket);
    let out = forkfleet(&["fork", "ls", "--data", path_str(&data), "--json"]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("locked by another process"), "{err}");
    assert!(!socket.exists(), "the stale socket file is removed");
    drop(store);
}

/// A `run` whose fork another process aborts ends with exit 1 saying so, suggests no merge
/// (it exited 0 and suggested a merge that fails), and leaves no fork directory behind.
#[test]
fn a_run_whose_fork_is_aborted_from_another_process_fails_and_says_so() {
    let ex = Example::quickstart();
    let spec = live_spec(&ex);
    let data = ex.data();
    let mut run = spawn_run(&spec, &data, &[]);
    let socket = local::socket_path(&data);
    wait_for(&mut run, "the socket", || socket.exists().then_some(()));
    let fork = wait_for(&mut run, "the fork, running", || {
        let list = ok_json(&["fork", "ls"], &data);
        let view = list.as_array()?.first()?.clone();
        (state(&view, "a") == "running").then(|| view["fork_id"].as_str().unwrap().to_string())
    });
    let fork_dir = ex.workspace().join(".forkfleet/forks").join(&fork);
    let aborted = forkfleet(&["fork", "abort", &fork, "--data", path_str(&data)]);
    assert!(aborted.status.success(), "{}", stderr(&aborted));
    let out = finish(run);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("was aborted while it ran")
            && stderr(&out).contains("nothing was merged"),
        "{}",
        stderr(&out)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(!text.contains("merge a branch with"), "{text}");
    assert!(!fork_dir.exists(), "the fork directory is left behind");
}
