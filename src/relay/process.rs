//! The transactional handler: in-process consumers that need no broker.

use std::collections::HashSet;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Instant;

use postgres::{Client, IsolationLevel, Transaction};

use crate::error::{describe, Error, Result};
use crate::producer::outbox::Outbox;
use crate::publish::publisher::{HandlerError, PublishError};
use crate::publish::record::{Fence, Record};
use crate::relay::store::{self, ClaimRequest};
use crate::runtime::conn::Conn;
use crate::runtime::fault::Fault;
use crate::runtime::retry::Outcome;

/// The most rows one [`Outbox::process`] call claims, as for a relay's batch.
const MAX_LIMIT: usize = 10_000;

/// What one [`Outbox::process`] call did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ProcessReport {
    /// Handled and marked sent, together with the handler's writes.
    pub processed: usize,
    /// The handler failed; its writes were rolled back and the row will be retried.
    pub retried: usize,
    /// The handler failed permanently or on the last attempt; the row is a dead letter.
    pub dead: usize,
    /// The lease ran out while the handler worked and another worker took the row; the
    /// handler's writes were rolled back.
    pub lease_lost: usize,
    /// Handed back without costing an attempt: claimed but not started (the lease was
    /// nearly over, an earlier record of the same aggregate did not commit in this call, or
    /// a handler said a service it needs is unavailable), or handled and rolled back for a
    /// fault of the database, not of the record (a serialization failure or a deadlock, a
    /// lock or statement timeout, a lost connection while marking it sent or at `COMMIT`).
    pub released: usize,
    /// The handler returned [`HandlerError::unavailable`]: its writes were rolled back and
    /// the row handed back without costing an attempt, as was every record after it in this
    /// call. The first such error is kept in [`ProcessReport::unavailable_error`].
    pub unavailable: usize,
    /// Why the handler said it could not go on, if it did.
    pub unavailable_error: Option<String>,
}

