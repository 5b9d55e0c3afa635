//! What placing one host region costs, as `Rails::placed` does at each
//! `register`: the kernel's answer for 64 of its pages
//! (`topology::host_node`) against reading `/proc/self/numa_maps`
//! (`topology::host_numa`, which walks the page tables of every mapping
//! of the process), in a process holding `GIB` GiB of touched memory cut
//! into `REGIONS` regions. The reference, same run: touching that memory
//! once (what any buffer costs before it is first used).
//!
//! ```text
//! cargo run --release -p transport-rails --example placing_cost -- [GIB [REGIONS]]
//! ```
use std::path::Path;
use std::time::{Duration, Instant};

use transport_rails::topology::{host_node, host_numa};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let gib: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(4);
    let regions: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(64);
    if !(1..=64).contains(&gib) || !(1..=4096).contains(&regions) {
        return Err("GIB 1..=64, REGIONS 1..=4096".into());
    }
    let len = gib << 30;
    let mut buf = transport_mem::PageBuf::new(len)?;
    let t = Instant::now();
    buf.fill(1);
    let touch = t.elapsed();
    let addr = buf.as_ptr() as u64;
    let per = (len / regions) as u64;
    let each = |f: &dyn Fn(u64) -> Option<u32>| -> (Duration, Option<u32>) {
        let t = Instant::now();
        let mut node = None;
        for i in 0..regions as u64 {
            node = f(addr + i * per);
        }
        (t.elapsed(), node)
    };
    let (maps, maps_node) = each(&|a| host_numa(Path::new("/proc"), a, per));
    let (sampled, node) = each(&|a| host_node(a, per));
    let kernel = match transport_mem::numa::node_of(addr, per) {
        Ok(_) => "move_pages",
        Err(_) => "refused: numa_maps",
    };
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    println!("{gib} GiB touched in {:.1} ms (the reference); {regions} regions of {} MiB", ms(touch), per >> 20);
    println!(
        "numa_maps: {:.3} ms in all, {:.3} ms a region ({:.2}% of touching the memory), node {maps_node:?}",
        ms(maps),
        ms(maps) / regions as f64,
        100.0 * maps.as_secs_f64() / touch.as_secs_f64()
    );
    println!(
        "host_node ({kernel}): {:.3} ms in all, {:.3} ms a region ({:.2}% of touching the memory), node {node:?}",
        ms(sampled),
        ms(sampled) / regions as f64,
        100.0 * sampled.as_secs_f64() / touch.as_secs_f64()
    );
    Ok(())
}
