//! Hooks for counters and histograms; every method does nothing unless overridden.

use std::time::Duration;

use crate::publish::PublishError;
use crate::record::Record;

/// Observes the relay. Every method has a no-op default, so implement only what you export,
/// and new events can be added without breaking you. Called from relay threads: keep it quick.
///
/// ```
/// use std::sync::atomic::{AtomicU64, Ordering};
/// use std::time::Duration;
/// use postgres_outbox::{Metrics, Record};
///
/// #[derive(Default)]
/// struct Published(AtomicU64);
///
/// impl Metrics for Published {
///     fn published(&self, _record: &Record, _took: Duration) {
///         self.0.fetch_add(1, Ordering::Relaxed);
///     }
/// }
/// ```
pub trait Metrics: Send + Sync {
    /// A claim returned `n` rows.
    fn claimed(&self, _n: usize) {}
    /// A record was published; `took` is the time from its claim to its confirmation.
    fn published(&self, _record: &Record, _took: Duration) {}
    /// A publish (or handler) attempt failed.
    fn failed(&self, _record: &Record, _error: &PublishError) {}
    /// A record ran out of attempts or failed permanently, and is now a dead letter.
    fn dead_lettered(&self, _record: &Record) {}
    /// `n` claimed rows were handed back unpublished (at shutdown, or a lease too short to use).
    fn released(&self, _n: usize) {}
}

/// The default: observe nothing.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoMetrics;

impl Metrics for NoMetrics {}
