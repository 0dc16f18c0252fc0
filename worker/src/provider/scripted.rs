//! The scripted provider: plays a [`Script`]'s turns, for demos, tests and benchmarks.
//!
//! The turn played is the request's `turn` (the branch's model calls so far), so a branch
//! resumed on another worker continues where it stopped. A turn's latency is slept (not at
//! all when 0); a turn without usage is estimated as one token per four characters of the
//! request's messages (input) and of the reply (output).

use super::{
    estimate_tokens, message_chars, tool_call_chars, ModelProvider, ModelReply, ModelRequest,
    ProviderError,
};
use async_trait::async_trait;
use forkfleet_shared::event::Usage;
use forkfleet_shared::script::{Script, ScriptError};
use std::time::Duration;

#[derive(Debug, Clone)]
pub struct ScriptedProvider {
    script: Script,
}

impl ScriptedProvider {
    pub fn new(script: Script) -> Self {
        Self { script }
    }

    /// Parse a script file's text.
    pub fn parse(text: &str) -> Result<Self, ScriptError> {
        Script::parse(text).map(Self::new)
    }

    pub fn script(&self) -> &Script {
        &self.script
    }
}

#[async_trait]
impl ModelProvider for ScriptedProvider {
    async fn complete(&self, req: &ModelRequest<'_>) -> Result<ModelReply, ProviderError> {
        let played = self.script.play(req.label, req.index, req.turn)?;
        if played.latency_ms > 0 {
            tokio::time::sleep(Duration::from_millis(played.latency_ms)).await;
        }
        let usage = match played.usage {
            Some(u) => u,
            None => {
                let output = played
                    .text
                    .as_deref()
                    .map_or(0, |t| t.chars().count() as u64)
                    + tool_call_chars(&played.tool_calls);
                Usage {
                    input_tokens: estimate_tokens(message_chars(req.messages)),
                    output_tokens: estimate_tokens(output),
                    cached_tokens: 0,
                }
            }
        };
        Ok(ModelReply {
            text: played.text,
            tool_calls: played.tool_calls,
            usage,
        })
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
        }
    }

    #[tokio::test]
    async fn plays_turns_and_estimates_usage() {
        let p = ScriptedProvider::parse(
            r#"
[[turns."*"]]
text = "12345678"

[[turns."*"]]
text = "x"
usage = { input_tokens = 7, output_tokens = 3 }
"#,
        )
        .unwrap();
        let history = vec![Message::User {
            text: "abcdefghi".into(),
        }];
        let r0 = p.complete(&req(&history, 0)).await.unwrap();
        assert_eq!(r0.text.as_deref(), Some("12345678"));
        assert_eq!(r0.usage.input_tokens, 3);
        assert_eq!(r0.usage.output_tokens, 2);
        let r1 = p.complete(&req(&history, 1)).await.unwrap();
        assert_eq!(r1.usage.input_tokens, 7);
        let err = p.complete(&req(&history, 2)).await.unwrap_err().to_string();
        assert!(err.contains("after the script ended"), "{err}");
    }

    #[tokio::test(start_paused = true)]
    async fn sleeps_the_latency() {
        let p = ScriptedProvider::parse("[[turns.\"*\"]]\ntext = \"t\"\nlatency_ms = 500").unwrap();
        let start = tokio::time::Instant::now();
        p.complete(&req(&[], 0)).await.unwrap();
        assert!(start.elapsed() >= Duration::from_millis(500));
    }
}
