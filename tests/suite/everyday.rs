//! Everyday use (issue 21): each branch's answer where people look (`run`, `fork show`,
//! `fork show FORK LABEL`), runs named by prefix or `FORK/LABEL`, and branches followed live
//! (`log --follow`, `fork watch --events`) on both buses.

use super::fleet::{Fleet, Options, COMMAND_LIMIT};
use super::harness::{
    branch, forkfleet, json, path_str, run_spec, stderr, writes_then_done, Example,
};
use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::process::Stdio;
use std::time::Instant;

#[test]
fn each_branch_answer_shows_and_runs_are_named_by_prefix_or_fork_and_label() {
    let ex = Example::quickstart();
    let data = path_str(&ex.data()).to_string();
    let out = forkfleet(&["run", path_str(&ex.spec())]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("answers:") && text.contains("Done (concise): one-line usage"),
        "{text}"
    );
    let doc = json(&run_spec(&ex.spec()));
    let fork = doc["fork_id"].as_str().unwrap().to_string();
    assert_eq!(
        branch(&doc, "tidy")["last_message_preview"],
        "Done (tidy): to-dos closed, stale docs removed."
    );

    // One branch, whole: its steer, final answer and changes.
    let short = &fork[..18];
    let one = json(&forkfleet(&[
        "fork", "show", short, "concise", "--json", "--data", &data,
    ]));
    assert_eq!(one["label"], "concise");
    assert_eq!(
        one["steers"][0],
        "Keep it short: a one-line usage note, a friendlier greeting, drop stale docs."
    );
    assert!(one["answer"]
        .as_str()
        .unwrap()
        .starts_with("Done (concise)"));
    let paths: Vec<&str> = one["changes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["path"].as_str().unwrap())
        .collect();
    assert!(paths.contains(&"docs/legacy.md"), "{one}");
    let text = forkfleet(&["fork", "show", short, "concise", "--data", &data]);
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains("final answer:\nDone (concise)"), "{text}");
    let bad = forkfleet(&["fork", "show", short, "nope", "--data", &data]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(stderr(&bad).contains("its branches: concise, thorough, tidy"));

    // `log` takes FORK/LABEL and a run id's prefix, like every other command.
    let by_label = json(&forkfleet(&[
        "log",
        &format!("{short}/tidy"),
        "--json",
        "--data",
        &data,
    ]));
    let run = branch(&doc, "tidy")["id"].as_str().unwrap().to_string();
    let by_prefix = json(&forkfleet(&["log", &run[..32], "--json", "--data", &data]));
    assert_eq!(by_label, by_prefix);
    assert!(by_label.as_array().unwrap().len() > 5);
    // So do `runs` and `checkpoint` (they took ids only).
    let tidy = format!("{short}/tidy");
    let shown = json(&forkfleet(&[
        "runs", "show", &tidy, "--json", "--data", &data,
    ]));
    assert_eq!(shown["run"]["run_id"], run.as_str(), "{shown}");
    // Its lineage names the workspace it starts from (Pixir's `workspaces`).
    assert_eq!(
        shown["run"]["lineage"]["workspaces"],
        serde_json::json!([shown["run"]["workspace"]]),
        "{shown}"
    );
    let listed = forkfleet(&["checkpoint", "ls", &tidy, "--json", "--data", &data]);
    assert!(listed.status.success(), "{}", stderr(&listed));
    let tree = forkfleet(&["runs", "tree", &tidy, "--data", &data]);
    assert!(tree.status.success(), "{}", stderr(&tree));
    let child = json(&forkfleet(&[
        "runs",
        "fork",
        &tidy,
        "--dry-run",
        "--json",
        "--data",
        &data,
    ]));
    assert_eq!(child["parent_run"], run.as_str(), "{child}");
    let wrong = forkfleet(&["runs", "show", &format!("{short}/nope"), "--data", &data]);
    assert_eq!(wrong.status.code(), Some(2));
    assert!(
        stderr(&wrong).contains("its branches: concise, thorough, tidy"),
        "{}",
        stderr(&wrong)
    );
    // The random tail of an id finds it too: the runs of one fork share their first 26
    // characters (UUID v7 made in the same millisecond).
    let tail = &run[run.len() - 8..];
    for given in [tail.to_string(), format!("…{tail}")] {
        let by_tail = json(&forkfleet(&[
            "runs", "show", &given, "--json", "--data", &data,
        ]));
        assert_eq!(by_tail["run"]["run_id"], run.as_str(), "{by_tail}");
    }
    let fork_tail = &fork[fork.len() - 8..];
    let shown = json(&forkfleet(&[
        "fork", "show", fork_tail, "--json", "--data", &data,
    ]));
    assert_eq!(shown["fork_id"], fork.as_str());
    // An id that matches nothing says how runs are named.
    let unknown = forkfleet(&["runs", "show", "0000000", "--data", &data]);
    assert_eq!(unknown.status.code(), Some(2));
    assert!(
        stderr(&unknown).contains("FORK/LABEL"),
        "{}",
        stderr(&unknown)
    );

    // `log --follow` of a finished branch prints its log and ends (one object a line).
    let followed = forkfleet(&[
        "log",
        &format!("{short}/tidy"),
        "--follow",
        "--json",
        "--data",
        &data,
    ]);
    assert!(followed.status.success(), "{}", stderr(&followed));
    let lines = String::from_utf8_lossy(&followed.stdout).lines().count();
    assert_eq!(lines, by_label.as_array().unwrap().len());

    // A finished fork's events, every branch's, each led by its label; then the end.
    let events = forkfleet(&[
        "fork", "watch", short, "--events", "--json", "--data", &data,
    ]);
    assert!(events.status.success(), "{}", stderr(&events));
    let lines: Vec<Value> = String::from_utf8_lossy(&events.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    for label in ["concise", "thorough", "tidy"] {
        let last = lines.iter().rev().find(|l| l["label"] == label).unwrap();
        assert_eq!(last["event"]["type"], "status", "{last}");
        assert_eq!(last["event"]["state"], "done");
    }
}

/// `log FORK/LABEL --follow` on a cluster, started while the branch is queued: it prints
/// the events as they land and ends with the branch.
#[test]
fn log_follow_streams_a_branch_on_a_cluster_until_it_ends() {
    let fleet = Fleet::start(1, 2, Options::default());
    let dir = fleet.dir.path();
    std::fs::create_dir_all(dir.join("workspace")).unwrap();
    std::fs::write(
        dir.join("w.toml"),
        // Slow enough (about 2.7 s) that the follow starts well before the branch ends.
        writes_then_done(300, true, "out/{label}-{repeat}.txt", "x\\n", 8),
    )
    .unwrap();
    let spec = dir.join("follow.toml");
    std::fs::write(
        &spec,
        "goal = \"follow\"\nworkspace = \"workspace\"\nmodel = \"scripted:w\"\n\
         [models.\"scripted:w\"]\nscript = \"w.toml\"\n\
         [[branches]]\nlabel = \"a\"\nsteer = \"go\"\n",
    )
    .unwrap();
    let id = fleet.create(&spec);
    let mut child = super::fleet::binary()
        .args([
            "log",
            &format!("{id}/a"),
            "--follow",
            "--json",
            "--timeout-s",
            "60",
            "--nats",
            &fleet.nats.url(),
        ])
        .current_dir(dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    // The first event arrives before the branch has finished.
    let mut lines = BufReader::new(stdout).lines();
    let first: Value = serde_json::from_str(&lines.next().unwrap().unwrap()).unwrap();
    assert_eq!(first["seq"], 0, "{first}");
    let shown = fleet.client(&["fork", "show", &id, "--json"]).json();
    let done_then = branch(&shown, "a")["state"] == "done";
    let rest: Vec<Value> = lines
        .map(|l| serde_json::from_str(&l.unwrap()).unwrap())
        .collect();
    let deadline = Instant::now() + COMMAND_LIMIT;
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "log --follow did not end");
        std::thread::sleep(super::fleet::POLL);
    };
    assert!(status.success());
    let last = rest.last().unwrap();
    assert_eq!(last["event"]["type"], "status", "{last}");
    assert_eq!(last["event"]["state"], "done");
    // Eight writes and an answer: nine model responses, every seq once, in order.
    let seqs: Vec<u64> = std::iter::once(&first)
        .chain(&rest)
        .map(|e| e["seq"].as_u64().unwrap())
        .collect();
    assert_eq!(seqs, (0..seqs.len() as u64).collect::<Vec<_>>());
    let responses = rest
        .iter()
        .filter(|e| e["event"]["type"] == "model_response")
        .count();
    assert_eq!(responses, 9);
    assert!(
        !done_then,
        "the branch had finished before the first line: nothing was followed"
    );

    // `fork open --follow` keeps the fork directory in sync while a fork runs on the
    // cluster, then opens it (here with a tool that does nothing).
    // (Another goal: the fork removed below has blobs of its own, its history prefix.)
    let spec2 = dir.join("follow-2.toml");
    std::fs::write(
        &spec2,
        std::fs::read_to_string(&spec)
            .unwrap()
            .replace("goal = \"follow\"", "goal = \"follow, again\""),
    )
    .unwrap();
    let id2 = fleet.create(&spec2);
    let opened = super::fleet::binary()
        .args([
            "fork",
            "open",
            &id2,
            "--follow",
            "--json",
            "--nats",
            &fleet.nats.url(),
        ])
        .env("FORKFLEET_DIFFTOOL", "true {parent} {branches}")
        .current_dir(dir)
        .output()
        .unwrap();
    assert!(
        opened.status.success(),
        "{}",
        String::from_utf8_lossy(&opened.stderr)
    );
    let doc: Value = serde_json::from_slice(&opened.stdout).unwrap();
    assert_eq!(doc["tool"], "custom", "{doc}");
    let fork_dir = dir.join("workspace/.forkfleet/forks").join(&id2);
    assert!(fork_dir.join("branches/a/out/a-7.txt").is_file(), "{doc}");
    let shown = fleet.client(&["fork", "show", &id2, "--json"]).json();
    assert_eq!(
        branch(&shown, "a")["state"],
        "done",
        "it followed to the end: {shown}"
    );

    // Every branch's events over the bus, each led by its label, to the end.
    let events = fleet.client(&["fork", "watch", &id2, "--events", "--json"]);
    assert_eq!(events.code, Some(0), "{}", events.stderr);
    let last: Value = serde_json::from_str(events.stdout.lines().last().unwrap()).unwrap();
    assert_eq!(last["label"], "a");
    assert_eq!(last["event"]["state"], "done", "{last}");
    // A name finds a fork over the bus too.
    let named = fleet.client(&["fork", "create", path_str(&spec2), "--name", "follower"]);
    assert_eq!(named.code, Some(0), "{}", named.stderr);
    let shown = fleet.client(&["fork", "show", "follower", "--json"]).json();
    assert_eq!(shown["fork_id"], named.stdout.trim(), "{shown}");
    assert_eq!(shown["name"], "follower");

    // Housekeeping over the bus: the finished fork is removed, and gone.
    let removed = fleet.client(&["fork", "rm", &id, "--json"]);
    assert_eq!(removed.code, Some(0), "{}", removed.stderr);
    assert_eq!(removed.json()["removed"][0], id.as_str());
    let gone = fleet.client(&["fork", "show", &id]);
    assert_eq!(gone.code, Some(2), "{}", gone.stdout);
    // The removed forks' blobs are swept from the bus's buckets too (no grace here).
    let gc = fleet.client(&["gc", "--older-than", "0s", "--grace", "0s", "--json"]);
    assert_eq!(gc.code, Some(0), "{}", gc.stderr);
    assert!(gc.json()["bus_blobs"].as_u64() > Some(0), "{}", gc.stdout);
    // What the other fork needs is still there: its diff reads its files.
    let diff = fleet.client(&["fork", "diff", &id2, "--unified", "--json"]);
    assert_eq!(diff.code, Some(0), "{}", diff.stderr);
}

/// `run` without a spec file: the flags build the plan (`--dry-run` prints it and writes
/// nothing); with one, they override its keys.
#[test]
fn quick_forks_from_flags_and_flags_over_a_spec() {
    let dir = tempfile::tempdir().unwrap();
    let ws = dir.path().join("ws");
    std::fs::create_dir_all(ws.join("src")).unwrap();
    std::fs::write(ws.join("src/app.py"), "print('app')\n").unwrap();
    // The heavy directories a snapshot skips by default.
    for heavy in [
        ".venv/lib/x.py",
        "node_modules/a/index.js",
        "src/__pycache__/app.pyc",
    ] {
        let p = ws.join(heavy);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, "x").unwrap();
    }
    // The embedded workers' catalogue offers the model (a dry run refuses one it does not).
    let plan = super::harness::command()
        .env(
            "FORKFLEET_MODELS",
            r#""openai:gpt-4o-mini" = { api_key_env = "OPENAI_API_KEY" }"#,
        )
        .args([
            "run",
            "--goal",
            "say hi",
            "--workspace",
            "ws",
            "--model",
            "openai:gpt-4o-mini",
            "--branch",
            "short=be brief",
            "--branch",
            "long=be thorough",
            "--aggregate-budget-usd",
            "1.5",
            "--dry-run",
            "--json",
        ])
        .current_dir(dir.path())
        .output()
        .unwrap();
    let plan = json(&plan);
    assert_eq!(plan["files"], 1, "{plan}");
    assert_eq!(plan["left_out"]["excluded_files"], 3, "{plan}");
    assert_eq!(plan["plan"]["goal"], "say hi");
    assert_eq!(plan["plan"]["aggregate_budget_usd"], 1.5);
    assert_eq!(plan["plan"]["branches"][1]["label"], "long");
    assert_eq!(plan["plan"]["branches"][1]["steer"], "be thorough");
    assert_eq!(plan["plan"]["branches"][1]["model"], "openai:gpt-4o-mini");
    assert!(
        !dir.path().join(".forkfleet").exists(),
        "a dry run writes nothing"
    );
    let missing = super::harness::command()
        .args(["run", "--goal", "g", "--workspace", "ws"])
        .current_dir(dir.path())
        .output()
        .unwrap();
    assert_eq!(missing.status.code(), Some(2));
    assert!(stderr(&missing).contains("no spec file and no --model"));

    // Over a spec: its models and script, these branches and goal.
    let ex = Example::quickstart();
    let out = forkfleet(&[
        "run",
        path_str(&ex.spec()),
        "--goal",
        "only two",
        "--branch",
        "concise=be brief",
        "--branch",
        "tidy=tidy up",
        "--json",
    ]);
    let doc = json(&out);
    assert_eq!(doc["goal"], "only two");
    let labels: Vec<&str> = doc["branches"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["label"].as_str().unwrap())
        .collect();
    assert_eq!(labels, ["concise", "tidy"]);
    let data = path_str(&ex.data()).to_string();
    let fork = doc["fork_id"].as_str().unwrap();
    let one = json(&forkfleet(&[
        "fork", "show", fork, "concise", "--json", "--data", &data,
    ]));
    assert_eq!(one["steers"][0], "be brief");
}

