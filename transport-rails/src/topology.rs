//! Where a NIC and a region's memory sit, and which NICs are nearest the
//! memory: read from sysfs (the root is a parameter, so tests run on
//! fabricated trees), decided without I/O.
//!
//! * A [`Place`] is a PCIe path (the host bridge, `pci0000:00`, then every
//!   bridge down to the device's own address) and a NUMA node; host memory
//!   has only a node.
//! * [`distance`] ranks two places as `nvidia-smi topo -m` does: through
//!   one PCIe switch (a bridge below the host bridge in common), through
//!   the same host bridge, on the same NUMA node, across nodes. What sysfs
//!   does not say (a virtual device such as soft-RoCE, a node of `-1` on a
//!   single-socket machine) never makes a place farther.
//! * [`nearest`] is the choice: the rails at the smallest distance from a
//!   region, several when equally near; every rail when the region's place
//!   is unknown or no rail's is. So a host with one NIC, or none that
//!   sysfs places, behaves as it did before topology existed.

use std::fmt;
use std::path::{Path, PathBuf};

use serde::Serialize;
use transport_mem::{MemoryKind, MemoryRegion};

/// A device's or a memory range's location: its PCIe path and NUMA node.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize)]
pub struct Place {
    /// From the host bridge (`pci0000:00`) down: each bridge's address,
    /// then the device's own (`0000:05:00.0`). Empty for host memory and
    /// for devices sysfs does not place (virtual ones).
    pub pci: Vec<String>,
    /// The NUMA node; `None` when sysfs says `-1` or nothing.
    pub numa: Option<u32>,
}

impl Place {
    /// Host memory on `numa` (`None`: unknown).
    pub fn host(numa: Option<u32>) -> Place {
        Place { pci: Vec::new(), numa }
    }

    /// Whether anything is known about where this is.
    pub fn is_known(&self) -> bool {
        !self.pci.is_empty() || self.numa.is_some()
    }
}

impl fmt::Display for Place {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.pci.last(), self.numa) {
            (Some(dev), Some(n)) => write!(f, "{dev} (node {n})"),
            (Some(dev), None) => write!(f, "{dev}"),
            (None, Some(n)) => write!(f, "node {n}"),
            (None, None) => f.write_str("unknown"),
        }
    }
}

/// How far apart two places are, nearest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Distance {
    /// A PCIe bridge below the host bridge in common: traffic between them
    /// stays on one switch (nvidia-smi's PIX/PXB).
    Switch,
    /// The same host bridge (root complex), no switch in common (PHB).
    HostBridge,
    /// The same NUMA node, or nothing known that says otherwise (NODE).
    Node,
    /// Different NUMA nodes: through the inter-socket link (SYS).
    System,
}

impl fmt::Display for Distance {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Distance::Switch => "switch",
            Distance::HostBridge => "host bridge",
            Distance::Node => "node",
            Distance::System => "system",
        })
    }
}

/// How far `a` is from `b` (symmetric).
pub fn distance(a: &Place, b: &Place) -> Distance {
    if let (Some(ra), Some(rb)) = (a.pci.first(), b.pci.first()) {
        if ra == rb {
            let common = a.pci.iter().zip(&b.pci).take_while(|(x, y)| x == y).count();
            // The host bridge and at least one bridge under it in common.
            return if common >= 2 { Distance::Switch } else { Distance::HostBridge };
        }
    }
    match (a.numa, b.numa) {
        (Some(x), Some(y)) if x != y => Distance::System,
        _ => Distance::Node,
    }
}

/// The rails nearest `region`: indexes into `rails`, ascending. Every rail
/// when the region's place is unknown, or when no rail's is.
pub fn nearest(region: &Place, rails: &[Place]) -> Vec<usize> {
    if !region.is_known() || !rails.iter().any(Place::is_known) {
        return (0..rails.len()).collect();
    }
    let d: Vec<Distance> = rails.iter().map(|r| distance(region, r)).collect();
    let Some(best) = d.iter().min().copied() else {
        return Vec::new();
    };
    d.iter().enumerate().filter(|(_, x)| **x == best).map(|(i, _)| i).collect()
}

