//! A publication sequence per aggregate (`OutboxBuilder::sequence`): places given at
//! enqueue by every path, in commit order, kept through purges, published as
//! `x-outbox-sequence`, and checked by the RabbitMQ consumer, which reports holes and
//! deliveries behind to its handler, its metrics and its log.

mod common;

use std::collections::BTreeMap;
use std::thread;

use common::*;
use postgres_outbox::{Access, Message, Outbox, Relay, Rows};

/// A migrated outbox that gives places, of this run's kind of table.
fn sequenced(prefix: &str) -> (Outbox, postgres::Client) {
    let (plain, client) = outbox(prefix);
    let outbox = builder()
        .table(plain.table())
        .sequence(true)
        .build()
        .expect("valid");
    (outbox, client)
}

/// Every row's aggregate and place, in id order.
fn places(client: &mut postgres::Client, outbox: &Outbox) -> Vec<(Option<String>, Option<i64>)> {
    client
        .query(
            &format!(
                "SELECT aggregate_key, sequence FROM {} ORDER BY id",
                quoted(outbox)
            ),
            &[],
        )
        .expect("read the places")
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect()
}

/// Each aggregate's places in id order; rows without an aggregate must have none.
fn by_aggregate(rows: &[(Option<String>, Option<i64>)]) -> BTreeMap<String, Vec<i64>> {
    let mut seen: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for (aggregate, place) in rows {
        match aggregate {
            Some(aggregate) => seen
                .entry(aggregate.clone())
                .or_default()
                .push(place.expect("a message with an aggregate has a place")),
            None => assert_eq!(*place, None, "a message without an aggregate has no place"),
        }
    }
    seen
}

fn counting(n: i64) -> Vec<i64> {
    (1..=n).collect()
}

fn of(aggregate: &str) -> Message {
    Message::new("ok.t", b"{}".to_vec()).aggregate_key(aggregate)
}

#[test]
fn places_count_up_per_aggregate_through_every_enqueue_path() {
    let (outbox, mut client) = sequenced("seq_paths");
    let mut tx = client.transaction().unwrap();
    outbox.enqueue(&mut tx, of("a")).unwrap();
    outbox.enqueue(&mut tx, of("a").key("a-caller")).unwrap();
    outbox.enqueue(&mut tx, of("b")).unwrap();
    outbox
        .enqueue(&mut tx, Message::new("ok.t", b"{}".to_vec()))
        .unwrap();
    tx.commit().unwrap();

    // Rolled back: its places are taken back with it.
    let mut tx = client.transaction().unwrap();
    outbox.enqueue(&mut tx, of("a")).unwrap();
    outbox.enqueue_all(&mut tx, vec![of("a"), of("b")]).unwrap();
    tx.rollback().unwrap();

    // A batch that names a key already there writes nothing, and takes no place.
    let mut tx = client.transaction().unwrap();
    let refused = outbox
        .enqueue_all(&mut tx, vec![of("a").key("a-caller"), of("a")])
        .unwrap_err();
    assert!(refused.is_duplicate_key(), "{refused}");
    let refused = outbox
        .enqueue(&mut tx, of("a").key("a-caller"))
        .unwrap_err();
    assert!(refused.is_duplicate_key(), "{refused}");
    outbox
        .enqueue_all(&mut tx, vec![of("a"), of("b"), of("a").key("a-batch")])
        .unwrap();
    // 70 due at once: what goes by COPY on an outbox without places.
    let large: Vec<Message> = (0..70)
        .map(|i| of(if i % 2 == 0 { "a" } else { "c" }))
        .collect();
    outbox.enqueue_all(&mut tx, large).unwrap();
    tx.commit().unwrap();

    let mut producer = outbox.producer(common::client()).unwrap();
    let mut tx = producer.transaction().unwrap();
    tx.enqueue(of("a")).unwrap();
    tx.enqueue(of("a").key("a-prepared")).unwrap();
    tx.enqueue(Message::new("ok.t", b"{}".to_vec())).unwrap();
    tx.enqueue_all(vec![of("c"), of("b")]).unwrap();
    tx.commit().unwrap();

    let seen = by_aggregate(&places(&mut client, &outbox));
    // a: 2 single, 2 of a batch, 35 of the large one, 2 by the producer.
    assert_eq!(seen["a"], counting(41));
    assert_eq!(seen["b"], counting(3));
    assert_eq!(seen["c"], counting(36));
}

