//! An outbox that diagnoses its own table: dead tuples, vacuum, analyze and bloat, what holds
//! back the xmin horizon (an open transaction, a prepared one, a replication slot), rows left
//! due, and relays whose publisher is down.
//!
//! A queue table is written to and deleted from all day, so it lives on vacuum: anything
//! that keeps vacuum from removing dead row versions makes every claim read more of them.
//! [`Outbox::health`] reads the server's own statistics (a handful of catalog rows and one
//! index entry, whatever the backlog) and says, for each figure past its threshold, what
//! is wrong and what to do.

use std::fmt;
use std::time::{Duration, SystemTime};

use postgres::error::SqlState;
use postgres::Client;

use crate::error::Result;
use crate::operations::relays::{PublisherState, RelayReport};
use crate::producer::outbox::Outbox;
use crate::runtime::clock::seconds;
use crate::runtime::conn::count;
use crate::sql;

/// Where [`Outbox::health`] draws the line. The defaults suit a busy outbox; lower them to
/// hear sooner.
#[derive(Debug, Clone, PartialEq)]
pub struct HealthThresholds {
    dead_tuples: u64,
    dead_ratio: f64,
    transaction_age: Duration,
    prepared_age: Duration,
    slot_wal_bytes: u64,
    slot_xmin_age: i64,
    due_age: Duration,
    dead_letters: u64,
    parked: u64,
    vacuum_age: Duration,
    analyze_age: Duration,
    bloat_bytes: u64,
    bloat_ratio: f64,
}

impl Default for HealthThresholds {
    fn default() -> Self {
        HealthThresholds {
            dead_tuples: 10_000,
            dead_ratio: 0.2,
            transaction_age: Duration::from_secs(300),
            prepared_age: Duration::from_secs(60),
            slot_wal_bytes: 1 << 30,
            slot_xmin_age: 1_000_000,
            due_age: Duration::from_secs(60),
            dead_letters: 1,
            parked: 1,
            vacuum_age: Duration::from_secs(86_400),
            analyze_age: Duration::from_secs(86_400),
            bloat_bytes: 1 << 30,
            bloat_ratio: 0.5,
        }
    }
}

impl HealthThresholds {
    /// Dead letters not parked are a finding from `count` of them (default 1, as the
    /// alerting advice of docs/operations.md: each is a message nobody received); `u64::MAX` for never.
    pub fn dead_letters(mut self, count: u64) -> Self {
        self.dead_letters = count;
        self
    }

    /// Parked dead letters are a finding from `count` of them (default 1: each holds its
    /// aggregate until an operator redrives or skips it).
    pub fn parked(mut self, count: u64) -> Self {
        self.parked = count;
        self
    }

    /// A table has too many dead tuples past `count` of them and `ratio` of its live ones
    /// (default 10,000 and 0.2). The same two figures of rows changed since its last analyze
    /// make its statistics worth a look (see [`analyze_age`](Self::analyze_age)).
    pub fn dead_tuples(mut self, count: u64, ratio: f64) -> Self {
        self.dead_tuples = count;
        self.dead_ratio = ratio;
        self
    }

    /// A transaction holding the xmin horizon is a problem once open this long (default 5
    /// minutes).
    pub fn transaction_age(mut self, age: Duration) -> Self {
        self.transaction_age = age;
        self
    }

    /// A prepared transaction is a problem once this old (default 1 minute).
    pub fn prepared_age(mut self, age: Duration) -> Self {
        self.prepared_age = age;
        self
    }

    /// A replication slot nothing reads from is a problem once it keeps this much WAL
    /// (default 1 GiB), or at once when it holds an xmin.
    pub fn slot_wal_bytes(mut self, bytes: u64) -> Self {
        self.slot_wal_bytes = bytes;
        self
    }

    /// A replication slot read from is a problem once the xmin it holds is this many
    /// transactions old (default 1,000,000): its consumer holds vacuum back, a standby
    /// with `hot_standby_feedback` running a long query, say.
    pub fn slot_xmin_age(mut self, transactions: i64) -> Self {
        self.slot_xmin_age = transactions;
        self
    }

    /// Past [`dead_tuples`](Self::dead_tuples)' figures of dead tuples, a table vacuum has
    /// not visited for this long is a problem (default a day), and one never vacuumed, if
    /// autovacuum is off for it.
    pub fn vacuum_age(mut self, age: Duration) -> Self {
        self.vacuum_age = age;
        self
    }

