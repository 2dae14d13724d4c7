//! PostgreSQL over TLS: a relay whose pool and own connections (workers and listener) are
//! encrypted, as the server itself reports in `pg_stat_ssl`, and certificates that are really
//! verified.
//!
//! `OUTBOX_TEST_PG_TLS_CA` names the CA that signed the server's certificate (`.ci/pg-tls`
//! makes one for 127.0.0.1 and `.ci/run` sets the variable); the connector then trusts that
//! CA and nothing else. Without it (a developer machine where `.ci/pg-tls` never ran, whose
//! stock Debian certificate names the hostname and verifies for no address), the relay tests
//! still require encrypted connections, from a connector that accepts any certificate, and
//! only the verification test is skipped, saying so.

mod common;

use std::convert::Infallible;
use std::net::{IpAddr, ToSocketAddrs};
use std::sync::{Arc, Once};
use std::time::Duration;

use common::{count, quoted, wait_until, Sink};
use native_tls::{Certificate, TlsConnector};
use postgres::config::{Host, SslMode};
use postgres::Client;
use postgres_native_tls::MakeTlsConnector;
use postgres_outbox::{publisher_fn, Connections, Message, Outbox, Record, Relay, RelayConfig};
use r2d2_postgres::PostgresConnectionManager;

const CA_VAR: &str = "OUTBOX_TEST_PG_TLS_CA";

type TlsPool = r2d2::Pool<PostgresConnectionManager<MakeTlsConnector>>;

/// The CA of `.ci/pg-tls`, if the variable names one.
fn ca() -> Option<Certificate> {
    let path = std::env::var(CA_VAR).ok().filter(|p| !p.is_empty())?;
    let pem = std::fs::read(&path)
        .unwrap_or_else(|e| panic!("{CA_VAR}={path}: cannot read it ({e}); run .ci/pg-tls"));
    Some(Certificate::from_pem(&pem).unwrap_or_else(|e| panic!("{CA_VAR}={path}: {e}")))
}

/// A connector that trusts exactly the CA (no system roots) and checks the server's name; or,
/// without the CA, one that accepts any certificate: encryption without authentication.
fn tls() -> MakeTlsConnector {
    let mut builder = TlsConnector::builder();
    match ca() {
        Some(ca) => {
            builder
                .disable_built_in_roots(true)
                .add_root_certificate(ca);
        }
        None => {
            static SAID: Once = Once::new();
            SAID.call_once(|| {
                eprintln!(
                    "{CA_VAR} is not set: TLS to PostgreSQL is required but certificates are \
                     not verified; run .ci/pg-tls and export what it prints as {CA_VAR} to \
                     verify them"
                )
            });
            builder.danger_accept_invalid_certs(true);
        }
    }
    MakeTlsConnector::new(builder.build().expect("a TLS connector"))
}

/// The test database's settings (this run's schema first on the search path), TLS required.
fn tls_config() -> postgres::Config {
    let mut config: postgres::Config = common::database_url().parse().expect("database URL");
    config.ssl_mode(SslMode::Require);
    config
}

fn tls_pool(size: u32) -> TlsPool {
    let manager = PostgresConnectionManager::new(tls_config(), tls());
    r2d2::Pool::builder()
        .max_size(size)
        .min_idle(Some(0))
        .build(manager)
        .expect("build the TLS pool")
}

/// Whether the server says this session is encrypted.
fn encrypted(client: &mut Client) -> bool {
    client
        .query_one(
            "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
            &[],
        )
        .expect("pg_stat_ssl")
        .get(0)
}

/// The relay's sessions on the server, by what they say of themselves: each worker's
/// `application_name` names the table, and the listener's last statement is its LISTEN on
/// the outbox's channel. Returns (application_name, ssl, TLS version) for each.
fn relay_sessions(observer: &mut Client, outbox: &Outbox) -> Vec<(String, bool, Option<String>)> {
    let channel: String = observer
        .query_one(&format!("SELECT \"{}_channel\"()", outbox.table()), &[])
        .expect("the outbox's channel")
        .get(0);
    observer
        .query(
            "SELECT a.application_name, s.ssl, s.version
             FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid)
             WHERE a.datname = current_database()
               AND (a.application_name = $1
                    OR (a.application_name = 'postgres-outbox listener' AND a.query = $2))",
            &[
                &format!("outbox relay {}", outbox.table()),
                &format!("LISTEN \"{channel}\""),
            ],
        )
        .expect("pg_stat_activity")
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect()
}

