//! What `forkfleet runs` shows: the runs table, one run's detail, the lineage tree (text
//! and JSON), and what forking or ending a run answered. Ids are shown as short as they
//! can be while unique among the runs listed.

use forkfleet_shared::api::{RunDetail, RunForkOutcome, RunKind, RunView};
use forkfleet_shared::ids::RunId;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::fmt::Write as _;

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

pub fn runs_table(runs: &[RunView], now: u64) -> String {
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

pub fn show_text(d: &RunDetail) -> String {
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

pub fn fork_text(o: &RunForkOutcome, reach: &str) -> String {
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

pub fn end_text(d: &RunDetail) -> String {
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

pub fn tree_text(runs: &[RunView], root: Option<RunId>) -> String {
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

pub fn tree_json(runs: &[RunView], root: Option<RunId>) -> Value {
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
