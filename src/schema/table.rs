//! Validated table names and every identifier derived from them.

use crate::error::{Error, Result};

/// PostgreSQL truncates identifiers longer than this (NAMEDATALEN - 1).
const MAX_IDENT: usize = 63;

/// The companion tables `migrate` makes, by suffix.
pub(crate) const COMPANION_TABLES: &[&str] = &[
    "_inbox",
    "_failures",
    "_sequences",
    "_consumed",
    "_counts",
    "_waiting",
    "_relays",
    "_partitions",
    "_migrations",
    "_functions",
];

/// The functions `migrate` makes, by suffix (a name may have several overloads).
pub(crate) const FUNCTIONS: &[&str] = &[
    "_notify",
    "_channel",
    "_enqueue",
    "_enqueue_n",
    "_head",
    "_place",
    "_placed",
    "_lock_n",
    "_lock_heads",
    "_busy",
    "_partition",
    "_retire",
    "_settle",
    "_ids_drawn",
    "_key_taken",
    "_keys_taken",
];

/// The other objects named after the table: indexes, constraints, the table a partitioned
/// outbox is converted from, and a partition and its key index (`_p<n>`, `_k<n>`, n below
/// ten million).
const OTHER_SUFFIXES: &[&str] = &[
    "_key",
    "_due",
    "_unordered",
    "_agg",
    "_done",
    "_status",
    "_ready",
    "_ordered",
    "_plain",
    "_pkey",
    "_p9999999",
];

/// A validated `[schema.]table` with its quoted forms.
#[derive(Debug, Clone)]
pub(crate) struct TableName {
    display: String,
    schema: Option<String>,
    name: String,
}

impl TableName {
    pub(crate) fn parse(input: &str) -> Result<TableName> {
        let bad = |reason: &str| Error::InvalidTableName {
            name: input.to_owned(),
            reason: reason.to_owned(),
        };
        let (schema, name) = match input.split_once('.') {
            Some((schema, name)) => (Some(schema), name),
            None => (None, input),
        };
        if let Some(schema) = schema {
            check_ident(schema).map_err(|r| bad(&format!("schema {r}")))?;
        }
        check_ident(name).map_err(|r| bad(&format!("table {r}")))?;
        // Every name derived from the table must still fit after it.
        let longest = COMPANION_TABLES
            .iter()
            .chain(FUNCTIONS)
            .chain(OTHER_SUFFIXES)
            .map(|s| s.len())
            .max()
            .unwrap_or(0);
        if name.len() + longest > MAX_IDENT {
            return Err(bad(&format!(
                "table part is {} bytes; at most {} fit with the suffix \"_migrations\"",
                name.len(),
                MAX_IDENT - longest
            )));
        }
        Ok(TableName {
            display: input.to_owned(),
            schema: schema.map(str::to_owned),
            name: name.to_owned(),
        })
    }

    /// The name as the user gave it.
    pub(crate) fn as_str(&self) -> &str {
        &self.display
    }

    pub(crate) fn schema(&self) -> Option<&str> {
        self.schema.as_deref()
    }

    /// The name without its schema: `events`.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// What qualifies a name in the table's schema, quoted: `"audit".`, or nothing.
    pub(crate) fn schema_prefix(&self) -> String {
        self.schema
            .as_deref()
            .map_or_else(String::new, |schema| format!("{}.", quote(schema)))
    }

    /// The quoted, schema-qualified table: `"audit"."events"`.
    pub(crate) fn quoted(&self) -> String {
        self.qualified(&self.name)
    }

    /// A companion table in the same schema: `"audit"."events_inbox"`.
    pub(crate) fn companion(&self, suffix: &str) -> String {
        self.qualified(&format!("{}{suffix}", self.name))
    }

    /// An unqualified derived name (indexes, constraints live in the table's schema).
    pub(crate) fn derived(&self, suffix: &str) -> String {
        quote(&format!("{}{suffix}", self.name))
    }

    /// The NOTIFY channel: the qualified name when it fits, else a stable hash of it.
    pub(crate) fn channel(&self) -> String {
        if self.display.len() <= MAX_IDENT {
            self.display.clone()
        } else {
            format!("outbox_{:016x}", self.lock_key())
        }
    }

    /// The advisory-lock key for migrations: a stable FNV-1a hash of the name, so every
    /// process and every version of this crate agree on it.
    pub(crate) fn lock_key(&self) -> i64 {
        self.hash("postgres-outbox:")
    }

