//! The agent's `run_command` tool end to end: scripted branches on the bus whose commands
//! are real processes in a materialised copy of the branch's tree; the files they touch come
//! back as `file_change` events (blobs stored first) before the tool's result.

use super::common::*;
use forkfleet_shared::blob::BlobHash;
use forkfleet_shared::endpoint::CommandTool;
use forkfleet_shared::event::Event;
use forkfleet_shared::manifest::{Manifest, Node, MODE_EXEC, MODE_SYMLINK};
use forkfleet_shared::overlay::{ChangeOp, Overlay};
use forkfleet_shared::path::WsPath;
use forkfleet_shared::protocol::BranchTask;
use forkfleet_shared::state::BranchState;
use forkfleet_worker::tools::{tool_names, ToolBox, RUN_COMMAND};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

fn tool(timeout_s: f64) -> CommandTool {
    CommandTool {
        timeout_s,
        env: BTreeMap::new(),
        max_output_bytes: 16 * 1024,
        sandbox: Default::default(),
    }
}

/// What a finished branch published.
struct Ran {
    fx: Fixture,
    task: BranchTask,
    base: Arc<Manifest>,
    log: Vec<Event>,
}

impl Ran {
    /// `(ok, output)` of every tool result, in order.
    fn results(&self) -> Vec<(bool, String)> {
        self.log
            .iter()
            .filter_map(|e| match e {
                Event::ToolResult { ok, output, .. } => Some((*ok, output.clone())),
                _ => None,
            })
            .collect()
    }

    /// The file changes published between the `n`th tool call's model response or previous
    /// result and its result: the changes that tool made.
    fn changes_of_result(&self, n: usize) -> Vec<ChangeOp> {
        let mut seen = 0;
        let mut changes = Vec::new();
        for e in &self.log {
            match e {
                Event::FileChange { change } => changes.push(change.clone()),
                Event::ToolResult { .. } => {
                    if seen == n {
                        return changes;
                    }
                    seen += 1;
                    changes.clear();
                }
                Event::ModelResponse { .. } => changes.clear(),
                _ => {}
            }
        }
        panic!("no tool result {n}");
    }

    /// Every change the branch published, replayed over its snapshot.
    fn replica(&self) -> Overlay {
        let changes: Vec<ChangeOp> = self
            .log
            .iter()
            .filter_map(|e| match e {
                Event::FileChange { change } => Some(change.clone()),
                _ => None,
            })
            .collect();
        Overlay::from_log(self.base.clone(), &changes).unwrap()
    }

    /// The text of a file of `ov`, its blob read from the bus's store.
    async fn text(&self, ov: &Overlay, path: &str) -> Option<String> {
        let Node::File(e) = ov.node(&WsPath::parse(path).unwrap()) else {
            return None;
        };
        let bytes = self.fx.bus.blobs().get(&e.hash).await.unwrap()?;
        Some(String::from_utf8(bytes.to_vec()).unwrap())
    }
}

/// Run one branch over `files` playing `script`, with `run_command` set to `command`.
async fn run_branch(files: &[(&str, &str)], script: &str, command: Option<CommandTool>) -> Ran {
    let fx = Fixture::new().await;
    let (base, snap) = fx.snapshot(files);
    let script = fx.script(script);
    let mut task = fx.task("cmd", 0, snap, script);
    task.tools.run_command = command;
    fx.enqueue(&task).await;
    let mut events = fx.events().await;
    let worker = start(&fx, config(2)).await;
    events.until_terminal(&[task.run_id]).await;
    shutdown(worker).await;
    assert_eq!(
        events.terminal(task.run_id),
        Some((BranchState::Done, None)),
        "{:#?}",
        events.of(task.run_id)
    );
    let log = events.of(task.run_id);
    // Every blob a change names is in the bus's store (the coordinator can fetch it).
    for e in &log {
        if let Event::FileChange { change } = e {
            if let Some(entry) = change.written() {
                let stored = fx.bus.blobs().get(&entry.hash).await.unwrap();
                assert!(stored.is_some(), "blob of {} not stored", change.path());
            }
        }
    }
    Ran {
        fx,
        task,
        base,
        log,
    }
}

