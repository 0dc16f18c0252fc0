//! Layered configuration of the services and of the client commands that talk to a
//! cluster: **defaults < a TOML file (`--config FILE`) < `FORKFLEET_*` environment
//! variables < flags**, resolved per key.
//!
//! ```toml
//! data = "/var/lib/forkfleet"   # coordinator: the run store; client commands: the embedded store
//! pool = "default"              # the task queue workers pull from and the coordinator fills
//! concurrency = 64              # worker: branches run at once
//! drain_grace_s = 30            # worker: on SIGTERM, how long running branches may finish
//! tree_cache_mb = 2048          # worker: branches' command trees kept on disk between calls
//! http_addr = "0.0.0.0:9090"    # services: /metrics, /healthz, /readyz (off unless set)
//!
//! [nats]
//! url = "nats://nats:4222"
//! name = "coordinator-0"        # connection name (default: forkfleet-<role>)
//! user = "forkfleet"            # with password or password_file
//! password_file = "/run/secrets/nats-password"
//! # token / token_file, nkey_seed / nkey_seed_file, creds_file: one auth method at most
//!
//! ack_wait_s = 30              # a task or event unacked this long is delivered again
//! max_deliver = 5               # deliveries of a task before it is judged dead (ADR 38)
//! replicas = 1                  # coordinator: replicas of the streams and buckets (1 to 5)
//! identity = "alice"            # client: its API subject ff.api.client.alice (ADR 17)
//! provision = false             # worker, client: bind to the coordinator's streams and buckets
//!
//! [nats.tls]
//! ca_file = "ca.pem"
//! cert_file = "client.pem"      # with key_file
//! key_file = "client.key"
//! require = true
//!
//! [access."alice"]             # coordinator: accounts client `alice` may use besides `alice`
//! accounts = ["team-a"]
//!
//! [pricing."scripted:demo"]    # USD per million tokens; used by `run` and `fork create`
//! input_per_mtok = 0.15
//! output_per_mtok = 0.60
//! cached_per_mtok = 0.075       # optional; defaults to the input price
//!
//! [models."openai:gpt-4o"]       # workers: the model catalogue (ADR 16); the name a spec uses
//! base_url = "https://api.openai.com/v1"
//! api_key_env = "OPENAI_API_KEY" # or api_key_file = "/run/secrets/openai"
//! model = "gpt-4o-2024-08-06"    # optional: the provider's model id
//! timeout_s = 60                 # optional
//! max_retries = 3                # optional
//!
//! [model_hosts]
//! allow = ["127.0.0.1", "llm.internal:8080"]  # hosts a spec's own base_url may point at
//! ```
//!
//! Only the catalogue names key sources; a spec never does. Catalogue entries from the
//! environment come as TOML in `FORKFLEET_MODELS` (a higher layer's entry replaces a lower
//! one's), the allow-list as a comma-separated `FORKFLEET_ALLOWED_MODEL_HOSTS`.
//!
//! A spec's own `[models."NAME"] price` wins over `[pricing."NAME"]`, which wins over the
//! built-in price table. A higher layer's entry for a model replaces a lower layer's whole
//! entry; the environment gives entries as TOML in `FORKFLEET_PRICING`
//! (`'"scripted:demo" = { input_per_mtok = 0.15, output_per_mtok = 0.60 }'`).
//!
//! Every key has an environment variable: `FORKFLEET_` and its path in capitals joined by
//! `_` (`FORKFLEET_NATS_TLS_CA_FILE`), plus `FORKFLEET_CONFIG` for the file itself. An
//! unknown key in the file is an error that lists the valid ones. Relative paths in the
//! file are relative to the file. Secrets (password, token, nkey seed) come as a value or
//! from a `*_file` (the file's content, trailing newline removed); flags only take the
//! files, since a command line is visible to every user of the machine. A secret is never
//! printed: [`Config::render`] (`--print-config`) shows `<redacted>` and where it came from.
//!
//! Layout: this file holds the effective configuration and how the layers merge; `layer`
//! the layers as written (file, environment, flags), `secret` secrets, `nats` the NATS
//! settings' checks and connection, `pricing` model prices, `models` the workers' model
//! catalogue, `telemetry` the `[telemetry]` table (logs, OTLP export), `render`
//! `--print-config`.

