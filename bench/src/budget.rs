//! `forkfleet bench budget`: the peer harness's aggregate-cap table
//! (`../shared/peers/pydantic_deep_bench.py --only budget_agg`) on forkfleet.
//!
//! The work: N branches (100), branch b makes `1 + b % 10` `write_file` calls and then
//! answers (so 2 to 11 model calls), every call 1,000 input and 200 output tokens priced
//! like gpt-4o-mini: $0.00027 a call, $0.1755 for the whole fork uncapped. Rows: caps at
//! 10%, 25% and 50% of that, and 25% with every branch equal (10 writes each), each in
//! strict and in best-effort mode.
//!
//! Per row it reports:
//! - **true spend / cap**: the calls the scripted model completed, read from its usage log
//!   (`FORKFLEET_SCRIPTED_USAGE_LOG`, written by the model itself on every worker), priced.
//!   This is what a provider would bill, independent of what forkfleet tracked.
//! - **tracked / cap**: the coordinator's ledger (`fork cost`).
//! - **end states** and **stop latency**: from the moment a cap was found crossed (the first
//!   refused reservation, or the usage report that crossed it) to the last branch seen
//!   stopped by the coordinator.
//!
//! Each row is its own fork, on the same system: with `--bus nats` (the default) its own
//! nats-server, the coordinator in this process and `--workers` worker processes; with
//! `--bus local` the embedded system. Every row's model has its own name, so the usage log
//! tells the rows apart.
//!
//! `--model streamed` plays the same work on a real provider instead: a local
//! OpenAI-compatible server in the bench process ([`super::stream_model`]) streams every
//! answer over its latency and bills what it generates (the input once a call starts
//! streaming, the output chunk by chunk), so a cancelled or cut call is billed what it
//! got: that bill is the true spend. Its calls are capped at 256 output tokens (the
//! answers are 200), so a strict reservation is not the default cap's 4,096. A fifth case
//! caps each branch (50% of its own uncapped spend) instead of the fork: in best-effort
//! mode the worker cuts a streamed answer mid-stream at the branch's cap (ADR 26).

use super::cluster::{settle, Cluster};
use super::{file_for, peak_rss_mb, seed_workspace, BenchBus, BENCH_MODEL};
use anyhow::Context;
use clap::Args;
use forkfleet_client::workspace as ws;
use forkfleet_client::{ApiClient, Client};
use forkfleet_node::embedded::{Embedded, EmbeddedOptions};
use forkfleet_shared::blob::BlobHash;
use forkfleet_shared::budget::{BudgetMode, BudgetPolicy};
use forkfleet_shared::flush::ConflictPolicy;
use forkfleet_shared::pricing::Price;
use forkfleet_shared::script::{Script, ScriptDefaults, ScriptToolCall, ScriptTurn, ScriptUsage};
use forkfleet_shared::spec::{BranchPlan, ForkPlan, Limits, ModelPlan};
use forkfleet_shared::state::BranchState;
use forkfleet_worker::provider::scripted::USAGE_LOG_ENV;
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

const PRICE: Price = Price {
    input_per_mtok: 0.15,
    output_per_mtok: 0.60,
    cached_per_mtok: None,
    cache_write_per_mtok: None,
};

#[derive(Debug, Args)]
pub struct BudgetArgs {
    /// Where the system runs: `nats` (its own nats-server and `--workers` worker
    /// processes; needs nats-server, see scripts/setup) or `local` (embedded).
    #[arg(long, value_enum, default_value_t = BenchBus::Nats)]
    pub bus: BenchBus,
    /// Branches per fork.
    #[arg(long, default_value_t = 100)]
    pub branches: usize,
    /// Workers: worker processes with `--bus nats`, in-process with `--bus local`.
    #[arg(long, default_value_t = 3)]
    pub workers: usize,
    /// Branches each worker runs at once (the default lets every branch run at once).
    #[arg(long, default_value_t = 34)]
    pub concurrency: usize,
    /// The scripted model's shortest call, in milliseconds.
    #[arg(long, default_value_t = 200)]
    pub latency_ms: u64,
    /// Each call takes up to this much longer (fixed per branch and turn, spread evenly).
    #[arg(long, default_value_t = 400)]
    pub jitter_ms: u64,
    /// Give up on a row after this many seconds.
    #[arg(long, default_value_t = 300)]
    pub timeout_s: u64,
    /// Print one JSON object per row.
    #[arg(long)]
    pub json: bool,
    /// Keep the bench's directory (server store, run store, worker logs, usage log) and
    /// print where it is.
    #[arg(long)]
    pub keep: bool,
    /// `scripted` (the scripted model, answers whole) or `streamed` (an OpenAI-compatible
    /// server streaming every answer, billing what it generates).
    #[arg(long, value_enum, default_value_t = BenchModel::Scripted)]
    pub model: BenchModel,
}

