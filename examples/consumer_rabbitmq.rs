//! A consumer that processes each order event exactly once: the handler's writes and the
//! deduplication record commit in one PostgreSQL transaction, and the delivery is acked after.
//!
//! ```text
//! cargo run --example relay_rabbitmq --features rabbitmq     # produce some events first
//! cargo run --example consumer_rabbitmq --features rabbitmq
//! ```
//! Stops after two seconds without a delivery.

use std::error::Error;
use std::time::{Duration, Instant};

use postgres_outbox::rabbitmq::{Consumer, ConsumerConfig};
use postgres_outbox::{HandlerError, Outbox};
use r2d2_postgres::{postgres::NoTls, PostgresConnectionManager};

fn main() -> Result<(), Box<dyn Error>> {
    let database_url = env_or("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test");
    let amqp_url = env_or("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672");
    // One connection per handler thread.
    let pool = r2d2::Pool::builder()
        .max_size(2)
        .build(PostgresConnectionManager::new(database_url.parse()?, NoTls))?;
    // The inbox used for deduplication lives beside the outbox table.
    let outbox = Outbox::new("demo_outbox")?;
    let mut client = pool.get()?;
    outbox.migrate(&mut client)?;
    client.batch_execute(
        "CREATE TABLE IF NOT EXISTS demo_invoices (
             event_key text PRIMARY KEY, body text NOT NULL)",
    )?;
    drop(client);

    // Two handler threads; events of one order (its aggregate key) are still handled one at
    // a time, in order. A message that keeps failing ends in "outbox.demo.orders.dead".
    let config = ConsumerConfig::new(&amqp_url, "outbox.demo.orders", "invoicing")
        .prefetch(32)
        .concurrency(2);
    let consumer = Consumer::spawn(config, outbox, pool.clone(), |tx, delivery| {
        let body = String::from_utf8_lossy(&delivery.body).into_owned();
        // Every statement's error goes back with `?`: the consumer charges the message only
        // for its own faults (a constraint its data breaks), and holds it uncounted through
        // the database's (a timeout, a deadlock, a revoked grant). Never ignore an error and
        // return Ok: the transaction is aborted, and that counts as a failure. To let an
        // expected error pass, use a savepoint (`tx.transaction()`) or ON CONFLICT.
        tx.execute(
            "INSERT INTO demo_invoices (event_key, body) VALUES ($1, $2)",
            &[&delivery.key, &body],
        )
        .map_err(HandlerError::transient)?;
        println!("invoiced {} ({})", delivery.key, delivery.routing_key);
        Ok(())
    })?;

    let mut seen = consumer.report();
    let mut idle_since = Instant::now();
    while idle_since.elapsed() < Duration::from_secs(2) {
        std::thread::sleep(Duration::from_millis(100));
        let now = consumer.report();
        if now != seen {
            seen = now;
            idle_since = Instant::now();
        }
    }
    let report = consumer.shutdown(Duration::from_secs(10))?;
    println!("consumer stopped: {report:?}");
    Ok(())
}

fn env_or(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}
