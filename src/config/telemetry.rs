//! `[telemetry]`: log format, OTLP export (traces; metrics for the metrics bridge), the
//! resource, the sampler and message-content capture. The OpenTelemetry variables
//! (`OTEL_EXPORTER_OTLP_*`, `OTEL_SERVICE_NAME`, ...) are this table's environment layer;
//! `FORKFLEET_LOG_FORMAT` and `--log-format` set the log format. See
//! `docs/OBSERVABILITY.md`, "Configuration".
//!
//! ```toml
//! [telemetry]
//! log_format = "json"                          # or "text" (the default)
//! otlp_endpoint = "http://collector:4318"      # traces go to <endpoint>/v1/traces over HTTP
//! otlp_traces_endpoint = "http://tempo:4318/v1/traces"   # used as is; wins over otlp_endpoint
//! otlp_protocol = "http/protobuf"              # or "grpc"
//! otlp_headers = { "x-honeycomb-team" = "..." } # secret: --print-config shows <redacted>
//! service_name = "forkfleet-coordinator"
//! resource_attributes = { "deployment.environment" = "prod" }
//! sampler = "parentbased_traceidratio"
//! sampler_arg = 0.25
//! disabled = false
//! capture_message_content = false
//! metrics_interval_s = 60
//! ```

use super::{Config, ConfigError, Layer, Origin, Secret, Sourced, SourcedLayer};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The default OTLP metric export period (the OpenTelemetry default).
pub const DEFAULT_METRICS_INTERVAL: Duration = Duration::from_secs(60);

/// `[telemetry]` as one layer writes it: every key optional.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TelemetryLayer {
    pub log_format: Option<String>,
    pub otlp_endpoint: Option<String>,
    pub otlp_traces_endpoint: Option<String>,
    pub otlp_metrics_endpoint: Option<String>,
    pub otlp_protocol: Option<String>,
    /// Headers of every export request (an API key): secrets.
    pub otlp_headers: Option<BTreeMap<String, Secret>>,
    pub service_name: Option<String>,
    pub resource_attributes: Option<BTreeMap<String, String>>,
    pub sampler: Option<String>,
    /// A file may give the ratio as a number or a string; the environment as a string.
    pub sampler_arg: Option<SamplerArg>,
    pub disabled: Option<bool>,
    pub capture_message_content: Option<bool>,
    pub metrics_interval_s: Option<u64>,
    /// `otlp` (push the metrics when an endpoint is set), or `none`/`prometheus` (never:
    /// they are scraped from `/metrics`).
    pub metrics_exporter: Option<String>,
    /// PEM: the CA that signed the collector's certificate (trusted besides the system's).
    pub otlp_certificate: Option<PathBuf>,
    /// PEM: a client certificate and its key, for a collector that asks for one.
    pub otlp_client_certificate: Option<PathBuf>,
    pub otlp_client_key: Option<PathBuf>,
}

/// `sampler_arg` as written: a number, or text to parse.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(untagged)]
pub enum SamplerArg {
    Number(f64),
    Text(String),
}

/// How log lines are written on stderr.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogFormat {
    /// Human-readable lines (the default).
    #[default]
    Text,
    /// One JSON object per line, with the current `trace_id` and `span_id`.
    Json,
}

impl LogFormat {
    /// `text` or `json`.
    pub fn parse(s: &str) -> Option<LogFormat> {
        match s.trim().to_ascii_lowercase().as_str() {
            "text" => Some(LogFormat::Text),
            "json" => Some(LogFormat::Json),
            _ => None,
        }
    }
}

impl fmt::Display for LogFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LogFormat::Text => "text",
            LogFormat::Json => "json",
        })
    }
}

/// The OTLP transport.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OtlpProtocol {
    /// OTLP over HTTP, protobuf bodies (port 4318; the default, as in the specification).
    #[default]
    HttpProtobuf,
    /// OTLP over gRPC (port 4317).
    Grpc,
}

impl fmt::Display for OtlpProtocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            OtlpProtocol::HttpProtobuf => "http/protobuf",
            OtlpProtocol::Grpc => "grpc",
        })
    }
}

/// The trace sampler (`OTEL_TRACES_SAMPLER`, with its ratio from `OTEL_TRACES_SAMPLER_ARG`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SamplerSetting {
    AlwaysOn,
    AlwaysOff,
    /// Sample this fraction of traces, by trace id.
    TraceIdRatio(f64),
    /// Follow a parent's decision; for a root span, the inner sampler's.
    ParentBased(RootSampler),
}

