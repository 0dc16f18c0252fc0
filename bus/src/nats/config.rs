//! Connection settings: the URL, authentication, TLS, storage and limits; secrets never in `Debug`.

use super::*;

/// How to authenticate to NATS. Secrets never appear in `Debug`.
#[derive(Clone, Default)]
pub enum NatsAuth {
    #[default]
    None,
    UserPassword {
        user: String,
        password: String,
    },
    Token(String),
    /// An NKey seed (`SU...`).
    NkeySeed(String),
    /// A `.creds` file (JWT and NKey seed).
    CredsFile(PathBuf),
}

impl fmt::Debug for NatsAuth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::None => f.write_str("None"),
            Self::UserPassword { user, .. } => f
                .debug_struct("UserPassword")
                .field("user", user)
                .field("password", &"<redacted>")
                .finish(),
            Self::Token(_) => f.write_str("Token(<redacted>)"),
            Self::NkeySeed(_) => f.write_str("NkeySeed(<redacted>)"),
            Self::CredsFile(path) => f.debug_tuple("CredsFile").field(path).finish(),
        }
    }
}

/// TLS to the server: extra root certificates, a client certificate, or TLS required.
#[derive(Debug, Clone, Default)]
pub struct NatsTls {
    pub ca_file: Option<PathBuf>,
    pub client_cert: Option<PathBuf>,
    pub client_key: Option<PathBuf>,
    pub require: bool,
}

/// Where JetStream keeps the bus's streams.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum NatsStorage {
    #[default]
    File,
    Memory,
}

impl From<NatsStorage> for stream::StorageType {
    fn from(s: NatsStorage) -> Self {
        match s {
            NatsStorage::File => stream::StorageType::File,
            NatsStorage::Memory => stream::StorageType::Memory,
        }
    }
}

#[derive(Clone)]
pub struct NatsConfig {
    /// `nats://host:port` (or `tls://`), or several separated by commas (cluster seeds);
    /// credentials in a URL are redacted in logs and errors.
    pub url: String,
    /// The connection name shown by the server's monitoring.
    pub name: Option<String>,
    pub auth: NatsAuth,
    pub tls: NatsTls,
    /// A task or event not acked (or extended) within this time is delivered again.
    pub ack_wait: Duration,
    /// Deliveries of one task that may take its branch over: a later one makes the task
    /// dead, which the coordinator judges (ADR 38; the consumer itself delivers without limit).
    pub max_deliver: u32,
    /// Bound of every JetStream API call, publish acknowledgement and double ack.
    pub request_timeout: Duration,
    /// Bound of the first connection.
    pub connect_timeout: Duration,
    pub storage: NatsStorage,
    /// Worker heartbeats older than this are not listed (the bucket's `max_age` when it is
    /// created).
    pub worker_ttl: Duration,
    /// How long events and control commands are kept.
    pub max_age: Duration,
    /// Replicas of every stream and bucket this process creates: 1 to 5 ([`MAX_REPLICAS`]);
    /// 3 on a NATS cluster of three or more servers. Streams that exist keep theirs.
    pub replicas: usize,
    /// Create the streams, buckets and consumers that are missing (the coordinator; every
    /// process of an unrestricted set-up). When false (a worker or client whose NATS user may
    /// not create them), bind to the existing ones, waiting at most [`NatsConfig::bind_wait`]
    /// for the coordinator to create them.
    pub provision: bool,
    /// How long a process that does not provision waits for the streams and buckets.
    pub bind_wait: Duration,
    /// The prefix of this connection's reply inboxes (`None`: the library's `_INBOX`), so
    /// that server permissions can let each identity subscribe to its own replies only
    /// (`forkfleet_shared::subjects::client_inbox`).
    pub inbox_prefix: Option<String>,
    /// A scoped client's API subject (without `ff.api.`): its blobs go through the
    /// coordinator there (`missing_blobs`, `put_blob_part`, `get_blob_part`), which
    /// verifies, counts and scopes them; such a client may not touch the blob buckets.
    /// `None`: the buckets directly (the coordinator, workers, an operator).
    pub blob_broker: Option<String>,
    /// `max_bytes` of each blob bucket this process creates (the small-blob KV bucket
    /// and the object store): a full bucket refuses writes with an error naming it.
    pub blob_max_bytes: i64,
    /// `max_bytes` of each stream this process creates (tasks, events, control, dead
    /// tasks); the worker heartbeat bucket gets a sixteenth of it.
    pub stream_max_bytes: i64,
}

/// The default of [`NatsConfig::blob_max_bytes`]: 8 GiB per bucket.
pub const DEFAULT_BLOB_MAX_BYTES: i64 = 8 << 30;
/// The default of [`NatsConfig::stream_max_bytes`]: 1 GiB per stream.
pub const DEFAULT_STREAM_MAX_BYTES: i64 = 1 << 30;

