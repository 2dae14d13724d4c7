//! A handler thread: runs each delivery it is given in a transaction of its own, together
//! with the dedupe record, and says how it went. It never touches the broker.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{after, select, Receiver, Sender};
use postgres::error::SqlState;
use postgres::types::Type;
use uuid::Uuid;

use super::dead_letter::DEAD_CONSUMER_HEADER;
use super::delivery::{Delivery, SequenceGap};
use super::lanes::Tag;
use super::shared::Shared;
use super::sql::{self, ConsumerSql};
use crate::error::describe;
use crate::publish::metrics::NoMetrics;
use crate::publish::publisher::HandlerError;
use crate::relay::store::storable;
use crate::runtime::fault::{self, Fault};
use crate::runtime::retry::reconnect_delay;
use crate::runtime::session::{Session, Setup, Watch};

/// What a worker is asked to do.
pub(super) enum Task {
    Handle(Job),
    /// Record that the dead letter of a message given up on is stored, before the original
    /// is acked: if the ack is lost, the redelivery is acked without a second dead letter.
    Bury(Job),
    /// Delete the failure count of a message rejected to the queue's dead-letter exchange,
    /// so a redriven copy starts afresh.
    Forget(String),
}

/// A delivery to handle.
pub(super) struct Job {
    pub(super) tag: Tag,
    /// Which channel the delivery came on: tags mean nothing on another.
    pub(super) generation: u64,
    pub(super) delivery: Arc<Delivery>,
    /// Its handler may have failed before (it was redelivered, or failed here): a success
    /// must then delete its failure count.
    pub(super) suspect: bool,
    /// Set when the channel is lost: a job waiting out a database outage gives up, since it
    /// can no longer be acked and the broker will deliver it again.
    pub(super) cancelled: Arc<AtomicBool>,
}

/// How a job ended.
pub(super) enum Outcome {
    /// Committed; the transaction took this long.
    Committed(Duration),
    /// Processed before: nothing done.
    Duplicate,
    /// The handler failed, or the database refused its data; rolled back. `failures` is the
    /// message's count of failures so far, across restarts and processes; `dead`, that it is
    /// given up on (a permanent error, or its last failure), a decision kept with the count,
    /// so a redelivery goes to the dead letters without running the handler again.
    Failed {
        error: HandlerError,
        failures: u32,
        dead: bool,
    },
    /// Its dead letter is stored (recorded by a `Bury` task, or found so for a redelivery):
    /// ack it, and publish no dead letter again.
    Buried,
    /// Given up unfinished while the database was away, because of a stop or a lost channel.
    Abandoned,
}

pub(super) struct Done {
    pub(super) tag: Tag,
    pub(super) generation: u64,
    pub(super) outcome: Outcome,
}

/// Why a delivery's transaction did not commit.
enum Failure {
    /// The handler failed (or panicked), or the database refused the handler's data: the
    /// message's fault, counted towards its failures.
    Handler(HandlerError),
    /// The database or the way to it: nobody's fault, never counted.
    Database(crate::error::Error),
    /// The handler failed because of the database or the way to it (a database error of
    /// the world's in its error's source chain): never counted either.
    World(HandlerError),
    /// The handler said a service it needs is unavailable: nobody's fault either.
    Unavailable(HandlerError),
}

impl Failure {
    /// A failure of `BEGIN` or `COMMIT`, which name none of the consumer's tables.
    fn db(error: postgres::Error) -> Failure {
        Failure::classify(crate::error::Error::Db(error))
    }

    /// Anything about the server or the connection is nobody's fault; input the database
    /// refuses (a message id it cannot store) is the message's, for good: it is dead at
    /// once; anything else about the data (a deferred constraint at `COMMIT`) is one failed
    /// attempt. See `Fault`.
    fn classify(error: crate::error::Error) -> Failure {
        match Fault::of(&error) {
            Fault::World => Failure::Database(error),
            Fault::Input => Failure::Handler(HandlerError::permanent(error)),
            Fault::Message => Failure::Handler(HandlerError::transient(error)),
        }
    }

