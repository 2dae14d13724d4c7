//! What the crate's statements assume holds whatever the database's or the role's defaults:
//! relay sessions, `process`'s claim and `migrate` run at READ COMMITTED, so a stricter
//! `default_transaction_isolation` (per role or session here; per database it is the same
//! setting) neither fails claims, nor keeps partitions from settling, nor has a migration
//! apply again what another one applied while it waited. And a producer that prepares its
//! transactions (two-phase commit) enqueues with `notify(false)` and never meets the NOTIFY
//! refusal.

mod common;

use std::thread;
use std::time::Duration;

use common::pg_node::PgNode;
use common::{quoted, quoted_with, row_state, wait_until, Role, Sink};
use postgres::error::SqlState;
use postgres::{Client, NoTls};
use postgres_outbox::{Access, Connections, Message, Outbox, Relay};

/// The defaults stricter than READ COMMITTED.
const STRICTER: [&str; 2] = ["repeatable read", "serializable"];

/// A role granted what a relay (and `process`) needs on `outbox`, whose sessions default to
/// `isolation`. Dropped with its grants when it goes.
fn relay_role(client: &mut Client, outbox: &Outbox, isolation: &str) -> Role {
    let role = Role::new(client);
    role.grant(client, outbox, Access::Relay);
    role.execute(
        client,
        &format!("ALTER ROLE {{role}} SET default_transaction_isolation = '{isolation}'"),
    );
    role
}

fn enqueue_one(client: &mut Client, outbox: &Outbox, key: &str) {
    let mut tx = client.transaction().expect("begin");
    outbox
        .enqueue(&mut tx, Message::new("t", b"{}".to_vec()).key(key))
        .expect("enqueue");
    tx.commit().expect("commit");
}

/// Runs `claim` (which claims as `role`) while the table is locked, and changes the due row
/// while the claim waits: a claim whose snapshot was taken before the change (as a
/// transaction snapshot is, under REPEATABLE READ and SERIALIZABLE, before the statement
/// waits for its lock) then meets the row changed since and fails with 40001, as it does
/// whenever another worker claims a row it reaches first. (Only for a statement sent
/// unprepared, as `process` sends its claim: a statement prepared while the table is locked
/// waits at its parse, and runs on a snapshot taken after.) Returns what `claim` returned.
fn claim_past_a_change<T: Send + 'static>(
    client: &mut Client,
    outbox: &Outbox,
    role: &Role,
    key: &str,
    claim: impl FnOnce() -> T + Send + 'static,
) -> T {
    let mut tx = client.transaction().expect("begin");
    tx.batch_execute(&format!("LOCK TABLE {} IN EXCLUSIVE MODE", quoted(outbox)))
        .expect("lock the table");
    let claiming = thread::spawn(claim);
    let mut watcher = common::client();
    wait_until("the claim waits for the table", || {
        watcher
            .query_one(
                "SELECT EXISTS (SELECT FROM pg_stat_activity
                                WHERE usename = $1 AND wait_event_type = 'Lock')",
                &[&role.name],
            )
            .expect("read pg_stat_activity")
            .get(0)
    });
    tx.execute(
        &format!(
            "UPDATE {} SET available_at = available_at WHERE key = $1",
            quoted(outbox)
        ),
        &[&key],
    )
    .expect("change the row");
    tx.commit().expect("commit");
    claiming.join().expect("the claim does not panic")
}

/// The isolation level of every transaction that updates a row of `outbox`, as a trigger
/// of the test's own writes it down; returns how to read what it wrote.
fn watch_isolation(client: &mut Client, outbox: &Outbox) -> String {
    let (seen, watch) = (quoted_with(outbox, "_seen"), quoted_with(outbox, "_watch"));
    client
        .batch_execute(&format!(
            "CREATE TABLE {seen} (isolation text NOT NULL);
             CREATE FUNCTION {watch}() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER AS $$
             BEGIN
                 INSERT INTO {seen} VALUES (current_setting('transaction_isolation'));
                 RETURN NEW;
             END $$;
             CREATE TRIGGER watch BEFORE UPDATE ON {} FOR EACH ROW EXECUTE FUNCTION {watch}()",
            quoted(outbox)
        ))
        .expect("watch the table's updates");
    format!("SELECT DISTINCT isolation FROM {seen}")
}

