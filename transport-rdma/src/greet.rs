//! The side channel's handshake (version 2): every connection opens with
//! it, and nothing else is answered before it is done.
//!
//! ```text
//! client: {"op":"hello","version":2,"nonce":CN}
//! server: {"result":"challenge","nonce":SN,"auth":BOOL,"proof":Q}   (or busy / denied / error)
//! client: {"op":"auth","proof":P}                           (P empty without a secret)
//! client: its first request, at once                        (see below)
//! server: {"result":"ready","proof":Q}                      (or busy / denied)
//! server: the answer to the first request
//! ```
//!
//! What is decided (versions, proofs, whether the first request may go
//! early) is `transport_control::handshake`'s, the machines the TCP
//! backend's handshake runs too; this module carries them in JSON lines.
//! With a secret (`RdmaConfig::secret`) each side proves it holds it
//! (`transport_control::auth`, domain `kvmove-rdma/2`): the client's proof before anything is answered, the
//! server's so that no impostor is sent a QP or a notification. A client
//! with a secret refuses a server that asks for none. Without a secret the
//! server answers only its own host (protected mode,
//! `transport_control::access`) unless `insecure` is set.
//!
//! The server's proof comes with the challenge (and again with `ready`,
//! for clients from before that): a client that has checked it, or that
//! has no secret, sends its first request right behind `auth`, so the
//! handshake costs one round trip more than a bare request, not two. The
//! server still reads that request only after it has checked the proof,
//! and the client reads the answer only after `ready`. A proof in the
//! challenge is answered to a client that has not proven anything yet; it
//! is an HMAC over the client's nonce and one the server just drew, in the
//! server's role, so it proves nothing in any other handshake.
//!
//! A peer of version 1 (a kvmove from before this handshake) opens with a
//! request instead: it is answered an error that says so, and the
//! connection is closed. Handshake lines are bounded by [`HELLO_LINE`]
//! before they are parsed.

use tokio::io::{AsyncRead, AsyncWrite, BufReader};
use transport_control::admission::{Limits, Proven, Slot};
use transport_control::auth::{self, NONCE_LEN};
use transport_control::handshake::{self, PROOF_LEN};
use transport_core::{Error, ErrorKind, Result};

use crate::wire::{self, hex, Reply, Request};

/// The side channel's version: 2 added this handshake.
pub(crate) const VERSION: u32 = 2;
/// Longest handshake line either side reads: a hello or an auth with its
/// hex, or a refusal with its reason.
pub(crate) const HELLO_LINE: usize = 1024;

/// What a version-1 peer (no handshake) is told.
pub(crate) const OLD_PEER: &str = "this peer speaks version 2 of the kvmove RDMA side channel, which opens with a \
     handshake (and a shared secret where one is set); the request came without one, from a kvmove older than \
     this handshake: upgrade both ends";

/// Why the server ended a handshake (it has already answered the peer).
#[derive(Debug)]
pub(crate) struct Refused(pub String);

/// The server's side, on a freshly accepted connection counted by `slot`:
/// answers the client's hello, checks its proof (with `secret`), and moves
/// the slot to the handshaken connections (`limits`). The peer has been
/// answered when this returns an error; the caller closes.
pub(crate) async fn answer<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut BufReader<S>,
    secret: Option<&str>,
    slot: &mut Slot,
    limits: &Limits,
) -> std::result::Result<(), Refused> {
    let hello = match wire::recv_limited::<_, Request>(s, HELLO_LINE).await {
        // A nonce that is not hex is one of the wrong length to the machine.
        Ok(Request::Hello { version, nonce }) => {
            let cn = unhex(&nonce, NONCE_LEN).unwrap_or_default();
            handshake::Server::hello(auth::RDMA, secret.map(str::as_bytes), VERSION, version, &cn)
        }
        Ok(_) => return refuse(s, Reply::Error { message: OLD_PEER.into() }).await,
        Err(e) if e.kind() == ErrorKind::Protocol => {
            return refuse(s, Reply::Error { message: format!("malformed hello: {e}") }).await
        }
        Err(e) => return Err(Refused(e.to_string())),
    };
    let (hs, challenge) = match hello {
        Ok(h) => h,
        Err(r) => return refuse(s, Reply::Error { message: r.to_string() }).await,
    };
    // A well-formed hello: silent connections give way before this one.
    slot.proved(limits, Proven::Hello);
    let reply = Reply::Challenge { nonce: hex(hs.nonce()), auth: challenge.auth, proof: hex(&challenge.proof) };
    wire::send(s.get_mut(), &reply).await.map_err(|e| Refused(e.to_string()))?;
    let proof = match wire::recv_limited::<_, Request>(s, HELLO_LINE).await {
        Ok(Request::Auth { proof }) => unhex(&proof, PROOF_LEN).unwrap_or_default(),
        Ok(_) => return refuse(s, Reply::Error { message: "expected auth".into() }).await,
        Err(e) if e.kind() == ErrorKind::Protocol => {
            return refuse(s, Reply::Error { message: format!("malformed auth: {e}") }).await
        }
        Err(e) => return Err(Refused(e.to_string())),
    };
    let ours = match hs.auth(&proof) {
        Ok(p) => hex(&p),
        Err(r) => return refuse(s, Reply::Denied { message: r.to_string() }).await,
    };
    if let Err(why) = slot.promote(limits) {
        tracing::warn!(reason = why, "side channel: refused after the handshake (answered busy)");
        return refuse(s, Reply::Busy).await;
    }
    wire::send(s.get_mut(), &Reply::Ready { proof: ours }).await.map_err(|e| Refused(e.to_string()))
}

