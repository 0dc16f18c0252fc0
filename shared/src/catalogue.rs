//! The workers' model catalogue: which real models a worker offers, where their APIs are,
//! where their keys are, and which hosts a spec's own `base_url` may point at (ADR 16).
//!
//! A key source (an environment variable, a secret file) is named only here, in the
//! worker's configuration (`[models."openai:gpt-4o"]`, `[model_hosts] allow`). A spec names
//! a model of the catalogue and never a key source ([`key_source_refusal`]); it may give its
//! own `base_url` only when the worker's allow-list holds the URL's host, and such a model
//! runs with no key. The key never leaves the worker: a task carries the model's name and
//! the spec's settings ([`Endpoint`]), the worker resolves them here ([`ModelCatalogue::route`]).
//!
//! Workers advertise what they offer ([`Offer`]: names, dialects, base URLs and the
//! allow-list, never a key source) in their heartbeat; the coordinator checks a plan against
//! the offers of the live workers of its pool ([`check_plan`]) before it creates a fork, and
//! the worker checks each task again before it makes a request.

use crate::endpoint::{is_env_name, Endpoint, MAX_RETRIES, MAX_TIMEOUT_S};
use crate::spec::ForkPlan;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::PathBuf;

/// The environment variable holding the allow-list (comma-separated hosts).
pub const ALLOWED_HOSTS_ENV: &str = "FORKFLEET_ALLOWED_MODEL_HOSTS";
/// The environment variable holding catalogue entries as TOML.
pub const MODELS_ENV: &str = "FORKFLEET_MODELS";

/// The message refusing a key source (`field`, `api_key_env` or `api_key_file`) in a spec's
/// section of `model`.
pub fn key_source_refusal(model: &str, field: &str) -> String {
    format!(
        "{field} is not allowed in a spec: key sources belong to the workers' catalogue; define model `{model}` in the worker's config `[models.\"{model}\"]` (base_url and api_key_env or api_key_file there) and remove {field} from the spec"
    )
}

/// One model of a worker's catalogue (`[models."openai:NAME"]` in its configuration).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CatalogueModel {
    /// The API's base URL (default: the vendor's, such as `https://api.openai.com/v1`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base_url: Option<String>,
    /// The environment variable (of the worker) holding the API key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key_env: Option<String>,
    /// A file (of the worker) holding the API key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key_file: Option<PathBuf>,
    /// The provider's model id (default: the name after the prefix).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Seconds one HTTP request may take.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_s: Option<f64>,
    /// Retries of a call answered 429 or 5xx (or not answered).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_retries: Option<u32>,
}

impl CatalogueModel {
    /// Check the entry of `name`; the error names the key and what is valid.
    pub fn validate(&self, name: &str) -> Result<(), String> {
        if dialect_of(name).is_none() {
            let dialects: Vec<String> = crate::provider::Provider::dialects()
                .map(|p| format!("`{p}:NAME`"))
                .collect();
            return Err(format!("the name must be {} (the prefix is the API's dialect); scripted models need no catalogue entry", dialects.join(" or ")));
        }
        if let Some(url) = &self.base_url {
            check_base_url(url)?;
        }
        if self.api_key_env.is_some() && self.api_key_file.is_some() {
            return Err("set one of api_key_env and api_key_file, not both".to_string());
        }
        if let Some(var) = &self.api_key_env {
            if !is_env_name(var) {
                return Err(format!(
                    "api_key_env `{var}` is not an environment variable name (letters, digits and `_`, not starting with a digit)"
                ));
            }
        }
        if let Some(path) = &self.api_key_file {
            if path.as_os_str().is_empty() {
                return Err("api_key_file is empty; give the path of the key file".to_string());
            }
        }
        if let Some(m) = &self.model {
            if m.trim().is_empty() {
                return Err("model is empty; give the provider's model id, or leave it out to use the name after the prefix".to_string());
            }
        }
        check_limits(self.timeout_s, self.max_retries)
    }

    /// Where the key is read, if anywhere.
    pub fn key_source(&self) -> Option<KeySource> {
        match (&self.api_key_file, &self.api_key_env) {
            (Some(path), _) => Some(KeySource::File(path.clone())),
            (None, Some(var)) => Some(KeySource::Env(var.clone())),
            (None, None) => None,
        }
    }
}

/// The dialect (`openai`, `anthropic`, ...) of a real model's name, else `None`.
pub fn dialect_of(model: &str) -> Option<&'static str> {
    crate::provider::Provider::of(model)
        .filter(|p| p.is_real())
        .map(|p| p.name())
}

/// Where a worker reads a model's key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeySource {
    Env(String),
    File(PathBuf),
}

impl fmt::Display for KeySource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeySource::Env(name) => write!(f, "env `{name}`"),
            KeySource::File(path) => write!(f, "file `{}`", path.display()),
        }
    }
}

