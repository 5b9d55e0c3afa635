//! The server's scratch buffers (read, staging and output): fixed-size
//! pages from the kernel (`transport_mem::PageBuf`), lent to a connection
//! only while it has work in hand and kept in a small pool between uses. An idle connection holds
//! none, so memory follows the connections that are busy, not those that
//! are open; buffers beyond the pool's cap are unmapped when returned, so a
//! burst's memory goes back to the OS when it ends.

use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::io::AsyncReadExt;
use tokio::net::tcp::OwnedReadHalf;
use transport_mem::PageBuf;

use crate::hush::Hush;

/// Buffers of one size, at most `cap` of them kept while unused.
#[derive(Debug)]
pub(crate) struct BufPool {
    size: usize,
    cap: usize,
    free: Mutex<Vec<PageBuf>>,
}

impl BufPool {
    pub fn new(size: usize, cap: usize) -> Arc<Self> {
        Arc::new(Self { size, cap, free: Mutex::new(Vec::new()) })
    }

    /// A buffer of the pool's size (its bytes are whatever the last user
    /// left). An error only when the kernel refuses the memory.
    pub fn take(self: &Arc<Self>) -> std::io::Result<Pooled> {
        let buf = match self.free.lock().pop() {
            Some(b) => b,
            None => PageBuf::new(self.size)
                .map_err(|e| std::io::Error::new(std::io::ErrorKind::OutOfMemory, e.to_string()))?,
        };
        Ok(Pooled { buf: Some(buf), pool: self.clone() })
    }

    /// The size of its buffers.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Buffers kept for reuse now.
    #[cfg(test)]
    pub fn idle(&self) -> usize {
        self.free.lock().len()
    }
}

/// A buffer on loan from a [`BufPool`]; returned (or unmapped, when the
/// pool is full) on drop.
#[derive(Debug)]
pub(crate) struct Pooled {
    buf: Option<PageBuf>,
    pool: Arc<BufPool>,
}

impl std::ops::Deref for Pooled {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.buf.as_deref().unwrap_or(&[])
    }
}

impl std::ops::DerefMut for Pooled {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.buf.as_deref_mut().unwrap_or(&mut [])
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        if let Some(b) = self.buf.take() {
            let mut free = self.pool.free.lock();
            if free.len() < self.pool.cap {
                free.push(b);
            }
        }
    }
}

/// A connection's pending answers: at most one pooled buffer's worth,
/// borrowed when the first answer is due and given back once everything
/// is on the wire ([`OutBuf::release`]).
#[derive(Debug)]
pub(crate) struct OutBuf {
    pool: Arc<BufPool>,
    buf: Option<Pooled>,
    len: usize,
}

