//! The relay against a real PostgreSQL: delivery, leases and fencing, retries and dead
//! letters, ordering, wake-up and shutdown.
//!
//! Every test works on its own table, so they run in parallel. Nothing sleeps and hopes: each
//! wait is for a condition (`common::wait_until`), and slow or stuck publishers are built from
//! gates the test opens itself.

mod common;

use std::collections::{HashMap, HashSet};
use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use common::{
    count, quoted, relay_config, relay_config_with_pool, row_state, wait_until, Counters, Gate,
    Sink, RELAY_POOL,
};
use postgres::Client;
use postgres_outbox::{
    publisher_fn, Connections, Filter, HandlerError, Message, Metrics, Outbox, PublishError,
    Publisher, PublisherFn, Record, Relay, RelayConfig, Retry,
};

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// Enqueues `messages` in one committed transaction; returns their keys.
fn enqueue(client: &mut Client, outbox: &Outbox, messages: Vec<Message>) -> Vec<String> {
    let mut tx = client.transaction().unwrap();
    let keys = messages
        .into_iter()
        .map(|m| outbox.enqueue(&mut tx, m).unwrap())
        .collect();
    tx.commit().unwrap();
    keys
}

fn enqueue_one(client: &mut Client, outbox: &Outbox, message: Message) -> String {
    enqueue(client, outbox, vec![message]).remove(0)
}

/// `n` plain messages with keys `<prefix>-0` .. `<prefix>-(n-1)`.
fn numbered(prefix: &str, n: usize) -> Vec<Message> {
    (0..n)
        .map(|i| Message::new("t", format!("payload {i}")).key(format!("{prefix}-{i}")))
        .collect()
}

fn last_error(client: &mut Client, outbox: &Outbox, key: &str) -> Option<String> {
    client
        .query_one(
            &format!("SELECT last_error FROM {} WHERE key = $1", quoted(outbox)),
            &[&key],
        )
        .unwrap()
        .get(0)
}

/// Backend pids of listeners LISTENing on this outbox's channel. A listener's last statement
/// is its `LISTEN "<channel>"`, which tells it apart from other tests' listeners.
fn listener_pids(client: &mut Client, outbox: &Outbox) -> Vec<i32> {
    let channel = outbox.channel(client).unwrap();
    client
        .query(
            "SELECT pid FROM pg_stat_activity
             WHERE application_name = 'postgres-outbox listener'
               AND datname = current_database() AND query = $1",
            &[&format!("LISTEN \"{channel}\"")],
        )
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Delivery
// ---------------------------------------------------------------------------------------------

#[test]
fn committed_publishes_once_and_rolled_back_never() {
    let (outbox, mut client) = common::outbox("rl_commit");
    let sink = Sink::default();
    let relay = Relay::spawn(relay_config(&outbox, sink.collect())).unwrap();

    let mut tx = client.transaction().unwrap();
    outbox
        .enqueue(&mut tx, Message::new("t", "never").key("rolled-back"))
        .unwrap();
    tx.rollback().unwrap();
    let key = enqueue_one(
        &mut client,
        &outbox,
        Message::new("order.created", b"{\"id\":1}".to_vec())
            .key("committed")
            .aggregate_key("order-1")
            .content_type("application/json")
            .header("tenant", "acme")
            .header("trace", "abc"),
    );
    assert_eq!(key, "committed");
    // Enqueued after both: once it is out, everything before it has been claimable.
    enqueue_one(
        &mut client,
        &outbox,
        Message::new("t", "marker").key("marker"),
    );

    wait_until("the marker is published", || sink.contains("marker"));
    wait_until("both are recorded sent", || {
        count(&mut client, &outbox, "status = 'sent'") == 2
    });
    let report = relay.shutdown(Duration::from_secs(10)).unwrap();
    assert_eq!(report.published, 2);
    assert_eq!(report.abandoned, 0);

    let records = sink.records();
    assert!(
        !sink.contains("rolled-back"),
        "a rolled-back message was published"
    );
    assert_eq!(count(&mut client, &outbox, "key = 'rolled-back'"), 0);
    let committed: Vec<&Record> = records.iter().filter(|r| r.key == "committed").collect();
    assert_eq!(committed.len(), 1, "published exactly once");
    let r = committed[0];
    assert_eq!(r.topic, "order.created");
    assert_eq!(r.payload, b"{\"id\":1}");
    assert_eq!(r.aggregate_key.as_deref(), Some("order-1"));
    assert_eq!(r.content_type.as_deref(), Some("application/json"));
    assert_eq!(
        r.headers,
        vec![
            ("tenant".to_owned(), "acme".to_owned()),
            ("trace".to_owned(), "abc".to_owned())
        ]
    );
    assert_eq!(r.attempt, 1);
    assert_eq!(records.len(), 2);
    assert_eq!(
        row_state(&mut client, &outbox, "committed"),
        ("sent".into(), 1)
    );
}

/// A relay's sessions have settings of their own (a statement timeout, commits that do not
/// wait for the WAL flush, on a partitioned table generic plans and no sequential scans):
/// the connection goes back to the caller's pool with the server's settings, as it came.
#[test]
fn a_relay_gives_its_pooled_connection_back_with_the_servers_settings() {
    let (outbox, mut client) = common::outbox("rl_session");
    enqueue_one(&mut client, &outbox, Message::new("t", "one").key("one"));
    let pool = common::pool(1);
    let sink = Sink::default();
    let config = common::relay_config_with(&outbox, pool.clone(), sink.collect());
    assert_eq!(Relay::run_until_idle(&config).unwrap(), 1);
    let mut conn = pool.get().unwrap();
    for setting in [
        "application_name",
        "statement_timeout",
        "idle_in_transaction_session_timeout",
        "jit",
        "synchronous_commit",
        "plan_cache_mode",
        "enable_seqscan",
    ] {
        let show = format!("SHOW {setting}");
        let server: String = client.query_one(&show, &[]).unwrap().get(0);
        let value: String = conn.query_one(&show, &[]).unwrap().get(0);
        assert_eq!(value, server, "{setting}");
    }
}

#[test]
fn crash_between_publish_and_record_republishes_and_dedupe_catches_it() {
    let (outbox, mut client) = common::outbox("rl_crash");
    let key = enqueue_one(&mut client, &outbox, Message::new("t", "p"));
    let deliveries = Sink::default();

    // The first relay publishes, then "crashes": its publisher never returns, so the outcome
    // is never recorded. It claims once at start and never again (no notify, hourly polls).
    let stuck = Gate::default();
    let first = {
        let (deliveries, stuck) = (deliveries.clone(), stuck.clone());
        relay_config(&outbox, move |record| {
            deliveries.push(record);
            stuck.pass();
            Ok(())
        })
    }
    .lease(Duration::from_secs(2))
    .batch_size(1)
    .concurrency(1)
    .notify(false)
    .poll_interval(Duration::from_secs(3600));
    let first = Relay::spawn(first).unwrap();
    wait_until("the first relay published", || deliveries.len() == 1);
    wait_until("the first publisher is stuck", || stuck.waiting() == 1);

    // The second relay finds the row once the first one's lease runs out.
    let second = relay_config(&outbox, deliveries.collect())
        .notify(false)
        .poll_interval(Duration::from_millis(50));
    let second = Relay::spawn(second).unwrap();
    wait_until("the second relay republished", || deliveries.len() == 2);
    wait_until("the second relay recorded it", || {
        row_state(&mut client, &outbox, &key).0 == "sent"
    });
    // The first relay's lease ran out: no verdict, so the second publish is still the
    // first attempt, and the message's one attempt is its only one.
    assert_eq!(row_state(&mut client, &outbox, &key), ("sent".into(), 1));

    let seen = deliveries.records();
    assert_eq!(seen[0].key, key);
    assert_eq!(seen[1].key, key);
    assert_eq!((seen[0].attempt, seen[1].attempt), (1, 1));

    // The consumer deduplicates on the key: the first delivery is fresh, the second is not.
    let fresh: Vec<bool> = seen
        .iter()
        .map(|record| {
            let mut tx = client.transaction().unwrap();
            let fresh = outbox.dedupe(&mut tx, "consumer", &record.key).unwrap();
            tx.commit().unwrap();
            fresh
        })
        .collect();
    assert_eq!(fresh, [true, false]);

    // The first relay comes back to life and records its stale outcome: fenced, it changes
    // nothing.
    stuck.open();
    let report = first.shutdown(Duration::from_secs(10)).unwrap();
    assert_eq!(report.published, 0, "a lost lease must not be recorded");
    assert_eq!(report.abandoned, 0);
    assert_eq!(row_state(&mut client, &outbox, &key), ("sent".into(), 1));
    let report = second.shutdown(Duration::from_secs(10)).unwrap();
    assert_eq!(report.published, 1);
    assert_eq!(deliveries.len(), 2);
}

#[test]
fn four_relays_publish_every_key_exactly_once() {
    let (outbox, mut client) = common::outbox("rl_many");
    let seen: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
    let relays: Vec<Relay> = (0..4)
        .map(|_| {
            let seen = seen.clone();
            let config = relay_config(&outbox, move |record| {
                *seen.lock().unwrap().entry(record.key.clone()).or_default() += 1;
                Ok(())
            })
            .concurrency(4)
            .batch_size(20);
            Relay::spawn(config).unwrap()
        })
        .collect();

    let mut keys = Vec::new();
    for part in 0..4 {
        let mut tx = client.transaction().unwrap();
        keys.extend(
            outbox
                .enqueue_all(&mut tx, numbered(&format!("k{part}"), 100))
                .unwrap(),
        );
        tx.commit().unwrap();
    }
    wait_until("400 keys published", || seen.lock().unwrap().len() == 400);
    wait_until("400 rows recorded sent", || {
        count(&mut client, &outbox, "status = 'sent'") == 400
    });
    let published: u64 = relays
        .into_iter()
        .map(|r| r.shutdown(Duration::from_secs(10)).unwrap().published)
        .sum();
    assert_eq!(published, 400);

    let seen = seen.lock().unwrap();
    let twice: Vec<_> = seen.iter().filter(|(_, n)| **n != 1).collect();
    assert!(twice.is_empty(), "published more than once: {twice:?}");
    let expected: HashSet<&String> = keys.iter().collect();
    assert_eq!(seen.keys().collect::<HashSet<_>>(), expected);
}

// ---------------------------------------------------------------------------------------------
// Retries and dead letters
// ---------------------------------------------------------------------------------------------

#[test]
fn failing_publisher_retries_then_dead_letters_and_redrive_revives() {
    let (outbox, mut client) = common::outbox("rl_dead");
    let key = enqueue_one(&mut client, &outbox, Message::new("t", "p"));

    let attempts = Arc::new(Mutex::new(Vec::new()));
    let metrics = Counters::default();
    let failing = {
        let attempts = attempts.clone();
        relay_config(&outbox, move |record| {
            attempts.lock().unwrap().push(record.attempt);
            Err(PublishError::transient("broker says no"))
        })
    }
    .retry(Retry::new(3).backoff(Duration::from_millis(10), Duration::from_millis(20)))
    .poll_interval(Duration::from_millis(20))
    .notify(false)
    .metrics(metrics.clone());
    let relay = Relay::spawn(failing).unwrap();
    wait_until("the row is dead", || {
        row_state(&mut client, &outbox, &key).0 == "dead"
    });
    let report = relay.shutdown(Duration::from_secs(10)).unwrap();
    assert_eq!(report.published, 0);

    assert_eq!(*attempts.lock().unwrap(), [1, 2, 3]);
    assert_eq!(row_state(&mut client, &outbox, &key), ("dead".into(), 3));
    assert_eq!(metrics.failed(), 3);
    assert_eq!(metrics.dead_lettered(), 1);
    assert_eq!(metrics.published(), 0);
    assert_eq!(metrics.claimed(), 3);
    assert_eq!(outbox.stats(&mut client).unwrap().dead, 1);
    let dead = outbox.dead_letters(&mut client, 10).unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].record.key, key);
    assert_eq!(dead[0].record.attempt, 3);
    assert_eq!(dead[0].last_error.as_deref(), Some("broker says no"));

    assert_eq!(outbox.redrive(&mut client, Filter::new()).unwrap(), 1);
    assert_eq!(row_state(&mut client, &outbox, &key), ("pending".into(), 0));
    assert!(outbox.dead_letters(&mut client, 10).unwrap().is_empty());

    // A permanent error dead-letters at once: one call each, for the redriven row (which
    // shows it is claimable again) and for a fresh one.
    let fresh = enqueue_one(&mut client, &outbox, Message::new("t", "p2"));
    let calls: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
    let metrics = Counters::default();
    let rejecting = {
        let calls = calls.clone();
        relay_config(&outbox, move |record| {
            *calls.lock().unwrap().entry(record.key.clone()).or_default() += 1;
            Err(PublishError::permanent("schema rejected"))
        })
    }
    .retry(Retry::new(3))
    .metrics(metrics.clone());
    assert_eq!(Relay::run_until_idle(&rejecting).unwrap(), 2);
    assert_eq!(
        *calls.lock().unwrap(),
        HashMap::from([(key.clone(), 1), (fresh.clone(), 1)])
    );
    assert_eq!(row_state(&mut client, &outbox, &key), ("dead".into(), 1));
    assert_eq!(row_state(&mut client, &outbox, &fresh), ("dead".into(), 1));
    assert_eq!(
        last_error(&mut client, &outbox, &fresh).as_deref(),
        Some("schema rejected")
    );
    assert_eq!((metrics.failed(), metrics.dead_lettered()), (2, 2));
}