mod layer;
mod models;
mod nats;
mod pricing;
mod render;
mod secret;
mod telemetry;

pub use layer::{
    env_layer, env_var, flag_origin, process_env, read_file, AccessLayer, CoordinatorLayer, Layer,
    ModelHostsLayer, NatsLayer, SourcedLayer, TlsLayer,
};
pub use nats::{NatsSettings, Role};
pub use pricing::price_of;
pub use secret::{Secret, SecretSetting};
pub use telemetry::{
    LogFormat, OtlpProtocol, RootSampler, SamplerSetting, TelemetryLayer, TelemetrySettings,
};

use forkfleet_shared::catalogue::CatalogueModel;
use forkfleet_shared::pricing::Price;
use forkfleet_shared::protocol::DEFAULT_POOL;
use secret::{resolve_secret, secret_of, LayeredSecret};
use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The prefix of every environment variable read here.
pub use forkfleet_shared::ENV_PREFIX;
/// The environment variable naming the config file when `--config` is not given.
pub const CONFIG_ENV: &str = "FORKFLEET_CONFIG";

pub const DEFAULT_DATA: &str = ".forkfleet";
pub const DEFAULT_CONCURRENCY: usize = 64;
pub const DEFAULT_DRAIN_GRACE: Duration = Duration::from_secs(30);
/// `tree_cache_mb`'s default: `forkfleet_worker::runner::DEFAULT_TREE_CACHE_BYTES`.
pub const DEFAULT_TREE_CACHE_MB: u64 = forkfleet_worker::runner::DEFAULT_TREE_CACHE_BYTES >> 20;
/// A pulled task or event unacked this long is delivered again (the NATS consumers').
pub const DEFAULT_ACK_WAIT: Duration = Duration::from_secs(30);
/// Deliveries of one task before its branch is failed.
pub const DEFAULT_MAX_DELIVER: u32 = 5;
/// How long a process keeps trying to reach NATS, and a client command the coordinator.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(15);
/// How long the coordinator lease lasts unless renewed.
pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(15);

/// The valid keys, as the file spells them (listed in errors).
const FILE_KEYS: &str = "data, pool, concurrency, drain_grace_s, tree_cache_mb, http_addr, [nats] url, name, user, password, password_file, token, token_file, nkey_seed, nkey_seed_file, creds_file, ack_wait_s, max_deliver, replicas, identity, provision, connect_timeout_s, blob_store_mb, stream_mb, [nats.tls] ca_file, cert_file, key_file, require, [pricing.\"MODEL\"] input_per_mtok, output_per_mtok, cached_per_mtok, [models.\"MODEL\"] base_url, api_key_env, api_key_file, model, timeout_s, max_retries, [model_hosts] allow, [access.\"IDENTITY\"] accounts, [http] audit_log, tokens_file, [http.tokens.\"NAME\"] sha256, scopes, accounts, [coordinator] lease_ttl_s, blob_quota_mb, [telemetry] log_format, otlp_endpoint, otlp_traces_endpoint, otlp_metrics_endpoint, otlp_protocol, otlp_headers, service_name, resource_attributes, sampler, sampler_arg, disabled, capture_message_content, metrics_interval_s, metrics_exporter, otlp_certificate, otlp_client_certificate, otlp_client_key";