    /// The first of the sixteen bucket locks on the table's ordered enqueues (this key plus
    /// 0 to 15): an aggregate lock holder holds its aggregate's bucket shared, a transaction
    /// past its share of aggregate locks holds all sixteen exclusively. Positive, with the
    /// low four bits clear, so adding a bucket never overflows.
    pub(crate) fn ordered_lock_key(&self) -> i64 {
        self.hash("postgres-outbox:ordered:") & 0x00ff_ffff_ffff_fff0
    }

    /// The advisory-lock key of a partitioned outbox's maintenance (one caller at a time).
    pub(crate) fn partition_lock_key(&self) -> i64 {
        self.hash("postgres-outbox:partitions:")
    }

    /// The advisory-lock key producers of the caller's keys hold shared, and a partition
    /// cut exclusively (see `sql/partitioned.sql`).
    pub(crate) fn key_epoch_lock_key(&self) -> i64 {
        self.hash("postgres-outbox:keys:")
    }

    /// The seed of the aggregate locks' keys, so aggregates of different tables get
    /// different keys.
    pub(crate) fn aggregate_lock_seed(&self) -> i64 {
        self.hash("postgres-outbox:aggregate:")
    }

    /// A stable FNV-1a hash of `prefix` and the name.
    fn hash(&self, prefix: &str) -> i64 {
        let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
        for byte in prefix.as_bytes().iter().chain(self.display.as_bytes()) {
            hash ^= u64::from(*byte);
            hash = hash.wrapping_mul(0x0100_0000_01b3);
        }
        i64::from_ne_bytes(hash.to_ne_bytes())
    }

    fn qualified(&self, name: &str) -> String {
        match &self.schema {
            Some(schema) => format!("{}.{}", quote(schema), quote(name)),
            None => quote(name),
        }
    }
}

/// Quotes an identifier that `check_ident` or `check_role` accepted (so it holds no quote
/// to escape).
pub(crate) fn quote(ident: &str) -> String {
    format!("\"{ident}\"")
}

/// A name PostgreSQL keeps whole: not empty, at most `MAX_IDENT` bytes.
fn check_length(name: &str) -> std::result::Result<(), String> {
    if name.is_empty() {
        return Err("name is empty".into());
    }
    if name.len() > MAX_IDENT {
        return Err(format!("name is longer than {MAX_IDENT} bytes"));
    }
    Ok(())
}

/// A role's name `Outbox::grants` may put between quotes and into a DO block's text: ASCII
/// letters, digits and `_ - . @` (which cover cloud IAM user names), never `public`.
pub(crate) fn check_role(role: &str) -> std::result::Result<(), String> {
    check_length(role)?;
    if !role
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || "_-.@".contains(c))
    {
        return Err("name may hold only ASCII letters, digits and _ - . @".into());
    }
    if role == "public" {
        return Err("public is every role: name the role to grant to".into());
    }
    Ok(())
}

fn check_ident(ident: &str) -> std::result::Result<(), String> {
    check_length(ident)?;
    let mut chars = ident.chars();
    let first_ok = chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_');
    if !first_ok || !chars.all(|c| c.is_ascii_alphanumeric() || c == '_') {
        return Err(format!(
            "name {ident:?} must start with a letter or underscore and hold only ASCII letters, digits and underscores"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_plain_and_qualified_names() {
        let t = TableName::parse("audit.events").unwrap();
        assert_eq!(t.quoted(), "\"audit\".\"events\"");
        assert_eq!(t.companion("_inbox"), "\"audit\".\"events_inbox\"");
        assert_eq!(t.derived("_due"), "\"events_due\"");
        assert_eq!(t.channel(), "audit.events");
        assert_eq!(
            TableName::parse("Orders_1").unwrap().quoted(),
            "\"Orders_1\""
        );
    }

    #[test]
    fn rejects_everything_that_is_not_an_identifier() {
        for bad in [
            "",
            "x; DROP TABLE y",
            "\"a\"",
            "a.b.c",
            ".a",
            "a.",
            "1abc",
            "a-b",
            "a b",
            "é",
        ] {
            let err = TableName::parse(bad).unwrap_err();
            assert!(err.is_invalid_input(), "{bad:?} gave {err}");
        }
    }

    #[test]
    fn rejects_names_that_leave_no_room_for_the_longest_suffix() {
        let fits = "a".repeat(52);
        assert!(TableName::parse(&fits).is_ok());
        let too_long = "a".repeat(53);
        let err = TableName::parse(&too_long).unwrap_err();
        assert!(err.to_string().contains("_migrations"), "{err}");
    }

    #[test]
    fn long_qualified_names_get_a_short_stable_channel() {
        let t = TableName::parse(&format!("{}.{}", "s".repeat(40), "t".repeat(40))).unwrap();
        let channel = t.channel();
        assert!(channel.len() <= MAX_IDENT);
        assert_eq!(channel, t.channel());
    }
}
