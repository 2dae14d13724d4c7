//! Dead letters: listing them, grouping them by error, and what an operator does with
//! them (redrive, skip).

use std::time::SystemTime;

use postgres::types::ToSql;
use postgres::{Client, IsolationLevel};

use crate::error::{Error, Result};
use crate::operations::filter::{skipped, Filter, Rows, DEAD_LETTERS};
use crate::operations::sql::letters::LettersSql;
use crate::producer::outbox::Outbox;
use crate::producer::sql::ProducerSql;
use crate::publish::record::Record;

/// A row that will not be published unless redriven.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct DeadLetter {
    /// The row; `attempt` is the number of attempts made.
    pub record: Record,
    /// The last publish or handler error.
    pub last_error: Option<String>,
    /// When it was dead-lettered.
    pub dead_at: SystemTime,
}

/// Dead letters that share one error text, from [`Outbox::dead_letter_errors`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ErrorGroup {
    /// The last error they all ended with.
    pub error: Option<String>,
    /// How many.
    pub count: u64,
    /// When the first of them died.
    pub first_dead_at: SystemTime,
    /// When the last of them died.
    pub last_dead_at: SystemTime,
    /// One of their keys, to look at.
    pub sample_key: String,
}

impl Outbox {
    /// The dead letters that match `filter`, oldest first: all of them, or the first
    /// [`limit`](Filter::limit) (a number alone is such a limit: `dead_letters(client, 100)`).
    ///
    /// ```no_run
    /// # use postgres_outbox::{Filter, Outbox};
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let mut client = postgres::Client::connect("postgres://postgres@localhost/app", postgres::NoTls)?;
    /// let outbox = Outbox::new("orders_outbox")?;
    /// for dead in outbox.dead_letters(&mut client, Filter::new().topic("order.paid").limit(20))? {
    ///     println!("{}: {:?}", dead.record.key, dead.last_error);
    /// }
    /// # Ok(())
    /// # }
    /// ```
    pub fn dead_letters(
        &self,
        client: &mut Client,
        filter: impl Into<Filter>,
    ) -> Result<Vec<DeadLetter>> {
        let filter = filter.into();
        filter.check()?;
        let (keys, topic, error, age, states) = filter.params(DEAD_LETTERS);
        let limit = filter
            .limit
            .map_or(i64::MAX, |n| i64::try_from(n).unwrap_or(i64::MAX));
        let rows = client
            .query(
                &self.statements::<LettersSql>().dead_where,
                &[&keys, &topic, &error, &age, &states, &limit],
            )
            .map_err(|e| self.db_error(e))?;
        rows.iter()
            .map(|row| {
                Ok(DeadLetter {
                    record: Record::from_row(row)?,
                    last_error: row.try_get(13)?,
                    dead_at: row.try_get(14)?,
                })
            })
            .collect::<Result<_, postgres::Error>>()
            .map_err(Error::Db)
    }

    /// The dead letters that match `filter`, grouped by their last error, most common
    /// first: what broke, how often, since when, and one key to look at.
    pub fn dead_letter_errors(
        &self,
        client: &mut Client,
        filter: impl Into<Filter>,
    ) -> Result<Vec<ErrorGroup>> {
        let filter = filter.into();
        filter.check_unlimited("grouping by error")?;
        let (keys, topic, error, age, states) = filter.params(DEAD_LETTERS);
        let rows = client
            .query(
                &self.statements::<LettersSql>().dead_errors,
                &[&keys, &topic, &error, &age, &states],
            )
            .map_err(|e| self.db_error(e))?;
        rows.iter()
            .map(|row| {
                Ok(ErrorGroup {
                    error: row.try_get(0)?,
                    count: u64::try_from(row.try_get::<_, i64>(1)?).unwrap_or(0),
                    first_dead_at: row.try_get(2)?,
                    last_dead_at: row.try_get(3)?,
                    sample_key: row.try_get(4)?,
                })
            })
            .collect::<Result<_, postgres::Error>>()
            .map_err(Error::Db)
    }

