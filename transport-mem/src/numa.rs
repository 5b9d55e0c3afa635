//! Which NUMA node holds a range of this process's memory, asked of the
//! kernel for a sample of its pages (`move_pages(2)` with no target
//! nodes, which only reports where each page is). The cost is in the pages
//! sampled, not in the size of the process, unlike
//! `/proc/self/numa_maps`, which the kernel builds by walking the page
//! tables of every mapping the process has.
#![allow(unsafe_code)]

/// Pages of a range [`node_of`] asks about, spread evenly over it.
pub const SAMPLES: usize = 64;

/// Why [`node_of`] has no answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoNode {
    /// None of the sampled pages is resident (never touched, or swapped
    /// out), or the range is not mapped: nothing to say yet.
    NotResident,
    /// The kernel refused the call (no NUMA support, or a seccomp filter:
    /// Docker's default profile allows `move_pages` only with
    /// `CAP_SYS_NICE`); the errno.
    Refused(i32),
}

/// The NUMA node holding most of the resident pages among [`SAMPLES`]
/// spread over `addr .. addr + len` of this process (the lower node on a
/// tie). An empty range, or one past the end of the address space, is
/// [`NoNode::NotResident`].
pub fn node_of(addr: u64, len: u64) -> Result<u32, NoNode> {
    // SAFETY: sysconf only reads a configuration value.
    let page = u64::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).ok().filter(|p| p.is_power_of_two());
    let page = page.unwrap_or(4096);
    let Some(last) = addr.checked_add(len).and_then(|end| end.checked_sub(1)).filter(|_| len > 0) else {
        return Err(NoNode::NotResident);
    };
    let (first, last) = (addr & !(page - 1), last & !(page - 1));
    let pages = (last - first) / page + 1;
    let count = pages.min(SAMPLES as u64);
    let step = if count > 1 { (pages - 1) / (count - 1) } else { 0 };
    let mut at: Vec<*mut libc::c_void> =
        (0..count).map(|i| (first + i * step * page) as usize as *mut libc::c_void).collect();
    let mut status: Vec<libc::c_int> = vec![0; at.len()];
    // SAFETY: move_pages with `nodes` null moves nothing: it reads `count`
    // addresses from `at` and writes `count` ints into `status`, both
    // vectors of exactly that length that outlive the call. The addresses
    // are not dereferenced here; the kernel checks each one against this
    // process's mappings and reports -EFAULT / -ENOENT for those it cannot
    // use.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_move_pages,
            0 as libc::c_long,
            at.len() as libc::c_ulong,
            at.as_mut_ptr(),
            std::ptr::null::<libc::c_int>(),
            status.as_mut_ptr(),
            0 as libc::c_int,
        )
    };
    if rc != 0 {
        let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
        return Err(NoNode::Refused(errno));
    }
    let mut counts: std::collections::BTreeMap<u32, u32> = std::collections::BTreeMap::new();
    for s in status {
        if let Ok(node) = u32::try_from(s) {
            *counts.entry(node).or_default() += 1;
        }
    }
    counts.into_iter().max_by(|a, b| a.1.cmp(&b.1).then(b.0.cmp(&a.0))).map(|(n, _)| n).ok_or(NoNode::NotResident)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn online_nodes() -> Vec<u32> {
        let Ok(text) = std::fs::read_to_string("/sys/devices/system/node/online") else { return vec![0] };
        let mut out = Vec::new();
        for part in text.trim().split(',') {
            let (a, b) = part.split_once('-').unwrap_or((part, part));
            if let (Ok(a), Ok(b)) = (a.parse::<u32>(), b.parse::<u32>()) {
                out.extend(a..=b);
            }
        }
        out
    }

    /// Touched memory is on an online node; untouched memory, an empty
    /// range and one past the end of the address space have no node.
    #[test]
    fn touched_pages_have_a_node_and_untouched_ones_none() {
        let mut buf = crate::PageBuf::new(16 << 20).unwrap();
        let addr = buf.as_ptr() as u64;
        match node_of(addr, 16 << 20) {
            Err(NoNode::Refused(errno)) => {
                eprintln!("move_pages refused here (errno {errno}): nothing to check");
                return;
            }
            r => assert_eq!(r, Err(NoNode::NotResident), "a fresh mapping has no page yet"),
        }
        buf.fill(1);
        let node = node_of(addr, 16 << 20).expect("touched pages");
        assert!(online_nodes().contains(&node), "node {node} is not online: {:?}", online_nodes());
        assert_eq!(node_of(addr + 5, 1), Ok(node), "one byte inside a page");
        assert_eq!(node_of(addr, 0), Err(NoNode::NotResident));
        assert_eq!(node_of(u64::MAX - 10, 100), Err(NoNode::NotResident));
    }
}
