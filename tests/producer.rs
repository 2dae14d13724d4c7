//! A `Producer`: the enqueue by statements prepared on its connection writes what
//! `Outbox::enqueue` writes, keeps its errors and its order, and leaves nothing behind.

mod common;

use std::error::Error as StdError;
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::{quoted, wait_until};
use postgres::fallible_iterator::FallibleIterator;
use postgres::Client;
use postgres_outbox::{Message, Outbox};

type TestResult = Result<(), Box<dyn StdError>>;

/// Messages of every shape: with an aggregate or none, the caller's key or the crate's,
/// delayed, scheduled, with headers, an attempt limit and a parking choice.
fn messages(tag: &str, at: SystemTime) -> Vec<Message> {
    vec![
        Message::new("a", vec![1u8, 2, 3])
            .key(format!("{tag}-k1"))
            .aggregate_key("agg")
            .content_type("application/json")
            .header("h", "v")
            .header("h2", "")
            .max_attempts(4)
            .delay(Duration::from_secs(60)),
        Message::new("a", "second of agg").aggregate_key("agg"),
        Message::new("b", "loose").key(format!("{tag}-k2")),
        Message::new("c", "loose, our key")
            .header("only", "one")
            .max_attempts(2)
            .park_on_dead(true),
        Message::new("d", "at").available_at(at).content_type(""),
        Message::new("e", "later").delay(Duration::from_millis(1500)),
        Message::new("f", vec![0u8, 255]).aggregate_key("other"),
    ]
}

/// Every column a message sets, and what the enqueue derives (status, head), in id order.
fn rows(client: &mut Client, outbox: &Outbox) -> Vec<String> {
    let sql = format!(
        "SELECT format('%L %L %L %L %L %L %L %L %L %L %L',
                       topic, aggregate_key, payload, content_type, headers, max_attempts,
                       park, status, attempts, head,
                       CASE WHEN topic = 'd' THEN available_at::text
                            ELSE (available_at - created_at)::text END)
         FROM {} ORDER BY id",
        quoted(outbox)
    );
    let rows = client.query(&sql, &[]).expect("rows");
    rows.iter().map(|r| r.get(0)).collect()
}

#[test]
fn a_producer_writes_what_enqueue_writes() -> TestResult {
    let tomorrow = SystemTime::now().duration_since(UNIX_EPOCH)?.as_secs() + 86_400;
    let at = UNIX_EPOCH + Duration::from_secs(tomorrow);
    for notify in [true, false] {
        let (by_enqueue, mut client) = common::outbox("by_enqueue");
        let by_enqueue = common::builder()
            .table(by_enqueue.table())
            .notify(notify)
            .build()?;
        let mut tx = client.transaction()?;
        let mut keys = Vec::new();
        for message in messages("e", at) {
            keys.push(by_enqueue.enqueue(&mut tx, message)?);
        }
        tx.commit()?;

        let (prepared, _) = common::outbox("by_producer");
        let prepared = common::builder()
            .table(prepared.table())
            .notify(notify)
            .build()?;
        let mut producer = prepared.producer(common::client())?;
        let mut tx = producer.transaction()?;
        let mut producer_keys = Vec::new();
        for message in messages("p", at) {
            producer_keys.push(tx.enqueue(message)?);
        }
        tx.commit()?;

        let expected = rows(&mut client, &by_enqueue);
        assert_eq!(expected.len(), 7);
        assert_eq!(rows(&mut client, &prepared), expected, "notify {notify}");
        // The caller's keys as given, the crate's as UUIDv7, as `enqueue` returns them.
        for (key, producer_key) in keys.iter().zip(&producer_keys) {
            assert_eq!(key.starts_with("e-"), producer_key.starts_with("p-"));
        }
        let generated = producer_keys.iter().filter(|k| !k.starts_with("p-"));
        for key in generated {
            let uuid = uuid::Uuid::parse_str(key)?;
            assert_eq!(uuid.get_version_num(), 7, "{key}");
        }
    }
    Ok(())
}

