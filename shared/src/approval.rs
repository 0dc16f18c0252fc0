//! Approvals (docs/APPROVALS.md): which tool calls wait for a person's consent.
//!
//! A spec's `[approval]` table (and a branch's `approval` table, which replaces it for that
//! branch) names the calls: every call of some tools, `run_command` calls whose command
//! line matches a pattern, and any write, edit or delete under some paths. A call that
//! needs consent is not run: its branch records an `approval_requested` event and stops,
//! `awaiting_approval`, holding no worker slot and no budget reservation; a person (or a
//! timeout, or a resolve that does not wait) decides, an `approval_decided` event, and any
//! worker goes on from the branch's log, running the call or answering it as denied.
//!
//! Here: the rules as written ([`ApprovalSection`]) and validated ([`ApprovalRules`]), the
//! compiled matcher ([`Gate`]), and the views of a pending request and a blocked call.

use crate::ids::{ForkId, RunId};
use crate::tools::ApprovalClass;
use globset::{Glob, GlobBuilder, GlobMatcher};
use serde::{Deserialize, Serialize};

/// The default `timeout_s`: an hour.
pub const DEFAULT_TIMEOUT_S: u64 = 3600;
/// The longest `timeout_s`: a week.
pub const MAX_TIMEOUT_S: u64 = 7 * 24 * 3600;

/// What a request nobody answered in time becomes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnTimeout {
    #[default]
    Deny,
    Approve,
}

impl OnTimeout {
    pub fn as_str(self) -> &'static str {
        match self {
            OnTimeout::Deny => "deny",
            OnTimeout::Approve => "approve",
        }
    }
}

/// `[approval]` as written in a spec (and a branch's `approval` table).
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApprovalSection {
    /// Every call of these tools.
    #[serde(default)]
    pub tools: Vec<String>,
    /// `run_command` calls whose command line (its words joined by spaces) matches one of
    /// these patterns (`*` any text, `?` one character, `[abc]` one of).
    #[serde(default)]
    pub run_command: Vec<String>,
    /// Any write, edit or delete of a path matching one of these patterns, or under a
    /// directory one names (`*` within a path segment, `**` across them).
    #[serde(default)]
    pub paths: Vec<String>,
    /// Seconds a request waits before `on_timeout` decides it.
    #[serde(default)]
    pub timeout_s: Option<u64>,
    /// `deny` (default) or `approve`.
    #[serde(default)]
    pub on_timeout: Option<OnTimeout>,
}

/// The approval rules of a fork or a branch, validated.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApprovalRules {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tools: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub run_command: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub paths: Vec<String>,
    pub timeout_s: u64,
    #[serde(default)]
    pub on_timeout: OnTimeout,
}

impl ApprovalSection {
    /// The rules, checked ([`ApprovalRules::check`]); `field` names the table in errors.
    pub fn build(&self, field: &str) -> Result<ApprovalRules, String> {
        let rules = ApprovalRules {
            tools: self.tools.clone(),
            run_command: self.run_command.clone(),
            paths: self.paths.clone(),
            timeout_s: self.timeout_s.unwrap_or(DEFAULT_TIMEOUT_S),
            on_timeout: self.on_timeout.unwrap_or_default(),
        };
        rules.check(field)?;
        Ok(rules)
    }
}

impl ApprovalRules {
    /// No call needs consent (an empty table, which a branch may use to lift the fork's).
    pub fn is_empty(&self) -> bool {
        self.tools.is_empty() && self.run_command.is_empty() && self.paths.is_empty()
    }

    /// Every tool known, every pattern valid, the timeout within 1 s to a week; each error
    /// names `field`'s key at fault and what is valid.
    pub fn check(&self, field: &str) -> Result<(), String> {
        for tool in &self.tools {
            if !crate::tools::is_known(tool) {
                return Err(format!(
                    "`{field}.tools` names `{tool}`, which is not a tool; valid: {}",
                    crate::tools::names().join(", ")
                ));
            }
        }
        for p in &self.run_command {
            command_glob(p).map_err(|e| format!("`{field}.run_command` pattern {e}"))?;
        }
        for p in &self.paths {
            path_glob(p).map_err(|e| format!("`{field}.paths` pattern {e}"))?;
        }
        if self.timeout_s == 0 || self.timeout_s > MAX_TIMEOUT_S {
            return Err(format!(
                "`{field}.timeout_s` is {}; give 1 to {MAX_TIMEOUT_S} seconds (a week)",
                self.timeout_s
            ));
        }
        Ok(())
    }

