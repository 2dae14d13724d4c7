//! The `postgres-outbox` binary end to end, against the real database and broker.
#![cfg(feature = "cli")]

mod common;

use std::process::{Command as StdCommand, Stdio};
use std::time::Duration;

use amiquip::{Connection, ExchangeDeclareOptions, ExchangeType};
use assert_cmd::Command;
use common::*;
use postgres::Client;
use postgres_outbox::{Message, Outbox};
use serde_json::Value;

/// The binary, pointed at the test database and `outbox`'s table.
fn cli(outbox: &Outbox) -> Command {
    let mut command = Command::cargo_bin("postgres-outbox").expect("the binary is built");
    command
        .env("DATABASE_URL", database_url())
        .env("OUTBOX_TABLE", outbox.table())
        .env_remove("RUST_LOG");
    command
}

/// Runs it and returns its stdout, asserting it succeeded.
fn ok(outbox: &Outbox, args: &[&str]) -> String {
    let output = cli(outbox).args(args).output().expect("run the binary");
    assert!(
        output.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).expect("utf-8 output")
}

/// Runs it, asserting it failed with `code`, and returns its stderr.
fn fails(outbox: &Outbox, args: &[&str], code: i32) -> String {
    let output = cli(outbox).args(args).output().expect("run the binary");
    assert_eq!(output.status.code(), Some(code), "{args:?}");
    assert!(output.stdout.is_empty(), "{args:?} printed to stdout");
    String::from_utf8(output.stderr).expect("utf-8 output")
}

fn json(text: &str) -> Value {
    serde_json::from_str(text).expect("valid JSON")
}

