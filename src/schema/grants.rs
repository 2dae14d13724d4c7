//! The rights each side of an outbox needs under a role that owns nothing (docs/grants.md),
//! as GRANT statements: the list changes with the migrations, so it is kept here, beside
//! them, and not in each deployment's scripts.

use crate::error::{Error, Result};
use crate::producer::outbox::Outbox;
use crate::schema::table;
use crate::sql;

/// A side of an outbox, for [`Outbox::grants`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Access {
    /// `enqueue` and `enqueue_all`.
    Produce,
    /// A relay, and `process`: claims, records, reports, and keeps a partitioned table's
    /// partitions.
    Relay,
    /// `dedupe` alone.
    Dedupe,
    /// The RabbitMQ `Consumer`: `dedupe`, and its failure counts.
    Consume,
    /// `purge` and `would_purge` by age on a partitioned table: drops partitions whose rows
    /// are all sent.
    Retire,
}

impl Outbox {
    /// The GRANT statements that give `role` what `access` needs on this outbox's tables
    /// and functions, USAGE on its schema included, and nothing more. Run them as the
    /// owner (the role that ran `migrate`), after `migrate`, and again after an upgrade
    /// whose notes say the rights changed; running them twice is harmless.
    ///
    /// `role` is taken as written (quoted): a role created as `CREATE ROLE relay` is
    /// `relay`. It may hold ASCII letters, digits and `_ - . @` (which takes in the names
    /// cloud databases give their IAM users), up to 63 bytes, and is never `public`, which
    /// PostgreSQL reads as every role: anything else is refused, so a name never needs
    /// escaping in the statements. On a plain table a relay is given EXECUTE on the
    /// partition upkeep too, which it never calls there.
    ///
    /// ```
    /// use postgres_outbox::{Access, Outbox};
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let outbox = Outbox::new("app.orders_outbox")?;
    /// let grants = outbox.grants(Access::Relay, "relay")?;
    /// assert!(grants.contains(r#"GRANT SELECT, UPDATE ON "app"."orders_outbox" TO "relay";"#));
    /// # Ok(())
    /// # }
    /// ```
    pub fn grants(&self, access: Access, role: &str) -> Result<String> {
        table::check_role(role).map_err(|why| Error::invalid("role", why))?;
        Ok(sql::grants(
            self.statements().table(),
            access,
            &table::quote(role),
        ))
    }
}
