//! Model prices: USD per million input, output, cached-input and cache-write tokens.
//!
//! The built-in table covers common models (prices as published by the vendors on
//! 2026-11-01); a spec's `[models."NAME"] price` overrides it and prices scripted models.
//! Anthropic bills a prompt-cache read at 0.1x its input price and a (5-minute) cache
//! write at 1.25x; OpenAI bills cached input at its published cached rate (0.1x to 0.5x)
//! and cache writes at the input price.

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
    /// USD per million input tokens written to the prompt cache; defaults to the input
    /// price.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_write_per_mtok: Option<f64>,
}

impl Price {
    /// A price of input and output tokens only (cached and written input at the input
    /// price).
    pub const fn flat(input_per_mtok: f64, output_per_mtok: f64) -> Self {
        Self {
            input_per_mtok,
            output_per_mtok,
            cached_per_mtok: None,
            cache_write_per_mtok: None,
        }
    }

    /// USD per million cached input tokens.
    pub fn cached_rate(&self) -> f64 {
        self.cached_per_mtok.unwrap_or(self.input_per_mtok)
    }

    /// USD per million input tokens written to the cache.
    pub fn cache_write_rate(&self) -> f64 {
        self.cache_write_per_mtok.unwrap_or(self.input_per_mtok)
    }

    /// The cost of one call. Cached and cache-written tokens are part of `input_tokens`
    /// and priced at the cached and cache-write rates; reasoning tokens are part of
    /// `output_tokens`.
    pub fn cost(&self, usage: &Usage) -> f64 {
        let cached = usage.cached_tokens.min(usage.input_tokens);
        let written = usage.cache_write_tokens.min(usage.input_tokens - cached);
        let fresh = usage.input_tokens - cached - written;
        (fresh as f64 * self.input_per_mtok
            + cached as f64 * self.cached_rate()
            + written as f64 * self.cache_write_rate()
            + usage.output_tokens as f64 * self.output_per_mtok)
            / 1_000_000.0
    }

    /// The cost of a call's input tokens only.
    pub fn input_cost(&self, usage: &Usage) -> f64 {
        self.cost(&Usage {
            output_tokens: 0,
            ..*usage
        })
    }

    /// What the prompt cache saved on `usage`: its cached tokens at the input price less
    /// at the cached rate, less what writing to the cache cost above the input price (so
    /// it may be negative when a cache is written and never read).
    pub fn cache_saving(&self, usage: &Usage) -> f64 {
        let cached = usage.cached_tokens.min(usage.input_tokens);
        let written = usage.cache_write_tokens.min(usage.input_tokens - cached);
        (cached as f64 * (self.input_per_mtok - self.cached_rate())
            - written as f64 * (self.cache_write_rate() - self.input_per_mtok))
            / 1_000_000.0
    }

    /// Every price finite and not negative; the error names the key at fault.
    pub fn validate(&self) -> Result<(), String> {
        let all = [
            ("input_per_mtok", Some(self.input_per_mtok)),
            ("output_per_mtok", Some(self.output_per_mtok)),
            ("cached_per_mtok", self.cached_per_mtok),
            ("cache_write_per_mtok", self.cache_write_per_mtok),
        ];
        for (key, v) in all {
            if let Some(v) = v.filter(|v| !v.is_finite() || *v < 0.0) {
                return Err(format!("`{key}` is {v}; it must be finite and >= 0"));
            }
        }
        Ok(())
    }
}

/// An OpenAI price: cached input at `cached`, cache writes at the input price.
const fn p(input: f64, output: f64, cached: f64) -> Price {
    Price {
        input_per_mtok: input,
        output_per_mtok: output,
        cached_per_mtok: Some(cached),
        cache_write_per_mtok: None,
    }
}

/// An Anthropic price: cache reads at 0.1x the input price, (5-minute) cache writes at
/// 1.25x.
const fn a(input: f64, output: f64) -> Price {
    Price {
        input_per_mtok: input,
        output_per_mtok: output,
        cached_per_mtok: Some(input * 0.1),
        cache_write_per_mtok: Some(input * 1.25),
    }
}

