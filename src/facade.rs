//! Reporting to the `metrics` crate facade (feature `metrics`), so any exporter (Prometheus,
//! StatsD, OpenTelemetry...) sees the relay and the consumer.
//!
//! | name | kind | labels | what |
//! |---|---|---|---|
//! | `outbox_claimed_rows_total` | counter | `table` | rows claimed |
//! | `outbox_published_total` | counter | `table`, `topic` | records published and confirmed |
//! | `outbox_publish_latency_seconds` | histogram | `table`, `topic` | claim to confirmation |
//! | `outbox_failed_total` | counter | `table`, `topic` | failed publish attempts |
//! | `outbox_dead_lettered_total` | counter | `table`, `topic` | records that became dead letters |
//! | `outbox_released_rows_total` | counter | `table` | claimed rows handed back unpublished |
//! | `outbox_publisher_up` | gauge | `table` | 1 while the relay's publishers publish, 0 while they cannot reach the broker |
//! | `outbox_database_stalls_total` | counter | `table` | relay connections given up because the database did not answer in time |
//! | `outbox_notifications_total` | counter | `table` | producers' notifications that woke the relay |
//! | `outbox_cycle_seconds` | histogram | `table`, `stage` | a worker cycle's `claim`, `publish` (confirms included) and `record` |
//! | `outbox_pending`, `outbox_due`, `outbox_blocked`, `outbox_in_flight`, `outbox_dead`, `outbox_parked` | gauge | `table` | from [`OutboxMetrics::record_stats`] |
//! | `outbox_oldest_pending_age_seconds`, `outbox_oldest_blocked_age_seconds` | gauge | `table` | from [`OutboxMetrics::record_stats`], 0 when none |
//! | `outbox_dead_tuples`, `outbox_live_tuples`, `outbox_changed_since_analyze`, `outbox_autovacuum` (1 or 0), `outbox_heap_bytes`, `outbox_total_bytes` | gauge | `table`, `relation` (`outbox`, `inbox`) | from [`OutboxMetrics::record_health`] |
//! | `outbox_since_vacuum_seconds`, `outbox_since_analyze_seconds`, `outbox_unused_heap_bytes` | gauge | `table`, `relation` | from [`OutboxMetrics::record_health`]; not set while never vacuumed, never analyzed, or (the estimate of the heap's bytes holding no live row) never measured |
//! | `outbox_oldest_transaction_age_seconds`, `outbox_oldest_prepared_transaction_age_seconds`, `outbox_oldest_due_age_seconds` | gauge | `table` | from [`OutboxMetrics::record_health`], 0 when none |
//! | `outbox_oldest_slot_xmin_age` | gauge | `table` | from [`OutboxMetrics::record_health`]: the age, in transactions, of the oldest xmin a replication slot or a standby feeding back without one holds, 0 when none |
//! | `outbox_inactive_slots_wal_bytes`, `outbox_relays`, `outbox_relays_publisher_down`, `outbox_relays_upkeep_failing`, `outbox_health_findings` | gauge | `table` | from [`OutboxMetrics::record_health`] |
//! | `outbox_partitions`, `outbox_partitions_ahead`, `outbox_partitions_unsettled` | gauge | `table` | from [`OutboxMetrics::record_health`]: a partitioned outbox's partitions, those ready ahead of the open one, and the closed ones not settled (not set for a plain table) |
//! | `outbox_consumer_handled_total` | counter | `queue`, `consumer` | deliveries committed |
//! | `outbox_consumer_handle_seconds` | histogram | `queue`, `consumer` | their transaction's time |
//! | `outbox_consumer_duplicates_total` | counter | `queue`, `consumer` | redeliveries skipped |
//! | `outbox_consumer_failed_total` | counter | `queue`, `consumer` | handler failures |
//! | `outbox_consumer_dead_lettered_total` | counter | `queue`, `consumer` | deliveries given up on |
//! | `outbox_consumer_database_failures_total` | counter | `queue`, `consumer` | database trouble, deliveries held |
//! | `outbox_consumer_sequence_gaps_total` | counter | `queue`, `consumer`, `gap` (`hole`, `behind`) | deliveries out of their aggregate's sequence |
//! | `outbox_consumer_sequence_missing_total` | counter | `queue`, `consumer` | places the holes skipped |
//!
//! Topics become label values: keep them a bounded set (event types, not ids).

