//! A worker: claims a batch, publishes it in order and records the outcomes, on a
//! connection and with a publisher of its own.
//!
//! A worker holds one batch at a time, from its claim until its outcomes are recorded, so the
//! relay's memory and the rows it keeps from other relays are bounded by its workers: a
//! worker whose publisher or database is stuck claims nothing more.

use std::collections::HashSet;
use std::error::Error as StdError;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::{Duration, Instant};

use postgres::types::ToSql;
use postgres::Client;

use super::config::RelayConfig;
use super::health::Access;
use crate::error::{describe, Result};
use crate::publish::metrics::CycleTimes;
use crate::publish::publisher::{fewer_outcomes, PublishError, Publisher};
use crate::publish::record::{Fence, Record};
use crate::publish::rounds::in_round_order;
use crate::relay::sql;
use crate::relay::store::{self, ClaimRequest, Claimed};
use crate::runtime::fault::Fault;
use crate::runtime::retry::{reconnect_delay, Outcome};
use crate::runtime::session::{Session, Setup};

/// A statement parameter a worker's connection thread can take.
pub(crate) type Param = Box<dyn ToSql + Send + Sync>;

/// What the worker reports to whoever runs it; a lone caller (`Relay::run_once`) ignores it.
pub(crate) trait Control {
    /// True once the relay is shutting down: claim nothing, hand nothing more over.
    fn stopping(&self) -> bool {
        false
    }
    /// True once shutting down and past the deadline: stop retrying anything.
    fn out_of_time(&self) -> bool {
        false
    }
    /// The worker now holds `n` more (`true`) or fewer (`false`) claimed rows whose
    /// outcomes are not recorded yet.
    fn holding(&self, _n: usize, _more: bool) {}
    /// Outcomes were recorded: `sent` rows marked sent.
    fn recorded(&self, _sent: u64) {}
    /// `n` claimed rows were handed back unpublished.
    fn released(&self, _n: usize) {}
    /// A claim came back full: more may be due, so another idle worker should look too.
    fn more_due(&self) {}
    /// A claim came back, taking rows or not.
    fn claimed(&self) {}
    /// Whether to claim now, and whether to probe a destination that is down.
    fn access(&self) -> Access {
        Access::Go
    }
    /// The publisher could not reach its destination (or could not be built): nobody's
    /// message's fault. `probe`: this cycle was the probe. Returns how long until the next
    /// try.
    fn publisher_down(&self, _cause: &(dyn StdError + 'static), _probe: bool) -> Duration {
        Duration::ZERO
    }
    /// The publisher published (or a probe found its destination answering).
    fn publisher_up(&self) {}
    /// A probe ended, with or without a verdict.
    fn probe_ended(&self) {}
}

/// A lone caller: never stopping, counting nothing.
pub(crate) struct Alone;

impl Control for Alone {}

/// What one cycle did.
#[derive(Debug)]
pub(crate) enum Cycle {
    /// Nothing was due.
    Idle,
    /// Rows were claimed and their outcomes decided (sent, retried, dead or released).
    Worked(usize),
    /// The database, the publisher factory or the publisher's destination is in trouble
    /// (`cause`, already logged or reported): wait this long first.
    Pause(Duration, crate::error::Error),
    /// The publisher's destination is down and another worker probes it, or the backoff
    /// has not passed: claim nothing before then.
    Wait(Instant),
}

pub(crate) struct Worker<'a> {
    config: &'a RelayConfig,
    session: Session,
    publisher: Option<Box<dyn Publisher>>,
    /// Where the next claim's aggregate scan starts.
    cursor: Option<String>,
    /// The most aggregates a claim saw since the scan last started at the first (0 when the
    /// next claim starts there): a claim late in the key space sees only the aggregates
    /// after its cursor, and sized by those alone its runs would be long enough to hold most
    /// of the aggregates from the other workers.
    lap_seen: i64,
    /// Whether publishing the last batch with ordered records took longer than claiming it:
    /// then its time goes to waiting for each aggregate's confirms, and runs are sized by
    /// `lap_seen`, so that every aggregate can be in flight. Otherwise the claim is the
    /// cost, and long runs of the aggregates after the cursor fill a batch per claim.
    confirm_bound: bool,
    /// The next claim first takes the ready rows alone: a producer's notification woke the
    /// worker.
    ready_first: bool,
    db_failures: u32,
}

