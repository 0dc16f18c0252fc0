//! Budgets on a cluster of real processes: a nats-server, a coordinator and three worker
//! processes running 100 branches at once. The workers' scripted model logs every call it
//! completes (`FORKFLEET_SCRIPTED_USAGE_LOG`): that log is the true spend, which the caps
//! are checked against, independently of what the coordinator tracked.

use super::fleet::{Fleet, Options, POLL, SHORT_ACK_WAIT_S};
use super::harness::{path_str, Example};
use serde_json::Value;
use std::collections::BTreeMap;
use std::time::Instant;

/// The test model's price: 1,000 input and 200 output tokens a call, priced like
/// gpt-4o-mini, $0.00027 a call.
const PRICE: &str = "price = { input_per_mtok = 0.15, output_per_mtok = 0.60 }";
const PER_CALL: f64 = 0.00027;
/// Calls per branch: five writes and an answer.
const CALLS: usize = 6;

fn script(latency_ms: u64) -> String {
    format!(
        r#"
[defaults]
latency_ms = {latency_ms}
usage = {{ input_tokens = 1000, output_tokens = 200 }}

[[turns."*"]]
tool_calls = [{{ name = "write_file", args = {{ path = "out/{{label}}/{{repeat}}.txt", content = "{{label}} {{repeat}}\n" }} }}]
repeat = 5

[[turns."*"]]
text = "done"
"#
    )
}

struct Run {
    fleet: Fleet,
    ex: Example,
    log: std::path::PathBuf,
}

impl Run {
    fn start(workers: usize, concurrency: usize) -> Run {
        let ex = Example::quickstart();
        let log = ex.dir.path().join("usage.jsonl");
        let fleet = Fleet::start(
            workers,
            concurrency,
            Options {
                ack_wait_s: Some(SHORT_ACK_WAIT_S),
                env: &[("FORKFLEET_SCRIPTED_USAGE_LOG", path_str(&log))],
                ..Options::default()
            },
        );
        Run { fleet, ex, log }
    }

    /// A spec named `name` of `n` branches; `top` adds fork-level keys, `branch(i)` keys of
    /// branch i.
    fn spec(
        &self,
        name: &str,
        n: usize,
        latency_ms: u64,
        top: &str,
        branch: impl Fn(usize) -> String,
    ) -> std::path::PathBuf {
        let dir = self.ex.dir.path();
        std::fs::write(dir.join(format!("{name}.script.toml")), script(latency_ms)).unwrap();
        let mut text = format!(
            "goal = \"budget\"\nworkspace = \"workspace\"\nmodel = \"scripted:{name}\"\nmax_branches = {n}\n{top}\n\
             [models.\"scripted:{name}\"]\nscript = \"{name}.script.toml\"\n{PRICE}\n"
        );
        for i in 0..n {
            text.push_str(&format!("[[branches]]\nlabel = \"b{i}\"\n{}\n", branch(i)));
        }
        let path = dir.join(format!("{name}.toml"));
        std::fs::write(&path, text).unwrap();
        path
    }

    /// The calls the model completed for `model`, by branch label: their times.
    fn calls(&self, model: &str) -> BTreeMap<String, Vec<u64>> {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let mut out: BTreeMap<String, Vec<u64>> = BTreeMap::new();
        for line in text.lines() {
            let v: Value = serde_json::from_str(line).unwrap();
            if v["model"] == model {
                out.entry(v["label"].as_str().unwrap().to_string())
                    .or_default()
                    .push(v["at_ms"].as_u64().unwrap());
            }
        }
        out
    }

    fn true_spend(&self, model: &str) -> f64 {
        self.calls(model).values().map(Vec::len).sum::<usize>() as f64 * PER_CALL
    }

    fn cost(&self, id: &str) -> Value {
        self.fleet.client(&["fork", "cost", id, "--json"]).json()
    }

