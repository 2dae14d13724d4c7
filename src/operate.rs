//! Operating an outbox: counts, dead letters, redrive and purge.

use std::time::{Duration, SystemTime};

use postgres::Client;
use rand::Rng;

use crate::error::{Error, Result};
use crate::message::micros;
use crate::outbox::Outbox;
use crate::record::Record;
use crate::sql::PURGE_BATCH;

/// A snapshot of an outbox's state.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Stats {
    /// Rows waiting to be claimed: due now, delayed, backing off after a failure, or
    /// blocked behind an earlier message of their aggregate.
    pub pending: u64,
    /// Of `pending`, those a relay could claim now: due, and (for a row with an aggregate
    /// key) the oldest pending row of its aggregate. Blocked rows are not due.
    pub due: u64,
    /// Of `pending`, rows waiting behind an earlier pending message of their aggregate.
    /// They move as soon as the messages before them are sent or dead.
    pub blocked: u64,
    /// Rows claimed by a relay whose lease has not run out.
    pub in_flight: u64,
    /// Rows published and not yet purged (kept as a counter, so this costs no scan).
    pub sent: u64,
    /// Dead letters: rows that ran out of attempts or failed permanently (parked ones
    /// included).
    pub dead: u64,
    /// Aggregates held by a parked dead letter (see
    /// [`OutboxBuilder::park_on_dead`](crate::OutboxBuilder::park_on_dead)): their later
    /// messages wait until it is redriven or skipped.
    pub parked: u64,
    /// Age of the oldest row not yet sent or dead (pending or in flight).
    pub oldest_pending_age: Option<Duration>,
    /// Age of the oldest message that holds others back: the head of an aggregate with
    /// blocked rows. Growing without bound means an aggregate is stuck (a head retrying,
    /// delayed or parked); alert on it.
    pub oldest_blocked_age: Option<Duration>,
}

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

/// Which dead letters [`Outbox::redrive`] makes pending again.
#[derive(Debug, Clone, Copy)]
pub enum Redrive<'a> {
    /// Every dead letter.
    All,
    /// The dead letters with these keys (others are left alone).
    Keys(&'a [&'a str]),
}

/// Which finished rows [`Outbox::purge`] deletes.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub enum Purge {
    /// Sent rows finished longer ago than this.
    Sent {
        /// Minimum age since the row was sent.
        older_than: Duration,
    },
    /// Dead letters older than this.
    Dead {
        /// Minimum age since the row died.
        older_than: Duration,
    },
    /// Dedupe records (see [`Outbox::dedupe`]) older than this. Keep them longer than any
    /// message can take to be delivered again: the relay's retry horizon, the broker's
    /// retention, and the longest a consumer may be down. A redelivery after its record was
    /// purged is processed again. Also deletes consumer failure counts (see
    /// `rabbitmq::Consumer`) not updated since the cutoff: a crash can leave one behind.
    Inbox {
        /// Minimum age since the message was processed.
        older_than: Duration,
    },
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
    keys: Vec<String>,
    topic: Option<String>,
    error_contains: Option<String>,
    older_than: Option<Duration>,
    parked: bool,
}

impl Filter {
    /// A filter that selects every row.
    pub fn new() -> Filter {
        Filter::default()
    }

    /// Only the row with this key; call it again for more keys (any of them).
    pub fn key(mut self, key: impl Into<String>) -> Filter {
        self.keys.push(key.into());
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
        self.parked = true;
        self
    }

    /// True when the filter has no condition.
    pub fn is_empty(&self) -> bool {
        self == &Filter::default()
    }

