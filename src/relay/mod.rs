//! The relay: threads that claim committed rows, publish them and record the outcomes.
//!
//! ```text
//!  listener ──wake──▶ dispatcher ──jobs──▶ worker × concurrency ──outcomes──▶ recorder
//!  (LISTEN)           (claims)             (one publisher each)               (batched, fenced)
//! ```
//!
//! The dispatcher claims the next batch while workers are still publishing the previous one,
//! but never holds more than two batches, so memory stays bounded whatever the backlog.

mod config;
mod dispatcher;
mod listener;
pub(crate) mod pool;
mod recorder;
mod worker;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, never, unbounded, Receiver, RecvTimeoutError, Sender};

pub use config::RelayConfig;

use crate::error::{Error, Result};
use crate::publish::Publisher;
use crate::record::Record;
use crate::retry::Outcome;
use crate::store::{self, Conn};
use pool::Session;

/// A claimed slice of a batch, on its way to a worker.
pub(crate) struct Job {
    records: Vec<Record>,
    claimed_at: Instant,
    /// When the lease runs out, by this host's monotonic clock; conservative, since it is
    /// measured from before the claim was sent.
    deadline: Instant,
}

/// State every relay thread shares.
pub(crate) struct Shared {
    config: RelayConfig,
    stopping: AtomicBool,
    listening: AtomicBool,
    published: AtomicU64,
    released: AtomicU64,
    /// Records handed to a publisher whose outcome is not yet known.
    publishing: AtomicU64,
    /// Set by shutdown: when the threads must be done.
    deadline: Mutex<Option<Instant>>,
}

impl Shared {
    fn stopping(&self) -> bool {
        self.stopping.load(Ordering::SeqCst)
    }

    /// True once shutting down and past its deadline.
    fn out_of_time(&self) -> bool {
        self.stopping()
            && self
                .deadline
                .lock()
                .map(|d| d.is_some_and(|d| Instant::now() >= d))
                .unwrap_or(true)
    }
}

/// What [`Relay::shutdown`] saw.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ShutdownReport {
    /// Records published and recorded as sent over the relay's life.
    pub published: u64,
    /// Claimed records handed back unpublished, attempt counts restored.
    pub released: u64,
    /// Records still inside a publisher when the timeout ran out. Their outcome is unknown:
    /// their leases will expire and another relay will publish them again.
    pub abandoned: u64,
}

/// A running relay. Stop it with [`Relay::shutdown`]; dropping it shuts down too, waiting
/// up to the configured drain timeout.
///
/// ```no_run
/// use std::time::Duration;
/// use postgres_outbox::{publisher_fn, Outbox, Relay, RelayConfig};
/// use r2d2_postgres::{postgres::NoTls, PostgresConnectionManager};
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let manager = PostgresConnectionManager::new("postgres://postgres@localhost/app".parse()?, NoTls);
/// let pool = r2d2::Pool::new(manager)?;
/// let relay = Relay::spawn(RelayConfig::new(Outbox::new("orders_outbox")?, pool, || {
///     Ok::<_, std::io::Error>(publisher_fn(|_record| Ok(())))
/// }))?;
/// // ... serve requests ...
/// let report = relay.shutdown(Duration::from_secs(10))?;
/// assert_eq!(report.abandoned, 0);
/// # Ok(())
/// # }
/// ```
pub struct Relay {
    shared: Arc<Shared>,
    stop: Option<Sender<()>>,
    dispatcher: Option<JoinHandle<Result<()>>>,
    dispatcher_done: Receiver<()>,
    threads: Vec<JoinHandle<()>>,
    workers_done: Receiver<()>,
    recorder_done: Receiver<()>,
    listener_done: Receiver<()>,
    work: Receiver<Job>,
    outcomes: Option<Sender<Vec<(Record, Outcome)>>>,
}

impl std::fmt::Debug for Relay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay")
            .field("outbox", &self.shared.config.outbox)
            .field("listening", &self.is_listening())
            .finish_non_exhaustive()
    }
}

fn spawn_named<T: Send + 'static>(
    name: String,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<JoinHandle<T>> {
    thread::Builder::new()
        .name(name)
        .spawn(f)
        .map_err(|e| Error::RelayDied(format!("could not start a thread: {e}")))
}

