//! The relay's settings.

use std::error::Error as StdError;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use postgres::tls::{MakeTlsConnect, TlsConnect};
use postgres::Socket;
use r2d2_postgres::PostgresConnectionManager;

use crate::error::{Error, Result};
use crate::metrics::{Metrics, NoMetrics};
use crate::outbox::{check_lease, check_retry, Outbox};
use crate::publish::Publisher;
use crate::relay::pool::Pool;
use crate::retry::RetryPolicy;

pub(crate) type BoxError = Box<dyn StdError + Send + Sync>;
pub(crate) type Factory = dyn Fn() -> Result<Box<dyn Publisher>, BoxError> + Send + Sync;
pub(crate) type Connect = dyn Fn() -> Result<postgres::Client, postgres::Error> + Send + Sync;

/// How a [`Relay`](crate::Relay) runs: which outbox, which pool, how to build publishers, and
/// its batching, leasing and retry settings. Consuming setters, like `r2d2::Builder`.
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
    pub(crate) pool: Arc<dyn Pool>,
    pub(crate) factory: Arc<Factory>,
    pub(crate) batch_size: usize,
    pub(crate) concurrency: usize,
    pub(crate) lease: Duration,
    pub(crate) poll_interval: Duration,
    pub(crate) drain_timeout: Duration,
    pub(crate) retry: RetryPolicy,
    pub(crate) notify: bool,
    pub(crate) metrics: Arc<dyn Metrics>,
    pub(crate) listener: Option<Arc<Connect>>,
}

impl fmt::Debug for RelayConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RelayConfig")
            .field("outbox", &self.outbox)
            .field("batch_size", &self.batch_size)
            .field("concurrency", &self.concurrency)
            .field("lease", &self.lease)
            .field("poll_interval", &self.poll_interval)
            .field("drain_timeout", &self.drain_timeout)
            .field("retry", &self.retry)
            .field("notify", &self.notify)
            .finish_non_exhaustive()
    }
}

impl RelayConfig {
    /// A relay for `outbox`, taking connections from `pool` and publishers from `factory`.
    ///
    /// Each worker calls `factory` for its own publisher, and again (with backoff) after its
    /// publisher breaks. Lease and retry settings start from the outbox's.
    pub fn new<T, F, P, E>(
        outbox: Outbox,
        pool: r2d2::Pool<PostgresConnectionManager<T>>,
        factory: F,
    ) -> RelayConfig
    where
        T: MakeTlsConnect<Socket> + Clone + Send + Sync + 'static,
        T::Stream: Send,
        T::TlsConnect: Send,
        <T::TlsConnect as TlsConnect<Socket>>::Future: Send,
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
            outbox,
            pool: Arc::new(pool),
            factory: Arc::new(factory),
            batch_size: 100,
            concurrency: 4,
            poll_interval: Duration::from_secs(2),
            drain_timeout: Duration::from_secs(10),
            notify: true,
            metrics: Arc::new(NoMetrics),
            listener: None,
        }
    }

    /// Rows claimed per statement (default 100). At most two batches are in the relay at once.
    pub fn batch_size(mut self, batch_size: usize) -> RelayConfig {
        self.batch_size = batch_size;
        self
    }

    /// Publishing workers, each with its own publisher (default 4).
    pub fn concurrency(mut self, concurrency: usize) -> RelayConfig {
        self.concurrency = concurrency;
        self
    }

    /// How long a claim holds its rows (default: the outbox's, 30 s). Time a record waits
    /// inside the relay counts against it; a record whose lease is nearly over is handed back
    /// rather than published.
    pub fn lease(mut self, lease: Duration) -> RelayConfig {
        self.lease = lease;
        self
    }

    /// How often to look for due rows without a notification (default 2 s): picks up delays,
    /// retries, expired leases and anything a lost notification missed.
    pub fn poll_interval(mut self, poll_interval: Duration) -> RelayConfig {
        self.poll_interval = poll_interval;
        self
    }

    /// How long dropping the relay waits for publishes under way (default 10 s);
    /// [`Relay::shutdown`](crate::Relay::shutdown) takes its own timeout.
    pub fn drain_timeout(mut self, drain_timeout: Duration) -> RelayConfig {
        self.drain_timeout = drain_timeout;
        self
    }

    /// Attempts before a row is dead-lettered, unless the message sets its own.
    pub fn max_attempts(mut self, max_attempts: u32) -> RelayConfig {
        self.retry.max_attempts = max_attempts;
        self
    }

    /// The first retry delay and the cap of the exponential backoff.
    pub fn backoff(mut self, min: Duration, max: Duration) -> RelayConfig {
        self.retry.backoff_min = min;
        self.retry.backoff_max = max;
        self
    }

    /// Whether to LISTEN for the outbox's notifications (default true). Turn it off behind a
    /// transaction-pooling proxy, where LISTEN does not work; the relay then only polls.
    pub fn notify(mut self, notify: bool) -> RelayConfig {
        self.notify = notify;
        self
    }

    /// LISTEN on a connection of its own, opened from `config` with `tls` and never part of
    /// the pool (recommended). Without it, the listener checks one connection out of the
    /// pool and keeps it for its whole life (an r2d2 pool cannot open a connection outside
    /// itself), UNLISTENing and draining it before handing it back.
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
        self.listener = Some(Arc::new(move || config.connect(tls.clone())));
        self
    }

    /// Where to report what the relay does.
    pub fn metrics(mut self, metrics: impl Metrics + 'static) -> RelayConfig {
        self.metrics = Arc::new(metrics);
        self
    }

    /// The pooled connections a running relay keeps: claiming, recording, and listening
    /// unless it has a connection of its own.
    pub(crate) fn connections_needed(&self) -> u32 {
        2 + u32::from(self.notify && self.listener.is_none())
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
