//! The health checks: one function for each, over the figures `Outbox::health` read, each
//! returning its findings; [`findings`] runs them in the order their findings are listed.

use std::time::{Duration, SystemTime};

use postgres::error::SqlState;

use super::report::{Check, Finding, Health, HealthThresholds, HeldBack, Partition, TableHealth};
use crate::operations::relays::PublisherState;
use crate::schema::statements::LOOK_RANGES;

/// A check of one of the outbox's tables (the outbox, then its inbox).
type TableCheck = fn(&TableHealth, &HealthThresholds) -> Option<Finding>;

/// A check of the figures of the whole outbox, named `table`.
type OutboxCheck = fn(&str, &Health, &HealthThresholds) -> Vec<Finding>;

/// What the figures of `health` show past `limits`, for the outbox named `table`.
pub(super) fn findings(table: &str, health: &Health, limits: &HealthThresholds) -> Vec<Finding> {
    let of_tables: [TableCheck; 4] = [dead_tuples, vacuum, analyze, bloat];
    let of_outbox: [OutboxCheck; 11] = [
        transaction,
        prepared_transaction,
        replication_slots,
        due,
        dead_letters,
        parked,
        publishers,
        open_partition,
        unsettled_partition,
        partition_upkeep,
        relays,
    ];
    let mut found = Vec::new();
    for figures in [&health.outbox_table, &health.inbox_table] {
        found.extend(of_tables.iter().filter_map(|check| check(figures, limits)));
    }
    for check in of_outbox {
        found.extend(check(table, health, limits));
    }
    found
}

fn finding(check: Check, problem: String, remedy: String) -> Finding {
    Finding {
        check,
        problem,
        remedy,
    }
}

/// Rows past the dead tuples' figures: dead ones, or changed since an analyze.
fn many(table: &TableHealth, limits: &HealthThresholds, rows: u64) -> bool {
    rows > limits.dead_tuples && rows as f64 > limits.dead_ratio * table.live_tuples as f64
}

/// Not for `age`: a table never vacuumed (or analyzed) with autovacuum on is one
/// autovacuum has yet to reach (it comes at a share of the table, as the figures above);
/// one done lately with autovacuum off is done by hand.
fn overdue(table: &TableHealth, since: Option<Duration>, age: Duration) -> bool {
    match since {
        Some(since) => since >= age,
        None => !table.autovacuum,
    }
}

fn last(since: Option<Duration>, done: &str) -> String {
    since.map_or(format!("never {done}"), |age| {
        format!("last {done} {} ago", whole(age))
    })
}

fn dead_tuples(table: &TableHealth, limits: &HealthThresholds) -> Option<Finding> {
    let (name, dead) = (&table.table, table.dead_tuples);
    let vacuumed = last(table.since_vacuum, "vacuumed");
    many(table, limits, dead).then(|| {
        finding(
            Check::DeadTuples,
            format!(
                "{name} holds {dead} dead tuples against {} live ({vacuumed})",
                table.live_tuples
            ),
            format!(
                "run VACUUM (ANALYZE) {name}; if they come back at once, end what holds the \
                 xmin horizon (an old transaction, a prepared transaction, a slot)"
            ),
        )
    })
}

fn vacuum(table: &TableHealth, limits: &HealthThresholds) -> Option<Finding> {
    let (name, dead) = (&table.table, table.dead_tuples);
    if !(many(table, limits, dead) && overdue(table, table.since_vacuum, limits.vacuum_age)) {
        return None;
    }
    let vacuumed = last(table.since_vacuum, "vacuumed");
    let (why, remedy) = if table.autovacuum {
        (
            "autovacuum has not come",
            format!(
                "run VACUUM (ANALYZE) {name}, then see why autovacuum does not: its \
                 workers busy on larger tables (autovacuum_max_workers), or held back by \
                 its cost limit (autovacuum_vacuum_cost_limit)"
            ),
        )
    } else {
        (
            "autovacuum is off for it",
            format!(
                "turn autovacuum on (autovacuum = on in the server's configuration, and \
                 ALTER TABLE ... RESET (autovacuum_enabled) for {name} or its \
                 partitions), or run VACUUM (ANALYZE) {name} on a schedule"
            ),
        )
    };
    Some(finding(
        Check::Vacuum,
        format!("{name} holds {dead} dead tuples and {why} ({vacuumed})"),
        remedy,
    ))
}

