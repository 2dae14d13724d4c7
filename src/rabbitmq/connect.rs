//! Opening amiquip connections the way a relay needs them: TCP_NODELAY, a short heartbeat,
//! TLS for `amqps://`, failing over between a cluster's endpoints, and a close that cannot
//! hang.

use std::collections::HashMap;
use std::fmt;
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;

use amiquip::{Auth, Channel, Connection, ConnectionOptions, ConnectionTuning};
use rand::seq::SliceRandom;

use super::error::Error;
use crate::runtime::lifecycle;

/// The brokers to connect to: one URL, or several (the nodes of a cluster, say), tried in
/// turn until one answers.
///
/// In order (the default), a connection attempt starts at the endpoint that answered last;
/// once a connection to it is lost, the next attempt starts at the one after it, so a
/// relay or consumer whose node goes down moves on to the next node (with its usual
/// reconnect backoff) rather than knocking on the dead one first. Every `Endpoints` made
/// from the same list in a process shares that place, so the relay's publishers, which are
/// built anew after a loss, follow it too. [`shuffle`](Endpoints::shuffle) tries them in a
/// random order instead, spreading many processes over the nodes.
///
/// `Display` and every log line and error name an endpoint as `amqp://user@host:port/vhost`,
/// never with its password.
///
/// ```
/// use postgres_outbox::rabbitmq::Endpoints;
/// let nodes = Endpoints::parse("amqp://app:secret@rabbit-1,amqp://app:secret@rabbit-2")?;
/// assert_eq!(nodes.to_string(), "amqp://app@rabbit-1:5672/,amqp://app@rabbit-2:5672/");
/// let spread = Endpoints::new(["amqp://rabbit-1", "amqp://rabbit-2"])?.shuffle(true);
/// # let _ = spread;
/// # Ok::<(), postgres_outbox::rabbitmq::Error>(())
/// ```
#[derive(Clone)]
pub struct Endpoints {
    list: Arc<[Endpoint]>,
    shuffle: bool,
    /// Where the next attempt starts, in order.
    next: Arc<AtomicUsize>,
}

impl Endpoints {
    /// Parses one URL, or several separated by commas (a comma inside a password must be
    /// percent-encoded, `%2C`). Each is `amqp://` or `amqps://` with the query parameters
    /// `heartbeat` (seconds) and `connection_timeout` (milliseconds, default 10,000: how long
    /// an endpoint that does not answer holds up trying the next).
    pub fn parse(urls: &str) -> Result<Endpoints, Error> {
        Endpoints::new(urls.split(','))
    }

    /// The endpoints from a list of URLs, each as [`parse`](Endpoints::parse) takes one.
    pub fn new<I, S>(urls: I) -> Result<Endpoints, Error>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let list = urls
            .into_iter()
            .map(|url| Endpoint::parse(url.as_ref().trim()))
            .collect::<Result<Vec<_>, _>>()?;
        if list.is_empty() {
            return Err(Error::InvalidUrl("no URL given".to_owned()));
        }
        let next = cursor(&list);
        Ok(Endpoints {
            list: list.into(),
            shuffle: false,
            next,
        })
    }

    /// Try the endpoints in a random order on every connection attempt (default off: in
    /// order, starting where the last connection was made).
    pub fn shuffle(mut self, shuffle: bool) -> Endpoints {
        self.shuffle = shuffle;
        self
    }

    /// The heartbeat of every connection (default 5 s; a dead broker is noticed after two
    /// missed heartbeats), overriding the URLs' `heartbeat`.
    pub fn heartbeat(mut self, heartbeat: Duration) -> Endpoints {
        let mut list = self.list.to_vec();
        for endpoint in &mut list {
            endpoint.set_heartbeat(heartbeat);
        }
        self.list = list.into();
        self
    }

    /// How many endpoints there are.
    pub fn len(&self) -> usize {
        self.list.len()
    }

    /// Always false: there is at least one endpoint.
    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    pub(crate) fn get(&self, index: usize) -> &Endpoint {
        &self.list[index % self.list.len()]
    }

    /// Opens a connection to the first endpoint that answers, and says which it was.
    pub(crate) fn open(&self) -> Result<(Connection, usize), Error> {
        self.open_cuttable()
            .map(|(connection, at, _socket)| (connection, at))
    }

    /// As [`open`](Endpoints::open), with the connection's socket, to cut it (see
    /// [`Cutter`](super::deadline::Cutter)).
    pub(crate) fn open_cuttable(&self) -> Result<(Connection, usize, TcpStream), Error> {
        let n = self.list.len();
        let order: Vec<usize> = if self.shuffle {
            let mut order: Vec<usize> = (0..n).collect();
            order.shuffle(&mut rand::thread_rng());
            order
        } else {
            let start = self.next.load(Ordering::SeqCst) % n;
            (0..n).map(|k| (start + k) % n).collect()
        };
        let mut failures = Vec::new();
        for index in order {
            match self.list[index].open() {
                Ok((connection, socket)) => {
                    self.next.store(index, Ordering::SeqCst);
                    return Ok((connection, index, socket));
                }
                Err(e) if n > 1 => {
                    log::warn!("{e}; trying the next endpoint");
                    failures.push(match e {
                        Error::Connect {
                            what,
                            source: Some(source),
                        } => format!("{what}: {source}"),
                        Error::Connect { what, source: None } => what,
                        other => other.to_string(),
                    });
                }
                Err(e) => return Err(e),
            }
        }
        Err(Error::Connect {
            what: format!("no endpoint answered ({})", failures.join("; ")),
            source: None,
        })
    }

    /// The connection to endpoint `index` was lost: the next attempt starts past it.
    pub(crate) fn lost(&self, index: usize) {
        let n = self.list.len();
        // Several connections to it may report the loss; only the first moves on.
        let _ = self.next.compare_exchange(
            index % n,
            (index + 1) % n,
            Ordering::SeqCst,
            Ordering::SeqCst,
        );
    }
}

