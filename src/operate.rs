//! Operating an outbox: counts, dead letters, redrive and purge.

use std::time::{Duration, SystemTime};

use postgres::types::Type;
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
    /// Dead letters: rows that ran out of attempts or failed permanently.
    pub dead: u64,
    /// Age of the oldest row not yet sent or dead (pending or in flight).
    pub oldest_pending_age: Option<Duration>,
    /// Age of the oldest message that holds others back: the head of an aggregate with
    /// blocked rows. Growing without bound means an aggregate is stuck (a head retrying
    /// or delayed); alert on it.
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
        })
    }

    /// Up to `limit` dead letters, oldest first.
    pub fn dead_letters(&self, client: &mut Client, limit: usize) -> Result<Vec<DeadLetter>> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let rows = client
            .query(&self.statements().dead_letters, &[&limit])
            .map_err(|e| self.db_error(e))?;
        rows.iter()
            .map(|row| {
                Ok(DeadLetter {
                    record: Record::from_row(row)?,
                    last_error: row.try_get(11)?,
                    dead_at: row.try_get(12)?,
                })
            })
            .collect::<Result<_, postgres::Error>>()
            .map_err(Error::Db)
    }

    /// Makes dead letters pending again, due now with a fresh attempt budget; returns how
    /// many. A redriven row of an aggregate may now be published after later rows of the
    /// same aggregate that went out while it was dead.
    pub fn redrive(&self, client: &mut Client, which: Redrive<'_>) -> Result<u64> {
        let sql = self.statements();
        let n = match which {
            Redrive::All => client.execute(&sql.redrive_all, &[]),
            Redrive::Keys(keys) => {
                client.execute_typed(&sql.redrive_keys, &[(&keys, Type::TEXT_ARRAY)])
            }
        }
        .map_err(|e| self.db_error(e))?;
        if n > 0 {
            log::info!("outbox {}: redrove {n} dead letters", self.table());
        }
        Ok(n)
    }

    /// Deletes finished rows (or dedupe records) older than a cutoff, in batches of 1,000
    /// rows each committed on its own so no statement holds locks for long; returns how
    /// many. Pending rows are never touched.
    pub fn purge(&self, client: &mut Client, which: Purge) -> Result<u64> {
        let sql = self.statements();
        let mut total = 0;
        // Where the inbox walk has got to, by primary key.
        let mut cursor = (String::new(), String::new());
        loop {
            let (deleted, more) = match which {
                Purge::Sent { older_than } => {
                    let slot: i16 = rand::thread_rng().gen_range(0..16);
                    let n: i64 = client
                        .query_one(&sql.purge_sent, &[&micros(older_than), &slot])
                        .map_err(|e| self.db_error(e))?
                        .get(0);
                    (n, n >= PURGE_BATCH)
                }
                Purge::Dead { older_than } => {
                    let n: i64 = client
                        .query_one(&sql.purge_dead, &[&micros(older_than)])
                        .map_err(|e| self.db_error(e))?
                        .get(0);
                    (n, n >= PURGE_BATCH)
                }
                Purge::Inbox { older_than } => {
                    let row = client
                        .query_one(
                            &sql.purge_inbox,
                            &[&micros(older_than), &cursor.0, &cursor.1],
                        )
                        .map_err(|e| self.db_error(e))?;
                    let read: i64 = row.get(1);
                    if let (Some(consumer), Some(key)) = (row.get(2), row.get(3)) {
                        cursor = (consumer, key);
                    }
                    (row.get(0), read >= PURGE_BATCH)
                }
            };
            total += u64::try_from(deleted).unwrap_or(0);
            if !more {
                break;
            }
        }
        if let Purge::Inbox { older_than } = which {
            loop {
                let n: i64 = client
                    .query_one(&sql.purge_failures, &[&micros(older_than)])
                    .map_err(|e| self.db_error(e))?
                    .get(0);
                total += u64::try_from(n).unwrap_or(0);
                if n < PURGE_BATCH {
                    break;
                }
            }
        }
        if total > 0 {
            log::info!("outbox {}: purged {total} rows", self.table());
        }
        Ok(total)
    }
}
