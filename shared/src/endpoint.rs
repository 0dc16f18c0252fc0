//! How a worker reaches a real model's API, and what the agent's command tool may do.
//!
//! [`Endpoint`] is written in a spec's `[models."openai:NAME"]` (or `anthropic:`) section
//! and travels in every branch task: the spec's own base URL (allowed only for hosts on the
//! workers' allow-list, and then called with no key), the request timeout and the retries.
//! A spec never names a key source: keys belong to the workers' catalogue
//! ([`crate::catalogue`], ADR 16), and `api_key_env` / `api_key_file` here are refused
//! everywhere an endpoint is checked (the spec loader, the coordinator, the worker).
//!
//! [`CommandTool`] is the spec's `[run_command]` table: the agent's `run_command` tool is
//! offered only when it is present. Its [`CommandSandbox`] (the table's `sandbox`,
//! `network` and limit fields) confines the tool's commands and the resolve's test command
//! alike (ADR 22).

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Most seconds a model request or a command may be given.
pub const MAX_TIMEOUT_S: f64 = crate::spec::MAX_TEST_TIMEOUT_S;
/// Most retries of one model call.
pub const MAX_RETRIES: u32 = 10;

/// True when `name` can name an environment variable: letters, digits and `_`, not
/// starting with a digit (what the spec's `test_env`, `[run_command] env` and a catalogue's
/// `api_key_env` take).
pub fn is_env_name(name: &str) -> bool {
    name.chars()
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// Which OpenAI API an `openai:` model is called through (`api`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OpenAiApi {
    /// `POST /chat/completions`: OpenAI and every compatible server.
    #[default]
    Chat,
    /// `POST /responses`: OpenAI's Responses API (reasoning items carried between turns).
    Responses,
}

/// Whether the provider's prompt cache is used (`cache`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CacheMode {
    /// Anthropic: `cache_control` breakpoints on the system prompt, the tools, the end of
    /// the fork's shared history and the end of the branch's own; OpenAI:
    /// `prompt_cache_key` set to the fork tree's root, so every branch of a tree is routed
    /// to one cache.
    #[default]
    Auto,
    /// No breakpoint and no cache key is sent.
    Off,
}

/// The request field that carries the output cap of an OpenAI chat call (`token_param`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TokenParam {
    /// What compatible servers (llama.cpp, vLLM, Ollama, OpenRouter) read.
    MaxTokens,
    /// What OpenAI's reasoning models require (and its other models accept).
    MaxCompletionTokens,
}

/// The `tool_choice` an OpenAI-compatible request sends with its tools (`tool_choice`;
/// unset: none is sent, and the server's default applies). llama-cpp-python's
/// `chatml-function-calling` chat format, for one, leaves the tools out of the prompt
/// unless a request says `auto`; vLLM refuses `auto` unless started with
/// `--enable-auto-tool-choice`, so it is not sent by default.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolChoice {
    /// The model decides whether to call a tool.
    Auto,
    /// The model must call a tool.
    Required,
    /// The model must not call a tool.
    None,
}

impl ToolChoice {
    /// The value as the API spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            ToolChoice::Auto => "auto",
            ToolChoice::Required => "required",
            ToolChoice::None => "none",
        }
    }
}

/// The valid `reasoning_effort` values.
pub const REASONING_EFFORTS: &[&str] = &["minimal", "low", "medium", "high"];
/// The least `thinking_budget` Anthropic accepts.
pub const MIN_THINKING_BUDGET: u32 = 1024;

