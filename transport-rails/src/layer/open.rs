//! Opening a peer by name: its control handle, then one handle per path
//! (a local rail paired with one of the peer's advertised rails, reached
//! on the host the peer was opened by); closing them; checking a remote
//! range against the peer's rails.

use super::*;

impl Rails {
    /// Opens the paths to the peer whose rail 0 is open as `control`.
    /// Also returns the rails of the peer nearest each of its regions, and
    /// the descriptor address that said so.
    pub(super) async fn open_paths(&self, name: &str, control: SegmentId) -> Result<(Vec<Path>, NearList, String)> {
        let inner = &self.inner;
        let desc = inner.all[0].segment_descriptor(control)?;
        let list = RailList::parse(&desc.address)?;
        let mut peer: Vec<String> = list.as_ref().map(|l| l.rails.clone()).unwrap_or_default();
        if peer.is_empty() {
            peer.push(name.to_string());
        }
        let near = NearList::parse(&desc.address, peer.len())?;
        // The name the caller opened reaches the peer's rail 0 (it may be
        // spelled differently from the peer's own list). The other rails
        // listen on the same host: only their ports are taken from the
        // list, so a peer cannot send us to connect anywhere else.
        peer[0] = name.to_string();
        for p in peer.iter_mut().skip(1) {
            *p = same_host(name, p);
        }
        let tcp = list.and_then(|l| l.tcp).map(|t| same_host(name, &t));
        let n = inner.rails;
        let candidates: Vec<(usize, usize)> = match inner.cfg.pairing {
            Pairing::Subnet => (0..n).flat_map(|i| (0..peer.len()).map(move |j| (i, j))).collect(),
            p => pair(p, n, peer.len(), |_| None, |_| None)?,
        };
        let opens = candidates.iter().map(|&(i, j)| {
            let t = inner.all[i].clone();
            let name = peer[j].clone();
            async move { (i, j, t.open_segment(&name).await) }
        });
        let mut opened = Vec::new();
        let mut first_err = None;
        // Every candidate path, and why it cannot be used (logged once).
        let mut reach: Vec<(usize, usize, Option<String>)> = Vec::new();
        for (i, j, r) in futures::future::join_all(opens).await {
            match r {
                Ok(seg) => opened.push((i, j, seg)),
                Err(e) => {
                    reach.push((i, j, Some(format!("its open failed: {e}"))));
                    first_err.get_or_insert(e);
                }
            }
        }
        if inner.cfg.pairing == Pairing::Subnet {
            let local: Vec<Option<String>> =
                (0..n).map(|i| inner.all[i].local_descriptor().ok().map(|d| d.address)).collect();
            let mut keep = Vec::new();
            for (i, j, seg) in opened {
                let theirs = inner.all[i].segment_descriptor(seg).ok().map(|d| d.address);
                let ok = pair(Pairing::Subnet, 1, 1, |_| local[i].clone(), |_| theirs.clone()).is_ok();
                if ok {
                    keep.push((i, j, seg));
                } else {
                    let _ = inner.all[i].close_segment(seg).await;
                    reach.push((i, j, Some("pairing subnet: its GID shares no subnet with the peer rail's".into())));
                }
            }
            opened = keep;
        }
        reach.extend(opened.iter().map(|&(i, j, _)| (i, j, None)));
        inner.reached(name, &reach);
        let mut paths: Vec<Path> = opened
            .into_iter()
            .map(|(k, j, seg)| Path {
                k,
                peer: Some(j),
                seg,
                fallback: false,
                health: PathHealth::new(&inner.cfg),
                subs: 0,
                inflight: 0,
                bytes: 0,
                failures: 0,
            })
            .collect();
        if paths.is_empty() {
            return Err(first_err.unwrap_or_else(|| {
                Error::new(
                    ErrorKind::Config,
                    "rails.pairing = subnet: no local rail shares a GID subnet with the peer's",
                )
            }));
        }
        if let (Some(t), Some(tcp)) = (inner.all.get(n), tcp) {
            match t.open_segment(&tcp).await {
                Ok(seg) => paths.push(Path {
                    k: n,
                    peer: None,
                    seg,
                    fallback: true,
                    health: PathHealth::new(&inner.cfg),
                    subs: 0,
                    inflight: 0,
                    bytes: 0,
                    failures: 0,
                }),
                Err(e) => tracing::warn!(peer = %tcp, error = %e, "rails: the peer's TCP fallback could not be opened"),
            }
        }
        Ok((paths, near, desc.address))
    }

    pub(super) async fn close_handles(&self, control: SegmentId, paths: &[Path]) {
        let closes = paths.iter().map(|p| self.inner.all[p.k].close_segment(p.seg));
        let _ = futures::future::join_all(closes).await;
        let _ = self.inner.all[0].close_segment(control).await;
    }

