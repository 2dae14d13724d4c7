//! Just enough HTTP/1.1 for an operator's page: one request per connection, read within a
//! deadline the server enforces itself, with capped headers and body.
//!
//! Why no server crate: tiny_http, the usual blocking one, sets no timeout on the sockets it
//! accepts and reads a request's body on the handler's thread, so one slow client holds a
//! handler for as long as it likes. Here each connection gets one deadline for its whole
//! request, and httparse (the parser hyper uses) does the parsing.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// The most a request's line and headers may take.
const MAX_HEAD: usize = 16 * 1024;
/// The most a request's body may take: forms of a few fields.
pub const MAX_BODY: usize = 16 * 1024;
const MAX_HEADERS: usize = 64;

pub struct Request {
    pub method: String,
    pub path: String,
    query: String,
    headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Request {
    /// A header's value (the first, if sent more than once).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// How many times header `name` was sent.
    fn count(&self, name: &str) -> usize {
        self.headers
            .iter()
            .filter(|(n, _)| n.eq_ignore_ascii_case(name))
            .count()
    }

    /// The query string's fields, decoded.
    pub fn query(&self) -> Fields {
        Fields::parse(self.query.as_bytes())
    }

    /// The form's fields, decoded (an `application/x-www-form-urlencoded` body).
    pub fn form(&self) -> Fields {
        Fields::parse(&self.body)
    }

    /// Every value of cookie `name`: a browser sends several of one name when another
    /// site on the same host planted its own (cookies ignore ports), and it may send that
    /// one first.
    pub fn cookies<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        self.headers
            .iter()
            .filter(|(n, _)| n.eq_ignore_ascii_case("cookie"))
            .flat_map(|(_, v)| v.split(';'))
            .filter_map(|pair| pair.trim().split_once('='))
            .filter(move |(n, _)| *n == name)
            .map(|(_, v)| v)
    }
}

/// Decoded `name=value` fields of a query string or a form.
pub struct Fields(Vec<(String, String)>);

impl Fields {
    fn parse(raw: &[u8]) -> Fields {
        Fields(url::form_urlencoded::parse(raw).into_owned().collect())
    }

    /// The first value of `name`, if it is there and not empty.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(n, v)| n == name && !v.is_empty())
            .map(|(_, v)| v.as_str())
    }

    /// Every non-empty value of `name`.
    pub fn all(&self, name: &str) -> Vec<String> {
        self.0
            .iter()
            .filter(|(n, v)| n == name && !v.is_empty())
            .map(|(_, v)| v.clone())
            .collect()
    }
}

