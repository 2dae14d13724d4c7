//! What the statements of every part share, and the cache that renders each part's once
//! per table.
//!
//! Table names are validated identifiers and always quoted (see `table.rs`), so splicing them
//! into statement text cannot inject SQL; every value travels as a bind parameter. Statements
//! and migrations alike are templates with `{name}` placeholders, rendered by `render.rs`,
//! which fails on a placeholder without a value and on a value no template uses; the table's
//! objects both name come from one list (`objects`), so they are spelled alike in both.
//!
//! Each part keeps its statements beside the code that runs them, as a struct that
//! implements [`Statements`]; an `Outbox` renders each part's on its first use and shares
//! it with its clones ([`Rendered`]).

use std::any::Any;
use std::sync::OnceLock;

use postgres::error::SqlState;

use crate::error::Error;
use crate::schema::render::{render, RenderError};
use crate::schema::table::TableName;

/// One part's statements for one table.
pub(crate) trait Statements: Any + Send + Sync + Sized {
    /// Every statement of the part for `table`; an error is a template that does not match
    /// its values, a fault of this crate the same for every table (see `render.rs`).
    fn render(table: &TableName) -> Result<Self, RenderError>;
}

/// How many parts have statements of their own, at most.
const PARTS: usize = 12;

/// Each part's statements for one table, rendered once, on the part's first use: the
/// relay's, the operator's and the consumer's parts live above the `Outbox` that holds
/// them, so it cannot name them (`rabbitmq::consumer::sql`'s tests ask for every part).
pub(crate) struct Rendered {
    table: TableName,
    parts: [OnceLock<Box<dyn Any + Send + Sync>>; PARTS],
}

impl Rendered {
    pub(crate) fn new(table: TableName) -> Rendered {
        Rendered {
            table,
            parts: Default::default(),
        }
    }

    /// The table the statements are rendered for.
    pub(crate) fn table(&self) -> &TableName {
        &self.table
    }

    /// The statements of part `S`, rendered on the first call.
    ///
    /// A part takes the first slot it finds free and keeps it: a slot once set never
    /// changes, and every caller visiting a free slot sets it (or waits for whoever does),
    /// so each part is rendered once whichever threads ask first.
    ///
    /// # Panics
    ///
    /// If a template of the part does not match its values, or more than `PARTS` parts
    /// ask: faults of this crate, the same for every table, which the tests of each part
    /// and of this cache show.
    pub(crate) fn get<S: Statements>(&self) -> &S {
        for slot in &self.parts {
            let part = slot.get_or_init(|| Box::new(checked(S::render(&self.table))));
            if let Some(part) = part.downcast_ref::<S>() {
                return part;
            }
        }
        panic!("postgres-outbox has more parts with statements than {PARTS}")
    }
}

/// The values of `names`, for one part's `Values`: from the table's objects (`objects`)
/// and what the statements of several parts take. Each part names the values its templates
/// use, and `Values::finish` holds it to them.
pub(crate) fn shared(
    table: &TableName,
    names: &[&str],
) -> Result<Vec<(&'static str, String)>, RenderError> {
    let mut vars = objects(table);
    vars.extend([
        ("migrations", table.companion("_migrations")),
        ("parks", PARKS.to_owned()),
        ("ready_idx", table.companion("_ready")),
        ("ordered_idx", table.companion("_ordered")),
        ("schema_text", format!("'{}'", table.schema_prefix())),
        ("name_text", format!("'{}_p'", table.name())),
        ("id_bits", PARTITION_ID_BITS.to_string()),
    ]);
    names
        .iter()
        .map(|name| {
            vars.iter()
                .find(|(n, _)| n == name)
                .cloned()
                .ok_or_else(|| RenderError::Missing((*name).to_owned()))
        })
        .collect()
}

/// [`LOCK_ONE`] for `table`.
pub(crate) fn lock_one(table: &TableName) -> String {
    checked(render(
        LOCK_ONE,
        &[
            ("table_lock", &bigint(table.ordered_lock_key())),
            ("lock_seed", &bigint(table.aggregate_lock_seed())),
        ],
    ))
}

/// [`NOTIFY_IF_WAITING`] for `table`.
pub(crate) fn notify_if_waiting(table: &TableName) -> String {
    checked(render(
        NOTIFY_IF_WAITING,
        &[
            ("waiting", &table.companion("_waiting")),
            ("channel", &table.channel()),
        ],
    ))
}