/// Two producers racing on one aggregate, one through `enqueue`, the other through a
/// `Producer`: the places follow the order of the rows, which is commit order.
#[test]
fn racing_producers_get_places_in_commit_order() {
    let (outbox, mut client) = sequenced("seq_race");
    let plain = {
        let outbox = outbox.clone();
        thread::spawn(move || {
            let mut client = common::client();
            for i in 0..40 {
                let mut tx = client.transaction().unwrap();
                outbox.enqueue(&mut tx, of("race")).unwrap();
                if i % 3 == 0 {
                    outbox
                        .enqueue_all(&mut tx, vec![of("race"), of("race")])
                        .unwrap();
                }
                tx.commit().unwrap();
            }
        })
    };
    let prepared = {
        let outbox = outbox.clone();
        thread::spawn(move || {
            let mut producer = outbox.producer(common::client()).unwrap();
            for _ in 0..40 {
                let mut tx = producer.transaction().unwrap();
                tx.enqueue(of("race")).unwrap();
                tx.enqueue(of("race")).unwrap();
                tx.commit().unwrap();
            }
        })
    };
    plain.join().unwrap();
    prepared.join().unwrap();
    let seen = by_aggregate(&places(&mut client, &outbox));
    assert_eq!(seen["race"], counting(40 + 2 * 14 + 80));
}

#[test]
fn places_survive_a_purge_of_the_sent_rows() {
    let (outbox, mut client) = sequenced("seq_purge");
    let mut tx = client.transaction().unwrap();
    outbox
        .enqueue_all(&mut tx, vec![of("a"), of("a"), of("a")])
        .unwrap();
    tx.commit().unwrap();
    let config = relay_config(&outbox, |_| Ok(()));
    assert_eq!(Relay::run_until_idle(&config).unwrap(), 3);
    outbox.purge(&mut client, Rows::Sent).unwrap();
    if partitioned() {
        // A partitioned outbox purges by dropping closed partitions: these rows are in the
        // open one, which no purge drops. Deleted by hand, as a plain table's purge does.
        client
            .execute(
                &format!("DELETE FROM {} WHERE status = 'sent'", quoted(&outbox)),
                &[],
            )
            .unwrap();
    }
    assert_eq!(count(&mut client, &outbox, "true"), 0);
    let mut tx = client.transaction().unwrap();
    outbox.enqueue(&mut tx, of("a")).unwrap();
    tx.commit().unwrap();
    assert_eq!(
        places(&mut client, &outbox),
        [(Some("a".to_owned()), Some(4))]
    );
}

/// Each side under a role with the rights `Outbox::grants` gives it, and no others.
#[test]
fn producers_give_places_with_the_rights_the_grants_give_them() {
    let (outbox, mut client) = sequenced("seq_roles");
    let role = Role::new(&mut client);
    role.grant(&mut client, &outbox, Access::Produce);
    let mut as_producer = role.client();
    let mut tx = as_producer.transaction().unwrap();
    outbox.enqueue(&mut tx, of("a")).unwrap();
    outbox.enqueue(&mut tx, of("a").key("roles-a")).unwrap();
    outbox.enqueue_all(&mut tx, vec![of("a"), of("a")]).unwrap();
    tx.commit().unwrap();
    let mut producer = outbox.producer(role.client()).unwrap();
    let mut tx = producer.transaction().unwrap();
    tx.enqueue(of("a")).unwrap();
    tx.enqueue(of("a").key("roles-b")).unwrap();
    tx.commit().unwrap();
    assert_eq!(
        by_aggregate(&places(&mut client, &outbox))["a"],
        counting(6)
    );
}

