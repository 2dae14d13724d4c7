//! Shared test harness: service URLs, isolated outbox tables, and waiting for conditions.
#![allow(dead_code)]

#[cfg(feature = "rabbitmq")]
pub mod broker;
#[cfg(feature = "cli")]
pub mod chromium;
pub mod faulty;
pub mod pg_node;
#[cfg(feature = "rabbitmq")]
pub mod proxy;
#[cfg(feature = "rabbitmq")]
pub mod rabbit_node;

use std::net::{TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use std::convert::Infallible;
use std::sync::{Arc, Condvar, Mutex};

use postgres::error::SqlState;
use postgres::{Client, NoTls};
use postgres_outbox::{
    publisher_fn, Access, Connections, Metrics, Outbox, OutboxBuilder, PublishError, Record,
    RelayConfig, Stats,
};
use r2d2_postgres::PostgresConnectionManager;

pub type Pool = r2d2::Pool<PostgresConnectionManager<NoTls>>;

const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/test";
const DEFAULT_AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672";

/// The PostgreSQL server's URL: `OUTBOX_TEST_DATABASE_URL`, `DATABASE_URL`, the local
/// default, or (with the `containers` feature) a throwaway container when none answers.
fn server_url() -> String {
    static URL: OnceLock<String> = OnceLock::new();
    URL.get_or_init(|| {
        resolve(
            &["OUTBOX_TEST_DATABASE_URL", "DATABASE_URL"],
            DEFAULT_DATABASE_URL,
            5432,
            containers::postgres,
        )
    })
    .clone()
}

/// The URL every test connection uses: the server's, with `search_path` set to this run's
/// schema, so the tables a test makes without naming a schema land there.
pub fn database_url() -> String {
    static URL: OnceLock<String> = OnceLock::new();
    URL.get_or_init(|| {
        let base = server_url();
        let separator = if base.contains('?') { '&' } else { '?' };
        format!("{base}{separator}options=-c%20search_path%3D{}", schema())
    })
    .clone()
}

/// Where this run's tables go: `outbox_test_<pid>`, or the schema a parent test process
/// handed down in `OUTBOX_TEST_SCHEMA` (the soak test's relay processes). The process that
/// created it drops it, and every schema named after its pid (`unique_name`), when it exits
/// after a run in which no test failed; after a failure they stay, for inspection.
pub fn schema() -> &'static str {
    SCHEMA.get_or_init(|| {
        let (name, owned) = match std::env::var(SCHEMA_VAR) {
            Ok(name) if !name.is_empty() => (name, false),
            _ => (format!("outbox_test_{}", std::process::id()), true),
        };
        Client::connect(&server_url(), NoTls)
            .and_then(|mut c| c.batch_execute(&format!("CREATE SCHEMA IF NOT EXISTS \"{name}\"")))
            .expect("create the test run's schema");
        if owned {
            OWNED.store(true, Ordering::SeqCst);
            watch_for_failures();
        }
        name
    })
}

/// Hands this run's schema down to a child test process.
pub const SCHEMA_VAR: &str = "OUTBOX_TEST_SCHEMA";

static SCHEMA: OnceLock<String> = OnceLock::new();
static OWNED: AtomicBool = AtomicBool::new(false);
static FAILED: AtomicBool = AtomicBool::new(false);
/// Where the first such panic happened, said when the schemas are kept.
static FIRST_FAILURE: OnceLock<String> = OnceLock::new();

/// A test fails by panicking on its own thread (or one it spawned). Panics on the library's
/// threads (`outbox-*`), and panics whose message starts with [`INJECTED`], are the faults
/// some tests inject on purpose, which the library contains. So is a panic of amiquip's I/O
/// thread (`amiquip-io`; amiquip 0.4 can panic there when a connection the broker closed is
/// dropped mid-read): the connection it served is gone, which the library sees as a broken
/// connection, and the test's own assertions decide.
fn watch_for_failures() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let thread = std::thread::current();
        let library = thread
            .name()
            .is_some_and(|n| n.starts_with("outbox-") || n == "amiquip-io");
        let payload = info.payload();
        let message = payload
            .downcast_ref::<&str>()
            .copied()
            .or_else(|| payload.downcast_ref::<String>().map(String::as_str));
        let injected = message.is_some_and(|m| m.starts_with(INJECTED));
        if !library && !injected {
            FAILED.store(true, Ordering::SeqCst);
            let _ = FIRST_FAILURE.set(format!(
                "thread {:?} panicked at {}: {}",
                thread.name().unwrap_or("unnamed"),
                info.location()
                    .map_or_else(String::new, ToString::to_string),
                message.unwrap_or("(no message)")
            ));
        }
        default(info);
    }));
}