/// A parent-based sampler's decision for root spans.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RootSampler {
    AlwaysOn,
    AlwaysOff,
    TraceIdRatio(f64),
}

impl SamplerSetting {
    /// The sampler `name` with the ratio `arg` (for the ratio samplers; default 1.0).
    fn parse(name: &str, arg: Option<f64>) -> Option<SamplerSetting> {
        let ratio = arg.unwrap_or(1.0);
        Some(match name.trim().to_ascii_lowercase().as_str() {
            "always_on" => SamplerSetting::AlwaysOn,
            "always_off" => SamplerSetting::AlwaysOff,
            "traceidratio" => SamplerSetting::TraceIdRatio(ratio),
            "parentbased_always_on" => SamplerSetting::ParentBased(RootSampler::AlwaysOn),
            "parentbased_always_off" => SamplerSetting::ParentBased(RootSampler::AlwaysOff),
            "parentbased_traceidratio" => {
                SamplerSetting::ParentBased(RootSampler::TraceIdRatio(ratio))
            }
            _ => return None,
        })
    }
}

impl fmt::Display for SamplerSetting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SamplerSetting::AlwaysOn => f.write_str("always_on"),
            SamplerSetting::AlwaysOff => f.write_str("always_off"),
            SamplerSetting::TraceIdRatio(r) => write!(f, "traceidratio {r}"),
            SamplerSetting::ParentBased(RootSampler::AlwaysOn) => {
                f.write_str("parentbased_always_on")
            }
            SamplerSetting::ParentBased(RootSampler::AlwaysOff) => {
                f.write_str("parentbased_always_off")
            }
            SamplerSetting::ParentBased(RootSampler::TraceIdRatio(r)) => {
                write!(f, "parentbased_traceidratio {r}")
            }
        }
    }
}

/// The effective telemetry settings (`config.telemetry`).
#[derive(Debug, Clone, PartialEq)]
pub struct TelemetrySettings {
    pub log_format: Sourced<LogFormat>,
    /// The base endpoint of every signal (`OTEL_EXPORTER_OTLP_ENDPOINT`).
    pub otlp_endpoint: Option<Sourced<String>>,
    /// The traces endpoint, used as is (`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`).
    pub otlp_traces_endpoint: Option<Sourced<String>>,
    /// The metrics endpoint, used as is (`OTEL_EXPORTER_OTLP_METRICS_ENDPOINT`).
    pub otlp_metrics_endpoint: Option<Sourced<String>>,
    pub otlp_protocol: Sourced<OtlpProtocol>,
    /// Export request headers; a higher layer's header replaces a lower one's of the same
    /// name. Never shown.
    pub otlp_headers: BTreeMap<String, Sourced<Secret>>,
    /// `service.name`; unset: the process's default (`forkfleet-coordinator`, ...).
    pub service_name: Option<Sourced<String>>,
    /// Extra resource attributes; a higher layer's key replaces a lower one's.
    pub resource_attributes: BTreeMap<String, Sourced<String>>,
    pub sampler: Sourced<SamplerSetting>,
    /// `OTEL_SDK_DISABLED`: no export whatever the endpoints say.
    pub disabled: Sourced<bool>,
    /// Record prompt and completion text on model spans.
    pub capture_message_content: Sourced<bool>,
    /// The OTLP metric export period.
    pub metrics_interval: Sourced<Duration>,
    /// Push the metrics over OTLP when an endpoint is set (`OTEL_METRICS_EXPORTER=otlp`,
    /// the default); false for `none` or `prometheus` (scraped from `/metrics` only).
    pub metrics_push: Sourced<bool>,
    /// A CA to trust for the collector's certificate (`OTEL_EXPORTER_OTLP_CERTIFICATE`).
    pub otlp_certificate: Option<Sourced<PathBuf>>,
    /// A client certificate and its key (`OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE`, `_KEY`).
    pub otlp_client_certificate: Option<Sourced<PathBuf>>,
    pub otlp_client_key: Option<Sourced<PathBuf>>,
}

impl Default for TelemetrySettings {
    fn default() -> Self {
        TelemetrySettings {
            log_format: super::default(LogFormat::Text),
            otlp_endpoint: None,
            otlp_traces_endpoint: None,
            otlp_metrics_endpoint: None,
            otlp_protocol: super::default(OtlpProtocol::HttpProtobuf),
            otlp_headers: BTreeMap::new(),
            service_name: None,
            resource_attributes: BTreeMap::new(),
            sampler: super::default(SamplerSetting::ParentBased(RootSampler::AlwaysOn)),
            disabled: super::default(false),
            capture_message_content: super::default(false),
            metrics_interval: super::default(DEFAULT_METRICS_INTERVAL),
            metrics_push: super::default(true),
            otlp_certificate: None,
            otlp_client_certificate: None,
            otlp_client_key: None,
        }
    }
}

