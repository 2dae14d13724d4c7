//! Whose fault a failure is: the one place that decides what may be charged to a message.
//!
//! A fault of the world (the database or the way to it, permissions, a server shutting down
//! or read-only, a statement of ours the server cannot run right now) is waited out and never
//! charged to a message, on any path: the relay's outcomes, the consumer, the dead-letter
//! queue. Only a message's own fault counts against it: data the database can never store
//! ends it at once, and anything else its handling did is one failed attempt.

use crate::error::Error;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fault {
    /// The database, the broker or the way to them: try again after a backoff, uncharged.
    World,
    /// Input the database refuses and always will (a NUL, an invalid encoding, a value too
    /// long for its index): the message is dead at once, with the reason.
    Input,
    /// Something the message's handling did (a constraint it broke, a handler that left its
    /// transaction aborted, a function of the application that raised on its data): one
    /// failed attempt.
    Message,
}

impl Fault {
    pub(crate) fn of(error: &Error) -> Fault {
        match error {
            Error::InvalidInput { .. } | Error::InvalidTableName { .. } => Fault::Input,
            Error::DuplicateKey { .. } => Fault::Message,
            Error::Db(e) => match e.as_db_error() {
                Some(db) => by_sqlstate(db.code().code()),
                // No answer from the server: I/O, a timeout, a closed connection.
                None => Fault::World,
            },
            // A table that is not there yet, no pooled connection, a stalled connection, a
            // read-only server, the broker.
            _ => Fault::World,
        }
    }
}

