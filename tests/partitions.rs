//! Partitioned outboxes (`OutboxBuilder::partition_interval`): partitions kept ahead, cuts
//! by the clock, keys unique across partitions, retention by dropping partitions whole. The
//! relay, consumer, ordering and parking suites run on partitioned tables too, with
//! `OUTBOX_TEST_TABLES=partitioned` (see `.ci/run`).

mod common;

use std::sync::mpsc;
use std::time::Duration;

use common::pg_node::PgNode;
use common::{client, quoted, quoted_with, relay_config, unique_name, wait_until, Role, Sink};
use postgres::error::SqlState;
use postgres::{Client, GenericClient, NoTls};
use postgres_outbox::{
    Access, Check, Connections, Filter, HeldBack, Message, Outbox, Record, Relay, Rows,
};

/// The longest interval there is, so that no cut by the clock (a day's partition is cut at
/// midnight UTC) comes in the middle of a test: each test cuts when it means to.
const YEAR: Duration = Duration::from_secs(366 * 24 * 3600);

/// An outbox on `table`, partitioned by the year, not migrated.
fn yearly(table: impl Into<String>) -> Outbox {
    Outbox::builder()
        .table(table)
        .partition_interval(YEAR)
        .build()
        .expect("valid settings")
}

fn partitioned(prefix: &str) -> (Outbox, Client) {
    let outbox = yearly(unique_name(prefix));
    let mut client = client();
    outbox.migrate(&mut client).expect("migrate");
    (outbox, client)
}

/// The partitions that exist, by number.
fn partitions(client: &mut Client, outbox: &Outbox) -> Vec<i64> {
    client
        .query(
            &format!(
                "SELECT n FROM {} WHERE to_regclass($1 || n) IS NOT NULL ORDER BY n",
                quoted_with(outbox, "_partitions")
            ),
            &[&format!("{}_p", outbox.table())],
        )
        .expect("partitions")
        .iter()
        .map(|row| row.get(0))
        .collect()
}

/// Drops partitions by hand, as an operator might (or a failed upkeep would leave them).
fn drop_partitions(client: &mut Client, outbox: &Outbox, numbers: &[i64]) {
    for n in numbers {
        client
            .batch_execute(&format!(
                "DROP TABLE {}",
                quoted_with(outbox, &format!("_p{n}"))
            ))
            .expect("drop a partition");
    }
}

/// The schema and the owner of partition `n`'s table.
fn partition_table(client: &mut Client, outbox: &Outbox, n: i64) -> (String, String) {
    let row = client
        .query_one(
            "SELECT schemaname::text, tableowner::text FROM pg_tables WHERE tablename = $1",
            &[&format!("{}_p{n}", outbox.table())],
        )
        .expect("the partition's table");
    (row.get(0), row.get(1))
}

/// The partition a message's row is in.
fn partition_of(client: &mut Client, outbox: &Outbox, key: &str) -> String {
    client
        .query_one(
            &format!(
                "SELECT tableoid::regclass::text FROM {} WHERE key = $1",
                common::quoted(outbox)
            ),
            &[&key],
        )
        .expect("the row")
        .get::<_, String>(0)
        .replace('"', "")
}

/// Cuts the open partition whatever the clock says, then makes the one this leaves missing
/// ahead, as the relay's next upkeep would.
fn cut(client: &mut Client, outbox: &Outbox) {
    upkeep(client, outbox, true);
    upkeep(client, outbox, false);
}

/// Runs the relay's partition upkeep once, as its statement does; `cut`: cut the open
/// partition whatever the clock.
fn upkeep(client: &mut impl GenericClient, outbox: &Outbox, cut: bool) -> Option<i32> {
    client
        .query_one(
            &format!(
                "SELECT {}($1), {}()",
                quoted_with(outbox, "_partition"),
                quoted_with(outbox, "_settle")
            ),
            &[&cut],
        )
        .expect("partition upkeep")
        .get(0)
}

fn enqueue(
    client: &mut Client,
    outbox: &Outbox,
    message: Message,
) -> postgres_outbox::Result<String> {
    let mut tx = client.transaction().expect("begin");
    let key = outbox.enqueue(&mut tx, message)?;
    tx.commit().expect("commit");
    Ok(key)
}

fn message(key: &str) -> Message {
    Message::new("t", b"{}".to_vec()).key(key)
}

/// A relay that publishes every row but those whose key starts with `key`, which it refuses
/// for good.
fn refusing(outbox: &Outbox, key: &'static str) -> postgres_outbox::RelayConfig {
    relay_config(outbox, move |record| {
        if record.key.starts_with(key) {
            return Err(postgres_outbox::PublishError::permanent("refused"));
        }
        Ok(())
    })
}

/// Sends every due row through a relay that publishes into `published`.
fn send_all(outbox: &Outbox) -> Sink {
    let published = Sink::default();
    let config = relay_config(outbox, published.collect());
    Relay::run_until_idle(&config).expect("run until idle");
    published
}

#[test]
fn a_partitioned_outbox_keeps_partitions_ahead_and_cuts_them_by_the_clock() {
    let (outbox, mut client) = partitioned("part_clock");
    assert_eq!(partitions(&mut client, &outbox), vec![0, 1, 2]);
    let first = enqueue(&mut client, &outbox, message("first")).unwrap();
    assert!(partition_of(&mut client, &outbox, &first).ends_with("_p0"));

    // Within its interval the open partition stays open.
    assert_eq!(upkeep(&mut client, &outbox, false), Some(2));
    let second = enqueue(&mut client, &outbox, message("second")).unwrap();
    assert!(partition_of(&mut client, &outbox, &second).ends_with("_p0"));

    // Opened over a year ago: cut, new ids go to the next partition, one more is made ahead
    // (by this call, so the next one can cut to it).
    client
        .execute(
            &format!(
                "UPDATE {} SET opened_at = now() - interval '400 days' WHERE n = 0",
                quoted_with(&outbox, "_partitions")
            ),
            &[],
        )
        .unwrap();
    assert_eq!(upkeep(&mut client, &outbox, false), Some(1));
    assert_eq!(partitions(&mut client, &outbox), vec![0, 1, 2]);
    let third = enqueue(&mut client, &outbox, message("third")).unwrap();
    assert!(partition_of(&mut client, &outbox, &third).ends_with("_p1"));
    assert_eq!(upkeep(&mut client, &outbox, false), Some(2));
    assert_eq!(partitions(&mut client, &outbox), vec![0, 1, 2, 3]);

    // A relay does the same on its own: drop the partitions ahead, and it makes them again.
    drop_partitions(&mut client, &outbox, &[2, 3]);
    let relay = Relay::spawn(relay_config(&outbox, |_| Ok(()))).expect("spawn");
    wait_until("the relay makes the partitions ahead again", || {
        partitions(&mut client, &outbox) == vec![0, 1, 2, 3]
    });
    relay.shutdown(Duration::from_secs(10)).expect("shutdown");
}

