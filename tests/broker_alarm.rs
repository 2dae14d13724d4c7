//! A RabbitMQ resource alarm while the relay publishes: nothing is charged to the messages,
//! and publishing resumes once the alarm clears.
//!
//! A memory alarm blocks every publishing connection of the broker, so this test has a
//! binary of its own: cargo runs test binaries one after another, so no other test publishes
//! meanwhile. The alarm is raised with `rabbitmqctl set_vm_memory_high_watermark 0` and the
//! watermark put back as it was, whatever happens.
#![cfg(feature = "rabbitmq")]

mod common;

use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use amiquip::{Connection, ExchangeDeclareOptions, ExchangeType, FieldTable, QueueDeclareOptions};
use common::{amqp_url, count, unique_name, wait_until, Counters};
use postgres_outbox::rabbitmq::PublisherConfig;
use postgres_outbox::{Message, Relay, RelayConfig, Retry};

fn rabbitmqctl(args: &[&str]) -> String {
    let output = Command::new("rabbitmqctl")
        .args(args)
        .output()
        .expect("run rabbitmqctl (the broker's own CLI)");
    assert!(output.status.success(), "rabbitmqctl {args:?} failed");
    String::from_utf8_lossy(&output.stdout).trim().to_owned()
}

/// Raises a memory alarm; dropping it puts the watermark back as it was.
struct MemoryAlarm {
    watermark: String,
}

impl MemoryAlarm {
    fn raise() -> MemoryAlarm {
        let watermark = rabbitmqctl(&["eval", "vm_memory_monitor:get_vm_memory_high_watermark()."]);
        assert!(
            watermark.parse::<f64>().is_ok_and(|w| w > 0.0),
            "the broker runs with an unexpected watermark: {watermark}"
        );
        let alarm = MemoryAlarm { watermark };
        rabbitmqctl(&["set_vm_memory_high_watermark", "0"]);
        wait_until("the memory alarm is in effect", alarm_on);
        alarm
    }
}

impl Drop for MemoryAlarm {
    fn drop(&mut self) {
        rabbitmqctl(&["set_vm_memory_high_watermark", &self.watermark]);
    }
}

fn alarm_on() -> bool {
    rabbitmqctl(&["eval", "rabbit_alarm:get_alarms()."]).contains("memory")
}

#[test]
fn a_memory_alarm_costs_no_attempt_and_publishing_resumes_when_it_clears() {
    let url = amqp_url();
    let (exchange, queue) = (unique_name("x_alarm"), unique_name("q_alarm"));
    let mut connection = Connection::insecure_open(&url).expect("connect to RabbitMQ");
    let channel = connection.open_channel(None).expect("channel");
    channel
        .exchange_declare(
            ExchangeType::Topic,
            &exchange,
            ExchangeDeclareOptions::default(),
        )
        .expect("declare exchange");
    channel
        .queue_declare(
            &queue,
            QueueDeclareOptions {
                durable: true,
                ..QueueDeclareOptions::default()
            },
        )
        .expect("declare queue");
    channel
        .queue_bind(&queue, &exchange, "#", FieldTable::new())
        .expect("bind");

    let (outbox, mut client) = common::outbox("alarm");
    let enqueue = |client: &mut postgres::Client, prefix: &str| {
        let mut tx = client.transaction().unwrap();
        for i in 0..20 {
            let message = Message::new("t", i.to_string()).key(format!("{prefix}-{i}"));
            let message = if i % 2 == 0 {
                message.aggregate_key("a")
            } else {
                message
            };
            outbox.enqueue(&mut tx, message).unwrap();
        }
        tx.commit().unwrap();
    };
    let (metrics, builds) = (Counters::default(), Arc::new(AtomicUsize::new(0)));
    let factory = {
        let builds = builds.clone();
        let publishing = PublisherConfig::new(&url, &exchange)
            .unwrap()
            .confirm_timeout(Duration::from_secs(2));
        move || {
            builds.fetch_add(1, Ordering::SeqCst);
            publishing.connect()
        }
    };
    let relay = Relay::spawn(
        RelayConfig::new(outbox.clone(), common::pool(5), factory)
            .retry(Retry::new(2).backoff(Duration::from_millis(5), Duration::from_millis(10)))
            .poll_interval(Duration::from_millis(50))
            .metrics(metrics.clone()),
    )
    .unwrap();
    enqueue(&mut client, "before");
    wait_until("the first rows are sent", || {
        count(&mut client, &outbox, "status = 'sent'") == 20
    });

    let alarm = MemoryAlarm::raise();
    enqueue(&mut client, "during");
    wait_until("the relay sees the outage", || metrics.downs() == 1);
    // Long enough for a few probes of the blocked connection (one batch claimed and handed
    // back at each, on the relay's backoff): none of them costs an attempt.
    let released = metrics.released();
    wait_until("rows are handed back again and again", || {
        metrics.released() >= released + 40
    });
    assert_eq!(count(&mut client, &outbox, "status = 'sent'"), 20);
    assert_eq!(count(&mut client, &outbox, "status = 'dead'"), 0);
    assert_eq!(count(&mut client, &outbox, "attempts > 1"), 0);
    drop(alarm);

    wait_until("every row is sent", || {
        count(&mut client, &outbox, "status = 'sent'") == 40
    });
    relay.shutdown(Duration::from_secs(10)).unwrap();
    assert_eq!(count(&mut client, &outbox, "attempts <> 1"), 0);
    assert_eq!((metrics.downs(), metrics.ups()), (1, 2));
    // The blocked connection was kept, not rebuilt for every try.
    assert!(
        builds.load(Ordering::SeqCst) <= 8,
        "{builds:?} publishers built"
    );

    let ready = channel
        .queue_declare_passive(&queue)
        .expect("queue exists")
        .declared_message_count()
        .unwrap_or(0);
    // At least once: a batch published into the blocked connection may arrive twice.
    assert!(ready >= 40, "{ready} messages queued");
    channel.queue_delete(&queue, Default::default()).unwrap();
    channel
        .exchange_delete(&exchange, Default::default())
        .unwrap();
}
