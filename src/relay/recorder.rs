//! The recorder: writes outcomes back to the table, batched and fenced.

use std::sync::atomic::Ordering;
use std::time::Duration;

use crossbeam_channel::{Receiver, RecvTimeoutError};

use super::pool::Session;
use super::Shared;
use crate::record::Record;
use crate::retry::reconnect_delay;
use crate::retry::Outcome;
use crate::store;

/// The most outcomes written in one statement.
const MAX_BATCH: usize = 5000;

/// Writes outcomes as they come, gathering whatever has queued up meanwhile into one
/// statement; ends when every sender is gone, or at the shutdown deadline.
pub(crate) fn run(
    shared: &Shared,
    session: &mut Session,
    outcomes: &Receiver<Vec<(Record, Outcome)>>,
) {
    loop {
        let mut batch = match outcomes.recv_timeout(Duration::from_millis(100)) {
            Ok(batch) => batch,
            Err(RecvTimeoutError::Timeout) if shared.out_of_time() => return,
            Err(RecvTimeoutError::Timeout) => continue,
            Err(RecvTimeoutError::Disconnected) => return,
        };
        while batch.len() < MAX_BATCH {
            match outcomes.try_recv() {
                Ok(more) => batch.extend(more),
                Err(_) => break,
            }
        }
        write(shared, session, &batch);
    }
}

/// Writes one batch, retrying through database trouble. If it cannot be written, the rows
/// stay leased and are claimed again once the lease runs out: delivery stays at least once.
fn write(shared: &Shared, session: &mut Session, batch: &[(Record, Outcome)]) {
    let config = &shared.config;
    let table = config.outbox.table();
    let pairs: Vec<(&Record, &Outcome)> = batch.iter().map(|(r, o)| (r, o)).collect();
    let mut failures = 0;
    loop {
        match session.run(|conn| store::record(conn, &config.outbox, &pairs)) {
            Ok(recorded) => {
                shared.published.fetch_add(recorded.sent, Ordering::SeqCst);
                let lost = pairs.len() as u64 - recorded.changed;
                if lost > 0 {
                    log::warn!(
                        "outbox {table}: {lost} outcomes not recorded: their leases ran out and \
                         the rows were claimed again"
                    );
                }
                return;
            }
            Err(e) => {
                failures += 1;
                // Worth retrying while a lease could still be valid; after that the rows will
                // be reclaimed anyway.
                let pause = reconnect_delay(failures);
                if shared.out_of_time() || pause * failures > config.lease {
                    log::error!(
                        "outbox {table}: giving up recording {} outcomes; the rows will be \
                         claimed again when their leases run out: {e}",
                        pairs.len()
                    );
                    return;
                }
                log::warn!("outbox {table}: recording outcomes failed, retrying in {pause:?}: {e}");
                std::thread::sleep(pause);
            }
        }
    }
}