/// Confirms every aggregate's first record, then panics with the rest handed over or not.
struct PanicsMidStream;

impl Publisher for PanicsMidStream {
    fn publish(&mut self, batch: &[Record]) -> Vec<Result<(), PublishError>> {
        batch.iter().map(|_| Ok(())).collect()
    }

    fn publish_in_order(
        &mut self,
        batch: &[Record],
        outcomes: &mut [Option<Result<(), PublishError>>],
        _proceed: &dyn Fn() -> bool,
    ) {
        for (record, outcome) in batch.iter().zip(outcomes.iter_mut()) {
            if record.key.ends_with("-0") {
                *outcome = Some(Ok(()));
            }
        }
        panic!("injected: a bug in publish_in_order");
    }
}

#[test]
fn a_panic_mid_stream_keeps_the_outcomes_given_and_charges_only_what_it_may_have_held() {
    let (outbox, mut client) = common::outbox("rl_panic_stream");
    let mut messages = ordered("a", 3);
    messages.extend(ordered("b", 1));
    messages.push(Message::new("t", "p").key("u"));
    enqueue(&mut client, &outbox, messages);
    let config = RelayConfig::new(outbox.clone(), common::pool(RELAY_POOL), || {
        Ok::<_, Infallible>(PanicsMidStream)
    })
    .concurrency(1);
    assert_eq!(Relay::run_once(&config).unwrap(), 5);
    // The heads it confirmed are sent; a-1 may have been handed over (its predecessor was
    // through) and u had no predecessor: each a failed attempt; a-2 cannot have been handed
    // over and goes back uncharged.
    for (key, status, attempts) in [
        ("a-0", "sent", 1),
        ("b-0", "sent", 1),
        ("a-1", "pending", 1),
        ("u", "pending", 1),
        ("a-2", "pending", 0),
    ] {
        assert_eq!(
            row_state(&mut client, &outbox, key),
            (status.to_owned(), attempts),
            "{key}"
        );
    }
    assert!(last_error(&mut client, &outbox, "a-1")
        .unwrap()
        .contains("panicked"));
}

#[test]
fn panicking_publisher_is_a_failed_attempt() {
    let (outbox, mut client) = common::outbox("rl_panic");
    let sink = Sink::default();
    let calls = Arc::new(AtomicUsize::new(0));
    let metrics = Counters::default();
    let config = {
        let (sink, calls) = (sink.clone(), calls.clone());
        relay_config(&outbox, move |record| {
            if calls.fetch_add(1, Ordering::SeqCst) == 0 {
                panic!("injected: publisher bug");
            }
            sink.push(record);
            Ok(())
        })
    }
    .concurrency(1)
    .retry(Retry::default().backoff(Duration::from_millis(10), Duration::from_millis(20)))
    .poll_interval(Duration::from_millis(20))
    .metrics(metrics.clone());
    let relay = Relay::spawn(config).unwrap();

    let key = enqueue_one(&mut client, &outbox, Message::new("t", "p"));
    wait_until("the retry is published", || sink.contains(&key));
    wait_until("it is recorded sent", || {
        row_state(&mut client, &outbox, &key).0 == "sent"
    });
    assert_eq!(row_state(&mut client, &outbox, &key), ("sent".into(), 2));
    assert_eq!(sink.records()[0].attempt, 2);
    assert_eq!(metrics.failed(), 1);
    assert!(last_error(&mut client, &outbox, &key)
        .unwrap()
        .contains("panicked"));

    // The relay is still alive and publishing.
    let next = enqueue_one(&mut client, &outbox, Message::new("t", "p"));
    wait_until("the next message is published", || sink.contains(&next));
    let report = relay.shutdown(Duration::from_secs(10)).unwrap();
    wait_until("both recorded", || {
        count(&mut client, &outbox, "status = 'sent'") == 2
    });
    assert_eq!(report.published, 2);
    assert_eq!(sink.keys(), [key, next]);
}

// ---------------------------------------------------------------------------------------------
// Shutdown
// ---------------------------------------------------------------------------------------------

/// Publishes 50 ms a record; after 20 records it also waits at `pause`. Notes every key it
/// is handed, published yet or not.
struct Slow {
    sink: Sink,
    pause: Gate,
    handed: Arc<Mutex<HashSet<String>>>,
}

impl Publisher for Slow {
    fn publish(&mut self, batch: &[Record]) -> Vec<Result<(), PublishError>> {
        self.handed
            .lock()
            .unwrap()
            .extend(batch.iter().map(|r| r.key.clone()));
        batch
            .iter()
            .map(|record| {
                if self.sink.len() >= 20 {
                    self.pause.pass();
                }
                self.sink.push(record);
                thread::sleep(Duration::from_millis(50));
                Ok(())
            })
            .collect()
    }
}

#[test]
fn shutdown_mid_stream_records_finished_publishes_and_releases_the_rest() {
    let (outbox, mut client) = common::outbox("rl_shutdown");
    // Two aggregates, so each worker holds a run of one of them: ten confirm rounds a batch.
    let messages: Vec<Message> = numbered("s", 200)
        .into_iter()
        .enumerate()
        .map(|(i, m)| m.aggregate_key(if i % 2 == 0 { "a" } else { "b" }))
        .collect();
    let mut tx = client.transaction().unwrap();
    let keys = outbox.enqueue_all(&mut tx, messages).unwrap();
    tx.commit().unwrap();

    // A slow publisher (50 ms a record) that, after 20 records, also pauses until the test
    // has begun the shutdown, so the relay is caught with claimed rows whose rounds have not
    // started.
    let first = Sink::default();
    let pause = Gate::default();
    let handed: Arc<Mutex<HashSet<String>>> = Arc::default();
    let metrics = Counters::default();
    let slow = {
        let (first, pause, handed) = (first.clone(), pause.clone(), handed.clone());
        RelayConfig::new(outbox.clone(), common::pool(RELAY_POOL), move || {
            Ok::<_, Infallible>(Slow {
                sink: first.clone(),
                pause: pause.clone(),
                handed: handed.clone(),
            })
        })
    }
    .concurrency(2)
    .batch_size(10)
    .metrics(metrics.clone());
    let relay = Relay::spawn(slow).unwrap();

    wait_until("both workers are paused", || pause.waiting() == 2);
    wait_until("claimed rows wait for their rounds", || {
        let handed = handed.lock().unwrap();
        client
            .query(
                &format!(
                    "SELECT key FROM {} WHERE status = 'pending' AND lease_until > now()",
                    quoted(&outbox)
                ),
                &[],
            )
            .unwrap()
            .iter()
            .any(|row| !handed.contains(row.get::<_, &str>(0)))
    });
    let stopping = thread::spawn(move || relay.shutdown(Duration::from_secs(10)));
    // The listener leaves as soon as the relay is stopping: only then let the rounds go on.
    wait_until("the relay is stopping", || {
        listener_pids(&mut client, &outbox).is_empty()
    });
    pause.open();
    let report = stopping.join().unwrap().unwrap();

    let delivered = first.keys();
    assert_eq!(report.abandoned, 0);
    assert!(report.released > 0);
    assert_eq!(report.released as usize, metrics.released());
    assert_eq!(report.published as usize, delivered.len());
    assert_eq!(
        metrics.claimed(),
        delivered.len() + metrics.released(),
        "every claimed row was either published or released"
    );
    assert_eq!(
        delivered.iter().collect::<HashSet<_>>().len(),
        delivered.len()
    );
    // Every finished publish is recorded, and nothing else is.
    let sent_of_delivered: i64 = client
        .query_one(
            &format!(
                "SELECT count(*) FROM {} WHERE status = 'sent' AND key = ANY($1)",
                quoted(&outbox)
            ),
            &[&delivered],
        )
        .unwrap()
        .get(0);
    assert_eq!(sent_of_delivered as usize, delivered.len());
    assert_eq!(
        count(&mut client, &outbox, "status = 'sent'") as usize,
        delivered.len()
    );
    // Nothing stays leased, and released rows have their attempt count restored.
    assert_eq!(count(&mut client, &outbox, "lease_until IS NOT NULL"), 0);
    assert_eq!(
        count(&mut client, &outbox, "status = 'pending' AND attempts <> 0"),
        0
    );
    assert_eq!(
        count(&mut client, &outbox, "status = 'pending'") as usize,
        200 - delivered.len()
    );

    // The next relay publishes the rest, each as its first attempt.
    let second = Sink::default();
    let relay = Relay::spawn(relay_config(&outbox, second.collect()).batch_size(50)).unwrap();
    wait_until("the rest is published", || {
        second.len() + delivered.len() >= 200
    });
    wait_until("everything is recorded sent", || {
        count(&mut client, &outbox, "status = 'sent'") == 200
    });
    relay.shutdown(Duration::from_secs(10)).unwrap();
    let rest = second.records();
    assert!(
        rest.iter().all(|r| r.attempt == 1),
        "released rows come back as attempt 1"
    );
    let mut all: Vec<String> = delivered;
    all.extend(rest.into_iter().map(|r| r.key));
    assert_eq!(all.len(), 200, "no duplicates");
    // Within each aggregate, every message went out after the ones before it.
    for parity in 0..2 {
        let seqs: Vec<usize> = all
            .iter()
            .map(|k| k.trim_start_matches("s-").parse::<usize>().unwrap())
            .filter(|n| n % 2 == parity)
            .collect();
        assert!(seqs.windows(2).all(|w| w[0] < w[1]), "{seqs:?}");
    }
    assert_eq!(
        all.into_iter().collect::<HashSet<_>>(),
        keys.into_iter().collect::<HashSet<_>>()
    );
}