fn analyze(table: &TableHealth, limits: &HealthThresholds) -> Option<Finding> {
    let (name, changed) = (&table.table, table.changed_since_analyze);
    if !(many(table, limits, changed) && overdue(table, table.since_analyze, limits.analyze_age)) {
        return None;
    }
    let analyzed = last(table.since_analyze, "analyzed");
    Some(finding(
        Check::Analyze,
        format!(
            "{name} has {changed} rows changed since its statistics were taken \
             ({analyzed}): its statements are planned on figures that no longer hold"
        ),
        format!(
            "run ANALYZE {name}; {}",
            if table.autovacuum {
                "autovacuum analyzes it once enough rows change, unless its workers are \
                 busy elsewhere (autovacuum_max_workers)"
            } else {
                "autovacuum, which would analyze it, is off for it"
            }
        ),
    ))
}

fn bloat(table: &TableHealth, limits: &HealthThresholds) -> Option<Finding> {
    let name = &table.table;
    let unused = table.unused_heap_bytes?;
    let past = unused >= limits.bloat_bytes
        && unused as f64 >= limits.bloat_ratio * table.heap_bytes as f64;
    past.then(|| {
        finding(
            Check::Bloat,
            format!(
                "{name} takes {} MiB for its rows, about {} MiB of it holding none (an \
                 estimate from its statistics): space vacuum keeps for new rows but does \
                 not give back",
                table.heap_bytes >> 20,
                unused >> 20
            ),
            format!(
                "once nothing holds the xmin horizon, rewrite it: pg_repack, or VACUUM \
                 FULL {name} (which locks it for as long as it runs); a partitioned \
                 outbox gives the space back as retention drops its partitions"
            ),
        )
    })
}

fn transaction(_: &str, health: &Health, limits: &HealthThresholds) -> Vec<Finding> {
    let old = health.oldest_transaction.as_ref();
    old.filter(|tx| tx.age >= limits.transaction_age)
        .map(|tx| {
            finding(
                Check::Transaction,
                format!(
                    "backend {} ({}) has held a transaction open for {}: vacuum keeps every row \
                     version since",
                    tx.id,
                    tx.what,
                    whole(tx.age)
                ),
                format!(
                    "end it (SELECT pg_terminate_backend({})), and set \
                     idle_in_transaction_session_timeout",
                    tx.id
                ),
            )
        })
        .into_iter()
        .collect()
}

fn prepared_transaction(_: &str, health: &Health, limits: &HealthThresholds) -> Vec<Finding> {
    let old = health.oldest_prepared.as_ref();
    old.filter(|prepared| prepared.age >= limits.prepared_age)
        .map(|prepared| {
            finding(
                Check::PreparedTransaction,
                format!(
                    "prepared transaction '{}' ({}) is {} old: it holds the xmin horizon until \
                     it ends",
                    prepared.id,
                    prepared.what,
                    whole(prepared.age)
                ),
                format!(
                    "COMMIT PREPARED or ROLLBACK PREPARED '{}' (from its database), once its \
                     coordinator is known to be gone",
                    prepared.id
                ),
            )
        })
        .into_iter()
        .collect()
}

