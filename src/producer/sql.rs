//! The producer's statements, rendered once per table, and those a `Producer` prepares.

use crate::schema::render::{RenderError, Values};
use crate::schema::statements::{borrowed, lock_one, notify_if_waiting, shared, Statements};
use crate::schema::table::TableName;

/// The producer's statements: enqueues, the batch path, and deduplication.
#[derive(Debug)]
pub(crate) struct ProducerSql {
    /// Calls the enqueue function (`sql/functions/enqueue.sql`): $1..$10 the message, $11 notify,
    /// $12 whether the key is the crate's own.
    pub(crate) enqueue: String,
    /// `enqueue` on an outbox that gives places (`OutboxBuilder::sequence`): the call, then
    /// the place of its row if it went in with an aggregate (`sql/functions/sequence.sql`),
    /// in the same round trip. Returns whether the row went in, as `enqueue`.
    pub(crate) enqueue_placed: String,
    /// `Outbox::enqueue` of a message with an aggregate and the crate's key on an outbox
    /// that gives places: `ordered_placed` in a function (`sql/functions/sequence.sql`),
    /// as text is parsed and planned on every call; $1..$10 the message, $11 notify.
    pub(crate) enqueue_one_placed: String,
    /// A `Producer`'s transaction past `PRODUCER_LOCKS` aggregates of its own: the
    /// aggregates it locked ($1) recorded as the enqueue functions record theirs, which
    /// makes them lock the table's ordered enqueues (`sql/functions/locks.sql`); its later
    /// messages with an aggregate go through the function.
    pub(crate) lock_many: String,
    /// Calls the batch enqueue function (`sql/functions/enqueue.sql`): $1..$12 the columns, $13
    /// notify, $14 whether every key is the crate's own.
    pub(crate) enqueue_all: String,
    /// `enqueue_all` on an outbox that gives places: the call, then, when every row went in,
    /// their places. Returns what `enqueue_all` returns.
    pub(crate) enqueue_all_placed: String,
    /// Before a batch is copied in: locks its aggregates ($1), notifies if $2 and a relay
    /// waits, and returns the aggregates that cannot take a new head (`sql/functions/enqueue.sql`).
    pub(crate) lock_heads: String,
    /// A large batch due at once: binary COPY of the columns that have no default, and
    /// whether each row is its aggregate's head.
    pub(crate) copy_in: String,
    pub(crate) existing_keys: String,
    pub(crate) notify: String,
    pub(crate) dedupe: String,
}

impl Statements for ProducerSql {
    fn render(table: &TableName) -> Result<Self, RenderError> {
        let vars = shared(
            table,
            &[
                "table",
                "inbox",
                "enqueue_fn",
                "enqueue_n_fn",
                "lock_heads_fn",
                "notify_fn",
                "lock_n_fn",
                "place_fn",
                "placed_fn",
            ],
        )?;
        let mut values = Values::new(&borrowed(&vars))?;
        let statements = ProducerSql {
            copy_in: values.render(
                "COPY {table} (key, topic, aggregate_key, payload, content_type, headers, \
                 max_attempts, park, head) FROM STDIN (FORMAT binary)",
            )?,
            lock_heads: values.render("SELECT {lock_heads_fn}($1, $2)")?,
            existing_keys: values
                .render("SELECT key FROM {table} WHERE key = ANY($1) ORDER BY key")?,
            notify: values.render("SELECT {notify_fn}()")?,
            enqueue: values
                .render("SELECT {enqueue_fn}($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)")?,
            lock_many: values.render("SELECT {lock_n_fn}($1)")?,
            // The call in a subquery of its own (OFFSET 0 keeps it from being merged), so
            // that it has run when the place is given; CASE runs the place only when a row
            // with an aggregate went in.
            enqueue_placed: values.render(
                "SELECT CASE WHEN e.inserted AND $3::text IS NOT NULL \
                             THEN {place_fn}(ARRAY[$1::text]) >= 0 ELSE e.inserted END \
                 FROM (SELECT {enqueue_fn}($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12) \
                              AS inserted OFFSET 0) AS e",
            )?,
            enqueue_one_placed: values
                .render("SELECT {placed_fn}($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)")?,
            enqueue_all_placed: values.render(
                "SELECT CASE WHEN e.existing IS NOT NULL THEN e.existing \
                             WHEN {place_fn}($1) >= 0 THEN NULL END \
                 FROM (SELECT {enqueue_n_fn}($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, \
                                             $13, $14) AS existing OFFSET 0) AS e",
            )?,
            enqueue_all: values.render(
                "SELECT {enqueue_n_fn}($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, \
                 $14)",
            )?,
            dedupe: values.render(
                "INSERT INTO {inbox} (consumer, key) VALUES ($1, $2)
                 ON CONFLICT DO NOTHING",
            )?,
        };
        values.finish()?;
        Ok(statements)
    }
}

