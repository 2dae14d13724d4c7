//! One message as the bound parameters of the statements that enqueue it, shared by
//! [`Outbox::enqueue`](crate::Outbox::enqueue) and a [`Producer`](crate::Producer)'s
//! prepared statements, so both send the same values.

use std::time::SystemTime;

use postgres::types::{ToSql, Type};

use crate::error::{Error, Result};
use crate::producer::message::Message;

/// The types of the enqueue function's parameters (`sql/functions/enqueue.sql`).
pub(crate) const CALL_TYPES: [Type; 12] = [
    Type::TEXT,
    Type::TEXT,
    Type::TEXT,
    Type::BYTEA,
    Type::TEXT,
    Type::TEXT_ARRAY,
    Type::TIMESTAMPTZ,
    Type::INT8,
    Type::INT4,
    Type::BOOL,
    Type::BOOL,
    Type::BOOL,
];

/// The types of the plain INSERT of a message that needs no function (see
/// [`Arguments::plain`]).
pub(crate) const PLAIN_TYPES: [Type; 9] = [
    Type::TEXT,
    Type::TEXT,
    Type::BYTEA,
    Type::TEXT,
    Type::TEXT_ARRAY,
    Type::TIMESTAMPTZ,
    Type::INT8,
    Type::INT4,
    Type::BOOL,
];

/// A validated message and the values its enqueue binds.
pub(crate) struct Arguments {
    key: String,
    message: Message,
    headers: Vec<String>,
    at: Option<SystemTime>,
    delay: i64,
    max_attempts: Option<i32>,
    notify: bool,
    generated: bool,
}

impl Arguments {
    /// Validates `message` (before any SQL, so a refusal leaves the transaction usable).
    pub(crate) fn new(message: Message, notify: bool) -> Result<Arguments> {
        let key = message.validate()?;
        let (at, delay) = message.schedule();
        Ok(Arguments {
            key,
            headers: message.headers_flat(),
            at,
            delay,
            max_attempts: message.max_attempts_param(),
            notify,
            generated: message.key.is_none(),
            message,
        })
    }

    /// The enqueue function's arguments: $1..$10 the message, $11 notify, $12 whether the
    /// key is the crate's own.
    pub(crate) fn call(&self) -> [&(dyn ToSql + Sync); 12] {
        let m = &self.message;
        [
            &self.key,
            &m.topic,
            &m.aggregate_key,
            &m.payload,
            &m.content_type,
            &self.headers,
            &self.at,
            &self.delay,
            &self.max_attempts,
            &m.park,
            &self.notify,
            &self.generated,
        ]
    }

    /// The function's arguments with their types, for a statement sent as text.
    pub(crate) fn typed_call(&self) -> [(&(dyn ToSql + Sync), Type); 12] {
        let call = self.call();
        std::array::from_fn(|i| (call[i], CALL_TYPES[i].clone()))
    }

    /// The arguments of the plain INSERT, when the message needs nothing the function does:
    /// no aggregate (so no lock and no head to find) and the crate's own key (so no
    /// conflict to look for). `None` otherwise.
    pub(crate) fn plain(&self) -> Option<[&(dyn ToSql + Sync); 9]> {
        let m = &self.message;
        if !self.generated || m.aggregate_key.is_some() {
            return None;
        }
        Some([
            &self.key,
            &m.topic,
            &m.payload,
            &m.content_type,
            &self.headers,
            &self.at,
            &self.delay,
            &self.max_attempts,
            &m.park,
        ])
    }

    /// The arguments of a [`Producer`](crate::Producer)'s ordered INSERT ($1..$10 the
    /// message), when the message has an aggregate and the crate's key. `None` otherwise.
    pub(crate) fn ordered(&self) -> Option<[&(dyn ToSql + Sync); 10]> {
        let [message @ .., _notify] = self.placed()?;
        Some(message)
    }

    /// The arguments of the function that writes a message with an aggregate, the crate's
    /// key and its place ($1..$10 the message, $11 notify; `sql/functions/sequence.sql`),
    /// with their types, for a statement sent as text. `None` for other messages.
    pub(crate) fn typed_placed(&self) -> Option<[(&(dyn ToSql + Sync), Type); 11]> {
        let placed = self.placed()?;
        Some(std::array::from_fn(|i| (placed[i], CALL_TYPES[i].clone())))
    }

    fn placed(&self) -> Option<[&(dyn ToSql + Sync); 11]> {
        if !self.generated || self.message.aggregate_key.is_none() {
            return None;
        }
        let [call @ .., _generated] = self.call();
        Some(call)
    }

    /// The message's aggregate key, if any.
    pub(crate) fn aggregate_key(&self) -> Option<&str> {
        self.message.aggregate_key.as_deref()
    }

    /// Whether the message has an aggregate and the caller's key.
    pub(crate) fn ordered_by_caller(&self) -> bool {
        !self.generated && self.message.aggregate_key.is_some()
    }

    /// The key, once the function said whether the row went in.
    pub(crate) fn inserted(self, inserted: bool, table: &str) -> Result<String> {
        if !inserted {
            return Err(Error::DuplicateKey {
                keys: vec![self.key],
            });
        }
        log::trace!("outbox {table}: enqueued {}", self.key);
        Ok(self.key)
    }
}
