//! A handler thread: runs each delivery it is given in a transaction of its own, together
//! with the dedupe record, and says how it went. It never touches the broker.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{after, select, Receiver, Sender};
use postgres::types::Type;

use super::delivery::Delivery;
use super::lanes::Tag;
use super::shared::Shared;
use crate::error::describe;
use crate::fault::Fault;
use crate::metrics::NoMetrics;
use crate::publish::HandlerError;
use crate::retry::reconnect_delay;
use crate::session::{Session, Setup, Watch};
use crate::sql;
use crate::store::storable;

/// What a worker is asked to do.
pub(super) enum Task {
    Handle(Job),
    /// Delete the failure count of a message that has been dead-lettered, so a redriven copy
    /// starts afresh.
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
                Task::Forget(key) => self.forget(key),
            }
        }
        self.release();
    }

    /// Runs the job until its outcome says something about the message. While the database
    /// is the trouble (no connection, `BEGIN`, the dedupe write, `COMMIT`, or counting a
    /// failure failing for reasons of the server or the connection) the delivery is held,
    /// unacked and uncounted, and tried again with capped backoff: an outage never costs a
    /// message one of its attempts, let alone a dead letter.
    fn handle(&mut self, job: &Job) -> Outcome {
        // Queued before a stop or a lost channel and not started: hand it back unrun.
        if self.shared.stop.is_sent() || job.cancelled.load(Ordering::SeqCst) {
            return Outcome::Abandoned;
        }
        let mut outages = 0u32;
        loop {
            let error = match self.attempt(job) {
                Ok(outcome) => return outcome,
                Err(Failure::Handler(error)) => match self.count_failure(job, &error) {
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
                    // Uncounted, the failure must not count: the handler runs again.
                    Err(e) => e,
                },
                Err(Failure::Database(e)) => e,
                Err(Failure::Unavailable(e)) => crate::error::Error::Unavailable(Box::new(e)),
            };
            // The consumer's tables are gone: no delivery can be handled until someone
            // migrates again, and holding them all meanwhile helps nobody.
            if error.is_not_migrated() {
                self.release();
                self.shared
                    .stop_consumer(crate::rabbitmq::error::Error::Database(error));
                return Outcome::Abandoned;
            }
            outages += 1;
            let pause = reconnect_delay(outages);
            let shared = self.shared.clone();
            let name = &shared.config.name;
            let key = &job.delivery.key;
            match &error {
                crate::error::Error::Unavailable(cause) => log::warn!(
                    "rabbitmq consumer {name}: the handler of {key} needs a service that is \
                     unavailable (not counted as a failure); trying again in {pause:?}: {}",
                    describe(cause.as_ref())
                ),
                error => {
                    self.release();
                    self.shared.observe(|m| m.database_failed(error));
                    if Fault::of(error) == Fault::World {
                        log::warn!(
                            "rabbitmq consumer {name}: the database failed while handling \
                             {key} (not counted as a failure); trying again in {pause:?}: \
                             {error}"
                        );
                    } else {
                        log::error!(
                            "rabbitmq consumer {name}: cannot keep the failure count of {key}; \
                             holding it and trying again in {pause:?}: {error}"
                        );
                    }
                }
            }
            select! {
                recv(self.shared.stop.receiver()) -> _ => return Outcome::Abandoned,
                recv(after(pause)) -> _ => {}
            }
            if job.cancelled.load(Ordering::SeqCst) {
                return Outcome::Abandoned;
            }
        }
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
    /// error is permanent or this was its last failure), which is kept with it.
    fn count_failure(
        &mut self,
        job: &Job,
        error: &HandlerError,
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
                    &shared.outbox.statements().count_failure,
                    &[&config.name, &key, &text, &permanent, &max_failures],
                )
                .map_err(|e| shared.outbox.db_error(e))?;
            let failures: i32 = row.get(0);
            Ok((u32::try_from(failures).unwrap_or(0), row.get(1)))
        })
    }

    fn forget(&mut self, key: String) {
        let shared = self.shared.clone();
        let forgot = self.session.run(move |conn| {
            conn.client
                .execute(
                    &shared.outbox.statements().forget_failures,
                    &[&shared.config.name, &key],
                )
                .map(drop)
                .map_err(|e| shared.outbox.db_error(e))
        });
        if let Err(e) = forgot {
            self.release();
            // Harmless: a redriven copy would just get fewer tries; Purge::Inbox clears it.
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

/// One transaction of [`Worker::attempt`], on the connection's thread. A suspect delivery
/// already given up on is not handled again.
fn attempt_on(
    client: &mut postgres::Client,
    watch: &Watch,
    shared: &Shared,
    delivery: &Delivery,
    suspect: bool,
) -> Result<Outcome, Failure> {
    let started = Instant::now();
    if suspect {
        let sql = shared.outbox.statements();
        let given_up = client
            .query_typed(
                &sql.failure_state,
                &[
                    (&shared.config.name, Type::TEXT),
                    (&delivery.key, Type::TEXT),
                ],
            )
            .map_err(|e| Failure::classify(shared.outbox.db_error(e)))?;
        if let Some(row) = given_up.first() {
            let (failures, last_error): (i32, String) = (row.get(0), row.get(1));
            return Ok(Outcome::Failed {
                error: HandlerError::permanent(last_error),
                failures: u32::try_from(failures).unwrap_or(0),
                dead: true,
            });
        }
    }
    let mut tx = client.transaction().map_err(Failure::db)?;
    let fresh = shared
        .outbox
        .dedupe(&mut tx, &shared.config.name, &delivery.key)
        .map_err(Failure::classify)?;
    if !fresh {
        return Ok(Outcome::Duplicate);
    }
    watch
        .unbounded(|| {
            catch_unwind(AssertUnwindSafe(|| (shared.handler)(&mut tx, delivery)))
                .unwrap_or_else(|_| Err(HandlerError::transient("handler panicked")))
        })
        .map_err(|e| {
            if e.is_unavailable() {
                Failure::Unavailable(e)
            } else {
                Failure::Handler(e)
            }
        })?;
    if suspect {
        tx.execute_typed(
            &shared.outbox.statements().forget_failures,
            &[
                (&shared.config.name, Type::TEXT),
                (&delivery.key, Type::TEXT),
            ],
        )
        // The consumer's own table: missing, it is not migrated (and the consumer stops).
        .map_err(|e| Failure::classify(shared.outbox.db_error(e)))?;
    }
    tx.commit().map_err(Failure::db)?;
    Ok(Outcome::Committed(started.elapsed()))
}