#[test]
fn keys_the_caller_gives_stay_unique_across_partitions() {
    let (outbox, mut client) = partitioned("part_keys");
    enqueue(&mut client, &outbox, message("k1")).unwrap();
    enqueue(&mut client, &outbox, message("k2")).unwrap();
    cut(&mut client, &outbox);
    let fresh = enqueue(&mut client, &outbox, message("k3")).unwrap();
    assert!(partition_of(&mut client, &outbox, &fresh).ends_with("_p1"));

    // The same key in the open partition and in the one before: both refused.
    for key in ["k1", "k3"] {
        let err = enqueue(&mut client, &outbox, message(key)).unwrap_err();
        assert!(err.is_duplicate_key(), "{key}: {err}");
    }
    // A batch, small (the function) and large (the function too: no COPY for these keys).
    for size in [3, 100] {
        let mut batch: Vec<Message> = (0..size)
            .map(|i| message(&format!("batch-{size}-{i}")))
            .collect();
        batch.push(message("k2"));
        let mut tx = client.transaction().unwrap();
        let err = outbox.enqueue_all(&mut tx, batch).unwrap_err();
        assert!(err.is_duplicate_key(), "{err}");
        tx.commit().unwrap();
    }
    // Keys the crate makes go in as before, by COPY too.
    let mut tx = client.transaction().unwrap();
    outbox
        .enqueue_all(&mut tx, (0..100).map(|_| Message::new("t", b"{}".to_vec())))
        .unwrap();
    tx.commit().unwrap();
    let rows: i64 = client
        .query_one(
            &format!("SELECT count(*) FROM {}", common::quoted(&outbox)),
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(rows, 103);
}

/// A producer of a caller's key holds the next cut off until it commits: a cut in between
/// would let the same key go into the next partition unseen.
#[test]
fn a_cut_waits_for_producers_of_the_callers_keys() {
    let (outbox, mut client) = partitioned("part_cut_wait");
    let (started, wait) = mpsc::channel();
    let (release, released) = mpsc::channel::<()>();
    let producer = {
        let outbox = outbox.clone();
        std::thread::spawn(move || {
            let mut client = common::client();
            let mut tx = client.transaction().unwrap();
            outbox.enqueue(&mut tx, message("held")).unwrap();
            started.send(()).unwrap();
            released.recv().unwrap();
            tx.commit().unwrap();
        })
    };
    wait.recv().unwrap();
    // The upkeep gives up on its lock after a second, and the open partition stays open.
    upkeep(&mut client, &outbox, true);
    let during = enqueue(&mut client, &outbox, Message::new("t", b"{}".to_vec())).unwrap();
    assert!(partition_of(&mut client, &outbox, &during).ends_with("_p0"));
    release.send(()).unwrap();
    producer.join().unwrap();
    cut(&mut client, &outbox);
    let after = enqueue(&mut client, &outbox, Message::new("t", b"{}".to_vec())).unwrap();
    assert!(partition_of(&mut client, &outbox, &after).ends_with("_p1"));
}

/// Backdates when the sent rows of `keys` were sent.
fn sent_days_ago(client: &mut Client, outbox: &Outbox, keys: &[&str], days: i32) {
    client
        .execute(
            &format!(
                "UPDATE {} SET done_at = now() - $2::int * interval '1 day' WHERE key = ANY($1)",
                common::quoted(outbox)
            ),
            &[&keys, &days],
        )
        .expect("backdate");
}

#[test]
fn retention_drops_a_partition_whole_once_every_row_in_it_is_sent() {
    let (outbox, mut client) = partitioned("part_retire");
    for i in 0..5 {
        enqueue(&mut client, &outbox, message(&format!("old-{i}"))).unwrap();
    }
    enqueue(&mut client, &outbox, message("doomed").max_attempts(1)).unwrap();
    cut(&mut client, &outbox);
    for i in 0..2 {
        enqueue(&mut client, &outbox, message(&format!("mid-{i}"))).unwrap();
    }
    cut(&mut client, &outbox);
    enqueue(&mut client, &outbox, message("new")).unwrap();
    let published = Sink::default();
    let config = relay_config(&outbox, {
        let published = published.clone();
        move |record| {
            if record.key == "doomed" {
                return Err(postgres_outbox::PublishError::permanent("refused"));
            }
            published.push(record);
            Ok(())
        }
    });
    Relay::run_until_idle(&config).expect("run until idle");
    assert_eq!(published.len(), 8);
    let sent = Rows::Sent.matching(Filter::new());

    // Partition 0 holds a dead letter: it stays, and so does every row in it, but retention
    // goes on past it; the open partition never goes.
    assert_eq!(outbox.would_purge(&mut client, sent.clone()).unwrap(), 2);
    assert_eq!(outbox.purge(&mut client, sent.clone()).unwrap(), 2);
    assert_eq!(partitions(&mut client, &outbox), vec![0, 2, 3, 4]);
    assert_eq!(common::stats(&outbox, &mut client).sent, 6);
    assert_eq!(outbox.purge(&mut client, sent.clone()).unwrap(), 0);

    // Once the dead letter is gone, each partition is judged by when its own rows were
    // sent: partition 0, one of whose rows went out after the cutoff, stays; partition 2,
    // after it, whose rows all went out before, goes.
    assert_eq!(
        outbox
            .purge(&mut client, Rows::Dead.matching(Filter::new()))
            .unwrap(),
        1
    );
    cut(&mut client, &outbox);
    sent_days_ago(
        &mut client,
        &outbox,
        &["old-0", "old-1", "old-2", "old-3", "new"],
        2,
    );
    let day_old = Rows::Sent.matching(Filter::new().older_than(Duration::from_secs(86_400)));
    assert_eq!(outbox.would_purge(&mut client, day_old.clone()).unwrap(), 1);
    assert_eq!(outbox.purge(&mut client, day_old.clone()).unwrap(), 1);
    assert_eq!(partitions(&mut client, &outbox), vec![0, 3, 4, 5]);
    assert_eq!(outbox.purge(&mut client, day_old).unwrap(), 0);
    assert_eq!(outbox.purge(&mut client, sent.clone()).unwrap(), 5);
    assert_eq!(partitions(&mut client, &outbox), vec![3, 4, 5]);
    let stats = common::stats(&outbox, &mut client);
    assert_eq!((stats.sent, stats.pending, stats.dead), (0, 0, 0));

    // A filter by anything but age deletes rows, as on a plain table.
    enqueue(&mut client, &outbox, message("newest")).unwrap();
    assert_eq!(send_all(&outbox).len(), 1);
    assert_eq!(outbox.purge(&mut client, sent).unwrap(), 0);
    let by_topic = Rows::Sent.matching(Filter::new().topic("t"));
    assert_eq!(outbox.purge(&mut client, by_topic).unwrap(), 1);
    assert_eq!(common::stats(&outbox, &mut client).sent, 0);
    assert_eq!(send_all(&outbox).len(), 0);
}

#[test]
fn only_an_empty_table_becomes_partitioned() {
    let table = unique_name("part_refused");
    let plain = Outbox::new(&table).unwrap();
    let mut client = client();
    plain.migrate(&mut client).unwrap();
    enqueue(&mut client, &plain, message("kept")).unwrap();
    let asked = yearly(&table);
    let err = asked.migrate(&mut client).unwrap_err();
    assert!(err.is_invalid_input(), "{err}");
    assert!(err.to_string().contains("holds rows"), "{err}");
    let kind: String = client
        .query_one(
            "SELECT relkind::text FROM pg_class WHERE oid = to_regclass($1)",
            &[&common::quoted(&plain)],
        )
        .unwrap()
        .get(0);
    assert_eq!(kind, "r");
    assert_eq!(partition_of(&mut client, &plain, "kept"), plain.table());

    for bad in [
        Duration::from_secs(59),
        Duration::from_secs(367 * 24 * 3600),
    ] {
        let err = Outbox::builder()
            .table(&table)
            .partition_interval(bad)
            .build()
            .unwrap_err();
        assert!(err.is_invalid_input(), "{err}");
    }
}

#[test]
fn the_sql_script_makes_the_same_partitioned_table_and_runs_again() {
    let table = format!("{}.{}", common::schema(), unique_name("part_script"));
    let outbox = yearly(&table);
    let mut client = client();
    let script = outbox.sql();
    client.batch_execute(&script).expect("the script");
    client.batch_execute(&script).expect("the script again");
    outbox.migrate(&mut client).expect("migrate finds it done");
    assert_eq!(partitions(&mut client, &outbox), vec![0, 1, 2]);
    let key = enqueue(&mut client, &outbox, message("scripted")).unwrap();
    assert!(partition_of(&mut client, &outbox, &key).ends_with("_p0"));
    assert_eq!(send_all(&outbox).keys(), vec!["scripted".to_owned()]);
}

/// The script of a name without a schema renders the upkeep's functions without one too:
/// they still make partitions, in the table's schema, as the owner's.
#[test]
fn the_sql_script_of_a_name_without_a_schema_keeps_its_partitions() {
    let outbox = yearly(unique_name("part_bare"));
    let mut client = client();
    client.batch_execute(&outbox.sql()).expect("the script");
    assert_eq!(partitions(&mut client, &outbox), vec![0, 1, 2]);
    cut(&mut client, &outbox);
    assert_eq!(partitions(&mut client, &outbox), vec![0, 1, 2, 3]);
    let (schema, _) = partition_table(&mut client, &outbox, 3);
    assert_eq!(schema, common::schema());
    // stats() finds where the sequence stands through its function, bare names and all.
    enqueue(&mut client, &outbox, message("bare")).unwrap();
    assert_eq!(common::stats(&outbox, &mut client).pending, 1);
    // Retention too: partition 0, closed and empty, goes.
    let sent = Rows::Sent.matching(Filter::new());
    assert_eq!(outbox.purge(&mut client, sent).unwrap(), 0);
    assert_eq!(partitions(&mut client, &outbox), vec![1, 2, 3]);
}

/// The problem of the doctor's partitions finding, if it has one.
fn partitions_finding(client: &mut Client, outbox: &Outbox) -> Option<String> {
    outbox
        .health(client)
        .unwrap()
        .findings
        .into_iter()
        .find(|f| f.check == Check::Partitions)
        .map(|f| f.problem)
}

#[test]
fn the_doctor_reports_missing_partitions_and_a_cut_overdue() {
    let (outbox, mut client) = partitioned("part_doctor");
    assert_eq!(partitions_finding(&mut client, &outbox), None);
    drop_partitions(&mut client, &outbox, &[1, 2]);
    let problem = partitions_finding(&mut client, &outbox).expect("a partitions finding");
    assert!(problem.contains("no partition ahead"), "{problem}");
    upkeep(&mut client, &outbox, false);
    assert_eq!(partitions_finding(&mut client, &outbox), None);

    // Open for more than twice its interval: no relay has cut it.
    client
        .execute(
            &format!(
                "UPDATE {} SET opened_at = now() - interval '800 days' WHERE n = 0",
                quoted_with(&outbox, "_partitions")
            ),
            &[],
        )
        .unwrap();
    let problem = partitions_finding(&mut client, &outbox).expect("a partitions finding");
    assert!(problem.contains("no cut happened"), "{problem}");
    cut(&mut client, &outbox);
    assert_eq!(partitions_finding(&mut client, &outbox), None);
}

/// What keeps partition `n` from settling, as the doctor reports it.
fn held_back(client: &mut Client, outbox: &Outbox, n: i64) -> Option<HeldBack> {
    let health = outbox.health(client).unwrap();
    let partition = health.partitions.iter().find(|p| p.number == n);
    partition.expect("the partition").held_back
}

/// Sets partition `n` closed long before its interval of a year ran out.
fn closed_long_ago(client: &mut Client, outbox: &Outbox, n: i64) {
    client
        .execute(
            &format!(
                "UPDATE {} SET closed_at = now() - interval '800 days' WHERE n = $1",
                quoted_with(outbox, "_partitions")
            ),
            &[&n],
        )
        .unwrap();
}

/// A closed partition that does not settle may be kept by retention, and brings back the
/// cost of every partition after it: past its interval the doctor says so, and why, for each
/// of the things that can hold it (a pending row, a dead letter, a transaction from before
/// its cut, no upkeep since its cut), until it settles.
#[test]
fn the_doctor_says_what_keeps_a_closed_partition_from_settling() {
    let (outbox, mut client) = partitioned("part_held");
    enqueue(&mut client, &outbox, message("waiting")).unwrap();
    enqueue(&mut client, &outbox, message("doomed").max_attempts(1)).unwrap();
    let mut producer = common::client();
    let mut late = producer.transaction().unwrap();
    // A key of the crate's: a producer of the caller's keys would hold the cut back.
    outbox
        .enqueue(&mut late, Message::new("t", "late"))
        .unwrap();
    cut(&mut client, &outbox);
    assert_eq!(held_back(&mut client, &outbox, 0), Some(HeldBack::Pending));
    // Closed for less than its interval: nothing to report yet.
    assert_eq!(partitions_finding(&mut client, &outbox), None);
    closed_long_ago(&mut client, &outbox, 0);
    let problem = partitions_finding(&mut client, &outbox).expect("a partitions finding");
    assert!(problem.contains("partition 0 "), "{problem}");
    assert!(problem.contains("messages to send"), "{problem}");
    assert!(problem.contains("retention keeps it whole"), "{problem}");
    let after = partitions(&mut client, &outbox).len() - 1;
    assert!(
        problem.contains(&format!("reads it and {after} partitions after it")),
        "{problem}"
    );

    let config = refusing(&outbox, "doomed");
    assert_eq!(Relay::run_until_idle(&config).unwrap(), 2);
    upkeep(&mut client, &outbox, false);
    assert_eq!(held_back(&mut client, &outbox, 0), Some(HeldBack::Kept(1)));
    let problem = partitions_finding(&mut client, &outbox).expect("a partitions finding");
    assert!(
        problem.contains("keeps 1 dead letter or parked"),
        "{problem}"
    );

    assert_eq!(
        outbox
            .purge(&mut client, Rows::Dead.matching(Filter::new()))
            .unwrap(),
        1
    );
    upkeep(&mut client, &outbox, false);
    assert_eq!(
        held_back(&mut client, &outbox, 0),
        Some(HeldBack::Transactions)
    );
    let problem = partitions_finding(&mut client, &outbox).expect("a partitions finding");
    assert!(problem.contains("may still write into it"), "{problem}");
    // No row holds it: retention may drop it.
    assert!(!problem.contains("retention"), "{problem}");

    late.commit().unwrap();
    assert_eq!(held_back(&mut client, &outbox, 0), Some(HeldBack::Pending));
    assert_eq!(send_all(&outbox).len(), 1);
    wait_settled(&mut client, &outbox, 0);
    let health = outbox.health(&mut client).unwrap();
    assert!(health.partitions[0].settled.is_some());
    assert!(health.partitions.iter().all(|p| p.held_back.is_none()));
    assert_eq!(partitions_finding(&mut client, &outbox), None);

    // A cut with no upkeep after it: nothing is in partition 1, and nothing settles it.
    client
        .query_one(
            &format!("SELECT {}(true)", quoted_with(&outbox, "_partition")),
            &[],
        )
        .unwrap();
    closed_long_ago(&mut client, &outbox, 1);
    assert_eq!(held_back(&mut client, &outbox, 1), Some(HeldBack::NoUpkeep));
    let problem = partitions_finding(&mut client, &outbox).expect("a partitions finding");
    assert!(problem.contains("no upkeep has settled it"), "{problem}");
    wait_settled(&mut client, &outbox, 1);
    assert_eq!(partitions_finding(&mut client, &outbox), None);
}

/// Under REPEATABLE READ and SERIALIZABLE a snapshot taken before a cut may miss a key
/// committed just before it, in the partition before: an enqueue of a caller's key in such
/// a transaction, alone or in a batch, is a serialization failure, to be retried; one that
/// began after the cut goes in.
#[test]
fn a_repeatable_read_producer_older_than_the_last_cut_is_told_to_retry() {
    let (outbox, mut client) = partitioned("part_rr");
    let mut early = common::client();
    let mut tries = Vec::new();
    for (level, batch) in [
        (postgres::IsolationLevel::RepeatableRead, false),
        (postgres::IsolationLevel::RepeatableRead, true),
        (postgres::IsolationLevel::Serializable, false),
        (postgres::IsolationLevel::Serializable, true),
    ] {
        let key = format!("before-the-cut-{}", tries.len());
        let mut tx = early
            .build_transaction()
            .isolation_level(level)
            .start()
            .unwrap();
        tx.batch_execute("SELECT 1").unwrap();
        enqueue(&mut client, &outbox, message(&key)).unwrap();
        cut(&mut client, &outbox);
        let err = if batch {
            outbox
                .enqueue_all(&mut tx, [message("fresh"), message(&key)])
                .unwrap_err()
        } else {
            outbox.enqueue(&mut tx, message(&key)).unwrap_err()
        };
        tries.push((level, batch, err.as_db_error().map(|e| e.code().clone())));
        tx.rollback().unwrap();
    }
    for (level, batch, code) in tries {
        assert_eq!(
            code,
            Some(SqlState::T_R_SERIALIZATION_FAILURE),
            "{level:?}, batch: {batch}"
        );
    }
    // Keys of the crate's own need no look, and no retry.
    let mut tx = early
        .build_transaction()
        .isolation_level(postgres::IsolationLevel::RepeatableRead)
        .start()
        .unwrap();
    let err = outbox
        .enqueue(&mut tx, message("before-the-cut-0"))
        .unwrap_err();
    assert!(err.is_duplicate_key(), "{err}");
    outbox
        .enqueue(&mut tx, Message::new("t", b"{}".to_vec()))
        .unwrap();
    outbox.enqueue(&mut tx, message("after-the-cut")).unwrap();
    tx.commit().unwrap();
}

/// A producer that drew its id in the open partition and has not committed when the cut
/// comes holds the partition: its drop waits for it (a second), gives up, and leaves every
/// row where it is; once its row is sent, the partition goes.
#[test]
fn retention_waits_for_a_producer_still_writing_to_the_partition() {
    let (outbox, mut client) = partitioned("part_retire_wait");
    enqueue(&mut client, &outbox, message("sent-early")).unwrap();
    send_all(&outbox);
    let mut slow = common::client();
    let mut tx = slow.transaction().unwrap();
    outbox
        .enqueue(&mut tx, Message::new("t", b"{}".to_vec()))
        .unwrap();
    // Keys of the crate's own do not hold the cut back.
    cut(&mut client, &outbox);
    let all_sent = Rows::Sent.matching(Filter::new());
    assert_eq!(outbox.purge(&mut client, all_sent.clone()).unwrap(), 0);
    assert_eq!(partitions(&mut client, &outbox), vec![0, 1, 2, 3]);
    tx.commit().unwrap();
    assert_eq!(outbox.purge(&mut client, all_sent.clone()).unwrap(), 0);
    assert_eq!(send_all(&outbox).len(), 1);
    // Whatever isolation the session defaults to, the drop looks under READ COMMITTED.
    client
        .batch_execute("SET default_transaction_isolation = 'repeatable read'")
        .unwrap();
    assert_eq!(outbox.purge(&mut client, all_sent).unwrap(), 2);
    assert_eq!(partitions(&mut client, &outbox), vec![1, 2, 3]);
    assert_eq!(common::stats(&outbox, &mut client).sent, 0);
}

/// The sequence moves only to a partition an earlier, committed transaction made: a cut in
/// the transaction that made it, rolled back, leaves producers where they were.
#[test]
fn a_cut_never_points_at_a_partition_that_may_roll_back() {
    let (outbox, mut client) = partitioned("part_rollback");
    drop_partitions(&mut client, &outbox, &[1, 2]);
    let mut tx = client.transaction().unwrap();
    let cut = format!("SELECT {}(true)", quoted_with(&outbox, "_partition"));
    tx.batch_execute(&cut).unwrap();
    tx.batch_execute(&cut).unwrap();
    tx.rollback().unwrap();
    let key = enqueue(&mut client, &outbox, message("still-p0")).unwrap();
    assert!(partition_of(&mut client, &outbox, &key).ends_with("_p0"));
    assert_eq!(partitions(&mut client, &outbox), vec![0]);
    // Made now, cut by the next call.
    assert_eq!(upkeep(&mut client, &outbox, true), Some(2));
    assert_eq!(upkeep(&mut client, &outbox, true), Some(1));
    let key = enqueue(&mut client, &outbox, message("now-p1")).unwrap();
    assert!(partition_of(&mut client, &outbox, &key).ends_with("_p1"));
}

/// The partitions settled: closed, every row sent, out of reach of any producer.
fn settled(client: &mut Client, outbox: &Outbox) -> Vec<i64> {
    client
        .query(
            &format!(
                "SELECT n FROM {} WHERE settled_at IS NOT NULL ORDER BY n",
                quoted_with(outbox, "_partitions")
            ),
            &[],
        )
        .expect("settled partitions")
        .iter()
        .map(|row| row.get(0))
        .collect()
}

/// Runs the upkeep until partition `n` is settled (a transaction of another test that ran
/// at the cut holds it back until it ends).
fn wait_settled(client: &mut Client, outbox: &Outbox, n: i64) {
    wait_until(&format!("partition {n} is settled"), || {
        upkeep(client, outbox, false);
        settled(client, outbox).contains(&n)
    });
}

/// Partition 0, where nothing pending is visible, stays unsettled while `late` runs, which
/// drew its row's id (`key`) there before the cut; the row is counted once committed, and
/// the partition settles once it is sent.
fn settles_once_the_late_row_is_sent(
    client: &mut Client,
    outbox: &Outbox,
    late: postgres::Transaction<'_>,
    key: &str,
) {
    assert!(upkeep(client, outbox, false).is_some());
    assert_eq!(settled(client, outbox), Vec::<i64>::new());
    late.commit().unwrap();
    assert!(partition_of(client, outbox, key).ends_with("_p0"));
    assert_eq!(common::stats(outbox, client).pending, 1);
    assert_eq!(send_all(outbox).len(), 1);
    wait_settled(client, outbox, 0);
}

/// `stats` plans its reads from the first partition that may still hold a backlog. A
/// closed partition settles once every row in it is sent and no transaction that ran at
/// its cut runs still: a producer that drew its id before the cut and commits after it is
/// counted, not hidden.
#[test]
fn stats_reads_from_the_first_partition_that_may_hold_a_backlog() {
    let (outbox, mut client) = partitioned("part_settle");
    enqueue(&mut client, &outbox, message("early")).unwrap();
    let mut producer = common::client();
    let mut late = producer.transaction().unwrap();
    // A key of the crate's: a producer of the caller's keys would hold the cut back.
    let key = outbox
        .enqueue(&mut late, Message::new("t", "late"))
        .unwrap();
    let vxid: String = late
        .query_one(
            "SELECT virtualxid FROM pg_locks
             WHERE locktype = 'virtualxid' AND pid = pg_backend_pid()",
            &[],
        )
        .unwrap()
        .get(0);
    cut(&mut client, &outbox);
    let written_down: bool = client
        .query_one(
            &format!(
                "SELECT coalesce($1 = ANY (cut_vxids), false) FROM {} WHERE n = 0",
                quoted_with(&outbox, "_partitions")
            ),
            &[&vxid],
        )
        .unwrap()
        .get(0);
    assert!(written_down, "the cut did not write down {vxid}");
    assert_eq!(send_all(&outbox).len(), 1);
    settles_once_the_late_row_is_sent(&mut client, &outbox, late, &key);
    assert_eq!(common::stats(&outbox, &mut client).sent, 2);
    // A pending row in a settled partition, which nothing but a hand can write, is out of
    // the reads of `stats` (not of `stats_exact`): the partition is left out.
    client
        .execute(
            &format!(
                "INSERT INTO {} (id, key, topic, payload) OVERRIDING SYSTEM VALUE
                 VALUES (1000, 'by-hand', 't', '\\x00')",
                common::quoted(&outbox)
            ),
            &[],
        )
        .unwrap();
    assert_eq!(outbox.stats(&mut client).unwrap().pending, 0);
    assert!(outbox.topic_stats(&mut client).unwrap().is_empty());
    assert_eq!(outbox.stats_exact(&mut client).unwrap().pending, 1);
}

/// A prepared transaction holds every closed partition unsettled: its row is in one of
/// them, invisible until it commits, and its producer's session is gone.
#[test]
fn a_prepared_transaction_holds_partitions_unsettled() {
    let node = PgNode::start();
    node.allow_prepared_transactions();
    let outbox = yearly("part_prepared");
    let mut client = node.client();
    outbox.migrate(&mut client).unwrap();

    let mut preparer = node.client();
    let mut tx = preparer.transaction().unwrap();
    outbox
        .enqueue(&mut tx, Message::new("t", "prepared"))
        .unwrap();
    tx.batch_execute("PREPARE TRANSACTION 'outbox-late'")
        .unwrap();
    // The transaction is the server's now: what the client does with its own is moot.
    drop(tx);
    drop(preparer);
    cut(&mut client, &outbox);
    upkeep(&mut client, &outbox, false);
    assert_eq!(settled(&mut client, &outbox), Vec::<i64>::new());
    client
        .batch_execute("COMMIT PREPARED 'outbox-late'")
        .unwrap();
    assert_eq!(common::stats(&outbox, &mut client).pending, 1);

    let config = common::relay_config_with(
        &outbox,
        Connections::open(node.url().parse().unwrap(), NoTls),
        |_: &Record| Ok(()),
    );
    assert_eq!(Relay::run_until_idle(&config).unwrap(), 1);
    upkeep(&mut client, &outbox, false);
    assert_eq!(settled(&mut client, &outbox), vec![0]);
    assert_eq!(common::stats(&outbox, &mut client).pending, 0);
}

/// Whether `key`'s row was marked its aggregate's head at enqueue.
fn is_head(client: &mut Client, outbox: &Outbox, key: &str) -> bool {
    client
        .query_one(
            &format!("SELECT head FROM {} WHERE key = $1", common::quoted(outbox)),
            &[&key],
        )
        .expect("the row")
        .get(0)
}

/// An enqueue looks for an aggregate's pending messages only from the first partition not
/// settled: past settled partitions, but never past one that still holds a pending message,
/// whether by a single enqueue, a batch, or a batch copied in.
#[test]
fn an_aggregate_pending_in_an_older_partition_keeps_its_order() {
    let (outbox, mut client) = partitioned("part_heads");
    let aggregate = |key: &str, of: &str| message(key).aggregate_key(of);
    enqueue(&mut client, &outbox, aggregate("x1", "x")).unwrap();
    assert_eq!(send_all(&outbox).keys(), ["x1"]);
    cut(&mut client, &outbox);
    wait_settled(&mut client, &outbox, 0);
    for (key, of) in [("a1", "a"), ("b1", "b"), ("c1", "c")] {
        enqueue(&mut client, &outbox, aggregate(key, of)).unwrap();
    }
    cut(&mut client, &outbox);
    upkeep(&mut client, &outbox, false);
    assert_eq!(settled(&mut client, &outbox), vec![0]);

    // Each aggregate's only pending message is in partition 1.
    enqueue(&mut client, &outbox, aggregate("a2", "a")).unwrap();
    let mut tx = client.transaction().unwrap();
    outbox
        .enqueue_all(&mut tx, [aggregate("b2", "b"), aggregate("y1", "y")])
        .unwrap();
    tx.commit().unwrap();
    // From 64 messages due at once, with the crate's keys, a batch is copied in.
    let copied = std::iter::once(Message::new("t", "c2").aggregate_key("c"))
        .chain((0..70).map(|i| Message::new("t", "z").aggregate_key(format!("z{i}"))));
    let mut tx = client.transaction().unwrap();
    let copied_keys = outbox.enqueue_all(&mut tx, copied).unwrap();
    tx.commit().unwrap();
    let c2 = copied_keys[0].clone();
    for key in ["a1", "b1", "c1"] {
        assert!(
            partition_of(&mut client, &outbox, key).ends_with("_p1"),
            "{key}"
        );
    }
    for key in ["a2", "b2", c2.as_str()] {
        assert!(
            partition_of(&mut client, &outbox, key).ends_with("_p2"),
            "{key}"
        );
        assert!(
            !is_head(&mut client, &outbox, key),
            "{key} is behind a pending message"
        );
    }
    assert!(is_head(&mut client, &outbox, "y1"));
    assert!(is_head(&mut client, &outbox, &copied_keys[1]));

    let sent: Vec<Record> = send_all(&outbox).records();
    assert_eq!(sent.len(), 77);
    for (of, order) in [
        ("a", ["a1", "a2"]),
        ("b", ["b1", "b2"]),
        ("c", ["c1", c2.as_str()]),
    ] {
        let keys: Vec<&str> = sent
            .iter()
            .filter(|r| r.aggregate_key.as_deref() == Some(of))
            .map(|r| r.key.as_str())
            .collect();
        assert_eq!(keys, order, "aggregate {of}");
    }
}

/// Whether a function `suffix` of `outbox` looks for pending messages only in the
/// partitions that may hold them (not quiet).
fn probes_from_the_backlog(client: &mut Client, outbox: &Outbox, suffix: &str) -> bool {
    let row = client
        .query_one(
            "SELECT count(*), coalesce(bool_or(strpos(pg_get_functiondef(oid),
                                                      '(o.id >= look[1]') > 0), false)
             FROM pg_proc WHERE proname = $1 AND pg_function_is_visible(oid)",
            &[&format!("{}{suffix}", outbox.table())],
        )
        .expect("the functions");
    assert!(row.get::<_, i64>(0) > 0, "no function {suffix}");
    row.get(1)
}