impl fmt::Display for Endpoints {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, endpoint) in self.list.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            fmt::Display::fmt(endpoint, f)?;
        }
        Ok(())
    }
}

impl fmt::Debug for Endpoints {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Endpoints")
            .field("list", &self.to_string())
            .field("shuffle", &self.shuffle)
            .finish()
    }
}

/// The place in `list` where the next attempt starts, shared by every `Endpoints` of the
/// same list in this process (a single endpoint needs none).
fn cursor(list: &[Endpoint]) -> Arc<AtomicUsize> {
    static CURSORS: OnceLock<Mutex<HashMap<String, Arc<AtomicUsize>>>> = OnceLock::new();
    if list.len() < 2 {
        return Arc::default();
    }
    let key = list
        .iter()
        .map(|e| format!("{e}?tls={}", e.tls))
        .collect::<Vec<_>>()
        .join(",");
    let mut cursors = CURSORS
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    cursors.entry(key).or_default().clone()
}

/// Where and how to connect, parsed from an `amqp://` or `amqps://` URL.
#[derive(Clone)]
pub(crate) struct Endpoint {
    tls: bool,
    /// Certificates to trust besides the system's, from the URL's `cacertfile` (PEM).
    roots: Vec<native_tls::Certificate>,
    host: String,
    port: u16,
    user: String,
    password: String,
    vhost: String,
    heartbeat: u16,
    timeout: Duration,
}

/// Shows the endpoint without its password, so it is safe to log.
impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let scheme = if self.tls { "amqps" } else { "amqp" };
        let vhost = if self.vhost == "/" { "" } else { &self.vhost };
        write!(
            f,
            "{scheme}://{}@{}:{}/{vhost}",
            self.user, self.host, self.port
        )
    }
}

impl fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// Heartbeat default: a dead broker or a black-holed socket is noticed within two of these.
const DEFAULT_HEARTBEAT: u16 = 5;
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

impl Endpoint {
    /// Parses the URL. Supports the query parameters `heartbeat` (seconds),
    /// `connection_timeout` (milliseconds) and, for `amqps`, `cacertfile` (a PEM file of
    /// certificates to trust besides the system's, read here); anything else is an error, not
    /// silently ignored.
    pub(crate) fn parse(url: &str) -> Result<Endpoint, Error> {
        // The URL may hold a password: never echo it in an error.
        let invalid = |why: &str| Error::InvalidUrl(why.to_owned());
        let parsed = url::Url::parse(url).map_err(|e| invalid(&format!("not a URL ({e})")))?;
        let tls = match parsed.scheme() {
            "amqp" => false,
            "amqps" => true,
            other => return Err(invalid(&format!("scheme {other:?} is not amqp or amqps"))),
        };
        let host = match parsed.host_str() {
            Some(h) if !h.is_empty() => h.trim_start_matches('[').trim_end_matches(']').to_owned(),
            _ => "localhost".to_owned(),
        };
        let decode = |s: &str| {
            percent_encoding_decode(s).ok_or_else(|| invalid("user or password is not valid UTF-8"))
        };
        let user = match parsed.username() {
            "" => "guest".to_owned(),
            u => decode(u)?,
        };
        let password = match parsed.password() {
            Some(p) => decode(p)?,
            None => "guest".to_owned(),
        };
        let path = parsed.path().trim_start_matches('/');
        if path.contains('/') {
            return Err(invalid("the path must be a single vhost segment"));
        }
        let vhost = if path.is_empty() {
            "/".to_owned()
        } else {
            decode(path)?
        };
        let mut endpoint = Endpoint {
            tls,
            roots: Vec::new(),
            port: parsed.port().unwrap_or(if tls { 5671 } else { 5672 }),
            host,
            user,
            password,
            vhost,
            heartbeat: DEFAULT_HEARTBEAT,
            timeout: DEFAULT_TIMEOUT,
        };
        for (key, value) in parsed.query_pairs() {
            match key.as_ref() {
                "heartbeat" => {
                    endpoint.heartbeat = value
                        .parse()
                        .map_err(|_| invalid("heartbeat must be whole seconds (0 to 65535)"))?;
                }
                "connection_timeout" => {
                    let ms: u64 = value
                        .parse()
                        .map_err(|_| invalid("connection_timeout must be milliseconds"))?;
                    endpoint.timeout = Duration::from_millis(ms);
                }
                "cacertfile" if tls => {
                    endpoint.roots = read_roots(&value)?;
                }
                other => return Err(invalid(&format!("unsupported query parameter {other:?}"))),
            }
        }
        Ok(endpoint)
    }

