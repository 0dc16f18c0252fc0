//! The fork tools: an agent whose task has `forking` forks its own run (ADR 14).
//!
//! `fork_run`, `inspect_branches`, `merge_or_select`, `terminate_branch`, `diff_branches`
//! and `fork_cost` are regular tools that call the coordinator's API over the bus, like any
//! client. The fork is the coordinator's like any other: its branches run on any worker,
//! hold budgets, show in `forkfleet fork ls`, and a fork the agent leaves unresolved stays
//! resolvable from the CLI. The agent's own run is the fork's parent, cut at the model
//! response that called `fork_run`; the branches start from the agent's files as they are
//! then. Merging a pick replays the winner's change log onto the agent's overlay (conflicts
//! against the fork's snapshot, under the plan's conflict policy): the changes become the
//! agent's own file changes, published like any tool's.
//!
//! Errors the agent can act on (the depth limit, an unknown label, a branch still running,
//! the coordinator not answering) are tool errors it reads, never a crash of the branch.
//!
//! The tools' definitions, what the model is offered, are in [`crate::toolspec`]
//! ([`fork_tool_specs`](crate::toolspec::fork_tool_specs)); this module runs them.

pub use crate::toolspec::{
    DIFF_BRANCHES, FORK_COST, FORK_RUN, INSPECT_BRANCHES, MAX_WAIT_S, MERGE_OR_SELECT,
    TERMINATE_BRANCH,
};

use crate::cache::BlobCache;
use crate::toolspec::ToolOutcome;
use forkfleet_bus::apicall::{BusApi, CallError};
use forkfleet_bus::Bus;
use forkfleet_shared::api::{AgentBranch, ApiClient, ForkView, MergeOutcome};
use forkfleet_shared::diff::{render_summary, DiffOptions};
use forkfleet_shared::event::{Event, ToolCall};
use forkfleet_shared::flush::flush;
use forkfleet_shared::ids::{ForkId, RunId};
use forkfleet_shared::manifest::Manifest;
use forkfleet_shared::overlay::Overlay;
use forkfleet_shared::path::WsPath;
use forkfleet_shared::resolve::{Decision, Strategy, DEFAULT_THRESHOLD, STRATEGY_NAMES};
use forkfleet_shared::state::ForkState;
use serde::Deserialize;
use serde_json::{json, Value};

/// Characters of a diff summary returned to the model.
const MAX_DIFF_CHARS: usize = 12_000;

/// What the fork tools need of the branch calling them.
pub(crate) struct ForkCall<'a> {
    pub bus: &'a dyn Bus,
    pub blobs: &'a BlobCache,
    /// The agent's run.
    pub run_id: RunId,
    /// The last seq of the agent's log before the model response making the call.
    pub cutoff_seq: u64,
    pub overlay: &'a mut Overlay,
}

/// The forks an agent made; the last one is the one the tools act on by default.
#[derive(Debug, Default, Clone)]
pub(crate) struct AgentForks {
    current: Option<ForkId>,
}

