//! A PostgreSQL server of the test's own, for faults no test may inflict on the shared one:
//! stopping it, making it read-only. Made with the machine's PostgreSQL binaries in a
//! directory under the system's temporary one (about a second), on a free port of
//! 127.0.0.1, trust auth, no fsync; stopped and deleted when dropped.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicU32, Ordering};

use postgres::{Client, NoTls};

use super::{as_root, free_port};

pub struct PgNode {
    dir: PathBuf,
    port: u16,
}

impl PgNode {
    /// Initialises and starts a server; panics with what to do if it cannot.
    pub fn start() -> PgNode {
        let node = PgNode::empty();
        node.pg(
            "initdb",
            &[
                "-D",
                &node.data(),
                "-A",
                "trust",
                "-U",
                "postgres",
                "--no-sync",
                "-N",
            ],
        );
        node.start_again();
        node
    }

    /// A directory and a port for a server, nothing in them yet.
    fn empty() -> PgNode {
        static N: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "outbox-pg-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::SeqCst)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create the node's directory");
        if as_root() {
            // initdb refuses to run as root; the server's files belong to `postgres`.
            run(Command::new("chown").arg("postgres").arg(&dir));
        }
        PgNode {
            dir,
            port: free_port(),
        }
    }

    /// A hot standby of `primary`, streaming from it, started.
    pub fn standby_of(primary: &PgNode) -> PgNode {
        let node = PgNode::empty();
        node.pg(
            "pg_basebackup",
            &[
                "-D",
                &node.data(),
                "-h",
                "127.0.0.1",
                "-p",
                &primary.port.to_string(),
                "-U",
                "postgres",
                "-R",
                "-X",
                "stream",
                "--no-sync",
            ],
        );
        node.start_again();
        node
    }

    /// Starts the server after `stop`, and waits until it takes connections.
    pub fn start_again(&self) {
        let options = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=60",
            self.port,
            self.dir.display()
        );
        let log = self.dir.join("log");
        self.pg(
            "pg_ctl",
            &[
                "-D",
                &self.data(),
                "-o",
                &options,
                "-l",
                &log.display().to_string(),
                "-w",
                "-t",
                "60",
                "start",
            ],
        );
    }

    /// Lets the server hold prepared transactions (two), which takes a restart.
    pub fn allow_prepared_transactions(&self) {
        self.client()
            .batch_execute("ALTER SYSTEM SET max_prepared_transactions = 2")
            .expect("allow prepared transactions");
        self.stop();
        self.start_again();
    }

    /// Stops the server at once, as a crash would (`-m immediate`): connections are cut and
    /// it recovers from its WAL when started again.
    pub fn stop(&self) {
        self.pg(
            "pg_ctl",
            &["-D", &self.data(), "-m", "immediate", "-w", "stop"],
        );
    }

    /// `host:port` of the server.
    pub fn address(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// A URL to the server's `postgres` database.
    pub fn url(&self) -> String {
        format!("postgres://postgres@{}/postgres", self.address())
    }

    pub fn client(&self) -> Client {
        Client::connect(&self.url(), NoTls).expect("connect to the test's own PostgreSQL")
    }

    /// Makes every session read-only (`default_transaction_read_only`, as a switchover
    /// fences the old primary), or writable again; running sessions see it at their next
    /// transaction.
    pub fn read_only(&self, on: bool) {
        let value = if on { "on" } else { "off" };
        let mut client = self.client();
        client
            .batch_execute(&format!(
                "ALTER SYSTEM SET default_transaction_read_only = {value}"
            ))
            .expect("set default_transaction_read_only");
        client
            .batch_execute("SELECT pg_reload_conf()")
            .expect("reload the configuration");
    }

    fn data(&self) -> String {
        self.dir.join("data").display().to_string()
    }

    /// Runs one of the server's programs, as `postgres` when the test runs as root.
    fn pg(&self, program: &str, args: &[&str]) -> Output {
        let path = bin_dir().join(program);
        let mut command = if as_root() {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(path);
            c
        } else {
            Command::new(path)
        };
        command.args(args);
        run(&mut command)
    }
}

impl Drop for PgNode {
    fn drop(&mut self) {
        let _ = Command::new("sh")
            .arg("-c")
            .arg(if as_root() {
                format!(
                    "runuser -u postgres -- {} -D {} -m immediate -w stop",
                    bin_dir().join("pg_ctl").display(),
                    self.data()
                )
            } else {
                format!(
                    "{} -D {} -m immediate -w stop",
                    bin_dir().join("pg_ctl").display(),
                    self.data()
                )
            })
            .output();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn run(command: &mut Command) -> Output {
    let output = command
        .output()
        .unwrap_or_else(|e| panic!("cannot run {command:?}: {e}"));
    assert!(
        output.status.success(),
        "{command:?} failed: {}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

/// The newest PostgreSQL's binaries: Debian keeps them in `/usr/lib/postgresql/<major>/bin`.
fn bin_dir() -> PathBuf {
    let base = Path::new("/usr/lib/postgresql");
    let newest = std::fs::read_dir(base)
        .ok()
        .into_iter()
        .flatten()
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .max()
        .unwrap_or_else(|| {
            panic!(
                "no PostgreSQL server binaries under {}: install the postgresql package (.ci/run \
                 does)",
                base.display()
            )
        });
    base.join(newest.to_string()).join("bin")
}

/// A server process stopped with `SIGSTOP`: it answers nothing, its sockets open, as a
/// stalled backend or a hung pooler looks from the client. Continued when dropped.
pub struct Stopped(i32);

impl Stopped {
    pub fn stop(pid: i32) -> Stopped {
        signal("STOP", pid);
        Stopped(pid)
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        signal("CONT", self.0);
    }
}

fn signal(name: &str, pid: i32) {
    let status = Command::new("kill")
        .arg(format!("-{name}"))
        .arg(pid.to_string())
        .status()
        .expect("run kill");
    assert!(status.success(), "kill -{name} {pid}");
}
