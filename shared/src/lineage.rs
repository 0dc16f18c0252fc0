//! Lineage and replay: forking a recorded run at any event (`forkfleet runs fork`,
//! docs/LINEAGE.md). The pure rules live here; the coordinator applies them to its store
//! (`coordinator/src/lineage.rs`) and the workers re-execute a replayed prefix
//! (`worker/src/agent/replay.rs`).
//!
//! - **Copy rules** ([`copy_plan`]): a child's seq 0 is its `fork` lineage event; the
//!   parent's *replayable* events on its history through the cutoff (inclusive, rewinds
//!   honoured) are copied from seq 1 on; usage, file changes, status, checkpoints, earlier
//!   lineage events and branch summaries are not ([`is_replayable`]).
//! - **Settings** ([`RunSettings`], [`apply_set`]): what `--set KEY=VALUE` may change,
//!   type-checked, an unknown key named with the closest valid one.
//! - **Request hashes** ([`RequestHash`], [`tool_call_hash`]): what a model response and a
//!   tool result are recorded with, so a replay can serve them from the record while the
//!   requests match and name the first differing part when they do not.
//! - **Summaries** ([`deterministic_summary`]): the operational summary `--summarize`
//!   records after a copied prefix.

use crate::event::{Event, Message, ToolCall};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::fmt::Write as _;

/// The strategy a child's lineage event names: its prefix is the parent's replayable
/// events through the cutoff, renumbered from seq 1.
pub const STRATEGY: &str = "replay_v1";

/// The deterministic summary's name, recorded in its text.
pub const SUMMARY_V1: &str = "deterministic_operational_summary_v1";

/// The kinds a child copies from its parent ([`is_replayable`]), for error messages.
pub const REPLAYABLE_KINDS: &[&str] = &[
    "system",
    "user_message",
    "model_response",
    "tool_result",
    "steer",
    "follow_up",
];

/// True for the events a child copies from its parent: the conversation itself. Not
/// usage (accounting, never model context), file changes (the child's workspace is rebuilt
/// from them instead), status, checkpoints, rewinds, earlier lineage events and branch
/// summaries (interpretive: a child records its own).
pub fn is_replayable(e: &Event) -> bool {
    e.is_conversational() && !matches!(e, Event::BranchSummary { .. })
}

/// What a child copies from its parent's log.
#[derive(Debug, Clone, PartialEq)]
pub struct CopyPlan {
    /// The parent's seq and event, in order: the child holds them at seqs 1, 2, ...
    pub copied: Vec<(u64, Event)>,
    /// Events on the parent's history through the cutoff that are not copied, by kind.
    pub skipped: BTreeMap<String, u64>,
}

/// Where a child may be cut from a parent's log: the replayable seqs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CutoffError {
    pub asked: u64,
    /// What the asked seq holds (`None`: beyond the log).
    pub kind: Option<&'static str>,
    /// The lowest and highest replayable seq (`None`: the log has none).
    pub range: Option<(u64, u64)>,
    /// The replayable seqs nearest the asked one, below and above.
    pub nearest: (Option<u64>, Option<u64>),
}

impl std::fmt::Display for CutoffError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.kind {
            None => write!(f, "seq {} is beyond the log", self.asked)?,
            Some(kind) => write!(
                f,
                "seq {} is a `{kind}` event, which a child does not copy",
                self.asked
            )?,
        }
        match self.range {
            None => write!(f, "; the log has no replayable event"),
            Some((lo, hi)) => {
                write!(
                    f,
                    "; fork at a replayable event ({}), from {lo} to {hi}",
                    REPLAYABLE_KINDS.join(", ")
                )?;
                let near: Vec<String> = [self.nearest.0, self.nearest.1]
                    .into_iter()
                    .flatten()
                    .map(|s| s.to_string())
                    .collect();
                if !near.is_empty() {
                    write!(f, " (nearest: {})", near.join(" or "))?;
                }
                Ok(())
            }
        }
    }
}

