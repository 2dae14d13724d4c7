//! The outbox handle: its table, settings and statements, its migration and grants, and
//! enqueueing.

use std::fmt;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

use postgres::error::SqlState;
use postgres::{Client, GenericClient, IsolationLevel, Transaction};

use crate::error::{Error, Result};
use crate::producer::arguments::Arguments;
use crate::producer::batch::Batch;
use crate::producer::message::Message;
use crate::producer::sql::ProducerSql;
use crate::runtime::retry::{check_lease, check_retry, Retry};
use crate::schema::grants::{self, Access};
use crate::schema::migrate::MigrateSql;
use crate::schema::migrate::{self, Form, Schema, MIGRATIONS};
use crate::schema::partitioning::{self, PartitionSql};
use crate::schema::statements::{self, Rendered, Statements};
use crate::schema::table::{check_role, quote, TableName};

/// A validated outbox table and the SQL for it. Cheap to clone; share one per table.
///
/// ```no_run
/// use postgres_outbox::{Message, Outbox};
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let mut client = postgres::Client::connect("postgres://postgres@localhost/app", postgres::NoTls)?;
/// let outbox = Outbox::new("orders_outbox")?;
/// outbox.migrate(&mut client)?;
///
/// let mut tx = client.transaction()?;
/// tx.execute("UPDATE orders SET state = 'paid' WHERE id = $1", &[&42_i64])?;
/// outbox.enqueue(&mut tx, Message::new("order.paid", br#"{"id":42}"#.to_vec()))?;
/// tx.commit()?; // the event exists if, and only if, the order was paid
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct Outbox {
    inner: Arc<Inner>,
}

struct Inner {
    notify: bool,
    partition_interval: Option<Duration>,
    /// What this process last learned of the table: `UNKNOWN`, `PLAIN` or `PARTITIONED`.
    kind: AtomicU8,
    lease: Duration,
    retry: Retry,
    park: bool,
    /// Whether enqueue gives messages their places in their aggregates' sequences.
    sequence: bool,
    /// Each part's statements, rendered on its first use.
    sql: Rendered,
}

impl fmt::Debug for Outbox {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Outbox")
            .field("table", &self.table())
            .field("notify", &self.inner.notify)
            .finish()
    }
}

/// What an `Outbox` knows of its table's kind.
const UNKNOWN: u8 = 0;
const PLAIN: u8 = 1;
const PARTITIONED: u8 = 2;

/// Builds an [`Outbox`] with non-default settings.
///
/// ```
/// use std::time::Duration;
/// use postgres_outbox::{Outbox, Retry};
///
/// let outbox = Outbox::builder()
///     .table("audit.events")
///     .notify(false)
///     .retry(Retry::new(5).backoff(Duration::from_secs(1), Duration::from_secs(60)))
///     .build()?;
/// assert_eq!(outbox.table(), "audit.events");
/// # Ok::<(), postgres_outbox::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct OutboxBuilder {
    table: String,
    notify: bool,
    partition_interval: Option<Duration>,
    lease: Duration,
    retry: Retry,
    park: bool,
    sequence: bool,
}

impl Default for OutboxBuilder {
    fn default() -> OutboxBuilder {
        OutboxBuilder {
            table: "outbox".to_owned(),
            notify: true,
            partition_interval: None,
            lease: Duration::from_secs(30),
            retry: Retry::default(),
            park: false,
            sequence: false,
        }
    }
}

impl OutboxBuilder {
    /// The table, `name` or `schema.name`; default `outbox`.
    pub fn table(mut self, table: impl Into<String>) -> OutboxBuilder {
        self.table = table.into();
        self
    }