fn statuses(client: &mut Client, outbox: &Outbox) -> Vec<(String, String)> {
    client
        .query(
            &format!("SELECT key, status FROM {} ORDER BY key", quoted(outbox)),
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect()
}

#[test]
fn migrate_and_sql() {
    let outbox = Outbox::new(&unique_name("cli_migrate")).unwrap();
    let ddl = ok(&outbox, &["sql"]);
    assert!(
        ddl.contains(&format!("CREATE TABLE \"{}\"", outbox.table())),
        "{ddl}"
    );
    assert!(fails(&outbox, &["stats"], 1).contains("migrate"));
    // A short command logs warnings alone, unless RUST_LOG asks for more.
    let output = cli(&outbox).arg("migrate").output().unwrap();
    let log = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{log}");
    assert!(String::from_utf8_lossy(&output.stdout).contains(outbox.table()));
    assert!(log.is_empty(), "{log}");
    assert!(ok(&outbox, &["migrate"]).contains(outbox.table()));
    let stats = json(&ok(&outbox, &["stats", "--json"]));
    assert_eq!(stats["pending"], 0);
}

#[test]
fn grants_prints_what_a_side_needs_and_refuses_a_bad_role() {
    let outbox = Outbox::new(&unique_name("cli_grants")).unwrap();
    let relay = ok(&outbox, &["grants", "relay", "relay_role"]);
    assert!(
        relay.contains(&format!(
            "GRANT SELECT, UPDATE ON \"{}\" TO \"relay_role\";",
            outbox.table()
        )),
        "{relay}"
    );
    assert!(
        relay.contains("_ids_drawn\"() TO \"relay_role\";"),
        "{relay}"
    );
    let error = fails(&outbox, &["grants", "relay", ""], 1);
    assert!(error.contains("invalid role"), "{error}");
    fails(&outbox, &["grants", "owner", "relay_role"], 2);
}

#[test]
fn migrate_makes_a_partitioned_table_and_the_doctor_lists_its_partitions() {
    let outbox = Outbox::new(&unique_name("cli_partitioned")).unwrap();
    let ddl = ok(&outbox, &["sql", "--partition-interval", "1d"]);
    assert!(ddl.contains("PARTITION BY RANGE (id)"), "{ddl}");
    assert!(!ok(&outbox, &["sql"]).contains("PARTITION BY RANGE (id)"));
    let error = fails(&outbox, &["migrate", "--partition-interval", "10s"], 1);
    assert!(error.contains("partition_interval"), "{error}");
    for _ in 0..2 {
        ok(&outbox, &["migrate", "--partition-interval", "1d"]);
    }
    let doctor = json(&ok(&outbox, &["doctor", "--json"]));
    let partitions = doctor["partitions"].as_array().expect("partitions");
    let numbers: Vec<i64> = partitions
        .iter()
        .map(|p| p["number"].as_i64().unwrap())
        .collect();
    assert_eq!(numbers, [0, 1, 2]);
    assert_eq!(partitions[0]["every_secs"], 86_400.0);
    assert!(ok(&outbox, &["doctor"]).contains("partition 0 (1day each): open for"));

    // A dead letter kept in partition 0, cut two days ago: it holds the partition back.
    let mut client = client();
    client
        .batch_execute(&format!(
            "INSERT INTO {0} (key, topic, payload, status, done_at)
             VALUES ('kept', 't', '\\x00', 'dead', now());
             SELECT {1}(true), {2}(), {1}(false);
             UPDATE {3} SET closed_at = now() - interval '2 days' WHERE n = 0",
            quoted(&outbox),
            quoted_with(&outbox, "_partition"),
            quoted_with(&outbox, "_settle"),
            quoted_with(&outbox, "_partitions"),
        ))
        .unwrap();
    let output = cli(&outbox).args(["doctor", "--json"]).output().unwrap();
    assert_eq!(output.status.code(), Some(1));
    let doctor = json(&String::from_utf8(output.stdout).unwrap());
    let first = &doctor["partitions"][0];
    assert_eq!(
        (
            &first["held_back"],
            &first["kept_rows"],
            &first["settled_secs"]
        ),
        (&Value::from("kept"), &Value::from(1), &Value::Null)
    );
    let checks: Vec<&str> = doctor["findings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["check"].as_str().unwrap())
        .collect();
    // The dead letter that keeps the partition is a finding of its own.
    assert_eq!(checks, ["dead_letters", "partitions"]);
    let output = cli(&outbox).arg("doctor").output().unwrap();
    let text = String::from_utf8(output.stdout).unwrap();
    // Seconds may have passed since it was closed two days ago.
    assert!(
        text.contains("partition 0 (1day each): closed 2days"),
        "{text}"
    );
    assert!(
        text.contains("not settled: it keeps 1 dead or parked row,"),
        "{text}"
    );
}

#[test]
fn stats_show_states_ages_and_topics() {
    let (outbox, mut client) = outbox("cli_stats");
    operator_rows(&mut client, &outbox);
    let stats = json(&ok(&outbox, &["stats", "--json"]));
    assert_eq!(
        (
            &stats["pending"],
            &stats["due"],
            &stats["sent"],
            &stats["dead"]
        ),
        (
            &Value::from(1),
            &Value::from(1),
            &Value::from(0),
            &Value::from(5)
        )
    );
    assert!(stats["oldest_pending_age_secs"].as_f64().is_some());
    assert_eq!(stats["oldest_blocked_age_secs"], Value::Null);
    assert_eq!(stats["exact"], Value::from(true));
    // The scanning form says the same of a table this small.
    let exact = json(&ok(&outbox, &["stats", "--json", "--exact"]));
    for field in [
        "pending",
        "due",
        "blocked",
        "in_flight",
        "sent",
        "dead",
        "exact",
    ] {
        assert_eq!(exact[field], stats[field], "{field}");
    }
    assert_eq!(
        stats["topics"],
        json(
            r#"[{"topic": "invoices", "pending": 0, "dead": 2},
                 {"topic": "orders", "pending": 1, "dead": 3}]"#
        )
    );
    let text = ok(&outbox, &["stats"]);
    assert!(text.contains("dead               5"), "{text}");
    assert!(
        text.lines()
            .any(|l| l.starts_with("orders") && l.ends_with(" 3")),
        "{text}"
    );

    // Past what `stats` reads, it estimates and lists no topic (that reads the backlog
    // whole); --exact counts and lists them.
    client
        .batch_execute(&format!(
            "INSERT INTO {} (key, topic, payload) \
             SELECT 'many-' || i, 'orders', 'p' FROM generate_series(1, 2500) AS i",
            quoted(&outbox)
        ))
        .unwrap();
    let stats = json(&ok(&outbox, &["stats", "--json"]));
    assert_eq!(stats["exact"], Value::from(false));
    assert_eq!(stats["topics"], Value::Null);
    assert!(ok(&outbox, &["stats"]).contains("per topic          with --exact"));
    let exact = json(&ok(&outbox, &["stats", "--json", "--exact"]));
    assert_eq!(exact["pending"], Value::from(2501));
    assert_eq!(
        exact["topics"],
        json(
            r#"[{"topic": "invoices", "pending": 0, "dead": 2},
                 {"topic": "orders", "pending": 2501, "dead": 3}]"#
        )
    );
}

#[test]
fn doctor_says_ok_or_names_the_problem_and_exits_1() {
    let (outbox, mut client) = common::outbox("cli_doctor");
    let out = ok(&outbox, &["doctor"]);
    assert!(out.contains("ok: nothing needs attention"), "{out}");
    let report = json(&ok(&outbox, &["doctor", "--json"]));
    assert_eq!(report["healthy"], true);
    assert_eq!(report["oldest_due_age_secs"], Value::Null);

    let mut tx = client.transaction().unwrap();
    outbox.enqueue(&mut tx, Message::new("t", "p")).unwrap();
    tx.commit().unwrap();
    // Due for less than the default minute: still healthy.
    assert!(ok(&outbox, &["doctor"]).contains("ok: nothing needs attention"));
    // What it found goes to stdout, the exit code says there was something.
    let found = |args: &[&str]| {
        let output = cli(&outbox).args(args).output().expect("run the binary");
        assert_eq!(output.status.code(), Some(1), "{args:?}");
        String::from_utf8(output.stdout).expect("utf-8 output")
    };
    let out = found(&["doctor", "--due-age", "0s"]);
    assert!(out.contains("no relay claimed"), "{out}");
    assert!(out.contains("remedy:"), "{out}");
    let out = found(&["doctor", "--json", "--due-age", "0s"]);
    let report = json(out.lines().next().unwrap_or_default());
    assert_eq!(report["healthy"], false);
    assert_eq!(report["findings"][0]["check"], "due");
    fails(&outbox, &["doctor", "--due-age", "soon"], 2);
}

