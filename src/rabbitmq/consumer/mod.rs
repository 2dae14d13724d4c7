//! Consuming a queue with exactly-once effects: each delivery is handled inside a
//! PostgreSQL transaction together with `Outbox::dedupe` on its message id.
//!
//! One dispatcher thread owns the broker connection; `concurrency` worker threads run the
//! handler, each on its own database connection. Deliveries of one aggregate go to the
//! workers one at a time, in the order they arrived; the rest run in parallel.

mod blocks;
mod config;
mod dead_letter;
mod delivery;
mod dispatch;
#[cfg(feature = "metrics")]
mod facade;
mod lanes;
mod metrics;
mod shared;
mod sql;
mod succession;
mod worker;

use std::fmt;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crossbeam_channel::unbounded;
use postgres::Transaction;

pub use config::ConsumerConfig;
pub use dead_letter::{
    QueueType, DEAD_CONSUMER_HEADER, DEAD_EXPIRATION_HEADER, DEAD_FAILURES_HEADER,
    DEAD_QUEUE_HEADER, DEAD_REASON_HEADER, DEAD_USER_ID_HEADER,
};
pub use delivery::{Delivery, SequenceGap};
#[cfg(feature = "metrics")]
pub use facade::QueueMetrics;
pub use metrics::ConsumerMetrics;

use super::connect::{close_within, Endpoints};
use super::error::Error;
use crate::producer::outbox::Outbox;
use crate::publish::publisher::HandlerError;
use crate::runtime::lifecycle::{StopSignal, Threads};
use crate::runtime::pool::Connections;
use dispatch::Dispatcher;
use shared::{Counters, Shared, FATAL_GRACE};
use worker::Worker;

/// What a [`Consumer`] did over its life.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConsumerReport {
    /// Handled and committed (and acked, unless the channel was lost first: the redelivery
    /// is then acked as a duplicate).
    pub processed: u64,
    /// Already processed before (or dead-lettered before, the original's ack lost): acked
    /// and skipped.
    pub duplicates: u64,
    /// Handler failures retried after a backoff.
    pub retried: u64,
    /// Given up on: out of attempts, a permanent error, or no message id. Dead-lettered,
    /// never dropped.
    pub rejected: u64,
}

impl ConsumerReport {
    fn of(counters: &Counters) -> ConsumerReport {
        ConsumerReport {
            processed: counters.processed.load(Ordering::SeqCst),
            duplicates: counters.duplicates.load(Ordering::SeqCst),
            retried: counters.retried.load(Ordering::SeqCst),
            rejected: counters.rejected.load(Ordering::SeqCst),
        }
    }
}

/// A running consumer: a thread on the broker and a pool of handler threads.
///
/// Each delivery runs the handler in a PostgreSQL transaction that also records the message
/// id with [`Outbox::dedupe`]; the delivery is acked only after that transaction commits. A
/// redelivery of a processed message is acked and skipped.
///
/// **Failures.** A handler error rolls back (so does a handler that ignored a failed
/// statement and returned `Ok`: its transaction is aborted, which the consumer finds before
/// `COMMIT`); the message's failure count goes up (in the
/// database, so restarts and other consumers of the queue see it) and it is handled again
/// after a capped, jittered backoff, held unacked meanwhile. After
/// its [`retry`](ConsumerConfig::retry)'s attempts, or at once for a permanent error, it is
/// dead-lettered: published to the [dead-letter queue](ConsumerConfig::dead_letter_queue)
/// and confirmed before it is acked, or rejected to the queue's dead-letter exchange. A
/// message without a message id is dead-lettered unhandled.
///
/// **Outages.** Trouble with the database (no pooled connection, `BEGIN`, the dedupe write,
/// `COMMIT`, counting a failure, the connection dying under the handler, or a handler error
/// caused by a database fault of that kind: a timeout, a deadlock, a revoked grant) is not
/// the message's fault: the delivery is held, unacked, and tried again with capped backoff until
/// the database is back. It never counts as a failure and never leads to a dead letter. A
/// lost broker connection is reopened with backoff; what was held goes back to the queue.
///
/// **Order.** Deliveries with the same aggregate key are handled one at a time in the
/// order they arrived, whatever the prefetch and concurrency: while one is running or
/// waiting out a retry, the later ones wait behind it (and hold prefetch slots). Once it
/// commits or is dead-lettered the next one starts. Order across consumers of one queue is
/// the broker's: use one consumer per queue (or a single active consumer) for ordered
/// traffic.
///
/// ```no_run
/// use std::time::Duration;
/// use postgres_outbox::rabbitmq::{Consumer, ConsumerConfig};
/// use postgres_outbox::{HandlerError, Outbox};
/// use r2d2_postgres::{postgres::NoTls, PostgresConnectionManager};
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let pool = r2d2::Pool::new(PostgresConnectionManager::new(
///     "postgres://postgres@localhost/app".parse()?,
///     NoTls,
/// ))?;
/// let config = ConsumerConfig::new("amqp://guest:guest@localhost:5672", "invoices", "invoicing")
///     .concurrency(4);
/// let consumer = Consumer::spawn(config, Outbox::new("orders_outbox")?, pool, |tx, delivery| {
///     // `?` on every statement: never ignore an error and return Ok.
///     tx.execute("INSERT INTO invoices (order_key) VALUES ($1)", &[&delivery.key])
///         .map_err(HandlerError::transient)?;
///     Ok(())
/// })?;
/// // ...
/// let report = consumer.shutdown(Duration::from_secs(10))?;
/// println!("{report:?}");
/// # Ok(())
/// # }
/// ```
pub struct Consumer {
    shared: Arc<Shared>,
    /// Once it has ended, the broker connection is closed.
    dispatcher: Threads,
    handlers: Threads,
    /// Its threads have been waited for (by `shutdown`, `join` or `Drop`).
    stopped: bool,
}

impl fmt::Debug for Consumer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Consumer")
            .field("report", &self.report())
            .finish_non_exhaustive()
    }
}

