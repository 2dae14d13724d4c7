//! A connection a relay thread keeps, held on a thread of its own so that the relay never
//! waits on the network without a deadline it enforces itself.
//!
//! The `postgres` client waits in a socket read until the server answers. Neither the
//! server's `statement_timeout` nor TCP keepalives end that wait when the server, or a pooler
//! in front of it, stops answering on a socket whose kernel is alive: a backend stopped by a
//! signal, a hung proxy (measured before this module: a worker opened no new connection for
//! 35-40 s, as long as the stall lasted). So each session's connection lives on a thread of
//! its own that runs the statements handed to it, and the caller waits for each answer with a
//! deadline: the statement timeout plus a margin. Past it, the caller gives that thread and
//! its connection up and carries on with a new one; the old thread ends when its wait does,
//! if it ever does, and what it wrote late is fenced like any late outcome.
//!
//! A statement costs two thread hand-overs more than on the caller's own thread (tens of
//! microseconds), and a relay thread one more thread beside it.

use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use crossbeam_channel::{at, bounded, never, select, unbounded, Receiver, Sender};
use fallible_iterator::FallibleIterator;
use postgres::Client;

use crate::error::{Error, Result};
use crate::publish::metrics::Metrics;
use crate::runtime::conn::{Conn, StatementCache};
use crate::runtime::lifecycle;
use crate::runtime::pool::{Pooled, Source};

/// Whether the server takes no writes: a hot standby, or a primary made read-only (as a
/// planned switchover fences the old primary with `default_transaction_read_only`).
pub(crate) const READ_ONLY: &str =
    "SELECT pg_is_in_recovery() OR current_setting('transaction_read_only')::boolean";

/// Has the server end this connection: a pool then drops it rather than hand it out again.
pub(crate) const END_OWN_BACKEND: &str = "SELECT pg_terminate_backend(pg_backend_pid())";

/// How long dropping a session waits for its thread to close the connection (or return it
/// to the pool) before leaving it to finish alone.
const CLOSE_WAIT: Duration = Duration::from_secs(2);

/// A connection kept on a thread of its own, with its prepared statements and session
/// settings. A broken, stalled or read-only connection is given up and the next call opens
/// (or checks out) a fresh one. A pooled connection gets its settings reset before it goes
/// back.
pub(crate) struct Session {
    source: Source,
    /// Run on every new connection.
    setup: Setup,
    /// Run before a pooled connection goes back.
    reset: &'static str,
    /// How long a statement may take before its connection is given up as stalled.
    bound: Duration,
    /// Names the connection's thread: `outbox-db-{name}`.
    name: String,
    line: Option<Line>,
    /// Told of every connection given up as stalled.
    metrics: Arc<dyn Metrics>,
}

/// The thread that holds the connection, and the way to it.
struct Line {
    jobs: Sender<Job>,
    /// Whether the thread holds a connection: without one, the next call opens it first,
    /// and may take the time that takes too.
    connected: bool,
    /// Disconnects once the thread has let its connection go.
    ended: Receiver<()>,
}

type Job = Box<dyn FnOnce(&mut Held) + Send>;

/// Session settings, applied to every new connection.
pub(crate) type Setup = Arc<dyn Fn(&mut Client) -> Result<(), postgres::Error> + Send + Sync>;

/// Settings given as SQL, run as one simple query.
pub(crate) fn sql_setup(sql: String) -> Setup {
    Arc::new(move |client: &mut Client| {
        if sql.is_empty() {
            Ok(())
        } else {
            client.batch_execute(&sql)
        }
    })
}

/// What the connection's thread holds.
struct Held {
    source: Source,
    setup: Setup,
    reset: &'static str,
    conn: Option<(Pooled, StatementCache)>,
}

/// What a call's job sends back: its result (or its panic), and whether the connection is
/// still held.
type Reply<R> = (thread::Result<Result<R>>, bool);

impl Session {
    /// A session whose connections run `setup` first and `reset` before going back to a
    /// pool, and whose statements are given up after `bound`.
    pub(crate) fn new(
        source: Source,
        setup: Setup,
        reset: &'static str,
        bound: Duration,
        name: &str,
        metrics: Arc<dyn Metrics>,
    ) -> Session {
        Session {
            source,
            setup,
            reset,
            bound,
            name: name.to_owned(),
            line: None,
            metrics,
        }
    }

