//! The core against a real PostgreSQL: schema and migrations, enqueue, dedupe and operations.

mod common;

use std::error::Error as StdError;
use std::sync::{mpsc, Arc, Barrier};
use std::thread;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::{count, quoted, row_state, unique_name, wait_until};
use postgres::error::SqlState;
use postgres::fallible_iterator::FallibleIterator;
use postgres::{Client, Transaction};
use postgres_outbox::{
    Access, Error, Filter, HandlerError, Message, Outbox, ProcessReport, Rows, MAX_INDEXED_KEY,
    MAX_SHORT_STRING,
};

type TestResult = Result<(), Box<dyn StdError>>;

/// Rows on this topic fail permanently in [`settle`]; every other row is marked sent.
const DIE: &str = "die";
/// A topic [`settle`] marks sent.
const SEND: &str = "send";

/// Enqueues one message on `topic` per key, in one committed transaction.
fn enqueue_keys(outbox: &Outbox, client: &mut Client, topic: &str, keys: &[&str]) -> TestResult {
    let mut tx = client.transaction()?;
    for key in keys {
        outbox.enqueue(&mut tx, Message::new(topic, *key).key(*key))?;
    }
    tx.commit()?;
    Ok(())
}

/// Processes every due row until none is left: rows on [`DIE`] become dead letters (error
/// "boom <key>"), the others are marked sent. Returns (sent, dead).
fn settle(outbox: &Outbox, client: &mut Client) -> Result<(usize, usize), Error> {
    let (mut sent, mut dead) = (0, 0);
    loop {
        let report = outbox.process(client, 500, |_, record| {
            if record.topic == DIE {
                Err(HandlerError::permanent(format!("boom {}", record.key)))
            } else {
                Ok(())
            }
        })?;
        if report == ProcessReport::default() {
            return Ok((sent, dead));
        }
        sent += report.processed;
        dead += report.dead;
    }
}

/// A row claimed by `process` on another thread, whose handler holds it until `finish`.
struct Held {
    key: String,
    release: mpsc::Sender<()>,
    worker: thread::JoinHandle<Result<ProcessReport, Error>>,
}

impl Held {
    /// Claims the next due row and waits until its handler is running.
    fn next(outbox: &Outbox) -> Result<Held, Box<dyn StdError>> {
        loop {
            let (started, started_rx) = mpsc::channel();
            let (release, release_rx) = mpsc::channel::<()>();
            let outbox = outbox.clone();
            let worker = thread::spawn(move || {
                let mut client = common::client();
                outbox.process(&mut client, 1, |_, record| {
                    started.send(record.key.clone()).expect("test is waiting");
                    let _ = release_rx.recv();
                    Ok(())
                })
            });
            match started_rx.recv_timeout(Duration::from_secs(60)) {
                Ok(key) => {
                    return Ok(Held {
                        key,
                        release,
                        worker,
                    })
                }
                // Too much of the lease went by before the handler could start, so `process`
                // handed the row back unattempted; claim it again.
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    let report = worker.join().expect("worker panicked")?;
                    assert_eq!(report.released, 1, "{report:?}");
                }
                Err(timeout) => return Err(timeout.into()),
            }
        }
    }

    /// Lets the handler succeed and returns the worker's report.
    fn finish(self) -> Result<ProcessReport, Box<dyn StdError>> {
        self.release.send(())?;
        Ok(self.worker.join().expect("worker panicked")?)
    }
}

/// (key, payload as text) of every row, in id order.
fn stored(client: &mut Client, outbox: &Outbox) -> Vec<(String, String)> {
    let sql = format!(
        "SELECT key, convert_from(payload, 'UTF8') FROM {} ORDER BY id",
        quoted(outbox)
    );
    let rows = client.query(&sql, &[]).expect("read rows");
    rows.iter().map(|row| (row.get(0), row.get(1))).collect()
}

fn pairs(rows: &[(&str, &str)]) -> Vec<(String, String)> {
    rows.iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// Rows in the outbox as the transaction sees them.
fn rows_in(tx: &mut Transaction<'_>, outbox: &Outbox) -> i64 {
    let sql = format!("SELECT count(*) FROM {}", quoted(outbox));
    tx.query_one(&sql, &[]).expect("count").get(0)
}

fn is_uuid_v7(key: &str) -> bool {
    uuid::Uuid::parse_str(key).is_ok_and(|u| u.get_version_num() == 7)
}

/// How many migrations the crate ships: the steps of the DDL `Outbox::sql` prints.
fn shipped_migrations(outbox: &Outbox) -> i64 {
    outbox.sql().matches("$outbox_migration$;").count() as i64
}

/// The field an `Error::InvalidInput` names.
fn field_of(error: &Error) -> &'static str {
    match error {
        Error::InvalidInput { field, .. } => field,
        other => panic!("expected InvalidInput, got {other}"),
    }
}

