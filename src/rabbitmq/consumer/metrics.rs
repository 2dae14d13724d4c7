//! What a consumer reports as it goes, to whoever observes it.

use std::time::Duration;

use super::delivery::{Delivery, SequenceGap};
use crate::publish::publisher::HandlerError;

/// Observes a [`Consumer`](crate::rabbitmq::Consumer). Every method has a no-op default, so
/// implement only what you export. A callback that panics is logged and ignored. Called from
/// the consumer's threads: keep it quick.
///
/// ```
/// use std::sync::atomic::{AtomicU64, Ordering};
/// use std::time::Duration;
/// use postgres_outbox::rabbitmq::{ConsumerMetrics, Delivery};
///
/// #[derive(Default)]
/// struct Handled(AtomicU64);
///
/// impl ConsumerMetrics for Handled {
///     fn handled(&self, _delivery: &Delivery, _took: Duration) {
///         self.0.fetch_add(1, Ordering::Relaxed);
///     }
/// }
/// ```
pub trait ConsumerMetrics: Send + Sync {
    /// A delivery was handled, committed and acked; `took` is its transaction's time.
    fn handled(&self, _delivery: &Delivery, _took: Duration) {}
    /// A delivery had been processed (or dead-lettered) before: acked and skipped.
    fn duplicate(&self, _delivery: &Delivery) {}
    /// The handler failed on a delivery (it is retried after a backoff, or dead-lettered).
    fn failed(&self, _delivery: &Delivery, _error: &HandlerError) {}
    /// The consumer gave up on a delivery: it went to the dead-letter queue, or was rejected
    /// to the queue's dead-letter exchange.
    fn dead_lettered(&self, _delivery: &Delivery) {}
    /// The database failed while handling a delivery, which is held and tried again.
    fn database_failed(&self, _error: &crate::error::Error) {}
    /// A delivery came out of its aggregate's publication sequence (see
    /// [`Delivery::gap`]): called before its handler runs, each time it runs.
    fn out_of_sequence(&self, _delivery: &Delivery, _gap: &SequenceGap) {}
}

pub(super) struct NoConsumerMetrics;

impl ConsumerMetrics for NoConsumerMetrics {}
