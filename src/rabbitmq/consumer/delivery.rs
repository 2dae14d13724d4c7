//! A delivery as the handler sees it, made from the broker's.

use amiquip::{AmqpValue, FieldTable};

use crate::runtime::wire::{AGGREGATE_HEADER, ATTEMPT_HEADER};
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
    }
}
