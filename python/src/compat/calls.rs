//! What the Mooncake API's calls share below the Python surface: running
//! a transfer to its end (and its notification after it), building the
//! operations from Mooncake's parallel lists, and reading its opcodes and
//! the policy override.

use kvmove_policy::TransferOutcome;
use transport_core::{Opcode, Result};

use crate::core::{Core, RawOp};
use crate::errors::invalid;

/// Mooncake's opcode numbering (`TransferOpcode.Read` / `.Write`).
const OPCODE_READ: i64 = 0;
const OPCODE_WRITE: i64 = 1;

/// Submits, waits, and drops the cached segment if the peer went away.
/// With `notify`, the message goes to the target once every request
/// completed (so after every byte landed: rule 5); a transfer that did not
/// complete sends nothing.
pub(super) fn run_sync(core: &Core, target: &str, ops: &[RawOp], notify: Option<Vec<u8>>) -> Result<()> {
    // Opened also for a call with nothing to move: Mooncake fails one to
    // a peer it cannot reach.
    let seg = core.cached_segment(target)?;
    if !ops.is_empty() {
        let reqs = core.requests(seg, ops)?;
        core.transfer(reqs)
            .and_then(TransferOutcome::into_result)
            .inspect_err(|e| core.forget_segment_after(target, seg, e))?;
    }
    if let Some(msg) = notify {
        core.notify_segment(seg, msg)
            .map_err(|e| e.with("while", "sending the notification (the data landed)"))
            .inspect_err(|e| core.forget_segment_after(target, seg, e))?;
    }
    Ok(())
}

pub(super) fn ops_from(op: Opcode, buffers: &[u64], peers: &[u64], lengths: &[u64]) -> Result<Vec<RawOp>> {
    if buffers.len() != peers.len() || buffers.len() != lengths.len() {
        return Err(invalid("buffers, peer_buffer_addresses and lengths have different lengths")
            .with("buffers", buffers.len())
            .with("peer_buffer_addresses", peers.len())
            .with("lengths", lengths.len()));
    }
    Ok(buffers
        .iter()
        .zip(peers)
        .zip(lengths)
        .map(|((&local_addr, &remote_addr), &len)| RawOp { op, local_addr, remote_addr, len })
        .collect())
}

pub(super) fn parse_opcode(code: i64) -> Result<Opcode> {
    match code {
        OPCODE_READ => Ok(Opcode::Read),
        OPCODE_WRITE => Ok(Opcode::Write),
        _ => Err(invalid("opcode must be TransferOpcode.Read (0) or TransferOpcode.Write (1)").with("opcode", code)),
    }
}
