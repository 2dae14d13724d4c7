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
pub(crate) const MIGRATIONS: &[Migration] = &[Migration {
    version: 1,
    name: "0001_create_outbox",
    template: include_str!("../sql/0001_create_outbox.sql"),
}];

/// The columns a claim returns, in the order `Record::from_row` reads them.
const RECORD_COLUMNS: &str = "t.id, t.key, t.topic, t.aggregate_key, t.payload, t.content_type, \
     t.headers, t.attempts, t.max_attempts, t.created_at, t.lease_until";

/// How many rows one purge statement deletes, so no statement holds locks for long.
pub(crate) const PURGE_BATCH: i64 = 1000;

/// The statements for one outbox table.
#[derive(Debug)]
pub(crate) struct Statements {
    pub(crate) enqueue: String,
    pub(crate) enqueue_quiet: String,
    pub(crate) enqueue_all: String,
    pub(crate) enqueue_all_quiet: String,
    pub(crate) find_keys: String,
    pub(crate) delete_keys: String,
    pub(crate) dedupe: String,
    pub(crate) stats: String,
    pub(crate) dead_letters: String,
    pub(crate) redrive_all: String,
    pub(crate) redrive_keys: String,
    pub(crate) purge_sent: String,
    pub(crate) purge_dead: String,
    pub(crate) claim: String,
    pub(crate) record_outcomes: String,
    pub(crate) migrations_table: String,
    pub(crate) applied_versions: String,
    pub(crate) record_migration: String,
    pub(crate) listen: String,
    pub(crate) probe: String,
}

impl Statements {
    pub(crate) fn new(table: &TableName) -> Statements {
        let t = table.quoted();
        let inbox = table.companion("_inbox");
        let counts = table.companion("_counts");
        let migrations = table.companion("_migrations");
        let channel = table.channel();
        let notify = format!(
            ", n AS (SELECT count(pg_notify('{channel}', '')) FROM (SELECT 1 FROM ins LIMIT 1) one)"
        );
        let from_notify = ", n";
        // One bounded batch of finished rows older than $1 microseconds, oldest first.
        let purge_batch = |status: &str| {
            format!(
                "DELETE FROM {t} WHERE id IN (
                   SELECT id FROM {t}
                   WHERE status = '{status}'
                     AND done_at < now() - $1::bigint * interval '1 microsecond'
                   ORDER BY status, done_at LIMIT {PURGE_BATCH}
                   FOR UPDATE SKIP LOCKED)
                 RETURNING 1"
            )
        };

