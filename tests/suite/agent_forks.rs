//! Root runs and agent-initiated forks end to end on the embedded mode: `forkfleet run` with
//! a goal and no branches runs one agent; with `forking = true` it forks itself through the
//! coordinator, waits for its branches, merges one into its own workspace, and the run's
//! work lands in the directory. A branch forking past `max_depth` gets a tool error.

use super::harness::{branch, forkfleet, json, path_str, run_spec, stderr, Example};
use serde_json::Value;

/// The root agent forks into `fast` and `careful`, waits, and picks `careful`; `careful`
/// tries to fork again (refused at `max_depth = 1`) and finishes anyway.
const SCRIPT: &str = r#"
[defaults]
usage = { input_tokens = 100, output_tokens = 10 }

[[turns.main]]
tool_calls = [{ name = "write_file", args = { path = "plan.md", content = "two ways\n" } }]
[[turns.main]]
tool_calls = [{ name = "fork_run", args = { branches = [{ label = "fast", steer = "be fast" }, { label = "careful", steer = "be careful" }], isolation = { history = "copy", backend = "copy", message_queue = "isolated" } } }]
[[turns.main]]
tool_calls = [{ name = "inspect_branches", args = { wait_s = 60 } }]
[[turns.main]]
tool_calls = [{ name = "merge_or_select", args = { action = "pick:careful" } }]
[[turns.main]]
text = "merged the careful branch"

[[turns.fast]]
tool_calls = [{ name = "write_file", args = { path = "fast.txt", content = "fast\n" } }]
[[turns.fast]]
text = "fast done"

[[turns.careful]]
tool_calls = [{ name = "write_file", args = { path = "careful.txt", content = "careful\n" } }]
[[turns.careful]]
tool_calls = [{ name = "fork_run", args = { branches = [{ label = "deeper", steer = "go deeper" }] } }]
[[turns.careful]]
text = "careful done"
"#;

fn setup(script: &str, top: &str) -> (Example, std::path::PathBuf) {
    let ex = Example::quickstart();
    std::fs::write(ex.dir.path().join("agent.toml"), script).unwrap();
    let spec = ex.write_spec(&format!(
        "goal = \"improve the tool\"\nworkspace = \"workspace\"\nmodel = \"scripted:agent\"\n{top}\n\
         [models.\"scripted:agent\"]\nscript = \"agent.toml\"\n"
    ));
    (ex, spec)
}

fn ff(ex: &Example, args: &[&str]) -> std::process::Output {
    let data = ex.data();
    let mut all: Vec<&str> = args.to_vec();
    all.extend(["--data", path_str(&data)]);
    forkfleet(&all)
}

fn log_of(ex: &Example, run: &str) -> Vec<Value> {
    json(&ff(ex, &["log", run, "--json"]))
        .as_array()
        .unwrap()
        .clone()
}

fn tool_results<'a>(log: &'a [Value], name: &str) -> Vec<&'a Value> {
    log.iter()
        .map(|e| &e["event"])
        .filter(|e| e["type"] == "tool_result" && e["name"] == name)
        .collect()
}

/// The fork (in a `fork ls --json` list) made by the agent of run `run`.
fn fork_of<'a>(forks: &'a Value, run: &str) -> Option<&'a Value> {
    forks
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["parent_run"] == run)
}

