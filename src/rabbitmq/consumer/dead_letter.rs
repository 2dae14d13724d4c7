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
/// The header carrying the original message's `expiration`, which its dead letter does not
/// keep (it would expire in the dead-letter queue, unseen).
pub const DEAD_EXPIRATION_HEADER: &str = "x-outbox-expiration";
/// The header carrying the original message's `user_id`, which its dead letter does not keep
/// (the broker refuses a message whose `user_id` is not the publishing connection's user).
pub const DEAD_USER_ID_HEADER: &str = "x-outbox-user-id";

/// The type of queue the consumer declares for its dead letters (RabbitMQ's
/// `x-queue-type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum QueueType {
    /// A classic queue, on the node it is declared on.
    Classic,
    /// A quorum queue, replicated over a cluster's nodes.
    Quorum,
}

impl QueueType {
    fn as_str(self) -> &'static str {
        match self {
            QueueType::Classic => "classic",
            QueueType::Quorum => "quorum",
        }
    }
}

/// How much of an error's text travels with a dead letter.
const MAX_REASON: usize = 1024;
/// How long the broker may take to confirm a dead letter before the connection is given up.
const CONFIRM_TIMEOUT: Duration = Duration::from_secs(10);

/// Declares `queue` durable, of type `queue_type`, unless it exists already, whatever its
/// arguments (an operator may have made it a quorum queue, or given it a length limit).
pub(super) fn ensure_queue(
    connection: &mut Connection,
    queue: &str,
    queue_type: QueueType,
) -> Result<(), amiquip::Error> {
    // A failed passive declare closes its channel, so it gets one of its own.
    let probe = connection.open_channel(None)?;
    if probe.queue_declare_passive(queue).is_ok() {
        return probe.close();
    }
    let channel = connection.open_channel(None)?;
    let mut arguments = FieldTable::new();
    arguments.insert(
        "x-queue-type".to_owned(),
        AmqpValue::LongString(queue_type.as_str().to_owned()),
    );
    channel.queue_declare(
        queue,
        QueueDeclareOptions {
            durable: true,
            arguments,
            ..QueueDeclareOptions::default()
        },
    )?;
    channel.close()
}

/// Why a dead letter was not stored. Either way the original stays held, unacked, and the
/// dead letter is tried again later: the dead-letter queue's trouble is not the message's.
pub(super) enum Refused {
    /// The broker declined it (a full queue that rejects publishes, a queue gone); the
    /// channel can be used again.
    Declined(String),
    /// The channel cannot be used again (closed by the broker, or a confirm that may still
    /// come): open a new one.
    Broken(String),
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
        queue_type: QueueType,
    ) -> Result<DeadLetterQueue, amiquip::Error> {
        ensure_queue(connection, queue, queue_type)?;
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

    /// Publishes a copy of the message (see `dead_copy`) and waits for the broker to
    /// confirm it. An error means the dead letter may not be stored, so the original must
    /// not be acked.
    pub(super) fn publish(
        &self,
        properties: &AmqpProperties,
        body: &[u8],
        death: &Death<'_>,
    ) -> Result<(), Refused> {
        let queue = &self.queue;
        self.channel
            .basic_publish(
                "",
                Publish {
                    body,
                    routing_key: queue.clone(),
                    // A dead-letter queue deleted under us must not swallow the message.
                    mandatory: true,
                    immediate: false,
                    properties: dead_copy(properties, death),
                },
            )
            .map_err(|e| Refused::Broken(format!("cannot publish to {queue:?}: {e}")))?;
        // One publish at a time, so the next confirm is this one's; a return for it
        // arrives before its confirm. After a timeout that no longer holds: a new channel.
        let confirm = match self
            .confirms
            .recv_deadline(crate::runtime::clock::deadline(CONFIRM_TIMEOUT))
        {
            Ok(confirm) => confirm,
            Err(RecvTimeoutError::Timeout) => {
                return Err(Refused::Broken(format!(
                    "no confirm for a dead letter to {queue:?} within {CONFIRM_TIMEOUT:?}"
                )))
            }
            Err(RecvTimeoutError::Disconnected) => {
                return Err(Refused::Broken(format!(
                    "the channel to {queue:?} closed before a dead letter was confirmed"
                )))
            }
        };
        if self.returns.try_recv().is_ok() {
            return Err(Refused::Declined(format!(
                "dead-letter queue {queue:?} does not exist"
            )));
        }
        match confirm {
            Confirm::Ack(_) => Ok(()),
            Confirm::Nack(_) => Err(Refused::Declined(format!(
                "the broker refused a dead letter for {queue:?} (is it full?)"
            ))),
        }
    }
}

