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

use std::process::{Child, Command};
use std::time::Duration;

use transport_core::{Access, BatchState, Buffer, ErrorKind, SubmitOptions, TransferRequest, Transport};
use transport_tcp::{TcpConfig, TcpTransport};

/// A network namespace joined to this one by a veth pair: this side is
/// `10.214.N.1`, the namespace's `10.214.N.2`. Removed on drop.
struct Netns {
    name: String,
    net: String,
}

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("run `ip` (iproute2)");
    assert!(out.status.success(), "ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr));
}

impl Netns {
    fn new(tag: &str) -> Self {
        let pid = std::process::id();
        let name = format!("kvmove-{tag}-{pid}");
        let net = format!("10.214.{}", pid % 250 + 1);
        let (host, inner) = (format!("kvh{tag}{}", pid % 100_000), format!("kvn{tag}{}", pid % 100_000));
        let _ = Command::new("ip").args(["netns", "del", &name]).output();
        ip(&["netns", "add", &name]);
        let ns = Self { name, net };
        ip(&["link", "add", &host, "type", "veth", "peer", "name", &inner]);
        ip(&["link", "set", &inner, "netns", &ns.name]);
        ip(&["addr", "add", &format!("{}.1/30", ns.net), "dev", &host]);
        ip(&["link", "set", &host, "up"]);
        ip(&["-n", &ns.name, "addr", "add", &format!("{}.2/30", ns.net), "dev", &inner]);
        ip(&["-n", &ns.name, "link", "set", &inner, "up"]);
        ip(&["-n", &ns.name, "link", "set", "lo", "up"]);
        ns
    }

    /// `tcp-peer` serving 4 KiB inside the namespace, with `secret` in its
    /// environment and protected mode off if `insecure`: the child, its
    /// segment name and its region's address.
    fn peer(&self, secret: Option<&str>, insecure: bool) -> (Child, String, u64) {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.name, env!("CARGO_BIN_EXE_tcp-peer")]);
        let listen = format!("{}.2:0", self.net);
        cmd.args([listen.as_str(), "4096", "off", if insecure { "insecure" } else { "secure" }]);
        cmd.env_remove("KVMOVE_SECRET").env_remove("KVMOVE_SECRET_FILE");
        if let Some(s) = secret {
            cmd.env("KVMOVE_SECRET", s);
        }
        support::start_peer(cmd)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        // Deleting the namespace deletes its end of the pair, and so the pair.
        let _ = Command::new("ip").args(["netns", "del", &self.name]).output();
    }
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
        let (mut peer, name, addr) = ns.peer(None, false);
        let e = read_region(None, &name, addr).await.expect_err("another host is refused in protected mode");
        assert_eq!(e.kind(), ErrorKind::AuthFailed, "{e}");
        assert!(e.to_string().contains("protected mode") && e.to_string().contains("KVMOVE_SECRET"), "{e}");
        drop(peer.stdin.take());
        peer.wait().unwrap();
        // The same secret on both ends: served.
        let (mut peer, name, addr) = ns.peer(Some("pm-secret"), false);
        read_region(Some("pm-secret"), &name, addr).await.expect("served with the secret");
        let e = read_region(Some("wrong"), &name, addr).await.expect_err("a wrong secret is refused");
        assert_eq!(e.kind(), ErrorKind::AuthFailed, "{e}");
        drop(peer.stdin.take());
        peer.wait().unwrap();
        // No secret, protected mode turned off knowingly: served.
        let (mut peer, name, addr) = ns.peer(None, true);
        read_region(None, &name, addr).await.expect("served with insecure = true");
        drop(peer.stdin.take());
        peer.wait().unwrap();
    })
    .await
    .expect("test timed out");
}
