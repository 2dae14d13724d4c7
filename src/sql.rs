//! Every SQL statement the crate runs, rendered once per table.
//!
//! Table names are validated identifiers and always quoted (see `table.rs`), so splicing them
//! into statement text cannot inject SQL; every value travels as a bind parameter.

use crate::table::TableName;

/// A migration file, embedded in the binary.
pub(crate) struct Migration {
    pub(crate) version: i32,
    pub(crate) name: &'static str,
    template: &'static str,
}

/// The versioned schema files in `sql/`, oldest first. Never edit one that has shipped: add a
/// new file instead.
pub(crate) const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        name: "0001_create_outbox",
        template: include_str!("../sql/0001_create_outbox.sql"),
    },
    Migration {
        version: 2,
        name: "0002_claim_heads",
        template: include_str!("../sql/0002_claim_heads.sql"),
    },
    Migration {
        version: 3,
        name: "0003_consumer_failures",
        template: include_str!("../sql/0003_consumer_failures.sql"),
    },
    Migration {
        version: 4,
        name: "0004_enqueue_functions",
        template: include_str!("../sql/0004_enqueue_functions.sql"),
    },
    Migration {
        version: 5,
        name: "0005_aggregate_locks_and_parking",
        template: include_str!("../sql/0005_aggregate_locks_and_parking.sql"),
    },
    Migration {
        version: 6,
        name: "0006_dead_decisions_and_channel",
        template: include_str!("../sql/0006_dead_decisions_and_channel.sql"),
    },
];

/// The columns a claim returns, in the order `Record::from_row` reads them.
pub(crate) const RECORD_COLUMNS: &str =
    "t.id, t.key, t.topic, t.aggregate_key, t.payload, t.content_type, \
     t.headers, t.attempts, t.max_attempts, t.created_at, t.lease_until, t.park";

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

/// How many rows one purge statement deletes, so no statement holds locks for long.
pub(crate) const PURGE_BATCH: i64 = 1000;

/// The statements for one outbox table.
#[derive(Debug)]
pub(crate) struct Statements {
    /// Calls the enqueue function of migration 0005: $1..$10 the message, $11 notify.
    pub(crate) enqueue: String,
    /// Calls the batch enqueue function of migration 0005: $1..$12 the columns, $13 notify.
    pub(crate) enqueue_all: String,
    /// Locks the aggregates of a batch ($1) before it is copied in.
    pub(crate) lock_aggregates: String,
    /// A large batch due at once: binary COPY of the columns that have no default.
    pub(crate) copy_in: String,
    pub(crate) existing_keys: String,
    pub(crate) notify_if_waiting: String,
    pub(crate) dedupe: String,
    pub(crate) stats: String,
    /// Rows matching a filter ($1..$5, see `FILTER`), oldest first, at most $6.
    pub(crate) dead_where: String,
    /// Dead letters matching a filter, grouped by error text.
    pub(crate) dead_errors: String,
    /// Rows matching a filter.
    pub(crate) count_where: String,
    pub(crate) redrive_where: String,
    /// Parked dead letters matching a filter stop holding their aggregates.
    pub(crate) skip_where: String,
    pub(crate) purge_where: String,
    pub(crate) topic_stats: String,
    pub(crate) purge_inbox_keys: String,
    pub(crate) count_inbox_keys: String,
    pub(crate) count_inbox_older: String,
    pub(crate) purge_inbox: String,
    pub(crate) purge_failures: String,
    /// Counts one more handler failure of a consumer on a message; returns the new count
    /// and whether the message is now given up on.
    #[cfg(feature = "rabbitmq")]
    pub(crate) count_failure: String,
    /// A consumer's failure count and last error of a message it gave up on, if it did.
    #[cfg(feature = "rabbitmq")]
    pub(crate) failure_state: String,
    #[cfg(feature = "rabbitmq")]
    pub(crate) forget_failures: String,
    /// Fails when the consumer's tables are missing.
    #[cfg(feature = "rabbitmq")]
    pub(crate) probe_consumer: String,
    /// The claim, its aggregate scan starting at the first aggregate key.
    pub(crate) claim: String,
    /// The claim, its aggregate scan starting after the key in `$4`.
    pub(crate) claim_after: String,
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
    pub(crate) probe: String,
}

