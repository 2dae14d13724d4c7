//! `Outbox::health`: each finding provoked for real, on a server of the test's own where
//! the finding is about the whole server (another test's transaction would be the oldest on
//! the shared one).

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::pg_node::PgNode;
use common::{quoted, wait_until};
use postgres::Client;
use postgres_outbox::{
    Check, Health, HealthThresholds, Message, Outbox, PublishError, PublisherState, Record, Relay,
};

fn checks(health: &Health) -> Vec<Check> {
    health.findings.iter().map(|f| f.check).collect()
}

/// Everything at once: no threshold left to wait for.
fn at_once() -> HealthThresholds {
    HealthThresholds::default()
        .transaction_age(Duration::ZERO)
        .prepared_age(Duration::ZERO)
        .due_age(Duration::ZERO)
}

/// An outbox named `table`, migrated on `node`.
fn migrated(node: &PgNode, table: &str) -> (Outbox, Client) {
    let mut client = node.client();
    let outbox = Outbox::new(table).unwrap();
    outbox.migrate(&mut client).unwrap();
    (outbox, client)
}

/// The table an uncut outbox's rows go to: on a partitioned run, its first partition, whose
/// figures the table's add up.
fn rows_in(outbox: &Outbox) -> String {
    if common::partitioned() {
        common::quoted_with(outbox, "_p0")
    } else {
        quoted(outbox)
    }
}

fn enqueue(client: &mut Client, outbox: &Outbox, key: &str) {
    let mut tx = client.transaction().expect("begin");
    outbox
        .enqueue(&mut tx, Message::new("t", "p").key(key))
        .expect("enqueue");
    tx.commit().expect("commit");
}

#[test]
fn a_quiet_outbox_is_healthy_and_reports_its_figures() {
    let node = PgNode::start();
    let (outbox, mut client) = migrated(&node, "quiet");
    client.batch_execute("VACUUM ANALYZE quiet").unwrap();
    let health = outbox.health(&mut client).unwrap();
    assert!(health.is_healthy(), "{:?}", health.findings);
    assert_eq!(health.outbox_table.table, "quiet");
    assert_eq!(health.inbox_table.table, "quiet_inbox");
    // No row for an analyze to measure: no estimate of the space they leave.
    assert_eq!(health.outbox_table.unused_heap_bytes, None);
    assert_eq!(health.inbox_table.unused_heap_bytes, None);
    // This server runs autovacuum, unless a table says otherwise.
    assert!(health.outbox_table.autovacuum && health.inbox_table.autovacuum);
    client
        .batch_execute("ALTER TABLE quiet SET (autovacuum_enabled = off)")
        .unwrap();
    let figures = outbox.health(&mut client).unwrap();
    assert!(!figures.outbox_table.autovacuum && figures.inbox_table.autovacuum);
    assert_eq!(health.oldest_due_age, None);
    assert_eq!(health.oldest_prepared, None);
    assert!(health.slots.is_empty());
    // Even with every threshold at zero, nothing holds the horizon or waits.
    let health = outbox.health_with(&mut client, &at_once()).unwrap();
    assert!(health.is_healthy(), "{:?}", health.findings);
}

#[test]
fn a_transaction_held_open_is_found_with_its_pid() {
    let node = PgNode::start();
    let (outbox, mut client) = migrated(&node, "held");
    let mut holder = node.client();
    let pid: i32 = holder
        .query_one("SELECT pg_backend_pid()", &[])
        .unwrap()
        .get(0);
    holder
        .batch_execute("BEGIN; SELECT txid_current();")
        .unwrap();
    let health = outbox.health_with(&mut client, &at_once()).unwrap();
    assert_eq!(checks(&health), [Check::Transaction]);
    let finding = &health.findings[0];
    assert!(
        finding.problem.contains(&format!("backend {pid} ")),
        "{finding}"
    );
    assert!(finding.remedy.contains("pg_terminate_backend"), "{finding}");
    // Below the default threshold (5 minutes) it is a figure, not a finding.
    let health = outbox.health(&mut client).unwrap();
    assert_eq!(
        health.oldest_transaction.as_ref().unwrap().id,
        pid.to_string()
    );
    assert!(health.is_healthy());
    holder.batch_execute("COMMIT").unwrap();
    let health = outbox.health_with(&mut client, &at_once()).unwrap();
    assert!(health.is_healthy(), "{:?}", health.findings);
}

