//! The resolve path end to end on the embedded mode (and one cluster run): tests on every
//! branch's tree run by workers, scripted judges, each strategy's decision, the merge.

use super::fleet::{Fleet, Options};
use super::harness::{forkfleet, json, path_str, run_spec, stderr, Example};
use serde_json::Value;
use std::path::Path;
use std::process::Command;

/// A test command: passes when `result.txt` says `ok`, printing a plain summary line.
const CHECK: &str = "import sys\n\
try:\n    t = open('result.txt').read().strip()\n\
except OSError:\n    t = ''\n\
print('1 passed, 0 failed' if t == 'ok' else '0 passed, 1 failed')\n\
sys.exit(0 if t == 'ok' else 1)\n";

/// Branch `good` writes `ok`, branch `bad` writes `bad`.
const BRANCHES: &str = r#"
[defaults]
usage = { input_tokens = 100, output_tokens = 10 }

[[turns.good]]
tool_calls = [{ name = "write_file", args = { path = "result.txt", content = "ok\n" } }]
[[turns.good]]
text = "good done"

[[turns.bad]]
tool_calls = [{ name = "write_file", args = { path = "result.txt", content = "bad\n" } }]
[[turns.bad]]
text = "bad done"
"#;

pub(super) fn verdict(winner: &str, confidence: f64) -> String {
    format!(
        "[[turns.judge]]\ntext = '{{\"winner\": \"{winner}\", \"confidence\": {confidence}, \"reasoning\": \"because\"}}'\n"
    )
}

/// A fork of `good` and `bad` in a fresh quickstart copy, with `top` spec keys and the
/// judge scripts `judges` (`scripted:judge1`, `scripted:judge2`, ... in order).
pub(super) fn setup(top: &str, judges: &[String]) -> (Example, std::path::PathBuf) {
    let ex = Example::quickstart();
    std::fs::write(ex.dir.path().join("branches.toml"), BRANCHES).unwrap();
    std::fs::write(ex.workspace().join("check.py"), CHECK).unwrap();
    let mut models = String::from(
        "[models.\"scripted:b\"]\nscript = \"branches.toml\"\nprice = { input_per_mtok = 1.0, output_per_mtok = 2.0 }\n",
    );
    for (i, script) in judges.iter().enumerate() {
        let file = format!("judge{}.toml", i + 1);
        std::fs::write(ex.dir.path().join(&file), script).unwrap();
        models.push_str(&format!(
            "[models.\"scripted:judge{}\"]\nscript = \"{file}\"\nprice = {{ input_per_mtok = 1.0, output_per_mtok = 2.0 }}\n",
            i + 1
        ));
    }
    let spec = ex.write_spec(&format!(
        "goal = \"make check.py pass\"\nworkspace = \"workspace\"\nmodel = \"scripted:b\"\n{top}\n{models}\n\
         [[branches]]\nlabel = \"good\"\nsteer = \"go\"\n[[branches]]\nlabel = \"bad\"\nsteer = \"go\"\n"
    ));
    (ex, spec)
}

pub(super) const TESTED: &str = "test_command = [\"python3\", \"check.py\"]\ntest_timeout_s = 60";

fn test_of<'a>(resolve: &'a Value, label: &str) -> &'a Value {
    resolve["tests"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["label"] == label)
        .unwrap_or_else(|| panic!("no test of {label} in {resolve}"))
}

