//! The `opentelemetry` feature against the real services, its spans caught by the SDK's
//! in-memory exporter: enqueue captures the current context, the relay's publish continues
//! the trace, and the consumer's span is the child of the producer's on a first delivery
//! and links to it on a retry or a redelivery.
#![cfg(all(feature = "opentelemetry", feature = "rabbitmq"))]

mod common;

use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use common::broker::Broker;
use common::*;
use opentelemetry::trace::{
    SpanContext, SpanId, SpanKind, Status, TraceContextExt, TraceId, Tracer,
};
use opentelemetry::{global, Context, Value};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use postgres_outbox::rabbitmq::{Consumer, ConsumerConfig, PublisherConfig};
use postgres_outbox::{HandlerError, Message, Outbox, Relay, RelayConfig, Retry};

/// The exporter behind the global tracer provider, installed once for the whole binary:
/// the tests run in parallel and tell their spans apart by message id and trace id.
fn exporter() -> &'static InMemorySpanExporter {
    static EXPORTER: OnceLock<InMemorySpanExporter> = OnceLock::new();
    EXPORTER.get_or_init(|| {
        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        global::set_tracer_provider(provider);
        exporter
    })
}

fn finished() -> Vec<SpanData> {
    exporter().get_finished_spans().expect("finished spans")
}

fn attribute<'s>(span: &'s SpanData, key: &str) -> Option<&'s Value> {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| &kv.value)
}

fn string(value: &str) -> Option<Value> {
    Some(Value::from(value.to_owned()))
}

/// The spans of `kind` about the message `key`, in the order they started.
fn spans_of(kind: SpanKind, key: &str) -> Vec<SpanData> {
    let mut spans: Vec<SpanData> = finished()
        .into_iter()
        .filter(|s| {
            s.span_kind == kind && attribute(s, "messaging.message.id") == string(key).as_ref()
        })
        .collect();
    spans.sort_by_key(|s| s.start_time);
    spans
}

/// Enqueues one message inside a span of the producer's own (a request handler's), as the
/// application would, and returns its key and that span's context.
fn enqueue_in_a_request(outbox: &Outbox, client: &mut postgres::Client) -> (String, SpanContext) {
    let tracer = global::tracer("the-web-app");
    let span = tracer
        .span_builder("POST /orders")
        .with_kind(SpanKind::Server)
        .start(&tracer);
    let cx = Context::current_with_span(span);
    let _request = cx.clone().attach();
    let mut tx = client.transaction().unwrap();
    let key = outbox
        .enqueue(&mut tx, Message::new("order.paid", "{}"))
        .unwrap();
    tx.commit().unwrap();
    let producer = cx.span().span_context().clone();
    cx.span().end();
    (key, producer)
}

fn relay_config(outbox: &Outbox, exchange: &str) -> RelayConfig {
    let publishing = PublisherConfig::new(&amqp_url(), exchange).unwrap();
    RelayConfig::new(outbox.clone(), pool(2), move || publishing.connect())
}

fn consumer_config(queue: &str, name: &str) -> ConsumerConfig {
    ConsumerConfig::new(&amqp_url(), queue, name)
        .retry(Retry::new(5).backoff(Duration::from_millis(10), Duration::from_millis(20)))
}

fn assert_messaging(span: &SpanData, exchange: &str, key: &str) {
    assert_eq!(
        attribute(span, "messaging.system"),
        string("rabbitmq").as_ref()
    );
    assert_eq!(
        attribute(span, "messaging.destination.name"),
        string(exchange).as_ref()
    );
    assert_eq!(
        attribute(span, "messaging.rabbitmq.destination.routing_key"),
        string("order.paid").as_ref()
    );
    assert_eq!(
        attribute(span, "messaging.message.id"),
        string(key).as_ref()
    );
}

