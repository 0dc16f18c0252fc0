//! # forkfleet-bench
//!
//! The benchmarks, out of the product's code: the whole-system ones `forkfleet bench ...`
//! runs ([`run`]), with the local servers they need, and the criterion micro-benchmarks
//! (`benches/`: `overlay`, `diff`, `wire`; `cargo bench -p forkfleet-bench`). They start
//! systems through `forkfleet-node`, as the binary does.
//!
//! ## Layout
//! - this file: `forkfleet bench fanout --branches N --writes K`, the peer harness's fan-out
//!   work (`../shared/peers/pydantic_deep_bench.py`): N branches, each makes K `write_file`
//!   calls and then answers. Write j of branch b goes, by (b + j) % 3, to a file every
//!   branch writes differently (`shared/split_j.txt`, seeded in the parent), a file only
//!   that branch writes (`unique/b<b>/f<j>.txt`), or a file every writer writes
//!   identically (`shared/agree_j.txt`). Every model call reports 1,000 input and 200
//!   output tokens, priced like gpt-4o-mini. Zero model latency. The script is JSON
//!   (`FORKFLEET_BENCH_SCRIPT=toml`: TOML, as older builds wrote it). Where it runs (`--bus`):
//!   `local` (the default), the embedded system in this process (the coordinator and
//!   `--workers` in-process workers on the local bus); `nats`, a cluster on this machine
//!   (`cluster`). Both run the same measurement (`run_fanout`) through a [`Client`].
//! - `cluster`: the bench's own `nats-server`, the coordinator (and its API) in this
//!   process on a NATS bus, `--workers` `forkfleet worker` processes, a client over
//!   request/reply.
//! - [`budget`]: `forkfleet bench budget`, the peer's aggregate-cap table.
//! - [`cache`]: `forkfleet bench cache`, what fork-aware prompt caching saves (with its
//!   local server billing a prompt cache as Anthropic does).
//! - [`workspace`]: `forkfleet bench workspace`, forks of a large real tree.
//! - [`stream`]: `forkfleet bench stream`, what a live 1,000-branch fork's Server-Sent
//!   Events stream sends through the HTTP API (the console's view of it).
//! - [`stream_model`]: a local OpenAI-compatible server that streams its answers.
//! - [`nats_server`]: the bench's `nats-server` child, killed on every exit path.

pub mod budget;
pub mod cache;
mod cluster;
pub mod nats_server;
pub mod stream;
pub mod stream_model;
pub mod workspace;

use anyhow::Context;
use clap::{Args, Subcommand, ValueEnum};
use forkfleet_client::workspace as ws;
use forkfleet_client::{ApiClient, Client};
use forkfleet_node::embedded::{Embedded, EmbeddedOptions};
use forkfleet_shared::api::{CreateFork, ForkView, ParentRun};
use forkfleet_shared::blob::BlobHash;
use forkfleet_shared::diff::DiffOptions;
use forkfleet_shared::flush::ConflictPolicy;
use forkfleet_shared::pricing::Price;
use forkfleet_shared::script::{Script, ScriptToolCall, ScriptTurn, ScriptUsage};
use forkfleet_shared::spec::{BranchPlan, ForkPlan, Limits, ModelPlan};
use forkfleet_shared::state::BranchState;
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;
use std::time::{Duration, Instant};

pub const BENCH_MODEL: &str = "scripted:bench";
pub const INPUT_TOKENS: u64 = 1000;
pub const OUTPUT_TOKENS: u64 = 200;

/// Where the bench runs the system.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BenchBus {
    /// The embedded system in this process (local bus, in-process workers).
    Local,
    /// A cluster on this machine: its own nats-server, the coordinator in this process,
    /// `--workers` worker processes.
    Nats,
}

impl BenchBus {
    pub fn as_str(self) -> &'static str {
        match self {
            BenchBus::Local => "local",
            BenchBus::Nats => "nats",
        }
    }
}

