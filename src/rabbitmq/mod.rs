//! RabbitMQ on both ends (feature `rabbitmq`): [`RabbitPublisher`] for the relay, and
//! [`Consumer`] to process deliveries exactly once in a PostgreSQL transaction.
//!
//! Built on amiquip, whose types never appear in this API; it has no reconnect of its own,
//! so a publisher that loses its connection reports itself broken and the relay builds a new
//! one, and the consumer reconnects with backoff. Both take one broker URL or several
//! ([`Endpoints`]) and fail over between them.

mod connect;
mod consumer;
mod deadline;
mod error;
mod publisher;
mod publisher_config;

pub use crate::runtime::wire::{AGGREGATE_HEADER, ATTEMPT_HEADER, SEQUENCE_HEADER};
pub use connect::Endpoints;
#[cfg(feature = "metrics")]
#[cfg_attr(docsrs, doc(cfg(feature = "metrics")))]
pub use consumer::QueueMetrics;
pub use consumer::{
    Consumer, ConsumerConfig, ConsumerMetrics, ConsumerReport, Delivery, QueueType, SequenceGap,
    DEAD_CONSUMER_HEADER, DEAD_EXPIRATION_HEADER, DEAD_FAILURES_HEADER, DEAD_QUEUE_HEADER,
    DEAD_REASON_HEADER, DEAD_USER_ID_HEADER,
};
pub use error::Error;
pub use publisher::RabbitPublisher;
pub use publisher_config::{PublisherConfig, DEFAULT_MAX_MESSAGE_SIZE};
