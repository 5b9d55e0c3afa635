//! The handshake every control connection opens with, on both backends
//! (TCP's framed protocol, RDMA's side channel), as two sans-IO machines:
//! [`Server`] and [`Client`] take what the peer sent and say what to
//! answer, or why the handshake ends. Each backend carries the four
//! messages in its own framing (TCP: HELLO, CHALLENGE, AUTH and READY
//! frames; RDMA: JSON lines), counts the connection in its quotas
//! ([`crate::admission`]) and bounds the exchange by its
//! `handshake_timeout_ms`; what is decided is decided here, once.
//!
//! ```text
//! client -> hello      version, client nonce
//! server -> challenge  server nonce, whether a proof is wanted, the server's proof (early)
//! client -> auth       the client's proof (empty without a secret)
//! server -> ready      the server's proof (empty without a secret)
//! ```
//!
//! With a secret both sides prove it ([`crate::auth`]): the server answers
//! nothing past the challenge to a client whose proof fails, and a client
//! with a secret sends nothing past its proof to a server that has not
//! proven it (an impostor listening on the address). A client with a
//! secret refuses a server that asks for none, and a client without one a
//! server that asks for one: both ends of a deployment are configured
//! alike, and a mismatch is an error that says which side lacks what.
//!
//! The server's proof may come early, with the challenge: a client that has
//! checked it (or that has no secret) may send its first request right
//! behind its `auth` ([`Auth::early`]), so the handshake costs one round
//! trip before a request, not two. It gives nothing away: an HMAC in the
//! server's role over the client's nonce and one the server just drew,
//! which proves nothing in any other handshake. The server still reads
//! such a request only after it has checked the client's proof.

use std::fmt;

use transport_core::{Error, ErrorKind};

use crate::auth::{self, Role, NONCE_LEN};

/// Bytes of a proof (HMAC-SHA256).
pub const PROOF_LEN: usize = 32;

/// Why a server ends a handshake; the backend answers it in its framing
/// (its `Display` is the text for the peer) and closes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// The client speaks another version of the protocol.
    Version { theirs: u32, ours: u32 },
    /// A hello or auth that does not parse: which part.
    Malformed(&'static str),
    /// The client's proof of the shared secret is wrong or missing.
    AuthFailed,
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refusal::Version { theirs, ours } => {
                write!(f, "protocol version {theirs}; this peer speaks {ours}: upgrade both ends")
            }
            Refusal::Malformed(what) => write!(f, "malformed handshake: {what}"),
            Refusal::AuthFailed => {
                write!(f, "authentication failed: the proof of the shared secret is wrong or missing")
            }
        }
    }
}

/// The server's answer to a hello.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Challenge {
    /// Whether the server wants the client's proof (it has a secret).
    pub auth: bool,
    /// The server's proof, sent early where the framing carries it; empty
    /// without a secret.
    pub proof: Vec<u8>,
}

/// The server's side of one handshake: made from the client's hello
/// ([`Server::hello`]), it checks the client's proof ([`Server::auth`]).
#[derive(Debug)]
pub struct Server<'a> {
    domain: &'static str,
    secret: Option<&'a [u8]>,
    client: [u8; NONCE_LEN],
    /// Boxed: TCP's same-host path lets a verified local client read it in
    /// this process's memory, at [`Server::nonce`]'s address.
    nonce: Box<[u8; NONCE_LEN]>,
}

impl<'a> Server<'a> {
    /// A hello of version `theirs` carrying `client_nonce`, to a server of
    /// version `ours` on `domain`'s channel (`auth::TCP`, `auth::RDMA`)
    /// with `secret`: the machine, and the challenge to answer; or why the
    /// hello is refused.
    pub fn hello(
        domain: &'static str,
        secret: Option<&'a [u8]>,
        ours: u32,
        theirs: u32,
        client_nonce: &[u8],
    ) -> Result<(Self, Challenge), Refusal> {
        if theirs != ours {
            return Err(Refusal::Version { theirs, ours });
        }
        let client: [u8; NONCE_LEN] = client_nonce.try_into().map_err(|_| Refusal::Malformed("the nonce"))?;
        let s = Server { domain, secret, client, nonce: Box::new(auth::nonce()) };
        let challenge = Challenge { auth: secret.is_some(), proof: s.proof() };
        Ok((s, challenge))
    }

    /// The server's nonce, for the challenge; it stays at this address
    /// while the machine lives.
    pub fn nonce(&self) -> &[u8; NONCE_LEN] {
        &self.nonce
    }

    /// The client's nonce, from its hello.
    pub fn client_nonce(&self) -> &[u8; NONCE_LEN] {
        &self.client
    }

    /// The client's `auth`: with a secret its proof must verify. Returns
    /// the proof to answer with `ready` (empty without a secret).
    pub fn auth(&self, proof: &[u8]) -> Result<Vec<u8>, Refusal> {
        if let Some(k) = self.secret {
            if !auth::verify(self.domain, k, Role::Client, &self.client, &self.nonce[..], proof) {
                return Err(Refusal::AuthFailed);
            }
        }
        Ok(self.proof())
    }

