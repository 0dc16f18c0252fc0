//! The layers as written: the TOML file, the `FORKFLEET_*` environment and the flags, each
//! with where its keys came from.

use super::{ConfigError, Origin, Secret, ENV_PREFIX};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// One layer as written: every key optional. The TOML file deserialises into it; the
/// environment and the flags are read into it.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Layer {
    pub data: Option<PathBuf>,
    pub pool: Option<String>,
    pub concurrency: Option<usize>,
    pub drain_grace_s: Option<u64>,
    /// Worker: megabytes of command trees kept between calls.
    pub tree_cache_mb: Option<u64>,
    /// Services: `HOST:PORT` of the HTTP endpoint (`/metrics`, `/healthz`, `/readyz`).
    pub http_addr: Option<String>,
    #[serde(default)]
    pub nats: NatsLayer,
    #[serde(default)]
    pub coordinator: CoordinatorLayer,
    /// `[pricing."MODEL"]` entries as written; checked when the layers are merged.
    #[serde(default)]
    pub pricing: BTreeMap<String, toml::Value>,
    /// `[access."IDENTITY"]` entries (the coordinator's): the accounts a scoped client
    /// identity may use besides its own (ADR 17). File only.
    #[serde(default)]
    pub access: BTreeMap<String, AccessLayer>,
    /// The coordinator's HTTP API (`[http]`: tokens, audit log). File only.
    #[serde(default)]
    pub http: HttpLayer,
    /// Workers: `[models."MODEL"]` catalogue entries as written; checked when merged.
    #[serde(default)]
    pub models: BTreeMap<String, toml::Value>,
    /// Workers: `[model_hosts]`, the hosts a spec's own `base_url` may point at.
    #[serde(default)]
    pub model_hosts: ModelHostsLayer,
    /// `[telemetry]`: logs and OTLP export; its environment layer is the OpenTelemetry
    /// variables.
    #[serde(default)]
    pub telemetry: super::TelemetryLayer,
}

/// One `[access."IDENTITY"]` entry.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AccessLayer {
    /// Accounts the identity may use besides its own.
    #[serde(default)]
    pub accounts: Vec<String>,
}

/// `[http]` as written: the HTTP API's tokens and audit log (docs/HTTP.md).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpLayer {
    /// `[http.tokens."NAME"]`: one per user or service.
    #[serde(default)]
    pub tokens: BTreeMap<String, TokenLayer>,
    /// Where every write through the HTTP API is recorded (default: `audit.log` in the
    /// data directory).
    pub audit_log: Option<PathBuf>,
    /// A file of more `[http.tokens."NAME"]` entries (as `forkfleet cluster token` prints
    /// them, nothing else), e.g. a mounted Secret: `FORKFLEET_HTTP_TOKENS_FILE` too.
    pub tokens_file: Option<PathBuf>,
}

/// A tokens file (`[http] tokens_file`): `[http.tokens."NAME"]` entries only.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokensFile {
    #[serde(default)]
    pub http: TokensFileHttp,
}

/// The `[http]` table of a tokens file.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokensFileHttp {
    #[serde(default)]
    pub tokens: BTreeMap<String, TokenLayer>,
}

/// One `[http.tokens."NAME"]` entry: the token's SHA-256 (never the token), its scopes,
/// and the accounts it is limited to (all when absent).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenLayer {
    pub sha256: String,
    #[serde(default)]
    pub scopes: Vec<String>,
    pub accounts: Option<Vec<String>>,
}

/// `[model_hosts]` as written.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelHostsLayer {
    /// `host` or `host:port` entries.
    pub allow: Option<Vec<String>>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NatsLayer {
    pub url: Option<String>,
    pub name: Option<String>,
    pub user: Option<String>,
    pub password: Option<Secret>,
    pub password_file: Option<PathBuf>,
    pub token: Option<Secret>,
    pub token_file: Option<PathBuf>,
    pub nkey_seed: Option<Secret>,
    pub nkey_seed_file: Option<PathBuf>,
    pub creds_file: Option<PathBuf>,
    /// Seconds a pulled task or event may go unacked before it is delivered again.
    pub ack_wait_s: Option<u64>,
    /// Deliveries of one task before its branch is failed.
    pub max_deliver: Option<u32>,
    /// Replicas of the streams and buckets the coordinator creates (1 to 5).
    pub replicas: Option<usize>,
    /// A client's identity: its API subject `ff.api.client.<identity>` (ADR 17).
    pub identity: Option<String>,
    /// Create missing streams and buckets (false: bind to the coordinator's).
    pub provision: Option<bool>,
    /// Seconds a process keeps trying to reach NATS (and a client command the
    /// coordinator) before it gives up.
    pub connect_timeout_s: Option<u64>,
    /// Megabytes each blob bucket the coordinator creates may hold (`max_bytes`).
    pub blob_store_mb: Option<u64>,
    /// Megabytes each stream the coordinator creates may hold (`max_bytes`).
    pub stream_mb: Option<u64>,
    #[serde(default)]
    pub tls: TlsLayer,
}

