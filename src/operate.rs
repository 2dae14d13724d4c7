//! Operating an outbox: counts, dead letters, redrive, skip and purge.
//!
//! One vocabulary: a [`Filter`] says which dead letters an operation applies to
//! (`dead_letters`, `dead_letter_errors`, `redrive`, `skip`), and [`Rows`] with a filter says
//! which finished rows (`purge`, `count`). Every change returns how many rows it changed;
//! [`Outbox::count`] of the same selection is its dry run.

use std::time::{Duration, SystemTime};

use postgres::types::ToSql;
use postgres::{Client, IsolationLevel};
use rand::Rng;

use crate::error::{Error, Result};
use crate::message::micros;
use crate::outbox::Outbox;
use crate::record::Record;
use crate::sql::PURGE_BATCH;

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

/// Which rows an operator's command applies to: every condition given must hold; a filter
/// with none selects every row. Built like a `postgres::Config`:
///
/// ```
/// use std::time::Duration;
/// use postgres_outbox::Filter;
/// let filter = Filter::new()
///     .topic("order.created")
///     .error_contains("timeout")
///     .older_than(Duration::from_secs(7 * 24 * 3600));
/// assert!(!filter.is_empty());
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Filter {
    /// `None`: any key; `Some`: one of these (none, if empty).
    keys: Option<Vec<String>>,
    topic: Option<String>,
    error_contains: Option<String>,
    older_than: Option<Duration>,
    /// Of dead letters: `None` both kinds, `Some(true)` only parked, `Some(false)` none.
    parked: Option<bool>,
    limit: Option<usize>,
}

impl Filter {
    /// A filter that selects every row.
    pub fn new() -> Filter {
        Filter::default()
    }

    /// Only the row with this key; call it again for more keys (any of them).
    pub fn key(mut self, key: impl Into<String>) -> Filter {
        self.keys.get_or_insert_with(Vec::new).push(key.into());
        self
    }

    /// Only the rows with these keys (none, if there are none).
    pub fn keys<I, K>(mut self, keys: I) -> Filter
    where
        I: IntoIterator<Item = K>,
        K: Into<String>,
    {
        let list = self.keys.get_or_insert_with(Vec::new);
        list.extend(keys.into_iter().map(Into::into));
        self
    }

    /// Only rows of this topic.
    pub fn topic(mut self, topic: impl Into<String>) -> Filter {
        self.topic = Some(topic.into());
        self
    }

    /// Only rows whose last error contains this text (case-sensitive).
    pub fn error_contains(mut self, text: impl Into<String>) -> Filter {
        self.error_contains = Some(text.into());
        self
    }

    /// Only rows that finished (were sent, died, or were processed, for the inbox) longer
    /// ago than this.
    pub fn older_than(mut self, age: Duration) -> Filter {
        self.older_than = Some(age);
        self
    }

    /// Only dead letters that park their aggregate (see
    /// [`OutboxBuilder::park_on_dead`](crate::OutboxBuilder::park_on_dead)).
    pub fn parked(mut self) -> Filter {
        self.parked = Some(true);
        self
    }

    /// Only dead letters that do not park their aggregate: what a purge of dead letters
    /// deletes (it never deletes parked ones).
    pub fn unparked(mut self) -> Filter {
        self.parked = Some(false);
        self
    }

    /// At most this many rows, for [`Outbox::dead_letters`] (oldest first); other
    /// operations refuse a filter with a limit rather than change only some rows.
    pub fn limit(mut self, limit: usize) -> Filter {
        self.limit = Some(limit);
        self
    }

    /// True when the filter has no condition.
    pub fn is_empty(&self) -> bool {
        self == &Filter::default()
    }

