//! A `RabbitPublisher`'s settings, kept apart from its connection, so a relay's factory can
//! build as many publishers as it needs from one value: `move || config.connect()`.

use std::time::Duration;

use super::connect::Endpoints;
use super::error::Error;

/// RabbitMQ's default `max_message_size` (128 MiB); a larger body makes it close the channel.
pub const DEFAULT_MAX_MESSAGE_SIZE: usize = 128 << 20;

/// Where and how [`RabbitPublisher`]s publish: the endpoints, the exchange and the
/// publisher's settings, the one place to set them. `Clone`, so a relay's publisher factory
/// is `move || config.connect()`, and a publisher built again after a lost connection gets
/// the same settings. [`RabbitPublisher::connect`] is the shorthand for the defaults.
///
/// [`RabbitPublisher`]: crate::rabbitmq::RabbitPublisher
/// [`RabbitPublisher::connect`]: crate::rabbitmq::RabbitPublisher::connect
///
/// ```no_run
/// use std::time::Duration;
/// use postgres_outbox::rabbitmq::{Endpoints, PublisherConfig};
/// use postgres_outbox::{Outbox, RelayConfig};
/// use r2d2_postgres::{postgres::NoTls, PostgresConnectionManager};
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let pool = r2d2::Pool::new(PostgresConnectionManager::new(
///     "postgres://postgres@localhost/app".parse()?,
///     NoTls,
/// ))?;
/// let publishing = PublisherConfig::new("amqp://guest:guest@localhost:5672", "events")?
///     .confirm_timeout(Duration::from_secs(5));
/// publishing.connect()?.close(); // fail fast on a wrong broker or exchange
/// let config = RelayConfig::new(Outbox::new("orders_outbox")?, pool, move || publishing.connect());
///
/// // A heartbeat, or a list of nodes, is the endpoints' business:
/// let nodes = Endpoints::parse("amqp://guest:guest@rabbit-1,amqp://guest:guest@rabbit-2")?
///     .heartbeat(Duration::from_secs(10));
/// let clustered = PublisherConfig::with_endpoints(nodes, "events").mandatory(true);
/// # let _ = (config, clustered);
/// # Ok(())
/// # }
/// ```
// Debug shows no password: `Endpoints`' own Debug hides it.
#[derive(Clone, Debug)]
pub struct PublisherConfig {
    pub(super) endpoints: Endpoints,
    pub(super) exchange: String,
    pub(super) confirm_timeout: Duration,
    pub(super) mandatory: bool,
    pub(super) first_attempt_header: bool,
    pub(super) max_message_size: usize,
}

impl PublisherConfig {
    /// Publishing to `exchange` (`""` is the default exchange) at `url` (`amqp://` or
    /// `amqps://`; several, comma-separated, for a cluster's nodes: see [`Endpoints`]);
    /// fails on a URL that does not parse. Nothing connects until [`connect`](Self::connect).
    pub fn new(url: &str, exchange: &str) -> Result<PublisherConfig, Error> {
        Ok(PublisherConfig::with_endpoints(
            Endpoints::parse(url)?,
            exchange,
        ))
    }

    /// Publishing to `exchange` at `endpoints` (a list of nodes, a shuffled order, a
    /// heartbeat of their own).
    pub fn with_endpoints(endpoints: Endpoints, exchange: &str) -> PublisherConfig {
        PublisherConfig {
            endpoints,
            exchange: exchange.to_owned(),
            confirm_timeout: Duration::from_secs(10),
            mandatory: true,
            first_attempt_header: true,
            max_message_size: DEFAULT_MAX_MESSAGE_SIZE,
        }
    }

    /// How long to wait for a batch's confirms before giving the connection up as broken
    /// (default 10 s), or, while the broker blocks the connection, before handing the batch
    /// back; in a stream ([`Publisher::publish_in_order`](crate::Publisher::publish_in_order)),
    /// how long to wait for the next confirm. Keep it well under the relay's lease.
    pub fn confirm_timeout(mut self, timeout: Duration) -> PublisherConfig {
        self.confirm_timeout = timeout;
        self
    }

    /// Whether the broker must return messages no queue is bound for (default on): a
    /// returned message is a failed attempt (retried, then dead), never counted as sent.
    /// Turn it off only where dropping unroutable messages is intended: the broker then
    /// confirms them and they are recorded as sent.
    pub fn mandatory(mut self, mandatory: bool) -> PublisherConfig {
        self.mandatory = mandatory;
        self
    }

    /// Whether a message's first attempt carries `x-outbox-attempt: 1` too (default true:
    /// every message carries it, as consumers written against the wire format expect).
    /// Turned off, the header comes from the second attempt on and its absence means the
    /// first (as [`Delivery::attempt`](super::Delivery::attempt) reads it): a message with
    /// no other header then carries no header table, and costs the broker less CPU (see
    /// BENCHMARKS.md). Only for consumers that all read a missing header as the first
    /// attempt.
    pub fn first_attempt_header(mut self, always: bool) -> PublisherConfig {
        self.first_attempt_header = always;
        self
    }

    /// The largest body the broker takes (default [`DEFAULT_MAX_MESSAGE_SIZE`], RabbitMQ's
    /// own default; set it to the broker's `max_message_size`). A larger record fails
    /// permanently on its own, before it is sent, instead of making the broker close the
    /// channel under the rest of its batch.
    pub fn max_message_size(mut self, bytes: usize) -> PublisherConfig {
        self.max_message_size = bytes;
        self
    }
}