#[derive(Debug, Args)]
pub struct FanoutArgs {
    /// Where the system runs: `local` (embedded, in-process) or `nats` (its own
    /// nats-server and `--workers` worker processes; needs nats-server, see scripts/setup).
    #[arg(long, value_enum, default_value_t = BenchBus::Local)]
    pub bus: BenchBus,
    /// Branches (N).
    #[arg(long, default_value_t = 100)]
    pub branches: usize,
    /// write_file calls per branch (K).
    #[arg(long, default_value_t = 10)]
    pub writes: usize,
    /// Lines per written file.
    #[arg(long, default_value_t = 10)]
    pub lines: usize,
    /// Workers: in-process with `--bus local`, worker processes with `--bus nats`.
    #[arg(long, default_value_t = 2)]
    pub workers: usize,
    /// Branches each worker runs at once.
    #[arg(long, default_value_t = 64)]
    pub concurrency: usize,
    /// Give up after this many seconds.
    #[arg(long, default_value_t = 600)]
    pub timeout_s: u64,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// One fan-out measurement.
#[derive(Debug, Clone, Serialize)]
pub struct FanoutResult {
    /// `local` or `nats`.
    pub bus: &'static str,
    pub branches: usize,
    pub writes: usize,
    pub workers: usize,
    pub concurrency: usize,
    /// Uploading the workspace and the script (only what the store lacks), before the fork.
    pub upload_s: f64,
    /// From the fork request to every branch settled.
    pub wall_s: f64,
    /// The fork request alone (validation, branch runs, checkpoint, enqueue).
    pub fork_call_s: f64,
    /// The full diff report, unified diffs included.
    pub diff_s: f64,
    /// Merging branch b0: the coordinator's merge plus applying it to a directory.
    pub merge_s: f64,
    /// Peak RSS (VmHWM) of this process: with `--bus nats`, the coordinator (and the bench's
    /// client side: the diff report, the merge applied to a directory).
    pub peak_rss_mb: f64,
    /// `--bus nats`: the largest peak RSS (VmHWM) of the worker processes.
    pub worker_peak_rss_mb: Option<f64>,
    /// `--bus nats`: the peak RSS of each worker process.
    pub workers_peak_rss_mb: Vec<f64>,
    /// `--bus nats`: the peak RSS of the nats-server.
    pub nats_server_peak_rss_mb: Option<f64>,
    pub model_turns: u64,
    /// `--bus nats`: the median over branches of (the branch's time from its first event to
    /// its terminal status, by the workers' clocks at millisecond resolution) / its model
    /// turns: what a turn costs one branch, with the model's latency zero and the branch
    /// sharing the machine with every other one running. `--bus local`: the same as
    /// `aggregate_turn_ms` (the local bus has no event timestamps to read back).
    pub per_turn_ms: f64,
    /// `--bus nats`: the 90th percentile of the same.
    pub per_turn_ms_p90: Option<f64>,
    /// Wall time per model turn across the fork (`wall_s` / `model_turns`, all branches in
    /// parallel): the system's throughput cost of a turn.
    pub aggregate_turn_ms: f64,
    /// `--bus nats`: branch events the workers published (read back from the stream).
    pub events: Option<u64>,
    /// `--bus nats`: worker processes that did not exit within 10 s of SIGTERM (killed).
    pub workers_killed: Option<usize>,
    pub states: BTreeMap<String, usize>,
    pub total_cost_usd: f64,
    pub paths_touched: usize,
    pub split_paths: usize,
    pub unanimous_paths: usize,
    pub applied_paths: usize,
}

pub async fn cmd_fanout(args: FanoutArgs) -> anyhow::Result<()> {
    let result = match args.bus {
        BenchBus::Local => fanout(&args).await?,
        BenchBus::Nats => cluster::fanout(&args).await?,
    };
    if args.json {
        println!("{}", serde_json::to_string(&result)?);
    } else {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "fan-out N={} K={} ({} bus, {} workers x {})",
            result.branches, result.writes, result.bus, result.workers, result.concurrency
        );
        let _ = writeln!(
            out,
            "  upload                      {:>9.3} s",
            result.upload_s
        );
        let _ = writeln!(
            out,
            "  wall (fork to all settled)  {:>9.3} s",
            result.wall_s
        );
        let _ = writeln!(
            out,
            "  fork call                   {:>9.3} s",
            result.fork_call_s
        );
        let _ = writeln!(
            out,
            "  diff report                 {:>9.3} s",
            result.diff_s
        );
        let _ = writeln!(
            out,
            "  merge (store + directory)   {:>9.3} s",
            result.merge_s
        );
        let _ = writeln!(
            out,
            "  peak RSS                    {:>9.1} MB",
            result.peak_rss_mb
        );
        if let Some(w) = result.worker_peak_rss_mb {
            let _ = writeln!(out, "  peak RSS, largest worker    {w:>9.1} MB");
        }
        if let Some(n) = result.nats_server_peak_rss_mb {
            let _ = writeln!(out, "  peak RSS, nats-server       {n:>9.1} MB");
        }
        let _ = writeln!(
            out,
            "  model turns                 {:>9}",
            result.model_turns
        );
        if let Some(p90) = result.per_turn_ms_p90 {
            let _ = writeln!(
                out,
                "  per turn, one branch        {:>9.3} ms median, {p90:.3} ms p90",
                result.per_turn_ms
            );
        }
        let _ = writeln!(
            out,
            "  per turn, whole fork        {:>9.4} ms (wall / turns)",
            result.aggregate_turn_ms
        );
        if let Some(events) = result.events {
            let _ = writeln!(
                out,
                "  events                      {events:>9} ({:.0}/s over the wall time)",
                events as f64 / result.wall_s.max(1e-9)
            );
        }
        if let Some(killed) = result.workers_killed.filter(|k| *k > 0) {
            let _ = writeln!(out, "  workers killed after 10 s   {killed:>9}");
        }
        let _ = writeln!(out, "  states                      {:?}", result.states);
        let _ = writeln!(
            out,
            "  diff: {} paths, {} split, {} unanimous",
            result.paths_touched, result.split_paths, result.unanimous_paths
        );
        print!("{out}");
    }
    Ok(())
}

