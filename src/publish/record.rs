//! A claimed outbox row, as publishers and handlers see it.

use std::time::SystemTime;

use postgres::Row;

use crate::trace::w3c::parse_traceparent;
use crate::trace::{self, TRACEPARENT, TRACESTATE};

/// One outbox row handed to a [`Publisher`](crate::Publisher) or a handler.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Record {
    /// The row's id; increases in enqueue order.
    pub id: i64,
    /// The idempotency key (the AMQP message id).
    pub key: String,
    /// The topic (the AMQP routing key).
    pub topic: String,
    /// Messages sharing an aggregate key are delivered one at a time, in order.
    pub aggregate_key: Option<String>,
    /// The payload, as enqueued.
    pub payload: Vec<u8>,
    /// The payload's MIME type, if given.
    pub content_type: Option<String>,
    /// Headers, in the order they were added.
    pub headers: Vec<(String, String)>,
    /// Which attempt this is: 1 on the first try.
    pub attempt: u32,
    /// The per-message attempt limit, if the producer set one.
    pub max_attempts: Option<u32>,
    /// When the message was enqueued (the database's clock).
    pub created_at: SystemTime,
    /// The message's place in its aggregate's publication sequence (1, 2, 3, ... in the
    /// order its aggregate's producers committed), when the outbox gives places
    /// ([`OutboxBuilder::sequence`](crate::OutboxBuilder::sequence)) and the message has an
    /// aggregate; the RabbitMQ publisher sends it as `x-outbox-sequence`.
    pub sequence: Option<i64>,
    /// The lease the claim stamped: with `attempt`, the fencing token of every outcome.
    pub(crate) lease: Option<SystemTime>,
    /// The message's own say on whether its death parks its aggregate.
    pub(crate) park: Option<bool>,
}

impl Record {
    /// A record as the relay would hand it over on the first attempt, for a unit test of
    /// your own [`Publisher`](crate::Publisher) or handler: id 1, no aggregate key, content
    /// type or headers, attempt 1, enqueued now. Its fields are public, so a test sets
    /// what it needs:
    ///
    /// ```
    /// use postgres_outbox::Record;
    /// let mut record = Record::new("order-7-paid", "order.paid", b"{}".to_vec());
    /// record.aggregate_key = Some("order-7".into());
    /// record.attempt = 3;
    /// assert_eq!(record.topic, "order.paid");
    /// ```
    ///
    /// The relay only hands over records it claimed; one made here was never in a table.
    pub fn new(key: impl Into<String>, topic: impl Into<String>, payload: Vec<u8>) -> Record {
        Record {
            id: 1,
            key: key.into(),
            topic: topic.into(),
            aggregate_key: None,
            payload,
            content_type: None,
            headers: Vec::new(),
            attempt: 1,
            max_attempts: None,
            created_at: SystemTime::now(),
            sequence: None,
            lease: None,
            park: None,
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

    /// A first-attempt record with an empty payload, keyed by its id.
    #[cfg(test)]
    pub(crate) fn for_tests(id: i64, topic: &str, aggregate: Option<&str>) -> Record {
        Record {
            id,
            aggregate_key: aggregate.map(str::to_owned),
            ..Record::new(id.to_string(), topic, Vec::new())
        }
    }

    /// Reads the columns `RECORD_TEMPLATE` (schema/statements.rs) lists, in that order.
    pub(crate) fn from_row(row: &Row) -> Result<Record, postgres::Error> {
        let flat: Vec<String> = row.try_get(6)?;
        let mut headers = Vec::with_capacity(flat.len() / 2);
        let mut pairs = flat.into_iter();
        while let (Some(name), Some(value)) = (pairs.next(), pairs.next()) {
            headers.push((name, value));
        }
        let attempt: i32 = row.try_get(7)?;
        let max_attempts: Option<i32> = row.try_get(8)?;
        Ok(Record {
            id: row.try_get(0)?,
            key: row.try_get(1)?,
            topic: row.try_get(2)?,
            aggregate_key: row.try_get(3)?,
            // A claim's reply may leave it out (see `store::read_payloads`).
            payload: row.try_get::<_, Option<Vec<u8>>>(4)?.unwrap_or_default(),
            content_type: row.try_get(5)?,
            headers,
            attempt: u32::try_from(attempt).unwrap_or(0),
            max_attempts: max_attempts.and_then(|n| u32::try_from(n).ok()),
            created_at: row.try_get(9)?,
            lease: row.try_get(10)?,
            park: row.try_get(11)?,
            sequence: row.try_get(12)?,
        })
    }

    /// Whether this record parks its aggregate if it dies: only a record with an aggregate
    /// does, by its own setting or else `default`. (The statements that record a death
    /// decide the same way, in SQL: `PARKS` in schema/statements.rs.)
    pub(crate) fn parks(&self, default: bool) -> bool {
        self.aggregate_key.is_some() && self.park.unwrap_or(default)
    }

    /// What an outcome of this claim is fenced on.
    pub(crate) fn fence(&self) -> Fence {
        Fence {
            id: self.id,
            attempts: i32::try_from(self.attempt.saturating_sub(1)).unwrap_or(i32::MAX),
            lease: self.lease,
        }
    }
}

/// What an outcome needs to change only the claim it belongs to: the row, the attempts it
/// had when claimed (the verdicts before this one) and the lease the claim stamped. A relay
/// whose lease ran out and whose row was claimed since matches none of them and changes
/// nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Fence {
    pub(crate) id: i64,
    pub(crate) attempts: i32,
    pub(crate) lease: Option<SystemTime>,
}
