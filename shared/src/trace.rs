//! W3C trace context across the bus.
//!
//! A span's OpenTelemetry context travels with a message as a W3C `traceparent` value,
//! `00-<32 hex trace id>-<16 hex parent span id>-<2 hex flags>`: the NATS bus puts it in a
//! header of every JetStream publish, the local bus keeps it beside the payload, and a
//! bus delivery (`forkfleet_bus::Delivery`) hands it out as `trace`. The worker makes each
//! `branch.run` span a child of its task's context, so a fork's branches hang under the
//! coordinator's `fork.create` span in a trace backend, across processes.
//!
//! The context is read from the `tracing` span through the `tracing-opentelemetry` layer.
//! Without that layer (tests, a library user with a plain subscriber) there is no valid
//! context: [`current_traceparent`] is `None`, messages go without one, and [`set_parent`]
//! leaves spans as they are. Nothing here ever fails a message: a malformed value is ignored.
//!
//! Only the `traceparent` field is carried; `tracestate` is not.
//!
//! Whether spans may record prompt and completion text (the GenAI attributes
//! `gen_ai.input.messages` and `gen_ai.output.messages`) is one process-wide switch, off by
//! default: [`set_capture_message_content`] at start-up, [`capture_message_content`] where a
//! span is recorded.

use opentelemetry::trace::{SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState};
use opentelemetry::Context;
use std::sync::atomic::{AtomicBool, Ordering};
use tracing_opentelemetry::{OpenTelemetrySpanExt, SetParentError};

/// Whether spans may record message content; off until [`set_capture_message_content`].
static CAPTURE_MESSAGE_CONTENT: AtomicBool = AtomicBool::new(false);

/// Whether model call spans may record prompt and completion text (`gen_ai.input.messages`,
/// `gen_ai.output.messages`). `false` unless the process turned it on.
pub fn capture_message_content() -> bool {
    CAPTURE_MESSAGE_CONTENT.load(Ordering::Relaxed)
}

/// Turn the recording of message content on or off for the whole process: once at start-up,
/// from the resolved configuration (`telemetry.capture_message_content`,
/// `OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT`).
pub fn set_capture_message_content(on: bool) {
    CAPTURE_MESSAGE_CONTENT.store(on, Ordering::Relaxed);
}

/// The W3C trace context header (and the name of the field everywhere else).
pub const TRACEPARENT: &str = "traceparent";

/// The only `traceparent` version this crate writes and reads.
const VERSION: &str = "00";

/// The current `tracing` span's OpenTelemetry context as a `traceparent` value; `None`
/// outside any span, when no OpenTelemetry layer is installed, or when the context is not
/// valid.
pub fn current_traceparent() -> Option<String> {
    traceparent_of(&tracing::Span::current())
}

/// `span`'s OpenTelemetry context as a `traceparent` value (see [`current_traceparent`]).
pub fn traceparent_of(span: &tracing::Span) -> Option<String> {
    // No span, or no subscriber wants it: nothing to look up.
    if span.is_disabled() {
        return None;
    }
    format_traceparent(span.context().span().span_context())
}

/// A span context as a `traceparent` value; `None` when it is not valid (an all-zero id).
/// Only the sampled flag is written, as version `00` defines no other.
pub fn format_traceparent(sc: &SpanContext) -> Option<String> {
    if !sc.is_valid() {
        return None;
    }
    let flags = sc.trace_flags() & TraceFlags::SAMPLED;
    Some(format!(
        "{VERSION}-{}-{}-{:02x}",
        sc.trace_id(),
        sc.span_id(),
        flags.to_u8()
    ))
}

/// The remote span context a `traceparent` value names, as an OpenTelemetry context, or
/// `None` unless the value is exactly version `00` with a 32-digit trace id, a 16-digit span
/// id and 2-digit flags, all lowercase hex, and neither id all zeros.
pub fn parse_traceparent(value: &str) -> Option<Context> {
    span_context_of(value).map(|sc| Context::new().with_remote_span_context(sc))
}

/// The span context of a `traceparent` value (see [`parse_traceparent`]).
pub fn span_context_of(value: &str) -> Option<SpanContext> {
    let mut parts = value.split('-');
    let (version, trace_id, span_id, flags) =
        (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() || version != VERSION {
        return None;
    }
    let trace_id = TraceId::from_bytes(hex_bytes::<16>(trace_id)?);
    let span_id = SpanId::from_bytes(hex_bytes::<8>(span_id)?);
    let [flags] = hex_bytes::<1>(flags)?;
    let sc = SpanContext::new(
        trace_id,
        span_id,
        TraceFlags::new(flags) & TraceFlags::SAMPLED,
        true,
        TraceState::default(),
    );
    sc.is_valid().then_some(sc)
}

/// Exactly `2 * N` lowercase hex digits, as bytes.
fn hex_bytes<const N: usize>(s: &str) -> Option<[u8; N]> {
    let s = s.as_bytes();
    if s.len() != 2 * N {
        return None;
    }
    let digit = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    };
    let mut out = [0u8; N];
    for (byte, pair) in out.iter_mut().zip(s.chunks_exact(2)) {
        *byte = (digit(pair[0])? << 4) | digit(pair[1])?;
    }
    Some(out)
}