impl Statements {
    pub(crate) fn new(table: &TableName) -> Statements {
        let t = table.quoted();
        let inbox = table.companion("_inbox");
        let failures = table.companion("_failures");
        let waiting = table.companion("_waiting");
        let counts = table.companion("_counts");
        let migrations = table.companion("_migrations");
        let enqueue_fn = table.companion("_enqueue");
        let enqueue_n_fn = table.companion("_enqueue_n");
        Statements {
            copy_in: format!(
                "COPY {t} (key, topic, aggregate_key, payload, content_type, headers, \
                 max_attempts, park) FROM STDIN (FORMAT binary)"
            ),
            lock_aggregates: format!("SELECT {}($1)", table.companion("_lock_n")),
            existing_keys: format!("SELECT key FROM {t} WHERE key = ANY($1) ORDER BY key"),
            notify_if_waiting: format!("SELECT {}()", table.companion("_notify")),
            enqueue: format!(
                "SELECT {enqueue_fn}($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)"
            ),
            enqueue_all: format!(
                "SELECT {enqueue_n_fn}($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)"
            ),
            dedupe: format!(
                "INSERT INTO {inbox} (consumer, key) VALUES ($1, $2)
                 ON CONFLICT DO NOTHING"
            ),
            // Each half reads its own partial index. The ordered half walks the aggregate
            // index in its order, so telling heads (oldest pending or parked row of their
            // aggregate) from the rows behind them needs no sort: every waiting row but a
            // head is blocked, so behind a parked head all are.
            stats: format!(
                "WITH u AS (
                   SELECT count(*) FILTER (WHERE lease_until IS NULL OR lease_until <= now()) AS waiting,
                          count(*) FILTER (WHERE lease_until > now()) AS in_flight,
                          count(*) FILTER (WHERE available_at <= now()) AS due,
                          min(created_at) AS oldest
                   FROM {t} WHERE status = 'pending' AND aggregate_key IS NULL),
                 r AS (
                   SELECT status, available_at, created_at,
                          status = 'pending' AND (lease_until IS NULL OR lease_until <= now()) AS waiting,
                          status = 'pending' AND lease_until > now() AS leased,
                          aggregate_key IS DISTINCT FROM lag(aggregate_key) OVER w AS head,
                          first_value(created_at) OVER w AS head_created
                   FROM {t} WHERE status IN ('pending', 'parked') AND aggregate_key IS NOT NULL
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
                        (SELECT count(*) FROM {t} WHERE status IN ('dead', 'parked')),
                        extract(epoch FROM now() - least(u.oldest, o.oldest))::float8,
                        o.blocked,
                        extract(epoch FROM now() - o.blocked_head)::float8,
                        o.parked
                 FROM u, o"
            ),
            dead_where: format!(
                "SELECT {RECORD_COLUMNS}, t.last_error, t.done_at
                 FROM {t} t WHERE {FILTER}
                 ORDER BY t.done_at, t.id LIMIT $6"
            ),
            dead_errors: format!(
                "SELECT t.last_error, count(*), min(t.done_at), max(t.done_at), min(t.key)
                 FROM {t} t WHERE {FILTER}
                 GROUP BY t.last_error ORDER BY count(*) DESC, t.last_error"
            ),
            count_where: format!("SELECT count(*) FROM {t} t WHERE {FILTER}"),
            // A redriven row keeps its id, so it is again the head of its aggregate (a parked
            // one goes first, then the rows it held back, in order).
            redrive_where: format!(
                "UPDATE {t} t SET status = 'pending', attempts = 0, available_at = now(),
                                  lease_until = NULL, done_at = NULL
                 WHERE {FILTER}"
            ),
            skip_where: format!("UPDATE {t} t SET status = 'dead' WHERE {FILTER}"),
            // One bounded batch of finished rows in the states $5, oldest first; the sent
            // counter (slot $6) goes down by the sent rows deleted.
            purge_where: format!(
                "WITH gone AS (
                   DELETE FROM {t} WHERE id IN (
                     SELECT t.id FROM {t} t WHERE {FILTER}
                     ORDER BY t.status, t.done_at LIMIT {PURGE_BATCH}
                     FOR UPDATE SKIP LOCKED)
                   RETURNING status),
                 c AS (SELECT count(*) FILTER (WHERE status = 'sent') AS gone_sent,
                              count(*) AS n
                       FROM gone),
                 bump AS (UPDATE {counts} SET sent = sent - c.gone_sent FROM c
                          WHERE slot = $6 AND c.gone_sent > 0)
                 SELECT n FROM c"
            ),
            // Pending rows through their two partial indexes, dead ones through the done
            // index: sent rows, however many, are never read.
            topic_stats: format!(
                "SELECT topic, sum(pending)::bigint, sum(dead)::bigint FROM (
                   SELECT topic, count(*) AS pending, 0 AS dead FROM {t}
                   WHERE status = 'pending' AND aggregate_key IS NULL GROUP BY topic
                   UNION ALL
                   SELECT topic, count(*), 0 FROM {t}
                   WHERE status = 'pending' AND aggregate_key IS NOT NULL GROUP BY topic
                   UNION ALL
                   SELECT topic, 0, count(*) FROM {t} WHERE status IN ('dead', 'parked')
                   GROUP BY topic
                 ) per GROUP BY topic ORDER BY topic"
            ),
            // Dedupe records by message key ($1), older than $2 microseconds if given.
            purge_inbox_keys: format!(
                "DELETE FROM {inbox} WHERE key = ANY($1)
                   AND ($2::bigint IS NULL OR processed_at < now() - $2 * interval '1 microsecond')"
            ),
            count_inbox_keys: format!(
                "SELECT count(*) FROM {inbox} WHERE key = ANY($1)
                   AND ($2::bigint IS NULL OR processed_at < now() - $2 * interval '1 microsecond')"
            ),
            // What `purge_inbox` would delete: dedupe records and stray failure counts.
            count_inbox_older: format!(
                "SELECT (SELECT count(*) FROM {inbox}
                         WHERE processed_at < now() - $1::bigint * interval '1 microsecond')
                      + (SELECT count(*) FROM {failures}
                         WHERE updated_at < now() - $1::bigint * interval '1 microsecond')"
            ),
            // The inbox has no index on processed_at (every dedupe would pay for one), so
            // purging walks the primary key once, a bounded batch per statement from the
            // cursor ($2, $3), deleting the old rows of each batch by their tuple ids.
            // $1 age in microseconds; returns rows deleted, rows read and the new cursor.
            purge_inbox: format!(
                "WITH batch AS (
                   SELECT ctid, consumer, key, processed_at FROM {inbox}
                   WHERE (consumer, key) > ($2, $3)
                   ORDER BY consumer, key LIMIT {PURGE_BATCH}),
                 gone AS (
                   DELETE FROM {inbox} WHERE ctid = ANY (ARRAY(
                     SELECT ctid FROM batch
                     WHERE processed_at < now() - $1::bigint * interval '1 microsecond'))
                   RETURNING 1),
                 last AS (SELECT consumer, key FROM batch ORDER BY consumer DESC, key DESC LIMIT 1)
                 SELECT (SELECT count(*) FROM gone), (SELECT count(*) FROM batch),
                        (SELECT consumer FROM last), (SELECT key FROM last)"
            ),
            // Failure counts are deleted as their messages finish, so only strays of a crash
            // grow old here; the table is small and a scan of it is cheap.
            purge_failures: format!(
                "WITH gone AS (
                   DELETE FROM {failures} WHERE ctid = ANY (ARRAY(
                     SELECT ctid FROM {failures}
                     WHERE updated_at < now() - $1::bigint * interval '1 microsecond'
                     LIMIT {PURGE_BATCH}))
                   RETURNING 1)
                 SELECT count(*) FROM gone"
            ),
            // $1 consumer, $2 key, $3 the error, already made storable, $4 whether it is
            // permanent, $5 the failures after which the consumer gives up.
            #[cfg(feature = "rabbitmq")]
            count_failure: format!(
                "INSERT INTO {failures} AS f (consumer, key, failures, last_error, dead)
                 VALUES ($1, $2, 1, $3, $4 OR 1 >= $5)
                 ON CONFLICT (consumer, key) DO UPDATE
                   SET failures = f.failures + 1, last_error = EXCLUDED.last_error,
                       updated_at = now(), dead = f.dead OR $4 OR f.failures + 1 >= $5
                 RETURNING failures, dead"
            ),
            #[cfg(feature = "rabbitmq")]
            failure_state: format!(
                "SELECT failures, last_error FROM {failures}
                 WHERE consumer = $1 AND key = $2 AND dead"
            ),
            #[cfg(feature = "rabbitmq")]
            forget_failures: format!("DELETE FROM {failures} WHERE consumer = $1 AND key = $2"),
            #[cfg(feature = "rabbitmq")]
            probe_consumer: format!(
                "SELECT 1 FROM {inbox} LIMIT 0; SELECT 1 FROM {failures} LIMIT 0"
            ),
            claim: claim(&t, ""),
            claim_after: claim(&t, "AND aggregate_key > $4"),
            // Every outcome of a batch in one statement, each row fenced on id + the attempt it
            // was claimed at + still pending + the lease its claim stamped, so a relay whose
            // lease was lost changes nothing. The lease stamp matters when a row was reclaimed
            // and then released: release restores the attempt count, the stamp is gone.
            // $1 ids, $2 claimed attempts, $3 outcome ('sent' | 'retry' | 'dead' | 'release'),
            // $4 retry delay in microseconds, $5 error text, $6 counter slot, $7 lease stamps,
            // $8 whether a dead row parks its aggregate, unless the row says.
            record_outcomes: format!(
                "WITH o AS (
                   SELECT * FROM unnest($1::bigint[], $2::int[], $3::text[], $4::bigint[],
                                        $5::text[], $7::timestamptz[])
                     AS o(id, attempts, outcome, delay_us, error, lease)),
                 upd AS (
                   UPDATE {t} t SET
                     status = CASE o.outcome WHEN 'sent' THEN 'sent'
                                             WHEN 'dead' THEN CASE WHEN {PARKS} THEN 'parked'
                                                                   ELSE 'dead' END
                                             ELSE 'pending' END,
                     attempts = CASE o.outcome WHEN 'release' THEN t.attempts - 1
                                               ELSE t.attempts END,
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
                   RETURNING t.status),
                 c AS (SELECT count(*) AS n, count(*) FILTER (WHERE status = 'sent') AS sent
                       FROM upd),
                 bump AS (UPDATE {counts} SET sent = {counts}.sent + c.sent FROM c
                          WHERE slot = $6 AND c.sent > 0)
                 SELECT n, sent FROM c"
            ),
            migrations_table: format!(
                "CREATE TABLE IF NOT EXISTS {migrations} (
                   version    integer     PRIMARY KEY,
                   name       text        NOT NULL,
                   applied_at timestamptz NOT NULL DEFAULT now())"
            ),
            applied_versions: format!("SELECT version FROM {migrations}"),
            record_migration: format!(
                "INSERT INTO {migrations} (version, name) VALUES ($1, $2) ON CONFLICT DO NOTHING"
            ),
            channel: format!("SELECT {}()", table.companion("_channel")),
            schema_of: "SELECT coalesce(
                 (SELECT n.nspname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                  WHERE c.oid = to_regclass($1)),
                 current_schema())::text"
                .to_owned(),
            register_waiting: format!(
                "WITH expired AS (DELETE FROM {waiting} WHERE seen < now() - interval '1 hour')
                 INSERT INTO {waiting} (relay) VALUES ($1)
                 ON CONFLICT (relay) DO UPDATE SET seen = now()"
            ),
            unregister_waiting: format!("DELETE FROM {waiting} WHERE relay = $1"),
            probe: format!("SELECT 1 FROM {t} LIMIT 0"),
        }
    }
}

