//! Faults of the database are never a message's: an outage longer than the lease, a claim
//! whose reply is lost, a read-only window, a hot standby, a connection that stalls. Each
//! test has a PostgreSQL server of its own (tests/common/pg_node.rs), and a misbehaving proxy
//! in front of it where the fault is the network's (tests/common/faulty.rs); the shared
//! server is never touched.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::faulty::{Faulty, Mode};
use common::pg_node::{PgNode, Stopped};
use common::{wait_until, Counters, Gate, Sink};
use postgres::{Client, NoTls};
use postgres_outbox::{
    Connections, Message, Outbox, PublishError, Publisher, Record, Relay, RelayConfig, Retry,
};

/// An outbox on `node`, migrated, with a lease of `lease`.
fn outbox_on(node: &PgNode, lease: Duration) -> (Outbox, Client) {
    let outbox = Outbox::builder()
        .table("faults")
        .lease(lease)
        .build()
        .expect("valid outbox");
    let mut client = node.client();
    outbox.migrate(&mut client).expect("migrate");
    (outbox, client)
}

/// `n` messages `m-0`.., every other one allowed a single attempt: a relay that charged a
/// fault of the world to them would make those dead letters.
fn enqueue(client: &mut Client, outbox: &Outbox, n: usize) -> Vec<String> {
    let mut tx = client.transaction().expect("begin");
    let keys = (0..n)
        .map(|i| {
            let message = Message::new("t", format!("p{i}")).key(format!("m-{i}"));
            let message = if i % 2 == 0 {
                message.max_attempts(1)
            } else {
                message
            };
            outbox.enqueue(&mut tx, message).expect("enqueue")
        })
        .collect();
    tx.commit().expect("commit");
    keys
}

/// Relays that say they wait for work.
fn count_waiting(client: &mut Client) -> i64 {
    client
        .query_one("SELECT count(*) FROM faults_waiting", &[])
        .expect("count waiting relays")
        .get(0)
}

fn count(client: &mut Client, filter: &str) -> i64 {
    client
        .query_one(&format!("SELECT count(*) FROM faults WHERE {filter}"), &[])
        .expect("count")
        .get(0)
}

/// Every row sent, after exactly one attempt, with no claim left hanging, and none dead.
fn assert_all_sent_once(client: &mut Client, n: usize) {
    assert_eq!(count(client, "status = 'sent'"), n as i64);
    assert_eq!(count(client, "status IN ('dead', 'parked')"), 0);
    assert_eq!(
        count(client, "attempts <> 1"),
        0,
        "a fault of the world was charged to a message"
    );
    assert_eq!(count(client, "claims <> 0"), 0);
}

fn relay_to(
    url: &str,
    outbox: &Outbox,
    publisher: impl Publisher + Clone + Sync + 'static,
) -> RelayConfig {
    let connections = Connections::open(url.parse().expect("database URL"), NoTls);
    RelayConfig::new(outbox.clone(), connections, move || {
        Ok::<_, std::convert::Infallible>(publisher.clone())
    })
}

/// A publisher that records what it is handed, and before its first batch passes `gate`
/// (which the test opens once it has set the fault up); it says how many batches began.
#[derive(Clone)]
struct Held {
    sink: Sink,
    gate: Gate,
    began: Arc<AtomicUsize>,
}

impl Held {
    fn new() -> Held {
        Held {
            sink: Sink::default(),
            gate: Gate::default(),
            began: Arc::new(AtomicUsize::new(0)),
        }
    }

    fn began(&self) -> usize {
        self.began.load(Ordering::SeqCst)
    }
}

impl Publisher for Held {
    fn publish(&mut self, batch: &[Record]) -> Vec<Result<(), PublishError>> {
        self.began.fetch_add(1, Ordering::SeqCst);
        self.gate.pass();
        batch
            .iter()
            .map(|record| {
                self.sink.push(record);
                Ok(())
            })
            .collect()
    }
}