impl TelemetrySettings {
    /// Where traces are exported, or `None` when export is off (no endpoint configured, or
    /// `disabled`). Over HTTP the base endpoint gets `/v1/traces`; the traces endpoint and
    /// any gRPC endpoint are used as they are.
    pub fn traces_endpoint(&self) -> Option<String> {
        self.signal_endpoint(&self.otlp_traces_endpoint, "v1/traces")
    }

    /// Where metrics are exported, or `None` when export is off (as
    /// [`TelemetrySettings::traces_endpoint`], with `/v1/metrics`).
    pub fn metrics_endpoint(&self) -> Option<String> {
        if !self.metrics_push.value {
            return None;
        }
        self.signal_endpoint(&self.otlp_metrics_endpoint, "v1/metrics")
    }

    fn signal_endpoint(&self, specific: &Option<Sourced<String>>, path: &str) -> Option<String> {
        if self.disabled.value {
            return None;
        }
        if let Some(e) = specific {
            return Some(e.value.clone());
        }
        let base = &self.otlp_endpoint.as_ref()?.value;
        Some(match self.otlp_protocol.value {
            OtlpProtocol::Grpc => base.clone(),
            OtlpProtocol::HttpProtobuf => format!("{}/{path}", base.trim_end_matches('/')),
        })
    }

    /// `service.name`: the configured one, else `default`.
    pub fn service_name_or(&self, default: &str) -> String {
        self.service_name
            .as_ref()
            .map_or_else(|| default.to_string(), |s| s.value.clone())
    }

