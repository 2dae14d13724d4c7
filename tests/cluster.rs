//! A real three-node RabbitMQ cluster (opt-in): relaying to and consuming from a quorum queue
//! while the node both are connected to is stopped and started again mid-stream.
//!
//! Needs the cluster of `.ci/rabbitmq-cluster start`, whose last two lines set
//! `OUTBOX_TEST_CLUSTER_URLS` (the nodes' AMQP URLs, comma-separated) and
//! `OUTBOX_TEST_CLUSTER_NODES` (their node names, in the same order). Without them the test
//! says so and does nothing, so the normal run stays light:
//!
//! ```text
//! eval "$(.ci/rabbitmq-cluster start | tail -2)"
//! cargo test --features rabbitmq --test cluster -- --nocapture
//! ```
#![cfg(feature = "rabbitmq")]

mod common;

use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use amiquip::{
    AmqpValue, Connection, ExchangeDeclareOptions, ExchangeType, FieldTable, QueueDeclareOptions,
};
use common::*;
use postgres_outbox::rabbitmq::{Consumer, ConsumerConfig, Endpoints, QueueType, RabbitPublisher};
use postgres_outbox::{HandlerError, Message, Relay, RelayConfig, Retry};

const TOTAL: usize = 6_000;
const BATCH: usize = 50;
const AGGREGATES: usize = 30;

/// Runs `rabbitmqctl` against one node of the cluster.
fn node_ctl(node: &str, args: &[&str]) {
    let status = Command::new("rabbitmqctl")
        .arg("-n")
        .arg(node)
        .args(args)
        .status()
        .expect("run rabbitmqctl");
    assert!(status.success(), "rabbitmqctl -n {node} {args:?} failed");
}

fn cluster() -> Option<(String, Vec<String>)> {
    let urls = std::env::var("OUTBOX_TEST_CLUSTER_URLS").ok()?;
    let nodes = std::env::var("OUTBOX_TEST_CLUSTER_NODES").ok()?;
    Some((urls, nodes.split(',').map(str::to_owned).collect()))
}

