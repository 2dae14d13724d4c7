//! Confirm rounds: the order in which a claimed batch is handed to a publisher.

use crate::publish::rounds_of;
use crate::record::Record;

/// Splits a batch (in id order) into rounds: round `k` holds the `k`-th record of every
/// aggregate's run, and round 0 also every record without an aggregate key.
///
/// The batch goes to `Publisher::publish_in_order` as the rounds one after the other: each
/// aggregate's order is kept, and every aggregate's first record comes ahead of anyone's
/// second, as the default (publishing round by round) needs.
pub(crate) fn rounds(records: Vec<Record>) -> Vec<Vec<Record>> {
    let depth = rounds_of(&records);
    let mut rounds: Vec<Vec<Record>> = Vec::new();
    rounds.resize_with(depth.iter().max().map_or(0, |d| d + 1), Vec::new);
    for (k, record) in depth.into_iter().zip(records) {
        rounds[k].push(record);
    }
    rounds
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(id: i64, aggregate: Option<&str>) -> Record {
        Record::for_tests(id, "t", aggregate)
    }

    #[test]
    fn each_round_holds_one_record_per_aggregate_in_order() {
        let batch = vec![
            record(1, Some("a")),
            record(2, None),
            record(3, Some("a")),
            record(4, Some("b")),
            record(5, None),
            record(6, Some("a")),
        ];
        let ids: Vec<Vec<i64>> = rounds(batch)
            .iter()
            .map(|round| round.iter().map(|r| r.id).collect())
            .collect();
        assert_eq!(ids, vec![vec![1, 2, 4, 5], vec![3], vec![6]]);
        assert!(rounds(Vec::new()).is_empty());
    }
}