/// Maps "relation does not exist" on `table`'s statements (or "function" or "schema does
/// not exist": enqueue calls functions the migrations create) to [`Error::NotMigrated`].
pub(crate) fn db_error(table: &TableName, e: postgres::Error) -> Error {
    let missing = [
        SqlState::UNDEFINED_TABLE,
        SqlState::UNDEFINED_FUNCTION,
        SqlState::INVALID_SCHEMA_NAME,
    ];
    if e.code().is_some_and(|code| missing.contains(code)) {
        Error::NotMigrated {
            table: table.as_str().to_owned(),
            source: e,
        }
    } else {
        Error::Db(e)
    }
}

/// How many ids a partition holds, as a power of two: partition n holds the ids from
/// `n << PARTITION_ID_BITS` (`sql/functions/partitions.sql`, whose functions spell out the width).
pub(crate) const PARTITION_ID_BITS: u32 = 40;

/// How many ranges of partitions an enqueue's look for its aggregate's pending messages
/// reads on a partitioned table, at most: the partitions that may hold a pending or parked
/// row (not quiet, migration 7), the first `LOOK_RANGES - 1` of them each alone and
/// every one from the next on. Quiet partitions hold sent and dead rows only, and a
/// redrive marks a partition not quiet before a row of it is pending again, so the quiet
/// ones between (after messages scheduled far ahead, or parked, in old partitions) are left
/// out (`sql/functions/enqueue_partitioned.sql`). Each range is an OR in the look's plan,
/// which the common case (one run of partitions, the open one and those made ahead) does
/// without ([`LOOK_IN_ONE_RUN`]).
pub(crate) const LOOK_RANGES: usize = 4;

/// The lock of one aggregate (see `sql/functions/locks.sql`) as the enqueue functions take it,
/// written into each of them: calling a function for it cost five times what the lock
/// does. Uses the function's `p_aggregate_key` and its variables `held text`, `lock_key
/// bigint` and `done text`; expressions where it can, as PL/pgSQL evaluates an expression
/// without starting an executor for it. The bucket, the aggregate, then the record of both,
/// in that order.
pub(crate) const LOCK_AGGREGATE: &str = "    \
    lock_key := hashtextextended(p_aggregate_key, {lock_seed});
    held := current_setting('postgres_outbox.aggregate_locks', true);
    IF held IS NULL OR NOT starts_with(held, pg_current_xact_id()::text || ':') THEN
        held := pg_current_xact_id()::text || ':,';
    END IF;
    IF strpos(held, ',' || lock_key || ',') = 0 AND strpos(held, ',t{table_lock_text},') = 0 THEN
        IF length(held) - length(replace(held, ',', '')) <= 64 THEN
            done := pg_advisory_xact_lock_shared({table_lock} + (lock_key & 15))::text
                    || pg_advisory_xact_lock(lock_key)::text
                    || set_config('postgres_outbox.aggregate_locks', held || lock_key || ',',
                                  false);
        ELSE
            PERFORM pg_advisory_xact_lock({table_lock} + bucket)
            FROM generate_series(0, 15) AS bucket;
            done := set_config('postgres_outbox.aggregate_locks',
                               held || 't{table_lock_text},', false);
        END IF;
    END IF;";

/// One aggregate's lock as a statement takes it, the aggregate key its `$3`: the bucket,
/// shared, then the aggregate, as `LOCK_AGGREGATE` takes them (see `sql/functions/locks.sql`),
/// without its record of what the transaction holds. A `Producer` counts the aggregates it
/// locked itself (`producer/prepared.rs`): the record cost an enqueue about as much as its
/// look for an earlier message did, and taking a lock the transaction holds already costs
/// no lock of the shared table.
pub(crate) const LOCK_ONE: &str = "pg_advisory_xact_lock_shared({table_lock}
                                     + (hashtextextended($3, {lock_seed}) & 15)),
       pg_advisory_xact_lock(hashtextextended($3, {lock_seed}))";

/// The notification of an enqueue, while a relay waits for work: the one place that decides
/// (see `sql/functions/notify.sql`, whose function runs it). An expression, so that a
/// statement can hold it without calling the function (a plain enqueue that called it cost
/// 6% more, measured with synchronous commit). In a statement it reads the statement's
/// snapshot: an ordered INSERT that waited for its aggregate's lock misses a relay that
/// began to wait meanwhile, which finds the row when it next polls (the function, called
/// after the lock, read a snapshot of its own).
pub(crate) const NOTIFY_IF_WAITING: &str =
    "CASE WHEN EXISTS (SELECT 1 FROM {waiting} WHERE seen > now() - interval '1 minute')
          THEN pg_notify('{channel}', '') END";

/// The partitions an enqueue's look reads (see `LOOK_RANGES`), which the enqueue functions
/// hold as `look`. With none (the bookkeeping emptied by hand), partition 0: the look reads
/// every partition.
pub(crate) const LOOK_PARTITIONS: &str =
    "coalesce(nullif(ARRAY(SELECT n FROM {partitions} WHERE quiet_at IS NULL
                                 ORDER BY n LIMIT {look_ranges}), ARRAY[]::bigint[]),
             ARRAY[0::bigint])";

