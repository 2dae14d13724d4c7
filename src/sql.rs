//! Every SQL statement the crate runs, rendered once per table, and the migrations.
//!
//! Table names are validated identifiers and always quoted (see `table.rs`), so splicing them
//! into statement text cannot inject SQL; every value travels as a bind parameter. Statements
//! and migrations alike are templates with `{name}` placeholders, rendered by `render.rs`,
//! which fails on a placeholder without a value and on a value no template uses; the table's
//! objects both name come from one list (`objects`), so they are spelled alike in both.

use std::time::Duration;

use postgres::error::SqlState;

use crate::error::Error;
use crate::schema::grants::Access;
use crate::schema::render::{render, RenderError, Values};
use crate::schema::table::{quote, TableName};

/// How many ids a partition holds, as a power of two: partition n holds the ids from
/// `n << PARTITION_ID_BITS` (migration 0012, whose functions spell out the width).
pub(crate) const PARTITION_ID_BITS: u32 = 40;

/// The first id that may belong to a pending, parked or dead row of a partitioned table:
/// the first of the oldest partition not settled (migration 0013). Settled partitions hold
/// sent rows only, and nothing may write to them again.
const BACKLOG_FROM: &str =
    "SELECT coalesce(min(n), 0) << {id_bits} FROM {partitions} WHERE settled_at IS NULL";

/// How many ranges of partitions an enqueue's look for its aggregate's pending messages
/// reads on a partitioned table, at most: the partitions that may hold a pending or parked
/// row (not quiet, migration 0016), the first `LOOK_RANGES - 1` of them each alone and
/// every one from the next on. Quiet partitions hold sent and dead rows only, and a redrive
/// marks a partition not quiet before a row of it is pending again, so the quiet ones
/// between (after messages scheduled far ahead, or parked, in old partitions) are left out
/// (migrations 0019 and 0021). Each range is an OR in the look's plan: four cost the common
/// case (one run of partitions, the open one and those made ahead) nothing measurable
/// against two (BENCHMARKS.md).
pub(crate) const LOOK_RANGES: usize = 4;

/// The partitions an enqueue's look reads (see `LOOK_RANGES`), which the enqueue functions
/// hold as `look`. With none (the bookkeeping emptied by hand), partition 0: the look reads
/// every partition.
pub(crate) const LOOK_PARTITIONS: &str =
    "coalesce(nullif(ARRAY(SELECT n FROM {partitions} WHERE quiet_at IS NULL
                                 ORDER BY n LIMIT {look_ranges}), ARRAY[]::bigint[]),
             ARRAY[0::bigint])";

/// Whether row `o` is in one of the partitions of `look` (see `LOOK_RANGES`): in one of the
/// first partitions alone, or in the last or any after it. With `look` NULL (an enqueue
/// that does not look), in none, so the plan holds no partition.
pub(crate) fn in_look() -> String {
    let bits = PARTITION_ID_BITS;
    let alone = (1..LOOK_RANGES)
        .map(|i| format!("o.id >= look[{i}] << {bits} AND o.id < (look[{i}] + 1) << {bits}"));
    let from_last = std::iter::once(format!("o.id >= look[cardinality(look)] << {bits}"));
    let arms: Vec<String> = alone.chain(from_last).collect();
    format!(
        "({})",
        arms.join("\n                                      OR ")
    )
}

/// How many ranges of ids `stats` and `topic_stats` read the backlog in, at most (`$2` on,
/// two a range: its first id and its last). They cover the partitions of a partitioned
/// table that may hold a pending or parked row (not quiet), or dead letters not counted
/// (migration 0018), up to the partition of the last id drawn (migration 0020), and that
/// one: the partitions made ahead, and the quiet ones between held ones (after messages
/// scheduled far ahead, or parked, in old partitions), are left out. A run of neighbours
/// takes one range; past the last range, the rest go into it, with the partitions between.
/// On a plain table, one range: every id.
pub(crate) const BACKLOG_RANGES: usize = 4;

/// How many ranges of ids, besides the backlog's, `topic_stats` reads dead letters in
/// (after the backlog's, two a range), as `BACKLOG_RANGES` are made: the quiet partitions
/// whose dead letters the upkeep counted as some, or has not counted.
pub(crate) const DEAD_RANGES: usize = 4;

/// The first id of partition `n`.
pub(crate) fn first_id(n: i64) -> i64 {
    n.saturating_mul(1 << PARTITION_ID_BITS)
}

/// Whether `value` is in one of `count` ranges of ids given as parameters from `$from` on,
/// two a range (see `BACKLOG_RANGES`), each bound shifted right by `shift` bits first (to
/// compare a partition's number).
fn in_ranges(value: &str, from: usize, count: usize, shift: u32) -> String {
    let bound = |param: usize| match shift {
        0 => format!("${param}"),
        bits => format!("(${param} >> {bits})"),
    };
    let ranges: Vec<String> = (0..count)
        .map(|i| {
            let start = from + 2 * i;
            format!(
                "{value} >= {} AND {value} <= {}",
                bound(start),
                bound(start + 1)
            )
        })
        .collect();
    format!("({})", ranges.join(" OR "))
}

/// `template` for each count of backlog ranges from 1 to `BACKLOG_RANGES`, the one at `k - 1`
/// reading `k` of them (`$2` to `$2k+1`) where it says `{in_backlog}` (of the rows' ids;
/// `{o_in_backlog}` of rows `o`, `{p_in_backlog}` and `{q_in_backlog}` of partitions `p`
/// and `q`), and `DEAD_RANGES` ranges after them where it says `{dead_ranges}`. So a
/// statement holds no more ranges than it reads: each costs every scan's plan an OR, even
/// one that holds no id.
fn by_ranges(values: &mut Values<'_>, template: &str) -> Result<Vec<String>, RenderError> {
    (1..=BACKLOG_RANGES)
        .map(|k| {
            let bits = PARTITION_ID_BITS;
            let ranges = [
                ("in_backlog", in_ranges("id", 2, k, 0)),
                ("o_in_backlog", in_ranges("o.id", 2, k, 0)),
                ("p_in_backlog", in_ranges("p.n", 2, k, bits)),
                ("q_in_backlog", in_ranges("q.n", 2, k, bits)),
                ("dead_ranges", in_ranges("id", 2 + 2 * k, DEAD_RANGES, 0)),
            ];
            values.render_with(template, &borrowed(&ranges))
        })
        .collect()
}

/// How many partitions are kept ahead of the one new ids fall in.
pub(crate) const PARTITIONS_AHEAD: i32 = 2;

/// The columns of a record, in the order `Record::from_row` reads them, its attempt being
/// `{attempt}`.
const RECORD_TEMPLATE: &str = "t.id, t.key, t.topic, t.aggregate_key, t.payload, t.content_type, \
     t.headers, {attempt}, t.max_attempts, t.created_at, t.lease_until, t.park";

/// The dead letters a redrive makes pending: those `{filter}` selects, of no aggregate or of
/// one `lock_redriven` locked ($6). A row that died after that lock's snapshot, of an
/// aggregate it did not lock, waits for the next redrive: a producer of its aggregate may
/// be deciding its head meanwhile.
const REDRIVEN: &str =
    "{filter} AND (t.aggregate_key IS NULL OR t.aggregate_key = ANY ($6::text[]))";

/// Before a redrive: for each redriven aggregate, the first message still pending or parked
/// after its first redriven letter, touched. Every claim's run that would cross the letter
/// holds that message: the touch waits for a claim that holds it, and a claim whose
/// snapshot predates the touch passes it over (it locks the version it read, see
/// [`claim`]) and so ends its run before it. So once the redrive commits, no claim takes
/// a message ahead of the letters it makes pending. (A marked head after the letter is that
/// message, and is the head no longer.) Returns the aggregates, the first redriven id of
/// each, when the lease of the message touched ends if it is in flight (its run's: they
/// were claimed together), and whether every aggregate's message was touched: one that got
/// its outcome while the touch waited for it was not, and the hold runs again, in a new
/// snapshot, to touch the message after it.
fn redrive_hold() -> String {
    let next = |marked: &str| {
        format!(
            "(SELECT min(o.id) FROM {{table}} o
              WHERE {marked} o.head AND o.aggregate_key = f.aggregate_key AND o.id > f.id
                AND o.status IN ('pending', 'parked'))"
        )
    };
    // Marked and unmarked apart: each is a descent of the ordered index.
    let (unmarked, marked) = (next("NOT"), next(""));
    format!(
        "WITH f AS (
           SELECT t.aggregate_key, min(t.id) AS id FROM {{table}} t
           WHERE {REDRIVEN} AND t.aggregate_key IS NOT NULL GROUP BY t.aggregate_key),
         n AS (SELECT f.aggregate_key, f.id, least({unmarked}, {marked}) AS next FROM f),
         touched AS (
           UPDATE {{table}} o SET head = false FROM n
           WHERE o.id = n.next AND o.status IN ('pending', 'parked')
           RETURNING o.aggregate_key,
                     CASE WHEN o.status = 'pending' AND o.lease_until IS NOT NULL
                               AND o.available_at > now() THEN o.available_at END AS until)
         SELECT ARRAY(SELECT aggregate_key::text FROM n ORDER BY aggregate_key),
                ARRAY(SELECT id FROM n ORDER BY aggregate_key),
                ARRAY(SELECT x.until FROM n LEFT JOIN touched x USING (aggregate_key)
                      ORDER BY n.aggregate_key),
                (SELECT count(*) FROM n WHERE next IS NOT NULL) = (SELECT count(*) FROM touched)"
    )
}

/// The redrive of the dead letters `{filter}` selects once [`redrive_hold`] touched what they
/// go ahead of, with `more` (statements of the WITH, each after a comma, reading the ids
/// in `redriven`) beside it: of no aggregate, or of an aggregate the hold returned
/// ($6) from its first redriven id ($7) on. A letter of an aggregate that died before that
/// first since the hold's snapshot may have messages after it the hold did not touch: it
/// waits for the next redrive. A letter of an aggregate whose messages after it are in
/// flight waits until their lease ends ($8): they finish first, or their relay is gone.
fn redrive(more: &str) -> String {
    format!(
        "WITH h AS (
           SELECT * FROM unnest($6::text[], $7::bigint[], $8::timestamptz[])
             AS h(aggregate_key, id, until)),
         redriven AS (
           SELECT t.id, h.until FROM {{table}} t
           LEFT JOIN h ON h.aggregate_key = t.aggregate_key
           WHERE {{filter}} AND (t.aggregate_key IS NULL OR t.id >= h.id)){more}
         UPDATE {{table}} t SET status = 'pending', attempts = 0, claims = 0,
                              available_at = greatest(now(), r.until),
                              lease_until = NULL, done_at = NULL, head = false
         FROM redriven r WHERE t.id = r.id"
    )
}