/// The model the rows run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BenchModel {
    Scripted,
    Streamed,
}

/// The streamed model's name in the workers' catalogue.
const STREAMED_MODEL: &str = "openai:bench-stream";

/// One row of the table.
#[derive(Debug, Clone, Serialize)]
pub struct BudgetRow {
    /// `strict` or `best_effort`.
    pub mode: &'static str,
    /// Whether stopped branches abandoned their calls in flight (strict: no, unless asked;
    /// best effort: yes).
    pub cancel_in_flight: bool,
    /// The fork's cap as a fraction of the uncapped spend.
    pub cap_fraction: f64,
    /// Every branch makes the same calls (10 writes and an answer).
    pub equal_branches: bool,
    /// The cap is on each branch (its fraction of the branch's uncapped spend), not on the
    /// fork.
    #[serde(default)]
    pub branch_caps: bool,
    /// `scripted` or `streamed`.
    pub model: &'static str,
    pub bus: &'static str,
    pub branches: usize,
    pub latency_ms: u64,
    pub jitter_ms: u64,
    pub uncapped_usd: f64,
    pub cap_usd: f64,
    /// What the model billed: its completed calls, priced.
    pub true_spend_usd: f64,
    /// What the coordinator tracked.
    pub tracked_usd: f64,
    pub true_spend_over_cap: f64,
    pub tracked_over_cap: f64,
    /// Calls the model completed.
    pub calls: usize,
    pub states: BTreeMap<String, usize>,
    /// From the cap found crossed to the last branch seen stopped, in milliseconds (none
    /// when the cap was never reached).
    pub stop_latency_ms: Option<f64>,
    /// From the fork request to every branch stopped.
    pub wall_s: f64,
}

/// The rows: (cap fraction, equal branches, caps on each branch), the peer's four first.
const CASES: [(f64, bool, bool); 5] = [
    (0.10, false, false),
    (0.25, false, false),
    (0.50, false, false),
    (0.25, true, false),
    (0.50, false, true),
];

pub async fn cmd_budget(args: BudgetArgs) -> anyhow::Result<()> {
    let rows = run(&args).await?;
    if args.json {
        for row in &rows {
            println!("{}", serde_json::to_string(row)?);
        }
        return Ok(());
    }
    let mut out = String::new();
    let _ = writeln!(
        out,
        "aggregate cap, N={} ({} model, {} bus, {} workers x {}, calls of {} to {} ms, uncapped ${:.4})",
        args.branches,
        rows.first().map_or("scripted", |r| r.model),
        args.bus.as_str(),
        args.workers,
        args.concurrency,
        args.latency_ms,
        args.latency_ms + args.jitter_ms,
        rows.first().map_or(0.0, |r| r.uncapped_usd)
    );
    let _ = writeln!(
        out,
        "  {:<20} {:<12} {:>10} {:>11} {:>8}  end states",
        "mode", "cap", "true/cap", "tracked/cap", "stop ms"
    );
    for r in &rows {
        let cap = format!(
            "{:.0}%{}{}",
            r.cap_fraction * 100.0,
            if r.equal_branches { " equal" } else { "" },
            if r.branch_caps { " per branch" } else { "" }
        );
        let stop = r
            .stop_latency_ms
            .map_or_else(|| "-".to_string(), |ms| format!("{ms:.1}"));
        let states: Vec<String> = r.states.iter().map(|(s, n)| format!("{n} {s}")).collect();
        let mode = if r.cancel_in_flight == (r.mode == "best_effort") {
            r.mode.to_string()
        } else if r.cancel_in_flight {
            format!("{} (cancel)", r.mode)
        } else {
            format!("{} (finish)", r.mode)
        };
        let _ = writeln!(
            out,
            "  {:<20} {:<12} {:>10.3} {:>11.3} {:>8}  {}",
            mode,
            cap,
            r.true_spend_over_cap,
            r.tracked_over_cap,
            stop,
            states.join(", ")
        );
    }
    print!("{out}");
    Ok(())
}

