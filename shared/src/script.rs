//! The scripted model: deterministic turns read from a TOML file, for demos, tests and
//! benchmarks.
//!
//! ```toml
//! [defaults]                 # optional
//! usage = { input_tokens = 1000, output_tokens = 200 }
//! latency_ms = 0
//! latency_jitter_ms = 0      # up to this much more, fixed per (label, turn)
//!
//! [[turns."*"]]              # every branch without turns of its own
//! tool_calls = [{ name = "write_file", args = { path = "notes/{label}.md", content = "hi\n" } }]
//! repeat = 3                 # this turn three times; {repeat} is 0, 1, 2
//!
//! [[turns."*"]]
//! text = "done on {label}"
//!
//! [[turns.fast]]             # the branch labelled `fast`
//! text = "nothing to do"
//! ```
//!
//! The same script as JSON (a text starting with `{`), as programs write large ones:
//! `{"defaults": {...}, "turns": {"*": [{"tool_calls": [...], "repeat": 3}, ...]}}`.
//!
//! Placeholders in every string (text and tool arguments): `{label}` (branch label),
//! `{index}` (branch index from 0), `{turn}` (model call number in the branch from 0),
//! `{repeat}` (iteration within a repeated turn). A turn's usage defaults to
//! `[defaults].usage`, else it is estimated as one token per four characters of request and
//! response. When a branch calls the model after its last turn, the call fails with an
//! error naming the label and turn.