#[test]
fn a_publish_stuck_past_the_shutdown_timeout_is_abandoned_and_republished_later() {
    let (outbox, mut client) = common::outbox("rl_abandon");
    let key = enqueue_one(&mut client, &outbox, Message::new("t", "p"));
    let sink = Sink::default();
    let stuck = Gate::default();
    let config = {
        let (sink, stuck) = (sink.clone(), stuck.clone());
        relay_config(&outbox, move |record| {
            sink.push(record);
            stuck.pass();
            Ok(())
        })
    }
    .lease(Duration::from_secs(3))
    .concurrency(1)
    .notify(false);
    let relay = Relay::spawn(config).unwrap();
    wait_until("the publisher is stuck", || stuck.waiting() == 1);

    let report = relay.shutdown(Duration::from_millis(300)).unwrap();
    assert_eq!(report.abandoned, 1);
    assert_eq!((report.published, report.released), (0, 0));
    // Claimed once, without a verdict.
    assert_eq!(row_state(&mut client, &outbox, &key), ("pending".into(), 0));
    assert_eq!(count(&mut client, &outbox, "claims = 1"), 1);

    // Its outcome is unknown, so once the lease runs out the row goes out again.
    wait_until("the abandoned lease has run out", || {
        count(&mut client, &outbox, "lease_until <= now()") == 1
    });
    let again = relay_config(&outbox, sink.collect());
    assert_eq!(Relay::run_until_idle(&again).unwrap(), 1);
    assert_eq!(row_state(&mut client, &outbox, &key), ("sent".into(), 1));
    assert_eq!(count(&mut client, &outbox, "claims = 0"), 1);
    assert_eq!(sink.keys(), [key.as_str(), key.as_str()]);
    stuck.open();
}

#[test]
fn a_round_that_would_outlive_the_lease_is_handed_back_unpublished() {
    let (outbox, mut client) = common::outbox("rl_late_round");
    enqueue(
        &mut client,
        &outbox,
        vec![
            Message::new("t", "p").key("first").aggregate_key("agg"),
            Message::new("t", "p").key("second").aggregate_key("agg"),
        ],
    );
    // One worker claims both as a run: "first" goes out in the first confirm round and
    // stalls there past the lease, so "second"'s round would start on a lease already gone.
    let sink = Sink::default();
    let stall = Gate::default();
    let metrics = Counters::default();
    let config = {
        let (sink, stall) = (sink.clone(), stall.clone());
        relay_config(&outbox, move |record| {
            if record.key == "first" {
                stall.pass();
            }
            sink.push(record);
            Ok(())
        })
    }
    .lease(Duration::from_secs(2))
    .batch_size(2)
    .concurrency(1)
    .notify(false)
    .poll_interval(Duration::from_millis(20))
    .metrics(metrics.clone());
    let relay = Relay::spawn(config).unwrap();
    wait_until("the worker is stalled", || stall.waiting() == 1);
    wait_until("the waiting row's lease has run out", || {
        count(
            &mut client,
            &outbox,
            "key = 'second' AND lease_until <= now()",
        ) == 1
    });
    stall.open();

    wait_until("both are recorded sent", || {
        count(&mut client, &outbox, "status = 'sent'") == 2
    });
    relay.shutdown(Duration::from_secs(10)).unwrap();
    // The expired claim of "second" was handed back, never published, and the row was then
    // claimed afresh and went out once, after "first".
    assert_eq!(metrics.released(), 1, "the expired claim was handed back");
    let second = sink
        .records()
        .into_iter()
        .filter(|r| r.key == "second")
        .count();
    assert_eq!(second, 1, "published once, from a fresh claim");
    assert_eq!(sink.keys(), ["first", "second"]);
    assert_eq!(
        row_state(&mut client, &outbox, "second"),
        ("sent".into(), 1)
    );
}

#[test]
fn dropping_a_relay_stops_its_threads() {
    let (outbox, mut client) = common::outbox("rl_drop");
    // Held by the factory, which lives as long as any relay thread does.
    let token = Arc::new(());
    let config = {
        let token = token.clone();
        relay_config(&outbox, move |_| {
            let _held = &token;
            Ok(())
        })
    }
    .drain_timeout(Duration::from_secs(5));
    let relay = Relay::spawn(config).unwrap();
    wait_until("listening", || relay.is_listening());
    wait_until("its listener shows in pg_stat_activity", || {
        listener_pids(&mut client, &outbox).len() == 1
    });
    assert!(Arc::strong_count(&token) > 1);

    drop(relay);
    wait_until("the listener's backend is gone", || {
        listener_pids(&mut client, &outbox).is_empty()
    });
    wait_until("every relay thread has ended", || {
        Arc::strong_count(&token) == 1
    });
}

// ---------------------------------------------------------------------------------------------
// Ordering and fencing
// ---------------------------------------------------------------------------------------------

#[test]
fn each_aggregate_arrives_in_order_despite_a_failed_head() {
    let (outbox, mut client) = common::outbox("rl_order");
    let mut messages = Vec::new();
    for seq in 0..5 {
        for agg in ["a", "b", "c"] {
            messages.push(
                Message::new("t", seq.to_string())
                    .key(format!("{agg}-{seq}"))
                    .aggregate_key(agg),
            );
        }
    }
    enqueue(&mut client, &outbox, messages);

    let arrived: Arc<Mutex<HashMap<String, Vec<u32>>>> = Arc::default();
    let head_attempts = Arc::new(Mutex::new(Vec::new()));
    let config = {
        let (arrived, head_attempts) = (arrived.clone(), head_attempts.clone());
        relay_config_with_pool(&outbox, 9, move |record| {
            if record.key == "a-0" {
                head_attempts.lock().unwrap().push(record.attempt);
                if record.attempt == 1 {
                    return Err(PublishError::transient("first try fails"));
                }
            }
            let seq = String::from_utf8(record.payload.clone())
                .unwrap()
                .parse()
                .unwrap();
            let agg = record.aggregate_key.clone().unwrap();
            arrived.lock().unwrap().entry(agg).or_default().push(seq);
            Ok(())
        })
    }
    .concurrency(8)
    .batch_size(10)
    .retry(Retry::default().backoff(Duration::from_millis(10), Duration::from_millis(20)))
    .poll_interval(Duration::from_millis(20));
    let relay = Relay::spawn(config).unwrap();
    wait_until("15 published", || {
        arrived
            .lock()
            .unwrap()
            .values()
            .map(Vec::len)
            .sum::<usize>()
            == 15
    });
    wait_until("15 recorded", || {
        count(&mut client, &outbox, "status = 'sent'") == 15
    });
    relay.shutdown(Duration::from_secs(10)).unwrap();

    let arrived = arrived.lock().unwrap();
    for agg in ["a", "b", "c"] {
        assert_eq!(
            arrived[agg],
            [0, 1, 2, 3, 4],
            "aggregate {agg} out of order"
        );
    }
    assert_eq!(*head_attempts.lock().unwrap(), [1, 2]);
}

#[test]
fn a_handler_whose_lease_was_taken_changes_nothing() {
    let table = common::unique_name("rl_fence");
    let outbox = common::builder()
        .table(&table)
        .lease(Duration::from_secs(1))
        .build()
        .unwrap();
    let mut client = common::client();
    outbox.migrate(&mut client).unwrap();
    let effects = format!("\"{table}_effects\"");
    client
        .batch_execute(&format!("CREATE TABLE {effects} (who text NOT NULL)"))
        .unwrap();
    let key = enqueue_one(&mut client, &outbox, Message::new("t", "p"));

    // The first worker claims the row and its handler stalls past the lease.
    let stalled = Gate::default();
    let first = {
        let (outbox, stalled, effects) = (outbox.clone(), stalled.clone(), effects.clone());
        let mut client = common::client();
        thread::spawn(move || {
            outbox
                .process(&mut client, 1, |tx, _record| {
                    tx.execute(&format!("INSERT INTO {effects} VALUES ('first')"), &[])
                        .map_err(HandlerError::transient)?;
                    stalled.pass();
                    Ok(())
                })
                .unwrap()
        })
    };
    wait_until("the first handler is stalled", || stalled.waiting() == 1);
    wait_until("its lease has run out", || {
        count(&mut client, &outbox, "lease_until <= now()") == 1
    });

    // A second worker takes the row over and finishes it.
    let report = outbox
        .process(&mut client, 1, |tx, _record| {
            tx.execute(&format!("INSERT INTO {effects} VALUES ('second')"), &[])
                .map_err(HandlerError::transient)?;
            Ok(())
        })
        .unwrap();
    assert_eq!(report.processed, 1);
    assert_eq!(row_state(&mut client, &outbox, &key), ("sent".into(), 1));

    // The first one wakes up: its ack is fenced off and its writes are rolled back.
    stalled.open();
    let report = first.join().unwrap();
    assert_eq!(report.lease_lost, 1);
    assert_eq!(report.processed, 0);
    assert_eq!(row_state(&mut client, &outbox, &key), ("sent".into(), 1));
    let who: Vec<String> = client
        .query(&format!("SELECT who FROM {effects}"), &[])
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(who, ["second"]);
}

#[test]
fn a_stale_worker_cannot_complete_a_row_reclaimed_and_released_since() {
    let table = common::unique_name("rl_aba");
    let outbox = common::builder()
        .table(&table)
        .lease(Duration::from_secs(1))
        .build()
        .unwrap();
    let mut client = common::client();
    outbox.migrate(&mut client).unwrap();
    let key = enqueue_one(&mut client, &outbox, Message::new("t", "p"));

    let stalled = Gate::default();
    let first = {
        let (outbox, stalled) = (outbox.clone(), stalled.clone());
        let mut client = common::client();
        thread::spawn(move || {
            outbox
                .process(&mut client, 1, |_tx, _record| {
                    stalled.pass();
                    Ok(())
                })
                .unwrap()
        })
    };
    wait_until("the first handler is stalled", || stalled.waiting() == 1);
    wait_until("its lease has run out", || {
        count(&mut client, &outbox, "lease_until <= now()") == 1
    });
    // Another worker claims the row and hands it back unstarted, as a shutdown does: the
    // attempt count is where the stale worker's claim found it.
    client
        .batch_execute(&format!(
            "UPDATE {t} SET claims = claims + 1, lease_until = now() + interval '1 minute', \
                            available_at = now() + interval '1 minute';
             UPDATE {t} SET claims = 0, lease_until = NULL, available_at = now();",
            t = common::quoted(&outbox)
        ))
        .unwrap();
    assert_eq!(row_state(&mut client, &outbox, &key), ("pending".into(), 0));

    stalled.open();
    let report = first.join().unwrap();
    assert_eq!(report.lease_lost, 1);
    assert_eq!(row_state(&mut client, &outbox, &key), ("pending".into(), 0));
}

/// A publisher that records the keys of every call, in order, and fails the keys in
/// `failing` once each (transiently); it keeps order when `keeps_order` says so.
#[derive(Clone, Default)]
struct Calls {
    calls: Arc<Mutex<Vec<Vec<String>>>>,
    failing: Arc<Mutex<HashSet<String>>>,
    keeps_order: bool,
}

impl Publisher for Calls {
    fn publish(&mut self, batch: &[Record]) -> Vec<Result<(), PublishError>> {
        let mut failing = self.failing.lock().unwrap();
        self.calls
            .lock()
            .unwrap()
            .push(batch.iter().map(|r| r.key.clone()).collect());
        batch
            .iter()
            .map(|r| match failing.remove(&r.key) {
                true => Err(PublishError::transient("nacked")),
                false => Ok(()),
            })
            .collect()
    }

    fn keeps_order(&self) -> bool {
        self.keeps_order
    }
}

impl Calls {
    fn config(&self, outbox: &Outbox, pipeline: bool) -> RelayConfig {
        let publisher = self.clone();
        RelayConfig::new(outbox.clone(), common::pool(RELAY_POOL), move || {
            Ok::<_, Infallible>(publisher.clone())
        })
        .pipeline_runs(pipeline)
        .batch_size(10)
        .concurrency(1)
        .retry(Retry::default().backoff(Duration::from_millis(1), Duration::from_millis(1)))
    }

    fn calls(&self) -> Vec<Vec<String>> {
        self.calls.lock().unwrap().clone()
    }
}

