//! The relay's row in `<table>_relays` (see [`Outbox::relays`](crate::Outbox::relays)):
//! written by whichever worker finds it due, on that worker's connection, after a cycle or
//! while idle: every few seconds, and at once when the publisher goes up or down. The last
//! worker to stop deletes it. It is for people: a report that cannot be written is logged
//! once, and the relay goes on as before. On a partitioned table each report is preceded
//! by the upkeep of its partitions, and says whether it failed.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime};

use postgres::error::SqlState;

use super::health::Health;
use super::worker::{Param, Worker};
use crate::operations::relays::{PublisherState, REPORT_EVERY};
use crate::relay::sql::RelaySql;

pub(crate) struct Report {
    /// The relay's id, the same as its row's in `<table>_waiting`.
    relay: String,
    started: SystemTime,
    poll_interval: Duration,
    /// What `claimed` counts from.
    base: Instant,
    /// When a worker's claim last came back, in microseconds after `base`, plus one; 0
    /// before the first. By this clock alone: the report gives the claim's age, which the
    /// database subtracts from its own `now()` (the relay's host's clock may be off).
    claimed: AtomicU64,
    /// When the report was last written, and the publisher's state it gave.
    last: Mutex<Option<(Instant, &'static str)>>,
    /// Workers running: the last to stop deletes the row.
    workers: AtomicUsize,
    /// The last write failed (and was logged).
    failing: AtomicBool,
    /// The last partition maintenance failed (and was logged).
    maintaining_fails: AtomicBool,
}

impl Report {
    pub(crate) fn new(relay: String, poll_interval: Duration) -> Report {
        Report {
            relay,
            started: SystemTime::now(),
            poll_interval,
            base: Instant::now(),
            claimed: AtomicU64::new(0),
            last: Mutex::new(None),
            workers: AtomicUsize::new(0),
            failing: AtomicBool::new(false),
            maintaining_fails: AtomicBool::new(false),
        }
    }

    /// A worker's claim came back, taking rows or not.
    pub(crate) fn claimed(&self) {
        let micros = u64::try_from(self.base.elapsed().as_micros()).unwrap_or(u64::MAX - 1);
        self.claimed.fetch_max(micros + 1, Ordering::SeqCst);
    }

    /// How long ago a claim came back, in microseconds: zero while a worker holds claimed
    /// rows (it publishes them: a long cycle is work, not a relay that stopped claiming).
    fn claim_age(&self, holding: &AtomicU64) -> Option<i64> {
        if holding.load(Ordering::SeqCst) > 0 {
            return Some(0);
        }
        let claimed = self.claimed.load(Ordering::SeqCst).checked_sub(1)?;
        let since = self
            .base
            .elapsed()
            .saturating_sub(Duration::from_micros(claimed));
        Some(i64::try_from(since.as_micros()).unwrap_or(i64::MAX))
    }

    pub(crate) fn worker_started(&self) {
        self.workers.fetch_add(1, Ordering::SeqCst);
    }

    /// When the next report is due, whatever happens meanwhile: an idle worker wakes for
    /// it, so a relay idle for long still says it runs.
    pub(crate) fn next_due(&self) -> Instant {
        match self.last.lock() {
            Ok(last) => last.map_or_else(Instant::now, |(at, _)| at + REPORT_EVERY),
            Err(_) => Instant::now() + REPORT_EVERY,
        }
    }

    /// Writes the report on `worker`'s connection if it is due: none written yet, the last
    /// one `REPORT_EVERY` ago, or the publisher has gone up or down since. Not while the
    /// worker's claims fail for the database's reasons: it waits out its backoff first.
    pub(crate) fn write_if_due(
        &self,
        worker: &mut Worker,
        sql: &RelaySql,
        health: &Health,
        published: &AtomicU64,
        holding: &AtomicU64,
    ) {
        if worker.in_database_trouble() {
            return;
        }
        let publisher = health.state();
        {
            let Ok(mut last) = self.last.lock() else {
                return;
            };
            let due = last
                .is_none_or(|(at, said)| at.elapsed() >= REPORT_EVERY || said != publisher.name());
            if !due {
                return;
            }
            *last = Some((Instant::now(), publisher.name()));
        }
        let down_since = match publisher {
            PublisherState::Down { since } => Some(since),
            _ => None,
        };
        // First, so that the report says how it went.
        let upkeep_error = self.maintain_partitions(worker, sql);
        let published = i64::try_from(published.load(Ordering::SeqCst)).unwrap_or(i64::MAX);
        let claim_age = self.claim_age(holding);
        let poll_interval = i64::try_from(self.poll_interval.as_micros()).unwrap_or(i64::MAX);
        let row: Vec<Param> = vec![
            Box::new(self.relay.clone()),
            Box::new(i32::try_from(std::process::id()).unwrap_or(i32::MAX)),
            Box::new(self.started),
            Box::new(publisher.name()),
            Box::new(down_since),
            Box::new(published),
            Box::new(upkeep_error),
            Box::new(claim_age),
            Box::new(poll_interval),
        ];
        match worker.execute(&sql.report_relay, row) {
            Ok(()) => {
                if self.failing.swap(false, Ordering::SeqCst) {
                    log::info!("outbox {}: the relay reports itself again", worker.table());
                }
            }
            Err(e) => {
                if !self.failing.swap(true, Ordering::SeqCst) {
                    let hint = if e.is_not_migrated() {
                        " (migrate to create its table)"
                    } else if e.code() == Some(&SqlState::UNDEFINED_COLUMN) {
                        " (migrate: the table is older than this relay)"
                    } else {
                        ""
                    };
                    log::warn!(
                        "outbox {}: the relay cannot write its report (Outbox::relays){hint} \
                         and goes on without: {e}",
                        worker.table()
                    );
                }
            }
        }
    }

    /// Keeps a partitioned outbox's partitions: cut on time, made ahead (see
    /// sql/functions/partitions.sql).
    /// On the report's cadence, which is frequent enough: partitions are made intervals
    /// ahead, and a cut a few seconds late only makes a partition a little longer. Returns
    /// why it failed, for the report.
    fn maintain_partitions(&self, worker: &mut Worker, sql: &RelaySql) -> Option<String> {
        // Nothing to keep on a plain table, and no statement more for its relays to run.
        if !worker.on_partitioned_table() {
            return None;
        }
        match worker.execute(&sql.maintain_partitions, Vec::new()) {
            Ok(()) => {
                self.maintaining_fails.store(false, Ordering::SeqCst);
                None
            }
            Err(e) => {
                if !self.maintaining_fails.swap(true, Ordering::SeqCst) {
                    log::warn!(
                        "outbox {}: the relay cannot keep the table's partitions, and tries \
                         again at its next report: {e}",
                        worker.table()
                    );
                }
                // With its SQLSTATE, which `doctor` reads the cause from: the text is in
                // the server's language.
                Some(match e.code() {
                    Some(code) => format!("[{}] {e}", code.code()),
                    None => e.to_string(),
                })
            }
        }
    }

    /// A worker stops; the last one deletes the row, unless the shutdown is out of time.
    pub(crate) fn worker_stopping(&self, worker: &mut Worker, sql: &RelaySql, in_time: bool) {
        if self.workers.fetch_sub(1, Ordering::SeqCst) != 1 || !in_time {
            return;
        }
        if let Err(e) = worker.execute(&sql.forget_relay, vec![Box::new(self.relay.clone())]) {
            log::warn!(
                "outbox {}: the relay could not delete its report; it is forgotten after a \
                 day: {e}",
                worker.table()
            );
        }
    }
}