    fn check(&self) -> Result<()> {
        if self.keys.iter().any(String::is_empty) {
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

    /// The five parameters of the SQL filter (`sql::FILTER`) over rows in `states`; a
    /// parked-only filter narrows dead letters to the parked ones.
    fn params<'a>(&'a self, states: &'static [&'static str]) -> FilterParams<'a> {
        let states = if self.parked && states.contains(&PARKED) {
            &[PARKED]
        } else {
            states
        };
        (
            (!self.keys.is_empty()).then_some(self.keys.as_slice()),
            self.topic.as_deref(),
            self.error_contains.as_deref(),
            self.older_than.map(micros),
            states,
        )
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

/// Finished rows that [`Outbox::purge_where`] deletes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum PurgeTarget {
    /// Sent rows.
    Sent,
    /// Dead letters.
    Dead,
    /// Dedupe records of consumers (filters: keys and age only).
    Inbox,
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

/// Pending and dead rows of one topic, from [`Outbox::topic_stats`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct TopicStats {
    /// The topic.
    pub topic: String,
    /// Rows not yet sent (including in flight).
    pub pending: u64,
    /// Dead letters.
    pub dead: u64,
}

impl Outbox {
    /// Counts rows by state. Reads only pending rows (through the two claim indexes), the
    /// dead-letter index and a counter table, so it stays fast however many sent rows are
    /// retained. It groups pending rows by aggregate to tell heads from blocked rows, so it
    /// costs about as much as reading every pending row once: call it for monitoring, not
    /// per message.
    ///
    /// ```no_run
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let mut client = postgres::Client::connect("postgres://postgres@localhost/app", postgres::NoTls)?;
    /// let stats = postgres_outbox::Outbox::new("orders_outbox")?.stats(&mut client)?;
    /// println!("{} pending, {} dead", stats.pending, stats.dead);
    /// # Ok(())
    /// # }
    /// ```
    pub fn stats(&self, client: &mut Client) -> Result<Stats> {
        let row = client
            .query_one(&self.statements().stats, &[])
            .map_err(|e| self.db_error(e))?;
        let count = |i: usize| -> u64 { u64::try_from(row.get::<_, i64>(i)).unwrap_or(0) };
        let age = |i: usize| -> Option<Duration> {
            row.get::<_, Option<f64>>(i)
                .map(|secs| Duration::try_from_secs_f64(secs.max(0.0)).unwrap_or(Duration::MAX))
        };
        Ok(Stats {
            pending: count(0),
            in_flight: count(1),
            due: count(2),
            sent: count(3),
            dead: count(4),
            oldest_pending_age: age(5),
            blocked: count(6),
            oldest_blocked_age: age(7),
            parked: count(8),
        })
    }

    /// Up to `limit` dead letters, oldest first.
    pub fn dead_letters(&self, client: &mut Client, limit: usize) -> Result<Vec<DeadLetter>> {
        self.dead_letters_where(client, &Filter::new(), limit)
    }