use std::time::Duration;

use metrics::{counter, gauge, histogram};

use crate::operations::health::report::Health;
use crate::operations::relays::PublisherState;
use crate::operations::stats::Stats;
use crate::producer::outbox::Outbox;
use crate::publish::metrics::{CycleTimes, Metrics};
use crate::publish::publisher::PublishError;
use crate::publish::record::Record;

/// The relay's [`Metrics`], reported to the `metrics` facade under the outbox's table name.
///
/// ```no_run
/// use std::time::Duration;
/// use postgres_outbox::{publisher_fn, OutboxMetrics, Outbox, Relay, RelayConfig};
/// use r2d2_postgres::{postgres::NoTls, PostgresConnectionManager};
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// // Install an exporter first, e.g. metrics_exporter_prometheus::PrometheusBuilder.
/// let url = "postgres://postgres@localhost/app";
/// let pool = r2d2::Pool::new(PostgresConnectionManager::new(url.parse()?, NoTls))?;
/// let outbox = Outbox::new("orders_outbox")?;
/// let metrics = OutboxMetrics::new(&outbox);
/// let relay = Relay::spawn(
///     RelayConfig::new(outbox.clone(), pool.clone(), || {
///         Ok::<_, std::io::Error>(publisher_fn(|_record| Ok(())))
///     })
///     .metrics(metrics.clone()),
/// )?;
/// // Now and then (every 15 s, say), the gauges worth alerting on:
/// metrics.record_stats(&outbox.stats(&mut *pool.get()?)?);
/// # relay.shutdown(Duration::from_secs(10))?;
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct OutboxMetrics {
    table: String,
}

impl OutboxMetrics {
    /// Reports under `table="<the outbox's table>"`.
    pub fn new(outbox: &Outbox) -> OutboxMetrics {
        OutboxMetrics {
            table: outbox.table().to_owned(),
        }
    }

