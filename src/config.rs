//! Layered configuration of the services and of the client commands that talk to a
//! cluster: **defaults < a TOML file (`--config FILE`) < `FORKFLEET_*` environment
//! variables < flags**, resolved per key.
//!
//! ```toml
//! data = "/var/lib/forkfleet"   # coordinator: the run store; client commands: the embedded store
//! pool = "default"              # the task queue workers pull from and the coordinator fills
//! concurrency = 64              # worker: branches run at once
//! drain_grace_s = 30            # worker: on SIGTERM, how long running branches may finish
//!
//! [nats]
//! url = "nats://nats:4222"
//! name = "coordinator-0"        # connection name (default: forkfleet-<role>)
//! user = "forkfleet"            # with password or password_file
//! password_file = "/run/secrets/nats-password"
//! # token / token_file, nkey_seed / nkey_seed_file, creds_file: one auth method at most
//!
//! ack_wait_s = 30              # a task or event unacked this long is delivered again
//! max_deliver = 5               # deliveries of a task before its branch is failed
//!
//! [nats.tls]
//! ca_file = "ca.pem"
//! cert_file = "client.pem"      # with key_file
//! key_file = "client.key"
//! require = true
//!
//! [pricing."scripted:demo"]    # USD per million tokens; used by `run` and `fork create`
//! input_per_mtok = 0.15
//! output_per_mtok = 0.60
//! cached_per_mtok = 0.075       # optional; defaults to the input price
//! ```
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

use forkfleet_bus::nats::{NatsAuth, NatsConfig, NatsTls};
use forkfleet_shared::pricing::Price;
use forkfleet_shared::protocol::DEFAULT_POOL;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::fmt;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The prefix of every environment variable read here.
pub const ENV_PREFIX: &str = "FORKFLEET_";
/// The environment variable naming the config file when `--config` is not given.
pub const CONFIG_ENV: &str = "FORKFLEET_CONFIG";

pub const DEFAULT_DATA: &str = ".forkfleet";
pub const DEFAULT_CONCURRENCY: usize = 64;
pub const DEFAULT_DRAIN_GRACE: Duration = Duration::from_secs(30);
/// A pulled task or event unacked this long is delivered again (the NATS consumers').
pub const DEFAULT_ACK_WAIT: Duration = Duration::from_secs(30);
/// Deliveries of one task before its branch is failed.
pub const DEFAULT_MAX_DELIVER: u32 = 5;

/// The valid keys, as the file spells them (listed in errors).
const FILE_KEYS: &str = "data, pool, concurrency, drain_grace_s, [nats] url, name, user, password, password_file, token, token_file, nkey_seed, nkey_seed_file, creds_file, ack_wait_s, max_deliver, [nats.tls] ca_file, cert_file, key_file, require, [pricing.\"MODEL\"] input_per_mtok, output_per_mtok, cached_per_mtok";

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
    #[error("more than one NATS auth method is configured ({0}); choose one of user + password, token, nkey seed, creds file")]
    AuthConflict(String),
    #[error("{0}")]
    Incomplete(String),
    #[error("[pricing.\"{model}\"] (from {origin}): {message}; an entry is input_per_mtok and output_per_mtok, and optionally cached_per_mtok: USD per million tokens, each a finite number >= 0")]
    BadPrice {
        model: String,
        origin: String,
        message: String,
    },
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

/// A secret value. `Debug` and `Display` never show it.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    /// The value itself: only for handing it to the NATS client.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

/// One layer as written: every key optional. The TOML file deserialises into it; the
/// environment and the flags are read into it.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Layer {
    pub data: Option<PathBuf>,
    pub pool: Option<String>,
    pub concurrency: Option<usize>,
    pub drain_grace_s: Option<u64>,
    #[serde(default)]
    pub nats: NatsLayer,
    /// `[pricing."MODEL"]` entries as written; checked when the layers are merged.
    #[serde(default)]
    pub pricing: BTreeMap<String, toml::Value>,
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
    #[serde(default)]
    pub tls: TlsLayer,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsLayer {
    pub ca_file: Option<PathBuf>,
    pub cert_file: Option<PathBuf>,
    pub key_file: Option<PathBuf>,
    pub require: Option<bool>,
}

