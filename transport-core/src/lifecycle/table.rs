//! The table of submitted batches: lookup and `release` with the trait's
//! errors, for any per-batch type a driver keeps.

use super::IdMap;
use crate::error::{Error, Result};
use crate::types::BatchId;

/// Batches by id, with ids that are never reused within the table.
#[derive(Debug)]
pub struct BatchTable<B> {
    batches: IdMap<BatchId, B>,
    next: u64,
}

impl<B> Default for BatchTable<B> {
    fn default() -> Self {
        Self { batches: IdMap::default(), next: 1 }
    }
}

impl<B> BatchTable<B> {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// Stores `batch` under a fresh id.
    pub fn insert(&mut self, batch: B) -> BatchId {
        let id = BatchId(self.next);
        self.next += 1;
        self.batches.insert(id, batch);
        id
    }

    /// The batch, or `InvalidHandle` (unknown or released).
    pub fn get(&self, id: BatchId) -> Result<&B> {
        self.batches.get(&id).ok_or_else(|| Error::unknown_batch(id))
    }

    /// The batch, mutably, or `InvalidHandle`.
    pub fn get_mut(&mut self, id: BatchId) -> Result<&mut B> {
        self.batches.get_mut(&id).ok_or_else(|| Error::unknown_batch(id))
    }

    /// Forgets a terminal batch: `InvalidHandle` if unknown or released,
    /// `InvalidRequest` if `is_terminal` says it is still in progress.
    pub fn release(&mut self, id: BatchId, is_terminal: impl FnOnce(&B) -> bool) -> Result<B> {
        let b = self.batches.get(&id).ok_or_else(|| Error::unknown_batch(id))?;
        if !is_terminal(b) {
            return Err(Error::batch_in_progress(id));
        }
        self.batches.remove(&id).ok_or_else(|| Error::unknown_batch(id))
    }

    /// Removes a batch whatever its state (a submit that failed to start).
    pub fn remove(&mut self, id: BatchId) -> Option<B> {
        self.batches.remove(&id)
    }

    /// Every batch.
    pub fn iter(&self) -> impl Iterator<Item = (&BatchId, &B)> {
        self.batches.iter()
    }

    /// Every batch, mutably.
    pub fn iter_mut(&mut self) -> impl Iterator<Item = (&BatchId, &mut B)> {
        self.batches.iter_mut()
    }

    /// Removes every batch (teardown).
    pub fn drain(&mut self) -> Vec<(BatchId, B)> {
        self.batches.drain().collect()
    }

    /// Batches not yet released.
    pub fn len(&self) -> usize {
        self.batches.len()
    }

    /// Whether no batch is held.
    pub fn is_empty(&self) -> bool {
        self.batches.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;

    #[test]
    fn release_refuses_in_progress_and_unknown() {
        let mut t = BatchTable::new();
        let a = t.insert(false);
        let b = t.insert(true);
        assert_ne!(a, b);
        assert_eq!(t.release(a, |d| *d).map_err(|e| e.kind()).err(), Some(ErrorKind::InvalidRequest));
        assert!(t.release(b, |d| *d).is_ok());
        assert_eq!(t.release(b, |d| *d).map_err(|e| e.kind()).err(), Some(ErrorKind::InvalidHandle));
        assert_eq!(t.len(), 1);
    }
}
