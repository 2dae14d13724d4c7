//! Producer and relay throughput against the local PostgreSQL.
//!
//! ```text
//! cargo bench --bench outbox              # everything
//! cargo bench --bench outbox enqueue      # only benchmarks whose name contains "enqueue"
//! cargo bench --bench outbox ordered      # the relay on ordered backlogs, per shape
//! cargo bench --bench outbox rss          # the relay's memory on 1 MiB payloads
//! cargo bench --bench outbox scale        # 10M sent + 1M pending rows against a small table
//! ```
//!
//! Prints one line per measurement, `bench=<name> key=value ... rate=<operations per second>`:
//! - `business`: a business transaction alone (insert one order, commit), per thread count;
//! - `enqueue-raw`: the same transaction plus a hand-written, prepared INSERT of an outbox
//!   row (bigserial id, unique uuid key, topic, aggregate key, bytea payload, jsonb headers,
//!   status, attempts, available_at, lease_until, created_at; one partial index on
//!   `(available_at, id)` for pending rows), on a table of its own; `enqueue-raw
//!   locked=true` takes the aggregate's transaction-scoped advisory lock first, in the same
//!   prepared statement: all it takes by hand to keep commit order per aggregate;
//! - `enqueue path=text|prepared aggregate=yes|no notify=on|off`: the same transaction plus
//!   `Outbox::enqueue` (`text`) or a `Producer`'s (`prepared`) of a 512-byte message with a
//!   content type, with an aggregate key or without, with `ratio=` its rate over
//!   `business`, `vs_raw=` over `enqueue-raw` and `vs_locked=` over `enqueue-raw
//!   locked=true` at the same thread count (the variants take turns in
//!   `OUTBOX_BENCH_ROUNDS` rounds, so load changes during the run hit them alike). No relay
//!   runs, so `notify=on` sends no notification; `relay=waiting` has a relay announced as
//!   waiting, so every commit notifies. `OUTBOX_BENCH_PARTITIONED=1`: the outboxes are
//!   partitioned by day (`table=partitioned`), and so is the hand-written table, as the
//!   crate makes its own (by id ranges, the key unique in each partition);
//! - `copy`, `copy locked=true`, `enqueue_all`: 1,000 such messages per transaction, by a
//!   binary `COPY` into an outbox table (after the sixteen bucket locks a batch of that many
//!   aggregates takes, with `locked=true`) and by `enqueue_all`, taking turns (100 each);
//!   `vs_copy=` and `vs_copy_locked=` are `enqueue_all`'s rate over each `COPY`'s,
//!   `vs_copy_turns=` and `vs_copy_locked_turns=` the quartiles of the turns' own ratios
//!   (the median the figure to read where a few turns stall);
//! - `enqueue_all backlog=0|100000 path=copy|function`: milliseconds per `enqueue_all` of
//!   1,000 messages of new aggregates beside that many pending rows (each its own
//!   aggregate), due at once (written by `COPY`) or scheduled (by the batch function), the
//!   transactions rolled back so that every batch meets the same backlog;
//! - `relay`: `Relay` draining pre-filled rows into an in-process no-op publisher, rows/s;
//! - `ordered shape=unordered|unique|agg40|hot1`: `Relay` with default settings draining a
//!   backlog of 512-byte rows with no aggregate key, each row its own aggregate, rows
//!   round-robin over 40 aggregates, or all in one aggregate, into a no-op publisher;
//!   `vs_unordered=` is its rate over `unordered`'s. A shape still draining after the time cap
//!   gets its rate from the rows sent so far, with `sent=<rows> capped=true`; each line
//!   ends with where the workers' cycles went (`cycle_ms=`, `cycle_share=` of
//!   claim/publish/record, see `Drained::cycle_report`);
//! - `enqueue-parts`: where an enqueue's cost goes, on one connection, in microseconds per
//!   transaction over an empty one: the hand-written prepared INSERT (`raw_us`), our
//!   `enqueue` (`enqueue_us`), the same function call prepared (`call_prepared_us`), and our
//!   row by a prepared INSERT without the function (`insert_prepared_us`: the row the
//!   function writes for the crate's own key, marked its head, with no lock and no look
//!   for earlier messages of its aggregate), and that INSERT sent as text every time
//!   (`insert_sent_us`); its commits do not wait for the WAL flush (`synchronous_commit =
//!   off` on its connection), so the parts are server and client work, not the disk's
//!   time, which moves more than they do between turns;
//! - `sequence`: what places in aggregates' sequences (`OutboxBuilder::sequence`) cost, on
//!   one connection each, in microseconds per transaction over an empty one, with
//!   `synchronous_commit = off` as `enqueue-parts`: `enqueue` (`text`), a `Producer`
//!   (`prepared`), `enqueue` with the caller's key (`keyed`) and an `enqueue_all` of 100 due
//!   at once (`batch100`, by `COPY` without places, by the batch function with them), each
//!   without places (`_off`) and with (`_on`), messages spread over 1,000 aggregates, the
//!   variants taking turns; and a consumer's transaction, `dedupe` alone against `dedupe`
//!   and the upsert of its last place (`consume_off`, `consume_on`);
//! - `wake`: an idle relay (polling once an hour) woken by enqueues' notifications: the
//!   median, 90th percentile and maximum time from commit to the publisher, in ms;
//! - `rss`: `Relay` with default settings draining rows of 1 MiB payloads into a no-op
//!   publisher: `rate=`, `peak_rss_mib=` (VmHWM) and `baseline_rss_mib=` (VmRSS after the
//!   prefill, before the relay starts). VmHWM is the process's peak so far: the bench resets
//!   it (`/proc/self/clear_refs`) before the relay starts and runs first in an unfiltered
//!   run, but for a clean figure run it alone, `cargo bench --bench outbox rss`;
//! - `partitions count=<n>`: `stats()`, one enqueue (with the crate's key, and with the
//!   caller's: `keyed_enqueue_ms`) and an `enqueue_all` of 100 (ms, means of 20, 200, 200
//!   and 20) on a table partitioned by day with that many partitions, every closed one
//!   holding 1,000 sent rows and the open one 200 pending, against a plain table holding
//!   the same rows (`plain_stats_ms`, `plain_enqueue_ms`, `plain_keyed_enqueue_ms`,
//!   `plain_enqueue_all_ms`): what each partition kept adds;
//! - `scale tables=plain|partitioned op=relay-cycle|stats|stats-exact|enqueue|enqueue-keyed|purge-day-sent`:
//!   the mean cost of each operation on a table retaining many rows (`small_ms`, `big_ms`,
//!   `vs_small`), plain and then partitioned by day; runs only when asked for by exactly that
//!   name, as filling the big tables takes minutes and a few GB of disk;
//!   `scale-stats-estimate` gives `stats()`'s estimates over `stats_exact()`'s counts on each,
//!   and `scale-retention` the cost of purging a day of sent rows (a tenth of them: by DELETE,
//!   or by dropping a partition), alone and beside a relay draining the backlog, with the
//!   relay's rate alone and beside it;
//!
//! Every measurement gets fresh tables in a scratch schema that is dropped at the end.
//! Env: `OUTBOX_BENCH_DATABASE_URL` or `DATABASE_URL` (default
//! `postgres://postgres@127.0.0.1:5432/test`), `OUTBOX_BENCH_SECS` (seconds per producer
//! variant and thread count, default 5), `OUTBOX_BENCH_ROUNDS` (the turns they take,
//! default 5), `OUTBOX_BENCH_THREADS` (default `1,4,16`), `OUTBOX_BENCH_ROWS`
//! (rows the relay drains, default 100000), `OUTBOX_BENCH_ORDERED_ROWS` (backlog per
//! `ordered` shape, default 20000), `OUTBOX_BENCH_ORDERED_CAP_SECS` (time cap per shape,
//! default 120), `OUTBOX_BENCH_RSS_ROWS` (1 MiB rows for `rss`, default 2000: 2 GiB through
//! the relay, though the repeated bytes compress to a few MB on disk),
//! `OUTBOX_BENCH_SCALE_SENT` / `OUTBOX_BENCH_SCALE_PENDING` (the big table of `scale`, default
//! 10000000 / 1000000), `OUTBOX_BENCH_SCALE_TABLES` (`plain`, `partitioned`, default both),
//! `OUTBOX_BENCH_SCALE_PLANS=1` (print its plans).

mod common;

use std::error::Error;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use common::{
    drain, drop_outbox, fmt_rate, prefill_rows, rate, ratio, Result, Shape, DEFAULT_RELAY_POOL_SIZE,
};
use postgres::binary_copy::BinaryCopyInWriter;
use postgres::types::Type;
use postgres::{Client, NoTls};
use postgres_outbox::{publisher_fn, Message, Outbox, Relay, RelayConfig, Rows};
use r2d2_postgres::PostgresConnectionManager;

const PAYLOAD_BYTES: usize = 512;
const ENQUEUE_ALL_ROWS: usize = 1_000;
const ENQUEUE_ALL_REPS: usize = 100;
const RELAY_BATCHES: [usize; 2] = [100, 500];
const RELAY_CONCURRENCY: usize = 4;
const RELAY_POOL_SIZE: u32 = 8;
const RELAY_TIMEOUT: Duration = Duration::from_secs(300);
const RSS_PAYLOAD_BYTES: usize = 1 << 20;