#[test]
fn the_example_merges_a_passing_fix_because_the_tests_say_so() {
    let ex = Example::named("fix-a-bug");
    let run_tests = |dir: &Path| {
        Command::new("python3")
            .arg("run_tests.py")
            .current_dir(dir)
            .output()
            .unwrap()
    };
    assert!(
        !run_tests(&ex.workspace()).status.success(),
        "the example starts failing"
    );

    let doc = json(&run_spec(&ex.spec()));
    let resolve = &doc["resolve"];
    // Real test runs on every branch's tree: the wrong fix fails two of six.
    assert_eq!(
        test_of(resolve, "average-middle")["signal"]["pass_ratio"],
        1.0
    );
    assert_eq!(test_of(resolve, "stdlib")["signal"]["pass_ratio"], 1.0);
    let wrong = test_of(resolve, "lower-middle");
    assert_eq!(wrong["signal"]["counts"]["passed"], 4, "{wrong}");
    assert_eq!(wrong["signal"]["counts"]["failed"], 2, "{wrong}");
    assert_eq!(wrong["outcome"]["kind"], "exited");
    // The judge first picked the wrong fix, was refused with the test results, and
    // picked a passing one.
    let judge = &resolve["judges"][0];
    assert_eq!(judge["run"]["calls"], 2, "{judge}");
    let refused = judge["run"]["refused"][0].as_str().unwrap();
    assert!(
        refused.contains("\"lower-middle\", which is not among"),
        "{refused}"
    );
    assert_eq!(judge["run"]["verdict"]["winner"], "average-middle");
    assert_eq!(resolve["decision"]["kind"], "commit");
    assert_eq!(resolve["decision"]["winner"], "average-middle");
    assert_eq!(doc["winner"], "average-middle");
    // The judge's cost is its own, not the branches'.
    let judge_cost = resolve["judge_cost_usd"].as_f64().unwrap();
    assert!(judge_cost > 0.0);
    let branches: f64 = doc["branches"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["cost_usd"].as_f64().unwrap())
        .sum();
    assert!((doc["total_cost_usd"].as_f64().unwrap() - branches).abs() < 1e-12);
    // The merge landed in the workspace: its tests pass now.
    let after = run_tests(&ex.workspace());
    assert!(
        after.status.success(),
        "{}",
        String::from_utf8_lossy(&after.stdout)
    );
    assert!(ex
        .read("stats.py")
        .unwrap()
        .contains("(s[mid - 1] + s[mid]) / 2"));
    // The materialised fork directory went with the resolve (no keep_artifacts).
    assert!(!ex.workspace().join(".forkfleet").exists());
}

#[test]
fn manual_runs_the_tests_and_merges_nothing() {
    let (ex, spec) = setup(&format!("strategy = \"manual\"\n{TESTED}"), &[]);
    let doc = json(&run_spec(&spec));
    let resolve = &doc["resolve"];
    assert_eq!(resolve["decision"]["kind"], "manual");
    assert_eq!(test_of(resolve, "good")["signal"]["pass_ratio"], 1.0);
    assert_eq!(test_of(resolve, "bad")["signal"]["pass_ratio"], 0.0);
    assert!(resolve["judges"].as_array().unwrap().is_empty());
    assert!(resolve["merge"].is_null());
    assert!(ex.read("result.txt").is_none(), "nothing merged");
    assert_eq!(doc["state"], "settled");
    // Unresolved, the materialised fork directory stays for people and their tools.
    let id = doc["fork_id"].as_str().unwrap();
    let mirrored = ex
        .workspace()
        .join(format!(".forkfleet/forks/{id}/branches/good/result.txt"));
    assert_eq!(std::fs::read_to_string(mirrored).unwrap(), "ok\n");
}

#[test]
fn auto_commits_the_judges_pick_and_a_fork_resolves_once() {
    let (ex, spec) = setup(
        &format!("strategy = \"auto\"\njudge_model = \"scripted:judge1\"\n{TESTED}"),
        &[verdict("good", 0.9)],
    );
    let doc = json(&run_spec(&spec));
    assert_eq!(doc["resolve"]["decision"]["kind"], "commit");
    assert_eq!(doc["winner"], "good");
    assert_eq!(ex.read("result.txt").as_deref(), Some("ok\n"));
    // evidence_v1: tests 1.0, agreement 0 (one split path), consistency 1, judge 0.9.
    let c = doc["resolve"]["judges"][0]["confidence"].as_f64().unwrap();
    assert!((c - 0.9 * (0.7 + 0.15)).abs() < 1e-9, "{c}");
    // A fork merges once: resolving again is refused and changes nothing.
    let id = doc["fork_id"].as_str().unwrap();
    let data = ex.data();
    let again = forkfleet(&["fork", "resolve", id, "--data", path_str(&data)]);
    assert_eq!(again.status.code(), Some(2), "{}", stderr(&again));
    assert!(
        stderr(&again).contains("already merged"),
        "{}",
        stderr(&again)
    );
    // The judge's spend shows in the fork's cost, apart from the branches'.
    let cost = json(&forkfleet(&[
        "fork",
        "cost",
        id,
        "--json",
        "--data",
        path_str(&data),
    ]));
    let judged = doc["resolve"]["judge_cost_usd"].as_f64().unwrap();
    assert!(judged > 0.0, "{doc}");
    assert_eq!(cost["judge_cost_usd"].as_f64(), Some(judged), "{cost}");
    let branches: f64 = cost["branches"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["spent_usd"].as_f64().unwrap())
        .sum();
    assert!(
        (cost["spent_usd"].as_f64().unwrap() - branches).abs() < 1e-12,
        "{cost}"
    );
    let text = forkfleet(&["fork", "cost", id, "--data", path_str(&data)]);
    assert!(
        String::from_utf8_lossy(&text.stdout).contains("judges (last resolve)"),
        "{}",
        String::from_utf8_lossy(&text.stdout)
    );
}

