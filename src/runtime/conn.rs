//! A connection as the crate's statements use it: a client, and for long-lived
//! connections a cache of the statements prepared on it.

use std::collections::HashMap;

use postgres::types::{ToSql, Type};
use postgres::{GenericClient, Row, Statement};

pub(crate) type Param<'a> = (&'a (dyn ToSql + Sync), Type);

/// Prepared statements of one connection, keyed by their text. The `postgres` client keeps
/// no cache of its own, and a prepared statement saves a parse and plan per call.
#[derive(Default)]
pub(crate) struct StatementCache(HashMap<String, Statement>);

/// Column `i` of `row`, a `count(*)` or other bigint that cannot be negative, as a `u64`.
pub(crate) fn count(row: &Row, i: usize) -> u64 {
    u64::try_from(row.get::<_, i64>(i)).unwrap_or(0)
}

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

    pub(crate) fn query(
        &mut self,
        sql: &str,
        params: &[Param<'_>],
    ) -> Result<Vec<Row>, postgres::Error> {
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