/// A real model API's connection settings (every field optional: the provider's defaults).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Endpoint {
    /// The API's base URL, e.g. `https://api.openai.com/v1`, `http://127.0.0.1:8080/v1`
    /// (llama.cpp, vLLM, Ollama), `https://openrouter.ai/api/v1`,
    /// `https://api.anthropic.com/v1`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base_url: Option<String>,
    /// Refused: kept so that a spec or a plan naming a key source gets a clear error rather
    /// than an unknown field (key sources belong to the workers' catalogue).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key_env: Option<String>,
    /// Refused, as `api_key_env`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key_file: Option<String>,
    /// Seconds one HTTP request may take.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_s: Option<f64>,
    /// Retries of a call answered 429 or 5xx (or not answered), with backoff and jitter.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_retries: Option<u32>,
    /// `openai:` models: `chat` (default) or `responses`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api: Option<OpenAiApi>,
    /// `auto` (default) or `off`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache: Option<CacheMode>,
    /// Stream the answer (SSE; default true): the output is metered as it comes and a
    /// cancelled call closes its stream at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<bool>,
    /// `openai:` reasoning models: `minimal`, `low`, `medium` or `high`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_effort: Option<String>,
    /// `openai:` chat models: `max_tokens` or `max_completion_tokens`. Default:
    /// `max_completion_tokens` for OpenAI's own API, `max_tokens` for any other base URL.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_param: Option<TokenParam>,
    /// `openai:` models: the `tool_choice` sent with a request that has tools (`auto`,
    /// `required` or `none`; unset: none sent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_choice: Option<ToolChoice>,
    /// `anthropic:` models: extended thinking with this many tokens of budget (at least
    /// 1024, and below the call's output cap).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub thinking_budget: Option<u32>,
}

impl Endpoint {
    /// True when nothing is set (the provider's defaults apply).
    pub fn is_empty(&self) -> bool {
        self == &Endpoint::default()
    }

    /// Check the settings; the error names the field and what is valid.
    pub fn validate(&self) -> Result<(), String> {
        if let Some(url) = &self.base_url {
            let rest = url
                .strip_prefix("http://")
                .or_else(|| url.strip_prefix("https://"));
            match rest {
                Some(host) if !host.is_empty() && !host.starts_with('/') => {}
                _ => {
                    return Err(format!(
                        "base_url `{url}` must be an http:// or https:// URL with a host, such as https://api.openai.com/v1"
                    ))
                }
            }
            if url.contains('@') {
                return Err(
                    "base_url must not carry credentials; keys belong to the workers' catalogue"
                        .to_string(),
                );
            }
        }
        for (field, set) in [
            ("api_key_env", self.api_key_env.is_some()),
            ("api_key_file", self.api_key_file.is_some()),
        ] {
            if set {
                return Err(format!(
                    "{field} is not allowed in a spec: key sources belong to the workers' catalogue (the worker's config `[models.\"NAME\"]`)"
                ));
            }
        }
        if let Some(t) = self.timeout_s {
            if !(t.is_finite() && t > 0.0 && t <= MAX_TIMEOUT_S) {
                return Err(format!(
                    "timeout_s is {t}; it must be more than 0 and at most {MAX_TIMEOUT_S} seconds"
                ));
            }
        }
        if let Some(n) = self.max_retries {
            if n > MAX_RETRIES {
                return Err(format!("max_retries is {n}; at most {MAX_RETRIES}"));
            }
        }
        if let Some(effort) = &self.reasoning_effort {
            if !REASONING_EFFORTS.contains(&effort.as_str()) {
                return Err(format!(
                    "reasoning_effort is `{effort}`; valid: {}",
                    REASONING_EFFORTS.join(", ")
                ));
            }
        }
        if let Some(budget) = self.thinking_budget {
            if budget < MIN_THINKING_BUDGET {
                return Err(format!(
                    "thinking_budget is {budget}; it must be at least {MIN_THINKING_BUDGET} tokens"
                ));
            }
        }
        Ok(())
    }