/// Session settings of a relay connection. The statement timeout (a quarter of the lease,
/// between 1 and 30 s) bounds a statement stuck behind a lock: the server cancels it and the
/// worker retries, several times within one lease, rather than hold its batch until the
/// lease is gone. (A server that stopped answering altogether, or a stalled socket, is the
/// session's own deadline's to catch: see `session.rs`.) The application name
/// carries the table, so `pg_stat_activity` tells which outbox a backend serves. JIT is off:
/// the claim's recursive scan is estimated above `jit_above_cost`, and compiling it took
/// 35 ms of every 6 ms claim. Commits do not wait for the WAL flush (`synchronous_commit =
/// off`): a relay's commits only record what it did with a row, and a database crash that
/// undoes the last of them puts those rows back where an earlier, durable commit left
/// them, to be claimed and published again: a duplicate, never a loss, as when the relay
/// itself crashes. The flush was 0.15-0.2 ms of the 0.65-0.75 ms claim an idle relay makes
/// for a row (more on a slower disk).
///
/// Transactions are READ COMMITTED whatever the database's or the role's default: a claim
/// under REPEATABLE READ or SERIALIZABLE fails (40001) whenever a row it reaches changed
/// after its snapshot, as rows do while other workers claim, and the partition upkeep
/// settles nothing outside READ COMMITTED (its snapshot must postdate its look at the
/// transactions). Left as the server has them: `default_transaction_read_only`, by which
/// a switchover fences the old primary (see `READ_ONLY` in runtime/session.rs); `search_path`, through
/// which a table named without a schema is found; `lock_timeout`, since a wait it ends is
/// retried as any fault of the database.
fn session_setup(config: &RelayConfig) -> Setup {
    let settings = sql::relay_session(config.outbox.table_name(), statement_timeout(config.lease));
    let outbox = config.outbox.clone();
    Arc::new(move |client: &mut Client| {
        client.batch_execute(&settings)?;
        if outbox.partitioned_as_client(client)? {
            client.batch_execute(sql::PARTITIONED_PLANS)?;
        }
        Ok(())
    })
}

/// A quarter of the lease, between 1 and 30 seconds.
pub(crate) fn statement_timeout(lease: Duration) -> Duration {
    (lease / 4).clamp(Duration::from_secs(1), Duration::from_secs(30))
}

/// How long a relay waits for the database's answer to one statement before it gives the
/// connection up as stalled: the statement timeout, after which a live server answers with
/// an error, and a margin of half that, at least two seconds.
pub(crate) fn statement_bound(lease: Duration) -> Duration {
    let timeout = statement_timeout(lease);
    timeout + (timeout / 2).max(Duration::from_secs(2))
}

/// The slowest link a relay expects to the database, in bytes a second: a statement's
/// reply is kept small enough to cross it within the statement's bound.
const SLOWEST_LINK: f64 = 100_000.0;

/// The payload bytes a claim's reply carries at most: what crosses the slowest link within
/// the statement's bound (about 1.1 MB at the default lease). A claim reply that took
/// longer would be given up as stalled although the claim committed, and every claim of
/// those rows again, until `max_claims` made them dead letters: the rest of the payloads
/// are read in statements of their own (`store::read_payloads`).
pub(crate) fn inline_bytes(lease: Duration) -> usize {
    (statement_bound(lease).as_secs_f64() * SLOWEST_LINK) as usize
}

