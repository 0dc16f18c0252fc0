//! The OTLP span exporter: built from the settings, behind a batch processor, and wrapped
//! so that a failing collector is reported once (and its recovery once), not per batch.

use crate::config::{OtlpProtocol, TelemetrySettings};
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{SpanData, SpanExporter};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// How long the exit flush waits for the collector, at most.
pub const FLUSH_BOUND: Duration = Duration::from_secs(5);

/// How long one export request may take before it fails (the OTLP default is 10 s; the
/// exit flush must fit in [`FLUSH_BOUND`]).
const EXPORT_TIMEOUT: Duration = Duration::from_secs(4);

/// Ended spans the batch processor holds at most; past it, spans are dropped, never
/// waited for. A fan-out of 1,000 branches of 10 tool calls ends 33,000 spans within a
/// second or two: the queue holds half of that (a few MB) while the exporter catches up.
const MAX_QUEUE: usize = 16_384;

/// Spans per export request: fewer, larger requests cost both ends less per span.
const MAX_BATCH: usize = 2_048;

/// How often the batch processor exports what it holds.
const EXPORT_DELAY: Duration = Duration::from_secs(1);

/// Reports the exporter's health on the log: the first failure as a warning, the first
/// success after failures as "recovered", nothing else.
#[derive(Debug, Clone)]
pub(super) struct Reporter {
    /// What is exported: "spans" or "metrics".
    what: &'static str,
    endpoint: Arc<str>,
    failing: Arc<AtomicBool>,
}

impl Reporter {
    /// A reporter of the export of `what` to `endpoint` (shown redacted).
    pub(super) fn new(what: &'static str, endpoint: &str) -> Reporter {
        Reporter {
            what,
            endpoint: forkfleet_bus::nats::redact_url(endpoint).into(),
            failing: Arc::new(AtomicBool::new(false)),
        }
    }

    /// An export failed (`what` says how): a warning unless one is already out.
    pub(super) fn failed(&self, what: &str) {
        if !self.failing.swap(true, Ordering::SeqCst) {
            tracing::warn!(
                otlp.endpoint = %self.endpoint,
                error = %what,
                "telemetry: cannot export {} to the collector; they are dropped until it answers (reported once)",
                self.what
            );
        }
    }

    /// An export succeeded: "recovered" if the last one had failed.
    pub(super) fn succeeded(&self) {
        if self.failing.swap(false, Ordering::SeqCst) {
            tracing::info!(otlp.endpoint = %self.endpoint, "telemetry: the collector takes {} again", self.what);
        }
    }
}

/// An exporter that reports its failures through a [`Reporter`].
#[derive(Debug)]
pub(super) struct Reporting<E> {
    inner: E,
    reporter: Reporter,
}

impl<E: SpanExporter> SpanExporter for Reporting<E> {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let result = self.inner.export(batch).await;
        match &result {
            Ok(()) => self.reporter.succeeded(),
            Err(e) => self.reporter.failed(&e.to_string()),
        }
        result
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &opentelemetry_sdk::Resource) {
        self.inner.set_resource(resource);
    }
}

/// The PEM files of the collector's TLS: a CA to trust besides the system's
/// (`OTEL_EXPORTER_OTLP_CERTIFICATE`), a client certificate and its key.
pub(super) struct OtlpTls {
    ca: Option<Vec<u8>>,
    client: Option<(Vec<u8>, Vec<u8>)>,
}

impl OtlpTls {
    /// Read the files the settings name (an unreadable one is an error naming it).
    pub(super) fn load(settings: &TelemetrySettings) -> Result<OtlpTls, String> {
        let read = |p: &crate::config::Sourced<std::path::PathBuf>, what: &str| {
            std::fs::read(&p.value).map_err(|e| {
                format!(
                    "cannot read the {what} `{}` (from {}): {e}",
                    p.value.display(),
                    p.origin
                )
            })
        };
        let ca = settings
            .otlp_certificate
            .as_ref()
            .map(|p| read(p, "collector's CA certificate"))
            .transpose()?;
        let client = match (&settings.otlp_client_certificate, &settings.otlp_client_key) {
            (Some(c), Some(k)) => Some((read(c, "client certificate")?, read(k, "client key")?)),
            _ => None,
        };
        Ok(OtlpTls { ca, client })
    }

    fn is_default(&self) -> bool {
        self.ca.is_none() && self.client.is_none()
    }

    /// A blocking HTTP client (the span exporter's) with these; `None`: the default one.
    fn blocking_client(&self) -> Result<Option<reqwest::blocking::Client>, String> {
        if self.is_default() {
            return Ok(None);
        }
        let (roots, identity) = self.reqwest_parts()?;
        let mut builder = reqwest::blocking::Client::builder()
            .timeout(EXPORT_TIMEOUT)
            .redirect(reqwest::redirect::Policy::none());
        for cert in roots {
            builder = builder.add_root_certificate(cert);
        }
        if let Some(identity) = identity {
            builder = builder.identity(identity);
        }
        // A blocking client runs a runtime of its own: built (and later dropped) off this
        // thread, which may be inside the process's runtime.
        std::thread::spawn(move || builder.build())
            .join()
            .map_err(|_| "building the HTTP client panicked".to_string())?
            .map(Some)
            .map_err(|e| e.to_string())
    }