/// The environment variable that makes the fan-out's script TOML (`toml`), as builds
/// before JSON scripts wrote it, for a comparison that parses the same text.
pub const SCRIPT_FORMAT_ENV: &str = "FORKFLEET_BENCH_SCRIPT";

/// The fan-out script's text: JSON, as a program writes a large script (1,000 branches x
/// 10 writes is 11,000 turns), or TOML when [`SCRIPT_FORMAT_ENV`] says `toml`.
fn script_text(script: &Script) -> anyhow::Result<Vec<u8>> {
    Ok(match std::env::var(SCRIPT_FORMAT_ENV).as_deref() {
        Ok("toml") => toml::to_string(script)?.into_bytes(),
        Ok("json") | Err(std::env::VarError::NotPresent) => serde_json::to_vec(script)?,
        Ok(other) => anyhow::bail!("{SCRIPT_FORMAT_ENV}=`{other}`: give `toml` or `json`"),
        Err(e) => anyhow::bail!("{SCRIPT_FORMAT_ENV}: {e}"),
    })
}

/// The bench script: per branch label, K write turns then a final answer.
pub fn fanout_script(n: usize, k: usize, lines: usize) -> Script {
    let usage = Some(ScriptUsage {
        input_tokens: INPUT_TOKENS,
        output_tokens: OUTPUT_TOKENS,
        cached_tokens: 0,
        cache_write_tokens: 0,
        reasoning_tokens: 0,
    });
    let mut turns = BTreeMap::new();
    for b in 0..n {
        let mut t = Vec::with_capacity(k + 1);
        for j in 0..k {
            let (path, content) = file_for(b, j, lines);
            t.push(ScriptTurn {
                tool_calls: vec![ScriptToolCall {
                    name: "write_file".into(),
                    args: serde_json::json!({"path": path, "content": content}),
                }],
                usage,
                ..ScriptTurn::default()
            });
        }
        t.push(ScriptTurn {
            text: Some(format!("branch {b} finished after {k} calls")),
            usage,
            ..ScriptTurn::default()
        });
        turns.insert(format!("b{b}"), t);
    }
    Script {
        turns,
        ..Script::default()
    }
}

fn file_for(b: usize, j: usize, n: usize) -> (String, String) {
    match (b + j) % 3 {
        0 => (
            format!("shared/split_{j}.txt"),
            (0..n)
                .map(|i| format!("branch {b} line {i} of file {j}\n"))
                .collect(),
        ),
        1 => (
            format!("unique/b{b}/f{j}.txt"),
            (0..n)
                .map(|i| format!("unique {b}/{j} line {i}\n"))
                .collect(),
        ),
        _ => (
            format!("shared/agree_{j}.txt"),
            (0..n)
                .map(|i| format!("agreed line {i} of file {j}\n"))
                .collect(),
        ),
    }
}

fn seed_workspace(dir: &Path, k: usize) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir.join("shared"))?;
    for j in 0..k.max(1) {
        std::fs::write(
            dir.join(format!("shared/split_{j}.txt")),
            format!("parent version of file {j}\n"),
        )?;
    }
    std::fs::write(dir.join("README.md"), "parent readme\n")?;
    Ok(())
}

