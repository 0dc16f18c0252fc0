//! The fork spec: a TOML file a user writes, parsed strictly and validated into a
//! [`ForkPlan`] before anything is created.
//!
//! Validation order follows the reference system: no branches, too many branches, depth;
//! then labels (blank ones become `branch-{i+1}`, duplicates get `-2`, `-3`), budgets,
//! models and prices, and finally the files the spec names (workspace, history, scripts).
//! Every error names what was wrong and what is valid; nothing is created on error.

use crate::blob::BlobHash;
use crate::budget::{BudgetMode, BudgetPolicy, OnExhausted};
use crate::endpoint::{CommandTool, CommandToolSection, Endpoint};
use crate::event::Message;
use crate::flush::ConflictPolicy;
use crate::pricing::{builtin_price, Price};
use crate::resolve::{ConfidenceFormula, Strategy, DEFAULT_THRESHOLD, STRATEGY_NAMES};
use crate::script::{Script, ScriptError};
use bytes::Bytes;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

pub const DEFAULT_MAX_BRANCHES: usize = 10;
pub const DEFAULT_MAX_DEPTH: u32 = 2;
pub const DEFAULT_MAX_TURNS: u32 = 50;
pub const DEFAULT_MAX_OUTPUT_TOKENS: u32 = 4096;
pub const MAX_LABEL_LEN: usize = 64;
/// Providers a model name may start with.
pub const PROVIDERS: &[&str] = &["scripted", "openai", "anthropic"];

/// The spec file as written. Unknown keys are errors that list the valid ones.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SpecFile {
    pub goal: String,
    pub workspace: String,
    pub model: String,
    #[serde(default)]
    pub system_prompt: Option<String>,
    #[serde(default)]
    pub history: Option<String>,
    #[serde(default)]
    pub exclude: Option<Vec<String>>,
    #[serde(default)]
    pub max_branches: Option<usize>,
    #[serde(default)]
    pub max_depth: Option<u32>,
    #[serde(default)]
    pub max_turns: Option<u32>,
    #[serde(default)]
    pub max_output_tokens: Option<u32>,
    #[serde(default)]
    pub conflict_policy: Option<ConflictPolicy>,
    #[serde(default)]
    pub budget_usd: Option<f64>,
    #[serde(default)]
    pub aggregate_budget_usd: Option<f64>,
    /// A named account the fork charges (made with `forkfleet account set`).
    #[serde(default)]
    pub account: Option<String>,
    /// `strict` (default) or `best_effort`.
    #[serde(default)]
    pub budget_mode: Option<BudgetMode>,
    /// `stop` (default) or `pause`.
    #[serde(default)]
    pub on_exhausted: Option<OnExhausted>,
    /// Whether a cap stopping a branch cancels its model call in flight; default: true in
    /// best-effort mode, false in strict mode.
    #[serde(default)]
    pub cancel_in_flight: Option<bool>,
    /// How the fork is resolved: `manual` (default), `auto`, `auto_with_fallback`, `vote`.
    #[serde(default)]
    pub strategy: Option<String>,
    /// `auto_with_fallback`: the confidence at which the judge's pick is merged (0.80).
    #[serde(default)]
    pub confidence_threshold: Option<f64>,
    /// `auto`, `auto_with_fallback`: the judge's model.
    #[serde(default)]
    pub judge_model: Option<String>,
    /// `vote`: the judges' models.
    #[serde(default)]
    pub judge_models: Option<Vec<String>>,
    /// `evidence_v1` (default) or `peer_v1`.
    #[serde(default)]
    pub confidence_formula: Option<ConfidenceFormula>,
    /// The test command run on every branch's tree: an argv list, or a string split into
    /// words like a shell would (quotes, backslashes) but run without one.
    #[serde(default)]
    pub test_command: Option<TestCommand>,
    #[serde(default)]
    pub test_timeout_s: Option<f64>,
    /// Environment variables the test command gets (besides PATH, HOME, TMPDIR, LANG).
    #[serde(default)]
    pub test_env: BTreeMap<String, String>,
    /// Keep the materialised fork directory after the fork is resolved.
    #[serde(default)]
    pub keep_artifacts: Option<bool>,
    /// Automatic checkpoints of the branches: `every_turn`, `every_tool` (default) or
    /// `manual_only`.
    #[serde(default)]
    pub checkpoints: Option<String>,
    /// Automatic checkpoints kept per branch run (default 20, at least 1).
    #[serde(default)]
    pub max_checkpoints: Option<i64>,
    /// The agent's `run_command` tool: offered when this table is present.
    #[serde(default)]
    pub run_command: Option<CommandToolSection>,
    /// Give the agents the fork tools (fork_run, inspect_branches, merge_or_select,
    /// terminate_branch, diff_branches, fork_cost); `max_depth` limits nesting.
    #[serde(default)]
    pub forking: Option<bool>,
    #[serde(default)]
    pub models: BTreeMap<String, ModelSection>,
    /// The branches; none: a root run of a single agent (label `main`).
    #[serde(default)]
    pub branches: Vec<BranchSection>,
}

/// `test_command` as written: a list of words, or one string.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(untagged)]
pub enum TestCommand {
    Argv(Vec<String>),
    Line(String),
}

/// The longest `test_timeout_s` (one hour).
pub const MAX_TEST_TIMEOUT_S: f64 = 3600.0;

/// The default `test_timeout_s`.
pub const DEFAULT_TEST_TIMEOUT_S: f64 = 300.0;

/// The test command of a fork, validated.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TestPlan {
    pub argv: Vec<String>,
    pub timeout_s: f64,
    pub env: BTreeMap<String, String>,
}

/// How a fork is resolved, validated. The default (also for plans stored before these
/// settings existed) is `manual` with no test command.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct ResolvePlan {
    pub strategy: Strategy,
    /// The judge models: none for `manual`, one for `auto` and `auto_with_fallback`, at
    /// least one for `vote`.
    #[serde(default)]
    pub judge_models: Vec<String>,
    #[serde(default)]
    pub confidence_formula: ConfidenceFormula,
    #[serde(default)]
    pub test: Option<TestPlan>,
    #[serde(default)]
    pub keep_artifacts: bool,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    /// Scripted models: the script file, relative to the spec.
    #[serde(default)]
    pub script: Option<String>,
    #[serde(default)]
    pub price: Option<Price>,
    /// Real models (`openai:`, `anthropic:`): the API's base URL.
    #[serde(default)]
    pub base_url: Option<String>,
    /// The environment variable on the workers holding the API key.
    #[serde(default)]
    pub api_key_env: Option<String>,
    /// A file on the workers holding the API key.
    #[serde(default)]
    pub api_key_file: Option<String>,
    /// Seconds one request may take.
    #[serde(default)]
    pub timeout_s: Option<f64>,
    /// Retries on 429, 5xx or no answer.
    #[serde(default)]
    pub max_retries: Option<u32>,
}