    /// Up to `limit` dead letters that match `filter`, oldest first.
    pub fn dead_letters_where(
        &self,
        client: &mut Client,
        filter: &Filter,
        limit: usize,
    ) -> Result<Vec<DeadLetter>> {
        filter.check()?;
        let (keys, topic, error, age, states) = filter.params(DEAD_LETTERS);
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
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

    /// Dead letters that match `filter`, grouped by their last error, most common first:
    /// what broke, how often, since when, and one key to look at.
    pub fn dead_letter_errors(
        &self,
        client: &mut Client,
        filter: &Filter,
    ) -> Result<Vec<ErrorGroup>> {
        filter.check()?;
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

    /// Pending and dead rows per topic, from the claim and dead-letter indexes (sent rows
    /// are not read).
    pub fn topic_stats(&self, client: &mut Client) -> Result<Vec<TopicStats>> {
        let rows = client
            .query(&self.statements().topic_stats, &[])
            .map_err(|e| self.db_error(e))?;
        Ok(rows
            .iter()
            .map(|row| TopicStats {
                topic: row.get(0),
                pending: u64::try_from(row.get::<_, i64>(1)).unwrap_or(0),
                dead: u64::try_from(row.get::<_, i64>(2)).unwrap_or(0),
            })
            .collect())
    }

    /// Makes dead letters pending again, due now with a fresh attempt budget; returns how
    /// many. A redriven row keeps its place in its aggregate: it goes before the messages
    /// still pending behind it (a parked one first of all), but after those that went out
    /// while it was dead, unless it was parked.
    pub fn redrive(&self, client: &mut Client, which: Redrive<'_>) -> Result<u64> {
        let filter = match which {
            Redrive::All => Filter::new(),
            Redrive::Keys([]) => return Ok(0),
            Redrive::Keys(keys) => keys.iter().fold(Filter::new(), |f, k| f.key(*k)),
        };
        self.redrive_where(client, &filter, false)
    }

    /// Makes the dead letters that match `filter` pending again, as [`Outbox::redrive`]
    /// does, and returns how many; with `dry_run`, only counts them and changes nothing.
    ///
    /// ```no_run
    /// # use postgres_outbox::{Filter, Outbox};
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let mut client = postgres::Client::connect("postgres://postgres@localhost/app", postgres::NoTls)?;
    /// let outbox = Outbox::new("orders_outbox")?;
    /// let filter = Filter::new().error_contains("connection refused");
    /// let n = outbox.redrive_where(&mut client, &filter, true)?;
    /// println!("would redrive {n}");
    /// # Ok(())
    /// # }
    /// ```
    pub fn redrive_where(
        &self,
        client: &mut Client,
        filter: &Filter,
        dry_run: bool,
    ) -> Result<u64> {
        let n = self.update_where(client, filter, dry_run, &self.statements().redrive_where)?;
        if n > 0 && !dry_run {
            log::info!("outbox {}: redrove {n} dead letters", self.table());
        }
        Ok(n)
    }

    /// Lets the aggregates of the parked dead letters that match `filter` go on without
    /// them: each stays a dead letter (it can still be redriven, but no longer goes first),
    /// and the messages it held back are published in order. Returns how many; with
    /// `dry_run`, only counts them.
    ///
    /// ```no_run
    /// # use postgres_outbox::{Filter, Outbox};
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let mut client = postgres::Client::connect("postgres://postgres@localhost/app", postgres::NoTls)?;
    /// let outbox = Outbox::new("orders_outbox")?;
    /// outbox.skip(&mut client, &Filter::new().key("0190-poison"), false)?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn skip(&self, client: &mut Client, filter: &Filter, dry_run: bool) -> Result<u64> {
        let filter = filter.clone().parked();
        let n = self.update_where(client, &filter, dry_run, &self.statements().skip_where)?;
        if n > 0 && !dry_run {
            log::info!("outbox {}: skipped {n} parked dead letters", self.table());
        }
        Ok(n)
    }

    /// Redrive or skip: one statement over the dead letters that match, then a wake-up for
    /// a waiting relay, as their aggregates may move now.
    fn update_where(
        &self,
        client: &mut Client,
        filter: &Filter,
        dry_run: bool,
        update: &str,
    ) -> Result<u64> {
        filter.check()?;
        if dry_run {
            return self.count_matching(client, filter, DEAD_LETTERS);
        }
        let (keys, topic, error, age, states) = filter.params(DEAD_LETTERS);
        let sql = self.statements();
        let n = client
            .execute(update, &[&keys, &topic, &error, &age, &states])
            .map_err(|e| self.db_error(e))?;
        if n > 0 {
            client
                .execute(&sql.notify_if_waiting, &[])
                .map_err(|e| self.db_error(e))?;
        }
        Ok(n)
    }

    /// Deletes the finished rows of `target` that match `filter`, in batches of 1,000 rows
    /// each committed on its own, and returns how many; with `dry_run`, only counts them.
    /// Pending rows are never touched, nor are parked dead letters: they hold their
    /// aggregates, so redrive or skip them first. For [`PurgeTarget::Inbox`] only keys and
    /// age apply; a topic or error filter is an error.
    pub fn purge_where(
        &self,
        client: &mut Client,
        target: PurgeTarget,
        filter: &Filter,
        dry_run: bool,
    ) -> Result<u64> {
        filter.check()?;
        if filter.parked {
            return Err(Error::invalid(
                "filter",
                "parked dead letters are never purged: redrive or skip them first",
            ));
        }
        let sql = self.statements();
        let states: &'static [&'static str] = match target {
            PurgeTarget::Sent => &["sent"],
            PurgeTarget::Dead => &["dead"],
            PurgeTarget::Inbox => {
                let (keys, topic, error, age, _) = filter.params(&[]);
                if topic.is_some() || error.is_some() {
                    return Err(Error::invalid(
                        "filter",
                        "dedupe records have no topic or error: filter them by key or age",
                    ));
                }
                return self.purge_inbox_where(client, keys, age, filter, dry_run);
            }
        };
        let count = |n: i64| u64::try_from(n).unwrap_or(0);
        if dry_run {
            return self.count_matching(client, filter, states);
        }
        let (keys, topic, error, age, states) = filter.params(states);
        let mut total = 0;
        loop {
            let slot: i16 = rand::thread_rng().gen_range(0..16);
            let n: i64 = client
                .query_one(
                    &sql.purge_where,
                    &[&keys, &topic, &error, &age, &states, &slot],
                )
                .map_err(|e| self.db_error(e))?
                .get(0);
            total += count(n);
            if n < PURGE_BATCH {
                break;
            }
        }
        if total > 0 {
            log::info!("outbox {}: purged {total} {} rows", self.table(), states[0]);
        }
        Ok(total)
    }