impl<'a> Worker<'a> {
    /// A worker on `config`, named `name` in its logs and its connection's thread.
    pub(crate) fn new(
        config: &'a RelayConfig,
        publisher: Option<Box<dyn Publisher>>,
        name: &str,
    ) -> Self {
        Worker {
            config,
            session: Session::new(
                config.worker_source(),
                session_setup(config),
                sql::RELAY_SESSION_RESET,
                statement_bound(config.lease),
                &format!("{} {name}", config.outbox.table()),
                config.metrics.clone(),
            ),
            publisher,
            cursor: None,
            lap_seen: 0,
            confirm_bound: false,
            ready_first: false,
            db_failures: 0,
        }
    }

    /// The table, for logs.
    pub(crate) fn table(&self) -> &str {
        self.config.outbox.table()
    }

    /// Whether the worker's connection found the table partitioned (its setup asks, once
    /// per `Outbox`); `false` before that.
    pub(crate) fn on_partitioned_table(&self) -> bool {
        self.config.outbox.known_partitioned() == Some(true)
    }

    /// Runs a statement of the relay's own bookkeeping on the worker's connection.
    pub(crate) fn execute(&mut self, sql: &str, params: Vec<Param>) -> Result<()> {
        let (sql, outbox) = (sql.to_owned(), self.config.outbox.clone());
        self.session.run(move |conn| {
            let params: Vec<&(dyn ToSql + Sync)> = params
                .iter()
                .map(|p| p.as_ref() as &(dyn ToSql + Sync))
                .collect();
            conn.client
                .execute(&sql, &params)
                .map(drop)
                .map_err(|e| outbox.db_error(e))
        })
    }

    /// The last claim failed for reasons of the database: bookkeeping waits for it.
    pub(crate) fn in_database_trouble(&self) -> bool {
        self.db_failures > 0
    }

    /// A producer's notification woke the worker: its next claim takes the ready rows first.
    pub(crate) fn notified(&mut self) {
        self.ready_first = true;
    }

    /// A running relay's worker about to wait: builds its publisher if it has none, so the
    /// next row (the first after a start, a broken publisher or a quiet spell) does not wait
    /// for a connection; one built when the worker was woken cost that row 3.5 ms. A build
    /// that fails is the destination down, as with rows waiting: backoff and probes.
    pub(crate) fn get_ready(
        &mut self,
        control: &dyn Control,
    ) -> Option<(Duration, crate::error::Error)> {
        if self.publisher.is_some() || control.stopping() {
            return None;
        }
        if !matches!(control.access(), Access::Go) {
            return None;
        }
        self.publisher(control, false).err()
    }

    /// After a panic escaped a cycle: start again with a fresh connection and publisher.
    /// The rows of that cycle stay leased and come back when the lease runs out.
    pub(crate) fn recover(&mut self) {
        self.publisher = None;
        self.session.reset();
    }

