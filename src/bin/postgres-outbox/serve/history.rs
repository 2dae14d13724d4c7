//! The last hour of each table, sampled by the server itself every few seconds, so a page
//! shows a trend from the moment it is opened.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use postgres_outbox::{Health, Stats};

/// How far back the charts look.
pub const WINDOW: Duration = Duration::from_secs(3600);

/// One sample of one table; `None` where the database did not answer.
#[derive(Clone, Copy)]
pub struct Point {
    pub at: Instant,
    pub pending: Option<f64>,
    /// Rows sent per second since the sample before.
    pub throughput: Option<f64>,
    pub oldest_secs: Option<f64>,
}

struct Series {
    points: VecDeque<Point>,
    /// The last stats read, and when: the overview shows them rather than read them again.
    latest: Option<(Instant, Stats)>,
}

/// The doctor's last result for one table, and when it ran.
pub type Checked = (Instant, Result<Health, String>);

#[derive(Default)]
pub struct History {
    tables: Mutex<HashMap<String, Series>>,
    /// The doctor's last result of each table: the overview shows it rather than run it.
    health: Mutex<HashMap<String, Checked>>,
}

impl History {
    /// Adds a sample of `table`: its stats, or `None` when they could not be read.
    pub fn record(&self, table: &str, stats: Option<&Stats>) {
        let now = Instant::now();
        let Ok(mut tables) = self.tables.lock() else {
            return;
        };
        let series = tables.entry(table.to_owned()).or_insert_with(|| Series {
            points: VecDeque::new(),
            latest: None,
        });
        let point = match stats {
            Some(stats) => {
                // Since the last stats read (across samples that failed, an average). A purge
                // lowers the sent counter: no negative throughput from it.
                let throughput = series.latest.as_ref().map(|(at, last)| {
                    let secs = now.duration_since(*at).as_secs_f64().max(1e-3);
                    stats.sent.saturating_sub(last.sent) as f64 / secs
                });
                series.latest = Some((now, stats.clone()));
                Point {
                    at: now,
                    pending: Some(stats.pending as f64),
                    throughput,
                    oldest_secs: Some(stats.oldest_pending_age.map_or(0.0, |a| a.as_secs_f64())),
                }
            }
            None => Point {
                at: now,
                pending: None,
                throughput: None,
                oldest_secs: None,
            },
        };
        series.points.push_back(point);
        while series
            .points
            .front()
            .is_some_and(|p| now.duration_since(p.at) > WINDOW)
        {
            series.points.pop_front();
        }
    }

    /// Keeps the doctor's result for `table`.
    pub fn record_health(&self, table: &str, health: Result<Health, String>) {
        if let Ok(mut checked) = self.health.lock() {
            checked.insert(table.to_owned(), (Instant::now(), health));
        }
    }

    /// The doctor's last result for `table`, and when it ran.
    pub fn health(&self, table: &str) -> Option<Checked> {
        self.health.lock().ok()?.get(table).cloned()
    }

    /// The last stats of `table` that could be read, and when.
    pub fn latest(&self, table: &str) -> Option<(Instant, Stats)> {
        let tables = self.tables.lock().ok()?;
        tables.get(table)?.latest.clone()
    }

    /// The samples of `table` in the window, oldest first.
    pub fn points(&self, table: &str) -> Vec<Point> {
        self.tables
            .lock()
            .ok()
            .and_then(|tables| {
                tables
                    .get(table)
                    .map(|s| s.points.iter().copied().collect())
            })
            .unwrap_or_default()
    }
}