/// The keys of one `[pricing."MODEL"]` entry.

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file `{path}`: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("invalid config file `{path}`: {message}; valid keys: {FILE_KEYS}")]
    Parse { path: PathBuf, message: String },
    #[error("environment variable {var}: {message}")]
    Env { var: String, message: String },
    #[error("{what} is set twice in {origin}: give the value or the file, not both")]
    SecretTwice { what: &'static str, origin: String },
    #[error("cannot read the {what} file `{path}` (from {origin}): {source}")]
    SecretFile {
        what: &'static str,
        path: PathBuf,
        origin: String,
        source: std::io::Error,
    },
    #[error("the {what} file `{path}` (from {origin}) is empty")]
    EmptySecret {
        what: &'static str,
        path: PathBuf,
        origin: String,
    },
    #[error("more than one NATS auth method is configured ({0}); choose one of user + password (in the URL or set apart), token, nkey seed, creds file")]
    AuthConflict(String),
    #[error("{0}")]
    Incomplete(String),
    #[error("[pricing.\"{model}\"] (from {origin}): {message}; an entry is input_per_mtok and output_per_mtok, and optionally cached_per_mtok: USD per million tokens, each a finite number >= 0")]
    BadPrice {
        model: String,
        origin: String,
        message: String,
    },
    #[error("[models.\"{model}\"] (from {origin}): {message}; an entry is base_url, api_key_env or api_key_file, and optionally model, timeout_s, max_retries")]
    BadModel {
        model: String,
        origin: String,
        message: String,
    },
    #[error("[model_hosts] allow (from {origin}): {message}")]
    BadModelHost { origin: String, message: String },
    #[error("{key} must be {expected}, got {value}")]
    Invalid {
        key: &'static str,
        expected: &'static str,
        value: String,
    },
}

/// Where a value came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    Default,
    File(PathBuf),
    Env(String),
    Flag(&'static str),
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Origin::Default => f.write_str("the default"),
            Origin::File(p) => write!(f, "config file {}", p.display()),
            Origin::Env(v) => write!(f, "environment variable {v}"),
            Origin::Flag(name) => write!(f, "flag {name}"),
        }
    }
}

/// A value and where it came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sourced<T> {
    pub value: T,
    pub origin: Origin,
}

/// The effective configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// The config file read, if any.
    pub file: Option<PathBuf>,
    pub data: Sourced<PathBuf>,
    pub pool: Sourced<String>,
    pub concurrency: Sourced<usize>,
    pub drain_grace: Sourced<Duration>,
    /// Worker: megabytes of branches' command trees kept on disk between `run_command`
    /// calls (0: none kept, every call copies the tree afresh).
    pub tree_cache_mb: Sourced<u64>,
    /// The services' HTTP endpoint (`/metrics`, `/healthz`, `/readyz`); off when `None`.
    pub http_addr: Sourced<Option<SocketAddr>>,
    pub nats: NatsSettings,
    /// `[coordinator] lease_ttl_s`: how long the coordinator lease lasts unless renewed.
    pub lease_ttl: Sourced<Duration>,
    /// `[coordinator] blob_quota_mb`: what each client identity's uploads, and on a
    /// cluster each account's branch writes, may hold, in megabytes (ADR 37).
    pub blob_quota_mb: Sourced<u64>,
    /// Model prices (`[pricing."MODEL"]`), for `spec::load_with`.
    pub pricing: BTreeMap<String, Price>,
    /// Where each model's price came from.
    pub pricing_origins: BTreeMap<String, Origin>,
    /// `[access."IDENTITY"] accounts`: the accounts each scoped client identity may use
    /// besides its own (the coordinator's; ADR 17). A higher layer's entry for an identity
    /// replaces a lower layer's.
    pub access: BTreeMap<String, std::collections::BTreeSet<String>>,
    /// The coordinator's HTTP API tokens (`[http.tokens."NAME"]`), by name.
    pub http_tokens: BTreeMap<String, HttpToken>,
    /// `[http] audit_log`: where HTTP writes are recorded (`None`: the data directory's
    /// `audit.log`).
    pub audit_log: Option<PathBuf>,
    /// Workers: the model catalogue (`[models."MODEL"]`), key sources only, never keys.
    pub models: BTreeMap<String, CatalogueModel>,
    /// Where each catalogue entry came from.
    pub models_origins: BTreeMap<String, Origin>,
    /// Workers: the hosts a spec's own `base_url` may point at (`[model_hosts] allow`).
    pub model_hosts: Sourced<Vec<String>>,
    /// `[telemetry]`: log format, OTLP export, resource, sampler, content capture.
    pub telemetry: TelemetrySettings,
}

fn default<T>(value: T) -> Sourced<T> {
    Sourced {
        value,
        origin: Origin::Default,
    }
}