impl<'de> Deserialize<'de> for Secret {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d).map(Secret)
    }
}

/// A value and where it came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sourced<T> {
    pub value: T,
    pub origin: Origin,
}

/// A secret as resolved: its value, and where it came from (a value or a file).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SecretSetting {
    pub value: Secret,
    pub origin: Origin,
    /// The file it was read from, when it came from a `*_file`.
    pub file: Option<PathBuf>,
}

/// The effective NATS settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NatsSettings {
    pub url: Option<Sourced<String>>,
    pub name: Option<Sourced<String>>,
    pub user: Option<Sourced<String>>,
    pub password: Option<SecretSetting>,
    pub token: Option<SecretSetting>,
    pub nkey_seed: Option<SecretSetting>,
    pub creds_file: Option<Sourced<PathBuf>>,
    pub tls_ca_file: Option<Sourced<PathBuf>>,
    pub tls_cert_file: Option<Sourced<PathBuf>>,
    pub tls_key_file: Option<Sourced<PathBuf>>,
    pub tls_require: Sourced<bool>,
    pub ack_wait: Sourced<Duration>,
    pub max_deliver: Sourced<u32>,
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
    pub nats: NatsSettings,
    /// Model prices (`[pricing."MODEL"]`), for `spec::load_with`.
    pub pricing: BTreeMap<String, Price>,
    /// Where each model's price came from.
    pub pricing_origins: BTreeMap<String, Origin>,
}

fn default<T>(value: T) -> Sourced<T> {
    Sourced {
        value,
        origin: Origin::Default,
    }
}

/// A secret as one layer gives it: a value or a file to read it from.
enum SecretSource {
    Value(Secret),
    File(PathBuf),
}

/// The secret of the highest layer that sets it, and where it came from.
struct LayeredSecret {
    source: SecretSource,
    origin: Origin,
}

/// One secret slot of a layer: a value or a file, never both.
fn secret_of(
    what: &'static str,
    value: Option<Secret>,
    file: Option<PathBuf>,
    origin: &Origin,
) -> Result<Option<SecretSource>, ConfigError> {
    match (value, file) {
        (Some(_), Some(_)) => Err(ConfigError::SecretTwice {
            what,
            origin: origin.to_string(),
        }),
        (Some(v), None) => Ok(Some(SecretSource::Value(v))),
        (None, Some(f)) => Ok(Some(SecretSource::File(f))),
        (None, None) => Ok(None),
    }
}