/// A bench's embedded system in `data`: `workers` in-process workers running `concurrency`
/// branches each (at least one of each), nothing requeued from an earlier run.
async fn start_embedded(
    data: &Path,
    workers: usize,
    concurrency: usize,
) -> anyhow::Result<Embedded> {
    Embedded::start(
        data,
        EmbeddedOptions {
            workers: workers.max(1),
            concurrency: concurrency.max(1),
            requeue_unfinished: false,
            ..EmbeddedOptions::default()
        },
    )
    .await
}

/// The fan-out on the embedded system (`--bus local`).
pub async fn fanout(args: &FanoutArgs) -> anyhow::Result<FanoutResult> {
    let tmp = tempfile::tempdir().context("temporary directory")?;
    let workspace = tmp.path().join("workspace");
    seed_workspace(&workspace, args.writes)?;
    let system = start_embedded(&tmp.path().join("data"), args.workers, args.concurrency).await?;
    let result = run_fanout(&system.client(), &workspace, args).await;
    system.shutdown().await?;
    Ok(result?.0)
}

/// The bench's fork plan: N branches `b0..`, the scripted model priced like gpt-4o-mini.
fn fanout_plan(n: usize, k: usize, script_hash: BlobHash) -> ForkPlan {
    let price = Price {
        input_per_mtok: 0.15,
        output_per_mtok: 0.60,
        cached_per_mtok: None,
        cache_write_per_mtok: None,
    };
    ForkPlan {
        name: None,
        approval: None,
        goal: "bench fan-out".into(),
        system_prompt: None,
        history: Vec::new(),
        model: BENCH_MODEL.into(),
        limits: Limits {
            max_branches: n.max(1),
            max_turns: (k + 5) as u32,
            ..Limits::default()
        },
        conflict_policy: ConflictPolicy::KeepParent,
        aggregate_budget_usd: None,
        budget: Default::default(),
        resolve: Default::default(),
        models: BTreeMap::from([(
            BENCH_MODEL.to_string(),
            ModelPlan {
                price: Some(price),
                script: Some(script_hash),
                endpoint: None,
            },
        )]),
        branches: (0..n)
            .map(|b| BranchPlan {
                approval: None,
                label: format!("b{b}"),
                steer: format!("BENCH b={b} k={k} tool=write_file"),
                model: BENCH_MODEL.into(),
                budget_usd: None,
                extra_instructions: None,
                max_turns: (k + 5) as u32,
                max_output_tokens: None,
                temperature: None,
            })
            .collect(),
        tools: Default::default(),
        solo: false,
    }
}

/// The measurement, through a client of the coordinator (embedded or remote): upload the
/// workspace and the script to the client's blob store, create the fork, wait until it
/// settles, the full diff report, merge b0 and apply it to the workspace directory.
/// Returns the result (the fields only a cluster has left empty) and the settled view.
async fn run_fanout(
    coord: &Client,
    workspace: &Path,
    args: &FanoutArgs,
) -> anyhow::Result<(FanoutResult, ForkView)> {
    let (n, k) = (args.branches, args.writes);
    let script = fanout_script(n, k, args.lines);
    let script_text = bytes::Bytes::from(script_text(&script)?);
    let script_hash = BlobHash::of(&script_text);
    let blobs = coord.blobs();
    let t_up = Instant::now();
    let (_, upload) = ws::upload_workspace(
        blobs.as_ref(),
        workspace,
        &forkfleet_shared::scan::ScanOptions::names_only(&[]),
        [(script_hash, script_text)],
    )
    .await?;
    let upload_s = t_up.elapsed().as_secs_f64();
    let plan = fanout_plan(n, k, script_hash);
    let Settled {
        view,
        created_s: fork_call_s,
        wall_s,
    } = settled_fork(coord, plan, upload.snapshot, workspace, args.timeout_s).await?;

    let t1 = Instant::now();
    let diff = coord.diff(view.fork_id, DiffOptions::default()).await?;
    let diff_s = t1.elapsed().as_secs_f64();

    let t2 = Instant::now();
    let outcome = coord.merge(view.fork_id, "b0").await?;
    let report = ws::apply_merge(
        blobs.as_ref(),
        &outcome,
        workspace,
        ConflictPolicy::KeepParent,
    )
    .await?;
    let merge_s = t2.elapsed().as_secs_f64();

    let mut states: BTreeMap<String, usize> = BTreeMap::new();
    for b in &view.branches {
        *states.entry(b.state.as_str().to_string()).or_default() += 1;
    }
    let model_turns: u64 = view.branches.iter().map(|b| b.turns as u64).sum();
    if view.branches.iter().any(|b| b.state != BranchState::Done) {
        tracing::warn!(?states, "bench: not every branch finished done");
    }
    let aggregate_turn_ms = if model_turns > 0 {
        wall_s * 1000.0 / model_turns as f64
    } else {
        0.0
    };
    let result = FanoutResult {
        bus: args.bus.as_str(),
        branches: n,
        writes: k,
        workers: args.workers,
        concurrency: args.concurrency,
        upload_s,
        wall_s,
        fork_call_s,
        diff_s,
        merge_s,
        peak_rss_mb: peak_rss_mb(),
        worker_peak_rss_mb: None,
        workers_peak_rss_mb: Vec::new(),
        nats_server_peak_rss_mb: None,
        model_turns,
        per_turn_ms: aggregate_turn_ms,
        per_turn_ms_p90: None,
        aggregate_turn_ms,
        events: None,
        workers_killed: None,
        states,
        total_cost_usd: view.total_cost_usd(),
        paths_touched: diff.summary.total_paths_touched,
        split_paths: diff.summary.split_paths,
        unanimous_paths: diff.summary.unanimous_paths,
        applied_paths: report.applied_paths.len(),
    };
    Ok((result, view))
}

