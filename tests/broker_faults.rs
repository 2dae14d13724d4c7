//! Faults on the broker's side that are the world's, not a message's, and one that is a
//! message's own: a broker that is down is probed by one worker on a backoff while nothing
//! is claimed; a message over the broker's size limit is dead alone while its aggregate
//! goes on. The broker goes down behind a proxy (tests/common/faulty.rs), and the size limit
//! is a node's of the test's own (tests/common/rabbit_node.rs): the shared broker is never
//! touched.
#![cfg(feature = "rabbitmq")]

mod common;

use std::collections::HashSet;
use std::time::Duration;

use amiquip::FieldTable;
use common::broker::Broker;
use common::faulty::{Faulty, Mode};
use common::proxy::broker_address;
use common::rabbit_node::RabbitNode;
use common::*;
use postgres_outbox::rabbitmq::RabbitPublisher;
use postgres_outbox::{Message, Relay, RelayConfig};

fn message_ids(got: &[amiquip::Get]) -> Vec<String> {
    got.iter()
        .filter_map(|m| m.delivery.properties.message_id().clone())
        .collect()
}

#[test]
fn a_broker_that_is_down_is_probed_by_one_worker_on_a_backoff_and_nothing_is_claimed() {
    let (outbox, mut client) = outbox("broker_down");
    let broker = Broker::new();
    let (exchange, queue) = broker.routed("down", FieldTable::new());
    let proxy = Faulty::to(&broker_address(&amqp_url()));
    let url = amqp_url().replacen(&broker_address(&amqp_url()), &proxy.address(), 1);

    let total = 5_000;
    let mut tx = client.transaction().unwrap();
    let keys = outbox
        .enqueue_all(
            &mut tx,
            (0..total).map(|i| Message::new("t", vec![b'x'; 64]).key(format!("m-{i}"))),
        )
        .unwrap();
    tx.commit().unwrap();

    let metrics = Counters::default();
    let relay = Relay::spawn(
        RelayConfig::new(outbox.clone(), pool(RELAY_POOL), move || {
            RabbitPublisher::connect(&url, &exchange)
        })
        .concurrency(2)
        .metrics(metrics.clone()),
    )
    .unwrap();
    wait_until("some messages are sent", || {
        count(&mut client, &outbox, "status = 'sent'") >= 200
    });

    // The broker goes away: connections cut, new ones refused.
    proxy.set(Mode::Refuse);
    wait_until("the relay knows", || metrics.downs() == 1);
    // A claim sent a moment before the outage was seen can still come back after it (and
    // be handed back): the window starts once the relay has settled, at its first probe, a
    // backoff step later, with nothing held.
    let before_probe = proxy.accepted();
    wait_until("the first probe", || proxy.accepted() > before_probe);
    wait_until("the batches under way are handed back", || {
        count(&mut client, &outbox, "lease_until > now()") == 0
    });
    let (claimed, attempts) = (metrics.claimed(), proxy.accepted());
    // Ten seconds of outage.
    std::thread::sleep(Duration::from_secs(10));
    let claimed_while_down = metrics.claimed() - claimed;
    let attempts_while_down = proxy.accepted() - attempts;
    eprintln!(
        "broker down 10 s: {attempts_while_down} connection attempts, {claimed_while_down} rows \
         claimed"
    );
    assert_eq!(
        claimed_while_down, 0,
        "nothing is claimed while the broker is down"
    );
    // One probe per backoff step (500 ms doubling, jittered down to half, up to 10 s): at
    // most 0.25 + 0.5 + 1 + 2 + 4 s pass before the sixth, so no more than seven fit.
    assert!(
        (2..=7).contains(&attempts_while_down),
        "{attempts_while_down} connection attempts in 10 s"
    );

    proxy.set(Mode::Pass);
    wait_until("every message is sent", || {
        count(&mut client, &outbox, "status = 'sent'") == total as i64
    });
    relay.shutdown(Duration::from_secs(10)).unwrap();
    assert_eq!(
        metrics.ups(),
        2,
        "up at the start, and again after the outage"
    );
    assert_eq!(
        count(&mut client, &outbox, "attempts <> 1"),
        0,
        "the outage cost no message an attempt"
    );
    let got: HashSet<String> = message_ids(&broker.drain(&queue)).into_iter().collect();
    let missing = keys.iter().filter(|k| !got.contains(*k)).count();
    assert_eq!(missing, 0, "every message reached the queue");
    broker.delete_queue(&queue);
}

#[test]
fn a_message_over_the_broker_s_size_limit_is_dead_alone_and_its_aggregate_goes_on() {
    let node = RabbitNode::start(&["max_message_size = 1048576"]);
    let broker = Broker::at(&node.url());
    let (exchange, queue) = broker.routed("oversize", FieldTable::new());
    let (outbox, mut client) = outbox("oversize");
    let messages = (0..81).map(|i| {
        let body = if i == 60 {
            vec![b'x'; 2 << 20]
        } else {
            vec![b'x'; 64]
        };
        Message::new("t", body)
            .key(format!("a-{i}"))
            .aggregate_key("a")
    });
    let mut tx = client.transaction().unwrap();
    outbox.enqueue_all(&mut tx, messages).unwrap();
    tx.commit().unwrap();

    // The publisher is left at its default limit (RabbitMQ's own, 128 MiB): it learns this
    // node's from the broker.
    let url = node.url();
    let relay = Relay::spawn(RelayConfig::new(
        outbox.clone(),
        pool(RELAY_POOL),
        move || RabbitPublisher::connect(&url, &exchange),
    ))
    .unwrap();
    wait_until("every message has its outcome", || {
        count(&mut client, &outbox, "status = 'pending'") == 0
    });
    relay.shutdown(Duration::from_secs(10)).unwrap();

    assert_eq!(row_state(&mut client, &outbox, "a-60"), ("dead".into(), 1));
    let error: String = client
        .query_one(
            &format!(
                "SELECT last_error FROM {} WHERE key = 'a-60'",
                quoted(&outbox)
            ),
            &[],
        )
        .unwrap()
        .get(0);
    assert!(error.contains("1048576"), "{error}");
    assert_eq!(count(&mut client, &outbox, "status = 'sent'"), 80);
    assert_eq!(count(&mut client, &outbox, "attempts <> 1"), 0);
    // Every other message reached the queue, in order (a message in flight when the broker
    // closed the channel may come twice).
    let mut seen = HashSet::new();
    let firsts: Vec<String> = message_ids(&broker.drain(&queue))
        .into_iter()
        .filter(|id| seen.insert(id.clone()))
        .collect();
    let expected: Vec<String> = (0..81)
        .filter(|i| *i != 60)
        .map(|i| format!("a-{i}"))
        .collect();
    assert_eq!(firsts, expected);
}