#[test]
fn an_outage_longer_than_the_lease_charges_nothing_and_kills_nothing_that_was_published() {
    let node = PgNode::start();
    let (outbox, mut client) = outbox_on(&node, Duration::from_secs(3));
    let keys = enqueue(&mut client, &outbox, 20);
    let publisher = Held::new();
    let relay = Relay::spawn(
        relay_to(&node.url(), &outbox, publisher.clone())
            .batch_size(20)
            .concurrency(2),
    )
    .unwrap();
    wait_until("the batch is being published", || publisher.began() == 1);

    // The database goes away while the batch is out, for longer than its lease.
    node.stop();
    publisher.gate.open();
    std::thread::sleep(Duration::from_secs(5));
    node.start_again();

    let mut client = node.client();
    wait_until("every message is recorded sent", || {
        count(&mut client, "status = 'sent'") == 20
    });
    relay.shutdown(Duration::from_secs(10)).unwrap();
    assert_all_sent_once(&mut client, 20);
    for key in &keys {
        assert!(publisher.sink.contains(key), "{key} was never published");
    }
}

#[test]
fn a_claim_whose_reply_is_lost_costs_no_attempt_and_the_message_is_published() {
    let node = PgNode::start();
    let (outbox, mut client) = outbox_on(&node, Duration::from_secs(2));
    let proxy = Faulty::to(&node.address());
    let lost = Held::new();
    lost.gate.open();
    // The worker's connection goes through the proxy; the listener's does not, so the
    // worker claims only when a notification wakes it (hourly polls), never mid-switch.
    let first = Relay::spawn(
        relay_to(
            &format!("postgres://postgres@{}/postgres", proxy.address()),
            &outbox,
            lost.clone(),
        )
        .listen_connection(node.url().parse().unwrap(), NoTls)
        .poll_interval(Duration::from_secs(3600))
        .concurrency(1),
    )
    .unwrap();
    let waits_for_work = |client: &mut Client| {
        count_waiting(client) == 1
            && client
                .query_one(
                    "SELECT count(*) FROM pg_stat_activity
                     WHERE application_name = 'outbox relay faults' AND state = 'idle'",
                    &[],
                )
                .map(|row| row.get::<_, i64>(0) == 1)
                .unwrap_or(false)
    };
    wait_until("the first relay's worker waits for work", || {
        waits_for_work(&mut client)
    });
    // One message through first: the relay works through the proxy.
    let mut tx = client.transaction().unwrap();
    outbox
        .enqueue(&mut tx, Message::new("t", "warm-up").key("warm-up"))
        .unwrap();
    tx.commit().unwrap();
    // Then the worker's last claims after it (one more, and one after it says it waits)
    // are over: none is in flight when the rows below commit.
    let idle_a_second = |client: &mut Client| {
        client
            .query_one(
                "SELECT count(*) FROM pg_stat_activity
                 WHERE application_name = 'outbox relay faults' AND state = 'idle'
                   AND state_change < now() - interval '1 second'",
                &[],
            )
            .map(|row| row.get::<_, i64>(0) == 1)
            .unwrap_or(false)
    };
    wait_until(
        "the first message is sent, and the worker waits again",
        || {
            count(&mut client, "status = 'sent'") == 1
                && waits_for_work(&mut client)
                && idle_a_second(&mut client)
        },
    );

    // The server takes the next claim and commits it; its answer never reaches the relay.
    // The proxy drops every reply from the first claim the worker sends after the fault is
    // set (its statement takes a lease), whatever else the worker sends meanwhile (its
    // report, its announcement that it waits). The rows are in before, unannounced, and
    // the worker is woken after: that claim sees them.
    let unannounced = Outbox::builder()
        .table("faults")
        .notify(false)
        .build()
        .unwrap();
    enqueue(&mut client, &unannounced, 10);
    proxy.set(Mode::DropRepliesFrom("lease_until = CASE"));
    client.batch_execute("SELECT faults_notify()").unwrap();
    wait_until(
        "the rows are claimed by a relay that never hears of it",
        || count(&mut client, "claims = 1 AND status = 'pending'") == 10,
    );

    // Another relay takes them once any lease on them has run out.
    let second = Held::new();
    second.gate.open();
    let relay = Relay::spawn(
        relay_to(&node.url(), &outbox, second.clone())
            .notify(false)
            .poll_interval(Duration::from_millis(100)),
    )
    .unwrap();
    wait_until("every message is recorded sent", || {
        count(&mut client, "status = 'sent'") == 11
    });
    relay.shutdown(Duration::from_secs(10)).unwrap();
    assert_eq!(lost.sink.len(), 1, "the first relay never had the rows");
    assert_eq!(second.sink.len(), 10);
    assert_all_sent_once(&mut client, 11);
    // The first relay gave its stalled connection up; it stops within its deadline.
    proxy.set(Mode::Refuse);
    first.shutdown(Duration::from_secs(10)).unwrap();
}

