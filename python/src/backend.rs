//! Choosing and building the backend from the `initialize` arguments.

use std::sync::Arc;

use kvmove_policy::WaitConfig;
use transport_core::{Error, ErrorKind, Result, Transport};

pub(crate) mod metadata;

/// Environment variable that overrides the protocol `initialize` asks for
/// (`tcp` or `rdma`): lets an unmodified caller that hard-codes `"rdma"`
/// (SGLang does) run over TCP on a machine without RDMA.
pub(crate) const PROTOCOL_ENV: &str = "KVMOVE_PROTOCOL";
/// Overrides `policy.wait.spin_us` (see [`wait_from_env`]).
pub(crate) const SPIN_ENV: &str = "KVMOVE_SPIN_US";

/// Mooncake's own switch to use TCP whatever `initialize` asks for
/// (`MC_FORCE_TCP=1`); honoured when `KVMOVE_PROTOCOL` is not set.
pub(crate) const FORCE_TCP_ENV: &str = "MC_FORCE_TCP";

/// Whether a value of `MC_FORCE_TCP` forces TCP: any value but empty,
/// `0`, `false`, `no`, `off` (Mooncake forces TCP whenever it is set).
pub(crate) fn force_tcp(value: Option<&str>) -> bool {
    value.is_some_and(|v| !matches!(v.trim().to_ascii_lowercase().as_str(), "" | "0" | "false" | "no" | "off"))
}

/// What the caller asked for, parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct BackendOptions {
    /// `tcp` or `rdma`.
    pub(crate) protocol: String,
    /// Host (name or IP) to listen on and to advertise.
    pub(crate) host: String,
    /// Port to listen on; 0 picks a free one (see `get_rpc_port`).
    pub(crate) port: u16,
    /// RDMA device name (`mlx5_0`); empty picks the first. Mooncake accepts a
    /// comma-separated filter: the first name is used.
    pub(crate) device: String,
}

impl BackendOptions {
    /// Parses Mooncake's `initialize` arguments, and the metadata server
    /// they name (`None`: peer-to-peer). `local_hostname` may be `host` or
    /// `host:port` (IPv6 as `[addr]:port`). With `P2PHANDSHAKE` (or `p2p`,
    /// or empty) the engine listens there and its segment name is the
    /// address; with a metadata server (`http://...`, `etcd://host:port`,
    /// bare `host:port`) `local_hostname` is a name, and the engine listens
    /// where [`metadata::listen_address`] says. `redis://` and other
    /// stores are refused with an `Unsupported` error, malformed ones with
    /// a `Config` error.
    pub(crate) fn from_mooncake(
        local_hostname: &str,
        metadata_server: &str,
        protocol: &str,
        device_name: &str,
    ) -> Result<(Self, Option<metadata::Server>)> {
        let meta = metadata::Server::parse(metadata_server)?;
        let protocol = protocol_from_env()
            .or_else(|| force_tcp(std::env::var(FORCE_TCP_ENV).ok().as_deref()).then(|| "tcp".to_owned()))
            .unwrap_or_else(|| protocol.to_owned());
        let protocol = protocol.trim().to_ascii_lowercase();
        if !matches!(protocol.as_str(), "tcp" | "rdma") {
            return Err(Error::new(ErrorKind::Unsupported, "unknown protocol; use \"tcp\" or \"rdma\"")
                .with("protocol", protocol));
        }
        let (host, port) = match &meta {
            None => split_host_port(local_hostname)?,
            Some(_) => metadata::listen_address(local_hostname)?,
        };
        // Every NIC named ("mlx5_0,mlx5_1"): several become rails.
        let device = device_name.split(',').map(str::trim).filter(|d| !d.is_empty()).collect::<Vec<_>>().join(",");
        Ok((Self { protocol, host, port, device }, meta))
    }

    /// `host:port` to listen on.
    pub(crate) fn listen_addr(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }
}

