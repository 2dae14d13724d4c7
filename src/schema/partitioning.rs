//! Partitioned outboxes as the schema makes them: the DDL that makes an outbox's table,
//! still empty, a partitioned one (`sql/partitioned.sql`), and what `migrate` runs to make
//! it or to change how long its partitions stay open.
//!
//! The partitions' own functions (the maker, settling, retirement) are in
//! `sql/functions/partitions.sql`; the relay runs their upkeep (`relay::sql`), the operator
//! retention (`operations::purge`) and the doctor reads their state (`operations::health`).

use std::time::Duration;

use postgres::Transaction;

use crate::error::{Error, Result};
use crate::runtime::clock::micros;
use crate::schema::render::{render, RenderError, Values};
use crate::schema::statements::PARTITIONS_AHEAD;
use crate::schema::statements::{borrowed, checked, shared, Statements};
use crate::schema::table::TableName;

/// The DDL that makes an outbox's table, still empty, a partitioned one (see
/// `Outbox::migrate` and `OutboxBuilder::partition_interval`).
const PARTITIONED: &str = include_str!("../../sql/partitioned.sql");

/// What a migration runs to give a table the form its `Outbox` asks for.
#[derive(Debug)]
pub(crate) struct PartitionSql {
    /// Locks the table against every other use, for its conversion.
    pub(crate) lock_table: String,
    /// Whether the table holds any row.
    pub(crate) has_rows: String,
    /// Sets how long the open and later partitions stay open.
    pub(crate) set_partition_interval: String,
}

impl Statements for PartitionSql {
    fn render(table: &TableName) -> std::result::Result<Self, RenderError> {
        let vars = shared(table, &["table", "partitions"])?;
        let mut values = Values::new(&borrowed(&vars))?;
        let statements = PartitionSql {
            lock_table: values.render("LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")?,
            has_rows: values.render("SELECT EXISTS (SELECT 1 FROM {table})")?,
            set_partition_interval: values.render(
                "UPDATE {partitions} SET every = $1::bigint * interval '1 microsecond'
                 WHERE closed_at IS NULL AND every <> $1::bigint * interval '1 microsecond'",
            )?,
        };
        values.finish()?;
        Ok(statements)
    }
}

/// Within a migration, under its lock: makes the table partitioned when `every` asks for
/// it and the table is still plain (refused if it holds rows), or sets how long its open
/// partitions stay open. Returns whether the table is partitioned. `name` is the outbox's
/// name, for messages.
pub(crate) fn give_form(
    tx: &mut Transaction<'_>,
    table: &TableName,
    sql: &PartitionSql,
    name: &str,
    partitioned: bool,
    every: Option<Duration>,
) -> Result<bool> {
    match every {
        Some(every) if !partitioned => {
            // Under the lock, so no producer writes a row between the check and the
            // conversion (which checks again, for the script of `Outbox::sql`).
            tx.batch_execute(&sql.lock_table)?;
            if tx.query_one(&sql.has_rows, &[])?.get::<_, bool>(0) {
                return Err(Error::InvalidConfig(format!(
                    "outbox {name} holds rows, and only an empty table is made partitioned: \
                     see docs/partitions.md to convert one"
                )));
            }
            log::info!("outbox {name}: making the table partitioned");
            tx.batch_execute(&partitioned_ddl(table, every))?;
            Ok(true)
        }
        Some(every) => {
            tx.execute(&sql.set_partition_interval, &[&micros(every)])?;
            Ok(true)
        }
        None => Ok(partitioned),
    }
}

/// The DDL that makes `table`, migrated and still empty, a partitioned table whose
/// partitions stay open for `every` (see `sql/partitioned.sql`).
///
/// # Panics
///
/// If the template does not match its values (see `Schema::new`).
pub(crate) fn partitioned_ddl(table: &TableName, every: Duration) -> String {
    checked(render_partitioned(table, every))
}

pub(crate) fn render_partitioned(
    table: &TableName,
    every: Duration,
) -> std::result::Result<String, RenderError> {
    let mut vars = shared(
        table,
        &[
            "table",
            "enqueue_fn",
            "enqueue_n_fn",
            "lock_heads_fn",
            "partitions",
            "partition_fn",
        ],
    )?;
    vars.extend([
        ("name", table.name().to_owned()),
        ("unpartitioned_name", table.derived("_plain")),
        ("unpartitioned", table.companion("_plain")),
        ("pkey", table.derived("_pkey")),
        ("ready_idx", table.derived("_ready")),
        ("ordered_idx", table.derived("_ordered")),
        ("done_idx", table.derived("_done")),
        (
            "every",
            format!("interval '{} microseconds'", every.as_micros()),
        ),
        ("ahead", PARTITIONS_AHEAD.to_string()),
    ]);
    render(PARTITIONED, &borrowed(&vars))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::render::placeholders;
    use crate::schema::statements::tests::{renders_for_every_table, tables};

    #[test]
    fn every_template_renders_for_every_table() {
        renders_for_every_table::<PartitionSql>();
    }

    #[test]
    fn the_conversion_renders_for_every_table_with_its_interval() {
        let day = Duration::from_secs(24 * 3600);
        for table in tables() {
            let ddl = render_partitioned(&table, day).unwrap();
            assert!(placeholders(&ddl).is_empty(), "{}", table.as_str());
            assert!(ddl.contains("interval '86400000000 microseconds'"));
        }
    }
}
