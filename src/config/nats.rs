//! The effective NATS settings: their checks (one auth method, each complete; a TLS client
//! certificate with its key) and the connection they make.

use super::{Config, ConfigError, SecretSetting, Sourced};
use forkfleet_bus::nats::{NatsAuth, NatsConfig, NatsTls};
use std::path::PathBuf;
use std::time::Duration;

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
    /// How long to keep trying to reach NATS (and, for a client command, the coordinator).
    pub connect_timeout: Sourced<Duration>,
}

impl NatsSettings {
    /// At most one auth method, and that one complete; a TLS client certificate only with
    /// its key.
    pub(super) fn check(&self) -> Result<(), ConfigError> {
        let n = self;
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
}

impl Config {
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
            connect_timeout: n.connect_timeout.value,
            ..NatsConfig::default()
        })
    }
}