/// A partitioned table's enqueue functions are those of sql/functions/enqueue_partitioned.sql,
/// made again when `<table>_functions` records another text of them (as a table partitioned
/// by a build before a change to the file has); a plain table keeps its own.
#[test]
fn a_partitioned_tables_enqueue_functions_are_made_again_from_their_file() {
    let (outbox, mut client) = partitioned("part_probes");
    let functions = ["_enqueue", "_busy"];
    for suffix in functions {
        assert!(probes_from_the_backlog(&mut client, &outbox, suffix));
    }
    // As a table partitioned before the file's change has them.
    client
        .execute(
            &format!(
                "UPDATE {} SET hash = 'earlier' WHERE name = 'enqueue_partitioned'",
                quoted_with(&outbox, "_functions")
            ),
            &[],
        )
        .unwrap();
    for suffix in functions {
        let definition: String = client
            .query_one(
                "SELECT pg_get_functiondef($1::text::regproc)",
                &[&quoted_with(&outbox, suffix)],
            )
            .unwrap()
            .get(0);
        let everywhere = definition.replace("(o.id >= look[1]", "(true OR o.id >= look[1]");
        client.batch_execute(&everywhere).unwrap();
        assert!(!probes_from_the_backlog(&mut client, &outbox, suffix));
    }
    outbox.migrate(&mut client).unwrap();
    for suffix in functions {
        assert!(
            probes_from_the_backlog(&mut client, &outbox, suffix),
            "{suffix}"
        );
    }

    let plain = Outbox::new(&unique_name("part_probes_plain")).unwrap();
    plain.migrate(&mut client).unwrap();
    for suffix in functions {
        assert!(
            !probes_from_the_backlog(&mut client, &plain, suffix),
            "{suffix}"
        );
    }
}

