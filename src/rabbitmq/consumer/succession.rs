//! One connection after another: a new connection consumes only once the broker can no
//! longer hold deliveries of the last one.
//!
//! Closing a connection hands its unacked deliveries back to the queue only once the broker
//! has closed it. When the last close went unanswered (a dead socket, a broker not reading),
//! the broker may still hold them, and consuming at once would hand the new channel the next
//! deliveries of their aggregates first. So the new connection waits until the queue has no
//! more consumers than it had besides this consumer's last one: the broker has dropped that
//! one and requeued what it held (it does both as it closes the channel). With other
//! consumers coming and going meanwhile the count says less, and order across consumers is
//! the broker's anyway.

use std::time::Duration;

use amiquip::{Channel, Queue};
use crossbeam_channel::{after, select};

use super::shared::Shared;
use crate::rabbitmq::deadline::Cutter;
use crate::runtime::retry::reconnect_delay;

/// The longest pause between two looks at whether the broker dropped the last connection.
const POLL: Duration = Duration::from_secs(1);

#[derive(Default)]
pub(super) struct Succession {
    /// The broker did not confirm closing the last connection: it may hold that
    /// connection's unacked deliveries still.
    unconfirmed: bool,
    /// Consumers of the queue besides this one when the last connection began consuming.
    others: u32,
}

impl Succession {
    /// The last connection is closed; `confirmed`, if the broker said so.
    pub(super) fn closed(&mut self, confirmed: bool) {
        self.unconfirmed = !confirmed;
    }

    /// Declares the consumed queue (passively, each call bounded by `bound`) and returns it
    /// once consuming cannot put a delivery ahead of one the last connection still holds;
    /// `None` if told to stop first.
    pub(super) fn await_old_consumer<'c>(
        &mut self,
        channel: &'c Channel,
        cutter: &Cutter,
        shared: &Shared,
        bound: Duration,
    ) -> Result<Option<Queue<'c>>, String> {
        let (name, queue) = (&shared.config.name, shared.config.queue.as_str());
        let mut waits = 0u32;
        loop {
            let declared = cutter
                .within(bound, || channel.queue_declare_passive(queue))
                .map_err(|e| format!("queue {queue:?}: {e}"))?;
            let consumers = declared.declared_consumer_count().unwrap_or(0);
            if !self.unconfirmed || consumers <= self.others {
                self.unconfirmed = false;
                self.others = consumers;
                return Ok(Some(declared));
            }
            waits += 1;
            if waits == 1 {
                log::warn!(
                    "rabbitmq consumer {name}: the broker did not confirm closing the last \
                     connection and still counts {consumers} consumers of {queue}; waiting \
                     for it to drop that connection (and requeue what it held) before \
                     consuming, so no delivery overtakes an earlier one of its aggregate"
                );
            }
            select! {
                recv(shared.stop.receiver()) -> _ => return Ok(None),
                recv(after(reconnect_delay(waits).min(POLL))) -> _ => {}
            }
        }
    }
}