impl AgentForks {
    /// The forks a branch's log shows it made (a branch taken over by another worker, or
    /// continued, acts on the fork it made last).
    pub fn from_log<'a>(log: impl Iterator<Item = &'a Event>) -> Self {
        let mut forks = Self::default();
        for e in log {
            if let Event::ToolResult {
                name,
                ok: true,
                output,
                ..
            } = e
            {
                if name == FORK_RUN {
                    if let Some(id) = serde_json::from_str::<Value>(output)
                        .ok()
                        .and_then(|v| v.get("fork_id")?.as_str()?.parse::<ForkId>().ok())
                    {
                        forks.current = Some(id);
                    }
                }
            }
        }
        forks
    }

    /// Run one fork tool call. Every failure is a tool error the model reads.
    pub async fn run(&mut self, call: &ToolCall, cx: ForkCall<'_>) -> ToolOutcome {
        let result = match call.name.as_str() {
            FORK_RUN => self.fork_run(&call.args, cx).await,
            INSPECT_BRANCHES => self.inspect(&call.args, cx).await,
            MERGE_OR_SELECT => self.merge_or_select(&call.args, cx).await,
            TERMINATE_BRANCH => self.terminate(&call.args, cx).await,
            DIFF_BRANCHES => self.diff(&call.args, cx).await,
            FORK_COST => self.cost(&call.args, cx).await,
            other => Err(format!(
                "unknown fork tool `{other}`; fork tools: {}",
                forkfleet_shared::tools::names_of(forkfleet_shared::tools::ToolKind::Fork)
                    .join(", ")
            )),
        };
        match result {
            Ok(output) => ToolOutcome { ok: true, output },
            Err(output) => ToolOutcome { ok: false, output },
        }
    }

    /// The fork a call names (`fork_id`), else the last one this agent made.
    fn target(&self, args: &Value) -> Result<ForkId, String> {
        match args.get("fork_id").and_then(Value::as_str) {
            Some(id) => id
                .parse::<ForkId>()
                .map_err(|_| format!("fork_id `{id}` is not a fork id")),
            None => self
                .current
                .ok_or_else(|| format!("no fork yet: call {FORK_RUN} first")),
        }
    }

    async fn fork_run(&mut self, args: &Value, cx: ForkCall<'_>) -> Result<String, String> {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Args {
            branches: Vec<AgentBranch>,
            #[serde(default)]
            strategy: Option<String>,
            #[serde(default)]
            aggregate_budget_usd: Option<f64>,
            /// pydantic-deep's `BranchIsolation` flags: taken where they mean something
            /// here, at the one value forkfleet gives them ([`check_isolation`]).
            #[serde(default)]
            isolation: Option<Value>,
        }
        let a: Args = parse(FORK_RUN, args)?;
        if let Some(isolation) = &a.isolation {
            check_isolation(isolation)?;
        }
        if let Some(current) = self.current {
            let view = fork_view(cx.bus, current).await?;
            if !view.state.is_resolved() {
                return Err(format!(
                    "fork {current} is not resolved yet ({}): resolve it with {MERGE_OR_SELECT} (pick:<label> or abort) before forking again",
                    view.state.as_str()
                ));
            }
        }
        let strategy = a.strategy.as_deref().map(strategy).transpose()?;
        let manifest = cx.overlay.to_manifest();
        let bytes = manifest
            .to_blob()
            .map_err(|e| format!("cannot snapshot the workspace: {e}"))?;
        let snapshot = cx
            .blobs
            .put(bytes)
            .await
            .map_err(|e| format!("cannot store the workspace snapshot: {e}"))?;
        let view = BusApi::worker(cx.bus)
            .agent_fork(
                cx.run_id,
                cx.cutoff_seq,
                snapshot,
                a.branches,
                strategy,
                a.aggregate_budget_usd,
            )
            .await
            .map_err(CallError::message)?;
        self.current = Some(view.fork_id);
        tracing::info!(fork.id = %view.fork_id, branches = view.branches.len(), "agent forked");
        Ok(json!({
            "fork_id": view.fork_id.to_string(),
            "branches": view.branches.iter().map(|b| json!({"label": b.label, "state": b.state.as_str()})).collect::<Vec<_>>(),
            "next": format!("the branches run now; call {INSPECT_BRANCHES} (with wait_s to wait for them), then {MERGE_OR_SELECT}"),
        })
        .to_string())
    }

    async fn inspect(&mut self, args: &Value, cx: ForkCall<'_>) -> Result<String, String> {
        let fork = self.target(args)?;
        let wait_s = match args.get("wait_s") {
            None | Some(Value::Null) => 0.0,
            Some(v) => v
                .as_f64()
                .filter(|w| w.is_finite() && *w >= 0.0)
                .ok_or_else(|| format!("wait_s must be a number of seconds, 0 to {MAX_WAIT_S}"))?
                .min(MAX_WAIT_S),
        };
        let view = if wait_s > 0.0 {
            let timeout_ms = (wait_s * 1000.0) as u64;
            match BusApi::worker(cx.bus).wait_settled(fork, timeout_ms).await {
                Ok(view) => view,
                // Not settled in time: say where the branches are.
                _ => fork_view(cx.bus, fork).await?,
            }
        } else {
            fork_view(cx.bus, fork).await?
        };
        Ok(describe(&view))
    }

    async fn merge_or_select(&mut self, args: &Value, cx: ForkCall<'_>) -> Result<String, String> {
        let fork = self.target(args)?;
        let api = BusApi::worker(cx.bus);
        let action = args
            .get("action")
            .and_then(Value::as_str)
            .ok_or_else(|| "`action` is required: pick:<label>, auto or abort".to_string())?;
        if action == "abort" {
            let a = api.abort(fork).await.map_err(CallError::message)?;
            return Ok(json!({
                "fork_id": fork.to_string(),
                "aborted": true,
                "terminated": a.terminated,
            })
            .to_string());
        }
        let pick = if action == "auto" {
            let report = api
                .resolve(fork, Some(Strategy::Auto), false, Vec::<String>::new())
                .await
                .map_err(CallError::message)?;
            match &report.decision {
                Decision::Commit { winner, .. } => winner.clone(),
                other => {
                    return Err(format!(
                        "the judge did not pick a branch ({other:?}); look at the branches ({INSPECT_BRANCHES}, {DIFF_BRANCHES}) and pick one with pick:<label>"
                    ))
                }
            }
        } else if let Some(label) = action.strip_prefix("pick:") {
            label.trim().to_string()
        } else {
            return Err(format!(
                "action `{action}` is not valid: pick:<label>, auto or abort"
            ));
        };
        let outcome = api
            .agent_merge(fork, pick, cx.run_id)
            .await
            .map_err(CallError::message)?;
        apply_merge(&outcome, cx.overlay, cx.blobs).await
    }

    async fn terminate(&mut self, args: &Value, cx: ForkCall<'_>) -> Result<String, String> {
        let fork = self.target(args)?;
        let label = args
            .get("label")
            .or_else(|| args.get("branch_id"))
            .and_then(Value::as_str)
            .ok_or_else(|| "`label` is required: the branch to stop".to_string())?
            .to_string();
        let t = BusApi::worker(cx.bus)
            .terminate(fork, label)
            .await
            .map_err(CallError::message)?;
        Ok(json!({
            "label": t.label,
            "state": t.state.as_str(),
            "stopped": t.sent,
        })
        .to_string())
    }

    async fn diff(&mut self, args: &Value, cx: ForkCall<'_>) -> Result<String, String> {
        let fork = self.target(args)?;
        let paths = match args.get("paths") {
            None | Some(Value::Null) => None,
            Some(Value::Array(items)) => {
                let mut out = Vec::with_capacity(items.len());
                for item in items {
                    let p = item
                        .as_str()
                        .ok_or_else(|| "paths must be a list of strings".to_string())?;
                    out.push(WsPath::parse(p).map_err(|e| format!("path `{p}`: {e}"))?);
                }
                Some(out)
            }
            Some(_) => return Err("paths must be a list of strings".to_string()),
        };
        let options = DiffOptions {
            paths,
            ..DiffOptions::default()
        };
        let report = BusApi::worker(cx.bus)
            .diff(fork, options)
            .await
            .map_err(CallError::message)?;
        Ok(cut(render_summary(&report), MAX_DIFF_CHARS))
    }

    async fn cost(&mut self, args: &Value, cx: ForkCall<'_>) -> Result<String, String> {
        let fork = self.target(args)?;
        let cost = BusApi::worker(cx.bus)
            .fork_cost(fork)
            .await
            .map_err(CallError::message)?;
        serde_json::to_string(&cost).map_err(|e| e.to_string())
    }
}

