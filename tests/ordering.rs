//! Per-aggregate order when producers race, and dead letters that park their aggregate.
//!
//! Racing producers: every enqueue of an aggregate holds a transaction-scoped lock on it, so
//! a second producer of the aggregate waits for the first to commit or roll back, and the
//! relay publishes each aggregate in commit order. Parking: a dead message can hold the later
//! messages of its aggregate until an operator redrives it (it goes first) or skips it.

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use common::{count, quoted, relay_config, row_state, wait_until, Sink};
use postgres::error::SqlState;
use postgres::Client;
use postgres_outbox::{
    Filter, HandlerError, Message, Outbox, PublishError, Record, Relay, RelayConfig, Retry, Rows,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

type TestResult = Result<(), Box<dyn std::error::Error>>;

const TOPIC: &str = "t";
/// Aggregates the racing producers share.
const SHARED_AGGREGATES: usize = 8;

/// The payloads the relay published for `aggregate`, in publishing order.
fn published(sink: &Sink, aggregate: &str) -> Vec<String> {
    sink.records()
        .into_iter()
        .filter(|r| r.aggregate_key.as_deref() == Some(aggregate))
        .map(|r| String::from_utf8(r.payload).unwrap())
        .collect()
}

fn message(aggregate: &str, payload: &str) -> Message {
    Message::new(TOPIC, payload.to_owned())
        .key(format!("{aggregate}-{payload}"))
        .aggregate_key(aggregate)
}

fn backend_pid(client: &mut Client) -> i32 {
    client
        .query_one("SELECT pg_backend_pid()", &[])
        .unwrap()
        .get(0)
}

/// True while the backend `pid` waits for an advisory lock.
fn waits_for_a_lock(client: &mut Client, pid: i32) -> bool {
    client
        .query_one(
            "SELECT count(*) FROM pg_stat_activity
             WHERE pid = $1 AND wait_event_type = 'Lock' AND wait_event = 'advisory'",
            &[&pid],
        )
        .unwrap()
        .get::<_, i64>(0)
        == 1
}

/// Advisory locks the backend `pid` holds.
fn advisory_locks(client: &mut Client, pid: i32) -> i64 {
    client
        .query_one(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = $1 AND granted",
            &[&pid],
        )
        .unwrap()
        .get(0)
}

/// A table or index, or on a partitioned table its partitions, as a plan names them.
fn leaves(client: &mut Client, relation: &str) -> Vec<String> {
    client
        .query(
            "SELECT $1::text WHERE NOT EXISTS (SELECT FROM pg_partition_tree($1::text::regclass))
             UNION ALL
             SELECT relid::regclass::text FROM pg_partition_tree($1::text::regclass)
             WHERE isleaf",
            &[&relation],
        )
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect()
}

/// A relay that publishes into `sink` and looks for work every 20 ms.
fn spawn_relay(outbox: &Outbox, sink: &Sink) -> Relay {
    Relay::spawn(relay_config(outbox, sink.collect()).poll_interval(Duration::from_millis(20)))
        .unwrap()
}

/// Starts a second producer of `aggregate` on its own connection: it enqueues `payload`
/// and then commits. Returns its backend pid and a receiver that hears when it committed.
fn second_producer(outbox: &Outbox, aggregate: &str, payload: &str) -> (i32, mpsc::Receiver<()>) {
    let (pid_tx, pid_rx) = mpsc::channel();
    let (done_tx, done_rx) = mpsc::channel();
    let (outbox, message) = (outbox.clone(), message(aggregate, payload));
    thread::spawn(move || {
        let mut client = common::client();
        pid_tx.send(backend_pid(&mut client)).unwrap();
        let mut tx = client.transaction().unwrap();
        outbox.enqueue(&mut tx, message).unwrap();
        tx.commit().unwrap();
        done_tx.send(()).unwrap();
    });
    (pid_rx.recv().unwrap(), done_rx)
}

// ---------------------------------------------------------------------------------------------
// Racing producers
// ---------------------------------------------------------------------------------------------

#[test]
fn a_later_producer_of_an_aggregate_waits_for_the_earlier_and_is_published_after_it() {
    let (outbox, mut client) = common::outbox("race_two");
    let sink = Sink::default();
    let relay = spawn_relay(&outbox, &sink);

    let mut first = common::client();
    let mut tx = first.transaction().unwrap();
    outbox.enqueue(&mut tx, message("kept", "1")).unwrap();
    let (pid, committed) = second_producer(&outbox, "kept", "2");
    // The second producer inserts only once the first is done with the aggregate.
    wait_until("the second producer waits for the aggregate", || {
        waits_for_a_lock(&mut client, pid)
    });
    assert_eq!(count(&mut client, &outbox, "aggregate_key = 'kept'"), 0);
    assert!(committed.try_recv().is_err());
    tx.commit().unwrap();
    committed.recv_timeout(Duration::from_secs(60)).unwrap();

    wait_until("both are published", || sink.len() == 2);
    assert_eq!(published(&sink, "kept"), ["1", "2"]);
    relay.shutdown(Duration::from_secs(10)).unwrap();
}

#[test]
fn a_rolled_back_earlier_producer_blocks_nothing() {
    let (outbox, mut client) = common::outbox("race_rollback");
    let sink = Sink::default();
    let relay = spawn_relay(&outbox, &sink);

    let mut first = common::client();
    let mut tx = first.transaction().unwrap();
    outbox.enqueue(&mut tx, message("kept", "1")).unwrap();
    let (pid, committed) = second_producer(&outbox, "kept", "2");
    wait_until("the second producer waits for the aggregate", || {
        waits_for_a_lock(&mut client, pid)
    });
    tx.rollback().unwrap();
    committed.recv_timeout(Duration::from_secs(60)).unwrap();

    wait_until("the second is published", || sink.len() == 1);
    assert_eq!(published(&sink, "kept"), ["2"]);
    relay.shutdown(Duration::from_secs(10)).unwrap();
}

#[test]
fn a_long_open_transaction_holds_only_its_own_aggregates() {
    let (outbox, mut client) = common::outbox("race_long_open");
    let sink = Sink::default();
    let relay = spawn_relay(&outbox, &sink);

    let mut long = common::client();
    let mut open = long.transaction().unwrap();
    outbox.enqueue(&mut open, message("a", "held")).unwrap();

    // Others go on: another aggregate, and a message without one. A wait would fail the
    // statement within a few seconds rather than hang the test.
    client.batch_execute("SET lock_timeout = '5s'").unwrap();
    let mut tx = client.transaction().unwrap();
    outbox.enqueue(&mut tx, message("b", "free")).unwrap();
    outbox
        .enqueue(&mut tx, Message::new(TOPIC, "loose").key("loose"))
        .unwrap();
    tx.commit().unwrap();
    wait_until("the others are published", || sink.len() == 2);
    assert!(!sink.contains("a-held"));

    open.commit().unwrap();
    wait_until("the held one is published", || sink.contains("a-held"));
    relay.shutdown(Duration::from_secs(10)).unwrap();
}

/// What the racing producers wrote: per message key, its aggregate and its place in the
/// order the producers passed the aggregate's lock; and which keys committed.
#[derive(Default)]
struct Written {
    next: HashMap<String, u64>,
    place: HashMap<String, (String, u64)>,
    committed: Vec<String>,
    rolled_back: usize,
}

#[test]
fn racing_producers_keep_every_aggregate_in_commit_order() {
    const PRODUCERS: usize = 6;
    const TRANSACTIONS: usize = 60;
    let (outbox, _client) = common::outbox("race_stress");
    let sink = Sink::default();
    // One publish in ten fails: retries must not reorder anything either.
    let failures = Arc::new(Mutex::new(StdRng::seed_from_u64(7)));
    let publish = {
        let sink = sink.clone();
        move |record: &Record| {
            if failures.lock().unwrap().gen_bool(0.1) {
                return Err(PublishError::transient("injected"));
            }
            sink.push(record);
            Ok(())
        }
    };
    let relay = Relay::spawn(
        relay_config(&outbox, publish)
            .poll_interval(Duration::from_millis(20))
            .retry(Retry::new(1000).backoff(Duration::from_millis(5), Duration::from_millis(20))),
    )
    .unwrap();

    let written = Arc::new(Mutex::new(Written::default()));
    let producers: Vec<_> = (0..PRODUCERS)
        .map(|p| {
            let (outbox, written) = (outbox.clone(), written.clone());
            thread::spawn(move || {
                let mut rng = StdRng::seed_from_u64(p as u64);
                let mut client = common::client();
                for t in 0..TRANSACTIONS {
                    produce_one(
                        &mut client,
                        &outbox,
                        &written,
                        &mut rng,
                        &format!("{p}-{t}"),
                    );
                }
            })
        })
        .collect();
    // Meanwhile, at every snapshot, a marked head is its aggregate's oldest pending or
    // parked row (the relay claims marked heads without looking behind them).
    let stop = Arc::new(AtomicBool::new(false));
    let checker = {
        let (outbox, stop) = (outbox.clone(), stop.clone());
        thread::spawn(move || {
            let mut client = common::client();
            let mut checks = 0u32;
            let mut wrong = Vec::new();
            while !stop.load(Ordering::SeqCst) {
                let rows = client
                    .query(
                        &format!(
                            "SELECT h.key FROM {t} h
                             WHERE h.head AND h.status IN ('pending', 'parked')
                               AND EXISTS (SELECT 1 FROM {t} o
                                           WHERE o.aggregate_key = h.aggregate_key
                                             AND o.id < h.id
                                             AND o.status IN ('pending', 'parked'))",
                            t = quoted(&outbox)
                        ),
                        &[],
                    )
                    .unwrap();
                wrong.extend(rows.into_iter().map(|row| row.get::<_, String>(0)));
                checks += 1;
                thread::sleep(Duration::from_millis(5));
            }
            (checks, wrong)
        })
    };
    for producer in producers {
        producer.join().unwrap();
    }
    stop.store(true, Ordering::SeqCst);
    let (checks, wrong) = checker.join().unwrap();
    assert!(checks > 0);
    assert!(
        wrong.is_empty(),
        "marked heads behind older rows: {wrong:?}"
    );

    let written = written.lock().unwrap();
    assert!(written.rolled_back > 0 && written.committed.len() > 100);
    wait_until("every committed message is published", || {
        sink.len() >= written.committed.len()
    });
    relay.shutdown(Duration::from_secs(10)).unwrap();
    let mut delivered: HashMap<String, Vec<u64>> = HashMap::new();
    for record in sink.records() {
        let (aggregate, place) = written.place[&record.key].clone();
        delivered.entry(aggregate).or_default().push(place);
    }
    let mut expected: HashMap<String, Vec<u64>> = HashMap::new();
    for key in &written.committed {
        let (aggregate, place) = written.place[key].clone();
        expected.entry(aggregate).or_default().push(place);
    }
    assert_eq!(delivered.len(), SHARED_AGGREGATES);
    for (aggregate, places) in expected.iter_mut() {
        places.sort_unstable();
        assert_eq!(&delivered[aggregate], places, "aggregate {aggregate}");
    }
}

/// One producer transaction of the stress test: single enqueues, a small batch, or now and
/// then a batch large enough to go by COPY; a pause between insert and commit; one in five
/// rolled back. Aggregates are enqueued in the byte order of their keys within a transaction,
/// the order in which a batch locks them, so producers never wait on each other in a circle.
fn produce_one(
    client: &mut Client,
    outbox: &Outbox,
    written: &Mutex<Written>,
    rng: &mut StdRng,
    id: &str,
) {
    let size = match rng.gen_range(0..20) {
        0 => 70,
        1..=6 => rng.gen_range(2..6),
        _ => rng.gen_range(1..4),
    };
    let mut aggregates: Vec<usize> = (0..size)
        .map(|_| rng.gen_range(0..SHARED_AGGREGATES))
        .collect();
    aggregates.sort_unstable();
    let messages: Vec<(String, Message)> = aggregates
        .iter()
        .enumerate()
        .map(|(i, a)| {
            let key = format!("{id}-{i}");
            let message = Message::new(TOPIC, key.clone())
                .key(key.clone())
                .aggregate_key(format!("agg-{a}"));
            (key, message)
        })
        .collect();
    let keys: Vec<String> = messages.iter().map(|(k, _)| k.clone()).collect();
    let mut tx = client.transaction().unwrap();
    if size > 1 && rng.gen_bool(0.5) {
        outbox
            .enqueue_all(&mut tx, messages.into_iter().map(|(_, m)| m))
            .unwrap();
    } else {
        for (_, message) in messages {
            outbox.enqueue(&mut tx, message).unwrap();
        }
    }
    // The transaction holds its aggregates from here to its end, so this order is the
    // order in which producers passed each aggregate.
    {
        let mut w = written.lock().unwrap();
        for (key, a) in keys.iter().zip(&aggregates) {
            let aggregate = format!("agg-{a}");
            let next = w.next.entry(aggregate.clone()).or_insert(0);
            *next += 1;
            let place = *next;
            w.place.insert(key.clone(), (aggregate, place));
        }
    }
    thread::sleep(Duration::from_millis(rng.gen_range(0..15)));
    if rng.gen_bool(0.2) {
        tx.rollback().unwrap();
        written.lock().unwrap().rolled_back += 1;
    } else {
        tx.commit().unwrap();
        written.lock().unwrap().committed.extend(keys);
    }
}

#[test]
fn ten_thousand_aggregates_in_one_batch_take_a_bounded_number_of_locks() {
    let (outbox, mut client) = common::outbox("race_many");
    let mut producer = common::client();
    let pid = backend_pid(&mut producer);
    // On a partitioned table, a producer of the caller's keys holds one lock more: the one
    // a partition cut waits for (see sql/partitioned.sql).
    let keys = i64::from(common::partitioned());

    // A small batch locks each of its aggregates, and their buckets of the table's ordered
    // enqueues (sixteen of them) shared.
    let mut tx = producer.transaction().unwrap();
    outbox
        .enqueue_all(&mut tx, (0..40).map(|i| message(&format!("s{i}"), "x")))
        .unwrap();
    let held = advisory_locks(&mut client, pid);
    assert!(
        (41 + keys..=56 + keys).contains(&held),
        "{held} advisory locks"
    );
    tx.commit().unwrap();

    // Past 64 in one transaction, the table's ordered enqueues (all sixteen buckets),
    // exclusively: by COPY, by the batch function, and one enqueue at a time.
    for (what, n) in [("copy", 10_000), ("batch", 63), ("single", 100)] {
        let mut tx = producer.transaction().unwrap();
        outbox
            .enqueue_all(
                &mut tx,
                (0..2).map(|i| message(&format!("{what}-first{i}"), "x")),
            )
            .unwrap();
        let messages = (0..n).map(|i| message(&format!("{what}{i}"), "x"));
        if what == "single" {
            for m in messages {
                outbox.enqueue(&mut tx, m).unwrap();
            }
        } else {
            outbox.enqueue_all(&mut tx, messages).unwrap();
        }
        // At most 64 aggregates, 16 buckets shared and 16 exclusive.
        let held = advisory_locks(&mut client, pid);
        assert!(held <= 96 + keys, "{what}: {held} advisory locks");
        // Meanwhile other ordered producers of this table wait; unordered ones do not.
        let mut other = common::client();
        other.batch_execute("SET lock_timeout = '200ms'").unwrap();
        let mut other_tx = other.transaction().unwrap();
        let e = outbox
            .enqueue(&mut other_tx, message("elsewhere", what))
            .unwrap_err();
        assert_eq!(e.code(), Some(&SqlState::LOCK_NOT_AVAILABLE), "{e}");
        other_tx.rollback().unwrap();
        let mut other_tx = other.transaction().unwrap();
        outbox
            .enqueue(&mut other_tx, Message::new(TOPIC, "loose"))
            .unwrap();
        other_tx.commit().unwrap();
        tx.commit().unwrap();
    }
    assert_eq!(
        count(&mut client, &outbox, "aggregate_key IS NOT NULL"),
        40 + 6 + 10_000 + 63 + 100
    );
}

#[test]
fn batches_locking_the_same_aggregates_in_any_order_never_deadlock() {
    let (outbox, _client) = common::outbox("race_batches");
    let threads: Vec<_> = (0..3u64)
        .map(|t| {
            let outbox = outbox.clone();
            thread::spawn(move || {
                let mut rng = StdRng::seed_from_u64(t);
                let mut client = common::client();
                for i in 0..40 {
                    let mut aggregates: Vec<u32> = (0..6).collect();
                    for k in (1..aggregates.len()).rev() {
                        aggregates.swap(k, rng.gen_range(0..=k));
                    }
                    let messages = aggregates
                        .iter()
                        .map(|a| message(&format!("a{a}"), &format!("{t}-{i}")));
                    let mut tx = client.transaction().unwrap();
                    // A deadlock would fail this with SQLSTATE 40P01 (after deadlock_timeout).
                    outbox.enqueue_all(&mut tx, messages).unwrap();
                    thread::sleep(Duration::from_millis(rng.gen_range(0..3)));
                    tx.commit().unwrap();
                }
            })
        })
        .collect();
    for thread in threads {
        thread.join().unwrap();
    }
}

#[test]
fn a_producer_of_the_previous_version_still_enqueues_after_the_upgrade() {
    if common::plain_only("a table is made partitioned by this version: no producer before it") {
        return;
    }
    let (outbox, mut client) = common::outbox("race_old_producer");
    // The statement the previous version sends: ten arguments, no park setting.
    let function = format!("\"{}_enqueue\"", outbox.table());
    let inserted: bool = client
        .query_one(
            &format!(
                "SELECT {function}('old', 't', 'agg', 'x'::bytea, NULL, '{{}}', NULL, 0, NULL, false)"
            ),
            &[],
        )
        .unwrap()
        .get(0);
    assert!(inserted);
    assert_eq!(
        row_state(&mut client, &outbox, "old"),
        ("pending".into(), 0)
    );
}

// ---------------------------------------------------------------------------------------------
// Parked dead letters
// ---------------------------------------------------------------------------------------------

/// A publisher that fails `poison` permanently until `cured`, and records the rest.
fn poisoned(
    sink: &Sink,
    poison: &'static str,
    cured: &Arc<AtomicBool>,
) -> impl Fn(&Record) -> Result<(), PublishError> + Send + Sync + 'static {
    let (sink, cured) = (sink.clone(), cured.clone());
    move |record: &Record| {
        if record.key == poison && !cured.load(Ordering::SeqCst) {
            return Err(PublishError::permanent("poison"));
        }
        sink.push(record);
        Ok(())
    }
}

