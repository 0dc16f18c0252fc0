//! Spans read back from the OpenTelemetry SDK as they end, for tests of what the services
//! trace: a [`SpanCollector`] is a span processor of an SDK provider, and
//! [`SpanCollector::subscriber`] a `tracing` subscriber whose OpenTelemetry layer feeds it
//! (without an exporter, as the binary's layer with export off).

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{SdkTracerProvider, SpanData, SpanProcessor};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::sync::Notify;
use tracing_subscriber::layer::SubscriberExt as _;

#[derive(Debug, Default)]
struct Ended {
    spans: Mutex<Vec<SpanData>>,
    notify: Notify,
}

/// Keeps every span the SDK ends; clones share the spans.
#[derive(Debug, Clone, Default)]
pub struct SpanCollector(Arc<Ended>);

impl SpanProcessor for SpanCollector {
    fn on_start(&self, _span: &mut opentelemetry_sdk::trace::Span, _cx: &opentelemetry::Context) {}

    fn on_end(&self, span: SpanData) {
        self.lock().push(span);
        self.0.notify.notify_waiters();
    }

    fn force_flush(&self) -> OTelSdkResult {
        Ok(())
    }

    fn shutdown_with_timeout(&self, _timeout: Duration) -> OTelSdkResult {
        Ok(())
    }
}

impl SpanCollector {
    fn lock(&self) -> MutexGuard<'_, Vec<SpanData>> {
        self.0.spans.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Every span ended so far.
    pub fn all(&self) -> Vec<SpanData> {
        self.lock().clone()
    }

    /// The first answer of `found` over the spans ended so far, waiting for more spans
    /// until it has one (unbounded: the caller bounds it).
    pub async fn wait_until<T>(&self, found: impl Fn(&[SpanData]) -> Option<T>) -> T {
        loop {
            let notified = self.0.notify.notified();
            tokio::pin!(notified);
            // Registered before looking, so a span ending in between wakes the wait.
            notified.as_mut().enable();
            if let Some(answer) = found(&self.lock()) {
                return answer;
            }
            notified.await;
        }
    }

    /// A subscriber whose OpenTelemetry layer (tracer `scope`) hands its spans to this
    /// collector.
    pub fn subscriber(&self, scope: &'static str) -> impl tracing::Subscriber + Send + Sync {
        let provider = SdkTracerProvider::builder()
            .with_span_processor(self.clone())
            .build();
        tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer(scope)))
    }
}