#[cfg(feature = "rabbitmq")]
mod rabbitmq {
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use amiquip::{AmqpProperties, AmqpValue, FieldTable, Publish};
    use common::broker::Broker;
    use postgres_outbox::rabbitmq::{
        Consumer, ConsumerConfig, ConsumerMetrics, Delivery, PublisherConfig, SequenceGap,
        AGGREGATE_HEADER, SEQUENCE_HEADER,
    };
    use postgres_outbox::{Filter, RelayConfig};

    use super::*;

    /// A message's key, place and gap, as the consumer's handler saw them.
    type Seen = (String, Option<i64>, Option<SequenceGap>);

    /// A gap the consumer reported to its metrics, with the delivery's aggregate.
    type Reported = (Option<String>, SequenceGap);

    /// The gaps the consumer reported to its metrics.
    #[derive(Clone, Default)]
    struct Gaps(Arc<Mutex<Vec<Reported>>>);

    impl ConsumerMetrics for Gaps {
        fn out_of_sequence(&self, delivery: &Delivery, gap: &SequenceGap) {
            self.0
                .lock()
                .unwrap()
                .push((delivery.aggregate_key.clone(), *gap));
        }
    }

    fn relay(outbox: &Outbox, exchange: &str) -> RelayConfig {
        let publishing = PublisherConfig::new(&amqp_url(), exchange).unwrap();
        RelayConfig::new(outbox.clone(), pool(3), move || publishing.connect())
            .batch_size(10)
            .concurrency(1)
    }

    fn enqueue(
        client: &mut postgres::Client,
        outbox: &Outbox,
        messages: Vec<Message>,
    ) -> Vec<String> {
        let mut tx = client.transaction().unwrap();
        let keys = messages
            .into_iter()
            .map(|m| outbox.enqueue(&mut tx, m).unwrap())
            .collect();
        tx.commit().unwrap();
        keys
    }

    /// Consumes `queue` until `n` deliveries are processed; what the handler saw, in order,
    /// and what the metrics were told.
    fn consume(
        outbox: &Outbox,
        queue: &str,
        connections: Pool,
        n: u64,
    ) -> (Vec<Seen>, Vec<Reported>) {
        let seen: Arc<Mutex<Vec<Seen>>> = Arc::default();
        let gaps = Gaps::default();
        let handler_seen = seen.clone();
        let consumer = Consumer::spawn(
            ConsumerConfig::new(&amqp_url(), queue, "sequenced").metrics(gaps.clone()),
            outbox.clone(),
            connections,
            move |_tx, delivery| {
                handler_seen.lock().unwrap().push((
                    delivery.key.clone(),
                    delivery.sequence,
                    delivery.gap,
                ));
                Ok(())
            },
        )
        .unwrap();
        wait_until("the deliveries are processed", || {
            consumer.report().processed == n
        });
        consumer.shutdown(Duration::from_secs(10)).unwrap();
        let seen = seen.lock().unwrap().clone();
        let gaps = gaps.0.lock().unwrap().clone();
        (seen, gaps)
    }

    fn hole(expected: i64, got: i64) -> Option<SequenceGap> {
        Some(SequenceGap::Hole { expected, got })
    }

    #[test]
    fn the_place_travels_as_an_integer_header_and_an_outbox_without_places_sends_none() {
        let broker = Broker::new();
        let (exchange, queue) = broker.routed("seq_header", FieldTable::new());
        let (outbox, mut client) = sequenced("seq_header");
        let keys = enqueue(
            &mut client,
            &outbox,
            vec![of("a"), of("a"), Message::new("ok.t", b"{}".to_vec())],
        );
        assert_eq!(
            Relay::run_until_idle(&relay(&outbox, &exchange)).unwrap(),
            3
        );
        let (unsequenced, mut other) = outbox_uncut("seq_off");
        let unplaced = enqueue(&mut other, &unsequenced, vec![of("a")]);
        assert_eq!(
            places(&mut other, &unsequenced),
            [(Some("a".to_owned()), None)]
        );
        assert_eq!(
            Relay::run_until_idle(&relay(&unsequenced, &exchange)).unwrap(),
            1
        );
        // Messages of different aggregates (or none) share confirm rounds: by key.
        let headers: BTreeMap<String, Option<AmqpValue>> = broker
            .drain(&queue)
            .into_iter()
            .map(|got| {
                let properties = &got.delivery.properties;
                (
                    properties.message_id().clone().unwrap_or_default(),
                    properties
                        .headers()
                        .as_ref()
                        .and_then(|h| h.get(SEQUENCE_HEADER).cloned()),
                )
            })
            .collect();
        let want: BTreeMap<String, Option<AmqpValue>> = [
            (keys[0].clone(), Some(AmqpValue::LongLongInt(1))),
            (keys[1].clone(), Some(AmqpValue::LongLongInt(2))),
            (keys[2].clone(), None),
            (unplaced[0].clone(), None),
        ]
        .into_iter()
        .collect();
        assert_eq!(headers, want);
        broker.delete_queue(&queue);
        broker.delete_exchange(&exchange);
    }