/// Three messages of `a` (the first poison), then one of `b`.
fn parked_scene(client: &mut Client, outbox: &Outbox) {
    let mut tx = client.transaction().unwrap();
    for m in [
        message("a", "0"),
        message("a", "1"),
        message("a", "2"),
        message("b", "0"),
    ] {
        outbox.enqueue(&mut tx, m).unwrap();
    }
    tx.commit().unwrap();
}

fn parked_relay(outbox: &Outbox, sink: &Sink, cured: &Arc<AtomicBool>) -> RelayConfig {
    relay_config(outbox, poisoned(sink, "a-0", cured)).park_on_dead(true)
}

#[test]
fn a_dead_message_parks_its_aggregate_and_a_redrive_sends_it_first() -> TestResult {
    let (outbox, mut client) = common::outbox("park_redrive");
    let sink = Sink::default();
    let cured = Arc::new(AtomicBool::new(false));
    parked_scene(&mut client, &outbox);
    let config = parked_relay(&outbox, &sink, &cured);
    Relay::run_until_idle(&config)?;

    assert_eq!(sink.keys(), ["b-0"]);
    assert_eq!(row_state(&mut client, &outbox, "a-0"), ("parked".into(), 1));
    let stats = common::stats(&outbox, &mut client);
    assert_eq!(
        (
            stats.parked,
            stats.dead,
            stats.blocked,
            stats.due,
            stats.pending
        ),
        (1, 1, 2, 0, 2),
        "{stats:?}"
    );
    assert!(stats.oldest_blocked_age.is_some());
    let parked = outbox.dead_letters(&mut client, Filter::new().parked().limit(10))?;
    assert_eq!(parked.len(), 1);
    assert_eq!(parked[0].record.key, "a-0");
    // Nothing moves however often the relay looks.
    assert_eq!(Relay::run_until_idle(&config)?, 0);

    cured.store(true, Ordering::SeqCst);
    assert_eq!(
        outbox.count(&mut client, Rows::Dead.matching(Filter::new().parked()))?,
        1
    );
    assert_eq!(outbox.redrive(&mut client, Filter::new().key("a-0"))?, 1);
    Relay::run_until_idle(&config)?;
    assert_eq!(sink.keys(), ["b-0", "a-0", "a-1", "a-2"]);
    let stats = common::stats(&outbox, &mut client);
    assert_eq!((stats.parked, stats.dead, stats.pending), (0, 0, 0));
    Ok(())
}