    /// Merge the layers' `[telemetry]` tables, lowest first, onto the defaults; check them.
    pub(super) fn merge(layers: &[SourcedLayer]) -> Result<TelemetrySettings, ConfigError> {
        let mut t = TelemetrySettings::default();
        let mut sampler: Option<Sourced<String>> = None;
        let mut sampler_arg: Option<Sourced<SamplerArg>> = None;
        for SourcedLayer { layer, origin } in layers {
            let l = &layer.telemetry;
            fn at<T>(
                value: T,
                origin: &dyn Fn(&'static str) -> Origin,
                key: &'static str,
            ) -> Sourced<T> {
                Sourced {
                    value,
                    origin: origin(key),
                }
            }
            let origin = origin.as_ref();
            let sourced = |value, key| at(value, origin, key);
            if let Some(v) = &l.log_format {
                let from = origin("telemetry.log_format");
                let format = LogFormat::parse(v).ok_or_else(|| ConfigError::Invalid {
                    key: "telemetry.log_format",
                    expected: "text or json",
                    value: format!("`{v}` (from {from})"),
                })?;
                t.log_format = Sourced {
                    value: format,
                    origin: from,
                };
            }
            for (slot, v, key) in [
                (
                    &mut t.otlp_endpoint,
                    &l.otlp_endpoint,
                    "telemetry.otlp_endpoint",
                ),
                (
                    &mut t.otlp_traces_endpoint,
                    &l.otlp_traces_endpoint,
                    "telemetry.otlp_traces_endpoint",
                ),
                (
                    &mut t.otlp_metrics_endpoint,
                    &l.otlp_metrics_endpoint,
                    "telemetry.otlp_metrics_endpoint",
                ),
            ] {
                if let Some(v) = v {
                    let from = origin(key);
                    check_endpoint(key, v, &from)?;
                    *slot = Some(Sourced {
                        value: v.trim().to_string(),
                        origin: from,
                    });
                }
            }
            if let Some(v) = &l.otlp_protocol {
                let from = origin("telemetry.otlp_protocol");
                let protocol = match v.trim().to_ascii_lowercase().as_str() {
                    "grpc" => OtlpProtocol::Grpc,
                    "http/protobuf" => OtlpProtocol::HttpProtobuf,
                    _ => {
                        return Err(ConfigError::Invalid {
                            key: "telemetry.otlp_protocol",
                            expected: "grpc or http/protobuf (http/json is not supported)",
                            value: format!("`{v}` (from {from})"),
                        })
                    }
                };
                t.otlp_protocol = Sourced {
                    value: protocol,
                    origin: from,
                };
            }
            for (value, setting, key) in [
                (
                    &l.otlp_certificate,
                    &mut t.otlp_certificate,
                    "telemetry.otlp_certificate",
                ),
                (
                    &l.otlp_client_certificate,
                    &mut t.otlp_client_certificate,
                    "telemetry.otlp_client_certificate",
                ),
                (
                    &l.otlp_client_key,
                    &mut t.otlp_client_key,
                    "telemetry.otlp_client_key",
                ),
            ] {
                if let Some(path) = value {
                    *setting = Some(at(path.clone(), origin, key));
                }
            }
            if let Some(v) = &l.metrics_exporter {
                let from = origin("telemetry.metrics_exporter");
                // A list, as the specification allows (`otlp,prometheus`): push when it
                // names otlp; `/metrics` serves the registry either way.
                let mut push = false;
                for name in v.split(',').map(|n| n.trim().to_ascii_lowercase()) {
                    match name.as_str() {
                        "otlp" => push = true,
                        "none" | "prometheus" | "console" => {}
                        _ => {
                            return Err(ConfigError::Invalid {
                                key: "telemetry.metrics_exporter",
                                expected: "otlp (push when an endpoint is set), none, prometheus or console (not pushed: scraped from /metrics), or a list of them",
                                value: format!("`{v}` (from {from})"),
                            })
                        }
                    }
                }
                t.metrics_push = Sourced {
                    value: push,
                    origin: from,
                };
            }
            if let Some(headers) = &l.otlp_headers {
                for (name, value) in headers {
                    let from = origin("telemetry.otlp_headers");
                    check_header(name, value, &from)?;
                    t.otlp_headers.insert(
                        name.to_ascii_lowercase(),
                        Sourced {
                            value: value.clone(),
                            origin: from,
                        },
                    );
                }
            }
            if let Some(v) = &l.service_name {
                if !v.trim().is_empty() {
                    t.service_name = Some(sourced(v.trim().to_string(), "telemetry.service_name"));
                }
            }
            if let Some(attrs) = &l.resource_attributes {
                for (k, v) in attrs {
                    let from = origin("telemetry.resource_attributes");
                    if k.trim().is_empty() {
                        return Err(ConfigError::Invalid {
                            key: "telemetry.resource_attributes",
                            expected: "key=value pairs with non-empty keys",
                            value: format!("an empty key (from {from})"),
                        });
                    }
                    t.resource_attributes.insert(
                        k.trim().to_string(),
                        Sourced {
                            value: v.clone(),
                            origin: from,
                        },
                    );
                }
            }
            if let Some(v) = &l.sampler {
                sampler = Some(sourced(v.clone(), "telemetry.sampler"));
            }
            if let Some(v) = &l.sampler_arg {
                sampler_arg = Some(at(v.clone(), origin, "telemetry.sampler_arg"));
            }
            if let Some(v) = l.disabled {
                t.disabled = at(v, origin, "telemetry.disabled");
            }
            if let Some(v) = l.capture_message_content {
                t.capture_message_content = at(v, origin, "telemetry.capture_message_content");
            }
            if let Some(v) = l.metrics_interval_s {
                let from = origin("telemetry.metrics_interval_s");
                if v == 0 {
                    return Err(ConfigError::Invalid {
                        key: "telemetry.metrics_interval_s",
                        expected: "at least 1 second",
                        value: format!("0 (from {from})"),
                    });
                }
                t.metrics_interval = Sourced {
                    value: Duration::from_secs(v),
                    origin: from,
                };
            }
        }
        let ratio = match &sampler_arg {
            None => None,
            Some(arg) => Some(ratio_of(arg)?),
        };
        if let Some(name) = sampler {
            let setting = SamplerSetting::parse(&name.value, ratio).ok_or_else(|| {
                ConfigError::Invalid {
                    key: "telemetry.sampler",
                    expected: "one of always_on, always_off, traceidratio, parentbased_always_on, parentbased_always_off, parentbased_traceidratio",
                    value: format!("`{}` (from {})", name.value, name.origin),
                }
            })?;
            t.sampler = Sourced {
                value: setting,
                origin: name.origin,
            };
        }
        // A client certificate goes with its key.
        match (&t.otlp_client_certificate, &t.otlp_client_key) {
            (Some(c), None) => {
                return Err(ConfigError::Invalid {
                    key: "telemetry.otlp_client_key",
                    expected: "the client certificate's key too (OTEL_EXPORTER_OTLP_CLIENT_KEY)",
                    value: format!("a client certificate from {} and no key", c.origin),
                })
            }
            (None, Some(k)) => {
                return Err(ConfigError::Invalid {
                    key: "telemetry.otlp_client_certificate",
                    expected: "the key's certificate too (OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE)",
                    value: format!("a client key from {} and no certificate", k.origin),
                })
            }
            _ => {}
        }
        Ok(t)
    }
}

/// A sampler ratio: a number from 0 to 1.
fn ratio_of(arg: &Sourced<SamplerArg>) -> Result<f64, ConfigError> {
    let value = match &arg.value {
        SamplerArg::Number(n) => Some(*n),
        SamplerArg::Text(s) => s.trim().parse::<f64>().ok(),
    };
    match value {
        Some(r) if (0.0..=1.0).contains(&r) => Ok(r),
        _ => Err(ConfigError::Invalid {
            key: "telemetry.sampler_arg",
            expected: "a ratio from 0 to 1, e.g. 0.25",
            value: format!(
                "`{}` (from {})",
                match &arg.value {
                    SamplerArg::Number(n) => n.to_string(),
                    SamplerArg::Text(s) => s.clone(),
                },
                arg.origin
            ),
        }),
    }
}

/// An endpoint: an `http://` or `https://` URL.
fn check_endpoint(key: &'static str, v: &str, from: &Origin) -> Result<(), ConfigError> {
    let v = v.trim();
    let rest = v
        .strip_prefix("http://")
        .or_else(|| v.strip_prefix("https://"));
    match rest {
        Some(host) if !host.is_empty() && !host.starts_with('/') => Ok(()),
        _ => Err(ConfigError::Invalid {
            key,
            expected: "an http:// or https:// URL, e.g. http://localhost:4318 (HTTP) or http://localhost:4317 (gRPC)",
            value: format!("`{v}` (from {from})"),
        }),
    }
}

/// A header: a token name and a value of visible characters (the value is never shown).
fn check_header(name: &str, value: &Secret, from: &Origin) -> Result<(), ConfigError> {
    let name_ok = !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b));
    if !name_ok {
        return Err(ConfigError::Invalid {
            key: "telemetry.otlp_headers",
            expected: "header names of letters, digits and !#$%&'*+-.^_`|~",
            value: format!("`{name}` (from {from})"),
        });
    }
    if value.expose().bytes().any(|b| b < 0x20 || b == 0x7f) {
        return Err(ConfigError::Invalid {
            key: "telemetry.otlp_headers",
            expected: "header values without control characters",
            value: format!("the value of `{name}` (from {from})"),
        });
    }
    Ok(())
}

