//! What the CLI shows: progress lines while a fork runs, tables, and `--json` documents;
//! `runs` is `forkfleet runs`' (the runs table, a run's detail, the lineage tree).

pub mod runs;

use crate::error::ClientError;
use std::sync::atomic::{AtomicBool, Ordering};

/// Log lines are JSON (`--log-format json`): set once at start by the CLI.
static JSON_LOGS: AtomicBool = AtomicBool::new(false);

/// Log lines are JSON: what a command says on stderr (progress, notes, warnings) becomes a
/// log line too ([`say`]), so that stderr holds nothing else.
pub fn set_json_logs(on: bool) {
    JSON_LOGS.store(on, Ordering::Relaxed);
}

/// Whether log lines are JSON ([`set_json_logs`]).
pub fn json_logs() -> bool {
    JSON_LOGS.load(Ordering::Relaxed)
}

/// Say `text` on stderr: a line, or under JSON logs an INFO log line of target
/// `forkfleet::progress` (which JSON logging always lets through), with the trace ids of
/// the command.
pub fn say(text: &str) {
    if json_logs() {
        tracing::info!(target: "forkfleet::progress", "{text}");
    } else {
        eprintln!("{text}");
    }
}
use forkfleet_shared::api::{
    AbortOutcome, BranchView, ContinueOutcome, ForkView, SteerOutcome, TerminateOutcome,
};
use forkfleet_shared::budget::{AccountView, ForkCost};
use forkfleet_shared::diff::{render_summary, DiffReport};
use forkfleet_shared::event::Event;
use forkfleet_shared::flush::FlushReport;
use forkfleet_shared::ids::ForkId;
use forkfleet_shared::protocol::WorkerInfo;
use forkfleet_shared::state::BranchState;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::fmt::Write as _;

/// The labels of the branches paused by a budget cap.
pub fn paused_labels(view: &ForkView) -> Vec<&str> {
    view.branches
        .iter()
        .filter(|b| b.state == BranchState::Paused)
        .map(|b| b.label.as_str())
        .collect()
}

