//! A small HTTP/1.1 client for the metadata servers: one request per
//! connection (`Connection: close`) over a blocking `std::net::TcpStream`,
//! every step bounded (connect, each read and write, the whole exchange,
//! the size of the headers and of the body). Nothing the server sends is
//! trusted: a response that does not parse is a `Protocol` error, never a
//! panic.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use transport_core::{Error, ErrorKind, Result};

/// Largest status line or header line accepted.
const MAX_LINE: usize = 8 * 1024;
/// Most header lines accepted in one response (trailers included).
const MAX_HEADERS: usize = 100;

/// Bounds of one exchange.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    /// Connecting (per resolved address).
    pub(crate) connect: Duration,
    /// The whole exchange, connecting included.
    pub(crate) total: Duration,
    /// Largest response body accepted.
    pub(crate) max_body: usize,
}

/// `host:port` of a server (`host` without IPv6 brackets).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct HostPort {
    pub(crate) host: String,
    pub(crate) port: u16,
}

impl HostPort {
    /// Parses `host`, `host:port`, `[v6]` or `[v6]:port`; `default_port`
    /// when none is given. Anything else (empty host, port 0 or out of
    /// range, spaces, control characters, `/`, `@`) is a `Config` error.
    pub(crate) fn parse(s: &str, default_port: u16) -> Result<Self> {
        let bad = |why: &str| Error::new(ErrorKind::Config, format!("metadata server address: {why}")).with("value", s);
        if s.is_empty() {
            return Err(bad("empty"));
        }
        if s.chars().any(|c| c.is_whitespace() || c.is_control() || matches!(c, '/' | '@' | '?' | '#')) {
            return Err(bad("unexpected character"));
        }
        let (host, port, bare_v6) = crate::backend::split_authority(s).map_err(bad)?;
        if bare_v6 {
            return Err(bad("an IPv6 address needs brackets: [addr]:port"));
        }
        if host.is_empty() {
            return Err(bad("empty host"));
        }
        let port = match port {
            Some(p) => match p.parse::<u16>() {
                Ok(p) if p != 0 => p,
                _ => return Err(bad("port is not a number in 1..=65535")),
            },
            None => default_port,
        };
        Ok(Self { host: host.to_owned(), port })
    }

    /// `host:port` as written in a `Host` header or a message.
    pub(crate) fn authority(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }
}

/// An `http://host[:port]/path[?query]` URL (Mooncake's HTTP metadata
/// server is given as one; the key goes in a `key` query parameter).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Url {
    pub(crate) server: HostPort,
    /// The path and any query, starting with `/`.
    pub(crate) target: String,
}

impl Url {
    /// Parses an `http://` URL. `https://` is `Unsupported` (this client
    /// speaks plain HTTP); anything malformed is a `Config` error.
    pub(crate) fn parse(s: &str) -> Result<Self> {
        let bad = |why: &str| Error::new(ErrorKind::Config, format!("metadata server URL: {why}")).with("url", s);
        let (scheme, rest) = s.split_once("://").ok_or_else(|| bad("expected http://host:port/path"))?;
        if scheme.eq_ignore_ascii_case("https") {
            return Err(Error::new(
                ErrorKind::Unsupported,
                "https metadata servers are not supported by kvmove (plain http:// only)",
            )
            .with("url", s));
        }
        if !scheme.eq_ignore_ascii_case("http") {
            return Err(bad("the scheme must be http"));
        }
        if rest.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(bad("spaces or control characters"));
        }
        let rest = rest.split_once('#').map_or(rest, |(r, _)| r);
        let cut = rest.find(['/', '?']).unwrap_or(rest.len());
        let (authority, target) = rest.split_at(cut);
        if authority.contains('@') {
            return Err(bad("user names and passwords in the URL are not supported"));
        }
        let server = HostPort::parse(authority, 80).map_err(|e| e.with("url", s))?;
        let target = match target {
            "" => "/".to_owned(),
            t if t.starts_with('?') => format!("/{t}"),
            t => t.to_owned(),
        };
        Ok(Self { server, target })
    }

    /// The request target for `key`: `<path>?key=<key, percent-encoded>`
    /// (`&key=` when the URL already has a query).
    pub(crate) fn with_key(&self, key: &str) -> String {
        let sep = if self.target.contains('?') { '&' } else { '?' };
        format!("{}{sep}key={}", self.target, percent_encode(key))
    }
}

