//! Consuming a queue with exactly-once effects: each delivery is handled inside a
//! PostgreSQL transaction together with `Outbox::dedupe` on its message id.
//!
//! One dispatcher thread owns the broker connection; `concurrency` worker threads run the
//! handler, each on its own database connection. Deliveries of one aggregate go to the
//! workers one at a time, in the order they arrived; the rest run in parallel.

mod dead_letter;
mod dispatch;
mod lanes;
mod worker;

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use amiquip::{AmqpValue, FieldTable};
use crossbeam_channel::{bounded, unbounded, Receiver, RecvTimeoutError, Sender};
use postgres::tls::{MakeTlsConnect, TlsConnect};
use postgres::{Socket, Transaction};

pub use dead_letter::{
    QueueType, DEAD_CONSUMER_HEADER, DEAD_EXPIRATION_HEADER, DEAD_FAILURES_HEADER,
    DEAD_QUEUE_HEADER, DEAD_REASON_HEADER, DEAD_USER_ID_HEADER,
};

use super::connect::{close_within, Endpoints};
use super::publisher::{AGGREGATE_HEADER, ATTEMPT_HEADER};
use super::Error;
use crate::message::MAX_SHORT_STRING;
use crate::outbox::{check_retry, Outbox};
use crate::pool::{connector, Connect, Connections, Source};
use crate::publish::HandlerError;
use crate::retry::Retry;
use dispatch::Dispatcher;
use worker::Worker;

/// A delivery as the handler sees it.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Delivery {
    /// The AMQP message id: the outbox key, deduplicated on.
    pub key: String,
    /// The exchange it was published to.
    pub exchange: String,
    /// The routing key (the outbox topic).
    pub routing_key: String,
    /// The body.
    pub body: Vec<u8>,
    /// The content type, if any.
    pub content_type: Option<String>,
    /// String-valued headers, sorted by name.
    pub headers: Vec<(String, String)>,
    /// The aggregate key (`x-outbox-aggregate-key`), if any: deliveries that share one are
    /// handled one at a time, in the order they arrived.
    pub aggregate_key: Option<String>,
    /// The outbox attempt that published it (`x-outbox-attempt`), if present.
    pub attempt: Option<u32>,
    /// True if the broker delivered it before.
    pub redelivered: bool,
}

impl Delivery {
    /// A delivery as the consumer would hand it to a handler, for a unit test of your own
    /// handler: a first delivery of `body` with message id `key`, routed by `routing_key`,
    /// with no exchange, content type, headers, aggregate key or attempt. Its fields are
    /// public, so a test sets what it needs:
    ///
    /// ```
    /// use postgres_outbox::rabbitmq::Delivery;
    /// let mut delivery = Delivery::new("order-7-paid", "order.paid", b"{}".to_vec());
    /// delivery.aggregate_key = Some("order-7".into());
    /// delivery.redelivered = true;
    /// # assert_eq!(delivery.key, "order-7-paid");
    /// ```
    pub fn new(key: impl Into<String>, routing_key: impl Into<String>, body: Vec<u8>) -> Delivery {
        Delivery {
            key: key.into(),
            exchange: String::new(),
            routing_key: routing_key.into(),
            body,
            content_type: None,
            headers: Vec::new(),
            aggregate_key: None,
            attempt: None,
            redelivered: false,
        }
    }
}

