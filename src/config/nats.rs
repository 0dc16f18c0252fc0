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
    /// Replicas of the streams and buckets the coordinator creates.
    pub replicas: Sourced<usize>,
    /// A scoped client's identity (ADR 17).
    pub identity: Option<Sourced<String>>,
    /// Whether a worker or client creates missing streams and buckets (the coordinator
    /// always does).
    pub provision: Sourced<bool>,
    /// How long to keep trying to reach NATS (and, for a client command, the coordinator).
    pub connect_timeout: Sourced<Duration>,
    /// `blob_store_mb`: `max_bytes` of each blob bucket the coordinator creates.
    pub blob_store_mb: Sourced<u64>,
    /// `stream_mb`: `max_bytes` of each stream the coordinator creates.
    pub stream_mb: Sourced<u64>,
}

impl NatsSettings {
    /// At most one auth method, and that one complete; a TLS client certificate only with
    /// its key.
    pub(super) fn check(&self) -> Result<(), ConfigError> {
        let n = self;
        let mut methods = Vec::new();
        if let Some(url) = &n.url {
            // A URL with user info (`nats://user:password@host`) authenticates too.
            if forkfleet_bus::nats::redact_url(&url.value) != url.value {
                // A command line is visible to every user of the machine (`ps`).
                if matches!(url.origin, super::Origin::Flag(_)) {
                    return Err(ConfigError::Incomplete(format!(
                        "the NATS URL given by {} carries credentials, and a command line is visible to every user of the machine: give the URL without them and the password in a file (--nats-user and --nats-password-file, or --nats-creds), or the whole URL in FORKFLEET_NATS_URL or the config file's [nats] url",
                        url.origin
                    )));
                }
                methods.push(format!("a user in the URL from {}", url.origin));
            }
        }
        match (&n.user, &n.password) {
            (Some(u), Some(p)) => methods.push(format!(
                "user + password from {} and {}",
                u.origin, p.origin
            )),
            (Some(u), None) if !methods.is_empty() => {
                methods.push(format!("user `{}` from {}", u.value, u.origin))
            }
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
                "a TLS client certificate is set (from {}) without its key: set nats.tls.key_file (--tls-key, FORKFLEET_NATS_TLS_KEY_FILE)",
                c.origin
            ))),
            (None, Some(k)) => Err(ConfigError::Incomplete(format!(
                "a TLS client key is set (from {}) without its certificate: set nats.tls.cert_file (--tls-cert, FORKFLEET_NATS_TLS_CERT_FILE)",
                k.origin
            ))),
            _ => Ok(()),
        }
    }
}

/// The role a process has on the bus (ADR 17): what it provisions and where its replies go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Coordinator,
    Worker,
    /// A client command: scoped by `[nats] identity` when set, else an admin.
    Client,
}

impl Config {
    /// The NATS connection of a process with `role`: [`Config::nats_config`], with the
    /// role's reply inbox prefix, provisioning and replicas.
    pub fn nats_config_for(&self, role: Role) -> Option<NatsConfig> {
        let name = match role {
            Role::Coordinator => "forkfleet-coordinator",
            Role::Worker => "forkfleet-worker",
            Role::Client => "forkfleet-client",
        };
        let mut nats = self.nats_config(name)?;
        let n = &self.nats;
        nats.replicas = n.replicas.value;
        match role {
            Role::Coordinator => {
                nats.provision = true;
                nats.inbox_prefix = Some(forkfleet_shared::subjects::coordinator_inbox());
            }
            Role::Worker => {
                nats.provision = n.provision.value;
                nats.inbox_prefix = Some(forkfleet_shared::subjects::worker_inbox());
            }
            Role::Client => {
                // A client command binds to the streams and buckets the coordinator made
                // (waiting for them, bounded) unless `provision` is set: made by a client,
                // they would have its replicas (1 by default), not the cluster's.
                nats.provision = match n.provision.origin {
                    super::Origin::Default => false,
                    _ => n.provision.value,
                };
                // A command waits for them as long as for NATS (`connect_timeout_s`).
                nats.bind_wait = nats.connect_timeout;
                // Checked when the configuration was loaded.
                nats.inbox_prefix = n
                    .identity
                    .as_ref()
                    .and_then(|id| forkfleet_shared::subjects::client_inbox(&id.value).ok());
                // A scoped client's blobs go through the coordinator (ADR 37).
                nats.blob_broker = n
                    .identity
                    .as_ref()
                    .and_then(|id| forkfleet_shared::api::client_api_subject(&id.value).ok());
            }
        }
        Some(nats)
    }

    /// The API subject a client command sends to: its identity's
    /// `client.<identity>`, else the admin subject.
    pub fn api_subject(&self) -> String {
        self.nats
            .identity
            .as_ref()
            .and_then(|id| forkfleet_shared::api::client_api_subject(&id.value).ok())
            .unwrap_or_else(|| forkfleet_shared::api::API_SUBJECT.to_string())
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
            replicas: n.replicas.value,
            connect_timeout: n.connect_timeout.value,
            blob_max_bytes: megabytes(n.blob_store_mb.value),
            stream_max_bytes: megabytes(n.stream_mb.value),
            ..NatsConfig::default()
        })
    }
}

/// `mb` megabytes in bytes, as JetStream's `max_bytes` (an `i64`).
fn megabytes(mb: u64) -> i64 {
    i64::try_from(mb.saturating_mul(1 << 20)).unwrap_or(i64::MAX)
}
