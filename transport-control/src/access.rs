//! Where the shared secret comes from, and whom an engine without one
//! answers.
//!
//! The secret is the configuration's (`secret`), else the environment's
//! (`KVMOVE_SECRET`), else the first line of the file `KVMOVE_SECRET_FILE`
//! names ([`resolve_secret`]). An empty secret is a configuration error,
//! never "no secret".
//!
//! **Protected mode** (as Redis runs without a password): an engine with
//! no secret answers control connections only from its own host, that is
//! from a loopback address or from the very address the connection
//! reached ([`Exposure::admits`]); anything else is refused with a reason
//! that says how to open it up. `insecure = true` in a backend's
//! configuration (or `KVMOVE_INSECURE=1` for the Python APIs and
//! connectors) answers every address without a secret, knowingly.

use std::net::IpAddr;

use transport_core::{Error, ErrorKind, Result};

/// The environment variable holding the shared secret.
pub const SECRET_ENV: &str = "KVMOVE_SECRET";
/// The environment variable naming a file whose first line is the secret.
pub const SECRET_FILE_ENV: &str = "KVMOVE_SECRET_FILE";
/// The environment variable that, set to `1`, turns protected mode off
/// where there is no configuration file to say `insecure = true` (the
/// Python APIs and the serving-engine connectors).
pub const INSECURE_ENV: &str = "KVMOVE_INSECURE";

/// The secret to use: `configured` if set, else `$KVMOVE_SECRET`, else the
/// first line of the file `$KVMOVE_SECRET_FILE` (`None` when none is set).
/// An empty secret, or a file that cannot be read, is a `Config` error
/// naming where it came from.
pub fn resolve_secret(configured: Option<&str>) -> Result<Option<String>> {
    resolve_secret_from(configured, |k| std::env::var(k).ok())
}

/// [`resolve_secret`] with the environment given (tests).
pub fn resolve_secret_from(configured: Option<&str>, env: impl Fn(&str) -> Option<String>) -> Result<Option<String>> {
    let empty = |from: &str| {
        Err(Error::new(
            ErrorKind::Config,
            format!("the shared secret from {from} is empty (leave it unset to run without one)"),
        ))
    };
    if let Some(s) = configured {
        return if s.is_empty() { empty("the configuration") } else { Ok(Some(s.to_owned())) };
    }
    if let Some(s) = env(SECRET_ENV) {
        return if s.is_empty() { empty(SECRET_ENV) } else { Ok(Some(s)) };
    }
    let Some(path) = env(SECRET_FILE_ENV) else { return Ok(None) };
    let text = std::fs::read_to_string(&path).map_err(|e| {
        Error::new(ErrorKind::Config, format!("cannot read the secret file {path:?} ({SECRET_FILE_ENV}): {e}"))
    })?;
    match text.lines().next().map(str::trim_end) {
        Some(s) if !s.is_empty() => Ok(Some(s.to_owned())),
        _ => empty(&format!("the file {path:?} ({SECRET_FILE_ENV})")),
    }
}

/// Whether `$KVMOVE_INSECURE` asks for protected mode off (`1`, `true`,
/// `yes`).
pub fn insecure_from_env() -> bool {
    std::env::var(INSECURE_ENV).is_ok_and(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "1" | "true" | "yes"))
}

/// Whom a control channel answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exposure {
    /// A secret is set: anyone who proves it.
    Authenticated,
    /// No secret, `insecure = true`: anyone.
    Insecure,
    /// No secret (protected mode): this host only.
    LocalOnly,
}

impl Exposure {
    /// The exposure of a channel with this secret and `insecure` setting.
    pub fn of(secret: Option<&str>, insecure: bool) -> Self {
        match (secret, insecure) {
            (Some(_), _) => Self::Authenticated,
            (None, true) => Self::Insecure,
            (None, false) => Self::LocalOnly,
        }
    }