fn main() -> Result<()> {
    let settings = Settings::from_env()?;
    let scratch = Scratch::create(&settings.url)?;
    // First: its peak RSS should owe nothing to the other benchmarks.
    if settings.wants("rss") {
        rss(&settings, &scratch)?;
    }
    let enqueue = settings.wants("enqueue");
    if enqueue || settings.wants("business") {
        producers(&settings, &scratch, enqueue)?;
    }
    if settings.wants("enqueue_all") {
        enqueue_all(&scratch)?;
        enqueue_all_backlog(&scratch)?;
    }
    if settings.wants("relay") {
        for batch in RELAY_BATCHES {
            relay(&settings, &scratch, batch)?;
        }
    }
    if settings.wants("ordered") {
        ordered(&settings, &scratch)?;
    }
    if settings.wants("wake") {
        wake(&scratch)?;
    }
    if settings.wants("enqueue-parts") {
        enqueue_parts(&scratch)?;
    }
    if settings.wants("partitions") {
        partitions(&scratch)?;
    }
    if settings.wants("sequence") {
        sequence(&scratch)?;
    }
    // Last, and only when asked for by name: it writes millions of rows.
    if settings.filter.as_deref() == Some("scale") {
        scale(&settings, &scratch)?;
    }
    Ok(())
}

// ------------------------------------------------------------------ settings

struct Settings {
    url: String,
    secs: Duration,
    threads: Vec<usize>,
    relay_rows: usize,
    ordered_rows: usize,
    ordered_cap: Duration,
    rss_rows: usize,
    scale_sent: usize,
    scale_pending: usize,
    scale_plans: bool,
    partitioned: bool,
    rounds: u32,
    scale_tables: Vec<TableKind>,
    filter: Option<String>,
}

impl Settings {
    fn from_env() -> Result<Settings> {
        let url = ["OUTBOX_BENCH_DATABASE_URL", "DATABASE_URL"]
            .iter()
            .find_map(|name| std::env::var(name).ok().filter(|v| !v.is_empty()))
            .unwrap_or_else(|| "postgres://postgres@127.0.0.1:5432/test".to_owned());
        let threads = env_or("OUTBOX_BENCH_THREADS", "1,4,16".to_owned())?;
        Ok(Settings {
            url,
            secs: Duration::from_secs_f64(env_or("OUTBOX_BENCH_SECS", 5.0)?),
            threads: threads
                .split(',')
                .map(|t| t.trim().parse())
                .collect::<std::result::Result<_, _>>()?,
            relay_rows: env_or("OUTBOX_BENCH_ROWS", 100_000)?,
            ordered_rows: env_or("OUTBOX_BENCH_ORDERED_ROWS", 20_000)?,
            ordered_cap: Duration::from_secs_f64(env_or("OUTBOX_BENCH_ORDERED_CAP_SECS", 120.0)?),
            rss_rows: env_or("OUTBOX_BENCH_RSS_ROWS", 2_000)?,
            scale_sent: env_or("OUTBOX_BENCH_SCALE_SENT", 10_000_000)?,
            scale_pending: env_or("OUTBOX_BENCH_SCALE_PENDING", 1_000_000)?,
            scale_plans: env_or("OUTBOX_BENCH_SCALE_PLANS", 0_u8)? == 1,
            partitioned: env_or("OUTBOX_BENCH_PARTITIONED", 0_u8)? == 1,
            rounds: env_or("OUTBOX_BENCH_ROUNDS", 5)?,
            scale_tables: match std::env::var("OUTBOX_BENCH_SCALE_TABLES").as_deref() {
                Ok("plain") => vec![TableKind::Plain],
                Ok("partitioned") => vec![TableKind::Partitioned],
                Ok("" | "both") | Err(_) => vec![TableKind::Plain, TableKind::Partitioned],
                Ok(other) => {
                    return Err(format!(
                        "OUTBOX_BENCH_SCALE_TABLES: plain, partitioned or both, not {other:?}"
                    )
                    .into())
                }
            },
            // `cargo bench` passes `--bench`; the first other argument is the filter.
            filter: std::env::args().skip(1).find(|a| !a.starts_with('-')),
        })
    }

    /// Whether the benchmark `name` passes the command line filter (a substring).
    fn wants(&self, name: &str) -> bool {
        self.filter.as_deref().is_none_or(|f| name.contains(f))
    }
}

fn env_or<T>(name: &str, default: T) -> Result<T>
where
    T: FromStr,
    T::Err: Error + Send + Sync + 'static,
{
    match std::env::var(name) {
        Ok(v) if !v.is_empty() => Ok(v.parse()?),
        _ => Ok(default),
    }
}

// ------------------------------------------------------------------ scratch tables

/// A schema of fresh tables for one run, dropped (with everything in it) at the end.
struct Scratch {
    url: String,
    schema: String,
    next: AtomicU32,
}

impl Scratch {
    fn create(url: &str) -> Result<Scratch> {
        let schema = format!("outbox_bench_{}", std::process::id());
        let mut client = Client::connect(url, NoTls)?;
        client.batch_execute(&format!(
            "DROP SCHEMA IF EXISTS {schema} CASCADE; CREATE SCHEMA {schema}"
        ))?;
        Ok(Scratch {
            url: url.to_owned(),
            schema,
            next: AtomicU32::new(0),
        })
    }

    fn client(&self) -> Result<Client> {
        Ok(Client::connect(&self.url, NoTls)?)
    }

    /// A table name not used before in this run.
    fn fresh_name(&self, base: &str) -> String {
        let n = self.next.fetch_add(1, Ordering::Relaxed) + 1;
        format!("{}.{base}_{n}", self.schema)
    }

    /// A fresh, empty business table.
    fn orders(&self) -> Result<String> {
        let table = self.fresh_name("orders");
        self.client()?.batch_execute(&format!(
            "CREATE TABLE {table} (id bigserial PRIMARY KEY, customer text, amount bigint, \
             created_at timestamptz DEFAULT now())"
        ))?;
        Ok(table)
    }

    /// A fresh table holding outbox rows as a careful engineer would write them by hand.
    fn raw_outbox(&self) -> Result<String> {
        self.raw_outbox_of(false)
    }

    /// The hand-written outbox table, plain or, with `partitioned`, made as the crate makes
    /// its own: partitioned by ranges of 2^40 ids, the open one and two ahead, the key
    /// unique in each partition by an index of its own.
    fn raw_outbox_of(&self, partitioned: bool) -> Result<String> {
        let table = self.fresh_name("raw_outbox");
        let (key, by) = if partitioned {
            ("key uuid NOT NULL", " PARTITION BY RANGE (id)")
        } else {
            ("key uuid NOT NULL UNIQUE", "")
        };
        let mut client = self.client()?;
        client.batch_execute(&format!(
            "CREATE TABLE {table} (
                 id bigserial PRIMARY KEY,
                 {key},
                 topic text NOT NULL,
                 aggregate_key text,
                 payload bytea NOT NULL,
                 headers jsonb NOT NULL DEFAULT '{{}}',
                 status text NOT NULL DEFAULT 'pending',
                 attempts integer NOT NULL DEFAULT 0,
                 available_at timestamptz NOT NULL DEFAULT now(),
                 lease_until timestamptz,
                 created_at timestamptz NOT NULL DEFAULT now()){by};
             CREATE INDEX ON {table} (available_at, id) WHERE status = 'pending';"
        ))?;
        if partitioned {
            const WIDTH: i64 = 1 << 40;
            for k in 0..=2 {
                client.batch_execute(&format!(
                    "CREATE TABLE {table}_p{k} PARTITION OF {table}
                         FOR VALUES FROM ({}) TO ({});
                     CREATE UNIQUE INDEX ON {table}_p{k} (key);",
                    k * WIDTH,
                    (k + 1) * WIDTH
                ))?;
            }
        }
        Ok(table)
    }

    /// A fresh, migrated outbox.
    fn outbox(&self, notify: bool) -> Result<Outbox> {
        self.outbox_of(notify, false)
    }

    /// A fresh, migrated outbox, partitioned by day or plain.
    fn outbox_of(&self, notify: bool, partitioned: bool) -> Result<Outbox> {
        let mut builder = Outbox::builder()
            .table(self.fresh_name("outbox"))
            .notify(notify);
        if partitioned {
            builder = builder.partition_interval(DAY);
        }
        let outbox = builder.build()?;
        outbox.migrate(&mut self.client()?)?;
        Ok(outbox)
    }

    /// A fresh outbox of `kind` for `scale`: partitioned by day, as an outbox that retains
    /// days of rows would be.
    fn scale_outbox(&self, kind: TableKind) -> Result<Outbox> {
        let builder = Outbox::builder().table(self.fresh_name("outbox"));
        let outbox = match kind {
            TableKind::Plain => builder.build()?,
            TableKind::Partitioned => builder.partition_interval(DAY).build()?,
        };
        outbox.migrate(&mut self.client()?)?;
        Ok(outbox)
    }

    fn pool(&self, size: u32) -> Result<r2d2::Pool<PostgresConnectionManager<NoTls>>> {
        let manager = PostgresConnectionManager::new(self.url.parse()?, NoTls);
        Ok(r2d2::Pool::builder().max_size(size).build(manager)?)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let dropped = self.client().and_then(|mut c| {
            Ok(c.batch_execute(&format!("DROP SCHEMA IF EXISTS {} CASCADE", self.schema))?)
        });
        if let Err(e) = dropped {
            eprintln!("could not drop the bench schema {}: {e}", self.schema);
        }
    }
}

// ------------------------------------------------------------------ output

/// One output line: `bench=<name> key=value ... rate=<n>`.
struct Line(String);

impl Line {
    fn new(name: &str) -> Line {
        Line(format!("bench={name}"))
    }

    fn kv(mut self, key: &str, value: impl std::fmt::Display) -> Line {
        self.0.push_str(&format!(" {key}={value}"));
        self
    }

    fn rate(self, ops: u64, took: Duration) -> Line {
        self.kv("secs", format!("{:.2}", took.as_secs_f64()))
            .kv("rate", fmt_rate(rate(ops, took)))
    }