/// Each message is rejected naming its field, by `enqueue` and `enqueue_all`, in one
/// transaction that still commits a valid message afterwards; only that one is stored.
fn assert_rejected(cases: Vec<(&'static str, Message)>) -> TestResult {
    let (outbox, mut client) = common::outbox("reject");
    let mut tx = client.transaction()?;
    for (field, message) in cases {
        let e = outbox.enqueue(&mut tx, message.clone()).unwrap_err();
        assert_eq!(field_of(&e), field, "{e}");
        assert!(e.is_invalid_input(), "{e}");
        assert!(e.to_string().contains(field), "{e}");
        let e = outbox
            .enqueue_all(&mut tx, [Message::new("t", "fine"), message])
            .unwrap_err();
        assert_eq!(field_of(&e), field, "{e}");
    }
    assert_eq!(rows_in(&mut tx, &outbox), 0);
    let key = outbox.enqueue(&mut tx, Message::new("t", "valid"))?;
    tx.commit()?;
    assert_eq!(stored(&mut client, &outbox), pairs(&[(&key, "valid")]));
    Ok(())
}

/// Tables, indexes, sequences, columns and constraints of `schema`, with the schema's name
/// taken out so two schemas can be compared.
fn schema_snapshot(client: &mut Client, schema: &str) -> Vec<String> {
    let queries = [
        "SELECT c.relname || ' ' || c.relkind::text FROM pg_class c
         JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = $1",
        "SELECT indexname || ' ' || replace(indexdef, $1::text || '.', '') FROM pg_indexes
         WHERE schemaname = $1::text",
        "SELECT concat_ws(' ', table_name, column_name, data_type, column_default, is_nullable)
         FROM information_schema.columns WHERE table_schema = $1",
        "SELECT c.conname || ' ' || pg_get_constraintdef(c.oid) FROM pg_constraint c
         JOIN pg_namespace n ON n.oid = c.connamespace WHERE n.nspname = $1",
    ];
    let mut lines: Vec<String> = queries
        .iter()
        .flat_map(|sql| client.query(*sql, &[&schema]).expect("catalog query"))
        .map(|row| row.get(0))
        .collect();
    lines.sort();
    lines
}

fn exists(client: &mut Client, relation: &str) -> bool {
    client
        .query_one("SELECT to_regclass($1) IS NOT NULL", &[&relation])
        .expect("to_regclass")
        .get(0)
}

// ---- produce ----

/// A run with `OUTBOX_TEST_CUTS` must cut, or the suites it runs cross no partition.
#[test]
fn a_run_that_cuts_partitions_cuts_them() -> TestResult {
    if !common::cuts() {
        return Ok(());
    }
    // Cut from when the first row is in.
    let (outbox, mut client) = common::outbox_uncut("cut");
    let mut tx = client.transaction()?;
    outbox.enqueue(&mut tx, Message::new("t", "before"))?;
    tx.commit()?;
    common::cut_often(&outbox);
    let before: i64 = client
        .query_one(&format!("SELECT max(id) FROM {}", quoted(&outbox)), &[])?
        .get(0);
    wait_until("the open partition is cut twice since", || {
        let health = outbox.health(&mut client).expect("health");
        let closed = health.partitions.iter().filter(|p| p.closed.is_some());
        closed.count() as i64 >= (before >> 40) + 2
    });
    let mut tx = client.transaction()?;
    outbox.enqueue(&mut tx, Message::new("t", "after"))?;
    tx.commit()?;
    let ids: Vec<i64> = client
        .query(
            &format!("SELECT id FROM {} ORDER BY id", quoted(&outbox)),
            &[],
        )?
        .iter()
        .map(|row| row.get(0))
        .collect();
    let [before, after] = ids[..] else {
        panic!("two rows: {ids:?}")
    };
    assert!(after >> 40 >= (before >> 40) + 2, "{ids:?}");
    Ok(())
}

#[test]
fn rolled_back_enqueues_leave_nothing() -> TestResult {
    let (outbox, mut client) = common::outbox("rollback");
    let mut tx = client.transaction()?;
    outbox.enqueue(&mut tx, Message::new("t", "one"))?;
    outbox.enqueue_all(
        &mut tx,
        [Message::new("t", "two"), Message::new("t", "three")],
    )?;
    assert_eq!(rows_in(&mut tx, &outbox), 3);
    tx.rollback()?;

    assert_eq!(count(&mut client, &outbox, "true"), 0);
    assert_eq!(outbox.stats(&mut client)?.pending, 0);
    assert_eq!(settle(&outbox, &mut client)?, (0, 0));

    let mut tx = client.transaction()?;
    let key = outbox.enqueue(&mut tx, Message::new("t", "kept"))?;
    tx.commit()?;
    assert_eq!(stored(&mut client, &outbox), pairs(&[(&key, "kept")]));
    Ok(())
}

#[test]
fn generated_keys_are_uuid_v7_and_given_keys_are_kept() -> TestResult {
    let (outbox, mut client) = common::outbox("keys");
    let mut tx = client.transaction()?;
    let generated = outbox.enqueue(&mut tx, Message::new("t", "a"))?;
    let other = outbox.enqueue(&mut tx, Message::new("t", "b"))?;
    let given = outbox.enqueue(&mut tx, Message::new("t", "c").key("order-42-created"))?;
    tx.commit()?;

    assert!(is_uuid_v7(&generated), "{generated}");
    assert!(is_uuid_v7(&other), "{other}");
    assert_ne!(generated, other);
    assert_eq!(given, "order-42-created");
    assert_eq!(
        stored(&mut client, &outbox),
        pairs(&[(&generated, "a"), (&other, "b"), ("order-42-created", "c")])
    );
    Ok(())
}

#[test]
fn enqueued_fields_are_stored_as_given() -> TestResult {
    let (outbox, mut client) = common::outbox("fields");
    let payload = vec![0u8, 159, 146, 150, 255];
    let headers = [("b", "2"), ("a", "1"), ("c", "3"), ("empty", "")];
    let message = headers.iter().fold(
        Message::new("order.created", payload.clone())
            .key("full")
            .aggregate_key("order-42")
            .content_type("application/json")
            .max_attempts(3),
        |m, (name, value)| m.header(*name, *value),
    );
    let mut tx = client.transaction()?;
    outbox.enqueue(&mut tx, message)?;
    outbox.enqueue(&mut tx, Message::new("plain", "p").key("plain"))?;
    tx.commit()?;

    let row = client.query_one(
        &format!(
            "SELECT topic, aggregate_key, payload, content_type, headers, max_attempts, status,
                    attempts
             FROM {} WHERE key = 'full'",
            quoted(&outbox)
        ),
        &[],
    )?;
    assert_eq!(row.get::<_, String>(0), "order.created");
    assert_eq!(row.get::<_, Option<String>>(1).as_deref(), Some("order-42"));
    assert_eq!(row.get::<_, Vec<u8>>(2), payload);
    assert_eq!(
        row.get::<_, Option<String>>(3).as_deref(),
        Some("application/json")
    );
    assert_eq!(
        row.get::<_, Vec<String>>(4),
        ["b", "2", "a", "1", "c", "3", "empty", ""]
    );
    assert_eq!(row.get::<_, Option<i32>>(5), Some(3));
    assert_eq!(row.get::<_, String>(6), "pending");
    assert_eq!(row.get::<_, i32>(7), 0);

    let mut seen = Vec::new();
    outbox.process(&mut client, 10, |_, record| {
        seen.push(record.clone());
        Ok(())
    })?;
    assert_eq!(seen.len(), 2);
    let (full, plain) = (&seen[0], &seen[1]);
    assert_eq!(full.key, "full");
    assert_eq!(full.topic, "order.created");
    assert_eq!(full.aggregate_key.as_deref(), Some("order-42"));
    assert_eq!(full.payload, payload);
    assert_eq!(full.content_type.as_deref(), Some("application/json"));
    let expected: Vec<(String, String)> = headers
        .iter()
        .map(|(n, v)| (n.to_string(), v.to_string()))
        .collect();
    assert_eq!(full.headers, expected);
    assert_eq!(full.max_attempts, Some(3));
    assert_eq!(full.attempt, 1);

    assert_eq!(plain.key, "plain");
    assert_eq!(plain.aggregate_key, None);
    assert_eq!(plain.content_type, None);
    assert!(plain.headers.is_empty());
    assert_eq!(plain.max_attempts, None);
    Ok(())
}

#[test]
fn delay_is_measured_by_the_database_clock() -> TestResult {
    let (outbox, mut client) = common::outbox("delay");
    let mut tx = client.transaction()?;
    outbox.enqueue(
        &mut tx,
        Message::new("t", "p")
            .key("later")
            .delay(Duration::from_secs(3600)),
    )?;
    tx.commit()?;

    let row = client.query_one(
        &format!(
            "SELECT available_at - created_at = interval '1 hour', available_at > now()
             FROM {} WHERE key = 'later'",
            quoted(&outbox)
        ),
        &[],
    )?;
    assert!(
        row.get::<_, bool>(0),
        "available_at is not created_at + delay"
    );
    assert!(row.get::<_, bool>(1), "available_at is not in the future");

    let stats = outbox.stats(&mut client)?;
    assert_eq!((stats.pending, stats.due), (1, 0));
    assert_eq!(
        settle(&outbox, &mut client)?,
        (0, 0),
        "a delayed row was claimed"
    );
    Ok(())
}

#[test]
fn available_at_is_stored_as_given() -> TestResult {
    let (outbox, mut client) = common::outbox("at");
    let whole_secs = SystemTime::now().duration_since(UNIX_EPOCH)?.as_secs();
    let future = UNIX_EPOCH + Duration::from_secs(whole_secs + 7200);
    let past = UNIX_EPOCH + Duration::from_secs(whole_secs - 3600);
    let mut tx = client.transaction()?;
    outbox.enqueue(
        &mut tx,
        Message::new("t", "f").key("future").available_at(future),
    )?;
    outbox.enqueue(
        &mut tx,
        Message::new("t", "p").key("past").available_at(past),
    )?;
    tx.commit()?;

    let sql = format!(
        "SELECT available_at FROM {} WHERE key = $1",
        quoted(&outbox)
    );
    let at = |client: &mut Client, key: &str| -> SystemTime {
        client.query_one(&sql, &[&key]).expect("row").get(0)
    };
    assert_eq!(at(&mut client, "future"), future);
    assert_eq!(at(&mut client, "past"), past);
    let stats = outbox.stats(&mut client)?;
    assert_eq!((stats.pending, stats.due), (2, 1));
    Ok(())
}

#[test]
fn duplicate_key_is_an_error_and_the_transaction_stays_usable() -> TestResult {
    let (outbox, mut client) = common::outbox("dup");
    let mut tx = client.transaction()?;
    outbox.enqueue(&mut tx, Message::new("t", "first").key("committed"))?;
    tx.commit()?;

    let mut tx = client.transaction()?;
    let e = outbox
        .enqueue(&mut tx, Message::new("t", "second").key("committed"))
        .unwrap_err();
    assert!(e.is_duplicate_key(), "{e}");
    assert_eq!(e.duplicate_keys(), ["committed"]);
    outbox.enqueue(&mut tx, Message::new("t", "first").key("same-tx"))?;
    let e = outbox
        .enqueue(&mut tx, Message::new("t", "second").key("same-tx"))
        .unwrap_err();
    assert!(e.is_duplicate_key(), "{e}");
    assert_eq!(e.duplicate_keys(), ["same-tx"]);
    let later = outbox.enqueue(&mut tx, Message::new("t", "later"))?;
    tx.commit()?;

    assert_eq!(
        stored(&mut client, &outbox),
        pairs(&[
            ("committed", "first"),
            ("same-tx", "first"),
            (&later, "later")
        ])
    );
    Ok(())
}

#[test]
fn enqueue_notifies_on_commit_only_while_a_relay_waits() -> TestResult {
    let (outbox, mut client) = common::outbox("notify");
    let quiet = common::builder()
        .table(outbox.table())
        .notify(false)
        .build()?;
    let mut listener = common::client();
    let channel = outbox.channel(&mut client)?;
    listener.batch_execute(&format!("LISTEN \"{channel}\""))?;
    let waiting = format!("\"{}_waiting\"", outbox.table());
    let loud = |client: &mut Client, outbox: &Outbox| -> TestResult {
        let mut tx = client.transaction()?;
        outbox.enqueue(&mut tx, Message::new("t", "loud"))?;
        outbox.enqueue_all(&mut tx, [Message::new("t", "loud too")])?;
        tx.commit()?;
        Ok(())
    };
    // Large enough to be written by COPY.
    let loud_copy = |client: &mut Client, outbox: &Outbox| -> TestResult {
        let mut tx = client.transaction()?;
        outbox.enqueue_all(&mut tx, (0..70).map(|_| Message::new("t", "many")))?;
        tx.commit()?;
        Ok(())
    };
    let marker = |client: &mut Client, payload: &str| -> TestResult {
        client.execute("SELECT pg_notify($1, $2)", &[&channel, &payload])?;
        Ok(())
    };

    // Notify off: never. Notify on, but no relay waits: not either.
    let mut tx = client.transaction()?;
    quiet.enqueue(&mut tx, Message::new("t", "quiet"))?;
    quiet.enqueue_all(&mut tx, [Message::new("t", "quiet too")])?;
    tx.commit()?;
    loud(&mut client, &outbox)?;
    loud_copy(&mut client, &outbox)?;
    marker(&mut client, "nobody waits")?;
    // A relay waits: one notification per enqueueing transaction, at its commit.
    client.execute(&format!("INSERT INTO {waiting} (relay) VALUES ('r1')"), &[])?;
    let mut tx = client.transaction()?;
    outbox.enqueue(&mut tx, Message::new("t", "loud"))?;
    // Sent and committed before the loud commit: it must come first.
    marker(&mut listener, "a relay waits")?;
    tx.commit()?;
    loud(&mut client, &outbox)?;
    loud_copy(&mut client, &outbox)?;
    // A waiting row not refreshed for over a minute is a relay that died.
    client.execute(
        &format!("UPDATE {waiting} SET seen = now() - interval '2 minutes'"),
        &[],
    )?;
    loud(&mut client, &outbox)?;
    loud_copy(&mut client, &outbox)?;
    marker(&mut client, "the relay died")?;

    let mut payloads = Vec::new();
    let mut notifications = listener.notifications();
    let mut incoming = notifications.timeout_iter(Duration::from_secs(60));
    while payloads.len() < 5 {
        let n = incoming.next()?.expect("a notification within 60 s");
        assert_eq!(n.channel(), channel);
        payloads.push(n.payload().to_owned());
    }
    // PostgreSQL folds identical notifications of one transaction into one.
    assert_eq!(payloads, ["nobody waits", "a relay waits", "", "", ""]);
    let n = incoming.next()?.expect("the last marker");
    assert_eq!(n.payload(), "the relay died");
    Ok(())
}

#[test]
fn enqueue_all_returns_keys_in_order_one_row_each() -> TestResult {
    let (outbox, mut client) = common::outbox("all");
    let messages = (0..5).map(|i| {
        let m = (0..i).fold(Message::new("t", format!("p{i}")), |m, h| {
            m.header(format!("h{h}"), format!("{i}.{h}"))
        });
        if i % 2 == 0 {
            m.key(format!("given-{i}"))
        } else {
            m
        }
    });
    let mut tx = client.transaction()?;
    let keys = outbox.enqueue_all(&mut tx, messages)?;
    assert!(outbox.enqueue_all(&mut tx, Vec::new())?.is_empty());
    tx.commit()?;

    assert_eq!(keys.len(), 5);
    assert_eq!(
        [&keys[0], &keys[2], &keys[4]],
        ["given-0", "given-2", "given-4"]
    );
    assert!(is_uuid_v7(&keys[1]) && is_uuid_v7(&keys[3]), "{keys:?}");
    let expected: Vec<(String, String)> = keys
        .iter()
        .enumerate()
        .map(|(i, k)| (k.clone(), format!("p{i}")))
        .collect();
    assert_eq!(stored(&mut client, &outbox), expected);

    let sql = format!("SELECT headers FROM {} ORDER BY id", quoted(&outbox));
    let headers: Vec<Vec<String>> = client.query(&sql, &[])?.iter().map(|r| r.get(0)).collect();
    for (i, flat) in headers.iter().enumerate() {
        let want: Vec<String> = (0..i)
            .flat_map(|h| [format!("h{h}"), format!("{i}.{h}")])
            .collect();
        assert_eq!(flat, &want, "headers of message {i}");
    }
    Ok(())
}

#[test]
fn enqueue_all_writes_nothing_when_a_key_exists() -> TestResult {
    let (outbox, mut client) = common::outbox("all_dup");
    enqueue_keys(&outbox, &mut client, "t", &["old", "older"])?;

    let mut tx = client.transaction()?;
    let batch = |keys: &[&str]| -> Vec<Message> {
        keys.iter()
            .map(|k| Message::new("t", "new").key(*k))
            .collect()
    };
    let e = outbox
        .enqueue_all(&mut tx, batch(&["new-1", "old", "new-2"]))
        .unwrap_err();
    assert!(e.is_duplicate_key(), "{e}");
    assert_eq!(e.duplicate_keys(), ["old"]);
    assert_eq!(rows_in(&mut tx, &outbox), 2);

    let e = outbox
        .enqueue_all(&mut tx, batch(&["older", "new-1", "old"]))
        .unwrap_err();
    let mut named = e.duplicate_keys().to_vec();
    named.sort();
    assert_eq!(named, ["old", "older"]);
    assert_eq!(rows_in(&mut tx, &outbox), 2);

    let keys = outbox.enqueue_all(&mut tx, batch(&["new-1", "new-2"]))?;
    assert_eq!(keys, ["new-1", "new-2"]);
    tx.commit()?;
    assert_eq!(
        stored(&mut client, &outbox),
        pairs(&[
            ("old", "old"),
            ("older", "older"),
            ("new-1", "new"),
            ("new-2", "new")
        ])
    );
    Ok(())
}

#[test]
fn enqueue_all_rejects_a_key_repeated_within_the_batch() -> TestResult {
    let (outbox, mut client) = common::outbox("all_rep");
    let mut tx = client.transaction()?;
    let e = outbox
        .enqueue_all(
            &mut tx,
            ["a", "b", "a"].map(|k| Message::new("t", k).key(k)),
        )
        .unwrap_err();
    assert!(e.is_duplicate_key(), "{e}");
    assert_eq!(e.duplicate_keys(), ["a"]);
    assert_eq!(rows_in(&mut tx, &outbox), 0);
    outbox.enqueue_all(&mut tx, ["a", "b"].map(|k| Message::new("t", k).key(k)))?;
    tx.commit()?;
    assert_eq!(
        stored(&mut client, &outbox),
        pairs(&[("a", "a"), ("b", "b")])
    );
    Ok(())
}

/// Every stored field of every row, in id order; for `k3` its absolute available_at, for
/// the others how long after enqueue they became due.
fn columns(client: &mut Client, outbox: &Outbox) -> Vec<String> {
    let sql = format!(
        "SELECT format('%L %L %L %L %L %L %L %L %L %L', key, topic, aggregate_key, payload,
                       content_type, headers, max_attempts, status, attempts,
                       CASE WHEN key = 'k3' THEN available_at::text
                            ELSE (available_at - created_at)::text END)
         FROM {} ORDER BY id",
        quoted(outbox)
    );
    let rows = client.query(&sql, &[]).expect("rows");
    rows.iter().map(|r| r.get(0)).collect()
}