    /// Rule 9 before anything moves: each remote range inside one region of
    /// the peer (as rail 0 sees it; re-read once if unknown) that allows
    /// the operation. Returns the descriptors it read, per segment.
    pub(super) async fn check_remote(
        &self,
        requests: &[TransferRequest],
        controls: &HashMap<SegmentId, (SegmentId, String)>,
    ) -> Result<HashMap<SegmentId, SegmentDescriptor>> {
        let rail0 = &self.inner.all[0];
        let mut descs: HashMap<SegmentId, SegmentDescriptor> = HashMap::new();
        let mut refreshed: HashMap<SegmentId, bool> = HashMap::new();
        for (i, r) in requests.iter().enumerate() {
            let Some((control, name)) = controls.get(&r.segment) else {
                return Err(Error::unknown_segment(r.segment).with("request", i));
            };
            if let std::collections::hash_map::Entry::Vacant(v) = descs.entry(r.segment) {
                v.insert(rail0.segment_descriptor(*control).map_err(|e| e.with("request", i))?);
            }
            let known = descs.get(&r.segment).and_then(|d| d.region_for(r.remote_addr, r.len)).is_some();
            if !known && !refreshed.get(&r.segment).copied().unwrap_or(false) {
                // The peer may have registered it after the handle was
                // opened: read its descriptor again, once per batch.
                refreshed.insert(r.segment, true);
                let fresh = rail0.open_segment(name).await.map_err(|e| e.with("request", i))?;
                let d = rail0.segment_descriptor(fresh);
                let _ = rail0.close_segment(fresh).await;
                descs.insert(r.segment, d.map_err(|e| e.with("request", i))?);
            }
            let Some(info) = descs.get(&r.segment).and_then(|d| d.region_for(r.remote_addr, r.len)) else {
                return Err(Error::new(
                    ErrorKind::OutOfBounds,
                    format!("remote range {:#x}+{} is in no region of the segment", r.remote_addr, r.len),
                )
                .with("segment", r.segment)
                .with("request", i));
            };
            if !info.access.allows(r.op) {
                return Err(Error::new(ErrorKind::AccessDenied, format!("remote region does not allow {:?}", r.op))
                    .with("segment", r.segment)
                    .with("request", i));
            }
        }
        Ok(descs)
    }

    /// What the peers' descriptors now say of the rails nearest their
    /// regions (a peer registers memory after we opened it, or restarts).
    /// A list the peer garbled is a `Protocol` error for the batch.
    pub(super) fn learn_near(&self, descs: &HashMap<SegmentId, SegmentDescriptor>) -> Result<()> {
        let mut st = self.inner.state.lock();
        for (id, d) in descs {
            let Some(s) = st.segments.get_mut(id) else { continue };
            if s.peer_address != d.address {
                let rails = RailList::parse(&d.address)?.map_or(1, |l| l.rails.len());
                s.peer_near = NearList::parse(&d.address, rails).map_err(|e| e.with("segment", id))?;
                s.peer_address.clone_from(&d.address);
            }
        }
        Ok(())
    }
}

/// `advertised` on the host of `opened` (both `host:port`); names that are
/// not `host:port` (the mock's) are taken as they are.
fn same_host(opened: &str, advertised: &str) -> String {
    match (opened.rsplit_once(':'), advertised.rsplit_once(':')) {
        (Some((host, _)), Some((_, port))) if port.parse::<u16>().is_ok() && !host.is_empty() => {
            format!("{host}:{port}")
        }
        _ => advertised.to_string(),
    }
}

/// Unregisters what a failed `register` left on some transports. Nothing
/// can use those ids yet, so each unregister ends at once; it runs in a
/// task because unregistering is async.
pub(super) fn undo_registrations(inner: &Arc<Inner>, ids: Vec<RegionId>) {
    if ids.is_empty() {
        return;
    }
    let all = inner.all.clone();
    let undo = async move {
        for (k, id) in ids.into_iter().enumerate() {
            let _ = all[k].unregister(id).await;
        }
    };
    match tokio::runtime::Handle::try_current() {
        Ok(_) => {
            inner.tasks.spawn(undo);
        }
        Err(_) => {
            tracing::warn!("rails: register failed outside a runtime; the other rails keep the memory until shutdown")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn advertised_rails_are_reached_on_the_host_the_peer_was_opened_by() {
        assert_eq!(same_host("10.0.0.7:5000", "10.0.0.7:5001"), "10.0.0.7:5001");
        assert_eq!(same_host("node7:5000", "10.0.0.7:5001"), "node7:5001");
        assert_eq!(same_host("10.0.0.7:5000", "169.254.169.254:80"), "10.0.0.7:80", "never another host");
        assert_eq!(same_host("[::1]:5000", "[fe80::1]:6000"), "[::1]:6000");
        assert_eq!(same_host("b.r0", "b.r1"), "b.r1", "mock names have no port");
    }
}
