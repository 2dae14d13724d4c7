//! The binary's logger: `env_logger` as `RUST_LOG` asks, the crates that log secrets never
//! above info whatever it asks.

use log::{Level, Log, Metadata, Record};

/// The PostgreSQL driver logs every statement's parameters (payloads) at debug level, and
/// the AMQP client its handshake (the PLAIN password): their logs go no further than info.
const CAPPED: [&str; 3] = ["tokio_postgres", "postgres", "amiquip"];

/// Logs as `RUST_LOG` asks (`default` where it is not set), never above info for the
/// crates of [`CAPPED`].
///
/// A cap over `env_logger` rather than one of its directives: a directive sets a level
/// (raising the driver to info where only warnings are asked for) and matches targets by
/// prefix (`postgres` matches `postgres_outbox`).
pub(crate) fn init(default: &str) {
    let logger =
        env_logger::Builder::from_env(env_logger::Env::default().default_filter_or(default))
            .build();
    let max = logger.filter();
    if log::set_boxed_logger(Box::new(Capped(logger))).is_ok() {
        log::set_max_level(max);
    }
}

struct Capped(env_logger::Logger);

impl Capped {
    fn capped(metadata: &Metadata<'_>) -> bool {
        metadata.level() > Level::Info
            && CAPPED.iter().any(|name| in_crate(metadata.target(), name))
    }
}

/// Whether `target` (a module path) is in crate `name`: the crate's root or a module of it.
fn in_crate(target: &str, name: &str) -> bool {
    target
        .strip_prefix(name)
        .is_some_and(|rest| rest.is_empty() || rest.starts_with("::"))
}

impl Log for Capped {
    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        !Capped::capped(metadata) && self.0.enabled(metadata)
    }

    fn log(&self, record: &Record<'_>) {
        // env_logger's own log() applies its filter.
        if !Capped::capped(record.metadata()) {
            self.0.log(record);
        }
    }

    fn flush(&self) {
        self.0.flush();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cap_holds_the_crates_it_names_and_no_other() {
        let at = |level, target| Metadata::builder().level(level).target(target).build();
        for target in [
            "tokio_postgres",
            "tokio_postgres::query",
            "postgres",
            "postgres::config",
            "amiquip",
            "amiquip::io",
        ] {
            assert!(Capped::capped(&at(Level::Debug, target)), "{target}");
            assert!(!Capped::capped(&at(Level::Info, target)), "{target}");
        }
        for target in [
            "postgres_outbox::relay",
            "postgres_outbox",
            "postgres_native_tls",
            "amiquipx",
        ] {
            assert!(!Capped::capped(&at(Level::Trace, target)), "{target}");
        }
    }
}
