//! The statements of the health checks, rendered once per table.

use crate::schema::render::{RenderError, Values};
use crate::schema::statements::{borrowed, shared, Statements};
use crate::schema::table::TableName;

/// The statements of the health checks, and the relays' reports they read.
#[derive(Debug)]
pub(crate) struct HealthSql {
    /// The partitions, oldest first, with their rows as the planner estimates them.
    pub(crate) partitions: String,
    /// What keeps partition $3, of ids $1 to $2 (excluded), from settling: its dead and
    /// parked rows (counted up to 1,000) and whether it has pending ones, through the
    /// partial indexes, as the upkeep looks; and whether a transaction the upkeep wrote
    /// down at its cut, or a prepared one, runs still. No row once it has settled or gone.
    pub(crate) partition_left: String,
    /// The relays' reports, oldest relay first.
    pub(crate) relays: String,
}

impl Statements for HealthSql {
    fn render(table: &TableName) -> Result<Self, RenderError> {
        let vars = shared(
            table,
            &["table", "relays", "partitions", "schema_text", "name_text"],
        )?;
        let mut values = Values::new(&borrowed(&vars))?;
        let statements = HealthSql {
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
                 ORDER BY p.n",
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
                 FROM {partitions} p WHERE p.n = $3 AND p.settled_at IS NULL",
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
                 FROM {relays} r ORDER BY started_at, relay",
            )?,
        };
        values.finish()?;
        Ok(statements)
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::statements::tests::renders_for_every_table;

    #[test]
    fn every_template_renders_for_every_table() {
        renders_for_every_table::<HealthSql>();
    }
}