#[test]
fn pipelined_runs_go_out_in_one_call_to_a_publisher_that_keeps_order() {
    let cases = [
        // (pipeline_runs, keeps_order, calls for two runs of four)
        (true, true, 1),
        (true, false, 4),
        (false, true, 4),
    ];
    for (pipeline, keeps_order, expected) in cases {
        let (outbox, mut client) = common::outbox("rl_pipelined");
        let mut messages = ordered("a", 4);
        messages.extend(ordered("b", 4));
        enqueue(&mut client, &outbox, messages);
        let publisher = Calls {
            keeps_order,
            ..Calls::default()
        };
        assert_eq!(
            Relay::run_once(&publisher.config(&outbox, pipeline)).unwrap(),
            8
        );
        let calls = publisher.calls();
        assert_eq!(calls.len(), expected, "{pipeline} {keeps_order}: {calls:?}");
        let handed: Vec<String> = calls.concat();
        for aggregate in ["a", "b"] {
            let order: Vec<&String> = handed
                .iter()
                .filter(|k| k.starts_with(&format!("{aggregate}-")))
                .collect();
            let expected: Vec<String> = (0..4).map(|i| format!("{aggregate}-{i}")).collect();
            assert_eq!(order, expected.iter().collect::<Vec<_>>());
        }
        assert_eq!(count(&mut client, &outbox, "status = 'sent'"), 8);
    }
}

/// Four messages of one aggregate, the second nacked once, drained with runs pipelined or
/// in confirm rounds: the publisher's calls, and the rows.
fn one_failure_in_a_run(pipeline: bool) -> (Calls, Outbox, Client) {
    let (outbox, mut client) = common::outbox("rl_run_fail");
    enqueue(&mut client, &outbox, ordered("a", 4));
    let publisher = Calls {
        keeps_order: true,
        ..Calls::default()
    };
    publisher.failing.lock().unwrap().insert("a-1".into());
    drain_by_hand(
        &mut client,
        &outbox,
        &publisher.config(&outbox, pipeline),
        4,
    );
    (publisher, outbox, client)
}

#[test]
fn a_pipelined_run_whose_message_fails_records_the_rest_sent_and_retries_it_after_them() {
    let (publisher, outbox, mut client) = one_failure_in_a_run(true);
    // The run went out in one call; a-1 was nacked, a-2 and a-3 had gone out with it and
    // were confirmed, so they are sent; a-1 went out again on its own.
    assert_eq!(
        publisher.calls(),
        [vec!["a-0", "a-1", "a-2", "a-3"], vec!["a-1"]]
    );
    assert_eq!(row_state(&mut client, &outbox, "a-1"), ("sent".into(), 2));
    assert_eq!(row_state(&mut client, &outbox, "a-3"), ("sent".into(), 1));

    // In confirm rounds the same failure holds the rest back until a-1 is through.
    let (publisher, _, _) = one_failure_in_a_run(false);
    let handed: Vec<String> = publisher.calls().concat();
    assert_eq!(handed, ["a-0", "a-1", "a-1", "a-2", "a-3"]);
}

/// Runs `config` on this thread until `rows` rows are sent (a retry waits out its backoff).
fn drain_by_hand(client: &mut Client, outbox: &Outbox, config: &RelayConfig, rows: i64) {
    wait_until("every row is sent", || {
        Relay::run_until_idle(config).unwrap();
        count(client, outbox, "status = 'sent'") == rows
    });
}

/// Records the keys of every batch the relay hands over and sends them all, taking
/// `latency` for each, as a broker's confirms would.
#[derive(Clone, Default)]
struct Batches {
    batches: Arc<Mutex<Vec<Vec<String>>>>,
    latency: Duration,
}

impl Publisher for Batches {
    fn publish(&mut self, batch: &[Record]) -> Vec<Result<(), PublishError>> {
        batch.iter().map(|_| Ok(())).collect()
    }

    fn publish_in_order(
        &mut self,
        batch: &[Record],
        outcomes: &mut [Option<Result<(), PublishError>>],
        _proceed: &dyn Fn() -> bool,
    ) {
        self.batches
            .lock()
            .unwrap()
            .push(batch.iter().map(|r| r.key.clone()).collect());
        thread::sleep(self.latency);
        outcomes.fill_with(|| Some(Ok(())));
    }
}

/// Eight aggregates of twelve messages, drained sixteen at a time by a relay of four
/// workers through `batches`: the batches it handed over.
fn eight_aggregates_drained(prefix: &str, batches: Batches) -> Vec<Vec<String>> {
    let (outbox, mut client) = common::outbox(prefix);
    for aggregate in 'a'..='h' {
        enqueue(&mut client, &outbox, ordered(&aggregate.to_string(), 12));
    }
    let config = {
        let batches = batches.clone();
        RelayConfig::new(outbox.clone(), common::pool(RELAY_POOL), move || {
            Ok::<_, Infallible>(batches.clone())
        })
    }
    .batch_size(16)
    .concurrency(4);
    drain_by_hand(&mut client, &outbox, &config, 96);
    let handed = batches.batches.lock().unwrap().clone();
    handed
}

/// The longest run of one aggregate in any of `batches` (keys are `<aggregate>-<n>`).
fn longest_run(batches: &[Vec<String>]) -> usize {
    let mut longest = 0;
    for batch in batches {
        let mut runs: HashMap<&str, usize> = HashMap::new();
        for key in batch {
            let run = runs.entry(key.split('-').next().unwrap()).or_default();
            *run += 1;
            longest = longest.max(*run);
        }
    }
    longest
}

#[test]
fn a_claim_late_in_the_key_space_sizes_its_runs_by_every_aggregate_while_confirms_take_the_time() {
    // A worker's share is two of the eight aggregates, so runs of eight. A claim whose scan
    // starts after the fourth aggregate sees only four, and sized by those alone would take
    // runs of twelve, holding aggregates the other workers should have in flight. Each batch
    // here takes a second to publish, far longer than its claim: confirms are the cost.
    let slow = Batches {
        latency: Duration::from_secs(1),
        ..Batches::default()
    };
    let batches = eight_aggregates_drained("rl_run_share", slow);
    assert!(longest_run(&batches) <= 8, "{batches:?}");

    // A publisher quicker than the claim gets the long runs: each claim fills more of its
    // batch from the few aggregates it sees.
    let quick = eight_aggregates_drained("rl_run_long", Batches::default());
    assert!(longest_run(&quick) > 8, "{quick:?}");
}

// ---------------------------------------------------------------------------------------------
// Wake-up
// ---------------------------------------------------------------------------------------------

#[test]
fn a_listener_on_its_own_connection_wakes_the_relay_and_takes_none_from_the_pool() {
    let (outbox, mut client) = common::outbox("rl_own_listener");
    let sink = Sink::default();
    // Two pooled connections: enough for two workers, none for listening.
    let config = relay_config_with_pool(&outbox, 2, sink.collect())
        .concurrency(2)
        .poll_interval(Duration::from_secs(3600))
        .listen_connection(common::database_url().parse().unwrap(), postgres::NoTls);
    let relay = Relay::spawn(config).unwrap();
    wait_until("listening", || relay.is_listening());
    enqueue_one(&mut client, &outbox, Message::new("t", "p").key("own"));
    wait_until("the notified row is published", || sink.contains("own"));
    relay.shutdown(Duration::from_secs(10)).unwrap();
    wait_until("the listener's own connection is closed", || {
        listener_pids(&mut client, &outbox).is_empty()
    });
}

#[test]
fn notify_wakes_an_idle_relay_and_survives_a_killed_listener() {
    let (outbox, mut client) = common::outbox("rl_notify");
    let sink = Sink::default();
    // Polling once an hour: within wait_until's 60 s, only a notification can wake it.
    let config = relay_config(&outbox, sink.collect()).poll_interval(Duration::from_secs(3600));
    let relay = Relay::spawn(config).unwrap();
    wait_until("listening", || relay.is_listening());

    for key in ["n1", "n2"] {
        enqueue_one(&mut client, &outbox, Message::new("t", "p").key(key));
        wait_until("the notified row is published", || sink.contains(key));
    }

    // Kill this relay's listener connection (and only this one: others LISTEN elsewhere).
    let mut pids = Vec::new();
    wait_until("the listener shows in pg_stat_activity", || {
        pids = listener_pids(&mut client, &outbox);
        pids.len() == 1
    });
    let killed = pids[0];
    let terminated: bool = client
        .query_one("SELECT pg_terminate_backend($1)", &[&killed])
        .unwrap()
        .get(0);
    assert!(terminated);
    wait_until("the listener is back on a new connection", || {
        let pids = listener_pids(&mut client, &outbox);
        relay.is_listening() && pids.len() == 1 && pids[0] != killed
    });
    wait_until("the killed backend is gone", || {
        client
            .query_opt("SELECT 1 FROM pg_stat_activity WHERE pid = $1", &[&killed])
            .unwrap()
            .is_none()
    });

    for key in ["n3", "n4"] {
        enqueue_one(&mut client, &outbox, Message::new("t", "p").key(key));
        wait_until("the notified row is published after reconnecting", || {
            sink.contains(key)
        });
    }
    let report = relay.shutdown(Duration::from_secs(10)).unwrap();
    assert_eq!(sink.keys(), ["n1", "n2", "n3", "n4"]);
    wait_until("all recorded", || {
        count(&mut client, &outbox, "status = 'sent'") == 4
    });
    assert_eq!(report.published, 4);
}

/// How many relays the outbox's producers see waiting for work.
fn waiting_relays(client: &mut Client, outbox: &Outbox) -> i64 {
    client
        .query_one(
            &format!("SELECT count(*) FROM \"{}_waiting\"", outbox.table()),
            &[],
        )
        .unwrap()
        .get(0)
}

#[test]
fn a_relay_is_announced_as_waiting_only_while_a_worker_waits() {
    let (outbox, mut client) = common::outbox("rl_waiting");
    let sink = Sink::default();
    // The publisher blocks on "gated" until the test lets it go.
    let (gate_tx, gate) = crossbeam_channel::unbounded::<()>();
    let collect = sink.collect();
    let config = relay_config(&outbox, move |record| {
        if record.key == "gated" {
            gate.recv().expect("the test holds the gate");
        }
        collect(record)
    })
    .concurrency(1)
    // Polling once an hour: within wait_until's 60 s, only a notification can wake it.
    .poll_interval(Duration::from_secs(3600));
    let relay = Relay::spawn(config).unwrap();
    wait_until("listening", || relay.is_listening());
    assert_eq!(waiting_relays(&mut client, &outbox), 1);

    // Its one worker busy: after a grace second, producers stop notifying.
    enqueue_one(&mut client, &outbox, Message::new("t", "p").key("gated"));
    wait_until("the worker is busy and the relay no longer waits", || {
        sink.len() == 0 && waiting_relays(&mut client, &outbox) == 0
    });
    // Committed while nobody waits: not announced, so the worker finds it when it claims
    // again after the gated one.
    enqueue_one(
        &mut client,
        &outbox,
        Message::new("t", "p").key("unannounced"),
    );
    gate_tx.send(()).unwrap();
    wait_until("both are published and the relay waits again", || {
        sink.contains("unannounced") && waiting_relays(&mut client, &outbox) == 1
    });
    // Waiting again, it is woken by the next enqueue.
    enqueue_one(
        &mut client,
        &outbox,
        Message::new("t", "p").key("announced"),
    );
    wait_until("the announced row is published", || {
        sink.contains("announced")
    });

    relay.shutdown(Duration::from_secs(10)).unwrap();
    assert_eq!(waiting_relays(&mut client, &outbox), 0, "gone on shutdown");
}

