//! What the relay and the consumers hand records to and hear back from: the record, the
//! `Publisher` trait and its outcomes, the confirm rounds of ordered publishing, the
//! retry policy that turns an outcome into the row's next state, and the metrics hooks.

pub(crate) mod metrics;
pub(crate) mod publisher;
pub(crate) mod record;
pub(crate) mod retry;
pub(crate) mod rounds;
