//! The relay: independent workers that each claim a batch, publish it and record the
//! outcomes, and a listener that wakes them.
//!
//! ```text
//!  listener ──wake──▶ worker × concurrency
//!  (LISTEN)           claim ─▶ publish in order ─▶ record (fenced), on its own
//!                     connection, with its own publisher
//! ```
//!
//! A worker holds one batch from claim to recorded outcome, so flow control is end to end:
//! a relay whose workers are all busy (or stuck) claims nothing, and what it holds is bounded
//! in rows (`concurrency x batch_size`) and bytes (`max_in_flight_bytes`). Several workers
//! overlap one another's database and broker waits, which is what a pipeline between
//! dedicated threads bought before, without the queues between them.

mod config;
mod health;
mod listener;
pub(crate) mod process;
mod report;
mod shared;
pub(crate) mod sql;
pub(crate) mod store;
mod waiting;
mod worker;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{at, select};
use rand::Rng;

pub use config::{RelayConfig, DEFAULT_MAX_IN_FLIGHT_BYTES};

use crate::error::{Error, Result};
use crate::runtime::clock;
use crate::runtime::lifecycle::Threads;
use crate::runtime::retry::reconnect_delay;
use crate::runtime::session::{sql_setup, Session};
use shared::{Shared, Wake};
use sql::RelaySql;
use worker::{Alone, Cycle, Worker};

/// Panics in a row, with no cycle finishing in between, after which a worker gives up and
/// stops the relay with an error rather than spin.
const MAX_PANICS_IN_A_ROW: u32 = 5;

/// What a relay did: so far ([`Relay::report`]), or over its life ([`Relay::shutdown`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ShutdownReport {
    /// Records published and recorded as sent over the relay's life.
    pub published: u64,
    /// Claimed records handed back unpublished, at no attempt's cost.
    pub released: u64,
    /// Claimed records whose outcome was not recorded when the timeout ran out (their
    /// worker was still inside a publisher, or still writing). Their outcome is unknown:
    /// their leases will expire and another relay will publish them again. Zero until the
    /// relay is shut down.
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
    workers: Threads,
    listener: Threads,
}

impl std::fmt::Debug for Relay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay")
            .field("outbox", &self.shared.config.outbox)
            .field("listening", &self.is_listening())
            .finish_non_exhaustive()
    }
}

impl Relay {
    /// Starts the relay's threads and returns at once.
    ///
    /// Fails if the configuration is invalid, the pool is too small for the relay's own
    /// connections (one per worker, and the listener's, unless
    /// [`Connections::open`](crate::Connections::open) opens them outside the pool), or the outbox table has
    /// not been migrated.
    pub fn spawn(config: RelayConfig) -> Result<Relay> {
        config.validate()?;
        let needed = config.connections_needed();
        match config.source.pool_size() {
            Some(size) if size < needed => {
                return Err(Error::InvalidConfig(format!(
                    "the pool holds {size} connections; the relay keeps {needed} checked out \
                     (one per worker and the listener's), or open them outside it with \
                     Connections::open"
                )));
            }
            Some(size) if size == needed => log::warn!(
                "outbox {}: the pool holds {size} connections and the relay keeps all of them \
                 checked out: anything else getting a connection from it waits for ever. Give \
                 the relay a pool (or Connections::open) of its own, or a larger one",
                config.outbox.table()
            ),
            _ => {}
        }
        let outbox = config.outbox.clone();
        let bound = worker::statement_bound(config.lease);
        let name = format!("{} start", outbox.table());
        let metrics = config.metrics.clone();
        let setup = sql_setup(String::new());
        Session::new(config.worker_source(), setup, "", bound, &name, metrics)
            .run(move |conn| store::probe(conn, &outbox))?;

        let shared = Arc::new(Shared::new(config));
        let config = &shared.config;
        // Dropping `relay` stops the threads already started.
        let relay = Relay {
            shared: shared.clone(),
            workers: Threads::new(),
            listener: Threads::new(),
        };
        let failed = |e| Error::RelayDied(format!("could not start a thread: {e}"));
        if config.notify {
            let shared = shared.clone();
            relay
                .listener
                .spawn("listener", move || listener::run(&shared))
                .map_err(failed)?;
        }
        for i in 0..config.concurrency {
            let shared = shared.clone();
            let name = format!("worker-{i}");
            relay
                .workers
                .spawn(&name.clone(), move || run_worker(&shared, &name))
                .map_err(failed)?;
        }
        log::info!(
            "outbox {}: relay started (batch {}, concurrency {}, notify {})",
            config.outbox.table(),
            config.batch_size,
            config.concurrency,
            config.notify
        );
        Ok(relay)
    }

