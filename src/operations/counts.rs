//! How many rows a selection holds: the dry run of every operation on them.

use postgres::Client;

use crate::error::Result;
use crate::operations::filter::{check_parking, inbox_params, Rows, Selection, DEAD_LETTERS, SENT};
use crate::operations::sql::letters::LettersSql;
use crate::producer::outbox::Outbox;

impl Outbox {
    /// How many rows `rows` selects: the dry run of any operation on them. Dead letters
    /// count parked and unparked ones unless the filter narrows them (a purge deletes only
    /// unparked ones: its dry run counts `Rows::Dead.matching(filter.unparked())`).
    pub fn count(&self, client: &mut Client, rows: impl Into<Selection>) -> Result<u64> {
        let Selection { rows, filter } = rows.into();
        filter.check_unlimited("count")?;
        check_parking(rows, &filter)?;
        let sql: &LettersSql = self.statements();
        let n: i64 = match rows {
            Rows::Sent | Rows::Dead => {
                let states = if rows == Rows::Sent {
                    SENT
                } else {
                    DEAD_LETTERS
                };
                let (keys, topic, error, age, states) = filter.params(states);
                client.query_one(&sql.count_where, &[&keys, &topic, &error, &age, &states])
            }
            Rows::Inbox => {
                let (keys, age) = inbox_params(&filter)?;
                match keys {
                    Some(keys) => client.query_one(&sql.count_inbox_keys, &[&keys, &age]),
                    None => client.query_one(&sql.count_inbox_older, &[&age.unwrap_or(0)]),
                }
            }
        }
        .map_err(|e| self.db_error(e))?
        .get(0);
        Ok(u64::try_from(n).unwrap_or(0))
    }
}
