//! The names 0.2.0 deprecated still work, for one release, exactly as the names that
//! replace them: one test per deprecated item (see docs/upgrading.md).
#![allow(deprecated)]

mod common;

use std::time::Duration;

use common::*;
use postgres_outbox::{Filter, Outbox, Purge, PurgeTarget, Redrive, Rows};

/// (key, status) of every row, by key.
fn states(client: &mut postgres::Client, outbox: &Outbox) -> Vec<(String, String)> {
    client
        .query(
            &format!("SELECT key, status FROM {} ORDER BY key", quoted(outbox)),
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect()
}

#[test]
fn redrive_with_the_redrive_enum_is_redrive_with_a_filter() {
    let (outbox, mut client) = outbox("dep_redrive");
    operator_rows(&mut client, &outbox);
    assert_eq!(outbox.redrive(&mut client, Redrive::Keys(&[])).unwrap(), 0);
    assert_eq!(
        outbox
            .redrive(&mut client, Redrive::Keys(&["d1", "d2"]))
            .unwrap(),
        2
    );
    assert_eq!(row_state(&mut client, &outbox, "d1").0, "pending");
    assert_eq!(outbox.redrive(&mut client, Redrive::All).unwrap(), 3);
    assert_eq!(count(&mut client, &outbox, "status = 'dead'"), 0);
}

#[test]
fn redrive_where_counts_on_a_dry_run_and_redrives_otherwise() {
    let (outbox, mut client) = outbox("dep_redrive_where");
    operator_rows(&mut client, &outbox);
    let timeouts = Filter::new().error_contains("timeout");
    let before = states(&mut client, &outbox);
    assert_eq!(
        outbox.redrive_where(&mut client, &timeouts, true).unwrap(),
        3
    );
    assert_eq!(
        states(&mut client, &outbox),
        before,
        "a dry run changes nothing"
    );
    assert_eq!(
        outbox.redrive_where(&mut client, &timeouts, false).unwrap(),
        3
    );
    assert_eq!(count(&mut client, &outbox, "status = 'dead'"), 2);
}

#[test]
fn dead_letters_where_is_dead_letters_with_a_limit() {
    let (outbox, mut client) = outbox("dep_dead_where");
    operator_rows(&mut client, &outbox);
    let orders = Filter::new().topic("orders");
    let old: Vec<String> = outbox
        .dead_letters_where(&mut client, &orders, 2)
        .unwrap()
        .into_iter()
        .map(|d| d.record.key)
        .collect();
    let new: Vec<String> = outbox
        .dead_letters(&mut client, orders.limit(2))
        .unwrap()
        .into_iter()
        .map(|d| d.record.key)
        .collect();
    assert_eq!(old.len(), 2);
    assert_eq!(old, new);
}

#[test]
fn purge_with_the_purge_enum_is_purge_of_rows_older_than_its_age() {
    let (outbox, mut client) = outbox("dep_purge");
    operator_rows(&mut client, &outbox);
    let week = Duration::from_secs(7 * 86_400);
    assert_eq!(
        outbox
            .purge(&mut client, Purge::Sent { older_than: week })
            .unwrap(),
        1
    );
    assert_eq!(
        outbox
            .purge(&mut client, Purge::Dead { older_than: week })
            .unwrap(),
        2
    );
    assert_eq!(
        outbox
            .purge(&mut client, Purge::Inbox { older_than: week })
            .unwrap(),
        0,
        "the dedupe record is fresh"
    );
    assert_eq!(count(&mut client, &outbox, "status = 'dead'"), 3);
}

#[test]
fn purge_where_with_purge_target_counts_on_a_dry_run_and_purges_otherwise() {
    let (outbox, mut client) = outbox("dep_purge_where");
    operator_rows(&mut client, &outbox);
    let old = Filter::new().older_than(Duration::from_secs(86_400));
    let before = states(&mut client, &outbox);
    assert_eq!(
        outbox
            .purge_where(&mut client, PurgeTarget::Dead, &old, true)
            .unwrap(),
        outbox
            .count(&mut client, Rows::Dead.matching(&old))
            .unwrap(),
    );
    assert_eq!(
        states(&mut client, &outbox),
        before,
        "a dry run changes nothing"
    );
    assert_eq!(
        outbox
            .purge_where(&mut client, PurgeTarget::Dead, &old, false)
            .unwrap(),
        2
    );
    assert_eq!(
        outbox
            .purge_where(&mut client, PurgeTarget::Sent, &old, false)
            .unwrap(),
        1
    );
    assert!(
        PurgeTarget::Inbox == Rows::Inbox,
        "the old name of the same type"
    );
}

#[test]
fn relay_config_connections_opens_the_relays_own_connections() {
    let (outbox, mut client) = outbox("dep_relay_connections");
    let sink = Sink::default();
    // A pool of one cannot serve four workers and a listener: only connections of the
    // relay's own make this work.
    let config = relay_config_with_pool(&outbox, 1, sink.collect())
        .connections(database_url().parse().unwrap(), postgres::NoTls);
    let relay = postgres_outbox::Relay::spawn(config).unwrap();
    let mut tx = client.transaction().unwrap();
    outbox
        .enqueue(&mut tx, postgres_outbox::Message::new("t", "x").key("one"))
        .unwrap();
    tx.commit().unwrap();
    wait_until("the message is published", || sink.len() == 1);
    relay.shutdown(Duration::from_secs(10)).unwrap();
}

#[cfg(feature = "rabbitmq")]
mod consumer {
    use std::time::Duration;

    use postgres_outbox::rabbitmq::{Consumer, ConsumerConfig};

    use super::common::broker::Broker;
    use super::common::*;

    #[test]
    fn max_failures_and_retry_backoff_are_max_attempts_and_backoff() {
        let (min, max) = (Duration::from_millis(20), Duration::from_secs(3));
        let old = ConsumerConfig::new("amqp://h", "q", "c")
            .max_failures(3)
            .retry_backoff(min, max);
        let new = ConsumerConfig::new("amqp://h", "q", "c")
            .max_attempts(3)
            .backoff(min, max);
        assert_eq!(format!("{old:?}"), format!("{new:?}"));
    }

    #[test]
    fn consumer_config_connections_opens_the_handlers_own_connections() {
        let broker = Broker::new();
        let queue = broker.plain_queue("dep_connections");
        broker.send(&queue, Some("m-1"), b"x");
        let (outbox, _client) = outbox("dep_consumer_connections");
        // Two handler threads and a pool of one: only connections of their own serve them.
        let consumer = Consumer::spawn(
            ConsumerConfig::new(&amqp_url(), &queue, "dep")
                .concurrency(2)
                .connections(database_url().parse().unwrap(), postgres::NoTls),
            outbox,
            pool(1),
            |_tx, _delivery| Ok(()),
        )
        .unwrap();
        wait_until("the message is handled", || {
            consumer.report().processed == 1
        });
        consumer.shutdown(Duration::from_secs(10));
        broker.delete_queue(&queue);
    }
}