    /// A queue of at most two messages drops the oldest of three: the consumer's first
    /// delivery of the aggregate is its second place.
    #[test]
    fn a_message_the_queue_dropped_is_a_hole() {
        let broker = Broker::new();
        let mut arguments = FieldTable::new();
        arguments.insert("x-max-length".into(), AmqpValue::LongInt(2));
        let (exchange, queue) = broker.routed("seq_dropped", arguments);
        let (outbox, mut client) = sequenced("seq_dropped");
        let keys = enqueue(&mut client, &outbox, vec![of("a"), of("a"), of("a")]);
        assert_eq!(
            Relay::run_until_idle(&relay(&outbox, &exchange)).unwrap(),
            3
        );
        wait_until("the queue dropped the oldest", || broker.ready(&queue) == 2);
        let (seen, gaps) = consume(&outbox, &queue, pool(2), 2);
        assert_eq!(
            seen,
            [
                (keys[1].clone(), Some(2), hole(1, 2)),
                (keys[2].clone(), Some(3), None)
            ]
        );
        assert_eq!(gaps, [(Some("a".to_owned()), hole(1, 2).unwrap())]);
        broker.delete_queue(&queue);
        broker.delete_exchange(&exchange);
    }

    /// A parked dead letter skipped by an operator: the messages behind it go on, and the
    /// consumer sees its place missing.
    #[test]
    fn a_skipped_dead_letter_is_a_hole() {
        let broker = Broker::new();
        let (exchange, queue) = (unique_name("x_seq_skip"), unique_name("q_seq_skip"));
        broker.exchange(&exchange);
        // Only `ok.*` is routed: the poison message is returned as unroutable.
        broker.queue(&queue, "", FieldTable::new());
        broker
            .channel
            .queue_bind(&queue, &exchange, "ok.#", FieldTable::new())
            .unwrap();
        let (outbox, mut client) = sequenced("seq_skip");
        let outbox = builder()
            .table(outbox.table())
            .sequence(true)
            .park_on_dead(true)
            .build()
            .unwrap();
        let poison = Message::new("poison", b"{}".to_vec())
            .aggregate_key("a")
            .max_attempts(1);
        let keys = enqueue(&mut client, &outbox, vec![of("a"), poison, of("a")]);
        let config = relay(&outbox, &exchange);
        Relay::run_until_idle(&config).unwrap();
        assert_eq!(row_state(&mut client, &outbox, &keys[1]).0, "parked");
        assert_eq!(row_state(&mut client, &outbox, &keys[2]).0, "pending");
        assert_eq!(
            outbox
                .skip(&mut client, Filter::new().key(keys[1].clone()))
                .unwrap(),
            1
        );
        wait_until("the message behind the skipped one is sent", || {
            Relay::run_once(&config).unwrap();
            row_state(&mut client, &outbox, &keys[2]).0 == "sent"
        });
        let (seen, gaps) = consume(&outbox, &queue, pool(2), 2);
        assert_eq!(
            seen,
            [
                (keys[0].clone(), Some(1), None),
                (keys[2].clone(), Some(3), hole(2, 3))
            ]
        );
        assert_eq!(gaps, [(Some("a".to_owned()), hole(2, 3).unwrap())]);
        broker.delete_queue(&queue);
        broker.delete_exchange(&exchange);
    }