    fn print(self) {
        println!("{}", self.0);
    }
}

fn payload() -> Vec<u8> {
    vec![b'x'; PAYLOAD_BYTES]
}

fn event(aggregate: i64) -> Message {
    event_of(aggregate, true)
}

/// `event`, or the same message without its aggregate key.
fn event_of(aggregate: i64, ordered: bool) -> Message {
    let message = Message::new("order.created", payload()).content_type("application/json");
    if ordered {
        message.aggregate_key(format!("order-{aggregate}"))
    } else {
        message
    }
}

// ------------------------------------------------------------------ producers

/// What a producer transaction writes besides its order.
#[derive(Clone, Copy, PartialEq)]
enum Extra {
    /// Nothing: the business transaction alone.
    Nothing,
    /// A hand-written prepared INSERT of an outbox row into a table of its own.
    Raw,
    /// The same INSERT with the aggregate's transaction-scoped advisory lock taken first,
    /// in the same prepared statement: all it takes by hand to keep commit order per
    /// aggregate.
    RawLocked,
    /// The crate's enqueue.
    Enqueue(Enqueue),
}

/// How the crate enqueues: `Outbox::enqueue` or a `Producer`'s prepared statements, with
/// notify on or off, the message with an aggregate key or without, and whether a relay
/// waits (so that every commit notifies).
#[derive(Clone, Copy, PartialEq)]
struct Enqueue {
    prepared: bool,
    notify: bool,
    ordered: bool,
    waited: bool,
}

impl Enqueue {
    const fn extra(prepared: bool, notify: bool, ordered: bool) -> Extra {
        Extra::Enqueue(Enqueue {
            prepared,
            notify,
            ordered,
            waited: false,
        })
    }
}

/// A producer thread's connection: a client, or one with the enqueue statements prepared.
enum Connection {
    Plain(Client),
    Prepared(postgres_outbox::Producer),
}

impl Connection {
    fn client(&mut self) -> &mut Client {
        match self {
            Connection::Plain(client) => client,
            Connection::Prepared(producer) => producer.client(),
        }
    }
}

/// One kind of producer transaction, on its own fresh tables, and what it has done so far.
struct Producer {
    extra: Extra,
    insert: String,
    /// The raw row's INSERT, or the outbox.
    raw: Option<String>,
    outbox: Option<Outbox>,
    tx: u64,
    took: Duration,
}

impl Producer {
    fn new(scratch: &Scratch, extra: Extra, partitioned: bool) -> Result<Producer> {
        let orders = scratch.orders()?;
        let raw_outbox = || scratch.raw_outbox_of(partitioned);
        let columns = "key, topic, aggregate_key, payload, headers";
        let raw = match extra {
            Extra::Raw => Some(format!(
                "INSERT INTO {} ({columns}) VALUES ($1, $2, $3, $4, $5::text::jsonb)",
                raw_outbox()?
            )),
            Extra::RawLocked => Some(format!(
                "INSERT INTO {} ({columns}) SELECT $1, $2, $3, $4, $5::text::jsonb \
                 FROM (SELECT pg_advisory_xact_lock(hashtextextended($3, 0))) AS locked",
                raw_outbox()?
            )),
            _ => None,
        };
        let outbox = match extra {
            Extra::Enqueue(how) => {
                let outbox = scratch.outbox_of(how.notify, partitioned)?;
                if how.waited {
                    // As an idle relay announces itself.
                    scratch.client()?.batch_execute(&format!(
                        "INSERT INTO {}_waiting (relay) VALUES ('bench')",
                        outbox.table()
                    ))?;
                }
                Some(outbox)
            }
            _ => None,
        };
        Ok(Producer {
            extra,
            insert: format!("INSERT INTO {orders} (customer, amount) VALUES ($1, $2) RETURNING id"),
            raw,
            outbox,
            tx: 0,
            took: Duration::ZERO,
        })
    }

    /// Runs its transaction on `threads` threads, one connection each, for `secs`.
    fn run(&mut self, scratch: &Scratch, threads: usize, secs: Duration) -> Result<()> {
        let (insert, raw, outbox) = (&self.insert, self.raw.as_ref(), self.outbox.as_ref());
        let how = match self.extra {
            Extra::Enqueue(how) => Some(how),
            _ => None,
        };
        let (tx, took) = run_threads(threads, secs, || {
            let client = scratch.client()?;
            let mut connection = match (outbox, how) {
                (Some(outbox), Some(how)) if how.prepared => {
                    Connection::Prepared(outbox.producer(client)?)
                }
                _ => Connection::Plain(client),
            };
            let client = connection.client();
            let insert = client.prepare(insert)?;
            let raw = raw.map(|sql| client.prepare(sql)).transpose()?;
            let ordered = how.is_none_or(|how| how.ordered);
            let payload = payload();
            Ok(move || -> Result<()> {
                let client = match &mut connection {
                    Connection::Prepared(producer) => {
                        let mut tx = producer.transaction()?;
                        let id: i64 = tx.query_one(&insert, &[&"acme", &4200_i64])?.get(0);
                        tx.enqueue(event_of(id, ordered))?;
                        return Ok(tx.commit()?);
                    }
                    Connection::Plain(client) => client,
                };
                let mut tx = client.transaction()?;
                let id: i64 = tx.query_one(&insert, &[&"acme", &4200_i64])?.get(0);
                if let Some(raw) = &raw {
                    let key = uuid::Uuid::now_v7();
                    let aggregate = format!("order-{id}");
                    tx.execute(
                        raw,
                        &[
                            &key,
                            &"order.created",
                            &aggregate,
                            &payload,
                            &r#"{"content-type": "application/json"}"#,
                        ],
                    )?;
                }
                if let Some(outbox) = outbox {
                    outbox.enqueue(&mut tx, event_of(id, ordered))?;
                }
                tx.commit()?;
                Ok(())
            })
        })?;
        self.tx += tx;
        self.took += took;
        Ok(())
    }

    fn rate(&self) -> f64 {
        rate(self.tx, self.took)
    }

    fn print(&self, threads: usize, settings: &Settings, rates: &[(Extra, f64)]) {
        let of = |extra: Extra| {
            rates
                .iter()
                .find(|(e, _)| *e == extra)
                .map_or(f64::NAN, |(_, r)| *r)
        };
        let mut line = match self.extra {
            Extra::Nothing => Line::new("business"),
            Extra::Raw => Line::new("enqueue-raw"),
            Extra::RawLocked => Line::new("enqueue-raw").kv("locked", true),
            Extra::Enqueue(how) => {
                let mut line = Line::new("enqueue")
                    .kv("path", if how.prepared { "prepared" } else { "text" })
                    .kv("aggregate", if how.ordered { "yes" } else { "no" })
                    .kv("notify", if how.notify { "on" } else { "off" });
                if how.waited {
                    line = line.kv("relay", "waiting");
                }
                line
            }
        };
        if settings.partitioned {
            line = line.kv("table", "partitioned");
        }
        line = line
            .kv("threads", threads)
            .kv("rounds", settings.rounds)
            .kv("tx", self.tx)
            .rate(self.tx, self.took);
        if self.extra != Extra::Nothing {
            line = line.kv("ratio", format!("{:.2}", self.rate() / of(Extra::Nothing)));
        }
        if self.extra != Extra::Raw && self.extra != Extra::Nothing {
            line = line.kv("vs_raw", format!("{:.2}", self.rate() / of(Extra::Raw)));
        }
        if let Extra::Enqueue(how) = self.extra {
            if how.ordered {
                line = line.kv(
                    "vs_locked",
                    format!("{:.2}", self.rate() / of(Extra::RawLocked)),
                );
            }
        }
        line.print();
    }
}

/// `business`, `enqueue-raw` (plain and locked), and the crate's enqueues against them, at
/// each thread count: `Outbox::enqueue` and a `Producer`'s, with notify on and off, with an
/// aggregate key and without. The variants take turns in short rounds, so a change in the
/// machine's load during the run (other processes, checkpoints) weighs on all of them alike
/// and the ratios hold. `OUTBOX_BENCH_PARTITIONED=1`: the outboxes are partitioned by day,
/// the hand-written one too.
fn producers(settings: &Settings, scratch: &Scratch, enqueue: bool) -> Result<()> {
    let extras: Vec<Extra> = if enqueue {
        let mut extras = vec![Extra::Nothing, Extra::Raw, Extra::RawLocked];
        for prepared in [false, true] {
            for (notify, ordered) in [(false, true), (true, true), (false, false), (true, false)] {
                extras.push(Enqueue::extra(prepared, notify, ordered));
            }
        }
        extras.push(Extra::Enqueue(Enqueue {
            prepared: false,
            notify: true,
            ordered: true,
            waited: true,
        }));
        extras
    } else {
        vec![Extra::Nothing]
    };
    let slice = settings.secs / settings.rounds;
    for &threads in &settings.threads {
        let mut producers = extras
            .iter()
            .map(|&extra| Producer::new(scratch, extra, settings.partitioned))
            .collect::<Result<Vec<_>>>()?;
        for _ in 0..settings.rounds {
            for producer in &mut producers {
                producer.run(scratch, threads, slice)?;
            }
        }
        let rates: Vec<(Extra, f64)> = producers.iter().map(|p| (p.extra, p.rate())).collect();
        for producer in &producers {
            producer.print(threads, settings, &rates);
        }
    }
    Ok(())
}