/// The INSERTs a [`Producer`](crate::Producer) prepares besides the enqueue function's
/// call, for its outbox's settings: rendered for the name the table resolves to on the
/// producer's connection (see [`PreparedSql::render`]), never cached by the `Outbox`, whose
/// parts are rendered for the name as configured.
#[derive(Debug)]
pub(crate) struct PreparedSql {
    /// A message without an aggregate, with the crate's key, as a [`Producer`](crate::Producer)
    /// writes it: the row the function writes for it, by a plain INSERT ($1..$9, see
    /// `Arguments::plain`), as one statement prepared once does it cheapest; on an outbox
    /// that notifies, it notifies a waiting relay first.
    pub(crate) plain: String,
    /// A message with an aggregate and the crate's key, as a [`Producer`](crate::Producer)
    /// writes it: the row the function writes for it, by an INSERT of $1..$10 (see
    /// `Arguments::ordered`) that takes the aggregate's lock (`LOCK_ONE`) in a subquery,
    /// so before it draws the row's id (an id drawn before the lock could be lower than that
    /// of an earlier producer's row committed while this one waited), then marks the head
    /// by the head function's look (`sql/functions/enqueue.sql`). On an outbox that gives
    /// places, the aggregate's counter is bumped after the lock and the row written with its
    /// place, so it is written once; on one that notifies, the subquery notifies too.
    pub(crate) ordered: String,
}

impl PreparedSql {
    /// The statements for `resolved`, the table's schema-qualified name as `migrate` resolved
    /// it, on an outbox that notifies (`notify`) and gives places (`sequenced`) or not: the
    /// aggregate locks' keys (`LOCK_ONE`) and the notification's channel
    /// (`NOTIFY_IF_WAITING`) derive from the name, and must be those of the functions
    /// `migrate` made, so a lock taken here meets the lock the functions take.
    pub(crate) fn render(
        resolved: &TableName,
        notify: bool,
        sequenced: bool,
    ) -> Result<PreparedSql, RenderError> {
        let names: &[&str] = if sequenced {
            &["table", "head_fn", "sequences"]
        } else {
            &["table", "head_fn"]
        };
        let mut vars = shared(resolved, names)?;
        vars.push(("lock_one", lock_one(resolved)));
        if notify {
            vars.push(("notify_if_waiting", notify_if_waiting(resolved)));
        }
        let (plain, more) = if notify {
            (PLAIN_NOTIFY, ", {notify_if_waiting}")
        } else {
            (PLAIN, "")
        };
        let ordered = if sequenced {
            ordered_placed(more)
        } else {
            ordered(more)
        };
        let mut values = Values::new(&borrowed(&vars))?;
        let statements = PreparedSql {
            plain: values.render(plain)?,
            ordered: values.render(&ordered)?,
        };
        values.finish()?;
        Ok(statements)
    }
}

/// `PreparedSql::plain` on an outbox that does not notify.
const PLAIN: &str = "INSERT INTO {table} (key, topic, payload, content_type, headers, \
                                          available_at, max_attempts, park) \
                     VALUES ($1, $2, $3, $4, $5, \
                             coalesce($6, now() + $7 * interval '1 microsecond'), $8, $9)";