    /// Sets the gauges from a [`Health`] diagnosis (see [`Outbox::health`]): dead and
    /// live tuples per relation with their vacuum, analyze and sizes, the ages of the oldest
    /// transaction, prepared transaction and due row (0 when none), the oldest xmin a slot
    /// holds and the WAL the slots nothing reads from keep, the relays reporting and how
    /// many of them cannot publish, and the number of findings.
    pub fn record_health(&self, health: &Health) {
        let table = self.table.clone();
        for (relation, figures) in [
            ("outbox", &health.outbox_table),
            ("inbox", &health.inbox_table),
        ] {
            let labels = [("table", table.clone()), ("relation", relation.to_owned())];
            gauge!("outbox_dead_tuples", &labels).set(figures.dead_tuples as f64);
            gauge!("outbox_live_tuples", &labels).set(figures.live_tuples as f64);
            gauge!("outbox_changed_since_analyze", &labels)
                .set(figures.changed_since_analyze as f64);
            gauge!("outbox_autovacuum", &labels).set(f64::from(u8::from(figures.autovacuum)));
            gauge!("outbox_heap_bytes", &labels).set(figures.heap_bytes as f64);
            gauge!("outbox_total_bytes", &labels).set(figures.total_bytes as f64);
            let since = [
                ("outbox_since_vacuum_seconds", figures.since_vacuum),
                ("outbox_since_analyze_seconds", figures.since_analyze),
            ];
            for (name, age) in since {
                if let Some(age) = age {
                    gauge!(name, &labels).set(age.as_secs_f64());
                }
            }
            if let Some(unused) = figures.unused_heap_bytes {
                gauge!("outbox_unused_heap_bytes", &labels).set(unused as f64);
            }
        }
        let ages = [
            (
                "outbox_oldest_transaction_age_seconds",
                health.oldest_transaction.as_ref().map(|h| h.age),
            ),
            (
                "outbox_oldest_prepared_transaction_age_seconds",
                health.oldest_prepared.as_ref().map(|h| h.age),
            ),
            ("outbox_oldest_due_age_seconds", health.oldest_due_age),
        ];
        for (name, age) in ages {
            let secs = age.map_or(0.0, |a| a.as_secs_f64());
            gauge!(name, "table" => table.clone()).set(secs);
        }
        let slot_xmin_age = health.slots.iter().filter_map(|s| s.xmin_age).max();
        gauge!("outbox_oldest_slot_xmin_age", "table" => table.clone())
            .set(slot_xmin_age.unwrap_or(0) as f64);
        let idle_slots_wal: u64 = health
            .slots
            .iter()
            .filter(|s| !s.active)
            .map(|s| s.wal_bytes)
            .sum();
        gauge!("outbox_inactive_slots_wal_bytes", "table" => table.clone())
            .set(idle_slots_wal as f64);
        let reporting = health.relays.iter().filter(|r| r.is_reporting());
        let down = reporting
            .clone()
            .filter(|r| matches!(r.publisher, PublisherState::Down { .. }))
            .count();
        let upkeep_failing = reporting
            .clone()
            .filter(|r| r.upkeep_error.is_some())
            .count();
        gauge!("outbox_relays", "table" => table.clone()).set(reporting.count() as f64);
        gauge!("outbox_relays_publisher_down", "table" => table.clone()).set(down as f64);
        gauge!("outbox_relays_upkeep_failing", "table" => table.clone()).set(upkeep_failing as f64);
        if let Some(open) = health.partitions.iter().find(|p| p.is_open()) {
            let exist = health.partitions.iter().filter(|p| p.exists);
            let ahead = exist.clone().filter(|p| p.number > open.number).count();
            gauge!("outbox_partitions", "table" => table.clone()).set(exist.count() as f64);
            gauge!("outbox_partitions_ahead", "table" => table.clone()).set(ahead as f64);
            let unsettled = health
                .partitions
                .iter()
                .filter(|p| p.exists && p.closed.is_some() && p.settled.is_none())
                .count();
            gauge!("outbox_partitions_unsettled", "table" => table.clone()).set(unsettled as f64);
        }
        gauge!("outbox_health_findings", "table" => table).set(health.findings.len() as f64);
    }

    /// Sets the gauges from a [`Stats`] snapshot (see [`Outbox::stats`]).
    pub fn record_stats(&self, stats: &Stats) {
        let table = self.table.clone();
        let counts = [
            ("outbox_pending", stats.pending),
            ("outbox_due", stats.due),
            ("outbox_blocked", stats.blocked),
            ("outbox_in_flight", stats.in_flight),
            ("outbox_dead", stats.dead),
            ("outbox_parked", stats.parked),
        ];
        for (name, value) in counts {
            gauge!(name, "table" => table.clone()).set(value as f64);
        }
        let ages = [
            (
                "outbox_oldest_pending_age_seconds",
                stats.oldest_pending_age,
            ),
            (
                "outbox_oldest_blocked_age_seconds",
                stats.oldest_blocked_age,
            ),
        ];
        for (name, age) in ages {
            let secs = age.map_or(0.0, |a| a.as_secs_f64());
            gauge!(name, "table" => table.clone()).set(secs);
        }
    }

    fn by_topic(&self, record: &Record) -> [(&'static str, String); 2] {
        [
            ("table", self.table.clone()),
            ("topic", record.topic.clone()),
        ]
    }
}

impl Metrics for OutboxMetrics {
    fn claimed(&self, n: usize) {
        counter!("outbox_claimed_rows_total", "table" => self.table.clone()).increment(n as u64);
    }