    /// A pipelined run whose second message the broker nacks (its only queue rejects
    /// every publish): the third reached the queue already, and the second dies.
    #[test]
    fn a_nack_in_a_pipelined_run_is_a_hole() {
        let broker = Broker::new();
        let exchange = unique_name("x_seq_nack");
        let (queue, full) = (unique_name("q_seq_nack"), unique_name("q_seq_full"));
        broker.exchange(&exchange);
        broker.queue(&queue, "", FieldTable::new());
        broker
            .channel
            .queue_bind(&queue, &exchange, "ok.#", FieldTable::new())
            .unwrap();
        let mut rejecting = FieldTable::new();
        rejecting.insert("x-max-length".into(), AmqpValue::LongInt(0));
        rejecting.insert(
            "x-overflow".into(),
            AmqpValue::LongString("reject-publish".into()),
        );
        broker.queue(&full, "", rejecting);
        broker
            .channel
            .queue_bind(&full, &exchange, "poison", FieldTable::new())
            .unwrap();
        let (outbox, mut client) = sequenced("seq_nack");
        let poison = Message::new("poison", b"{}".to_vec())
            .aggregate_key("a")
            .max_attempts(1);
        let keys = enqueue(&mut client, &outbox, vec![of("a"), poison, of("a")]);
        let config = relay(&outbox, &exchange).pipeline_runs(true);
        assert_eq!(Relay::run_once(&config).unwrap(), 3);
        let states: Vec<String> = keys
            .iter()
            .map(|k| row_state(&mut client, &outbox, k).0)
            .collect();
        assert_eq!(states, ["sent", "dead", "sent"]);
        let (seen, gaps) = consume(&outbox, &queue, pool(2), 2);
        assert_eq!(
            seen,
            [
                (keys[0].clone(), Some(1), None),
                (keys[2].clone(), Some(3), hole(2, 3))
            ]
        );
        assert_eq!(gaps, [(Some("a".to_owned()), hole(2, 3).unwrap())]);
        for queue in [&queue, &full] {
            broker.delete_queue(queue);
        }
        broker.delete_exchange(&exchange);
    }

    /// Place 2 published before place 1, by hand: a hole, then a delivery behind, which
    /// leaves the consumer's last place at 2. The consumer runs with the rights
    /// `Outbox::grants` gives it, and no others.
    #[test]
    fn a_reordered_delivery_is_behind() {
        let broker = Broker::new();
        let queue = broker.plain_queue("seq_reorder");
        let (outbox, mut client) = sequenced("seq_reorder");
        let send = |key: &str, place: i64| {
            let mut headers = FieldTable::new();
            headers.insert(AGGREGATE_HEADER.into(), AmqpValue::LongString("a".into()));
            headers.insert(SEQUENCE_HEADER.into(), AmqpValue::LongLongInt(place));
            let properties = AmqpProperties::default()
                .with_delivery_mode(2)
                .with_message_id(key.to_owned())
                .with_headers(headers);
            broker
                .channel
                .basic_publish("", Publish::with_properties(b"{}", &queue, properties))
                .unwrap();
        };
        send("second", 2);
        send("first", 1);
        send("third", 3);
        let role = Role::new(&mut client);
        role.grant(&mut client, &outbox, Access::Consume);
        let (seen, gaps) = consume(&outbox, &queue, role.pool(), 3);
        let behind = SequenceGap::Behind { last: 2, got: 1 };
        assert_eq!(
            seen,
            [
                ("second".to_owned(), Some(2), hole(1, 2)),
                ("first".to_owned(), Some(1), Some(behind)),
                ("third".to_owned(), Some(3), None),
            ]
        );
        assert_eq!(
            gaps,
            [
                (Some("a".to_owned()), hole(1, 2).unwrap()),
                (Some("a".to_owned()), behind)
            ]
        );
        let last: i64 = client
            .query_one(
                &format!(
                    "SELECT last FROM {} WHERE consumer = 'sequenced' AND aggregate_key = 'a'",
                    quoted_with(&outbox, "_consumed")
                ),
                &[],
            )
            .unwrap()
            .get(0);
        assert_eq!(last, 3);
        broker.delete_queue(&queue);
    }
}