    /// The compiled matcher.
    pub fn gate(&self) -> Result<Gate, String> {
        self.check("approval")?;
        Ok(Gate {
            tools: self.tools.clone(),
            commands: self
                .run_command
                .iter()
                .map(|p| Ok((p.clone(), command_glob(p)?)))
                .collect::<Result<_, String>>()?,
            paths: self
                .paths
                .iter()
                .map(|p| Ok((p.clone(), path_glob(p)?)))
                .collect::<Result<_, String>>()?,
        })
    }
}

fn command_glob(p: &str) -> Result<GlobMatcher, String> {
    if p.trim().is_empty() {
        return Err("is empty; write the command line to match, e.g. `git push*`".into());
    }
    Glob::new(p.trim())
        .map(|g| g.compile_matcher())
        .map_err(|e| format!("`{p}` is not valid: {e}"))
}

fn path_glob(p: &str) -> Result<GlobMatcher, String> {
    let t = p.trim().trim_start_matches("./").trim_end_matches('/');
    if t.is_empty() {
        return Err(
            "is empty; write a workspace path or pattern, e.g. `migrations/**` or `*.lock`".into(),
        );
    }
    if t.starts_with('/') || t.split('/').any(|s| s == "..") {
        return Err(format!(
            "`{p}` is outside the workspace; patterns are relative to the workspace root"
        ));
    }
    GlobBuilder::new(t)
        .literal_separator(true)
        .build()
        .map(|g| g.compile_matcher())
        .map_err(|e| format!("`{p}` is not valid: {e}"))
}

/// The command line of `run_command` arguments: its `command` as written (a string,
/// trimmed) or its words joined by single spaces. `None` when it has neither.
pub fn command_line(args: &serde_json::Value) -> Option<String> {
    match args.get("command")? {
        serde_json::Value::String(s) => Some(s.trim().to_string()),
        serde_json::Value::Array(words) => Some(
            words
                .iter()
                .map(|w| w.as_str().map_or_else(|| w.to_string(), str::to_string))
                .collect::<Vec<_>>()
                .join(" "),
        ),
        _ => None,
    }
}

/// The rules, compiled: what decides whether a call waits.
#[derive(Debug, Clone)]
pub struct Gate {
    tools: Vec<String>,
    commands: Vec<(String, GlobMatcher)>,
    paths: Vec<(String, GlobMatcher)>,
}

impl Gate {
    /// The rule a call of `tool` with `args` matches (`tools: delete_file`, `run_command:
    /// git push*`, `paths: migrations/**`), the first in that order; `None` when it may
    /// run at once.
    pub fn needs(&self, tool: &str, args: &serde_json::Value) -> Option<String> {
        if self.tools.iter().any(|t| t == tool) {
            return Some(format!("tools: {tool}"));
        }
        let class = crate::tools::decl(tool).map(|t| t.approval);
        if class == Some(ApprovalClass::Command) {
            if let Some(line) = command_line(args) {
                if let Some((p, _)) = self.commands.iter().find(|(_, g)| g.is_match(&line)) {
                    return Some(format!("run_command: {p}"));
                }
            }
        }
        if class == Some(ApprovalClass::WritesPath) {
            let path = args.get("path")?.as_str()?;
            let path = path.trim().trim_start_matches("./").trim_end_matches('/');
            // The path, or any directory above it.
            let mut candidates = vec![path.to_string()];
            let mut rest = path;
            while let Some((dir, _)) = rest.rsplit_once('/') {
                candidates.push(dir.to_string());
                rest = dir;
            }
            for (p, g) in &self.paths {
                if candidates.iter().any(|c| g.is_match(c)) {
                    return Some(format!("paths: {p}"));
                }
            }
        }
        None
    }
}

/// Who decided a request that no person answered.
pub const BY_TIMEOUT: &str = "timeout";
/// Who decided a request a resolve that does not wait denied.
pub const BY_POLICY: &str = "policy";

/// A request waiting for an answer, as `forkfleet approvals` lists it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PendingApproval {
    pub call_id: String,
    pub tool: String,
    pub args: serde_json::Value,
    /// The rule that matched (`tools: delete_file`, `run_command: git push*`, ...).
    pub rule: String,
    pub requested_at_ms: u64,
    /// When `on_timeout` decides it.
    pub deadline_ms: u64,
    pub on_timeout: OnTimeout,
}

/// A pending request with where it waits: one row of `forkfleet approvals`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ApprovalView {
    pub fork_id: ForkId,
    pub label: String,
    pub run_id: RunId,
    #[serde(flatten)]
    pub request: PendingApproval,
}

/// A call that was not run: denied by a person or a policy, or timed out.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BlockedCall {
    pub call_id: String,
    pub tool: String,
    pub args: serde_json::Value,
    pub rule: String,
    /// Who decided: a person's identity (`admin`, a client's), [`BY_TIMEOUT`] or
    /// [`BY_POLICY`].
    pub by: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    pub decided_at_ms: u64,
}