/// Why no request could be read; each but `Gone` is answered.
pub enum ReadError {
    /// The client sent nothing, or closed the connection: nothing to answer.
    Gone,
    /// Not HTTP we take: 400.
    Malformed(&'static str),
    /// Headers or body over their cap: 431 or 413.
    HeadTooLarge,
    BodyTooLarge,
    /// Not all of it by the deadline: 408.
    TooSlow,
}

impl ReadError {
    pub fn response(&self) -> Option<Response> {
        let (status, text) = match self {
            ReadError::Gone => return None,
            ReadError::Malformed(why) => (400, *why),
            ReadError::HeadTooLarge => (431, "request headers too large"),
            ReadError::BodyTooLarge => (413, "request body too large"),
            ReadError::TooSlow => (408, "request not received in time"),
        };
        Some(Response::text(status, text))
    }
}

/// Reads one request, all of it by `deadline`.
pub fn read_request(stream: &mut TcpStream, deadline: Instant) -> Result<Request, ReadError> {
    let mut buf = Vec::with_capacity(1024);
    let head_len = loop {
        if read_some(stream, &mut buf, deadline, MAX_HEAD)? == 0 {
            return Err(if buf.is_empty() {
                ReadError::Gone
            } else {
                ReadError::Malformed("the request ended early")
            });
        }
        let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut parsed = httparse::Request::new(&mut headers);
        match parsed.parse(&buf) {
            Ok(httparse::Status::Complete(len)) => break len,
            Ok(httparse::Status::Partial) if buf.len() >= MAX_HEAD => {
                return Err(ReadError::HeadTooLarge)
            }
            Ok(httparse::Status::Partial) => continue,
            Err(httparse::Error::TooManyHeaders) => return Err(ReadError::HeadTooLarge),
            Err(_) => return Err(ReadError::Malformed("not an HTTP request")),
        }
    };
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut parsed = httparse::Request::new(&mut headers);
    parsed
        .parse(&buf[..head_len])
        .map_err(|_| ReadError::Malformed("not an HTTP request"))?;
    let method = parsed.method.unwrap_or_default().to_owned();
    let target = parsed.path.unwrap_or_default();
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let (path, query) = (path.to_owned(), query.to_owned());
    let headers: Vec<(String, String)> = parsed
        .headers
        .iter()
        .map(|h| {
            (
                h.name.to_owned(),
                String::from_utf8_lossy(h.value).trim().to_owned(),
            )
        })
        .collect();
    let mut request = Request {
        method,
        path,
        query,
        headers,
        body: Vec::new(),
    };
    if request.header("transfer-encoding").is_some() {
        return Err(ReadError::Malformed("chunked bodies are not taken"));
    }
    // RFC 9112: a request with more than one Host, or a Content-Length that is not one
    // number of digits alone, is answered 400; two lengths are how requests are smuggled
    // past a proxy that reads the other one.
    if request.count("host") > 1 {
        return Err(ReadError::Malformed("more than one Host header"));
    }
    if request.count("content-length") > 1 {
        return Err(ReadError::Malformed("more than one Content-Length header"));
    }
    let length = match request.header("content-length") {
        None => 0,
        Some(n) if !n.is_empty() && n.len() <= 9 && n.bytes().all(|b| b.is_ascii_digit()) => n
            .parse::<usize>()
            .map_err(|_| ReadError::Malformed("bad Content-Length"))?,
        Some(_) => return Err(ReadError::Malformed("bad Content-Length")),
    };
    if length > MAX_BODY {
        return Err(ReadError::BodyTooLarge);
    }
    let mut body = buf.split_off(head_len);
    while body.len() < length {
        if read_some(stream, &mut body, deadline, length)? == 0 {
            return Err(ReadError::Malformed("the body ended early"));
        }
    }
    body.truncate(length);
    request.body = body;
    Ok(request)
}

/// Reads what has arrived into `buf` (at most up to `cap` bytes in all), waiting no later
/// than `deadline`.
fn read_some(
    stream: &mut TcpStream,
    buf: &mut Vec<u8>,
    deadline: Instant,
    cap: usize,
) -> Result<usize, ReadError> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(ReadError::TooSlow);
    }
    stream
        .set_read_timeout(Some(left))
        .map_err(|_| ReadError::Gone)?;
    let mut chunk = [0u8; 4096];
    let room = cap.saturating_sub(buf.len()).clamp(1, chunk.len());
    match stream.read(&mut chunk[..room]) {
        Ok(n) => {
            buf.extend_from_slice(&chunk[..n]);
            Ok(n)
        }
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            ) =>
        {
            Err(ReadError::TooSlow)
        }
        Err(_) => Err(ReadError::Gone),
    }
}

/// After refusing a request whose rest was not read: says it is done writing, then reads and
/// drops what the client still sends (a second at most), so closing does not reset the
/// connection and lose the answer before the client reads it.
pub fn linger(stream: &mut TcpStream) {
    let _ = stream.shutdown(std::net::Shutdown::Write);
    let until = Instant::now() + Duration::from_secs(1);
    let mut sink = [0u8; 4096];
    let mut left: usize = 1 << 20;
    while left > 0 {
        let wait = until.saturating_duration_since(Instant::now());
        if wait.is_zero() || stream.set_read_timeout(Some(wait)).is_err() {
            return;
        }
        match stream.read(&mut sink) {
            Ok(0) | Err(_) => return,
            Ok(n) => left = left.saturating_sub(n),
        }
    }
}

