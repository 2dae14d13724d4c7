//! A RabbitMQ node of the test's own, for settings no test may give the shared broker (a
//! small `max_message_size`, say): node `outbox-t<pid>-<n>@localhost` on free ports of
//! 127.0.0.1, its files under the system's temporary directory, run as user `rabbitmq` when
//! the test runs as root (as `.ci/rabbitmq-cluster` does). Starting takes 5-10 s. Stopped
//! and deleted when dropped.

use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use super::{as_root, free_port};

pub struct RabbitNode {
    name: String,
    dir: PathBuf,
    port: u16,
}

impl RabbitNode {
    /// Starts a node whose `rabbitmq.conf` also holds `config` (lines of `key = value`).
    pub fn start(config: &[&str]) -> RabbitNode {
        static N: AtomicU32 = AtomicU32::new(0);
        let n = N.fetch_add(1, Ordering::SeqCst);
        let name = format!("outbox-t{}-{n}@localhost", std::process::id());
        let dir = std::env::temp_dir().join(format!("outbox-rabbit-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for sub in ["log", "mnesia"] {
            std::fs::create_dir_all(dir.join(sub)).expect("create the node's directories");
        }
        let port = free_port();
        let mut conf = format!("listeners.tcp.local = 127.0.0.1:{port}\nloopback_users = none\n");
        for line in config {
            conf.push_str(line);
            conf.push('\n');
        }
        std::fs::write(dir.join("rabbitmq.conf"), conf).expect("write rabbitmq.conf");
        // No plugins: no management listener to collide with the shared node's.
        std::fs::write(dir.join("enabled_plugins"), "[].").expect("write enabled_plugins");
        if as_root() {
            let status = Command::new("chown")
                .args(["-R", "rabbitmq:rabbitmq"])
                .arg(&dir)
                .status()
                .expect("run chown");
            assert!(status.success(), "chown the node's directory to rabbitmq");
        }
        let node = RabbitNode { name, dir, port };
        let env = [
            ("RABBITMQ_NODENAME", node.name.clone()),
            ("RABBITMQ_NODE_PORT", port.to_string()),
            ("RABBITMQ_DIST_PORT", free_port().to_string()),
            ("RABBITMQ_CONFIG_FILE", node.path("rabbitmq")),
            (
                "RABBITMQ_ENABLED_PLUGINS_FILE",
                node.path("enabled_plugins"),
            ),
            ("RABBITMQ_MNESIA_BASE", node.path("mnesia")),
            ("RABBITMQ_LOG_BASE", node.path("log")),
            ("RABBITMQ_PID_FILE", node.path("pid")),
        ];
        let mut start = node.as_rabbitmq("/usr/lib/rabbitmq/bin/rabbitmq-server");
        start.arg("-detached");
        for (key, value) in env {
            start.env(key, value);
        }
        let status = start.status().expect("run rabbitmq-server");
        assert!(
            status.success(),
            "rabbitmq-server -detached for {}",
            node.name
        );
        let deadline = Instant::now() + Duration::from_secs(120);
        while !node.ctl(&["-q", "await_startup", "--timeout", "10"]) {
            assert!(
                Instant::now() < deadline,
                "{} did not start; see {}",
                node.name,
                node.dir.join("log").display()
            );
            std::thread::sleep(Duration::from_millis(500));
        }
        node
    }

    /// The node's AMQP URL.
    pub fn url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}", self.port)
    }

    fn path(&self, name: &str) -> String {
        self.dir.join(name).display().to_string()
    }

    fn as_rabbitmq(&self, program: &str) -> Command {
        let mut command = if as_root() {
            let mut c = Command::new("runuser");
            c.args(["-u", "rabbitmq", "--"]).arg(program);
            c
        } else {
            Command::new(program)
        };
        command.env("HOME", "/var/lib/rabbitmq");
        command
    }

    /// Raises a memory alarm (`on`) or clears it, and waits until the node says so.
    pub fn memory_alarm(&self, on: bool) {
        let watermark = if on { "0" } else { "0.4" };
        assert!(
            self.ctl(&["set_vm_memory_high_watermark", watermark]),
            "set the watermark of {}",
            self.name
        );
        super::wait_until("the memory alarm is as asked", || {
            self.output(&["eval", "rabbit_alarm:get_alarms()."])
                .contains("memory")
                == on
        });
    }

    /// How many of the node's connections it blocks (does not read) now.
    pub fn blocked_connections(&self) -> usize {
        self.output(&["-q", "list_connections", "state"])
            .lines()
            .filter(|line| line.trim() == "blocked")
            .count()
    }

    /// What `rabbitmqctl -n <node> args` printed; empty if it failed.
    fn output(&self, args: &[&str]) -> String {
        self.as_rabbitmq("/usr/lib/rabbitmq/bin/rabbitmqctl")
            .arg("-n")
            .arg(&self.name)
            .args(args)
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default()
    }

    /// Runs `rabbitmqctl -n <node> args`; true if it succeeded.
    fn ctl(&self, args: &[&str]) -> bool {
        self.as_rabbitmq("/usr/lib/rabbitmq/bin/rabbitmqctl")
            .arg("-n")
            .arg(&self.name)
            .args(args)
            .output()
            .is_ok_and(|o| o.status.success())
    }
}

impl Drop for RabbitNode {
    fn drop(&mut self) {
        self.ctl(&["-q", "stop"]);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