#[test]
fn auto_with_fallback_below_the_threshold_suggests_and_a_person_accepts() {
    let (ex, spec) = setup(
        &format!(
            "strategy = \"auto_with_fallback\"\nconfidence_threshold = 0.9\njudge_model = \"scripted:judge1\"\n{TESTED}"
        ),
        &[verdict("good", 0.8)],
    );
    let out = run_spec(&spec);
    let doc = json(&out);
    let decision = &doc["resolve"]["decision"];
    assert_eq!(decision["kind"], "defer", "{decision}");
    assert_eq!(decision["pick"], "good");
    assert!(decision["confidence"].as_f64().unwrap() < 0.9);
    assert!(
        ex.read("result.txt").is_none(),
        "a deferred pick merges nothing"
    );
    // The suggestion is accepted with a merge.
    let id = doc["fork_id"].as_str().unwrap();
    let merged = forkfleet(&[
        "fork",
        "merge",
        id,
        "--pick",
        "good",
        "--data",
        path_str(&ex.data()),
    ]);
    assert!(merged.status.success(), "{}", stderr(&merged));
    assert_eq!(ex.read("result.txt").as_deref(), Some("ok\n"));
}

#[test]
fn vote_majority_and_a_tie_to_the_most_confident() {
    // No test command: the judges may pick any branch.
    let (ex, spec) = setup(
        "strategy = \"vote\"\njudge_models = [\"scripted:judge1\", \"scripted:judge2\"]",
        &[verdict("bad", 0.6), verdict("good", 0.9)],
    );
    let doc = json(&run_spec(&spec));
    let resolve = &doc["resolve"];
    assert_eq!(resolve["judges"].as_array().unwrap().len(), 2);
    // One vote each: the tie goes to the more confident verdict.
    assert_eq!(resolve["decision"]["kind"], "commit");
    assert_eq!(resolve["decision"]["winner"], "good", "{resolve}");
    assert_eq!(ex.read("result.txt").as_deref(), Some("ok\n"));

    // A majority beats confidence.
    let (ex, spec) = setup(
        "strategy = \"vote\"\njudge_models = [\"scripted:judge1\", \"scripted:judge2\", \"scripted:judge3\"]",
        &[verdict("bad", 0.5), verdict("good", 0.99), verdict("bad", 0.5)],
    );
    let doc = json(&run_spec(&spec));
    assert_eq!(doc["resolve"]["decision"]["winner"], "bad");
    assert_eq!(ex.read("result.txt").as_deref(), Some("bad\n"));
}

#[test]
fn a_judge_naming_no_branch_is_asked_once_more_then_fails() {
    // Retried once: the second answer is valid.
    let (_ex, spec) = setup(
        "strategy = \"auto\"\njudge_model = \"scripted:judge1\"",
        &[format!("{}{}", verdict("nope", 0.9), verdict("good", 0.7))],
    );
    let doc = json(&run_spec(&spec));
    let judge = &doc["resolve"]["judges"][0]["run"];
    assert_eq!(judge["calls"], 2);
    assert_eq!(judge["verdict"]["winner"], "good");
    assert_eq!(doc["winner"], "good");

    // Twice wrong: an error naming the valid labels; nothing merged.
    let (ex, spec) = setup(
        "strategy = \"auto\"\njudge_model = \"scripted:judge1\"",
        &[format!(
            "{}{}",
            verdict("nope", 0.9),
            verdict("../../x", 0.9)
        )],
    );
    let out = run_spec(&spec);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(err.contains("no judge gave a valid verdict"), "{err}");
    assert!(err.contains("\"good\", \"bad\""), "{err}");
    let doc: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(doc["resolve"]["decision"]["kind"], "manual");
    assert_eq!(doc["state"], "settled");
    assert!(ex.read("result.txt").is_none());
}

#[test]
fn a_hanging_test_is_killed_and_zero_tests_give_no_signal() {
    let (_ex, spec) = setup(
        "strategy = \"manual\"\ntest_command = [\"python3\", \"-c\", \"import time; time.sleep(600)\"]\ntest_timeout_s = 1",
        &[],
    );
    let doc = json(&run_spec(&spec));
    for label in ["good", "bad"] {
        let t = test_of(&doc["resolve"], label);
        assert_eq!(t["outcome"]["kind"], "timed_out", "{t}");
        assert!(t["signal"]["pass_ratio"].is_null(), "{t}");
    }

    let (_ex, spec) = setup(
        "strategy = \"manual\"\ntest_command = [\"python3\", \"-c\", \"print('0 passed, 0 failed')\"]",
        &[],
    );
    let doc = json(&run_spec(&spec));
    let t = test_of(&doc["resolve"], "good");
    assert_eq!(t["outcome"]["kind"], "exited");
    assert!(
        t["signal"]["pass_ratio"].is_null(),
        "zero tests are no pass: {t}"
    );
}

