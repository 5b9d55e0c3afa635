//! Backends are chosen by config (rule 10): the backend works behind
//! `Arc<dyn Transport>` with the policy layer configured from serde.

use std::sync::Arc;

use kvmove_policy::{Engine, PolicyConfig};
use transport_core::Transport;

use crate::ctx::Ctx;
use crate::ensure;
use crate::outcome::{CaseError, CaseResult};

/// The node's transport, held only as `Arc<dyn Transport>`, reports sane
/// capabilities and its own segment name, and runs a transfer through an
/// [`Engine`] whose policy was read from JSON.
pub async fn works_behind_dyn_transport(cx: Ctx) -> CaseResult {
    let p = cx.pair(64 << 10).await?;
    let t: Arc<dyn Transport> = p.t().clone();
    ensure!(!t.backend().is_empty(), "backend() is empty");
    ensure!(
        t.local_segment_name() == p.a.name,
        "local_segment_name() is {:?}, the harness says {:?}",
        t.local_segment_name(),
        p.a.name
    );
    let caps = t.capabilities();
    ensure!(
        caps.write && caps.max_batch_len >= 1 && caps.max_request_len >= 1 && caps.max_endpoints >= 1,
        "capabilities are not usable: {caps:?}"
    );
    let d = t.segment_descriptor(p.seg)?;
    ensure!(d.name == p.b.name, "the descriptor names {:?}, opened {:?}", d.name, p.b.name);
    let cfg: PolicyConfig = serde_json::from_str(r#"{"retry": {"max_attempts": 2}, "deadline": {"base_ms": 10000}}"#)
        .map_err(|e| CaseError::Fail(format!("policy JSON: {e}")))?;
    let engine = Engine::new(t, cfg)?;
    let seg = engine.open_segment(&p.b.name).await?;
    let req = transport_core::TransferRequest { segment: seg, ..p.write(0, 0, 4096) };
    let out = crate::ctx::bounded("engine transfer", engine.transfer(vec![req])).await??;
    ensure!(out.is_success() && out.attempts == 1, "engine transfer: {:?} after {} attempts", out.state, out.attempts);
    p.remote.expect(
        &{
            let mut m = p.remote.snapshot();
            m[..4096].copy_from_slice(&p.local.snapshot()[..4096]);
            m
        },
        "engine transfer result",
    )?;
    Ok(())
}