/// Make `span` a child of the remote context `traceparent` names (a message's trace).
///
/// Call it right after creating the span, before it is entered: the OpenTelemetry layer
/// fixes a span's parent when the span starts. An absent or malformed value, or a span no
/// OpenTelemetry layer sees, leaves the span as it is.
pub fn set_parent(span: &tracing::Span, traceparent: Option<&str>) {
    let Some(cx) = traceparent.and_then(parse_traceparent) else {
        return;
    };
    match OpenTelemetrySpanExt::set_parent(span, cx) {
        Ok(()) | Err(SetParentError::LayerNotFound | SetParentError::SpanDisabled) => {}
        Err(e) => tracing::debug!(error = %e, "trace parent not set"),
    }
}

/// How this process samples a trace a caller starts (its root sampler), as a ratio of the
/// trace id space: 1 keeps every trace, 0 none. Set once by the binary's telemetry.
static CALLER_SAMPLE_RATIO: std::sync::atomic::AtomicU64 =
    std::sync::atomic::AtomicU64::new(0x3ff0_0000_0000_0000); // 1.0

/// Set the ratio [`set_caller_parent`] keeps (clamped to 0..=1).
pub fn set_caller_sample_ratio(ratio: f64) {
    let ratio = if ratio.is_finite() {
        ratio.clamp(0.0, 1.0)
    } else {
        1.0
    };
    CALLER_SAMPLE_RATIO.store(ratio.to_bits(), Ordering::Relaxed);
}

/// Whether this process keeps the trace `trace_id` by its own ratio: the rule of the
/// OpenTelemetry SDK's trace-id ratio sampler (the id's low 8 bytes, halved, under the
/// ratio's share of 2^63), so every process with the same ratio decides alike.
fn kept_by_ratio(trace_id: TraceId) -> bool {
    let ratio = f64::from_bits(CALLER_SAMPLE_RATIO.load(Ordering::Relaxed));
    if ratio >= 1.0 {
        return true;
    }
    if ratio <= 0.0 {
        return false;
    }
    let bytes = trace_id.to_bytes();
    let mut low = [0u8; 8];
    low.copy_from_slice(&bytes[8..]);
    let rnd = u64::from_be_bytes(low) >> 1;
    (rnd as f64) < ratio * (1u64 << 63) as f64
}

