//! RabbitMQ end to end: the publisher against the real broker, and the consumer.
#![cfg(feature = "rabbitmq")]

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use amiquip::{AmqpProperties, AmqpValue, ExchangeDeclareOptions, ExchangeType, FieldTable};
use common::broker::{rabbitmqctl, Broker};
use common::*;
use postgres_outbox::rabbitmq::{
    Consumer, ConsumerConfig, ConsumerMetrics, Delivery, PublisherConfig, RabbitPublisher,
    AGGREGATE_HEADER, DEAD_FAILURES_HEADER, DEAD_QUEUE_HEADER, DEAD_REASON_HEADER,
};
use postgres_outbox::{
    Access, HandlerError, Message, Outbox, PublishError, Publisher, Record, Relay, RelayConfig,
    Retry,
};

/// A relay to `exchange` whose publishers are set up by `tune`, with short retry backoff.
fn relay_config(
    outbox: &Outbox,
    exchange: &str,
    tune: fn(PublisherConfig) -> PublisherConfig,
) -> RelayConfig {
    let publishing = tune(PublisherConfig::new(&amqp_url(), exchange).unwrap());
    RelayConfig::new(outbox.clone(), pool(4), move || publishing.connect())
        .retry(Retry::default().backoff(Duration::from_millis(10), Duration::from_millis(20)))
}

fn enqueue(client: &mut postgres::Client, outbox: &Outbox, messages: Vec<Message>) -> Vec<String> {
    let mut tx = client.transaction().unwrap();
    let keys = outbox.enqueue_all(&mut tx, messages).unwrap();
    tx.commit().unwrap();
    keys
}

fn header<'a>(properties: &'a AmqpProperties, name: &str) -> Option<&'a AmqpValue> {
    properties.headers().as_ref().and_then(|h| h.get(name))
}

#[test]
fn a_published_record_carries_every_property_and_header() {
    let (outbox, mut client) = outbox("rmq_props");
    let broker = Broker::new();
    let (exchange, queue) = broker.routed("props", FieldTable::new());

    let keys = enqueue(
        &mut client,
        &outbox,
        vec![Message::new("order.created", b"{\"id\":1}".to_vec())
            .key("order-1-created")
            .aggregate_key("order-1")
            .content_type("application/json")
            .header("tenant", "acme")],
    );
    let before = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs();
    assert_eq!(
        Relay::run_once(&relay_config(&outbox, &exchange, |p| p)).unwrap(),
        1
    );

    let got = broker.drain(&queue);
    assert_eq!(got.len(), 1);
    let m = &got[0];
    let p = &m.delivery.properties;
    assert_eq!(m.delivery.body, b"{\"id\":1}");
    assert_eq!(m.delivery.routing_key, "order.created");
    assert_eq!(m.delivery.exchange, exchange);
    assert_eq!(p.message_id().as_deref(), Some(keys[0].as_str()));
    assert_eq!(p.content_type().as_deref(), Some("application/json"));
    assert_eq!(*p.delivery_mode(), Some(2));
    let ts = p.timestamp().expect("timestamp");
    assert!(
        ts <= before + 1 && ts + 60 >= before,
        "timestamp {ts} vs {before}"
    );
    assert_eq!(
        header(p, "tenant"),
        Some(&AmqpValue::LongString("acme".into()))
    );
    assert_eq!(
        header(p, "x-outbox-attempt"),
        Some(&AmqpValue::LongLongInt(1))
    );
    assert_eq!(
        header(p, "x-outbox-aggregate-key"),
        Some(&AmqpValue::LongString("order-1".into()))
    );
    assert_eq!(row_state(&mut client, &outbox, &keys[0]).0, "sent");
    broker.delete_queue(&queue);
}

#[test]
fn a_publisher_config_builds_every_publisher_of_a_relay_with_its_settings() {
    let (outbox, mut client) = outbox("rmq_config");
    let broker = Broker::new();
    let (exchange, queue) = broker.routed("config", FieldTable::new());
    // A URL of its own: the test broker's may hold other credentials (nothing connects).
    let url = "amqp://guest:s3cret-never-shown@127.0.0.1:1";
    assert!(
        PublisherConfig::new(url, &exchange).is_ok_and(|c| !format!("{c:?}").contains("s3cret")),
        "Debug shows no password"
    );
    let publishing = PublisherConfig::new(&amqp_url(), &exchange)
        .unwrap()
        .first_attempt_header(false)
        .confirm_timeout(Duration::from_secs(5));
    // A wrong exchange fails at connect, before any row is taken.
    assert!(PublisherConfig::new(&amqp_url(), "no-such-exchange")
        .unwrap()
        .connect()
        .is_err());
    enqueue(
        &mut client,
        &outbox,
        vec![Message::new("t", b"x".to_vec()).key("configured")],
    );
    let config = RelayConfig::new(outbox.clone(), pool(4), move || publishing.connect());
    assert_eq!(Relay::run_once(&config).unwrap(), 1);
    let got = broker.drain(&queue);
    assert_eq!(got.len(), 1);
    // The setting reached the publisher the relay built: no header on a first attempt.
    assert_eq!(*got[0].delivery.properties.headers(), None);
    broker.delete_queue(&queue);
}

#[test]
fn every_message_carries_its_attempt_unless_first_attempts_are_asked_to_go_bare() {
    let (outbox, mut client) = outbox("rmq_attempt");
    let broker = Broker::new();
    let (exchange, queue) = broker.routed("attempt", FieldTable::new());
    let publish = |client: &mut postgres::Client, key: &str, earlier: i32, bare: bool| {
        enqueue(
            client,
            &outbox,
            vec![Message::new("t", b"x".to_vec()).key(key)],
        );
        client
            .execute(
                &format!(
                    "UPDATE {} SET attempts = $1 WHERE key = $2",
                    quoted(&outbox)
                ),
                &[&earlier, &key],
            )
            .unwrap();
        let tune = if bare {
            |p: PublisherConfig| p.first_attempt_header(false)
        } else {
            |p| p
        };
        assert_eq!(
            Relay::run_once(&relay_config(&outbox, &exchange, tune)).unwrap(),
            1
        );
        let got = broker.drain(&queue);
        assert_eq!(got.len(), 1);
        got[0].delivery.properties.clone()
    };

    // By default every message says its attempt, the first included.
    let first = publish(&mut client, "first", 0, false);
    assert_eq!(
        header(&first, "x-outbox-attempt"),
        Some(&AmqpValue::LongLongInt(1))
    );
    let second = publish(&mut client, "second", 1, false);
    assert_eq!(
        header(&second, "x-outbox-attempt"),
        Some(&AmqpValue::LongLongInt(2))
    );
    // Bare first attempts: a message without headers or aggregate carries no header table,
    // and a later attempt still says which it is.
    let bare = publish(&mut client, "bare", 0, true);
    assert_eq!(*bare.headers(), None);
    let bare_second = publish(&mut client, "bare-second", 1, true);
    assert_eq!(
        header(&bare_second, "x-outbox-attempt"),
        Some(&AmqpValue::LongLongInt(2))
    );
    broker.delete_queue(&queue);
}

#[test]
fn an_unroutable_message_is_a_failed_attempt_by_default() {
    let (outbox, mut client) = outbox("rmq_unroutable");
    let broker = Broker::new();
    let exchange = unique_name("x_nobody");
    broker.exchange(&exchange);
    let keys = enqueue(
        &mut client,
        &outbox,
        vec![Message::new("nowhere", b"x".to_vec()).max_attempts(2)],
    );
    // The publisher as it comes: mandatory unless told otherwise.
    let config = relay_config(&outbox, &exchange, |p| p);

    assert_eq!(Relay::run_once(&config).unwrap(), 1);
    assert_eq!(
        row_state(&mut client, &outbox, &keys[0]),
        ("pending".into(), 1)
    );
    let error: String = client
        .query_one(
            &format!("SELECT last_error FROM {} WHERE key = $1", quoted(&outbox)),
            &[&keys[0]],
        )
        .unwrap()
        .get(0);
    assert!(error.contains("unroutable"), "{error}");

    // Retried after its backoff, then dead on its last attempt.
    wait_until("the retry is due", || {
        Relay::run_once(&config).unwrap() == 1
    });
    assert_eq!(
        row_state(&mut client, &outbox, &keys[0]),
        ("dead".into(), 2)
    );
    broker.delete_exchange(&exchange);
}

/// Queue arguments under which the broker takes `n` messages and nacks every one after.
fn nacking_after(n: i32) -> FieldTable {
    let mut arguments = FieldTable::new();
    arguments.insert("x-max-length".into(), AmqpValue::LongInt(n));
    arguments.insert(
        "x-overflow".into(),
        AmqpValue::LongString("reject-publish".into()),
    );
    arguments
}