/// Percent-encodes everything but RFC 3986's unreserved characters (as
/// curl's `curl_easy_escape`, which Mooncake's HTTP client uses).
pub(crate) fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// A response: its status and its whole body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Response {
    pub(crate) status: u16,
    pub(crate) body: Vec<u8>,
}

impl Response {
    /// Up to 200 characters of the body, printable, for error messages.
    pub(crate) fn snippet(&self) -> String {
        let text = String::from_utf8_lossy(&self.body);
        let mut s: String = text.chars().take(200).map(|c| if c.is_control() { ' ' } else { c }).collect();
        if text.chars().count() > 200 {
            s.push_str("...");
        }
        s.trim().to_owned()
    }
}

/// Sends one request to `server` and reads the whole response.
///
/// # Errors
/// `ConnectionRefused` / `Timeout` / `Io` from the socket (nothing answers,
/// too slow), `Protocol` for a response that does not parse or is larger
/// than `limits.max_body`.
pub(crate) fn request(
    server: &HostPort,
    method: &str,
    target: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
    limits: Limits,
) -> Result<Response> {
    let deadline = Instant::now() + limits.total;
    let stream = connect(server, limits.connect, deadline)?;
    let mut head = format!("{method} {target} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n", server.authority());
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    if let Some(b) = body {
        head.push_str(&format!("Content-Length: {}\r\n", b.len()));
    }
    head.push_str("\r\n");
    let mut io = Timed { stream, deadline };
    io.write_all(head.as_bytes())?;
    if let Some(b) = body {
        io.write_all(b)?;
    }
    io.flush()?;
    read_response(&mut BufReader::new(io), limits.max_body)
}

fn connect(server: &HostPort, connect: Duration, deadline: Instant) -> Result<TcpStream> {
    let addrs = (server.host.as_str(), server.port)
        .to_socket_addrs()
        .map_err(|e| Error::new(ErrorKind::Io, format!("cannot resolve the metadata server's host: {e}")))?;
    let mut last = Error::new(ErrorKind::Io, "the metadata server's host has no address");
    for a in addrs {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Error::new(ErrorKind::Timeout, "no answer from the metadata server in time"));
        }
        match TcpStream::connect_timeout(&a, connect.min(left)) {
            Ok(s) => {
                let _ = s.set_nodelay(true);
                return Ok(s);
            }
            Err(e) => last = Error::from(e).with("address", a),
        }
    }
    Err(last)
}

/// A stream whose every read and write ends by `deadline`.
struct Timed {
    stream: TcpStream,
    deadline: Instant,
}

impl Timed {
    fn left(&self) -> std::io::Result<Duration> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "no answer from the metadata server in time"))
        } else {
            Ok(left)
        }
    }
}

impl Read for Timed {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let left = self.left()?;
        self.stream.set_read_timeout(Some(left))?;
        self.stream.read(buf).map_err(timed_out)
    }
}

impl Write for Timed {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let left = self.left()?;
        self.stream.set_write_timeout(Some(left))?;
        self.stream.write(buf).map_err(timed_out)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.stream.flush()
    }
}

/// A socket timeout reads as `WouldBlock` on Unix: it is a timeout.
fn timed_out(e: std::io::Error) -> std::io::Error {
    if e.kind() == std::io::ErrorKind::WouldBlock {
        std::io::Error::new(std::io::ErrorKind::TimedOut, "no answer from the metadata server in time")
    } else {
        e
    }
}

fn protocol(why: impl Into<String>) -> Error {
    Error::new(ErrorKind::Protocol, format!("metadata server: {}", why.into()))
}

