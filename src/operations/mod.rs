//! The operator's view and levers: counts, dead letters and what to do with them, the
//! relays' reports, the health checks, and what `migrate` made (and its removal).

pub(crate) mod counts;
pub(crate) mod filter;
pub(crate) mod health;
pub(crate) mod install;
pub(crate) mod letters;
pub(crate) mod purge;
pub(crate) mod relays;
pub(crate) mod sql;
pub(crate) mod stats;
