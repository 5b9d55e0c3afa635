//! Progress on the caller's thread (`Transport::poll`, docs/CONTRACT.md
//! rule 3's "poll never blocks"): a caller polling its batch reads and
//! applies the answers that have arrived itself. The initiator runs on a
//! current-thread runtime that nobody drives while the caller polls, so its
//! lanes' reader tasks never run then: the batches below can only complete
//! through the caller's polls. Answers larger than one poll reads arrive
//! over several polls (a frame's payload split between them).
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failure should panic

mod support;

use std::time::{Duration, Instant};

use support::{node, test_config};
use tokio::runtime::{Builder, Runtime};
use transport_core::{Access, BatchId, BatchState, BatchStatus, Buffer, SubmitOptions, TransferRequest, Transport};
use transport_tcp::{TcpConfig, TcpTransport};

const PAGE: u64 = 4096;
/// Pages per batch: few and small enough that a submit sends them at once
/// from the caller (no writer task needed).
const PAGES: u64 = 48;

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(29).wrapping_add(seed)).collect()
}

/// Polls `id` on this thread (inside `rt`'s context, which nobody drives
/// meanwhile) until it is terminal; the polls it took.
fn spin(rt: &Runtime, t: &TcpTransport, id: BatchId) -> (BatchStatus, u64) {
    let _in_rt = rt.enter();
    let start = Instant::now();
    let mut polls = 0u64;
    loop {
        let s = t.poll(id).unwrap();
        polls += 1;
        if s.state.is_terminal() {
            return (s, polls);
        }
        assert!(start.elapsed() < Duration::from_secs(20), "the batch did not complete through polls: {s:?}");
        std::thread::yield_now();
    }
}

#[test]
fn polls_complete_small_batches_on_the_callers_thread() {
    for same_host in [false, true] {
        let target_rt = Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        let init_rt = Builder::new_current_thread().enable_all().build().unwrap();
        let cfg = TcpConfig { same_host, ..test_config() };
        let b = target_rt.block_on(node(cfg.clone()));
        let a = init_rt.block_on(node(cfg));
        let len = (PAGE * PAGES) as usize;
        let (src, dst, back) =
            (Buffer::from_slice(&pattern(3, len)).unwrap(), Buffer::new(len).unwrap(), Buffer::new(len).unwrap());
        let l = a.register(src.region(), Access::LOCAL).unwrap();
        let lb = a.register(back.region(), Access::LOCAL).unwrap();
        b.register(dst.region(), Access::REMOTE_RW).unwrap();
        let seg = init_rt.block_on(a.open_segment(&b.local_segment_name())).unwrap();

        let writes =
            (0..PAGES).map(|j| TransferRequest::write(l, j * PAGE, seg, dst.addr() + j * PAGE, PAGE)).collect();
        let id = init_rt.block_on(a.submit(writes, SubmitOptions::default())).unwrap();
        let (s, _) = spin(&init_rt, &a, id);
        assert_eq!(s.state, BatchState::Completed, "writes (same_host {same_host}): {:?}", s.first_error());
        a.release(id).unwrap();
        assert_eq!(dst.to_vec(), src.to_vec(), "written bytes (same_host {same_host})");

        // Read back in reverse page order: 192 KiB of answers, more than
        // one poll reads when they come through the sockets.
        let reads =
            (0..PAGES).map(|j| TransferRequest::read(lb, j * PAGE, seg, dst.addr() + j * PAGE, PAGE)).rev().collect();
        let id = init_rt.block_on(a.submit(reads, SubmitOptions::default())).unwrap();
        let (s, polls) = spin(&init_rt, &a, id);
        assert_eq!(s.state, BatchState::Completed, "reads (same_host {same_host}): {:?}", s.first_error());
        a.release(id).unwrap();
        assert_eq!(back.to_vec(), src.to_vec(), "read bytes (same_host {same_host}, {polls} polls)");

        init_rt.block_on(a.shutdown()).unwrap();
        target_rt.block_on(b.shutdown()).unwrap();
    }
}