impl ModelSection {
    /// The connection settings written in this section.
    pub fn endpoint(&self) -> Endpoint {
        Endpoint {
            base_url: self.base_url.clone(),
            api_key_env: self.api_key_env.clone(),
            api_key_file: self.api_key_file.clone(),
            timeout_s: self.timeout_s,
            max_retries: self.max_retries,
        }
    }
}

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct BranchSection {
    #[serde(default)]
    pub label: Option<String>,
    #[serde(default)]
    pub steer: Option<String>,
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub budget_usd: Option<f64>,
    #[serde(default)]
    pub extra_instructions: Option<String>,
    #[serde(default)]
    pub max_turns: Option<u32>,
    #[serde(default)]
    pub max_output_tokens: Option<u32>,
}

/// The label of a root run's single agent (a spec without branches).
pub const SOLO_LABEL: &str = "main";

/// Limits that hold for the whole fork.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limits {
    pub max_branches: usize,
    pub max_depth: u32,
    pub max_turns: u32,
    pub max_output_tokens: u32,
    /// The branches' automatic checkpoints. A plan without it (stored before checkpoints
    /// existed, or sent by an older client) takes none: [`CheckpointPolicy::legacy`].
    #[serde(default = "CheckpointPolicy::legacy")]
    pub checkpoints: CheckpointPolicy,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_branches: DEFAULT_MAX_BRANCHES,
            max_depth: DEFAULT_MAX_DEPTH,
            max_turns: DEFAULT_MAX_TURNS,
            max_output_tokens: DEFAULT_MAX_OUTPUT_TOKENS,
            checkpoints: CheckpointPolicy::default(),
        }
    }
}

// ---- checkpoints ------------------------------------------------------------------------

/// The default `max_checkpoints`.
pub const DEFAULT_MAX_CHECKPOINTS: u32 = 20;

/// When the coordinator saves an automatic checkpoint of a branch run (`checkpoints`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CheckpointFrequency {
    /// Before each model call: `turn-N` at the last event before call N's response.
    EveryTurn,
    /// After each tool call: `tool-N-NAME` at the call's result (the reference's default).
    #[default]
    EveryTool,
    /// None: only `fork:`, `post-fork:` and the ones saved by hand.
    ManualOnly,
}

impl CheckpointFrequency {
    pub const VALID: &'static str = "every_turn, every_tool, manual_only";

    pub fn as_str(self) -> &'static str {
        match self {
            CheckpointFrequency::EveryTurn => "every_turn",
            CheckpointFrequency::EveryTool => "every_tool",
            CheckpointFrequency::ManualOnly => "manual_only",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "every_turn" => Some(CheckpointFrequency::EveryTurn),
            "every_tool" => Some(CheckpointFrequency::EveryTool),
            "manual_only" => Some(CheckpointFrequency::ManualOnly),
            _ => None,
        }
    }
}

/// The automatic checkpoints of a fork's branches: when, and how many each keeps (the
/// oldest automatic one is evicted beyond `max_checkpoints`; named ones never are).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointPolicy {
    pub frequency: CheckpointFrequency,
    pub max_checkpoints: u32,
}

impl Default for CheckpointPolicy {
    fn default() -> Self {
        Self {
            frequency: CheckpointFrequency::default(),
            max_checkpoints: DEFAULT_MAX_CHECKPOINTS,
        }
    }
}

impl CheckpointPolicy {
    /// The policy of a plan that does not say: no automatic checkpoints.
    pub fn legacy() -> Self {
        Self {
            frequency: CheckpointFrequency::ManualOnly,
            max_checkpoints: DEFAULT_MAX_CHECKPOINTS,
        }
    }

    /// `max_checkpoints` is at least 1.
    pub fn validate(&self) -> Result<(), SpecError> {
        if self.max_checkpoints == 0 {
            return Err(SpecError::BadCheckpoints {
                field: "max_checkpoints",
                message: "0 is not valid; keep at least 1 (automatic checkpoints beyond it \
                          evict the oldest)"
                    .to_string(),
            });
        }
        Ok(())
    }
}

/// `checkpoints` and `max_checkpoints` of a spec, validated.
fn checkpoint_policy(file: &SpecFile) -> Result<CheckpointPolicy, SpecError> {
    let bad = |field, message: String| SpecError::BadCheckpoints { field, message };
    let frequency = match &file.checkpoints {
        None => CheckpointFrequency::default(),
        Some(s) => CheckpointFrequency::parse(s).ok_or_else(|| {
            bad(
                "checkpoints",
                format!("`{s}` is not valid; valid: {}", CheckpointFrequency::VALID),
            )
        })?,
    };
    let max_checkpoints = match file.max_checkpoints {
        None => DEFAULT_MAX_CHECKPOINTS,
        Some(n) if n >= 1 && n <= i64::from(u32::MAX) => n as u32,
        Some(n) => {
            return Err(bad(
                "max_checkpoints",
                format!("{n} is not valid; give a whole number of at least 1"),
            ))
        }
    };
    let policy = CheckpointPolicy {
        frequency,
        max_checkpoints,
    };
    policy.validate()?;
    Ok(policy)
}

/// A model as the fork uses it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelPlan {
    pub price: Option<Price>,
    /// Scripted models: the script file's blob.
    pub script: Option<BlobHash>,
    /// Real models: how the workers reach the API (never the key itself).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<Endpoint>,
}

/// One branch, validated.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BranchPlan {
    pub label: String,
    pub steer: String,
    pub model: String,
    pub budget_usd: Option<f64>,
    pub extra_instructions: Option<String>,
    pub max_turns: u32,
    /// The branch's own output cap per call (the fork's when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_output_tokens: Option<u32>,
}

