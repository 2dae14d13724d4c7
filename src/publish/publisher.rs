//! The publishing side: the `Publisher` trait, its error, and the closure adapter.

use std::collections::HashSet;
use std::error::Error as StdError;
use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};

use crate::publish::record::Record;
use crate::publish::rounds::rounds_of;

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
/// concerns: the relay hands them back uncharged, backs off, and tries
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

    /// Publishes a batch whose records of one aggregate must reach the destination in
    /// order, filling `outcomes` (one per record, `None` on entry): a record with an
    /// aggregate key is handed over only once the record before it of its aggregate in
    /// `batch` has succeeded (for a broker, is confirmed), and not at all once that one
    /// failed. Records of different aggregates, and records without a key, go out together.
    ///
    /// `proceed` is asked before anything more is handed over; once it says no (the relay
    /// is stopping, or its lease is nearly over), nothing more is. So is nothing after a
    /// [`PublishError::unavailable`] or once the publisher [is broken](Publisher::is_broken).
    /// A record left `None` was not handed over: the relay gives it back with its attempt
    /// restored.
    ///
    /// The relay hands the batch over in confirm-round order: the first record of every
    /// aggregate (and every record without a key), then every aggregate's second, and so on.
    /// The default publishes round by round with [`publish`](Publisher::publish), each round
    /// waiting for the slowest outcome of the one before. Override it to let an aggregate's
    /// next record go out as soon as its own predecessor succeeds, as
    /// [`RabbitPublisher`](crate::rabbitmq::RabbitPublisher) does.
    fn publish_in_order(
        &mut self,
        batch: &[Record],
        outcomes: &mut [Option<Result<(), PublishError>>],
        proceed: &dyn Fn() -> bool,
    ) {
        in_rounds(self, batch, outcomes, proceed);
    }
}

/// [`Publisher::publish_in_order`]'s default: round `k` is the `k`-th record of every
/// aggregate still going (and, in round 0, every record without a key), published with
/// `publish` in as many calls as the round has stretches of adjacent records in `batch`
/// (one, in confirm-round order, unless a failure took records out).
fn in_rounds<P: Publisher + ?Sized>(
    publisher: &mut P,
    batch: &[Record],
    outcomes: &mut [Option<Result<(), PublishError>>],
    proceed: &dyn Fn() -> bool,
) {
    let mut failed: HashSet<&str> = HashSet::new();
    for round in rounds_of(batch) {
        let going: Vec<usize> = round
            .into_iter()
            .filter(|&i| {
                batch[i]
                    .aggregate_key
                    .as_deref()
                    .is_none_or(|aggregate| !failed.contains(aggregate))
            })
            .collect();
        if going.is_empty() {
            continue;
        }
        if !proceed() {
            return;
        }
        for stretch in going.chunk_by(|a, b| a + 1 == *b) {
            let (first, last) = (stretch[0], stretch[stretch.len() - 1]);
            let mut results = publisher.publish(&batch[first..=last]).into_iter();
            // As the relay takes it: a publisher whose `is_broken` panics is broken.
            let mut stop = catch_unwind(AssertUnwindSafe(|| publisher.is_broken())).unwrap_or(true);
            for i in first..=last {
                let result = results.next().unwrap_or_else(|| Err(fewer_outcomes()));
                if result.is_err() {
                    if let Some(aggregate) = &batch[i].aggregate_key {
                        failed.insert(aggregate);
                    }
                }
                stop |= result.as_ref().is_err_and(PublishError::is_unavailable);
                outcomes[i] = Some(result);
            }
            if stop {
                return;
            }
        }
    }
}