/// The environment variable of a `[telemetry]` key: the OpenTelemetry one, or
/// `FORKFLEET_LOG_FORMAT`.
pub fn env_var(key: &str) -> Option<&'static str> {
    Some(match key {
        "telemetry.log_format" => "FORKFLEET_LOG_FORMAT",
        "telemetry.otlp_endpoint" => "OTEL_EXPORTER_OTLP_ENDPOINT",
        "telemetry.otlp_traces_endpoint" => "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "telemetry.otlp_metrics_endpoint" => "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
        "telemetry.otlp_protocol" => "OTEL_EXPORTER_OTLP_PROTOCOL",
        "telemetry.otlp_headers" => "OTEL_EXPORTER_OTLP_HEADERS",
        "telemetry.service_name" => "OTEL_SERVICE_NAME",
        "telemetry.resource_attributes" => "OTEL_RESOURCE_ATTRIBUTES",
        "telemetry.sampler" => "OTEL_TRACES_SAMPLER",
        "telemetry.sampler_arg" => "OTEL_TRACES_SAMPLER_ARG",
        "telemetry.disabled" => "OTEL_SDK_DISABLED",
        "telemetry.capture_message_content" => "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT",
        "telemetry.metrics_interval_s" => "OTEL_METRIC_EXPORT_INTERVAL",
        "telemetry.metrics_exporter" => "OTEL_METRICS_EXPORTER",
        "telemetry.otlp_certificate" => "OTEL_EXPORTER_OTLP_CERTIFICATE",
        "telemetry.otlp_client_certificate" => "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE",
        "telemetry.otlp_client_key" => "OTEL_EXPORTER_OTLP_CLIENT_KEY",
        _ => return None,
    })
}

