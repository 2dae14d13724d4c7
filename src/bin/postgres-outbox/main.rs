//! `postgres-outbox`: operate an outbox from the shell. See `postgres-outbox --help`.
//!
//! Exit status: 0 on success, 1 on an error (one line on stderr), 2 on bad usage.

#![forbid(unsafe_code)]

/// `println!` that hands back an error instead of panicking when stdout is closed
/// (`postgres-outbox sql | head -1`); `main` ends quietly on a broken pipe.
macro_rules! say {
    () => {
        writeln!(std::io::stdout())?
    };
    ($($arg:tt)*) => {
        writeln!(std::io::stdout(), $($arg)*)?
    };
}

mod logs;
mod serve;

use std::error::Error;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use clap::error::ErrorKind;
use clap::{ArgAction, ArgGroup, Args, CommandFactory, Parser, Subcommand, ValueEnum};
use postgres::config::SslMode;
use postgres::Client;
use postgres_native_tls::MakeTlsConnector;
use postgres_outbox::rabbitmq::{Endpoints, PublisherConfig};
use postgres_outbox::{
    Access, Connections, Filter, HealthThresholds, HeldBack, ObjectKind, Outbox, Relay,
    RelayConfig, Retry, Rows,
};
use serde_json::{json, Value};

type Result<T, E = Box<dyn Error>> = std::result::Result<T, E>;

