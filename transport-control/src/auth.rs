//! Shared-secret challenge-response (HMAC-SHA256 over both nonces).
//!
//! The client sends a fresh nonce in its HELLO, the server a fresh nonce in
//! its CHALLENGE. The client proves the secret with
//! `HMAC(secret, DOMAIN " client" | client_nonce | server_nonce)`, the
//! server answers with the same over `DOMAIN " server"`, so each side knows
//! the other holds the secret and neither proof can be replayed on another
//! connection (both nonces are fresh). `DOMAIN` names the protocol
//! ([`TCP`], [`RDMA`]), so a proof made for one backend's channel is no
//! proof on the other's. Proofs are compared in constant time.

use hmac::{Hmac, Mac};
use rand::RngCore;
use sha2::Sha256;

/// Bytes of each side's nonce.
pub const NONCE_LEN: usize = 32;

/// The TCP backend's protocol, version 1.
pub const TCP: &str = "kvmove-tcp/1";
/// The RDMA backend's side channel, version 2 (the first with a handshake).
pub const RDMA: &str = "kvmove-rdma/2";

type HmacSha256 = Hmac<Sha256>;

/// Which side a proof comes from (part of the MAC input, so a server proof
/// cannot be reflected as a client proof).
#[derive(Debug, Clone, Copy)]
pub enum Role {
    Client,
    Server,
}

/// A fresh random nonce.
pub fn nonce() -> [u8; NONCE_LEN] {
    let mut n = [0u8; NONCE_LEN];
    rand::thread_rng().fill_bytes(&mut n);
    n
}

fn mac(domain: &str, secret: &[u8], role: Role, client: &[u8], server: &[u8]) -> Option<HmacSha256> {
    let mut m = HmacSha256::new_from_slice(secret).ok()?;
    m.update(domain.as_bytes());
    m.update(match role {
        Role::Client => b" client",
        Role::Server => b" server",
    });
    m.update(client);
    m.update(server);
    Some(m)
}

/// The proof `role` sends for this pair of nonces on `domain`'s channel.
pub fn prove(domain: &str, secret: &[u8], role: Role, client: &[u8], server: &[u8]) -> Vec<u8> {
    mac(domain, secret, role, client, server).map(|m| m.finalize().into_bytes().to_vec()).unwrap_or_default()
}

/// Whether `proof` is `role`'s proof for these nonces on `domain`'s
/// channel (constant time).
pub fn verify(domain: &str, secret: &[u8], role: Role, client: &[u8], server: &[u8], proof: &[u8]) -> bool {
    match mac(domain, secret, role, client, server) {
        Some(m) => m.verify_slice(proof).is_ok(),
        None => false,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn proofs_verify_only_with_the_secret_role_and_nonces() {
        let (c, s) = (nonce(), nonce());
        let p = prove(TCP, b"k", Role::Client, &c, &s);
        assert!(verify(TCP, b"k", Role::Client, &c, &s, &p));
        assert!(!verify(TCP, b"other", Role::Client, &c, &s, &p));
        assert!(!verify(TCP, b"k", Role::Server, &c, &s, &p));
        assert!(!verify(TCP, b"k", Role::Client, &s, &c, &p));
        assert!(!verify(TCP, b"k", Role::Client, &c, &s, &[]));
        assert!(!verify(RDMA, b"k", Role::Client, &c, &s, &p), "a TCP proof is no RDMA proof");
    }

    /// The TCP backend's proofs are unchanged by the move to this crate
    /// (peers of the same protocol version keep talking): the MAC input is
    /// still `"kvmove-tcp/1 client" | client nonce | server nonce`.
    #[test]
    fn the_tcp_domain_is_what_it_was() {
        let (c, s) = ([1u8; NONCE_LEN], [2u8; NONCE_LEN]);
        let mut m = HmacSha256::new_from_slice(b"k").unwrap();
        m.update(b"kvmove-tcp/1 client");
        m.update(&c);
        m.update(&s);
        assert_eq!(prove(TCP, b"k", Role::Client, &c, &s), m.finalize().into_bytes().to_vec());
    }
}