/// The error for a label `view` has no branch of, naming the labels it has.
pub fn no_branch(view: &ForkView, label: &str) -> ClientError {
    ClientError::BadInput(format!(
        "fork {} has no branch `{label}`; its branches: {}",
        view.fork_id,
        view.branches
            .iter()
            .map(|b| b.label.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    ))
}

/// The labels of the branches waiting for consent to a tool call.
pub fn awaiting_labels(view: &ForkView) -> Vec<&str> {
    view.branches
        .iter()
        .filter(|b| b.state == BranchState::AwaitingApproval)
        .map(|b| b.label.as_str())
        .collect()
}

/// A tool call's arguments on one line, shortened.
pub fn args_line(args: &Value) -> String {
    // A command reads best as its command line.
    let text = forkfleet_shared::approval::command_line(args).unwrap_or_else(|| args.to_string());
    one_line(&text, 80)
}

/// How long ago `ms` was, from `now_ms`: `42s`, `3m10s`, `2h05m`.
pub fn elapsed(now_ms: u64, ms: u64) -> String {
    let s = now_ms.saturating_sub(ms) / 1000;
    match s {
        0..=59 => format!("{s}s"),
        60..=3599 => format!("{}m{:02}s", s / 60, s % 60),
        _ => format!("{}h{:02}m", s / 3600, (s % 3600) / 60),
    }
}

/// The requests for consent that wait, one line each (`forkfleet approvals`).
pub fn approvals_table(list: &[forkfleet_shared::approval::ApprovalView], now_ms: u64) -> String {
    let mut out = String::new();
    if list.is_empty() {
        out.push_str("no request waits for approval\n");
        return out;
    }
    let lw = list
        .iter()
        .map(|a| a.label.chars().count())
        .max()
        .unwrap_or(5)
        .max(5);
    let _ = writeln!(
        out,
        "{:<36}  {:<lw$}  {:<12}  {:<14}  {:>7}  {:>9}  {:<24}  ARGUMENTS",
        "FORK", "LABEL", "TOOL", "CALL", "AGE", "DECIDES", "RULE"
    );
    for a in list {
        let p = &a.request;
        let _ = writeln!(
            out,
            "{:<36}  {:<lw$}  {:<12}  {:<14}  {:>7}  {:>9}  {:<24}  {}",
            a.fork_id,
            a.label,
            p.tool,
            p.call_id,
            elapsed(now_ms, p.requested_at_ms),
            format!(
                "{} {}",
                p.on_timeout.as_str(),
                elapsed(p.deadline_ms, now_ms.min(p.deadline_ms))
            ),
            p.rule,
            args_line(&p.args)
        );
    }
    out
}

/// What to tell about branches waiting for consent, and how to answer them; `suffix` is
/// appended to each command.
pub fn approvals_hint(view: &ForkView, suffix: &str) -> String {
    let waiting: Vec<&BranchView> = view
        .branches
        .iter()
        .filter(|b| b.state == BranchState::AwaitingApproval)
        .collect();
    if waiting.is_empty() {
        return String::new();
    }
    let id = view.fork_id;
    let mut out = format!(
        "{} of {} wait for approval of a tool call, holding no worker and no budget:\n",
        waiting.len(),
        count(view.branches.len(), "branch", "branches")
    );
    for b in &waiting {
        if let Some(p) = &b.approval {
            let _ = writeln!(
                out,
                "  {}: {} {} ({}; call {})",
                b.label,
                p.tool,
                args_line(&p.args),
                p.rule,
                p.call_id
            );
        }
    }
    let _ = writeln!(
        out,
        "answer with:\n  forkfleet fork approve {id} LABEL{suffix}\n  forkfleet fork deny {id} LABEL --reason TEXT{suffix}"
    );
    out
}

/// One call that was not run: `write_file {...} (paths: m/**), denied by admin: why`.
pub fn blocked_line(c: &forkfleet_shared::approval::BlockedCall) -> String {
    format!(
        "{} {} ({}), denied by {}{}",
        c.tool,
        args_line(&c.args),
        c.rule,
        c.by,
        c.reason
            .as_deref()
            .map(|r| format!(": {r}"))
            .unwrap_or_default()
    )
}

/// The calls that were not run (denied, or timed out), per branch; empty when none.
pub fn blocked_text(view: &ForkView) -> String {
    let mut out = String::new();
    for b in view.branches.iter().filter(|b| !b.blocked.is_empty()) {
        for c in &b.blocked {
            if out.is_empty() {
                out.push_str("\nblocked calls (not run):\n");
            }
            let _ = writeln!(out, "  {}: {}", b.label, blocked_line(c));
        }
    }
    out
}

/// What an answer did.
pub fn decision_text(d: &forkfleet_shared::api::DecisionOutcome) -> String {
    format!(
        "{} `{}` call {} of branch `{}` (fork {}){}; the branch is {} and goes on on any worker\n",
        if d.approved { "approved" } else { "denied" },
        d.tool,
        d.call_id,
        d.label,
        d.fork_id,
        d.reason
            .as_deref()
            .map(|r| format!(": {r}"))
            .unwrap_or_default(),
        d.branch.state
    )
}

/// What to tell about branches paused by a budget cap, and how to resume them. With the
/// fork's cost report, only the caps the fork has are named, with what is left of them.
/// `suffix` is appended to each command (e.g. ` --data DIR`).
pub fn paused_hint(
    fork: ForkId,
    paused: &[&str],
    total: usize,
    cost: Option<&ForkCost>,
    suffix: &str,
) -> String {
    let mut out = format!(
        "{} of {} paused by a budget cap, their work kept: {}
resume them by raising the cap that stopped them:
",
        paused.len(),
        count(total, "branch", "branches"),
        paused.join(", ")
    );
    let left = |cap: Option<f64>, remaining: Option<f64>| match (cap, remaining) {
        (Some(c), Some(r)) => format!(" (${:.6} left of ${:.6})", money(r), money(c)),
        _ => String::new(),
    };
    let (fork_cap, branch_caps, account) = match cost {
        Some(c) => (
            c.cap_usd
                .is_some()
                .then(|| left(c.cap_usd, c.remaining_usd)),
            c.branches
                .iter()
                .any(|b| b.state == BranchState::Paused && b.cap_usd.is_some()),
            c.account
                .as_ref()
                .filter(|a| a.cap_usd.is_some())
                .map(|a| (a.name.clone(), left(a.cap_usd, a.remaining_usd))),
        ),
        None => (Some(String::new()), true, None),
    };
    if let Some(left) = fork_cap {
        let _ = writeln!(
            out,
            "  forkfleet fork topup {fork} --usd X{suffix}   # the fork's cap{left}"
        );
    }
    if branch_caps {
        let _ = writeln!(
            out,
            "  forkfleet fork topup {fork} --branch LABEL --usd X{suffix}   # a branch's own cap"
        );
    }
    if let Some((name, left)) = account {
        let _ = writeln!(
            out,
            "  forkfleet account set {name} --cap USD{suffix}   # the account's cap{left}"
        );
    }
    out
}

pub(crate) fn label_width(view: &ForkView) -> usize {
    view.branches
        .iter()
        .map(|b| b.label.len())
        .max()
        .unwrap_or(5)
        .max(5)
}

/// One line about a fork, its goal, and what its workspace snapshot left out (when told).
pub fn fork_header(view: &ForkView) -> String {
    let mut out = format!(
        "fork {}{} · {} · {} · {}\ngoal: {}\n",
        view.fork_id,
        view.name
            .as_deref()
            .map(|n| format!(" ({n})"))
            .unwrap_or_default(),
        list_state(view),
        count(view.branches.len(), "branch", "branches"),
        total_cost_text(view),
        view.goal
    );
    if let Some(left_out) = &view.left_out {
        let _ = writeln!(
            out,
            "workspace: {} · {}",
            view.workspace.as_deref().unwrap_or("(not told)"),
            left_out.summary()
        );
    }
    if let Some(g) = &view.git {
        out.push_str(&git_line(g));
    }
    out
}

/// `git: <commit> (in <prefix>, uncommitted changes)`: where the workspace stood.
fn git_line(g: &forkfleet_shared::api::GitHead) -> String {
    let mut notes = Vec::new();
    if !g.prefix.is_empty() {
        notes.push(format!("workspace at {}", g.prefix));
    }
    if g.dirty {
        notes.push("uncommitted changes".to_string());
    }
    if notes.is_empty() {
        format!("git: {}\n", g.commit)
    } else {
        format!("git: {} ({})\n", g.commit, notes.join(", "))
    }
}

fn state_text(view: &ForkView) -> String {
    match &view.state {
        forkfleet_shared::state::ForkState::Merged { winner } => format!("merged ({winner})"),
        s => s.as_str().to_string(),
    }
}

/// The fork's state, and how many branches wait paused (a fork list's column).
fn list_state(view: &ForkView) -> String {
    let paused = paused_labels(view).len();
    if paused > 0 && !view.state.is_resolved() {
        format!("{} ({paused} paused)", state_text(view))
    } else {
        state_text(view)
    }
}

/// A spend: `$X`, or `at least $X (unknown: no price for M, ...)` when calls of `unpriced`
/// models are in it, uncounted.
pub fn spend_text<'a>(usd: f64, unpriced: impl IntoIterator<Item = &'a str>) -> String {
    let models: std::collections::BTreeSet<&str> = unpriced.into_iter().collect();
    if models.is_empty() {
        return format!("${:.6}", money(usd));
    }
    let models: Vec<&str> = models.into_iter().collect();
    format!(
        "at least ${:.6} (unknown: no price for {})",
        money(usd),
        models.join(", ")
    )
}