/// A validated fork: what the coordinator needs to create it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ForkPlan {
    pub goal: String,
    pub system_prompt: Option<String>,
    /// An existing conversation the parent run starts from.
    pub history: Vec<Message>,
    pub model: String,
    pub limits: Limits,
    pub conflict_policy: ConflictPolicy,
    pub aggregate_budget_usd: Option<f64>,
    /// Mode, what a cap does when reached, and the account charged.
    #[serde(default)]
    pub budget: BudgetPolicy,
    /// Strategy, judges, confidence formula, test command.
    #[serde(default)]
    pub resolve: ResolvePlan,
    pub models: BTreeMap<String, ModelPlan>,
    pub branches: Vec<BranchPlan>,
    /// The agents' `run_command` tool, when enabled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_command: Option<CommandTool>,
    /// The agents get the fork tools.
    #[serde(default, skip_serializing_if = "is_false")]
    pub forking: bool,
    /// A root run of a single agent: one branch labelled `main` whose run is the root's own
    /// agent (at the parent's depth, merged back when it is done).
    #[serde(default, skip_serializing_if = "is_false")]
    pub solo: bool,
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// A spec loaded from disk: the plan plus what the client uploads with it.
#[derive(Debug, Clone)]
pub struct LoadedSpec {
    pub plan: ForkPlan,
    pub spec_path: PathBuf,
    /// The workspace directory, absolute.
    pub workspace: PathBuf,
    pub exclude: Vec<String>,
    /// Script files by hash.
    pub blobs: BTreeMap<BlobHash, Bytes>,
}

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
    #[error("`{field}` is {value}; budgets must be finite and zero or more (USD)")]
    BadBudget { field: String, value: f64 },
    #[error("`{field}` must be at least 1")]
    ZeroLimit { field: String },
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
        "[models.\"{model}\"] is configured but no branch uses it and it is not the fork's model"
    )]
    UnusedModel { model: String },
    #[error("[models.\"{model}\"]: {message}")]
    BadModel { model: String, message: String },
    #[error("[run_command]: {message}", message = .0)]
    BadRunCommand(String),
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

/// Read, parse and validate a spec file; read the files it names. Prices come from the
/// spec, else the built-in table.
pub fn load(spec_path: &Path) -> Result<LoadedSpec, SpecError> {
    load_with(spec_path, &BTreeMap::new())
}

/// [`load`], with price overrides (the config's `[pricing]`) consulted after the spec's
/// own `[models."NAME"] price` and before the built-in table.
pub fn load_with(
    spec_path: &Path,
    prices: &BTreeMap<String, Price>,
) -> Result<LoadedSpec, SpecError> {
    let text = std::fs::read_to_string(spec_path).map_err(|source| SpecError::Read {
        path: spec_path.to_path_buf(),
        source,
    })?;
    let file: SpecFile = toml::from_str(&text).map_err(|e| SpecError::Toml {
        path: spec_path.to_path_buf(),
        message: e.to_string().trim().to_string(),
    })?;
    let dir = spec_path
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."));
    let dir = if dir.as_os_str().is_empty() {
        PathBuf::from(".")
    } else {
        dir
    };
    let mut plan = validate_with(&file, 0, prices)?;

    let workspace = dir.join(&file.workspace);
    if !workspace.is_dir() {
        return Err(SpecError::WorkspaceMissing(workspace));
    }
    let workspace = workspace
        .canonicalize()
        .map_err(|_| SpecError::WorkspaceMissing(workspace.clone()))?;

    if let Some(h) = &file.history {
        let path = dir.join(h);
        let text = std::fs::read_to_string(&path).map_err(|e| SpecError::History {
            path: path.clone(),
            message: e.to_string(),
        })?;
        plan.history = serde_json::from_str(&text).map_err(|e| SpecError::History {
            path: path.clone(),
            message: e.to_string(),
        })?;
    }

    let mut blobs = BTreeMap::new();
    for (name, section) in &file.models {
        let Some(script_file) = &section.script else {
            continue;
        };
        let path = dir.join(script_file);
        let text = std::fs::read_to_string(&path).map_err(|e| SpecError::Script {
            model: name.clone(),
            path: path.clone(),
            source: ScriptError::Parse(e.to_string()),
        })?;
        let script = Script::parse(&text).map_err(|source| SpecError::Script {
            model: name.clone(),
            path: path.clone(),
            source,
        })?;
        for b in plan.branches.iter().filter(|b| &b.model == name) {
            script
                .check_label(&b.label)
                .map_err(|source| SpecError::Script {
                    model: name.clone(),
                    path: path.clone(),
                    source,
                })?;
        }
        let bytes = Bytes::from(text.into_bytes());
        let hash = BlobHash::of(&bytes);
        blobs.insert(hash, bytes);
        if let Some(m) = plan.models.get_mut(name) {
            m.script = Some(hash);
        }
    }

    Ok(LoadedSpec {
        plan,
        spec_path: spec_path.to_path_buf(),
        workspace,
        exclude: file
            .exclude
            .clone()
            .unwrap_or_else(|| vec![".git".to_string(), ".forkfleet".to_string()]),
        blobs,
    })
}

/// Validate a parsed spec for a fork whose parent is at `depth` (0 for a root run).
/// Script blobs are filled in by [`load`].
pub fn validate(file: &SpecFile, depth: u32) -> Result<ForkPlan, SpecError> {
    validate_with(file, depth, &BTreeMap::new())
}