#[test]
fn without_notify_polling_picks_rows_up() {
    let (outbox, mut client) = common::outbox("rl_poll");
    let sink = Sink::default();
    let config = relay_config(&outbox, sink.collect())
        .notify(false)
        .poll_interval(Duration::from_millis(100));
    let relay = Relay::spawn(config).unwrap();
    assert!(!relay.is_listening());

    for key in ["p1", "p2"] {
        enqueue_one(&mut client, &outbox, Message::new("t", "p").key(key));
        wait_until("the polled row is published", || sink.contains(key));
    }
    assert!(!relay.is_listening());
    assert!(listener_pids(&mut client, &outbox).is_empty());
    let report = relay.shutdown(Duration::from_secs(10)).unwrap();
    assert_eq!(report.published, 2);
    assert_eq!(sink.keys(), ["p1", "p2"]);
}

// ---------------------------------------------------------------------------------------------
// Synchronous runs and the transactional handler
// ---------------------------------------------------------------------------------------------

#[test]
fn delayed_messages_wait_and_run_once_counts() {
    let (outbox, mut client) = common::outbox("rl_delay");
    let sink = Sink::default();
    let config = relay_config(&outbox, sink.collect()).batch_size(2);

    let later = enqueue_one(
        &mut client,
        &outbox,
        Message::new("t", "later").delay(Duration::from_secs(3600)),
    );
    let now = enqueue_one(&mut client, &outbox, Message::new("t", "now"));
    assert_eq!(Relay::run_until_idle(&config).unwrap(), 1);
    assert_eq!(Relay::run_until_idle(&config).unwrap(), 0);
    assert_eq!(sink.keys(), [now.as_str()]);
    assert_eq!(
        row_state(&mut client, &outbox, &later),
        ("pending".into(), 0)
    );
    assert_eq!(row_state(&mut client, &outbox, &now), ("sent".into(), 1));

    enqueue(&mut client, &outbox, numbered("r", 3));
    assert_eq!(Relay::run_once(&config).unwrap(), 2);
    assert_eq!(Relay::run_once(&config).unwrap(), 1);
    assert_eq!(Relay::run_once(&config).unwrap(), 0);
    assert_eq!(sink.keys(), [now.as_str(), "r-0", "r-1", "r-2"]);
    assert_eq!(count(&mut client, &outbox, "status = 'sent'"), 4);
    assert_eq!(
        row_state(&mut client, &outbox, &later),
        ("pending".into(), 0)
    );
}

#[test]
fn process_commits_writes_with_the_ack_and_rolls_both_back_on_error() {
    // Failed rows back off for an hour, so each process() call below sees only new rows.
    let outbox = common::builder()
        .table(common::unique_name("rl_process"))
        .retry(Retry::default().backoff(Duration::from_secs(3600), Duration::from_secs(3600)))
        .build()
        .unwrap();
    let mut client = common::client();
    outbox.migrate(&mut client).unwrap();
    let effects = format!("\"{}_effects\"", outbox.table());
    client
        .batch_execute(&format!("CREATE TABLE {effects} (key text PRIMARY KEY)"))
        .unwrap();
    let good = enqueue_one(&mut client, &outbox, Message::new("ok", "p"));
    let bad = enqueue_one(&mut client, &outbox, Message::new("fail", "p"));

    let insert = format!("INSERT INTO {effects} (key) VALUES ($1)");
    let report = outbox
        .process(&mut client, 10, |tx, record| {
            tx.execute(&insert, &[&record.key])
                .map_err(HandlerError::transient)?;
            if record.topic == "fail" {
                return Err(HandlerError::transient("handler refused"));
            }
            Ok(())
        })
        .unwrap();
    assert_eq!((report.processed, report.retried, report.dead), (1, 1, 0));
    assert_eq!(report.lease_lost, 0);

    let written: Vec<String> = client
        .query(&format!("SELECT key FROM {effects}"), &[])
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(written, [good.as_str()]);
    assert_eq!(row_state(&mut client, &outbox, &good), ("sent".into(), 1));
    assert_eq!(row_state(&mut client, &outbox, &bad), ("pending".into(), 1));
    assert_eq!(
        last_error(&mut client, &outbox, &bad).as_deref(),
        Some("handler refused")
    );
    assert_eq!(count(&mut client, &outbox, "lease_until IS NOT NULL"), 0);

    // A permanent handler error dead-letters, and still rolls the writes back.
    let doomed = enqueue_one(&mut client, &outbox, Message::new("doomed", "p"));
    let report = outbox
        .process(&mut client, 10, |tx, record| {
            tx.execute(&insert, &[&record.key])
                .map_err(HandlerError::transient)?;
            Err(HandlerError::permanent("cannot ever work"))
        })
        .unwrap();
    // Only the doomed row is due; the failed one is backing off for an hour.
    assert_eq!((report.processed, report.dead), (0, 1));
    assert_eq!(row_state(&mut client, &outbox, &doomed), ("dead".into(), 1));
    assert_eq!(count(&mut client, &outbox, "status = 'sent'"), 1);
    let n: i64 = client
        .query_one(&format!("SELECT count(*) FROM {effects}"), &[])
        .unwrap()
        .get(0);
    assert_eq!(n, 1);
}

#[test]
fn a_dead_head_stops_blocking_its_aggregate() {
    let (outbox, mut client) = common::outbox("rl_deadhead");
    enqueue(
        &mut client,
        &outbox,
        vec![
            Message::new("poison", "p").key("x-0").aggregate_key("x"),
            Message::new("t", "p").key("x-1").aggregate_key("x"),
        ],
    );
    let sink = Sink::default();
    let config = {
        let sink = sink.clone();
        relay_config(&outbox, move |record| {
            sink.push(record);
            if record.topic == "poison" {
                return Err(PublishError::permanent("cannot be routed"));
            }
            Ok(())
        })
    }
    .batch_size(10);
    // The first cycle claims both as a run; the head dies, so the rest of its run goes back
    // untried (handled: one dead, one handed back), and is due now that its head is dead.
    assert_eq!(Relay::run_once(&config).unwrap(), 2);
    assert_eq!(row_state(&mut client, &outbox, "x-0"), ("dead".into(), 1));
    assert_eq!(
        row_state(&mut client, &outbox, "x-1"),
        ("pending".into(), 0)
    );
    assert_eq!(sink.keys(), ["x-0"]);
    assert_eq!(Relay::run_until_idle(&config).unwrap(), 1);
    assert_eq!(row_state(&mut client, &outbox, "x-1"), ("sent".into(), 1));
    assert_eq!(sink.keys(), ["x-0", "x-1"]);
}

/// Publishes what it is given, then reports itself broken.
struct OneShot {
    sink: Sink,
    used: bool,
}

impl Publisher for OneShot {
    fn publish(&mut self, batch: &[Record]) -> Vec<Result<(), PublishError>> {
        self.used = true;
        batch
            .iter()
            .map(|record| {
                self.sink.push(record);
                Ok(())
            })
            .collect()
    }

    fn is_broken(&self) -> bool {
        self.used
    }
}

#[test]
fn publishers_are_rebuilt_after_factory_failures_and_breakage() {
    let (outbox, mut client) = common::outbox("rl_factory");
    let sink = Sink::default();
    let builds = Arc::new(AtomicUsize::new(0));
    let metrics = Counters::default();
    let config = {
        let (sink, builds) = (sink.clone(), builds.clone());
        RelayConfig::new(outbox.clone(), common::pool(RELAY_POOL), move || {
            if builds.fetch_add(1, Ordering::SeqCst) == 0 {
                return Err(std::io::Error::other("broker unreachable"));
            }
            Ok(OneShot {
                sink: sink.clone(),
                used: false,
            })
        })
    }
    .concurrency(1)
    .notify(false)
    .poll_interval(Duration::from_millis(20))
    .metrics(metrics.clone());
    // Waiting when the relay starts, so the failed build holds a row back (an idle worker
    // builds its publisher before any row comes).
    let first = enqueue_one(&mut client, &outbox, Message::new("t", "p"));
    let relay = Relay::spawn(config).unwrap();

    wait_until("published once a publisher could be built", || {
        sink.contains(&first)
    });
    let second = enqueue_one(&mut client, &outbox, Message::new("t", "p"));
    wait_until("published by a rebuilt publisher", || {
        sink.contains(&second)
    });
    wait_until("both recorded", || {
        count(&mut client, &outbox, "status = 'sent'") == 2
    });
    relay.shutdown(Duration::from_secs(10)).unwrap();

    // The failed build cost no attempt: the rows it could not publish were handed back.
    assert!(metrics.released() >= 1);
    assert_eq!(metrics.failed(), 0);
    assert!(sink.records().iter().all(|r| r.attempt == 1));
    assert_eq!(row_state(&mut client, &outbox, &first), ("sent".into(), 1));
    assert_eq!(row_state(&mut client, &outbox, &second), ("sent".into(), 1));
    // One failed build, one for the first row, one after that publisher broke (built while
    // idle, before the second row came), and one after the second broke unless the shutdown
    // came first.
    let built = builds.load(Ordering::SeqCst);
    assert!(matches!(built, 3 | 4), "{built} publishers built");
}

#[test]
fn spawn_rejects_a_small_pool_and_an_unmigrated_table() {
    let (outbox, _client) = common::outbox("rl_spawn");
    let sink = Sink::default();
    // Four workers and a listener need five pooled connections; four workers alone, four.
    let err = Relay::spawn(relay_config_with_pool(&outbox, 4, sink.collect())).unwrap_err();
    assert!(err.to_string().contains("pool"), "{err}");
    let err =
        Relay::spawn(relay_config_with_pool(&outbox, 3, sink.collect()).notify(false)).unwrap_err();
    assert!(err.to_string().contains("pool"), "{err}");
    // Connections of its own need none from a pool.
    let own = common::relay_config_with(
        &outbox,
        Connections::open(common::database_url().parse().unwrap(), postgres::NoTls),
        sink.collect(),
    );
    Relay::spawn(own)
        .unwrap()
        .shutdown(Duration::from_secs(10))
        .unwrap();

    let missing = Outbox::new(&common::unique_name("rl_never_migrated")).unwrap();
    let err = Relay::spawn(relay_config(&missing, sink.collect())).unwrap_err();
    assert!(err.is_not_migrated(), "{err}");
}

#[test]
fn join_returns_when_the_table_is_dropped() {
    let (outbox, mut client) = common::outbox("rl_join");
    let sink = Sink::default();
    let config = relay_config(&outbox, sink.collect())
        .notify(false)
        .poll_interval(Duration::from_millis(20));
    let relay = Relay::spawn(config).unwrap();
    let key = enqueue_one(&mut client, &outbox, Message::new("t", "p"));
    wait_until("published", || sink.contains(&key));
    assert!(!relay.has_stopped());

    client
        .batch_execute(&format!("DROP TABLE {}", quoted(&outbox)))
        .unwrap();
    // What a caller waiting on something else (the CLI, on a signal) polls.
    wait_until("the relay says it stopped", || relay.has_stopped());
    let joined = thread::spawn(move || relay.join());
    wait_until("the relay stops on its own", || joined.is_finished());
    let err = joined.join().unwrap().unwrap_err();
    assert!(err.is_not_migrated(), "{err}");
}

// ---------------------------------------------------------------------------------------------
// Adversarial: hung peers, stalled writes, poison, crash loops, panics
// ---------------------------------------------------------------------------------------------

/// The sequence number a test message carries as its payload.
fn seq(record: &Record) -> i64 {
    String::from_utf8(record.payload.clone())
        .unwrap()
        .parse()
        .unwrap()
}

/// `n` messages of one aggregate, payloads `0..n` in enqueue order.
fn ordered(aggregate: &str, n: usize) -> Vec<Message> {
    (0..n)
        .map(|i| {
            Message::new("t", i.to_string())
                .key(format!("{aggregate}-{i}"))
                .aggregate_key(aggregate)
        })
        .collect()
}