/// Replay a merged winner's change log onto the agent's overlay.
async fn apply_merge(
    outcome: &MergeOutcome,
    overlay: &mut Overlay,
    blobs: &BlobCache,
) -> Result<String, String> {
    let bytes = blobs
        .get(&outcome.fork_snapshot)
        .await
        .map_err(|e| format!("cannot read the fork's snapshot: {e}"))?;
    let snapshot = Manifest::from_blob(&bytes)
        .map_err(|e| format!("the fork's snapshot is unreadable: {e}"))?;
    let report = flush(
        &outcome.changes,
        &snapshot,
        overlay,
        outcome.conflict_policy,
    );
    tracing::info!(
        fork.id = %outcome.fork_id,
        branch.label = %outcome.winner,
        applied = report.applied_paths.len(),
        overwritten = report.overwritten.len(),
        conflicts = report.conflicts.len(),
        "agent merged its fork"
    );
    Ok(json!({
        "fork_id": outcome.fork_id.to_string(),
        "merged": outcome.winner,
        // applied_paths, deleted_paths, overwritten, conflicts, errors (each with path, op,
        // message).
        "report": report,
        "conflict_policy": outcome.conflict_policy.to_string(),
        "winner_answer": outcome.summary,
    })
    .to_string())
}

async fn fork_view(bus: &dyn Bus, fork: ForkId) -> Result<ForkView, String> {
    BusApi::worker(bus)
        .fork(fork)
        .await
        .map_err(CallError::message)
}