/// The rails' places, and where a region's memory is looked up: what
/// [`crate::Rails`] uses to keep each region's bytes on the rails nearest
/// it ([`crate::Rails::placed`]).
#[derive(Debug, Clone)]
pub struct Topology {
    names: Vec<String>,
    rails: Vec<Place>,
    sysfs: Sysfs,
    /// A fabricated `/proc` to place host memory from (tests).
    proc_root: Option<PathBuf>,
}

impl Topology {
    /// The RDMA devices `devices` (one per rail, rail 0 first) as `sysfs`
    /// places them; host memory is placed by [`host_node`].
    pub fn of_devices(sysfs: Sysfs, devices: &[String]) -> Topology {
        let rails = devices.iter().map(|d| sysfs.rdma_device(d)).collect();
        Topology { names: devices.to_vec(), rails, sysfs, proc_root: None }
    }

    /// Rails at the places given (tests, and a caller that placed them
    /// itself), named `rail0`, `rail1`, ...
    pub fn of_places(sysfs: Sysfs, rails: Vec<Place>) -> Topology {
        let names = (0..rails.len()).map(|i| format!("rail{i}")).collect();
        Topology { names, rails, sysfs, proc_root: None }
    }

    /// Host memory placed from `proc_root/self/{maps,numa_maps}` instead
    /// ([`host_numa`]): a fabricated `/proc` for tests.
    pub fn with_proc_root(mut self, proc_root: impl Into<PathBuf>) -> Topology {
        self.proc_root = Some(proc_root.into());
        self
    }

    /// Each rail's place, rail 0 first.
    pub fn rails(&self) -> &[Place] {
        &self.rails
    }

    /// Each rail's device name.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// Where `mem`'s bytes are: a device's PCI place (from its provider's
    /// PCI address), or host memory's NUMA node.
    pub fn place_of(&self, mem: &MemoryRegion) -> Place {
        match mem.kind() {
            MemoryKind::Device(d) => {
                mem.provider().and_then(|p| p.pci_bus_id(d)).map(|b| self.sysfs.pci_device(&b)).unwrap_or_default()
            }
            MemoryKind::Host => Place::host(match &self.proc_root {
                Some(root) => host_numa(root, mem.addr(), mem.len() as u64),
                None => host_node(mem.addr(), mem.len() as u64),
            }),
        }
    }

    /// The rails nearest `mem` ([`nearest`]).
    pub fn near(&self, mem: &MemoryRegion) -> (Place, Vec<usize>) {
        let place = self.place_of(mem);
        let near = nearest(&place, &self.rails);
        (place, near)
    }
}

/// A sysfs tree (`/sys`, or a fabricated one in tests).
#[derive(Debug, Clone)]
pub struct Sysfs {
    root: PathBuf,
}

/// A GPU sysfs lists: its PCI address, vendor and place.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Gpu {
    /// The PCI address, `0000:18:00.0`.
    pub bus_id: String,
    /// `nvidia`, `amd`, or the vendor id.
    pub vendor: String,
    pub place: Place,
}

impl Default for Sysfs {
    fn default() -> Self {
        Sysfs::new("/sys")
    }
}

impl Sysfs {
    /// The tree under `root` (`/sys` on a real host).
    pub fn new(root: impl Into<PathBuf>) -> Sysfs {
        Sysfs { root: root.into() }
    }