    /// Whether enqueue sends a `pg_notify` to wake relays at once (default true). Each
    /// notifying transaction takes a global lock at commit; turn it off for the highest
    /// producer throughput, or behind a transaction-pooling proxy, and let relays poll.
    ///
    /// Turn it off, too, on the outbox of a producer that prepares its transactions
    /// (two-phase commit, `PREPARE TRANSACTION`): PostgreSQL refuses to prepare a
    /// transaction that ran NOTIFY, and an enqueue notifies only while some relay waits for
    /// work, so with notify on such a producer fails only now and then. With `notify(false)`
    /// no enqueue (nor `enqueue_all`) ever runs NOTIFY; the relays find the rows when they
    /// poll, once `COMMIT PREPARED` makes them visible.
    pub fn notify(mut self, notify: bool) -> OutboxBuilder {
        self.notify = notify;
        self
    }

    /// How long a claim holds a row before another worker may take it (default 30 s).
    /// The default for relays and the lease [`Outbox::process`] uses.
    pub fn lease(mut self, lease: Duration) -> OutboxBuilder {
        self.lease = lease;
        self
    }

    /// Attempts and backoff for [`Outbox::process`], and the start of every relay's
    /// (default [`Retry::default`]: 10 attempts, 500 ms up to 300 s); a message may set its
    /// own attempt limit.
    pub fn retry(mut self, retry: Retry) -> OutboxBuilder {
        self.retry = retry;
        self
    }

    /// Whether a message that becomes a dead letter *parks* its aggregate (default false):
    /// the later messages of the aggregate then stay pending until an operator redrives it
    /// (it goes first, then the rest in order) or skips it. Off, a dead message stops
    /// blocking its aggregate and the later ones go on without it. The default for relays
    /// and [`Outbox::process`]; a message can say otherwise with
    /// [`Message::park_on_dead`].
    pub fn park_on_dead(mut self, park: bool) -> OutboxBuilder {
        self.park = park;
        self
    }

    /// Whether enqueue gives each message with an aggregate key its place in its aggregate's
    /// publication sequence (default false): 1, 2, 3, ..., consecutive, in the order the
    /// aggregate's producers commit (a rolled-back enqueue takes its place back). Relays
    /// hand it to publishers as [`Record::sequence`](crate::Record::sequence) and the
    /// RabbitMQ publisher sends it as the integer header `x-outbox-sequence`, so that the
    /// RabbitMQ consumer can tell a message that skips places (one the queue dropped, an
    /// operator skipped, or a broker lost) or comes behind, and report it to its handler.
    ///
    /// It costs the producer a counter per aggregate (`<table>_sequences`, one row each,
    /// kept through purges) bumped in its transaction, and writes a large `enqueue_all` by
    /// the batch function rather than by `COPY` (docs/rabbitmq.md, "Publication sequence",
    /// says how much). Turn it on in every producer of the outbox: messages of a producer
    /// without it carry no place, and the places count only those that do.
    pub fn sequence(mut self, sequence: bool) -> OutboxBuilder {
        self.sequence = sequence;
        self
    }

    /// Makes the table, when [`Outbox::migrate`] creates it, partitioned by time: each
    /// partition takes the messages enqueued in one interval (from 1 minute to 366 days;
    /// a day suits most), and [`Outbox::purge`] of sent rows by age drops a partition
    /// whole, once every row in it is sent, instead of deleting rows one by one. Relays
    /// keep partitions ready ahead of time. Default: a plain table. On a table already
    /// partitioned, `migrate` sets the interval of the open and later partitions; a plain
    /// table that holds rows is not converted (docs/partitions.md says how).
    pub fn partition_interval(mut self, every: Duration) -> OutboxBuilder {
        self.partition_interval = Some(every);
        self
    }

    /// Validates the settings.
    pub fn build(self) -> Result<Outbox> {
        let table = TableName::parse(&self.table)?;
        check_lease(self.lease)?;
        check_retry(&self.retry)?;
        if let Some(every) = self.partition_interval {
            if every < Duration::from_secs(60) || every > Duration::from_secs(366 * 24 * 3600) {
                return Err(Error::InvalidConfig(format!(
                    "partition_interval must be between 1 minute and 366 days, got {every:?}"
                )));
            }
        }
        Ok(Outbox {
            inner: Arc::new(Inner {
                notify: self.notify,
                partition_interval: self.partition_interval,
                kind: AtomicU8::new(UNKNOWN),
                lease: self.lease,
                retry: self.retry,
                park: self.park,
                sequence: self.sequence,
                sql: Rendered::new(table),
            }),
        })
    }
}

