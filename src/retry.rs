//! When a failed row is tried again, and when it gives up.

use std::time::Duration;

use rand::Rng;

use crate::error::describe;
use crate::publish::PublishError;
use crate::record::Record;

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
    /// Handed back unattempted: due at once, its attempt count restored.
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

/// Attempt limit and capped exponential backoff with jitter.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RetryPolicy {
    pub(crate) max_attempts: u32,
    pub(crate) backoff_min: Duration,
    pub(crate) backoff_max: Duration,
}

impl Default for RetryPolicy {
    fn default() -> RetryPolicy {
        RetryPolicy {
            max_attempts: 10,
            backoff_min: Duration::from_millis(500),
            backoff_max: Duration::from_secs(300),
        }
    }
}

impl RetryPolicy {
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
                delay: self.backoff(attempt),
                error,
            }
        }
    }

    /// "Equal jitter": half the capped exponential delay, plus a random part of the other
    /// half, so retries of a burst spread out but never come sooner than half the schedule.
    pub(crate) fn backoff(&self, attempt: u32) -> Duration {
        let exp = attempt.saturating_sub(1).min(31);
        let full = self
            .backoff_min
            .saturating_mul(1u32 << exp)
            .min(self.backoff_max)
            .max(self.backoff_min);
        // Past the longest delay a message may have, a timestamp would overflow in SQL.
        let full = full.min(crate::message::MAX_DELAY);
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
        let p = RetryPolicy {
            max_attempts: 5,
            backoff_min: Duration::from_millis(100),
            backoff_max: Duration::from_secs(1),
        };
        for _ in 0..100 {
            let first = p.backoff(1);
            assert!(first >= Duration::from_millis(50) && first <= Duration::from_millis(100));
            let third = p.backoff(3);
            assert!(third >= Duration::from_millis(200) && third <= Duration::from_millis(400));
            let late = p.backoff(40);
            assert!(late >= Duration::from_millis(500) && late <= Duration::from_secs(1));
        }
    }
}
