//! Every metric forkfleet records, in one place (`docs/OBSERVABILITY.md`, "Metrics and the
//! HTTP endpoint", describes each one and where it is recorded). Label names are OTel
//! attribute names; Prometheus shows their dots as underscores (`fork.id` -> `fork_id`).

use super::{
    Counter, Family, Gauge, Histogram, DURATION_BUCKETS, FAST_DURATION_BUCKETS, TOKEN_BUCKETS,
};

/// The label of a per-fork series.
pub const FORK_ID: &str = "fork.id";

// Coordinator: branches and budgets.
pub static BRANCHES: Gauge = Gauge::new(
    "forkfleet.branches",
    "Branches per state over the forks the coordinator holds (live, and finished ones for a grace period).",
    "{branch}",
    &["state"],
);
pub static BRANCHES_ENDED: Counter = Counter::new(
    "forkfleet.branches.ended",
    "Branches that reached a terminal state, by that state.",
    "{branch}",
    &["state"],
);
pub static FORK_SPENT: Gauge = Gauge::new(
    "forkfleet.fork.spent_usd",
    "USD a fork has spent (live forks, and finished ones for a grace period).",
    "USD",
    &[FORK_ID],
);
pub static FORK_RESERVED: Gauge = Gauge::new(
    "forkfleet.fork.reserved_usd",
    "USD reserved for a fork's model calls in flight.",
    "USD",
    &[FORK_ID],
);
pub static FORK_CAP: Gauge = Gauge::new(
    "forkfleet.fork.cap_usd",
    "A fork's aggregate cap in USD (absent when uncapped).",
    "USD",
    &[FORK_ID],
);
/// Series [`COST`] holds at most: past it a new (account, model) pair counts under model
/// `_OTHER` (a spec may price models of its own naming: their names are not a catalogue).
pub const COST_MAX_SERIES: usize = 512;

/// Add `usd` to [`COST`] for `account` and `model`, within [`COST_MAX_SERIES`].
pub fn add_cost(account: &str, model: &str, usd: f64) {
    // The count first: under the bound (the common case) no key is built to look up.
    let model = if COST.0.series_count() < COST_MAX_SERIES || COST.0.has(&[account, model]) {
        model
    } else {
        "_OTHER"
    };
    COST.add(&[account, model], usd);
}

pub static COST: Counter = Counter::new(
    "forkfleet.cost_usd",
    "USD spent on model calls, by account (empty: a fork without one) and model; monotonic, so a day's spend is its increase over the day.",
    "USD",
    &["account", "model"],
);
pub static ACCOUNT_SPENT: Gauge = Gauge::new(
    "forkfleet.account.spent_usd",
    "USD an account's forks have spent (the forks the coordinator holds).",
    "USD",
    &["account"],
);
pub static ACCOUNT_RESERVED: Gauge = Gauge::new(
    "forkfleet.account.reserved_usd",
    "USD reserved for model calls in flight charged to an account.",
    "USD",
    &["account"],
);
pub static ACCOUNT_CAP: Gauge = Gauge::new(
    "forkfleet.account.cap_usd",
    "An account's cap in USD (absent when uncapped).",
    "USD",
    &["account"],
);
pub static BUDGET_REFUSALS: Counter = Counter::new(
    "forkfleet.budget.refusals",
    "Budget reservations refused, by the cap that refused them (branch, fork or account).",
    "{reservation}",
    &["scope"],
);
pub static QUEUE_DEPTH: Gauge = Gauge::new(
    "forkfleet.queue.depth",
    "Task messages of a pool not yet acked (waiting or held by a worker).",
    "{task}",
    &["pool"],
);
pub static QUEUE_LAG: Gauge = Gauge::new(
    "forkfleet.queue.lag",
    "Task messages of a pool not yet delivered to any worker (the consumer's lag).",
    "{task}",
    &["pool"],
);
pub static EVENTS_APPLIED: Counter = Counter::new(
    "forkfleet.events.applied",
    "Branch events the coordinator applied.",
    "{event}",
    &[],
);
pub static EVENTS_APPLY_DURATION: Histogram = Histogram::new(
    "forkfleet.events.apply.duration",
    "Time to write and apply one fork's batch of events.",
    "s",
    &[],
    FAST_DURATION_BUCKETS,
);