/// A fork's spend ([`spend_text`]).
pub fn total_cost_text(view: &ForkView) -> String {
    spend_text(
        view.total_cost_usd(),
        view.branches
            .iter()
            .filter_map(|b| b.unpriced_model.as_deref()),
    )
}

/// A branch's cost as the tables show it: `unknown` for a model with no price.
pub fn branch_cost_text(b: &BranchView) -> String {
    if b.unpriced_model.is_some() {
        "unknown".to_string()
    } else {
        format!("{:.6}", b.cost_usd)
    }
}

/// The branch table: label, state, turns, cost, changes, error.
pub fn branch_table(view: &ForkView) -> String {
    let width = label_width(view);
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<width$}  {:<26}  {:>5}  {:>12}  {:>7}  ERROR",
        "LABEL", "STATE", "TURNS", "COST_USD", "CHANGES"
    );
    for b in &view.branches {
        let _ = writeln!(
            out,
            "{:<width$}  {:<26}  {:>5}  {:>12}  {:>7}  {}",
            b.label,
            b.state.as_str(),
            b.turns,
            branch_cost_text(b),
            b.changes,
            b.error.as_deref().unwrap_or("")
        );
    }
    out
}

/// `text` on one line (newlines as `⏎`), cut to `max` characters with `…`.
pub fn one_line(text: &str, max: usize) -> String {
    let one = text.replace('\n', "⏎");
    match one.char_indices().nth(max) {
        Some((end, _)) => format!("{}…", &one[..end]),
        None => one,
    }
}

/// Each branch's last answer, one line each (`fork show FORK LABEL` prints a whole one);
/// empty when no branch answered with text yet.
pub fn answers_text(view: &ForkView) -> String {
    let width = label_width(view);
    let mut out = String::new();
    for b in &view.branches {
        if let Some(p) = &b.last_message_preview {
            if out.is_empty() {
                out.push_str("\nanswers:\n");
            }
            let _ = writeln!(out, "  {:<width$}  {}", b.label, one_line(p, 100));
        }
    }
    out
}

/// One branch as `fork show FORK LABEL` tells it, from its view and its log.
pub struct BranchDetail<'a> {
    pub branch: &'a BranchView,
    /// Its steer, then the steering messages sent to it, in order.
    pub steers: Vec<String>,
    /// Its last answer with text, whole.
    pub answer: Option<String>,
    /// What it changed, net per path (`write`, `delete`, ...), on its history (rewinds
    /// honoured).
    pub changes: BTreeMap<String, &'static str>,
}

/// [`BranchDetail`] of `b`, whose log is `events`.
pub fn branch_detail<'a>(
    b: &'a BranchView,
    events: &[forkfleet_shared::api::LoggedEvent],
) -> BranchDetail<'a> {
    let log: Vec<(u64, Event)> = events.iter().map(|e| (e.seq, e.event.clone())).collect();
    let mut steers = Vec::new();
    // Its own: the answers of its copied prefix are its parent's.
    let answer = forkfleet_shared::event::own_answer(&log, b.first_seq);
    let mut changes = BTreeMap::new();
    for (_, e) in forkfleet_shared::event::history_events(&log, None) {
        match e {
            Event::Steer { text } if !text.trim().is_empty() => steers.push(text.clone()),
            Event::FileChange { change } => {
                changes.insert(change.path().to_string(), change.kind());
            }
            _ => {}
        }
    }
    BranchDetail {
        branch: b,
        steers,
        answer,
        changes,
    }
}