    fn proof(&self) -> Vec<u8> {
        self.secret
            .map(|k| auth::prove(self.domain, k, Role::Server, &self.client, &self.nonce[..]))
            .unwrap_or_default()
    }
}

/// What a client sends in answer to the challenge.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Auth {
    /// Its proof (empty without a secret).
    pub proof: Vec<u8>,
    /// Whether its first request may follow at once: it has no secret, or
    /// the challenge carried the server's proof and it verified. Otherwise
    /// the request waits for `ready` (and its proof).
    pub early: bool,
}

/// The client's side of one handshake: its nonce for the hello
/// ([`Client::nonce`]), its answer to the challenge ([`Client::challenge`]),
/// its check of `ready` ([`Client::ready`]).
#[derive(Debug)]
pub struct Client<'a> {
    domain: &'static str,
    secret: Option<&'a [u8]>,
    /// Boxed, as the server's (TCP's same-host path reads it).
    nonce: Box<[u8; NONCE_LEN]>,
    server: Option<[u8; NONCE_LEN]>,
}

impl<'a> Client<'a> {
    /// A handshake on `domain`'s channel with `secret`, and a fresh nonce.
    pub fn new(domain: &'static str, secret: Option<&'a [u8]>) -> Self {
        Client { domain, secret, nonce: Box::new(auth::nonce()), server: None }
    }

    /// The client's nonce, for the hello; it stays at this address while
    /// the machine lives.
    pub fn nonce(&self) -> &[u8; NONCE_LEN] {
        &self.nonce
    }

    /// The server's challenge: its nonce, whether it wants a proof, and its
    /// early proof (empty if it sent none). Errors are `AuthFailed` when
    /// one side has a secret and the other none, `Protocol` for a nonce
    /// of the wrong length.
    pub fn challenge(&mut self, server_nonce: &[u8], wants_proof: bool, early_proof: &[u8]) -> Result<Auth, Error> {
        let sn: [u8; NONCE_LEN] =
            server_nonce.try_into().map_err(|_| Error::new(ErrorKind::Protocol, "malformed challenge: the nonce"))?;
        self.server = Some(sn);
        let proof = match (self.secret, wants_proof) {
            (Some(k), true) => auth::prove(self.domain, k, Role::Client, &self.nonce[..], &sn),
            (None, true) => {
                return Err(Error::new(
                    ErrorKind::AuthFailed,
                    "the peer requires a shared secret and none is set here (secret, KVMOVE_SECRET)",
                ))
            }
            (Some(_), false) => {
                return Err(Error::new(
                    ErrorKind::AuthFailed,
                    "the peer asks for no shared secret but one is set here: refusing an unauthenticated peer",
                ))
            }
            (None, false) => Vec::new(),
        };
        let early = self.proven(early_proof);
        Ok(Auth { proof, early })
    }

    /// The server's `ready` with its proof: with a secret it must verify
    /// (`AuthFailed` otherwise: nothing more goes to this peer).
    pub fn ready(&self, server_proof: &[u8]) -> Result<(), Error> {
        if self.proven(server_proof) {
            Ok(())
        } else {
            Err(Error::new(ErrorKind::AuthFailed, "the peer did not prove the shared secret"))
        }
    }

