//! What can go wrong talking to RabbitMQ: the one error type of the `rabbitmq` module.

use std::fmt;

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
    Database(crate::error::Error),
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

impl From<crate::error::Error> for Error {
    fn from(e: crate::error::Error) -> Error {
        Error::Database(e)
    }
}