/// Whether the partitions of `look` follow one another (its numbers are distinct and sorted,
/// as `LOOK_PARTITIONS` reads them), as in the common case: the open one and those made
/// ahead, nothing held back in older ones. Then [`from_look`] says what [`in_look`] says,
/// in one range, whose plan leaves the partitions before it out at a fraction of what
/// pruning by the ranges' ORs costs (BENCHMARKS.md, "Producing").
pub(crate) const LOOK_IN_ONE_RUN: &str =
    "look[cardinality(look)] - look[1] = cardinality(look) - 1";

/// Whether row `o` is in the first partition of `look` or any after it: [`in_look`] when
/// the partitions of `look` are one run ([`LOOK_IN_ONE_RUN`]).
pub(crate) fn from_look() -> String {
    format!("(o.id >= look[1] << {PARTITION_ID_BITS})")
}

/// A partitioned table's look for an earlier message of `p_aggregate_key` still pending or
/// parked, written into both functions that mark a single message's head (the enqueue
/// function and the head function of `sql/functions/enqueue_partitioned.sql`), so that
/// they mark alike. Sets the function's variables `look bigint[]` and `is_head boolean`:
/// one range when the partitions of `look` are one run ([`LOOK_IN_ONE_RUN`]), the ranges of
/// [`in_look`] otherwise. A statement of its own, so its snapshot follows the lock taken
/// before it.
const LOOK_EARLIER: &str = "    look := {look_partitions};
    IF {look_in_one_run} THEN
        is_head := NOT EXISTS (SELECT 1 FROM {table} o
                               WHERE o.head IN (false, true)
                                 AND o.aggregate_key = p_aggregate_key
                                 AND o.status IN ('pending', 'parked')
                                 AND {from_look});
    ELSE
        is_head := NOT EXISTS (SELECT 1 FROM {table} o
                               WHERE o.head IN (false, true)
                                 AND o.aggregate_key = p_aggregate_key
                                 AND o.status IN ('pending', 'parked')
                                 AND {in_look});
    END IF;";

/// [`LOOK_EARLIER`] for `table`, whose look reads `look_partitions` (`LOOK_PARTITIONS`
/// rendered for it).
pub(crate) fn look_earlier(table: &TableName, look_partitions: &str) -> String {
    checked(render(
        LOOK_EARLIER,
        &[
            ("table", &table.quoted()),
            ("look_partitions", look_partitions),
            ("look_in_one_run", LOOK_IN_ONE_RUN),
            ("from_look", &from_look()),
            ("in_look", &in_look()),
        ],
    ))
}

/// Whether row `o` is in one of the partitions of `look` (see `LOOK_RANGES`): in one of the
/// first partitions alone, or in the last or any after it.
pub(crate) fn in_look() -> String {
    let bits = PARTITION_ID_BITS;
    let alone = (1..LOOK_RANGES)
        .map(|i| format!("o.id >= look[{i}] << {bits} AND o.id < (look[{i}] + 1) << {bits}"));
    let from_last = std::iter::once(format!("o.id >= look[cardinality(look)] << {bits}"));
    let arms: Vec<String> = alone.chain(from_last).collect();
    format!(
        "({})",
        arms.join("\n                                      OR ")
    )
}

/// The first id of partition `n`.
pub(crate) fn first_id(n: i64) -> i64 {
    n.saturating_mul(1 << PARTITION_ID_BITS)
}

/// How many partitions are kept ahead of the one new ids fall in.
pub(crate) const PARTITIONS_AHEAD: i32 = 2;

/// The columns of a record, in the order `Record::from_row` reads them, its attempt being
/// `{attempt}`.
pub(crate) const RECORD_TEMPLATE: &str =
    "t.id, t.key, t.topic, t.aggregate_key, t.payload, t.content_type, \
     t.headers, {attempt}, t.max_attempts, t.created_at, t.lease_until, t.park, t.sequence";

/// Whether a row that dies parks its aggregate: it has one, and its own setting, or else
/// the caller's (`$8` in the statements that use it), says so.
pub(crate) const PARKS: &str = "(t.aggregate_key IS NOT NULL AND coalesce(t.park, $8))";

/// The ready rows `o`, due now: rows without an aggregate key and heads marked at enqueue,
/// in the words of `{ready_idx}`'s predicate (migration 0007), so that index serves each
/// statement that reads them.
pub(crate) const READY_ROWS: &str = "o.status = 'pending' AND (o.head OR o.aggregate_key IS NULL)
     AND o.available_at <= now()";

