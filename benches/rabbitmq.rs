//! Relay throughput to RabbitMQ, against the textbook relay and the broker's own ceiling.
//!
//! ```text
//! cargo bench --bench rabbitmq --features rabbitmq           # everything
//! cargo bench --bench rabbitmq --features rabbitmq ordered   # names containing "ordered"
//! ```
//! Prints `bench=<name> key=value ... rate=<messages per second>` lines:
//! - `broker-confirmed`: publishing straight to the broker, pipelined confirms, no database;
//! - `relay-rabbitmq`: `Relay` with `RabbitPublisher` draining pre-filled rows;
//! - `relay-naive`: one transaction per batch, publish and wait for each confirm, UPDATE each row;
//! - `rabbitmq-ordered shape=unordered|unique|agg40|hot1`: `Relay` with default settings and
//!   `RabbitPublisher` draining a backlog with no aggregate key, each row its own aggregate,
//!   rows round-robin over 40 aggregates, or all in one aggregate; `vs_unordered=` is its rate
//!   over `unordered`'s. A shape still draining after the time cap gets its rate from the rows
//!   sent so far, with `sent=<rows> capped=true`. The ordered shapes run twice: in confirm
//!   rounds (`pipeline_runs=false`, the default) and with `RelayConfig::pipeline_runs`.
//!   Each line ends with where the workers' cycles went (`cycles=`, `cycle_ms=`,
//!   `cycle_share=` of claim/publish/record, see `Drained::cycle_report`).
//!   First the broker alone, with the CPU it took per message: `broker-confirmed
//!   window=100|40`, 100 (or 40) messages published and confirmed before the next ones
//!   (confirm rounds; 100 is how a default batch free of order goes out); `broker-streams
//!   streams=40|1 connections=1|4`, 40 messages (or one) kept in flight, each confirm letting
//!   the next one go, on one connection or split over four (as four workers split the
//!   aggregates): what strict order allows 40 aggregates (one message in flight each) and one
//!   aggregate, whatever the relay does. Each line in order gives its rate over its shape's
//!   ceiling: `unordered` and `unique` `vs_rounds=` of `window=100`, `agg40` and `hot1`
//!   `vs_streams=` of the one-connection line.
//! - `consumer concurrency=1|4 shape=unordered|agg40`: `rabbitmq::Consumer` with a no-op
//!   handler draining a pre-filled queue (each delivery one transaction: dedupe insert and
//!   commit), next to `db_only=`, the same transactions run by as many threads with no
//!   broker; `vs_db_only=` is the consumer's rate over that. Two rounds, taking turns.
//!   `db_only_cpu_us=` and `cpu_us=` are this process's CPU per message in each (the
//!   database server's is not counted), `broker_cpu_us=` the broker's while the consumer
//!   drains (`?` when no `beam.smp` runs on this machine).
//!
//! - `latency`: an idle `Relay` (default settings, notify on) and an amiquip consumer on the
//!   queue; 300 single-message commits, one at a time: `p50= p90= p99= max=` in ms from
//!   COMMIT returned to the consumer holding the delivery, beside `notify_p50= notify_p99=`,
//!   the floor: COMMIT of a bare `pg_notify` to its receipt on a listening connection, in the
//!   same run. Then each stage's median and 99th percentile, `p50/p99` (from
//!   `RelayConfig::metrics`' `notified` and `cycle`):
//!   `stage_notified=` (COMMIT returned to the listener hearing it; negative when it heard it
//!   first), `stage_woken=` (to the worker's claim being sent), `stage_claim=`,
//!   `stage_publish=` (confirm included), `stage_delivered=` (confirm to delivery; negative
//!   when the delivery came first) and `stage_record=` (after the delivery: it delays the next
//!   message, not this one). Last the broker's part alone, `p50/p99/max`: a persistent
//!   message published on a confirmed channel, 300 times one at a time, to its confirm
//!   (`broker_confirm=`) and to the consumer holding it (`broker_delivery=`), then the same
//!   each right after a committed one-row UPDATE, as a relay publishes after its claim
//!   (`broker_confirm_after_commit=`, `broker_delivery_after_commit=`), and through
//!   `RabbitPublisher::publish` after such a commit (`publisher_after_commit=`, to its
//!   return, confirm included, and `publisher_delivery_after_commit=`).
//!
//! Messages are persistent, 512 bytes, into a durable queue, purged before each measurement.
//! Env: OUTBOX_BENCH_DATABASE_URL or DATABASE_URL, OUTBOX_BENCH_AMQP_URL or AMQP_URL,
//! OUTBOX_BENCH_ROWS (default 100000), OUTBOX_BENCH_ORDERED_ROWS (backlog per `ordered`
//! shape, default 20000), OUTBOX_BENCH_ORDERED_CAP_SECS (time cap per shape, default 120),
//! OUTBOX_BENCH_ORDERED_BATCH / OUTBOX_BENCH_ORDERED_CONCURRENCY (the relay's `batch_size`
//! and `concurrency` for `rabbitmq-ordered`, default the relay's defaults; the lines say
//! which), OUTBOX_BENCH_CONSUMED (messages per `consumer` measurement, default 10000).

mod common;