    /// [`Endpoint::validate`], and that the settings are ones `provider`'s models take:
    /// `api`, `reasoning_effort` and `token_param` for `openai`, `thinking_budget` for
    /// `anthropic`.
    pub fn validate_for(&self, provider: &str) -> Result<(), String> {
        self.validate()?;
        let only = |field: &str, set: bool, for_provider: &str| {
            if set && provider != for_provider {
                Err(format!(
                    "{field} is for {for_provider}: models; a {provider}: model does not take it"
                ))
            } else {
                Ok(())
            }
        };
        only("api", self.api.is_some(), "openai")?;
        only(
            "reasoning_effort",
            self.reasoning_effort.is_some(),
            "openai",
        )?;
        only("token_param", self.token_param.is_some(), "openai")?;
        only("tool_choice", self.tool_choice.is_some(), "openai")?;
        only(
            "thinking_budget",
            self.thinking_budget.is_some(),
            "anthropic",
        )?;
        if self.api == Some(OpenAiApi::Responses) && self.token_param.is_some() {
            return Err(
                "token_param is for api = \"chat\"; the Responses API always takes max_output_tokens"
                    .to_string(),
            );
        }
        Ok(())
    }

    /// Whether answers are streamed (default true).
    pub fn streams(&self) -> bool {
        self.stream.unwrap_or(true)
    }

    /// Whether the prompt cache is used (default true).
    pub fn caches(&self) -> bool {
        self.cache.unwrap_or_default() == CacheMode::Auto
    }
}

/// Default seconds a `run_command` call may run.
pub const DEFAULT_COMMAND_TIMEOUT_S: f64 = 60.0;
/// Default bytes of a command's output the model sees (the middle is cut).
pub const DEFAULT_COMMAND_OUTPUT_BYTES: u32 = 16 * 1024;

/// Whether a command runs in the sandbox (`[run_command] sandbox`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SandboxMode {
    /// Confined where the worker's kernel has Landlock; elsewhere only the resource limits
    /// apply (the worker says so once when it starts).
    #[default]
    Auto,
    /// Confined, or not run: a command is refused, naming why, when the kernel cannot
    /// confine it (no Landlock, or no network rules while `network` is off).
    Required,
    /// No sandbox and no limits: the command sees what the worker sees.
    Off,
}

impl SandboxMode {
    pub fn as_str(self) -> &'static str {
        match self {
            SandboxMode::Auto => "auto",
            SandboxMode::Required => "required",
            SandboxMode::Off => "off",
        }
    }
}

/// Default most processes (per user, as the kernel counts them) a command may have.
pub const DEFAULT_MAX_PROCESSES: u32 = 4096;
/// Default most megabytes of data memory one process of a command may use.
pub const DEFAULT_MAX_MEMORY_MB: u64 = 4096;
/// Default largest file, in megabytes, a command may write.
pub const DEFAULT_MAX_FILE_SIZE_MB: u64 = 1024;

/// How a command (the `run_command` tool's, and the resolve's test command) is confined:
/// the filesystem limited to its tree and scratch directories plus read-only system paths,
/// no TCP unless `network`, resource limits. Every field has a default, so a message
/// written before the sandbox existed decodes to the defaults.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct CommandSandbox {
    pub mode: SandboxMode,
    /// TCP connections and listening sockets allowed.
    pub network: bool,
    /// `RLIMIT_NPROC`: processes of the worker's user (the kernel counts per user, and not
    /// for root) beyond which a command's fork fails.
    pub max_processes: u32,
    /// `RLIMIT_DATA` of every process of the command, megabytes.
    pub max_memory_mb: u64,
    /// `RLIMIT_FSIZE`: the largest file a command may write, megabytes.
    pub max_file_size_mb: u64,
}

impl Default for CommandSandbox {
    fn default() -> Self {
        Self {
            mode: SandboxMode::Auto,
            network: false,
            max_processes: DEFAULT_MAX_PROCESSES,
            max_memory_mb: DEFAULT_MAX_MEMORY_MB,
            max_file_size_mb: DEFAULT_MAX_FILE_SIZE_MB,
        }
    }
}

impl CommandSandbox {
    /// Check the limits; the error names the field and the valid range.
    pub fn validate(&self) -> Result<(), String> {
        for (field, value, min, max) in [
            ("max_processes", u64::from(self.max_processes), 8, 1_048_576),
            ("max_memory_mb", self.max_memory_mb, 64, 1_048_576),
            ("max_file_size_mb", self.max_file_size_mb, 1, 1_048_576),
        ] {
            if !(min..=max).contains(&value) {
                return Err(format!(
                    "{field} is {value}; it must be between {min} and {max}"
                ));
            }
        }
        Ok(())
    }
}