#[test]
fn forced_nacks_fail_exactly_the_overflowed_records() {
    let (outbox, mut client) = outbox("rmq_nack");
    let broker = Broker::new();
    let (exchange, queue) = broker.routed("nack", nacking_after(5));

    let keys = enqueue(
        &mut client,
        &outbox,
        (0..8).map(|i| Message::new("t", vec![i])).collect(),
    );
    let config = relay_config(&outbox, &exchange, |p| p.mandatory(false))
        .batch_size(8)
        .concurrency(1);
    assert_eq!(Relay::run_once(&config).unwrap(), 8);

    let states: Vec<String> = keys
        .iter()
        .map(|k| row_state(&mut client, &outbox, k).0)
        .collect();
    assert_eq!(&states[..5], ["sent"; 5]);
    assert_eq!(&states[5..], ["pending"; 3]);
    assert_eq!(broker.ready(&queue), 5);

    // Room again: the nacked ones go out on retry, and only they.
    let first: Vec<Vec<u8>> = broker
        .drain(&queue)
        .into_iter()
        .map(|g| g.delivery.body)
        .collect();
    assert_eq!(first, (0..5u8).map(|i| vec![i]).collect::<Vec<_>>());
    wait_until("the retries are published", || {
        let _ = Relay::run_once(&config).unwrap();
        count(&mut client, &outbox, "status = 'sent'") == 8
    });
    // Messages without an aggregate key keep no order, and each retry has a jittered
    // backoff: compare what went out, not in which order.
    let mut second: Vec<Vec<u8>> = broker
        .drain(&queue)
        .into_iter()
        .map(|g| g.delivery.body)
        .collect();
    second.sort();
    assert_eq!(second, (5..8u8).map(|i| vec![i]).collect::<Vec<_>>());
    broker.delete_queue(&queue);
}

#[test]
fn an_over_long_topic_is_rejected_before_sending_and_the_batch_still_goes() {
    let (outbox, mut client) = outbox("rmq_long");
    let broker = Broker::new();
    let (exchange, queue) = broker.routed("long", FieldTable::new());

    let mut keys = enqueue(
        &mut client,
        &outbox,
        vec![Message::new("ok.before", b"1".to_vec())],
    );
    // enqueue refuses such a topic, so write the row the way another producer might.
    client
        .execute(
            &format!(
                "INSERT INTO {} (key, topic, payload) VALUES ('long-topic', $1, '\\x00')",
                quoted(&outbox)
            ),
            &[&"t".repeat(300)],
        )
        .unwrap();
    keys.extend(enqueue(
        &mut client,
        &outbox,
        vec![Message::new("ok.after", b"2".to_vec())],
    ));

    let config = relay_config(&outbox, &exchange, |p| p)
        .batch_size(10)
        .concurrency(1);
    assert_eq!(Relay::run_once(&config).unwrap(), 3);
    assert_eq!(row_state(&mut client, &outbox, "long-topic").0, "dead");
    for key in &keys {
        assert_eq!(row_state(&mut client, &outbox, key).0, "sent");
    }
    let topics: Vec<String> = broker
        .drain(&queue)
        .into_iter()
        .map(|g| g.delivery.routing_key)
        .collect();
    assert_eq!(topics, ["ok.before", "ok.after"]);
    broker.delete_queue(&queue);
}

/// Publishes the first half of its first batch, has the broker close every connection of
/// the vhost, then publishes the second half on the dead connection.
struct ClosesMidBatch {
    inner: RabbitPublisher,
    armed: Arc<AtomicBool>,
    vhost: String,
}

impl Publisher for ClosesMidBatch {
    fn publish(&mut self, batch: &[Record]) -> Vec<Result<(), PublishError>> {
        if batch.len() < 2 || !self.armed.swap(false, Ordering::SeqCst) {
            return self.inner.publish(batch);
        }
        let (first, second) = batch.split_at(batch.len() / 2);
        let mut results = self.inner.publish(first);
        rabbitmqctl(&[
            "close_all_connections",
            "-p",
            &self.vhost,
            "test: connection lost",
        ]);
        results.extend(self.inner.publish(second));
        results
    }

    fn is_broken(&self) -> bool {
        self.inner.is_broken()
    }
}

#[test]
fn a_connection_closed_mid_batch_loses_nothing_and_duplicates_only_the_unconfirmed() {
    // Its own vhost, so closing its connections does not disturb tests running alongside.
    let vhost = unique_name("vh_close");
    rabbitmqctl(&["add_vhost", &vhost]);
    rabbitmqctl(&["set_permissions", "-p", &vhost, "guest", ".*", ".*", ".*"]);
    let url = format!("{}/{vhost}", amqp_url().trim_end_matches('/'));
    let broker = Broker::at(&url);
    broker.exchange("events");
    broker.queue("all", "events", FieldTable::new());
    drop(broker);

    let (outbox, mut client) = outbox("rmq_close");
    let total = 1000;
    let keys = enqueue(
        &mut client,
        &outbox,
        (0..total)
            .map(|i| Message::new("t", vec![0u8; 64]).key(format!("k{i}")))
            .collect(),
    );
    let armed = Arc::new(AtomicBool::new(true));
    let (publisher_url, publisher_vhost, publisher_armed) =
        (url.clone(), vhost.clone(), armed.clone());
    let config = RelayConfig::new(outbox.clone(), pool(4), move || {
        RabbitPublisher::connect(&publisher_url, "events").map(|inner| ClosesMidBatch {
            inner,
            armed: publisher_armed.clone(),
            vhost: publisher_vhost.clone(),
        })
    })
    .batch_size(50)
    .concurrency(2)
    .notify(false)
    .poll_interval(Duration::from_millis(50))
    .retry(Retry::default().backoff(Duration::from_millis(10), Duration::from_millis(50)));
    let relay = Relay::spawn(config).unwrap();
    wait_until("every row is sent", || {
        count(&mut client, &outbox, "status = 'sent'") == total as i64
    });
    relay.shutdown(Duration::from_secs(10)).unwrap();
    assert!(
        !armed.load(Ordering::SeqCst),
        "the connection was never closed"
    );
    // The connection closed under the batch: the broker's doing, not the records'. Those
    // not confirmed went back without costing an attempt.
    assert_eq!(count(&mut client, &outbox, "attempts > 1"), 0);

    let broker = Broker::at(&url);
    wait_until("every message is queued", || {
        broker.ready("all") >= total as u32
    });
    let mut seen: HashMap<String, usize> = HashMap::new();
    for message in broker.drain("all") {
        let key = message
            .delivery
            .properties
            .message_id()
            .clone()
            .expect("message id");
        *seen.entry(key).or_default() += 1;
    }
    assert!(keys.iter().all(|k| seen.contains_key(k)), "a row was lost");
    // Only what was in flight on the closed connections can have gone out twice: the
    // second half of the batch, published on the dead connection, and the other worker's
    // batch.
    let twice: usize = seen.values().filter(|n| **n > 1).count();
    assert!(twice <= 2 * 50, "{twice} keys delivered more than once");
    assert!(
        seen.values().all(|n| *n <= 2),
        "a key delivered three times"
    );
    drop(broker);
    rabbitmqctl(&["delete_vhost", &vhost]);
}

/// A consumer table the handler writes to, so tests can see what committed.
fn handled_table(client: &mut postgres::Client) -> String {
    let table = unique_name("handled");
    client
        .batch_execute(&format!("CREATE TABLE {table} (key text PRIMARY KEY)"))
        .unwrap();
    table
}

/// The handler's own write: one row per message it handled.
fn record_handled(
    tx: &mut postgres::Transaction<'_>,
    table: &str,
    key: &str,
) -> Result<(), HandlerError> {
    tx.execute(&format!("INSERT INTO {table} (key) VALUES ($1)"), &[&key])
        .map_err(HandlerError::transient)?;
    Ok(())
}

#[test]
fn the_consumer_skips_redeliveries_of_processed_messages() {
    let (outbox, mut client) = outbox("rmq_consume");
    let table = handled_table(&mut client);
    let broker = Broker::new();
    let queue = broker.plain_queue("consume");
    let calls = Arc::new(AtomicUsize::new(0));

    let handler_table = table.clone();
    let handler_calls = calls.clone();
    let consumer = Consumer::spawn(
        ConsumerConfig::new(&amqp_url(), &queue, "billing"),
        outbox.clone(),
        pool(2),
        move |tx, delivery| {
            handler_calls.fetch_add(1, Ordering::SeqCst);
            record_handled(tx, &handler_table, &delivery.key)
        },
    )
    .unwrap();
    broker.send(&queue, Some("m-1"), b"a");
    broker.send(&queue, Some("m-1"), b"a"); // the broker delivering it again
    broker.send(&queue, Some("m-2"), b"b");
    wait_until("all three are acked", || {
        let r = consumer.report();
        r.processed + r.duplicates == 3
    });
    let report = consumer.shutdown(Duration::from_secs(10)).unwrap();
    assert_eq!((report.processed, report.duplicates), (2, 1));
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    let rows: i64 = client
        .query_one(&format!("SELECT count(*) FROM {table}"), &[])
        .unwrap()
        .get(0);
    assert_eq!(rows, 2);
    assert_eq!(broker.ready(&queue), 0);
    broker.delete_queue(&queue);
}

