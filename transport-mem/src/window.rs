//! Direct same-host writes and reads: a target's consent, shared with one
//! initiator process, that lets the initiator copy a WRITE's bytes straight
//! into the target's memory, or a READ's straight out of it (one kernel
//! copy, no round trip).
//!
//! The consent is a *window*: a small memory file (`memfd`) that the target
//! creates for one connection and the initiator maps (it takes the file
//! with `pidfd_getfd`, which the kernel allows only where it would also
//! allow the copy itself: ptrace rights over the target). It holds:
//!
//! - the ranges the target lets this initiator write or read (one entry
//!   per registered region that allows remote writes or reads), each
//!   closed or open for writes ([`DIRECT_WRITE`]), reads ([`DIRECT_READ`])
//!   or both;
//! - whether the window is alive (the target retires it when the
//!   connection ends or the engine closes);
//! - the initiator's *counter*, odd while it is inside a direct write or
//!   read, and the bytes it wrote and read (for the target's metrics).
//!
//! **Why a write never lands after unregister returns.** The initiator
//! makes the counter odd, then reads the window (alive, an open entry
//! holding the whole range), copies, and makes the counter even. The
//! target closes the entry (or retires the window), then reads the
//! counter. All four accesses are sequentially consistent, so at least one
//! side sees the other: either the initiator finds the entry closed and
//! copies nothing, or the target finds the counter odd and waits until it
//! moves on ([`WindowOwner::writing`]) or the initiator's process is gone
//! ([`WindowOwner::writer_exited`]). Only then does the region count as
//! unregistered. A writer frozen inside a write (SIGSTOP, a debugger) holds
//! that wait; the window is the few microseconds of one copy. A direct read
//! keeps the same order with the same counter, so no byte of a region is
//! read once its unregister returned (the target may reuse the memory for
//! anything then).
//!
//! The copy goes through the target's `/proc/<pid>/mem`, opened once when
//! the window is attached: that file stays bound to the address space the
//! target had then, so once the target exits or replaces its program
//! (`exec`), or its pid names another process, a write fails instead of
//! landing elsewhere. (`process_vm_writev` names the target by pid at
//! every call.) A forked child of the initiator never writes through the
//! window (the mapping is not inherited, and a `pthread_atfork` handler
//! tells the copied structures so).
//!
//! The target never trusts what the initiator can write here: it reads
//! only the counter, as a number (and a byte count, for metrics); whether
//! the window is retired it keeps in its own memory. The initiator checks the file before it
//! maps it (size, seals that stop the target from shrinking it under the
//! mapping, magic, the handshake's nonce), reads the entry count only
//! once, and bounds every index by it. Both processes are the same user's
//! (or one has ptrace rights over the other), so neither can do through a
//! window what it could not do to the other process anyway.
#![allow(unsafe_code)]

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

use crate::region::MemoryRegion;

/// "KVMWIN01", little-endian.
const MAGIC: u64 = u64::from_le_bytes(*b"KVMWIN01");
/// Words before the first entry: magic, nonce (4), entries, alive,
/// counter, high-water mark, bytes written, bytes read, reserved.
const HEADER_WORDS: usize = 16;
const W_MAGIC: usize = 0;
const W_NONCE: usize = 1;
const W_ENTRIES: usize = 5;
const W_ALIVE: usize = 6;
const W_COUNTER: usize = 7;
const W_HIGH: usize = 8;
const W_WRITTEN: usize = 9;
const W_READ: usize = 10;
/// Words per entry: state, address, length, reserved.
const ENTRY_WORDS: usize = 4;
/// An entry's state bit while its range may be written directly (a
/// window of a version that knew only writes compared the word with 1: a
/// range open for reads as well then reads as closed there).
pub const DIRECT_WRITE: u64 = 1;
/// An entry's state bit while its range may be read directly.
pub const DIRECT_READ: u64 = 2;
/// Entries a window holds at most (a region beyond them is written the
/// usual way, through its target).
pub const WINDOW_ENTRIES: usize = 1024;
/// Bytes of a window's nonce (the handshake's).
pub const WINDOW_NONCE_LEN: usize = 32;

fn words_for(entries: usize) -> usize {
    HEADER_WORDS + entries * ENTRY_WORDS
}

