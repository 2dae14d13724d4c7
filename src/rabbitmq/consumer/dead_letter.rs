//! Where a consumer puts the messages it gives up on: a durable queue of its own, published
//! to with a confirm before the original is acked, so a dead letter is never lost in between.

use std::time::Duration;

use amiquip::{
    AmqpProperties, AmqpValue, Channel, Confirm, Connection, FieldTable, Publish,
    QueueDeclareOptions, Return,
};
use crossbeam_channel::{Receiver, RecvTimeoutError};

/// The header carrying why the consumer gave up on a message (at most 1 KiB of text).
pub const DEAD_REASON_HEADER: &str = "x-outbox-dead-reason";
/// The header carrying how many times the consumer's handler failed on the message.
pub const DEAD_FAILURES_HEADER: &str = "x-outbox-failures";
/// The header carrying the queue the message was consumed from, for redriving it.
pub const DEAD_QUEUE_HEADER: &str = "x-outbox-queue";
/// The header carrying the name of the consumer that gave up.
pub const DEAD_CONSUMER_HEADER: &str = "x-outbox-consumer";

/// How much of an error's text travels with a dead letter.
const MAX_REASON: usize = 1024;
/// How long the broker may take to confirm a dead letter before the connection is given up.
const CONFIRM_TIMEOUT: Duration = Duration::from_secs(10);

/// Declares `queue` durable unless it exists already, whatever its arguments (an operator
/// may have made it a quorum queue, or given it a length limit).
pub(super) fn ensure_queue(connection: &mut Connection, queue: &str) -> Result<(), amiquip::Error> {
    // A failed passive declare closes its channel, so it gets one of its own.
    let probe = connection.open_channel(None)?;
    if probe.queue_declare_passive(queue).is_ok() {
        return probe.close();
    }
    let channel = connection.open_channel(None)?;
    channel.queue_declare(
        queue,
        QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        },
    )?;
    channel.close()
}

/// A confirming channel publishing dead letters to one queue.
pub(super) struct DeadLetterQueue {
    queue: String,
    channel: Channel,
    confirms: Receiver<Confirm>,
    returns: Receiver<Return>,
}

/// Why a message is dead, and where it came from.
pub(super) struct Death<'a> {
    pub(super) reason: &'a str,
    pub(super) failures: u32,
    pub(super) consumer: &'a str,
    pub(super) queue: &'a str,
}

impl DeadLetterQueue {
    /// Declares the queue if needed and opens a confirming channel to it.
    pub(super) fn open(
        connection: &mut Connection,
        queue: &str,
    ) -> Result<DeadLetterQueue, amiquip::Error> {
        ensure_queue(connection, queue)?;
        let channel = connection.open_channel(None)?;
        // Listen first: confirms and returns that arrive before anyone listens are dropped.
        let returns = channel.listen_for_returns()?;
        let confirms = channel.listen_for_publisher_confirms()?;
        channel.enable_publisher_confirms()?;
        Ok(DeadLetterQueue {
            queue: queue.to_owned(),
            channel,
            confirms,
            returns,
        })
    }

    /// Publishes a copy of the message (body, properties and headers) with the reason
    /// added, and waits for the broker to confirm it. An error means the dead letter may not
    /// be stored, so the original must not be acked.
    pub(super) fn publish(
        &self,
        properties: &AmqpProperties,
        body: &[u8],
        death: &Death<'_>,
    ) -> Result<(), String> {
        let mut headers = properties.headers().clone().unwrap_or_default();
        add_death(&mut headers, death);
        let properties = properties
            .clone()
            .with_headers(headers)
            .with_delivery_mode(2);
        self.channel
            .basic_publish(
                "",
                Publish {
                    body,
                    routing_key: self.queue.clone(),
                    // A dead-letter queue deleted under us must not swallow the message.
                    mandatory: true,
                    immediate: false,
                    properties,
                },
            )
            .map_err(|e| format!("cannot publish to {:?}: {e}", self.queue))?;
        // One publish at a time, so the next confirm is this one's; a return for it
        // arrives before its confirm.
        let confirm = match self
            .confirms
            .recv_deadline(crate::clock::deadline(CONFIRM_TIMEOUT))
        {
            Ok(confirm) => confirm,
            Err(RecvTimeoutError::Timeout) => {
                return Err(format!(
                    "no confirm for a dead letter within {CONFIRM_TIMEOUT:?}"
                ))
            }
            Err(RecvTimeoutError::Disconnected) => {
                return Err("the connection closed before a dead letter was confirmed".into())
            }
        };
        if self.returns.try_recv().is_ok() {
            return Err(format!("dead-letter queue {:?} is gone", self.queue));
        }
        match confirm {
            Confirm::Ack(_) => Ok(()),
            Confirm::Nack(_) => Err(format!(
                "the broker refused a dead letter for {:?}",
                self.queue
            )),
        }
    }
}

fn add_death(headers: &mut FieldTable, death: &Death<'_>) {
    let mut end = death.reason.len().min(MAX_REASON);
    while !death.reason.is_char_boundary(end) {
        end -= 1;
    }
    let text = |s: &str| AmqpValue::LongString(s.to_owned());
    headers.insert(DEAD_REASON_HEADER.into(), text(&death.reason[..end]));
    headers.insert(
        DEAD_FAILURES_HEADER.into(),
        AmqpValue::LongLongInt(i64::from(death.failures)),
    );
    headers.insert(DEAD_QUEUE_HEADER.into(), text(death.queue));
    headers.insert(DEAD_CONSUMER_HEADER.into(), text(death.consumer));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reason_is_cut_on_a_character_boundary() {
        let mut headers = FieldTable::new();
        let reason = "é".repeat(MAX_REASON);
        add_death(
            &mut headers,
            &Death {
                reason: &reason,
                failures: 3,
                consumer: "c",
                queue: "q",
            },
        );
        match &headers[DEAD_REASON_HEADER] {
            AmqpValue::LongString(s) => assert!(s.len() <= MAX_REASON && s.starts_with('é')),
            other => panic!("{other:?}"),
        }
        assert_eq!(headers[DEAD_FAILURES_HEADER], AmqpValue::LongLongInt(3));
    }
}
