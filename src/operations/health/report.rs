//! What `Outbox::health` reports: the figures it read and its findings, and the
//! thresholds it holds them to.

use std::fmt;
use std::time::Duration;

use crate::operations::relays::RelayReport;

/// Where [`Outbox::health`](crate::Outbox::health) draws the line. The defaults suit a busy outbox; lower them to
/// hear sooner.
#[derive(Debug, Clone, PartialEq)]
pub struct HealthThresholds {
    pub(super) dead_tuples: u64,
    pub(super) dead_ratio: f64,
    pub(super) transaction_age: Duration,
    pub(super) prepared_age: Duration,
    pub(super) slot_wal_bytes: u64,
    pub(super) slot_xmin_age: i64,
    pub(super) due_age: Duration,
    pub(super) dead_letters: u64,
    pub(super) parked: u64,
    pub(super) vacuum_age: Duration,
    pub(super) analyze_age: Duration,
    pub(super) bloat_bytes: u64,
    pub(super) bloat_ratio: f64,
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

/// What [`Outbox::health`](crate::Outbox::health) measured, and what it found wrong.
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
    /// What the relays of this outbox report of themselves (see [`Outbox::relays`](crate::Outbox::relays)).
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
    /// Its number: it holds ids from `number << PARTITION_ID_BITS` (40) to the next
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
