//! kvmove's CUDA driver double, for tests: where its shared library is
//! ([`library`], built by build.rs from `driver/libcuda.rs`), a test run
//! under it in a child process ([`under_double`]), and its own functions
//! from inside that process ([`Double`]: failures on demand, the record of
//! calls, what is still held).
#![allow(unsafe_code)]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::ffi::{c_char, c_int, c_uint, c_void, CString};
use std::path::PathBuf;
use std::process::Command;

/// Clippy's view of the double itself (it is built by build.rs, outside
/// cargo's targets); never compiled into this library.
#[cfg(clippy)]
#[path = "../driver/libcuda.rs"]
mod driver;

/// Where a test body runs.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Driver {
    /// The CUDA driver double, in a child process of the test.
    Double,
    /// A real GPU and driver (`KVMOVE_CUDA_TESTS=gpu`).
    Gpu,
}

/// The double's shared library: `KVMOVE_CUDA_DOUBLE_LIB` if set (binaries
/// copied to another machine, scripts/gpu-tests.sh --prebuilt), else where
/// this crate's build script built it.
pub fn library() -> PathBuf {
    match std::env::var_os("KVMOVE_CUDA_DOUBLE_LIB") {
        Some(p) => PathBuf::from(p),
        None => PathBuf::from(env!("KVMOVE_CUDA_DOUBLE_BUILT")),
    }
}

/// A directory holding the double under the driver's names
/// (`libcuda.so.1`, `libcuda.so`), for a process's `LD_LIBRARY_PATH`: the
/// one the build script made, or (with `KVMOVE_CUDA_DOUBLE_LIB`) a new one
/// under the temporary directory.
pub fn driver_dir(tag: &str) -> std::io::Result<PathBuf> {
    if std::env::var_os("KVMOVE_CUDA_DOUBLE_LIB").is_none() {
        return Ok(PathBuf::from(env!("KVMOVE_CUDA_DOUBLE_DIR")));
    }
    let lib = library();
    if !lib.exists() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::NotFound,
            format!("no CUDA driver double at {}", lib.display()),
        ));
    }
    let dir = std::env::temp_dir().join(format!("kvmove-cuda-double-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    for name in ["libcuda.so.1", "libcuda.so"] {
        std::os::unix::fs::symlink(&lib, dir.join(name))?;
    }
    Ok(dir)
}

/// `LD_LIBRARY_PATH` with `dir` first.
fn library_path(dir: &std::path::Path) -> std::ffi::OsString {
    let mut path = dir.as_os_str().to_owned();
    if let Some(old) = std::env::var_os("LD_LIBRARY_PATH") {
        path.push(":");
        path.push(old);
    }
    path
}

/// For a test binary with a `main` of its own (a conformance suite):
/// unless it already runs under the double (or on a GPU, with
/// `KVMOVE_CUDA_TESTS=gpu`), replaces this process with itself, the same
/// arguments, under the double. Returns the driver it runs against.
///
/// # Panics
///
/// When the double is missing or the process cannot be replaced.
pub fn run_under_double() -> Driver {
    match std::env::var("KVMOVE_CUDA_TESTS").as_deref() {
        Ok("gpu") => return Driver::Gpu,
        Ok("double") => return Driver::Double,
        _ => {}
    }
    use std::os::unix::process::CommandExt;
    let dir = driver_dir("main").expect("the CUDA driver double");
    let err = Command::new(std::env::current_exe().unwrap())
        .args(std::env::args_os().skip(1))
        .env("LD_LIBRARY_PATH", library_path(&dir))
        .env("KVMOVE_CUDA_TESTS", "double")
        .exec();
    panic!("cannot run under the CUDA driver double: {err}");
}

