//! Input from outside ends in a clear outcome: handled, dead-lettered with its reason, or
//! refused with a clear error; never a stuck consumer, never a silent loss. Messages the
//! database cannot store, dead letters the broker would refuse, dead-letter queues that
//! refuse, handlers that panic or hang.
#![cfg(feature = "rabbitmq")]

mod common;

use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use amiquip::{AmqpProperties, AmqpValue, FieldTable, Publish};
use common::broker::{rabbitmqctl, Broker};
use common::*;
use postgres_outbox::rabbitmq::{
    Consumer, ConsumerConfig, ConsumerReport, DEAD_EXPIRATION_HEADER, DEAD_REASON_HEADER,
    DEAD_USER_ID_HEADER,
};
use postgres_outbox::{HandlerError, Outbox, Retry};

/// A consumer of `queue` whose handler records each key it handled, in order.
fn consumer(
    config: ConsumerConfig,
    outbox: &Outbox,
    handled: &Arc<Mutex<Vec<String>>>,
) -> Consumer {
    let handled = handled.clone();
    Consumer::spawn(config, outbox.clone(), pool(4), move |_tx, delivery| {
        handled.lock().unwrap().push(delivery.key.clone());
        Ok(())
    })
    .unwrap()
}

fn config(queue: &str) -> ConsumerConfig {
    ConsumerConfig::new(&amqp_url(), queue, "bad_input")
        .retry(Retry::new(5).backoff(Duration::from_millis(10), Duration::from_millis(50)))
}

fn text_header(properties: &AmqpProperties, name: &str) -> Option<String> {
    match properties.headers().as_ref()?.get(name)? {
        AmqpValue::LongString(s) => Some(s.clone()),
        _ => None,
    }
}

/// Waits until the dead-letter queue of `queue` holds `n` messages, and takes them.
fn dead_letters(broker: &Broker, queue: &str, n: u32) -> Vec<amiquip::Get> {
    let dead = format!("{queue}.dead");
    wait_until("the dead letters are stored", || broker.ready(&dead) >= n);
    broker.drain(&dead)
}

/// (An id longer than `MAX_INDEXED_KEY` cannot arrive: AMQP carries at most 255 bytes in a
/// message id. `dedupe` refuses one from any other caller; see the core tests.)
#[test]
fn a_message_id_the_database_cannot_store_is_dead_lettered_at_once_and_the_rest_go_on() {
    let (outbox, _client) = outbox("bad_ids");
    let broker = Broker::new();
    let queue = broker.plain_queue("bad_ids");
    broker.send(&queue, Some("nul\0id"), b"1");
    broker.send(&queue, Some("fine-1"), b"2");
    broker.send(&queue, Some("fine-2"), b"3");
    let handled = Arc::new(Mutex::new(Vec::new()));
    let consumer = consumer(config(&queue), &outbox, &handled);
    wait_until("the good messages are handled", || {
        handled.lock().unwrap().len() == 2
    });
    let dead = dead_letters(&broker, &queue, 1);
    let report = consumer.shutdown(Duration::from_secs(10)).unwrap();
    assert_eq!(
        (report.processed, report.rejected, report.retried),
        (2, 1, 0)
    );
    assert_eq!(*handled.lock().unwrap(), ["fine-1", "fine-2"]);
    let reason = text_header(&dead[0].delivery.properties, DEAD_REASON_HEADER).unwrap();
    assert!(reason.contains("NUL"), "{reason}");
    broker.delete_queue(&queue);
}

#[test]
fn a_consumer_name_the_database_cannot_store_is_refused_before_connecting() {
    let (outbox, _client) = outbox("bad_name");
    for name in ["nul\0name", "tab\tname", ""] {
        let config = ConsumerConfig::new(&amqp_url(), "any", name);
        let e = Consumer::spawn(config, outbox.clone(), pool(1), |_, _| Ok(())).unwrap_err();
        assert!(e.to_string().contains("consumer name"), "{e}");
    }
}

/// Publishes a message whose message id is not UTF-8, which amiquip cannot send, through
/// the broker's own CLI.
fn send_invalid_utf8_id(queue: &str) {
    let expression = format!(
        "rabbit_basic:publish(rabbit_misc:r(<<\"/\">>, exchange, <<>>), <<\"{queue}\">>, \
         {{'P_basic', undefined, undefined, undefined, 2, undefined, undefined, undefined, \
         undefined, <<255, 254, 97>>, undefined, undefined, undefined, undefined, undefined}}, \
         <<\"body\">>)."
    );
    let status = Command::new("rabbitmqctl")
        .args(["eval", &expression])
        .status()
        .expect("run rabbitmqctl");
    assert!(status.success(), "publish through rabbitmqctl eval");
}