/// Runs `threads` threads for `secs`: each calls `setup` once, then, once every thread is
/// ready, its operation until time is up. Returns the operations done and the time taken.
fn run_threads<S, Op>(threads: usize, secs: Duration, setup: S) -> Result<(u64, Duration)>
where
    S: Fn() -> Result<Op> + Sync,
    Op: FnMut() -> Result<()>,
{
    let ready = Barrier::new(threads + 1);
    thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| -> Result<u64> {
                    let op = setup();
                    ready.wait(); // even after a failed setup, so nobody waits forever
                    let mut op = op?;
                    let deadline = Instant::now() + secs;
                    let mut done = 0;
                    while Instant::now() < deadline {
                        op()?;
                        done += 1;
                    }
                    Ok(done)
                })
            })
            .collect();
        ready.wait();
        let started = Instant::now();
        let mut total = 0;
        for handle in handles {
            total += handle.join().expect("bench thread panicked")?;
        }
        Ok((total, started.elapsed()))
    })
}

// ------------------------------------------------------------------ enqueue_all

/// `enqueue_all` of 1,000 messages per transaction, taking turns with a binary `COPY` of
/// the same rows into a table of the same schema, and with that `COPY` after the locks a
/// batch of that many aggregates takes (the sixteen buckets of the table's ordered
/// enqueues, exclusively: see `sql/functions/locks.sql`), the same guarantee of order by
/// hand.
fn enqueue_all(scratch: &Scratch) -> Result<()> {
    let outbox = scratch.outbox(true)?;
    let copied = scratch.outbox(false)?;
    let copy = format!(
        "COPY {} (key, topic, aggregate_key, payload, content_type) FROM STDIN (FORMAT binary)",
        copied.table()
    );
    let types = [Type::TEXT, Type::TEXT, Type::TEXT, Type::BYTEA, Type::TEXT];
    let mut client = scratch.client()?;
    let lock = client.prepare(
        "SELECT pg_advisory_xact_lock(7340032 + bucket) FROM generate_series(0, 15) AS bucket",
    )?;
    let mut spent = [Duration::ZERO; 3];
    // Each turn's copy time over its enqueue_all's: their median holds still where a
    // stall of a few turns moves the ratio of the sums.
    let mut turns = [
        Vec::with_capacity(ENQUEUE_ALL_REPS),
        Vec::with_capacity(ENQUEUE_ALL_REPS),
    ];
    let payload = payload();
    for rep in 0..ENQUEUE_ALL_REPS {
        let first = (rep * ENQUEUE_ALL_ROWS) as i64;
        let started = Instant::now();
        let mut tx = client.transaction()?;
        outbox.enqueue_all(
            &mut tx,
            (0..ENQUEUE_ALL_ROWS as i64).map(|i| event(first + i)),
        )?;
        tx.commit()?;
        let enqueue_took = started.elapsed();
        spent[0] += enqueue_took;

        for (locked, turns) in turns.iter_mut().enumerate() {
            let started = Instant::now();
            let mut tx = client.transaction()?;
            if locked == 1 {
                tx.execute(&lock, &[])?;
            }
            let mut writer = BinaryCopyInWriter::new(tx.copy_in(&copy)?, &types);
            for i in first..first + ENQUEUE_ALL_ROWS as i64 {
                let key = uuid::Uuid::now_v7().to_string();
                let aggregate = format!("order-{i}");
                writer.write(&[
                    &key,
                    &"order.created",
                    &aggregate,
                    &payload,
                    &"application/json",
                ])?;
            }
            writer.finish()?;
            tx.commit()?;
            let copy_took = started.elapsed();
            spent[1 + locked] += copy_took;
            turns.push(copy_took.as_secs_f64() / enqueue_took.as_secs_f64());
        }
    }
    let quartiles = |turns: &mut Vec<f64>| {
        turns.sort_by(f64::total_cmp);
        format!(
            "{:.2}/{:.2}/{:.2}",
            turns[turns.len() / 4],
            turns[turns.len() / 2],
            turns[turns.len() * 3 / 4]
        )
    };
    let rows = (ENQUEUE_ALL_REPS * ENQUEUE_ALL_ROWS) as u64;
    for (locked, name) in ["copy", "copy locked=true"].iter().enumerate() {
        Line::new(name)
            .kv("rows", ENQUEUE_ALL_ROWS)
            .kv("tx", ENQUEUE_ALL_REPS)
            .kv(
                "ms_per_tx",
                format!(
                    "{:.1}",
                    spent[1 + locked].as_secs_f64() * 1e3 / ENQUEUE_ALL_REPS as f64
                ),
            )
            .rate(rows, spent[1 + locked])
            .print();
    }
    let [copying, locked_copying] = &mut turns;
    Line::new("enqueue_all")
        .kv("rows", ENQUEUE_ALL_ROWS)
        .kv("tx", ENQUEUE_ALL_REPS)
        .kv(
            "ms_per_tx",
            format!(
                "{:.1}",
                spent[0].as_secs_f64() * 1e3 / ENQUEUE_ALL_REPS as f64
            ),
        )
        .rate(rows, spent[0])
        .kv(
            "vs_copy",
            format!("{:.2}", spent[1].as_secs_f64() / spent[0].as_secs_f64()),
        )
        .kv("vs_copy_turns", quartiles(copying))
        .kv(
            "vs_copy_locked",
            format!("{:.2}", spent[2].as_secs_f64() / spent[0].as_secs_f64()),
        )
        .kv("vs_copy_locked_turns", quartiles(locked_copying))
        .print();
    Ok(())
}

/// Batches checked against a backlog: a batch looks up each of its aggregates, and the cost
/// must follow the batch, not the backlog.
fn enqueue_all_backlog(scratch: &Scratch) -> Result<()> {
    const REPS: usize = 10;
    for backlog in [0i64, 100_000] {
        let outbox = scratch.outbox(false)?;
        let mut client = scratch.client()?;
        client.batch_execute(&format!(
            "INSERT INTO {t} (key, topic, aggregate_key, payload, head)
             SELECT 'backlog-' || i, 'order.created', 'backlog-' || i, 'p', true
             FROM generate_series(1, {backlog}) AS i;
             ANALYZE {t};",
            t = outbox.table()
        ))?;
        let mut took = [Duration::ZERO; 2];
        for rep in 0..REPS {
            for (path, delay) in [Duration::ZERO, Duration::from_secs(3600)]
                .iter()
                .enumerate()
            {
                let first = (rep * ENQUEUE_ALL_ROWS) as i64;
                let batch =
                    (first..first + ENQUEUE_ALL_ROWS as i64).map(|i| event(i).delay(*delay));
                let started = Instant::now();
                let mut tx = client.transaction()?;
                outbox.enqueue_all(&mut tx, batch)?;
                tx.rollback()?;
                took[path] += started.elapsed();
            }
        }
        for (took, path) in took.iter().zip(["copy", "function"]) {
            Line::new("enqueue_all")
                .kv("backlog", backlog)
                .kv("path", path)
                .kv("rows", ENQUEUE_ALL_ROWS)
                .kv("tx", REPS)
                .kv(
                    "ms_per_tx",
                    format!("{:.1}", took.as_secs_f64() * 1e3 / REPS as f64),
                )
                .print();
        }
    }
    Ok(())
}

// ------------------------------------------------------------------ relay

/// Drains `relay_rows` pre-filled rows with a relay and a no-op publisher.
fn relay(settings: &Settings, scratch: &Scratch, batch: usize) -> Result<()> {
    let rows = settings.relay_rows;
    let outbox = scratch.outbox(false)?;
    let mut client = scratch.client()?;
    prefill(&mut client, &outbox, rows)?;
    stats_cost(&mut client, &outbox, "pending", rows, "after_fill")?;

    let config = RelayConfig::new(outbox.clone(), scratch.pool(RELAY_POOL_SIZE)?, no_op)
        .batch_size(batch)
        .concurrency(RELAY_CONCURRENCY);
    let drained = drain(&mut client, &outbox, config, rows, RELAY_TIMEOUT)?.complete()?;
    Line::new("relay")
        .kv("batch", batch)
        .kv("concurrency", RELAY_CONCURRENCY)
        .kv("rows", rows)
        .rate(drained.sent, drained.took)
        .print();
    // Right after the drain the due index still points at every dead row version; once
    // (auto)vacuum has run, only the counters stand for the sent rows.
    stats_cost(&mut client, &outbox, "sent", rows, "before_vacuum")?;
    client.batch_execute(&format!("VACUUM ANALYZE {}", outbox.table()))?;
    stats_cost(&mut client, &outbox, "sent", rows, "after_vacuum")
}

/// Each shape's backlog of `ordered_rows` 512-byte rows, drained by a relay with default
/// settings into a no-op publisher, against the unordered backlog's rate.
fn ordered(settings: &Settings, scratch: &Scratch) -> Result<()> {
    let rows = settings.ordered_rows;
    let mut client = scratch.client()?;
    let mut unordered = None;
    for shape in Shape::ALL {
        let outbox = scratch.outbox(false)?;
        prefill_rows(&mut client, &outbox, rows, PAYLOAD_BYTES, shape)?;
        let config = RelayConfig::new(
            outbox.clone(),
            scratch.pool(DEFAULT_RELAY_POOL_SIZE)?,
            no_op,
        );
        let drained = drain(&mut client, &outbox, config, rows, settings.ordered_cap)?;
        let unordered = *unordered.get_or_insert(drained.rate());
        let mut line = Line::new("ordered")
            .kv("shape", shape.name())
            .kv("rows", rows)
            .rate(drained.sent, drained.took)
            .kv("vs_unordered", ratio(drained.rate(), unordered));
        if drained.capped {
            line = line.kv("sent", drained.sent).kv("capped", true);
        }
        Line(format!("{} {}", line.0, drained.cycle_report())).print();
        drop_outbox(&mut client, &outbox)?;
    }
    Ok(())
}

