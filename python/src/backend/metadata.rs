//! Mooncake's metadata-server modes for the Mooncake-style
//! `TransferEngine`: engines find each other by *segment name* through an
//! HTTP metadata server (`http://host:port/path`, Mooncake's own
//! `mooncake_http_metadata_server` or anything answering GET/PUT/DELETE on
//! `?key=`) or etcd (`etcd://host:port` or bare `host:port`, through
//! etcd's v3 JSON gateway), instead of passing `host:port` addresses
//! around (`P2PHANDSHAKE`).
//!
//! # Names
//!
//! As in Mooncake, the segment name of an engine is its `local_hostname`
//! exactly as given to `initialize` (`"127.0.0.1:12345"`, `"prefill-0"`):
//! a name, not necessarily an address. The engine listens on an address of
//! its own ([`listen_address`]) and publishes `name -> address` at
//! initialize; a peer's transfer call with `target_hostname = name` looks
//! the name up once ([`Directory::resolve`], cached), opens the address,
//! and looks it up again after a failure that says the peer went away (a
//! restarted peer listens elsewhere).
//!
//! # Records
//!
//! kvmove does not write Mooncake's records (`mooncake/ram/<name>`,
//! `mooncake/rpc_meta/<name>`): stand-in engines only meet other stand-in
//! engines. Its record is JSON under `kvmove/segments/<name>`:
//! `{"kvmove": 1, "name": ..., "address": "host:port", "backend": "tcp"}`.
//! Publishing overwrites an older record of the same name (a restarted
//! engine takes its name back); close removes the record if it is still
//! this engine's (best effort: a crashed engine leaves its record, and a
//! peer calling it then fails to connect and looks the name up again).

pub(crate) mod etcd;
pub(crate) mod http;

use std::collections::HashMap;
use std::net::{IpAddr, TcpListener, ToSocketAddrs, UdpSocket};
use std::time::Duration;

use parking_lot::Mutex;
use serde_json::{json, Value};
use transport_core::{Error, ErrorKind, Result};

use self::etcd::Etcd;
use self::http::{Limits, Url};

/// Where this engine's record and its peers' live.
pub(crate) const KEY_PREFIX: &str = "kvmove/segments/";

/// Mooncake's bearer token for its HTTP metadata server.
const TOKEN_ENV: &str = "MC_METADATA_HTTP_TOKEN";
/// Mooncake's address to listen on in metadata mode.
pub(crate) const BIND_ADDRESS_ENV: &str = "MC_TCP_BIND_ADDRESS";
/// Mooncake's switch to listen on the port of `local_hostname`.
pub(crate) const LEGACY_PORT_ENV: &str = "MC_LEGACY_RPC_PORT_BINDING";

/// Longest segment name looked up.
const MAX_NAME: usize = 1024;

/// Bounds of every request (Mooncake's HTTP client: 1.5 s to connect, 3 s
/// in all); records are small.
const LIMITS: Limits =
    Limits { connect: Duration::from_millis(1500), total: Duration::from_secs(3), max_body: 1 << 20 };
/// Removing the record at close: shorter, it may run while Python waits.
const CLOSE_LIMITS: Limits =
    Limits { connect: Duration::from_millis(500), total: Duration::from_secs(1), max_body: 1 << 20 };

/// A metadata server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Server {
    Http(Url),
    Etcd(Etcd),
}

impl Server {
    /// The server a Mooncake `metadata_server` string names, or `None` for
    /// peer-to-peer (`P2PHANDSHAKE`, `p2p`, empty). `redis://` and unknown
    /// schemes are `Unsupported`; a malformed address is `Config`.
    pub(crate) fn parse(conn: &str) -> Result<Option<Self>> {
        let s = conn.trim();
        if s.is_empty() || s.eq_ignore_ascii_case("P2PHANDSHAKE") || s.eq_ignore_ascii_case("p2p") {
            return Ok(None);
        }
        let server = match s.split_once("://") {
            Some((scheme, _)) if scheme.eq_ignore_ascii_case("http") || scheme.eq_ignore_ascii_case("https") => {
                Self::Http(Url::parse(s)?)
            }
            Some((scheme, rest)) if scheme.eq_ignore_ascii_case("etcd") => Self::Etcd(Etcd::parse(rest)?),
            Some((scheme, _)) => {
                return Err(Error::new(
                    ErrorKind::Unsupported,
                    format!(
                        "{scheme}:// metadata servers are not supported by kvmove; use http://host:port/path, \
                         etcd://host:port or P2PHANDSHAKE"
                    ),
                )
                .with("metadata_server", conn))
            }
            None => Self::Etcd(Etcd::parse(s)?),
        };
        Ok(Some(server))
    }