#[test]
fn a_message_id_that_is_not_utf8_does_not_stop_the_consumer() {
    let (outbox, _client) = outbox("bad_utf8");
    let broker = Broker::new();
    let queue = broker.plain_queue("bad_utf8");
    send_invalid_utf8_id(&queue);
    broker.send(&queue, Some("after"), b"x");
    let handled = Arc::new(Mutex::new(Vec::new()));
    let consumer = consumer(config(&queue), &outbox, &handled);
    wait_until("the next message is handled", || {
        handled.lock().unwrap().len() == 1
    });
    let report = consumer.shutdown(Duration::from_secs(10)).unwrap();
    assert_eq!(report.rejected, 1, "{report:?}");
    let dead = dead_letters(&broker, &queue, 1);
    // amiquip cannot read such an id and hands the message over without one.
    let reason = text_header(&dead[0].delivery.properties, DEAD_REASON_HEADER).unwrap();
    assert!(reason.contains("no usable message id"), "{reason}");
    broker.delete_queue(&queue);
}

#[test]
fn dead_letters_keep_no_expiration_and_no_foreign_user_id() {
    let (outbox, _client) = outbox("bad_props");
    let broker = Broker::new();
    let queue = broker.plain_queue("bad_props");
    let properties = AmqpProperties::default()
        .with_message_id("poison".into())
        .with_expiration("600000".into())
        .with_user_id("guest".into())
        .with_delivery_mode(2);
    broker
        .channel
        .basic_publish("", Publish::with_properties(b"x", &queue, properties))
        .unwrap();
    let consumer = Consumer::spawn(config(&queue), outbox.clone(), pool(2), |_, _| {
        Err(HandlerError::permanent("poison"))
    })
    .unwrap();
    let dead = dead_letters(&broker, &queue, 1);
    consumer.shutdown(Duration::from_secs(10)).unwrap();
    let properties = &dead[0].delivery.properties;
    assert_eq!(properties.expiration(), &None);
    assert_eq!(properties.user_id(), &None);
    assert_eq!(
        text_header(properties, DEAD_EXPIRATION_HEADER).as_deref(),
        Some("600000")
    );
    assert_eq!(
        text_header(properties, DEAD_USER_ID_HEADER).as_deref(),
        Some("guest")
    );
    broker.delete_queue(&queue);
}