#[test]
fn a_prepared_transaction_and_a_replication_slot_are_found_by_name() {
    let node = PgNode::start();
    node.allow_prepared_transactions();
    let (outbox, mut client) = migrated(&node, "horizon");

    let mut preparer = node.client();
    preparer
        .batch_execute("BEGIN; SELECT txid_current(); PREPARE TRANSACTION 'stuck-gid';")
        .unwrap();
    let health = outbox.health_with(&mut client, &at_once()).unwrap();
    assert_eq!(checks(&health), [Check::PreparedTransaction]);
    assert!(health.findings[0].problem.contains("'stuck-gid'"));
    assert!(health.findings[0].remedy.contains("ROLLBACK PREPARED"));
    client
        .batch_execute("ROLLBACK PREPARED 'stuck-gid'")
        .unwrap();

    // A physical slot reserving WAL from now on, that nothing reads from.
    client
        .batch_execute("SELECT pg_create_physical_replication_slot('forgotten', true)")
        .unwrap();
    let health = outbox.health_with(&mut client, &at_once()).unwrap();
    assert!(
        health.is_healthy(),
        "below 1 GiB of WAL: {:?}",
        health.findings
    );
    assert_eq!(health.slots.len(), 1);
    assert!(!health.slots[0].active);
    let health = outbox
        .health_with(&mut client, &at_once().slot_wal_bytes(0))
        .unwrap();
    assert_eq!(checks(&health), [Check::ReplicationSlot]);
    assert!(health.findings[0]
        .remedy
        .contains("pg_drop_replication_slot('forgotten')"));
    client
        .batch_execute("SELECT pg_drop_replication_slot('forgotten')")
        .unwrap();
    let health = outbox
        .health_with(&mut client, &at_once().slot_wal_bytes(0))
        .unwrap();
    assert!(health.is_healthy(), "{:?}", health.findings);
}

#[test]
fn a_standby_holding_an_xmin_is_found_with_its_walsender_with_a_slot_or_without() {
    let primary = PgNode::start();
    let (outbox, mut client) = migrated(&primary, "fed");
    client
        .batch_execute("SELECT pg_create_physical_replication_slot('fed_standby', true)")
        .unwrap();
    let standby = PgNode::standby_of(&primary);
    let mut setup = standby.client();
    let set = |setup: &mut Client, setting: &str| {
        setup
            .batch_execute(&format!("ALTER SYSTEM SET {setting}"))
            .unwrap();
        setup.batch_execute("SELECT pg_reload_conf()").unwrap();
    };
    set(&mut setup, "wal_receiver_status_interval = 1");
    set(&mut setup, "hot_standby_feedback = on");
    // A query on the standby keeps its snapshot; its feedback holds an xmin on the primary
    // while the primary goes on.
    let mut reader = standby.client();
    reader
        .batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM pg_class;")
        .unwrap();
    let limits = HealthThresholds::default().slot_xmin_age(20);
    let held = |client: &mut Client, kind: &str| {
        let mut health = None;
        wait_until(
            &format!("the {kind} holds an xmin 20 transactions old"),
            || {
                client
                    .batch_execute("SELECT txid_current()")
                    .expect("burn a transaction id");
                let now = outbox.health_with(client, &limits).unwrap();
                // One walsender: the one before a switch to the slot has gone.
                let held = match &now.slots[..] {
                    [one, rest @ ..] => {
                        one.kind == kind
                            && one.active
                            && one.xmin_age.is_some_and(|a| a >= 20)
                            && rest.iter().all(|s| !s.active)
                    }
                    [] => false,
                };
                health = Some(now);
                held
            },
        );
        let health = health.unwrap();
        let walsender: i32 = client
            .query_one("SELECT pid FROM pg_stat_replication", &[])
            .unwrap()
            .get(0);
        let slot = &health.slots[0];
        assert_eq!(slot.kind, kind);
        assert_eq!(slot.active_pid, Some(walsender as u32));
        assert_eq!(checks(&health), [Check::ReplicationSlot]);
        let finding = health.findings[0].clone();
        assert!(finding.remedy.contains("hot_standby_feedback"), "{finding}");
        (walsender, finding.problem)
    };

    // Without a slot: on the standby's walsender, with no transaction open there.
    let (walsender, problem) = held(&mut client, "feedback");
    assert!(
        problem.starts_with(&format!(
            "standby walreceiver (its walsender pid {walsender}, hot_standby_feedback without \
             a slot) holds an xmin"
        )),
        "{problem}"
    );
    // Through its slot.
    set(&mut setup, "primary_slot_name = 'fed_standby'");
    let (walsender, problem) = held(&mut client, "physical");
    assert!(
        problem.starts_with(&format!(
            "replication slot fed_standby (physical, read by pid {walsender}) holds an xmin"
        )),
        "{problem}"
    );
    // A million transactions by default.
    assert!(outbox.health(&mut client).unwrap().is_healthy());
    reader.batch_execute("COMMIT").unwrap();
    wait_until("the standby lets the slot's xmin go", || {
        client
            .batch_execute("SELECT txid_current()")
            .expect("burn a transaction id");
        outbox
            .health_with(&mut client, &limits)
            .unwrap()
            .is_healthy()
    });
}

