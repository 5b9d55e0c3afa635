//! The low-level classes behind the Pythonic API in `kvmove/__init__.py`:
//! `NativeEngine` (raises `kvmove.TransferError` subclasses) and
//! `NativeBatch` (a submitted transfer: poll / wait / cancel).

use std::sync::Arc;
use std::time::Duration;

use kvmove_policy::session::Grant;
use kvmove_policy::{PolicyConfig, Transfer, TransferOutcome};
use parking_lot::Mutex;
use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use transport_core::{Error, ErrorKind, Opcode, Result, SegmentId};

use crate::backend::{config_kind, engine_config, split_host_port, BackendOptions};
use crate::core::{Core, RawOp};
use crate::devmem::Want;
use crate::errors::{invalid, to_pyerr};
use crate::handoff::{bounded, grant_tuple, timeout_arg, GrantTuple, NativeHandoff};
use crate::nixl::{NixlOps, NixlXfer};
use crate::outcome::outcome_to_py;
use crate::words::Word;

/// Parses a JSON policy (keys of the Rust `PolicyConfig`).
pub(crate) fn parse_policy(json: &str) -> Result<PolicyConfig> {
    let p: PolicyConfig = serde_json::from_str(json)
        .map_err(|e| Error::new(ErrorKind::Config, format!("policy: {e}")).with("policy", json))?;
    p.validate()?;
    Ok(p)
}

fn py_result<T>(py: Python<'_>, r: Result<T>) -> PyResult<T> {
    r.map_err(|e| to_pyerr(py, &e))
}

/// The engine configuration the constructor's arguments make: `config`
/// (TOML text) with the backend, listen address and device the other
/// arguments give in place of its own (without a config: TCP on
/// 127.0.0.1).
fn config_for(
    protocol: Option<&str>,
    host: Option<&str>,
    port: Option<u16>,
    device: Option<&str>,
    config: Option<&str>,
) -> Result<kvmove::EngineConfig> {
    let overrides = config.is_none() || protocol.is_some() || host.is_some() || port.is_some();
    let opts = if overrides {
        let (h, p) = split_host_port(host.unwrap_or("127.0.0.1"))?;
        if let (Some(port), true) = (port, p != 0) {
            if port != p {
                return Err(invalid("port given both in host and as port, differently"));
            }
        }
        // Not given: the config's backend (a host given with a
        // config moves the listener, not the backend), else TCP.
        let protocol = match protocol {
            Some(p) => p.trim().to_ascii_lowercase(),
            None => config_kind(config).unwrap_or_else(|| "tcp".into()),
        };
        if !matches!(protocol.as_str(), "tcp" | "rdma") {
            return Err(Error::new(ErrorKind::Unsupported, "unknown protocol; use \"tcp\" or \"rdma\"")
                .with("protocol", protocol));
        }
        Some(BackendOptions {
            protocol,
            host: h,
            port: port.unwrap_or(p),
            device: device.unwrap_or_default().to_owned(),
        })
    } else {
        None
    };
    engine_config(opts.as_ref(), config)
}

/// One engine: a backend with the shared policy, its own runtime.
#[pyclass(module = "kvmove._native", name = "NativeEngine", frozen)]
pub(crate) struct NativeEngine {
    core: Arc<Core>,
}

/// `(local_addr, remote_addr, length)`, all of one direction.
type PairTuple = (Word, Word, Word);

fn raw_pairs(write: bool, ops: &[PairTuple]) -> Vec<RawOp> {
    let op = if write { Opcode::Write } else { Opcode::Read };
    ops.iter()
        .map(|&(Word(local_addr), Word(remote_addr), Word(len))| RawOp { op, local_addr, remote_addr, len })
        .collect()
}

impl NativeEngine {
    /// Starts the engine `cfg` describes (the GIL released meanwhile).
    fn start(py: Python<'_>, cfg: Result<kvmove::EngineConfig>) -> PyResult<Self> {
        let core = cfg.and_then(|cfg| py.allow_threads(|| Core::start(&cfg)));
        Ok(Self { core: Arc::new(py_result(py, core)?) })
    }

    fn submit_raw(&self, py: Python<'_>, segment: u64, raw: Vec<RawOp>) -> PyResult<NativeBatch> {
        let core = &self.core;
        let t = py_result(
            py,
            py.allow_threads(|| {
                let reqs = core.requests(SegmentId(segment), &raw)?;
                core.submit(reqs)
            }),
        )?;
        Ok(NativeBatch { core: self.core.clone(), slot: Mutex::new(Slot::Running(t)) })
    }

