//! The listener: waits on LISTEN/NOTIFY and wakes an idle worker.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crossbeam_channel::{at, select};
use fallible_iterator::FallibleIterator;

use super::shared::Shared;
use super::worker::statement_bound;
use crate::error::{Error, Result};
use crate::relay::sql::{self, RelaySql};
use crate::runtime::clock;
use crate::runtime::retry::reconnect_delay;
use crate::runtime::session::{sql_setup, Session};
use crate::schema::migrate::MigrateSql;

/// How often the wait is cut short to see whether the relay is stopping.
const STOP_CHECK: Duration = Duration::from_millis(200);
/// How often an idle connection is checked, to catch a peer that vanished silently.
const LIVENESS_CHECK: Duration = Duration::from_secs(10);
/// How long that check waits for the server's answer.
const LIVENESS_WAIT: Duration = Duration::from_secs(5);

/// Listens until the relay stops, reconnecting with capped backoff. A panic (in the driver,
/// say) is logged and the listener starts over; polling covers the gap meanwhile.
///
/// The connection is the relay's own when `connections` or `listen_connection` was set.
/// Otherwise it is checked out of the pool and kept for the listener's whole life, so no
/// other borrower shares it while it LISTENs; before going back it UNLISTENs and drops its
/// buffered notifications, so it returns clean. Like a worker's, it lives on a thread of its
/// own (see `session.rs`), so a connection that stops answering is given up after a bound
/// instead of holding the listener, and `Relay::is_listening` says false meanwhile.
pub(crate) fn run(shared: &Shared) {
    let config = &shared.config;
    let table = config.outbox.table();
    let mut session = Session::new(
        config.listener_source(),
        sql_setup(sql::LISTENER_SESSION.to_owned()),
        sql::LISTENER_SESSION_RESET,
        statement_bound(config.lease),
        &format!("{table} listener"),
        config.metrics.clone(),
    );
    let mut failures = 0u32;
    while !shared.stopping() {
        let outcome = catch_unwind(AssertUnwindSafe(|| {
            listen(shared, &mut session, &mut failures)
        }));
        shared.listening.store(false, Ordering::SeqCst);
        match outcome {
            Ok(Ok(())) => {}
            Ok(Err(e)) => log::warn!("outbox {table}: listener connection lost: {e}"),
            Err(_) => log::error!("outbox {table}: the listener panicked; starting it again"),
        }
        // Nobody hears a notification now: the relay's waiting row goes if it can (if not,
        // enqueue ignores it within a minute).
        let statements: &RelaySql = config.outbox.statements();
        shared.waiting.forget(statements, &mut |sql, relay| {
            execute(&mut session, sql, relay)
        });
        if shared.stopping() {
            break;
        }
        session.reset();
        failures += 1;
        select! {
            recv(shared.stop.receiver()) -> _ => {},
            recv(at(clock::deadline(reconnect_delay(failures)))) -> _ => {},
        }
    }
    shared.listening.store(false, Ordering::SeqCst);
}

fn listen(shared: &Shared, session: &mut Session, failures: &mut u32) -> Result<()> {
    let config = &shared.config;
    let sql: &RelaySql = config.outbox.statements();
    // The channel the producers' migrations rendered, whatever this relay calls the table.
    let channel_sql = config.outbox.statements::<MigrateSql>().channel.clone();
    let channel: String = session.run(move |conn| {
        Ok(conn
            .client
            .query_one(&channel_sql, &[])
            .map_err(Error::Db)?
            .get(0))
    })?;
    let listen = sql::listen(&channel);
    shared
        .waiting
        .start(sql, &mut |sql, relay| execute(session, sql, relay));
    run_batch(session, &listen)?;
    shared.listening.store(true, Ordering::SeqCst);
    *failures = 0;
    log::info!(
        "outbox {}: listening on channel {channel}",
        config.outbox.table()
    );
    // Anything committed while we were not listening was not announced: look once now.
    shared.wake_one();
    let mut last_check = Instant::now();
    let on_notified = shared.on_notified();
    while !shared.stopping() {
        let ran = shared
            .waiting
            .upkeep(sql, &mut |sql, relay| execute(session, sql, relay));
        if ran {
            // LISTEN again (a no-op), so it stays the last statement pg_stat_activity shows.
            run_batch(session, &listen)?;
        }
        let on_notified = on_notified.clone();
        session.run_for(STOP_CHECK, move |conn| notified(conn, on_notified))?;
        if last_check.elapsed() >= LIVENESS_CHECK {
            let listen = listen.clone();
            session.run_for(LIVENESS_WAIT, move |conn| {
                conn.client.is_valid(LIVENESS_WAIT).map_err(Error::Db)?;
                // Re-issuing LISTEN (a no-op) keeps it the last statement pg_stat_activity
                // shows.
                conn.client.batch_execute(&listen).map_err(Error::Db)
            })?;
            last_check = Instant::now();
        }
    }
    Ok(())
}

/// Waits up to `STOP_CHECK` for a notification, then takes whatever else has arrived
/// without waiting again, and calls `on_notified` once if any came.
fn notified(
    conn: &mut crate::runtime::conn::Conn<'_, postgres::Client>,
    on_notified: impl Fn(),
) -> Result<()> {
    let client = &mut *conn.client;
    {
        let mut notifications = client.notifications();
        if notifications
            .timeout_iter(STOP_CHECK)
            .next()
            .map_err(Error::Db)?
            .is_some()
        {
            on_notified();
        }
        let mut queued = notifications.iter();
        while queued.next().map_err(Error::Db)?.is_some() {}
    }
    // The iterator ends quietly on a closed connection as well as on a timeout.
    if client.is_closed() {
        client.check_connection().map_err(Error::Db)?;
    }
    Ok(())
}

fn run_batch(session: &mut Session, statement: &str) -> Result<()> {
    let statement = statement.to_owned();
    session.run(move |conn| conn.client.batch_execute(&statement).map_err(Error::Db))
}

/// Runs a statement whose one parameter is the relay's id.
fn execute(session: &mut Session, sql: &str, relay: &str) -> Result<()> {
    let (sql, relay) = (sql.to_owned(), relay.to_owned());
    session.run(move |conn| {
        conn.client
            .execute(&sql, &[&relay])
            .map(drop)
            .map_err(Error::Db)
    })
}