#[test]
fn a_large_batch_due_at_once_is_copied_with_every_field() -> TestResult {
    let messages = || {
        (0..100).map(|i| {
            let m =
                Message::new(format!("topic-{}", i % 3), vec![i as u8; i]).key(format!("k-{i:03}"));
            let m = (0..i % 4).fold(m, |m, h| m.header(format!("h{h}"), format!("{i}")));
            match i % 5 {
                0 => m.aggregate_key(format!("agg-{}", i % 7)).max_attempts(3),
                1 => m.content_type("application/json"),
                2 => m.content_type(""),
                _ => m,
            }
        })
    };
    let (one_by_one, mut client) = common::outbox("copy_ref");
    let mut tx = client.transaction()?;
    for message in messages() {
        one_by_one.enqueue(&mut tx, message)?;
    }
    tx.commit()?;
    let (copied, _) = common::outbox("copied");
    let mut tx = client.transaction()?;
    let keys = copied.enqueue_all(&mut tx, messages())?;
    tx.commit()?;
    assert_eq!(keys[0], "k-000");
    assert_eq!(keys.len(), 100);
    let expected = columns(&mut client, &one_by_one);
    assert_eq!(expected.len(), 100);
    assert_eq!(columns(&mut client, &copied), expected);
    Ok(())
}

#[test]
fn a_large_batch_with_an_existing_key_writes_nothing() -> TestResult {
    let (outbox, mut client) = common::outbox("copy_dup");
    enqueue_keys(&outbox, &mut client, "t", &["k-050"])?;
    let batch = |skip: Option<usize>| {
        (0..100)
            .filter(move |i| Some(*i) != skip)
            .map(|i| Message::new("t", "new").key(format!("k-{i:03}")))
    };
    let mut tx = client.transaction()?;
    let e = outbox.enqueue_all(&mut tx, batch(None)).unwrap_err();
    assert!(e.is_duplicate_key(), "{e}");
    assert_eq!(e.duplicate_keys(), ["k-050"]);
    // The transaction is still usable and holds nothing of the batch.
    assert_eq!(rows_in(&mut tx, &outbox), 1);
    let rest = outbox.enqueue_all(&mut tx, batch(Some(50)))?;
    assert_eq!(rest.len(), 99);
    tx.commit()?;
    assert_eq!(count(&mut client, &outbox, "true"), 100);
    Ok(())
}

#[test]
fn enqueue_all_stores_fields_like_enqueue() -> TestResult {
    let tomorrow = SystemTime::now().duration_since(UNIX_EPOCH)?.as_secs() + 86_400;
    let at = UNIX_EPOCH + Duration::from_secs(tomorrow);
    let messages = || {
        vec![
            Message::new("a", vec![1u8, 2, 3])
                .key("k1")
                .aggregate_key("agg")
                .content_type("application/json")
                .header("h", "v")
                .header("h2", "")
                .max_attempts(4)
                .delay(Duration::from_secs(60)),
            Message::new("b", "plain").key("k2"),
            Message::new("c", "at")
                .key("k3")
                .available_at(at)
                .header("only", "one"),
            Message::new("d", "")
                .key("k4")
                .max_attempts(1)
                .content_type(""),
        ]
    };
    let (one_by_one, mut client) = common::outbox("one_by_one");
    let mut tx = client.transaction()?;
    for message in messages() {
        one_by_one.enqueue(&mut tx, message)?;
    }
    tx.commit()?;
    let (at_once, _) = common::outbox("at_once");
    let mut tx = client.transaction()?;
    at_once.enqueue_all(&mut tx, messages())?;
    tx.commit()?;

    let expected = columns(&mut client, &one_by_one);
    assert_eq!(expected.len(), 4);
    assert_eq!(columns(&mut client, &at_once), expected);
    Ok(())
}

#[test]
fn enqueue_all_racing_a_concurrent_producer_keeps_its_row() -> TestResult {
    racing_a_concurrent_producer(0)
}

#[test]
fn a_copied_batch_racing_a_concurrent_producer_keeps_its_row() -> TestResult {
    racing_a_concurrent_producer(100)
}

/// A batch of "mine", "shared" and `padding` more, while another producer has inserted
/// "shared" and not committed yet.
fn racing_a_concurrent_producer(padding: usize) -> TestResult {
    let (outbox, mut client) = common::outbox("race");
    // Another producer has inserted "shared" and not yet committed.
    let mut other = common::client();
    let mut other_tx = other.transaction()?;
    outbox.enqueue(&mut other_tx, Message::new("t", "theirs").key("shared"))?;

    let pid: i32 = client.query_one("SELECT pg_backend_pid()", &[])?.get(0);
    let racer = {
        let outbox = outbox.clone();
        thread::spawn(move || -> Result<_, Error> {
            let mut tx = client.transaction()?;
            let batch = ["mine".to_owned(), "shared".to_owned()]
                .into_iter()
                .chain((0..padding).map(|i| format!("pad-{i}")))
                .map(|k| Message::new("t", "mine").key(k));
            let result = outbox.enqueue_all(&mut tx, batch);
            tx.commit()?; // the caller carries on with its transaction
            Ok(result)
        })
    };
    let mut watcher = common::client();
    wait_until("the batch waits for the other producer's key", || {
        let sql = "SELECT wait_event_type IS NOT DISTINCT FROM 'Lock' FROM pg_stat_activity
                   WHERE pid = $1";
        watcher.query_one(sql, &[&pid]).expect("activity").get(0)
    });
    other_tx.commit()?;
    let result = racer.join().expect("racer panicked")?;

    assert_eq!(
        stored(&mut watcher, &outbox),
        pairs(&[("shared", "theirs")]),
        "the other producer's committed row must survive, and nothing of the batch"
    );
    let e = result.unwrap_err();
    assert!(e.is_duplicate_key(), "{e}");
    assert_eq!(e.duplicate_keys(), ["shared"]);
    Ok(())
}

// ---- validation ----

#[test]
fn over_long_fields_are_rejected_and_nothing_is_written() -> TestResult {
    let long = "x".repeat(256);
    let ok = || Message::new("t", "p");
    assert_rejected(vec![
        ("topic", Message::new(long.clone(), "p")),
        ("topic", Message::new("é".repeat(128), "p")), // 128 characters, 256 bytes
        ("key", ok().key(long.clone())),
        ("content type", ok().content_type(long.clone())),
        ("header name", ok().header(long.clone(), "v")),
        // Beyond what a B-tree index entry holds comfortably: refused before the insert
        // could abort the caller's transaction.
        (
            "aggregate key",
            ok().aggregate_key("a".repeat(MAX_INDEXED_KEY + 1)),
        ),
    ])
}

#[test]
fn an_aggregate_key_of_the_largest_size_is_stored_and_claimed() -> TestResult {
    let (outbox, mut client) = common::outbox("agg_max");
    let aggregate = "a".repeat(MAX_INDEXED_KEY);
    let mut tx = client.transaction()?;
    outbox.enqueue(
        &mut tx,
        Message::new(SEND, "p")
            .key("k")
            .aggregate_key(aggregate.as_str()),
    )?;
    tx.commit()?;
    assert_eq!(settle(&outbox, &mut client)?, (1, 0));
    Ok(())
}

#[test]
fn empty_topic_zero_max_attempts_and_nul_are_rejected() -> TestResult {
    let ok = || Message::new("t", "p");
    assert_rejected(vec![
        ("topic", Message::new("", "p")),
        ("max_attempts", ok().max_attempts(0)),
        ("header value", ok().header("h", "a\0b")),
    ])
}

#[test]
fn a_header_given_twice_and_headers_no_amqp_frame_holds_are_refused_at_enqueue() -> TestResult {
    let ok = || Message::new("t", "p");
    // Under the byte limit of names and values, but about 140 KB as AMQP properties: the
    // broker would close the channel at every attempt.
    let many = (0..13_000).fold(ok(), |m, i| m.header(format!("{i:x}"), "v"));
    assert_rejected(vec![
        (
            "header name",
            ok().header("tenant", "a").header("tenant", "b"),
        ),
        ("headers", many),
    ])
}

#[test]
fn fields_of_255_bytes_are_accepted() -> TestResult {
    let (outbox, mut client) = common::outbox("max_len");
    let max = "y".repeat(255);
    let message = Message::new(max.clone(), "p")
        .key(max.clone())
        .content_type(max.clone())
        .header(max.clone(), "v");
    let mut tx = client.transaction()?;
    outbox.enqueue(&mut tx, message)?;
    tx.commit()?;
    let mut seen = Vec::new();
    outbox.process(&mut client, 1, |_, record| {
        seen.push(record.clone());
        Ok(())
    })?;
    assert_eq!(seen.len(), 1);
    let record = &seen[0];
    assert_eq!((&record.topic, &record.key), (&max, &max));
    assert_eq!(record.content_type.as_ref(), Some(&max));
    assert_eq!(record.headers, [(max.clone(), "v".to_owned())]);
    Ok(())
}

// ---- schema and migrations ----

#[test]
fn migrate_twice_is_harmless() -> TestResult {
    let (outbox, mut client) = common::outbox("twice");
    enqueue_keys(&outbox, &mut client, "t", &["kept"])?;
    outbox.migrate(&mut client)?;
    outbox.migrate(&mut client)?;
    assert_eq!(stored(&mut client, &outbox), pairs(&[("kept", "kept")]));
    let migrations = format!("\"{}_migrations\"", outbox.table());
    let sql = format!("SELECT count(*) = count(DISTINCT version) FROM {migrations}");
    assert!(client.query_one(&sql, &[])?.get::<_, bool>(0));
    Ok(())
}

#[test]
fn migrate_from_ten_threads_at_once() -> TestResult {
    let schema = unique_name("conc");
    let outbox = Outbox::new(&format!("{schema}.events"))?;
    let barrier = Arc::new(Barrier::new(10));
    let threads: Vec<_> = (0..10)
        .map(|_| {
            let (outbox, barrier) = (outbox.clone(), barrier.clone());
            thread::spawn(move || {
                let mut client = common::client();
                barrier.wait();
                outbox.migrate(&mut client)
            })
        })
        .collect();
    for thread in threads {
        thread.join().expect("migrating thread panicked")?;
    }

    // The same objects as one migration alone creates, in a schema of its own.
    let mut client = common::client();
    let reference = unique_name("conc_ref");
    Outbox::new(&format!("{reference}.events"))?.migrate(&mut client)?;
    let got = schema_snapshot(&mut client, &schema);
    assert_eq!(got, schema_snapshot(&mut client, &reference));
    for table in ["events r", "events_inbox r", "events_migrations r"] {
        assert!(
            got.iter().any(|l| l == table),
            "{table} missing from {got:#?}"
        );
    }

    let versions = |client: &mut Client, schema: &str| -> Vec<i32> {
        let sql = format!("SELECT version FROM \"{schema}\".events_migrations ORDER BY version");
        let rows = client.query(&sql, &[]).expect("versions");
        rows.iter().map(|r| r.get(0)).collect()
    };
    let applied = versions(&mut client, &schema);
    assert!(!applied.is_empty());
    assert_eq!(applied, (1..=applied.len() as i32).collect::<Vec<_>>());
    assert_eq!(applied, versions(&mut client, &reference));
    let counters = |client: &mut Client, schema: &str| -> i64 {
        let sql = format!("SELECT count(*) FROM \"{schema}\".events_counts");
        client.query_one(&sql, &[]).expect("counters").get(0)
    };
    assert_eq!(
        counters(&mut client, &schema),
        counters(&mut client, &reference)
    );
    Ok(())
}