/// `s` as its host and port text: `host`, `host:port`, `[v6]` or
/// `[v6]:port`. A bare IPv6 address (no brackets, two colons or more) is
/// the host, whole, with the third value set. The error says what is
/// wrong.
pub(crate) fn split_authority(s: &str) -> std::result::Result<(&str, Option<&str>, bool), &'static str> {
    if let Some(rest) = s.strip_prefix('[') {
        let (h, after) = rest.split_once(']').ok_or("unclosed '['")?;
        return match after.strip_prefix(':') {
            Some(p) => Ok((h, Some(p), false)),
            None if after.is_empty() => Ok((h, None, false)),
            None => Err("junk after ']'"),
        };
    }
    Ok(match s.rsplit_once(':') {
        Some((h, _)) if h.contains(':') => (s, None, true),
        Some((h, p)) => (h, Some(p), false),
        None => (s, None, false),
    })
}

/// Splits `host`, `host:port`, `[v6]` or `[v6]:port` (or a bare IPv6
/// address); no port is 0.
pub(crate) fn split_host_port(s: &str) -> Result<(String, u16)> {
    let s = s.trim();
    let bad = |why: &str| Error::new(ErrorKind::Config, format!("local_hostname: {why}")).with("value", s);
    if s.is_empty() {
        return Err(bad("empty host name"));
    }
    let (host, port, _) = split_authority(s).map_err(bad)?;
    if host.is_empty() {
        return Err(bad("empty host name"));
    }
    let port = match port {
        Some(p) => p.parse::<u16>().map_err(|_| bad("port is not a number in 0..=65535"))?,
        None => 0,
    };
    Ok((host.to_owned(), port))
}

/// Who a control channel of the Python package itself answers (the NIXL
/// API's metadata listener): the shared secret from the environment
/// (`KVMOVE_SECRET`, else the file `KVMOVE_SECRET_FILE` names), and
/// whether protected mode is off without one (`KVMOVE_INSECURE=1`), read
/// as the engines read them. An empty secret is a `Config` error.
#[pyo3::pyfunction]
pub(crate) fn control_access(py: pyo3::Python<'_>) -> pyo3::PyResult<(Option<String>, bool)> {
    let secret = transport_control::access::resolve_secret(None).map_err(|e| crate::errors::to_pyerr(py, &e))?;
    Ok((secret, transport_control::access::insecure_from_env()))
}

/// Environment variable naming a kvmove TOML config file (the facade's
/// `EngineConfig`: backend options, policy) used as the base of every
/// Mooncake-style engine; `initialize`'s arguments override its backend
/// kind and listen address.
pub(crate) const CONFIG_ENV: &str = "KVMOVE_CONFIG";

/// The engine configuration: `base` (TOML text of a `kvmove::EngineConfig`,
/// or the defaults), with the backend kind and listen address (and RDMA
/// device) replaced by `opts` where given. Goes through the facade's own
/// parser, so unknown keys and bad values are `Config` errors that name the
/// key.
pub(crate) fn engine_config(opts: Option<&BackendOptions>, base: Option<&str>) -> Result<kvmove::EngineConfig> {
    let mut table: toml::Table = match base {
        Some(text) => text
            .parse()
            .map_err(|e: toml::de::Error| Error::new(ErrorKind::Config, format!("config: {}", e.message().trim())))?,
        None => toml::Table::new(),
    };
    if let Some(o) = opts {
        let backend = sub_table(&mut table, "backend")?;
        backend.insert("kind".into(), toml::Value::String(o.protocol.clone()));
        let options = sub_table(backend, &o.protocol)?;
        options.insert("listen".into(), toml::Value::String(o.listen_addr()));
        if o.protocol == "rdma" && !o.device.is_empty() {
            // Mooncake's `device_name` may list several NICs ("mlx5_0,mlx5_1"):
            // each becomes a rail.
            let names: Vec<&str> = o.device.split(',').map(str::trim).filter(|d| !d.is_empty()).collect();
            if names.len() > 1 {
                let list = names.iter().map(|d| toml::Value::String((*d).to_owned())).collect();
                options.insert("devices".into(), toml::Value::Array(list));
            } else {
                options.insert("device".into(), toml::Value::String(o.device.trim().to_owned()));
            }
        }
    }
    let text = toml::to_string(&table).map_err(|e| Error::new(ErrorKind::Config, format!("config: {e}")))?;
    kvmove::EngineConfig::from_toml_named(&text, "kvmove config")
}