use std::collections::{HashMap, HashSet};
use std::net::TcpStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use amiquip::{
    AmqpProperties, Auth, Channel, Confirm, Connection, ConnectionOptions, ConnectionTuning,
    ExchangeDeclareOptions, ExchangeType, FieldTable, Publish, QueueDeclareOptions,
};
use common::{
    drain, drop_outbox, fmt_rate, prefill_rows, ratio, Result, Shape, DEFAULT_RELAY_POOL_SIZE,
};
use postgres::{Client, NoTls};
use postgres_outbox::rabbitmq::{Consumer, ConsumerConfig, RabbitPublisher, AGGREGATE_HEADER};
use postgres_outbox::{
    CycleTimes, Message, Metrics, Outbox, Publisher, Record, Relay, RelayConfig,
};
use r2d2_postgres::PostgresConnectionManager;

const EXCHANGE: &str = "outbox.bench";
const QUEUE: &str = "outbox.bench.all";
/// The queue the `consumer` bench fills and drains, on the default exchange.
const CONSUMED: &str = "outbox.bench.consumed";
/// How long a `consumer` measurement may take before it counts as stalled.
const CONSUME_TIMEOUT: Duration = Duration::from_secs(600);
const PAYLOAD: usize = 512;
/// How long `relay-rabbitmq` may take before it counts as stalled.
const RELAY_TIMEOUT: Duration = Duration::from_secs(600);

fn env(names: &[&str], default: &str) -> String {
    names
        .iter()
        .find_map(|n| std::env::var(n).ok())
        .unwrap_or_else(|| default.to_owned())
}