/// Observes a [`Consumer`]. Every method has a no-op default, so implement only what you
/// export. A callback that panics is logged and ignored. Called from the consumer's threads:
/// keep it quick.
///
/// ```
/// use std::sync::atomic::{AtomicU64, Ordering};
/// use std::time::Duration;
/// use postgres_outbox::rabbitmq::{ConsumerMetrics, Delivery};
///
/// #[derive(Default)]
/// struct Handled(AtomicU64);
///
/// impl ConsumerMetrics for Handled {
///     fn handled(&self, _delivery: &Delivery, _took: Duration) {
///         self.0.fetch_add(1, Ordering::Relaxed);
///     }
/// }
/// ```
pub trait ConsumerMetrics: Send + Sync {
    /// A delivery was handled, committed and acked; `took` is its transaction's time.
    fn handled(&self, _delivery: &Delivery, _took: Duration) {}
    /// A delivery had been processed before: acked and skipped.
    fn duplicate(&self, _delivery: &Delivery) {}
    /// The handler failed on a delivery (it is retried after a backoff, or dead-lettered).
    fn failed(&self, _delivery: &Delivery, _error: &HandlerError) {}
    /// The consumer gave up on a delivery: it went to the dead-letter queue, or was rejected
    /// to the queue's dead-letter exchange.
    fn dead_lettered(&self, _delivery: &Delivery) {}
    /// The database failed while handling a delivery, which is held and tried again.
    fn database_failed(&self, _error: &crate::Error) {}
}

struct NoConsumerMetrics;

impl ConsumerMetrics for NoConsumerMetrics {}

/// How a [`Consumer`] runs.
///
/// ```
/// use std::time::Duration;
/// use postgres_outbox::rabbitmq::ConsumerConfig;
/// let config = ConsumerConfig::new("amqp://guest:guest@localhost:5672", "invoices", "invoicing")
///     .concurrency(4)
///     .prefetch(32)
///     .max_attempts(5)
///     .backoff(Duration::from_secs(1), Duration::from_secs(60));
/// # let _ = config;
/// ```
#[derive(Clone)]
pub struct ConsumerConfig {
    url: String,
    /// Set by [`ConsumerConfig::endpoints`]; else parsed from `url` at spawn.
    endpoints: Option<Endpoints>,
    queue: String,
    name: String,
    prefetch: u16,
    concurrency: usize,
    retry: Retry,
    /// `None`: reject to the queue's own dead-letter exchange.
    dead_letter_queue: Option<String>,
    dead_letter_queue_type: QueueType,
    metrics: Arc<dyn ConsumerMetrics>,
    /// Where the handlers' connections come from, when not from the pool.
    own: Option<Arc<Connect>>,
    statement_timeout: Duration,
}

impl fmt::Debug for ConsumerConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConsumerConfig")
            .field("queue", &self.queue)
            .field("name", &self.name)
            .field("prefetch", &self.prefetch)
            .field("concurrency", &self.concurrency)
            .field("retry", &self.retry)
            .field("endpoints", &self.endpoints)
            .field("dead_letter_queue", &self.dead_letter_queue)
            .field("dead_letter_queue_type", &self.dead_letter_queue_type)
            .field("own_connections", &self.own.is_some())
            .field("statement_timeout", &self.statement_timeout)
            .finish_non_exhaustive()
    }
}

impl ConsumerConfig {
    /// Consume `queue` at `url` (several URLs, comma-separated, for the nodes of a cluster:
    /// see [`Endpoints`]); `name` identifies this consumer in the outbox's inbox table,
    /// so two services reading copies of one message each process it once. Every process
    /// consuming the same queue for the same purpose uses the same name: they share dedupe
    /// records and failure counts.
    pub fn new(url: &str, queue: &str, name: &str) -> ConsumerConfig {
        ConsumerConfig {
            url: url.to_owned(),
            endpoints: None,
            queue: queue.to_owned(),
            name: name.to_owned(),
            prefetch: 16,
            concurrency: 1,
            retry: Retry::new(5).backoff(Duration::from_secs(1), Duration::from_secs(60)),
            dead_letter_queue: Some(format!("{queue}.dead")),
            dead_letter_queue_type: QueueType::Classic,
            metrics: Arc::new(NoConsumerMetrics),
            own: None,
            statement_timeout: Duration::from_secs(30),
        }
    }

    /// The brokers to consume from, instead of the URL given to
    /// [`new`](ConsumerConfig::new): a list, or a shuffled order. After a lost connection
    /// the consumer reconnects (with its backoff) starting at the endpoint after the lost one.
    pub fn endpoints(mut self, endpoints: Endpoints) -> ConsumerConfig {
        self.endpoints = Some(endpoints);
        self
    }

