//! `rabbitmq::Consumer` against a model of what it promises (issue 50), on the real
//! services: random messages (some of one aggregate, some of none), copies of them published
//! again, handlers scripted to succeed, fail, ignore a failed statement, panic, fail on a
//! fault of the database or give up for good, and restarts of the consumer in between. After
//! each run:
//!
//! - every message ends processed or dead-lettered, as its script says it must;
//! - each processed message's effects are committed exactly once, and a dead one's never;
//! - the handler ran exactly as often as the script says (a copy runs nothing);
//! - a dead letter's failure count is the failures charged: a fault of the database never is;
//! - one dead letter per dead message;
//! - per aggregate, effects committed in the order the messages were published.
#![cfg(feature = "rabbitmq")]

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use amiquip::AmqpValue;
use common::broker::Broker;
use common::*;
use postgres_outbox::rabbitmq::{Consumer, ConsumerConfig, ConsumerReport, DEAD_FAILURES_HEADER};
use postgres_outbox::{HandlerError, Outbox, Retry};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

/// Failures after which a message is dead-lettered.
const MAX_ATTEMPTS: u32 = 3;

/// What the handler does on one call for a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    /// Writes its effect and returns `Ok`.
    Ok,
    /// Writes its effect, then fails: rolled back, one failure.
    Fail,
    /// Writes its effect, runs a statement that fails, ignores that and returns `Ok`: the
    /// transaction is aborted, one failure.
    Swallow,
    /// Writes its effect and panics: one failure.
    Panic,
    /// A statement timeout, returned as a permanent error: the database's fault, uncharged.
    World,
    /// Gives up for good: dead at once.
    Permanent,
}

impl Step {
    fn charged(self) -> bool {
        matches!(
            self,
            Step::Fail | Step::Swallow | Step::Panic | Step::Permanent
        )
    }
}

#[derive(Debug, Clone)]
struct Message {
    aggregate: Option<u8>,
    /// The handler's calls, in order; past the end it succeeds.
    script: Vec<Step>,
    /// Published once more, right after (the relay's at-least-once).
    copied: bool,
}

#[derive(Debug, Clone)]
struct Run {
    messages: Vec<Message>,
    /// Restart the consumer after publishing this many.
    restart_after: Option<usize>,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        3 => Just(Step::Ok),
        2 => Just(Step::Fail),
        1 => Just(Step::Swallow),
        1 => Just(Step::Panic),
        2 => Just(Step::World),
        1 => Just(Step::Permanent),
    ]
}

fn message() -> impl Strategy<Value = Message> {
    (
        prop::option::weighted(0.7, 0u8..2),
        prop::collection::vec(step(), 0..4),
        prop::bool::weighted(0.2),
    )
        // Only a message that ends processed is copied: a copy of a dead-lettered one is a
        // new message to the consumer (a redriven one, say), handled afresh.
        .prop_map(|(aggregate, script, copied)| Message {
            aggregate,
            copied: copied && expected(&script).1.is_none(),
            script,
        })
}

fn run() -> impl Strategy<Value = Run> {
    prop::collection::vec(message(), 1..8).prop_flat_map(|messages| {
        let n = messages.len();
        (Just(messages), prop::option::of(0..=n)).prop_map(|(messages, restart_after)| Run {
            messages,
            restart_after,
        })
    })
}

/// What the model says becomes of a message: the handler's calls, and whether it ends dead
/// with the failures charged, or processed.
fn expected(script: &[Step]) -> (usize, Option<u32>) {
    let mut charged = 0;
    for (call, step) in script.iter().enumerate() {
        match step {
            Step::Ok => return (call + 1, None),
            Step::Permanent => return (call + 1, Some(charged + 1)),
            step if step.charged() => {
                charged += 1;
                if charged >= MAX_ATTEMPTS {
                    return (call + 1, Some(charged));
                }
            }
            _ => {}
        }
    }
    (script.len() + 1, None)
}

/// Each message's calls so far, by key.
type Calls = Arc<Mutex<HashMap<String, usize>>>;

fn spawn(
    outbox: &Outbox,
    queue: &str,
    name: &str,
    table: &str,
    scripts: &Arc<HashMap<String, Vec<Step>>>,
    calls: &Calls,
) -> Consumer {
    let (table, scripts, calls) = (table.to_owned(), scripts.clone(), calls.clone());
    Consumer::spawn(
        ConsumerConfig::new(&amqp_url(), queue, name)
            .concurrency(2)
            .retry(
                Retry::new(MAX_ATTEMPTS)
                    .backoff(Duration::from_millis(5), Duration::from_millis(20)),
            ),
        outbox.clone(),
        pool(2),
        move |tx, delivery| {
            let call = {
                let mut calls = calls.lock().unwrap();
                let call = calls.entry(delivery.key.clone()).or_default();
                *call += 1;
                *call - 1
            };
            let step = scripts[&delivery.key]
                .get(call)
                .copied()
                .unwrap_or(Step::Ok);
            if step == Step::World {
                tx.batch_execute("SET LOCAL statement_timeout = '1ms'; SELECT pg_sleep(1)")
                    .map_err(HandlerError::permanent)?;
            }
            tx.execute(
                &format!("INSERT INTO {table} (key) VALUES ($1)"),
                &[&delivery.key],
            )
            .map_err(HandlerError::transient)?;
            match step {
                Step::Ok | Step::World => Ok(()),
                Step::Fail => Err(HandlerError::transient("scripted failure")),
                Step::Swallow => {
                    let _ = tx.batch_execute("SELECT 1 / 0");
                    Ok(())
                }
                Step::Panic => panic!("{INJECTED} a scripted panic"),
                Step::Permanent => Err(HandlerError::permanent("scripted give-up")),
            }
        },
    )
    .unwrap()
}