impl Outbox {
    /// An outbox on `table` (`name` or `schema.name`) with default settings.
    ///
    /// The name must be a plain identifier (ASCII letters, digits, underscores) that leaves
    /// room for the longest derived name, `<table>_migrations`; it is always quoted in SQL.
    ///
    /// ```
    /// use postgres_outbox::Outbox;
    /// assert!(Outbox::new("orders_outbox").is_ok());
    /// assert!(Outbox::new("x; DROP TABLE y").is_err());
    /// ```
    pub fn new(table: &str) -> Result<Outbox> {
        Outbox::builder().table(table).build()
    }

    /// A builder for the non-default settings.
    pub fn builder() -> OutboxBuilder {
        OutboxBuilder::default()
    }

    /// The table name as configured.
    pub fn table(&self) -> &str {
        self.table_name().as_str()
    }

    /// The NOTIFY channel producers notify on and relays LISTEN on, as the migrations
    /// rendered it (from the table's schema-qualified name).
    pub fn channel(&self, client: &mut Client) -> Result<String> {
        let row = client
            .query_one(&self.statements::<MigrateSql>().channel, &[])
            .map_err(|e| self.db_error(e))?;
        Ok(row.get(0))
    }

    /// The table's name with the schema PostgreSQL resolves it to on this connection (the
    /// schema it is in, or would be created in), so that processes spelling it differently
    /// (`orders`, `public.orders`) take the same migration lock and render the same channel.
    pub(crate) fn resolved(&self, client: &mut impl GenericClient) -> Result<TableName> {
        let table = self.table_name();
        if table.schema().is_some() {
            return Ok(table.clone());
        }
        let schema: Option<String> = client
            .query_one(
                &self.statements::<MigrateSql>().schema_of,
                &[&table.quoted()],
            )?
            .get(0);
        Ok(schema
            .and_then(|schema| TableName::parse(&format!("{schema}.{}", table.as_str())).ok())
            .unwrap_or_else(|| table.clone()))
    }

    /// Whether enqueue sends notifications (to relays that wait).
    pub(crate) fn notifies(&self) -> bool {
        self.inner.notify
    }

    /// The statements of part `S` for this table, rendered on the first call of any clone.
    pub(crate) fn statements<S: Statements>(&self) -> &S {
        self.inner.sql.get()
    }

    /// The table, as validated.
    pub(crate) fn table_name(&self) -> &TableName {
        self.inner.sql.table()
    }

    pub(crate) fn lease(&self) -> Duration {
        self.inner.lease
    }

    pub(crate) fn retry(&self) -> Retry {
        self.inner.retry
    }

    /// Whether enqueue gives places in aggregates' sequences.
    pub(crate) fn sequenced(&self) -> bool {
        self.inner.sequence
    }

    /// Whether a dead message parks its aggregate unless it says otherwise.
    pub(crate) fn parks(&self) -> bool {
        self.inner.park
    }

    /// See [`statements::db_error`].
    pub(crate) fn db_error(&self, e: postgres::Error) -> Error {
        statements::db_error(self.table_name(), e)
    }