impl BranchDetail<'_> {
    pub fn text(&self, fork: ForkId) -> String {
        let b = self.branch;
        let mut out = format!(
            "branch `{}` of fork {fork} · {} · turns {} · {} · {}\n",
            b.label,
            b.state,
            b.turns,
            match branch_cost_text(b).as_str() {
                "unknown" => "cost unknown (its model has no price)".to_string(),
                usd => format!("${usd}"),
            },
            count(self.changes.len(), "path changed", "paths changed")
        );
        if let Some(e) = &b.error {
            let _ = writeln!(out, "error: {e}");
        }
        for (i, s) in self.steers.iter().enumerate() {
            let what = if i == 0 { "steer" } else { "steered" };
            let _ = writeln!(out, "{what}: {}", one_line(s, 200));
        }
        match &self.answer {
            Some(a) => {
                let _ = writeln!(out, "\nfinal answer:\n{}", a.trim_end());
            }
            None => out.push_str("\nno answer yet\n"),
        }
        if !self.changes.is_empty() {
            out.push_str("\nchanges:\n");
            for (path, kind) in &self.changes {
                let _ = writeln!(out, "  {kind:<8} {path}");
            }
        }
        for c in &b.blocked {
            let _ = writeln!(out, "not run: {}", blocked_line(c));
        }
        out
    }

    pub fn json(&self) -> Value {
        let b = self.branch;
        json!({
            "label": b.label,
            "id": b.run_id.to_string(),
            "state": b.state.as_str(),
            "error": b.error,
            "turns": b.turns,
            "cost_usd": b.cost_usd,
            "cost_unknown": b.unpriced_model.is_some(),
            "usage": b.usage,
            "steers": self.steers,
            "answer": self.answer,
            "changes": self.changes.iter().map(|(p, k)| json!({"path": p, "kind": k})).collect::<Vec<_>>(),
            "blocked": b.blocked,
            "approval": b.approval,
        })
    }
}

/// Forks, one line each.
pub fn fork_list(forks: &[ForkView]) -> String {
    let mut out = String::new();
    if forks.is_empty() {
        out.push_str("no forks\n");
        return out;
    }
    let nw = forks
        .iter()
        .filter_map(|f| f.name.as_ref().map(|n| n.chars().count()))
        .max()
        .unwrap_or(1)
        .max(4);
    let _ = writeln!(
        out,
        "{:<36}  {:<nw$}  {:<16}  {:>8}  {:>12}  GOAL",
        "FORK", "NAME", "STATE", "BRANCHES", "COST_USD"
    );
    for f in forks {
        let goal: String = f.goal.chars().take(50).collect();
        let _ = writeln!(
            out,
            "{:<36}  {:<nw$}  {:<16}  {:>8}  {:>12.6}  {}",
            f.fork_id,
            f.name.as_deref().unwrap_or("-"),
            list_state(f),
            f.branches.len(),
            f.total_cost_usd(),
            goal.replace('\n', " ")
        );
    }
    out
}

/// A USD amount, or `-` for none (no cap).
fn usd(v: Option<f64>) -> String {
    v.map_or_else(|| "-".to_string(), |v| format!("{:.6}", money(v)))
}

/// An amount as shown: float noise around zero (`-0.0`, `-1e-20` left by a released
/// reservation) shows as 0.
fn money(v: f64) -> f64 {
    if v.abs() < 5e-10 {
        0.0
    } else {
        v
    }
}

/// A cap in a sentence: `$X` or `no cap`.
fn cap_text(cap: Option<f64>, remaining: Option<f64>) -> String {
    match (cap, remaining) {
        (Some(c), Some(r)) => format!("cap ${:.6} · remaining ${:.6}", money(c), money(r)),
        (Some(c), None) => format!("cap ${:.6}", money(c)),
        _ => "no cap".to_string(),
    }
}