impl Outbox {
    /// Claims up to `limit` due rows and runs `handler` on each, every record in its own short
    /// transaction: on `Ok` the row is marked sent in the same transaction as the handler's
    /// writes, so both commit or neither does. On `Err` (or a panic) the writes are rolled
    /// back and the row is retried with backoff, or dead-lettered if the error is permanent or
    /// the attempts are used up. A lease that ran out meanwhile (another worker took the row)
    /// rolls the handler's writes back and is counted in [`ProcessReport::lease_lost`].
    /// When the handler succeeded but marking the row sent or the `COMMIT` fails for a fault
    /// of the database (a serialization failure, a deadlock, a timeout), the writes are
    /// rolled back and the row handed back uncharged ([`ProcessReport::released`]); an error
    /// the record's own handling caused (a deferred constraint, an SQL error the handler
    /// swallowed, which leaves its transaction aborted) is a failed attempt.
    ///
    /// The claim and the final bookkeeping run READ COMMITTED whatever the session's
    /// default; the handler's transaction keeps the session's isolation level. The handler
    /// must not end that transaction itself (a `COMMIT` or `ROLLBACK` sent as SQL): the row
    /// would then be marked sent outside it, whatever became of the handler's writes.
    ///
    /// Records of one aggregate come in order; once one of them does not commit, the later
    /// ones of that aggregate in this call are handed back unhandled
    /// ([`ProcessReport::released`]), so they never run before it.
    ///
    /// ```no_run
    /// use postgres_outbox::{HandlerError, Outbox};
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let mut client = postgres::Client::connect("postgres://postgres@localhost/app", postgres::NoTls)?;
    /// let outbox = Outbox::new("orders_outbox")?;
    /// let report = outbox.process(&mut client, 100, |tx, record| {
    ///     tx.execute("INSERT INTO audit (key) VALUES ($1)", &[&record.key])
    ///         .map_err(HandlerError::transient)?;
    ///     Ok(())
    /// })?;
    /// println!("{} processed", report.processed);
    /// # Ok(())
    /// # }
    /// ```
    pub fn process<F>(
        &self,
        client: &mut Client,
        limit: usize,
        mut handler: F,
    ) -> Result<ProcessReport>
    where
        F: FnMut(&mut Transaction<'_>, &Record) -> Result<(), HandlerError>,
    {
        if limit == 0 || limit > MAX_LIMIT {
            return Err(Error::invalid(
                "limit",
                format!("process takes 1 to {MAX_LIMIT} rows per call, got {limit}"),
            ));
        }
        let lease = self.lease();
        let claimed_at = Instant::now();
        let request = ClaimRequest::simple(limit, lease, self.retry().max_claims, self.parks());
        // In a transaction of its own, to turn JIT off for it (see the relay's sessions), and
        // READ COMMITTED: under a stricter default, the claim fails whenever a row it reaches
        // changed after its snapshot, as rows do while others claim.
        let claimed = {
            let mut tx = read_committed(client)?;
            tx.batch_execute("SET LOCAL jit = off")?;
            let claimed = store::claim(&mut Conn::uncached(&mut tx), self, &request)?;
            tx.commit()?;
            claimed
        };
        let mut report = ProcessReport {
            dead: claimed.dead.len() + claimed.undecodable.len(),
            ..ProcessReport::default()
        };
        // Failures and hand-backs are written together, in one statement, at the end.
        let mut outcomes: Vec<(Fence, Outcome)> = claimed
            .undecodable
            .iter()
            .map(|(fence, reason)| {
                let error = reason.clone();
                (*fence, Outcome::Dead { error })
            })
            .collect();
        // An aggregate whose record did not commit (or died at the claim): its later records
        // wait for the next call.
        let mut stopped: HashSet<&str> = claimed.ended.iter().map(String::as_str).collect();
        for record in &claimed.records {
            let aggregate = record.aggregate_key.as_deref();
            // Leave a tenth of the lease as margin: past it, another worker may take the row.
            let late = claimed_at.elapsed() > lease - lease / 10;
            let outage = report.unavailable > 0;
            if late || outage || aggregate.is_some_and(|a| stopped.contains(a)) {
                report.released += 1;
                outcomes.push((record.fence(), Outcome::Release));
                continue;
            }
            let committed = match self.handle_one(client, record, &mut handler)? {
                Handled::Committed => {
                    report.processed += 1;
                    true
                }
                Handled::LeaseLost => {
                    log::warn!(
                        "outbox {}: lease on {} lost while its handler ran; rolled back",
                        self.table(),
                        record.key
                    );
                    report.lease_lost += 1;
                    false
                }
                // Not the record's fault: back without an attempt, and the rest after it.
                Handled::Failed(error) if error.is_unavailable() => {
                    log::warn!(
                        "outbox {}: handler unavailable on {}; handing the rest of this call \
                         back: {}",
                        self.table(),
                        record.key,
                        describe(&error)
                    );
                    report.unavailable += 1;
                    report.unavailable_error = Some(describe(&error));
                    outcomes.push((record.fence(), Outcome::Release));
                    false
                }
                Handled::Uncharged(error) => {
                    log::warn!(
                        "outbox {}: {} handled, but the database failed to mark it sent \
                         (not counted as an attempt); rolled back and handed back: {error}",
                        self.table(),
                        record.key
                    );
                    report.released += 1;
                    outcomes.push((record.fence(), Outcome::Release));
                    false
                }
                Handled::Failed(error) => {
                    let outcome =
                        self.retry()
                            .after_failure(self.table(), record, &error, self.parks());
                    match outcome {
                        Outcome::Dead { .. } => report.dead += 1,
                        _ => report.retried += 1,
                    }
                    outcomes.push((record.fence(), outcome));
                    false
                }
            };
            if let (false, Some(aggregate)) = (committed, aggregate) {
                stopped.insert(aggregate);
            }
        }
        if !outcomes.is_empty() {
            let mut tx = read_committed(client)?;
            store::record(&mut Conn::uncached(&mut tx), self, &outcomes, self.parks())?;
            tx.commit()?;
        }
        Ok(report)
    }

    fn handle_one<F>(
        &self,
        client: &mut Client,
        record: &Record,
        handler: &mut F,
    ) -> Result<Handled>
    where
        F: FnMut(&mut Transaction<'_>, &Record) -> Result<(), HandlerError>,
    {
        let mut tx = client.transaction()?;
        let result = catch_unwind(AssertUnwindSafe(|| handler(&mut tx, record)))
            .unwrap_or_else(|_| Err(PublishError::transient("handler panicked")));
        if let Err(error) = result {
            tx.rollback()?;
            return Ok(Handled::Failed(error));
        }
        // Marked sent in the handler's transaction, just before its COMMIT. A statement
        // that succeeds proves the transaction is not aborted, so the COMMIT cannot end it
        // in a rollback unseen (the server answers COMMIT in an aborted transaction with
        // ROLLBACK, and no error). If the handler swallowed an error of its own, this
        // statement is the one refused (25P02), and the record is not sent.
        let marked = store::record(
            &mut Conn::uncached(&mut tx),
            self,
            &[(record.fence(), Outcome::Sent)],
            self.parks(),
        );
        let failed = match marked {
            Ok(recorded) if recorded.changed == 0 => {
                tx.rollback()?;
                return Ok(Handled::LeaseLost);
            }
            Ok(_) => match tx.commit() {
                Ok(()) => return Ok(Handled::Committed),
                Err(e) => Error::Db(e),
            },
            Err(e) => {
                tx.rollback()?;
                e
            }
        };
        Ok(match Fault::of(&failed) {
            Fault::World => Handled::Uncharged(failed),
            // Data of the record's that the database refuses for good, at COMMIT (a
            // deferred check): no retry can store it.
            Fault::Input => Handled::Failed(PublishError::permanent(failed)),
            Fault::Message => Handled::Failed(PublishError::transient(failed)),
        })
    }
}

/// A transaction at READ COMMITTED, whatever the session's default.
fn read_committed(client: &mut Client) -> Result<Transaction<'_>> {
    Ok(client
        .build_transaction()
        .isolation_level(IsolationLevel::ReadCommitted)
        .start()?)
}

enum Handled {
    Committed,
    LeaseLost,
    Failed(PublishError),
    /// Marking the row sent or committing failed for a fault of the database's.
    Uncharged(Error),
}
