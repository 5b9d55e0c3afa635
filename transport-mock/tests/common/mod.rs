//! Shared helpers of the mock's tests.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use transport_core::{Access, BatchStatus, Buffer, RegionId, SegmentId, SubmitOptions, TransferRequest, Transport};
use transport_mock::{MockConfig, MockFabric, MockTransport};

/// Runs a test body on a multi-thread runtime with a 20 s timeout.
pub fn run<F: Future<Output = ()> + Send + 'static>(f: F) {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(4).enable_all().build().unwrap();
    rt.block_on(async move {
        tokio::time::timeout(Duration::from_secs(20), f).await.expect("test timed out");
    });
}

/// Guard bytes on each side of a test region.
pub const GUARD: usize = 4096;
pub const CANARY: u8 = 0xA5;

/// A buffer with canaries around the usable middle.
pub struct Mem {
    pub buf: Buffer,
    pub len: usize,
}

impl Mem {
    pub fn new(len: usize, seed: u8) -> Self {
        let buf = Buffer::new(len + 2 * GUARD).unwrap();
        buf.fill(CANARY);
        let m = Self { buf, len };
        m.write(0, &pattern(seed, len));
        m
    }
    pub fn addr(&self) -> u64 {
        self.buf.addr() + GUARD as u64
    }
    pub fn region(&self) -> transport_core::MemoryRegion {
        sub_region(&self.buf, GUARD, self.len)
    }
    pub fn read(&self) -> Vec<u8> {
        let mut v = vec![0; self.len];
        self.buf.read_at(GUARD, &mut v).unwrap();
        v
    }
    pub fn write(&self, off: usize, bytes: &[u8]) {
        self.buf.write_at(GUARD + off, bytes).unwrap();
    }
    pub fn canaries_intact(&self) -> bool {
        let all = self.buf.to_vec();
        all[..GUARD].iter().all(|&b| b == CANARY) && all[GUARD + self.len..].iter().all(|&b| b == CANARY)
    }
}

fn sub_region(buf: &Buffer, off: usize, len: usize) -> transport_core::MemoryRegion {
    buf.region().sub(off, len).unwrap()
}

pub fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

pub fn host(fabric: &MockFabric, name: &str) -> Arc<MockTransport> {
    MockTransport::new(fabric, MockConfig::named(name)).unwrap()
}

/// Two hosts: `a` with a local region, `b` with a remote read/write one,
/// and `a`'s handle to `b`.
pub struct Pair {
    pub fabric: MockFabric,
    pub a: Arc<MockTransport>,
    pub b: Arc<MockTransport>,
    pub local: Mem,
    pub remote: Mem,
    pub lid: RegionId,
    pub rid: RegionId,
    pub seg: SegmentId,
}

impl Pair {
    pub async fn new(len: usize, a: MockConfig, b: MockConfig) -> Self {
        let fabric = MockFabric::new();
        let a = MockTransport::new(&fabric, a).unwrap();
        let b = MockTransport::new(&fabric, b).unwrap();
        Self::of(len, fabric, a, b).await
    }
    /// A pair of hosts already started on `fabric`.
    pub async fn of(len: usize, fabric: MockFabric, a: Arc<MockTransport>, b: Arc<MockTransport>) -> Self {
        let local = Mem::new(len, 1);
        let remote = Mem::new(len, 2);
        let lid = a.register(local.region(), Access::LOCAL).unwrap();
        let rid = b.register(remote.region(), Access::REMOTE_RW).unwrap();
        let seg = a.open_segment(&b.local_segment_name()).await.unwrap();
        Self { fabric, a, b, local, remote, lid, rid, seg }
    }
    pub async fn default(len: usize) -> Self {
        Self::new(len, MockConfig::named("a"), MockConfig::named("b")).await
    }
    pub fn write(&self, loff: u64, roff: u64, len: u64) -> TransferRequest {
        TransferRequest::write(self.lid, loff, self.seg, self.remote.addr() + roff, len)
    }
    pub fn read(&self, loff: u64, roff: u64, len: u64) -> TransferRequest {
        TransferRequest::read(self.lid, loff, self.seg, self.remote.addr() + roff, len)
    }
}

/// Submit, wait, release.
pub async fn run_batch(t: &dyn Transport, reqs: Vec<TransferRequest>, opts: SubmitOptions) -> BatchStatus {
    let b = t.submit(reqs, opts).await.unwrap();
    let s = t.wait(b).await.unwrap();
    assert!(s.is_terminal());
    t.release(b).unwrap();
    s
}

/// Watches `mem` for `ms` milliseconds: it must keep `snapshot`.
pub async fn quiet(mem: &Mem, snapshot: &[u8], ms: u64) {
    let end = std::time::Instant::now() + Duration::from_millis(ms);
    while std::time::Instant::now() < end {
        assert_eq!(mem.read(), snapshot, "memory changed after its batch was reported terminal");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Polls until `f` holds (up to 3 s).
pub async fn settle(mut f: impl FnMut() -> bool) -> bool {
    let end = std::time::Instant::now() + Duration::from_secs(3);
    while std::time::Instant::now() < end {
        if f() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    f()
}