#[test]
fn dead_lists_and_groups_what_its_filters_name() {
    let (outbox, mut client) = outbox("cli_dead");
    operator_rows(&mut client, &outbox);
    let keys = |args: &[&str]| -> Vec<String> {
        let mut all = vec!["dead", "--json"];
        all.extend_from_slice(args);
        let mut keys: Vec<String> = json(&ok(&outbox, &all))
            .as_array()
            .expect("an array")
            .iter()
            .map(|d| d["key"].as_str().expect("a key").to_owned())
            .collect();
        keys.sort();
        keys
    };
    assert_eq!(keys(&[]), ["d1", "d2", "d3", "d4", "d5"]);
    assert_eq!(keys(&["--topic", "orders"]), ["d1", "d2", "d5"]);
    assert_eq!(keys(&["--error-contains", "bad"]), ["d4"]);
    assert_eq!(keys(&["--older-than", "7d"]), ["d1", "d3"]);
    assert_eq!(keys(&["--key", "d2", "--key", "d3"]), ["d2", "d3"]);
    assert_eq!(keys(&["--limit", "1"]).len(), 1);

    let groups = json(&ok(&outbox, &["dead", "--by-error", "--json"]));
    assert_eq!(groups[0]["error"], "timeout talking to broker");
    assert_eq!(groups[0]["count"], 3);
    assert_eq!(groups[0]["sample_key"], "d1");
    assert_eq!(groups[1]["count"], 1);
    let text = ok(&outbox, &["dead", "--by-error"]);
    assert_eq!(
        text.lines().count(),
        4,
        "a heading and three groups: {text}"
    );
    let heading = text.lines().next().unwrap_or_default();
    for column in ["count", "first dead", "last dead", "sample key", "error"] {
        assert!(heading.contains(column), "{heading}");
    }
    assert!(ok(&outbox, &["dead"]).contains("timeout talking to broker"));
}

#[test]
fn redrive_changes_exactly_what_its_filters_name_and_a_dry_run_nothing() {
    let (outbox, mut client) = outbox("cli_redrive");
    operator_rows(&mut client, &outbox);
    let before = statuses(&mut client, &outbox);

    let refused = fails(&outbox, &["redrive"], 2);
    assert!(refused.contains("--all"), "{refused}");
    let dry = ok(
        &outbox,
        &["redrive", "--error-contains", "timeout", "--dry-run"],
    );
    assert_eq!(dry.trim(), "would redrive 3 dead letters");
    assert_eq!(
        ok(&outbox, &["redrive", "--all", "--dry-run"]).trim(),
        "would redrive 5 dead letters"
    );
    assert_eq!(
        statuses(&mut client, &outbox),
        before,
        "dry runs change nothing"
    );

    let done = ok(
        &outbox,
        &["redrive", "--topic", "invoices", "--older-than", "7d"],
    );
    assert_eq!(done.trim(), "redrove 1 dead letter");
    let after = statuses(&mut client, &outbox);
    let changed: Vec<&(String, String)> =
        after.iter().filter(|row| !before.contains(row)).collect();
    assert_eq!(changed, [&("d3".to_owned(), "pending".to_owned())]);

    ok(&outbox, &["redrive", "--key", "d4"]);
    assert_eq!(row_state(&mut client, &outbox, "d4"), ("pending".into(), 0));
    assert_eq!(
        ok(&outbox, &["redrive", "--all"]).trim(),
        "redrove 3 dead letters"
    );
}

#[test]
fn purge_deletes_exactly_what_its_filters_name_and_a_dry_run_nothing() {
    let (outbox, mut client) = outbox("cli_purge");
    operator_rows(&mut client, &outbox);
    assert_eq!(
        ok(
            &outbox,
            &["purge", "dead", "--older-than", "7d", "--dry-run"]
        )
        .trim(),
        "would purge 2 dead letters"
    );
    assert_eq!(count(&mut client, &outbox, "true"), 7);
    assert_eq!(
        ok(
            &outbox,
            &[
                "purge",
                "dead",
                "--error-contains",
                "timeout",
                "--topic",
                "orders"
            ]
        )
        .trim(),
        "purged 2 dead letters"
    );
    assert_eq!(
        ok(&outbox, &["purge", "sent", "--older-than", "1d"]).trim(),
        "purged 1 sent row"
    );
    let left: Vec<String> = statuses(&mut client, &outbox)
        .into_iter()
        .map(|(k, _)| k)
        .collect();
    assert_eq!(left, ["d3", "d4", "d5", "p1"]);
    assert_eq!(
        ok(&outbox, &["purge", "inbox", "--key", "m1", "--dry-run"]).trim(),
        "would purge 1 dedupe record"
    );
    assert_eq!(
        ok(&outbox, &["purge", "inbox", "--key", "m1"]).trim(),
        "purged 1 dedupe record"
    );
    let refused = fails(
        &outbox,
        &["purge", "inbox", "--topic", "orders", "--older-than", "2h"],
        1,
    );
    assert!(refused.contains("topic"), "{refused}");
}