    /// Past [`dead_tuples`](Self::dead_tuples)' figures of rows changed since, a table
    /// not analyzed for this long has stale statistics (default a day); at once when it was
    /// never analyzed and autovacuum is off for it.
    pub fn analyze_age(mut self, age: Duration) -> Self {
        self.analyze_age = age;
        self
    }

    /// A table's heap is bloated once `bytes` of it, and `ratio` of it, hold no live row
    /// (default 1 GiB and 0.5): space vacuum keeps for new rows but does not give back.
    pub fn bloat(mut self, bytes: u64, ratio: f64) -> Self {
        self.bloat_bytes = bytes;
        self.bloat_ratio = ratio;
        self
    }

    /// A row due this long and still not claimed means no relay claims, or the relays that
    /// do fall behind (default 1 minute; keep it above the relays' poll interval).
    pub fn due_age(mut self, age: Duration) -> Self {
        self.due_age = age;
        self
    }
}

/// What [`Outbox::health`] measured, and what it found wrong.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Health {
    /// The outbox table.
    pub outbox_table: TableHealth,
    /// The consumers' deduplication table.
    pub inbox_table: TableHealth,
    /// The oldest transaction of this database holding back the xmin horizon.
    pub oldest_transaction: Option<Holder>,
    /// The oldest prepared transaction.
    pub oldest_prepared: Option<Holder>,
    /// Every replication slot, the one holding the oldest xmin first.
    pub slots: Vec<Slot>,
    /// How long the oldest row a relay could take as it is has been due (rows without an
    /// aggregate key and aggregates' heads marked at enqueue).
    pub oldest_due_age: Option<Duration>,
    /// Dead letters (parked ones included), as [`Stats::dead`](crate::Stats::dead).
    pub dead_letters: u64,
    /// Parked dead letters, as [`Stats::parked`](crate::Stats::parked).
    pub parked: u64,
    /// What the relays of this outbox report of themselves (see [`Outbox::relays`]).
    pub relays: Vec<RelayReport>,
    /// A partitioned outbox's partitions, oldest first; empty for a plain table.
    pub partitions: Vec<Partition>,
    /// Figures past their thresholds, each with its remedy; empty when all is well.
    pub findings: Vec<Finding>,
}

impl Health {
    /// No finding.
    pub fn is_healthy(&self) -> bool {
        self.findings.is_empty()
    }
}

/// A table's figures from the server's statistics (`pg_stat_user_tables`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct TableHealth {
    /// The table's name, schema-qualified when it is not on the search path.
    pub table: String,
    /// Estimated live row versions.
    pub live_tuples: u64,
    /// Estimated dead row versions: deleted or updated rows vacuum has not removed yet.
    pub dead_tuples: u64,
    /// Since the last vacuum, manual or auto; `None` if never.
    pub since_vacuum: Option<Duration>,
    /// Since the last analyze, manual or auto; `None` if never.
    pub since_analyze: Option<Duration>,
    /// Rows inserted, updated or deleted since the last analyze.
    pub changed_since_analyze: u64,
    /// Whether autovacuum visits it: the server's `autovacuum` is on, and
    /// `autovacuum_enabled` is not off for it (or for any of its partitions).
    pub autovacuum: bool,
    /// The size of its rows' file (the heap, without indexes or TOAST), in bytes, as the
    /// last vacuum or analyze found it (the catalog's figure: reading the file's size would
    /// wait behind a `VACUUM FULL` or a partition's drop); 0 before the first.
    pub heap_bytes: u64,
    /// Its size with its indexes and TOAST, in bytes, as the last vacuum or analyze found
    /// it.
    pub total_bytes: u64,
    /// An estimate of the heap's bytes that hold no live row (dead row versions, and the
    /// space vacuum freed but keeps): the heap less its rows at the width the last analyze
    /// measured. `None` until an analyze has measured every column, or where the role may
    /// not read them all (the width of some would make the rows narrower than they are).
    pub unused_heap_bytes: Option<u64>,
}