    fn transfer_raw(&self, py: Python<'_>, segment: u64, raw: Vec<RawOp>) -> PyResult<PyObject> {
        let core = &self.core;
        let o = py_result(
            py,
            py.allow_threads(|| {
                let reqs = core.requests(SegmentId(segment), &raw)?;
                core.transfer(reqs)
            }),
        )?;
        outcome_to_py(py, &o)
    }
}

#[pymethods]
impl NativeEngine {
    /// Starts an engine. With `config` (TOML text of a kvmove
    /// `EngineConfig`), the backend and its options come from it and
    /// `protocol` / `host` / `port` / `device` override them only when given;
    /// without it they default to TCP on `127.0.0.1`, a free port.
    /// `policy_json` replaces the policy.
    #[new]
    #[pyo3(signature = (protocol = None, host = None, port = None, device = None, policy_json = None, config = None))]
    fn new(
        py: Python<'_>,
        protocol: Option<&str>,
        host: Option<&str>,
        port: Option<u16>,
        device: Option<&str>,
        policy_json: Option<&str>,
        config: Option<&str>,
    ) -> PyResult<Self> {
        let cfg = config_for(protocol, host, port, device, config).and_then(|mut cfg| {
            if let Some(p) = policy_json {
                cfg.policy = parse_policy(p)?;
            }
            Ok(cfg)
        });
        Self::start(py, cfg)
    }

    /// An engine configured as every Python surface configures its own
    /// (the NIXL agent, SGLang's backend, the vLLM connector): the TOML
    /// file `KVMOVE_CONFIG` names, the policy in `KVMOVE_POLICY` (JSON) in
    /// place of the file's, and `KVMOVE_PROTOCOL` when `protocol` is not
    /// given; the arguments override the file as in the constructor. Read
    /// here, once, so every surface reads them alike.
    #[staticmethod]
    #[pyo3(signature = (protocol = None, host = None, port = None, device = None))]
    fn from_env(
        py: Python<'_>,
        protocol: Option<&str>,
        host: Option<&str>,
        port: Option<u16>,
        device: Option<&str>,
    ) -> PyResult<Self> {
        let cfg = (|| {
            let config = crate::backend::base_config_from_env()?;
            let protocol = protocol.map(str::to_owned).or_else(crate::backend::protocol_from_env);
            let mut cfg = config_for(protocol.as_deref(), host, port, device, config.as_deref())?;
            if let Some(p) = crate::backend::policy_from_env()? {
                cfg.policy = p;
            }
            Ok(cfg)
        })();
        Self::start(py, cfg)
    }

    /// `host:port` that peers open to reach this engine.
    #[getter]
    fn session_id(&self) -> String {
        self.core.session_id().to_owned()
    }