/// Built-in prices, by model name without the provider prefix. A name matches itself and
/// its dated versions (`NAME-20...`).
const BUILTIN: &[(&str, Price)] = &[
    ("gpt-4o-mini", p(0.15, 0.60, 0.075)),
    ("gpt-4o", p(2.50, 10.00, 1.25)),
    ("gpt-4.1", p(2.00, 8.00, 0.50)),
    ("gpt-4.1-mini", p(0.40, 1.60, 0.10)),
    ("gpt-4.1-nano", p(0.10, 0.40, 0.025)),
    ("gpt-5", p(1.25, 10.00, 0.125)),
    ("gpt-5-mini", p(0.25, 2.00, 0.025)),
    ("gpt-5-nano", p(0.05, 0.40, 0.005)),
    ("o3", p(2.00, 8.00, 0.50)),
    ("o4-mini", p(1.10, 4.40, 0.275)),
    ("claude-opus-4", a(15.00, 75.00)),
    ("claude-opus-4-1", a(15.00, 75.00)),
    ("claude-sonnet-4", a(3.00, 15.00)),
    ("claude-sonnet-4-5", a(3.00, 15.00)),
    ("claude-haiku-4-5", a(1.00, 5.00)),
    ("claude-3-5-haiku", a(0.80, 4.00)),
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
        let usage = Usage::tokens(1000, 200);
        assert!((price.cost(&usage) - 0.00027).abs() < 1e-12);
        let cached = Usage {
            cached_tokens: 1000,
            ..Usage::tokens(1000, 0)
        };
        assert!((price.cost(&cached) - 0.000075).abs() < 1e-12);
        assert!(builtin_price("scripted:demo").is_none());
        assert!(builtin_price("anthropic:claude-sonnet-4-20250514").is_some());
    }

    #[test]
    fn anthropic_cache_reads_cost_a_tenth_and_writes_a_quarter_more() {
        let price = builtin_price("anthropic:claude-sonnet-4-5-20250929").unwrap();
        // 10,000 input tokens: 6,000 read from the cache, 3,000 written, 1,000 fresh.
        let usage = Usage {
            cached_tokens: 6000,
            cache_write_tokens: 3000,
            ..Usage::tokens(10_000, 0)
        };
        let expected = (1000.0 * 3.0 + 6000.0 * 0.3 + 3000.0 * 3.75) / 1e6;
        assert!((price.cost(&usage) - expected).abs() < 1e-12);
        let saving = (6000.0 * (3.0 - 0.3) - 3000.0 * 0.75) / 1e6;
        assert!((price.cache_saving(&usage) - saving).abs() < 1e-12);
        assert!(
            (price.input_cost(&Usage {
                output_tokens: 9,
                ..usage
            }) - expected)
                .abs()
                < 1e-12
        );
        // Reads and writes never count more than the input.
        let odd = Usage {
            cached_tokens: 80,
            cache_write_tokens: 80,
            ..Usage::tokens(100, 0)
        };
        assert!((price.cost(&odd) - (80.0 * 0.3 + 20.0 * 3.75) / 1e6).abs() < 1e-12);
    }

    #[test]
    fn longer_names_match_before_their_prefixes() {
        assert_eq!(
            builtin_price("openai:gpt-5-mini"),
            Some(p(0.25, 2.00, 0.025))
        );
        assert_eq!(builtin_price("openai:gpt-5"), Some(p(1.25, 10.00, 0.125)));
        assert_eq!(
            builtin_price("anthropic:claude-opus-4-1-20250805"),
            Some(a(15.00, 75.00))
        );
        assert_eq!(
            builtin_price("openai:gpt-4o-mini-2024-07-18"),
            Some(p(0.15, 0.60, 0.075))
        );
    }
}