    /// Creates or upgrades the outbox's tables, indexes and functions.
    ///
    /// The embedded migrations in `sql/` run in one transaction under an advisory lock
    /// derived from the table name and are recorded in `<table>_migrations`, and the
    /// functions of `sql/functions/` are made again where `<table>_functions` records
    /// another text of them, so running this on every start, from many processes at once,
    /// is safe. A migration that cannot lock
    /// the tables within 5 s (a long transaction holds them) gives up with an error
    /// (SQLSTATE 55P03) rather than queue behind it and block producers and relays
    /// meanwhile: run it again later.
    ///
    /// ```no_run
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let mut client = postgres::Client::connect("postgres://postgres@localhost/app", postgres::NoTls)?;
    /// postgres_outbox::Outbox::new("orders_outbox")?.migrate(&mut client)?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn migrate(&self, client: &mut Client) -> Result<()> {
        // Two migrations of different tables in one new schema can race on CREATE SCHEMA IF
        // NOT EXISTS (the advisory lock is per table); the loser simply tries again.
        let mut tries = 0;
        loop {
            match self.migrate_once(client) {
                Err(e) if e.code() == Some(&SqlState::UNIQUE_VIOLATION) && tries < 3 => {
                    tries += 1;
                }
                other => return other,
            }
        }
    }

    fn migrate_once(&self, client: &mut Client) -> Result<()> {
        let sql: &MigrateSql = self.statements();
        // READ COMMITTED whatever the session's default: a snapshot taken before the lock
        // (as REPEATABLE READ's is) misses what the migration ahead of it committed, and
        // this one would apply it again.
        let mut tx = client
            .build_transaction()
            .isolation_level(IsolationLevel::ReadCommitted)
            .start()?;
        let table = self.resolved(&mut tx)?;
        tx.execute("SELECT pg_advisory_xact_lock($1)", &[&table.lock_key()])?;
        // Once it is this process's turn: a migration that waited behind a long transaction
        // for its lock on the table would block every producer and relay queued behind it.
        // Better to give up and be run again.
        tx.batch_execute(&sql.migration_lock_timeout)?;
        if let Some(create_schema) = &sql.create_schema {
            tx.batch_execute(create_schema)?;
        }
        let schema = Schema::new(&table);
        tx.batch_execute(&sql.migrations_table)?;
        tx.batch_execute(&schema.forget_squashed)?;
        let applied: Vec<i32> = tx
            .query(&sql.applied_versions, &[])?
            .iter()
            .map(|row| row.get(0))
            .collect();
        for (migration, ddl) in MIGRATIONS.iter().zip(&schema.migrations) {
            if applied.contains(&migration.version) {
                continue;
            }
            log::info!(
                "outbox {}: applying migration {}",
                self.table(),
                migration.name
            );
            tx.batch_execute(ddl)?;
            tx.execute(
                &sql.record_migration,
                &[&migration.version, &migration.name],
            )?;
        }
        tx.batch_execute(&schema.functions_table)?;
        schema.make_functions(&mut tx, self.table(), Form::Any)?;
        let partitioned: bool = tx.query_one(&sql.is_partitioned, &[])?.get(0);
        let partitioned = partitioning::give_form(
            &mut tx,
            &table,
            self.statements::<PartitionSql>(),
            self.table(),
            partitioned,
            self.inner.partition_interval,
        )?;
        schema.make_functions(&mut tx, self.table(), migrate::form(partitioned))?;
        schema.forget_functions(&mut tx, partitioned)?;
        tx.commit()?;
        self.learned(partitioned);
        Ok(())
    }

    /// Whether the table is partitioned, asked of the catalog once per `Outbox` (a table
    /// becomes partitioned only while empty, by `migrate`: convert it before producers
    /// run).
    pub(crate) fn partitioned(&self, client: &mut impl GenericClient) -> Result<bool> {
        self.partitioned_as_client(client)
            .map_err(|e| self.db_error(e))
    }

    /// What [`Outbox::partitioned`] has found, if it has asked.
    pub(crate) fn known_partitioned(&self) -> Option<bool> {
        match self.inner.kind.load(Ordering::Relaxed) {
            PLAIN => Some(false),
            PARTITIONED => Some(true),
            _ => None,
        }
    }

    /// [`Outbox::partitioned`] with the client's own error, for a session's setup.
    pub(crate) fn partitioned_as_client(
        &self,
        client: &mut impl GenericClient,
    ) -> std::result::Result<bool, postgres::Error> {
        if let Some(partitioned) = self.known_partitioned() {
            return Ok(partitioned);
        }
        let partitioned: bool = client
            .query_one(&self.statements::<MigrateSql>().is_partitioned, &[])?
            .get(0);
        self.learned(partitioned);
        Ok(partitioned)
    }

    fn learned(&self, partitioned: bool) {
        let kind = if partitioned { PARTITIONED } else { PLAIN };
        self.inner.kind.store(kind, Ordering::Relaxed);
    }

    /// The DDL [`Outbox::migrate`] applies, for teams that run their own migration tool.
    /// It can be run again: each migration runs only if `<table>_migrations` does not
    /// record it yet, and each function file only if `<table>_functions` does not record
    /// its text, and records it, so a later `migrate` finds nothing to do either. Use
    /// a schema-qualified table name here, as `migrate` resolves it to its schema first.
    pub fn sql(&self) -> String {
        migrate::script(
            self.table_name(),
            self.statements(),
            self.inner.partition_interval,
        )
    }

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
        check_role(role).map_err(|why| Error::invalid("role", why))?;
        Ok(grants::grants(self.table_name(), access, &quote(role)))
    }

    /// Enqueues a message in the caller's transaction and returns its key; it is published
    /// only if that transaction commits. One round trip.
    ///
    /// A key already in the outbox gives an error with [`Error::is_duplicate_key`]; nothing
    /// is written and the transaction stays usable. Invalid fields are rejected before any SQL.
    ///
    /// ```no_run
    /// # use postgres_outbox::{Message, Outbox};
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let mut client = postgres::Client::connect("postgres://postgres@localhost/app", postgres::NoTls)?;
    /// # let outbox = Outbox::new("orders_outbox")?;
    /// let mut tx = client.transaction()?;
    /// let key = outbox.enqueue(
    ///     &mut tx,
    ///     Message::new("order.created", b"{}".to_vec()).aggregate_key("order-42"),
    /// )?;
    /// tx.commit()?;
    /// println!("enqueued {key}");
    /// # Ok(())
    /// # }
    /// ```
    pub fn enqueue(&self, tx: &mut Transaction<'_>, message: Message) -> Result<String> {
        let arguments = Arguments::new(message, self.inner.notify)?;
        let sql: &ProducerSql = self.statements();
        if self.sequenced() {
            if let Some(placed) = arguments.typed_placed() {
                tx.execute_typed(&sql.enqueue_one_placed, &placed)
                    .map_err(|e| self.db_error(e))?;
                return arguments.inserted(true, self.table());
            }
        }
        let statement = if self.sequenced() && arguments.ordered_by_caller() {
            &sql.enqueue_placed
        } else {
            &sql.enqueue
        };
        let inserted: bool = tx
            .query_typed_one(statement, &arguments.typed_call())
            .map_err(|e| self.db_error(e))?
            .get(0);
        arguments.inserted(inserted, self.table())
    }

    /// Enqueues many messages, all or nothing, and returns their keys in order. A batch of 64
    /// or more messages that are all due at once is written with a binary `COPY` (in a
    /// savepoint, four round trips); a smaller or scheduled one in one round trip.
    ///
    /// If any key is already in the outbox (or repeats within `messages`), nothing is
    /// written, the error's [`Error::duplicate_keys`] names them, and the transaction stays
    /// usable.
    pub fn enqueue_all(
        &self,
        tx: &mut Transaction<'_>,
        messages: impl IntoIterator<Item = Message>,
    ) -> Result<Vec<String>> {
        let messages: Vec<Message> = messages.into_iter().collect();
        if messages.is_empty() {
            return Ok(Vec::new());
        }
        let batch = Batch::new(messages)?;
        // The caller's keys in a partitioned table are unique across partitions by the
        // batch function's look into each (see `sql/partitioned.sql`), which COPY skips.
        let copy = batch.copies() && (batch.generated() || !self.partitioned(tx)?);
        let placed = self.sequenced() && batch.ordered();
        let target = (self.statements::<ProducerSql>(), self.table_name());
        batch.write(target, self.notifies(), copy, placed, tx)
    }
}