#[test]
fn dead_tuples_are_found_once_the_statistics_show_them() {
    let (outbox, mut client) = common::outbox_uncut("bloated");
    let t = quoted(&outbox);
    // Autovacuum must not clean up before the check looks.
    let rows_in = rows_in(&outbox);
    client
        .batch_execute(&format!(
            "ALTER TABLE {rows_in} SET (autovacuum_enabled = false);
             INSERT INTO {t} (key, topic, payload, status)
             SELECT 'gone-' || i, 't', 'p', 'sent' FROM generate_series(1, 500) AS i;
             DELETE FROM {t} WHERE key LIKE 'gone-%';"
        ))
        .unwrap();
    let limits = HealthThresholds::default().dead_tuples(100, 0.0);
    let mut health = None;
    wait_until("the statistics count the dead tuples", || {
        let now = outbox.health_with(&mut client, &limits).unwrap();
        let found = now.outbox_table.dead_tuples >= 500;
        health = Some(now);
        found
    });
    let health = health.unwrap();
    assert!(!health.outbox_table.autovacuum);
    // With autovacuum off, nothing but a hand will vacuum or analyze the table: each its
    // own finding, the 1,000 rows inserted and deleted changes to analyze.
    assert_eq!(
        checks(&health),
        [Check::DeadTuples, Check::Vacuum, Check::Analyze]
    );
    let [dead, vacuum, analyze] = &health.findings[..] else {
        unreachable!()
    };
    let table = outbox.table();
    assert!(
        dead.problem
            .starts_with(&format!("{table} holds 500 dead tuples")),
        "{dead}"
    );
    assert!(dead.remedy.starts_with("run VACUUM (ANALYZE)"));
    assert_eq!(
        vacuum.problem,
        format!("{table} holds 500 dead tuples and autovacuum is off for it (never vacuumed)")
    );
    assert!(vacuum.remedy.starts_with("turn autovacuum on"), "{vacuum}");
    assert!(
        analyze.problem.starts_with(&format!(
            "{table} has 1000 rows changed since its statistics were taken (never analyzed)"
        )),
        "{analyze}"
    );
    assert!(analyze.remedy.starts_with(&format!("run ANALYZE {table}")));
    // The default thresholds ask for 10,000.
    assert!(outbox.health(&mut client).unwrap().is_healthy());
    // Again until one removes them all: a transaction running meanwhile (another test's)
    // keeps the dead tuples it may still see.
    wait_until(
        "a vacuum removes the dead tuples and the statistics see it",
        || {
            client
                .batch_execute(&format!("VACUUM ANALYZE {t}"))
                .unwrap();
            let now = outbox.health_with(&mut client, &limits).unwrap();
            now.outbox_table.dead_tuples == 0
                && now.outbox_table.since_vacuum.is_some()
                && now.outbox_table.changed_since_analyze == 0
        },
    );
    let health = outbox.health_with(&mut client, &limits).unwrap();
    assert!(health.is_healthy(), "{:?}", health.findings);
}

