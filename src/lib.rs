//! A blocking transactional outbox for PostgreSQL.
//!
//! Write the event in the same `postgres::Transaction` as the data it describes, with
//! [`Outbox::enqueue`]: it exists if, and only if, that transaction commits. A [`Relay`]
//! then ships committed rows to a [`Publisher`] (RabbitMQ with the `rabbitmq` feature) at
//! least once, retrying with backoff until it succeeds or the row becomes a dead letter.
//! Consumers deduplicate on the message key with [`Outbox::dedupe`].
//!
//! No async runtime appears in the API: the relay is a handful of threads, each claiming,
//! publishing and recording its own batches.
//!
//! ```no_run
//! use std::time::Duration;
//! use postgres_outbox::{publisher_fn, Message, Outbox, Relay, RelayConfig};
//! use r2d2_postgres::{postgres::NoTls, PostgresConnectionManager};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let url = "postgres://postgres@localhost/app";
//! let pool = r2d2::Pool::new(PostgresConnectionManager::new(url.parse()?, NoTls))?;
//! let outbox = Outbox::new("orders_outbox")?;
//! let mut client = pool.get()?;
//! outbox.migrate(&mut client)?;
//!
//! let relay = Relay::spawn(RelayConfig::new(outbox.clone(), pool.clone(), || {
//!     Ok::<_, std::io::Error>(publisher_fn(|record| {
//!         println!("publish {} {}", record.topic, record.key);
//!         Ok(())
//!     }))
//! }))?;
//!
//! let mut tx = client.transaction()?;
//! outbox.enqueue(&mut tx, Message::new("order.created", b"{}".to_vec()))?;
//! tx.commit()?;
//!
//! let report = relay.shutdown(Duration::from_secs(10))?;
//! println!("{report:?}");
//! # Ok(())
//! # }
//! ```
//!
//! Ordering: messages with the same [`Message::aggregate_key`] are published in the order
//! their transactions committed (within one transaction, in enqueue order): none is handed
//! to a publisher before every earlier one of its aggregate is confirmed sent or is dead.
//! An enqueue locks its aggregate until its transaction ends, so a second producer of the
//! same aggregate waits for the first, as if both had locked the aggregate's own row.
//! Different aggregates go out together: see [`Publisher::publish_in_order`].
//!
//! Faults of the world are never charged to a message: a publisher that cannot reach its
//! broker says [`PublishError::unavailable`], and the relay hands the records back with
//! no attempt charged, and tries again until the broker is back. So does a database outage,
//! however long: an attempt is a verdict on the message, never a lease that ran out.
//!
//! # Features
//!
//! | feature | adds |
//! |---|---|
//! | (none) | the outbox, the relay, operations ([`Outbox::stats`], [`Outbox::redrive`], [`Outbox::health`], ...) and the [`Publisher`] trait; no AMQP |
//! | `rabbitmq` | `rabbitmq::RabbitPublisher` and `rabbitmq::Consumer` (amiquip, publisher confirms) |
//! | `metrics` | `OutboxMetrics` (and with `rabbitmq`, `QueueMetrics`): the relay's and consumer's events for the `metrics` crate facade |
//! | `cli` | the `postgres-outbox` binary (migrate, stats, doctor, dead letters, redrive, purge, relay); implies `rabbitmq` |
//! | `containers` | tests only: throwaway PostgreSQL and RabbitMQ containers (testcontainers) |

#![forbid(unsafe_code)]
#![cfg_attr(docsrs, feature(doc_cfg))]
#![deny(missing_docs)]

mod error;
#[cfg(feature = "metrics")]
#[cfg_attr(docsrs, doc(cfg(feature = "metrics")))]
pub mod facade;
#[doc(hidden)]
pub mod hooks;
mod operations;
mod producer;
mod publish;
mod relay;
mod runtime;
mod schema;
mod trace;

#[cfg(feature = "rabbitmq")]
#[cfg_attr(docsrs, doc(cfg(feature = "rabbitmq")))]
pub mod rabbitmq;

pub use error::{Error, Result};
#[cfg(feature = "metrics")]
#[cfg_attr(docsrs, doc(cfg(feature = "metrics")))]
pub use facade::OutboxMetrics;
pub use operations::filter::{Filter, Rows, Selection};
pub use operations::health::report::{
    Check, Finding, Health, HealthThresholds, HeldBack, Holder, Partition, Slot, TableHealth,
};
pub use operations::install::{Installed, ObjectKind};
pub use operations::letters::{DeadLetter, ErrorGroup};
pub use operations::relays::{PublisherState, RelayReport};
pub use operations::stats::{Stats, TopicStats};
pub use producer::message::{Message, MAX_HEADER_BYTES, MAX_INDEXED_KEY, MAX_SHORT_STRING};
pub use producer::outbox::{Outbox, OutboxBuilder};
pub use producer::prepared::{Producer, ProducerTransaction};
pub use publish::metrics::{CycleTimes, Metrics, NoMetrics};
pub use publish::publisher::{publisher_fn, HandlerError, PublishError, Publisher, PublisherFn};
pub use publish::record::Record;
#[cfg(all(feature = "metrics", feature = "rabbitmq"))]
#[cfg_attr(docsrs, doc(cfg(all(feature = "metrics", feature = "rabbitmq"))))]
pub use rabbitmq::QueueMetrics;
pub use relay::process::ProcessReport;
pub use relay::{Relay, RelayConfig, ShutdownReport, DEFAULT_MAX_IN_FLIGHT_BYTES};
pub use runtime::pool::Connections;
pub use runtime::retry::{Retry, MAX_DELAY};
pub use schema::grants::Access;
pub use trace::{TRACEPARENT, TRACESTATE};

// The Rust examples of the README and the docs pages are compiled as doc tests, so they
// cannot drift from the API.
#[cfg(all(doctest, feature = "rabbitmq", feature = "metrics"))]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

#[cfg(all(doctest, feature = "rabbitmq", feature = "metrics"))]
#[doc = include_str!("../docs/guarantees.md")]
struct GuaranteesDoctests;

#[cfg(all(doctest, feature = "rabbitmq", feature = "metrics"))]
#[doc = include_str!("../docs/operations.md")]
struct OperationsDoctests;

#[cfg(all(doctest, feature = "rabbitmq", feature = "metrics"))]
#[doc = include_str!("../docs/partitions.md")]
struct PartitionsDoctests;

#[cfg(all(doctest, feature = "rabbitmq", feature = "metrics"))]
#[doc = include_str!("../docs/producing.md")]
struct ProducingDoctests;

#[cfg(all(doctest, feature = "rabbitmq", feature = "metrics"))]
#[doc = include_str!("../docs/upgrading.md")]
struct UpgradingDoctests;

#[cfg(all(doctest, feature = "rabbitmq", feature = "metrics"))]
#[doc = include_str!("../docs/rabbitmq.md")]
struct RabbitmqDoctests;

#[cfg(all(doctest, feature = "rabbitmq", feature = "opentelemetry"))]
#[doc = include_str!("../docs/tracing.md")]
struct TracingDoctests;
