//! The producer's statements, rendered once per table.

use crate::schema::render::{RenderError, Values};
use crate::schema::statements::{borrowed, shared, Statements};
use crate::schema::table::TableName;

/// The producer's statements: enqueues, the batch path, and deduplication.
#[derive(Debug)]
pub(crate) struct ProducerSql {
    /// Calls the enqueue function (`sql/functions/enqueue.sql`): $1..$10 the message, $11 notify,
    /// $12 whether the key is the crate's own.
    pub(crate) enqueue: String,
    /// A message without an aggregate, with the crate's key, as a [`Producer`](crate::Producer)
    /// writes it: the row the function writes for it, by a plain INSERT ($1..$9, see
    /// `Arguments::plain`), as one statement prepared once does it cheapest.
    pub(crate) plain: String,
    /// `plain`, notifying a waiting relay first.
    pub(crate) plain_notify: String,
    /// A message with an aggregate and the crate's key, as a [`Producer`](crate::Producer)
    /// writes it: the row the function writes for it, by an INSERT of $1..$10 (see
    /// `Arguments::ordered`) whose head mark, $11 saying whether to notify, takes the
    /// aggregate's lock in a CTE, so before the INSERT draws the row's id: an id drawn
    /// before the lock could be lower than that of an earlier producer's row committed
    /// while this one waited (`sql/functions/enqueue.sql`).
    pub(crate) ordered: String,
    /// Calls the batch enqueue function (`sql/functions/enqueue.sql`): $1..$12 the columns, $13
    /// notify, $14 whether every key is the crate's own.
    pub(crate) enqueue_all: String,
    /// Before a batch is copied in: locks its aggregates ($1), notifies if $2 and a relay
    /// waits, and returns the aggregates that cannot take a new head (`sql/functions/enqueue.sql`).
    pub(crate) lock_heads: String,
    /// A large batch due at once: binary COPY of the columns that have no default, and
    /// whether each row is its aggregate's head.
    pub(crate) copy_in: String,
    pub(crate) existing_keys: String,
    pub(crate) notify_if_waiting: String,
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
                "head_fn",
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
            notify_if_waiting: values.render("SELECT {notify_fn}()")?,
            enqueue: values
                .render("SELECT {enqueue_fn}($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)")?,
            plain: values.render(
                "INSERT INTO {table} (key, topic, payload, content_type, headers, available_at, \
                                      max_attempts, park) \
                 VALUES ($1, $2, $3, $4, $5, coalesce($6, now() + $7 * interval '1 microsecond'), \
                         $8, $9)",
            )?,
            plain_notify: values.render(
                "INSERT INTO {table} (key, topic, payload, content_type, headers, available_at, \
                                      max_attempts, park) \
                 SELECT $1, $2, $3, $4, $5, coalesce($6, now() + $7 * interval '1 microsecond'), \
                        $8, $9 \
                 FROM {notify_fn}() AS notified",
            )?,
            ordered: values.render(
                "WITH marked AS MATERIALIZED (SELECT {head_fn}($3, $11) AS head) \
                 INSERT INTO {table} (key, topic, aggregate_key, payload, content_type, headers, \
                                      available_at, max_attempts, park, head) \
                 SELECT $1, $2, $3, $4, $5, $6, \
                        coalesce($7, now() + $8 * interval '1 microsecond'), $9, $10, head \
                 FROM marked",
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::statements::tests::renders_for_every_table;

    #[test]
    fn every_template_renders_for_every_table() {
        renders_for_every_table::<ProducerSql>();
    }
}