/// The most replicas a JetStream stream may have.
pub const MAX_REPLICAS: usize = 5;

impl NatsConfig {
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            ..Self::default()
        }
    }
}

impl Default for NatsConfig {
    fn default() -> Self {
        Self {
            url: "nats://127.0.0.1:4222".into(),
            name: None,
            auth: NatsAuth::None,
            tls: NatsTls::default(),
            ack_wait: Duration::from_secs(30),
            max_deliver: 5,
            request_timeout: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(5),
            storage: NatsStorage::File,
            worker_ttl: Duration::from_millis(WORKER_TTL_MS),
            max_age: Duration::from_secs(7 * 24 * 3600),
            replicas: 1,
            provision: true,
            bind_wait: Duration::from_secs(60),
            inbox_prefix: None,
            blob_broker: None,
            blob_max_bytes: DEFAULT_BLOB_MAX_BYTES,
            stream_max_bytes: DEFAULT_STREAM_MAX_BYTES,
        }
    }
}

impl fmt::Debug for NatsConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsConfig")
            .field("url", &redact_url(&self.url))
            .field("name", &self.name)
            .field("auth", &self.auth)
            .field("tls", &self.tls)
            .field("ack_wait", &self.ack_wait)
            .field("max_deliver", &self.max_deliver)
            .field("request_timeout", &self.request_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("storage", &self.storage)
            .field("worker_ttl", &self.worker_ttl)
            .field("max_age", &self.max_age)
            .field("replicas", &self.replicas)
            .field("provision", &self.provision)
            .field("bind_wait", &self.bind_wait)
            .field("inbox_prefix", &self.inbox_prefix)
            .field("blob_broker", &self.blob_broker)
            .field("blob_max_bytes", &self.blob_max_bytes)
            .field("stream_max_bytes", &self.stream_max_bytes)
            .finish()
    }
}

/// The URL(s), comma-separated as `NatsBus::connect` takes them, without user info
/// (`nats://user:pass@host` → `nats://<redacted>@host`): what logs and printed
/// configurations show.
pub fn redact_url(urls: &str) -> String {
    urls.split(',')
        .map(|u| redact_one(u.trim()))
        .collect::<Vec<_>>()
        .join(",")
}

pub(super) fn redact_one(url: &str) -> String {
    let (scheme, rest) = match url.find("://") {
        Some(i) => url.split_at(i + 3),
        None => ("", url),
    };
    let host_end = rest.find('/').unwrap_or(rest.len());
    match rest[..host_end].rfind('@') {
        Some(at) => format!("{scheme}<redacted>{}", &rest[at..]),
        None => url.to_string(),
    }
}

/// The user and password inside the URLs (`nats://user:password@host`), percent-decoded,
/// and the URLs without them: async-nats does not authenticate with them itself. `None`
/// when no URL carries a user; an error when two URLs carry different ones.
pub(super) fn url_credentials(urls: &str) -> Result<(Option<(String, String)>, String), String> {
    let mut found: Option<(String, String)> = None;
    let mut stripped = Vec::new();
    for url in urls.split(',').map(str::trim).filter(|u| !u.is_empty()) {
        let (scheme, rest) = match url.find("://") {
            Some(i) => url.split_at(i + 3),
            None => ("", url),
        };
        let host_end = rest.find('/').unwrap_or(rest.len());
        let Some(at) = rest[..host_end].rfind('@') else {
            stripped.push(url.to_string());
            continue;
        };
        let info = &rest[..at];
        let (user, password) = info.split_once(':').unwrap_or((info, ""));
        // What a URL's user info escapes (`@`, `:`, `/`), decoded; a malformed escape is an
        // error, not a password silently different from the one written.
        let decoded = |part: &str, what: &str| {
            forkfleet_shared::percent::decode(part).ok_or_else(|| {
                format!(
                    "the NATS URL {} has a malformed %-escape in its {what} (write `%` as %25)",
                    redact_one(url)
                )
            })
        };
        let creds = (decoded(user, "user")?, decoded(password, "password")?);
        if creds.0.is_empty() {
            return Err(format!(
                "the NATS URL {} has a password but no user",
                redact_one(url)
            ));
        }
        match &found {
            Some(f) if *f != creds => {
                return Err("the NATS URLs carry different users or passwords; give one user for every URL (or none, and nats.user)".into())
            }
            _ => found = Some(creds),
        }
        stripped.push(format!("{scheme}{}", &rest[at + 1..]));
    }
    Ok((found, stripped.join(",")))
}
