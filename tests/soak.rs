//! Fault-injection soak: several relay processes over one outbox table, producers writing
//! ordered and unordered messages (some rolled back; one by one, in batches, and now and
//! then in a batch written by COPY), and faults all along: relay processes
//! killed with SIGKILL and restarted, their PostgreSQL backends terminated, their broker
//! connections closed, the exchange deleted for a while (a broker outage), the database
//! restarted (`-m immediate`), made read-only for a while (a switchover's fence), a relay's
//! backend stopped past its statement bound (a stalled connection), 10% of publishes
//! failing and 1% of confirms lost. The database is a PostgreSQL server of the soak's own
//! (tests/common/pg_node.rs).
//!
//! At the end it checks what a consumer of the queue saw: every committed message delivered,
//! no rolled-back one, no aggregate out of order, duplicates within what the faults explain,
//! and the outbox drained with nothing dead.
//!
//! ```sh
//! cargo test --release --features rabbitmq --test soak                        # short: ~20 s of traffic
//! OUTBOX_SOAK_SECS=300 cargo test --release --features rabbitmq --test soak   # long
//! ```
//!
//! Settings: `OUTBOX_SOAK_SECS` (traffic seconds; default 20), `OUTBOX_SOAK_DRAIN_SECS` (how
//! long the backlog may take to drain afterwards; default 25, 120 when `OUTBOX_SOAK_SECS` is
//! set), `OUTBOX_SOAK_ORDERED=0` (unordered traffic only), `OUTBOX_SOAK_SEED`;
//! `OUTBOX_TEST_TABLES=partitioned` runs it on a partitioned table.
//!
//! The relay processes are this test binary run again with `SOAK_ROLE=relay`: the test
//! `relay_process` then runs a relay until it is killed, or until its parent goes away.
#![cfg(feature = "rabbitmq")]

mod common;

use std::collections::{HashMap, HashSet};
use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use amiquip::{
    AmqpValue, Connection, ConsumerMessage, ConsumerOptions, ExchangeDeclareOptions, ExchangeType,
    FieldTable, QueueDeclareOptions,
};
use common::pg_node::{PgNode, Stopped};
use common::{amqp_url, quoted, quoted_with};
use postgres::NoTls;
use postgres_outbox::rabbitmq::{RabbitPublisher, AGGREGATE_HEADER};
use postgres_outbox::{
    Message, Outbox, PublishError, Publisher, Record, Relay, RelayConfig, Retry,
};
use r2d2_postgres::PostgresConnectionManager;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Set to `relay` in the relay processes.
const ROLE_VAR: &str = "SOAK_ROLE";
const EXCHANGE: &str = "events";
/// Where `EXCHANGE` sends everything (its alternate exchange), so that re-declaring it after
/// an outage makes it routable in the same step.
const FALLBACK: &str = "events.all";
const QUEUE: &str = "all";
const TOPIC_ORDERED: &str = "soak.ordered";
const TOPIC_UNORDERED: &str = "soak.unordered";

const RELAYS: usize = 3;
const PRODUCERS: usize = 2;
const AGGREGATES: usize = 40;
/// Relay settings: the in-flight budget per relay is `CONCURRENCY * BATCH`.
const BATCH: usize = 50;
const CONCURRENCY: usize = 2;
/// High enough that injected failures never make a dead letter.
const MAX_ATTEMPTS: u32 = 1000;
/// Share of records the publisher wrapper fails without publishing.
const FAIL_RATE: f64 = 0.10;
/// Share of records published whose confirm the wrapper then reports as lost.
const LOSE_CONFIRM_RATE: f64 = 0.01;
/// Share of producer transactions rolled back.
const ROLLBACK_RATE: f64 = 0.10;
/// Pause between a producer's transactions (1-4 messages each, now and then `COPIED_BATCH`).
const PRODUCER_PAUSE: Duration = Duration::from_millis(10);
/// Messages of the occasional large transaction: enough for `enqueue_all` to `COPY` them
/// (it does from 64 messages due at once).
const COPIED_BATCH: usize = 80;
/// Average time between two faults.
const FAULT_EVERY: Duration = Duration::from_millis(2500);
/// How often a partitioned table's open partition is cut.
const CUT_EVERY: Duration = Duration::from_secs(3);
/// How long the exchange stays deleted in a broker outage.
const OUTAGE: Duration = Duration::from_secs(2);
/// How long the database is down when it restarts.
const DATABASE_DOWN: Duration = Duration::from_secs(1);
/// How long the database takes no writes in a read-only window.
const READ_ONLY: Duration = Duration::from_secs(2);
/// How long a relay's backend is stopped: past its statement bound (a 2 s lease gives a
/// 1 s statement timeout and a 3 s bound).
const STALL: Duration = Duration::from_secs(5);

// ---------------------------------------------------------------------------------------
// The relay process
// ---------------------------------------------------------------------------------------

/// Runs a relay when started by the soak as a relay process; does nothing otherwise.
#[test]
fn relay_process() {
    if std::env::var(ROLE_VAR).as_deref() == Ok("relay") {
        run_relay_process();
    }
}

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} is set by the soak test"))
}

/// Prints the relay's warnings and errors to the process's log file (the crate never logs
/// payloads or passwords).
struct StderrLogger;

impl log::Log for StderrLogger {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        metadata.level() <= log::Level::Warn
    }

    fn log(&self, record: &log::Record<'_>) {
        if self.enabled(record.metadata()) {
            eprintln!("{} {}", record.level(), record.args());
        }
    }

    fn flush(&self) {}
}

