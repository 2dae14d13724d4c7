//! The listener: waits on LISTEN/NOTIFY and wakes an idle worker.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crossbeam_channel::{at, select};
use fallible_iterator::FallibleIterator;
use postgres::Client;

use super::shared::Shared;
use crate::clock;
use crate::retry::reconnect_delay;
use crate::sql;

/// How often the wait is cut short to see whether the relay is stopping.
const STOP_CHECK: Duration = Duration::from_millis(200);
/// How often an idle connection is checked, to catch a peer that vanished silently.
const LIVENESS_CHECK: Duration = Duration::from_secs(10);

/// Listens until the relay stops, reconnecting with capped backoff. A panic (in the driver,
/// say) is logged and the listener starts over; polling covers the gap meanwhile.
///
/// The connection is the relay's own when `connections` or `listen_connection` was set.
/// Otherwise it is checked out of the pool and kept for the listener's whole life, so no
/// other borrower shares it while it LISTENs; before going back it UNLISTENs and drops its
/// buffered notifications, so it returns clean.
pub(crate) fn run(shared: &Shared) {
    let table = shared.config.outbox.table();
    let mut failures = 0u32;
    while !shared.stopping() {
        let outcome = catch_unwind(AssertUnwindSafe(|| {
            connect_and_listen(shared, &mut failures)
        }));
        shared.listening.store(false, Ordering::SeqCst);
        if outcome.is_err() {
            log::error!("outbox {table}: the listener panicked; starting it again");
        }
        if shared.stopping() {
            break;
        }
        failures += 1;
        select! {
            recv(shared.stop.receiver()) -> _ => {},
            recv(at(clock::deadline(reconnect_delay(failures)))) -> _ => {},
        }
    }
    shared.listening.store(false, Ordering::SeqCst);
}

fn connect_and_listen(shared: &Shared, failures: &mut u32) {
    let table = shared.config.outbox.table();
    match shared.config.listener_source().connect() {
        Ok(mut conn) => {
            if let Err(e) = listen(shared, &mut conn, failures) {
                log::warn!("outbox {table}: listener connection lost: {e}");
            }
            shared.listening.store(false, Ordering::SeqCst);
            let sql = shared.config.outbox.statements();
            shared.waiting.forget(sql, &mut |sql, relay| {
                if conn.is_closed() {
                    return Ok(());
                }
                execute(&mut conn, sql, relay)
            });
            if !conn.is_closed() {
                let _ = conn.batch_execute("UNLISTEN *; RESET application_name");
                let _ = conn.notifications().iter().count();
            }
        }
        Err(e) => log::warn!("outbox {table}: listener cannot get a connection: {e}"),
    }
}

fn listen(shared: &Shared, client: &mut Client, failures: &mut u32) -> Result<(), String> {
    let config = &shared.config;
    let db = |e: postgres::Error| crate::Error::Db(e).to_string();
    // The channel the producers' migrations rendered, whatever this relay calls the table.
    let channel: String = client
        .query_one(&config.outbox.statements().channel, &[])
        .map_err(db)?
        .get(0);
    let listen = &sql::listen(&channel);
    client
        .batch_execute("SET application_name = 'postgres-outbox listener'")
        .map_err(db)?;
    let sql = config.outbox.statements();
    shared
        .waiting
        .start(sql, &mut |sql, relay| execute(client, sql, relay));
    client.batch_execute(listen).map_err(db)?;
    shared.listening.store(true, Ordering::SeqCst);
    *failures = 0;
    log::info!(
        "outbox {}: listening on channel {channel}",
        config.outbox.table()
    );
    // Anything committed while we were not listening was not announced: look once now.
    shared.wake_one();
    let mut last_check = Instant::now();
    while !shared.stopping() {
        let ran = shared
            .waiting
            .upkeep(sql, &mut |sql, relay| execute(client, sql, relay));
        if ran {
            // LISTEN again (a no-op), so it stays the last statement pg_stat_activity shows.
            client.batch_execute(listen).map_err(db)?;
        }
        let mut woken = false;
        {
            let mut notifications = client.notifications();
            if notifications
                .timeout_iter(STOP_CHECK)
                .next()
                .map_err(db)?
                .is_some()
            {
                woken = true;
            }
            // Take whatever else has arrived without waiting again.
            let mut queued = notifications.iter();
            while queued.next().map_err(db)?.is_some() {}
        }
        if woken {
            shared.wake_one();
        }
        // The iterator ends quietly on a closed connection as well as on a timeout.
        if client.is_closed() {
            return Err("connection closed".into());
        }
        if last_check.elapsed() >= LIVENESS_CHECK {
            client.is_valid(Duration::from_secs(5)).map_err(db)?;
            // Re-issuing LISTEN (a no-op) keeps it the last statement pg_stat_activity shows.
            client.batch_execute(listen).map_err(db)?;
            last_check = Instant::now();
        }
    }
    Ok(())
}

/// Runs a statement whose one parameter is the relay's id.
fn execute(client: &mut Client, sql: &str, relay: &str) -> crate::Result<()> {
    client
        .execute(sql, &[&relay])
        .map(drop)
        .map_err(crate::Error::Db)
}