    fn published(&self, record: &Record, took: Duration) {
        let labels = self.by_topic(record);
        counter!("outbox_published_total", &labels).increment(1);
        histogram!("outbox_publish_latency_seconds", &labels).record(took.as_secs_f64());
    }

    fn failed(&self, record: &Record, _error: &PublishError) {
        counter!("outbox_failed_total", &self.by_topic(record)).increment(1);
    }

    fn dead_lettered(&self, record: &Record) {
        counter!("outbox_dead_lettered_total", &self.by_topic(record)).increment(1);
    }

    fn released(&self, n: usize) {
        counter!("outbox_released_rows_total", "table" => self.table.clone()).increment(n as u64);
    }

    fn publisher_down(&self, _cause: &(dyn std::error::Error + 'static)) {
        gauge!("outbox_publisher_up", "table" => self.table.clone()).set(0.0);
    }

    fn publisher_up(&self) {
        gauge!("outbox_publisher_up", "table" => self.table.clone()).set(1.0);
    }

    fn database_stalled(&self, _waited: Duration) {
        counter!("outbox_database_stalls_total", "table" => self.table.clone()).increment(1);
    }

    fn notified(&self) {
        counter!("outbox_notifications_total", "table" => self.table.clone()).increment(1);
    }

    fn cycle(&self, times: &CycleTimes) {
        for (stage, took) in [
            ("claim", times.claim),
            ("publish", times.publish),
            ("record", times.record),
        ] {
            histogram!("outbox_cycle_seconds", "table" => self.table.clone(), "stage" => stage)
                .record(took.as_secs_f64());
        }
    }
}

#[cfg(feature = "rabbitmq")]
pub use crate::rabbitmq::QueueMetrics;

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};
    use metrics_util::MetricKind;

    /// (kind, name, sorted labels, value) of everything reported while `f` ran.
    pub(crate) fn reported(f: impl FnOnce()) -> Vec<(MetricKind, String, Vec<String>, DebugValue)> {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        metrics::with_local_recorder(&recorder, f);
        let mut seen: Vec<_> = snapshotter
            .snapshot()
            .into_vec()
            .into_iter()
            .map(|(key, _, _, value)| {
                let (kind, key) = key.into_parts();
                let mut labels: Vec<String> = key
                    .labels()
                    .map(|l| format!("{}={}", l.key(), l.value()))
                    .collect();
                labels.sort();
                (kind, key.name().to_owned(), labels, value)
            })
            .collect();
        seen.sort_by(|a, b| (a.1.as_str(), &a.2).cmp(&(b.1.as_str(), &b.2)));
        seen
    }

    fn record(topic: &str) -> Record {
        Record::for_tests(1, topic, None)
    }

    #[test]
    fn relay_events_become_labelled_counters_and_a_latency_histogram() {
        let metrics = OutboxMetrics::new(&Outbox::new("orders_outbox").unwrap());
        let seen = reported(|| {
            metrics.claimed(3);
            metrics.published(&record("order.created"), Duration::from_millis(250));
            metrics.published(&record("order.created"), Duration::from_millis(750));
            metrics.failed(&record("order.paid"), &PublishError::transient("down"));
            metrics.dead_lettered(&record("order.paid"));
            metrics.released(2);
            metrics.publisher_up();
            metrics.publisher_down(&PublishError::unavailable("connection refused"));
        });
        let table = "table=orders_outbox".to_owned();
        let labels = |topic: &str| vec![table.clone(), format!("topic={topic}")];
        assert_eq!(
            seen,
            [
                (
                    MetricKind::Counter,
                    "outbox_claimed_rows_total".into(),
                    vec![table.clone()],
                    DebugValue::Counter(3)
                ),
                (
                    MetricKind::Counter,
                    "outbox_dead_lettered_total".into(),
                    labels("order.paid"),
                    DebugValue::Counter(1)
                ),
                (
                    MetricKind::Counter,
                    "outbox_failed_total".into(),
                    labels("order.paid"),
                    DebugValue::Counter(1)
                ),
                (
                    MetricKind::Histogram,
                    "outbox_publish_latency_seconds".into(),
                    labels("order.created"),
                    DebugValue::Histogram(vec![0.25.into(), 0.75.into()])
                ),
                (
                    MetricKind::Counter,
                    "outbox_published_total".into(),
                    labels("order.created"),
                    DebugValue::Counter(2)
                ),
                (
                    MetricKind::Gauge,
                    "outbox_publisher_up".into(),
                    vec![table.clone()],
                    DebugValue::Gauge(0.0.into())
                ),
                (
                    MetricKind::Counter,
                    "outbox_released_rows_total".into(),
                    vec![table.clone()],
                    DebugValue::Counter(2)
                ),
            ]
        );
    }

