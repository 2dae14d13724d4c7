//! The relay's claim and outcome statements, one call each, for the model suite
//! (`tests/model.rs`): it drives them step by step, in interleavings a running relay
//! reaches only by chance, and holds the table to a model after every step. Not part of
//! the API: hidden from the docs, and changed whenever the relay changes.

use std::time::Duration;

use postgres::Client;

use crate::error::{Error, Result};
use crate::producer::outbox::Outbox;
use crate::publish::record::Record;
use crate::relay::store::{self, ClaimRequest};
use crate::runtime::conn::Conn;
use crate::runtime::retry::Outcome;

/// What one claim asks for; the fields are the relay's settings of the same names.
#[derive(Debug, Clone)]
pub struct Claim {
    /// `RelayConfig::batch_size`.
    pub rows: usize,
    /// The worker's share of `RelayConfig::max_in_flight_bytes`.
    pub bytes: usize,
    /// `RelayConfig::lease`.
    pub lease: Duration,
    /// `RelayConfig::concurrency`.
    pub workers: usize,
    /// `Retry::max_claims`.
    pub max_claims: u32,
    /// `RelayConfig::park_on_dead`.
    pub park: bool,
    /// The claim of a worker woken by a notification: ready rows only.
    pub ready_only: bool,
    /// Where the aggregate scan starts: after this key, or at the first.
    pub after: Option<String>,
    /// Payload bytes the claim's reply carries at most; the rest are read after it.
    pub inline_bytes: usize,
}

/// What one claim returned.
#[derive(Debug, Default)]
pub struct Claimed {
    /// Rows leased, in id order.
    pub records: Vec<Record>,
    /// Rows that died (or parked) at the claim: claimed more often than `max_claims`.
    pub dead: Vec<Record>,
    /// Where the next claim's scan starts.
    pub cursor: Option<String>,
}

/// One outcome of a claimed record, as the relay records it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Confirmed by the broker.
    Sent,
    /// Failed; tried again after the delay. Costs an attempt.
    Retry(Duration),
    /// Failed for good: dead, or parked if the record or the caller says so.
    Dead,
    /// Handed back unattempted (at shutdown, or behind a failure in its run).
    Release,
}

/// Runs one claim, as a relay's worker does.
pub fn claim(client: &mut Client, outbox: &Outbox, claim: &Claim) -> Result<Claimed> {
    let request = ClaimRequest {
        rows: claim.rows,
        bytes: claim.bytes,
        lease: claim.lease,
        after: claim.after.clone(),
        workers: claim.workers,
        seen: 0,
        max_claims: claim.max_claims,
        park: claim.park,
        ready_only: claim.ready_only,
        inline_bytes: claim.inline_bytes,
    };
    let mut conn = Conn::uncached(client);
    let mut claimed = store::claim(&mut conn, outbox, &request)?;
    // Every payload the reply left out, as a worker reads them, without its deadline.
    let deferred = std::mem::take(&mut claimed.deferred);
    for read in store::payload_reads(&deferred) {
        let pieces = store::read_payloads(&mut conn, outbox, &read)?;
        store::append_payloads(&mut claimed.records, pieces);
    }
    if !store::take_incomplete(&mut claimed.records, &deferred).is_empty() {
        return Err(Error::invalid(
            "claim",
            "a payload left out of the claim's reply could not be read whole",
        ));
    }
    Ok(Claimed {
        records: claimed.records,
        dead: claimed.dead.into_iter().map(|(record, _)| record).collect(),
        cursor: claimed.cursor,
    })
}

/// Records outcomes in one statement, as a relay's worker does, each fenced on the claim
/// that handed the record over. Returns how many rows changed.
pub fn record(
    client: &mut Client,
    outbox: &Outbox,
    outcomes: &[(&Record, Verdict)],
    park: bool,
) -> Result<u64> {
    let outcomes: Vec<_> = outcomes
        .iter()
        .map(|(record, verdict)| {
            let outcome = match verdict {
                Verdict::Sent => Outcome::Sent,
                Verdict::Retry(delay) => Outcome::Retry {
                    delay: *delay,
                    error: "model: failed".into(),
                },
                Verdict::Dead => Outcome::Dead {
                    error: "model: failed for good".into(),
                },
                Verdict::Release => Outcome::Release,
            };
            (record.fence(), outcome)
        })
        .collect();
    let recorded = store::record(&mut Conn::uncached(client), outbox, &outcomes, park)?;
    Ok(recorded.changed)
}