/// Enqueues `message` and says how many times it scanned partitions 0, 1 and 2, whole or by
/// their ordered index (where the look for an aggregate's pending messages goes). (The
/// counts are the session's since the server last took them in, so the difference is read
/// in one transaction, where it takes in none.)
fn looks_into(client: &mut Client, outbox: &Outbox, message: Message) -> [i64; 5] {
    let scans = |tx: &mut postgres::Transaction| -> Vec<i64> {
        let rows = tx
            .query(
                "SELECT coalesce(pg_stat_get_xact_numscans(to_regclass($1 || n)), 0)
                        + coalesce((SELECT sum(pg_stat_get_xact_numscans(i.indexrelid))
                                    FROM pg_index i
                                    WHERE i.indrelid = to_regclass($1 || n)
                                      AND pg_get_indexdef(i.indexrelid)
                                          LIKE '%(head, aggregate_key, id)%'), 0)::bigint
                 FROM unnest(ARRAY[0, 1, 2, 3, 4]) AS n ORDER BY n",
                &[&format!("{}_p", outbox.table())],
            )
            .expect("scans");
        rows.iter().map(|row| row.get(0)).collect()
    };
    let mut tx = client.transaction().unwrap();
    let before = scans(&mut tx);
    outbox.enqueue(&mut tx, message).unwrap();
    let after = scans(&mut tx);
    tx.commit().unwrap();
    [0, 1, 2, 3, 4].map(|n| after[n] - before[n])
}

/// Whether partition `n` is quiet: left out of producers' looks.
fn is_quiet(client: &mut Client, outbox: &Outbox, n: i64) -> bool {
    let sql = format!(
        "SELECT quiet_at IS NOT NULL FROM {} WHERE n = $1",
        quoted_with(outbox, "_partitions")
    );
    client.query_one(&sql, &[&n]).expect("the partition").get(0)
}

/// Waits until partition `n` is quiet: until no transaction that ran at its cut (other
/// tests' too) is left.
fn wait_quiet(client: &mut Client, outbox: &Outbox, n: i64) {
    wait_until(&format!("partition {n} is quiet"), || {
        upkeep(client, outbox, false);
        is_quiet(client, outbox, n)
    });
}

/// A dead letter kept in a closed partition keeps it from settling, but the partition is
/// quiet: producers' looks for their aggregates' pending messages leave it out (as they
/// leave out settled ones), and only `topic_stats()` still reads it. A redrive makes it part of
/// the looks again before its row is pending, so the aggregate's order holds.
#[test]
fn a_dead_letter_kept_is_left_out_of_producers_looks_until_it_is_redriven() {
    let (outbox, mut client) = partitioned("part_quiet");
    let of = |key: &str, aggregate: &str| message(key).aggregate_key(aggregate);
    enqueue(&mut client, &outbox, of("doomed", "a").max_attempts(1)).unwrap();
    enqueue(&mut client, &outbox, of("fine", "b")).unwrap();
    cut(&mut client, &outbox);
    let config = refusing(&outbox, "doomed");
    assert_eq!(Relay::run_until_idle(&config).unwrap(), 2);
    wait_quiet(&mut client, &outbox, 0);
    assert_eq!(held_back(&mut client, &outbox, 0), Some(HeldBack::Kept(1)));
    let [into_0, into_1, ..] = looks_into(&mut client, &outbox, of("c2", "c"));
    // (A look may scan an index once for each value of the head flag.)
    assert!(into_0 == 0 && into_1 > 0, "{into_0} {into_1}");
    // stats() counts the dead letter there (and agrees with stats_exact()).
    let stats = common::stats(&outbox, &mut client);
    assert_eq!((stats.dead, stats.pending, stats.sent), (1, 1, 1));
    assert_eq!(by_topic(&mut client, &outbox), [("t".to_owned(), 1, 1)]);
    closed_long_ago(&mut client, &outbox, 0);
    let problem = partitions_finding(&mut client, &outbox).expect("a partitions finding");
    assert!(
        problem.contains("each topic_stats() reads it for its dead letters"),
        "{problem}"
    );
    assert!(!problem.contains("each enqueue"), "{problem}");
    // Cut with c2 still to send: enqueues look from partition 1 on, and the doctor says so.
    cut(&mut client, &outbox);
    let problem = partitions_finding(&mut client, &outbox).expect("a partitions finding");
    assert!(
        problem.contains("each enqueue with an aggregate key reads partition 1 "),
        "{problem}"
    );
    assert_eq!(send_all(&outbox).keys(), vec!["c2".to_owned()]);

    // Redriven, the dead letter goes before what its aggregate enqueues next.
    assert_eq!(
        outbox
            .redrive(&mut client, Filter::new().key("doomed"))
            .unwrap(),
        1
    );
    assert!(looks_into(&mut client, &outbox, of("a2", "a"))[0] > 0);
    assert!(!is_head(&mut client, &outbox, "a2"));
    let sent = send_all(&outbox).keys();
    let a: Vec<&String> = sent
        .iter()
        .filter(|k| ["doomed", "a2"].contains(&k.as_str()))
        .collect();
    assert_eq!(a, ["doomed", "a2"]);
    // Once the transactions from before the second cut (other tests' too) have ended.
    wait_settled(&mut client, &outbox, 0);
    wait_settled(&mut client, &outbox, 1);
    // Partitions 0 and 1 settled; the look reads the open one, 2, alone.
    let looks = looks_into(&mut client, &outbox, of("c3", "c"));
    assert!(looks[0] == 0 && looks[1] == 0 && looks[2] > 0, "{looks:?}");
}

