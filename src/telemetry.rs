//! The process's telemetry: log lines (text or JSON), trace context, and OTLP export of
//! traces.
//!
//! [`init`] installs the subscriber and returns a [`Telemetry`] guard; every command and
//! service calls [`Telemetry::shutdown`] before the process exits, which flushes the spans
//! still buffered (within [`FLUSH_BOUND`]). Layout: `export` builds the OTLP exporter and
//! reports a failing collector once; `json` the JSON log lines; `metrics` the OTLP export
//! of the metric registry; `process` what every service serves from its start (build
//! info, the process metrics from `/proc`, counters at zero).

mod export;
mod json;
pub mod metrics;
pub mod process;

use crate::config::{LogFormat, RootSampler, SamplerSetting, TelemetrySettings};

pub use export::FLUSH_BOUND;

/// Colour codes on stderr only when it is a terminal and `NO_COLOR` is unset or empty
/// (<https://no-color.org>): a log file or a pipe gets plain text.
pub fn colour_on_stderr() -> bool {
    use std::io::IsTerminal as _;
    std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}

/// Let a closed standard output end the process quietly, as a Unix filter does
/// (`forkfleet log RUN | head`): the default action of `SIGPIPE`, which Rust's runtime
/// ignores so that `println!` panics on a broken pipe instead. For the commands that
/// print; the long-running services keep ignoring it (their sockets never raise it: the
/// standard library sends with `MSG_NOSIGNAL`).
pub fn exit_quietly_on_broken_pipe() {
    #[cfg(unix)]
    // SAFETY: called at start-up before any thread is spawned; restoring a signal's
    // default action has no other effect on the process's state.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

/// Libraries whose debug and trace logs may carry secrets: async-nats prints its
/// connection's options and protocol lines (the CONNECT with the password or token) at
/// those levels. Capped at `warn` whatever `-v` or `RUST_LOG` ask for.
const SECRET_LOGGING_TARGETS: &[&str] = &["async_nats"];

/// `filter` with [`SECRET_LOGGING_TARGETS`] capped at `warn`: a directive for a target
/// overrides any broader one (`RUST_LOG=trace`), and replaces one for the same target.
pub fn quiet_libraries(mut filter: tracing_subscriber::EnvFilter) -> tracing_subscriber::EnvFilter {
    for target in SECRET_LOGGING_TARGETS {
        if let Ok(directive) = format!("{target}=warn").parse() {
            filter = filter.add_directive(directive);
        }
    }
    filter
}

/// Targets of the OpenTelemetry SDK's own diagnostics (an export that failed, a full
/// queue; a directive matches every target it prefixes): left out of the log lines, since they would repeat per batch; the exporter
/// reports a failing collector once instead (`export`).
const SDK_TARGETS: &[&str] = &["opentelemetry"];

/// The `service.name` of a process that runs `command` when none is configured.
pub fn default_service_name(service: Service) -> &'static str {
    match service {
        Service::Coordinator => "forkfleet-coordinator",
        Service::Worker => "forkfleet-worker",
        Service::Command => "forkfleet",
    }
}

/// What the process is, for its default `service.name`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Service {
    Coordinator,
    Worker,
    /// Any other command (`run`, `fork ...`, ...).
    Command,
}

/// The process's telemetry, installed by [`init`]: call [`Telemetry::shutdown`] before
/// the process exits, so that the spans still buffered are exported.
#[must_use = "call shutdown() before the process exits, or buffered spans are lost"]
pub struct Telemetry {
    provider: opentelemetry_sdk::trace::SdkTracerProvider,
    exporter: Option<export::Reporter>,
    metrics: Option<metrics::MetricsExport>,
    /// A service's process metrics, read at every read of the registry.
    _process: Option<forkfleet_shared::metrics::CollectorGuard>,
}

impl Telemetry {
    /// Export the spans still buffered and stop the exporter, waiting at most
    /// [`FLUSH_BOUND`]; a collector that does not answer in time is reported (once, as any
    /// export failure) and the spans are dropped. Nothing to do when export is off.
    pub fn shutdown(self) {
        let deadline = std::time::Instant::now() + FLUSH_BOUND;
        // The metric export's last snapshot goes out while the spans are flushed.
        let metrics = self.metrics.map(metrics::MetricsExport::stop);
        if let Some(reporter) = self.exporter {
            // Shutting down exports what is queued, then stops the processor's thread.
            if let Err(e) = self.provider.shutdown_with_timeout(FLUSH_BOUND) {
                reporter.failed(&format!("flushing at exit: {e}"));
            }
        }
        if let Some(stopping) = metrics {
            stopping.wait_until(deadline);
        }
    }
}