fn main() -> Result<()> {
    let db_url = env(
        &["OUTBOX_BENCH_DATABASE_URL", "DATABASE_URL"],
        "postgres://postgres@127.0.0.1:5432/test",
    );
    let amqp_url = env(
        &["OUTBOX_BENCH_AMQP_URL", "AMQP_URL"],
        "amqp://guest:guest@127.0.0.1:5672",
    );
    let rows: usize = env(&["OUTBOX_BENCH_ROWS"], "100000").parse()?;
    let ordered_rows: usize = env(&["OUTBOX_BENCH_ORDERED_ROWS"], "20000").parse()?;
    let ordered_cap =
        Duration::from_secs_f64(env(&["OUTBOX_BENCH_ORDERED_CAP_SECS"], "120").parse()?);
    let consumed: usize = env(&["OUTBOX_BENCH_CONSUMED"], "10000").parse()?;
    let ordered_batch: Option<usize> = std::env::var("OUTBOX_BENCH_ORDERED_BATCH")
        .ok()
        .map(|b| b.parse())
        .transpose()?;
    let ordered_concurrency: Option<usize> = std::env::var("OUTBOX_BENCH_ORDERED_CONCURRENCY")
        .ok()
        .map(|c| c.parse())
        .transpose()?;
    let filter = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    let wanted = |name: &str| filter.as_deref().is_none_or(|f| name.contains(f));

    let mut broker = Broker::connect()?;
    broker.declare()?;
    let mut client = Client::connect(&db_url, NoTls)?;

    let mut broker_rate = None;
    if wanted("broker-confirmed") {
        broker.purge()?;
        let rate = broker.confirmed_publish_rate(rows, 500)?;
        println!("bench=broker-confirmed messages={rows} window=500 rate={rate:.0}");
        broker_rate = Some(rate);
    }
    let mut naive_rate = None;
    if wanted("relay-naive") {
        // The textbook relay is slow; a fifth of the rows gives a stable rate.
        let n = (rows / 5).max(1000);
        let outbox = prefilled(&mut client, n)?;
        broker.purge()?;
        let rate = naive_relay(&mut client, &outbox, &broker.channel, 100)?;
        println!("bench=relay-naive rows={n} batch=100 rate={rate:.0}");
        naive_rate = Some(rate);
        drop_outbox(&mut client, &outbox)?;
    }
    if wanted("relay-rabbitmq") {
        for (batch, concurrency) in [(100, 4), (500, 2), (500, 4)] {
            let outbox = prefilled(&mut client, rows)?;
            broker.purge()?;
            let config = rabbit_relay(&db_url, &amqp_url, &outbox, 4)?
                .batch_size(batch)
                .concurrency(concurrency)
                .notify(false)
                .poll_interval(Duration::from_millis(100));
            let cpu = CpuTimes::now();
            let rate = drain(&mut client, &outbox, config, rows, RELAY_TIMEOUT)?
                .complete()?
                .rate();
            let mut line = format!(
                "bench=relay-rabbitmq rows={rows} batch={batch} concurrency={concurrency} \
                 rate={rate:.0} {}",
                cpu.report(rows)
            );
            if let Some(naive) = naive_rate {
                line.push_str(&format!(" vs_naive={:.1}", rate / naive));
            }
            if let Some(ceiling) = broker_rate {
                line.push_str(&format!(" vs_broker={:.2}", rate / ceiling));
            }
            println!("{line}");
            drop_outbox(&mut client, &outbox)?;
        }
    }
    if wanted("rabbitmq-ordered") {
        let setting = |value: Option<usize>| value.map_or("default".to_owned(), |v| v.to_string());
        let mut unordered = None;
        // Each shape's ceiling, the broker alone publishing as the relay must: rounds of 100
        // (a batch of rows free to go together: no key, or each row its own aggregate), and
        // strict order's streams, every aggregate's next message waiting for its confirm.
        let mut ceilings = HashMap::new();
        for (window, shapes) in [(100, &[Shape::Unordered, Shape::Unique][..]), (40, &[])] {
            broker.purge()?;
            let cpu = CpuTimes::now();
            let rate = broker.confirmed_publish_rate(10_000, window)?;
            println!(
                "bench=broker-confirmed messages=10000 window={window} rate={rate:.0} {}",
                cpu.report(10_000)
            );
            for shape in shapes {
                ceilings.insert(shape.name(), ("vs_rounds", rate));
            }
        }
        for (shape, streams, connections, messages) in [
            (Shape::Agg40, 40, 1, 10_000),
            (Shape::Agg40, 40, 4, 10_000),
            (Shape::Hot1, 1, 1, 2_000),
        ] {
            broker.purge()?;
            let cpu = CpuTimes::now();
            let rate = confirmed_stream_rate(messages, streams, connections)?;
            println!(
                "bench=broker-streams messages={messages} streams={streams} \
                 connections={connections} rate={rate:.0} {}",
                cpu.report(messages)
            );
            if connections == 1 {
                ceilings.insert(shape.name(), ("vs_streams", rate));
            }
        }
        // Confirm rounds, then the ordered shapes again with runs pipelined.
        let runs = Shape::ALL
            .into_iter()
            .map(|shape| (shape, false))
            .chain(Shape::ALL.into_iter().skip(1).map(|shape| (shape, true)));
        for (shape, pipeline) in runs {
            let outbox = fresh_outbox(&mut client)?;
            prefill_rows(&mut client, &outbox, ordered_rows, PAYLOAD, shape)?;
            broker.purge()?;
            let mut config = rabbit_relay(&db_url, &amqp_url, &outbox, DEFAULT_RELAY_POOL_SIZE)?
                .pipeline_runs(pipeline);
            if let Some(batch) = ordered_batch {
                config = config.batch_size(batch);
            }
            if let Some(concurrency) = ordered_concurrency {
                config = config.concurrency(concurrency);
            }
            let cpu = CpuTimes::now();
            let drained = drain(&mut client, &outbox, config, ordered_rows, ordered_cap)?;
            let rate = drained.rate();
            let unordered = *unordered.get_or_insert(rate);
            let mut line = format!(
                "bench=rabbitmq-ordered pipeline_runs={pipeline} shape={} rows={ordered_rows} \
                 batch={} concurrency={} rate={} vs_unordered={} {} {}",
                shape.name(),
                setting(ordered_batch),
                setting(ordered_concurrency),
                fmt_rate(rate),
                ratio(rate, unordered),
                cpu.report(drained.sent as usize),
                drained.cycle_report(),
            );
            if let (false, Some((label, ceiling))) = (pipeline, ceilings.get(shape.name())) {
                line.push_str(&format!(" {label}={}", ratio(rate, *ceiling)));
            }
            if drained.capped {
                line.push_str(&format!(" sent={} capped=true", drained.sent));
            }
            println!("{line}");
            drop_outbox(&mut client, &outbox)?;
        }
    }
    if wanted("latency") {
        broker.purge()?;
        latency(&mut client, &db_url, &amqp_url, 300)?;
    }
    if wanted("consumer") {
        for round in 1..=2 {
            for (concurrency, aggregates) in [(1, None), (1, Some(40)), (4, None), (4, Some(40))] {
                let shape = if aggregates.is_some() {
                    "agg40"
                } else {
                    "unordered"
                };
                let outbox = fresh_outbox(&mut client)?;
                let cpu = CpuTimes::now();
                let db_only = db_only_rate(&db_url, &outbox, consumed, concurrency)?;
                let db_only_cpu = cpu.per_op(consumed);
                drop_outbox(&mut client, &outbox)?;
                let outbox = fresh_outbox(&mut client)?;
                // The broker's work filling the queue is not the consumer's.
                Broker::connect()?.fill(CONSUMED, consumed, aggregates)?;
                let cpu = CpuTimes::now();
                let rate = consumer_rate(&db_url, &amqp_url, &outbox, consumed, concurrency)?;
                let consumer_cpu = cpu.per_op(consumed);
                drop_outbox(&mut client, &outbox)?;
                println!(
                    "bench=consumer round={round} concurrency={concurrency} shape={shape} \
                     messages={consumed} db_only={} rate={} vs_db_only={} \
                     db_only_cpu_us={:.0} cpu_us={:.0} broker_cpu_us={}",
                    fmt_rate(db_only),
                    fmt_rate(rate),
                    ratio(rate, db_only),
                    db_only_cpu.0,
                    consumer_cpu.0,
                    consumer_cpu
                        .1
                        .map_or("?".to_owned(), |us| format!("{us:.0}")),
                );
            }
        }
    }
    broker.remove()?;
    Ok(())
}