/// A fork's money: a line per branch (state, spent, reserved, cap, remaining, calls),
/// then the fork's totals and its account's.
pub fn cost_table(cost: &ForkCost) -> String {
    let width = cost
        .branches
        .iter()
        .map(|b| b.label.len())
        .max()
        .unwrap_or(5)
        .max(5);
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<width$}  {:<26}  {:>12}  {:>12}  {:>12}  {:>13}  {:>5}  {:>6}  {:>12}  {:>12}",
        "LABEL",
        "STATE",
        "SPENT_USD",
        "RESERVED_USD",
        "CAP_USD",
        "REMAINING_USD",
        "CALLS",
        "CACHED",
        "CACHE_READ",
        "SAVED_USD"
    );
    for b in &cost.branches {
        let _ = writeln!(
            out,
            "{:<width$}  {:<26}  {:>12}  {:>12.6}  {:>12}  {:>13}  {:>5}  {:>6}  {:>12}  {:>12.6}",
            b.label,
            b.state.as_str(),
            match &b.unpriced_model {
                Some(_) => "unknown".to_string(),
                None => format!("{:.6}", money(b.spent_usd)),
            },
            money(b.reserved_usd),
            usd(b.cap_usd),
            usd(b.remaining_usd),
            b.calls,
            b.cached_calls,
            b.usage.cached_tokens,
            money(b.cache_saved_usd)
        );
    }
    let _ = writeln!(
        out,
        "\nfork {}: spent {} · reserved ${:.6} · {} · mode {} · on_exhausted {}",
        cost.fork_id,
        spend_text(
            cost.spent_usd,
            cost.branches
                .iter()
                .filter_map(|b| b.unpriced_model.as_deref())
        ),
        money(cost.reserved_usd),
        cap_text(cost.cap_usd, cost.remaining_usd),
        cost.mode.as_str(),
        cost.on_exhausted.as_str()
    );
    let over: Vec<String> = cost
        .branches
        .iter()
        .filter(|b| b.overrun_usd > 0.0)
        .map(|b| format!("{} ${:.6}", b.label, money(b.overrun_usd)))
        .collect();
    if cost.overrun_usd > 0.0 || !over.is_empty() {
        let _ = writeln!(
            out,
            "overrun past the caps: fork ${:.6}{}{} (billed past what was reserved: a provider generated beyond max_output_tokens, or best-effort mode's last call)",
            money(cost.overrun_usd),
            if over.is_empty() { "" } else { " · branches " },
            over.join(", ")
        );
    }
    let u = &cost.usage;
    if u.input_tokens + u.output_tokens > 0 {
        let _ = writeln!(
            out,
            "tokens: {} input ({} read from the prompt cache, {} written to it) · {} output ({} reasoning) · the prompt cache saved ${:.6}",
            u.input_tokens,
            u.cached_tokens,
            u.cache_write_tokens,
            u.output_tokens,
            u.reasoning_tokens,
            money(cost.cache_saved_usd)
        );
    }
    if let Some(a) = &cost.account {
        out.push_str(&account_text(a));
    }
    if cost.judge_usage.input_tokens + cost.judge_usage.output_tokens > 0 {
        let _ = writeln!(
            out,
            "judges (last resolve): {} · {} input + {} output tokens (not charged to the branches' caps)",
            spend_text(
                cost.judge_cost_usd,
                cost.judge_unpriced.iter().map(String::as_str)
            ),
            cost.judge_usage.input_tokens,
            cost.judge_usage.output_tokens
        );
    }
    out
}

/// A value as JSON (the cost report and accounts are printed as they are defined).
pub fn to_json<T: serde::Serialize>(value: &T) -> Result<Value, ClientError> {
    serde_json::to_value(value).map_err(|e| ClientError::encode("a JSON document", e))
}

/// Accounts, one line each.
/// The accounts, one line each; `reach` (see `Client::reach`) ends the command the empty
/// table suggests.
pub fn account_table(accounts: &[AccountView], reach: &str) -> String {
    let mut out = String::new();
    if accounts.is_empty() {
        let _ = writeln!(
            out,
            "no accounts; create one with `forkfleet account set NAME --cap USD{reach}`"
        );
        return out;
    }
    let width = accounts
        .iter()
        .map(|a| a.name.len())
        .max()
        .unwrap_or(7)
        .max(7);
    let _ = writeln!(
        out,
        "{:<width$}  {:>12}  {:>12}  {:>12}  {:>13}  {:>5}",
        "ACCOUNT", "CAP_USD", "SPENT_USD", "RESERVED_USD", "REMAINING_USD", "FORKS"
    );
    for a in accounts {
        let _ = writeln!(
            out,
            "{:<width$}  {:>12}  {:>12.6}  {:>12.6}  {:>13}  {:>5}",
            a.name,
            usd(a.cap_usd),
            money(a.spent_usd),
            money(a.reserved_usd),
            usd(a.remaining_usd),
            a.forks
        );
    }
    out
}

/// One account in a sentence.
pub fn account_text(a: &AccountView) -> String {
    format!(
        "account {}: spent ${:.6} · reserved ${:.6} · {} · {} fork(s)\n",
        a.name,
        money(a.spent_usd),
        money(a.reserved_usd),
        cap_text(a.cap_usd, a.remaining_usd),
        a.forks
    )
}

/// The diff summary, and with `unified` every path's unified diffs.
pub fn diff_text(report: &DiffReport, unified: bool) -> String {
    let mut out = render_summary(report);
    if unified {
        for p in &report.paths {
            for c in &p.changes {
                if let Some(d) = &c.diff {
                    let _ = writeln!(
                        out,
                        "\n=== {} · {} ({})",
                        p.path,
                        report.label(c.branch),
                        c.operation
                    );
                    out.push_str(d);
                    if !d.ends_with('\n') {
                        out.push('\n');
                    }
                }
            }
        }
    }
    out
}

/// What a merge did.
pub fn merge_text(winner: &str, report: &FlushReport) -> String {
    format!(
        "\nmerged `{winner}`: {}",
        flush_text(report, "applied", "changed since the fork")
    )
}

