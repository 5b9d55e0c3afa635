//! Test fixtures for protected mode ([`crate::access`]), behind the
//! `testing` feature (a dev-dependency of the backends' tests, never part
//! of a build that ships): another host, as a network namespace joined to
//! this one by a veth pair, so a connection arrives from an address that
//! is not this host's. Unlike the rest of the crate this runs commands
//! (`ip`, from iproute2) and needs root.
#![allow(clippy::expect_used)] // a fixture that cannot be built fails the test that asked for it

use std::process::Command;

/// A network namespace joined to this one by a veth pair: this side is
/// [`Netns::here`] (`10.214.N.1`), the namespace [`Netns::there`]
/// (`10.214.N.2`). Removed, with the pair, on drop.
#[derive(Debug)]
pub struct Netns {
    name: String,
    net: String,
}

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("run `ip` (iproute2)");
    assert!(out.status.success(), "ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr));
}

impl Netns {
    /// A new namespace; `tag` (a few letters) keeps names apart between
    /// the tests of one process.
    pub fn new(tag: &str) -> Self {
        let pid = std::process::id();
        let name = format!("kvmove-{tag}-{pid}");
        let net = format!("10.214.{}", pid % 250 + 1);
        let (host, inner) = (format!("kvh{tag}{}", pid % 100_000), format!("kvn{tag}{}", pid % 100_000));
        let _ = Command::new("ip").args(["netns", "del", &name]).output();
        ip(&["netns", "add", &name]);
        let ns = Self { name, net };
        ip(&["link", "add", &host, "type", "veth", "peer", "name", &inner]);
        ip(&["link", "set", &inner, "netns", &ns.name]);
        ip(&["addr", "add", &format!("{}/30", ns.here()), "dev", &host]);
        ip(&["link", "set", &host, "up"]);
        ip(&["-n", &ns.name, "addr", "add", &format!("{}/30", ns.there()), "dev", &inner]);
        ip(&["-n", &ns.name, "link", "set", &inner, "up"]);
        ip(&["-n", &ns.name, "link", "set", "lo", "up"]);
        ns
    }

    /// This side's address (this host, as the namespace sees it).
    pub fn here(&self) -> String {
        format!("{}.1", self.net)
    }

    /// The namespace's address (the other host).
    pub fn there(&self) -> String {
        format!("{}.2", self.net)
    }

    /// A command that runs `program` inside the namespace.
    pub fn command(&self, program: &str) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.name, program]);
        cmd
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        // Deleting the namespace deletes its end of the pair, and so the pair.
        let _ = Command::new("ip").args(["netns", "del", &self.name]).output();
    }
}
