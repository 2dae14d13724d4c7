//! A connection that keeps an outbox's enqueue statements prepared: for producers that hold a
//! connection (a worker thread, a batch job), the enqueue without the cost of a statement
//! parsed and planned on every call.
//!
//! [`Outbox::enqueue`] takes any transaction, so it cannot know which connection it runs on,
//! nor whether a statement was prepared there: it sends its statement as text, and the
//! server parses and plans it every time (measured: about as much again as the row costs,
//! see BENCHMARKS.md). A prepared statement belongs to the connection that prepared it, and
//! binding it on another fails and aborts that transaction. So a [`Producer`] owns (or
//! borrows) its connection and hands out the transactions its statements run in: a
//! statement meets only the connection that prepared it (unless the client behind
//! `Producer::client` is swapped for another, which the next enqueue reports as
//! PostgreSQL's error 26000).

use std::borrow::BorrowMut;
use std::fmt;
use std::ops::{Deref, DerefMut};

use postgres::types::ToSql;
use postgres::{Client, Statement, Transaction};

use crate::error::Result;
use crate::producer::arguments::{Arguments, CALL_TYPES, PLAIN_TYPES};
use crate::producer::message::Message;
use crate::producer::outbox::Outbox;
use crate::producer::sql::{PreparedSql, ProducerSql};
use crate::schema::statements::checked;

/// A connection with an outbox's enqueue statements prepared on it, and the transactions
/// that use them. Made by [`Outbox::producer`].
///
/// ```no_run
/// use postgres_outbox::{Message, Outbox};
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let client = postgres::Client::connect("postgres://postgres@localhost/app", postgres::NoTls)?;
/// let outbox = Outbox::new("orders_outbox")?;
/// let mut producer = outbox.producer(client)?;
/// for id in 1..=1000_i64 {
///     let mut tx = producer.transaction()?;
///     tx.execute("UPDATE orders SET state = 'paid' WHERE id = $1", &[&id])?;
///     tx.enqueue(Message::new("order.paid", format!(r#"{{"id":{id}}}"#)).aggregate_key(format!("order-{id}")))?;
///     tx.commit()?;
/// }
/// # Ok(())
/// # }
/// ```
pub struct Producer<C: BorrowMut<Client> = Client> {
    client: C,
    prepared: Prepared,
}

/// The statements, and the outbox they were rendered for.
struct Prepared {
    outbox: Outbox,
    /// The enqueue function's call: messages with the caller's key.
    call: Statement,
    /// The INSERT of messages with an aggregate and the crate's key.
    ordered: Statement,
    /// The plain INSERT of the others (notifying or not, as the outbox says).
    plain: Statement,
}

impl Outbox {
    /// Prepares this outbox's enqueue statements on `client` (four round trips: the
    /// schema the table resolves to, then three statements), for a
    /// producer that keeps its connection: each [`ProducerTransaction::enqueue`] then binds
    /// a statement prepared once, where [`Outbox::enqueue`] sends one as text to be parsed
    /// and planned again. What is written, and every guarantee of order, key and
    /// notification, is `enqueue`'s.
    ///
    /// `client` is a [`Client`] or a `&mut Client` (a pooled connection as
    /// `&mut *connection`, though preparing on every checkout costs what it saves). Not
    /// behind a proxy that pools transactions (PgBouncer's transaction mode): a prepared
    /// statement lives in one server session. A statement dropped under it (`DISCARD ALL`,
    /// `DEALLOCATE ALL` on the connection) makes the next enqueue fail with its error,
    /// aborting that transaction: make a new `Producer` after either.
    pub fn producer<C: BorrowMut<Client>>(&self, mut client: C) -> Result<Producer<C>> {
        let connection = client.borrow_mut();
        // Rendered for the name the table resolves to on this connection, as `migrate`
        // renders the functions: the aggregate locks' keys and the channel derive from it,
        // so a lock the INSERT takes is the one the functions take.
        let resolved = self.resolved(connection)?;
        let prepared = checked(PreparedSql::render(
            &resolved,
            self.notifies(),
            self.sequenced(),
        ));
        let sql = self.statements::<ProducerSql>();
        // An outbox that gives places prepares the call that gives them (a message without
        // an aggregate takes none: the plain INSERT serves it either way).
        let call = if self.sequenced() {
            &sql.enqueue_placed
        } else {
            &sql.enqueue
        };
        let call = connection
            .prepare_typed(call, &CALL_TYPES)
            .map_err(|e| self.db_error(e))?;
        let ordered = connection
            .prepare_typed(&prepared.ordered, &CALL_TYPES[..10])
            .map_err(|e| self.db_error(e))?;
        let plain = connection
            .prepare_typed(&prepared.plain, &PLAIN_TYPES)
            .map_err(|e| self.db_error(e))?;
        Ok(Producer {
            client,
            prepared: Prepared {
                outbox: self.clone(),
                call,
                ordered,
                plain,
            },
        })
    }
}

impl<C: BorrowMut<Client>> Producer<C> {
    /// Begins a transaction on the producer's connection.
    pub fn transaction(&mut self) -> Result<ProducerTransaction<'_>> {
        Ok(ProducerTransaction {
            tx: self.client.borrow_mut().transaction()?,
            prepared: &self.prepared,
            locked: Vec::new(),
            many: false,
        })
    }

    /// The connection, for work outside a producer's transaction.
    pub fn client(&mut self) -> &mut Client {
        self.client.borrow_mut()
    }

    /// The outbox the statements were prepared for.
    pub fn outbox(&self) -> &Outbox {
        &self.prepared.outbox
    }

    /// The connection back. The statements are closed on it as they drop.
    pub fn into_inner(self) -> C {
        self.client
    }
}