/// A shared mapping of a window file, unmapped on drop.
///
/// The mapping is not inherited across `fork` (`MADV_DONTFORK`), while the
/// struct is (a copy of this process's memory). So every use first asks
/// [`Map::here`]: in a forked child the window is treated as retired and
/// never touched, and its drop unmaps nothing.
#[derive(Debug)]
struct Map {
    base: NonNull<AtomicU64>,
    words: usize,
    /// [`forks`] when it was mapped: a different value means this is a
    /// forked child's copy.
    forks: u64,
}

/// What a window's words read as in a process that does not map it.
static ABSENT: AtomicU64 = AtomicU64::new(0);

/// How many `fork`s this process is removed from the one it started as:
/// raised in every child (a `pthread_atfork` handler), so a check costs one
/// load instead of a `getpid`.
static FORKS: AtomicU64 = AtomicU64::new(0);

extern "C" fn in_forked_child() {
    // Async-signal-safe: one atomic add.
    FORKS.fetch_add(1, Ordering::Relaxed);
}

/// [`FORKS`] now, with the handler installed (once).
fn forks() -> io::Result<u64> {
    static HOOK: std::sync::OnceLock<libc::c_int> = std::sync::OnceLock::new();
    // SAFETY: registers a child handler that only touches an atomic; the
    // other two handlers are absent.
    let rc = *HOOK.get_or_init(|| unsafe { libc::pthread_atfork(None, None, Some(in_forked_child)) });
    if rc != 0 {
        return Err(io::Error::from_raw_os_error(rc));
    }
    Ok(FORKS.load(Ordering::Relaxed))
}

// SAFETY: the mapping is only ever accessed through `AtomicU64`s, which
// are `Sync`; the pointer itself is never handed out.
unsafe impl Send for Map {}
// SAFETY: as above.
unsafe impl Sync for Map {}

