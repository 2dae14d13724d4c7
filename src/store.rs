//! Running the claim and outcome statements, with or without a statement cache.

use std::collections::HashMap;
use std::time::Duration;

use postgres::types::{ToSql, Type};
use postgres::{GenericClient, Row, Statement};
use rand::Rng;

use crate::error::{Error, Result};
use crate::message::micros;
use crate::outbox::Outbox;
use crate::record::Record;
use crate::retry::Outcome;

type Param<'a> = (&'a (dyn ToSql + Sync), Type);

/// Prepared statements of one connection, keyed by their text. The `postgres` client keeps
/// no cache of its own, and a prepared statement saves a parse and plan per call.
#[derive(Default)]
pub(crate) struct StatementCache(HashMap<String, Statement>);

/// A client and, for long-lived connections, its statement cache.
pub(crate) struct Conn<'a, C: GenericClient> {
    pub(crate) client: &'a mut C,
    pub(crate) cache: Option<&'a mut StatementCache>,
}

impl<'a, C: GenericClient> Conn<'a, C> {
    /// A connection used once: every statement is a one-round-trip `query_typed`.
    pub(crate) fn uncached(client: &'a mut C) -> Self {
        Conn {
            client,
            cache: None,
        }
    }

    fn query(&mut self, sql: &str, params: &[Param<'_>]) -> Result<Vec<Row>, postgres::Error> {
        let Some(cache) = self.cache.as_deref_mut() else {
            return self.client.query_typed(sql, params);
        };
        let statement = match cache.0.get(sql) {
            Some(statement) => statement.clone(),
            None => {
                let types: Vec<Type> = params.iter().map(|(_, t)| t.clone()).collect();
                let statement = self.client.prepare_typed(sql, &types)?;
                cache.0.insert(sql.to_owned(), statement.clone());
                statement
            }
        };
        let values: Vec<&(dyn ToSql + Sync)> = params.iter().map(|(v, _)| *v).collect();
        let result = self.client.query(&statement, &values);
        if result.is_err() {
            // A dropped and recreated table invalidates cached plans; start afresh.
            cache.0.clear();
        }
        result
    }
}

/// Fails with `Error::NotMigrated` when the outbox table is missing.
pub(crate) fn probe(conn: &mut Conn<'_, impl GenericClient>, outbox: &Outbox) -> Result<()> {
    conn.query(&outbox.statements().probe, &[])
        .map_err(|e| outbox.db_error(e))?;
    Ok(())
}

/// Claims up to `limit` due rows under a lease, oldest first.
pub(crate) fn claim(
    conn: &mut Conn<'_, impl GenericClient>,
    outbox: &Outbox,
    limit: usize,
    lease: Duration,
) -> Result<Vec<Record>> {
    let limit = i64::try_from(limit).unwrap_or(i64::MAX);
    let lease = micros(lease);
    let rows = conn
        .query(
            &outbox.statements().claim,
            &[(&limit, Type::INT8), (&lease, Type::INT8)],
        )
        .map_err(|e| outbox.db_error(e))?;
    let mut records = rows
        .iter()
        .map(Record::from_row)
        .collect::<Result<Vec<_>, _>>()
        .map_err(Error::Db)?;
    // UPDATE .. RETURNING does not keep the claim's order.
    records.sort_unstable_by_key(|r| r.id);
    Ok(records)
}

/// What one `record` call changed.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Recorded {
    /// Rows changed; fewer than given when leases were lost.
    pub(crate) changed: u64,
    /// Of those, rows marked sent.
    pub(crate) sent: u64,
}

/// Records a batch of outcomes in one statement, each fenced on id, claimed attempt and
/// status.
pub(crate) fn record(
    conn: &mut Conn<'_, impl GenericClient>,
    outbox: &Outbox,
    outcomes: &[(&Record, &Outcome)],
) -> Result<Recorded> {
    if outcomes.is_empty() {
        return Ok(Recorded::default());
    }
    let n = outcomes.len();
    let mut ids = Vec::with_capacity(n);
    let mut attempts = Vec::with_capacity(n);
    let mut labels = Vec::with_capacity(n);
    let mut delays = Vec::with_capacity(n);
    let mut errors: Vec<Option<&str>> = Vec::with_capacity(n);
    let mut leases = Vec::with_capacity(n);
    for (record, outcome) in outcomes {
        ids.push(record.id);
        leases.push(record.lease);
        attempts.push(record.attempt_param());
        labels.push(outcome.label());
        match outcome {
            Outcome::Retry { delay, error } => {
                delays.push(micros(*delay));
                errors.push(Some(error));
            }
            Outcome::Dead { error } => {
                delays.push(0);
                errors.push(Some(error));
            }
            Outcome::Sent | Outcome::Release => {
                delays.push(0);
                errors.push(None);
            }
        }
    }
    let slot: i16 = rand::thread_rng().gen_range(0..16);
    let rows = conn
        .query(
            &outbox.statements().record_outcomes,
            &[
                (&ids, Type::INT8_ARRAY),
                (&attempts, Type::INT4_ARRAY),
                (&labels, Type::TEXT_ARRAY),
                (&delays, Type::INT8_ARRAY),
                (&errors, Type::TEXT_ARRAY),
                (&slot, Type::INT2),
                (&leases, Type::TIMESTAMPTZ_ARRAY),
            ],
        )
        .map_err(|e| outbox.db_error(e))?;
    let count = |i: usize| {
        rows.first()
            .map_or(0, |row| u64::try_from(row.get::<_, i64>(i)).unwrap_or(0))
    };
    Ok(Recorded {
        changed: count(0),
        sent: count(1),
    })
}