#[test]
fn migrate_different_tables_into_one_new_schema_at_once() -> TestResult {
    let schema = unique_name("shared");
    let barrier = Arc::new(Barrier::new(10));
    let threads: Vec<_> = (0..10)
        .map(|i| {
            let outbox = Outbox::new(&format!("{schema}.t{i}")).expect("valid name");
            let barrier = barrier.clone();
            thread::spawn(move || {
                let mut client = common::client();
                barrier.wait();
                outbox.migrate(&mut client)
            })
        })
        .collect();
    for thread in threads {
        thread.join().expect("migrating thread panicked")?;
    }
    let mut client = common::client();
    for i in 0..10 {
        assert!(exists(&mut client, &format!("\"{schema}\".t{i}")));
    }
    Ok(())
}

#[test]
fn sql_is_the_ddl_migrate_applies() -> TestResult {
    let by_hand = unique_name("ddl");
    let outbox = Outbox::new(&format!("{by_hand}.events"))?;
    let ddl = outbox.sql();
    assert!(
        ddl.contains(&format!("CREATE TABLE \"{by_hand}\".\"events\"")),
        "{ddl}"
    );
    assert!(
        ddl.contains(&format!("\"{by_hand}\".\"events_inbox\"")),
        "{ddl}"
    );
    assert!(ddl.matches("CREATE INDEX").count() >= 2, "{ddl}");

    let mut client = common::client();
    client.batch_execute(&ddl)?;
    let migrated = unique_name("ddl_ref");
    Outbox::new(&format!("{migrated}.events"))?.migrate(&mut client)?;
    assert_eq!(
        schema_snapshot(&mut client, &by_hand),
        schema_snapshot(&mut client, &migrated)
    );
    // The DDL records its versions, so migrate() at a later start has nothing to do.
    outbox.migrate(&mut client)?;
    let versions: i64 = client
        .query_one(
            &format!("SELECT count(*) FROM \"{by_hand}\".\"events_migrations\""),
            &[],
        )?
        .get(0);
    assert_eq!(versions, shipped_migrations(&outbox));

    // And the outbox works on it.
    enqueue_keys(&outbox, &mut client, SEND, &["a", "b"])?;
    assert_eq!(settle(&outbox, &mut client)?, (2, 0));
    assert_eq!(outbox.stats(&mut client)?.sent, 2);
    Ok(())
}

#[test]
fn schema_qualified_table_migrates_enqueues_and_counts() -> TestResult {
    let schema = unique_name("custom");
    let table = unique_name("events");
    let outbox = Outbox::new(&format!("{schema}.{table}"))?;
    assert_eq!(outbox.table(), format!("{schema}.{table}"));
    let mut client = common::client();
    outbox.migrate(&mut client)?;

    let sql = "SELECT schemaname::text FROM pg_tables WHERE tablename = ANY($1) ORDER BY 1";
    let names = [
        table.clone(),
        format!("{table}_inbox"),
        format!("{table}_migrations"),
    ];
    let schemas: Vec<String> = client
        .query(sql, &[&&names[..]])?
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(schemas, vec![schema.clone(); 3]);

    let mut tx = client.transaction()?;
    outbox.enqueue(&mut tx, Message::new(SEND, "a").aggregate_key("agg"))?;
    outbox.enqueue_all(&mut tx, [Message::new(SEND, "b"), Message::new(DIE, "c")])?;
    assert!(outbox.dedupe(&mut tx, "consumer", "key")?);
    tx.commit()?;
    assert_eq!(outbox.stats(&mut client)?.pending, 3);
    assert_eq!(settle(&outbox, &mut client)?, (2, 1));
    let stats = outbox.stats(&mut client)?;
    assert_eq!((stats.pending, stats.sent, stats.dead), (0, 2, 1));
    Ok(())
}

#[test]
fn mixed_case_table_names_are_kept_by_quoting() -> TestResult {
    let name = unique_name("MixedCase");
    let outbox = Outbox::new(&name)?;
    let mut client = common::client();
    outbox.migrate(&mut client)?;
    assert!(exists(&mut client, &format!("\"{name}\"")));
    assert!(exists(&mut client, &format!("\"{name}_inbox\"")));
    assert!(
        !exists(&mut client, &name),
        "an unquoted (lower-cased) copy exists"
    );
    enqueue_keys(&outbox, &mut client, SEND, &["k"])?;
    assert_eq!(settle(&outbox, &mut client)?, (1, 0));
    Ok(())
}

#[test]
fn injection_shaped_table_names_are_rejected() -> TestResult {
    let mut client = common::client();
    let sentinel = unique_name("sentinel");
    client.batch_execute(&format!("CREATE TABLE \"{sentinel}\" (id int)"))?;
    let bad = [
        format!("x; DROP TABLE {sentinel}"),
        format!("x; DROP TABLE \"{sentinel}\"; --"),
        "\"a\"".to_owned(),
        String::new(),
        "a.b.c".to_owned(),
        "a".repeat(53),
    ];
    for name in &bad {
        let e = Outbox::new(name).unwrap_err();
        assert!(e.is_invalid_input(), "{name:?}: {e}");
        let e = Outbox::builder().table(name.clone()).build().unwrap_err();
        assert!(e.is_invalid_input(), "{name:?}: {e}");
    }
    assert!(exists(&mut client, &format!("\"{sentinel}\"")));
    let derived: Vec<String> = ["", "_inbox", "_migrations"]
        .iter()
        .flat_map(|suffix| bad.iter().map(move |name| format!("{name}{suffix}")))
        .collect();
    let created: i64 = client
        .query_one(
            "SELECT count(*) FROM pg_class WHERE relname::text = ANY($1)",
            &[&derived],
        )?
        .get(0);
    assert_eq!(created, 0);
    Ok(())
}

#[test]
fn longest_valid_name_migrates_without_truncation() -> TestResult {
    let mut name = unique_name("long");
    name.push_str(&"a".repeat(52 - name.len()));
    let outbox = Outbox::new(&name)?;
    let mut client = common::client();
    outbox.migrate(&mut client)?;
    for suffix in ["", "_inbox", "_migrations"] {
        let relation = format!("\"{name}{suffix}\"");
        assert!(exists(&mut client, &relation), "{relation} missing");
    }
    enqueue_keys(&outbox, &mut client, "t", &["k"])?;
    assert_eq!(outbox.stats(&mut client)?.pending, 1);
    Ok(())
}

// ---- consume side ----

#[test]
fn dedupe_is_fresh_once_per_consumer() -> TestResult {
    let (outbox, mut client) = common::outbox("dedupe");
    let mut tx = client.transaction()?;
    assert!(outbox.dedupe(&mut tx, "invoicing", "m1")?);
    assert!(!outbox.dedupe(&mut tx, "invoicing", "m1")?);
    assert!(outbox.dedupe(&mut tx, "invoicing", "m2")?);
    tx.commit()?;

    let mut tx = client.transaction()?;
    assert!(!outbox.dedupe(&mut tx, "invoicing", "m1")?);
    assert!(outbox.dedupe(&mut tx, "shipping", "m1")?);
    assert!(!outbox.dedupe(&mut tx, "shipping", "m1")?);
    tx.commit()?;
    Ok(())
}

#[test]
fn rolled_back_dedupe_is_forgotten() -> TestResult {
    let (outbox, mut client) = common::outbox("dedupe_rb");
    let mut tx = client.transaction()?;
    assert!(outbox.dedupe(&mut tx, "invoicing", "m1")?);
    tx.rollback()?;

    let mut tx = client.transaction()?;
    assert!(outbox.dedupe(&mut tx, "invoicing", "m1")?);
    tx.commit()?;
    let mut tx = client.transaction()?;
    assert!(!outbox.dedupe(&mut tx, "invoicing", "m1")?);
    Ok(())
}

#[test]
fn dedupe_rejects_empty_and_nul_and_stays_usable() -> TestResult {
    let (outbox, mut client) = common::outbox("dedupe_bad");
    let mut tx = client.transaction()?;
    for (field, consumer, key) in [
        ("consumer", "", "k"),
        ("key", "c", ""),
        ("consumer", "a\0b", "k"),
        ("key", "c", "k\0"),
        ("consumer", &"c".repeat(MAX_SHORT_STRING + 1), "k"),
        ("key", "c", &"k".repeat(MAX_INDEXED_KEY + 1)),
    ] {
        let e = outbox.dedupe(&mut tx, consumer, key).unwrap_err();
        assert_eq!(field_of(&e), field, "{e}");
    }
    assert!(outbox.dedupe(&mut tx, "c", "k")?);
    tx.commit()?;
    let inbox = format!("\"{}_inbox\"", outbox.table());
    let sql = format!("SELECT consumer || '/' || key FROM {inbox}");
    let rows: Vec<String> = client.query(&sql, &[])?.iter().map(|r| r.get(0)).collect();
    assert_eq!(rows, ["c/k"]);
    Ok(())
}

// ---- operate ----

#[test]
fn purge_sent_leaves_pending_and_dead_rows() -> TestResult {
    if common::plain_only("a purge of sent rows by age drops whole partitions there") {
        return Ok(());
    }
    let (outbox, mut client) = common::outbox("purge_sent");
    enqueue_keys(&outbox, &mut client, SEND, &["s1", "s2", "s3"])?;
    enqueue_keys(&outbox, &mut client, DIE, &["d1"])?;
    assert_eq!(settle(&outbox, &mut client)?, (3, 1));
    enqueue_keys(&outbox, &mut client, SEND, &["p1"])?;

    let hour = Duration::from_secs(3600);
    assert_eq!(
        outbox.purge(
            &mut client,
            Rows::Sent.matching(Filter::new().older_than(hour))
        )?,
        0
    );
    assert_eq!(count(&mut client, &outbox, "status = 'sent'"), 3);

    let zero = Duration::ZERO;
    assert_eq!(
        outbox.purge(
            &mut client,
            Rows::Sent.matching(Filter::new().older_than(zero))
        )?,
        3
    );
    assert_eq!(count(&mut client, &outbox, "status = 'sent'"), 0);
    assert_eq!(row_state(&mut client, &outbox, "p1").0, "pending");
    assert_eq!(row_state(&mut client, &outbox, "d1").0, "dead");
    let stats = outbox.stats(&mut client)?;
    assert_eq!((stats.pending, stats.sent, stats.dead), (1, 0, 1));
    Ok(())
}

#[test]
fn purge_dead_leaves_pending_and_sent_rows() -> TestResult {
    let (outbox, mut client) = common::outbox("purge_dead");
    enqueue_keys(&outbox, &mut client, DIE, &["d1", "d2"])?;
    enqueue_keys(&outbox, &mut client, SEND, &["s1"])?;
    assert_eq!(settle(&outbox, &mut client)?, (1, 2));
    enqueue_keys(&outbox, &mut client, SEND, &["p1"])?;

    let hour = Duration::from_secs(3600);
    assert_eq!(
        outbox.purge(
            &mut client,
            Rows::Dead.matching(Filter::new().older_than(hour))
        )?,
        0
    );
    let zero = Duration::ZERO;
    assert_eq!(
        outbox.purge(
            &mut client,
            Rows::Dead.matching(Filter::new().older_than(zero))
        )?,
        2
    );
    assert_eq!(count(&mut client, &outbox, "status = 'dead'"), 0);
    assert_eq!(row_state(&mut client, &outbox, "p1").0, "pending");
    assert_eq!(row_state(&mut client, &outbox, "s1").0, "sent");
    let stats = outbox.stats(&mut client)?;
    assert_eq!((stats.pending, stats.sent, stats.dead), (1, 1, 0));
    assert!(outbox.dead_letters(&mut client, 10)?.is_empty());
    Ok(())
}