/// The cutoff a fork of `log` takes: `asked`, checked to be a replayable event of the
/// log, or by default the highest replayable seq.
pub fn cutoff(log: &[(u64, Event)], asked: Option<u64>) -> Result<u64, CutoffError> {
    let replayable: Vec<u64> = log
        .iter()
        .filter(|(_, e)| is_replayable(e))
        .map(|(s, _)| *s)
        .collect();
    let range = replayable
        .first()
        .zip(replayable.last())
        .map(|(a, b)| (*a, *b));
    let error = |asked: u64, kind| CutoffError {
        asked,
        kind,
        range,
        nearest: (
            replayable.iter().rev().find(|s| **s < asked).copied(),
            replayable.iter().find(|s| **s > asked).copied(),
        ),
    };
    match asked {
        None => range.map(|(_, hi)| hi).ok_or_else(|| error(0, None)),
        Some(seq) => match log.binary_search_by_key(&seq, |(s, _)| *s) {
            Err(_) => Err(error(seq, None)),
            Ok(i) if !is_replayable(&log[i].1) => Err(error(seq, Some(log[i].1.kind()))),
            Ok(_) => Ok(seq),
        },
    }
}

/// The events a child of `log` cut at `cutoff` copies (the history at the cutoff, rewinds
/// honoured, see [`crate::event::history_at`]), and what it leaves out.
pub fn copy_plan(log: &[(u64, Event)], cutoff: u64) -> CopyPlan {
    let mut copied = Vec::new();
    let mut skipped: BTreeMap<String, u64> = BTreeMap::new();
    for i in crate::event::history_at(log, Some(cutoff)) {
        let (seq, event) = &log[i];
        if is_replayable(event) {
            copied.push((*seq, event.clone()));
        } else {
            *skipped.entry(event.kind().to_string()).or_default() += 1;
        }
    }
    CopyPlan { copied, skipped }
}

// ---- settings ---------------------------------------------------------------------------

/// The settings of a run that `--set` may change.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunSettings {
    /// `provider:name`.
    pub model: String,
    /// The sampling temperature sent with every call (`None`: the provider's default).
    pub temperature: Option<f64>,
    /// The system prompt at the start of the history.
    pub system_prompt: Option<String>,
    /// Model calls per turn.
    pub max_turns: u32,
    /// Output tokens per call.
    pub max_output_tokens: u32,
    /// The run's own spending cap, USD.
    pub budget_usd: Option<f64>,
    /// The `run_command` tool.
    pub run_command: bool,
    /// The fork tools (`fork_run`, ...).
    pub forking: bool,
}

/// Every key `--set` takes, with the type of its value.
pub const SETTING_KEYS: &[(&str, &str)] = &[
    ("model", "a model `provider:name`"),
    ("temperature", "a number from 0 to 2, or `none`"),
    ("system_prompt", "a text, or `none`"),
    ("max_turns", "a whole number from 1 to 10000"),
    ("max_output_tokens", "a whole number from 1 to 1000000"),
    ("budget", "USD above 0, or `none`"),
    ("tools.run_command", "true or false"),
    ("tools.forking", "true or false"),
];

/// Why a `--set` was refused: nothing is written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SetError {
    /// Not `KEY=VALUE`.
    Syntax { arg: String },
    UnknownKey {
        key: String,
        suggestion: Option<&'static str>,
    },
    BadValue {
        key: &'static str,
        value: String,
        expected: &'static str,
    },
}

impl std::fmt::Display for SetError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let keys = || {
            SETTING_KEYS
                .iter()
                .map(|(k, _)| *k)
                .collect::<Vec<_>>()
                .join(", ")
        };
        match self {
            SetError::Syntax { arg } => write!(
                f,
                "--set `{}` is not KEY=VALUE; valid keys: {}",
                crate::api::limits::truncated(arg),
                keys()
            ),
            SetError::UnknownKey { key, suggestion } => {
                write!(
                    f,
                    "--set: unknown key `{}`",
                    crate::api::limits::truncated(key)
                )?;
                if let Some(s) = suggestion {
                    write!(f, " (did you mean `{s}`?)")?;
                }
                write!(f, "; valid keys: {}", keys())
            }
            SetError::BadValue {
                key,
                value,
                expected,
            } => write!(
                f,
                "--set {key}: `{}` is not {expected}",
                crate::api::limits::truncated(value)
            ),
        }
    }
}

/// The closest key to a mistyped one (a dotted key named without its section, or an edit
/// distance of at most a third of its length, at least 2), for "did you mean".
fn closest_key(key: &str) -> Option<&'static str> {
    let lower = key.to_ascii_lowercase();
    if let Some((k, _)) = SETTING_KEYS
        .iter()
        .find(|(k, _)| k.rsplit_once('.').is_some_and(|(_, last)| last == lower))
    {
        return Some(k);
    }
    SETTING_KEYS
        .iter()
        .map(|(k, _)| (*k, edit_distance(&lower, k)))
        .filter(|(k, d)| *d <= (k.len() / 3).max(2))
        .min_by_key(|(_, d)| *d)
        .map(|(k, _)| k)
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let cur = row[j + 1];
            row[j + 1] = if ca == *cb {
                prev
            } else {
                1 + prev.min(row[j]).min(cur)
            };
            prev = cur;
        }
    }
    row[b.len()]
}

