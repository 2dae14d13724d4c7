//! What the relay and the consumers hand records to and hear back from: the record, the
//! `Publisher` trait and its outcomes, the confirm rounds of ordered publishing, and the
//! metrics hooks.

pub(crate) mod metrics;
pub(crate) mod publisher;
pub(crate) mod record;
pub(crate) mod rounds;