    /// What a dry run reports: the rows in `states` that match `filter`.
    fn count_matching(
        &self,
        client: &mut Client,
        filter: &Filter,
        states: &'static [&'static str],
    ) -> Result<u64> {
        let (keys, topic, error, age, states) = filter.params(states);
        let n: i64 = client
            .query_one(
                &self.statements().count_where,
                &[&keys, &topic, &error, &age, &states],
            )
            .map_err(|e| self.db_error(e))?
            .get(0);
        Ok(u64::try_from(n).unwrap_or(0))
    }

    fn purge_inbox_where(
        &self,
        client: &mut Client,
        keys: Option<&[String]>,
        age: Option<i64>,
        filter: &Filter,
        dry_run: bool,
    ) -> Result<u64> {
        let sql = self.statements();
        let n: i64 = match (keys, age) {
            (Some(keys), age) if dry_run => client
                .query_one(&sql.count_inbox_keys, &[&keys, &age])
                .map(|row| row.get(0)),
            (Some(keys), age) => client
                .execute(&sql.purge_inbox_keys, &[&keys, &age])
                .map(|n| i64::try_from(n).unwrap_or(i64::MAX)),
            (None, age) if dry_run => client
                .query_one(&sql.count_inbox_older, &[&age.unwrap_or(0)])
                .map(|row| row.get(0)),
            (None, _) => {
                let older_than = filter.older_than.unwrap_or(Duration::ZERO);
                return self.purge_inbox(client, older_than);
            }
        }
        .map_err(|e| self.db_error(e))?;
        Ok(u64::try_from(n).unwrap_or(0))
    }

    /// Deletes finished rows (or dedupe records) older than a cutoff, in batches of 1,000
    /// rows each committed on its own so no statement holds locks for long; returns how
    /// many. Pending rows are never touched.
    pub fn purge(&self, client: &mut Client, which: Purge) -> Result<u64> {
        let (target, older_than) = match which {
            Purge::Sent { older_than } => (PurgeTarget::Sent, older_than),
            Purge::Dead { older_than } => (PurgeTarget::Dead, older_than),
            Purge::Inbox { older_than } => return self.purge_inbox(client, older_than),
        };
        self.purge_where(client, target, &Filter::new().older_than(older_than), false)
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