#[test]
fn fork_resolve_overrides_the_strategy_and_checks_its_flags() {
    let (ex, spec) = setup(
        &format!("judge_model = \"scripted:judge1\"\n{TESTED}"),
        &[verdict("good", 0.95)],
    );
    // `manual` in the spec: `run` only tests.
    let doc = json(&run_spec(&spec));
    assert_eq!(doc["resolve"]["decision"]["kind"], "manual");
    let id = doc["fork_id"].as_str().unwrap().to_string();
    let data = ex.data();
    let bad = forkfleet(&[
        "fork",
        "resolve",
        &id,
        "--strategy",
        "best",
        "--data",
        path_str(&data),
    ]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(
        stderr(&bad).contains("valid: manual, auto"),
        "{}",
        stderr(&bad)
    );
    let text = forkfleet(&[
        "fork",
        "resolve",
        &id[..13],
        "--strategy",
        "auto",
        "--data",
        path_str(&data),
    ]);
    assert!(text.status.success(), "{}", stderr(&text));
    let out = String::from_utf8_lossy(&text.stdout);
    assert!(
        out.contains("judge scripted:judge1: picked `good`"),
        "{out}"
    );
    assert!(out.contains("decision (auto): merge `good`"), "{out}");
    assert_eq!(ex.read("result.txt").as_deref(), Some("ok\n"));
}

#[test]
fn resolve_on_a_cluster_runs_tests_and_the_judge_on_workers() {
    let cluster = Fleet::start(2, 4, Options::default());
    let (_ex, spec) = setup(
        &format!("strategy = \"auto\"\njudge_model = \"scripted:judge1\"\n{TESTED}"),
        &[verdict("good", 0.9)],
    );
    let id = cluster.create(&spec);
    cluster.watch(&id);
    // Judged without committing over the bus, and the verdict kept.
    let judged = cluster
        .client(&["fork", "resolve", &id, "--judge-only", "--json"])
        .json();
    assert_eq!(judged["no_commit"], true, "{judged}");
    assert!(judged["merge"].is_null());
    let kept = cluster.client(&["fork", "verdict", &id, "--json"]).json();
    assert_eq!(kept["decision"], judged["decision"]);
    let doc = cluster
        .client(&["fork", "resolve", &id, "--no-apply", "--json"])
        .json();
    assert_eq!(doc["decision"]["winner"], "good", "{doc}");
    assert_eq!(test_of(&doc, "good")["signal"]["pass_ratio"], 1.0);
    assert_eq!(test_of(&doc, "bad")["signal"]["pass_ratio"], 0.0);
    assert!(!test_of(&doc, "good")["worker"].as_str().unwrap().is_empty());
    assert_eq!(doc["merge"]["winner"], "good");
}

/// `fork resolve --judge-only` decides without merging and keeps the report, which `fork
/// verdict` shows again; `--judge-model` replaces the spec's judges (a scripted one must be
/// the spec's); without any judge the error says how to name one.
#[test]
fn judge_only_keeps_the_verdict_and_judge_model_overrides_the_spec() {
    let top = format!(
        "strategy = \"vote\"\njudge_models = [\"scripted:judge1\", \"scripted:judge2\"]\n{TESTED}"
    );
    let (ex, spec) = setup(&top, &[verdict("good", 0.9), verdict("good", 0.8)]);
    let data = path_str(&ex.data()).to_string();
    let created = forkfleet(&["fork", "create", path_str(&spec), "--data", &data]);
    assert!(created.status.success(), "{}", stderr(&created));
    let fork = String::from_utf8_lossy(&created.stdout).trim().to_string();

    let never = forkfleet(&["fork", "verdict", &fork, "--data", &data]);
    assert_eq!(never.status.code(), Some(2));
    assert!(
        stderr(&never).contains("was never resolved"),
        "{}",
        stderr(&never)
    );

    let judged = json(&forkfleet(&[
        "fork",
        "resolve",
        &fork,
        "--judge-only",
        "--json",
        "--data",
        &data,
    ]));
    assert_eq!(judged["decision"]["kind"], "commit", "{judged}");
    assert_eq!(judged["decision"]["winner"], "good");
    assert_eq!(judged["no_commit"], true);
    assert!(judged["merge"].is_null(), "{judged}");
    let shown = json(&forkfleet(&[
        "fork", "show", &fork, "--json", "--data", &data,
    ]));
    assert_eq!(shown["state"], "settled", "nothing merged: {shown}");
    assert!(ex.read("result.txt").is_none());

    let kept = json(&forkfleet(&[
        "fork", "verdict", &fork, "--json", "--data", &data,
    ]));
    assert_eq!(kept["decision"], judged["decision"]);
    assert_eq!(kept["judges"].as_array().map(Vec::len), Some(2));
    let text = forkfleet(&["fork", "verdict", &fork, "--data", &data]);
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains("not merged\n  merge it with: forkfleet fork merge"),
        "{text}"
    );

    let unknown = forkfleet(&[
        "fork",
        "resolve",
        &fork,
        "--judge-model",
        "scripted:nope",
        "--data",
        &data,
    ]);
    assert_eq!(unknown.status.code(), Some(2));
    assert!(
        stderr(&unknown)
            .contains("`scripted:nope` is a scripted model the fork's spec does not configure"),
        "{}",
        stderr(&unknown)
    );
    let merged = json(&forkfleet(&[
        "fork",
        "resolve",
        &fork,
        "--strategy",
        "auto",
        "--judge-model",
        "scripted:judge2",
        "--json",
        "--data",
        &data,
    ]));
    let judges = merged["judges"].as_array().unwrap();
    assert_eq!(judges.len(), 1, "{merged}");
    assert_eq!(judges[0]["run"]["model"], "scripted:judge2");
    assert_eq!(merged["merge"]["winner"], "good", "{merged}");
    assert_eq!(ex.read("result.txt").as_deref(), Some("ok\n"));

    // No judge anywhere: the error says how to name one.
    let (ex, spec) = setup(TESTED, &[]);
    let data = path_str(&ex.data()).to_string();
    let created = forkfleet(&["fork", "create", path_str(&spec), "--data", &data]);
    let fork = String::from_utf8_lossy(&created.stdout).trim().to_string();
    let none = forkfleet(&[
        "fork",
        "resolve",
        &fork,
        "--strategy",
        "auto",
        "--data",
        &data,
    ]);
    assert_eq!(none.status.code(), Some(2), "{}", stderr(&none));
    assert!(
        stderr(&none).contains("pass `--judge-model provider:name`"),
        "{}",
        stderr(&none)
    );
}