    /// Claims one batch, publishes it and records the outcomes. Errors only when the relay
    /// cannot go on (its table is gone); trouble with the database or the publisher comes
    /// back as a pause.
    pub(crate) fn cycle(&mut self, control: &dyn Control) -> Result<Cycle> {
        if control.stopping() {
            return Ok(Cycle::Idle);
        }
        let config = self.config;
        let probe = match control.access() {
            Access::Wait(until) => return Ok(Cycle::Wait(until)),
            Access::Probe => true,
            Access::Go => false,
        };
        let _probe = probe.then(|| Probing(control));
        if probe {
            // Before anything is claimed: a broken publisher is rebuilt (the probe's one
            // connection attempt); one that is not (a connection the broker blocks in a
            // resource alarm, say) is tried as it is.
            let broken = self.publisher.as_ref().is_some_and(|publisher| {
                catch_unwind(AssertUnwindSafe(|| publisher.is_broken())).unwrap_or(true)
            });
            if broken {
                self.publisher = None;
            }
            if let Err((pause, cause)) = self.publisher(control, true) {
                return Ok(Cycle::Pause(pause, cause));
            }
        }
        let claimed_at = Instant::now();
        let mut claimed = match self.claim() {
            Ok(claimed) => claimed,
            Err(e) if e.is_not_migrated() => return Err(e),
            Err(e) => {
                self.db_failures += 1;
                let pause = reconnect_delay(self.db_failures);
                log::warn!(
                    "outbox {}: claim failed, retrying in {pause:?}: {e}",
                    config.outbox.table()
                );
                return Ok(Cycle::Pause(pause, e));
            }
        };
        self.db_failures = 0;
        control.claimed();
        let n = claimed.len();
        if n == 0 {
            if probe {
                // The destination answered and nothing is due to try it further.
                control.publisher_up();
            }
            return Ok(Cycle::Idle);
        }
        log::debug!("outbox {}: claimed {n} rows", config.outbox.table());
        let _held = Held::new(control, n);
        config.metrics.claimed(n);
        if n >= config.batch_size {
            control.more_due();
        }
        // A lease is stamped by the database after the claim was sent, so measuring it from
        // before is conservative.
        let deadline = claimed_at + config.lease;
        let claimed_ordered = claimed.records.iter().any(|r| r.aggregate_key.is_some());
        let mut outcomes = self.finish_unpublishable(&claimed);
        // Half the lease for the payloads: the rest is the publisher's.
        let back = match self.read_payloads(&mut claimed, claimed_at + config.lease / 2) {
            Ok(back) => back,
            Err(e) => {
                // A fault of the world: the rows go back uncharged, claims included.
                self.db_failures += 1;
                let pause = reconnect_delay(self.db_failures);
                log::warn!(
                    "outbox {}: reading the payloads of {n} claimed rows failed, handing them \
                     back and retrying in {pause:?}: {e}",
                    config.outbox.table()
                );
                let fences = claimed.records.iter().map(Record::fence).collect();
                hand_back(config, control, fences, &mut outcomes);
                self.record(&outcomes, control)?;
                return Ok(Cycle::Pause(pause, e));
            }
        };
        if !back.is_empty() {
            log::info!(
                "outbox {}: handing {} rows back whose payloads did not arrive within half \
                 the lease (a slow link to the database?)",
                config.outbox.table(),
                back.len()
            );
            hand_back(
                config,
                control,
                back.iter().map(Record::fence).collect(),
                &mut outcomes,
            );
        }
        let published_at = Instant::now();
        let claim_took = published_at - claimed_at;
        let pause = self.publish(
            claimed.records,
            claimed.ended,
            (claimed_at, deadline),
            probe,
            control,
            &mut outcomes,
        );
        let recorded_at = Instant::now();
        let publish_took = recorded_at - published_at;
        if claimed_ordered {
            self.confirm_bound = publish_took > claim_took;
        }
        self.record(&outcomes, control)?;
        config.metrics.cycle(&CycleTimes {
            rows: n,
            claim: claim_took,
            publish: publish_took,
            record: recorded_at.elapsed(),
        });
        // Heads just recorded make their aggregates' next messages due: an idle worker can
        // take some of them while this one claims again.
        if claimed_ordered {
            control.more_due();
        }
        Ok(match pause {
            Some((pause, cause)) => Cycle::Pause(pause, cause),
            None => Cycle::Worked(n),
        })
    }

    /// One claim. A claim that takes nothing has either found nothing due, or lost every due
    /// head it saw to claims running alongside (workers scanning the same aggregates see the
    /// same heads; one wins): it looks on from where its scan stopped, and past the last
    /// aggregate from the first again, a few times before the worker goes idle.
    fn claim(&mut self) -> Result<Claimed> {
        const LOOKS: u32 = 4;
        let config = self.config;
        if std::mem::take(&mut self.ready_first) {
            let request = ClaimRequest {
                ready_only: true,
                ..self.claim_request()
            };
            let outbox = config.outbox.clone();
            let claimed = self
                .session
                .run(move |conn| store::claim(conn, &outbox, &request))?;
            if claimed.len() > 0 {
                return Ok(claimed);
            }
        }
        let mut looks = 0;
        loop {
            let request = self.claim_request();
            let from_start = request.after.is_none();
            let outbox = config.outbox.clone();
            let claimed = self
                .session
                .run(move |conn| store::claim(conn, &outbox, &request))?;
            // Past the last aggregate, the next claim starts a new lap.
            self.lap_seen = match claimed.cursor {
                Some(_) => self.lap_seen.max(claimed.seen),
                None => 0,
            };
            self.cursor = claimed.cursor.clone();
            looks += 1;
            let seen_all = from_start && claimed.cursor.is_none();
            if claimed.len() > 0 || seen_all || looks >= LOOKS {
                return Ok(claimed);
            }
        }
    }