// Coordinator: approvals (docs/APPROVALS.md).
pub static APPROVALS_REQUESTED: Counter = Counter::new(
    "forkfleet.approvals.requested",
    "Tool calls that stopped their branch to wait for consent, by tool.",
    "{request}",
    &["gen_ai.tool.name"],
);
pub static APPROVALS_DECIDED: Counter = Counter::new(
    "forkfleet.approvals.decided",
    "Requests for consent answered, by decision (approved, denied) and by whom (person, timeout, policy).",
    "{request}",
    &["decision", "by"],
);
pub static APPROVAL_WAIT: Histogram = Histogram::new(
    "forkfleet.approvals.wait.duration",
    "Time from a request for consent to its answer.",
    "s",
    &["decision"],
    DURATION_BUCKETS,
);

// Worker.
pub static WORKER_RUNNING: Gauge = Gauge::new(
    "forkfleet.worker.branches.running",
    "Branches this worker process runs now.",
    "{branch}",
    &[],
);
pub static WORKER_SLOTS: Gauge = Gauge::new(
    "forkfleet.worker.slots",
    "Branches this worker process may run at once (its concurrency).",
    "{branch}",
    &[],
);
pub static MODEL_CALLS: Counter = Counter::new(
    "forkfleet.model.calls",
    "Model calls made, by provider, model and outcome (ok, error, cancelled).",
    "{call}",
    &["gen_ai.provider.name", "gen_ai.request.model", "outcome"],
);
pub static TOKEN_USAGE: Histogram = Histogram::new(
    "gen_ai.client.token.usage",
    "Tokens used per model call, input and output (the GenAI semantic conventions); cache_read, cache_creation and reasoning for the calls that had any (they are counted in input and output too).",
    "{token}",
    &[
        "gen_ai.operation.name",
        "gen_ai.provider.name",
        "gen_ai.request.model",
        "gen_ai.token.type",
    ],
    TOKEN_BUCKETS,
);
pub static OPERATION_DURATION: Histogram = Histogram::new(
    "gen_ai.client.operation.duration",
    "Duration of a model call (the GenAI semantic conventions); error.type is set on failure.",
    "s",
    &[
        "gen_ai.operation.name",
        "gen_ai.provider.name",
        "gen_ai.request.model",
        "error.type",
    ],
    DURATION_BUCKETS,
);

// Bus.
pub static BUS_RECONNECTS: Counter = Counter::new(
    "forkfleet.bus.reconnects",
    "Times the NATS connection was established again after it was lost.",
    "{reconnect}",
    &[],
);

/// Every family, in the order they are rendered.
// Every service: what it is and what it uses (the Prometheus client libraries' process
// metrics, read from /proc when the registry is read).
pub static BUILD_INFO: Gauge = Gauge::new(
    "forkfleet.build_info",
    "1, labelled with the version and the service of the process.",
    "1",
    &["version", "service"],
);
pub static PROCESS_CPU: Counter = Counter::new(
    "process.cpu",
    "CPU time the process has used, user and system.",
    "s",
    &[],
);
pub static PROCESS_RESIDENT_MEMORY: Gauge = Gauge::new(
    "process.resident_memory_bytes",
    "Resident memory of the process.",
    "By",
    &[],
);
pub static PROCESS_START_TIME: Gauge = Gauge::new(
    "process.start_time",
    "When the process started, in seconds since the Unix epoch.",
    "s",
    &[],
);
pub static PROCESS_OPEN_FDS: Gauge = Gauge::new(
    "process.open_fds",
    "File descriptors the process holds open.",
    "{fd}",
    &[],
);
pub static PROCESS_THREADS: Gauge = Gauge::new(
    "process.threads",
    "Threads of the process.",
    "{thread}",
    &[],
);

pub static ALL: &[&Family] = &[
    &BRANCHES.0,
    &BRANCHES_ENDED.0,
    &FORK_SPENT.0,
    &FORK_RESERVED.0,
    &FORK_CAP.0,
    &COST.0,
    &ACCOUNT_SPENT.0,
    &ACCOUNT_RESERVED.0,
    &ACCOUNT_CAP.0,
    &BUDGET_REFUSALS.0,
    &QUEUE_DEPTH.0,
    &QUEUE_LAG.0,
    &EVENTS_APPLIED.0,
    &EVENTS_APPLY_DURATION.0,
    &APPROVALS_REQUESTED.0,
    &APPROVALS_DECIDED.0,
    &APPROVAL_WAIT.0,
    &WORKER_RUNNING.0,
    &WORKER_SLOTS.0,
    &MODEL_CALLS.0,
    &TOKEN_USAGE.0,
    &OPERATION_DURATION.0,
    &BUS_RECONNECTS.0,
    &BUILD_INFO.0,
    &PROCESS_CPU.0,
    &PROCESS_RESIDENT_MEMORY.0,
    &PROCESS_START_TIME.0,
    &PROCESS_OPEN_FDS.0,
    &PROCESS_THREADS.0,
];
