//! Outgrowing one broker: several endpoints with failover, quorum queues, and TLS.
//!
//! The endpoints are TCP proxies in front of the one local broker (tests/common/proxy.rs),
//! so a test can see which endpoint a client reconnected through and have the broker close
//! the connections that came through one of them.
#![cfg(feature = "rabbitmq")]

mod common;

use std::collections::HashSet;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use amiquip::{AmqpValue, FieldTable};
use common::broker::Broker;
use common::proxy::Proxy;
use common::*;
use postgres_outbox::rabbitmq::{
    Consumer, ConsumerConfig, Endpoints, QueueType, RabbitPublisher, DEAD_REASON_HEADER,
};
use postgres_outbox::{
    HandlerError, Message, PublishError, Publisher, Record, Relay, RelayConfig, Retry,
};

/// An endpoint where nothing listens: connecting fails at once.
const DEAD_ENDPOINT: &str = "amqp://guest:guest@127.0.0.1:1";

/// A publisher that has the broker close its connection before its `cut_at`-th batch.
struct CutOnce {
    inner: RabbitPublisher,
    calls: Arc<AtomicUsize>,
    cut_at: usize,
    proxy: Arc<Proxy>,
}

impl Publisher for CutOnce {
    fn publish(&mut self, batch: &[Record]) -> Vec<Result<(), PublishError>> {
        if self.calls.fetch_add(1, Ordering::SeqCst) == self.cut_at {
            assert_eq!(self.proxy.close_at_broker("test: failover"), 1);
        }
        self.inner.publish(batch)
    }

    fn is_broken(&self) -> bool {
        self.inner.is_broken()
    }
}

fn quorum() -> FieldTable {
    let mut arguments = FieldTable::new();
    arguments.insert(
        "x-queue-type".into(),
        AmqpValue::LongString("quorum".into()),
    );
    arguments
}

/// The type RabbitMQ reports for `queue` (`classic`, `quorum`).
fn queue_type(queue: &str) -> String {
    let listed = Command::new("rabbitmqctl")
        .args(["-q", "list_queues", "--no-table-headers", "name", "type"])
        .output()
        .expect("run rabbitmqctl list_queues");
    assert!(listed.status.success(), "rabbitmqctl list_queues failed");
    String::from_utf8_lossy(&listed.stdout)
        .lines()
        .find_map(|line| {
            let (name, kind) = line.split_once('\t')?;
            (name == queue).then(|| kind.trim().to_owned())
        })
        .unwrap_or_else(|| panic!("queue {queue} is not listed"))
}

fn message_ids(got: &[amiquip::Get]) -> HashSet<String> {
    got.iter()
        .filter_map(|m| m.delivery.properties.message_id().clone())
        .collect()
}

#[test]
fn the_relay_skips_a_dead_endpoint_and_fails_over_to_the_next_when_its_connection_is_closed() {
    let (outbox, mut client) = outbox("failover_relay");
    let broker = Broker::new();
    let (exchange, queue) = broker.routed("failover", FieldTable::new());
    let (first, second) = (Arc::new(Proxy::to_broker()), Proxy::to_broker());
    // One string, as a user would configure it: a node that is down, then two that are up.
    let urls = format!("{DEAD_ENDPOINT},{},{}", first.url(), second.url());

    let total = 300;
    let mut tx = client.transaction().unwrap();
    let keys = outbox
        .enqueue_all(
            &mut tx,
            (0..total).map(|i| Message::new("order.placed", vec![b'x'; 64]).key(format!("m-{i}"))),
        )
        .unwrap();
    tx.commit().unwrap();

    let calls = Arc::new(AtomicUsize::new(0));
    let (factory_calls, proxy) = (calls.clone(), first.clone());
    let relay = Relay::spawn(
        RelayConfig::new(outbox.clone(), pool(4), move || {
            RabbitPublisher::connect(&urls, &exchange).map(|inner| CutOnce {
                inner,
                calls: factory_calls.clone(),
                cut_at: 5,
                proxy: proxy.clone(),
            })
        })
        .batch_size(10)
        .concurrency(1)
        .retry(Retry::new(2).backoff(Duration::from_millis(10), Duration::from_millis(20))),
    )
    .unwrap();
    wait_until("every message is sent", || {
        count(&mut client, &outbox, "status = 'sent'") == total as i64
    });
    relay.shutdown(Duration::from_secs(10)).unwrap();

    assert!(calls.load(Ordering::SeqCst) > 5, "the cut happened");
    assert_eq!(
        first.accepted(),
        1,
        "connected through the first live endpoint"
    );
    assert!(second.accepted() >= 1, "then resumed on the next");
    assert_eq!(count(&mut client, &outbox, "status <> 'sent'"), 0);
    assert_eq!(
        count(&mut client, &outbox, "attempts > 1"),
        0,
        "the lost connection cost no message an attempt"
    );
    let got = message_ids(&broker.drain(&queue));
    let missing: Vec<&String> = keys.iter().filter(|k| !got.contains(*k)).collect();
    assert!(missing.is_empty(), "not delivered: {missing:?}");
    broker.delete_queue(&queue);
}

