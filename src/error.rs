//! The crate's one error type.

use std::error::Error as StdError;
use std::fmt;

/// Everything that can go wrong in this crate.
///
/// Its text never includes the server's DETAIL (a constraint violation's DETAIL quotes the
/// row, payload included); [`Error::as_db_error`] has it.
///
/// Like `postgres::Error`, callers usually ask questions of it ([`Error::is_duplicate_key`],
/// [`Error::as_db_error`], [`Error::code`]) rather than match on it; the variants are public
/// for the cases where matching is clearer, and `#[non_exhaustive]` so new ones can be added.
#[derive(Debug)]
#[non_exhaustive]
pub enum Error {
    /// A table name that is not a plain PostgreSQL identifier (optionally `schema.table`), or
    /// one too long to derive the companion objects' names from.
    InvalidTableName {
        /// The rejected name.
        name: String,
        /// Why it was rejected.
        reason: String,
    },
    /// A message or argument that would be rejected by PostgreSQL or the broker; nothing was
    /// written.
    InvalidInput {
        /// The offending field, such as `"topic"` or `"header name"`.
        field: &'static str,
        /// Why it was rejected.
        reason: String,
    },
    /// A setting that cannot work, of an outbox, a relay or `Outbox::process`; the text
    /// names the setting.
    InvalidConfig(String),
    /// One or more keys are already in the outbox; nothing was written and the caller's
    /// transaction is still usable.
    DuplicateKey {
        /// The keys that already exist.
        keys: Vec<String>,
    },
    /// The outbox table does not exist: run [`Outbox::migrate`](crate::Outbox::migrate) first.
    NotMigrated {
        /// The table, as configured.
        table: String,
        /// The database's own error.
        source: postgres::Error,
    },
    /// The table exists but is not an outbox `migrate` made (it has no
    /// `<table>_migrations`, or not an outbox's columns): nothing was read or changed.
    NotAnOutbox {
        /// The table, as configured.
        table: String,
    },
    /// [`Outbox::uninstall`](crate::Outbox::uninstall) was refused: relays of the table
    /// report that they run.
    InUse {
        /// The table, as configured.
        table: String,
        /// The relays reporting.
        relays: usize,
    },
    /// An error from PostgreSQL or the connection to it.
    Db(postgres::Error),
    /// No pooled connection could be had in time.
    Pool(r2d2::Error),
    /// A publisher could not be built.
    Publisher(Box<dyn StdError + Send + Sync>),
    /// The publisher could not reach its destination (the broker, or the way to it): the
    /// records it concerned were handed back without costing an attempt.
    Unavailable(Box<dyn StdError + Send + Sync>),
    /// A relay thread died (it panicked, or its channel closed unexpectedly).
    RelayDied(String),
    /// The database server takes no writes: a hot standby, or a primary made read-only (a
    /// planned switchover fences the old primary so). A relay or consumer waits it out and
    /// connects again, to the host that takes writes of a multi-host configuration;
    /// [`Relay::spawn`](crate::Relay::spawn) reports it.
    ReadOnly,
    /// The database did not answer within this long (the statement timeout and a margin): the
    /// connection was given up as stalled (a server or pooler that stopped answering on a
    /// live socket) and another is opened.
    Stalled(std::time::Duration),
}

impl Error {
    /// True when the message's key (or one of a batch's keys) is already in the outbox.
    pub fn is_duplicate_key(&self) -> bool {
        matches!(self, Error::DuplicateKey { .. })
    }

    /// True when the outbox table has not been created yet.
    pub fn is_not_migrated(&self) -> bool {
        matches!(self, Error::NotMigrated { .. })
    }

    /// True when the table exists but is not an outbox ([`Error::NotAnOutbox`]).
    pub fn is_not_an_outbox(&self) -> bool {
        matches!(self, Error::NotAnOutbox { .. })
    }

    /// True for input rejected before any SQL ran (bad message field or table name).
    pub fn is_invalid_input(&self) -> bool {
        matches!(
            self,
            Error::InvalidInput { .. } | Error::InvalidTableName { .. } | Error::InvalidConfig(_)
        )
    }

    /// True when the server takes no writes ([`Error::ReadOnly`], or SQLSTATE 25006 from a
    /// statement that tried to write).
    pub fn is_read_only(&self) -> bool {
        matches!(self, Error::ReadOnly)
            || self.code() == Some(&postgres::error::SqlState::READ_ONLY_SQL_TRANSACTION)
    }

    /// The keys that were already present, for [`Error::DuplicateKey`].
    pub fn duplicate_keys(&self) -> &[String] {
        match self {
            Error::DuplicateKey { keys } => keys,
            _ => &[],
        }
    }

