//! The background prober: while a peer's breaker is open, ask the peer
//! (a real round trip, a one-byte read) at doubling intervals, so the
//! first answer closes the breaker and work to a peer that came back flows
//! again at once.

use super::*;

/// The background prober's first wait after a breaker opens.
const PROBER_FIRST: Duration = Duration::from_millis(20);
/// Probes a background prober makes before it leaves the breaker to its
/// cool-down (about 20 s at the default 2 s cool-down).
const PROBER_TRIES: u32 = 40;
/// The longest wait between a background prober's probes.
const PROBER_MAX_WAIT: Duration = Duration::from_secs(1);

/// The prober's longest wait for a breaker with `cooldown`: a quarter of
/// it, at most [`PROBER_MAX_WAIT`], so a peer that comes back is found
/// within a fraction of the cool-down however long it was away.
fn prober_cap(cooldown: Duration) -> Duration {
    (cooldown / 4).clamp(PROBER_FIRST, PROBER_MAX_WAIT)
}
/// Longest a probe's read may take.
const PROBE_READ_TIMEOUT: Duration = Duration::from_secs(2);

impl Inner {
    /// Starts the background prober of `peer` unless one runs (or there
    /// is no runtime to run it on).
    pub(super) fn start_prober(self: &Arc<Self>, peer: &str) {
        let Ok(handle) = tokio::runtime::Handle::try_current() else { return };
        if !self.probers.lock().insert(peer.to_owned()) {
            return;
        }
        // Holds the engine weakly: a dropped engine's prober ends at its
        // next wake-up instead of keeping the transport alive.
        let (weak, peer) = (Arc::downgrade(self), peer.to_owned());
        handle.spawn(async move {
            let mut wait = PROBER_FIRST;
            for _ in 0..PROBER_TRIES {
                tokio::time::sleep(wait).await;
                let Some(me) = weak.upgrade() else { return };
                if me.breaker_closed(&peer) {
                    break;
                }
                match me.probe(&peer).await {
                    Ok(()) => break,
                    Err(e) if e.kind() == ErrorKind::Shutdown => break,
                    Err(_) => {}
                }
                wait = (wait * 2).min(prober_cap(me.cfg.breaker.cooldown));
            }
            if let Some(me) = weak.upgrade() {
                me.probers.lock().remove(&peer);
            }
        });
    }

    /// See [`Engine::probe`].
    pub(super) async fn probe(self: &Arc<Self>, name: &str) -> Result<()> {
        let t = &self.transport;
        // The peer counts as tried when the probe failed (below), not when
        // it started: a call that comes while a probe is out may probe
        // itself once the interval since the last failure passed, instead
        // of failing fast beside a probe that finds the peer back (a call
        // 200 ms after a restart failed so under load, ci71).
        let result = match t.open_segment(name).await {
            Ok(seg) => {
                let r = self.read_one(seg).await;
                let _ = t.close_segment(seg).await;
                // The peer's refusal of the read (a range or access it does
                // not allow, memory it just unregistered) is an answer from
                // it, so it is alive. Only the read's errors count so: an
                // open that failed says nothing of the kind.
                match r {
                    Err(e)
                        if matches!(
                            e.kind(),
                            ErrorKind::OutOfBounds | ErrorKind::AccessDenied | ErrorKind::Unregistered
                        ) =>
                    {
                        Ok(())
                    }
                    r => r,
                }
            }
            Err(e) => Err(e),
        };
        match &result {
            Ok(()) => self.record(name, PeerVerdict::Healthy),
            Err(e) if e.kind().is_peer_failure() => {
                if self.breaker_closed(name) {
                    self.record(name, PeerVerdict::failed(e));
                } else {
                    self.tried(name, e.nothing_listens());
                }
            }
            Err(_) => {}
        }
        result.map_err(|e| e.with("peer", name).with("probe", true))
    }

    /// Reads one byte of the first readable region of `seg` (or the first
    /// region) into a scratch buffer registered for the time of the read;
    /// `Ok` without a read when the peer exposes nothing (the open was the
    /// round trip).
    pub(super) async fn read_one(&self, seg: SegmentId) -> Result<()> {
        let t = &self.transport;
        let desc = t.segment_descriptor(seg)?;
        let Some(r) = desc.regions.iter().find(|r| r.access.remote_read).or(desc.regions.first()) else {
            return Ok(());
        };
        let buf = Buffer::new(64).map_err(|e| Error::new(ErrorKind::Internal, e.to_string()))?;
        let local = t.register(buf.region(), Access::LOCAL)?;
        let read = async {
            let b = t
                .submit(
                    vec![TransferRequest::read(local, 0, seg, r.addr, 1)],
                    // A real round trip: the peer must answer, not be read
                    // directly (a stopped same-host peer's memory still is).
                    SubmitOptions::with_timeout(PROBE_READ_TIMEOUT).round_trip(),
                )
                .await?;
            let st = t.wait(b).await;
            let _ = t.release(b);
            let st = st?;
            match (st.state, st.first_error()) {
                (BatchState::Completed, _) => Ok(()),
                (_, Some(e)) => Err(e.clone()),
                (BatchState::TimedOut, None) => Err(Error::new(
                    ErrorKind::Timeout,
                    format!("the peer did not answer a probe within {} ms", PROBE_READ_TIMEOUT.as_millis()),
                )),
                (state, None) => Err(Error::new(ErrorKind::Cancelled, format!("the probe's read ended {state:?}"))),
            }
        }
        .await;
        let _ = t.unregister(local).await;
        read
    }

    /// The peer was just tried outside the breaker's admission: an open
    /// breaker lets the next call probe only a probe interval from now
    /// (`refused`: its host refused the try).
    fn tried(&self, peer: &str, refused: bool) {
        let now = self.clock.now();
        if let Some(b) = self.breakers.lock().get_mut(peer) {
            b.on_probe(now, refused);
        }
    }

    pub(super) fn abandon_probes(self: &Arc<Self>, peers: &[String]) {
        for p in peers {
            self.record(p, PeerVerdict::Unknown);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prober_waits_at_most_a_quarter_of_the_cool_down_and_one_second() {
        assert_eq!(prober_cap(Duration::from_secs(2)), Duration::from_millis(500));
        assert_eq!(prober_cap(Duration::from_secs(60)), PROBER_MAX_WAIT);
        assert_eq!(prober_cap(Duration::from_millis(10)), PROBER_FIRST);
        assert_eq!(prober_cap(Duration::ZERO), PROBER_FIRST);
    }
}