#[test]
fn skipping_a_parked_message_lets_the_rest_go_and_leaves_it_dead() -> TestResult {
    let (outbox, mut client) = common::outbox("park_skip");
    let sink = Sink::default();
    let cured = Arc::new(AtomicBool::new(false));
    parked_scene(&mut client, &outbox);
    let config = parked_relay(&outbox, &sink, &cured);
    Relay::run_until_idle(&config)?;

    // A relay waiting for work is woken by the skip, not by its hourly poll.
    let relay = Relay::spawn(config.clone().poll_interval(Duration::from_secs(3600)))?;
    wait_until("the relay listens", || relay.is_listening());
    assert_eq!(outbox.skip(&mut client, Filter::new().key("b-0"))?, 0);
    assert_eq!(
        outbox.count(&mut client, Rows::Dead.matching(Filter::new().parked()))?,
        1
    );
    assert_eq!(outbox.skip(&mut client, Filter::new().key("a-0"))?, 1);
    wait_until("the rest is published", || sink.len() == 3);
    relay.shutdown(Duration::from_secs(10))?;
    assert_eq!(sink.keys(), ["b-0", "a-1", "a-2"]);
    assert_eq!(row_state(&mut client, &outbox, "a-0"), ("dead".into(), 1));
    let stats = common::stats(&outbox, &mut client);
    assert_eq!((stats.parked, stats.dead, stats.pending), (0, 1, 0));
    // Skipped, it is an ordinary dead letter: purged like one, redriven like one.
    assert_eq!(
        outbox
            .dead_letters(&mut client, Filter::new().parked().limit(10))?
            .len(),
        0
    );
    Ok(())
}

