//! The relay's settings.

use std::error::Error as StdError;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use postgres::tls::{MakeTlsConnect, TlsConnect};
use postgres::Socket;

use crate::error::{Error, Result};
use crate::producer::outbox::Outbox;
use crate::publish::metrics::{Guarded, Metrics, NoMetrics};
use crate::publish::publisher::Publisher;
use crate::runtime::pool::{connector, Connect, Connections, Source};
use crate::runtime::retry::{check_lease, check_retry, Retry};

pub(crate) type BoxError = Box<dyn StdError + Send + Sync>;
pub(crate) type Factory = dyn Fn() -> Result<Box<dyn Publisher>, BoxError> + Send + Sync;

/// The default [`RelayConfig::max_in_flight_bytes`]: 64 MiB.
pub const DEFAULT_MAX_IN_FLIGHT_BYTES: usize = 64 << 20;

/// How a [`Relay`](crate::Relay) runs: which outbox, where its connections come from, how to
/// build publishers, and its batching, leasing and retry settings. Consuming setters, like
/// `r2d2::Builder`.
///
/// ```no_run
/// use std::time::Duration;
/// use postgres_outbox::{publisher_fn, Outbox, RelayConfig};
/// use r2d2_postgres::{postgres::NoTls, PostgresConnectionManager};
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let manager = PostgresConnectionManager::new("postgres://postgres@localhost/app".parse()?, NoTls);
/// let pool = r2d2::Pool::new(manager)?;
/// let config = RelayConfig::new(Outbox::new("orders_outbox")?, pool, || {
///     Ok::<_, std::io::Error>(publisher_fn(|_record| Ok(())))
/// })
/// .batch_size(500)
/// .concurrency(4)
/// .lease(Duration::from_secs(30))
/// .poll_interval(Duration::from_secs(2));
/// # let _ = config;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct RelayConfig {
    pub(crate) outbox: Outbox,
    /// Where the workers' connections (and the listener's, unless `listener`) come from.
    pub(crate) source: Source,
    pub(crate) factory: Arc<Factory>,
    pub(crate) batch_size: usize,
    pub(crate) concurrency: usize,
    pub(crate) max_in_flight_bytes: usize,
    pub(crate) lease: Duration,
    pub(crate) poll_interval: Duration,
    pub(crate) drain_timeout: Duration,
    pub(crate) retry: Retry,
    pub(crate) park: bool,
    pub(crate) notify: bool,
    pub(crate) pipeline_runs: bool,
    pub(crate) metrics: Arc<dyn Metrics>,
    /// Where the listener's connection comes from, when not from `source`.
    pub(crate) listener: Option<Arc<Connect>>,
}

impl fmt::Debug for RelayConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RelayConfig")
            .field("outbox", &self.outbox)
            .field("batch_size", &self.batch_size)
            .field("concurrency", &self.concurrency)
            .field("max_in_flight_bytes", &self.max_in_flight_bytes)
            .field("lease", &self.lease)
            .field("poll_interval", &self.poll_interval)
            .field("drain_timeout", &self.drain_timeout)
            .field("retry", &self.retry)
            .field("park", &self.park)
            .field("notify", &self.notify)
            .field("pipeline_runs", &self.pipeline_runs)
            .finish_non_exhaustive()
    }
}

impl RelayConfig {
    /// A relay for `outbox`, taking its database connections from `connections` (an r2d2
    /// pool, or [`Connections::open`], recommended for production) and publishers from
    /// `factory`.
    ///
    /// Each worker keeps one connection, and so does the listener; from a pool, it must hold
    /// that many. Each worker calls `factory` for its own publisher, and again (with backoff)
    /// after its publisher breaks. Lease and retry settings start from the outbox's.
    pub fn new<C, F, P, E>(outbox: Outbox, connections: C, factory: F) -> RelayConfig
    where
        C: Into<Connections>,
        F: Fn() -> Result<P, E> + Send + Sync + 'static,
        P: Publisher + 'static,
        E: StdError + Send + Sync + 'static,
    {
        let factory = move || -> Result<Box<dyn Publisher>, BoxError> {
            factory()
                .map(|p| Box::new(p) as Box<dyn Publisher>)
                .map_err(|e| Box::new(e) as BoxError)
        };
        RelayConfig {
            lease: outbox.lease(),
            retry: outbox.retry(),
            park: outbox.parks(),
            outbox,
            source: connections.into().source,
            factory: Arc::new(factory),
            batch_size: 100,
            concurrency: 4,
            max_in_flight_bytes: DEFAULT_MAX_IN_FLIGHT_BYTES,
            poll_interval: Duration::from_secs(2),
            drain_timeout: Duration::from_secs(10),
            notify: true,
            pipeline_runs: false,
            metrics: Arc::new(Guarded(NoMetrics)),
            listener: None,
        }
    }