/// `PreparedSql::plain` on an outbox that notifies: the notification in a subquery of its
/// own, which OFFSET 0 keeps apart.
const PLAIN_NOTIFY: &str = "INSERT INTO {table} (key, topic, payload, content_type, headers, \
                                                 available_at, max_attempts, park) \
                            SELECT $1, $2, $3, $4, $5, \
                                   coalesce($6, now() + $7 * interval '1 microsecond'), $8, $9 \
                            FROM (SELECT {notify_if_waiting} OFFSET 0) AS notified";

/// The aggregate's lock, and `more` (a notification) beside it, in a subquery that runs
/// before the row's id is drawn: its volatile functions keep it from being merged into the
/// INSERT's own SELECT, and OFFSET 0 says so.
fn locked(more: &str) -> String {
    format!("(SELECT {{lock_one}}{more} OFFSET 0) AS locked")
}

/// `PreparedSql::ordered`, with `more` in its subquery of locks.
fn ordered(more: &str) -> String {
    format!(
        "INSERT INTO {{table}} (key, topic, aggregate_key, payload, content_type, headers, \
                              available_at, max_attempts, park, head) \
         SELECT $1, $2, $3, $4, $5, $6, coalesce($7, now() + $8 * interval '1 microsecond'), \
                $9, $10, {{head_fn}}($3) \
         FROM {}",
        locked(more)
    )
}

/// `PreparedSql::ordered` on an outbox that gives places, with `more` in its subquery of
/// locks.
fn ordered_placed(more: &str) -> String {
    format!(
        "WITH marked AS MATERIALIZED (SELECT {{head_fn}}($3) AS head FROM {}), \
         placed AS (INSERT INTO {{sequences}} AS s (aggregate_key, last) \
                    SELECT $3, 1 FROM marked \
                    ON CONFLICT (aggregate_key) DO UPDATE SET last = s.last + 1 \
                    RETURNING s.last) \
         INSERT INTO {{table}} (key, topic, aggregate_key, payload, content_type, headers, \
                              available_at, max_attempts, park, head, sequence) \
         SELECT $1, $2, $3, $4, $5, $6, coalesce($7, now() + $8 * interval '1 microsecond'), \
                $9, $10, marked.head, placed.last \
         FROM marked, placed",
        locked(more)
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::render::placeholders;
    use crate::schema::statements::bigint;
    use crate::schema::statements::tests::{renders_for_every_table, tables};

    #[test]
    fn every_template_renders_for_every_table() {
        renders_for_every_table::<ProducerSql>();
    }

    /// A `Producer`'s INSERTs take the locks of the name they were rendered for, and notify
    /// on its channel (when the outbox notifies): the keys and channel `migrate` renders
    /// into the functions. The ordered one gives places only on an outbox that gives them.
    #[test]
    fn a_producers_statements_take_the_locks_and_channel_of_their_name() {
        for table in tables() {
            for (notify, sequenced) in [(false, false), (true, false), (false, true), (true, true)]
            {
                let sql = PreparedSql::render(&table, notify, sequenced).unwrap();
                let every_statement = format!("{sql:?}");
                assert!(
                    placeholders(&every_statement).is_empty(),
                    "{every_statement}"
                );
                let (seed, bucket) = (
                    bigint(table.aggregate_lock_seed()),
                    bigint(table.ordered_lock_key()),
                );
                assert!(sql
                    .ordered
                    .contains(&format!("hashtextextended($3, {seed})")));
                assert!(sql
                    .ordered
                    .contains(&format!("pg_advisory_xact_lock_shared({bucket}")));
                let notifies = format!("pg_notify('{}', '')", table.channel());
                assert_eq!(sql.plain.contains(&notifies), notify, "{}", sql.plain);
                assert_eq!(sql.ordered.contains(&notifies), notify, "{}", sql.ordered);
                assert!(!sql.plain.contains("pg_notify") || notify);
                assert!(!sql.ordered.contains("pg_notify") || notify);
                let places = table.companion("_sequences");
                assert_eq!(sql.ordered.contains(&places), sequenced, "{}", sql.ordered);
            }
        }
    }
}