impl Config {
    /// Resolve the configuration from its layers. `file` is `--config` (else
    /// `FORKFLEET_CONFIG` is used); `env` looks a variable up; `flags` is the top layer
    /// (see [`flag_origin`] for its origins).
    pub fn load(
        file: Option<&Path>,
        env: &dyn Fn(&str) -> Option<String>,
        flags: Layer,
    ) -> Result<Config, ConfigError> {
        let (layers, file) = Self::layers(file, env, flags)?;
        let mut config = Config::merge(&layers)?;
        config.file = file;
        Ok(config)
    }

    /// The layers, lowest first: the file (`file`, else `FORKFLEET_CONFIG`), the
    /// environment, the flags; and the file's path.
    fn layers(
        file: Option<&Path>,
        env: &dyn Fn(&str) -> Option<String>,
        flags: Layer,
    ) -> Result<(Vec<SourcedLayer>, Option<PathBuf>), ConfigError> {
        let file = match file {
            Some(f) => Some(f.to_path_buf()),
            None => env(CONFIG_ENV).filter(|s| !s.is_empty()).map(PathBuf::from),
        };
        let mut layers = Vec::with_capacity(3);
        if let Some(path) = &file {
            let layer = read_file(path)?;
            let p = path.clone();
            layers.push(SourcedLayer {
                layer,
                origin: Box::new(move |_| Origin::File(p.clone())),
            });
        }
        layers.push(SourcedLayer {
            layer: env_layer(env)?,
            origin: Box::new(|key| Origin::Env(env_var(key))),
        });
        layers.push(SourcedLayer {
            layer: flags,
            origin: Box::new(|key| Origin::Flag(flag_origin(key))),
        });
        Ok((layers, file))
    }