/// Every row, strict first.
pub async fn run(args: &BudgetArgs) -> anyhow::Result<Vec<BudgetRow>> {
    let mut tmp = tempfile::Builder::new()
        .prefix("forkfleet-bench-budget-")
        .tempdir()
        .context("temporary directory")?;
    if args.keep {
        tmp.disable_cleanup(true);
        eprintln!("bench: files kept in {}", tmp.path().display());
    }
    let workspace = tmp.path().join("workspace");
    seed_workspace(&workspace, 10)?;
    let log = tmp.path().join("usage.jsonl");
    let log_str = log.display().to_string();
    // The streamed model's server, and the workers' catalogue entry for it.
    let streamed = match args.model {
        BenchModel::Scripted => None,
        BenchModel::Streamed => {
            Some(super::stream_model::start(args.latency_ms, args.jitter_ms).await?)
        }
    };
    let catalogue =
        streamed
            .as_ref()
            .map(|(_, url, _)| forkfleet_shared::catalogue::ModelCatalogue {
                models: BTreeMap::from([(
                    STREAMED_MODEL.to_string(),
                    forkfleet_shared::catalogue::CatalogueModel {
                        base_url: Some(url.clone()),
                        ..Default::default()
                    },
                )]),
                allowed_hosts: Vec::new(),
            });
    let model = streamed.as_ref().map(|(m, _, _)| m.clone());
    let measured = match args.bus {
        BenchBus::Nats => {
            let mut env = vec![(USAGE_LOG_ENV.to_string(), log_str)];
            if let Some((_, url, _)) = &streamed {
                env.push((
                    "FORKFLEET_MODELS".to_string(),
                    format!("\"{STREAMED_MODEL}\" = {{ base_url = \"{url}\" }}"),
                ));
            }
            let cluster =
                Cluster::start("budget", tmp.path(), args.workers, args.concurrency, &env).await?;
            let measured = match cluster.client() {
                Ok(client) => rows(client, &workspace, &log, args, model.as_deref()).await,
                Err(e) => Err(e),
            };
            let mut stopped = cluster.stop().await;
            settle(measured, &mut stopped)
        }
        BenchBus::Local => {
            let system = Embedded::start_with_usage_log(
                &tmp.path().join("data"),
                EmbeddedOptions {
                    workers: args.workers.max(1),
                    concurrency: args.concurrency.max(1),
                    requeue_unfinished: false,
                    catalogue: std::sync::Arc::new(catalogue.unwrap_or_default()),
                    ..EmbeddedOptions::default()
                },
                Some(log.clone()),
            )
            .await?;
            let measured = rows(&system.client(), &workspace, &log, args, model.as_deref()).await;
            system.shutdown().await?;
            measured
        }
    };
    if let Some((_, _, server)) = streamed {
        server.abort();
    }
    measured
}

async fn rows(
    coord: &Client,
    workspace: &Path,
    log: &Path,
    args: &BudgetArgs,
    streamed: Option<&super::stream_model::StreamModel>,
) -> anyhow::Result<Vec<BudgetRow>> {
    let mut out = Vec::new();
    // Strict as configured by default (calls in flight finish), strict cancelling them,
    // and best effort (which cancels them by default).
    let modes = [
        (BudgetMode::Strict, false),
        (BudgetMode::Strict, true),
        (BudgetMode::BestEffort, true),
    ];
    for (m, (mode, cancel)) in modes.into_iter().enumerate() {
        for (i, (fraction, equal, branch_caps)) in CASES.into_iter().enumerate() {
            let model = match streamed {
                None => format!("{BENCH_MODEL}-{m}-{i}"),
                Some(_) => STREAMED_MODEL.to_string(),
            };
            let policy = BudgetPolicy {
                mode,
                cancel_in_flight: Some(cancel),
                ..BudgetPolicy::default()
            };
            let case = Case {
                fraction,
                equal,
                branch_caps,
            };
            let row = run_row(coord, workspace, log, args, &model, policy, case, streamed).await?;
            tracing::info!(?row, "bench.budget row");
            out.push(row);
        }
    }
    tracing::info!(peak_rss_mb = peak_rss_mb(), "bench.budget done");
    Ok(out)
}