    #[test]
    fn notifications_count_and_cycles_become_a_histogram_per_stage() {
        let metrics = OutboxMetrics::new(&Outbox::new("orders_outbox").unwrap());
        let seen = reported(|| {
            metrics.notified();
            metrics.cycle(&CycleTimes {
                rows: 3,
                claim: Duration::from_millis(1),
                publish: Duration::from_millis(2),
                record: Duration::from_millis(4),
            });
        });
        let table = "table=orders_outbox".to_owned();
        let stage = |name: &str, seconds: f64| {
            (
                MetricKind::Histogram,
                "outbox_cycle_seconds".to_owned(),
                vec![format!("stage={name}"), table.clone()],
                DebugValue::Histogram(vec![seconds.into()]),
            )
        };
        assert_eq!(
            seen,
            [
                stage("claim", 0.001),
                stage("publish", 0.002),
                stage("record", 0.004),
                (
                    MetricKind::Counter,
                    "outbox_notifications_total".into(),
                    vec![table.clone()],
                    DebugValue::Counter(1)
                ),
            ]
        );
    }

    #[test]
    fn health_becomes_gauges() {
        use crate::operations::health::report::{Check, Finding, Holder, Partition, TableHealth};
        use crate::operations::relays::{PublisherState, RelayReport};
        use std::time::SystemTime;
        let metrics = OutboxMetrics::new(&Outbox::new("orders_outbox").unwrap());
        let health = Health {
            outbox_table: TableHealth {
                table: "orders_outbox".into(),
                live_tuples: 10,
                dead_tuples: 20_000,
                since_vacuum: None,
                since_analyze: Some(Duration::from_secs(30)),
                changed_since_analyze: 25_000,
                autovacuum: false,
                heap_bytes: 8192,
                total_bytes: 24_576,
                unused_heap_bytes: Some(4096),
            },
            inbox_table: TableHealth::default(),
            oldest_transaction: Some(Holder {
                id: "42".into(),
                age: Duration::from_secs(400),
                what: "app, idle in transaction".into(),
            }),
            oldest_prepared: None,
            slots: Vec::new(),
            oldest_due_age: Some(Duration::from_millis(1500)),
            dead_letters: 0,
            parked: 0,
            partitions: (0..3)
                .map(|number| Partition {
                    number,
                    every: Duration::from_secs(86_400),
                    opened: (number < 2).then_some(Duration::from_secs(60)),
                    closed: (number < 1).then_some(Duration::from_secs(60)),
                    exists: true,
                    rows: 0,
                    settled: None,
                    held_back: None,
                    quiet: false,
                })
                .collect(),
            relays: [
                PublisherState::Up,
                PublisherState::Down {
                    since: SystemTime::now(),
                },
            ]
            .into_iter()
            .map(|publisher| RelayReport {
                relay: "r".into(),
                client_addr: None,
                pid: 7,
                started_at: SystemTime::now(),
                last_seen: Duration::from_secs(1),
                publisher,
                published: 0,
                upkeep_error: (publisher == PublisherState::Up).then(|| "denied".into()),
                since_claim: Some(Duration::from_secs(1)),
                poll_interval: Some(Duration::from_secs(2)),
            })
            .collect(),
            findings: vec![Finding {
                check: Check::DeadTuples,
                problem: "p".into(),
                remedy: "r".into(),
            }],
        };
        let seen = reported(|| metrics.record_health(&health));
        let gauge = |name: &str, labels: &[&str], value: f64| {
            (
                MetricKind::Gauge,
                name.to_owned(),
                labels.iter().map(|l| (*l).to_owned()).collect::<Vec<_>>(),
                DebugValue::Gauge(value.into()),
            )
        };
        let table = "table=orders_outbox";
        for expected in [
            gauge("outbox_dead_tuples", &["relation=outbox", table], 20_000.0),
            gauge("outbox_dead_tuples", &["relation=inbox", table], 0.0),
            gauge(
                "outbox_changed_since_analyze",
                &["relation=outbox", table],
                25_000.0,
            ),
            gauge("outbox_autovacuum", &["relation=outbox", table], 0.0),
            gauge("outbox_heap_bytes", &["relation=outbox", table], 8192.0),
            gauge("outbox_total_bytes", &["relation=outbox", table], 24_576.0),
            gauge(
                "outbox_since_analyze_seconds",
                &["relation=outbox", table],
                30.0,
            ),
            gauge(
                "outbox_unused_heap_bytes",
                &["relation=outbox", table],
                4096.0,
            ),
            gauge("outbox_oldest_slot_xmin_age", &[table], 0.0),
            gauge("outbox_oldest_transaction_age_seconds", &[table], 400.0),
            gauge(
                "outbox_oldest_prepared_transaction_age_seconds",
                &[table],
                0.0,
            ),
            gauge("outbox_oldest_due_age_seconds", &[table], 1.5),
            gauge("outbox_relays", &[table], 2.0),
            gauge("outbox_relays_publisher_down", &[table], 1.0),
            gauge("outbox_relays_upkeep_failing", &[table], 1.0),
            gauge("outbox_health_findings", &[table], 1.0),
            gauge("outbox_partitions", &[table], 3.0),
            gauge("outbox_partitions_ahead", &[table], 1.0),
            gauge("outbox_partitions_unsettled", &[table], 1.0),
        ] {
            assert!(seen.contains(&expected), "{expected:?} not in {seen:?}");
        }
        // Never vacuumed: no age to give.
        assert!(!seen.iter().any(|(_, name, labels, _)| {
            name == "outbox_since_vacuum_seconds" && labels.iter().any(|l| l == "relation=outbox")
        }));
    }