    /// Reads the payloads the claim's reply left out, each read a statement of its own
    /// with the session's deadline, until `until`; returns the records to hand back: those
    /// whose payloads are not whole by then, and the later records of their aggregates.
    fn read_payloads(&mut self, claimed: &mut Claimed, until: Instant) -> Result<Vec<Record>> {
        let deferred = std::mem::take(&mut claimed.deferred);
        for read in store::payload_reads(&deferred) {
            if Instant::now() >= until {
                break;
            }
            let outbox = self.config.outbox.clone();
            let pieces = self
                .session
                .run(move |conn| store::read_payloads(conn, &outbox, &read))?;
            store::append_payloads(&mut claimed.records, pieces);
        }
        Ok(store::take_incomplete(&mut claimed.records, &deferred))
    }

    /// The next full claim: from the cursor, runs sized by the lap when confirms took the
    /// time.
    fn claim_request(&self) -> ClaimRequest {
        let config = self.config;
        ClaimRequest {
            rows: config.batch_size,
            bytes: config.worker_bytes(),
            lease: config.lease,
            after: self.cursor.clone(),
            workers: config.concurrency,
            seen: if self.confirm_bound { self.lap_seen } else { 0 },
            max_claims: config.retry.max_claims,
            park: config.park,
            ready_only: false,
            inline_bytes: inline_bytes(config.lease),
        }
    }

    /// Rows the claim finished itself (dead after too many claims in a row without an
    /// outcome: a crash loop) and rows that cannot be read: the latter become dead letters
    /// with the reason.
    fn finish_unpublishable(&self, claimed: &Claimed) -> Vec<(Fence, Outcome)> {
        let config = self.config;
        let table = config.outbox.table();
        for (record, claims) in &claimed.dead {
            let parked = if record.parks(config.park) {
                " (its aggregate is parked)"
            } else {
                ""
            };
            log::error!(
                "outbox {table}: {} dead{parked}: claimed {claims} times in a row without an \
                 outcome, more than max_claims allows (a crash loop?)",
                record.key,
            );
            config.metrics.dead_lettered(record);
        }
        claimed
            .undecodable
            .iter()
            .map(|(fence, reason)| {
                log::error!("outbox {table}: row {} dead: {reason}", fence.id);
                (
                    *fence,
                    Outcome::Dead {
                        error: reason.clone(),
                    },
                )
            })
            .collect()
    }