    /// The RDMA devices (`class/infiniband/*`), sorted by name.
    pub fn rdma_devices(&self) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(self.root.join("class/infiniband"))
            .map(|dir| dir.filter_map(|e| e.ok()?.file_name().into_string().ok()).collect())
            .unwrap_or_default();
        names.sort();
        names
    }

    /// Where the RDMA device `name` sits; unknown (the default place) for
    /// a virtual device (soft-RoCE has no PCI device) or a name that is not
    /// one (never a path: `/` and `..` are refused).
    pub fn rdma_device(&self, name: &str) -> Place {
        if !plain_name(name) {
            return Place::default();
        }
        self.place_of(&self.root.join("class/infiniband").join(name).join("device"))
    }

    /// Where the PCI device at `bus_id` sits (`0000:18:00.0`, or CUDA's
    /// `00000000:18:00.0`; any case).
    pub fn pci_device(&self, bus_id: &str) -> Place {
        match normalize_bus_id(bus_id) {
            Some(id) => self.place_of(&self.root.join("bus/pci/devices").join(id)),
            None => Place::default(),
        }
    }

    /// The GPUs on the PCI bus (display or 3D controllers of NVIDIA or
    /// AMD), sorted by address.
    pub fn gpus(&self) -> Vec<Gpu> {
        let dir = self.root.join("bus/pci/devices");
        let mut ids: Vec<String> = std::fs::read_dir(&dir)
            .map(|d| d.filter_map(|e| e.ok()?.file_name().into_string().ok()).collect())
            .unwrap_or_default();
        ids.sort();
        ids.into_iter()
            .filter_map(|id| {
                let class = read_trimmed(&dir.join(&id).join("class"))?;
                // 0x0300xx VGA, 0x0302xx 3D controller.
                if !(class.starts_with("0x0300") || class.starts_with("0x0302")) {
                    return None;
                }
                let vendor = match read_trimmed(&dir.join(&id).join("vendor"))?.as_str() {
                    "0x10de" => "nvidia".to_string(),
                    "0x1002" => "amd".to_string(),
                    _ => return None,
                };
                let place = self.place_of(&dir.join(&id));
                Some(Gpu { bus_id: id, vendor, place })
            })
            .collect()
    }

    fn place_of(&self, link: &Path) -> Place {
        let Ok(real) = std::fs::canonicalize(link) else {
            return Place::default();
        };
        let numa = read_trimmed(&real.join("numa_node")).and_then(|s| s.parse::<i64>().ok()).and_then(|n| {
            if n >= 0 {
                u32::try_from(n).ok()
            } else {
                None
            }
        });
        let Ok(devices) = std::fs::canonicalize(self.root.join("devices")) else {
            return Place { pci: Vec::new(), numa };
        };
        let Ok(rel) = real.strip_prefix(&devices) else {
            return Place { pci: Vec::new(), numa };
        };
        let parts: Vec<String> = rel.iter().filter_map(|c| c.to_str().map(str::to_string)).collect();
        let pci = match parts.first() {
            Some(host) if host.starts_with("pci") && parts[1..].iter().all(|p| normalize_bus_id(p).is_some()) => parts,
            _ => Vec::new(),
        };
        Place { pci, numa }
    }
}

/// The NUMA node holding most of the resident pages of `addr .. addr +
/// len` of this process: the kernel's answer for a sample of its pages
/// ([`transport_mem::numa::node_of`], microseconds whatever the size of
/// the process), or where the kernel refuses that call (a container whose
/// seccomp profile forbids `move_pages`), [`host_numa`] on `/proc`, which
/// walks the page tables of every mapping of the process (see
/// `examples/placing_cost.rs`). `None` when nothing says (no page touched
/// yet, no NUMA support).
pub fn host_node(addr: u64, len: u64) -> Option<u32> {
    use transport_mem::numa::{node_of, NoNode};
    match node_of(addr, len) {
        Ok(node) => Some(node),
        Err(NoNode::NotResident) => None,
        Err(NoNode::Refused(_)) => host_numa(Path::new("/proc"), addr, len),
    }
}

