//! The RabbitMQ side of the tests: a connection of their own for setup and inspection, and
//! the broker's own CLI.

use std::process::Command;

use amiquip::{
    AmqpProperties, AmqpValue, Channel, Connection, ExchangeDeclareOptions, ExchangeType,
    FieldTable, Publish, QueueDeclareOptions,
};
use postgres_outbox::rabbitmq::AGGREGATE_HEADER;

use super::{amqp_url, unique_name};

/// A broker connection for the test's own setup and inspection.
pub struct Broker {
    // Kept alive for the channel.
    _connection: Connection,
    pub channel: Channel,
}

impl Broker {
    pub fn new() -> Broker {
        Broker::at(&amqp_url())
    }

    pub fn at(url: &str) -> Broker {
        let mut connection = Connection::insecure_open(url).expect("connect to RabbitMQ");
        let channel = connection.open_channel(None).expect("channel");
        Broker {
            _connection: connection,
            channel,
        }
    }

    pub fn exchange(&self, name: &str) {
        self.channel
            .exchange_declare(
                ExchangeType::Topic,
                name,
                ExchangeDeclareOptions {
                    auto_delete: true,
                    ..ExchangeDeclareOptions::default()
                },
            )
            .expect("declare exchange");
    }

    /// A queue bound to `exchange` for every routing key.
    pub fn queue(&self, name: &str, exchange: &str, arguments: FieldTable) {
        self.channel
            .queue_declare(
                name,
                QueueDeclareOptions {
                    durable: true,
                    auto_delete: false,
                    arguments,
                    ..QueueDeclareOptions::default()
                },
            )
            .expect("declare queue");
        if !exchange.is_empty() {
            self.channel
                .queue_bind(name, exchange, "#", FieldTable::new())
                .expect("bind");
        }
    }

    /// A fresh durable queue on the default exchange, for a consumer to read.
    pub fn plain_queue(&self, name: &str) -> String {
        let queue = unique_name(&format!("q_{name}"));
        self.queue(&queue, "", FieldTable::new());
        queue
    }

    /// A fresh exchange and a fresh queue bound to it for every routing key.
    pub fn routed(&self, name: &str, arguments: FieldTable) -> (String, String) {
        let (exchange, queue) = (
            unique_name(&format!("x_{name}")),
            unique_name(&format!("q_{name}")),
        );
        self.exchange(&exchange);
        self.queue(&queue, &exchange, arguments);
        (exchange, queue)
    }

    pub fn ready(&self, queue: &str) -> u32 {
        self.channel
            .queue_declare_passive(queue)
            .expect("queue exists")
            .declared_message_count()
            .unwrap_or(0)
    }

    /// Takes every ready message off the queue.
    pub fn drain(&self, queue: &str) -> Vec<amiquip::Get> {
        let mut got = Vec::new();
        while let Some(message) = self.channel.basic_get(queue, true).expect("get") {
            got.push(message);
        }
        got
    }

    pub fn send(&self, queue: &str, key: Option<&str>, body: &[u8]) {
        let mut properties = AmqpProperties::default().with_delivery_mode(2);
        if let Some(key) = key {
            properties = properties.with_message_id(key.to_owned());
        }
        self.channel
            .basic_publish("", Publish::with_properties(body, queue, properties))
            .expect("publish");
    }

    /// Deletes an exchange (one no queue was ever bound to is not deleted automatically).
    pub fn delete_exchange(&self, name: &str) {
        let _ = self.channel.exchange_delete(name, Default::default());
    }

    /// Deletes the queue, and the dead-letter queue a consumer of it may have declared.
    pub fn delete_queue(&self, queue: &str) {
        for name in [queue.to_owned(), format!("{queue}.dead")] {
            let _ = self.channel.queue_delete(name, Default::default());
        }
    }

    /// Publishes a message with an aggregate key, as the relay does.
    pub fn send_ordered(&self, queue: &str, key: &str, aggregate: Option<&str>) {
        let mut headers = FieldTable::new();
        if let Some(aggregate) = aggregate {
            headers.insert(
                AGGREGATE_HEADER.into(),
                AmqpValue::LongString(aggregate.to_owned()),
            );
        }
        let properties = AmqpProperties::default()
            .with_delivery_mode(2)
            .with_message_id(key.to_owned())
            .with_headers(headers);
        self.channel
            .basic_publish(
                "",
                Publish::with_properties(key.as_bytes(), queue, properties),
            )
            .expect("publish");
    }
}

/// Runs the broker's own CLI, which the tests use for faults (closing connections,
/// revoking permissions, raising alarms), asserting it succeeded.
pub fn rabbitmqctl(args: &[&str]) {
    let status = Command::new("rabbitmqctl")
        .args(args)
        .status()
        .expect("run rabbitmqctl (the broker's own CLI)");
    assert!(status.success(), "rabbitmqctl {args:?} failed");
}
