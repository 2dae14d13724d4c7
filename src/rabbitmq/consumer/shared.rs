//! What the consumer's threads and its handle share.

use std::sync::atomic::AtomicU64;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use postgres::Transaction;

use super::config::ConsumerConfig;
use super::delivery::Delivery;
use super::metrics::ConsumerMetrics;
use crate::producer::outbox::Outbox;
use crate::publish::publisher::HandlerError;
use crate::rabbitmq::error::Error;
use crate::runtime::lifecycle::StopSignal;
use crate::runtime::pool::Source;

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
    /// Sent by shutdown, with when what is held must be back in the queue, or by a worker
    /// that found the consumer cannot go on.
    pub(super) stop: StopSignal,
    /// Why the consumer stopped on its own, if it did.
    pub(super) fatal: Mutex<Option<Error>>,
}

/// How long the jobs running get to finish when the consumer stops on its own.
pub(super) const FATAL_GRACE: Duration = Duration::from_secs(10);

impl Shared {
    /// The shutdown's deadline; far away until shutdown sets one.
    pub(super) fn stop_deadline(&self) -> Instant {
        self.stop
            .deadline()
            .unwrap_or_else(|| crate::runtime::clock::deadline(Duration::MAX))
    }

    /// Stops the consumer on its own: what runs gets `FATAL_GRACE` to finish, the rest goes
    /// back to the queue. `fatal` is kept for `join` (the first one wins).
    pub(super) fn stop_consumer(&self, fatal: Error) {
        log::error!("rabbitmq consumer {}: stopping: {fatal}", self.config.name);
        if let Ok(mut slot) = self.fatal.lock() {
            slot.get_or_insert(fatal);
        }
        self.stop
            .send_by(crate::runtime::clock::deadline(FATAL_GRACE));
    }

    pub(super) fn take_fatal(&self) -> Option<Error> {
        self.fatal.lock().ok().and_then(|mut slot| slot.take())
    }

    /// Calls the metrics hook; a panic in it is logged and goes no further.
    pub(super) fn observe(&self, f: impl FnOnce(&dyn ConsumerMetrics)) {
        let metrics = self.config.metrics.as_ref();
        crate::publish::metrics::contained("ConsumerMetrics", || f(metrics));
    }
}