fn run_relay_process() -> ! {
    let _ = log::set_logger(&StderrLogger);
    log::set_max_level(log::LevelFilter::Warn);
    let parent = std::os::unix::process::parent_id();
    // An orphan must not outlive the test: exit as soon as the parent is gone.
    thread::spawn(move || loop {
        thread::sleep(Duration::from_millis(200));
        if std::os::unix::process::parent_id() != parent {
            std::process::exit(0);
        }
    });

    let table = env("SOAK_TABLE");
    let amqp = env("SOAK_AMQP_URL");
    let database = env("SOAK_DATABASE_URL");
    let seed: u64 = env("SOAK_SEED").parse().expect("SOAK_SEED is a number");
    let tally = Arc::new(Tally::new(Path::new(&env("SOAK_DIR"))));

    let outbox = Outbox::new(&table).expect("valid table name");
    let manager = PostgresConnectionManager::new(database.parse().expect("database URL"), NoTls);
    let pool = r2d2::Pool::builder()
        .max_size(4)
        .min_idle(Some(0))
        .build(manager)
        .expect("build pool");
    let publishers = Arc::new(AtomicU64::new(0));
    let factory = move || {
        let n = publishers.fetch_add(1, Ordering::SeqCst);
        RabbitPublisher::connect(&amqp, EXCHANGE).map(|inner| FaultyPublisher {
            inner,
            rng: StdRng::seed_from_u64(seed ^ (n << 32) ^ u64::from(std::process::id())),
            tally: tally.clone(),
        })
    };
    let config = RelayConfig::new(outbox, pool, factory)
        .batch_size(BATCH)
        .concurrency(CONCURRENCY)
        .lease(Duration::from_secs(2))
        .poll_interval(Duration::from_millis(200))
        .retry(
            Retry::new(MAX_ATTEMPTS).backoff(Duration::from_millis(20), Duration::from_millis(200)),
        );
    // Starting can meet a fault (its first connection terminated): try again.
    let relay = loop {
        match Relay::spawn(config.clone()) {
            Ok(relay) => break relay,
            Err(e) => {
                eprintln!("relay_process: cannot start yet: {e}");
                thread::sleep(Duration::from_millis(500));
            }
        }
    };
    eprintln!("relay_process {}: relay running", std::process::id());
    // Returns only if the relay stops on its own, which the soak counts as a failure.
    let result = relay.join();
    eprintln!("relay_process: the relay stopped on its own: {result:?}");
    std::process::exit(3);
}

/// What a relay process's publishers injected and returned, kept in a file rewritten
/// (atomically, by rename) after every batch, so a killed process loses at most its last one.
/// And three lists of keys, appended to unbuffered: those handed to the broker but given
/// back to the relay as unavailable (the connection failed before their confirm), each of
/// which may arrive once more; those about to be handed to the broker, written before they
/// are, so a process killed mid-publish has listed every key it may have delivered; and
/// every verdict returned to the relay (a success or a failure, not an outage), the only
/// thing that may cost a message an attempt.
struct Tally {
    path: PathBuf,
    counts: Mutex<Counts>,
    handed_back: Mutex<File>,
    handing: Mutex<File>,
    verdicts: Mutex<File>,
}

#[derive(Debug, Default, Clone, Copy)]
struct Counts {
    /// Records failed without being published.
    injected_failures: u64,
    /// Records published and confirmed, reported as failed.
    lost_confirms: u64,
    /// Records reported published to the relay (which should then record them as sent).
    ok_returned: u64,
    /// Records handed to the RabbitMQ publisher.
    handed_to_broker: u64,
}

impl Counts {
    fn add(&mut self, other: Counts) {
        self.injected_failures += other.injected_failures;
        self.lost_confirms += other.lost_confirms;
        self.ok_returned += other.ok_returned;
        self.handed_to_broker += other.handed_to_broker;
    }

    fn parse(text: &str) -> Option<Counts> {
        let n: Vec<u64> = text
            .split_whitespace()
            .map(str::parse)
            .collect::<Result<_, _>>()
            .ok()?;
        match n[..] {
            [injected_failures, lost_confirms, ok_returned, handed_to_broker] => Some(Counts {
                injected_failures,
                lost_confirms,
                ok_returned,
                handed_to_broker,
            }),
            _ => None,
        }
    }
}

impl Tally {
    fn new(dir: &Path) -> Tally {
        let pid = std::process::id();
        let list = |name: &str| {
            Mutex::new(
                File::create(dir.join(format!("{name}-{pid}.txt"))).expect("create a list of keys"),
            )
        };
        Tally {
            path: dir.join(format!("counts-{pid}.txt")),
            counts: Mutex::new(Counts::default()),
            handed_back: list("handed-back"),
            handing: list("handing"),
            verdicts: list("verdicts"),
        }
    }

    /// Written at once, unbuffered: a killed process loses no key it returned.
    fn handed_back(&self, keys: &[&str]) {
        append(&self.handed_back, keys);
    }

    /// Before the keys go to the broker.
    fn handing(&self, keys: &[&str]) {
        append(&self.handing, keys);
    }

    /// Before the verdicts go back to the relay.
    fn verdicts(&self, keys: &[&str]) {
        append(&self.verdicts, keys);
    }

    fn add(&self, more: Counts) {
        let mut counts = self.counts.lock().expect("tally lock");
        counts.add(more);
        let c = *counts;
        let text = format!(
            "{} {} {} {}\n",
            c.injected_failures, c.lost_confirms, c.ok_returned, c.handed_to_broker
        );
        let tmp = self.path.with_extension("tmp");
        fs::write(&tmp, text).expect("write the counts file");
        fs::rename(&tmp, &self.path).expect("replace the counts file");
    }
}

/// Appends a line per key, at once.
fn append(file: &Mutex<File>, keys: &[&str]) {
    if keys.is_empty() {
        return;
    }
    let text: String = keys.iter().map(|k| format!("{k}\n")).collect();
    file.lock()
        .expect("tally lock")
        .write_all(text.as_bytes())
        .expect("append to a list of keys");
}

/// The keys of the records whose outcome is a verdict (not an outage, not left unset).
fn verdicts<'r>(
    batch: &'r [Record],
    outcomes: impl IntoIterator<Item = Option<&'r Result<(), PublishError>>>,
) -> Vec<&'r str> {
    batch
        .iter()
        .zip(outcomes)
        .filter(|(_, o)| {
            o.is_some_and(|o| o.as_ref().is_ok() || !o.as_ref().is_err_and(|e| e.is_unavailable()))
        })
        .map(|(record, _)| record.key.as_str())
        .collect()
}

