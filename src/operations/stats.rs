//! Counts of an outbox's rows by state: at a bounded cost, for monitoring, or exactly, by a
//! scan of the backlog; and per topic.

use std::time::Duration;

use postgres::types::{ToSql, Type};
use postgres::{Client, IsolationLevel, Row};

use crate::error::{Error, Result};
use crate::operations::sql::stats::{StatsSql, BACKLOG_RANGES, DEAD_RANGES, STATS_COUNTED};
use crate::producer::outbox::Outbox;
use crate::runtime::clock::seconds;
use crate::runtime::conn::{self, count};
use crate::schema::statements::first_id;

/// A snapshot of an outbox's state, from [`Outbox::stats`] or [`Outbox::stats_exact`].
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
    /// Age of the oldest row not yet sent or dead (pending or in flight), since it was
    /// enqueued: a row delayed for an hour (`Message::delay`) or backing off counts from its
    /// enqueue, so this grows with nothing wrong. Alert on
    /// [`Outbox::oldest_due_age`](crate::Outbox::oldest_due_age) for "no relay takes rows".
    pub oldest_pending_age: Option<Duration>,
    /// Age of the oldest message that holds others back: the head of an aggregate with
    /// blocked rows. Growing without bound means an aggregate is stuck (a head retrying,
    /// delayed or parked); alert on it.
    pub oldest_blocked_age: Option<Duration>,
    /// Whether every count above was counted row by row. Always true from
    /// [`Outbox::stats_exact`]; from [`Outbox::stats`], false once a part of the backlog
    /// held more rows than it reads, and then `pending`, `due`, `blocked`, `in_flight` and
    /// the two ages are estimates (see there). `sent`, `dead` and `parked` are always exact.
    pub exact: bool,
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
    /// Counts rows by state, at a cost that does not grow with the backlog (under 10 ms on
    /// the reference machine with a million rows pending): for dashboards, gauges and
    /// alerts, as often as every second.
    ///
    /// It reads at most 2,000 rows of each of three parts of the backlog: the rows due now,
    /// the rows waiting for a later time (delayed, backing off, in flight), and the rows
    /// behind an earlier message of their aggregate. While no part holds more, every count
    /// is exact and [`Stats::exact`] is true. Past that, the counts of a part are scaled
    /// from the rows it read to its size as the planner estimates it: the rows per page of
    /// its index when vacuum or analyze last measured it, times the pages the index has
    /// now. So an estimate is off by about the rows that left the backlog since autovacuum
    /// last visited the table (the outbox asks for a visit after 1% of its rows changed),
    /// and a backlog that refills pages an earlier one left empty shows once the table is
    /// analyzed again (after 2%). On a table never vacuumed or analyzed, what was read is
    /// all it reports: a lower bound. Past 2,000 rows waiting for a later time, those count
    /// as read and the rest of the ready rows as due; `in_flight` is always what was read
    /// (a relay holds a few batches, and they come first). The oldest ages are those of the
    /// rows read: the rows behind a head are read in the order of their aggregate keys, so
    /// past 2,000 of them an aggregate stuck for long whose key sorts late is missed, as is
    /// a row retried long past its creation behind 2,000 later ones.
    /// `sent` (a counter), `dead` and `parked` are always exact (these two read the
    /// dead-letter index: their cost grows with the dead letters kept, not the backlog; on
    /// a partitioned outbox, those of closed partitions with nothing else left to send are
    /// counted once, by the relays' upkeep, and not read again: exact as long as dead
    /// letters are deleted only by `purge` of this version or later).
    ///
    /// [`stats_exact`](Outbox::stats_exact) reads every pending row instead.
    ///
    /// ```no_run
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let mut client = postgres::Client::connect("postgres://postgres@localhost/app", postgres::NoTls)?;
    /// let stats = postgres_outbox::Outbox::new("orders_outbox")?.stats(&mut client)?;
    /// let about = if stats.exact { "" } else { "about " };
    /// println!("{about}{} pending, {} dead", stats.pending, stats.dead);
    /// # Ok(())
    /// # }
    /// ```
    pub fn stats(&self, client: &mut Client) -> Result<Stats> {
        let rows = self.read_backlog(client, &self.statements::<StatsSql>().stats, false)?;
        Counted::from_rows(&rows)
            .map(|counted| counted.stats())
            .map_err(Error::Db)
    }

    /// How long the oldest row a relay could take now has been due (since its
    /// `available_at`): unlike [`Stats::oldest_pending_age`], a row delayed or backing off
    /// counts only once due. Growing means no relay claims, or the relays fall behind;
    /// `None` when no row is due. The first entry of the ready index; on a partitioned
    /// table that opens every partition's (which `stats()` does not: it passes over quiet
    /// ones), so it is apart from `stats()`.
    pub fn oldest_due_age(&self, client: &mut Client) -> Result<Option<Duration>> {
        Ok(seconds(
            client
                .query_one(&self.statements::<StatsSql>().health_due, &[])
                .map_err(|e| self.db_error(e))?
                .get(0),
        ))
    }

    /// Counts rows by state exactly: reads every pending and parked row (through the two
    /// claim indexes), the dead-letter index and the sent counter. It groups pending rows
    /// by aggregate to tell heads from blocked rows, so it costs about as much as reading
    /// the backlog once (about 2 s for a million pending rows on the reference machine):
    /// for an operator's question or a test, not for a gauge; see [`stats`](Outbox::stats).
    pub fn stats_exact(&self, client: &mut Client) -> Result<Stats> {
        let row = client
            .query_one(&self.statements::<StatsSql>().stats_exact, &[])
            .map_err(|e| self.db_error(e))?;
        let count = |i: usize| conn::count(&row, i);
        let age = |i: usize| seconds(row.get(i));
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
            exact: true,
        })
    }

    /// Pending and dead rows per topic, from the claim and dead-letter indexes (sent rows
    /// are not read, nor are a partitioned table's settled partitions, nor its quiet ones
    /// but for their dead letters).
    pub fn topic_stats(&self, client: &mut Client) -> Result<Vec<TopicStats>> {
        let rows = self.read_backlog(client, &self.statements::<StatsSql>().topic_stats, true)?;
        Ok(rows
            .iter()
            .map(|row| TopicStats {
                topic: row.get(0),
                pending: count(row, 1),
                dead: count(row, 2),
            })
            .collect())
    }

    /// Runs `query`, which reads the backlog in the ranges of ids from `$2` on (see
    /// `BACKLOG_RANGES`) and counts the dead letters of the quiet partitions from `$1` on
    /// left out (see `StatsSql::stats`), or, `with_ranges`, reads those in the ranges
    /// after (see `DEAD_RANGES`). On a partitioned table, `$1` is the first id of the
    /// oldest partition not settled (sql/functions/partitions.sql), and the ranges those of
    /// the partitions that may hold a pending or parked row, up to the partition of the last
    /// id drawn (the same file): its plan leaves the others out, however
    /// many days retention keeps, partitions it makes ahead, or quiet ones lie between
    /// messages held in old partitions. On a plain one, every id.
    /// The bounds and the counts are read in one snapshot: a redrive committed in between
    /// marks a partition not quiet, before rows the counts would then miss.
    fn read_backlog(
        &self,
        client: &mut Client,
        query: &[String],
        with_ranges: bool,
    ) -> Result<Vec<Row>> {
        // The statement for as many backlog ranges as it reads (at least one), and its
        // parameters.
        let statement = |first: i64, backlog: &[(i64, i64)], counted: &[i64]| {
            let backlog = if backlog.is_empty() {
                &[EMPTY]
            } else {
                backlog
            };
            let mut params = vec![first];
            params.extend(backlog.iter().flat_map(|&(from, to)| [from, to]));
            if with_ranges {
                let mut dead = ranges(counted, DEAD_RANGES);
                dead.resize(DEAD_RANGES, EMPTY);
                params.extend(dead.iter().flat_map(|&(from, to)| [from, to]));
            }
            (&query[backlog.len() - 1], params)
        };
        if !self.partitioned(client)? {
            let (query, params) = statement(0, &[(0, i64::MAX)], &[]);
            return client
                .query_typed(query, &as_params(&params))
                .map_err(|e| self.db_error(e));
        }
        let mut tx = client
            .build_transaction()
            .isolation_level(IsolationLevel::RepeatableRead)
            .read_only(true)
            .start()?;
        let bounds = tx
            .query_typed_one(&self.statements::<StatsSql>().backlog_bounds, &[])
            .map_err(|e| self.db_error(e))?;
        let backlog: Vec<i64> = bounds.get(1);
        let counted: Vec<i64> = bounds.get(2);
        let backlog = ranges(&backlog, BACKLOG_RANGES);
        let (query, params) = statement(bounds.get(0), &backlog, &counted);
        let rows = tx
            .query_typed(query, &as_params(&params))
            .map_err(|e| self.db_error(e))?;
        tx.commit()?;
        Ok(rows)
    }
}