impl Consumer {
    /// Checks the settings, connects, declares the dead-letter queue if needed, starts
    /// consuming and returns. Each handler thread keeps a database connection from
    /// `connections`: an r2d2 pool (holding at least `concurrency`), or
    /// [`Connections::open`], as the relay takes them: with TCP keepalives and
    /// `tcp_user_timeout`, a dead or half-open connection is noticed within about 30 s and
    /// the deliveries it held are handled on a new one. Fails at once on bad settings, a
    /// wrong URL, broker or queue, a pool smaller than `concurrency`, or an outbox not
    /// migrated to this version (when the database answers; if it does not, the consumer
    /// starts and waits for it).
    pub fn spawn<C, F>(
        config: ConsumerConfig,
        outbox: Outbox,
        connections: C,
        handler: F,
    ) -> Result<Consumer, Error>
    where
        C: Into<Connections>,
        F: Fn(&mut Transaction<'_>, &Delivery) -> Result<(), HandlerError> + Send + Sync + 'static,
    {
        config.check()?;
        let source = connections.into().source;
        if let Some(size) = source.pool_size() {
            if (size as usize) < config.concurrency {
                return Err(Error::InvalidConfig(format!(
                    "concurrency {} needs a pool of at least as many connections; it has {size}",
                    config.concurrency,
                )));
            }
        }
        let endpoints = match &config.endpoints {
            Some(endpoints) => endpoints.clone(),
            None => Endpoints::parse(&config.url)?,
        };
        // Fail fast on a wrong broker or queue; the dispatcher opens its own connection.
        check_broker(endpoints.open()?.0, &config)?;
        // A database that is down now must not hold the start up for the pool's timeout.
        let mut probe = source.connect_within(Duration::from_secs(5));
        check_tables(
            probe
                .as_deref_mut()
                .map(|c| &mut **c)
                .map_err(|e| e.to_string()),
            &outbox,
        )?;
        drop(probe);
        let shared = Arc::new(Shared {
            config,
            outbox,
            source,
            handler: Box::new(handler),
            counters: Counters::default(),
            stop: StopSignal::new(),
            fatal: Mutex::new(None),
        });
        // Declared before the channels, so a failed start drops it after them: the handlers
        // already started find no more tasks and end, and its `Drop` waits for them.
        let consumer = Consumer {
            shared: shared.clone(),
            dispatcher: Threads::new(),
            handlers: Threads::new(),
            stopped: false,
        };
        let (tasks_tx, tasks_rx) = unbounded();
        let (results_tx, results_rx) = unbounded();
        for n in 0..shared.config.concurrency {
            let worker = Worker::new(shared.clone(), &format!("handler-{n}"));
            let (tasks, results) = (tasks_rx.clone(), results_tx.clone());
            consumer
                .handlers
                .spawn(&format!("handler-{n}"), move || worker.run(tasks, results))
                .map_err(|e| Error::connect("cannot start a consumer thread", e))?;
        }
        drop(results_tx);
        let dispatcher = Dispatcher::new(shared, endpoints, tasks_tx, results_rx);
        consumer
            .dispatcher
            .spawn("consumer", move || dispatcher.run())
            .map_err(|e| Error::connect("cannot start the consumer thread", e))?;
        Ok(consumer)
    }

    /// What the consumer has done so far, as [`Relay::report`](crate::Relay::report) says
    /// it of a relay.
    pub fn report(&self) -> ConsumerReport {
        ConsumerReport::of(&self.shared.counters)
    }

    /// Whether the consumer has stopped (or is stopping): told to by `shutdown`, or on its
    /// own, because it cannot go on (see [`join`](Consumer::join)).
    pub fn has_stopped(&self) -> bool {
        self.shared.stop.is_sent()
    }

    /// Stops taking deliveries and lets the ones being handled finish (commit and ack)
    /// within `timeout`, then closes the connection: deliveries received but not started,
    /// or waiting out a retry, go back to the queue. A handler still running at the
    /// timeout cannot be interrupted: the connection is closed anyway (within a few seconds
    /// more, cut if the broker does not answer), so everything else goes back on time; that handler finishes in the
    /// background, and its delivery comes again (acked as a duplicate if it committed).
    ///
    /// Returns what the consumer did, or, as [`Relay::shutdown`](crate::Relay::shutdown)
    /// does, the error that had stopped it on its own (see [`join`](Consumer::join)), if one
    /// had.
    pub fn shutdown(mut self, timeout: Duration) -> Result<ConsumerReport, Error> {
        self.stop(timeout);
        match self.shared.take_fatal() {
            Some(e) => Err(e),
            None => Ok(self.report()),
        }
    }

    /// Blocks until the consumer stops on its own, then waits for its threads and returns
    /// why. It stops on its own only when it cannot go on: its tables were dropped
    /// ([`Error::Database`] holding [`NotMigrated`](crate::Error::NotMigrated)). Outages of
    /// the broker or the database never stop it; it waits them out. What runs gets ten
    /// seconds to finish; what is held goes back to the queue.
    pub fn join(self) -> Result<(), Error> {
        self.shared.stop.wait();
        self.shutdown(FATAL_GRACE).map(drop)
    }

    fn stop(&mut self, timeout: Duration) {
        // A stop before (the consumer's own, or `shutdown` before `Drop`) set the deadline
        // that stands.
        self.shared
            .stop
            .send_by(crate::runtime::clock::deadline(timeout));
        if std::mem::replace(&mut self.stopped, true) {
            return;
        }
        let deadline = self.shared.stop_deadline();
        // The dispatcher closes the connection by the deadline; each call on the broker at
        // a stop (the cancel, the close) is cut after two seconds, and a cut one ends at once.
        let closed = deadline + Duration::from_secs(5);
        for (threads, by, what) in [
            (
                &mut self.dispatcher,
                closed,
                "its broker connection is still closing",
            ),
            (&mut self.handlers, deadline, "a handler is still running"),
        ] {
            if !threads.wait(by) {
                log::warn!(
                    "rabbitmq consumer {}: {what} at the shutdown timeout; it finishes in \
                     the background",
                    self.shared.config.name
                );
                return;
            }
        }
    }
}

impl Drop for Consumer {
    fn drop(&mut self) {
        self.stop(Duration::from_secs(10));
    }
}

/// The queue must exist; the dead-letter queue is declared if it does not.
fn check_broker(mut connection: amiquip::Connection, config: &ConsumerConfig) -> Result<(), Error> {
    let queue = &config.queue;
    let mut result = connection
        .open_channel(None)
        .and_then(|channel| channel.queue_declare_passive(queue.as_str()).map(|_| ()))
        .map_err(|e| Error::broker(format!("queue {queue:?} is not usable"), e));
    if let (Ok(()), Some(dead)) = (&result, &config.dead_letter_queue) {
        result = dead_letter::ensure_queue(&mut connection, dead, config.dead_letter_queue_type)
            .map_err(|e| Error::broker(format!("cannot declare dead-letter queue {dead:?}"), e));
    }
    close_within(connection, None, Duration::from_secs(2));
    result
}

/// The consumer's tables must exist, if the database can say so now.
fn check_tables(conn: Result<&mut postgres::Client, String>, outbox: &Outbox) -> Result<(), Error> {
    let conn = match conn {
        Ok(conn) => conn,
        Err(e) => {
            log::warn!("rabbitmq consumer: no database connection to check the tables: {e}");
            return Ok(());
        }
    };
    match conn.batch_execute(&outbox.statements::<sql::ConsumerSql>().probe_consumer) {
        Ok(()) => Ok(()),
        Err(e) => match outbox.db_error(e) {
            e @ crate::error::Error::NotMigrated { .. } => Err(Error::Database(e)),
            e => {
                log::warn!("rabbitmq consumer: cannot check the tables: {e}");
                Ok(())
            }
        },
    }
}
