//! The effective configuration as TOML for `--print-config`, secrets redacted, each value's
//! origin in a comment.

use super::{Config, Origin};
use std::fmt::Write as _;
use std::path::Path;

// URLs without their user info (every one of a comma-separated list), as `--print-config`
// shows them: the bus's own redaction, so logs and printouts agree.
use forkfleet_bus::nats::redact_url;

impl Config {
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
        self.render_top(&mut out);
        self.render_nats(&mut out);
        self.render_tables(&mut out);
        self.render_models(&mut out);
        self.render_telemetry(&mut out);
        out
    }

    /// The top-level settings: data, pool, concurrency, drain grace, tree cache, HTTP address.
    fn render_top(&self, out: &mut String) {
        line(out, "data", path(&self.data.value), &self.data.origin);
        line(out, "pool", quoted(&self.pool.value), &self.pool.origin);
        line(
            out,
            "concurrency",
            self.concurrency.value.to_string(),
            &self.concurrency.origin,
        );
        line(
            out,
            "drain_grace_s",
            self.drain_grace.value.as_secs().to_string(),
            &self.drain_grace.origin,
        );
        line(
            out,
            "tree_cache_mb",
            self.tree_cache_mb.value.to_string(),
            &self.tree_cache_mb.origin,
        );
        match &self.http_addr.value {
            Some(addr) => line(
                out,
                "http_addr",
                quoted(&addr.to_string()),
                &self.http_addr.origin,
            ),
            None => {
                let _ = writeln!(
                    out,
                    "# http_addr: not set (the services serve no /metrics, /healthz, /readyz)"
                );
            }
        }
    }

    /// `[nats]` and `[nats.tls]`.
    fn render_nats(&self, out: &mut String) {
        let n = &self.nats;
        let _ = writeln!(out, "\n[nats]");
        match &n.url {
            Some(u) => line(out, "url", quoted(&redact_url(&u.value)), &u.origin),
            None => {
                let _ = writeln!(
                    out,
                    "# url: not set (client commands use the embedded store under `data`)"
                );
            }
        }
        for (key, v) in [("name", &n.name), ("user", &n.user)] {
            if let Some(v) = v {
                line(out, key, quoted(&v.value), &v.origin);
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
            line(out, "creds_file", path(&c.value), &c.origin);
        }
        line(
            out,
            "ack_wait_s",
            n.ack_wait.value.as_secs().to_string(),
            &n.ack_wait.origin,
        );
        line(
            out,
            "max_deliver",
            n.max_deliver.value.to_string(),
            &n.max_deliver.origin,
        );
        line(
            out,
            "replicas",
            n.replicas.value.to_string(),
            &n.replicas.origin,
        );
        if let Some(id) = &n.identity {
            line(out, "identity", quoted(&id.value), &id.origin);
        }
        line(
            out,
            "provision",
            match n.provision.origin {
                super::Origin::Default => {
                    "true # client commands: false, they bind to the coordinator's".to_string()
                }
                _ => n.provision.value.to_string(),
            },
            &n.provision.origin,
        );
        line(
            out,
            "connect_timeout_s",
            n.connect_timeout.value.as_secs().to_string(),
            &n.connect_timeout.origin,
        );
        for (key, v) in [
            ("blob_store_mb", &n.blob_store_mb),
            ("stream_mb", &n.stream_mb),
        ] {
            line(out, key, v.value.to_string(), &v.origin);
        }
        let _ = writeln!(out, "\n[nats.tls]");
        for (key, v) in [
            ("ca_file", &n.tls_ca_file),
            ("cert_file", &n.tls_cert_file),
            ("key_file", &n.tls_key_file),
        ] {
            if let Some(v) = v {
                line(out, key, path(&v.value), &v.origin);
            }
        }
        line(
            out,
            "require",
            n.tls_require.value.to_string(),
            &n.tls_require.origin,
        );
    }

    /// `[coordinator]`, then `[pricing.*]`, `[access.*]` and `[http.tokens.*]`.
    fn render_tables(&self, out: &mut String) {
        let _ = writeln!(out, "\n[coordinator]");
        line(
            out,
            "lease_ttl_s",
            self.lease_ttl.value.as_secs().to_string(),
            &self.lease_ttl.origin,
        );
        line(
            out,
            "blob_quota_mb",
            self.blob_quota_mb.value.to_string(),
            &self.blob_quota_mb.origin,
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
        for (identity, accounts) in &self.access {
            let _ = writeln!(out, "\n[access.{}]", quoted(identity));
            let list: Vec<String> = accounts.iter().map(|a| quoted(a)).collect();
            let _ = writeln!(out, "accounts = [{}]", list.join(", "));
        }
        for (name, t) in &self.http_tokens {
            let _ = writeln!(out, "\n[http.tokens.{}]", quoted(name));
            let _ = writeln!(out, "sha256 = {}", quoted(&hex::encode(t.sha256)));
            let scopes: Vec<String> = t.scopes.iter().map(|s| quoted(s.as_str())).collect();
            let _ = writeln!(out, "scopes = [{}]", scopes.join(", "));
            if let Some(accounts) = &t.accounts {
                let list: Vec<String> = accounts.iter().map(|a| quoted(a)).collect();
                let _ = writeln!(out, "accounts = [{}]", list.join(", "));
            }
        }
    }

    /// `[models.*]` and `[model_hosts]`.
    fn render_models(&self, out: &mut String) {
        // The catalogue shows where keys are (a variable's name, a file's path), never a key.
        for (model, m) in &self.models {
            let origin = self
                .models_origins
                .get(model)
                .cloned()
                .unwrap_or(Origin::Default);
            let _ = writeln!(out, "\n[models.{}]  # {origin}", quoted(model));
            if let Some(u) = &m.base_url {
                let _ = writeln!(out, "base_url = {}", quoted(u));
            }
            if let Some(v) = &m.api_key_env {
                let _ = writeln!(
                    out,
                    "api_key_env = {}  # the key's source, not its value",
                    quoted(v)
                );
            }
            if let Some(f) = &m.api_key_file {
                let _ = writeln!(
                    out,
                    "api_key_file = {}  # the key's source, not its value",
                    path(f)
                );
            }
            if let Some(id) = &m.model {
                let _ = writeln!(out, "model = {}", quoted(id));
            }
            if let Some(t) = m.timeout_s {
                let _ = writeln!(out, "timeout_s = {t:?}");
            }
            if let Some(r) = m.max_retries {
                let _ = writeln!(out, "max_retries = {r}");
            }
        }
        let hosts: Vec<String> = self.model_hosts.value.iter().map(|h| quoted(h)).collect();
        let _ = writeln!(out, "\n[model_hosts]");
        line(
            out,
            "allow",
            format!("[{}]", hosts.join(", ")),
            &self.model_hosts.origin,
        );
    }

    /// `[telemetry]`.
    fn render_telemetry(&self, out: &mut String) {
        let t = &self.telemetry;
        let _ = writeln!(out, "\n[telemetry]");
        line(
            out,
            "log_format",
            quoted(&t.log_format.value.to_string()),
            &t.log_format.origin,
        );
        for (key, v) in [
            ("otlp_endpoint", &t.otlp_endpoint),
            ("otlp_traces_endpoint", &t.otlp_traces_endpoint),
            ("otlp_metrics_endpoint", &t.otlp_metrics_endpoint),
        ] {
            if let Some(v) = v {
                line(out, key, quoted(&redact_url(&v.value)), &v.origin);
            }
        }
        match t.traces_endpoint() {
            Some(e) => {
                let _ = writeln!(out, "# traces are exported to {}", redact_url(&e));
            }
            None if t.disabled.value => {
                let _ = writeln!(out, "# export is off: disabled");
            }
            None => {
                let _ = writeln!(out, "# export is off: no OTLP endpoint is set");
            }
        }
        line(
            out,
            "otlp_protocol",
            quoted(&t.otlp_protocol.value.to_string()),
            &t.otlp_protocol.origin,
        );
        if !t.otlp_headers.is_empty() {
            // Header values are secrets (API keys): names and origins only.
            let _ = writeln!(out, "# otlp_headers: values redacted");
            let _ = writeln!(out, "otlp_headers = {{ {} }}", {
                let entries: Vec<String> = t
                    .otlp_headers
                    .keys()
                    .map(|k| format!("{} = \"<redacted>\"", quoted(k)))
                    .collect();
                entries.join(", ")
            });
            for (k, v) in &t.otlp_headers {
                let _ = writeln!(out, "#   {k}: {}", v.origin);
            }
        }
        if let Some(s) = &t.service_name {
            line(out, "service_name", quoted(&s.value), &s.origin);
        }
        if !t.resource_attributes.is_empty() {
            let entries: Vec<String> = t
                .resource_attributes
                .iter()
                .map(|(k, v)| format!("{} = {}", quoted(k), quoted(&v.value)))
                .collect();
            let _ = writeln!(out, "resource_attributes = {{ {} }}", entries.join(", "));
            for (k, v) in &t.resource_attributes {
                let _ = writeln!(out, "#   {k}: {}", v.origin);
            }
        }
        line(
            out,
            "sampler",
            quoted(&t.sampler.value.to_string()),
            &t.sampler.origin,
        );
        line(
            out,
            "disabled",
            t.disabled.value.to_string(),
            &t.disabled.origin,
        );
        line(
            out,
            "capture_message_content",
            t.capture_message_content.value.to_string(),
            &t.capture_message_content.origin,
        );
        line(
            out,
            "metrics_interval_s",
            t.metrics_interval.value.as_secs().to_string(),
            &t.metrics_interval.origin,
        );
    }
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
