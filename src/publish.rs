//! The publishing side: the `Publisher` trait, its error, and the closure adapter.

use std::error::Error as StdError;
use std::fmt;

use crate::record::Record;

type BoxError = Box<dyn StdError + Send + Sync>;

/// Ships records somewhere: a broker, another service, an in-process queue.
///
/// Each relay worker owns one publisher, built by the relay's factory, and builds a fresh one
/// when [`Publisher::is_broken`] says the old one is beyond repair.
///
/// **Whose fault.** Only what is a record's own fault may cost it an attempt: say so with
/// [`PublishError::transient`] or [`PublishError::permanent`]. When the destination or the
/// way to it is down (a lost connection, a refused login, a missing exchange, a broker that
/// stopped taking messages), return [`PublishError::unavailable`] for the records it
/// concerns: the relay hands them back with their attempts restored, backs off, and tries
/// again, however long the outage lasts. A publisher that reports itself broken after a
/// call is taken at its word too: that call's transient failures are the break's, not the
/// records', and cost nothing.
pub trait Publisher: Send {
    /// Publishes a batch and returns one outcome per record, in order. Publish the batch
    /// pipelined where the broker allows it, and return only once each outcome is certain
    /// (for a broker, confirmed).
    fn publish(&mut self, batch: &[Record]) -> Vec<Result<(), PublishError>>;

    /// True once the publisher cannot be used again (a lost connection, say); the relay then
    /// drops it and builds a new one, with backoff. The default: never.
    fn is_broken(&self) -> bool {
        false
    }

    /// True if the records of one [`publish`](Publisher::publish) call reach the destination
    /// in the order given, whatever becomes of each (as messages published on one AMQP
    /// channel reach each queue in the order they were sent). A relay set to
    /// [`pipeline_runs`](crate::RelayConfig::pipeline_runs) then hands such a publisher an
    /// aggregate's whole run in one call, instead of one message per confirm round. The
    /// default: false, and the relay keeps to confirm rounds.
    fn keeps_order(&self) -> bool {
        false
    }
}

/// Why a record was not published (or a handler did not finish), and whose fault it is.
///
/// - [`transient`](PublishError::transient): the record's own attempt failed (the broker
///   nacked it, no queue was bound for it); it costs an attempt and is retried after a
///   backoff, up to its attempt limit.
/// - [`permanent`](PublishError::permanent): the record can never succeed; it becomes a dead
///   letter at once.
/// - [`unavailable`](PublishError::unavailable): the destination or the way to it is down;
///   not the record's fault. It costs no attempt and never leads to a dead letter: the
///   record is handed back and tried again once the outage is over.
///
/// Each takes anything that converts into a boxed error, so a `&str` works.
///
/// ```
/// use postgres_outbox::PublishError;
/// let retry_later = PublishError::transient("the broker nacked it");
/// let give_up = PublishError::permanent("payload rejected by schema");
/// let outage = PublishError::unavailable("connection refused");
/// assert!(give_up.is_permanent() && !retry_later.is_permanent());
/// assert!(outage.is_unavailable() && !retry_later.is_unavailable());
/// ```
#[derive(Debug)]
pub struct PublishError {
    kind: Kind,
    source: BoxError,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Transient,
    Permanent,
    Unavailable,
}

impl PublishError {
    /// A failure of this record's attempt, worth retrying: it costs an attempt.
    pub fn transient(err: impl Into<BoxError>) -> PublishError {
        PublishError::new(Kind::Transient, err)
    }

    /// A failure that retrying cannot fix: the record goes to the dead letters.
    pub fn permanent(err: impl Into<BoxError>) -> PublishError {
        PublishError::new(Kind::Permanent, err)
    }

    /// The destination, or the way to it, is down: no fault of the record. It costs no
    /// attempt; the relay (or consumer) backs off and tries again until it is back.
    pub fn unavailable(err: impl Into<BoxError>) -> PublishError {
        PublishError::new(Kind::Unavailable, err)
    }

    fn new(kind: Kind, err: impl Into<BoxError>) -> PublishError {
        PublishError {
            kind,
            source: err.into(),
        }
    }

    /// True for [`PublishError::permanent`].
    pub fn is_permanent(&self) -> bool {
        self.kind == Kind::Permanent
    }

    /// True for [`PublishError::unavailable`].
    pub fn is_unavailable(&self) -> bool {
        self.kind == Kind::Unavailable
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
/// Transient errors are retried with backoff; permanent ones dead-letter the record;
/// `unavailable` (a service the handler needs is down) hands it back without counting.
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
