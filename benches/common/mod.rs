//! What the `outbox` and `rabbitmq` benches share: the shapes of an ordered backlog, filling
//! one as producers do, draining it with a relay, and printing rates.
//!
//! Each bench includes this with `mod common;`; Cargo takes only the files directly in
//! `benches/` as bench targets, so this one is not a bench of its own.

use std::error::Error;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use postgres::Client;
use postgres_outbox::{CycleTimes, Message, Metrics, Outbox, Record, Relay, RelayConfig};

/// `Send + Sync`, so that bench threads can return it; `?` turns it into a plain
/// `Box<dyn Error>` where a bench wants that.
pub type Result<T> = std::result::Result<T, Box<dyn Error + Send + Sync>>;

/// Pool for the relays that otherwise keep default settings (`ordered`, `rss`,
/// `rabbitmq-ordered`).
pub const DEFAULT_RELAY_POOL_SIZE: u32 = 16;
/// How often `stats()` is asked whether the last rows are recorded sent.
const STATS_POLL: Duration = Duration::from_millis(50);

/// How messages of a backlog are spread over aggregates.
#[derive(Debug, Clone, Copy)]
pub enum Shape {
    /// No aggregate key: no ordering to keep.
    Unordered,
    /// Each row its own aggregate.
    Unique,
    /// Rows round-robin over 40 aggregates.
    Agg40,
    /// Every row in one aggregate.
    Hot1,
}

impl Shape {
    /// `Unordered` first: the others are measured against it.
    pub const ALL: [Shape; 4] = [Shape::Unordered, Shape::Unique, Shape::Agg40, Shape::Hot1];

    pub fn name(self) -> &'static str {
        match self {
            Shape::Unordered => "unordered",
            Shape::Unique => "unique",
            Shape::Agg40 => "agg40",
            Shape::Hot1 => "hot1",
        }
    }

    /// The aggregate key of row `i` (1-based).
    fn aggregate_key(self, i: usize) -> Option<String> {
        match self {
            Shape::Unordered => None,
            Shape::Unique => Some(format!("agg-{i}")),
            Shape::Agg40 => Some(format!("agg-{}", i % 40)),
            Shape::Hot1 => Some("agg-0".to_owned()),
        }
    }
}

/// Fills the outbox with `rows` pending messages of `payload` bytes through
/// `Outbox::enqueue_all`, as producers write them, aggregates per `shape`, a transaction per
/// batch of at most 1,000 messages or 16 MiB; then `VACUUM ANALYZE`s it, as autovacuum would
/// have by then.
pub fn prefill_rows(
    client: &mut Client,
    outbox: &Outbox,
    rows: usize,
    payload: usize,
    shape: Shape,
) -> Result<()> {
    let per_batch = (16 << 20) / payload.max(1);
    let per_batch = per_batch.clamp(1, 1000);
    let bytes = vec![b'x'; payload];
    for first in (1..=rows).step_by(per_batch) {
        let last = rows.min(first + per_batch - 1);
        let mut tx = client.transaction()?;
        outbox.enqueue_all(
            &mut tx,
            (first..=last).map(|i| {
                let message = Message::new("bench.event", bytes.clone()).key(format!("bench-{i}"));
                match shape.aggregate_key(i) {
                    Some(aggregate) => message.aggregate_key(aggregate),
                    None => message,
                }
            }),
        )?;
        tx.commit()?;
    }
    client.batch_execute(&format!("VACUUM ANALYZE {}", outbox.table()))?;
    Ok(())
}

/// How a drain ended.
pub struct Drained {
    /// Rows recorded sent when it ended.
    pub sent: u64,
    /// From spawning the relay to seeing the last row sent, or to the cap.
    pub took: Duration,
    /// Whether the cap ended it before every row was sent.
    pub capped: bool,
    /// Where the workers' cycles went.
    pub cycles: Vec<CycleTimes>,
}

impl Drained {
    pub fn rate(&self) -> f64 {
        rate(self.sent, self.took)
    }

    /// Where the workers' cycles went: `cycles=`, `rows_per_cycle=`, the median claim,
    /// publish (confirms included) and record of a cycle in ms (`cycle_ms=`), and the share
    /// of all cycles' time each took (`cycle_share=`). A worker claims and records with
    /// nothing of its own in flight, so claiming an aggregate's next rows while its last ones
    /// are in flight would win at most the claim's and the record's share.
    pub fn cycle_report(&self) -> String {
        let stage = |of: fn(&CycleTimes) -> Duration| -> (f64, f64) {
            let mut each: Vec<f64> = self
                .cycles
                .iter()
                .map(|c| of(c).as_secs_f64() * 1e3)
                .collect();
            let total = each.iter().sum();
            each.sort_by(f64::total_cmp);
            (each.get(each.len() / 2).copied().unwrap_or(0.0), total)
        };
        let (claim, publish, record) = (
            stage(|c| c.claim),
            stage(|c| c.publish),
            stage(|c| c.record),
        );
        let all = (claim.1 + publish.1 + record.1).max(f64::MIN_POSITIVE);
        let rows: usize = self.cycles.iter().map(|c| c.rows).sum();
        format!(
            "cycles={} rows_per_cycle={:.0} cycle_ms={:.1}/{:.1}/{:.1} \
             cycle_share={:.2}/{:.2}/{:.2}",
            self.cycles.len(),
            rows as f64 / self.cycles.len().max(1) as f64,
            claim.0,
            publish.0,
            record.0,
            claim.1 / all,
            publish.1 / all,
            record.1 / all,
        )
    }