/// The dead letters partition `n` was counted to hold when it became quiet.
fn counted_dead(client: &mut Client, outbox: &Outbox, n: i64) -> Option<i64> {
    let sql = format!(
        "SELECT dead FROM {} WHERE n = $1",
        quoted_with(outbox, "_partitions")
    );
    client.query_one(&sql, &[&n]).expect("the partition").get(0)
}

/// Makes `dead` dead letters (`doomed-1`, ...) and a sent row in partition 0, cuts, and
/// waits until the partition is quiet.
fn dead_letters_in_partition_0(client: &mut Client, outbox: &Outbox, dead: usize) {
    for i in 1..=dead {
        let doomed = message(&format!("doomed-{i}")).max_attempts(1);
        enqueue(client, outbox, doomed).unwrap();
    }
    enqueue(client, outbox, message("fine")).unwrap();
    cut(client, outbox);
    let config = refusing(outbox, "doomed-");
    assert_eq!(Relay::run_until_idle(&config).unwrap(), dead + 1);
    wait_quiet(client, outbox, 0);
}

/// A partition of more dead letters than the upkeep counts (100,000) is not quiet: the
/// looks and `stats()` read it, and the upkeep, having found it so, does not count them
/// again until a purge changes them.
#[test]
fn a_partition_of_too_many_dead_letters_is_read_not_counted() {
    let (outbox, mut client) = partitioned("part_many_dead");
    too_many_dead_letters_in_partition_0(&mut client, &outbox);
    // Its probe for rows still to send and dead letters, through the indexes, alone.
    assert!(upkeep_reads_in_partition_0(&mut client, &outbox) < 1_000);
    assert_eq!(counted_dead(&mut client, &outbox, 0), Some(-1));
    assert_eq!(common::stats(&outbox, &mut client).dead, 100_001);

    let all = Rows::Dead.matching(Filter::new());
    assert_eq!(outbox.purge(&mut client, all).unwrap(), 100_001);
    wait_settled(&mut client, &outbox, 0);
    assert_eq!(common::stats(&outbox, &mut client).dead, 0);
}

/// A partition of too many dead letters to count, whose letters are then all deleted by
/// hand, not by a purge: the upkeep finds none left, and it settles.
#[test]
fn a_partition_of_too_many_dead_letters_deleted_by_hand_settles() {
    let (outbox, mut client) = partitioned("part_many_by_hand");
    too_many_dead_letters_in_partition_0(&mut client, &outbox);
    client
        .execute(
            &format!("DELETE FROM {} WHERE status = 'dead'", quoted(&outbox)),
            &[],
        )
        .unwrap();
    wait_settled(&mut client, &outbox, 0);
    assert_eq!(counted_dead(&mut client, &outbox, 0), Some(0));
    assert_eq!(common::stats(&outbox, &mut client).dead, 0);
}

/// A dead letter made by hand in a quiet partition leaves its count too low: a purge of
/// more dead letters than counted there has the upkeep count them again, never leaving
/// the count below zero.
#[test]
fn a_purge_of_more_dead_letters_than_counted_has_them_counted_again() {
    let (outbox, mut client) = partitioned("part_undercounted");
    dead_letters_in_partition_0(&mut client, &outbox, 1);
    assert_eq!(counted_dead(&mut client, &outbox, 0), Some(1));
    client
        .execute(
            &format!(
                "UPDATE {} SET status = 'dead' WHERE key = 'fine'",
                quoted(&outbox)
            ),
            &[],
        )
        .unwrap();
    let all = Rows::Dead.matching(Filter::new());
    assert_eq!(outbox.purge(&mut client, all).unwrap(), 2);
    assert_eq!(counted_dead(&mut client, &outbox, 0), None);
    wait_settled(&mut client, &outbox, 0);
    assert_eq!(common::stats(&outbox, &mut client).dead, 0);
}

/// Until the upkeep counts it again, a quiet partition whose count a purge cleared is read
/// by `stats()`, whose dead letters then stay exact: here two made by hand beside the one
/// counted, and two of the three purged.
#[test]
fn a_quiet_partition_whose_count_a_purge_cleared_is_read_until_counted_again() {
    let (outbox, mut client) = partitioned("part_recount");
    enqueue(&mut client, &outbox, message("doomed-1").max_attempts(1)).unwrap();
    for key in ["fine-1", "fine-2"] {
        enqueue(&mut client, &outbox, message(key)).unwrap();
    }
    cut(&mut client, &outbox);
    let config = refusing(&outbox, "doomed-");
    assert_eq!(Relay::run_until_idle(&config).unwrap(), 3);
    wait_quiet(&mut client, &outbox, 0);
    assert_eq!(counted_dead(&mut client, &outbox, 0), Some(1));
    let by_hand = format!(
        "UPDATE {} SET status = 'dead' WHERE key LIKE 'fine-%'",
        quoted(&outbox)
    );
    client.execute(&by_hand, &[]).unwrap();
    let two = Rows::Dead.matching(Filter::new().keys(["doomed-1", "fine-1"]));
    assert_eq!(outbox.purge(&mut client, two).unwrap(), 2);
    assert_eq!(counted_dead(&mut client, &outbox, 0), None);
    assert!(is_quiet(&mut client, &outbox, 0));
    assert_eq!(common::stats(&outbox, &mut client).dead, 1);
    wait_until("partition 0 counted again", || {
        upkeep(&mut client, &outbox, false);
        counted_dead(&mut client, &outbox, 0).is_some()
    });
    assert_eq!(counted_dead(&mut client, &outbox, 0), Some(1));
    assert_eq!(common::stats(&outbox, &mut client).dead, 1);
}

/// Makes 100,001 dead letters in partition 0 (more than the upkeep counts), as relays would
/// have left them, with the count cleared (as after a purge by an older version), and runs
/// the upkeep, which counts them and marks the partition (not quiet, -1).
fn too_many_dead_letters_in_partition_0(client: &mut Client, outbox: &Outbox) {
    dead_letters_in_partition_0(client, outbox, 1);
    client
        .batch_execute(&format!(
            "INSERT INTO {} (id, key, topic, payload, status, attempts, done_at)
             OVERRIDING SYSTEM VALUE
             SELECT 1000000 + i, 'many-' || i, 't', '', 'dead', 1, now()
             FROM generate_series(1, 100000) AS i;
             UPDATE {} SET dead = NULL WHERE n = 0",
            quoted(outbox),
            quoted_with(outbox, "_partitions")
        ))
        .unwrap();
    assert!(upkeep_reads_in_partition_0(client, outbox) > 100_000);
    assert!(!is_quiet(client, outbox, 0));
    assert_eq!(counted_dead(client, outbox, 0), Some(-1));
}

/// The rows and index entries of partition 0 one upkeep reads.
fn upkeep_reads_in_partition_0(client: &mut Client, outbox: &Outbox) -> i64 {
    let read = |tx: &mut postgres::Transaction| -> i64 {
        tx.query_one(
            "SELECT pg_stat_get_xact_tuples_returned(to_regclass($1))
                    + pg_stat_get_xact_tuples_fetched(to_regclass($1))
                    + (SELECT coalesce(sum(pg_stat_get_xact_tuples_returned(i.indexrelid)), 0)
                       FROM pg_index i WHERE i.indrelid = to_regclass($1))::bigint",
            &[&format!("{}_p0", outbox.table())],
        )
        .expect("reads")
        .get(0)
    };
    let mut tx = client.transaction().unwrap();
    let before = read(&mut tx);
    upkeep(&mut tx, outbox, false);
    let after = read(&mut tx);
    tx.commit().unwrap();
    after - before
}

/// `topic_stats()` as (topic, pending, dead).
fn by_topic(client: &mut Client, outbox: &Outbox) -> Vec<(String, u64, u64)> {
    let topics = outbox.topic_stats(client).expect("topic_stats");
    topics
        .into_iter()
        .map(|t| (t.topic, t.pending, t.dead))
        .collect()
}

/// What `read` returns while partitions `numbers` are locked against reads by another
/// session: a statement of `read` that touches one of them fails after 10 s.
fn with_partitions_locked<T>(
    client: &mut Client,
    outbox: &Outbox,
    numbers: &[i64],
    read: impl FnOnce(&mut Client) -> T,
) -> T {
    let mut holder = common::client();
    let mut held = holder.transaction().unwrap();
    for n in numbers {
        let partition = quoted_with(outbox, &format!("_p{n}"));
        held.batch_execute(&format!("LOCK TABLE {partition} IN ACCESS EXCLUSIVE MODE"))
            .unwrap();
    }
    client.batch_execute("SET lock_timeout = '10s'").unwrap();
    let read = read(client);
    client.batch_execute("RESET lock_timeout").unwrap();
    held.rollback().unwrap();
    read
}

/// The server process of `client`'s session.
fn backend_pid(client: &mut Client) -> i32 {
    client
        .query_one("SELECT pg_backend_pid()", &[])
        .expect("pid")
        .get(0)
}

/// Waits until the session of server process `pid` waits for a lock.
fn wait_for_a_lock(client: &mut Client, pid: i32) {
    wait_until(&format!("process {pid} waits for a lock"), || {
        client
            .query_one(
                "SELECT EXISTS (SELECT FROM pg_locks WHERE NOT granted AND pid = $1)",
                &[&pid],
            )
            .unwrap()
            .get(0)
    });
}

/// A purge and a redrive of dead letters in the same two quiet partitions both lock the
/// partitions' bookkeeping, in the same order whatever the plan: waiting behind a third
/// transaction that holds the first, neither holds the second while it waits, so they never
/// deadlock, whichever comes first.
#[test]
fn a_purge_and_a_redrive_across_the_same_partitions_do_not_deadlock() {
    for redrive_first in [true, false] {
        purge_beside_redrive(redrive_first);
    }
}

