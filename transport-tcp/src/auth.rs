//! Shared-secret challenge-response (HMAC-SHA256 over both nonces).
//!
//! The client sends a fresh nonce in HELLO, the server a fresh nonce in
//! CHALLENGE. The client proves the secret with
//! `HMAC(secret, "kvmove-tcp/1 client" | client_nonce | server_nonce)`, the
//! server answers with the same over `"... server"`, so each side knows the
//! other holds the secret and neither proof can be replayed on another
//! connection (both nonces are fresh). Proofs are compared in constant time.

use hmac::{Hmac, Mac};
use rand::RngCore;
use sha2::Sha256;

use crate::proto::NONCE_LEN;

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

fn mac(secret: &[u8], role: Role, client: &[u8], server: &[u8]) -> Option<HmacSha256> {
    let mut m = HmacSha256::new_from_slice(secret).ok()?;
    m.update(match role {
        Role::Client => b"kvmove-tcp/1 client",
        Role::Server => b"kvmove-tcp/1 server",
    });
    m.update(client);
    m.update(server);
    Some(m)
}

/// The proof `role` sends for this pair of nonces.
pub fn prove(secret: &[u8], role: Role, client: &[u8], server: &[u8]) -> Vec<u8> {
    mac(secret, role, client, server).map(|m| m.finalize().into_bytes().to_vec()).unwrap_or_default()
}

/// Whether `proof` is `role`'s proof for these nonces (constant time).
pub fn verify(secret: &[u8], role: Role, client: &[u8], server: &[u8], proof: &[u8]) -> bool {
    match mac(secret, role, client, server) {
        Some(m) => m.verify_slice(proof).is_ok(),
        None => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proofs_verify_only_with_the_secret_role_and_nonces() {
        let (c, s) = (nonce(), nonce());
        let p = prove(b"k", Role::Client, &c, &s);
        assert!(verify(b"k", Role::Client, &c, &s, &p));
        assert!(!verify(b"other", Role::Client, &c, &s, &p));
        assert!(!verify(b"k", Role::Server, &c, &s, &p));
        assert!(!verify(b"k", Role::Client, &s, &c, &p));
        assert!(!verify(b"k", Role::Client, &c, &s, &[]));
    }
}
