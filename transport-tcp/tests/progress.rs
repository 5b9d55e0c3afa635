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

use std::sync::Arc;

use support::fake_peer::{self, FakePeer, Script};
use support::{node, test_config};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::runtime::{Builder, Runtime};
use transport_core::{
    Access, BatchId, BatchState, BatchStatus, Buffer, ErrorKind, SubmitOptions, TransferRequest, Transport,
};
use transport_tcp::wire::{FrameType, Header, WireRegion, SAME_HOST};
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

/// Rule 6 on the caller's thread: a peer whose READ answer does not match
/// the slice (one byte short) is read by the polling caller (the
/// initiator's runtime is not driven while it polls, so no task reads
/// it). Polls never panic and never block; the endpoint breaks, and once
/// its teardown runs the batch ends failed with a protocol error.
#[test]
fn a_malformed_answer_read_by_a_polling_caller_fails_the_batch() {
    let script: Script = Arc::new(|mut s: TcpStream| {
        Box::pin(async move {
            while let Some(h) = fake_peer::next_request(&mut s).await {
                if h.ty != FrameType::Read {
                    return;
                }
                let mut r = Header::new(FrameType::ReadResp);
                r.id = h.id;
                r.len = h.len - 1;
                r.payload_len = (h.len - 1) as u32;
                let bytes = vec![0x5au8; (h.len - 1) as usize];
                if s.write_all(&r.encode()).await.is_err() || s.write_all(&bytes).await.is_err() {
                    return;
                }
            }
        })
    });
    let peer_rt = Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let init_rt = Builder::new_current_thread().enable_all().build().unwrap();
    let peer = peer_rt.block_on(FakePeer::start(script));
    let a = init_rt.block_on(node(test_config()));
    let dst = Buffer::new(PAGE as usize).unwrap();
    let l = a.register(dst.region(), Access::LOCAL).unwrap();
    let seg = init_rt.block_on(a.open_segment(&peer.name())).unwrap();
    let r = TransferRequest::read(l, 0, seg, fake_peer::REGION.addr, PAGE);
    let id = init_rt.block_on(a.submit(vec![r], SubmitOptions::default())).unwrap();
    let tasks = a.stats().tasks;
    {
        // Long enough for the answer to arrive and be read here.
        let _in_rt = init_rt.enter();
        let start = Instant::now();
        while start.elapsed() < Duration::from_millis(300) {
            let s = a.poll(id).unwrap();
            assert!(!s.state.is_terminal() || s.state == BatchState::Failed, "{s:?}");
            std::thread::yield_now();
        }
    }
    assert_eq!(a.stats().tasks, tasks + 1, "the polls read the answer and started the endpoint's teardown");
    // The broken endpoint's teardown (spawned by the caller's poll) runs
    // once the runtime is driven again.
    let s = init_rt.block_on(async { tokio::time::timeout(Duration::from_secs(10), a.wait(id)).await });
    let s = s.expect("the batch ends").unwrap();
    assert_eq!(s.state, BatchState::Failed);
    assert_eq!(s.first_error().map(|e| e.kind()), Some(ErrorKind::Protocol), "{s:?}");
    assert!(dst.to_vec().iter().all(|&b| b == 0), "no byte of the mismatched answer was copied");
    a.release(id).unwrap();
    init_rt.block_on(a.shutdown()).unwrap();
    drop(peer_rt);
}

/// Rule 5 with same-host READ answers copied together (a burst's copies
/// are made after its frames are read): a second answer to a request
/// whose copy is gathered but not made yet is a protocol error and is
/// never applied, whether it brings bytes (written after the request
/// completed, otherwise) or is another same-host answer (ending the request
/// twice). The request completes with the bytes its first answer named,
/// nothing is written into its memory afterwards, and the endpoint is
/// torn down.
#[test]
fn a_second_answer_behind_a_same_host_one_is_never_applied() {
    for with_bytes in [true, false] {
        second_answer(with_bytes);
    }
}

fn second_answer(with_bytes: bool) {
    // The fake peer's memory is this process's: its same-host answers name
    // `src`, which the initiator copies from.
    let src = Buffer::from_slice(&pattern(7, PAGE as usize)).unwrap();
    let region = WireRegion { addr: src.addr(), len: PAGE, read: true, write: true };
    let script: Script = Arc::new(move |mut s: TcpStream| {
        Box::pin(async move {
            while let Some(h) = fake_peer::next_request_on(&mut s, region).await {
                if h.ty != FrameType::Read {
                    return;
                }
                let mut same = Header::new(FrameType::ReadResp);
                (same.id, same.len, same.flags) = (h.id, h.len, SAME_HOST);
                let mut burst = same.encode().to_vec();
                if with_bytes {
                    let mut again = Header::new(FrameType::ReadResp);
                    (again.id, again.len, again.payload_len) = (h.id, h.len, h.len as u32);
                    burst.extend_from_slice(&again.encode());
                    burst.extend(std::iter::repeat_n(0x5au8, h.len as usize));
                } else {
                    burst.extend_from_slice(&same.encode());
                }
                if s.write_all(&burst).await.is_err() {
                    return;
                }
            }
        })
    });
    let rt = Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async {
        let peer = FakePeer::start_on(script, true).await;
        let a = node(test_config()).await;
        let dst = Buffer::new(PAGE as usize).unwrap();
        let l = a.register(dst.region(), Access::LOCAL).unwrap();
        let seg = a.open_segment(&peer.name()).await.unwrap();
        assert_eq!(a.stats().endpoints, 1);
        let r = TransferRequest::read(l, 0, seg, src.addr(), PAGE);
        let id = a.submit(vec![r], SubmitOptions::default()).await.unwrap();
        let s = tokio::time::timeout(Duration::from_secs(10), a.wait(id)).await.expect("the read ends").unwrap();
        assert_eq!(s.state, BatchState::Completed, "{s:?}");
        assert_eq!(a.same_host_bytes(), PAGE, "the first answer was a same-host copy");
        let start = Instant::now();
        while a.stats().endpoints > 0 && start.elapsed() < Duration::from_secs(5) {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(a.stats().endpoints, 0, "the second answer broke the endpoint (with_bytes {with_bytes})");
        assert_eq!(dst.to_vec(), src.to_vec(), "nothing written after the request completed");
        a.release(id).unwrap();
        a.shutdown().await.unwrap();
    });
}