/// Whether a well-formed hello of this version is already waiting in a
/// just-accepted socket (a peer sends it with the connection; under a
/// flood it waits in the accept backlog long enough to arrive), so its
/// handshake gives way after silent ones from the start. Peeked, not read.
pub(crate) fn hello_waiting(s: &tokio::net::TcpStream) -> bool {
    // Through a duplicate of the descriptor (non-blocking, as the
    // original): the runtime has not polled a socket it just accepted, so
    // its own peek would not look yet.
    use std::os::fd::AsFd;
    let Ok(fd) = s.as_fd().try_clone_to_owned() else { return false };
    let mut b = [0u8; HELLO_LINE];
    let Ok(n) = std::net::TcpStream::from(fd).peek(&mut b) else { return false };
    let Some(end) = b.get(..n).and_then(|b| b.iter().position(|&c| c == b'\n')) else { return false };
    matches!(
        serde_json::from_slice::<Request>(&b[..end]),
        Ok(Request::Hello { version, nonce }) if version == VERSION && unhex(&nonce, NONCE_LEN).is_some()
    )
}

/// Answers `reply` and gives the reason to end the connection.
async fn refuse<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut BufReader<S>,
    reply: Reply,
) -> std::result::Result<(), Refused> {
    let why = match &reply {
        Reply::Error { message } | Reply::Denied { message } => message.clone(),
        Reply::Busy => "busy".into(),
        other => format!("{other:?}"),
    };
    let _ = wire::send(s.get_mut(), &reply).await;
    Err(Refused(why))
}

/// The client's side, on a fresh connection to `peer`: the handshake, with
/// `secret` if set, and then `first` (the connection's first request, if
/// given): right behind `auth` where the challenge allows it (no secret,
/// or the server's proof in the challenge checked), else after `ready`.
/// Its answer is the caller's to read. Errors: `ConnectionRefused`
/// (transient) when the peer is busy; `AuthFailed` when either side's
/// proof fails, a secret is missing on one side, or the peer's protected
/// mode refuses this host; `HandshakeFailed` for another version or a
/// peer that does not follow the handshake.
pub(crate) async fn hello<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut BufReader<S>,
    secret: Option<&str>,
    peer: &str,
    first: Option<&Request>,
) -> Result<()> {
    let mut hs = handshake::Client::new(auth::RDMA, secret.map(str::as_bytes));
    wire::send(s.get_mut(), &Request::Hello { version: VERSION, nonce: hex(hs.nonce()) }).await?;
    let a = match wire::recv_limited::<_, Reply>(s, HELLO_LINE).await? {
        Reply::Challenge { nonce, auth, proof } => {
            let sn = unhex(&nonce, NONCE_LEN).unwrap_or_default();
            hs.challenge(&sn, auth, &unhex(&proof, PROOF_LEN).unwrap_or_default())
        }
        other => return Err(refusal(other, peer)),
    }
    .map_err(|e| e.with("segment", peer))?;
    // A proof in the challenge that is missing or wrong (a server from
    // before it, an impostor, or a secret that differs: the server then
    // says so, answering the proof below): the request waits for `ready`.
    wire::send(s.get_mut(), &Request::Auth { proof: hex(&a.proof) }).await?;
    if let Some(first) = first.filter(|_| a.early) {
        wire::send(s.get_mut(), first).await?;
    }
    let proven = match wire::recv_limited::<_, Reply>(s, HELLO_LINE).await? {
        Reply::Ready { proof } => hs.ready(&unhex(&proof, PROOF_LEN).unwrap_or_default()),
        other => return Err(refusal(other, peer)),
    };
    proven.map_err(|e| e.with("segment", peer))?;
    if let Some(first) = first.filter(|_| !a.early) {
        wire::send(s.get_mut(), first).await?;
    }
    Ok(())
}