/// `s` as one word of a POSIX shell command: as it is when it is plain, else in single
/// quotes (a quote inside written `'\''`).
pub fn shell_word(s: &str) -> String {
    let plain = !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./=:,+@%{}~".contains(c));
    if plain {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

/// `n` and the noun, singular for one: `1 file`, `2 files`.
pub fn count(n: usize, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

/// What a flush did to a directory (a merge, a rewind), each path once with what happened
/// to it: a summary line, then a line per path. `written` names a written path (`applied`,
/// `restored`); `edited_since` says since when a conflicting path was edited locally.
pub fn flush_text(report: &FlushReport, written: &str, edited_since: &str) -> String {
    let mut out = String::new();
    let mut summary = vec![
        format!(
            "{} {written} ({})",
            count(report.applied_paths.len(), "file", "files"),
            count(report.applied_changes, "change", "changes")
        ),
        format!("{} deleted", report.deleted_paths.len()),
    ];
    if !report.overwritten.is_empty() {
        summary.push(format!("{} overwritten", report.overwritten.len()));
    }
    summary.push(count(report.conflicts.len(), "conflict", "conflicts"));
    summary.push(count(report.errors.len(), "error", "errors"));
    let _ = writeln!(out, "{}", summary.join(", "));
    for p in &report.applied_paths {
        let _ = writeln!(out, "  {written:<11} {p}");
    }
    for p in &report.deleted_paths {
        let _ = writeln!(out, "  {:<11} {p}", "deleted");
    }
    for p in &report.overwritten {
        let _ = writeln!(
            out,
            "  {:<11} {p} ({edited_since}; the local edit was replaced)",
            "overwritten"
        );
    }
    for p in &report.conflicts {
        let _ = writeln!(
            out,
            "  {:<11} {p} ({edited_since}; kept as it is)",
            "conflict"
        );
    }
    for e in &report.errors {
        let _ = writeln!(
            out,
            "  {:<11} {} ({}): {}",
            "error", e.path, e.op, e.message
        );
    }
    out
}

/// The diff as JSON: the summary and, per path, its agreement and each touching branch's
/// operation (a branch not listed left the path untouched). With `full`, every change's
/// entry and unified diff too.
pub fn diff_json(report: &DiffReport, full: bool) -> Value {
    if full {
        return report.to_json_value();
    }
    let paths: Vec<Value> = report
        .paths
        .iter()
        .map(|p| {
            let ops: BTreeMap<&str, &str> = report
                .operations(p)
                .into_iter()
                .map(|(l, o)| (l, o.as_str()))
                .collect();
            json!({"path": p.path.as_str(), "agreement": p.agreement.as_str(), "operations": ops})
        })
        .collect();
    json!({"branches": report.branches, "summary": report.summary, "paths": paths})
}

/// The JSON document of `forkfleet run --json` and the fork commands.
pub fn fork_json(
    view: &ForkView,
    diff: Option<&DiffReport>,
    merge: Option<(&str, &FlushReport)>,
) -> Value {
    let branches: Vec<Value> = view
        .branches
        .iter()
        .map(|b| {
            json!({
                "label": b.label,
                "id": b.run_id.to_string(),
                "state": b.state.as_str(),
                "turns": b.turns,
                "cost_usd": b.cost_usd,
                "usage": b.usage,
                "changes": b.changes,
                "error": b.error,
                "approval": b.approval,
                "blocked": b.blocked,
                "last_message_preview": b.last_message_preview,
                // A model with no price: cost_usd counts none of its calls.
                "cost_unknown": b.unpriced_model.is_some(),
            })
        })
        .collect();
    let mut doc = json!({
        "fork_id": view.fork_id.to_string(),
        "name": view.name,
        "parent_run": view.parent_run.to_string(),
        "goal": view.goal,
        "state": view.state.as_str(),
        "created_at_ms": view.created_at_ms,
        "workspace": view.workspace,
        "left_out": view.left_out,
        "total_cost_usd": view.total_cost_usd(),
        // True: a branch's model has no price, and the total is a lower bound.
        "cost_unknown": view.cost_unknown(),
        "branches": branches,
    });
    if let forkfleet_shared::state::ForkState::Merged { winner } = &view.state {
        doc["winner"] = json!(winner);
    }
    if let Some(g) = &view.git {
        doc["git"] = json!({"commit": g.commit, "prefix": g.prefix, "dirty": g.dirty});
    }
    if let Some(d) = diff {
        doc["diff"] = diff_json(d, false);
    }
    if let Some((winner, r)) = merge {
        doc["merge"] = json!({
            "winner": winner,
            "applied_paths": r.applied_paths,
            "applied_changes": r.applied_changes,
            "conflicts": r.conflicts,
            "overwritten": r.overwritten,
            "errors": r.errors,
            "deleted_paths": r.deleted_paths,
        });
    }
    doc
}

/// The live workers, one line each.
pub fn worker_table(workers: &[WorkerInfo], now_ms: u64) -> String {
    let mut out = String::new();
    if workers.is_empty() {
        out.push_str("no live workers\n");
        return out;
    }
    let _ = writeln!(
        out,
        "{:<36}  {:<12}  {:>7}  {:<20}  {:<10}  {:<18}  LAST_HEARTBEAT",
        "WORKER", "POOL", "RUNNING", "HOST", "VERSION", "COMMANDS"
    );
    for w in workers {
        let _ = writeln!(
            out,
            "{:<36}  {:<12}  {:>7}  {:<20}  {:<10}  {:<18}  {}",
            w.worker_id,
            w.pool,
            format!("{}/{}", w.running.len(), w.concurrency),
            w.hostname,
            w.version,
            w.commands
                .as_ref()
                .map_or_else(|| "-".to_string(), commands_cell),
            age(now_ms.saturating_sub(w.heartbeat_at_ms))
        );
    }
    out
}

/// A worker's command set-up in a few words: `layered+landlock7`, `whole+limits`.
fn commands_cell(c: &forkfleet_shared::protocol::CommandSetupInfo) -> String {
    format!(
        "{}+{}",
        if c.layered { "layered" } else { "whole" },
        if c.landlock_abi > 0 {
            format!("landlock{}", c.landlock_abi)
        } else {
            "limits".to_string()
        }
    )
}

fn age(ms: u64) -> String {
    if ms < 1_000 {
        format!("{ms} ms ago")
    } else {
        format!("{:.1} s ago", ms as f64 / 1_000.0)
    }
}

/// The workers as JSON.
pub fn workers_json(workers: &[WorkerInfo], now_ms: u64) -> Value {
    let list: Vec<Value> = workers
        .iter()
        .map(|w| {
            json!({
                "worker_id": w.worker_id.to_string(),
                "pool": w.pool,
                "concurrency": w.concurrency,
                "running": w.running.iter().map(|r| r.to_string()).collect::<Vec<_>>(),
                "hostname": w.hostname,
                "version": w.version,
                "started_at_ms": w.started_at_ms,
                "heartbeat_at_ms": w.heartbeat_at_ms,
                "heartbeat_age_ms": now_ms.saturating_sub(w.heartbeat_at_ms),
                // Its model catalogue as advertised: names, dialects, base URLs (no keys).
                "models": w.models,
                "allowed_model_hosts": w.allowed_model_hosts,
                // What its commands run in, as its probe at start found.
                "commands": w.commands,
            })
        })
        .collect();
    Value::Array(list)
}

/// What a terminate did.
pub fn terminate_text(t: &TerminateOutcome) -> String {
    if t.sent {
        format!(
            "terminate sent to branch `{}` ({}); it stops at its next turn and keeps its work\n",
            t.label, t.state
        )
    } else {
        format!(
            "branch `{}` already finished ({}); nothing to stop\n",
            t.label, t.state
        )
    }
}

/// A terminate as JSON.
pub fn terminate_json(t: &TerminateOutcome) -> Value {
    json!({
        "fork_id": t.fork_id.to_string(),
        "label": t.label,
        "run_id": t.run_id.to_string(),
        "state": t.state.as_str(),
        "sent": t.sent,
    })
}

/// What a steer did.
pub fn steer_text(s: &SteerOutcome) -> String {
    format!(
        "steer sent to branch `{}` ({}); it applies it before its next model call\n",
        s.label, s.state
    )
}

/// A steer as JSON.
pub fn steer_json(s: &SteerOutcome) -> Value {
    json!({
        "fork_id": s.fork_id.to_string(),
        "label": s.label,
        "run_id": s.run_id.to_string(),
        "state": s.state.as_str(),
        "attempt": s.attempt,
        "sent": true,
    })
}

/// How a continued branch ended: its view after the turn and the text of its last model
/// response in that turn (`fork continue --wait`).
pub struct TurnEnd<'a> {
    pub branch: &'a BranchView,
    pub text: Option<&'a str>,
}

/// What a continue did.
pub fn continue_text(c: &ContinueOutcome) -> String {
    format!(
        "branch `{}` of fork {} continued: was {}, now {} (follow-up at seq {})\n",
        c.label, c.fork_id, c.previous, c.branch.state, c.seq
    )
}

/// How a continued branch's turn ended, and its final text.
pub fn turn_end_text(end: &TurnEnd<'_>) -> String {
    let b = end.branch;
    let mut out = format!(
        "branch `{}` {}{} · {} turns in all · ${:.4}\n",
        b.label,
        b.state,
        b.error
            .as_deref()
            .map(|e| format!(": {e}"))
            .unwrap_or_default(),
        b.turns,
        b.cost_usd
    );
    if let Some(text) = end.text {
        let _ = writeln!(out, "\n{}", text.trim_end());
    }
    out
}

/// A continue as JSON (with `final` when the new turn was waited for).
pub fn continue_json(c: &ContinueOutcome, end: Option<&TurnEnd<'_>>) -> Value {
    let mut doc = json!({
        "fork_id": c.fork_id.to_string(),
        "label": c.label,
        "run_id": c.run_id.to_string(),
        "previous": c.previous.as_str(),
        "state": c.branch.state.as_str(),
        "seq": c.seq,
        "fork_state": c.fork_state.as_str(),
    });
    if let Some(end) = end {
        doc["final"] = json!({
            "state": end.branch.state.as_str(),
            "error": end.branch.error,
            "turns": end.branch.turns,
            "cost_usd": end.branch.cost_usd,
            "changes": end.branch.changes,
            "text": end.text,
        });
    }
    doc
}

/// What an abort did.
pub fn abort_text(a: &AbortOutcome) -> String {
    let id = a.view.fork_id;
    if !a.changed {
        return format!("fork {id} was already aborted\n");
    }
    if a.terminated.is_empty() {
        format!("fork {id} aborted; no branch was still running\n")
    } else {
        format!(
            "fork {id} aborted; terminate sent to {}: {}\n",
            count(a.terminated.len(), "branch", "branches"),
            a.terminated.join(", ")
        )
    }
}

/// An abort as JSON: the fork document plus what was stopped.
pub fn abort_json(a: &AbortOutcome) -> Value {
    let mut doc = fork_json(&a.view, None, None);
    doc["terminated"] = json!(a.terminated);
    doc["changed"] = json!(a.changed);
    doc
}

/// One event as a line of text (prompts and outputs shortened).
pub fn event_line(e: &Event) -> String {
    let short = |s: &str| one_line(s, 100);
    match e {
        Event::Fork {
            fork_id,
            parent_run,
            cutoff_seq,
            label,
            ..
        } => format!("fork       {label} of run {parent_run} at seq {cutoff_seq} (fork {fork_id})"),
        Event::System { text } => format!("system     {}", short(text)),
        Event::UserMessage { text } => format!("user       {}", short(text)),
        Event::Steer { text } => format!("steer      {}", short(text)),
        Event::FollowUp { text } => format!("follow-up  {}", short(text)),
        Event::ModelResponse {
            text,
            tool_calls,
            finish_reason,
            ..
        } => {
            let calls: Vec<&str> = tool_calls.iter().map(|c| c.name.as_str()).collect();
            // A cut answer says so: at the output cap, or at the branch's budget.
            let cut = match finish_reason.as_deref() {
                Some(r @ ("length" | "max_tokens" | "max_output_tokens")) => {
                    format!(" [truncated: {r}]")
                }
                Some("budget_cut") => " [cut mid-answer: budget]".to_string(),
                _ => String::new(),
            };
            format!(
                "model      {}{}{cut}",
                text.as_deref().map(short).unwrap_or_default(),
                if calls.is_empty() {
                    String::new()
                } else {
                    format!(" [calls: {}]", calls.join(", "))
                }
            )
        }
        Event::ToolResult {
            name, ok, output, ..
        } => {
            format!(
                "tool       {name} {} {}",
                if *ok { "ok" } else { "ERROR" },
                short(output)
            )
        }
        Event::FileChange { change } => format!("change     {} {}", change.kind(), change.path()),
        Event::Usage { cached: true, .. } => {
            "usage      served from the replay's record · $0".to_string()
        }
        Event::Usage {
            usage, cost_usd, ..
        } => format!(
            "usage      in {} out {} cached {}{}{} · ${cost_usd:.6}",
            usage.input_tokens,
            usage.output_tokens,
            usage.cached_tokens,
            if usage.cache_write_tokens > 0 {
                format!(" cache-write {}", usage.cache_write_tokens)
            } else {
                String::new()
            },
            if usage.reasoning_tokens > 0 {
                format!(" reasoning {}", usage.reasoning_tokens)
            } else {
                String::new()
            }
        ),
        Event::BranchSummary { text } => format!("summary    {}", short(text)),
        Event::Checkpoint { label } => format!("checkpoint {label}"),
        Event::Rewind { to_seq, label, .. } => {
            format!("rewind     to checkpoint {label} (history as at seq {to_seq})")
        }
        Event::ApprovalRequested {
            call_id,
            tool,
            args,
            rule,
            timeout_s,
            on_timeout,
            ..
        } => format!(
            "approval?  {tool} {} ({call_id}; rule {rule}; {} after {timeout_s} s)",
            short(&args.to_string()),
            on_timeout.as_str()
        ),
        Event::ApprovalDecided {
            call_id,
            approved,
            by,
            reason,
            ..
        } => format!(
            "approval   {} by {by} ({call_id}){}",
            if *approved { "approved" } else { "denied" },
            reason
                .as_deref()
                .map(|r| format!(": {}", short(r)))
                .unwrap_or_default()
        ),
        Event::Status { state, error } => format!(
            "status     {state}{}",
            error
                .as_deref()
                .map(|e| format!(": {e}"))
                .unwrap_or_default()
        ),
    }
}

/// An error and its causes on one line, each cause once (a message that already contains
/// its cause's text is not followed by it again). Pass an `anyhow::Error` as `&*e`.
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut parts: Vec<String> = Vec::new();
    for cause in std::iter::successors(Some(e), |c| c.source()) {
        let s = cause.to_string();
        if !parts.iter().any(|p| p.contains(&s)) {
            parts.push(s);
        }
    }
    parts.join(": ")
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use forkfleet_shared::path::WsPath;

    /// Counts read as English: one file, two files (issue 13: "1 files applied").
    #[test]
    fn counts_are_singular_for_one() {
        let one = FlushReport {
            applied_paths: vec![WsPath::parse("a.txt").unwrap()],
            applied_changes: 1,
            ..FlushReport::default()
        };
        let text = merge_text("x", &one);
        assert!(
            text.contains(
                "merged `x`: 1 file applied (1 change), 0 deleted, 0 conflicts, 0 errors"
            ),
            "{text}"
        );
        assert_eq!(count(2, "branch", "branches"), "2 branches");
        assert_eq!(count(1, "branch", "branches"), "1 branch");
    }
}