/// What a no-op consumer costs the database: `threads` threads, each with its own
/// connection, running one transaction per message (dedupe insert and commit) for its
/// share of `messages` keys.
fn db_only_rate(db_url: &str, outbox: &Outbox, messages: usize, threads: usize) -> Result<f64> {
    let next = AtomicUsize::new(0);
    let started = Instant::now();
    std::thread::scope(|scope| -> Result<()> {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                scope.spawn(|| -> std::result::Result<(), String> {
                    let mut client = Client::connect(db_url, NoTls).map_err(|e| e.to_string())?;
                    loop {
                        let n = next.fetch_add(1, Ordering::Relaxed);
                        if n >= messages {
                            return Ok(());
                        }
                        let mut tx = client.transaction().map_err(|e| e.to_string())?;
                        let key = format!("m-{n}");
                        outbox
                            .dedupe(&mut tx, "bench", &key)
                            .map_err(|e| e.to_string())?;
                        tx.commit().map_err(|e| e.to_string())?;
                    }
                })
            })
            .collect();
        for worker in workers {
            worker.join().map_err(|_| "a db-only thread panicked")??;
        }
        Ok(())
    })?;
    Ok(messages as f64 / started.elapsed().as_secs_f64())
}

/// A `Consumer` with a no-op handler draining `messages` from the filled queue.
fn consumer_rate(
    db_url: &str,
    amqp_url: &str,
    outbox: &Outbox,
    messages: usize,
    concurrency: usize,
) -> Result<f64> {
    let manager = PostgresConnectionManager::new(db_url.parse()?, NoTls);
    let pool = r2d2::Pool::builder()
        .max_size(concurrency as u32)
        .build(manager)?;
    let config = ConsumerConfig::new(amqp_url, CONSUMED, "bench")
        .concurrency(concurrency)
        .prefetch(64);
    let started = Instant::now();
    let consumer = Consumer::spawn(config, outbox.clone(), pool, |_tx, _delivery| Ok(()))?;
    let deadline = started + CONSUME_TIMEOUT;
    while (consumer.report().processed as usize) < messages {
        if Instant::now() > deadline {
            return Err(format!("consumer stalled: {:?}", consumer.report()).into());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let took = started.elapsed();
    consumer.shutdown(Duration::from_secs(10))?;
    Ok(messages as f64 / took.as_secs_f64())
}

/// CPU time (user and system) of this process, of the broker (`beam.smp`, if it runs on
/// this machine) and of the database (its `postgres` processes alive at both readings: a
/// relay's connections live through a drain), read from `/proc` in clock ticks of 10 ms
/// (Linux's USER_HZ).
struct CpuTimes {
    own: f64,
    broker: Option<f64>,
    database: HashMap<String, f64>,
}

impl CpuTimes {
    fn now() -> CpuTimes {
        CpuTimes {
            own: cpu_seconds("self").unwrap_or(0.0),
            broker: broker_pid().and_then(|pid| cpu_seconds(&pid)),
            database: pids_of("postgres")
                .into_iter()
                .filter_map(|pid| Some((pid.clone(), cpu_seconds(&pid)?)))
                .collect(),
        }
    }

    /// `cpu_us=` ours, `broker_cpu_us=` and `db_cpu_us=`: microseconds of CPU per message
    /// since `self`.
    fn report(&self, ops: usize) -> String {
        let later = CpuTimes::now();
        let (own, broker) = self.per_op(ops);
        let database: f64 = later
            .database
            .iter()
            .filter_map(|(pid, after)| Some(after - self.database.get(pid)?))
            .sum();
        format!(
            "cpu_us={own:.0} broker_cpu_us={} db_cpu_us={:.0}",
            broker.map_or_else(|| "-".to_owned(), |b| format!("{b:.0}")),
            database * 1e6 / ops.max(1) as f64
        )
    }

    /// Microseconds of CPU per operation since `self`: ours, and the broker's.
    fn per_op(&self, ops: usize) -> (f64, Option<f64>) {
        let later = CpuTimes::now();
        let per = |secs: f64| secs * 1e6 / ops.max(1) as f64;
        let broker = match (self.broker, later.broker) {
            (Some(before), Some(after)) => Some(per(after - before)),
            _ => None,
        };
        (per(later.own - self.own), broker)
    }
}

fn cpu_seconds(pid: &str) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name, which may hold spaces, ends with ')'.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks: f64 = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
    Some(ticks / 100.0)
}

fn broker_pid() -> Option<String> {
    pids_of("beam.smp").into_iter().next()
}

/// The processes whose command is `command`.
fn pids_of(command: &str) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|entry| {
            let comm = std::fs::read_to_string(entry.path().join("comm")).ok()?;
            (comm.trim() == command).then(|| entry.file_name().to_string_lossy().into_owned())
        })
        .collect()
}

/// A fresh, migrated, empty outbox.
fn fresh_outbox(client: &mut Client) -> Result<Outbox> {
    let table = format!("bench_rmq_{}", std::process::id());
    let outbox = Outbox::builder().table(table).notify(false).build()?;
    drop_outbox(client, &outbox)?;
    outbox.migrate(client)?;
    Ok(outbox)
}