#[test]
fn a_read_only_window_mid_batch_charges_nothing() {
    let node = PgNode::start();
    let (outbox, mut client) = outbox_on(&node, Duration::from_secs(10));
    enqueue(&mut client, &outbox, 10);
    let publisher = Held::new();
    let relay = Relay::spawn(
        relay_to(&node.url(), &outbox, publisher.clone())
            .batch_size(10)
            .concurrency(1),
    )
    .unwrap();
    wait_until("the batch is being published", || publisher.began() == 1);

    // As a planned switchover fences the old primary: every transaction read-only.
    node.read_only(true);
    publisher.gate.open();
    wait_until("the relay has tried to record and been refused", || {
        node.client()
            .query_one(
                "SELECT count(*) FROM pg_stat_database WHERE datname = 'postgres' \
                 AND xact_rollback > 0",
                &[],
            )
            .map(|row| row.get::<_, i64>(0) > 0)
            .unwrap_or(false)
    });
    std::thread::sleep(Duration::from_secs(2));
    node.read_only(false);

    wait_until("every message is recorded sent", || {
        count(&mut client, "status = 'sent'") == 10
    });
    relay.shutdown(Duration::from_secs(10)).unwrap();
    assert_all_sent_once(&mut client, 10);
    // The outcomes waited for the window to close: nothing was left to its lease and
    // published again.
    assert_eq!(publisher.sink.len(), 10);
}

#[test]
fn spawn_refuses_a_read_only_server_and_a_hot_standby_and_a_multi_host_url_finds_the_primary() {
    let primary = PgNode::start();
    let (outbox, mut client) = outbox_on(&primary, Duration::from_secs(10));
    let standby = PgNode::standby_of(&primary);
    let config = |url: &str| relay_to(url, &outbox, Held::new());

    let e = Relay::spawn(config(&standby.url())).unwrap_err();
    assert!(e.is_read_only(), "{e}");
    // Through a pool too.
    let pool = r2d2::Pool::builder()
        .max_size(6)
        .build(r2d2_postgres::PostgresConnectionManager::new(
            standby.url().parse().unwrap(),
            NoTls,
        ))
        .unwrap();
    let pooled = RelayConfig::new(outbox.clone(), pool, || {
        Ok::<_, std::convert::Infallible>(Held::new())
    });
    let e = Relay::spawn(pooled).unwrap_err();
    assert!(e.is_read_only(), "{e}");

    // A standby first among the hosts, as after a failover: the relay works on the primary.
    enqueue(&mut client, &outbox, 4);
    let publisher = Held::new();
    publisher.gate.open();
    let url = format!(
        "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/postgres",
        standby.port(),
        primary.port()
    );
    let relay = Relay::spawn(relay_to(&url, &outbox, publisher.clone())).unwrap();
    wait_until("every message is recorded sent", || {
        count(&mut client, "status = 'sent'") == 4
    });
    relay.shutdown(Duration::from_secs(10)).unwrap();

    // A primary made read-only is refused as well.
    primary.read_only(true);
    let e = Relay::spawn(config(&primary.url())).unwrap_err();
    assert!(e.is_read_only(), "{e}");
    primary.read_only(false);
}

