//! `enqueue_all`'s batches: validated messages as columns, written by the batch enqueue
//! function, or by a binary `COPY` when the batch is large and due at once.
//!
//! `Outbox::enqueue_all` hands a batch the producer's statements, the table and its notify
//! setting, and says whether it may be copied in: this module depends on `sql.rs`, not on
//! `outbox.rs`.

use std::collections::HashSet;

use postgres::binary_copy::BinaryCopyInWriter;
use postgres::error::SqlState;
use postgres::types::{ToSql, Type};
use postgres::Transaction;

use crate::error::{Error, Result};
use crate::producer::message::Message;
use crate::producer::sql::ProducerSql;
use crate::schema::statements::db_error;
use crate::schema::table::TableName;

/// From this many messages a batch due at once goes by `COPY`: its extra round trips
/// (savepoint, copy start, release, notify) cost about what `COPY` saves on some fifty rows.
const COPY_FROM: usize = 64;

/// `enqueue_all`'s messages as column arrays.
pub(crate) struct Batch {
    keys: Vec<String>,
    topics: Vec<String>,
    aggregate_keys: Vec<Option<String>>,
    payloads: Vec<Vec<u8>>,
    content_types: Vec<Option<String>>,
    headers: Vec<String>,
    header_offsets: Vec<i32>,
    header_lens: Vec<i32>,
    available_at: Vec<Option<std::time::SystemTime>>,
    delays: Vec<i64>,
    max_attempts: Vec<Option<i32>>,
    parks: Vec<Option<bool>>,
    /// Every key is the crate's own (a fresh UUIDv7), so none can be in the table already.
    generated: bool,
}

impl Batch {
    pub(crate) fn new(messages: Vec<Message>) -> Result<Batch> {
        let n = messages.len();
        let mut batch = Batch {
            keys: Vec::with_capacity(n),
            topics: Vec::with_capacity(n),
            aggregate_keys: Vec::with_capacity(n),
            payloads: Vec::with_capacity(n),
            content_types: Vec::with_capacity(n),
            headers: Vec::new(),
            header_offsets: Vec::with_capacity(n),
            header_lens: Vec::with_capacity(n),
            available_at: Vec::with_capacity(n),
            delays: Vec::with_capacity(n),
            max_attempts: Vec::with_capacity(n),
            parks: Vec::with_capacity(n),
            generated: messages.iter().all(|m| m.key.is_none()),
        };
        let mut seen = std::collections::HashSet::with_capacity(n);
        let mut repeated = Vec::new();
        let mut keyed = Vec::with_capacity(n);
        for message in messages {
            let key = message.validate()?;
            if !seen.insert(key.clone()) {
                repeated.push(key.clone());
            }
            keyed.push((key, message));
        }
        if !repeated.is_empty() {
            return Err(Error::DuplicateKey { keys: repeated });
        }
        for (key, message) in keyed {
            let flat = message.headers_flat();
            let offset = i32::try_from(batch.headers.len())
                .map_err(|_| Error::invalid("headers", "too many headers in one batch"))?;
            batch.header_offsets.push(offset);
            batch.header_lens.push(flat.len() as i32);
            batch.headers.extend(flat);
            let (at, delay) = message.schedule();
            batch.available_at.push(at);
            batch.delays.push(delay);
            batch.max_attempts.push(message.max_attempts_param());
            batch.parks.push(message.park);
            batch.keys.push(key);
            batch.topics.push(message.topic);
            batch.aggregate_keys.push(message.aggregate_key);
            batch.payloads.push(message.payload);
            batch.content_types.push(message.content_type);
        }
        Ok(batch)
    }
}

impl Batch {
    /// Whether each row is its aggregate's head: the first of its aggregate in the batch,
    /// when the aggregate is not among the `busy` ones, which have rows pending already.
    fn heads(&self, busy: Vec<String>) -> Vec<bool> {
        let mut taken: HashSet<&str> = busy.iter().map(String::as_str).collect();
        self.aggregate_keys
            .iter()
            .map(|key| key.as_deref().is_some_and(|key| taken.insert(key)))
            .collect()
    }

    /// Whether the batch may go in by `COPY` whatever the table: large and due at once.
    pub(crate) fn copies(&self) -> bool {
        let due_now =
            self.available_at.iter().all(Option::is_none) && self.delays.iter().all(|d| *d == 0);
        due_now && self.keys.len() >= COPY_FROM
    }

    /// Whether every key is the crate's own.
    pub(crate) fn generated(&self) -> bool {
        self.generated
    }

    /// Whether any message has an aggregate: on an outbox that gives places, such a batch
    /// takes them (see [`Batch::write`]).
    pub(crate) fn ordered(&self) -> bool {
        self.aggregate_keys.iter().any(Option::is_some)
    }

    /// Writes the batch, all or nothing, and returns its keys in order; an existing key
    /// leaves nothing written and the transaction usable. With `notify`, a waiting relay is
    /// woken at commit; with `copy` (the caller's decision, from [`copies`](Batch::copies)),
    /// it goes in by `COPY`; with `placed`, its messages with an aggregate take their places
    /// in their aggregates' sequences, by the batch function and never by `COPY`.
    pub(crate) fn write(
        self,
        target: (&ProducerSql, &TableName),
        notify: bool,
        copy: bool,
        placed: bool,
        tx: &mut Transaction<'_>,
    ) -> Result<Vec<String>> {
        let (sql, table) = target;
        if placed {
            self.insert(&sql.enqueue_all_placed, table, notify, tx)?;
        } else if copy {
            self.copy(sql, table, notify, tx)?;
        } else {
            self.insert(&sql.enqueue_all, table, notify, tx)?;
        }
        log::trace!(
            "outbox {}: enqueued {} messages",
            table.as_str(),
            self.keys.len()
        );
        Ok(self.keys)
    }