    /// Opens the handlers' connections (one per handler thread) from `config` with `tls`,
    /// outside the pool, whatever [`Consumer::spawn`] is given.
    #[deprecated(
        since = "0.2.0",
        note = "hand `Connections::open(config, tls)` to `Consumer::spawn` instead of a pool"
    )]
    pub fn connections<T>(mut self, config: postgres::Config, tls: T) -> ConsumerConfig
    where
        T: MakeTlsConnect<Socket> + Clone + Send + Sync + 'static,
        T::Stream: Send,
        T::TlsConnect: Send,
        <T::TlsConnect as TlsConnect<Socket>>::Future: Send,
    {
        self.own = Some(connector(config, tls));
        self
    }

    /// The `statement_timeout` of the handlers' sessions (default 30 s; zero for none),
    /// the handler's own statements included: a statement stuck behind a lock, or a server
    /// that stopped answering, is cancelled and the delivery tried again, rather than
    /// holding its thread and its aggregate. A handler that needs longer can
    /// `SET LOCAL statement_timeout` in its transaction.
    pub fn statement_timeout(mut self, timeout: Duration) -> ConsumerConfig {
        self.statement_timeout = timeout;
        self
    }

    /// Where to report what the consumer does.
    pub fn metrics(mut self, metrics: impl ConsumerMetrics + 'static) -> ConsumerConfig {
        self.metrics = Arc::new(metrics);
        self
    }

    /// Deliveries the broker sends ahead of acknowledgement (default 16, at least 1). It
    /// bounds what the consumer holds: deliveries running, waiting behind an earlier one of
    /// their aggregate, or waiting out a retry's backoff. Give it a few per worker.
    pub fn prefetch(mut self, prefetch: u16) -> ConsumerConfig {
        self.prefetch = prefetch;
        self
    }

    /// Handler threads (default 1), each with its own transaction and database
    /// connection, so the pool needs at least this many connections. Deliveries of one
    /// aggregate are handled one at a time in order whatever this is; others in parallel.
    pub fn concurrency(mut self, workers: usize) -> ConsumerConfig {
        self.concurrency = workers;
        self
    }

    /// Attempts and backoff (default 5 attempts, 1 s doubling to 60 s), as the relay and
    /// `process` take them: after its last failed attempt, or at once on a permanent handler
    /// error, a message is dead-lettered. Failures are counted in the database, in
    /// `<table>_failures`, so the count survives restarts and is shared by every consumer
    /// with this name. While a message waits out its backoff, the later messages of its
    /// aggregate wait too; other messages go on.
    pub fn retry(mut self, retry: Retry) -> ConsumerConfig {
        self.retry = retry;
        self
    }

    /// Attempts before a message is dead-lettered (default 5): the attempt part of
    /// [`retry`](ConsumerConfig::retry).
    pub fn max_attempts(mut self, max_attempts: u32) -> ConsumerConfig {
        self.retry.max_attempts = max_attempts;
        self
    }

    /// The first retry's delay and the backoff's cap (default 1 s, 60 s): the backoff part
    /// of [`retry`](ConsumerConfig::retry).
    pub fn backoff(mut self, min: Duration, max: Duration) -> ConsumerConfig {
        self.retry = self.retry.backoff(min, max);
        self
    }

    /// Handler failures after which a message is dead-lettered (above `i32::MAX`, as good
    /// as never, as in 0.1).
    #[deprecated(
        since = "0.2.0",
        note = "use `max_attempts` (or `retry`): the same number"
    )]
    pub fn max_failures(self, max_failures: u32) -> ConsumerConfig {
        self.max_attempts(max_failures.min(i32::MAX as u32))
    }

    /// The wait before a failed message is handled again.
    #[deprecated(since = "0.2.0", note = "use `backoff` (or `retry`)")]
    pub fn retry_backoff(self, min: Duration, max: Duration) -> ConsumerConfig {
        self.backoff(min, max)
    }

    /// The queue dead letters are published to (default `<queue>.dead`), declared durable
    /// if it does not exist. Each carries the original body, properties and headers, plus
    /// [`DEAD_REASON_HEADER`], [`DEAD_FAILURES_HEADER`], [`DEAD_QUEUE_HEADER`] and
    /// [`DEAD_CONSUMER_HEADER`]; to redrive, move it back to the queue.
    pub fn dead_letter_queue(mut self, queue: &str) -> ConsumerConfig {
        self.dead_letter_queue = Some(queue.to_owned());
        self
    }

    /// The type the dead-letter queue is declared with when it does not exist yet (default
    /// [`QueueType::Classic`]). Consuming a quorum queue in a cluster, make it
    /// [`QueueType::Quorum`] too, so dead letters survive the loss of a node like the
    /// messages they come from. An existing queue is used as it is.
    pub fn dead_letter_queue_type(mut self, queue_type: QueueType) -> ConsumerConfig {
        self.dead_letter_queue_type = queue_type;
        self
    }

    /// Reject dead letters instead, for the queue's own dead-letter exchange
    /// (`x-dead-letter-exchange`) to route. The queue must have one: without it the broker
    /// drops a rejected message.
    pub fn dead_letter_exchange(mut self) -> ConsumerConfig {
        self.dead_letter_queue = None;
        self
    }

    fn check(&self) -> Result<(), Error> {
        let invalid = |why: String| Err(Error::InvalidName(why));
        for (what, value) in [("consumer name", &self.name), ("queue", &self.queue)] {
            if value.is_empty() || value.len() > MAX_SHORT_STRING {
                return invalid(format!(
                    "the {what} must be 1 to {MAX_SHORT_STRING} bytes, got {}",
                    value.len()
                ));
            }
            // The name is stored with every dedupe record and failure count: the database
            // cannot store a NUL, and a control character in it is always a mistake.
            if value.chars().any(char::is_control) {
                return invalid(format!(
                    "the {what} {value:?} holds a control character (a NUL, a tab, a newline)"
                ));
            }
        }
        if let Some(dead) = &self.dead_letter_queue {
            if dead.is_empty() || dead.len() > MAX_SHORT_STRING || *dead == self.queue {
                return invalid(format!(
                    "the dead-letter queue must be 1 to {MAX_SHORT_STRING} bytes and not the \
                     consumed queue, got {} bytes",
                    dead.len()
                ));
            }
        }
        let invalid = |why: &str| Err(Error::InvalidConfig(why.to_owned()));
        if self.prefetch == 0 {
            // 0 means "unlimited" to the broker: unbounded memory here.
            return invalid("prefetch must be at least 1");
        }
        if self.concurrency == 0 {
            return invalid("concurrency must be at least 1");
        }
        match check_retry(&self.retry) {
            Err(crate::Error::InvalidConfig(why)) => invalid(&why),
            other => other.map_err(Error::from),
        }
    }
}