/// One batch of a purge, with `more` (statements of the WITH, each after a comma) beside
/// it: `c` counts what it deleted by partition, sent and not.
fn purge(more: &str) -> String {
    format!(
        "WITH gone AS (
           DELETE FROM {{table}} WHERE id IN (
             SELECT t.id FROM {{table}} t WHERE {{filter}}
             ORDER BY t.status, t.done_at LIMIT {{purge_batch}}
             FOR UPDATE SKIP LOCKED)
           RETURNING status, id),
         c AS (SELECT id >> {{id_bits}} AS part, count(*) FILTER (WHERE status = 'sent') AS sent,
                      count(*) FILTER (WHERE status <> 'sent') AS dead
               FROM gone GROUP BY 1),
         bump AS (UPDATE {{counts}} k SET sent = k.sent - c.sent FROM c
                  WHERE k.part = c.part AND k.slot = $6 AND c.sent > 0){more}
         SELECT count(*) FROM gone"
    )
}

/// A record as an operator lists it: its attempt is the number of attempts made.
fn record_columns() -> Result<String, RenderError> {
    render(RECORD_TEMPLATE, &[("attempt", "t.attempts")])
}

/// A record as a claim hands it over: its attempt is the one this claim starts (`attempts`
/// counts the verdicts so far, see migration 0009).
fn claimed_columns() -> Result<String, RenderError> {
    render(RECORD_TEMPLATE, &[("attempt", "t.attempts + 1 AS attempt")])
}

/// Whether a row that dies parks its aggregate: it has one, and its own setting, or else
/// the caller's (`$8` in the statements that use it), says so.
const PARKS: &str = "(t.aggregate_key IS NOT NULL AND coalesce(t.park, $8))";

/// The conditions of an operator's filter on rows `t`: $5 the states it selects, and, each
/// ignored when NULL, $1 keys, $2 topic, $3 text the last error contains, $4 minimum age in
/// microseconds since the row finished.
const FILTER: &str = "t.status = ANY($5::text[])
     AND ($1::text[] IS NULL OR t.key = ANY($1))
     AND ($2::text IS NULL OR t.topic = $2)
     AND ($3::text IS NULL OR strpos(t.last_error, $3) > 0)
     AND ($4::bigint IS NULL OR t.done_at < now() - $4 * interval '1 microsecond')";

/// Live and dead tuples, ages of the last vacuum and analyze (manual or auto), rows changed
/// since the last analyze, whether autovacuum may visit, and sizes of the relations named in
/// `$1` and `$2`: the heap, the whole (its indexes and TOAST with it), and the heap's bytes
/// that hold no live row, estimated as the heap less its rows at the width the planner's
/// statistics give them (a row's header and line pointer with it, aligned), NULL unless an
/// analyze measured every column and the role may read them all (a sum over fewer would
/// make the rows narrower than they are). Sizes and rows are the catalog's, as the last
/// vacuum or analyze left them, and the partitions are found in `pg_inherits`: reading the
/// files' sizes, or `pg_partition_tree`, would lock each relation, and wait behind a
/// `VACUUM FULL` or a partition's drop.
/// A partitioned table's figures are its partitions', summed; its last vacuum and analyze
/// the most recent of any; autovacuum off for it when off for any partition.
pub(crate) const HEALTH_TABLES: &str =
    "SELECT coalesce(v.rel::text, v.name), coalesce(sum(s.n_live_tup), 0)::bigint,
            coalesce(sum(s.n_dead_tup), 0)::bigint,
            extract(epoch FROM now() - max(greatest(s.last_vacuum, s.last_autovacuum)))::float8,
            extract(epoch FROM now() - max(greatest(s.last_analyze, s.last_autoanalyze)))::float8,
            coalesce(sum(s.n_mod_since_analyze), 0)::bigint,
            current_setting('autovacuum')::boolean AND NOT coalesce(bool_or(z.off), false),
            (coalesce(sum(z.heap), 0) * current_setting('block_size')::int)::bigint,
            (coalesce(sum(z.heap + z.others), 0) * current_setting('block_size')::int)::bigint,
            (sum(CASE WHEN w.bytes IS NOT NULL
                      THEN greatest(z.heap * current_setting('block_size')::int
                                    - z.rows * w.bytes, 0) END))::bigint
     FROM (VALUES (1, $1, to_regclass($1)), (2, $2, to_regclass($2))) AS v(n, name, rel)
     LEFT JOIN LATERAL (WITH RECURSIVE tree(leaf) AS (
                          SELECT v.rel
                          UNION ALL
                          SELECT i.inhrelid FROM pg_inherits i JOIN tree t ON i.inhparent = t.leaf)
                        SELECT leaf FROM tree) l ON true
     LEFT JOIN pg_stat_user_tables s ON s.relid = l.leaf
     LEFT JOIN LATERAL (
       SELECT greatest(c.relpages, 0)::numeric AS heap, greatest(c.reltuples, 0) AS rows,
              (SELECT coalesce(sum(greatest(r.relpages, 0)), 0)
               FROM pg_class r
               WHERE r.oid IN (SELECT indexrelid FROM pg_index
                               WHERE indrelid IN (c.oid, c.reltoastrelid))
                  OR r.oid = c.reltoastrelid) AS others,
              (SELECT NOT option_value::boolean FROM pg_options_to_table(c.reloptions)
               WHERE option_name = 'autovacuum_enabled') AS off
       FROM pg_class c WHERE c.oid = l.leaf) z ON true
     LEFT JOIN LATERAL (
       SELECT CASE WHEN count(*) = (SELECT count(*) FROM pg_attribute a
                                    WHERE a.attrelid = l.leaf AND a.attnum > 0
                                      AND NOT a.attisdropped)
                   THEN (ceil((sum(st.avg_width * (1 - st.null_frac)) + 24) / 8.0) * 8
                         + 4)::bigint END AS bytes
       FROM pg_stats st
       WHERE st.schemaname = s.schemaname AND st.tablename = s.relname
         AND NOT st.inherited) w ON true
     GROUP BY v.n, v.rel, v.name
     ORDER BY v.n";

/// The oldest open transaction that holds back the xmin horizon of this database (a
/// backend with a snapshot or a transaction id: vacuum keeps every row version it may
/// see), other than the caller's. No query text: it may carry a payload. (A standby's
/// walsender holds an xmin with no transaction open: see [`HEALTH_SLOTS`].)
pub(crate) const HEALTH_TRANSACTION: &str =
    "SELECT pid::text, extract(epoch FROM now() - xact_start)::float8,
            coalesce(nullif(application_name, ''), backend_type) || ', ' || coalesce(state, '?')
     FROM pg_stat_activity
     WHERE pid <> pg_backend_pid() AND xact_start IS NOT NULL
       AND (backend_xmin IS NOT NULL OR backend_xid IS NOT NULL)
       AND datname = current_database()
     ORDER BY xact_start LIMIT 1";

/// The oldest prepared transaction: it holds the xmin horizon until committed or rolled
/// back, whoever prepared it.
pub(crate) const HEALTH_PREPARED: &str =
    "SELECT gid, extract(epoch FROM now() - prepared)::float8, 'database ' || database
     FROM pg_prepared_xacts ORDER BY prepared LIMIT 1";

/// Every replication slot, with the xmin it holds (in transactions), the WAL it keeps (in
/// bytes), whether something reads from it and the pid of what does; then every standby
/// that holds an xmin by `hot_standby_feedback` without a slot (on its walsender), named
/// by its `application_name`, of kind `feedback`; the oldest horizon first.
pub(crate) const HEALTH_SLOTS: &str = "SELECT name, xmin_age, wal_bytes, kind, active, pid
     FROM (SELECT slot_name::text AS name,
                  greatest(age(xmin), age(catalog_xmin))::bigint AS xmin_age,
                  coalesce(pg_wal_lsn_diff(CASE WHEN pg_is_in_recovery()
                                                THEN pg_last_wal_receive_lsn()
                                                ELSE pg_current_wal_lsn() END,
                                           restart_lsn), 0)::bigint AS wal_bytes,
                  slot_type AS kind, active, active_pid AS pid, restart_lsn
           FROM pg_replication_slots
           UNION ALL
           SELECT coalesce(nullif(application_name, ''), 'pid ' || pid),
                  age(backend_xmin)::bigint, 0, 'feedback', true, pid, NULL
           FROM pg_stat_replication
           WHERE backend_xmin IS NOT NULL
             AND pid NOT IN (SELECT active_pid FROM pg_replication_slots
                             WHERE active_pid IS NOT NULL)) AS holders
     ORDER BY xmin_age DESC NULLS LAST, restart_lsn";

/// How many rows of each part of the backlog `stats` reads: past that, it estimates. Reading
/// 2,000 of each, the whole statement takes about 3 ms on the reference machine (`scale` bench).
pub(crate) const STATS_COUNTED: u64 = 2000;

/// How many rows one purge statement deletes, so no statement holds locks for long.
pub(crate) const PURGE_BATCH: i64 = 1000;

