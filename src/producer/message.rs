//! What a producer enqueues, and the checks it passes before any SQL runs.

use std::collections::HashSet;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::error::{Error, Result};
use crate::runtime::clock::micros;
use crate::runtime::retry::MAX_DELAY;
use crate::runtime::wire::{fits_one_frame, properties_size, FRAME_MAX};
use crate::trace::w3c::{check_tracestate, parse_traceparent};
use crate::trace::{self, TRACEPARENT, TRACESTATE};

/// AMQP short strings (routing key, message id, content type, header names) carry at most
/// this many bytes; a longer one makes the broker close the whole connection.
pub const MAX_SHORT_STRING: usize = 255;

/// The longest aggregate key, and the longest key `dedupe` takes, in bytes. Both go into a
/// B-tree index, whose entries hold at most about 2,700 bytes: a longer value would fail
/// the insert and abort the caller's transaction, so it is refused before any SQL instead.
pub const MAX_INDEXED_KEY: usize = 1024;

/// The most bytes a message's headers (names and values together) may take: they travel
/// in one AMQP frame (128 KiB by default) with the message's other properties, and count
/// against the relay's byte budget.
pub const MAX_HEADER_BYTES: usize = 64 << 10;

/// An event to enqueue: a topic (the routing key), a payload and optional metadata.
///
/// ```
/// use std::time::Duration;
/// use postgres_outbox::Message;
///
/// let message = Message::new("order.created", br#"{"id":42}"#.to_vec())
///     .aggregate_key("order-42")
///     .content_type("application/json")
///     .header("tenant", "acme")
///     .delay(Duration::from_secs(5))
///     .max_attempts(5);
/// # let _ = message;
/// ```
#[derive(Debug, Clone)]
pub struct Message {
    pub(crate) topic: String,
    pub(crate) payload: Vec<u8>,
    pub(crate) key: Option<String>,
    pub(crate) aggregate_key: Option<String>,
    pub(crate) content_type: Option<String>,
    pub(crate) headers: Vec<(String, String)>,
    pub(crate) when: When,
    pub(crate) max_attempts: Option<u32>,
    pub(crate) park: Option<bool>,
}

#[derive(Debug, Clone, Copy)]
pub(crate) enum When {
    /// Due this long after the enqueuing transaction's `now()`.
    Delay(Duration),
    /// Due at this wall-clock time.
    At(SystemTime),
}

impl Message {
    /// A message for `topic` carrying `payload` (bytes, a `String` or a `Vec<u8>`).
    pub fn new(topic: impl Into<String>, payload: impl Into<Vec<u8>>) -> Message {
        Message {
            topic: topic.into(),
            payload: payload.into(),
            key: None,
            aggregate_key: None,
            content_type: None,
            headers: Vec::new(),
            when: When::Delay(Duration::ZERO),
            max_attempts: None,
            park: None,
        }
    }

    /// The idempotency key consumers deduplicate on, and the AMQP message id. Defaults to a
    /// fresh UUID v7. Enqueueing a key that is already in the outbox is an error.
    pub fn key(mut self, key: impl Into<String>) -> Message {
        self.key = Some(key.into());
        self
    }

    /// Messages sharing an aggregate key are published strictly in enqueue order. At most
    /// [`MAX_INDEXED_KEY`] bytes, without NUL.
    pub fn aggregate_key(mut self, aggregate_key: impl Into<String>) -> Message {
        self.aggregate_key = Some(aggregate_key.into());
        self
    }

    /// The payload's MIME type, sent as the AMQP content type.
    pub fn content_type(mut self, content_type: impl Into<String>) -> Message {
        self.content_type = Some(content_type.into());
        self
    }

    /// Adds a header, sent as an AMQP message header.
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Message {
        self.headers.push((name.into(), value.into()));
        self
    }

    /// The W3C Trace Context `traceparent` of the operation that enqueues the message
    /// (`00-<trace id>-<parent id>-<flags>`), sent as the header `traceparent` and handed to
    /// publishers and handlers, which continue the trace. Checked at enqueue against the
    /// spec's grammar: a malformed one is an [`Error::InvalidInput`] and changes nothing.
    /// Replaces a `traceparent` given before; the header of that name set with
    /// [`header`](Message::header) is the same thing and is checked the same way.
    ///
    /// With the feature `opentelemetry`, a message enqueued without one carries the current
    /// OpenTelemetry context's.
    ///
    /// ```
    /// use postgres_outbox::Message;
    ///
    /// let message = Message::new("order.paid", "{}")
    ///     .traceparent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
    ///     .tracestate("rojo=00f067aa0ba902b7");
    /// # let _ = message;
    /// ```
    pub fn traceparent(self, traceparent: impl Into<String>) -> Message {
        self.replace_header(TRACEPARENT, traceparent.into())
    }