/// Runs `test` (this binary's test of that name) under the double, in a
/// child with `env` set, and fails if it fails. Returns the driver the
/// body should run against here, or `None` when the child ran it. With
/// `KVMOVE_CUDA_TESTS=gpu` the body runs here against the real driver.
///
/// # Panics
///
/// When the child fails, ran no test of that name, or still runs after
/// 300 s (killed as hung).
pub fn under_double(test: &str, env: &[(&str, &str)]) -> Option<Driver> {
    match std::env::var("KVMOVE_CUDA_TESTS").as_deref() {
        Ok("gpu") => return Some(Driver::Gpu),
        Ok("double") => return Some(Driver::Double),
        _ => {}
    }
    let dir = driver_dir(test).expect("the CUDA driver double");
    let path = library_path(&dir);
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env("LD_LIBRARY_PATH", path)
        .env("KVMOVE_CUDA_TESTS", "double");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let (status, text) = run_bounded(cmd, CHILD_LIMIT);
    if std::env::var_os("KVMOVE_CUDA_DOUBLE_LIB").is_some() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    let Some(status) = status else {
        panic!(
            "{test} under the CUDA driver double still ran after {CHILD_LIMIT:?}: killed (a hang). Its output:\n{text}"
        );
    };
    assert!(status.success(), "{test} under the CUDA driver double failed:\n{text}");
    assert!(text.contains("1 passed"), "{test} did not run under the double:\n{text}");
    None
}

/// How long a test run under the double ([`under_double`]) may take before
/// it is killed as hung: each runs in seconds.
const CHILD_LIMIT: std::time::Duration = std::time::Duration::from_secs(300);