        // $1 key, $2 topic, $3 aggregate key, $4 payload, $5 content type, $6 headers,
        // $7 absolute available_at (or NULL), $8 delay in microseconds, $9 max attempts.
        let insert_one = format!(
            "WITH ins AS (
               INSERT INTO {t} (key, topic, aggregate_key, payload, content_type, headers,
                                available_at, max_attempts)
               VALUES ($1, $2, $3, $4, $5, $6,
                       COALESCE($7, now() + $8 * interval '1 microsecond'), $9)
               ON CONFLICT (key) DO NOTHING
               RETURNING key)"
        );
        // The same, for arrays: headers travel flattened in $6 and are sliced out by each
        // message's offset ($10) and length ($11), since PostgreSQL has no ragged arrays.
        let insert_all = format!(
            "WITH input AS (
               SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::bytea[], $5::text[],
                                    $7::timestamptz[], $8::bigint[], $9::int[], $10::int[],
                                    $11::int[])
                 WITH ORDINALITY
                 AS i(key, topic, aggregate_key, payload, content_type, available_at, delay_us,
                      max_attempts, header_offset, header_len, ord)
             ),
             ins AS (
               INSERT INTO {t} (key, topic, aggregate_key, payload, content_type, headers,
                                available_at, max_attempts)
               SELECT key, topic, aggregate_key, payload, content_type,
                      ($6::text[])[header_offset + 1 : header_offset + header_len],
                      COALESCE(available_at, now() + delay_us * interval '1 microsecond'),
                      max_attempts
               FROM input
               WHERE NOT EXISTS (SELECT 1 FROM {t} o JOIN input d ON o.key = d.key)
               ORDER BY ord
               ON CONFLICT (key) DO NOTHING
               RETURNING key)"
        );

        Statements {
            enqueue: format!("{insert_one}{notify} SELECT key FROM ins{from_notify}"),
            enqueue_quiet: format!("{insert_one} SELECT key FROM ins"),
            enqueue_all: format!("{insert_all}{notify} SELECT key FROM ins{from_notify}"),
            enqueue_all_quiet: format!("{insert_all} SELECT key FROM ins"),
            find_keys: format!("SELECT key FROM {t} WHERE key = ANY($1) ORDER BY key"),
            delete_keys: format!("DELETE FROM {t} WHERE key = ANY($1)"),
            dedupe: format!(
                "INSERT INTO {inbox} (consumer, key) VALUES ($1, $2)
                 ON CONFLICT DO NOTHING"
            ),
            stats: format!(
                "SELECT
                   count(*) FILTER (WHERE lease_until IS NULL OR lease_until <= now()),
                   count(*) FILTER (WHERE lease_until > now()),
                   count(*) FILTER (WHERE available_at <= now()),
                   (SELECT coalesce(sum(sent), 0)::bigint FROM {counts}),
                   (SELECT count(*) FROM {t} WHERE status = 'dead'),
                   extract(epoch FROM now() - min(created_at))::float8
                 FROM {t} WHERE status = 'pending'"
            ),
            dead_letters: format!(
                "SELECT {RECORD_COLUMNS}, t.last_error, t.done_at
                 FROM {t} t WHERE t.status = 'dead'
                 ORDER BY t.status, t.done_at, t.id LIMIT $1"
            ),
            redrive_all: format!(
                "UPDATE {t} SET status = 'pending', attempts = 0, available_at = now(),
                                lease_until = NULL, done_at = NULL
                 WHERE status = 'dead'"
            ),
            redrive_keys: format!(
                "UPDATE {t} SET status = 'pending', attempts = 0, available_at = now(),
                                lease_until = NULL, done_at = NULL
                 WHERE status = 'dead' AND key = ANY($1)"
            ),
            purge_sent: format!(
                "WITH gone AS ({}),
                 c AS (SELECT count(*) AS n FROM gone),
                 bump AS (UPDATE {counts} SET sent = sent - c.n FROM c
                          WHERE slot = $2 AND c.n > 0)
                 SELECT n FROM c",
                purge_batch("sent")
            ),
            purge_dead: format!(
                "WITH gone AS ({}) SELECT count(*) FROM gone",
                purge_batch("dead")
            ),
            // Due, not leased (a lease pushes available_at forward), and the oldest pending row
            // of its aggregate. The lease is stamped into available_at so an abandoned claim
            // becomes due again by itself.
            claim: format!(
                "WITH due AS (
                   SELECT o.id FROM {t} o
                   WHERE o.status = 'pending' AND o.available_at <= now()
                     AND (o.aggregate_key IS NULL OR NOT EXISTS (
                           SELECT 1 FROM {t} h
                           WHERE h.status = 'pending' AND h.aggregate_key = o.aggregate_key
                             AND h.id < o.id))
                   ORDER BY o.available_at, o.id
                   LIMIT $1
                   FOR UPDATE SKIP LOCKED)
                 UPDATE {t} t
                 SET attempts = t.attempts + 1,
                     available_at = now() + $2::bigint * interval '1 microsecond',
                     lease_until = now() + $2::bigint * interval '1 microsecond'
                 FROM due WHERE t.id = due.id
                 RETURNING {RECORD_COLUMNS}"
            ),
            // Every outcome of a batch in one statement, each row fenced on id + the attempt it
            // was claimed at + still pending + the lease its claim stamped, so a relay whose
            // lease was lost changes nothing. The lease stamp matters when a row was reclaimed
            // and then released: release restores the attempt count, the stamp is gone.
            // $1 ids, $2 claimed attempts, $3 outcome ('sent' | 'retry' | 'dead' | 'release'),
            // $4 retry delay in microseconds, $5 error text, $6 counter slot, $7 lease stamps.
            record_outcomes: format!(
                "WITH o AS (
                   SELECT * FROM unnest($1::bigint[], $2::int[], $3::text[], $4::bigint[],
                                        $5::text[], $7::timestamptz[])
                     AS o(id, attempts, outcome, delay_us, error, lease)),
                 upd AS (
                   UPDATE {t} t SET
                     status = CASE o.outcome WHEN 'sent' THEN 'sent'
                                             WHEN 'dead' THEN 'dead'
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
            listen: format!("LISTEN {}", crate::table::quote(&channel)),
            probe: format!("SELECT 1 FROM {t} LIMIT 0"),
        }
    }
}

impl Migration {
    /// The migration's DDL for one table.
    pub(crate) fn render(&self, table: &TableName) -> String {
        self.template
            .replace("{table}", &table.quoted())
            .replace("{inbox}", &table.companion("_inbox"))
            .replace("{counts}", &table.companion("_counts"))
            .replace("{key_constraint}", &table.derived("_key"))
            .replace("{due_idx}", &table.derived("_due"))
            .replace("{agg_idx}", &table.derived("_agg"))
            .replace("{done_idx}", &table.derived("_done"))
    }
}