    /// Until every branch is terminal or paused (bounded); the cost report then.
    fn wait_quiet(&self, id: &str) -> Value {
        let deadline = Instant::now() + std::time::Duration::from_secs(90);
        loop {
            let cost = self.cost(id);
            let quiet = cost["branches"]
                .as_array()
                .unwrap()
                .iter()
                .all(|b| !matches!(b["state"].as_str(), Some("pending") | Some("running")));
            if quiet {
                return cost;
            }
            assert!(
                Instant::now() < deadline,
                "the fork did not settle\n{}",
                self.fleet.logs()
            );
            std::thread::sleep(POLL);
        }
    }
}

fn states(cost: &Value) -> BTreeMap<String, usize> {
    let mut out = BTreeMap::new();
    for b in cost["branches"].as_array().unwrap() {
        *out.entry(b["state"].as_str().unwrap().to_string())
            .or_default() += 1;
    }
    out
}

#[test]
fn strict_caps_are_never_overshot_by_true_spend() {
    let run = Run::start(3, 34);
    let n = 100;
    let uncapped = (n * CALLS) as f64 * PER_CALL;
    let cap = uncapped * 0.5;
    // Even branches may make two calls; the fork as a whole half of what all would.
    let spec = run.spec(
        "strict",
        n,
        20,
        &format!("aggregate_budget_usd = {cap}"),
        |i| {
            if i % 2 == 0 {
                format!("budget_usd = {}", 2.5 * PER_CALL)
            } else {
                String::new()
            }
        },
    );
    let id = run.fleet.create(&spec);
    let cost = run.wait_quiet(&id);
    let truth = run.true_spend("scripted:strict");
    assert!(
        truth <= cap + 1e-12,
        "true spend {truth} over the cap {cap}"
    );
    for (label, calls) in run.calls("scripted:strict") {
        let i: usize = label[1..].parse().unwrap();
        if i.is_multiple_of(2) {
            assert!(
                calls.len() <= 2,
                "{label} made {} calls over its cap",
                calls.len()
            );
        }
    }
    let s = states(&cost);
    assert!(s.get("budget_exhausted").copied().unwrap_or(0) > 0, "{s:?}");
    assert!(
        s.get("aggregate_budget_exhausted").copied().unwrap_or(0) > 0,
        "{s:?}"
    );
    assert_eq!(cost["reserved_usd"].as_f64(), Some(0.0), "{cost}");
    let tracked = cost["spent_usd"].as_f64().unwrap();
    assert!(
        (tracked - truth).abs() < 1e-9,
        "tracked {tracked}, true {truth}"
    );
    assert!(cost["crossed_at_ms"].as_u64().is_some());
    // Stopped branches keep their work and can win.
    let merged = run.fleet.client(&["fork", "merge", &id, "--pick", "b0"]);
    assert_eq!(merged.code, Some(0), "{}", merged.stderr);
}

#[test]
fn best_effort_stops_every_branch_within_one_call_of_the_crossing() {
    let run = Run::start(3, 34);
    let n = 100;
    let cap = (n * CALLS) as f64 * PER_CALL * 0.1;
    let spec = run.spec(
        "besteffort",
        n,
        100,
        &format!("aggregate_budget_usd = {cap}\nbudget_mode = \"best_effort\""),
        |_| String::new(),
    );
    let id = run.fleet.create(&spec);
    let cost = run.wait_quiet(&id);
    let crossed = cost["crossed_at_ms"].as_u64().expect("the cap was crossed");
    let calls = run.calls("scripted:besteffort");
    for (label, times) in &calls {
        let after = times.iter().filter(|t| **t > crossed).count();
        assert!(
            after <= 1,
            "{label} completed {after} calls after the crossing"
        );
    }
    let s = states(&cost);
    assert_eq!(
        s.get("aggregate_budget_exhausted").copied().unwrap_or(0)
            + s.get("done").copied().unwrap_or(0),
        n,
        "{s:?}"
    );
    let truth = run.true_spend("scripted:besteffort");
    assert!(
        truth <= cap + n as f64 * PER_CALL,
        "true spend {truth}, cap {cap}"
    );
    let tracked = cost["spent_usd"].as_f64().unwrap();
    assert!(
        tracked >= cap,
        "the crossing was tracked: {tracked} < {cap}"
    );
}