/// What the model reads as the result of a call that was denied.
pub fn denied_output(by: &str, reason: Option<&str>, rule: &str) -> String {
    let who = match by {
        BY_TIMEOUT => "no one answered in time (the rule's on_timeout denies)".to_string(),
        BY_POLICY => "the fork's resolve does not wait for a person".to_string(),
        person => format!("denied by {person}"),
    };
    match reason {
        Some(r) if !r.trim().is_empty() => format!(
            "denied: this call needs approval ({rule}) and was not run: {who}; reason: {r}. Do not retry it as is: find another way or explain."
        ),
        _ => format!(
            "denied: this call needs approval ({rule}) and was not run: {who}. Do not retry it as is: find another way or explain."
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A call as the gate reads it: its tool and its arguments.
    fn call(name: &str, args: serde_json::Value) -> (String, serde_json::Value) {
        (name.to_string(), args)
    }

    fn rules(tools: &[&str], run: &[&str], paths: &[&str]) -> ApprovalRules {
        ApprovalSection {
            tools: tools.iter().map(|s| s.to_string()).collect(),
            run_command: run.iter().map(|s| s.to_string()).collect(),
            paths: paths.iter().map(|s| s.to_string()).collect(),
            timeout_s: None,
            on_timeout: None,
        }
        .build("approval")
        .unwrap()
    }

    fn needs(gate: &Gate, (tool, args): (String, serde_json::Value)) -> Option<String> {
        gate.needs(&tool, &args)
    }

    #[test]
    fn calls_match_tools_commands_and_paths() {
        let gate = rules(
            &["delete_file"],
            &["git push*", "rm -rf*"],
            &["migrations/**", "secrets"],
        )
        .gate()
        .unwrap();
        assert_eq!(
            needs(&gate, call("delete_file", json!({"path": "a.txt"}))).as_deref(),
            Some("tools: delete_file")
        );
        assert_eq!(
            needs(
                &gate,
                call("run_command", json!({"command": "git push origin main"}))
            )
            .as_deref(),
            Some("run_command: git push*")
        );
        assert_eq!(
            needs(
                &gate,
                call("run_command", json!({"command": ["rm", "-rf", "/x"]}))
            )
            .as_deref(),
            Some("run_command: rm -rf*")
        );
        assert_eq!(
            needs(&gate, call("run_command", json!({"command": "git status"}))),
            None
        );
        assert_eq!(
            needs(
                &gate,
                call(
                    "write_file",
                    json!({"path": "migrations/001/up.sql", "content": ""})
                )
            )
            .as_deref(),
            Some("paths: migrations/**")
        );
        // A directory named by a pattern covers what is under it.
        assert_eq!(
            needs(
                &gate,
                call("edit_file", json!({"path": "./secrets/key.pem"}))
            )
            .as_deref(),
            Some("paths: secrets")
        );
        assert_eq!(
            needs(
                &gate,
                call("write_file", json!({"path": "src/migrations.rs"}))
            ),
            None
        );
        // Reading is never gated by paths.
        assert_eq!(
            needs(
                &gate,
                call("read_file", json!({"path": "migrations/x.sql"}))
            ),
            None
        );
    }

    #[test]
    fn bad_rules_are_refused_naming_the_key() {
        let bad = |s: ApprovalSection, want: &str| {
            let e = s.build("approval").unwrap_err();
            assert!(e.contains(want), "{e}");
        };
        bad(
            ApprovalSection {
                tools: vec!["rm".into()],
                ..Default::default()
            },
            "`approval.tools` names `rm`, which is not a tool; valid: read_file",
        );
        bad(
            ApprovalSection {
                run_command: vec!["git [push".into()],
                ..Default::default()
            },
            "`approval.run_command` pattern `git [push` is not valid",
        );
        bad(
            ApprovalSection {
                paths: vec!["../etc/**".into()],
                ..Default::default()
            },
            "outside the workspace",
        );
        bad(
            ApprovalSection {
                timeout_s: Some(0),
                ..Default::default()
            },
            "`approval.timeout_s` is 0",
        );
        let toml_err = toml::from_str::<ApprovalSection>("tool = [\"x\"]").unwrap_err();
        assert!(
            toml_err.to_string().contains("unknown field `tool`"),
            "{toml_err}"
        );
    }

    #[test]
    fn denied_output_says_who_and_why() {
        let t = denied_output("admin", Some("not on main"), "tools: delete_file");
        assert!(t.starts_with("denied:") && t.contains("admin") && t.contains("not on main"));
        assert!(denied_output(BY_TIMEOUT, None, "r").contains("no one answered"));
    }
}
