//! Starting, stopping and waiting for the threads of a relay or a consumer.
//!
//! Both run threads that must hear one stop at once, finish what they hold by a deadline,
//! and be waited for no longer than that: a thread inside a publisher or a handler cannot be
//! interrupted, so a shutdown that joined it could hang for as long as that call does. Hence
//! no `JoinHandle::join` here. A thread holds a token (a channel's sender) that is dropped
//! however it ends, a panic included, and the caller waits for that channel to disconnect,
//! with a deadline; a thread still running past it is left to end on its own.

use std::io;
use std::sync::{Mutex, OnceLock};
use std::thread;
use std::time::Instant;

use crossbeam_channel::{bounded, Receiver, RecvTimeoutError, Sender, TryRecvError};

/// Starts a thread named `outbox-{name}`, detached. Every thread of the library carries that
/// prefix, so a thread dump tells ours apart (and so do the tests, which tell the panics they
/// inject on our threads from their own by it). Fails where `thread::spawn` would panic: a
/// system out of threads is the caller's error to report, not a crash.
pub(crate) fn spawn(name: &str, f: impl FnOnce() + Send + 'static) -> io::Result<()> {
    thread::Builder::new()
        .name(format!("outbox-{name}"))
        .spawn(f)
        .map(drop)
}

/// The one stop signal of a set of threads: a channel nothing is ever sent on, whose
/// disconnection every holder of the receiver sees at once, in `try_recv` or in a `select!`
/// beside its other channels and timers. Sending it drops the only sender.
pub(crate) struct StopSignal {
    sender: Mutex<Option<Sender<()>>>,
    receiver: Receiver<()>,
    /// When the threads must be done, once a shutdown says.
    deadline: OnceLock<Instant>,
}

impl StopSignal {
    pub(crate) fn new() -> StopSignal {
        let (sender, receiver) = bounded(0);
        StopSignal {
            sender: Mutex::new(Some(sender)),
            receiver,
            deadline: OnceLock::new(),
        }
    }

    /// Stops the threads, with no deadline yet: a thread that cannot go on stops the others
    /// this way, and the shutdown that follows sets one.
    pub(crate) fn send(&self) {
        if let Ok(mut sender) = self.sender.lock() {
            sender.take();
        }
    }

    /// Stops the threads, which have until `deadline` to finish what they hold. The deadline
    /// is set before the signal goes out, so a thread that hears the stop always finds it.
    /// Returns false, changing nothing, if a deadline was set before: a second shutdown
    /// (`Drop` after an explicit one) must not move the first one's.
    pub(crate) fn send_by(&self, deadline: Instant) -> bool {
        if self.deadline.set(deadline).is_err() {
            return false;
        }
        self.send();
        true
    }

    pub(crate) fn is_sent(&self) -> bool {
        matches!(self.receiver.try_recv(), Err(TryRecvError::Disconnected))
    }

    /// The shutdown's deadline, once one is set.
    pub(crate) fn deadline(&self) -> Option<Instant> {
        self.deadline.get().copied()
    }

    /// Whether a shutdown's deadline has passed (a stop without one never runs out).
    pub(crate) fn past_deadline(&self) -> bool {
        self.deadline()
            .is_some_and(|deadline| Instant::now() >= deadline)
    }

    /// Ready (disconnected) once the signal is sent: for a `select!`.
    pub(crate) fn receiver(&self) -> &Receiver<()> {
        &self.receiver
    }

    /// Blocks until the signal is sent.
    pub(crate) fn wait(&self) {
        let _ = self.receiver.recv();
    }
}

/// Threads waited for together, without their join handles (see the module's note).
pub(crate) struct Threads {
    /// Cloned into every thread started. The group's own copy is dropped by `wait`, after
    /// which `ended` disconnects once the last thread has ended.
    alive: Option<Sender<()>>,
    ended: Receiver<()>,
}

impl Threads {
    pub(crate) fn new() -> Threads {
        let (alive, ended) = bounded(0);
        Threads {
            alive: Some(alive),
            ended,
        }
    }

    /// Starts a thread of the group (see [`spawn`]).
    pub(crate) fn spawn(&self, name: &str, f: impl FnOnce() + Send + 'static) -> io::Result<()> {
        let alive = self.alive.clone();
        spawn(name, move || {
            let _alive = alive;
            f();
        })
    }

    /// Waits until every thread of the group has ended, or `deadline` passes; returns
    /// whether they all ended. A thread started after the first wait is not waited for.
    pub(crate) fn wait(&mut self, deadline: Instant) -> bool {
        self.alive = None;
        loop {
            match self.ended.recv_deadline(deadline) {
                Ok(()) => continue,
                Err(RecvTimeoutError::Disconnected) => return true,
                Err(RecvTimeoutError::Timeout) => return false,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn threads_are_named_for_the_library_and_waited_for_until_they_end() {
        let stop = std::sync::Arc::new(StopSignal::new());
        let mut threads = Threads::new();
        for n in 0..3 {
            let stop = stop.clone();
            threads
                .spawn(&format!("test-{n}"), move || {
                    let name = thread::current().name().map(str::to_owned);
                    assert!(name.is_some_and(|n| n.starts_with("outbox-test-")));
                    stop.wait();
                })
                .unwrap();
        }
        let soon = Instant::now() + Duration::from_millis(50);
        assert!(!threads.wait(soon), "they wait for the stop");
        assert!(stop.send_by(Instant::now() + Duration::from_secs(10)));
        assert!(threads.wait(Instant::now() + Duration::from_secs(10)));
    }

    #[test]
    fn the_first_deadline_stands_and_is_there_before_the_signal() {
        let stop = StopSignal::new();
        assert!(!stop.is_sent());
        stop.send();
        assert!(stop.is_sent());
        assert_eq!(stop.deadline(), None, "a thread that gave up sets none");
        assert!(!stop.past_deadline());
        let first = Instant::now() + Duration::from_secs(1);
        assert!(stop.send_by(first));
        assert!(!stop.send_by(first + Duration::from_secs(10)));
        assert_eq!(stop.deadline(), Some(first));
        assert!(!stop.past_deadline());
        stop.wait();
        let passed = StopSignal::new();
        assert!(passed.send_by(Instant::now()));
        assert!(passed.past_deadline());
    }

    #[test]
    fn a_group_without_threads_has_ended() {
        assert!(Threads::new().wait(Instant::now()));
    }
}
