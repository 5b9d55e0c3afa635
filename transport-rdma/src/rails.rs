//! Several devices: [`open_devices`] builds one [`RdmaTransport`] per
//! device of [`RdmaConfig::devices`]. Driving them as one (striping,
//! failover, a fallback) is a layer's work, `transport_rails::Rails`,
//! which the builder that has the other backends composes over them (the
//! `kvmove` facade: `transport_rails::over`). This crate only opens the
//! devices.

use std::sync::Arc;

use transport_core::{Error, ErrorKind, Result, Transport};

use crate::{rdma_devices, RdmaConfig, RdmaTransport};

/// The devices `cfg` names: `devices` (`["all"]` or `["auto"]`: every
/// device with an active port), else `device` alone.
pub fn rail_devices(cfg: &RdmaConfig) -> Result<Vec<Option<String>>> {
    match cfg.devices.as_slice() {
        [] => Ok(vec![cfg.device.clone()]),
        [all] if all == "all" || all == "auto" => {
            let active: Vec<Option<String>> = rdma_devices()?
                .into_iter()
                .filter(|d| {
                    let path = format!("/sys/class/infiniband/{d}/ports/{}/state", cfg.port);
                    std::fs::read_to_string(path).is_ok_and(|s| s.contains("ACTIVE"))
                })
                .map(Some)
                .collect();
            if active.is_empty() {
                let why = format!("rdma.devices = [\"{all}\"]: no device has an active port");
                return Err(Error::new(ErrorKind::Config, why));
            }
            Ok(active)
        }
        list => Ok(list.iter().cloned().map(Some).collect()),
    }
}

/// One [`RdmaTransport`] per device `cfg` names ([`rail_devices`]), in
/// that order: rail 0 listens on `cfg.listen` and names the set, the
/// others listen on the same host, any port. Compose them with
/// `transport_rails::over(rails, fallback, cfg.rails)`. Must be called
/// inside a tokio runtime.
pub async fn open_devices(cfg: RdmaConfig) -> Result<Vec<Arc<dyn Transport>>> {
    cfg.validate()?;
    let devices = rail_devices(&cfg)?;
    let host = match cfg.listen.rsplit_once(':') {
        Some((h, _)) => h.to_string(),
        None => "127.0.0.1".into(),
    };
    let mut rails: Vec<Arc<dyn Transport>> = Vec::with_capacity(devices.len());
    for (i, device) in devices.into_iter().enumerate() {
        let listen = if i == 0 { cfg.listen.clone() } else { format!("{host}:0") };
        let name = device.clone().unwrap_or_else(|| "the first device".into());
        let rail = RdmaConfig { device, devices: Vec::new(), listen, ..cfg.clone() };
        let t = RdmaTransport::new(rail).await.map_err(|e| e.with("rail", i).with("device", name))?;
        rails.push(Arc::new(t));
    }
    Ok(rails)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_are_for_open_and_checked() {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        let cfg = RdmaConfig { devices: vec!["x0".into(), "x1".into()], ..Default::default() };
        let e = rt.block_on(RdmaTransport::new(cfg.clone())).expect_err("one transport, one device");
        assert_eq!(e.kind(), ErrorKind::Config, "{e}");
        assert_eq!(rail_devices(&cfg).expect("a list"), vec![Some("x0".to_string()), Some("x1".to_string())]);
        let one = RdmaConfig { device: Some("x9".into()), ..Default::default() };
        assert_eq!(rail_devices(&one).expect("one"), vec![Some("x9".to_string())]);
        for bad in [
            vec!["all".to_string(), "x0".into()],
            vec!["x0".to_string(), "auto".into()],
            vec![String::new()],
            vec!["d".to_string(); 17],
        ] {
            let c = RdmaConfig { devices: bad, ..Default::default() };
            assert!(c.validate().expect_err("refused").to_string().contains("devices"));
        }
    }
}