impl Relay {
    /// Starts the relay's threads and returns at once.
    ///
    /// Fails if the configuration is invalid, the pool is too small for the relay's own
    /// connections (two, three with notify), or the outbox table has not been migrated.
    pub fn spawn(config: RelayConfig) -> Result<Relay> {
        config.validate()?;
        let needed = config.connections_needed();
        if config.pool.max_size() < needed {
            return Err(Error::InvalidConfig(format!(
                "the pool holds {} connections; the relay keeps {needed} checked out",
                config.pool.max_size()
            )));
        }
        let mut session = Session::new(config.pool.clone());
        session.run(|conn| store::probe(conn, &config.outbox))?;

        let shared = Arc::new(Shared {
            config,
            stopping: AtomicBool::new(false),
            listening: AtomicBool::new(false),
            published: AtomicU64::new(0),
            released: AtomicU64::new(0),
            publishing: AtomicU64::new(0),
            deadline: Mutex::new(None),
        });
        let config = &shared.config;
        let (stop_tx, stop_rx) = bounded::<()>(0);
        let (work_tx, work_rx) = unbounded::<Job>();
        let (done_tx, done_rx) = unbounded::<usize>();
        let (outcome_tx, outcome_rx) = unbounded::<Vec<(Record, Outcome)>>();
        let (dispatcher_alive, dispatcher_done) = bounded::<()>(0);
        let (workers_alive, workers_done) = bounded::<()>(0);
        let (recorder_alive, recorder_done) = bounded::<()>(0);
        let (listener_alive, listener_done) = bounded::<()>(0);
        let mut threads = Vec::new();

        let wake_rx = if config.notify {
            let (wake_tx, wake_rx) = bounded::<()>(1);
            let shared = shared.clone();
            threads.push(spawn_named("outbox-listener".into(), move || {
                let _alive = listener_alive;
                listener::run(&shared, &wake_tx);
            })?);
            wake_rx
        } else {
            drop(listener_alive);
            never()
        };

        {
            let shared = shared.clone();
            let mut session = session;
            threads.push(spawn_named("outbox-recorder".into(), move || {
                let _alive = recorder_alive;
                recorder::run(&shared, &mut session, &outcome_rx);
            })?);
        }

        for i in 0..config.concurrency {
            let shared = shared.clone();
            let work_rx = work_rx.clone();
            let stop_rx = stop_rx.clone();
            let outcome_tx = outcome_tx.clone();
            let done_tx = done_tx.clone();
            let alive = workers_alive.clone();
            threads.push(spawn_named(format!("outbox-worker-{i}"), move || {
                let _alive = alive;
                worker::run(&shared, &work_rx, &stop_rx, &outcome_tx, &done_tx);
            })?);
        }
        drop(workers_alive);

        let dispatcher = {
            let shared = shared.clone();
            spawn_named("outbox-dispatcher".into(), move || {
                let _alive = dispatcher_alive;
                dispatcher::run(&shared, &work_tx, &done_rx, &wake_rx, &stop_rx)
            })?
        };
        log::info!(
            "outbox {}: relay started (batch {}, concurrency {}, notify {})",
            config.outbox.table(),
            config.batch_size,
            config.concurrency,
            config.notify
        );
        Ok(Relay {
            shared,
            stop: Some(stop_tx),
            dispatcher: Some(dispatcher),
            dispatcher_done,
            threads,
            workers_done,
            recorder_done,
            listener_done,
            work: work_rx,
            outcomes: Some(outcome_tx),
        })
    }

    /// True while the listener holds a live LISTEN connection. Always false with
    /// `notify(false)`; false while the listener reconnects.
    pub fn is_listening(&self) -> bool {
        self.shared.listening.load(Ordering::SeqCst)
    }

    /// Stops the relay: no more claims; claimed rows not yet handed to a publisher are
    /// released at once with their attempt counts restored; publishes under way get until
    /// `timeout` to finish and be recorded; then every thread is joined.
    ///
    /// A publisher still running at the timeout cannot be interrupted: its records are
    /// counted in [`ShutdownReport::abandoned`], their leases will expire, and its thread is
    /// left to end when the publisher returns.
    pub fn shutdown(mut self, timeout: Duration) -> Result<ShutdownReport> {
        let report = self.stop(timeout);
        match self.dispatcher_result() {
            Err(e) if !e.is_not_migrated() => Err(e),
            _ => Ok(report),
        }
    }

    /// Blocks until the relay stops on its own, which it does only on a fatal error (such
    /// as its table being dropped), then shuts the rest down and returns that error.
    pub fn join(mut self) -> Result<()> {
        let _ = self.dispatcher_done.recv();
        let timeout = self.shared.config.drain_timeout;
        self.stop(timeout);
        self.dispatcher_result()
    }

    fn dispatcher_result(&mut self) -> Result<()> {
        match self.dispatcher.take() {
            Some(handle) if handle.is_finished() => handle
                .join()
                .unwrap_or_else(|_| Err(Error::RelayDied("the dispatcher panicked".into()))),
            _ => Ok(()),
        }
    }