    /// Publishes the batch in order, adding an outcome for every record: each aggregate's
    /// next record goes out once the one before it is confirmed (see
    /// [`Publisher::publish_in_order`]), or, with pipelined runs, the whole batch in one
    /// call. A failed record ends its aggregate's run: the rest of that run goes back
    /// unpublished, uncharged, as do the runs of the aggregates in `ended` (whose
    /// heads died at the claim). So do all records not yet handed over when the relay stops,
    /// when the lease is nearly over, or when the publisher breaks. Returns a pause, and
    /// why, when no publisher could be built or the destination is unavailable.
    fn publish(
        &mut self,
        records: Vec<Record>,
        ended: HashSet<String>,
        (claimed_at, deadline): (Instant, Instant),
        probe: bool,
        control: &dyn Control,
        outcomes: &mut Vec<(Fence, Outcome)>,
    ) -> Option<(Duration, crate::error::Error)> {
        let config = self.config;
        let table = config.outbox.table();
        // Confirm-round order keeps each aggregate's order and puts every aggregate's first
        // record ahead of anyone's second.
        let (going, held): (Vec<Record>, Vec<Record>) =
            in_round_order(records).into_iter().partition(|r| {
                r.aggregate_key
                    .as_ref()
                    .is_none_or(|aggregate| !ended.contains(aggregate))
            });
        let mut release: Vec<Fence> = held.iter().map(Record::fence).collect();
        let mut pause = None;
        // Nothing is handed over that may outlive the lease: whoever claims the rows next
        // would publish them again, and maybe ahead of this call's confirms.
        let margin = config.lease / 10;
        let proceed = || !control.stopping() && Instant::now() + margin < deadline;
        if !going.is_empty() && !proceed() {
            release.extend(going.iter().map(Record::fence));
        } else if !going.is_empty() {
            match self.publisher(control, probe) {
                Err(unavailable) => {
                    pause = Some(unavailable);
                    release.extend(going.iter().map(Record::fence));
                }
                Ok(publisher) => {
                    let pipelined = config.pipeline_runs
                        && catch_unwind(AssertUnwindSafe(|| publisher.keeps_order()))
                            .unwrap_or(false);
                    let how = if pipelined {
                        Call::Pipelined
                    } else {
                        Call::InOrder(&proceed)
                    };
                    let attempted = attempt(config, publisher.as_mut(), &going, claimed_at, how);
                    for (record, outcome) in going.iter().zip(attempted.outcomes) {
                        match outcome {
                            Outcome::Release => release.push(record.fence()),
                            outcome => outcomes.push((record.fence(), outcome)),
                        }
                    }
                    if attempted.broken {
                        log::debug!("outbox {table}: publisher broke; building a new one");
                        self.publisher = None;
                    }
                    if let Some(cause) = attempted.outage {
                        pause = Some((
                            control.publisher_down(&cause, probe),
                            crate::error::Error::Unavailable(Box::new(cause)),
                        ));
                    } else if attempted.published {
                        control.publisher_up();
                    }
                }
            }
        }
        if !release.is_empty() {
            log::debug!("outbox {table}: handing {} rows back", release.len());
            hand_back(config, control, release, outcomes);
        }
        pause
    }

    /// The worker's publisher, built by the factory when there is none (or it is broken).
    /// A factory that fails (or panics) costs no attempt: the rows go back and the relay
    /// waits before trying again. `probe`: this is the probe of a destination that is down.
    fn publisher(
        &mut self,
        control: &dyn Control,
        probe: bool,
    ) -> Result<&mut Box<dyn Publisher>, (Duration, crate::error::Error)> {
        let config = self.config;
        let publisher = match self.publisher.take() {
            Some(publisher) => publisher,
            None => match catch_unwind(AssertUnwindSafe(|| (config.factory)()))
                .unwrap_or_else(|_| Err("the publisher factory panicked".into()))
            {
                Ok(publisher) => publisher,
                Err(e) => {
                    let pause = control.publisher_down(e.as_ref(), probe);
                    log::debug!(
                        "outbox {}: could not build a publisher, retrying in {pause:?}: {}",
                        config.outbox.table(),
                        describe(e.as_ref())
                    );
                    return Err((pause, crate::error::Error::Publisher(e)));
                }
            },
        };
        Ok(self.publisher.insert(publisher))
    }

