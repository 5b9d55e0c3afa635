//! The shared state's bookkeeping, without a device.

use super::*;

/// A state without a device, holding one batch of two requests with
/// `posted` units of request 0 on the wire (request 1 has none).
fn state_with_posted(posted: u64) -> (State, BatchId) {
    let mut st = State::with_verbs(None, 4, transport_core::Epoch::start());
    let req = TransferRequest::write(RegionId(1), 0, SegmentId(1), 0x1000, 8);
    let targets = vec![Target { spec: req, rkey: Some(7) }, Target { spec: req, rkey: Some(7) }];
    let ledger = BatchLedger::new([posted, 1], None);
    let id = st.batches.insert(Batch::new(ledger, targets));
    let b = st.batches.get_mut(id).unwrap();
    for _ in 0..posted {
        assert!(b.ledger.start(0));
    }
    assert!(b.ledger.start(1));
    assert!(!b.ledger.unit_done(1, Ok(())).batch_terminal);
    (st, id)
}

#[test]
fn lost_units_are_counted_per_request() {
    let mut g = Graveyard::default();
    let (a, b) = (BatchId(1), BatchId(2));
    g.lose(a, 0);
    g.lose(b, 0);
    g.lose(a, 0);
    g.lose(a, 1);
    assert_eq!(
        g.lost,
        vec![Lost { batch: a, req: 0, n: 2 }, Lost { batch: b, req: 0, n: 1 }, Lost { batch: a, req: 1, n: 1 }]
    );
    assert!(!g.is_empty());
    g.lost.clear(); // nothing to destroy: dropping it is a no-op
}

/// Rule 5: work posted on a QP being destroyed keeps its batch
/// non-terminal (and on the wire for `settle`) until the QP is gone;
/// only `after_destroy` (run by `with_state` after the graveyard was
/// dropped) ends it.
#[test]
fn lost_work_ends_only_after_the_qp_is_destroyed() {
    let (mut st, id) = state_with_posted(3);
    let mut g = Graveyard::default();
    for _ in 0..3 {
        g.lose(id, 0);
    }
    let lost = std::mem::take(&mut g.lost);
    let b = st.batches.get(id).unwrap();
    assert!(!b.ledger.is_terminal());
    assert_eq!(b.ledger.on_wire(), 3);
    assert!(st.any_on_wire(|t| t.spec.local == RegionId(1)));
    drop(g); // where ibv_destroy_qp runs
    st.after_destroy(&[], &lost);
    let b = st.batches.get(id).unwrap();
    assert!(b.ledger.is_terminal());
    assert_eq!(b.ledger.on_wire(), 0);
    assert!(b.ledger.status().first_error().is_some());
    assert!(!st.any_on_wire(|_| true));
}

#[test]
fn orphaned_batches_are_removed_once_terminal() {
    let (mut st, id) = state_with_posted(1);
    st.batches.get_mut(id).unwrap().orphaned = true;
    let mut g = Graveyard::default();
    st.remove_orphans(&mut g);
    assert_eq!(st.batches.len(), 1, "work still posted: kept");
    st.after_destroy(&[], &[Lost { batch: id, req: 0, n: 1 }]);
    st.remove_orphans(&mut g);
    assert_eq!(st.batches.len(), 0);
    assert_eq!(g.batches.len(), 1);
}

#[test]
fn lost_units_of_a_released_batch_are_ignored() {
    let (mut st, id) = state_with_posted(1);
    let before = format!("{:?}", st.batches.get(id).unwrap().ledger.status());
    // A batch released meanwhile (99 was never in the table): its lost
    // units touch nothing, and the live batch keeps its work on the wire.
    st.after_destroy(&[], &[Lost { batch: BatchId(99), req: 0, n: 1 }]);
    st.after_destroy(&[], &[]);
    assert_eq!(st.batches.len(), 1);
    let b = st.batches.get(id).unwrap();
    assert!(!b.ledger.is_terminal());
    assert_eq!(b.ledger.on_wire(), 1, "the live batch's work request is still posted");
    assert_eq!(format!("{:?}", b.ledger.status()), before);
    assert!(st.any_on_wire(|t| t.spec.local == RegionId(1)));
}

#[test]
fn work_request_ids_are_never_reused() {
    let mut ids = WrIds::default();
    let a = ids.next();
    assert_ne!(a, ids.next());
}