pub struct Response {
    pub status: u16,
    content_type: &'static str,
    headers: Vec<(&'static str, String)>,
    body: Vec<u8>,
}

impl Response {
    pub fn html(status: u16, body: String) -> Response {
        Response {
            status,
            content_type: "text/html; charset=utf-8",
            headers: Vec::new(),
            body: body.into_bytes(),
        }
    }

    pub fn text(status: u16, text: &str) -> Response {
        Response {
            status,
            content_type: "text/plain; charset=utf-8",
            headers: Vec::new(),
            body: format!("{text}\n").into_bytes(),
        }
    }

    /// 303 See Other: after a POST, the browser GETs `location`.
    pub fn redirect(location: &str) -> Response {
        Response::text(303, "see other").with("Location", location.to_owned())
    }

    pub fn with(mut self, name: &'static str, value: String) -> Response {
        self.headers.push((name, value));
        self
    }

    /// Writes the response and ends the connection, giving up on a client that does not
    /// take it within `timeout`; to a HEAD request, the head alone.
    pub fn write(
        &self,
        stream: &mut TcpStream,
        timeout: Duration,
        head_only: bool,
    ) -> io::Result<()> {
        stream.set_write_timeout(Some(timeout))?;
        let mut head = format!(
            "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n\
             Cache-Control: no-store\r\nX-Content-Type-Options: nosniff\r\n\
             X-Frame-Options: DENY\r\nReferrer-Policy: no-referrer\r\n\
             Content-Security-Policy: default-src 'none'; style-src 'unsafe-inline'; \
             img-src 'self'; form-action 'self'; frame-ancestors 'none'\r\n",
            self.status,
            reason(self.status),
            self.content_type,
            self.body.len()
        );
        for (name, value) in &self.headers {
            head.push_str(&format!("{name}: {value}\r\n"));
        }
        head.push_str("\r\n");
        stream.write_all(head.as_bytes())?;
        if !head_only {
            stream.write_all(&self.body)?;
        }
        stream.flush()
    }
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        303 => "See Other",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        413 => "Content Too Large",
        431 => "Request Header Fields Too Large",
        503 => "Service Unavailable",
        _ => "Internal Server Error",
    }
}

/// `text` with HTML's special characters escaped, for element content and quoted attributes.
pub fn esc(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// `text` for a log line: control characters (a newline would start a forged line, ESC
/// drives the terminal) escaped, and at most `LOGGED` characters of it.
pub fn loggable(text: &str) -> String {
    let mut out = String::new();
    for (i, c) in text.chars().enumerate() {
        if i == LOGGED {
            out.push_str("...");
            break;
        }
        if c.is_control() || c == '\\' {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

/// The most of one value a log line carries.
const LOGGED: usize = 200;

/// `text` encoded for a query string's value.
pub fn query_value(text: &str) -> String {
    url::form_urlencoded::byte_serialize(text.as_bytes()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escaping_leaves_no_markup() {
        assert_eq!(
            esc(r#"<a href="x">'&'</a>"#),
            "&lt;a href=&quot;x&quot;&gt;&#39;&amp;&#39;&lt;/a&gt;"
        );
    }

    #[test]
    fn logged_values_cannot_start_a_line_or_drive_a_terminal() {
        assert_eq!(
            loggable("a\nINFO forged\u{1b}[2J"),
            "a\\nINFO forged\\u{1b}[2J"
        );
        assert_eq!(loggable(&"x".repeat(1000)).len(), LOGGED + 3);
    }

    #[test]
    fn fields_decode_and_skip_empty_values() {
        let fields = Fields::parse(b"error=no+route%21&topic=&key=a&key=b");
        assert_eq!(fields.get("error"), Some("no route!"));
        assert_eq!(fields.get("topic"), None);
        assert_eq!(fields.all("key"), ["a", "b"]);
    }
}