fn purge_beside_redrive(redrive_first: bool) {
    let (outbox, mut client) = partitioned("part_lock_order");
    for n in 0..2 {
        for key in ["purged", "redriven"] {
            let doomed = message(&format!("doomed-{key}-{n}")).max_attempts(1);
            enqueue(&mut client, &outbox, doomed).unwrap();
        }
        cut(&mut client, &outbox);
    }
    let config = refusing(&outbox, "doomed-");
    assert_eq!(Relay::run_until_idle(&config).unwrap(), 4);
    for n in 0..2 {
        wait_quiet(&mut client, &outbox, n);
    }

    let partitions = quoted_with(&outbox, "_partitions");
    // Partition 0's row after partition 1's in the table, so that a scan of the table
    // meets them out of order.
    client
        .execute(
            &format!("UPDATE {partitions} SET every = every WHERE n = 0"),
            &[],
        )
        .unwrap();
    let mut holder = common::client();
    let mut held = holder.transaction().unwrap();
    held.execute(
        &format!("SELECT FROM {partitions} WHERE n = 0 FOR UPDATE"),
        &[],
    )
    .unwrap();
    let keys = |what: &str| {
        Filter::new()
            .key(format!("doomed-{what}-0"))
            .key(format!("doomed-{what}-1"))
    };
    let (purge, redrive) = (keys("purged"), keys("redriven"));
    // The first to wait is the first to lock partition 0 once it is free.
    let mut runs = Vec::new();
    for redriving in [redrive_first, !redrive_first] {
        let mut session = common::client();
        // Plans that read the bookkeeping in its table's order, not the partitions'.
        session
            .batch_execute("SET enable_indexscan = off; SET enable_bitmapscan = off")
            .unwrap();
        let pid = backend_pid(&mut session);
        let (outbox, purge, redrive) = (outbox.clone(), purge.clone(), redrive.clone());
        runs.push(std::thread::spawn(move || {
            if redriving {
                outbox.redrive(&mut session, redrive)
            } else {
                outbox.purge(&mut session, Rows::Dead.matching(purge))
            }
        }));
        wait_for_a_lock(&mut client, pid);
    }
    held.commit().unwrap();
    for run in runs {
        assert_eq!(run.join().unwrap().unwrap(), 2);
    }
    // Both partitions hold pending rows again: read, not counted.
    for n in 0..2 {
        assert_eq!(counted_dead(&mut client, &outbox, n), None);
    }
    let stats = common::stats(&outbox, &mut client);
    assert_eq!((stats.pending, stats.dead), (2, 0));
}

/// `topic_stats()` reads the dead letters of the quiet partitions that hold some, and no
/// other quiet partition: partitions 0 and 3 hold a dead letter, 1 and 2 sent rows alone,
/// 4 is open, and partition 2, locked against every read, holds it up in nothing.
#[test]
fn topic_stats_reads_only_the_quiet_partitions_that_hold_dead_letters() {
    let (outbox, mut client) = partitioned("part_topic_dead");
    for n in 0..4 {
        if n == 0 || n == 3 {
            let doomed = message(&format!("doomed-{n}")).max_attempts(1);
            enqueue(&mut client, &outbox, doomed).unwrap();
        }
        enqueue(&mut client, &outbox, message(&format!("fine-{n}"))).unwrap();
        cut(&mut client, &outbox);
    }
    let config = refusing(&outbox, "doomed-");
    assert_eq!(Relay::run_until_idle(&config).unwrap(), 6);
    for n in 0..4 {
        wait_quiet(&mut client, &outbox, n);
    }
    enqueue(&mut client, &outbox, message("later")).unwrap();

    let topics = with_partitions_locked(&mut client, &outbox, &[2], |client| {
        by_topic(client, &outbox)
    });
    assert_eq!(topics, [("t".to_owned(), 1, 2)]);
    let stats = common::stats(&outbox, &mut client);
    assert_eq!((stats.pending, stats.dead), (1, 2));
}

/// `stats()` and `topic_stats()` read no partition past the one the id sequence stands in
/// (`<table>_ids_drawn`): the partitions made ahead are left out of their plans, here locked
/// against reads. They go by the sequence, not the bookkeeping: moved into partition 1 by
/// hand, as a cut moves it before its bookkeeping commits, the row drawn there is counted.
/// So does a role of a relay's rights, with PUBLIC's EXECUTE on the function revoked.
#[test]
fn stats_leave_out_the_partitions_past_the_last_id_drawn() {
    let (outbox, mut client) = partitioned("part_ids_drawn");
    assert_eq!(partitions(&mut client, &outbox), [0, 1, 2]);
    enqueue(&mut client, &outbox, message("first")).unwrap();
    let counted = |client: &mut Client| {
        let stats = outbox.stats(client).expect("stats");
        (stats.pending, stats.exact, by_topic(client, &outbox))
    };
    let topics = |pending: u64| vec![("t".to_owned(), pending, 0)];
    assert_eq!(
        with_partitions_locked(&mut client, &outbox, &[1, 2], counted),
        (1, true, topics(1))
    );

    client
        .execute(
            "SELECT setval(pg_get_serial_sequence($1, 'id'), $2, false)",
            &[&common::quoted(&outbox), &(1_i64 << 40)],
        )
        .unwrap();
    enqueue(&mut client, &outbox, message("drawn-past")).unwrap();
    assert_eq!(
        partition_of(&mut client, &outbox, "drawn-past"),
        format!("{}_p1", outbox.table())
    );
    assert_eq!(
        with_partitions_locked(&mut client, &outbox, &[2], counted),
        (2, true, topics(2))
    );
    assert_eq!(common::stats(&outbox, &mut client).pending, 2);

    // PUBLIC may call the function; a relay's role is granted it by name too.
    client
        .batch_execute(&format!(
            "REVOKE EXECUTE ON FUNCTION {}() FROM PUBLIC",
            quoted_with(&outbox, "_ids_drawn")
        ))
        .unwrap();
    let role = Role::new(&mut client);
    role.grant(&mut client, &outbox, Access::Relay);
    let mut as_role = role.client();
    assert_eq!(
        with_partitions_locked(&mut as_role, &outbox, &[2], counted),
        (2, true, topics(2))
    );
}

/// The partition ids are drawn in is read whatever its bookkeeping says: here its row
/// deleted by hand.
#[test]
fn stats_read_the_partition_ids_are_drawn_in_without_its_bookkeeping() {
    let (outbox, mut client) = partitioned("part_no_row");
    enqueue(&mut client, &outbox, message("open")).unwrap();
    client
        .execute(
            &format!(
                "DELETE FROM {} WHERE n = 0",
                quoted_with(&outbox, "_partitions")
            ),
            &[],
        )
        .unwrap();
    assert_eq!(common::stats(&outbox, &mut client).pending, 1);
    assert_eq!(by_topic(&mut client, &outbox), [("t".to_owned(), 1, 0)]);
}

/// A purge from a session whose default is REPEATABLE READ, waiting for a partition's
/// bookkeeping that another transaction (as the upkeep would) updates, takes its dead
/// letter off the count that transaction left, where an update under its own snapshot
/// would fail.
#[test]
fn a_purge_in_a_repeatable_read_session_waits_for_the_bookkeeping_and_goes_on() {
    let (outbox, mut client) = partitioned("part_purge_rr");
    dead_letters_in_partition_0(&mut client, &outbox, 2);
    assert_eq!(counted_dead(&mut client, &outbox, 0), Some(2));
    let mut holder = common::client();
    let mut held = holder.transaction().unwrap();
    held.execute(
        &format!(
            "UPDATE {} SET dead = dead WHERE n = 0",
            quoted_with(&outbox, "_partitions")
        ),
        &[],
    )
    .unwrap();
    let mut session = common::client();
    session
        .batch_execute("SET default_transaction_isolation = 'repeatable read'")
        .unwrap();
    let pid = backend_pid(&mut session);
    let purging = {
        let outbox = outbox.clone();
        let doomed = Rows::Dead.matching(Filter::new().key("doomed-1"));
        std::thread::spawn(move || outbox.purge(&mut session, doomed))
    };
    wait_for_a_lock(&mut client, pid);
    held.commit().unwrap();
    assert_eq!(purging.join().unwrap().unwrap(), 1);
    assert_eq!(counted_dead(&mut client, &outbox, 0), Some(1));
    assert_eq!(common::stats(&outbox, &mut client).dead, 1);
}

/// Each of `held`, scheduled for tomorrow, in a partition of its own (0, 2, 4, ...), and
/// after each a sent row (`sent-<n>`) and a dead letter (`doomed-<n>`) in the next (1, 3,
/// 5, ...), cut after each partition; sends what can be sent, and waits until the
/// partitions of dead letters are quiet.
fn held_between_dead_letters<const N: usize>(
    client: &mut Client,
    outbox: &Outbox,
    held: [Message; N],
) {
    for (i, message_held) in held.into_iter().enumerate() {
        let tomorrow = message_held.delay(Duration::from_secs(86_400));
        enqueue(client, outbox, tomorrow).unwrap();
        cut(client, outbox);
        let n = 2 * i + 1;
        enqueue(client, outbox, message(&format!("sent-{n}"))).unwrap();
        let doomed = message(&format!("doomed-{n}")).max_attempts(1);
        enqueue(client, outbox, doomed).unwrap();
        cut(client, outbox);
    }
    let config = refusing(outbox, "doomed");
    assert_eq!(Relay::run_until_idle(&config).unwrap(), 2 * N);
    for i in 0..N {
        wait_quiet(client, outbox, 2 * i as i64 + 1);
    }
}

/// A message held in an old partition (here one scheduled for tomorrow) keeps that
/// partition from being quiet, and no longer the ones after it: producers'
/// looks read the partitions held, and the open one, leaving out the quiet ones between
/// (19 and 21); so does `stats()`.
/// Partitions 0 and 2 hold a message for tomorrow, of aggregates `a` and `c`; 1 and 3 a
/// sent row and a dead letter each; 4 is open.
#[test]
fn a_message_held_in_an_old_partition_keeps_no_later_one_in_the_looks() {
    let (outbox, mut client) = partitioned("part_scheduled");
    let of = |key: &str, aggregate: &str| message(key).aggregate_key(aggregate);
    held_between_dead_letters(
        &mut client,
        &outbox,
        [of("tomorrow-0", "a"), of("tomorrow-2", "c")],
    );
    assert!(!is_quiet(&mut client, &outbox, 0) && !is_quiet(&mut client, &outbox, 2));

    let looks = looks_into(&mut client, &outbox, of("b", "b"));
    assert!(looks[0] > 0 && looks[1] == 0, "{looks:?}");
    assert!(looks[2] > 0 && looks[3] == 0 && looks[4] > 0, "{looks:?}");
    // Each held message still goes before its aggregate's next one.
    for aggregate in ["a", "c"] {
        let next = format!("{aggregate}2");
        enqueue(&mut client, &outbox, of(&next, aggregate)).unwrap();
        assert!(!is_head(&mut client, &outbox, &next), "{next}");
    }
    // stats() counts the dead letters of partitions 1 and 3, and agrees with stats_exact().
    let stats = common::stats(&outbox, &mut client);
    assert_eq!(
        (stats.pending, stats.blocked, stats.dead, stats.sent),
        (5, 2, 2, 2)
    );
    assert_eq!(by_topic(&mut client, &outbox), [("t".to_owned(), 5, 2)]);
    // It reads no quiet partition: 1 and 3 are locked against reads meanwhile.
    let stats = with_partitions_locked(&mut client, &outbox, &[1, 3], |client| {
        outbox.stats(client).unwrap()
    });
    assert_eq!((stats.pending, stats.dead, stats.exact), (5, 2, true));

    // A `Producer`'s messages too: its head function looks into partitions 0 and 2 alone.
    for aggregate in ["a", "c"] {
        let next = produce(&outbox, aggregate);
        assert!(!is_head(&mut client, &outbox, &next), "{aggregate}");
    }
    assert!(is_head(&mut client, &outbox, &produce(&outbox, "d")));
}