#[test]
fn a_root_agent_forks_itself_merges_a_branch_and_its_work_lands_in_the_workspace() {
    let (ex, spec) = setup(SCRIPT, "forking = true\nmax_depth = 1");
    let out = run_spec(&spec);
    assert!(out.status.success(), "{}", stderr(&out));
    let doc = json(&out);
    // One agent, labelled main, done and merged.
    let branches = doc["branches"].as_array().unwrap();
    assert_eq!(branches.len(), 1, "{doc}");
    assert_eq!(branches[0]["label"], "main");
    assert_eq!(branches[0]["state"], "done", "{doc}");

    // Its own file and the picked branch's file are in the workspace; the other's is not.
    assert_eq!(ex.read("plan.md").as_deref(), Some("two ways\n"));
    assert_eq!(ex.read("careful.txt").as_deref(), Some("careful\n"));
    assert_eq!(ex.read("fast.txt"), None, "the branch not picked stays out");

    // The agent's fork is a fork like any other: listed, parented on the agent's run,
    // merged with the pick.
    let main_run = branches[0]["id"].as_str().unwrap().to_string();
    let forks = json(&ff(&ex, &["fork", "ls", "--json"]));
    let inner = fork_of(&forks, &main_run)
        .unwrap_or_else(|| panic!("no fork of the agent's run in {forks}"))
        .clone();
    assert_eq!(inner["state"], "merged", "{inner}");
    assert_eq!(inner["winner"], "careful", "{inner}");

    // The agent saw its tools' results: the fork, the settled branches, the merge.
    let log = log_of(&ex, &main_run);
    // Its call gave pydantic-deep's isolation flags, at the values forkfleet gives them.
    let forked = tool_results(&log, "fork_run");
    assert_eq!(forked.len(), 1);
    assert_eq!(forked[0]["ok"], true, "{}", forked[0]);
    let inspected = tool_results(&log, "inspect_branches");
    assert!(
        inspected[0]["output"]
            .as_str()
            .unwrap()
            .contains("\"settled\":true"),
        "{}",
        inspected[0]
    );
    let merged = tool_results(&log, "merge_or_select");
    assert_eq!(merged[0]["ok"], true, "{}", merged[0]);
    let output = merged[0]["output"].as_str().unwrap();
    assert!(
        output.contains("careful.txt") && output.contains("careful done"),
        "{output}"
    );
    // The merged file is the agent's own change, after the merge's tool call.
    let changes: Vec<&str> = log
        .iter()
        .filter(|e| e["event"]["type"] == "file_change")
        .map(|e| e["event"]["change"]["path"].as_str().unwrap())
        .collect();
    assert_eq!(changes, ["plan.md", "careful.txt"], "{log:?}");

    // The branch that tried to fork past max_depth got a tool error and went on.
    let careful = branch(&inner, "careful");
    assert_eq!(careful["state"], "done", "{careful}");
    let careful_log = log_of(&ex, careful["id"].as_str().unwrap());
    let refused = tool_results(&careful_log, "fork_run");
    assert_eq!(refused.len(), 1);
    assert_eq!(refused[0]["ok"], false, "{}", refused[0]);
    assert!(
        refused[0]["output"]
            .as_str()
            .unwrap()
            .contains("max_depth is 1"),
        "{}",
        refused[0]
    );
    // The branches' history stops before the response that asked for the fork: the only
    // fork_run call in `careful`'s log is its own.
    let calls = careful_log
        .iter()
        .filter(|e| {
            e["event"]["type"] == "model_response"
                && e["event"]["tool_calls"][0]["name"] == "fork_run"
        })
        .count();
    assert_eq!(calls, 1, "{careful_log:?}");
}

#[test]
fn a_root_run_without_forking_has_no_fork_tools_and_runs_one_agent() {
    let script = r#"
[[turns.main]]
tool_calls = [{ name = "fork_run", args = { branches = [{ label = "x", steer = "y" }] } }]
[[turns.main]]
tool_calls = [{ name = "write_file", args = { path = "solo.txt", content = "alone\n" } }]
[[turns.main]]
text = "done alone"
"#;
    let (ex, spec) = setup(script, "");
    let out = run_spec(&spec);
    assert!(out.status.success(), "{}", stderr(&out));
    let doc = json(&out);
    let main_run = doc["branches"][0]["id"].as_str().unwrap().to_string();
    assert_eq!(ex.read("solo.txt").as_deref(), Some("alone\n"));
    let log = log_of(&ex, &main_run);
    let refused = tool_results(&log, "fork_run");
    assert_eq!(refused[0]["ok"], false);
    assert!(
        refused[0]["output"]
            .as_str()
            .unwrap()
            .contains("unknown tool `fork_run`"),
        "{}",
        refused[0]
    );
    let forks = json(&ff(&ex, &["fork", "ls", "--json"]));
    assert_eq!(
        forks.as_array().unwrap().len(),
        1,
        "no fork was made: {forks}"
    );
}

