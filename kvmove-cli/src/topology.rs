//! `kvmove topology`: where each RDMA device and GPU sits, and which
//! devices `backend.rdma.devices = ["auto"]` gives each GPU's memory and
//! each NUMA node's host memory. Reads sysfs (`--sysfs`, default `/sys`),
//! or a fabricated tree of a known layout (`--fabricate`).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use kvmove::topology::{self, distance, fabricate, nearest, Place, Sysfs};
use kvmove::{Error, ErrorKind, Result};
use serde::Serialize;

use crate::args::{Layout, TopologyArgs};
use crate::commands::Outcome;

#[derive(Debug, Serialize)]
struct Report {
    sysfs: String,
    devices: Vec<Device>,
    gpus: Vec<Memory>,
    nodes: Vec<Memory>,
}

#[derive(Debug, Serialize)]
struct Device {
    name: String,
    place: Place,
}

/// A kind of memory and the devices nearest it.
#[derive(Debug, Serialize)]
struct Memory {
    memory: String,
    place: Place,
    devices: Vec<String>,
    distance: Option<topology::Distance>,
}

pub fn run(args: &TopologyArgs, json: bool) -> Result<Outcome> {
    let made = match args.fabricate {
        Some(layout) => Some(Fabricated::new(layout)?),
        None => None,
    };
    let root = match &made {
        Some(f) => f.0.clone(),
        None => args.sysfs.clone(),
    };
    let report = report(&root);
    let shown = match args.fabricate {
        Some(layout) => format!("a fabricated {} ({})", layout.name(), layout.describe()),
        None => root.display().to_string(),
    };
    let report = Report { sysfs: shown, ..report };
    if json {
        let text = serde_json::to_string(&report).map_err(|e| Error::new(ErrorKind::Internal, e.to_string()))?;
        println!("{text}");
    } else {
        print!("{}", render(&report));
    }
    Ok(Outcome::Ok)
}

fn report(root: &Path) -> Report {
    let s = Sysfs::new(root);
    let names = s.rdma_devices();
    let places: Vec<Place> = names.iter().map(|n| s.rdma_device(n)).collect();
    let memory = |label: String, place: Place| {
        let near = nearest(&place, &places);
        let d = near.first().filter(|_| place.is_known()).map(|&k| distance(&place, &places[k]));
        Memory { memory: label, place, devices: near.iter().map(|&k| names[k].clone()).collect(), distance: d }
    };
    let gpus = s.gpus().into_iter().map(|g| memory(format!("GPU {} ({})", g.bus_id, g.vendor), g.place)).collect();
    // The nodes the devices name, and those sysfs lists.
    let mut nodes: BTreeSet<u32> = places.iter().filter_map(|p| p.numa).collect();
    if let Ok(dir) = std::fs::read_dir(root.join("devices/system/node")) {
        for e in dir.flatten() {
            if let Some(n) = e.file_name().to_str().and_then(|n| n.strip_prefix("node")).and_then(|n| n.parse().ok()) {
                nodes.insert(n);
            }
        }
    }
    let mut host: Vec<Memory> =
        nodes.into_iter().map(|n| memory(format!("host memory, node {n}"), Place::host(Some(n)))).collect();
    host.push(memory("host memory, node unknown".into(), Place::host(None)));
    Report {
        sysfs: root.display().to_string(),
        devices: names.into_iter().zip(places).map(|(name, place)| Device { name, place }).collect(),
        gpus,
        nodes: host,
    }
}

fn render(r: &Report) -> String {
    let mut out = format!("topology of {}\n", r.sysfs);
    if r.devices.is_empty() {
        out.push_str("no RDMA devices\n");
        return out;
    }
    out.push_str("RDMA devices:\n");
    for d in &r.devices {
        out.push_str(&format!("  {:<10} {}\n", d.name, d.place));
    }
    out.push_str("devices = [\"auto\"] sends the bytes of\n");
    for m in r.gpus.iter().chain(&r.nodes) {
        let how =
            m.distance.map(|d| format!(" (nearest: {d})")).unwrap_or_else(|| " (every device: place unknown)".into());
        out.push_str(&format!("  {:<34} over {}{how}\n", m.memory, m.devices.join(" ")));
    }
    out
}

/// A fabricated tree in a directory of its own, removed when dropped.
struct Fabricated(PathBuf);

impl Fabricated {
    fn new(layout: Layout) -> Result<Fabricated> {
        let dir = std::env::temp_dir().join(format!("kvmove-topology-{}-{}", std::process::id(), layout.name()));
        let _ = std::fs::remove_dir_all(&dir);
        let made = match layout {
            Layout::DgxH100 => fabricate::dgx_h100(&dir),
            Layout::NicPerSocket => fabricate::nic_per_socket(&dir),
            Layout::NicsNoGpu => fabricate::nics_no_gpu(&dir),
        };
        let f = Fabricated(dir);
        made.map_err(|e| Error::new(ErrorKind::Io, format!("cannot write a sysfs tree under {}: {e}", f.0.display())))?;
        Ok(f)
    }
}

impl Drop for Fabricated {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn devices_of(r: &Report, memory: &str) -> Vec<String> {
        r.gpus
            .iter()
            .chain(&r.nodes)
            .find(|m| m.memory.starts_with(memory))
            .map(|m| m.devices.clone())
            .unwrap_or_default()
    }

    #[test]
    fn the_three_layouts_give_the_expected_devices() {
        let f = Fabricated::new(Layout::DgxH100).expect("tree");
        let r = report(&f.0);
        assert_eq!(r.devices.len(), 8);
        assert_eq!(r.gpus.len(), 8);
        for (i, g) in r.gpus.iter().enumerate() {
            assert_eq!(g.devices, vec![format!("mlx5_{i}")], "{}", g.memory);
        }
        assert_eq!(devices_of(&r, "host memory, node 1"), vec!["mlx5_4", "mlx5_5", "mlx5_6", "mlx5_7"]);
        assert_eq!(devices_of(&r, "host memory, node unknown").len(), 8);
        let text = render(&r);
        assert!(text.contains("over mlx5_3 (nearest: switch)"), "{text}");

        let f = Fabricated::new(Layout::NicPerSocket).expect("tree");
        let r = report(&f.0);
        assert_eq!(devices_of(&r, "GPU"), vec!["mlx5_1"]);
        assert_eq!(devices_of(&r, "host memory, node 0"), vec!["mlx5_0"]);

        let f = Fabricated::new(Layout::NicsNoGpu).expect("tree");
        let r = report(&f.0);
        assert!(r.gpus.is_empty());
        assert_eq!(devices_of(&r, "host memory, node unknown"), vec!["mlx5_0", "mlx5_1", "rxe0"]);
    }

    #[test]
    fn a_host_without_rdma_devices_says_so() {
        let r = report(Path::new("/nonexistent-sysfs"));
        assert!(r.devices.is_empty());
        assert_eq!(render(&r), "topology of /nonexistent-sysfs\nno RDMA devices\n");
    }
}
