//! Lineage and replay (docs/LINEAGE.md) through the CLI, embedded and on a real NATS
//! cluster: `runs ls/show/tree`, `runs fork` (copy rules, fork roots, dry runs, the
//! workspace at the cutoff, `--set`, summaries) and `runs resume`, and `--replay`: served
//! from the record at no cost, a divergence named, `--record`.

use super::fleet::{Fleet, Options};
use super::harness::{forkfleet, json, path_str, stderr, Example};
use serde_json::Value;

/// Four calls of model `scripted:one`: write a.txt, delete b.txt, write c.txt, answer.
const SCRIPT_ONE: &str = r#"[defaults]
usage = { input_tokens = 100, output_tokens = 10 }

[[turns."*"]]
tool_calls = [{ name = "write_file", args = { path = "a.txt", content = "A\n" } }]

[[turns."*"]]
tool_calls = [{ name = "delete_file", args = { path = "b.txt" } }]

[[turns."*"]]
tool_calls = [{ name = "write_file", args = { path = "c.txt", content = "C\n" } }]

[[turns."*"]]
text = "done: a written, b deleted, c written"

[[turns.summary]]
text = "The run wrote a.txt, deleted b.txt and wrote c.txt."
"#;

/// `scripted:two` answers at once, differently.
const SCRIPT_TWO: &str = r#"[defaults]
usage = { input_tokens = 100, output_tokens = 10 }

[[turns."*"]]
text = "two: nothing to do"
"#;

/// A single-agent spec on `scripted:one`, with `scripted:two` configured too; the
/// workspace holds b.txt.
fn example() -> (Example, std::path::PathBuf) {
    let ex = Example::quickstart();
    std::fs::write(ex.dir.path().join("one.toml"), SCRIPT_ONE).unwrap();
    std::fs::write(ex.dir.path().join("two.toml"), SCRIPT_TWO).unwrap();
    std::fs::write(ex.workspace().join("b.txt"), "B\n").unwrap();
    let spec = ex.write_spec(
        "goal = \"write and delete\"\nworkspace = \"workspace\"\nmodel = \"scripted:one\"\n\
         system_prompt = \"be careful\"\n\
         [models.\"scripted:one\"]\nscript = \"one.toml\"\nprice = { input_per_mtok = 1.0, output_per_mtok = 10.0 }\n\
         [models.\"scripted:two\"]\nscript = \"two.toml\"\nspare = true\nprice = { input_per_mtok = 1.0, output_per_mtok = 10.0 }\n",
    );
    (ex, spec)
}

fn data(ex: &Example) -> String {
    path_str(&ex.data()).to_string()
}

fn runs(ex: &Example) -> Vec<Value> {
    json(&forkfleet(&["runs", "ls", "--data", &data(ex), "--json"]))
        .as_array()
        .unwrap()
        .clone()
}

fn run_labelled(ex: &Example, label: &str) -> Value {
    runs(ex)
        .into_iter()
        .find(|r| r["label"] == label)
        .unwrap_or_else(|| panic!("no run labelled {label}"))
}

fn log(ex: &Example, run: &str) -> Vec<Value> {
    json(&forkfleet(&["log", run, "--data", &data(ex), "--json"]))
        .as_array()
        .unwrap()
        .clone()
}

fn kinds(log: &[Value]) -> Vec<String> {
    log.iter()
        .map(|e| e["event"]["type"].as_str().unwrap().to_string())
        .collect()
}

/// The seq of the `n`th (from 0) event of `kind` in `log`.
fn seq_of(log: &[Value], kind: &str, n: usize) -> u64 {
    log.iter()
        .filter(|e| e["event"]["type"] == kind)
        .nth(n)
        .unwrap_or_else(|| panic!("no {kind} #{n}"))["seq"]
        .as_u64()
        .unwrap()
}

/// `runs fork` with `args`, its JSON outcome.
fn fork(ex: &Example, parent: &str, args: &[&str]) -> Value {
    let d = data(ex);
    let mut all = vec!["runs", "fork", parent, "--data", &d, "--json"];
    all.extend_from_slice(args);
    json(&forkfleet(&all))
}