/// How a worker calls one model: what [`ModelCatalogue::route`] resolved.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ModelRoute {
    /// `None`: the vendor's own API.
    pub base_url: Option<String>,
    /// The provider's model id; `None`: the name after the prefix.
    pub model: Option<String>,
    /// `None`: no key is sent.
    pub key: Option<KeySource>,
    pub timeout_s: Option<f64>,
    pub max_retries: Option<u32>,
}

/// A worker's catalogue and allow-list.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ModelCatalogue {
    pub models: BTreeMap<String, CatalogueModel>,
    /// Hosts (`host` or `host:port`) a spec's own `base_url` may point at.
    pub allowed_hosts: Vec<String>,
}

impl ModelCatalogue {
    /// How to call `model` for a task whose plan gave `spec` (its `[models."X"]` settings).
    /// A spec `base_url` is used, with no key, only when its host is allowed; otherwise the
    /// model must be in the catalogue, and its entry gives the URL and the key (the spec's
    /// timeout and retries win). The error says what was refused and what is offered.
    pub fn route(&self, model: &str, spec: Option<&Endpoint>) -> Result<ModelRoute, String> {
        let spec = spec.cloned().unwrap_or_default();
        if spec.api_key_env.is_some() || spec.api_key_file.is_some() {
            let field = if spec.api_key_env.is_some() {
                "api_key_env"
            } else {
                "api_key_file"
            };
            return Err(key_source_refusal(model, field));
        }
        spec.validate()?;
        if let Some(url) = &spec.base_url {
            if !host_allowed(&self.allowed_hosts, url) {
                return Err(host_refusal(model, url, "this worker", &self.allowed_hosts));
            }
            return Ok(ModelRoute {
                base_url: Some(url.clone()),
                model: None,
                key: None,
                timeout_s: spec.timeout_s,
                max_retries: spec.max_retries,
            });
        }
        let Some(entry) = self.models.get(model) else {
            return Err(model_refusal(
                model,
                "this worker",
                self.models.keys().map(String::as_str),
            ));
        };
        Ok(ModelRoute {
            base_url: entry.base_url.clone(),
            model: entry.model.clone(),
            key: entry.key_source(),
            timeout_s: spec.timeout_s.or(entry.timeout_s),
            max_retries: spec.max_retries.or(entry.max_retries),
        })
    }

    /// What this worker advertises: names, dialects and base URLs, and the allow-list.
    pub fn offer(&self) -> Offer {
        Offer {
            models: self
                .models
                .iter()
                .map(|(name, m)| OfferedModel {
                    name: name.clone(),
                    dialect: dialect_of(name).unwrap_or_default().to_string(),
                    base_url: m.base_url.clone(),
                })
                .collect(),
            allowed_hosts: self.allowed_hosts.clone(),
        }
    }
}

/// A model as a worker advertises it (never where its key is).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OfferedModel {
    pub name: String,
    /// `openai` or `anthropic`.
    pub dialect: String,
    /// `None`: the vendor's own API.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base_url: Option<String>,
}

/// What a worker advertises in its heartbeat.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Offer {
    #[serde(default)]
    pub models: Vec<OfferedModel>,
    #[serde(default)]
    pub allowed_hosts: Vec<String>,
}

/// Check `plan`'s real models against the offers of the live workers of `pool`: every model
/// the spec gives no `base_url` is offered by one of them, and every spec `base_url` has a
/// host one of them allows. Scripted models need nothing.
pub fn check_plan(plan: &ForkPlan, pool: &str, offers: &[Offer]) -> Result<(), String> {
    let workers = format!("any live worker of pool `{pool}`");
    for (name, m) in &plan.models {
        if dialect_of(name).is_none() {
            continue;
        }
        match m.endpoint.as_ref().and_then(|e| e.base_url.as_deref()) {
            Some(url) => {
                if !offers.iter().any(|o| host_allowed(&o.allowed_hosts, url)) {
                    let allowed: BTreeSet<&str> = offers
                        .iter()
                        .flat_map(|o| o.allowed_hosts.iter().map(String::as_str))
                        .collect();
                    let allowed: Vec<String> = allowed.into_iter().map(str::to_string).collect();
                    return Err(host_refusal(name, url, &workers, &allowed));
                }
            }
            None => {
                if !offers
                    .iter()
                    .any(|o| o.models.iter().any(|om| &om.name == name))
                {
                    let offered: BTreeSet<&str> = offers
                        .iter()
                        .flat_map(|o| o.models.iter().map(|om| om.name.as_str()))
                        .collect();
                    return Err(model_refusal(name, &workers, offered.into_iter()));
                }
            }
        }
    }
    Ok(())
}

