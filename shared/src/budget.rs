//! Budgets: the policy a fork runs under, the reservation protocol between workers and the
//! coordinator, and the cost report clients read.
//!
//! Caps exist at three levels: a branch's `budget_usd`, a fork's `aggregate_budget_usd`, and
//! a named **account** shared by every fork that charges it. The coordinator keeps the
//! ledger of all three.
//!
//! - **Strict** (default): before each model call the worker asks the coordinator, on
//!   [`BUDGET_SUBJECT`], to reserve an upper bound of the call's cost against the branch,
//!   its fork and its account at once ([`BudgetRequest`]). Refused, the branch stops (or
//!   pauses) before spending; granted, the call runs and the `usage` event that records it
//!   names the reservation, so applying the event settles it with the actual cost. Money is
//!   only ever spent inside a reservation, so the spend never passes a cap.
//! - **Best effort**: no reservation; usage is reported after each call and the coordinator
//!   stops every affected branch as soon as a cap is crossed, cancelling calls in flight.

use crate::event::{Message, Usage};
use crate::ids::{ForkId, ReservationId, RunId};
use crate::pricing::Price;
use crate::state::BranchState;
use crate::wire::WireMessage;
use serde::{Deserialize, Serialize};

/// How caps are enforced.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BudgetMode {
    /// Reserve an upper bound before every call; never overshoots.
    #[default]
    Strict,
    /// Report after every call; stop as soon as a cap is crossed.
    BestEffort,
}

impl BudgetMode {
    pub fn as_str(self) -> &'static str {
        match self {
            BudgetMode::Strict => "strict",
            BudgetMode::BestEffort => "best_effort",
        }
    }
}

/// What happens to a branch a cap stops.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnExhausted {
    /// It ends as `budget_exhausted` or `aggregate_budget_exhausted` (work kept, mergeable).
    #[default]
    Stop,
    /// It waits as `paused` with its work kept; a top-up resumes it.
    Pause,
}

impl OnExhausted {
    /// The default (left out of encoded tasks).
    pub fn is_stop(&self) -> bool {
        *self == OnExhausted::Stop
    }

    pub fn as_str(self) -> &'static str {
        match self {
            OnExhausted::Stop => "stop",
            OnExhausted::Pause => "pause",
        }
    }
}

/// A fork's budget policy (its caps live in the plan and the ledger).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct BudgetPolicy {
    #[serde(default)]
    pub mode: BudgetMode,
    #[serde(default)]
    pub on_exhausted: OnExhausted,
    /// The account the fork charges, if any.
    #[serde(default)]
    pub account: Option<String>,
    /// Whether a branch stopped by a cap abandons the model call it has in flight
    /// (`true`) or lets it finish and records it (`false`). Unset: strict mode finishes
    /// (the call's money is reserved, so it is within the cap), best effort cancels (every
    /// call that completes after the crossing overshoots).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cancel_in_flight: Option<bool>,
}

impl BudgetPolicy {
    /// Whether stops cancel the call in flight (see [`BudgetPolicy::cancel_in_flight`]).
    pub fn cancels_in_flight(&self) -> bool {
        self.cancel_in_flight
            .unwrap_or(self.mode == BudgetMode::BestEffort)
    }
}

/// The request/reply subject on which workers reserve budget before a model call.
pub const BUDGET_SUBJECT: &str = "coord.budget";

