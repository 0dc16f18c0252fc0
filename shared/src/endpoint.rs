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
//! offered only when it is present.

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
        Ok(())
    }
}

/// Default seconds a `run_command` call may run.
pub const DEFAULT_COMMAND_TIMEOUT_S: f64 = 60.0;
/// Default bytes of a command's output the model sees (the middle is cut).
pub const DEFAULT_COMMAND_OUTPUT_BYTES: u32 = 16 * 1024;

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
}

impl CommandToolSection {
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
        Ok(CommandTool {
            timeout_s,
            env: self.env.clone(),
            max_output_bytes,
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
}