/// The backend kind a config's text names (`[backend] kind`), if it names
/// one; a config that does not parse is left to [`engine_config`], which
/// says what is wrong.
pub(crate) fn config_kind(base: Option<&str>) -> Option<String> {
    let table: toml::Table = base?.parse().ok()?;
    table.get("backend")?.get("kind")?.as_str().map(|k| k.trim().to_ascii_lowercase())
}

fn sub_table<'a>(t: &'a mut toml::Table, key: &str) -> Result<&'a mut toml::Table> {
    t.entry(key.to_owned())
        .or_insert_with(|| toml::Value::Table(toml::Table::new()))
        .as_table_mut()
        .ok_or_else(|| Error::new(ErrorKind::Config, format!("config: `{key}` must be a table")))
}

/// The base config of Mooncake-style engines: the file named by
/// `KVMOVE_CONFIG`, if set.
pub(crate) fn base_config_from_env() -> Result<Option<String>> {
    match std::env::var(CONFIG_ENV) {
        Ok(path) if !path.trim().is_empty() => {
            std::fs::read_to_string(&path).map(Some).map_err(|e| Error::from(e).with("config", path))
        }
        _ => Ok(None),
    }
}

/// Environment variable with a policy (JSON, the keys of the Rust
/// `PolicyConfig`) in place of the config's.
pub(crate) const POLICY_ENV: &str = "KVMOVE_POLICY";

/// The policy in `KVMOVE_POLICY`, if set; JSON that does not parse, or a
/// policy out of bounds, is a `Config` error that names the variable.
pub(crate) fn policy_from_env() -> Result<Option<kvmove_policy::PolicyConfig>> {
    match std::env::var(POLICY_ENV) {
        Ok(s) if !s.trim().is_empty() => {
            crate::native::parse_policy(&s).map(Some).map_err(|e| e.with("from", POLICY_ENV))
        }
        _ => Ok(None),
    }
}

/// The protocol `KVMOVE_PROTOCOL` names (lower case), if set and not empty.
pub(crate) fn protocol_from_env() -> Option<String> {
    std::env::var(PROTOCOL_ENV).ok().map(|p| p.trim().to_ascii_lowercase()).filter(|p| !p.is_empty())
}

/// `policy.wait` with `KVMOVE_SPIN_US` (microseconds, 0 to
/// [`WaitConfig::MAX_SPIN_US`]) in place of its `spin_us`, if set: the
/// Python APIs have no config file to say it in. A value that is not such
/// a number is refused (the engine does not start).
pub(crate) fn wait_from_env(wait: &WaitConfig) -> Result<WaitConfig> {
    let mut wait = wait.clone();
    let Ok(v) = std::env::var(SPIN_ENV) else { return Ok(wait) };
    match v.trim().parse::<u64>() {
        Ok(us) if us <= WaitConfig::MAX_SPIN_US => {
            wait.spin_us = us;
            Ok(wait)
        }
        _ => Err(Error::new(
            ErrorKind::Config,
            format!("{SPIN_ENV}={v:?}: expected a number of microseconds from 0 to {}", WaitConfig::MAX_SPIN_US),
        )),
    }
}

/// Builds the backend the config names, through the facade's one builder
/// (`kvmove::build_transport`). Must run inside the engine's tokio runtime.
///
/// # Errors
/// - Whatever the facade returns; asking for RDMA from a build without it
///   is `Unsupported`, and the message says how to run over TCP instead.
pub(crate) async fn build(cfg: &kvmove::EngineConfig) -> Result<Arc<dyn Transport>> {
    if cfg.backend.kind == kvmove::BackendKind::Rdma && !has_rdma() {
        return Err(Error::new(
            ErrorKind::Unsupported,
            format!(
                "this build of kvmove has no RDMA backend (rebuild with the `rdma` feature); \
                 set {PROTOCOL_ENV}=tcp (or {FORCE_TCP_ENV}=1) to run over TCP"
            ),
        ));
    }
    // `KVMOVE_INSECURE=1`: protected mode off for engines without a
    // secret (Python has no config file to say `insecure = true` in).
    let mut cfg = cfg.clone();
    if transport_control::access::insecure_from_env() {
        cfg.backend.tcp.insecure = true;
        #[cfg(feature = "rdma")]
        {
            cfg.backend.rdma.insecure = true;
        }
    }
    kvmove::build_transport(&cfg).await
}