/// Operate a postgres-outbox table: migrate it, see what is stuck and why, redrive or purge
/// exactly the rows you name, and run a relay to RabbitMQ.
#[derive(Parser)]
#[command(name = "postgres-outbox", version)]
struct Cli {
    /// PostgreSQL URL, e.g. postgres://user:password@host/db?sslmode=require. TLS: with
    /// sslmode=require the server's certificate and name are verified (system roots and
    /// --database-ca); with prefer (the default), TLS when the server offers it, verified only
    /// with --database-ca; disable: none.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true, global = true)]
    database_url: Option<String>,
    /// A CA certificate (PEM; a bundle may hold several) to verify the server's certificate
    /// with, besides the system's roots; `system`: the system's roots only. Given, the
    /// certificate is verified under sslmode=prefer too.
    #[arg(long, env = "PGSSLROOTCERT", value_name = "FILE", global = true)]
    database_ca: Option<PathBuf>,
    /// The outbox table (`name` or `schema.name`); `serve` takes it repeated, for several.
    #[arg(long, env = "OUTBOX_TABLE", default_value = "outbox", action = ArgAction::Append, global = true)]
    table: Vec<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Create or upgrade the outbox's tables (safe to run again).
    Migrate {
        /// Make the table, still empty, partitioned by time: a partition per interval (`1d`),
        /// dropped whole by `purge sent` once all its rows are sent (see
        /// docs/partitions.md). On a partitioned table, sets the interval from the open partition on.
        #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
        partition_interval: Option<Duration>,
    },
    /// List everything `migrate` made for the table (it, its partitions, its companion
    /// tables and functions), and drop it all, rows included, with --yes. Refused while
    /// relays of the table report that they run.
    Uninstall {
        /// Drop what is listed.
        #[arg(long)]
        yes: bool,
    },
    /// Print the DDL `migrate` would apply.
    Sql {
        /// As `migrate --partition-interval`.
        #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
        partition_interval: Option<Duration>,
    },
    /// Print the GRANT statements that give a role what one side of the outbox needs, and
    /// no more (docs/grants.md); run them as the table's owner, after migrate.
    Grants {
        /// The side the role plays.
        #[arg(value_enum)]
        access: AccessArg,
        /// The role, as written (quoted): `relay` for a role created as CREATE ROLE relay.
        role: String,
    },
    /// Rows by state, the oldest pending and blocked ages, and per topic pending and dead.
    /// Past 2,000 rows in a part of the backlog the counts are estimates, marked `~` (and
    /// `"exact": false`), and topics are left out (`"topics": null`), unless --exact is given.
    Stats {
        /// Print JSON.
        #[arg(long)]
        json: bool,
        /// Count every pending row, however long that takes (about 2 s per million).
        #[arg(long)]
        exact: bool,
    },
    /// Diagnose the outbox: dead tuples and vacuum, what holds back the xmin horizon (an old
    /// transaction, a prepared transaction, a replication slot), rows due and not claimed.
    /// Exits with 1 when something is wrong.
    Doctor {
        /// A row due this long and not claimed is a problem (like 30s or 5m; keep it above
        /// the relays' poll interval).
        #[arg(long, default_value = "1m", value_parser = humantime::parse_duration)]
        due_age: Duration,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// List dead letters, oldest first, or group them by error with --by-error.
    Dead {
        /// At most this many (not with --by-error).
        #[arg(long, default_value_t = 20)]
        limit: usize,
        /// One line per distinct error: count, first and last seen, one sample key.
        #[arg(long)]
        by_error: bool,
        #[command(flatten)]
        filter: FilterArgs,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Let the aggregates of parked dead letters go on without them (they stay dead).
    #[command(group(scope()))]
    Skip {
        #[command(flatten)]
        filter: FilterArgs,
        /// Skip every parked dead letter (required when no filter is given).
        #[arg(long)]
        all: bool,
        /// Print how many would be skipped and change nothing.
        #[arg(long)]
        dry_run: bool,
    },
    /// Make dead letters pending again, with a fresh attempt budget.
    #[command(group(scope()))]
    Redrive {
        #[command(flatten)]
        filter: FilterArgs,
        /// Redrive every dead letter (required when no filter is given).
        #[arg(long)]
        all: bool,
        /// Print how many would be redriven and change nothing.
        #[arg(long)]
        dry_run: bool,
    },
    /// Delete finished rows: sent rows, dead letters, or consumers' dedupe records.
    #[command(group(scope()))]
    Purge {
        /// What to delete.
        what: What,
        #[command(flatten)]
        filter: FilterArgs,
        /// Delete every such row (required when no filter is given).
        #[arg(long)]
        all: bool,
        /// Purge dedupe records processed less than an hour ago (every redelivery of their
        /// messages would then be processed again).
        #[arg(long)]
        force: bool,
        /// Print how many would be deleted and change nothing.
        #[arg(long)]
        dry_run: bool,
    },
    /// Run a relay to a RabbitMQ exchange until SIGINT or SIGTERM (logs via RUST_LOG).
    Relay(RelayArgs),
    /// Serve an operator's web page for the tables (--table repeated) until stopped:
    /// counts, charts of the last hour, the doctor's findings, dead letters by error, and,
    /// with --allow-changes and the token, redrive, skip and purge.
    Serve(ServeArgs),
}

/// Commands that change rows name them: by a filter, or every one with `--all`.
fn scope() -> ArgGroup {
    ArgGroup::new("scope")
        .args([
            "keys",
            "topic",
            "error_contains",
            "older_than",
            "parked",
            "all",
        ])
        .multiple(true)
        .required(true)
}

/// How recent a dedupe record `purge inbox` deletes without `--force`.
const INBOX_WINDOW: Duration = Duration::from_secs(3600);

/// A side of the outbox, for `grants`.
#[derive(Clone, Copy, ValueEnum)]
enum AccessArg {
    /// enqueue and enqueue_all.
    Produce,
    /// A relay, and process.
    Relay,
    /// dedupe alone.
    Dedupe,
    /// The RabbitMQ consumer.
    Consume,
    /// purge by age of a partitioned table.
    Retire,
}

impl AccessArg {
    fn access(self) -> Access {
        match self {
            AccessArg::Produce => Access::Produce,
            AccessArg::Relay => Access::Relay,
            AccessArg::Dedupe => Access::Dedupe,
            AccessArg::Consume => Access::Consume,
            AccessArg::Retire => Access::Retire,
        }
    }
}

#[derive(Clone, Copy, ValueEnum)]
enum What {
    Sent,
    Dead,
    Inbox,
}

#[derive(Args)]
struct FilterArgs {
    /// Only this key (repeat for more).
    #[arg(long = "key", value_name = "KEY")]
    keys: Vec<String>,
    /// Only this topic.
    #[arg(long)]
    topic: Option<String>,
    /// Only rows whose last error contains this text.
    #[arg(long, value_name = "TEXT")]
    error_contains: Option<String>,
    /// Only rows finished longer ago than this, e.g. 7d, 12h, 30m.
    #[arg(long, value_name = "AGE", value_parser = humantime::parse_duration)]
    older_than: Option<Duration>,
    /// Only dead letters that park their aggregate.
    #[arg(long)]
    parked: bool,
}

#[derive(Args)]
struct ServeArgs {
    /// The address to listen on. Anything but loopback needs a token, and then every page
    /// needs a login.
    #[arg(long, default_value = "127.0.0.1:8080")]
    bind: std::net::SocketAddr,
    /// Take changes (redrive, skip, purge) from clients that show the token.
    #[arg(long)]
    allow_changes: bool,
    /// A file holding the token (its first line). Or set OUTBOX_WEB_TOKEN; never on the
    /// command line, where other users of the machine can read it.
    #[arg(long, value_name = "FILE")]
    token_file: Option<PathBuf>,
    /// Let a message's page show its payload, on request, at most 4 KiB of it.
    #[arg(long)]
    show_payloads: bool,
    /// How often the charts are sampled.
    #[arg(long, value_name = "DURATION", default_value = "5s", value_parser = humantime::parse_duration)]
    sample_interval: Duration,
}

#[derive(Args)]
struct RelayArgs {
    /// RabbitMQ URL, e.g. amqp://user:password@host:5672/vhost; several, comma-separated, for
    /// the nodes of a cluster (tried in order, failing over to the next on a lost connection).
    /// amqps:// takes ?cacertfile=/path/ca.pem for a CA besides the system's.
    #[arg(long, env = "AMQP_URL", hide_env_values = true)]
    amqp_url: String,
    /// Try the --amqp-url endpoints in a random order instead (spreads relays over the nodes).
    #[arg(long)]
    amqp_shuffle: bool,
    /// The exchange to publish to (it must exist).
    #[arg(long)]
    exchange: String,
    /// Rows per claim.
    #[arg(long)]
    batch_size: Option<usize>,
    /// Worker threads.
    #[arg(long)]
    concurrency: Option<usize>,
    /// How long a claim holds its rows, e.g. 30s.
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    lease: Option<Duration>,
    /// How often an idle worker looks for due rows, e.g. 2s.
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    poll_interval: Option<Duration>,
    /// Attempts before a row becomes a dead letter.
    #[arg(long)]
    max_attempts: Option<u32>,
    /// How long publishes under way may take to finish at shutdown.
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = humantime::parse_duration)]
    drain_timeout: Duration,
}

