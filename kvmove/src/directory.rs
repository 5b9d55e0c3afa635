//! Logical names through a metadata store: a peer publishes its descriptor
//! under a name; others resolve the name, open the address it names and
//! check that the peer serves the generation the store advertises.

use kvmove_policy::Engine;
use transport_core::{Error, ErrorKind, MetadataStore, Result, SegmentDescriptor, SegmentId};

/// Publishes this engine's descriptor under the logical `name`. The stored
/// descriptor is the one peers get from the engine itself (same generation
/// and regions; see [`Engine::local_descriptor`]), renamed to `name`, with `address` set to the segment name
/// to open (`host:port` for TCP and RDMA).
pub async fn publish(engine: &Engine, store: &dyn MetadataStore, name: &str) -> Result<SegmentDescriptor> {
    let mut desc = engine.local_descriptor()?;
    desc.address = engine.local_segment_name();
    desc.name = name.to_owned();
    store.put(desc.clone()).await.map_err(|e| e.with("publishing", name))?;
    Ok(desc)
}

/// Opens the peer published as `name` and returns the handle with the
/// descriptor the peer serves.
///
/// # Errors
/// - `NotFound` when nothing is published under `name`;
/// - the open's error (e.g. transient `ConnectionRefused`) when the address
///   does not answer;
/// - transient `PeerRestarted` when the peer serves another generation than
///   the store advertises (it restarted and its entry is stale); the handle
///   is closed, never used.
pub async fn resolve(engine: &Engine, store: &dyn MetadataStore, name: &str) -> Result<(SegmentId, SegmentDescriptor)> {
    let advertised = store
        .get(name)
        .await
        .map_err(|e| e.with("resolving", name))?
        .ok_or_else(|| Error::new(ErrorKind::NotFound, format!("nothing is published under the name '{name}'")))?;
    let (segment, served) = open(engine, &advertised.address).await.map_err(|e| e.with("name", name))?;
    if advertised.generation != served.generation {
        let _ = engine.close_segment(segment).await;
        return Err(Error::new(
            ErrorKind::PeerRestarted,
            format!(
                "'{name}' is advertised with generation {} but the peer at {} serves generation {} (it restarted; \
                 its entry is stale)",
                advertised.generation, advertised.address, served.generation
            ),
        ));
    }
    Ok((segment, served))
}

/// Opens a segment by its address (`host:port`) and returns the handle with
/// its descriptor; the error says which address did not answer.
pub async fn open(engine: &Engine, address: &str) -> Result<(SegmentId, SegmentDescriptor)> {
    let segment = engine.open_segment(address).await.map_err(|e| {
        // The context (how many tries over how long, the peer) is kept.
        let reached = Error::new(e.kind(), format!("cannot reach {address}: {}", e.message()));
        e.context().iter().fold(reached, |r, (k, v)| r.with(k, v)).with("segment", address)
    })?;
    match engine.segment_descriptor(segment) {
        Ok(d) => Ok((segment, d)),
        Err(e) => {
            let _ = engine.close_segment(segment).await;
            Err(e)
        }
    }
}
