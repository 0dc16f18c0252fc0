//! `forkfleet runs ...`: every run of the store and its lineage, and forking any recorded
//! run at any event into a child run (docs/LINEAGE.md): `ls`, `show`, `tree`, `fork`,
//! `resume`.

use super::fork::turns::wait_for_branch;
use super::*;
use forkfleet_shared::api::{
    ContinueOutcome, RunDetail, RunForkOptions, RunForkOutcome, RunKind, RunView,
};
use forkfleet_shared::event::Event;
use forkfleet_shared::lineage::SummaryMode;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::fmt::Write as _;

#[derive(Debug, Subcommand)]
pub enum RunsCommand {
    /// Every run of the store, oldest first: kind, label, state, parent and cutoff, events,
    /// cost.
    Ls {
        #[command(flatten)]
        client: ClientArgs,
    },
    /// One run: lineage, settings, state, cost, workspace version, children.
    Show {
        /// Run id (or a unique prefix of one).
        run: String,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// The session tree: every run under its parent (forks of forks, branches of a fork,
    /// checkpoint forks, children of `runs fork`, merge winners), from lineage only.
    Tree {
        /// Only the tree under this run (id or unique prefix).
        run: Option<String>,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Fork a recorded run at an event into a new child run: the parent's history through
    /// the cutoff copied (or re-executed with --replay), its files as they were then, its
    /// settings with --set applied. Prints the child's id.
    Fork {
        /// The parent run (id or unique prefix).
        parent: String,
        /// The last parent event the child copies (default: the parent's last replayable
        /// one: a system, user_message, model_response, tool_result, steer or follow_up).
        #[arg(long, value_name = "SEQ")]
        at_event: Option<u64>,
        /// The child's label (default: at-<SEQ>).
        #[arg(long, value_name = "LABEL")]
        label: Option<String>,
        /// Override a setting of the child: model, temperature, system_prompt, max_turns,
        /// max_output_tokens, budget, tools.run_command, tools.forking.
        #[arg(long = "set", value_name = "KEY=VALUE")]
        set: Vec<String>,
        /// Record a branch summary after the copied prefix: deterministic (counts and
        /// names from the log, the default) or model (written by the run's model).
        #[arg(long, value_name = "HOW", num_args = 0..=1, default_missing_value = "deterministic", value_parser = ["deterministic", "model"])]
        summarize: Option<String>,
        /// Re-execute the prefix instead of copying it: each model and tool call whose
        /// request hashes as the parent's is served from its record at no cost; the first
        /// that differs fails the child (replay_divergence). The child then goes on live.
        #[arg(long)]
        replay: bool,
        /// With --replay: at the first divergence go on live and record the answers.
        #[arg(long, requires = "replay")]
        record: bool,
        /// Print the plan (events to copy, skipped kinds, summary, settings, files) and
        /// write nothing.
        #[arg(long)]
        dry_run: bool,
        /// With --replay on a cluster: wait for the child to finish.
        #[arg(long)]
        wait: bool,
        /// Give up waiting after this many seconds (the child keeps running).
        #[arg(long, value_name = "S")]
        timeout_s: Option<u64>,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Run a child on the workers: an idle child from its copied history (MESSAGE, when
    /// given, as a new user message first), or a finished run continued with MESSAGE.
    Resume {
        /// The run (id or unique prefix).
        run: String,
        message: Option<String>,
        /// On a cluster: wait for the run to finish and print its answer (always,
        /// embedded).
        #[arg(long)]
        wait: bool,
        /// Give up waiting after this many seconds (the run keeps running).
        #[arg(long, value_name = "S")]
        timeout_s: Option<u64>,
        #[command(flatten)]
        client: ClientArgs,
    },
}

impl RunsCommand {
    pub fn client(&self) -> &ClientArgs {
        match self {
            RunsCommand::Ls { client }
            | RunsCommand::Show { client, .. }
            | RunsCommand::Tree { client, .. }
            | RunsCommand::Fork { client, .. }
            | RunsCommand::Resume { client, .. } => client,
        }
    }

    /// What an embedded session needs: workers for what runs.
    fn local(&self) -> Local {
        match self {
            RunsCommand::Fork {
                replay: true,
                dry_run: false,
                ..
            }
            | RunsCommand::Resume { .. } => Local::Resume,
            // A model summary is written on a worker.
            RunsCommand::Fork {
                summarize: Some(how),
                ..
            } if how == "model" => Local::Resume,
            _ => Local::Read,
        }
    }
}

pub(crate) async fn cmd_runs(command: RunsCommand) -> anyhow::Result<()> {
    let local = command.local();
    with_session!(command.client(), local, |coord| run(coord, &command))
}

async fn run(coord: &Client, command: &RunsCommand) -> anyhow::Result<()> {
    let json_out = command.client().json;
    match command {
        RunsCommand::Ls { .. } => {
            let runs = coord.runs().await?;
            if json_out {
                return print_json(&serde_json::to_value(&runs)?);
            }
            print!("{}", runs_table(&runs, now_ms()));
            Ok(())
        }
        RunsCommand::Show { run, .. } => {
            let id = coord.find_run(run).await?;
            let detail = coord.run(id).await?;
            if json_out {
                return print_json(&serde_json::to_value(&detail)?);
            }
            print!("{}", show_text(&detail));
            Ok(())
        }
        RunsCommand::Tree { run, .. } => {
            let runs = coord.runs().await?;
            let root = match run {
                Some(r) => Some(coord.find_run(r).await?),
                None => None,
            };
            if json_out {
                return print_json(&tree_json(&runs, root));
            }
            print!("{}", tree_text(&runs, root));
            Ok(())
        }
        RunsCommand::Fork {
            parent,
            at_event,
            label,
            set,
            summarize,
            replay,
            record,
            dry_run,
            wait,
            timeout_s,
            ..
        } => {
            let parent = coord.find_run(parent).await?;
            let summarize = summarize.as_deref().map(|s| match s {
                "model" => SummaryMode::Model,
                _ => SummaryMode::Deterministic,
            });
            let outcome = coord
                .run_fork(
                    parent,
                    RunForkOptions {
                        at_event: *at_event,
                        label: label.clone(),
                        set: set.clone(),
                        summarize,
                        replay: *replay,
                        record: *record,
                        dry_run: *dry_run,
                    },
                )
                .await?;
            let follow = outcome.replay && !outcome.dry_run && (*wait || !coord.is_remote());
            if !follow {
                if json_out {
                    return print_json(&serde_json::to_value(&outcome)?);
                }
                print!("{}", fork_text(&outcome, coord.reach()));
                return Ok(());
            }
            if !json_out {
                print!("{}", fork_text(&outcome, coord.reach()));
            }
            let (Some(fork), Some(run)) = (outcome.fork_id, outcome.run_id) else {
                return Ok(());
            };
            let view = wait_for_branch(
                coord,
                fork,
                &outcome.label,
                timeout_s.map(Duration::from_secs),
            )
            .await?;
            let detail = coord.run(run).await?;
            if json_out {
                return print_json(&json!({"fork": outcome, "run": detail}));
            }
            print!("{}", end_text(&detail));
            finished_ok(&view, &outcome.label)
        }
        RunsCommand::Resume {
            run,
            message,
            wait,
            timeout_s,
            ..
        } => {
            let id = coord.find_run(run).await?;
            let outcome = coord.run_resume(id, message.clone()).await?;
            if !*wait && coord.is_remote() {
                if json_out {
                    return print_json(&serde_json::to_value(resume_json(&outcome))?);
                }
                print!("{}", resume_text(&outcome));
                println!(
                    "follow it with `forkfleet fork watch {}{}`, or wait with `runs resume --wait`",
                    outcome.fork_id,
                    coord.reach()
                );
                return Ok(());
            }
            if !json_out {
                print!("{}", resume_text(&outcome));
            }
            let view = wait_for_branch(
                coord,
                outcome.fork_id,
                &outcome.label,
                timeout_s.map(Duration::from_secs),
            )
            .await?;
            let detail = coord.run(id).await?;
            let answer = last_answer(&coord.run_events(id).await?, outcome.seq);
            if json_out {
                return print_json(&json!({
                    "resume": resume_json(&outcome),
                    "run": detail,
                    "answer": answer,
                }));
            }
            print!("{}", end_text(&detail));
            if let Some(text) = answer {
                println!("{text}");
            }
            finished_ok(&view, &outcome.label)
        }
    }
}

/// Exit 1 unless the run finished `done`.
fn finished_ok(view: &ForkView, label: &str) -> anyhow::Result<()> {
    match view.branch(label) {
        Some(b) if b.state == forkfleet_shared::state::BranchState::Done => Ok(()),
        Some(b) => Err(anyhow::anyhow!(
            "the run finished {}{}",
            b.state,
            b.error
                .as_deref()
                .map(|e| format!(": {e}"))
                .unwrap_or_default()
        )),
        None => Err(anyhow::anyhow!("the run's fork has no branch `{label}`")),
    }
}

fn resume_json(o: &ContinueOutcome) -> Value {
    json!({
        "run_id": o.run_id,
        "fork_id": o.fork_id,
        "label": o.label,
        "previous": o.previous,
        "seq": o.seq,
        "state": o.branch.state,
    })
}

fn resume_text(o: &ContinueOutcome) -> String {
    format!(
        "run {} ({}) was {}; now {} on the workers\n",
        o.run_id, o.label, o.previous, o.branch.state
    )
}

/// The last answer of a run after seq `after`.
fn last_answer(events: &[forkfleet_shared::api::LoggedEvent], after: u64) -> Option<String> {
    events
        .iter()
        .filter(|e| e.seq > after)
        .filter_map(|e| match &e.event {
            Event::ModelResponse {
                text: Some(text), ..
            } if !text.trim().is_empty() => Some(text.clone()),
            _ => None,
        })
        .next_back()
}

/// Ids as short as they can be while unique among `ids` (UUID v7s share their time
/// prefix), at least 8 characters: what `find_run` takes back.
struct Short(Vec<String>);

impl Short {
    fn new<'a>(ids: impl IntoIterator<Item = &'a RunView>) -> Short {
        let mut all: Vec<String> = Vec::new();
        for v in ids {
            all.push(v.run_id.to_string());
            if let Some(l) = &v.lineage {
                all.push(l.fork_id.to_string());
            }
        }
        all.sort();
        all.dedup();
        Short(all)
    }

    fn of(&self, id: impl std::fmt::Display) -> String {
        let id = id.to_string();
        let common = |other: &String| {
            id.chars()
                .zip(other.chars())
                .take_while(|(a, b)| a == b)
                .count()
        };
        let n = self
            .0
            .iter()
            .filter(|o| **o != id)
            .map(common)
            .max()
            .unwrap_or(0);
        id.chars().take((n + 1).max(8)).collect()
    }
}

fn state_of(v: &RunView) -> String {
    v.state.map_or("-".to_string(), |s| s.to_string())
}

fn runs_table(runs: &[RunView], now: u64) -> String {
    let short = Short::new(runs);
    let short = |id: RunId| short.of(id);
    let mut out = String::new();
    if runs.is_empty() {
        out.push_str("no runs\n");
        return out;
    }
    let from = |v: &RunView| match (&v.lineage, &v.origin) {
        (Some(l), _) => format!("{}@{}", short(l.parent_run), l.cutoff_seq),
        (None, Some(o)) => format!("{}@{}", short(o.run), o.seq),
        _ => "-".to_string(),
    };
    let w = runs
        .iter()
        .map(|v| from(v).len())
        .max()
        .unwrap_or(0)
        .max(10);
    let lw = runs
        .iter()
        .map(|v| v.label.as_deref().map_or(1, str::len))
        .max()
        .unwrap_or(0)
        .max(5);
    let _ = writeln!(
        out,
        "{:<36}  {:<6}  {:<lw$}  {:<26}  {:<w$}  {:>6}  {:>10}  {:>6}  age",
        "RUN", "KIND", "LABEL", "STATE", "PARENT@SEQ", "EVENTS", "COST", "CACHED"
    );
    for v in runs {
        let _ = writeln!(
            out,
            "{:<36}  {:<6}  {:<lw$}  {:<26}  {:<w$}  {:>6}  {:>10}  {:>6}  {}",
            v.run_id,
            v.kind.as_str(),
            v.label.as_deref().unwrap_or("-"),
            state_of(v),
            from(v),
            v.events,
            format!("${:.4}", v.cost_usd),
            v.cached_calls,
            ago(now, v.created_at_ms)
        );
    }
    out
}

fn ago(now: u64, then: u64) -> String {
    let s = now.saturating_sub(then) / 1000;
    match s {
        0..=59 => format!("{s}s"),
        60..=3599 => format!("{}m", s / 60),
        3600..=86_399 => format!("{}h", s / 3600),
        _ => format!("{}d", s / 86_400),
    }
}

fn show_text(d: &RunDetail) -> String {
    let v = &d.run;
    let mut out = String::new();
    let _ = writeln!(out, "run        {}  ({})", v.run_id, v.kind.as_str());
    if let Some(label) = &v.label {
        let _ = writeln!(out, "label      {label}");
    }
    if let Some(state) = v.state {
        let _ = writeln!(
            out,
            "state      {state}{}",
            v.error
                .as_deref()
                .map(|e| format!(": {e}"))
                .unwrap_or_default()
        );
    }
    if let Some(l) = &v.lineage {
        let _ = writeln!(
            out,
            "parent     {} at seq {}{}",
            l.parent_run,
            l.cutoff_seq,
            match &l.strategy {
                Some(s) => format!(" ({s}, {} events)", l.replay_event_count),
                None => String::new(),
            }
        );
        let _ = writeln!(out, "fork       {}", l.fork_id);
    }
    if let Some(o) = &v.origin {
        let _ = writeln!(
            out,
            "from       {} checkpoint `{}` (seq {})",
            o.run, o.checkpoint, o.seq
        );
    }
    let _ = writeln!(out, "fork root  {}", v.fork_root);
    if v.merged {
        let _ = writeln!(out, "merged     the winner of its fork");
    }
    let _ = writeln!(
        out,
        "events     {}   cost ${:.6} ({} calls paid, {} served from a replay's record)",
        v.events, v.cost_usd, v.calls, v.cached_calls
    );
    let _ = writeln!(
        out,
        "workspace  {} ({} files, {} bytes)",
        d.workspace.to_hex(),
        d.files,
        d.bytes
    );
    match &d.settings {
        Some(s) => {
            let _ = writeln!(
                out,
                "settings   model={} temperature={} max_turns={} max_output_tokens={} budget={} tools.run_command={} tools.forking={}",
                s.model,
                s.temperature.map_or("default".to_string(), |t| t.to_string()),
                s.max_turns,
                s.max_output_tokens,
                s.budget_usd.map_or("none".to_string(), |b| format!("${b}")),
                s.run_command,
                s.forking
            );
            if let Some(p) = &s.system_prompt {
                let _ = writeln!(
                    out,
                    "system     {}",
                    forkfleet_shared::api::limits::truncated_to(p, 120)
                );
            }
        }
        None => {
            let _ = writeln!(out, "settings   none (a root run never forked)");
        }
    }
    if !d.children.is_empty() {
        let kids: Vec<String> = d.children.iter().map(|c| c.to_string()).collect();
        let _ = writeln!(out, "children   {}", kids.join(", "));
    }
    out
}

fn fork_text(o: &RunForkOutcome, reach: &str) -> String {
    let mut out = String::new();
    let head = if o.dry_run {
        "would fork".to_string()
    } else {
        format!(
            "forked child run {}",
            o.run_id.map(|r| r.to_string()).unwrap_or_default()
        )
    };
    let _ = writeln!(
        out,
        "{head} `{}` from run {} at seq {} ({}, {} events {})",
        o.label,
        o.parent_run,
        o.cutoff_seq,
        o.strategy,
        o.replay_event_count,
        if o.replay { "to re-execute" } else { "copied" }
    );
    if !o.skipped.is_empty() {
        let s: Vec<String> = o.skipped.iter().map(|(k, n)| format!("{k} {n}")).collect();
        let _ = writeln!(out, "  not copied: {}", s.join(", "));
    }
    if !o.changed.is_empty() {
        let _ = writeln!(
            out,
            "  --set: {} (model {}, max_turns {}, max_output_tokens {})",
            o.changed.join(", "),
            o.settings.model,
            o.settings.max_turns,
            o.settings.max_output_tokens
        );
    }
    if let Some(s) = &o.summary {
        let _ = writeln!(
            out,
            "  summary: {}",
            forkfleet_shared::api::limits::truncated_to(s, 200)
        );
    }
    let bytes: u64 = o.files.iter().map(|f| f.bytes).sum();
    let _ = writeln!(
        out,
        "  workspace at seq {}: {} files, {} bytes",
        o.cutoff_seq,
        o.files.len(),
        bytes
    );
    if o.dry_run {
        for c in &o.copied {
            let from = c
                .parent_seq
                .map_or("set".to_string(), |s| format!("parent {s}"));
            let _ = writeln!(out, "  copy {:>10} -> {:>4}  {}", from, c.seq, c.kind);
        }
        for f in &o.files {
            let _ = writeln!(out, "  file {}  {} bytes", f.path, f.bytes);
        }
        out.push_str("  (dry run: nothing written)\n");
    } else if let Some(run) = o.run_id {
        if o.replay {
            let _ = writeln!(
                out,
                "  replaying on the workers: `forkfleet runs show {run}{reach}`"
            );
        } else {
            let _ = writeln!(
                out,
                "  idle: run it with `forkfleet runs resume {run} [MESSAGE]{reach}`, or fork it with `forkfleet fork create SPEC --from-run {run}{reach}`"
            );
        }
    }
    out
}

fn end_text(d: &RunDetail) -> String {
    let v = &d.run;
    format!(
        "run {} finished {}: {} events, ${:.6} spent ({} calls paid, {} served from the record)\n",
        v.run_id,
        state_of(v),
        v.events,
        v.cost_usd,
        v.calls,
        v.cached_calls
    )
}

/// How a run came from its parent, for the tree.
fn how(v: &RunView, short: &Short) -> String {
    let short = |id: &dyn std::fmt::Display| short.of(id);
    match (v.kind, &v.lineage, &v.origin) {
        (RunKind::Child, Some(l), _) => format!(
            "child at seq {} ({} {} events)",
            l.cutoff_seq,
            l.strategy.as_deref().unwrap_or("-"),
            l.replay_event_count
        ),
        (RunKind::Branch, Some(l), _) => format!("branch of fork {}", short(&l.fork_id)),
        (_, _, Some(o)) => format!("checkpoint fork of {} at `{}`", short(&o.run), o.checkpoint),
        _ => "root".to_string(),
    }
}

fn children_of(runs: &[RunView]) -> BTreeMap<Option<RunId>, Vec<&RunView>> {
    let known: std::collections::BTreeSet<RunId> = runs.iter().map(|r| r.run_id).collect();
    let mut by_parent: BTreeMap<Option<RunId>, Vec<&RunView>> = BTreeMap::new();
    for r in runs {
        // A run whose parent is not listed (another account's) starts a tree of its own.
        let parent = r.parent.filter(|p| known.contains(p));
        by_parent.entry(parent).or_default().push(r);
    }
    by_parent
}

fn node_line(v: &RunView, short: &Short) -> String {
    format!(
        "{} {}  {}  {}  ${:.4}{}{}",
        short.of(v.run_id),
        v.label.as_deref().unwrap_or("-"),
        how(v, short),
        state_of(v),
        v.cost_usd,
        if v.cached_calls > 0 {
            format!(" ({} cached)", v.cached_calls)
        } else {
            String::new()
        },
        if v.merged { "  * merged" } else { "" }
    )
}

fn tree_text(runs: &[RunView], root: Option<RunId>) -> String {
    let short = Short::new(runs);
    let by_parent = children_of(runs);
    let tops: Vec<&RunView> = match root {
        Some(r) => runs.iter().filter(|v| v.run_id == r).collect(),
        None => by_parent.get(&None).cloned().unwrap_or_default(),
    };
    let mut out = String::new();
    if tops.is_empty() {
        out.push_str("no runs\n");
    }
    for top in tops {
        let _ = writeln!(out, "{}", node_line(top, &short));
        write_children(&mut out, &by_parent, &short, top.run_id, "");
    }
    out
}

fn write_children(
    out: &mut String,
    by_parent: &BTreeMap<Option<RunId>, Vec<&RunView>>,
    short: &Short,
    parent: RunId,
    indent: &str,
) {
    let Some(kids) = by_parent.get(&Some(parent)) else {
        return;
    };
    for (i, k) in kids.iter().enumerate() {
        let last = i + 1 == kids.len();
        let _ = writeln!(
            out,
            "{indent}{}{}",
            if last { "└── " } else { "├── " },
            node_line(k, short)
        );
        let deeper = format!("{indent}{}", if last { "    " } else { "│   " });
        write_children(out, by_parent, short, k.run_id, &deeper);
    }
}

fn tree_json(runs: &[RunView], root: Option<RunId>) -> Value {
    fn node(
        v: &RunView,
        by_parent: &BTreeMap<Option<RunId>, Vec<&RunView>>,
        short: &Short,
    ) -> Value {
        let children: Vec<Value> = by_parent
            .get(&Some(v.run_id))
            .map(|kids| kids.iter().map(|k| node(k, by_parent, short)).collect())
            .unwrap_or_default();
        json!({
            "run_id": v.run_id,
            "kind": v.kind,
            "label": v.label,
            "state": v.state,
            "how": how(v, short),
            "cost_usd": v.cost_usd,
            "cached_calls": v.cached_calls,
            "merged": v.merged,
            "lineage": v.lineage,
            "origin": v.origin,
            "children": children,
        })
    }
    let short = Short::new(runs);
    let by_parent = children_of(runs);
    let tops: Vec<&RunView> = match root {
        Some(r) => runs.iter().filter(|v| v.run_id == r).collect(),
        None => by_parent.get(&None).cloned().unwrap_or_default(),
    };
    Value::Array(tops.iter().map(|t| node(t, &by_parent, &short)).collect())
}