/// Runs `cmd` for at most `limit`, its output (stdout and stderr, in the
/// order written) collected into a file: its exit status, or `None` when
/// it was killed at the limit, and what it wrote. A file, not pipes, so a
/// process it left behind holding them cannot keep this waiting.
fn run_bounded(mut cmd: Command, limit: std::time::Duration) -> (Option<std::process::ExitStatus>, String) {
    use std::io::{Read, Seek};
    let mut out = tempfile_or_panic();
    let err = out.try_clone().expect("a second handle on the output file");
    let mut child = cmd
        .stdin(std::process::Stdio::null())
        .stdout(out.try_clone().expect("a handle on the output file"))
        .stderr(err)
        .spawn()
        .expect("the test binary starts again under the double");
    let start = std::time::Instant::now();
    let status = loop {
        match child.try_wait().expect("waiting for the child") {
            Some(s) => break Some(s),
            None if start.elapsed() >= limit => {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            None => std::thread::sleep(std::time::Duration::from_millis(20)),
        }
    };
    let mut text = String::new();
    let _ = out.rewind();
    let mut bytes = Vec::new();
    let _ = out.read_to_end(&mut bytes);
    text.push_str(&String::from_utf8_lossy(&bytes));
    (status, text)
}

/// An unnamed file in the temporary directory (gone once closed).
fn tempfile_or_panic() -> std::fs::File {
    let dir = std::env::temp_dir();
    for n in 0..1000u32 {
        let path = dir.join(format!("kvmove-cuda-double-{}-{n}.out", std::process::id()));
        if let Ok(f) = std::fs::OpenOptions::new().read(true).write(true).create_new(true).open(&path) {
            let _ = std::fs::remove_file(&path);
            return f;
        }
    }
    panic!("no temporary file for the child's output in {}", dir.display());
}

/// The double's own functions (found in the loaded driver library).
#[derive(Debug)]
pub struct Double {
    handle: *mut c_void,
}

// SAFETY: a `dlopen` handle may be used from any thread (`dlsym` is
// thread-safe), and the double's functions lock their own state.
unsafe impl Send for Double {}
// SAFETY: as for `Send`.
unsafe impl Sync for Double {}

impl Double {
    /// The next `count` copies to or from device `dev`'s memory fail with
    /// CUDA_ERROR_ILLEGAL_ADDRESS (0: none fail).
    pub fn fail_copies(&self, dev: u32, count: u64) {
        // SAFETY: the double exports this function with this signature.
        let f: unsafe extern "C" fn(c_uint, u64) =
            unsafe { std::mem::transmute(self.sym(c"kvmove_double_fail_copies")) };
        // SAFETY: plain values.
        unsafe { f(dev, count) }
    }

    /// How many of the failures set by [`Double::fail_copies`] are left.
    pub fn copy_failures_left(&self, dev: u32) -> u64 {
        type Left = unsafe extern "C" fn(c_uint) -> u64;
        // SAFETY: the double exports this function with this signature.
        let f: Left = unsafe { std::mem::transmute(self.sym(c"kvmove_double_copy_failures_left")) };
        // SAFETY: a plain value.
        unsafe { f(dev) }
    }

    /// Each copy of device `dev` takes `d` more (zero: none).
    pub fn delay_copies(&self, dev: u32, d: std::time::Duration) {
        // SAFETY: the double exports this function with this signature.
        let f: unsafe extern "C" fn(c_uint, u64) =
            unsafe { std::mem::transmute(self.sym(c"kvmove_double_delay_copies")) };
        let us = u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        // SAFETY: plain values.
        unsafe { f(dev, us) }
    }

    /// The double loaded in this process (loads it through the library
    /// path, as the provider does).
    ///
    /// # Panics
    ///
    /// When the `libcuda.so.1` found is not the double.
    pub fn get() -> Double {
        // SAFETY: loads the driver library the provider loads (the double,
        // on this child's library path); it stays loaded for the process.
        let handle = unsafe { libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW) };
        assert!(!handle.is_null(), "libcuda.so.1 not loadable");
        let d = Double { handle };
        assert!(!d.sym(c"kvmove_double_report").is_null(), "the libcuda.so.1 loaded is not the double");
        d
    }

    fn sym(&self, name: &std::ffi::CStr) -> *mut c_void {
        // SAFETY: looks a symbol up in a library handle from dlopen.
        unsafe { libc::dlsym(self.handle, name.as_ptr()) }
    }

    /// The double's report (calls recorded, what is still held).
    pub fn report(&self) -> serde_json::Value {
        type Report = unsafe extern "C" fn(*mut c_char, usize) -> usize;
        // SAFETY: the double exports this function with this signature.
        let f: Report = unsafe { std::mem::transmute(self.sym(c"kvmove_double_report")) };
        // SAFETY: a null buffer asks for the length only.
        let n = unsafe { f(std::ptr::null_mut(), 0) };
        let mut buf = vec![0u8; n + 1];
        // SAFETY: `buf` holds `n + 1` bytes.
        unsafe { f(buf.as_mut_ptr().cast(), buf.len()) };
        buf.truncate(n);
        serde_json::from_slice(&buf).unwrap()
    }

    /// One count of what is held (`contexts`, `streams`, ...).
    pub fn live(&self, what: &str) -> u64 {
        self.report()["live"][what].as_u64().unwrap()
    }

    /// Names of the driver calls recorded, in order.
    pub fn calls(&self) -> Vec<String> {
        self.report()["calls"].as_array().unwrap().iter().map(|c| c[0].as_str().unwrap().to_owned()).collect()
    }

    pub fn clear_calls(&self) {
        // SAFETY: the double exports this function with this signature.
        let f: unsafe extern "C" fn() = unsafe { std::mem::transmute(self.sym(c"kvmove_double_clear_calls")) };
        // SAFETY: no arguments.
        unsafe { f() };
    }

    /// The next `count` calls of `name` fail with `code`.
    pub fn fail(&self, name: &str, code: u32, count: u32) {
        type Fail = unsafe extern "C" fn(*const c_char, c_uint, c_uint) -> c_int;
        // SAFETY: the double exports this function with this signature.
        let f: Fail = unsafe { std::mem::transmute(self.sym(c"kvmove_double_fail")) };
        let name = CString::new(name).unwrap();
        // SAFETY: a NUL-terminated name.
        assert_eq!(unsafe { f(name.as_ptr(), code, count) }, 0);
    }

    /// How deep this thread's context stack is.
    pub fn depth(&self) -> u32 {
        // SAFETY: the double exports this function with this signature.
        let f: unsafe extern "C" fn() -> c_uint =
            unsafe { std::mem::transmute(self.sym(c"kvmove_double_stack_depth")) };
        // SAFETY: no arguments.
        unsafe { f() }
    }

    /// Queues a "kernel" setting `len` bytes at `dst` to `byte` on `stream`.
    pub fn launch(&self, stream: u64, dst: u64, byte: u8, len: usize) {
        type Launch = unsafe extern "C" fn(u64, u64, u8, usize) -> c_uint;
        // SAFETY: the double exports this function with this signature.
        let f: Launch = unsafe { std::mem::transmute(self.sym(c"kvmove_double_launch")) };
        // SAFETY: `dst` is device memory of the double.
        assert_eq!(unsafe { f(stream, dst, byte, len) }, 0);
    }
}

