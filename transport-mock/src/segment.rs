//! An opened segment handle: the peer's name and the descriptor it was
//! opened with (refreshed when a peer restart is noticed).

use parking_lot::Mutex;
use transport_core::{SegmentDescriptor, SegmentId};

#[derive(Debug)]
pub(crate) struct SegmentEntry {
    pub id: SegmentId,
    pub name: String,
    descriptor: Mutex<SegmentDescriptor>,
}

impl SegmentEntry {
    pub fn new(id: SegmentId, descriptor: SegmentDescriptor) -> Self {
        Self { id, name: descriptor.name.clone(), descriptor: Mutex::new(descriptor) }
    }

    pub fn descriptor(&self) -> SegmentDescriptor {
        self.descriptor.lock().clone()
    }

    pub fn generation(&self) -> u64 {
        self.descriptor.lock().generation
    }

    pub fn refresh(&self, descriptor: SegmentDescriptor) {
        *self.descriptor.lock() = descriptor;
    }
}
