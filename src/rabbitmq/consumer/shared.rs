//! What the consumer's threads and its handle share.

use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};

use postgres::Transaction;

use super::config::ConsumerConfig;
use super::delivery::Delivery;
use super::metrics::ConsumerMetrics;
use crate::lifecycle::StopSignal;
use crate::outbox::Outbox;
use crate::pool::Source;
use crate::publish::HandlerError;

/// What the consumer has done so far, counted by the dispatcher.
#[derive(Default)]
pub(super) struct Counters {
    pub(super) processed: AtomicU64,
    pub(super) duplicates: AtomicU64,
    pub(super) retried: AtomicU64,
    pub(super) rejected: AtomicU64,
}

type Handler = dyn Fn(&mut Transaction<'_>, &Delivery) -> Result<(), HandlerError> + Send + Sync;

/// What the consumer's handle, its dispatcher and its workers share.
pub(super) struct Shared {
    pub(super) config: ConsumerConfig,
    pub(super) outbox: Outbox,
    /// The handlers' connections: the pool's, or the consumer's own.
    pub(super) source: Source,
    pub(super) handler: Box<Handler>,
    pub(super) counters: Counters,
    /// Sent by shutdown, with when what is held must be back in the queue.
    pub(super) stop: StopSignal,
}

impl Shared {
    /// The shutdown's deadline; far away until shutdown sets one.
    pub(super) fn stop_deadline(&self) -> Instant {
        self.stop
            .deadline()
            .unwrap_or_else(|| crate::clock::deadline(Duration::MAX))
    }

    /// Calls the metrics hook; a panic in it is logged and goes no further.
    pub(super) fn observe(&self, f: impl FnOnce(&dyn ConsumerMetrics)) {
        let metrics = self.config.metrics.as_ref();
        crate::metrics::contained("ConsumerMetrics", || f(metrics));
    }
}