/// Reserve `estimate_usd` for one model call of branch `run_id` (strict mode).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BudgetRequest {
    pub fork_id: ForkId,
    pub run_id: RunId,
    /// The worker's task attempt: a fenced-off attempt is refused (`gone`).
    pub attempt: u32,
    /// The upper bound of the call's cost.
    pub estimate_usd: f64,
    /// The upper bound in tokens, for the record.
    pub estimate: Usage,
    /// The W3C `traceparent` of the span the worker asks in (its `branch.turn`): the
    /// coordinator's `budget.reserve` span is its child (`crate::trace`). `None` without
    /// trace context.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace: Option<String>,
    /// The branch's previous call, as the worker counted it: its usage event may reach the
    /// ledger after this request does, and a provider that billed past its reservation
    /// must not have one more call granted meanwhile. The ledger counts it as settled for
    /// this decision while the reservation is still held (its event settles it for good).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub settles: Option<Settle>,
    /// The least the call may be granted: what the branch's calls so far say it needs (its
    /// input bound scaled by how far the provider's counts fell below the bound, and its
    /// largest answer as output). When `estimate_usd` does not fit under a cap but this
    /// does, the ledger grants what room is left ([`BudgetReply::Partial`]) and the worker
    /// lowers the call's output cap to fit it; when other reservations hold the room this
    /// needs, it answers [`BudgetReply::Wait`]. `None` (a worker that learns nothing, or
    /// an older one): the whole estimate or nothing, and neither answer is sent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub least_usd: Option<f64>,
}

/// A call's actual cost, for the reservation that paid for it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Settle {
    pub reservation: ReservationId,
    pub cost_usd: f64,
}

impl WireMessage for BudgetRequest {
    const KIND: &'static str = "budget_request";
}

/// The answer to a [`BudgetRequest`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "result", rename_all = "snake_case")]
pub enum BudgetReply {
    /// Make the call; name the reservation in its `usage` event.
    Granted { reservation: ReservationId },
    /// Make the call within `usd`, less than the estimate asked for and at least its
    /// `least_usd`: all the room a cap had left. The worker lowers the call's output cap so
    /// that the call fits. Sent only to a request with `least_usd`.
    Partial {
        reservation: ReservationId,
        usd: f64,
    },
    /// Do not make the call: a cap has no room for it. `state` is `budget_exhausted` (the
    /// branch's own cap) or `aggregate_budget_exhausted` (the fork's or the account's).
    Refused { state: BranchState, reason: String },
    /// The branch or its fork is gone or finished: stop without publishing anything more.
    Gone { reason: String },
    /// Task attempt `by` took the branch over: this worker's lease is lost. Stop without
    /// publishing anything more and without settling the task (ADR 18).
    Superseded { by: u32 },
    /// The coordinator could not decide (its store failed): try again later.
    Retry { reason: String },
    /// Not now: other calls' reservations hold the room this one needs under a cap, and
    /// what they do not spend comes back when they settle (or expire). Ask again shortly;
    /// this is not a failure and has no limit of tries. Sent only to a request with
    /// `least_usd`.
    Wait { reason: String },
}

impl WireMessage for BudgetReply {
    const KIND: &'static str = "budget_reply";
}

/// Bytes per token assumed when estimating a request's input tokens from its size. This is
/// a heuristic, not a proven bound: BPE tokenizers are commonly said to average 3 to 4 bytes
/// of English or code per token (not measured here), so counting every 2 bytes as a token
/// leaves a margin for ordinary text; dense input (base64, long digit runs) may come closer
/// to one token a byte. Providers that know their usage in advance (the scripted model)
/// state it exactly instead.
pub const BYTES_PER_TOKEN_ESTIMATE: u64 = 2;
/// Tokens added per message (role markers, separators) and per tool schema.
pub const TOKENS_PER_MESSAGE: u64 = 8;

/// A conservative estimate (see [`BYTES_PER_TOKEN_ESTIMATE`]) of the input tokens of a
/// request made of `messages` and tool schemas totalling `tools_bytes` bytes.
pub fn estimate_input_tokens(messages: &[Message], tools_bytes: usize) -> u64 {
    let mut bytes = tools_bytes as u64;
    for m in messages {
        bytes += match m {
            Message::System { text } | Message::User { text } => text.len() as u64,
            Message::Assistant {
                text,
                tool_calls,
                reasoning,
            } => {
                text.as_ref().map_or(0, |t| t.len() as u64)
                    + reasoning.as_ref().map_or(0, |r| r.len() as u64)
                    + tool_calls
                        .iter()
                        .map(|c| (c.id.len() + c.name.len()) as u64 + json_len(&c.args))
                        .sum::<u64>()
            }
            Message::Tool {
                call_id,
                name,
                output,
            } => (call_id.len() + name.len() + output.len()) as u64,
        };
    }
    bytes.div_ceil(BYTES_PER_TOKEN_ESTIMATE) + TOKENS_PER_MESSAGE * (messages.len() as u64 + 1)
}

