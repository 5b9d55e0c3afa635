//! etcd v3 through its JSON gateway (`POST /v3/kv/put`, `/v3/kv/range`,
//! `/v3/kv/deleterange`, keys and values base64-encoded), over the small
//! HTTP client: no gRPC stack in the wheel. Several endpoints are tried in
//! order until one answers.

use serde_json::{json, Value};
use transport_core::{Error, ErrorKind, Result};

use super::http::{self, HostPort, Limits};

/// The etcd endpoints of a connection string.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Etcd {
    pub(crate) endpoints: Vec<HostPort>,
}

/// etcd's client port, when an endpoint names none.
const DEFAULT_PORT: u16 = 2379;

impl Etcd {
    /// Parses `host:port`, or several separated by `;` or `,` (Mooncake's
    /// etcd connection string without its `etcd://`).
    pub(crate) fn parse(list: &str) -> Result<Self> {
        let endpoints = list
            .split([';', ','])
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(|s| HostPort::parse(s.strip_prefix("http://").unwrap_or(s), DEFAULT_PORT))
            .collect::<Result<Vec<_>>>()?;
        if endpoints.is_empty() {
            return Err(Error::new(ErrorKind::Config, "etcd metadata server: no endpoint given").with("value", list));
        }
        Ok(Self { endpoints })
    }

    /// The value of `key`, or `None` when etcd has no such key.
    pub(crate) fn get(&self, key: &str, limits: Limits) -> Result<Option<Vec<u8>>> {
        let v = self.call("/v3/kv/range", json!({ "key": b64_encode(key.as_bytes()) }), limits)?;
        let Some(kvs) = v.get("kvs") else { return Ok(None) };
        let first = kvs.as_array().and_then(|a| a.first());
        let Some(kv) = first else { return Ok(None) };
        match kv.get("value") {
            // etcd leaves out an empty value.
            None => Ok(Some(Vec::new())),
            Some(Value::String(s)) => b64_decode(s).map(Some).ok_or_else(|| bad_answer("a value that is not base64")),
            Some(_) => Err(bad_answer("a value that is not a string")),
        }
    }

    /// Sets `key` to `value`.
    pub(crate) fn put(&self, key: &str, value: &[u8], limits: Limits) -> Result<()> {
        let body = json!({ "key": b64_encode(key.as_bytes()), "value": b64_encode(value) });
        self.call("/v3/kv/put", body, limits).map(drop)
    }

    /// Deletes `key` (nothing to delete is no error).
    pub(crate) fn delete(&self, key: &str, limits: Limits) -> Result<()> {
        self.call("/v3/kv/deleterange", json!({ "key": b64_encode(key.as_bytes()) }), limits).map(drop)
    }

    /// Posts `body` to `path` on the first endpoint that answers; the
    /// answer must be 200 with a JSON object.
    fn call(&self, path: &str, body: Value, limits: Limits) -> Result<Value> {
        let body = body.to_string();
        let mut last = None;
        for ep in &self.endpoints {
            let r =
                http::request(ep, "POST", path, &[("Content-Type", "application/json")], Some(body.as_bytes()), limits);
            let resp = match r {
                Ok(resp) => resp,
                // Not there or too slow: the next endpoint may answer.
                Err(e) if e.is_transient() => {
                    last = Some(e.with("etcd", ep.authority()));
                    continue;
                }
                Err(e) => return Err(e.with("etcd", ep.authority())),
            };
            if resp.status != 200 {
                return Err(super::status_error(&resp).with("etcd", ep.authority()).with("call", path));
            }
            let v: Value = serde_json::from_slice(&resp.body)
                .map_err(|_| bad_answer("an answer that is not JSON").with("etcd", ep.authority()))?;
            if !v.is_object() {
                return Err(bad_answer("an answer that is not a JSON object").with("etcd", ep.authority()));
            }
            return Ok(v);
        }
        Err(last.unwrap_or_else(|| Error::new(ErrorKind::Config, "etcd metadata server: no endpoint given")))
    }
}

fn bad_answer(what: &str) -> Error {
    Error::new(ErrorKind::Protocol, format!("etcd metadata server sent {what}"))
}

const B64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// Standard base64 with padding (what etcd's JSON gateway reads).
pub(crate) fn b64_encode(data: &[u8]) -> String {
    let mut out = String::with_capacity(data.len().div_ceil(3) * 4);
    for chunk in data.chunks(3) {
        let b = [chunk[0], chunk.get(1).copied().unwrap_or(0), chunk.get(2).copied().unwrap_or(0)];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(B64[((n >> (18 - 6 * i)) & 63) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Decodes standard base64 (padding optional); `None` if it is not.
pub(crate) fn b64_decode(s: &str) -> Option<Vec<u8>> {
    let s = s.trim_end_matches('=');
    let mut out = Vec::with_capacity(s.len() * 3 / 4);
    let (mut acc, mut bits) = (0u32, 0u32);
    for c in s.bytes() {
        let v = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        };
        acc = (acc << 6) | u32::from(v);
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push(((acc >> bits) & 0xff) as u8);
        }
    }
    // A single leftover character (6 bits) cannot end valid base64.
    (bits < 6).then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_round_trips() {
        for (plain, enc) in [("", ""), ("f", "Zg=="), ("fo", "Zm8="), ("foo", "Zm9v"), ("foob", "Zm9vYg==")] {
            assert_eq!(b64_encode(plain.as_bytes()), enc);
            assert_eq!(b64_decode(enc).unwrap(), plain.as_bytes());
        }
        let all: Vec<u8> = (0..=255).collect();
        assert_eq!(b64_decode(&b64_encode(&all)).unwrap(), all);
        assert!(b64_decode("Zm9v!").is_none());
        assert!(b64_decode("Z").is_none());
    }

    #[test]
    fn endpoints() {
        let e = Etcd::parse("127.0.0.1:2379").unwrap();
        assert_eq!(e.endpoints, vec![HostPort { host: "127.0.0.1".into(), port: 2379 }]);
        let e = Etcd::parse("a:1; b ,http://c:3").unwrap();
        let names: Vec<String> = e.endpoints.iter().map(HostPort::authority).collect();
        assert_eq!(names, ["a:1", "b:2379", "c:3"]);
        for bad in ["", ";", "a:0", "a:b", "a b:1"] {
            assert_eq!(Etcd::parse(bad).unwrap_err().kind(), ErrorKind::Config, "{bad:?}");
        }
    }
}