/// Rule 1 (every resource is counted): a batch with a deadline leaves the
/// deadline queue when it leaves the table, by release or as an orphan,
/// so the timer never holds (or wakes for) a batch nobody has.
#[test]
fn a_batch_leaves_the_deadline_queue_with_the_table() {
    let (mut st, id) = state_with_posted(1);
    let (key, _) = st.deadlines.add(Duration::from_secs(60), id);
    st.batches.get_mut(id).unwrap().deadline = Some(key);
    assert_eq!(st.deadlines.len(), 1);
    // Not terminal yet: the release is refused and nothing moves.
    assert_eq!(st.release_batch(id).unwrap_err().kind(), ErrorKind::InvalidRequest);
    assert_eq!(st.deadlines.len(), 1);
    st.after_destroy(&[], &[Lost { batch: id, req: 0, n: 1 }]);
    assert!(st.release_batch(id).is_ok());
    assert!(st.deadlines.is_empty() && st.deadlines.next().is_none());
    assert_eq!(st.batches.len(), 0);

    let (mut st, id) = state_with_posted(1);
    let (key, _) = st.deadlines.add(Duration::from_secs(60), id);
    let b = st.batches.get_mut(id).unwrap();
    b.deadline = Some(key);
    b.orphaned = true;
    st.after_destroy(&[], &[Lost { batch: id, req: 0, n: 1 }]);
    st.remove_orphans(&mut Graveyard::default());
    assert!(st.deadlines.is_empty());
}

/// A kept side channel: one end of a loopback TCP connection, kept
/// `age` ago.
async fn spare(age: std::time::Duration) -> (crate::wire::Spare, tokio::net::TcpStream) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let c = tokio::net::TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
    let (s, _) = l.accept().await.unwrap();
    let since = std::time::Instant::now().checked_sub(age).unwrap();
    (crate::wire::Spare { stream: tokio::io::BufReader::new(c), since }, s)
}

fn handle(st: &mut State) -> SegmentId {
    let id = st.new_segment_id();
    let desc = SegmentDescriptor {
        name: "peer".into(),
        backend: "rdma".into(),
        generation: 1,
        address: String::new(),
        regions: vec![],
    };
    st.segments.insert(id, Segment::new(desc));
    id
}

/// At most `MAX_SPARES` handles keep their descriptor's connection (each
/// holds one of the peer's connection places); one taken, reaped or
/// closed with its handle makes room for the next, and a handle whose
/// descriptor was read again keeps the newer one in its place.
#[tokio::test]
async fn kept_side_channels_are_bounded_and_reaped() {
    let mut st = State::with_verbs(None, 4, transport_core::Epoch::start());
    let fresh = std::time::Duration::ZERO;
    let limit = std::time::Duration::from_secs(10);
    let mut peers = Vec::new();
    let mut ids = Vec::new();
    for _ in 0..MAX_SPARES + 2 {
        let id = handle(&mut st);
        let (sp, peer) = spare(fresh).await;
        st.keep_spare(id, sp);
        peers.push(peer);
        ids.push(id);
    }
    assert_eq!(st.spares(), MAX_SPARES);
    assert!(st.take_spare(ids[MAX_SPARES]).is_none(), "kept past the bound");
    // Read again: the handle keeps the newer connection, still one place.
    let (sp, peer) = spare(fresh).await;
    st.keep_spare(ids[0], sp);
    peers.push(peer);
    assert_eq!(st.spares(), MAX_SPARES);
    // Taken by a first endpoint: a place frees.
    assert!(st.take_spare(ids[1]).is_some());
    assert!(st.take_spare(ids[1]).is_none());
    assert_eq!(st.spares(), MAX_SPARES - 1);
    // A closed handle's place frees at the next reap.
    st.segments.remove(&ids[2]);
    st.reap_spares(limit);
    assert_eq!(st.spares(), MAX_SPARES - 2);
    // Stale ones (older than half the handshake timeout) are closed.
    let late = handle(&mut st);
    let (sp, _peer) = spare(limit).await;
    st.keep_spare(late, sp);
    assert_eq!(st.spares(), MAX_SPARES - 1);
    st.reap_spares(limit);
    assert_eq!(st.spares(), MAX_SPARES - 2);
    assert!(st.take_spare(late).is_none());
    // Room again: a new handle keeps its connection.
    let next = handle(&mut st);
    let (sp, _peer2) = spare(fresh).await;
    st.keep_spare(next, sp);
    assert!(st.take_spare(next).is_some());
}