#[test]
fn refusals_and_duplicates_leave_a_producers_transaction_usable() -> TestResult {
    let (outbox, mut client) = common::outbox("producer_errors");
    let mut producer = outbox.producer(common::client())?;
    let mut tx = producer.transaction()?;
    tx.enqueue(Message::new("t", "first").key("taken"))?;
    tx.commit()?;

    let mut tx = producer.transaction()?;
    let e = tx
        .enqueue(Message::new("t", "again").key("taken"))
        .unwrap_err();
    assert!(e.is_duplicate_key(), "{e}");
    assert_eq!(e.duplicate_keys(), ["taken"]);
    let e = tx.enqueue(Message::new("", "no topic")).unwrap_err();
    assert!(!e.is_duplicate_key(), "{e}");
    let e = tx
        .enqueue(Message::new("t", "nul").aggregate_key("a\0b"))
        .unwrap_err();
    assert!(!e.is_duplicate_key(), "{e}");
    // The business write and the messages after the refusals all commit.
    tx.execute("SELECT 1", &[])?;
    let later = tx.enqueue(Message::new("t", "later").aggregate_key("a"))?;
    let loose = tx.enqueue(Message::new("t", "loose"))?;
    tx.commit()?;

    let sql = format!("SELECT key FROM {} ORDER BY id", quoted(&outbox));
    let keys: Vec<String> = client.query(&sql, &[])?.iter().map(|r| r.get(0)).collect();
    assert_eq!(keys, ["taken".to_owned(), later, loose]);

    // Rolled back, explicitly or by a drop, nothing stays.
    let mut tx = producer.transaction()?;
    tx.enqueue(Message::new("t", "gone"))?;
    tx.rollback()?;
    {
        let mut tx = producer.transaction()?;
        tx.enqueue(Message::new("t", "gone too").aggregate_key("a"))?;
    }
    assert_eq!(client.query(&sql, &[])?.len(), 3);
    Ok(())
}

#[test]
fn a_producer_notifies_a_waiting_relay_at_commit_as_enqueue_does() -> TestResult {
    let (outbox, mut client) = common::outbox("producer_notify");
    let quiet = common::builder()
        .table(outbox.table())
        .notify(false)
        .build()?;
    let mut listener = common::client();
    let channel = outbox.channel(&mut client)?;
    listener.batch_execute(&format!("LISTEN \"{channel}\""))?;
    client.execute(
        &format!(
            "INSERT INTO \"{}_waiting\" (relay) VALUES ('r1')",
            outbox.table()
        ),
        &[],
    )?;
    let marker = |client: &mut Client, payload: &str| -> TestResult {
        client.execute("SELECT pg_notify($1, $2)", &[&channel, &payload])?;
        Ok(())
    };

    let mut loud = outbox.producer(common::client())?;
    let mut silent = quiet.producer(common::client())?;
    for (aggregate, what) in [(None, "loose"), (Some("agg"), "ordered")] {
        let message = |payload: &str| match aggregate {
            Some(aggregate) => Message::new("t", payload.to_owned()).aggregate_key(aggregate),
            None => Message::new("t", payload.to_owned()),
        };
        let mut tx = silent.transaction()?;
        tx.enqueue(message("quiet"))?;
        tx.commit()?;
        marker(&mut client, &format!("{what}: quiet committed"))?;
        let mut tx = loud.transaction()?;
        tx.enqueue(message("loud"))?;
        // Sent before the loud commit: the notification must come after it.
        marker(&mut client, &format!("{what}: before the commit"))?;
        tx.commit()?;
    }

    let mut payloads = Vec::new();
    let mut notifications = listener.notifications();
    let mut incoming = notifications.timeout_iter(Duration::from_secs(60));
    while payloads.len() < 6 {
        let n = incoming.next()?.expect("a notification within 60 s");
        payloads.push(n.payload().to_owned());
    }
    assert_eq!(
        payloads,
        [
            "loose: quiet committed",
            "loose: before the commit",
            "",
            "ordered: quiet committed",
            "ordered: before the commit",
            ""
        ]
    );
    Ok(())
}