/// A consumer under a role of its own, with the rights `Outbox::grants` gives it (and the
/// handler's own table): it dedupes, and counts a failure and forgets it
/// once the message is processed.
#[test]
fn a_consumer_works_with_the_rights_the_readme_gives_it() {
    let (outbox, mut client) = outbox("rmq_role");
    let table = handled_table(&mut client);
    let role = Role::new(&mut client);
    role.grant(&mut client, &outbox, Access::Consume);
    role.execute(&mut client, &format!("GRANT INSERT ON {table} TO {{role}}"));
    let broker = Broker::new();
    let queue = broker.plain_queue("role");
    let failed_once = Arc::new(AtomicBool::new(false));

    let handler_table = table.clone();
    let handler_failed = failed_once.clone();
    let consumer = Consumer::spawn(
        ConsumerConfig::new(&amqp_url(), &queue, "billing")
            .retry(Retry::new(5).backoff(Duration::from_millis(10), Duration::from_millis(20))),
        outbox.clone(),
        role.pool(),
        move |tx, delivery| {
            if delivery.key == "flaky" && !handler_failed.swap(true, Ordering::SeqCst) {
                return Err(HandlerError::transient("not yet"));
            }
            record_handled(tx, &handler_table, &delivery.key)
        },
    )
    .unwrap();
    broker.send(&queue, Some("m-1"), b"a");
    broker.send(&queue, Some("m-1"), b"a");
    broker.send(&queue, Some("flaky"), b"b");
    wait_until("every delivery is acked", || {
        let r = consumer.report();
        r.processed + r.duplicates == 3
    });
    let report = consumer.shutdown(Duration::from_secs(10)).unwrap();
    assert_eq!(
        (report.processed, report.duplicates, report.retried),
        (2, 1, 1)
    );
    let rows: i64 = client
        .query_one(&format!("SELECT count(*) FROM {table}"), &[])
        .unwrap()
        .get(0);
    assert_eq!(rows, 2);
    let failures: i64 = client
        .query_one(
            &format!("SELECT count(*) FROM {}", quoted_with(&outbox, "_failures")),
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(failures, 0, "the failure is forgotten once processed");
    broker.delete_queue(&queue);
}

/// Drops the consumer's dedupe table from under it: a consumer that cannot go on.
fn drop_inbox(client: &mut postgres::Client, outbox: &Outbox) {
    client
        .batch_execute(&format!("DROP TABLE {}", quoted_with(outbox, "_inbox")))
        .unwrap();
}

#[test]
fn a_consumer_whose_tables_are_dropped_stops_on_its_own_and_hands_its_deliveries_back() {
    let (outbox, mut client) = outbox("rmq_join");
    let table = handled_table(&mut client);
    let broker = Broker::new();
    let queue = broker.plain_queue("join");
    let handler_table = table.clone();
    let consumer = Consumer::spawn(
        ConsumerConfig::new(&amqp_url(), &queue, "billing"),
        outbox.clone(),
        pool(2),
        move |tx, delivery| record_handled(tx, &handler_table, &delivery.key),
    )
    .unwrap();
    broker.send(&queue, Some("m-1"), b"a");
    wait_until("m-1 is handled", || consumer.report().processed == 1);
    assert!(!consumer.has_stopped());

    drop_inbox(&mut client, &outbox);
    broker.send(&queue, Some("m-2"), b"b");
    // What a caller waiting on something else polls.
    wait_until("the consumer says it stopped", || consumer.has_stopped());
    let joined = std::thread::spawn(move || consumer.join());
    wait_until("the consumer stops on its own", || joined.is_finished());
    match joined.join().unwrap() {
        Err(postgres_outbox::rabbitmq::Error::Database(e)) => {
            assert!(e.is_not_migrated(), "{e}")
        }
        other => panic!("expected the tables' absence, got {other:?}"),
    }
    // m-2 was neither handled nor acked: it is back in the queue for the next consumer.
    wait_until("m-2 is back in the queue", || broker.ready(&queue) == 1);
    let rows: i64 = client
        .query_one(&format!("SELECT count(*) FROM {table}"), &[])
        .unwrap()
        .get(0);
    assert_eq!(rows, 1);
    broker.delete_queue(&queue);
}

#[test]
fn a_consumer_shut_down_checked_reports_what_it_did_or_why_it_stopped() {
    let (outbox, mut client) = outbox("rmq_checked");
    let broker = Broker::new();
    let queue = broker.plain_queue("checked");
    let spawn = || {
        Consumer::spawn(
            ConsumerConfig::new(&amqp_url(), &queue, "billing"),
            outbox.clone(),
            pool(1),
            |_tx, _delivery| Ok(()),
        )
        .unwrap()
    };
    let consumer = spawn();
    broker.send(&queue, Some("m-1"), b"a");
    wait_until("m-1 is handled", || consumer.report().processed == 1);
    let report = consumer.shutdown(Duration::from_secs(10)).unwrap();
    assert_eq!(report.processed, 1);

    let consumer = spawn();
    drop_inbox(&mut client, &outbox);
    broker.send(&queue, Some("m-2"), b"b");
    wait_until("the consumer stops on its own", || consumer.has_stopped());
    let err = consumer.shutdown(Duration::from_secs(10)).unwrap_err();
    assert!(
        matches!(&err, postgres_outbox::rabbitmq::Error::Database(e) if e.is_not_migrated()),
        "{err}"
    );
    broker.delete_queue(&queue);
}

#[test]
fn poison_is_rejected_to_the_queues_dead_letter_exchange_when_asked() {
    let (outbox, _client) = outbox("rmq_fail");
    let broker = Broker::new();
    let queue = unique_name("q_fail");
    let dead = unique_name("q_dead");
    broker.queue(&dead, "", FieldTable::new());
    let mut arguments = FieldTable::new();
    arguments.insert(
        "x-dead-letter-exchange".into(),
        AmqpValue::LongString(String::new()),
    );
    arguments.insert(
        "x-dead-letter-routing-key".into(),
        AmqpValue::LongString(dead.clone()),
    );
    broker.queue(&queue, "", arguments);
    let calls = Arc::new(AtomicUsize::new(0));

    let handler_calls = calls.clone();
    let consumer = Consumer::spawn(
        ConsumerConfig::new(&amqp_url(), &queue, "fails")
            .retry(Retry::new(3).backoff(Duration::from_millis(10), Duration::from_millis(20)))
            .dead_letter_exchange(),
        outbox.clone(),
        pool(2),
        move |_tx, _delivery| {
            handler_calls.fetch_add(1, Ordering::SeqCst);
            Err(HandlerError::transient("downstream unavailable"))
        },
    )
    .unwrap();
    broker.send(&queue, Some("poison"), b"x");
    wait_until("the message is dead-lettered", || broker.ready(&dead) == 1);
    let report = consumer.shutdown(Duration::from_secs(10)).unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 3);
    assert_eq!(
        (report.retried, report.rejected, report.processed),
        (2, 1, 0)
    );
    assert_eq!(broker.ready(&queue), 0);
    let dead_letter = broker.drain(&dead);
    assert_eq!(
        dead_letter[0].delivery.properties.message_id().as_deref(),
        Some("poison")
    );
    broker.delete_queue(&queue);
    broker.delete_queue(&dead);
}

#[test]
fn consumer_shutdown_mid_stream_acks_exactly_what_committed() {
    let (outbox, mut client) = outbox("rmq_stop");
    let table = handled_table(&mut client);
    let broker = Broker::new();
    let queue = broker.plain_queue("stop");
    let total = 40;
    for i in 0..total {
        broker.send(&queue, Some(&format!("m{i}")), b"x");
    }
    let (started_tx, started_rx) = crossbeam_channel::unbounded::<()>();
    let handler_table = table.clone();
    let consumer = Consumer::spawn(
        ConsumerConfig::new(&amqp_url(), &queue, "slow")
            .prefetch(10)
            .concurrency(4),
        outbox.clone(),
        pool(4),
        move |tx, delivery| {
            let _ = started_tx.send(());
            std::thread::sleep(Duration::from_millis(20));
            record_handled(tx, &handler_table, &delivery.key)
        },
    )
    .unwrap();
    for _ in 0..5 {
        started_rx
            .recv_timeout(Duration::from_secs(60))
            .expect("handler runs");
    }
    let report = consumer.shutdown(Duration::from_secs(10)).unwrap();
    let committed: i64 = client
        .query_one(&format!("SELECT count(*) FROM {table}"), &[])
        .unwrap()
        .get(0);
    assert!(
        committed >= 4 && committed < total as i64,
        "committed {committed}"
    );
    assert_eq!(report.processed, committed as u64);
    // Everything not committed is back on the queue, nothing committed is.
    wait_until("the unacked deliveries are requeued", || {
        broker.ready(&queue) as i64 == total as i64 - committed
    });
    broker.delete_queue(&queue);
}