use crate::event::{ToolCall, Usage};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct Script {
    #[serde(default)]
    pub defaults: ScriptDefaults,
    /// Turns per branch label; `*` is the default for every other label.
    #[serde(default)]
    pub turns: BTreeMap<String, Vec<ScriptTurn>>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct ScriptDefaults {
    #[serde(default)]
    pub usage: Option<ScriptUsage>,
    #[serde(default)]
    pub latency_ms: u64,
    /// Each call takes up to this much longer than its latency: an amount fixed by the
    /// branch label and the turn (so runs repeat), spread evenly over `0..=jitter`. Real
    /// model calls do not all take the same time.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub latency_jitter_ms: u64,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

/// A number in `0..=max` fixed by `label` and `turn` (FNV-1a).
fn jitter(label: &str, turn: u32, max: u64) -> u64 {
    if max == 0 {
        return 0;
    }
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in label.bytes().chain(turn.to_le_bytes()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h % (max + 1)
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScriptUsage {
    pub input_tokens: u64,
    pub output_tokens: u64,
    #[serde(default)]
    pub cached_tokens: u64,
    #[serde(default)]
    pub cache_write_tokens: u64,
    #[serde(default)]
    pub reasoning_tokens: u64,
}

impl From<ScriptUsage> for Usage {
    fn from(u: ScriptUsage) -> Self {
        Usage {
            input_tokens: u.input_tokens,
            output_tokens: u.output_tokens,
            cached_tokens: u.cached_tokens,
            cache_write_tokens: u.cache_write_tokens,
            reasoning_tokens: u.reasoning_tokens,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct ScriptTurn {
    #[serde(default)]
    pub text: Option<String>,
    #[serde(default)]
    pub tool_calls: Vec<ScriptToolCall>,
    #[serde(default)]
    pub usage: Option<ScriptUsage>,
    #[serde(default)]
    pub latency_ms: Option<u64>,
    /// Play this turn this many times (default 1).
    #[serde(default)]
    pub repeat: Option<u32>,
    /// The finish reason the call reports (default `stop`, or `tool_calls` when it calls
    /// tools); `length` plays an answer cut at the output cap.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finish_reason: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScriptToolCall {
    pub name: String,
    #[serde(default = "empty_object")]
    pub args: serde_json::Value,
}

fn empty_object() -> serde_json::Value {
    serde_json::Value::Object(Default::default())
}

/// One turn as the model returns it.
#[derive(Debug, Clone, PartialEq)]
pub struct PlayedTurn {
    pub text: Option<String>,
    pub tool_calls: Vec<ToolCall>,
    /// `None`: estimate from sizes.
    pub usage: Option<Usage>,
    pub latency_ms: u64,
    /// The script's finish reason, if it gives one.
    pub finish_reason: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScriptError {
    #[error("invalid script: {0}")]
    Parse(String),
    #[error(
        "script has no turns for branch `{label}` and no `*` default (labels with turns: {known})"
    )]
    NoTurnsFor { label: String, known: String },
    #[error("script for branch `{label}` has {available} turns; the model was called for turn {turn} (0-based) after the script ended")]
    Exhausted {
        label: String,
        turn: u32,
        available: u32,
    },
    #[error("script turn {index} for `{label}` has neither text nor tool calls")]
    EmptyTurn { label: String, index: usize },
}

impl Script {
    /// Parse a script: TOML, or JSON when the text starts with `{` (no TOML document
    /// does). A program that writes a large script writes JSON: the fan-out benchmark's
    /// 1,000 x 10 script parses in a fraction of TOML's time, with none of its
    /// document-wide intermediate (TOML's peaked at twice the script's size).
    pub fn parse(text: &str) -> Result<Self, ScriptError> {
        // A byte order mark says nothing of the format (editors on Windows write one).
        let text = text.strip_prefix('\u{feff}').unwrap_or(text);
        let script: Script = if text.trim_start().starts_with('{') {
            serde_json::from_str(text).map_err(|e| ScriptError::Parse(format!("JSON: {e}")))?
        } else {
            toml::from_str(text).map_err(|e| ScriptError::Parse(e.to_string()))?
        };
        for (label, turns) in &script.turns {
            for (index, t) in turns.iter().enumerate() {
                if t.text.is_none() && t.tool_calls.is_empty() {
                    return Err(ScriptError::EmptyTurn {
                        label: label.clone(),
                        index,
                    });
                }
            }
        }
        Ok(script)
    }

    fn turns_for(&self, label: &str) -> Result<&[ScriptTurn], ScriptError> {
        self.turns
            .get(label)
            .or_else(|| self.turns.get("*"))
            .map(Vec::as_slice)
            .ok_or_else(|| ScriptError::NoTurnsFor {
                label: label.to_string(),
                known: self.turns.keys().cloned().collect::<Vec<_>>().join(", "),
            })
    }

    /// Check that a branch with this label has turns to play.
    pub fn check_label(&self, label: &str) -> Result<(), ScriptError> {
        self.turns_for(label).map(|_| ())
    }

    /// The turn a branch plays on its `turn`-th model call (0-based).
    pub fn play(&self, label: &str, index: u32, turn: u32) -> Result<PlayedTurn, ScriptError> {
        let turns = self.turns_for(label)?;
        let mut remaining = turn;
        let mut available = 0u32;
        for t in turns {
            let reps = t.repeat.unwrap_or(1);
            available = available.saturating_add(reps);
            if remaining < reps {
                let vars = Vars {
                    label,
                    index,
                    turn,
                    repeat: remaining,
                };
                return Ok(PlayedTurn {
                    text: t.text.as_deref().map(|s| vars.render(s)),
                    tool_calls: t
                        .tool_calls
                        .iter()
                        .enumerate()
                        .map(|(i, c)| ToolCall {
                            id: format!("call_{turn}_{i}"),
                            name: c.name.clone(),
                            args: vars.render_json(&c.args),
                        })
                        .collect(),
                    usage: t.usage.or(self.defaults.usage).map(Usage::from),
                    finish_reason: t.finish_reason.clone(),
                    latency_ms: t
                        .latency_ms
                        .unwrap_or(self.defaults.latency_ms)
                        .saturating_add(jitter(label, turn, self.defaults.latency_jitter_ms)),
                });
            }
            remaining -= reps;
        }
        Err(ScriptError::Exhausted {
            label: label.to_string(),
            turn,
            available,
        })
    }
}

struct Vars<'a> {
    label: &'a str,
    index: u32,
    turn: u32,
    repeat: u32,
}

impl Vars<'_> {
    fn render(&self, s: &str) -> String {
        if !s.contains('{') {
            return s.to_string();
        }
        s.replace("{label}", self.label)
            .replace("{index}", &self.index.to_string())
            .replace("{turn}", &self.turn.to_string())
            .replace("{repeat}", &self.repeat.to_string())
    }

    fn render_json(&self, v: &serde_json::Value) -> serde_json::Value {
        match v {
            serde_json::Value::String(s) => serde_json::Value::String(self.render(s)),
            serde_json::Value::Array(a) => {
                serde_json::Value::Array(a.iter().map(|x| self.render_json(x)).collect())
            }
            serde_json::Value::Object(o) => serde_json::Value::Object(
                o.iter()
                    .map(|(k, x)| (k.clone(), self.render_json(x)))
                    .collect(),
            ),
            other => other.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SCRIPT: &str = r#"
[defaults]
usage = { input_tokens = 10, output_tokens = 2 }

[[turns."*"]]
tool_calls = [{ name = "write_file", args = { path = "out/{label}-{repeat}.txt", content = "turn {turn}" } }]
repeat = 2

[[turns."*"]]
text = "done {label}#{index}"

[[turns.solo]]
text = "solo"
usage = { input_tokens = 1, output_tokens = 1 }
"#;

    #[test]
    fn plays_turns_with_repeat_and_placeholders() {
        let s = Script::parse(SCRIPT).unwrap();
        let t0 = s.play("a", 3, 0).unwrap();
        assert_eq!(t0.tool_calls[0].args["path"], "out/a-0.txt");
        let t1 = s.play("a", 3, 1).unwrap();
        assert_eq!(t1.tool_calls[0].args["path"], "out/a-1.txt");
        assert_eq!(t1.tool_calls[0].args["content"], "turn 1");
        assert_eq!(s.play("a", 3, 2).unwrap().text.as_deref(), Some("done a#3"));
        assert!(matches!(
            s.play("a", 3, 3),
            Err(ScriptError::Exhausted { available: 3, .. })
        ));
        assert_eq!(s.play("solo", 0, 0).unwrap().usage.unwrap().input_tokens, 1);
        assert_eq!(s.play("a", 0, 0).unwrap().usage.unwrap().input_tokens, 10);
    }

    #[test]
    fn jitter_is_fixed_per_label_and_turn_and_bounded() {
        let s = Script::parse(
            "[defaults]\nlatency_ms = 100\nlatency_jitter_ms = 50\n[[turns.\"*\"]]\ntext = \"t\"\nrepeat = 200",
        )
        .unwrap();
        let lat: Vec<u64> = (0..200)
            .map(|t| s.play("a", 0, t).unwrap().latency_ms)
            .collect();
        assert!(lat.iter().all(|l| (100..=150).contains(l)), "{lat:?}");
        assert!(lat.iter().any(|l| *l < 110) && lat.iter().any(|l| *l > 140));
        assert_eq!(s.play("a", 0, 7).unwrap(), s.play("a", 0, 7).unwrap());
        let plain = Script::parse("[[turns.\"*\"]]\ntext = \"t\"\nlatency_ms = 5").unwrap();
        assert_eq!(plain.play("x", 0, 0).unwrap().latency_ms, 5);
    }

    #[test]
    fn rejects_unknown_keys_and_empty_turns() {
        // JSON says the same as TOML, and is held to the same fields.
        let json = Script::parse(
            r#"{"defaults": {"latency_ms": 5}, "turns": {"*": [{"text": "t", "repeat": 2}]}}"#,
        )
        .unwrap();
        let toml =
            Script::parse("[defaults]\nlatency_ms = 5\n[[turns.\"*\"]]\ntext = \"t\"\nrepeat = 2")
                .unwrap();
        assert_eq!(json, toml);
        let bom = Script::parse(
            "\u{feff}{\"defaults\": {\"latency_ms\": 5}, \"turns\": {\"*\": [{\"text\": \"t\", \"repeat\": 2}]}}",
        )
        .unwrap();
        assert_eq!(bom, toml);
        let err = Script::parse(r#"{"turns": {"x": [{"txt": "typo"}]}}"#).unwrap_err();
        assert!(
            err.to_string().contains("JSON") && err.to_string().contains("txt"),
            "{err}"
        );
        let err = Script::parse(r#"{"turns": {"x": [{"repeat": 2}]}}"#).unwrap_err();
        assert!(matches!(err, ScriptError::EmptyTurn { .. }), "{err}");
        let err = Script::parse("[[turns.x]]\ntxt = \"typo\"").unwrap_err();
        assert!(err.to_string().contains("unknown field `txt`"), "{err}");
        let err = Script::parse("[[turns.x]]\nrepeat = 2").unwrap_err();
        assert!(matches!(err, ScriptError::EmptyTurn { .. }));
        let s = Script::parse("[[turns.x]]\ntext = \"t\"").unwrap();
        assert!(matches!(
            s.check_label("y"),
            Err(ScriptError::NoTurnsFor { .. })
        ));
    }
}
