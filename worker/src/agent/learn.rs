//! What a branch's calls say of the next one's cost (strict mode, ADR 35).
//!
//! A reservation is an upper bound: the request's input at two bytes a token and a whole
//! `max_output_tokens` answer. Most answers are far shorter, so a cap holding only upper
//! bounds stops a branch while a fifth to a third of it is unused. The branch learns from
//! its own calls: the largest answer it has had, and how far the provider's input counts
//! fell below the bound. With them the worker asks the ledger for *at least* what such a
//! call costs (`least_usd`); a cap that cannot hold the whole bound but holds that grants
//! what room is left, and the worker lowers the call's output cap so that the call fits the
//! room. A cap then stops a branch with less than one call's worth unused.
//!
//! Input is learned as the largest ratio of counted to estimated tokens seen, with a tenth
//! more for margin (a history's tokens per byte change little from call to call); output
//! as the largest answer seen. A provider whose estimate is exact (the scripted model)
//! learns nothing: its estimate is its least.

use forkfleet_shared::budget::estimate_cost;
use forkfleet_shared::event::Usage;
use forkfleet_shared::pricing::Price;

/// The margin on the learned ratio of counted to estimated input tokens.
const INPUT_MARGIN: f64 = 1.1;

/// What the branch's calls so far say.
#[derive(Debug, Default, Clone, PartialEq)]
pub(super) struct Learned {
    /// The most output tokens one answer of the branch has counted.
    largest_output: Option<u64>,
    /// The largest ratio of counted to estimated input tokens of a call.
    input_ratio: Option<f64>,
}

impl Learned {
    /// Learn from the usage events of a branch's log (a resumed branch): answers' sizes.
    pub(super) fn from_usages<'a>(usages: impl Iterator<Item = &'a Usage>) -> Self {
        let largest_output = usages
            .filter(|u| u.input_tokens > 0 || u.output_tokens > 0)
            .map(|u| u.output_tokens)
            .max();
        Self {
            largest_output,
            input_ratio: None,
        }
    }

    /// Learn from one call: `estimate` reserved for it, `counted` what it used.
    pub(super) fn observe(&mut self, estimate: &Usage, counted: &Usage) {
        self.largest_output = Some(self.largest_output.unwrap_or(0).max(counted.output_tokens));
        if estimate.input_tokens > 0 {
            let ratio = counted.input_tokens as f64 / estimate.input_tokens as f64;
            self.input_ratio = Some(self.input_ratio.unwrap_or(0.0).max(ratio));
        }
    }

    /// The least usage the next call, estimated at `estimate`, is expected to need: the
    /// estimate itself until a call was seen.
    pub(super) fn least(&self, estimate: &Usage) -> Usage {
        let Some(output) = self.largest_output else {
            return *estimate;
        };
        let ratio = self
            .input_ratio
            .map_or(1.0, |r| (r * INPUT_MARGIN).min(1.0));
        let input =
            ((estimate.input_tokens as f64 * ratio).ceil() as u64).min(estimate.input_tokens);
        let cached = estimate.cached_tokens.min(input);
        Usage {
            input_tokens: input,
            cached_tokens: cached,
            cache_write_tokens: estimate.cache_write_tokens.min(input - cached),
            output_tokens: output.min(estimate.output_tokens),
            reasoning_tokens: 0,
        }
    }
}

/// The output cap of a call granted `granted_usd`, less than its estimate: the most output
/// tokens that fit once the `least` input is paid for, less the part of the estimate's
/// output beyond the answer cap `answer_cap` (a thinking budget); at least 1, at most
/// `answer_cap`.
pub(super) fn fitted_output_cap(
    price: &Price,
    estimate: &Usage,
    least: &Usage,
    granted_usd: f64,
    answer_cap: u32,
) -> u32 {
    if price.output_per_mtok <= 0.0 {
        return answer_cap;
    }
    let input = estimate_cost(
        price,
        &Usage {
            output_tokens: 0,
            ..*least
        },
    );
    let tokens = ((granted_usd - input).max(0.0) * 1_000_000.0 / price.output_per_mtok).floor();
    let extra = estimate.output_tokens.saturating_sub(u64::from(answer_cap));
    let fits = (tokens as u64).saturating_sub(extra);
    u32::try_from(fits)
        .unwrap_or(u32::MAX)
        .clamp(1, answer_cap.max(1))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn usage(input: u64, output: u64) -> Usage {
        Usage::tokens(input, output)
    }

    #[test]
    fn nothing_learned_asks_for_the_whole_estimate() {
        let est = usage(1000, 4096);
        assert_eq!(Learned::default().least(&est), est);
    }

    #[test]
    fn learns_the_largest_answer_and_the_input_ratio() {
        let mut l = Learned::default();
        l.observe(&usage(1000, 4096), &usage(400, 120));
        l.observe(&usage(2000, 4096), &usage(600, 80));
        // Output: the largest answer (120); input: the largest ratio (0.4) and a tenth.
        let least = l.least(&usage(3000, 4096));
        assert_eq!(least.output_tokens, 120);
        assert!((1320..=1321).contains(&least.input_tokens), "{least:?}");
        // Never more than the estimate.
        let mut big = Learned::default();
        big.observe(&usage(100, 50), &usage(300, 900));
        assert_eq!(big.least(&usage(100, 50)), usage(100, 50));
    }

    #[test]
    fn a_resumed_branch_learns_its_answers_sizes() {
        let log = [usage(10, 7), usage(20, 300), Usage::default()];
        let l = Learned::from_usages(log.iter());
        assert_eq!(l.least(&usage(500, 4096)).output_tokens, 300);
        assert_eq!(
            Learned::from_usages([Usage::default()].iter()),
            Learned::default()
        );
    }

    #[test]
    fn the_output_cap_fits_the_grant() {
        let price = Price::flat(1.0, 100.0);
        let est = usage(1000, 4096);
        let least = usage(500, 100);
        // $0.0105: $0.0005 of input leaves $0.01, 100 tokens at $100 a million.
        assert_eq!(fitted_output_cap(&price, &est, &least, 0.0105, 4096), 100);
        // A thinking budget beyond the answer cap is kept out of the answer's part.
        let thinking = usage(1000, 4096 + 50);
        assert_eq!(
            fitted_output_cap(&price, &thinking, &least, 0.0105, 4096),
            50
        );
        // Never 0, never past the answer cap; free output keeps the cap.
        assert_eq!(fitted_output_cap(&price, &est, &least, 0.0, 4096), 1);
        assert_eq!(fitted_output_cap(&price, &est, &least, 10.0, 4096), 4096);
        assert_eq!(
            fitted_output_cap(&Price::flat(1.0, 0.0), &est, &least, 0.0, 77),
            77
        );
    }
}