/// The start of a panic message a test raises on purpose (in a handler the library runs on
/// the test's own thread, say): not a failure of the test.
pub const INJECTED: &str = "injected:";

/// When the test binary exits: drop the run's schemas unless a test failed. A lock held
/// by a connection still open cannot make the exit hang: the drop gives up after 10 s.
#[ctor::dtor]
fn drop_run_schemas() {
    let Some(schema) = SCHEMA.get() else {
        return;
    };
    if !OWNED.load(Ordering::SeqCst) {
        return;
    }
    if FAILED.load(Ordering::SeqCst) {
        eprintln!(
            "a test failed: kept schema {schema} (and *_{}_* schemas) for inspection; the first \
             panic: {}",
            std::process::id(),
            FIRST_FAILURE.get().map_or("(unknown)", String::as_str)
        );
        return;
    }
    let dropped = Client::connect(&server_url(), NoTls).and_then(|mut client| {
        client.batch_execute("SET lock_timeout = '10s'")?;
        let pattern = format!("%\\_{}\\_%", std::process::id());
        let extra: Vec<String> = client
            .query(
                "SELECT nspname::text FROM pg_namespace WHERE nspname LIKE $1",
                &[&pattern],
            )?
            .iter()
            .map(|r| r.get(0))
            .collect();
        for name in std::iter::once(schema.clone()).chain(extra) {
            // Partitioned tables first, each in a transaction of its own: one drop of
            // every partition of a run's tables at once would need more locks than the
            // server's lock table holds.
            let partitioned = client.query(
                "SELECT format('%I.%I', n.nspname, c.relname) FROM pg_class c
                 JOIN pg_namespace n ON n.oid = c.relnamespace
                 WHERE n.nspname = $1 AND c.relkind = 'p'",
                &[&name],
            )?;
            for table in partitioned {
                let table: String = table.get(0);
                client.batch_execute(&format!("DROP TABLE IF EXISTS {table} CASCADE"))?;
            }
            client.batch_execute(&format!("DROP SCHEMA IF EXISTS \"{name}\" CASCADE"))?;
        }
        Ok(())
    });
    if let Err(e) = dropped {
        eprintln!("could not drop the test schema {schema}: {e}");
    }
}

/// The RabbitMQ URL, resolved like [`database_url`].
pub fn amqp_url() -> String {
    static URL: OnceLock<String> = OnceLock::new();
    URL.get_or_init(|| {
        resolve(
            &["OUTBOX_TEST_AMQP_URL", "AMQP_URL"],
            DEFAULT_AMQP_URL,
            5672,
            containers::rabbitmq,
        )
    })
    .clone()
}

fn resolve(vars: &[&str], default: &str, port: u16, container: fn() -> Option<String>) -> String {
    let url = vars
        .iter()
        .find_map(|v| std::env::var(v).ok().filter(|s| !s.is_empty()))
        .unwrap_or_else(|| default.to_owned());
    if reachable(&url, port) {
        return url;
    }
    if let Some(url) = container() {
        return url;
    }
    panic!(
        "no service answers at {} (from {} or the default). Start it (see .ci/run), set one of \
         those variables, or run the tests with `--features containers` to use testcontainers.",
        redact(&url),
        vars.join(" / ")
    );
}

/// Host and port of a URL like `scheme://user:pass@host:port/db`.
fn reachable(url: &str, default_port: u16) -> bool {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = rest.split('/').next().unwrap_or(rest);
    let host_port = authority.rsplit('@').next().unwrap_or(authority);
    let addr = if host_port.contains(':') {
        host_port.to_owned()
    } else {
        format!("{host_port}:{default_port}")
    };
    addr.to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
        .is_some_and(|a| TcpStream::connect_timeout(&a, Duration::from_secs(3)).is_ok())
}