    #[test]
    fn stats_become_gauges() {
        let metrics = OutboxMetrics::new(&Outbox::new("orders_outbox").unwrap());
        let stats = Stats {
            pending: 7,
            due: 2,
            blocked: 5,
            in_flight: 1,
            sent: 100,
            dead: 3,
            parked: 1,
            oldest_pending_age: Some(Duration::from_secs(90)),
            oldest_blocked_age: None,
            exact: true,
        };
        let seen = reported(|| metrics.record_stats(&stats));
        let gauges: Vec<(String, f64)> = seen
            .into_iter()
            .map(|(kind, name, _, value)| {
                assert_eq!(kind, MetricKind::Gauge);
                match value {
                    DebugValue::Gauge(v) => (name, v.into_inner()),
                    other => panic!("{name}: {other:?}"),
                }
            })
            .collect();
        assert_eq!(
            gauges,
            [
                ("outbox_blocked".to_owned(), 5.0),
                ("outbox_dead".to_owned(), 3.0),
                ("outbox_due".to_owned(), 2.0),
                ("outbox_in_flight".to_owned(), 1.0),
                ("outbox_oldest_blocked_age_seconds".to_owned(), 0.0),
                ("outbox_oldest_pending_age_seconds".to_owned(), 90.0),
                ("outbox_parked".to_owned(), 1.0),
                ("outbox_pending".to_owned(), 7.0),
            ]
        );
    }
}