    /// Rows one worker claims at most per claim (default 100). A worker holds one batch at a
    /// time, from its claim until its outcomes are recorded, so the relay holds at most
    /// `concurrency x batch_size` rows.
    pub fn batch_size(mut self, batch_size: usize) -> RelayConfig {
        self.batch_size = batch_size;
        self
    }

    /// Workers (default 4). Each claims, publishes with a publisher of its own and records
    /// the outcomes, on a database connection of its own; a worker whose publisher is busy
    /// or stuck claims nothing more.
    ///
    /// Strictly ordered traffic concentrated in a few aggregates gains little from more
    /// workers: an aggregate's next batch waits until its last one is recorded, so one
    /// aggregate moves about as fast with one worker as with four (BENCHMARKS.md,
    /// "Relaying"); see also [`RelayConfig::pipeline_runs`].
    pub fn concurrency(mut self, concurrency: usize) -> RelayConfig {
        self.concurrency = concurrency;
        self
    }

    /// Payload bytes the relay holds at most between claim and recorded outcome (default
    /// 64 MiB), shared evenly by the workers. A row larger than a worker's share is claimed
    /// alone, so one huge message still moves; memory then peaks at one such row per worker.
    pub fn max_in_flight_bytes(mut self, bytes: usize) -> RelayConfig {
        self.max_in_flight_bytes = bytes;
        self
    }

    /// How long a claim holds its rows (default: the outbox's, 30 s). Time a record waits
    /// inside the relay counts against it; a record whose lease is nearly over is handed back
    /// rather than published.
    pub fn lease(mut self, lease: Duration) -> RelayConfig {
        // (The time a record waits for its predecessor's confirm counts against it too.)
        self.lease = lease;
        self
    }

    /// How often to look for due rows without a notification (default 2 s): picks up delays,
    /// retries, expired leases and anything a lost notification missed.
    pub fn poll_interval(mut self, poll_interval: Duration) -> RelayConfig {
        self.poll_interval = poll_interval;
        self
    }

    /// How long dropping the relay waits for publishes under way (default 10 s; any value,
    /// `Duration::MAX` included, means at most that long);
    /// [`Relay::shutdown`](crate::Relay::shutdown) takes its own timeout.
    pub fn drain_timeout(mut self, drain_timeout: Duration) -> RelayConfig {
        self.drain_timeout = drain_timeout;
        self
    }

    /// Attempts and backoff (default: the outbox's, see
    /// [`OutboxBuilder::retry`](crate::OutboxBuilder::retry)); a message may set its own
    /// attempt limit.
    pub fn retry(mut self, retry: Retry) -> RelayConfig {
        self.retry = retry;
        self
    }

    /// Whether a message that becomes a dead letter parks its aggregate (default: the
    /// outbox's, see [`OutboxBuilder::park_on_dead`](crate::OutboxBuilder::park_on_dead));
    /// a message may say otherwise with [`Message::park_on_dead`](crate::Message::park_on_dead).
    pub fn park_on_dead(mut self, park: bool) -> RelayConfig {
        self.park = park;
        self
    }

    /// Whether an aggregate's run goes to a publisher that [keeps
    /// order](crate::Publisher::keeps_order) in one call, its messages pipelined, instead of
    /// [in order](crate::Publisher::publish_in_order), one confirm at a time (default false).
    ///
    /// In order, message k + 1 of an aggregate is handed over only once message k is
    /// confirmed: order holds whatever fails, at one broker round trip per message of an
    /// aggregate (a busy aggregate moves as fast as the broker confirms one message at a
    /// time). Pipelined, the run goes out in order without waiting, so a busy aggregate
    /// moves faster (BENCHMARKS.md, "Relaying", has both), and **order holds
    /// unless a message of the run fails**: when message k is nacked, returned as
    /// unroutable, refused by the publisher or not confirmed (a lost connection), the later
    /// messages of its run may have reached the broker already. Each is recorded as the
    /// publisher reports it: those confirmed are sent, and k goes out again after them
    /// (retried, or handed back after an outage), or becomes a dead letter, which then
    /// holds back nothing that went out with it. Only then may a consumer see k after later
    /// messages of its aggregate. A publisher that does not keep order is published to in
    /// order whatever this says.
    pub fn pipeline_runs(mut self, pipeline: bool) -> RelayConfig {
        self.pipeline_runs = pipeline;
        self
    }