#[test]
fn a_producer_waits_for_an_earlier_producer_of_its_aggregate_and_marks_heads() -> TestResult {
    // The second producer's message with its caller's key (the enqueue function) and with
    // the crate's (the INSERT whose head mark takes the lock).
    for keyed in [true, false] {
        let (outbox, mut client) = common::outbox("producer_order");
        let mut first = outbox.producer(common::client())?;
        let mut tx = first.transaction()?;
        let earlier = tx.enqueue(Message::new("t", "first").aggregate_key("agg"))?;

        // A second producer of the aggregate, on statements of its own, waits for the first.
        let second_outbox = outbox.clone();
        let (enqueued, second_done) = mpsc::channel();
        let second = thread::spawn(move || -> Result<String, postgres_outbox::Error> {
            let mut producer = second_outbox.producer(common::client())?;
            let mut tx = producer.transaction()?;
            let message = Message::new("t", "second").aggregate_key("agg");
            let message = if keyed {
                message.key("second")
            } else {
                message
            };
            let key = tx.enqueue(message)?;
            enqueued.send(()).expect("tell enqueued");
            tx.commit()?;
            Ok(key)
        });
        let waiting = "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' \
                       AND wait_event = 'advisory' AND strpos(query, $1) > 0";
        let table = outbox
            .table()
            .rsplit('.')
            .next()
            .unwrap_or_default()
            .to_owned();
        wait_until("the second producer waits for the aggregate's lock", || {
            client
                .query_one(waiting, &[&table])
                .is_ok_and(|row| row.get::<_, i64>(0) == 1)
        });
        assert!(second_done.try_recv().is_err(), "the second did not wait");
        // The first goes on while the second waits: the id of the second's row, drawn
        // after the lock, is above both of the first's.
        let later = tx.enqueue(Message::new("t", "third").aggregate_key("agg"))?;
        tx.commit()?;
        let second = second.join().expect("second producer")?;

        // Id order is commit order; the first is its aggregate's head, marked so; the
        // others, enqueued while it was pending, are not.
        let sql = format!("SELECT key, head FROM {} ORDER BY id", quoted(&outbox));
        let rows: Vec<(String, bool)> = client
            .query(&sql, &[])?
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect();
        assert_eq!(
            rows,
            [(earlier, true), (later, false), (second, false)],
            "keyed {keyed}"
        );
    }
    Ok(())
}

#[test]
fn a_producer_borrows_or_owns_its_connection_and_closes_its_statements() -> TestResult {
    let (outbox, mut client) = common::outbox("producer_connection");
    // The statements naming the table (this query names it in a parameter only).
    let prepared = "SELECT count(*) FROM pg_prepared_statements \
                    WHERE NOT from_sql AND strpos(statement, $1) > 0";
    let table = outbox
        .table()
        .rsplit('.')
        .next()
        .unwrap_or_default()
        .to_owned();
    let before: i64 = client.query_one(prepared, &[&table])?.get(0);
    {
        let mut producer = outbox.producer(&mut client)?;
        let mut tx = producer.transaction()?;
        tx.enqueue(Message::new("t", "borrowed"))?;
        tx.commit()?;
        let held: i64 = producer.client().query_one(prepared, &[&table])?.get(0);
        assert_eq!(held, before + 3, "the producer's three statements");
    }
    // Dropped, the producer closed its statements on the connection it borrowed.
    let after: i64 = client.query_one(prepared, &[&table])?.get(0);
    assert_eq!(after, before);

    // A pooled connection, borrowed for a checkout.
    let pool = common::pool(1);
    let mut pooled = pool.get()?;
    let mut producer = outbox.producer(&mut *pooled)?;
    let mut tx = producer.transaction()?;
    tx.enqueue(Message::new("t", "pooled").aggregate_key("a"))?;
    tx.commit()?;
    assert_eq!(producer.outbox().table(), outbox.table());

    // Owned, and given back.
    let mut producer = outbox.producer(common::client())?;
    let mut tx = producer.transaction()?;
    tx.enqueue(Message::new("t", "owned"))?;
    tx.commit()?;
    let mut owned = producer.into_inner();
    let left: i64 = owned.query_one(prepared, &[&table])?.get(0);
    assert_eq!(
        left, 0,
        "statements closed when the producer gave its client back"
    );

    let sql = format!("SELECT count(*) FROM {}", quoted(&outbox));
    assert_eq!(client.query_one(&sql, &[])?.get::<_, i64>(0), 3);
    Ok(())
}

#[test]
fn a_producer_on_a_table_not_migrated_is_a_clear_error() -> TestResult {
    let outbox = common::builder()
        .table(common::unique_name("never_migrated"))
        .build()?;
    let e = outbox.producer(common::client()).unwrap_err();
    let text = e.to_string();
    assert!(
        text.contains("migrate") || text.contains("does not exist"),
        "{text}"
    );
    Ok(())
}

