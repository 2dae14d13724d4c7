//! The operator's statements, by job, each rendered once per table.

pub(crate) mod health;
pub(crate) mod letters;
pub(crate) mod stats;
