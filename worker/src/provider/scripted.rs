//! The scripted provider: plays a [`Script`]'s turns, for demos, tests and benchmarks.
//!
//! The turn played is the request's `turn` (the branch's model calls so far), so a branch
//! resumed on another worker continues where it stopped. A turn's latency is slept (not at
//! all when 0; a call cancelled during it reports nothing); a turn without usage is
//! estimated as one token per four characters of the request's messages (input) and of the
//! reply (output).
//!
//! The provider is deterministic, so its [`ModelProvider::estimate`] of a call is exactly
//! the usage the call will report (the default bound when the script has no such turn: the
//! call then fails anyway).
//!
//! **Usage log.** A provider given a file ([`ScriptedProvider::with_usage_log`]) appends
//! one JSON line to it for every call that returns a reply: `{"model", "label", "index",
//! "turn", "input_tokens", "output_tokens", "cached_tokens", "at_ms"}`. A worker gives its
//! scripted models its [`WorkerConfig::scripted_usage_log`](crate::WorkerConfig), which the
//! `forkfleet` services set once, when they start, from the environment variable
//! `FORKFLEET_SCRIPTED_USAGE_LOG` ([`usage_log_from_env`]). The log is the provider's own
//! record of what was "spent", independent of the events, which benchmarks use to measure
//! true spend against a cap. The file is opened in append mode for each line and each line
//! is written with one `write_all`, so several worker processes can share it without
//! interleaving. A failed write is logged as a warning and never fails the call.

use super::{size_estimate, upper_bound_estimate, ModelProvider, ModelReply, ModelRequest};
use crate::cache::Memo;
use crate::error::WorkerError;
use async_trait::async_trait;
use forkfleet_shared::event::Usage;
use forkfleet_shared::protocol::now_ms;
use forkfleet_shared::script::{PlayedTurn, Script, ScriptError};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// The environment variable naming the usage log (see the module docs).
pub const USAGE_LOG_ENV: &str = "FORKFLEET_SCRIPTED_USAGE_LOG";

/// The usage log [`USAGE_LOG_ENV`] names, if it is set and not empty. Read it once, when
/// a service starts: providers never look at the environment.
pub fn usage_log_from_env() -> Option<PathBuf> {
    std::env::var_os(USAGE_LOG_ENV)
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
}

#[derive(Debug, Clone)]
pub struct ScriptedProvider {
    script: Arc<Script>,
    /// Where every completed call is appended, if anywhere.
    usage_log: Option<PathBuf>,
}

impl ScriptedProvider {
    /// A provider playing `script`, logging usage nowhere.
    pub fn new(script: impl Into<Arc<Script>>) -> Self {
        Self {
            script: script.into(),
            usage_log: None,
        }
    }

    /// Log usage to `path` (`None`: not at all).
    pub fn with_usage_log(mut self, path: Option<PathBuf>) -> Self {
        self.usage_log = path;
        self
    }

    /// Parse a script file's text.
    pub fn parse(text: &str) -> Result<Self, ScriptError> {
        Script::parse(text).map(Self::new)
    }
}

/// Scripts parsed in this process, by the hash of their text: every worker of the process
/// (the embedded system runs several) shares one parse of a script. A hash names one text,
/// so sharing across workers cannot mix scripts up. Parsing a large script is costly (the
/// fan-out benchmark's 1,000 x 10 script: about 90 ms), so it runs on a blocking thread,
/// never on the runtime's.
pub(crate) fn parsed_scripts() -> &'static Memo<Script> {
    static SCRIPTS: OnceLock<Memo<Script>> = OnceLock::new();
    SCRIPTS.get_or_init(|| Memo::new(SCRIPTS_KEPT))
}

/// Most parsed scripts a process keeps (the oldest is forgotten first).
const SCRIPTS_KEPT: usize = 64;

/// Parse `bytes` as a script off the runtime's threads.
pub(crate) async fn parse_blocking(bytes: bytes::Bytes) -> Result<Script, WorkerError> {
    tokio::task::spawn_blocking(move || {
        let text = std::str::from_utf8(&bytes).map_err(|_| WorkerError::ScriptEncoding)?;
        Ok(Script::parse(text)?)
    })
    .await
    .map_err(|e| WorkerError::NodeStopped(format!("parsing a script stopped: {e}")))?
}

/// The usage a played turn reports for `req`: the script's, else estimated from sizes.
fn usage_of(played: &PlayedTurn, req: &ModelRequest<'_>) -> Usage {
    played
        .usage
        .unwrap_or_else(|| size_estimate(req.messages, played.text.as_deref(), &played.tool_calls))
}

/// Append one call's usage to the log at `path` (see the module docs).
fn log_usage(path: &Path, req: &ModelRequest<'_>, usage: &Usage) {
    let line = serde_json::json!({
        "model": req.model,
        "label": req.label,
        "index": req.index,
        "turn": req.turn,
        "input_tokens": usage.input_tokens,
        "output_tokens": usage.output_tokens,
        "cached_tokens": usage.cached_tokens,
        "at_ms": now_ms(),
    });
    let mut bytes = line.to_string().into_bytes();
    bytes.push(b'\n');
    let written = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .and_then(|mut f| f.write_all(&bytes));
    if let Err(e) = written {
        tracing::warn!(path = %path.display(), error = %e, "could not append to the scripted usage log");
    }
}