/// A fresh outbox holding `rows` pending 512-byte messages.
fn prefilled(client: &mut Client, rows: usize) -> Result<Outbox> {
    let outbox = fresh_outbox(client)?;
    let payload = vec![b'x'; PAYLOAD];
    let mut left = rows;
    while left > 0 {
        let n = left.min(5000);
        let mut tx = client.transaction()?;
        outbox.enqueue_all(
            &mut tx,
            (0..n).map(|_| Message::new("bench.event", payload.clone())),
        )?;
        tx.commit()?;
        left -= n;
    }
    client.batch_execute("CHECKPOINT")?;
    Ok(outbox)
}

/// A relay configuration with default settings: `outbox` to `RabbitPublisher`s on
/// `EXCHANGE`, with a pool of `pool_size` connections.
fn rabbit_relay(
    db_url: &str,
    amqp_url: &str,
    outbox: &Outbox,
    pool_size: u32,
) -> Result<RelayConfig> {
    let manager = PostgresConnectionManager::new(db_url.parse()?, NoTls);
    let pool = r2d2::Pool::builder().max_size(pool_size).build(manager)?;
    let url = amqp_url.to_owned();
    Ok(RelayConfig::new(outbox.clone(), pool, move || {
        RabbitPublisher::connect(&url, EXCHANGE)
    }))
}

/// The textbook relay: in one transaction per batch, lock rows, publish each and wait for
/// its confirm, then UPDATE that row.
fn naive_relay(client: &mut Client, outbox: &Outbox, channel: &Channel, batch: i64) -> Result<f64> {
    let t = outbox.table();
    let confirms = channel.listen_for_publisher_confirms()?;
    let started = Instant::now();
    let mut total = 0usize;
    loop {
        let mut tx = client.transaction()?;
        let rows = tx.query(
            &format!(
                "SELECT id, key, topic, payload FROM {t} WHERE status = 'pending' \
                 ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED"
            ),
            &[&batch],
        )?;
        if rows.is_empty() {
            break;
        }
        for row in &rows {
            let id: i64 = row.get(0);
            let key: String = row.get(1);
            let topic: String = row.get(2);
            let payload: Vec<u8> = row.get(3);
            let properties = AmqpProperties::default()
                .with_delivery_mode(2)
                .with_message_id(key);
            channel.basic_publish(
                EXCHANGE,
                Publish::with_properties(&payload, topic, properties),
            )?;
            match confirms.recv()? {
                Confirm::Ack(_) => {}
                Confirm::Nack(_) => return Err("nacked".into()),
            }
            tx.execute(
                &format!("UPDATE {t} SET status = 'sent', done_at = now() WHERE id = $1"),
                &[&id],
            )?;
        }
        tx.commit()?;
        total += rows.len();
    }
    Ok(total as f64 / started.elapsed().as_secs_f64())
}

/// A confirming channel on a TCP_NODELAY socket, for setup and the baselines.
struct Broker {
    connection: Connection,
    channel: Channel,
}

impl Broker {
    fn connect() -> Result<Broker> {
        let socket = TcpStream::connect("127.0.0.1:5672")?;
        socket.set_nodelay(true)?;
        let options = ConnectionOptions::default().auth(Auth::Plain {
            username: "guest".into(),
            password: "guest".into(),
        });
        let mut connection = Connection::insecure_open_stream(
            mio::net::TcpStream::from_stream(socket)?,
            options,
            ConnectionTuning::default(),
        )?;
        let channel = connection.open_channel(None)?;
        channel.enable_publisher_confirms()?;
        Ok(Broker {
            connection,
            channel,
        })
    }

    fn declare(&self) -> Result<()> {
        let durable = ExchangeDeclareOptions {
            durable: true,
            ..ExchangeDeclareOptions::default()
        };
        self.channel
            .exchange_declare(ExchangeType::Topic, EXCHANGE, durable)?;
        let queue = QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        };
        self.channel.queue_declare(QUEUE, queue)?;
        self.channel
            .queue_bind(QUEUE, EXCHANGE, "#", FieldTable::new())?;
        Ok(())
    }

    /// Deletes what the bench declared, so a run leaves the broker as it found it.
    fn remove(&self) -> Result<()> {
        for queue in [
            QUEUE.to_owned(),
            CONSUMED.to_owned(),
            format!("{CONSUMED}.dead"),
        ] {
            self.channel.queue_delete(queue, Default::default())?;
        }
        self.channel.exchange_delete(EXCHANGE, Default::default())?;
        Ok(())
    }

    fn purge(&self) -> Result<()> {
        self.channel.queue_purge(QUEUE)?;
        Ok(())
    }

    /// Empties `queue` (declaring it if needed) and fills it with `messages` persistent
    /// 512-byte messages, confirmed, round-robin over `aggregates` aggregate keys if given.
    fn fill(&self, queue: &str, messages: usize, aggregates: Option<usize>) -> Result<()> {
        let durable = QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        };
        self.channel.queue_declare(queue, durable)?;
        self.channel.queue_purge(queue)?;
        let confirms = self.channel.listen_for_publisher_confirms()?;
        let payload = vec![b'x'; PAYLOAD];
        let mut tag = 0u64;
        let mut open: HashSet<u64> = HashSet::new();
        for n in 0..messages {
            let mut properties = AmqpProperties::default()
                .with_delivery_mode(2)
                .with_message_id(format!("m-{n}"));
            if let Some(aggregates) = aggregates {
                let mut headers = FieldTable::new();
                headers.insert(
                    AGGREGATE_HEADER.into(),
                    amiquip::AmqpValue::LongString(format!("agg-{}", n % aggregates)),
                );
                properties = properties.with_headers(headers);
            }
            self.channel
                .basic_publish("", Publish::with_properties(&payload, queue, properties))?;
            tag += 1;
            open.insert(tag);
            if open.len() >= 500 || n + 1 == messages {
                await_confirms(&confirms, &mut open)?;
            }
        }
        Ok(())
    }

    /// The broker's own ceiling: publish windows of messages, then drain their confirms.
    fn confirmed_publish_rate(&mut self, messages: usize, window: usize) -> Result<f64> {
        let mut channel = Confirmed::open(&mut self.connection)?;
        let started = Instant::now();
        let mut sent = 0;
        while sent < messages {
            let n = window.min(messages - sent);
            let mut open: HashSet<u64> = HashSet::with_capacity(n);
            for _ in 0..n {
                open.insert(channel.publish()?);
            }
            await_confirms(&channel.confirms, &mut open)?;
            sent += n;
        }
        let rate = messages as f64 / started.elapsed().as_secs_f64();
        channel.channel.close()?;
        Ok(rate)
    }
}

