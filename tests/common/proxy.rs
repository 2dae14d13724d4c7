//! A TCP proxy in front of the broker: a second (third, ...) endpoint of the same broker,
//! so failover between endpoints can be watched on one machine: which endpoint a client
//! connected through, and the broker-side connections that came through it, to close.

use std::io;
use std::net::{Shutdown, TcpListener, TcpStream};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;

use super::amqp_url;

pub struct Proxy {
    port: u16,
    accepted: Arc<AtomicUsize>,
    /// The local ports of the proxy's connections to the broker: the broker's peer ports.
    upstream_ports: Arc<Mutex<Vec<u16>>>,
}

impl Proxy {
    /// A proxy to the test broker, listening on a port of its own on 127.0.0.1.
    pub fn to_broker() -> Proxy {
        let target = broker_address(&amqp_url());
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind a proxy port");
        let port = listener.local_addr().expect("proxy address").port();
        let accepted = Arc::new(AtomicUsize::new(0));
        let upstream_ports = Arc::new(Mutex::new(Vec::new()));
        let (count, ports) = (accepted.clone(), upstream_ports.clone());
        thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { continue };
                let Ok(upstream) = TcpStream::connect(&target) else {
                    let _ = client.shutdown(Shutdown::Both);
                    continue;
                };
                count.fetch_add(1, Ordering::SeqCst);
                if let Ok(local) = upstream.local_addr() {
                    ports.lock().unwrap().push(local.port());
                }
                let _ = client.set_nodelay(true);
                let _ = upstream.set_nodelay(true);
                pipe(&client, &upstream);
                pipe(&upstream, &client);
            }
        });
        Proxy {
            port,
            accepted,
            upstream_ports,
        }
    }

    /// The test broker's URL, through this proxy.
    pub fn url(&self) -> String {
        let url = amqp_url();
        let target = broker_address(&url);
        url.replacen(&target, &format!("127.0.0.1:{}", self.port), 1)
    }

    /// Connections made through this proxy so far.
    pub fn accepted(&self) -> usize {
        self.accepted.load(Ordering::SeqCst)
    }

    /// Has the broker close every connection that came through this proxy
    /// (`rabbitmqctl close_connection`), as an operator or a node going down would; returns
    /// how many it closed.
    pub fn close_at_broker(&self, reason: &str) -> usize {
        let ports = self.upstream_ports.lock().unwrap().clone();
        let listed = Command::new("rabbitmqctl")
            .args([
                "-q",
                "list_connections",
                "--no-table-headers",
                "pid",
                "peer_port",
            ])
            .output()
            .expect("run rabbitmqctl list_connections");
        assert!(
            listed.status.success(),
            "rabbitmqctl list_connections failed"
        );
        let mut closed = 0;
        for line in String::from_utf8_lossy(&listed.stdout).lines() {
            let Some((pid, peer_port)) = line.rsplit_once('\t') else {
                continue;
            };
            let through_here = peer_port
                .trim()
                .parse::<u16>()
                .is_ok_and(|p| ports.contains(&p));
            if through_here {
                super::broker::rabbitmqctl(&["close_connection", pid.trim(), reason]);
                closed += 1;
            }
        }
        closed
    }
}

/// Copies from one socket to the other until either end closes, then closes both.
fn pipe(from: &TcpStream, to: &TcpStream) {
    let (Ok(mut from), Ok(mut to)) = (from.try_clone(), to.try_clone()) else {
        return;
    };
    thread::spawn(move || {
        let _: io::Result<u64> = io::copy(&mut from, &mut to);
        let _ = from.shutdown(Shutdown::Both);
        let _ = to.shutdown(Shutdown::Both);
    });
}

/// `host:port` of an AMQP URL.
pub fn broker_address(url: &str) -> String {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let rest = rest.rsplit_once('@').map_or(rest, |(_, host)| host);
    let host_port = rest.split(['/', '?']).next().unwrap_or(rest);
    if host_port.contains(':') {
        host_port.to_owned()
    } else {
        format!("{host_port}:5672")
    }
}