/// The error for a reply that ends the handshake.
fn refusal(reply: Reply, peer: &str) -> Error {
    let (kind, why) = match reply {
        Reply::Busy => (ErrorKind::ConnectionRefused, "the peer is busy (its handshake quota is full)".to_string()),
        Reply::Denied { message } => (ErrorKind::AuthFailed, message),
        Reply::Error { message } => (
            ErrorKind::HandshakeFailed,
            format!("the peer refused the handshake: {message} (a kvmove from before side channel version 2 answers so: upgrade it)"),
        ),
        other => (ErrorKind::Protocol, format!("unexpected reply to the handshake: {other:?}")),
    };
    Error::new(kind, why).with("segment", peer)
}

/// Exactly `len` bytes from lowercase or uppercase hex; `None` otherwise.
fn unhex(s: &str, len: usize) -> Option<Vec<u8>> {
    if s.len() != len.checked_mul(2)? || !s.bytes().all(|c| c.is_ascii_hexdigit()) {
        return None;
    }
    (0..len).map(|i| u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()).collect()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::net::IpAddr;
    use std::sync::Arc;

    use parking_lot::Mutex;
    use tokio::io::{AsyncWriteExt, DuplexStream};
    use transport_control::admission::{Admit, Counts};
    use transport_control::auth::Role;

    use super::*;

    const LIMITS: Limits =
        Limits { max_connections: 8, max_connections_per_ip: 8, max_handshaking: 8, max_handshaking_per_ip: 8 };

    fn slot(counts: &Arc<Mutex<Counts>>, id: u64) -> Slot {
        let ip: IpAddr = "10.0.0.1".parse().unwrap();
        let mut c = counts.lock();
        assert_eq!(c.admits(&LIMITS, ip), Admit::Yes);
        Slot::handshaking(counts, &mut c, ip, id)
    }

    /// Runs both sides over an in-memory pipe: (client's result, server's).
    async fn pair(client: Option<&str>, server: Option<&str>) -> (Result<()>, std::result::Result<(), Refused>) {
        let (a, b) = tokio::io::duplex(4096);
        let counts = Arc::new(Mutex::new(Counts::default()));
        let mut sl = slot(&counts, 1);
        let (mut a, mut b) = (BufReader::new(a), BufReader::new(b));
        let (c, s) = tokio::join!(
            async move {
                let r = hello(&mut a, client, "peer", None).await;
                // The client closes after a failure, as its callers do.
                drop(a);
                r
            },
            async {
                let r = answer(&mut b, server, &mut sl, &LIMITS).await;
                // The server closes after a refusal, as `serve` does.
                drop(b);
                r
            }
        );
        let served = counts.lock().served;
        assert_eq!(served, usize::from(s.is_ok()), "promoted exactly when the handshake succeeded");
        (c, s)
    }

    #[tokio::test]
    async fn peers_with_the_same_secret_or_none_get_through() {
        let (c, s) = pair(Some("k"), Some("k")).await;
        c.unwrap();
        s.unwrap();
        let (c, s) = pair(None, None).await;
        c.unwrap();
        s.unwrap();
    }

    #[tokio::test]
    async fn a_wrong_or_missing_secret_is_refused_on_both_sides() {
        let (c, s) = pair(Some("wrong"), Some("k")).await;
        assert_eq!(c.unwrap_err().kind(), ErrorKind::AuthFailed);
        assert!(s.unwrap_err().0.contains("authentication failed"));
        let (c, _) = pair(None, Some("k")).await;
        let e = c.unwrap_err();
        assert!(e.kind() == ErrorKind::AuthFailed && e.to_string().contains("none is set here"), "{e}");
        // A client with a secret never talks to a server without one (an
        // impostor on the address could ask for no proof).
        let (c, _) = pair(Some("k"), None).await;
        assert_eq!(c.unwrap_err().kind(), ErrorKind::AuthFailed);
    }

    /// Runs the server's side against raw lines from a client; what the
    /// server answered (lines) and its result.
    async fn raw(lines: &[&str]) -> (String, std::result::Result<(), Refused>) {
        let (a, b): (DuplexStream, DuplexStream) = tokio::io::duplex(1 << 16);
        let counts = Arc::new(Mutex::new(Counts::default()));
        let mut sl = slot(&counts, 1);
        let mut b = BufReader::new(b);
        let mut a = a;
        for l in lines {
            a.write_all(l.as_bytes()).await.unwrap();
        }
        a.shutdown().await.unwrap();
        let r = answer(&mut b, Some("k"), &mut sl, &LIMITS).await;
        drop(b);
        let mut out = String::new();
        tokio::io::AsyncReadExt::read_to_string(&mut a, &mut out).await.unwrap();
        assert_eq!(counts.lock().served, 0, "nothing refused is promoted");
        (out, r)
    }

    /// Issue 49: a version-1 peer (or a stranger) that opens with a
    /// request is answered only that it must handshake: no descriptor, no
    /// QP, no notification.
    #[tokio::test]
    async fn requests_before_the_handshake_get_nothing_but_a_clear_error() {
        let requests = [
            r#"{"op":"describe"}"#,
            r#"{"op":"notify","from":"x","msg":"00"}"#,
            r#"{"op":"stage","write":true,"addr":0,"len":1}"#,
            r#"{"op":"connect","gid":"00000000000000000000000000000000","lid":0,"mtu":5,"qps":[{"qpn":1,"psn":1}]}"#,
        ];
        for req in requests {
            let (out, r) = raw(&[req, "\n"]).await;
            assert!(out.contains("\"result\":\"error\"") && out.contains("version 2"), "{req}: {out}");
            assert!(!out.contains("descriptor") && !out.contains("rkey"), "{req}: {out}");
            assert!(r.is_err());
        }
    }

    #[tokio::test]
    async fn malformed_or_oversized_hellos_are_refused() {
        let long = format!("{}\n", "x".repeat(HELLO_LINE + 1));
        for bad in [
            "not json\n",
            "{\"op\":\"hello\",\"version\":2,\"nonce\":\"zz\"}\n",
            "{\"op\":\"hello\",\"version\":1,\"nonce\":\"00\"}\n",
            long.as_str(),
        ] {
            let (out, r) = raw(&[bad]).await;
            assert!(out.contains("\"result\":\"error\""), "{bad:.40}: {out}");
            assert!(r.is_err());
        }
        // A hello, then a wrong proof: denied.
        let hello = format!("{{\"op\":\"hello\",\"version\":2,\"nonce\":\"{}\"}}\n", "ab".repeat(NONCE_LEN));
        let auth = format!("{{\"op\":\"auth\",\"proof\":\"{}\"}}\n", "00".repeat(32));
        let (out, r) = raw(&[&hello, &auth]).await;
        assert!(out.contains("\"result\":\"challenge\"") && out.contains("\"result\":\"denied\""), "{out}");
        assert!(r.is_err());
    }

    /// A server played by hand over a pipe, with the secret "k": reads the
    /// hello, answers a challenge carrying `proof` (the right one if
    /// `None`), and gives back the client's pipe end, the server's end
    /// and both nonces. The client runs `hello(.., Some(describe))`.
    async fn by_hand(
        proof: Option<&str>,
    ) -> (tokio::task::JoinHandle<Result<()>>, BufReader<DuplexStream>, Vec<u8>, Vec<u8>) {
        let (a, b) = tokio::io::duplex(4096);
        let client = tokio::spawn(async move {
            let mut a = BufReader::new(a);
            let r = hello(&mut a, Some("k"), "peer", Some(&Request::Describe)).await;
            // Held open until the test has read what it needs.
            tokio::time::sleep(std::time::Duration::from_millis(500)).await;
            r
        });
        let mut b = BufReader::new(b);
        let cn = match wire::recv::<_, Request>(&mut b).await.unwrap() {
            Request::Hello { nonce, .. } => unhex(&nonce, NONCE_LEN).unwrap(),
            other => panic!("{other:?}"),
        };
        let sn = auth::nonce();
        let right = hex(&auth::prove(auth::RDMA, b"k", Role::Server, &cn, &sn));
        let proof = proof.map_or(right, str::to_string);
        wire::send(b.get_mut(), &Reply::Challenge { nonce: hex(&sn), auth: true, proof }).await.unwrap();
        (client, b, cn, sn.to_vec())
    }

    /// Issue 49 (the first transfer within one round trip of a bare
    /// request): with the server's proof in the challenge the client sends
    /// its first request right behind its proof, before `ready`.
    #[tokio::test]
    async fn the_first_request_follows_auth_before_ready() {
        let (client, mut b, cn, sn) = by_hand(None).await;
        let limit = std::time::Duration::from_secs(2);
        let auth = tokio::time::timeout(limit, wire::recv::<_, Request>(&mut b)).await.unwrap().unwrap();
        let Request::Auth { proof } = auth else { panic!("{auth:?}") };
        assert!(auth::verify(auth::RDMA, b"k", Role::Client, &cn, &sn, &unhex(&proof, 32).unwrap()));
        let first = tokio::time::timeout(limit, wire::recv::<_, Request>(&mut b)).await;
        assert!(matches!(first, Ok(Ok(Request::Describe))), "the request came behind auth: {first:?}");
        let ours = hex(&auth::prove(auth::RDMA, b"k", Role::Server, &cn, &sn));
        wire::send(b.get_mut(), &Reply::Ready { proof: ours }).await.unwrap();
        client.await.unwrap().unwrap();
    }

    /// A server from before the proof in the challenge: the client sends its
    /// request only once `ready` proved the server.
    #[tokio::test]
    async fn without_a_proof_in_the_challenge_the_request_waits_for_ready() {
        let (client, mut b, cn, sn) = by_hand(Some("")).await;
        let auth = wire::recv::<_, Request>(&mut b).await.unwrap();
        assert!(matches!(auth, Request::Auth { .. }), "{auth:?}");
        let early = tokio::time::timeout(std::time::Duration::from_millis(200), wire::recv::<_, Request>(&mut b)).await;
        assert!(early.is_err(), "nothing before ready: {early:?}");
        let ours = hex(&auth::prove(auth::RDMA, b"k", Role::Server, &cn, &sn));
        wire::send(b.get_mut(), &Reply::Ready { proof: ours }).await.unwrap();
        assert!(matches!(wire::recv::<_, Request>(&mut b).await, Ok(Request::Describe)));
        client.await.unwrap().unwrap();
    }

    /// A wrong proof in the challenge (an impostor, or another secret)
    /// gets no request: the client sends its own proof (a server with
    /// another secret then says why it refuses) and fails.
    #[tokio::test]
    async fn a_wrong_proof_in_the_challenge_gets_no_request() {
        let (client, mut b, _, _) = by_hand(Some(&"00".repeat(32))).await;
        let auth = wire::recv::<_, Request>(&mut b).await.unwrap();
        assert!(matches!(auth, Request::Auth { .. }), "{auth:?}");
        let early = tokio::time::timeout(std::time::Duration::from_millis(200), wire::recv::<_, Request>(&mut b)).await;
        assert!(early.is_err(), "nothing before ready: {early:?}");
        wire::send(b.get_mut(), &Reply::Ready { proof: "00".repeat(32) }).await.unwrap();
        let e = client.await.unwrap().unwrap_err();
        assert_eq!(e.kind(), ErrorKind::AuthFailed, "{e}");
        let mut rest = Vec::new();
        tokio::io::AsyncReadExt::read_to_end(&mut b, &mut rest).await.unwrap();
        assert!(rest.is_empty(), "sent to a server that did not prove the secret: {}", String::from_utf8_lossy(&rest));
    }

    #[test]
    fn hex_round_trips_and_refuses_junk() {
        let b = [0u8, 1, 0xab, 0xff];
        assert_eq!(unhex(&hex(&b), 4).unwrap(), b);
        assert_eq!(unhex("ABff0001", 4).unwrap(), vec![0xab, 0xff, 0, 1]);
        assert!(unhex("abc", 2).is_none());
        assert!(unhex("zz00", 2).is_none());
        assert!(unhex("éé", 2).is_none());
        assert!(unhex("+1", 1).is_none());
    }
}