/// Advisory locks the backend `pid` holds.
fn advisory_locks(client: &mut Client, pid: i32) -> i64 {
    client
        .query_one(
            "SELECT count(*) FROM pg_locks WHERE pid = $1 AND locktype = 'advisory' AND granted",
            &[&pid],
        )
        .expect("count locks")
        .get(0)
}

#[test]
fn a_producers_transaction_of_many_aggregates_takes_a_bounded_number_of_locks() -> TestResult {
    let (outbox, mut client) = common::outbox("producer_many");
    let mut producer = outbox.producer(common::client())?;
    let pid: i32 = producer
        .client()
        .query_one("SELECT pg_backend_pid()", &[])?
        .get(0);
    // On a partitioned table, a producer of the caller's keys holds one lock more: the one
    // a partition cut waits for (see sql/partitioned.sql).
    let keys = i64::from(common::partitioned());

    let mut tx = producer.transaction()?;
    for i in 0..40 {
        tx.enqueue(Message::new("t", "x").aggregate_key(format!("s{i}")))?;
        // An aggregate locked already costs no lock and no count.
        tx.enqueue(Message::new("t", "x").aggregate_key(format!("s{i}")))?;
    }
    let held = advisory_locks(&mut client, pid);
    assert!((41..=56).contains(&held), "{held} advisory locks");
    tx.commit()?;

    // Past 64 aggregates, the table's ordered enqueues: all sixteen buckets, exclusively;
    // one of the caller's keys among them takes the same count.
    let mut tx = producer.transaction()?;
    tx.enqueue(
        Message::new("t", "x")
            .key("caller's")
            .aggregate_key("first"),
    )?;
    for i in 0..100 {
        tx.enqueue(Message::new("t", "x").aggregate_key(format!("m{i}")))?;
    }
    // The caller's key's aggregate, locked by the function; 64 by the producer's INSERTs;
    // the buckets shared, then all sixteen exclusively.
    let held = advisory_locks(&mut client, pid);
    assert!(held <= 1 + 64 + 16 + 16 + keys, "{held} advisory locks");
    // Meanwhile other ordered producers of this table wait; unordered ones do not.
    let mut other = common::client();
    other.batch_execute("SET lock_timeout = '200ms'")?;
    let mut other_tx = other.transaction()?;
    let e = outbox
        .enqueue(
            &mut other_tx,
            Message::new("t", "elsewhere").aggregate_key("e"),
        )
        .unwrap_err();
    assert_eq!(
        e.code(),
        Some(&postgres::error::SqlState::LOCK_NOT_AVAILABLE),
        "{e}"
    );
    other_tx.rollback()?;
    let mut other_tx = other.transaction()?;
    outbox.enqueue(&mut other_tx, Message::new("t", "loose"))?;
    other_tx.commit()?;
    tx.commit()?;
    let sql = format!(
        "SELECT count(*) FROM {} WHERE aggregate_key IS NOT NULL",
        quoted(&outbox)
    );
    assert_eq!(client.query_one(&sql, &[])?.get::<_, i64>(0), 80 + 101);

    // docs/producing.md: `enqueue` and the producer's INSERTs count their 64 apart, so a
    // transaction using both holds 128 aggregate locks at most (and the buckets, shared).
    let mut tx = producer.transaction()?;
    for i in 0..64 {
        outbox.enqueue(
            &mut tx,
            Message::new("t", "x").aggregate_key(format!("f{i}")),
        )?;
        tx.enqueue(Message::new("t", "x").aggregate_key(format!("p{i}")))?;
    }
    let held = advisory_locks(&mut client, pid);
    assert!((128..=128 + 16).contains(&held), "{held} advisory locks");
    tx.commit()?;
    Ok(())
}

