//! A minimal TCP peer for tests and benchmarks: serves one remotely
//! readable and writable region until stdin closes (or it is killed).
//!
//! `tcp-peer <listen host:port> <region bytes> [same_host: on|off]
//! [insecure]` prints one line, `<segment name> <region address>`, once it
//! serves. The secret is the environment's (`KVMOVE_SECRET`), if any;
//! `insecure` turns protected mode off. The region
//! starts as the bytes `i % 251` (byte `i`), so a reader can check them.

use std::io::{BufRead, Write};

use transport_core::{Access, Buffer, Transport};
use transport_tcp::{TcpConfig, TcpTransport};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let listen = args.get(1).cloned().unwrap_or_else(|| "127.0.0.1:0".into());
    let len: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(1 << 20);
    let same_host = args.get(3).map(String::as_str) != Some("off");
    let insecure = args.get(4).map(String::as_str) == Some("insecure");
    let rt = match tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("tcp-peer: cannot start a runtime: {e}");
            std::process::exit(2);
        }
    };
    rt.block_on(async move {
        let cfg = TcpConfig { listen, same_host, insecure, ..TcpConfig::default() };
        let t = match TcpTransport::new(cfg).await {
            Ok(t) => t,
            Err(e) => {
                eprintln!("tcp-peer: {e}");
                std::process::exit(2);
            }
        };
        let start: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        let buf = match Buffer::from_slice(&start) {
            Ok(b) => b,
            Err(e) => {
                eprintln!("tcp-peer: {e}");
                std::process::exit(2);
            }
        };
        if let Err(e) = t.register(buf.region(), Access::REMOTE_RW) {
            eprintln!("tcp-peer: {e}");
            std::process::exit(2);
        }
        println!("{} {}", t.local_segment_name(), buf.addr());
        let _ = std::io::stdout().flush();
        // Serve until stdin closes.
        let _ = tokio::task::spawn_blocking(|| {
            let mut line = String::new();
            let _ = std::io::stdin().lock().read_line(&mut line);
        })
        .await;
        let _ = t.shutdown().await;
    });
}