impl<C: BorrowMut<Client>> fmt::Debug for Producer<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Producer")
            .field("outbox", &self.prepared.outbox)
            .finish_non_exhaustive()
    }
}

/// A transaction of a [`Producer`]'s connection: a [`postgres::Transaction`] (it derefs to
/// one, for the business writes) that enqueues with the producer's prepared statements.
/// Dropped without [`commit`](ProducerTransaction::commit), it rolls back.
pub struct ProducerTransaction<'a> {
    tx: Transaction<'a>,
    prepared: &'a Prepared,
    /// The aggregates this transaction's INSERTs locked, `PRODUCER_LOCKS` at most.
    locked: Vec<String>,
    /// Past `PRODUCER_LOCKS` aggregates: the table's ordered enqueues are locked, and the
    /// enqueue function writes the rest (see [`ProducerTransaction::own_lock`]).
    many: bool,
}

/// How many aggregates a `Producer`'s transaction locks by its own INSERTs, as many as the
/// enqueue functions lock one by one (`sql/functions/locks.sql`), so the shared lock table
/// holds a bounded number of each transaction's.
const PRODUCER_LOCKS: usize = 64;

impl ProducerTransaction<'_> {
    /// [`Outbox::enqueue`] by the prepared statements: one round trip, and nothing parsed
    /// or planned. Errors as `enqueue`'s: a refused message changes nothing and leaves the
    /// transaction usable, and so does a key already in the outbox
    /// ([`Error::is_duplicate_key`](crate::Error::is_duplicate_key)).
    pub fn enqueue(&mut self, message: Message) -> Result<String> {
        let prepared = self.prepared;
        let outbox = &prepared.outbox;
        let arguments = Arguments::new(message, outbox.notifies())?;
        let inserted = if let Some(plain) = arguments.plain() {
            self.tx
                .execute(&prepared.plain, &plain)
                .map_err(|e| outbox.db_error(e))?;
            true
        } else if let Some(ordered) = self.own_lock(&arguments)? {
            self.tx
                .execute(&prepared.ordered, &ordered)
                .map_err(|e| outbox.db_error(e))?;
            true
        } else {
            self.tx
                .query_one(&prepared.call, &arguments.call())
                .map_err(|e| outbox.db_error(e))?
                .get(0)
        };
        arguments.inserted(inserted, outbox.table())
    }

    /// The ordered INSERT's arguments, when the message has an aggregate and the crate's
    /// key and this transaction's INSERTs may lock one more aggregate: `PRODUCER_LOCKS`
    /// distinct ones (taking a lock the transaction holds costs no lock of the shared
    /// table, and a savepoint rolled back may have let one go, so an INSERT always takes
    /// its lock). Past that, the aggregates are recorded as the enqueue functions record
    /// theirs, which locks the table's ordered enqueues (all sixteen buckets, see
    /// `sql/functions/locks.sql`), and the function writes this message and the later
    /// ones: it takes no more locks, and its record rolls back with a savepoint.
    fn own_lock<'m>(
        &mut self,
        arguments: &'m Arguments,
    ) -> Result<Option<[&'m (dyn ToSql + Sync); 10]>> {
        let (Some(ordered), Some(aggregate)) = (arguments.ordered(), arguments.aggregate_key())
        else {
            return Ok(None);
        };
        if self.many {
            return Ok(None);
        }
        if self.locked.iter().any(|locked| locked == aggregate) {
            return Ok(Some(ordered));
        }
        if self.locked.len() < PRODUCER_LOCKS {
            self.locked.push(aggregate.to_owned());
            return Ok(Some(ordered));
        }
        let mut all = std::mem::take(&mut self.locked);
        all.push(aggregate.to_owned());
        let outbox = &self.prepared.outbox;
        let lock_many = &outbox.statements::<ProducerSql>().lock_many;
        if let Err(e) = self.tx.execute(lock_many, &[&all]) {
            all.pop();
            self.locked = all;
            return Err(outbox.db_error(e));
        }
        self.many = true;
        Ok(None)
    }

    /// [`Outbox::enqueue_all`] in this transaction (a batch is one statement or a `COPY`
    /// already: preparing it would save nothing worth a statement kept per connection).
    pub fn enqueue_all(
        &mut self,
        messages: impl IntoIterator<Item = Message>,
    ) -> Result<Vec<String>> {
        self.prepared.outbox.enqueue_all(&mut self.tx, messages)
    }

    /// Commits: the messages exist from here on, with the rest of the transaction's work.
    pub fn commit(self) -> Result<()> {
        Ok(self.tx.commit()?)
    }

    /// Rolls back, messages and all.
    pub fn rollback(self) -> Result<()> {
        Ok(self.tx.rollback()?)
    }
}

impl<'a> Deref for ProducerTransaction<'a> {
    type Target = Transaction<'a>;

    fn deref(&self) -> &Transaction<'a> {
        &self.tx
    }
}

impl<'a> DerefMut for ProducerTransaction<'a> {
    fn deref_mut(&mut self) -> &mut Transaction<'a> {
        &mut self.tx
    }
}

impl fmt::Debug for ProducerTransaction<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProducerTransaction")
            .field("outbox", &self.prepared.outbox)
            .finish_non_exhaustive()
    }
}
