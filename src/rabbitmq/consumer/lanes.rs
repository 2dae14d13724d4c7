//! Which held deliveries may start: one at a time per aggregate, in arrival order, and a
//! failed one only once its backoff has passed.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::time::Instant;

/// Deliveries are known by their delivery tag, which is unique on a channel.
pub(super) type Tag = u64;

/// The deliveries of one channel that are held but not yet settled.
#[derive(Default)]
pub(super) struct Lanes {
    /// Per aggregate key, its held deliveries in arrival order; the front one is started
    /// (handling or waiting out its backoff) and the rest wait behind it. A lane is removed
    /// when it empties, so the map holds only aggregates with something held.
    lanes: HashMap<String, VecDeque<Tag>>,
    /// Failed deliveries waiting out their backoff, soonest first.
    retries: BinaryHeap<Reverse<(Instant, Tag)>>,
}

impl Lanes {
    /// A delivery arrived: true when it may start now, false when an earlier delivery of its
    /// aggregate is still unsettled (it starts when that one settles). Deliveries without an
    /// aggregate promise no order and always start.
    pub(super) fn arrive(&mut self, tag: Tag, aggregate: Option<&str>) -> bool {
        let Some(aggregate) = aggregate else {
            return true;
        };
        let lane = self.lanes.entry(aggregate.to_owned()).or_default();
        lane.push_back(tag);
        lane.len() == 1
    }

    /// The delivery is settled (acked, or dead-lettered): returns the next of its aggregate,
    /// which may start now.
    pub(super) fn settle(&mut self, tag: Tag, aggregate: Option<&str>) -> Option<Tag> {
        let aggregate = aggregate?;
        let lane = self.lanes.get_mut(aggregate)?;
        if lane.front() == Some(&tag) {
            lane.pop_front();
        } else {
            // Not reachable through the dispatcher; kept exact rather than assumed.
            lane.retain(|t| *t != tag);
        }
        let next = lane.front().copied();
        if next.is_none() {
            self.lanes.remove(aggregate);
        }
        next
    }

    /// The started delivery failed and starts again at `at`; its lane stays blocked
    /// meanwhile.
    pub(super) fn retry_at(&mut self, tag: Tag, at: Instant) {
        self.retries.push(Reverse((at, tag)));
    }

    /// When the next retry is due.
    pub(super) fn next_retry(&self) -> Option<Instant> {
        self.retries.peek().map(|Reverse((at, _))| *at)
    }

    /// The retries due by `now`, soonest first.
    pub(super) fn due(&mut self, now: Instant) -> Vec<Tag> {
        let mut due = Vec::new();
        while let Some(Reverse((at, tag))) = self.retries.peek().copied() {
            if at > now {
                break;
            }
            self.retries.pop();
            due.push(tag);
        }
        due
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn one_delivery_per_aggregate_starts_and_the_next_follows_in_order() {
        let mut lanes = Lanes::default();
        assert!(lanes.arrive(1, Some("a")));
        assert!(!lanes.arrive(2, Some("a")));
        assert!(lanes.arrive(3, Some("b")));
        assert!(!lanes.arrive(4, Some("a")));
        assert!(lanes.arrive(5, None));
        assert!(lanes.arrive(6, None));
        assert_eq!(lanes.settle(1, Some("a")), Some(2));
        assert_eq!(lanes.settle(3, Some("b")), None);
        assert_eq!(lanes.settle(2, Some("a")), Some(4));
        assert_eq!(lanes.settle(4, Some("a")), None);
        assert_eq!(lanes.settle(5, None), None);
        assert!(lanes.lanes.is_empty(), "emptied lanes are dropped");
        assert!(
            lanes.arrive(7, Some("a")),
            "a drained aggregate starts at once"
        );
    }

    #[test]
    fn a_failed_delivery_keeps_its_lane_until_its_retry_is_due() {
        let mut lanes = Lanes::default();
        let now = Instant::now();
        assert!(lanes.arrive(1, Some("a")));
        assert!(!lanes.arrive(2, Some("a")));
        lanes.retry_at(1, now + Duration::from_secs(2));
        lanes.retry_at(9, now + Duration::from_secs(1));
        assert_eq!(lanes.next_retry(), Some(now + Duration::from_secs(1)));
        assert!(lanes.due(now).is_empty());
        assert_eq!(lanes.due(now + Duration::from_secs(1)), vec![9]);
        assert_eq!(lanes.due(now + Duration::from_secs(5)), vec![1]);
        assert_eq!(lanes.next_retry(), None);
        // Still blocked behind 1 until 1 settles.
        assert!(!lanes.arrive(3, Some("a")));
        assert_eq!(lanes.settle(1, Some("a")), Some(2));
    }
}
