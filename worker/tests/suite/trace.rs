//! Trace context: a branch's `branch.run` span is a child of the span its task was enqueued
//! in (the coordinator's `fork.create`), through the bus, with the OpenTelemetry SDK as the
//! binary installs it; the spans are read back from the SDK as they end.

use super::common::*;
use forkfleet_shared::trace::{span_context_of, traceparent_of};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry::Value;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{SdkTracerProvider, SpanData, SpanProcessor};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Notify;
use tracing::Instrument;
use tracing_subscriber::layer::SubscriberExt;

const ANSWER: &str = r#"
[[turns."*"]]
text = "done"
"#;

/// Keeps every span the SDK ends.
#[derive(Debug, Default)]
struct Ended {
    spans: Mutex<Vec<SpanData>>,
    notify: Notify,
}

#[derive(Debug, Clone, Default)]
struct Collector(Arc<Ended>);

impl SpanProcessor for Collector {
    fn on_start(&self, _span: &mut opentelemetry_sdk::trace::Span, _cx: &opentelemetry::Context) {}

    fn on_end(&self, span: SpanData) {
        self.0.spans.lock().unwrap().push(span);
        self.0.notify.notify_waiters();
    }

    fn force_flush(&self) -> OTelSdkResult {
        Ok(())
    }

    fn shutdown_with_timeout(&self, _timeout: Duration) -> OTelSdkResult {
        Ok(())
    }
}

impl Collector {
    /// The ended `branch.run` span of `run`, waiting for it at most [`WAIT`].
    async fn branch_run(&self, run: &str) -> SpanData {
        let found = async {
            loop {
                let notified = self.0.notify.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                let spans = self.0.spans.lock().unwrap().clone();
                if let Some(span) = spans
                    .into_iter()
                    .find(|s| s.name == "branch.run" && attribute(s, "run.id") == Some(run))
                {
                    return span;
                }
                notified.await;
            }
        };
        tokio::time::timeout(WAIT, found)
            .await
            .expect("the branch.run span did not end in time")
    }

    fn ended(&self, name: &str) -> Vec<SpanData> {
        let spans = self.0.spans.lock().unwrap();
        spans.iter().filter(|s| s.name == name).cloned().collect()
    }
}

fn attribute<'a>(span: &'a SpanData, key: &str) -> Option<&'a str> {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .and_then(|kv| match &kv.value {
            Value::String(s) => Some(s.as_str()),
            _ => None,
        })
}

#[tokio::test]
async fn a_branch_span_is_a_child_of_the_span_that_enqueued_its_task() {
    let collector = Collector::default();
    let provider = SdkTracerProvider::builder()
        .with_span_processor(collector.clone())
        .build();
    let subscriber = tracing_subscriber::registry()
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("worker-test")));
    // This thread's tasks (the test, the node, its agents: a current-thread runtime).
    let _default = tracing::subscriber::set_default(subscriber);

    let fx = Fixture::new().await;
    let (_, snap) = fx.snapshot(&[]);
    let script = fx.script(ANSWER);
    let traced = fx.task("traced", 0, snap, script);
    let untraced = fx.task("untraced", 1, snap, script);

    let fork = tracing::info_span!("fork.create");
    let fork_sc = span_context_of(&traceparent_of(&fork).unwrap()).unwrap();
    fx.enqueue(&traced).instrument(fork.clone()).await;
    fx.enqueue(&untraced).await;

    let mut events = fx.events().await;
    let worker = start(&fx, config(2)).await;
    events
        .until_terminal(&[traced.run_id, untraced.run_id])
        .await;
    shutdown(worker).await;

    // The traced branch hangs under the fork's span, across the bus.
    let run = collector.branch_run(&traced.run_id.to_string()).await;
    assert_eq!(run.span_context.trace_id(), fork_sc.trace_id());
    assert_eq!(run.parent_span_id, fork_sc.span_id());
    assert!(run.parent_span_is_remote);
    assert!(run.span_context.is_sampled());
    // Its turns are in the same trace, under it.
    let turns: Vec<SpanData> = collector
        .ended("branch.turn")
        .into_iter()
        .filter(|t| t.parent_span_id == run.span_context.span_id())
        .collect();
    assert!(!turns.is_empty(), "no branch.turn span under branch.run");
    for t in &turns {
        assert_eq!(t.span_context.trace_id(), fork_sc.trace_id());
    }

    // A task enqueued outside any span carries no context: its branch keeps the parent it
    // would have had (the span of the actor's start), nothing remote.
    let lone = collector.branch_run(&untraced.run_id.to_string()).await;
    assert_ne!(lone.span_context.trace_id(), fork_sc.trace_id());
    assert!(!lone.parent_span_is_remote);
}
