//! `postgres-outbox serve`: an operator's page for one or several outbox tables. The overview
//! (counts, ages, the doctor's findings, the last hour as charts), dead letters by error,
//! a message's headers, and redrive, skip and purge by the same filters as the CLI, each
//! previewed with the count it would touch.
//!
//! Read-only unless started with `--allow-changes`; a change needs the token (a header, or
//! the session cookie of the login form, whose forms carry a CSRF token). Payloads are never
//! shown unless `--show-payloads` allows it, and then only on request, capped.

mod auth;
mod chart;
mod gate;
mod history;
mod http;
mod page;

use std::error::Error;
use std::fmt::Write;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant, SystemTime};

use crossbeam_channel::{bounded, TrySendError};
use postgres_native_tls::MakeTlsConnector;
use postgres_outbox::{Filter, Outbox, Rows, Stats};
use r2d2_postgres::PostgresConnectionManager;

use crate::{human, time};
use auth::{Auth, Who};
pub use auth::{MIN_DISTINCT, MIN_TOKEN};
use gate::{Gate, Place};
use history::History;
use http::{esc, loggable, query_value, Fields, Request, Response};
use page::{cell, number, page, table};

type Pool = r2d2::Pool<PostgresConnectionManager<MakeTlsConnector>>;
type Client = r2d2::PooledConnection<PostgresConnectionManager<MakeTlsConnector>>;
/// A handler's answer; an early `Err` is an answer too (a refusal).
type Answer = Result<Response, Response>;

/// Threads answering requests; a request that finds them all busy and the queue full gets
/// a 503 at once.
const HANDLERS: usize = 4;
const QUEUED: usize = 32;
/// The whole request must arrive within this of the connection's acceptance; the answer
/// must be taken within as long.
const READ_DEADLINE: Duration = Duration::from_secs(10);
/// A reader's stack: it holds a request's head and a read buffer, no more.
const READER_STACK: usize = 256 * 1024;
/// How often the doctor runs for the overview: it reads the server's statistics (about a
/// second of database work on a busy server), so a page load never runs it.
const DOCTOR_EVERY: Duration = Duration::from_secs(30);
/// The most of an error's text a link carries (the header cap is 16 KiB, and an error
/// may be any length): a filter by its start finds the group.
const LINKED_ERROR: usize = 200;
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);
/// Dead letters listed on one page.
const LIST_LIMIT: usize = 200;
/// The most of a payload shown, when payloads may be shown at all.
const PAYLOAD_CAP: usize = 4096;
/// A page's statements give up after this, so a stuck one frees its handler.
const STATEMENT_TIMEOUT: &str = "-c statement_timeout=30s";

pub struct Options {
    pub bind: SocketAddr,
    pub allow_changes: bool,
    pub show_payloads: bool,
    pub sample_interval: Duration,
    pub token: Option<String>,
}

/// Serves until the process is stopped.
pub fn serve(
    outboxes: Vec<Outbox>,
    mut config: postgres::Config,
    tls: MakeTlsConnector,
    options: Options,
) -> Result<(), Box<dyn Error>> {
    let with_timeout = match config.get_options() {
        Some(o) => format!("{o} {STATEMENT_TIMEOUT}"),
        None => STATEMENT_TIMEOUT.to_owned(),
    };
    config
        .options(&with_timeout)
        .application_name("postgres-outbox serve");
    // Built unchecked: a database that is down at start is said on the pages, not fatal.
    let pool = r2d2::Pool::builder()
        .max_size(HANDLERS as u32 + 1)
        .min_idle(Some(0))
        .connection_timeout(Duration::from_secs(5))
        .build_unchecked(PostgresConnectionManager::new(config, tls));
    let listener = TcpListener::bind(options.bind)
        .map_err(|e| format!("cannot listen on {}: {e}", options.bind))?;
    let bound = listener.local_addr()?;
    let app = Arc::new(App {
        outboxes,
        pool,
        auth: Auth::new(options.token),
        allow_changes: options.allow_changes,
        show_payloads: options.show_payloads,
        private: !bound.ip().is_loopback(),
        bound,
        history: History::default(),
        gate: Arc::new(Gate::default()),
    });
    let sampler = app.clone();
    thread::Builder::new()
        .name("sampler".into())
        .spawn(move || sampler.sample_forever(options.sample_interval))?;
    let (tx, rx) = bounded::<Job>(QUEUED);
    for n in 0..HANDLERS {
        let (app, rx) = (app.clone(), rx.clone());
        thread::Builder::new()
            .name(format!("handler-{n}"))
            .spawn(move || rx.iter().for_each(|job| app.answer(job)))?;
    }
    if app.private {
        log::warn!(
            "serving beyond loopback over plain HTTP: the token and the session cookie cross \
             the network unencrypted; put a TLS proxy in front"
        );
    }
    // Tests and scripts read the address from here (with --bind 127.0.0.1:0, the port); the
    // log says the rest, not the address again.
    println!("serving http://{bound}/");
    log::info!(
        "serve: {} table(s), {}{}",
        app.outboxes.len(),
        if app.allow_changes {
            "changes allowed with the token"
        } else {
            "read-only"
        },
        if app.show_payloads {
            ", payloads on request"
        } else {
            ""
        }
    );
    for stream in listener.incoming() {
        match stream {
            Ok(stream) => app.admit(stream, &tx),
            // Out of file descriptors, most likely: let some close.
            Err(e) => {
                log::warn!("serve: cannot accept a connection: {e}");
                thread::sleep(Duration::from_millis(100));
            }
        }
    }
    Ok(())
}

