//! The transport's ids and the unit of work they name: small plain types
//! every module uses (a leaf: it imports nothing of the crate).

use transport_core::BatchId;

/// A work request's id (the `wr_id` the CQ hands back).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct WrId(pub u64);

/// The source of [`WrId`]s: one counter, never reused within a transport.
#[derive(Debug, Default)]
pub(crate) struct WrIds(u64);

impl WrIds {
    pub(crate) fn next(&mut self) -> WrId {
        self.0 += 1;
        WrId(self.0)
    }
}

/// A QP group a peer holds into this transport (one served side channel).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct PeerGroupId(pub u64);

/// A piece of a request, posted as one work request (one ledger unit).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Slice {
    pub batch: BatchId,
    pub req: usize,
    pub offset: u64,
    pub len: u32,
}