/// [`validate`] with price overrides (see [`load_with`]).
pub fn validate_with(
    file: &SpecFile,
    depth: u32,
    prices: &BTreeMap<String, Price>,
) -> Result<ForkPlan, SpecError> {
    let limits = Limits {
        max_branches: file.max_branches.unwrap_or(DEFAULT_MAX_BRANCHES),
        max_depth: file.max_depth.unwrap_or(DEFAULT_MAX_DEPTH),
        max_turns: file.max_turns.unwrap_or(DEFAULT_MAX_TURNS),
        max_output_tokens: file.max_output_tokens.unwrap_or(DEFAULT_MAX_OUTPUT_TOKENS),
        checkpoints: CheckpointPolicy::default(),
    };
    let solo = file.branches.is_empty();
    if solo && file.goal.trim().is_empty() {
        return Err(SpecError::NoBranches);
    }
    let solo_branch = [BranchSection {
        label: Some(SOLO_LABEL.to_string()),
        ..BranchSection::default()
    }];
    let sections: &[BranchSection] = if solo { &solo_branch } else { &file.branches };
    if sections.len() > limits.max_branches {
        return Err(SpecError::TooManyBranches {
            requested: file.branches.len(),
            max: limits.max_branches,
        });
    }
    check_depth(depth, limits.max_depth)?;
    for (field, v) in [
        ("max_branches", limits.max_branches as u64),
        ("max_turns", limits.max_turns as u64),
        ("max_output_tokens", limits.max_output_tokens as u64),
    ] {
        if v == 0 {
            return Err(SpecError::ZeroLimit {
                field: field.to_string(),
            });
        }
    }

    let limits = Limits {
        checkpoints: checkpoint_policy(file)?,
        ..limits
    };

    let labels = normalise_labels(sections.iter().map(|b| b.label.as_deref()))?;
    check_budget("budget_usd", file.budget_usd)?;
    check_budget("aggregate_budget_usd", file.aggregate_budget_usd)?;
    if let Some(name) = &file.account {
        check_account_name(name)?;
    }
    check_model_name(&file.model)?;

    let mut branches = Vec::with_capacity(sections.len());
    for (i, (b, label)) in sections.iter().zip(labels).enumerate() {
        let model = b.model.clone().unwrap_or_else(|| file.model.clone());
        check_model_name(&model)?;
        let field = format!("branches[{i}].budget_usd");
        check_budget(&field, b.budget_usd)?;
        for (field, v) in [
            ("max_turns", b.max_turns),
            ("max_output_tokens", b.max_output_tokens),
        ] {
            if v == Some(0) {
                return Err(SpecError::ZeroLimit {
                    field: format!("branches[{i}].{field}"),
                });
            }
        }
        branches.push(BranchPlan {
            label,
            steer: b.steer.clone().unwrap_or_default(),
            model,
            budget_usd: b.budget_usd.or(file.budget_usd),
            extra_instructions: b.extra_instructions.clone(),
            max_turns: b.max_turns.unwrap_or(limits.max_turns),
            max_output_tokens: b.max_output_tokens,
        });
    }

    let resolve = resolve_plan(file)?;
    let mut used: BTreeSet<&str> = branches.iter().map(|b| b.model.as_str()).collect();
    used.insert(file.model.as_str());
    for judge in &resolve.judge_models {
        check_model_name(judge)?;
        used.insert(judge.as_str());
    }
    for name in file.models.keys() {
        check_model_name(name)?;
        if !used.contains(name.as_str()) {
            return Err(SpecError::UnusedModel {
                model: name.clone(),
            });
        }
    }
    let mut models = BTreeMap::new();
    for name in used {
        let section = file.models.get(name);
        let price = match section.and_then(|s| s.price) {
            Some(p) => {
                p.validate().map_err(|message| SpecError::BadPrice {
                    model: name.to_string(),
                    message,
                })?;
                Some(p)
            }
            None => match prices.get(name) {
                Some(p) => {
                    p.validate().map_err(|message| SpecError::BadPrice {
                        model: name.to_string(),
                        message,
                    })?;
                    Some(*p)
                }
                None => builtin_price(name),
            },
        };
        let scripted = name.starts_with("scripted:");
        if scripted && section.and_then(|s| s.script.as_ref()).is_none() {
            return Err(SpecError::NoScript {
                model: name.to_string(),
            });
        }
        let endpoint = section.map(ModelSection::endpoint).unwrap_or_default();
        let bad_model = |message: String| SpecError::BadModel {
            model: name.to_string(),
            message,
        };
        if scripted && !endpoint.is_empty() {
            return Err(bad_model(
                "a scripted model takes only `script` and `price`; base_url, api_key_env, api_key_file, timeout_s and max_retries are for openai: and anthropic: models".to_string(),
            ));
        }
        if !scripted && section.and_then(|s| s.script.as_ref()).is_some() {
            return Err(bad_model(
                "only scripted: models take a `script`".to_string(),
            ));
        }
        endpoint.validate().map_err(bad_model)?;
        models.insert(
            name.to_string(),
            ModelPlan {
                price,
                script: None,
                endpoint: (!endpoint.is_empty()).then_some(endpoint),
            },
        );
    }
    // A budget on a model with no known price would be a silently disabled cap.
    for (i, b) in branches.iter().enumerate() {
        let capped =
            b.budget_usd.is_some() || file.aggregate_budget_usd.is_some() || file.account.is_some();
        if capped && models.get(&b.model).and_then(|m| m.price).is_none() {
            let field = if sections[i].budget_usd.is_some() {
                format!("branches[{i}].budget_usd")
            } else if file.budget_usd.is_some() {
                "budget_usd".to_string()
            } else if file.aggregate_budget_usd.is_some() {
                "aggregate_budget_usd".to_string()
            } else {
                "account".to_string()
            };
            return Err(SpecError::NoPrice {
                model: b.model.clone(),
                field,
            });
        }
    }

    Ok(ForkPlan {
        goal: file.goal.clone(),
        system_prompt: file.system_prompt.clone(),
        history: Vec::new(),
        model: file.model.clone(),
        limits,
        conflict_policy: file.conflict_policy.unwrap_or_default(),
        aggregate_budget_usd: file.aggregate_budget_usd,
        budget: BudgetPolicy {
            mode: file.budget_mode.unwrap_or_default(),
            on_exhausted: file.on_exhausted.unwrap_or_default(),
            account: file.account.clone(),
            cancel_in_flight: file.cancel_in_flight,
        },
        resolve,
        models,
        branches,
        run_command: match &file.run_command {
            Some(section) => Some(section.validate().map_err(SpecError::BadRunCommand)?),
            None => None,
        },
        forking: file.forking.unwrap_or(false),
        solo,
    })
}

