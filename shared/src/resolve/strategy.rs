//! The merge strategies and the decision they make from the judges' verdicts.

use super::confidence::unit;
use super::verdict::JudgeVerdict;
use super::DEFAULT_THRESHOLD;
use serde::{Deserialize, Serialize};

/// How a fork is resolved. The judges' models are not part of it: they are named once,
/// next to it (the spec's `judge_model` or `judge_models`, `spec::ResolvePlan`).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Strategy {
    /// No judge runs; a person picks. The default: nothing merges without a judge or a
    /// person asking for it.
    #[default]
    Manual,
    /// One judge picks and the pick is committed at once, whatever its confidence.
    Auto,
    /// One judge picks; the pick is committed when its effective confidence is at least
    /// `threshold` (default [`DEFAULT_THRESHOLD`]), otherwise it is suggested, not merged.
    AutoWithFallback {
        #[serde(default = "default_threshold")]
        threshold: f64,
    },
    /// Every judge judges independently; the majority pick is committed at once, a tie
    /// going to the pick with the highest individual confidence.
    Vote,
}

fn default_threshold() -> f64 {
    DEFAULT_THRESHOLD
}

/// Why a strategy cannot be used.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum StrategyError {
    #[error("the auto_with_fallback threshold {0} is not a number in [0, 1]")]
    Threshold(f64),
}

/// The strategies' names, as specs, `--strategy` and the agents' `fork_run` write them.
pub const STRATEGY_NAMES: &str = "manual, auto, auto_with_fallback, vote";

impl Strategy {
    /// The strategy named `name` (`auto_with_fallback` with `threshold`); `None` for a
    /// name that is none of [`STRATEGY_NAMES`].
    pub fn from_name(name: &str, threshold: f64) -> Option<Strategy> {
        Some(match name {
            "manual" => Strategy::Manual,
            "auto" => Strategy::Auto,
            "auto_with_fallback" => Strategy::AutoWithFallback { threshold },
            "vote" => Strategy::Vote,
            _ => return None,
        })
    }

    pub fn as_str(&self) -> &'static str {
        match self {
            Strategy::Manual => "manual",
            Strategy::Auto => "auto",
            Strategy::AutoWithFallback { .. } => "auto_with_fallback",
            Strategy::Vote => "vote",
        }
    }

    /// Whether a judge runs at all.
    pub fn needs_judge(&self) -> bool {
        !matches!(self, Strategy::Manual)
    }

    /// Checks the threshold is in `[0, 1]`.
    pub fn validate(&self) -> Result<(), StrategyError> {
        match self {
            Strategy::AutoWithFallback { threshold }
                if !threshold.is_finite() || !(0.0..=1.0).contains(threshold) =>
            {
                Err(StrategyError::Threshold(*threshold))
            }
            _ => Ok(()),
        }
    }
}

/// What to do with a fork after its judges answered.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Decision {
    /// A person picks: the strategy is manual, or no judge verdict is available.
    Manual,
    /// Merge `winner` now.
    Commit { winner: String, confidence: f64 },
    /// `auto_with_fallback` below its threshold: `pick` is suggested, nothing is merged.
    Defer { pick: String, confidence: f64 },
}

/// Decides from validated verdicts, each with its effective confidence
/// ([`ConfidenceFormula::effective`](super::ConfidenceFormula::effective); NaN counts as 0).
///
/// - `manual`: [`Decision::Manual`], whatever the verdicts.
/// - `auto`: the first verdict is committed. No verdict: manual.
/// - `auto_with_fallback`: the first verdict is committed when its effective confidence is at
///   least the threshold, else deferred. No verdict: manual.
/// - `vote`: the winner named by the most verdicts is committed; a tie goes to the tied winner
///   with the highest individual effective confidence, then to the one named first. The
///   decision's confidence is the mean effective confidence of the verdicts naming the winner.
///   No verdict: manual.
pub fn decide(strategy: &Strategy, verdicts: &[(JudgeVerdict, f64)]) -> Decision {
    let Some((first, first_confidence)) = verdicts.first() else {
        return Decision::Manual;
    };
    let first_confidence = unit(*first_confidence);
    match strategy {
        Strategy::Manual => Decision::Manual,
        Strategy::Auto => Decision::Commit {
            winner: first.winner.clone(),
            confidence: first_confidence,
        },
        Strategy::AutoWithFallback { threshold } => {
            if first_confidence >= *threshold {
                Decision::Commit {
                    winner: first.winner.clone(),
                    confidence: first_confidence,
                }
            } else {
                Decision::Defer {
                    pick: first.winner.clone(),
                    confidence: first_confidence,
                }
            }
        }
        Strategy::Vote => {
            // (winner, votes, best confidence, confidence sum), in order of first mention.
            let mut tally: Vec<(&str, usize, f64, f64)> = Vec::new();
            for (verdict, confidence) in verdicts {
                let confidence = unit(*confidence);
                match tally.iter_mut().find(|t| t.0 == verdict.winner) {
                    Some(t) => {
                        t.1 += 1;
                        t.2 = t.2.max(confidence);
                        t.3 += confidence;
                    }
                    None => tally.push((&verdict.winner, 1, confidence, confidence)),
                }
            }
            let mut best = tally[0];
            for t in &tally[1..] {
                if t.1 > best.1 || (t.1 == best.1 && t.2 > best.2) {
                    best = *t;
                }
            }
            Decision::Commit {
                winner: best.0.to_owned(),
                confidence: best.3 / best.1 as f64,
            }
        }
    }
}