struct App {
    outboxes: Vec<Outbox>,
    pool: Pool,
    auth: Auth,
    allow_changes: bool,
    show_payloads: bool,
    /// Bound beyond loopback: every page needs a login.
    private: bool,
    bound: SocketAddr,
    history: History,
    gate: Arc<Gate>,
}

/// A request read whole, for a handler.
struct Job {
    stream: TcpStream,
    request: Request,
    _place: Place,
}

/// Says the server is busy, without waiting on a client that does not read.
fn busy(mut stream: TcpStream) {
    let _ = Response::text(503, "busy: try again in a moment").write(
        &mut stream,
        Duration::from_secs(1),
        false,
    );
}

/// What a change does, and to which rows.
#[derive(Clone, Copy)]
enum Kind {
    Redrive,
    Skip,
    Purge,
}

impl Kind {
    fn parse(text: Option<&str>) -> Result<Kind, Response> {
        match text {
            Some("redrive") => Ok(Kind::Redrive),
            Some("skip") => Ok(Kind::Skip),
            Some("purge") => Ok(Kind::Purge),
            _ => Err(page::message(
                400,
                "Bad request",
                "kind must be redrive, skip or purge",
            )),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Kind::Redrive => "redrive",
            Kind::Skip => "skip",
            Kind::Purge => "purge",
        }
    }

    fn done(self) -> &'static str {
        match self {
            Kind::Redrive => "redrove",
            Kind::Skip => "skipped",
            Kind::Purge => "purged",
        }
    }

    fn noun(self, n: u64) -> &'static str {
        match (self, n) {
            (Kind::Skip, 1) => "parked dead letter",
            (Kind::Skip, _) => "parked dead letters",
            (Kind::Redrive | Kind::Purge, 1) => "dead letter",
            (Kind::Redrive | Kind::Purge, _) => "dead letters",
        }
    }
}