    /// `self`, or an error if the cap ended it.
    pub fn complete(self) -> Result<Drained> {
        if self.capped {
            return Err(format!("relay stalled: {} rows sent before the cap", self.sent).into());
        }
        Ok(self)
    }
}

/// Counts records the publisher accepted (for `RabbitPublisher`, those the broker confirmed),
/// and keeps the workers' cycle times.
#[derive(Clone, Default)]
struct Published {
    count: Arc<AtomicU64>,
    cycles: Arc<Mutex<Vec<CycleTimes>>>,
}

impl Metrics for Published {
    fn published(&self, _record: &Record, _took: Duration) {
        self.count.fetch_add(1, Ordering::Relaxed);
    }
    fn cycle(&self, times: &CycleTimes) {
        if let Ok(mut cycles) = self.cycles.lock() {
            cycles.push(*times);
        }
    }
}

/// Spawns a relay from `config` and waits until all `rows` rows of `outbox` are recorded
/// sent or `cap` has passed, then shuts the relay down.
///
/// `stats` is only asked once a metrics counter has seen `rows` records published, and then
/// every `STATS_POLL`: the relay's rate is measured without a reader beside it.
pub fn drain(
    client: &mut Client,
    outbox: &Outbox,
    config: RelayConfig,
    rows: usize,
    cap: Duration,
) -> Result<Drained> {
    let rows = rows as u64;
    let published = Published::default();
    let config = config.metrics(published.clone());
    let started = Instant::now();
    let relay = Relay::spawn(config)?;
    let drained = wait_until_sent(client, outbox, &published.count, rows, started, cap);
    relay.shutdown(Duration::from_secs(10))?;
    let cycles = match published.cycles.lock() {
        Ok(cycles) => cycles.clone(),
        Err(_) => Vec::new(),
    };
    drained.map(|drained| Drained { cycles, ..drained })
}

/// Waits until `rows` rows are recorded sent or `cap` has passed since `started`.
fn wait_until_sent(
    client: &mut Client,
    outbox: &Outbox,
    published: &AtomicU64,
    rows: u64,
    started: Instant,
    cap: Duration,
) -> Result<Drained> {
    loop {
        let all_published = published.load(Ordering::Relaxed) >= rows;
        let capped = started.elapsed() >= cap;
        if all_published || capped {
            let sent = outbox.stats(client)?.sent;
            if sent >= rows || capped {
                return Ok(Drained {
                    sent,
                    took: started.elapsed(),
                    capped: sent < rows,
                    cycles: Vec::new(),
                });
            }
        }
        thread::sleep(if all_published {
            STATS_POLL
        } else {
            Duration::from_millis(5)
        });
    }
}

pub fn rate(ops: u64, took: Duration) -> f64 {
    ops as f64 / took.as_secs_f64()
}

/// A rate as a whole number, or with a decimal below 10 so that a crawl does not print 0.
pub fn fmt_rate(rate: f64) -> String {
    if rate < 10.0 {
        format!("{rate:.1}")
    } else {
        format!("{rate:.0}")
    }
}

/// `a / b` with two decimals (five below 0.01, so that a crawl does not print 0), or `n/a`
/// when `b` is zero.
pub fn ratio(a: f64, b: f64) -> String {
    match a / b {
        _ if b <= 0.0 => "n/a".to_owned(),
        r if r > 0.0 && r < 0.01 => format!("{r:.5}"),
        r => format!("{r:.2}"),
    }
}

/// Drops an outbox's tables (the outbox and every `<outbox>_*` table its migrations made,
/// found in its schema (`schema.name`) or the current one) and its enqueue functions.
pub fn drop_outbox(client: &mut Client, outbox: &Outbox) -> Result<()> {
    let (schema, name) = match outbox.table().split_once('.') {
        Some((schema, name)) => (Some(schema), name),
        None => (None, outbox.table()),
    };
    let tables: Vec<String> = client
        .query(
            "SELECT format('%I.%I', schemaname, tablename) FROM pg_tables \
             WHERE schemaname = coalesce($1, current_schema()) \
               AND (tablename = $2 OR starts_with(tablename, $2 || '_'))",
            &[&schema, &name],
        )?
        .iter()
        .map(|row| row.get(0))
        .collect();
    if !tables.is_empty() {
        client.batch_execute(&format!("DROP TABLE {}", tables.join(", ")))?;
    }
    // The outbox's functions, every signature of each (enqueue has two).
    let functions: Vec<String> = client
        .query(
            "SELECT p.oid::regprocedure::text FROM pg_proc p \
             JOIN pg_namespace n ON n.oid = p.pronamespace \
             WHERE n.nspname = coalesce($1, current_schema()) \
               AND starts_with(p.proname, $2 || '_')",
            &[&schema, &name],
        )?
        .iter()
        .map(|row| row.get(0))
        .collect();
    if !functions.is_empty() {
        client.batch_execute(&format!("DROP FUNCTION {}", functions.join(", ")))?;
    }
    Ok(())
}
