//! Hash maps keyed by the ids a driver hands out itself (batches,
//! endpoints, segments, work requests): [`IdMap`] hashes them with one
//! multiply per word instead of SipHash's rounds. The keys are sequential
//! numbers that no peer or caller picks, so the flooding attack that
//! SipHash defends against does not apply; maps keyed by anything from
//! outside (names, addresses) keep the standard hasher.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// The multiplier of the Fx hash (rustc's): odd, so multiplying is a
/// bijection on the low bits, and sequential keys fill the buckets evenly.
const K: u64 = 0x51_7c_c1_b7_27_22_0a_95;

/// A fast, non-keyed hasher for the driver's own ids (see the module docs).
#[derive(Debug, Default, Clone, Copy)]
pub struct IdHasher(u64);

impl IdHasher {
    fn add(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(K);
    }
}

impl Hasher for IdHasher {
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut w = [0u8; 8];
            w[..chunk.len()].copy_from_slice(chunk);
            self.add(u64::from_le_bytes(w));
        }
    }

    fn write_u8(&mut self, n: u8) {
        self.add(u64::from(n));
    }

    fn write_u16(&mut self, n: u16) {
        self.add(u64::from(n));
    }

    fn write_u32(&mut self, n: u32) {
        self.add(u64::from(n));
    }

    fn write_u64(&mut self, n: u64) {
        self.add(n);
    }

    fn write_usize(&mut self, n: usize) {
        self.add(n as u64);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

/// Builds [`IdHasher`]s.
pub type IdBuildHasher = BuildHasherDefault<IdHasher>;
/// A map keyed by driver-made ids.
pub type IdMap<K, V> = HashMap<K, V, IdBuildHasher>;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::BatchId;
    use std::collections::HashSet;
    use std::hash::{BuildHasher, Hash};

    fn hash<T: Hash>(t: &T) -> u64 {
        IdBuildHasher::default().hash_one(t)
    }

    #[test]
    fn sequential_ids_hash_apart_and_fill_low_bits() {
        let hashes: HashSet<u64> = (0..10_000u64).map(|i| hash(&BatchId(i))).collect();
        assert_eq!(hashes.len(), 10_000, "distinct ids must not collide");
        // hashbrown picks the bucket from the low bits: 1024 sequential
        // ids must spread over the 1024 buckets of a 1024-bucket table.
        let buckets: HashSet<u64> = (0..1024u64).map(|i| hash(&BatchId(i)) & 1023).collect();
        assert_eq!(buckets.len(), 1024);
    }

    #[test]
    fn bytes_and_words_agree_and_length_matters() {
        let mut a = IdHasher::default();
        a.write(&7u64.to_le_bytes());
        let mut b = IdHasher::default();
        b.write_u64(7);
        assert_eq!(a.finish(), b.finish());
        assert_ne!(hash(&(1u64, 2u64)), hash(&(2u64, 1u64)));
    }

    #[test]
    fn a_map_works_as_a_map() {
        let mut m: IdMap<BatchId, u32> = IdMap::default();
        for i in 0..100 {
            m.insert(BatchId(i), i as u32);
        }
        assert_eq!(m.get(&BatchId(42)), Some(&42));
        assert_eq!(m.remove(&BatchId(42)), Some(42));
        assert_eq!(m.get(&BatchId(42)), None);
        assert_eq!(m.len(), 99);
    }
}
