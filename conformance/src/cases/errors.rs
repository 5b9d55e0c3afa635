//! Errors say what to do (rule 7): peer failures are transient.

use std::time::Duration;

use transport_core::{ErrorKind, SubmitOptions};

use crate::ctx::{bounded, run_batch, Ctx};
use crate::ensure;
use crate::outcome::CaseResult;

/// A transfer to a killed peer fails with a transient error (of a peer
/// kind or a timeout), and opening the dead peer anew is transient too.
pub async fn peer_failures_are_transient(cx: Ctx) -> CaseResult {
    let p = cx.pair(64 << 10).await?;
    let t = p.t().clone();
    cx.kill(&p.b).await?;
    let r = run_batch(&t, vec![p.write(0, 0, 4096)], SubmitOptions::with_timeout(Duration::from_secs(5))).await?;
    let e = match r {
        Err(e) => Some(e),
        Ok(s) => {
            ensure!(
                matches!(s.state, transport_core::BatchState::Failed | transport_core::BatchState::TimedOut),
                "a transfer to a killed peer ended {:?}",
                s.state
            );
            s.first_error().cloned()
        }
    };
    if let Some(e) = e {
        ensure!(e.is_transient(), "a transfer to a killed peer failed with a permanent error: {e} (rule 7)");
        ensure!(e.kind().is_peer_failure(), "a killed peer must count as a peer failure, got {e}");
    }
    match bounded("open_segment of a killed peer", t.open_segment(&p.b.name)).await? {
        Ok(_) => {}
        Err(e) => ensure!(
            e.is_transient() || e.kind() == ErrorKind::NotFound,
            "opening a killed peer failed with a permanent error: {e} (rule 7)"
        ),
    }
    Ok(())
}
