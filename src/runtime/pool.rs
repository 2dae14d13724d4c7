//! Database plumbing shared by the relay and the consumer: a pool with its TLS type erased,
//! connections opened outside it, and the long-lived sessions threads hold.

use std::ops::DerefMut;
use std::sync::Arc;
use std::time::Duration;

use postgres::config::TargetSessionAttrs;
use postgres::tls::{MakeTlsConnect, TlsConnect};
use postgres::{Client, Socket};
use r2d2_postgres::PostgresConnectionManager;

use crate::error::{Error, Result};

/// A checked-out connection.
pub(crate) type Pooled = Box<dyn DerefMut<Target = Client> + Send>;

/// Opens a connection outside any pool.
pub(crate) type Connect = dyn Fn() -> Result<Client, postgres::Error> + Send + Sync;

/// A pool of PostgreSQL connections, whatever its TLS connector.
pub(crate) trait Pool: Send + Sync {
    fn get(&self) -> Result<Pooled>;
    /// A connection within `timeout`, rather than the pool's own connection timeout.
    #[cfg(feature = "rabbitmq")]
    fn get_timeout(&self, timeout: Duration) -> Result<Pooled>;
    fn max_size(&self) -> u32;
    /// How long `get` waits for a connection at most.
    fn connection_timeout(&self) -> Duration;
}

impl<T> Pool for r2d2::Pool<PostgresConnectionManager<T>>
where
    T: MakeTlsConnect<Socket> + Clone + Send + Sync + 'static,
    T::Stream: Send,
    T::TlsConnect: Send,
    <T::TlsConnect as TlsConnect<Socket>>::Future: Send,
{
    fn get(&self) -> Result<Pooled> {
        Ok(Box::new(r2d2::Pool::get(self)?))
    }

    #[cfg(feature = "rabbitmq")]
    fn get_timeout(&self, timeout: Duration) -> Result<Pooled> {
        Ok(Box::new(r2d2::Pool::get_timeout(self, timeout)?))
    }

    fn max_size(&self) -> u32 {
        r2d2::Pool::max_size(self)
    }

    fn connection_timeout(&self) -> Duration {
        r2d2::Pool::connection_timeout(self)
    }
}

/// How long the kernel may wait on an unacknowledged send, or on an idle connection's
/// keepalive probes, before it declares the peer gone.
pub(crate) const TCP_DEAD_AFTER: Duration = Duration::from_secs(30);

/// How long a connection of our own may take to open, from the first host tried to the last:
/// the connect timeout bounds each TCP connect, not the start-up exchange after it.
const OPEN_BOUND: Duration = Duration::from_secs(15);

/// A connector for connections of our own, with the liveness settings a long-lived relay
/// connection needs unless the caller chose stricter ones: keepalive probes after 10 s idle,
/// every 5 s, three of them; `tcp_user_timeout` 30 s; a 10 s connect timeout; and, unless it
/// says otherwise, `target_session_attrs=read-write`. A peer that vanished (or a half-open
/// connection) is then noticed within about 30 s, and of several hosts the one taking writes
/// is used.
pub(crate) fn connector<T>(mut config: postgres::Config, tls: T) -> Arc<Connect>
where
    T: MakeTlsConnect<Socket> + Clone + Send + Sync + 'static,
    T::Stream: Send,
    T::TlsConnect: Send,
    <T::TlsConnect as TlsConnect<Socket>>::Future: Send,
{
    config.keepalives(true);
    if config.get_keepalives_idle() > Duration::from_secs(10) {
        config.keepalives_idle(Duration::from_secs(10));
    }
    if config
        .get_keepalives_interval()
        .is_none_or(|d| d > Duration::from_secs(5))
    {
        config.keepalives_interval(Duration::from_secs(5));
    }
    if config.get_keepalives_retries().is_none_or(|n| n > 3) {
        config.keepalives_retries(3);
    }
    if config
        .get_tcp_user_timeout()
        .is_none_or(|d| d.is_zero() || *d > TCP_DEAD_AFTER)
    {
        config.tcp_user_timeout(TCP_DEAD_AFTER);
    }
    if config.get_connect_timeout().is_none() {
        config.connect_timeout(Duration::from_secs(10));
    }
    // Every connection of ours writes: of several hosts, take one that takes writes (the
    // primary after a failover), rather than the first that answers.
    if config.get_target_session_attrs() == TargetSessionAttrs::Any {
        config.target_session_attrs(TargetSessionAttrs::ReadWrite);
    }
    Arc::new(move || config.connect(tls.clone()))
}

/// A connection opened outside the pool, handled as the pool's connections are.
pub(crate) struct Dedicated(pub(crate) Client);

impl std::ops::Deref for Dedicated {
    type Target = Client;

    fn deref(&self) -> &Client {
        &self.0
    }
}

impl DerefMut for Dedicated {
    fn deref_mut(&mut self) -> &mut Client {
        &mut self.0
    }
}

