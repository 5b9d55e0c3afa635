//! Issue 49, item 2: protected mode. A TCP engine without a shared secret
//! serves only its own host; a connection from another host (here a
//! network namespace this test makes, with a veth pair: another network
//! stack, as another machine would be) is refused with `AuthFailed` and a
//! reason that says what to set. With the same secret on both ends, or
//! with `insecure` on the server, it is served.
//!
//! Needs root and iproute2 (`ip netns`), as the PD-cluster test does.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failure should panic

mod support;

use std::process::Child;
use std::time::Duration;

use transport_control::testing::Netns;
use transport_core::{Access, BatchState, Buffer, ErrorKind, SubmitOptions, TransferRequest, Transport};
use transport_tcp::{TcpConfig, TcpTransport};

/// `tcp-peer` serving 4 KiB inside the namespace, with `secret` in its
/// environment and protected mode off if `insecure`: the child, its
/// segment name and its region's address.
fn peer_in(ns: &Netns, secret: Option<&str>, insecure: bool) -> (Child, String, u64) {
    let mut cmd = ns.command(env!("CARGO_BIN_EXE_tcp-peer"));
    let listen = format!("{}:0", ns.there());
    cmd.args([listen.as_str(), "4096", "off", if insecure { "insecure" } else { "secure" }]);
    cmd.env_remove("KVMOVE_SECRET").env_remove("KVMOVE_SECRET_FILE");
    if let Some(s) = secret {
        cmd.env("KVMOVE_SECRET", s);
    }
    support::start_peer(cmd)
}

/// Reads the peer's 4 KiB region (the bytes `i % 251`); the error if any.
async fn read_region(secret: Option<&str>, name: &str, addr: u64) -> transport_core::Result<()> {
    let a = TcpTransport::new(TcpConfig { secret: secret.map(Into::into), ..support::test_config() }).await?;
    let result = async {
        let seg = a.open_segment(name).await?;
        let dst = Buffer::new(4096)?;
        let l = a.register(dst.region(), Access::LOCAL)?;
        let b = a.submit(vec![TransferRequest::read(l, 0, seg, addr, 4096)], SubmitOptions::default()).await?;
        let st = a.wait(b).await?;
        a.release(b)?;
        assert_eq!(st.state, BatchState::Completed, "{:?}", st.first_error());
        assert!(dst.to_vec().iter().enumerate().all(|(i, &v)| v == (i % 251) as u8), "the peer's bytes");
        a.close_segment(seg).await
    }
    .await;
    a.shutdown().await?;
    result
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_host_is_refused_without_a_secret_and_served_with_one() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let ns = Netns::new("pm");
        // No secret on either end: refused, and told what to set.
        let (mut peer, name, addr) = peer_in(&ns, None, false);
        let e = read_region(None, &name, addr).await.expect_err("another host is refused in protected mode");
        assert_eq!(e.kind(), ErrorKind::AuthFailed, "{e}");
        assert!(e.to_string().contains("protected mode") && e.to_string().contains("KVMOVE_SECRET"), "{e}");
        drop(peer.stdin.take());
        peer.wait().unwrap();
        // The same secret on both ends: served.
        let (mut peer, name, addr) = peer_in(&ns, Some("pm-secret"), false);
        read_region(Some("pm-secret"), &name, addr).await.expect("served with the secret");
        let e = read_region(Some("wrong"), &name, addr).await.expect_err("a wrong secret is refused");
        assert_eq!(e.kind(), ErrorKind::AuthFailed, "{e}");
        drop(peer.stdin.take());
        peer.wait().unwrap();
        // No secret, protected mode turned off knowingly: served.
        let (mut peer, name, addr) = peer_in(&ns, None, true);
        read_region(None, &name, addr).await.expect("served with insecure = true");
        drop(peer.stdin.take());
        peer.wait().unwrap();
    })
    .await
    .expect("test timed out");
}