/// The resolve settings of a spec, validated (in the order the keys are documented).
fn resolve_plan(file: &SpecFile) -> Result<ResolvePlan, SpecError> {
    let bad = |field, message: String| SpecError::BadResolve { field, message };
    let kind = file.strategy.as_deref().unwrap_or("manual");
    if file.confidence_threshold.is_some() && kind != "auto_with_fallback" {
        return Err(bad(
            "confidence_threshold",
            format!("only `auto_with_fallback` uses a threshold; the strategy is `{kind}`"),
        ));
    }
    let one_judge = || -> Result<Vec<String>, SpecError> {
        if file.judge_models.is_some() {
            return Err(bad(
                "judge_models",
                format!("`{kind}` has one judge: set `judge_model`; `judge_models` is for `vote`"),
            ));
        }
        match &file.judge_model {
            Some(m) => Ok(vec![m.clone()]),
            None => Err(bad(
                "judge_model",
                format!("strategy `{kind}` needs a judge: set `judge_model = \"provider:name\"`"),
            )),
        }
    };
    let threshold = file.confidence_threshold.unwrap_or(DEFAULT_THRESHOLD);
    let Some(strategy) = Strategy::from_name(kind, threshold) else {
        return Err(bad(
            "strategy",
            format!("`{kind}` is not a strategy; valid: {STRATEGY_NAMES}"),
        ));
    };
    let judges = match &strategy {
        // A manual fork runs no judge by itself, but may name one (or several) for a
        // later `forkfleet fork resolve --strategy ...`.
        Strategy::Manual => match (&file.judge_model, &file.judge_models) {
            (Some(_), Some(_)) => {
                return Err(bad(
                    "judge_models",
                    "set `judge_model` or `judge_models`, not both".to_string(),
                ))
            }
            (Some(m), None) => vec![m.clone()],
            (None, Some(ms)) => ms.clone(),
            (None, None) => Vec::new(),
        },
        Strategy::Auto | Strategy::AutoWithFallback { .. } => one_judge()?,
        Strategy::Vote => {
            if file.judge_model.is_some() {
                return Err(bad(
                    "judge_model",
                    "`vote` has several judges: set `judge_models = [...]`".to_string(),
                ));
            }
            file.judge_models.clone().unwrap_or_default()
        }
    };
    let test = match &file.test_command {
        None => {
            if file.test_timeout_s.is_some() || !file.test_env.is_empty() {
                return Err(bad(
                    "test_command",
                    "`test_timeout_s` and `test_env` need a `test_command`".to_string(),
                ));
            }
            None
        }
        Some(cmd) => {
            let argv = match cmd {
                TestCommand::Argv(v) => v.clone(),
                TestCommand::Line(line) => split_words(line).map_err(|m| bad("test_command", m))?,
            };
            Some(TestPlan {
                argv,
                timeout_s: file.test_timeout_s.unwrap_or(DEFAULT_TEST_TIMEOUT_S),
                env: file.test_env.clone(),
            })
        }
    };
    let plan = ResolvePlan {
        strategy,
        judge_models: judges,
        confidence_formula: file.confidence_formula.unwrap_or_default(),
        test,
        keep_artifacts: file.keep_artifacts.unwrap_or(false),
    };
    plan.validate()?;
    Ok(plan)
}

impl ResolvePlan {
    /// The rules a plan holds whoever built it (the spec parser, or a client of the
    /// coordinator's API, which checks again): the strategy's threshold, as many judges as
    /// the strategy has (none, one, or at least one for a vote), judge models of the form
    /// `provider:name`, and a test command with a program, a timeout above 0 and variable
    /// names for its environment.
    pub fn validate(&self) -> Result<(), SpecError> {
        let bad = |field, message: String| SpecError::BadResolve { field, message };
        self.strategy
            .validate()
            .map_err(|e| bad("strategy", e.to_string()))?;
        let kind = self.strategy.as_str();
        let judges = self.judge_models.len();
        match self.strategy {
            Strategy::Auto | Strategy::AutoWithFallback { .. } if judges != 1 => {
                return Err(bad(
                    "judge_model",
                    format!("strategy `{kind}` has one judge, not {judges}: set `judge_model = \"provider:name\"`"),
                ))
            }
            Strategy::Vote if judges == 0 => {
                return Err(bad(
                    "judge_models",
                    "a vote needs at least one judge model: set `judge_models = [...]`"
                        .to_string(),
                ))
            }
            _ => {}
        }
        for judge in &self.judge_models {
            check_model_name(judge)?;
        }
        if let Some(test) = &self.test {
            test.validate().map_err(|(field, m)| bad(field, m))?;
        }
        Ok(())
    }
}

impl TestPlan {
    /// A program to run, a timeout above 0, and variable names for the environment; the
    /// key at fault and why.
    fn validate(&self) -> Result<(), (&'static str, String)> {
        if self.argv.first().is_none_or(|p| p.trim().is_empty()) {
            return Err((
                "test_command",
                "the command is empty; give a program and its arguments".to_string(),
            ));
        }
        if !self.timeout_s.is_finite()
            || self.timeout_s <= 0.0
            || self.timeout_s > MAX_TEST_TIMEOUT_S
        {
            return Err((
                "test_timeout_s",
                format!(
                    "{} is not a number of seconds above 0 and at most {MAX_TEST_TIMEOUT_S}",
                    self.timeout_s
                ),
            ));
        }
        for key in self.env.keys() {
            if !crate::endpoint::is_env_name(key) {
                return Err((
                    "test_env",
                    format!("`{key}` is not a variable name (letters, digits and `_`, not starting with a digit)"),
                ));
            }
        }
        Ok(())
    }
}

/// Split a command line into words as a POSIX shell would for plain words, quotes and
/// backslashes, without expanding anything (no variables, globs, pipes: the command runs
/// without a shell).
pub fn split_words(line: &str) -> Result<Vec<String>, String> {
    let mut words = Vec::new();
    let mut cur = String::new();
    let mut in_word = false;
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match c {
            '\'' => {
                in_word = true;
                loop {
                    match chars.next() {
                        Some('\'') => break,
                        Some(ch) => cur.push(ch),
                        None => return Err(format!("unterminated single quote in `{line}`")),
                    }
                }
            }
            '"' => {
                in_word = true;
                loop {
                    match chars.next() {
                        Some('"') => break,
                        Some('\\') => match chars.next() {
                            Some(ch @ ('"' | '\\' | '$' | '`')) => cur.push(ch),
                            Some(ch) => {
                                cur.push('\\');
                                cur.push(ch);
                            }
                            None => return Err(format!("unterminated double quote in `{line}`")),
                        },
                        Some(ch) => cur.push(ch),
                        None => return Err(format!("unterminated double quote in `{line}`")),
                    }
                }
            }
            '\\' => match chars.next() {
                Some(ch) => {
                    in_word = true;
                    cur.push(ch);
                }
                None => return Err(format!("`{line}` ends with a lone backslash")),
            },
            c if c.is_whitespace() => {
                if in_word {
                    words.push(std::mem::take(&mut cur));
                    in_word = false;
                }
            }
            c => {
                in_word = true;
                cur.push(c);
            }
        }
    }
    if in_word {
        words.push(cur);
    }
    Ok(words)
}