#[test]
fn a_fork_the_agent_leaves_unresolved_is_merged_from_the_cli_into_the_agent() {
    // The agent forks and finishes without resolving.
    let script = r#"
[defaults]
usage = { input_tokens = 100, output_tokens = 10 }
[[turns.main]]
tool_calls = [{ name = "fork_run", args = { branches = [{ label = "one", steer = "write one" }] } }]
[[turns.main]]
text = "left it to you"
[[turns.one]]
tool_calls = [{ name = "write_file", args = { path = "one.txt", content = "1\n" } }]
[[turns.one]]
text = "one done"
"#;
    let (ex, spec) = setup(script, "forking = true");
    let out = run_spec(&spec);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("unresolved"),
        "the run says why nothing was merged: {}",
        stderr(&out)
    );
    assert_eq!(ex.read("one.txt"), None);
    let doc = json(&out);
    let solo = doc["fork_id"].as_str().unwrap().to_string();
    let main_run = doc["branches"][0]["id"].as_str().unwrap().to_string();
    let forks = json(&ff(&ex, &["fork", "ls", "--json"]));
    let inner = fork_of(&forks, &main_run).unwrap()["fork_id"]
        .as_str()
        .unwrap()
        .to_string();
    // Wait for the inner branch, merge it into the (finished) agent, then the agent's run
    // into the workspace.
    let w = ff(&ex, &["fork", "watch", &inner, "--timeout-s", "60"]);
    assert!(w.status.success(), "{}", stderr(&w));
    let m = ff(&ex, &["fork", "merge", &inner, "--pick", "one", "--json"]);
    assert!(m.status.success(), "{}", stderr(&m));
    assert_eq!(
        ex.read("one.txt"),
        None,
        "an inner merge lands in the agent, not the directory"
    );
    let log = log_of(&ex, &main_run);
    let last = &log.last().unwrap()["event"];
    assert_eq!(last["type"], "branch_summary", "{last}");
    assert!(
        last["text"].as_str().unwrap().contains("one done"),
        "{last}"
    );
    let m = ff(&ex, &["fork", "merge", &solo, "--pick", "main", "--json"]);
    assert!(m.status.success(), "{}", stderr(&m));
    assert_eq!(ex.read("one.txt").as_deref(), Some("1\n"));
}

#[test]
fn an_agent_forks_on_a_cluster_and_merges_into_its_branch() {
    use super::fleet::{Fleet, Options};
    let cluster = Fleet::start(2, 4, Options::default());
    let (_ex, spec) = setup(SCRIPT, "forking = true\nmax_depth = 1");
    let id = cluster.create(&spec);
    let view = cluster.watch(&id);
    let main = &view["branches"][0];
    assert_eq!(main["label"], "main");
    assert_eq!(main["state"], "done", "{view}\n{}", cluster.logs());
    let main_run = main["id"].as_str().unwrap().to_string();
    let log = cluster.log(&main_run);
    let merged = tool_results(&log, "merge_or_select");
    assert_eq!(merged[0]["ok"], true, "{}", merged[0]);
    let changes: Vec<&str> = log
        .iter()
        .filter(|e| e["event"]["type"] == "file_change")
        .map(|e| e["event"]["change"]["path"].as_str().unwrap())
        .collect();
    assert_eq!(changes, ["plan.md", "careful.txt"]);
    // The depth limit holds on the cluster too.
    let forks = cluster.client(&["fork", "ls", "--json"]).json();
    let inner = fork_of(&forks, &main_run).unwrap().clone();
    assert_eq!(inner["winner"], "careful", "{inner}");
    let careful = branch(&inner, "careful");
    let refused = tool_results(&cluster.log(careful["id"].as_str().unwrap()), "fork_run")
        .into_iter()
        .cloned()
        .collect::<Vec<_>>();
    assert_eq!(refused[0]["ok"], false, "{}", refused[0]);
}

