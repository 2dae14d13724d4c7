//! What running relays say about themselves: each keeps a row in `<table>_relays`, written
//! every few seconds on a connection it already holds (see sql/0007_since_0_2_0.sql).

use std::time::{Duration, SystemTime};

use postgres::GenericClient;

use crate::error::Result;
use crate::operations::sql::health::HealthSql;
use crate::producer::outbox::Outbox;
use crate::runtime::clock::seconds;
use crate::runtime::conn::count;

/// How often a relay writes its report, and at once when its publisher goes up or down.
pub(crate) const REPORT_EVERY: Duration = Duration::from_secs(5);
/// A relay that has not reported for this long has stopped or hangs.
const GONE_AFTER: Duration = Duration::from_secs(60);

/// Whether a relay's publishers reach their destination.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PublisherState {
    /// Nothing published or failed yet.
    Unknown,
    /// Its last publish (or probe of the destination) worked.
    Up,
    /// Failing since `since`.
    Down {
        /// When the destination went down, as the relay saw it.
        since: SystemTime,
    },
}

impl PublisherState {
    /// `unknown`, `up` or `down`.
    pub fn name(self) -> &'static str {
        match self {
            PublisherState::Unknown => "unknown",
            PublisherState::Up => "up",
            PublisherState::Down { .. } => "down",
        }
    }
}

/// One relay's report of itself, from [`Outbox::relays`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RelayReport {
    /// The relay's id, new at every `Relay::spawn`.
    pub relay: String,
    /// The relay's address as the database saw it (none over a Unix socket).
    pub client_addr: Option<String>,
    /// The relay's process id on its host.
    pub pid: u32,
    /// When it was spawned.
    pub started_at: SystemTime,
    /// How long ago it last reported: more than a few seconds, and the relay is stuck or
    /// gone (a relay that died keeps its row until another forgets it, after a day).
    pub last_seen: Duration,
    /// Whether its publishers reach their destination.
    pub publisher: PublisherState,
    /// Rows it published since it started.
    pub published: u64,
    /// Why its last upkeep of a partitioned table's partitions failed (a role not granted
    /// it, say; see docs/grants.md): the server's SQLSTATE in brackets,
    /// then the error's text; none once one works.
    pub upkeep_error: Option<String>,
    /// How long ago its workers last had a claim answered, taking rows or not, as its last
    /// report tells (a claim after that report shows at the next one); the report's part
    /// by the relay's own clock, zero if a worker held claimed rows then (a long cycle is
    /// work). `None` before its first claim, or from a relay of a build before 0.3.0. An
    /// idle relay claims once per poll interval.
    pub since_claim: Option<Duration>,
    /// Its poll interval; `None` from a relay of a build before 0.3.0.
    pub poll_interval: Option<Duration>,
}

impl RelayReport {
    /// It reported within the last minute (relays report every five seconds): it runs.
    pub fn is_reporting(&self) -> bool {
        self.last_seen < GONE_AFTER
    }

    /// It reports, and claimed within its poll interval and two reports' time (a report
    /// gives its last claim as of when it was written).
    pub fn is_claiming(&self) -> bool {
        match (self.since_claim, self.poll_interval) {
            (Some(since), Some(poll)) => self.is_reporting() && since <= poll + 2 * REPORT_EVERY,
            _ => false,
        }
    }
}

impl Outbox {
    /// The reports of the relays of this outbox, oldest relay first: the running ones, and
    /// those that stopped without saying so in the last day.
    pub fn relays(&self, client: &mut impl GenericClient) -> Result<Vec<RelayReport>> {
        let rows = client
            .query(&self.statements::<HealthSql>().relays, &[])
            .map_err(|e| self.db_error(e))?;
        Ok(rows
            .iter()
            .map(|row| {
                let down_since: Option<SystemTime> = row.get(6);
                RelayReport {
                    relay: row.get(0),
                    client_addr: row.get(1),
                    pid: u32::try_from(row.get::<_, i32>(2)).unwrap_or(0),
                    started_at: row.get(3),
                    last_seen: seconds(row.get(4)).unwrap_or_default(),
                    publisher: match (row.get::<_, &str>(5), down_since) {
                        ("up", _) => PublisherState::Up,
                        ("down", Some(since)) => PublisherState::Down { since },
                        _ => PublisherState::Unknown,
                    },
                    published: count(row, 7),
                    upkeep_error: row.get(8),
                    since_claim: seconds(row.get(9)),
                    poll_interval: seconds(row.get(10)),
                }
            })
            .collect())
    }
}