/// `auto_with_fallback` above its threshold, with a person at the terminal: the acceptance
/// step asks before merging; `d` shows the diff, `o` picks another branch, which is merged.
#[test]
fn the_acceptance_step_asks_before_merging_and_another_branch_can_be_picked() {
    let top = format!(
        "strategy = \"auto_with_fallback\"\nconfidence_threshold = 0.1\njudge_model = \"scripted:judge1\"\n{TESTED}"
    );
    let (ex, spec) = setup(&top, &[verdict("good", 0.95)]);
    let data = path_str(&ex.data()).to_string();
    let created = forkfleet(&["fork", "create", path_str(&spec), "--data", &data]);
    assert!(created.status.success(), "{}", stderr(&created));
    let fork = String::from_utf8_lossy(&created.stdout).trim().to_string();
    let tmux = super::harness::Tmux::start(&format!(
        "env RUST_LOG=warn {} fork resolve {fork} --data {data}; echo RESOLVE-EXIT-$?; sleep 600",
        env!("CARGO_BIN_EXE_forkfleet")
    ));
    let prompt = "merge `good`? [enter] accept";
    tmux.wait_for("the acceptance step", |s| s.contains(prompt));
    tmux.type_line("d");
    let screen = tmux.wait_for("the diff, then the question again", |s| {
        s.matches(prompt).count() == 2
    });
    assert!(screen.contains("result.txt"), "{screen}");
    tmux.type_line("o");
    tmux.wait_for("the branch question", |s| {
        s.contains("branch to merge (good, bad):")
    });
    tmux.type_line("bad");
    let screen = tmux.wait_for("the end", |s| s.contains("RESOLVE-EXIT-"));
    assert!(screen.contains("RESOLVE-EXIT-0"), "{screen}");
    assert!(screen.contains("merged `bad`"), "{screen}");
    assert_eq!(ex.read("result.txt").as_deref(), Some("bad\n"));
    let shown = json(&forkfleet(&[
        "fork", "show", &fork, "--json", "--data", &data,
    ]));
    assert_eq!(shown["winner"], "bad");
}