/// A `RabbitPublisher` that notes which of its methods each call was.
struct Counting(RabbitPublisher, Arc<Mutex<Vec<&'static str>>>);

impl Publisher for Counting {
    fn publish(&mut self, batch: &[Record]) -> Vec<Result<(), PublishError>> {
        self.1.lock().unwrap().push("publish");
        self.0.publish(batch)
    }

    fn is_broken(&self) -> bool {
        self.0.is_broken()
    }

    fn keeps_order(&self) -> bool {
        self.0.keeps_order()
    }

    fn publish_in_order(
        &mut self,
        batch: &[Record],
        outcomes: &mut [Option<Result<(), PublishError>>],
        proceed: &dyn Fn() -> bool,
    ) {
        self.1.lock().unwrap().push("publish_in_order");
        self.0.publish_in_order(batch, outcomes, proceed)
    }
}

#[test]
fn runs_of_several_aggregates_reach_the_queue_in_order_streamed_and_pipelined() {
    // One worker, one batch holding every run: one call either way, the runs streamed (each
    // aggregate's next message once its last is confirmed) or pipelined.
    for (pipeline, calls_expected) in [(false, "publish_in_order"), (true, "publish")] {
        let (outbox, mut client) = outbox("rmq_rounds");
        let broker = Broker::new();
        let (exchange, queue) = broker.routed("rounds", FieldTable::new());
        let mut messages = Vec::new();
        for seq in 0..20 {
            for aggregate in ["a", "b", "c"] {
                messages.push(
                    Message::new("t", seq.to_string())
                        .key(format!("{aggregate}-{seq}"))
                        .aggregate_key(aggregate),
                );
            }
        }
        enqueue(&mut client, &outbox, messages);
        let calls = Arc::new(Mutex::new(Vec::new()));
        let config = {
            let calls = calls.clone();
            let publishing = PublisherConfig::new(&amqp_url(), &exchange)
                .unwrap()
                .confirm_timeout(Duration::MAX);
            RelayConfig::new(outbox.clone(), pool(4), move || {
                publishing.connect().map(|p| Counting(p, calls.clone()))
            })
        }
        .pipeline_runs(pipeline)
        .batch_size(60)
        .concurrency(1);
        assert_eq!(Relay::run_until_idle(&config).unwrap(), 60);
        assert_eq!(*calls.lock().unwrap(), [calls_expected]);

        let mut seen: HashMap<String, Vec<u32>> = HashMap::new();
        for got in broker.drain(&queue) {
            let key = got.delivery.properties.message_id().clone().expect("key");
            let (aggregate, seq) = key.split_once('-').expect("aggregate-seq");
            seen.entry(aggregate.to_owned())
                .or_default()
                .push(seq.parse().expect("seq"));
        }
        for aggregate in ["a", "b", "c"] {
            assert_eq!(seen[aggregate], (0..20).collect::<Vec<_>>(), "{aggregate}");
        }
        broker.delete_queue(&queue);
    }
}

/// Records keyed `<aggregate>-<n>`, or `u-<n>` for none, each with its aggregate key.
fn keyed(keys: &[&str]) -> Vec<Record> {
    keys.iter()
        .map(|key| {
            let mut record = Record::new(*key, "t", key.as_bytes().to_vec());
            let aggregate = key.split('-').next().unwrap_or_default();
            if aggregate != "u" {
                record.aggregate_key = Some(aggregate.to_owned());
            }
            record
        })
        .collect()
}

/// Streams `records` in order and returns each one's outcome: "ok", "failed" (costs an
/// attempt), "down" (unavailable) or "-" (not handed over).
fn stream(publisher: &mut RabbitPublisher, records: &[Record]) -> Vec<&'static str> {
    let mut outcomes: Vec<Option<Result<(), PublishError>>> =
        records.iter().map(|_| None).collect();
    publisher.publish_in_order(records, &mut outcomes, &|| true);
    outcomes
        .iter()
        .map(|o| match o {
            None => "-",
            Some(Ok(())) => "ok",
            Some(Err(e)) if e.is_unavailable() => "down",
            Some(Err(_)) => "failed",
        })
        .collect()
}

#[test]
fn a_stream_ends_an_aggregate_at_its_first_nack_and_goes_on_with_the_others() {
    let broker = Broker::new();
    let (exchange, queue) = broker.routed("stream_nack", nacking_after(5));
    let mut publisher = PublisherConfig::new(&amqp_url(), &exchange)
        .unwrap()
        .mandatory(false)
        .connect()
        .unwrap();
    // Confirm-round order, as the relay hands a batch over.
    let records = keyed(&["a-0", "b-0", "a-1", "b-1", "a-2", "b-2", "a-3", "b-3"]);
    let outcomes = stream(&mut publisher, &records);

    // The queue takes five; whichever aggregate's message comes next is nacked, and that
    // aggregate's stream ends there, while the other's goes on until it is nacked too.
    assert_eq!(
        outcomes.iter().filter(|o| **o == "ok").count(),
        5,
        "{outcomes:?}"
    );
    for aggregate in ["a", "b"] {
        let of: Vec<&str> = records
            .iter()
            .zip(&outcomes)
            .filter(|(r, _)| r.aggregate_key.as_deref() == Some(aggregate))
            .map(|(_, o)| *o)
            .collect();
        let sent = of.iter().take_while(|o| **o == "ok").count();
        let rest: Vec<&str> = of[sent..].to_vec();
        if let Some((first, after)) = rest.split_first() {
            assert_eq!(*first, "failed", "{aggregate}: {of:?}");
            assert!(after.iter().all(|o| *o == "-"), "{aggregate}: {of:?}");
        }
    }
    let mut seen: HashMap<String, Vec<String>> = HashMap::new();
    for got in broker.drain(&queue) {
        let key = got.delivery.properties.message_id().clone().expect("key");
        seen.entry(key[..1].to_owned()).or_default().push(key);
    }
    for (aggregate, keys) in &seen {
        let expected: Vec<String> = (0..keys.len())
            .map(|i| format!("{aggregate}-{i}"))
            .collect();
        assert_eq!(keys, &expected, "each aggregate's prefix, in order");
    }
    broker.delete_queue(&queue);
    broker.delete_exchange(&exchange);
}

#[test]
fn a_returned_record_in_a_stream_is_its_own_failed_attempt() {
    let broker = Broker::new();
    let exchange = unique_name("x_stream_nobody");
    broker.exchange(&exchange);
    let mut publisher = RabbitPublisher::connect(&amqp_url(), &exchange).unwrap();
    let records = keyed(&["a-0", "b-0", "u-0", "a-1"]);
    // Nothing is bound: every message handed over comes back unroutable, and a's second is
    // never handed over.
    assert_eq!(
        stream(&mut publisher, &records),
        ["failed", "failed", "failed", "-"]
    );
    assert!(!publisher.is_broken());

    // The same publisher streams on once a queue is bound: the returns were all settled.
    let queue = unique_name("q_stream_bound");
    broker.queue(&queue, &exchange, FieldTable::new());
    assert_eq!(stream(&mut publisher, &records), ["ok"; 4]);
    let keys: Vec<String> = broker
        .drain(&queue)
        .into_iter()
        .filter_map(|g| g.delivery.properties.message_id().clone())
        .collect();
    assert_eq!(keys.len(), 4);
    let a: Vec<&String> = keys.iter().filter(|k| k.starts_with("a-")).collect();
    assert_eq!(a, ["a-0", "a-1"]);
    broker.delete_queue(&queue);
    broker.delete_exchange(&exchange);
}