/// The URL without its password, for messages.
pub fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => {
            let creds = &url[s + 3..at];
            match creds.split_once(':') {
                Some((user, _)) => format!("{}{user}:***{}", &url[..s + 3], &url[at..]),
                None => url.to_owned(),
            }
        }
        _ => url.to_owned(),
    }
}

#[cfg(feature = "containers")]
mod containers {
    use std::sync::OnceLock;
    use testcontainers::runners::SyncRunner;
    use testcontainers::Container;

    pub fn postgres() -> Option<String> {
        static C: OnceLock<Container<testcontainers_modules::postgres::Postgres>> = OnceLock::new();
        let c = C.get_or_init(|| {
            testcontainers_modules::postgres::Postgres::default()
                .start()
                .expect("start a PostgreSQL container")
        });
        let port = c.get_host_port_ipv4(5432).expect("container port");
        Some(format!(
            "postgres://postgres:postgres@127.0.0.1:{port}/postgres"
        ))
    }

    pub fn rabbitmq() -> Option<String> {
        static C: OnceLock<Container<testcontainers_modules::rabbitmq::RabbitMq>> = OnceLock::new();
        let c = C.get_or_init(|| {
            testcontainers_modules::rabbitmq::RabbitMq::default()
                .start()
                .expect("start a RabbitMQ container")
        });
        let port = c.get_host_port_ipv4(5672).expect("container port");
        Some(format!("amqp://guest:guest@127.0.0.1:{port}"))
    }
}

#[cfg(not(feature = "containers"))]
mod containers {
    pub fn postgres() -> Option<String> {
        None
    }
    pub fn rabbitmq() -> Option<String> {
        None
    }
}