    /// Whether `proof` is the server's for this handshake (always, without
    /// a secret; never before the challenge).
    fn proven(&self, proof: &[u8]) -> bool {
        match (self.secret, self.server) {
            (None, _) => true,
            (Some(k), Some(sn)) => auth::verify(self.domain, k, Role::Server, &self.nonce[..], &sn, proof),
            (Some(_), None) => false,
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// A whole handshake between a client and a server with these secrets:
    /// the server's refusal, or the client's error, or whether the first
    /// request went early.
    fn run(client: Option<&[u8]>, server: Option<&[u8]>) -> Result<bool, String> {
        let mut c = Client::new(auth::RDMA, client);
        let (s, ch) = Server::hello(auth::RDMA, server, 2, 2, c.nonce()).map_err(|r| r.to_string())?;
        let a = c.challenge(s.nonce(), ch.auth, &ch.proof).map_err(|e| e.to_string())?;
        let ready = s.auth(&a.proof).map_err(|r| r.to_string())?;
        c.ready(&ready).map_err(|e| e.to_string())?;
        Ok(a.early)
    }

    #[test]
    fn the_same_secret_or_none_gets_through_and_the_first_request_goes_early() {
        assert_eq!(run(Some(b"k"), Some(b"k")), Ok(true));
        assert_eq!(run(None, None), Ok(true));
    }

    #[test]
    fn a_mismatch_is_refused_by_the_side_that_sees_it() {
        let e = run(Some(b"k"), Some(b"other")).unwrap_err();
        assert!(e.contains("authentication failed"), "{e}");
        let e = run(None, Some(b"k")).unwrap_err();
        assert!(e.contains("none is set here"), "{e}");
        let e = run(Some(b"k"), None).unwrap_err();
        assert!(e.contains("asks for no shared secret"), "{e}");
    }

    /// A server from before early proofs (the challenge carries none): the
    /// client with a secret holds its request until `ready` proves the
    /// server, and gets through.
    #[test]
    fn without_an_early_proof_the_request_waits_for_ready() {
        let mut c = Client::new(auth::TCP, Some(b"k"));
        let (s, ch) = Server::hello(auth::TCP, Some(b"k"), 1, 1, c.nonce()).unwrap();
        let a = c.challenge(s.nonce(), ch.auth, &[]).unwrap();
        assert!(!a.early);
        c.ready(&s.auth(&a.proof).unwrap()).unwrap();
    }

    /// An impostor without the secret: its proofs, early or in `ready`,
    /// never verify, and a proof made for another connection (replayed) or
    /// in the client's role (reflected) does not either.
    #[test]
    fn an_impostor_s_proofs_never_verify() {
        let mut c = Client::new(auth::RDMA, Some(b"k"));
        let (s, ch) = Server::hello(auth::RDMA, Some(b"guess"), 2, 2, c.nonce()).unwrap();
        let a = c.challenge(s.nonce(), ch.auth, &ch.proof).unwrap();
        assert!(!a.early);
        assert_eq!(c.ready(&[0; PROOF_LEN]).unwrap_err().kind(), ErrorKind::AuthFailed);
        assert_eq!(c.ready(&[]).unwrap_err().kind(), ErrorKind::AuthFailed);
        assert_eq!(c.ready(&a.proof).unwrap_err().kind(), ErrorKind::AuthFailed, "its own proof reflected");
        let other = Client::new(auth::RDMA, Some(b"k"));
        let (s2, _) = Server::hello(auth::RDMA, Some(b"k"), 2, 2, other.nonce()).unwrap();
        assert_eq!(c.ready(&s2.proof()).unwrap_err().kind(), ErrorKind::AuthFailed, "another connection's proof");
        let (s3, _) = Server::hello(auth::RDMA, Some(b"k"), 2, 2, c.nonce()).unwrap();
        assert_eq!(c.ready(&s3.proof()).unwrap_err().kind(), ErrorKind::AuthFailed, "another server nonce");
    }

    #[test]
    fn the_server_refuses_versions_nonces_and_proofs_that_do_not_fit() {
        let r = Server::hello(auth::TCP, None, 2, 1, &[0; NONCE_LEN]).unwrap_err();
        assert_eq!(r, Refusal::Version { theirs: 1, ours: 2 });
        assert!(r.to_string().contains("upgrade both ends"));
        let r = Server::hello(auth::TCP, None, 2, 2, &[0; NONCE_LEN - 1]).unwrap_err();
        assert_eq!(r, Refusal::Malformed("the nonce"));
        let (s, ch) = Server::hello(auth::TCP, Some(b"k"), 2, 2, &[7; NONCE_LEN]).unwrap();
        assert!(ch.auth && ch.proof.len() == PROOF_LEN);
        for bad in [&[][..], &[0; PROOF_LEN][..], &[0; 3 * PROOF_LEN][..]] {
            assert_eq!(s.auth(bad), Err(Refusal::AuthFailed));
        }
        let right = auth::prove(auth::TCP, b"k", Role::Client, &[7; NONCE_LEN], s.nonce());
        assert_eq!(s.auth(&right).unwrap(), ch.proof);
        assert_ne!(s.auth(&right).unwrap(), right, "the server's proof is not the client's");
        // Without a secret anything passes as a proof and none is answered.
        let (s, ch) = Server::hello(auth::TCP, None, 2, 2, &[7; NONCE_LEN]).unwrap();
        assert!(!ch.auth && ch.proof.is_empty());
        assert_eq!(s.auth(b"junk"), Ok(Vec::new()));
    }

    #[test]
    fn a_proof_for_one_backend_is_no_proof_on_the_other() {
        let mut c = Client::new(auth::TCP, Some(b"k"));
        let (s, ch) = Server::hello(auth::RDMA, Some(b"k"), 2, 2, c.nonce()).unwrap();
        let a = c.challenge(s.nonce(), ch.auth, &ch.proof).unwrap();
        assert!(!a.early);
        assert_eq!(s.auth(&a.proof), Err(Refusal::AuthFailed));
    }

    #[test]
    fn a_challenge_with_a_short_nonce_is_a_protocol_error() {
        let mut c = Client::new(auth::RDMA, None);
        assert_eq!(c.challenge(&[1; 5], false, &[]).unwrap_err().kind(), ErrorKind::Protocol);
    }

    #[test]
    fn nonces_are_fresh_and_stay_where_they_are() {
        let c = Client::new(auth::RDMA, None);
        let at = c.nonce().as_ptr();
        let moved = c;
        assert_eq!(moved.nonce().as_ptr(), at);
        assert_ne!(moved.nonce(), Client::new(auth::RDMA, None).nonce());
        let (s, _) = Server::hello(auth::RDMA, None, 2, 2, moved.nonce()).unwrap();
        assert_eq!(s.client_nonce(), moved.nonce());
        assert_ne!(s.nonce(), moved.nonce());
    }
}