    pub(crate) fn set_heartbeat(&mut self, heartbeat: Duration) {
        self.heartbeat = u16::try_from(heartbeat.as_secs()).unwrap_or(u16::MAX);
    }

    /// Opens a connection. The socket is opened here rather than by amiquip so that Nagle's
    /// algorithm can be turned off: with it on, each confirm waits for a delayed ACK
    /// (measured: 31 vs 2,342 confirmed messages per second); and so that a handle on it is
    /// kept, returned beside the connection, to cut it (see `deadline.rs`).
    fn open(&self) -> Result<(Connection, TcpStream), Error> {
        let addrs = (self.host.as_str(), self.port)
            .to_socket_addrs()
            .map_err(|e| Error::connect(format!("cannot resolve {self}"), e))?;
        let mut last = Error::Connect {
            what: format!("{self} resolved to no address"),
            source: None,
        };
        for addr in addrs {
            let socket = match TcpStream::connect_timeout(&addr, self.timeout) {
                Ok(socket) => socket,
                Err(e) => {
                    last = Error::connect(format!("cannot connect to {self} ({addr})"), e);
                    continue;
                }
            };
            socket
                .set_nodelay(true)
                .map_err(|e| Error::connect("cannot set TCP_NODELAY", e))?;
            let handle = socket
                .try_clone()
                .map_err(|e| Error::connect("cannot keep a handle on the socket", e))?;
            let stream = mio::net::TcpStream::from_stream(socket)
                .map_err(|e| Error::connect("cannot register the socket", e))?;
            let options = ConnectionOptions::default()
                .auth(Auth::Plain {
                    username: self.user.clone(),
                    password: self.password.clone(),
                })
                .virtual_host(self.vhost.clone())
                .heartbeat(self.heartbeat)
                .connection_timeout(Some(self.timeout));
            let tuning = ConnectionTuning::default();
            let opened = if self.tls {
                let mut builder = native_tls::TlsConnector::builder();
                for root in &self.roots {
                    builder.add_root_certificate(root.clone());
                }
                let connector = builder
                    .build()
                    .map_err(|e| Error::connect("cannot set up TLS", e))?;
                Connection::open_tls_stream(connector, &self.host, stream, options, tuning)
            } else {
                Connection::insecure_open_stream(stream, options, tuning)
            };
            return opened
                .map(|connection| (connection, handle))
                .map_err(|e| Error::connect(format!("AMQP handshake with {self} failed"), e));
        }
        Err(last)
    }
}

/// The certificates of a PEM file (one or several).
fn read_roots(path: &str) -> Result<Vec<native_tls::Certificate>, Error> {
    let invalid = |why: String| Error::InvalidUrl(format!("cacertfile {path:?}: {why}"));
    let pem = std::fs::read(path).map_err(|e| invalid(e.to_string()))?;
    let text = String::from_utf8_lossy(&pem);
    const END: &str = "-----END CERTIFICATE-----";
    let roots = text
        .split_inclusive(END)
        .filter(|block| block.contains("-----BEGIN CERTIFICATE-----"))
        .map(|block| native_tls::Certificate::from_pem(block.trim_start().as_bytes()))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| invalid(e.to_string()))?;
    if roots.is_empty() {
        return Err(invalid("no PEM certificate in it".to_owned()));
    }
    Ok(roots)
}