    /// How messages name the server.
    pub(crate) fn describe(&self) -> String {
        match self {
            Self::Http(u) => format!("http://{}{}", u.server.authority(), u.target),
            Self::Etcd(e) => {
                let eps: Vec<String> = e.endpoints.iter().map(http::HostPort::authority).collect();
                format!("etcd://{}", eps.join(";"))
            }
        }
    }

    fn get(&self, key: &str, limits: Limits) -> Result<Option<Vec<u8>>> {
        match self {
            Self::Http(u) => {
                let token = auth();
                let headers: Vec<_> = token.iter().map(|t| ("Authorization", t.as_str())).collect();
                let r = http::request(&u.server, "GET", &u.with_key(key), &headers, None, limits)?;
                match r.status {
                    200 => Ok(Some(r.body)),
                    404 => Ok(None),
                    _ => Err(status_error(&r)),
                }
            }
            Self::Etcd(e) => e.get(key, limits),
        }
    }

    fn put(&self, key: &str, value: &[u8], limits: Limits) -> Result<()> {
        match self {
            Self::Http(u) => {
                let token = auth();
                let mut headers: Vec<_> = token.iter().map(|t| ("Authorization", t.as_str())).collect();
                headers.push(("Content-Type", "application/json"));
                let r = http::request(&u.server, "PUT", &u.with_key(key), &headers, Some(value), limits)?;
                if (200..300).contains(&r.status) {
                    Ok(())
                } else {
                    Err(status_error(&r))
                }
            }
            Self::Etcd(e) => e.put(key, value, limits),
        }
    }

    fn delete(&self, key: &str, limits: Limits) -> Result<()> {
        match self {
            Self::Http(u) => {
                let token = auth();
                let headers: Vec<_> = token.iter().map(|t| ("Authorization", t.as_str())).collect();
                let r = http::request(&u.server, "DELETE", &u.with_key(key), &headers, None, limits)?;
                if (200..300).contains(&r.status) || r.status == 404 {
                    Ok(())
                } else {
                    Err(status_error(&r))
                }
            }
            Self::Etcd(e) => e.delete(key, limits),
        }
    }
}

/// `Authorization: Bearer` from `MC_METADATA_HTTP_TOKEN`, as Mooncake's
/// HTTP client sends it.
fn auth() -> Option<String> {
    std::env::var(TOKEN_ENV).ok().map(|t| t.trim().to_owned()).filter(|t| !t.is_empty()).map(|t| format!("Bearer {t}"))
}

/// An answer that is not the one asked for: refused access is
/// `AuthFailed`, anything else `Io` (the server's trouble; may pass).
pub(crate) fn status_error(r: &http::Response) -> Error {
    let kind = if matches!(r.status, 401 | 403) { ErrorKind::AuthFailed } else { ErrorKind::Io };
    Error::new(kind, format!("metadata server answered HTTP {}: {}", r.status, r.snippet()))
}

/// The name directory of one engine: its own record, and the addresses of
/// the names it looked up.
#[derive(Debug)]
pub(crate) struct Directory {
    server: Server,
    /// This engine's segment name and kvmove address.
    name: String,
    address: String,
    backend: String,
    record: Vec<u8>,
    /// Names looked up, with their addresses.
    cache: Mutex<HashMap<String, String>>,
}

impl Directory {
    /// Publishes `name -> address` on `server`.
    ///
    /// # Errors
    /// The server's, with its name in the context: an unreachable server is
    /// `ConnectionRefused` / `Timeout`, one that refuses the record `Io` or
    /// `AuthFailed`.
    pub(crate) fn publish(server: Server, name: &str, address: &str, backend: &str) -> Result<Self> {
        check_name(name)?;
        let record = json!({ "kvmove": 1, "name": name, "address": address, "backend": backend }).to_string();
        let d = Self {
            server,
            name: name.to_owned(),
            address: address.to_owned(),
            backend: backend.to_owned(),
            record: record.into_bytes(),
            cache: Mutex::new(HashMap::new()),
        };
        d.server.put(&key(name), &d.record, LIMITS).map_err(|e| d.context(e, name, "publishing this engine"))?;
        Ok(d)
    }

