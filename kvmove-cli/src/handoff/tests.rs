//! The handoff scenario over real sockets (TCP on 127.0.0.1): several prefill
//! senders, one decode whose memory is saturated. With sessions no request
//! fails while the decode is busy; the way connectors work today (timeouts
//! from arrival, no grants) fails many; a killed decode fails every open
//! session within the liveness timeout.

use std::time::Duration;

use super::{run, Flow, HandoffConfig};
use kvmove::EngineConfig;

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(4).enable_all().build().unwrap()
}

/// 4 senders x 8 requests of 256 KiB; the decode holds 2 at a time and
/// keeps each page 100 ms after it landed: about 1.6 s to drain, while
/// today's timeout from arrival is 500 ms. A grant's deadline (from the
/// grant) is 20 s: in CI, next to three other test binaries and the VM,
/// one session once took over 5 s from its grant to its end.
fn saturated() -> HandoffConfig {
    HandoffConfig {
        senders: 4,
        requests: 8,
        request_bytes: 256 << 10,
        layers: 4,
        decode_pages: 2,
        hold: Duration::from_millis(100),
        grant_deadline: Duration::from_secs(20),
        arrival_timeout: Duration::from_millis(500),
        liveness: Duration::from_millis(600),
        kill_decode_after: None,
    }
}

#[test]
fn sessions_never_fail_a_busy_decode_and_today_does() {
    rt().block_on(async {
        let cfg = EngineConfig::from_toml_str("").unwrap();
        let c = saturated();
        let with = tokio::time::timeout(Duration::from_secs(60), run(&cfg, &c, Flow::Sessions)).await.unwrap().unwrap();
        eprintln!("sessions: {with:?}");
        assert_eq!(with.landed, with.requests, "{:?}", with.failed);
        assert!(with.failed.is_empty());
        assert_eq!(with.disagreements, 0, "both sides end the same, bytes verified");
        // Waiting for the grant took longer than today's timeout: the busy
        // decode was waited for, not given up on.
        assert!(with.grant_wait.max_us > 500_000.0, "{:?}", with.grant_wait);
        // Senders' in-flight bytes stay within what the decode granted.
        assert!(with.max_inflight_bytes <= 2 * (256 << 10), "{}", with.max_inflight_bytes);

        let today = tokio::time::timeout(Duration::from_secs(60), run(&cfg, &c, Flow::Today)).await.unwrap().unwrap();
        eprintln!("today: {today:?}");
        assert!(today.landed < today.requests, "the saturated decode fails requests today");
        assert!(!today.failed.is_empty());
    });
}

#[test]
fn killed_decode_fails_every_open_session_within_liveness() {
    rt().block_on(async {
        let cfg = EngineConfig::from_toml_str("").unwrap();
        let c = HandoffConfig { kill_decode_after: Some(Duration::from_millis(400)), ..saturated() };
        let r = tokio::time::timeout(Duration::from_secs(60), run(&cfg, &c, Flow::Sessions)).await.unwrap().unwrap();
        eprintln!("{r:?}");
        assert!(r.open_at_kill > 0, "sessions were open when the decode died");
        assert!(r.landed < r.requests);
        let failed: usize = r.failed.values().sum();
        assert_eq!(r.landed + failed, r.requests, "every request ended: {:?}", r.failed);
        let slowest = r.slowest_fail_after_kill.unwrap();
        assert!(slowest <= c.liveness + Duration::from_millis(1500), "{slowest:?}");
    });
}