impl OutBuf {
    pub fn new(pool: Arc<BufPool>) -> Self {
        Self { pool, buf: None, len: 0 }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes that still fit.
    pub fn room(&self) -> usize {
        self.pool.size - self.len
    }

    /// The pending bytes.
    pub fn as_slice(&self) -> &[u8] {
        match &self.buf {
            Some(b) => &b[..self.len],
            None => &[],
        }
    }

    /// Appends `n` bytes and returns them to be filled. The caller checks
    /// [`OutBuf::room`] first; `n` above it is an invalid-input error.
    pub fn tail(&mut self, n: usize) -> std::io::Result<&mut [u8]> {
        if n > self.room() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("{n} bytes do not fit the {} left of the output buffer", self.room()),
            ));
        }
        if self.buf.is_none() {
            self.buf = Some(self.pool.take()?);
        }
        let start = self.len;
        self.len += n;
        match &mut self.buf {
            Some(b) => Ok(&mut b[start..start + n]),
            None => Ok(&mut []),
        }
    }

    /// Appends `bytes` (at most [`OutBuf::room`]).
    pub fn push(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.tail(bytes.len())?.copy_from_slice(bytes);
        Ok(())
    }

    /// Forgets everything after the first `len` bytes.
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// Forgets every pending byte; the buffer stays on loan.
    pub fn clear(&mut self) {
        self.len = 0;
    }

    /// Gives the buffer back to the pool if nothing is pending.
    pub fn release(&mut self) {
        if self.len == 0 {
            self.buf = None;
        }
    }

    /// Whether a buffer is on loan (tests).
    #[cfg(test)]
    pub fn holds(&self) -> bool {
        self.buf.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_keeps_at_most_cap_and_reuses() {
        let p = BufPool::new(8192, 2);
        let bufs: Vec<_> = (0..4).map(|_| p.take().unwrap()).collect();
        assert!(bufs.iter().all(|b| b.len() == 8192));
        drop(bufs);
        assert_eq!(p.idle(), 2, "two kept, two unmapped");
        let mut a = p.take().unwrap();
        a[0] = 9;
        assert_eq!(p.idle(), 1);
        drop(a);
        assert_eq!(p.idle(), 2);
    }

    #[test]
    fn out_buf_borrows_only_while_it_holds_bytes() {
        let p = BufPool::new(4096, 4);
        let mut o = OutBuf::new(p.clone());
        assert!(!o.holds());
        o.push(b"hello").unwrap();
        assert!(o.holds());
        assert_eq!(o.as_slice(), b"hello");
        o.tail(3).unwrap().copy_from_slice(b"abc");
        assert_eq!(o.as_slice(), b"helloabc");
        o.truncate(5);
        assert_eq!(o.as_slice(), b"hello");
        o.release();
        assert!(o.holds(), "pending bytes keep the buffer");
        assert_eq!(o.room(), 4096 - 5);
        assert!(o.tail(4092).is_err(), "never past the buffer");
        assert_eq!(o.len(), 5, "a refused tail changes nothing");
        o.clear();
        o.release();
        assert!(!o.holds());
        assert_eq!(p.idle(), 1);
    }

    /// `poll_until` reads the socket itself: bytes sent while it polls are
    /// caught; when none come it gives up at the deadline holding no
    /// buffer; a closed peer ends it at once, and the next read reports
    /// the end. Whether it spins or yields between reads.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_polling_reader_catches_bytes_and_holds_nothing_otherwise() {
        for spin in [false, true] {
            polling_reader(spin).await;
        }
    }

    async fn polling_reader(spin: bool) {
        use std::io::Write;
        let (mut c, mut r, pool, _wr) = polled_pair();
        let t = Instant::now();
        assert!(!r.poll_until(t + Duration::from_millis(20), spin).await.unwrap(), "nothing was sent");
        assert!(t.elapsed() >= Duration::from_millis(20), "polled until the deadline");
        assert_eq!((r.buffered(), pool.idle()), (0, 1), "the buffer went back to the pool");
        let sender = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(5));
            c.write_all(b"hello").unwrap();
            c
        });
        assert!(r.poll_until(Instant::now() + Duration::from_secs(10), spin).await.unwrap(), "sent while polling");
        let mut got = [0u8; 5];
        assert!(r.read_buffered(&mut got));
        assert_eq!(&got, b"hello");
        drop(sender.join().unwrap());
        let t = Instant::now();
        assert!(!r.poll_until(t + Duration::from_secs(10), spin).await.unwrap(), "the peer closed");
        assert!(t.elapsed() < Duration::from_secs(5), "a closed peer ends the polling at once");
        let e = r.read_exact(&mut got).await.unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof);
    }

    /// A client socket and the server side's polling reader of it.
    fn polled_pair() -> (std::net::TcpStream, PooledReader, Arc<BufPool>, tokio::net::tcp::OwnedWriteHalf) {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, _) = l.accept().unwrap();
        s.set_nonblocking(true).unwrap();
        let (rd, wr) = tokio::net::TcpStream::from_std(s).unwrap().into_split();
        let pool = BufPool::new(4096, 4);
        let r = PooledReader::new(rd, pool.clone());
        (c, r, pool, wr)
    }

    /// The socket is hushed only while polled: after a poll that caught
    /// nothing, and when a frame's rest must be waited for after a poll
    /// that caught its start, a few bytes wake the waiting reader (a hushed
    /// socket would wake it only for a whole `Hush` mark of bytes).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_polled_socket_is_loud_again_before_any_wait() {
        use std::io::Write;
        let (mut c, mut r, _pool, _wr) = polled_pair();
        let bound = Duration::from_secs(5);
        assert!(!r.poll_until(Instant::now() + Duration::from_millis(5), true).await.unwrap());
        c.write_all(b"ab").unwrap();
        let mut two = [0u8; 2];
        tokio::time::timeout(bound, r.read_exact(&mut two)).await.expect("woken after a missed poll").unwrap();
        assert_eq!(&two, b"ab");
        c.write_all(b"cd").unwrap();
        assert!(r.poll_until(Instant::now() + Duration::from_secs(10), true).await.unwrap());
        let writer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            c.write_all(b"ef").unwrap();
            c
        });
        let mut four = [0u8; 4];
        tokio::time::timeout(bound, r.read_exact(&mut four)).await.expect("woken for a frame's rest").unwrap();
        assert_eq!(&four, b"cdef");
        drop(writer.join().unwrap());
    }

    #[tokio::test]
    async fn pooled_reader_borrows_only_while_bytes_are_buffered() {
        use tokio::io::AsyncWriteExt;
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut c = tokio::net::TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
        let (s, _) = l.accept().await.unwrap();
        let (rd, _wr) = s.into_split();
        let pool = BufPool::new(4096, 4);
        let mut r = PooledReader::new(rd, pool.clone());
        let data: Vec<u8> = (0..20_000u32).map(|i| (i % 251) as u8).collect();
        c.write_all(&data[..100]).await.unwrap();
        let mut a = [0u8; 10];
        r.read_exact(&mut a).await.unwrap();
        assert_eq!(&a[..], &data[..10]);
        assert_eq!(r.buffered(), 90, "the rest of what arrived is buffered");
        r.release();
        assert_eq!(r.buffered(), 90, "release keeps unread bytes");
        assert_eq!(r.take_buffered(30), &data[10..40], "taken in place, at most what was asked");
        assert_eq!(r.buffered(), 60);
        let mut more = [0u8; 61];
        assert!(!r.read_buffered(&mut more), "61 bytes are not buffered");
        assert_eq!((r.buffered(), more), (60, [0u8; 61]), "nothing taken");
        let mut few = [0u8; 5];
        assert!(r.read_buffered(&mut few));
        assert_eq!(&few[..], &data[40..45]);
        assert_eq!(r.buffered(), 55);
        r.pos -= 5;
        let mut b = [0u8; 60];
        r.read_exact(&mut b).await.unwrap();
        assert_eq!(&b[..], &data[40..100]);
        assert!(r.take_buffered(8).is_empty(), "nothing buffered: nothing taken");
        r.release();
        assert_eq!(pool.idle(), 1, "emptied and released: the buffer is back");
        // A read of at least a buffer goes straight into the caller's memory.
        c.write_all(&data[100..]).await.unwrap();
        let mut big = vec![0u8; 19_900];
        r.read_exact(&mut big).await.unwrap();
        assert_eq!(&big[..], &data[100..]);
        drop(c);
        let e = r.read_exact(&mut a).await.unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof);
    }
}

