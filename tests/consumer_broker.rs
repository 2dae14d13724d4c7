//! The consumer and a broker that stops answering (issue 50): every call on the broker has a
//! deadline the crate enforces, a shutdown during a resource alarm ends on time and leaves no
//! thread behind, and a reconnect never lets a delivery overtake an earlier one of its
//! aggregate that the broker still holds on the old connection.
//!
//! A binary of its own: it captures the crate's log lines (the logger is the process's) and
//! counts the process's threads.
#![cfg(feature = "rabbitmq")]

mod common;

use std::sync::{Mutex, OnceLock, PoisonError};
use std::time::Duration;

use common::broker::Broker;
use common::faulty::{Faulty, Mode};
use common::proxy::broker_address;
use common::rabbit_node::RabbitNode;
use common::*;
use postgres_outbox::rabbitmq::{Consumer, ConsumerConfig};
use postgres_outbox::HandlerError;

/// The crate's warnings and errors.
struct Capture(Mutex<Vec<String>>);

impl log::Log for Capture {
    fn enabled(&self, _: &log::Metadata<'_>) -> bool {
        true
    }

    fn log(&self, record: &log::Record<'_>) {
        if record.target().starts_with("postgres_outbox") {
            self.0
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(record.args().to_string());
        }
    }

    fn flush(&self) {}
}

fn capture() -> &'static Capture {
    static CAPTURE: OnceLock<&'static Capture> = OnceLock::new();
    CAPTURE.get_or_init(|| {
        let capture: &'static Capture = Box::leak(Box::new(Capture(Mutex::new(Vec::new()))));
        log::set_logger(capture).expect("the only logger of this binary");
        log::set_max_level(log::LevelFilter::Warn);
        capture
    })
}

fn lines() -> Vec<String> {
    capture()
        .0
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .clone()
}

/// Waits until `condition` holds, failing with what the crate logged after a generous
/// deadline.
fn wait_for(what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !condition() {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting until {what}; logged: {:?}",
            lines()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn logged(text: &str) -> bool {
    lines().iter().any(|line| line.contains(text))
}

/// The names of this process's threads that are the library's or amiquip's.
fn library_threads() -> Vec<String> {
    let tasks = std::fs::read_dir("/proc/self/task").expect("read /proc/self/task");
    tasks
        .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("comm")).ok())
        .map(|name| name.trim().to_owned())
        .filter(|name| name.starts_with("outbox-") || name.starts_with("amiquip"))
        .collect()
}

/// During a memory alarm the broker stops reading the consumer's connection once it has
/// published a dead letter: a cancel or a channel's close would wait for the alarm to
/// clear. A shutdown still ends on time, says nothing false about handlers, and leaves no
/// thread or connection behind.
#[test]
fn a_shutdown_during_a_resource_alarm_ends_and_leaves_no_thread_behind() {
    capture();
    let node = RabbitNode::start(&[]);
    let url = node.url();
    let (outbox, _client) = outbox("alarm_consumer");
    let broker = Broker::at(&url);
    let queue = broker.plain_queue("alarm");
    let before = library_threads();
    let gate = Gate::default();
    let handler_gate = gate.clone();
    let consumer = Consumer::spawn(
        ConsumerConfig::new(&url, &queue, "alarmed"),
        outbox.clone(),
        pool(2),
        move |_tx, _delivery| {
            handler_gate.pass();
            Err(HandlerError::permanent("no such customer"))
        },
    )
    .unwrap();
    broker.send(&queue, Some("poison"), b"a");
    wait_until("the handler runs", || gate.waiting() == 1);
    // The test's own connection publishes nothing from here on: it stays unblocked.
    node.memory_alarm(true);
    gate.open();
    wait_until("the broker blocks the consumer's connection", || {
        node.blocked_connections() >= 1
    });
    consumer.shutdown(Duration::from_secs(2)).unwrap();
    wait_for("the consumer's threads have ended", || {
        library_threads() == before
    });
    assert!(
        !logged("a handler is still running"),
        "no handler was running: {:?}",
        lines()
    );
    node.memory_alarm(false);
    broker.delete_queue(&queue);
}

fn ordered_table(client: &mut postgres::Client) -> String {
    let table = unique_name("handled");
    client
        .batch_execute(&format!(
            "CREATE TABLE {table} (n bigserial PRIMARY KEY, key text UNIQUE NOT NULL)"
        ))
        .unwrap();
    table
}

fn handled(client: &mut postgres::Client, table: &str) -> Vec<String> {
    client
        .query(&format!("SELECT key FROM {table} ORDER BY n"), &[])
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect()
}

/// The consumer's connection is lost while the broker still holds it, with A1 (its handler
/// still running), A2 and A3 delivered on it and not acked: the consumer reconnects (to
/// another endpoint), and must not handle A4 before the broker has dropped the old
/// connection and handed A1, A2 and A3 back.
#[test]
fn a_reconnect_waits_for_the_broker_to_hand_back_what_the_old_connection_held() {
    capture();
    let (outbox, mut client) = outbox("reconnect_order");
    let table = ordered_table(&mut client);
    let broker = Broker::new();
    let queue = broker.plain_queue("reconnect_order");
    for n in 1..=5 {
        broker.send_ordered(&queue, &format!("A{n}"), Some("A"));
    }
    let proxy = Faulty::to(&broker_address(&amqp_url()));
    // Through the proxy first, without heartbeats: nothing but a close ends the connection
    // on the broker's side. Then straight to the broker.
    let urls = format!(
        "amqp://guest:guest@{}?heartbeat=0,{}",
        proxy.address(),
        amqp_url()
    );
    let gate = Gate::default();
    let (handler_gate, handler_table) = (gate.clone(), table.clone());
    let consumer = Consumer::spawn(
        ConsumerConfig::new(&urls, &queue, "ordered")
            .prefetch(3)
            .concurrency(2),
        outbox.clone(),
        pool(2),
        move |tx, delivery| {
            if delivery.key == "A1" {
                handler_gate.pass();
            }
            tx.execute(
                &format!("INSERT INTO {handler_table} (key) VALUES ($1)"),
                &[&delivery.key],
            )
            .map_err(HandlerError::transient)?;
            Ok(())
        },
    )
    .unwrap();
    wait_until("A1 is being handled, A2 and A3 held", || {
        gate.waiting() == 1
    });
    proxy.cut_clients();
    wait_for("the consumer reconnected, and waits or goes on", || {
        logged("did not confirm closing the last connection")
            || handled(&mut client, &table).contains(&"A4".to_owned())
    });
    gate.open();
    // The broker drops the old connection: A1, A2 and A3 go back to the queue.
    proxy.set(Mode::Refuse);
    wait_until("every message is handled", || {
        handled(&mut client, &table).len() == 5
    });
    let report = consumer.shutdown(Duration::from_secs(10)).unwrap();
    assert_eq!(
        handled(&mut client, &table),
        ["A1", "A2", "A3", "A4", "A5"],
        "{report:?}"
    );
    assert_eq!(report.processed, 5, "{report:?}");
    broker.delete_queue(&queue);
}
