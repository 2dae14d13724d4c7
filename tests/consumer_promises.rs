//! The consumer keeps its word (issue 50): a delivery is acked only once its effects
//! committed, a fault of the database is never charged to a message, and a message is
//! dead-lettered once and only when it failed for good.
#![cfg(feature = "rabbitmq")]

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use amiquip::AmqpValue;
use common::broker::Broker;
use common::faulty::{Faulty, Mode};
use common::*;
use postgres::NoTls;
use postgres_outbox::rabbitmq::{Consumer, ConsumerConfig, DEAD_FAILURES_HEADER};
use postgres_outbox::{Connections, HandlerError, Outbox, Retry};

fn effects_table(client: &mut postgres::Client) -> String {
    let table = unique_name("effects");
    client
        .batch_execute(&format!("CREATE TABLE {table} (key text PRIMARY KEY)"))
        .unwrap();
    table
}

fn rows(client: &mut postgres::Client, table: &str) -> i64 {
    client
        .query_one(&format!("SELECT count(*) FROM {table}"), &[])
        .unwrap()
        .get(0)
}

fn inbox_rows(client: &mut postgres::Client, outbox: &Outbox) -> i64 {
    rows(client, &quoted_with(outbox, "_inbox"))
}

fn failure_rows(client: &mut postgres::Client, outbox: &Outbox) -> i64 {
    rows(client, &quoted_with(outbox, "_failures"))
}

fn failures_header(letter: &amiquip::Get) -> Option<AmqpValue> {
    letter
        .delivery
        .properties
        .headers()
        .as_ref()
        .and_then(|headers| headers.get(DEAD_FAILURES_HEADER).cloned())
}

/// A first delivery's handler runs a statement that fails, ignores the error and returns
/// `Ok`: the transaction is aborted, and `COMMIT` would roll it back without an error. The
/// delivery must count as a failure and be tried again, never acked with nothing stored.
#[test]
fn a_handler_that_ignored_a_failed_statement_is_tried_again_not_acked_with_nothing_stored() {
    let (outbox, mut client) = outbox("swallowed");
    let table = effects_table(&mut client);
    let broker = Broker::new();
    let queue = broker.plain_queue("swallowed");
    let calls = Arc::new(AtomicUsize::new(0));
    let (handler_calls, handler_table) = (calls.clone(), table.clone());
    let consumer = Consumer::spawn(
        ConsumerConfig::new(&amqp_url(), &queue, "swallowing")
            .retry(Retry::new(5).backoff(Duration::from_millis(10), Duration::from_millis(20))),
        outbox.clone(),
        pool(2),
        move |tx, delivery| {
            if handler_calls.fetch_add(1, Ordering::SeqCst) == 0 {
                // "Ignore the error": the transaction is aborted all the same.
                let _ = tx.batch_execute("SELECT 1 / 0");
                return Ok(());
            }
            tx.execute(
                &format!("INSERT INTO {handler_table} (key) VALUES ($1)"),
                &[&delivery.key],
            )
            .map_err(HandlerError::transient)?;
            Ok(())
        },
    )
    .unwrap();
    broker.send(&queue, Some("m-1"), b"a");
    wait_until("the delivery is processed", || {
        consumer.report().processed == 1
    });
    let report = consumer.shutdown(Duration::from_secs(10)).unwrap();
    assert_eq!(
        (rows(&mut client, &table), inbox_rows(&mut client, &outbox)),
        (1, 1),
        "acked with its effects and its inbox row committed"
    );
    assert_eq!((report.processed, report.retried), (1, 1), "{report:?}");
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    assert_eq!(failure_rows(&mut client, &outbox), 0);
    assert_eq!(broker.ready(&format!("{queue}.dead")), 0);
    broker.delete_queue(&queue);
}

