//! Running the claim and outcome statements, with or without a statement cache.

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::time::Duration;

use postgres::types::Type;
use postgres::GenericClient;
use rand::Rng;

use crate::error::{Error, Result};
use crate::producer::outbox::Outbox;
use crate::publish::record::{Fence, Record};
use crate::relay::sql::RelaySql;
use crate::runtime::clock::micros;
use crate::runtime::conn::{count, Conn};
use crate::runtime::retry::Outcome;

/// Fails with `Error::NotMigrated` when the outbox table is missing.
pub(crate) fn probe(conn: &mut Conn<'_, impl GenericClient>, outbox: &Outbox) -> Result<()> {
    conn.query(&outbox.statements::<RelaySql>().probe, &[])
        .map_err(|e| outbox.db_error(e))?;
    Ok(())
}

/// What one claim asks for.
#[derive(Debug, Clone)]
pub(crate) struct ClaimRequest {
    /// Rows at most.
    pub(crate) rows: usize,
    /// Payload bytes at most, though never fewer than one row.
    pub(crate) bytes: usize,
    pub(crate) lease: Duration,
    /// Where the aggregate scan starts: after this key, or at the first one.
    pub(crate) after: Option<String>,
    /// How many workers share the due aggregates.
    pub(crate) workers: usize,
    /// Size runs as if at least this many aggregates were seen (the most an earlier claim
    /// of the caller's lap over the key space saw; 0: by what this claim sees).
    pub(crate) seen: i64,
    /// Claims in a row without an outcome after which a row is dead (see `Retry::max_claims`).
    pub(crate) max_claims: u32,
    /// Whether a row that dies here parks its aggregate, unless it says.
    pub(crate) park: bool,
    /// Only the ready rows, with no aggregate scan (see `claim_ready` in relay/sql.rs); `after` and
    /// `seen` are then ignored, and the result carries no cursor.
    pub(crate) ready_only: bool,
    /// Payload bytes the claim's reply carries at most; the rest is left out, for
    /// [`read_payloads`] (see `CLAIM_REPLY` in relay/sql.rs).
    pub(crate) inline_bytes: usize,
}

impl ClaimRequest {
    /// One claim of `rows` rows for a lone caller, with no byte limit.
    pub(crate) fn simple(
        rows: usize,
        lease: Duration,
        max_claims: u32,
        park: bool,
    ) -> ClaimRequest {
        ClaimRequest {
            rows,
            bytes: usize::MAX,
            lease,
            after: None,
            workers: 1,
            seen: 0,
            max_claims,
            park,
            ready_only: false,
            inline_bytes: usize::MAX,
        }
    }
}

/// What one claim returned.
#[derive(Debug, Default)]
pub(crate) struct Claimed {
    /// Leased rows to publish, in id order.
    pub(crate) records: Vec<Record>,
    /// Rows that became dead letters instead, with how many times they were claimed in a
    /// row without an outcome: more than `max_claims` allows.
    pub(crate) dead: Vec<(Record, i32)>,
    /// Leased rows that cannot be read into a `Record`, with the reason; the caller
    /// dead-letters them.
    pub(crate) undecodable: Vec<(Fence, String)>,
    /// The aggregates of the rows that died in this claim or cannot be read: their later
    /// rows in this claim must not go out ahead of them, whether they park or not.
    pub(crate) ended: HashSet<String>,
    /// Where the next claim's aggregate scan should start: after this key, or at the first.
    pub(crate) cursor: Option<String>,
    /// How many aggregates this claim saw (due or in flight) to size its runs.
    pub(crate) seen: i64,
    /// The rows whose payloads the reply left out, with their lengths, in id order: their
    /// records hold an empty payload until [`read_payloads`] fills it.
    pub(crate) deferred: Vec<(i64, usize)>,
}

impl Claimed {
    /// Rows this claim leased or finished.
    pub(crate) fn len(&self) -> usize {
        self.records.len() + self.dead.len() + self.undecodable.len()
    }
}

/// How many aggregate heads one claim may visit; bounds a claim's cost when many aggregates
/// are leased or backing off.
const MAX_HEADS_VISITED: i32 = 2_000;