#[test]
fn purge_without_a_filter_or_within_the_dedupe_window_is_refused_as_bad_usage() {
    let (outbox, mut client) = outbox("cli_purge_guard");
    operator_rows(&mut client, &outbox);
    for what in ["sent", "dead", "inbox"] {
        let e = fails(&outbox, &["purge", what], 2);
        assert!(e.contains("--all"), "{what}: {e}");
    }
    // The dedupe window: none at all, or shorter than an hour, needs --force.
    for args in [
        &["purge", "inbox", "--all"][..],
        &["purge", "inbox", "--older-than", "30m"],
    ] {
        let e = fails(&outbox, args, 2);
        assert!(
            e.contains("processed twice") && e.contains("--force"),
            "{e}"
        );
    }
    assert_eq!(count(&mut client, &outbox, "true"), 7);
    let inbox = |client: &mut Client| -> i64 {
        client
            .query_one(
                &format!("SELECT count(*) FROM \"{}_inbox\"", outbox.table()),
                &[],
            )
            .unwrap()
            .get(0)
    };
    assert_eq!(inbox(&mut client), 1);
    // An hour or more, or --force, is an informed choice; it says what it deletes.
    let output = cli(&outbox)
        .args(["purge", "inbox", "--older-than", "2h"])
        .output()
        .unwrap();
    assert!(output.status.success());
    let note = String::from_utf8_lossy(&output.stderr);
    assert!(
        note.contains("2h") && note.contains("processed again"),
        "{note}"
    );
    assert_eq!(inbox(&mut client), 1);
    // A dry run deletes nothing, so it needs no --force.
    assert_eq!(
        ok(&outbox, &["purge", "inbox", "--all", "--dry-run"]).trim(),
        "would purge 1 dedupe record"
    );
    assert_eq!(inbox(&mut client), 1);
    assert_eq!(
        ok(&outbox, &["purge", "inbox", "--all", "--force"]).trim(),
        "purged 1 dedupe record"
    );
    assert_eq!(
        ok(&outbox, &["purge", "dead", "--all"]).trim(),
        "purged 5 dead letters"
    );
    assert_eq!(count(&mut client, &outbox, "status = 'dead'"), 0);
}

#[test]
fn bad_input_exits_1_or_2_with_a_clear_message_and_no_password() {
    let (outbox, _client) = outbox("cli_bad");
    let missing = Outbox::new(&unique_name("cli_missing")).unwrap();
    let e = fails(&missing, &["dead"], 1);
    assert!(e.contains(missing.table()) && e.contains("migrate"), "{e}");
    let e = fails(&outbox, &["purge", "sent", "--older-than", "seven days"], 2);
    assert!(e.contains("--older-than"), "{e}");
    let e = fails(&outbox, &["redrive", "--all", "--older-than=-1d"], 2);
    assert!(e.contains("--older-than"), "{e}");
    // A relay's durations are parsed before anything connects: bad usage, exit 2.
    for option in ["--lease", "--poll-interval", "--drain-timeout"] {
        let e = fails(
            &outbox,
            &[
                "relay",
                "--amqp-url",
                "amqp://x",
                "--exchange",
                "e",
                option,
                "soon",
            ],
            2,
        );
        assert!(e.contains(option) && e.contains("soon"), "{e}");
    }
    let e = fails(&outbox, &["bogus"], 2);
    assert!(e.contains("bogus"), "{e}");
    let e = fails(&outbox, &["purge", "everything"], 2);
    assert!(e.contains("everything"), "{e}");
    let output = cli(&outbox)
        .env(
            "DATABASE_URL",
            "postgres://someone:s3cret@127.0.0.1:1/nowhere",
        )
        .arg("stats")
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(1));
    let e = String::from_utf8_lossy(&output.stderr);
    assert!(e.contains("cannot connect"), "{e}");
    assert!(e.contains("127.0.0.1:1"), "where it could not connect: {e}");
    assert!(!e.contains("s3cret"), "{e}");
    // libpq's sslmode=verify-full is not the driver's: said so, as bad usage.
    let output = cli(&outbox)
        .env(
            "DATABASE_URL",
            "postgres://someone:s3cret@127.0.0.1/x?sslmode=verify-full",
        )
        .arg("stats")
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2));
    let e = String::from_utf8_lossy(&output.stderr);
    assert!(e.contains("sslmode=require"), "{e}");
    assert!(!e.contains("s3cret"), "{e}");
    let e = fails(&outbox, &["--table", "no such; table", "stats"], 1);
    assert!(e.contains("no such; table"), "{e}");
}