/// A partition of a partitioned outbox (see `OutboxBuilder::partition_interval`).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Partition {
    /// Its number: it holds ids from `number << sql::PARTITION_ID_BITS` (40) to the next
    /// partition's first.
    pub number: i64,
    /// How long it stays open once new rows go to it.
    pub every: Duration,
    /// Since new rows began to go to it; `None` while it waits ahead.
    pub opened: Option<Duration>,
    /// Since new rows went to the next one instead; `None` while it is open or ahead.
    pub closed: Option<Duration>,
    /// Whether its table exists (a partition ahead that could not be made does not).
    pub exists: bool,
    /// Its rows, as the planner last estimated them.
    pub rows: u64,
    /// Since it settled: closed, every row in it sent, and no producer left that may still
    /// write into it. `None` while it may hold a backlog or a dead letter: unless it is
    /// quiet (only dead letters left), every `stats()` and every enqueue's look for an
    /// aggregate's earlier messages read it.
    pub settled: Option<Duration>,
    /// For the oldest closed partition not settled: what keeps it from settling. The
    /// upkeep settles partitions oldest first, so it holds back every one after it too.
    /// `None` for every other partition.
    pub held_back: Option<HeldBack>,
    /// Closed, no producer left that may still write into it, and no pending or parked
    /// row in it: enqueues' looks leave it out (sql/functions/partitions.sql).
    pub(crate) quiet: bool,
}

impl Partition {
    /// New rows go to it now.
    pub fn is_open(&self) -> bool {
        self.opened.is_some() && self.closed.is_none()
    }
}

/// What keeps a closed partition from settling (see [`Partition::held_back`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum HeldBack {
    /// Dead letters or parked messages kept in it: this many, counted up to 1,000. They
    /// stay until they are redriven and sent, skipped or purged; retention keeps the
    /// partition whole meanwhile, its sent rows with it.
    Kept(u64),
    /// Messages still to be sent: the relays have not reached them yet, or they are
    /// scheduled for later. Retention keeps the partition whole meanwhile.
    Pending,
    /// No such row, but a transaction that was running when the upkeep first found it
    /// closed, or a prepared transaction, may still write into it.
    Transactions,
    /// Nothing in it: the upkeep has not looked at it since its cut, or not since what held
    /// it ended. No relay runs on the table, or its upkeep fails (its log says why).
    NoUpkeep,
}

/// Something holding the xmin horizon: a backend (`id` its pid) or a prepared transaction
/// (`id` its gid).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Holder {
    /// The pid or the gid.
    pub id: String,
    /// How long it has been open.
    pub age: Duration,
    /// Who it is: the application name and state, or the database.
    pub what: String,
}

/// A replication slot.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Slot {
    /// The slot's name.
    pub name: String,
    /// The age, in transactions, of the xmin (or catalog xmin) it holds, if it holds one.
    pub xmin_age: Option<i64>,
    /// The WAL it keeps, in bytes.
    pub wal_bytes: u64,
    /// Whether something reads from it now.
    pub active: bool,
    /// The pid of the process reading from it (a walsender), while one does.
    pub active_pid: Option<u32>,
    /// `physical` or `logical`; or `feedback`: no slot, but a standby whose
    /// `hot_standby_feedback` holds an xmin on its walsender (`name` is the standby's
    /// `application_name`).
    pub kind: String,
}

/// What a finding is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Check {
    /// Dead tuples in the outbox or inbox table.
    DeadTuples,
    /// Dead tuples that vacuum does not visit: autovacuum is off for the table, or has not
    /// come for long.
    Vacuum,
    /// Statistics the planner chooses plans on, stale: many rows changed since the last
    /// analyze, long ago or never.
    Analyze,
    /// Space in the heap holding no live row, kept by the table for new rows but not given
    /// back.
    Bloat,
    /// A long open transaction.
    Transaction,
    /// An old prepared transaction.
    PreparedTransaction,
    /// A replication slot nothing reads from, or one whose reader holds an old xmin.
    ReplicationSlot,
    /// Rows due and not claimed.
    Due,
    /// Dead letters wait for an operator: messages nobody received.
    DeadLetters,
    /// Parked dead letters hold their aggregates.
    Parked,
    /// A relay reports that its publisher does not reach the destination.
    Publisher,
    /// Relays reported, and none has for a while: they stopped without saying so.
    Relays,
    /// A partitioned outbox lacks a partition ahead, or its open one is long past its
    /// interval: no relay keeps them. Or a closed one has not settled within its interval
    /// (see [`Partition::held_back`]).
    Partitions,
}

impl Check {
    /// A short name: `dead_tuples`, `vacuum`, `analyze`, `bloat`, `transaction`,
    /// `prepared_transaction`, `replication_slot`, `due`, `dead_letters`, `parked`,
    /// `publisher`, `relays`, `partitions`.
    pub fn name(self) -> &'static str {
        match self {
            Check::DeadTuples => "dead_tuples",
            Check::Vacuum => "vacuum",
            Check::Analyze => "analyze",
            Check::Bloat => "bloat",
            Check::Transaction => "transaction",
            Check::PreparedTransaction => "prepared_transaction",
            Check::ReplicationSlot => "replication_slot",
            Check::Due => "due",
            Check::DeadLetters => "dead_letters",
            Check::Parked => "parked",
            Check::Publisher => "publisher",
            Check::Relays => "relays",
            Check::Partitions => "partitions",
        }
    }
}

