//! Resolving a fork: confidence scoring, the judge's verdict, the bounded judge prompt and the
//! merge strategies. Pure logic only: running tests and judges, and committing a merge, live in
//! the services.
//!
//! - [`ConfidenceSignals`] and [`ConfidenceFormula`]: the heuristic behind a judge's pick.
//!   [`ConfidenceFormula::PeerV1`] is the peer's formula, kept for comparison;
//!   [`ConfidenceFormula::EvidenceV1`] (the default) does not punish branches for agreeing.
//! - [`JudgeVerdict`]: parsed leniently from the judge model's text
//!   ([`JudgeVerdict::parse`]) and checked against the real branch labels ([`validate`]).
//! - [`judge_prompt`]: goal, diff report and one bullet per branch, at most
//!   [`MAX_JUDGE_PROMPT_CHARS`] characters.
//! - [`Strategy`] and [`decide`]: what to do with the verdicts.
//!
//! Layout: `confidence` the signals and formulas, `verdict` the judge's answer, `prompt` the
//! judge prompt, `strategy` the strategies and [`decide`].

mod confidence;
mod prompt;
mod strategy;
#[cfg(test)]
mod tests;
mod verdict;

pub use confidence::{internal_consistency, ConfidenceFormula, ConfidenceSignals};
pub use prompt::{judge_prompt, BranchOutcome};
pub use strategy::{decide, Decision, Strategy, StrategyError, STRATEGY_NAMES};
pub use verdict::{parse_verdict, validate, JudgeVerdict, VerdictError};

/// Without a test signal the heuristic never exceeds this, so at the default threshold
/// ([`DEFAULT_THRESHOLD`]) `auto_with_fallback` never commits on the judge's word alone.
pub const NO_TEST_CAP: f64 = 0.65;

/// The default `auto_with_fallback` threshold.
pub const DEFAULT_THRESHOLD: f64 = 0.80;

/// The judge prompt never exceeds this many characters (Unicode scalar values, not bytes).
pub const MAX_JUDGE_PROMPT_CHARS: usize = 32_000;