    /// The W3C Trace Context `tracestate` that goes with the
    /// [`traceparent`](Message::traceparent) (vendor `key=value` pairs), sent as the header
    /// `tracestate`. A `tracestate` without a `traceparent` is refused at enqueue, as is
    /// one the spec's grammar does not allow (over 32 members, or 512 characters).
    pub fn tracestate(self, tracestate: impl Into<String>) -> Message {
        self.replace_header(TRACESTATE, tracestate.into())
    }

    fn replace_header(mut self, name: &str, value: String) -> Message {
        match self.headers.iter_mut().find(|(n, _)| n == name) {
            Some((_, old)) => *old = value,
            None => self.headers.push((name.to_owned(), value)),
        }
        self
    }

    /// Not published until this long after the enqueuing transaction started (the
    /// database's clock decides).
    pub fn delay(mut self, delay: Duration) -> Message {
        self.when = When::Delay(delay);
        self
    }

    /// Not published before this time.
    pub fn available_at(mut self, at: SystemTime) -> Message {
        self.when = When::At(at);
        self
    }

    /// Overrides the relay's attempt limit for this message; must be at least 1.
    pub fn max_attempts(mut self, max_attempts: u32) -> Message {
        self.max_attempts = Some(max_attempts);
        self
    }

    /// Overrides the relay's [`park_on_dead`](crate::RelayConfig::park_on_dead) for this
    /// message: whether, should it become a dead letter, the later messages of its aggregate
    /// wait for it to be redriven or skipped (`true`), or go on without it (`false`). A
    /// message without an aggregate key never parks anything.
    pub fn park_on_dead(mut self, park: bool) -> Message {
        self.park = Some(park);
        self
    }

    /// Checks every field; on success returns the key to store.
    pub(crate) fn validate(&self) -> Result<String> {
        short_string("topic", &self.topic)?;
        if self.topic.is_empty() {
            return Err(Error::invalid("topic", "must not be empty"));
        }
        let key = match &self.key {
            Some(key) => {
                short_string("key", key)?;
                if key.is_empty() {
                    return Err(Error::invalid("key", "must not be empty"));
                }
                key.clone()
            }
            None => uuid::Uuid::now_v7().to_string(),
        };
        if let Some(aggregate_key) = &self.aggregate_key {
            // An empty key would be an aggregate to the relay and none to a consumer.
            if aggregate_key.is_empty() {
                return Err(Error::invalid("aggregate key", "must not be empty"));
            }
            no_nul("aggregate key", aggregate_key)?;
            at_most("aggregate key", aggregate_key, MAX_INDEXED_KEY)?;
        }
        if let Some(content_type) = &self.content_type {
            short_string("content type", content_type)?;
        }
        let mut names = HashSet::with_capacity(self.headers.len());
        for (name, value) in &self.headers {
            short_string("header name", name)?;
            if name.is_empty() {
                return Err(Error::invalid("header name", "must not be empty"));
            }
            // AMQP headers are a table: of two values under one name only one would arrive.
            if !names.insert(name.as_str()) {
                return Err(Error::invalid(
                    "header name",
                    format!("{name:?} is given twice; a header name carries one value"),
                ));
            }
            if name.starts_with("x-outbox-") {
                return Err(Error::invalid(
                    "header name",
                    format!("{name:?} uses the prefix x-outbox-, reserved for the relay"),
                ));
            }
            no_nul("header value", value)?;
        }
        self.check_trace_context()?;
        let header_bytes: usize = self
            .headers
            .iter()
            .map(|(n, v)| n.len() + v.len())
            .sum::<usize>()
            + self.captured_room();
        if header_bytes > MAX_HEADER_BYTES {
            return Err(Error::invalid(
                "headers",
                format!("take {header_bytes} bytes; at most {MAX_HEADER_BYTES} are accepted"),
            ));
        }
        // Many small headers can stay under that and still not fit the one AMQP frame
        // their encoding travels in: the broker would close the channel at every attempt.
        let properties = properties_size(
            &key,
            self.content_type.as_deref(),
            self.aggregate_key.as_deref(),
            &self.headers,
        ) + self.captured_room();
        if !fits_one_frame(properties) {
            return Err(Error::invalid(
                "headers",
                format!(
                    "take about {properties} bytes as AMQP properties with the key and \
                     content type; one frame carries at most {FRAME_MAX}"
                ),
            ));
        }
        match self.when {
            When::Delay(delay) if delay > MAX_DELAY => {
                return Err(Error::invalid(
                    "delay",
                    format!("{delay:?} is longer than the maximum of {MAX_DELAY:?}"),
                ))
            }
            When::At(at) => {
                let since_epoch = at.duration_since(UNIX_EPOCH).map_err(|_| {
                    Error::invalid("available_at", "is before 1970-01-01 (the Unix epoch)")
                })?;
                let limit = SystemTime::now() + MAX_DELAY;
                if at > limit || since_epoch.as_micros() > i64::MAX as u128 {
                    return Err(Error::invalid(
                        "available_at",
                        format!("is more than {MAX_DELAY:?} in the future"),
                    ));
                }
            }
            When::Delay(_) => {}
        }
        if let Some(n) = self.max_attempts {
            if n == 0 || n > i32::MAX as u32 {
                return Err(Error::invalid(
                    "max_attempts",
                    format!("must be between 1 and {}, got {n}", i32::MAX),
                ));
            }
        }
        Ok(key)
    }