/// Writes branch `b` makes.
fn writes(b: usize, equal: bool) -> usize {
    if equal {
        10
    } else {
        1 + b % 10
    }
}

fn script(n: usize, equal: bool, latency_ms: u64, jitter_ms: u64) -> Script {
    let usage = ScriptUsage {
        input_tokens: super::INPUT_TOKENS,
        output_tokens: super::OUTPUT_TOKENS,
        cached_tokens: 0,
        cache_write_tokens: 0,
        reasoning_tokens: 0,
    };
    let mut turns = BTreeMap::new();
    for b in 0..n {
        let k = writes(b, equal);
        let mut t: Vec<ScriptTurn> = (0..k)
            .map(|j| {
                let (path, content) = file_for(b, j, 3);
                ScriptTurn {
                    tool_calls: vec![ScriptToolCall {
                        name: "write_file".into(),
                        args: serde_json::json!({"path": path, "content": content}),
                    }],
                    ..ScriptTurn::default()
                }
            })
            .collect();
        t.push(ScriptTurn {
            text: Some(format!("branch {b} finished after {k} calls")),
            ..ScriptTurn::default()
        });
        turns.insert(format!("b{b}"), t);
    }
    Script {
        defaults: ScriptDefaults {
            usage: Some(usage),
            latency_ms,
            latency_jitter_ms: jitter_ms,
        },
        turns,
    }
}

/// One row's cap.
#[derive(Clone, Copy)]
struct Case {
    fraction: f64,
    equal: bool,
    /// On each branch instead of the fork.
    branch_caps: bool,
}