#[test]
fn purge_deletes_more_than_one_batch() -> TestResult {
    if common::plain_only("a purge of sent rows by age drops whole partitions there") {
        return Ok(());
    }
    let (outbox, mut client) = common::outbox("purge_many");
    // Thousands of one-row handler transactions; durability is beside the point here.
    client.batch_execute("SET synchronous_commit = off")?;
    const N: usize = 2_345;
    let mut tx = client.transaction()?;
    outbox.enqueue_all(&mut tx, (0..N).map(|i| Message::new(SEND, i.to_string())))?;
    tx.commit()?;
    assert_eq!(settle(&outbox, &mut client)?, (N, 0));
    enqueue_keys(&outbox, &mut client, SEND, &["pending"])?;
    assert_eq!(outbox.stats(&mut client)?.sent, N as u64);

    let zero = Duration::ZERO;
    assert_eq!(
        outbox.purge(
            &mut client,
            Rows::Sent.matching(Filter::new().older_than(zero))
        )?,
        N as u64
    );
    assert_eq!(count(&mut client, &outbox, "true"), 1);
    let stats = outbox.stats(&mut client)?;
    assert_eq!((stats.sent, stats.pending), (0, 1));
    Ok(())
}

#[test]
fn stats_count_every_state() -> TestResult {
    let (outbox, mut client) = common::outbox("stats");
    let empty = common::stats(&outbox, &mut client);
    assert_eq!(
        (
            empty.pending,
            empty.due,
            empty.in_flight,
            empty.sent,
            empty.dead
        ),
        (0, 0, 0, 0, 0)
    );
    assert_eq!(empty.oldest_pending_age, None);

    enqueue_keys(&outbox, &mut client, SEND, &["s1", "s2"])?;
    enqueue_keys(&outbox, &mut client, DIE, &["d1"])?;
    assert_eq!(settle(&outbox, &mut client)?, (2, 1));

    enqueue_keys(&outbox, &mut client, SEND, &["flying"])?;
    let held = Held::next(&outbox)?;
    assert_eq!(held.key, "flying");

    enqueue_keys(&outbox, &mut client, SEND, &["p1", "p2"])?;
    let mut tx = client.transaction()?;
    let later = Message::new(SEND, "p3").delay(Duration::from_secs(3600));
    outbox.enqueue(&mut tx, later)?;
    tx.commit()?;

    let stats = common::stats(&outbox, &mut client);
    let sql = format!(
        "SELECT extract(epoch FROM now() - min(created_at))::float8 FROM {}
         WHERE status = 'pending'",
        quoted(&outbox)
    );
    let age_after: f64 = client.query_one(&sql, &[])?.get(0);
    assert_eq!(
        (
            stats.pending,
            stats.due,
            stats.in_flight,
            stats.sent,
            stats.dead
        ),
        (3, 2, 1, 2, 1),
        "{stats:?}"
    );
    let age = stats.oldest_pending_age.expect("rows are pending");
    assert!(
        age.as_secs_f64() <= age_after + 1e-3,
        "{age:?} vs {age_after}"
    );

    assert_eq!(held.finish()?.processed, 1);
    let stats = common::stats(&outbox, &mut client);
    assert_eq!(
        (
            stats.pending,
            stats.due,
            stats.in_flight,
            stats.sent,
            stats.dead
        ),
        (3, 2, 0, 3, 1),
        "{stats:?}"
    );
    Ok(())
}

#[test]
fn a_row_whose_lease_ran_out_is_due_again() -> TestResult {
    let outbox = common::builder()
        .table(unique_name("lease"))
        .lease(Duration::from_secs(1))
        .build()?;
    let mut client = common::client();
    outbox.migrate(&mut client)?;
    enqueue_keys(&outbox, &mut client, SEND, &["k"])?;
    let held = Held::next(&outbox)?;
    wait_until("the lease runs out", || {
        outbox.stats(&mut client).expect("stats").in_flight == 0
    });

    let stats = outbox.stats(&mut client)?;
    assert_eq!(
        (stats.pending, stats.due, stats.in_flight),
        (1, 1, 0),
        "a claimable row is not counted as due: {stats:?}"
    );
    // It is indeed claimable: another worker takes it, and the first one's late success
    // changes nothing. A lease that ran out is no verdict: the second claim is still the
    // first attempt.
    let mut attempts = Vec::new();
    outbox.process(&mut client, 10, |_, record| {
        attempts.push(record.attempt);
        Ok(())
    })?;
    assert_eq!(attempts, [1]);
    let late = held.finish()?;
    assert_eq!((late.processed, late.lease_lost), (0, 1));
    assert_eq!(row_state(&mut client, &outbox, "k"), ("sent".into(), 1));
    assert_eq!(outbox.stats(&mut client)?.sent, 1);
    Ok(())
}

#[test]
fn oldest_pending_age_is_none_when_nothing_is_pending() -> TestResult {
    let (outbox, mut client) = common::outbox("age");
    enqueue_keys(&outbox, &mut client, SEND, &["s"])?;
    enqueue_keys(&outbox, &mut client, DIE, &["d"])?;
    assert!(common::stats(&outbox, &mut client)
        .oldest_pending_age
        .is_some());
    assert_eq!(settle(&outbox, &mut client)?, (1, 1));
    let stats = common::stats(&outbox, &mut client);
    assert_eq!((stats.pending, stats.sent, stats.dead), (0, 1, 1));
    assert_eq!(stats.oldest_pending_age, None);
    Ok(())
}

#[test]
fn dead_letters_come_oldest_first_with_their_error() -> TestResult {
    let (outbox, mut client) = common::outbox("dead");
    enqueue_keys(&outbox, &mut client, DIE, &["a", "b", "c"])?;
    enqueue_keys(&outbox, &mut client, SEND, &["ok"])?;
    assert_eq!(settle(&outbox, &mut client)?, (1, 3));
    // "a" dies again, last: now it is the newest dead letter although its id is the oldest.
    assert_eq!(outbox.redrive(&mut client, Filter::new().key("a"))?, 1);
    assert_eq!(settle(&outbox, &mut client)?, (0, 1));

    let keys = |letters: &[postgres_outbox::DeadLetter]| -> Vec<String> {
        letters.iter().map(|l| l.record.key.clone()).collect()
    };
    let letters = outbox.dead_letters(&mut client, 10)?;
    assert_eq!(keys(&letters), ["b", "c", "a"]);
    for letter in &letters {
        let key = &letter.record.key;
        assert_eq!(
            letter.last_error.as_deref(),
            Some(format!("boom {key}").as_str())
        );
        assert_eq!(letter.record.topic, DIE);
        assert_eq!(letter.record.payload, key.as_bytes());
        assert_eq!(letter.record.attempt, 1);
        assert!(letter.dead_at >= letter.record.created_at, "{letter:?}");
    }
    assert!(letters[0].dead_at <= letters[1].dead_at && letters[1].dead_at <= letters[2].dead_at);
    assert_eq!(keys(&outbox.dead_letters(&mut client, 2)?), ["b", "c"]);
    assert!(outbox.dead_letters(&mut client, 0)?.is_empty());
    Ok(())
}

#[test]
fn redrive_revives_the_chosen_keys_then_all() -> TestResult {
    let (outbox, mut client) = common::outbox("redrive");
    enqueue_keys(&outbox, &mut client, DIE, &["a", "b", "c"])?;
    enqueue_keys(&outbox, &mut client, SEND, &["ok"])?;
    assert_eq!(settle(&outbox, &mut client)?, (1, 3));

    // "ok" is sent, not dead: a redrive by key leaves it alone.
    assert_eq!(
        outbox.redrive(&mut client, Filter::new().keys(["b", "ok"]))?,
        1
    );
    assert_eq!(row_state(&mut client, &outbox, "b"), ("pending".into(), 0));
    assert_eq!(row_state(&mut client, &outbox, "a"), ("dead".into(), 1));
    assert_eq!(row_state(&mut client, &outbox, "c"), ("dead".into(), 1));
    assert_eq!(row_state(&mut client, &outbox, "ok"), ("sent".into(), 1));
    let stats = common::stats(&outbox, &mut client);
    assert_eq!((stats.pending, stats.due, stats.dead), (1, 1, 2));

    assert_eq!(outbox.redrive(&mut client, Filter::new())?, 2);
    for key in ["a", "b", "c"] {
        assert_eq!(row_state(&mut client, &outbox, key), ("pending".into(), 0));
    }
    assert_eq!(row_state(&mut client, &outbox, "ok"), ("sent".into(), 1));
    assert_eq!(outbox.redrive(&mut client, Filter::new())?, 0);
    let stats = common::stats(&outbox, &mut client);
    assert_eq!((stats.pending, stats.due, stats.dead), (3, 3, 0));

    // Revived rows are claimed again, as a first attempt.
    let mut attempts = Vec::new();
    outbox.process(&mut client, 10, |_, record| {
        attempts.push(record.attempt);
        Ok(())
    })?;
    assert_eq!(attempts, [1, 1, 1]);
    Ok(())
}

// ---- errors ----

fn assert_not_migrated(outbox: &Outbox, result: Result<impl std::fmt::Debug, Error>) {
    let e = result.expect_err("a table that was never migrated");
    assert!(e.is_not_migrated(), "{e}");
    let text = e.to_string();
    assert!(text.contains("migrate"), "{text}");
    assert!(text.contains(outbox.table()), "{text}");
    // Its missing table, function or schema.
    assert!(
        ["42P01", "42883", "3F000"]
            .iter()
            .any(|code| text.contains(code)),
        "{text}"
    );
}

fn never_migrated(outbox: &Outbox) {
    let mut client = common::client();
    let mut tx = client.transaction().expect("begin");
    assert_not_migrated(outbox, outbox.enqueue(&mut tx, Message::new("t", "p")));
    drop(tx);
    let mut tx = client.transaction().expect("begin");
    assert_not_migrated(
        outbox,
        outbox.enqueue_all(&mut tx, [Message::new("t", "p")]),
    );
    drop(tx);
    let mut tx = client.transaction().expect("begin");
    assert_not_migrated(outbox, outbox.dedupe(&mut tx, "c", "k"));
    drop(tx);
    assert_not_migrated(outbox, outbox.stats(&mut client));
    assert_not_migrated(outbox, outbox.dead_letters(&mut client, 10));
    assert_not_migrated(outbox, outbox.redrive(&mut client, Filter::new()));
    let older_than = Duration::ZERO;
    assert_not_migrated(
        outbox,
        outbox.purge(
            &mut client,
            Rows::Sent.matching(Filter::new().older_than(older_than)),
        ),
    );
    assert_not_migrated(outbox, outbox.process(&mut client, 1, |_, _| Ok(())));
}

#[test]
fn a_table_never_migrated_says_to_migrate() -> TestResult {
    never_migrated(&Outbox::new(&unique_name("never"))?);
    Ok(())
}

#[test]
fn a_table_in_a_schema_never_created_says_to_migrate() -> TestResult {
    let outbox = Outbox::new(&format!("{}.events", unique_name("noschema")))?;
    never_migrated(&outbox);
    Ok(())
}

#[test]
fn database_errors_show_their_sqlstate() -> TestResult {
    let name = unique_name("not_an_outbox");
    let mut client = common::client();
    client.batch_execute(&format!("CREATE TABLE \"{name}\" (id int)"))?;
    let outbox = Outbox::new(&name)?;

    // Enqueue goes through the outbox's own function, so here it says "not migrated".
    let mut tx = client.transaction()?;
    let e = outbox.enqueue(&mut tx, Message::new("t", "p")).unwrap_err();
    assert!(e.is_not_migrated(), "{e}");
    drop(tx);
    let e = outbox.redrive(&mut client, Filter::new()).unwrap_err();
    let e2 = outbox.dead_letters(&mut client, 10).unwrap_err();
    for e in [e, e2] {
        assert!(!e.is_not_migrated(), "{e}");
        assert_eq!(e.code(), Some(&SqlState::UNDEFINED_COLUMN), "{e}");
        let message = e
            .as_db_error()
            .expect("a server error")
            .message()
            .to_owned();
        let text = e.to_string();
        assert!(text.contains("42703"), "{text}");
        assert!(text.contains(&message), "{text}");
    }
    Ok(())
}

