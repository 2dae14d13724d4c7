//! The rights each side of an outbox needs under a role that owns nothing (docs/grants.md),
//! as GRANT statements: the list changes with the migrations, so it is kept here, beside
//! them, and not in each deployment's scripts.

use crate::schema::render::{RenderError, Values};
use crate::schema::statements::{borrowed, checked, objects};
use crate::schema::table::TableName;

/// A side of an outbox, for [`Outbox::grants`](crate::Outbox::grants).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Access {
    /// `enqueue` and `enqueue_all` (and the places of an outbox built with
    /// [`sequence`](crate::OutboxBuilder::sequence)).
    Produce,
    /// A relay, and `process`: claims, records, reports, and keeps a partitioned table's
    /// partitions.
    Relay,
    /// `dedupe` alone.
    Dedupe,
    /// The RabbitMQ `Consumer`: `dedupe`, its failure counts, and the last place it
    /// processed of each aggregate.
    Consume,
    /// `purge` and `would_purge` by age on a partitioned table: drops partitions whose rows
    /// are all sent.
    Retire,
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
GRANT UPDATE (sequence) ON {table} TO {role};
GRANT SELECT, INSERT, UPDATE ON {sequences} TO {role};
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
GRANT SELECT, INSERT, UPDATE ON {consumed} TO {role};
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

#[cfg(test)]
mod tests {
    use super::*;

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