/// The server processes of the connections with this application name.
fn backends_of(client: &mut Client, application: &str) -> Vec<i32> {
    client
        .query(
            "SELECT pid FROM pg_stat_activity WHERE application_name = $1",
            &[&application],
        )
        .expect("list backends")
        .iter()
        .map(|row| row.get(0))
        .collect()
}

/// The one server process of the connection with this application name.
fn backend_of(client: &mut Client, application: &str) -> i32 {
    let pids = backends_of(client, application);
    assert_eq!(pids.len(), 1, "{application}: {pids:?}");
    pids[0]
}

#[test]
fn a_stalled_connection_is_given_up_and_the_worker_goes_on_with_a_new_one() {
    let node = PgNode::start();
    let (outbox, mut client) = outbox_on(&node, Duration::from_secs(4));
    enqueue(&mut client, &outbox, 10);
    let publisher = Held::new();
    let metrics = Counters::default();
    let relay = Relay::spawn(
        relay_to(&node.url(), &outbox, publisher.clone())
            .batch_size(10)
            .concurrency(1)
            .notify(false)
            .metrics(metrics.clone()),
    )
    .unwrap();
    wait_until("the batch is being published", || publisher.began() == 1);

    // The worker's server process stops answering, its socket open: as a backend stopped
    // by a signal, or a pooler that hangs, looks from the client's side.
    let backend = backend_of(&mut client, "outbox relay faults");
    let stopped = Stopped::stop(backend);
    publisher.gate.open();
    wait_until("every message is recorded sent", || {
        count(&mut client, "status = 'sent'") == 10
    });
    assert_eq!(
        metrics.stalls(),
        1,
        "the stalled connection was given up once"
    );
    // The outcome went through a new connection while the old one is still stopped.
    let now = backends_of(&mut client, "outbox relay faults");
    assert!(now.iter().any(|pid| *pid != backend), "{now:?}");
    drop(stopped);
    relay.shutdown(Duration::from_secs(10)).unwrap();
    assert_all_sent_once(&mut client, 10);
}

#[test]
fn a_pooler_that_hangs_holds_no_worker_for_ever() {
    let node = PgNode::start();
    let (outbox, mut client) = outbox_on(&node, Duration::from_secs(4));
    enqueue(&mut client, &outbox, 10);
    let proxy = Faulty::to(&node.address());
    let publisher = Held::new();
    let metrics = Counters::default();
    let relay = Relay::spawn(
        relay_to(
            &format!("postgres://postgres@{}/postgres", proxy.address()),
            &outbox,
            publisher.clone(),
        )
        .batch_size(10)
        .concurrency(1)
        .notify(false)
        .metrics(metrics.clone()),
    )
    .unwrap();
    wait_until("the batch is being published", || publisher.began() == 1);

    // Nothing goes through, either way, and the sockets stay open.
    proxy.set(Mode::Stall);
    publisher.gate.open();
    wait_until("the worker gave the stalled connection up", || {
        metrics.stalls() >= 1
    });
    proxy.set(Mode::Pass);
    wait_until("every message is recorded sent", || {
        count(&mut client, "status = 'sent'") == 10
    });
    relay.shutdown(Duration::from_secs(10)).unwrap();
    assert_all_sent_once(&mut client, 10);
}