/// A fork from a parent at `depth` is allowed while `depth < max_depth`.
pub fn check_depth(depth: u32, max_depth: u32) -> Result<(), SpecError> {
    if depth >= max_depth {
        return Err(SpecError::DepthExceeded {
            depth,
            max: max_depth,
            last: max_depth.saturating_sub(1),
        });
    }
    Ok(())
}

fn check_budget(field: &str, v: Option<f64>) -> Result<(), SpecError> {
    match v {
        Some(v) if !v.is_finite() || v < 0.0 => Err(SpecError::BadBudget {
            field: field.to_string(),
            value: v,
        }),
        _ => Ok(()),
    }
}

fn check_model_name(model: &str) -> Result<(), SpecError> {
    split_model(model).map(|_| ())
}

/// Split a model name `provider:name`, checking the provider is one of [`PROVIDERS`].
pub fn split_model(model: &str) -> Result<(&str, &str), SpecError> {
    let valid = || PROVIDERS.join(", ");
    match model.split_once(':') {
        Some((provider, name)) if !name.is_empty() => {
            if PROVIDERS.contains(&provider) {
                Ok((provider, name))
            } else {
                Err(SpecError::UnknownProvider {
                    model: model.to_string(),
                    provider: provider.to_string(),
                    valid: valid(),
                })
            }
        }
        _ => Err(SpecError::BadModelName {
            model: model.to_string(),
            valid: valid(),
        }),
    }
}

/// Blank labels become `branch-{i+1}`; a repeated label gets `-2`, `-3`, ... Labels must
/// be safe as a directory name.
pub fn normalise_labels<'a>(
    labels: impl IntoIterator<Item = Option<&'a str>>,
) -> Result<Vec<String>, SpecError> {
    let mut seen: BTreeSet<String> = BTreeSet::new();
    let mut out = Vec::new();
    for (i, l) in labels.into_iter().enumerate() {
        let base = match l.map(str::trim) {
            None | Some("") => format!("branch-{}", i + 1),
            Some(s) => s.to_string(),
        };
        check_label(&base)?;
        let mut label = base.clone();
        let mut n = 2;
        while seen.contains(&label) {
            label = format!("{base}-{n}");
            n += 1;
        }
        seen.insert(label.clone());
        out.push(label);
    }
    Ok(out)
}

/// A label is a safe single directory name.
pub fn check_label(label: &str) -> Result<(), SpecError> {
    let bad = |reason| {
        Err(SpecError::BadLabel {
            label: label.to_string(),
            reason,
        })
    };
    if label.len() > MAX_LABEL_LEN {
        return bad("it is longer than 64 characters");
    }
    if label.contains('/') || label.contains('\\') {
        return bad("it contains a path separator");
    }
    if label.starts_with('.') {
        return bad("it starts with `.`");
    }
    if !label
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    {
        return bad("it contains a character other than letters, digits, `-`, `_` and `.`");
    }
    Ok(())
}