#[tokio::test]
async fn a_command_writes_edits_deletes_and_chmods_files() {
    let script = r#"
[[turns."*"]]
tool_calls = [{ name = "write_file", args = { path = "from_tool.txt", content = "via the write tool\n" } }]

[[turns."*"]]
tool_calls = [{ name = "run_command", args = { command = ["sh", "-c", "cat from_tool.txt; echo new > new.txt; printf 'status: final\\n' > README.md; rm old.txt; chmod +x run.sh; mkdir -p sub/empty; echo to-stderr >&2"] } }]

[[turns."*"]]
tool_calls = [{ name = "run_command", args = { command = "cat new.txt README.md" } }]

[[turns."*"]]
text = "done"
"#;
    let ran = run_branch(
        &[
            ("README.md", "status: draft\n"),
            ("old.txt", "old\n"),
            ("run.sh", "echo hi\n"),
            ("keep.txt", "untouched\n"),
        ],
        script,
        Some(tool(30.0)),
    )
    .await;

    let results = ran.results();
    assert_eq!(results.len(), 3, "{results:?}");
    let (ok, out) = &results[1];
    assert!(ok, "{out}");
    assert!(out.starts_with("exit code 0\n"), "{out}");
    // It ran on the branch's current tree: the write_file before it is there.
    assert!(out.contains("via the write tool"), "{out}");
    assert!(out.contains("to-stderr"), "{out}");
    assert!(out.contains("created `new.txt`"), "{out}");
    assert!(out.contains("changed `README.md`"), "{out}");
    assert!(out.contains("made executable `run.sh`"), "{out}");
    assert!(out.contains("deleted `old.txt`"), "{out}");
    assert!(out.contains("new empty directories `sub/empty/`"), "{out}");

    // The command's changes, published before its result.
    let changes = ran.changes_of_result(1);
    let summary: Vec<(&str, &str)> = changes
        .iter()
        .map(|c| (c.kind(), c.path().as_str()))
        .collect();
    // Removals first, then new directories, then files in path order.
    assert_eq!(
        summary,
        [
            ("delete", "old.txt"),
            ("mkdir", "sub/empty"),
            ("edit", "README.md"),
            ("write", "new.txt"),
            ("edit", "run.sh"),
        ]
    );
    let run_sh = changes[4].written().unwrap();
    assert_eq!(run_sh.mode, MODE_EXEC);
    assert_eq!(
        run_sh.hash,
        ran.base.files[&WsPath::parse("run.sh").unwrap()].hash,
        "a chmod changes the mode only"
    );
    let kinds: Vec<&str> = ran.log.iter().map(Event::kind).collect();
    let result_at = kinds
        .iter()
        .enumerate()
        .filter(|(_, k)| **k == "tool_result")
        .nth(1)
        .unwrap()
        .0;
    assert_eq!(&kinds[result_at - 5..result_at], ["file_change"; 5]);

    // A second command sees the first one's changes, and changes nothing.
    let (ok, out) = &results[2];
    assert!(ok, "{out}");
    assert!(out.contains("new\nstatus: final\n"), "{out}");
    assert!(out.ends_with("files: no changes\n"), "{out}");
    assert!(ran.changes_of_result(2).is_empty());

    // The branch's workspace, replayed from its events.
    let ov = ran.replica();
    for (path, content) in [
        ("new.txt", "new\n"),
        ("README.md", "status: final\n"),
        ("keep.txt", "untouched\n"),
        ("run.sh", "echo hi\n"),
        ("from_tool.txt", "via the write tool\n"),
    ] {
        assert_eq!(
            ran.text(&ov, path).await.as_deref(),
            Some(content),
            "{path}"
        );
    }
    assert_eq!(ov.node(&WsPath::parse("old.txt").unwrap()), Node::Missing);
    assert_eq!(ov.node(&WsPath::parse("sub/empty").unwrap()), Node::Dir);
    assert_eq!(
        ov.file(&WsPath::parse("run.sh").unwrap()).unwrap().mode,
        MODE_EXEC
    );
    assert_eq!(ran.task.label, "cmd");
}

#[tokio::test]
async fn a_command_that_times_out_is_killed_and_its_files_still_come_back() {
    let script = r#"
[[turns."*"]]
tool_calls = [{ name = "run_command", args = { command = ["sh", "-c", "echo started; echo partial > partial.txt; rm gone.txt; sleep 30; echo never > never.txt"], timeout_s = 600 } }]

[[turns."*"]]
text = "done"
"#;
    let started = std::time::Instant::now();
    let ran = run_branch(&[("gone.txt", "bye\n")], script, Some(tool(1.0))).await;
    assert!(
        started.elapsed() < std::time::Duration::from_secs(20),
        "the sleep was not cut short: {:?}",
        started.elapsed()
    );
    let results = ran.results();
    let (ok, out) = &results[0];
    assert!(!ok, "a timeout is not ok: {out}");
    assert!(out.starts_with("timed out after 1 s"), "{out}");
    assert!(out.contains("over this run's limit; 1 s was used"), "{out}");
    assert!(out.contains("started"), "{out}");
    assert!(out.contains("created `partial.txt`"), "{out}");
    assert!(out.contains("deleted `gone.txt`"), "{out}");
    let summary: Vec<(&str, String)> = ran
        .changes_of_result(0)
        .iter()
        .map(|c| (c.kind(), c.path().to_string()))
        .collect();
    assert_eq!(
        summary,
        [
            ("delete", "gone.txt".to_string()),
            ("write", "partial.txt".to_string())
        ]
    );
    let ov = ran.replica();
    let partial = ov.file(&WsPath::parse("partial.txt").unwrap()).unwrap();
    assert_eq!(
        partial.hash,
        forkfleet_shared::blob::BlobHash::of(b"partial\n")
    );
    assert_eq!(ov.node(&WsPath::parse("never.txt").unwrap()), Node::Missing);
}

#[tokio::test]
async fn the_environment_is_limited_to_the_base_and_the_plan() {
    let script = r#"
[[turns."*"]]
tool_calls = [
  { name = "run_command", args = { command = ["env"] } },
  { name = "run_command", args = { command = '''sh -c 'echo cached > "$HOME/cache" && echo t > "$TMPDIR/t" && echo "$HOME" "$TMPDIR"' ''' } },
]

[[turns."*"]]
text = "done"
"#;
    let mut command = tool(30.0);
    command
        .env
        .insert("PLAN_VAR".to_string(), "from the plan".to_string());
    let ran = run_branch(&[("a.txt", "a\n")], script, Some(command)).await;
    let results = ran.results();
    let (ok, out) = &results[0];
    assert!(ok, "{out}");
    let vars: BTreeMap<&str, &str> = out
        .lines()
        .skip(1)
        .filter_map(|l| l.split_once('='))
        .collect();
    let names: BTreeSet<&str> = vars.keys().copied().collect();
    assert_eq!(
        names,
        BTreeSet::from(["HOME", "LANG", "PATH", "PLAN_VAR", "TMPDIR"]),
        "{out}"
    );
    assert_eq!(vars["PLAN_VAR"], "from the plan");
    assert_eq!(vars["LANG"], "C.UTF-8");
    // Nothing else of the worker's own environment (here: the test process's) leaks in.
    let own: Vec<(String, String)> = std::env::vars()
        .filter(|(k, _)| !names.contains(k.as_str()))
        .collect();
    assert!(!own.is_empty(), "the test process has variables of its own");
    for (k, v) in &own {
        assert!(
            !out.contains(&format!("{k}={v}")),
            "{k} leaked into the command's environment"
        );
    }
    if let Ok(home) = std::env::var("HOME") {
        assert_ne!(vars["HOME"], home, "HOME is not the worker's");
    }

    // HOME and TMPDIR are scratch directories outside the workspace: what is written there
    // is not a change of the branch.
    let (ok, out) = &results[1];
    assert!(ok, "{out}");
    assert!(out.ends_with("files: no changes\n"), "{out}");
    assert!(ran.changes_of_result(1).is_empty());
}