#[test]
fn a_heap_left_empty_and_statistics_long_untaken_are_found() {
    let (outbox, mut client) = common::outbox_uncut("emptied");
    let t = quoted(&outbox);
    let rows_in = rows_in(&outbox);
    // 5,000 rows of 1,000 bytes, all but the last deleted: vacuum frees their space for new
    // rows, but cannot give the file back past the last one.
    client
        .batch_execute(&format!(
            "ALTER TABLE {rows_in} SET (autovacuum_enabled = false);
             INSERT INTO {t} (key, topic, payload, status)
             SELECT 'b-' || i, 't', convert_to(repeat('x', 1000), 'UTF8'), 'sent'
             FROM generate_series(1, 5000) AS i;
             DELETE FROM {t} WHERE key LIKE 'b-%' AND key <> 'b-5000';"
        ))
        .unwrap();
    let limits = HealthThresholds::default()
        .dead_tuples(100, 0.0)
        .bloat(1 << 20, 0.5);
    // The delete's figures reach the statistics after its transaction, maybe after a
    // vacuum started at once: they would count its dead tuples again.
    wait_until("the statistics count the dead tuples", || {
        let now = outbox.health_with(&mut client, &limits).unwrap();
        now.outbox_table.dead_tuples >= 4999
    });
    let mut health = None;
    // Again until one removes them all (see the dead tuples' test).
    wait_until(
        "a vacuum removes the dead tuples and the statistics see it",
        || {
            client
                .batch_execute(&format!("VACUUM ANALYZE {t}"))
                .unwrap();
            let now = outbox.health_with(&mut client, &limits).unwrap();
            let seen = now.outbox_table.live_tuples == 1 && now.outbox_table.dead_tuples == 0;
            health = Some(now);
            seen
        },
    );
    let health = health.unwrap();
    let figures = &health.outbox_table;
    assert!(figures.heap_bytes >= 5 << 20, "{figures:?}");
    assert!(figures.total_bytes > figures.heap_bytes, "{figures:?}");
    let unused = figures.unused_heap_bytes.expect("analyzed");
    assert!(
        unused > figures.heap_bytes - 8192 * 2 && unused < figures.heap_bytes,
        "{figures:?}"
    );
    assert_eq!(checks(&health), [Check::Bloat]);
    let bloat = &health.findings[0];
    let table = outbox.table();
    assert!(
        bloat.problem.starts_with(&format!(
            "{table} takes {} MiB for its rows, about {} MiB of it holding none",
            figures.heap_bytes >> 20,
            unused >> 20
        )),
        "{bloat}"
    );
    assert!(bloat.remedy.contains("pg_repack"), "{bloat}");
    // 1 GiB by default.
    assert!(outbox.health(&mut client).unwrap().is_healthy());

    // Rows changed since an analyze longer ago than the threshold.
    client
        .batch_execute(&format!(
            "INSERT INTO {t} (key, topic, payload, status)
             SELECT 'c-' || i, 't', 'p', 'sent' FROM generate_series(1, 200) AS i"
        ))
        .unwrap();
    let limits = limits.bloat(u64::MAX, 1.0).analyze_age(Duration::ZERO);
    let mut health = None;
    wait_until("the statistics count the rows changed", || {
        let now = outbox.health_with(&mut client, &limits).unwrap();
        let seen = now.outbox_table.changed_since_analyze >= 200;
        health = Some(now);
        seen
    });
    let health = health.unwrap();
    assert_eq!(checks(&health), [Check::Analyze]);
    let analyze = &health.findings[0].problem;
    assert!(
        analyze.starts_with(&format!(
            "{table} has 200 rows changed since its statistics were taken (last analyzed "
        )),
        "{analyze}"
    );
    // A day by default.
    let limits = limits.analyze_age(Duration::from_secs(86_400));
    assert!(outbox
        .health_with(&mut client, &limits)
        .unwrap()
        .is_healthy());
}