#[test]
fn an_agent_lets_the_judge_pick_and_merges_the_pick_itself() {
    let script = r#"
[defaults]
usage = { input_tokens = 100, output_tokens = 10 }
[[turns.main]]
tool_calls = [{ name = "fork_run", args = { branches = [{ label = "a", steer = "write a" }, { label = "b", steer = "write b" }] } }]
[[turns.main]]
tool_calls = [{ name = "inspect_branches", args = { wait_s = 60 } }]
[[turns.main]]
tool_calls = [{ name = "merge_or_select", args = { action = "auto" } }]
[[turns.main]]
text = "the judge chose"
[[turns.a]]
tool_calls = [{ name = "write_file", args = { path = "a.txt", content = "a\n" } }]
[[turns.a]]
text = "a done"
[[turns.b]]
tool_calls = [{ name = "write_file", args = { path = "b.txt", content = "b\n" } }]
[[turns.b]]
text = "b done"
"#;
    let (ex, _) = setup(script, "");
    std::fs::write(
        ex.dir.path().join("judge.toml"),
        "[[turns.judge]]\ntext = '{\"winner\": \"b\", \"confidence\": 0.9, \"reasoning\": \"b\"}'\n",
    )
    .unwrap();
    // The spec's judge strategy is for the agent's forks: the root run itself has one
    // branch and merges it once it is done.
    let spec = ex.write_spec(
        "goal = \"improve the tool\"\nworkspace = \"workspace\"\nmodel = \"scripted:agent\"\n\
         forking = true\nstrategy = \"auto\"\njudge_model = \"scripted:judge\"\n\
         [models.\"scripted:agent\"]\nscript = \"agent.toml\"\n\
         [models.\"scripted:judge\"]\nscript = \"judge.toml\"\n",
    );
    let out = run_spec(&spec);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(ex.read("b.txt").as_deref(), Some("b\n"));
    assert_eq!(ex.read("a.txt"), None);
    let doc = json(&out);
    let main_run = doc["branches"][0]["id"].as_str().unwrap().to_string();
    let merged = tool_results(&log_of(&ex, &main_run), "merge_or_select")[0].clone();
    assert_eq!(merged["ok"], true, "{merged}");
    assert!(
        merged["output"]
            .as_str()
            .unwrap()
            .contains("\"merged\":\"b\""),
        "{merged}"
    );
}

/// An agent's forks run under the agent's approval rules: its branch that deletes a file
/// waits, `inspect_branches` says so, and picking the other branch ends the waiting one
/// with its request.
const APPROVAL_SCRIPT: &str = r#"
[defaults]
usage = { input_tokens = 100, output_tokens = 10 }

[[turns.main]]
tool_calls = [{ name = "fork_run", args = { branches = [{ label = "del", steer = "delete" }, { label = "keep", steer = "keep" }] } }]
[[turns.main]]
tool_calls = [{ name = "inspect_branches", args = { wait_s = 60 } }]
[[turns.main]]
tool_calls = [{ name = "merge_or_select", args = { action = "pick:keep" } }]
[[turns.main]]
text = "kept"

[[turns.del]]
tool_calls = [{ name = "delete_file", args = { path = "greet.py" } }]
[[turns.del]]
text = "deleted"

[[turns.keep]]
tool_calls = [{ name = "write_file", args = { path = "kept.txt", content = "kept\n" } }]
[[turns.keep]]
text = "kept"
"#;

#[test]
fn an_agents_forks_wait_for_approval_under_its_rules() {
    let (ex, spec) = setup(
        APPROVAL_SCRIPT,
        "forking = true\nmax_depth = 1\n[approval]\ntools = [\"delete_file\"]",
    );
    let out = run_spec(&spec);
    assert!(out.status.success(), "{}", stderr(&out));
    let doc = json(&out);
    let main_run = doc["branches"][0]["id"].as_str().unwrap().to_string();
    let log = log_of(&ex, &main_run);
    let inspected = tool_results(&log, "inspect_branches");
    let text = inspected[0]["output"].as_str().unwrap();
    assert!(
        text.contains("\"state\":\"awaiting_approval\"")
            && text.contains("\"waits_for_approval\":{")
            && text.contains("\"rule\":\"tools: delete_file\""),
        "{text}"
    );
    let forks = json(&ff(&ex, &["fork", "ls", "--json"]));
    let inner = fork_of(&forks, &main_run).unwrap();
    assert_eq!(inner["winner"], "keep", "{inner}");
    let del = branch(inner, "del");
    assert_eq!(del["state"], "terminated", "{inner}");
    assert!(del["approval"].is_null());
    assert_eq!(ex.read("kept.txt").as_deref(), Some("kept\n"));
    assert!(ex.read("greet.py").is_some(), "the delete never ran");
    assert!(json(&ff(&ex, &["approvals", "--json"]))
        .as_array()
        .unwrap()
        .is_empty());
}
