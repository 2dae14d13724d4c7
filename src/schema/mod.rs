//! The outbox's tables and functions: validated table names, the checked renderer of SQL
//! templates, the migrations, partitioned tables, and the grants each side needs.

pub(crate) mod grants;
pub(crate) mod migrate;
pub(crate) mod partitioning;
pub(crate) mod render;
pub(crate) mod statements;
pub(crate) mod table;
