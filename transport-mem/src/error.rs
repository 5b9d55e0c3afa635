//! The error of every memory operation.

/// Why a memory access or allocation was refused. Always the caller's (or
/// the remote peer's) mistake; never retried.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MemError {
    /// `offset + len` runs past the end of the region (or overflows).
    #[error("access of {len} bytes at offset {offset} is outside a region of {region_len} bytes")]
    OutOfBounds { offset: u64, len: u64, region_len: u64 },
    /// A zero-length buffer or region was asked for.
    #[error("zero-length memory is not allowed")]
    ZeroLength,
    /// The allocator refused.
    #[error("allocation of {len} bytes failed")]
    AllocFailed { len: usize },
    /// `addr + len` overflows the address space, or `addr` is null.
    #[error("region at {addr:#x} of {len} bytes is not a valid address range")]
    BadRange { addr: u64, len: u64 },
    /// A range given as device memory is not (entirely) the provider's.
    #[error("{len} bytes at {addr:#x} are not device memory of the {provider} provider")]
    NotDeviceMemory { addr: u64, len: u64, provider: String },
    /// The device provider failed a copy to or from device memory.
    #[error("a copy to or from device {device} failed: {why}")]
    DeviceCopy { device: u32, why: String },
    /// A same-host copy from another process's memory (`pull_at`) failed:
    /// the process is gone, the address is not mapped there, or the kernel
    /// refused the access.
    #[error("a same-host copy from process {pid} failed: {why}")]
    ProcessCopy { pid: u32, why: String },
}