/// Wraps the RabbitMQ publisher: 10% of records fail without being published, 1% are
/// published but their confirm is reported lost; the rest pass through.
struct FaultyPublisher {
    inner: RabbitPublisher,
    rng: StdRng,
    tally: Arc<Tally>,
}

impl Publisher for FaultyPublisher {
    fn publish(&mut self, batch: &[Record]) -> Vec<Result<(), PublishError>> {
        let mut counts = Counts::default();
        let mut results: Vec<Option<Result<(), PublishError>>> =
            batch.iter().map(|_| None).collect();
        // (index in batch, lose its confirm)
        let mut passed: Vec<(usize, bool)> = Vec::with_capacity(batch.len());
        for (i, result) in results.iter_mut().enumerate() {
            let roll: f64 = self.rng.gen();
            if roll < FAIL_RATE {
                counts.injected_failures += 1;
                *result = Some(Err(PublishError::transient(
                    "soak: injected publish failure",
                )));
            } else {
                passed.push((i, roll < FAIL_RATE + LOSE_CONFIRM_RATE));
            }
        }
        if !passed.is_empty() {
            let sub: Vec<Record> = passed.iter().map(|&(i, _)| batch[i].clone()).collect();
            counts.handed_to_broker += sub.len() as u64;
            let keys: Vec<&str> = sub.iter().map(|r| r.key.as_str()).collect();
            self.tally.handing(&keys);
            let outcomes = self.inner.publish(&sub);
            let handed_back: Vec<&str> = sub
                .iter()
                .zip(&outcomes)
                .filter(|(_, outcome)| outcome.as_ref().is_err_and(|e| e.is_unavailable()))
                .map(|(record, _)| record.key.as_str())
                .collect();
            self.tally.handed_back(&handed_back);
            let mut outcomes = outcomes.into_iter();
            for &(i, lose) in &passed {
                let outcome = outcomes.next().unwrap_or_else(|| {
                    Err(PublishError::transient(
                        "soak: the publisher gave no outcome",
                    ))
                });
                results[i] = Some(match outcome {
                    Ok(()) if lose => {
                        counts.lost_confirms += 1;
                        Err(PublishError::transient("soak: injected lost confirm"))
                    }
                    Ok(()) => {
                        counts.ok_returned += 1;
                        Ok(())
                    }
                    Err(e) => Err(e),
                });
            }
        }
        self.tally.add(counts);
        let results: Vec<Result<(), PublishError>> = results
            .into_iter()
            .map(|r| r.unwrap_or_else(|| Err(PublishError::transient("soak: no outcome"))))
            .collect();
        self.tally
            .verdicts(&verdicts(batch, results.iter().map(Some)));
        results
    }

    /// The relay's path: the same faults around `RabbitPublisher`'s stream. A record picked
    /// to fail is not handed over, nor is anything after it in its aggregate (the stream
    /// would not hand them over either); its failure stands where every earlier record of
    /// its aggregate succeeded. A confirm is lost only of a record its aggregate went no
    /// further than in this call: the stream publishes an aggregate's next record once the
    /// one before is confirmed, so a lost confirm would have stopped it there.
    fn publish_in_order(
        &mut self,
        batch: &[Record],
        outcomes: &mut [Option<Result<(), PublishError>>],
        proceed: &dyn Fn() -> bool,
    ) {
        let mut counts = Counts::default();
        let mut failing = vec![false; batch.len()];
        let mut lose = vec![false; batch.len()];
        let mut passed = Vec::with_capacity(batch.len());
        let mut stopped: HashSet<&str> = HashSet::new();
        for (i, record) in batch.iter().enumerate() {
            let aggregate = record.aggregate_key.as_deref();
            if aggregate.is_some_and(|a| stopped.contains(a)) {
                continue;
            }
            let roll: f64 = self.rng.gen();
            if roll < FAIL_RATE {
                failing[i] = true;
                stopped.extend(aggregate);
            } else {
                lose[i] = roll < FAIL_RATE + LOSE_CONFIRM_RATE;
                passed.push(i);
            }
        }
        let sub: Vec<Record> = passed.iter().map(|&i| batch[i].clone()).collect();
        let mut streamed: Vec<Option<Result<(), PublishError>>> =
            sub.iter().map(|_| None).collect();
        if !sub.is_empty() {
            let keys: Vec<&str> = sub.iter().map(|r| r.key.as_str()).collect();
            self.tally.handing(&keys);
            self.inner.publish_in_order(&sub, &mut streamed, proceed);
        }
        counts.handed_to_broker += streamed.iter().filter(|o| o.is_some()).count() as u64;
        let handed_back: Vec<&str> = sub
            .iter()
            .zip(&streamed)
            .filter(|(_, o)| {
                o.as_ref()
                    .is_some_and(|o| o.as_ref().is_err_and(|e| e.is_unavailable()))
            })
            .map(|(record, _)| record.key.as_str())
            .collect();
        self.tally.handed_back(&handed_back);
        for (&i, outcome) in passed.iter().zip(streamed) {
            outcomes[i] = outcome;
        }
        let mut went_further: HashSet<&str> = HashSet::new();
        for i in (0..batch.len()).rev() {
            let aggregate = batch[i].aggregate_key.as_deref();
            let last = aggregate.is_none_or(|a| !went_further.contains(a));
            if outcomes[i].is_some() {
                went_further.extend(aggregate);
            }
            if matches!(outcomes[i], Some(Ok(()))) {
                if lose[i] && last {
                    counts.lost_confirms += 1;
                    outcomes[i] = Some(Err(PublishError::transient("soak: injected lost confirm")));
                } else {
                    counts.ok_returned += 1;
                }
            }
        }
        let mut held_back: HashSet<&str> = HashSet::new();
        for (i, record) in batch.iter().enumerate() {
            let aggregate = record.aggregate_key.as_deref();
            let reached = aggregate.is_none_or(|a| !held_back.contains(a));
            if failing[i] && reached {
                counts.injected_failures += 1;
                outcomes[i] = Some(Err(PublishError::transient(
                    "soak: injected publish failure",
                )));
            }
            if !matches!(outcomes[i], Some(Ok(()))) {
                held_back.extend(aggregate);
            }
        }
        self.tally.add(counts);
        self.tally
            .verdicts(&verdicts(batch, outcomes.iter().map(Option::as_ref)));
    }