/// Whether the tests run as root: the servers they start of their own then run as their
/// own users (`postgres`, `rabbitmq`).
pub fn as_root() -> bool {
    std::process::Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

/// A port of 127.0.0.1 nothing listens on right now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

pub fn client() -> Client {
    Client::connect(&database_url(), NoTls).expect("connect to PostgreSQL")
}

pub fn pool(size: u32) -> Pool {
    let manager =
        PostgresConnectionManager::new(database_url().parse().expect("database URL"), NoTls);
    // Connections open on demand: parallel tests share PostgreSQL's max_connections.
    r2d2::Pool::builder()
        .max_size(size)
        .min_idle(Some(0))
        .build(manager)
        .expect("build pool")
}

/// A table name no other test (or earlier run) uses: `<prefix>_<pid>_<n>`.
pub fn unique_name(prefix: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "{prefix}_{}_{}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    )
}

/// Set to `partitioned` to run a suite on partitioned tables: every outbox `outbox` and
/// `builder` make is then partitioned (`OutboxBuilder::partition_interval`), by the longest
/// interval, so that no cut by the clock comes in the middle of a test; [`CUTS_VAR`] makes
/// cuts of its own in the tables `outbox` makes.
pub const TABLES_VAR: &str = "OUTBOX_TEST_TABLES";

/// Whether this run's outboxes are partitioned (see [`TABLES_VAR`]).
pub fn partitioned() -> bool {
    std::env::var(TABLES_VAR).is_ok_and(|kind| kind == "partitioned")
}

/// Whether a test of what holds on plain tables only should stop here, on a partitioned
/// run: it says so, and where the partitioned form is tested.
pub fn plain_only(why: &str) -> bool {
    if partitioned() {
        eprintln!("plain tables only ({why}); tests/partitions.rs tests partitioned tables");
    }
    partitioned()
}

/// An outbox builder of this run's kind of table (see [`TABLES_VAR`]).
pub fn builder() -> OutboxBuilder {
    let builder = Outbox::builder();
    if partitioned() {
        builder.partition_interval(Duration::from_secs(366 * 24 * 3600))
    } else {
        builder
    }
}

/// Drops `outbox`'s tables and functions: for a suite that makes many outboxes (the
/// model's, one per case), whose objects would overflow the lock table of the schema's
/// drop at exit.
pub fn drop_outbox(outbox: &Outbox, client: &mut Client) {
    let name = outbox
        .table()
        .rsplit('.')
        .next()
        .unwrap_or_default()
        .to_owned();
    let mut objects = |sql: &str| -> Vec<String> {
        client
            .query(sql, &[&schema(), &name])
            .expect("list the outbox's objects")
            .iter()
            .map(|r| r.get(0))
            .collect()
    };
    let owned = "(x = $2 OR starts_with(x, $2 || '_'))";
    let tables = objects(&format!(
        "SELECT c.oid::regclass::text FROM pg_class c, LATERAL (SELECT c.relname::text AS x) n
         WHERE c.relnamespace = $1::text::regnamespace AND c.relkind IN ('r', 'p')
           AND NOT c.relispartition AND {owned}"
    ));
    let functions = objects(&format!(
        "SELECT p.oid::regprocedure::text FROM pg_proc p, LATERAL (SELECT p.proname::text AS x) n
         WHERE p.pronamespace = $1::text::regnamespace AND {owned}"
    ));
    for table in tables {
        client
            .batch_execute(&format!("DROP TABLE IF EXISTS {table} CASCADE"))
            .expect("drop an outbox table");
    }
    for function in functions {
        client
            .batch_execute(&format!("DROP FUNCTION IF EXISTS {function} CASCADE"))
            .expect("drop an outbox function");
    }
}

/// What the catalog says of every object in `schema`, one line each, sorted: relations
/// (kind, options, partition bounds, grants), columns (type, collation, nullability,
/// identity, default), indexes, constraints, sequences, triggers and functions (signature,
/// result, language, rights, settings, grants and body), so that two schemas built apart
/// can be compared whole.
pub fn catalog(client: &mut Client, schema: &str) -> Vec<String> {
    client
        .query(CATALOG, &[&schema])
        .expect("read the catalog")
        .iter()
        .map(|row| row.get(0))
        .collect()
}

/// Fails naming the lines of one catalog (see [`catalog`]) that the other does not have.
pub fn assert_same_catalog(got: &[String], want: &[String]) {
    let only = |a: &[String], b: &[String]| -> Vec<String> {
        a.iter().filter(|line| !b.contains(line)).cloned().collect()
    };
    let (extra, missing) = (only(got, want), only(want, got));
    assert!(
        extra.is_empty() && missing.is_empty(),
        "not in the reference: {extra:#?}\nmissing: {missing:#?}"
    );
}

const CATALOG: &str = "SELECT line FROM (
    SELECT 'relation ' || c.relname || ' kind=' || c.relkind::text
           || ' persistence=' || c.relpersistence::text
           || ' options=' || coalesce(array_to_string(c.reloptions, ','), '')
           || ' bound=' || coalesce(pg_get_expr(c.relpartbound, c.oid), '')
           || ' key=' || coalesce(pg_get_partkeydef(c.oid), '')
           || ' acl=' || coalesce(c.relacl::text, '') AS line
    FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = $1
    UNION ALL
    SELECT 'column ' || c.relname || ' ' || a.attnum || ' ' || a.attname || ' '
           || format_type(a.atttypid, a.atttypmod) || ' collation=' || coalesce(co.collname, '')
           || ' notnull=' || a.attnotnull || ' identity=' || a.attidentity::text
           || ' default=' || coalesce(pg_get_expr(d.adbin, d.adrelid), '')
    FROM pg_attribute a
    JOIN pg_class c ON c.oid = a.attrelid
    JOIN pg_namespace n ON n.oid = c.relnamespace
    LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
    LEFT JOIN pg_collation co ON co.oid = a.attcollation
    WHERE n.nspname = $1 AND a.attnum > 0 AND NOT a.attisdropped AND c.relkind IN ('r', 'p')
    UNION ALL
    SELECT 'index ' || pg_get_indexdef(i.indexrelid)
    FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
    JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = $1
    UNION ALL
    SELECT 'constraint ' || c.relname || ' ' || k.conname || ' ' || pg_get_constraintdef(k.oid)
           || ' local=' || k.conislocal || ' inherited=' || k.coninhcount
    FROM pg_constraint k JOIN pg_class c ON c.oid = k.conrelid
    JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = $1
    UNION ALL
    SELECT 'sequence ' || s.seqrelid::regclass || ' ' || s.seqtypid::regtype || ' start='
           || s.seqstart || ' by=' || s.seqincrement || ' max=' || s.seqmax
    FROM pg_sequence s JOIN pg_class c ON c.oid = s.seqrelid
    JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = $1
    UNION ALL
    SELECT 'trigger ' || pg_get_triggerdef(t.oid)
    FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
    JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = $1 AND NOT t.tgisinternal
    UNION ALL
    SELECT 'function ' || p.oid::regprocedure || ' returns ' || pg_get_function_result(p.oid)
           || ' language=' || l.lanname || ' definer=' || p.prosecdef
           || ' volatile=' || p.provolatile::text || ' strict=' || p.proisstrict
           || ' config=' || coalesce(p.proconfig::text, '')
           || ' acl=' || coalesce(p.proacl::text, '')
           || E' body:\n' || p.prosrc
    FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
    JOIN pg_language l ON l.oid = p.prolang WHERE n.nspname = $1
) AS catalog ORDER BY line";