fn replication_slots(_: &str, health: &Health, limits: &HealthThresholds) -> Vec<Finding> {
    let mut found = Vec::new();
    for slot in &health.slots {
        let name = &slot.name;
        if !slot.active && (slot.xmin_age.is_some() || slot.wal_bytes >= limits.slot_wal_bytes) {
            let xmin = slot.xmin_age.map_or(String::new(), |age| {
                format!(", holds an xmin {age} transactions old")
            });
            found.push(finding(
                Check::ReplicationSlot,
                format!(
                    "replication slot {name} ({}, inactive) keeps {} bytes of WAL{xmin}",
                    slot.kind, slot.wal_bytes
                ),
                format!(
                    "start its consumer again, or drop it: SELECT \
                     pg_drop_replication_slot('{name}')"
                ),
            ));
        }
        let old = slot.xmin_age.filter(|&age| age >= limits.slot_xmin_age);
        if let (true, Some(age)) = (slot.active, old) {
            let pid = slot.active_pid.unwrap_or_default();
            let holder = if slot.kind == "feedback" {
                format!(
                    "standby {name} (its walsender pid {pid}, hot_standby_feedback without a slot)"
                )
            } else {
                format!("replication slot {name} ({}, read by pid {pid})", slot.kind)
            };
            // A logical slot's is a catalog xmin: it holds back the catalogs alone.
            let kept = if slot.kind == "logical" {
                "the system catalogs' row versions"
            } else {
                "every row version"
            };
            found.push(finding(
                Check::ReplicationSlot,
                format!("{holder} holds an xmin {age} transactions old: vacuum keeps {kept} since"),
                "its reader holds it back: a standby with hot_standby_feedback running a long \
                 query (end it there, or bound it with max_standby_streaming_delay), or a \
                 logical consumer that has fallen behind"
                    .to_owned(),
            ));
        }
    }
    found
}

fn due(table: &str, health: &Health, limits: &HealthThresholds) -> Vec<Finding> {
    let Some(age) = health.oldest_due_age.filter(|&age| age >= limits.due_age) else {
        return Vec::new();
    };
    // The relay that claimed last, if any claims at all.
    let claiming = health
        .relays
        .iter()
        .filter(|r| r.is_claiming())
        .min_by_key(|r| r.since_claim);
    vec![match claiming {
        Some(relay) => finding(
            Check::Due,
            format!(
                "{} has had a row due for {} though its relays claim (pid {}, {} ago): \
                 they do not keep up",
                table,
                whole(age),
                relay.pid,
                whole(relay.since_claim.unwrap_or_default())
            ),
            "give the relays more workers (concurrency) or run more of them, and see \
             where their cycles go (Metrics::cycle): a publisher that takes long, or \
             claims that do"
                .to_owned(),
        ),
        None => finding(
            Check::Due,
            format!(
                "{} has had a row due for {} that no relay claimed{}",
                table,
                whole(age),
                match health.relays.iter().filter(|r| r.is_reporting()).count() {
                    0 => String::new(),
                    n => format!(
                        " ({n} reporting, none a claim within its poll interval, or a \
                         relay of a build before 0.3.0, which does not report its claims)"
                    ),
                }
            ),
            "check that a relay runs against this table and reaches the database (its log, \
             Relay::is_listening); a relay that keeps up claims within its poll interval"
                .to_owned(),
        ),
    }]
}

fn dead_letters(t: &str, health: &Health, limits: &HealthThresholds) -> Vec<Finding> {
    let unparked = health.dead_letters.saturating_sub(health.parked);
    if unparked < limits.dead_letters {
        return Vec::new();
    }
    vec![finding(
        Check::DeadLetters,
        format!(
            "{t} holds {unparked} dead letter{}: messages nobody received",
            if unparked == 1 { "" } else { "s" }
        ),
        format!(
            "see why (postgres-outbox --table {t} dead --by-error), fix the cause, then \
             redrive them, or purge them once they are not wanted"
        ),
    )]
}

fn parked(t: &str, health: &Health, limits: &HealthThresholds) -> Vec<Finding> {
    let n = health.parked;
    if n < limits.parked {
        return Vec::new();
    }
    vec![finding(
        Check::Parked,
        format!(
            "{t} has {n} parked dead letter{}: {} waits for an operator",
            if n == 1 { "" } else { "s" },
            if n == 1 {
                "its aggregate"
            } else {
                "their aggregates"
            }
        ),
        format!(
            "postgres-outbox --table {t} dead --parked, then redrive (it goes first) or \
             skip (its aggregate goes on without it)"
        ),
    )]
}

