//! Confirm-round order: the order in which a claimed batch is handed to a publisher.

use crate::publish::rounds_of;
use crate::record::Record;

/// Puts a batch (in id order) in confirm-round order: the first record of every aggregate's
/// run and every record without an aggregate key, then every run's second, and so on, each
/// round in id order.
///
/// The batch goes to `Publisher::publish_in_order` in this order: each aggregate's order is
/// kept, and every aggregate's first record comes ahead of anyone's second, as the default
/// (publishing round by round) needs.
pub(crate) fn in_round_order(records: Vec<Record>) -> Vec<Record> {
    let order = rounds_of(&records).concat();
    let mut records: Vec<Option<Record>> = records.into_iter().map(Some).collect();
    order
        .into_iter()
        .filter_map(|i| records[i].take())
        .collect()
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
        assert_eq!(rounds_of(&batch), [vec![0, 1, 3, 4], vec![2], vec![5]]);
        let ids: Vec<i64> = in_round_order(batch).iter().map(|r| r.id).collect();
        // Rounds [1, 2, 4, 5], [3], [6], one after the other.
        assert_eq!(ids, [1, 2, 4, 5, 3, 6]);
        assert!(in_round_order(Vec::new()).is_empty());
    }
}