#[test]
fn a_message_says_whether_it_parks_whatever_the_relay_default() -> TestResult {
    let (outbox, mut client) = common::outbox("park_override");
    let sink = Sink::default();
    let cured = Arc::new(AtomicBool::new(false));
    let mut tx = client.transaction()?;
    outbox.enqueue(&mut tx, message("a", "0").park_on_dead(true))?;
    outbox.enqueue(&mut tx, message("a", "1"))?;
    outbox.enqueue(&mut tx, message("c", "0").park_on_dead(false))?;
    outbox.enqueue(&mut tx, message("c", "1"))?;
    // Without an aggregate there is nothing to park.
    outbox.enqueue(
        &mut tx,
        Message::new(TOPIC, "x").key("loose").park_on_dead(true),
    )?;
    tx.commit()?;
    let poison = |record: &Record| ["a-0", "c-0", "loose"].contains(&record.key.as_str());
    let publish = {
        let sink = sink.clone();
        move |record: &Record| {
            if poison(record) && !cured.load(Ordering::SeqCst) {
                return Err(PublishError::permanent("poison"));
            }
            sink.push(record);
            Ok(())
        }
    };
    // The relay parks by default, except where a message says not to, and the reverse.
    for park in [false, true] {
        let config = relay_config(&outbox, publish.clone()).park_on_dead(park);
        Relay::run_until_idle(&config)?;
    }
    assert_eq!(row_state(&mut client, &outbox, "a-0").0, "parked");
    assert_eq!(row_state(&mut client, &outbox, "c-0").0, "dead");
    assert_eq!(row_state(&mut client, &outbox, "loose").0, "dead");
    assert_eq!(sink.keys(), ["c-1"]);
    Ok(())
}

