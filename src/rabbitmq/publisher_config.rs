//! A `RabbitPublisher`'s settings, kept apart from its connection, so a relay's factory can
//! build as many publishers as it needs from one value: `move || config.connect()`.

use std::time::Duration;

use super::connect::Endpoints;
use super::error::Error;
use super::publisher::RabbitPublisher;

/// Where and how [`RabbitPublisher`]s publish: the endpoints, the exchange and the
/// publisher's settings (each left unset keeps [`RabbitPublisher`]'s default). `Clone`, so
/// a relay's publisher factory is `move || config.connect()`, and a publisher built again
/// after a lost connection gets the same settings.
///
/// ```no_run
/// use std::time::Duration;
/// use postgres_outbox::rabbitmq::PublisherConfig;
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
/// # let _ = config;
/// # Ok(())
/// # }
/// ```
// Debug shows no password: `Endpoints`' own Debug hides it.
#[derive(Clone, Debug)]
pub struct PublisherConfig {
    endpoints: Endpoints,
    exchange: String,
    confirm_timeout: Option<Duration>,
    mandatory: Option<bool>,
    first_attempt_header: Option<bool>,
    max_message_size: Option<usize>,
}

impl PublisherConfig {
    /// Publishing to `exchange` at `url` (several, comma-separated, for a cluster's nodes);
    /// fails on a URL that does not parse. Nothing connects until [`connect`](Self::connect).
    pub fn new(url: &str, exchange: &str) -> Result<PublisherConfig, Error> {
        Ok(PublisherConfig::with_endpoints(
            Endpoints::parse(url)?,
            exchange,
        ))
    }

    /// Publishing to `exchange` at `endpoints`.
    pub fn with_endpoints(endpoints: Endpoints, exchange: &str) -> PublisherConfig {
        PublisherConfig {
            endpoints,
            exchange: exchange.to_owned(),
            confirm_timeout: None,
            mandatory: None,
            first_attempt_header: None,
            max_message_size: None,
        }
    }

    /// See [`RabbitPublisher::confirm_timeout`].
    pub fn confirm_timeout(mut self, timeout: Duration) -> PublisherConfig {
        self.confirm_timeout = Some(timeout);
        self
    }

    /// See [`RabbitPublisher::mandatory`].
    pub fn mandatory(mut self, mandatory: bool) -> PublisherConfig {
        self.mandatory = Some(mandatory);
        self
    }

    /// See [`RabbitPublisher::first_attempt_header`].
    pub fn first_attempt_header(mut self, always: bool) -> PublisherConfig {
        self.first_attempt_header = Some(always);
        self
    }

    /// See [`RabbitPublisher::max_message_size`].
    pub fn max_message_size(mut self, bytes: usize) -> PublisherConfig {
        self.max_message_size = Some(bytes);
        self
    }

    /// A publisher with these settings: connects to the first endpoint that answers and
    /// checks the exchange, as [`RabbitPublisher::connect_to`] does.
    pub fn connect(&self) -> Result<RabbitPublisher, Error> {
        let mut publisher = RabbitPublisher::connect_to(&self.endpoints, &self.exchange)?;
        if let Some(timeout) = self.confirm_timeout {
            publisher = publisher.confirm_timeout(timeout);
        }
        if let Some(mandatory) = self.mandatory {
            publisher = publisher.mandatory(mandatory);
        }
        if let Some(always) = self.first_attempt_header {
            publisher = publisher.first_attempt_header(always);
        }
        if let Some(bytes) = self.max_message_size {
            publisher = publisher.max_message_size(bytes);
        }
        Ok(publisher)
    }
}
