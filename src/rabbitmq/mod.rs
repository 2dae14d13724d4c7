//! RabbitMQ on both ends (feature `rabbitmq`): [`RabbitPublisher`] for the relay, and
//! [`Consumer`] to process deliveries exactly once in a PostgreSQL transaction.
//!
//! Built on amiquip, whose types never appear in this API; it has no reconnect of its own,
//! so a publisher that loses its connection reports itself broken and the relay builds a new
//! one, and the consumer reconnects with backoff. Both take one broker URL or several
//! ([`Endpoints`]) and fail over between them.

mod connect;
mod consumer;
mod publisher;

use std::fmt;

pub use connect::Endpoints;
pub use consumer::{
    Consumer, ConsumerConfig, ConsumerMetrics, ConsumerReport, Delivery, QueueType,
    DEAD_CONSUMER_HEADER, DEAD_EXPIRATION_HEADER, DEAD_FAILURES_HEADER, DEAD_QUEUE_HEADER,
    DEAD_REASON_HEADER, DEAD_USER_ID_HEADER,
};
pub use publisher::{RabbitPublisher, AGGREGATE_HEADER, ATTEMPT_HEADER, DEFAULT_MAX_MESSAGE_SIZE};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What can go wrong talking to RabbitMQ, by what failed: the settings, the connection, the
/// broker, or the consumer's database. The cause (an I/O, TLS, AMQP or database error) is kept
/// and returned by `source()`; `Display` shows it too, for logs. Never contains the URL's
/// password.
#[derive(Debug)]
#[non_exhaustive]
pub enum Error {
    /// The URL could not be used.
    InvalidUrl(String),
    /// A name or setting the broker cannot carry, or that cannot work.
    InvalidName(String),
    /// A setting that cannot work (a prefetch, a concurrency the pool cannot serve, a retry
    /// policy); the text names the setting.
    InvalidConfig(String),
    /// No connection could be made.
    Connect {
        /// What was being done, and with which host (never the password).
        what: String,
        /// The I/O, TLS or AMQP error behind it, if there was one.
        source: Option<BoxError>,
    },
    /// The broker refused an operation, or the connection failed mid-way.
    Broker {
        /// What was being done.
        what: String,
        /// The AMQP error behind it.
        source: Option<BoxError>,
    },
    /// The consumer's database work failed.
    Database(crate::Error),
}

impl Error {
    pub(crate) fn connect(what: impl Into<String>, source: impl Into<BoxError>) -> Error {
        Error::Connect {
            what: what.into(),
            source: Some(source.into()),
        }
    }

    pub(crate) fn broker(what: impl Into<String>, source: impl Into<BoxError>) -> Error {
        Error::Broker {
            what: what.into(),
            source: Some(source.into()),
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let cause = |f: &mut fmt::Formatter<'_>, source: &Option<BoxError>| match source {
            Some(source) => write!(f, ": {source}"),
            None => Ok(()),
        };
        match self {
            Error::InvalidUrl(why) => write!(f, "invalid AMQP URL: {why}"),
            Error::InvalidName(why) => write!(f, "invalid name: {why}"),
            Error::InvalidConfig(why) => write!(f, "invalid configuration: {why}"),
            Error::Connect { what, source } => {
                write!(f, "cannot connect to RabbitMQ: {what}")?;
                cause(f, source)
            }
            Error::Broker { what, source } => {
                write!(f, "RabbitMQ: {what}")?;
                cause(f, source)
            }
            Error::Database(e) => write!(f, "consumer database error: {e}"),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Database(e) => Some(e),
            Error::Connect { source, .. } | Error::Broker { source, .. } => source
                .as_ref()
                .map(|e| e.as_ref() as &(dyn std::error::Error + 'static)),
            _ => None,
        }
    }
}

impl From<crate::Error> for Error {
    fn from(e: crate::Error) -> Error {
        Error::Database(e)
    }
}