#[tokio::test]
async fn run_command_is_offered_only_when_the_task_enables_it() {
    let fx = Fixture::store_only();
    let (_, snap) = fx.snapshot(&[]);
    let script = fx.script("[[turns.\"*\"]]\ntext = \"x\"\n");
    let mut task = fx.task("t", 0, snap, script);
    let off = ToolBox::for_task(&task);
    assert_eq!(off.names(), tool_names());
    task.tools.run_command = Some(tool(5.0));
    let on = ToolBox::for_task(&task);
    let mut expected = tool_names();
    expected.push(RUN_COMMAND);
    assert_eq!(on.names(), expected);
    let spec = on.specs().iter().find(|s| s.name == RUN_COMMAND).unwrap();
    assert_eq!(spec.parameters["required"], serde_json::json!(["command"]));

    // A model that calls it anyway gets a clear tool error and nothing changes.
    let script = r#"
[[turns."*"]]
tool_calls = [{ name = "run_command", args = { command = ["sh", "-c", "echo x > x.txt"] } }]

[[turns."*"]]
text = "done"
"#;
    let ran = run_branch(&[("a.txt", "a\n")], script, None).await;
    let results = ran.results();
    let (ok, out) = &results[0];
    assert!(!ok);
    assert!(out.contains("`run_command` is not enabled"), "{out}");
    assert!(out.contains("[run_command]"), "{out}");
    assert!(out.contains("read_file, write_file"), "{out}");
    assert!(!ran
        .log
        .iter()
        .any(|e| matches!(e, Event::FileChange { .. })));
}

#[tokio::test]
async fn cwd_must_be_a_directory_inside_the_workspace() {
    let script = r#"
[[turns."*"]]
tool_calls = [
  { name = "run_command", args = { command = ["sh", "-c", "echo x > escaped.txt"], cwd = "../" } },
  { name = "run_command", args = { command = ["sh", "-c", "echo x > escaped.txt"], cwd = "sub/../.." } },
  { name = "run_command", args = { command = ["sh", "-c", "echo x > escaped.txt"], cwd = "/tmp" } },
  { name = "run_command", args = { command = ["sh", "-c", "echo x > escaped.txt"], cwd = "out" } },
  { name = "run_command", args = { command = ["pwd"], cwd = "missing" } },
  { name = "run_command", args = { command = ["pwd"], cwd = "sub/a.txt" } },
  { name = "run_command", args = { command = ["sh", "-c", "pwd; echo here > made.txt"], cwd = "sub" } },
  { name = "run_command", args = { command = ["sh", "-c", "pwd; echo there > made.txt"], cwd = "inner" } },
]

[[turns."*"]]
text = "done"
"#;
    let ran = run_branch(
        &[
            ("sub/a.txt", "a\n"),
            ("out", "->.."),
            ("inner", "->sub/deeper"),
            ("sub/deeper/b.txt", "b\n"),
        ],
        script,
        Some(tool(30.0)),
    )
    .await;
    let results = ran.results();
    assert_eq!(results.len(), 8);
    for (i, want) in [
        "leaves the workspace",
        "leaves the workspace",
        "absolute path",
        "outside the workspace",
        "does not exist",
        "is a file, not a directory",
    ]
    .iter()
    .enumerate()
    {
        let (ok, out) = &results[i];
        assert!(!ok, "call {i}: {out}");
        assert!(out.contains(want), "call {i}: {out}");
        assert!(ran.changes_of_result(i).is_empty());
    }
    let (ok, out) = &results[6];
    assert!(ok, "{out}");
    assert!(out.lines().nth(1).unwrap().ends_with("/sub"), "{out}");
    assert!(out.contains("created `sub/made.txt`"), "{out}");
    // A symlinked directory inside the workspace is followed in the overlay.
    let (ok, out) = &results[7];
    assert!(ok, "{out}");
    assert!(
        out.lines().nth(1).unwrap().ends_with("/sub/deeper"),
        "{out}"
    );
    assert!(out.contains("created `sub/deeper/made.txt`"), "{out}");
}

#[tokio::test]
async fn outcomes_output_limits_and_symlinks() {
    let script = r#"
[[turns."*"]]
tool_calls = [
  { name = "run_command", args = { command = ["sh", "-c", "echo failing; exit 3"] } },
  { name = "run_command", args = { command = ["definitely-not-a-program-xyz"] } },
  { name = "run_command", args = { command = "" } },
  { name = "run_command", args = { command = "sh -c 'unterminated" } },
  { name = "run_command", args = { command = ["sh", "-c", "i=0; while [ $i -lt 200 ]; do echo line-$i-xxxxxxxxxxxxxxxxxxxx; i=$((i+1)); done"] } },
  { name = "run_command", args = { command = ["sh", "-c", "ln -s /etc/passwd evil; ln -s a.txt good; ln -sf ../.. a-link"] } },
  { name = "run_command", args = { command = ["sh", "-c", "kill -9 $$"] } },
  { name = "run_command", args = { command = ["true"], timeout_s = -1 } },
]

[[turns."*"]]
text = "done"
"#;
    let mut command = tool(30.0);
    command.max_output_bytes = 256;
    let ran = run_branch(
        &[("a.txt", "a\n"), ("a-link", "->a.txt")],
        script,
        Some(command),
    )
    .await;
    let results = ran.results();
    assert_eq!(results.len(), 8);

    let (ok, out) = &results[0];
    assert!(!ok, "a non-zero exit is not ok");
    assert!(out.starts_with("exit code 3\nfailing\n"), "{out}");

    let (ok, out) = &results[1];
    assert!(!ok);
    assert!(out.starts_with("could not start: "), "{out}");
    assert!(out.contains("definitely-not-a-program-xyz"), "{out}");

    let (ok, out) = &results[2];
    assert!(!ok);
    assert!(out.contains("`command` is empty"), "{out}");
    let (ok, out) = &results[3];
    assert!(!ok);
    assert!(out.contains("unterminated single quote"), "{out}");

    // 200 lines, cut to 256 bytes in the middle.
    let (ok, out) = &results[4];
    assert!(ok, "{out}");
    assert!(out.contains("line-0-"), "{out}");
    assert!(out.contains("line-199-"), "{out}");
    assert!(!out.contains("line-100-"), "{out}");
    let total: usize = (0..200)
        .map(|i| format!("line-{i}-xxxxxxxxxxxxxxxxxxxx\n").len())
        .sum();
    let dropped = total - 256;
    assert!(
        out.contains(&format!("[... {dropped} bytes of output left out ...]")),
        "{out}"
    );

    // A symlink to outside the workspace is not taken back (nor one replacing a file).
    let (ok, out) = &results[5];
    assert!(ok, "{out}");
    assert!(out.contains("created `good`"), "{out}");
    assert!(
        out.contains("not taken back (left as they were): `a-link` (a symlink to `../..`, outside the workspace), `evil` (a symlink to `/etc/passwd`, outside the workspace)"),
        "{out}"
    );
    let changes = ran.changes_of_result(5);
    assert_eq!(changes.len(), 1, "{changes:?}");
    let good = changes[0].written().unwrap();
    assert_eq!(good.mode, MODE_SYMLINK);
    assert_eq!(good.hash, forkfleet_shared::blob::BlobHash::of(b"a.txt"));

    let (ok, out) = &results[6];
    assert!(!ok);
    assert!(out.starts_with("killed by signal 9"), "{out}");

    let (ok, out) = &results[7];
    assert!(!ok);
    assert!(out.contains("timeout_s is -1"), "{out}");
}