#[test]
fn a_database_outage_mid_stream_loses_nothing_and_handles_each_message_once() {
    // The consumer gets a database of its own, so its outage disturbs no other test.
    let db = unique_name("outage");
    let mut admin = client();
    admin
        .batch_execute(&format!("CREATE DATABASE {db}"))
        .unwrap();
    let base = database_url();
    let (server, _) = base
        .rsplit_once('/')
        .expect("a database URL ends in /<database>");
    let url = format!("{server}/{db}");
    let mut local = postgres::Client::connect(&url, postgres::NoTls).unwrap();
    let outbox = Outbox::new("outage_outbox").unwrap();
    outbox.migrate(&mut local).unwrap();
    let table = handled_table(&mut local);
    drop(local);
    let pool = r2d2::Pool::builder()
        .max_size(2)
        .min_idle(Some(0))
        .connection_timeout(Duration::from_secs(1))
        .build(r2d2_postgres::PostgresConnectionManager::new(
            url.parse().unwrap(),
            postgres::NoTls,
        ))
        .unwrap();

    // No dead-letter exchange: a rejected message would be gone.
    let broker = Broker::new();
    let queue = broker.plain_queue("outage");
    let calls = Arc::new(AtomicUsize::new(0));
    let (handler_table, handler_calls) = (table.clone(), calls.clone());
    let consumer = Consumer::spawn(
        ConsumerConfig::new(&amqp_url(), &queue, "outage")
            .retry(Retry::new(2).backoff(Duration::from_secs(1), Duration::from_secs(60))),
        outbox,
        pool,
        move |tx, delivery| {
            handler_calls.fetch_add(1, Ordering::SeqCst);
            record_handled(tx, &handler_table, &delivery.key)
        },
    )
    .unwrap();
    broker.send(&queue, Some("m-1"), b"a");
    wait_until("the first is processed", || {
        consumer.report().processed == 1
    });

    // The outage: no new connections, and the open ones cut.
    admin
        .batch_execute(&format!(
            "ALTER DATABASE {db} ALLOW_CONNECTIONS false;
             SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{db}';"
        ))
        .unwrap();
    broker.send(&queue, Some("m-2"), b"b");
    broker.send(&queue, Some("m-3"), b"c");
    wait_until("the consumer holds both", || broker.ready(&queue) == 0);
    // Long enough for several tries against the dead database (pacing the fault only).
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(
        consumer.report().rejected,
        0,
        "an outage rejected a message"
    );
    admin
        .batch_execute(&format!("ALTER DATABASE {db} ALLOW_CONNECTIONS true"))
        .unwrap();

    wait_until("all three are processed", || {
        consumer.report().processed == 3
    });
    let report = consumer.shutdown(Duration::from_secs(10)).unwrap();
    assert_eq!(
        (report.processed, report.retried, report.rejected),
        (3, 0, 0)
    );
    assert_eq!(calls.load(Ordering::SeqCst), 3, "each handled once");
    assert_eq!(broker.ready(&queue), 0);
    let mut local = postgres::Client::connect(&url, postgres::NoTls).unwrap();
    let rows: i64 = local
        .query_one(&format!("SELECT count(*) FROM {table}"), &[])
        .unwrap()
        .get(0);
    assert_eq!(rows, 3);
    drop(local);
    broker.delete_queue(&queue);
    admin
        .batch_execute(&format!("DROP DATABASE {db} WITH (FORCE)"))
        .unwrap();
}

#[test]
fn a_consumer_name_longer_than_a_short_string_is_refused_before_connecting() {
    let (outbox, _client) = outbox("rmq_name");
    let long = "n".repeat(postgres_outbox::MAX_SHORT_STRING + 1);
    // The broker URL is never reached: the name is checked first.
    let refused = Consumer::spawn(
        ConsumerConfig::new("amqp://guest:guest@127.0.0.1:1", "q", &long),
        outbox,
        pool(1),
        |_tx, _delivery| Ok(()),
    );
    let error = refused.expect_err("refused");
    assert!(error.to_string().contains("consumer name"), "{error}");
}

#[test]
fn an_oversize_body_or_header_fails_alone_and_permanently() {
    let (outbox, mut client) = outbox("rmq_oversize");
    let broker = Broker::new();
    let (exchange, queue) = broker.routed("oversize", FieldTable::new());
    let keys = enqueue(
        &mut client,
        &outbox,
        vec![
            Message::new("ok.before", b"1".to_vec()).key("before"),
            Message::new("big.body", vec![b'x'; 4096]).key("big-body"),
            Message::new("big.header", b"3".to_vec()).key("big-header"),
            Message::new("ok.after", b"4".to_vec()).key("after"),
        ],
    );
    // More than one AMQP frame (128 KiB) of headers: enqueue refuses so many, but a row
    // written by hand (or before that check) may have them.
    client
        .execute(
            &format!(
                "UPDATE {} SET headers = ARRAY['blob', repeat('h', 200000)] \
                 WHERE key = 'big-header'",
                quoted(&outbox)
            ),
            &[],
        )
        .unwrap();
    // A broker whose max_message_size is 1 KiB, as far as the publisher knows.
    let config = relay_config(&outbox, &exchange, |p| p.max_message_size(1024))
        .batch_size(10)
        .concurrency(1);
    assert_eq!(Relay::run_once(&config).unwrap(), 4);
    assert_eq!(keys.len(), 4);
    assert_eq!(
        row_state(&mut client, &outbox, "before"),
        ("sent".into(), 1)
    );
    assert_eq!(row_state(&mut client, &outbox, "after"), ("sent".into(), 1));
    // Dead at their first attempt: no retry can make them fit.
    assert_eq!(
        row_state(&mut client, &outbox, "big-body"),
        ("dead".into(), 1)
    );
    assert_eq!(
        row_state(&mut client, &outbox, "big-header"),
        ("dead".into(), 1)
    );
    let topics: Vec<String> = broker
        .drain(&queue)
        .into_iter()
        .map(|g| g.delivery.routing_key)
        .collect();
    assert_eq!(topics, ["ok.before", "ok.after"]);
    broker.delete_queue(&queue);
}

#[test]
fn connection_errors_keep_their_cause_and_never_show_the_password() {
    let error = RabbitPublisher::connect("amqp://guest:s3cret@127.0.0.1:1", "x")
        .expect_err("nothing listens on port 1");
    assert!(
        matches!(error, postgres_outbox::rabbitmq::Error::Connect { .. }),
        "{error:?}"
    );
    let cause = std::error::Error::source(&error).expect("the cause is kept");
    assert!(
        cause.downcast_ref::<std::io::Error>().is_some(),
        "{cause:?}"
    );
    assert!(!error.to_string().contains("s3cret"), "{error}");
    assert!(!format!("{error:?}").contains("s3cret"), "{error:?}");
}

/// Counts every consumer event; panics after counting a duplicate.
#[derive(Clone, Default)]
struct ConsumerCounts(Arc<[AtomicUsize; 4]>);

impl ConsumerMetrics for ConsumerCounts {
    fn handled(&self, _delivery: &Delivery, took: Duration) {
        // Counted only with a transaction time: a panic here would be swallowed.
        if took > Duration::ZERO {
            self.0[0].fetch_add(1, Ordering::SeqCst);
        }
    }
    fn duplicate(&self, _delivery: &Delivery) {
        self.0[1].fetch_add(1, Ordering::SeqCst);
        panic!("injected: a bug in the metrics exporter");
    }
    fn failed(&self, _delivery: &Delivery, _error: &HandlerError) {
        self.0[2].fetch_add(1, Ordering::SeqCst);
    }
    fn dead_lettered(&self, _delivery: &Delivery) {
        self.0[3].fetch_add(1, Ordering::SeqCst);
    }
}

#[test]
fn consumer_metrics_see_each_outcome_and_their_panics_stop_nothing() {
    let (outbox, _client) = outbox("rmq_cmetrics");
    let broker = Broker::new();
    let queue = broker.plain_queue("cmetrics");
    let counts = ConsumerCounts::default();
    let consumer = Consumer::spawn(
        ConsumerConfig::new(&amqp_url(), &queue, "metered")
            .retry(Retry::new(2).backoff(Duration::from_millis(10), Duration::from_millis(20)))
            .metrics(counts.clone()),
        outbox,
        pool(2),
        |_tx, delivery| {
            if delivery.key == "bad" {
                return Err(HandlerError::transient("cannot handle it"));
            }
            Ok(())
        },
    )
    .unwrap();
    broker.send(&queue, Some("m-1"), b"a");
    broker.send(&queue, Some("m-1"), b"a");
    broker.send(&queue, Some("bad"), b"b");
    broker.send(&queue, Some("m-2"), b"c");
    wait_until("every delivery is settled", || {
        let r = consumer.report();
        r.processed == 2 && r.duplicates == 1 && r.rejected == 1
    });
    consumer.shutdown(Duration::from_secs(10)).unwrap();
    let seen: Vec<usize> = counts.0.iter().map(|c| c.load(Ordering::SeqCst)).collect();
    assert_eq!(
        seen,
        [2, 1, 2, 1],
        "handled, duplicate, failed, dead-lettered"
    );
    assert_eq!(broker.drain(&format!("{queue}.dead")).len(), 1);
    broker.delete_queue(&queue);
    broker.delete_queue(&format!("{queue}.dead"));
}