/// A savepoint rolled back lets go of the aggregate locks taken after it; the producer's
/// next enqueue of such an aggregate takes its lock again, and so it does after a
/// savepoint rolled back the table's lock its 65th aggregate took.
#[test]
fn a_savepoint_rolled_back_leaves_a_producers_next_enqueue_its_lock() -> TestResult {
    let (outbox, mut client) = common::outbox("producer_savepoint");
    let mut producer = outbox.producer(common::client())?;
    let mut other = common::client();
    other.batch_execute("SET lock_timeout = '200ms'")?;
    // Whether another producer of `aggregate` must wait for this one.
    let mut held = |aggregate: &str| -> Result<bool, Box<dyn std::error::Error>> {
        let mut tx = other.transaction()?;
        let message = Message::new("t", "other").aggregate_key(aggregate);
        let outcome = outbox.enqueue(&mut tx, message);
        tx.rollback()?;
        match outcome {
            Ok(_) => Ok(false),
            Err(e) if e.code() == Some(&postgres::error::SqlState::LOCK_NOT_AVAILABLE) => Ok(true),
            Err(e) => Err(e.into()),
        }
    };

    let mut tx = producer.transaction()?;
    tx.batch_execute("SAVEPOINT s")?;
    tx.enqueue(Message::new("t", "gone").aggregate_key("a"))?;
    assert!(held("a")?, "the lock taken after the savepoint");
    tx.batch_execute("ROLLBACK TO SAVEPOINT s")?;
    assert!(!held("a")?, "let go with the savepoint");
    tx.enqueue(Message::new("t", "kept").aggregate_key("a"))?;
    assert!(held("a")?, "taken again");
    tx.commit()?;

    let mut tx = producer.transaction()?;
    for i in 0..60 {
        tx.enqueue(Message::new("t", "x").aggregate_key(format!("many{i}")))?;
    }
    tx.batch_execute("SAVEPOINT s")?;
    for i in 60..70 {
        tx.enqueue(Message::new("t", "x").aggregate_key(format!("many{i}")))?;
    }
    assert!(held("elsewhere")?, "the table's ordered enqueues locked");
    tx.batch_execute("ROLLBACK TO SAVEPOINT s")?;
    assert!(!held("elsewhere")?, "let go with the savepoint");
    tx.enqueue(Message::new("t", "kept").aggregate_key("b"))?;
    assert!(held("b")?, "the aggregate's lock taken again");
    assert!(!held("elsewhere")?, "and no more than that");
    tx.commit()?;

    let sql = format!(
        "SELECT aggregate_key FROM {} WHERE aggregate_key IN ('a', 'b') ORDER BY id",
        quoted(&outbox)
    );
    let kept: Vec<String> = client.query(&sql, &[])?.iter().map(|r| r.get(0)).collect();
    assert_eq!(kept, ["a", "b"]);
    Ok(())
}

/// docs/producing.md: `migrate` remaking the functions a producer's statements call is
/// safe, and `DISCARD ALL` makes the next enqueue fail with PostgreSQL's error, not write
/// anything else.
#[test]
fn a_producer_outlives_functions_made_again_and_says_when_its_statements_are_gone() -> TestResult {
    let (outbox, mut client) = common::outbox("producer_remade");
    let mut producer = outbox.producer(common::client())?;
    let mut tx = producer.transaction()?;
    tx.enqueue(Message::new("t", "before").aggregate_key("a"))?;
    tx.commit()?;

    // Every function file made again, as an upgrade would.
    client.batch_execute(&format!(
        "DELETE FROM {}",
        common::quoted_with(&outbox, "_functions")
    ))?;
    outbox.migrate(&mut client)?;
    let mut tx = producer.transaction()?;
    tx.enqueue(Message::new("t", "after").aggregate_key("a"))?;
    tx.enqueue(Message::new("t", "loose"))?;
    tx.enqueue(Message::new("t", "keyed").key("keyed").aggregate_key("a"))?;
    tx.commit()?;

    producer.client().batch_execute("DISCARD ALL")?;
    let mut tx = producer.transaction()?;
    let e = tx.enqueue(Message::new("t", "lost")).unwrap_err();
    assert_eq!(
        e.code(),
        Some(&postgres::error::SqlState::INVALID_SQL_STATEMENT_NAME),
        "{e}"
    );
    drop(tx);

    let sql = format!(
        "SELECT convert_from(payload, 'UTF8') FROM {} ORDER BY id",
        quoted(&outbox)
    );
    let payloads: Vec<String> = client.query(&sql, &[])?.iter().map(|r| r.get(0)).collect();
    assert_eq!(payloads, ["before", "after", "loose", "keyed"]);
    Ok(())
}