/// What a [`Consumer`] did over its life.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConsumerReport {
    /// Handled and committed (and acked, unless the channel was lost first: the redelivery
    /// is then acked as a duplicate).
    pub processed: u64,
    /// Already processed before: acked and skipped.
    pub duplicates: u64,
    /// Handler failures retried after a backoff.
    pub retried: u64,
    /// Given up on: out of attempts, a permanent error, or no message id. Dead-lettered,
    /// never dropped.
    pub rejected: u64,
}

#[derive(Default)]
struct Counters {
    processed: AtomicU64,
    duplicates: AtomicU64,
    retried: AtomicU64,
    rejected: AtomicU64,
}

impl Counters {
    fn report(&self) -> ConsumerReport {
        ConsumerReport {
            processed: self.processed.load(Ordering::SeqCst),
            duplicates: self.duplicates.load(Ordering::SeqCst),
            retried: self.retried.load(Ordering::SeqCst),
            rejected: self.rejected.load(Ordering::SeqCst),
        }
    }
}

type Handler = dyn Fn(&mut Transaction<'_>, &Delivery) -> Result<(), HandlerError> + Send + Sync;

/// What the dispatcher and the workers share.
struct Shared {
    config: ConsumerConfig,
    outbox: Outbox,
    /// The handlers' connections: the pool's, or the consumer's own.
    source: Source,
    handler: Box<Handler>,
    counters: Counters,
    /// Set by shutdown: when what is held must be back in the queue.
    stop_by: Mutex<Option<Instant>>,
}

impl Shared {
    /// The shutdown's deadline; far away until shutdown sets one.
    fn stop_deadline(&self) -> Instant {
        self.stop_by
            .lock()
            .ok()
            .and_then(|d| *d)
            .unwrap_or_else(|| crate::clock::deadline(Duration::MAX))
    }

    /// Calls the metrics hook; a panic in it is logged and goes no further.
    fn observe(&self, f: impl FnOnce(&dyn ConsumerMetrics)) {
        let metrics = self.config.metrics.as_ref();
        crate::metrics::contained("ConsumerMetrics", || f(metrics));
    }
}

/// A running consumer: a thread on the broker and a pool of handler threads.
///
/// Each delivery runs the handler in a PostgreSQL transaction that also records the message
/// id with [`Outbox::dedupe`]; the delivery is acked only after that transaction commits. A
/// redelivery of a processed message is acked and skipped.
///
/// **Failures.** A handler error rolls back; the message's failure count goes up (in the
/// database, so restarts and other consumers of the queue see it) and it is handled again
/// after a capped, jittered backoff, held unacked meanwhile. After
/// [`max_attempts`](ConsumerConfig::max_attempts), or at once for a permanent error, it is
/// dead-lettered: published to the [dead-letter queue](ConsumerConfig::dead_letter_queue)
/// and confirmed before it is acked, or rejected to the queue's dead-letter exchange. A
/// message without a message id is dead-lettered unhandled.
///
/// **Outages.** Trouble with the database (no pooled connection, `BEGIN`, the dedupe write,
/// `COMMIT`, counting a failure, or the connection dying under the handler) is not the
/// message's fault: the delivery is held, unacked, and tried again with capped backoff until
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
///     tx.execute("INSERT INTO invoices (order_key) VALUES ($1)", &[&delivery.key])
///         .map_err(HandlerError::transient)?;
///     Ok(())
/// })?;
/// // ...
/// let report = consumer.shutdown(Duration::from_secs(10));
/// println!("{report:?}");
/// # Ok(())
/// # }
/// ```
pub struct Consumer {
    stop: Option<Sender<()>>,
    /// Disconnected once the dispatcher has ended: the broker connection is closed.
    dispatched: Receiver<()>,
    /// Disconnected once every thread of the consumer has ended.
    done: Receiver<()>,
    shared: Arc<Shared>,
}

impl fmt::Debug for Consumer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Consumer")
            .field("report", &self.shared.counters.report())
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
        let source = match &config.own {
            Some(connect) => Source::Own(connect.clone()),
            None => connections.into().source,
        };
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
            stop_by: Mutex::new(None),
        });
        let (stop_tx, stop_rx) = bounded::<()>(0);
        let (alive, done) = bounded::<()>(0);
        let (dispatching, dispatched) = bounded::<()>(0);
        let (tasks_tx, tasks_rx) = unbounded();
        let (results_tx, results_rx) = unbounded();
        let consumer = Consumer {
            stop: Some(stop_tx),
            dispatched,
            done,
            shared: shared.clone(),
        };
        for n in 0..shared.config.concurrency {
            let worker = Worker::new(shared.clone(), stop_rx.clone());
            let (tasks, results, alive) = (tasks_rx.clone(), results_tx.clone(), alive.clone());
            std::thread::Builder::new()
                .name(format!("outbox-handler-{n}"))
                .spawn(move || {
                    let _alive = alive;
                    worker.run(tasks, results);
                })
                // Dropping `consumer` stops the threads already started.
                .map_err(|e| Error::connect("cannot start a consumer thread", e))?;
        }
        drop(results_tx);
        let dispatcher = Dispatcher::new(shared, endpoints, tasks_tx, results_rx, stop_rx);
        std::thread::Builder::new()
            .name("outbox-consumer".into())
            .spawn(move || {
                let _alive = alive;
                let _dispatching = dispatching;
                dispatcher.run();
            })
            .map_err(|e| Error::connect("cannot start the consumer thread", e))?;
        Ok(consumer)
    }

    /// What the consumer has done so far.
    pub fn report(&self) -> ConsumerReport {
        self.shared.counters.report()
    }

    /// Stops taking deliveries and lets the ones being handled finish (commit and ack)
    /// within `timeout`, then closes the connection: deliveries received but not started,
    /// or waiting out a retry, go back to the queue. A handler still running at the
    /// timeout cannot be interrupted: the connection is closed anyway (within two seconds
    /// more), so everything else goes back on time; that handler finishes in the
    /// background, and its delivery comes again (acked as a duplicate if it committed).
    pub fn shutdown(mut self, timeout: Duration) -> ConsumerReport {
        self.stop(timeout);
        self.shared.counters.report()
    }

    fn stop(&mut self, timeout: Duration) {
        if self.stop.take().is_none() {
            return;
        }
        let deadline = crate::clock::deadline(timeout);
        if let Ok(mut stop_by) = self.shared.stop_by.lock() {
            *stop_by = Some(deadline);
        }
        // The dispatcher closes the connection by the deadline; closing takes at most two
        // seconds more.
        let closed = deadline + Duration::from_secs(3);
        for (threads, by) in [(&self.dispatched, closed), (&self.done, deadline)] {
            loop {
                match threads.recv_deadline(by) {
                    Ok(()) => continue,
                    Err(RecvTimeoutError::Disconnected) => break,
                    Err(RecvTimeoutError::Timeout) => {
                        log::warn!(
                            "rabbitmq consumer {}: a handler is still running at the shutdown \
                             timeout; it finishes in the background",
                            self.shared.config.name
                        );
                        return;
                    }
                }
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
    close_within(connection, Duration::from_secs(2));
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
    match conn.batch_execute(&outbox.statements().probe_consumer) {
        Ok(()) => Ok(()),
        Err(e) => match outbox.db_error(e) {
            e @ crate::Error::NotMigrated { .. } => Err(Error::Database(e)),
            e => {
                log::warn!("rabbitmq consumer: cannot check the tables: {e}");
                Ok(())
            }
        },
    }
}

fn as_i64(value: &AmqpValue) -> Option<i64> {
    match value {
        AmqpValue::ShortShortInt(v) => Some(i64::from(*v)),
        AmqpValue::ShortShortUInt(v) => Some(i64::from(*v)),
        AmqpValue::ShortInt(v) => Some(i64::from(*v)),
        AmqpValue::ShortUInt(v) => Some(i64::from(*v)),
        AmqpValue::LongInt(v) => Some(i64::from(*v)),
        AmqpValue::LongUInt(v) => Some(i64::from(*v)),
        AmqpValue::LongLongInt(v) => Some(*v),
        _ => None,
    }
}

/// The handler's view of a delivery; its body is moved out of `delivery`. The key is
/// empty when the message has no message id.
fn view(delivery: &mut amiquip::Delivery) -> Delivery {
    let key = delivery.properties.message_id().clone().unwrap_or_default();
    let empty = FieldTable::new();
    let table = delivery.properties.headers().as_ref().unwrap_or(&empty);
    let headers: Vec<(String, String)> = table
        .iter()
        .filter_map(|(k, v)| match v {
            AmqpValue::LongString(s) => Some((k.clone(), s.clone())),
            _ => None,
        })
        .collect();
    let aggregate_key = match table.get(AGGREGATE_HEADER) {
        Some(AmqpValue::LongString(s)) if !s.is_empty() => Some(s.clone()),
        _ => None,
    };
    let attempt = table
        .get(ATTEMPT_HEADER)
        .and_then(as_i64)
        .and_then(|n| u32::try_from(n).ok());
    Delivery {
        key,
        exchange: delivery.exchange.clone(),
        routing_key: delivery.routing_key.clone(),
        body: std::mem::take(&mut delivery.body),
        content_type: delivery.properties.content_type().clone(),
        headers,
        aggregate_key,
        attempt,
        redelivered: delivery.redelivered,
    }
}