/// A bigint constant in SQL text.
pub(crate) fn bigint(value: i64) -> String {
    format!("({value})::bigint")
}

/// The table's objects that statements and migrations both name, each under the one
/// placeholder name both use.
pub(crate) fn objects(table: &TableName) -> Vec<(&'static str, String)> {
    vec![
        ("table", table.quoted()),
        ("inbox", table.companion("_inbox")),
        ("failures", table.companion("_failures")),
        ("sequences", table.companion("_sequences")),
        ("consumed", table.companion("_consumed")),
        ("waiting", table.companion("_waiting")),
        ("counts", table.companion("_counts")),
        ("relays", table.companion("_relays")),
        ("enqueue_fn", table.companion("_enqueue")),
        ("enqueue_n_fn", table.companion("_enqueue_n")),
        ("head_fn", table.companion("_head")),
        ("place_fn", table.companion("_place")),
        ("placed_fn", table.companion("_placed")),
        ("lock_n_fn", table.companion("_lock_n")),
        ("lock_heads_fn", table.companion("_lock_heads")),
        ("notify_fn", table.companion("_notify")),
        ("channel_fn", table.companion("_channel")),
        ("partitions", table.companion("_partitions")),
        ("partition_fn", table.companion("_partition")),
        ("retire_fn", table.companion("_retire")),
        ("settle_fn", table.companion("_settle")),
        ("ids_drawn_fn", table.companion("_ids_drawn")),
    ]
}

/// Named values as `Values::new` borrows them.
pub(crate) fn borrowed<'a>(vars: &'a [(&'static str, String)]) -> Vec<(&'a str, &'a str)> {
    vars.iter()
        .map(|(name, value)| (*name, value.as_str()))
        .collect()
}

/// The SQL text, or a panic naming the template fault (a bug of this crate, see `render.rs`).
pub(crate) fn checked<T>(rendered: Result<T, RenderError>) -> T {
    rendered.unwrap_or_else(|e| panic!("postgres-outbox renders its SQL wrongly: {e}"))
}

#[cfg(test)]
pub(crate) mod tests {
    use std::fmt::Debug;

    use super::*;
    use crate::schema::render::{placeholders, render};

    /// A name of every kind the crate accepts: plain, schema-qualified, mixed case, the
    /// longest table part, and one too long for its channel (which becomes a hash).
    pub(crate) fn tables() -> Vec<TableName> {
        let long = format!("{}.{}", "s".repeat(40), "t".repeat(40));
        let longest = "a".repeat(52);
        ["orders_outbox", "app.events", "Orders_1", &long, &longest]
            .iter()
            .map(|name| TableName::parse(name).unwrap())
            .collect()
    }

    /// Renders every statement of part `S` for every table: each part's test
    /// `every_template_renders_for_every_table` calls it.
    pub(crate) fn renders_for_every_table<S: Statements + Debug>() {
        for table in tables() {
            let statements = S::render(&table).unwrap();
            // Debug shows every statement, whatever fields are added later.
            let every_statement = format!("{statements:?}");
            assert!(
                placeholders(&every_statement).is_empty(),
                "{}: {:?}",
                table.as_str(),
                placeholders(&every_statement)
            );
        }
    }

    #[derive(Debug, PartialEq)]
    struct One(String);

    impl Statements for One {
        fn render(table: &TableName) -> Result<Self, RenderError> {
            render("SELECT 1 FROM {table}", &[("table", &table.quoted())]).map(One)
        }
    }

    #[derive(Debug, PartialEq)]
    struct Two(String);

    impl Statements for Two {
        fn render(table: &TableName) -> Result<Self, RenderError> {
            render("SELECT 2 FROM {table}", &[("table", &table.quoted())]).map(Two)
        }
    }

    #[test]
    fn each_part_is_rendered_once_and_kept_apart() {
        let rendered = Rendered::new(TableName::parse("app.events").unwrap());
        let two: *const Two = rendered.get::<Two>();
        assert_eq!(rendered.get::<One>().0, "SELECT 1 FROM \"app\".\"events\"");
        assert_eq!(rendered.get::<Two>().0, "SELECT 2 FROM \"app\".\"events\"");
        assert!(std::ptr::eq(two, rendered.get::<Two>()));
    }

    #[test]
    fn shared_values_are_named_or_missing() {
        let table = TableName::parse("orders").unwrap();
        let vars = shared(&table, &["table", "id_bits"]).unwrap();
        assert_eq!(vars[1], ("id_bits", PARTITION_ID_BITS.to_string()));
        assert_eq!(
            shared(&table, &["nothing"]),
            Err(RenderError::Missing("nothing".to_owned()))
        );
    }
}