    /// Whether a connection from `peer` that reached this engine at
    /// `local` may start its handshake; the reason for the peer when not.
    pub fn admits(self, peer: IpAddr, local: IpAddr) -> std::result::Result<(), &'static str> {
        if self != Self::LocalOnly || same_host(peer, local) {
            return Ok(());
        }
        Err(PROTECTED)
    }
}

/// What a peer refused by protected mode is told (and the log says).
/// At most 256 bytes (what the TCP backend's ERROR frame carries).
pub const PROTECTED: &str = "protected mode: the engine has no shared secret, so it answers only its own host; \
     set the same secret on both ends (secret, KVMOVE_SECRET or KVMOVE_SECRET_FILE) \
     or insecure = true (KVMOVE_INSECURE=1) on it";

/// Whether a connection from `peer` to `local` comes from this host: a
/// loopback address, or the address it reached (the kernel gives a
/// connection between two of a host's own addresses the destination as
/// its source).
pub fn same_host(peer: IpAddr, local: IpAddr) -> bool {
    let (peer, local) = (peer.to_canonical(), local.to_canonical());
    peer.is_loopback() || peer == local
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn the_secret_comes_from_config_then_env_then_file() {
        let dir = std::env::temp_dir().join(format!("kvmove-secret-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("secret");
        std::fs::write(&file, "from-file\nsecond line\n").unwrap();
        let f = file.to_str().unwrap();
        let all = env(&[(SECRET_ENV, "from-env"), (SECRET_FILE_ENV, f)]);
        assert_eq!(resolve_secret_from(Some("from-config"), &all).unwrap().as_deref(), Some("from-config"));
        assert_eq!(resolve_secret_from(None, &all).unwrap().as_deref(), Some("from-env"));
        let only_file = env(&[(SECRET_FILE_ENV, f)]);
        assert_eq!(resolve_secret_from(None, &only_file).unwrap().as_deref(), Some("from-file"));
        assert_eq!(resolve_secret_from(None, env(&[])).unwrap(), None);
        // Empty anywhere, or a missing file: an error naming where.
        let e = resolve_secret_from(Some(""), env(&[])).unwrap_err();
        assert!(e.kind() == ErrorKind::Config && e.to_string().contains("configuration"), "{e}");
        let e = resolve_secret_from(None, env(&[(SECRET_ENV, "")])).unwrap_err();
        assert!(e.to_string().contains(SECRET_ENV), "{e}");
        let missing = dir.join("nope");
        let e = resolve_secret_from(None, env(&[(SECRET_FILE_ENV, missing.to_str().unwrap())])).unwrap_err();
        assert!(e.to_string().contains("cannot read the secret file"), "{e}");
        std::fs::write(&file, "\n").unwrap();
        let e = resolve_secret_from(None, env(&[(SECRET_FILE_ENV, f)])).unwrap_err();
        assert!(e.to_string().contains("empty"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn protected_mode_answers_only_this_host() {
        let here: IpAddr = "10.0.0.5".parse().unwrap();
        let other: IpAddr = "10.0.0.6".parse().unwrap();
        let lo: IpAddr = "127.0.0.1".parse().unwrap();
        let lo6: IpAddr = "::1".parse().unwrap();
        let mapped: IpAddr = "::ffff:10.0.0.5".parse().unwrap();
        let p = Exposure::of(None, false);
        assert_eq!(p, Exposure::LocalOnly);
        assert!(p.admits(lo, lo).is_ok());
        assert!(p.admits(lo6, lo6).is_ok());
        assert!(p.admits(here, here).is_ok(), "from the address it reached: this host");
        assert!(p.admits(mapped, here).is_ok(), "IPv4-mapped is the same address");
        assert_eq!(p.admits(other, here), Err(PROTECTED));
        assert!(PROTECTED.len() <= 256, "fits the TCP backend's ERROR frame");
        for open in [Exposure::of(Some("k"), false), Exposure::of(None, true), Exposure::of(Some("k"), true)] {
            assert!(open.admits(other, here).is_ok(), "{open:?}");
        }
    }
}