/// Claims due rows under a lease; see `claim` in relay/sql.rs for which.
pub(crate) fn claim(
    conn: &mut Conn<'_, impl GenericClient>,
    outbox: &Outbox,
    request: &ClaimRequest,
) -> Result<Claimed> {
    let rows_max = i64::try_from(request.rows).unwrap_or(i64::MAX);
    let bytes = i64::try_from(request.bytes).unwrap_or(i64::MAX);
    let lease = micros(request.lease);
    let workers = i32::try_from(request.workers).unwrap_or(i32::MAX).max(1);
    let max_claims = i32::try_from(request.max_claims).unwrap_or(i32::MAX);
    let inline = i64::try_from(request.inline_bytes).unwrap_or(i64::MAX);
    let sql: &RelaySql = outbox.statements();
    let (statement, after) = match &request.after {
        _ if request.ready_only => (&sql.claim_ready, ""),
        Some(key) => (&sql.claim_after, key.as_str()),
        None => (&sql.claim, ""),
    };
    let rows = conn
        .query(
            statement,
            &[
                (&rows_max, Type::INT8),
                (&lease, Type::INT8),
                (&bytes, Type::INT8),
                (&after, Type::TEXT),
                (&MAX_HEADS_VISITED, Type::INT4),
                (&workers, Type::INT4),
                (&max_claims, Type::INT4),
                (&request.park, Type::BOOL),
                (&request.seen, Type::INT8),
                (&inline, Type::INT8),
            ],
        )
        .map_err(|e| outbox.db_error(e))?;
    let mut claimed = Claimed::default();
    // Each row is dropped once read, so its raw bytes and its Record are not held together.
    for row in rows {
        // The cursor rides on every row, and alone on an empty claim.
        claimed.cursor = row.try_get(16).map_err(Error::Db)?;
        claimed.seen = row.try_get(17).map_err(Error::Db)?;
        let Some(id) = row.try_get::<_, Option<i64>>(0).map_err(Error::Db)? else {
            continue;
        };
        let deferred: Option<i32> = row.try_get(15).map_err(Error::Db)?;
        // Dead or parked: claimed more often in a row than `max_claims` allows.
        let dead = row.try_get::<_, &str>(13).map_err(Error::Db)? != "pending";
        if dead {
            // Read alone: it must stop its aggregate even when the rest of the row is bad.
            if let Ok(Some(aggregate)) = row.try_get::<_, Option<String>>(3) {
                claimed.ended.insert(aggregate);
            }
        }
        match Record::from_row(&row) {
            Ok(record) if dead => {
                let claims = row.try_get(14).map_err(Error::Db)?;
                claimed.dead.push((record, claims));
            }
            Ok(record) => {
                if let Some(len) = deferred {
                    claimed
                        .deferred
                        .push((id, usize::try_from(len).unwrap_or(0)));
                }
                claimed.records.push(record);
            }
            Err(_) if dead => {}
            Err(e) => {
                if let Ok(Some(aggregate)) = row.try_get::<_, Option<String>>(3) {
                    claimed.ended.insert(aggregate);
                }
                let fence = Fence {
                    id,
                    attempts: row.try_get::<_, i32>(7).map_err(Error::Db)? - 1,
                    lease: row.try_get(10).map_err(Error::Db)?,
                };
                claimed
                    .undecodable
                    .push((fence, format!("the row cannot be read: {e}")));
            }
        }
    }
    // UPDATE .. RETURNING does not keep the claim's order.
    claimed.records.sort_unstable_by_key(|r| r.id);
    claimed.deferred.sort_unstable();
    Ok(claimed)
}

/// The most payload bytes one statement reads back after a claim: a reply of this size
/// crosses a link of 100 kB/s within the shortest statement deadline a relay sets.
pub(crate) const PAYLOAD_SLICE: usize = 256 << 10;

/// One statement's worth of the payloads a claim left out: whole payloads of several rows,
/// or a slice of one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PayloadRead {
    ids: Vec<i64>,
    /// The first byte read, from 1.
    from: i32,
    len: i32,
}