/// The failure count the consumer keeps for a message, if any.
fn failures_of(client: &mut postgres::Client, outbox: &Outbox, consumer: &str, key: &str) -> i32 {
    let sql = format!(
        "SELECT coalesce(max(failures), 0) FROM \"{}_failures\" WHERE consumer = $1 AND key = $2",
        outbox.table()
    );
    client.query_one(&sql, &[&consumer, &key]).unwrap().get(0)
}

fn text_header(properties: &AmqpProperties, name: &str) -> String {
    match header(properties, name) {
        Some(AmqpValue::LongString(s)) => s.clone(),
        other => panic!("header {name}: {other:?}"),
    }
}

#[test]
fn poison_reaches_the_dead_letter_queue_after_n_tries_across_a_restart() {
    let (outbox, mut client) = outbox("rmq_poison");
    let broker = Broker::new();
    // No dead-letter exchange: the consumer's own dead-letter queue must catch it.
    let queue = broker.plain_queue("poison");
    let calls = Arc::new(AtomicUsize::new(0));
    let spawn = |backoff: Duration| {
        let calls = calls.clone();
        Consumer::spawn(
            ConsumerConfig::new(&amqp_url(), &queue, "poisoned")
                .retry(Retry::new(3).backoff(backoff, backoff * 2)),
            outbox.clone(),
            pool(1),
            move |_tx, _delivery| {
                calls.fetch_add(1, Ordering::SeqCst);
                Err(HandlerError::transient("no such customer\0 (NUL and all)"))
            },
        )
        .unwrap()
    };

    // The first consumer fails once, then waits out a long backoff: stop it there.
    let first = spawn(Duration::from_secs(600));
    broker.send(&queue, Some("poison"), b"body");
    wait_until("the first failure is counted", || {
        failures_of(&mut client, &outbox, "poisoned", "poison") == 1
    });
    let report = first.shutdown(Duration::from_secs(10)).unwrap();
    assert_eq!((report.retried, report.rejected), (1, 0));
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    wait_until("the message is back on the queue", || {
        broker.ready(&queue) == 1
    });

    // A new process picks up the count: two more failures, not three.
    let second = spawn(Duration::from_millis(10));
    let dead = format!("{queue}.dead");
    wait_until("the message is dead-lettered", || broker.ready(&dead) == 1);
    let report = second.shutdown(Duration::from_secs(10)).unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 3, "three tries in all");
    assert_eq!((report.retried, report.rejected), (1, 1));
    assert_eq!(broker.ready(&queue), 0);

    let letters = broker.drain(&dead);
    assert_eq!(letters.len(), 1);
    let letter = &letters[0].delivery;
    assert_eq!(letter.body, b"body");
    assert_eq!(letter.properties.message_id().as_deref(), Some("poison"));
    assert!(text_header(&letter.properties, DEAD_REASON_HEADER).contains("no such customer"));
    assert_eq!(text_header(&letter.properties, DEAD_QUEUE_HEADER), queue);
    assert_eq!(
        header(&letter.properties, DEAD_FAILURES_HEADER),
        Some(&AmqpValue::LongLongInt(3))
    );
    // The count stays, marked buried, so a redelivery after a lost ack is not
    // dead-lettered twice; a redriven copy (the dead letter moved back) starts afresh.
    let buried: bool = client
        .query_one(
            &format!(
                "SELECT buried FROM {} WHERE consumer = 'poisoned' AND key = 'poison'",
                quoted_with(&outbox, "_failures")
            ),
            &[],
        )
        .unwrap()
        .get(0);
    assert!(buried);
    let third = spawn(Duration::from_secs(600));
    broker
        .channel
        .basic_publish(
            "",
            amiquip::Publish::with_properties(
                &letter.body,
                queue.clone(),
                letter.properties.clone(),
            ),
        )
        .unwrap();
    wait_until("the redriven copy fails once, counted afresh", || {
        calls.load(Ordering::SeqCst) == 4
    });
    let report = third.shutdown(Duration::from_secs(10)).unwrap();
    assert_eq!((report.retried, report.rejected), (1, 0), "{report:?}");
    assert_eq!(failures_of(&mut client, &outbox, "poisoned", "poison"), 1);
    broker.delete_queue(&queue);
}

#[test]
fn retries_back_off_exponentially() {
    let (outbox, _client) = outbox("rmq_backoff");
    let broker = Broker::new();
    let queue = broker.plain_queue("backoff");
    let calls: Arc<Mutex<Vec<Instant>>> = Arc::default();
    let handler_calls = calls.clone();
    let consumer = Consumer::spawn(
        ConsumerConfig::new(&amqp_url(), &queue, "backoff")
            .retry(Retry::new(10).backoff(Duration::from_millis(200), Duration::from_secs(10))),
        outbox,
        pool(1),
        move |_tx, _delivery| {
            let mut calls = handler_calls.lock().unwrap();
            calls.push(Instant::now());
            if calls.len() <= 3 {
                return Err(HandlerError::transient("not yet"));
            }
            Ok(())
        },
    )
    .unwrap();
    broker.send(&queue, Some("m"), b"x");
    wait_until("it succeeds", || consumer.report().processed == 1);
    let report = consumer.shutdown(Duration::from_secs(10)).unwrap();
    assert_eq!((report.retried, report.rejected), (3, 0));
    let calls = calls.lock().unwrap();
    // Equal jitter: the n-th wait is at least half of 200 ms * 2^(n-1).
    for (n, pair) in calls.windows(2).enumerate() {
        let floor = Duration::from_millis(100) * (1 << n);
        let waited = pair[1] - pair[0];
        assert!(waited >= floor, "wait {} was {waited:?}", n + 1);
    }
    broker.delete_queue(&queue);
}

/// A consumer table that numbers the rows as handlers insert them.
fn ordered_table(client: &mut postgres::Client) -> String {
    let table = unique_name("handled_order");
    client
        .batch_execute(&format!(
            "CREATE TABLE {table} (n bigserial PRIMARY KEY, key text UNIQUE NOT NULL)"
        ))
        .unwrap();
    table
}