#[test]
fn a_stalled_listener_says_so_and_listens_again_on_a_new_connection() {
    let node = PgNode::start();
    let (outbox, mut client) = outbox_on(&node, Duration::from_secs(4));
    let publisher = Held::new();
    publisher.gate.open();
    let relay = Relay::spawn(
        relay_to(&node.url(), &outbox, publisher.clone())
            .poll_interval(Duration::from_secs(3600))
            .concurrency(1),
    )
    .unwrap();
    wait_until("the relay listens", || relay.is_listening());
    let backend = backend_of(&mut client, "postgres-outbox listener");
    let stopped = Stopped::stop(backend);
    wait_until("the relay knows it is not listening", || {
        !relay.is_listening()
    });
    wait_until("the relay listens again", || relay.is_listening());
    let now = backends_of(&mut client, "postgres-outbox listener");
    assert!(now.iter().any(|pid| *pid != backend), "{now:?}");
    // And a notification wakes it: with hourly polls, only the new LISTEN delivers this.
    enqueue(&mut client, &outbox, 1);
    wait_until("the message is sent", || {
        count(&mut client, "status = 'sent'") == 1
    });
    drop(stopped);
    relay.shutdown(Duration::from_secs(10)).unwrap();
}

/// Every database failure a consumer reports, as text.
#[cfg(feature = "rabbitmq")]
#[derive(Clone, Default)]
struct DatabaseFailures(Arc<std::sync::Mutex<Vec<String>>>);

#[cfg(feature = "rabbitmq")]
impl postgres_outbox::rabbitmq::ConsumerMetrics for DatabaseFailures {
    fn database_failed(&self, error: &postgres_outbox::Error) {
        self.0.lock().unwrap().push(error.to_string());
    }
}

#[cfg(feature = "rabbitmq")]
#[test]
fn a_consumer_whose_commit_stalls_gives_the_connection_up_and_the_effect_happens_once() {
    use postgres_outbox::rabbitmq::{Consumer, ConsumerConfig};

    let node = PgNode::start();
    let (outbox, mut client) = outbox_on(&node, Duration::from_secs(30));
    client
        .batch_execute("CREATE TABLE effects (key text NOT NULL)")
        .unwrap();
    let broker = common::broker::Broker::new();
    let queue = broker.plain_queue("stalled_commit");
    let stopped: Arc<std::sync::Mutex<Option<Stopped>>> = Arc::default();
    let failures = DatabaseFailures::default();
    let consumer = {
        let stopped = stopped.clone();
        Consumer::spawn(
            ConsumerConfig::new(&common::amqp_url(), &queue, "stalls")
                .statement_timeout(Duration::from_secs(1))
                .metrics(failures.clone()),
            outbox,
            Connections::open(node.url().parse().unwrap(), NoTls),
            move |tx, delivery| {
                tx.execute("INSERT INTO effects VALUES ($1)", &[&delivery.key])
                    .map_err(postgres_outbox::HandlerError::transient)?;
                // The first time, the server stops answering before the commit: as a
                // backend stopped by a signal, or a pooler that hangs, looks from here.
                let mut slot = stopped.lock().unwrap();
                if slot.is_none() {
                    let pid: i32 = tx
                        .query_one("SELECT pg_backend_pid()", &[])
                        .map_err(postgres_outbox::HandlerError::transient)?
                        .get(0);
                    *slot = Some(Stopped::stop(pid));
                }
                Ok(())
            },
        )
        .unwrap()
    };
    broker.send(&queue, Some("m-1"), b"a");
    wait_until("the consumer gave the stalled connection up", || {
        failures
            .0
            .lock()
            .unwrap()
            .iter()
            .any(|e| e.contains("did not answer"))
    });
    // The stalled transaction holds the message's dedupe row: once it commits after all,
    // the delivery held meanwhile is a duplicate.
    stopped.lock().unwrap().take();
    wait_until("the delivery is settled", || {
        let report = consumer.report();
        report.processed + report.duplicates == 1 && broker.ready(&queue) == 0
    });
    let report = consumer.shutdown(Duration::from_secs(10)).unwrap();
    assert_eq!((report.retried, report.rejected), (0, 0));
    let effects: i64 = client
        .query_one("SELECT count(*) FROM effects", &[])
        .unwrap()
        .get(0);
    assert_eq!(effects, 1, "the handler's effect happened exactly once");
    broker.delete_queue(&queue);
}