    /// One round trip: the batch enqueue function, called by `statement`.
    fn insert(
        &self,
        statement: &str,
        table: &TableName,
        notify: bool,
        tx: &mut Transaction<'_>,
    ) -> Result<()> {
        let params: [(&(dyn ToSql + Sync), Type); 14] = [
            (&self.keys, Type::TEXT_ARRAY),
            (&self.topics, Type::TEXT_ARRAY),
            (&self.aggregate_keys, Type::TEXT_ARRAY),
            (&self.payloads, Type::BYTEA_ARRAY),
            (&self.content_types, Type::TEXT_ARRAY),
            (&self.headers, Type::TEXT_ARRAY),
            (&self.available_at, Type::TIMESTAMPTZ_ARRAY),
            (&self.delays, Type::INT8_ARRAY),
            (&self.max_attempts, Type::INT4_ARRAY),
            (&self.header_offsets, Type::INT4_ARRAY),
            (&self.header_lens, Type::INT4_ARRAY),
            (&self.parks, Type::BOOL_ARRAY),
            (&notify, Type::BOOL),
            (&self.generated, Type::BOOL),
        ];
        // NULL when all went in; otherwise the keys that exist, with nothing written.
        let existing: Option<Vec<String>> = tx
            .query_typed_one(statement, &params)
            .map_err(|e| db_error(table, e))?
            .get(0);
        match existing {
            None => Ok(()),
            Some(keys) => Err(Error::DuplicateKey { keys }),
        }
    }

    /// A binary `COPY`, after one statement that locks the batch's aggregates, asks for
    /// the notification (if a relay waits) and names the aggregates that cannot take a new
    /// head. Keys the caller gave go in inside a savepoint, so an existing one (which fails
    /// the whole copy) rolls back only the copy, its locks and its notification; keys of
    /// the crate's own cannot exist, and need none.
    fn copy(
        &self,
        sql: &ProducerSql,
        table: &TableName,
        notify: bool,
        tx: &mut Transaction<'_>,
    ) -> Result<()> {
        if self.generated {
            return self
                .copy_in(sql, notify, tx)
                .map_err(|e| db_error(table, e));
        }
        let mut savepoint = tx.savepoint("outbox_enqueue_all")?;
        match self.copy_in(sql, notify, &mut savepoint) {
            Ok(()) => savepoint.commit()?,
            Err(e) if e.code() == Some(&SqlState::UNIQUE_VIOLATION) => {
                savepoint.rollback()?;
                let mut existing: Vec<String> = tx
                    .query_typed(&sql.existing_keys, &[(&self.keys, Type::TEXT_ARRAY)])
                    .map_err(|e| db_error(table, e))?
                    .iter()
                    .map(|row| row.get(0))
                    .collect();
                // A snapshot older than the conflicting commit (REPEATABLE READ) sees none
                // of them: name them all.
                if existing.is_empty() {
                    existing = self.keys.clone();
                    existing.sort_unstable();
                }
                return Err(Error::DuplicateKey { keys: existing });
            }
            Err(e) => {
                let _ = savepoint.rollback();
                return Err(db_error(table, e));
            }
        }
        Ok(())
    }

    /// The locks, the notification and the copy itself (see [`Batch::copy`]).
    fn copy_in(
        &self,
        sql: &ProducerSql,
        notify: bool,
        tx: &mut Transaction<'_>,
    ) -> std::result::Result<(), postgres::Error> {
        let types = [
            Type::TEXT,
            Type::TEXT,
            Type::TEXT,
            Type::BYTEA,
            Type::TEXT,
            Type::TEXT_ARRAY,
            Type::INT4,
            Type::BOOL,
            Type::BOOL,
        ];
        // Locking the aggregates tells which of them have rows pending: the first row of
        // each other one is its head (see sql/functions/enqueue.sql).
        let ordered = self.aggregate_keys.iter().any(Option::is_some);
        let busy: Vec<String> = if ordered || notify {
            let keys = ordered.then_some(&self.aggregate_keys);
            tx.query_typed_one(
                &sql.lock_heads,
                &[(&keys, Type::TEXT_ARRAY), (&notify, Type::BOOL)],
            )?
            .try_get(0)?
        } else {
            Vec::new()
        };
        let heads = self.heads(busy);
        let sink = tx.copy_in(&sql.copy_in)?;
        let mut writer = BinaryCopyInWriter::new(sink, &types);
        for (i, head) in heads.iter().enumerate() {
            let start = self.header_offsets[i] as usize;
            let headers = &self.headers[start..start + self.header_lens[i] as usize];
            writer.write(&[
                &self.keys[i],
                &self.topics[i],
                &self.aggregate_keys[i],
                &self.payloads[i],
                &self.content_types[i],
                &headers,
                &self.max_attempts[i],
                &self.parks[i],
                head,
            ])?;
        }
        writer.finish()?;
        Ok(())
    }
}
