//! Confirm rounds: the order in which a claimed batch is handed to a publisher, and how the
//! default `Publisher::publish_in_order` splits it.

use std::collections::HashMap;

use crate::publish::record::Record;

/// The confirm rounds of a batch in id order, as indices into it: round `k` holds the `k`-th
/// record of every aggregate's run (and round 0 also every record without an aggregate
/// key), in id order.
pub(crate) fn rounds_of(batch: &[Record]) -> Vec<Vec<usize>> {
    let mut seen: HashMap<&str, usize> = HashMap::new();
    let mut rounds: Vec<Vec<usize>> = Vec::new();
    for (i, record) in batch.iter().enumerate() {
        let round = match &record.aggregate_key {
            None => 0,
            Some(aggregate) => {
                let next = seen.entry(aggregate.as_str()).or_insert(0);
                *next += 1;
                *next - 1
            }
        };
        if rounds.len() <= round {
            rounds.resize_with(round + 1, Vec::new);
        }
        rounds[round].push(i);
    }
    rounds
}

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
