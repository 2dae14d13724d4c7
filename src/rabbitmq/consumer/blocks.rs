//! What the broker says of reading the consumer's connection: during a memory or disk alarm
//! it stops reading a connection that published (a dead letter is enough) and says so with
//! `connection.blocked`, then `connection.unblocked` once the alarm clears. Meanwhile no
//! call that waits for its answer can succeed.

use amiquip::ConnectionBlockedNotification;
use crossbeam_channel::Receiver;

/// Takes note of the broker's notices received so far.
pub(super) fn read_blocks(
    blocking: &Option<Receiver<ConnectionBlockedNotification>>,
    blocked: &mut Option<String>,
    name: &str,
) {
    for notice in blocking.iter().flat_map(Receiver::try_iter) {
        note_block(blocked, notice, name);
    }
}

/// Takes note of the broker's block or unblock of the connection.
pub(super) fn note_block(
    blocked: &mut Option<String>,
    notice: ConnectionBlockedNotification,
    name: &str,
) {
    match notice {
        ConnectionBlockedNotification::Blocked(reason) => {
            log::warn!(
                "rabbitmq consumer {name}: the broker stops reading this connection ({reason}); \
                 no acks or dead letters go through until it reads it again"
            );
            *blocked = Some(reason);
        }
        ConnectionBlockedNotification::Unblocked => {
            log::info!("rabbitmq consumer {name}: the broker reads this connection again");
            *blocked = None;
        }
    }
}