    /// The PostgreSQL error behind this one, if it came from the server.
    pub fn as_db_error(&self) -> Option<&postgres::error::DbError> {
        self.postgres().and_then(|e| e.as_db_error())
    }

    /// The SQLSTATE of the server error behind this one, if any.
    pub fn code(&self) -> Option<&postgres::error::SqlState> {
        self.postgres().and_then(|e| e.code())
    }

    fn postgres(&self) -> Option<&postgres::Error> {
        match self {
            Error::Db(e) | Error::NotMigrated { source: e, .. } => Some(e),
            _ => None,
        }
    }

    pub(crate) fn invalid(field: &'static str, reason: impl Into<String>) -> Error {
        Error::InvalidInput {
            field,
            reason: reason.into(),
        }
    }
}

/// Prints what `postgres::Error` hides behind "db error": the server's message and the
/// SQLSTATE; never its DETAIL, which for a constraint violation quotes the failing row,
/// payload included (ask [`Error::as_db_error`] for it).
fn fmt_db(e: &postgres::Error, f: &mut fmt::Formatter<'_>) -> fmt::Result {
    match e.as_db_error() {
        Some(db) => write!(f, "{} (SQLSTATE {})", db.message(), db.code().code()),
        // "error connecting to server", say: what went wrong is its source (an I/O error,
        // "database does not allow writes"), which carries no row.
        None => match e.source() {
            Some(source) => write!(f, "{e}: {source}"),
            None => write!(f, "{e}"),
        },
    }
}

/// An error's text for everything the crate stores, sends or logs: without the server's
/// DETAIL, which `postgres::Error` prints and which quotes rows, payloads included. Looks
/// through a `PublishError` (a handler's or publisher's error) to what it carries.
pub(crate) fn describe(error: &(dyn StdError + 'static)) -> String {
    if let Some(e) = error.downcast_ref::<Error>() {
        return e.to_string();
    }
    if let Some(e) = error.downcast_ref::<postgres::Error>() {
        return DbText(e).to_string();
    }
    if let Some(e) = error.downcast_ref::<crate::publish::publisher::PublishError>() {
        if let Some(source) = e.source() {
            return describe(source);
        }
    }
    error.to_string()
}

struct DbText<'a>(&'a postgres::Error);

impl fmt::Display for DbText<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt_db(self.0, f)
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::InvalidTableName { name, reason } => {
                write!(f, "invalid outbox table name {name:?}: {reason}")
            }
            Error::InvalidInput { field, reason } => write!(f, "invalid {field}: {reason}"),
            Error::InvalidConfig(reason) => write!(f, "invalid configuration: {reason}"),
            Error::DuplicateKey { keys } => {
                write!(f, "message key already in the outbox: {}", keys.join(", "))
            }
            Error::NotMigrated { table, source } => {
                write!(
                    f,
                    "outbox table {table} does not exist; run Outbox::migrate first ("
                )?;
                fmt_db(source, f)?;
                write!(f, ")")
            }
            Error::NotAnOutbox { table } => write!(
                f,
                "table {table} is not an outbox (migrate made no {table}_migrations for it, or \
                 it lacks an outbox's columns): check the table name"
            ),
            Error::InUse { table, relays } => write!(
                f,
                "{relays} relay(s) of outbox {table} report that they run: stop them first"
            ),
            Error::Db(e) => {
                write!(f, "database error: ")?;
                fmt_db(e, f)
            }
            Error::Pool(e) => write!(f, "connection pool: {e}"),
            Error::Publisher(e) => {
                write!(f, "could not build a publisher: {}", describe(e.as_ref()))
            }
            Error::Unavailable(e) => write!(
                f,
                "the publisher's destination is unavailable: {}",
                describe(e.as_ref())
            ),
            Error::RelayDied(why) => write!(f, "relay thread died: {why}"),
            Error::ReadOnly => write!(
                f,
                "the database server takes no writes (a hot standby, or a primary made \
                 read-only)"
            ),
            Error::Stalled(after) => write!(
                f,
                "the database did not answer within {after:?}; the connection was given up as \
                 stalled"
            ),
        }
    }
}

impl StdError for Error {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        match self {
            Error::Db(e) | Error::NotMigrated { source: e, .. } => Some(e),
            Error::Pool(e) => Some(e),
            Error::Publisher(e) | Error::Unavailable(e) => Some(e.as_ref()),
            _ => None,
        }
    }
}

impl From<postgres::Error> for Error {
    fn from(e: postgres::Error) -> Error {
        Error::Db(e)
    }
}

impl From<r2d2::Error> for Error {
    fn from(e: r2d2::Error) -> Error {
        Error::Pool(e)
    }
}

/// The crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
