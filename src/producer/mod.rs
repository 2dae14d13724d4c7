//! The producer's side: the `Outbox` handle, the message it enqueues, batches of them,
//! and the consumer-side deduplication in the caller's transaction.

pub(crate) mod arguments;
pub(crate) mod batch;
pub(crate) mod dedupe;
pub(crate) mod message;
pub(crate) mod outbox;
pub(crate) mod prepared;
pub(crate) mod sql;