fn check(outbox: &Outbox, broker: &Broker, run: &Run, case: usize) -> Result<(), TestCaseError> {
    let mut client = client();
    let queue = broker.plain_queue(&format!("model{case}"));
    let dead = format!("{queue}.dead");
    let name = unique_name("model");
    let table = unique_name("effects");
    client
        .batch_execute(&format!(
            "CREATE TABLE {table} (n bigserial PRIMARY KEY, key text NOT NULL)"
        ))
        .unwrap();
    let keys: Vec<String> = (0..run.messages.len()).map(|i| format!("m{i}")).collect();
    let scripts: Arc<HashMap<String, Vec<Step>>> = Arc::new(
        keys.iter()
            .cloned()
            .zip(run.messages.iter().map(|m| m.script.clone()))
            .collect(),
    );
    let calls = Calls::default();
    let mut consumer = spawn(outbox, &queue, &name, &table, &scripts, &calls);
    // Deliveries settled (acked or dead-lettered) by the consumers before this one.
    let mut earlier = 0;
    for (i, (key, message)) in keys.iter().zip(&run.messages).enumerate() {
        if run.restart_after == Some(i) {
            earlier += settled_by(consumer.shutdown(Duration::from_secs(10)).unwrap());
            consumer = spawn(outbox, &queue, &name, &table, &scripts, &calls);
        }
        let aggregate = message.aggregate.map(|a| format!("agg{a}"));
        for _ in 0..if message.copied { 2 } else { 1 } {
            broker.send_ordered(&queue, key, aggregate.as_deref());
        }
    }
    let outcomes: Vec<(usize, Option<u32>)> =
        run.messages.iter().map(|m| expected(&m.script)).collect();
    let deliveries: u64 = run.messages.iter().map(|m| 1 + u64::from(m.copied)).sum();
    let effects = |client: &mut postgres::Client| -> Vec<String> {
        client
            .query(&format!("SELECT key FROM {table} ORDER BY n"), &[])
            .unwrap()
            .iter()
            .map(|row| row.get(0))
            .collect()
    };
    // Settled: as many deliveries acked or dead-lettered as were published, and nothing
    // left on the queue; whether rightly, the checks below say.
    let settled = wait_while(|| {
        earlier + settled_by(consumer.report()) >= deliveries && broker.ready(&queue) == 0
    });
    let report = consumer.shutdown(Duration::from_secs(10)).unwrap();
    let committed = effects(&mut client);
    let letters = broker.drain(&dead);
    broker.delete_queue(&queue);
    client
        .batch_execute(&format!("DROP TABLE {table}"))
        .unwrap();
    let calls = calls.lock().unwrap().clone();
    for (key, (message, (want_calls, dies))) in keys.iter().zip(run.messages.iter().zip(&outcomes))
    {
        let got_calls = calls.get(key).copied().unwrap_or(0);
        prop_assert_eq!(
            got_calls,
            *want_calls,
            "handler calls of {} ({:?})",
            key,
            message
        );
        let effects = committed.iter().filter(|k| *k == key).count();
        let letter: Vec<_> = letters
            .iter()
            .filter(|l| l.delivery.properties.message_id().as_deref() == Some(key.as_str()))
            .collect();
        match dies {
            None => {
                prop_assert_eq!(effects, 1, "effects of {} ({:?})", key, message);
                prop_assert!(letter.is_empty(), "{} dead-lettered ({:?})", key, message);
            }
            Some(charged) => {
                prop_assert_eq!(effects, 0, "effects of dead {} ({:?})", key, message);
                prop_assert_eq!(letter.len(), 1, "dead letters of {} ({:?})", key, message);
                let failures = letter[0]
                    .delivery
                    .properties
                    .headers()
                    .as_ref()
                    .and_then(|h| h.get(DEAD_FAILURES_HEADER).cloned());
                prop_assert_eq!(
                    failures,
                    Some(AmqpValue::LongLongInt(i64::from(*charged))),
                    "failures charged to {} ({:?})",
                    key,
                    message
                );
            }
        }
    }
    for aggregate in 0..2u8 {
        let published: Vec<&String> = keys
            .iter()
            .zip(&run.messages)
            .filter(|(_, m)| m.aggregate == Some(aggregate))
            .map(|(k, _)| k)
            .filter(|k| committed.contains(k))
            .collect();
        let order: Vec<&String> = committed.iter().filter(|k| published.contains(k)).collect();
        prop_assert_eq!(order, published, "order of aggregate {}", aggregate);
    }
    prop_assert!(settled, "the run settled: {:?}", report);
    Ok(())
}

/// The deliveries a consumer acked or dead-lettered.
fn settled_by(report: ConsumerReport) -> u64 {
    report.processed + report.duplicates + report.rejected
}

/// Polls `condition` until it holds or a generous deadline passes; whether it held.
fn wait_while(mut condition: impl FnMut() -> bool) -> bool {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !condition() {
        if std::time::Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    true
}

#[test]
fn the_consumer_keeps_its_promises_over_random_runs() {
    let (outbox, _client) = outbox("consumer_model");
    let broker = Broker::new();
    let cases: u32 = std::env::var("OUTBOX_MODEL_CASES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(24);
    let mut runner = TestRunner::new(Config {
        cases,
        failure_persistence: None,
        // A failing run waits for the consumer to settle: shrinking is bounded.
        max_shrink_iters: 64,
        ..Config::default()
    });
    let case = std::sync::atomic::AtomicUsize::new(0);
    let result = runner.run(&run(), |run| {
        let n = case.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        check(&outbox, &broker, &run, n)
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}
