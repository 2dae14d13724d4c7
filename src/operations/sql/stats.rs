//! The statements of the counts, rendered once per table.

use crate::schema::render::{RenderError, Values};
use crate::schema::statements::{borrowed, shared, Statements, PARTITION_ID_BITS, READY_ROWS};
use crate::schema::table::TableName;

/// The statements of `Outbox::stats` and `Outbox::topic_stats`.
#[derive(Debug)]
pub(crate) struct StatsSql {
    /// Counts by state from at most `STATS_COUNTED` rows of each part of the backlog, and
    /// the estimated sizes of the ready and ordered indexes (see `Outbox::stats`): every
    /// row in the ranges from `$2` on (`backlog_bounds`, see `BACKLOG_RANGES`; all ids on a
    /// plain table), so that the partitions out of them are left out of the plan, and the
    /// dead letters counted in the quiet ones from `$1` on left out.
    pub(crate) stats: Vec<String>,
    /// What `stats` and `topic_stats` read on a partitioned table: the first id of the
    /// oldest partition not settled (migration 7), whose rows may still be pending,
    /// parked or dead; the partitions from there that may hold a pending or parked row
    /// (not quiet), or dead letters not counted, up to the partition of the last id drawn
    /// (migration 7), past which no row is, and that one unless its bookkeeping says it
    /// is quiet (were its row lost, the rows written there would be missed); and the quiet
    /// ones whose dead letters are counted as some, or not counted (migration 7).
    pub(crate) backlog_bounds: String,
    /// Counts by state from every pending and parked row.
    pub(crate) stats_exact: String,
    pub(crate) topic_stats: Vec<String>,
    /// How long the oldest due ready row has waited, in seconds (NULL when none is due).
    pub(crate) health_due: String,
}

impl Statements for StatsSql {
    fn render(table: &TableName) -> Result<Self, RenderError> {
        let mut vars = shared(
            table,
            &[
                "table",
                "counts",
                "partitions",
                "ids_drawn_fn",
                "ready_idx",
                "ordered_idx",
                "schema_text",
                "name_text",
                "id_bits",
            ],
        )?;
        vars.extend([("stats_counted", STATS_COUNTED.to_string())]);
        let mut values = Values::new(&borrowed(&vars))?;
        let statements = StatsSql {
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
                 -- from $1 on left out (migration 7).
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
        };
        values.finish()?;
        Ok(statements)
    }
}

/// The first id that may belong to a pending, parked or dead row of a partitioned table:
/// the first of the oldest partition not settled (migration 7). Settled partitions hold
/// sent rows only, and nothing may write to them again.
const BACKLOG_FROM: &str =
    "SELECT coalesce(min(n), 0) << {id_bits} FROM {partitions} WHERE settled_at IS NULL";

/// How many ranges of ids `stats` and `topic_stats` read the backlog in, at most (`$2` on,
/// two a range: its first id and its last). They cover the partitions of a partitioned
/// table that may hold a pending or parked row (not quiet), or dead letters not counted
/// (migration 7), up to the partition of the last id drawn (migration 7), and that
/// one: the partitions made ahead, and the quiet ones between held ones (after messages
/// scheduled far ahead, or parked, in old partitions), are left out. A run of neighbours
/// takes one range; past the last range, the rest go into it, with the partitions between.
/// On a plain table, one range: every id.
pub(crate) const BACKLOG_RANGES: usize = 4;

/// How many ranges of ids, besides the backlog's, `topic_stats` reads dead letters in
/// (after the backlog's, two a range), as `BACKLOG_RANGES` are made: the quiet partitions
/// whose dead letters the upkeep counted as some, or has not counted.
pub(crate) const DEAD_RANGES: usize = 4;

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

/// How many rows of each part of the backlog `stats` reads: past that, it estimates. Reading
/// 2,000 of each, the whole statement takes about 3 ms on the reference machine (`scale` bench).
pub(crate) const STATS_COUNTED: u64 = 2000;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::statements::tests::renders_for_every_table;

    #[test]
    fn every_template_renders_for_every_table() {
        renders_for_every_table::<StatsSql>();
    }
}
