//! Test data and its verification: a seeded pattern per pass, and xxh3
//! checksums of every request's bytes at the source and the destination.

use kvmove::Buffer;
use rand::{RngCore, SeedableRng};
use xxhash_rust::xxh3::Xxh3;

use crate::plan::Req;

/// Chunk used to fill and hash buffers without large temporaries.
const CHUNK: usize = 1 << 20;

/// Fills `buf` with a pseudo-random pattern of `seed`; every pass uses a
/// new seed, so bytes left from an earlier pass never verify.
pub fn fill(buf: &Buffer, seed: u64) -> kvmove::Result<()> {
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
    let mut chunk = vec![0u8; CHUNK.min(buf.len())];
    let mut off = 0;
    while off < buf.len() {
        let n = chunk.len().min(buf.len() - off);
        rng.fill_bytes(&mut chunk[..n]);
        buf.write_at(off, &chunk[..n])?;
        off += n;
    }
    Ok(())
}

/// Which side of a request a checksum reads.
#[derive(Debug, Clone, Copy)]
pub enum Side {
    /// The initiator's buffer, at `local_off`.
    Local,
    /// The target's buffer, at `remote_off`.
    Remote,
}

/// xxh3-64 of each request's bytes in `buf` (at the side's offset).
pub fn checksums<'a>(buf: &Buffer, reqs: impl Iterator<Item = &'a Req>, side: Side) -> kvmove::Result<Vec<u64>> {
    let mut scratch = vec![0u8; CHUNK];
    let mut out = Vec::new();
    for r in reqs {
        let start = match side {
            Side::Local => r.local_off,
            Side::Remote => r.remote_off,
        };
        out.push(hash_range(buf, start, r.len, &mut scratch)?);
    }
    Ok(out)
}

fn hash_range(buf: &Buffer, start: u64, len: u64, scratch: &mut [u8]) -> kvmove::Result<u64> {
    let mut h = Xxh3::new();
    let mut done = 0u64;
    while done < len {
        let n = (scratch.len() as u64).min(len - done) as usize;
        let off = usize::try_from(start + done).map_err(|_| {
            kvmove::Error::new(kvmove::ErrorKind::OutOfBounds, "offset does not fit this machine's address space")
        })?;
        buf.read_at(off, &mut scratch[..n])?;
        h.update(&scratch[..n]);
        done += n as u64;
    }
    Ok(h.digest())
}

/// What a verification found.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Verification {
    pub requests: u64,
    pub bytes: u64,
    pub mismatched: u64,
}

/// Compares expected and actual checksums request by request.
pub fn compare<'a>(expected: &[u64], actual: &[u64], reqs: impl Iterator<Item = &'a Req>) -> Verification {
    let mut v = Verification::default();
    for ((e, a), r) in expected.iter().zip(actual).zip(reqs) {
        if e == a {
            v.requests += 1;
            v.bytes += r.len;
        } else {
            v.mismatched += 1;
        }
    }
    // Missing checksums on either side count as mismatches.
    v.mismatched += expected.len().abs_diff(actual.len()) as u64;
    v
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn checksums_see_a_single_changed_byte() {
        let a = Buffer::new(3 << 20).unwrap();
        let b = Buffer::new(3 << 20).unwrap();
        fill(&a, 7).unwrap();
        fill(&b, 7).unwrap();
        let reqs = [Req { local_off: 100, remote_off: 100, len: (2 << 20) + 5 }];
        let ea = checksums(&a, reqs.iter(), Side::Local).unwrap();
        assert_eq!(ea, checksums(&b, reqs.iter(), Side::Local).unwrap());
        b.write_at((1 << 20) + 3, &[0xAA]).unwrap();
        let eb = checksums(&b, reqs.iter(), Side::Local).unwrap();
        let v = compare(&ea, &eb, reqs.iter());
        assert_eq!(v.mismatched, 1);
        fill(&b, 8).unwrap();
        assert_ne!(ea, checksums(&b, reqs.iter(), Side::Local).unwrap(), "a new seed gives new bytes");
    }
}
