//! A delivery as the handler sees it, made from the broker's.

use amiquip::{AmqpValue, FieldTable};

use crate::runtime::wire::{AGGREGATE_HEADER, ATTEMPT_HEADER, SEQUENCE_HEADER};
use crate::trace::w3c::parse_traceparent;
use crate::trace::{self, TRACEPARENT, TRACESTATE};

/// A delivery as the handler sees it.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Delivery {
    /// The AMQP message id: the outbox key, deduplicated on.
    pub key: String,
    /// The exchange it was published to.
    pub exchange: String,
    /// The routing key (the outbox topic).
    pub routing_key: String,
    /// The body.
    pub body: Vec<u8>,
    /// The content type, if any.
    pub content_type: Option<String>,
    /// String-valued headers, sorted by name.
    pub headers: Vec<(String, String)>,
    /// The aggregate key (`x-outbox-aggregate-key`), if any: deliveries that share one are
    /// handled one at a time, in the order they arrived.
    pub aggregate_key: Option<String>,
    /// The outbox attempt that published it (`x-outbox-attempt`), if present. The relay's
    /// `RabbitPublisher` sends it on every message, unless told to leave it off first
    /// attempts (`first_attempt_header(false)`): then `None` from it means the first.
    pub attempt: Option<u32>,
    /// True if the broker delivered it before.
    pub redelivered: bool,
    /// Its place in its aggregate's publication sequence (`x-outbox-sequence`, sent by the
    /// relay of an outbox built with
    /// [`sequence(true)`](crate::OutboxBuilder::sequence)), if it carries one.
    pub sequence: Option<i64>,
    /// How its place follows the last place this consumer processed of its aggregate, when
    /// not as the next one: a hole (places skipped: a message dropped by the queue, skipped
    /// by an operator, lost) or a delivery behind (reordered, or an older place again).
    /// `None` in order, and for a delivery without an aggregate or a place. The consumer
    /// still calls the handler, which decides: process it, or fail it (a
    /// [`HandlerError`](crate::HandlerError), retried or dead-lettered as any other).
    pub gap: Option<SequenceGap>,
}

/// A delivery's place out of its aggregate's order, as the consumer found it against the
/// last place it processed of that aggregate (see [`Delivery::gap`]).
///
/// After a hole the consumer's last place becomes the delivery's, once its handler commits:
/// the places skipped are reported once, and the next delivery in order after it is in
/// order again. After a delivery behind, the last place stays where it was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum SequenceGap {
    /// Places were skipped: the consumer expected `expected` (its last place plus one, or 1
    /// for an aggregate it never processed) and got `got`, a later one.
    Hole {
        /// The place that should have come.
        expected: i64,
        /// The place that came.
        got: i64,
    },
    /// The delivery's place `got` is not after the last one processed, `last`: it was
    /// reordered behind a later place, or is an older message again under a new key.
    Behind {
        /// The last place this consumer processed of the aggregate.
        last: i64,
        /// The place that came.
        got: i64,
    },
}

impl SequenceGap {
    /// How `got` follows `last` (the last place processed of the aggregate, `None` for
    /// none): `None` when it is the next one.
    pub fn between(last: Option<i64>, got: i64) -> Option<SequenceGap> {
        let expected = last.unwrap_or(0).saturating_add(1);
        match last {
            _ if got == expected => None,
            Some(last) if got <= last => Some(SequenceGap::Behind { last, got }),
            _ => Some(SequenceGap::Hole { expected, got }),
        }
    }

    /// The places skipped by a hole (`expected..got`); none for a delivery behind.
    pub fn missing(&self) -> std::ops::Range<i64> {
        match *self {
            SequenceGap::Hole { expected, got } => expected..got,
            SequenceGap::Behind { .. } => 0..0,
        }
    }
}

impl Delivery {
    /// A delivery as the consumer would hand it to a handler, for a unit test of your own
    /// handler: a first delivery of `body` with message id `key`, routed by `routing_key`,
    /// with no exchange, content type, headers, aggregate key or attempt. Its fields are
    /// public, so a test sets what it needs:
    ///
    /// ```
    /// use postgres_outbox::rabbitmq::Delivery;
    /// let mut delivery = Delivery::new("order-7-paid", "order.paid", b"{}".to_vec());
    /// delivery.aggregate_key = Some("order-7".into());
    /// delivery.redelivered = true;
    /// # assert_eq!(delivery.key, "order-7-paid");
    /// ```
    pub fn new(key: impl Into<String>, routing_key: impl Into<String>, body: Vec<u8>) -> Delivery {
        Delivery {
            key: key.into(),
            exchange: String::new(),
            routing_key: routing_key.into(),
            body,
            content_type: None,
            headers: Vec::new(),
            aggregate_key: None,
            attempt: None,
            redelivered: false,
            sequence: None,
            gap: None,
        }
    }