/// Under REPEATABLE READ or SERIALIZABLE a claim fails (40001) whenever a row it reaches
/// changed after its snapshot, as rows do while other workers claim them (see
/// `process_claims_at_read_committed_whatever_the_session_s_default`, where that is made to
/// happen): a relay's claims and outcomes run at READ COMMITTED whatever its role's default.
#[test]
fn a_relay_claims_and_records_at_read_committed_whatever_the_role_s_default() {
    for isolation in STRICTER {
        let (outbox, mut client) = common::outbox_uncut("sess_relay");
        let role = relay_role(&mut client, &outbox, isolation);
        let seen = watch_isolation(&mut client, &outbox);
        enqueue_one(&mut client, &outbox, "claimed");
        let published = Sink::default();
        let config = common::relay_config_with(&outbox, role.pool(), published.collect());

        assert_eq!(Relay::run_once(&config).expect("run once"), 1);
        assert_eq!(published.keys(), ["claimed"]);
        let levels: Vec<String> = client
            .query(&seen, &[])
            .expect("read what the trigger saw")
            .iter()
            .map(|row| row.get(0))
            .collect();
        assert_eq!(levels, ["read committed"], "under {isolation}");
        assert_eq!(
            row_state(&mut client, &outbox, "claimed"),
            ("sent".into(), 1)
        );
    }
}

#[test]
fn process_claims_at_read_committed_whatever_the_session_s_default() {
    for isolation in STRICTER {
        let (outbox, mut client) = common::outbox_uncut("sess_process");
        let role = relay_role(&mut client, &outbox, isolation);
        enqueue_one(&mut client, &outbox, "processed");

        let (claiming, mut as_role) = (outbox.clone(), role.client());
        let report = claim_past_a_change(&mut client, &outbox, &role, "processed", move || {
            claiming
                .process(&mut as_role, 10, |_, _| Ok(()))
                .map(|report| report.processed)
                .map_err(|e| e.to_string())
        });
        assert_eq!(report, Ok(1), "under {isolation}");
        assert_eq!(
            row_state(&mut client, &outbox, "processed"),
            ("sent".into(), 1)
        );
    }
}

/// The partition upkeep settles a closed partition only under READ COMMITTED: a relay whose
/// role defaults to something stricter settles it all the same.
#[test]
fn a_relay_settles_partitions_whatever_the_role_s_default() {
    for isolation in STRICTER {
        let outbox = Outbox::builder()
            .table(common::unique_name("sess_settle"))
            // Longer than any test: no cut by the clock comes in the middle of it.
            .partition_interval(Duration::from_secs(366 * 24 * 3600))
            .build()
            .expect("valid settings");
        let mut client = common::client();
        outbox.migrate(&mut client).expect("migrate");
        let role = relay_role(&mut client, &outbox, isolation);
        enqueue_one(&mut client, &outbox, "before-the-cut");
        // The cut alone, as the owner: settling is left to the relay.
        let partition = format!("SELECT {}($1)", quoted_with(&outbox, "_partition"));
        for cut in [true, false] {
            client.execute(&partition, &[&cut]).expect("cut");
        }

        let published = Sink::default();
        let relay = Relay::spawn(common::relay_config_with(
            &outbox,
            role.pool(),
            published.collect(),
        ))
        .expect("spawn the relay as its role");
        let settled = format!(
            "SELECT EXISTS (SELECT FROM {} WHERE n = 0 AND settled_at IS NOT NULL)",
            quoted_with(&outbox, "_partitions")
        );
        wait_until(
            &format!("the relay settles partition 0 under {isolation}"),
            || {
                published.len() == 1
                    && client
                        .query_one(&settled, &[])
                        .expect("read the partitions")
                        .get(0)
            },
        );
        relay.shutdown(Duration::from_secs(10)).expect("shutdown");
    }
}

/// The advisory lock `migrate` takes for a schema-qualified `table` (`lock_key` in
/// src/schema/table.rs): FNV-1a of its name behind a prefix.
fn migration_lock(table: &str) -> i64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in "postgres-outbox:".bytes().chain(table.bytes()) {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    i64::from_ne_bytes(hash.to_ne_bytes())
}

