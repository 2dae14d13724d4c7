//! An outbox that diagnoses its own table: dead tuples, vacuum, analyze and bloat, what holds
//! back the xmin horizon (an open transaction, a prepared one, a replication slot), rows left
//! due, and relays whose publisher is down.
//!
//! A queue table is written to and deleted from all day, so it lives on vacuum: anything
//! that keeps vacuum from removing dead row versions makes every claim read more of them.
//! [`Outbox::health`] reads the server's own statistics (a handful of catalog rows and one
//! index entry, whatever the backlog) and says, for each figure past its threshold, what
//! is wrong and what to do.

mod checks;
mod diagnose;
pub(crate) mod report;
