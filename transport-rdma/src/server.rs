//! The passive side: serves descriptors and accepts QP groups from peers.
//!
//! A peer's QP group lives exactly as long as its side-channel socket:
//! when the peer closes it (endpoint destroyed, process killed), the QPs
//! are moved to ERROR and destroyed here.

use std::sync::{Arc, Weak};

use tokio::io::{AsyncReadExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use transport_core::{Error, ErrorKind, Result};

use crate::state::PassiveConn;
use crate::transport::Inner;
use crate::verbs::RemoteQp;
use crate::wire::{self, QpInfo, Reply, Request};

pub(crate) async fn listen(weak: Weak<Inner>, listener: TcpListener) {
    loop {
        let (sock, _) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!("side channel accept failed: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                continue;
            }
        };
        let Some(inner) = weak.upgrade() else { return };
        let mut st = inner.state.lock();
        if st.shutdown {
            return;
        }
        let id = st.next_id();
        let w = weak.clone();
        let h = tokio::spawn(async move {
            serve(&w, id, sock).await;
            if let Some(inner) = w.upgrade() {
                let gone = {
                    let mut st = inner.state.lock();
                    st.passive_tasks.remove(&id);
                    st.passive.remove(&id)
                };
                if let Some(p) = gone {
                    for q in &p.qps {
                        let _ = q.set_error();
                    }
                }
            }
        });
        st.passive_tasks.insert(id, h.abort_handle());
    }
}

async fn serve(weak: &Weak<Inner>, id: u64, sock: TcpStream) {
    let _ = sock.set_nodelay(true);
    let mut sock = BufReader::new(sock);
    let timeout = match weak.upgrade() {
        Some(i) => i.cfg.handshake_timeout(),
        None => return,
    };
    let req = match tokio::time::timeout(timeout, wire::recv::<_, Request>(&mut sock)).await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => {
            let _ = wire::send(sock.get_mut(), &Reply::Error { message: e.to_string() }).await;
            return;
        }
        Err(_) => return,
    };
    let reply = match weak.upgrade() {
        Some(inner) => match req {
            Request::Describe => Reply::Descriptor { descriptor: inner.descriptor() },
            Request::Connect { gid, lid, mtu, qps } => match accept(&inner, id, &gid, lid, mtu, &qps) {
                Ok(r) => r,
                Err(e) => Reply::Error { message: e.to_string() },
            },
        },
        None => return,
    };
    let connected = matches!(reply, Reply::Connected { .. });
    if wire::send(sock.get_mut(), &reply).await.is_err() || !connected {
        return;
    }
    // Hold the QPs until the peer closes the channel (or dies).
    let mut buf = [0u8; 256];
    loop {
        match sock.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
    }
}

fn accept(inner: &Arc<Inner>, id: u64, gid: &str, lid: u16, mtu: u32, theirs: &[QpInfo]) -> Result<Reply> {
    let gid = wire::parse_gid(gid)?;
    if theirs.is_empty() || theirs.len() > 64 {
        return Err(Error::new(ErrorKind::HandshakeFailed, format!("{} QPs requested (1..=64)", theirs.len())));
    }
    inner.link_usable()?;
    {
        let st = inner.state.lock();
        if st.passive.len() >= inner.cfg.max_passive {
            return Err(Error::new(
                ErrorKind::ResourceExhausted,
                format!("peer QP groups at their limit ({})", inner.cfg.max_passive),
            ));
        }
    }
    let v = inner.verbs()?;
    let created = std::time::Instant::now();
    let qps = inner.new_qps(&v, theirs.len())?;
    let mtu = mtu.clamp(1, 5).min(v.port.active_mtu);
    for ((qp, psn), r) in qps.iter().zip(theirs) {
        let remote = RemoteQp { qpn: r.qpn, psn: r.psn, gid, lid };
        qp.connect(*psn, &remote, v.port.port, v.port.gid_index, mtu, v.port.max_rd_atom, inner.timing())?;
    }
    let info: Vec<QpInfo> = qps.iter().map(|(q, psn)| QpInfo { qpn: q.qpn(), psn: *psn }).collect();
    let descriptor = inner.descriptor();
    let mut st = inner.state.lock();
    if st.shutdown {
        return Err(Error::new(ErrorKind::Shutdown, "shutting down"));
    }
    st.passive.insert(id, PassiveConn { qps: qps.into_iter().map(|(q, _)| q).collect(), created });
    Ok(Reply::Connected { gid: wire::gid_hex(&v.port.gid), lid: v.port.lid, mtu, qps: info, descriptor })
}
