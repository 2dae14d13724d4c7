//! W3C Trace Context end to end: checked at enqueue, stored with the row, handed to
//! publishers, `process` handlers and the RabbitMQ consumer's handler.

mod common;

use std::sync::{Arc, Mutex};

use common::*;
use postgres_outbox::{Error, Message, Relay, TRACEPARENT};

const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const TRACEPARENT_VALUE: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

/// A message's key and the trace context a publisher or handler read from it.
type Seen = (String, Option<String>, Option<String>, Option<String>);

fn field(e: Error) -> &'static str {
    match e {
        Error::InvalidInput { field, .. } => field,
        other => panic!("expected InvalidInput, got {other:?}"),
    }
}

/// Each malformed context is refused before any SQL runs: the caller's transaction goes on
/// and commits its other work, and nothing of the refused message is stored.
#[test]
fn a_malformed_trace_context_is_refused_at_enqueue_and_the_transaction_stays_usable() {
    let (outbox, mut client) = outbox("trace_bad");
    let table = unique_name("trace_work");
    client
        .batch_execute(&format!("CREATE TABLE {table} (n int)"))
        .unwrap();
    let bad = [
        (
            Message::new("t", "p").traceparent("00-4bf92f3577b34da6a3ce929d0e0e4736"),
            "traceparent",
        ),
        (
            Message::new("t", "p")
                .traceparent("00-00000000000000000000000000000000-00f067aa0ba902b7-01"),
            "traceparent",
        ),
        (
            Message::new("t", "p").traceparent(TRACEPARENT_VALUE.to_uppercase()),
            "traceparent",
        ),
        (
            Message::new("t", "p").header(TRACEPARENT, format!("ff{}", &TRACEPARENT_VALUE[2..])),
            "traceparent",
        ),
        (Message::new("t", "p").tracestate("rojo=1"), "tracestate"),
        (
            Message::new("t", "p")
                .traceparent(TRACEPARENT_VALUE)
                .tracestate("Rojo=1"),
            "tracestate",
        ),
    ];
    let mut tx = client.transaction().unwrap();
    tx.execute(&format!("INSERT INTO {table} VALUES (1)"), &[])
        .unwrap();
    for (message, want) in bad {
        let e = outbox.enqueue(&mut tx, message.clone()).unwrap_err();
        assert!(e.is_invalid_input(), "{e}");
        assert_eq!(field(e), want);
        let e = outbox.enqueue_all(&mut tx, vec![message]).unwrap_err();
        assert_eq!(field(e), want);
    }
    tx.execute(&format!("INSERT INTO {table} VALUES (2)"), &[])
        .unwrap();
    tx.commit().unwrap();
    let rows: i64 = client
        .query_one(&format!("SELECT count(*) FROM {table}"), &[])
        .unwrap()
        .get(0);
    assert_eq!(rows, 2);
    assert_eq!(count(&mut client, &outbox, "true"), 0);
    client
        .batch_execute(&format!("DROP TABLE {table}"))
        .unwrap();
}