    /// The handler's error: unavailable when it says so or when a database error of the
    /// world's caused it, whatever kind the handler gave it; else its own verdict.
    fn of_handler(error: HandlerError) -> Failure {
        if error.is_unavailable() {
            return Failure::Unavailable(error);
        }
        match fault::in_chain(&error) {
            Some(Fault::World) => Failure::World(error),
            _ => Failure::Handler(error),
        }
    }
}

/// What holds a job while the world is at fault.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Held {
    /// The consumer's own statements (`BEGIN`, dedupe, `COMMIT`) or the connection.
    Database,
    /// The handler, failing on a fault of the database's.
    World,
    /// The handler, saying a service it needs is unavailable.
    Service,
    /// Counting the handler's failure.
    Count,
    /// Recording that a dead letter is stored.
    Burial,
}

pub(super) struct Worker {
    shared: Arc<Shared>,
    /// The worker's connection, held on a thread of its own (see `session.rs`): kept
    /// between deliveries, given up after any error the server did not answer, and after a
    /// statement of the consumer's own (not the handler's) that goes unanswered past the
    /// statement timeout and a margin.
    session: Session,
}

impl Worker {
    pub(super) fn new(shared: Arc<Shared>, name: &str) -> Worker {
        let config = &shared.config;
        let (timeout, app) = (
            config.statement_timeout,
            format!("outbox consumer {}", config.name),
        );
        let setup: Setup = Arc::new(move |client: &mut postgres::Client| {
            client.batch_execute(&sql::consumer_session(timeout))?;
            client.execute(sql::SET_APPLICATION_NAME, &[&app]).map(drop)
        });
        let session = Session::new(
            shared.source.clone(),
            setup,
            sql::CONSUMER_SESSION_RESET,
            statement_bound(timeout),
            &format!("consumer {} {name}", config.name),
            Arc::new(NoMetrics),
        );
        Worker { shared, session }
    }

    /// Works until the dispatcher hangs up.
    pub(super) fn run(mut self, tasks: Receiver<Task>, results: Sender<Done>) {
        for task in tasks.iter() {
            match task {
                Task::Handle(job) => {
                    let outcome = self.handle(&job);
                    let done = Done {
                        tag: job.tag,
                        generation: job.generation,
                        outcome,
                    };
                    if results.send(done).is_err() {
                        break;
                    }
                }
                Task::Bury(job) => {
                    let outcome = self.bury(&job);
                    let done = Done {
                        tag: job.tag,
                        generation: job.generation,
                        outcome,
                    };
                    if results.send(done).is_err() {
                        break;
                    }
                }
                Task::Forget(key) => self.forget(key),
            }
        }
        self.release();
    }

    /// Runs the job until its outcome says something about the message. While the database
    /// is the trouble (no connection, `BEGIN`, the dedupe write, `COMMIT`, a handler that
    /// failed on a fault of the database's, or counting a failure failing for reasons of the
    /// server or the connection) the delivery is held, unacked and uncounted, and tried again
    /// with capped backoff: an outage never costs a message one of its attempts, let alone a
    /// dead letter.
    fn handle(&mut self, job: &Job) -> Outcome {
        // Queued before a stop or a lost channel and not started: hand it back unrun.
        if self.shared.stop.is_sent() || job.cancelled.load(Ordering::SeqCst) {
            return Outcome::Abandoned;
        }
        let mut outages = 0u32;
        // A failure of the handler not yet known to be counted: counted again under the
        // same attempt, never by running the handler again, so a lost reply to the count
        // charges the failure once.
        let mut uncounted: Option<(HandlerError, Uuid)> = None;
        loop {
            let (error, held) = match uncounted.take() {
                Some((error, attempt)) => match self.count_failure(job, &error, attempt) {
                    Ok((failures, dead)) => {
                        return Outcome::Failed {
                            error,
                            failures,
                            dead,
                        }
                    }
                    // A key the database cannot store (dedupe refused it before the
                    // handler ran) cannot be counted either, nor ever processed: dead.
                    Err(e) if Fault::of(&e) == Fault::Input => {
                        return Outcome::Failed {
                            error,
                            failures: 0,
                            dead: true,
                        }
                    }
                    Err(e) => {
                        uncounted = Some((error, attempt));
                        (e, Held::Count)
                    }
                },
                None => match self.attempt(job) {
                    Ok(outcome) => return outcome,
                    Err(Failure::Handler(error)) => {
                        uncounted = Some((error, Uuid::new_v4()));
                        continue;
                    }
                    Err(Failure::Database(e)) => (e, Held::Database),
                    Err(Failure::World(e)) => {
                        (crate::error::Error::Unavailable(Box::new(e)), Held::World)
                    }
                    Err(Failure::Unavailable(e)) => {
                        (crate::error::Error::Unavailable(Box::new(e)), Held::Service)
                    }
                },
            };
            if !self.wait_out(job, error, held, &mut outages) {
                return Outcome::Abandoned;
            }
        }
    }