/// An account name follows the label rules (it names a ledger, and shows in paths and
/// subjects nowhere, but one rule is easier to remember) and is not empty.
pub fn check_account_name(name: &str) -> Result<(), SpecError> {
    if name.is_empty() {
        return Err(SpecError::BadAccount {
            name: name.to_string(),
            reason: "it is empty",
        });
    }
    check_label(name).map_err(|e| match e {
        SpecError::BadLabel { reason, .. } => SpecError::BadAccount {
            name: name.to_string(),
            reason,
        },
        other => other,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<ForkPlan, SpecError> {
        let f: SpecFile = toml::from_str(s).map_err(|e| SpecError::Toml {
            path: "t".into(),
            message: e.to_string(),
        })?;
        validate(&f, 0)
    }

    /// A spec with `top` keys, the demo model (with `model` extra keys) and `rest`.
    fn spec(top: &str, model: &str, rest: &str) -> String {
        format!("goal = \"g\"\nworkspace = \"w\"\nmodel = \"scripted:demo\"\n{top}\n[models.\"scripted:demo\"]\nscript = \"s.toml\"\n{model}\n{rest}")
    }

    #[test]
    fn labels_blank_and_duplicates() {
        let p = parse(&spec(
            "",
            "",
            "[[branches]]\nsteer = \"a\"\n[[branches]]\nlabel = \"x\"\n[[branches]]\nlabel = \"x\"\n[[branches]]\nlabel = \" \"\n[[branches]]\nlabel = \"x\"",
        ))
        .unwrap();
        let labels: Vec<_> = p.branches.iter().map(|b| b.label.as_str()).collect();
        assert_eq!(labels, ["branch-1", "x", "x-2", "branch-4", "x-3"]);
    }

    #[test]
    fn checkpoint_keys_default_and_are_validated() {
        let b = "[[branches]]\nsteer = \"a\"";
        let p = parse(&spec("", "", b)).unwrap();
        assert_eq!(p.limits.checkpoints, CheckpointPolicy::default());
        assert_eq!(
            p.limits.checkpoints.frequency,
            CheckpointFrequency::EveryTool
        );
        assert_eq!(p.limits.checkpoints.max_checkpoints, 20);
        let p = parse(&spec(
            "checkpoints = \"every_turn\"\nmax_checkpoints = 3",
            "",
            b,
        ))
        .unwrap();
        assert_eq!(
            p.limits.checkpoints,
            CheckpointPolicy {
                frequency: CheckpointFrequency::EveryTurn,
                max_checkpoints: 3
            }
        );
        let err = parse(&spec("checkpoints = \"sometimes\"", "", b)).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("`checkpoints`") && msg.contains("sometimes"),
            "{msg}"
        );
        assert!(msg.contains("every_turn, every_tool, manual_only"), "{msg}");
        for bad in ["0", "-3"] {
            let err = parse(&spec(&format!("max_checkpoints = {bad}"), "", b)).unwrap_err();
            assert!(err.to_string().contains("`max_checkpoints`"), "{err}");
        }
        // Branches are checked first (the documented order).
        assert!(matches!(
            parse(&spec("max_checkpoints = 0\nmax_branches = 0", "", "")),
            Err(SpecError::TooManyBranches { .. })
        ));
        // A plan stored before the keys existed has no automatic checkpoints.
        let limits: Limits = serde_json::from_str(
            r#"{"max_branches": 1, "max_depth": 2, "max_turns": 3, "max_output_tokens": 4}"#,
        )
        .unwrap();
        assert_eq!(
            limits.checkpoints.frequency,
            CheckpointFrequency::ManualOnly
        );
    }

    #[test]
    fn real_models_take_endpoints_and_tools_are_enabled_per_spec() {
        let text = "goal = \"g\"\nworkspace = \"w\"\nmodel = \"openai:gpt-4o-mini\"\nforking = true\n\
            [run_command]\ntimeout_s = 5\nenv = { A = \"1\" }\n\
            [models.\"openai:gpt-4o-mini\"]\nbase_url = \"http://127.0.0.1:9/v1\"\napi_key_env = \"MY_KEY\"\nmax_retries = 2\n\
            [[branches]]\nlabel = \"a\"\nmax_output_tokens = 7\n";
        let p = parse(text).unwrap();
        let m = &p.models["openai:gpt-4o-mini"];
        let e = m.endpoint.as_ref().unwrap();
        assert_eq!(e.base_url.as_deref(), Some("http://127.0.0.1:9/v1"));
        assert_eq!(e.api_key_env.as_deref(), Some("MY_KEY"));
        assert_eq!(e.max_retries, Some(2));
        assert!(p.forking && !p.solo);
        let tool = p.run_command.as_ref().unwrap();
        assert_eq!(tool.timeout_s, 5.0);
        assert_eq!(tool.env["A"], "1");
        assert_eq!(p.branches[0].max_output_tokens, Some(7));

        let err =
            parse(&text.replace("max_output_tokens = 7", "max_output_tokens = 0")).unwrap_err();
        assert!(
            err.to_string().contains("branches[0].max_output_tokens"),
            "{err}"
        );
        let err = parse(&text.replace("http://127.0.0.1:9/v1", "127.0.0.1")).unwrap_err();
        assert!(err.to_string().contains("base_url"), "{err}");
        let err = parse(&text.replace("timeout_s = 5", "timeout_s = -5")).unwrap_err();
        assert!(err.to_string().contains("[run_command]"), "{err}");
        // A scripted model takes no endpoint.
        let err = parse(&spec("", "base_url = \"http://x\"", "[[branches]]")).unwrap_err();
        assert!(
            err.to_string().contains("scripted model takes only"),
            "{err}"
        );
    }

    #[test]
    fn unknown_key_lists_valid_keys() {
        let err = parse(&spec("colour = 1", "", "[[branches]]\nsteer = \"a\"")).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("unknown field `colour`"), "{msg}");
        assert!(
            msg.contains("goal") && msg.contains("max_branches"),
            "{msg}"
        );
        let err = parse(&spec("", "", "[[branches]]\nsteer = \"a\"\nbudget = 1")).unwrap_err();
        assert!(err.to_string().contains("budget_usd"), "{err}");
    }

    #[test]
    fn validation_order_and_limits() {
        // No branches: a root run of one agent, unless there is no goal either.
        let solo = parse(&spec("", "", "")).unwrap();
        assert!(solo.solo);
        assert_eq!(solo.branches.len(), 1);
        assert_eq!(solo.branches[0].label, SOLO_LABEL);
        assert_eq!(solo.branches[0].steer, "");
        assert!(matches!(
            parse(&spec("", "", "").replace("goal = \"g\"", "goal = \" \"")),
            Err(SpecError::NoBranches)
        ));
        let many = spec("max_branches = 2", "", &"[[branches]]\n".repeat(3));
        assert!(matches!(
            parse(&many),
            Err(SpecError::TooManyBranches {
                requested: 3,
                max: 2
            })
        ));
        assert!(matches!(
            check_depth(2, 2),
            Err(SpecError::DepthExceeded { .. })
        ));
        assert!(check_depth(1, 2).is_ok());
    }

    #[test]
    fn bad_labels_budgets_models() {
        for l in ["../../x", "a/b", ".hidden", "a b"] {
            let err = parse(&spec("", "", &format!("[[branches]]\nlabel = \"{l}\""))).unwrap_err();
            assert!(matches!(err, SpecError::BadLabel { .. }), "{l}: {err}");
        }
        let err = parse(&spec("", "", "[[branches]]\nbudget_usd = -1.0")).unwrap_err();
        assert!(matches!(err, SpecError::BadBudget { .. }), "{err}");
        let err =
            parse("goal = \"g\"\nworkspace = \"w\"\nmodel = \"gpt\"\n[[branches]]").unwrap_err();
        assert!(matches!(err, SpecError::BadModelName { .. }), "{err}");
        let err =
            parse("goal = \"g\"\nworkspace = \"w\"\nmodel = \"nope:x\"\n[[branches]]").unwrap_err();
        assert!(
            err.to_string().contains("valid providers: scripted"),
            "{err}"
        );
        let err = parse("goal = \"g\"\nworkspace = \"w\"\nmodel = \"scripted:x\"\n[[branches]]")
            .unwrap_err();
        assert!(matches!(err, SpecError::NoScript { .. }), "{err}");
    }

    #[test]
    fn budget_policy_and_accounts() {
        let plan = parse(&spec(
            "account = \"team-a\"\nbudget_mode = \"best_effort\"\non_exhausted = \"pause\"",
            "price = { input_per_mtok = 1.0, output_per_mtok = 2.0 }",
            "[[branches]]",
        ))
        .unwrap();
        assert_eq!(plan.budget.account.as_deref(), Some("team-a"));
        assert_eq!(plan.budget.mode, BudgetMode::BestEffort);
        assert_eq!(plan.budget.on_exhausted, OnExhausted::Pause);
        let plan = parse(&spec("", "", "[[branches]]")).unwrap();
        assert_eq!(plan.budget, BudgetPolicy::default());
        let err = parse(&spec("account = \"../x\"", "", "[[branches]]")).unwrap_err();
        assert!(err.to_string().contains("account name `../x`"), "{err}");
        let err = parse(&spec("budget_mode = \"loose\"", "", "[[branches]]")).unwrap_err();
        assert!(err.to_string().contains("strict"), "{err}");
        // An account needs priced models, like any cap.
        let err = parse(&spec("account = \"team-a\"", "", "[[branches]]")).unwrap_err();
        assert!(err.to_string().contains("`account` sets a budget"), "{err}");
    }

    #[test]
    fn resolve_settings_are_validated() {
        let plan = parse(&spec("", "", "[[branches]]")).unwrap();
        assert_eq!(plan.resolve, ResolvePlan::default());
        assert_eq!(plan.resolve.strategy, Strategy::Manual);
        let judge = "[models.\"scripted:judge\"]\nscript = \"j.toml\"";
        let plan = parse(&spec(
            "strategy = \"auto_with_fallback\"\nconfidence_threshold = 0.7\njudge_model = \"scripted:judge\"\ntest_command = \"pytest -q 'tests/a b.py'\"\ntest_timeout_s = 30\ntest_env = { PYTHONHASHSEED = \"0\" }\nconfidence_formula = \"peer_v1\"\nkeep_artifacts = true",
            "",
            &format!("{judge}\n[[branches]]"),
        ))
        .unwrap();
        assert_eq!(
            plan.resolve.strategy,
            Strategy::AutoWithFallback { threshold: 0.7 }
        );
        assert_eq!(
            plan.resolve.judge_models,
            vec!["scripted:judge".to_string()]
        );
        assert!(plan.models.contains_key("scripted:judge"));
        let test = plan.resolve.test.as_ref().unwrap();
        assert_eq!(test.argv, vec!["pytest", "-q", "tests/a b.py"]);
        assert_eq!(test.timeout_s, 30.0);
        assert_eq!(plan.resolve.confidence_formula, ConfidenceFormula::PeerV1);
        assert!(plan.resolve.keep_artifacts);
        let vote = parse(&spec(
            "strategy = \"vote\"\njudge_models = [\"scripted:judge\", \"scripted:judge\"]\ntest_command = [\"cargo\", \"test\"]",
            "",
            &format!("{judge}\n[[branches]]"),
        ))
        .unwrap();
        assert_eq!(vote.resolve.strategy, Strategy::Vote);
        assert_eq!(vote.resolve.judge_models.len(), 2);
        for (top, needle) in [
            ("strategy = \"best\"", "valid: manual, auto"),
            ("strategy = \"auto\"", "needs a judge"),
            ("strategy = \"vote\"", "at least one judge model"),
            ("strategy = \"vote\"\njudge_model = \"scripted:judge\"", "judge_models = [...]"),
            ("judge_model = \"scripted:judge\"\njudge_models = [\"scripted:judge\"]", "not both"),
            ("test_command = \"pytest\"\ntest_timeout_s = 7200", "at most 3600"),
            ("confidence_threshold = 0.5", "only `auto_with_fallback`"),
            ("strategy = \"auto_with_fallback\"\njudge_model = \"scripted:judge\"\nconfidence_threshold = 1.5", "not a number in [0, 1]"),
            ("test_command = \"\"", "the command is empty"),
            ("test_command = \"pytest 'unclosed\"", "unterminated single quote"),
            ("test_command = \"pytest\"\ntest_timeout_s = 0", "above 0"),
            ("test_timeout_s = 5", "need a `test_command`"),
            ("test_command = \"x\"\ntest_env = { \"1BAD\" = \"v\" }", "not a variable name"),
            ("strategy = \"auto\"\njudge_model = \"nope:judge\"", "unknown provider"),
        ] {
            let err = parse(&spec(top, "", &format!("{judge}\n[[branches]]")))
                .or_else(|e| {
                    // Without a judge using it, the judge's model section is unused: try
                    // without it so the error under test is the one reported.
                    if matches!(e, SpecError::UnusedModel { .. }) {
                        parse(&spec(top, "", "[[branches]]"))
                    } else {
                        Err(e)
                    }
                })
                .unwrap_err();
            assert!(err.to_string().contains(needle), "{top}: {err}");
        }
    }

    #[test]
    fn words_split_like_a_shell_without_one() {
        assert_eq!(
            split_words(r#"cargo test -- --exact "a b" 'c d' e\ f"#).unwrap(),
            vec!["cargo", "test", "--", "--exact", "a b", "c d", "e f"]
        );
        assert_eq!(split_words("  ").unwrap(), Vec::<String>::new());
        assert_eq!(split_words("a ''").unwrap(), vec!["a", ""]);
        assert_eq!(split_words(r#""$HOME""#).unwrap(), vec!["$HOME"]);
        assert!(split_words("a\\").is_err());
        assert!(split_words("\"open").is_err());
    }

    #[test]
    fn config_prices_fill_in_after_the_spec() {
        let f: SpecFile =
            toml::from_str(&spec("aggregate_budget_usd = 1.0", "", "[[branches]]")).unwrap();
        let mut prices = BTreeMap::new();
        prices.insert(
            "scripted:demo".to_string(),
            Price {
                input_per_mtok: 1.0,
                output_per_mtok: 2.0,
                cached_per_mtok: None,
            },
        );
        let plan = validate_with(&f, 0, &prices).unwrap();
        assert_eq!(
            plan.models["scripted:demo"]
                .price
                .map(|p| p.output_per_mtok),
            Some(2.0)
        );
        assert!(validate(&f, 0).is_err());
    }

    #[test]
    fn budget_needs_a_price() {
        let err = parse(&spec("aggregate_budget_usd = 1.0", "", "[[branches]]")).unwrap_err();
        assert!(matches!(err, SpecError::NoPrice { .. }), "{err}");
        assert!(err.to_string().contains("scripted:demo"));
        let ok = parse(&spec(
            "aggregate_budget_usd = 1.0",
            "price = { input_per_mtok = 1.0, output_per_mtok = 2.0 }",
            "[[branches]]",
        ));
        assert!(ok.is_ok(), "{ok:?}");
    }
}
