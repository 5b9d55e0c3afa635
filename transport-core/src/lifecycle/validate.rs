//! Batch validation (the `submit` rules of the trait and rule 9's local
//! checks), written once. Every error names the failing request's index in
//! its context (`request`) and starts nothing.

use crate::error::{Error, ErrorKind, Result};
use crate::stats::Capabilities;
use crate::types::{RegionId, SegmentId, TransferRequest};

/// The size limits a backend announces in its [`Capabilities`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchLimits {
    /// Most requests in one batch.
    pub max_batch_len: usize,
    /// Largest single request in bytes.
    pub max_request_len: u64,
}

impl From<&Capabilities> for BatchLimits {
    fn from(c: &Capabilities) -> Self {
        Self { max_batch_len: c.max_batch_len, max_request_len: c.max_request_len }
    }
}

/// The batch as a whole: 1 ..= `max_batch_len` requests.
fn check_batch_len(len: usize, limits: BatchLimits) -> Result<()> {
    if len == 0 {
        return Err(Error::new(ErrorKind::InvalidRequest, "empty batch"));
    }
    if len > limits.max_batch_len {
        return Err(Error::new(ErrorKind::InvalidRequest, "batch is longer than max_batch_len")
            .with("len", len)
            .with("max_batch_len", limits.max_batch_len));
    }
    Ok(())
}

/// The checks of one request that need no lookup: non-zero length within
/// `max_request_len`, and `remote_addr + len` does not overflow.
fn check_request_shape(i: usize, r: &TransferRequest, limits: BatchLimits) -> Result<()> {
    if r.len == 0 {
        return Err(Error::new(ErrorKind::InvalidRequest, "zero-length request").with("request", i));
    }
    if r.len > limits.max_request_len {
        return Err(Error::new(ErrorKind::InvalidRequest, "request longer than max_request_len")
            .with("request", i)
            .with("len", r.len)
            .with("max_request_len", limits.max_request_len));
    }
    if r.remote_addr.checked_add(r.len).is_none() {
        return Err(Error::new(ErrorKind::OutOfBounds, "remote address + length overflows").with("request", i));
    }
    Ok(())
}

/// Checks that `offset .. offset + len` lies inside a local region of
/// `region_len` bytes (no overflow).
fn check_local_range(i: usize, r: &TransferRequest, region_len: u64) -> Result<()> {
    match r.local_offset.checked_add(r.len) {
        Some(end) if end <= region_len => Ok(()),
        _ => Err(Error::new(ErrorKind::OutOfBounds, "request lies outside its local region")
            .with("request", i)
            .with("region", r.local)
            .with("offset", r.local_offset)
            .with("len", r.len)
            .with("region_len", region_len)),
    }
}

/// Validates a whole batch and returns each request's local region as the
/// driver resolved it (in request order).
///
/// `local(id)` resolves a registered region to the driver's handle and its
/// length (`None`: unknown or unregistered). `segment(id)` says whether the
/// segment handle is open. Consecutive requests naming the same region are
/// resolved once.
///
/// Order of checks per request: shape (`check_request_shape`), local
/// region known, local range, segment known.
pub fn validate_batch<L: Clone>(
    requests: &[TransferRequest],
    limits: BatchLimits,
    mut local: impl FnMut(RegionId) -> Option<(L, u64)>,
    mut segment: impl FnMut(SegmentId) -> bool,
) -> Result<Vec<L>> {
    check_batch_len(requests.len(), limits)?;
    let mut out = Vec::with_capacity(requests.len());
    let mut last: Option<(RegionId, L, u64)> = None;
    let mut last_seg: Option<SegmentId> = None;
    for (i, r) in requests.iter().enumerate() {
        check_request_shape(i, r, limits)?;
        let (handle, len) = match &last {
            Some((id, h, len)) if *id == r.local => (h.clone(), *len),
            _ => {
                let (h, len) = local(r.local).ok_or_else(|| Error::unknown_region(r.local).with("request", i))?;
                last = Some((r.local, h.clone(), len));
                (h, len)
            }
        };
        check_local_range(i, r, len)?;
        if last_seg != Some(r.segment) {
            if !segment(r.segment) {
                return Err(Error::unknown_segment(r.segment).with("request", i));
            }
            last_seg = Some(r.segment);
        }
        out.push(handle);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: BatchLimits = BatchLimits { max_batch_len: 4, max_request_len: 1 << 20 };

    fn run(reqs: &[TransferRequest]) -> Result<Vec<u64>> {
        validate_batch(reqs, LIMITS, |id| (id == RegionId(1)).then_some((id.0, 4096)), |s| s == SegmentId(9))
    }

    fn w(off: u64, addr: u64, len: u64) -> TransferRequest {
        TransferRequest::write(RegionId(1), off, SegmentId(9), addr, len)
    }

    fn fails(reqs: &[TransferRequest], kind: ErrorKind, index: Option<&str>) {
        let e = run(reqs).expect_err("must be refused");
        assert_eq!(e.kind(), kind, "{e}");
        assert_eq!(e.context_value("request"), index, "{e}");
    }

    #[test]
    fn every_bad_shape_is_refused_with_its_index() {
        assert_eq!(run(&[w(0, 0, 4096), w(0, 0, 1)]).ok(), Some(vec![1, 1]));
        fails(&[], ErrorKind::InvalidRequest, None);
        fails(&[w(0, 0, 1); 5], ErrorKind::InvalidRequest, None);
        fails(&[w(0, 0, 1), w(0, 0, 0)], ErrorKind::InvalidRequest, Some("1"));
        fails(&[w(0, 0, (1 << 20) + 1)], ErrorKind::InvalidRequest, Some("0"));
        fails(&[w(1, 0, 4096)], ErrorKind::OutOfBounds, Some("0"));
        fails(&[w(u64::MAX, 0, 2)], ErrorKind::OutOfBounds, Some("0"));
        fails(&[w(0, u64::MAX, 2)], ErrorKind::OutOfBounds, Some("0"));
        let mut unknown = w(0, 0, 1);
        unknown.local = RegionId(2);
        fails(&[w(0, 0, 1), unknown], ErrorKind::InvalidHandle, Some("1"));
        let mut closed = w(0, 0, 1);
        closed.segment = SegmentId(3);
        fails(&[closed], ErrorKind::InvalidHandle, Some("0"));
    }
}
