//! Enqueue's side of the bridge to OpenTelemetry (feature `opentelemetry`): the current
//! span's context, captured as the `traceparent`/`tracestate` headers of a message that
//! carries none.
//!
//! The W3C format is written here (and read in `spans`) rather than by a propagator: the
//! API crate has none (`TraceContextPropagator` is in the SDK), and the global one is a
//! no-op unless the application installs one, which would leave the headers empty without a
//! word.

use opentelemetry::trace::TraceContextExt;
use opentelemetry::Context;

use super::w3c::{check_tracestate, MAX_TRACESTATE};
use super::{TRACEPARENT, TRACESTATE};

/// The most header bytes a captured context takes, as AMQP encodes it: `traceparent` (55
/// characters) and a `tracestate` of at most 512, each with its name and 6 bytes of
/// framing.
pub(crate) const CAPTURED_ROOM: usize =
    (TRACEPARENT.len() + 6 + 55) + (TRACESTATE.len() + 6 + MAX_TRACESTATE);

/// The current span's context as headers (name, value, ...), or nothing outside a span.
/// A `tracestate` the spec's grammar refuses (the API checks less) is left out.
pub(crate) fn current_headers() -> Vec<String> {
    let cx = Context::current();
    let span = cx.span();
    let sc = span.span_context();
    if !sc.is_valid() {
        return Vec::new();
    }
    let mut headers = vec![
        TRACEPARENT.to_owned(),
        format!(
            "00-{}-{}-{:02x}",
            sc.trace_id(),
            sc.span_id(),
            sc.trace_flags().to_u8()
        ),
    ];
    let state = sc.trace_state().header();
    if !state.is_empty() && check_tracestate(&state).is_ok() {
        headers.extend([TRACESTATE.to_owned(), state]);
    }
    headers
}

#[cfg(test)]
mod tests {
    use std::str::FromStr;

    use opentelemetry::trace::{SpanContext, SpanId, TraceFlags, TraceId, TraceState};

    use super::*;

    #[test]
    fn the_current_span_is_written_as_w3c_headers() {
        let sc = SpanContext::new(
            TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").unwrap(),
            SpanId::from_hex("00f067aa0ba902b7").unwrap(),
            TraceFlags::SAMPLED,
            true,
            TraceState::from_str("rojo=1,congo=2").unwrap(),
        );
        let headers = {
            let _current = Context::new().with_remote_span_context(sc).attach();
            current_headers()
        };
        assert_eq!(
            headers,
            [
                "traceparent",
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                "tracestate",
                "rojo=1,congo=2"
            ]
        );
        // Outside any span there is nothing to capture.
        assert!(current_headers().is_empty());
    }
}
