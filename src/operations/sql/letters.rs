//! The statements of dead letters, redrive, skip and purge, rendered once per table.

use crate::schema::render::{render, RenderError, Values};
use crate::schema::statements::{borrowed, shared, Statements, RECORD_TEMPLATE};
use crate::schema::table::TableName;

/// The operator's statements on rows a filter selects (dead letters, redrive, skip,
/// purge), on the inbox, and the retirement of partitions.
#[derive(Debug)]
pub(crate) struct LettersSql {
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
    pub(crate) purge_inbox_keys: String,
    pub(crate) count_inbox_keys: String,
    pub(crate) count_inbox_older: String,
    pub(crate) purge_inbox: String,
    pub(crate) purge_failures: String,
    /// Drops a closed partition whose rows are all sent longer ago than $1 us, and its sent
    /// count with it; returns how many rows it held (NULL: none dropped). With $2, drops
    /// nothing and counts the rows of every partition it would.
    pub(crate) retire_partition: String,
}

impl Statements for LettersSql {
    fn render(table: &TableName) -> Result<Self, RenderError> {
        let mut vars = shared(
            table,
            &[
                "table",
                "inbox",
                "failures",
                "counts",
                "lock_n_fn",
                "partitions",
                "retire_fn",
                "id_bits",
            ],
        )?;
        vars.extend([
            ("record_columns", record_columns()?),
            ("filter", FILTER.to_owned()),
            ("purge_batch", PURGE_BATCH.to_string()),
        ]);
        let mut values = Values::new(&borrowed(&vars))?;
        let statements = LettersSql {
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
            // On a partitioned table its partitions are no longer quiet (migration 7):
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
            // down too (migration 7). Each closed partition it deletes dead letters from
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
            retire_partition: values.render(
                "SELECT {retire_fn}(now() - $1::bigint * interval '1 microsecond', $2)"
            )?,
        };
        values.finish()?;
        Ok(statements)
    }
}

/// The conditions of an operator's filter on rows `t`: $5 the states it selects, and, each
/// ignored when NULL, $1 keys, $2 topic, $3 text the last error contains, $4 minimum age in
/// microseconds since the row finished.
const FILTER: &str = "t.status = ANY($5::text[])
     AND ($1::text[] IS NULL OR t.key = ANY($1))
     AND ($2::text IS NULL OR t.topic = $2)
     AND ($3::text IS NULL OR strpos(t.last_error, $3) > 0)
     AND ($4::bigint IS NULL OR t.done_at < now() - $4 * interval '1 microsecond')";

/// A record as an operator lists it: its attempt is the number of attempts made.
fn record_columns() -> Result<String, RenderError> {
    render(RECORD_TEMPLATE, &[("attempt", "t.attempts")])
}

/// The dead letters a redrive makes pending: those `{filter}` selects, of no aggregate or of
/// one `lock_redriven` locked ($6). A row that died after that lock's snapshot, of an
/// aggregate it did not lock, waits for the next redrive: a producer of its aggregate may
/// be deciding its head meanwhile.
const REDRIVEN: &str =
    "{filter} AND (t.aggregate_key IS NULL OR t.aggregate_key = ANY ($6::text[]))";

/// Before a redrive: for each redriven aggregate, the first message still pending or parked after
/// its first redriven letter, touched. Every claim's run that would cross the letter holds that
/// message: the touch waits for a claim that holds it, and a claim whose snapshot predates the
/// touch passes it over (it locks the version it read, see the claim in `relay::sql`) and so ends
/// its run before it. So once the redrive commits, no claim takes a message ahead of the letters it
/// makes pending. (A marked head after the letter is that message, and is the head no longer.)
/// Returns the aggregates, the first redriven id of each, when the lease of the message touched
/// ends if it is in flight (its run's: they were claimed together), and whether every aggregate's
/// message was touched: one that got its outcome while the touch waited for it was not, and the
/// hold runs again, in a new snapshot, to touch the message after it.
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

/// How many rows one purge statement deletes, so no statement holds locks for long.
pub(crate) const PURGE_BATCH: i64 = 1000;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::statements::tests::renders_for_every_table;

    #[test]
    fn every_template_renders_for_every_table() {
        renders_for_every_table::<LettersSql>();
    }
}