/// The statements for one outbox table.
#[derive(Debug)]
pub(crate) struct Statements {
    table: TableName,
    /// Creates the table's schema, if its name has one.
    pub(crate) create_schema: Option<String>,
    /// Bounds the wait of a migration for its locks, see `MIGRATION_LOCK_TIMEOUT`.
    pub(crate) migration_lock_timeout: String,
    /// Calls the enqueue function (migration 0010): $1..$10 the message, $11 notify, $12
    /// whether the key is the crate's own.
    pub(crate) enqueue: String,
    /// Calls the batch enqueue function (migration 0010): $1..$12 the columns, $13 notify,
    /// $14 whether every key is the crate's own.
    pub(crate) enqueue_all: String,
    /// Before a batch is copied in: locks its aggregates ($1), notifies if $2 and a relay
    /// waits, and returns the aggregates that cannot take a new head (migration 0010).
    pub(crate) lock_heads: String,
    /// A large batch due at once: binary COPY of the columns that have no default, and
    /// whether each row is its aggregate's head.
    pub(crate) copy_in: String,
    pub(crate) existing_keys: String,
    pub(crate) notify_if_waiting: String,
    pub(crate) dedupe: String,
    /// Counts by state from at most `STATS_COUNTED` rows of each part of the backlog, and
    /// the estimated sizes of the ready and ordered indexes (see `Outbox::stats`): every
    /// row in the ranges from `$2` on (`backlog_bounds`, see `BACKLOG_RANGES`; all ids on a
    /// plain table), so that the partitions out of them are left out of the plan, and the
    /// dead letters counted in the quiet ones from `$1` on left out.
    pub(crate) stats: Vec<String>,
    /// What `stats` and `topic_stats` read on a partitioned table: the first id of the
    /// oldest partition not settled (migration 0013), whose rows may still be pending,
    /// parked or dead; the partitions from there that may hold a pending or parked row
    /// (not quiet), or dead letters not counted, up to the partition of the last id drawn
    /// (migration 0020), past which no row is, and that one unless its bookkeeping says it
    /// is quiet (were its row lost, the rows written there would be missed); and the quiet
    /// ones whose dead letters are counted as some, or not counted (migration 0018).
    pub(crate) backlog_bounds: String,
    /// Counts by state from every pending and parked row.
    pub(crate) stats_exact: String,
    /// Rows matching a filter ($1..$5, see `FILTER`), oldest first, at most $6.
    pub(crate) dead_where: String,
    /// Dead letters matching a filter, grouped by error text.
    pub(crate) dead_errors: String,
    /// Rows matching a filter.
    pub(crate) count_where: String,
    /// Locks the aggregates of the dead letters matching a filter against producers, so
    /// none marks a head that a redriven row is about to go before.
    pub(crate) lock_redriven: String,
    /// Touches what a redrive puts a message ahead of, before `redrive_where`; returns
    /// the aggregates touched and the first redriven id of each.
    pub(crate) redrive_hold: String,
    /// Dead letters matching a filter become pending; returns how many.
    pub(crate) redrive_where: String,
    /// `redrive_where` on a partitioned table.
    pub(crate) redrive_partitioned: String,
    /// Parked dead letters matching a filter stop holding their aggregates.
    pub(crate) skip_where: String,
    /// One batch of a purge; returns how many rows it deleted.
    pub(crate) purge_where: String,
    /// `purge_where` on a partitioned table.
    pub(crate) purge_partitioned: String,
    pub(crate) topic_stats: Vec<String>,
    /// How long the oldest due ready row has waited, in seconds (NULL when none is due).
    pub(crate) health_due: String,
    pub(crate) purge_inbox_keys: String,
    pub(crate) count_inbox_keys: String,
    pub(crate) count_inbox_older: String,
    pub(crate) purge_inbox: String,
    pub(crate) purge_failures: String,
    /// Counts one more handler failure of a consumer on a message; returns the new count
    /// and whether the message is now given up on.
    #[cfg(feature = "rabbitmq")]
    pub(crate) count_failure: String,
    /// A consumer's failure count and last error of a message it gave up on, if it did,
    /// and whether its dead letter is stored.
    #[cfg(feature = "rabbitmq")]
    pub(crate) failure_state: String,
    /// Records that the dead letter of a message given up on is stored.
    #[cfg(feature = "rabbitmq")]
    pub(crate) mark_buried: String,
    #[cfg(feature = "rabbitmq")]
    pub(crate) forget_failures: String,
    /// Fails when the consumer's tables are missing.
    #[cfg(feature = "rabbitmq")]
    pub(crate) probe_consumer: String,
    /// The claim, its aggregate scan starting at the first aggregate key.
    pub(crate) claim: String,
    /// The claim, its aggregate scan starting after the key in `$4`.
    pub(crate) claim_after: String,
    /// The claim of the ready rows alone, after a producer's notification.
    pub(crate) claim_ready: String,
    /// The payloads a claim's reply left out: of the rows `$1`, the `$3` bytes from byte
    /// `$2` on (1 for the first).
    pub(crate) payload_slices: String,
    pub(crate) record_outcomes: String,
    pub(crate) migrations_table: String,
    pub(crate) applied_versions: String,
    pub(crate) record_migration: String,
    /// The channel producers notify on, as the migrations rendered it.
    pub(crate) channel: String,
    /// The schema the table is in, or would be created in, on this connection.
    pub(crate) schema_of: String,
    /// Marks relay $1 as waiting for work (and forgets relays long gone).
    pub(crate) register_waiting: String,
    pub(crate) unregister_waiting: String,
    /// A relay's report of itself (and forgets reports unseen for a day).
    pub(crate) report_relay: String,
    pub(crate) forget_relay: String,
    /// Keeps a partitioned outbox's partitions and settles the closed ones (migrations 0012
    /// and 0013; NULL on a plain one).
    pub(crate) maintain_partitions: String,
    /// Drops a closed partition whose rows are all sent longer ago than $1 us, and its sent
    /// count with it; returns how many rows it held (NULL: none dropped). With $2, drops
    /// nothing and counts the rows of every partition it would.
    pub(crate) retire_partition: String,
    /// Whether the table is partitioned.
    pub(crate) is_partitioned: String,
    /// Locks the table against every other use, for its conversion.
    pub(crate) lock_table: String,
    /// The partitions, oldest first, with their rows as the planner estimates them.
    pub(crate) partitions: String,
    /// What keeps partition $3, of ids $1 to $2 (excluded), from settling: its dead and
    /// parked rows (counted up to 1,000) and whether it has pending ones, through the
    /// partial indexes, as the upkeep looks; and whether a transaction the upkeep wrote
    /// down at its cut, or a prepared one, runs still. No row once it has settled or gone.
    pub(crate) partition_left: String,
    /// Whether the table holds any row.
    pub(crate) has_rows: String,
    /// Sets how long the open and later partitions stay open.
    pub(crate) set_partition_interval: String,
    /// The relays' reports, oldest relay first.
    pub(crate) relays: String,
    pub(crate) probe: String,
}

impl Statements {
    /// Every statement for `table`.
    ///
    /// # Panics
    ///
    /// If a template does not match its values: a fault of this crate, the same for every
    /// table (see `render.rs`), which the test `every_template_renders_for_every_table`
    /// would show.
    pub(crate) fn new(table: &TableName) -> Statements {
        checked(Statements::render(table))
    }