/// A polling connection gives the runtime a turn after spinning this long
/// without bytes ([`PooledReader::poll_until`]).
const TURN_SPIN: Duration = Duration::from_micros(50);
/// ... and at least this often while it keeps catching them.
const TURN_EVERY: Duration = Duration::from_millis(1);
/// A spinning poll gives the CPU up (`sched_yield`) every this many reads:
/// next to one busy process the fastest and steadiest of every read, 4, 16
/// and never; on a quiet machine they were level (the README's single 4
/// KiB write over the network path has the numbers).
const CPU_EVERY: u32 = 4;

/// A connection's buffered reader whose buffer is borrowed from a pool
/// only while it holds bytes: it waits for the socket to be readable with
/// no buffer, borrows one to read what arrived, and gives it back once
/// emptied ([`PooledReader::release`]). Reads at least a buffer long go
/// straight into the caller's memory.
#[derive(Debug)]
pub(crate) struct PooledReader {
    sock: OwnedReadHalf,
    pool: Arc<BufPool>,
    buf: Option<Pooled>,
    pos: usize,
    end: usize,
    /// Bytes were read from the socket since the last [`Self::check_reset`].
    unchecked: bool,
    /// How far the socket may be hushed while polled, and whether it is
    /// now ([`crate::hush`]): never while waiting on the runtime.
    hush: Hush,
    hushed: bool,
    /// When [`Self::poll_until`] last gave the runtime a turn (yielded);
    /// `None` after a wait on the runtime.
    turn_given: Option<Instant>,
}

