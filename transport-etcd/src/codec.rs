//! Descriptors on the wire: JSON of `SegmentDescriptor` under its key.

use transport_core::{Error, ErrorKind, Result, SegmentDescriptor};

use crate::error::Ctx;

/// The JSON stored for a descriptor.
pub(crate) fn encode(desc: &SegmentDescriptor, ctx: &Ctx<'_>) -> Result<Vec<u8>> {
    serde_json::to_vec(desc).map_err(|e| ctx.error(ErrorKind::Internal, format_args!("cannot encode descriptor: {e}")))
}

/// Parses the bytes stored under the key of segment `name`. Bytes that are
/// not a descriptor, or a descriptor of another segment, are a `Protocol`
/// error: someone else wrote under our prefix, or a version skew.
pub(crate) fn decode(bytes: &[u8], name: &str, ctx: &Ctx<'_>) -> Result<SegmentDescriptor> {
    let desc: SegmentDescriptor = serde_json::from_slice(bytes).map_err(|e| {
        ctx.error(
            ErrorKind::Protocol,
            format_args!("the value is not a segment descriptor ({} bytes): {e}", bytes.len()),
        )
    })?;
    if desc.name != name {
        return Err(ctx
            .error(ErrorKind::Protocol, format_args!("the descriptor names segment {:?}, not {:?}", desc.name, name)));
    }
    Ok(desc)
}

/// A segment name must be a non-empty key suffix without control characters.
pub(crate) fn check_name(name: &str) -> Result<()> {
    if name.is_empty() || name.chars().any(char::is_control) {
        return Err(Error::new(ErrorKind::InvalidRequest, "segment name must be non-empty and printable")
            .with("segment", format_args!("{name:?}")));
    }
    Ok(())
}