/// A fork's name (the spec's `name` or `--name`) shows in lists and finds it like an id.
#[test]
fn a_named_fork_is_listed_and_found_by_its_name() {
    let ex = Example::quickstart();
    let data = path_str(&ex.data()).to_string();
    let first = json(&forkfleet(&[
        "run",
        path_str(&ex.spec()),
        "--name",
        "greeter",
        "--json",
    ]));
    assert_eq!(first["name"], "greeter");
    let again = json(&forkfleet(&[
        "run",
        path_str(&ex.spec()),
        "--name",
        "greeter",
        "--json",
    ]));
    let list = forkfleet(&["fork", "ls", "--data", &data]);
    let list = String::from_utf8_lossy(&list.stdout);
    assert!(list.contains("NAME") && list.contains("greeter"), "{list}");
    // The name finds the newest fork that has it.
    let shown = json(&forkfleet(&[
        "fork", "show", "greeter", "--json", "--data", &data,
    ]));
    assert_eq!(shown["fork_id"], again["fork_id"]);
    assert_ne!(shown["fork_id"], first["fork_id"]);
    let bad = forkfleet(&["run", path_str(&ex.spec()), "--name", "no spaces"]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(
        stderr(&bad).contains("fork name `no spaces` is not valid"),
        "{}",
        stderr(&bad)
    );
    // A name that is also the end of another fork's id names its fork: names come before
    // tails.
    let first_id = first["fork_id"].as_str().unwrap();
    let tail = &first_id[first_id.len() - 6..];
    let named_as_tail = json(&forkfleet(&[
        "run",
        path_str(&ex.spec()),
        "--name",
        tail,
        "--json",
    ]));
    let shown = json(&forkfleet(&[
        "fork", "show", tail, "--json", "--data", &data,
    ]));
    assert_eq!(shown["fork_id"], named_as_tail["fork_id"], "{shown}");
    let none = forkfleet(&["fork", "show", "nameless", "--data", &data]);
    assert_eq!(none.status.code(), Some(2));
    assert!(stderr(&none).contains("no fork has the id, id prefix or name `nameless`"));
}

/// An agent with the checkpoint tools saves a checkpoint, lists it, and rewinds to it: the
/// conversation and the files go back (its later file is gone from its changes, on the
/// coordinator too), and it goes on from there.
/// The checkpoint tools' script: write a.txt, save, write b.txt, list, rewind, answer.
const CHECKPOINT_SCRIPT: &str = r#"
[[turns.a]]
tool_calls = [{ name = "write_file", args = { path = "a.txt", content = "a\n" } }]
[[turns.a]]
tool_calls = [{ name = "save_checkpoint", args = { label = "before-b" } }]
[[turns.a]]
tool_calls = [{ name = "write_file", args = { path = "b.txt", content = "b\n" } }]
[[turns.a]]
tool_calls = [{ name = "list_checkpoints", args = {} }]
[[turns.a]]
tool_calls = [{ name = "rewind_to", args = { checkpoint = "before-b" } }]
[[turns.a]]
text = "back before b"
"#;

/// A spec of one branch `a` playing [`CHECKPOINT_SCRIPT`] with the checkpoint tools.
const CHECKPOINT_SPEC: &str = "goal = \"checkpoints\"\nworkspace = \"workspace\"\nmodel = \"scripted:cp\"\ncheckpoint_tools = true\n\
     [tool_descriptions]\nsave_checkpoint = \"Remember this point.\"\n\
     [models.\"scripted:cp\"]\nscript = \"cp.toml\"\n\
     [[branches]]\nlabel = \"a\"\nsteer = \"go\"\n";

#[test]
fn an_agent_saves_lists_and_rewinds_to_its_checkpoints() {
    let ex = Example::quickstart();
    std::fs::write(ex.dir.path().join("cp.toml"), CHECKPOINT_SCRIPT).unwrap();
    let spec = ex.write_spec(CHECKPOINT_SPEC);
    let doc = json(&run_spec(&spec));
    let fork = doc["fork_id"].as_str().unwrap();
    let a = branch(&doc, "a");
    assert_eq!(a["state"], "done", "{doc}");
    let data = path_str(&ex.data()).to_string();
    let one = json(&forkfleet(&[
        "fork", "show", fork, "a", "--json", "--data", &data,
    ]));
    let paths: Vec<&str> = one["changes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["path"].as_str().unwrap())
        .collect();
    assert_eq!(paths, ["a.txt"], "b.txt was rewound away: {one}");
    assert_eq!(one["answer"], "back before b");
    // The coordinator's replica rewound too: the diff holds a.txt only.
    let diff = json(&forkfleet(&[
        "fork", "diff", fork, "--json", "--data", &data,
    ]));
    let touched: Vec<&str> = diff["paths"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["path"].as_str().unwrap())
        .collect();
    assert_eq!(touched, ["a.txt"], "{diff}");
    let run = a["id"].as_str().unwrap();
    let log = json(&forkfleet(&["log", run, "--json", "--data", &data]));
    let events: Vec<&Value> = log
        .as_array()
        .unwrap()
        .iter()
        .map(|e| &e["event"])
        .collect();
    let listed = events
        .iter()
        .find(|e| e["type"] == "tool_result" && e["name"] == "list_checkpoints")
        .unwrap();
    assert!(
        listed["output"].as_str().unwrap().contains("before-b"),
        "{listed}"
    );
    assert!(events
        .iter()
        .any(|e| e["type"] == "rewind" && e["label"] == "before-b"));
    assert!(events.iter().any(|e| e["type"] == "user_message"
        && e["text"]
            .as_str()
            .unwrap()
            .starts_with("[forkfleet] You rewound")));
    // Describing a tool the spec does not enable is refused.
    let bad = ex.write_spec(
        "goal = \"g\"\nworkspace = \"workspace\"\nmodel = \"scripted:cp\"\n\
         [tool_descriptions]\nrewind_to = \"x\"\n\
         [models.\"scripted:cp\"]\nscript = \"cp.toml\"\n[[branches]]\nlabel = \"a\"\n",
    );
    let out = forkfleet(&["run", path_str(&bad), "--dry-run"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("checkpoint_tools = true"),
        "{}",
        stderr(&out)
    );
}

/// The checkpoint tools on a cluster: the worker asks the coordinator over the bus, and
/// the coordinator's view follows the agent's rewind.
#[test]
fn checkpoint_tools_work_on_a_cluster() {
    let fleet = Fleet::start(1, 2, Options::default());
    let dir = fleet.dir.path();
    std::fs::create_dir_all(dir.join("workspace")).unwrap();
    std::fs::write(dir.join("cp.toml"), CHECKPOINT_SCRIPT).unwrap();
    let spec = dir.join("cp-spec.toml");
    std::fs::write(&spec, CHECKPOINT_SPEC).unwrap();
    let id = fleet.create(&spec);
    let doc = fleet.watch(&id);
    assert_eq!(
        branch(&doc, "a")["state"],
        "done",
        "{doc}\n{}",
        fleet.logs()
    );
    let one = fleet.client(&["fork", "show", &id, "a", "--json"]).json();
    assert_eq!(one["changes"].as_array().map(Vec::len), Some(1), "{one}");
    assert_eq!(one["changes"][0]["path"], "a.txt");
}