    /// The wait policy in force (`policy.wait`, `KVMOVE_SPIN_US` in place
    /// of `spin_us`): `{"spin_us": .., "spinning_gap_us": .., "fresh_us":
    /// .., "spinner_wait_us": ..}`, what the bindings' polls follow.
    #[getter]
    fn wait_policy<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let w = self.core.wait_policy();
        let d = PyDict::new(py);
        d.set_item("spin_us", w.spin_us)?;
        d.set_item("spinning_gap_us", w.spinning_gap_us)?;
        d.set_item("fresh_us", w.fresh_us)?;
        d.set_item("spinner_wait_us", w.spinner_wait_us)?;
        Ok(d)
    }

    /// The backend kind (`tcp`, `rdma`).
    #[getter]
    fn backend(&self) -> String {
        self.core.backend()
    }

    /// Whether this engine's backend moves device memory.
    #[getter]
    fn device_memory(&self) -> bool {
        self.core.device_memory()
    }

    /// The kind of the registered memory holding `addr`: `"host"` or
    /// `"device:N"`.
    fn memory_kind(&self, py: Python<'_>, addr: u64) -> PyResult<String> {
        py_result(py, self.core.memory_kind(addr)).map(|k| k.to_string())
    }

    /// Registers raw memory: host memory this process can read, or device
    /// memory of an installed provider. `kind` is `"auto"` (found from the
    /// pointer), `"host"`, `"device"` or `"device:N"`; returns the kind
    /// registered (`"host"`, `"device:N"`). See
    /// `kvmove.Engine.register_address` for the safety contract the caller
    /// keeps.
    #[pyo3(signature = (addr, length, kind = "auto"))]
    fn register_address(&self, py: Python<'_>, addr: u64, length: u64, kind: &str) -> PyResult<String> {
        let want = py_result(py, Want::parse(kind))?;
        let core = &self.core;
        let r = py.allow_threads(|| {
            // SAFETY: the Python caller keeps `MemoryRegion::from_raw`'s
            // (or `from_device`'s) contract, as documented on
            // `kvmove.Engine.register_address`.
            unsafe { core.register(addr, length, None, want) }
        });
        py_result(py, r).map(|k| k.to_string())
    }

    /// Registers a writable, C-contiguous Python buffer (bytearray,
    /// memoryview, numpy array...). Keeps a buffer export until
    /// unregistered, so the memory can neither be freed nor resized.
    /// Returns `(address, length)`.
    fn register_buffer(&self, py: Python<'_>, obj: &Bound<'_, PyAny>) -> PyResult<(u64, u64)> {
        let view = py.import("builtins")?.getattr("memoryview")?.call1((obj,))?;
        if view.getattr("readonly")?.extract::<bool>()? {
            return Err(to_pyerr(py, &invalid("the buffer is read-only; transfers may write into registered memory")));
        }
        if !view.getattr("c_contiguous")?.extract::<bool>()? {
            return Err(to_pyerr(py, &invalid("the buffer is not C-contiguous")));
        }
        let bytes = view.call_method1("cast", ("B",))?;
        let buf = PyBuffer::<u8>::get(&bytes)?;
        let (addr, len) = (buf.buf_ptr() as u64, buf.len_bytes() as u64);
        let core = &self.core;
        let r = py.allow_threads(|| {
            // SAFETY: `buf` is a live export of the object's memory; it is
            // stored with the region and released only after the transport
            // unregistered the region (or shut down), so the memory outlives
            // every transfer.
            unsafe { core.register(addr, len, Some(buf), Want::Host) }.map(drop)
        });
        py_result(py, r)?;
        Ok((addr, len))
    }

    /// Unregisters the region that starts at `addr`; returns when no
    /// transfer can touch it any more.
    fn unregister(&self, py: Python<'_>, addr: u64) -> PyResult<()> {
        let core = self.core.clone();
        let keep = py_result(py, py.allow_threads(move || core.unregister(addr)))?;
        drop(keep); // the buffer export is released here, with the GIL
        Ok(())
    }

    /// Opens a peer's segment (`host:port`); returns a handle.
    fn open_segment(&self, py: Python<'_>, peer: &str) -> PyResult<u64> {
        let core = self.core.clone();
        py_result(py, py.allow_threads(move || core.open_segment(peer))).map(|s| s.0)
    }

    /// Closes a segment handle; transfers still running on it end.
    fn close_segment(&self, py: Python<'_>, segment: u64) -> PyResult<()> {
        let core = self.core.clone();
        py_result(py, py.allow_threads(move || core.close_segment(SegmentId(segment))))
    }

    /// Submits `(local_addr, remote_addr, length)` requests, all writes
    /// (`write`) or all reads, on a segment; returns a running batch. The
    /// caller's tuples are read here as they are.
    fn submit_pairs(&self, py: Python<'_>, segment: u64, write: bool, ops: Vec<PairTuple>) -> PyResult<NativeBatch> {
        self.submit_raw(py, segment, raw_pairs(write, &ops))
    }

    /// Submits requests as `submit_pairs` does and waits; returns the
    /// outcome tuple.
    fn transfer_pairs(&self, py: Python<'_>, segment: u64, write: bool, ops: Vec<PairTuple>) -> PyResult<PyObject> {
        self.transfer_raw(py, segment, raw_pairs(write, &ops))
    }

    /// NIXL agent: submits `ops` (a `NixlOps`) on a segment; with
    /// `notify_peer` and `notify_msg`, the runtime sends the message to that
    /// peer once every request completed (never after a failure). Returns a
    /// `NixlXfer`.
    #[pyo3(signature = (segment, ops, notify_peer = None, notify_msg = None))]
    fn submit_nixl(
        &self,
        py: Python<'_>,
        segment: u64,
        ops: &NixlOps,
        notify_peer: Option<String>,
        notify_msg: Option<Vec<u8>>,
    ) -> PyResult<NixlXfer> {
        let notify = match (notify_peer, notify_msg) {
            (Some(p), Some(m)) => Some((p, m)),
            (None, None) => None,
            _ => return Err(to_pyerr(py, &invalid("notify_peer and notify_msg go together"))),
        };
        let core = &self.core;
        py_result(
            py,
            py.allow_threads(|| {
                // A transfer of nothing but zero-byte descriptors only
                // sends its notification.
                let reqs = if ops.ops.is_empty() { Vec::new() } else { core.requests(SegmentId(segment), &ops.ops)? };
                NixlXfer::start(core, reqs, notify)
            }),
        )
    }

    /// Copies bytes into registered local memory.
    fn write_local(&self, py: Python<'_>, addr: u64, data: &[u8]) -> PyResult<()> {
        py_result(py, self.core.write_local(addr, data))
    }

    /// Copies bytes out of registered local memory.
    fn read_local<'py>(&self, py: Python<'py>, addr: u64, length: u64) -> PyResult<Bound<'py, PyBytes>> {
        py_result(py, self.core.read_local(addr, length)).map(|v| PyBytes::new(py, &v))
    }

    /// Sends a plain notification (at most 4096 bytes) to `peer`; returns
    /// once it is in the peer's inbox. A full inbox is offered it again for
    /// the policy's `notify_patience`; past it a transient `backpressure`
    /// error is raised (nothing was queued: retry later).
    fn notify(&self, py: Python<'_>, peer: &str, msg: &[u8]) -> PyResult<()> {
        let core = &self.core;
        let msg = msg.to_vec();
        let r = py.allow_threads(|| {
            crate::core::check_peer_name(peer)?;
            let s = core.sessions()?;
            core.block_on(s.notify(peer, msg))
        });
        py_result(py, r)
    }

    /// Takes up to `max` received notifications, oldest first, as
    /// `(peer, bytes)`; never blocks.
    fn notifications<'py>(&self, py: Python<'py>, max: usize) -> PyResult<Vec<(String, Bound<'py, PyBytes>)>> {
        let s = py_result(py, self.core.sessions())?;
        Ok(s.take_notifications(max).into_iter().map(|n| (n.from, PyBytes::new(py, &n.msg))).collect())
    }

    /// Waits up to `timeout` seconds (None = no limit) until a notification
    /// is queued; whether one is.
    #[pyo3(signature = (timeout = None))]
    fn wait_notification(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
        let core = &self.core;
        let r = py.allow_threads(|| {
            let limit = timeout_arg(timeout)?;
            let s = core.sessions()?;
            match bounded(core, limit, s.wait_notification())? {
                None => Ok(false),
                Some(r) => r.map(|()| true),
            }
        });
        py_result(py, r)
    }

    /// Receiver: grants `peer` (the sender's session id) the right to write
    /// `ranges` (`(addr, len)` in this engine's registered memory) for
    /// session `id`; `expected` bytes must be written before `deadline`
    /// seconds from now.
    fn receive(
        &self,
        py: Python<'_>,
        peer: &str,
        id: u64,
        ranges: Vec<(u64, u64)>,
        expected: u64,
        deadline: f64,
    ) -> PyResult<NativeHandoff> {
        let core = &self.core;
        let r = py.allow_threads(|| {
            if !(deadline > 0.0 && deadline.is_finite()) {
                return Err(invalid("deadline must be a positive, finite number of seconds"));
            }
            let grant = Grant { ranges, expected, deadline: Duration::from_secs_f64(deadline) };
            NativeHandoff::receive(core, peer, id, grant)
        });
        py_result(py, r)
    }

    /// Sender: expects a grant from `peer` (the receiver's session id) for
    /// session `id`.
    fn send(&self, py: Python<'_>, peer: &str, id: u64) -> PyResult<NativeHandoff> {
        let core = &self.core;
        py_result(py, py.allow_threads(|| NativeHandoff::send(core, peer, id)))
    }

    /// Sender: grants received and not yet written to, oldest first, as
    /// `(peer, id, (ranges, expected, deadline_seconds))`.
    fn grants(&self, py: Python<'_>) -> PyResult<Vec<(String, u64, GrantTuple)>> {
        let s = py_result(py, self.core.sessions())?;
        Ok(s.grants().into_iter().map(|(k, g)| (k.peer, k.id, grant_tuple(&g))).collect())
    }

    /// The same grants as `grants`, without their ranges: `(peer, id)`
    /// (cheap to poll often).
    fn grant_keys(&self, py: Python<'_>) -> PyResult<Vec<(String, u64)>> {
        let s = py_result(py, self.core.sessions())?;
        Ok(s.grants().into_iter().map(|(k, _)| (k.peer, k.id)).collect())
    }

    /// Live resource counts as a dict.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (k, v) in self.core.stats() {
            d.set_item(k, v)?;
        }
        Ok(d)
    }

    /// Shuts everything down (idempotent).
    fn close(&self, py: Python<'_>) {
        let core = self.core.clone();
        let keep = py.allow_threads(move || core.close());
        drop(keep);
    }
}

