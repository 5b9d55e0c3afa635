//! Open file descriptors and stats return to baseline after open, transfer,
//! close and shutdown (rule 1). Alone in its own test binary: the process's
//! descriptor count is only meaningful when no other test opens sockets in
//! the same process at the same time.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failure should panic

mod support;

use support::run;

use std::time::Duration;

use support::{node, test_config};
use transport_core::{Access, Buffer, ErrorKind, TransferRequest, Transport};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fds_and_stats_return_to_baseline() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let fds = support::open_fds();
        for _ in 0..3 {
            let (a, b) = (node(test_config()).await, node(test_config()).await);
            let (src, dst) = (Buffer::new(1 << 20).unwrap(), Buffer::new(1 << 20).unwrap());
            let l = a.register(src.region(), Access::LOCAL).unwrap();
            b.register(dst.region(), Access::REMOTE_RW).unwrap();
            let seg = a.open_segment(&b.local_segment_name()).await.unwrap();
            assert_eq!(a.stats().endpoints, 1);
            assert_eq!(a.stats().endpoint_lanes, 4);
            run(&a, vec![TransferRequest::write(l, 0, seg, dst.addr(), 1 << 20)]).await;
            a.close_segment(seg).await.unwrap();
            assert_eq!(a.stats().endpoints, 0);
            assert_eq!(a.stats().endpoint_lanes, 0);
            assert_eq!(a.close_segment(seg).await.unwrap_err().kind(), ErrorKind::InvalidHandle);
            a.shutdown().await.unwrap();
            b.shutdown().await.unwrap();
            assert_eq!(a.stats(), Default::default());
            assert_eq!(b.stats(), Default::default());
        }
        let mut now = support::open_fds();
        for _ in 0..100 {
            if now == fds {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
            now = support::open_fds();
        }
        assert_eq!(now, fds, "open file descriptors back to baseline");
    })
    .await
    .expect("test timed out");
}