    /// A `traceparent` as the spec defines it, and a `tracestate` only beside one.
    fn check_trace_context(&self) -> Result<()> {
        let traceparent = trace::header(&self.headers, TRACEPARENT);
        if let Some(traceparent) = traceparent {
            parse_traceparent(traceparent)?;
        }
        if let Some(tracestate) = trace::header(&self.headers, TRACESTATE) {
            if traceparent.is_none() {
                return Err(Error::invalid(
                    "tracestate",
                    "is given without a traceparent: it means nothing without one",
                ));
            }
            check_tracestate(tracestate)?;
        }
        Ok(())
    }

    /// The room, in header bytes, kept for the trace context enqueue captures from
    /// OpenTelemetry for a message that carries none, so that it cannot push the headers
    /// past the limits checked here.
    fn captured_room(&self) -> usize {
        #[cfg(feature = "opentelemetry")]
        if trace::header(&self.headers, TRACEPARENT).is_none() {
            return trace::otel::CAPTURED_ROOM;
        }
        0
    }

    /// The delay in microseconds and the absolute time, as bound parameters.
    pub(crate) fn schedule(&self) -> (Option<SystemTime>, i64) {
        match self.when {
            When::Delay(delay) => (None, micros(delay)),
            When::At(at) => (Some(at), 0),
        }
    }

    pub(crate) fn max_attempts_param(&self) -> Option<i32> {
        self.max_attempts.and_then(|n| i32::try_from(n).ok())
    }

    /// The headers as name, value, name, value, ... With the feature `opentelemetry`, a
    /// message without a `traceparent` gets the current context's here, at enqueue.
    pub(crate) fn headers_flat(&self) -> Vec<String> {
        let given = self
            .headers
            .iter()
            .flat_map(|(k, v)| [k.clone(), v.clone()]);
        #[cfg(feature = "opentelemetry")]
        let given = given.chain(
            trace::header(&self.headers, TRACEPARENT)
                .is_none()
                .then(trace::otel::current_headers)
                .into_iter()
                .flatten(),
        );
        given.collect()
    }
}

fn short_string(field: &'static str, value: &str) -> Result<()> {
    if value.len() > MAX_SHORT_STRING {
        return Err(Error::invalid(
            field,
            format!(
                "is {} bytes; AMQP short strings carry at most {MAX_SHORT_STRING}",
                value.len()
            ),
        ));
    }
    no_nul(field, value)
}

/// A value stored in a B-tree index: at most `limit` bytes.
pub(crate) fn at_most(field: &'static str, value: &str, limit: usize) -> Result<()> {
    if value.len() > limit {
        return Err(Error::invalid(
            field,
            format!("is {} bytes; at most {limit} are accepted", value.len()),
        ));
    }
    Ok(())
}