enum Slot {
    Running(Transfer),
    /// A `cancel` is waiting for the transfer to be quiet.
    Cancelling,
    Done(TransferOutcome),
}

/// A submitted transfer.
#[pyclass(module = "kvmove._native", name = "NativeBatch", frozen)]
pub(crate) struct NativeBatch {
    core: Arc<Core>,
    slot: Mutex<Slot>,
}

impl NativeBatch {
    /// The outcome if finished. With `here`, progress is made on this
    /// thread first and a first attempt that completed is finished here,
    /// without the engine's driver task (`Transfer::try_finish`); without,
    /// the driver is started if it was not (`Transfer::poll`).
    fn try_finish(&self, here: bool) -> Option<TransferOutcome> {
        let mut slot = self.slot.lock();
        let o = match &*slot {
            Slot::Running(t) if here => self.core.in_rt(|| t.try_finish())?,
            Slot::Running(t) => t.poll()?,
            Slot::Cancelling => return None,
            Slot::Done(o) => return Some(o.clone()),
        };
        *slot = Slot::Done(o.clone());
        Some(o)
    }
}

#[pymethods]
impl NativeBatch {
    /// The outcome tuple if finished, else None. Never blocks.
    fn poll(&self, py: Python<'_>) -> PyResult<Option<PyObject>> {
        self.try_finish(true).map(|o| outcome_to_py(py, &o)).transpose()
    }

