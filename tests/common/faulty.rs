//! A TCP proxy that misbehaves on demand, in front of any server: it stalls with its sockets
//! open (a hung pooler), forwards requests but drops the replies (a lost answer), or refuses
//! connections (a server that is down), or passes replies slowly through a buffer (a slow
//! link), and counts the connections made through it.

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread;
use std::time::Duration;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Forwards both ways.
    Pass,
    /// Forwards nothing either way, the sockets left open: whatever is sent waits.
    Stall,
    /// Forwards what clients send; what the server answers is read and thrown away.
    DropReplies,
    /// Passes until a client of the PostgreSQL protocol runs a statement whose text holds
    /// this (prepared then or before, on the same connection); from then on, as
    /// `DropReplies`. So the reply lost is that statement's, whatever else the client sent
    /// before it, or had sent before the mode was set.
    DropRepliesFrom(&'static str),
    /// Forwards what servers answer; what clients send is read and thrown away.
    DropRequests,
    /// Passes until a client sends these bytes (a frame of a protocol the proxy does not
    /// read, say an AMQP method's class and method ids); from then on, as `DropRequests`,
    /// starting with what held them.
    DropRequestsFrom(&'static [u8]),
    /// Closes every connection it holds, and every new one as soon as it is accepted.
    Refuse,
    /// Forwards both ways, the replies at this many bytes a second, buffered: the server's
    /// writes finish at once, as through a pooler on a slow link.
    Throttle(usize),
}

pub struct Faulty {
    port: u16,
    state: Arc<State>,
}

struct State {
    mode: Mutex<Mode>,
    changed: Condvar,
    /// Connections accepted, refused ones included.
    accepted: AtomicUsize,
    /// Both ends of every connection, to cut them when refusing.
    open: Mutex<Vec<TcpStream>>,
    /// The client's end of every connection.
    clients: Mutex<Vec<TcpStream>>,
}

impl Faulty {
    /// A proxy to `target` (`host:port`) on a port of its own on 127.0.0.1, passing.
    pub fn to(target: &str) -> Faulty {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind a proxy port");
        let port = listener.local_addr().expect("proxy address").port();
        let state = Arc::new(State {
            mode: Mutex::new(Mode::Pass),
            changed: Condvar::new(),
            accepted: AtomicUsize::new(0),
            open: Mutex::new(Vec::new()),
            clients: Mutex::new(Vec::new()),
        });
        let (target, shared) = (target.to_owned(), state.clone());
        thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { continue };
                shared.accepted.fetch_add(1, Ordering::SeqCst);
                if shared.mode() == Mode::Refuse {
                    let _ = client.shutdown(Shutdown::Both);
                    continue;
                }
                let Ok(server) = TcpStream::connect(&target) else {
                    let _ = client.shutdown(Shutdown::Both);
                    continue;
                };
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                if let (Ok(c), Ok(s)) = (client.try_clone(), server.try_clone()) {
                    shared.open.lock().unwrap().extend([c, s]);
                }
                if let Ok(c) = client.try_clone() {
                    shared.clients.lock().unwrap().push(c);
                }
                pipe(&shared, &client, &server, false);
                pipe(&shared, &server, &client, true);
            }
        });
        Faulty { port, state }
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// `127.0.0.1:<port>` of the proxy.
    pub fn address(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Connections accepted so far, refused ones included.
    pub fn accepted(&self) -> usize {
        self.state.accepted.load(Ordering::SeqCst)
    }

    pub fn set(&self, mode: Mode) {
        self.state.set(mode);
    }

    /// Closes the client's end of every connection, stalling first, so the server's end
    /// stays open: the client sees its connection lost while the server still holds it,
    /// until the proxy passes (or refuses) again.
    pub fn cut_clients(&self) {
        self.set(Mode::Stall);
        for stream in self.state.clients.lock().unwrap().drain(..) {
            let _ = stream.shutdown(Shutdown::Both);
        }
    }

    /// Whether replies are being dropped (set so, or since `DropRepliesFrom` found its
    /// statement).
    pub fn dropping(&self) -> bool {
        self.state.mode() == Mode::DropReplies
    }

    /// Whether requests are being dropped (set so, or since `DropRequestsFrom` found its
    /// bytes).
    pub fn dropping_requests(&self) -> bool {
        self.state.mode() == Mode::DropRequests
    }
}

impl Drop for Faulty {
    fn drop(&mut self) {
        self.set(Mode::Refuse);
    }
}

impl State {
    fn set(&self, mode: Mode) {
        *self.mode.lock().unwrap() = mode;
        if mode == Mode::Refuse {
            for stream in self.open.lock().unwrap().drain(..) {
                let _ = stream.shutdown(Shutdown::Both);
            }
        }
        self.changed.notify_all();
    }

    fn mode(&self) -> Mode {
        *self.mode.lock().unwrap()
    }

    /// The mode once it is no longer `Stall`.
    fn unstalled(&self) -> Mode {
        let mut mode = self.mode.lock().unwrap();
        while *mode == Mode::Stall {
            mode = self.changed.wait(mode).unwrap();
        }
        *mode
    }
}