/// Six messages of 1 MiB of random bytes (stored as they are, not compressed to nothing),
/// sent by a relay of one worker, `max_claims` 2 and a 12 s lease (a 5 s deadline for a
/// statement, `statement_bound`), whose connection to the database passes replies at
/// `rate` bytes a second from the moment the payloads are committed. Returns the
/// payloads, in key order, and what the relay published, once every message is sent or
/// dead; every one must be sent, charged nothing.
fn over_a_slow_link(rate: usize) -> (Vec<Vec<u8>>, Held) {
    const ROWS: usize = 6;
    const PAYLOAD: usize = 1 << 20;
    let node = PgNode::start();
    let (outbox, mut client) = outbox_on(&node, Duration::from_secs(12));
    let proxy = Faulty::to(&node.address());
    let publisher = Held::new();
    publisher.gate.open();
    let relay = Relay::spawn(
        relay_to(
            &format!("postgres://postgres@{}/postgres", proxy.address()),
            &outbox,
            publisher.clone(),
        )
        .retry(Retry::default().max_claims(2))
        .concurrency(1),
    )
    .expect("spawn the relay");
    // One message through first: the worker's connection is open (opening one has a
    // deadline of its own) before the link slows down.
    enqueue(&mut client, &outbox, 1);
    wait_until("the first message is sent", || {
        count(&mut client, "status = 'sent'") == 1
    });
    proxy.set(Mode::Throttle(rate));
    let payloads: Vec<Vec<u8>> = (0..ROWS)
        .map(|_| (0..PAYLOAD).map(|_| rand::random::<u8>()).collect())
        .collect();
    let mut tx = client.transaction().expect("begin");
    for (i, payload) in payloads.iter().enumerate() {
        let message = Message::new("t", payload.clone()).key(format!("big-{i}"));
        outbox.enqueue(&mut tx, message).expect("enqueue");
    }
    tx.commit().expect("commit");
    wait_until("every message is sent or dead", || {
        count(&mut client, "status <> 'pending'") == 1 + ROWS as i64
    });
    relay.shutdown(Duration::from_secs(10)).expect("shutdown");
    assert_all_sent_once(&mut client, 1 + ROWS);
    (payloads, publisher)
}

/// Issue 49, item 4: a claim whose reply takes longer than the relay's deadline for a
/// statement (large payloads over a slow link, which a pooler buffers: the server commits
/// the claim at once) was given up as stalled although it committed, every claim again,
/// until `max_claims` made the rows dead letters. The reply now carries what crosses the
/// slowest link in time, and the rest of the payloads come in statements of their own.
#[test]
fn large_payloads_over_a_slow_link_are_published_and_charged_nothing() {
    // The claim's reply of 6 MiB at 1 MB/s would take 6 s.
    let (payloads, publisher) = over_a_slow_link(1_000_000);
    for (i, payload) in payloads.iter().enumerate() {
        let key = format!("big-{i}");
        let published = publisher
            .sink
            .records()
            .into_iter()
            .find(|r| r.key == key)
            .expect("published");
        assert!(
            published.payload == *payload,
            "{key}'s payload arrived whole"
        );
    }
}

/// Issue 49, item 4, when the payloads take longer than half the lease to read: the rows
/// whose payloads arrived go out, the others go back uncharged and come in the next
/// claims (read whole, the batch outlived its lease and went back entire, claim after
/// claim, and nothing was ever published).
#[test]
fn payloads_slower_than_half_the_lease_go_out_over_several_claims() {
    // 6 s for the payloads: about two of the six at 400 kB/s.
    let (_, publisher) = over_a_slow_link(400_000);
    assert!(
        publisher.began() > 2,
        "the payloads went out over several claims"
    );
}