/// A freshly migrated outbox on its own table, of this run's kind (see [`TABLES_VAR`]),
/// cut in a run that cuts (see [`CUTS_VAR`]).
pub fn outbox(prefix: &str) -> (Outbox, Client) {
    let (outbox, client) = outbox_uncut(prefix);
    if cuts() {
        cut_often(&outbox);
    }
    (outbox, client)
}

/// As [`outbox`], never cut: for a test that looks into the partition its rows go to
/// (`_p0`) on a partitioned run.
pub fn outbox_uncut(prefix: &str) -> (Outbox, Client) {
    let outbox = builder()
        .table(unique_name(prefix))
        .build()
        .expect("valid table name");
    let mut client = client();
    outbox.migrate(&mut client).expect("migrate");
    (outbox, client)
}

/// Set to `1` beside `OUTBOX_TEST_TABLES=partitioned` to cut the open partition of every
/// outbox `outbox` makes, whatever the clock: every 400 ms, up to [`CUTS`] times a table,
/// so that the suites run across partitions (producers drawing ids on both sides of a cut,
/// relays claiming, fencing and parking rows in older partitions).
pub const CUTS_VAR: &str = "OUTBOX_TEST_CUTS";

/// Whether this run cuts its tables' partitions (see [`CUTS_VAR`]).
pub fn cuts() -> bool {
    partitioned() && std::env::var(CUTS_VAR).is_ok_and(|v| v == "1")
}

/// Cuts of each table in a run with [`CUTS_VAR`].
const CUTS: u32 = 5;

/// Registers `outbox` with this process's cutter, started on first use.
pub fn cut_often(outbox: &Outbox) {
    static TABLES: OnceLock<Mutex<Vec<(String, u32)>>> = OnceLock::new();
    let mut started = false;
    let tables = TABLES.get_or_init(|| {
        started = true;
        Mutex::new(Vec::new())
    });
    let partition_fn = quoted_with(outbox, "_partition");
    tables
        .lock()
        .expect("cutter's tables")
        .push((partition_fn, 0));
    if !started {
        return;
    }
    std::thread::spawn(move || {
        let mut client = client();
        loop {
            std::thread::sleep(Duration::from_millis(400));
            // Out of the lock while cutting: a test registering meanwhile need not wait.
            let round = std::mem::take(&mut *tables.lock().expect("cutter's tables"));
            let kept: Vec<_> = round
                .into_iter()
                .filter_map(|(partition_fn, cuts)| {
                    let cut = format!("SELECT {partition_fn}(true); SELECT {partition_fn}(false)");
                    let done = match client.batch_execute(&cut) {
                        Ok(()) => cuts + 1 >= CUTS,
                        // Gone with its test's table or schema.
                        Err(e)
                            if e.code().is_some_and(|code| {
                                [SqlState::UNDEFINED_FUNCTION, SqlState::INVALID_SCHEMA_NAME]
                                    .contains(code)
                            }) =>
                        {
                            true
                        }
                        Err(e) => {
                            eprintln!(
                                "the cutter could not cut {partition_fn}, and leaves it: {e}"
                            );
                            true
                        }
                    };
                    (!done).then_some((partition_fn, cuts + 1))
                })
                .collect();
            tables.lock().expect("cutter's tables").extend(kept);
            if client.is_closed() {
                client = self::client();
            }
        }
    });
}