#[test]
fn a_hung_relay_does_not_starve_a_healthy_one() {
    let (outbox, mut client) = common::outbox("rl_hung");
    let mut messages = numbered("u", 60);
    messages.extend(ordered("x", 15));
    messages.extend(ordered("y", 15));
    enqueue(&mut client, &outbox, messages);

    // Every publisher of this relay hangs on the first record it is handed.
    let hung = Gate::default();
    let hung_metrics = Counters::default();
    let stuck = {
        let hung = hung.clone();
        relay_config(&outbox, move |_| {
            hung.pass();
            Ok(())
        })
    }
    .concurrency(2)
    .batch_size(10)
    .lease(Duration::from_secs(2))
    .poll_interval(Duration::from_millis(100))
    .metrics(hung_metrics.clone());
    let stuck = Relay::spawn(stuck).unwrap();
    wait_until("both workers of the hung relay are stuck", || {
        hung.waiting() == 2
    });

    let healthy_sink = Sink::default();
    let healthy = Relay::spawn(
        relay_config(&outbox, healthy_sink.collect())
            .lease(Duration::from_secs(2))
            .poll_interval(Duration::from_millis(100)),
    )
    .unwrap();
    wait_until("the healthy relay has delivered every row", || {
        count(&mut client, &outbox, "status = 'sent'") == 90
    });
    // The hung relay holds what its two workers claimed and claims nothing more.
    assert!(hung_metrics.claimed() <= 20, "{}", hung_metrics.claimed());
    for aggregate in ["x", "y"] {
        let seqs: Vec<i64> = healthy_sink
            .records()
            .iter()
            .filter(|r| r.aggregate_key.as_deref() == Some(aggregate))
            .map(seq)
            .collect();
        assert_eq!(seqs, (0..15).collect::<Vec<_>>(), "aggregate {aggregate}");
    }
    hung.open();
    let late = stuck.shutdown(Duration::from_secs(10)).unwrap();
    // Its late outcomes are fenced off: the rows were claimed and sent since.
    assert_eq!(late.published, 0);
    healthy.shutdown(Duration::from_secs(10)).unwrap();
    assert_eq!(count(&mut client, &outbox, "status <> 'sent'"), 0);
}

#[test]
fn a_stalled_outcome_write_holds_its_batch_and_claims_nothing_more() {
    let (outbox, mut client) = common::outbox("rl_stall");
    enqueue(&mut client, &outbox, numbered("first", 5));
    let handed = Gate::default();
    let metrics = Counters::default();
    let config = {
        let handed = handed.clone();
        relay_config(&outbox, move |_| {
            handed.pass();
            Ok(())
        })
    }
    .concurrency(1)
    .batch_size(5)
    // Statements time out after a quarter of the lease: 2 s.
    .lease(Duration::from_secs(8))
    .poll_interval(Duration::from_millis(50))
    .metrics(metrics.clone());
    let relay = Relay::spawn(config).unwrap();
    wait_until("the batch is being published", || handed.waiting() == 1);

    // Lock the claimed rows, so writing their outcomes waits behind the lock.
    let mut locker = common::client();
    let mut lock = locker.transaction().unwrap();
    lock.execute(
        &format!(
            "SELECT 1 FROM {} WHERE key LIKE 'first-%' FOR UPDATE",
            quoted(&outbox)
        ),
        &[],
    )
    .unwrap();
    handed.open();
    let relay_app = format!("outbox relay {}", outbox.table());
    let blocked_since = |client: &mut Client| -> Option<std::time::SystemTime> {
        client
            .query_opt(
                "SELECT query_start FROM pg_stat_activity
                 WHERE application_name = $1 AND wait_event_type = 'Lock'",
                &[&relay_app],
            )
            .unwrap()
            .map(|row| row.get(0))
    };
    let mut first_wait = None;
    wait_until("the outcome write waits on the lock", || {
        first_wait = blocked_since(&mut client);
        first_wait.is_some()
    });
    let first_wait = first_wait.unwrap();
    enqueue(&mut client, &outbox, numbered("second", 5));
    wait_until(
        "the stalled write was cancelled and is waiting again",
        || blocked_since(&mut client).is_some_and(|since| since > first_wait),
    );
    // Seconds went by with due, notified rows and an idle poll, and none was claimed: the
    // worker still holds its unrecorded batch.
    assert_eq!(
        count(
            &mut client,
            &outbox,
            "key LIKE 'second-%' AND attempts = 0 AND lease_until IS NULL"
        ),
        5
    );
    assert_eq!(metrics.claimed(), 5);
    lock.rollback().unwrap();

    wait_until("all ten are sent", || {
        count(&mut client, &outbox, "status = 'sent'") == 10
    });
    relay.shutdown(Duration::from_secs(10)).unwrap();
    // The first batch was recorded by its own claim, not published again after a lease.
    assert_eq!(
        count(&mut client, &outbox, "key LIKE 'first-%' AND attempts = 1"),
        5
    );
    assert_eq!(metrics.claimed(), 10);
}

#[test]
fn a_nul_in_an_error_text_is_stored_and_the_rest_of_the_batch_recorded() {
    let (outbox, mut client) = common::outbox("rl_nul");
    enqueue(&mut client, &outbox, numbered("n", 4));
    let config = relay_config(&outbox, |record| match record.key.as_str() {
        "n-1" => Err(PublishError::transient("broker said \0 nothing")),
        "n-2" => Err(PublishError::permanent("bad \0 payload")),
        _ => Ok(()),
    });
    assert_eq!(Relay::run_once(&config).unwrap(), 4);
    assert_eq!(row_state(&mut client, &outbox, "n-0"), ("sent".into(), 1));
    assert_eq!(row_state(&mut client, &outbox, "n-3"), ("sent".into(), 1));
    assert_eq!(
        row_state(&mut client, &outbox, "n-1"),
        ("pending".into(), 1)
    );
    assert_eq!(
        last_error(&mut client, &outbox, "n-1").as_deref(),
        Some("broker said \u{fffd} nothing")
    );
    assert_eq!(row_state(&mut client, &outbox, "n-2"), ("dead".into(), 1));
    assert_eq!(
        last_error(&mut client, &outbox, "n-2").as_deref(),
        Some("bad \u{fffd} payload")
    );
}

#[test]
fn an_outcome_the_database_refuses_dead_letters_its_row_alone() {
    let (outbox, mut client) = common::outbox("rl_refused");
    // A rule of the operator's that one error text breaks.
    client
        .batch_execute(&format!(
            "ALTER TABLE {} ADD CONSTRAINT clean_errors CHECK (last_error NOT LIKE '%pill%')",
            quoted(&outbox)
        ))
        .unwrap();
    enqueue(&mut client, &outbox, numbered("p", 3));
    let config = relay_config(&outbox, |record| {
        if record.key == "p-1" {
            return Err(PublishError::transient("poison pill"));
        }
        Ok(())
    });
    assert_eq!(Relay::run_once(&config).unwrap(), 3);
    assert_eq!(row_state(&mut client, &outbox, "p-0"), ("sent".into(), 1));
    assert_eq!(row_state(&mut client, &outbox, "p-2"), ("sent".into(), 1));
    assert_eq!(row_state(&mut client, &outbox, "p-1"), ("dead".into(), 1));
    let error = last_error(&mut client, &outbox, "p-1").unwrap();
    assert!(
        error.contains("could not be stored") && error.contains("clean_errors"),
        "{error}"
    );
}

#[test]
fn an_undecodable_row_is_dead_lettered_with_the_reason() {
    let (outbox, mut client) = common::outbox("rl_undecodable");
    // Headers with a NULL value cannot become a Record.
    client
        .execute(
            &format!(
                "INSERT INTO {} (key, topic, payload, headers)
                 VALUES ('broken', 't', 'p', ARRAY['name', NULL])",
                quoted(&outbox)
            ),
            &[],
        )
        .unwrap();
    enqueue(&mut client, &outbox, numbered("fine", 2));
    let sink = Sink::default();
    let config = relay_config(&outbox, sink.collect());
    assert_eq!(Relay::run_until_idle(&config).unwrap(), 3);
    assert_eq!(sink.keys(), ["fine-0", "fine-1"]);
    assert_eq!(
        row_state(&mut client, &outbox, "broken"),
        ("dead".into(), 1)
    );
    let error = last_error(&mut client, &outbox, "broken").unwrap();
    assert!(error.contains("cannot be read"), "{error}");
}

#[test]
fn a_row_claimed_more_often_in_a_row_than_max_claims_allows_dies_at_claim() {
    let (outbox, mut client) = common::outbox("rl_crashloop");
    let key = enqueue_one(
        &mut client,
        &outbox,
        Message::new("t", "p").max_attempts(5).aggregate_key("a"),
    );
    let next = enqueue_one(
        &mut client,
        &outbox,
        Message::new("t", "q").aggregate_key("a"),
    );
    // Claimed twice already, and no outcome ever recorded: the relay crashed both times.
    client
        .execute(
            &format!("UPDATE {} SET claims = 2 WHERE key = $1", quoted(&outbox)),
            &[&key],
        )
        .unwrap();
    let sink = Sink::default();
    let metrics = Counters::default();
    let config = relay_config(&outbox, sink.collect())
        .retry(Retry::default().max_claims(2))
        .metrics(metrics.clone());
    // The first cycle kills it and hands back the message behind it (claimed in the same
    // run, it must not go out before the death is recorded); the next sends that one.
    assert_eq!(Relay::run_until_idle(&config).unwrap(), 3);
    // Never handed to a publisher again; the message behind it went out.
    assert_eq!(sink.keys(), [next.as_str()]);
    // Its attempts are its verdicts: none was ever given.
    assert_eq!(row_state(&mut client, &outbox, &key), ("dead".into(), 0));
    let error = last_error(&mut client, &outbox, &key).unwrap();
    assert!(
        error.contains("claimed 3 times in a row without an outcome")
            && error.contains("max_claims (2)"),
        "{error}"
    );
    assert_eq!(metrics.dead_lettered(), 1);
    // The message behind it was handed back once and then sent: neither cost it a claim
    // left over, nor more than its one attempt.
    assert_eq!(
        count(
            &mut client,
            &outbox,
            &format!("key = '{next}' AND claims = 0 AND attempts = 1")
        ),
        1
    );
}

/// Panics in every callback it implements.
struct PanickingMetrics;

impl Metrics for PanickingMetrics {
    fn claimed(&self, _n: usize) {
        panic!("injected: a bug in the metrics exporter");
    }
    fn published(&self, _record: &Record, _took: Duration) {
        panic!("injected: a bug in the metrics exporter");
    }
}

#[test]
fn a_panicking_metrics_callback_never_stops_the_relay() {
    let (outbox, mut client) = common::outbox("rl_metrics_panic");
    let sink = Sink::default();
    let relay =
        Relay::spawn(relay_config(&outbox, sink.collect()).metrics(PanickingMetrics)).unwrap();
    enqueue(&mut client, &outbox, numbered("m", 20));
    wait_until("all 20 are recorded sent", || {
        count(&mut client, &outbox, "status = 'sent'") == 20
    });
    let report = relay.shutdown(Duration::from_secs(10)).unwrap();
    assert_eq!(report.published, 20);
    assert_eq!(sink.len(), 20);
}

/// Publishes, then says it is broken, and panics when it is dropped.
struct PanicsOnDrop;

impl Publisher for PanicsOnDrop {
    fn publish(&mut self, batch: &[Record]) -> Vec<Result<(), PublishError>> {
        batch.iter().map(|_| Ok(())).collect()
    }

    fn is_broken(&self) -> bool {
        true
    }
}

impl Drop for PanicsOnDrop {
    fn drop(&mut self) {
        panic!("injected: a bug in the publisher's Drop");
    }
}