/// Copies from one socket to the other as the mode says, until either end closes; then
/// closes both. `reply` is the server-to-client direction.
fn pipe(state: &Arc<State>, from: &TcpStream, to: &TcpStream, reply: bool) {
    let (Ok(mut from), Ok(mut to)) = (from.try_clone(), to.try_clone()) else {
        return;
    };
    let state = state.clone();
    // Reads wake up now and then, so a stall takes hold even while nothing is sent.
    let _ = from.set_read_timeout(Some(Duration::from_millis(50)));
    // Replies are written on a thread of their own, from a buffer, so that a throttled
    // link still reads the server's writes as they come.
    let (replies, buffered) = crossbeam_channel::unbounded::<Vec<u8>>();
    let mut writer = None;
    if reply {
        let (mut to, state) = (
            to.try_clone().expect("clone the client's socket"),
            state.clone(),
        );
        writer = Some(thread::spawn(move || {
            for chunk in buffered {
                if to.write_all(&chunk).is_err() {
                    break;
                }
                if let Mode::Throttle(rate) = state.mode() {
                    thread::sleep(Duration::from_secs_f64(chunk.len() as f64 / rate as f64));
                }
            }
        }));
    }
    thread::spawn(move || {
        let mut buf = vec![0u8; 64 << 10];
        let mut statements = Statements::default();
        loop {
            if state.unstalled() == Mode::Refuse {
                break;
            }
            let n = match from.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                    continue
                }
                Err(_) => break,
            };
            if let (false, Mode::DropRequestsFrom(needle)) = (reply, state.mode()) {
                if buf[..n].windows(needle.len()).any(|bytes| bytes == needle) {
                    state.set(Mode::DropRequests);
                }
            }
            if !reply {
                // Before the statement goes on: its reply is then the first one dropped.
                let ran = statements.read(&buf[..n]);
                if let Mode::DropRepliesFrom(needle) = state.mode() {
                    if ran.iter().any(|text| text.contains(needle)) {
                        state.set(Mode::DropReplies);
                    }
                }
            }
            // What was read while a stall began waits for it to end.
            match state.unstalled() {
                Mode::Refuse => break,
                Mode::DropReplies if reply => continue,
                Mode::DropRequests if !reply => continue,
                _ => {}
            }
            if reply {
                let chunks = buf[..n].chunks(match state.mode() {
                    // Small writes, so the rate holds within a reply too.
                    Mode::Throttle(rate) => (rate / 20).max(1),
                    _ => n,
                });
                if chunks
                    .map(|c| replies.send(c.to_vec()))
                    .any(|sent| sent.is_err())
                {
                    break;
                }
            } else if to.write_all(&buf[..n]).is_err() {
                break;
            }
        }
        // What the server sent before it closed still reaches the client, unless refused.
        drop(replies);
        if state.mode() != Mode::Refuse {
            if let Some(writer) = writer {
                let _ = writer.join();
            }
        }
        let _ = from.shutdown(Shutdown::Both);
        // A stall leaves the other end open, even once this one is closed.
        if state.mode() != Mode::Stall {
            let _ = to.shutdown(Shutdown::Both);
        }
    });
}

/// What a PostgreSQL client has sent on one connection, read as the protocol's messages:
/// the text of each statement it prepared (Parse, named or not) and of each it ran (Bind of
/// a prepared one, or a simple Query). Anything it cannot read (TLS, another protocol) ends
/// the reading, and nothing is ever found.
#[derive(Default)]
struct Statements {
    pending: Vec<u8>,
    started: bool,
    lost: bool,
    prepared: std::collections::HashMap<Vec<u8>, String>,
}

impl Statements {
    /// Reads what the client sent next; returns the text of each statement it ran in it.
    fn read(&mut self, bytes: &[u8]) -> Vec<String> {
        let mut ran = Vec::new();
        if self.lost {
            return ran;
        }
        self.pending.extend_from_slice(bytes);
        loop {
            // The startup message has a length and no type; every later one both.
            let head = if self.started { 5 } else { 4 };
            if self.pending.len() < head {
                return ran;
            }
            let at = head - 4;
            let len = i32::from_be_bytes(self.pending[at..head].try_into().unwrap());
            // A startup message is short: a longer one is another protocol (AMQP's greeting).
            let most = if self.started { 1 << 30 } else { 10_000 };
            let len = match usize::try_from(len) {
                Ok(len) if (4..=most).contains(&len) => len,
                _ => {
                    self.lost = true;
                    return ran;
                }
            };
            let end = at + len;
            if self.pending.len() < end {
                return ran;
            }
            let message: Vec<u8> = self.pending.drain(..end).collect();
            if !self.started {
                self.started = true;
                // 196608 is protocol 3.0; anything else (an SSL or GSS request) is not read.
                if message.get(4..8) != Some(&196_608i32.to_be_bytes()[..]) {
                    self.lost = true;
                    return ran;
                }
                continue;
            }
            let body = &message[5..];
            let mut strings = body.split(|&b| b == 0);
            match message[0] {
                b'P' => {
                    let name = strings.next().unwrap_or_default().to_vec();
                    let text = String::from_utf8_lossy(strings.next().unwrap_or_default());
                    self.prepared.insert(name, text.into_owned());
                }
                b'B' => {
                    let _portal = strings.next();
                    let name = strings.next().unwrap_or_default();
                    if let Some(text) = self.prepared.get(name) {
                        ran.push(text.clone());
                    }
                }
                b'Q' => {
                    let text = String::from_utf8_lossy(strings.next().unwrap_or_default());
                    ran.push(text.into_owned());
                }
                _ => {}
            }
        }
    }
}