/// Where a [`Relay`](crate::Relay) or a `rabbitmq::Consumer` gets its database connections:
/// an r2d2 pool, or connections of its own. Either is handed over the same way, to
/// [`RelayConfig::new`](crate::RelayConfig::new) or `rabbitmq::Consumer::spawn`; a pool
/// converts by itself.
///
/// [`Connections::open`] is what production wants: each thread keeps a connection of its
/// own, opened with TCP keepalives (probes after 10 s idle, every 5 s, three of them),
/// `tcp_user_timeout` 30 s and a 10 s connect timeout unless the `Config` is stricter, so a
/// dead or half-open database connection is noticed within about 30 s and replaced. From
/// a pool, those TCP settings are whatever the pool's `Config` has, and the pool must hold
/// a connection for each thread that keeps one.
///
/// ```no_run
/// use postgres::NoTls;
/// use postgres_outbox::{publisher_fn, Connections, Outbox, RelayConfig};
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let connections = Connections::open("postgres://app@db/app".parse()?, NoTls);
/// let config = RelayConfig::new(Outbox::new("orders_outbox")?, connections, || {
///     Ok::<_, std::io::Error>(publisher_fn(|_record| Ok(())))
/// });
/// # let _ = config;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct Connections {
    pub(crate) source: Source,
}

impl Connections {
    /// Connections checked out of `pool` (and returned with their session settings reset).
    pub fn pool<T>(pool: r2d2::Pool<PostgresConnectionManager<T>>) -> Connections
    where
        T: MakeTlsConnect<Socket> + Clone + Send + Sync + 'static,
        T::Stream: Send,
        T::TlsConnect: Send,
        <T::TlsConnect as TlsConnect<Socket>>::Future: Send,
    {
        Connections {
            source: Source::Pool(Arc::new(pool)),
        }
    }

    /// Connections opened from `config` with `tls`, one per thread that needs one, outside
    /// any pool, with the liveness settings above.
    pub fn open<T>(config: postgres::Config, tls: T) -> Connections
    where
        T: MakeTlsConnect<Socket> + Clone + Send + Sync + 'static,
        T::Stream: Send,
        T::TlsConnect: Send,
        <T::TlsConnect as TlsConnect<Socket>>::Future: Send,
    {
        Connections {
            source: Source::Own(connector(config, tls)),
        }
    }
}

impl<T> From<r2d2::Pool<PostgresConnectionManager<T>>> for Connections
where
    T: MakeTlsConnect<Socket> + Clone + Send + Sync + 'static,
    T::Stream: Send,
    T::TlsConnect: Send,
    <T::TlsConnect as TlsConnect<Socket>>::Future: Send,
{
    fn from(pool: r2d2::Pool<PostgresConnectionManager<T>>) -> Connections {
        Connections::pool(pool)
    }
}

impl std::fmt::Debug for Connections {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.source {
            Source::Pool(pool) => write!(f, "Connections::pool(max_size {})", pool.max_size()),
            Source::Own(_) => f.write_str("Connections::open(..)"),
        }
    }
}

/// A connection that could not be opened: [`Error::ReadOnly`] when every host answered
/// but none takes writes (`target_session_attrs=read-write`, which connections of our own
/// ask for); otherwise the driver's error.
fn refused(e: postgres::Error) -> Error {
    // The driver says so only in its error's text.
    let read_only = std::error::Error::source(&e)
        .is_some_and(|source| source.to_string() == "database does not allow writes");
    if read_only {
        Error::ReadOnly
    } else {
        Error::Db(e)
    }
}

/// Where a session's connections come from.
#[derive(Clone)]
pub(crate) enum Source {
    Pool(Arc<dyn Pool>),
    Own(Arc<Connect>),
}

impl Source {
    pub(crate) fn connect(&self) -> Result<Pooled> {
        match self {
            Source::Pool(pool) => pool.get(),
            Source::Own(connect) => Ok(Box::new(Dedicated(connect().map_err(refused)?))),
        }
    }

    /// A connection within `timeout` at most, for the consumer's check at start-up.
    #[cfg(feature = "rabbitmq")]
    pub(crate) fn connect_within(&self, timeout: Duration) -> Result<Pooled> {
        match self {
            Source::Pool(pool) => pool.get_timeout(timeout),
            Source::Own(_) => self.connect(),
        }
    }

    pub(crate) fn is_pool(&self) -> bool {
        matches!(self, Source::Pool(_))
    }

    /// How long getting a connection may take before a caller gives it up: the pool's own
    /// timeout, or the time a connection of our own may take to open, and a margin.
    pub(crate) fn connect_bound(&self) -> Duration {
        let margin = Duration::from_secs(2);
        match self {
            Source::Pool(pool) => pool.connection_timeout() + margin,
            Source::Own(_) => OPEN_BOUND + margin,
        }
    }

    /// The pool's size, if the connections come from a pool.
    pub(crate) fn pool_size(&self) -> Option<u32> {
        match self {
            Source::Pool(pool) => Some(pool.max_size()),
            Source::Own(_) => None,
        }
    }
}