#[test]
fn a_row_due_that_no_relay_claims_is_found() {
    let (outbox, mut client) = common::outbox("unclaimed");
    enqueue(&mut client, &outbox, "waiting");
    let limits = HealthThresholds::default().due_age(Duration::from_millis(1));
    wait_until("the row has been due past the threshold", || {
        outbox
            .health_with(&mut client, &limits)
            .unwrap()
            .oldest_due_age
            .is_some_and(|age| age >= Duration::from_millis(1))
    });
    let health = outbox.health_with(&mut client, &limits).unwrap();
    assert!(
        checks(&health).contains(&Check::Due),
        "{:?}",
        health.findings
    );
    // A minute by default: a relay polling every second is far inside it.
    assert!(!checks(&outbox.health(&mut client).unwrap()).contains(&Check::Due));
    // A row scheduled for later is not due.
    let (later, mut client) = common::outbox("scheduled");
    let mut tx = client.transaction().unwrap();
    later
        .enqueue(
            &mut tx,
            Message::new("t", "p").delay(Duration::from_secs(3600)),
        )
        .unwrap();
    tx.commit().unwrap();
    assert_eq!(later.health(&mut client).unwrap().oldest_due_age, None);
}

#[test]
fn a_relay_reports_itself_and_a_publisher_that_is_down_is_found() {
    let (outbox, mut client) = common::outbox("reports");
    enqueue(&mut client, &outbox, "m1");
    let down = Arc::new(AtomicBool::new(true));
    let publish = {
        let down = down.clone();
        move |_: &Record| {
            if down.load(Ordering::SeqCst) {
                return Err(PublishError::unavailable("broker down"));
            }
            Ok(())
        }
    };
    let config = common::relay_config(&outbox, publish).poll_interval(Duration::from_millis(20));
    let relay = Relay::spawn(config).unwrap();
    wait_until("the relay reports its publisher down", || {
        let reports = outbox.relays(&mut client).unwrap();
        matches!(reports.as_slice(), [r] if matches!(r.publisher, PublisherState::Down { .. }))
    });
    let report = outbox.relays(&mut client).unwrap().remove(0);
    assert_eq!(report.pid, std::process::id());
    assert!(report.client_addr.is_some(), "the tests connect over TCP");
    assert!(report.last_seen < Duration::from_secs(30), "{report:?}");
    let health = outbox.health(&mut client).unwrap();
    assert!(
        checks(&health).contains(&Check::Publisher),
        "{:?}",
        health.findings
    );

    down.store(false, Ordering::SeqCst);
    wait_until(
        "the relay reports its publisher up and what it published",
        || {
            let reports = outbox.relays(&mut client).unwrap();
            matches!(reports.as_slice(), [r] if r.publisher == PublisherState::Up && r.published == 1)
        },
    );
    let health = outbox.health(&mut client).unwrap();
    assert!(health.is_healthy(), "{:?}", health.findings);
    relay.shutdown(Duration::from_secs(10)).unwrap();
    assert!(
        outbox.relays(&mut client).unwrap().is_empty(),
        "its report goes with it"
    );
}

#[test]
fn a_row_due_while_the_relays_claim_is_found_as_relays_that_do_not_keep_up() {
    let (outbox, mut client) = common::outbox("behind");
    let mut tx = client.transaction().unwrap();
    for i in 0..100 {
        outbox
            .enqueue(&mut tx, Message::new("t", "p").key(format!("m{i}")))
            .unwrap();
    }
    tx.commit().unwrap();
    let limits = HealthThresholds::default().due_age(Duration::from_millis(300));
    let problem = |client: &mut Client| {
        let health = outbox.health_with(client, &limits).unwrap();
        let due = health.findings.iter().find(|f| f.check == Check::Due);
        due.map(|f| f.problem.clone())
    };
    wait_until("the rows have been due past the threshold", || {
        problem(&mut client).is_some()
    });
    let alone = problem(&mut client).unwrap();
    assert!(alone.ends_with("that no relay claimed"), "{alone}");

    // One worker publishing a row every 100 ms: it claims all the while, and a row waits
    // for seconds.
    let publish = |_: &Record| {
        std::thread::sleep(Duration::from_millis(100));
        Ok(())
    };
    let config = common::relay_config(&outbox, publish)
        .concurrency(1)
        .batch_size(1)
        .poll_interval(Duration::from_millis(250));
    let relay = Relay::spawn(config).unwrap();
    wait_until("the relay reports a claim", || {
        let reports = outbox.relays(&mut client).unwrap();
        matches!(reports.as_slice(), [r] if r.since_claim.is_some())
    });
    let report = outbox.relays(&mut client).unwrap().remove(0);
    assert_eq!(report.poll_interval, Some(Duration::from_millis(250)));
    assert!(report.is_claiming(), "{report:?}");
    let behind = problem(&mut client).expect("rows wait past the threshold");
    assert!(
        behind.contains(&format!(
            "though its relays claim (pid {}, ",
            std::process::id()
        )),
        "{behind}"
    );
    assert!(behind.ends_with("they do not keep up"), "{behind}");
    relay.shutdown(Duration::from_secs(10)).unwrap();
    // Its report gone, nothing claims.
    let alone = problem(&mut client).expect("rows still due");
    assert!(alone.ends_with("that no relay claimed"), "{alone}");
}

