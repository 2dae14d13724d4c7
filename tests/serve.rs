//! `postgres-outbox serve` over plain HTTP: what the pages show, what they never show, and
//! every refusal. (The `#[ignore]`d browser test below drives the same pages in Chromium.)
#![cfg(feature = "cli")]

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::faulty::{Faulty, Mode};
use common::*;
use postgres::Client;
use postgres_outbox::{Message, Outbox};

/// A payload no page may show unless payloads are allowed and asked for.
const SECRET: &str = "card=4111111111111111";
const TOKEN: &str = "a-test-token-of-some-length";

/// A running `serve`, killed when dropped.
pub struct Server {
    child: Child,
    pub addr: SocketAddr,
}

impl Server {
    /// A server that takes changes, with the test token.
    fn taking_changes(outbox: &Outbox) -> Server {
        Server::start(
            &database_url(),
            &[outbox],
            &["--allow-changes"],
            Some(TOKEN),
        )
    }

    /// Serves `tables` with `args`, the token in the environment when given.
    pub fn start(
        database_url: &str,
        tables: &[&Outbox],
        args: &[&str],
        token: Option<&str>,
    ) -> Server {
        let mut command = Command::new(env!("CARGO_BIN_EXE_postgres-outbox"));
        command
            .env("DATABASE_URL", database_url)
            .env_remove("OUTBOX_TABLE")
            .env_remove("OUTBOX_WEB_TOKEN")
            // Its default: every change is logged without asking.
            .env_remove("RUST_LOG");
        if let Some(token) = token {
            command.env("OUTBOX_WEB_TOKEN", token);
        }
        for table in tables {
            command.args(["--table", table.table()]);
        }
        let mut child = command
            .args([
                "serve",
                "--bind",
                "127.0.0.1:0",
                "--sample-interval",
                "200ms",
            ])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start serve");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("serve prints its address");
        let addr = line
            .trim()
            .strip_prefix("serving http://")
            .and_then(|a| a.strip_suffix('/'))
            .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
            .parse()
            .expect("an address");
        Server { child, addr }
    }

    pub fn get(&self, path: &str, headers: &[(&str, &str)]) -> Reply {
        self.send("GET", path, headers, "")
    }

    pub fn post(&self, path: &str, headers: &[(&str, &str)], form: &str) -> Reply {
        self.send("POST", path, headers, form)
    }