/// The reads that bring back the payloads `deferred` (ids and lengths, see
/// [`Claimed::deferred`]), each at most [`PAYLOAD_SLICE`] bytes, a payload longer than that
/// in slices of its own.
pub(crate) fn payload_reads(deferred: &[(i64, usize)]) -> Vec<PayloadRead> {
    let slice = i32::try_from(PAYLOAD_SLICE).unwrap_or(i32::MAX);
    let mut reads = Vec::new();
    let mut whole = PayloadRead {
        ids: Vec::new(),
        from: 1,
        len: i32::MAX,
    };
    let mut bytes = 0;
    for &(id, len) in deferred {
        if len > PAYLOAD_SLICE {
            reads.extend((0..len.div_ceil(PAYLOAD_SLICE)).map(|k| PayloadRead {
                ids: vec![id],
                from: i32::try_from(k * PAYLOAD_SLICE + 1).unwrap_or(i32::MAX),
                len: slice,
            }));
            continue;
        }
        if bytes + len > PAYLOAD_SLICE {
            reads.push(std::mem::replace(
                &mut whole,
                PayloadRead {
                    ids: Vec::new(),
                    from: 1,
                    len: i32::MAX,
                },
            ));
            bytes = 0;
        }
        whole.ids.push(id);
        bytes += len;
    }
    if !whole.ids.is_empty() {
        reads.push(whole);
    }
    reads
}

/// Runs one read of [`payload_reads`]: the ids and the bytes it brought back.
pub(crate) fn read_payloads(
    conn: &mut Conn<'_, impl GenericClient>,
    outbox: &Outbox,
    read: &PayloadRead,
) -> Result<Vec<(i64, Vec<u8>)>> {
    let rows = conn
        .query(
            &outbox.statements::<RelaySql>().payload_slices,
            &[
                (&read.ids, Type::INT8_ARRAY),
                (&read.from, Type::INT4),
                (&read.len, Type::INT4),
            ],
        )
        .map_err(|e| outbox.db_error(e))?;
    rows.iter()
        .map(|row| Ok((row.try_get(0)?, row.try_get(1)?)))
        .collect::<Result<_, postgres::Error>>()
        .map_err(Error::Db)
}

/// Appends what reads brought back to the payloads of `records` (the reads of one payload
/// come in order).
pub(crate) fn append_payloads(records: &mut [Record], pieces: Vec<(i64, Vec<u8>)>) {
    for (id, bytes) in pieces {
        if let Some(record) = records.iter_mut().find(|r| r.id == id) {
            record.payload.extend_from_slice(&bytes);
        }
    }
}

/// Takes out of `records` (in id order) those whose payloads `deferred` says are longer than
/// what they hold (reads not made, or rows gone), with every later record of their
/// aggregates: they must not go out ahead of them.
pub(crate) fn take_incomplete(records: &mut Vec<Record>, deferred: &[(i64, usize)]) -> Vec<Record> {
    let expected: HashMap<i64, usize> = deferred.iter().copied().collect();
    let mut stopped: HashSet<String> = HashSet::new();
    let (back, kept): (Vec<Record>, Vec<Record>) =
        std::mem::take(records).into_iter().partition(|record| {
            let whole = expected
                .get(&record.id)
                .is_none_or(|&len| record.payload.len() == len);
            let behind = record
                .aggregate_key
                .as_ref()
                .is_some_and(|a| stopped.contains(a));
            if !whole || behind {
                stopped.extend(record.aggregate_key.clone());
            }
            !whole || behind
        });
    *records = kept;
    back
}

/// What one `record` call changed.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Recorded {
    /// Rows changed; fewer than given when leases were lost.
    pub(crate) changed: u64,
    /// Of those, rows marked sent.
    pub(crate) sent: u64,
}

/// The longest error text stored with a row.
const MAX_ERROR_BYTES: usize = 2_000;

/// An error text PostgreSQL can store: NUL (which `text` cannot hold) becomes U+FFFD, and a
/// long text is cut at a character boundary.
pub(crate) fn storable(error: &str) -> Cow<'_, str> {
    if error.len() <= MAX_ERROR_BYTES && !error.contains('\0') {
        return Cow::Borrowed(error);
    }
    let mut end = error.len().min(MAX_ERROR_BYTES);
    while !error.is_char_boundary(end) {
        end -= 1;
    }
    let mut text = error[..end].replace('\0', "\u{fffd}");
    if end < error.len() {
        text.push_str(" [cut]");
    }
    Cow::Owned(text)
}

