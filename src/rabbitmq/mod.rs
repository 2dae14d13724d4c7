//! RabbitMQ on both ends (feature `rabbitmq`): [`RabbitPublisher`] for the relay, and
//! [`Consumer`] to process deliveries exactly once in a PostgreSQL transaction.
//!
//! Built on amiquip, whose types never appear in this API; it has no reconnect of its own,
//! so a publisher that loses its connection reports itself broken and the relay builds a new
//! one, and the consumer reconnects with backoff.

mod connect;
mod consumer;
mod publisher;

use std::fmt;

pub use consumer::{Consumer, ConsumerConfig, ConsumerReport, Delivery};
pub use publisher::{RabbitPublisher, AGGREGATE_HEADER, ATTEMPT_HEADER, DEFAULT_MAX_MESSAGE_SIZE};

/// What can go wrong talking to RabbitMQ. Never contains the URL's password.
#[derive(Debug)]
#[non_exhaustive]
pub enum Error {
    /// The URL could not be used.
    InvalidUrl(String),
    /// An exchange or queue name the broker cannot carry.
    InvalidName(String),
    /// No connection could be made.
    Connect(String),
    /// The broker refused an operation or the connection failed mid-way.
    Protocol(String),
    /// The consumer's database work failed.
    Database(crate::Error),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::InvalidUrl(why) => write!(f, "invalid AMQP URL: {why}"),
            Error::InvalidName(why) => write!(f, "invalid name: {why}"),
            Error::Connect(why) => write!(f, "cannot connect to RabbitMQ: {why}"),
            Error::Protocol(why) => write!(f, "RabbitMQ: {why}"),
            Error::Database(e) => write!(f, "consumer database error: {e}"),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Database(e) => Some(e),
            _ => None,
        }
    }
}

impl From<crate::Error> for Error {
    fn from(e: crate::Error) -> Error {
        Error::Database(e)
    }
}