/// Split `KEY=VALUE`.
pub fn parse_set(arg: &str) -> Result<(String, String), SetError> {
    match arg.split_once('=') {
        Some((k, v)) if !k.trim().is_empty() => Ok((k.trim().to_string(), v.to_string())),
        _ => Err(SetError::Syntax {
            arg: arg.to_string(),
        }),
    }
}

/// Apply one `--set KEY=VALUE` to `settings`, type-checked. A model name is checked for its
/// form here; whether the plan can run it is the plan's validation.
pub fn apply_set(settings: &mut RunSettings, key: &str, value: &str) -> Result<(), SetError> {
    let Some((key, expected)) = SETTING_KEYS.iter().find(|(k, _)| *k == key) else {
        return Err(SetError::UnknownKey {
            key: key.to_string(),
            suggestion: closest_key(key),
        });
    };
    let bad = || SetError::BadValue {
        key,
        value: value.to_string(),
        expected,
    };
    let none = value.trim().eq_ignore_ascii_case("none");
    let number = |lo: f64, hi: f64| -> Result<f64, SetError> {
        value
            .trim()
            .parse::<f64>()
            .ok()
            .filter(|x| x.is_finite() && *x >= lo && *x <= hi)
            .ok_or_else(bad)
    };
    let whole = |hi: u32| -> Result<u32, SetError> {
        value
            .trim()
            .parse::<u32>()
            .ok()
            .filter(|x| (1..=hi).contains(x))
            .ok_or_else(bad)
    };
    let flag = || -> Result<bool, SetError> {
        match value.trim() {
            "true" => Ok(true),
            "false" => Ok(false),
            _ => Err(bad()),
        }
    };
    match *key {
        "model" => {
            crate::spec::split_model(value.trim()).map_err(|_| bad())?;
            settings.model = value.trim().to_string();
        }
        "temperature" => settings.temperature = if none { None } else { Some(number(0.0, 2.0)?) },
        "system_prompt" => {
            settings.system_prompt = if none || value.is_empty() {
                None
            } else {
                Some(value.to_string())
            }
        }
        "max_turns" => settings.max_turns = whole(10_000)?,
        "max_output_tokens" => settings.max_output_tokens = whole(1_000_000)?,
        "budget" => {
            settings.budget_usd = if none {
                None
            } else {
                let usd = number(0.0, f64::MAX)?;
                if usd <= 0.0 {
                    return Err(bad());
                }
                Some(usd)
            }
        }
        "tools.run_command" => settings.run_command = flag()?,
        "tools.forking" => settings.forking = flag()?,
        _ => return Err(bad()),
    }
    Ok(())
}

// ---- request hashes ---------------------------------------------------------------------

/// The content hash of a model request, recorded with its response: the hash of its parts
/// (model, messages, tools, temperature, max_output_tokens; what changes the answer) and
/// each part's own hash, so a mismatch names the first part that differs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestHash {
    /// 32 hex digits (128 bits of SHA-256 over the parts' hashes).
    pub hash: String,
    /// `(part, hash)` in order; `messages` also carries the message count.
    pub parts: Vec<(String, String)>,
}

/// 32 hex digits of SHA-256.
fn short_hash(bytes: &[u8]) -> String {
    let digest = Sha256::digest(bytes);
    hex::encode(&digest[..16])
}

/// The hash of a history of messages, extended as the history grows (a chain: each
/// message's canonical JSON hashed onto the previous hash), so a branch pays for the new
/// messages of each call only.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MessagesHash {
    count: usize,
    state: [u8; 32],
}

impl MessagesHash {
    /// The hash of `messages`, reusing what was hashed when they extend the messages hashed
    /// before (else hashed from the start).
    pub fn update(&mut self, messages: &[Message]) {
        if messages.len() < self.count {
            *self = MessagesHash::default();
        }
        for m in &messages[self.count..] {
            let mut h = Sha256::new();
            h.update(self.state);
            // A message always serialises (plain strings and JSON values).
            h.update(serde_json::to_vec(m).unwrap_or_default());
            self.state = h.finalize().into();
        }
        self.count = messages.len();
    }

    pub fn count(&self) -> usize {
        self.count
    }