    fn send(&self, method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> Reply {
        let mut request = format!(
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nContent-Length: {}\r\n",
            self.addr,
            body.len()
        );
        if !body.is_empty() {
            request.push_str("Content-Type: application/x-www-form-urlencoded\r\n");
        }
        for (name, value) in headers {
            request.push_str(&format!("{name}: {value}\r\n"));
        }
        request.push_str("\r\n");
        request.push_str(body);
        self.raw(request.as_bytes())
    }

    /// Sends `bytes` as they are and reads the whole answer.
    pub fn raw(&self, bytes: &[u8]) -> Reply {
        let mut stream = TcpStream::connect(self.addr).expect("connect");
        stream
            .set_read_timeout(Some(Duration::from_secs(60)))
            .unwrap();
        stream.write_all(bytes).expect("send");
        Reply::read(&mut stream)
    }

    /// Its log so far, after stopping it.
    fn stop(mut self) -> String {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let mut log = String::new();
        if let Some(mut stderr) = self.child.stderr.take() {
            let _ = stderr.read_to_string(&mut log);
        }
        log
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub struct Reply {
    pub status: u16,
    head: String,
    pub body: String,
}

impl Reply {
    fn read(stream: &mut TcpStream) -> Reply {
        let mut raw = Vec::new();
        let _ = stream.read_to_end(&mut raw);
        let text = String::from_utf8_lossy(&raw).into_owned();
        let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
        let status = head
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("no status in {head:?}"));
        Reply {
            status,
            head: head.to_owned(),
            body: body.to_owned(),
        }
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.head.lines().find_map(|line| {
            let (n, v) = line.split_once(':')?;
            n.eq_ignore_ascii_case(name).then(|| v.trim())
        })
    }

    /// The text of the element with `id` (a number cell, a message).
    pub fn by_id(&self, id: &str) -> String {
        let start = self
            .body
            .find(&format!("id=\"{id}\""))
            .unwrap_or_else(|| panic!("no #{id} in {}", self.body));
        let from = start + self.body[start..].find('>').unwrap() + 1;
        let to = from + self.body[from..].find('<').unwrap();
        self.body[from..to].to_owned()
    }

    /// The value of the hidden field `name` of the page's form.
    pub fn field(&self, name: &str) -> String {
        let at = self
            .body
            .find(&format!("name=\"{name}\" value=\""))
            .unwrap_or_else(|| panic!("no field {name}"));
        let from = at + format!("name=\"{name}\" value=\"").len();
        let to = from + self.body[from..].find('"').unwrap();
        self.body[from..to].to_owned()
    }
}

/// An outbox with `operator_rows` (five dead letters, a sent and a pending row), each
/// payload `SECRET`, and one dead letter parking its aggregate.
fn outbox_with_dead_letters(prefix: &str) -> (Outbox, Client) {
    let (outbox, mut client) = outbox(prefix);
    operator_rows(&mut client, &outbox);
    let mut tx = client.transaction().unwrap();
    outbox
        .enqueue(
            &mut tx,
            Message::new("orders", SECRET)
                .key("parked-1")
                .aggregate_key("order-7")
                .header("tenant", "acme"),
        )
        .unwrap();
    tx.commit().unwrap();
    let t = quoted(&outbox);
    client
        .batch_execute(&format!(
            "UPDATE {t} SET payload = convert_to('{SECRET}', 'UTF8');
             UPDATE {t} SET status = 'parked', park = true, attempts = 5, done_at = now(),
                            last_error = 'no route to exchange' WHERE key = 'parked-1';"
        ))
        .unwrap();
    (outbox, client)
}

fn dead_rows(client: &mut Client, outbox: &Outbox, keys: &[&str]) -> Vec<String> {
    client
        .query(
            &format!(
                "SELECT status FROM {} WHERE key = ANY($1) ORDER BY key",
                quoted(outbox)
            ),
            &[&keys],
        )
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

#[test]
fn the_overview_shows_each_tables_counts_and_no_page_shows_a_payload() {
    let (a, mut client) = outbox_with_dead_letters("web_overview");
    let (b, _) = outbox("web_overview_b");
    // A relay's report of a publisher that is down (see tests/health.rs for a real one).
    client
        .execute(
            &format!(
                "INSERT INTO {} (relay, pid, started_at, publisher, down_since)
                 VALUES ('r1', 4242, now(), 'down', now() - interval '90 seconds')",
                quoted_with(&a, "_relays")
            ),
            &[],
        )
        .unwrap();
    let server = Server::start(&database_url(), &[&a, &b], &[], None);

    // The doctor runs on the server's own schedule, never for a page.
    wait_until("the doctor has run", || {
        server.get("/", &[]).body.contains("cannot publish")
    });
    let page = server.get("/", &[]);
    assert_eq!(page.status, 200, "{}", page.body);
    let stats = a.stats(&mut client).unwrap();
    let cell = |outbox: &Outbox, what: &str| page.by_id(&format!("{}-{what}", outbox.table()));
    assert_eq!(cell(&a, "pending"), stats.pending.to_string());
    assert_eq!(cell(&a, "dead"), stats.dead.to_string());
    assert_eq!(cell(&a, "parked"), "1");
    assert_eq!(cell(&a, "sent"), stats.sent.to_string());
    assert_eq!(cell(&b, "pending"), "0");
    assert!(cell(&a, "publisher-0").starts_with("down for 1m"));
    assert!(page.body.contains("cannot publish"), "the doctor's finding");
    assert!(page.body.contains("<svg"), "a chart");
    // The sampler's points reach the chart.
    wait_until("the backlog chart has a line", || {
        server.get("/", &[]).body.contains("<polyline")
    });

    // The doctor's line is the alarm's colour while letters are dead or parked.
    assert!(
        page.body.contains("<span class=\"bad\">web_overview")
            && page.body.contains("1 parked dead letter"),
        "{}",
        page.body
    );
    let dead = server.get(&format!("/dead?table={}", a.table()), &[]);
    assert_eq!(dead.status, 200);
    assert!(dead.body.contains("timeout talking to broker"));
    assert!(dead.body.contains("order-7"), "the parked aggregate");
    let group = server.get(
        &format!(
            "/dead/group?table={}&error=timeout+talking+to+broker",
            a.table()
        ),
        &[],
    );
    assert_eq!(group.status, 200);
    for key in ["d1", "d2", "d3"] {
        assert!(
            group.body.contains(&format!(">{key}<")),
            "{key} in the group"
        );
    }
    assert!(!group.body.contains(">d4<"), "d4 died of something else");
    let message = server.get(&format!("/message?table={}&key=parked-1", a.table()), &[]);
    assert_eq!(message.status, 200);
    assert!(message.body.contains("tenant") && message.body.contains("acme"));
    assert!(
        message.body.contains("parked: dead, and holding back"),
        "{}",
        message.body
    );
    assert!(message.by_id("payload").contains("Hidden"));
    let asked = server.get(
        &format!("/message?table={}&key=parked-1&payload=1", a.table()),
        &[],
    );
    for reply in [&page, &dead, &group, &message, &asked] {
        assert!(!reply.body.contains(SECRET), "a payload on a page");
    }
    // Not one of them offers a change: the server is read-only.
    assert!(!dead.body.contains("/action"));
    let log = server.stop();
    assert!(!log.contains(SECRET));
}

#[test]
fn a_payload_is_shown_only_when_allowed_and_asked_for_and_capped() {
    let (outbox, mut client) = outbox_with_dead_letters("web_payload");
    let big = "x".repeat(10_000);
    client
        .execute(
            &format!(
                "UPDATE {} SET payload = convert_to($1, 'UTF8') WHERE key = 'd4'",
                quoted(&outbox)
            ),
            &[&big],
        )
        .unwrap();
    let server = Server::start(&database_url(), &[&outbox], &["--show-payloads"], None);
    let t = outbox.table();
    let page = server.get(&format!("/message?table={t}&key=parked-1"), &[]);
    assert!(!page.body.contains(SECRET), "not before it is asked for");
    let asked = server.get(&format!("/message?table={t}&key=parked-1&payload=1"), &[]);
    assert_eq!(asked.by_id("payload"), SECRET);
    let capped = server.get(&format!("/message?table={t}&key=d4&payload=1"), &[]);
    assert_eq!(capped.by_id("payload").len(), 4096);
}

#[test]
fn a_redrive_needs_the_token_and_a_csrf_token_and_touches_only_what_it_previewed() {
    let (outbox, mut client) = outbox_with_dead_letters("web_redrive");
    let server = Server::taking_changes(&outbox);
    let t = outbox.table();
    let scope = format!("table={t}&kind=redrive&error=timeout+talking+to+broker");

    // Without the token: no preview, no change.
    assert_eq!(server.get(&format!("/action?{scope}"), &[]).status, 401);
    assert_eq!(server.post("/action", &[], &scope).status, 401);
    let wrong = server.post("/login", &[], "token=not-the-token-at-all");
    assert_eq!(wrong.status, 401);
    assert!(wrong.header("set-cookie").is_none());
    assert_eq!(
        dead_rows(&mut client, &outbox, &["d1", "d2", "d3"]),
        ["dead"; 3]
    );

    // Logged in: the preview counts, the confirmation carries the CSRF token.
    let login = server.post("/login", &[], &format!("token={TOKEN}"));
    assert_eq!(login.status, 303);
    let cookie = login.header("set-cookie").expect("a session cookie");
    assert!(cookie.contains("HttpOnly") && cookie.contains("SameSite=Strict"));
    let session = cookie.split(';').next().unwrap().to_owned();
    // The name is this server's own, so another app on localhost cannot have set it
    // before; and one it plants after, sent first, does not hide the session.
    let name = session.split('=').next().unwrap().to_owned();
    assert!(
        name != "outbox_session" && name.starts_with("outbox_"),
        "{name}"
    );
    let planted = format!("{name}=planted-by-a-neighbour; {session}");
    let shadowed = server.get(&format!("/action?{scope}"), &[("Cookie", &planted)]);
    assert_eq!(shadowed.status, 200, "{}", shadowed.body);
    let cookie = [("Cookie", session.as_str())];
    let preview = server.get(&format!("/action?{scope}"), &cookie);
    assert_eq!(preview.status, 200, "{}", preview.body);
    assert_eq!(preview.by_id("would"), "3");
    let csrf = preview.field("csrf");
    assert_eq!(
        dead_rows(&mut client, &outbox, &["d1", "d2", "d3"]),
        ["dead"; 3]
    );

    // A form without it, or with another, is refused (what another site's page would post).
    assert_eq!(server.post("/action", &cookie, &scope).status, 403);
    let forged = format!("{scope}&csrf={}", "0".repeat(64));
    assert_eq!(server.post("/action", &cookie, &forged).status, 403);
    assert_eq!(
        dead_rows(&mut client, &outbox, &["d1", "d2", "d3"]),
        ["dead"; 3]
    );

    let done = server.post("/action", &cookie, &format!("{scope}&csrf={csrf}"));
    assert_eq!(done.status, 200, "{}", done.body);
    assert!(done.by_id("done").starts_with("Redrove 3 dead letters"));
    assert_eq!(
        dead_rows(&mut client, &outbox, &["d1", "d2", "d3", "d4", "d5"]),
        ["pending", "pending", "pending", "dead", "dead"]
    );

    // The token in a header needs no form token: no browser sends it on its own.
    let bearer = format!("Bearer {TOKEN}");
    let skip = server.post(
        "/action",
        &[("Authorization", &bearer)],
        &format!("table={t}&kind=skip&key=parked-1"),
    );
    assert_eq!(skip.status, 200, "{}", skip.body);
    assert!(skip.by_id("done").starts_with("Skipped 1 parked"));
    let log = server.stop();
    assert!(log.contains("redrove 3 dead letters"), "{log}");
    assert!(log.contains("skipped 1 parked dead letter "), "{log}");
    assert!(!log.contains(TOKEN), "the token in the log");
}

#[test]
fn every_bad_request_is_refused_and_changes_nothing() {
    let (outbox, mut client) = outbox_with_dead_letters("web_refusals");
    let t = outbox.table();
    let bearer = format!("Bearer {TOKEN}");
    let auth = [("Authorization", bearer.as_str())];

    let read_only = Server::start(&database_url(), &[&outbox], &[], Some(TOKEN));
    let change = format!("table={t}&kind=purge&all=1");
    assert_eq!(read_only.post("/action", &auth, &change).status, 403);
    assert_eq!(
        read_only.get(&format!("/action?{change}"), &auth).status,
        403
    );
    drop(read_only);

    let server = Server::taking_changes(&outbox);
    let status = |path: &str| server.get(path, &auth).status;
    assert_eq!(status("/nowhere"), 404);
    assert_eq!(status("/dead?table=no_such_table"), 404);
    assert_eq!(status(&format!("/message?table={t}&key=nobody")), 404);
    assert_eq!(
        status(&format!("/action?table={t}&kind=explode&all=1")),
        400
    );
    // A change must name its rows.
    assert_eq!(status(&format!("/action?table={t}&kind=purge")), 400);
    assert_eq!(
        status(&format!(
            "/action?table={t}&kind=purge&older_than=yesterday"
        )),
        400
    );
    assert_eq!(
        server
            .post("/action", &auth, &format!("table={t}&kind=purge"))
            .status,
        400
    );
    assert_eq!(server.post("/", &auth, "").status, 405);
    // Another site's name for this address (DNS rebinding).
    let rebound = server.raw(b"GET / HTTP/1.1\r\nHost: evil.example:8080\r\n\r\n");
    assert_eq!(rebound.status, 400);
    let huge = format!("table={t}&kind=purge&all=1&pad={}", "x".repeat(20_000));
    assert_eq!(server.post("/action", &auth, &huge).status, 413);
    assert_eq!(server.raw(b"NOT HTTP AT ALL\r\n\r\n").status, 400);
    // A client that stops half-way gets an answer at the deadline, and the server goes on.
    let slow =
        server.raw(b"POST /action HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 40\r\n\r\ntable=");
    assert_eq!(slow.status, 408);
    assert_eq!(status("/"), 200);

    assert_eq!(count(&mut client, &outbox, "status = 'dead'"), 5);
    assert_eq!(count(&mut client, &outbox, "status = 'parked'"), 1);
    assert_eq!(count(&mut client, &outbox, "true"), 8);
}

#[test]
fn a_server_without_a_token_takes_no_changes_and_stays_on_loopback() {
    let (outbox, _client) = outbox("web_usage");
    let run = |args: &[&str], token: Option<&str>| {
        let mut command = Command::new(env!("CARGO_BIN_EXE_postgres-outbox"));
        command
            .env("DATABASE_URL", database_url())
            .env_remove("OUTBOX_WEB_TOKEN")
            .args(["--table", outbox.table(), "serve"])
            .args(args);
        if let Some(token) = token {
            command.env("OUTBOX_WEB_TOKEN", token);
        }
        let output = command.output().expect("run serve");
        (
            output.status.code(),
            String::from_utf8_lossy(&output.stderr).into_owned(),
        )
    };
    let (code, stderr) = run(&["--bind", "0.0.0.0:0"], None);
    assert_eq!(code, Some(2));
    assert!(stderr.contains("beyond loopback"), "{stderr}");
    let (code, stderr) = run(&["--allow-changes"], None);
    assert_eq!(code, Some(2));
    assert!(stderr.contains("needs a token"), "{stderr}");
    let (code, stderr) = run(&["--bind", "127.0.0.1:0"], Some("short"));
    assert_eq!(code, Some(2));
    assert!(stderr.contains("at least 16"), "{stderr}");
    // The token is never taken from the command line.
    let (code, _) = run(&["--token", TOKEN], None);
    assert_eq!(code, Some(2));
}

#[test]
fn beyond_loopback_every_page_needs_a_login() {
    let (outbox, _client) = outbox("web_private");
    let mut command = Command::new(env!("CARGO_BIN_EXE_postgres-outbox"));
    let mut child = command
        .env("DATABASE_URL", database_url())
        .env("OUTBOX_WEB_TOKEN", TOKEN)
        .args(["--table", outbox.table(), "serve", "--bind", "0.0.0.0:0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let port: u16 = line
        .trim()
        .trim_end_matches('/')
        .rsplit(':')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let server = Server {
        child,
        addr: SocketAddr::from(([127, 0, 0, 1], port)),
    };
    let page = server.get("/", &[]);
    assert_eq!(page.status, 303);
    assert_eq!(page.header("location"), Some("/login"));
    assert_eq!(server.get("/login", &[]).status, 200);
    let bearer = format!("Bearer {TOKEN}");
    assert_eq!(server.get("/", &[("Authorization", &bearer)]).status, 200);
}

#[test]
fn the_server_outlives_a_database_outage_and_says_so() {
    let (outbox, mut client) = outbox_with_dead_letters("web_outage");
    let config: postgres::Config = database_url().parse().unwrap();
    let (host, port) = match (&config.get_hosts()[0], config.get_ports()[0]) {
        (postgres::config::Host::Tcp(host), port) => (host.clone(), port),
        _ => panic!("the tests' database is reached over TCP"),
    };
    let proxy = Faulty::to(&format!("{host}:{port}"));
    let url = database_url().replacen(&format!("{host}:{port}"), &proxy.address(), 1);
    assert_ne!(url, database_url(), "the URL names its host and port");
    let server = Server::start(&url, &[&outbox], &[], None);
    assert_eq!(server.get("/", &[]).status, 200);

    proxy.set(Mode::Refuse);
    let page = server.get("/", &[]);
    assert_eq!(page.status, 200, "the overview still answers");
    assert!(page.by_id("database").contains("not answering"));
    let dead = server.get(&format!("/dead?table={}", outbox.table()), &[]);
    assert_eq!(dead.status, 503);

    // A row dies meanwhile (this connection does not go through the proxy).
    client
        .execute(
            &format!(
                "UPDATE {} SET status = 'dead', done_at = now(), last_error = 'x'
                 WHERE key = 'p1'",
                quoted(&outbox)
            ),
            &[],
        )
        .unwrap();
    let dead = outbox.stats(&mut client).unwrap().dead;

    proxy.set(Mode::Pass);
    let cell = format!("id=\"{}-dead\">{dead}<", outbox.table());
    wait_until("the overview shows the counts read since", || {
        let page = server.get("/", &[]);
        !page.body.contains("id=\"database\"") && page.body.contains(&cell)
    });
}

#[test]
#[ignore = "needs Chromium (apt-get install chromium, or OUTBOX_TEST_CHROMIUM); .ci/run installs it and runs this"]
fn in_a_browser_an_operator_reads_the_counts_follows_a_group_and_redrives_it_with_the_token() {
    use common::chromium::Browser;

    let (outbox, mut client) = outbox_with_dead_letters("web_browser");
    let server = Server::taking_changes(&outbox);
    let base = format!("http://{}", server.addr);
    let t = outbox.table();
    let stats = outbox.stats(&mut client).unwrap();
    let mut browser = Browser::launch();

    browser.open(&format!("{base}/"));
    assert_eq!(
        browser.text(&format!("{t}-dead")),
        Some(stats.dead.to_string())
    );
    assert_eq!(
        browser.text(&format!("{t}-pending")),
        Some(stats.pending.to_string())
    );
    assert_eq!(browser.text(&format!("{t}-parked")), Some("1".into()));
    browser.wait_for(
        "the backlog chart has a line",
        "document.querySelector('svg.chart polyline')",
    );
    let shot = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("serve-overview.png");
    browser.screenshot(&shot);
    assert!(std::fs::metadata(&shot).unwrap().len() > 1000);
    println!("screenshot of the overview: {}", shot.display());

    // The dead letters, then the group of one error.
    browser.click("a", "Dead letters", "/dead");
    browser.click("a.group", "timeout talking to broker", "/dead/group");
    let keys = browser.eval("[...document.querySelectorAll('a.message')].map(a => a.textContent)");
    assert_eq!(keys, serde_json::json!(["d1", "d3", "d2"]), "oldest first");

    // Not logged in: the redrive is refused, and nothing changed.
    browser.click("a.action", "redrive", "/action");
    assert!(
        browser.text("confirm").is_none(),
        "no confirmation without the token"
    );
    assert!(
        browser.eval("document.body.textContent.includes('log in first')")
            == serde_json::json!(true)
    );
    assert_eq!(
        dead_rows(&mut client, &outbox, &["d1", "d2", "d3"]),
        ["dead"; 3]
    );

    // Logged in with the token: preview, confirm, done.
    browser.open(&format!("{base}/login"));
    let token = serde_json::json!(TOKEN);
    browser.eval(&format!("document.getElementById('token').value = {token}"));
    browser.click("button", "log in", "/");
    browser.open(&format!(
        "{base}/dead/group?table={t}&error=timeout+talking+to+broker"
    ));
    browser.click("a.action", "redrive", "/action");
    assert_eq!(browser.text("would"), Some("3".into()));
    browser.click("button", "redrive 3", "/action");
    let done = browser.text("done").expect("the result");
    assert!(done.starts_with("Redrove 3 dead letters"), "{done}");
    assert_eq!(
        dead_rows(&mut client, &outbox, &["d1", "d2", "d3"]),
        ["pending"; 3]
    );
    let shot = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("serve-redrove.png");
    browser.screenshot(&shot);
    println!("screenshot after the redrive: {}", shot.display());
}

#[test]
fn the_token_can_come_from_a_file() {
    let (outbox, _client) = outbox("web_token_file");
    let file = std::env::temp_dir().join(unique_name("outbox-token"));
    std::fs::write(&file, format!("{TOKEN}\n")).unwrap();
    let path = file.to_str().unwrap();
    let server = Server::start(
        &database_url(),
        &[&outbox],
        &["--allow-changes", "--token-file", path],
        None,
    );
    assert_eq!(
        server
            .post("/login", &[], "token=wrong-token-wrong-token")
            .status,
        401
    );
    assert_eq!(
        server.post("/login", &[], &format!("token={TOKEN}")).status,
        303
    );
    std::fs::remove_file(&file).unwrap();
}

#[test]
fn idle_connections_do_not_lock_others_out() {
    let (outbox, _client) = outbox("web_idle");
    let server = Server::start(&database_url(), &[&outbox], &[], None);
    // More than the handlers and their queue: each sends the start of a request, then
    // nothing.
    let idle: Vec<TcpStream> = (0..48)
        .map(|_| {
            let mut stream = TcpStream::connect(server.addr).expect("connect");
            stream.write_all(b"GET / HTTP/1.1\r\n").expect("send");
            stream
        })
        .collect();
    let page = server.get("/", &[]);
    assert_eq!(page.status, 200, "{}", page.body);
    drop(idle);
}

#[test]
fn headers_that_could_smuggle_a_request_are_refused() {
    let (outbox, _client) = outbox("web_strict");
    let server = Server::start(&database_url(), &[&outbox], &[], None);
    let host = format!("Host: {}\r\n", server.addr);
    for (what, extra) in [
        ("two lengths", "Content-Length: 0\r\nContent-Length: 5\r\n"),
        (
            "the same length twice",
            "Content-Length: 0\r\nContent-Length: 0\r\n",
        ),
        ("a signed length", "Content-Length: +0\r\n"),
        ("two hosts", "Host: localhost\r\n"),
    ] {
        let request = format!("GET / HTTP/1.1\r\n{host}{extra}\r\n");
        assert_eq!(server.raw(request.as_bytes()).status, 400, "{what}");
    }
    // HEAD is GET without the body.
    let head = server.raw(format!("HEAD / HTTP/1.1\r\n{host}\r\n").as_bytes());
    assert_eq!(head.status, 200);
    assert!(head.body.is_empty(), "{}", head.body);
    assert_ne!(head.header("content-length"), Some("0"));
}

#[test]
fn a_change_older_than_nothing_is_refused_not_taken_for_all() {
    let (outbox, mut client) = outbox_with_dead_letters("web_zero_age");
    let server = Server::taking_changes(&outbox);
    let bearer = format!("Bearer {TOKEN}");
    let auth = [("Authorization", bearer.as_str())];
    let form = format!("table={}&kind=purge&older_than=0s", outbox.table());
    assert_eq!(server.get(&format!("/action?{form}"), &auth).status, 400);
    assert_eq!(server.post("/action", &auth, &form).status, 400);
    assert_eq!(count(&mut client, &outbox, "status = 'dead'"), 5);
}

#[test]
fn the_log_says_once_where_it_serves_and_escapes_what_a_client_sent() {
    let (outbox, _client) = outbox_with_dead_letters("web_log");
    let server = Server::taking_changes(&outbox);
    let bearer = format!("Bearer {TOKEN}");
    let forged = format!(
        "table={}&kind=purge&topic=x%0A[2026-01-01T00:00:00Z+INFO++forged]%1B[2J",
        outbox.table()
    );
    let done = server.post("/action", &[("Authorization", &bearer)], &forged);
    assert_eq!(done.status, 200, "{}", done.body);
    let log = server.stop();
    assert!(log.contains("purged 0 dead letters"), "{log}");
    assert!(!log.contains('\u{1b}'), "{log:?}");
    assert!(
        !log.lines().any(|line| line.starts_with("[2026-01-01")),
        "a forged line: {log}"
    );
    // The address is on stdout, where scripts read it; the log does not repeat it.
    assert!(!log.contains("http://"), "{log}");
}

/// Runs `command`, which must refuse to serve: a server that starts instead is killed, and
/// the test fails rather than hangs.
fn exits_at_start(mut command: Command) -> std::process::Output {
    let mut child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run serve");
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while child.try_wait().expect("its status").is_none() {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!("serve started instead of refusing to");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.wait_with_output().expect("its output")
}

#[test]
fn an_unknown_table_is_refused_at_start() {
    let missing = Outbox::new(&unique_name("web_missing")).unwrap();
    let mut command = Command::new(env!("CARGO_BIN_EXE_postgres-outbox"));
    command
        .env("DATABASE_URL", database_url())
        .env_remove("OUTBOX_WEB_TOKEN")
        .args(["--table", missing.table(), "serve", "--bind", "127.0.0.1:0"]);
    let output = exits_at_start(command);
    assert_eq!(output.status.code(), Some(1));
    let e = String::from_utf8_lossy(&output.stderr);
    assert!(e.contains(missing.table()) && e.contains("migrate"), "{e}");
}

#[test]
fn wrong_tokens_are_slowed_and_their_log_lines_bounded_and_a_weak_token_refused() {
    let (outbox, _client) = outbox("web_guess");
    let server = Server::start(&database_url(), &[&outbox], &[], Some(TOKEN));
    let tries = 60;
    let statuses: Vec<u16> = (0..tries)
        .map(|i| {
            server
                .post("/login", &[], &format!("token=guess-number-{i:04}-xyz"))
                .status
        })
        .collect();
    assert!(
        statuses.iter().all(|s| [401, 429].contains(s)),
        "{statuses:?}"
    );
    assert!(statuses.contains(&429), "never slowed: {statuses:?}");
    // Throttled, even the right token is not compared.
    assert_eq!(
        server.post("/login", &[], &format!("token={TOKEN}")).status,
        429
    );
    let log = server.stop();
    let lines = log.lines().filter(|l| l.contains("token")).count();
    assert!(
        lines < tries / 2,
        "{lines} log lines for {tries} tries: {log}"
    );

    let mut command = Command::new(env!("CARGO_BIN_EXE_postgres-outbox"));
    command
        .env("DATABASE_URL", database_url())
        .env("OUTBOX_WEB_TOKEN", "a".repeat(16))
        .args(["--table", outbox.table(), "serve", "--bind", "127.0.0.1:0"]);
    let output = exits_at_start(command);
    assert_eq!(output.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&output.stderr).contains("different characters"));
}

#[test]
fn the_doctor_runs_on_the_servers_schedule_not_per_page() {
    let (outbox, mut client) = outbox("web_doctor_cache");
    let relays = quoted_with(&outbox, "_relays");
    client
        .execute(
            &format!(
                "INSERT INTO {relays} (relay, pid, started_at, publisher, down_since)
                 VALUES ('r1', 4242, now(), 'down', now())"
            ),
            &[],
        )
        .unwrap();
    let server = Server::start(&database_url(), &[&outbox], &[], None);
    wait_until("the doctor has run", || {
        server.get("/", &[]).body.contains("cannot publish")
    });
    client
        .execute(&format!("DELETE FROM {relays}"), &[])
        .unwrap();
    // The next loads show what the doctor found, not a new run of it (it runs every 30 s).
    for _ in 0..3 {
        let page = server.get("/", &[]);
        assert!(page.body.contains("cannot publish"), "{}", page.body);
        assert!(page.body.contains("Doctor as of"), "{}", page.body);
    }
}

#[test]
fn a_long_error_makes_links_the_server_takes() {
    let (outbox, mut client) = outbox_with_dead_letters("web_long_error");
    let long = format!("broker said {}", "e".repeat(30_000));
    client
        .execute(
            &format!(
                "UPDATE {} SET last_error = $1 WHERE key = 'd4'",
                quoted(&outbox)
            ),
            &[&long],
        )
        .unwrap();
    let server = Server::taking_changes(&outbox);
    let dead = server.get(&format!("/dead?table={}", outbox.table()), &[]);
    assert_eq!(dead.status, 200);
    let links: Vec<String> = dead
        .body
        .split("href=\"")
        .skip(1)
        .filter_map(|rest| rest.split('"').next())
        .map(|href| href.replace("&amp;", "&"))
        .collect();
    let group = links
        .iter()
        .find(|l| l.starts_with("/dead/group") && l.contains("broker+said"))
        .expect("a link to the long error's group");
    assert!(links.iter().all(|l| l.len() < 1024), "an unbounded link");
    let page = server.get(group, &[]);
    assert_eq!(page.status, 200, "{}", page.body);
    assert!(page.body.contains(">d4<"), "the group's message");
    let bearer = format!("Bearer {TOKEN}");
    let action = links
        .iter()
        .find(|l| l.starts_with("/action") && l.contains("broker+said"))
        .expect("a link to redrive or purge it");
    let preview = server.get(action, &[("Authorization", &bearer)]);
    assert_eq!(preview.status, 200, "{}", preview.body);
    assert_eq!(preview.by_id("would"), "1");
}
