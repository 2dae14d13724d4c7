//! The publishing side: the `Publisher` trait, its error, and the closure adapter.

use std::error::Error as StdError;
use std::fmt;

use crate::record::Record;

type BoxError = Box<dyn StdError + Send + Sync>;

/// Ships records somewhere: a broker, another service, an in-process queue.
///
/// Each relay worker owns one publisher, built by the relay's factory, and builds a fresh one
/// when [`Publisher::is_broken`] says the old one is beyond repair.
pub trait Publisher: Send {
    /// Publishes a batch and returns one outcome per record, in order. Publish the batch
    /// pipelined where the broker allows it, and return only once each outcome is certain
    /// (for a broker, confirmed).
    fn publish(&mut self, batch: &[Record]) -> Vec<Result<(), PublishError>>;

    /// True once the publisher cannot be used again (a lost connection, say); the relay then
    /// drops it and builds a new one. The default: never.
    fn is_broken(&self) -> bool {
        false
    }
}

/// Why a record was not published.
///
/// A transient error is retried after a backoff; a permanent one dead-letters the record at
/// once. Either takes anything that converts into a boxed error, so a `&str` works.
///
/// ```
/// use postgres_outbox::PublishError;
/// let retry_later = PublishError::transient("broker unavailable");
/// let give_up = PublishError::permanent("payload rejected by schema");
/// assert!(give_up.is_permanent() && !retry_later.is_permanent());
/// ```
#[derive(Debug)]
pub struct PublishError {
    permanent: bool,
    source: BoxError,
}

impl PublishError {
    /// A failure worth retrying.
    pub fn transient(err: impl Into<BoxError>) -> PublishError {
        PublishError {
            permanent: false,
            source: err.into(),
        }
    }

    /// A failure that retrying cannot fix: the record goes to the dead letters.
    pub fn permanent(err: impl Into<BoxError>) -> PublishError {
        PublishError {
            permanent: true,
            source: err.into(),
        }
    }

    /// True for [`PublishError::permanent`].
    pub fn is_permanent(&self) -> bool {
        self.permanent
    }
}

impl fmt::Display for PublishError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.source, f)
    }
}

impl StdError for PublishError {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        Some(self.source.as_ref())
    }
}

/// The error a transactional handler returns; see [`Outbox::process`](crate::Outbox::process).
/// Transient errors are retried with backoff; permanent ones dead-letter the record.
pub type HandlerError = PublishError;

/// A [`Publisher`] from a closure that publishes one record.
///
/// ```
/// use postgres_outbox::{publisher_fn, PublishError, Record};
/// let publisher = publisher_fn(|record: &Record| -> Result<(), PublishError> {
///     println!("{} {}", record.topic, record.key);
///     Ok(())
/// });
/// # let _ = publisher;
/// ```
pub fn publisher_fn<F>(f: F) -> PublisherFn<F>
where
    F: FnMut(&Record) -> Result<(), PublishError> + Send,
{
    PublisherFn(f)
}

/// The publisher [`publisher_fn`] returns.
pub struct PublisherFn<F>(F);

impl<F> fmt::Debug for PublisherFn<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("PublisherFn")
    }
}

impl<F> Publisher for PublisherFn<F>
where
    F: FnMut(&Record) -> Result<(), PublishError> + Send,
{
    fn publish(&mut self, batch: &[Record]) -> Vec<Result<(), PublishError>> {
        batch.iter().map(|record| (self.0)(record)).collect()
    }
}
