//! Memory that a transfer engine may read and write behind the caller's back.
//!
//! A transport moves bytes into and out of memory while the caller keeps
//! running, so the memory it touches must outlive every transfer and must not
//! be freed while a NIC or a socket task still writes it. This crate holds
//! the two ways memory enters the engine, and it is the only place outside
//! the RDMA crate where raw pointers are dereferenced:
//!
//! * [`Buffer`]: an owned, zeroed, page-aligned allocation. Registering it
//!   clones a reference, so the allocation lives until the last transport and
//!   the last user handle drop it. This is the safe path for Rust users.
//! * [`MemoryRegion::from_raw`]: memory owned by someone else (an inference
//!   engine's tensors, a Python buffer). It is `unsafe`, and its `# Safety`
//!   section is the contract the caller keeps.
//! * [`PageBuf`]: scratch memory mapped from the kernel and unmapped on
//!   drop, for buffers whose pages must go back to the OS after a burst.
//!
//! * [`CountingAlloc`]: the system allocator, counting live allocations
//!   ([`census`]), which the conformance suite installs to find leaks a
//!   backend's own counts do not show.
//!
//! It also holds the one socket call the transports make that no safe
//! crate offers ([`sock::set_recv_lowat`]), so that their crates stay free
//! of `unsafe`.
//!
//! Every access goes through [`MemoryRegion::read_at`] / [`MemoryRegion::write_at`]
//! which check offset, length and overflow before touching a byte, so a
//! wrong request from a peer becomes an error, never a stray write.
//!
//! Concurrency: the engine writes a region from its own threads while a
//! transfer is in flight. Reading bytes of a range that is being written
//! gives unspecified bytes (a mix of old and new), exactly as with DMA; the
//! engine's contract ("terminal means quiet") says when a range is settled.
#![deny(unsafe_code)]

mod buffer;
pub mod census;
pub mod cma;
#[cfg(feature = "cuda")]
mod cuda;
mod device;
mod error;
mod fake;
pub mod numa;
mod pages;
pub mod providers;
mod region;
pub mod sock;
pub mod window;

pub use buffer::Buffer;
pub use census::{census, Census, CountingAlloc};
#[cfg(feature = "cuda")]
pub use cuda::{CudaAlloc, CudaDevices, StreamPoint};
pub use device::{DeviceMemory, DmaBuf, MemoryKind};
pub use error::MemError;
pub use fake::FakeDevice;
pub use pages::{PageBuf, PinnedBuf};
pub use region::MemoryRegion;