/// A figure past its threshold.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Finding {
    /// What it is about.
    pub check: Check,
    /// What is wrong, with the figure.
    pub problem: String,
    /// What to do, in one line.
    pub remedy: String,
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.problem, self.remedy)
    }
}

/// Who keeps a partitioned outbox's partitions, and the rights it takes.
fn run_upkeep(outbox: &Outbox) -> String {
    format!(
        "run a relay on {0} as its owner, or as a role given `postgres-outbox --table {0} \
         grants relay <role>` (docs/grants.md)",
        outbox.table()
    )
}

/// Dead or parked rows as counted, up to 1,000.
fn kept_rows(kept: u64) -> String {
    match kept {
        1 => "1 dead letter or parked message".to_owned(),
        1000.. => "1,000 or more dead letters or parked messages".to_owned(),
        kept => format!("{kept} dead letters or parked messages"),
    }
}

fn whole(age: Duration) -> String {
    format!("{}s", age.as_secs())
}

impl Outbox {
    /// Diagnoses the outbox with the default [`HealthThresholds`]; see
    /// [`health_with`](Outbox::health_with).
    pub fn health(&self, client: &mut Client) -> Result<Health> {
        self.health_with(client, &HealthThresholds::default())
    }

    /// Diagnoses the outbox: dead tuples, the last vacuum and analyze (and whether autovacuum
    /// visits), and the space holding no live row of its tables, the oldest transaction and
    /// prepared transaction holding back the xmin horizon, the replication slots and
    /// standbys holding one, how long the oldest ready row has been due, and what the relays
    /// report (a publisher down; claims that do not keep up; reports that stopped coming).
    /// Every figure past `thresholds` is a [`Finding`] with its remedy. Its cost does not
    /// grow with the table: catalog rows and one index entry.
    ///
    /// ```no_run
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let mut client = postgres::Client::connect("postgres://postgres@localhost/app", postgres::NoTls)?;
    /// let health = postgres_outbox::Outbox::new("orders_outbox")?.health(&mut client)?;
    /// for finding in &health.findings {
    ///     eprintln!("{finding}");
    /// }
    /// # Ok(())
    /// # }
    /// ```
    pub fn health_with(
        &self,
        client: &mut Client,
        thresholds: &HealthThresholds,
    ) -> Result<Health> {
        let sql = self.statements();
        let names = [sql.table().quoted(), sql.table().companion("_inbox")];
        let mut tables = client
            .query(sql::HEALTH_TABLES, &[&names[0], &names[1]])
            .map_err(|e| self.db_error(e))?
            .into_iter()
            .map(|row| TableHealth {
                table: row.get(0),
                live_tuples: count(&row, 1),
                dead_tuples: count(&row, 2),
                since_vacuum: seconds(row.get(3)),
                since_analyze: seconds(row.get(4)),
                changed_since_analyze: count(&row, 5),
                autovacuum: row.get(6),
                heap_bytes: count(&row, 7),
                total_bytes: count(&row, 8),
                unused_heap_bytes: row
                    .get::<_, Option<i64>>(9)
                    .map(|bytes| u64::try_from(bytes).unwrap_or(0)),
            });
        let outbox_table = tables.next().unwrap_or_default();
        let inbox_table = tables.next().unwrap_or_default();
        let holder = |statement: &str, client: &mut Client| -> Result<Option<Holder>> {
            Ok(client
                .query_opt(statement, &[])
                .map_err(|e| self.db_error(e))?
                .map(|row| Holder {
                    id: row.get(0),
                    age: seconds(row.get(1)).unwrap_or_default(),
                    what: row.get(2),
                }))
        };
        let oldest_transaction = holder(sql::HEALTH_TRANSACTION, client)?;
        let oldest_prepared = holder(sql::HEALTH_PREPARED, client)?;
        let slots = client
            .query(sql::HEALTH_SLOTS, &[])
            .map_err(|e| self.db_error(e))?
            .into_iter()
            .map(|row| Slot {
                name: row.get(0),
                xmin_age: row.get(1),
                wal_bytes: count(&row, 2),
                kind: row.get(3),
                active: row.get(4),
                active_pid: row
                    .get::<_, Option<i32>>(5)
                    .and_then(|pid| u32::try_from(pid).ok()),
            })
            .collect();
        let oldest_due_age = self.oldest_due_age(client)?;
        // Exact whatever the backlog (the dead-letter index and a counter).
        let counted = self.stats(client)?;
        let relays = self.relays(client)?;
        let mut partitions: Vec<Partition> = client
            .query(&sql.partitions, &[])
            .map_err(|e| self.db_error(e))?
            .into_iter()
            .map(|row| Partition {
                number: row.get(0),
                every: seconds(row.get(1)).unwrap_or_default(),
                opened: seconds(row.get(2)),
                closed: seconds(row.get(3)),
                exists: row.get(4),
                rows: count(&row, 5),
                settled: seconds(row.get(6)),
                held_back: None,
                quiet: row.get(7),
            })
            .collect();
        // A partition dropped by hand holds nothing back.
        if let Some(oldest) = partitions
            .iter_mut()
            .find(|p| p.closed.is_some() && p.settled.is_none() && p.exists)
        {
            let ids = (
                sql::first_id(oldest.number),
                sql::first_id(oldest.number + 1),
            );
            let row = client
                .query_opt(&sql.partition_left, &[&ids.0, &ids.1, &oldest.number])
                .map_err(|e| self.db_error(e))?;
            // None: it settled, or was dropped, since the list was read.
            oldest.held_back = row.map(|row| match (count(&row, 0), row.get(1), row.get(2)) {
                (0, false, true) => HeldBack::Transactions,
                (0, false, false) => HeldBack::NoUpkeep,
                (0, true, _) => HeldBack::Pending,
                (kept, _, _) => HeldBack::Kept(kept),
            });
        }
        let mut health = Health {
            outbox_table,
            inbox_table,
            oldest_transaction,
            oldest_prepared,
            slots,
            oldest_due_age,
            dead_letters: counted.dead,
            parked: counted.parked,
            relays,
            partitions,
            findings: Vec::new(),
        };
        health.findings = findings(self, &health, thresholds);
        Ok(health)
    }
}