#[test]
#[ignore = "needs a three-node RabbitMQ cluster: eval \"$(.ci/rabbitmq-cluster start | tail -2)\", then --ignored"]
fn a_quorum_queue_keeps_every_message_in_order_while_a_node_stops_and_starts() {
    let (urls, nodes) = cluster().expect(
        "OUTBOX_TEST_CLUSTER_URLS and OUTBOX_TEST_CLUSTER_NODES: \
         eval \"$(.ci/rabbitmq-cluster start | tail -2)\" sets them",
    );
    let first_url = urls.split(',').next().expect("a URL").to_owned();
    let exchange = unique_name("x_cluster");
    let queue = unique_name("q_cluster");
    {
        let mut connection = Connection::insecure_open(&first_url).expect("connect to node 1");
        let channel = connection.open_channel(None).expect("channel");
        channel
            .exchange_declare(
                ExchangeType::Topic,
                exchange.as_str(),
                ExchangeDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
            )
            .expect("declare exchange");
        let mut arguments = FieldTable::new();
        arguments.insert(
            "x-queue-type".into(),
            AmqpValue::LongString("quorum".into()),
        );
        channel
            .queue_declare(
                queue.as_str(),
                QueueDeclareOptions {
                    durable: true,
                    arguments,
                    ..Default::default()
                },
            )
            .expect("declare quorum queue");
        channel
            .queue_bind(queue.as_str(), exchange.as_str(), "#", FieldTable::new())
            .expect("bind");
        connection.close().expect("close");
    }

    let (outbox, mut client) = outbox("cluster");
    let table = unique_name("cluster_handled");
    client
        .batch_execute(&format!(
            "CREATE TABLE {table} (n bigserial PRIMARY KEY, key text UNIQUE NOT NULL, \
             aggregate text NOT NULL, seq int NOT NULL)"
        ))
        .unwrap();

    let builds = Arc::new(AtomicUsize::new(0));
    let (relay_urls, relay_exchange, relay_builds) =
        (urls.clone(), exchange.clone(), builds.clone());
    let relay = Relay::spawn(
        RelayConfig::new(outbox.clone(), pool(4), move || {
            relay_builds.fetch_add(1, Ordering::SeqCst);
            RabbitPublisher::connect(&relay_urls, &relay_exchange)
        })
        .batch_size(BATCH)
        .concurrency(2)
        .retry(Retry::new(3)),
    )
    .unwrap();
    let handler_table = table.clone();
    let consumer = Consumer::spawn(
        ConsumerConfig::new(&urls, &queue, "cluster")
            .endpoints(Endpoints::parse(&urls).unwrap())
            .dead_letter_queue_type(QueueType::Quorum)
            .prefetch(32)
            .concurrency(2),
        outbox.clone(),
        pool(2),
        move |tx, delivery| {
            let aggregate = delivery.aggregate_key.clone().unwrap_or_default();
            let seq: i32 = String::from_utf8_lossy(&delivery.body)
                .parse()
                .map_err(HandlerError::permanent)?;
            tx.execute(
                &format!("INSERT INTO {handler_table} (key, aggregate, seq) VALUES ($1, $2, $3)"),
                &[&delivery.key, &aggregate, &seq],
            )
            .map_err(HandlerError::transient)?;
            Ok(())
        },
    )
    .unwrap();

    // Producers keep a backlog of two batches ahead of the relay, so the stream is still
    // flowing when the node stops.
    let started = Instant::now();
    let producer_outbox = outbox.clone();
    let producer = thread::spawn(move || {
        let mut client = common::client();
        for batch in 0..TOTAL / BATCH {
            wait_until("the relay keeps up", || {
                count(&mut client, &producer_outbox, "status = 'sent'")
                    >= ((batch as i64) - 2) * BATCH as i64
            });
            let mut tx = client.transaction().unwrap();
            producer_outbox
                .enqueue_all(
                    &mut tx,
                    (batch * BATCH..(batch + 1) * BATCH).map(|i| {
                        let aggregate = i % AGGREGATES;
                        Message::new("cluster.event", format!("{}", i / AGGREGATES).into_bytes())
                            .key(format!("c-{i}"))
                            .aggregate_key(format!("agg-{aggregate}"))
                    }),
                )
                .unwrap();
            tx.commit().unwrap();
        }
    });

    let handled = |client: &mut postgres::Client| -> i64 {
        client
            .query_one(&format!("SELECT count(*) FROM {table}"), &[])
            .unwrap()
            .get(0)
    };
    wait_until("a quarter is sent", || {
        count(&mut client, &outbox, "status = 'sent'") >= (TOTAL / 4) as i64
    });
    let stop_time = Instant::now();
    node_ctl(&nodes[0], &["stop_app"]);
    // What got through while the node was stopping does not count: the stream must go on
    // with the node down.
    let stopped_at = (
        count(&mut client, &outbox, "status = 'sent'"),
        handled(&mut client),
    );
    wait_until("the stream goes on without the node", || {
        count(&mut client, &outbox, "status = 'sent'") >= (stopped_at.0 + 1_000).min(TOTAL as i64)
            && handled(&mut client) >= (stopped_at.1 + 1_000).min(TOTAL as i64)
    });
    let down_for = stop_time.elapsed();
    node_ctl(&nodes[0], &["start_app"]);
    producer.join().expect("the producer");
    wait_until("every message is handled", || {
        handled(&mut client) == TOTAL as i64
    });
    let took = started.elapsed();
    relay.shutdown(Duration::from_secs(10)).unwrap();
    let report = consumer.shutdown(Duration::from_secs(10)).unwrap();

    assert_eq!(count(&mut client, &outbox, "status = 'sent'"), TOTAL as i64);
    assert_eq!(
        count(&mut client, &outbox, "status <> 'sent'"),
        0,
        "nothing dead"
    );
    assert_eq!(report.processed, TOTAL as u64, "each handled once");
    assert_eq!(report.rejected, 0, "nothing dead-lettered");
    for aggregate in 0..AGGREGATES {
        let seqs: Vec<i32> = client
            .query(
                &format!("SELECT seq FROM {table} WHERE aggregate = $1 ORDER BY n"),
                &[&format!("agg-{aggregate}")],
            )
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect();
        let expected: Vec<i32> = (0..(TOTAL / AGGREGATES) as i32).collect();
        assert_eq!(seqs, expected, "agg-{aggregate} handled in order");
    }
    let attempts: i64 = client
        .query_one(
            &format!(
                "SELECT coalesce(max(attempts), 0)::bigint FROM {}",
                quoted(&outbox)
            ),
            &[],
        )
        .unwrap()
        .get(0);
    eprintln!(
        "cluster: messages={TOTAL} aggregates={AGGREGATES} took={:.1}s node_down={:.1}s \
         stopped_at_sent={} stopped_at_handled={} publisher_builds={} max_attempts_used={attempts} \
         processed={} duplicates={} retried={} rejected={}",
        took.as_secs_f64(),
        down_for.as_secs_f64(),
        stopped_at.0,
        stopped_at.1,
        builds.load(Ordering::SeqCst),
        report.processed,
        report.duplicates,
        report.retried,
        report.rejected,
    );

    let mut connection = Connection::insecure_open(&first_url).expect("connect to node 1");
    let channel = connection.open_channel(None).expect("channel");
    for name in [queue.clone(), format!("{queue}.dead")] {
        let _ = channel.queue_delete(name, Default::default());
    }
    let _ = channel.exchange_delete(exchange.as_str(), Default::default());
    let _ = connection.close();
}