/// What a call costs on a bigger tree (ignored by default; run with
/// `cargo test -p forkfleet-worker --release --test all -- --ignored --nocapture run_command_cost`):
/// every call materialises the whole tree and compares it back (reading only the files
/// whose stat changed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore]
async fn run_command_cost_on_5000_files() {
    use forkfleet_shared::event::ToolCall;
    use forkfleet_worker::cache::BlobCache;
    let _ = tracing_subscriber::fmt()
        .with_env_filter("forkfleet_worker::tools=debug,forkfleet_worker::runner=debug")
        .with_test_writer()
        .try_init();
    let fx = Fixture::store_only();
    let files: Vec<(String, String)> = (0..5000)
        .map(|i| {
            (
                format!("d{}/f{i}.txt", i % 50),
                format!("{i} {}\n", "x".repeat(2000)),
            )
        })
        .collect();
    let refs: Vec<(&str, &str)> = files
        .iter()
        .map(|(p, c)| (p.as_str(), c.as_str()))
        .collect();
    let (base, _) = fx.snapshot(&refs);
    let cache = BlobCache::new(Arc::new(fx.store.clone()), 1 << 30);
    let mut ov = Overlay::new(base);
    let tools = ToolBox::with_command(Some(tool(60.0)));
    for (i, command) in ["true", "touch d0/new.txt", "true", "true"]
        .iter()
        .enumerate()
    {
        let call = ToolCall {
            id: format!("c{i}"),
            name: RUN_COMMAND.into(),
            args: serde_json::json!({ "command": command }),
        };
        let started = std::time::Instant::now();
        let out = tools.run(&call, &mut ov, &cache).await.unwrap();
        assert!(out.ok, "{}", out.output);
        println!(
            "`{command}` on 5,000 files (10 MB): {:?}",
            started.elapsed()
        );
    }
    assert_eq!(ov.changes().len(), 1);
}

