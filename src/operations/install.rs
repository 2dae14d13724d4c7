//! What `migrate` made for a table, found in the catalog, and its removal; and the check
//! that a table is an outbox at all, before an operator's command reads it.
//!
//! The names are the outbox's own, suffix by suffix, rather than every `<table>_*`: another
//! outbox may be named `<table>_eu`, and a user's own `<table>_archive` is not ours to drop.
//! (tests/cli.rs checks that nothing named after the table is left once it is uninstalled,
//! so a companion a migration adds and this list misses fails there.)

use postgres::{Client, GenericClient};

use crate::error::{Error, Result};
use crate::producer::outbox::Outbox;
use crate::schema::table::{TableName, COMPANION_TABLES, FUNCTIONS};

/// What kind of database object `migrate` made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ObjectKind {
    /// A table: the outbox, or a companion (`<table>_inbox`, `<table>_migrations`, ...).
    Table,
    /// A partition of a partitioned outbox: dropped with it.
    Partition,
    /// A function (every overload is named).
    Function,
}

/// One object `migrate` made, as [`Outbox::installed`] finds it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Installed {
    /// Its kind.
    pub kind: ObjectKind,
    /// Its qualified, quoted name; a function's with its argument types.
    pub name: String,
}

impl Outbox {
    /// Fails unless the table is an outbox `migrate` made: [`Error::NotMigrated`] when it
    /// does not exist, [`Error::NotAnOutbox`] when it is some other table. The CLI checks
    /// this before every command that reads the table.
    ///
    /// ```no_run
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let mut client = postgres::Client::connect("postgres://postgres@localhost/app", postgres::NoTls)?;
    /// postgres_outbox::Outbox::new("orders_outbox")?.check(&mut client)?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn check(&self, client: &mut Client) -> Result<()> {
        let table = self.resolved(client)?;
        let row = client.query_one(
            "SELECT to_regclass($1) IS NOT NULL, to_regclass($2) IS NOT NULL,
                    EXISTS (SELECT FROM pg_attribute
                            WHERE attrelid = to_regclass($1) AND attname = 'lease_until'
                              AND NOT attisdropped)",
            &[&table.quoted(), &table.companion("_migrations")],
        )?;
        let (exists, migrated, columns): (bool, bool, bool) = (row.get(0), row.get(1), row.get(2));
        if !exists {
            // The server's own error, as every other statement on a missing table gives it.
            client
                .batch_execute(&format!("SELECT FROM {} LIMIT 0", table.quoted()))
                .map_err(|e| self.db_error(e))?;
        }
        if !(migrated && columns) {
            return Err(Error::NotAnOutbox {
                table: self.table().to_owned(),
            });
        }
        Ok(())
    }

    /// What [`Outbox::uninstall`] would drop, read from the catalog: the table, its
    /// partitions, its companion tables and its functions. Empty when nothing is there.
    pub fn installed(&self, client: &mut Client) -> Result<Vec<Installed>> {
        let table = self.resolved(client)?;
        self.find(client, &table)
    }

    /// Drops everything `migrate` made for this table ([`Outbox::installed`] lists it),
    /// rows included, in one transaction; returns what it dropped. Refused with
    /// [`Error::InUse`] while relays of the table report that they run (stop them first).
    /// The schema of a `schema.table` stays, and so do objects of the user's that depend on
    /// the outbox (a view, say): the drop then fails, and changes nothing.
    ///
    /// ```no_run
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let mut client = postgres::Client::connect("postgres://postgres@localhost/app", postgres::NoTls)?;
    /// let dropped = postgres_outbox::Outbox::new("orders_outbox")?.uninstall(&mut client)?;
    /// println!("dropped {} objects", dropped.len());
    /// # Ok(())
    /// # }
    /// ```
    pub fn uninstall(&self, client: &mut Client) -> Result<Vec<Installed>> {
        let mut tx = client.transaction()?;
        let table = self.resolved(&mut tx)?;
        // A migration of the same table waits; so would a long transaction on the table,
        // for at most this long.
        tx.execute("SELECT pg_advisory_xact_lock($1)", &[&table.lock_key()])?;
        tx.batch_execute("SET LOCAL lock_timeout = '5s'")?;
        let found = self.find(&mut tx, &table)?;
        let has_reports = found
            .iter()
            .any(|o| o.kind == ObjectKind::Table && o.name == table.companion("_relays"));
        if has_reports {
            let running = self
                .relays(&mut tx)?
                .iter()
                .filter(|r| r.is_reporting())
                .count();
            if running > 0 {
                return Err(Error::InUse {
                    table: self.table().to_owned(),
                    relays: running,
                });
            }
        }
        let tables: Vec<&str> = found
            .iter()
            .filter(|o| o.kind == ObjectKind::Table)
            .map(|o| o.name.as_str())
            .collect();
        if !tables.is_empty() {
            tx.batch_execute(&format!("DROP TABLE {}", tables.join(", ")))?;
        }
        for function in found.iter().filter(|o| o.kind == ObjectKind::Function) {
            tx.batch_execute(&format!("DROP FUNCTION {}", function.name))?;
        }
        tx.commit()?;
        Ok(found)
    }

    /// Names are quoted as `TableName` quotes them (every identifier the crate makes is
    /// one it validated, so none holds a quote).
    fn find(&self, client: &mut impl GenericClient, table: &TableName) -> Result<Vec<Installed>> {
        let schema = table.schema().unwrap_or("public").to_owned();
        let name = table.name().to_owned();
        let tables: Vec<String> = std::iter::once(String::new())
            .chain(COMPANION_TABLES.iter().map(|s| (*s).to_owned()))
            .map(|suffix| format!("{name}{suffix}"))
            .collect();
        let functions: Vec<String> = FUNCTIONS.iter().map(|s| format!("{name}{s}")).collect();
        let rows = client.query(
            "SELECT 0, format('\"%s\".\"%s\"', n.nspname, c.relname), c.relname = $2
             FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
             WHERE n.nspname = $1 AND c.relname = ANY($3) AND c.relkind IN ('r', 'p')
               AND NOT c.relispartition
             UNION ALL
             SELECT 1, format('\"%s\".\"%s\"', n.nspname, c.relname), false
             FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
             JOIN pg_namespace n ON n.oid = c.relnamespace
             WHERE i.inhparent = to_regclass(format('%I.%I', $1::text, $2::text))
             UNION ALL
             SELECT 2, p.oid::regprocedure::text, false
             FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
             WHERE n.nspname = $1 AND p.proname = ANY($4)
             ORDER BY 1, 3 DESC, 2",
            &[&schema, &name, &tables, &functions],
        )?;
        Ok(rows
            .iter()
            .map(|row| Installed {
                kind: match row.get::<_, i32>(0) {
                    0 => ObjectKind::Table,
                    1 => ObjectKind::Partition,
                    _ => ObjectKind::Function,
                },
                name: row.get(1),
            })
            .collect())
    }
}