    /// The W3C `traceparent` the producer gave (the header of that name), if any: the
    /// context to continue the producer's trace from.
    pub fn traceparent(&self) -> Option<&str> {
        trace::header(&self.headers, TRACEPARENT)
    }

    /// The W3C `tracestate` that goes with the [`traceparent`](Self::traceparent), if any.
    pub fn tracestate(&self) -> Option<&str> {
        trace::header(&self.headers, TRACESTATE)
    }

    /// The trace id of a well-formed [`traceparent`](Self::traceparent): 32 lowercase hex
    /// digits, the same at the producer, the relay and every consumer.
    pub fn trace_id(&self) -> Option<&str> {
        let traceparent = self.traceparent()?;
        parse_traceparent(traceparent).ok().map(|p| p.trace_id)
    }
}

fn as_i64(value: &AmqpValue) -> Option<i64> {
    match value {
        AmqpValue::ShortShortInt(v) => Some(i64::from(*v)),
        AmqpValue::ShortShortUInt(v) => Some(i64::from(*v)),
        AmqpValue::ShortInt(v) => Some(i64::from(*v)),
        AmqpValue::ShortUInt(v) => Some(i64::from(*v)),
        AmqpValue::LongInt(v) => Some(i64::from(*v)),
        AmqpValue::LongUInt(v) => Some(i64::from(*v)),
        AmqpValue::LongLongInt(v) => Some(*v),
        _ => None,
    }
}

/// The handler's view of a delivery; its body is moved out of `delivery`. The key is
/// empty when the message has no message id.
pub(super) fn view(delivery: &mut amiquip::Delivery) -> Delivery {
    let key = delivery.properties.message_id().clone().unwrap_or_default();
    let empty = FieldTable::new();
    let table = delivery.properties.headers().as_ref().unwrap_or(&empty);
    let headers: Vec<(String, String)> = table
        .iter()
        .filter_map(|(k, v)| match v {
            AmqpValue::LongString(s) => Some((k.clone(), s.clone())),
            _ => None,
        })
        .collect();
    let aggregate_key = match table.get(AGGREGATE_HEADER) {
        Some(AmqpValue::LongString(s)) if !s.is_empty() => Some(s.clone()),
        _ => None,
    };
    let attempt = table
        .get(ATTEMPT_HEADER)
        .and_then(as_i64)
        .and_then(|n| u32::try_from(n).ok());
    let sequence = table.get(SEQUENCE_HEADER).and_then(as_i64);
    Delivery {
        key,
        exchange: delivery.exchange.clone(),
        routing_key: delivery.routing_key.clone(),
        body: std::mem::take(&mut delivery.body),
        content_type: delivery.properties.content_type().clone(),
        headers,
        aggregate_key,
        attempt,
        redelivered: delivery.redelivered,
        sequence,
        gap: None,
    }
}

#[cfg(test)]
mod tests {
    use super::SequenceGap;

    #[test]
    fn a_place_is_in_order_a_hole_or_behind() {
        assert_eq!(SequenceGap::between(None, 1), None);
        assert_eq!(SequenceGap::between(Some(4), 5), None);
        let hole = SequenceGap::between(None, 3).unwrap();
        assert_eq!(
            hole,
            SequenceGap::Hole {
                expected: 1,
                got: 3
            }
        );
        assert_eq!(hole.missing(), 1..3);
        let hole = SequenceGap::between(Some(4), 7).unwrap();
        assert_eq!(hole.missing(), 5..7);
        let behind = SequenceGap::between(Some(4), 4).unwrap();
        assert_eq!(behind, SequenceGap::Behind { last: 4, got: 4 });
        assert!(behind.missing().is_empty());
        assert_eq!(
            SequenceGap::between(Some(4), 2),
            Some(SequenceGap::Behind { last: 4, got: 2 })
        );
    }
}
