//! What a trace context costs a producer: `Outbox::enqueue` of a message without one, with a
//! `traceparent`, with a `traceparent` and a `tracestate`, and (built with the feature
//! `opentelemetry`) with the context captured from the current span; and the same for 1,000
//! messages by `enqueue_all`.
//!
//! cargo bench --bench trace [--features opentelemetry]
//!
//! One connection, `synchronous_commit = off` (the disk's time moves more between turns
//! than the differences measured), the variants taking turns of a second, `TRACE_ROUNDS`
//! turns each (default 7); it prints the median turn of each in microseconds per
//! transaction (`enqueue`) or per message (`enqueue_all`), and `extra_us=` over the plain
//! message's median. Its schema is dropped at the end.

use std::time::{Duration, Instant};

use postgres::{Client, NoTls};
use postgres_outbox::{Message, Outbox};

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
const TRACESTATE: &str = "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE";
const BATCH: usize = 1000;

#[derive(Clone, Copy, PartialEq)]
enum Variant {
    Plain,
    Traceparent,
    WithState,
    #[cfg(feature = "opentelemetry")]
    Captured,
}

impl Variant {
    fn all() -> Vec<Variant> {
        vec![
            Variant::Plain,
            Variant::Traceparent,
            Variant::WithState,
            #[cfg(feature = "opentelemetry")]
            Variant::Captured,
        ]
    }

    fn name(self) -> &'static str {
        match self {
            Variant::Plain => "none",
            Variant::Traceparent => "traceparent",
            Variant::WithState => "traceparent+tracestate",
            #[cfg(feature = "opentelemetry")]
            Variant::Captured => "captured",
        }
    }

    fn message(self, n: u64) -> Message {
        let message = Message::new("order.created", vec![b'x'; 512])
            .aggregate_key(format!("order-{n}"))
            .content_type("application/json");
        match self {
            Variant::Traceparent => message.traceparent(TRACEPARENT),
            Variant::WithState => message.traceparent(TRACEPARENT).tracestate(TRACESTATE),
            _ => message,
        }
    }

    /// Runs `f` with the current OpenTelemetry context a sampled remote span's, for the
    /// variant that captures it.
    fn within<T>(self, f: impl FnOnce() -> T) -> T {
        #[cfg(feature = "opentelemetry")]
        if self == Variant::Captured {
            use opentelemetry::trace::{
                SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState,
            };
            let sc = SpanContext::new(
                TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").expect("hex"),
                SpanId::from_hex("00f067aa0ba902b7").expect("hex"),
                TraceFlags::SAMPLED,
                true,
                TraceState::default(),
            );
            let _current = opentelemetry::Context::new()
                .with_remote_span_context(sc)
                .attach();
            return f();
        }
        f()
    }
}

fn main() -> Result<()> {
    let url = std::env::var("OUTBOX_BENCH_DATABASE_URL")
        .or_else(|_| std::env::var("DATABASE_URL"))
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    let rounds: usize = std::env::var("TRACE_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(7);
    let schema = format!("outbox_bench_trace_{}", std::process::id());
    let mut client = Client::connect(&url, NoTls)?;
    client.batch_execute(&format!("CREATE SCHEMA {schema}"))?;
    let result = run(&mut client, &schema, rounds);
    client.batch_execute(&format!("DROP SCHEMA {schema} CASCADE"))?;
    result
}

fn run(client: &mut Client, schema: &str, rounds: usize) -> Result<()> {
    let outbox = Outbox::builder()
        .table(format!("{schema}.outbox"))
        .notify(false)
        .build()?;
    outbox.migrate(client)?;
    client.batch_execute("SET synchronous_commit = off")?;
    let variants = Variant::all();
    for batch in [false, true] {
        let mut turns: Vec<Vec<f64>> = vec![Vec::new(); variants.len()];
        let mut n = 0u64;
        for _ in 0..rounds {
            for (v, &variant) in variants.iter().enumerate() {
                let (mut spent, mut count) = (Duration::ZERO, 0u64);
                let started = Instant::now();
                while started.elapsed() < Duration::from_secs(1) {
                    let took = variant.within(|| -> Result<Duration> {
                        let begun = Instant::now();
                        let mut tx = client.transaction()?;
                        if batch {
                            let messages = (0..BATCH as u64).map(|i| variant.message(n + i));
                            outbox.enqueue_all(&mut tx, messages)?;
                        } else {
                            outbox.enqueue(&mut tx, variant.message(n))?;
                        }
                        tx.commit()?;
                        Ok(begun.elapsed())
                    })?;
                    n += if batch { BATCH as u64 } else { 1 };
                    spent += took;
                    count += if batch { BATCH as u64 } else { 1 };
                }
                turns[v].push(spent.as_secs_f64() * 1e6 / count as f64);
            }
            // Keeps the table the size of one turn, so that no variant inserts into a
            // larger one than the others.
            client.batch_execute(&format!("TRUNCATE {}", outbox.table()))?;
        }
        let medians: Vec<f64> = turns.iter_mut().map(|t| median(t)).collect();
        for (v, variant) in variants.iter().enumerate() {
            println!(
                "trace op={} context={} us={:.2} extra_us={:+.2} turns={}",
                if batch { "enqueue_all" } else { "enqueue" },
                variant.name(),
                medians[v],
                medians[v] - medians[0],
                rounds
            );
        }
    }
    Ok(())
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}