fn parse<T: serde::de::DeserializeOwned>(tool: &str, args: &Value) -> Result<T, String> {
    serde_json::from_value(args.clone()).map_err(|e| format!("{tool}: bad arguments: {e}"))
}

/// `fork_run`'s `isolation` (pydantic-deep's `BranchIsolation`): each flag forkfleet has
/// a meaning for is taken at the value that meaning gives it (a branch's history is a
/// copy, its workspace a copy-on-write copy, its steering its own); any other value, and
/// any flag with no meaning here, is refused by name.
fn check_isolation(isolation: &Value) -> Result<(), String> {
    let Some(flags) = isolation.as_object() else {
        return Err(format!(
            "{FORK_RUN}: isolation must be an object of history, backend and message_queue; got {isolation}"
        ));
    };
    for (flag, value) in flags {
        let (only, why) = match flag.as_str() {
            "history" => ("copy", "each branch starts from a copy of your conversation"),
            "backend" => (
                "copy",
                "each branch works in its own copy-on-write copy of the workspace; only the winner's changes come back, at the merge",
            ),
            "message_queue" => ("isolated", "each branch is steered on its own"),
            other => {
                return Err(format!(
                    "{FORK_RUN}: isolation.{other} is not a setting here: forkfleet branches have no {other} to copy or share; the settings are history (copy), backend (copy) and message_queue (isolated)"
                ))
            }
        };
        if value.as_str() != Some(only) {
            return Err(format!(
                "{FORK_RUN}: isolation.{flag} = {value} is not offered: {why} ({flag} = \"{only}\", the default, is the only value)"
            ));
        }
    }
    Ok(())
}

fn strategy(name: &str) -> Result<Strategy, String> {
    Strategy::from_name(name, DEFAULT_THRESHOLD)
        .ok_or_else(|| format!("strategy `{name}` is not valid: {STRATEGY_NAMES}"))
}

/// The fork's state and its branches, as the model reads them.
fn describe(view: &ForkView) -> String {
    json!({
        "fork_id": view.fork_id.to_string(),
        "state": view.state.as_str(),
        "settled": matches!(view.state, ForkState::Settled) || view.state.is_resolved(),
        "branches": view.branches.iter().map(|b| json!({
            "label": b.label,
            "state": b.state.as_str(),
            "error": b.error,
            "turns": b.turns,
            "changes": b.changes,
            "cost_usd": b.cost_usd,
            // A branch waiting for a person's consent to a call (docs/APPROVALS.md).
            "waits_for_approval": b.approval.as_ref().map(|p| json!({
                "tool": p.tool,
                "call_id": p.call_id,
                "rule": p.rule,
            })),
            "blocked_calls": b.blocked.len(),
            "last_message_preview": b.last_message_preview,
        })).collect::<Vec<_>>(),
    })
    .to_string()
}

fn cut(mut s: String, max: usize) -> String {
    if s.len() > max {
        let mut end = max;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
        s.push_str("\n[... cut: ask for fewer paths with `paths`]");
    }
    s
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn isolation_flags_are_taken_where_they_mean_something_and_refused_by_name() {
        let ok =
            serde_json::json!({"history": "copy", "backend": "copy", "message_queue": "isolated"});
        assert!(check_isolation(&ok).is_ok());
        assert!(check_isolation(&serde_json::json!({})).is_ok());
        let shared = check_isolation(&serde_json::json!({"backend": "share"})).unwrap_err();
        assert!(
            shared.contains("isolation.backend = \"share\" is not offered")
                && shared.contains("copy-on-write"),
            "{shared}"
        );
        let queue = check_isolation(&serde_json::json!({"message_queue": "shared"})).unwrap_err();
        assert!(queue.contains("steered on its own"), "{queue}");
        let bus = check_isolation(&serde_json::json!({"team_bus": "shared"})).unwrap_err();
        assert!(
            bus.contains("isolation.team_bus is not a setting here"),
            "{bus}"
        );
        assert!(check_isolation(&serde_json::json!("copy"))
            .unwrap_err()
            .contains("must be an object"));
    }
}