/// `params` as a statement's typed parameters: each statement then takes one round trip.
fn as_params(params: &[i64]) -> Vec<(&(dyn ToSql + Sync), Type)> {
    params
        .iter()
        .map(|p| (p as &(dyn ToSql + Sync), Type::INT8))
        .collect()
}

/// A range of ids that holds none.
const EMPTY: (i64, i64) = (0, -1);

/// The ranges of ids of the partitions `numbers` (ascending), at most `most`, each as its
/// first id and its last: a run of neighbours in one range, and past the last range the
/// rest in it, the partitions between included (the statements read those whole, and count
/// nothing in them twice).
fn ranges(numbers: &[i64], most: usize) -> Vec<(i64, i64)> {
    let mut runs: Vec<(i64, i64)> = Vec::new();
    for &n in numbers {
        let full = runs.len() == most;
        match runs.last_mut() {
            Some(run) if run.1 + 1 == n || full => run.1 = n,
            _ => runs.push((n, n)),
        }
    }
    runs.into_iter()
        .map(|(first, last)| (first_id(first), first_id(last + 1) - 1))
        .collect()
}

/// What one bounded read of the backlog counted (see `StatsSql::stats`).
#[derive(Debug, Clone, Copy, Default)]
struct Part {
    read: u64,
    waiting: u64,
    in_flight: u64,
    due: u64,
    blocked: u64,
    /// Rows with an aggregate key: marked heads, which the ordered index holds too.
    marked: u64,
}