/// The agent's `run_command` tool, as the spec's `[run_command]` table enables it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CommandTool {
    /// The longest a command may run (the model may ask for less), seconds.
    pub timeout_s: f64,
    /// Environment variables the command gets besides PATH, HOME, TMPDIR and LANG.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// Bytes of output (stdout and stderr) returned to the model.
    pub max_output_bytes: u32,
    /// How the tool's commands (and the resolve's test command) are confined.
    #[serde(default)]
    pub sandbox: CommandSandbox,
}

/// `[run_command]` as written in a spec.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CommandToolSection {
    #[serde(default)]
    pub timeout_s: Option<f64>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    pub max_output_bytes: Option<u32>,
    /// `"auto"` (default), `"required"` or `"off"`.
    #[serde(default)]
    pub sandbox: Option<SandboxMode>,
    /// TCP allowed (default false).
    #[serde(default)]
    pub network: Option<bool>,
    #[serde(default)]
    pub max_processes: Option<u32>,
    #[serde(default)]
    pub max_memory_mb: Option<u64>,
    #[serde(default)]
    pub max_file_size_mb: Option<u64>,
}

impl CommandToolSection {
    /// The section a validated tool came from (every field written out).
    pub fn from_tool(tool: &CommandTool) -> Self {
        Self {
            timeout_s: Some(tool.timeout_s),
            env: tool.env.clone(),
            max_output_bytes: Some(tool.max_output_bytes),
            sandbox: Some(tool.sandbox.mode),
            network: Some(tool.sandbox.network),
            max_processes: Some(tool.sandbox.max_processes),
            max_memory_mb: Some(tool.sandbox.max_memory_mb),
            max_file_size_mb: Some(tool.sandbox.max_file_size_mb),
        }
    }