    /// Waits (GIL released) up to `timeout` seconds (None = no limit);
    /// returns the outcome tuple, or None if still running.
    #[pyo3(signature = (timeout = None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Option<PyObject>> {
        let limit = match timeout {
            Some(t) if !(t >= 0.0 && t.is_finite()) => {
                return Err(to_pyerr(py, &invalid("timeout must be a finite number of seconds >= 0")))
            }
            Some(t) => Some(Duration::from_secs_f64(t)),
            None => None,
        };
        let o = py.allow_threads(|| {
            let start = std::time::Instant::now();
            // First on this thread, for at most policy.wait.spin_us (and never
            // past the limit), yielding between polls, as a blocking
            // write does: a batch that completes meanwhile is finished here,
            // with no hand-off between threads.
            let spin = limit.map_or(self.core.spin(), |l| l.min(self.core.spin()));
            loop {
                if let Some(o) = self.try_finish(true) {
                    return Some(o);
                }
                if start.elapsed() >= spin {
                    break;
                }
                std::thread::yield_now();
            }
            // Then asleep until the outcome comes or the limit passes.
            loop {
                if let Some(o) = self.try_finish(false) {
                    return Some(o);
                }
                let left = match limit {
                    Some(l) => match l.checked_sub(start.elapsed()) {
                        Some(left) if !left.is_zero() => Some(left),
                        _ => return None,
                    },
                    None => None,
                };
                let outcome = match &*self.slot.lock() {
                    Slot::Running(t) => Some(t.finished()),
                    _ => None,
                };
                let pause = Duration::from_micros(100);
                match (outcome, left) {
                    // Asleep until the outcome, or the limit (then the
                    // loop returns at once).
                    (Some(f), Some(l)) => {
                        let _ = self.core.block_on(async move { tokio::time::timeout(l, f).await });
                    }
                    (Some(f), None) => {
                        if self.core.block_on(f).is_none() {
                            // The runtime stopped: no outcome will come.
                            std::thread::sleep(pause);
                        }
                    }
                    // Another thread is cancelling it: its outcome comes
                    // shortly.
                    (None, left) => std::thread::sleep(left.map_or(pause, |l| l.min(pause))),
                }
            }
        });
        o.map(|o| outcome_to_py(py, &o)).transpose()
    }

    /// Cancels requests that have not completed and waits until the batch
    /// is quiet; returns the final outcome tuple (completed requests stay
    /// completed). Cancelling a finished batch returns its outcome.
    fn cancel(&self, py: Python<'_>) -> PyResult<PyObject> {
        let taken = {
            let mut slot = self.slot.lock();
            match std::mem::replace(&mut *slot, Slot::Cancelling) {
                Slot::Running(t) => Some(t),
                other => {
                    *slot = other;
                    None
                }
            }
        };
        let o = match taken {
            Some(t) => {
                let r = py.allow_threads(|| self.core.cancel(t));
                let o = py_result(py, r)?;
                *self.slot.lock() = Slot::Done(o.clone());
                o
            }
            // Finished already, or another thread is cancelling it: wait for
            // that thread to record the outcome.
            None => py.allow_threads(|| loop {
                if let Some(o) = self.try_finish(false) {
                    break o;
                }
                std::thread::sleep(Duration::from_micros(100));
            }),
        };
        outcome_to_py(py, &o)
    }

    /// Whether the batch is finished.
    #[getter]
    fn done(&self) -> bool {
        self.try_finish(true).is_some()
    }
}