    fn render(table: &TableName) -> Result<Statements, RenderError> {
        let t = table.quoted();
        let mut vars = objects(table);
        vars.extend([
            ("migrations", table.companion("_migrations")),
            ("record_columns", record_columns()?),
            ("filter", FILTER.to_owned()),
            ("parks", PARKS.to_owned()),
            ("purge_batch", PURGE_BATCH.to_string()),
            ("stats_counted", STATS_COUNTED.to_string()),
            ("ready_idx", table.companion("_ready")),
            ("ordered_idx", table.companion("_ordered")),
            ("schema_text", format!("'{}'", table.schema_prefix())),
            ("name_text", format!("'{}_p'", table.name())),
            ("id_bits", PARTITION_ID_BITS.to_string()),
        ]);
        let mut values = Values::new(&borrowed(&vars))?;
        let statements = Statements {
            table: table.clone(),
            create_schema: match table.schema() {
                Some(schema) => Some(render(CREATE_SCHEMA, &[("schema", &quote(schema))])?),
                None => None,
            },
            migration_lock_timeout: render(
                "SET LOCAL lock_timeout = {ms}",
                &[("ms", &MIGRATION_LOCK_TIMEOUT.as_millis().to_string())],
            )?,
            copy_in: values.render(
                "COPY {table} (key, topic, aggregate_key, payload, content_type, headers, \
                 max_attempts, park, head) FROM STDIN (FORMAT binary)"
            )?,
            lock_heads: values.render("SELECT {lock_heads_fn}($1, $2)")?,
            existing_keys: values
                .render("SELECT key FROM {table} WHERE key = ANY($1) ORDER BY key")?,
            notify_if_waiting: values.render("SELECT {notify_fn}()")?,
            enqueue: values.render(
                "SELECT {enqueue_fn}($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)"
            )?,
            enqueue_all: values.render(
                "SELECT {enqueue_n_fn}($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, \
                 $14)"
            )?,
            dedupe: values.render(
                "INSERT INTO {inbox} (consumer, key) VALUES ($1, $2)
                 ON CONFLICT DO NOTHING"
            )?,
            // Bounded reads, each in its index's order so none sorts: the ready rows due now
            // (never in flight: a claim moves available_at to its lease's end), the ready
            // rows not due yet, and the rows of aggregates not marked as heads. Those are
            // blocked but the first of each aggregate, and the first too when a marked head
            // is ahead of it (one probe per aggregate). A count of the marked heads tells how
            // much of the ordered index the unmarked rows are. Each read stops one row past
            // STATS_COUNTED, which tells the caller it was cut short; the sizes of the two
            // indexes, as the planner estimates them, stand for what was not read.
            stats: by_ranges(
                &mut values,
                "WITH d AS MATERIALIZED (
                   SELECT lease_until, created_at, aggregate_key IS NOT NULL AS marked
                   FROM {table}
                   WHERE status = 'pending' AND (head OR aggregate_key IS NULL)
                     AND available_at <= now() AND {in_backlog}
                   ORDER BY available_at, id LIMIT {stats_counted} + 1),
                 l AS MATERIALIZED (
                   SELECT lease_until, created_at, aggregate_key IS NOT NULL AS marked
                   FROM {table}
                   WHERE status = 'pending' AND (head OR aggregate_key IS NULL)
                     AND available_at > now() AND {in_backlog}
                   ORDER BY available_at, id LIMIT {stats_counted} + 1),
                 u AS MATERIALIZED (
                   SELECT id, aggregate_key, status, available_at, lease_until, created_at,
                          aggregate_key IS DISTINCT FROM lag(aggregate_key) OVER w AS first,
                          first_value(created_at) OVER w AS first_created
                   FROM {table}
                   WHERE NOT head AND status IN ('pending', 'parked') AND aggregate_key IS NOT NULL
                     AND {in_backlog}
                   WINDOW w AS (PARTITION BY aggregate_key ORDER BY id)
                   ORDER BY aggregate_key, id LIMIT {stats_counted} + 1),
                 m AS MATERIALIZED (
                   SELECT 1 FROM {table}
                   WHERE head AND status IN ('pending', 'parked') AND aggregate_key IS NOT NULL
                     AND {in_backlog}
                   LIMIT {stats_counted} + 1),
                 -- The head that holds an aggregate's rows back: the marked one ahead of
                 -- them if any (created before them or, when the transactions overlapped,
                 -- after), else the first of them.
                 uh AS (
                   SELECT u.*, u.first AND h.created_at IS NULL AS head,
                          coalesce(first_value(h.created_at) OVER (PARTITION BY u.aggregate_key
                                                                   ORDER BY u.id),
                                   u.first_created) AS head_created
                   FROM u LEFT JOIN LATERAL (
                     SELECT o.created_at FROM {table} o
                     WHERE u.first AND o.head AND o.aggregate_key = u.aggregate_key
                       AND o.status IN ('pending', 'parked') AND o.id < u.id
                       AND {o_in_backlog}
                     ORDER BY o.id LIMIT 1) h ON true),
                 -- Every row read, with what it counts as: `behind` a head, it is blocked
                 -- while waiting, held back by the head created at `held_since`.
                 read AS (
                   SELECT 'due' AS part, true AS pending, lease_until, created_at, marked,
                          true AS due, false AS behind, NULL::timestamptz AS held_since
                   FROM d
                   UNION ALL
                   SELECT 'later', true, lease_until, created_at, marked, false, false, NULL
                   FROM l
                   UNION ALL
                   SELECT 'unmarked', status = 'pending', lease_until, created_at, false,
                          head AND status = 'pending' AND available_at <= now(), NOT head,
                          head_created
                   FROM uh),
                 counted AS (
                   SELECT *, pending AND (lease_until IS NULL OR lease_until <= now()) AS waiting
                   FROM read),
                 parts AS (
                   SELECT part, count(*) AS n,
                          count(*) FILTER (WHERE waiting) AS waiting,
                          count(*) FILTER (WHERE pending AND lease_until > now()) AS in_flight,
                          count(*) FILTER (WHERE due) AS due,
                          count(*) FILTER (WHERE waiting AND behind) AS blocked,
                          count(*) FILTER (WHERE marked) AS marked,
                          extract(epoch FROM now() - min(created_at) FILTER (WHERE pending))
                            ::float8 AS pending_age,
                          extract(epoch FROM now() - min(held_since)
                                                     FILTER (WHERE waiting AND behind))
                            ::float8 AS blocked_age
                   FROM counted GROUP BY part),
                 -- As the planner sizes a relation: the rows per page its last vacuum or
                 -- analyze found, times the pages it has now.
                 -- A partitioned index: its partitions' rows per page, times their pages,
                 -- in the ranges read (the others are quiet: they hold no backlog, and sizing
                 -- each index is a file system call). Each is found by its table's name
                 -- and the catalogs' indexes, never by a walk of every partition or a read
                 -- of all of pg_class.
                 sizes AS (
                   SELECT i.name,
                          (sum(c.reltuples) FILTER (WHERE c.reltuples >= 0 AND c.relpages > 0))::float8
                          / nullif(sum(c.relpages) FILTER (WHERE c.reltuples >= 0
                                                             AND c.relpages > 0), 0)
                          * sum(pg_relation_size(c.oid)) / current_setting('block_size')::float8
                            AS rows
                   FROM (VALUES ('ready', to_regclass('{ready_idx}')),
                                ('ordered', to_regclass('{ordered_idx}'))) AS i (name, oid)
                   CROSS JOIN LATERAL (
                     SELECT i.oid AS leaf
                     WHERE NOT EXISTS (SELECT FROM pg_class k WHERE k.oid = i.oid
                                                                AND k.relkind = 'I')
                     UNION ALL
                     SELECT h.inhrelid FROM {partitions} p
                     JOIN pg_index x
                       ON x.indrelid = to_regclass({schema_text} || quote_ident({name_text} || p.n))
                     JOIN pg_inherits h ON h.inhrelid = x.indexrelid AND h.inhparent = i.oid
                     WHERE {p_in_backlog}) l
                   JOIN pg_class c ON c.oid = l.leaf
                   GROUP BY i.name)
                 -- A row per part read (none when nothing was), the rest on each.
                 SELECT p.part, p.n, p.waiting, p.in_flight, p.due, p.blocked, p.marked,
                        p.pending_age, p.blocked_age, dead.parked, dead.total,
                        (SELECT coalesce(sum(sent), 0)::bigint FROM {counts}),
                        (SELECT rows FROM sizes WHERE name = 'ready'),
                        (SELECT rows FROM sizes WHERE name = 'ordered'),
                        (SELECT count(*) FROM m)
                 -- Dead letters: read where the rest is, counted in the quiet partitions
                 -- from $1 on left out (migration 0018).
                 FROM (SELECT count(*) + (SELECT coalesce(sum(q.dead), 0)::bigint
                                          FROM {partitions} q
                                          WHERE q.quiet_at IS NOT NULL
                                            AND q.n >= $1 >> {id_bits}
                                            AND NOT {q_in_backlog}) AS total,
                              count(*) FILTER (WHERE status = 'parked'
                                                 AND aggregate_key IS NOT NULL) AS parked
                       FROM {table} WHERE status IN ('dead', 'parked') AND {in_backlog}) AS dead
                      LEFT JOIN parts p ON true"
            )?,
            // Each half reads its own partial index. The ordered half walks the aggregate
            // index in its order, so telling heads (oldest pending or parked row of their
            // aggregate) from the rows behind them needs no sort: every waiting row but a
            // head is blocked, so behind a parked head all are.
            stats_exact: values.render(
                "WITH u AS (
                   SELECT count(*) FILTER (WHERE lease_until IS NULL OR lease_until <= now()) AS waiting,
                          count(*) FILTER (WHERE lease_until > now()) AS in_flight,
                          count(*) FILTER (WHERE available_at <= now()) AS due,
                          min(created_at) AS oldest
                   FROM {table} WHERE status = 'pending' AND aggregate_key IS NULL),
                 r AS (
                   SELECT status, available_at, created_at,
                          status = 'pending' AND (lease_until IS NULL OR lease_until <= now()) AS waiting,
                          status = 'pending' AND lease_until > now() AS leased,
                          aggregate_key IS DISTINCT FROM lag(aggregate_key) OVER w AS head,
                          first_value(created_at) OVER w AS head_created
                   FROM {table} WHERE status IN ('pending', 'parked') AND aggregate_key IS NOT NULL
                   WINDOW w AS (PARTITION BY aggregate_key ORDER BY id)),
                 o AS (
                   SELECT count(*) FILTER (WHERE waiting) AS waiting,
                          count(*) FILTER (WHERE leased) AS in_flight,
                          count(*) FILTER (WHERE head AND status = 'pending'
                                                AND available_at <= now()) AS due,
                          count(*) FILTER (WHERE waiting AND NOT head) AS blocked,
                          min(created_at) FILTER (WHERE status = 'pending') AS oldest,
                          min(head_created) FILTER (WHERE waiting AND NOT head) AS blocked_head,
                          count(*) FILTER (WHERE status = 'parked') AS parked
                   FROM r)
                 SELECT u.waiting + o.waiting, u.in_flight + o.in_flight, u.due + o.due,
                        (SELECT coalesce(sum(sent), 0)::bigint FROM {counts}),
                        (SELECT count(*) FROM {table} WHERE status IN ('dead', 'parked')),
                        extract(epoch FROM now() - least(u.oldest, o.oldest))::float8,
                        o.blocked,
                        extract(epoch FROM now() - o.blocked_head)::float8,
                        o.parked
                 FROM u, o"
            )?,
            dead_where: values.render(
                "SELECT {record_columns}, t.last_error, t.done_at
                 FROM {table} t WHERE {filter}
                 ORDER BY t.done_at, t.id LIMIT $6"
            )?,
            dead_errors: values.render(
                "SELECT t.last_error, count(*), min(t.done_at), max(t.done_at), min(t.key)
                 FROM {table} t WHERE {filter}
                 GROUP BY t.last_error ORDER BY count(*) DESC, t.last_error"
            )?,
            count_where: values.render("SELECT count(*) FROM {table} t WHERE {filter}")?,
            // Returns the aggregates it locked: rows of others that die after its snapshot
            // are left out of the redrive that follows (see `REDRIVEN`).
            lock_redriven: values.render(
                "SELECT s.k FROM (SELECT ARRAY(SELECT DISTINCT t.aggregate_key::text FROM {table} t
                                             WHERE {filter} AND t.aggregate_key IS NOT NULL)
                                  AS k) s
                 CROSS JOIN LATERAL {lock_n_fn}(s.k)"
            )?,
            // A redriven row keeps its id, so it is again the head of its aggregate (a parked
            // one goes first, then the rows it held back, in order). It waits among the rows
            // the claim's scan finds, where it is the first of its aggregate. The lock of
            // `lock_redriven` keeps producers from adding to its aggregate meanwhile.
            redrive_hold: values.render(&redrive_hold())?,
            redrive_where: values.render(&redrive(""))?,
            // On a partitioned table its partitions are no longer quiet (migration 0016):
            // producers' looks read them again. The rows are read in the same snapshot as
            // the update's, so every partition it makes a row pending in is among them.
            // Closed partitions not settled only: the open one is never quiet (a redrive
            // whose snapshot predates its cut is among the transactions the upkeep waits
            // for), nor is one that holds a dead letter ever settled. Not only the quiet
            // ones: the update locks each, and the upkeep, which locks a partition before
            // it reads its rows, must wait for this transaction or be waited for. Locked in
            // their order, as a purge locks them, so the two never wait for each other in
            // a cycle.
            redrive_partitioned: values.render(&redrive(
                ",
                 unquiet AS (
                   UPDATE {partitions} p SET quiet_at = NULL, dead = NULL
                   WHERE p.n IN (SELECT q.n FROM {partitions} q
                                 WHERE q.closed_at IS NOT NULL AND q.settled_at IS NULL
                                   AND q.n IN (SELECT r.id >> {id_bits} FROM redriven r)
                                 ORDER BY q.n FOR UPDATE))",
            ))?,
            skip_where: values.render("UPDATE {table} t SET status = 'dead' WHERE {filter}")?,
            // One bounded batch of finished rows in the states $5, oldest first; the sent
            // counter (slot $6) goes down by the sent rows deleted.
            purge_where: values.render(&purge(""))?,
            // On a partitioned table, a quiet partition's count of its dead letters goes
            // down too (migration 0018). Each closed partition it deletes dead letters from
            // is locked, quiet or not: the upkeep, which locks one before it counts it,
            // counts after this commits, or this waits for its count. (A purge whose
            // snapshot predates a cut is among the transactions the upkeep waits for before
            // that partition is quiet.) Locked in their order, as a redrive locks them. One
            // found with too many to count (-1), or whose count was too low (dead letters
            // made by hand), is counted again.
            purge_partitioned: values.render(&purge(
                ",
                 kept AS (UPDATE {partitions} p
                          SET dead = CASE WHEN p.dead >= c.dead THEN p.dead - c.dead END FROM c
                          WHERE p.n = c.part
                            AND p.n IN (SELECT q.n FROM {partitions} q
                                        WHERE q.closed_at IS NOT NULL
                                          AND q.n IN (SELECT part FROM c WHERE dead > 0)
                                        ORDER BY q.n FOR UPDATE))",
            ))?,
            // The first entry of the ready index: the oldest row a relay could take as it is.
            health_due: values.render(
                &format!(
                    "SELECT extract(epoch FROM now() - min(o.available_at))::float8
                     FROM {{table}} o WHERE {READY_ROWS}"
                ),
            )?,
            // Pending rows through their two partial indexes (in the ranges of
            // `BACKLOG_RANGES`), dead ones through the done index, there and in the ranges
            // of quiet partitions holding dead letters (`DEAD_RANGES`, after those; all
            // from $1, the oldest partition not settled): sent rows, however many, are
            // never read.
            topic_stats: by_ranges(
                &mut values,
                "SELECT topic, sum(pending)::bigint, sum(dead)::bigint FROM (
                   SELECT topic, count(*) AS pending, 0 AS dead FROM {table}
                   WHERE status = 'pending' AND aggregate_key IS NULL AND {in_backlog}
                   GROUP BY topic
                   UNION ALL
                   SELECT topic, count(*), 0 FROM {table}
                   WHERE status = 'pending' AND aggregate_key IS NOT NULL AND {in_backlog}
                   GROUP BY topic
                   UNION ALL
                   SELECT topic, 0, count(*) FROM {table}
                   WHERE status IN ('dead', 'parked') AND id >= $1
                     AND ({in_backlog} OR {dead_ranges})
                   GROUP BY topic
                 ) per GROUP BY topic ORDER BY topic",
            )?,
            // Dedupe records by message key ($1), older than $2 microseconds if given.
            purge_inbox_keys: values.render(
                "DELETE FROM {inbox} WHERE key = ANY($1)
                   AND ($2::bigint IS NULL OR processed_at < now() - $2 * interval '1 microsecond')"
            )?,
            count_inbox_keys: values.render(
                "SELECT count(*) FROM {inbox} WHERE key = ANY($1)
                   AND ($2::bigint IS NULL OR processed_at < now() - $2 * interval '1 microsecond')"
            )?,
            // What `purge_inbox` would delete: dedupe records and stray failure counts.
            count_inbox_older: values.render(
                "SELECT (SELECT count(*) FROM {inbox}
                         WHERE processed_at < now() - $1::bigint * interval '1 microsecond')
                      + (SELECT count(*) FROM {failures}
                         WHERE updated_at < now() - $1::bigint * interval '1 microsecond')"
            )?,
            // The inbox has no index on processed_at (every dedupe would pay for one), so
            // purging walks the primary key once, a bounded batch per statement from the
            // cursor ($2, $3), deleting the old rows of each batch by their tuple ids.
            // $1 age in microseconds; returns rows deleted, rows read and the new cursor.
            purge_inbox: values.render(
                "WITH batch AS (
                   SELECT ctid, consumer, key, processed_at FROM {inbox}
                   WHERE (consumer, key) > ($2, $3)
                   ORDER BY consumer, key LIMIT {purge_batch}),
                 gone AS (
                   DELETE FROM {inbox} WHERE ctid = ANY (ARRAY(
                     SELECT ctid FROM batch
                     WHERE processed_at < now() - $1::bigint * interval '1 microsecond'))
                   RETURNING 1),
                 last AS (SELECT consumer, key FROM batch ORDER BY consumer DESC, key DESC LIMIT 1)
                 SELECT (SELECT count(*) FROM gone), (SELECT count(*) FROM batch),
                        (SELECT consumer FROM last), (SELECT key FROM last)"
            )?,
            // Failure counts are deleted as their messages finish, so only strays of a crash
            // grow old here; the table is small and a scan of it is cheap.
            purge_failures: values.render(
                "WITH gone AS (
                   DELETE FROM {failures} WHERE ctid = ANY (ARRAY(
                     SELECT ctid FROM {failures}
                     WHERE updated_at < now() - $1::bigint * interval '1 microsecond'
                     LIMIT {purge_batch}))
                   RETURNING 1)
                 SELECT count(*) FROM gone"
            )?,
            // $1 consumer, $2 key, $3 the error, already made storable, $4 whether it is
            // permanent, $5 the failures after which the consumer gives up, $6 the handling
            // counted: counted again (its reply was lost), it answers with the count it made
            // rather than adding one more. A message whose dead letter is stored and that
            // fails again is a redriven copy: its count starts afresh.
            #[cfg(feature = "rabbitmq")]
            count_failure: values.render(
                "WITH counted AS (
                   INSERT INTO {failures} AS f (consumer, key, failures, last_error, dead, attempt)
                   VALUES ($1, $2, 1, $3, $4 OR 1 >= $5, $6)
                   ON CONFLICT (consumer, key) DO UPDATE
                     SET failures = CASE WHEN f.buried THEN 1 ELSE f.failures + 1 END,
                         last_error = EXCLUDED.last_error, updated_at = now(),
                         dead = $4 OR CASE WHEN f.buried THEN 1 >= $5
                                           ELSE f.dead OR f.failures + 1 >= $5 END,
                         attempt = $6, buried = false
                     WHERE f.attempt IS DISTINCT FROM $6
                   RETURNING failures, dead)
                 SELECT failures, dead FROM counted
                 UNION ALL
                 SELECT failures, dead FROM {failures}
                 WHERE consumer = $1 AND key = $2 AND attempt = $6
                   AND NOT EXISTS (SELECT 1 FROM counted)"
            )?,
            #[cfg(feature = "rabbitmq")]
            failure_state: values.render(
                "SELECT failures, last_error, buried FROM {failures}
                 WHERE consumer = $1 AND key = $2 AND dead"
            )?,
            // The dead letter of a message given up on is stored: a redelivery of it is acked.
            #[cfg(feature = "rabbitmq")]
            mark_buried: values.render(
                "UPDATE {failures} SET buried = true, updated_at = now()
                 WHERE consumer = $1 AND key = $2 AND dead"
            )?,
            #[cfg(feature = "rabbitmq")]
            forget_failures: values
                .render("DELETE FROM {failures} WHERE consumer = $1 AND key = $2")?,
            #[cfg(feature = "rabbitmq")]
            probe_consumer: values.render(
                "SELECT 1 FROM {inbox} LIMIT 0; SELECT attempt, buried FROM {failures} LIMIT 0"
            )?,
            claim: claim(&t, "")?,
            claim_after: claim(&t, "AND b.aggregate_key > $4")?,
            claim_ready: claim_ready(&t)?,
            // A payload never changes: no fence is needed to read it.
            payload_slices: values.render(
                "SELECT id, substring(payload FROM $2 FOR $3) FROM {table} WHERE id = ANY ($1)"
            )?,
            // Every outcome of a batch in one statement, each row fenced on id + the attempts
            // it had when claimed + still pending + the lease its claim stamped, so a relay
            // whose lease was lost and whose row was claimed since changes nothing, however
            // late it writes. A verdict (sent, retry, dead) counts an attempt; a hand-back
            // does not. Any outcome ends the row's run of claims without one.
            // $1 ids, $2 attempts at the claim, $3 outcome ('sent' | 'retry' | 'dead' | 'release'),
            // $4 retry delay in microseconds, $5 error text, $6 counter slot, $7 lease stamps,
            // $8 whether a dead row parks its aggregate, unless the row says.
            record_outcomes: values.render(
                "WITH o AS (
                   SELECT * FROM unnest($1::bigint[], $2::int[], $3::text[], $4::bigint[],
                                        $5::text[], $7::timestamptz[])
                     AS o(id, attempts, outcome, delay_us, error, lease)),
                 upd AS (
                   UPDATE {table} t SET
                     status = CASE o.outcome WHEN 'sent' THEN 'sent'
                                             WHEN 'dead' THEN CASE WHEN {parks} THEN 'parked'
                                                                   ELSE 'dead' END
                                             ELSE 'pending' END,
                     attempts = CASE o.outcome WHEN 'release' THEN t.attempts
                                               ELSE t.attempts + 1 END,
                     claims = 0,
                     available_at = CASE o.outcome
                                      WHEN 'retry' THEN now() + o.delay_us * interval '1 microsecond'
                                      WHEN 'release' THEN now()
                                      ELSE t.available_at END,
                     lease_until = NULL,
                     done_at = CASE WHEN o.outcome IN ('sent', 'dead') THEN now() END,
                     last_error = COALESCE(o.error, t.last_error)
                   FROM o
                   WHERE t.id = o.id AND t.attempts = o.attempts AND t.status = 'pending'
                     AND t.lease_until = o.lease
                   RETURNING t.status, t.id),
                 -- Counted by partition (migration 0012; all are partition 0 on a plain
                 -- table), so a partition dropped is taken off the count without a count.
                 c AS (SELECT id >> {id_bits} AS part, count(*) AS n,
                              count(*) FILTER (WHERE status = 'sent') AS sent
                       FROM upd GROUP BY 1),
                 bump AS (UPDATE {counts} k SET sent = k.sent + c.sent FROM c
                          WHERE k.part = c.part AND k.slot = $6 AND c.sent > 0)
                 SELECT coalesce(sum(n), 0)::bigint, coalesce(sum(sent), 0)::bigint FROM c"
            )?,
            migrations_table: values.render(
                "CREATE TABLE IF NOT EXISTS {migrations} (
                   version    integer     PRIMARY KEY,
                   name       text        NOT NULL,
                   applied_at timestamptz NOT NULL DEFAULT now())"
            )?,
            applied_versions: values.render("SELECT version FROM {migrations}")?,
            record_migration: render(
                RECORD_MIGRATION,
                &[
                    ("migrations", &table.companion("_migrations")),
                    ("version", "$1"),
                    ("name", "$2"),
                ],
            )?,
            channel: values.render("SELECT {channel_fn}()")?,
            schema_of: values.render(
                "SELECT coalesce(
                 (SELECT n.nspname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                  WHERE c.oid = to_regclass($1)),
                 current_schema())::text",
            )?,
            register_waiting: values.render(
                "WITH expired AS (DELETE FROM {waiting} WHERE seen < now() - interval '1 hour')
                 INSERT INTO {waiting} (relay) VALUES ($1)
                 ON CONFLICT (relay) DO UPDATE SET seen = now()"
            )?,
            unregister_waiting: values.render("DELETE FROM {waiting} WHERE relay = $1")?,
            report_relay: values.render(
                "WITH gone AS (DELETE FROM {relays} WHERE seen_at < now() - interval '1 day')
                 INSERT INTO {relays}
                   (relay, client_addr, pid, started_at, publisher, down_since, published,
                    upkeep_error, claimed_at, poll_interval)
                 VALUES ($1, host(inet_client_addr()), $2, $3, $4, $5, $6, $7,
                         now() - $8::bigint * interval '1 microsecond',
                         $9::bigint * interval '1 microsecond')
                 ON CONFLICT (relay) DO UPDATE SET
                   seen_at = now(), publisher = excluded.publisher,
                   down_since = excluded.down_since, published = excluded.published,
                   upkeep_error = excluded.upkeep_error, claimed_at = excluded.claimed_at,
                   poll_interval = excluded.poll_interval"
            )?,
            forget_relay: values.render("DELETE FROM {relays} WHERE relay = $1")?,
            maintain_partitions: values.render("SELECT {partition_fn}(false), {settle_fn}()")?,
            retire_partition: values.render(
                "SELECT {retire_fn}(now() - $1::bigint * interval '1 microsecond', $2)"
            )?,
            backlog_bounds: values.render(&format!(
                "SELECT s.first,
                        ARRAY(SELECT p.n FROM {{partitions}} p
                              WHERE p.settled_at IS NULL
                                AND (p.quiet_at IS NULL OR p.dead IS NULL)
                                AND p.n >= s.first >> {{id_bits}} AND p.n < d.last
                              UNION
                              SELECT d.last WHERE NOT EXISTS (
                                SELECT FROM {{partitions}} q
                                WHERE q.n = d.last AND q.quiet_at IS NOT NULL
                                  AND q.dead IS NOT NULL)
                              ORDER BY 1),
                        ARRAY(SELECT q.n FROM {{partitions}} q
                              WHERE q.quiet_at IS NOT NULL AND q.dead IS DISTINCT FROM 0
                                AND q.n >= s.first >> {{id_bits}}
                              ORDER BY q.n)
                 FROM ({BACKLOG_FROM}) AS s(first), (SELECT {{ids_drawn_fn}}()) AS d(last)"
            ))?,
            // From the catalog, which every role may read.
            is_partitioned: values.render(
                "SELECT coalesce((SELECT relkind = 'p' FROM pg_class
                                  WHERE oid = to_regclass('{table}')), false)"
            )?,
            lock_table: values.render("LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")?,
            partitions: values.render(
                "SELECT p.n, extract(epoch FROM p.every)::float8,
                        extract(epoch FROM now() - p.opened_at)::float8,
                        extract(epoch FROM now() - p.closed_at)::float8,
                        c.oid IS NOT NULL, greatest(c.reltuples, 0)::bigint,
                        extract(epoch FROM now() - p.settled_at)::float8,
                        -- Through the row's JSON: a table not migrated to 16 has no column.
                        to_jsonb(p) ->> 'quiet_at' IS NOT NULL
                 FROM {partitions} p
                 LEFT JOIN pg_class c
                   ON c.oid = to_regclass({schema_text} || quote_ident({name_text} || p.n))
                 ORDER BY p.n"
            )?,
            partition_left: values.render(
                "SELECT (SELECT count(*) FROM (SELECT 1 FROM {table}
                                               WHERE id >= $1 AND id < $2
                                                 AND status IN ('dead', 'parked')
                                               LIMIT 1000) AS kept),
                        EXISTS (SELECT 1 FROM {table}
                                WHERE id >= $1 AND id < $2 AND status = 'pending'
                                  AND (head OR aggregate_key IS NULL))
                        OR EXISTS (SELECT 1 FROM {table}
                                   WHERE id >= $1 AND id < $2 AND status = 'pending'
                                     AND aggregate_key IS NOT NULL),
                        EXISTS (SELECT FROM pg_locks WHERE locktype = 'virtualxid'
                                                       AND virtualxid = ANY (p.cut_vxids))
                        OR EXISTS (SELECT FROM pg_prepared_xacts
                                   WHERE database = current_database())
                 FROM {partitions} p WHERE p.n = $3 AND p.settled_at IS NULL"
            )?,
            has_rows: values.render("SELECT EXISTS (SELECT 1 FROM {table})")?,
            set_partition_interval: values.render(
                "UPDATE {partitions} SET every = $1::bigint * interval '1 microsecond'
                 WHERE closed_at IS NULL AND every <> $1::bigint * interval '1 microsecond'"
            )?,
            // Columns added since by name through the row's JSON, so that reports are read
            // from a table not yet migrated to version 15 (the error) or 22 (the claims) too.
            relays: values.render(
                "SELECT relay, client_addr, pid, started_at,
                        extract(epoch FROM now() - seen_at)::float8, publisher, down_since,
                        published, to_jsonb(r) ->> 'upkeep_error',
                        extract(epoch FROM now()
                                - (to_jsonb(r) ->> 'claimed_at')::timestamptz)::float8,
                        extract(epoch FROM (to_jsonb(r) ->> 'poll_interval')::interval)::float8
                 FROM {relays} r ORDER BY started_at, relay"
            )?,
            probe: values.render("SELECT 1 FROM {table} LIMIT 0")?,
        };
        values.finish()?;
        Ok(statements)
    }

    /// The table these statements were rendered for.
    pub(crate) fn table(&self) -> &TableName {
        &self.table
    }

    /// Maps "relation does not exist" on these statements (or "function" or "schema does
    /// not exist": enqueue calls functions the migrations create) to [`Error::NotMigrated`].
    pub(crate) fn db_error(&self, e: postgres::Error) -> Error {
        let missing = [
            SqlState::UNDEFINED_TABLE,
            SqlState::UNDEFINED_FUNCTION,
            SqlState::INVALID_SCHEMA_NAME,
        ];
        if e.code().is_some_and(|code| missing.contains(code)) {
            Error::NotMigrated {
                table: self.table.as_str().to_owned(),
                source: e,
            }
        } else {
            Error::Db(e)
        }
    }
}