/// Polls `condition` until it holds, failing the test after a generous deadline.
pub fn wait_until(what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !condition() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `stats()` where no relay changes the table meanwhile: on a table this small it must
/// count exactly, as `stats_exact()` does (the ages, read a moment apart, within a second).
pub fn stats(outbox: &Outbox, client: &mut Client) -> Stats {
    let bounded = outbox.stats(client).expect("stats");
    let exact = outbox.stats_exact(client).expect("stats_exact");
    assert!(bounded.exact && exact.exact, "{bounded:?}");
    let counts = |s: &Stats| {
        (
            s.pending,
            s.due,
            s.blocked,
            s.in_flight,
            s.sent,
            s.dead,
            s.parked,
        )
    };
    assert_eq!(
        counts(&bounded),
        counts(&exact),
        "stats against stats_exact"
    );
    for (what, a, b) in [
        (
            "oldest pending",
            bounded.oldest_pending_age,
            exact.oldest_pending_age,
        ),
        (
            "oldest blocked",
            bounded.oldest_blocked_age,
            exact.oldest_blocked_age,
        ),
    ] {
        match (a, b) {
            (None, None) => {}
            (Some(a), Some(b)) => assert!(
                a <= b && b - a < Duration::from_secs(1),
                "{what} age: {a:?} against {b:?}"
            ),
            _ => panic!("{what} age: {a:?} against {b:?}"),
        }
    }
    bounded
}

/// Status and attempts of the row with `key`.
pub fn row_state(client: &mut Client, outbox: &Outbox, key: &str) -> (String, i32) {
    let row = client
        .query_one(
            &format!(
                "SELECT status, attempts FROM {} WHERE key = $1",
                quoted(outbox)
            ),
            &[&key],
        )
        .expect("row exists");
    (row.get(0), row.get(1))
}

/// The outbox table, quoted for the tests' own SQL.
pub fn quoted(outbox: &Outbox) -> String {
    quoted_with(outbox, "")
}

/// The outbox's companion table `<table><suffix>` (`_inbox`, `_relays`), quoted.
pub fn quoted_with(outbox: &Outbox, suffix: &str) -> String {
    let table = format!("{}{suffix}", outbox.table());
    table
        .split('.')
        .map(|p| format!("\"{p}\""))
        .collect::<Vec<_>>()
        .join(".")
}

pub fn count(client: &mut Client, outbox: &Outbox, filter: &str) -> i64 {
    client
        .query_one(
            &format!("SELECT count(*) FROM {} WHERE {filter}", quoted(outbox)),
            &[],
        )
        .expect("count")
        .get(0)
}

/// Rows in every state for the operator tests: dead letters of two topics and three errors
/// (`d1`, `d3` ten days old; `d5` without an error), a sent row ten days old (`s1`), a
/// pending row (`p1`), and consumer `billing`'s dedupe record of `m1`.
pub fn operator_rows(client: &mut Client, outbox: &Outbox) {
    let mut tx = client.transaction().expect("begin");
    for (key, topic) in [
        ("d1", "orders"),
        ("d2", "orders"),
        ("d3", "invoices"),
        ("d4", "invoices"),
        ("d5", "orders"),
        ("s1", "orders"),
        ("p1", "orders"),
    ] {
        outbox
            .enqueue(&mut tx, postgres_outbox::Message::new(topic, "x").key(key))
            .expect("enqueue");
    }
    outbox.dedupe(&mut tx, "billing", "m1").expect("dedupe");
    tx.commit().expect("commit");
    let t = quoted(outbox);
    client
        .batch_execute(&format!(
            "UPDATE {t} SET status = 'dead', attempts = 3, done_at = now() - interval '10 days',
                            last_error = 'timeout talking to broker' WHERE key IN ('d1', 'd3');
             UPDATE {t} SET status = 'dead', attempts = 3, done_at = now(),
                            last_error = 'timeout talking to broker' WHERE key = 'd2';
             UPDATE {t} SET status = 'dead', attempts = 1, done_at = now(),
                            last_error = 'bad payload' WHERE key = 'd4';
             UPDATE {t} SET status = 'dead', attempts = 1, done_at = now(), last_error = NULL
             WHERE key = 'd5';
             UPDATE {t} SET status = 'sent', attempts = 1, done_at = now() - interval '10 days'
             WHERE key = 's1';"
        ))
        .expect("age the rows");
}

// ---------------------------------------------------------------------------------------------
// Relays with in-process publishers
// ---------------------------------------------------------------------------------------------

/// Pooled connections a default relay keeps: one per worker (4) and the listener's.
pub const RELAY_POOL: u32 = 5;

/// A relay configuration whose publishers call `publish` for every record. The closure is
/// shared by every publisher the factory builds.
pub fn relay_config(
    outbox: &Outbox,
    publish: impl Fn(&Record) -> Result<(), PublishError> + Send + Sync + 'static,
) -> RelayConfig {
    relay_config_with_pool(outbox, RELAY_POOL, publish)
}

pub fn relay_config_with_pool(
    outbox: &Outbox,
    pool_size: u32,
    publish: impl Fn(&Record) -> Result<(), PublishError> + Send + Sync + 'static,
) -> RelayConfig {
    relay_config_with(outbox, pool(pool_size), publish)
}

/// A relay config for `outbox` on `connections`, publishing through `publish`.
pub fn relay_config_with(
    outbox: &Outbox,
    connections: impl Into<Connections>,
    publish: impl Fn(&Record) -> Result<(), PublishError> + Send + Sync + 'static,
) -> RelayConfig {
    let publish = Arc::new(publish);
    RelayConfig::new(outbox.clone(), connections, move || {
        let publish = publish.clone();
        Ok::<_, Infallible>(publisher_fn(move |record: &Record| publish(record)))
    })
}

/// A gate publishers (or handlers) block at until the test opens it; it counts who waits.
#[derive(Clone, Default)]
pub struct Gate(Arc<GateInner>);

#[derive(Default)]
pub struct GateInner {
    open: Mutex<bool>,
    opened: Condvar,
    waiting: AtomicUsize,
}

impl Gate {
    /// Blocks until the gate is open.
    pub fn pass(&self) {
        let mut open = self.0.open.lock().unwrap();
        if !*open {
            self.0.waiting.fetch_add(1, Ordering::SeqCst);
            while !*open {
                open = self.0.opened.wait(open).unwrap();
            }
            self.0.waiting.fetch_sub(1, Ordering::SeqCst);
        }
    }

    pub fn open(&self) {
        *self.0.open.lock().unwrap() = true;
        self.0.opened.notify_all();
    }

    /// How many are blocked at the gate right now.
    pub fn waiting(&self) -> usize {
        self.0.waiting.load(Ordering::SeqCst)
    }
}

/// Every record a publisher was handed, in the order it was handed over.
#[derive(Clone, Default)]
pub struct Sink(Arc<Mutex<Vec<Record>>>);

impl Sink {
    pub fn push(&self, record: &Record) {
        self.0.lock().unwrap().push(record.clone());
    }

    pub fn len(&self) -> usize {
        self.0.lock().unwrap().len()
    }

    pub fn records(&self) -> Vec<Record> {
        self.0.lock().unwrap().clone()
    }

    pub fn keys(&self) -> Vec<String> {
        self.records().into_iter().map(|r| r.key).collect()
    }

    pub fn contains(&self, key: &str) -> bool {
        self.0.lock().unwrap().iter().any(|r| r.key == key)
    }

    /// A publisher body that records every record and succeeds.
    pub fn collect(&self) -> impl Fn(&Record) -> Result<(), PublishError> + Send + Sync + 'static {
        let sink = self.clone();
        move |record| {
            sink.push(record);
            Ok(())
        }
    }
}