/// `[coordinator]`: the coordinator lease (see `docs/CLUSTER.md`, "One coordinator at a
/// time").
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CoordinatorLayer {
    /// Seconds the coordinator lease lasts unless renewed (every third of it).
    pub lease_ttl_s: Option<u64>,
    /// Megabytes each client identity's uploads (and an account's branch writes) may hold.
    pub blob_quota_mb: Option<u64>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsLayer {
    pub ca_file: Option<PathBuf>,
    pub cert_file: Option<PathBuf>,
    pub key_file: Option<PathBuf>,
    pub require: Option<bool>,
}

/// A layer with where it came from: one origin for the file, one per key otherwise.
pub struct SourcedLayer {
    pub layer: Layer,
    /// The origin of a key (its dotted path) in this layer.
    pub origin: Box<dyn Fn(&'static str) -> Origin>,
}

/// Read and parse the config file; relative paths in it become relative to its directory.
pub fn read_file(path: &Path) -> Result<Layer, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let mut layer: Layer = toml::from_str(&text).map_err(|e| ConfigError::Parse {
        path: path.to_path_buf(),
        message: e.message().to_string(),
    })?;
    let base = path.parent().unwrap_or(Path::new(""));
    let rebase = |p: &mut Option<PathBuf>| {
        if let Some(p) = p {
            if p.is_relative() {
                *p = base.join(&*p);
            }
        }
    };
    rebase(&mut layer.data);
    rebase(&mut layer.http.tokens_file);
    rebase(&mut layer.telemetry.otlp_certificate);
    rebase(&mut layer.telemetry.otlp_client_certificate);
    rebase(&mut layer.telemetry.otlp_client_key);
    // A catalogue entry's key file, too (left as written when it is not a string: the
    // merge reports it).
    for entry in layer.models.values_mut() {
        if let Some(toml::Value::String(p)) = entry.get_mut("api_key_file") {
            if Path::new(p.as_str()).is_relative() {
                *p = base.join(p.as_str()).display().to_string();
            }
        }
    }
    let n = &mut layer.nats;
    for p in [
        &mut n.password_file,
        &mut n.token_file,
        &mut n.nkey_seed_file,
        &mut n.creds_file,
        &mut n.tls.ca_file,
        &mut n.tls.cert_file,
        &mut n.tls.key_file,
    ] {
        rebase(p);
    }
    Ok(layer)
}

/// The environment variable of a key: `nats.tls.ca_file` -> `FORKFLEET_NATS_TLS_CA_FILE`.
pub fn env_var(key: &str) -> String {
    if key == "model_hosts.allow" {
        return forkfleet_shared::catalogue::ALLOWED_HOSTS_ENV.to_string();
    }
    if let Some(var) = super::telemetry::env_var(key) {
        return var.to_string();
    }
    format!("{ENV_PREFIX}{}", key.replace('.', "_").to_ascii_uppercase())
}

/// The flag that sets a key (see `cli::ConfigArgs`).
pub fn flag_origin(key: &'static str) -> &'static str {
    match key {
        "data" => "--data",
        "pool" => "--pool",
        "concurrency" => "--concurrency",
        "drain_grace_s" => "--drain-grace-s",
        "tree_cache_mb" => "--tree-cache-mb",
        "http_addr" => "--http-addr",
        "nats.url" => "--nats",
        "nats.name" => "--nats-name",
        "nats.user" => "--nats-user",
        "nats.password_file" => "--nats-password-file",
        "nats.token_file" => "--nats-token-file",
        "nats.nkey_seed_file" => "--nats-nkey-seed-file",
        "nats.creds_file" => "--nats-creds",
        "nats.ack_wait_s" => "--nats-ack-wait-s",
        "nats.max_deliver" => "--nats-max-deliver",
        "nats.replicas" => "--nats-replicas",
        "nats.identity" => "--identity",
        "nats.connect_timeout_s" => "--nats-connect-timeout-s",
        "coordinator.lease_ttl_s" => "--lease-ttl-s",
        "nats.tls.ca_file" => "--tls-ca",
        "nats.tls.cert_file" => "--tls-cert",
        "nats.tls.key_file" => "--tls-key",
        "nats.tls.require" => "--tls-require",
        "telemetry.log_format" => "--log-format",
        _ => "a flag",
    }
}

/// A boolean environment variable's value: `1`, `true`, `yes`, `on` or their opposites, in
/// any case; `None` for anything else.
pub(super) fn env_bool(v: &str) -> Option<bool> {
    match v.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Some(true),
        "0" | "false" | "no" | "off" => Some(false),
        _ => None,
    }
}

/// The environment layer.
pub fn env_layer(env: &dyn Fn(&str) -> Option<String>) -> Result<Layer, ConfigError> {
    let get = |key: &str| env(&env_var(key)).filter(|v| !v.is_empty());
    let parse = |key: &'static str, expected: &'static str| -> Result<Option<u64>, ConfigError> {
        get(key)
            .map(|v| {
                v.trim().parse::<u64>().map_err(|_| ConfigError::Env {
                    var: env_var(key),
                    message: format!("expected {expected}, got `{v}`"),
                })
            })
            .transpose()
    };
    let boolean = |key: &'static str| -> Result<Option<bool>, ConfigError> {
        match get(key) {
            None => Ok(None),
            Some(v) => env_bool(&v).map(Some).ok_or_else(|| ConfigError::Env {
                var: env_var(key),
                message: format!("expected true or false, got `{v}`"),
            }),
        }
    };
    let require = boolean("nats.tls.require")?;
    let pricing = match get("pricing") {
        None => BTreeMap::new(),
        Some(text) => toml::from_str::<BTreeMap<String, toml::Value>>(&text).map_err(|e| {
            ConfigError::Env {
                var: env_var("pricing"),
                message: format!(
                    "expected TOML entries like `\"MODEL\" = {{ input_per_mtok = 0.15, output_per_mtok = 0.60 }}`: {}",
                    e.message()
                ),
            }
        })?,
    };
    let models = match get("models") {
        None => BTreeMap::new(),
        Some(text) => toml::from_str::<BTreeMap<String, toml::Value>>(&text).map_err(|e| {
            ConfigError::Env {
                var: env_var("models"),
                message: format!(
                    "expected TOML entries like `\"openai:gpt-4o\" = {{ base_url = \"https://api.openai.com/v1\", api_key_env = \"OPENAI_API_KEY\" }}`: {}",
                    e.message()
                ),
            }
        })?,
    };
    let allow = get("model_hosts.allow").map(|v| {
        v.split(',')
            .map(str::trim)
            .filter(|h| !h.is_empty())
            .map(str::to_string)
            .collect()
    });
    Ok(Layer {
        pricing,
        access: BTreeMap::new(),
        http: HttpLayer {
            tokens_file: get("http.tokens_file").map(PathBuf::from),
            ..HttpLayer::default()
        },
        models,
        model_hosts: ModelHostsLayer { allow },
        telemetry: super::telemetry::env_layer(env)?,
        data: get("data").map(PathBuf::from),
        coordinator: CoordinatorLayer {
            lease_ttl_s: parse("coordinator.lease_ttl_s", "a number of seconds")?,
            blob_quota_mb: parse("coordinator.blob_quota_mb", "a number of megabytes")?,
        },
        pool: get("pool"),
        concurrency: parse("concurrency", "a number of branches")?.map(|n| n as usize),
        drain_grace_s: parse("drain_grace_s", "a number of seconds")?,
        tree_cache_mb: parse("tree_cache_mb", "a number of megabytes")?,
        http_addr: get("http_addr"),
        nats: NatsLayer {
            url: get("nats.url"),
            name: get("nats.name"),
            user: get("nats.user"),
            password: get("nats.password").map(Secret),
            password_file: get("nats.password_file").map(PathBuf::from),
            token: get("nats.token").map(Secret),
            token_file: get("nats.token_file").map(PathBuf::from),
            nkey_seed: get("nats.nkey_seed").map(Secret),
            nkey_seed_file: get("nats.nkey_seed_file").map(PathBuf::from),
            creds_file: get("nats.creds_file").map(PathBuf::from),
            ack_wait_s: parse("nats.ack_wait_s", "a number of seconds")?,
            max_deliver: parse("nats.max_deliver", "a number of deliveries")?
                .map(|n| n.min(u32::MAX as u64) as u32),
            replicas: parse("nats.replicas", "a number of replicas (1 to 5)")?
                .map(|n| n.min(usize::MAX as u64) as usize),
            identity: get("nats.identity"),
            provision: boolean("nats.provision")?,
            connect_timeout_s: parse("nats.connect_timeout_s", "a number of seconds")?,
            blob_store_mb: parse("nats.blob_store_mb", "a number of megabytes")?,
            stream_mb: parse("nats.stream_mb", "a number of megabytes")?,
            tls: TlsLayer {
                ca_file: get("nats.tls.ca_file").map(PathBuf::from),
                cert_file: get("nats.tls.cert_file").map(PathBuf::from),
                key_file: get("nats.tls.key_file").map(PathBuf::from),
                require,
            },
        },
    })
}

/// The process environment, for [`Config::load`](super::Config::load).
pub fn process_env(var: &str) -> Option<String> {
    std::env::var(var).ok()
}