/// Strict order's ceiling: `streams` messages in flight, one per aggregate, split evenly over
/// `connections` connections of their own (as relay workers split aggregates), each confirm
/// letting its aggregate's next message go. Every confirm already received is settled
/// before the next messages go out, so they go out together.
fn confirmed_stream_rate(messages: usize, streams: usize, connections: usize) -> Result<f64> {
    let start = std::sync::Barrier::new(connections + 1);
    let (started, finished) = std::thread::scope(|scope| -> Result<(Instant, Vec<Result<()>>)> {
        let workers: Vec<_> = (0..connections)
            .map(|_| {
                let start = &start;
                scope.spawn(move || -> Result<()> {
                    let mut broker = Broker::connect()?;
                    let mut channel = Confirmed::open(&mut broker.connection)?;
                    start.wait();
                    let mut open: HashSet<u64> = HashSet::new();
                    let (mut sent, mut free) = (0, streams / connections);
                    let messages = messages / connections;
                    while sent < messages || !open.is_empty() {
                        while free > 0 && sent < messages {
                            open.insert(channel.publish()?);
                            (sent, free) = (sent + 1, free - 1);
                        }
                        let mut confirm = Some(channel.confirms.recv()?);
                        while let Some(received) = confirm {
                            free += settle(&mut open, received);
                            confirm = channel.confirms.try_recv().ok();
                        }
                    }
                    channel.channel.close()?;
                    Ok(())
                })
            })
            .collect();
        start.wait();
        let started = Instant::now();
        let finished = workers
            .into_iter()
            .map(|w| {
                w.join()
                    .unwrap_or_else(|_| Err("stream thread panicked".into()))
            })
            .collect();
        Ok((started, finished))
    })?;
    let elapsed = started.elapsed().as_secs_f64();
    finished.into_iter().collect::<Result<Vec<()>>>()?;
    Ok((messages / connections * connections) as f64 / elapsed)
}

/// A channel of its own with publisher confirms, so its delivery tags start at 1.
struct Confirmed {
    channel: Channel,
    confirms: crossbeam_channel::Receiver<Confirm>,
    payload: Vec<u8>,
    tag: u64,
}

impl Confirmed {
    fn open(connection: &mut Connection) -> Result<Confirmed> {
        let channel = connection.open_channel(None)?;
        channel.enable_publisher_confirms()?;
        let confirms = channel.listen_for_publisher_confirms()?;
        Ok(Confirmed {
            channel,
            confirms,
            payload: vec![b'x'; PAYLOAD],
            tag: 0,
        })
    }

    /// Publishes one persistent message to the bench's exchange; returns its delivery tag.
    fn publish(&mut self) -> Result<u64> {
        self.tag += 1;
        let properties = AmqpProperties::default()
            .with_delivery_mode(2)
            .with_message_id(self.tag.to_string());
        self.channel.basic_publish(
            EXCHANGE,
            Publish::with_properties(&self.payload, "bench.event", properties),
        )?;
        Ok(self.tag)
    }
}

/// Takes the tags `confirm` covers (acked or nacked) out of `open`; returns how many.
fn settle(open: &mut HashSet<u64>, confirm: Confirm) -> usize {
    let (Confirm::Ack(p) | Confirm::Nack(p)) = confirm;
    let before = open.len();
    if p.multiple {
        open.retain(|t| *t > p.delivery_tag);
    } else {
        open.remove(&p.delivery_tag);
    }
    before - open.len()
}

/// Waits until every tag in `open` is confirmed (acked or nacked).
fn await_confirms(
    confirms: &crossbeam_channel::Receiver<Confirm>,
    open: &mut HashSet<u64>,
) -> Result<()> {
    while !open.is_empty() {
        settle(open, confirms.recv()?);
    }
    Ok(())
}

/// A hook call and when: a notification heard (`None`) or a cycle ended.
type Seen = (Instant, Option<CycleTimes>);