impl Part {
    /// The read stopped one row past its limit: there is more than it saw.
    fn cut_short(&self) -> bool {
        self.read > STATS_COUNTED
    }
}

/// What `StatsSql::stats` read.
#[derive(Debug, Clone, Default)]
struct Counted {
    /// Ready rows due now.
    due: Part,
    /// Ready rows not due yet.
    later: Part,
    /// Rows of aggregates not marked as heads.
    unmarked: Part,
    parked: u64,
    dead: u64,
    sent: u64,
    oldest_pending_age: Option<Duration>,
    oldest_blocked_age: Option<Duration>,
    /// The estimated entries of the ready and the ordered index, if ever measured.
    ready_size: Option<f64>,
    ordered_size: Option<f64>,
    /// Marked heads, pending or parked, counted up to one past the limit.
    marked: u64,
}

impl Counted {
    /// The rows of `StatsSql::stats`: one per part read, each with the totals.
    fn from_rows(rows: &[Row]) -> Result<Counted, postgres::Error> {
        let mut counted = Counted::default();
        for row in rows {
            let count = |i: usize| -> Result<u64, postgres::Error> {
                Ok(u64::try_from(row.try_get::<_, Option<i64>>(i)?.unwrap_or(0)).unwrap_or(0))
            };
            let part = Part {
                read: count(1)?,
                waiting: count(2)?,
                in_flight: count(3)?,
                due: count(4)?,
                blocked: count(5)?,
                marked: count(6)?,
            };
            match row.try_get::<_, Option<&str>>(0)? {
                Some("due") => counted.due = part,
                Some("later") => counted.later = part,
                Some("unmarked") => counted.unmarked = part,
                _ => {}
            }
            // The oldest of the parts' oldest.
            let older = |a: Option<Duration>, b: Option<Duration>| a.max(b);
            counted.oldest_pending_age =
                older(counted.oldest_pending_age, seconds(row.try_get(7)?));
            counted.oldest_blocked_age =
                older(counted.oldest_blocked_age, seconds(row.try_get(8)?));
            counted.parked = count(9)?;
            counted.dead = count(10)?;
            counted.sent = count(11)?;
            counted.ready_size = row.try_get(12)?;
            counted.ordered_size = row.try_get(13)?;
            counted.marked = count(14)?;
        }
        Ok(counted)
    }