/// Counts every metrics event.
#[derive(Clone, Default)]
pub struct Counters(Arc<CountersInner>);

#[derive(Default)]
pub struct CountersInner {
    claimed: AtomicUsize,
    published: AtomicUsize,
    failed: AtomicUsize,
    dead_lettered: AtomicUsize,
    released: AtomicUsize,
    downs: AtomicUsize,
    ups: AtomicUsize,
    stalls: AtomicUsize,
}

impl Counters {
    pub fn claimed(&self) -> usize {
        self.0.claimed.load(Ordering::SeqCst)
    }
    pub fn published(&self) -> usize {
        self.0.published.load(Ordering::SeqCst)
    }
    pub fn failed(&self) -> usize {
        self.0.failed.load(Ordering::SeqCst)
    }
    pub fn dead_lettered(&self) -> usize {
        self.0.dead_lettered.load(Ordering::SeqCst)
    }
    pub fn released(&self) -> usize {
        self.0.released.load(Ordering::SeqCst)
    }
    pub fn downs(&self) -> usize {
        self.0.downs.load(Ordering::SeqCst)
    }
    pub fn ups(&self) -> usize {
        self.0.ups.load(Ordering::SeqCst)
    }
    pub fn stalls(&self) -> usize {
        self.0.stalls.load(Ordering::SeqCst)
    }
}