/// What the relay's metrics hooks saw.
#[derive(Clone, Default)]
struct Stages(Arc<Mutex<Vec<Seen>>>);

impl Metrics for Stages {
    fn notified(&self) {
        if let Ok(mut seen) = self.0.lock() {
            seen.push((Instant::now(), None));
        }
    }
    fn cycle(&self, times: &CycleTimes) {
        if let Ok(mut seen) = self.0.lock() {
            seen.push((Instant::now(), Some(*times)));
        }
    }
}

/// `latency`: see the crate docs above.
fn latency(client: &mut Client, db_url: &str, amqp_url: &str, commits: usize) -> Result<()> {
    const WAIT: Duration = Duration::from_secs(10);
    let floor = notify_floor(client, db_url, commits)?;

    let table = format!("bench_rmq_latency_{}", std::process::id());
    let outbox = Outbox::builder().table(table).build()?;
    drop_outbox(client, &outbox)?;
    outbox.migrate(client)?;
    let stages = Stages::default();
    let config =
        rabbit_relay(db_url, amqp_url, &outbox, DEFAULT_RELAY_POOL_SIZE)?.metrics(stages.clone());
    let relay = Relay::spawn(config)?;

    // The consumer: every delivery's key and when it arrived.
    let (delivered_tx, delivered) = crossbeam_channel::unbounded::<(String, Instant)>();
    let (ready_tx, ready) = crossbeam_channel::bounded::<std::result::Result<(), String>>(1);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stopped = Arc::clone(&stop);
    let receiving = std::thread::spawn(move || -> Result<()> {
        let mut connection = Broker::connect()?.connection;
        let channel = connection.open_channel(None)?;
        let options = amiquip::ConsumerOptions {
            no_ack: true,
            ..amiquip::ConsumerOptions::default()
        };
        let consumer = channel.basic_consume(QUEUE, options)?;
        let _ = ready_tx.send(Ok(()));
        while !stopped.load(Ordering::SeqCst) {
            match consumer.receiver().recv_timeout(Duration::from_millis(100)) {
                Ok(amiquip::ConsumerMessage::Delivery(delivery)) => {
                    let at = Instant::now();
                    let key = delivery.properties.message_id().clone().unwrap_or_default();
                    let _ = delivered_tx.send((key, at));
                }
                Ok(_) => return Err("the consumer was cancelled".into()),
                Err(_) => {}
            }
        }
        connection.close()?;
        Ok(())
    });
    ready.recv_timeout(WAIT)??;
    let listening = Instant::now();
    while !relay.is_listening() {
        if listening.elapsed() > WAIT {
            return Err("the relay did not listen within 10 s".into());
        }
        std::thread::sleep(Duration::from_millis(10));
    }

    let payload = vec![b'x'; PAYLOAD];
    let mut totals = Vec::with_capacity(commits);
    let mut parts: [Vec<f64>; 6] = Default::default();
    for i in 0..commits {
        // Idle again: the last cycle recorded, the worker back on its wait.
        std::thread::sleep(Duration::from_millis(20));
        stages.0.lock().map_err(|_| "poisoned")?.clear();
        let key = format!("latency-{i}");
        let mut tx = client.transaction()?;
        outbox.enqueue(
            &mut tx,
            Message::new("bench.latency", payload.clone()).key(&key),
        )?;
        tx.commit()?;
        let committed = Instant::now();
        let arrived = delivery_of(&delivered, &key, WAIT)?;
        totals.push(ms(arrived - committed));
        // The cycle's hook runs after its record: wait for it.
        let waited = Instant::now();
        let seen = loop {
            let seen = stages.0.lock().map_err(|_| "poisoned")?.clone();
            if seen.iter().any(|(_, cycle)| cycle.is_some()) || waited.elapsed() > WAIT {
                break seen;
            }
            std::thread::sleep(Duration::from_millis(1));
        };
        let heard = seen.iter().find(|(_, cycle)| cycle.is_none()).map(|s| s.0);
        if let Some((ended, Some(cycle))) = seen.iter().find(|(_, cycle)| cycle.is_some()) {
            let recorded = *ended - cycle.record;
            let published = recorded - cycle.publish;
            let claim_sent = published - cycle.claim;
            if let Some(heard) = heard {
                parts[0].push(signed_ms(committed, heard));
                parts[1].push(signed_ms(heard, claim_sent));
            }
            parts[2].push(ms(cycle.claim));
            parts[3].push(ms(cycle.publish));
            parts[4].push(signed_ms(recorded, arrived));
            parts[5].push(ms(cycle.record));
        }
    }
    relay.shutdown(Duration::from_secs(10))?;

    // The broker's part of the same path, alone, in the same run: a persistent message
    // published on a confirmed channel to the consumer's queue, to its confirm and to the
    // consumer holding it.
    // Then the same right after a committed write to PostgreSQL, as a relay publishes right
    // after its claim commits (both servers flush to the same disk), and last through
    // `RabbitPublisher` (mandatory, with its properties and headers) after such a commit.
    let mut broker = Broker::connect()?;
    let mut confirmed = Confirmed::open(&mut broker.connection)?;
    let mut publisher = RabbitPublisher::connect(amqp_url, EXCHANGE)?;
    let scratch = format!("{}_floor", outbox.table());
    client.batch_execute(&format!(
        "CREATE TABLE {scratch} (n bigint); INSERT INTO {scratch} VALUES (0)"
    ))?;
    let write = format!("UPDATE {scratch} SET n = n + 1");
    // (name, after a commit, through RabbitPublisher): to the confirm, to the delivery.
    let mut floors = [
        ("broker", false, false, Vec::new(), Vec::new()),
        ("broker", true, false, Vec::new(), Vec::new()),
        ("publisher", true, true, Vec::new(), Vec::new()),
    ];
    for (_, after_commit, ours, to_confirm, to_delivery) in &mut floors {
        for i in 0..commits {
            std::thread::sleep(Duration::from_millis(20));
            if *after_commit {
                client.execute(&write, &[])?;
            }
            let started = Instant::now();
            let key = if !*ours {
                let tag = confirmed.publish()?;
                let mut open = HashSet::from([tag]);
                while !open.is_empty() {
                    settle(&mut open, confirmed.confirms.recv_timeout(WAIT)?);
                }
                tag.to_string()
            } else {
                let key = format!("floor-{i}");
                let record = Record::new(&key, "bench.latency", payload.clone());
                if let Some(Err(e)) = publisher.publish(&[record]).pop() {
                    return Err(e.to_string().into());
                }
                key
            };
            to_confirm.push(ms(started.elapsed()));
            to_delivery.push(signed_ms(started, delivery_of(&delivered, &key, WAIT)?));
        }
    }
    client.batch_execute(&format!("DROP TABLE {scratch}"))?;
    drop((confirmed, publisher));
    broker.connection.close()?;
    stop.store(true, Ordering::SeqCst);
    receiving.join().map_err(|_| "the consumer panicked")??;
    drop_outbox(client, &outbox)?;

    let woken_by_notify = parts[0].len();
    let [p50, p90, p99, max] = percentiles(&mut totals);
    let [floor50, _, floor99, _] = percentiles(&mut floor.clone());
    let mut line = format!(
        "bench=latency commits={commits} p50={p50:.2} p90={p90:.2} p99={p99:.2} max={max:.2} \
         notify_p50={floor50:.2} notify_p99={floor99:.2} woken_by_notify={woken_by_notify}"
    );
    for (name, values) in [
        "notified",
        "woken",
        "claim",
        "publish",
        "delivered",
        "record",
    ]
    .iter()
    .zip(parts.iter_mut())
    {
        let [p50, _, p99, _] = percentiles(values);
        line.push_str(&format!(" stage_{name}={p50:.2}/{p99:.2}"));
    }
    for (name, after_commit, ours, to_confirm, to_delivery) in &mut floors {
        let after = if *after_commit { "_after_commit" } else { "" };
        // RabbitPublisher::publish returns with the confirm.
        let confirm = if *ours { "" } else { "_confirm" };
        for (part, values) in [(confirm, to_confirm), ("_delivery", to_delivery)] {
            let [p50, _, p99, max] = percentiles(values);
            line.push_str(&format!(" {name}{part}{after}={p50:.2}/{p99:.2}/{max:.2}"));
        }
    }
    println!("{line}");
    Ok(())
}