#[allow(clippy::too_many_arguments)]
async fn run_row(
    coord: &Client,
    workspace: &Path,
    log: &Path,
    args: &BudgetArgs,
    model: &str,
    policy: BudgetPolicy,
    case: Case,
    streamed: Option<&super::stream_model::StreamModel>,
) -> anyhow::Result<BudgetRow> {
    let Case {
        fraction,
        equal,
        branch_caps,
    } = case;
    let mode = policy.mode;
    let cancel_in_flight = policy.cancels_in_flight();
    let n = args.branches.max(1);
    let per_call = PRICE.cost(&forkfleet_shared::event::Usage {
        input_tokens: super::INPUT_TOKENS,
        output_tokens: super::OUTPUT_TOKENS,
        cached_tokens: 0,
        cache_write_tokens: 0,
        reasoning_tokens: 0,
    });
    let calls: usize = (0..n).map(|b| writes(b, equal) + 1).sum();
    let uncapped = calls as f64 * per_call;
    let cap = uncapped * fraction;

    let script = script(n, equal, args.latency_ms, args.jitter_ms);
    let text = bytes::Bytes::from(toml::to_string(&script)?.into_bytes());
    let hash = BlobHash::of(&text);
    let blobs = coord.blobs();
    let (_, upload) = ws::upload_workspace(
        blobs.as_ref(),
        workspace,
        &forkfleet_shared::scan::ScanOptions::names_only(&[]),
        [(hash, text)],
    )
    .await?;
    let max_turns = 16;
    let plan = ForkPlan {
        name: None,
        approval: None,
        goal: format!("bench budget {} {fraction}", mode.as_str()),
        system_prompt: None,
        history: Vec::new(),
        model: model.to_string(),
        limits: Limits {
            max_branches: n,
            max_turns,
            // A real model's reservation is bounded by the output cap: the answers are 200.
            max_output_tokens: if streamed.is_some() {
                256
            } else {
                Limits::default().max_output_tokens
            },
            ..Limits::default()
        },
        conflict_policy: ConflictPolicy::KeepParent,
        aggregate_budget_usd: (!branch_caps).then_some(cap),
        budget: policy,
        resolve: Default::default(),
        models: BTreeMap::from([(
            model.to_string(),
            ModelPlan {
                price: Some(PRICE),
                script: streamed.is_none().then_some(hash),
                endpoint: None,
            },
        )]),
        branches: (0..n)
            .map(|b| BranchPlan {
                approval: None,
                label: format!("b{b}"),
                steer: format!("BENCH b={b} k={} tool=write_file", writes(b, equal)),
                model: model.to_string(),
                budget_usd: branch_caps
                    .then(|| (writes(b, equal) + 1) as f64 * per_call * fraction),
                extra_instructions: None,
                max_turns,
                max_output_tokens: None,
                temperature: None,
            })
            .collect(),
        tools: Default::default(),
        solo: false,
    };
    let super::Settled { view, wall_s, .. } =
        super::settled_fork(coord, plan, upload.snapshot, workspace, args.timeout_s).await?;
    let cost = coord.fork_cost(view.fork_id).await?;

    let (true_calls, true_spend) = match streamed {
        None => {
            let calls = completed_calls(log, model)?;
            (calls, calls as f64 * per_call)
        }
        Some(server) => {
            let billed = server.take();
            let usage =
                forkfleet_shared::event::Usage::tokens(billed.input_tokens, billed.output_tokens);
            (billed.completed as usize, PRICE.cost(&usage))
        }
    };
    let mut states: BTreeMap<String, usize> = BTreeMap::new();
    for b in &cost.branches {
        *states.entry(b.state.as_str().to_string()).or_default() += 1;
    }
    let stopped_last = cost
        .branches
        .iter()
        .filter(|b| {
            matches!(
                b.state,
                BranchState::BudgetExhausted
                    | BranchState::AggregateBudgetExhausted
                    | BranchState::Paused
            )
        })
        .filter_map(|b| b.stopped_at_ms)
        .max();
    let stop_latency_ms = match (cost.crossed_at_ms, stopped_last) {
        (Some(crossed), Some(last)) => Some(last.saturating_sub(crossed) as f64),
        _ => None,
    };
    Ok(BudgetRow {
        mode: mode.as_str(),
        cancel_in_flight,
        cap_fraction: fraction,
        equal_branches: equal,
        branch_caps,
        model: if streamed.is_some() {
            "streamed"
        } else {
            "scripted"
        },
        bus: args.bus.as_str(),
        branches: n,
        latency_ms: args.latency_ms,
        jitter_ms: args.jitter_ms,
        uncapped_usd: uncapped,
        cap_usd: cap,
        true_spend_usd: true_spend,
        tracked_usd: cost.spent_usd,
        true_spend_over_cap: true_spend / cap,
        tracked_over_cap: cost.spent_usd / cap,
        calls: true_calls,
        states,
        stop_latency_ms,
        wall_s,
    })
}

/// Calls of `model` in the scripted model's usage log.
fn completed_calls(log: &Path, model: &str) -> anyhow::Result<usize> {
    let text = match std::fs::read_to_string(log) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(e).with_context(|| format!("cannot read `{}`", log.display())),
    };
    let mut n = 0;
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let v: serde_json::Value = serde_json::from_str(line)
            .with_context(|| format!("a line of `{}` is not JSON: {line}", log.display()))?;
        if v["model"] == model {
            n += 1;
        }
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_peer_s_work() {
        let calls: usize = (0..100).map(|b| writes(b, false) + 1).sum();
        assert_eq!(calls, 650);
        let per_call = PRICE.cost(&forkfleet_shared::event::Usage {
            input_tokens: 1000,
            output_tokens: 200,
            cached_tokens: 0,
            cache_write_tokens: 0,
            reasoning_tokens: 0,
        });
        assert!((calls as f64 * per_call - 0.1755).abs() < 1e-9);
        let s = script(3, true, 5, 0);
        assert_eq!(s.turns["b2"].len(), 11);
    }
}
