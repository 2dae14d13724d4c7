//! Consumer-side deduplication: a consumer records each message it processed in its own
//! transaction, in `<table>_inbox`.

use postgres::types::Type;
use postgres::Transaction;

use crate::error::{Error, Result};
use crate::producer::message::{at_most, MAX_INDEXED_KEY, MAX_SHORT_STRING};
use crate::producer::outbox::Outbox;
use crate::producer::sql::ProducerSql;

impl Outbox {
    /// Records that `consumer` has processed the message `key`, in the consumer's own
    /// transaction. Returns true the first time, false for a duplicate delivery; rolling the
    /// transaction back forgets it, so a failed handler sees the message as fresh again.
    ///
    /// Both must be non-empty and free of NUL; `consumer` is at most
    /// [`MAX_SHORT_STRING`](crate::MAX_SHORT_STRING) bytes and `key` at most
    /// [`MAX_INDEXED_KEY`](crate::MAX_INDEXED_KEY). Anything else is an error before any SQL,
    /// and the transaction stays usable.
    ///
    /// ```no_run
    /// # use postgres_outbox::Outbox;
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let mut client = postgres::Client::connect("postgres://postgres@localhost/app", postgres::NoTls)?;
    /// # let outbox = Outbox::new("orders_outbox")?;
    /// # let message_id = "0190-example";
    /// let mut tx = client.transaction()?;
    /// if outbox.dedupe(&mut tx, "invoicing", message_id)? {
    ///     // first delivery: do the work in `tx`
    /// }
    /// tx.commit()?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn dedupe(&self, tx: &mut Transaction<'_>, consumer: &str, key: &str) -> Result<bool> {
        for (field, value, limit) in [
            ("consumer", consumer, MAX_SHORT_STRING),
            ("key", key, MAX_INDEXED_KEY),
        ] {
            if value.is_empty() {
                return Err(Error::invalid(field, "must not be empty"));
            }
            if value.contains('\0') {
                return Err(Error::invalid(field, "contains a NUL character"));
            }
            at_most(field, value, limit)?;
        }
        let n = tx
            .execute_typed(
                &self.statements::<ProducerSql>().dedupe,
                &[(&consumer, Type::TEXT), (&key, Type::TEXT)],
            )
            .map_err(|e| self.db_error(e))?;
        Ok(n == 1)
    }
}