#[test]
fn paused_branches_resume_after_a_top_up() {
    let run = Run::start(3, 4);
    let n = 10;
    let cap = 2.0 * PER_CALL * n as f64;
    let spec = run.spec(
        "pause",
        n,
        20,
        &format!("aggregate_budget_usd = {cap}\non_exhausted = \"pause\""),
        |_| String::new(),
    );
    let id = run.fleet.create(&spec);
    let cost = run.wait_quiet(&id);
    let s = states(&cost);
    assert!(s.get("paused").copied().unwrap_or(0) > 0, "{s:?}");
    assert!(run.true_spend("scripted:pause") <= cap + 1e-12);
    // Room for every branch to finish.
    let topped = run
        .fleet
        .client(&["fork", "topup", &id, "--usd", "1.0", "--json"]);
    assert_eq!(topped.code, Some(0), "{}", topped.stderr);
    let view = run.fleet.watch(&id);
    for b in view["branches"].as_array().unwrap() {
        assert_eq!(b["state"], "done", "{b}\n{}", run.fleet.logs());
    }
    // Every branch made its calls once: work kept across the pause.
    for (label, times) in run.calls("scripted:pause") {
        assert_eq!(times.len(), CALLS, "{label}");
    }
    let cost = run.cost(&id);
    assert_eq!(cost["reserved_usd"].as_f64(), Some(0.0));
}

#[test]
fn a_killed_worker_holds_only_its_own_reservations() {
    let mut run = Run::start(3, 8);
    let n = 60;
    let cap = (n * CALLS) as f64 * PER_CALL * 0.6;
    let spec = run.spec(
        "killed",
        n,
        150,
        &format!("aggregate_budget_usd = {cap}"),
        |_| String::new(),
    );
    let id = run.fleet.create(&spec);
    run.fleet.wait_progress(&id, 12);
    run.fleet.workers[0].kill();
    let cost = run.wait_quiet(&id);
    // What the killed worker had reserved for its calls in flight stays held until it
    // expires (a superseded attempt may still be making its call, ADR 18): at most one
    // reservation per branch it ran (8), none of any other branch.
    let holding = cost["branches"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|b| b["reserved_usd"].as_f64() != Some(0.0))
        .count();
    assert!(holding <= 8, "{holding} branches hold reservations: {cost}");
    let (spent, reserved) = (
        cost["spent_usd"].as_f64().unwrap(),
        cost["reserved_usd"].as_f64().unwrap(),
    );
    assert!(spent + reserved <= cap + 1e-12, "{cost}");
    let truth = run.true_spend("scripted:killed");
    assert!(
        truth <= cap + 1e-12,
        "true spend {truth} over the cap {cap}"
    );
}

/// A coordinator outage of 15 s under a strict fork cap: the workers wait for it (their
/// reservations asked again, their tasks' leases kept) instead of handing their tasks back
/// until the deliveries run out, and every branch finishes once it is back. The outage's
/// length is the fault itself, not a wait for something to happen.
#[test]
fn a_coordinator_outage_under_a_strict_cap_is_waited_out() {
    let mut run = Run::start(2, 4);
    let n = 6;
    let cap = (n * CALLS) as f64 * PER_CALL * 10.0;
    let spec = run.spec(
        "outage",
        n,
        300,
        &format!("aggregate_budget_usd = {cap}"),
        |_| String::new(),
    );
    let id = run.fleet.create(&spec);
    run.fleet.wait_progress(&id, 3);
    let status = run.fleet.coordinator.terminate();
    assert!(status.success(), "{status:?}\n{}", run.fleet.logs());
    std::thread::sleep(std::time::Duration::from_secs(15));
    run.fleet.coordinator = run.fleet.spawn_coordinator("coordinator-2");
    let cost = run.wait_quiet(&id);
    let states = states(&cost);
    assert_eq!(
        states.get("done"),
        Some(&n),
        "{states:?}\n{cost}\n{}",
        run.fleet.logs()
    );
    // No worker handed a task back for the outage.
    let logs = run.fleet.logs();
    assert!(
        logs.contains("the coordinator is unreachable: waiting for it"),
        "{logs}"
    );
    assert!(
        !logs.contains("delivered the maximum number of times"),
        "{logs}"
    );
}