/// Bytes of `value` as compact JSON, counted without building the string.
pub fn json_len(value: &serde_json::Value) -> u64 {
    struct Count(u64);
    impl std::io::Write for Count {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 += buf.len() as u64;
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut count = Count(0);
    // Writing a `Value` to a sink that cannot fail cannot fail.
    let _ = serde_json::to_writer(&mut count, value);
    count.0
}

/// The upper bound of a call's cost: its estimated usage at `price`. Only the estimate's
/// `cached_tokens` are priced at the cached rate (a provider counts there only a prefix its
/// API confirmed cached, ADR 26); every other input token at the higher of the input and
/// cache-write rates, as it may be written to the cache.
pub fn estimate_cost(price: &Price, estimate: &Usage) -> f64 {
    let cached = estimate.cached_tokens.min(estimate.input_tokens);
    let rest = estimate.input_tokens - cached;
    let rest_rate = price.input_per_mtok.max(price.cache_write_rate());
    (rest as f64 * rest_rate
        + cached as f64 * price.cached_rate()
        + estimate.output_tokens as f64 * price.output_per_mtok)
        / 1_000_000.0
}

/// One branch's money.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BranchCost {
    pub label: String,
    pub run_id: RunId,
    pub state: BranchState,
    /// Settled spend (the sum of its usage events' costs).
    pub spent_usd: f64,
    /// Held by reservations of calls in flight.
    pub reserved_usd: f64,
    /// Its own cap, if any.
    pub cap_usd: Option<f64>,
    /// `cap - spent - reserved`, never below 0; `None` without a cap.
    pub remaining_usd: Option<f64>,
    /// Spent past its cap (`spent - cap`, 0 when within): what a provider billed past a
    /// call's reservation, or best-effort mode's last call.
    #[serde(default)]
    pub overrun_usd: f64,
    /// Model calls paid for: the branch's `usage` events, those of fenced task attempts
    /// included (ADR 18).
    pub calls: u32,
    /// Model calls a replay served from the record: nothing spent (docs/LINEAGE.md).
    #[serde(default)]
    pub cached_calls: u32,
    /// When the coordinator saw it stop (terminal or paused), milliseconds since the epoch.
    pub stopped_at_ms: Option<u64>,
    /// Its tokens: input (cached reads and cache writes among them) and output.
    #[serde(default)]
    pub usage: crate::event::Usage,
    /// What the provider's prompt cache saved, at its model's price
    /// ([`crate::pricing::Price::cache_saving`]).
    #[serde(default)]
    pub cache_saved_usd: f64,
    /// Its model, when it is a provider's with no price: what its calls cost is unknown,
    /// and `spent_usd` counts none of it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unpriced_model: Option<String>,
}

/// A named ledger shared by every fork that charges it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AccountView {
    pub name: String,
    pub cap_usd: Option<f64>,
    pub spent_usd: f64,
    pub reserved_usd: f64,
    pub remaining_usd: Option<f64>,
    /// Forks that charge it.
    pub forks: usize,
    pub created_at_ms: u64,
}

/// A fork's money: per branch, the fork's totals and its account's.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ForkCost {
    pub fork_id: ForkId,
    pub mode: BudgetMode,
    pub on_exhausted: OnExhausted,
    pub spent_usd: f64,
    pub reserved_usd: f64,
    /// The fork's aggregate cap (after top-ups), if any.
    pub cap_usd: Option<f64>,
    pub remaining_usd: Option<f64>,
    /// Spent past the fork's cap (`spent - cap`, 0 when within).
    #[serde(default)]
    pub overrun_usd: f64,
    /// When a cap the fork is under was first found crossed or full (a refused
    /// reservation, or a usage report past a cap), milliseconds since the epoch.
    pub crossed_at_ms: Option<u64>,
    pub branches: Vec<BranchCost>,
    pub account: Option<AccountView>,
    /// What the judges of the fork's last resolve spent (never charged to its branches,
    /// its cap or its account: they run after the branches, on the coordinator's behalf).
    #[serde(default)]
    pub judge_cost_usd: f64,
    /// The judges' models with no price: their spend is unknown (not in
    /// `judge_cost_usd`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub judge_unpriced: Vec<String>,
    #[serde(default)]
    pub judge_usage: crate::event::Usage,
    /// The branches' tokens, summed.
    #[serde(default)]
    pub usage: crate::event::Usage,
    /// What the prompt cache saved the branches, summed.
    #[serde(default)]
    pub cache_saved_usd: f64,
}