#[test]
fn a_worker_that_keeps_panicking_stops_the_relay_with_an_error() {
    let (outbox, mut client) = common::outbox("rl_panic_loop");
    enqueue(&mut client, &outbox, numbered("k", 10));
    let config = RelayConfig::new(outbox.clone(), common::pool(RELAY_POOL), || {
        Ok::<_, Infallible>(PanicsOnDrop)
    })
    .concurrency(1)
    .batch_size(1)
    .notify(false)
    .poll_interval(Duration::from_millis(20));
    let relay = Relay::spawn(config).unwrap();
    let joined = thread::spawn(move || relay.join());
    wait_until("the relay stops on its own", || joined.is_finished());
    let err = joined.join().unwrap().unwrap_err();
    assert!(err.to_string().contains("panicked 5 times"), "{err}");
    // Nothing was lost: the rows whose outcomes never got written are still pending.
    assert_eq!(count(&mut client, &outbox, "status = 'pending'"), 10);
}

#[test]
fn huge_durations_saturate_instead_of_panicking() {
    let (outbox, mut client) = common::outbox("rl_durations");
    let sink = Sink::default();
    let config = relay_config(&outbox, sink.collect())
        .drain_timeout(Duration::MAX)
        .poll_interval(Duration::MAX)
        .retry(Retry::default().backoff(Duration::from_millis(1), Duration::MAX));
    let relay = Relay::spawn(config.clone()).unwrap();
    let key = enqueue_one(&mut client, &outbox, Message::new("t", "p"));
    wait_until("published", || sink.contains(&key));
    relay.shutdown(Duration::MAX).unwrap();
    drop(Relay::spawn(config.clone()).unwrap());

    // A retry this late in an exponential schedule is capped, not an overflow in SQL.
    let late = enqueue_one(
        &mut client,
        &outbox,
        Message::new("t", "p").max_attempts(1000),
    );
    client
        .execute(
            &format!(
                "UPDATE {} SET attempts = 60 WHERE key = $1",
                quoted(&outbox)
            ),
            &[&late],
        )
        .unwrap();
    let failing = relay_config(&outbox, |_| Err(PublishError::transient("down")))
        .retry(Retry::default().backoff(Duration::from_secs(24 * 3600), Duration::MAX));
    assert_eq!(Relay::run_once(&failing).unwrap(), 1);
    assert_eq!(
        row_state(&mut client, &outbox, &late),
        ("pending".into(), 61)
    );
    assert_eq!(
        count(
            &mut client,
            &outbox,
            "available_at > now() + interval '1 year'"
        ),
        1
    );
}

#[test]
fn a_relay_whose_backends_are_terminated_mid_batch_delivers_everything_once() {
    let (outbox, mut client) = common::outbox("rl_terminated");
    enqueue(&mut client, &outbox, numbered("t", 40));
    let gate = Gate::default();
    let sink = Sink::default();
    let config = {
        let (gate, sink) = (gate.clone(), sink.clone());
        relay_config(&outbox, move |record| {
            gate.pass();
            sink.push(record);
            Ok(())
        })
    }
    .concurrency(2)
    .batch_size(10);
    let relay = Relay::spawn(config).unwrap();
    wait_until("both workers are publishing", || gate.waiting() == 2);
    let killed: i64 = client
        .query_one(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
             WHERE application_name = $1",
            &[&format!("outbox relay {}", outbox.table())],
        )
        .unwrap()
        .get(0);
    assert_eq!(killed, 2);
    gate.open();
    wait_until("all 40 are recorded sent", || {
        count(&mut client, &outbox, "status = 'sent'") == 40
    });
    relay.shutdown(Duration::from_secs(10)).unwrap();
    // The outcomes were written on fresh connections within the lease: nothing went twice.
    assert_eq!(sink.len(), 40);
    assert_eq!(count(&mut client, &outbox, "attempts <> 1"), 0);
}

/// Checks the order invariant as records are handed over: a message of the hot aggregate is
/// handed to a publisher only once every earlier one was confirmed.
#[derive(Default)]
struct OrderCheck {
    /// How many of the aggregate's messages, from the first, are confirmed.
    confirmed: Mutex<i64>,
    violations: Mutex<Vec<String>>,
    failures: AtomicUsize,
}

#[test]
fn one_hot_aggregate_across_three_relays_with_failures_keeps_strict_order() {
    let (outbox, mut client) = common::outbox("rl_hot3");
    let n = 300;
    let mut messages = ordered("hot", n);
    messages.extend(numbered("free", 100));
    enqueue(&mut client, &outbox, messages);
    let check = Arc::new(OrderCheck::default());
    let relays: Vec<Relay> = (0..3)
        .map(|_| {
            let check = check.clone();
            let config = relay_config(&outbox, move |record| {
                if record.aggregate_key.is_none() {
                    return Ok(());
                }
                let seq = seq(record);
                let mut confirmed = check.confirmed.lock().unwrap();
                if seq > *confirmed {
                    check.violations.lock().unwrap().push(format!(
                        "{seq} handed over with only {} confirmed",
                        *confirmed
                    ));
                }
                // Every seventh message fails its first attempt.
                if record.attempt == 1 && seq % 7 == 3 {
                    check.failures.fetch_add(1, Ordering::SeqCst);
                    return Err(PublishError::transient("injected failure"));
                }
                if seq == *confirmed {
                    *confirmed += 1;
                }
                Ok(())
            })
            .concurrency(2)
            .batch_size(20)
            .retry(Retry::default().backoff(Duration::from_millis(1), Duration::from_millis(5)))
            .poll_interval(Duration::from_millis(20));
            Relay::spawn(config).unwrap()
        })
        .collect();
    wait_until("everything is sent", || {
        count(&mut client, &outbox, "status = 'sent'") == (n + 100) as i64
    });
    for relay in relays {
        relay.shutdown(Duration::from_secs(10)).unwrap();
    }
    assert_eq!(*check.violations.lock().unwrap(), Vec::<String>::new());
    assert_eq!(*check.confirmed.lock().unwrap(), n as i64);
    assert_eq!(check.failures.load(Ordering::SeqCst), n / 7 + 1);
}

/// Publishes what it is given, and panics when asked whether it is broken.
struct PanicsWhenAsked {
    sink: Sink,
}

impl Publisher for PanicsWhenAsked {
    fn publish(&mut self, batch: &[Record]) -> Vec<Result<(), PublishError>> {
        batch.iter().for_each(|r| self.sink.push(r));
        batch.iter().map(|_| Ok(())).collect()
    }

    fn is_broken(&self) -> bool {
        panic!("injected: a bug in is_broken");
    }
}

#[test]
fn an_idle_relay_builds_its_publishers_before_rows_come() {
    let (outbox, mut client) = common::outbox("rl_ready");
    let sink = Sink::default();
    let builds = Arc::new(AtomicUsize::new(0));
    let config = {
        let (publish, builds) = (sink.collect(), builds.clone());
        let publish = Arc::new(publish);
        RelayConfig::new(outbox.clone(), common::pool(RELAY_POOL), move || {
            builds.fetch_add(1, Ordering::SeqCst);
            let publish = Arc::clone(&publish);
            Ok::<_, Infallible>(publisher_fn(move |record| publish(record)))
        })
    }
    .concurrency(2)
    .poll_interval(Duration::from_millis(20));
    let relay = Relay::spawn(config).unwrap();
    wait_until("each worker has built its publisher", || {
        builds.load(Ordering::SeqCst) == 2
    });
    let key = enqueue_one(&mut client, &outbox, Message::new("t", "p"));
    wait_until("sent", || row_state(&mut client, &outbox, &key).0 == "sent");
    relay.shutdown(Duration::from_secs(10)).unwrap();
    assert!(sink.contains(&key));
    assert_eq!(
        builds.load(Ordering::SeqCst),
        2,
        "the row used a publisher built before it"
    );
}

#[test]
fn an_idle_relay_whose_publisher_cannot_be_built_reports_it_down_and_probes_with_backoff() {
    type Never = PublisherFn<fn(&Record) -> Result<(), PublishError>>;
    let (outbox, _client) = common::outbox("rl_ready_down");
    let builds = Arc::new(AtomicUsize::new(0));
    let metrics = Counters::default();
    let config = {
        let builds = builds.clone();
        RelayConfig::new(outbox.clone(), common::pool(RELAY_POOL), move || {
            builds.fetch_add(1, Ordering::SeqCst);
            Err::<Never, _>(std::io::Error::other("broker unreachable"))
        })
    }
    .poll_interval(Duration::from_millis(10))
    .metrics(metrics.clone());
    let relay = Relay::spawn(config).unwrap();
    wait_until("the destination is known down with no row waiting", || {
        metrics.downs() >= 1
    });
    // A window to count builds in, not a wait for a condition: load can only lower the
    // count. On the destination's backoff (500 ms, doubling), a probe at a time: one or two
    // in a second. Four workers building at every 10 ms poll would make hundreds.
    let at_down = builds.load(Ordering::SeqCst);
    thread::sleep(Duration::from_secs(1));
    let in_a_second = builds.load(Ordering::SeqCst) - at_down;
    relay.shutdown(Duration::from_secs(10)).unwrap();
    assert!(in_a_second <= 20, "{in_a_second} builds in a second");
}

#[test]
fn a_panicking_factory_or_is_broken_costs_no_attempt_and_stops_nothing() {
    let (outbox, mut client) = common::outbox("rl_factory_panic");
    let sink = Sink::default();
    let builds = Arc::new(AtomicUsize::new(0));
    let config = {
        let (sink, builds) = (sink.clone(), builds.clone());
        RelayConfig::new(outbox.clone(), common::pool(RELAY_POOL), move || {
            // The first build panics; every publisher after that panics in `is_broken`
            // after its first batch.
            if builds.fetch_add(1, Ordering::SeqCst) == 0 {
                panic!("injected: a bug in the publisher factory");
            }
            Ok::<_, Infallible>(PanicsWhenAsked { sink: sink.clone() })
        })
    }
    .concurrency(1)
    .batch_size(5)
    .notify(false)
    .poll_interval(Duration::from_millis(20));
    enqueue(&mut client, &outbox, numbered("f", 10));
    let relay = Relay::spawn(config).unwrap();
    wait_until("all ten are recorded sent", || {
        count(&mut client, &outbox, "status = 'sent'") == 10
    });
    relay.shutdown(Duration::from_secs(10)).unwrap();
    // The factory's panic cost no attempt; a publisher whose `is_broken` panicked was
    // treated as broken and rebuilt, its batch still recorded as sent.
    assert_eq!(count(&mut client, &outbox, "attempts <> 1"), 0);
    assert_eq!(sink.len(), 10);
    assert!(
        builds.load(Ordering::SeqCst) >= 3,
        "rebuilt after each panic"
    );
}

#[test]
fn the_byte_budget_bounds_each_claim_and_a_larger_row_goes_alone() {
    let (outbox, mut client) = common::outbox("rl_bytes");
    let mut messages: Vec<Message> = (0..4)
        .map(|i| Message::new("t", vec![b'x'; 1_000]).key(format!("small-{i}")))
        .collect();
    messages.push(Message::new("t", vec![b'x'; 10_000]).key("large"));
    enqueue(&mut client, &outbox, messages);
    let sink = Sink::default();
    // One worker with 2,500 bytes: two 1,000-byte rows fit, a third would not.
    let config = relay_config(&outbox, sink.collect())
        .concurrency(1)
        .max_in_flight_bytes(2_500);
    assert_eq!(Relay::run_once(&config).unwrap(), 2);
    assert_eq!(Relay::run_once(&config).unwrap(), 2);
    // Larger than the whole budget: claimed on its own, so it still moves.
    assert_eq!(Relay::run_once(&config).unwrap(), 1);
    assert_eq!(Relay::run_once(&config).unwrap(), 0);
    assert_eq!(
        sink.keys(),
        ["small-0", "small-1", "small-2", "small-3", "large"]
    );
}

