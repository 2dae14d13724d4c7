//! The relay's row in `<table>_relays` (see [`Outbox::relays`](crate::Outbox::relays)):
//! written between cycles by whichever worker finds it due, on that worker's connection,
//! every few seconds and at once when the publisher goes up or down; deleted by the last
//! worker to stop. It is for people: a report that cannot be written is logged once, and
//! the relay goes on as before.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Instant, SystemTime};

use super::worker::Worker;
use crate::relays::{PublisherState, REPORT_EVERY};
use crate::sql::Statements;

pub(crate) struct Report {
    relay: String,
    started: SystemTime,
    /// When the report was last written.
    last: Mutex<Option<Instant>>,
    /// Workers running: the last to stop deletes the row.
    workers: AtomicUsize,
    /// The last write failed (and was logged).
    failing: AtomicBool,
}

/// What a report says, as its statement takes it.
pub(crate) struct Row {
    pub(crate) relay: String,
    pub(crate) pid: i32,
    pub(crate) started: SystemTime,
    pub(crate) publisher: &'static str,
    pub(crate) down_since: Option<SystemTime>,
    pub(crate) published: i64,
}

impl Report {
    pub(crate) fn new() -> Report {
        Report {
            relay: uuid::Uuid::new_v4().to_string(),
            started: SystemTime::now(),
            last: Mutex::new(None),
            workers: AtomicUsize::new(0),
            failing: AtomicBool::new(false),
        }
    }

    pub(crate) fn worker_started(&self) {
        self.workers.fetch_add(1, Ordering::SeqCst);
    }

    /// Writes the report on `worker`'s connection if it is due: none written yet, the last
    /// one `REPORT_EVERY` ago, or the publisher went up or down (`changed`).
    pub(crate) fn write_if_due(
        &self,
        worker: &mut Worker,
        sql: &Statements,
        changed: bool,
        publisher: PublisherState,
        published: u64,
    ) {
        {
            let Ok(mut last) = self.last.lock() else {
                return;
            };
            if !changed && last.is_some_and(|at| at.elapsed() < REPORT_EVERY) {
                return;
            }
            *last = Some(Instant::now());
        }
        let row = Row {
            relay: self.relay.clone(),
            pid: i32::try_from(std::process::id()).unwrap_or(i32::MAX),
            started: self.started,
            publisher: publisher.name(),
            down_since: match publisher {
                PublisherState::Down { since } => Some(since),
                _ => None,
            },
            published: i64::try_from(published).unwrap_or(i64::MAX),
        };
        match worker.report(&sql.report_relay, row) {
            Ok(()) => {
                if self.failing.swap(false, Ordering::SeqCst) {
                    log::info!(
                        "outbox {}: the relay reports itself again",
                        sql.table().as_str()
                    );
                }
            }
            Err(e) => {
                if !self.failing.swap(true, Ordering::SeqCst) {
                    log::warn!(
                        "outbox {}: the relay cannot write its report (Outbox::relays; \
                         migrate to create its table) and goes on without: {e}",
                        sql.table().as_str()
                    );
                }
            }
        }
    }

    /// A worker stops; the last one deletes the row, unless the shutdown is out of time.
    pub(crate) fn worker_stopping(&self, worker: &mut Worker, sql: &Statements, in_time: bool) {
        if self.workers.fetch_sub(1, Ordering::SeqCst) != 1 || !in_time {
            return;
        }
        if let Err(e) = worker.execute(&sql.forget_relay, &self.relay) {
            log::warn!(
                "outbox {}: the relay could not delete its report; it is forgotten after a \
                 day: {e}",
                sql.table().as_str()
            );
        }
    }
}
