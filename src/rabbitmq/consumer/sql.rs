//! The consumer's statements, rendered once per table, and the settings of its sessions.

use std::time::Duration;

use crate::schema::render::{render, RenderError, Values};
use crate::schema::statements::{borrowed, checked, shared, Statements};
use crate::schema::table::TableName;

/// The RabbitMQ consumer's statements: its failure counts, and the probe of its tables.
#[derive(Debug)]
pub(crate) struct ConsumerSql {
    /// Counts one more handler failure of a consumer on a message; returns the new count
    /// and whether the message is now given up on.
    pub(crate) count_failure: String,
    /// A consumer's failure count and last error of a message it gave up on, if it did,
    /// and whether its dead letter is stored.
    pub(crate) failure_state: String,
    /// Records that the dead letter of a message given up on is stored.
    pub(crate) mark_buried: String,
    pub(crate) forget_failures: String,
    /// Records that consumer $1 processes place $3 of aggregate $2 (in the handler's
    /// transaction, so it commits with the handler's work) and returns the last place it
    /// had processed (NULL for none). The last place only moves forward: a delivery behind
    /// leaves it where it was.
    pub(crate) record_place: String,
    /// Fails when the consumer's tables are missing.
    pub(crate) probe_consumer: String,
}

impl Statements for ConsumerSql {
    fn render(table: &TableName) -> Result<Self, RenderError> {
        let vars = shared(table, &["inbox", "failures", "consumed"])?;
        let mut values = Values::new(&borrowed(&vars))?;
        let statements = ConsumerSql {
            // $1 consumer, $2 key, $3 the error, already made storable, $4 whether it is
            // permanent, $5 the failures after which the consumer gives up, $6 the handling
            // counted: counted again (its reply was lost), it answers with the count it made
            // rather than adding one more. A message whose dead letter is stored and that
            // fails again is a redriven copy: its count starts afresh.
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
                   AND NOT EXISTS (SELECT 1 FROM counted)",
            )?,
            failure_state: values.render(
                "SELECT failures, last_error, buried FROM {failures}
                 WHERE consumer = $1 AND key = $2 AND dead",
            )?,
            // The dead letter of a message given up on is stored: a redelivery of it is acked.
            mark_buried: values.render(
                "UPDATE {failures} SET buried = true, updated_at = now()
                 WHERE consumer = $1 AND key = $2 AND dead",
            )?,
            forget_failures: values
                .render("DELETE FROM {failures} WHERE consumer = $1 AND key = $2")?,
            // The row is locked before it is read: a second consumer of the same name
            // handling the same aggregate waits, and reads what the first committed. (Of an
            // aggregate's first place there is no row to lock yet: both read none.)
            record_place: values.render(
                "WITH prior AS (
                   SELECT last FROM {consumed} WHERE consumer = $1 AND aggregate_key = $2
                   FOR UPDATE),
                 kept AS (
                   INSERT INTO {consumed} AS c (consumer, aggregate_key, last) VALUES ($1, $2, $3)
                   ON CONFLICT (consumer, aggregate_key)
                   DO UPDATE SET last = greatest(c.last, excluded.last))
                 SELECT (SELECT last FROM prior)",
            )?,
            probe_consumer: values.render(
                "SELECT 1 FROM {inbox} LIMIT 0; SELECT attempt, buried FROM {failures} LIMIT 0; \
                 SELECT last FROM {consumed} LIMIT 0",
            )?,
        };
        values.finish()?;
        Ok(statements)
    }
}

/// Names a session for `pg_stat_activity`, the name bound as `$1`.
pub(crate) const SET_APPLICATION_NAME: &str = "SELECT set_config('application_name', $1, false)";

/// Undoes a consumer's session settings before a pooled connection goes back.
pub(crate) const CONSUMER_SESSION_RESET: &str = "RESET statement_timeout; RESET application_name";

/// The statement timeout of a consumer's handler sessions.
pub(crate) fn consumer_session(statement_timeout: Duration) -> String {
    checked(render(
        "SET statement_timeout = {ms}",
        &[("ms", &statement_timeout.as_millis().to_string())],
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::statements::tests::renders_for_every_table;

    #[test]
    fn every_template_renders_for_every_table() {
        renders_for_every_table::<ConsumerSql>();
    }

    // Here because the consumer's is the one part a build without features lacks: with it,
    // every part of the crate asks one table's cache, so a part added past its slots fails
    // this test rather than a process that uses every part.
    #[test]
    fn every_part_of_the_crate_has_a_slot() {
        use crate::operations::sql::{health::HealthSql, letters::LettersSql, stats::StatsSql};
        use crate::producer::sql::ProducerSql;
        use crate::relay::sql::RelaySql;
        use crate::schema::migrate::MigrateSql;
        use crate::schema::partitioning::PartitionSql;
        use crate::schema::statements::Rendered;

        let rendered = Rendered::new(TableName::parse("app.events").unwrap());
        rendered.get::<MigrateSql>();
        rendered.get::<PartitionSql>();
        rendered.get::<ProducerSql>();
        rendered.get::<RelaySql>();
        rendered.get::<StatsSql>();
        rendered.get::<LettersSql>();
        rendered.get::<HealthSql>();
        rendered.get::<ConsumerSql>();
    }

    #[test]
    fn a_handler_session_has_its_statement_timeout() {
        assert_eq!(
            consumer_session(Duration::from_secs(30)),
            "SET statement_timeout = 30000"
        );
    }
}