    /// Whether to LISTEN for the outbox's notifications (default true). Turn it off behind a
    /// transaction-pooling proxy, where LISTEN does not work; the relay then only polls.
    pub fn notify(mut self, notify: bool) -> RelayConfig {
        self.notify = notify;
        self
    }

    /// LISTEN on a connection of its own, opened from `config` with `tls` (with the
    /// liveness settings of [`Connections::open`]) and never part of
    /// the pool. Without it, the listener checks one connection out of
    /// the pool and keeps it for its whole life, UNLISTENing and draining it before
    /// handing it back.
    ///
    /// ```no_run
    /// # use postgres_outbox::{publisher_fn, Outbox, RelayConfig};
    /// # use r2d2_postgres::{postgres::NoTls, PostgresConnectionManager};
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let url = "postgres://postgres@localhost/app";
    /// let pool = r2d2::Pool::new(PostgresConnectionManager::new(url.parse()?, NoTls))?;
    /// let config = RelayConfig::new(Outbox::new("orders_outbox")?, pool, || {
    ///     Ok::<_, std::io::Error>(publisher_fn(|_record| Ok(())))
    /// })
    /// .listen_connection(url.parse()?, NoTls);
    /// # let _ = config;
    /// # Ok(())
    /// # }
    /// ```
    pub fn listen_connection<T>(mut self, config: postgres::Config, tls: T) -> RelayConfig
    where
        T: MakeTlsConnect<Socket> + Clone + Send + Sync + 'static,
        T::Stream: Send,
        T::TlsConnect: Send,
        <T::TlsConnect as TlsConnect<Socket>>::Future: Send,
    {
        self.listener = Some(connector(config, tls));
        self
    }

    /// Where to report what the relay does. A callback that panics is logged and ignored:
    /// metrics never stop the relay.
    pub fn metrics(mut self, metrics: impl Metrics + 'static) -> RelayConfig {
        self.metrics = Arc::new(Guarded(metrics));
        self
    }

    /// Where the workers' connections come from.
    pub(crate) fn worker_source(&self) -> Source {
        self.source.clone()
    }

    /// Where the listener's connection comes from.
    pub(crate) fn listener_source(&self) -> Source {
        match &self.listener {
            Some(connect) => Source::Own(connect.clone()),
            None => self.source.clone(),
        }
    }

    /// The pooled connections a running relay keeps: one per worker, and the listener's,
    /// unless they are opened outside the pool.
    pub(crate) fn connections_needed(&self) -> u32 {
        let workers = if self.source.is_pool() {
            u32::try_from(self.concurrency).unwrap_or(u32::MAX)
        } else {
            0
        };
        let listener = self.notify && self.listener_source().is_pool();
        workers.saturating_add(u32::from(listener))
    }

    /// Payload bytes one worker may claim at once.
    pub(crate) fn worker_bytes(&self) -> usize {
        (self.max_in_flight_bytes / self.concurrency.max(1)).max(1)
    }

    pub(crate) fn validate(&self) -> Result<()> {
        if self.batch_size == 0 || self.batch_size > 10_000 {
            return Err(Error::InvalidConfig(format!(
                "batch_size must be between 1 and 10000, got {}",
                self.batch_size
            )));
        }
        if self.concurrency == 0 || self.concurrency > 256 {
            return Err(Error::InvalidConfig(format!(
                "concurrency must be between 1 and 256, got {}",
                self.concurrency
            )));
        }
        if self.poll_interval < Duration::from_millis(10) {
            return Err(Error::InvalidConfig(format!(
                "poll_interval must be at least 10 ms, got {:?}",
                self.poll_interval
            )));
        }
        check_lease(self.lease)?;
        check_retry(&self.retry)
    }
}