/// Records a migration as applied: `{version}` and `{name}` are `$1` and `$2` in the
/// statement, SQL literals in the script of `Outbox::sql`.
pub(crate) const RECORD_MIGRATION: &str =
    "INSERT INTO {migrations} (version, name) VALUES ({version}, {name}) ON CONFLICT DO NOTHING";

const CREATE_SCHEMA: &str = "CREATE SCHEMA IF NOT EXISTS {schema}";

/// How long a migration waits for its locks on the outbox's tables.
pub(crate) const MIGRATION_LOCK_TIMEOUT: Duration = Duration::from_secs(5);

/// The claim: one statement that leases up to `$1` rows and `$3` payload bytes.
///
/// Rows a claim can take as they are (rows without an aggregate key, and heads marked at
/// enqueue, see migration 0007) come from the ready index, oldest due first, locked as they
/// are read under `FOR UPDATE SKIP LOCKED`: workers side by side take different rows, and
/// each row costs what an unordered one does. The other rows with an aggregate key wait
/// behind a head, or were not marked as one: a skip scan of the unmarked part of the ordered
/// index visits the first of each aggregate, starting after the caller's cursor, until it has
/// seen `2 x $1` due ones or `$5` in all; one is due when its time has come and no marked
/// head of its aggregate is still pending or parked (a probe of the marked part: only a
/// marked head can be ahead of an aggregate's first unmarked row). A lease pushes
/// `available_at` forward, so a leased head is not due and its aggregate is passed over; a
/// parked head is never due, nor is anything behind it. So the cost is what the claim
/// returns plus the heads it passes, never the rows waiting behind a head.
///
/// Behind every due head, marked or found, the claim reads a run of consecutive due rows:
/// it ends at the first row of the aggregate still pending or parked that is not due, so
/// a parked message in the middle holds back everything behind it. With a batch's worth
/// of heads or more, each gives one row (runs of one: the most aggregates, each in the
/// first confirm round). With fewer, they are shared among the `$6`
/// workers: runs are as long as fills the batch from a worker's share of all the heads seen
/// (due or in flight), so each claim takes about that share. A scan late in the key space
/// sees only the aggregates after its cursor, so the caller may pass in `$9` the most an
/// earlier claim of its lap saw, and runs are sized by that when it is more; the statement
/// returns what it saw with every row (and the one row of an empty claim). Ready rows and
/// found heads take turns, and found heads get at least half the batch when there are that
/// many, so neither kind starves the other.
///
/// Workers scanning the same aggregates see the same found heads, so twice the batch is read
/// as candidates and locked in order with `SKIP LOCKED` until the batch is full: a head
/// another claim holds costs a skipped row, not an empty claim.
///
/// A run is read from the statement's snapshot, so a concurrent claim may have taken (and
/// a concurrent outcome finished) part of it meanwhile. Every run row is therefore locked and
/// rechecked, and an aggregate keeps only the unbroken prefix of its run that starts at its
/// head: a run missing its head, or any row before another, is cut there; so is a run that
/// does not fit the batch or the byte budget. A row is locked only in the version the
/// snapshot read (its `ctid`): one changed since by a transaction that committed meanwhile,
/// which may have put a redriven message ahead of it (see [`redrive_hold`]), is passed over
/// rather than rechecked. That keeps the order strict whatever runs alongside.
///
/// A claim leases a row and counts one more claim without an outcome (`claims`, which any
/// outcome sets back to 0; `attempts` counts only verdicts, see migration 0009). A row whose
/// claims would pass `$7` (`max_claims`) has been in hand that often, in a row, when a relay
/// crashed or lost its connection: a crash loop, maybe its own doing. It becomes dead (or
/// parked, see `PARKS`, with the caller's setting in `$8`) here instead of being published
/// again. Every row (and the one
/// row of an empty claim) carries where the next claim's scan should start: after the last
/// aggregate this claim took from the scan, else after the last one it visited, or at the
/// first (NULL) once the scan has passed the last aggregate.
fn claim(t: &str, after: &str) -> Result<String, RenderError> {
    // The rows of the skip scan: those of an aggregate that were not marked as its head.
    let behind = "b.status IN ('pending', 'parked') AND b.aggregate_key IS NOT NULL AND NOT b.head";
    // A row found by the scan is due when it is pending, its time has come and no marked
    // head of its aggregate is before it. (The marked part holds a head per aggregate at
    // most, and none of the rows sent behind it: the probe reads next to nothing.)
    let b_due = render(
        "b.status = 'pending' AND b.available_at <= now()
         AND NOT EXISTS (SELECT 1 FROM {table} p
                         WHERE p.head AND p.aggregate_key = b.aggregate_key AND p.id < b.id
                           AND p.status IN ('pending', 'parked'))",
        &[("table", t)],
    )?;
    render(
        "WITH RECURSIVE behind(aggregate_key, id, due, n, d, version) AS (
           (SELECT f.aggregate_key, f.id, f.due, 1, f.due::int, f.version FROM (
              SELECT b.aggregate_key, b.id, {b_due} AS due, b.ctid AS version FROM {table} b
              WHERE {behind} {after}
              ORDER BY b.aggregate_key, b.id LIMIT 1) f)
           UNION ALL
           SELECT nx.aggregate_key, nx.id, nx.due, h.n + 1, h.d + nx.due::int, nx.version
           FROM behind h CROSS JOIN LATERAL (
             SELECT b.aggregate_key, b.id, {b_due} AS due, b.ctid AS version FROM {table} b
             WHERE {behind} AND b.aggregate_key > h.aggregate_key
             ORDER BY b.aggregate_key, b.id LIMIT 1) nx
           WHERE h.n < $5 AND h.d < 2 * $1),
         -- A batch of one goes to either kind at random.
         ready AS (
           SELECT o.id, o.aggregate_key, o.available_at, {bytes} AS bytes FROM {table} o
           WHERE {ready_rows}
           ORDER BY o.available_at, o.id
           LIMIT $1 - least((SELECT count(*) FROM behind WHERE due),
                            CASE WHEN $1 > 1 THEN $1 / 2 ELSE (random() < 0.5)::int END)
           FOR UPDATE SKIP LOCKED),
         -- Ready rows take the odd places, found heads the even ones.
         placed AS (
           SELECT id, aggregate_key, bytes,
                  2 * row_number() OVER (ORDER BY available_at, id) - 1 AS hpos
           FROM ready),
         heads AS (
           SELECT aggregate_key, id, due, 2 * n AS hpos, true AS scanned, false AS held, version
           FROM behind
           UNION ALL
           SELECT aggregate_key, id, true, hpos, false, true, NULL::tid
           FROM placed WHERE aggregate_key IS NOT NULL),
         -- Sized by every aggregate seen, due or in flight, so that a claim finding only a
         -- few free heads while other workers hold the rest takes short runs of them, not
         -- one long run: every confirm round stays wide. (The scan may pass the row behind
         -- a ready head: one aggregate. A batch of ready heads needs no counting.)
         seen AS (
           SELECT CASE WHEN (SELECT count(*) FROM placed
                             WHERE aggregate_key IS NOT NULL) >= $1 THEN $1
                       ELSE (SELECT count(DISTINCT aggregate_key) FROM heads)
                  END AS n),
         run_len AS (
           SELECT CASE WHEN n >= $1 THEN 1
                       ELSE greatest(1, ceil($1::numeric / greatest(1, ceil(n::numeric / $6))))
                  END::bigint AS r
           FROM (SELECT greatest($9, (SELECT n FROM seen)) AS n) a),
         -- Materialized: a row locked below that a concurrent claim changed is rechecked
         -- against the candidates, and inlined they would be read again for every such
         -- row (measured: 200 ms and 118,000 buffers for one claim of 40 aggregates).
         ocand AS MATERIALIZED (
           -- Runs of one are the due heads themselves: no need to read behind them.
           (SELECT h.id, h.aggregate_key, h.hpos, 1::bigint AS rn, h.scanned, false AS held,
                   h.version
            FROM heads h
            WHERE h.due AND NOT h.held AND (SELECT r FROM run_len) = 1
            ORDER BY h.hpos LIMIT 2 * $1)
           UNION ALL
           -- Behind a marked head (locked already) its run goes on with the unmarked rows
           -- after it; a found head starts its run. The run ends at the first row that is
           -- not due: a parked one holds back everything behind it.
           (SELECT r.id, h.aggregate_key, h.hpos, r.rn, h.scanned, h.held, r.version
            FROM heads h CROSS JOIN LATERAL (
              SELECT s.id, s.rn, s.version FROM (
                SELECT o.id, o.version, row_number() OVER w + h.held::int AS rn,
                       bool_and(o.status = 'pending' AND o.available_at <= now()) OVER w AS due
                FROM (SELECT o.id, o.ctid AS version, o.status, o.available_at FROM {table} o
                      WHERE NOT o.head AND o.status IN ('pending', 'parked')
                        AND o.aggregate_key = h.aggregate_key AND o.id >= h.id
                      ORDER BY o.id LIMIT (SELECT r FROM run_len) - h.held::int) o
                WINDOW w AS (ORDER BY o.id)) s
              WHERE s.due) r
            WHERE h.due AND (SELECT r FROM run_len) > 1
            ORDER BY h.hpos, r.rn
            LIMIT 2 * $1)),
         olock AS (
           SELECT o.id, c.aggregate_key, c.hpos, c.rn, c.scanned, c.held, {bytes} AS bytes
           FROM ocand c JOIN {table} o ON o.id = c.id
           -- The version read: a row changed since the statement's snapshot (a redrive
           -- put a message ahead of it, see redrive_hold) is left for the next claim.
           WHERE o.ctid = c.version AND o.status = 'pending' AND o.available_at <= now()
           ORDER BY c.hpos, c.rn
           LIMIT $1 - (SELECT count(*) FROM ready)
           FOR UPDATE OF o SKIP LOCKED),
         -- A run behind a ready head starts at 2: the head is the ready row.
         ovalid AS (
           SELECT id, aggregate_key, hpos, rn, scanned, bytes, held,
                  row_number() OVER (PARTITION BY aggregate_key ORDER BY rn) AS pos
           FROM olock),
         picked AS (
           SELECT id, aggregate_key, scanned, bytes, hpos, rn FROM ovalid
           WHERE pos + held::int = rn
           UNION ALL
           SELECT id, aggregate_key, false, bytes, hpos, 1 FROM placed),
         take AS (
           SELECT id, aggregate_key, scanned, rank FROM (
             SELECT id, aggregate_key, scanned, row_number() OVER k AS rank,
                    sum(coalesce(bytes, 0)) OVER k AS total
             FROM picked WINDOW k AS (ORDER BY hpos, rn, id)) p
           WHERE rank <= $1 AND (rank = 1 OR total <= $3)),
         upd AS ({lease_taken}),
         scan AS (
           SELECT coalesce(
             (SELECT aggregate_key FROM take WHERE scanned ORDER BY rank DESC LIMIT 1),
             CASE WHEN (SELECT count(*) FROM behind) >= $5
                       OR (SELECT count(*) FROM behind WHERE due) >= 2 * $1
                  THEN (SELECT aggregate_key FROM behind ORDER BY n DESC LIMIT 1) END)
             AS next_cursor),
         reply AS ({reply})
         SELECT reply.*, scan.next_cursor, (SELECT n FROM seen) AS seen
         FROM scan LEFT JOIN reply ON true",
        &[
            ("table", t),
            ("after", after),
            ("behind", behind),
            ("b_due", &b_due),
            ("bytes", CLAIMED_BYTES),
            ("ready_rows", READY_ROWS),
            ("lease_taken", &lease_taken(t)?),
            ("reply", CLAIM_REPLY),
        ],
    )
}