    /// True while the listener holds a live LISTEN connection. Always false with
    /// `notify(false)`; false while the listener reconnects.
    pub fn is_listening(&self) -> bool {
        self.shared.listening.load(Ordering::SeqCst)
    }

    /// What the relay has done so far, as `rabbitmq::Consumer::report` says it of a
    /// consumer.
    ///
    /// ```no_run
    /// # use postgres_outbox::{publisher_fn, Connections, Outbox, Relay, RelayConfig};
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let connections = Connections::open("postgres://postgres@localhost/app".parse()?, postgres::NoTls);
    /// # let factory = || Ok::<_, std::io::Error>(publisher_fn(|_record| Ok(())));
    /// let relay = Relay::spawn(RelayConfig::new(Outbox::new("orders_outbox")?, connections, factory))?;
    /// println!("{} published so far", relay.report().published);
    /// let report = relay.shutdown(std::time::Duration::from_secs(10))?;
    /// # let _ = report;
    /// # Ok(())
    /// # }
    /// ```
    pub fn report(&self) -> ShutdownReport {
        self.counted(0)
    }

    /// True once the relay has stopped on its own (see [`Relay::join`]): a caller that
    /// waits for something else, such as a signal, can poll it.
    pub fn has_stopped(&self) -> bool {
        self.shared.stopping()
    }

    /// Stops the relay: no more claims; claimed rows not yet handed to a publisher are
    /// released at no attempt's cost (the publisher is asked before it hands
    /// anything more over; idle workers hold none); publishes under way get until
    /// `timeout` (any duration; `Duration::MAX` waits as long as it takes) to finish and be
    /// recorded; then every thread is joined.
    ///
    /// A publisher still running at the timeout cannot be interrupted: its worker's batch is
    /// counted in [`ShutdownReport::abandoned`], its leases will expire, and its thread is
    /// left to end when the publisher returns (recording what it can).
    ///
    /// Returns the error that stopped the relay on its own, if one did (a panic it could
    /// not contain, say); a dropped table only ends the relay and is not an error here.
    pub fn shutdown(mut self, timeout: Duration) -> Result<ShutdownReport> {
        let report = self.stop(timeout);
        match self.shared.take_fatal() {
            Some(e) if !e.is_not_migrated() => Err(e),
            _ => Ok(report),
        }
    }