    /// Merge layers, lowest first, onto the defaults; read secret files; check the result.
    pub fn merge(layers: &[SourcedLayer]) -> Result<Config, ConfigError> {
        let mut c = Config::merge_defaults();
        models::merge_models(&mut c, layers)?;
        // Secrets as layered: (value or file, origin), resolved after merging.
        let mut password: Option<LayeredSecret> = None;
        let mut token: Option<LayeredSecret> = None;
        let mut nkey: Option<LayeredSecret> = None;
        for SourcedLayer { layer, origin } in layers {
            fn set<T: Clone>(
                slot: &mut Sourced<T>,
                v: &Option<T>,
                origin: &dyn Fn(&'static str) -> Origin,
                key: &'static str,
            ) {
                if let Some(v) = v {
                    *slot = Sourced {
                        value: v.clone(),
                        origin: origin(key),
                    };
                }
            }
            fn set_opt<T: Clone>(
                slot: &mut Option<Sourced<T>>,
                v: &Option<T>,
                origin: &dyn Fn(&'static str) -> Origin,
                key: &'static str,
            ) {
                if let Some(v) = v {
                    *slot = Some(Sourced {
                        value: v.clone(),
                        origin: origin(key),
                    });
                }
            }
            let o = origin.as_ref();
            set(&mut c.data, &layer.data, o, "data");
            set(&mut c.pool, &layer.pool, o, "pool");
            set(&mut c.concurrency, &layer.concurrency, o, "concurrency");
            set(
                &mut c.drain_grace,
                &layer.drain_grace_s.map(Duration::from_secs),
                o,
                "drain_grace_s",
            );
            set(
                &mut c.tree_cache_mb,
                &layer.tree_cache_mb,
                o,
                "tree_cache_mb",
            );
            if let Some(addr) = &layer.http_addr {
                let from = o("http_addr");
                c.http_addr = Sourced {
                    value: Some(parse_http_addr(addr, &from)?),
                    origin: from,
                };
            }
            for (model, value) in &layer.pricing {
                let from = o("pricing");
                let price = price_of(model, value, &from)?;
                c.pricing.insert(model.clone(), price);
                c.pricing_origins.insert(model.clone(), from);
            }
            for (identity, entry) in &layer.access {
                c.access
                    .insert(identity.clone(), entry.accounts.iter().cloned().collect());
            }
            for (name, t) in &layer.http.tokens {
                c.http_tokens
                    .insert(name.clone(), parse_http_token(name, t)?);
            }
            if let Some(path) = &layer.http.tokens_file {
                // Its entries join the layer's; a name given twice is an error, not a
                // silent replacement of one token by another.
                for (name, t) in &read_tokens_file(path)? {
                    if layer.http.tokens.contains_key(name) {
                        return Err(ConfigError::Invalid {
                            key: "http.tokens_file",
                            expected: "token names not also in the config file",
                            value: format!(
                                "[http.tokens.\"{name}\"] is in `{}` and in {}",
                                path.display(),
                                o("http.tokens")
                            ),
                        });
                    }
                    c.http_tokens
                        .insert(name.clone(), parse_http_token(name, t)?);
                }
            }
            if let Some(f) = &layer.http.audit_log {
                c.audit_log = Some(f.clone());
            }
            let n = &layer.nats;
            set(&mut c.nats.replicas, &n.replicas, o, "nats.replicas");
            set_opt(&mut c.nats.identity, &n.identity, o, "nats.identity");
            set(&mut c.nats.provision, &n.provision, o, "nats.provision");
            set_opt(&mut c.nats.url, &n.url, o, "nats.url");
            set_opt(&mut c.nats.name, &n.name, o, "nats.name");
            set_opt(&mut c.nats.user, &n.user, o, "nats.user");
            set_opt(&mut c.nats.creds_file, &n.creds_file, o, "nats.creds_file");
            set(
                &mut c.nats.ack_wait,
                &n.ack_wait_s.map(Duration::from_secs),
                o,
                "nats.ack_wait_s",
            );
            set(
                &mut c.nats.max_deliver,
                &n.max_deliver,
                o,
                "nats.max_deliver",
            );
            set(
                &mut c.nats.connect_timeout,
                &n.connect_timeout_s.map(Duration::from_secs),
                o,
                "nats.connect_timeout_s",
            );
            set(
                &mut c.lease_ttl,
                &layer.coordinator.lease_ttl_s.map(Duration::from_secs),
                o,
                "coordinator.lease_ttl_s",
            );
            set(
                &mut c.blob_quota_mb,
                &layer.coordinator.blob_quota_mb,
                o,
                "coordinator.blob_quota_mb",
            );
            set(
                &mut c.nats.blob_store_mb,
                &n.blob_store_mb,
                o,
                "nats.blob_store_mb",
            );
            set(&mut c.nats.stream_mb, &n.stream_mb, o, "nats.stream_mb");
            set_opt(
                &mut c.nats.tls_ca_file,
                &n.tls.ca_file,
                o,
                "nats.tls.ca_file",
            );
            set_opt(
                &mut c.nats.tls_cert_file,
                &n.tls.cert_file,
                o,
                "nats.tls.cert_file",
            );
            set_opt(
                &mut c.nats.tls_key_file,
                &n.tls.key_file,
                o,
                "nats.tls.key_file",
            );
            set(
                &mut c.nats.tls_require,
                &n.tls.require,
                o,
                "nats.tls.require",
            );
            for (slot, what, value, file, key, file_key) in [
                (
                    &mut password,
                    "NATS password",
                    &n.password,
                    &n.password_file,
                    "nats.password",
                    "nats.password_file",
                ),
                (
                    &mut token,
                    "NATS token",
                    &n.token,
                    &n.token_file,
                    "nats.token",
                    "nats.token_file",
                ),
                (
                    &mut nkey,
                    "NATS nkey seed",
                    &n.nkey_seed,
                    &n.nkey_seed_file,
                    "nats.nkey_seed",
                    "nats.nkey_seed_file",
                ),
            ] {
                let key = if value.is_some() { key } else { file_key };
                if let Some(source) = secret_of(what, value.clone(), file.clone(), &o(key))? {
                    *slot = Some(LayeredSecret {
                        source,
                        origin: o(key),
                    });
                }
            }
        }
        c.nats.password = resolve_secret("NATS password", password)?;
        c.nats.token = resolve_secret("NATS token", token)?;
        c.nats.nkey_seed = resolve_secret("NATS nkey seed", nkey)?;
        c.telemetry = TelemetrySettings::merge(layers)?;
        c.check()?;
        Ok(c)
    }

    /// The defaults alone, before any layer.
    fn merge_defaults() -> Config {
        Config {
            file: None,
            data: default(PathBuf::from(DEFAULT_DATA)),
            pool: default(DEFAULT_POOL.to_string()),
            concurrency: default(DEFAULT_CONCURRENCY),
            drain_grace: default(DEFAULT_DRAIN_GRACE),
            tree_cache_mb: default(DEFAULT_TREE_CACHE_MB),
            http_addr: default(None),
            nats: NatsSettings {
                url: None,
                name: None,
                user: None,
                password: None,
                token: None,
                nkey_seed: None,
                creds_file: None,
                tls_ca_file: None,
                tls_cert_file: None,
                tls_key_file: None,
                tls_require: default(false),
                ack_wait: default(DEFAULT_ACK_WAIT),
                max_deliver: default(DEFAULT_MAX_DELIVER),
                replicas: default(1),
                identity: None,
                provision: default(true),
                connect_timeout: default(DEFAULT_CONNECT_TIMEOUT),
                blob_store_mb: default(
                    (forkfleet_bus::nats::DEFAULT_BLOB_MAX_BYTES >> 20).unsigned_abs(),
                ),
                stream_mb: default(
                    (forkfleet_bus::nats::DEFAULT_STREAM_MAX_BYTES >> 20).unsigned_abs(),
                ),
            },
            lease_ttl: default(DEFAULT_LEASE_TTL),
            blob_quota_mb: default(forkfleet_coordinator::DEFAULT_BLOB_QUOTA_BYTES >> 20),
            pricing: BTreeMap::new(),
            pricing_origins: BTreeMap::new(),
            access: BTreeMap::new(),
            http_tokens: BTreeMap::new(),
            audit_log: None,
            models: BTreeMap::new(),
            models_origins: BTreeMap::new(),
            model_hosts: default(Vec::new()),
            telemetry: TelemetrySettings::default(),
        }
    }

    fn check(&self) -> Result<(), ConfigError> {
        for (key, value) in [
            ("nats.blob_store_mb", &self.nats.blob_store_mb),
            ("nats.stream_mb", &self.nats.stream_mb),
        ] {
            if value.value == 0 {
                return Err(ConfigError::Invalid {
                    key,
                    expected: "at least 1 megabyte",
                    value: format!("0 (from {})", value.origin),
                });
            }
        }
        if self.concurrency.value == 0 {
            return Err(ConfigError::Invalid {
                key: "concurrency",
                expected: "at least 1",
                value: format!("0 (from {})", self.concurrency.origin),
            });
        }
        for (key, value) in [
            ("coordinator.lease_ttl_s", &self.lease_ttl),
            ("nats.connect_timeout_s", &self.nats.connect_timeout),
        ] {
            if value.value.is_zero() {
                return Err(ConfigError::Invalid {
                    key,
                    expected: "at least 1 second",
                    value: format!("0 (from {})", value.origin),
                });
            }
        }
        if let Err(e) = forkfleet_shared::subjects::task_subject(&self.pool.value) {
            return Err(ConfigError::Invalid {
                key: "pool",
                expected: "1 to 64 letters, digits, `_` or `-`",
                value: format!("`{}` (from {}): {e}", self.pool.value, self.pool.origin),
            });
        }
        let replicas = &self.nats.replicas;
        if !(1..=forkfleet_bus::nats::MAX_REPLICAS).contains(&replicas.value) {
            return Err(ConfigError::Invalid {
                key: "nats.replicas",
                expected: "1 to 5 (3 on a NATS cluster of three servers or more)",
                value: format!("{} (from {})", replicas.value, replicas.origin),
            });
        }
        if let Some(id) = &self.nats.identity {
            if let Err(e) = forkfleet_shared::subjects::check_identity(&id.value) {
                return Err(ConfigError::Invalid {
                    key: "nats.identity",
                    expected: "1 to 64 letters, digits, `_` or `-`",
                    value: format!("`{}` (from {}): {e}", id.value, id.origin),
                });
            }
        }
        for (identity, accounts) in &self.access {
            if let Err(e) = forkfleet_shared::subjects::check_identity(identity) {
                return Err(ConfigError::Invalid {
                    key: "access",
                    expected: "identities of 1 to 64 letters, digits, `_` or `-`",
                    value: format!("`{identity}`: {e}"),
                });
            }
            for account in accounts {
                if let Err(e) = forkfleet_shared::spec::check_account_name(account) {
                    return Err(ConfigError::Invalid {
                        key: "access",
                        expected: "valid account names",
                        value: format!("[access.\"{identity}\"] accounts: {e}"),
                    });
                }
            }
        }
        self.nats.check()
    }
}

pub use forkfleet_http::auth::HttpToken;

/// The entries of a tokens file (`[http] tokens_file`): `[http.tokens."NAME"]` tables
/// only, as `forkfleet cluster token` prints them.
fn read_tokens_file(path: &Path) -> Result<BTreeMap<String, layer::TokenLayer>, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let file: layer::TokensFile = toml::from_str(&text).map_err(|e| ConfigError::Invalid {
        key: "http.tokens_file",
        expected: "a file of [http.tokens.\"NAME\"] entries (sha256, scopes, accounts) only, as `forkfleet cluster token` prints them",
        value: format!("`{}`: {}", path.display(), e.message()),
    })?;
    Ok(file.http.tokens)
}

/// `[http.tokens."NAME"]` checked: a 64-digit hex hash, scopes among read, write and
/// admin, valid account names; the name is a client identity.
fn parse_http_token(name: &str, t: &layer::TokenLayer) -> Result<HttpToken, ConfigError> {
    use forkfleet_shared::api::Access;
    let bad = |expected: &'static str, value: String| ConfigError::Invalid {
        key: "http.tokens",
        expected,
        value,
    };
    forkfleet_shared::subjects::check_identity(name).map_err(|e| {
        bad(
            "token names of 1 to 64 letters, digits, `_` or `-`",
            format!("`{name}`: {e}"),
        )
    })?;
    let sha256 = hex::decode(t.sha256.trim())
        .ok()
        .and_then(|b| <[u8; 32]>::try_from(b).ok())
        .ok_or_else(|| {
            bad(
                "the token's SHA-256 as 64 hex digits (forkfleet http token NAME prints one)",
                format!("[http.tokens.\"{name}\"] sha256"),
            )
        })?;
    let mut scopes = std::collections::BTreeSet::new();
    for s in &t.scopes {
        scopes.insert(match s.as_str() {
            "read" => Access::Read,
            "write" => Access::Write,
            "admin" => Access::Admin,
            other => {
                return Err(bad(
                    "scopes among read, write and admin",
                    format!("[http.tokens.\"{name}\"] scopes: `{other}`"),
                ))
            }
        });
    }
    if scopes.is_empty() {
        return Err(bad(
            "at least one scope: read, write or admin",
            format!("[http.tokens.\"{name}\"] scopes = []"),
        ));
    }
    let accounts = match &t.accounts {
        None => None,
        Some(list) => {
            for a in list {
                forkfleet_shared::spec::check_account_name(a).map_err(|e| {
                    bad(
                        "valid account names",
                        format!("[http.tokens.\"{name}\"] accounts: {e}"),
                    )
                })?;
            }
            Some(list.iter().cloned().collect())
        }
    };
    Ok(HttpToken {
        sha256,
        scopes,
        accounts,
    })
}

/// `http_addr` as written: `IP:PORT` (`0.0.0.0:9090`, `[::1]:9090`) or `localhost:PORT`.
fn parse_http_addr(addr: &str, origin: &Origin) -> Result<SocketAddr, ConfigError> {
    let addr = addr.trim();
    let parsed = match addr.strip_prefix("localhost:") {
        Some(port) => port
            .parse::<u16>()
            .ok()
            .map(|p| SocketAddr::from(([127, 0, 0, 1], p))),
        None => addr.parse::<SocketAddr>().ok(),
    };
    parsed.ok_or_else(|| ConfigError::Invalid {
        key: "http_addr",
        expected: "HOST:PORT with an IP address or localhost as the host (e.g. 0.0.0.0:9090, 127.0.0.1:9090, [::]:9090, localhost:9090)",
        value: format!("`{addr}` (from {origin})"),
    })
}
