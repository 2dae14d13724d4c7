//! Consuming a queue with exactly-once effects: each delivery is handled inside a
//! PostgreSQL transaction together with `Outbox::dedupe` on its message id.

use std::collections::HashMap;
use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use amiquip::{AmqpValue, Channel, ConsumerMessage, ConsumerOptions, FieldTable};
use crossbeam_channel::{after, bounded, select, Receiver, RecvTimeoutError, Sender};
use postgres::tls::{MakeTlsConnect, TlsConnect};
use postgres::{Socket, Transaction};
use r2d2_postgres::PostgresConnectionManager;

use super::connect::{close_within, Endpoint};
use super::publisher::ATTEMPT_HEADER;
use super::Error;
use crate::message::MAX_SHORT_STRING;
use crate::outbox::Outbox;
use crate::pool::Pool;
use crate::publish::HandlerError;
use crate::retry::reconnect_delay;

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
    /// The outbox attempt that published it (`x-outbox-attempt`), if present.
    pub attempt: Option<u32>,
    /// True if the broker delivered it before.
    pub redelivered: bool,
}

/// Observes a [`Consumer`]. Every method has a no-op default, so implement only what you
/// export. A callback that panics is logged and ignored. Called from the consumer's thread:
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
    /// The handler failed on a delivery (it is retried, or rejected when out of attempts).
    fn failed(&self, _delivery: &Delivery, _error: &HandlerError) {}
    /// A delivery was rejected without requeue: to the queue's dead-letter exchange, if any.
    fn dead_lettered(&self, _delivery: &Delivery) {}
    /// The database failed while handling a delivery, which is held and tried again.
    fn database_failed(&self, _error: &crate::Error) {}
}

struct NoConsumerMetrics;

impl ConsumerMetrics for NoConsumerMetrics {}

/// How a [`Consumer`] runs.
///
/// ```
/// use postgres_outbox::rabbitmq::ConsumerConfig;
/// let config = ConsumerConfig::new("amqp://guest:guest@localhost:5672", "invoices", "invoicing")
///     .prefetch(32)
///     .max_failures(5);
/// # let _ = config;
/// ```
#[derive(Clone)]
pub struct ConsumerConfig {
    url: String,
    queue: String,
    name: String,
    prefetch: u16,
    max_failures: u32,
    metrics: Arc<dyn ConsumerMetrics>,
}

impl fmt::Debug for ConsumerConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConsumerConfig")
            .field("queue", &self.queue)
            .field("name", &self.name)
            .field("prefetch", &self.prefetch)
            .field("max_failures", &self.max_failures)
            .finish_non_exhaustive()
    }
}

impl ConsumerConfig {
    /// Consume `queue` at `url`; `name` identifies this consumer in the outbox's inbox table,
    /// so two services reading copies of one message each process it once.
    pub fn new(url: &str, queue: &str, name: &str) -> ConsumerConfig {
        ConsumerConfig {
            url: url.to_owned(),
            queue: queue.to_owned(),
            name: name.to_owned(),
            prefetch: 16,
            max_failures: 5,
            metrics: Arc::new(NoConsumerMetrics),
        }
    }

    /// Where to report what the consumer does.
    pub fn metrics(mut self, metrics: impl ConsumerMetrics + 'static) -> ConsumerConfig {
        self.metrics = Arc::new(metrics);
        self
    }

    /// Deliveries the broker sends ahead of acknowledgement (default 16).
    pub fn prefetch(mut self, prefetch: u16) -> ConsumerConfig {
        self.prefetch = prefetch;
        self
    }

    /// Failed attempts after which a delivery is rejected without requeue (default 5): the
    /// broker then dead-letters it if the queue has a dead-letter exchange, or drops it. A
    /// permanent handler error rejects at once.
    pub fn max_failures(mut self, max_failures: u32) -> ConsumerConfig {
        self.max_failures = max_failures;
        self
    }
}