#[test]
fn a_row_that_dies_at_claim_parks_too() -> TestResult {
    let outbox = common::builder()
        .table(common::unique_name("park_claim"))
        .park_on_dead(true)
        .retry(Retry::default().max_claims(2))
        .build()?;
    let mut client = common::client();
    outbox.migrate(&mut client)?;
    let mut tx = client.transaction()?;
    outbox.enqueue(&mut tx, message("a", "0"))?;
    outbox.enqueue(&mut tx, message("a", "1"))?;
    tx.commit()?;
    // Claimed twice already, by relays that crashed with it.
    client.execute(
        &format!(
            "UPDATE {} SET claims = 2 WHERE key = 'a-0'",
            common::quoted(&outbox)
        ),
        &[],
    )?;
    let sink = Sink::default();
    Relay::run_until_idle(&relay_config(&outbox, sink.collect()))?;
    assert_eq!(row_state(&mut client, &outbox, "a-0"), ("parked".into(), 0));
    // Its successor was claimed in the same run, and handed back unpublished.
    assert!(sink.keys().is_empty());
    assert_eq!(
        row_state(&mut client, &outbox, "a-1"),
        ("pending".into(), 0)
    );
    Ok(())
}

#[test]
fn process_parks_too_and_purge_leaves_parked_letters_alone() -> TestResult {
    let outbox = common::builder()
        .table(common::unique_name("park_process"))
        .park_on_dead(true)
        .build()?;
    let mut client = common::client();
    outbox.migrate(&mut client)?;
    parked_scene(&mut client, &outbox);
    let mut handled = Vec::new();
    outbox.process(&mut client, 100, |_, record| {
        if record.key == "a-0" {
            return Err(HandlerError::permanent("poison"));
        }
        handled.push(record.key.clone());
        Ok(())
    })?;
    assert_eq!(handled, ["b-0"]);
    assert_eq!(row_state(&mut client, &outbox, "a-0").0, "parked");

    let purge = postgres_outbox::Rows::Dead;
    assert_eq!(outbox.purge(&mut client, purge.matching(Filter::new()))?, 0);
    let e = outbox
        .purge(&mut client, purge.matching(Filter::new().parked()))
        .unwrap_err();
    assert!(e.is_invalid_input(), "{e}");
    assert_eq!(row_state(&mut client, &outbox, "a-0").0, "parked");
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Heads marked at enqueue
// ---------------------------------------------------------------------------------------------

/// The keys of the pending or parked rows marked as their aggregate's head at enqueue, in
/// key order.
fn marked_heads(client: &mut Client, outbox: &Outbox) -> Vec<String> {
    client
        .query(
            &format!(
                "SELECT key FROM {} WHERE head AND status IN ('pending', 'parked') ORDER BY key",
                quoted(outbox)
            ),
            &[],
        )
        .unwrap()
        .into_iter()
        .map(|row| row.get(0))
        .collect()
}

#[test]
fn an_enqueue_marks_a_head_only_when_its_aggregate_has_nothing_pending_or_parked() -> TestResult {
    let (outbox, mut client) = common::outbox("heads_marked");
    let mut tx = client.transaction()?;
    outbox.enqueue(&mut tx, message("a", "1"))?;
    outbox.enqueue(&mut tx, message("a", "2"))?;
    outbox.enqueue(&mut tx, Message::new(TOPIC, "loose").key("loose"))?;
    // A batch: the first of a new aggregate is its head, the first of a pending one is not.
    outbox.enqueue_all(
        &mut tx,
        [message("b", "1"), message("b", "2"), message("a", "3")],
    )?;
    // A batch large enough to be copied in marks its heads the same way.
    let copied = (0..100).map(|i| message(if i == 0 { "a" } else { "c" }, &format!("x{i}")));
    outbox.enqueue_all(&mut tx, copied)?;
    tx.commit()?;
    assert_eq!(marked_heads(&mut client, &outbox), ["a-1", "b-1", "c-x1"]);

    // An aggregate whose rows are all finished takes a new head; one whose last row is in
    // flight or parked does not.
    client.batch_execute(&format!(
        "UPDATE {t} SET status = 'sent', done_at = now() WHERE aggregate_key = 'a';
         UPDATE {t} SET available_at = now() + interval '1 hour',
                        lease_until = now() + interval '1 hour', attempts = 1
         WHERE aggregate_key = 'b';
         UPDATE {t} SET status = 'parked', done_at = now() WHERE aggregate_key = 'c';",
        t = quoted(&outbox)
    ))?;
    let mut tx = client.transaction()?;
    for m in [message("a", "4"), message("b", "3"), message("c", "y")] {
        outbox.enqueue(&mut tx, m)?;
    }
    tx.commit()?;
    assert_eq!(marked_heads(&mut client, &outbox), ["a-4", "b-1", "c-x1"]);

    // Under REPEATABLE READ the snapshot may predate an earlier producer's commit: nothing
    // is marked, and the row is found by the claim's scan instead.
    let mut tx = client
        .build_transaction()
        .isolation_level(postgres::IsolationLevel::RepeatableRead)
        .start()?;
    outbox.enqueue(&mut tx, message("d", "1"))?;
    outbox.enqueue_all(&mut tx, (0..100).map(|i| message("e", &format!("{i}"))))?;
    tx.commit()?;
    assert_eq!(
        count(&mut client, &outbox, "aggregate_key IN ('d', 'e') AND head"),
        0
    );
    let sink = Sink::default();
    let config = relay_config(&outbox, sink.collect());
    Relay::run_until_idle(&config)?;
    let expected: Vec<String> = (0..100).map(|i| i.to_string()).collect();
    assert_eq!(published(&sink, "e"), expected);
    assert_eq!(published(&sink, "d"), ["1"]);
    assert_eq!(published(&sink, "a"), ["4"]);
    Ok(())
}

/// The plans PostgreSQL logs (by `auto_explain`) for the statements `client` runs from now
/// on, nested ones included.
fn logged_plans(mut config: postgres::Config) -> (Client, Arc<Mutex<Vec<String>>>) {
    let plans = Arc::new(Mutex::new(Vec::new()));
    let sink = Arc::clone(&plans);
    config.notice_callback(move |notice| sink.lock().unwrap().push(notice.message().to_owned()));
    let mut client = config
        .connect(postgres::NoTls)
        .expect("connect to PostgreSQL");
    client
        .batch_execute(
            "LOAD 'auto_explain';
             SET auto_explain.log_min_duration = 0;
             SET auto_explain.log_nested_statements = on;
             SET client_min_messages = log;",
        )
        .expect("auto_explain");
    (client, plans)
}

#[test]
fn a_batch_checks_its_aggregates_by_index_probes_however_many_rows_are_pending() -> TestResult {
    let (outbox, mut client) = common::outbox("heads_probed");
    let t = quoted(&outbox);
    // A backlog much larger than a batch: reading it whole into a hash once looks cheaper to
    // the planner than a probe per aggregate, and costs what the backlog costs.
    client.batch_execute(&format!(
        "INSERT INTO {t} (key, topic, aggregate_key, payload, head)
         SELECT 'old-' || i, '{TOPIC}', 'agg-' || i, 'p', true
         FROM generate_series(1, 20000) AS i;
         ANALYZE {t};"
    ))?;
    let (mut watched, plans) = logged_plans(common::database_url().parse()?);
    // Each batch: a new aggregate, twice, then one with a pending row, then new ones; one
    // goes in by COPY, the other (scheduled) by the batch function.
    let batch = |tag: &'static str, delay: Duration| {
        (0..1000).map(move |i| {
            let aggregate = match i {
                0 | 1 => format!("{tag}-first"),
                2 => "agg-7".to_owned(),
                i => format!("{tag}-{i}"),
            };
            Message::new(TOPIC, "p")
                .key(format!("{tag}-key-{i}"))
                .aggregate_key(aggregate)
                .delay(delay)
        })
    };
    let mut tx = watched.transaction()?;
    outbox.enqueue_all(&mut tx, batch("copied", Duration::ZERO))?;
    outbox.enqueue_all(&mut tx, batch("scheduled", Duration::from_secs(3600)))?;
    tx.commit()?;

    let plans = plans.lock().unwrap().join("\n");
    let name = outbox.table();
    // A probe of the ordered index per aggregate (an index-only scan or a plain one, as the
    // planner likes), and neither a read of the whole table nor a hash of what it read. On
    // a partitioned table, of a partition's.
    let ordered = leaves(&mut client, &format!("{name}_ordered"));
    assert!(
        ["Index Only Scan using", "Index Scan using"]
            .iter()
            .any(|scan| ordered
                .iter()
                .any(|index| plans.contains(&format!("{scan} {index} "))),),
        "no probe of {ordered:?} in:\n{plans}"
    );
    for table in leaves(&mut client, name) {
        let whole = format!("Seq Scan on {table} ");
        assert!(!plans.contains(&whole), "{whole} in:\n{plans}");
    }
    for reading in [
        "Hash Join",
        "Hash Semi Join",
        "Hash Right",
        "hashed SubPlan",
    ] {
        assert!(!plans.contains(reading), "{reading} in:\n{plans}");
    }
    let heads = count(
        &mut client,
        &outbox,
        "head AND (key LIKE 'copied-%' OR key LIKE 'scheduled-%')",
    );
    // Of each batch, 998 aggregates are new: their first rows are heads, agg-7's is not.
    assert_eq!(heads, 2 * 998);
    for tag in ["copied", "scheduled"] {
        let (first, second, behind): (bool, bool, bool) = {
            let row = client.query_one(
                &format!(
                    "SELECT bool_or(head) FILTER (WHERE key = $1 || '-key-0'),
                            bool_or(head) FILTER (WHERE key = $1 || '-key-1'),
                            bool_or(head) FILTER (WHERE key = $1 || '-key-2')
                     FROM {t}"
                ),
                &[&tag],
            )?;
            (row.get(0), row.get(1), row.get(2))
        };
        assert_eq!((first, second, behind), (true, false, false), "{tag}");
    }
    Ok(())
}