    fn check(&self) -> Result<()> {
        if self.keys.iter().flatten().any(String::is_empty) {
            return Err(Error::invalid("key", "must not be empty"));
        }
        if self.error_contains.as_deref() == Some("") {
            return Err(Error::invalid("error text", "must not be empty"));
        }
        if self
            .older_than
            .is_some_and(|age| age > crate::message::MAX_DELAY)
        {
            return Err(Error::invalid("age", "is beyond what a timestamp can hold"));
        }
        Ok(())
    }

    /// For every operation but listing: a limit would change only some of the rows.
    fn check_unlimited(&self, operation: &str) -> Result<()> {
        self.check()?;
        match self.limit {
            Some(_) => Err(Error::invalid(
                "filter",
                format!("{operation} applies to every row that matches: a limit only lists"),
            )),
            None => Ok(()),
        }
    }

    /// The age of a filter that selects by age alone (or selects every row: age zero), which
    /// a partitioned outbox's retention serves by dropping partitions.
    fn age_alone(&self) -> Option<Duration> {
        let only_age = self.keys.is_none()
            && self.topic.is_none()
            && self.error_contains.is_none()
            && self.parked.is_none()
            && self.limit.is_none();
        only_age.then(|| self.older_than.unwrap_or(Duration::ZERO))
    }

    /// The five parameters of the SQL filter (`sql::FILTER`) over rows in `states`;
    /// `parked` narrows dead letters to one kind.
    fn params<'a>(&'a self, states: &'static [&'static str]) -> FilterParams<'a> {
        let states: &'static [&'static str] = match self.parked {
            Some(true) if states.contains(&PARKED) => &[PARKED],
            Some(false) if states.contains(&PARKED) => &["dead"],
            _ => states,
        };
        (
            self.keys.as_deref(),
            self.topic.as_deref(),
            self.error_contains.as_deref(),
            self.older_than.map(micros),
            states,
        )
    }
}

impl From<&Filter> for Filter {
    fn from(filter: &Filter) -> Filter {
        filter.clone()
    }
}

/// The first `limit` dead letters: `dead_letters(client, 100)`.
impl From<usize> for Filter {
    fn from(limit: usize) -> Filter {
        Filter::new().limit(limit)
    }
}

/// Which finished rows [`Outbox::purge`] deletes and [`Outbox::count`] counts; with a
/// filter, through [`matching`](Rows::matching).
///
/// ```no_run
/// use std::time::Duration;
/// use postgres_outbox::{Filter, Outbox, Rows};
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let mut client = postgres::Client::connect("postgres://postgres@localhost/app", postgres::NoTls)?;
/// let outbox = Outbox::new("orders_outbox")?;
/// let week_old = Rows::Sent.matching(Filter::new().older_than(Duration::from_secs(7 * 86_400)));
/// println!("would purge {}", outbox.count(&mut client, week_old.clone())?);
/// outbox.purge(&mut client, week_old)?;
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Rows {
    /// Sent rows.
    Sent,
    /// Dead letters; [`Filter::parked`] and [`Filter::unparked`] narrow them to one kind.
    /// A purge deletes only the unparked ones.
    Dead,
    /// Dedupe records of consumers (filters: keys and age only).
    Inbox,
}

impl Rows {
    /// The rows of this kind that match `filter`.
    pub fn matching(self, filter: impl Into<Filter>) -> Selection {
        Selection {
            rows: self,
            filter: filter.into(),
        }
    }
}

/// Rows of one kind that match a filter: what [`Outbox::purge`] and [`Outbox::count`]
/// take. Made by [`Rows::matching`]; a bare [`Rows`] selects every row of its kind.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Selection {
    rows: Rows,
    filter: Filter,
}

impl From<Rows> for Selection {
    fn from(rows: Rows) -> Selection {
        rows.matching(Filter::new())
    }
}

/// A filter as SQL parameters: keys, topic, error text, age in microseconds, the states.
type FilterParams<'a> = (
    Option<&'a [String]>,
    Option<&'a str>,
    Option<&'a str>,
    Option<i64>,
    &'static [&'static str],
);