/// Enqueues a message of `aggregate` with the crate's key through a `Producer`, whose
/// ordered INSERT marks the head by the head function; returns its key.
fn produce(outbox: &Outbox, aggregate: &str) -> String {
    let mut producer = outbox.producer(common::client()).unwrap();
    let mut tx = producer.transaction().unwrap();
    let key = tx
        .enqueue(Message::new("t", b"{}".to_vec()).aggregate_key(aggregate))
        .unwrap();
    tx.commit().unwrap();
    key
}

/// Messages held in more old partitions than `stats()` reads in ranges (four): it reads
/// the first three alone, and from the fourth on every partition in one range, the quiet
/// ones between with their dead letters, which it then counts once (read, not counted).
/// Partitions 0, 2, 4, 6 and 8 hold a message for tomorrow; 1, 3, 5, 7 and 9 a sent row
/// and a dead letter each; 10 is open, with a message.
#[test]
fn stats_count_each_dead_letter_once_past_four_runs_of_held_partitions() {
    let (outbox, mut client) = partitioned("part_held_runs");
    let held = [0, 2, 4, 6, 8].map(|n| message(&format!("tomorrow-{n}")));
    held_between_dead_letters(&mut client, &outbox, held);
    enqueue(&mut client, &outbox, message("open")).unwrap();
    let stats = common::stats(&outbox, &mut client);
    assert_eq!((stats.pending, stats.dead, stats.sent), (6, 5, 5));
    assert_eq!(by_topic(&mut client, &outbox), [("t".to_owned(), 6, 5)]);

    // Counts no reader of 7 and 9 could take for theirs, and 1, 3 and 5 locked against reads.
    client
        .execute(
            &format!(
                "UPDATE {} SET dead = 100 WHERE n IN (7, 9)",
                quoted_with(&outbox, "_partitions")
            ),
            &[],
        )
        .unwrap();
    let stats = with_partitions_locked(&mut client, &outbox, &[1, 3, 5], |client| {
        outbox.stats(client).unwrap()
    });
    assert_eq!((stats.pending, stats.dead, stats.exact), (6, 5, true));
}

/// Messages held in more old partitions than an enqueue's look reads alone (three): it
/// reads the first three alone and every partition from the fourth on, so the quiet ones
/// between the first three are left out, and a message held in any of them
/// still goes before its aggregate's next one, single or in a batch. Partitions 0, 2, 4, 6
/// and 8 hold a message for tomorrow, of aggregates `a0` to `a8`; 1, 3, 5, 7 and 9 a sent
/// row and a dead letter each; 10 is open.
#[test]
fn an_enqueue_looks_into_three_held_partitions_alone_and_every_one_from_the_fourth() {
    let (outbox, mut client) = partitioned("part_look_runs");
    let of = |aggregate: &str| Message::new("t", b"{}".to_vec()).aggregate_key(aggregate);
    let held = [0, 2, 4, 6, 8].map(|n| of(&format!("a{n}")).key(format!("tomorrow-{n}")));
    held_between_dead_letters(&mut client, &outbox, held);

    // Keys of the crate's own: a key the caller gives is looked for in every partition.
    let enqueued = with_partitions_locked(&mut client, &outbox, &[1, 3, 5], |client| {
        let mut tx = client.transaction().unwrap();
        let mut keys = vec![outbox.enqueue(&mut tx, of("b")).unwrap()];
        let batch = ["a0", "c", "a6", "a8"].map(of);
        keys.extend(outbox.enqueue_all(&mut tx, batch).unwrap());
        keys.push(outbox.enqueue(&mut tx, of("a4")).unwrap());
        tx.commit().unwrap();
        keys
    });
    let heads: Vec<bool> = enqueued
        .iter()
        .map(|key| is_head(&mut client, &outbox, key))
        .collect();
    assert_eq!(heads, [true, false, true, false, false, false]);
    for n in [2, 8] {
        let next = enqueue(&mut client, &outbox, of(&format!("a{n}"))).unwrap();
        assert!(!is_head(&mut client, &outbox, &next), "a{n}");
    }

    // The doctor counts the partitions after the oldest one held that each look reads: 2
    // and 4 alone, and 6 to 12 (10 is open, 11 and 12 made ahead).
    assert_eq!(partitions(&mut client, &outbox).last(), Some(&12));
    closed_long_ago(&mut client, &outbox, 0);
    let problem = partitions_finding(&mut client, &outbox).expect("a partitions finding");
    assert!(
        problem.contains("reads it and 9 partitions after it"),
        "{problem}"
    );
}

/// A dead letter set back to pending by hand (or by a redrive of a build that did not mark
/// partitions not quiet) in the oldest quiet partition, as its aggregate's head: the upkeep finds
/// it there and has the looks read that partition again, so the aggregate's next message
/// waits behind it.
#[test]
fn a_row_set_pending_by_hand_in_a_quiet_partition_brings_it_back_into_the_looks() {
    let (outbox, mut client) = partitioned("part_by_hand");
    dead_letters_in_partition_0(&mut client, &outbox, 1);
    client
        .execute(
            &format!(
                "UPDATE {} SET status = 'pending', attempts = 0, aggregate_key = 'by-hand',
                               head = true
                 WHERE key = 'doomed-1'",
                quoted(&outbox)
            ),
            &[],
        )
        .unwrap();
    upkeep(&mut client, &outbox, false);
    assert!(!is_quiet(&mut client, &outbox, 0));
    assert_eq!(counted_dead(&mut client, &outbox, 0), None);
    let next = message("by-hand-next").aggregate_key("by-hand");
    enqueue(&mut client, &outbox, next).unwrap();
    assert!(!is_head(&mut client, &outbox, "by-hand-next"));
}

/// The dead letters of a quiet partition are counted once, by the upkeep that marks it
/// quiet, and `stats()` takes them from that count rather than reading the partition: a
/// purge takes the letters it deletes off the count, and a redrive makes the partition not
/// quiet, to be read until the upkeep counts it again.
#[test]
fn stats_counts_a_quiet_partitions_dead_letters_through_purges_and_redrives() {
    let (outbox, mut client) = partitioned("part_counted");
    dead_letters_in_partition_0(&mut client, &outbox, 3);
    assert_eq!(counted_dead(&mut client, &outbox, 0), Some(3));
    // stats() takes them from the count, which the upkeep makes again once it is cleared
    // (as an operator would, after a purge by an older version).
    let set_count = |client: &mut Client, count: Option<i64>| {
        let sql = format!(
            "UPDATE {} SET dead = $1 WHERE n = 0",
            quoted_with(&outbox, "_partitions")
        );
        client.execute(&sql, &[&count]).unwrap();
    };
    set_count(&mut client, Some(7));
    assert_eq!(outbox.stats(&mut client).unwrap().dead, 7);
    set_count(&mut client, None);
    upkeep(&mut client, &outbox, false);
    assert_eq!(counted_dead(&mut client, &outbox, 0), Some(3));
    let dead = |client: &mut Client| common::stats(&outbox, client).dead;
    assert_eq!(dead(&mut client), 3);

    let purge = |client: &mut Client, key: &str| {
        let letter = Rows::Dead.matching(Filter::new().key(key));
        outbox.purge(client, letter).unwrap()
    };
    assert_eq!(purge(&mut client, "doomed-1"), 1);
    assert_eq!(counted_dead(&mut client, &outbox, 0), Some(2));
    assert_eq!(dead(&mut client), 2);

    assert_eq!(
        outbox
            .redrive(&mut client, Filter::new().key("doomed-2"))
            .unwrap(),
        1
    );
    assert!(!is_quiet(&mut client, &outbox, 0));
    assert_eq!(counted_dead(&mut client, &outbox, 0), None);
    let stats = common::stats(&outbox, &mut client);
    assert_eq!((stats.dead, stats.pending), (1, 1));
    assert_eq!(send_all(&outbox).keys(), vec!["doomed-2".to_owned()]);
    wait_quiet(&mut client, &outbox, 0);
    assert_eq!(counted_dead(&mut client, &outbox, 0), Some(1));
    assert_eq!(dead(&mut client), 1);

    // Its last dead letter gone, it settles.
    assert_eq!(purge(&mut client, "doomed-3"), 1);
    wait_settled(&mut client, &outbox, 0);
    assert_eq!(counted_dead(&mut client, &outbox, 0), Some(0));
    assert_eq!(dead(&mut client), 0);
}

/// A parked message holds its aggregate's later messages back, so its partition stays in
/// producers' looks however long it waits; skipped, it is a dead letter that holds nothing,
/// and the partition is quiet.
#[test]
fn a_parked_message_keeps_its_partition_in_producers_looks() {
    let (outbox, mut client) = partitioned("part_parked");
    let of = |key: &str| message(key).aggregate_key("a");
    let stuck = of("stuck").max_attempts(1).park_on_dead(true);
    enqueue(&mut client, &outbox, stuck).unwrap();
    cut(&mut client, &outbox);
    let config = refusing(&outbox, "stuck");
    assert_eq!(Relay::run_until_idle(&config).unwrap(), 1);
    // Once the transactions the cut wrote down have ended, only the parked row holds it.
    let ended = format!(
        "SELECT p.cut_vxids IS NOT NULL
                AND NOT EXISTS (SELECT FROM pg_locks l WHERE l.locktype = 'virtualxid'
                                                         AND l.virtualxid = ANY (p.cut_vxids))
         FROM {} p WHERE p.n = 0",
        quoted_with(&outbox, "_partitions")
    );
    wait_until("the transactions from before the cut end", || {
        client.query_one(&ended, &[]).unwrap().get(0)
    });
    upkeep(&mut client, &outbox, false);
    assert!(!is_quiet(&mut client, &outbox, 0));
    assert!(looks_into(&mut client, &outbox, of("after"))[0] > 0);
    assert!(!is_head(&mut client, &outbox, "after"));
    let produced = produce(&outbox, "a");
    assert!(!is_head(&mut client, &outbox, &produced));

    assert_eq!(
        outbox
            .skip(&mut client, Filter::new().key("stuck"))
            .unwrap(),
        1
    );
    upkeep(&mut client, &outbox, false);
    assert!(is_quiet(&mut client, &outbox, 0));
    assert_eq!(send_all(&outbox).keys(), vec!["after".to_owned(), produced]);
}