/// A layer with where it came from: one origin for the file, one per key otherwise.
pub struct SourcedLayer {
    pub layer: Layer,
    /// The origin of a key (its dotted path) in this layer.
    pub origin: Box<dyn Fn(&'static str) -> Origin>,
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

    /// Only the `[pricing]` table of the layers [`Config::load`] reads (`forkfleet run`
    /// needs nothing else): a NATS setting it does not use cannot make it fail.
    pub fn load_pricing(
        file: Option<&Path>,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<BTreeMap<String, Price>, ConfigError> {
        let (layers, _) = Self::layers(file, env, Layer::default())?;
        let mut pricing = BTreeMap::new();
        for l in &layers {
            for (model, value) in &l.layer.pricing {
                let price = price_of(model, value, &(l.origin)("pricing"))?;
                pricing.insert(model.clone(), price);
            }
        }
        Ok(pricing)
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
        let mut c = Config {
            file: None,
            data: default(PathBuf::from(DEFAULT_DATA)),
            pool: default(DEFAULT_POOL.to_string()),
            concurrency: default(DEFAULT_CONCURRENCY),
            drain_grace: default(DEFAULT_DRAIN_GRACE),
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
            },
            pricing: BTreeMap::new(),
            pricing_origins: BTreeMap::new(),
        };
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
            for (model, value) in &layer.pricing {
                let from = o("pricing");
                let price = price_of(model, value, &from)?;
                c.pricing.insert(model.clone(), price);
                c.pricing_origins.insert(model.clone(), from);
            }
            let n = &layer.nats;
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
        c.check()?;
        Ok(c)
    }

    fn check(&self) -> Result<(), ConfigError> {
        if self.concurrency.value == 0 {
            return Err(ConfigError::Invalid {
                key: "concurrency",
                expected: "at least 1",
                value: format!("0 (from {})", self.concurrency.origin),
            });
        }
        if let Err(e) = forkfleet_shared::subjects::task_subject(&self.pool.value) {
            return Err(ConfigError::Invalid {
                key: "pool",
                expected: "1 to 64 letters, digits, `_` or `-`",
                value: format!("`{}` (from {}): {e}", self.pool.value, self.pool.origin),
            });
        }
        let n = &self.nats;
        let mut methods = Vec::new();
        match (&n.user, &n.password) {
            (Some(u), Some(p)) => methods.push(format!(
                "user + password from {} and {}",
                u.origin, p.origin
            )),
            (Some(u), None) => {
                return Err(ConfigError::Incomplete(format!(
                "NATS user `{}` (from {}) has no password: set nats.password or nats.password_file",
                u.value, u.origin
            )))
            }
            (None, Some(p)) => {
                return Err(ConfigError::Incomplete(format!(
                    "a NATS password is set (from {}) but no user: set nats.user",
                    p.origin
                )))
            }
            (None, None) => {}
        }
        if let Some(t) = &n.token {
            methods.push(format!("token from {}", t.origin));
        }
        if let Some(k) = &n.nkey_seed {
            methods.push(format!("nkey seed from {}", k.origin));
        }
        if let Some(c) = &n.creds_file {
            methods.push(format!("creds file from {}", c.origin));
        }
        if methods.len() > 1 {
            return Err(ConfigError::AuthConflict(methods.join("; ")));
        }
        match (&n.tls_cert_file, &n.tls_key_file) {
            (Some(c), None) => Err(ConfigError::Incomplete(format!(
                "a TLS client certificate is set (from {}) without its key: set nats.tls.key_file",
                c.origin
            ))),
            (None, Some(k)) => Err(ConfigError::Incomplete(format!(
                "a TLS client key is set (from {}) without its certificate: set nats.tls.cert_file",
                k.origin
            ))),
            _ => Ok(()),
        }
    }

    /// The NATS connection to make, named `default_name` unless configured; `None`
    /// when no URL is configured (the embedded mode).
    pub fn nats_config(&self, default_name: &str) -> Option<NatsConfig> {
        let n = &self.nats;
        let url = n.url.as_ref()?;
        let auth = if let (Some(user), Some(password)) = (&n.user, &n.password) {
            NatsAuth::UserPassword {
                user: user.value.clone(),
                password: password.value.expose().to_string(),
            }
        } else if let Some(t) = &n.token {
            NatsAuth::Token(t.value.expose().to_string())
        } else if let Some(k) = &n.nkey_seed {
            NatsAuth::NkeySeed(k.value.expose().to_string())
        } else if let Some(c) = &n.creds_file {
            NatsAuth::CredsFile(c.value.clone())
        } else {
            NatsAuth::None
        };
        Some(NatsConfig {
            url: url.value.clone(),
            name: Some(
                n.name
                    .as_ref()
                    .map(|s| s.value.clone())
                    .unwrap_or_else(|| default_name.to_string()),
            ),
            auth,
            tls: NatsTls {
                ca_file: n.tls_ca_file.as_ref().map(|s| s.value.clone()),
                client_cert: n.tls_cert_file.as_ref().map(|s| s.value.clone()),
                client_key: n.tls_key_file.as_ref().map(|s| s.value.clone()),
                require: n.tls_require.value,
            },
            ack_wait: n.ack_wait.value,
            max_deliver: n.max_deliver.value,
            ..NatsConfig::default()
        })
    }

    /// The effective configuration as TOML, secrets redacted, each value's origin in a
    /// comment (`--print-config`).
    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "# effective configuration: defaults < config file < FORKFLEET_* environment < flags"
        );
        if let Some(f) = &self.file {
            let _ = writeln!(out, "# config file: {}", f.display());
        }
        fn line(out: &mut String, key: &str, value: String, origin: &Origin) {
            let _ = writeln!(out, "{key} = {value}  # {origin}");
        }
        fn quoted(s: &str) -> String {
            toml::Value::String(s.to_string()).to_string()
        }
        fn path(p: &Path) -> String {
            quoted(&p.display().to_string())
        }
        line(&mut out, "data", path(&self.data.value), &self.data.origin);
        line(
            &mut out,
            "pool",
            quoted(&self.pool.value),
            &self.pool.origin,
        );
        line(
            &mut out,
            "concurrency",
            self.concurrency.value.to_string(),
            &self.concurrency.origin,
        );
        line(
            &mut out,
            "drain_grace_s",
            self.drain_grace.value.as_secs().to_string(),
            &self.drain_grace.origin,
        );
        let n = &self.nats;
        let _ = writeln!(out, "\n[nats]");
        match &n.url {
            Some(u) => line(&mut out, "url", quoted(&redact_url(&u.value)), &u.origin),
            None => {
                let _ = writeln!(
                    out,
                    "# url: not set (client commands use the embedded store under `data`)"
                );
            }
        }
        for (key, v) in [("name", &n.name), ("user", &n.user)] {
            if let Some(v) = v {
                line(&mut out, key, quoted(&v.value), &v.origin);
            }
        }
        for (key, s) in [
            ("password", &n.password),
            ("token", &n.token),
            ("nkey_seed", &n.nkey_seed),
        ] {
            if let Some(s) = s {
                let from = match &s.file {
                    Some(f) => format!("{} (file {})", s.origin, f.display()),
                    None => s.origin.to_string(),
                };
                let _ = writeln!(out, "{key} = \"<redacted>\"  # {from}");
            }
        }
        if let Some(c) = &n.creds_file {
            line(&mut out, "creds_file", path(&c.value), &c.origin);
        }
        line(
            &mut out,
            "ack_wait_s",
            n.ack_wait.value.as_secs().to_string(),
            &n.ack_wait.origin,
        );
        line(
            &mut out,
            "max_deliver",
            n.max_deliver.value.to_string(),
            &n.max_deliver.origin,
        );
        let _ = writeln!(out, "\n[nats.tls]");
        for (key, v) in [
            ("ca_file", &n.tls_ca_file),
            ("cert_file", &n.tls_cert_file),
            ("key_file", &n.tls_key_file),
        ] {
            if let Some(v) = v {
                line(&mut out, key, path(&v.value), &v.origin);
            }
        }
        line(
            &mut out,
            "require",
            n.tls_require.value.to_string(),
            &n.tls_require.origin,
        );
        for (model, price) in &self.pricing {
            let origin = self
                .pricing_origins
                .get(model)
                .cloned()
                .unwrap_or(Origin::Default);
            let _ = writeln!(out, "\n[pricing.{}]  # {origin}", quoted(model));
            let _ = writeln!(out, "input_per_mtok = {:?}", price.input_per_mtok);
            let _ = writeln!(out, "output_per_mtok = {:?}", price.output_per_mtok);
            if let Some(c) = price.cached_per_mtok {
                let _ = writeln!(out, "cached_per_mtok = {c:?}");
            }
        }
        out
    }
}

