//! The main example: orders written together with their events, relayed to RabbitMQ.
//!
//! ```text
//! cargo run --example relay_rabbitmq --features rabbitmq
//! ```
//! Uses DATABASE_URL (default postgres://postgres@127.0.0.1:5432/test) and AMQP_URL (default
//! amqp://guest:guest@127.0.0.1:5672). Declares the exchange `outbox.demo` and the queue
//! `outbox.demo.orders`, which `consumer_rabbitmq` then reads.

use std::error::Error;
use std::time::{Duration, Instant};

use amiquip::{Connection, ExchangeDeclareOptions, ExchangeType, FieldTable, QueueDeclareOptions};
use postgres_outbox::rabbitmq::RabbitPublisher;
use postgres_outbox::{Connections, Message, Outbox, Relay, RelayConfig};
use r2d2_postgres::{postgres::NoTls, PostgresConnectionManager};

const EXCHANGE: &str = "outbox.demo";
const QUEUE: &str = "outbox.demo.orders";

fn main() -> Result<(), Box<dyn Error>> {
    let database_url = env_or("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test");
    let amqp_url = env_or("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672");
    declare_topology(&amqp_url)?;

    let pool = r2d2::Pool::builder()
        .max_size(6)
        .build(PostgresConnectionManager::new(database_url.parse()?, NoTls))?;
    let outbox = Outbox::new("demo_outbox")?;
    let mut client = pool.get()?;
    outbox.migrate(&mut client)?;
    client.batch_execute(
        "CREATE TABLE IF NOT EXISTS demo_orders (
             id bigserial PRIMARY KEY, customer text NOT NULL, total_cents bigint NOT NULL)",
    )?;

    let url = amqp_url.clone();
    let relay = Relay::spawn(
        // The relay's own connections, with keepalives: none taken from the pool.
        RelayConfig::new(
            outbox.clone(),
            Connections::open(database_url.parse()?, NoTls),
            move || {
                // Mandatory by default: an unroutable message is a failed attempt, not a drop.
                RabbitPublisher::connect(&url, EXCHANGE)
            },
        )
        .batch_size(100)
        .concurrency(2),
    )?;

    // The business write and its event commit together, or not at all.
    let mut keys = Vec::new();
    for (customer, total_cents) in [("ada", 4200_i64), ("grace", 1999), ("edsger", 300)] {
        let mut tx = client.transaction()?;
        let id: i64 = tx
            .query_one(
                "INSERT INTO demo_orders (customer, total_cents) VALUES ($1, $2) RETURNING id",
                &[&customer, &total_cents],
            )?
            .get(0);
        let body =
            format!(r#"{{"order_id":{id},"customer":"{customer}","total_cents":{total_cents}}}"#);
        let key = outbox.enqueue(
            &mut tx,
            Message::new("order.created", body)
                .aggregate_key(format!("order-{id}"))
                .content_type("application/json"),
        )?;
        tx.commit()?;
        println!("order {id} for {customer}: event {key}");
        keys.push(key);
    }

    // A rolled-back order leaves no event behind.
    let mut tx = client.transaction()?;
    outbox.enqueue(&mut tx, Message::new("order.created", "never sent"))?;
    tx.rollback()?;

    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let stats = outbox.stats(&mut client)?;
        if stats.pending == 0 && stats.in_flight == 0 {
            println!("relayed: {stats:?}");
            break;
        }
        if Instant::now() > deadline {
            return Err(format!("events still pending after 30 s: {stats:?}").into());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let report = relay.shutdown(Duration::from_secs(10))?;
    println!("relay stopped: {report:?}");
    println!("now run: cargo run --example consumer_rabbitmq --features rabbitmq");
    Ok(())
}

fn env_or(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

/// The exchange the relay publishes to and a queue that keeps every order event.
fn declare_topology(amqp_url: &str) -> Result<(), Box<dyn Error>> {
    let mut connection = Connection::insecure_open(amqp_url)?;
    let channel = connection.open_channel(None)?;
    let options = ExchangeDeclareOptions {
        durable: true,
        ..ExchangeDeclareOptions::default()
    };
    channel.exchange_declare(ExchangeType::Topic, EXCHANGE, options)?;
    let queue = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    channel.queue_declare(QUEUE, queue)?;
    channel.queue_bind(QUEUE, EXCHANGE, "order.#", FieldTable::new())?;
    connection.close()?;
    Ok(())
}