    fn stop(&mut self, timeout: Duration) -> ShutdownReport {
        let deadline = Instant::now() + timeout;
        let shared = &self.shared;
        if self.stop.take().is_none() {
            return self.report(0);
        }
        if let Ok(mut d) = shared.deadline.lock() {
            *d = Some(deadline);
        }
        shared.stopping.store(true, Ordering::SeqCst);
        log::info!("outbox {}: relay stopping", shared.config.outbox.table());
        wait(&self.dispatcher_done, deadline);

        // Claimed but not started: hand back at once.
        let mut queued = Vec::new();
        while let Ok(job) = self.work.try_recv() {
            queued.extend(job.records);
        }
        if let Some(outcomes) = &self.outcomes {
            release(shared, outcomes, queued);
        }
        wait(&self.workers_done, deadline);
        let abandoned = shared.publishing.load(Ordering::SeqCst);

        // The recorder ends once every outcome sender is gone; a stuck worker still holds
        // one, so it is also told to finish by the deadline.
        self.outcomes = None;
        wait(&self.recorder_done, deadline);
        wait(
            &self.listener_done,
            deadline.max(Instant::now() + Duration::from_secs(1)),
        );
        for handle in std::mem::take(&mut self.threads) {
            if handle.is_finished() {
                let _ = handle.join();
            }
        }
        let report = self.report(abandoned);
        log::info!(
            "outbox {}: relay stopped ({} published, {} released, {} abandoned)",
            shared.config.outbox.table(),
            report.published,
            report.released,
            report.abandoned
        );
        report
    }

    fn report(&self, abandoned: u64) -> ShutdownReport {
        ShutdownReport {
            published: self.shared.published.load(Ordering::SeqCst),
            released: self.shared.released.load(Ordering::SeqCst),
            abandoned,
        }
    }

    /// Claims one batch on the calling thread, publishes it with a fresh publisher from the
    /// factory and records the outcomes; returns how many rows it handled (sent, retried or
    /// dead). For cron jobs and tests; a running [`Relay`] needs no help.
    pub fn run_once(config: &RelayConfig) -> Result<usize> {
        config.validate()?;
        let mut publisher = (config.factory)().map_err(Error::Publisher)?;
        cycle(config, publisher.as_mut())
    }

    /// Runs claim, publish and record cycles on the calling thread, with one publisher,
    /// until no row is due; returns how many rows it handled. A row that fails is tried
    /// again once its backoff has passed, which may still be within this call.
    pub fn run_until_idle(config: &RelayConfig) -> Result<usize> {
        config.validate()?;
        let mut publisher = (config.factory)().map_err(Error::Publisher)?;
        let mut total = 0;
        loop {
            let n = cycle(config, publisher.as_mut())?;
            if n == 0 {
                return Ok(total);
            }
            total += n;
            if publisher.is_broken() {
                publisher = (config.factory)().map_err(Error::Publisher)?;
            }
        }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        let timeout = self.shared.config.drain_timeout;
        self.stop(timeout);
    }
}

/// One synchronous claim, publish and record.
fn cycle(config: &RelayConfig, publisher: &mut dyn Publisher) -> Result<usize> {
    let mut client = config.pool.get()?;
    let mut conn = Conn::uncached(&mut **client);
    let claimed_at = Instant::now();
    let records = store::claim(&mut conn, &config.outbox, config.batch_size, config.lease)?;
    if records.is_empty() {
        return Ok(0);
    }
    config.metrics.claimed(records.len());
    let outcomes = worker::attempt(config, publisher, &records, claimed_at);
    let pairs: Vec<_> = records.iter().zip(outcomes.iter()).collect();
    store::record(&mut conn, &config.outbox, &pairs)?;
    Ok(records.len())
}

/// Hands records back unpublished through the recorder.
fn release(shared: &Shared, outcomes: &Sender<Vec<(Record, Outcome)>>, records: Vec<Record>) {
    if records.is_empty() {
        return;
    }
    let n = records.len();
    shared.released.fetch_add(n as u64, Ordering::SeqCst);
    shared.config.metrics.released(n);
    log::debug!(
        "outbox {}: releasing {n} claimed rows",
        shared.config.outbox.table()
    );
    let _ = outcomes.send(records.into_iter().map(|r| (r, Outcome::Release)).collect());
}

/// Waits until every holder of the channel's sender has gone, or the deadline passes.
fn wait(done: &Receiver<()>, deadline: Instant) {
    loop {
        match done.recv_deadline(deadline) {
            Ok(()) => continue,
            Err(RecvTimeoutError::Disconnected) | Err(RecvTimeoutError::Timeout) => return,
        }
    }
}