fn main() -> ExitCode {
    // Usage errors exit with 2, from clap.
    let cli = Cli::parse();
    // The long-running commands say what they do (serve logs every change it makes).
    let default_level = if matches!(cli.command, Command::Relay(_) | Command::Serve(_)) {
        "info"
    } else {
        "warn"
    };
    logs::init(default_level);
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        // The reader of stdout went away (`| head -1`): it has what it wanted.
        Err(e) if broken_pipe(e.as_ref()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("postgres-outbox: error: {}", one_line(e.as_ref()));
            ExitCode::from(1)
        }
    }
}

/// The error and its causes, on one line, with a hint where one helps. The crate's own
/// errors already show their cause, except what lies below a connection that failed before
/// any SQL (TLS, I/O).
fn one_line(error: &(dyn Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut cause = error.source();
    if let Some(e) = error.downcast_ref::<postgres_outbox::Error>() {
        if e.is_not_migrated() {
            text.push_str(" (`postgres-outbox migrate` creates it)");
        }
        cause = e
            .source()
            .and_then(|s| s.downcast_ref::<postgres::Error>())
            .filter(|db| db.as_db_error().is_none())
            .and_then(|db| db.source());
    }
    while let Some(e) = cause {
        // (A TLS error shows the same OpenSSL error as its source does.)
        let more = e.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        cause = e.source();
    }
    if certificate_failed(error) {
        text.push_str(
            " (a server certificate signed by a private CA verifies with --database-ca FILE \
             or PGSSLROOTCERT)",
        );
    }
    text.replace('\n', " ")
}

fn broken_pipe(error: &(dyn Error + 'static)) -> bool {
    error
        .downcast_ref::<std::io::Error>()
        .is_some_and(|e| e.kind() == std::io::ErrorKind::BrokenPipe)
}

/// Ends the process as clap does on bad usage: the message, the usage line, exit 2.
fn usage(kind: ErrorKind, text: impl std::fmt::Display) -> ! {
    Cli::command().error(kind, text).exit()
}

/// Where the database is, for an error: host(s) and port(s), never the user or password.
fn database_at(config: &postgres::Config) -> String {
    let ports = config.get_ports();
    config
        .get_hosts()
        .iter()
        .enumerate()
        .map(|(i, host)| {
            let port = ports.get(i).or(ports.first()).copied().unwrap_or(5432);
            match host {
                postgres::config::Host::Tcp(name) => format!("{name}:{port}"),
                postgres::config::Host::Unix(dir) => format!("{}:{port}", dir.display()),
            }
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// Connects the command's own client, naming where it failed to.
fn connect(config: &postgres::Config, tls: MakeTlsConnector) -> Result<Client> {
    config.connect(tls).map_err(|e| {
        format!(
            "cannot connect to the database at {}: {}",
            database_at(config),
            one_line(&e)
        )
        .into()
    })
}

/// Whether a server certificate that did not verify is behind `error`.
fn certificate_failed(error: &(dyn Error + 'static)) -> bool {
    let mut cause = Some(error);
    while let Some(e) = cause {
        if e.is::<native_tls::Error>() && e.to_string().contains("certificate") {
            return true;
        }
        cause = e.source();
    }
    false
}

fn run(cli: Cli) -> Result<()> {
    // `sql` and `grants` only print: they need no database.
    let config = || {
        let Some(url) = &cli.database_url else {
            usage(
                ErrorKind::MissingRequiredArgument,
                "the database is needed: --database-url URL, or DATABASE_URL",
            );
        };
        database_config(url)
    };
    if let Command::Serve(args) = cli.command {
        let config = config();
        let options = serve_options(args)?;
        let outboxes = cli
            .table
            .iter()
            .map(|t| Outbox::new(t))
            .collect::<Result<Vec<_>, _>>()?;
        let tls = database_tls(&config, cli.database_ca.as_deref())?;
        // Every table must be an outbox, as for any other command; a database that is
        // down at start is said on the pages instead.
        match config.connect(tls.clone()) {
            Ok(mut client) => {
                for outbox in &outboxes {
                    outbox.check(&mut client)?;
                }
            }
            Err(e) => log::warn!(
                "serve: the database at {} is not answering ({}); serving anyway",
                database_at(&config),
                one_line(&e)
            ),
        }
        return serve::serve(outboxes, config, tls, options);
    }
    let [table] = cli.table.as_slice() else {
        usage(
            ErrorKind::ArgumentConflict,
            "--table is taken once, except by serve",
        );
    };
    let partition_interval = match cli.command {
        Command::Migrate { partition_interval } | Command::Sql { partition_interval } => {
            partition_interval
        }
        _ => None,
    };
    let outbox = match partition_interval {
        Some(every) => Outbox::builder()
            .table(table)
            .partition_interval(every)
            .build()?,
        None => Outbox::new(table)?,
    };
    if let Command::Sql { .. } = cli.command {
        write!(std::io::stdout(), "{}", outbox.sql())?;
        return Ok(());
    }
    if let Command::Grants { access, role } = &cli.command {
        write!(
            std::io::stdout(),
            "{}",
            outbox.grants(access.access(), role)?
        )?;
        return Ok(());
    }
    if let Command::Purge { what, filter, .. } = &cli.command {
        if filter.parked {
            usage(
                ErrorKind::ArgumentConflict,
                match what {
                    What::Dead => {
                        "purge dead never deletes parked dead letters (their aggregates wait \
                         on them): skip or redrive them first"
                    }
                    What::Sent | What::Inbox => "--parked names dead letters only",
                },
            );
        }
    }
    let config = config();
    let tls = database_tls(&config, cli.database_ca.as_deref())?;
    let mut client = connect(&config, tls.clone())?;
    // What reads the table, after it is known to be an outbox (not some other table that
    // would fail on a column the outbox has).
    if !matches!(
        cli.command,
        Command::Migrate { .. } | Command::Uninstall { .. }
    ) {
        outbox.check(&mut client)?;
    }
    if let Command::Relay(args) = cli.command {
        drop(client);
        return relay(outbox, config, tls, args);
    }
    match cli.command {
        Command::Migrate { .. } => {
            outbox.migrate(&mut client)?;
            say!("migrated {}", outbox.table());
        }
        Command::Uninstall { yes } => uninstall(&outbox, &mut client, yes)?,
        Command::Stats { json, exact } => stats(&outbox, &mut client, json, exact)?,
        Command::Doctor { due_age, json } => {
            let thresholds = HealthThresholds::default().due_age(due_age);
            if !doctor(&outbox, &mut client, &thresholds, json)? {
                return Err(DOCTOR_FOUND.into());
            }
        }
        Command::Dead {
            limit,
            by_error,
            filter,
            json,
        } => {
            let filter = filter.build();
            if by_error {
                dead_by_error(&outbox, &mut client, &filter, json)?;
            } else {
                dead(&outbox, &mut client, &filter, limit, json)?;
            }
        }
        // Clap has checked that each names its rows: a filter, or --all.
        Command::Redrive {
            filter, dry_run, ..
        } => {
            let filter = filter.build();
            let n = if dry_run {
                outbox.count(&mut client, Rows::Dead.matching(filter))?
            } else {
                outbox.redrive(&mut client, filter)?
            };
            let verb = if dry_run { "would redrive" } else { "redrove" };
            say!("{verb} {}", counted(n, "dead letter"));
        }
        Command::Skip {
            filter, dry_run, ..
        } => {
            let filter = filter.build();
            let n = if dry_run {
                outbox.would_skip(&mut client, filter)?
            } else {
                outbox.skip(&mut client, filter)?
            };
            let verb = if dry_run { "would skip" } else { "skipped" };
            say!("{verb} {}", counted(n, "parked dead letter"));
        }
        Command::Purge {
            what,
            filter,
            force,
            dry_run,
            ..
        } => {
            if let What::Inbox = what {
                check_inbox_window(&filter, force, dry_run);
            }
            let (rows, noun) = match what {
                What::Sent => (Rows::Sent, "sent row"),
                What::Dead => (Rows::Dead, "dead letter"),
                What::Inbox => (Rows::Inbox, "dedupe record"),
            };
            let rows = rows.matching(filter.build());
            let n = if dry_run {
                outbox.would_purge(&mut client, rows)?
            } else {
                outbox.purge(&mut client, rows)?
            };
            let verb = if dry_run { "would purge" } else { "purged" };
            say!("{verb} {}", counted(n, noun));
        }
        Command::Sql { .. } | Command::Grants { .. } | Command::Relay(_) | Command::Serve(_) => {}
    }
    Ok(())
}

/// `n` and `noun`, made plural unless `n` is 1: "1 dead letter", "3 dead letters".
fn counted(n: u64, noun: &str) -> String {
    if n == 1 {
        format!("1 {noun}")
    } else {
        format!("{n} {noun}s")
    }
}

/// Lists what `migrate` made for the table; drops it with `yes`.
fn uninstall(outbox: &Outbox, client: &mut Client, yes: bool) -> Result<()> {
    let kind = |k: ObjectKind| match k {
        ObjectKind::Table => "table",
        ObjectKind::Partition => "partition",
        _ => "function",
    };
    if !yes {
        let found = outbox.installed(client)?;
        if found.is_empty() {
            say!("nothing of outbox {} is installed", outbox.table());
            return Ok(());
        }
        say!("would drop, with every row:");
        for o in &found {
            say!("  {} {}", kind(o.kind), o.name);
        }
        say!("run again with --yes to drop them (stop the relays first)");
        return Ok(());
    }
    let dropped = outbox.uninstall(client)?;
    for o in &dropped {
        say!("dropped {} {}", kind(o.kind), o.name);
    }
    say!(
        "uninstalled {}: {}",
        outbox.table(),
        counted(dropped.len() as u64, "object")
    );
    Ok(())
}

/// The server's settings, its token read from the file or the environment. Usage errors
/// (exit 2): a bind beyond loopback, or changes, without a token; a token too short to be
/// out of a guesser's reach.
fn serve_options(args: ServeArgs) -> Result<serve::Options> {
    let usage = |text: String| -> ! {
        Cli::command()
            .error(ErrorKind::ValueValidation, text)
            .exit()
    };
    let token = match &args.token_file {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| format!("cannot read the token file {}: {e}", path.display()))?;
            Some(text.lines().next().unwrap_or("").trim().to_owned())
        }
        None => std::env::var("OUTBOX_WEB_TOKEN").ok(),
    }
    .filter(|t| !t.is_empty());
    if token.as_ref().is_some_and(|t| t.len() < serve::MIN_TOKEN) {
        usage(format!(
            "the token must be at least {} characters long",
            serve::MIN_TOKEN
        ));
    }
    let distinct = |t: &String| t.chars().collect::<std::collections::HashSet<_>>().len();
    if token
        .as_ref()
        .is_some_and(|t| distinct(t) < serve::MIN_DISTINCT)
    {
        usage(format!(
            "the token must have at least {} different characters: make a random one, e.g. \
             openssl rand -hex 16",
            serve::MIN_DISTINCT
        ));
    }
    if token.is_none() && !args.bind.ip().is_loopback() {
        usage(format!(
            "--bind {} is beyond loopback: set a token (--token-file or OUTBOX_WEB_TOKEN)",
            args.bind
        ));
    }
    if token.is_none() && args.allow_changes {
        usage("--allow-changes needs a token (--token-file or OUTBOX_WEB_TOKEN)".to_owned());
    }
    Ok(serve::Options {
        bind: args.bind,
        allow_changes: args.allow_changes,
        show_payloads: args.show_payloads,
        sample_interval: args.sample_interval,
        token,
    })
}

/// The database settings, with a connect timeout unless the URL sets one, so an unreachable
/// host fails within seconds. The URL itself is never echoed: it may hold a password.
fn database_config(url: &str) -> postgres::Config {
    let mut config: postgres::Config = match url.parse() {
        Ok(config) => config,
        // The driver knows disable, prefer and require, and says only "invalid
        // connection string" of libpq's other modes.
        Err(_) if url.contains("sslmode=verify-") => usage(
            ErrorKind::ValueValidation,
            "--database-url: sslmode=verify-ca and verify-full are not understood here: use \
             sslmode=require, which verifies the server's certificate and its host name (add \
             --database-ca FILE for a private CA)",
        ),
        Err(e) => usage(
            ErrorKind::ValueValidation,
            format!("invalid --database-url (not shown, it may hold a password): {e}"),
        ),
    };
    if config.get_connect_timeout().is_none() {
        config.connect_timeout(Duration::from_secs(10));
    }
    config
}

/// The TLS connector for every connection to the database (the commands' client, the relay's
/// pool and its own connections). `sslmode` in the URL decides whether it is used: disable,
/// never; require, always, and the connection fails unless the server's certificate verifies
/// (the system's roots and `ca`) for the host it was reached by; prefer (the default) when the
/// server offers TLS. Under prefer a certificate is verified only when `ca` is given: like
/// libpq's prefer, which verifies nothing, so a server with a self-signed certificate (a stock
/// Debian one) still connects, encrypted. (The driver would not fall back to plain text after
/// a failed handshake.)
fn database_tls(config: &postgres::Config, ca: Option<&Path>) -> Result<MakeTlsConnector> {
    let mut builder = native_tls::TlsConnector::builder();
    let mode = config.get_ssl_mode();
    match ca {
        _ if mode == SslMode::Disable => {}
        // libpq's PGSSLROOTCERT=system: the system's roots, verified.
        Some(path) if path.as_os_str() == "system" => {}
        Some(path) => {
            for certificate in read_ca(path)? {
                builder.add_root_certificate(certificate);
            }
        }
        None if mode == SslMode::Prefer => {
            builder.danger_accept_invalid_certs(true);
        }
        None => {}
    }
    let connector = builder
        .build()
        .map_err(|e| format!("cannot set up TLS: {e}"))?;
    Ok(MakeTlsConnector::new(connector))
}

/// The certificates of a PEM file (a CA, or a bundle of them).
fn read_ca(path: &Path) -> Result<Vec<native_tls::Certificate>> {
    let shown = path.display();
    let pem = std::fs::read(path)
        .map_err(|e| format!("cannot read --database-ca (PGSSLROOTCERT) {shown}: {e}"))?;
    let certificates = native_tls::Certificate::stack_from_pem(&pem)
        .map_err(|e| format!("--database-ca (PGSSLROOTCERT) {shown}: {e}"))?;
    if certificates.is_empty() {
        return Err(format!(
            "--database-ca (PGSSLROOTCERT) {shown} holds no PEM certificate \
             (-----BEGIN CERTIFICATE-----)"
        )
        .into());
    }
    Ok(certificates)
}

/// Says which dedupe records `purge inbox` deletes and what that means, and refuses, as bad
/// usage, to delete records younger than an hour without `--force` (unless it is given the
/// keys to delete): a message whose ack was lost comes again, and finds its record gone.
/// A dry run deletes nothing, so it only says what the real one would need.
fn check_inbox_window(filter: &FilterArgs, force: bool, dry_run: bool) {
    if !filter.keys.is_empty() {
        return;
    }
    let window = filter.older_than.unwrap_or(Duration::ZERO);
    let shown = humantime::format_duration(window);
    if window < INBOX_WINDOW && !force && dry_run {
        eprintln!(
            "purge inbox: a dry run; the purge itself would need --force or --older-than 1h \
             or more (messages delivered again after their record is gone are processed twice)"
        );
        return;
    }
    if window < INBOX_WINDOW && !force {
        Cli::command()
            .error(
                ErrorKind::ArgumentConflict,
                format!(
                    "purge inbox would delete the dedupe records of messages processed {} ago \
                     or longer: any of those delivered again (an ack lost, a redrive) would be \
                     processed twice. Give --older-than 1h or more (longer than a message can \
                     take to come again), or --force",
                    if window.is_zero() {
                        "any time".to_owned()
                    } else {
                        shown.to_string()
                    }
                ),
            )
            .exit();
    }
    eprintln!(
        "purge inbox: deleting the dedupe records of messages processed more than {shown} \
         ago; a message delivered again after its record is gone is processed again"
    );
}

impl FilterArgs {
    fn build(self) -> Filter {
        let mut filter = self.keys.into_iter().fold(Filter::new(), Filter::key);
        if let Some(topic) = self.topic {
            filter = filter.topic(topic);
        }
        if let Some(text) = self.error_contains {
            filter = filter.error_contains(text);
        }
        if let Some(age) = self.older_than {
            filter = filter.older_than(age);
        }
        if self.parked {
            filter = filter.parked();
        }
        filter
    }
}

fn secs(age: Option<Duration>) -> Value {
    age.map_or(Value::Null, |a| json!(a.as_secs_f64()))
}

fn human(age: Option<Duration>) -> String {
    age.map_or_else(
        || "-".to_owned(),
        |a| humantime::format_duration(Duration::from_secs(a.as_secs())).to_string(),
    )
}

/// What keeps a closed partition from settling, in a few words.
fn held_back(held: HeldBack) -> String {
    match held {
        HeldBack::Kept(1) => "it keeps 1 dead or parked row".to_owned(),
        HeldBack::Kept(1000..) => "it keeps 1,000 or more dead or parked rows".to_owned(),
        HeldBack::Kept(kept) => format!("it keeps {kept} dead or parked rows"),
        HeldBack::Pending => "it has rows to send".to_owned(),
        HeldBack::Transactions => "transactions from before its cut".to_owned(),
        HeldBack::NoUpkeep => "no upkeep since its cut".to_owned(),
        _ => "unknown".to_owned(),
    }
}

fn time(at: SystemTime) -> String {
    humantime::format_rfc3339_seconds(at).to_string()
}

/// The error `doctor` ends with when it found something, after printing what.
const DOCTOR_FOUND: &str = "the outbox needs attention (see above)";

/// Prints the diagnosis; true when healthy.
fn doctor(
    outbox: &Outbox,
    client: &mut Client,
    thresholds: &HealthThresholds,
    as_json: bool,
) -> Result<bool> {
    let health = outbox.health_with(client, thresholds)?;
    let tables = [&health.outbox_table, &health.inbox_table];
    if as_json {
        let holder = |h: &Option<postgres_outbox::Holder>| {
            h.as_ref().map_or(
                Value::Null,
                |h| json!({"id": h.id, "age_secs": h.age.as_secs_f64(), "what": h.what}),
            )
        };
        let value = json!({
            "table": outbox.table(),
            "healthy": health.is_healthy(),
            "tables": tables.iter().map(|t| json!({
                "table": t.table,
                "live_tuples": t.live_tuples,
                "dead_tuples": t.dead_tuples,
                "since_vacuum_secs": secs(t.since_vacuum),
                "since_analyze_secs": secs(t.since_analyze),
                "changed_since_analyze": t.changed_since_analyze,
                "autovacuum": t.autovacuum,
                "heap_bytes": t.heap_bytes,
                "total_bytes": t.total_bytes,
                "unused_heap_bytes": t.unused_heap_bytes,
            })).collect::<Vec<_>>(),
            "oldest_transaction": holder(&health.oldest_transaction),
            "oldest_prepared": holder(&health.oldest_prepared),
            "slots": health.slots.iter().map(|s| json!({
                "name": s.name, "kind": s.kind, "xmin_age": s.xmin_age,
                "wal_bytes": s.wal_bytes, "active": s.active, "active_pid": s.active_pid,
            })).collect::<Vec<_>>(),
            "oldest_due_age_secs": secs(health.oldest_due_age),
            "dead_letters": health.dead_letters,
            "parked": health.parked,
            "relays": health.relays.iter().map(|r| json!({
                "relay": r.relay, "client_addr": r.client_addr, "pid": r.pid,
                "started_at": time(r.started_at), "last_seen_secs": r.last_seen.as_secs_f64(),
                "publisher": r.publisher.name(), "published": r.published,
                "upkeep_error": r.upkeep_error,
                "since_claim_secs": secs(r.since_claim),
                "poll_interval_secs": secs(r.poll_interval),
                "publisher_down_since": match r.publisher {
                    postgres_outbox::PublisherState::Down { since } => Value::from(time(since)),
                    _ => Value::Null,
                },
            })).collect::<Vec<_>>(),
            "partitions": health.partitions.iter().map(|p| json!({
                "number": p.number, "every_secs": p.every.as_secs_f64(),
                "opened_secs": secs(p.opened), "closed_secs": secs(p.closed),
                "exists": p.exists, "rows": p.rows, "settled_secs": secs(p.settled),
                "held_back": p.held_back.map(|held| match held {
                    HeldBack::Kept(_) => "kept",
                    HeldBack::Pending => "pending",
                    HeldBack::Transactions => "transactions",
                    HeldBack::NoUpkeep => "no_upkeep",
                    _ => "unknown",
                }),
                "kept_rows": match p.held_back {
                    Some(HeldBack::Kept(rows)) => Value::from(rows),
                    _ => Value::Null,
                },
            })).collect::<Vec<_>>(),
            "findings": health.findings.iter().map(|f| json!({
                "check": f.check.name(), "problem": f.problem, "remedy": f.remedy,
            })).collect::<Vec<_>>(),
        });
        say!("{value}");
        return Ok(health.is_healthy());
    }
    for t in tables {
        say!(
            "{}: {} live, {} dead tuples, {} rows changed since analyzed; vacuumed {} ago, \
             analyzed {} ago{}; {} MiB with indexes, its rows {} MiB{}",
            t.table,
            t.live_tuples,
            t.dead_tuples,
            t.changed_since_analyze,
            human(t.since_vacuum),
            human(t.since_analyze),
            if t.autovacuum {
                ""
            } else {
                " (autovacuum off)"
            },
            t.total_bytes >> 20,
            t.heap_bytes >> 20,
            t.unused_heap_bytes.map_or(String::new(), |unused| format!(
                " (about {} MiB holding none)",
                unused >> 20
            ))
        );
    }
    let holders = [
        ("oldest transaction: backend", &health.oldest_transaction),
        ("oldest prepared transaction:", &health.oldest_prepared),
    ];
    for (what, holder) in holders {
        if let Some(h) = holder {
            say!("{what} {} ({}), open {}", h.id, h.what, human(Some(h.age)));
        }
    }
    for s in &health.slots {
        let state = match (s.active, s.active_pid) {
            (true, Some(pid)) => format!("read by pid {pid}"),
            (true, None) => "active".to_owned(),
            (false, _) => "inactive".to_owned(),
        };
        let xmin = s.xmin_age.map_or(String::new(), |age| {
            format!(", an xmin {age} transactions old")
        });
        say!(
            "replication slot {} ({}, {state}): {} bytes of WAL{xmin}",
            s.name,
            s.kind,
            s.wal_bytes
        );
    }
    say!("oldest due row: {}", human(health.oldest_due_age));
    say!(
        "dead letters: {} ({} parked)",
        health.dead_letters,
        health.parked
    );
    for r in &health.relays {
        say!(
            "relay {} (pid {}{}): publisher {}, {} published, last seen {} ago{}",
            r.relay,
            r.pid,
            r.client_addr
                .as_ref()
                .map_or(String::new(), |a| format!(" at {a}")),
            r.publisher.name(),
            r.published,
            human(Some(r.last_seen)),
            r.since_claim.map_or(String::new(), |since| format!(
                ", last claimed {} ago",
                human(Some(since))
            ))
        );
        if let Some(error) = &r.upkeep_error {
            say!("  its upkeep of the partitions fails: {error}");
        }
    }
    for p in &health.partitions {
        let state = match (p.opened, p.closed, p.exists) {
            (_, _, false) => "missing".to_owned(),
            (Some(_), Some(closed), _) => format!(
                "closed {} ago, {}",
                human(Some(closed)),
                match (p.settled, p.held_back) {
                    (Some(_), _) => "settled".to_owned(),
                    (None, Some(held)) => format!("not settled: {}", held_back(held)),
                    (None, None) => "not settled".to_owned(),
                }
            ),
            (Some(opened), None, _) => format!("open for {}", human(Some(opened))),
            (None, _, _) => "ahead".to_owned(),
        };
        say!(
            "partition {} ({} each): {state}, ~{} rows",
            p.number,
            human(Some(p.every)),
            p.rows
        );
    }
    if health.is_healthy() {
        say!("ok: nothing needs attention");
    }
    for finding in &health.findings {
        say!("problem: {}", finding.problem);
        say!("  remedy: {}", finding.remedy);
    }
    Ok(health.is_healthy())
}

fn stats(outbox: &Outbox, client: &mut Client, as_json: bool, exact: bool) -> Result<()> {
    let stats = if exact {
        outbox.stats_exact(client)?
    } else {
        outbox.stats(client)?
    };
    // Per topic, the backlog is read whole: only when the counts are exact anyway, so that
    // `stats` costs what `Outbox::stats` does however large the backlog.
    let due_age = outbox.oldest_due_age(client)?;
    let topics = if stats.exact {
        Some(outbox.topic_stats(client)?)
    } else {
        None
    };
    if as_json {
        let value = json!({
            "table": outbox.table(),
            "pending": stats.pending,
            "due": stats.due,
            "blocked": stats.blocked,
            "in_flight": stats.in_flight,
            "sent": stats.sent,
            "dead": stats.dead,
            "parked": stats.parked,
            "oldest_pending_age_secs": secs(stats.oldest_pending_age),
            "oldest_due_age_secs": secs(due_age),
            "oldest_blocked_age_secs": secs(stats.oldest_blocked_age),
            "exact": stats.exact,
            "topics": topics.as_ref().map(|topics| topics.iter().map(|t| json!({
                "topic": t.topic, "pending": t.pending, "dead": t.dead,
            })).collect::<Vec<_>>()),
        });
        say!("{value}");
        return Ok(());
    }
    // Estimates read as such: "~1000000".
    let about = if stats.exact { "" } else { "~" };
    say!("table              {}", outbox.table());
    say!("pending            {about}{}", stats.pending);
    say!("  due              {about}{}", stats.due);
    say!("  blocked          {about}{}", stats.blocked);
    say!("in flight          {about}{}", stats.in_flight);
    say!("sent               {}", stats.sent);
    say!("dead               {}", stats.dead);
    say!("  parked           {}", stats.parked);
    // Told apart: a row delayed for an hour is pending from its enqueue, due only after.
    say!(
        "oldest pending     {about}{}  (since enqueued, delayed rows too)",
        human(stats.oldest_pending_age)
    );
    say!(
        "oldest due         {}  (since due: growing, no relay takes rows)",
        human(due_age)
    );
    say!(
        "oldest blocked     {about}{}",
        human(stats.oldest_blocked_age)
    );
    match topics {
        Some(topics) if !topics.is_empty() => {
            say!();
            say!("{:<32} {:>10} {:>10}", "topic", "pending", "dead");
            for t in &topics {
                say!("{:<32} {:>10} {:>10}", t.topic, t.pending, t.dead);
            }
        }
        Some(_) => {}
        None => {
            say!();
            say!("per topic          with --exact (reads the whole backlog)");
        }
    }
    Ok(())
}

fn dead(
    outbox: &Outbox,
    client: &mut Client,
    filter: &Filter,
    limit: usize,
    as_json: bool,
) -> Result<()> {
    let letters = outbox.dead_letters(client, filter.clone().limit(limit))?;
    if as_json {
        let rows: Vec<Value> = letters
            .iter()
            .map(|d| {
                json!({
                    "key": d.record.key,
                    "topic": d.record.topic,
                    "aggregate_key": d.record.aggregate_key,
                    "attempts": d.record.attempt,
                    "last_error": d.last_error,
                    "dead_at": time(d.dead_at),
                })
            })
            .collect();
        say!("{}", Value::Array(rows));
        return Ok(());
    }
    if letters.is_empty() {
        say!(
            "no dead letters{}",
            if filter.is_empty() { "" } else { " match" }
        );
        return Ok(());
    }
    for d in &letters {
        say!(
            "{}  {}  {}  attempts={}  {}",
            time(d.dead_at),
            d.record.key,
            d.record.topic,
            d.record.attempt,
            d.last_error.as_deref().unwrap_or("-")
        );
    }
    Ok(())
}

fn dead_by_error(
    outbox: &Outbox,
    client: &mut Client,
    filter: &Filter,
    as_json: bool,
) -> Result<()> {
    let groups = outbox.dead_letter_errors(client, filter)?;
    if as_json {
        let rows: Vec<Value> = groups
            .iter()
            .map(|g| {
                json!({
                    "error": g.error,
                    "count": g.count,
                    "first_dead_at": time(g.first_dead_at),
                    "last_dead_at": time(g.last_dead_at),
                    "sample_key": g.sample_key,
                })
            })
            .collect();
        say!("{}", Value::Array(rows));
        return Ok(());
    }
    if groups.is_empty() {
        say!(
            "no dead letters{}",
            if filter.is_empty() { "" } else { " match" }
        );
        return Ok(());
    }
    say!(
        "{:>8}  {:<20}  {:<20}  {}  error",
        "count",
        "first dead",
        "last dead",
        "sample key"
    );
    for g in &groups {
        say!(
            "{:>8}  {}  {}  {}  {}",
            g.count,
            time(g.first_dead_at),
            time(g.last_dead_at),
            g.sample_key,
            g.error.as_deref().unwrap_or("-")
        );
    }
    Ok(())
}

/// Runs a relay until SIGINT or SIGTERM (or until it stops on its own, with an error), then
/// shuts it down within the drain timeout.
fn relay(
    outbox: Outbox,
    database: postgres::Config,
    tls: MakeTlsConnector,
    args: RelayArgs,
) -> Result<()> {
    let endpoints = Endpoints::parse(&args.amqp_url)?.shuffle(args.amqp_shuffle);
    let publishing = PublisherConfig::with_endpoints(endpoints, &args.exchange);
    // Fail fast on a wrong broker or exchange, before taking rows.
    publishing.connect()?.close();
    // Connections of the relay's own, with keepalives.
    let connections = Connections::open(database, tls);
    let mut config = RelayConfig::new(outbox.clone(), connections, move || publishing.connect())
        .drain_timeout(args.drain_timeout);
    if let Some(n) = args.batch_size {
        config = config.batch_size(n);
    }
    if let Some(n) = args.concurrency {
        config = config.concurrency(n);
    }
    if let Some(lease) = args.lease {
        config = config.lease(lease);
    }
    if let Some(poll) = args.poll_interval {
        config = config.poll_interval(poll);
    }
    if let Some(n) = args.max_attempts {
        config = config.retry(Retry::new(n));
    }
    let stop = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(signal, stop.clone())?;
    }
    let relay = Relay::spawn(config)?;
    log::info!(
        "relay for {} running; SIGINT or SIGTERM stops it",
        outbox.table()
    );
    while !stop.load(Ordering::SeqCst) && !relay.has_stopped() {
        std::thread::sleep(Duration::from_millis(100));
    }
    let on_its_own = !stop.load(Ordering::SeqCst);
    log::info!("relay for {} stopping", outbox.table());
    let report = relay.shutdown(args.drain_timeout)?;
    if on_its_own {
        return Err("the relay stopped on its own: its table is gone".into());
    }
    log::info!(
        "relay stopped: {} published, {} released, {} abandoned",
        report.published,
        report.released,
        report.abandoned
    );
    if report.abandoned > 0 {
        return Err(format!(
            "{} claimed rows were still being published at the drain timeout; they will be \
             published again when their leases run out",
            report.abandoned
        )
        .into());
    }
    Ok(())
}