    /// This engine's segment name.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// The kvmove address of the segment `name`: this engine's own, one
    /// looked up before, or the server's answer.
    ///
    /// # Errors
    /// `NotFound` for a name the server does not know; `Protocol` for a
    /// record that is not a kvmove segment record of that name;
    /// `Unsupported` for a peer of another backend; the server's own.
    pub(crate) fn resolve(&self, name: &str) -> Result<String> {
        if name == self.name {
            return Ok(self.address.clone());
        }
        if let Some(a) = self.cache.lock().get(name) {
            return Ok(a.clone());
        }
        check_name(name)?;
        let Some(bytes) = self.server.get(&key(name), LIMITS).map_err(|e| self.context(e, name, "looking up"))? else {
            return Err(self.context(
                Error::new(ErrorKind::NotFound, "no segment of this name in the metadata server"),
                name,
                "looking up",
            ));
        };
        let address = self.read_record(name, &bytes).map_err(|e| self.context(e, name, "looking up"))?;
        self.cache.lock().insert(name.to_owned(), address.clone());
        Ok(address)
    }

    fn read_record(&self, name: &str, bytes: &[u8]) -> Result<String> {
        let bad = || Error::new(ErrorKind::Protocol, "the metadata server's record of this name is no kvmove segment");
        let v: Value = serde_json::from_slice(bytes).map_err(|_| bad())?;
        if v.get("kvmove").and_then(Value::as_u64) != Some(1) || v.get("name").and_then(Value::as_str) != Some(name) {
            return Err(bad());
        }
        let address = v.get("address").and_then(Value::as_str).ok_or_else(bad)?;
        crate::core::check_peer_name(address).map_err(|_| bad())?;
        let backend = v.get("backend").and_then(Value::as_str).unwrap_or("");
        if backend != self.backend {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!("the peer runs kvmove's {backend:?} backend, this engine {:?}", self.backend),
            ));
        }
        Ok(address.to_owned())
    }

    /// Forgets the address of `name` (after a failure that says the peer
    /// went away): the next call looks it up again.
    pub(crate) fn forget(&self, name: &str) {
        self.cache.lock().remove(name);
    }

    /// Removes this engine's record if it is still this engine's (best
    /// effort, bounded to about a second).
    pub(crate) fn unpublish(&self) -> Result<()> {
        let k = key(&self.name);
        match self.server.get(&k, CLOSE_LIMITS)? {
            Some(v) if v == self.record => self.server.delete(&k, CLOSE_LIMITS),
            _ => Ok(()),
        }
    }

    fn context(&self, e: Error, name: &str, doing: &'static str) -> Error {
        e.with("segment", name).with("while", doing).with("metadata_server", self.server.describe())
    }
}

fn key(name: &str) -> String {
    format!("{KEY_PREFIX}{name}")
}

fn check_name(name: &str) -> Result<()> {
    if name.is_empty() || name.len() > MAX_NAME {
        return Err(Error::new(ErrorKind::InvalidRequest, format!("a segment name must have 1 to {MAX_NAME} bytes"))
            .with("segment", name.chars().take(80).collect::<String>()));
    }
    Ok(())
}

