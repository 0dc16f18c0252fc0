//! Every write through the HTTP API, recorded: one JSON line per request (when, who, which
//! operation on what, the answer's status) appended to the audit log, and a log line.

use super::auth::Principal;
use std::path::PathBuf;
use tokio::io::AsyncWriteExt;
use tokio::sync::Mutex;

pub struct Audit {
    file: Option<PathBuf>,
    lock: Mutex<()>,
}

impl Audit {
    /// Appending to `file` (none: log lines only).
    pub fn new(file: Option<PathBuf>) -> Self {
        Self {
            file,
            lock: Mutex::new(()),
        }
    }

    /// Record a write: operation `op` (a declared one's name, or a route of its own such as
    /// `put_blob`), its `method` and declared `path`, the path's values, the answer's status.
    pub async fn record(
        &self,
        who: &Principal,
        (op, method, path): (&str, &str, &str),
        params: &[String],
        status: axum::http::StatusCode,
    ) {
        let line = serde_json::json!({
            "at_ms": forkfleet_shared::protocol::now_ms(),
            "who": who.name,
            "op": op,
            "method": method,
            "path": path,
            "params": params,
            "status": status.as_u16(),
        });
        tracing::info!(audit.who = %who.name, audit.op = op, audit.status = status.as_u16(), "http.write");
        let Some(file) = &self.file else { return };
        let _held = self.lock.lock().await;
        let written = async {
            if let Some(dir) = file.parent() {
                tokio::fs::create_dir_all(dir).await?;
            }
            let mut f = tokio::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(file)
                .await?;
            f.write_all(format!("{line}\n").as_bytes()).await?;
            f.flush().await
        };
        if let Err(e) = written.await {
            tracing::error!(audit.file = %file.display(), error = %e, "the audit log could not be written");
        }
    }
}
