//! When a failed row is tried again, and when it gives up.

use std::time::Duration;

use rand::Rng;

use crate::error::{describe, Error, Result};
use crate::publish::publisher::PublishError;
use crate::publish::record::Record;

/// The longest delay accepted, of a message or a retry: beyond it a value is almost
/// certainly a unit mistake, and a timestamp would overflow in SQL.
pub const MAX_DELAY: Duration = Duration::from_secs(10 * 365 * 24 * 3600);

/// What happens to a claimed row after its attempt.
#[derive(Debug, Clone)]
pub(crate) enum Outcome {
    Sent,
    Retry {
        delay: Duration,
        error: String,
    },
    Dead {
        error: String,
    },
    /// Handed back unattempted: due at once, no attempt charged.
    Release,
}

impl Outcome {
    pub(crate) fn label(&self) -> &'static str {
        match self {
            Outcome::Sent => "sent",
            Outcome::Retry { .. } => "retry",
            Outcome::Dead { .. } => "dead",
            Outcome::Release => "release",
        }
    }
}

/// How often a message is tried, and how long to wait between tries: one value for the
/// three ways to consume an outbox, [`RelayConfig::retry`](crate::RelayConfig::retry),
/// [`OutboxBuilder::retry`](crate::OutboxBuilder::retry) (which [`Outbox::process`](crate::Outbox::process)
/// uses) and, with the `rabbitmq` feature, `rabbitmq::ConsumerConfig::retry`.
///
/// A message that fails its last attempt is dead (a dead letter); before that, each failure
/// waits a capped exponential backoff with jitter: the `n`th retry waits between half and
/// all of `min x 2^(n-1)`, at most `max`. An attempt is a verdict on the message (a
/// publisher or handler that failed it, a nack, a return as unroutable). Failures that are
/// the world's (an outage of the broker or the database, a lost connection, a lease that ran
/// out while the world was at fault) are never counted, however long they last.
///
/// One more limit guards against a crash loop, apart from attempts:
/// [`max_claims`](Retry::max_claims), the claims in a row that end with no outcome at all
/// (the relay crashed, or lost its connection, with the message in hand).
///
/// ```
/// use std::time::Duration;
/// use postgres_outbox::Retry;
/// let retry = Retry::new(5)
///     .backoff(Duration::from_secs(1), Duration::from_secs(60))
///     .max_claims(3);
/// assert_eq!(retry.max_attempts(), 5);
/// assert_eq!(retry.backoff_range(), (Duration::from_secs(1), Duration::from_secs(60)));
/// assert_eq!(retry.max_claims_in_a_row(), 3);
/// assert_eq!(Retry::default().max_attempts(), 10);
/// assert_eq!(Retry::default().max_claims_in_a_row(), 20);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retry {
    pub(crate) max_attempts: u32,
    pub(crate) backoff_min: Duration,
    pub(crate) backoff_max: Duration,
    pub(crate) max_claims: u32,
}

/// 10 attempts, backing off from 500 ms up to 300 s, and 20 claims in a row without an
/// outcome: the relay's and `process`'s defaults.
impl Default for Retry {
    fn default() -> Retry {
        Retry {
            max_attempts: 10,
            backoff_min: Duration::from_millis(500),
            backoff_max: Duration::from_secs(300),
            max_claims: 20,
        }
    }
}

impl Retry {
    /// At most `max_attempts` tries (1 to `i32::MAX`), with the default backoff (500 ms up to
    /// 300 s). Checked when the relay, outbox or consumer using it is built.
    pub fn new(max_attempts: u32) -> Retry {
        Retry {
            max_attempts,
            ..Retry::default()
        }
    }

    /// The first retry's delay and the cap of the exponential backoff (`0 < min <= max`).
    pub fn backoff(mut self, min: Duration, max: Duration) -> Retry {
        self.backoff_min = min;
        self.backoff_max = max;
        self
    }

    /// The crash-loop guard (default 20, at least 1): how many times in a row a message may
    /// be claimed without any outcome being recorded before the claim makes it a dead
    /// letter, with a reason that says so. A claim ends without an outcome only when its
    /// relay crashed, or lost its database connection, with the message in hand (a lost
    /// claim reply, an outage longer than the lease that another relay outlasted); any
    /// outcome, a hand-back included, starts the count again. A message that crashes the
    /// relay process each time it is published still ends, after this many crashes, without
    /// an outage ever costing a message one of its [`max_attempts`](Retry::max_attempts).
    /// Applies to relays and [`Outbox::process`](crate::Outbox::process); the RabbitMQ
    /// consumer counts a message's failures, not claims.
    pub fn max_claims(mut self, max_claims: u32) -> Retry {
        self.max_claims = max_claims;
        self
    }

    /// The most tries a message gets.
    pub fn max_attempts(&self) -> u32 {
        self.max_attempts
    }