    fn is_broken(&self) -> bool {
        self.inner.is_broken()
    }
}

// ---------------------------------------------------------------------------------------
// The soak
// ---------------------------------------------------------------------------------------

struct Settings {
    traffic: Duration,
    drain: Duration,
    ordered: bool,
    seed: u64,
}

impl Settings {
    fn from_env() -> Settings {
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        let secs = |name: &str| -> Option<u64> {
            var(name).map(|v| {
                v.parse()
                    .unwrap_or_else(|_| panic!("{name} must be a number of seconds"))
            })
        };
        let long = secs("OUTBOX_SOAK_SECS");
        Settings {
            traffic: Duration::from_secs(long.unwrap_or(20)),
            drain: Duration::from_secs(
                secs("OUTBOX_SOAK_DRAIN_SECS").unwrap_or(if long.is_some() { 120 } else { 25 }),
            ),
            ordered: var("OUTBOX_SOAK_ORDERED").as_deref() != Some("0"),
            seed: var("OUTBOX_SOAK_SEED").map_or_else(
                || {
                    SystemTime::now()
                        .duration_since(UNIX_EPOCH)
                        .map_or(0, |d| d.as_nanos() as u64)
                },
                |v| v.parse().expect("OUTBOX_SOAK_SEED must be a number"),
            ),
        }
    }
}