impl PooledReader {
    pub fn new(sock: OwnedReadHalf, pool: Arc<BufPool>) -> Self {
        let hush = Hush::new(sock.as_ref());
        Self { sock, pool, buf: None, pos: 0, end: 0, unchecked: false, hush, hushed: false, turn_given: None }
    }

    /// Makes the socket loud before a wait on the runtime.
    fn loud(&mut self) -> std::io::Result<()> {
        if std::mem::take(&mut self.hushed) {
            self.hush.loud(self.sock.as_ref())?;
        }
        Ok(())
    }

    /// An error if the connection was reset (or failed) and bytes were
    /// read from the socket since the last check: bytes read with the
    /// reset already behind them are not to be applied. One `SO_ERROR`
    /// look-up per read from the socket, not per frame: frames taken from
    /// bytes already read reached the process before any later reset.
    pub fn check_reset(&mut self) -> std::io::Result<()> {
        if !std::mem::take(&mut self.unchecked) {
            return Ok(());
        }
        match self.sock.as_ref().take_error()? {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Bytes read from the socket and not yet taken.
    pub fn buffered(&self) -> usize {
        self.end - self.pos
    }

    /// Gives the buffer back to the pool if it holds nothing.
    pub fn release(&mut self) {
        if self.pos == self.end {
            self.buf = None;
            self.pos = 0;
            self.end = 0;
        }
    }

    /// Takes up to `max` of the bytes already buffered (none is read from
    /// the socket): at least one byte if [`Self::buffered`] is not 0.
    pub fn take_buffered(&mut self, max: usize) -> &[u8] {
        let n = self.buffered().min(max);
        let start = self.pos;
        self.pos += n;
        match &self.buf {
            Some(b) => &b[start..start + n],
            None => &[],
        }
    }

    /// Fills `dst` from the bytes already buffered if they are enough
    /// (`true`); otherwise takes nothing (`false`). Never waits.
    pub fn read_buffered(&mut self, dst: &mut [u8]) -> bool {
        let Some(b) = &self.buf else { return dst.is_empty() };
        if self.end - self.pos < dst.len() {
            return false;
        }
        dst.copy_from_slice(&b[self.pos..self.pos + dst.len()]);
        self.pos += dst.len();
        true
    }

    /// Fills `dst` (an `UnexpectedEof` error if the peer closes first).
    pub async fn read_exact(&mut self, dst: &mut [u8]) -> std::io::Result<()> {
        let mut done = 0;
        while done < dst.len() {
            if let (Some(b), true) = (&self.buf, self.pos < self.end) {
                let n = (self.end - self.pos).min(dst.len() - done);
                dst[done..done + n].copy_from_slice(&b[self.pos..self.pos + n]);
                self.pos += n;
                done += n;
                continue;
            }
            self.release();
            let want = &mut dst[done..];
            let n = if want.len() >= self.pool.size {
                self.loud()?;
                self.turn_given = None;
                self.sock.read(want).await?
            } else {
                self.fill().await?
            };
            self.unchecked = true;
            if n == 0 {
                return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "the peer closed the connection"));
            }
            if want.len() >= self.pool.size {
                done += n;
            }
        }
        Ok(())
    }

