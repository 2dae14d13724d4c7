//! Whose fault a failure is: the one place that decides what may be charged to a message.
//!
//! A fault of the world (the database or the way to it, permissions, a server shutting down)
//! is waited out and never charged to a message, on any path: the relay's outcomes, the
//! consumer, the dead-letter queue. Only a message's own fault counts against it: data the
//! database can never store ends it at once, and anything else its handling did is one
//! failed attempt.

use crate::error::Error;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fault {
    /// The database, the broker or the way to them: try again after a backoff, uncharged.
    World,
    /// Input the database refuses and always will (a NUL, an invalid encoding, a value too
    /// long for its index): the message is dead at once, with the reason.
    Input,
    /// Something the message's handling did (a constraint it broke, a handler that left its
    /// transaction aborted): one failed attempt.
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
            // A table that is not there yet, no pooled connection, the broker.
            _ => Fault::World,
        }
    }
}

/// The server's verdict, by SQLSTATE class.
fn by_sqlstate(code: &str) -> Fault {
    // 08 connection, 28 authorization, 3D catalog, 40 serialization failure or deadlock,
    // 53 resources, 55 lock not available, 57 operator intervention (statement timeout,
    // shutdown), 58 system, XX internal; and 42501, a privilege an operator took away.
    const WORLD: &[&str] = &["08", "28", "3D", "40", "53", "55", "57", "58", "XX"];
    if WORLD.iter().any(|class| code.starts_with(class)) || code == "42501" {
        return Fault::World;
    }
    // 22 data exception (invalid encoding, NUL, out of range), 54 program limit (an index
    // row too large).
    if code.starts_with("22") || code.starts_with("54") {
        return Fault::Input;
    }
    Fault::Message
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sqlstates_are_the_world_s_the_input_s_or_the_message_s() {
        for code in [
            "08006", "40001", "40P01", "53300", "55P03", "57014", "57P01", "42501",
        ] {
            assert_eq!(by_sqlstate(code), Fault::World, "{code}");
        }
        for code in ["22021", "22P05", "22001", "54000"] {
            assert_eq!(by_sqlstate(code), Fault::Input, "{code}");
        }
        for code in ["23505", "23503", "25P02", "P0001"] {
            assert_eq!(by_sqlstate(code), Fault::Message, "{code}");
        }
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