/// What stands for the outcomes a publisher's `publish` did not return.
pub(crate) fn fewer_outcomes() -> PublishError {
    PublishError::transient("publisher returned fewer outcomes than records")
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

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::*;

    /// Records each `publish` call's keys; fails (transiently) the keys in `failing`, makes
    /// `down` unavailable, and returns no outcome for `missing`.
    #[derive(Default)]
    struct Script {
        calls: Vec<Vec<String>>,
        failing: Vec<&'static str>,
        down: Vec<&'static str>,
        missing: Vec<&'static str>,
    }

    impl Publisher for Script {
        fn publish(&mut self, batch: &[Record]) -> Vec<Result<(), PublishError>> {
            self.calls
                .push(batch.iter().map(|r| r.key.clone()).collect());
            batch
                .iter()
                .filter(|r| !self.missing.contains(&r.key.as_str()))
                .map(|r| match r.key.as_str() {
                    k if self.failing.contains(&k) => Err(PublishError::transient("nacked")),
                    k if self.down.contains(&k) => Err(PublishError::unavailable("down")),
                    _ => Ok(()),
                })
                .collect()
        }
    }

    /// Records keyed `<aggregate>-<n>` (`u-<n>` without an aggregate key), in confirm-round
    /// order as the relay hands them over.
    fn batch(keys: &[&str]) -> Vec<Record> {
        keys.iter()
            .enumerate()
            .map(|(i, key)| {
                let mut record = Record::for_tests(i as i64 + 1, "t", None);
                record.key = (*key).to_owned();
                let aggregate = key.split('-').next().unwrap_or_default();
                if aggregate != "u" {
                    record.aggregate_key = Some(aggregate.to_owned());
                }
                record
            })
            .collect()
    }

    /// Runs the default and returns each record's outcome: "ok", "failed", "down" or "-"
    /// (not handed over).
    fn run(publisher: &mut Script, records: &[Record], proceed: &dyn Fn() -> bool) -> Vec<String> {
        let mut outcomes: Vec<Option<Result<(), PublishError>>> =
            records.iter().map(|_| None).collect();
        publisher.publish_in_order(records, &mut outcomes, proceed);
        outcomes
            .iter()
            .map(|o| match o {
                None => "-".to_owned(),
                Some(Ok(())) => "ok".to_owned(),
                Some(Err(e)) if e.is_unavailable() => "down".to_owned(),
                Some(Err(e)) => format!("failed: {e}"),
            })
            .collect()
    }

    #[test]
    fn the_default_publishes_round_by_round_and_a_failure_ends_only_its_aggregate() {
        let records = batch(&["a-0", "b-0", "u-0", "a-1", "b-1", "a-2", "b-2"]);
        let mut publisher = Script {
            failing: vec!["b-1"],
            ..Script::default()
        };
        let outcomes = run(&mut publisher, &records, &|| true);
        assert_eq!(
            publisher.calls,
            [vec!["a-0", "b-0", "u-0"], vec!["a-1", "b-1"], vec!["a-2"]]
        );
        assert_eq!(
            outcomes,
            ["ok", "ok", "ok", "ok", "failed: nacked", "ok", "-"]
        );
    }

    #[test]
    fn the_default_splits_a_round_only_where_records_of_other_rounds_lie_between() {
        // In id order, not confirm-round order: round 0 is two stretches, round 1 one.
        let records = batch(&["a-0", "a-1", "b-0"]);
        let mut publisher = Script::default();
        assert_eq!(run(&mut publisher, &records, &|| true), ["ok"; 3]);
        assert_eq!(publisher.calls, [vec!["a-0"], vec!["b-0"], vec!["a-1"]]);
    }

    #[test]
    fn the_default_hands_nothing_more_over_once_told_to_stop_or_the_destination_is_down() {
        let records = batch(&["a-0", "b-0", "a-1", "b-1"]);
        let rounds = Cell::new(0);
        let once = || {
            rounds.set(rounds.get() + 1);
            rounds.get() == 1
        };
        let mut publisher = Script::default();
        assert_eq!(run(&mut publisher, &records, &once), ["ok", "ok", "-", "-"]);
        assert_eq!(publisher.calls.len(), 1);

        let mut publisher = Script {
            down: vec!["b-0"],
            ..Script::default()
        };
        assert_eq!(
            run(&mut publisher, &records, &|| true),
            ["ok", "down", "-", "-"]
        );
        assert_eq!(publisher.calls.len(), 1);
    }

    #[test]
    fn the_default_counts_an_outcome_a_publisher_did_not_return_as_a_failure() {
        let records = batch(&["a-0", "b-0", "a-1"]);
        let mut publisher = Script {
            missing: vec!["b-0"],
            ..Script::default()
        };
        // `publish` returned one outcome for two records: the first is a-0's, the
        // second is missing, and b-0 fails for it.
        let outcomes = run(&mut publisher, &records, &|| true);
        assert_eq!(outcomes[0], "ok");
        assert_eq!(
            outcomes[1],
            "failed: publisher returned fewer outcomes than records"
        );
        assert_eq!(outcomes[2], "ok");
    }
}
