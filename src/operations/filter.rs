//! The operator's one vocabulary: a [`Filter`] says which dead letters an operation
//! applies to (`dead_letters`, `dead_letter_errors`, `redrive`, `skip`), and [`Rows`] with a
//! filter says which finished rows (`purge`, `count`). Every change returns how many rows
//! it changed; [`Outbox::count`](crate::Outbox::count) of the same selection is its dry run.

use std::time::Duration;

use crate::error::{Error, Result};
use crate::runtime::clock::micros;

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
    pub(super) older_than: Option<Duration>,
    /// Of dead letters: `None` both kinds, `Some(true)` only parked, `Some(false)` none.
    parked: Option<bool>,
    pub(super) limit: Option<usize>,
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

    /// At most this many rows, for [`Outbox::dead_letters`](crate::Outbox::dead_letters) (oldest first); other
    /// operations refuse a filter with a limit rather than change only some rows.
    pub fn limit(mut self, limit: usize) -> Filter {
        self.limit = Some(limit);
        self
    }

    /// True when the filter has no condition.
    pub fn is_empty(&self) -> bool {
        self == &Filter::default()
    }

    pub(super) fn check(&self) -> Result<()> {
        if self.keys.iter().flatten().any(String::is_empty) {
            return Err(Error::invalid("key", "must not be empty"));
        }
        if self.error_contains.as_deref() == Some("") {
            return Err(Error::invalid("error text", "must not be empty"));
        }
        if self
            .older_than
            .is_some_and(|age| age > crate::runtime::retry::MAX_DELAY)
        {
            return Err(Error::invalid("age", "is beyond what a timestamp can hold"));
        }
        Ok(())
    }

    /// For every operation but listing: a limit would change only some of the rows.
    pub(super) fn check_unlimited(&self, operation: &str) -> Result<()> {
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
    pub(super) fn age_alone(&self) -> Option<Duration> {
        let only_age = self.keys.is_none()
            && self.topic.is_none()
            && self.error_contains.is_none()
            && self.parked.is_none()
            && self.limit.is_none();
        only_age.then(|| self.older_than.unwrap_or(Duration::ZERO))
    }

    /// The five parameters of the SQL filter (`FILTER`) over rows in `states`;
    /// `parked` narrows dead letters to one kind.
    pub(super) fn params<'a>(&'a self, states: &'static [&'static str]) -> FilterParams<'a> {
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

/// Which finished rows [`Outbox::purge`](crate::Outbox::purge) deletes and [`Outbox::count`](crate::Outbox::count) counts; with a
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

/// Rows of one kind that match a filter: what [`Outbox::purge`](crate::Outbox::purge) and [`Outbox::count`](crate::Outbox::count)
/// take. Made by [`Rows::matching`]; a bare [`Rows`] selects every row of its kind.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Selection {
    pub(super) rows: Rows,
    pub(super) filter: Filter,
}

impl From<Rows> for Selection {
    fn from(rows: Rows) -> Selection {
        rows.matching(Filter::new())
    }
}

/// A filter as SQL parameters: keys, topic, error text, age in microseconds, the states.
pub(super) type FilterParams<'a> = (
    Option<&'a [String]>,
    Option<&'a str>,
    Option<&'a str>,
    Option<i64>,
    &'static [&'static str],
);

pub(super) const PARKED: &str = "parked";
/// Every dead letter: parked or not.
pub(super) const DEAD_LETTERS: &[&str] = &["dead", PARKED];
pub(super) const SENT: &[&str] = &["sent"];

/// The filter `skip` applies: parked dead letters only, as many as the filter names.
pub(super) fn skipped(filter: Filter) -> Result<Filter> {
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
pub(super) fn purged(selection: Selection) -> Result<Selection> {
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
pub(super) fn check_parking(rows: Rows, filter: &Filter) -> Result<()> {
    match (rows, filter.parked) {
        (Rows::Sent | Rows::Inbox, Some(_)) => Err(Error::invalid(
            "filter",
            "only dead letters are parked or not: drop parked/unparked from this filter",
        )),
        _ => Ok(()),
    }
}

/// The inbox's filter: keys and age, as SQL parameters; a topic or an error text is an error.
pub(super) fn inbox_params(filter: &Filter) -> Result<(Option<&[String]>, Option<i64>)> {
    if filter.topic.is_some() || filter.error_contains.is_some() || filter.parked.is_some() {
        return Err(Error::invalid(
            "filter",
            "dedupe records have no topic, error or parking: filter them by key or age",
        ));
    }
    Ok((filter.keys.as_deref(), filter.older_than.map(micros)))
}