impl Map {
    /// Maps `words` words of `fd`, shared, readable and writable; the
    /// mapping is not inherited by a child process (a fork's copy of the
    /// initiator must not write as it).
    fn new(fd: &OwnedFd, words: usize) -> io::Result<Map> {
        let bytes = words.checked_mul(8).ok_or_else(|| io::Error::from_raw_os_error(libc::EINVAL))?;
        // SAFETY: a fresh shared mapping of a file this process holds; no
        // existing memory is affected. The result is checked below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let base = NonNull::new(p.cast()).ok_or_else(|| io::Error::from_raw_os_error(libc::ENOMEM))?;
        let forks = match forks() {
            Ok(n) => n,
            Err(e) => {
                // SAFETY: unmaps the mapping just made, never used.
                unsafe { libc::munmap(p, bytes) };
                return Err(e);
            }
        };
        let map = Map { base, words, forks };
        // SAFETY: `p .. p + bytes` is the mapping just made; advice changes
        // only what a fork inherits.
        if unsafe { libc::madvise(p, bytes, libc::MADV_DONTFORK) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(map)
    }

    /// Whether this process made the mapping (not a forked child).
    fn here(&self) -> bool {
        FORKS.load(Ordering::Relaxed) == self.forks
    }

    /// Word `i`; `i` is always below `words` (the callers bound it by an
    /// entry count they checked against the mapping's size). In a forked
    /// child, a word of no window (always 0: retired, not writing): the
    /// public methods check [`Map::here`] first, this is the backstop.
    fn word(&self, i: usize) -> &AtomicU64 {
        assert!(i < self.words, "window word {i} outside the mapping");
        if !self.here() {
            return &ABSENT;
        }
        // SAFETY: in bounds (above); the mapping is page-aligned, so every
        // word is 8-byte aligned; it lives as long as `self` in the process
        // that made it (checked above); both processes access it only
        // atomically.
        unsafe { &*self.base.as_ptr().add(i) }
    }
}

impl Drop for Map {
    fn drop(&mut self) {
        if !self.here() {
            // A forked child has no such mapping: nothing to unmap, and the
            // address may hold something else of the child's.
            return;
        }
        // SAFETY: unmaps exactly the mapping `new` made, in the process
        // that made it; no reference into it outlives `self` (they borrow
        // it).
        unsafe {
            libc::munmap(self.base.as_ptr().cast(), self.words * 8);
        }
    }
}

/// The nonce as the four words the window holds it in.
fn nonce_words(nonce: &[u8; WINDOW_NONCE_LEN]) -> [u64; WINDOW_NONCE_LEN / 8] {
    let mut words = [0u64; WINDOW_NONCE_LEN / 8];
    for (w, chunk) in words.iter_mut().zip(nonce.chunks_exact(8)) {
        let mut b = [0u8; 8];
        b.copy_from_slice(chunk);
        *w = u64::from_le_bytes(b);
    }
    words
}

fn entry(i: usize) -> usize {
    HEADER_WORDS + i * ENTRY_WORDS
}

fn cvt(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

fn pidfd_open(pid: u32) -> io::Result<OwnedFd> {
    let pid = libc::pid_t::try_from(pid).map_err(|_| io::Error::from_raw_os_error(libc::ESRCH))?;
    // SAFETY: a plain system call with integer arguments.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    let fd = libc::c_int::try_from(fd).map_err(|_| io::Error::from_raw_os_error(libc::EBADF))?;
    let fd = cvt(fd)?;
    // SAFETY: the kernel just gave this descriptor to us alone.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Whether the process behind `pidfd` has exited (its pidfd is readable).
fn exited(pidfd: &OwnedFd) -> bool {
    let mut p = libc::pollfd { fd: pidfd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd, no wait.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    n > 0 && p.revents != 0
}

/// The target's side of one window.
#[derive(Debug)]
pub struct WindowOwner {
    map: Map,
    fd: OwnedFd,
    entries: usize,
    /// The writer's process (verified by the caller), to learn it exited.
    writer: OwnedFd,
    /// Of the bytes the writer says it wrote, those already taken.
    taken: AtomicU64,
    /// Of the bytes it says it read, those already taken.
    taken_read: AtomicU64,
    /// Retired (this process's own record: the shared word is the
    /// writer's to read, never trusted back).
    retired: AtomicBool,
    /// The writer's counter when the window was retired.
    retired_at: AtomicU64,
}

impl WindowOwner {
    /// A window of `entries` entries (at most [`WINDOW_ENTRIES`]), all
    /// closed, alive, for the process `writer` (whose identity the caller
    /// verified), carrying `nonce`.
    pub fn create(nonce: &[u8; WINDOW_NONCE_LEN], entries: usize, writer: u32) -> io::Result<WindowOwner> {
        if entries == 0 || entries > WINDOW_ENTRIES {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        let writer = pidfd_open(writer)?;
        let words = words_for(entries);
        // SAFETY: a NUL-terminated name; the flags are plain bits.
        let fd =
            cvt(unsafe { libc::memfd_create(c"kvmove-window".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) })?;
        // SAFETY: the kernel just gave this descriptor to us alone.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let bytes = libc::off_t::try_from(words * 8).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
        // SAFETY: plain calls on the descriptor we own.
        cvt(unsafe { libc::ftruncate(fd.as_raw_fd(), bytes) })?;
        // The size is final: the initiator checks these seals, so it knows
        // its mapping can never lose its pages.
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        // SAFETY: as above.
        cvt(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) })?;
        let map = Map::new(&fd, words)?;
        for (k, w) in nonce_words(nonce).into_iter().enumerate() {
            map.word(W_NONCE + k).store(w, Ordering::Relaxed);
        }
        map.word(W_ENTRIES).store(entries as u64, Ordering::Relaxed);
        map.word(W_ALIVE).store(1, Ordering::Relaxed);
        map.word(W_MAGIC).store(MAGIC, Ordering::Release);
        Ok(WindowOwner {
            map,
            fd,
            entries,
            writer,
            taken: AtomicU64::new(0),
            taken_read: AtomicU64::new(0),
            retired: AtomicBool::new(false),
            retired_at: AtomicU64::new(0),
        })
    }

    /// The window file's descriptor in this process (the initiator takes a
    /// copy of it with `pidfd_getfd`).
    pub fn raw_fd(&self) -> i32 {
        self.fd.as_raw_fd()
    }

    /// Lets the initiator write (`modes` with [`DIRECT_WRITE`]) or read
    /// ([`DIRECT_READ`]) `addr .. addr + len` through entry `slot`, which
    /// must be closed (never used meanwhile by the initiator: the caller
    /// waited for [`WindowOwner::writing`] after closing it). False when
    /// the window has no such entry, `modes` opens nothing (or this is a
    /// forked child).
    pub fn open(&self, slot: usize, addr: u64, len: u64, modes: u64) -> bool {
        let modes = modes & (DIRECT_WRITE | DIRECT_READ);
        if slot >= self.entries || modes == 0 || !self.map.here() {
            return false;
        }
        let e = entry(slot);
        self.map.word(e + 1).store(addr, Ordering::Relaxed);
        self.map.word(e + 2).store(len, Ordering::Relaxed);
        self.map.word(e).store(modes, Ordering::SeqCst);
        self.map.word(W_HIGH).fetch_max(slot as u64 + 1, Ordering::SeqCst);
        true
    }

    /// Closes entry `slot`: a write that has not read it open yet never
    /// will. Then [`WindowOwner::writing`] says whether one that did may
    /// still be copying.
    pub fn close(&self, slot: usize) {
        if slot < self.entries && self.map.here() {
            self.map.word(entry(slot)).store(0, Ordering::SeqCst);
        }
    }

    /// Closes the whole window, for good (the connection ended, or the
    /// engine is closing); [`WindowOwner::is_quiet`] says when no write
    /// that saw it alive is still copying.
    pub fn retire(&self) {
        if !self.map.here() {
            return;
        }
        self.map.word(W_ALIVE).store(0, Ordering::SeqCst);
        if !self.retired.swap(true, Ordering::SeqCst) {
            self.retired_at.store(self.map.word(W_COUNTER).load(Ordering::SeqCst), Ordering::SeqCst);
        }
    }

    /// Whether the window was retired (this process's record).
    pub fn is_retired(&self) -> bool {
        self.retired.load(Ordering::SeqCst)
    }

    /// Whether the window is retired and no write that saw it alive can
    /// still be copying: the writer was not inside a write when it was
    /// retired, or has left that write since, or exited. (In a forked
    /// child, which has no window: true.)
    pub fn is_quiet(&self) -> bool {
        if !self.map.here() {
            return true;
        }
        if !self.is_retired() {
            return false;
        }
        let at = self.retired_at.load(Ordering::SeqCst);
        at.is_multiple_of(2) || self.map.word(W_COUNTER).load(Ordering::SeqCst) != at || self.writer_exited()
    }

    /// The writer's counter if it is inside a write (odd): a later value
    /// different from it means that write is over.
    pub fn writing(&self) -> Option<u64> {
        let c = self.map.word(W_COUNTER).load(Ordering::SeqCst);
        (!c.is_multiple_of(2)).then_some(c)
    }

    /// The bytes the writer wrote since the last call, as it counts them
    /// (for metrics only: a number the writer controls, never trusted
    /// for anything else; a count that goes back gives 0).
    pub fn take_written(&self) -> u64 {
        take(self.map.word(W_WRITTEN), &self.taken)
    }

    /// The bytes the initiator read directly since the last call, as
    /// [`WindowOwner::take_written`] counts writes.
    pub fn take_read(&self) -> u64 {
        take(self.map.word(W_READ), &self.taken_read)
    }

    /// Whether the writer's process has exited (it can write no more).
    pub fn writer_exited(&self) -> bool {
        exited(&self.writer)
    }
}

/// What a counter the initiator controls grew since `taken` (0 when it
/// went back).
fn take(word: &AtomicU64, taken: &AtomicU64) -> u64 {
    let now = word.load(Ordering::Relaxed);
    match taken.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |t| (now > t).then_some(now)) {
        Ok(before) => now - before,
        Err(_) => 0,
    }
}

impl Drop for WindowOwner {
    fn drop(&mut self) {
        // The writer keeps its own mapping: it must find the window dead.
        self.retire();
    }
}

/// Why a direct write did not happen. Either way nothing was written that
/// the target did not allow, and the caller writes the bytes the usual
/// way (through the target), which reports any real error.
#[derive(Debug)]
pub enum Declined {
    /// The window does not (or no longer) allow this range, or the source
    /// is not host memory of this process.
    NotAllowed,
    /// The copy failed or was short (the target exited or replaced its
    /// program, or its memory is not mapped there).
    Copy(io::Error),
}

/// The initiator's side of one window.
#[derive(Debug)]
pub struct WindowView {
    map: Map,
    entries: usize,
    /// The target's memory (`/proc/<pid>/mem`), opened once: it stays
    /// bound to the address space the target had then, so after the
    /// target exits or `exec`s (or its pid is reused) a write through it
    /// fails instead of landing in another program.
    mem: std::fs::File,
    /// One write at a time, so the counter's parity means "inside a write".
    one: Mutex<()>,
    /// The entry the last write went through (looked at first).
    last: AtomicUsize,
}

impl WindowView {
    /// Maps window file `fd` of process `pid` (the target, whose identity
    /// the caller verified) and checks it: sealed against shrinking, as
    /// large as its entry count says, the right magic and `nonce`.
    pub fn attach(pid: u32, fd: i32, nonce: &[u8; WINDOW_NONCE_LEN]) -> io::Result<WindowView> {
        let bad = |why: &str| io::Error::new(io::ErrorKind::InvalidData, format!("not a kvmove window: {why}"));
        let target = pidfd_open(pid)?;
        let mem = std::fs::OpenOptions::new().read(true).write(true).open(format!("/proc/{pid}/mem"))?;
        // SAFETY: a plain system call with integer arguments; the kernel
        // checks ptrace rights over the target.
        let got = unsafe { libc::syscall(libc::SYS_pidfd_getfd, target.as_raw_fd(), fd, 0) };
        let got = cvt(libc::c_int::try_from(got).map_err(|_| io::Error::from_raw_os_error(libc::EBADF))?)?;
        // SAFETY: the kernel just gave this descriptor to us alone.
        let file = unsafe { OwnedFd::from_raw_fd(got) };
        // The pid named the process of the pidfd until now: the memory
        // file and the window are that process's.
        if exited(&target) {
            return Err(io::Error::from_raw_os_error(libc::ESRCH));
        }
        // SAFETY: plain calls on the descriptor we own.
        let seals = cvt(unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) })?;
        if seals & libc::F_SEAL_SHRINK == 0 {
            return Err(bad("not sealed against shrinking"));
        }
        // SAFETY: a zeroed stat is a valid out-parameter.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: as above; `st` is written by the kernel.
        cvt(unsafe { libc::fstat(file.as_raw_fd(), &mut st) })?;
        let size = usize::try_from(st.st_size).map_err(|_| bad("size"))?;
        if size < words_for(1) * 8 || size > words_for(WINDOW_ENTRIES) * 8 || size % 8 != 0 {
            return Err(bad("size"));
        }
        let map = Map::new(&file, size / 8)?;
        if map.word(W_MAGIC).load(Ordering::Acquire) != MAGIC {
            return Err(bad("magic"));
        }
        for (k, w) in nonce_words(nonce).into_iter().enumerate() {
            if map.word(W_NONCE + k).load(Ordering::Relaxed) != w {
                return Err(bad("another connection's window"));
            }
        }
        // Read once; every index below is bounded by this checked copy.
        let entries = usize::try_from(map.word(W_ENTRIES).load(Ordering::Relaxed)).map_err(|_| bad("entries"))?;
        if entries == 0 || words_for(entries) != size / 8 {
            return Err(bad("entry count does not match the size"));
        }
        Ok(WindowView { map, entries, mem, one: Mutex::new(()), last: AtomicUsize::new(0) })
    }