    /// Reads what the socket has without waiting for the runtime to report
    /// it readable, and tries again until `until`: whether bytes were read.
    /// The socket is read directly, not through the runtime's readiness,
    /// which only a reactor thread woken by the kernel would update: the
    /// point is that no thread sleeps. Holds no buffer when nothing came.
    /// The end of the stream is left for the next read to report (it reads
    /// 0 again); an error is returned.
    ///
    /// The socket is hushed while polled ([`crate::hush`]), and stays hushed
    /// when bytes came (the next poll needs no system call to hush it
    /// again); any wait on the runtime makes it loud first.
    ///
    /// Between reads the task yields to the runtime, unless `spin`
    /// (`crate::busypoll::may_spin`): then it stays on its worker, giving
    /// the CPU up to other threads now and then ([`CPU_EVERY`]), and gives the runtime
    /// a turn (yields the task) only now and then: first if it last
    /// waited on the runtime (its worker may be the one that was reading
    /// I/O; the yield lets another worker take that over), then after
    /// [`TURN_SPIN`] of spinning and at least every [`TURN_EVERY`].
    /// Yielding the task at every read (tried) made the runtime wake its
    /// other worker at every request, costing what the polling saves;
    /// never yielding it (tried) left the runtime with nobody reading I/O
    /// while a task of the same process waited for an answer.
    pub async fn poll_until(&mut self, until: Instant, spin: bool) -> std::io::Result<bool> {
        if self.pos < self.end {
            return Ok(true);
        }
        let caught = self.poll_hushed(until, spin).await;
        if !matches!(caught, Ok(true)) {
            self.loud()?;
        }
        caught
    }

    async fn poll_hushed(&mut self, until: Instant, spin: bool) -> std::io::Result<bool> {
        if !self.hushed {
            self.hushed = self.hush.hush(self.sock.as_ref());
        }
        // The runtime's turn first if this task last waited on it (its
        // worker may have been the one reading I/O: another takes over
        // now) or has not given one for a while.
        if self.turn_given.is_none_or(|t| t.elapsed() >= TURN_EVERY) {
            tokio::task::yield_now().await;
            self.turn_given = Some(Instant::now());
        }
        let mut b = match self.buf.take() {
            Some(b) => b,
            None => self.pool.take()?,
        };
        let mut spins = 0u32;
        loop {
            let stream: &tokio::net::TcpStream = self.sock.as_ref();
            match std::io::Read::read(&mut &*socket2::SockRef::from(stream), &mut b) {
                Ok(0) => return Ok(false),
                Ok(n) => {
                    self.buf = Some(b);
                    self.pos = 0;
                    self.end = n;
                    self.unchecked = true;
                    return Ok(true);
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
            let now = Instant::now();
            if now >= until {
                return Ok(false);
            }
            if !spin || self.turn_given.is_none_or(|t| now.saturating_duration_since(t) >= TURN_SPIN) {
                tokio::task::yield_now().await;
                self.turn_given = Some(Instant::now());
            } else {
                // Every few reads the CPU goes to any other thread waiting
                // for it (on a machine with few CPUs, maybe the peer's): a
                // spin that kept it made small writes much slower next to
                // one busy process (`CPU_EVERY`).
                spins = spins.wrapping_add(1);
                if spins.is_multiple_of(CPU_EVERY) {
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
            }
        }
    }

    /// Waits until the socket is readable (holding no buffer), then reads
    /// what arrived into a borrowed buffer; the bytes read (0: closed).
    async fn fill(&mut self) -> std::io::Result<usize> {
        self.loud()?;
        self.turn_given = None;
        loop {
            self.sock.readable().await?;
            let mut b = match self.buf.take() {
                Some(b) => b,
                None => self.pool.take()?,
            };
            match self.sock.try_read(&mut b) {
                Ok(n) => {
                    self.buf = Some(b);
                    self.pos = 0;
                    self.end = n;
                    return Ok(n);
                }
                // A spurious wake-up: wait again without the buffer.
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(e),
            }
        }
    }
}