/// `a-1` is dead (not parked) and `a-2`, enqueued since, is marked as the head.
fn dead_head_and_a_later_marked_one(client: &mut Client, outbox: &Outbox) {
    let mut tx = client.transaction().unwrap();
    outbox.enqueue(&mut tx, message("a", "1")).unwrap();
    tx.commit().unwrap();
    client
        .batch_execute(&format!(
            "UPDATE {} SET status = 'dead', attempts = 1, done_at = now(), last_error = 'boom'",
            quoted(outbox)
        ))
        .unwrap();
    let mut tx = client.transaction().unwrap();
    outbox.enqueue(&mut tx, message("a", "2")).unwrap();
    tx.commit().unwrap();
    assert_eq!(marked_heads(client, outbox), ["a-2"]);
}

#[test]
fn a_redriven_dead_letter_goes_before_a_later_message_marked_head_while_it_was_dead() -> TestResult
{
    // A batch of one takes either kind of row; a batch of two could take both at once.
    // Neither may take "2" ahead of "1".
    for batch in [1, 2] {
        let (outbox, mut client) = common::outbox("heads_redrive");
        dead_head_and_a_later_marked_one(&mut client, &outbox);
        assert_eq!(outbox.redrive(&mut client, Filter::new().key("a-1"))?, 1);
        assert!(marked_heads(&mut client, &outbox).is_empty());

        let sink = Sink::default();
        let config = relay_config(&outbox, sink.collect()).batch_size(batch);
        Relay::run_until_idle(&config)?;
        assert_eq!(published(&sink, "a"), ["1", "2"], "batch of {batch}");
    }
    Ok(())
}