fn publishers(_: &str, health: &Health, _: &HealthThresholds) -> Vec<Finding> {
    let mut found = Vec::new();
    for relay in health.relays.iter().filter(|r| r.is_reporting()) {
        if let PublisherState::Down { since } = relay.publisher {
            let down = SystemTime::now().duration_since(since).unwrap_or_default();
            found.push(finding(
                Check::Publisher,
                format!(
                    "relay {} (pid {}{}) cannot publish: its destination has been down for {}",
                    relay.relay,
                    relay.pid,
                    relay
                        .client_addr
                        .as_ref()
                        .map_or(String::new(), |a| format!(" at {a}")),
                    whole(down)
                ),
                "check the broker and the relay's log; it claims nothing meanwhile and tries \
                 again with backoff, and nothing is lost or charged an attempt"
                    .to_owned(),
            ));
        }
    }
    found
}

fn open_partition(table: &str, health: &Health, _: &HealthThresholds) -> Vec<Finding> {
    let mut found = Vec::new();
    let Some(open) = health.partitions.iter().find(|p| p.is_open()) else {
        return found;
    };
    let upkeep = format!(
        "{}: it keeps the partitions every few seconds (or SELECT {}_partition(false) now)",
        run_upkeep(table),
        table
    );
    let ahead = health
        .partitions
        .iter()
        .filter(|p| p.number > open.number && p.exists)
        .count();
    if ahead == 0 {
        found.push(finding(
            Check::Partitions,
            format!(
                "{} has no partition ahead of the open one (partition {}): the next cut \
                 cannot happen",
                table, open.number
            ),
            upkeep.clone(),
        ));
    }
    let open_for = open.opened.unwrap_or_default();
    if open_for > open.every * 2 {
        found.push(finding(
            Check::Partitions,
            format!(
                "partition {} of {} has been open for {}, its interval {}: no cut \
                 happened, so retention cannot drop its rows",
                open.number,
                table,
                whole(open_for),
                whole(open.every)
            ),
            upkeep,
        ));
    }
    found
}

fn unsettled_partition(table: &str, health: &Health, _: &HealthThresholds) -> Vec<Finding> {
    let held = health
        .partitions
        .iter()
        .find_map(|p| Some((p, p.held_back?)));
    let Some((partition, held_back)) = held else {
        return Vec::new();
    };
    let closed = partition.closed.unwrap_or_default();
    if closed <= partition.every {
        return Vec::new();
    }
    // The partitions after `n`, the first not quiet, that a producer's look reads:
    // the next ones not quiet alone, and every one from the one after them on
    // (`LOOK_RANGES`). stats() reads the partitions not quiet alone
    // (`BACKLOG_RANGES`).
    let after = |n: i64| {
        let not_quiet = |p: &&Partition| p.closed.is_none() || !p.quiet;
        let partitions = health.partitions.iter();
        let mut later = partitions.filter(|p| p.number > n).filter(not_quiet);
        let alone = later.by_ref().take(LOOK_RANGES - 2);
        let alone = alone.filter(|p| p.exists).count();
        later.next().map_or(alone, |rest| {
            let partitions = health.partitions.iter();
            let rest = partitions.filter(|p| p.number >= rest.number && p.exists);
            alone + rest.count()
        })
    };
    let retention = "retention keeps it whole, its sent rows with it, and ";
    // Dead letters alone leave it quiet: stats() counts them once (see
    // sql/functions/partitions.sql), topic_stats() reads it alone for them, and
    // enqueues read from the first closed partition not quiet, if any.
    let looked = health
        .partitions
        .iter()
        .find(|p| p.number > partition.number && p.closed.is_some() && p.exists && !p.quiet);
    let reads = match (partition.quiet, looked) {
        (false, _) => format!(
            "each enqueue with an aggregate key reads it and {} partitions after \
             it, and each stats() reads it",
            after(partition.number)
        ),
        (true, looked) => format!(
            "each topic_stats() reads it for its dead letters{}",
            looked.map_or_else(String::new, |p| format!(
                ", and each enqueue with an aggregate key reads partition {} and {} \
                 partitions after it",
                p.number,
                after(p.number)
            ))
        ),
    };
    let (why, retention, remedy) = match held_back {
        HeldBack::Kept(kept) => (
            format!("it keeps {}", kept_rows(kept)),
            retention,
            "look at them (postgres-outbox dead, oldest first), then redrive, skip or \
             purge them"
                .to_owned(),
        ),
        HeldBack::Pending => (
            "it still has messages to send".to_owned(),
            retention,
            "check that a relay runs against this table and keeps up (postgres-outbox \
             stats); a message enqueued with a long delay holds its partition until \
             it is sent"
                .to_owned(),
        ),
        HeldBack::Transactions => (
            "a transaction that was running when it was cut, or a prepared \
             transaction, may still write into it"
                .to_owned(),
            "",
            "end the old transactions (pg_stat_activity: xact_start) and prepared \
             transactions (pg_prepared_xacts); the doctor names the oldest of each past \
             its threshold"
                .to_owned(),
        ),
        HeldBack::NoUpkeep => (
            "nothing is left in it, but no upkeep has settled it".to_owned(),
            "",
            format!(
                "{} (it logs why an upkeep fails), or SELECT {1}_partition(false), \
                 {1}_settle()",
                run_upkeep(table),
                table
            ),
        ),
    };
    vec![finding(
        Check::Partitions,
        format!(
            "partition {} of {}, closed {} ago, has not settled: {why}. Until it \
             does, {retention}{reads}",
            partition.number,
            table,
            whole(closed)
        ),
        remedy,
    )]
}