/// When the consumer held the delivery with message id `key` (earlier ones are skipped).
fn delivery_of(
    delivered: &crossbeam_channel::Receiver<(String, Instant)>,
    key: &str,
    wait: Duration,
) -> Result<Instant> {
    loop {
        let (got, at) = delivered.recv_timeout(wait)?;
        if got == key {
            return Ok(at);
        }
    }
}

/// COMMIT of a bare `pg_notify` to its receipt on a listening connection, in ms, `commits`
/// times: the floor under any relay woken by notifications.
fn notify_floor(client: &mut Client, db_url: &str, commits: usize) -> Result<Vec<f64>> {
    let mut listener = Client::connect(db_url, NoTls)?;
    listener.batch_execute("LISTEN bench_notify_floor")?;
    let mut took = Vec::with_capacity(commits);
    for _ in 0..commits {
        let mut tx = client.transaction()?;
        tx.execute("SELECT pg_notify('bench_notify_floor', '')", &[])?;
        tx.commit()?;
        let committed = Instant::now();
        let mut notifications = listener.notifications();
        let mut waiting = notifications.timeout_iter(Duration::from_secs(10));
        if fallible_iterator::FallibleIterator::next(&mut waiting)?.is_none() {
            return Err("a notification did not arrive within 10 s".into());
        }
        took.push(ms(committed.elapsed()));
    }
    Ok(took)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// `to - from` in ms, negative when `to` came first.
fn signed_ms(from: Instant, to: Instant) -> f64 {
    match to.checked_duration_since(from) {
        Some(d) => ms(d),
        None => -ms(from - to),
    }
}

/// Median, 90th and 99th percentiles and maximum (0 for none).
fn percentiles(values: &mut [f64]) -> [f64; 4] {
    if values.is_empty() {
        return [0.0; 4];
    }
    values.sort_by(f64::total_cmp);
    let at = |q: f64| values[((values.len() - 1) as f64 * q).round() as usize];
    [at(0.5), at(0.9), at(0.99), values[values.len() - 1]]
}