    /// Waits out an outage that holds a job, after letting the connection go unless a
    /// service of the handler's is the trouble; false when the job is given up meanwhile
    /// (a stop, a lost channel, or tables that are gone).
    fn wait_out(
        &mut self,
        job: &Job,
        error: crate::error::Error,
        held: Held,
        outages: &mut u32,
    ) -> bool {
        // The consumer's tables are gone: no delivery can be handled until someone
        // migrates again, and holding them all meanwhile helps nobody.
        if error.is_not_migrated() {
            self.release();
            self.shared
                .stop_consumer(crate::rabbitmq::error::Error::Database(error));
            return false;
        }
        *outages += 1;
        let pause = reconnect_delay(*outages);
        let shared = self.shared.clone();
        let (name, key) = (&shared.config.name, &job.delivery.key);
        if held != Held::Service {
            self.release();
            self.shared.observe(|m| m.database_failed(&error));
        }
        let what = match held {
            Held::Database => "the database failed while handling",
            Held::World => "the handler failed on a fault of the database's while handling",
            Held::Service => "the handler needs a service that is unavailable to handle",
            Held::Count => "cannot keep the failure count of",
            Held::Burial => "cannot record the stored dead letter of",
        };
        log::warn!(
            "rabbitmq consumer {name}: {what} {key} (not counted as a failure); holding it \
             and trying again in {pause:?}: {error}"
        );
        select! {
            recv(self.shared.stop.receiver()) -> _ => return false,
            recv(after(pause)) -> _ => {}
        }
        !job.cancelled.load(Ordering::SeqCst)
    }

    /// One transaction: dedupe, the handler, and for a suspect delivery its failure count's
    /// deletion, on the worker's connection. The consumer's own statements are bounded; the
    /// handler takes as long as it takes.
    fn attempt(&mut self, job: &Job) -> Result<Outcome, Failure> {
        let (shared, delivery, suspect) = (self.shared.clone(), job.delivery.clone(), job.suspect);
        self.session
            .run_watched(move |conn, watch| {
                Ok(attempt_on(conn.client, watch, &shared, &delivery, suspect))
            })
            .unwrap_or_else(|e| Err(Failure::classify(e)))
    }

    /// Adds one to the message's failure count, in a statement of its own after the
    /// rollback, and returns the new count and whether the message is given up on (its
    /// error is permanent or this was its last failure), which is kept with it. Counting
    /// the same `attempt` again adds nothing and answers the same.
    fn count_failure(
        &mut self,
        job: &Job,
        error: &HandlerError,
        attempt: Uuid,
    ) -> Result<(u32, bool), crate::error::Error> {
        let shared = self.shared.clone();
        let text = storable(&describe(error)).into_owned();
        let (key, permanent) = (job.delivery.key.clone(), error.is_permanent());
        // Counted on the connection the handler used, even a closed one: if the connection
        // died under the handler, counting fails too, and the failure is the database's,
        // not the message's.
        self.session.run(move |conn| {
            let config = &shared.config;
            let max_failures = i32::try_from(config.retry.max_attempts).unwrap_or(i32::MAX);
            let row = conn
                .client
                .query_one(
                    &shared.outbox.statements::<ConsumerSql>().count_failure,
                    &[
                        &config.name,
                        &key,
                        &text,
                        &permanent,
                        &max_failures,
                        &attempt,
                    ],
                )
                .map_err(|e| shared.outbox.db_error(e))?;
            let failures: i32 = row.get(0);
            Ok((u32::try_from(failures).unwrap_or(0), row.get(1)))
        })
    }

