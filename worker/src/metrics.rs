//! The worker's metrics: a model call's outcome, duration and tokens, recorded by the
//! call's [`crate::genai::ChatSpan`] (branches' and judges' calls alike), with the GenAI
//! conventions' labels; the running branches and the slots are held by the node
//! (`node.rs`).

use crate::genai;
use forkfleet_shared::event::Usage;
use forkfleet_shared::metrics::catalog;
use std::time::Instant;

/// The operation every model call of a branch is (GenAI `gen_ai.operation.name`).
const CHAT: &str = "chat";

/// One model call being made; recorded as `cancelled` if dropped before its outcome.
pub(crate) struct ModelCall {
    provider: String,
    model: String,
    started: Instant,
    recorded: bool,
}

impl ModelCall {
    /// A call of `model` (`provider:name`) starting now; labelled as its `chat {model}`
    /// span is ([`genai::provider_name`], [`genai::model_name`]).
    pub fn start(model: &str) -> ModelCall {
        ModelCall {
            provider: genai::provider_name(model).to_string(),
            model: genai::model_name(model).to_string(),
            started: Instant::now(),
            recorded: false,
        }
    }

    /// The call answered with `usage`.
    pub fn ok(mut self, usage: &Usage) {
        self.record("ok", "");
        let (p, m) = (self.provider.as_str(), self.model.as_str());
        for (kind, tokens) in [
            ("input", usage.input_tokens),
            ("output", usage.output_tokens),
        ] {
            catalog::TOKEN_USAGE.observe(&[CHAT, p, m, kind], tokens as f64);
        }
        // Prompt-cache reads and writes and reasoning, of the calls that had any.
        for (kind, tokens) in [
            ("cache_read", usage.cached_tokens),
            ("cache_creation", usage.cache_write_tokens),
            ("reasoning", usage.reasoning_tokens),
        ] {
            if tokens > 0 {
                catalog::TOKEN_USAGE.observe(&[CHAT, p, m, kind], tokens as f64);
            }
        }
    }

    /// The call failed, of class `error_type` ([`genai::error_type`], as its span says).
    pub fn failed(mut self, error_type: &str) {
        self.record("error", error_type);
    }

    fn record(&mut self, outcome: &str, error_type: &str) {
        self.recorded = true;
        let (p, m) = (self.provider.as_str(), self.model.as_str());
        catalog::MODEL_CALLS.inc(&[p, m, outcome]);
        catalog::OPERATION_DURATION.observe(
            &[CHAT, p, m, error_type],
            self.started.elapsed().as_secs_f64(),
        );
    }
}

impl Drop for ModelCall {
    fn drop(&mut self) {
        if !self.recorded {
            catalog::MODEL_CALLS.inc(&[&self.provider, &self.model, "cancelled"]);
        }
    }
}
