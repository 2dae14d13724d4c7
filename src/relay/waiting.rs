//! Whether this relay is waiting for work, as producers see it: a row of its own in
//! `<table>_waiting`. Enqueue notifies only while some relay has one, so producers do not
//! pay for a notification (a lock every notifying commit queues on) while every relay is
//! busy.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::error::Result;
use crate::relay::sql::RelaySql;

/// How often a waiting relay refreshes its row; enqueue ignores rows older than a minute.
const REFRESH: Duration = Duration::from_secs(10);
/// How long every worker must have been busy before the row goes: a relay that is idle
/// between bursts keeps it, rather than writing it at every burst.
const BUSY_GRACE: Duration = Duration::from_secs(1);

/// Runs a statement whose one parameter is the relay's id.
pub(crate) type Exec<'a> = &'a mut dyn FnMut(&str, &str) -> Result<()>;

pub(crate) struct Waiting {
    relay: String,
    /// Workers waiting for a wake-up or their poll.
    idle: AtomicUsize,
    state: Mutex<State>,
}

struct State {
    registered: bool,
    refreshed: Instant,
    busy_since: Option<Instant>,
}

impl Waiting {
    /// The row of relay `relay`.
    pub(crate) fn new(relay: String) -> Waiting {
        Waiting {
            relay,
            idle: AtomicUsize::new(0),
            state: Mutex::new(State {
                registered: false,
                refreshed: Instant::now(),
                busy_since: None,
            }),
        }
    }

    /// The listener has just started listening: announce the relay as waiting before it
    /// says it listens, so an enqueue that follows `Relay::is_listening` is announced. If
    /// every worker is busy, the upkeep takes the row away again after a second.
    pub(crate) fn start(&self, sql: &RelaySql, exec: Exec<'_>) {
        if let Ok(mut state) = self.state.lock() {
            state.busy_since = None;
            self.register(&mut state, sql, exec);
        }
    }

    /// A worker found nothing to claim and is about to wait. True when that made the relay
    /// known as waiting just now: the worker must claim once more, as a row committed before
    /// the row appeared was not announced.
    pub(crate) fn going_idle(&self, sql: &RelaySql, exec: Exec<'_>) -> bool {
        let Ok(mut state) = self.state.lock() else {
            return false;
        };
        state.busy_since = None;
        if state.registered {
            return false;
        }
        self.register(&mut state, sql, exec)
    }

    /// Counts the calling worker as idle until the guard drops.
    pub(crate) fn idle(&self) -> IdleGuard<'_> {
        self.idle.fetch_add(1, Ordering::SeqCst);
        IdleGuard(&self.idle)
    }

    /// The listener's upkeep, every few hundred milliseconds: refresh the row while a worker
    /// waits, register it if none did, delete it once every worker has been busy a while.
    /// True when it ran a statement.
    pub(crate) fn upkeep(&self, sql: &RelaySql, exec: Exec<'_>) -> bool {
        let Ok(mut state) = self.state.lock() else {
            return false;
        };
        if self.idle.load(Ordering::SeqCst) > 0 {
            state.busy_since = None;
            if !state.registered || state.refreshed.elapsed() >= REFRESH {
                self.register(&mut state, sql, exec);
                return true;
            }
        } else if state.registered {
            let since = *state.busy_since.get_or_insert_with(Instant::now);
            if since.elapsed() >= BUSY_GRACE {
                self.unregister(&mut state, sql, exec);
                return true;
            }
        }
        false
    }

    /// The listener is going away (stopping, or its connection is lost): nobody would hear
    /// a notification, so the row goes if it can; if not, enqueue ignores it within a
    /// minute.
    pub(crate) fn forget(&self, sql: &RelaySql, exec: Exec<'_>) {
        if let Ok(mut state) = self.state.lock() {
            if state.registered {
                self.unregister(&mut state, sql, exec);
            }
            state.registered = false;
        }
    }

    fn register(&self, state: &mut State, sql: &RelaySql, exec: Exec<'_>) -> bool {
        match exec(&sql.register_waiting, &self.relay) {
            Ok(()) => {
                let newly = !state.registered;
                state.registered = true;
                state.refreshed = Instant::now();
                newly
            }
            Err(e) => {
                log::warn!("outbox relay: cannot mark itself as waiting for work: {e}");
                false
            }
        }
    }

    fn unregister(&self, state: &mut State, sql: &RelaySql, exec: Exec<'_>) {
        match exec(&sql.unregister_waiting, &self.relay) {
            Ok(()) => {
                state.registered = false;
                state.busy_since = None;
            }
            Err(e) => log::warn!("outbox relay: cannot mark itself as busy: {e}"),
        }
    }
}

pub(crate) struct IdleGuard<'a>(&'a AtomicUsize);

impl Drop for IdleGuard<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}