/// The conformance suite's device source ([`conformance::devices`]) made
/// of CUDA devices through the real CUDA provider: over the double (copy
/// failures and delays through [`Double`]) or, with [`Driver::Gpu`], a
/// real GPU (no failures or delays: those device cases skip them).
pub mod devices {
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use conformance::devices::TestDevice;
    use transport_core::{DeviceMemory, MemoryRegion};
    use transport_mem::{CudaAlloc, CudaDevices};

    use super::{Double, Driver};

    /// Installs CUDA devices as the device cases' source.
    ///
    /// # Panics
    ///
    /// Where no CUDA device opens.
    pub fn install(driver: Driver) {
        let cuda = Arc::new(CudaDevices::open().unwrap().expect("no CUDA device"));
        let double = (driver == Driver::Double).then(|| Arc::new(Double::get()));
        let name = match driver {
            Driver::Double => "CUDA (driver double)",
            Driver::Gpu => "CUDA (GPU)",
        };
        conformance::devices::install(
            name,
            Arc::new(move |index, _len| {
                let dev = index % u32::try_from(cuda.count()).unwrap_or(1).max(1);
                let allocs = Mutex::new(Vec::new());
                Ok(Arc::new(Cuda { cuda: cuda.clone(), dev, allocs, double: double.clone() }) as Arc<dyn TestDevice>)
            }),
        );
    }

    /// One CUDA device; its allocations live as long as it does.
    #[derive(Debug)]
    struct Cuda {
        cuda: Arc<CudaDevices>,
        dev: u32,
        allocs: Mutex<Vec<CudaAlloc>>,
        double: Option<Arc<Double>>,
    }

    impl TestDevice for Cuda {
        fn region(&self, len: usize) -> Result<MemoryRegion, String> {
            let a = self.cuda.alloc(self.dev, len).map_err(|e| e.to_string())?;
            let provider: Arc<dyn DeviceMemory> = self.cuda.clone();
            // SAFETY: `a` is kept in `self.allocs` until this device drops,
            // which the suite does only after the region's transports are
            // gone (a guarded region holds its device).
            let r = unsafe { MemoryRegion::from_device(provider, a.addr(), len) }.map_err(|e| e.to_string())?;
            self.allocs.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(a);
            Ok(r)
        }

        fn fail_copies(&self, n: u64) -> bool {
            self.double.as_ref().is_some_and(|d| {
                d.fail_copies(self.dev, n);
                true
            })
        }

        fn failures_left(&self) -> u64 {
            self.double.as_ref().map_or(0, |d| d.copy_failures_left(self.dev))
        }

        fn delay_copies(&self, d: Duration) -> bool {
            self.double.as_ref().is_some_and(|x| {
                x.delay_copies(self.dev, d);
                true
            })
        }
    }
}