/// `actual` is within `share` of `expected`.
fn near(actual: u64, expected: u64, share: f64) -> bool {
    (actual as f64 - expected as f64).abs() <= expected as f64 * share
}

#[test]
fn stats_past_their_reading_limit_are_estimates_and_say_so() -> TestResult {
    let (outbox, mut client) = common::outbox("stats_estimated");
    // 3,000 rows due without an aggregate and 2,500 behind the heads of five aggregates:
    // more of each than stats() reads.
    let mut tx = client.transaction()?;
    outbox.enqueue_all(
        &mut tx,
        (0..3000).map(|i| Message::new(SEND, format!("u{i}"))),
    )?;
    outbox.enqueue_all(
        &mut tx,
        (0..2500).map(|i| Message::new(SEND, format!("a{i}")).aggregate_key(format!("a{}", i % 5))),
    )?;
    tx.commit()?;
    // As autovacuum would, soon: the estimates rest on it.
    client.batch_execute(&format!("ANALYZE {}", quoted(&outbox)))?;

    let exact = outbox.stats_exact(&mut client)?;
    assert_eq!(
        (exact.pending, exact.due, exact.blocked, exact.exact),
        (5500, 3005, 2495, true),
        "{exact:?}"
    );
    let estimated = outbox.stats(&mut client)?;
    assert!(!estimated.exact, "{estimated:?}");
    for (what, got, want) in [
        ("pending", estimated.pending, 5500),
        ("due", estimated.due, 3005),
        ("blocked", estimated.blocked, 2495),
    ] {
        assert!(
            near(got, want, 0.02),
            "{what}: {got} for {want}: {estimated:?}"
        );
    }
    assert_eq!(
        (estimated.in_flight, estimated.sent, estimated.dead),
        (0, 0, 0)
    );
    assert!(estimated.oldest_pending_age.is_some() && estimated.oldest_blocked_age.is_some());

    // The backlog grows past what the analyze saw: the index's new pages count for it.
    let mut tx = client.transaction()?;
    outbox.enqueue_all(
        &mut tx,
        (0..3000).map(|i| Message::new(SEND, format!("v{i}"))),
    )?;
    tx.commit()?;
    let grown = outbox.stats(&mut client)?;
    assert!(!grown.exact);
    assert!(near(grown.pending, 8500, 0.2), "{grown:?}");
    assert!(near(grown.due, 6005, 0.2), "{grown:?}");

    // Drained, every count is exact again.
    while outbox.process(&mut client, 1000, |_, _| Ok(()))?.processed > 0 {}
    let drained = common::stats(&outbox, &mut client);
    assert_eq!((drained.pending, drained.sent), (0, 8500));
    Ok(())
}

#[test]
fn the_blocked_age_is_the_heads_even_when_the_rows_behind_it_began_first() -> TestResult {
    let (outbox, mut client) = common::outbox("stats_overlap");
    let mut tx = client.transaction()?;
    for key in ["h", "b-1", "b-2"] {
        outbox.enqueue(&mut tx, Message::new(SEND, key).key(key).aggregate_key("a"))?;
    }
    tx.commit()?;
    // `created_at` is when a transaction began, so rows written behind a head by a
    // transaction that began before the head's are older than it. An hour older here, and
    // the head delayed, so it holds them back.
    client.batch_execute(&format!(
        "UPDATE {t} SET created_at = now() - interval '1 hour' WHERE key <> 'h';
         UPDATE {t} SET available_at = now() + interval '1 hour' WHERE key = 'h'",
        t = quoted(&outbox)
    ))?;
    let stats = common::stats(&outbox, &mut client);
    assert_eq!(
        (stats.pending, stats.blocked, stats.due),
        (3, 2, 0),
        "{stats:?}"
    );
    let blocked = stats.oldest_blocked_age.expect("rows are blocked");
    assert!(
        blocked < Duration::from_secs(600),
        "the head's age: {blocked:?}"
    );
    Ok(())
}

#[test]
fn stats_tell_blocked_rows_from_due_heads() -> TestResult {
    let (outbox, mut client) = common::outbox("stats_blocked");
    let mut tx = client.transaction()?;
    for key in ["a-1", "a-2", "a-3"] {
        outbox.enqueue(&mut tx, Message::new(SEND, key).key(key).aggregate_key("a"))?;
    }
    outbox.enqueue(
        &mut tx,
        Message::new(SEND, "b-1").key("b-1").aggregate_key("b"),
    )?;
    for key in ["u-1", "u-2"] {
        outbox.enqueue(&mut tx, Message::new(SEND, key).key(key))?;
    }
    // A delayed head blocks the message behind it.
    let later = Message::new(SEND, "c-1").key("c-1").aggregate_key("c");
    outbox.enqueue(&mut tx, later.delay(Duration::from_secs(3600)))?;
    outbox.enqueue(
        &mut tx,
        Message::new(SEND, "c-2").key("c-2").aggregate_key("c"),
    )?;
    tx.commit()?;

    let stats = common::stats(&outbox, &mut client);
    assert_eq!(
        (stats.pending, stats.due, stats.blocked, stats.in_flight),
        (8, 4, 3, 0),
        "{stats:?}"
    );
    assert!(stats.oldest_blocked_age.is_some(), "{stats:?}");

    // One call handles the runs of a and b and the unordered rows; c waits for its head.
    let report = outbox.process(&mut client, 100, |_, _| Ok(()))?;
    assert_eq!(report.processed, 6, "{report:?}");
    let stats = common::stats(&outbox, &mut client);
    assert_eq!(
        (stats.pending, stats.due, stats.blocked, stats.sent),
        (2, 0, 1, 6),
        "{stats:?}"
    );
    Ok(())
}

#[test]
fn process_stops_an_aggregate_at_its_first_failure_and_keeps_the_rest_for_later() -> TestResult {
    let (outbox, mut client) = common::outbox("process_runs");
    let mut tx = client.transaction()?;
    for key in ["a-1", "a-2", "a-3"] {
        outbox.enqueue(&mut tx, Message::new(SEND, key).key(key).aggregate_key("a"))?;
    }
    outbox.enqueue(&mut tx, Message::new(SEND, "free").key("free"))?;
    tx.commit()?;
    let mut seen = Vec::new();
    let report = outbox.process(&mut client, 100, |_, record| {
        seen.push(record.key.clone());
        if record.key == "a-2" {
            return Err(HandlerError::transient("not yet"));
        }
        Ok(())
    })?;
    assert_eq!(
        (report.processed, report.retried, report.released),
        (2, 1, 1),
        "{report:?}"
    );
    assert_eq!(seen, ["a-1", "a-2", "free"]);
    assert_eq!(
        row_state(&mut client, &outbox, "a-2"),
        ("pending".into(), 1)
    );
    assert_eq!(
        row_state(&mut client, &outbox, "a-3"),
        ("pending".into(), 0)
    );
    Ok(())
}

/// The DDL of the migrations 0.2.0 shipped (1 to 6), from the script `Outbox::sql` prints.
fn version_0_2_0(outbox: &Outbox) -> String {
    let ddl = outbox.sql();
    let (shipped, _) = ddl
        .split_once("-- 0007_since_0_2_0")
        .expect("the DDL lists its migrations");
    shipped.to_owned()
}

/// A table 0.2.0 made, filled with rows in every state through plain SQL (as its enqueue
/// wrote them), upgrades with nothing lost, and the outbox works on.
#[test]
fn a_0_2_0_table_upgrades_keeping_rows_in_every_state() -> TestResult {
    let outbox = Outbox::new(&unique_name("upgrade"))?;
    let mut client = common::client();
    client.batch_execute(&version_0_2_0(&outbox))?;
    let t = quoted(&outbox);
    client.batch_execute(&format!(
        "INSERT INTO {t} (key, topic, payload) VALUES
             ('u', '{SEND}', 'u'), ('flying', '{SEND}', 'f'), ('sent', '{SEND}', 's'),
             ('dead', '{SEND}', 'd');
         INSERT INTO {t} (key, topic, payload, aggregate_key) VALUES
             ('a-1', '{SEND}', '1', 'a'), ('a-2', '{SEND}', '2', 'a');
         UPDATE {t} SET attempts = 1, available_at = now() + interval '1 hour',
                        lease_until = now() + interval '1 hour' WHERE key = 'flying';
         UPDATE {t} SET status = 'sent', attempts = 1, done_at = now() WHERE key = 'sent';
         UPDATE {t} SET status = 'dead', attempts = 3, done_at = now(), last_error = 'boom'
         WHERE key = 'dead';"
    ))?;

    let name = outbox.table();
    outbox.migrate(&mut client)?;
    let versions: i64 = client
        .query_one(&format!("SELECT count(*) FROM \"{name}_migrations\""), &[])?
        .get(0);
    assert_eq!(versions, shipped_migrations(&outbox));
    assert!(!exists(&mut client, &format!("{name}_due")));
    assert!(!exists(&mut client, &format!("{name}_unordered")));
    assert!(exists(&mut client, &format!("{name}_ready")));
    assert!(exists(&mut client, &format!("{name}_ordered")));
    assert!(!exists(&mut client, &format!("{name}_agg")));
    assert!(exists(&mut client, &format!("{name}_failures")));
    let stats = common::stats(&outbox, &mut client);
    assert_eq!(
        (
            stats.pending,
            stats.in_flight,
            stats.due,
            stats.blocked,
            stats.dead
        ),
        (3, 1, 2, 1, 1),
        "{stats:?}"
    );
    // Keys written before are still duplicates for enqueue, alone or in a batch.
    let mut tx = client.transaction()?;
    let e = outbox
        .enqueue(&mut tx, Message::new(SEND, "again").key("a-1"))
        .unwrap_err();
    assert_eq!(e.duplicate_keys(), ["a-1"]);
    let e = outbox
        .enqueue_all(
            &mut tx,
            [
                Message::new(SEND, "x").key("new"),
                Message::new(SEND, "y").key("u"),
            ],
        )
        .unwrap_err();
    assert_eq!(e.duplicate_keys(), ["u"]);
    outbox.enqueue(
        &mut tx,
        Message::new(SEND, "a-3").key("a-3").aggregate_key("a"),
    )?;
    tx.commit()?;
    assert_eq!(settle(&outbox, &mut client)?, (4, 0));
    assert_eq!(
        row_state(&mut client, &outbox, "flying"),
        ("pending".into(), 1)
    );
    assert_eq!(row_state(&mut client, &outbox, "sent"), ("sent".into(), 1));
    assert_eq!(row_state(&mut client, &outbox, "dead"), ("dead".into(), 3));
    assert_eq!(count(&mut client, &outbox, "true"), 7);
    Ok(())
}

/// A table 0.2.0 made, upgraded, has what a fresh install has, in the catalog's words:
/// tables, columns, defaults, indexes, constraints, functions (bodies, rights, settings and
/// grants) and grants; made partitioned after the upgrade as a fresh table is.
fn upgrades_from_0_2_0_to_a_fresh_install(partition_interval: Option<Duration>) -> TestResult {
    let schema = unique_name("catalog");
    let mut builder = Outbox::builder().table(format!("{schema}.events"));
    if let Some(every) = partition_interval {
        builder = builder.partition_interval(every);
    }
    let outbox = builder.build()?;
    let mut client = common::client();
    outbox.migrate(&mut client)?;
    let fresh = common::catalog(&mut client, &schema);
    assert!(fresh.iter().any(|line| line.contains("events_enqueue(")));
    // Made again under the same names, so every name, lock key and channel is the same.
    client.batch_execute(&format!("DROP SCHEMA \"{schema}\" CASCADE"))?;
    client.batch_execute(&version_0_2_0(&outbox))?;
    outbox.migrate(&mut client)?;
    common::assert_same_catalog(&common::catalog(&mut client, &schema), &fresh);
    Ok(())
}

#[test]
fn a_0_2_0_table_upgrades_to_what_a_fresh_install_makes() -> TestResult {
    upgrades_from_0_2_0_to_a_fresh_install(None)
}