/// A publisher reads the producer's context from the record, and so does a `process`
/// handler; a message without one carries none (outside a span, with the feature on too).
#[test]
fn publishers_and_process_handlers_see_the_producers_trace_context() {
    let (outbox, mut client) = outbox("trace_seen");
    let enqueue_two = |outbox: &postgres_outbox::Outbox, client: &mut postgres::Client| {
        let mut tx = client.transaction().unwrap();
        outbox
            .enqueue(
                &mut tx,
                Message::new("order.paid", "{}")
                    .key("traced")
                    .traceparent(TRACEPARENT_VALUE)
                    .tracestate("rojo=00f067aa0ba902b7"),
            )
            .unwrap();
        outbox
            .enqueue(&mut tx, Message::new("order.paid", "{}").key("untraced"))
            .unwrap();
        tx.commit().unwrap();
    };
    enqueue_two(&outbox, &mut client);
    let seen: Arc<Mutex<Vec<Seen>>> = Arc::default();
    let publisher_seen = seen.clone();
    let config = relay_config(&outbox, move |record| {
        publisher_seen.lock().unwrap().push((
            record.key.clone(),
            record.traceparent().map(str::to_owned),
            record.tracestate().map(str::to_owned),
            record.trace_id().map(str::to_owned),
        ));
        Ok(())
    });
    assert_eq!(Relay::run_until_idle(&config).unwrap(), 2);
    let mut got = seen.lock().unwrap().clone();
    got.sort();
    let want = [
        (
            "traced".to_owned(),
            Some(TRACEPARENT_VALUE.to_owned()),
            Some("rojo=00f067aa0ba902b7".to_owned()),
            Some(TRACE_ID.to_owned()),
        ),
        ("untraced".to_owned(), None, None, None),
    ];
    assert_eq!(got, want);

    // Again, through `process`.
    let (outbox, mut client) = common::outbox("trace_processed");
    enqueue_two(&outbox, &mut client);
    let mut handled = Vec::new();
    let report = outbox
        .process(&mut client, 10, |_, record| {
            handled.push((
                record.key.clone(),
                record.traceparent().map(str::to_owned),
                record.tracestate().map(str::to_owned),
                record.trace_id().map(str::to_owned),
            ));
            Ok(())
        })
        .unwrap();
    assert_eq!(report.processed, 2);
    handled.sort();
    assert_eq!(handled, want);
}

/// Enqueued with a traceparent, relayed to RabbitMQ, handled by the crate's consumer: the
/// handler sees the producer's trace id and its context, as AMQP headers of those names.
#[cfg(feature = "rabbitmq")]
#[test]
fn the_consumers_handler_sees_the_producers_trace_id() {
    use std::time::Duration;

    use common::broker::Broker;
    use postgres_outbox::rabbitmq::{Consumer, ConsumerConfig, PublisherConfig};

    let (outbox, mut client) = outbox("trace_consumed");
    let broker = Broker::new();
    let (exchange, queue) = broker.routed("trace", amiquip::FieldTable::new());
    let mut tx = client.transaction().unwrap();
    let key = outbox
        .enqueue(
            &mut tx,
            Message::new("order.paid", "{}")
                .traceparent(TRACEPARENT_VALUE)
                .tracestate("rojo=00f067aa0ba902b7"),
        )
        .unwrap();
    tx.commit().unwrap();
    let publishing = PublisherConfig::new(&amqp_url(), &exchange).unwrap();
    let config =
        postgres_outbox::RelayConfig::new(outbox.clone(), pool(2), move || publishing.connect());
    assert_eq!(Relay::run_until_idle(&config).unwrap(), 1);

    let seen: Arc<Mutex<Vec<Seen>>> = Arc::default();
    let handler_seen = seen.clone();
    let consumer = Consumer::spawn(
        ConsumerConfig::new(&amqp_url(), &queue, "traced"),
        outbox.clone(),
        pool(2),
        move |_tx, delivery| {
            handler_seen.lock().unwrap().push((
                delivery.key.clone(),
                delivery.trace_id().map(str::to_owned),
                delivery.traceparent().map(str::to_owned),
                delivery.tracestate().map(str::to_owned),
            ));
            Ok(())
        },
    )
    .unwrap();
    wait_until("the message is handled", || {
        consumer.report().processed == 1
    });
    consumer.shutdown(Duration::from_secs(10)).unwrap();
    assert_eq!(
        *seen.lock().unwrap(),
        [(
            key,
            Some(TRACE_ID.to_owned()),
            Some(TRACEPARENT_VALUE.to_owned()),
            Some("rojo=00f067aa0ba902b7".to_owned()),
        )]
    );
    broker.delete_queue(&queue);
    broker.delete_exchange(&exchange);
}