/// Whether this build can run the RDMA backend (the `rdma` feature, which
/// turns on the facade's).
pub(crate) fn has_rdma() -> bool {
    kvmove::BackendKind::Rdma.is_built_in()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_forms() {
        assert_eq!(split_host_port("10.0.0.1").unwrap(), ("10.0.0.1".into(), 0));
        assert_eq!(split_host_port("10.0.0.1:17000").unwrap(), ("10.0.0.1".into(), 17000));
        assert_eq!(split_host_port("localhost:0").unwrap(), ("localhost".into(), 0));
        assert_eq!(split_host_port("[::1]:80").unwrap(), ("::1".into(), 80));
        assert_eq!(split_host_port("::1").unwrap(), ("::1".into(), 0));
        assert!(split_host_port("").is_err());
        assert!(split_host_port("h:99999").is_err());
        assert!(split_host_port("h:x").is_err());
        assert!(split_host_port(":80").is_err());
    }

    #[test]
    fn force_tcp_values() {
        for v in ["1", "true", "TRUE", "yes", "on"] {
            assert!(force_tcp(Some(v)), "{v}");
        }
        for v in [None, Some(""), Some("0"), Some("false"), Some("No"), Some("off")] {
            assert!(!force_tcp(v), "{v:?}");
        }
    }

    #[test]
    fn metadata_servers() {
        let (o, meta) = BackendOptions::from_mooncake("h:7", "P2PHANDSHAKE", "tcp", "").unwrap();
        assert_eq!((o.host.as_str(), o.port, meta), ("h", 7, None));
        // A name: listened on at a free port of its address.
        let (o, meta) = BackendOptions::from_mooncake("127.0.0.1:12345", "etcd://127.0.0.1:2379", "tcp", "").unwrap();
        assert_eq!((o.host.as_str(), o.port), ("127.0.0.1", 0));
        assert!(matches!(meta, Some(metadata::Server::Etcd(_))));
        let (_, meta) = BackendOptions::from_mooncake("127.0.0.1", "http://127.0.0.1:8080/m", "tcp", "").unwrap();
        assert!(matches!(meta, Some(metadata::Server::Http(_))));
        let e = BackendOptions::from_mooncake("h", "redis://127.0.0.1:6379", "tcp", "").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unsupported);
        assert!(e.to_string().contains("redis"), "{e}");
        let e = BackendOptions::from_mooncake("h", "http://:8080/m", "tcp", "").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
        let (o, _) = BackendOptions::from_mooncake("h:5", "P2PHANDSHAKE", "rdma", "mlx5_1, mlx5_2").unwrap();
        assert_eq!(o.device, "mlx5_1,mlx5_2");
        let cfg = engine_config(Some(&o), None).unwrap();
        let text = cfg.to_toml().unwrap();
        assert!(text.contains("devices = [\"mlx5_1\", \"mlx5_2\"]"), "{text}");
        assert_eq!(o.listen_addr(), "h:5");
        assert!(BackendOptions::from_mooncake("h", "P2PHANDSHAKE", "ib", "").is_err());
    }

    #[test]
    fn config_overrides_listen_and_keeps_the_rest() {
        let (o, _) = BackendOptions::from_mooncake("127.0.0.1:7000", "P2PHANDSHAKE", "tcp", "").unwrap();
        let base = "[backend.tcp]\nlanes = 2\n[policy.retry]\nmax_attempts = 1\n";
        let cfg = engine_config(Some(&o), Some(base)).unwrap();
        assert_eq!(cfg.backend.kind, kvmove::BackendKind::Tcp);
        assert_eq!(cfg.backend.tcp.listen, "127.0.0.1:7000");
        assert_eq!(cfg.backend.tcp.lanes, 2);
        assert_eq!(cfg.policy.retry.max_attempts, 1);
        let e = engine_config(None, Some("[backend.tcp]\nlane = 2\n")).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
        assert!(e.to_string().contains("lane"), "{e}");
    }
}