/// Reads one HTTP/1.x response (skipping `1xx` interim ones): status,
/// headers, and a body framed by `Content-Length`, chunked, or the end of
/// the stream, of at most `max_body` bytes.
pub(crate) fn read_response(r: &mut impl BufRead, max_body: usize) -> Result<Response> {
    loop {
        let line = read_line(r)?.ok_or_else(|| protocol("connection closed before a response"))?;
        let status = parse_status_line(&line)?;
        let mut length: Option<usize> = None;
        let mut chunked = false;
        let mut n = 0;
        loop {
            let line = read_line(r)?.ok_or_else(|| protocol("connection closed inside the headers"))?;
            if line.is_empty() {
                break;
            }
            n += 1;
            if n > MAX_HEADERS {
                return Err(protocol("too many header lines"));
            }
            let (name, value) = line.split_once(':').ok_or_else(|| protocol("a header line without ':'"))?;
            let value = value.trim();
            if name.eq_ignore_ascii_case("content-length") {
                let v: usize = value.parse().map_err(|_| protocol("Content-Length is not a number"))?;
                if length.is_some_and(|l| l != v) {
                    return Err(protocol("conflicting Content-Length headers"));
                }
                length = Some(v);
            } else if name.eq_ignore_ascii_case("transfer-encoding") {
                let last = value.rsplit(',').next().unwrap_or("").trim();
                if !last.eq_ignore_ascii_case("chunked") {
                    return Err(protocol(format!("unsupported Transfer-Encoding {value:?}")));
                }
                chunked = true;
            }
        }
        if (100..200).contains(&status) {
            continue;
        }
        let body = if status == 204 || status == 304 {
            Vec::new()
        } else if chunked {
            read_chunked(r, max_body)?
        } else if let Some(len) = length {
            if len > max_body {
                return Err(protocol(format!("response body of {len} bytes is over the limit of {max_body}")));
            }
            let mut body = vec![0u8; len];
            r.read_exact(&mut body).map_err(|e| eof_is_protocol(e, "connection closed inside the body"))?;
            body
        } else {
            let mut body = Vec::new();
            r.take(max_body as u64 + 1).read_to_end(&mut body).map_err(Error::from)?;
            if body.len() > max_body {
                return Err(protocol(format!("response body is over the limit of {max_body} bytes")));
            }
            body
        };
        return Ok(Response { status, body });
    }
}

fn parse_status_line(line: &str) -> Result<u16> {
    let mut parts = line.splitn(3, ' ');
    let version = parts.next().unwrap_or("");
    if !version.starts_with("HTTP/1.") {
        return Err(protocol(format!("not an HTTP/1.x status line: {:?}", truncate(line))));
    }
    let code = parts.next().unwrap_or("");
    match code.parse::<u16>() {
        Ok(c) if code.len() == 3 && (100..600).contains(&c) => Ok(c),
        _ => Err(protocol(format!("bad status code in {:?}", truncate(line)))),
    }
}

fn truncate(s: &str) -> String {
    s.chars().take(80).collect()
}

fn read_chunked(r: &mut impl BufRead, max_body: usize) -> Result<Vec<u8>> {
    let mut body = Vec::new();
    loop {
        let line = read_line(r)?.ok_or_else(|| protocol("connection closed inside a chunked body"))?;
        let size = line.split(';').next().unwrap_or("").trim();
        let size = usize::from_str_radix(size, 16).map_err(|_| protocol("bad chunk size"))?;
        if size == 0 {
            // Trailers, up to the empty line.
            let mut n = 0;
            while !read_line(r)?.ok_or_else(|| protocol("connection closed inside the trailers"))?.is_empty() {
                n += 1;
                if n > MAX_HEADERS {
                    return Err(protocol("too many trailer lines"));
                }
            }
            return Ok(body);
        }
        if size > max_body.saturating_sub(body.len()) {
            return Err(protocol(format!("response body is over the limit of {max_body} bytes")));
        }
        let start = body.len();
        body.resize(start + size, 0);
        r.read_exact(&mut body[start..]).map_err(|e| eof_is_protocol(e, "connection closed inside a chunk"))?;
        let mut crlf = [0u8; 2];
        r.read_exact(&mut crlf).map_err(|e| eof_is_protocol(e, "connection closed after a chunk"))?;
        if &crlf != b"\r\n" {
            return Err(protocol("a chunk does not end with CRLF"));
        }
    }
}