fn percent_encoding_decode(s: &str) -> Option<String> {
    percent_encoding::percent_decode_str(s)
        .decode_utf8()
        .ok()
        .map(|s| s.into_owned())
}

/// Closes a connection (and first `channel`, one of its channels), waiting at most `bound`:
/// amiquip's close joins its I/O thread, which can hang on a dead peer, and closing a channel
/// waits for the broker's answer, which a broker that blocks the connection (a resource
/// alarm) does not send. Past the bound the close finishes on its own thread.
pub(crate) fn close_within(connection: Connection, channel: Option<Channel>, bound: Duration) {
    let (done_tx, done_rx) = mpsc::channel();
    let spawned = lifecycle::spawn("amqp-close", move || {
        drop(channel);
        let _ = connection.close();
        let _ = done_tx.send(());
    });
    if spawned.is_ok() {
        let _ = done_rx.recv_timeout(bound);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_urls_and_hides_the_password() {
        let e = Endpoint::parse("amqp://app:s%40cret@broker:5673/orders?heartbeat=3").unwrap();
        assert_eq!(e.password, "s@cret");
        assert_eq!(e.vhost, "orders");
        assert_eq!(e.heartbeat, 3);
        assert_eq!(e.to_string(), "amqp://app@broker:5673/orders");
        let d = Endpoint::parse("amqps://h").unwrap();
        assert!(d.tls && d.port == 5671 && d.vhost == "/" && d.user == "guest");
        assert_eq!(Endpoint::parse("amqp://h/%2f").unwrap().vhost, "/");
    }

    #[test]
    fn parses_lists_and_hides_every_password() {
        let e = Endpoints::parse("amqp://a:pw1@h1, amqps://b:pw2@h2:5000/v").unwrap();
        assert_eq!(e.len(), 2);
        assert_eq!(e.to_string(), "amqp://a@h1:5672/,amqps://b@h2:5000/v");
        assert!(!format!("{e:?}").contains("pw"));
        let list = Endpoints::new(["amqp://h1", "amqp://h2"]).unwrap();
        assert_eq!(
            list.to_string(),
            "amqp://guest@h1:5672/,amqp://guest@h2:5672/"
        );
        for bad in ["", "amqp://u:pw@h1,", "amqp://u:pw@h1,http://u:pw@h2"] {
            let err = Endpoints::parse(bad).unwrap_err().to_string();
            assert!(!err.contains("pw"), "{err}");
        }
    }

    #[test]
    fn a_lost_endpoint_moves_the_next_attempt_past_it_once() {
        let urls = "amqp://cursor-test-1,amqp://cursor-test-2,amqp://cursor-test-3";
        let (a, b) = (
            Endpoints::parse(urls).unwrap(),
            Endpoints::parse(urls).unwrap(),
        );
        assert_eq!(a.next.load(Ordering::SeqCst), 0);
        a.lost(0);
        b.lost(0); // a second report of the same loss
        assert_eq!(b.next.load(Ordering::SeqCst), 1, "shared, and moved once");
        a.lost(2); // not where attempts start: nothing moves
        assert_eq!(a.next.load(Ordering::SeqCst), 1);
        b.lost(1);
        b.lost(2);
        assert_eq!(a.next.load(Ordering::SeqCst), 0, "wraps around");
    }

    #[test]
    fn cacertfile_is_read_at_parse_time() {
        let missing = Endpoint::parse("amqps://u:pw@h?cacertfile=/nonexistent/ca.pem")
            .unwrap_err()
            .to_string();
        assert!(
            missing.contains("/nonexistent/ca.pem") && !missing.contains("pw"),
            "{missing}"
        );
        let not_pem = std::env::temp_dir().join(format!("not-a-ca-{}.pem", std::process::id()));
        std::fs::write(&not_pem, "hello").unwrap();
        let url = format!("amqps://h?cacertfile={}", not_pem.display());
        let error = Endpoint::parse(&url).unwrap_err().to_string();
        std::fs::remove_file(&not_pem).unwrap();
        assert!(error.contains("no PEM certificate"), "{error}");
        // Plain AMQP has no use for it.
        assert!(Endpoint::parse("amqp://h?cacertfile=/x").is_err());
    }

    #[test]
    fn rejects_bad_urls_without_echoing_them() {
        for bad in [
            "http://u:pw@h",
            "amqp://u:pw@h/a/b",
            "amqp://u:pw@h?frame=1",
            "nonsense",
        ] {
            let err = Endpoint::parse(bad).unwrap_err().to_string();
            assert!(!err.contains("pw"), "{err}");
        }
    }
}