    /// Records the batch's outcomes, retrying through database trouble for as long as it
    /// lasts: each outcome is fenced on the claim's lease stamp, so one written after the
    /// lease ran out changes nothing if the row was claimed since, and is right if it was
    /// not (a message published during an outage longer than the lease stays published, at
    /// the attempt it was). Only a relay shutting down past its deadline gives up; its rows
    /// are claimed again when their leases run out, at no attempt's cost. If the batched
    /// statement is refused for its data, the outcomes are written one by one, so one bad
    /// outcome never costs the others theirs.
    fn record(&mut self, outcomes: &[(Fence, Outcome)], control: &dyn Control) -> Result<()> {
        let config = self.config;
        let table = config.outbox.table();
        let refused = match self.write(outcomes, control)? {
            Written::Done(recorded) => {
                control.recorded(recorded.sent);
                let lost = outcomes.len() as u64 - recorded.changed;
                if lost > 0 {
                    log::warn!(
                        "outbox {table}: {lost} outcomes not recorded: their leases ran out \
                         and the rows were claimed again"
                    );
                }
                return Ok(());
            }
            Written::GaveUp => return Ok(()),
            Written::Refused(e) => e,
        };
        log::warn!(
            "outbox {table}: the batch of {} outcomes was refused ({refused}); recording them \
             one by one",
            outcomes.len()
        );
        for (fence, outcome) in outcomes {
            let refused = match self.write(&[(*fence, outcome.clone())], control)? {
                Written::Done(recorded) => {
                    control.recorded(recorded.sent);
                    continue;
                }
                Written::GaveUp => return Ok(()),
                Written::Refused(e) => e,
            };
            let reason = format!("the outcome of this attempt could not be stored: {refused}");
            log::error!("outbox {table}: row {} dead: {reason}", fence.id);
            let dead = [(*fence, Outcome::Dead { error: reason })];
            match self.write(&dead, control)? {
                Written::Done(_) | Written::GaveUp => {}
                Written::Refused(e) => log::error!(
                    "outbox {table}: row {} cannot be dead-lettered either; it stays leased \
                     until its lease runs out: {e}",
                    fence.id
                ),
            }
        }
        Ok(())
    }

    /// Writes outcomes in one statement, waiting out the world's faults with capped backoff
    /// until the database answers, or a relay shutting down is past its deadline.
    fn write(&mut self, outcomes: &[(Fence, Outcome)], control: &dyn Control) -> Result<Written> {
        let config = self.config;
        let table = config.outbox.table();
        let mut failures = 0;
        loop {
            let (outbox, batch, park) = (config.outbox.clone(), outcomes.to_vec(), config.park);
            match self
                .session
                .run(move |conn| store::record(conn, &outbox, &batch, park))
            {
                Ok(recorded) => {
                    if failures > 0 {
                        log::info!("outbox {table}: outcomes recorded after {failures} failures");
                    }
                    return Ok(Written::Done(recorded));
                }
                Err(e) if e.is_not_migrated() => return Err(e),
                Err(e) if Fault::of(&e) != Fault::World => return Ok(Written::Refused(e)),
                Err(e) => {
                    failures += 1;
                    if control.out_of_time() {
                        log::error!(
                            "outbox {table}: shutting down: giving up recording {} outcomes; \
                             the rows will be claimed again when their leases run out, at no \
                             attempt's cost: {e}",
                            outcomes.len()
                        );
                        return Ok(Written::GaveUp);
                    }
                    let pause = reconnect_delay(failures);
                    log::warn!(
                        "outbox {table}: recording {} outcomes failed, retrying in {pause:?}: {e}",
                        outcomes.len()
                    );
                    sleep_unless_out_of_time(pause, control);
                }
            }
        }
    }
}

/// Claimed rows handed back unpublished and uncharged: told to the control and the
/// metrics, and added to the outcomes to record.
fn hand_back(
    config: &RelayConfig,
    control: &dyn Control,
    fences: Vec<Fence>,
    outcomes: &mut Vec<(Fence, Outcome)>,
) {
    control.released(fences.len());
    config.metrics.released(fences.len());
    outcomes.extend(fences.into_iter().map(|fence| (fence, Outcome::Release)));
}

/// How writing outcomes ended.
enum Written {
    Done(store::Recorded),
    /// The relay is shutting down and out of time.
    GaveUp,
    /// The database refused the statement for its data.
    Refused(crate::error::Error),
}

/// Marks a cycle as the probe of a destination that is down, until it ends however it ends.
struct Probing<'c>(&'c dyn Control);

impl Drop for Probing<'_> {
    fn drop(&mut self) {
        self.0.probe_ended();
    }
}

/// Counts a batch as held until its outcomes are recorded, or given up, or a panic unwinds.
struct Held<'c> {
    control: &'c dyn Control,
    n: usize,
}