/// The address an engine named `local_hostname` listens on in metadata
/// mode (Mooncake's rules, as far as an address is concerned):
/// `MC_TCP_BIND_ADDRESS` if set; else the host of the name when it is an IP
/// address (not `0.0.0.0` / `::`) or a host name that resolves to an
/// address of this machine; else the address this machine reaches other
/// hosts from. The port is any free one, or the name's with
/// `MC_LEGACY_RPC_PORT_BINDING` set.
pub(crate) fn listen_address(local_hostname: &str) -> Result<(String, u16)> {
    let (host, port) = crate::backend::split_host_port(local_hostname)?;
    let port = if std::env::var_os(LEGACY_PORT_ENV).is_some() { port } else { 0 };
    if let Some(a) = std::env::var(BIND_ADDRESS_ENV).ok().map(|a| a.trim().to_owned()).filter(|a| !a.is_empty()) {
        return Ok((a, port));
    }
    if let Ok(ip) = host.parse::<IpAddr>() {
        if !ip.is_unspecified() {
            return Ok((ip.to_string(), port));
        }
    } else if let Ok(addrs) = (host.as_str(), 0).to_socket_addrs() {
        for a in addrs {
            if TcpListener::bind((a.ip(), 0)).is_ok() {
                return Ok((a.ip().to_string(), port));
            }
        }
    }
    // The source address of a route out (a UDP "connect" sends nothing).
    for probe in ["192.0.2.1:9", "10.255.255.255:9", "[2001:db8::1]:9"] {
        let bind = if probe.starts_with('[') { "[::]:0" } else { "0.0.0.0:0" };
        let local = UdpSocket::bind(bind).and_then(|s| s.connect(probe).and_then(|()| s.local_addr()));
        if let Ok(a) = local {
            if !a.ip().is_unspecified() {
                return Ok((a.ip().to_string(), port));
            }
        }
    }
    Err(Error::new(
        ErrorKind::Config,
        format!("found no address of this machine to listen on for segment {local_hostname:?}; set {BIND_ADDRESS_ENV}"),
    ))
}

#[cfg(test)]
mod tests {
    use std::io::{BufRead, BufReader, Read, Write};

    use super::*;

    #[test]
    fn server_strings() {
        for p2p in ["", "P2PHANDSHAKE", "p2phandshake", " p2p "] {
            assert_eq!(Server::parse(p2p).unwrap(), None, "{p2p:?}");
        }
        let Some(Server::Http(u)) = Server::parse("http://127.0.0.1:8080/metadata").unwrap() else { panic!() };
        assert_eq!(u.target, "/metadata");
        for etcd in ["127.0.0.1:2379", "etcd://127.0.0.1:2379", "ETCD://127.0.0.1"] {
            let Some(Server::Etcd(e)) = Server::parse(etcd).unwrap() else { panic!("{etcd}") };
            assert_eq!(e.endpoints[0].authority(), "127.0.0.1:2379");
        }
        for unsupported in ["redis://127.0.0.1:6379", "https://h/m", "carrier://x"] {
            assert_eq!(Server::parse(unsupported).unwrap_err().kind(), ErrorKind::Unsupported, "{unsupported}");
        }
        for malformed in ["http://", "etcd://", "http://h:x/m", "h:99999", "a b", "etcd://h:0"] {
            assert_eq!(Server::parse(malformed).unwrap_err().kind(), ErrorKind::Config, "{malformed}");
        }
        let s = Server::parse("etcd://a:1;b:2").unwrap().unwrap();
        assert_eq!(s.describe(), "etcd://a:1;b:2");
    }

    #[test]
    fn listen_addresses() {
        // The environment variables are not set by the tests' runner.
        assert_eq!(listen_address("127.0.0.1:12345").unwrap(), ("127.0.0.1".into(), 0));
        assert_eq!(listen_address("[::1]:5").unwrap(), ("::1".into(), 0));
        assert_eq!(listen_address("localhost").unwrap().1, 0);
        assert!(listen_address("").is_err());
    }