#[test]
fn a_dead_letter_queue_that_refuses_holds_the_message_without_running_its_handler_again() {
    let (outbox, _client) = outbox("bad_dlq");
    // Its own vhost, so cutting its connections disturbs no other test.
    let vhost = unique_name("vh_dlq");
    rabbitmqctl(&["add_vhost", &vhost]);
    rabbitmqctl(&["set_permissions", "-p", &vhost, "guest", ".*", ".*", ".*"]);
    let url = format!("{}/{vhost}", amqp_url().trim_end_matches('/'));
    let broker = Broker::at(&url);
    let queue = broker.plain_queue("bad_dlq");
    // A dead-letter queue that is full and refuses more.
    let dead = format!("{queue}.dead");
    let mut arguments = FieldTable::new();
    arguments.insert("x-max-length".into(), AmqpValue::LongInt(2));
    arguments.insert(
        "x-overflow".into(),
        AmqpValue::LongString("reject-publish".into()),
    );
    broker.queue(&dead, "", arguments);
    broker.send(&dead, Some("already-there-1"), b"x");
    broker.send(&dead, Some("already-there-2"), b"x");
    broker.send(&queue, Some("poison"), b"x");
    broker.send_ordered(&queue, "poison-a", Some("a"));
    broker.send_ordered(&queue, "after-a", Some("a"));
    broker.send(&queue, Some("other"), b"x");
    let runs = Arc::new(AtomicUsize::new(0));
    let handled = Arc::new(Mutex::new(Vec::new()));
    let consumer = {
        let (runs, handled) = (runs.clone(), handled.clone());
        let config = ConsumerConfig::new(&url, &queue, "bad_input")
            .retry(Retry::new(5).backoff(Duration::from_millis(10), Duration::from_millis(50)));
        Consumer::spawn(config, outbox.clone(), pool(2), move |_, delivery| {
            if delivery.key.starts_with("poison") {
                runs.fetch_add(1, Ordering::SeqCst);
                return Err(HandlerError::permanent("poison"));
            }
            handled.lock().unwrap().push(delivery.key.clone());
            Ok(())
        })
        .unwrap()
    };
    wait_until("the unrelated message is handled", || {
        handled.lock().unwrap().contains(&"other".to_owned())
    });
    // Long enough for several refused tries of the dead letters; then the channel is lost
    // and both come again: still given up on, their handlers do not run again.
    std::thread::sleep(Duration::from_millis(1000));
    rabbitmqctl(&["close_all_connections", "-p", &vhost, "test: channel lost"]);
    let broker = Broker::at(&url);
    wait_until("the consumer has them again", || {
        broker.ready(&queue) == 0 && runs.load(Ordering::SeqCst) >= 2
    });
    std::thread::sleep(Duration::from_millis(1000));
    assert_eq!(
        runs.load(Ordering::SeqCst),
        2,
        "each poison ran its handler once"
    );
    // Order: what follows a dying message of its aggregate waits for it.
    assert!(!handled.lock().unwrap().contains(&"after-a".to_owned()));
    // Room in the dead-letter queue: both are stored, and the aggregate goes on.
    broker.drain(&dead);
    wait_until("the aggregate goes on", || {
        handled.lock().unwrap().contains(&"after-a".to_owned())
    });
    wait_until("both dead letters are stored", || broker.ready(&dead) == 2);
    let report = consumer.shutdown(Duration::from_secs(10)).unwrap();
    assert_eq!(report.rejected, 2, "{report:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    drop(broker);
    rabbitmqctl(&["delete_vhost", &vhost]);
}

#[test]
fn a_panicking_handler_is_a_failed_attempt_and_its_thread_lives_on() {
    let (outbox, _client) = outbox("bad_panic");
    let broker = Broker::new();
    let queue = broker.plain_queue("bad_panic");
    broker.send(&queue, Some("panics-twice"), b"x");
    broker.send(&queue, Some("fine"), b"x");
    let calls = Arc::new(AtomicUsize::new(0));
    let handled = Arc::new(Mutex::new(Vec::new()));
    let consumer = {
        let (calls, handled) = (calls.clone(), handled.clone());
        // One handler thread: it must survive the panics to handle the rest.
        Consumer::spawn(
            config(&queue).concurrency(1),
            outbox.clone(),
            pool(1),
            move |_, d| {
                if d.key == "panics-twice" && calls.fetch_add(1, Ordering::SeqCst) < 2 {
                    panic!("injected: a bug in the handler");
                }
                handled.lock().unwrap().push(d.key.clone());
                Ok(())
            },
        )
        .unwrap()
    };
    wait_until("both are handled", || handled.lock().unwrap().len() == 2);
    let report = consumer.shutdown(Duration::from_secs(10)).unwrap();
    assert_eq!(
        (report.processed, report.retried, report.rejected),
        (2, 2, 0),
        "{report:?}"
    );
    broker.delete_queue(&queue);
}

#[test]
fn shutdown_hands_held_deliveries_back_on_time_even_with_a_hung_handler() {
    let (outbox, _client) = outbox("bad_hung");
    let broker = Broker::new();
    let queue = broker.plain_queue("bad_hung");
    broker.send_ordered(&queue, "hangs", Some("a"));
    broker.send_ordered(&queue, "behind", Some("a"));
    broker.send(&queue, Some("held"), b"x");
    let release = Arc::new(AtomicBool::new(false));
    let started = Arc::new(AtomicBool::new(false));
    let consumer = {
        let (release, started) = (release.clone(), started.clone());
        Consumer::spawn(
            config(&queue).concurrency(1),
            outbox.clone(),
            pool(1),
            move |_, d| {
                if d.key == "hangs" {
                    started.store(true, Ordering::SeqCst);
                    while !release.load(Ordering::SeqCst) {
                        std::thread::sleep(Duration::from_millis(10));
                    }
                }
                Ok(())
            },
        )
        .unwrap()
    };
    wait_until("the handler hangs", || started.load(Ordering::SeqCst));
    let stopping = Instant::now();
    let report: ConsumerReport = consumer.shutdown(Duration::from_millis(500)).unwrap();
    assert!(
        stopping.elapsed() < Duration::from_secs(5),
        "{:?}",
        stopping.elapsed()
    );
    // The broker has every delivery back, the hung one included, while it still hangs.
    wait_until("every delivery is back in the queue", || {
        broker.ready(&queue) == 3
    });
    assert_eq!(report.processed, 0);
    release.store(true, Ordering::SeqCst);
    broker.delete_queue(&queue);
}