    /// The first retry's delay and the backoff's cap.
    pub fn backoff_range(&self) -> (Duration, Duration) {
        (self.backoff_min, self.backoff_max)
    }

    /// The claims in a row without an outcome after which a message is dead (see
    /// [`max_claims`](Retry::max_claims)).
    pub fn max_claims_in_a_row(&self) -> u32 {
        self.max_claims
    }
}

impl Retry {
    /// Dead when the error is permanent or the record used its last attempt; otherwise a
    /// retry after a backoff. The delay is relative: the database adds it to its own `now()`.
    /// Logs the failure: a dead letter at error level (saying whether it parks its aggregate,
    /// by its own setting or `park`), a retry at warn.
    pub(crate) fn after_failure(
        &self,
        table: &str,
        record: &Record,
        error: &PublishError,
        park: bool,
    ) -> Outcome {
        let limit = record.max_attempts.unwrap_or(self.max_attempts);
        let (key, attempt) = (&record.key, record.attempt);
        let error_is_permanent = error.is_permanent();
        let error = describe(error);
        if error_is_permanent || attempt >= limit {
            let parked = if record.parks(park) {
                " (its aggregate is parked until it is redriven or skipped)"
            } else {
                ""
            };
            log::error!("outbox {table}: {key} dead after attempt {attempt}{parked}: {error}");
            Outcome::Dead { error }
        } else {
            log::warn!("outbox {table}: {key} failed (attempt {attempt}): {error}");
            Outcome::Retry {
                delay: self.delay(attempt),
                error,
            }
        }
    }

    /// "Equal jitter": half the capped exponential delay, plus a random part of the other
    /// half, so retries of a burst spread out but never come sooner than half the schedule.
    pub(crate) fn delay(&self, attempt: u32) -> Duration {
        let exp = attempt.saturating_sub(1).min(31);
        let full = self
            .backoff_min
            .saturating_mul(1u32 << exp)
            .min(self.backoff_max)
            .max(self.backoff_min);
        // Past the longest delay a message may have, a timestamp would overflow in SQL.
        let full = full.min(MAX_DELAY);
        let half = full / 2;
        let jitter = rand::thread_rng().gen_range(0..=half.as_micros().max(1) as u64);
        half + Duration::from_micros(jitter)
    }
}

/// Capped exponential backoff for reconnecting after infrastructure errors (database,
/// broker, publisher factory): 100 ms doubling to 10 s.
pub(crate) fn reconnect_delay(failures: u32) -> Duration {
    let exp = failures.saturating_sub(1).min(7);
    (Duration::from_millis(100) * (1u32 << exp)).min(Duration::from_secs(10))
}

/// A lease a relay can keep: 100 ms to 24 h.
pub(crate) fn check_lease(lease: Duration) -> Result<()> {
    if lease < Duration::from_millis(100) || lease > Duration::from_secs(24 * 3600) {
        return Err(Error::InvalidConfig(format!(
            "lease must be between 100 ms and 24 h, got {lease:?}"
        )));
    }
    Ok(())
}

/// Retry settings that make sense: at least one attempt and claim, a positive backoff.
pub(crate) fn check_retry(retry: &Retry) -> Result<()> {
    if retry.max_attempts == 0 || retry.max_attempts > i32::MAX as u32 {
        return Err(Error::InvalidConfig(format!(
            "max_attempts must be at least 1, got {}",
            retry.max_attempts
        )));
    }
    if retry.max_claims == 0 || retry.max_claims > i32::MAX as u32 {
        return Err(Error::InvalidConfig(format!(
            "max_claims must be at least 1, got {}",
            retry.max_claims
        )));
    }
    if retry.backoff_min.is_zero() || retry.backoff_min > retry.backoff_max {
        return Err(Error::InvalidConfig(format!(
            "backoff needs 0 < min <= max, got {:?} and {:?}",
            retry.backoff_min, retry.backoff_max
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reconnect_delay_is_capped() {
        assert_eq!(reconnect_delay(1), Duration::from_millis(100));
        assert_eq!(reconnect_delay(2), Duration::from_millis(200));
        assert_eq!(reconnect_delay(50), Duration::from_secs(10));
    }

    #[test]
    fn backoff_grows_and_is_capped() {
        let p = Retry {
            max_attempts: 5,
            backoff_min: Duration::from_millis(100),
            backoff_max: Duration::from_secs(1),
            max_claims: 20,
        };
        for _ in 0..100 {
            let first = p.delay(1);
            assert!(first >= Duration::from_millis(50) && first <= Duration::from_millis(100));
            let third = p.delay(3);
            assert!(third >= Duration::from_millis(200) && third <= Duration::from_millis(400));
            let late = p.delay(40);
            assert!(late >= Duration::from_millis(500) && late <= Duration::from_secs(1));
        }
    }
}
