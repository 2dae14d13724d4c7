//! Hooks for counters and histograms; every method does nothing unless overridden.

use std::error::Error as StdError;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use crate::publish::publisher::PublishError;
use crate::publish::record::Record;

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
    /// `n` claimed rows were handed back unpublished, uncharged (at shutdown,
    /// a lease too short to use, or the publisher down).
    fn released(&self, _n: usize) {}
    /// The relay's publishers cannot reach their destination (a broker down or refusing, a
    /// missing exchange, a resource alarm, a factory that fails): nothing is charged to any
    /// message meanwhile. Called once per outage, when it starts.
    fn publisher_down(&self, _cause: &(dyn StdError + 'static)) {}
    /// A publisher published: the first time, and again after each outage.
    fn publisher_up(&self) {}
    /// The database did not answer one of the relay's statements within `waited` (the
    /// statement timeout and a margin): the connection was given up as stalled and another
    /// opened. Nothing is charged to any message.
    fn database_stalled(&self, _waited: Duration) {}
    /// The listener heard a notification from a producer's commit and wakes an idle worker,
    /// if one is idle (a busy one claims again anyway).
    fn notified(&self) {}
    /// A worker's cycle that claimed rows ended: where its time went.
    fn cycle(&self, _times: &CycleTimes) {}
}

/// Where one worker cycle's time went, from the claim being sent to the outcomes recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct CycleTimes {
    /// Rows claimed.
    pub rows: usize,
    /// The claim: every claim statement of the cycle (a ready-only claim, and up to four
    /// full ones when the first find nothing), and settling rows that cannot be published.
    pub claim: Duration,
    /// Publishing the batch, confirms included.
    pub publish: Duration,
    /// Recording the outcomes.
    pub record: Duration,
}

/// The default: observe nothing.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoMetrics;

impl Metrics for NoMetrics {}

/// Runs every callback of the wrapped `Metrics` under `catch_unwind`: a panicking callback is
/// logged (once) and otherwise ignored, so observing the relay can never stop it.
pub(crate) struct Guarded<M>(pub(crate) M);

static PANIC_LOGGED: AtomicBool = AtomicBool::new(false);

/// Runs a metrics callback (the relay's or a consumer's); a panic in it is logged the first
/// time and otherwise ignored, so observing can never stop what is observed.
pub(crate) fn contained(name: &str, f: impl FnOnce()) {
    if catch_unwind(AssertUnwindSafe(f)).is_err() && !PANIC_LOGGED.swap(true, Ordering::Relaxed) {
        log::error!("a metrics callback ({name}) panicked; ignoring it and any later panics");
    }
}

impl<M: Metrics> Guarded<M> {
    fn call(&self, name: &str, f: impl FnOnce(&M)) {
        contained(name, || f(&self.0));
    }
}

impl<M: Metrics> Metrics for Guarded<M> {
    fn claimed(&self, n: usize) {
        self.call("claimed", |m| m.claimed(n));
    }
    fn published(&self, record: &Record, took: Duration) {
        self.call("published", |m| m.published(record, took));
    }
    fn failed(&self, record: &Record, error: &PublishError) {
        self.call("failed", |m| m.failed(record, error));
    }
    fn dead_lettered(&self, record: &Record) {
        self.call("dead_lettered", |m| m.dead_lettered(record));
    }
    fn released(&self, n: usize) {
        self.call("released", |m| m.released(n));
    }
    fn publisher_down(&self, cause: &(dyn StdError + 'static)) {
        self.call("publisher_down", |m| m.publisher_down(cause));
    }
    fn publisher_up(&self) {
        self.call("publisher_up", |m| m.publisher_up());
    }
    fn notified(&self) {
        self.call("notified", |m| m.notified());
    }
    fn cycle(&self, times: &CycleTimes) {
        self.call("cycle", |m| m.cycle(times));
    }
    fn database_stalled(&self, waited: Duration) {
        self.call("database_stalled", |m| m.database_stalled(waited));
    }
}