    /// The async HTTP client (the metric export's) with these.
    pub(super) fn async_client(&self) -> Result<reqwest::Client, String> {
        let (roots, identity) = self.reqwest_parts()?;
        let mut builder = reqwest::Client::builder()
            .timeout(EXPORT_TIMEOUT)
            .redirect(reqwest::redirect::Policy::none());
        for cert in roots {
            builder = builder.add_root_certificate(cert);
        }
        if let Some(identity) = identity {
            builder = builder.identity(identity);
        }
        builder.build().map_err(|e| e.to_string())
    }

    /// The CA's certificates and the client identity, as reqwest takes them.
    fn reqwest_parts(
        &self,
    ) -> Result<(Vec<reqwest::Certificate>, Option<reqwest::Identity>), String> {
        let roots = match &self.ca {
            Some(ca) => reqwest::Certificate::from_pem_bundle(ca)
                .map_err(|e| format!("the collector's CA certificate is not PEM: {e}"))?,
            None => Vec::new(),
        };
        let identity = match &self.client {
            Some((cert, key)) => {
                let pem = [cert.as_slice(), b"\n", key.as_slice()].concat();
                Some(
                    reqwest::Identity::from_pem(&pem)
                        .map_err(|e| format!("the client certificate and key are not PEM: {e}"))?,
                )
            }
            None => None,
        };
        Ok((roots, identity))
    }

    /// gRPC's TLS settings with these (the system's roots too); `None`: the default ones.
    pub(super) fn tonic(&self) -> Option<tonic::transport::ClientTlsConfig> {
        if self.is_default() {
            return None;
        }
        let mut tls = tonic::transport::ClientTlsConfig::new().with_enabled_roots();
        if let Some(ca) = &self.ca {
            tls = tls.ca_certificate(tonic::transport::Certificate::from_pem(ca));
        }
        if let Some((cert, key)) = &self.client {
            tls = tls.identity(tonic::transport::Identity::from_pem(cert, key));
        }
        Some(tls)
    }
}

/// The exporter to `endpoint` over the configured protocol, with the configured headers
/// and TLS files, wrapped in its [`Reporter`]. gRPC needs the tokio runtime entered.
pub(super) fn build(
    settings: &TelemetrySettings,
    endpoint: &str,
) -> Result<(Reporting<opentelemetry_otlp::SpanExporter>, Reporter), String> {
    use opentelemetry_otlp::{WithExportConfig as _, WithHttpConfig as _, WithTonicConfig as _};
    let headers: std::collections::HashMap<String, String> = settings
        .otlp_headers
        .iter()
        .map(|(k, v)| (k.clone(), v.value.expose().to_string()))
        .collect();
    let tls = OtlpTls::load(settings)?;
    let exporter = match settings.otlp_protocol.value {
        OtlpProtocol::HttpProtobuf => {
            let mut builder = opentelemetry_otlp::SpanExporter::builder()
                .with_http()
                .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
                .with_endpoint(endpoint)
                .with_timeout(EXPORT_TIMEOUT)
                .with_headers(headers);
            if let Some(client) = tls.blocking_client()? {
                builder = builder.with_http_client(client);
            }
            builder.build()
        }
        OtlpProtocol::Grpc => {
            let mut metadata = tonic::metadata::MetadataMap::new();
            for (k, v) in &headers {
                let key = tonic::metadata::MetadataKey::from_bytes(k.as_bytes())
                    .map_err(|_| format!("header `{k}` is not a valid gRPC metadata name"))?;
                let value = v
                    .parse()
                    .map_err(|_| format!("the value of header `{k}` is not valid gRPC metadata"))?;
                metadata.insert(key, value);
            }
            let mut builder = opentelemetry_otlp::SpanExporter::builder()
                .with_tonic()
                .with_protocol(opentelemetry_otlp::Protocol::Grpc)
                .with_endpoint(endpoint)
                .with_timeout(EXPORT_TIMEOUT)
                .with_metadata(metadata);
            if let Some(config) = tls.tonic() {
                builder = builder.with_tls_config(config);
            }
            builder.build()
        }
    }
    .map_err(|e| e.to_string())?;
    let reporter = Reporter::new("spans", endpoint);
    Ok((
        Reporting {
            inner: exporter,
            reporter: reporter.clone(),
        },
        reporter,
    ))
}

/// The batch processor in front of `exporter`: its own thread, a bounded queue.
/// The standard variables, which the SDK reads, win over these defaults.
pub(super) fn batch<E: SpanExporter + 'static>(
    exporter: E,
) -> opentelemetry_sdk::trace::BatchSpanProcessor {
    use opentelemetry_sdk::trace::{BatchConfigBuilder, BatchSpanProcessor};
    let unset = |var: &str| std::env::var_os(var).is_none();
    let mut config = BatchConfigBuilder::default();
    if unset("OTEL_BSP_MAX_QUEUE_SIZE") {
        config = config.with_max_queue_size(MAX_QUEUE);
    }
    if unset("OTEL_BSP_MAX_EXPORT_BATCH_SIZE") {
        config = config.with_max_export_batch_size(MAX_BATCH);
    }
    if unset("OTEL_BSP_SCHEDULE_DELAY") {
        config = config.with_scheduled_delay(EXPORT_DELAY);
    }
    BatchSpanProcessor::builder(exporter)
        .with_batch_config(config.build())
        .build()
}