/// Peak resident set size of this process (VmHWM), in MB; 0 where unknown.
pub fn peak_rss_mb() -> f64 {
    proc_peak_rss_mb("self").unwrap_or(0.0)
}

/// Peak resident set size (VmHWM) of process `pid` (or `self`), in MB, from
/// `/proc/<pid>/status`; `None` where unknown.
pub fn proc_peak_rss_mb(pid: &str) -> Option<f64> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<f64>().ok())
        })
        .map(|kb| kb / 1024.0)
}

#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// N branches, each making K write_file calls then answering (the peer's fan-out work),
    /// embedded (`--bus local`) or on a cluster of its own (`--bus nats`).
    Fanout(self::FanoutArgs),
    /// The peer's aggregate-cap table: 100 branches under caps of 10%, 25% and 50% of their
    /// uncapped spend, in strict and best-effort mode; true spend against each cap.
    Budget(self::budget::BudgetArgs),
    /// Forks of a large real tree (issue 18): snapshot time, run_command overhead per call
    /// (kept trees against a fresh copy), whole runs of 4 and 32 branches with peak RSS,
    /// and the same work with one git worktree per branch, side by side.
    Workspace(self::workspace::WorkspaceArgs),
    /// Fork-aware prompt caching: a fork of 10 branches x 10 turns on a 20,000-token
    /// parent history, against a local server that bills a prompt cache as Anthropic
    /// does; the fork's input cost with caching and without.
    Cache(self::cache::CacheArgs),
    /// A live fork of 1,000 branches through the HTTP API: what its Server-Sent Events
    /// stream sends in its first 20 s (the whole view once, then per-branch deltas).
    Stream(self::stream::StreamArgs),
}

/// Run the benchmark `command` names.
pub async fn run(command: BenchCommand) -> anyhow::Result<()> {
    match command {
        BenchCommand::Fanout(args) => cmd_fanout(args).await,
        BenchCommand::Budget(args) => budget::cmd_budget(args).await,
        BenchCommand::Workspace(args) => workspace::cmd_workspace(args).await,
        BenchCommand::Cache(args) => cache::cmd_cache(args).await,
        BenchCommand::Stream(args) => stream::cmd_stream(args).await,
    }
}

/// A fork a benchmark made and waited for.
pub struct Settled {
    /// The fork once every branch settled.
    pub view: ForkView,
    /// Seconds until the fork was created (the call answered).
    pub created_s: f64,
    /// Seconds until it settled, from the same start.
    pub wall_s: f64,
}

/// Create a fork of `plan` over the uploaded `snapshot` of `workspace` and wait (at most
/// `timeout_s`) until its branches settle.
pub async fn settled_fork(
    client: &Client,
    plan: ForkPlan,
    snapshot: BlobHash,
    workspace: &Path,
    timeout_s: u64,
) -> anyhow::Result<Settled> {
    let t0 = Instant::now();
    let view = client
        .call(CreateFork {
            plan,
            parent: ParentRun::New,
            snapshot,
            workspace: Some(workspace.display().to_string()),
            left_out: None,
            git: None,
        })
        .await?;
    let created_s = t0.elapsed().as_secs_f64();
    let view = client
        .wait_settled(view.fork_id, Duration::from_secs(timeout_s))
        .await?;
    Ok(Settled {
        view,
        created_s,
        wall_s: t0.elapsed().as_secs_f64(),
    })
}