/// `rss_rows` rows of 1 MiB drained by a relay with default settings into a no-op
/// publisher: the relay's rate and the process's peak resident memory.
fn rss(settings: &Settings, scratch: &Scratch) -> Result<()> {
    let rows = settings.rss_rows;
    let outbox = scratch.outbox(false)?;
    let mut client = scratch.client()?;
    prefill_rows(
        &mut client,
        &outbox,
        rows,
        RSS_PAYLOAD_BYTES,
        Shape::Unordered,
    )?;
    let pool = scratch.pool(DEFAULT_RELAY_POOL_SIZE)?;
    // VmHWM is the process's peak so far; start it again from here (Linux 4.0+).
    if let Err(e) = std::fs::write("/proc/self/clear_refs", "5") {
        eprintln!("could not reset VmHWM ({e}): peak_rss_mib is the whole process's peak");
    }
    let baseline = proc_status_mib("VmRSS")?;
    let config = RelayConfig::new(outbox.clone(), pool, no_op);
    let drained = drain(&mut client, &outbox, config, rows, RELAY_TIMEOUT)?.complete()?;
    let peak = proc_status_mib("VmHWM")?;
    Line::new("rss")
        .kv("rows", rows)
        .kv("payload", RSS_PAYLOAD_BYTES)
        .kv("rate", fmt_rate(drained.rate()))
        .kv("peak_rss_mib", format!("{peak:.0}"))
        .kv("baseline_rss_mib", format!("{baseline:.0}"))
        .print();
    drop_outbox(&mut client, &outbox)
}

/// A `/proc/self/status` memory figure (reported in kB), in MiB.
fn proc_status_mib(field: &str) -> Result<f64> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    let kb: f64 = status
        .lines()
        .find_map(|line| line.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|rest| rest.split_whitespace().next())
        .ok_or_else(|| format!("no {field} in /proc/self/status"))?
        .parse()?;
    Ok(kb / 1024.0)
}

// ------------------------------------------------------------------ enqueue-parts

const PARTS_ROUNDS: u32 = 4;

/// Where an enqueue's cost goes, on one connection: each variant is a transaction of its own
/// (BEGIN, one write, COMMIT) and the line gives its microseconds over an empty one.
/// `raw` is the hand-written prepared INSERT; `enqueue` our call as sent (parsed and planned
/// on every call); `call_prepared` the same call prepared once; `insert_prepared` our row
/// written by a prepared INSERT with `ON CONFLICT`, no function; `insert_sent` that INSERT
/// sent as text, parsed and planned on every call, as enqueue was before the function.
fn enqueue_parts(scratch: &Scratch) -> Result<()> {
    let outbox = scratch.outbox(false)?;
    let raw_table = scratch.raw_outbox()?;
    let mut client = scratch.client()?;
    client.batch_execute("SET synchronous_commit = off")?;
    let (table, schema) = (outbox.table().to_owned(), outbox.table().split_once('.'));
    let function = match schema {
        Some((schema, name)) => format!("{schema}.{name}_enqueue"),
        None => format!("{table}_enqueue"),
    };
    let raw = client.prepare(&format!(
        "INSERT INTO {raw_table} (key, topic, aggregate_key, payload, headers) \
         VALUES ($1, $2, $3, $4, $5::text::jsonb)"
    ))?;
    let types = [
        Type::TEXT,
        Type::TEXT,
        Type::TEXT,
        Type::BYTEA,
        Type::TEXT,
        Type::TEXT_ARRAY,
        Type::TIMESTAMPTZ,
        Type::INT8,
        Type::INT4,
        Type::BOOL,
        Type::BOOL,
        Type::BOOL,
    ];
    // The function `Outbox::enqueue` calls (migration 10's), with the same arguments.
    let call = client.prepare_typed(
        &format!("SELECT {function}($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)"),
        &types,
    )?;
    // The row the function writes for the crate's own key, as its head, with no lock and no
    // look for earlier messages of its aggregate.
    let insert_sql = format!(
        "INSERT INTO {table} (key, topic, aggregate_key, payload, content_type, headers, \
                              available_at, max_attempts, park, head) \
         VALUES ($1, $2, $3, $4, $5, $6, coalesce($7, now() + $8 * interval '1 microsecond'), $9, \
                 $10, true)"
    );
    let insert = client.prepare_typed(&insert_sql, &types[..10])?;
    let payload = payload();
    let no_headers: Vec<String> = Vec::new();
    let no_time: Option<std::time::SystemTime> = None;
    let no_limit: Option<i32> = None;
    let no_park: Option<bool> = None;
    let variants = [
        "empty",
        "raw",
        "enqueue",
        "call_prepared",
        "insert_prepared",
        "insert_sent",
    ];
    let mut spent = vec![(Duration::ZERO, 0u64); variants.len()];
    for _ in 0..PARTS_ROUNDS {
        for (v, variant) in variants.iter().enumerate() {
            let started = Instant::now();
            let mut n = 0u64;
            while started.elapsed() < Duration::from_secs(1) {
                let key = uuid::Uuid::now_v7();
                let text_key = key.to_string();
                let aggregate = format!("order-{n}");
                let mut tx = client.transaction()?;
                // Notify off, the key the crate's own (as `enqueue` sends it for this message).
                let ours: [&(dyn postgres::types::ToSql + Sync); 12] = [
                    &text_key,
                    &"order.created",
                    &aggregate,
                    &payload,
                    &"application/json",
                    &no_headers,
                    &no_time,
                    &0i64,
                    &no_limit,
                    &no_park,
                    &false,
                    &true,
                ];
                match *variant {
                    "raw" => {
                        tx.execute(
                            &raw,
                            &[
                                &key,
                                &"order.created",
                                &aggregate,
                                &payload,
                                &r#"{"content-type": "application/json"}"#,
                            ],
                        )?;
                    }
                    "enqueue" => {
                        outbox.enqueue(
                            &mut tx,
                            Message::new("order.created", payload.clone())
                                .aggregate_key(aggregate.clone())
                                .content_type("application/json"),
                        )?;
                    }
                    "call_prepared" => {
                        tx.query_one(&call, &ours)?;
                    }
                    "insert_prepared" => {
                        tx.execute(&insert, &ours[..10])?;
                    }
                    "insert_sent" => {
                        let typed: Vec<_> = ours[..10].iter().copied().zip(types.clone()).collect();
                        tx.execute_typed(&insert_sql, &typed)?;
                    }
                    _ => {}
                }
                tx.commit()?;
                n += 1;
            }
            spent[v].0 += started.elapsed();
            spent[v].1 += n;
        }
    }
    parts_line("enqueue-parts", PARTS_ROUNDS, &variants, &spent).print();
    Ok(())
}

/// A line of microseconds per transaction over an empty one (the first variant), for
/// each other variant: `spent` holds each variant's time and transactions.
fn parts_line(name: &str, rounds: u32, variants: &[&str], spent: &[(Duration, u64)]) -> Line {
    let micros = |(took, n): (Duration, u64)| took.as_secs_f64() * 1e6 / n.max(1) as f64;
    let empty = micros(spent[0]);
    let mut line = Line::new(name)
        .kv("rounds", rounds)
        .kv("empty_us", format!("{empty:.0}"));
    for (v, variant) in variants.iter().enumerate().skip(1) {
        line = line.kv(
            &format!("{variant}_us"),
            format!("{:.0}", micros(spent[v]) - empty),
        );
    }
    line
}

// ------------------------------------------------------------------ sequence

const SEQUENCE_ROUNDS: u32 = 4;

/// What places cost the producer and the consumer (see the module's documentation).
fn sequence(scratch: &Scratch) -> Result<()> {
    let off = scratch.outbox(false)?;
    let on = Outbox::builder()
        .table(off.table())
        .notify(false)
        .sequence(true)
        .build()?;
    let connect = || -> Result<Client> {
        let mut client = scratch.client()?;
        client.batch_execute("SET synchronous_commit = off")?;
        Ok(client)
    };
    let mut client = connect()?;
    let mut prepared_off = off.producer(connect()?)?;
    let mut prepared_on = on.producer(connect()?)?;
    let consumed = match off.table().split_once('.') {
        Some((schema, name)) => format!("{schema}.{name}_consumed"),
        None => format!("{}_consumed", off.table()),
    };
    // The consumer's statement (src/rabbitmq/consumer/sql.rs), by hand: the bench builds
    // without the rabbitmq feature.
    let place = client.prepare(&format!(
        "WITH prior AS (SELECT last FROM {consumed} WHERE consumer = $1 AND aggregate_key = $2 \
                        FOR UPDATE), \
         kept AS (INSERT INTO {consumed} AS c (consumer, aggregate_key, last) \
                  VALUES ($1, $2, $3) ON CONFLICT (consumer, aggregate_key) \
                  DO UPDATE SET last = greatest(c.last, excluded.last)) \
         SELECT (SELECT last FROM prior)"
    ))?;
    let payload = payload();
    let message = |n: u64| {
        Message::new("order.created", payload.clone())
            .aggregate_key(format!("order-{}", n % 1000))
            .content_type("application/json")
    };
    let variants = [
        "empty",
        "text_off",
        "text_on",
        "prepared_off",
        "prepared_on",
        "keyed_off",
        "keyed_on",
        "batch100_off",
        "batch100_on",
        "consume_off",
        "consume_on",
    ];
    let mut spent = vec![(Duration::ZERO, 0u64); variants.len()];
    let mut places = 0i64;
    for _ in 0..SEQUENCE_ROUNDS {
        for (v, variant) in variants.iter().enumerate() {
            let started = Instant::now();
            let mut n = 0u64;
            while started.elapsed() < Duration::from_secs(1) {
                match *variant {
                    "prepared_off" | "prepared_on" => {
                        let producer = if *variant == "prepared_on" {
                            &mut prepared_on
                        } else {
                            &mut prepared_off
                        };
                        let mut tx = producer.transaction()?;
                        tx.enqueue(message(n))?;
                        tx.commit()?;
                    }
                    _ => {
                        let outbox = if variant.ends_with("_on") { &on } else { &off };
                        let mut tx = client.transaction()?;
                        match *variant {
                            "text_off" | "text_on" => {
                                outbox.enqueue(&mut tx, message(n))?;
                            }
                            "keyed_off" | "keyed_on" => {
                                let key = uuid::Uuid::now_v7().to_string();
                                outbox.enqueue(&mut tx, message(n).key(key))?;
                            }
                            "batch100_off" | "batch100_on" => {
                                outbox
                                    .enqueue_all(&mut tx, (0..100).map(|i| message(n * 100 + i)))?;
                            }
                            "consume_off" | "consume_on" => {
                                let key = uuid::Uuid::now_v7().to_string();
                                outbox.dedupe(&mut tx, "bench", &key)?;
                                if *variant == "consume_on" {
                                    places += 1;
                                    let aggregate = format!("order-{}", n % 1000);
                                    tx.query_one(&place, &[&"bench", &aggregate, &places])?;
                                }
                            }
                            _ => {}
                        }
                        tx.commit()?;
                    }
                }
                n += 1;
            }
            spent[v].0 += started.elapsed();
            spent[v].1 += n;
        }
    }
    parts_line("sequence", SEQUENCE_ROUNDS, &variants, &spent).print();
    Ok(())
}