/// PostgreSQL text cannot hold NUL; sending one would abort the caller's transaction.
fn no_nul(field: &'static str, value: &str) -> Result<()> {
    if value.contains('\0') {
        return Err(Error::invalid(field, "contains a NUL character"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field_of(m: Message) -> &'static str {
        match m.validate() {
            Err(Error::InvalidInput { field, .. }) => field,
            other => panic!("expected InvalidInput, got {other:?}"),
        }
    }

    #[test]
    fn headers_that_would_not_fit_one_amqp_frame_are_refused_under_the_byte_limit() {
        // 13,000 headers of at most 5 bytes: under MAX_HEADER_BYTES, but about 140 KB as
        // AMQP encodes them.
        let many = (0..13_000).fold(Message::new("t", "p"), |m, i| {
            m.header(format!("{i:x}"), "v")
        });
        let bytes: usize = many.headers.iter().map(|(n, v)| n.len() + v.len()).sum();
        assert!(bytes <= MAX_HEADER_BYTES, "{bytes}");
        let e = many.validate().unwrap_err();
        assert!(
            e.to_string().contains("one frame carries at most 131072"),
            "{e}"
        );
        // A header set that fits is taken.
        let fits = (0..1_000).fold(Message::new("t", "p"), |m, i| {
            m.header(format!("h{i}"), "v")
        });
        assert!(fits.validate().is_ok());
    }

    #[test]
    fn each_field_is_checked() {
        let long = "x".repeat(256);
        assert_eq!(field_of(Message::new("", "p")), "topic");
        assert_eq!(field_of(Message::new(long.clone(), "p")), "topic");
        assert_eq!(field_of(Message::new("t", "p").key(long.clone())), "key");
        assert_eq!(field_of(Message::new("t", "p").key("")), "key");
        assert_eq!(
            field_of(Message::new("t", "p").content_type(long.clone())),
            "content type"
        );
        assert_eq!(
            field_of(Message::new("t", "p").header(long.clone(), "v")),
            "header name"
        );
        assert_eq!(
            field_of(Message::new("t", "p").header("", "v")),
            "header name"
        );
        assert_eq!(
            field_of(Message::new("t", "p").header("x-outbox-attempt", "1")),
            "header name"
        );
        assert_eq!(
            field_of(Message::new("t", "p").header("h", "a\0b")),
            "header value"
        );
        assert_eq!(
            field_of(Message::new("t", "p").aggregate_key("a\0")),
            "aggregate key"
        );
        assert_eq!(
            field_of(Message::new("t", "p").aggregate_key("")),
            "aggregate key"
        );
        assert_eq!(
            field_of(Message::new("t", "p").header("big", "v".repeat(MAX_HEADER_BYTES))),
            "headers"
        );
        assert_eq!(
            field_of(
                Message::new("t", "p")
                    .header("tenant", "a")
                    .header("tenant", "b")
            ),
            "header name"
        );
        assert_eq!(
            field_of(Message::new("t", "p").delay(MAX_DELAY * 2)),
            "delay"
        );
        assert_eq!(
            field_of(Message::new("t", "p").available_at(UNIX_EPOCH - Duration::from_secs(1))),
            "available_at"
        );
        assert_eq!(
            field_of(Message::new("t", "p").max_attempts(0)),
            "max_attempts"
        );
        assert_eq!(
            field_of(Message::new("t", "p").traceparent("00-1-2-01")),
            "traceparent"
        );
        assert_eq!(
            field_of(Message::new("t", "p").header("traceparent", "junk")),
            "traceparent"
        );
        assert_eq!(
            field_of(Message::new("t", "p").tracestate("a=1")),
            "tracestate"
        );
    }

    #[test]
    fn a_trace_context_given_twice_replaces_the_first() {
        let a = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let b = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b8-00";
        let m = Message::new("t", "p")
            .traceparent(a)
            .tracestate("x=1")
            .traceparent(b)
            .tracestate("y=2");
        assert!(m.validate().is_ok());
        assert_eq!(
            m.headers,
            [
                ("traceparent".to_owned(), b.to_owned()),
                ("tracestate".to_owned(), "y=2".to_owned())
            ]
        );
    }

    #[test]
    fn a_255_byte_topic_is_fine_and_keys_default_to_uuid_v7() {
        let key = Message::new("t".repeat(255), "p").validate().unwrap();
        let uuid = uuid::Uuid::parse_str(&key).unwrap();
        assert_eq!(uuid.get_version_num(), 7);
    }
}