/// Whose fault an application's error is, when a database error caused it: the first
/// [`Error`] or `postgres::Error` in its source chain decides, as it would had the crate
/// run the statement itself. `None` when no database error is in the chain (the
/// application's own verdict then stands). A handler that wraps a statement timeout or a
/// revoked grant as its own failure must not make the message pay for the database.
#[cfg(feature = "rabbitmq")]
pub(crate) fn in_chain(error: &(dyn std::error::Error + 'static)) -> Option<Fault> {
    let mut next = Some(error);
    while let Some(error) = next {
        if let Some(ours) = error.downcast_ref::<Error>() {
            return Some(Fault::of(ours));
        }
        if let Some(theirs) = error.downcast_ref::<postgres::Error>() {
            return Some(match theirs.as_db_error() {
                Some(db) => by_sqlstate(db.code().code()),
                None => Fault::World,
            });
        }
        next = error.source();
    }
    None
}

/// The server's verdict, by SQLSTATE class: every class PostgreSQL defines (Appendix A of
/// its manual) has its line here, and `every_sqlstate_class_has_a_verdict` holds the list.
///
/// The rule: a class is the message's only when a message's data (or what a handler did
/// with it) can cause it. Everything else says the server, the connection, a setting or the
/// schema is not as it should be, which no retry of the message can mend and no message
/// should pay for: the world's, waited out with backoff and reported.
fn by_sqlstate(code: &str) -> Fault {
    let class = code.get(..2).unwrap_or(code);
    match class {
        // 22 data exception: an invalid encoding, a NUL, a value out of range or too long.
        // 54 program limit exceeded: an index row too large for its page.
        "22" | "54" => Fault::Input,
        // 25 invalid transaction state: 25P02 (the transaction is aborted) is a handler
        // that swallowed an error of its own; the rest is the server's state: 25006 a
        // read-only transaction (a hot standby, or a primary fenced for a switchover),
        // 25P03 an idle-in-transaction timeout, 25001/25P01 a transaction not as expected.
        "25" if code == "25P02" => Fault::Message,
        // 09 triggered action, 20 case not found, 21 cardinality violation, 23 integrity
        // constraint violation, 27 triggered data change violation, 2F SQL routine, 38
        // external routine, 39 external routine invocation, 44 WITH CHECK OPTION violation,
        // P0 PL/pgSQL (RAISE, ASSERT, NO_DATA_FOUND): what a constraint, a trigger or a
        // function of the application said about this message's data.
        "09" | "20" | "21" | "23" | "27" | "2F" | "38" | "39" | "44" | "P0" => Fault::Message,
        // 03 statement not complete, 08 connection exception, 0A feature not supported (on
        // a hot standby: locks and writes during recovery), 0B invalid transaction
        // initiation, 0F locator, 0L invalid grantor, 0P invalid role, 0Z diagnostics, 24
        // invalid cursor state, 25 (above), 26 invalid statement name (a prepared statement
        // a pooler lost), 28 invalid authorization, 2B dependent privileges, 2D invalid
        // transaction termination, 34 invalid cursor name, 3B savepoint, 3D invalid
        // catalog (no such database), 3F invalid schema, 40 serialization failure or
        // deadlock, 42 syntax or access rule (a privilege taken away, a schema that is not
        // the one migrated), 53 insufficient resources, 55 object not in prerequisite state
        // (a lock not available), 57 operator intervention (a statement timeout, a
        // shutdown, a terminated backend), 58 system error, 72 snapshot too old, F0
        // configuration file, HV foreign data wrapper, XX internal error.
        "03" | "08" | "0A" | "0B" | "0F" | "0L" | "0P" | "0Z" | "24" | "25" | "26" | "28"
        | "2B" | "2D" | "34" | "3B" | "3D" | "3F" | "40" | "42" | "53" | "55" | "57" | "58"
        | "72" | "F0" | "HV" | "XX" => Fault::World,
        // 00 success, 01 warning and 02 no data are never errors; a class PostgreSQL adds
        // later is taken as the message's until it is placed here, so a message that keeps
        // failing still ends.
        _ => Fault::Message,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One code of every class PostgreSQL 13-17 defines, and the verdict it gets.
    const CLASSES: &[(&str, Fault)] = &[
        ("03000", Fault::World),
        ("08006", Fault::World),
        ("09000", Fault::Message),
        ("0A000", Fault::World),
        ("0B000", Fault::World),
        ("0F001", Fault::World),
        ("0L000", Fault::World),
        ("0P000", Fault::World),
        ("0Z002", Fault::World),
        ("20000", Fault::Message),
        ("21000", Fault::Message),
        ("22021", Fault::Input),
        ("23505", Fault::Message),
        ("24000", Fault::World),
        ("25006", Fault::World),
        ("26000", Fault::World),
        ("27000", Fault::Message),
        ("28P01", Fault::World),
        ("2B000", Fault::World),
        ("2D000", Fault::World),
        ("2F005", Fault::Message),
        ("34000", Fault::World),
        ("38001", Fault::Message),
        ("39P01", Fault::Message),
        ("3B001", Fault::World),
        ("3D000", Fault::World),
        ("3F000", Fault::World),
        ("40001", Fault::World),
        ("42501", Fault::World),
        ("44000", Fault::Message),
        ("53300", Fault::World),
        ("54000", Fault::Input),
        ("55P03", Fault::World),
        ("57014", Fault::World),
        ("58030", Fault::World),
        ("72000", Fault::World),
        ("F0000", Fault::World),
        ("HV000", Fault::World),
        ("P0001", Fault::Message),
        ("XX000", Fault::World),
    ];

    #[test]
    fn every_sqlstate_class_has_a_verdict() {
        for (code, fault) in CLASSES {
            assert_eq!(by_sqlstate(code), *fault, "{code}");
        }
        // Every class of PostgreSQL's list of error codes that is an error at all.
        let classes: Vec<&str> = CLASSES.iter().map(|(code, _)| &code[..2]).collect();
        assert_eq!(classes.len(), 40, "{classes:?}");
    }

    #[test]
    fn within_a_class_the_codes_that_differ_are_placed() {
        for code in [
            "25006", // read-only transaction: a standby, or a primary fenced for a switchover
            "25P03", // idle-in-transaction session timeout
            "25001", "25P01", "57P01", // terminated by an administrator
            "57P03", // cannot connect now (starting up, shutting down)
            "42P01", "42703", "0A000", "40P01", "55006",
        ] {
            assert_eq!(by_sqlstate(code), Fault::World, "{code}");
        }
        for code in ["22001", "22P05", "22008", "54001"] {
            assert_eq!(by_sqlstate(code), Fault::Input, "{code}");
        }
        for code in ["25P02", "23503", "23514", "P0004"] {
            assert_eq!(by_sqlstate(code), Fault::Message, "{code}");
        }
        // A class added after PostgreSQL 17 still lets a message end.
        assert_eq!(by_sqlstate("ZZ000"), Fault::Message);
    }

    #[test]
    #[cfg(feature = "rabbitmq")]
    fn a_database_error_anywhere_in_a_chain_decides_and_none_leaves_the_verdict_open() {
        use crate::publish::publisher::HandlerError;
        let timeout = HandlerError::transient(Error::invalid("key", "contains a NUL character"));
        assert_eq!(in_chain(&timeout), Some(Fault::Input));
        let stalled = HandlerError::permanent(Error::Stalled(std::time::Duration::from_secs(1)));
        assert_eq!(in_chain(&stalled), Some(Fault::World));
        assert_eq!(in_chain(&HandlerError::transient("bad input")), None);
    }

    #[test]
    fn input_refused_before_any_sql_is_the_message_s_and_missing_things_the_world_s() {
        assert_eq!(
            Fault::of(&Error::invalid("key", "contains a NUL character")),
            Fault::Input
        );
        assert_eq!(Fault::of(&Error::RelayDied("x".into())), Fault::World);
    }
}