fn host_refusal(model: &str, url: &str, who: &str, allowed: &[String]) -> String {
    let host = url_host(url)
        .map(|h| h.to_string())
        .unwrap_or_else(|| url.to_string());
    let allowed = if allowed.is_empty() {
        "none".to_string()
    } else {
        allowed.join(", ")
    };
    format!(
        "model `{model}`: the spec's base_url `{url}` points at host `{host}`, which is not in the model-host allow-list of {who} (allowed: {allowed}); add the host to the worker's `[model_hosts] allow` (or {ALLOWED_HOSTS_ENV}), or remove base_url from the spec and use a model of the workers' catalogue"
    )
}

fn model_refusal<'a>(model: &str, who: &str, offered: impl Iterator<Item = &'a str>) -> String {
    let offered: Vec<&str> = offered.collect();
    let offered = if offered.is_empty() {
        "none".to_string()
    } else {
        offered.join(", ")
    };
    format!(
        "model `{model}` is not in the model catalogue of {who} (offered: {offered}); define it in the worker's config `[models.\"{model}\"]` with its base_url and api_key_env or api_key_file"
    )
}

/// A URL's host and port as the allow-list sees them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UrlHost {
    /// Lowercase; an IPv6 address without its brackets.
    pub host: String,
    /// The explicit port, else the scheme's (80, 443).
    pub port: u16,
    /// Whether the URL wrote the port.
    pub explicit_port: bool,
}

impl fmt::Display for UrlHost {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let host = if self.host.contains(':') {
            format!("[{}]", self.host)
        } else {
            self.host.clone()
        };
        if self.explicit_port {
            write!(f, "{host}:{}", self.port)
        } else {
            f.write_str(&host)
        }
    }
}

/// The host and port of an `http://` or `https://` URL; `None` when it has none, or carries
/// user info.
pub fn url_host(url: &str) -> Option<UrlHost> {
    let (rest, default_port) = if let Some(r) = url.strip_prefix("http://") {
        (r, 80)
    } else if let Some(r) = url.strip_prefix("https://") {
        (r, 443)
    } else {
        return None;
    };
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    if authority.is_empty() || authority.contains('@') {
        return None;
    }
    let (host, port) = split_host_port(authority)?;
    Some(UrlHost {
        host,
        port: port.unwrap_or(default_port),
        explicit_port: port.is_some(),
    })
}

/// `host`, `host:port`, `[v6]` or `[v6]:port`, lowercased.
fn split_host_port(s: &str) -> Option<(String, Option<u16>)> {
    if let Some(rest) = s.strip_prefix('[') {
        let (host, after) = rest.split_once(']')?;
        let port = match after {
            "" => None,
            p => Some(p.strip_prefix(':')?.parse::<u16>().ok()?),
        };
        return (!host.is_empty()).then(|| (host.to_ascii_lowercase(), port));
    }
    let (host, port) = match s.rsplit_once(':') {
        Some((h, p)) => (h, Some(p.parse::<u16>().ok()?)),
        None => (s, None),
    };
    let ok = !host.is_empty()
        && host
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_'));
    ok.then(|| (host.to_ascii_lowercase(), port))
}

/// Check an allow-list entry: `host` or `host:port`, nothing else.
pub fn check_allowed_host(entry: &str) -> Result<(), String> {
    if split_host_port(entry.trim()).is_none() {
        return Err(format!(
            "`{entry}` is not a host or host:port (such as `127.0.0.1`, `llm.internal:8080`); no scheme, path or user"
        ));
    }
    Ok(())
}

/// True when `url`'s host is in `allowed`: an entry `host` allows every port of it, an entry
/// `host:port` that port only (the URL's explicit port, else its scheme's).
pub fn host_allowed(allowed: &[String], url: &str) -> bool {
    let Some(u) = url_host(url) else {
        return false;
    };
    allowed
        .iter()
        .any(|entry| match split_host_port(entry.trim()) {
            Some((host, None)) => host == u.host,
            Some((host, Some(port))) => host == u.host && port == u.port,
            None => false,
        })
}

/// A base URL's rules: http(s), a host, no user info.
fn check_base_url(url: &str) -> Result<(), String> {
    if url.contains('@') {
        return Err(format!(
            "base_url `{url}` must not carry credentials; name the key with api_key_env or api_key_file"
        ));
    }
    if url_host(url).is_none() {
        return Err(format!(
            "base_url `{url}` must be an http:// or https:// URL with a host, such as https://api.openai.com/v1"
        ));
    }
    Ok(())
}

/// The timeout's and the retries' bounds.
fn check_limits(timeout_s: Option<f64>, max_retries: Option<u32>) -> Result<(), String> {
    if let Some(t) = timeout_s {
        if !(t.is_finite() && t > 0.0 && t <= MAX_TIMEOUT_S) {
            return Err(format!(
                "timeout_s is {t}; it must be more than 0 and at most {MAX_TIMEOUT_S} seconds"
            ));
        }
    }
    if let Some(n) = max_retries {
        if n > MAX_RETRIES {
            return Err(format!("max_retries is {n}; at most {MAX_RETRIES}"));
        }
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests;
