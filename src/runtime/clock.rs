//! Deadlines that saturate instead of overflowing.

use std::time::{Duration, Instant};

/// A century: "never" for any deadline a caller can mean.
const FOREVER: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// `Instant::now() + after`, capped at a century so that `Duration::MAX` means "wait for
/// ever" rather than an overflow panic.
pub(crate) fn deadline(after: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(after.min(FOREVER)).unwrap_or(now)
}

/// A database's age in seconds (`extract(epoch ..)`) as a duration: negative (clock skew
/// between statements) is zero, too large saturates.
pub(crate) fn seconds(secs: Option<f64>) -> Option<Duration> {
    secs.map(|s| Duration::try_from_secs_f64(s.max(0.0)).unwrap_or(Duration::MAX))
}

/// A duration in whole microseconds, as statements bind it: saturating (validated
/// durations never get near it).
pub(crate) fn micros(d: Duration) -> i64 {
    i64::try_from(d.as_micros()).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn huge_timeouts_saturate() {
        assert!(deadline(Duration::MAX) > Instant::now() + Duration::from_secs(3600));
        assert!(deadline(Duration::ZERO) <= Instant::now());
    }
}