/// Sets one of a message's text properties.
type SetText = fn(AmqpProperties, String) -> AmqpProperties;

/// The dead letter of a message: its body, properties and headers, persistent, with why it
/// died added. Not its `expiration` (it would expire unseen in the dead-letter queue, as
/// RabbitMQ's own dead-lettering knows) nor its `user_id` (the broker refuses a message
/// whose `user_id` is not the connection's user): both travel as headers instead.
fn dead_copy(original: &AmqpProperties, death: &Death<'_>) -> AmqpProperties {
    let mut headers = original.headers().clone().unwrap_or_default();
    add_death(&mut headers, death);
    for (header, value) in [
        (DEAD_EXPIRATION_HEADER, original.expiration()),
        (DEAD_USER_ID_HEADER, original.user_id()),
    ] {
        if let Some(value) = value {
            headers.insert(header.into(), AmqpValue::LongString(value.clone()));
        }
    }
    let mut copy = AmqpProperties::default()
        .with_headers(headers)
        .with_delivery_mode(2);
    let texts: [(&Option<String>, SetText); 8] = [
        (original.content_type(), AmqpProperties::with_content_type),
        (
            original.content_encoding(),
            AmqpProperties::with_content_encoding,
        ),
        (
            original.correlation_id(),
            AmqpProperties::with_correlation_id,
        ),
        (original.reply_to(), AmqpProperties::with_reply_to),
        (original.message_id(), AmqpProperties::with_message_id),
        (original.type_(), AmqpProperties::with_type_),
        (original.app_id(), AmqpProperties::with_app_id),
        (original.cluster_id(), AmqpProperties::with_cluster_id),
    ];
    for (value, set) in texts {
        if let Some(value) = value {
            copy = set(copy, value.clone());
        }
    }
    if let Some(priority) = original.priority() {
        copy = copy.with_priority(*priority);
    }
    if let Some(timestamp) = original.timestamp() {
        copy = copy.with_timestamp(*timestamp);
    }
    copy
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
    fn a_dead_copy_keeps_the_message_but_not_its_expiration_or_user_id() {
        let original = AmqpProperties::default()
            .with_message_id("k".into())
            .with_content_type("application/json".into())
            .with_expiration("60000".into())
            .with_user_id("someone-else".into())
            .with_priority(3)
            .with_timestamp(1_700_000_000);
        let death = Death {
            reason: "poison",
            failures: 5,
            consumer: "c",
            queue: "q",
        };
        let copy = dead_copy(&original, &death);
        assert_eq!(copy.message_id().as_deref(), Some("k"));
        assert_eq!(copy.content_type().as_deref(), Some("application/json"));
        assert_eq!(
            (*copy.priority(), *copy.timestamp()),
            (Some(3), Some(1_700_000_000))
        );
        assert_eq!((copy.expiration(), copy.user_id()), (&None, &None));
        assert_eq!(*copy.delivery_mode(), Some(2));
        let headers = copy.headers().clone().unwrap();
        assert_eq!(
            headers[DEAD_EXPIRATION_HEADER],
            AmqpValue::LongString("60000".into())
        );
        assert_eq!(
            headers[DEAD_USER_ID_HEADER],
            AmqpValue::LongString("someone-else".into())
        );
        assert_eq!(
            headers[DEAD_REASON_HEADER],
            AmqpValue::LongString("poison".into())
        );
    }

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