#[test]
fn a_0_2_0_table_upgrades_and_is_made_partitioned_as_a_fresh_one() -> TestResult {
    upgrades_from_0_2_0_to_a_fresh_install(Some(Duration::from_secs(24 * 3600)))
}

/// Builds between 0.2.0 and 0.3.0 recorded migrations numbered 7 to 23, never released,
/// which migration 7 replaces: `migrate` forgets them and runs it, making each of its
/// changes only where it is missing, and the functions as they are today.
#[test]
fn a_table_of_a_build_between_releases_is_brought_to_migration_7() -> TestResult {
    let schema = unique_name("between");
    let outbox = common::builder()
        .table(format!("{schema}.events"))
        .build()?;
    let mut client = common::client();
    outbox.migrate(&mut client)?;
    let today = common::catalog(&mut client, &schema);
    let migrations = format!("\"{schema}\".events_migrations");
    client.batch_execute(&format!(
        "UPDATE {migrations} SET name = '0007_head_flags' WHERE version = 7;
         UPDATE {migrations} SET name = '0008_head_probes_per_aggregate' WHERE version = 8;
         INSERT INTO {migrations} (version, name) VALUES (23, '0023_writes_without_checks');
         DELETE FROM \"{schema}\".events_functions;"
    ))?;
    outbox.migrate(&mut client)?;
    let recorded = |client: &mut Client| -> Result<Vec<(i32, String)>, postgres::Error> {
        Ok(client
            .query(
                &format!("SELECT version, name FROM {migrations} ORDER BY 1"),
                &[],
            )?
            .iter()
            .map(|row| (row.get(0), row.get(1)))
            .collect())
    };
    let after = recorded(&mut client)?;
    assert_eq!(after.len(), 8, "{after:?}");
    assert_eq!(after[6], (7, "0007_since_0_2_0".to_owned()));
    assert_eq!(after[7], (8, "0008_publication_sequence".to_owned()));
    common::assert_same_catalog(&common::catalog(&mut client, &schema), &today);

    // A build of 0.3.0 that applied migration 7 before the sequence was added to the
    // schema: migration 8 brings it.
    client.batch_execute(&format!(
        "DELETE FROM {migrations} WHERE version = 8;
         ALTER TABLE \"{schema}\".events DROP COLUMN sequence;
         DROP TABLE \"{schema}\".events_sequences, \"{schema}\".events_consumed;"
    ))?;
    outbox.migrate(&mut client)?;
    assert_eq!(recorded(&mut client)?, after);
    assert!(exists(&mut client, &format!("{schema}.events_sequences")));
    assert!(exists(&mut client, &format!("{schema}.events_consumed")));
    let columns: i64 = client
        .query_one(
            "SELECT count(*) FROM information_schema.columns
             WHERE table_schema = $1 AND table_name = 'events' AND column_name = 'sequence'",
            &[&schema],
        )?
        .get(0);
    assert_eq!(columns, 1);
    enqueue_keys(&outbox, &mut client, SEND, &["after"])?;
    assert_eq!(settle(&outbox, &mut client)?, (1, 0));
    Ok(())
}

/// A function file is made again when `<table>_functions` records another text at its
/// revision (an edit) or an older revision, and left alone when it records a later one (a
/// newer version's, which an older process migrating on its start must not undo).
#[test]
fn a_function_file_is_made_again_unless_a_later_revision_made_it() -> TestResult {
    let (outbox, mut client) = common::outbox("functions_again");
    let notify = common::quoted_with(&outbox, "_notify");
    let functions = common::quoted_with(&outbox, "_functions");
    let body = |client: &mut Client| -> String {
        let sql = format!("SELECT prosrc FROM pg_proc WHERE oid = '{notify}()'::regprocedure");
        client.query_one(&sql, &[]).expect("the function").get(0)
    };
    let today = body(&mut client);
    let mute = format!(
        "CREATE OR REPLACE FUNCTION {notify}() RETURNS void LANGUAGE plpgsql AS $fn$
         BEGIN END $fn$"
    );
    for (recorded, made_again) in [
        ("revision = revision + 1", false),
        ("revision = revision - 2", true),
        ("hash = 'edited'", true),
    ] {
        client.batch_execute(&mute)?;
        client.batch_execute(&format!(
            "UPDATE {functions} SET {recorded} WHERE name = 'notify'"
        ))?;
        outbox.migrate(&mut client)?;
        assert_eq!(body(&mut client) == today, made_again, "{recorded}");
    }
    Ok(())
}

#[test]
fn purge_inbox_deletes_old_dedupe_records_across_batches_and_keeps_fresh_ones() -> TestResult {
    let (outbox, mut client) = common::outbox("purge_inbox");
    let mut tx = client.transaction()?;
    for i in 0..2_500 {
        let consumer = if i % 3 == 0 { "billing" } else { "shipping" };
        assert!(outbox.dedupe(&mut tx, consumer, &format!("k-{i:04}"))?);
    }
    tx.commit()?;
    enqueue_keys(&outbox, &mut client, SEND, &["pending"])?;
    // Every other record was processed two days ago.
    let inbox = format!("\"{}_inbox\"", outbox.table());
    let aged = client.execute(
        &format!(
            "UPDATE {inbox} SET processed_at = now() - interval '2 days'
             WHERE right(key, 1)::int % 2 = 0"
        ),
        &[],
    )?;
    assert_eq!(aged, 1_250);
    // Consumer failure counts: one a crash left behind two days ago, one current.
    let failures = format!("\"{}_failures\"", outbox.table());
    client.batch_execute(&format!(
        "INSERT INTO {failures} (consumer, key, failures, last_error, updated_at)
         VALUES ('billing', 'stray', 2, 'boom', now() - interval '2 days'),
                ('billing', 'failing', 1, 'boom', now())"
    ))?;

    let day = Duration::from_secs(24 * 3600);
    // A dry run counts what the purge then deletes.
    let old = Filter::new().older_than(day);
    assert_eq!(
        outbox.count(&mut client, Rows::Inbox.matching(&old))?,
        1_251
    );
    assert_eq!(
        outbox.purge(
            &mut client,
            Rows::Inbox.matching(Filter::new().older_than(day))
        )?,
        1_251
    );
    let kept: Vec<String> = client
        .query(&format!("SELECT key FROM {failures}"), &[])?
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(kept, ["failing"]);
    let left: i64 = client
        .query_one(&format!("SELECT count(*) FROM {inbox}"), &[])?
        .get(0);
    assert_eq!(left, 1_250);
    let old_left: i64 = client
        .query_one(
            &format!("SELECT count(*) FROM {inbox} WHERE processed_at < now() - interval '1 day'"),
            &[],
        )?
        .get(0);
    assert_eq!(old_left, 0);
    assert_eq!(
        outbox.purge(
            &mut client,
            Rows::Inbox.matching(Filter::new().older_than(day))
        )?,
        0
    );
    // A fresh record is still a duplicate; the outbox itself was not touched.
    let mut tx = client.transaction()?;
    assert!(!outbox.dedupe(&mut tx, "shipping", "k-0001")?);
    tx.rollback()?;
    assert_eq!(count(&mut client, &outbox, "true"), 1);
    Ok(())
}

// ---- filtered operations ----

fn keys_of(letters: &[postgres_outbox::DeadLetter]) -> Vec<String> {
    let mut keys: Vec<String> = letters.iter().map(|d| d.record.key.clone()).collect();
    keys.sort();
    keys
}

#[test]
fn filters_select_exactly_the_dead_letters_they_name() -> TestResult {
    let (outbox, mut client) = common::outbox("filters");
    common::operator_rows(&mut client, &outbox);
    let week = Duration::from_secs(7 * 24 * 3600);
    let cases = [
        (Filter::new(), vec!["d1", "d2", "d3", "d4", "d5"]),
        (Filter::new().topic("orders"), vec!["d1", "d2", "d5"]),
        (
            Filter::new().error_contains("timeout"),
            vec!["d1", "d2", "d3"],
        ),
        (Filter::new().older_than(week), vec!["d1", "d3"]),
        (
            Filter::new().key("d4").key("d5").key("s1"),
            vec!["d4", "d5"],
        ),
        (
            Filter::new()
                .topic("orders")
                .error_contains("timeout")
                .older_than(week),
            vec!["d1"],
        ),
    ];
    for (filter, want) in &cases {
        let got = outbox.dead_letters(&mut client, filter.clone().limit(100))?;
        assert_eq!(keys_of(&got), *want, "{filter:?}");
        // A dry run counts the same rows and changes nothing.
        let n = outbox.count(&mut client, Rows::Dead.matching(filter))?;
        assert_eq!(n, want.len() as u64, "{filter:?}");
        assert_eq!(outbox.stats(&mut client)?.dead, 5);
    }

    let groups = outbox.dead_letter_errors(&mut client, Filter::new())?;
    let summary: Vec<(Option<&str>, u64)> = groups
        .iter()
        .map(|g| (g.error.as_deref(), g.count))
        .collect();
    assert_eq!(
        summary,
        [
            (Some("timeout talking to broker"), 3),
            (Some("bad payload"), 1),
            (None, 1)
        ]
    );
    assert_eq!(groups[0].sample_key, "d1");
    assert!(groups[0].first_dead_at < groups[0].last_dead_at);

    let topics = outbox.topic_stats(&mut client)?;
    let topics: Vec<(&str, u64, u64)> = topics
        .iter()
        .map(|t| (t.topic.as_str(), t.pending, t.dead))
        .collect();
    assert_eq!(topics, [("invoices", 0, 2), ("orders", 1, 3)]);

    // Redrive for real: only the old timeouts of "orders".
    let filter = Filter::new()
        .topic("orders")
        .error_contains("timeout")
        .older_than(week);
    assert_eq!(outbox.redrive(&mut client, &filter)?, 1);
    assert_eq!(row_state(&mut client, &outbox, "d1"), ("pending".into(), 0));
    assert_eq!(outbox.stats(&mut client)?.dead, 4);
    Ok(())
}

#[test]
fn a_limit_only_lists_and_parking_only_narrows_dead_letters() -> TestResult {
    let (outbox, mut client) = common::outbox("ops_limits");
    common::operator_rows(&mut client, &outbox);
    let before = count(&mut client, &outbox, "true");
    let one = Filter::new().limit(1);
    assert_eq!(outbox.dead_letters(&mut client, one.clone())?.len(), 1);
    assert_eq!(
        outbox.dead_letters(&mut client, 2)?.len(),
        2,
        "a number alone is a limit"
    );
    let refused = [
        outbox.redrive(&mut client, one.clone()).unwrap_err(),
        outbox.skip(&mut client, one.clone()).unwrap_err(),
        outbox
            .count(&mut client, Rows::Dead.matching(one.clone()))
            .unwrap_err(),
        outbox
            .purge(&mut client, Rows::Sent.matching(one))
            .unwrap_err(),
        outbox
            .purge(&mut client, Rows::Sent.matching(Filter::new().parked()))
            .unwrap_err(),
        outbox
            .count(&mut client, Rows::Inbox.matching(Filter::new().unparked()))
            .unwrap_err(),
        outbox
            .purge(&mut client, Rows::Dead.matching(Filter::new().parked()))
            .unwrap_err(),
        outbox
            .skip(&mut client, Filter::new().unparked())
            .unwrap_err(),
    ];
    for e in refused {
        assert!(e.is_invalid_input(), "{e}");
    }
    assert_eq!(
        count(&mut client, &outbox, "true"),
        before,
        "nothing changed"
    );
    // A purge of dead letters and the count that is its dry run agree.
    let dead = Rows::Dead.matching(Filter::new().unparked());
    let would = outbox.count(&mut client, dead.clone())?;
    assert_eq!(outbox.purge(&mut client, dead)?, would);
    Ok(())
}