/// Records a batch of outcomes in one statement, each fenced on id, attempts at the claim, status
/// and lease stamp. A dead row parks its aggregate if it says so, or else if `park`.
pub(crate) fn record(
    conn: &mut Conn<'_, impl GenericClient>,
    outbox: &Outbox,
    outcomes: &[(Fence, Outcome)],
    park: bool,
) -> Result<Recorded> {
    if outcomes.is_empty() {
        return Ok(Recorded::default());
    }
    let n = outcomes.len();
    let mut ids = Vec::with_capacity(n);
    let mut attempts = Vec::with_capacity(n);
    let mut labels = Vec::with_capacity(n);
    let mut delays = Vec::with_capacity(n);
    let mut errors: Vec<Option<Cow<'_, str>>> = Vec::with_capacity(n);
    let mut leases = Vec::with_capacity(n);
    for (fence, outcome) in outcomes {
        ids.push(fence.id);
        leases.push(fence.lease);
        attempts.push(fence.attempts);
        labels.push(outcome.label());
        match outcome {
            Outcome::Retry { delay, error } => {
                delays.push(micros(*delay));
                errors.push(Some(storable(error)));
            }
            Outcome::Dead { error } => {
                delays.push(0);
                errors.push(Some(storable(error)));
            }
            Outcome::Sent | Outcome::Release => {
                delays.push(0);
                errors.push(None);
            }
        }
    }
    let errors: Vec<Option<&str>> = errors.iter().map(|e| e.as_deref()).collect();
    let slot: i16 = rand::thread_rng().gen_range(0..16);
    let rows = conn
        .query(
            &outbox.statements::<RelaySql>().record_outcomes,
            &[
                (&ids, Type::INT8_ARRAY),
                (&attempts, Type::INT4_ARRAY),
                (&labels, Type::TEXT_ARRAY),
                (&delays, Type::INT8_ARRAY),
                (&errors, Type::TEXT_ARRAY),
                (&slot, Type::INT2),
                (&leases, Type::TIMESTAMPTZ_ARRAY),
                (&park, Type::BOOL),
            ],
        )
        .map_err(|e| outbox.db_error(e))?;
    let count = |i: usize| rows.first().map_or(0, |row| count(row, i));
    Ok(Recorded {
        changed: count(0),
        sent: count(1),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payload_reads_group_small_payloads_and_slice_large_ones() {
        let slice = PAYLOAD_SLICE;
        let reads = payload_reads(&[
            (1, 100),
            (2, slice - 100),
            (3, 1),
            (4, slice * 2 + 1),
            (5, slice),
        ]);
        let at = |ids: &[i64], from: usize, len: usize| PayloadRead {
            ids: ids.to_vec(),
            from: i32::try_from(from).unwrap(),
            len: i32::try_from(len).unwrap(),
        };
        let max = i32::MAX as usize;
        assert_eq!(
            reads,
            [
                at(&[1, 2], 1, max),
                at(&[4], 1, slice),
                at(&[4], 1 + slice, slice),
                at(&[4], 1 + 2 * slice, slice),
                at(&[3], 1, max),
                at(&[5], 1, max),
            ]
        );
        assert!(payload_reads(&[]).is_empty());
    }

    #[test]
    fn incomplete_payloads_go_back_with_the_rest_of_their_aggregates() {
        let record = |id: i64, aggregate: Option<&str>, payload: &[u8]| Record {
            payload: payload.to_vec(),
            ..Record::for_tests(id, "t", aggregate)
        };
        let mut records = vec![
            record(1, Some("a"), b"x"),
            record(2, Some("a"), b""),
            record(3, Some("a"), b"zz"),
            record(4, Some("b"), b"yy"),
            record(5, None, b""),
            record(6, None, b"w"),
        ];
        let back = take_incomplete(&mut records, &[(2, 1), (4, 2), (5, 3), (6, 1)]);
        let ids = |records: &[Record]| records.iter().map(|r| r.id).collect::<Vec<_>>();
        assert_eq!(ids(&back), [2, 3, 5]);
        assert_eq!(ids(&records), [1, 4, 6]);
    }

    #[test]
    fn storable_replaces_nul_and_caps_length() {
        assert_eq!(storable("fine"), "fine");
        assert_eq!(storable("a\0b"), "a\u{fffd}b");
        let long = "é".repeat(MAX_ERROR_BYTES);
        let cut = storable(&long);
        assert!(cut.len() <= MAX_ERROR_BYTES + " [cut]".len());
        assert!(cut.ends_with(" [cut]"));
    }
}