    /// Blocks until the relay stops on its own, which it does only on a fatal error (its
    /// table was dropped, or a worker kept panicking), then shuts the rest down and returns
    /// that error.
    pub fn join(mut self) -> Result<()> {
        self.shared.stop.wait();
        let timeout = self.shared.config.drain_timeout;
        self.stop(timeout);
        match self.shared.take_fatal() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    fn stop(&mut self, timeout: Duration) -> ShutdownReport {
        let deadline = clock::deadline(timeout);
        let shared = &self.shared;
        // Stopped before: `shutdown` or `join`, then `Drop`.
        if !shared.stop.send_by(deadline) {
            return self.counted(0);
        }
        log::info!("outbox {}: relay stopping", shared.config.outbox.table());
        self.workers.wait(deadline);
        let abandoned = shared.holding.load(Ordering::SeqCst);
        self.listener
            .wait(deadline.max(clock::deadline(Duration::from_secs(1))));
        let report = self.counted(abandoned);
        log::info!(
            "outbox {}: relay stopped ({} published, {} released, {} abandoned)",
            shared.config.outbox.table(),
            report.published,
            report.released,
            report.abandoned
        );
        report
    }

    fn counted(&self, abandoned: u64) -> ShutdownReport {
        ShutdownReport {
            published: self.shared.published.load(Ordering::SeqCst),
            released: self.shared.released.load(Ordering::SeqCst),
            abandoned,
        }
    }

    /// Claims one batch on the calling thread, publishes it with a fresh publisher from the
    /// factory and records the outcomes; returns how many rows it handled (sent, retried,
    /// dead or handed back). For cron jobs and tests; a running [`Relay`] needs no help.
    pub fn run_once(config: &RelayConfig) -> Result<usize> {
        config.validate()?;
        let publisher = (config.factory)().map_err(Error::Publisher)?;
        let mut worker = Worker::new(config, Some(publisher), "run_once");
        once(&mut worker)
    }

    /// Runs claim, publish and record cycles on the calling thread, with one publisher,
    /// until no row is due; returns how many rows it handled. A row that fails is tried
    /// again once its backoff has passed, which may still be within this call.
    pub fn run_until_idle(config: &RelayConfig) -> Result<usize> {
        config.validate()?;
        let publisher = (config.factory)().map_err(Error::Publisher)?;
        let mut worker = Worker::new(config, Some(publisher), "run_until_idle");
        let mut total = 0;
        loop {
            match once(&mut worker)? {
                0 => return Ok(total),
                n => total += n,
            }
        }
    }
}

/// One cycle for a lone caller: trouble that a running relay would wait out is an error here.
fn once(worker: &mut Worker<'_>) -> Result<usize> {
    match worker.cycle(&Alone)? {
        Cycle::Idle => Ok(0),
        Cycle::Worked(n) => Ok(n),
        Cycle::Pause(_, cause) => Err(cause),
        // A lone caller's publisher is never held back by others: no relay-wide state.
        Cycle::Wait(_) => Ok(0),
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        let timeout = self.shared.config.drain_timeout;
        self.stop(timeout);
    }
}

/// A worker thread: cycles until the relay stops. Between cycles it waits for a wake-up, its
/// poll (jittered, so relays started together drift apart) or a pause to pass. A panic that
/// escapes a cycle is contained: the worker starts over with a fresh connection and
/// publisher, and only after several in a row stops the relay with an error.
fn run_worker(shared: &Shared, name: &str) {
    let config = &shared.config;
    let mut worker = Worker::new(config, None, name);
    shared.report.worker_started();
    work(shared, &mut worker);
    let in_time = !shared.stop.past_deadline();
    shared
        .report
        .worker_stopping(&mut worker, config.outbox.statements::<RelaySql>(), in_time);
}

/// The worker's cycles, until the relay stops (or this worker stops it).
fn work(shared: &Shared, worker: &mut Worker) {
    let config = &shared.config;
    let table = config.outbox.table();
    let mut panics = 0u32;
    let sql: &RelaySql = config.outbox.statements();
    while !shared.stopping() {
        let next = match catch_unwind(AssertUnwindSafe(|| worker.cycle(shared))) {
            Ok(Ok(cycle)) => {
                panics = 0;
                cycle
            }
            Ok(Err(e)) => {
                log::error!("outbox {table}: relay stopping: {e}");
                shared.stop_relay(e);
                return;
            }
            Err(panic) => {
                panics += 1;
                let what = panic_message(panic.as_ref());
                if panics >= MAX_PANICS_IN_A_ROW {
                    log::error!("outbox {table}: a worker panicked {panics} times in a row ({what}); relay stopping");
                    shared.stop_relay(Error::RelayDied(format!(
                        "a worker panicked {panics} times in a row: {what}"
                    )));
                    return;
                }
                log::error!("outbox {table}: a worker panicked ({what}); starting it again");
                worker.recover();
                Cycle::Pause(
                    reconnect_delay(panics),
                    Error::RelayDied(format!("a worker panicked: {what}")),
                )
            }
        };
        // After the cycle, never between a wake-up and its claim: the report must not delay
        // a notified row.
        shared.report_if_due(worker, sql);
        // A pause or a wait for the publisher's destination is sat out whole: wake-ups
        // (other workers', producers' notifications) must not hurry a worker back to a
        // database or a broker that is in trouble.
        let next = match next {
            Cycle::Idle => match worker.get_ready(shared) {
                Some((pause, cause)) => Cycle::Pause(pause, cause),
                None => Cycle::Idle,
            },
            next => next,
        };
        let until = match next {
            Cycle::Worked(_) => continue,
            Cycle::Pause(pause, _) => clock::deadline(pause),
            Cycle::Wait(until) => until,
            Cycle::Idle => {
                if config.notify
                    && !shared.stopping()
                    && shared.waiting.going_idle(sql, &mut |sql, relay| {
                        worker.execute(sql, vec![Box::new(relay.to_owned())])
                    })
                {
                    continue;
                }
                let poll = config
                    .poll_interval
                    .mul_f64(rand::thread_rng().gen_range(0.5..=1.0));
                let poll_at = clock::deadline(poll);
                let _idle = shared.waiting.idle();
                // Woken for the report too, so a relay idle longer than it (a long poll
                // interval) still says it runs. An idle worker's claims have just worked, so
                // a due report is written and the next one is later.
                loop {
                    select! {
                        recv(shared.stop.receiver()) -> _ => break,
                        recv(shared.wake) -> wake => {
                            if wake == Ok(Wake::Notified) {
                                worker.notified();
                            }
                            break;
                        },
                        recv(at(poll_at.min(shared.report.next_due()))) -> _ => {
                            if Instant::now() >= poll_at {
                                break;
                            }
                            shared.report_if_due(worker, sql);
                        },
                    }
                }
                continue;
            }
        };
        select! {
            recv(shared.stop.receiver()) -> _ => {},
            recv(at(until)) -> _ => {},
        }
    }
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "no message".to_owned())
}