/// The ready rows `o`, due now: rows without an aggregate key and heads marked at enqueue,
/// in the words of `{ready_idx}`'s predicate (migration 0007), so that index serves each
/// statement that reads them.
const READY_ROWS: &str = "o.status = 'pending' AND (o.head OR o.aggregate_key IS NULL)
     AND o.available_at <= now()";

/// What a claimed row `o` weighs against a claim's byte budget: its payload and headers.
const CLAIMED_BYTES: &str = "octet_length(o.payload) + pg_column_size(o.headers)";

/// The lease a claim takes on the rows of its `take`, in the statement's parameters `$2`
/// (lease), `$7` (`max_claims`) and `$8` (parks): one more claim without an outcome, or the
/// end of a crash loop (see [`claim`]).
fn lease_taken(t: &str) -> Result<String, RenderError> {
    let over = "t.claims + 1 > $7";
    render(
        "UPDATE {table} t SET
  claims = t.claims + 1,
  status = CASE WHEN NOT {over} THEN 'pending'
                WHEN {parks} THEN 'parked' ELSE 'dead' END,
  available_at = CASE WHEN {over} THEN t.available_at
                      ELSE now() + $2::bigint * interval '1 microsecond' END,
  lease_until = CASE WHEN {over} THEN NULL
                     ELSE now() + $2::bigint * interval '1 microsecond' END,
  done_at = CASE WHEN {over} THEN now() END,
  last_error = CASE WHEN {over}
                 THEN 'claimed ' || t.claims + 1 || ' times in a row without an '
                      || 'outcome (a relay crashed, or lost its connection, with '
                      || 'the message in hand each time): more than max_claims ('
                      || $7 || ') allows'
                 ELSE t.last_error END
-- An id list, not a join: a join may be planned as a merge along the primary key
-- from its first id, through every sent row.
WHERE t.id = ANY (ARRAY(SELECT id FROM take))
RETURNING {claimed_columns}, t.status, t.claims",
        &[
            ("table", t),
            ("over", over),
            ("parks", PARKS),
            ("claimed_columns", &claimed_columns()?),
        ],
    )
}