/// One trace from the request to the handler: enqueue captured the request's context, the
/// relay's publish is its child, and the consumer's first handling is a child of the
/// request's span too, current while the handler runs. The handler fails once: its retry
/// starts a trace of its own, linked to the request's.
#[test]
fn the_consumers_span_is_the_producers_child_first_and_links_to_it_on_a_retry() {
    exporter();
    let (outbox, mut client) = outbox("otel_retry");
    let broker = Broker::new();
    let (exchange, queue) = broker.routed("otel_retry", amiquip::FieldTable::new());
    let (key, producer) = enqueue_in_a_request(&outbox, &mut client);

    // The row carries the request's context.
    let stored: Vec<String> = client
        .query_one(
            &format!("SELECT headers FROM {} WHERE key = $1", quoted(&outbox)),
            &[&key],
        )
        .unwrap()
        .get(0);
    let traceparent = format!("00-{}-{}-01", producer.trace_id(), producer.span_id());
    assert_eq!(stored, ["traceparent".to_owned(), traceparent.clone()]);

    assert_eq!(
        Relay::run_until_idle(&relay_config(&outbox, &exchange)).unwrap(),
        1
    );
    let published = spans_of(SpanKind::Producer, &key);
    assert_eq!(published.len(), 1, "{published:?}");
    let publish = &published[0];
    assert_eq!(publish.span_context.trace_id(), producer.trace_id());
    assert_eq!(publish.parent_span_id, producer.span_id());
    assert_eq!(publish.name, format!("publish {exchange}"));
    assert_messaging(publish, &exchange, &key);

    // What the handler sees as the current span, each time it runs.
    let current: Arc<Mutex<Vec<(TraceId, SpanId)>>> = Arc::default();
    let handler_current = current.clone();
    let consumer = Consumer::spawn(
        consumer_config(&queue, "otel_retry"),
        outbox.clone(),
        pool(2),
        move |_tx, delivery| {
            assert_eq!(delivery.traceparent(), Some(traceparent.as_str()));
            let cx = Context::current();
            let sc = cx.span().span_context().clone();
            let mut seen = handler_current.lock().unwrap();
            seen.push((sc.trace_id(), sc.span_id()));
            if seen.len() == 1 {
                return Err(HandlerError::transient("the first try fails"));
            }
            Ok(())
        },
    )
    .unwrap();
    wait_until("the message is handled on its retry", || {
        consumer.report().processed == 1
    });
    consumer.shutdown(Duration::from_secs(10)).unwrap();

    let handled = spans_of(SpanKind::Consumer, &key);
    assert_eq!(handled.len(), 2, "{handled:?}");
    let (first, retry) = (&handled[0], &handled[1]);
    for span in [first, retry] {
        assert_eq!(span.name, format!("process {exchange}"));
        assert_messaging(span, &exchange, &key);
    }
    assert_eq!(first.span_context.trace_id(), producer.trace_id());
    assert_eq!(first.parent_span_id, producer.span_id());
    assert!(first.parent_span_is_remote);
    assert!(first.links.links.is_empty());
    assert!(
        matches!(first.status, Status::Error { .. }),
        "{:?}",
        first.status
    );

    assert_ne!(retry.span_context.trace_id(), producer.trace_id());
    assert_eq!(retry.parent_span_id, SpanId::INVALID);
    let linked: Vec<(TraceId, SpanId)> = retry
        .links
        .links
        .iter()
        .map(|l| (l.span_context.trace_id(), l.span_context.span_id()))
        .collect();
    assert_eq!(linked, [(producer.trace_id(), producer.span_id())]);
    assert_eq!(retry.status, Status::Unset);

    // The handler ran inside each span.
    let ids = |s: &SpanData| (s.span_context.trace_id(), s.span_context.span_id());
    assert_eq!(*current.lock().unwrap(), [ids(first), ids(retry)]);
    broker.delete_queue(&queue);
    broker.delete_exchange(&exchange);
}

/// A delivery the broker redelivers (another consumer took it and gave it back) links to
/// the producer's context even on its first handling here; a message that carries its own
/// traceparent keeps it, whatever span enqueues it.
#[test]
fn a_redelivery_links_to_the_producers_context() {
    exporter();
    let (outbox, mut client) = outbox("otel_redelivered");
    let broker = Broker::new();
    let (exchange, queue) = broker.routed("otel_redelivered", amiquip::FieldTable::new());
    let given = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let tracer = global::tracer("the-web-app");
    let key = tracer.in_span("a request", |_| {
        let mut tx = client.transaction().unwrap();
        let key = outbox
            .enqueue(&mut tx, Message::new("order.paid", "{}").traceparent(given))
            .unwrap();
        tx.commit().unwrap();
        key
    });
    assert_eq!(
        Relay::run_until_idle(&relay_config(&outbox, &exchange)).unwrap(),
        1
    );
    let taken = broker
        .channel
        .basic_get(&queue, false)
        .unwrap()
        .expect("the published message");
    taken.delivery.nack(&broker.channel, true).unwrap();

    let redelivered = Arc::new(Mutex::new(None));
    let handler_redelivered = redelivered.clone();
    let consumer = Consumer::spawn(
        consumer_config(&queue, "otel_redelivered"),
        outbox.clone(),
        pool(2),
        move |_tx, delivery| {
            *handler_redelivered.lock().unwrap() = Some(delivery.redelivered);
            Ok(())
        },
    )
    .unwrap();
    wait_until("the message is handled", || {
        consumer.report().processed == 1
    });
    consumer.shutdown(Duration::from_secs(10)).unwrap();
    assert_eq!(*redelivered.lock().unwrap(), Some(true));

    let handled = spans_of(SpanKind::Consumer, &key);
    assert_eq!(handled.len(), 1, "{handled:?}");
    let span = &handled[0];
    let trace_id = TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").unwrap();
    assert_ne!(span.span_context.trace_id(), trace_id);
    assert_eq!(span.parent_span_id, SpanId::INVALID);
    let linked: Vec<(TraceId, SpanId)> = span
        .links
        .links
        .iter()
        .map(|l| (l.span_context.trace_id(), l.span_context.span_id()))
        .collect();
    assert_eq!(
        linked,
        [(trace_id, SpanId::from_hex("00f067aa0ba902b7").unwrap())]
    );
    assert_messaging(span, &exchange, &key);
    broker.delete_queue(&queue);
    broker.delete_exchange(&exchange);
}