/// The process's subscriber: log lines on stderr, and an OpenTelemetry layer. Call it
/// inside the tokio runtime (the gRPC exporter's connection runs on it) and call
/// [`Telemetry::shutdown`] before that runtime drops.
///
/// - **Logs**: filtered by `RUST_LOG`, else by `-v` (warn, info, debug); the libraries
///   that log secrets at debug and trace (async-nats) never below `warn`, the
///   OpenTelemetry SDK's own diagnostics never. Text lines, or with
///   [`LogFormat::Json`] one JSON object per line carrying the current `trace_id` and
///   `span_id` (`json`).
/// - **Traces**: forkfleet's own spans at info and above, whatever the log filter, get
///   OpenTelemetry trace and span ids from an SDK tracer, so trace context propagates over
///   the bus: tasks carry the `fork.create` span's `traceparent` and branch spans hang
///   under it (`forkfleet_shared::trace`). Events and other crates' spans (ractor's
///   `Actor`, the HTTP and gRPC clients' own) stay out of it, so an export never produces
///   spans of its own. With an OTLP endpoint configured ([`TelemetrySettings::traces_endpoint`])
///   ended spans go to a batch processor (its own thread, a bounded queue: a slow or
///   unreachable collector drops spans, never blocks a branch) and out over OTLP; without
///   one, or `disabled`, there is no exporter, no thread and no buffer, and spans are
///   dropped as they end.
pub fn init(verbose: u8, settings: &TelemetrySettings, service: Service) -> Telemetry {
    use opentelemetry::trace::TracerProvider as _;
    use opentelemetry_sdk::trace::SdkTracerProvider;
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;
    use tracing_subscriber::Layer as _;

    forkfleet_shared::trace::set_capture_message_content(settings.capture_message_content.value);
    // A caller's trace (a command's, an HTTP request's) is recorded by this process's own
    // root decision, whatever the caller's flag says.
    forkfleet_shared::trace::set_caller_sample_ratio(caller_ratio(&settings.sampler.value));
    let default = match verbose {
        0 => "warn",
        1 => "info",
        _ => "debug",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let mut filter = quiet_libraries(filter);
    for target in SDK_TARGETS {
        if let Ok(directive) = format!("{target}=off").parse() {
            filter = filter.add_directive(directive);
        }
    }
    if settings.log_format.value == LogFormat::Json {
        // What a command says on stderr becomes a log line (`forkfleet_client::render::say`),
        // let through whatever the filter: under JSON logs stderr holds nothing else.
        forkfleet_client::render::set_json_logs(true);
        for d in ["forkfleet::progress=info", "forkfleet::command=error"] {
            if let Ok(directive) = d.parse() {
                filter = filter.add_directive(directive);
            }
        }
    }
    let logs = match settings.log_format.value {
        LogFormat::Text => tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_ansi(colour_on_stderr())
            .with_filter(filter)
            .boxed(),
        LogFormat::Json => tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_ansi(false)
            .fmt_fields(tracing_subscriber::fmt::format::JsonFields::new())
            .event_format(json::JsonLines)
            .with_filter(filter)
            .boxed(),
    };
    let mut builder = SdkTracerProvider::builder().with_sampler(sampler(&settings.sampler.value));
    // Built before the subscriber is installed: its diagnostics would go nowhere yet, so a
    // bad endpoint is reported below, once the log lines are set up.
    let exporter = settings
        .traces_endpoint()
        .map(|endpoint| export::build(settings, &endpoint));
    // One resource for both signals: the same `service.instance.id` on spans and metrics.
    let resource = resource(settings, service);
    let mut reporter = None;
    let mut build_error = None;
    match exporter {
        Some(Ok((exporter, r))) => {
            builder = builder
                .with_resource(resource.clone())
                .with_span_processor(export::batch(exporter));
            reporter = Some(r);
        }
        Some(Err(e)) => build_error = Some(e),
        None => {}
    }
    let provider = builder.build();
    // The tracer keeps the provider alive for the life of the process.
    let traces = tracing_opentelemetry::layer()
        .with_tracer(provider.tracer("forkfleet"))
        .with_threads(false)
        // Not `busy_ns`/`idle_ns` on every span: two clock reads at every poll of an
        // instrumented future, a fifth of a fan-out's wall with export on (BENCHMARKS.md).
        .with_tracked_inactivity(false)
        // Nor the OpenTelemetry context made current at every enter (nothing here reads
        // `Context::current()`: trace context is read from the span itself), nor the
        // source location and target as attributes on every span.
        .with_context_activation(false)
        .with_location(false)
        .with_target(false)
        .with_filter(
            tracing_subscriber::filter::filter_fn(|meta| {
                meta.is_span()
                    && *meta.level() <= tracing::Level::INFO
                    && meta.target().starts_with("forkfleet")
            })
            // Without the hint, `log` records (sled's trace logging) would all be converted
            // and dispatched only to be dropped.
            .with_max_level_hint(tracing::Level::INFO),
        );
    let _ = tracing_subscriber::registry()
        .with(logs)
        .with(traces)
        .try_init();
    if let Some(e) = build_error {
        tracing::warn!(error = %e, "traces: the OTLP exporter cannot be built; spans are not exported");
    }
    // A service serves its build, its process's figures and its counters from the start.
    let process = match service {
        Service::Coordinator | Service::Worker => {
            let name = resource
                .get(&opentelemetry::Key::from_static_str("service.name"))
                .map_or_else(
                    || default_service_name(service).to_string(),
                    |v| v.to_string(),
                );
            Some(process::install(service, &name))
        }
        Service::Command => None,
    };
    // Metrics: the services' registry, exported as OTLP when an endpoint is configured
    // (the commands' metrics die with them; a service is what a stack watches).
    let metrics = match (service, settings.metrics_endpoint()) {
        (Service::Coordinator | Service::Worker, Some(endpoint)) => {
            let attributes = resource
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            let reporter = export::Reporter::new("metrics", &endpoint);
            match metrics::MetricsExport::start(settings, &endpoint, attributes, reporter) {
                Ok(m) => Some(m),
                Err(e) => {
                    tracing::warn!(error = %e, "metrics: the OTLP exporter cannot be built; metrics are not exported");
                    None
                }
            }
        }
        _ => None,
    };
    Telemetry {
        provider,
        exporter: reporter,
        metrics,
        _process: process,
    }
}

/// The span of one command (`forkfleet fork create`): the root of its trace, or a child of
/// `TRACEPARENT` from the environment (a script's or a CI job's trace, as the OpenTelemetry
/// environment carrier names it).
pub fn command_span(path: &str) -> tracing::Span {
    // Under the target JSON logging lets through, so the command's progress lines carry
    // its trace ids.
    let span = tracing::info_span!(
        target: "forkfleet::progress",
        "command",
        otel.name = %format_args!("forkfleet {path}"),
        otel.kind = "client",
        otel.status_code = tracing::field::Empty,
        process.command = %format_args!("forkfleet {path}"),
        process.exit.code = tracing::field::Empty,
    );
    let parent = std::env::var("TRACEPARENT").ok();
    forkfleet_shared::trace::set_parent(&span, parent.as_deref());
    span
}

/// Record how the command of [`command_span`] ended.
pub fn end_command_span(span: &tracing::Span, code: u8) {
    span.record("process.exit.code", i64::from(code));
    if code != 0 {
        span.record("otel.status_code", "ERROR");
    }
}

/// The share of callers' traces the sampler's root decision keeps.
fn caller_ratio(setting: &SamplerSetting) -> f64 {
    let root = |r: &RootSampler| match r {
        RootSampler::AlwaysOn => 1.0,
        RootSampler::AlwaysOff => 0.0,
        RootSampler::TraceIdRatio(ratio) => *ratio,
    };
    match setting {
        SamplerSetting::AlwaysOn => 1.0,
        SamplerSetting::AlwaysOff => 0.0,
        SamplerSetting::TraceIdRatio(r) => *r,
        SamplerSetting::ParentBased(r) => root(r),
    }
}

/// The SDK sampler of a setting.
fn sampler(setting: &SamplerSetting) -> opentelemetry_sdk::trace::Sampler {
    use opentelemetry_sdk::trace::Sampler;
    let root = |r: &RootSampler| match r {
        RootSampler::AlwaysOn => Sampler::AlwaysOn,
        RootSampler::AlwaysOff => Sampler::AlwaysOff,
        RootSampler::TraceIdRatio(ratio) => Sampler::TraceIdRatioBased(*ratio),
    };
    match setting {
        SamplerSetting::AlwaysOn => Sampler::AlwaysOn,
        SamplerSetting::AlwaysOff => Sampler::AlwaysOff,
        SamplerSetting::TraceIdRatio(r) => Sampler::TraceIdRatioBased(*r),
        SamplerSetting::ParentBased(r) => Sampler::ParentBased(Box::new(root(r))),
    }
}

/// The resource of every exported span: `service.name` (configured, else the process's
/// default), `service.version`, `service.instance.id` (unless configured: a fresh id per
/// process), the SDK's own attributes and the configured `resource_attributes` (which win
/// over the variables the SDK reads itself).
fn resource(settings: &TelemetrySettings, service: Service) -> opentelemetry_sdk::Resource {
    use opentelemetry::KeyValue;
    let attributes = settings
        .resource_attributes
        .iter()
        .filter(|(k, _)| k.as_str() != "service.name")
        .map(|(k, v)| KeyValue::new(k.clone(), v.value.clone()));
    let name = match &settings.service_name {
        Some(s) => s.value.clone(),
        None => settings
            .resource_attributes
            .get("service.name")
            .map_or_else(
                || default_service_name(service).to_string(),
                |v| v.value.clone(),
            ),
    };
    let mut builder = opentelemetry_sdk::Resource::builder()
        .with_attributes(attributes)
        .with_attribute(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")))
        .with_service_name(name);
    if !settings
        .resource_attributes
        .contains_key("service.instance.id")
    {
        // Tells the processes of one service apart (two workers' spans).
        builder = builder.with_attribute(KeyValue::new(
            "service.instance.id",
            uuid::Uuid::now_v7().to_string(),
        ));
    }
    builder.build()
}