/// The claim: one statement that leases up to `$1` rows and `$3` payload bytes.
///
/// Rows without an aggregate key come from the unordered due index, oldest due first, under
/// `FOR UPDATE SKIP LOCKED`. Rows with one come in runs: a skip scan of the aggregate index
/// visits one head (oldest pending or parked row) per aggregate, starting after the caller's
/// cursor, until it has seen `2 x $1` due heads or `$5` heads in all; behind each due head it
/// reads the consecutive due rows. A lease pushes `available_at` forward, so a leased head is
/// not due and its aggregate is passed over; a parked head is never due. So the cost is what the claim returns plus the
/// heads it passes, never the rows waiting behind a head.
///
/// With a batch's worth of aggregates or more, each due one gives one row (runs of one: the
/// most aggregates, each in the first confirm round). With fewer, they are shared among the
/// `$6` workers: runs are as long as fills the batch from a worker's share of all the
/// aggregates seen (due or in flight), so each claim takes about that share. Ordered and
/// unordered rows split the batch so that neither starves the other.
///
/// Workers scanning the same aggregates see the same heads, so twice the batch is read as
/// candidates and locked in order with `SKIP LOCKED` until the batch is full: a head another
/// claim holds costs a skipped row, not an empty claim.
///
/// The run is read from the statement's snapshot, so a concurrent claim may have taken (and
/// a concurrent outcome finished) part of it meanwhile. Every run row is therefore locked and
/// rechecked, and an aggregate keeps only the unbroken prefix of its run that starts at its
/// head: a run missing its head, or any row before another, is cut there. That keeps the
/// order strict whatever runs alongside.
///
/// A row claimed more often than its attempt limit (`$7` unless the row sets one) allows has
/// crashed or lost its lease that often: it becomes dead (or parked, see `PARKS`, with the
/// caller's setting in `$8`) here instead of being published again. Every row (and the one
/// row of an empty claim) carries where the next claim's scan should start: after the last
/// aggregate this claim took, else after the last one it visited, or at the first (NULL)
/// once the scan has passed the last aggregate.
fn claim(t: &str, after: &str) -> String {
    let over = "t.attempts + 1 > coalesce(t.max_attempts, $7)";
    // A parked head is never due: its aggregate waits for an operator.
    let due = "status = 'pending' AND available_at <= now()";
    let o_due = "o.status = 'pending' AND o.available_at <= now()";
    // What a row weighs against the byte budget: its payload and its headers.
    let bytes = "octet_length(o.payload) + pg_column_size(o.headers)";
    format!(
        "WITH RECURSIVE heads(aggregate_key, id, due, n, d) AS (
           (SELECT aggregate_key, id, {due}, 1, ({due})::int
            FROM {t}
            WHERE status IN ('pending', 'parked') AND aggregate_key IS NOT NULL {after}
            ORDER BY aggregate_key, id LIMIT 1)
           UNION ALL
           SELECT nx.aggregate_key, nx.id, nx.due, h.n + 1, h.d + nx.due::int
           FROM heads h CROSS JOIN LATERAL (
             SELECT o.aggregate_key, o.id, {o_due} AS due FROM {t} o
             WHERE o.status IN ('pending', 'parked') AND o.aggregate_key IS NOT NULL
               AND o.aggregate_key > h.aggregate_key
             ORDER BY o.aggregate_key, o.id LIMIT 1) nx
           WHERE h.n < $5 AND h.d < 2 * $1),
         due_heads AS (SELECT aggregate_key, id, n FROM heads WHERE due),
         -- Sized by every aggregate seen, due or in flight, so that a claim finding only a
         -- few free heads while other workers hold the rest takes short runs of them, not
         -- one long run: every confirm round stays wide.
         run_len AS (
           SELECT CASE WHEN count(*) >= $1 THEN 1
                       ELSE greatest(1, ceil($1::numeric
                              / greatest(1, ceil(count(*)::numeric / $6))))
                  END::bigint AS r
           FROM heads),
         ocand AS (
           -- Runs of one are the due heads themselves: no need to read behind them.
           (SELECT h.id, h.aggregate_key, h.n AS hpos, 1::bigint AS rn FROM due_heads h
            WHERE (SELECT r FROM run_len) = 1
            ORDER BY h.n LIMIT 2 * $1)
           UNION ALL
           (SELECT r.id, h.aggregate_key, h.n AS hpos, r.rn
            FROM due_heads h CROSS JOIN LATERAL (
              SELECT s.id, s.rn FROM (
                SELECT o.id, row_number() OVER w AS rn,
                       bool_and(o.available_at <= now()) OVER w AS due
                FROM (SELECT o.id, o.available_at FROM {t} o
                      WHERE o.status = 'pending' AND o.aggregate_key = h.aggregate_key
                        AND o.id >= h.id
                      ORDER BY o.id LIMIT (SELECT r FROM run_len)) o
                WINDOW w AS (ORDER BY o.id)) s
              WHERE s.due) r
            WHERE (SELECT r FROM run_len) > 1
            ORDER BY h.n, r.rn
            LIMIT 2 * $1)),
         -- Ordered rows get at least half the batch when they have candidates; a batch of
         -- one goes to either kind at random, so neither can starve the other.
         ulock AS (
           SELECT o.id, o.available_at, {bytes} AS bytes FROM {t} o
           WHERE o.status = 'pending' AND o.aggregate_key IS NULL AND o.available_at <= now()
           ORDER BY o.available_at, o.id
           LIMIT $1 - least((SELECT count(*) FROM ocand),
                            CASE WHEN $1 > 1 THEN $1 / 2 ELSE (random() < 0.5)::int END)
           FOR UPDATE SKIP LOCKED),
         olock AS (
           SELECT o.id, c.aggregate_key, c.hpos, c.rn, {bytes} AS bytes
           FROM ocand c JOIN {t} o ON o.id = c.id
           WHERE o.status = 'pending' AND o.available_at <= now()
           ORDER BY c.hpos, c.rn
           LIMIT $1 - (SELECT count(*) FROM ulock)
           FOR UPDATE OF o SKIP LOCKED),
         ovalid AS (
           SELECT id, aggregate_key, hpos, rn, bytes,
                  row_number() OVER (PARTITION BY aggregate_key ORDER BY rn) AS pos
           FROM olock),
         picked AS (
           SELECT id, aggregate_key, bytes, row_number() OVER (ORDER BY hpos, rn) AS rank,
                  0 AS src
           FROM ovalid WHERE pos = rn
           UNION ALL
           SELECT id, NULL, bytes, row_number() OVER (ORDER BY available_at, id), 1
           FROM ulock),
         take AS (
           SELECT id, aggregate_key, rank FROM (
             SELECT id, aggregate_key, rank, row_number() OVER k AS k,
                    sum(coalesce(bytes, 0)) OVER k AS total
             FROM picked WINDOW k AS (ORDER BY rank, src, id)) p
           WHERE k = 1 OR total <= $3),
         upd AS (
           UPDATE {t} t SET
             attempts = t.attempts + 1,
             status = CASE WHEN NOT {over} THEN 'pending'
                           WHEN {PARKS} THEN 'parked' ELSE 'dead' END,
             available_at = CASE WHEN {over} THEN t.available_at
                                 ELSE now() + $2::bigint * interval '1 microsecond' END,
             lease_until = CASE WHEN {over} THEN NULL
                                ELSE now() + $2::bigint * interval '1 microsecond' END,
             done_at = CASE WHEN {over} THEN now() END,
             last_error = CASE WHEN {over}
                            THEN 'claimed ' || t.attempts + 1 || ' times, more than its '
                                 || coalesce(t.max_attempts, $7) || ' attempts allow, without '
                                 || 'an outcome being recorded (a relay crashed or lost its '
                                 || 'lease each time)'
                            ELSE t.last_error END
           -- An id list, not a join: a join may be planned as a merge along the primary key
           -- from its first id, through every sent row.
           WHERE t.id = ANY (ARRAY(SELECT id FROM take))
           RETURNING {RECORD_COLUMNS}, t.status),
         scan AS (
           SELECT coalesce(
             (SELECT aggregate_key FROM take WHERE aggregate_key IS NOT NULL
              ORDER BY rank DESC LIMIT 1),
             CASE WHEN (SELECT count(*) FROM heads) >= $5
                       OR (SELECT count(*) FROM due_heads) >= 2 * $1
                  THEN (SELECT aggregate_key FROM heads ORDER BY n DESC LIMIT 1) END)
             AS next_cursor)
         SELECT upd.*, scan.next_cursor FROM scan LEFT JOIN upd ON true"
    )
}