#[test]
fn a_row_due_while_the_relays_report_no_recent_claim_says_so() {
    let (outbox, mut client) = common::outbox("unclaiming");
    enqueue(&mut client, &outbox, "waiting");
    // A relay reporting now whose last claim was an hour ago, and one older than migration
    // 22, which gives none. (Written by hand: a relay of this version that reports also
    // claims, or has its publisher down.)
    let relays = common::quoted_with(&outbox, "_relays");
    client
        .batch_execute(&format!(
            "INSERT INTO {relays} (relay, pid, started_at, publisher, claimed_at, poll_interval)
             VALUES ('stuck', 4242, now() - interval '2 hours', 'up', now() - interval '1 hour',
                     interval '2 seconds'),
                    ('old', 4343, now() - interval '2 hours', 'up', NULL, NULL)"
        ))
        .unwrap();
    let reports = outbox.relays(&mut client).unwrap();
    assert!(reports.iter().all(|r| r.is_reporting() && !r.is_claiming()));
    let limits = HealthThresholds::default().due_age(Duration::from_millis(1));
    let mut health = None;
    wait_until("the row has been due past the threshold", || {
        let now = outbox.health_with(&mut client, &limits).unwrap();
        let due = checks(&now).contains(&Check::Due);
        health = Some(now);
        due
    });
    let problem = &health.unwrap().findings[0].problem;
    assert!(
        problem.ends_with(
            "that no relay claimed (2 reporting, none a claim within its poll interval, or a \
             relay of a build before 0.3.0, which does not report its claims)"
        ),
        "{problem}"
    );
}

#[test]
fn reports_that_stopped_coming_are_found() {
    let (outbox, mut client) = common::outbox("gone");
    // What a relay killed by SIGKILL leaves behind: its last report, growing old. (Aged by
    // hand: the report's own clock is the database's.)
    let relays = common::quoted_with(&outbox, "_relays");
    client
        .execute(
            &format!(
                "INSERT INTO {relays} (relay, pid, started_at, seen_at, publisher)
                 VALUES ('dead', 4242, now() - interval '1 hour', now() - interval '2 minutes',
                         'up')"
            ),
            &[],
        )
        .unwrap();
    let health = outbox.health(&mut client).unwrap();
    assert_eq!(checks(&health), [Check::Relays]);
    assert!(health.findings[0].problem.contains("pid 4242"));
    // A relay reporting now clears it.
    client
        .execute(&format!("UPDATE {relays} SET seen_at = now()"), &[])
        .unwrap();
    assert!(outbox.health(&mut client).unwrap().is_healthy());
}

#[test]
fn an_idle_relay_with_a_long_poll_interval_keeps_reporting() {
    let (outbox, mut client) = common::outbox("idle_reports");
    let config = common::relay_config(&outbox, |_: &Record| Ok(()))
        .notify(false)
        .poll_interval(Duration::from_secs(3600));
    let relay = Relay::spawn(config).unwrap();
    wait_until("the first report", || {
        outbox.relays(&mut client).unwrap().len() == 1
    });
    // Its workers sleep for an hour; the report's age grows, then drops at the next one.
    let mut grew = false;
    wait_until("a report written while idle", || {
        let seen = outbox.relays(&mut client).unwrap()[0].last_seen;
        grew |= seen >= Duration::from_secs(2);
        grew && seen < Duration::from_secs(1)
    });
    relay.shutdown(Duration::from_secs(10)).unwrap();
}