/// The parent: the spec's single agent `main`, run to the end.
fn parent(ex: &Example, spec: &std::path::Path) -> String {
    let out = forkfleet(&["run", path_str(spec), "--json", "--timeout-s", "120"]);
    json(&out);
    run_labelled(ex, "main")["run_id"]
        .as_str()
        .unwrap()
        .to_string()
}

/// Everything the store shows: every run with its log, every fork.
fn store_dump(ex: &Example) -> Value {
    let d = data(ex);
    let all = runs(ex);
    let logs: Vec<Value> = all
        .iter()
        .map(|r| Value::Array(log(ex, r["run_id"].as_str().unwrap())))
        .collect();
    let forks = json(&forkfleet(&["fork", "ls", "--data", &d, "--json"]));
    serde_json::json!({"runs": all, "logs": logs, "forks": forks})
}

#[test]
fn a_child_copies_the_conversation_through_the_cutoff_and_nothing_else() {
    let (ex, spec) = example();
    let main = parent(&ex, &spec);
    let parent_log = log(&ex, &main);
    let cut = seq_of(&parent_log, "tool_result", 1);
    let before = store_dump(&ex);

    let child = fork(
        &ex,
        &main,
        &["--at-event", &cut.to_string(), "--label", "retry"],
    );
    assert_eq!(child["state"], "idle");
    assert_eq!(child["cutoff_seq"], cut);
    let id = child["run_id"].as_str().unwrap();
    let child_log = log(&ex, id);

    // Seq 0: the lineage event.
    let lineage = &child_log[0]["event"];
    assert_eq!(lineage["type"], "fork");
    assert_eq!(lineage["parent_run"], main.as_str());
    assert_eq!(lineage["cutoff_seq"], cut);
    assert_eq!(lineage["strategy"], "replay_v1");
    assert_eq!(lineage["label"], "retry");
    // Then the parent's replayable events through the cutoff, renumbered from 1, the
    // same content; no usage, file change, status or lineage.
    let expected: Vec<&Value> = parent_log
        .iter()
        .filter(|e| e["seq"].as_u64().unwrap() <= cut)
        .filter(|e| {
            matches!(
                e["event"]["type"].as_str().unwrap(),
                "system" | "user_message" | "model_response" | "tool_result" | "steer"
            )
        })
        .collect();
    assert_eq!(lineage["replay_event_count"], expected.len());
    for (i, e) in expected.iter().enumerate() {
        assert_eq!(child_log[i + 1]["seq"], i as u64 + 1);
        assert_eq!(
            child_log[i + 1]["event"],
            e["event"],
            "copied with its content"
        );
    }
    assert_eq!(
        kinds(&child_log[expected.len() + 1..]),
        ["status"],
        "then only the idle status"
    );
    assert_eq!(child_log.last().unwrap()["event"]["state"], "idle");
    let skipped = &child["skipped"];
    assert_eq!(skipped["usage"], 2);
    assert_eq!(skipped["file_change"], 2);
    assert_eq!(skipped["fork"], 1);

    // The parent's log is not modified.
    assert_eq!(log(&ex, &main), parent_log);
    let after = store_dump(&ex);
    assert_eq!(after["logs"][0], before["logs"][0]);

    // A cutoff beyond the log, or on an event a child does not copy, is refused with the
    // valid range.
    let d = data(&ex);
    let usage = seq_of(&parent_log, "usage", 0).to_string();
    for (at, says) in [
        ("999", "seq 999 is beyond the log"),
        (usage.as_str(), "is a `usage` event"),
    ] {
        let out = forkfleet(&["runs", "fork", &main, "--at-event", at, "--data", &d]);
        assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
        let err = stderr(&out);
        assert!(
            err.contains(says) && err.contains("fork at a replayable event"),
            "{err}"
        );
    }
}