/// A bigint constant in SQL text.
fn bigint(value: i64) -> String {
    format!("({value})::bigint")
}

impl Migration {
    /// The migration's DDL for one table.
    pub(crate) fn render(&self, table: &TableName) -> String {
        self.template
            .replace("{table}", &table.quoted())
            .replace("{inbox}", &table.companion("_inbox"))
            .replace("{failures}", &table.companion("_failures"))
            .replace("{waiting}", &table.companion("_waiting"))
            .replace("{notify_fn}", &table.companion("_notify"))
            .replace("{enqueue_fn}", &table.companion("_enqueue"))
            .replace("{enqueue_n_fn}", &table.companion("_enqueue_n"))
            .replace("{lock_n_fn}", &table.companion("_lock_n"))
            .replace("{channel_fn}", &table.companion("_channel"))
            .replace("{table_lock_text}", &table.ordered_lock_key().to_string())
            .replace("{table_lock}", &bigint(table.ordered_lock_key()))
            .replace("{lock_seed}", &bigint(table.aggregate_lock_seed()))
            .replace("{status_constraint}", &table.derived("_status"))
            .replace("{channel}", &table.channel())
            .replace("{counts}", &table.companion("_counts"))
            .replace("{key_constraint}", &table.derived("_key"))
            .replace("{due_idx_qualified}", &table.companion("_due"))
            .replace("{due_idx}", &table.derived("_due"))
            .replace("{unordered_idx}", &table.derived("_unordered"))
            .replace("{agg_idx_qualified}", &table.companion("_agg"))
            .replace("{agg_idx}", &table.derived("_agg"))
            .replace("{done_idx}", &table.derived("_done"))
    }
}