#[test]
fn headers_weigh_against_the_byte_budget_as_payloads_do() {
    let (outbox, mut client) = common::outbox("rl_header_bytes");
    // Small payloads, 1,000 bytes of headers each (hex, so nothing compresses them).
    let blob: String = (0..500).map(|i| format!("{:02x}", i % 256)).collect();
    enqueue(
        &mut client,
        &outbox,
        (0..4)
            .map(|i| {
                Message::new("t", "p")
                    .key(format!("h-{i}"))
                    .header("blob", blob.clone())
            })
            .collect(),
    );
    let sink = Sink::default();
    let config = relay_config(&outbox, sink.collect())
        .concurrency(1)
        .max_in_flight_bytes(2_500);
    assert_eq!(Relay::run_once(&config).unwrap(), 2);
    assert_eq!(Relay::run_once(&config).unwrap(), 2);
}

#[test]
fn a_batch_of_one_claims_ordered_rows_while_unordered_ones_keep_coming() {
    let (outbox, mut client) = common::outbox("rl_batch_one");
    enqueue_one(
        &mut client,
        &outbox,
        Message::new("t", "o").key("ordered").aggregate_key("a"),
    );
    let sink = Sink::default();
    let config = relay_config(&outbox, sink.collect()).batch_size(1);
    // Each claim takes one row of either kind at random: the ordered one cannot wait
    // behind unordered rows for ever (after 40 claims, with odds of 2^-40).
    for i in 0..40 {
        enqueue_one(
            &mut client,
            &outbox,
            Message::new("t", "u").key(format!("u-{i}")),
        );
        Relay::run_once(&config).unwrap();
        if sink.contains("ordered") {
            return;
        }
    }
    panic!("the ordered row was never claimed: {:?}", sink.keys());
}

#[test]
fn process_refuses_a_limit_it_cannot_claim_and_contains_a_panicking_handler() {
    let (outbox, mut client) = common::outbox("rl_process_limits");
    for limit in [0, 10_001, usize::MAX] {
        let e = outbox
            .process(&mut client, limit, |_, _| Ok(()))
            .unwrap_err();
        assert!(e.is_invalid_input(), "{limit}: {e}");
    }
    enqueue(&mut client, &outbox, numbered("p", 2));
    let report = outbox
        .process(&mut client, 10, |_, record| {
            if record.key == "p-0" {
                panic!("injected: a bug in the handler");
            }
            Ok(())
        })
        .unwrap();
    assert_eq!((report.processed, report.retried), (1, 1), "{report:?}");
    assert_eq!(
        row_state(&mut client, &outbox, "p-0"),
        ("pending".into(), 1)
    );
    let error = last_error(&mut client, &outbox, "p-0").unwrap();
    assert!(error.contains("panicked"), "{error}");
}

#[test]
fn producers_and_relays_that_spell_the_table_differently_share_its_channel() {
    // Producers migrate and enqueue as `name`; the relay is given `schema.name`.
    let (outbox, mut client) = common::outbox("rl_spelling");
    let qualified = Outbox::new(&format!("{}.{}", common::schema(), outbox.table())).unwrap();
    let sink = Sink::default();
    let relay = Relay::spawn(
        relay_config(&qualified, sink.collect()).poll_interval(Duration::from_secs(3600)),
    )
    .unwrap();
    wait_until("the relay listens", || relay.is_listening());
    enqueue_one(&mut client, &outbox, Message::new("t", "x").key("woken"));
    // An hourly poll: only the notification can have woken it.
    wait_until("the relay is woken", || sink.contains("woken"));
    relay.shutdown(Duration::from_secs(10)).unwrap();
    assert_eq!(
        outbox.channel(&mut client).unwrap(),
        qualified.channel(&mut client).unwrap()
    );
}

#[test]
fn run_once_reports_the_database_error_it_met() {
    let (outbox, _client) = common::outbox("rl_unreachable");
    // Nothing listens on port 1.
    let manager = r2d2_postgres::PostgresConnectionManager::new(
        "postgres://postgres@127.0.0.1:1/test".parse().unwrap(),
        postgres::NoTls,
    );
    let pool = r2d2::Pool::builder()
        .max_size(1)
        .min_idle(Some(0))
        .connection_timeout(Duration::from_secs(1))
        .build(manager)
        .unwrap();
    let config = RelayConfig::new(outbox, pool, || {
        Ok::<_, Infallible>(publisher_fn(|_| Ok(())))
    });
    let err = Relay::run_once(&config).unwrap_err();
    assert!(
        matches!(err, postgres_outbox::Error::Pool(_)),
        "the pool's own error, not a generic one: {err:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// Outages: the world's faults cost no attempt
// ---------------------------------------------------------------------------------------------

#[test]
fn an_unavailable_destination_costs_no_attempt_and_is_reported_once_per_outage() {
    let (outbox, mut client) = common::outbox("rl_outage");
    let mut messages = numbered("u", 10);
    messages.extend(ordered("o", 10));
    enqueue(&mut client, &outbox, messages);
    let down = Arc::new(AtomicBool::new(true));
    let tries = Arc::new(AtomicUsize::new(0));
    let sink = Sink::default();
    let publish = {
        let (down, tries, sink) = (down.clone(), tries.clone(), sink.clone());
        move |record: &Record| {
            if down.load(Ordering::SeqCst) {
                tries.fetch_add(1, Ordering::SeqCst);
                return Err(PublishError::unavailable("broker down"));
            }
            sink.push(record);
            Ok(())
        }
    };
    let metrics = Counters::default();
    // Two attempts at most: a relay that charged the outage would kill every row quickly.
    let config = relay_config(&outbox, publish)
        .retry(Retry::new(2).backoff(Duration::from_millis(5), Duration::from_millis(10)))
        .poll_interval(Duration::from_millis(20))
        .metrics(metrics.clone());

    // A lone call says what stopped it.
    let e = Relay::run_once(&config).unwrap_err();
    assert!(e.to_string().contains("broker down"), "{e}");

    let relay = Relay::spawn(config).unwrap();
    // The backlog, and then a batch at each probe of the destination, three times over.
    wait_until("the relay has tried again and again", || {
        tries.load(Ordering::SeqCst) >= 60
    });
    assert_eq!(count(&mut client, &outbox, "status <> 'pending'"), 0);
    assert_eq!(count(&mut client, &outbox, "attempts > 1"), 0);
    assert_eq!((metrics.downs(), metrics.ups()), (1, 0));
    assert_eq!(metrics.failed(), 0);
    assert!(metrics.released() > 0);

    down.store(false, Ordering::SeqCst);
    wait_until("everything is sent", || sink.len() == 20);
    relay.shutdown(Duration::from_secs(10)).unwrap();
    assert_eq!(count(&mut client, &outbox, "status = 'sent'"), 20);
    assert_eq!(count(&mut client, &outbox, "attempts <> 1"), 0);
    assert_eq!((metrics.downs(), metrics.ups()), (1, 1));
    let published: Vec<i64> = sink
        .records()
        .iter()
        .filter(|r| r.aggregate_key.is_some())
        .map(seq)
        .collect();
    assert_eq!(published, (0..10).collect::<Vec<_>>());
}

/// Fails every record transiently and then says it is broken, as a publisher whose
/// connection died under the batch would, on its first `fails` calls.
struct BreaksUnderTheBatch {
    fails: Arc<AtomicUsize>,
    broken: bool,
    sink: Sink,
}

impl Publisher for BreaksUnderTheBatch {
    fn publish(&mut self, batch: &[Record]) -> Vec<Result<(), PublishError>> {
        let failing = self
            .fails
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        self.broken = failing;
        batch
            .iter()
            .map(|record| {
                if failing {
                    Err(PublishError::transient("connection reset"))
                } else {
                    self.sink.push(record);
                    Ok(())
                }
            })
            .collect()
    }

    fn is_broken(&self) -> bool {
        self.broken
    }
}

#[test]
fn transient_failures_of_a_publisher_that_then_breaks_cost_no_attempt() {
    let (outbox, mut client) = common::outbox("rl_breaks");
    enqueue(&mut client, &outbox, numbered("b", 5));
    let (fails, sink) = (Arc::new(AtomicUsize::new(3)), Sink::default());
    let (publisher_fails, publisher_sink) = (fails.clone(), sink.clone());
    let config = RelayConfig::new(outbox.clone(), common::pool(RELAY_POOL), move || {
        Ok::<_, Infallible>(BreaksUnderTheBatch {
            fails: publisher_fails.clone(),
            broken: false,
            sink: publisher_sink.clone(),
        })
    })
    .retry(Retry::new(1));
    for _ in 0..3 {
        assert!(Relay::run_once(&config).is_err());
    }
    assert_eq!(count(&mut client, &outbox, "attempts > 0"), 0);
    assert_eq!(Relay::run_until_idle(&config).unwrap(), 5);
    assert_eq!(sink.len(), 5);
    assert_eq!(
        count(&mut client, &outbox, "status = 'sent' AND attempts = 1"),
        5
    );
    assert_eq!(fails.load(Ordering::SeqCst), 0);
}

#[test]
fn one_retry_value_sets_attempts_and_backoff_for_the_outbox_and_the_relay() {
    let refused = common::builder()
        .table(common::unique_name("rl_retry_bad"))
        .retry(Retry::new(0))
        .build()
        .unwrap_err();
    assert!(refused.to_string().contains("max_attempts"), "{refused}");

    let (outbox, mut client) = common::outbox("rl_retry");
    let mut tx = client.transaction().unwrap();
    outbox
        .enqueue(&mut tx, Message::new("t", "x").key("r1"))
        .unwrap();
    tx.commit().unwrap();
    let config = relay_config(&outbox, |_| Err(PublishError::transient("injected: no")))
        .retry(Retry::new(2).backoff(Duration::from_millis(1), Duration::from_millis(2)));
    assert_eq!(Relay::run_once(&config).unwrap(), 1);
    assert_eq!(row_state(&mut client, &outbox, "r1"), ("pending".into(), 1));
    wait_until("the retry is due", || {
        Relay::run_once(&config).unwrap() == 1
    });
    assert_eq!(row_state(&mut client, &outbox, "r1"), ("dead".into(), 2));

    let refused = Relay::spawn(config.retry(Retry::new(3).backoff(Duration::ZERO, Duration::ZERO)))
        .unwrap_err();
    assert!(refused.to_string().contains("backoff"), "{refused}");
}

/// Each claim's size, as the relay reports it.
#[derive(Clone, Default)]
struct Claims(Arc<Mutex<Vec<usize>>>);

impl Metrics for Claims {
    fn claimed(&self, n: usize) {
        self.0.lock().unwrap().push(n);
    }
}

#[test]
fn a_notified_relay_takes_a_commits_rows_of_one_aggregate_in_one_claim_and_in_order() {
    let (outbox, mut client) = common::outbox("notified_runs");
    let deliveries = Sink::default();
    let claims = Claims::default();
    // Only notifications wake it (hourly polls), so every claim below follows one.
    let relay = Relay::spawn(
        relay_config(&outbox, deliveries.collect())
            .concurrency(1)
            .poll_interval(Duration::from_secs(3600))
            .metrics(claims.clone()),
    )
    .unwrap();
    wait_until("the relay listens", || relay.is_listening());

    // A lone message: the ready rows alone.
    let mut tx = client.transaction().unwrap();
    outbox
        .enqueue(&mut tx, Message::new("t", "p").key("alone"))
        .unwrap();
    tx.commit().unwrap();
    wait_until("the lone message is sent", || deliveries.len() == 1);
    // Three messages of one aggregate in one commit: a head with its run behind it.
    let mut tx = client.transaction().unwrap();
    for i in 0..3 {
        let message = Message::new("t", "p")
            .key(format!("order-{i}"))
            .aggregate_key("order-1");
        outbox.enqueue(&mut tx, message).unwrap();
    }
    tx.commit().unwrap();
    wait_until("the aggregate's messages are sent", || {
        deliveries.len() == 4
    });
    relay.shutdown(Duration::from_secs(10)).unwrap();

    assert_eq!(
        deliveries.keys(),
        ["alone", "order-0", "order-1", "order-2"]
    );
    assert_eq!(*claims.0.lock().unwrap(), [1, 3], "one claim each");
}