/// `spent - cap`, not below zero (0 without a cap): money spent past a cap.
pub fn overrun(cap: Option<f64>, spent: f64) -> f64 {
    cap.map_or(0.0, |c| (spent - c).max(0.0))
}

/// `cap - spent - reserved`, not below zero.
pub fn remaining(cap: Option<f64>, spent: f64, reserved: f64) -> Option<f64> {
    cap.map(|c| (c - spent - reserved).max(0.0))
}

/// An amount of USD a person typed (`--usd`, a chat's budget): finite, greater than 0.
pub fn parse_usd(s: &str) -> Result<f64, String> {
    parse_amount(s, false, "a finite amount of USD greater than 0, e.g. 0.5")
}

/// A cap a person typed (`--cap`): a finite amount of 0 or more.
pub fn parse_cap(s: &str) -> Result<f64, String> {
    parse_amount(
        s,
        true,
        "a finite cap in USD of 0 or more, e.g. 25 (or --no-cap)",
    )
}

/// A finite number above 0 (or of 0 or more with `zero_ok`); `valid` says what is.
pub fn parse_amount(s: &str, zero_ok: bool, valid: &str) -> Result<f64, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("`{s}` is not a number; give {valid}"))?;
    let ok = v.is_finite() && if zero_ok { v >= 0.0 } else { v > 0.0 };
    if !ok {
        return Err(format!("{v} is not valid; give {valid}"));
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pricing::builtin_price;

    #[test]
    fn estimate_counts_two_bytes_a_token_plus_overhead() {
        // 4,000 bytes of text and 100 of tool schemas: 2,050 tokens, plus 8 for the message
        // and 8 for the request.
        let msgs = vec![Message::User {
            text: "word ".repeat(800),
        }];
        assert_eq!(estimate_input_tokens(&msgs, 100), 2_066);
        // Tool call arguments count as their compact JSON.
        let args = serde_json::json!({"path": "a.txt", "content": "héllo"});
        assert_eq!(json_len(&args), args.to_string().len() as u64);
        let call = Message::Assistant {
            text: None,
            tool_calls: vec![crate::event::ToolCall {
                id: "c1".into(),
                name: "write_file".into(),
                args: args.clone(),
            }],
            reasoning: None,
        };
        let bytes = 2 + 10 + args.to_string().len() as u64;
        assert_eq!(estimate_input_tokens(&[call], 0), bytes.div_ceil(2) + 16);
        let price = builtin_price("gpt-4o-mini").unwrap();
        // No cached tokens: all input at the input price.
        let c = estimate_cost(&price, &Usage::tokens(1000, 200));
        assert!((c - 0.00027).abs() < 1e-12);
        // Cached tokens the provider confirmed: at the cached rate.
        let confirmed = Usage {
            cached_tokens: 1000,
            ..Usage::tokens(1000, 200)
        };
        assert!((estimate_cost(&price, &confirmed) - 0.000195).abs() < 1e-12);
        // Where writes cost more (Anthropic), every other input token is priced as a write,
        // whether or not the estimate marked it one.
        let claude = builtin_price("claude-sonnet-4").unwrap();
        let c = estimate_cost(
            &claude,
            &Usage {
                cached_tokens: 600,
                ..Usage::tokens(1000, 0)
            },
        );
        assert!((c - (400.0 * 3.75 + 600.0 * 0.3) / 1e6).abs() < 1e-12);
        assert_eq!(remaining(Some(1.0), 0.5, 0.75), Some(0.0));
        assert_eq!(remaining(None, 0.5, 0.75), None);
    }
}