/// Runs a relay whose every connection is TLS (the pool's, and with `own` its own workers'
/// and listener's through `connections`) over 100 committed messages; checks that each
/// message reached the publisher and was recorded as sent, and that the server saw every
/// relay session, and the pool's, encrypted.
fn relay_over_tls(prefix: &str, own: bool) {
    const MESSAGES: usize = 100;
    const WORKERS: usize = 4;
    let outbox = Outbox::new(&common::unique_name(prefix)).expect("valid table name");
    // With its own connections the relay takes none from the pool: one is enough for the
    // test's writes, and a relay that wanted more would be refused at spawn.
    let pool = tls_pool(if own { 1 } else { WORKERS as u32 + 1 });
    {
        let mut conn = pool.get().expect("a pooled TLS connection");
        assert!(encrypted(&mut conn), "a pooled connection is not encrypted");
        outbox.migrate(&mut conn).expect("migrate over TLS");
        let mut tx = conn.transaction().expect("begin");
        for i in 0..MESSAGES {
            let message = Message::new("orders", format!("payload {i}")).key(format!("k{i}"));
            let message = if i % 2 == 0 {
                message.aggregate_key(format!("order-{}", i % 10))
            } else {
                message
            };
            outbox.enqueue(&mut tx, message).expect("enqueue over TLS");
        }
        tx.commit().expect("commit");
    }

    let sink = Sink::default();
    let publish = Arc::new(sink.collect());
    let connections = if own {
        Connections::open(tls_config(), tls())
    } else {
        Connections::pool(pool.clone())
    };
    let config = RelayConfig::new(outbox.clone(), connections, move || {
        let publish = publish.clone();
        Ok::<_, Infallible>(publisher_fn(move |record: &Record| publish(record)))
    })
    .concurrency(WORKERS)
    .poll_interval(Duration::from_millis(100));
    let relay = Relay::spawn(config).expect("spawn the relay over TLS");

    let mut observer = common::client();
    wait_until("every message is published and recorded as sent", || {
        sink.len() >= MESSAGES
            && count(&mut observer, &outbox, "status = 'sent'") == MESSAGES as i64
    });
    let mut keys = sink.keys();
    keys.sort();
    keys.dedup();
    assert_eq!(keys.len(), MESSAGES, "every key once at least");
    // Workers connect when they first look for rows; idle ones look every poll interval.
    let mut sessions = Vec::new();
    wait_until("every worker and the listener are connected", || {
        sessions = relay_sessions(&mut observer, &outbox);
        let listeners = sessions
            .iter()
            .filter(|s| s.0 == "postgres-outbox listener")
            .count();
        sessions.len() == WORKERS + 1 && listeners == 1
    });
    for (name, ssl, version) in &sessions {
        assert!(ssl, "{name}: not encrypted ({sessions:?})");
        assert!(
            version.as_deref().is_some_and(|v| v.starts_with("TLS")),
            "{name}: {version:?}"
        );
    }
    if !own {
        // The relay's sessions were the pool's: with all of them checked out by the relay,
        // the pool is full.
        assert_eq!(pool.state().connections, WORKERS as u32 + 1);
    }

    let report = relay.shutdown(Duration::from_secs(10)).expect("shutdown");
    assert_eq!(report.published, MESSAGES as u64);
    assert_eq!(report.abandoned, 0);
    let mut conn = pool.get().expect("a pooled TLS connection after the relay");
    assert!(encrypted(&mut conn));
    assert_eq!(
        conn.query_one(
            &format!(
                "SELECT count(*) FROM {} WHERE status = 'sent'",
                quoted(&outbox)
            ),
            &[]
        )
        .unwrap()
        .get::<_, i64>(0),
        MESSAGES as i64
    );
}

#[test]
fn a_relay_on_a_tls_pool_publishes_everything_over_encrypted_connections() {
    relay_over_tls("tls_pool", false);
}

#[test]
fn a_relay_on_its_own_tls_connections_publishes_everything_over_encrypted_connections() {
    relay_over_tls("tls_own", true);
}

/// The TLS error behind a failed connection, as text.
fn tls_error(result: Result<Client, postgres::Error>) -> String {
    let error = match result {
        Ok(_) => panic!("connected, but the certificate should not have verified"),
        Err(e) => e,
    };
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(&error);
    while let Some(e) = cause {
        if e.is::<native_tls::Error>() {
            return e.to_string();
        }
        cause = e.source();
    }
    panic!("not a TLS error: {error:?}");
}

/// The test database's settings, TLS required, reaching the server's address as `host`
/// (so the certificate is checked against a name of the test's choosing).
fn reached_as(host: &str) -> postgres::Config {
    let base = tls_config();
    let port = base.get_ports().first().copied().unwrap_or(5432);
    let address: IpAddr = match base.get_hosts().first() {
        Some(Host::Tcp(name)) => (name.as_str(), port)
            .to_socket_addrs()
            .expect("resolve the database host")
            .next()
            .expect("an address")
            .ip(),
        other => panic!("the test database is not reached over TCP: {other:?}"),
    };
    let mut config = postgres::Config::new();
    config
        .host(host)
        .hostaddr(address)
        .port(port)
        .user(base.get_user().unwrap_or("postgres"))
        .ssl_mode(SslMode::Require)
        .connect_timeout(Duration::from_secs(10));
    if let Some(db) = base.get_dbname() {
        config.dbname(db);
    }
    if let Some(password) = base.get_password() {
        config.password(password);
    }
    config
}

#[test]
#[ignore = "needs the CA of the server's certificate: OUTBOX_TEST_PG_TLS_CA, from .ci/pg-tls (.ci/run sets it and runs this)"]
fn the_servers_certificate_is_verified_against_the_ca_and_its_name_checked() {
    assert!(
        ca().is_some(),
        "{CA_VAR} is not set: run .ci/pg-tls and export what it prints as {CA_VAR}"
    );
    // The CA, and only the CA, makes the certificate verify.
    let mut client = tls_config()
        .connect(tls())
        .expect("TLS with the CA verifies");
    assert!(encrypted(&mut client));
    let system_roots = MakeTlsConnector::new(TlsConnector::new().unwrap());
    let e = tls_error(tls_config().connect(system_roots));
    assert!(e.contains("certificate verify failed"), "{e}");

    // The name is checked: the certificate names 127.0.0.1, ::1 and localhost only.
    let mut client = reached_as("localhost")
        .connect(tls())
        .expect("the certificate names localhost");
    assert!(encrypted(&mut client));
    let e = tls_error(reached_as("not-in-the-certificate.invalid").connect(tls()));
    assert!(
        e.contains("certificate verify failed") && e.contains("hostname"),
        "{e}"
    );
}