/// The NUMA node holding most of the pages of `addr .. addr + len` of this
/// process, from `proc_root/self/maps` and `proc_root/self/numa_maps`
/// (`/proc` on a real host): the nodes of every mapping the range
/// overlaps, weighed by their pages. `None` when nothing says (no pages
/// touched yet, no NUMA support).
pub fn host_numa(proc_root: &Path, addr: u64, len: u64) -> Option<u32> {
    let maps = std::fs::read_to_string(proc_root.join("self/maps")).ok()?;
    let numa = std::fs::read_to_string(proc_root.join("self/numa_maps")).ok()?;
    host_numa_of(&maps, &numa, addr, len)
}

/// [`host_numa`] on the two files' text.
pub fn host_numa_of(maps: &str, numa_maps: &str, addr: u64, len: u64) -> Option<u32> {
    let end = addr.checked_add(len)?;
    // The mappings the range overlaps, by start address.
    let mut starts = std::collections::HashSet::new();
    for line in maps.lines() {
        let Some(range) = line.split_whitespace().next() else { continue };
        let Some((s, e)) = range.split_once('-') else { continue };
        let (Ok(s), Ok(e)) = (u64::from_str_radix(s, 16), u64::from_str_radix(e, 16)) else { continue };
        if s < end && addr < e {
            starts.insert(s);
        }
    }
    let mut pages: std::collections::BTreeMap<u32, u64> = std::collections::BTreeMap::new();
    for line in numa_maps.lines() {
        let mut words = line.split_whitespace();
        let Some(Ok(start)) = words.next().map(|s| u64::from_str_radix(s, 16)) else { continue };
        if !starts.contains(&start) {
            continue;
        }
        for w in words {
            let Some((node, count)) = w.strip_prefix('N').and_then(|w| w.split_once('=')) else { continue };
            if let (Ok(node), Ok(count)) = (node.parse::<u32>(), count.parse::<u64>()) {
                let slot = pages.entry(node).or_default();
                *slot = slot.saturating_add(count);
            }
        }
    }
    // The most pages; the lower node on a tie.
    pages.into_iter().max_by(|a, b| a.1.cmp(&b.1).then(b.0.cmp(&a.0))).map(|(node, _)| node)
}

/// `0000:18:00.0` from any spelling of a PCI address (CUDA's eight-digit
/// domain, upper case); `None` for anything else.
pub fn normalize_bus_id(id: &str) -> Option<String> {
    let id = id.trim().to_ascii_lowercase();
    let (domain, rest) = id.split_once(':')?;
    let (bus, rest) = rest.split_once(':')?;
    let (dev, func) = rest.split_once('.')?;
    let hex = |s: &str, max: usize| !s.is_empty() && s.len() <= max && s.bytes().all(|b| b.is_ascii_hexdigit());
    if !(hex(domain, 8) && hex(bus, 2) && hex(dev, 2) && hex(func, 1)) {
        return None;
    }
    let domain = u32::from_str_radix(domain, 16).ok()?;
    if domain > 0xffff {
        return None;
    }
    Some(format!("{domain:04x}:{bus:0>2}:{dev:0>2}.{func}"))
}

fn plain_name(name: &str) -> bool {
    !name.is_empty() && name != "." && name != ".." && !name.contains('/') && !name.contains('\0')
}

fn read_trimmed(path: &Path) -> Option<String> {
    std::fs::read_to_string(path).ok().map(|s| s.trim().to_string())
}

#[doc(hidden)]
pub mod fabricate {
    //! Fabricated sysfs trees of real layouts, for tests and `kvmove
    //! topology --sysfs`: the directories and links sysfs has for PCI
    //! devices, RDMA devices and GPUs, nothing else.
    use std::io;
    use std::path::{Path, PathBuf};

