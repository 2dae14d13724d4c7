//! Whether the relay's publishers can reach their destination, as one state for the whole
//! relay: every worker reports what it sees, and a change is logged and reported once.

use std::error::Error as StdError;
use std::sync::Mutex;
use std::time::Instant;

use crate::error::describe;
use crate::metrics::Metrics;

enum State {
    /// Nothing published or failed yet.
    Unknown,
    Up,
    /// Down since then.
    Down(Instant),
}

pub(crate) struct Health {
    state: Mutex<State>,
}

impl Health {
    pub(crate) fn new() -> Health {
        Health {
            state: Mutex::new(State::Unknown),
        }
    }

    /// A worker could not publish for a reason that is nobody's message's fault.
    pub(crate) fn down(
        &self,
        table: &str,
        cause: &(dyn StdError + 'static),
        metrics: &dyn Metrics,
    ) {
        let Ok(mut state) = self.state.lock() else {
            return;
        };
        if matches!(*state, State::Down(_)) {
            return;
        }
        *state = State::Down(Instant::now());
        log::warn!(
            "outbox {table}: publisher down: {}; claimed rows go back without costing an \
             attempt, and publishing resumes with backoff",
            describe(cause)
        );
        metrics.publisher_down(cause);
    }

    /// A worker published.
    pub(crate) fn up(&self, table: &str, metrics: &dyn Metrics) {
        let Ok(mut state) = self.state.lock() else {
            return;
        };
        match *state {
            State::Up => return,
            State::Down(since) => {
                log::info!(
                    "outbox {table}: publisher up again after {:.1} s",
                    since.elapsed().as_secs_f64()
                );
            }
            State::Unknown => {}
        }
        *state = State::Up;
        metrics.publisher_up();
    }
}
