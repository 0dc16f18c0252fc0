//! Model prices: USD per million input, output and cached-input tokens.
//!
//! The built-in table covers common models (prices as published by the vendors on
//! 2026-11-01); a spec's `[models."NAME"] price` overrides it and prices scripted models.

use crate::event::Usage;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Price {
    /// USD per million input tokens.
    pub input_per_mtok: f64,
    /// USD per million output tokens.
    pub output_per_mtok: f64,
    /// USD per million cached input tokens; defaults to the input price.
    #[serde(default)]
    pub cached_per_mtok: Option<f64>,
}

impl Price {
    /// The cost of one call. Cached tokens are part of `input_tokens` and priced at the
    /// cached rate.
    pub fn cost(&self, usage: &Usage) -> f64 {
        let cached = usage.cached_tokens.min(usage.input_tokens);
        let fresh = usage.input_tokens - cached;
        let cached_rate = self.cached_per_mtok.unwrap_or(self.input_per_mtok);
        (fresh as f64 * self.input_per_mtok
            + cached as f64 * cached_rate
            + usage.output_tokens as f64 * self.output_per_mtok)
            / 1_000_000.0
    }

    /// Every price finite and not negative; the error names the key at fault.
    pub fn validate(&self) -> Result<(), String> {
        let all = [
            ("input_per_mtok", Some(self.input_per_mtok)),
            ("output_per_mtok", Some(self.output_per_mtok)),
            ("cached_per_mtok", self.cached_per_mtok),
        ];
        for (key, v) in all {
            if let Some(v) = v.filter(|v| !v.is_finite() || *v < 0.0) {
                return Err(format!("`{key}` is {v}; it must be finite and >= 0"));
            }
        }
        Ok(())
    }
}

const fn p(input: f64, output: f64, cached: f64) -> Price {
    Price {
        input_per_mtok: input,
        output_per_mtok: output,
        cached_per_mtok: Some(cached),
    }
}

/// Built-in prices, by model name without the provider prefix.
const BUILTIN: &[(&str, Price)] = &[
    ("gpt-4o-mini", p(0.15, 0.60, 0.075)),
    ("gpt-4o", p(2.50, 10.00, 1.25)),
    ("gpt-4.1", p(2.00, 8.00, 0.50)),
    ("gpt-4.1-mini", p(0.40, 1.60, 0.10)),
    ("gpt-4.1-nano", p(0.10, 0.40, 0.025)),
    ("o3", p(2.00, 8.00, 0.50)),
    ("o4-mini", p(1.10, 4.40, 0.275)),
    ("claude-opus-4", p(15.00, 75.00, 1.50)),
    ("claude-sonnet-4", p(3.00, 15.00, 0.30)),
    ("claude-3-5-haiku", p(0.80, 4.00, 0.08)),
];

/// The built-in price of `model` (`provider:name` or a bare name), if known.
pub fn builtin_price(model: &str) -> Option<Price> {
    let name = model.split_once(':').map(|(_, n)| n).unwrap_or(model);
    BUILTIN
        .iter()
        .find(|(n, _)| *n == name || name.starts_with(&format!("{n}-20")))
        .map(|(_, p)| *p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cost_of_a_call() {
        let price = builtin_price("openai:gpt-4o-mini").unwrap();
        let usage = Usage {
            input_tokens: 1000,
            output_tokens: 200,
            cached_tokens: 0,
        };
        assert!((price.cost(&usage) - 0.00027).abs() < 1e-12);
        let cached = Usage {
            input_tokens: 1000,
            output_tokens: 0,
            cached_tokens: 1000,
        };
        assert!((price.cost(&cached) - 0.000075).abs() < 1e-12);
        assert!(builtin_price("scripted:demo").is_none());
        assert!(builtin_price("anthropic:claude-sonnet-4-20250514").is_some());
    }
}