/// What a [`Consumer`] did over its life.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConsumerReport {
    /// Handled, committed and acked.
    pub processed: u64,
    /// Already processed before: acked and skipped.
    pub duplicates: u64,
    /// Handler failures sent back for redelivery.
    pub retried: u64,
    /// Rejected without requeue: out of attempts, permanent error, or no message id.
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

/// A running consumer: one thread, one channel, deliveries handled one at a time in order.
///
/// Each delivery runs the handler in a PostgreSQL transaction that also records the message
/// id with [`Outbox::dedupe`]; the delivery is acked only after that transaction commits. A
/// redelivery of a processed message is acked and skipped. A handler error rolls back and
/// the delivery is requeued, up to [`ConsumerConfig::max_failures`], then rejected.
///
/// Trouble with the database (no pooled connection, `BEGIN`, the dedupe write or `COMMIT`
/// failing for reasons of the server or the connection) is not the message's fault: the
/// delivery is held, unacked, and tried again with capped backoff until the database is
/// back. It never counts as a failure and never leads to a rejection.
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
/// let config = ConsumerConfig::new("amqp://guest:guest@localhost:5672", "invoices", "invoicing");
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
    done: Receiver<()>,
    thread: Option<JoinHandle<()>>,
    counters: Arc<Counters>,
}

impl fmt::Debug for Consumer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Consumer")
            .field("report", &self.counters.report())
            .finish_non_exhaustive()
    }
}

