//! The spec file as written: the TOML shape, parsed strictly (unknown keys are errors that
//! list the valid ones). `build.rs` turns it into a [`super::ForkPlan`].

use crate::budget::{BudgetMode, OnExhausted};
use crate::endpoint::{CommandToolSection, Endpoint};
use crate::flush::ConflictPolicy;
use crate::pricing::Price;
use crate::resolve::ConfidenceFormula;
use serde::Deserialize;
use std::collections::BTreeMap;

/// The spec file as written. Unknown keys are errors that list the valid ones.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SpecFile {
    /// A name for the fork, shown in lists and usable where a fork id is.
    #[serde(default)]
    pub name: Option<String>,
    pub goal: String,
    pub workspace: String,
    pub model: String,
    #[serde(default)]
    pub system_prompt: Option<String>,
    #[serde(default)]
    pub history: Option<String>,
    #[serde(default)]
    pub exclude: Option<Vec<String>>,
    /// Honour `.gitignore`, `.ignore` and `.git/info/exclude` in the snapshot (default true;
    /// `.forkfleetignore` is always honoured).
    #[serde(default)]
    pub respect_gitignore: Option<bool>,
    #[serde(default)]
    pub max_branches: Option<usize>,
    #[serde(default)]
    pub max_depth: Option<u32>,
    #[serde(default)]
    pub max_turns: Option<u32>,
    #[serde(default)]
    pub max_output_tokens: Option<u32>,
    /// What an answer cut at `max_output_tokens` with no tool call does: `continue`
    /// (default: the branch is asked to go on) or `stop` (the branch ends `truncated`).
    #[serde(default)]
    pub on_truncated: Option<super::plan::OnTruncated>,
    #[serde(default)]
    pub temperature: Option<f64>,
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
    /// Give the agents the checkpoint tools (`save_checkpoint`, `list_checkpoints`,
    /// `rewind_to`).
    #[serde(default)]
    pub checkpoint_tools: Option<bool>,
    /// The checkpoint tools' descriptions, by tool name, instead of the built-in ones.
    #[serde(default)]
    pub tool_descriptions: BTreeMap<String, String>,
    /// The tools' own settings: `[tools.http_get]`, ... (`forkfleet_shared::tools`).
    #[serde(default)]
    pub tools: crate::tools::ToolSections,
    /// Tool calls that wait for a person's consent (docs/APPROVALS.md).
    #[serde(default)]
    pub approval: Option<crate::approval::ApprovalSection>,
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

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    /// Scripted models: the script file, relative to the spec.
    #[serde(default)]
    pub script: Option<String>,
    #[serde(default)]
    pub price: Option<Price>,
    /// Real models (`openai:`, `anthropic:`): the spec's own API base URL, used with no key
    /// and only when the workers' allow-list holds its host.
    #[serde(default)]
    pub base_url: Option<String>,
    /// Refused with a clear error: key sources belong to the workers' catalogue.
    #[serde(default)]
    pub api_key_env: Option<String>,
    /// Refused, as `api_key_env`.
    #[serde(default)]
    pub api_key_file: Option<String>,
    /// Seconds one request may take.
    #[serde(default)]
    pub timeout_s: Option<f64>,
    /// Retries on 429, 5xx or no answer.
    #[serde(default)]
    pub max_retries: Option<u32>,
    /// `openai:` models: `chat` (default) or `responses`.
    #[serde(default)]
    pub api: Option<crate::endpoint::OpenAiApi>,
    /// Prompt caching: `auto` (default) or `off`.
    #[serde(default)]
    pub cache: Option<crate::endpoint::CacheMode>,
    /// Stream answers (default true).
    #[serde(default)]
    pub stream: Option<bool>,
    /// `openai:` reasoning models: `minimal`, `low`, `medium`, `high`.
    #[serde(default)]
    pub reasoning_effort: Option<String>,
    /// `openai:` chat models: `max_tokens` or `max_completion_tokens`.
    #[serde(default)]
    pub token_param: Option<crate::endpoint::TokenParam>,
    /// `openai:` models: the `tool_choice` sent with tools (`auto`, `required`, `none`).
    #[serde(default)]
    pub tool_choice: Option<crate::endpoint::ToolChoice>,
    /// `anthropic:` models: extended thinking's budget, tokens.
    #[serde(default)]
    pub thinking_budget: Option<u32>,
    /// Configured though no branch uses it: a model the runs may be switched to later
    /// (`runs fork --set model=NAME`, docs/LINEAGE.md), which keeps its script and price.
    #[serde(default)]
    pub spare: bool,
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
            api: self.api,
            cache: self.cache,
            stream: self.stream,
            reasoning_effort: self.reasoning_effort.clone(),
            token_param: self.token_param,
            tool_choice: self.tool_choice,
            thinking_budget: self.thinking_budget,
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
    #[serde(default)]
    pub temperature: Option<f64>,
    /// The branch's own approval rules, replacing the fork's `[approval]` (an empty
    /// table: no call of this branch waits).
    #[serde(default)]
    pub approval: Option<crate::approval::ApprovalSection>,
}