fn rabbitmqctl(args: &[&str]) {
    let output = Command::new("rabbitmqctl")
        .args(args)
        .output()
        .expect("run rabbitmqctl (the broker's own CLI)");
    assert!(
        output.status.success(),
        "rabbitmqctl {args:?} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// The relay processes; killed (and reaped) when dropped, whatever happens to the test.
struct Relays {
    children: Vec<Child>,
    env: Vec<(&'static str, String)>,
    dir: PathBuf,
    started: usize,
    /// Relay processes that exited without being killed.
    died: usize,
}

impl Relays {
    fn start(&mut self) -> Child {
        self.started += 1;
        let log = File::create(self.dir.join(format!("relay-{}.log", self.started)))
            .expect("create a relay log");
        let err = log.try_clone().expect("clone a file handle");
        Command::new(std::env::current_exe().expect("the test binary"))
            .args([
                "--exact",
                "relay_process",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(ROLE_VAR, "relay")
            .env("SOAK_SEED", self.started.to_string())
            .envs(self.env.iter().map(|(k, v)| (*k, v.as_str())))
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err)
            .spawn()
            .expect("start a relay process")
    }

    fn kill(&mut self, i: usize) {
        let child = &mut self.children[i];
        child.kill().expect("kill a relay process");
        child.wait().expect("reap a relay process");
        self.children[i] = self.start();
    }

    /// Restarts any relay process that exited on its own.
    fn check(&mut self) {
        for i in 0..self.children.len() {
            if let Some(status) = self.children[i].try_wait().expect("poll a relay process") {
                eprintln!("soak: relay process exited on its own ({status}); restarting it");
                self.died += 1;
                self.children[i] = self.start();
            }
        }
    }
}

impl Drop for Relays {
    fn drop(&mut self) {
        for child in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A committed or rolled-back message: its key and, if ordered, its aggregate and sequence.
struct Sent {
    key: String,
    ordered: Option<(String, u64)>,
}

#[derive(Default)]
struct Produced {
    committed: Vec<Sent>,
    rolled_back: Vec<Sent>,
    /// Transactions that wrote their messages with `enqueue_all`, and those of them large
    /// enough to be copied in.
    batches: u64,
    copied: u64,
}

fn produce(
    id: usize,
    url: &str,
    outbox: &Outbox,
    ordered: bool,
    seed: u64,
    stop: &AtomicBool,
) -> Produced {
    let connect = || loop {
        match postgres::Client::connect(url, NoTls) {
            Ok(client) => return client,
            // The database restarts now and then.
            Err(_) => thread::sleep(Duration::from_millis(100)),
        }
    };
    let mut client = connect();
    let mut rng = StdRng::seed_from_u64(seed);
    // Each producer owns its aggregates, so enqueue order is each aggregate's intended order.
    let owned: Vec<usize> = (0..AGGREGATES).filter(|a| a % PRODUCERS == id).collect();
    let mut next_seq = [0u64; AGGREGATES];
    let mut produced = Produced::default();
    let mut n_keys = 0u64;
    while !stop.load(Ordering::SeqCst) {
        // Mostly a few messages, now and then a batch large enough to go in by COPY; a
        // transaction of several writes them one by one or in one `enqueue_all`.
        let n = if rng.gen_bool(0.02) {
            COPIED_BATCH
        } else {
            rng.gen_range(1..=4)
        };
        let mut messages = Vec::with_capacity(n);
        let mut sent = Vec::with_capacity(n);
        for _ in 0..n {
            // Keys known before the write: a transaction a fault interrupts is looked up.
            let key = format!("p{id}-{n_keys}");
            n_keys += 1;
            let (message, order) = if ordered && rng.gen_bool(0.5) {
                let a = owned[rng.gen_range(0..owned.len())];
                let seq = next_seq[a];
                next_seq[a] += 1;
                let aggregate = format!("agg-{a}");
                (
                    Message::new(TOPIC_ORDERED, format!("o:{aggregate}:{seq}"))
                        .aggregate_key(aggregate.clone()),
                    Some((aggregate, seq)),
                )
            } else {
                (Message::new(TOPIC_UNORDERED, format!("u:{id}")), None)
            };
            messages.push(message.key(key.clone()).max_attempts(MAX_ATTEMPTS));
            sent.push(Sent {
                key,
                ordered: order,
            });
        }
        let batch = n > 1 && rng.gen_bool(0.5);
        let roll_back = rng.gen_bool(ROLLBACK_RATE);
        let written = (|| -> Result<(), Box<dyn std::error::Error>> {
            let mut tx = client.transaction()?;
            if batch {
                outbox.enqueue_all(&mut tx, messages)?;
            } else {
                for message in messages {
                    outbox.enqueue(&mut tx, message)?;
                }
            }
            if roll_back {
                tx.rollback()?;
            } else {
                tx.commit()?;
            }
            Ok(())
        })();
        let committed = match written {
            Ok(()) => !roll_back,
            // A restart, a read-only window or a terminated backend: whether it committed is
            // for the database to say, once it answers again.
            Err(_) => {
                client = connect();
                let keys: Vec<&str> = sent.iter().map(|s| s.key.as_str()).collect();
                let found: i64 = loop {
                    match client.query_one(
                        &format!(
                            "SELECT count(*) FROM {} WHERE key = ANY($1)",
                            quoted(outbox)
                        ),
                        &[&keys],
                    ) {
                        Ok(row) => break row.get(0),
                        Err(_) => {
                            thread::sleep(Duration::from_millis(100));
                            client = connect();
                        }
                    }
                };
                assert!(
                    found == 0 || found == n as i64,
                    "a transaction committed in part: {found} of {n}"
                );
                found > 0
            }
        };
        if committed {
            produced.committed.extend(sent);
            if batch {
                produced.batches += 1;
                produced.copied += u64::from(n == COPIED_BATCH);
            }
        } else {
            produced.rolled_back.extend(sent);
        }
        thread::sleep(PRODUCER_PAUSE);
    }
    produced
}

/// One delivery as the consumer saw it.
struct Delivered {
    key: String,
    header_aggregate: Option<String>,
    /// From the payload: aggregate and sequence number of an ordered message.
    ordered: Option<(String, u64)>,
    redelivered: bool,
}

#[derive(Default)]
struct ConsumerLog {
    deliveries: Vec<Delivered>,
    keys: HashSet<String>,
    reconnects: u64,
}

fn parse_payload(body: &[u8]) -> Option<(String, u64)> {
    let text = std::str::from_utf8(body).ok()?;
    let rest = text.strip_prefix("o:")?;
    let (aggregate, seq) = rest.rsplit_once(':')?;
    Some((aggregate.to_owned(), seq.parse().ok()?))
}

/// Reads the queue, acking each delivery after recording it, and reconnects whenever the
/// broker closes its connection (the fault closes every connection of the vhost).
fn consume(url: &str, log: &Mutex<ConsumerLog>, stop: &AtomicBool) {
    while !stop.load(Ordering::SeqCst) {
        let mut connection = match Connection::insecure_open(url) {
            Ok(connection) => connection,
            Err(_) => {
                thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        // Any error ends the session: reconnect.
        let _ = (|| -> amiquip::Result<()> {
            let channel = connection.open_channel(None)?;
            channel.qos(0, 500, false)?;
            let consumer = channel.basic_consume(QUEUE, ConsumerOptions::default())?;
            while !stop.load(Ordering::SeqCst) {
                match consumer.receiver().recv_timeout(Duration::from_millis(100)) {
                    Ok(ConsumerMessage::Delivery(delivery)) => {
                        let key = delivery
                            .properties
                            .message_id()
                            .clone()
                            .expect("every message has a message id");
                        let header_aggregate = delivery
                            .properties
                            .headers()
                            .as_ref()
                            .and_then(|h| h.get(AGGREGATE_HEADER))
                            .map(|v| match v {
                                AmqpValue::LongString(s) => s.clone(),
                                other => format!("{other:?}"),
                            });
                        {
                            let mut log = log.lock().expect("consumer log");
                            log.keys.insert(key.clone());
                            log.deliveries.push(Delivered {
                                key,
                                header_aggregate,
                                ordered: parse_payload(&delivery.body),
                                redelivered: delivery.redelivered,
                            });
                        }
                        consumer.ack(delivery)?;
                    }
                    Ok(_) => return Ok(()),
                    Err(e) if e.is_timeout() => {}
                    Err(_) => return Ok(()),
                }
            }
            Ok(())
        })();
        if !stop.load(Ordering::SeqCst) {
            log.lock().expect("consumer log").reconnects += 1;
        }
        drop(connection);
    }
}

/// Figures the assertions and the summary are made of.
#[derive(Default)]
struct Analysis {
    deliveries: usize,
    distinct: usize,
    duplicates: usize,
    broker_redeliveries: usize,
    /// First deliveries of an aggregate's message after a later one of the same aggregate.
    order_violations: Vec<String>,
    header_mismatches: usize,
    /// Relay deliveries (not broker redeliveries) per key.
    per_key: HashMap<String, u64>,
}

fn analyse(deliveries: &[Delivered]) -> Analysis {
    let mut a = Analysis {
        deliveries: deliveries.len(),
        ..Analysis::default()
    };
    let mut last_seq: HashMap<&str, u64> = HashMap::new();
    for d in deliveries {
        if d.ordered.as_ref().map(|(agg, _)| agg) != d.header_aggregate.as_ref() {
            a.header_mismatches += 1;
        }
        match a.per_key.get_mut(&d.key) {
            // The broker handing back a message the consumer saw and did not get to ack.
            Some(_) if d.redelivered => a.broker_redeliveries += 1,
            Some(n) => {
                *n += 1;
                a.duplicates += 1;
            }
            None => {
                a.per_key.insert(d.key.clone(), 1);
                if let Some((aggregate, seq)) = &d.ordered {
                    match last_seq.get(aggregate.as_str()) {
                        Some(&last) if *seq < last => {
                            a.order_violations
                                .push(format!("{aggregate}: #{seq} first delivered after #{last}"));
                        }
                        _ => {
                            last_seq.insert(aggregate, *seq);
                        }
                    }
                }
            }
        }
    }
    a.distinct = a.per_key.len();
    a
}

fn read_counts(dir: &Path) -> Counts {
    let mut total = Counts::default();
    for entry in fs::read_dir(dir).expect("read the soak directory") {
        let path = entry.expect("directory entry").path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if name.starts_with("counts-") && name.ends_with(".txt") {
            let text = fs::read_to_string(&path).expect("read a counts file");
            total.add(Counts::parse(&text).expect("a counts file holds four numbers"));
        }
    }
    total
}

/// Waits until `condition` holds or `deadline` passes; true if it held.
fn wait_for(deadline: Instant, mut condition: impl FnMut() -> bool) -> bool {
    loop {
        if condition() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        thread::sleep(Duration::from_millis(250));
    }
}

#[test]
fn analysis_tells_duplicates_from_reorderings() {
    let d = |key: &str, seq: Option<u64>, redelivered: bool| Delivered {
        key: key.to_owned(),
        header_aggregate: seq.map(|_| "a".to_owned()),
        ordered: seq.map(|s| ("a".to_owned(), s)),
        redelivered,
    };
    // A re-delivery of #1 after #2 is a duplicate; the broker handing #2 back is neither.
    let a = analyse(&[
        d("k1", Some(1), false),
        d("k2", Some(2), false),
        d("k1", Some(1), false),
        d("k2", Some(2), true),
        d("u", None, false),
    ]);
    assert_eq!((a.distinct, a.duplicates, a.broker_redeliveries), (3, 1, 1));
    assert!(a.order_violations.is_empty());
    assert_eq!(a.header_mismatches, 0);
    // #1 first delivered after #2 (gaps are fine: #0 was rolled back) is a reordering.
    let a = analyse(&[d("k2", Some(2), false), d("k1", Some(1), false)]);
    assert_eq!(a.order_violations.len(), 1);
    assert_eq!(a.duplicates, 0);
}

#[test]
fn soak() {
    if std::env::var(ROLE_VAR).is_ok() {
        return;
    }
    let settings = Settings::from_env();
    let pid = std::process::id();
    let schema = format!("soak_{pid}");
    let relay_app = format!("soak_{pid}_relay");
    let dir = std::env::temp_dir().join(format!("outbox-soak-{pid}"));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).expect("create the soak directory");

    // The outbox, in a schema of its own, on a server of the soak's own: it is restarted
    // and made read-only.
    let node = PgNode::start();
    let database = node.url();
    let mut admin = node.client();
    admin
        .batch_execute(&format!("CREATE SCHEMA {schema}"))
        .expect("create the schema");
    // Of this run's kind (`OUTBOX_TEST_TABLES=partitioned`); the relay processes learn it.
    let outbox = common::builder()
        .table(format!("{schema}.outbox"))
        .build()
        .expect("valid table name");
    outbox.migrate(&mut admin).expect("migrate");

    // The broker: a vhost of its own, so closing its connections disturbs nobody else.
    let vhost = format!("soak_{pid}");
    rabbitmqctl(&["add_vhost", &vhost]);
    rabbitmqctl(&["set_permissions", "-p", &vhost, "guest", ".*", ".*", ".*"]);
    let amqp = format!("{}/{vhost}", amqp_url().trim_end_matches('/'));
    let mut setup_connection = Connection::insecure_open(&amqp).expect("connect to RabbitMQ");
    let setup = setup_connection.open_channel(None).expect("channel");
    setup
        .exchange_declare(
            ExchangeType::Fanout,
            FALLBACK,
            ExchangeDeclareOptions::default(),
        )
        .expect("declare the fallback exchange");
    setup
        .queue_declare(QUEUE, QueueDeclareOptions::default())
        .expect("declare the queue");
    setup
        .queue_bind(QUEUE, FALLBACK, "", FieldTable::new())
        .expect("bind the queue");
    declare_exchange(&setup);
    drop(setup);
    setup_connection
        .close()
        .expect("close the setup connection");

    let mut relays = Relays {
        children: Vec::new(),
        env: vec![
            ("SOAK_TABLE", outbox.table().to_owned()),
            ("SOAK_AMQP_URL", amqp.clone()),
            (
                "SOAK_DATABASE_URL",
                format!("{database}?application_name={relay_app}"),
            ),
            ("SOAK_DIR", dir.display().to_string()),
        ],
        dir: dir.clone(),
        started: 0,
        died: 0,
    };
    let consumer_log = Arc::new(Mutex::new(ConsumerLog::default()));
    let consumer_stop = Arc::new(AtomicBool::new(false));
    let consumer = {
        let (log, stop, url) = (consumer_log.clone(), consumer_stop.clone(), amqp.clone());
        thread::spawn(move || consume(&url, &log, &stop))
    };

    let producers_stop = Arc::new(AtomicBool::new(false));
    let producers: Vec<_> = (0..PRODUCERS)
        .map(|id| {
            let (outbox, stop, url) = (outbox.clone(), producers_stop.clone(), database.clone());
            let (ordered, seed) = (settings.ordered, settings.seed.wrapping_add(id as u64));
            thread::spawn(move || produce(id, &url, &outbox, ordered, seed, &stop))
        })
        .collect();

    // The relays start late, so they meet a backlog of ordered and unordered rows (the shape
    // that once drained at 20 rows/s), not only a trickle they can keep up with.
    let traffic_end = Instant::now() + settings.traffic;
    let backlog_phase =
        (settings.traffic / 4).clamp(Duration::from_secs(2), Duration::from_secs(15));
    thread::sleep(backlog_phase);
    let backlog = outbox.stats(&mut admin).expect("stats").pending;
    for _ in 0..RELAYS {
        let child = relays.start();
        relays.children.push(child);
    }

    // Faults, in turn, at random intervals, while the producers write: the database's take
    // turns with the others, so that even the short soak meets most kinds.
    let mut rng = StdRng::seed_from_u64(settings.seed);
    let (mut kills, mut terminations, mut terminated_backends, mut broker_closes) = (0, 0, 0, 0);
    let (mut outages, mut restarts, mut read_only_windows, mut stalls) = (0, 0, 0, 0);
    let mut next_fault = Instant::now() + FAULT_EVERY.mul_f64(rng.gen_range(0.5..1.5));
    let mut fault = 0;
    // On a partitioned table, a cut now and then (its interval is a year), so that
    // partitions close and settle under the faults, and aggregates run across them.
    let cut = format!("SELECT {}(true)", quoted_with(&outbox, "_partition"));
    let (mut cuts, mut next_cut) = (0, Instant::now() + CUT_EVERY);
    while Instant::now() < traffic_end {
        relays.check();
        if common::partitioned() && Instant::now() >= next_cut {
            // A cut the database refuses (down, read-only, a producer's lock) waits for
            // the next turn.
            if admin.execute(&cut, &[]).is_ok() {
                cuts += 1;
            }
            next_cut = Instant::now() + CUT_EVERY;
        }
        if Instant::now() >= next_fault {
            match fault % 7 {
                1 => {
                    relays.kill(rng.gen_range(0..RELAYS));
                    kills += 1;
                }
                0 => {
                    // The database goes down hard, and comes back.
                    node.stop();
                    thread::sleep(DATABASE_DOWN);
                    node.start_again();
                    admin = node.client();
                    restarts += 1;
                }
                2 => {
                    // As a planned switchover fences the old primary.
                    node.read_only(true);
                    thread::sleep(READ_ONLY);
                    node.read_only(false);
                    read_only_windows += 1;
                }
                4 => {
                    // A relay worker's backend stops answering, its socket open.
                    let backend: Option<i32> = admin
                        .query_opt(
                            "SELECT pid FROM pg_stat_activity WHERE application_name = $1
                             ORDER BY random() LIMIT 1",
                            &[&format!("outbox relay {}", outbox.table())],
                        )
                        .expect("find a relay's backend")
                        .map(|row| row.get(0));
                    if let Some(backend) = backend {
                        let stopped = Stopped::stop(backend);
                        thread::sleep(STALL);
                        drop(stopped);
                        stalls += 1;
                    }
                }
                5 => {
                    let n: i64 = admin
                        .query_one(
                            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
                             WHERE datname = current_database() AND pid <> pg_backend_pid()
                               AND (application_name IN ($1, $3)
                                    OR (application_name = 'postgres-outbox listener'
                                        AND query LIKE $2))",
                            &[
                                &relay_app,
                                &format!("%{schema}.outbox%"),
                                &format!("outbox relay {}", outbox.table()),
                            ],
                        )
                        .expect("terminate the relays' backends")
                        .get(0);
                    terminations += 1;
                    terminated_backends += n;
                }
                3 => {
                    rabbitmqctl(&["close_all_connections", "-p", &vhost, "soak fault"]);
                    broker_closes += 1;
                }
                _ => {
                    // The broker has no such exchange for a while: publishes on the relays'
                    // channels close them (404), and so does every reconnect's check.
                    let mut connection =
                        Connection::insecure_open(&amqp).expect("connect to RabbitMQ");
                    let channel = connection.open_channel(None).expect("channel");
                    channel
                        .exchange_delete(EXCHANGE, false)
                        .expect("delete the exchange");
                    thread::sleep(OUTAGE);
                    declare_exchange(&channel);
                    drop(channel);
                    let _ = connection.close();
                    outages += 1;
                }
            }
            fault += 1;
            next_fault = Instant::now() + FAULT_EVERY.mul_f64(rng.gen_range(0.5..1.5));
        }
        thread::sleep(Duration::from_millis(100));
    }
    producers_stop.store(true, Ordering::SeqCst);
    let mut produced = Produced::default();
    for producer in producers {
        let p = producer.join().expect("a producer panicked");
        produced.committed.extend(p.committed);
        produced.rolled_back.extend(p.rolled_back);
        produced.batches += p.batches;
        produced.copied += p.copied;
    }

    // Faults have stopped: the relays must drain the backlog.
    let drain_start = Instant::now();
    let mut last_stats = None;
    let drained = wait_for(drain_start + settings.drain, || {
        relays.check();
        let stats = outbox.stats(&mut admin).expect("stats");
        let done = stats.pending == 0 && stats.in_flight == 0;
        last_stats = Some(stats);
        done
    });
    let drain_time = drain_start.elapsed();

    // Every committed key reaches the consumer; then wait for trailing duplicates to settle.
    let committed: HashSet<&str> = produced.committed.iter().map(|s| s.key.as_str()).collect();
    if drained {
        wait_for(Instant::now() + Duration::from_secs(30), || {
            let log = consumer_log.lock().expect("consumer log");
            committed.iter().all(|k| log.keys.contains(*k))
        });
    }
    let mut seen = usize::MAX;
    wait_for(Instant::now() + Duration::from_secs(10), || {
        thread::sleep(Duration::from_millis(750));
        let now = consumer_log.lock().expect("consumer log").deliveries.len();
        std::mem::replace(&mut seen, now) == now
    });
    consumer_stop.store(true, Ordering::SeqCst);
    consumer.join().expect("the consumer panicked");
    let died = relays.died;
    drop(relays);

    let counts = read_counts(&dir);
    let handed_back = read_keys(&dir, "handed-back-");
    let handings = read_keys(&dir, "handing-");
    let verdicts = read_keys(&dir, "verdicts-");
    let log = consumer_log.lock().expect("consumer log");
    let a = analyse(&log.deliveries);
    let rows: HashMap<String, (String, i32)> = admin
        .query(
            &format!("SELECT key, status, attempts FROM {}", quoted(&outbox)),
            &[],
        )
        .expect("read the outbox")
        .into_iter()
        .map(|row| (row.get(0), (row.get(1), row.get(2))))
        .collect();
    // Only the injected failures are the messages' fault: a killed relay, a terminated
    // backend, a closed connection or a deleted exchange must have left no error behind.
    let charged: Vec<String> = admin
        .query(
            &format!(
                "SELECT DISTINCT last_error FROM {} WHERE last_error IS NOT NULL",
                quoted(&outbox)
            ),
            &[],
        )
        .expect("read the outbox's errors")
        .into_iter()
        .map(|row| row.get::<_, String>(0))
        .filter(|e| !e.starts_with("soak: injected"))
        .collect();
    let sent_rows = rows.values().filter(|(status, _)| status == "sent").count() as u64;
    // Publishes the relay was told succeeded but did not record as sent (its write failed,
    // or its lease ran out first): each may be published again.
    let unrecorded_oks = counts.ok_returned.saturating_sub(sent_rows);
    let fault_units = (kills + died)
        + (terminations + broker_closes + restarts + read_only_windows) * RELAYS
        + stalls;
    let budget =
        fault_units * CONCURRENCY * BATCH + counts.lost_confirms as usize + unrecorded_oks as usize;
    let ordered_committed = produced
        .committed
        .iter()
        .filter(|s| s.ordered.is_some())
        .count();

    println!(
        "soak: seed={} traffic={}s ordered={} backlog_at_relay_start={backlog} \
         committed={} (ordered {ordered_committed}) batch_transactions={} (copied {}) \
         rolled_back={} delivered={} distinct={} duplicates={} duplicate_budget={budget} \
         broker_redeliveries={} consumer_reconnects={} kills={kills} relay_deaths={died} \
         terminations={terminations} (backends {terminated_backends}) \
         broker_closes={broker_closes} outages={outages} database_restarts={restarts} \
         read_only_windows={read_only_windows} stalled_backends={stalls} cuts={cuts} \
         injected_failures={} lost_confirms={} \
         unrecorded_oks={unrecorded_oks} handed_to_broker={} handed_back={} \
         drained={drained} drain={:.1}s \
         order_violations={} stats={last_stats:?}",
        settings.seed,
        settings.traffic.as_secs(),
        settings.ordered,
        produced.committed.len(),
        produced.batches,
        produced.copied,
        produced.rolled_back.len(),
        a.deliveries,
        a.distinct,
        a.duplicates,
        a.broker_redeliveries,
        log.reconnects,
        counts.injected_failures,
        counts.lost_confirms,
        counts.handed_to_broker,
        handed_back.values().sum::<u64>(),
        drain_time.as_secs_f64(),
        a.order_violations.len(),
    );

    let rolled_back: HashSet<&str> = produced
        .rolled_back
        .iter()
        .map(|s| s.key.as_str())
        .collect();
    let leaked: Vec<&str> = rolled_back
        .iter()
        .filter(|k| a.per_key.contains_key(**k) || rows.contains_key(**k))
        .copied()
        .collect();
    assert!(
        leaked.is_empty(),
        "{} rolled-back messages were delivered or left a row, e.g. {:?}",
        leaked.len(),
        &leaked[..leaked.len().min(5)]
    );
    let unknown = a
        .per_key
        .keys()
        .filter(|k| !committed.contains(k.as_str()))
        .count();
    assert_eq!(unknown, 0, "deliveries of keys no producer committed");
    assert_eq!(
        a.header_mismatches, 0,
        "deliveries whose aggregate header does not match their payload"
    );
    assert!(
        a.order_violations.is_empty(),
        "{} messages were first delivered after a later message of their aggregate, e.g. {:?}",
        a.order_violations.len(),
        &a.order_violations[..a.order_violations.len().min(5)]
    );
    assert_eq!(
        died, 0,
        "relay processes stopped on their own (see {dir:?})"
    );
    assert!(
        drained,
        "the backlog did not drain within {:?} after the traffic stopped: {last_stats:?}",
        settings.drain
    );
    let stats = last_stats.expect("stats were read");
    assert_eq!((stats.pending, stats.in_flight, stats.dead), (0, 0, 0));
    let missing: Vec<&str> = committed
        .iter()
        .filter(|k| !a.per_key.contains_key(**k))
        .copied()
        .collect();
    assert!(
        missing.is_empty(),
        "{} committed messages were never delivered, e.g. {:?}",
        missing.len(),
        &missing[..missing.len().min(5)]
    );
    assert_eq!(
        sent_rows,
        committed.len() as u64,
        "every committed row ends sent"
    );
    assert!(
        charged.is_empty(),
        "faults of the world were charged to messages: {charged:?}"
    );
    // Each delivery came from a record handed to the broker (each listed before it was), and
    // each attempt from a verdict a publisher gave: a killed relay, a terminated or stalled
    // backend, a restart or a read-only window, a closed connection or a deleted exchange
    // cost no message an attempt.
    for (key, n) in &a.per_key {
        let handed = handings.get(key).copied().unwrap_or(0);
        assert!(
            *n <= handed,
            "{key} delivered {n} times, handed over {handed}"
        );
    }
    for (key, (_, attempts)) in &rows {
        let given = verdicts.get(key).copied().unwrap_or(0);
        assert!(
            u64::try_from(*attempts).unwrap_or(0) <= given,
            "{key} charged {attempts} attempts for {given} verdicts"
        );
    }
    assert!(
        a.duplicates <= budget,
        "{} duplicates; the faults explain at most {budget}",
        a.duplicates
    );

    // Clean up only after a passing run, so a failure can be looked into.
    admin
        .batch_execute(&format!("DROP SCHEMA {schema} CASCADE"))
        .expect("drop the schema");
    rabbitmqctl(&["delete_vhost", &vhost]);
    let _ = fs::remove_dir_all(&dir);
}

/// Declares the exchange the relays publish to: everything published to it goes on to
/// `FALLBACK`, and from there to the queue, from the moment it exists.
fn declare_exchange(channel: &amiquip::Channel) {
    let mut arguments = FieldTable::new();
    arguments.insert(
        "alternate-exchange".into(),
        AmqpValue::LongString(FALLBACK.into()),
    );
    channel
        .exchange_declare(
            ExchangeType::Topic,
            EXCHANGE,
            ExchangeDeclareOptions {
                arguments,
                ..ExchangeDeclareOptions::default()
            },
        )
        .expect("declare the exchange");
}

/// How many times each key is listed in the relay processes' lists named `prefix<pid>`.
fn read_keys(dir: &Path, prefix: &str) -> HashMap<String, u64> {
    let mut keys = HashMap::new();
    for entry in fs::read_dir(dir).expect("read the soak directory") {
        let path = entry.expect("directory entry").path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if name.starts_with(prefix) {
            let text = fs::read_to_string(&path).expect("read a list of keys");
            for key in text.lines() {
                *keys.entry(key.to_owned()).or_default() += 1;
            }
        }
    }
    keys
}
