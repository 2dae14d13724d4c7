//! The listener: waits on LISTEN/NOTIFY and wakes the dispatcher.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;
use fallible_iterator::FallibleIterator;
use postgres::Client;

use super::pool::{Dedicated, Pooled};
use super::Shared;
use crate::retry::reconnect_delay;

/// How often the wait is cut short to see whether the relay is stopping.
const STOP_CHECK: Duration = Duration::from_millis(200);
/// How often an idle connection is checked, to catch a peer that vanished silently.
const LIVENESS_CHECK: Duration = Duration::from_secs(10);

/// Listens until the relay stops, reconnecting with capped backoff.
///
/// The connection is the relay's own when `listen_connection` was set. Otherwise it is
/// checked out of the pool and kept for the listener's whole life, so no other borrower
/// shares it while it LISTENs; before going back it UNLISTENs and drops its buffered
/// notifications, so it returns clean.
pub(crate) fn run(shared: &Shared, wake: &Sender<()>) {
    let config = &shared.config;
    let table = config.outbox.table();
    let mut failures = 0u32;
    while !shared.stopping() {
        let connection = match &config.listener {
            Some(connect) => connect()
                .map(|client| Box::new(Dedicated(client)) as Pooled)
                .map_err(crate::Error::Db),
            None => config.pool.get(),
        };
        match connection {
            Ok(mut conn) => {
                if let Err(e) = listen(shared, &mut conn, wake, &mut failures) {
                    log::warn!("outbox {table}: listener connection lost: {e}");
                }
                shared.listening.store(false, Ordering::SeqCst);
                if !conn.is_closed() {
                    let _ = conn.batch_execute("UNLISTEN *; RESET application_name");
                    let _ = conn.notifications().iter().count();
                }
            }
            Err(e) => log::warn!("outbox {table}: listener cannot get a connection: {e}"),
        }
        if shared.stopping() {
            break;
        }
        failures += 1;
        let until = Instant::now() + reconnect_delay(failures);
        while Instant::now() < until && !shared.stopping() {
            std::thread::sleep(STOP_CHECK.min(until.saturating_duration_since(Instant::now())));
        }
    }
    shared.listening.store(false, Ordering::SeqCst);
}

fn listen(
    shared: &Shared,
    client: &mut Client,
    wake: &Sender<()>,
    failures: &mut u32,
) -> Result<(), String> {
    let config = &shared.config;
    let listen = &config.outbox.statements().listen;
    let db = |e: postgres::Error| crate::Error::Db(e).to_string();
    client
        .batch_execute("SET application_name = 'postgres-outbox listener'")
        .map_err(db)?;
    client.batch_execute(listen).map_err(db)?;
    shared.listening.store(true, Ordering::SeqCst);
    *failures = 0;
    log::info!(
        "outbox {}: listening on channel {}",
        config.outbox.table(),
        config.outbox.channel()
    );
    // Anything committed while we were not listening was not announced: poll once now.
    let _ = wake.try_send(());
    let mut last_check = Instant::now();
    while !shared.stopping() {
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
            let _ = wake.try_send(());
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