    /// The validated tool; the error names the field and what is valid.
    pub fn validate(&self) -> Result<CommandTool, String> {
        let timeout_s = self.timeout_s.unwrap_or(DEFAULT_COMMAND_TIMEOUT_S);
        if !(timeout_s.is_finite() && timeout_s > 0.0 && timeout_s <= MAX_TIMEOUT_S) {
            return Err(format!(
                "timeout_s is {timeout_s}; it must be more than 0 and at most {MAX_TIMEOUT_S} seconds"
            ));
        }
        let max_output_bytes = self
            .max_output_bytes
            .unwrap_or(DEFAULT_COMMAND_OUTPUT_BYTES);
        if !(256..=1024 * 1024).contains(&max_output_bytes) {
            return Err(format!(
                "max_output_bytes is {max_output_bytes}; it must be between 256 and 1048576"
            ));
        }
        for key in self.env.keys() {
            if !is_env_name(key) {
                return Err(format!(
                    "env key `{key}` is not a variable name (letters, digits and `_`, not starting with a digit)"
                ));
            }
        }
        let defaults = CommandSandbox::default();
        let sandbox = CommandSandbox {
            mode: self.sandbox.unwrap_or(defaults.mode),
            network: self.network.unwrap_or(defaults.network),
            max_processes: self.max_processes.unwrap_or(defaults.max_processes),
            max_memory_mb: self.max_memory_mb.unwrap_or(defaults.max_memory_mb),
            max_file_size_mb: self.max_file_size_mb.unwrap_or(defaults.max_file_size_mb),
        };
        sandbox.validate()?;
        Ok(CommandTool {
            timeout_s,
            env: self.env.clone(),
            max_output_bytes,
            sandbox,
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_are_checked() {
        assert!(Endpoint::default().validate().is_ok());
        let ok = Endpoint {
            base_url: Some("http://127.0.0.1:8080/v1".into()),
            timeout_s: Some(30.0),
            max_retries: Some(3),
            ..Endpoint::default()
        };
        assert!(ok.validate().is_ok());
        for (bad, says) in [
            (
                Endpoint {
                    base_url: Some("ftp://x".into()),
                    ..Endpoint::default()
                },
                "http://",
            ),
            (
                Endpoint {
                    base_url: Some("https://user:pw@host/v1".into()),
                    ..Endpoint::default()
                },
                "credentials",
            ),
            (
                Endpoint {
                    api_key_env: Some("OPENAI_API_KEY".into()),
                    ..Endpoint::default()
                },
                "api_key_env is not allowed in a spec: key sources belong to the workers' catalogue",
            ),
            (
                Endpoint {
                    api_key_file: Some("/run/secrets/nats".into()),
                    ..Endpoint::default()
                },
                "api_key_file is not allowed in a spec",
            ),
            (
                Endpoint {
                    timeout_s: Some(0.0),
                    ..Endpoint::default()
                },
                "timeout_s",
            ),
            (
                Endpoint {
                    max_retries: Some(99),
                    ..Endpoint::default()
                },
                "max_retries",
            ),
        ] {
            let err = bad.validate().unwrap_err();
            assert!(err.contains(says), "{err}");
        }
    }

    #[test]
    fn the_command_tool_has_defaults_and_limits() {
        let t = CommandToolSection::default().validate().unwrap();
        assert_eq!(t.timeout_s, DEFAULT_COMMAND_TIMEOUT_S);
        assert_eq!(t.max_output_bytes, DEFAULT_COMMAND_OUTPUT_BYTES);
        let err = CommandToolSection {
            timeout_s: Some(-1.0),
            ..Default::default()
        }
        .validate()
        .unwrap_err();
        assert!(err.contains("timeout_s"), "{err}");
        let err = CommandToolSection {
            max_output_bytes: Some(1),
            ..Default::default()
        }
        .validate()
        .unwrap_err();
        assert!(err.contains("max_output_bytes"), "{err}");
    }

    #[test]
    fn the_sandbox_has_defaults_and_limits() {
        let t = CommandToolSection::default().validate().unwrap();
        assert_eq!(t.sandbox, CommandSandbox::default());
        assert_eq!(t.sandbox.mode, SandboxMode::Auto);
        assert!(!t.sandbox.network);
        for (section, says) in [
            (
                CommandToolSection {
                    max_processes: Some(0),
                    ..Default::default()
                },
                "max_processes is 0; it must be between 8 and 1048576",
            ),
            (
                CommandToolSection {
                    max_memory_mb: Some(1),
                    ..Default::default()
                },
                "max_memory_mb is 1; it must be between 64 and 1048576",
            ),
            (
                CommandToolSection {
                    max_file_size_mb: Some(0),
                    ..Default::default()
                },
                "max_file_size_mb is 0; it must be between 1 and 1048576",
            ),
        ] {
            assert_eq!(section.validate().unwrap_err(), says);
        }
        let section: CommandToolSection = toml::from_str(
            "sandbox = \"required\"\nnetwork = true\nmax_processes = 64\nmax_memory_mb = 512\nmax_file_size_mb = 8",
        )
        .unwrap();
        let t = section.validate().unwrap();
        assert_eq!(
            t.sandbox,
            CommandSandbox {
                mode: SandboxMode::Required,
                network: true,
                max_processes: 64,
                max_memory_mb: 512,
                max_file_size_mb: 8,
            }
        );
        let back = CommandToolSection::from_tool(&t).validate().unwrap();
        assert_eq!(back, t);
        let err = toml::from_str::<CommandToolSection>("sandbox = \"maybe\"")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("auto") && err.contains("required") && err.contains("off"),
            "{err}"
        );
    }

    #[test]
    fn a_command_tool_without_a_sandbox_decodes_to_the_defaults() {
        #[derive(Serialize)]
        struct Old {
            timeout_s: f64,
            max_output_bytes: u32,
        }
        let bytes = rmp_serde::to_vec_named(&Old {
            timeout_s: 5.0,
            max_output_bytes: 1024,
        })
        .unwrap();
        let t: CommandTool = rmp_serde::from_slice(&bytes).unwrap();
        assert_eq!(t.sandbox, CommandSandbox::default());
    }
}
