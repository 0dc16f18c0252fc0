//! The fork spec: a TOML file a user writes, parsed strictly and validated into a
//! [`ForkPlan`] before anything is created.
//!
//! - `file.rs`: the TOML shape ([`SpecFile`] and its sections).
//! - `plan.rs`: the validated shapes ([`ForkPlan`], [`BranchPlan`], [`Limits`], ...).
//! - `build.rs`: reading a spec and building its plan ([`load`], [`validate`]): defaults,
//!   blank and repeated labels (blank ones become `branch-{i+1}`, duplicates get `-2`,
//!   `-3`), prices, the keys only a spec has, and the files it names.
//! - `validate.rs`: [`ForkPlan::validate`], the one set of rules every plan holds whoever
//!   built it: the spec loader checks the plan it built with it, and the coordinator checks
//!   every plan it is sent with it again (a client may have skipped the loader).
//!
//! Validation order: the spec's own keys while the plan is built (no goal and no branches,
//! labels, checkpoint and resolve keys, unused or script-less models), then the plan's rules
//! (no branches, too many branches, limits, labels, budgets, models and prices), then depth,
//! and finally the files the spec names (workspace, history, scripts). Every error names
//! what was wrong and what is valid; nothing is created on error.

use crate::script::ScriptError;
use std::path::PathBuf;

mod build;
mod file;
mod plan;
#[cfg(test)]
mod tests;
mod validate;

pub use build::{
    load, load_overridden, load_with, split_words, validate, validate_with, DEFAULT_EXCLUDE,
};
pub use file::{BranchSection, ModelSection, SpecFile, TestCommand};
pub use plan::{
    BranchPlan, CheckpointFrequency, CheckpointPolicy, CheckpointTools, ForkPlan, Limits,
    LoadedSpec, ModelPlan, OnTruncated, ResolvePlan, TestPlan, CHECKPOINT_TOOLS,
    CONTINUE_TRUNCATED, DEFAULT_MAX_CHECKPOINTS, DEFAULT_TEST_TIMEOUT_S, MAX_TEST_TIMEOUT_S,
    SOLO_LABEL,
};
pub use validate::{check_account_name, check_depth, check_label, normalise_labels, split_model};

pub const DEFAULT_MAX_BRANCHES: usize = 10;
pub const DEFAULT_MAX_DEPTH: u32 = 2;
pub const DEFAULT_MAX_TURNS: u32 = 50;
pub const DEFAULT_MAX_OUTPUT_TOKENS: u32 = 4096;
pub const MAX_LABEL_LEN: usize = 64;

/// What is wrong with a spec or a plan: each names the key (or plan field) at fault and what
/// is valid.
#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    #[error("cannot read spec `{path}`: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("invalid spec `{path}`: {message}")]
    Toml { path: PathBuf, message: String },
    #[error("no branches and no goal: give a `goal` for a single agent run, or add [[branches]] tables with a `steer` to fork")]
    NoBranches,
    #[error("{requested} branches requested, max_branches is {max}")]
    TooManyBranches { requested: usize, max: usize },
    #[error("fork depth {depth} reached: max_depth is {max} (root and branches down to depth {last} may fork)")]
    DepthExceeded { depth: u32, max: u32, last: u32 },
    #[error("branch label `{label}` is not valid: {reason}; labels are 1 to 64 characters of letters, digits, `-`, `_` and `.`, not starting with `.`")]
    BadLabel { label: String, reason: &'static str },
    #[error("`branches[{index}].label` is empty; give branch {position} a label (1 to 64 characters of letters, digits, `-`, `_` and `.`), or leave `label` out and it is `branch-{position}`", position = index + 1)]
    EmptyLabel { index: usize },
    #[error("`{field}` is {value}; budgets must be finite and zero or more (USD)")]
    BadBudget { field: String, value: f64 },
    #[error("`{field}` must be at least 1")]
    ZeroLimit { field: String },
    #[error("`{field}` is {value}; a temperature is a number from 0 to 2")]
    BadTemperature { field: String, value: f64 },
    #[error("`branches[{index}].label` is `{label}`, like `branches[{first}].label`; labels must be unique within a fork")]
    DuplicateLabel {
        label: String,
        first: usize,
        index: usize,
    },
    #[error(
        "a single agent run (`solo`) has exactly one branch; this plan has {count} ({labels})"
    )]
    BadSolo { count: usize, labels: String },
    #[error(
        "`{field}` is `{model}`, which the plan does not configure; configured models: {valid}"
    )]
    UnknownModel {
        field: String,
        model: String,
        valid: String,
    },
    #[error("model `{model}` is not of the form provider:name; valid providers: {valid}")]
    BadModelName { model: String, valid: String },
    #[error("model `{model}` has unknown provider `{provider}`; valid providers: {valid}")]
    UnknownProvider {
        model: String,
        provider: String,
        valid: String,
    },
    #[error("scripted model `{model}` needs a script: add [models.\"{model}\"] script = \"FILE\"")]
    NoScript { model: String },
    #[error("script `{path}` of model `{model}`: {source}")]
    Script {
        model: String,
        path: PathBuf,
        source: ScriptError,
    },
    #[error("`{field}` sets a budget but model `{model}` has no known price; add [models.\"{model}\"] price = {{ input_per_mtok = ..., output_per_mtok = ... }} to the spec, or [pricing.\"{model}\"] to the config")]
    NoPrice { model: String, field: String },
    #[error("account name `{name}` is not valid: {reason}; names are 1 to 64 characters of letters, digits, `-`, `_` and `.`, not starting with `.`")]
    BadAccount { name: String, reason: &'static str },
    #[error("`{field}`: {message}")]
    BadResolve {
        field: &'static str,
        message: String,
    },
    #[error("price of model `{model}`: {message}")]
    BadPrice { model: String, message: String },
    #[error("`{field}`: {message}")]
    BadCheckpoints {
        field: &'static str,
        message: String,
    },
    #[error(
        "[models.\"{model}\"] is configured but no branch uses it and it is not the fork's model; mark it `spare = true` to keep it for `runs fork --set model=...`"
    )]
    UnusedModel { model: String },
    #[error("[models.\"{model}\"]: {message}")]
    BadModel { model: String, message: String },
    #[error("[run_command]: {message}", message = .0)]
    BadRunCommand(String),
    /// A tool's settings (`[tools.NAME]`; the message names the key and what is valid).
    #[error("[tools]: {0}")]
    BadTool(String),
    #[error("fork name `{name}` is not valid: {reason}; names are 1 to 64 characters of letters, digits, `-`, `_` and `.`, not starting with `.`")]
    BadName { name: String, reason: &'static str },
    /// The approval rules (the error names the table and key, and what is valid).
    #[error("{0}")]
    BadApproval(String),
    #[error("workspace `{0}` does not exist or is not a directory")]
    WorkspaceMissing(PathBuf),
    #[error("history file `{path}`: {message}; expected a JSON array of messages such as [{{\"role\": \"user\", \"text\": \"...\"}}]")]
    History { path: PathBuf, message: String },
}

impl SpecError {
    /// Exit code 2 (bad input) for every spec error except an unreadable file system.
    pub fn is_bad_input(&self) -> bool {
        true
    }
}