/// The rows a change names, from a query or a form, with the fields to pass it on.
struct Scope {
    filter: Filter,
    /// The fields as received, to carry into the confirmation's form.
    fields: Vec<(&'static str, String)>,
    /// For people and logs: "topic = x, error contains y".
    describe: String,
}

impl Scope {
    fn parse(fields: &Fields) -> Result<Scope, Response> {
        let bad = |text: String| page::message(400, "Bad request", &text);
        let mut filter = Filter::new();
        let mut kept: Vec<(&'static str, String)> = Vec::new();
        let mut said = Vec::new();
        let keys = fields.all("key");
        if !keys.is_empty() {
            said.push(format!(
                "key in {}",
                keys.iter()
                    .map(|k| loggable(k))
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
            kept.extend(keys.iter().map(|k| ("key", k.clone())));
            filter = filter.keys(keys);
        }
        if let Some(topic) = fields.get("topic") {
            said.push(format!("topic = {}", loggable(topic)));
            kept.push(("topic", topic.to_owned()));
            filter = filter.topic(topic);
        }
        if let Some(error) = fields.get("error") {
            said.push(format!("error contains \"{}\"", loggable(error)));
            kept.push(("error", error.to_owned()));
            filter = filter.error_contains(error);
        }
        if let Some(older) = fields.get("older_than") {
            let age = humantime::parse_duration(older)
                .map_err(|e| bad(format!("older_than {older:?}: {e}")))?;
            // Every dead letter is older than nothing: that is all=1, which must be said.
            if age.is_zero() {
                return Err(bad(
                    "older_than must be more than 0s (or say all=1)".to_owned()
                ));
            }
            said.push(format!("dead more than {} ago", loggable(older)));
            kept.push(("older_than", older.to_owned()));
            filter = filter.older_than(age);
        }
        if fields.get("parked") == Some("1") {
            said.push("parked".to_owned());
            kept.push(("parked", "1".to_owned()));
            filter = filter.parked();
        }
        if filter.is_empty() {
            if fields.get("all") != Some("1") {
                return Err(bad(
                    "name the rows: a key, topic, error, older_than or parked, or all=1".to_owned(),
                ));
            }
            said.push("all".to_owned());
            kept.push(("all", "1".to_owned()));
        }
        Ok(Scope {
            filter,
            fields: kept,
            describe: said.join(", "),
        })
    }
}

impl App {
    /// Samples every table's stats every `interval`, or less often when they take long (a
    /// database under load): sampling keeps to a twentieth of one backend's time.
    /// The doctor runs with them every `DOCTOR_EVERY`.
    fn sample_forever(&self, interval: Duration) {
        let mut doctor_due = Instant::now();
        loop {
            let mut client = self.pool.get().ok();
            // Timed from here: waiting for a database that is down is not its load.
            let started = Instant::now();
            let doctor = started >= doctor_due && client.is_some();
            for outbox in &self.outboxes {
                let stats = client.as_mut().and_then(|c| outbox.stats(c).ok());
                self.history.record(outbox.table(), stats.as_ref());
                if let (true, Some(c)) = (doctor, client.as_mut()) {
                    let health = outbox.health(c).map_err(|e| e.to_string());
                    self.history.record_health(outbox.table(), health);
                }
            }
            if doctor {
                doctor_due = Instant::now() + DOCTOR_EVERY;
            }
            drop(client);
            thread::sleep(interval.max(started.elapsed() * 19));
        }
    }

    /// Admits a connection just accepted and reads its request on a thread of its own,
    /// by a deadline from now, then queues it for a handler.
    fn admit(&self, stream: TcpStream, queue: &crossbeam_channel::Sender<Job>) {
        let deadline = Instant::now() + READ_DEADLINE;
        let place = stream
            .peer_addr()
            .ok()
            .and_then(|peer| self.gate.admit(peer.ip()));
        let Some(place) = place else {
            return busy(stream);
        };
        let queue = queue.clone();
        let read = move || {
            let mut stream = stream;
            match http::read_request(&mut stream, deadline) {
                Ok(request) => {
                    let job = Job {
                        stream,
                        request,
                        _place: place,
                    };
                    if let Err(TrySendError::Full(job) | TrySendError::Disconnected(job)) =
                        queue.try_send(job)
                    {
                        busy(job.stream);
                    }
                }
                Err(e) => {
                    if let Some(response) = e.response() {
                        let _ = response.write(&mut stream, WRITE_TIMEOUT, false);
                        http::linger(&mut stream);
                    }
                }
            }
        };
        // Out of threads: the connection is dropped (and its place given back).
        if let Err(e) = thread::Builder::new()
            .name("reader".into())
            .stack_size(READER_STACK)
            .spawn(read)
        {
            log::warn!("serve: cannot start a reader: {e}");
        }
    }

    /// Answers a request read whole; a handler that panics answers 500 and the thread
    /// goes on.
    fn answer(&self, job: Job) {
        let Job {
            mut stream,
            request,
            _place,
        } = job;
        let response = catch_unwind(AssertUnwindSafe(|| self.route(&request)))
            .unwrap_or_else(|_| Response::text(500, "the page failed; see the server's log"));
        let _ = response.write(&mut stream, WRITE_TIMEOUT, request.method == "HEAD");
    }

    fn route(&self, request: &Request) -> Response {
        if !self.expected_host(request) {
            return Response::text(400, "unexpected Host header");
        }
        let who = self.auth.who(request);
        let path = request.path.as_str();
        // HEAD is GET without the body (Response::write leaves it out).
        let method = match request.method.as_str() {
            "HEAD" => "GET",
            method => method,
        };
        if self.private && !who.is_known() && path != "/login" {
            return match method {
                "GET" => Response::redirect("/login"),
                _ => Response::text(401, "log in first"),
            };
        }
        let answer = match (method, path) {
            ("GET", "/") => self.overview(&who),
            ("GET", "/dead") => self.dead(request, &who),
            ("GET", "/dead/group") => self.group(request, &who),
            ("GET", "/message") => self.message(request, &who),
            ("GET", "/action") => self.preview(request, &who),
            ("POST", "/action") => self.act(request),
            ("GET", "/login") => Ok(self.login_form(200, None)),
            ("POST", "/login") => Ok(self.login(request)),
            ("POST", "/logout") => self.logout(request),
            (_, "/" | "/dead" | "/dead/group" | "/message" | "/action" | "/login" | "/logout") => {
                Err(Response::text(405, "method not allowed"))
            }
            _ => Err(page::message(404, "Not found", "no such page")),
        };
        answer.unwrap_or_else(|refusal| refusal)
    }

    /// On loopback, only a Host naming loopback: a page of another site that rebinds its
    /// name to 127.0.0.1 must not read these pages through the browser.
    fn expected_host(&self, request: &Request) -> bool {
        if self.private {
            return true;
        }
        let Some(host) = request.header("host") else {
            return false;
        };
        let name = match host.rsplit_once(':') {
            Some((name, port)) if port.parse::<u16>().is_ok() && !name.contains(':') => name,
            Some((name, port)) if port.parse::<u16>().is_ok() && name.ends_with(']') => name,
            _ => host,
        };
        matches!(name, "localhost" | "127.0.0.1" | "[::1]") || name == self.bound.ip().to_string()
    }

    fn frame(&self, title: &str, body: &str, who: &Who) -> Response {
        Response::html(200, page(title, body, who.csrf(), self.auth.has_token()))
    }

    fn outbox(&self, fields: &Fields) -> Result<&Outbox, Response> {
        match fields.get("table") {
            None if self.outboxes.len() == 1 => Ok(&self.outboxes[0]),
            None => Err(page::message(
                400,
                "Bad request",
                "which table? (table=...)",
            )),
            Some(name) => self
                .outboxes
                .iter()
                .find(|o| o.table() == name)
                .ok_or_else(|| {
                    page::message(
                        404,
                        "Not found",
                        &format!("no table {name:?} is served here"),
                    )
                }),
        }
    }

    fn client(&self) -> Result<Client, Response> {
        self.pool.get().map_err(|e| {
            page::message(
                503,
                "Database unavailable",
                &format!("the database is not answering: {e}"),
            )
        })
    }

    fn overview(&self, who: &Who) -> Answer {
        let mut client = self.client().ok();
        let mut body = String::new();
        if client.is_none() {
            body.push_str(
                "<p class=\"bad\" id=\"database\">The database is not answering; the counts \
                 and charts show what was sampled before.</p>",
            );
        }
        for outbox in &self.outboxes {
            body.push_str(&self.card(outbox, client.as_deref_mut()));
        }
        Ok(self.frame("Overview", &body, who))
    }

    /// One table on the overview. Its counts and the doctor's findings are the sampler's
    /// latest (a page load adds no load however often it is reloaded); the counts are read
    /// now before the first sample.
    fn card(&self, outbox: &Outbox, client: Option<&mut postgres::Client>) -> String {
        let name = outbox.table();
        let mut html = format!("<section class=\"card\"><h2>{}</h2>", esc(name));
        let sampled = self.history.latest(name).or_else(|| {
            let stats = outbox.stats(client?).ok()?;
            Some((Instant::now(), stats))
        });
        // The doctor's, as the sampler last ran it.
        let doctor = self.history.health(name);
        match sampled {
            Some((at, stats)) => {
                // The due age as the doctor last read it (it opens every partition).
                let due = match &doctor {
                    Some((_, Ok(health))) => Some(health.oldest_due_age),
                    _ => None,
                };
                html.push_str(&counts(name, &stats, due));
                let _ = write!(
                    html,
                    "<p class=\"note\">Counts as of {} ago.</p>",
                    human(Some(at.elapsed()))
                );
            }
            None => html.push_str("<p class=\"note\">No counts read yet.</p>"),
        }
        match doctor {
            Some((at, Ok(health))) => {
                html.push_str(&relays(name, &health.relays));
                html.push_str(&findings(&health));
                let _ = write!(
                    html,
                    "<p class=\"note\">Doctor as of {} ago.</p>",
                    human(Some(at.elapsed()))
                );
            }
            Some((_, Err(e))) => {
                let _ = write!(
                    html,
                    "<p class=\"note\">Doctor unavailable: {}</p>",
                    esc(&e)
                );
            }
            None => html.push_str("<p class=\"note\" id=\"health\">Doctor: not run yet.</p>"),
        }
        let now = Instant::now();
        let points = self.history.points(name);
        let series = |f: fn(&history::Point) -> Option<f64>| -> Vec<_> {
            points.iter().map(|p| (p.at, f(p))).collect()
        };
        let _ = write!(
            html,
            "<div class=\"charts\">{}{}{}</div>\
             <p><a href=\"/dead?table={}\">Dead letters and parked aggregates</a></p></section>",
            chart::line("backlog (pending rows)", "", &series(|p| p.pending), now),
            chart::line("throughput (sent/s)", "/s", &series(|p| p.throughput), now),
            chart::line("oldest pending (s)", "s", &series(|p| p.oldest_secs), now),
            query_value(name)
        );
        html
    }

    fn dead(&self, request: &Request, who: &Who) -> Answer {
        let query = request.query();
        let outbox = self.outbox(&query)?;
        let mut client = self.client()?;
        let t = query_value(outbox.table());
        let groups = outbox
            .dead_letter_errors(&mut client, Filter::new())
            .map_err(db_failed)?;
        let rows: Vec<Vec<String>> =
            groups
                .iter()
                .map(|g| {
                    let error = g.error.as_deref().unwrap_or("");
                    let scope = if error.is_empty() {
                        format!("&amp;key={}", query_value(&g.sample_key))
                    } else {
                        format!("&amp;error={}", query_value(linked(error)))
                    };
                    let actions = if error.is_empty() {
                        String::new()
                    } else {
                        self.actions(&t, &[Kind::Redrive, Kind::Purge], &scope, "")
                    };
                    vec![
                        format!(
                        "<td><a class=\"group\" href=\"/dead/group?table={t}{scope}\">{}</a></td>",
                        esc(if error.is_empty() { "(no error text)" } else { error })
                    ),
                        format!("<td class=\"n group-count\">{}</td>", g.count),
                        cell(&time(g.first_dead_at)),
                        cell(&time(g.last_dead_at)),
                        format!("<td>{actions}</td>"),
                    ]
                })
                .collect();
        let mut body = format!("<h2>Dead letters of {} by error</h2>", esc(outbox.table()));
        if rows.is_empty() {
            body.push_str("<p id=\"no-dead\">No dead letters.</p>");
        } else {
            body.push_str(&table(&["last error", "count", "first", "last", ""], &rows));
        }
        let parked = outbox
            .dead_letters(&mut client, Filter::new().parked().limit(LIST_LIMIT))
            .map_err(db_failed)?;
        body.push_str("<h2>Parked aggregates</h2>");
        if parked.is_empty() {
            body.push_str("<p>None: no aggregate waits on a dead letter.</p>");
        } else {
            let rows: Vec<Vec<String>> = parked
                .iter()
                .map(|d| {
                    let key = query_value(&d.record.key);
                    let actions = self.actions(
                        &t,
                        &[Kind::Redrive, Kind::Skip],
                        &format!("&amp;key={key}"),
                        "",
                    );
                    vec![
                        cell(d.record.aggregate_key.as_deref().unwrap_or("")),
                        format!(
                            "<td><a href=\"/message?table={t}&amp;key={key}\">{}</a></td>",
                            esc(&d.record.key)
                        ),
                        cell(&d.record.topic),
                        cell(d.last_error.as_deref().unwrap_or("")),
                        cell(&time(d.dead_at)),
                        format!("<td>{actions}</td>"),
                    ]
                })
                .collect();
            body.push_str(&table(
                &[
                    "aggregate",
                    "held by",
                    "topic",
                    "last error",
                    "dead since",
                    "",
                ],
                &rows,
            ));
        }
        Ok(self.frame("Dead letters", &body, who))
    }

    fn group(&self, request: &Request, who: &Who) -> Answer {
        let query = request.query();
        let outbox = self.outbox(&query)?;
        let mut client = self.client()?;
        let t = query_value(outbox.table());
        let mut filter = Filter::new().limit(LIST_LIMIT);
        let mut scope = String::new();
        if let Some(error) = query.get("error") {
            filter = filter.error_contains(error);
            scope = format!("&amp;error={}", query_value(linked(error)));
        }
        let keys = query.all("key");
        if !keys.is_empty() {
            scope.extend(keys.iter().map(|k| format!("&amp;key={}", query_value(k))));
            filter = filter.keys(keys);
        }
        let dead = outbox
            .dead_letters(&mut client, filter)
            .map_err(db_failed)?;
        let rows: Vec<Vec<String>> = dead
            .iter()
            .map(|d| {
                let r = &d.record;
                vec![
                    format!(
                        "<td><a class=\"message\" href=\"/message?table={t}&amp;key={}\">{}</a></td>",
                        query_value(&r.key),
                        esc(&r.key)
                    ),
                    cell(&r.topic),
                    cell(r.aggregate_key.as_deref().unwrap_or("")),
                    format!("<td class=\"n\">{}</td>", r.attempt),
                    cell(d.last_error.as_deref().unwrap_or("")),
                    cell(&time(r.created_at)),
                    cell(&time(d.dead_at)),
                ]
            })
            .collect();
        let mut body = format!(
            "<p>{} dead letters of {} (at most {LIST_LIMIT} shown).</p>",
            dead.len(),
            esc(outbox.table())
        );
        if !scope.is_empty() {
            let actions = self.actions(&t, &[Kind::Redrive, Kind::Purge], &scope, " these");
            let _ = write!(body, "<p>{actions}</p>");
        }
        body.push_str(&table(
            &[
                "key",
                "topic",
                "aggregate",
                "attempts",
                "last error",
                "created",
                "dead since",
            ],
            &rows,
        ));
        Ok(self.frame("Dead letters", &body, who))
    }

    fn message(&self, request: &Request, who: &Who) -> Answer {
        let query = request.query();
        let outbox = self.outbox(&query)?;
        let key = query
            .get("key")
            .ok_or_else(|| page::message(400, "Bad request", "which message? (key=...)"))?;
        let mut client = self.client()?;
        let found = outbox
            .dead_letters(&mut client, Filter::new().key(key).limit(1))
            .map_err(db_failed)?;
        let dead = found
            .first()
            .ok_or_else(|| page::message(404, "Not found", "no dead letter has that key"))?;
        let parked = !outbox
            .dead_letters(&mut client, Filter::new().key(key).parked().limit(1))
            .map_err(db_failed)?
            .is_empty();
        let r = &dead.record;
        let state = if parked {
            "parked: dead, and holding back the later messages of its aggregate"
        } else {
            "dead"
        };
        let facts = [
            ("state", state.to_owned()),
            ("key", r.key.clone()),
            ("topic", r.topic.clone()),
            ("aggregate", r.aggregate_key.clone().unwrap_or_default()),
            ("content type", r.content_type.clone().unwrap_or_default()),
            ("attempts", r.attempt.to_string()),
            ("created", time(r.created_at)),
            ("dead since", time(dead.dead_at)),
            ("last error", dead.last_error.clone().unwrap_or_default()),
            ("payload size", format!("{} bytes", r.payload.len())),
        ];
        let rows: Vec<Vec<String>> = facts.iter().map(|(n, v)| vec![cell(n), cell(v)]).collect();
        let mut body = table(&["", ""], &rows);
        body.push_str("<h2>Headers</h2>");
        let headers: Vec<Vec<String>> = r
            .headers
            .iter()
            .map(|(n, v)| vec![cell(n), cell(v)])
            .collect();
        body.push_str(&table(&["name", "value"], &headers));
        body.push_str("<h2>Payload</h2>");
        if !self.show_payloads {
            body.push_str(
                "<p class=\"note\" id=\"payload\">Hidden: this server was not started with \
                 --show-payloads.</p>",
            );
        } else if query.get("payload") == Some("1") {
            let shown = &r.payload[..r.payload.len().min(PAYLOAD_CAP)];
            let _ = write!(
                body,
                "<pre id=\"payload\">{}</pre><p class=\"note\">{} of {} bytes.</p>",
                esc(&String::from_utf8_lossy(shown)),
                shown.len(),
                r.payload.len()
            );
        } else {
            let _ = write!(
                body,
                "<p><a id=\"payload\" href=\"/message?table={}&amp;key={}&amp;payload=1\">Show the \
                 payload</a> (at most {PAYLOAD_CAP} bytes).</p>",
                query_value(outbox.table()),
                query_value(key)
            );
        }
        Ok(self.frame(&format!("Message {key}"), &body, who))
    }

    /// Links to the previews of `kinds` of change to the rows `scope` names (query fields,
    /// each `&amp;`-led), on a server that takes changes; nothing on one that does not.
    fn actions(&self, table: &str, kinds: &[Kind], scope: &str, suffix: &str) -> String {
        if !self.allow_changes {
            return String::new();
        }
        kinds
            .iter()
            .map(|kind| {
                format!(
                    "<a class=\"action\" href=\"/action?table={table}&amp;kind={k}{scope}\">{k}{suffix}</a> ",
                    k = kind.name()
                )
            })
            .collect()
    }

    /// A change is allowed on this server at all.
    fn changes_allowed(&self) -> Result<(), Response> {
        if self.allow_changes {
            Ok(())
        } else {
            Err(page::message(
                403,
                "Read-only",
                "this server is read-only: start it with --allow-changes (and a token)",
            ))
        }
    }

    /// What a change would touch, and the form that confirms it.
    fn preview(&self, request: &Request, who: &Who) -> Answer {
        self.changes_allowed()?;
        let query = request.query();
        let outbox = self.outbox(&query)?;
        let kind = Kind::parse(query.get("kind"))?;
        let scope = Scope::parse(&query)?;
        if !who.is_known() {
            return Err(page::message(
                401,
                "Log in",
                "a change needs the token: log in first",
            ));
        }
        let mut client = self.client()?;
        let n = self.count(outbox, &mut client, kind, &scope)?;
        let mut hidden = format!(
            "<input type=\"hidden\" name=\"table\" value=\"{}\">\
             <input type=\"hidden\" name=\"kind\" value=\"{}\">",
            esc(outbox.table()),
            kind.name()
        );
        if let Some(csrf) = who.csrf() {
            let _ = write!(
                hidden,
                "<input type=\"hidden\" name=\"csrf\" value=\"{}\">",
                esc(csrf)
            );
        }
        for (name, value) in &scope.fields {
            let _ = write!(
                hidden,
                "<input type=\"hidden\" name=\"{name}\" value=\"{}\">",
                esc(value)
            );
        }
        let body = format!(
            "<p>This would {} <strong id=\"would\">{n}</strong> {} of {} ({}).</p>\
             <form method=\"post\" action=\"/action\">{hidden}<button id=\"confirm\">{} {n}</button></form>\
             <p><a href=\"/dead?table={}\">Cancel</a></p>",
            kind.name(),
            kind.noun(n),
            esc(outbox.table()),
            esc(&scope.describe),
            kind.name(),
            query_value(outbox.table())
        );
        Ok(self.frame(&format!("Confirm {}", kind.name()), &body, who))
    }

    fn count(
        &self,
        outbox: &Outbox,
        client: &mut Client,
        kind: Kind,
        scope: &Scope,
    ) -> Result<u64, Response> {
        let filter = scope.filter.clone();
        match kind {
            Kind::Redrive => outbox.count(client, Rows::Dead.matching(filter)),
            Kind::Skip => outbox.would_skip(client, filter),
            Kind::Purge => outbox.would_purge(client, Rows::Dead.matching(filter)),
        }
        .map_err(refused)
    }

    fn act(&self, request: &Request) -> Answer {
        self.changes_allowed()?;
        let form = request.form();
        self.auth.allow_change(request, &form)?;
        let outbox = self.outbox(&form)?;
        let kind = Kind::parse(form.get("kind"))?;
        let scope = Scope::parse(&form)?;
        let mut client = self.client()?;
        let filter = scope.filter.clone();
        let n = match kind {
            Kind::Redrive => outbox.redrive(&mut client, filter),
            Kind::Skip => outbox.skip(&mut client, filter),
            Kind::Purge => outbox.purge(&mut client, Rows::Dead.matching(filter)),
        }
        .map_err(refused)?;
        log::info!(
            "serve: {} {n} {} of {} ({})",
            kind.done(),
            kind.noun(n),
            outbox.table(),
            scope.describe
        );
        let body = format!(
            "<p id=\"done\">{} {n} {} of {} ({}).</p><p><a href=\"/dead?table={}\">Back to \
             the dead letters</a></p>",
            capitalised(kind.done()),
            kind.noun(n),
            esc(outbox.table()),
            esc(&scope.describe),
            query_value(outbox.table()),
        );
        let who = self.auth.who(request);
        Ok(self.frame("Done", &body, &who))
    }

    fn login_form(&self, status: u16, problem: Option<&str>) -> Response {
        if !self.auth.has_token() {
            return page::message(
                404,
                "No logins",
                "this server has no token (--token-file or OUTBOX_WEB_TOKEN), so it takes \
                 no logins and no changes",
            );
        }
        let problem = problem.map_or(String::new(), |p| {
            format!("<p class=\"bad\" id=\"problem\">{}</p>", esc(p))
        });
        let body = format!(
            "{problem}<form method=\"post\" action=\"/login\"><label>Token \
             <input type=\"password\" name=\"token\" id=\"token\" autocomplete=\"off\"></label> \
             <button id=\"login\">log in</button></form>"
        );
        Response::html(status, page("Log in", &body, None, false))
    }

    fn login(&self, request: &Request) -> Response {
        let form = request.form();
        match self.auth.login(form.get("token").unwrap_or("")) {
            Ok(id) => Response::redirect("/").with("Set-Cookie", self.auth.cookie(&id)),
            // A wrong token is logged where it is counted (auth.rs), boundedly.
            Err((status, why)) => self.login_form(status, Some(why)),
        }
    }

    fn logout(&self, request: &Request) -> Answer {
        self.auth.allow_change(request, &request.form())?;
        self.auth.logout(request);
        Ok(Response::redirect("/").with("Set-Cookie", self.auth.expired_cookie()))
    }
}

/// The counts of `Stats` as a table, each cell with an id to read it by.
/// `due`: the oldest due age, once the doctor has read it.
fn counts(table_name: &str, s: &Stats, due: Option<Option<Duration>>) -> String {
    let id = |what: &str| format!("{table_name}-{what}");
    let row = vec![
        number(&id("pending"), s.pending),
        number(&id("due"), s.due),
        number(&id("blocked"), s.blocked),
        number(&id("in-flight"), s.in_flight),
        number(&id("sent"), s.sent),
        number(&id("dead"), s.dead),
        number(&id("parked"), s.parked),
        cell(&human(s.oldest_pending_age)),
        cell(&due.map_or_else(|| "not read yet".to_owned(), human)),
        cell(&human(s.oldest_blocked_age)),
    ];
    let mut html = table(
        &[
            "pending",
            "due",
            "blocked",
            "in flight",
            "sent",
            "dead",
            "parked",
            "oldest pending",
            "oldest due",
            "oldest blocked",
        ],
        &[row],
    );
    html.push_str(
        "<p class=\"note\">Oldest pending counts from enqueue, delayed rows too; oldest due \
         from when a row could be taken: that one growing means no relay takes rows.</p>",
    );
    if !s.exact {
        html.push_str(
            "<p class=\"note\">Pending, due, blocked, in flight and the ages are estimates: \
             the backlog is larger than what a sample reads. \
             <code>postgres-outbox stats --exact</code> counts every row.</p>",
        );
    }
    html
}

/// The doctor's findings, or that there are none.
fn findings(health: &postgres_outbox::Health) -> String {
    if health.is_healthy() {
        return "<p class=\"ok\" id=\"health\">Doctor: nothing needs attention.</p>".to_owned();
    }
    let mut html = String::from("<p class=\"bad\">Doctor:</p><ul id=\"health\">");
    for f in &health.findings {
        let _ = write!(
            html,
            "<li><span class=\"bad\">{}</span><br>{}</li>",
            esc(&f.problem),
            esc(&f.remedy)
        );
    }
    html.push_str("</ul>");
    html
}

/// The relays' reports: who runs, and whether each reaches its destination.
fn relays(table_name: &str, reports: &[postgres_outbox::RelayReport]) -> String {
    if reports.is_empty() {
        return "<p class=\"note\">No relay reports on this table.</p>".to_owned();
    }
    let rows: Vec<Vec<String>> = reports
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let state = match r.publisher {
                postgres_outbox::PublisherState::Down { since } => {
                    let down = SystemTime::now().duration_since(since).ok();
                    format!("down for {}", human(down))
                }
                state => state.name().to_owned(),
            };
            let class = if state.starts_with("down") {
                "bad"
            } else {
                "ok"
            };
            vec![
                cell(&format!("pid {}", r.pid)),
                cell(r.client_addr.as_deref().unwrap_or("local socket")),
                format!(
                    "<td class=\"{class}\" id=\"{}\">{}</td>",
                    esc(&format!("{table_name}-publisher-{i}")),
                    esc(&state)
                ),
                format!("<td class=\"n\">{}</td>", r.published),
                cell(&format!("{} ago", human(Some(r.last_seen)))),
            ]
        })
        .collect();
    table(
        &["relay", "from", "publisher", "published", "last report"],
        &rows,
    )
}

/// A database failure on a page: said, with no DETAIL (the crate's errors never show one).
fn db_failed(e: postgres_outbox::Error) -> Response {
    page::message(503, "Database error", &e.to_string())
}

/// A change the library refused (a bad filter) or the database failed.
fn refused(e: postgres_outbox::Error) -> Response {
    if e.is_invalid_input() {
        page::message(400, "Bad request", &e.to_string())
    } else {
        db_failed(e)
    }
}

/// The start of an error's text, for a link: at most `LINKED_ERROR` characters.
fn linked(error: &str) -> &str {
    match error.char_indices().nth(LINKED_ERROR) {
        Some((at, _)) => &error[..at],
        None => error,
    }
}

fn capitalised(word: &str) -> String {
    let mut chars = word.chars();
    chars
        .next()
        .map(|c| c.to_uppercase().collect::<String>() + chars.as_str())
        .unwrap_or_default()
}