type Handler = dyn FnMut(&mut Transaction<'_>, &Delivery) -> Result<(), HandlerError> + Send;

struct Worker {
    config: ConsumerConfig,
    endpoint: Endpoint,
    outbox: Outbox,
    pool: Arc<dyn Pool>,
    handler: Box<Handler>,
    counters: Arc<Counters>,
    /// Failed attempts per message id, for deliveries still being retried.
    failures: HashMap<String, u32>,
    /// Disconnected when the consumer is told to stop.
    stop: Receiver<()>,
    /// How long the last committed transaction took.
    took: Duration,
}

/// Why one connection's consuming ended.
enum Ended {
    Stopped,
    Lost(String),
}

impl Consumer {
    /// Connects, starts consuming and returns; fails at once if the URL, the broker or the
    /// queue is wrong.
    pub fn spawn<T, F>(
        config: ConsumerConfig,
        outbox: Outbox,
        pool: r2d2::Pool<PostgresConnectionManager<T>>,
        handler: F,
    ) -> Result<Consumer, Error>
    where
        T: MakeTlsConnect<Socket> + Clone + Send + Sync + 'static,
        T::Stream: Send,
        T::TlsConnect: Send,
        <T::TlsConnect as TlsConnect<Socket>>::Future: Send,
        F: FnMut(&mut Transaction<'_>, &Delivery) -> Result<(), HandlerError> + Send + 'static,
    {
        if config.name.is_empty() || config.name.len() > MAX_SHORT_STRING {
            return Err(Error::InvalidName(format!(
                "the consumer name must be 1 to {MAX_SHORT_STRING} bytes, got {}",
                config.name.len()
            )));
        }
        if config.max_failures == 0 {
            return Err(Error::InvalidName("max_failures must be at least 1".into()));
        }
        let endpoint = Endpoint::parse(&config.url)?;
        // Fail fast on a wrong broker or queue; the thread opens its own connection.
        let connection = endpoint.open()?;
        let checked = check_queue(connection, &config.queue);
        checked?;
        let counters = Arc::new(Counters::default());
        let (stop_tx, stop_rx) = bounded::<()>(0);
        let mut worker = Worker {
            config,
            endpoint,
            outbox,
            pool: Arc::new(pool),
            handler: Box::new(handler),
            counters: counters.clone(),
            failures: HashMap::new(),
            stop: stop_rx,
            took: Duration::ZERO,
        };
        let (alive, done) = bounded::<()>(0);
        let thread = std::thread::Builder::new()
            .name("outbox-consumer".into())
            .spawn(move || {
                let _alive = alive;
                worker.run();
            })
            .map_err(|e| Error::connect("cannot start the consumer thread", e))?;
        Ok(Consumer {
            stop: Some(stop_tx),
            done,
            thread: Some(thread),
            counters,
        })
    }

    /// What the consumer has done so far.
    pub fn report(&self) -> ConsumerReport {
        self.counters.report()
    }

    /// Stops taking deliveries, lets the delivery being handled finish (commit and ack)
    /// within `timeout`, and closes; deliveries received but not started go back to the
    /// queue when the channel closes.
    pub fn shutdown(mut self, timeout: Duration) -> ConsumerReport {
        self.stop(timeout);
        self.counters.report()
    }

    fn stop(&mut self, timeout: Duration) {
        if self.stop.take().is_none() {
            return;
        }
        let deadline = crate::clock::deadline(timeout);
        loop {
            match self.done.recv_deadline(deadline) {
                Ok(()) => continue,
                Err(RecvTimeoutError::Disconnected) => break,
                Err(RecvTimeoutError::Timeout) => {
                    log::warn!("rabbitmq consumer: handler still running at shutdown timeout");
                    return;
                }
            }
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for Consumer {
    fn drop(&mut self) {
        self.stop(Duration::from_secs(10));
    }
}

fn check_queue(mut connection: amiquip::Connection, queue: &str) -> Result<(), Error> {
    let result = connection
        .open_channel(None)
        .and_then(|channel| channel.queue_declare_passive(queue).map(|_| ()))
        .map_err(|e| Error::broker(format!("queue {queue:?} is not usable"), e));
    close_within(connection, Duration::from_secs(2));
    result
}

impl Worker {
    fn run(&mut self) {
        let stop = self.stop.clone();
        let stop = &stop;
        let mut failures = 0u32;
        loop {
            match self.consume(stop) {
                Ended::Stopped => return,
                Ended::Lost(why) => {
                    failures += 1;
                    let pause = reconnect_delay(failures);
                    log::warn!("rabbitmq consumer: {why}; reconnecting in {pause:?}");
                    select! {
                        recv(stop) -> _ => return,
                        recv(after(pause)) -> _ => {}
                    }
                }
            }
        }
    }

    /// Consumes on one connection until told to stop or the connection fails.
    fn consume(&mut self, stop: &Receiver<()>) -> Ended {
        let mut connection = match self.endpoint.open() {
            Ok(c) => c,
            Err(e) => return Ended::Lost(e.to_string()),
        };
        let ended = match connection.open_channel(None) {
            Ok(channel) => self.consume_channel(&channel, stop),
            Err(e) => Ended::Lost(format!("cannot open a channel: {e}")),
        };
        // Closing the connection hands deliveries received but not acked back to the queue.
        close_within(connection, Duration::from_secs(2));
        ended
    }

    fn consume_channel(&mut self, channel: &Channel, stop: &Receiver<()>) -> Ended {
        if let Err(e) = channel.qos(0, self.config.prefetch, false) {
            return Ended::Lost(format!("cannot set prefetch: {e}"));
        }
        let queue = match channel.queue_declare_passive(self.config.queue.as_str()) {
            Ok(q) => q,
            Err(e) => return Ended::Lost(format!("queue {:?}: {e}", self.config.queue)),
        };
        let consumer = match queue.consume(ConsumerOptions::default()) {
            Ok(c) => c,
            Err(e) => return Ended::Lost(format!("cannot consume: {e}")),
        };
        log::info!(
            "rabbitmq consumer {}: consuming {}",
            self.config.name,
            self.config.queue
        );
        loop {
            select! {
                recv(stop) -> _ => {
                    let _ = consumer.cancel();
                    return Ended::Stopped;
                }
                recv(consumer.receiver()) -> message => match message {
                    Ok(ConsumerMessage::Delivery(delivery)) => {
                        if let Err(e) = self.handle(channel, delivery) {
                            return Ended::Lost(e);
                        }
                    }
                    Ok(other) => return Ended::Lost(format!("consumer ended: {other:?}")),
                    Err(_) => return Ended::Lost("consumer channel closed".into()),
                },
            }
        }
    }

    /// Handles one delivery; an error means the channel is unusable.
    fn handle(&mut self, channel: &Channel, delivery: amiquip::Delivery) -> Result<(), String> {
        let view = match view(&delivery) {
            Some(view) => view,
            None => {
                log::error!(
                    "rabbitmq consumer {}: delivery without a message id; rejecting it",
                    self.config.name
                );
                self.counters.rejected.fetch_add(1, Ordering::SeqCst);
                return delivery.reject(channel, false).map_err(|e| e.to_string());
            }
        };
        let outcome = match self.handle_through_outages(&view) {
            Some(outcome) => outcome,
            // Stopping while the database is away: the delivery goes back to the queue
            // unacked when the channel closes, uncounted.
            None => return Ok(()),
        };
        match outcome {
            Ok(true) => {
                self.failures.remove(&view.key);
                self.counters.processed.fetch_add(1, Ordering::SeqCst);
                let took = self.took;
                self.observe(|m| m.handled(&view, took));
                delivery.ack(channel).map_err(|e| e.to_string())
            }
            Ok(false) => {
                log::debug!(
                    "rabbitmq consumer {}: duplicate {}",
                    self.config.name,
                    view.key
                );
                self.counters.duplicates.fetch_add(1, Ordering::SeqCst);
                self.observe(|m| m.duplicate(&view));
                delivery.ack(channel).map_err(|e| e.to_string())
            }
            Err(error) => {
                self.observe(|m| m.failed(&view, &error));
                let count = self.failures.entry(view.key.clone()).or_insert(0);
                *count = (*count + 1).max(delivery_count(&delivery));
                if error.is_permanent() || *count >= self.config.max_failures {
                    log::error!(
                        "rabbitmq consumer {}: rejecting {} after {} failures: {error}",
                        self.config.name,
                        view.key,
                        count
                    );
                    self.failures.remove(&view.key);
                    self.counters.rejected.fetch_add(1, Ordering::SeqCst);
                    self.observe(|m| m.dead_lettered(&view));
                    delivery.reject(channel, false).map_err(|e| e.to_string())
                } else {
                    log::warn!(
                        "rabbitmq consumer {}: handler failed on {} (failure {count}): {error}",
                        self.config.name,
                        view.key
                    );
                    self.counters.retried.fetch_add(1, Ordering::SeqCst);
                    delivery.nack(channel, true).map_err(|e| e.to_string())
                }
            }
        }
    }

    /// Runs the delivery until its outcome says something about the message: committed, a
    /// duplicate, or a handler failure. While the database is the trouble (no pooled
    /// connection, `BEGIN`, the dedupe write or `COMMIT` failing for reasons of the server or
    /// the connection), the delivery is held, unacked and uncounted, and tried again with
    /// capped backoff: an outage never costs a message one of its attempts, let alone a
    /// rejection. `None` when told to stop meanwhile.
    fn handle_through_outages(
        &mut self,
        delivery: &Delivery,
    ) -> Option<Result<bool, HandlerError>> {
        let mut outages = 0u32;
        loop {
            match self.run_handler(delivery) {
                Ok(handled) => return Some(Ok(handled)),
                Err(Failure::Handler(error)) => return Some(Err(error)),
                Err(Failure::Database(error)) => {
                    self.observe(|m| m.database_failed(&error));
                    outages += 1;
                    let pause = reconnect_delay(outages);
                    log::warn!(
                        "rabbitmq consumer {}: the database failed while handling {} (not \
                         counted as a failure); trying again in {pause:?}: {error}",
                        self.config.name,
                        delivery.key
                    );
                    select! {
                        recv(self.stop) -> _ => return None,
                        recv(after(pause)) -> _ => {}
                    }
                }
            }
        }
    }

    /// Runs dedupe and the handler in one transaction. Ok(true): committed; Ok(false): a
    /// duplicate; Err: rolled back, with whose fault it was.
    fn run_handler(&mut self, delivery: &Delivery) -> Result<bool, Failure> {
        let started = Instant::now();
        let mut conn = self.pool.get().map_err(Failure::Database)?;
        let mut tx = conn.transaction().map_err(Failure::db)?;
        let fresh = self
            .outbox
            .dedupe(&mut tx, &self.config.name, &delivery.key)
            .map_err(Failure::classify)?;
        if !fresh {
            return Ok(false);
        }
        let handler = &mut self.handler;
        catch_unwind(AssertUnwindSafe(|| handler(&mut tx, delivery)))
            .unwrap_or_else(|_| Err(HandlerError::transient("handler panicked")))
            .map_err(Failure::Handler)?;
        tx.commit().map_err(Failure::db)?;
        self.took = started.elapsed();
        Ok(true)
    }

    /// Calls the metrics hook; a panic in it is logged and goes no further.
    fn observe(&self, f: impl FnOnce(&dyn ConsumerMetrics)) {
        let metrics = self.config.metrics.as_ref();
        if catch_unwind(AssertUnwindSafe(|| f(metrics))).is_err() {
            log::error!(
                "rabbitmq consumer {}: a ConsumerMetrics callback panicked; ignoring it",
                self.config.name
            );
        }
    }
}

/// Why a delivery's transaction did not commit.
enum Failure {
    /// The handler failed (or panicked), or the database refused the handler's data: the
    /// message's fault, counted towards its failures.
    Handler(HandlerError),
    /// The database or the way to it: nobody's fault, never counted.
    Database(crate::Error),
}

impl Failure {
    fn db(error: postgres::Error) -> Failure {
        Failure::classify(crate::Error::Db(error))
    }

    /// A server error about the data (a deferred constraint at `COMMIT`, a key the dedupe
    /// index cannot hold) is the message's fault; anything about the server or the
    /// connection is not.
    fn classify(error: crate::Error) -> Failure {
        if crate::store::is_infrastructure(&error) {
            Failure::Database(error)
        } else {
            Failure::Handler(HandlerError::transient(error))
        }
    }
}

/// The broker's own count of earlier deliveries, where it keeps one (quorum queues).
fn delivery_count(delivery: &amiquip::Delivery) -> u32 {
    let count = delivery
        .properties
        .headers()
        .as_ref()
        .and_then(|h| h.get("x-delivery-count"))
        .and_then(as_i64)
        .unwrap_or(0);
    u32::try_from(count).unwrap_or(0)
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

fn view(delivery: &amiquip::Delivery) -> Option<Delivery> {
    let key = delivery
        .properties
        .message_id()
        .clone()
        .filter(|k| !k.is_empty())?;
    let empty = FieldTable::new();
    let table = delivery.properties.headers().as_ref().unwrap_or(&empty);
    let headers = table
        .iter()
        .filter_map(|(k, v)| match v {
            AmqpValue::LongString(s) => Some((k.clone(), s.clone())),
            _ => None,
        })
        .collect();
    let attempt = table
        .get(ATTEMPT_HEADER)
        .and_then(as_i64)
        .and_then(|n| u32::try_from(n).ok());
    Some(Delivery {
        key,
        exchange: delivery.exchange.clone(),
        routing_key: delivery.routing_key.clone(),
        body: delivery.body.clone(),
        content_type: delivery.properties.content_type().clone(),
        headers,
        attempt,
        redelivered: delivery.redelivered,
    })
}