/// The rows a claim leased or finished (`upd`), as the statement returns them: each
/// payload while the payloads so far, in id order, come to `$10` bytes at most, and none
/// after that but those of rows that died at the claim (rare, and told to metrics whole) (a claim's reply must arrive within the caller's deadline whatever the link;
/// the caller reads the rest, `payload_slices`, in statements of their own). The last
/// column holds the length of a payload left out.
const CLAIM_REPLY: &str = "SELECT r.id, r.key, r.topic, r.aggregate_key,
       CASE WHEN r.inline THEN r.payload END AS payload, r.content_type, r.headers,
       r.attempt, r.max_attempts, r.created_at, r.lease_until, r.park, r.status, r.claims,
       CASE WHEN NOT r.inline THEN octet_length(r.payload) END AS deferred
     FROM (SELECT u.*, u.status <> 'pending'
                       OR sum(octet_length(u.payload)) OVER (ORDER BY u.id) <= $10 AS inline
           FROM upd u) r";

/// The claim of a worker woken by a producer's notification: the ready rows alone (rows
/// without an aggregate key and heads marked at enqueue, see [`claim`]), oldest due first,
/// as many as `$1` rows and `$3` bytes allow, under the same lease, with the same columns
/// and parameters (`$4`, `$5`, `$6` and `$9` unused) and no cursor. A commit that notified
/// made its rows ready, unless an earlier row of their aggregate is still pending (those
/// wait for that row's outcome, which wakes the full claim) or the commit wrote several rows
/// of one aggregate: then rows wait behind a ready head, and this claim takes nothing, so
/// that the full claim takes each head with its run. So it reads an index range a few rows
/// long and probes the aggregates it found, where the full claim scans the aggregates for
/// heads. A worker falls back to the full claim when this one takes nothing, and claims
/// fully after it, so nothing waits longer for it.
fn claim_ready(t: &str) -> Result<String, RenderError> {
    render(
        "WITH ready AS (
           SELECT o.id, o.aggregate_key, o.available_at, {bytes} AS bytes FROM {table} o
           WHERE {ready_rows}
           ORDER BY o.available_at, o.id
           LIMIT $1
           FOR UPDATE SKIP LOCKED),
         runs AS (
           SELECT EXISTS (SELECT 1 FROM ready r JOIN {table} b
                            ON NOT b.head AND b.aggregate_key = r.aggregate_key
                               AND b.id > r.id AND b.status IN ('pending', 'parked'))
             AS found),
         take AS (
           SELECT id FROM (
             SELECT id, row_number() OVER k AS rank, sum(coalesce(bytes, 0)) OVER k AS total
             FROM ready WINDOW k AS (ORDER BY available_at, id)) p
           WHERE (rank = 1 OR total <= $3) AND NOT (SELECT found FROM runs)),
         upd AS ({lease_taken}),
         reply AS ({reply})
         SELECT reply.*, NULL::text AS next_cursor, 0::bigint AS seen FROM reply",
        &[
            ("table", t),
            ("bytes", CLAIMED_BYTES),
            ("ready_rows", READY_ROWS),
            ("lease_taken", &lease_taken(t)?),
            ("reply", CLAIM_REPLY),
        ],
    )
}

/// A bigint constant in SQL text.
pub(crate) fn bigint(value: i64) -> String {
    format!("({value})::bigint")
}

/// The table's objects that statements and migrations both name, each under the one
/// placeholder name both use.
pub(crate) fn objects(table: &TableName) -> Vec<(&'static str, String)> {
    vec![
        ("table", table.quoted()),
        ("inbox", table.companion("_inbox")),
        ("failures", table.companion("_failures")),
        ("waiting", table.companion("_waiting")),
        ("counts", table.companion("_counts")),
        ("relays", table.companion("_relays")),
        ("enqueue_fn", table.companion("_enqueue")),
        ("enqueue_n_fn", table.companion("_enqueue_n")),
        ("lock_n_fn", table.companion("_lock_n")),
        ("lock_heads_fn", table.companion("_lock_heads")),
        ("notify_fn", table.companion("_notify")),
        ("channel_fn", table.companion("_channel")),
        ("partitions", table.companion("_partitions")),
        ("partition_fn", table.companion("_partition")),
        ("retire_fn", table.companion("_retire")),
        ("settle_fn", table.companion("_settle")),
        ("ids_drawn_fn", table.companion("_ids_drawn")),
    ]
}

