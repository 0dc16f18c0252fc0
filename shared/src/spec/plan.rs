//! The validated shapes: a [`ForkPlan`] (what the coordinator creates a fork from) and its
//! parts. [`ForkPlan::validate`] (in `validate.rs`) holds the rules over them.

use crate::approval::ApprovalRules;
use crate::blob::BlobHash;
use crate::budget::BudgetPolicy;
use crate::endpoint::Endpoint;
use crate::event::Message;
use crate::flush::ConflictPolicy;
use crate::pricing::Price;
use crate::resolve::{ConfidenceFormula, Strategy};
use crate::tools::ToolSettings;
use bytes::Bytes;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::PathBuf;

use super::{
    DEFAULT_MAX_BRANCHES, DEFAULT_MAX_DEPTH, DEFAULT_MAX_OUTPUT_TOKENS, DEFAULT_MAX_TURNS,
};

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
    /// What an answer cut at the output cap with no tool call does.
    #[serde(default)]
    pub on_truncated: OnTruncated,
}

/// What an answer cut at the output cap (`max_output_tokens`) with no tool call does to
/// its branch (`on_truncated`); either way the `model_response` records why it stopped.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnTruncated {
    /// The branch goes on: a user message ([`CONTINUE_TRUNCATED`]) asks the model to
    /// continue where it was cut (within `max_turns`).
    #[default]
    Continue,
    /// The branch ends `truncated`.
    Stop,
}

impl OnTruncated {
    pub fn is_continue(&self) -> bool {
        *self == OnTruncated::Continue
    }
}

/// The user message that asks a model cut at its output cap to go on.
pub const CONTINUE_TRUNCATED: &str = "[forkfleet] Your last answer was cut off at the output token limit. Continue exactly where it stopped; to change files, call the tools (keep each call short enough to fit).";

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_branches: DEFAULT_MAX_BRANCHES,
            max_depth: DEFAULT_MAX_DEPTH,
            max_turns: DEFAULT_MAX_TURNS,
            max_output_tokens: DEFAULT_MAX_OUTPUT_TOKENS,
            checkpoints: CheckpointPolicy::default(),
            on_truncated: OnTruncated::default(),
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
}

/// A model as the fork uses it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelPlan {
    pub price: Option<Price>,
    /// Scripted models: the script file's blob.
    pub script: Option<BlobHash>,
    /// Real models: the spec's own settings (base URL, timeout, retries); never a key
    /// source, which only the workers' catalogue names (ADR 16).
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
    /// The sampling temperature sent with each call (0 to 2; the provider's default when
    /// absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f64>,
    /// The branch's own approval rules, replacing the fork's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval: Option<ApprovalRules>,
}

/// The names of the agents' checkpoint tools.
pub const CHECKPOINT_TOOLS: &[&str] = &["save_checkpoint", "list_checkpoints", "rewind_to"];

/// The agents' checkpoint tools (`checkpoint_tools = true`), with the descriptions the
/// spec's `[tool_descriptions]` gives them instead of the built-in ones.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointTools {
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub descriptions: BTreeMap<String, String>,
}

impl CheckpointTools {
    /// Every description names a checkpoint tool and says something (at most 4,096
    /// characters).
    pub fn check(&self) -> Result<(), String> {
        for (name, text) in &self.descriptions {
            if !CHECKPOINT_TOOLS.contains(&name.as_str()) {
                return Err(format!(
                    "`tool_descriptions` names `{name}`, which is not a checkpoint tool; valid: {}",
                    CHECKPOINT_TOOLS.join(", ")
                ));
            }
            if text.trim().is_empty() || text.chars().count() > 4096 {
                return Err(format!(
                    "`tool_descriptions.{name}` must be 1 to 4096 characters"
                ));
            }
        }
        Ok(())
    }
}

/// A validated fork: what the coordinator needs to create it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ForkPlan {
    /// A name people use for the fork (lists show it; commands take it where a fork id
    /// goes): 1 to 64 letters, digits, `-`, `_` and `.`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
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
    /// The agents' optional tools (`run_command`, the fork tools, the checkpoint tools,
    /// `http_get`, ...), as the spec enables them; flattened: each keeps its own key.
    #[serde(flatten)]
    pub tools: ToolSettings,
    /// Tool calls that wait for a person's consent, for every branch without rules of its
    /// own (docs/APPROVALS.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval: Option<ApprovalRules>,
    /// A root run of a single agent: one branch labelled `main` whose run is the root's own
    /// agent (at the parent's depth, merged back when it is done).
    #[serde(default, skip_serializing_if = "is_false")]
    pub solo: bool,
}

fn is_false(b: &bool) -> bool {
    !*b
}

impl ForkPlan {
    /// The approval rules branch `b` runs under: its own, else the fork's; `None` when no
    /// call of it waits.
    pub fn approval_for<'a>(&'a self, b: &'a BranchPlan) -> Option<&'a ApprovalRules> {
        b.approval
            .as_ref()
            .or(self.approval.as_ref())
            .filter(|r| !r.is_empty())
    }
}

/// A spec loaded from disk: the plan plus what the client uploads with it.
#[derive(Debug, Clone)]
pub struct LoadedSpec {
    pub plan: ForkPlan,
    pub spec_path: PathBuf,
    /// The workspace directory, absolute.
    pub workspace: PathBuf,
    /// What the workspace snapshot leaves out (`exclude`, the ignore files).
    pub scan: crate::scan::ScanOptions,
    /// Script files by hash.
    pub blobs: BTreeMap<BlobHash, Bytes>,
}
