//! `--log-format json`: one JSON object per line.
//!
//! ```json
//! {"timestamp":"2026-01-02T03:04:05.678901Z","level":"INFO","target":"forkfleet_worker::run",
//!  "message":"branch done","fields":{"branch.id":"..."},
//!  "span":{"name":"branch.run","fork.id":"..."},"spans":[{"name":"fork.create",...},...],
//!  "trace_id":"4bf92f3577b34da6a3ce929d0e0e4736","span_id":"00f067aa0ba902b7"}
//! ```
//!
//! `span` is the innermost span the event is in, `spans` every span from the root down
//! (each its name and fields); `trace_id` and `span_id` are the OpenTelemetry ids of the
//! innermost of them that has some (forkfleet's own spans), absent outside any.

use opentelemetry::trace::TraceContextExt as _;
use serde_json::{Map, Value};
use std::fmt;
use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_subscriber::fmt::format::{JsonFields, Writer};
use tracing_subscriber::fmt::time::{FormatTime as _, SystemTime};
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields, FormattedFields};
use tracing_subscriber::registry::LookupSpan;

/// The JSON event format (with [`JsonFields`] as the field formatter, so that span fields
/// are stored as JSON).
pub(super) struct JsonLines;

impl<S, N> FormatEvent<S, N> for JsonLines
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let meta = event.metadata();
        let mut line = Map::new();
        let mut timestamp = String::new();
        if SystemTime
            .format_time(&mut Writer::new(&mut timestamp))
            .is_ok()
        {
            line.insert("timestamp".into(), Value::String(timestamp));
        }
        line.insert("level".into(), Value::String(meta.level().to_string()));
        line.insert("target".into(), Value::String(meta.target().to_string()));
        let mut fields = Fields(Map::new());
        event.record(&mut fields);
        let mut fields = fields.0;
        if let Some(message) = fields.remove("message") {
            line.insert("message".into(), message);
        }
        if !fields.is_empty() {
            line.insert("fields".into(), Value::Object(fields));
        }
        if let Some(scope) = ctx.event_scope() {
            let dispatch = tracing::dispatcher::get_default(|d| d.clone());
            let mut spans = Vec::new();
            let mut ids = None;
            for span in scope {
                let mut entry = Map::new();
                entry.insert("name".into(), Value::String(span.name().to_string()));
                if let Some(stored) = span.extensions().get::<FormattedFields<JsonFields>>() {
                    if let Ok(Value::Object(map)) = serde_json::from_str::<Value>(stored) {
                        entry.extend(map);
                    }
                }
                spans.push(Value::Object(entry));
                if ids.is_none() {
                    // The extensions are not held here, as `get_otel_context` requires.
                    ids = tracing_opentelemetry::get_otel_context(&span.id(), &dispatch)
                        .map(|cx| cx.span().span_context().clone())
                        .filter(|sc| sc.is_valid());
                }
            }
            // The scope runs from the innermost span out.
            spans.reverse();
            if let Some(current) = spans.last() {
                line.insert("span".into(), current.clone());
            }
            if !spans.is_empty() {
                line.insert("spans".into(), Value::Array(spans));
            }
            if let Some(sc) = ids {
                line.insert("trace_id".into(), Value::String(sc.trace_id().to_string()));
                line.insert("span_id".into(), Value::String(sc.span_id().to_string()));
            }
        }
        let text = serde_json::to_string(&Value::Object(line)).map_err(|_| fmt::Error)?;
        writeln!(writer, "{text}")
    }
}

/// An event's fields as JSON values.
struct Fields(Map<String, Value>);

impl Visit for Fields {
    fn record_f64(&mut self, field: &Field, value: f64) {
        let v = serde_json::Number::from_f64(value).map_or(Value::Null, Value::Number);
        self.0.insert(field.name().to_string(), v);
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        self.0.insert(field.name().to_string(), value.into());
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        self.0.insert(field.name().to_string(), value.into());
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        self.0.insert(field.name().to_string(), value.into());
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_string(), value.into());
    }

    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        self.0
            .insert(field.name().to_string(), value.to_string().into());
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.0
            .insert(field.name().to_string(), format!("{value:?}").into());
    }
}