impl Metrics for Counters {
    fn claimed(&self, n: usize) {
        self.0.claimed.fetch_add(n, Ordering::SeqCst);
    }
    fn published(&self, _record: &Record, _took: Duration) {
        self.0.published.fetch_add(1, Ordering::SeqCst);
    }
    fn failed(&self, _record: &Record, _error: &PublishError) {
        self.0.failed.fetch_add(1, Ordering::SeqCst);
    }
    fn dead_lettered(&self, _record: &Record) {
        self.0.dead_lettered.fetch_add(1, Ordering::SeqCst);
    }
    fn released(&self, n: usize) {
        self.0.released.fetch_add(n, Ordering::SeqCst);
    }
    fn publisher_down(&self, _cause: &(dyn std::error::Error + 'static)) {
        self.0.downs.fetch_add(1, Ordering::SeqCst);
    }
    fn publisher_up(&self) {
        self.0.ups.fetch_add(1, Ordering::SeqCst);
    }
    fn database_stalled(&self, _waited: Duration) {
        self.0.stalls.fetch_add(1, Ordering::SeqCst);
    }
}

/// A login role of a test's own, with the rights it is granted and no other: not the
/// owner's. Dropped, with what was granted to it, when it goes.
pub struct Role {
    pub name: String,
}

impl Role {
    /// A role that may log in and do nothing else yet.
    pub fn new(client: &mut Client) -> Role {
        let role = Role {
            name: unique_name("outbox_role"),
        };
        client
            .batch_execute(&format!("CREATE ROLE {} LOGIN PASSWORD 'role'", role.name))
            .expect("create a role");
        role
    }

    /// Grants it what `access` needs on `outbox`, as `Outbox::grants` gives it.
    pub fn grant(&self, client: &mut Client, outbox: &Outbox, access: Access) {
        let grants = outbox.grants(access, &self.name).expect("the grants");
        client.batch_execute(&grants).expect("grant");
    }

    /// Runs `sql`, in which `{role}` stands for this role.
    pub fn execute(&self, client: &mut Client, sql: &str) {
        client
            .batch_execute(&sql.replace("{role}", &self.name))
            .expect("a statement about the role");
    }

    pub fn config(&self) -> postgres::Config {
        let mut config: postgres::Config = database_url().parse().expect("database URL");
        config.user(&self.name).password("role");
        config
    }

    pub fn client(&self) -> Client {
        self.config().connect(NoTls).expect("connect as the role")
    }

    pub fn pool(&self) -> Pool {
        r2d2::Pool::builder()
            .max_size(RELAY_POOL)
            .min_idle(Some(0))
            .build(PostgresConnectionManager::new(self.config(), NoTls))
            .expect("the role's pool")
    }
}

impl Drop for Role {
    fn drop(&mut self) {
        let dropped =
            client().batch_execute(&format!("DROP OWNED BY {0}; DROP ROLE {0}", self.name));
        if let Err(e) = dropped {
            eprintln!("role {} left behind: {e}", self.name);
        }
    }
}
