//! Deadlines for the calls a thread makes on an amiquip connection.
//!
//! amiquip waits for the broker's answer to every synchronous method (opening a channel, a
//! declare, `confirm.select`, a consumer's cancel, a channel's close, which `Drop` runs
//! too) with no timeout. A broker that stops reading a connection never answers: during a
//! memory or disk alarm RabbitMQ stops reading every connection that published (a consumer's
//! dead letter is enough) until the alarm clears, and its heartbeats go on meanwhile, so
//! amiquip never gives up. The crate keeps a handle on the socket under the connection and
//! shuts it down when a call overruns its deadline: amiquip's I/O thread then fails, and
//! with it the call under way and every later one on the connection, at once.

use std::net::{Shutdown, TcpStream};
use std::thread;
use std::time::Duration;

use amiquip::Connection;
use crossbeam_channel::{bounded, RecvTimeoutError};

use crate::runtime::lifecycle;

/// How long a closed connection's I/O thread may take to end once its socket is cut.
const AFTER_CUT: Duration = Duration::from_secs(2);

/// The socket under one connection.
pub(crate) struct Cutter {
    socket: TcpStream,
}

/// How a connection's close went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Closed {
    /// The broker answered the close: every channel of it is closed there, and what they
    /// held is back in its queues.
    Confirmed,
    /// No answer (the connection was dead already, or the close overran its bound and the
    /// socket was cut): the broker may hold the connection, and its unacked deliveries,
    /// until it notices.
    Unconfirmed,
}

impl Cutter {
    pub(crate) fn new(socket: TcpStream) -> Cutter {
        Cutter { socket }
    }

    /// Runs `call`, a call on the connection, and cuts the connection if it has not
    /// returned within `bound`. The watch runs on a thread of its own, joined before this
    /// returns; if none can be started the connection is cut at once, never left unbounded.
    pub(crate) fn within<T>(&self, bound: Duration, call: impl FnOnce() -> T) -> T {
        let (done, watch) = bounded::<()>(0);
        thread::scope(|scope| {
            let socket = &self.socket;
            let watchdog = thread::Builder::new()
                .name("outbox-amqp-deadline".to_owned())
                .spawn_scoped(scope, move || {
                    if let Err(RecvTimeoutError::Timeout) = watch.recv_timeout(bound) {
                        log::warn!(
                            "rabbitmq: the broker did not answer within {bound:?}; cutting \
                             the connection"
                        );
                        let _ = socket.shutdown(Shutdown::Both);
                    }
                });
            if let Err(e) = watchdog {
                log::warn!("rabbitmq: cannot watch a broker call ({e}); cutting the connection");
                self.cut();
            }
            let result = call();
            drop(done);
            result
        })
    }

    /// Cuts the connection: every call on it fails from now on.
    pub(crate) fn cut(&self) {
        let _ = self.socket.shutdown(Shutdown::Both);
    }

    /// Closes `connection`, waiting for the broker's answer at most `bound`, and cuts it
    /// past that: the closing thread and amiquip's I/O thread end soon after, rather than
    /// when the broker next reads the connection.
    pub(crate) fn close(self, connection: Connection, bound: Duration) -> Closed {
        let (done, closed) = bounded::<bool>(1);
        // Handed over through a slot: if no thread starts, the connection is still here, to
        // be cut before it is dropped (dropping it closes it, and waits as a close does).
        let (slot, kept) = bounded::<Connection>(1);
        let _ = slot.send(connection);
        let spawned = lifecycle::spawn("amqp-close", move || {
            if let Ok(connection) = kept.try_recv() {
                let _ = done.send(connection.close().is_ok());
            }
        });
        if spawned.is_err() {
            self.cut();
            return Closed::Unconfirmed;
        }
        let confirmed = match closed.recv_timeout(bound) {
            Ok(confirmed) => confirmed,
            Err(_) => {
                self.cut();
                let _ = closed.recv_timeout(AFTER_CUT);
                false
            }
        };
        if confirmed {
            Closed::Confirmed
        } else {
            Closed::Unconfirmed
        }
    }
}