/// Handlers wrap database errors as their own failures, even as permanent ones: a statement
/// timeout, or a table missing while a deploy is under way, is the database's fault and
/// costs the message nothing, however many times it comes back.
#[test]
fn a_handler_failing_on_a_fault_of_the_database_is_never_charged() {
    let (outbox, mut client) = outbox("world_fault");
    let table = unique_name("deployed_later");
    let broker = Broker::new();
    let queue = broker.plain_queue("world_fault");
    let (timeouts, deploys) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let (handler_timeouts, handler_deploys, handler_table) =
        (timeouts.clone(), deploys.clone(), table.clone());
    let consumer = Consumer::spawn(
        ConsumerConfig::new(&amqp_url(), &queue, "worldly")
            .retry(Retry::new(2).backoff(Duration::from_millis(10), Duration::from_millis(20))),
        outbox.clone(),
        pool(2),
        move |tx, delivery| {
            if delivery.key == "times-out" {
                // Three statement timeouts, each called hopeless by the handler.
                if handler_timeouts.fetch_add(1, Ordering::SeqCst) < 3 {
                    tx.batch_execute("SET LOCAL statement_timeout = '1ms'; SELECT pg_sleep(1)")
                        .map_err(HandlerError::permanent)?;
                }
                return Ok(());
            }
            handler_deploys.fetch_add(1, Ordering::SeqCst);
            tx.execute(
                &format!("INSERT INTO {handler_table} (key) VALUES ($1)"),
                &[&delivery.key],
            )
            .map_err(HandlerError::transient)?;
            Ok(())
        },
    )
    .unwrap();
    broker.send(&queue, Some("times-out"), b"a");
    broker.send(&queue, Some("deploy"), b"b");
    let dead = format!("{queue}.dead");
    // More tries than the message has attempts, or its dead letter.
    wait_until("the table's users outlive their attempts", || {
        deploys.load(Ordering::SeqCst) > 3 || broker.ready(&dead) > 0
    });
    client
        .batch_execute(&format!("CREATE TABLE {table} (key text PRIMARY KEY)"))
        .unwrap();
    wait_until("both are processed, or dead", || {
        let report = consumer.report();
        report.processed + report.rejected == 2
    });
    let report = consumer.shutdown(Duration::from_secs(10)).unwrap();
    assert_eq!(
        (report.processed, report.retried, report.rejected),
        (2, 0, 0),
        "{report:?}"
    );
    assert_eq!(broker.ready(&dead), 0);
    assert_eq!(timeouts.load(Ordering::SeqCst), 4);
    assert_eq!(
        (
            rows(&mut client, &table),
            failure_rows(&mut client, &outbox)
        ),
        (1, 0)
    );
    broker.delete_queue(&queue);
}

/// A message processed before, redelivered, with a failure count a copy of it left behind
/// (a dead decision whose deletion failed, or a copy that failed while another succeeded):
/// a duplicate, acked, not a dead letter.
#[test]
fn a_stale_failure_count_never_dead_letters_a_processed_message() {
    let (outbox, mut client) = outbox("stale_failures");
    let broker = Broker::new();
    let queue = broker.plain_queue("stale_failures");
    let mut tx = client.transaction().unwrap();
    assert!(outbox.dedupe(&mut tx, "stale", "done").unwrap());
    tx.commit().unwrap();
    client
        .execute(
            &format!(
                "INSERT INTO {} (consumer, key, failures, last_error, dead) \
                 VALUES ('stale', 'done', 3, 'an old failure', true)",
                quoted_with(&outbox, "_failures")
            ),
            &[],
        )
        .unwrap();
    // Delivered once and handed back: the consumer gets it as a redelivery.
    broker.send(&queue, Some("done"), b"a");
    let got = broker
        .channel
        .basic_get(&queue, false)
        .unwrap()
        .expect("the message is on the queue");
    got.delivery.nack(&broker.channel, true).unwrap();
    let calls = Arc::new(AtomicUsize::new(0));
    let handler_calls = calls.clone();
    let consumer = Consumer::spawn(
        ConsumerConfig::new(&amqp_url(), &queue, "stale"),
        outbox.clone(),
        pool(2),
        move |_tx, _delivery| {
            handler_calls.fetch_add(1, Ordering::SeqCst);
            Ok(())
        },
    )
    .unwrap();
    wait_until("the redelivery is settled", || {
        let report = consumer.report();
        report.duplicates + report.rejected == 1
    });
    let report = consumer.shutdown(Duration::from_secs(10)).unwrap();
    assert_eq!((report.duplicates, report.rejected), (1, 0), "{report:?}");
    assert_eq!(broker.ready(&format!("{queue}.dead")), 0);
    assert_eq!(calls.load(Ordering::SeqCst), 0);
    assert_eq!(
        failure_rows(&mut client, &outbox),
        0,
        "the stale count is gone"
    );
    broker.delete_queue(&queue);
}

/// The connection settings of this run's database, to `address` instead.
fn database_at(address: &str) -> postgres::Config {
    let base: postgres::Config = database_url().parse().unwrap();
    let (host, port) = address.split_once(':').unwrap();
    let mut config = postgres::Config::new();
    config
        .host(host)
        .port(port.parse().unwrap())
        .user(base.get_user().unwrap_or("postgres"))
        .dbname(base.get_dbname().unwrap_or("postgres"))
        .options(base.get_options().unwrap_or(""));
    if let Some(password) = base.get_password() {
        config.password(password);
    }
    config
}