const PARKED: &str = "parked";
/// Every dead letter: parked or not.
const DEAD_LETTERS: &[&str] = &["dead", PARKED];
const SENT: &[&str] = &["sent"];

/// The filter `skip` applies: parked dead letters only, as many as the filter names.
fn skipped(filter: Filter) -> Result<Filter> {
    filter.check_unlimited("skip")?;
    if filter.parked == Some(false) {
        return Err(Error::invalid(
            "filter",
            "skip applies to parked dead letters only",
        ));
    }
    Ok(filter.parked())
}

/// The selection `purge` applies, refused when it names parked dead letters (they hold
/// their aggregates: redrive or skip them first).
fn purged(selection: Selection) -> Result<Selection> {
    selection.filter.check_unlimited("purge")?;
    check_parking(selection.rows, &selection.filter)?;
    if selection.rows == Rows::Dead && selection.filter.parked == Some(true) {
        return Err(Error::invalid(
            "filter",
            "parked dead letters are never purged: redrive or skip them first",
        ));
    }
    Ok(selection)
}

/// Parking narrows dead letters only.
fn check_parking(rows: Rows, filter: &Filter) -> Result<()> {
    match (rows, filter.parked) {
        (Rows::Sent | Rows::Inbox, Some(_)) => Err(Error::invalid(
            "filter",
            "only dead letters are parked or not: drop parked/unparked from this filter",
        )),
        _ => Ok(()),
    }
}

/// The inbox's filter: keys and age, as SQL parameters; a topic or an error text is an error.
fn inbox_params(filter: &Filter) -> Result<(Option<&[String]>, Option<i64>)> {
    if filter.topic.is_some() || filter.error_contains.is_some() || filter.parked.is_some() {
        return Err(Error::invalid(
            "filter",
            "dedupe records have no topic, error or parking: filter them by key or age",
        ));
    }
    Ok((filter.keys.as_deref(), filter.older_than.map(micros)))
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
                &self.statements().dead_where,
                &[&keys, &topic, &error, &age, &states, &limit],
            )
            .map_err(|e| self.db_error(e))?;
        rows.iter()
            .map(|row| {
                Ok(DeadLetter {
                    record: Record::from_row(row)?,
                    last_error: row.try_get(12)?,
                    dead_at: row.try_get(13)?,
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
                &self.statements().dead_errors,
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
        let sql = self.statements();
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
        let sql = self.statements();
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

    /// Redrive or skip in one transaction, then a wake-up for a waiting relay, as their
    /// aggregates may move now. A skip is one statement over the parked dead letters that
    /// match. A redrive (`Some(lock, hold)`) first locks the aggregates of the dead letters
    /// that match against their producers (`lock` returns them), then touches what the
    /// redriven rows go ahead of (`hold`, given them as `$6`, returns the aggregates, the
    /// first redriven id of each and when what is in flight of each ends), then updates
    /// (given those as `$6`, `$7` and `$8`); see
    /// `sql::redrive_hold` for why in three statements. READ COMMITTED whatever the
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
            tx.execute(&self.statements().notify_if_waiting, &[])
                .map_err(|e| self.db_error(e))?;
        }
        tx.commit()?;
        Ok(n)
    }

    /// How many rows `rows` selects: the dry run of any operation on them. Dead letters
    /// count parked and unparked ones unless the filter narrows them (a purge deletes only
    /// unparked ones: its dry run counts `Rows::Dead.matching(filter.unparked())`).
    pub fn count(&self, client: &mut Client, rows: impl Into<Selection>) -> Result<u64> {
        let Selection { rows, filter } = rows.into();
        filter.check_unlimited("count")?;
        check_parking(rows, &filter)?;
        let sql = self.statements();
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
                let sql = self.statements();
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
        let sql = self.statements();
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
        let sql = self.statements();
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
        let sql = self.statements();
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