    /// A metadata server answering GET/PUT/DELETE on `?key=`, for
    /// `requests` connections; returns what it stored at the end.
    fn http_server(requests: usize) -> (Url, std::thread::JoinHandle<HashMap<String, Vec<u8>>>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = Url::parse(&format!("http://{}/metadata", l.local_addr().unwrap())).unwrap();
        let t = std::thread::spawn(move || {
            let mut store = HashMap::new();
            for _ in 0..requests {
                let (s, _) = l.accept().unwrap();
                let mut r = BufReader::new(s.try_clone().unwrap());
                let mut line = String::new();
                r.read_line(&mut line).unwrap();
                let mut parts = line.split(' ');
                let (method, target) = (parts.next().unwrap().to_owned(), parts.next().unwrap().to_owned());
                let mut len = 0;
                loop {
                    let mut h = String::new();
                    r.read_line(&mut h).unwrap();
                    if h.trim().is_empty() {
                        break;
                    }
                    if let Some(v) = h.to_ascii_lowercase().strip_prefix("content-length:") {
                        len = v.trim().parse().unwrap();
                    }
                }
                let mut body = vec![0u8; len];
                r.read_exact(&mut body).unwrap();
                let key = target.split_once("key=").unwrap().1.replace("%2F", "/").replace("%3A", ":");
                let (status, answer) = match method.as_str() {
                    "PUT" => {
                        store.insert(key, body);
                        (200, b"metadata updated".to_vec())
                    }
                    "GET" => store.get(&key).map_or((404, b"metadata not found".to_vec()), |v| (200, v.clone())),
                    _ => store.remove(&key).map_or((404, b"metadata not found".to_vec()), |_| (200, b"ok".to_vec())),
                };
                let mut s = s;
                write!(s, "HTTP/1.1 {status} X\r\nContent-Length: {}\r\n\r\n", answer.len()).unwrap();
                s.write_all(&answer).unwrap();
            }
            store
        });
        (url, t)
    }

    #[test]
    fn directory_over_http() {
        // 2 publishes, 1 lookup of b, 1 of a name nobody has, 2 for a's
        // unpublish (read, delete), 1 for b's (read: not b's record).
        let (url, t) = http_server(7);
        let a = Directory::publish(Server::Http(url.clone()), "a", "127.0.0.1:7000", "tcp").unwrap();
        let b = Directory::publish(Server::Http(url), "127.0.0.1:1", "127.0.0.1:7001", "tcp").unwrap();
        assert_eq!(a.resolve("127.0.0.1:1").unwrap(), "127.0.0.1:7001");
        assert_eq!(a.resolve("127.0.0.1:1").unwrap(), "127.0.0.1:7001", "cached: no request");
        assert_eq!(a.resolve("a").unwrap(), "127.0.0.1:7000", "its own: no request");
        let e = a.resolve("nobody").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NotFound);
        assert_eq!(e.context_value("segment"), Some("nobody"));
        assert!(e.context_value("metadata_server").unwrap().starts_with("http://127.0.0.1:"), "{e}");
        a.unpublish().unwrap();
        // b's record is gone from under it: nothing to delete.
        let mut b = b;
        b.record = b"other".to_vec();
        b.unpublish().unwrap();
        let store = t.join().unwrap();
        let keys: Vec<&String> = store.keys().collect();
        assert_eq!(keys, ["kvmove/segments/127.0.0.1:1"]);
    }

    #[test]
    fn records_are_checked() {
        let d = Directory {
            server: Server::parse("etcd://127.0.0.1:1").unwrap().unwrap(),
            name: "me".into(),
            address: "127.0.0.1:1".into(),
            backend: "tcp".into(),
            record: Vec::new(),
            cache: Mutex::new(HashMap::new()),
        };
        let ok = br#"{"kvmove":1,"name":"p","address":"10.0.0.1:5","backend":"tcp"}"#;
        assert_eq!(d.read_record("p", ok).unwrap(), "10.0.0.1:5");
        for bad in [
            &br#"{"kvmove":1,"name":"q","address":"10.0.0.1:5","backend":"tcp"}"#[..],
            br#"{"kvmove":2,"name":"p","address":"10.0.0.1:5","backend":"tcp"}"#,
            br#"{"kvmove":1,"name":"p","address":"nowhere","backend":"tcp"}"#,
            br#"{"kvmove":1,"name":"p","backend":"tcp"}"#,
            br#"["p"]"#,
            b"not json",
            br#"{"segment_name":"p","buffers":[]}"#,
        ] {
            assert_eq!(d.read_record("p", bad).unwrap_err().kind(), ErrorKind::Protocol);
        }
        let rdma = br#"{"kvmove":1,"name":"p","address":"10.0.0.1:5","backend":"rdma"}"#;
        assert_eq!(d.read_record("p", rdma).unwrap_err().kind(), ErrorKind::Unsupported);
        // Nothing listens on the etcd endpoint: refused, named.
        let e = d.resolve("p").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::ConnectionRefused, "{e}");
        assert_eq!(e.context_value("metadata_server"), Some("etcd://127.0.0.1:1"));
        assert_eq!(d.resolve("").unwrap_err().kind(), ErrorKind::InvalidRequest);
    }
}