fn findings(outbox: &Outbox, health: &Health, limits: &HealthThresholds) -> Vec<Finding> {
    let mut found = Vec::new();
    let mut finding = |check, problem: String, remedy: String| {
        found.push(Finding {
            check,
            problem,
            remedy,
        })
    };
    for table in [&health.outbox_table, &health.inbox_table] {
        let (name, dead) = (&table.table, table.dead_tuples);
        // Rows past the dead tuples' figures: dead ones, or changed since an analyze.
        let many = |rows: u64| {
            rows > limits.dead_tuples && rows as f64 > limits.dead_ratio * table.live_tuples as f64
        };
        // Not for `age`: a table never vacuumed (or analyzed) with autovacuum on is one
        // autovacuum has yet to reach (it comes at a share of the table, as the figures
        // above); one done lately with autovacuum off is done by hand.
        let overdue = |since: Option<Duration>, age: Duration| match since {
            Some(since) => since >= age,
            None => !table.autovacuum,
        };
        let last = |since: Option<Duration>, done: &str| {
            since.map_or(format!("never {done}"), |age| {
                format!("last {done} {} ago", whole(age))
            })
        };
        let vacuumed = last(table.since_vacuum, "vacuumed");
        if many(dead) {
            finding(
                Check::DeadTuples,
                format!(
                    "{name} holds {dead} dead tuples against {} live ({vacuumed})",
                    table.live_tuples
                ),
                format!(
                    "run VACUUM (ANALYZE) {name}; if they come back at once, end what holds the \
                     xmin horizon (an old transaction, a prepared transaction, a slot)"
                ),
            );
        }
        if many(dead) && overdue(table.since_vacuum, limits.vacuum_age) {
            let (why, remedy) = if table.autovacuum {
                (
                    "autovacuum has not come",
                    format!(
                        "run VACUUM (ANALYZE) {name}, then see why autovacuum does not: its \
                         workers busy on larger tables (autovacuum_max_workers), or held back by \
                         its cost limit (autovacuum_vacuum_cost_limit)"
                    ),
                )
            } else {
                (
                    "autovacuum is off for it",
                    format!(
                        "turn autovacuum on (autovacuum = on in the server's configuration, and \
                         ALTER TABLE ... RESET (autovacuum_enabled) for {name} or its \
                         partitions), or run VACUUM (ANALYZE) {name} on a schedule"
                    ),
                )
            };
            finding(
                Check::Vacuum,
                format!("{name} holds {dead} dead tuples and {why} ({vacuumed})"),
                remedy,
            );
        }
        let changed = table.changed_since_analyze;
        if many(changed) && overdue(table.since_analyze, limits.analyze_age) {
            let analyzed = last(table.since_analyze, "analyzed");
            finding(
                Check::Analyze,
                format!(
                    "{name} has {changed} rows changed since its statistics were taken \
                     ({analyzed}): its statements are planned on figures that no longer hold"
                ),
                format!(
                    "run ANALYZE {name}; {}",
                    if table.autovacuum {
                        "autovacuum analyzes it once enough rows change, unless its workers are \
                         busy elsewhere (autovacuum_max_workers)"
                    } else {
                        "autovacuum, which would analyze it, is off for it"
                    }
                ),
            );
        }
        if let Some(unused) = table.unused_heap_bytes {
            if unused >= limits.bloat_bytes
                && unused as f64 >= limits.bloat_ratio * table.heap_bytes as f64
            {
                finding(
                    Check::Bloat,
                    format!(
                        "{name} takes {} MiB for its rows, about {} MiB of it holding none (an \
                         estimate from its statistics): space vacuum keeps for new rows but does \
                         not give back",
                        table.heap_bytes >> 20,
                        unused >> 20
                    ),
                    format!(
                        "once nothing holds the xmin horizon, rewrite it: pg_repack, or VACUUM \
                         FULL {name} (which locks it for as long as it runs); a partitioned \
                         outbox gives the space back as retention drops its partitions"
                    ),
                );
            }
        }
    }
    if let Some(tx) = &health.oldest_transaction {
        if tx.age >= limits.transaction_age {
            finding(
                Check::Transaction,
                format!(
                    "backend {} ({}) has held a transaction open for {}: vacuum keeps every row \
                     version since",
                    tx.id,
                    tx.what,
                    whole(tx.age)
                ),
                format!(
                    "end it (SELECT pg_terminate_backend({})), and set \
                     idle_in_transaction_session_timeout",
                    tx.id
                ),
            );
        }
    }
    if let Some(prepared) = &health.oldest_prepared {
        if prepared.age >= limits.prepared_age {
            finding(
                Check::PreparedTransaction,
                format!(
                    "prepared transaction '{}' ({}) is {} old: it holds the xmin horizon until \
                     it ends",
                    prepared.id,
                    prepared.what,
                    whole(prepared.age)
                ),
                format!(
                    "COMMIT PREPARED or ROLLBACK PREPARED '{}' (from its database), once its \
                     coordinator is known to be gone",
                    prepared.id
                ),
            );
        }
    }
    for slot in &health.slots {
        let name = &slot.name;
        if !slot.active && (slot.xmin_age.is_some() || slot.wal_bytes >= limits.slot_wal_bytes) {
            let xmin = slot.xmin_age.map_or(String::new(), |age| {
                format!(", holds an xmin {age} transactions old")
            });
            finding(
                Check::ReplicationSlot,
                format!(
                    "replication slot {name} ({}, inactive) keeps {} bytes of WAL{xmin}",
                    slot.kind, slot.wal_bytes
                ),
                format!(
                    "start its consumer again, or drop it: SELECT \
                     pg_drop_replication_slot('{name}')"
                ),
            );
        }
        let old = slot.xmin_age.filter(|&age| age >= limits.slot_xmin_age);
        if let (true, Some(age)) = (slot.active, old) {
            let pid = slot.active_pid.unwrap_or_default();
            let holder = if slot.kind == "feedback" {
                format!(
                    "standby {name} (its walsender pid {pid}, hot_standby_feedback without a slot)"
                )
            } else {
                format!("replication slot {name} ({}, read by pid {pid})", slot.kind)
            };
            // A logical slot's is a catalog xmin: it holds back the catalogs alone.
            let kept = if slot.kind == "logical" {
                "the system catalogs' row versions"
            } else {
                "every row version"
            };
            finding(
                Check::ReplicationSlot,
                format!("{holder} holds an xmin {age} transactions old: vacuum keeps {kept} since"),
                "its reader holds it back: a standby with hot_standby_feedback running a long \
                 query (end it there, or bound it with max_standby_streaming_delay), or a \
                 logical consumer that has fallen behind"
                    .to_owned(),
            );
        }
    }
    if let Some(age) = health.oldest_due_age.filter(|&age| age >= limits.due_age) {
        // The relay that claimed last, if any claims at all.
        let claiming = health
            .relays
            .iter()
            .filter(|r| r.is_claiming())
            .min_by_key(|r| r.since_claim);
        match claiming {
            Some(relay) => finding(
                Check::Due,
                format!(
                    "{} has had a row due for {} though its relays claim (pid {}, {} ago): \
                     they do not keep up",
                    outbox.table(),
                    whole(age),
                    relay.pid,
                    whole(relay.since_claim.unwrap_or_default())
                ),
                "give the relays more workers (concurrency) or run more of them, and see \
                 where their cycles go (Metrics::cycle): a publisher that takes long, or \
                 claims that do"
                    .to_owned(),
            ),
            None => finding(
                Check::Due,
                format!(
                    "{} has had a row due for {} that no relay claimed{}",
                    outbox.table(),
                    whole(age),
                    match health.relays.iter().filter(|r| r.is_reporting()).count() {
                        0 => String::new(),
                        n => format!(
                            " ({n} reporting, none a claim within its poll interval, or a \
                             relay of a build before 0.3.0, which does not report its claims)"
                        ),
                    }
                ),
                "check that a relay runs against this table and reaches the database (its log, \
                 Relay::is_listening); a relay that keeps up claims within its poll interval"
                    .to_owned(),
            ),
        }
    }
    let t = outbox.table();
    let unparked = health.dead_letters.saturating_sub(health.parked);
    if unparked >= limits.dead_letters {
        finding(
            Check::DeadLetters,
            format!(
                "{t} holds {unparked} dead letter{}: messages nobody received",
                if unparked == 1 { "" } else { "s" }
            ),
            format!(
                "see why (postgres-outbox --table {t} dead --by-error), fix the cause, then \
                 redrive them, or purge them once they are not wanted"
            ),
        );
    }
    if health.parked >= limits.parked {
        let n = health.parked;
        finding(
            Check::Parked,
            format!(
                "{t} has {n} parked dead letter{}: {} waits for an operator",
                if n == 1 { "" } else { "s" },
                if n == 1 {
                    "its aggregate"
                } else {
                    "their aggregates"
                }
            ),
            format!(
                "postgres-outbox --table {t} dead --parked, then redrive (it goes first) or \
                 skip (its aggregate goes on without it)"
            ),
        );
    }
    for relay in health.relays.iter().filter(|r| r.is_reporting()) {
        if let PublisherState::Down { since } = relay.publisher {
            let down = SystemTime::now().duration_since(since).unwrap_or_default();
            finding(
                Check::Publisher,
                format!(
                    "relay {} (pid {}{}) cannot publish: its destination has been down for {}",
                    relay.relay,
                    relay.pid,
                    relay
                        .client_addr
                        .as_ref()
                        .map_or(String::new(), |a| format!(" at {a}")),
                    whole(down)
                ),
                "check the broker and the relay's log; it claims nothing meanwhile and tries \
                 again with backoff, and nothing is lost or charged an attempt"
                    .to_owned(),
            );
        }
    }
    if let Some(open) = health.partitions.iter().find(|p| p.is_open()) {
        let upkeep = format!(
            "{}: it keeps the partitions every few seconds (or SELECT {}_partition(false) now)",
            run_upkeep(outbox),
            outbox.table()
        );
        let ahead = health
            .partitions
            .iter()
            .filter(|p| p.number > open.number && p.exists)
            .count();
        if ahead == 0 {
            finding(
                Check::Partitions,
                format!(
                    "{} has no partition ahead of the open one (partition {}): the next cut \
                     cannot happen",
                    outbox.table(),
                    open.number
                ),
                upkeep.clone(),
            );
        }
        let open_for = open.opened.unwrap_or_default();
        if open_for > open.every * 2 {
            finding(
                Check::Partitions,
                format!(
                    "partition {} of {} has been open for {}, its interval {}: no cut \
                     happened, so retention cannot drop its rows",
                    open.number,
                    outbox.table(),
                    whole(open_for),
                    whole(open.every)
                ),
                upkeep,
            );
        }
    }
    let held = health
        .partitions
        .iter()
        .find_map(|p| Some((p, p.held_back?)));
    if let Some((partition, held_back)) = held {
        let closed = partition.closed.unwrap_or_default();
        if closed > partition.every {
            // The partitions after `n`, the first not quiet, that a producer's look reads:
            // the next ones not quiet alone, and every one from the one after them on
            // (`LOOK_RANGES`). stats() reads the partitions not quiet alone
            // (`BACKLOG_RANGES`).
            let after = |n: i64| {
                let not_quiet = |p: &&Partition| p.closed.is_none() || !p.quiet;
                let partitions = health.partitions.iter();
                let mut later = partitions.filter(|p| p.number > n).filter(not_quiet);
                let alone = later.by_ref().take(sql::LOOK_RANGES - 2);
                let alone = alone.filter(|p| p.exists).count();
                later.next().map_or(alone, |rest| {
                    let partitions = health.partitions.iter();
                    let rest = partitions.filter(|p| p.number >= rest.number && p.exists);
                    alone + rest.count()
                })
            };
            let retention = "retention keeps it whole, its sent rows with it, and ";
            // Dead letters alone leave it quiet: stats() counts them once (see
            // sql/functions/partitions.sql), topic_stats() reads it alone for them, and
            // enqueues read from the first closed partition not quiet, if any.
            let looked = health.partitions.iter().find(|p| {
                p.number > partition.number && p.closed.is_some() && p.exists && !p.quiet
            });
            let reads = match (partition.quiet, looked) {
                (false, _) => format!(
                    "each enqueue with an aggregate key reads it and {} partitions after \
                     it, and each stats() reads it",
                    after(partition.number)
                ),
                (true, looked) => format!(
                    "each topic_stats() reads it for its dead letters{}",
                    looked.map_or_else(String::new, |p| format!(
                        ", and each enqueue with an aggregate key reads partition {} and {} \
                         partitions after it",
                        p.number,
                        after(p.number)
                    ))
                ),
            };
            let (why, retention, remedy) = match held_back {
                HeldBack::Kept(kept) => (
                    format!("it keeps {}", kept_rows(kept)),
                    retention,
                    "look at them (postgres-outbox dead, oldest first), then redrive, skip or \
                     purge them"
                        .to_owned(),
                ),
                HeldBack::Pending => (
                    "it still has messages to send".to_owned(),
                    retention,
                    "check that a relay runs against this table and keeps up (postgres-outbox \
                     stats); a message enqueued with a long delay holds its partition until \
                     it is sent"
                        .to_owned(),
                ),
                HeldBack::Transactions => (
                    "a transaction that was running when it was cut, or a prepared \
                     transaction, may still write into it"
                        .to_owned(),
                    "",
                    "end the old transactions (pg_stat_activity: xact_start) and prepared \
                     transactions (pg_prepared_xacts); the doctor names the oldest of each past \
                     its threshold"
                        .to_owned(),
                ),
                HeldBack::NoUpkeep => (
                    "nothing is left in it, but no upkeep has settled it".to_owned(),
                    "",
                    format!(
                        "{} (it logs why an upkeep fails), or SELECT {1}_partition(false), \
                         {1}_settle()",
                        run_upkeep(outbox),
                        outbox.table()
                    ),
                ),
            };
            finding(
                Check::Partitions,
                format!(
                    "partition {} of {}, closed {} ago, has not settled: {why}. Until it \
                     does, {retention}{reads}",
                    partition.number,
                    outbox.table(),
                    whole(closed)
                ),
                remedy,
            );
        }
    }
    let failing: Vec<_> = health
        .relays
        .iter()
        .filter(|r| r.is_reporting())
        .filter_map(|r| Some((r, r.upkeep_error.as_ref()?)))
        .collect();
    if let Some((first, error)) = failing.first() {
        finding(
            Check::Partitions,
            format!(
                "{} of the relays of {} failed to keep its partitions at their last report \
                 (pid {}: {error}): while that lasts, no cut happens and no partition is made \
                 ahead",
                failing.len(),
                outbox.table(),
                first.pid
            ),
            if error.starts_with(&format!("[{}]", SqlState::INSUFFICIENT_PRIVILEGE.code())) {
                run_upkeep(outbox)
            } else {
                "see the relay's log; it tries again at its next report, every few seconds"
                    .to_owned()
            },
        );
    }
    if let Some(last) = health.relays.iter().min_by_key(|r| r.last_seen) {
        if !last.is_reporting() {
            finding(
                Check::Relays,
                format!(
                    "no relay of {} has reported for {} (the last: pid {}): they stopped \
                     without saying so, or hang",
                    outbox.table(),
                    whole(last.last_seen),
                    last.pid
                ),
                "start a relay (what the dead one held comes back when its leases run out); \
                 reports of relays gone a day are forgotten"
                    .to_owned(),
            );
        }
    }
    found
}