    /// The counts, each part that was cut short scaled up to its estimated size.
    fn stats(&self) -> Stats {
        let Counted {
            due,
            later,
            unmarked,
            ..
        } = *self;
        // The ready index holds the due and the later rows. The later ones (in flight,
        // backing off, delayed) are the fewer as a rule: a relay holds at most its batches
        // in flight. So what the index holds beyond the rows read is due, unless the due
        // rows were read whole; past the limit, the later rows count as read.
        let ready = self
            .ready_size
            .unwrap_or(0.0)
            .max((due.read + later.read) as f64);
        let scale_of = |part: &Part, rest: f64| {
            if part.cut_short() {
                rest.max(part.read as f64) / part.read as f64
            } else {
                1.0
            }
        };
        let due_scale = scale_of(&due, ready - later.read as f64);
        let later_scale = if due.cut_short() {
            1.0
        } else {
            scale_of(&later, ready - due.read as f64)
        };
        // The ordered index holds the unmarked rows and the marked heads. Past the limit,
        // the pending heads are the ready rows with an aggregate key, as scaled (the ready
        // rows read first are not a fair sample of the rest: a last resort).
        let unmarked_scale = if unmarked.cut_short() {
            let marked = if self.marked > STATS_COUNTED {
                (due.marked as f64 * due_scale
                    + later.marked as f64 * later_scale
                    + self.parked as f64)
                    .max(self.marked as f64)
            } else {
                self.marked as f64
            };
            scale_of(&unmarked, self.ordered_size.unwrap_or(0.0) - marked)
        } else {
            1.0
        };
        let total = |pick: fn(&Part) -> u64| -> u64 {
            [
                (due, due_scale),
                (later, later_scale),
                (unmarked, unmarked_scale),
            ]
            .iter()
            .map(|(part, scale)| (pick(part) as f64 * scale).round() as u64)
            .sum()
        };
        Stats {
            pending: total(|p| p.waiting),
            due: total(|p| p.due),
            blocked: total(|p| p.blocked),
            // Never scaled: leases run out in the order they were taken, so the rows in
            // flight come first among the later ones, and a relay holds a few batches.
            in_flight: due.in_flight + later.in_flight + unmarked.in_flight,
            sent: self.sent,
            dead: self.dead,
            parked: self.parked,
            oldest_pending_age: self.oldest_pending_age,
            oldest_blocked_age: self.oldest_blocked_age,
            exact: !(due.cut_short() || later.cut_short() || unmarked.cut_short()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_take_runs_of_neighbours_and_the_rest_in_the_last() {
        // From partition `first` to the end of partition `last`.
        let span = |first: i64, last: i64| (first_id(first), first_id(last + 1) - 1);
        assert_eq!(ranges(&[], 4), []);
        assert_eq!(ranges(&[3, 4, 5, 9], 4), [span(3, 5), span(9, 9)]);
        assert_eq!(
            ranges(&[1, 3, 5, 7, 9, 10, 12], 4),
            [span(1, 1), span(3, 3), span(5, 5), span(7, 12)]
        );
        assert_eq!(ranges(&[0, 2], 1), [(0, first_id(3) - 1)]);
    }

    const LIMIT: u64 = STATS_COUNTED;

    fn counted(due: Part, later: Part, unmarked: Part) -> Counted {
        Counted {
            due,
            later,
            unmarked,
            parked: 0,
            dead: 2,
            sent: 9,
            oldest_pending_age: Some(Duration::from_secs(5)),
            oldest_blocked_age: None,
            ready_size: Some(100_000.0),
            ordered_size: Some(30_000.0),
            marked: 10,
        }
    }

    fn due(read: u64, marked: u64) -> Part {
        Part {
            read,
            waiting: read,
            due: read,
            marked,
            ..Part::default()
        }
    }

    fn blocked(read: u64) -> Part {
        Part {
            read,
            waiting: read,
            blocked: read,
            ..Part::default()
        }
    }

    #[test]
    fn parts_read_whole_are_counted_as_they_are() {
        let stats = counted(due(7, 3), Part::default(), blocked(4)).stats();
        assert!(stats.exact);
        assert_eq!((stats.pending, stats.due, stats.blocked), (11, 7, 4));
        assert_eq!((stats.sent, stats.dead), (9, 2));
    }

    #[test]
    fn a_part_cut_short_takes_the_rest_of_its_index() {
        // 100,000 ready rows, 500 of them in flight and read whole: the due ones are the rest.
        let later = Part {
            read: 500,
            in_flight: 500,
            ..Part::default()
        };
        let stats = counted(due(LIMIT + 1, 0), later, Part::default()).stats();
        assert!(!stats.exact);
        assert_eq!((stats.due, stats.in_flight), (99_500, 500));
        assert_eq!(stats.pending, 99_500);
    }

    #[test]
    fn past_the_limit_on_both_sides_the_later_rows_count_as_read() {
        let later = Part {
            read: LIMIT + 1,
            in_flight: 700,
            waiting: LIMIT + 1 - 700,
            ..Part::default()
        };
        let stats = counted(due(LIMIT + 1, 0), later, Part::default()).stats();
        assert_eq!(stats.due, 100_000 - (LIMIT + 1));
        assert_eq!(stats.in_flight, 700);
        assert_eq!(stats.pending, 100_000 - 700);
    }

    #[test]
    fn unmarked_rows_are_the_ordered_index_less_its_marked_heads() {
        let stats = counted(due(20, 10), Part::default(), blocked(LIMIT + 1)).stats();
        assert_eq!(stats.blocked, 30_000 - 10);
        assert_eq!(stats.pending, 20 + 30_000 - 10);
    }

    #[test]
    fn without_statistics_what_was_read_is_a_lower_bound() {
        let mut never_analyzed = counted(due(LIMIT + 1, 0), Part::default(), blocked(LIMIT + 1));
        never_analyzed.ready_size = None;
        never_analyzed.ordered_size = None;
        let stats = never_analyzed.stats();
        assert!(!stats.exact);
        assert_eq!((stats.due, stats.blocked), (LIMIT + 1, LIMIT + 1));
    }
}
