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

use crossbeam_channel::{bounded, unbounded, Receiver, RecvTimeoutError, Sender};
use fallible_iterator::FallibleIterator;
use postgres::Client;

use crate::error::{Error, Result};
use crate::lifecycle;
use crate::pool::{Pooled, Source};
use crate::sql;
use crate::store::{Conn, StatementCache};

/// How long dropping a session waits for its thread to close the connection (or return it
/// to the pool) before leaving it to finish alone.
const CLOSE_WAIT: Duration = Duration::from_secs(2);

/// A connection kept on a thread of its own, with its prepared statements and session
/// settings. A broken, stalled or read-only connection is given up and the next call opens
/// (or checks out) a fresh one. A pooled connection gets its settings reset before it goes
/// back.
pub(crate) struct Session {
    source: Source,
    /// Run on every new connection, as one simple query.
    setup: Arc<str>,
    /// Run before a pooled connection goes back.
    reset: &'static str,
    /// How long a statement may take before its connection is given up as stalled.
    bound: Duration,
    /// Names the connection's thread: `outbox-db-{name}`.
    name: String,
    line: Option<Line>,
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

/// What the connection's thread holds.
struct Held {
    source: Source,
    setup: Arc<str>,
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
        setup: String,
        reset: &'static str,
        bound: Duration,
        name: &str,
    ) -> Session {
        Session {
            source,
            setup: setup.into(),
            reset,
            bound,
            name: name.to_owned(),
            line: None,
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
        let line = match self.line.take() {
            Some(line) => line,
            None => self.start()?,
        };
        let mut bound = expected.saturating_add(self.bound);
        if !line.connected {
            bound = bound.saturating_add(self.source.connect_bound());
        }
        let (reply_to, reply) = bounded::<Reply<R>>(1);
        let job: Job = Box::new(move |held: &mut Held| {
            let result = catch_unwind(AssertUnwindSafe(|| held.run(f)));
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
        match reply.recv_timeout(bound) {
            Ok((result, connected)) => {
                self.line = Some(Line { connected, ..line });
                match result {
                    Ok(result) => result,
                    Err(panic) => resume_unwind(panic),
                }
            }
            Err(RecvTimeoutError::Timeout) => {
                // Dropping `line` lets the thread end once its wait does.
                log::warn!(
                    "outbox {}: the database did not answer within {bound:?}; giving that \
                     connection up as stalled and opening another",
                    self.name
                );
                Err(Error::Stalled(bound))
            }
            Err(RecvTimeoutError::Disconnected) => Err(Error::RelayDied(format!(
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
        let mut held = Held {
            source: self.source.clone(),
            setup: self.setup.clone(),
            reset: self.reset,
            conn: None,
        };
        lifecycle::spawn(&format!("db-{}", self.name), move || {
            let _end = end;
            for job in queue.iter() {
                job(&mut held);
            }
            held.let_go();
        })
        .map_err(|e| Error::RelayDied(format!("could not start a thread: {e}")))?;
        Ok(Line {
            jobs,
            connected: false,
            ended,
        })
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
        if !self.setup.is_empty() {
            client.batch_execute(&self.setup).map_err(Error::Db)?;
        }
        let read_only: bool = client
            .query_one(sql::READ_ONLY, &[])
            .map_err(Error::Db)?
            .get(0);
        if read_only {
            // A pool would hand the same connection out again: have the server end it, so
            // the pool opens a new one (to another host of a multi-host configuration, if
            // the pool's own asks for a server that takes writes).
            if self.source.is_pool() {
                let _ = client.batch_execute(sql::END_OWN_BACKEND);
            }
            return Err(Error::ReadOnly);
        }
        Ok(client)
    }

    /// Closes the connection, or returns it to the pool clean: settings reset, and no
    /// notification left for the next borrower.
    fn let_go(&mut self) {
        if let Some((mut client, _)) = self.conn.take() {
            if self.source.is_pool() && !client.is_closed() && !self.reset.is_empty() {
                let _ = client.batch_execute(self.reset);
                let _ = client.notifications().iter().count();
            }
        }
    }
}