#[async_trait]
impl ModelProvider for ScriptedProvider {
    async fn complete(&self, req: &ModelRequest<'_>) -> Result<ModelReply, WorkerError> {
        let played = self.script.play(req.label, req.index, req.turn)?;
        if played.latency_ms > 0 {
            tokio::time::sleep(Duration::from_millis(played.latency_ms)).await;
        }
        let usage = usage_of(&played, req);
        if let Some(path) = &self.usage_log {
            log_usage(path, req, &usage);
        }
        // What an API would say: the model as named, and why it stopped.
        let finish_reason = played.finish_reason.unwrap_or_else(|| {
            if played.tool_calls.is_empty() {
                "stop".to_string()
            } else {
                "tool_calls".to_string()
            }
        });
        Ok(ModelReply {
            text: played.text,
            tool_calls: played.tool_calls,
            usage,
            response_model: Some(crate::genai::model_name(req.model).to_string()),
            finish_reason: Some(finish_reason),
            reasoning: None,
        })
    }

    /// Exactly what the call will report.
    fn estimate(&self, req: &ModelRequest<'_>) -> Usage {
        match self.script.play(req.label, req.index, req.turn) {
            Ok(played) => usage_of(&played, req),
            Err(_) => upper_bound_estimate(req),
        }
    }

    fn estimate_is_exact(&self) -> bool {
        true
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use forkfleet_shared::event::Message;

    fn req<'a>(messages: &'a [Message], turn: u32) -> ModelRequest<'a> {
        ModelRequest {
            model: "scripted:t",
            messages,
            tools: &[],
            max_output_tokens: 100,
            label: "a",
            index: 0,
            turn,
            temperature: None,
            cache_key: None,
            shared_prefix: 0,
            spend_cap: None,
            meter: None,
        }
    }

    #[tokio::test]
    async fn plays_turns_and_estimates_exactly_the_usage_reported() {
        let p = ScriptedProvider::parse(
            r#"
[[turns."*"]]
text = "12345678"

[[turns."*"]]
text = "x"
usage = { input_tokens = 7, output_tokens = 3, cached_tokens = 2 }
"#,
        )
        .unwrap();
        let history = vec![Message::User {
            text: "abcdefghi".into(),
        }];
        // Turn 0 has no usage in the script: one token per four characters of request (9)
        // and reply (8). Turn 1 reports the script's.
        for (turn, text, usage) in [(0, "12345678", (3, 2, 0)), (1, "x", (7, 3, 2))] {
            let r = req(&history, turn);
            let estimate = p.estimate(&r);
            let reply = p.complete(&r).await.unwrap();
            assert_eq!(reply.text.as_deref(), Some(text));
            let (input_tokens, output_tokens, cached_tokens) = usage;
            let expected = Usage {
                input_tokens,
                output_tokens,
                cached_tokens,
                cache_write_tokens: 0,
                reasoning_tokens: 0,
            };
            assert_eq!((reply.usage, estimate), (expected, expected), "turn {turn}");
        }
        // Past the script's end the call fails; the estimate is the default bound.
        let r2 = req(&history, 2);
        let err = p.complete(&r2).await.unwrap_err().to_string();
        assert!(err.contains("after the script ended"), "{err}");
        assert_eq!(p.estimate(&r2), upper_bound_estimate(&r2));
    }

    #[tokio::test]
    async fn completed_calls_are_appended_to_the_usage_log() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("usage.jsonl");
        let p = ScriptedProvider::parse(
            "[[turns.\"*\"]]\ntext = \"a\"\nusage = { input_tokens = 5, output_tokens = 6 }\nrepeat = 2\n\n[[turns.\"*\"]]\ntext = \"slow\"\nlatency_ms = 60000",
        )
        .unwrap()
        .with_usage_log(Some(path.clone()));
        p.complete(&req(&[], 0)).await.unwrap();
        p.complete(&req(&[], 1)).await.unwrap();
        // A call cancelled (dropped) during its latency logs nothing.
        let cancelled =
            tokio::time::timeout(Duration::from_millis(20), p.complete(&req(&[], 2))).await;
        assert!(cancelled.is_err());
        let text = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 2, "{text}");
        for (turn, l) in lines.iter().enumerate() {
            assert_eq!(l["model"], "scripted:t");
            assert_eq!(l["label"], "a");
            assert_eq!(l["index"], 0);
            assert_eq!(l["turn"], turn);
            assert_eq!(
                (&l["input_tokens"], &l["output_tokens"], &l["cached_tokens"]),
                (
                    &serde_json::json!(5),
                    &serde_json::json!(6),
                    &serde_json::json!(0)
                )
            );
            assert!(l["at_ms"].as_u64().unwrap() > 0);
        }
        // A log that cannot be written is not an error of the call.
        let broken = p.with_usage_log(Some(dir.path().join("no/such/dir/u.jsonl")));
        assert!(broken.complete(&req(&[], 0)).await.is_ok());
    }

    #[tokio::test(start_paused = true)]
    async fn sleeps_the_latency() {
        let p = ScriptedProvider::parse("[[turns.\"*\"]]\ntext = \"t\"\nlatency_ms = 500").unwrap();
        let start = tokio::time::Instant::now();
        p.complete(&req(&[], 0)).await.unwrap();
        assert!(start.elapsed() >= Duration::from_millis(500));
    }
}
