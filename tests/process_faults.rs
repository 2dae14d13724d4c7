//! `Outbox::process` charges a record only for what its handling did: when marking it sent
//! or the `COMMIT` fails for a fault of the database (a deadlock, a serialization failure),
//! the handler's writes are rolled back and the record is handed back at no attempt's
//! cost; a handler that swallowed an SQL error of its own left its transaction aborted, and
//! that is a failed attempt, never a record sent.

mod common;

use std::thread;

use common::{count, quoted, quoted_with, row_state, wait_until};
use postgres::Client;
use postgres_outbox::{HandlerError, Message, Outbox, ProcessReport};

fn enqueue_one(client: &mut Client, outbox: &Outbox, key: &str) {
    let mut tx = client.transaction().expect("begin");
    outbox
        .enqueue(&mut tx, Message::new("t", b"{}".to_vec()).key(key))
        .expect("enqueue");
    tx.commit().expect("commit");
}

/// A table of the test's own beside the outbox, with rows 1 and 2, for the handler to write.
fn side_table(client: &mut Client, outbox: &Outbox) -> String {
    let table = quoted_with(outbox, "_side");
    client
        .batch_execute(&format!(
            "CREATE TABLE {table} (id int PRIMARY KEY, v int NOT NULL);
             INSERT INTO {table} VALUES (1, 0), (2, 0)"
        ))
        .expect("create the side table");
    table
}

/// Handed back, uncharged, and handled on the next call.
fn handed_back_uncharged(client: &mut Client, outbox: &Outbox, report: &ProcessReport) {
    assert_eq!(
        (
            report.processed,
            report.retried,
            report.dead,
            report.released
        ),
        (0, 0, 0, 1),
        "{report:?}"
    );
    assert_eq!(row_state(client, outbox, "m"), ("pending".into(), 0));
    assert_eq!(
        count(client, outbox, "claims = 0 AND lease_until IS NULL"),
        1
    );
    let report = outbox.process(client, 10, |_, _| Ok(())).expect("process");
    assert_eq!(report.processed, 1);
    assert_eq!(row_state(client, outbox, "m"), ("sent".into(), 1));
}

/// The handler's transaction holds a side row; another transaction holds the outbox row and
/// waits for the side row; marking the record sent then waits for the outbox row: a deadlock,
/// which the server breaks by failing the statement of the transaction that detects it, the
/// last to wait (the other one's `deadlock_timeout` is an hour).
#[test]
fn a_deadlock_marking_a_record_sent_costs_no_attempt() {
    let (outbox, mut client) = common::outbox_uncut("pf_deadlock");
    let side = side_table(&mut client, &outbox);
    enqueue_one(&mut client, &outbox, "m");

    let mut other = common::client();
    let other_pid: i32 = other
        .query_one("SELECT pg_backend_pid()", &[])
        .expect("pid")
        .get(0);
    let mut other = Some(other);
    let mut watcher = common::client();
    let mut holder = None;
    let report = outbox
        .process(&mut client, 10, |tx, record| {
            tx.execute(&format!("UPDATE {side} SET v = v + 1 WHERE id = 1"), &[])
                .map_err(HandlerError::transient)?;
            let (outbox_table, side, key) = (quoted(&outbox), side.clone(), record.key.clone());
            let mut other = other.take().expect("one record, one handler call");
            holder = Some(thread::spawn(move || {
                let mut tx = other.transaction().expect("begin");
                tx.batch_execute("SET LOCAL deadlock_timeout = '1h'")
                    .expect("set deadlock_timeout");
                tx.execute(
                    &format!("SELECT FROM {outbox_table} WHERE key = $1 FOR UPDATE"),
                    &[&key],
                )
                .expect("lock the outbox row");
                // Granted once the handler's transaction is rolled back.
                tx.execute(&format!("SELECT FROM {side} WHERE id = 1 FOR UPDATE"), &[])
                    .expect("lock the side row");
                tx.rollback().expect("rollback");
            }));
            wait_until("the other transaction waits for the side row", || {
                watcher
                    .query_one(
                        "SELECT EXISTS (SELECT FROM pg_locks
                                        WHERE pid = $1 AND NOT granted)",
                        &[&other_pid],
                    )
                    .expect("read pg_locks")
                    .get(0)
            });
            Ok(())
        })
        .expect("process");
    holder
        .expect("the handler ran")
        .join()
        .expect("the other transaction ends");
    let v: i32 = client
        .query_one(&format!("SELECT v FROM {side} WHERE id = 1"), &[])
        .expect("the side row")
        .get(0);
    assert_eq!(v, 0, "the handler's write is rolled back");
    handed_back_uncharged(&mut client, &outbox, &report);
}

/// Write skew under a SERIALIZABLE default: the handler reads row 1 and writes row 2, another
/// transaction reads row 2, writes row 1 and commits first; the handler's transaction then
/// fails (40001) marking the record sent or at its `COMMIT`.
#[test]
fn a_serialization_failure_at_commit_costs_no_attempt() {
    let (outbox, mut client) = common::outbox_uncut("pf_serial");
    let side = side_table(&mut client, &outbox);
    enqueue_one(&mut client, &outbox, "m");
    client
        .batch_execute("SET default_transaction_isolation = 'serializable'")
        .expect("a SERIALIZABLE default");

    let mut other = common::client();
    let report = outbox
        .process(&mut client, 10, |tx, _| {
            tx.query(&format!("SELECT v FROM {side} WHERE id = 1"), &[])
                .map_err(HandlerError::transient)?;
            other
                .batch_execute(&format!(
                    "BEGIN ISOLATION LEVEL SERIALIZABLE; SELECT v FROM {side} WHERE id = 2"
                ))
                .expect("the other transaction reads");
            tx.execute(&format!("UPDATE {side} SET v = v + 1 WHERE id = 2"), &[])
                .map_err(HandlerError::transient)?;
            other
                .batch_execute(&format!("UPDATE {side} SET v = v + 1 WHERE id = 1; COMMIT"))
                .expect("the other transaction commits first");
            Ok(())
        })
        .expect("process");
    let rows: Vec<i32> = client
        .query(&format!("SELECT v FROM {side} ORDER BY id"), &[])
        .expect("the side rows")
        .iter()
        .map(|row| row.get(0))
        .collect();
    assert_eq!(rows, [1, 0], "only the other transaction's write stays");
    handed_back_uncharged(&mut client, &outbox, &report);
}

/// A handler that swallows an SQL error and returns `Ok` left its transaction aborted: the
/// record is not sent (a COMMIT there would only roll back), and the attempt counts.
#[test]
fn a_handler_that_swallowed_an_sql_error_fails_its_attempt() {
    let (outbox, mut client) = common::outbox_uncut("pf_swallowed");
    let side = side_table(&mut client, &outbox);
    enqueue_one(&mut client, &outbox, "m");

    let report = outbox
        .process(&mut client, 10, |tx, _| {
            tx.execute(&format!("UPDATE {side} SET v = v + 1 WHERE id = 1"), &[])
                .map_err(HandlerError::transient)?;
            let swallowed = tx.execute("SELECT 1 / 0", &[]);
            assert!(swallowed.is_err());
            Ok(())
        })
        .expect("process");
    assert_eq!(
        (report.processed, report.retried, report.released),
        (0, 1, 0),
        "{report:?}"
    );
    assert_eq!(row_state(&mut client, &outbox, "m"), ("pending".into(), 1));
    let v: i32 = client
        .query_one(&format!("SELECT v FROM {side} WHERE id = 1"), &[])
        .expect("the side row")
        .get(0);
    assert_eq!(v, 0, "the handler's write is rolled back");
}