// ------------------------------------------------------------------ wake

const WAKE_SAMPLES: usize = 50;

/// How long an idle relay (polling once an hour, so only a notification wakes it) takes
/// from an enqueue's commit to handing the row to its publisher.
fn wake(scratch: &Scratch) -> Result<()> {
    let outbox = scratch.outbox(true)?;
    let published: Arc<Mutex<Option<Instant>>> = Arc::default();
    let seen = published.clone();
    let config = RelayConfig::new(outbox.clone(), scratch.pool(RELAY_POOL_SIZE)?, move || {
        let seen = seen.clone();
        Ok::<_, std::io::Error>(publisher_fn(move |_| {
            if let Ok(mut at) = seen.lock() {
                *at = Some(Instant::now());
            }
            Ok(())
        }))
    })
    .poll_interval(Duration::from_secs(3600));
    let relay = postgres_outbox::Relay::spawn(config)?;
    let mut client = scratch.client()?;
    let deadline = Instant::now() + Duration::from_secs(30);
    while !relay.is_listening() && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(10));
    }
    let mut took = Vec::with_capacity(WAKE_SAMPLES);
    for i in 0..WAKE_SAMPLES {
        *published.lock().map_err(|_| "poisoned")? = None;
        let mut tx = client.transaction()?;
        outbox.enqueue(&mut tx, event(i as i64))?;
        tx.commit()?;
        let committed = Instant::now();
        let deadline = committed + Duration::from_secs(30);
        loop {
            if let Some(at) = *published.lock().map_err(|_| "poisoned")? {
                took.push(at.saturating_duration_since(committed));
                break;
            }
            if Instant::now() > deadline {
                return Err("the idle relay was not woken within 30 s".into());
            }
            thread::sleep(Duration::from_micros(200));
        }
        // Idle again before the next one.
        thread::sleep(Duration::from_millis(100));
    }
    relay.shutdown(Duration::from_secs(10))?;
    took.sort();
    let ms = |d: Duration| format!("{:.2}", d.as_secs_f64() * 1e3);
    Line::new("wake")
        .kv("samples", WAKE_SAMPLES)
        .kv("median_ms", ms(took[WAKE_SAMPLES / 2]))
        .kv("p90_ms", ms(took[WAKE_SAMPLES * 9 / 10]))
        .kv("max_ms", ms(took[WAKE_SAMPLES - 1]))
        .print();
    Ok(())
}

/// The relay's publisher factory: a publisher that accepts every record and does nothing.
fn no_op() -> std::result::Result<impl postgres_outbox::Publisher, std::io::Error> {
    Ok(publisher_fn(|_| Ok(())))
}

/// Times `stats()` with `rows` rows in one state: it reads pending rows, but sent rows only
/// through the counters, so its cost should not grow with them.
fn stats_cost(
    client: &mut Client,
    outbox: &Outbox,
    state: &str,
    rows: usize,
    when: &str,
) -> Result<()> {
    const CALLS: u32 = 20;
    let started = Instant::now();
    for _ in 0..CALLS {
        outbox.stats(client)?;
    }
    let took = started.elapsed();
    Line::new("stats")
        .kv(state, rows)
        .kv("when", when)
        .kv(
            "ms_per_call",
            format!("{:.2}", took.as_secs_f64() * 1e3 / f64::from(CALLS)),
        )
        .rate(u64::from(CALLS), took)
        .print();
    Ok(())
}

/// Fills the outbox with `rows` pending messages, a thousand per transaction.
fn prefill(client: &mut Client, outbox: &Outbox, rows: usize) -> Result<()> {
    for first in (0..rows).step_by(ENQUEUE_ALL_ROWS) {
        let last = rows.min(first + ENQUEUE_ALL_ROWS);
        let mut tx = client.transaction()?;
        outbox.enqueue_all(&mut tx, (first as i64..last as i64).map(event))?;
        tx.commit()?;
    }
    // What autovacuum would have done by now after so many inserts.
    client.batch_execute(&format!("VACUUM ANALYZE {}", outbox.table()))?;
    Ok(())
}

// ------------------------------------------------------------------ partitions

/// Partition counts `partitions` measures at: from a fresh table to four months of days.
const PARTITION_COUNTS: [usize; 5] = [3, 14, 30, 60, 120];