    /// Runs `f` on the session's connection, opening one first if needed, and waits for it
    /// no longer than the session's bound (plus the time a connection may take to open, if
    /// one is opened). Past that the connection is given up: [`Error::Stalled`].
    pub(crate) fn run<R: Send + 'static>(
        &mut self,
        f: impl FnOnce(&mut Conn<'_, Client>) -> Result<R> + Send + 'static,
    ) -> Result<R> {
        self.run_for(Duration::ZERO, f)
    }

    /// As [`run`](Session::run), for a call that takes up to `expected` by design (a wait
    /// for notifications) before the bound starts.
    pub(crate) fn run_for<R: Send + 'static>(
        &mut self,
        expected: Duration,
        f: impl FnOnce(&mut Conn<'_, Client>) -> Result<R> + Send + 'static,
    ) -> Result<R> {
        self.call(expected, move |conn, _| f(conn))
    }

    /// As [`run`](Session::run), for a call that runs code of the application's in between
    /// its statements (a handler in the transaction): the bound holds for the statements,
    /// while what `f` runs through [`Watch::unbounded`] may take as long as it takes.
    #[cfg(feature = "rabbitmq")]
    pub(crate) fn run_watched<R: Send + 'static>(
        &mut self,
        f: impl FnOnce(&mut Conn<'_, Client>, &Watch) -> Result<R> + Send + 'static,
    ) -> Result<R> {
        self.call(Duration::ZERO, f)
    }

    fn call<R: Send + 'static>(
        &mut self,
        expected: Duration,
        f: impl FnOnce(&mut Conn<'_, Client>, &Watch) -> Result<R> + Send + 'static,
    ) -> Result<R> {
        let line = match self.line.take() {
            Some(line) => line,
            None => self.start()?,
        };
        let mut bound = expected.saturating_add(self.bound);
        if !line.connected {
            bound = bound.saturating_add(self.source.connect_bound());
        }
        let (reply_to, reply) = bounded::<Reply<R>>(1);
        let (phase_to, phases) = unbounded::<bool>();
        let job: Job = Box::new(move |held: &mut Held| {
            let watch = Watch(phase_to);
            let result = catch_unwind(AssertUnwindSafe(|| held.run(|conn| f(conn, &watch))));
            if result.is_err() {
                held.let_go();
            }
            let _ = reply_to.send((result, held.conn.is_some()));
        });
        if line.jobs.send(job).is_err() {
            return Err(Error::RelayDied(format!(
                "the database connection's thread of {} ended",
                self.name
            )));
        }
        let mut deadline = Some(crate::runtime::clock::deadline(bound));
        let mut phases = Some(phases);
        let outcome = loop {
            let timer = match deadline {
                Some(deadline) => at(deadline),
                None => never(),
            };
            let watched = phases.clone().unwrap_or_else(never);
            select! {
                recv(reply) -> answer => break answer.ok(),
                recv(watched) -> phase => match phase {
                    // Code of the application's runs: no bound until our statements again.
                    Ok(false) => deadline = None,
                    Ok(true) => deadline = Some(crate::runtime::clock::deadline(self.bound)),
                    Err(_) => phases = None,
                },
                recv(timer) -> _ => {
                    // Dropping `line` lets the thread end once its wait does.
                    log::warn!(
                        "outbox {}: the database did not answer within {bound:?}; giving that \
                         connection up as stalled and opening another",
                        self.name
                    );
                    self.metrics.database_stalled(bound);
                    return Err(Error::Stalled(bound));
                }
            }
        };
        match outcome {
            Some((result, connected)) => {
                self.line = Some(Line { connected, ..line });
                match result {
                    Ok(result) => result,
                    Err(panic) => resume_unwind(panic),
                }
            }
            None => Err(Error::RelayDied(format!(
                "the database connection's thread of {} ended",
                self.name
            ))),
        }
    }

    /// Gives the connection up, so the next call starts afresh; its thread closes it (or
    /// returns it to the pool) on its own.
    pub(crate) fn reset(&mut self) {
        self.line = None;
    }