impl<'c> Held<'c> {
    fn new(control: &'c dyn Control, n: usize) -> Held<'c> {
        control.holding(n, true);
        Held { control, n }
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.control.holding(self.n, false);
    }
}

/// Sleeps `pause`, cut short once a shutting-down relay is out of time.
fn sleep_unless_out_of_time(pause: Duration, control: &dyn Control) {
    let until = Instant::now() + pause;
    while !control.out_of_time() {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return;
        }
        std::thread::sleep(left.min(Duration::from_millis(50)));
    }
}

/// How a batch is handed to the publisher.
pub(crate) enum Call<'p> {
    /// One `publish` call: every record is handed over.
    Pipelined,
    /// `publish_in_order`, asking the function before handing anything more over.
    InOrder(&'p dyn Fn() -> bool),
}

/// What one publish call came to.
pub(crate) struct Attempted {
    /// One per record: sent, retried, dead, or handed back uncharged (`Release`).
    pub(crate) outcomes: Vec<Outcome>,
    /// The publisher said it is broken after the call.
    pub(crate) broken: bool,
    /// Why records were handed back uncharged: the destination was unavailable.
    pub(crate) outage: Option<PublishError>,
    /// At least one record was published.
    pub(crate) published: bool,
}

/// Publishes `records` and decides each one's outcome. What is the record's fault costs an
/// attempt; what is the world's (an `unavailable` error, or a transient one from a publisher
/// that then reports itself broken) hands it back with its attempt restored, as does a
/// record `publish_in_order` did not hand over. A panicking publisher is a failed attempt
/// for every record it may have held without an outcome (in order: those whose
/// predecessors had all succeeded), never a dead relay.
pub(crate) fn attempt(
    config: &RelayConfig,
    publisher: &mut dyn Publisher,
    records: &[Record],
    claimed_at: Instant,
    how: Call<'_>,
) -> Attempted {
    let table = config.outbox.table();
    let mut results: Vec<Option<Result<(), PublishError>>> = Vec::with_capacity(records.len());
    results.resize_with(records.len(), || None);
    let panicked = catch_unwind(AssertUnwindSafe(|| match how {
        Call::Pipelined => {
            let mut returned = publisher.publish(records).into_iter();
            for slot in results.iter_mut() {
                *slot = Some(returned.next().unwrap_or_else(|| Err(fewer_outcomes())));
            }
        }
        Call::InOrder(proceed) => publisher.publish_in_order(records, &mut results, proceed),
    }))
    .is_err();
    if panicked {
        log::error!("outbox {table}: publisher panicked");
    }
    let broken = catch_unwind(AssertUnwindSafe(|| publisher.is_broken())).unwrap_or(true);
    let mut attempted = Attempted {
        outcomes: Vec::with_capacity(records.len()),
        broken,
        outage: None,
        published: false,
    };
    // The aggregates whose next record cannot have been handed over: one before it did
    // not succeed.
    let mut stopped: HashSet<&str> = HashSet::new();
    for (record, result) in records.iter().zip(results) {
        let aggregate = record.aggregate_key.as_deref();
        let reached = aggregate.is_none_or(|a| !stopped.contains(a));
        if !matches!(result, Some(Ok(()))) {
            stopped.extend(aggregate);
        }
        let result = match result {
            Some(result) => result,
            None if panicked && reached => Err(PublishError::transient("publisher panicked")),
            None => {
                attempted.outcomes.push(Outcome::Release);
                continue;
            }
        };
        let outcome = match result {
            Ok(()) => {
                log::trace!("outbox {table}: published {}", record.key);
                config.metrics.published(record, claimed_at.elapsed());
                attempted.published = true;
                Outcome::Sent
            }
            Err(error) if error.is_unavailable() || (broken && !error.is_permanent()) => {
                attempted.outage.get_or_insert(error);
                Outcome::Release
            }
            Err(error) => {
                config.metrics.failed(record, &error);
                let outcome = config
                    .retry
                    .after_failure(table, record, &error, config.park);
                if let Outcome::Dead { .. } = outcome {
                    config.metrics.dead_lettered(record);
                }
                outcome
            }
        };
        attempted.outcomes.push(outcome);
    }
    attempted
}