    /// Records that the job's dead letter is stored, waiting out an outage of the database
    /// meanwhile: the dispatcher acks the original only then.
    fn bury(&mut self, job: &Job) -> Outcome {
        let mut outages = 0u32;
        loop {
            let (shared, key) = (self.shared.clone(), job.delivery.key.clone());
            let marked = self.session.run(move |conn| {
                conn.client
                    .execute(
                        &shared.outbox.statements::<ConsumerSql>().mark_buried,
                        &[&shared.config.name, &key],
                    )
                    .map(drop)
                    .map_err(|e| shared.outbox.db_error(e))
            });
            match marked {
                Ok(()) => return Outcome::Buried,
                Err(e) => {
                    if !self.wait_out(job, e, Held::Burial, &mut outages) {
                        return Outcome::Abandoned;
                    }
                }
            }
        }
    }

    fn forget(&mut self, key: String) {
        let shared = self.shared.clone();
        let forgot = self.session.run(move |conn| {
            conn.client
                .execute(
                    &shared.outbox.statements::<ConsumerSql>().forget_failures,
                    &[&shared.config.name, &key],
                )
                .map(drop)
                .map_err(|e| shared.outbox.db_error(e))
        });
        if let Err(e) = forgot {
            self.release();
            // Harmless: a redriven copy would just get fewer tries; a purge of `Rows::Inbox` clears it.
            log::warn!(
                "rabbitmq consumer {}: cannot delete the failure count of a dead-lettered \
                 message: {e}",
                self.shared.config.name
            );
        }
    }

    /// Lets the connection go: back to the pool with its settings reset, or closed.
    fn release(&mut self) {
        self.session.reset();
    }
}

/// The statement bound of a handler session: its statement timeout and half as much again,
/// at least two seconds more; a minute without a statement timeout.
fn statement_bound(timeout: Duration) -> Duration {
    if timeout.is_zero() {
        return Duration::from_secs(60);
    }
    timeout + (timeout / 2).max(Duration::from_secs(2))
}