/// The upkeep runs with the owner's rights for a role granted it, and for no other: a relay
/// of its own role cuts, makes partitions ahead and settles them, and a purge by a role
/// granted retention alone drops a partition; before the grant, the same calls are refused
/// and change nothing, and the relay's report and the doctor say why.
#[test]
fn a_relay_and_a_purge_that_do_not_own_the_table_keep_its_partitions() {
    let (outbox, mut client) = partitioned("part_role");
    // A relay's rights but the upkeep's.
    let role = Role::new(&mut client);
    role.grant(&mut client, &outbox, Access::Relay);
    role.execute(
        &mut client,
        &format!(
            "REVOKE EXECUTE ON FUNCTION {}(boolean), {}() FROM {{role}}",
            quoted_with(&outbox, "_partition"),
            quoted_with(&outbox, "_settle")
        ),
    );
    let mut as_role = role.client();
    for i in 0..3 {
        enqueue(&mut client, &outbox, message(&format!("old-{i}"))).unwrap();
    }
    let denied = |result: Result<Option<i32>, postgres::Error>| {
        result.expect_err("refused").code() == Some(&SqlState::INSUFFICIENT_PRIVILEGE)
    };
    let cut_as = |client: &mut Client| {
        client
            .query_one(
                &format!("SELECT {}(true)", quoted_with(&outbox, "_partition")),
                &[],
            )
            .map(|row| row.get::<_, Option<i32>>(0))
    };
    assert!(denied(cut_as(&mut as_role)));
    let sent = Rows::Sent.matching(Filter::new());
    for refused in [
        outbox.purge(&mut as_role, sent.clone()),
        outbox.would_purge(&mut as_role, sent.clone()),
    ] {
        let refused = refused.expect_err("refused");
        assert!(
            refused.to_string().contains("permission denied"),
            "{refused}"
        );
    }
    assert_eq!(partitions(&mut client, &outbox), vec![0, 1, 2]);

    // Its relay sends the rows, and says in its report that its upkeep fails, and why.
    let published = Sink::default();
    let relay = Relay::spawn(common::relay_config_with(
        &outbox,
        role.pool(),
        published.collect(),
    ))
    .expect("spawn");
    let upkeep_error = |client: &mut Client| {
        outbox
            .relays(client)
            .expect("the relays' reports")
            .into_iter()
            .find_map(|report| report.upkeep_error)
    };
    wait_until("the relay reports that its upkeep is refused", || {
        published.len() == 3
            && upkeep_error(&mut client)
                .is_some_and(|e| e.starts_with("[42501] ") && e.contains("permission denied"))
    });
    let finding = partitions_finding(&mut client, &outbox).expect("a finding");
    assert!(
        finding.contains("failed to keep its partitions") && finding.contains("permission denied"),
        "{finding}"
    );

    role.grant(&mut client, &outbox, Access::Relay);
    // A cut by the role: new ids go to partition 1, and partition 2 is left ahead. (NULL
    // while the relay's upkeep, granted now too, holds the upkeep's lock: nothing done.)
    let mut cut = None;
    wait_until("a cut by the role", || {
        cut = cut_as(&mut as_role).expect("cut as the role");
        cut.is_some()
    });
    assert_eq!(cut, Some(1));
    let new = enqueue(&mut client, &outbox, message("new")).unwrap();
    assert!(partition_of(&mut client, &outbox, &new).ends_with("_p1"));

    // Now the relay's upkeep makes partition 3 ahead and settles partition 0, whose table
    // its role has no right to read, and its report says nothing fails.
    wait_until(
        "the role's relay sends every row and keeps the partitions",
        || {
            published.len() == 4
                && partitions(&mut client, &outbox) == vec![0, 1, 2, 3]
                && settled(&mut client, &outbox).contains(&0)
                && upkeep_error(&mut client).is_none()
        },
    );
    assert_eq!(partitions_finding(&mut client, &outbox), None);
    relay.shutdown(Duration::from_secs(10)).expect("shutdown");
    let (_, owner) = partition_table(&mut client, &outbox, 3);
    assert_ne!(owner, role.name, "a partition belongs to the table's owner");

    // A purge by a role granted retention alone drops partition 0 whole.
    let retirer = Role::new(&mut client);
    retirer.grant(&mut client, &outbox, Access::Retire);
    let mut as_retirer = retirer.client();
    assert_eq!(
        outbox.would_purge(&mut as_retirer, sent.clone()).unwrap(),
        3
    );
    assert_eq!(outbox.purge(&mut as_retirer, sent).unwrap(), 3);
    assert_eq!(partitions(&mut client, &outbox), vec![1, 2, 3]);
    drop((as_role, as_retirer));
}

/// The upkeep runs with the owner's rights, so it must call nothing a caller put in its
/// way: a `format` with a closer signature than the built-in's, in the table's own schema
/// and first on the caller's search_path, is never called.
#[test]
fn the_upkeep_calls_no_function_put_in_its_way() {
    let schema = unique_name("shadow");
    let mut client = client();
    client
        .batch_execute(&format!(
            "CREATE SCHEMA {schema};
             CREATE FUNCTION {schema}.format(text, text, text) RETURNS text
             LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION 'a function put in the way ran'; END $$;"
        ))
        .expect("the schema and its function");
    let outbox = yearly(format!("{schema}.events"));
    outbox.migrate(&mut client).expect("migrate");
    client
        .batch_execute(&format!("SET search_path = {schema}, public"))
        .unwrap();
    // A cut, and the partition it leaves missing ahead made again.
    assert_eq!(upkeep(&mut client, &outbox, true), Some(1));
    assert_eq!(upkeep(&mut client, &outbox, false), Some(2));
    assert_eq!(partitions(&mut client, &outbox), vec![0, 1, 2, 3]);
    // And retention: partition 0, closed and empty, goes.
    let sent = Rows::Sent.matching(Filter::new());
    assert_eq!(outbox.purge(&mut client, sent).unwrap(), 0);
    assert_eq!(partitions(&mut client, &outbox), vec![1, 2, 3]);
    client
        .batch_execute(&format!("DROP SCHEMA {schema} CASCADE"))
        .unwrap();
}

/// The CHECK constraints on the outbox table and its partitions, as `table: definition`.
fn checks(client: &mut Client, outbox: &Outbox) -> Vec<String> {
    client
        .query(
            "SELECT conrelid::regclass::text || ': ' || pg_get_constraintdef(oid)
             FROM pg_constraint
             WHERE contype = 'c'
               AND conrelid IN (SELECT $1::text::regclass
                                UNION ALL
                                SELECT inhrelid FROM pg_inherits
                                WHERE inhparent = $1::text::regclass)
             ORDER BY 1",
            &[&common::quoted(outbox)],
        )
        .expect("the table's checks")
        .iter()
        .map(|row| row.get(0))
        .collect()
}

#[test]
fn migration_7_leaves_rows_without_checks_on_tables_and_partitions_made_before_it() {
    let (outbox, mut client) = partitioned("part_checks");
    let plain = Outbox::new(&unique_name("part_checks_plain")).unwrap();
    plain.migrate(&mut client).unwrap();
    cut(&mut client, &outbox);
    assert_eq!(checks(&mut client, &outbox), Vec::<String>::new());
    assert_eq!(checks(&mut client, &plain), Vec::<String>::new());

    // The checks as migrations 1 and 5 left them, and as builds between 0.2.0 and 0.3.0 made
    // a partitioned table: a copy of the table's own on each partition (made by LIKE, which
    // copies the status check as valid, then attached) and each partition's id range. And the application's own, which are
    // not the crate's to drop: on the plain table one is named as a partition's range.
    let status = "CHECK (status IN ('pending', 'sent', 'dead', 'parked'))";
    let budget = "ADD CONSTRAINT max_attempts_check CHECK (max_attempts >= 1)";
    for n in partitions(&mut client, &outbox) {
        client
            .batch_execute(&format!(
                "ALTER TABLE {} ADD CONSTRAINT status {status}, {budget},
                     ADD CONSTRAINT ids CHECK (id >= {n} * 1099511627776
                                               AND id < ({n} + 1) * 1099511627776)",
                quoted_with(&outbox, &format!("_p{n}"))
            ))
            .unwrap();
    }
    // A plain table's status check is migration 5's, NOT VALID; a table made partitioned
    // copied it by LIKE, valid.
    for (table, valid, theirs) in [
        (&outbox, "", ""),
        (&plain, "NOT VALID", ", ADD CONSTRAINT ids CHECK (id > 0)"),
    ] {
        client
            .batch_execute(&format!(
                "ALTER TABLE {} ADD CONSTRAINT status {status} {valid}, {budget},
                     ADD CONSTRAINT short_topics CHECK (length(topic) < 1000){theirs};
                 DELETE FROM {} WHERE version = 7",
                common::quoted(table),
                quoted_with(table, "_migrations")
            ))
            .unwrap();
    }
    let maker = |client: &mut Client| -> (bool, Vec<String>) {
        let row = client
            .query_one(
                "SELECT prosecdef, coalesce(proconfig, '{}') FROM pg_proc
                 WHERE oid = $1::text::regproc",
                &[&quoted_with(&outbox, "_partition")],
            )
            .unwrap();
        (row.get(0), row.get(1))
    };
    let rights = maker(&mut client);
    assert!(rights.0, "{rights:?}");
    let tables = 1 + partitions(&mut client, &outbox).len();
    // Three on the table, four on each partition (the table's, inherited, and its range).
    assert_eq!(checks(&mut client, &outbox).len(), 3 + 4 * (tables - 1));
    assert_eq!(checks(&mut client, &plain).len(), 4);

    for table in [&outbox, &plain] {
        table.migrate(&mut client).unwrap();
    }
    let theirs = |check: &String| {
        check.ends_with(": CHECK ((length(topic) < 1000))") || check.ends_with(": CHECK ((id > 0))")
    };
    let left = checks(&mut client, &outbox);
    assert_eq!(left.len(), tables, "{left:?}");
    assert!(left.iter().all(theirs), "{left:?}");
    let left = checks(&mut client, &plain);
    assert_eq!(left.len(), 2, "{left:?}");
    assert!(left.iter().all(theirs), "{left:?}");
    // The maker, made again, keeps the owner's rights and its search path.
    assert_eq!(maker(&mut client), rights);
    // A partition made since has none of them either: only the application's.
    cut(&mut client, &outbox);
    assert_eq!(checks(&mut client, &outbox).len(), tables + 1);
}