fn eof_is_protocol(e: std::io::Error, what: &str) -> Error {
    if e.kind() == std::io::ErrorKind::UnexpectedEof {
        protocol(what)
    } else {
        Error::from(e)
    }
}

/// One line without its `\r\n` (or `\n`), at most [`MAX_LINE`] bytes;
/// `None` at the end of the stream before any byte.
fn read_line(r: &mut impl BufRead) -> Result<Option<String>> {
    let mut buf = Vec::new();
    let n = r.take(MAX_LINE as u64 + 1).read_until(b'\n', &mut buf).map_err(Error::from)?;
    if n == 0 {
        return Ok(None);
    }
    if buf.last() != Some(&b'\n') {
        return Err(if buf.len() > MAX_LINE {
            protocol("a header line is too long")
        } else {
            protocol("connection closed inside a line")
        });
    }
    buf.pop();
    if buf.last() == Some(&b'\r') {
        buf.pop();
    }
    String::from_utf8(buf).map(Some).map_err(|_| protocol("a header line is not UTF-8"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(bytes: &[u8]) -> Result<Response> {
        read_response(&mut std::io::Cursor::new(bytes), 64)
    }

    #[test]
    fn urls() {
        let u = Url::parse("http://127.0.0.1:8080/metadata").unwrap();
        assert_eq!(u.server, HostPort { host: "127.0.0.1".into(), port: 8080 });
        assert_eq!(u.target, "/metadata");
        assert_eq!(u.with_key("mooncake/ram/127.0.0.1:12345"), "/metadata?key=mooncake%2Fram%2F127.0.0.1%3A12345");
        let u = Url::parse("HTTP://meta").unwrap();
        assert_eq!((u.server.port, u.target.as_str()), (80, "/"));
        let u = Url::parse("http://[::1]:9/m?x=1#frag").unwrap();
        assert_eq!(u.server.host, "::1");
        assert_eq!(u.server.authority(), "[::1]:9");
        assert_eq!(u.with_key("a b"), "/m?x=1&key=a%20b");
        assert_eq!(Url::parse("http://h:1?q").unwrap().target, "/?q");
        for bad in [
            "http://",
            "http:///metadata",
            "http://:80/x",
            "http://h:0/x",
            "http://h:99999/x",
            "http://h:port/x",
            "http://h:80/a b",
            "http://u:p@h:80/x",
            "http://::1:80/x",
            "http://[::1/x",
            "ftp://h/x",
            "h:80/x",
        ] {
            let e = Url::parse(bad).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Config, "{bad}: {e}");
        }
        assert_eq!(Url::parse("https://h/x").unwrap_err().kind(), ErrorKind::Unsupported);
    }

    #[test]
    fn host_ports() {
        assert_eq!(HostPort::parse("h", 2379).unwrap(), HostPort { host: "h".into(), port: 2379 });
        assert_eq!(HostPort::parse("10.0.0.1:1", 2379).unwrap().port, 1);
        for bad in ["", ":1", "h:", "h:0", "h:-1", "a b:1", "h/x:1", "fe80::1"] {
            assert_eq!(HostPort::parse(bad, 2379).unwrap_err().kind(), ErrorKind::Config, "{bad:?}");
        }
    }

    #[test]
    fn encoding_keeps_only_unreserved() {
        assert_eq!(percent_encode("aZ09-._~"), "aZ09-._~");
        assert_eq!(percent_encode("a/b:c?d&e=f%g h\u{e9}"), "a%2Fb%3Ac%3Fd%26e%3Df%25g%20h%C3%A9");
    }

    #[test]
    fn responses() {
        let r = parse(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX: y\r\n\r\nhello").unwrap();
        assert_eq!(r, Response { status: 200, body: b"hello".to_vec() });
        let r = parse(b"HTTP/1.0 404 Not Found\r\n\r\nmetadata not found").unwrap();
        assert_eq!((r.status, r.snippet().as_str()), (404, "metadata not found"));
        let r =
            parse(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3;x=1\r\nabc\r\n2\r\nde\r\n0\r\nT: 1\r\n\r\n")
                .unwrap();
        assert_eq!(r.body, b"abcde");
        let r = parse(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 No Content\r\nContent-Length: 0\r\n\r\n").unwrap();
        assert_eq!((r.status, r.body.len()), (204, 0));
        // Bare LF line ends are accepted.
        assert_eq!(parse(b"HTTP/1.1 200 OK\nContent-Length: 1\n\nx").unwrap().body, b"x");
    }

    #[test]
    fn bad_responses_are_protocol_errors() {
        let long_header = format!("HTTP/1.1 200 OK\r\nX: {}\r\n\r\n", "y".repeat(MAX_LINE + 10));
        let many_headers = format!("HTTP/1.1 200 OK\r\n{}\r\n", "X: y\r\n".repeat(MAX_HEADERS + 1));
        let cases: Vec<&[u8]> = vec![
            b"",
            b"garbage\r\n\r\n",
            b"HTTP/1.1 2000 OK\r\n\r\n",
            b"HTTP/1.1 abc OK\r\n\r\n",
            b"HTTP/2 200 OK\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab",
            b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabcXX0\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nab",
            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n",
            b"HTTP/1.1 200 OK\r\nX: \xff\r\n\r\n",
            long_header.as_bytes(),
            many_headers.as_bytes(),
        ];
        for c in cases {
            let e = parse(c).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Protocol, "{:?}: {e}", String::from_utf8_lossy(c));
        }
    }

    #[test]
    fn oversized_bodies_are_refused() {
        let e = parse(b"HTTP/1.1 200 OK\r\nContent-Length: 65\r\n\r\n").unwrap_err();
        assert!(e.to_string().contains("over the limit"), "{e}");
        let big = format!("HTTP/1.1 200 OK\r\n\r\n{}", "x".repeat(65));
        assert!(parse(big.as_bytes()).unwrap_err().to_string().contains("over the limit"));
        assert_eq!(parse(format!("HTTP/1.1 200 OK\r\n\r\n{}", "x".repeat(64)).as_bytes()).unwrap().body.len(), 64);
        let chunks = format!(
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n40\r\n{}\r\n1\r\nx\r\n0\r\n\r\n",
            "x".repeat(64)
        );
        assert!(parse(chunks.as_bytes()).unwrap_err().to_string().contains("over the limit"));
        let huge = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nffffffffffffffff\r\n";
        assert_eq!(parse(huge).unwrap_err().kind(), ErrorKind::Protocol);
    }

    #[test]
    fn requests_over_a_socket() {
        use std::net::TcpListener;
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let server = HostPort { host: "127.0.0.1".into(), port: l.local_addr().unwrap().port() };
        let limits = Limits { connect: Duration::from_secs(1), total: Duration::from_millis(500), max_body: 64 };
        let t = std::thread::spawn(move || {
            // First: answer; second: say nothing (the client times out).
            let (mut s, _) = l.accept().unwrap();
            let mut req = Vec::new();
            let mut buf = [0u8; 512];
            while !req.windows(4).any(|w| w == b"\r\n\r\n") || !req.ends_with(b"body") {
                let n = s.read(&mut buf).unwrap();
                assert!(n > 0);
                req.extend_from_slice(&buf[..n]);
            }
            s.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok").unwrap();
            let (s2, _) = l.accept().unwrap();
            std::thread::sleep(Duration::from_millis(800));
            drop(s2);
            String::from_utf8(req).unwrap()
        });
        let r = request(&server, "PUT", "/m?key=k", &[("Content-Type", "application/json")], Some(b"body"), limits)
            .unwrap();
        assert_eq!(r, Response { status: 200, body: b"ok".to_vec() });
        let e = request(&server, "GET", "/m?key=k", &[], None, limits).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
        let req = t.join().unwrap();
        assert!(req.starts_with("PUT /m?key=k HTTP/1.1\r\n"), "{req}");
        assert!(req.contains("\r\nContent-Length: 4\r\n") && req.contains("\r\nConnection: close\r\n"), "{req}");
        // Nothing listens there any more.
        let e = request(&server, "GET", "/", &[], None, limits).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::ConnectionRefused, "{e}");
    }
}