/// One transaction of [`Worker::attempt`], on the connection's thread.
///
/// Dedupe comes first, so a message processed before is acked as a duplicate whatever
/// failure count a copy of it left behind. A suspect delivery already given up on is not
/// handled again: dead-lettered, or acked if its dead letter is stored (unless it is a
/// redriven copy of that dead letter, which starts afresh). After the handler, its failure
/// count goes in the same transaction; that statement also finds a transaction the handler
/// left aborted (it ignored a failed statement and returned `Ok`), where `COMMIT` would
/// answer `ROLLBACK` without an error and the delivery would be acked with nothing stored.
fn attempt_on(
    client: &mut postgres::Client,
    watch: &Watch,
    shared: &Shared,
    delivery: &Delivery,
    suspect: bool,
) -> Result<Outcome, Failure> {
    let started = Instant::now();
    let sql: &ConsumerSql = shared.outbox.statements();
    let params: [(&(dyn postgres::types::ToSql + Sync), Type); 2] = [
        (&shared.config.name, Type::TEXT),
        (&delivery.key, Type::TEXT),
    ];
    let mut tx = client.transaction().map_err(Failure::db)?;
    let fresh = shared
        .outbox
        .dedupe(&mut tx, &shared.config.name, &delivery.key)
        .map_err(Failure::classify)?;
    if !fresh {
        if suspect {
            tx.execute_typed(&sql.forget_failures, &params)
                .map_err(|e| Failure::classify(shared.outbox.db_error(e)))?;
            tx.commit().map_err(Failure::db)?;
        }
        return Ok(Outcome::Duplicate);
    }
    if suspect {
        let given_up = tx
            .query_typed(&sql.failure_state, &params)
            .map_err(|e| Failure::classify(shared.outbox.db_error(e)))?;
        if let Some(row) = given_up.first() {
            let (failures, last_error, buried): (i32, String, bool) =
                (row.get(0), row.get(1), row.get(2));
            if !buried {
                return Ok(Outcome::Failed {
                    error: HandlerError::permanent(last_error),
                    failures: u32::try_from(failures).unwrap_or(0),
                    dead: true,
                });
            }
            if !redriven(shared, delivery) {
                return Ok(Outcome::Buried);
            }
        }
    }
    let gap = match (&delivery.aggregate_key, delivery.sequence) {
        (Some(aggregate), Some(place)) => {
            let placed: [(&(dyn postgres::types::ToSql + Sync), Type); 3] = [
                (&shared.config.name, Type::TEXT),
                (aggregate, Type::TEXT),
                (&place, Type::INT8),
            ];
            let last: Option<i64> = tx
                .query_typed_one(&sql.record_place, &placed)
                .map_err(|e| Failure::classify(shared.outbox.db_error(e)))?
                .get(0);
            SequenceGap::between(last, place)
        }
        _ => None,
    };
    // Copied only when out of sequence: the handler sees the gap on its delivery.
    let out_of_sequence;
    let delivery = match gap {
        Some(gap) => {
            report_gap(shared, delivery, &gap);
            out_of_sequence = Delivery {
                gap: Some(gap),
                ..delivery.clone()
            };
            &out_of_sequence
        }
        None => delivery,
    };
    let handle = || {
        catch_unwind(AssertUnwindSafe(|| (shared.handler)(&mut tx, delivery)))
            .unwrap_or_else(|_| Err(HandlerError::transient("handler panicked")))
    };
    #[cfg(feature = "opentelemetry")]
    let handle = || {
        let d = delivery;
        crate::trace::spans::delivered(
            &d.exchange,
            &d.routing_key,
            &d.key,
            &d.headers,
            suspect,
            handle,
        )
    };
    watch.unbounded(handle).map_err(Failure::of_handler)?;
    // The consumer's own table: missing, it is not migrated (and the consumer stops).
    tx.execute_typed(&sql.forget_failures, &params)
        .map_err(|e| match e.code() {
            Some(&SqlState::IN_FAILED_SQL_TRANSACTION) => {
                Failure::Handler(HandlerError::transient(
                    "the handler returned Ok from a transaction a failed statement had \
                     aborted (it ignored that statement's error): nothing it did could commit",
                ))
            }
            _ => Failure::classify(shared.outbox.db_error(e)),
        })?;
    tx.commit().map_err(Failure::db)?;
    Ok(Outcome::Committed(started.elapsed()))
}

/// Logs and counts a delivery out of its aggregate's sequence (never its body).
fn report_gap(shared: &Shared, delivery: &Delivery, gap: &SequenceGap) {
    let (name, key) = (&shared.config.name, &delivery.key);
    let aggregate = delivery.aggregate_key.as_deref().unwrap_or_default();
    match *gap {
        SequenceGap::Hole { expected, got } => log::warn!(
            "rabbitmq consumer {name}: aggregate {aggregate:?} skipped places {expected} to {}: \
             expected {expected}, got {got} (message {key}); its handler decides",
            got - 1
        ),
        SequenceGap::Behind { last, got } => log::warn!(
            "rabbitmq consumer {name}: aggregate {aggregate:?} is behind: processed up to \
             {last}, got {got} (message {key}); its handler decides"
        ),
    }
    shared.observe(|m| m.out_of_sequence(delivery, gap));
}

/// A copy of a dead letter of this consumer's, moved back to the queue: it carries the
/// header the dead letter was given.
fn redriven(shared: &Shared, delivery: &Delivery) -> bool {
    delivery
        .headers
        .iter()
        .any(|(name, value)| name == DEAD_CONSUMER_HEADER && *value == shared.config.name)
}