/// The keys a handler committed, in the order it inserted them.
fn handled_in_order(client: &mut postgres::Client, table: &str) -> Vec<String> {
    client
        .query(&format!("SELECT key FROM {table} ORDER BY n"), &[])
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

/// The sequence numbers of `<aggregate>-<seq>` keys among `handled`, in order.
fn sequence(handled: &[String], aggregate: &str) -> Vec<u32> {
    let prefix = format!("{aggregate}-");
    handled
        .iter()
        .filter_map(|k| k.strip_prefix(&prefix))
        .map(|seq| seq.parse().unwrap())
        .collect()
}

/// Four aggregates of ten and ten unordered messages; a-3 and c-7 fail twice before they
/// go through, b-5 fails permanently. Each aggregate must be handled in order, with b-5
/// skipped once dead.
fn order_is_kept_through_failures(concurrency: usize) {
    let (outbox, mut client) = outbox("rmq_order");
    let table = ordered_table(&mut client);
    let broker = Broker::new();
    let queue = broker.plain_queue("order");
    let failures: Arc<Mutex<HashMap<String, u32>>> = Arc::default();
    let (handler_table, handler_failures) = (table.clone(), failures.clone());
    let consumer = Consumer::spawn(
        ConsumerConfig::new(&amqp_url(), &queue, "ordered")
            .prefetch(16)
            .concurrency(concurrency)
            .retry(Retry::new(5).backoff(Duration::from_millis(20), Duration::from_millis(50))),
        outbox,
        pool(concurrency as u32),
        move |tx, delivery| {
            if delivery.key == "b-5" {
                return Err(HandlerError::permanent("cannot be handled"));
            }
            if delivery.key == "a-3" || delivery.key == "c-7" {
                let mut failures = handler_failures.lock().unwrap();
                let n = failures.entry(delivery.key.clone()).or_insert(0);
                if *n < 2 {
                    *n += 1;
                    return Err(HandlerError::transient("not yet"));
                }
            }
            record_handled(tx, &handler_table, &delivery.key)
        },
    )
    .unwrap();
    for seq in 0..10 {
        for aggregate in ["a", "b", "c", "d"] {
            broker.send_ordered(&queue, &format!("{aggregate}-{seq}"), Some(aggregate));
        }
        broker.send_ordered(&queue, &format!("u-{seq}"), None);
    }
    wait_until("every message is settled", || {
        let r = consumer.report();
        r.processed == 49 && r.rejected == 1
    });
    let report = consumer.shutdown(Duration::from_secs(10)).unwrap();
    assert_eq!(report.retried, 4);
    let handled = handled_in_order(&mut client, &table);
    for aggregate in ["a", "b", "c", "d"] {
        let expected: Vec<u32> = (0..10).filter(|&s| aggregate != "b" || s != 5).collect();
        assert_eq!(
            sequence(&handled, aggregate),
            expected,
            "aggregate {aggregate}"
        );
    }
    assert_eq!(sequence(&handled, "u").len(), 10);
    assert_eq!(broker.drain(&format!("{queue}.dead")).len(), 1);
    broker.delete_queue(&queue);
}

#[test]
fn order_is_kept_through_failures_at_prefetch_16() {
    order_is_kept_through_failures(1);
}

#[test]
fn order_is_kept_through_failures_at_concurrency_4() {
    order_is_kept_through_failures(4);
}

#[test]
fn a_failing_aggregate_holds_only_itself() {
    let (outbox, _client) = outbox("rmq_holds");
    let broker = Broker::new();
    let queue = broker.plain_queue("holds");
    let release = Arc::new(AtomicBool::new(false));
    let handled: Arc<Mutex<Vec<String>>> = Arc::default();
    let (handler_release, handler_handled) = (release.clone(), handled.clone());
    let consumer = Consumer::spawn(
        ConsumerConfig::new(&amqp_url(), &queue, "holds").retry(
            Retry::new(i32::MAX as u32)
                .backoff(Duration::from_millis(10), Duration::from_millis(20)),
        ),
        outbox,
        pool(1),
        move |_tx, delivery| {
            if delivery.key == "a-0" && !handler_release.load(Ordering::SeqCst) {
                return Err(HandlerError::transient("downstream is down"));
            }
            handler_handled.lock().unwrap().push(delivery.key.clone());
            Ok(())
        },
    )
    .unwrap();
    broker.send_ordered(&queue, "a-0", Some("a"));
    broker.send_ordered(&queue, "a-1", Some("a"));
    broker.send_ordered(&queue, "b-0", Some("b"));
    broker.send_ordered(&queue, "u-0", None);
    // a-0 cannot succeed before the release: whatever is handled meanwhile overtook it.
    wait_until(
        "the other aggregate and the unordered message go on",
        || handled.lock().unwrap().len() == 2 && consumer.report().retried >= 2,
    );
    assert_eq!(consumer.report().processed, 2);
    release.store(true, Ordering::SeqCst);
    wait_until("the held aggregate follows", || {
        consumer.report().processed == 4
    });
    consumer.shutdown(Duration::from_secs(10)).unwrap();
    let handled = handled.lock().unwrap();
    let mut first_two = handled[..2].to_vec();
    first_two.sort();
    assert_eq!(first_two, ["b-0", "u-0"]);
    assert_eq!(handled[2..], ["a-0", "a-1"]);
    broker.delete_queue(&queue);
}

#[test]
fn a_connection_lost_under_the_handler_is_not_the_messages_fault() {
    let (outbox, _client) = outbox("rmq_cut");
    let broker = Broker::new();
    let queue = broker.plain_queue("cut");
    let calls = Arc::new(AtomicUsize::new(0));
    let handler_calls = calls.clone();
    let consumer = Consumer::spawn(
        // One failure would dead-letter it.
        ConsumerConfig::new(&amqp_url(), &queue, "cut").retry(Retry::new(1)),
        outbox,
        pool(2),
        move |tx, _delivery| {
            if handler_calls.fetch_add(1, Ordering::SeqCst) == 0 {
                // The server ends this very session, as a failover or an admin would.
                tx.execute("SELECT pg_terminate_backend(pg_backend_pid())", &[])
                    .map_err(HandlerError::transient)?;
            }
            Ok(())
        },
    )
    .unwrap();
    broker.send(&queue, Some("m"), b"x");
    wait_until("it is processed", || consumer.report().processed == 1);
    let report = consumer.shutdown(Duration::from_secs(10)).unwrap();
    assert_eq!((report.retried, report.rejected), (0, 0));
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    broker.delete_queue(&queue);
}

#[test]
fn a_message_without_an_id_is_dead_lettered_unhandled() {
    let (outbox, _client) = outbox("rmq_noid");
    let broker = Broker::new();
    let queue = broker.plain_queue("noid");
    let calls = Arc::new(AtomicUsize::new(0));
    let handler_calls = calls.clone();
    let consumer = Consumer::spawn(
        ConsumerConfig::new(&amqp_url(), &queue, "noid"),
        outbox,
        pool(1),
        move |_tx, _delivery| {
            handler_calls.fetch_add(1, Ordering::SeqCst);
            Ok(())
        },
    )
    .unwrap();
    broker.send(&queue, None, b"anonymous");
    broker.send(&queue, Some("m"), b"x");
    wait_until("both are settled", || {
        let r = consumer.report();
        r.processed == 1 && r.rejected == 1
    });
    consumer.shutdown(Duration::from_secs(10)).unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    let letters = broker.drain(&format!("{queue}.dead"));
    assert_eq!(letters.len(), 1);
    assert_eq!(letters[0].delivery.body, b"anonymous");
    assert!(
        text_header(&letters[0].delivery.properties, DEAD_REASON_HEADER).contains("message id")
    );
    broker.delete_queue(&queue);
}

#[test]
fn consumer_settings_that_cannot_work_are_refused_before_connecting() {
    let (outbox, _client) = outbox("rmq_settings");
    // The broker URL is never reached: settings are checked first.
    let url = "amqp://guest:guest@127.0.0.1:1";
    let config = || ConsumerConfig::new(url, "q", "c");
    let cases = [
        (config().prefetch(0), 1, "prefetch"),
        (config().concurrency(0), 1, "concurrency"),
        (config().concurrency(3), 2, "pool"),
        (config().retry(Retry::new(0)), 1, "max_attempts"),
        (
            config().retry(Retry::new(5).backoff(Duration::from_secs(2), Duration::from_secs(1))),
            1,
            "backoff",
        ),
        (config().dead_letter_queue("q"), 1, "dead-letter"),
        (config().dead_letter_queue(""), 1, "dead-letter"),
    ];
    for (config, pool_size, words) in cases {
        let refused = Consumer::spawn(config, outbox.clone(), pool(pool_size), |_tx, _d| Ok(()));
        let error = refused.expect_err(words).to_string();
        assert!(error.contains(words), "{words}: {error}");
    }
}

#[test]
fn a_consumer_of_an_outbox_never_migrated_is_refused() {
    let outbox = Outbox::new(&unique_name("never_migrated")).unwrap();
    let broker = Broker::new();
    let queue = broker.plain_queue("unmigrated");
    let refused = Consumer::spawn(
        ConsumerConfig::new(&amqp_url(), &queue, "c"),
        outbox,
        pool(1),
        |_tx, _d| Ok(()),
    );
    match refused {
        Err(postgres_outbox::rabbitmq::Error::Database(e)) => assert!(e.is_not_migrated(), "{e}"),
        other => panic!("{other:?}"),
    }
    broker.delete_queue(&queue);
}

#[test]
fn a_consumer_whose_broker_connection_is_cut_reconnects_and_loses_nothing() {
    // Its own vhost, so closing its connections does not disturb tests running alongside.
    let vhost = unique_name("vh_consume");
    rabbitmqctl(&["add_vhost", &vhost]);
    rabbitmqctl(&["set_permissions", "-p", &vhost, "guest", ".*", ".*", ".*"]);
    let url = format!("{}/{vhost}", amqp_url().trim_end_matches('/'));
    let broker = Broker::at(&url);
    broker.queue("orders", "", FieldTable::new());
    let total = 200;
    for seq in 0..total / 4 {
        for aggregate in ["a", "b", "c", "d"] {
            broker.send_ordered("orders", &format!("{aggregate}-{seq}"), Some(aggregate));
        }
    }
    // The cut closes this connection too.
    drop(broker);

    let (outbox, mut client) = outbox("rmq_cut_broker");
    let table = ordered_table(&mut client);
    let calls = Arc::new(AtomicUsize::new(0));
    let (handler_table, handler_calls, handler_vhost) =
        (table.clone(), calls.clone(), vhost.clone());
    let consumer = Consumer::spawn(
        ConsumerConfig::new(&url, "orders", "cut")
            .prefetch(16)
            .concurrency(2),
        outbox,
        pool(2),
        move |tx, delivery| {
            if handler_calls.fetch_add(1, Ordering::SeqCst) == 50 {
                rabbitmqctl(&["close_all_connections", "-p", &handler_vhost, "test: cut"]);
            }
            record_handled(tx, &handler_table, &delivery.key)
        },
    )
    .unwrap();
    wait_until("every message is handled", || {
        let n: i64 = client
            .query_one(&format!("SELECT count(*) FROM {table}"), &[])
            .unwrap()
            .get(0);
        n == total as i64
    });
    let broker = Broker::at(&url);
    wait_until("every delivery is acked", || {
        broker.ready("orders") == 0 && {
            let r = consumer.report();
            r.processed + r.duplicates >= total as u64
        }
    });
    let report = consumer.shutdown(Duration::from_secs(10)).unwrap();
    assert_eq!(report.processed, total as u64, "each committed once");
    assert_eq!(report.rejected, 0);
    assert!(calls.load(Ordering::SeqCst) > 50, "the cut happened");
    let handled = handled_in_order(&mut client, &table);
    for aggregate in ["a", "b", "c", "d"] {
        let expected: Vec<u32> = (0..50).collect();
        assert_eq!(
            sequence(&handled, aggregate),
            expected,
            "aggregate {aggregate}"
        );
    }
    drop(broker);
    rabbitmqctl(&["delete_vhost", &vhost]);
}

// ---------------------------------------------------------------------------------------------
// Outages of the broker: never charged to a message
// ---------------------------------------------------------------------------------------------

/// A relay publishing to `exchange` at `url`, reporting to `metrics`, whose factory counts
/// its calls in `builds`. Two attempts at most: a relay that charged an outage to the
/// messages would soon turn them into dead letters.
fn outage_relay(
    outbox: &Outbox,
    url: &str,
    exchange: &str,
    metrics: &Counters,
    builds: &Arc<AtomicUsize>,
) -> Relay {
    let builds = builds.clone();
    let publishing = PublisherConfig::new(url, exchange)
        .unwrap()
        .confirm_timeout(Duration::from_secs(2));
    Relay::spawn(
        RelayConfig::new(outbox.clone(), pool(5), move || {
            builds.fetch_add(1, Ordering::SeqCst);
            publishing.connect()
        })
        .retry(Retry::new(2).backoff(Duration::from_millis(5), Duration::from_millis(10)))
        .poll_interval(Duration::from_millis(50))
        .metrics(metrics.clone()),
    )
    .unwrap()
}

/// Ten messages of aggregate `a` and ten without one, keys `<prefix>-<i>`.
fn outage_messages(prefix: &str) -> Vec<Message> {
    (0..20)
        .map(|i| {
            let message = Message::new("t", i.to_string()).key(format!("{prefix}-{i}"));
            if i < 10 {
                message.aggregate_key("a")
            } else {
                message
            }
        })
        .collect()
}

/// Waits until every row is sent, and checks that none paid an attempt for the outage.
fn all_sent_once(client: &mut postgres::Client, outbox: &Outbox, rows: i64) {
    wait_until("every row is sent", || {
        count(client, outbox, "status = 'sent'") == rows
    });
    assert_eq!(count(client, outbox, "attempts <> 1"), 0);
}

/// The payloads of aggregate `a`, in the order they reached `queue`.
fn aggregate_order(broker: &Broker, queue: &str) -> Vec<u32> {
    broker
        .drain(queue)
        .iter()
        .filter(|m| header(&m.delivery.properties, AGGREGATE_HEADER).is_some())
        .map(|m| String::from_utf8_lossy(&m.delivery.body).parse().unwrap())
        .collect()
}

#[test]
fn a_missing_or_deleted_exchange_costs_no_attempt_and_the_relay_resumes_once_it_exists() {
    let broker = Broker::new();
    let (exchange, fallback, queue) = (
        unique_name("x_missing"),
        unique_name("x_missing_ae"),
        unique_name("q_missing"),
    );
    // Declared, the exchange routes everything at once through its alternate exchange, so no
    // message can be published in between declaring it and binding a queue to it.
    broker
        .channel
        .exchange_declare(ExchangeType::Fanout, &fallback, Default::default())
        .unwrap();
    broker.queue(&queue, &fallback, FieldTable::new());
    let declare = || {
        let mut arguments = FieldTable::new();
        arguments.insert(
            "alternate-exchange".into(),
            AmqpValue::LongString(fallback.clone()),
        );
        let options = ExchangeDeclareOptions {
            arguments,
            ..ExchangeDeclareOptions::default()
        };
        broker
            .channel
            .exchange_declare(ExchangeType::Topic, &exchange, options)
            .unwrap();
    };

    // Asked directly, connecting says at once what is wrong.
    let e = RabbitPublisher::connect(&amqp_url(), &exchange).unwrap_err();
    let text = e.to_string();
    assert!(text.contains(&exchange) && text.contains("404"), "{text}");

    let (outbox, mut client) = outbox("rmq_missing");
    enqueue(&mut client, &outbox, outage_messages("m"));
    let (metrics, builds) = (Counters::default(), Arc::new(AtomicUsize::new(0)));
    let relay = outage_relay(&outbox, &amqp_url(), &exchange, &metrics, &builds);
    wait_until("the relay has tried to connect again and again", || {
        builds.load(Ordering::SeqCst) >= 8
    });
    // Rows are claimed and handed back again and again; none ever pays for it.
    assert_eq!(count(&mut client, &outbox, "status <> 'pending'"), 0);
    assert_eq!(count(&mut client, &outbox, "attempts > 1"), 0);
    assert_eq!(metrics.downs(), 1);
    declare();
    all_sent_once(&mut client, &outbox, 20);
    assert_eq!((metrics.downs(), metrics.ups()), (1, 1));

    // Deleted under the running relay: its channel is closed by the broker mid-stream.
    broker
        .channel
        .exchange_delete(&exchange, Default::default())
        .unwrap();
    enqueue(&mut client, &outbox, outage_messages("n"));
    let before = builds.load(Ordering::SeqCst);
    wait_until("the relay has tried to reconnect again and again", || {
        builds.load(Ordering::SeqCst) >= before + 8
    });
    assert_eq!(count(&mut client, &outbox, "status = 'dead'"), 0);
    assert_eq!(count(&mut client, &outbox, "attempts > 1"), 0);
    assert_eq!(metrics.downs(), 2);
    declare();
    all_sent_once(&mut client, &outbox, 40);
    relay.shutdown(Duration::from_secs(10)).unwrap();
    assert_eq!((metrics.downs(), metrics.ups()), (2, 2));

    assert_eq!(
        aggregate_order(&broker, &queue),
        [(0..10).collect::<Vec<_>>(), (0..10).collect()].concat()
    );
    for name in [&exchange, &fallback] {
        let _ = broker
            .channel
            .exchange_delete(name.as_str(), Default::default());
    }
    broker.delete_queue(&queue);
}

#[test]
fn revoked_permissions_cost_no_attempt_and_the_relay_resumes_once_restored() {
    let vhost = unique_name("vh_revoke");
    rabbitmqctl(&["add_vhost", &vhost]);
    let grant = || rabbitmqctl(&["set_permissions", "-p", &vhost, "guest", ".*", ".*", ".*"]);
    grant();
    let url = format!("{}/{vhost}", amqp_url().trim_end_matches('/'));
    let broker = Broker::at(&url);
    broker.exchange("events");
    broker.queue("all", "events", FieldTable::new());

    let (outbox, mut client) = outbox("rmq_revoke");
    enqueue(&mut client, &outbox, outage_messages("m"));
    let (metrics, builds) = (Counters::default(), Arc::new(AtomicUsize::new(0)));
    let relay = outage_relay(&outbox, &url, "events", &metrics, &builds);
    all_sent_once(&mut client, &outbox, 20);

    // Access revoked, and the user's connections cut (a channel that has published may go
    // on a while on cached permissions): reconnecting is refused (530).
    rabbitmqctl(&["clear_permissions", "-p", &vhost, "guest"]);
    rabbitmqctl(&[
        "close_all_connections",
        "-p",
        &vhost,
        "test: access revoked",
    ]);
    enqueue(&mut client, &outbox, outage_messages("n"));
    let before = builds.load(Ordering::SeqCst);
    wait_until("the relay has tried to reconnect again and again", || {
        builds.load(Ordering::SeqCst) >= before + 8
    });
    assert_eq!(count(&mut client, &outbox, "status = 'dead'"), 0);
    assert_eq!(count(&mut client, &outbox, "attempts > 1"), 0);
    assert_eq!(metrics.downs(), 1);
    grant();
    all_sent_once(&mut client, &outbox, 40);
    relay.shutdown(Duration::from_secs(10)).unwrap();
    assert_eq!((metrics.downs(), metrics.ups()), (1, 2));

    let broker = Broker::at(&url);
    assert_eq!(
        aggregate_order(&broker, "all"),
        [(0..10).collect::<Vec<_>>(), (0..10).collect()].concat()
    );
    drop(broker);
    rabbitmqctl(&["delete_vhost", &vhost]);
}