/// Named values as `Values::new` borrows them.
pub(crate) fn borrowed<'a>(vars: &'a [(&'static str, String)]) -> Vec<(&'a str, &'a str)> {
    vars.iter()
        .map(|(name, value)| (*name, value.as_str()))
        .collect()
}

/// USAGE on the schema the table is in, found when the statements run: `Outbox::sql()` may
/// render a name without one. (The role's name holds no quote, dollar or backslash: see
/// `Outbox::grants`.)
const GRANT_SCHEMA: &str = "DO $grant$
DECLARE
    home name := (SELECT n.nspname FROM pg_class c
                  JOIN pg_namespace n ON n.oid = c.relnamespace
                  WHERE c.oid = to_regclass('{table_text}'));
BEGIN
    IF home IS NULL THEN
        RAISE EXCEPTION 'outbox {table_text} does not exist: migrate first'
            USING ERRCODE = 'undefined_table';
    END IF;
    EXECUTE format('GRANT USAGE ON SCHEMA %I TO {role}', home);
END
$grant$;
";

/// What each side needs (docs/grants.md; tests/core.rs and tests/partitions.rs
/// run each side with these and no other rights). `{role}` is the quoted role.
fn grant_template(access: Access) -> &'static str {
    match access {
        Access::Produce => {
            "GRANT SELECT, INSERT ON {table} TO {role};
GRANT SELECT ON {waiting}, {partitions} TO {role};
"
        }
        Access::Relay => {
            "GRANT SELECT, UPDATE ON {table} TO {role};
GRANT SELECT, INSERT, UPDATE ON {counts} TO {role};
GRANT SELECT, INSERT, UPDATE, DELETE ON {waiting}, {relays} TO {role};
GRANT SELECT ON {partitions} TO {role};
GRANT EXECUTE ON FUNCTION {partition_fn}(boolean), {settle_fn}(), {ids_drawn_fn}() TO {role};
"
        }
        Access::Dedupe => {
            "GRANT INSERT ON {inbox} TO {role};
"
        }
        Access::Consume => {
            "GRANT SELECT, INSERT ON {inbox} TO {role};
GRANT SELECT, INSERT, UPDATE, DELETE ON {failures} TO {role};
"
        }
        Access::Retire => {
            "GRANT EXECUTE ON FUNCTION {retire_fn}(timestamptz, boolean) TO {role};
"
        }
    }
}

/// The GRANT statements of [`Outbox::grants`](crate::Outbox::grants) for `role`, quoted.
pub(crate) fn grants(table: &TableName, access: Access, role: &str) -> String {
    checked(render_grants(table, access, role))
}

fn render_grants(table: &TableName, access: Access, role: &str) -> Result<String, RenderError> {
    let mut vars = objects(table);
    vars.extend([("table_text", table.quoted()), ("role", role.to_owned())]);
    // Each side's template names some of the table's objects, not all: no `finish`.
    let mut values = Values::new(&borrowed(&vars))?;
    Ok(values.render(GRANT_SCHEMA)? + &values.render(grant_template(access))?)
}

/// Session settings of a relay worker's connection (see `relay/worker.rs` for why each).
/// The table name is a validated identifier: nothing in it can end the literal.
pub(crate) fn relay_session(table: &TableName, statement_timeout: Duration) -> String {
    checked(render(
        "SET application_name = 'outbox relay {table}'; \
         SET statement_timeout = {ms}; \
         SET idle_in_transaction_session_timeout = {ms}; \
         SET jit = off; \
         SET synchronous_commit = off; \
         SET default_transaction_isolation = 'read committed'",
        &[
            ("table", table.as_str()),
            ("ms", &statement_timeout.as_millis().to_string()),
        ],
    ))
}

/// Whether the server takes no writes: a hot standby, or a primary made read-only (as a
/// planned switchover fences the old primary with `default_transaction_read_only`).
pub(crate) const READ_ONLY: &str =
    "SELECT pg_is_in_recovery() OR current_setting('transaction_read_only')::boolean";

/// Has the server end this connection: a pool then drops it rather than hand it out again.
pub(crate) const END_OWN_BACKEND: &str = "SELECT pg_terminate_backend(pg_backend_pid())";

/// Undoes [`relay_session`] before a pooled connection goes back.
pub(crate) const RELAY_SESSION_RESET: &str = "RESET application_name; RESET statement_timeout; \
     RESET idle_in_transaction_session_timeout; RESET jit; RESET plan_cache_mode; \
     RESET enable_seqscan; RESET synchronous_commit; RESET default_transaction_isolation";

/// A relay session's plans on a partitioned table: planned once per connection. Planned
/// for each claim's values (which PostgreSQL keeps choosing, as their estimates look
/// cheaper), every statement plans every partition: half the relay's rate with a dozen
/// partitions (BENCHMARKS.md, "Partitioned outboxes at scale"). And no sequential scan
/// where an index serves: a plan made while a partition ahead was empty would read it
/// whole once it is the open one, until the next analyze. A plain table keeps the
/// server's choices.
pub(crate) const PARTITIONED_PLANS: &str =
    "SET plan_cache_mode = force_generic_plan; SET enable_seqscan = off";

/// Session settings of a relay's listener connection.
pub(crate) const LISTENER_SESSION: &str = "SET application_name = 'postgres-outbox listener'";

/// Undoes [`LISTENER_SESSION`] and the LISTEN before a pooled connection goes back.
pub(crate) const LISTENER_SESSION_RESET: &str = "UNLISTEN *; RESET application_name";

/// Listens on a channel, as the migrations named it (quoted here: it may be a hash).
pub(crate) fn listen(channel: &str) -> String {
    checked(render("LISTEN {channel}", &[("channel", &quote(channel))]))
}

/// Names a session for `pg_stat_activity`, the name bound as `$1`.
#[cfg(feature = "rabbitmq")]
pub(crate) const SET_APPLICATION_NAME: &str = "SELECT set_config('application_name', $1, false)";

/// Undoes a consumer's session settings before a pooled connection goes back.
#[cfg(feature = "rabbitmq")]
pub(crate) const CONSUMER_SESSION_RESET: &str = "RESET statement_timeout; RESET application_name";

/// The statement timeout of a consumer's handler sessions.
#[cfg(feature = "rabbitmq")]
pub(crate) fn consumer_session(statement_timeout: Duration) -> String {
    checked(render(
        "SET statement_timeout = {ms}",
        &[("ms", &statement_timeout.as_millis().to_string())],
    ))
}

/// The SQL text, or a panic naming the template fault (a bug of this crate, see `render.rs`).
pub(crate) fn checked<T>(rendered: Result<T, RenderError>) -> T {
    rendered.unwrap_or_else(|e| panic!("postgres-outbox renders its SQL wrongly: {e}"))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::schema::render::placeholders;

    /// A name of every kind the crate accepts: plain, schema-qualified, mixed case, the
    /// longest table part, and one too long for its channel (which becomes a hash).
    pub(crate) fn tables() -> Vec<TableName> {
        let long = format!("{}.{}", "s".repeat(40), "t".repeat(40));
        let longest = "a".repeat(52);
        ["orders_outbox", "app.events", "Orders_1", &long, &longest]
            .iter()
            .map(|name| TableName::parse(name).unwrap())
            .collect()
    }

    #[test]
    fn every_template_renders_for_every_table() {
        for table in tables() {
            let statements = Statements::render(&table).unwrap();
            // Debug shows every statement, whatever fields are added later.
            let every_statement = format!("{statements:?}");
            assert!(
                placeholders(&every_statement).is_empty(),
                "{}: {:?}",
                table.as_str(),
                placeholders(&every_statement)
            );
        }
    }

    #[test]
    fn session_settings_render_for_every_table() {
        for table in tables() {
            let setup = relay_session(&table, Duration::from_millis(2500));
            assert!(placeholders(&setup).is_empty(), "{setup}");
            assert!(setup.contains(&format!("'outbox relay {}'", table.as_str())));
            assert!(setup.contains("statement_timeout = 2500;"), "{setup}");
            assert!(setup.contains("idle_in_transaction_session_timeout = 2500;"));
            assert!(setup.ends_with("default_transaction_isolation = 'read committed'"));
            // Whatever a relay session sets goes before its connection goes back.
            for set in setup.split(';').chain(PARTITIONED_PLANS.split(';')) {
                let name = set.trim().trim_start_matches("SET ").split(' ').next();
                let name = name.unwrap_or_default();
                assert!(
                    RELAY_SESSION_RESET.contains(&format!("RESET {name};"))
                        || RELAY_SESSION_RESET.ends_with(&format!("RESET {name}")),
                    "{name} is set and never reset"
                );
            }
            let channel = Statements::new(&table).table().channel();
            assert_eq!(listen(&channel), format!("LISTEN {}", quote(&channel)));
        }
        #[cfg(feature = "rabbitmq")]
        assert_eq!(
            consumer_session(Duration::from_secs(30)),
            "SET statement_timeout = 30000"
        );
    }

    #[test]
    fn statements_a_migration_runs_render_as_they_always_did() {
        let qualified = Statements::new(&TableName::parse("app.events").unwrap());
        assert_eq!(
            qualified.create_schema.as_deref(),
            Some("CREATE SCHEMA IF NOT EXISTS \"app\"")
        );
        assert_eq!(
            qualified.migration_lock_timeout,
            "SET LOCAL lock_timeout = 5000"
        );
        assert_eq!(
            qualified.record_migration,
            "INSERT INTO \"app\".\"events_migrations\" (version, name) VALUES ($1, $2) \
             ON CONFLICT DO NOTHING"
        );
        let plain = Statements::new(&TableName::parse("orders").unwrap());
        assert_eq!(plain.create_schema, None);
    }

    #[test]
    fn grants_render_for_every_side_and_table() {
        for table in ["orders_outbox", "app.events"] {
            let table = TableName::parse(table).unwrap();
            for access in [
                Access::Produce,
                Access::Relay,
                Access::Dedupe,
                Access::Consume,
                Access::Retire,
            ] {
                let sql = grants(&table, access, "\"app-relay@example.com\"");
                assert!(
                    sql.contains("GRANT USAGE ON SCHEMA %I TO \"app-relay@example.com\"'"),
                    "{sql}"
                );
                assert!(!sql.contains('{'), "{sql}");
            }
        }
        let relay = grants(
            &TableName::parse("app.events").unwrap(),
            Access::Relay,
            "\"relay\"",
        );
        assert!(relay.contains(
            "GRANT EXECUTE ON FUNCTION \"app\".\"events_partition\"(boolean), \
             \"app\".\"events_settle\"(), \"app\".\"events_ids_drawn\"() TO \"relay\";"
        ));
    }
}