#[test]
fn purge_where_deletes_exactly_what_its_filter_names() -> TestResult {
    if common::plain_only("a purge of sent rows by age drops whole partitions there") {
        return Ok(());
    }
    let (outbox, mut client) = common::outbox("purge_filter");
    common::operator_rows(&mut client, &outbox);
    let week = Duration::from_secs(7 * 24 * 3600);
    let old = Filter::new().older_than(week);
    assert_eq!(outbox.count(&mut client, Rows::Dead.matching(&old))?, 2);
    assert_eq!(outbox.count(&mut client, Rows::Sent.matching(&old))?, 1);
    assert_eq!(
        count(&mut client, &outbox, "true"),
        7,
        "dry runs change nothing"
    );

    let bad = Filter::new().error_contains("bad");
    assert_eq!(outbox.purge(&mut client, Rows::Dead.matching(&bad))?, 1);
    assert_eq!(outbox.purge(&mut client, Rows::Sent.matching(&old))?, 1);
    assert_eq!(
        outbox.stats(&mut client)?.sent,
        0,
        "the sent counter follows"
    );
    let mut left: Vec<String> = client
        .query(
            &format!("SELECT key FROM {} ORDER BY key", quoted(&outbox)),
            &[],
        )?
        .iter()
        .map(|r| r.get(0))
        .collect();
    left.sort();
    assert_eq!(left, ["d1", "d2", "d3", "d5", "p1"]);

    // Dedupe records by key, with a dry run first.
    let mut tx = client.transaction()?;
    for key in ["m1", "m2", "m3"] {
        outbox.dedupe(&mut tx, "billing", key)?;
    }
    tx.commit()?;
    let two = Filter::new().key("m1").key("m3");
    assert_eq!(outbox.count(&mut client, Rows::Inbox.matching(&two))?, 2);
    assert_eq!(outbox.purge(&mut client, Rows::Inbox.matching(&two))?, 2);
    let mut tx = client.transaction()?;
    assert!(
        outbox.dedupe(&mut tx, "billing", "m1")?,
        "purged: fresh again"
    );
    assert!(!outbox.dedupe(&mut tx, "billing", "m2")?, "kept");
    tx.rollback()?;

    // What cannot apply, or cannot be stored, is refused before any SQL.
    for (target, filter) in [
        (Rows::Inbox, Filter::new().topic("orders")),
        (Rows::Dead, Filter::new().key("")),
        (Rows::Dead, Filter::new().error_contains("")),
    ] {
        let e = outbox
            .purge(&mut client, target.matching(&filter))
            .unwrap_err();
        assert!(e.is_invalid_input(), "{e}");
    }
    assert_eq!(count(&mut client, &outbox, "true"), 5);
    Ok(())
}

#[test]
fn sql_can_be_run_again_and_migrate_then_has_nothing_to_do() -> TestResult {
    let schema = unique_name("rerun");
    let outbox = Outbox::new(&format!("{schema}.events"))?;
    let mut client = common::client();
    client.batch_execute(&outbox.sql())?;
    enqueue_keys(&outbox, &mut client, SEND, &["kept"])?;
    client.batch_execute(&outbox.sql())?;
    outbox.migrate(&mut client)?;
    assert_eq!(
        row_state(&mut client, &outbox, "kept"),
        ("pending".into(), 0)
    );
    Ok(())
}

#[test]
fn a_repeatable_read_producer_meeting_a_concurrent_duplicate_gets_a_duplicate_key_error(
) -> TestResult {
    let (outbox, mut client) = common::outbox("rr_duplicate");
    let mut other = common::client();
    let mut tx = client
        .build_transaction()
        .isolation_level(postgres::IsolationLevel::RepeatableRead)
        .start()?;
    tx.batch_execute("SELECT 1")?; // the snapshot is taken
    enqueue_keys(&outbox, &mut other, SEND, &["taken", "taken-too"])?;
    let e = outbox
        .enqueue(&mut tx, Message::new(SEND, "x").key("taken"))
        .unwrap_err();
    assert_eq!(e.duplicate_keys(), ["taken"]);
    // A batch cannot tell which of its keys conflict: it names them all.
    let batch = [
        Message::new(SEND, "x").key("taken-too"),
        Message::new(SEND, "y").key("new-a"),
    ];
    let e = outbox.enqueue_all(&mut tx, batch).unwrap_err();
    assert_eq!(e.duplicate_keys(), ["new-a", "taken-too"]);
    // The transaction is still usable.
    outbox.enqueue(&mut tx, Message::new(SEND, "z").key("new-b"))?;
    tx.commit()?;
    assert_eq!(
        row_state(&mut client, &outbox, "new-b"),
        ("pending".into(), 0)
    );
    assert_eq!(count(&mut client, &outbox, "key = 'new-a'"), 0);
    Ok(())
}

#[test]
fn a_migration_behind_a_long_transaction_gives_up_instead_of_blocking_producers() -> TestResult {
    let outbox = Outbox::new(&unique_name("lock_wait"))?;
    let mut client = common::client();
    // The schema before migration 6, which alters the failures table.
    let ddl = outbox.sql();
    let before = ddl
        .split("-- 0006_dead_decisions_and_channel")
        .next()
        .expect("the DDL lists its migrations");
    client.batch_execute(before)?;
    let mut long = common::client();
    let mut open = long.transaction()?;
    open.batch_execute(&format!("SELECT 1 FROM \"{}_failures\"", outbox.table()))?;
    let started = std::time::Instant::now();
    let e = outbox.migrate(&mut client).unwrap_err();
    assert_eq!(e.code(), Some(&SqlState::LOCK_NOT_AVAILABLE), "{e}");
    assert!(started.elapsed() < Duration::from_secs(30));
    open.commit()?;
    outbox.migrate(&mut client)?;
    enqueue_keys(&outbox, &mut client, SEND, &["after"])?;
    Ok(())
}

#[test]
fn dry_runs_count_what_skip_and_purge_would_change_and_refuse_as_they_do() -> TestResult {
    let (outbox, mut client) = common::outbox("dry_runs");
    common::operator_rows(&mut client, &outbox);
    // d1 and d2 park their aggregates; the other dead letters do not.
    let t = quoted(&outbox);
    client.batch_execute(&format!(
        "UPDATE {t} SET status = 'parked', aggregate_key = 'agg-' || key
         WHERE key IN ('d1', 'd2')"
    ))?;

    // Skip touches parked dead letters only; its dry run counts exactly those.
    let all = Filter::new().topic("orders");
    assert_eq!(outbox.would_skip(&mut client, all.clone())?, 2);
    assert!(outbox
        .would_skip(&mut client, all.clone().unparked())
        .is_err_and(|e| e.to_string().contains("parked dead letters only")));
    // Purge leaves parked ones alone; its dry run counts the rest, and refuses --parked.
    let dead = Rows::Dead.matching(Filter::new().topic("orders"));
    assert_eq!(outbox.would_purge(&mut client, dead.clone())?, 1, "d5");
    let parked = Rows::Dead.matching(Filter::new().parked());
    let refused = outbox.would_purge(&mut client, parked.clone());
    assert!(refused.is_err_and(|e| e.to_string().contains("never purged")));
    assert!(outbox.purge(&mut client, parked).is_err());

    // What the changes then did is what the dry runs said. Skipped, d1 and d2 are plain
    // dead letters, which a purge deletes.
    assert_eq!(outbox.skip(&mut client, all)?, 2);
    assert_eq!(
        count(
            &mut client,
            &outbox,
            "key IN ('d1', 'd2') AND status = 'dead'"
        ),
        2
    );
    assert_eq!(outbox.would_purge(&mut client, dead.clone())?, 3);
    assert_eq!(outbox.purge(&mut client, dead)?, 3);
    assert_eq!(
        count(&mut client, &outbox, "topic = 'orders' AND status = 'dead'"),
        0
    );
    Ok(())
}

/// Each side works with the rights `Outbox::grants` gives it (docs/grants.md),
/// under a role of its own that owns nothing: a producer enqueues one message with an aggregate and a
/// key of its own, and a batch; a relay sends them, and `process` with its rights handles
/// another; a consumer dedupes one.
#[test]
fn producers_relays_and_consumers_work_with_the_rights_the_readme_gives_them() {
    let (outbox, mut client) = common::outbox("roles");
    let too_long = "r".repeat(64);
    for bad in [
        "",
        "a\0b",
        "public",
        "x$grant$;",
        "o'brien",
        "\"r\"",
        &too_long,
    ] {
        let refused = outbox.grants(Access::Relay, bad).expect_err("refused");
        assert!(refused.is_invalid_input(), "{refused}");
    }
    let never_made = Outbox::new(&unique_name("never_made")).unwrap();
    let refused = client
        .batch_execute(&never_made.grants(Access::Relay, "relay").unwrap())
        .expect_err("refused");
    assert_eq!(
        refused.code(),
        Some(&SqlState::UNDEFINED_TABLE),
        "{refused}"
    );
    let roles = [Access::Produce, Access::Relay, Access::Dedupe].map(|access| {
        let role = common::Role::new(&mut client);
        role.grant(&mut client, &outbox, access);
        role
    });
    let [producer, relay_role, consumer] = &roles;

    let mut as_producer = producer.client();
    let mut tx = as_producer.transaction().unwrap();
    outbox
        .enqueue(
            &mut tx,
            Message::new("t", b"{}".to_vec())
                .key("roles-1")
                .aggregate_key("order-1"),
        )
        .expect("enqueue as the producer");
    outbox
        .enqueue(
            &mut tx,
            Message::new("t", b"{}".to_vec()).aggregate_key("order-1"),
        )
        .expect("enqueue a second of the aggregate");
    let batch = (0..3)
        .map(|i| Message::new("t", format!("{i}").into_bytes()).aggregate_key("order-2"))
        .collect::<Vec<_>>();
    outbox
        .enqueue_all(&mut tx, batch)
        .expect("enqueue a batch as the producer");
    tx.commit().unwrap();

    let published = common::Sink::default();
    let relay = postgres_outbox::Relay::spawn(common::relay_config_with(
        &outbox,
        relay_role.pool(),
        published.collect(),
    ))
    .expect("spawn the relay as its role");
    wait_until(
        "the relay's role sends every message and reports itself",
        || {
            published.len() == 5
                && count(&mut client, &outbox, "status = 'sent'") == 5
                && outbox.relays(&mut client).is_ok_and(|r| r.len() == 1)
        },
    );
    let report = relay.shutdown(Duration::from_secs(10)).expect("shutdown");
    assert_eq!(report.published, 5);
    assert!(published.contains("roles-1"));

    // `process`, a consumer in the database, needs what a relay has.
    let mut tx = as_producer.transaction().unwrap();
    outbox
        .enqueue(&mut tx, Message::new("t", b"{}".to_vec()).key("roles-2"))
        .unwrap();
    tx.commit().unwrap();
    let processed = outbox
        .process(&mut relay_role.client(), 10, |_, record| {
            assert_eq!(record.key, "roles-2");
            Ok(())
        })
        .expect("process as the relay's role");
    assert_eq!(processed.processed, 1);

    let mut as_consumer = consumer.client();
    let mut tx = as_consumer.transaction().unwrap();
    assert!(outbox.dedupe(&mut tx, "billing", "roles-1").unwrap());
    assert!(!outbox.dedupe(&mut tx, "billing", "roles-1").unwrap());
    tx.commit().unwrap();

    // A role given none of it is refused, and nothing changes.
    let nobody = common::Role::new(&mut client);
    nobody.execute(
        &mut client,
        &format!("GRANT USAGE ON SCHEMA \"{}\" TO {{role}}", common::schema()),
    );
    let mut as_nobody = nobody.client();
    let mut tx = as_nobody.transaction().unwrap();
    let refused = outbox
        .enqueue(&mut tx, Message::new("t", b"{}".to_vec()))
        .expect_err("refused");
    assert!(
        refused.to_string().contains("permission denied"),
        "{refused}"
    );
    drop(tx);
    assert_eq!(count(&mut client, &outbox, "true"), 6);
    drop((as_producer, as_consumer, as_nobody));
}