/// What each partition a table keeps costs `stats()` and an enqueue: a table partitioned
/// by day, cut by hand to each count in `PARTITION_COUNTS`, its closed partitions holding
/// 1,000 sent rows each and the open one 200 pending, against a plain table holding the
/// same rows. The rows of the partitions closed are marked sent in place, and the relay's
/// upkeep run once before measuring, as a relay would have done. `kept_` is the
/// partitioned table again with a dead letter kept in its oldest partition, which keeps
/// that partition from settling (before migration 18, `stats()` read every partition from
/// there, as `topic_stats()` did for dead letters; before migration 16, each enqueue's
/// look did too). `held_` is the same with a
/// message scheduled for tomorrow in the oldest partition, which keeps it from being
/// quiet (before migration 19, each enqueue's look and `stats()` read every partition
/// from there); `held_twice_` with a second one in the middle partition (each enqueue's
/// look read every partition from there before migration 21, and `stats()` before
/// 6fc6f7d).
fn partitions(scratch: &Scratch) -> Result<()> {
    const STATS_CALLS: u32 = 20;
    const ENQUEUES: u32 = 200;
    // Batches of `enqueue_all`, due at once with the crate's keys: copied in.
    const BATCHES: u32 = 20;
    const BATCH: u32 = 100;
    let mut client = scratch.client()?;
    let partitioned = scratch.scale_outbox(TableKind::Partitioned)?;
    let plain = scratch.scale_outbox(TableKind::Plain)?;
    // As a relay's upkeep statement runs it.
    let upkeep = |client: &mut Client, cut: bool| -> Result<()> {
        let t = partitioned.table();
        client.execute(&format!("SELECT {t}_partition($1), {t}_settle()"), &[&cut])?;
        Ok(())
    };
    let sent = "UPDATE {} SET status = 'sent', done_at = now(), head = false \
                WHERE status = 'pending'";
    let mut have = 3;
    for count in PARTITION_COUNTS {
        while have < count {
            for outbox in [&partitioned, &plain] {
                prefill(&mut client, outbox, 1_000)?;
                client.batch_execute(&sent.replace("{}", outbox.table()))?;
            }
            upkeep(&mut client, true)?;
            have += 1;
        }
        upkeep(&mut client, false)?;
        for outbox in [&partitioned, &plain] {
            prefill(&mut client, outbox, 200)?;
        }
        // The mean of a `stats()` (after one to warm up) and of a single enqueue.
        let stats_and_enqueue = |client: &mut Client, outbox: &Outbox| -> Result<_> {
            outbox.stats(client)?;
            let stats = mean_of(STATS_CALLS, |_| outbox.stats(client).map(drop))?;
            let enqueue = mean_of(ENQUEUES, |i| {
                enqueued(client, |tx| {
                    outbox.enqueue(tx, event(i64::from(i))).map(drop)
                })
            })?;
            Ok((stats, enqueue))
        };
        let mut line = Line::new("partitions").kv("count", count);
        for (name, outbox) in [("", &partitioned), ("plain_", &plain)] {
            let (stats, enqueue) = stats_and_enqueue(&mut client, outbox)?;
            // With a key of the caller's, looked for in every partition.
            let keyed = mean_of(ENQUEUES, |i| {
                let keyed = event(i64::from(i)).key(format!("keyed-{count}-{i}"));
                enqueued(&mut client, |tx| outbox.enqueue(tx, keyed).map(drop))
            })?;
            let batch = mean_of(BATCHES, |i| {
                let first = i64::from(ENQUEUES + i * BATCH);
                let batch = (first..first + i64::from(BATCH)).map(event);
                enqueued(&mut client, |tx| outbox.enqueue_all(tx, batch).map(drop))
            })?;
            line = line
                .kv(&format!("{name}stats_ms"), ms(stats))
                .kv(&format!("{name}enqueue_ms"), ms(enqueue))
                .kv(&format!("{name}keyed_enqueue_ms"), ms(keyed))
                .kv(&format!("{name}enqueue_all_ms"), ms(batch));
            client.batch_execute(&sent.replace("{}", outbox.table()))?;
        }
        // A dead letter in the oldest partition, as a relay would have left it there before
        // the partition was quiet: the upkeep finds it.
        let t = partitioned.table();
        client.batch_execute(&format!(
            "UPDATE {t} SET status = 'dead' WHERE id = (SELECT min(id) FROM {t});
             UPDATE {t}_partitions SET settled_at = NULL, quiet_at = NULL
             WHERE n = (SELECT min(n) FROM {t}_partitions)"
        ))?;
        // Quiet once no transaction from before this is left (autovacuum's included), if
        // it is closed (with 3 partitions, the oldest is the open one).
        let quiet = format!(
            "SELECT quiet_at IS NOT NULL OR closed_at IS NULL FROM {t}_partitions \
             WHERE n = (SELECT min(n) FROM {t}_partitions)"
        );
        let started = Instant::now();
        loop {
            upkeep(&mut client, false)?;
            if client.query_one(&quiet, &[])?.get(0) {
                break;
            }
            if started.elapsed() > Duration::from_secs(60) {
                return Err("the oldest partition did not become quiet".into());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let (stats, enqueue) = stats_and_enqueue(&mut client, &partitioned)?;
        partitioned.topic_stats(&mut client)?;
        let topic_stats = mean_of(STATS_CALLS, |_| {
            partitioned.topic_stats(&mut client).map(drop)
        })?;
        client.batch_execute(&format!(
            "DELETE FROM {t} WHERE status = 'dead'; {}",
            sent.replace("{}", t)
        ))?;
        upkeep(&mut client, false)?;
        line = line
            .kv("kept_stats_ms", ms(stats))
            .kv("kept_topic_stats_ms", ms(topic_stats))
            .kv("kept_enqueue_ms", ms(enqueue));
        // The first row of the partition `after` the oldest, scheduled for tomorrow, as its
        // relay would have left it there before the partition was quiet (partition n's ids
        // start at n << 40).
        let hold = |client: &mut Client, after: usize| -> Result<()> {
            client.batch_execute(&format!(
                "UPDATE {t} SET status = 'pending', done_at = NULL,
                                available_at = now() + interval '1 day'
                 WHERE id = (SELECT min(id) FROM {t}
                             WHERE id >= (SELECT min(n) + {after} FROM {t}_partitions) << 40);
                 UPDATE {t}_partitions SET settled_at = NULL, quiet_at = NULL
                 WHERE n = (SELECT min(n) + {after} FROM {t}_partitions)"
            ))?;
            upkeep(client, false)
        };
        // A message scheduled for tomorrow in the oldest partition instead.
        hold(&mut client, 0)?;
        let (stats, enqueue) = stats_and_enqueue(&mut client, &partitioned)?;
        line = line
            .kv("held_stats_ms", ms(stats))
            .kv("held_enqueue_ms", ms(enqueue));
        // And a second one, in the middle partition, past quiet ones.
        if count > 3 {
            hold(&mut client, count / 2)?;
            let (stats, enqueue) = stats_and_enqueue(&mut client, &partitioned)?;
            line = line
                .kv("held_twice_stats_ms", ms(stats))
                .kv("held_twice_enqueue_ms", ms(enqueue));
        }
        client.batch_execute(&sent.replace("{}", t))?;
        upkeep(&mut client, false)?;
        line.print();
    }
    Ok(())
}

/// The mean time of `f`, called `times` times with 0, 1, ...
fn mean_of<E>(times: u32, mut f: impl FnMut(u32) -> std::result::Result<(), E>) -> Result<Duration>
where
    E: Into<Box<dyn Error + Send + Sync>>,
{
    let started = Instant::now();
    for i in 0..times {
        f(i).map_err(Into::into)?;
    }
    Ok(started.elapsed() / times)
}

/// `enqueue` in a transaction of its own, committed.
fn enqueued(
    client: &mut Client,
    enqueue: impl FnOnce(&mut postgres::Transaction<'_>) -> postgres_outbox::Result<()>,
) -> Result<()> {
    let mut tx = client.transaction()?;
    enqueue(&mut tx)?;
    tx.commit()?;
    Ok(())
}

fn ms(took: Duration) -> String {
    format!("{:.2}", took.as_secs_f64() * 1e3)
}

// ------------------------------------------------------------------ scale

/// Rows of the small table `scale` compares the big one with: a backlog to claim from.
const SCALE_SMALL_ROWS: usize = 20_000;

/// The sent rows of each table, in days of as many rows each: on a partitioned table, a
/// partition each, as a day's partition holds a day of traffic.
const SCALE_DAYS: usize = 10;

/// Whether what the outbox retains makes its everyday operations dearer: a relay cycle
/// (`Relay::run_once`: claim, publish to a no-op publisher, record), `stats()`, one enqueue
/// with a key of the crate's and one with the caller's, and the purge of a day of sent rows,
/// on a table holding `scale_sent` sent rows (`SCALE_DAYS` days of them) and `scale_pending`
/// pending rows (each its own aggregate, 128-byte payloads), against the same on a table
/// holding `SCALE_SMALL_ROWS` of each: plain tables, then partitioned ones (a partition per
/// day; `OUTBOX_BENCH_SCALE_TABLES=plain` or `partitioned` for one kind). Tables are
/// vacuumed and analysed first, as autovacuum would have them. `vs_small=` is the big
/// table's cost over the small one's. With `OUTBOX_BENCH_SCALE_PLANS=1` it prints the
/// claim's and `stats()`'s plans on each big table (auto_explain, as notices).
fn scale(settings: &Settings, scratch: &Scratch) -> Result<()> {
    for kind in &settings.scale_tables {
        scale_tables(settings, scratch, *kind)?;
    }
    Ok(())
}

/// The kind of table `scale` measures.
#[derive(Debug, Clone, Copy, PartialEq)]
enum TableKind {
    Plain,
    Partitioned,
}

impl TableKind {
    fn name(self) -> &'static str {
        match self {
            TableKind::Plain => "plain",
            TableKind::Partitioned => "partitioned",
        }
    }
}

fn scale_tables(settings: &Settings, scratch: &Scratch, kind: TableKind) -> Result<()> {
    let mut client = scratch.client()?;
    let (small, big) = (scratch.scale_outbox(kind)?, scratch.scale_outbox(kind)?);
    let started = Instant::now();
    scale_fill(
        &mut client,
        &small,
        kind,
        SCALE_SMALL_ROWS,
        SCALE_SMALL_ROWS,
    )?;
    scale_fill(
        &mut client,
        &big,
        kind,
        settings.scale_sent,
        settings.scale_pending,
    )?;
    let filled = Instant::now();
    Line::new("scale-fill")
        .kv("tables", kind.name())
        .kv("sent", settings.scale_sent)
        .kv("pending", settings.scale_pending)
        .kv("secs", format!("{:.0}", started.elapsed().as_secs_f64()))
        .print();

    let pool = scratch.pool(2)?;
    let cycle = |outbox: &Outbox| -> Result<Duration> {
        let config = RelayConfig::new(outbox.clone(), pool.clone(), no_op)
            .batch_size(100)
            .concurrency(1);
        let started = Instant::now();
        Relay::run_once(&config)?;
        Ok(started.elapsed())
    };
    scale_compare(kind, "relay-cycle", 20, &small, &big, cycle)?;
    // On one connection, as a gauge or a dashboard reads them.
    let mut stats_client = scratch.client()?;
    scale_compare(kind, "stats", 20, &small, &big, |outbox: &Outbox| {
        let started = Instant::now();
        outbox.stats(&mut stats_client)?;
        Ok(started.elapsed())
    })?;
    scale_compare(kind, "stats-exact", 3, &small, &big, |outbox: &Outbox| {
        let started = Instant::now();
        outbox.stats_exact(&mut stats_client)?;
        Ok(started.elapsed())
    })?;
    // How far the estimates of stats() are from the counts (neither table changes now).
    for (table, outbox) in [("small", &small), ("big", &big)] {
        let (estimated, exact) = (
            outbox.stats(&mut stats_client)?,
            outbox.stats_exact(&mut stats_client)?,
        );
        Line::new("scale-stats-estimate")
            .kv("tables", kind.name())
            .kv("table", table)
            .kv("exact", estimated.exact)
            .kv(
                "pending",
                format!("{}/{}", estimated.pending, exact.pending),
            )
            .kv("due", format!("{}/{}", estimated.due, exact.due))
            .kv(
                "blocked",
                format!("{}/{}", estimated.blocked, exact.blocked),
            )
            .kv(
                "vs_exact",
                ratio(estimated.pending as f64, exact.pending as f64),
            )
            .print();
    }
    let mut producer = scratch.client()?;
    scale_compare(kind, "enqueue", 200, &small, &big, |outbox: &Outbox| {
        let started = Instant::now();
        let mut tx = producer.transaction()?;
        outbox.enqueue(&mut tx, event(i64::from(rand_u32())))?;
        tx.commit()?;
        Ok(started.elapsed())
    })?;
    // A key of the caller's: on a partitioned table, looked for in every partition.
    let keyed = AtomicU32::new(0);
    scale_compare(
        kind,
        "enqueue-keyed",
        200,
        &small,
        &big,
        |outbox: &Outbox| {
            let n = keyed.fetch_add(1, Ordering::Relaxed);
            let started = Instant::now();
            let mut tx = producer.transaction()?;
            outbox.enqueue(&mut tx, event(i64::from(n)).key(format!("keyed-{n}")))?;
            tx.commit()?;
            Ok(started.elapsed())
        },
    )?;
    // A day of sent rows, the oldest, from each table.
    let day = |rows: usize| move |j: usize| day_cutoff(rows, j, filled);
    let mut took = (Duration::ZERO, Duration::ZERO);
    for (outbox, cutoff, took) in [
        (&small, day(SCALE_SMALL_ROWS)(1), &mut took.0),
        (&big, day(settings.scale_sent)(1), &mut took.1),
    ] {
        let mut client = scratch.client()?;
        let started = Instant::now();
        outbox.purge(
            &mut client,
            Rows::Sent.matching(postgres_outbox::Filter::new().older_than(cutoff)),
        )?;
        *took = started.elapsed();
    }
    scale_line(kind, "purge-day-sent", 1, took);
    scale_retention(scratch, &big, kind, day(settings.scale_sent))?;
    if settings.scale_plans {
        scale_plans(&settings.url, &big)?;
    }
    drop_outbox(&mut client, &small)?;
    drop_outbox(&mut client, &big)
}

/// The age past which sent rows are the first `days` days of a table filled with `sent`
/// rows `filled` ago, one finished a second, the oldest first (see `scale_fill`).
fn day_cutoff(sent: usize, days: usize, filled: Instant) -> Duration {
    let rows = (sent / SCALE_DAYS * days).min(sent) as u64;
    Duration::from_secs(sent as u64 - rows) + filled.elapsed()
}

/// A random number, for aggregate keys that do not repeat.
fn rand_u32() -> u32 {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u128(Instant::now().elapsed().as_nanos());
    hasher.finish() as u32
}

/// Fills `outbox` straight through SQL: `sent` rows finished a second apart, oldest first,
/// `SCALE_DAYS` days of them (on a partitioned table, a partition each: the partition is
/// cut after each day), and `pending` rows each its own aggregate, marked as its head as an
/// enqueue marks it; sets the sent counter; vacuums and analyses.
fn scale_fill(
    client: &mut Client,
    outbox: &Outbox,
    kind: TableKind,
    sent: usize,
    pending: usize,
) -> Result<()> {
    let t = outbox.table();
    let day = sent / SCALE_DAYS;
    for first in (0..sent).step_by(day.max(1)) {
        let last = (first + day).min(sent);
        client.execute(
            &format!(
                "WITH p AS MATERIALIZED (SELECT decode(repeat('78', 128), 'hex') AS payload) \
                 INSERT INTO {t} (key, topic, aggregate_key, payload, status, attempts, done_at) \
                 SELECT 'sent-' || i, 'scale.event', 'sent-' || i, p.payload, 'sent', 1, \
                        now() - ($3::bigint - i + 1) * interval '1 second' \
                 FROM generate_series($1::bigint, $2::bigint) AS i, p ORDER BY i"
            ),
            &[
                &i64::try_from(first + 1)?,
                &i64::try_from(last)?,
                &i64::try_from(sent)?,
            ],
        )?;
        if kind == TableKind::Partitioned {
            client.execute(&format!("SELECT {t}_partition(true), {t}_settle()"), &[])?;
        }
    }
    client.execute(
        &format!(
            "WITH p AS MATERIALIZED (SELECT decode(repeat('78', 128), 'hex') AS payload) \
             INSERT INTO {t} (key, topic, aggregate_key, payload, head) \
             SELECT 'pending-' || i, 'scale.event', 'agg-' || i, p.payload, true \
             FROM generate_series(1, $1::bigint) AS i, p ORDER BY i"
        ),
        &[&i64::try_from(pending)?],
    )?;
    // The sent count, by partition as the relay keeps it (all in partition 0 on a plain
    // table).
    client.execute(
        &format!(
            "UPDATE {t}_counts c SET sent = s.n \
             FROM (SELECT coalesce(substring(tableoid::regclass::text FROM '_p([0-9]+)\"?$')\
                                   ::bigint, 0) AS part, \
                          count(*) AS n FROM {t} WHERE status = 'sent' GROUP BY 1) s \
             WHERE c.part = s.part AND c.slot = 0"
        ),
        &[],
    )?;
    client.batch_execute(&format!("VACUUM ANALYZE {t}"))?;
    Ok(())
}

const DAY: Duration = Duration::from_secs(86_400);
const RETENTION_WINDOW: Duration = Duration::from_secs(10);

/// Retention at scale: a purge of the next day of sent rows alone (by DELETE on a plain
/// table, by dropping its partition on a partitioned one), then a relay draining the backlog
/// for `RETENTION_WINDOW` alone and as long again while a purge takes day after day of the
/// oldest sent rows, until none is left. `cutoff(j)` is the age past which the first `j`
/// days are.
fn scale_retention(
    scratch: &Scratch,
    outbox: &Outbox,
    kind: TableKind,
    cutoff: impl Fn(usize) -> Duration + Sync,
) -> Result<()> {
    // The first day went in `purge-day-sent`.
    let days_purged = AtomicU32::new(1);
    let purge_day = |client: &mut Client| -> Result<Option<(Duration, u64)>> {
        let day = days_purged.fetch_add(1, Ordering::Relaxed) as usize + 1;
        if day > SCALE_DAYS {
            return Ok(None);
        }
        let started = Instant::now();
        let rows = outbox.purge(
            client,
            Rows::Sent.matching(postgres_outbox::Filter::new().older_than(cutoff(day))),
        )?;
        Ok(Some((started.elapsed(), rows)))
    };
    let (alone, alone_rows) = purge_day(&mut scratch.client()?)?.unwrap_or_default();

    let published = Arc::new(AtomicU64::new(0));
    let counted = Arc::clone(&published);
    let config = RelayConfig::new(
        outbox.clone(),
        scratch.pool(DEFAULT_RELAY_POOL_SIZE)?,
        move || {
            let counted = Arc::clone(&counted);
            Ok::<_, std::io::Error>(publisher_fn(move |_| {
                counted.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }))
        },
    );
    let relay = Relay::spawn(config)?;
    let rate_for = |window: Duration| {
        let (before, started) = (published.load(Ordering::Relaxed), Instant::now());
        thread::sleep(window);
        (published.load(Ordering::Relaxed) - before) as f64 / started.elapsed().as_secs_f64()
    };
    rate_for(Duration::from_secs(2)); // the relay settles
    let relay_alone = rate_for(RETENTION_WINDOW);
    let done = AtomicBool::new(false);
    let (relay_beside, (purge_took, days, rows)) = thread::scope(|s| -> Result<_> {
        let purger = s.spawn(|| -> Result<(Duration, u32, u64)> {
            let mut client = scratch.client()?;
            let (mut took, mut days, mut rows) = (Duration::ZERO, 0, 0);
            while !done.load(Ordering::Relaxed) {
                let Some((t, n)) = purge_day(&mut client)? else {
                    break;
                };
                (took, days, rows) = (took + t, days + 1, rows + n);
            }
            Ok((took, days, rows))
        });
        let relay_beside = rate_for(RETENTION_WINDOW);
        done.store(true, Ordering::Relaxed);
        let purged = purger.join().map_err(|_| "the purge thread panicked")??;
        Ok((relay_beside, purged))
    })?;
    relay.shutdown(Duration::from_secs(10))?;
    Line::new("scale-retention")
        .kv("tables", kind.name())
        .kv("purge_day_ms", format!("{:.1}", alone.as_secs_f64() * 1e3))
        .kv("rows", alone_rows)
        .kv(
            "purge_day_ms_beside_relay",
            format!(
                "{:.1}",
                purge_took.as_secs_f64() * 1e3 / f64::from(days.max(1))
            ),
        )
        .kv("days", days)
        .kv("rows_beside_relay", rows)
        .kv("relay_alone", format!("{relay_alone:.0}"))
        .kv("relay_beside_purge", format!("{relay_beside:.0}"))
        .kv("vs_alone", ratio(relay_beside, relay_alone))
        .print();
    Ok(())
}

/// Runs `op` `times` times on each table, taking turns, and prints the mean costs.
fn scale_compare(
    kind: TableKind,
    name: &str,
    times: u32,
    small: &Outbox,
    big: &Outbox,
    mut op: impl FnMut(&Outbox) -> Result<Duration>,
) -> Result<()> {
    let mut took = (Duration::ZERO, Duration::ZERO);
    for _ in 0..times {
        took.0 += op(small)?;
        took.1 += op(big)?;
    }
    scale_line(kind, name, times, took);
    Ok(())
}

fn scale_line(kind: TableKind, name: &str, times: u32, (small, big): (Duration, Duration)) {
    let ms = |d: Duration| d.as_secs_f64() * 1e3 / f64::from(times);
    Line::new("scale")
        .kv("tables", kind.name())
        .kv("op", name)
        .kv("times", times)
        .kv("small_ms", format!("{:.2}", ms(small)))
        .kv("big_ms", format!("{:.2}", ms(big)))
        .kv("vs_small", ratio(ms(big), ms(small)))
        .print();
}

/// The plans of a claim (through `process`, on one connection) and of `stats()` on the big
/// table, as auto_explain reports them.
fn scale_plans(url: &str, outbox: &Outbox) -> Result<()> {
    let mut config: postgres::Config = url.parse()?;
    config.notice_callback(|notice| {
        for line in notice.message().lines() {
            println!("plan: {line}");
        }
    });
    let mut client = config.connect(NoTls)?;
    client.batch_execute(
        "LOAD 'auto_explain'; SET auto_explain.log_min_duration = 0; \
         SET auto_explain.log_analyze = on; SET auto_explain.log_buffers = on; \
         SET auto_explain.log_nested_statements = on; SET auto_explain.log_level = notice",
    )?;
    outbox.process(&mut client, 100, |_, _| Ok(()))?;
    outbox.stats(&mut client)?;
    Ok(())
}