#[test]
fn relay_publishes_and_stops_cleanly_on_sigterm() {
    let (outbox, mut client) = outbox("cli_relay");
    let (exchange, queue) = (unique_name("x_cli"), unique_name("q_cli"));
    let mut connection = Connection::insecure_open(&amqp_url()).unwrap();
    let channel = connection.open_channel(None).unwrap();
    channel
        .exchange_declare(
            ExchangeType::Topic,
            exchange.as_str(),
            ExchangeDeclareOptions::default(),
        )
        .unwrap();
    // Bound, so the relay's mandatory publishes are routed.
    channel
        .queue_declare(queue.as_str(), Default::default())
        .unwrap();
    channel
        .queue_bind(queue.as_str(), exchange.as_str(), "#", Default::default())
        .unwrap();
    let mut tx = client.transaction().unwrap();
    for i in 0..50 {
        outbox
            .enqueue(&mut tx, Message::new("orders", "x").key(format!("k{i}")))
            .unwrap();
    }
    tx.commit().unwrap();

    let binary = assert_cmd::cargo::cargo_bin("postgres-outbox");
    let relay = StdCommand::new(binary)
        .env("DATABASE_URL", database_url())
        .args(["--table", outbox.table(), "relay", "--exchange", &exchange])
        .args(["--amqp-url", &amqp_url(), "--poll-interval", "200ms"])
        .args(["--drain-timeout", "10s"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_until("every row is sent", || {
        count(&mut client, &outbox, "status = 'sent'") == 50
    });
    let terminated = StdCommand::new("kill")
        .args(["-TERM", &relay.id().to_string()])
        .status()
        .unwrap();
    assert!(terminated.success());
    let output = relay.wait_with_output().unwrap();
    let log = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{log}");
    assert!(log.contains("relay stopped"), "{log}");
    assert!(!log.contains("guest:guest"), "{log}");
    let stats = outbox.stats(&mut client).unwrap();
    assert_eq!((stats.pending, stats.in_flight, stats.sent), (0, 0, 50));
    assert_eq!(stats.oldest_pending_age, None::<Duration>);
    let delivered = channel
        .queue_declare_passive(queue.as_str())
        .unwrap()
        .declared_message_count();
    assert_eq!(delivered, Some(50));
    channel
        .queue_delete(queue.as_str(), Default::default())
        .unwrap();
    channel.exchange_delete(exchange.as_str(), false).unwrap();
}

/// A RabbitMQ user of the test's own, deleted when dropped.
struct BrokerUser(String);

impl Drop for BrokerUser {
    fn drop(&mut self) {
        let _ = StdCommand::new("rabbitmqctl")
            .args(["-q", "delete_user", &self.0])
            .status();
    }
}

#[test]
fn relay_logs_at_trace_level_quote_neither_password() {
    let (outbox, mut client) = outbox("cli_secrets");
    let (user, amqp_password, db_password) = (
        unique_name("outbox_log_user"),
        "amqp-Pw-7f3c91",
        "db-Pw-5e82a4",
    );
    common::broker::rabbitmqctl(&["-q", "add_user", &user, amqp_password]);
    let _user = BrokerUser(user.clone());
    common::broker::rabbitmqctl(&["-q", "set_permissions", "-p", "/", &user, ".*", ".*", ".*"]);
    let address = common::proxy::broker_address(&amqp_url());
    let amqp = format!("amqp://{user}:{amqp_password}@{address}");
    // The test database trusts local connections, so the password is never needed: what is
    // tested is that nothing writes the URL out.
    let database = database_url().replacen("postgres@", &format!("postgres:{db_password}@"), 1);
    let (exchange, queue) = (unique_name("x_cli_secrets"), unique_name("q_cli_secrets"));
    let broker = common::broker::Broker::new();
    broker.exchange(&exchange);
    broker.queue(&queue, &exchange, Default::default());
    let mut tx = client.transaction().unwrap();
    for i in 0..5 {
        outbox
            .enqueue(&mut tx, Message::new("orders", "x").key(format!("k{i}")))
            .unwrap();
    }
    tx.commit().unwrap();

    let binary = assert_cmd::cargo::cargo_bin("postgres-outbox");
    let log_path = std::env::temp_dir().join(format!("{exchange}.log"));
    let mut relay = StdCommand::new(binary)
        .env("DATABASE_URL", &database)
        .env("RUST_LOG", "trace")
        .args(["--table", outbox.table(), "relay", "--exchange", &exchange])
        .args(["--amqp-url", &amqp, "--poll-interval", "200ms"])
        .stdout(Stdio::null())
        // A file, not a pipe: at trace level a pipe read only at the end could fill and
        // block the relay.
        .stderr(std::fs::File::create(&log_path).unwrap())
        .spawn()
        .unwrap();
    wait_until("every row is sent", || {
        count(&mut client, &outbox, "status = 'sent'") == 5
    });
    let terminated = StdCommand::new("kill")
        .args(["-TERM", &relay.id().to_string()])
        .status()
        .unwrap();
    assert!(terminated.success());
    let status = relay.wait().unwrap();
    let log = std::fs::read_to_string(&log_path).unwrap();
    let _ = std::fs::remove_file(&log_path);
    assert!(status.success(), "{log}");
    assert!(log.contains("TRACE"), "logged at trace level: {log}");
    // The crate's own debug logs come through; the PostgreSQL driver's, which quote every
    // statement's parameters, do not.
    assert!(log.contains(": claimed "), "the relay's debug logs: {log}");
    let driver: Vec<&str> = log
        .lines()
        .filter(|line| line.contains(" tokio_postgres") || line.contains(" postgres::"))
        .filter(|line| line.contains("DEBUG") || line.contains("TRACE"))
        .collect();
    assert!(driver.is_empty(), "{driver:?}");
    for secret in [amqp_password, db_password] {
        let quoting: Vec<&str> = log.lines().filter(|l| l.contains(secret)).collect();
        assert!(quoting.is_empty(), "the log quotes a password: {quoting:?}");
    }
    broker.delete_queue(&queue);
    broker.delete_exchange(&exchange);
}

#[test]
fn relay_refuses_an_exchange_that_does_not_exist_at_once() {
    let (outbox, _client) = outbox("cli_no_exchange");
    let missing = unique_name("x_cli_missing");
    let started = std::time::Instant::now();
    let e = fails(
        &outbox,
        &["relay", "--amqp-url", &amqp_url(), "--exchange", &missing],
        1,
    );
    assert!(e.contains(&missing) && e.contains("404"), "{e}");
    assert!(!e.contains("guest:guest"), "{e}");
    // Refused before it started: it never waited for a signal.
    assert!(started.elapsed() < Duration::from_secs(30));
}

#[test]
fn dead_parked_and_skip_name_exactly_the_parked_dead_letters() {
    let (outbox, mut client) = outbox("cli_parked");
    operator_rows(&mut client, &outbox);
    // d1 parks aggregate a, with a message waiting behind it.
    let mut tx = client.transaction().unwrap();
    outbox
        .enqueue(
            &mut tx,
            Message::new("orders", "x").key("a-next").aggregate_key("a"),
        )
        .unwrap();
    tx.commit().unwrap();
    park_d1(&mut client, &outbox);
    let parked = json(&ok(&outbox, &["dead", "--parked", "--json"]));
    let keys: Vec<&str> = parked
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["key"].as_str().unwrap())
        .collect();
    assert_eq!(keys, ["d1"]);
    assert_eq!(json(&ok(&outbox, &["stats", "--json"]))["parked"], 1);
    let e = fails(&outbox, &["skip"], 2);
    assert!(e.contains("--all"), "{e}");
    assert_eq!(
        ok(&outbox, &["skip", "--all", "--dry-run"]).trim(),
        "would skip 1 parked dead letter"
    );
    // A purge never deletes parked dead letters: asking it to is bad usage.
    let e = fails(&outbox, &["purge", "dead", "--parked"], 2);
    assert!(e.contains("never deletes parked"), "{e}");
    assert_eq!(
        ok(&outbox, &["skip", "--key", "d2"]).trim(),
        "skipped 0 parked dead letters"
    );
    assert_eq!(
        ok(&outbox, &["skip", "--key", "d1"]).trim(),
        "skipped 1 parked dead letter"
    );
    assert_eq!(row_state(&mut client, &outbox, "d1").0, "dead");
    assert_eq!(json(&ok(&outbox, &["stats", "--json"]))["parked"], 0);
}

#[test]
#[ignore = "needs the CA of the server's certificate: OUTBOX_TEST_PG_TLS_CA, from .ci/pg-tls (.ci/run sets it and runs this)"]
fn a_database_that_requires_tls_is_reached_with_its_ca_and_refused_without_it() {
    let ca = std::env::var("OUTBOX_TEST_PG_TLS_CA")
        .ok()
        .filter(|p| !p.is_empty())
        .expect("OUTBOX_TEST_PG_TLS_CA: run .ci/pg-tls and export what it prints");
    let outbox = Outbox::new(&unique_name("cli_tls")).unwrap();
    let base = database_url();
    let separator = if base.contains('?') { '&' } else { '?' };
    // Trust auth ignores a password; one in the URL shows none is ever printed.
    let url = format!("{base}{separator}sslmode=require").replacen(
        "://postgres@",
        "://postgres:s3cret@",
        1,
    );
    let run = |args: &[&str], ca: Option<&str>| {
        let mut command = cli(&outbox);
        command
            .env("DATABASE_URL", &url)
            .env_remove("PGSSLROOTCERT");
        if let Some(ca) = ca {
            command.env("PGSSLROOTCERT", ca);
        }
        command.args(args).output().expect("run the binary")
    };
    let output = run(&["--database-ca", &ca, "migrate"], None);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let output = run(&["stats", "--json"], Some(&ca));
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert_eq!(json(&String::from_utf8_lossy(&output.stdout))["pending"], 0);

    // Without the CA the certificate does not verify: TLS really was used, and checked.
    let output = run(&["stats"], None);
    assert_eq!(output.status.code(), Some(1));
    let e = String::from_utf8_lossy(&output.stderr);
    assert!(e.contains("certificate verify failed"), "{e}");
    assert!(e.contains("--database-ca"), "{e}");
    assert!(!e.contains("s3cret"), "{e}");
    let output = run(&["--database-ca", "/nonexistent/ca.pem", "stats"], None);
    assert_eq!(output.status.code(), Some(1));
    let e = String::from_utf8_lossy(&output.stderr);
    assert!(
        e.contains("cannot read --database-ca") && e.contains("/nonexistent/ca.pem"),
        "{e}"
    );

    // The relay's connections are encrypted, as the server sees them.
    let binary = assert_cmd::cargo::cargo_bin("postgres-outbox");
    let relay = StdCommand::new(binary)
        .env("DATABASE_URL", &url)
        .env("PGSSLROOTCERT", &ca)
        .args([
            "--table",
            outbox.table(),
            "relay",
            "--exchange",
            "amq.topic",
        ])
        .args(["--amqp-url", &amqp_url(), "--poll-interval", "100ms"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut client = client();
    let channel: String = client
        .query_one(&format!("SELECT \"{}_channel\"()", outbox.table()), &[])
        .unwrap()
        .get(0);
    let mut sessions: Vec<bool> = Vec::new();
    wait_until(
        "the relay's four workers and its listener are connected",
        || {
            sessions = client
                .query(
                    "SELECT s.ssl FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid)
                 WHERE a.datname = current_database()
                   AND (a.application_name = $1
                        OR (a.application_name = 'postgres-outbox listener' AND a.query = $2))",
                    &[
                        &format!("outbox relay {}", outbox.table()),
                        &format!("LISTEN \"{channel}\""),
                    ],
                )
                .unwrap()
                .iter()
                .map(|r| r.get(0))
                .collect();
            sessions.len() == 5
        },
    );
    assert!(sessions.iter().all(|&ssl| ssl), "{sessions:?}");
    let terminated = StdCommand::new("kill")
        .args(["-TERM", &relay.id().to_string()])
        .status()
        .unwrap();
    assert!(terminated.success());
    let output = relay.wait_with_output().unwrap();
    let log = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{log}");
    assert!(!log.contains("s3cret"), "{log}");
}

#[test]
fn table_and_database_url_are_taken_anywhere_on_the_line() {
    let (outbox, _client) = outbox("cli_anywhere");
    let output = Command::cargo_bin("postgres-outbox")
        .unwrap()
        .env_remove("DATABASE_URL")
        .env_remove("OUTBOX_TABLE")
        .args(["stats", "--json", "--table", outbox.table()])
        .args(["--database-url", &database_url()])
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert_eq!(
        json(&String::from_utf8_lossy(&output.stdout))["table"],
        outbox.table()
    );
}

#[test]
fn sql_into_a_closed_pipe_ends_quietly() {
    let mut child = StdCommand::new(env!("CARGO_BIN_EXE_postgres-outbox"))
        .arg("sql")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The reader is gone before the first line is written, as `| head -1` is soon after.
    drop(child.stdout.take());
    let output = child.wait_with_output().unwrap();
    assert_eq!(
        output.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        output.stderr.is_empty(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

#[test]
fn an_empty_dead_letter_list_says_so() {
    let (outbox, _client) = outbox("cli_no_dead");
    assert_eq!(ok(&outbox, &["dead"]).trim(), "no dead letters");
    assert_eq!(
        ok(&outbox, &["dead", "--by-error"]).trim(),
        "no dead letters"
    );
    assert_eq!(
        ok(&outbox, &["dead", "--topic", "x"]).trim(),
        "no dead letters match"
    );
    assert_eq!(ok(&outbox, &["dead", "--json"]).trim(), "[]");
}

#[test]
fn a_table_that_is_not_an_outbox_is_named_as_such() {
    let mut client = client();
    let name = unique_name("cli_not_outbox");
    client
        .batch_execute(&format!("CREATE TABLE \"{name}\" (id int)"))
        .unwrap();
    let other = Outbox::new(&name).unwrap();
    for command in ["stats", "dead", "doctor"] {
        let e = fails(&other, &[command], 1);
        assert!(e.contains("is not an outbox"), "{command}: {e}");
        assert!(!e.contains("lease_until"), "{command}: {e}");
    }
    assert!(other.check(&mut client).unwrap_err().is_not_an_outbox());
    client
        .batch_execute(&format!("DROP TABLE \"{name}\""))
        .unwrap();
}

/// Everything in the catalog named after `outbox`'s table: it, or it and `_` and more.
fn named_after(client: &mut Client, outbox: &Outbox) -> Vec<String> {
    let pattern = format!("{}\\_%", outbox.table());
    client
        .query(
            "SELECT relname::text FROM pg_class WHERE relname = $1 OR relname LIKE $2
             UNION ALL SELECT proname::text FROM pg_proc WHERE proname LIKE $2
             ORDER BY 1",
            &[&outbox.table(), &pattern],
        )
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

#[test]
fn uninstall_lists_then_drops_everything_migrate_made_and_nothing_else() {
    let mut client = client();
    for partitioned in [false, true] {
        let name = unique_name("cli_uninstall");
        let mut builder = Outbox::builder().table(&name);
        if partitioned {
            builder = builder.partition_interval(Duration::from_secs(86_400));
        }
        let outbox = builder.build().unwrap();
        outbox.migrate(&mut client).unwrap();
        // Another outbox whose name starts with this one's, which must stay.
        let sibling = Outbox::new(&format!("{name}_eu")).unwrap();
        sibling.migrate(&mut client).unwrap();
        let mut tx = client.transaction().unwrap();
        outbox.enqueue(&mut tx, Message::new("t", "p")).unwrap();
        tx.commit().unwrap();
        let before = named_after(&mut client, &sibling);

        let listed = ok(&outbox, &["uninstall"]);
        assert!(listed.contains("--yes"), "{listed}");
        assert!(listed.contains(&format!(".\"{name}\"\n")), "{listed}");
        assert!(listed.contains(&format!("{name}_enqueue(")), "{listed}");
        assert_eq!(listed.contains("partition "), partitioned, "{listed}");
        assert!(!listed.contains(&format!("{name}_eu")), "{listed}");
        assert_eq!(
            count(&mut client, &outbox, "true"),
            1,
            "a listing drops nothing"
        );

        let dropped = ok(&outbox, &["uninstall", "--yes"]);
        assert!(
            dropped.contains(&format!("uninstalled {name}")),
            "{dropped}"
        );
        let left: Vec<String> = named_after(&mut client, &outbox)
            .into_iter()
            .filter(|n| !n.starts_with(&format!("{name}_eu")))
            .collect();
        assert!(left.is_empty(), "left behind: {left:?}");
        assert_eq!(
            named_after(&mut client, &sibling),
            before,
            "the sibling is whole"
        );
        assert!(ok(&outbox, &["uninstall"]).contains("nothing of outbox"));
        sibling.uninstall(&mut client).unwrap();
        assert!(named_after(&mut client, &sibling).is_empty());
    }
}

#[test]
fn uninstall_is_refused_while_a_relay_reports() {
    let (outbox, mut client) = outbox("cli_uninstall_busy");
    client
        .execute(
            &format!(
                "INSERT INTO {} (relay, pid, started_at, publisher) VALUES ('r1', 4242, now(), 'up')",
                quoted_with(&outbox, "_relays")
            ),
            &[],
        )
        .unwrap();
    let e = fails(&outbox, &["uninstall", "--yes"], 1);
    assert!(e.contains("relay") && e.contains("stop them"), "{e}");
    assert!(matches!(
        outbox.uninstall(&mut client),
        Err(postgres_outbox::Error::InUse { relays: 1, .. })
    ));
    assert_eq!(
        count(&mut client, &outbox, "true"),
        0,
        "the table is still there"
    );
    client
        .execute(
            &format!("DELETE FROM {}", quoted_with(&outbox, "_relays")),
            &[],
        )
        .unwrap();
    ok(&outbox, &["uninstall", "--yes"]);
    assert!(named_after(&mut client, &outbox).is_empty());
}

#[test]
fn the_doctor_names_dead_and_parked_letters_and_stats_tell_due_from_pending() {
    let (outbox, mut client) = outbox("cli_doctor_letters");
    // A lone message delayed for an hour: pending, not due; nothing is wrong.
    let mut tx = client.transaction().unwrap();
    outbox
        .enqueue(
            &mut tx,
            Message::new("t", "p").delay(Duration::from_secs(3600)),
        )
        .unwrap();
    tx.commit().unwrap();
    client
        .execute(
            &format!(
                "UPDATE {} SET created_at = now() - interval '10 minutes'",
                quoted(&outbox)
            ),
            &[],
        )
        .unwrap();
    let stats = json(&ok(&outbox, &["stats", "--json"]));
    assert!(
        stats["oldest_pending_age_secs"].as_f64().unwrap() >= 600.0,
        "{stats}"
    );
    assert_eq!(stats["oldest_due_age_secs"], Value::Null, "{stats}");
    let text = ok(&outbox, &["stats"]);
    assert!(text.contains("oldest due         -"), "{text}");
    assert!(ok(&outbox, &["doctor"]).contains("ok: nothing needs attention"));

    operator_rows(&mut client, &outbox);
    park_d1(&mut client, &outbox);
    let output = cli(&outbox).arg("doctor").output().unwrap();
    assert_eq!(output.status.code(), Some(1));
    let out = String::from_utf8_lossy(&output.stdout);
    assert!(
        out.contains("holds 4 dead letters: messages nobody received"),
        "{out}"
    );
    assert!(out.contains("has 1 parked dead letter:"), "{out}");
    assert!(
        out.contains("dead --by-error") && out.contains("dead --parked"),
        "{out}"
    );
    let report = json(&String::from_utf8_lossy(
        &cli(&outbox)
            .args(["doctor", "--json"])
            .output()
            .unwrap()
            .stdout,
    ));
    let checks: Vec<&str> = report["findings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["check"].as_str().unwrap())
        .collect();
    assert!(
        checks.contains(&"dead_letters") && checks.contains(&"parked"),
        "{checks:?}"
    );
    assert_eq!(report["parked"], 1);
}

/// The dead letter `d1` of `operator_rows` becomes a parked one, holding aggregate `a`.
fn park_d1(client: &mut Client, outbox: &Outbox) {
    client
        .execute(
            &format!(
                "UPDATE {} SET status = 'parked', aggregate_key = 'a' WHERE key = 'd1'",
                quoted(outbox)
            ),
            &[],
        )
        .unwrap();
}
