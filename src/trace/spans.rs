//! The spans of the RabbitMQ side (features `opentelemetry` and `rabbitmq`): the publisher
//! reports each batch it publishes, and the consumer each delivery it handles, as spans of
//! the global tracer, named and described as the OpenTelemetry messaging conventions say.

use std::str::FromStr;

use opentelemetry::global::{self, BoxedSpan};
use opentelemetry::trace::{
    Link, Span, SpanBuilder, SpanContext, SpanId, SpanKind, Status, TraceContextExt, TraceFlags,
    TraceId, TraceState, Tracer,
};
use opentelemetry::{Context, KeyValue};

use super::w3c::parse_traceparent;
use super::{header, TRACEPARENT, TRACESTATE};
use crate::publish::record::Record;

/// The tracer's name: the instrumentation scope of every span made here.
const SCOPE: &str = "postgres-outbox";

/// The producer's context these headers carry, if they carry a valid one.
fn remote(headers: &[(String, String)]) -> Option<SpanContext> {
    let parsed = parse_traceparent(header(headers, TRACEPARENT)?).ok()?;
    let state = header(headers, TRACESTATE)
        .and_then(|s| TraceState::from_str(s).ok())
        .unwrap_or_default();
    Some(SpanContext::new(
        TraceId::from_hex(parsed.trace_id).ok()?,
        SpanId::from_hex(parsed.parent_id).ok()?,
        TraceFlags::new(u8::from_str_radix(parsed.flags, 16).ok()?),
        true,
        state,
    ))
}

/// The span of one batch the RabbitMQ publisher publishes (kind Producer). A batch whose
/// records all belong to one trace continues it, as the child of the first record's
/// context; any other batch starts a trace of its own. Either way it links to every
/// producer's context it does not descend from.
pub(crate) fn publish_span(exchange: &str, batch: &[Record]) -> BoxedSpan {
    let contexts: Vec<Option<SpanContext>> = batch.iter().map(|r| remote(&r.headers)).collect();
    let parent = match contexts.first() {
        Some(Some(first))
            if contexts
                .iter()
                .all(|c| c.as_ref().is_some_and(|c| c.trace_id() == first.trace_id())) =>
        {
            Some(first.clone())
        }
        _ => None,
    };
    let links = contexts
        .into_iter()
        .flatten()
        .filter(|c| parent.as_ref() != Some(c))
        .map(Link::with_context)
        .collect();
    let mut attributes = vec![
        KeyValue::new("messaging.system", "rabbitmq"),
        KeyValue::new("messaging.operation.type", "send"),
        KeyValue::new("messaging.operation.name", "publish"),
        KeyValue::new("messaging.destination.name", exchange.to_owned()),
    ];
    match batch {
        [record] => attributes.extend([
            KeyValue::new("messaging.message.id", record.key.clone()),
            KeyValue::new(
                "messaging.rabbitmq.destination.routing_key",
                record.topic.clone(),
            ),
        ]),
        _ => attributes.push(KeyValue::new(
            "messaging.batch.message_count",
            i64::try_from(batch.len()).unwrap_or(i64::MAX),
        )),
    }
    let builder = SpanBuilder::from_name(format!("publish {}", destination(exchange)))
        .with_kind(SpanKind::Producer)
        .with_attributes(attributes)
        .with_links(links);
    global::tracer(SCOPE).build_with_context(builder, &parent_context(parent))
}

/// Ends a batch's span, in error if any record of it was not published.
pub(crate) fn end_publish(mut span: BoxedSpan, failed: usize) {
    if failed > 0 {
        span.set_status(Status::error(format!("{failed} not published")));
    }
    span.end();
}

/// Runs `handle` inside the span of one delivery's handling (kind Consumer), which is the
/// current span meanwhile: the handler's own spans are its children. On the first handling
/// of a delivery (`again` false: neither redelivered by the broker nor retried here) the
/// span is a child of the producer's context; on any later one it starts a trace of its
/// own and links to that context, so a trace holds one first attempt and the retries
/// point to it.
pub(crate) fn delivered<T, E: std::fmt::Display>(
    exchange: &str,
    routing_key: &str,
    key: &str,
    headers: &[(String, String)],
    again: bool,
    handle: impl FnOnce() -> Result<T, E>,
) -> Result<T, E> {
    let producer = remote(headers);
    let (parent, links) = match producer {
        Some(producer) if again => (None, vec![Link::with_context(producer)]),
        producer => (producer, Vec::new()),
    };
    let builder = SpanBuilder::from_name(format!("process {}", destination(exchange)))
        .with_kind(SpanKind::Consumer)
        .with_attributes([
            KeyValue::new("messaging.system", "rabbitmq"),
            KeyValue::new("messaging.operation.type", "process"),
            KeyValue::new("messaging.operation.name", "process"),
            KeyValue::new("messaging.destination.name", exchange.to_owned()),
            KeyValue::new(
                "messaging.rabbitmq.destination.routing_key",
                routing_key.to_owned(),
            ),
            KeyValue::new("messaging.message.id", key.to_owned()),
        ])
        .with_links(links);
    let span = global::tracer(SCOPE).build_with_context(builder, &parent_context(parent));
    let cx = Context::current_with_span(span);
    let result = {
        let _current = cx.clone().attach();
        handle()
    };
    if let Err(e) = &result {
        cx.span().set_status(Status::error(e.to_string()));
    }
    cx.span().end();
    result
}

/// A context with `parent` as its remote span, or an empty one: never the thread's current
/// context, which belongs to whatever ran before on a crate's thread.
fn parent_context(parent: Option<SpanContext>) -> Context {
    match parent {
        Some(parent) => Context::new().with_remote_span_context(parent),
        None => Context::new(),
    }
}

/// The conventions' name for the default exchange, which has none.
fn destination(exchange: &str) -> &str {
    if exchange.is_empty() {
        "amq.default"
    } else {
        exchange
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_traceparent_is_read_as_the_producers_remote_context() {
        let headers = [
            (
                "traceparent".to_owned(),
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".to_owned(),
            ),
            ("tracestate".to_owned(), "rojo=1,congo=2".to_owned()),
        ];
        let sc = remote(&headers).unwrap();
        assert_eq!(
            sc.trace_id(),
            TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").unwrap()
        );
        assert_eq!(sc.span_id(), SpanId::from_hex("00f067aa0ba902b7").unwrap());
        assert!(sc.is_sampled() && sc.is_remote());
        assert_eq!(sc.trace_state().get("congo"), Some("2"));
        assert_eq!(remote(&headers[1..]), None);
    }
}