/// Two processes migrate at once, one of them in a session defaulting to REPEATABLE READ:
/// it waits for the other's lock, and then sees what the other applied, rather than a
/// snapshot from before the lock that would have it apply every migration again.
#[test]
fn a_migration_waiting_for_another_sees_what_it_applied_whatever_the_default() {
    let table = format!(
        "{}.{}",
        common::schema(),
        common::unique_name("sess_migrate")
    );
    let outbox = Outbox::new(&table).expect("valid outbox");
    let mut first = common::client();
    let mut tx = first.transaction().expect("begin");
    tx.execute(
        "SELECT pg_advisory_xact_lock($1)",
        &[&migration_lock(outbox.table())],
    )
    .expect("take the migration's lock");

    let mut second = common::client();
    second
        .batch_execute("SET default_transaction_isolation = 'repeatable read'")
        .expect("a stricter default");
    let pid: i32 = second
        .query_one("SELECT pg_backend_pid()", &[])
        .expect("pid")
        .get(0);
    let migrating = {
        let outbox = outbox.clone();
        thread::spawn(move || outbox.migrate(&mut second).map_err(|e| e.to_string()))
    };
    let mut watcher = common::client();
    wait_until("the second migration waits for the first", || {
        watcher
            .query_one(
                "SELECT EXISTS (SELECT FROM pg_locks
                                WHERE pid = $1 AND locktype = 'advisory' AND NOT granted)",
                &[&pid],
            )
            .expect("read pg_locks")
            .get(0)
    });
    // The first one: the script of `Outbox::sql`, as a migration tool runs it.
    tx.batch_execute(&outbox.sql()).expect("migrate by script");
    tx.commit().expect("commit");

    assert_eq!(migrating.join().expect("no panic"), Ok(()));
    let mut client = common::client();
    enqueue_one(&mut client, &outbox, "after");
    assert_eq!(common::count(&mut client, &outbox, "true"), 1);
}

/// Relays that say they wait for work, whom an enqueue with notify on notifies.
fn waiting(client: &mut Client, outbox: &Outbox) -> i64 {
    client
        .query_one(
            &format!(
                "SELECT count(*) FROM {} WHERE seen > now() - interval '1 minute'",
                quoted_with(outbox, "_waiting")
            ),
            &[],
        )
        .expect("count waiting relays")
        .get(0)
}

/// PostgreSQL refuses `PREPARE TRANSACTION` in a transaction that ran NOTIFY, and an enqueue
/// notifies while a relay waits: shown here, then `notify(false)`, with which a prepared
/// enqueue (one message, and a batch on the COPY path) commits and ships.
#[test]
fn a_producer_that_prepares_its_transactions_enqueues_with_notify_off() {
    let node = PgNode::start();
    node.allow_prepared_transactions();
    for (table, partitioned) in [("two_phase", false), ("two_phase_parted", true)] {
        let builder = || {
            let builder = Outbox::builder().table(table);
            if partitioned {
                builder.partition_interval(Duration::from_secs(366 * 24 * 3600))
            } else {
                builder
            }
        };
        let notifying = builder().build().expect("valid outbox");
        let quiet = builder().notify(false).build().expect("valid outbox");
        prepared_enqueues_ship(&node, &notifying, &quiet);
    }
}

/// With a relay waiting on `notifying`: its enqueue cannot be prepared, `quiet`'s can.
fn prepared_enqueues_ship(node: &PgNode, notifying: &Outbox, quiet: &Outbox) {
    let mut client = node.client();
    notifying.migrate(&mut client).expect("migrate");
    let published = Sink::default();
    let relay = Relay::spawn(common::relay_config_with(
        notifying,
        Connections::open(node.url().parse().expect("the node's URL"), NoTls),
        published.collect(),
    ))
    .expect("spawn the relay");
    wait_until("the relay listens and waits for work", || {
        relay.is_listening() && waiting(&mut client, notifying) > 0
    });

    let mut producer = node.client();
    let mut tx = producer.transaction().expect("begin");
    notifying
        .enqueue(&mut tx, Message::new("t", "refused").aggregate_key("a"))
        .expect("enqueue");
    let refused = tx
        .batch_execute("PREPARE TRANSACTION 'outbox-notified'")
        .expect_err("a transaction that notified cannot be prepared");
    assert_eq!(refused.code(), Some(&SqlState::FEATURE_NOT_SUPPORTED));
    drop(tx);

    let mut tx = producer.transaction().expect("begin");
    quiet
        .enqueue(&mut tx, Message::new("t", "prepared").aggregate_key("a"))
        .expect("enqueue");
    let batch = (0..64).map(|i| Message::new("t", format!("batch {i}")).aggregate_key("b"));
    assert_eq!(
        quiet.enqueue_all(&mut tx, batch).expect("enqueue").len(),
        64
    );
    tx.batch_execute("PREPARE TRANSACTION 'outbox-quiet'")
        .expect("prepare");
    // The transaction is the server's now: what the client does with its own is moot.
    drop(tx);
    assert_eq!(waiting(&mut client, quiet), 1, "the relay still waits");
    client
        .batch_execute("COMMIT PREPARED 'outbox-quiet'")
        .expect("commit prepared");
    wait_until("the relay ships the prepared messages", || {
        published.len() == 65
    });
    relay.shutdown(Duration::from_secs(10)).expect("shutdown");
}