#[test]
fn the_workspace_is_the_parents_as_it_was_at_the_cutoff() {
    let (ex, spec) = example();
    let main = parent(&ex, &spec);
    let parent_log = log(&ex, &main);
    // After the first tool result: a.txt written; b.txt deleted and c.txt written later.
    let cut = seq_of(&parent_log, "tool_result", 0);
    let child = fork(&ex, &main, &["--at-event", &cut.to_string()]);
    let files: Vec<&str> = child["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["path"].as_str().unwrap())
        .collect();
    assert!(files.contains(&"a.txt"), "{files:?}");
    assert!(
        files.contains(&"b.txt"),
        "deleted after the cutoff: {files:?}"
    );
    assert!(
        !files.contains(&"c.txt"),
        "written after the cutoff: {files:?}"
    );
    // The child's own workspace is that version, its files readable.
    let id = child["run_id"].as_str().unwrap();
    let shown = json(&forkfleet(&[
        "runs",
        "show",
        id,
        "--data",
        &data(&ex),
        "--json",
    ]));
    assert_eq!(shown["workspace"], child["workspace"]);
    assert_eq!(shown["files"], child["files"].as_array().unwrap().len());

    // Resumed with a message, it runs on its history and its files: the script's first
    // turn writes a.txt again, the rest follows; it finishes done.
    let out = forkfleet(&[
        "runs",
        "resume",
        id,
        "carry on",
        "--data",
        &data(&ex),
        "--json",
        "--timeout-s",
        "120",
    ]);
    let doc = json(&out);
    assert_eq!(doc["run"]["run"]["state"], "done", "{doc}");
    let child_log = log(&ex, id);
    assert!(
        child_log
            .iter()
            .any(|e| e["event"]["type"] == "follow_up" && e["event"]["text"] == "carry on"),
        "{child_log:?}"
    );
    // And it can be forked into branches like any run.
    let spec2 = ex.write_spec(
        "goal = \"branches of the child\"\nworkspace = \"workspace\"\nmodel = \"scripted:two\"\n\
         [models.\"scripted:two\"]\nscript = \"two.toml\"\n[[branches]]\nlabel = \"x\"\n[[branches]]\nlabel = \"y\"\n",
    );
    let created = json(&forkfleet(&[
        "fork",
        "create",
        path_str(&spec2),
        "--from-run",
        id,
        "--data",
        &data(&ex),
        "--json",
    ]));
    assert_eq!(created["parent_run"], id, "{created}");
}

#[test]
fn fork_roots_are_inherited_over_generations_and_the_tree_shows_them() {
    let (ex, spec) = example();
    let main = parent(&ex, &spec);
    let root = run_labelled(&ex, "main")["fork_root"]
        .as_str()
        .unwrap()
        .to_string();
    assert_ne!(root, main);
    let mut parent = main.clone();
    let mut ids = Vec::new();
    for generation in 1..=3 {
        let label = format!("gen{generation}");
        let child = fork(&ex, &parent, &["--label", &label]);
        assert_eq!(child["fork_root"], root.as_str(), "generation {generation}");
        let id = child["run_id"].as_str().unwrap().to_string();
        let lineage = &log(&ex, &id)[0]["event"];
        assert_eq!(lineage["fork_root"], root.as_str());
        assert_eq!(lineage["parent_run"], parent.as_str());
        ids.push(id.clone());
        parent = id;
    }
    // A child of the root run itself: the root is the parent and its fork root.
    let of_root = fork(&ex, &root, &["--label", "of-root"]);
    assert_eq!(of_root["fork_root"], root.as_str());
    assert_eq!(of_root["parent_run"], root.as_str());
    // A run started from one of main's checkpoints: a root of its own, under main.
    let d = data(&ex);
    json(&forkfleet(&[
        "checkpoint",
        "save",
        &main,
        "mark",
        "--data",
        &d,
        "--json",
    ]));
    let started = json(&forkfleet(&[
        "checkpoint",
        "fork",
        &main,
        "mark",
        "--data",
        &d,
        "--json",
    ]));
    let from_checkpoint = started["run_id"].as_str().unwrap().to_string();

    let tree = json(&forkfleet(&[
        "runs",
        "tree",
        "--data",
        &data(&ex),
        "--json",
    ]));
    let tops = tree.as_array().unwrap();
    assert_eq!(tops.len(), 1, "{tree}");
    let top = &tops[0];
    assert_eq!(top["run_id"], root.as_str());
    assert_eq!(top["kind"], "root");
    let kids = top["children"].as_array().unwrap();
    let labels: Vec<&str> = kids.iter().map(|k| k["label"].as_str().unwrap()).collect();
    assert_eq!(labels, ["main", "of-root"]);
    // main (merged by `run`) -> gen1 -> gen2 -> gen3.
    let mut node = &kids[0];
    assert_eq!(node["merged"], true);
    assert_eq!(node["kind"], "branch");
    let under_main = node["children"].as_array().unwrap();
    let started = under_main
        .iter()
        .find(|k| k["run_id"] == from_checkpoint.as_str())
        .unwrap_or_else(|| panic!("the checkpoint fork under main: {tree}"));
    assert_eq!(started["kind"], "root");
    assert_eq!(started["origin"]["checkpoint"], "mark");
    assert!(started["how"]
        .as_str()
        .unwrap()
        .starts_with("checkpoint fork of"));
    for (generation, id) in ids.iter().enumerate() {
        let next = node["children"]
            .as_array()
            .unwrap()
            .iter()
            .find(|k| k["kind"] == "child")
            .unwrap();
        assert_eq!(next["run_id"], id.as_str());
        assert_eq!(next["kind"], "child");
        assert_eq!(next["state"], "idle");
        assert_eq!(next["label"], format!("gen{}", generation + 1));
        node = next;
    }
    assert!(node["children"].as_array().unwrap().is_empty());
    let text =
        String::from_utf8(forkfleet(&["runs", "tree", "--data", &data(&ex)]).stdout).unwrap();
    assert!(
        text.contains("└── ") && text.contains("gen3") && text.contains("* merged"),
        "{text}"
    );
    // A subtree.
    let sub = json(&forkfleet(&[
        "runs",
        "tree",
        &ids[1],
        "--data",
        &data(&ex),
        "--json",
    ]));
    assert_eq!(sub[0]["label"], "gen2");
    assert_eq!(sub[0]["children"][0]["label"], "gen3");
}

#[test]
fn a_dry_run_plans_everything_and_writes_nothing() {
    let (ex, spec) = example();
    let main = parent(&ex, &spec);
    let before = store_dump(&ex);
    let plan = fork(
        &ex,
        &main,
        &[
            "--dry-run",
            "--summarize",
            "--set",
            "model=scripted:two",
            "--set",
            "max_turns=3",
        ],
    );
    assert_eq!(plan["dry_run"], true);
    assert!(plan["run_id"].is_null());
    assert_eq!(plan["settings"]["model"], "scripted:two");
    assert_eq!(plan["settings"]["max_turns"], 3);
    assert_eq!(plan["changed"], serde_json::json!(["model", "max_turns"]));
    let summary = plan["summary"].as_str().unwrap();
    assert!(summary.contains("4 model turns"), "{summary}");
    assert!(
        summary.contains("files touched: a.txt, b.txt, c.txt"),
        "{summary}"
    );
    let copied = plan["copied"].as_array().unwrap();
    assert_eq!(copied[0]["seq"], 1);
    assert!(plan["files"].as_array().unwrap().len() >= 2);
    assert_eq!(store_dump(&ex), before, "a dry run writes nothing");
}

#[test]
fn set_typos_and_bad_values_are_refused_before_anything_is_written() {
    let (ex, spec) = example();
    let main = parent(&ex, &spec);
    let before = store_dump(&ex);
    let d = data(&ex);
    for (set, says) in [
        ("temprature=0.5", "did you mean `temperature`?"),
        ("max_turns=0", "--set max_turns: `0` is not a whole number"),
        ("temperature=hot", "is not a number from 0 to 2"),
        ("model=scripted:nope", "scripted:nope"),
        ("novalue", "is not KEY=VALUE"),
    ] {
        let out = forkfleet(&["runs", "fork", &main, "--set", set, "--data", &d]);
        assert_eq!(out.status.code(), Some(2), "{set}: {}", stderr(&out));
        let err = stderr(&out);
        assert!(err.contains(says), "{set}: {err}");
        if set.starts_with("temprature") {
            assert!(
                err.contains("valid keys: model, temperature, system_prompt"),
                "{err}"
            );
        }
    }
    let out = forkfleet(&["runs", "fork", &main, "--record", "--data", &d]);
    assert_eq!(out.status.code(), Some(2), "--record needs --replay");
    assert_eq!(store_dump(&ex), before, "nothing written");
}

#[test]
fn a_replay_is_served_from_the_record_at_no_cost() {
    let (ex, spec) = example();
    let main = parent(&ex, &spec);
    let d = data(&ex);
    let out = forkfleet(&[
        "runs", "fork", &main, "--replay", "--label", "again", "--data", &d, "--json",
    ]);
    let doc = json(&out);
    let run = &doc["run"]["run"];
    assert_eq!(run["state"], "done", "{doc}");
    assert_eq!(run["calls"], 0, "no model call paid: {doc}");
    assert_eq!(run["cached_calls"], 4, "every call served: {doc}");
    assert_eq!(run["cost_usd"], 0.0);
    // The outcome's fields at the top, as when the child is not followed.
    assert_eq!(doc["label"], "again", "{doc}");
    let fork_id = doc["fork_id"].as_str().unwrap();
    let cost = json(&forkfleet(&[
        "fork", "cost", fork_id, "--data", &d, "--json",
    ]));
    assert_eq!(cost["spent_usd"], 0.0);
    assert_eq!(cost["branches"][0]["cached_calls"], 4);
    assert_eq!(cost["branches"][0]["calls"], 0);
    // The re-executed log has the parent's conversation, responses and changes, every
    // usage event marked cached; the workspace ends as the parent's did.
    let id = run["run_id"].as_str().unwrap();
    let child_log = log(&ex, id);
    let parent_log = log(&ex, &main);
    let conv = |l: &[Value]| -> Vec<Value> {
        l.iter()
            .filter(|e| {
                matches!(
                    e["event"]["type"].as_str().unwrap(),
                    "model_response" | "tool_result" | "file_change" | "user_message"
                )
            })
            .map(|e| e["event"].clone())
            .collect()
    };
    assert_eq!(conv(&child_log), conv(&parent_log));
    let usages: Vec<&Value> = child_log
        .iter()
        .filter(|e| e["event"]["type"] == "usage")
        .collect();
    assert_eq!(usages.len(), 4, "{child_log:#?}");
    assert!(usages.iter().all(|u| u["event"]["cached"] == true));
    let shown = json(&forkfleet(&["runs", "show", id, "--data", &d, "--json"]));
    let main_shown = json(&forkfleet(&["runs", "show", &main, "--data", &d, "--json"]));
    assert_eq!(shown["workspace"], main_shown["workspace"]);
}

#[test]
fn a_changed_model_diverges_naming_the_seq_and_the_field_unless_recorded() {
    let (ex, spec) = example();
    let main = parent(&ex, &spec);
    let d = data(&ex);
    let out = forkfleet(&[
        "runs",
        "fork",
        &main,
        "--replay",
        "--set",
        "model=scripted:two",
        "--label",
        "two",
        "--data",
        &d,
    ]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let child = run_labelled(&ex, "two");
    assert_eq!(child["state"], "failed");
    let error = child["error"].as_str().unwrap();
    let first_response = seq_of(&log(&ex, &main), "model_response", 0);
    assert!(error.starts_with("replay_divergence:"), "{error}");
    assert!(
        error.contains(&format!("recorded one at seq {first_response}")),
        "{error}"
    );
    assert!(error.contains("first differing field: model"), "{error}");
    assert!(error.contains("request hash "), "{error}");
    assert_eq!(child["calls"], 0, "nothing live was called");

    // With --record: live from the divergence, recorded in the child.
    let doc = json(&forkfleet(&[
        "runs",
        "fork",
        &main,
        "--replay",
        "--record",
        "--set",
        "model=scripted:two",
        "--label",
        "two-live",
        "--data",
        &d,
        "--json",
    ]));
    let run = &doc["run"]["run"];
    assert_eq!(run["state"], "done", "{doc}");
    assert_eq!(run["calls"], 1);
    assert_eq!(run["cached_calls"], 0);
    assert!(run["cost_usd"].as_f64().unwrap() > 0.0);
    let child_log = log(&ex, run["run_id"].as_str().unwrap());
    let answer = child_log
        .iter()
        .find(|e| e["event"]["type"] == "model_response")
        .unwrap();
    assert_eq!(answer["event"]["text"], "two: nothing to do");
    assert_eq!(answer["event"]["model"], "scripted:two");
    assert!(
        answer["event"]["request"]["hash"].is_string(),
        "recorded with its hash"
    );
}

#[test]
fn a_summary_follows_the_copied_prefix_deterministic_or_by_the_model() {
    let (ex, spec) = example();
    let main = parent(&ex, &spec);
    for (how, says) in [
        ("--summarize", "deterministic_operational_summary_v1"),
        (
            "--summarize=model",
            "The run wrote a.txt, deleted b.txt and wrote c.txt.",
        ),
    ] {
        // A dry run calls no model: a model summary is not written, nor paid for.
        let dry = fork(&ex, &main, &[how, "--dry-run", "--label", "dry"]);
        if how == "--summarize=model" {
            assert!(dry["summary"].is_null(), "{dry}");
        } else {
            assert!(dry["summary"].as_str().unwrap().contains(says), "{dry}");
        }
        let child = fork(&ex, &main, &[how]);
        let child_log = log(&ex, child["run_id"].as_str().unwrap());
        let n = child["replay_event_count"].as_u64().unwrap() as usize;
        let summary = &child_log[n + 1]["event"];
        assert_eq!(summary["type"], "branch_summary", "{child_log:?}");
        assert!(
            summary["text"].as_str().unwrap().contains(says),
            "{summary}"
        );
        // The copied events stay: the summary is added, it replaces nothing.
        assert_eq!(
            kinds(&child_log[1..=n])
                .iter()
                .filter(|k| *k == "model_response")
                .count(),
            4
        );
    }
}

/// A fork of a child summarises the files of the whole history it copies: the child's
/// copied prefix holds the conversation only (its files are in its fork's snapshot), and
/// its summary said "no files touched" where the parent wrote, deleted and wrote three.
#[test]
fn a_summary_of_a_fork_of_a_child_names_the_files_its_history_touched() {
    let (ex, spec) = example();
    let main = parent(&ex, &spec);
    let child = fork(&ex, &main, &["--label", "copy"]);
    let child_run = child["run_id"]
        .as_str()
        .unwrap_or_else(|| panic!("{child}"));
    let grandchild = fork(&ex, child_run, &["--summarize", "--label", "again"]);
    let grandchild_log = log(&ex, grandchild["run_id"].as_str().unwrap());
    let summary = grandchild_log
        .iter()
        .find(|e| e["event"]["type"] == "branch_summary")
        .unwrap_or_else(|| panic!("{grandchild_log:?}"))["event"]["text"]
        .as_str()
        .unwrap();
    assert!(
        summary.contains("files touched: a.txt, b.txt, c.txt"),
        "{summary}"
    );
    assert!(summary.contains("4 model turns"), "{summary}");
}

/// A branch with no answer of its own says so: its copied prefix holds its parent's
/// answers, which `fork show FORK LABEL` showed as the child's final answer.
#[test]
fn a_child_without_an_answer_of_its_own_shows_none() {
    let (ex, spec) = example();
    let main = parent(&ex, &spec);
    let d = data(&ex);
    let main_fork = run_labelled(&ex, "main")["fork_id"]
        .as_str()
        .unwrap()
        .to_string();
    let shown = |fork: &str, label: &str, json_out: bool| {
        let mut args = vec!["fork", "show", fork, label, "--data", &d];
        if json_out {
            args.push("--json");
        }
        forkfleet(&args)
    };
    let parents = json(&shown(&main_fork, "main", true));
    assert!(parents["answer"].is_string(), "{parents}");
    let child = fork(&ex, &main, &["--label", "quiet"]);
    let child_fork = child["fork_id"]
        .as_str()
        .unwrap_or_else(|| panic!("{child}"));
    let detail = json(&shown(child_fork, "quiet", true));
    assert_eq!(detail["turns"], 0, "{detail}");
    assert!(detail["answer"].is_null(), "{detail}");
    let text = shown(child_fork, "quiet", false);
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains("no answer yet"), "{text}");
}

/// A model no worker offers is refused when the child is asked for (dry run or not), and
/// by a fork's dry run, as a fork's creation refuses it: they were accepted, and the child
/// or the branch failed when it ran.
#[test]
fn a_model_no_worker_offers_is_refused_before_anything_runs() {
    let (ex, spec) = example();
    let main = parent(&ex, &spec);
    let d = data(&ex);
    for dry in [false, true] {
        let mut args = vec![
            "runs",
            "fork",
            main.as_str(),
            "--set",
            "model=openai:nosuch",
            "--data",
            &d,
        ];
        if dry {
            args.push("--dry-run");
        }
        let out = forkfleet(&args);
        assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
        assert!(stderr(&out).contains("openai:nosuch"), "{}", stderr(&out));
    }
    assert_eq!(runs(&ex).len(), 2, "no child was written");
    let unoffered =
        ex.write_spec("goal = \"g\"\nworkspace = \"workspace\"\nmodel = \"openai:nosuch\"\n");
    for cmd in ["run", "fork create"] {
        let mut args: Vec<&str> = cmd.split(' ').collect();
        args.extend([path_str(&unoffered), "--dry-run", "--data", &d]);
        let out = forkfleet(&args);
        assert_eq!(out.status.code(), Some(2), "{cmd}: {}", stderr(&out));
        assert!(stderr(&out).contains("openai:nosuch"), "{}", stderr(&out));
    }
}

/// A cutoff between a tool call and its result, with a summary: the call is answered as
/// interrupted first, then the summary, so no message ever sits between a call and its
/// result (a server enforcing OpenAI's order answers such a history 400, and the child
/// could never be resumed). Resumed, the child runs on from there.
#[test]
fn a_summary_at_a_cutoff_inside_a_tool_call_follows_its_interrupted_result() {
    let (ex, spec) = example();
    let main = parent(&ex, &spec);
    let parent_log = log(&ex, &main);
    // The first model response (a write_file call), before its tool result.
    let at = seq_of(&parent_log, "model_response", 0);
    for replay in [false, true] {
        let mut args = vec![
            "--at-event".to_string(),
            at.to_string(),
            "--summarize".into(),
        ];
        args.push("--label".into());
        args.push(format!("inside-{replay}"));
        if replay {
            args.push("--replay".into());
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let child = fork(&ex, &main, &args);
        // Embedded, a replay is followed to its end: the outcome is under `fork`.
        let run = child["run_id"]
            .as_str()
            .or_else(|| child["run"]["run"]["run_id"].as_str())
            .unwrap_or_else(|| panic!("{child}"));
        let child_log = log(&ex, run);
        let conversational: Vec<&Value> = child_log
            .iter()
            .map(|e| &e["event"])
            .filter(|e| {
                e["type"].as_str().is_some_and(|t| {
                    [
                        "model_response",
                        "tool_result",
                        "branch_summary",
                        "user_message",
                    ]
                    .contains(&t)
                })
            })
            .collect();
        let kinds: Vec<&str> = conversational
            .iter()
            .map(|e| e["type"].as_str().unwrap())
            .collect();
        let response = kinds
            .iter()
            .position(|k| *k == "model_response")
            .unwrap_or_else(|| panic!("{kinds:?}"));
        assert_eq!(
            &kinds[response..response + 3],
            ["model_response", "tool_result", "branch_summary"],
            "{child_log:?}"
        );
        // The summary counts the call the cutoff cut off.
        let summary = conversational[response + 2]["text"].as_str().unwrap();
        assert!(
            summary.contains("tool calls: write_file x1 (1 without a result at the cutoff)"),
            "{summary}"
        );
        let result = conversational[response + 1];
        if replay {
            // The replay ran the call again: its real result, then the summary.
            assert_eq!(result["ok"], true, "{result}");
        } else {
            // A copy answers it as interrupted, then the summary; nothing after (idle).
            assert_eq!(kinds.len(), response + 3, "{kinds:?}");
            assert_eq!(result["ok"], false, "{result}");
            assert!(
                result["output"]
                    .as_str()
                    .unwrap()
                    .starts_with("interrupted"),
                "{result}"
            );
        }
        // One result per call.
        let results_of_first = conversational
            .iter()
            .filter(|e| e["type"] == "tool_result" && e["call_id"] == "call_0_0")
            .count();
        assert_eq!(results_of_first, 1, "{child_log:?}");
    }
}

/// The same replay over NATS: the parent ran on one worker, which is gone; the child
/// replays on another, which calls no model (its `/metrics` counts none).
#[test]
fn a_replay_runs_on_any_worker_of_a_cluster_from_the_coordinators_record() {
    let (ex, spec) = example();
    let mut fleet = Fleet::start(1, 4, Options::default());
    let id = fleet.create(&spec);
    let view = fleet.watch(&id);
    assert_eq!(view["branches"][0]["state"], "done", "{view}");
    let main = view["branches"][0]["id"].as_str().unwrap().to_string();
    // The worker that ran the parent is gone: the child can only run on another.
    let mut first = fleet.workers.remove(0);
    first.kill();

    let addr = format!("127.0.0.1:{}", forkfleet_bus::testkit::free_port());
    let second = super::fleet::Service::spawn_env(
        "worker-second",
        &["worker", "--nats", &fleet.nats.url(), "--http-addr", &addr],
        fleet.dir.path(),
        &[],
    );
    fleet.workers.push(second);
    let forked = fleet.client(&[
        "runs",
        "fork",
        &main,
        "--replay",
        "--wait",
        "--timeout-s",
        "60",
        "--json",
    ]);
    let doc = forked.json();
    let run = &doc["run"]["run"];
    assert_eq!(run["state"], "done", "{doc}\n{}", fleet.logs());
    assert_eq!(run["cached_calls"], 4);
    assert_eq!(run["calls"], 0);
    assert_eq!(run["cost_usd"], 0.0);
    let metrics = super::metrics::get(&addr, "/metrics").expect("the worker's /metrics");
    let calls = super::metrics::sample_sum(&metrics.body, "forkfleet_model_calls_total");
    assert_eq!(
        calls, 0.0,
        "no provider call on the replaying worker:\n{}",
        metrics.body
    );

    // A child made on the cluster resumes there too.
    let child = fleet
        .client(&[
            "runs",
            "fork",
            &main,
            "--at-event",
            "2",
            "--label",
            "late",
            "--json",
        ])
        .json();
    let child_id = child["run_id"].as_str().unwrap();
    let resumed = fleet
        .client(&[
            "runs",
            "resume",
            child_id,
            "--wait",
            "--timeout-s",
            "60",
            "--json",
        ])
        .json();
    assert_eq!(resumed["run"]["run"]["state"], "done", "{resumed}");
    // The same counter on the same worker counts the live calls of the resumed child:
    // the zero above is a count, not a missing series.
    let live = resumed["run"]["run"]["calls"].as_f64().unwrap();
    assert!(live > 0.0, "{resumed}");
    let metrics = super::metrics::get(&addr, "/metrics").expect("the worker's /metrics");
    let calls = super::metrics::sample_sum(&metrics.body, "forkfleet_model_calls_total");
    assert_eq!(calls, live, "every live call counted:\n{}", metrics.body);
    let tree = fleet.client(&["runs", "tree", "--json"]).json();
    assert_eq!(tree.as_array().unwrap().len(), 1, "{tree}");
    let _ = ex;
}

/// `examples/lineage/demo.sh`, the example a new user runs, end to end.
#[test]
fn the_lineage_example_runs_end_to_end() {
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/lineage/demo.sh");
    let out = std::process::Command::new("bash")
        .arg(&script)
        .env("FORKFLEET", env!("CARGO_BIN_EXE_forkfleet"))
        .env("RUST_LOG", "warn")
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let err = stderr(&out);
    assert!(out.status.success(), "{stdout}\n{err}");
    assert!(stdout.contains("state      idle"), "{stdout}");
    assert!(
        stdout.contains(
            "finished done: 18 events, $0.000000 spent (0 calls paid, 4 served from the record)"
        ),
        "{stdout}"
    );
    assert!(err.contains("first differing field: model"), "{err}");
    assert!(
        stdout.contains("state      failed: replay_divergence"),
        "{stdout}"
    );
    assert!(stdout.contains("careful-live"), "{stdout}");
}