    fn hex(&self) -> String {
        hex::encode(&self.state[..16])
    }
}

impl RequestHash {
    /// The hash of the tool schemas a request offers (a branch's are the same at every
    /// call: it hashes them once).
    pub fn tools_hash<T: Serialize + ?Sized>(tools: &T) -> String {
        short_hash(&serde_json::to_vec(tools).unwrap_or_default())
    }

    /// The hash of a request; `messages` is the history's [`MessagesHash`] (updated to the
    /// request's messages), `tools` the [`RequestHash::tools_hash`] of the schemas offered.
    pub fn of(
        model: &str,
        messages: &MessagesHash,
        tools: &str,
        temperature: Option<f64>,
        max_output_tokens: u32,
    ) -> RequestHash {
        RequestHasher::new(model, tools, temperature, max_output_tokens).hash(messages)
    }

    fn from_parts(parts: Vec<(String, String)>) -> RequestHash {
        let mut all = Sha256::new();
        for (name, h) in &parts {
            all.update(name.as_bytes());
            all.update(b"=");
            all.update(h.as_bytes());
            all.update(b"\n");
        }
        RequestHash {
            hash: hex::encode(&all.finalize()[..16]),
            parts,
        }
    }

    /// The first part that differs from `recorded`'s (`None`: the same request).
    pub fn first_difference(&self, recorded: &RequestHash) -> Option<String> {
        if self.hash == recorded.hash {
            return None;
        }
        for (name, h) in &self.parts {
            match recorded.parts.iter().find(|(n, _)| n == name) {
                Some((_, r)) if r == h => continue,
                Some((_, r)) if name == "messages" => {
                    let count = |s: &str| s.split(':').next().unwrap_or("?").to_string();
                    return Some(format!(
                        "messages ({} in the recorded request, {} now)",
                        count(r),
                        count(h)
                    ));
                }
                _ => return Some(name.clone()),
            }
        }
        Some("the request's form (recorded by another version)".to_string())
    }
}

/// A branch's request hashes: the parts that are the same at every call of a task (model,
/// tools, temperature, output cap) hashed once, the messages at each call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestHasher {
    model: String,
    tools: String,
    temperature: String,
    max_output_tokens: String,
}

impl RequestHasher {
    /// `tools` is the [`RequestHash::tools_hash`] of the schemas offered.
    pub fn new(
        model: &str,
        tools: &str,
        temperature: Option<f64>,
        max_output_tokens: u32,
    ) -> RequestHasher {
        RequestHasher {
            model: short_hash(model.as_bytes()),
            tools: tools.to_string(),
            temperature: short_hash(format!("{temperature:?}").as_bytes()),
            max_output_tokens: short_hash(max_output_tokens.to_string().as_bytes()),
        }
    }

    /// The hash of the request whose history `messages` hashes.
    pub fn hash(&self, messages: &MessagesHash) -> RequestHash {
        RequestHash::from_parts(vec![
            ("model".to_string(), self.model.clone()),
            (
                "messages".to_string(),
                format!("{}:{}", messages.count(), messages.hex()),
            ),
            ("tools".to_string(), self.tools.clone()),
            ("temperature".to_string(), self.temperature.clone()),
            (
                "max_output_tokens".to_string(),
                self.max_output_tokens.clone(),
            ),
        ])
    }
}

/// The hash a tool result is recorded with: the call's tool name and arguments.
pub fn tool_call_hash(call: &ToolCall) -> String {
    let mut bytes = call.name.as_bytes().to_vec();
    bytes.push(0);
    // serde_json::Value orders object keys: the same arguments hash the same.
    bytes.extend(serde_json::to_vec(&call.args).unwrap_or_default());
    short_hash(&bytes)
}

// ---- summaries --------------------------------------------------------------------------

/// How `--summarize` writes a child's branch summary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SummaryMode {
    /// [`deterministic_summary`]: counts and names from the log, no model call.
    Deterministic,
    /// Written by the run's model through its provider (a resolve-style job on a worker).
    Model,
}

/// The characters of the last answer a summary quotes.
const EXCERPT_CHARS: usize = 280;
/// The files a summary names before it counts the rest.
const FILES_NAMED: usize = 12;