/// The environment layer of `[telemetry]`: the OpenTelemetry variables (an empty one is
/// unset) and `FORKFLEET_LOG_FORMAT`.
pub(super) fn env_layer(
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<TelemetryLayer, ConfigError> {
    let get = |key: &str| env_var(key).and_then(env).filter(|v| !v.trim().is_empty());
    let bad = |key: &str, message: String| ConfigError::Env {
        var: env_var(key).unwrap_or("?").to_string(),
        message,
    };
    let boolean = |key: &str| -> Result<Option<bool>, ConfigError> {
        match get(key) {
            None => Ok(None),
            Some(v) => super::layer::env_bool(&v)
                .map(Some)
                .ok_or_else(|| bad(key, format!("expected true or false, got `{v}`"))),
        }
    };
    let headers = match get("telemetry.otlp_headers") {
        None => None,
        Some(v) => Some(
            parse_pairs(&v)
                .map_err(|m| {
                    bad(
                        "telemetry.otlp_headers",
                        format!("{m}; expected name=value pairs separated by commas, e.g. `x-api-key=KEY,x-team=a` (values percent-encoded)"),
                    )
                })?
                .into_iter()
                .map(|(k, v)| (k, Secret(v)))
                .collect(),
        ),
    };
    let resource_attributes = match get("telemetry.resource_attributes") {
        None => None,
        Some(v) => Some(parse_pairs(&v).map_err(|m| {
            bad(
                "telemetry.resource_attributes",
                format!("{m}; expected key=value pairs separated by commas, e.g. `deployment.environment=prod,team=a` (values percent-encoded)"),
            )
        })?),
    };
    let metrics_interval_s = match get("telemetry.metrics_interval_s") {
        None => None,
        Some(v) => {
            let ms = v.trim().parse::<u64>().map_err(|_| {
                bad(
                    "telemetry.metrics_interval_s",
                    format!("expected a number of milliseconds, got `{v}`"),
                )
            })?;
            Some(ms.div_ceil(1000))
        }
    };
    Ok(TelemetryLayer {
        log_format: get("telemetry.log_format"),
        otlp_endpoint: get("telemetry.otlp_endpoint"),
        otlp_traces_endpoint: get("telemetry.otlp_traces_endpoint"),
        otlp_metrics_endpoint: get("telemetry.otlp_metrics_endpoint"),
        otlp_protocol: get("telemetry.otlp_protocol"),
        otlp_headers: headers,
        service_name: get("telemetry.service_name"),
        resource_attributes,
        sampler: get("telemetry.sampler"),
        sampler_arg: get("telemetry.sampler_arg").map(SamplerArg::Text),
        disabled: boolean("telemetry.disabled")?,
        capture_message_content: boolean("telemetry.capture_message_content")?,
        metrics_interval_s,
        metrics_exporter: get("telemetry.metrics_exporter"),
        otlp_certificate: get("telemetry.otlp_certificate").map(PathBuf::from),
        otlp_client_certificate: get("telemetry.otlp_client_certificate").map(PathBuf::from),
        otlp_client_key: get("telemetry.otlp_client_key").map(PathBuf::from),
    })
}

/// `k=v,k2=v2` (the W3C baggage-like list the OpenTelemetry variables use), values
/// percent-decoded; an error names the malformed entry (never its value).
fn parse_pairs(text: &str) -> Result<BTreeMap<String, String>, String> {
    let mut out = BTreeMap::new();
    for (i, entry) in text.split(',').enumerate() {
        let entry = entry.trim();
        if entry.is_empty() {
            continue;
        }
        let Some((k, v)) = entry.split_once('=') else {
            return Err(format!("entry {} has no `=`", i + 1));
        };
        let k = k.trim();
        if k.is_empty() {
            return Err(format!("entry {} has an empty name", i + 1));
        }
        let v = forkfleet_shared::percent::decode(v.trim()).ok_or_else(|| {
            format!(
                "the value of `{k}` (entry {}) is not valid percent-encoding",
                i + 1
            )
        })?;
        out.insert(k.to_string(), v);
    }
    Ok(out)
}

impl Config {
    /// The telemetry settings alone, from the file (`file`, else `FORKFLEET_CONFIG`), the
    /// environment and `flags`: what the process needs before its logging starts.
    pub fn load_telemetry(
        file: Option<&Path>,
        env: &dyn Fn(&str) -> Option<String>,
        flags: Layer,
    ) -> Result<TelemetrySettings, ConfigError> {
        let (layers, _) = Self::layers(file, env, flags)?;
        TelemetrySettings::merge(&layers)
    }
}