    /// Makes the dead letters that match `filter` pending again, due now with a fresh
    /// attempt budget, and returns how many (`count(client, Rows::Dead.matching(filter))` is
    /// its dry run). A redriven row keeps its place in its aggregate: it goes before the
    /// messages still pending behind it (a parked one first of all), but after those that
    /// went out while it was dead, unless it was parked.
    ///
    /// ```no_run
    /// # use postgres_outbox::{Filter, Outbox, Rows};
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let mut client = postgres::Client::connect("postgres://postgres@localhost/app", postgres::NoTls)?;
    /// let outbox = Outbox::new("orders_outbox")?;
    /// let refused = Filter::new().error_contains("connection refused");
    /// println!("would redrive {}", outbox.count(&mut client, Rows::Dead.matching(&refused))?);
    /// outbox.redrive(&mut client, &refused)?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn redrive(&self, client: &mut Client, filter: impl Into<Filter>) -> Result<u64> {
        let filter = filter.into();
        filter.check_unlimited("redrive")?;
        let sql: &LettersSql = self.statements();
        let redrive = if self.partitioned(client)? {
            &sql.redrive_partitioned
        } else {
            &sql.redrive_where
        };
        let held = Some((sql.lock_redriven.as_str(), sql.redrive_hold.as_str()));
        let n = self.update_where(client, &filter, held, redrive)?;
        if n > 0 {
            log::info!("outbox {}: redrove {n} dead letters", self.table());
        }
        Ok(n)
    }

    /// Lets the aggregates of the parked dead letters that match `filter` go on without
    /// them: each stays a dead letter (it can still be redriven, but no longer goes first),
    /// and the messages it held back are published in order. Returns how many;
    /// [`would_skip`](Outbox::would_skip) is its dry run.
    ///
    /// ```no_run
    /// # use postgres_outbox::{Filter, Outbox};
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let mut client = postgres::Client::connect("postgres://postgres@localhost/app", postgres::NoTls)?;
    /// let outbox = Outbox::new("orders_outbox")?;
    /// outbox.skip(&mut client, Filter::new().key("0190-poison"))?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn skip(&self, client: &mut Client, filter: impl Into<Filter>) -> Result<u64> {
        let filter = skipped(filter.into())?;
        let sql: &LettersSql = self.statements();
        let n = self.update_where(client, &filter, None, &sql.skip_where)?;
        if n > 0 {
            log::info!("outbox {}: skipped {n} parked dead letters", self.table());
        }
        Ok(n)
    }

    /// What [`skip`](Outbox::skip) would change: how many parked dead letters match
    /// `filter`, refused as `skip` refuses it.
    pub fn would_skip(&self, client: &mut Client, filter: impl Into<Filter>) -> Result<u64> {
        let filter = skipped(filter.into())?;
        self.count(client, Rows::Dead.matching(filter))
    }

    /// Redrive or skip in one transaction, then a wake-up for a waiting relay, as their
    /// aggregates may move now. A skip is one statement over the parked dead letters that
    /// match. A redrive (`Some(lock, hold)`) first locks the aggregates of the dead letters
    /// that match against their producers (`lock` returns them), then touches what the
    /// redriven rows go ahead of (`hold`, given them as `$6`, returns the aggregates, the
    /// first redriven id of each and when what is in flight of each ends), then updates
    /// (given those as `$6`, `$7` and `$8`); see
    /// `redrive_hold` (operations/sql/letters.rs) for why in three statements. READ COMMITTED whatever the
    /// session's default: each statement's snapshot must come after the one before it, to
    /// see what the aggregates' producers and claims committed meanwhile.
    fn update_where(
        &self,
        client: &mut Client,
        filter: &Filter,
        redrive: Option<(&str, &str)>,
        update: &str,
    ) -> Result<u64> {
        let (keys, topic, error, age, states) = filter.params(DEAD_LETTERS);
        let params: [&(dyn ToSql + Sync); 5] = [&keys, &topic, &error, &age, &states];
        let mut tx = client
            .build_transaction()
            .isolation_level(IsolationLevel::ReadCommitted)
            .start()?;
        let n = match redrive {
            Some((lock, hold)) => {
                let locked: Vec<String> = tx
                    .query_one(lock, &params)
                    .map_err(|e| self.db_error(e))?
                    .get(0);
                // Again while a message it waited for got its outcome meanwhile: it then
                // touches the one after it. (Each outcome ends a message: this ends.)
                let held = loop {
                    let held = tx
                        .query_one(hold, &[&keys, &topic, &error, &age, &states, &locked])
                        .map_err(|e| self.db_error(e))?;
                    if held.try_get::<_, bool>(3).map_err(Error::Db)? {
                        break held;
                    }
                };
                let aggregates: Vec<String> = held.try_get(0).map_err(Error::Db)?;
                let firsts: Vec<i64> = held.try_get(1).map_err(Error::Db)?;
                let untils: Vec<Option<SystemTime>> = held.try_get(2).map_err(Error::Db)?;
                tx.execute(
                    update,
                    &[
                        &keys,
                        &topic,
                        &error,
                        &age,
                        &states,
                        &aggregates,
                        &firsts,
                        &untils,
                    ],
                )
            }
            None => tx.execute(update, &params),
        }
        .map_err(|e| self.db_error(e))?;
        if n > 0 {
            tx.execute(&self.statements::<ProducerSql>().notify, &[])
                .map_err(|e| self.db_error(e))?;
        }
        tx.commit()?;
        Ok(n)
    }
}