    /// One device of a fabricated tree: its PCIe path from the host bridge
    /// (`["pci0000:00", "0000:00:01.0", ..., "0000:05:00.0"]`) and node.
    #[derive(Debug)]
    pub struct Dev<'a> {
        pub pci: &'a [&'a str],
        pub numa: i32,
    }

    /// Writes the PCI device `dev` under `root` (its directory, `numa_node`,
    /// `class`, `vendor`, and `bus/pci/devices/<address>`).
    pub fn pci(root: &Path, dev: &Dev<'_>, class: &str, vendor: &str) -> io::Result<PathBuf> {
        let mut dir = root.join("devices");
        for p in dev.pci {
            dir.push(p);
        }
        std::fs::create_dir_all(&dir)?;
        std::fs::write(dir.join("numa_node"), format!("{}\n", dev.numa))?;
        std::fs::write(dir.join("class"), format!("{class}\n"))?;
        std::fs::write(dir.join("vendor"), format!("{vendor}\n"))?;
        let bus = root.join("bus/pci/devices");
        std::fs::create_dir_all(&bus)?;
        if let Some(id) = dev.pci.last() {
            let link = bus.join(id);
            if !link.exists() {
                std::os::unix::fs::symlink(&dir, link)?;
            }
        }
        Ok(dir)
    }

    /// A directory standing for `/proc` ([`super::host_numa`]'s root):
    /// `self/maps` and `self/numa_maps` placing `addr .. addr + len` on
    /// NUMA node `node`.
    pub fn proc_placing(dir: &Path, addr: u64, len: u64, node: u32) -> io::Result<()> {
        std::fs::create_dir_all(dir.join("self"))?;
        let end = addr.saturating_add(len);
        std::fs::write(dir.join("self/maps"), format!("{addr:x}-{end:x} rw-p 00000000 00:00 0\n"))?;
        let pages = (len / 4096).max(1);
        std::fs::write(dir.join("self/numa_maps"), format!("{addr:x} default anon={pages} N{node}={pages}\n"))
    }

    /// An NVIDIA GPU at `dev`.
    pub fn gpu(root: &Path, dev: &Dev<'_>) -> io::Result<()> {
        pci(root, dev, "0x030200", "0x10de").map(|_| ())
    }

    /// A Mellanox NIC at `dev` with the RDMA device `name`.
    pub fn nic(root: &Path, dev: &Dev<'_>, name: &str) -> io::Result<()> {
        let dir = pci(root, dev, "0x020700", "0x15b3")?;
        let ib = dir.join("infiniband").join(name);
        std::fs::create_dir_all(&ib)?;
        std::os::unix::fs::symlink(&dir, ib.join("device"))?;
        let class = root.join("class/infiniband");
        std::fs::create_dir_all(&class)?;
        std::os::unix::fs::symlink(&ib, class.join(name))
    }

    /// A virtual RDMA device (soft-RoCE): no PCI device behind it.
    pub fn virtual_rdma(root: &Path, name: &str) -> io::Result<()> {
        let ib = root.join("devices/virtual/infiniband").join(name);
        std::fs::create_dir_all(&ib)?;
        let class = root.join("class/infiniband");
        std::fs::create_dir_all(&class)?;
        std::os::unix::fs::symlink(&ib, class.join(name))
    }

    /// A node like NVIDIA's DGX H100: 2 NUMA nodes, on each 2 host bridges
    /// with 2 PCIe switches each, every switch with 1 GPU and 1 NIC (8
    /// GPUs, 8 NICs `mlx5_0..7`; GPU i and NIC i share a switch).
    pub fn dgx_h100(root: &Path) -> io::Result<()> {
        for i in 0..8u32 {
            let node = (i / 4) as i32;
            let host = format!("pci0000:{:02x}", 0x10 + 0x20 * (i / 2));
            let bus = 0x10 + 0x20 * (i / 2);
            let port = format!("0000:{bus:02x}:{:02x}.0", 1 + i % 2);
            let up = format!("0000:{:02x}:00.0", bus + 1 + 4 * (i % 2));
            let gpu_down = format!("0000:{:02x}:00.0", bus + 2 + 4 * (i % 2));
            let nic_down = format!("0000:{:02x}:01.0", bus + 2 + 4 * (i % 2));
            let gpu_addr = format!("0000:{:02x}:00.0", bus + 3 + 4 * (i % 2));
            let nic_addr = format!("0000:{:02x}:00.0", bus + 4 + 4 * (i % 2));
            gpu(root, &Dev { pci: &[&host, &port, &up, &gpu_down, &gpu_addr], numa: node })?;
            nic(root, &Dev { pci: &[&host, &port, &up, &nic_down, &nic_addr], numa: node }, &format!("mlx5_{i}"))?;
        }
        Ok(())
    }

    /// Two sockets, one NIC on each (`mlx5_0` on node 0, `mlx5_1` on node
    /// 1), each on its own host bridge; a GPU on node 1 under another host
    /// bridge than the NIC.
    pub fn nic_per_socket(root: &Path) -> io::Result<()> {
        nic(root, &Dev { pci: &["pci0000:00", "0000:00:02.0", "0000:01:00.0"], numa: 0 }, "mlx5_0")?;
        nic(root, &Dev { pci: &["pci0000:80", "0000:80:02.0", "0000:81:00.0"], numa: 1 }, "mlx5_1")?;
        gpu(root, &Dev { pci: &["pci0000:c0", "0000:c0:01.0", "0000:c1:00.0"], numa: 1 })
    }

    /// NICs and no GPU, NUMA unknown (`-1`, a single-socket board): two
    /// NICs on one host bridge, and a soft-RoCE device.
    pub fn nics_no_gpu(root: &Path) -> io::Result<()> {
        nic(root, &Dev { pci: &["pci0000:00", "0000:00:01.0", "0000:01:00.0"], numa: -1 }, "mlx5_0")?;
        nic(root, &Dev { pci: &["pci0000:00", "0000:00:03.0", "0000:02:00.0"], numa: -1 }, "mlx5_1")?;
        virtual_rdma(root, "rxe0")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Tree(PathBuf);
    impl Tree {
        fn new(make: fn(&Path) -> std::io::Result<()>) -> Tree {
            static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
            let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let dir = std::env::temp_dir().join(format!("kvmove-sysfs-{}-{n}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            make(&dir).expect("fabricate a sysfs tree");
            Tree(dir)
        }
        fn sysfs(&self) -> Sysfs {
            Sysfs::new(&self.0)
        }
    }
    impl Drop for Tree {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn rails(s: &Sysfs) -> (Vec<String>, Vec<Place>) {
        let names = s.rdma_devices();
        let places = names.iter().map(|n| s.rdma_device(n)).collect();
        (names, places)
    }

    #[test]
    fn dgx_h100_each_gpu_gets_the_nic_on_its_switch() {
        let t = Tree::new(fabricate::dgx_h100);
        let s = t.sysfs();
        let (names, places) = rails(&s);
        assert_eq!(names.len(), 8);
        let gpus = s.gpus();
        assert_eq!(gpus.len(), 8, "{gpus:?}");
        for (i, g) in gpus.iter().enumerate() {
            let near: Vec<&str> = nearest(&g.place, &places).into_iter().map(|k| names[k].as_str()).collect();
            assert_eq!(near, vec![format!("mlx5_{i}")], "GPU {} at {:?}", g.bus_id, g.place);
            assert_eq!(distance(&g.place, &places[i]), Distance::Switch);
        }
        // The GPU and NIC pairs on one host bridge, on one node, across.
        assert_eq!(distance(&gpus[0].place, &places[1]), Distance::HostBridge);
        assert_eq!(distance(&gpus[0].place, &places[2]), Distance::Node);
        assert_eq!(distance(&gpus[0].place, &places[7]), Distance::System);
        // Host memory: the node's four NICs.
        assert_eq!(nearest(&Place::host(Some(0)), &places), vec![0, 1, 2, 3]);
        assert_eq!(nearest(&Place::host(Some(1)), &places), vec![4, 5, 6, 7]);
        assert_eq!(nearest(&Place::host(None), &places), (0..8).collect::<Vec<_>>());
    }

    #[test]
    fn one_nic_per_socket_host_memory_by_node_and_the_gpu_by_its_node() {
        let t = Tree::new(fabricate::nic_per_socket);
        let s = t.sysfs();
        let (names, places) = rails(&s);
        assert_eq!(names, vec!["mlx5_0", "mlx5_1"]);
        assert_eq!(places[1].numa, Some(1));
        assert_eq!(places[1].pci, vec!["pci0000:80", "0000:80:02.0", "0000:81:00.0"]);
        let gpus = s.gpus();
        assert_eq!(gpus.len(), 1);
        assert_eq!(nearest(&gpus[0].place, &places), vec![1]);
        assert_eq!(distance(&gpus[0].place, &places[1]), Distance::Node);
        assert_eq!(nearest(&Place::host(Some(0)), &places), vec![0]);
        // CUDA's spelling of the address finds the same device.
        assert_eq!(s.pci_device("00000000:C1:00.0"), gpus[0].place);
    }

    #[test]
    fn without_a_gpu_or_numa_every_nic_serves_host_memory() {
        let t = Tree::new(fabricate::nics_no_gpu);
        let s = t.sysfs();
        let (names, places) = rails(&s);
        assert_eq!(names, vec!["mlx5_0", "mlx5_1", "rxe0"]);
        assert!(s.gpus().is_empty());
        assert_eq!(places[2], Place::default(), "soft-RoCE has no PCI device");
        assert_eq!(places[0].numa, None, "-1 is unknown");
        assert_eq!(nearest(&Place::host(Some(0)), &places), vec![0, 1, 2]);
        assert_eq!(nearest(&Place::host(None), &places), vec![0, 1, 2]);
    }

    #[test]
    fn device_memory_is_placed_by_its_providers_pci_address() {
        let t = Tree::new(fabricate::dgx_h100);
        let s = t.sysfs();
        let names = s.rdma_devices();
        let topo = Topology::of_devices(s.clone(), &names);
        let gpu = std::sync::Arc::new(transport_mem::FakeDevice::new(0, 1 << 20).expect("fake device"));
        let region = transport_mem::FakeDevice::region(&gpu, 4096).expect("device region");
        assert_eq!(topo.near(&region).1, (0..8).collect::<Vec<_>>(), "no PCI address: every rail");
        // GPU 5's address (CUDA's spelling): the NIC on its switch.
        gpu.set_pci_bus_id(Some(s.gpus()[5].bus_id.to_uppercase().replacen("0000:", "00000000:", 1)));
        let (place, near) = topo.near(&region);
        assert_eq!(place, s.gpus()[5].place);
        assert_eq!(near, vec![5]);
        assert_eq!(topo.names()[5], "mlx5_5");
    }

    #[test]
    fn names_and_addresses_are_never_paths() {
        let t = Tree::new(fabricate::nic_per_socket);
        let s = t.sysfs();
        assert_eq!(s.rdma_device("../../devices"), Place::default());
        assert_eq!(s.rdma_device("mlx5_0/../mlx5_1"), Place::default());
        assert_eq!(s.pci_device("../0000:81:00.0"), Place::default());
        assert_eq!(normalize_bus_id("0000:81:00.0/.."), None);
        assert_eq!(normalize_bus_id("100000000:81:00.0"), None);
        assert_eq!(normalize_bus_id("0000:18:00.0").as_deref(), Some("0000:18:00.0"));
        assert_eq!(Sysfs::new("/nonexistent").rdma_devices(), Vec::<String>::new());
    }

    #[test]
    fn distance_is_symmetric_and_unknowns_never_push_away() {
        let a = Place { pci: vec!["pci0000:00".into(), "0000:00:01.0".into(), "0000:01:00.0".into()], numa: Some(0) };
        let b = Place { pci: vec!["pci0000:00".into(), "0000:00:01.0".into(), "0000:01:01.0".into()], numa: Some(0) };
        let c = Place { pci: vec!["pci0000:00".into(), "0000:00:02.0".into()], numa: Some(0) };
        let d = Place { pci: vec!["pci0000:80".into(), "0000:80:02.0".into()], numa: Some(1) };
        let u = Place::default();
        for (x, y, want) in [
            (&a, &b, Distance::Switch),
            (&a, &c, Distance::HostBridge),
            (&a, &d, Distance::System),
            (&a, &u, Distance::Node),
            (&d, &Place::host(None), Distance::Node),
        ] {
            assert_eq!(distance(x, y), want, "{x:?} {y:?}");
            assert_eq!(distance(y, x), want, "{y:?} {x:?}");
        }
    }

    #[test]
    fn host_memory_takes_the_node_of_most_pages() {
        let maps = "7f0000000000-7f0000100000 rw-p 00000000 00:00 0\n\
                    7f0000100000-7f0000200000 rw-p 00000000 00:00 0\n\
                    7f0000300000-7f0000400000 rw-p 00000000 00:00 0\n";
        let numa = "7f0000000000 default anon=10 dirty=10 N0=10 kernelpagesize_kB=4\n\
                    7f0000100000 default anon=30 dirty=30 N0=5 N1=25 kernelpagesize_kB=4\n\
                    7f0000300000 bind:0 anon=99 N0=99 kernelpagesize_kB=4\n";
        // The first two mappings: node 0 15 pages, node 1 25.
        assert_eq!(host_numa_of(maps, numa, 0x7f00_0000_0000, 0x20_0000), Some(1));
        assert_eq!(host_numa_of(maps, numa, 0x7f00_0000_0000, 0x1000), Some(0));
        assert_eq!(host_numa_of(maps, numa, 0x7f00_0030_0000, 0x10), Some(0));
        assert_eq!(host_numa_of(maps, numa, 0x7f00_0020_0000, 0x1000), None, "no mapping there");
        assert_eq!(host_numa_of(maps, numa, u64::MAX, 2), None, "no overflow");
        // This process: a touched page is somewhere (or NUMA is absent).
        let buf = vec![1u8; 1 << 16];
        let here = host_numa(Path::new("/proc"), buf.as_ptr() as u64, buf.len() as u64);
        if Path::new("/proc/self/numa_maps").exists() {
            assert!(here.is_some(), "a touched buffer has a node");
        }
    }

    /// The kernel's answer for a sample of pages agrees with numa_maps on
    /// touched memory, and a region registered before it is touched has
    /// no place (every rail serves it) rather than a guessed one.
    #[test]
    fn host_node_agrees_with_numa_maps() {
        let mut buf = transport_mem::PageBuf::new(8 << 20).unwrap();
        let (addr, len) = (buf.as_ptr() as u64, buf.len() as u64);
        let refused = matches!(transport_mem::numa::node_of(addr, len), Err(transport_mem::numa::NoNode::Refused(_)));
        if !refused {
            assert_eq!(host_node(addr, len), None, "nothing touched yet");
        }
        buf.fill(7);
        let maps = host_numa(Path::new("/proc"), addr, len);
        assert_eq!(host_node(addr, len), maps, "sampled pages against numa_maps (refused: {refused})");
        let filled = transport_mem::Buffer::from_slice(&[3u8; 1 << 16]).unwrap();
        let t = Topology::of_places(Sysfs::new("/nonexistent"), vec![Place::host(Some(0))]);
        let want = host_node(filled.addr(), filled.len() as u64);
        assert!(want.is_some() || refused, "touched");
        assert_eq!(t.place_of(&filled.region()).numa, want, "a topology on the real /proc asks the kernel");
    }
}