    /// Whether the target retired the window (or this is a forked child,
    /// which never writes through it).
    pub fn is_retired(&self) -> bool {
        !self.map.here() || self.map.word(W_ALIVE).load(Ordering::SeqCst) == 0
    }

    /// Copies `len` bytes at `offset` in the host region `src` of this
    /// process to `dst` in the target, if the window allows the whole
    /// range now; see the module documentation for why the target can
    /// rely on it. Returns once the bytes are in the target's memory.
    pub fn write(&self, src: &MemoryRegion, offset: usize, len: usize, dst: u64) -> Result<(), Declined> {
        self.copy(src, offset, len, dst, DIRECT_WRITE)
    }

    /// Copies `len` bytes at `src` in the target into the host region
    /// `dst` of this process at `offset`, if the window allows reading the
    /// whole range now: as [`WindowView::write`] the other way, with the
    /// same order against the target's close (no byte is read once the
    /// target's unregister returned). Returns once the bytes are in `dst`.
    pub fn read(&self, dst: &MemoryRegion, offset: usize, len: usize, src: u64) -> Result<(), Declined> {
        self.copy(dst, offset, len, src, DIRECT_READ)
    }

    /// One direct copy between `local` (at `offset`) and `remote` in the
    /// target: a write (`DIRECT_WRITE`) or a read (`DIRECT_READ`), inside
    /// the counter's odd span, of a range an entry holds open for it.
    fn copy(&self, local: &MemoryRegion, offset: usize, len: usize, remote: u64, mode: u64) -> Result<(), Declined> {
        if len == 0 || local.provider().is_some() || local.check(offset as u64, len as u64).is_err() {
            return Err(Declined::NotAllowed);
        }
        let end = remote.checked_add(len as u64).ok_or(Declined::NotAllowed)?;
        if !self.map.here() {
            return Err(Declined::NotAllowed);
        }
        let _one = self.one.lock().unwrap_or_else(|p| p.into_inner());
        let counter = self.map.word(W_COUNTER);
        counter.fetch_add(1, Ordering::SeqCst);
        // Even again however this returns.
        struct Even<'a>(&'a AtomicU64);
        impl Drop for Even<'_> {
            fn drop(&mut self) {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        let _even = Even(counter);
        if self.map.word(W_ALIVE).load(Ordering::SeqCst) == 0 || !self.find(remote, end, mode) {
            return Err(Declined::NotAllowed);
        }
        let at = libc::off_t::try_from(remote).map_err(|_| Declined::NotAllowed)?;
        let here = (local.addr() as usize).wrapping_add(offset) as *mut libc::c_void;
        let n = if mode == DIRECT_WRITE {
            // SAFETY: the source is a range of the live host region
            // `local` that `check` bounded (its constructor's guarantee),
            // and it is only read. The destination is in the target's
            // address space (the memory file's), allowed by its window
            // (above); the kernel checks it there.
            unsafe { libc::pwrite(self.mem.as_raw_fd(), here, len, at) }
        } else {
            // SAFETY: the destination is a range of the live host region
            // `local` that `check` bounded (memory this process may write,
            // which the caller's ledger gives this copy alone). The source
            // is in the target's address space, allowed by its window
            // (above); the kernel checks it there.
            unsafe { libc::pread(self.mem.as_raw_fd(), here, len, at) }
        };
        match usize::try_from(n) {
            Ok(n) if n == len => {
                let count = if mode == DIRECT_WRITE { W_WRITTEN } else { W_READ };
                self.map.word(count).fetch_add(len as u64, Ordering::Relaxed);
                Ok(())
            }
            Ok(_) => Err(Declined::Copy(io::Error::new(io::ErrorKind::UnexpectedEof, "short copy"))),
            Err(_) => Err(Declined::Copy(io::Error::last_os_error())),
        }
    }