// URLs without their user info (every one of a comma-separated list), as `--print-config`
// shows them: the bus's own redaction, so logs and printouts agree.
use forkfleet_bus::nats::redact_url;

fn resolve_secret(
    what: &'static str,
    slot: Option<LayeredSecret>,
) -> Result<Option<SecretSetting>, ConfigError> {
    let Some(LayeredSecret { source, origin }) = slot else {
        return Ok(None);
    };
    let path = match source {
        SecretSource::Value(value) => {
            return Ok(Some(SecretSetting {
                value,
                origin,
                file: None,
            }))
        }
        SecretSource::File(path) => path,
    };
    let text = std::fs::read_to_string(&path).map_err(|source| ConfigError::SecretFile {
        what,
        path: path.clone(),
        origin: origin.to_string(),
        source,
    })?;
    let value = text.trim_end_matches(['\n', '\r']).to_string();
    if value.is_empty() {
        return Err(ConfigError::EmptySecret {
            what,
            path,
            origin: origin.to_string(),
        });
    }
    Ok(Some(SecretSetting {
        value: Secret(value),
        origin,
        file: Some(path),
    }))
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

/// One `[pricing."MODEL"]` entry, checked: a table of the known keys, the two required
/// ones present, every value a finite number >= 0 (integers are fine).
pub fn price_of(model: &str, value: &toml::Value, origin: &Origin) -> Result<Price, ConfigError> {
    let bad = |message: String| ConfigError::BadPrice {
        model: model.to_string(),
        origin: origin.to_string(),
        message,
    };
    if model.is_empty() {
        return Err(bad("the model name is empty".into()));
    }
    // The spec's own price type: unknown, missing and mistyped keys are its errors.
    let price: Price = value
        .clone()
        .try_into()
        .map_err(|e: toml::de::Error| bad(e.message().trim().to_string()))?;
    price.validate().map_err(bad)?;
    Ok(price)
}

/// The environment variable of a key: `nats.tls.ca_file` -> `FORKFLEET_NATS_TLS_CA_FILE`.
pub fn env_var(key: &str) -> String {
    format!("{ENV_PREFIX}{}", key.replace('.', "_").to_ascii_uppercase())
}

/// The flag that sets a key (see `cli::ConfigArgs`).
pub fn flag_origin(key: &'static str) -> &'static str {
    match key {
        "data" => "--data",
        "pool" => "--pool",
        "concurrency" => "--concurrency",
        "drain_grace_s" => "--drain-grace-s",
        "nats.url" => "--nats",
        "nats.name" => "--nats-name",
        "nats.user" => "--nats-user",
        "nats.password_file" => "--nats-password-file",
        "nats.token_file" => "--nats-token-file",
        "nats.nkey_seed_file" => "--nats-nkey-seed-file",
        "nats.creds_file" => "--nats-creds",
        "nats.ack_wait_s" => "--nats-ack-wait-s",
        "nats.max_deliver" => "--nats-max-deliver",
        "nats.tls.ca_file" => "--tls-ca",
        "nats.tls.cert_file" => "--tls-cert",
        "nats.tls.key_file" => "--tls-key",
        "nats.tls.require" => "--tls-require",
        _ => "a flag",
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
    let require = match get("nats.tls.require") {
        None => None,
        Some(v) => Some(match v.trim().to_ascii_lowercase().as_str() {
            "1" | "true" | "yes" | "on" => true,
            "0" | "false" | "no" | "off" => false,
            _ => {
                return Err(ConfigError::Env {
                    var: env_var("nats.tls.require"),
                    message: format!("expected true or false, got `{v}`"),
                })
            }
        }),
    };
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
    Ok(Layer {
        pricing,
        data: get("data").map(PathBuf::from),
        pool: get("pool"),
        concurrency: parse("concurrency", "a number of branches")?.map(|n| n as usize),
        drain_grace_s: parse("drain_grace_s", "a number of seconds")?,
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
            tls: TlsLayer {
                ca_file: get("nats.tls.ca_file").map(PathBuf::from),
                cert_file: get("nats.tls.cert_file").map(PathBuf::from),
                key_file: get("nats.tls.key_file").map(PathBuf::from),
                require,
            },
        },
    })
}

/// The process environment, for [`Config::load`].
pub fn process_env(var: &str) -> Option<String> {
    std::env::var(var).ok()
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env_of(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).cloned()
    }

    fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    }

    #[test]
    fn defaults_alone() {
        let c = Config::load(None, &env_of(&[]), Layer::default()).unwrap();
        assert_eq!(c.data.value, PathBuf::from(".forkfleet"));
        assert_eq!(c.pool.value, "default");
        assert_eq!(c.concurrency.value, 64);
        assert_eq!(c.drain_grace.value, Duration::from_secs(30));
        assert_eq!(c.nats.url, None);
        assert!(c.nats_config("x").is_none());
    }

    #[test]
    fn each_layer_overrides_the_one_below_per_key() {
        let dir = tempfile::tempdir().unwrap();
        let file = write(
            dir.path(),
            "ff.toml",
            "pool = \"file-pool\"\nconcurrency = 3\ndrain_grace_s = 5\ndata = \"store\"\n[nats]\nurl = \"nats://file:4222\"\nname = \"from-file\"\n[nats.tls]\nca_file = \"ca.pem\"\n",
        );
        let env = env_of(&[
            ("FORKFLEET_CONCURRENCY", "7"),
            ("FORKFLEET_NATS_URL", "nats://env:4222"),
            ("FORKFLEET_DRAIN_GRACE_S", "9"),
        ]);
        let flags = Layer {
            concurrency: Some(11),
            ..Layer::default()
        };
        let c = Config::load(Some(&file), &env, flags).unwrap();
        // file only
        assert_eq!(c.pool.value, "file-pool");
        assert_eq!(c.pool.origin, Origin::File(file.clone()));
        assert_eq!(
            c.data.value,
            dir.path().join("store"),
            "relative to the file"
        );
        assert_eq!(
            c.nats.tls_ca_file.as_ref().unwrap().value,
            dir.path().join("ca.pem")
        );
        assert_eq!(c.nats.name.as_ref().unwrap().value, "from-file");
        // env over file
        assert_eq!(c.nats.url.as_ref().unwrap().value, "nats://env:4222");
        assert_eq!(
            c.nats.url.as_ref().unwrap().origin,
            Origin::Env("FORKFLEET_NATS_URL".into())
        );
        assert_eq!(c.drain_grace.value, Duration::from_secs(9));
        // flag over env over file
        assert_eq!(c.concurrency.value, 11);
        assert_eq!(c.concurrency.origin, Origin::Flag("--concurrency"));
        let nats = c.nats_config("forkfleet-test").unwrap();
        assert_eq!(nats.url, "nats://env:4222");
        assert_eq!(nats.name.as_deref(), Some("from-file"));
        assert_eq!(nats.tls.ca_file, Some(dir.path().join("ca.pem")));
    }

    #[test]
    fn config_file_from_the_environment() {
        let dir = tempfile::tempdir().unwrap();
        let file = write(dir.path(), "c.toml", "pool = \"p\"\n");
        let path = file.to_str().unwrap().to_string();
        let c = Config::load(
            None,
            &env_of(&[("FORKFLEET_CONFIG", &path)]),
            Layer::default(),
        )
        .unwrap();
        assert_eq!(c.pool.value, "p");
        assert_eq!(c.file, Some(file));
    }

    #[test]
    fn unknown_keys_list_the_valid_ones() {
        let dir = tempfile::tempdir().unwrap();
        for text in [
            "colour = 1\n",
            "[nats]\nurll = \"x\"\n",
            "[nats.tls]\nca = \"x\"\n",
        ] {
            let file = write(dir.path(), "bad.toml", text);
            let err = Config::load(Some(&file), &env_of(&[]), Layer::default())
                .unwrap_err()
                .to_string();
            assert!(err.contains("unknown field"), "{err}");
            assert!(err.contains("drain_grace_s"), "{err}");
            assert!(err.contains("nkey_seed_file"), "{err}");
        }
    }

    #[test]
    fn secrets_from_values_and_files_are_redacted() {
        let dir = tempfile::tempdir().unwrap();
        let pw = write(dir.path(), "pw", "hunter2\n");
        let file = write(
            dir.path(),
            "c.toml",
            "[nats]\nurl = \"nats://u:urlsecret@h:4222\"\nuser = \"alice\"\npassword = \"from-file-secret\"\n",
        );
        let env = env_of(&[("FORKFLEET_NATS_PASSWORD_FILE", pw.to_str().unwrap())]);
        let c = Config::load(Some(&file), &env, Layer::default()).unwrap();
        let p = c.nats.password.as_ref().unwrap();
        assert_eq!(p.value.expose(), "hunter2", "env file over file value");
        assert_eq!(p.file.as_deref(), Some(pw.as_path()));
        let shown = c.render();
        let debug = format!("{c:?} {:?}", c.nats_config("x").unwrap());
        for text in [&shown, &debug] {
            assert!(!text.contains("hunter2"), "{text}");
            assert!(!text.contains("from-file-secret"), "{text}");
        }
        assert!(!shown.contains("urlsecret"), "{shown}");
        assert!(shown.contains("password = \"<redacted>\""), "{shown}");
        assert!(shown.contains("FORKFLEET_NATS_PASSWORD_FILE"), "{shown}");
        assert!(shown.contains("user = \"alice\""), "{shown}");
        match c.nats_config("x").unwrap().auth {
            NatsAuth::UserPassword { user, password } => {
                assert_eq!((user.as_str(), password.as_str()), ("alice", "hunter2"))
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn auth_and_tls_mistakes_are_errors() {
        let cases: Vec<(Vec<(&str, &str)>, &str)> = vec![
            (
                vec![
                    ("FORKFLEET_NATS_TOKEN", "t"),
                    ("FORKFLEET_NATS_CREDS_FILE", "c"),
                ],
                "more than one NATS auth method",
            ),
            (vec![("FORKFLEET_NATS_USER", "u")], "has no password"),
            (vec![("FORKFLEET_NATS_PASSWORD", "p")], "no user"),
            (
                vec![
                    ("FORKFLEET_NATS_TOKEN", "t"),
                    ("FORKFLEET_NATS_TOKEN_FILE", "f"),
                ],
                "not both",
            ),
            (
                vec![("FORKFLEET_NATS_TLS_CERT_FILE", "c")],
                "without its key",
            ),
            (
                vec![("FORKFLEET_NATS_TLS_REQUIRE", "maybe")],
                "true or false",
            ),
            (
                vec![("FORKFLEET_CONCURRENCY", "lots")],
                "FORKFLEET_CONCURRENCY",
            ),
            (vec![("FORKFLEET_CONCURRENCY", "0")], "at least 1"),
            (vec![("FORKFLEET_POOL", "a.b")], "pool"),
            (
                vec![("FORKFLEET_NATS_NKEY_SEED_FILE", "/nonexistent/seed")],
                "/nonexistent/seed",
            ),
        ];
        for (vars, expect) in cases {
            let err = Config::load(None, &env_of(&vars), Layer::default())
                .unwrap_err()
                .to_string();
            assert!(err.contains(expect), "{vars:?}: {err}");
            for (_, v) in &vars {
                if *v == "t" || *v == "p" {
                    assert!(!err.contains(&format!("`{v}`")), "secret in {err}");
                }
            }
        }
    }

    #[test]
    fn a_higher_layer_replaces_a_secret_value_with_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let tok = write(dir.path(), "tok", "tok-from-file\n");
        let env = env_of(&[("FORKFLEET_NATS_TOKEN", "tok-from-env")]);
        let flags = Layer {
            nats: NatsLayer {
                token_file: Some(tok.clone()),
                ..NatsLayer::default()
            },
            ..Layer::default()
        };
        let c = Config::load(None, &env, flags).unwrap();
        let t = c.nats.token.unwrap();
        assert_eq!(t.value.expose(), "tok-from-file");
        assert_eq!(t.origin, Origin::Flag("--nats-token-file"));
    }

    #[test]
    fn pricing_layers_per_model_and_bad_entries_name_model_and_key() {
        let dir = tempfile::tempdir().unwrap();
        let file = write(
            dir.path(),
            "p.toml",
            "[pricing.\"scripted:a\"]\ninput_per_mtok = 1\noutput_per_mtok = 2.5\n\
             [pricing.\"openai:gpt-x\"]\ninput_per_mtok = 0.5\noutput_per_mtok = 1.0\ncached_per_mtok = 0.1\n",
        );
        // The environment replaces one model's whole entry and adds another.
        let env = env_of(&[(
            "FORKFLEET_PRICING",
            "\"openai:gpt-x\" = { input_per_mtok = 3.0, output_per_mtok = 4.0 }\n\"scripted:b\" = { input_per_mtok = 0, output_per_mtok = 0 }",
        )]);
        let c = Config::load(Some(&file), &env, Layer::default()).unwrap();
        let a = c.pricing["scripted:a"];
        assert_eq!((a.input_per_mtok, a.output_per_mtok), (1.0, 2.5));
        assert_eq!(a.cached_per_mtok, None);
        assert_eq!(c.pricing_origins["scripted:a"], Origin::File(file.clone()));
        let x = c.pricing["openai:gpt-x"];
        assert_eq!((x.input_per_mtok, x.output_per_mtok), (3.0, 4.0));
        assert_eq!(x.cached_per_mtok, None, "replaced whole, not per key");
        assert_eq!(
            c.pricing_origins["openai:gpt-x"],
            Origin::Env("FORKFLEET_PRICING".into())
        );
        assert_eq!(c.pricing["scripted:b"].output_per_mtok, 0.0);
        let shown = c.render();
        assert!(shown.contains("[pricing.\"scripted:a\"]"), "{shown}");
        assert!(shown.contains("output_per_mtok = 2.5"), "{shown}");

        for (text, expect) in [
            (
                "[pricing.\"m:x\"]\ninput_per_mtok = -1\noutput_per_mtok = 1\n",
                &["[pricing.\"m:x\"]", "`input_per_mtok`", ">= 0", "-1"][..],
            ),
            (
                "[pricing.\"m:x\"]\ninput_per_mtok = nan\noutput_per_mtok = 1\n",
                &["m:x", "`input_per_mtok`", "finite"],
            ),
            (
                "[pricing.\"m:x\"]\ninput_per_mtok = 1\noutput_per_mtok = inf\n",
                &["m:x", "`output_per_mtok`", "finite"],
            ),
            (
                "[pricing.\"m:y\"]\ninput_per_mtok = 1\n",
                &["m:y", "missing field `output_per_mtok`"],
            ),
            (
                "[pricing.\"m:y\"]\ninput_per_mtok = 1\noutput_per_mtok = 1\ncached = 1\n",
                &["m:y", "unknown field `cached`", "cached_per_mtok"],
            ),
            (
                "[pricing.\"m:z\"]\ninput_per_mtok = \"cheap\"\noutput_per_mtok = 1\n",
                &["m:z", "invalid type", "\"cheap\""],
            ),
            (
                "[pricing]\n\"m:w\" = 3\n",
                &["m:w", "invalid type: integer `3`"],
            ),
        ] {
            let bad = write(dir.path(), "bad.toml", text);
            let err = Config::load(Some(&bad), &env_of(&[]), Layer::default())
                .unwrap_err()
                .to_string();
            for e in expect {
                assert!(err.contains(e), "{text}: expected `{e}` in {err}");
            }
            assert!(err.contains("bad.toml"), "{err}");
        }
        let err = Config::load(
            None,
            &env_of(&[("FORKFLEET_PRICING", "not toml at all")]),
            Layer::default(),
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("FORKFLEET_PRICING"), "{err}");
    }

    #[test]
    fn urls_are_redacted() {
        assert_eq!(redact_url("nats://h:4222"), "nats://h:4222");
        assert_eq!(
            redact_url("nats://u:p@h:4222/x"),
            "nats://<redacted>@h:4222/x"
        );
        assert_eq!(redact_url("tls://tok@h"), "tls://<redacted>@h");
        // Every URL of a list: the second one's password must not show.
        assert_eq!(
            redact_url("nats://a:1,nats://u:p@b:2"),
            "nats://a:1,nats://<redacted>@b:2"
        );
    }
}