fn partition_upkeep(table: &str, health: &Health, _: &HealthThresholds) -> Vec<Finding> {
    let failing: Vec<_> = health
        .relays
        .iter()
        .filter(|r| r.is_reporting())
        .filter_map(|r| Some((r, r.upkeep_error.as_ref()?)))
        .collect();
    let Some((first, error)) = failing.first() else {
        return Vec::new();
    };
    vec![finding(
        Check::Partitions,
        format!(
            "{} of the relays of {} failed to keep its partitions at their last report \
             (pid {}: {error}): while that lasts, no cut happens and no partition is made \
             ahead",
            failing.len(),
            table,
            first.pid
        ),
        if error.starts_with(&format!("[{}]", SqlState::INSUFFICIENT_PRIVILEGE.code())) {
            run_upkeep(table)
        } else {
            "see the relay's log; it tries again at its next report, every few seconds".to_owned()
        },
    )]
}

fn relays(table: &str, health: &Health, _: &HealthThresholds) -> Vec<Finding> {
    let last = health.relays.iter().min_by_key(|r| r.last_seen);
    last.filter(|last| !last.is_reporting())
        .map(|last| {
            finding(
                Check::Relays,
                format!(
                    "no relay of {} has reported for {} (the last: pid {}): they stopped \
                     without saying so, or hang",
                    table,
                    whole(last.last_seen),
                    last.pid
                ),
                "start a relay (what the dead one held comes back when its leases run out); \
                 reports of relays gone a day are forgotten"
                    .to_owned(),
            )
        })
        .into_iter()
        .collect()
}

/// Who keeps a partitioned outbox's partitions, and the rights it takes.
fn run_upkeep(table: &str) -> String {
    format!(
        "run a relay on {0} as its owner, or as a role given `postgres-outbox --table {0} \
         grants relay <role>` (docs/grants.md)",
        table
    )
}

/// Dead or parked rows as counted, up to 1,000.
fn kept_rows(kept: u64) -> String {
    match kept {
        1 => "1 dead letter or parked message".to_owned(),
        1000.. => "1,000 or more dead letters or parked messages".to_owned(),
        kept => format!("{kept} dead letters or parked messages"),
    }
}

fn whole(age: Duration) -> String {
    format!("{}s", age.as_secs())
}