    /// Whether an entry open for `mode` holds `dst .. end`, read after the
    /// counter went odd.
    fn find(&self, dst: u64, end: u64, mode: u64) -> bool {
        let holds = |i: usize| {
            let e = entry(i);
            if self.map.word(e).load(Ordering::SeqCst) & mode == 0 {
                return false;
            }
            let (a, l) = (self.map.word(e + 1).load(Ordering::Relaxed), self.map.word(e + 2).load(Ordering::Relaxed));
            a <= dst && a.checked_add(l).is_some_and(|stop| end <= stop)
        };
        let last = self.last.load(Ordering::Relaxed);
        if last < self.entries && holds(last) {
            return true;
        }
        let high = usize::try_from(self.map.word(W_HIGH).load(Ordering::SeqCst)).unwrap_or(usize::MAX);
        for i in 0..high.min(self.entries) {
            if holds(i) {
                self.last.store(i, Ordering::Relaxed);
                return true;
            }
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nonce(b: u8) -> [u8; WINDOW_NONCE_LEN] {
        [b; WINDOW_NONCE_LEN]
    }

    /// Rule 9 (only what the target allows is written): a window in this
    /// process writes exactly the open ranges, and nothing once closed or
    /// retired.
    #[test]
    fn writes_only_open_ranges() {
        let dst = crate::Buffer::new(8192).unwrap();
        let src = crate::Buffer::new(4096).unwrap();
        src.region().write_at(0, &[7u8; 4096]).unwrap();
        let me = std::process::id();
        let owner = WindowOwner::create(&nonce(1), 4, me).unwrap();
        let view = WindowView::attach(me, owner.raw_fd(), &nonce(1)).unwrap();
        let base = dst.region().addr();
        // Nothing open yet.
        assert!(matches!(view.write(&src.region(), 0, 4096, base), Err(Declined::NotAllowed)));
        assert!(owner.open(2, base, 4096, DIRECT_WRITE));
        view.write(&src.region(), 0, 4096, base).unwrap();
        assert_eq!(owner.take_written(), 4096);
        assert_eq!(owner.take_written(), 0, "taken once");
        let mut got = vec![0u8; 8192];
        dst.region().read_at(0, &mut got).unwrap();
        assert_eq!(&got[..4096], &[7u8; 4096][..]);
        assert_eq!(&got[4096..], &[0u8; 4096][..]);
        // A range past the entry's end, or wrapping, is refused.
        assert!(matches!(view.write(&src.region(), 0, 4096, base + 1), Err(Declined::NotAllowed)));
        assert!(matches!(view.write(&src.region(), 0, 16, u64::MAX - 8), Err(Declined::NotAllowed)));
        assert_eq!(owner.writing(), None);
        owner.close(2);
        assert!(matches!(view.write(&src.region(), 0, 4096, base), Err(Declined::NotAllowed)));
        assert!(owner.open(0, base, 8192, DIRECT_WRITE));
        view.write(&src.region(), 0, 4096, base + 4096).unwrap();
        owner.retire();
        assert!(view.is_retired());
        assert!(matches!(view.write(&src.region(), 0, 4096, base), Err(Declined::NotAllowed)));
        assert!(!owner.open(4, base, 1, DIRECT_WRITE), "entries beyond the window");
    }

    /// Rule 9 for direct reads: only ranges open for reads are read (a
    /// write-only entry is not), nothing once closed or retired, and a
    /// read and a write each need their own mode.
    #[test]
    fn reads_only_ranges_open_for_reads() {
        let src = crate::Buffer::from_slice(&(0..8192u32).map(|i| i as u8).collect::<Vec<_>>()).unwrap();
        let dst = crate::Buffer::new(8192).unwrap();
        let me = std::process::id();
        let owner = WindowOwner::create(&nonce(6), 4, me).unwrap();
        let view = WindowView::attach(me, owner.raw_fd(), &nonce(6)).unwrap();
        let base = src.region().addr();
        assert!(matches!(view.read(&dst.region(), 0, 4096, base), Err(Declined::NotAllowed)), "nothing open");
        assert!(owner.open(1, base, 4096, DIRECT_WRITE));
        assert!(matches!(view.read(&dst.region(), 0, 4096, base), Err(Declined::NotAllowed)), "open for writes only");
        owner.close(1);
        assert!(owner.open(1, base, 4096, DIRECT_READ));
        view.read(&dst.region(), 100, 4096, base).unwrap();
        assert_eq!(&dst.to_vec()[100..4196], &src.to_vec()[..4096]);
        assert_eq!(owner.take_read(), 4096);
        assert_eq!(owner.take_written(), 0);
        assert!(matches!(view.write(&dst.region(), 0, 16, base), Err(Declined::NotAllowed)), "open for reads only");
        assert!(matches!(view.read(&dst.region(), 0, 4096, base + 1), Err(Declined::NotAllowed)), "past the entry");
        assert!(matches!(view.read(&dst.region(), 8000, 4096, base), Err(Declined::NotAllowed)), "past dst");
        assert!(owner.open(2, base + 4096, 4096, DIRECT_READ | DIRECT_WRITE));
        view.read(&dst.region(), 0, 4096, base + 4096).unwrap();
        assert_eq!(&dst.to_vec()[..4096], &src.to_vec()[4096..]);
        assert!(!owner.open(3, base, 1, 0), "no mode opens nothing");
        owner.close(1);
        assert!(matches!(view.read(&dst.region(), 0, 16, base), Err(Declined::NotAllowed)), "closed");
        owner.retire();
        assert!(matches!(view.read(&dst.region(), 0, 16, base + 4096), Err(Declined::NotAllowed)), "retired");
    }

    #[test]
    fn attach_checks_the_window() {
        let me = std::process::id();
        let owner = WindowOwner::create(&nonce(1), 1, me).unwrap();
        let e = WindowView::attach(me, owner.raw_fd(), &nonce(2)).unwrap_err();
        assert!(e.to_string().contains("another connection"), "{e}");
        // Not a window: a plain file without seals.
        let f = std::fs::File::open("/proc/self/stat").unwrap();
        assert!(WindowView::attach(me, f.as_raw_fd(), &nonce(1)).is_err());
        assert!(WindowView::attach(me, 987_654, &nonce(1)).is_err());
        assert!(WindowOwner::create(&nonce(1), WINDOW_ENTRIES + 1, me).is_err());
    }

    /// A writer stopped inside a write (its counter odd) is waited for
    /// until its process exits; a count that goes back is taken as 0.
    #[test]
    fn a_writer_that_exited_writes_no_more() {
        let mut child = std::process::Command::new("sleep").arg("30").spawn().unwrap();
        let owner = WindowOwner::create(&nonce(4), 1, child.id()).unwrap();
        owner.map.word(W_COUNTER).store(7, Ordering::SeqCst);
        assert_eq!(owner.writing(), Some(7));
        assert!(!owner.writer_exited());
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(owner.writer_exited());
        owner.map.word(W_WRITTEN).store(100, Ordering::SeqCst);
        assert_eq!(owner.take_written(), 100);
        owner.map.word(W_WRITTEN).store(40, Ordering::SeqCst);
        assert_eq!(owner.take_written(), 0);
    }

    /// A forked child of the initiator finds the window retired and writes
    /// nothing; the parent goes on writing.
    #[test]
    fn a_forked_child_never_writes_through_the_window() {
        let me = std::process::id();
        let owner = WindowOwner::create(&nonce(5), 1, me).unwrap();
        let view = WindowView::attach(me, owner.raw_fd(), &nonce(5)).unwrap();
        let (dst, src) = (crate::Buffer::new(4096).unwrap(), crate::Buffer::from_slice(&[3u8; 4096]).unwrap());
        owner.open(0, dst.region().addr(), 4096, DIRECT_WRITE);
        let region = src.region();
        // SAFETY: (test) the child only reads atomics, makes one failed
        // call, drops what it copied (no unmapping) and exits at once.
        let child = unsafe { libc::fork() };
        assert!(child >= 0);
        if child == 0 {
            let ok = view.is_retired()
                && matches!(view.write(&region, 0, 4096, dst.region().addr()), Err(Declined::NotAllowed));
            drop(view);
            // SAFETY: (test) leaves the child without running the parent's
            // test harness.
            unsafe { libc::_exit(if ok { 0 } else { 1 }) };
        }
        let mut status = 0;
        // SAFETY: (test) waits for the child just made.
        assert_eq!(unsafe { libc::waitpid(child, &mut status, 0) }, child);
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "child status {status}");
        assert_eq!(dst.to_vec(), vec![0u8; 4096], "the child wrote nothing");
        assert!(!view.is_retired());
        view.write(&region, 0, 4096, dst.region().addr()).unwrap();
        assert_eq!(dst.to_vec(), vec![3u8; 4096]);
        owner.retire();
        assert!(owner.is_quiet(), "retired with no write inside");
    }

    /// The handshake of `close` and the counter: a writer that saw the
    /// entry open is seen by the owner as writing until it is done, and one
    /// that comes after the close copies nothing.
    #[test]
    fn a_close_waits_for_the_write_that_saw_it_open() {
        let me = std::process::id();
        let owner = WindowOwner::create(&nonce(3), 2, me).unwrap();
        let view = WindowView::attach(me, owner.raw_fd(), &nonce(3)).unwrap();
        let dst = crate::Buffer::new(1 << 20).unwrap();
        let src = crate::Buffer::new(1 << 20).unwrap();
        src.region().write_at(0, &vec![9u8; 1 << 20]).unwrap();
        owner.open(1, dst.region().addr(), 1 << 20, DIRECT_WRITE);
        let stop = std::sync::atomic::AtomicBool::new(false);
        // Stops the writer also when an assertion below fails (the scope
        // joins it before the panic goes on).
        struct Stop<'a>(&'a std::sync::atomic::AtomicBool);
        impl Drop for Stop<'_> {
            fn drop(&mut self) {
                self.0.store(true, Ordering::Relaxed);
            }
        }
        std::thread::scope(|s| {
            s.spawn(|| {
                let mut n = 0u32;
                while !stop.load(Ordering::Relaxed) && n < 1_000_000 {
                    let _ = view.write(&src.region(), 0, 1 << 20, dst.region().addr());
                    n += 1;
                }
            });
            let _stop = Stop(&stop);
            for _ in 0..200 {
                owner.close(1);
                // From here on, nothing may land: zero the destination once
                // the write that may have seen the entry open is over.
                if let Some(c) = owner.writing() {
                    while owner.map.word(W_COUNTER).load(Ordering::SeqCst) == c {
                        std::hint::spin_loop();
                    }
                }
                dst.region().write_at(0, &vec![0u8; 1 << 20]).unwrap();
                std::thread::sleep(std::time::Duration::from_micros(200));
                let mut got = vec![1u8; 1 << 20];
                dst.region().read_at(0, &mut got).unwrap();
                assert!(got.iter().all(|&b| b == 0), "a write landed after the close was quiet");
                owner.open(1, dst.region().addr(), 1 << 20, DIRECT_WRITE);
                std::thread::sleep(std::time::Duration::from_micros(100));
            }
        });
    }
}
