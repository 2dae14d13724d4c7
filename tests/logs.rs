//! Nothing the crate logs, stores or sends quotes a payload: the relay, the consumer and the
//! CLI run through failures whose server DETAIL quotes the failing row (a unique violation
//! on the payload itself), with every log line captured at trace level.
//!
//! A binary of its own: the logger is the process's.
#![cfg(feature = "cli")]

mod common;

use std::process::Command;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use common::broker::Broker;
use common::*;
use postgres::Client;
use postgres_outbox::rabbitmq::{Consumer, ConsumerConfig, DEAD_REASON_HEADER};
use postgres_outbox::{
    publisher_fn, HandlerError, Message, PublishError, Relay, RelayConfig, Retry,
};

/// Every log line the crate writes, at every level. (The PostgreSQL driver logs each
/// statement's parameters at debug level, target `tokio_postgres`: not the crate's doing,
/// and the CLI keeps it at info.)
struct Capture(Mutex<Vec<String>>);

impl log::Log for Capture {
    fn enabled(&self, _: &log::Metadata<'_>) -> bool {
        true
    }

    fn log(&self, record: &log::Record<'_>) {
        if record.target().starts_with("postgres_outbox") {
            self.0
                .lock()
                .unwrap()
                .push(format!("{} {}", record.level(), record.args()));
        }
    }

    fn flush(&self) {}
}

fn capture() -> &'static Capture {
    static CAPTURE: OnceLock<&'static Capture> = OnceLock::new();
    CAPTURE.get_or_init(|| {
        let capture: &'static Capture = Box::leak(Box::new(Capture(Mutex::new(Vec::new()))));
        log::set_logger(capture).expect("the only logger of this binary");
        log::set_max_level(log::LevelFilter::Trace);
        capture
    })
}

/// What the payloads say; it must appear nowhere.
const SECRET: &str = "card-4111-1111-1111-1111";

/// A table whose unique index makes a second insert of the same payload fail, with a DETAIL
/// that quotes it.
fn secret_table(client: &mut Client) -> String {
    let table = unique_name("secrets");
    client
        .batch_execute(&format!(
            "CREATE TABLE {table} (v text UNIQUE); INSERT INTO {table} VALUES ('{SECRET}')"
        ))
        .unwrap();
    table
}

/// Inserts `payload` into `table` again: a unique violation quoting the payload.
fn leak(client: &mut impl postgres::GenericClient, table: &str, payload: &[u8]) -> postgres::Error {
    client
        .execute(
            &format!("INSERT INTO {table} VALUES ($1)"),
            &[&String::from_utf8_lossy(payload).as_ref()],
        )
        .unwrap_err()
}

fn assert_nothing_quotes_the_payload(what: &str, lines: &[String]) {
    assert!(!lines.is_empty(), "{what}: nothing was logged");
    let quoting: Vec<&String> = lines.iter().filter(|l| l.contains(SECRET)).collect();
    assert!(quoting.is_empty(), "{what} quoted the payload: {quoting:?}");
}

