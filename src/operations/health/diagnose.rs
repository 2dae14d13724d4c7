//! Reading the figures of `Outbox::health` from the server's statistics and catalogs.

use postgres::Client;

use super::checks::findings;
use super::report::{Health, HealthThresholds, HeldBack, Holder, Partition, Slot, TableHealth};
use crate::error::Result;
use crate::operations::sql::health::{self as sql, HealthSql};
use crate::producer::outbox::Outbox;
use crate::runtime::clock::seconds;
use crate::runtime::conn::count;
use crate::schema::statements::first_id;

impl Outbox {
    /// Diagnoses the outbox with the default [`HealthThresholds`]; see
    /// [`health_with`](Outbox::health_with).
    pub fn health(&self, client: &mut Client) -> Result<Health> {
        self.health_with(client, &HealthThresholds::default())
    }

    /// Diagnoses the outbox: dead tuples, the last vacuum and analyze (and whether autovacuum
    /// visits), and the space holding no live row of its tables, the oldest transaction and
    /// prepared transaction holding back the xmin horizon, the replication slots and
    /// standbys holding one, how long the oldest ready row has been due, and what the relays
    /// report (a publisher down; claims that do not keep up; reports that stopped coming).
    /// Every figure past `thresholds` is a [`Finding`](crate::Finding) with its remedy. Its
    /// cost does not grow with the table: catalog rows, and the bounded reads of
    /// [`stats`](Outbox::stats) for the dead and parked letters.
    ///
    /// ```no_run
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let mut client = postgres::Client::connect("postgres://postgres@localhost/app", postgres::NoTls)?;
    /// let health = postgres_outbox::Outbox::new("orders_outbox")?.health(&mut client)?;
    /// for finding in &health.findings {
    ///     eprintln!("{finding}");
    /// }
    /// # Ok(())
    /// # }
    /// ```
    pub fn health_with(
        &self,
        client: &mut Client,
        thresholds: &HealthThresholds,
    ) -> Result<Health> {
        let sql: &HealthSql = self.statements();
        let names = [
            self.table_name().quoted(),
            self.table_name().companion("_inbox"),
        ];
        let mut tables = client
            .query(sql::HEALTH_TABLES, &[&names[0], &names[1]])
            .map_err(|e| self.db_error(e))?
            .into_iter()
            .map(|row| TableHealth {
                table: row.get(0),
                live_tuples: count(&row, 1),
                dead_tuples: count(&row, 2),
                since_vacuum: seconds(row.get(3)),
                since_analyze: seconds(row.get(4)),
                changed_since_analyze: count(&row, 5),
                autovacuum: row.get(6),
                heap_bytes: count(&row, 7),
                total_bytes: count(&row, 8),
                unused_heap_bytes: row
                    .get::<_, Option<i64>>(9)
                    .map(|bytes| u64::try_from(bytes).unwrap_or(0)),
            });
        let outbox_table = tables.next().unwrap_or_default();
        let inbox_table = tables.next().unwrap_or_default();
        let holder = |statement: &str, client: &mut Client| -> Result<Option<Holder>> {
            Ok(client
                .query_opt(statement, &[])
                .map_err(|e| self.db_error(e))?
                .map(|row| Holder {
                    id: row.get(0),
                    age: seconds(row.get(1)).unwrap_or_default(),
                    what: row.get(2),
                }))
        };
        let oldest_transaction = holder(sql::HEALTH_TRANSACTION, client)?;
        let oldest_prepared = holder(sql::HEALTH_PREPARED, client)?;
        let slots = client
            .query(sql::HEALTH_SLOTS, &[])
            .map_err(|e| self.db_error(e))?
            .into_iter()
            .map(|row| Slot {
                name: row.get(0),
                xmin_age: row.get(1),
                wal_bytes: count(&row, 2),
                kind: row.get(3),
                active: row.get(4),
                active_pid: row
                    .get::<_, Option<i32>>(5)
                    .and_then(|pid| u32::try_from(pid).ok()),
            })
            .collect();
        let oldest_due_age = self.oldest_due_age(client)?;
        // The dead and parked letters, as `stats` counts them.
        let counted = self.stats(client)?;
        let relays = self.relays(client)?;
        let mut partitions: Vec<Partition> = client
            .query(&sql.partitions, &[])
            .map_err(|e| self.db_error(e))?
            .into_iter()
            .map(|row| Partition {
                number: row.get(0),
                every: seconds(row.get(1)).unwrap_or_default(),
                opened: seconds(row.get(2)),
                closed: seconds(row.get(3)),
                exists: row.get(4),
                rows: count(&row, 5),
                settled: seconds(row.get(6)),
                held_back: None,
                quiet: row.get(7),
            })
            .collect();
        // A partition dropped by hand holds nothing back.
        if let Some(oldest) = partitions
            .iter_mut()
            .find(|p| p.closed.is_some() && p.settled.is_none() && p.exists)
        {
            let ids = (first_id(oldest.number), first_id(oldest.number + 1));
            let row = client
                .query_opt(&sql.partition_left, &[&ids.0, &ids.1, &oldest.number])
                .map_err(|e| self.db_error(e))?;
            // None: it settled, or was dropped, since the list was read.
            oldest.held_back = row.map(|row| match (count(&row, 0), row.get(1), row.get(2)) {
                (0, false, true) => HeldBack::Transactions,
                (0, false, false) => HeldBack::NoUpkeep,
                (0, true, _) => HeldBack::Pending,
                (kept, _, _) => HeldBack::Kept(kept),
            });
        }
        let mut health = Health {
            outbox_table,
            inbox_table,
            oldest_transaction,
            oldest_prepared,
            slots,
            oldest_due_age,
            dead_letters: counted.dead,
            parked: counted.parked,
            relays,
            partitions,
            findings: Vec::new(),
        };
        health.findings = findings(self.table(), &health, thresholds);
        Ok(health)
    }
}
