// The README's quickstart: an order and its event commit together; a relay ships the event
// to RabbitMQ. `cargo run --example quickstart --features rabbitmq` (DATABASE_URL, AMQP_URL).
use std::time::Duration;

use amiquip::{
    Connection, ConsumerMessage, ConsumerOptions, ExchangeDeclareOptions, ExchangeType, FieldTable,
    QueueDeclareOptions,
};
use postgres::{Client, NoTls};
use postgres_outbox::rabbitmq::PublisherConfig;
use postgres_outbox::{Connections, Message, Outbox, Relay, RelayConfig};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let db = env_or("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test");
    let amqp = env_or("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672");

    // RabbitMQ: the exchange the relay publishes to, and a queue bound to it. The publisher
    // is mandatory: a message no queue takes is a failed attempt, never a silent drop.
    let mut rabbit = Connection::insecure_open(&amqp)?;
    let channel = rabbit.open_channel(None)?;
    let durable = ExchangeDeclareOptions {
        durable: true,
        ..Default::default()
    };
    let exchange = channel.exchange_declare(ExchangeType::Topic, "shop", durable)?;
    // Named by the server and exclusive: it goes away with this connection.
    let exclusive = QueueDeclareOptions {
        exclusive: true,
        ..Default::default()
    };
    let queue = channel.queue_declare("", exclusive)?;
    queue.bind(&exchange, "order.#", FieldTable::new())?;
    let deliveries = queue.consume(ConsumerOptions {
        no_ack: true,
        ..Default::default()
    })?;

    // PostgreSQL: the business table and the outbox (`migrate` is safe on every start).
    let mut client = Client::connect(&db, NoTls)?;
    client.batch_execute(
        "CREATE TABLE IF NOT EXISTS orders (id bigserial PRIMARY KEY, customer text NOT NULL)",
    )?;
    let outbox = Outbox::new("orders_outbox")?;
    outbox.migrate(&mut client)?;

    // The relay: threads on connections of their own that ship committed rows to the
    // exchange (routing key = topic, message id = key).
    let publisher = PublisherConfig::new(&amqp, "shop")?;
    let relay = Relay::spawn(RelayConfig::new(
        outbox.clone(),
        Connections::open(db.parse()?, NoTls),
        move || publisher.connect(),
    ))?;

    // The producer: the order and its event commit together, or not at all.
    let mut tx = client.transaction()?;
    let id: i64 = tx
        .query_one(
            "INSERT INTO orders (customer) VALUES ($1) RETURNING id",
            &[&"ada"],
        )?
        .get(0);
    let event = Message::new("order.created", format!(r#"{{"order_id":{id}}}"#))
        .aggregate_key(format!("order-{id}")) // in order per order
        .content_type("application/json");
    let key = outbox.enqueue(&mut tx, event)?;
    tx.commit()?;
    println!("order {id} committed with its event {key}");

    // The relay publishes it within milliseconds of the commit.
    loop {
        match deliveries
            .receiver()
            .recv_timeout(Duration::from_secs(30))?
        {
            ConsumerMessage::Delivery(d) if d.properties.message_id().as_deref() == Some(&key) => {
                println!(
                    "received {}: {}",
                    d.routing_key,
                    String::from_utf8_lossy(&d.body)
                );
                break;
            }
            ConsumerMessage::Delivery(_) => continue, // another run's order
            other => return Err(format!("the queue stopped: {other:?}").into()),
        }
    }

    // On the way out: stop claiming, let publishes under way finish, hand back the rest.
    let report = relay.shutdown(Duration::from_secs(10))?;
    println!("relay stopped: {report:?}");
    rabbit.close()?;
    Ok(())
}

fn env_or(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}
