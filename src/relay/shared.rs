//! What the relay's threads and its handle share: the configuration, the stop signal, the
//! wake-ups, and the counts the shutdown reports.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crossbeam_channel::{bounded, Receiver, Sender};

use super::config::RelayConfig;
use super::health::{Access, Health};
use super::report::Report;
use super::waiting::Waiting;
use super::worker::{Control, Worker};
use crate::error::Error;
use crate::relay::sql::RelaySql;
use crate::runtime::lifecycle::StopSignal;

/// Why an idle worker was woken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Wake {
    /// Rows may be due: claim as usual.
    Look,
    /// A producer's commit announced rows: they are most likely ready, so claim those first.
    Notified,
}

/// State every relay thread shares.
pub(crate) struct Shared {
    pub(super) config: RelayConfig,
    /// Sent by shutdown, with its deadline, or by a worker that cannot go on.
    pub(super) stop: StopSignal,
    /// Why the relay stopped on its own, if it did.
    fatal: Mutex<Option<Error>>,
    wake_tx: Sender<Wake>,
    pub(super) wake: Receiver<Wake>,
    pub(super) listening: AtomicBool,
    /// This relay's row in `<table>_waiting`, while a worker waits.
    pub(super) waiting: Waiting,
    pub(super) published: AtomicU64,
    pub(super) released: AtomicU64,
    /// Claimed rows whose outcomes are not recorded yet.
    pub(super) holding: AtomicU64,
    /// Whether the publishers reach their destination.
    pub(super) health: Health,
    /// This relay's row in `<table>_relays`.
    pub(super) report: Report,
}

impl Shared {
    pub(super) fn new(config: RelayConfig) -> Shared {
        let (wake_tx, wake) = bounded::<Wake>(config.concurrency);
        // One id names the relay in `<table>_waiting` and `<table>_relays`.
        let relay = uuid::Uuid::new_v4().to_string();
        let report = Report::new(relay.clone(), config.poll_interval);
        Shared {
            config,
            stop: StopSignal::new(),
            fatal: Mutex::new(None),
            wake_tx,
            wake,
            listening: AtomicBool::new(false),
            waiting: Waiting::new(relay.clone()),
            published: AtomicU64::new(0),
            released: AtomicU64::new(0),
            holding: AtomicU64::new(0),
            health: Health::new(),
            report,
        }
    }

    pub(super) fn stopping(&self) -> bool {
        self.stop.is_sent()
    }

    /// Stops the relay on its own; `fatal` is kept for `join` and `shutdown` (the first one
    /// wins).
    pub(super) fn stop_relay(&self, fatal: Error) {
        if let Ok(mut slot) = self.fatal.lock() {
            slot.get_or_insert(fatal);
        }
        self.stop.send();
    }

    pub(super) fn take_fatal(&self) -> Option<Error> {
        self.fatal.lock().ok().and_then(|mut slot| slot.take())
    }

    /// Writes the relay's report on `worker`'s connection if it is due (see
    /// [`Report::write_if_due`]).
    pub(super) fn report_if_due(&self, worker: &mut Worker, sql: &RelaySql) {
        self.report
            .write_if_due(worker, sql, &self.health, &self.published, &self.holding);
    }

    /// Wakes one idle worker (if none is idle, a busy one claims again anyway).
    pub(super) fn wake_one(&self) {
        let _ = self.wake_tx.try_send(Wake::Look);
    }

    /// What the listener's connection thread calls when a producer's commit announced rows:
    /// it wakes an idle worker from there, a thread hand-over sooner than the listener could.
    pub(super) fn on_notified(&self) -> impl Fn() + Clone + Send + 'static {
        let wake = self.wake_tx.clone();
        let metrics = Arc::clone(&self.config.metrics);
        move || {
            metrics.notified();
            let _ = wake.try_send(Wake::Notified);
        }
    }
}

impl Control for Shared {
    fn stopping(&self) -> bool {
        Shared::stopping(self)
    }

    fn out_of_time(&self) -> bool {
        self.stop.past_deadline()
    }

    fn holding(&self, n: usize, more: bool) {
        if more {
            self.holding.fetch_add(n as u64, Ordering::SeqCst);
        } else {
            self.holding.fetch_sub(n as u64, Ordering::SeqCst);
        }
    }

    fn recorded(&self, sent: u64) {
        self.published.fetch_add(sent, Ordering::SeqCst);
    }

    fn released(&self, n: usize) {
        self.released.fetch_add(n as u64, Ordering::SeqCst);
    }

    fn more_due(&self) {
        self.wake_one();
    }

    fn claimed(&self) {
        self.report.claimed();
    }

    fn access(&self) -> Access {
        self.health.access()
    }

    fn publisher_down(&self, cause: &(dyn std::error::Error + 'static), probe: bool) -> Duration {
        let config = &self.config;
        self.health
            .down(config.outbox.table(), cause, probe, config.metrics.as_ref())
    }

    fn publisher_up(&self) {
        let config = &self.config;
        self.health
            .up(config.outbox.table(), config.metrics.as_ref());
    }

    fn probe_ended(&self) {
        self.health.probe_ended();
    }
}