/// Make `span` a child of a *caller's* `traceparent` (a client command's, an HTTP request's
/// header): the caller's trace continues here, but whether it is recorded is this
/// process's decision (its sampler's ratio on the trace id), not the caller's flag, so a
/// caller can neither force every fork to be traced nor hide one. Trace context between
/// forkfleet's own processes ([`set_parent`]) keeps the flag: a worker follows the
/// coordinator.
pub fn set_caller_parent(span: &tracing::Span, traceparent: Option<&str>) {
    let Some(sc) = traceparent.and_then(span_context_of) else {
        return;
    };
    let flags = if kept_by_ratio(sc.trace_id()) {
        TraceFlags::SAMPLED
    } else {
        TraceFlags::default()
    };
    let sc = SpanContext::new(
        sc.trace_id(),
        sc.span_id(),
        flags,
        true,
        TraceState::default(),
    );
    let cx = Context::new().with_remote_span_context(sc);
    match OpenTelemetrySpanExt::set_parent(span, cx) {
        Ok(()) | Err(SetParentError::LayerNotFound | SetParentError::SpanDisabled) => {}
        Err(e) => tracing::debug!(error = %e, "trace parent not set"),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn a_callers_trace_is_kept_by_this_processs_ratio_not_its_flag() {
        let id = |low: u64| {
            let mut b = [0u8; 16];
            b[0] = 1;
            b[8..].copy_from_slice(&low.to_be_bytes());
            TraceId::from_bytes(b)
        };
        set_caller_sample_ratio(1.0);
        assert!(kept_by_ratio(id(u64::MAX)));
        set_caller_sample_ratio(0.0);
        assert!(!kept_by_ratio(id(0)));
        set_caller_sample_ratio(0.5);
        assert!(kept_by_ratio(id(0)));
        assert!(!kept_by_ratio(id(u64::MAX)));
        set_caller_sample_ratio(1.0);
    }

    const GOOD: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn parse_then_format_round_trips() {
        let cx = parse_traceparent(GOOD).unwrap();
        let span = cx.span();
        let sc = span.span_context();
        assert!(sc.is_remote());
        assert!(sc.is_sampled());
        assert_eq!(
            sc.trace_id(),
            TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").unwrap()
        );
        assert_eq!(sc.span_id(), SpanId::from_hex("00f067aa0ba902b7").unwrap());
        assert_eq!(format_traceparent(sc).as_deref(), Some(GOOD));

        let unsampled = "00-0000000000000000000000000000002a-000000000000002b-00";
        let sc = span_context_of(unsampled).unwrap();
        assert!(!sc.is_sampled());
        assert_eq!(format_traceparent(&sc).as_deref(), Some(unsampled));
    }

    #[test]
    fn format_writes_fixed_widths_and_only_the_sampled_flag() {
        let sc = SpanContext::new(
            TraceId::from(1u128),
            SpanId::from(2u64),
            TraceFlags::new(0xff),
            false,
            TraceState::default(),
        );
        assert_eq!(
            format_traceparent(&sc).as_deref(),
            Some("00-00000000000000000000000000000001-0000000000000002-01")
        );
        assert_eq!(format_traceparent(&SpanContext::empty_context()), None);
    }

    #[test]
    fn unknown_flag_bits_are_dropped_on_read() {
        let sc =
            span_context_of("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-03").unwrap();
        assert_eq!(sc.trace_flags(), TraceFlags::SAMPLED);
    }

    #[test]
    fn malformed_values_are_rejected() {
        let bad = [
            "",
            "00",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            // Another version, or version 00 with more fields.
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            // Lengths.
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e47366-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b77-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-001",
            // Not lowercase hex (a sign, upper case, a space, a non-hex letter).
            "00-+bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00F067AA0BA902B7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0g",
            " 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01 ",
            "00-4bf92f3577b34da6a3ce929d0e0e47z6-00f067aa0ba902b7-01",
            // All-zero ids.
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            // Multi-byte characters where digits belong.
            "00-4bf92f3577b34da6a3ce929d0e0e47é-00f067aa0ba902b7-01",
        ];
        for value in bad {
            assert!(parse_traceparent(value).is_none(), "accepted {value:?}");
        }
    }

    #[test]
    fn without_an_otel_layer_there_is_no_context() {
        // No subscriber at all: no span, nothing to carry.
        assert_eq!(current_traceparent(), None);
        // A subscriber without the OpenTelemetry layer.
        tracing::subscriber::with_default(tracing_subscriber::registry(), || {
            let span = tracing::info_span!("t");
            let _entered = span.enter();
            assert_eq!(current_traceparent(), None);
            // And a parent cannot be set, without a panic or an error.
            set_parent(&span, Some(GOOD));
        });
    }

    fn otel_subscriber() -> impl tracing::Subscriber + Send + Sync {
        use opentelemetry::trace::TracerProvider as _;
        use tracing_subscriber::layer::SubscriberExt;
        let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder().build();
        tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")))
    }

    #[test]
    fn a_span_gives_its_context_and_takes_a_remote_parent() {
        tracing::subscriber::with_default(otel_subscriber(), || {
            assert_eq!(current_traceparent(), None, "outside any span");
            let outer = tracing::info_span!("outer");
            let tp = outer.in_scope(current_traceparent).unwrap();
            let sc = span_context_of(&tp).unwrap();
            assert_eq!(
                traceparent_of(&outer).as_deref(),
                Some(tp.as_str()),
                "the current span is the one entered"
            );
            assert!(sc.is_sampled());

            // A span made a child of a remote context joins its trace.
            let child = tracing::info_span!("child");
            set_parent(&child, Some(GOOD));
            let got = span_context_of(&traceparent_of(&child).unwrap()).unwrap();
            let remote = span_context_of(GOOD).unwrap();
            assert_eq!(got.trace_id(), remote.trace_id());
            assert_ne!(got.span_id(), remote.span_id());

            // Malformed or absent: the span keeps the trace it would have had.
            let lone = tracing::info_span!("lone");
            set_parent(&lone, Some("00-nope"));
            set_parent(&lone, None);
            let lone_sc = span_context_of(&traceparent_of(&lone).unwrap()).unwrap();
            assert_ne!(lone_sc.trace_id(), remote.trace_id());
            let nested = outer.in_scope(|| tracing::info_span!("nested"));
            set_parent(&nested, None);
            let nested_sc = span_context_of(&traceparent_of(&nested).unwrap()).unwrap();
            assert_eq!(nested_sc.trace_id(), sc.trace_id());
        });
    }
}