#[test]
fn no_log_line_error_text_or_dead_letter_quotes_a_payload() {
    let capture = capture();
    let (outbox, mut client) = outbox("logs");
    let table = secret_table(&mut client);

    // The relay: failed attempts, then a dead letter, each with the violation as its error.
    let mut tx = client.transaction().unwrap();
    outbox
        .enqueue(
            &mut tx,
            Message::new("t", SECRET).key("secret").max_attempts(2),
        )
        .unwrap();
    tx.commit().unwrap();
    let db = Arc::new(Mutex::new(common::client()));
    let publish = {
        let (db, table) = (db.clone(), table.clone());
        move || {
            let (db, table) = (db.clone(), table.clone());
            Ok::<_, std::convert::Infallible>(publisher_fn(move |record| {
                let e = leak(&mut *db.lock().unwrap(), &table, &record.payload);
                Err(PublishError::transient(e))
            }))
        }
    };
    let config = RelayConfig::new(outbox.clone(), pool(RELAY_POOL), publish)
        .retry(Retry::default().backoff(Duration::from_millis(5), Duration::from_millis(10)));
    wait_until("the row is dead", || {
        let _ = Relay::run_once(&config);
        row_state(&mut client, &outbox, "secret").0 == "dead"
    });
    let stored: String = client
        .query_one(
            &format!(
                "SELECT last_error FROM {} WHERE key = 'secret'",
                quoted(&outbox)
            ),
            &[],
        )
        .unwrap()
        .get(0);
    assert!(
        stored.contains("23505") && !stored.contains(SECRET),
        "{stored}"
    );

    // The consumer: a handler whose insert fails the same way, to the dead-letter queue.
    let broker = Broker::new();
    let queue = broker.plain_queue("logs");
    broker.send(&queue, Some("consumed-secret"), SECRET.as_bytes());
    let handler_table = table.clone();
    let consumer = Consumer::spawn(
        ConsumerConfig::new(&amqp_url(), &queue, "logs")
            .retry(Retry::new(2).backoff(Duration::from_millis(5), Duration::from_millis(10))),
        outbox.clone(),
        pool(2),
        move |tx, delivery| {
            Err(HandlerError::transient(leak(
                tx,
                &handler_table,
                &delivery.body,
            )))
        },
    )
    .unwrap();
    let dead = format!("{queue}.dead");
    wait_until("the message is dead-lettered", || broker.ready(&dead) == 1);
    consumer.shutdown(Duration::from_secs(10)).unwrap();
    let letter = broker.drain(&dead).remove(0);
    let reason = match &letter.delivery.properties.headers().as_ref().unwrap()[DEAD_REASON_HEADER] {
        amiquip::AmqpValue::LongString(reason) => reason.clone(),
        other => panic!("{other:?}"),
    };
    assert!(
        reason.contains("23505") && !reason.contains(SECRET),
        "{reason}"
    );
    broker.delete_queue(&queue);

    // The CLI: a relay at trace level whose every publish is returned as unroutable.
    let mut tx = client.transaction().unwrap();
    outbox
        .enqueue(&mut tx, Message::new("nowhere", SECRET).key("cli-secret"))
        .unwrap();
    tx.commit().unwrap();
    let exchange = unique_name("x_logs");
    broker.exchange(&exchange);
    let binary = assert_cmd::cargo::cargo_bin("postgres-outbox");
    let log_path = std::env::temp_dir().join(format!("{exchange}.log"));
    let mut relay = Command::new(binary)
        .env("DATABASE_URL", database_url())
        .env("RUST_LOG", "trace")
        .args(["--table", outbox.table(), "relay", "--exchange", &exchange])
        .args(["--amqp-url", &amqp_url(), "--poll-interval", "50ms"])
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log_path).unwrap())
        .spawn()
        .unwrap();
    wait_until("the CLI's relay has failed an attempt", || {
        row_state(&mut client, &outbox, "cli-secret").1 >= 2
    });
    Command::new("kill")
        .args(["-TERM", &relay.id().to_string()])
        .status()
        .unwrap();
    relay.wait().unwrap();
    let text = std::fs::read_to_string(&log_path).unwrap();
    let _ = std::fs::remove_file(&log_path);
    let cli_log: Vec<String> = text.lines().map(str::to_owned).collect();
    assert!(
        cli_log.iter().any(|l| l.contains("unroutable")),
        "the CLI logged the failure"
    );
    assert_nothing_quotes_the_payload("the CLI", &cli_log);
    broker.delete_exchange(&exchange);

    let lines = capture.0.lock().unwrap().clone();
    assert!(
        lines.iter().any(|l| l.contains("23505")),
        "the failures were logged"
    );
    assert_nothing_quotes_the_payload("the library", &lines);
}

#[test]
fn a_relay_that_would_take_every_connection_of_its_pool_says_so_at_spawn() {
    let capture = capture();
    let (outbox, _client) = outbox("logs_pool");
    let warned = || {
        capture
            .0
            .lock()
            .unwrap()
            .iter()
            .filter(|l| l.starts_with("WARN") && l.contains(outbox.table()))
            .filter(|l| l.contains("keeps all of them checked out"))
            .count()
    };
    let factory = || Ok::<_, std::convert::Infallible>(publisher_fn(|_record| Ok(())));
    // One more than the relay keeps: nothing to say.
    let relay = Relay::spawn(RelayConfig::new(
        outbox.clone(),
        pool(RELAY_POOL + 1),
        factory,
    ))
    .unwrap();
    relay.shutdown(Duration::from_secs(10)).unwrap();
    assert_eq!(warned(), 0);
    // Exactly what it keeps: the application would wait for ever for one.
    let relay = Relay::spawn(RelayConfig::new(outbox.clone(), pool(RELAY_POOL), factory)).unwrap();
    relay.shutdown(Duration::from_secs(10)).unwrap();
    assert_eq!(warned(), 1);
}