#[test]
fn a_redrive_waits_for_a_producer_of_the_aggregate_and_goes_before_its_message() -> TestResult {
    let (outbox, mut client) = common::outbox("heads_redrive_race");
    dead_head_and_a_later_marked_one(&mut client, &outbox);
    client.batch_execute(&format!(
        "UPDATE {} SET status = 'sent', done_at = now() WHERE key = 'a-2'",
        quoted(&outbox)
    ))?;

    // A producer holds the aggregate, its row about to be marked as the head (a-1 is dead).
    let mut producer = common::client();
    let mut open = producer.transaction()?;
    outbox.enqueue(&mut open, message("a", "3"))?;
    let (pid_tx, pid_rx) = mpsc::channel();
    let redriving = {
        let outbox = outbox.clone();
        thread::spawn(move || {
            let mut client = common::client();
            pid_tx.send(backend_pid(&mut client)).unwrap();
            outbox
                .redrive(&mut client, Filter::new().key("a-1"))
                .unwrap()
        })
    };
    let pid = pid_rx.recv()?;
    wait_until("the redrive waits for the aggregate", || {
        waits_for_a_lock(&mut client, pid)
    });
    open.commit()?;
    assert_eq!(redriving.join().unwrap(), 1);
    assert!(marked_heads(&mut client, &outbox).is_empty());

    let sink = Sink::default();
    Relay::run_until_idle(&relay_config(&outbox, sink.collect()))?;
    assert_eq!(published(&sink, "a"), ["1", "3"]);
    Ok(())
}

#[test]
fn a_run_behind_a_ready_head_stops_where_another_transaction_holds_a_row() -> TestResult {
    let (outbox, mut client) = common::outbox("heads_run_cut");
    let mut tx = client.transaction()?;
    for i in 0..4 {
        outbox.enqueue(&mut tx, message("a", &i.to_string()))?;
    }
    tx.commit()?;
    assert_eq!(marked_heads(&mut client, &outbox), ["a-0"]);

    // Someone else holds "1", the second of the run behind the marked head.
    let mut other = common::client();
    let mut holding = other.transaction()?;
    holding.execute(
        &format!(
            "SELECT 1 FROM {} WHERE key = 'a-1' FOR UPDATE",
            quoted(&outbox)
        ),
        &[],
    )?;
    let sink = Sink::default();
    let config = relay_config(&outbox, sink.collect())
        .batch_size(10)
        .concurrency(1);
    // The head goes; the rest of its run stops at the row it cannot lock.
    assert_eq!(Relay::run_once(&config)?, 1);
    assert_eq!(published(&sink, "a"), ["0"]);
    holding.rollback()?;
    Relay::run_until_idle(&config)?;
    assert_eq!(published(&sink, "a"), ["0", "1", "2", "3"]);
    Ok(())
}