/// The deterministic operational summary of `history` (a parent's events on its history
/// through the cutoff, file changes included): model turns, tool calls by name, files
/// touched, an excerpt of the last answer. Lossy by design; the copied events stay the
/// record.
pub fn deterministic_summary(parent: &str, cutoff: u64, history: &[&Event]) -> String {
    let mut turns = 0u32;
    // Calls as the model made them: one whose result came after the cutoff counts too.
    let mut tools: BTreeMap<&str, u32> = BTreeMap::new();
    let mut unanswered: Vec<&str> = Vec::new();
    let mut files: Vec<String> = Vec::new();
    let mut last_answer: Option<&str> = None;
    for e in history {
        match e {
            Event::ModelResponse {
                text, tool_calls, ..
            } => {
                turns += 1;
                if let Some(t) = text.as_deref().filter(|t| !t.trim().is_empty()) {
                    last_answer = Some(t);
                }
                unanswered.clear();
                for c in tool_calls {
                    *tools.entry(c.name.as_str()).or_default() += 1;
                    unanswered.push(c.id.as_str());
                }
            }
            Event::ToolResult { call_id, .. } => unanswered.retain(|c| *c != call_id.as_str()),
            Event::FileChange { change } => {
                let p = change.path().to_string();
                if !files.contains(&p) {
                    files.push(p);
                }
            }
            _ => {}
        }
    }
    let mut out = format!(
        "[{SUMMARY_V1}; lossy: the events before this are the record] Run {parent} through seq {cutoff}: {turns} model turn{}",
        if turns == 1 { "" } else { "s" }
    );
    if tools.is_empty() {
        out.push_str("; no tool calls");
    } else {
        let list: Vec<String> = tools.iter().map(|(n, c)| format!("{n} x{c}")).collect();
        let _ = write!(out, "; tool calls: {}", list.join(", "));
        if !unanswered.is_empty() {
            let _ = write!(
                out,
                " ({} without a result at the cutoff)",
                unanswered.len()
            );
        }
    }
    if files.is_empty() {
        out.push_str("; no files touched");
    } else {
        let named: Vec<&str> = files.iter().take(FILES_NAMED).map(String::as_str).collect();
        let _ = write!(out, "; files touched: {}", named.join(", "));
        if files.len() > FILES_NAMED {
            let _ = write!(out, " (+{} more)", files.len() - FILES_NAMED);
        }
    }
    match last_answer {
        Some(t) => {
            let excerpt: String = t.chars().take(EXCERPT_CHARS).collect();
            let more = if t.chars().count() > EXCERPT_CHARS {
                "..."
            } else {
                ""
            };
            let _ = write!(out, "; last answer: \"{}{more}\"", excerpt.trim());
        }
        None => out.push_str("; no answer yet"),
    }
    out.push('.');
    out
}

/// The most characters of the run a model summary's prompt quotes (its latest part).
pub const SUMMARY_PROMPT_CHARS: usize = 24_000;

/// What the model is asked for `--summarize=model`: the run's conversation through the
/// cutoff (its last [`SUMMARY_PROMPT_CHARS`] characters) and the files it touched.
pub fn summary_prompt(history: &[Event]) -> String {
    let mut body = String::new();
    for m in crate::event::messages_from_events(history.iter()) {
        let line = match m {
            Message::System { text } => format!("[system] {text}"),
            Message::User { text } => format!("[user] {text}"),
            Message::Assistant {
                text, tool_calls, ..
            } => {
                let calls: Vec<String> = tool_calls
                    .iter()
                    .map(|c| format!("{}({})", c.name, c.args))
                    .collect();
                format!(
                    "[assistant] {}{}",
                    text.unwrap_or_default(),
                    if calls.is_empty() {
                        String::new()
                    } else {
                        format!(" calls: {}", calls.join(", "))
                    }
                )
            }
            Message::Tool { name, output, .. } => format!("[tool {name}] {output}"),
        };
        body.push_str(&line);
        body.push('\n');
    }
    let start = body
        .char_indices()
        .rev()
        .nth(SUMMARY_PROMPT_CHARS)
        .map_or(0, |(i, _)| i);
    let mut files: Vec<String> = Vec::new();
    for e in history {
        if let Event::FileChange { change } = e {
            let p = change.path().to_string();
            if !files.contains(&p) {
                files.push(p);
            }
        }
    }
    format!(
        "Summarise this agent run for whoever continues it: what it was asked, what it did, what it found, what is left. Be brief and concrete; name files.\n\nFiles touched: {}\n\nThe run{}:\n{}",
        if files.is_empty() { "none".to_string() } else { files.join(", ") },
        if start > 0 { " (its latest part)" } else { "" },
        &body[start..]
    )
}

#[cfg(test)]
#[path = "lineage/tests.rs"]
mod tests;