/// The server's answer to counting a handler's failure is lost: counting again must not
/// charge the one failure twice, nor run the handler again to find out.
#[test]
fn a_lost_reply_to_the_failure_count_charges_the_failure_once() {
    let (outbox, client) = outbox("lost_count");
    let broker = Broker::new();
    let queue = broker.plain_queue("lost_count");
    let base: postgres::Config = database_url().parse().unwrap();
    let target = match (base.get_hosts().first(), base.get_ports().first()) {
        (Some(postgres::config::Host::Tcp(host)), Some(port)) => format!("{host}:{port}"),
        other => panic!("the tests' database must be reached over TCP: {other:?}"),
    };
    let proxy = Faulty::to(&target);
    let calls = Arc::new(AtomicUsize::new(0));
    let handler_calls = calls.clone();
    let consumer = Consumer::spawn(
        // One attempt: the first failure is the message's last.
        ConsumerConfig::new(&amqp_url(), &queue, "counted")
            .retry(Retry::new(1))
            .statement_timeout(Duration::from_secs(1)),
        outbox.clone(),
        Connections::open(database_at(&proxy.address()), NoTls),
        move |_tx, _delivery| {
            handler_calls.fetch_add(1, Ordering::SeqCst);
            Err(HandlerError::transient("no such customer"))
        },
    )
    .unwrap();
    // The failure count's text, in every version: its reply, and every one after it, lost.
    proxy.set(Mode::DropRepliesFrom("SET failures = "));
    broker.send(&queue, Some("m-1"), b"a");
    wait_until("the count's reply is lost", || proxy.dropping());
    let before = proxy.accepted();
    wait_until("the consumer gives that connection up", || {
        proxy.accepted() > before
    });
    proxy.set(Mode::Pass);
    let dead = format!("{queue}.dead");
    wait_until("the message is dead-lettered", || broker.ready(&dead) == 1);
    let report = consumer.shutdown(Duration::from_secs(10)).unwrap();
    assert_eq!(report.rejected, 1, "{report:?}");
    assert_eq!(calls.load(Ordering::SeqCst), 1, "the handler ran once");
    let letters = broker.drain(&dead);
    assert_eq!(
        failures_header(&letters[0]),
        Some(AmqpValue::LongLongInt(1)),
        "one failure, charged once"
    );
    broker.delete_queue(&queue);
    drop(client);
}

/// An AMQP `basic.ack` method frame's class and method ids (60, 80).
const BASIC_ACK: &[u8] = &[0x00, 0x3c, 0x00, 0x50];

/// The dead letter is stored and confirmed, and the ack of the original is lost with its
/// connection: the broker delivers the original again, which is acked, not dead-lettered a
/// second time.
#[test]
fn a_lost_ack_after_a_stored_dead_letter_is_not_dead_lettered_twice() {
    let (outbox, _client) = outbox("lost_burial_ack");
    let broker = Broker::new();
    let queue = broker.plain_queue("lost_burial_ack");
    let proxy = Faulty::to(&common::proxy::broker_address(&amqp_url()));
    let url = format!("amqp://guest:guest@{}", proxy.address());
    let calls = Arc::new(AtomicUsize::new(0));
    let handler_calls = calls.clone();
    let consumer = Consumer::spawn(
        ConsumerConfig::new(&url, &queue, "buried"),
        outbox.clone(),
        pool(2),
        move |_tx, _delivery| {
            handler_calls.fetch_add(1, Ordering::SeqCst);
            Err(HandlerError::permanent("no such customer"))
        },
    )
    .unwrap();
    // The consumer's first ack is the dead message's: it, and all after it, never arrive.
    proxy.set(Mode::DropRequestsFrom(BASIC_ACK));
    broker.send(&queue, Some("m-1"), b"a");
    let dead = format!("{queue}.dead");
    wait_until("the dead letter is stored and its ack lost", || {
        proxy.dropping_requests() && broker.ready(&dead) == 1
    });
    // The connection goes; the broker hands the original back to the queue.
    proxy.set(Mode::Refuse);
    wait_until("the original is back on the queue", || {
        broker.ready(&queue) == 1
    });
    proxy.set(Mode::Pass);
    wait_until("the redelivery is settled", || {
        let report = consumer.report();
        report.rejected + report.duplicates == 2
    });
    let report = consumer.shutdown(Duration::from_secs(10)).unwrap();
    assert_eq!((report.rejected, report.duplicates), (1, 1), "{report:?}");
    assert_eq!(broker.ready(&dead), 1, "one dead letter");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(broker.ready(&queue), 0);
    broker.delete_queue(&queue);
}
