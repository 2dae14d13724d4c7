//! How a consumer runs.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use super::dead_letter::QueueType;
use super::metrics::{ConsumerMetrics, NoConsumerMetrics};
use crate::producer::message::MAX_SHORT_STRING;
use crate::rabbitmq::connect::Endpoints;
use crate::rabbitmq::error::Error;
use crate::runtime::retry::check_retry;
use crate::runtime::retry::Retry;

/// How a [`Consumer`](crate::rabbitmq::Consumer) runs.
///
/// ```
/// use std::time::Duration;
/// use postgres_outbox::rabbitmq::ConsumerConfig;
/// use postgres_outbox::Retry;
/// let config = ConsumerConfig::new("amqp://guest:guest@localhost:5672", "invoices", "invoicing")
///     .concurrency(4)
///     .prefetch(32)
///     .retry(Retry::new(5).backoff(Duration::from_secs(1), Duration::from_secs(60)));
/// # let _ = config;
/// ```
#[derive(Clone)]
pub struct ConsumerConfig {
    pub(super) url: String,
    /// Set by [`ConsumerConfig::endpoints`]; else parsed from `url` at spawn.
    pub(super) endpoints: Option<Endpoints>,
    pub(super) queue: String,
    pub(super) name: String,
    pub(super) prefetch: u16,
    pub(super) concurrency: usize,
    pub(super) retry: Retry,
    /// `None`: reject to the queue's own dead-letter exchange.
    pub(super) dead_letter_queue: Option<String>,
    pub(super) dead_letter_queue_type: QueueType,
    pub(super) metrics: Arc<dyn ConsumerMetrics>,
    pub(super) statement_timeout: Duration,
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

    /// The queue dead letters are published to (default `<queue>.dead`), declared durable
    /// if it does not exist. Each carries the original body, properties and headers, plus
    /// [`DEAD_REASON_HEADER`], [`DEAD_FAILURES_HEADER`], [`DEAD_QUEUE_HEADER`] and
    /// [`DEAD_CONSUMER_HEADER`]; to redrive, move it back to the queue.
    ///
    /// [`DEAD_REASON_HEADER`]: super::DEAD_REASON_HEADER
    /// [`DEAD_FAILURES_HEADER`]: super::DEAD_FAILURES_HEADER
    /// [`DEAD_QUEUE_HEADER`]: super::DEAD_QUEUE_HEADER
    /// [`DEAD_CONSUMER_HEADER`]: super::DEAD_CONSUMER_HEADER
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

    pub(super) fn check(&self) -> Result<(), Error> {
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
            Err(crate::error::Error::InvalidConfig(why)) => invalid(&why),
            other => other.map_err(Error::from),
        }
    }
}
