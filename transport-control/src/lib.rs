//! The control plane the backends share (TCP's framed protocol and RDMA's
//! side channel): the handshake every control connection opens with
//! ([`handshake`]), how a peer proves it holds the shared secret
//! ([`auth`]), who may connect while nobody has proven anything yet
//! ([`admission`]), where the secret comes from and whom an engine
//! without one answers ([`access`]), and the secret itself, never printed
//! ([`Secret`]).
//!
//! Sans-IO: nothing here opens a socket or reads a clock; the backends'
//! servers ask and act. `docs/THREAT_MODEL.md` says what each piece keeps
//! out.

pub mod access;
pub mod admission;
pub mod auth;
pub mod handshake;
mod secret;
#[cfg(feature = "testing")]
pub mod testing;

pub use secret::Secret;
