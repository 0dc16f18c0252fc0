//! The process's telemetry: log lines and trace context.

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

/// The process's subscriber: log lines on stderr, and an OpenTelemetry layer.
///
/// - **Logs**: filtered by `RUST_LOG`, else by `-v` (warn, info, debug); the libraries
///   that log secrets at debug and trace (async-nats) never below `warn`.
/// - **Traces**: forkfleet's own spans at info and above, whatever the log filter, get
///   OpenTelemetry trace and span ids from an SDK tracer (sampled unless a remote parent
///   says otherwise), so trace context propagates over the bus: tasks carry the
///   `fork.create` span's `traceparent` and branch spans hang under it
///   (`forkfleet_shared::trace`). Events and other crates' spans (ractor's `Actor`, ...)
///   stay out of it. There is no exporter yet, so nothing leaves the process: spans are
///   dropped as they end and the provider has no thread or buffer to flush at exit.
pub fn init(verbose: u8) {
    use opentelemetry::trace::TracerProvider as _;
    use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider};
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;
    use tracing_subscriber::Layer as _;

    let default = match verbose {
        0 => "warn",
        1 => "info",
        _ => "debug",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let filter = quiet_libraries(filter);
    let logs = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(colour_on_stderr())
        .with_filter(filter);
    let provider = SdkTracerProvider::builder()
        .with_sampler(Sampler::ParentBased(Box::new(Sampler::AlwaysOn)))
        .build();
    // The tracer keeps the provider alive for the life of the process.
    let traces = tracing_opentelemetry::layer()
        .with_tracer(provider.tracer("forkfleet"))
        .with_threads(false)
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
}