/// Calls of one branch: `(tool, args)`.
const KEPT_TREE_CALLS: &[(&str, &str)] = &[
    (
        "run_command",
        r#"{"command": ["sh", "-c", "echo A > a.txt; rm b.txt; mv d/c.txt d/moved.txt; chmod +x run.sh; mkdir -p e/f; ln -s a.txt link; echo new > n.txt"]}"#,
    ),
    (
        "write_file",
        r#"{"path": "n.txt", "content": "from the write tool\n"}"#,
    ),
    (
        "run_command",
        r#"{"command": ["sh", "-c", "cat n.txt > copy.txt; rm -r gone; chmod -x run.sh; echo AA >> a.txt; ln -s ../../etc/passwd out; touch -d 2000-01-01 keep.txt"]}"#,
    ),
    (
        "run_command",
        r#"{"command": ["sh", "-c", "mv d e/d2; rm link; printf x > a.txt; truncate -s 70M big; mkfifo fifo"]}"#,
    ),
    (
        "run_command",
        r#"{"command": ["sh", "-c", "ls -R; rm -f big fifo; echo after > after.txt; printf y > a.txt"]}"#,
    ),
    ("delete_file", r#"{"path": "after.txt"}"#),
    (
        "run_command",
        r#"{"command": ["sh", "-c", "ls -R; test ! -e after.txt && cat a.txt copy.txt"]}"#,
    ),
    // Between calls: a file of the snapshot deleted, a directory a command removed made
    // again (a layered tree: a whiteout, then an opaque directory in its place).
    ("delete_file", r#"{"path": "src/lib.rs"}"#),
    (
        "write_file",
        r#"{"path": "gone/y.txt", "content": "back\n"}"#,
    ),
    (
        "run_command",
        r#"{"command": ["sh", "-c", "ls -R ..; cat ../gone/*; test ! -e lib.rs && echo none > lib.rs"], "cwd": "src"}"#,
    ),
    (
        "run_command",
        r#"{"command": ["sh", "-c", "rm -r gone src; mkdir gone; echo z > gone/x.txt; ls -R"]}"#,
    ),
];

/// The workspace [`KEPT_TREE_CALLS`] are played on.
const KEPT_TREE_FILES: &[(&str, &str)] = &[
    ("a.txt", "a\n"),
    ("b.txt", "b\n"),
    ("d/c.txt", "c\n"),
    ("run.sh", "echo hi\n"),
    ("gone/x.txt", "x\n"),
    ("keep.txt", "untouched\n"),
    ("src/lib.rs", "pub fn f() {}\n"),
];

/// Play [`KEPT_TREE_CALLS`] with `tools`: every result, and the change log at the end.
async fn play_kept_tree_calls(
    tools: &ToolBox,
    base: Arc<Manifest>,
    cache: &forkfleet_worker::cache::BlobCache,
) -> (Vec<(bool, String)>, Vec<ChangeOp>) {
    use forkfleet_shared::event::ToolCall;
    let mut ov = Overlay::new(base);
    let mut results = Vec::new();
    for (i, (name, args)) in KEPT_TREE_CALLS.iter().enumerate() {
        let call = ToolCall {
            id: format!("c{i}"),
            name: name.to_string(),
            args: serde_json::from_str(args).unwrap(),
        };
        let out = tools.run(&call, &mut ov, cache).await.unwrap();
        results.push((out.ok, out.output));
    }
    (results, ov.changes().to_vec())
}

/// A branch's tree is kept between its `run_command` calls and brought up to date, and the
/// calls yield exactly what a fresh copy per call (the runner before kept trees, kept here
/// as the reference) yields: the same results and the same change log, through edits,
/// deletes, renames, chmods, symlinks (one leaving the tree), a new file over the import
/// limit, a fifo, and changes made by other tools between calls.
#[tokio::test]
async fn a_kept_tree_yields_the_same_changes_as_a_fresh_copy_per_call() {
    let trees = forkfleet_worker::runner::Trees::new(1 << 30).whole_trees();
    kept_tree_matches_a_fresh_copy(trees).await;
}

/// The same with a layered tree (an overlay of the branch's changes over the fork's base,
/// mounted in a user namespace per command), which this kernel allows.
#[tokio::test]
async fn a_layered_tree_yields_the_same_changes_as_a_fresh_copy_per_call() {
    let trees = forkfleet_worker::runner::Trees::new(1 << 30);
    assert!(
        trees.layered(),
        "overlayfs in a user namespace is not available here (see the worker's log line `command trees:`)"
    );
    kept_tree_matches_a_fresh_copy(trees).await;
}

async fn kept_tree_matches_a_fresh_copy(trees: forkfleet_worker::runner::Trees) {
    use forkfleet_worker::cache::BlobCache;
    use forkfleet_worker::runner::TreeKey;
    use forkfleet_worker::tools::TreeSlot;
    use std::os::unix::fs::MetadataExt;
    let layered = trees.layered();
    let fx = Fixture::store_only();
    let (base, snapshot) = fx.snapshot(KEPT_TREE_FILES);
    let cache = BlobCache::new(Arc::new(fx.store.clone()), 1 << 30);
    let fresh = ToolBox::with_command(Some(tool(30.0)));
    let (want, want_log) = play_kept_tree_calls(&fresh, base.clone(), &cache).await;

    let trees = Arc::new(trees);
    let key = TreeKey {
        fork: forkfleet_shared::ids::ForkId::new(),
        label: "a".into(),
    };
    let kept = ToolBox::with_command(Some(tool(30.0))).with_trees(TreeSlot {
        trees: trees.clone(),
        key,
        snapshot,
    });
    let (got, got_log) = play_kept_tree_calls(&kept, base.clone(), &cache).await;
    assert_eq!(got, want);
    assert_eq!(got_log, want_log);
    // The reference is what the calls should do (so the comparison is not of two no-ops).
    assert!(want[3].1.contains("not taken back"), "{}", want[3].1);
    assert!(
        want[3].1.contains("`big`") && want[3].1.contains("`fifo`"),
        "{}",
        want[3].1
    );
    // What was not taken back is not in the next call's tree.
    assert!(
        !want[4].1.contains("big") && !want[4].1.contains("fifo"),
        "{}",
        want[4].1
    );
    assert!(
        want[6].0 && want[6].1.contains("yfrom the write tool\n"),
        "{}",
        want[6].1
    );
    assert!(
        want[2].1.contains("`out` (a symlink to `../../etc/passwd`"),
        "{}",
        want[2].1
    );

    // The tree is one directory, kept between calls (a layered one beside the fork's
    // base): a file is not written again by a call that changes nothing.
    let tree_dirs = || -> Vec<std::path::PathBuf> {
        let mut dirs: Vec<_> = std::fs::read_dir(trees.dir().unwrap())
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.is_dir())
            .collect();
        dirs.sort();
        dirs
    };
    assert_eq!(trees.held().0, 1);
    let dirs = tree_dirs();
    let names: Vec<String> = dirs
        .iter()
        .map(|d| d.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    if layered {
        assert_eq!(dirs.len(), 2, "{dirs:?}");
        assert!(names[0].starts_with("base-"), "{names:?}");
        // The upper directory holds only what the branch changed since the tree was made
        // (after the call that left a fifo, which was not kept): `a.txt`, a whiteout for
        // the removed `src/`, `gone/` made again; not `keep.txt`, which no call changed
        // since.
        use std::os::unix::fs::FileTypeExt;
        let upper = dirs[1].join("upper");
        assert_eq!(std::fs::read_to_string(upper.join("a.txt")).unwrap(), "y");
        let src = std::fs::symlink_metadata(upper.join("src")).unwrap();
        assert!(src.file_type().is_char_device() && src.rdev() == 0);
        assert_eq!(
            std::fs::read_to_string(upper.join("gone/x.txt")).unwrap(),
            "z\n"
        );
        assert!(!upper.join("keep.txt").exists());
        // The base is never written: it holds the snapshot's files as they were.
        assert_eq!(
            std::fs::read_to_string(dirs[0].join("ws/a.txt")).unwrap(),
            "a\n"
        );
        assert!(dirs[0].join("ws/b.txt").exists() && dirs[0].join("ws/gone/x.txt").exists());
    } else {
        assert_eq!(dirs.len(), 1, "{dirs:?}");
    }
    let in_tree = if layered {
        "upper/a.txt"
    } else {
        "ws/keep.txt"
    };
    let inode = |dirs: &[std::path::PathBuf]| {
        std::fs::metadata(dirs[dirs.len() - 1].join(in_tree))
            .unwrap()
            .ino()
    };
    let before = inode(&dirs);
    let call = forkfleet_shared::event::ToolCall {
        id: "again".into(),
        name: RUN_COMMAND.into(),
        args: serde_json::json!({ "command": "true" }),
    };
    let mut ov = Overlay::new(base);
    for op in &got_log {
        ov.apply(op.clone()).unwrap();
    }
    let out = kept.run(&call, &mut ov, &cache).await.unwrap();
    assert!(
        out.ok && out.output.ends_with("files: no changes\n"),
        "{}",
        out.output
    );
    assert_eq!(tree_dirs(), dirs);
    assert_eq!(inode(&tree_dirs()), before, "not written again");

    // Dropping the trees (the worker stops) removes their directory.
    let dir = trees.dir().unwrap().to_path_buf();
    drop(kept);
    drop(trees);
    tokio::time::timeout(std::time::Duration::from_secs(30), async {
        while dir.exists() {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the trees' directory is removed");
}

/// Two branches of one fork on one worker share the fork's base (materialised once), see
/// only their own changes, and cannot write into the base (the sandbox grants the mounted
/// tree, not the directories under it).
#[tokio::test]
async fn branches_of_a_fork_share_one_base_and_see_only_their_own_changes() {
    use forkfleet_worker::cache::BlobCache;
    use forkfleet_worker::runner::{TreeKey, Trees};
    use forkfleet_worker::tools::TreeSlot;
    let trees = Arc::new(Trees::new(1 << 30));
    assert!(trees.layered());
    let fx = Fixture::store_only();
    let (base, snapshot) = fx.snapshot(&[("a.txt", "a\n"), ("lib/b.txt", "b\n")]);
    let cache = BlobCache::new(Arc::new(fx.store.clone()), 1 << 30);
    let fork = forkfleet_shared::ids::ForkId::new();
    let branch = |label: &str| {
        ToolBox::with_command(Some(tool(30.0))).with_trees(TreeSlot {
            trees: trees.clone(),
            key: TreeKey {
                fork,
                label: label.into(),
            },
            snapshot,
        })
    };
    let (one, two) = (branch("one"), branch("two"));
    let (mut ov1, mut ov2) = (Overlay::new(base.clone()), Overlay::new(base.clone()));
    let out = one
        .run(&sh_call("echo one > a.txt; rm lib/b.txt"), &mut ov1, &cache)
        .await
        .unwrap();
    assert!(out.ok, "{}", out.output);
    let out = two
        .run(&sh_call("cat a.txt; ls lib"), &mut ov2, &cache)
        .await
        .unwrap();
    assert!(out.ok && out.output.contains("a\nb.txt"), "{}", out.output);
    assert_eq!(ov1.changes().len(), 2);
    assert!(ov2.changes().is_empty());

    let dirs: Vec<_> = std::fs::read_dir(trees.dir().unwrap())
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_dir())
        .collect();
    let bases: Vec<_> = dirs
        .iter()
        .filter(|d| {
            d.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("base-")
        })
        .collect();
    assert_eq!((dirs.len(), bases.len()), (3, 1), "{dirs:?}");
    let in_base = bases[0].join("ws/a.txt");
    let out = one
        .run(
            &sh_call(&format!("echo x > {}", in_base.display())),
            &mut ov1,
            &cache,
        )
        .await
        .unwrap();
    assert!(!out.ok, "{}", out.output);
    assert_eq!(std::fs::read_to_string(&in_base).unwrap(), "a\n");
    let out = two
        .run(&sh_call("cat a.txt"), &mut ov2, &cache)
        .await
        .unwrap();
    assert!(out.ok && out.output.contains("a\n"), "{}", out.output);
}

/// A blob store that also keeps every blob as a file, as the run store keeps its larger
/// ones for an embedded worker ([`BlobStore::local_file`]).
#[derive(Clone)]
struct FileBlobs {
    mem: forkfleet_shared::blob::MemBlobStore,
    dir: Arc<tempfile::TempDir>,
    /// Where workers may keep the trees they link (as the run store's `kept-trees/`).
    kept: Option<std::path::PathBuf>,
}

impl FileBlobs {
    fn of(mem: forkfleet_shared::blob::MemBlobStore, tree: &Manifest) -> Self {
        let dir = Arc::new(tempfile::tempdir().unwrap());
        let this = Self {
            mem,
            dir,
            kept: None,
        };
        this.add(tree);
        this
    }

    /// The same store, keeping linked trees in a directory beside its files.
    fn keeping_trees(mut self) -> Self {
        self.kept = Some(self.dir.path().join("kept-trees"));
        self
    }

    /// Store `tree`'s files as files too.
    fn add(&self, tree: &Manifest) {
        for entry in tree.files.values() {
            let bytes = self.mem.get_now(&entry.hash).unwrap();
            std::fs::write(self.path(&entry.hash), &bytes).unwrap();
            // As the run store writes its blob files.
            std::fs::set_permissions(
                self.path(&entry.hash),
                std::os::unix::fs::PermissionsExt::from_mode(0o644),
            )
            .unwrap();
        }
    }

    fn path(&self, hash: &forkfleet_shared::blob::BlobHash) -> std::path::PathBuf {
        self.dir.path().join(hash.to_hex())
    }

    /// Every file still holds the bytes it is named for.
    fn assert_intact(&self) {
        for e in std::fs::read_dir(self.dir.path())
            .unwrap()
            .flatten()
            .filter(|e| e.file_type().unwrap().is_file())
        {
            let bytes = std::fs::read(e.path()).unwrap();
            assert_eq!(
                forkfleet_shared::blob::BlobHash::of(&bytes).to_hex(),
                e.file_name().to_string_lossy(),
                "the store's file was written through a link"
            );
        }
    }
}

#[async_trait::async_trait]
impl forkfleet_shared::blob::BlobStore for FileBlobs {
    async fn put(
        &self,
        hash: forkfleet_shared::blob::BlobHash,
        bytes: bytes::Bytes,
    ) -> Result<(), forkfleet_shared::blob::BlobError> {
        self.mem.put(hash, bytes).await
    }
    async fn get(
        &self,
        hash: &forkfleet_shared::blob::BlobHash,
    ) -> Result<Option<bytes::Bytes>, forkfleet_shared::blob::BlobError> {
        self.mem.get(hash).await
    }
    async fn missing(
        &self,
        hashes: &[forkfleet_shared::blob::BlobHash],
    ) -> Result<Vec<forkfleet_shared::blob::BlobHash>, forkfleet_shared::blob::BlobError> {
        self.mem.missing(hashes).await
    }
    fn local_file(&self, hash: &forkfleet_shared::blob::BlobHash) -> Option<std::path::PathBuf> {
        Some(self.path(hash)).filter(|p| p.exists())
    }
    fn kept_trees_dir(&self) -> Option<std::path::PathBuf> {
        self.kept.clone()
    }
}

/// The fixture of the linked-base tests: a store that also keeps `KEPT_TREE_FILES`'s blobs
/// as files (as the run store does), for commands confined by Landlock (which a linked
/// base is only for: the test refuses to run without it).
fn linked_store() -> (Fixture, Arc<Manifest>, BlobHash, FileBlobs) {
    assert!(
        forkfleet_worker::runner::sandbox::confines(&tool(30.0).sandbox),
        "Landlock is not available here (see the worker's log line `sandbox:`)"
    );
    let fx = Fixture::store_only();
    let (base, snapshot) = fx.snapshot(KEPT_TREE_FILES);
    let store = FileBlobs::of(fx.store.clone(), &base);
    (fx, base, snapshot, store)
}

/// A `run_command` call of `sh -c command`.
fn sh_call(command: &str) -> forkfleet_shared::event::ToolCall {
    forkfleet_shared::event::ToolCall {
        id: "c".into(),
        name: RUN_COMMAND.into(),
        args: serde_json::json!({ "command": ["sh", "-c", command] }),
    }
}

/// A shell command saying which kind of tree it runs in: a layered tree's directory has the
/// overlay's `upper` beside the mounted `ws`, a whole tree's has not.
const KIND: &str = "test -d ../upper && echo 'tree: layered' || echo 'tree: whole'";

/// Where the blob store keeps blobs as files on this machine (an embedded worker over the
/// run store) and commands are confined, the fork's base hard-links them instead of
/// writing the workspace again (ADR 31). The branch's calls yield exactly what a fresh copy
/// per call yields; nothing a command does, through the tree or by the base's own path,
/// writes into the store; and a command that is not confined gets no linked base.
#[tokio::test]
async fn a_base_for_confined_commands_links_the_stores_files_and_never_writes_them() {
    use forkfleet_worker::cache::BlobCache;
    use forkfleet_worker::runner::{TreeKey, Trees};
    use forkfleet_worker::tools::TreeSlot;
    use std::os::unix::fs::MetadataExt;
    let (_fx, base, snapshot, store) = linked_store();
    let cache = BlobCache::new(Arc::new(store.clone()), 1 << 30);
    let fresh = ToolBox::with_command(Some(tool(30.0)));
    let (want, want_log) = play_kept_tree_calls(&fresh, base.clone(), &cache).await;

    let trees = Arc::new(Trees::new(1 << 30));
    assert!(trees.layered());
    let fork = forkfleet_shared::ids::ForkId::new();
    let branch = |label: &str, tool: CommandTool| {
        ToolBox::with_command(Some(tool)).with_trees(TreeSlot {
            trees: trees.clone(),
            key: TreeKey {
                fork,
                label: label.into(),
            },
            snapshot,
        })
    };
    let kept = branch("a", tool(30.0));
    let (got, got_log) = play_kept_tree_calls(&kept, base.clone(), &cache).await;
    assert_eq!(got, want);
    assert_eq!(got_log, want_log);
    // The calls edited, removed, renamed and chmodded files of the base.
    assert!(want_log.len() >= 5, "{want_log:?}");
    store.assert_intact();

    let base_dir = std::fs::read_dir(trees.dir().unwrap())
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("base-")
        })
        .unwrap()
        .join("ws");
    let in_base = base_dir.join("keep.txt");
    let linked = std::fs::metadata(&in_base).unwrap();
    let stored =
        std::fs::metadata(store.path(&base.files[&WsPath::parse("keep.txt").unwrap()].hash))
            .unwrap();
    assert_eq!(linked.ino(), stored.ino(), "the base's file is the store's");
    assert_eq!(linked.mode() & 0o7777, 0o644);

    // By the base's own path: refused (the sandbox grants the mounted tree only).
    let mut ov = Overlay::new(base.clone());
    for op in &got_log {
        ov.apply(op.clone()).unwrap();
    }
    let out = kept
        .run(
            &sh_call(&format!("echo x >> {0}; chmod 600 {0}", in_base.display())),
            &mut ov,
            &cache,
        )
        .await
        .unwrap();
    assert!(!out.ok, "{}", out.output);
    let after = std::fs::metadata(&in_base).unwrap();
    assert_eq!(
        (after.mode() & 0o7777, after.mtime()),
        (0o644, linked.mtime()),
        "chmod (which Landlock does not govern) reached the base"
    );
    // Through the tree: copied up, the base untouched.
    let out = kept
        .run(
            &sh_call(&format!("echo more >> keep.txt; chmod +x keep.txt; {KIND}")),
            &mut ov,
            &cache,
        )
        .await
        .unwrap();
    assert!(
        out.ok && out.output.contains("tree: layered"),
        "{}",
        out.output
    );
    let Node::File(e) = ov.node(&WsPath::parse("keep.txt").unwrap()) else {
        panic!("keep.txt is not a file of the branch");
    };
    assert_eq!(&cache.get(&e.hash).await.unwrap()[..], b"untouched\nmore\n");
    assert_eq!(e.mode, MODE_EXEC);
    store.assert_intact();
    assert_eq!(std::fs::read_to_string(&in_base).unwrap(), "untouched\n");

    // A command of the fork that is not confined is not given the linked base: its tree is
    // whole, its own files.
    let mut off = tool(30.0);
    off.sandbox.mode = forkfleet_shared::endpoint::SandboxMode::Off;
    let loose = branch("b", off.clone());
    let mut ov = Overlay::new(base.clone());
    let out = loose
        .run(
            &sh_call(&format!("echo y >> keep.txt; {KIND}")),
            &mut ov,
            &cache,
        )
        .await
        .unwrap();
    assert!(
        out.ok && out.output.contains("tree: whole"),
        "{}",
        out.output
    );
    store.assert_intact();
    assert_eq!(std::fs::metadata(&in_base).unwrap().nlink(), 2);
    // Nor is the branch's kept tree over it, should the same branch's command not be.
    let mut ov = Overlay::new(base.clone());
    for op in &got_log {
        ov.apply(op.clone()).unwrap();
    }
    let out = branch("a", off)
        .run(
            &sh_call(&format!("echo z >> keep.txt; cat keep.txt; {KIND}")),
            &mut ov,
            &cache,
        )
        .await
        .unwrap();
    assert!(
        out.ok && out.output.contains("untouched\nz\n") && out.output.contains("tree: whole"),
        "{}",
        out.output
    );
    store.assert_intact();
}

/// Where the blob store keeps linked trees (the run store's `kept-trees/`), a fork's linked
/// base is made there once, named by its manifest's hash, and the next process (a new
/// `Trees`) forking the same snapshot uses it as it is (ADR 32). Beyond `KEPT_BASES`, making
/// one removes the least recently used ones, never one in use.
#[tokio::test]
async fn a_linked_base_is_kept_beside_the_store_for_the_next_process() {
    use forkfleet_worker::cache::BlobCache;
    use forkfleet_worker::runner::layered::KEPT_BASES;
    use forkfleet_worker::runner::{TreeKey, Trees};
    use forkfleet_worker::tools::TreeSlot;
    use std::os::unix::fs::MetadataExt;
    let (fx, base, _, store) = linked_store();
    let store = store.keeping_trees();
    let kept_dir = store.kept.clone().unwrap();
    let cache = BlobCache::new(Arc::new(store.clone()), 1 << 30);
    let hash_of = |m: &Manifest| BlobHash::of(&m.to_blob().unwrap());
    let name_of = |m: &Manifest| hash_of(m).to_hex();
    let run_in = |trees: &Arc<Trees>, m: &Arc<Manifest>| {
        let (trees, m, cache) = (trees.clone(), m.clone(), &cache);
        let box_ = ToolBox::with_command(Some(tool(30.0))).with_trees(TreeSlot {
            trees,
            key: TreeKey {
                fork: forkfleet_shared::ids::ForkId::new(),
                label: "a".into(),
            },
            snapshot: hash_of(&m),
        });
        async move {
            let mut ov = Overlay::new(m);
            let out = box_
                .run(&sh_call(&format!("cat keep.txt; {KIND}")), &mut ov, cache)
                .await
                .unwrap();
            assert!(
                out.ok && out.output.contains("untouched") && out.output.contains("tree: layered"),
                "{}",
                out.output
            );
        }
    };
    let kept_names = || {
        let mut names: Vec<String> = std::fs::read_dir(&kept_dir)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            // Evicted ones are renamed away at once, removed after.
            .filter(|n| !n.starts_with('.'))
            .collect();
        names.sort();
        names
    };

    // One process: the base is made in the store's directory, of the store's files.
    let first = Arc::new(Trees::new(1 << 30));
    run_in(&first, &base).await;
    let at = kept_dir.join(name_of(&base));
    let in_base = at.join("ws").join("keep.txt");
    let stored =
        std::fs::metadata(store.path(&base.files[&WsPath::parse("keep.txt").unwrap()].hash))
            .unwrap();
    assert_eq!(std::fs::metadata(&in_base).unwrap().ino(), stored.ino());
    let made_ino = std::fs::metadata(at.join("ws")).unwrap().ino();
    drop(first);
    assert!(in_base.exists(), "the kept base went with its process");
    assert_eq!(kept_names(), vec![name_of(&base)]);

    // The next: the same base, not made again.
    let next = Arc::new(Trees::new(1 << 30));
    run_in(&next, &base).await;
    assert_eq!(std::fs::metadata(at.join("ws")).unwrap().ino(), made_ino);
    assert_eq!(
        std::fs::metadata(&in_base).unwrap().nlink(),
        2,
        "linked once"
    );
    assert_eq!(kept_names(), vec![name_of(&base)]);
    store.assert_intact();

    // Older ones beyond the bound go, least recently used first; the one `next` holds (its
    // branch's tree is kept over it) stays though it is the oldest of all.
    let age = |path: &std::path::Path, secs: u64| {
        let t = std::time::UNIX_EPOCH + std::time::Duration::from_secs(secs);
        std::fs::File::open(path)
            .unwrap()
            .set_times(std::fs::FileTimes::new().set_modified(t))
            .unwrap();
    };
    let old: Vec<String> = (0..KEPT_BASES).map(|i| format!("old{i}")).collect();
    for (i, name) in old.iter().enumerate() {
        let dir = kept_dir.join(name);
        std::fs::create_dir_all(dir.join("ws")).unwrap();
        age(&dir, 1_000 + i as u64);
    }
    age(&at, 1);
    let mut other = (*base).clone();
    let extra = forkfleet_shared::blob::BlobHash::of(b"another snapshot\n");
    forkfleet_shared::blob::BlobStore::put(
        &fx.store,
        extra,
        bytes::Bytes::from_static(b"another snapshot\n"),
    )
    .await
    .unwrap();
    other.insert_file(
        WsPath::parse("extra.txt").unwrap(),
        forkfleet_shared::manifest::FileEntry::for_bytes(b"another snapshot\n", 0o644),
    );
    assert_eq!(
        other.files[&WsPath::parse("extra.txt").unwrap()].hash,
        extra
    );
    store.add(&other);
    let other = Arc::new(other);
    run_in(&next, &other).await;
    let mut want = vec![name_of(&base), name_of(&other)];
    want.extend(old.iter().skip(2).cloned());
    want.sort();
    assert_eq!(kept_names(), want);
    assert!(in_base.exists());
    store.assert_intact();
}