    fn start(&self) -> Result<Line> {
        let (jobs, queue) = unbounded::<Job>();
        let (end, ended) = bounded::<()>(0);
        let held = Held {
            source: self.source.clone(),
            setup: self.setup.clone(),
            reset: self.reset,
            conn: None,
        };
        lifecycle::spawn(&format!("db-{}", self.name), move || {
            let _end = end;
            // Dropped before `_end`, so its connection is let go before `ended` says so.
            let mut held = held;
            for job in queue.iter() {
                job(&mut held);
            }
        })
        .map_err(|e| Error::RelayDied(format!("could not start a thread: {e}")))?;
        Ok(Line {
            jobs,
            connected: false,
            ended,
        })
    }
}

/// What a call's code tells the session: when it runs code of the application's, which
/// no bound holds.
#[cfg_attr(not(feature = "rabbitmq"), allow(dead_code))]
pub(crate) struct Watch(Sender<bool>);

#[cfg(feature = "rabbitmq")]
impl Watch {
    /// Runs `f` without the session's bound: the caller waits for it as long as it takes,
    /// and the bound starts again after it.
    pub(crate) fn unbounded<T>(&self, f: impl FnOnce() -> T) -> T {
        let _ = self.0.send(false);
        let result = f();
        let _ = self.0.send(true);
        result
    }
}

impl Drop for Session {
    /// Lets the connection go, waiting a little for it: a relay that has stopped has closed
    /// its connections (or returned them), unless one is stalled.
    fn drop(&mut self) {
        if let Some(Line { jobs, ended, .. }) = self.line.take() {
            drop(jobs);
            let _ = ended.recv_timeout(CLOSE_WAIT);
        }
    }
}

/// However the thread ends, its connection goes back to the pool clean, or not at all.
impl Drop for Held {
    fn drop(&mut self) {
        self.let_go();
    }
}

impl Held {
    /// Runs `f` on the connection, opening one first if needed. A server error leaves the
    /// connection as it is; any other error (I/O, a closed socket) says nothing good about
    /// it, and it goes.
    fn run<R>(&mut self, f: impl FnOnce(&mut Conn<'_, Client>) -> Result<R>) -> Result<R> {
        let (client, cache) = match &mut self.conn {
            Some(conn) => conn,
            None => {
                let client = self.open()?;
                self.conn.insert((client, StatementCache::default()))
            }
        };
        let result = f(&mut Conn {
            client: &mut **client,
            cache: Some(cache),
        });
        if let Err(e) = &result {
            if client.is_closed() || e.as_db_error().is_none() || e.is_read_only() {
                self.let_go();
            }
        }
        result
    }

    /// A new connection with the session's settings, on a server that takes writes.
    fn open(&self) -> Result<Pooled> {
        let mut client = self.source.connect()?;
        // A panic too: unwinding would drop the connection back into the pool as it is.
        match catch_unwind(AssertUnwindSafe(|| self.set_up(&mut client))) {
            Ok(Ok(())) => Ok(client),
            Ok(Err(e)) => {
                self.end_pooled(&mut client);
                Err(e)
            }
            Err(panic) => {
                self.end_pooled(&mut client);
                resume_unwind(panic)
            }
        }
    }

    fn set_up(&self, client: &mut Client) -> Result<()> {
        (self.setup)(client).map_err(Error::Db)?;
        let read_only: bool = client.query_one(READ_ONLY, &[]).map_err(Error::Db)?.get(0);
        if read_only {
            return Err(Error::ReadOnly);
        }
        Ok(())
    }

    /// Has the server end a pooled connection this session may have set up in part, or that
    /// is on a read-only server: a pool would hand it out again, to the application with
    /// the session's settings (a relay's commits do not wait for the WAL flush), or to
    /// this session on the same server. The pool then opens a new one (to another host of
    /// a multi-host configuration, if the pool's own asks for a server that takes writes).
    fn end_pooled(&self, client: &mut Client) {
        if self.source.is_pool() && !client.is_closed() {
            let _ = client.batch_execute(END_OWN_BACKEND);
        }
    }

    /// Closes the connection, or returns it to the pool clean: settings reset, and no
    /// notification left for the next borrower; one whose reset fails is ended instead.
    fn let_go(&mut self) {
        if let Some((mut client, _)) = self.conn.take() {
            if self.source.is_pool() && !client.is_closed() && !self.reset.is_empty() {
                if client.batch_execute(self.reset).is_err() {
                    self.end_pooled(&mut client);
                }
                let _ = client.notifications().iter().count();
            }
        }
    }
}