#[test]
fn the_consumer_skips_a_dead_endpoint_and_fails_over_to_the_next_when_its_connection_is_closed() {
    let broker = Broker::new();
    let queue = broker.plain_queue("failover_consume");
    let total = 200;
    for seq in 0..total / 4 {
        for aggregate in ["a", "b", "c", "d"] {
            broker.send_ordered(&queue, &format!("{aggregate}-{seq}"), Some(aggregate));
        }
    }
    let (outbox, mut client) = outbox("failover_consume");
    let table = unique_name("handled");
    client
        .batch_execute(&format!(
            "CREATE TABLE {table} (n bigserial PRIMARY KEY, key text UNIQUE NOT NULL)"
        ))
        .unwrap();
    let (first, second) = (Arc::new(Proxy::to_broker()), Proxy::to_broker());
    let endpoints = Endpoints::new([DEAD_ENDPOINT.to_owned(), first.url(), second.url()]).unwrap();

    let calls = Arc::new(AtomicUsize::new(0));
    let (handler_table, handler_calls, proxy) = (table.clone(), calls.clone(), first.clone());
    let consumer = Consumer::spawn(
        ConsumerConfig::new("amqp://unused", &queue, "failover")
            .endpoints(endpoints)
            .prefetch(16)
            .concurrency(2),
        outbox,
        pool(2),
        move |tx, delivery| {
            if handler_calls.fetch_add(1, Ordering::SeqCst) == 50 {
                assert_eq!(proxy.close_at_broker("test: failover"), 1);
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
    wait_until("every message is handled and acked", || {
        let r = consumer.report();
        broker.ready(&queue) == 0
            && r.processed + r.duplicates >= total as u64
            && r.processed == total as u64
    });
    let report = consumer.shutdown(Duration::from_secs(10)).unwrap();

    assert_eq!(report.processed, total as u64, "each committed once");
    assert_eq!(report.rejected, 0, "nothing dead");
    assert!(calls.load(Ordering::SeqCst) > 50, "the cut happened");
    // The start-up check and the first consuming connection went through the first.
    assert_eq!(
        first.accepted(),
        2,
        "connected through the first live endpoint"
    );
    assert!(second.accepted() >= 1, "then resumed on the next");
    let handled: Vec<String> = client
        .query(&format!("SELECT key FROM {table} ORDER BY n"), &[])
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    for aggregate in ["a", "b", "c", "d"] {
        let seqs: Vec<u32> = handled
            .iter()
            .filter_map(|k| k.strip_prefix(&format!("{aggregate}-")))
            .map(|s| s.parse().unwrap())
            .collect();
        assert_eq!(
            seqs,
            (0..50).collect::<Vec<u32>>(),
            "aggregate {aggregate} in order"
        );
    }
    broker.delete_queue(&queue);
}

#[test]
fn every_endpoint_down_is_one_error_naming_each_without_its_password() {
    let urls = "amqp://app:s3cret@127.0.0.1:1,amqp://app:s3cret@127.0.0.1:2";
    let error = RabbitPublisher::connect(urls, "events")
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("127.0.0.1:1") && error.contains("127.0.0.1:2"),
        "{error}"
    );
    assert!(!error.contains("s3cret"), "{error}");
}

#[test]
fn the_relay_publishes_to_a_quorum_queue_with_confirms_and_mandatory() {
    let (outbox, mut client) = outbox("quorum_relay");
    let broker = Broker::new();
    let exchange = unique_name("x_quorum");
    broker.exchange(&exchange);
    let queue = unique_name("q_quorum");
    broker
        .channel
        .queue_declare(
            queue.as_str(),
            amiquip::QueueDeclareOptions {
                durable: true,
                arguments: quorum(),
                ..Default::default()
            },
        )
        .unwrap();
    broker
        .channel
        .queue_bind(
            queue.as_str(),
            exchange.as_str(),
            "order.#",
            FieldTable::new(),
        )
        .unwrap();
    assert_eq!(queue_type(&queue), "quorum");

    let mut tx = client.transaction().unwrap();
    let keys = outbox
        .enqueue_all(
            &mut tx,
            (0..100).map(|i| {
                Message::new("order.placed", format!("{i}").into_bytes())
                    .key(format!("q-{i}"))
                    .aggregate_key(format!("order-{}", i % 7))
            }),
        )
        .unwrap();
    // Bound for no queue: mandatory makes it a failure, not a silent drop.
    outbox
        .enqueue(
            &mut tx,
            Message::new("refund.issued", b"r".to_vec()).key("unroutable"),
        )
        .unwrap();
    tx.commit().unwrap();

    let config = relay_config_to(&outbox, &exchange).retry(Retry::new(1));
    while Relay::run_once(&config).unwrap() > 0 {}

    assert_eq!(count(&mut client, &outbox, "status = 'sent'"), 100);
    assert_eq!(row_state(&mut client, &outbox, "unroutable").0, "dead");
    let got = broker.drain(&queue);
    assert_eq!(message_ids(&got), keys.into_iter().collect::<HashSet<_>>());
    // Per aggregate, in enqueue order.
    for aggregate in 0..7 {
        let seqs: Vec<u32> = got
            .iter()
            .map(|m| {
                String::from_utf8(m.delivery.body.clone())
                    .unwrap()
                    .parse()
                    .unwrap()
            })
            .filter(|i: &u32| i % 7 == aggregate)
            .collect();
        let mut sorted = seqs.clone();
        sorted.sort_unstable();
        assert_eq!(seqs, sorted, "aggregate {aggregate}");
    }
    broker.delete_queue(&queue);
}

fn relay_config_to(outbox: &postgres_outbox::Outbox, exchange: &str) -> RelayConfig {
    let (url, exchange) = (amqp_url(), exchange.to_owned());
    RelayConfig::new(outbox.clone(), pool(2), move || {
        RabbitPublisher::connect(&url, &exchange)
    })
    .retry(Retry::default().backoff(Duration::from_millis(10), Duration::from_millis(20)))
}

#[test]
fn the_consumer_reads_a_quorum_queue_and_dead_letters_into_a_quorum_queue() {
    let broker = Broker::new();
    let queue = unique_name("q_quorum_consume");
    broker.queue(&queue, "", quorum());
    for seq in 0..10 {
        broker.send_ordered(&queue, &format!("a-{seq}"), Some("a"));
    }
    let (outbox, _client) = outbox("quorum_consume");
    let handled = Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = handled.clone();
    let consumer = Consumer::spawn(
        ConsumerConfig::new(&amqp_url(), &queue, "quorum")
            .dead_letter_queue_type(QueueType::Quorum)
            .retry(Retry::new(2).backoff(Duration::from_millis(10), Duration::from_millis(20))),
        outbox,
        pool(1),
        move |_tx, delivery| {
            if delivery.key == "a-4" {
                return Err(HandlerError::transient("test: a-4 always fails"));
            }
            seen.lock().unwrap().push(delivery.key.clone());
            Ok(())
        },
    )
    .unwrap();
    let dead_queue = format!("{queue}.dead");
    wait_until("nine handled and one dead", || {
        let r = consumer.report();
        r.processed == 9 && r.rejected == 1
    });
    consumer.shutdown(Duration::from_secs(10)).unwrap();

    assert_eq!(queue_type(&dead_queue), "quorum");
    let dead = broker.drain(&dead_queue);
    assert_eq!(dead.len(), 1);
    assert_eq!(
        dead[0].delivery.properties.message_id().as_deref(),
        Some("a-4")
    );
    let reason = dead[0]
        .delivery
        .properties
        .headers()
        .as_ref()
        .and_then(|h| h.get(DEAD_REASON_HEADER).cloned());
    assert!(
        matches!(&reason, Some(AmqpValue::LongString(r)) if r.contains("a-4 always fails")),
        "{reason:?}"
    );
    let expected: Vec<String> = (0..10)
        .filter(|&i| i != 4)
        .map(|i| format!("a-{i}"))
        .collect();
    assert_eq!(*handled.lock().unwrap(), expected);
    assert_eq!(broker.ready(&queue), 0);
    broker.delete_queue(&queue);
}

/// The RabbitMQ node with a TLS listener that `.ci/rabbitmq-tls` starts.
fn amqps_url() -> String {
    std::env::var("OUTBOX_TEST_AMQPS_URL")
        .ok()
        .filter(|u| !u.is_empty())
        .expect("OUTBOX_TEST_AMQPS_URL: .ci/rabbitmq-tls start prints it; .ci/run sets it")
}

/// A connection of the test's own to the TLS node, trusting the URL's `cacertfile`.
fn tls_broker(url: &str) -> amiquip::Connection {
    let (_, query) = url.split_once('?').expect("a cacertfile parameter");
    let ca = query
        .split('&')
        .find_map(|pair| pair.strip_prefix("cacertfile="))
        .expect("a cacertfile parameter");
    let ca = native_tls::Certificate::from_pem(&std::fs::read(ca).expect("read the CA")).unwrap();
    let connector = native_tls::TlsConnector::builder()
        .add_root_certificate(ca)
        .build()
        .unwrap();
    let address = url
        .split_once('@')
        .and_then(|(_, rest)| rest.split(['/', '?']).next())
        .expect("host:port");
    let socket = std::net::TcpStream::connect(address.replace("localhost", "127.0.0.1")).unwrap();
    let stream = mio::net::TcpStream::from_stream(socket).unwrap();
    amiquip::Connection::open_tls_stream(
        connector,
        "localhost",
        stream,
        amiquip::ConnectionOptions::<amiquip::Auth>::default(),
        amiquip::ConnectionTuning::default(),
    )
    .expect("connect to the TLS node")
}

#[test]
#[ignore = "needs a RabbitMQ node with TLS: OUTBOX_TEST_AMQPS_URL, from .ci/rabbitmq-tls (.ci/run sets it and runs this)"]
fn the_relay_and_the_consumer_speak_amqps_and_verify_the_broker() {
    let url = amqps_url();
    let (exchange, queue) = (unique_name("x_amqps"), unique_name("q_amqps"));
    let mut setup = tls_broker(&url);
    let channel = setup.open_channel(None).unwrap();
    channel
        .exchange_declare(
            amiquip::ExchangeType::Topic,
            exchange.as_str(),
            amiquip::ExchangeDeclareOptions::default(),
        )
        .unwrap();
    channel
        .queue_declare(
            queue.as_str(),
            amiquip::QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
        )
        .unwrap();
    channel
        .queue_bind(queue.as_str(), exchange.as_str(), "#", FieldTable::new())
        .unwrap();

    // Without the CA the certificate does not verify: no connection.
    let (untrusted, _) = url.split_once('?').unwrap();
    let refused = RabbitPublisher::connect(untrusted, &exchange).unwrap_err();
    assert!(
        format!("{refused} {:?}", std::error::Error::source(&refused)).contains("certificate"),
        "{refused}"
    );

    let (outbox, mut client) = outbox("amqps");
    let mut tx = client.transaction().unwrap();
    let keys = outbox
        .enqueue_all(
            &mut tx,
            (0..20).map(|i| {
                Message::new("order.placed", format!("{i}").into_bytes())
                    .key(format!("tls-{i}"))
                    .aggregate_key("order-1")
            }),
        )
        .unwrap();
    tx.commit().unwrap();
    let (relay_url, relay_exchange) = (url.clone(), exchange.clone());
    let config = RelayConfig::new(outbox.clone(), pool(2), move || {
        RabbitPublisher::connect(&relay_url, &relay_exchange)
    });
    assert_eq!(Relay::run_until_idle(&config).unwrap(), 20);

    let handled = Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = handled.clone();
    let consumer = Consumer::spawn(
        ConsumerConfig::new(&url, &queue, "amqps"),
        outbox,
        pool(1),
        move |_tx, delivery| {
            seen.lock().unwrap().push(delivery.key.clone());
            Ok(())
        },
    )
    .unwrap();
    wait_until("every message is handled", || {
        consumer.report().processed == 20
    });
    consumer.shutdown(Duration::from_secs(10)).unwrap();
    assert_eq!(*handled.lock().unwrap(), keys, "all of them, in order");

    for name in [queue.clone(), format!("{queue}.dead")] {
        let _ = channel.queue_delete(name, Default::default());
    }
    let _ = channel.exchange_delete(exchange.as_str(), Default::default());
    let _ = setup.close();
}
