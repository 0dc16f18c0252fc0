//! Confidence scoring: the signals behind a judge's pick and the formulas that turn them, with
//! the judge's own confidence, into the effective confidence.

use super::NO_TEST_CAP;
use serde::{Deserialize, Serialize};
use std::fmt;

/// The signals behind a pick, all in `[0, 1]` (out-of-range values are clamped when scored).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ConfidenceSignals {
    /// The diff report's agreement score (`1 - split / max(touched, 1)`).
    /// [`ConfidenceFormula::PeerV1`] reads its complement, `quality_spread`.
    pub agreement_score: f64,
    /// The winner's pass ratio (passed / counted tests); `None` when there is no test signal
    /// (no test command, timeout, failure to start, no tests collected).
    pub test_pass_ratio: Option<f64>,
    /// `1 - (retries + stuck-loop hits) / max(turns, 1)` for the winner
    /// (see [`internal_consistency`]).
    pub internal_consistency: f64,
}

impl ConfidenceSignals {
    pub fn new(
        agreement_score: f64,
        test_pass_ratio: Option<f64>,
        internal_consistency: f64,
    ) -> Self {
        ConfidenceSignals {
            agreement_score,
            test_pass_ratio,
            internal_consistency,
        }
    }
}

/// `1 - (retries + stuck_loop_hits) / max(turns, 1)`, clamped to `[0, 1]`.
pub fn internal_consistency(retries: u32, stuck_loop_hits: u32, turns: u32) -> f64 {
    let bad = f64::from(retries) + f64::from(stuck_loop_hits);
    unit(1.0 - bad / f64::from(turns.max(1)))
}

/// How the signals and the judge's own confidence become the effective confidence.
///
/// Both formulas clamp every input first: a non-finite test ratio counts as no test signal,
/// any other NaN counts as 0, and values outside `[0, 1]` are clamped to it. Both multiply the
/// heuristic by the judge's confidence and clamp the product to `[0, 1]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ConfidenceFormula {
    /// The peer's formula (PEER.md item 12), kept for comparison:
    /// `h = 0.4 * quality_spread + 0.4 * test_pass_ratio + 0.2 * internal_consistency`, the
    /// test term 0 and `h` capped at [`NO_TEST_CAP`] without a test signal.
    ///
    /// Its defect: `quality_spread` is `1 - agreement`, so branches that agree lose 0.4. Agreeing
    /// branches with passing tests, full consistency and a fully confident judge score 0.60,
    /// below the 0.80 threshold.
    PeerV1,
    /// The default (`"evidence_v1"`, also accepted as `"default"`):
    ///
    /// `h = gate * (0.7 + 0.15 * agreement_score + 0.15 * internal_consistency)`, where `gate` is
    /// the test pass ratio, or [`NO_TEST_CAP`] without a test signal.
    ///
    /// Why: tests are the only signal that checks the change against the world, so they gate the
    /// score multiplicatively: a failing winner scores 0 however much the branches agree, and a
    /// 90% pass ratio caps it at 0.9. Agreement is evidence, not noise: independent branches that
    /// converge on the same change corroborate it, so agreement raises the score, and a split
    /// only trims it (a passing, consistent winner with a fully confident judge still scores
    /// 0.85 when every path is split). Without tests the score stays at most 0.65 × the judge's
    /// confidence, the peer's safety rail: `auto_with_fallback` at 0.80 then never commits.
    #[default]
    #[serde(alias = "default")]
    EvidenceV1,
}

impl ConfidenceFormula {
    pub fn as_str(self) -> &'static str {
        match self {
            ConfidenceFormula::PeerV1 => "peer_v1",
            ConfidenceFormula::EvidenceV1 => "evidence_v1",
        }
    }

    /// The heuristic `h` before the judge's confidence, in `[0, 1]`.
    pub fn heuristic(self, signals: &ConfidenceSignals) -> f64 {
        let test = signals.test_pass_ratio.filter(|t| t.is_finite()).map(unit);
        let consistency = unit(signals.internal_consistency);
        match self {
            ConfidenceFormula::PeerV1 => {
                let spread = 1.0 - unit(signals.agreement_score);
                let h = 0.4 * spread + 0.4 * test.unwrap_or(0.0) + 0.2 * consistency;
                if test.is_none() {
                    unit(h.min(NO_TEST_CAP))
                } else {
                    unit(h)
                }
            }
            ConfidenceFormula::EvidenceV1 => {
                let agreement = unit(signals.agreement_score);
                let gate = test.unwrap_or(NO_TEST_CAP);
                unit(gate * (0.7 + 0.15 * agreement + 0.15 * consistency))
            }
        }
    }

    /// The effective confidence: the heuristic times the judge's confidence, in `[0, 1]`.
    pub fn effective(self, signals: &ConfidenceSignals, judge_confidence: f64) -> f64 {
        unit(self.heuristic(signals) * unit(judge_confidence))
    }
}

impl fmt::Display for ConfidenceFormula {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Clamps to `[0, 1]`; NaN becomes 0.
pub(super) fn unit(x: f64) -> f64 {
    if x.is_nan() {
        0.0
    } else {
        x.clamp(0.0, 1.0)
    }
}
