//! Deleting finished rows: sent rows and dead letters in bounded batches, or whole
//! partitions of a partitioned table; dedupe records and stray failure counts.

use std::time::Duration;

use postgres::{Client, IsolationLevel};
use rand::Rng;

use crate::error::Result;
use crate::operations::filter::{inbox_params, purged, Filter, Rows, Selection, SENT};
use crate::operations::sql::letters::{LettersSql, PURGE_BATCH};
use crate::producer::outbox::Outbox;
use crate::runtime::clock::micros;

impl Outbox {
    /// What [`purge`](Outbox::purge) would delete: the rows `rows` selects, parked dead
    /// letters left out, refused as `purge` refuses it.
    pub fn would_purge(&self, client: &mut Client, rows: impl Into<Selection>) -> Result<u64> {
        let Selection { rows, filter } = purged(rows.into())?;
        if let Some(age) = self.retired_by_partition(client, rows, &filter)? {
            return self.retire(client, age, true);
        }
        let filter = match rows {
            Rows::Dead => filter.unparked(),
            _ => filter,
        };
        self.count(client, rows.matching(filter))
    }

    /// Deletes the finished rows `rows` selects, in batches of 1,000 rows each committed on
    /// its own (so no statement holds locks for long), and returns how many. Pending rows
    /// are never touched, nor are parked dead letters: they hold their aggregates, so
    /// redrive or skip them first. Dedupe records ([`Rows::Inbox`]) filter by key and age
    /// only: keep them longer than any message can take to be delivered again (the relay's
    /// retry horizon, the broker's retention, the longest a consumer may be down), as a
    /// redelivery after its record is gone is processed again; their purge also deletes
    /// consumers' failure counts not updated since the cutoff (a crash can leave one).
    /// [`would_purge`](Outbox::would_purge) is its dry run.
    pub fn purge(&self, client: &mut Client, rows: impl Into<Selection>) -> Result<u64> {
        let Selection { rows, filter } = purged(rows.into())?;
        let states = match rows {
            Rows::Sent => SENT,
            Rows::Dead => &["dead"],
            Rows::Inbox => {
                let sql: &LettersSql = self.statements();
                return match inbox_params(&filter)? {
                    (Some(keys), age) => client
                        .execute(&sql.purge_inbox_keys, &[&keys, &age])
                        .map_err(|e| self.db_error(e)),
                    (None, _) => {
                        let older_than = filter.older_than.unwrap_or(Duration::ZERO);
                        self.purge_inbox(client, older_than)
                    }
                };
            }
        };
        if let Some(age) = self.retired_by_partition(client, rows, &filter)? {
            return self.retire(client, age, false);
        }
        let (keys, topic, error, age, states) = filter.params(states);
        let sql: &LettersSql = self.statements();
        let purge = if self.partitioned(client)? {
            &sql.purge_partitioned
        } else {
            &sql.purge_where
        };
        let mut total = 0;
        loop {
            let slot: i16 = rand::thread_rng().gen_range(0..16);
            // READ COMMITTED whatever the session's default: relays write the sent counters
            // and their upkeep the partitions' bookkeeping all the time, and an update of a
            // row written after a REPEATABLE READ snapshot fails where this one waits and
            // reads it anew.
            let mut tx = client
                .build_transaction()
                .isolation_level(IsolationLevel::ReadCommitted)
                .start()?;
            let n: i64 = tx
                .query_one(purge, &[&keys, &topic, &error, &age, &states, &slot])
                .map_err(|e| self.db_error(e))?
                .get(0);
            tx.commit()?;
            total += u64::try_from(n).unwrap_or(0);
            if n < PURGE_BATCH {
                break;
            }
        }
        if total > 0 {
            log::info!("outbox {}: purged {total} {} rows", self.table(), states[0]);
        }
        Ok(total)
    }

    /// The age before which sent rows go by whole partitions: on a partitioned outbox, a
    /// purge of sent rows by age alone.
    fn retired_by_partition(
        &self,
        client: &mut Client,
        rows: Rows,
        filter: &Filter,
    ) -> Result<Option<Duration>> {
        match filter.age_alone() {
            Some(age) if rows == Rows::Sent && self.partitioned(client)? => Ok(Some(age)),
            _ => Ok(None),
        }
    }

    /// Drops each closed partition whose rows were all sent longer than `age` ago, passing
    /// over the ones it keeps (one statement and transaction each, see `<table>_retire` in
    /// sql/functions/partitions.sql), and returns how many rows they held; with `dry_run`, how many they hold.
    fn retire(&self, client: &mut Client, age: Duration, dry_run: bool) -> Result<u64> {
        let sql: &LettersSql = self.statements();
        let age = micros(age);
        let mut total = 0;
        loop {
            // Whatever the session's default: the drop's second look must see what
            // committed while it waited for its lock (see sql/functions/partitions.sql).
            let mut tx = client
                .build_transaction()
                .isolation_level(IsolationLevel::ReadCommitted)
                .start()?;
            let rows: Option<i64> = tx
                .query_one(&sql.retire_partition, &[&age, &dry_run])
                .map_err(|e| self.db_error(e))?
                .get(0);
            tx.commit()?;
            let Some(rows) = rows else { break };
            total += u64::try_from(rows).unwrap_or(0);
            if dry_run {
                break;
            }
            log::info!(
                "outbox {}: dropped a partition of {rows} sent rows",
                self.table()
            );
        }
        Ok(total)
    }

    /// The inbox has no index on processed_at (every dedupe would pay for one): walk the
    /// primary key, a batch per statement. Then the consumers' stray failure counts.
    fn purge_inbox(&self, client: &mut Client, older_than: Duration) -> Result<u64> {
        let sql: &LettersSql = self.statements();
        let age = micros(older_than);
        let mut total = 0;
        let mut cursor = (String::new(), String::new());
        loop {
            let row = client
                .query_one(&sql.purge_inbox, &[&age, &cursor.0, &cursor.1])
                .map_err(|e| self.db_error(e))?;
            let (deleted, read): (i64, i64) = (row.get(0), row.get(1));
            total += u64::try_from(deleted).unwrap_or(0);
            match (row.get(2), row.get(3)) {
                (Some(consumer), Some(key)) if read >= PURGE_BATCH => cursor = (consumer, key),
                _ => break,
            }
        }
        loop {
            let n: i64 = client
                .query_one(&sql.purge_failures, &[&age])
                .map_err(|e| self.db_error(e))?
                .get(0);
            total += u64::try_from(n).unwrap_or(0);
            if n < PURGE_BATCH {
                break;
            }
        }
        if total > 0 {
            log::info!("outbox {}: purged {total} dedupe records", self.table());
        }
        Ok(total)
    }
}
