//! `TransferEngine`: the calls SGLang and vLLM make on Mooncake's
//! `mooncake.engine.TransferEngine`, with the same names, parameter order,
//! defaults and return conventions (0 = success, negative = failure, batch
//! ids > 0). Errors are never raised for transfer failures; the reason is
//! kept in `last_error()` and logged at debug level on logger `kvmove`.
//! Wrong argument *types* raise `TypeError`, as with pybind11.
//!
//! This file is the one Python class and its one `#[pymethods]` block (pyo3
//! allows one per class): the API as Mooncake's users see it, call by call.
//! What the calls share is below it: [`calls`] (running a transfer and its
//! notification, building operations, opcodes, the policy override) and
//! [`notify`] (`TransferNotify`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use kvmove_policy::{Transfer, TransferOutcome};
use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use transport_core::{Buffer, Error, ErrorKind, Opcode, Result};

use crate::backend::metadata::Directory;
use crate::backend::{self, BackendOptions};
use crate::core::{Core, RawOp};
use crate::devmem::Want;
use crate::errors::invalid;
use crate::outcome::{last_error, log, set_last_error};
use crate::words::Words;

mod calls;
mod notify;

use calls::{ops_from, parse_opcode, run_sync};
use notify::notify_arg;
pub(crate) use notify::TransferNotify;

/// Mooncake's return code for an address that starts no registered region.
const ERR_ADDRESS_NOT_REGISTERED: i64 = -3;
/// Mooncake's return code for memory that overlaps a registered region.
const ERR_ADDRESS_OVERLAPPED: i64 = -7;

/// A drop-in for `mooncake.engine.TransferEngine`.
#[pyclass(module = "kvmove._native", name = "TransferEngine", frozen, subclass)]
pub(crate) struct MooncakeEngine {
    core: Mutex<Option<Arc<Core>>>,
    /// Submitted batches by id; `None`: a batch with nothing to move.
    batches: Mutex<HashMap<u64, Option<Transfer>>>,
    next_batch: AtomicU64,
    managed: Mutex<HashMap<u64, Buffer>>,
}

impl MooncakeEngine {
    fn core(&self) -> Result<Arc<Core>> {
        self.core.lock().clone().ok_or_else(|| {
            Error::new(ErrorKind::InvalidRequest, "TransferEngine is not initialized; call initialize() first")
        })
    }

    /// A registration refused because the memory is not host memory this
    /// process can read (GPU memory) is a deployment mistake a caller may
    /// ignore the return code of (SGLang does): logged at warning level.
    /// Memory that overlaps a registered region is Mooncake's
    /// `ERR_ADDRESS_OVERLAPPED` (-7).
    fn registration_code(py: Python<'_>, what: &str, r: Result<()>) -> i64 {
        if let Err(e) = &r {
            if e.kind() == ErrorKind::Unsupported {
                log(py, "warning", &format!("kvmove TransferEngine.{what} refused: {e}"));
            }
        }
        let overlap = matches!(&r, Err(e) if e.kind() == ErrorKind::AlreadyRegistered);
        match Self::code(py, what, r) {
            -1 if overlap => ERR_ADDRESS_OVERLAPPED,
            rc => rc,
        }
    }

    /// An address that starts no registered region is Mooncake's
    /// `ERR_ADDRESS_NOT_REGISTERED` (-3).
    fn unregistration_code<T>(py: Python<'_>, what: &str, r: Result<T>) -> i64 {
        let unknown = matches!(&r, Err(e) if e.kind() == ErrorKind::Unregistered);
        match Self::code(py, what, r) {
            -1 if unknown => ERR_ADDRESS_NOT_REGISTERED,
            rc => rc,
        }
    }

    /// Turns a result into Mooncake's return code, remembering the error.
    fn code<T>(py: Python<'_>, what: &str, r: Result<T>) -> i64 {
        match r {
            Ok(_) => 0,
            Err(e) => {
                log(py, "debug", &format!("{what} failed: {e}"));
                set_last_error(e);
                -1
            }
        }
    }

    fn sync(
        &self,
        py: Python<'_>,
        what: &str,
        target: &str,
        ops: Result<Vec<RawOp>>,
        notify: Option<TransferNotify>,
    ) -> i64 {
        let r = self.core().and_then(|core| {
            // A request of zero bytes moves nothing: Mooncake returns 0 for
            // it, and for a batch of nothing.
            let ops: Vec<RawOp> = ops?.into_iter().filter(|op| op.len != 0).collect();
            // Checked before anything moves: a notification that cannot be
            // sent fails the call up front.
            let msg = notify.as_ref().map(TransferNotify::encode).transpose()?;
            py.allow_threads(|| run_sync(&core, target, &ops, msg))
        });
        Self::code(py, what, r)
    }

    fn submit_async(&self, py: Python<'_>, target: &str, ops: Result<Vec<RawOp>>) -> Result<u64> {
        let core = self.core()?;
        // Zero-byte requests move nothing (Mooncake completes a batch of
        // nothing), but the peer must be reachable, as in `sync`.
        let ops: Vec<RawOp> = ops?.into_iter().filter(|op| op.len != 0).collect();
        let t = py.allow_threads(|| {
            let seg = core.cached_segment(target)?;
            if ops.is_empty() {
                return Ok(None);
            }
            let reqs = core.requests(seg, &ops)?;
            core.submit(reqs).map(Some).inspect_err(|e| core.forget_segment_after(target, seg, e))
        })?;
        let id = self.next_batch.fetch_add(1, Ordering::Relaxed);
        self.batches.lock().insert(id, t);
        Ok(id)
    }
}

#[pymethods]
impl MooncakeEngine {
    #[new]
    fn new() -> Self {
        Self {
            core: Mutex::new(None),
            batches: Mutex::new(HashMap::new()),
            next_batch: AtomicU64::new(1),
            managed: Mutex::new(HashMap::new()),
        }
    }

    /// Starts the engine. With `metadata_server` `"P2PHANDSHAKE"`,
    /// `local_hostname` is `host` (a free port is picked, see
    /// `get_rpc_port`) or `host:port`, and peers name this engine by its
    /// `host:port`. With a metadata server (`"http://host:port/path"`,
    /// `"etcd://host:port"` or bare `"host:port"`: etcd), `local_hostname`
    /// is this engine's segment name, published there (and removed at
    /// `close`), and peers name it by that string; `redis://` is refused.
    /// `protocol` is `"tcp"` or `"rdma"` (the environment
    /// variable `KVMOVE_PROTOCOL` overrides it, and Mooncake's `MC_FORCE_TCP=1`
    /// forces `"tcp"` when that is unset); `device_name` names the RDMA
    /// device; a comma-separated list makes each a rail (empty = first device).
    /// `KVMOVE_CONFIG` may name a kvmove TOML config (backend options,
    /// policy) these arguments are applied to; `KVMOVE_POLICY` (JSON)
    /// replaces its policy. Returns 0, or -1 (see `last_error()`).
    #[pyo3(signature = (local_hostname, metadata_server, protocol, device_name))]
    fn initialize(
        &self,
        py: Python<'_>,
        local_hostname: &str,
        metadata_server: &str,
        protocol: &str,
        device_name: Option<&str>,
    ) -> i64 {
        let r = (|| {
            if self.core.lock().is_some() {
                return Err(invalid("TransferEngine is already initialized"));
            }
            let (opts, meta) =
                BackendOptions::from_mooncake(local_hostname, metadata_server, protocol, device_name.unwrap_or(""))?;
            let base = backend::base_config_from_env()?;
            let mut cfg = backend::engine_config(Some(&opts), base.as_deref())?;
            if let Some(policy) = backend::policy_from_env()? {
                cfg.policy = policy;
            }
            let core = py.allow_threads(|| {
                let mut core = Core::start(&cfg)?;
                if let Some(server) = meta {
                    // Not published: the engine stops as `core` drops.
                    let dir = Directory::publish(server, local_hostname, core.session_id(), &core.backend())?;
                    core.attach_directory(dir);
                }
                Ok::<_, Error>(core)
            })?;
            *self.core.lock() = Some(Arc::new(core));
            Ok(())
        })();
        if let Err(e) = &r {
            log(py, "warning", &format!("kvmove TransferEngine.initialize failed: {e}"));
        }
        Self::code(py, "initialize", r)
    }

    /// `initialize` with an explicit metadata type, as Mooncake builds its
    /// connection string: a `metadata_server` with a scheme, or
    /// `"P2PHANDSHAKE"`, is used as it is; else `metadata_type` (`"etcd"`,
    /// `"http"`, ...) becomes its scheme (`"p2p"` or empty: peer-to-peer
    /// with the server string as it is).
    #[pyo3(signature = (local_hostname, metadata_server, protocol, device_name, metadata_type))]
    fn initialize_ext(
        &self,
        py: Python<'_>,
        local_hostname: &str,
        metadata_server: &str,
        protocol: &str,
        device_name: Option<&str>,
        metadata_type: &str,
    ) -> i64 {
        let kind = metadata_type.trim();
        let meta = if metadata_server.contains("://")
            || metadata_server.trim().eq_ignore_ascii_case("P2PHANDSHAKE")
            || kind.is_empty()
            || kind.eq_ignore_ascii_case("p2p")
        {
            metadata_server.to_owned()
        } else {
            format!("{kind}://{metadata_server}")
        };
        self.initialize(py, local_hostname, &meta, protocol, device_name)
    }

    /// The port peers reach this engine on; the session id peers pass as
    /// `target_hostname` is `f"{host}:{get_rpc_port()}"`. -1 before
    /// `initialize`.
    fn get_rpc_port(&self, py: Python<'_>) -> i64 {
        match self.core().and_then(|c| c.rpc_port()) {
            Ok(p) => i64::from(p),
            Err(e) => Self::code(py, "get_rpc_port", Err::<(), _>(e)),
        }
    }

    /// The name peers pass as `target_hostname` to reach this engine — an
    /// addition to Mooncake's API: its `host:port`, or in metadata mode its
    /// segment name (`local_hostname`).
    fn get_session_id(&self) -> PyResult<String> {
        self.core()
            .map(|c| c.segment_name().to_owned())
            .map_err(|e| Python::with_gil(|py| crate::errors::to_pyerr(py, &e)))
    }

    /// Registers `capacity` bytes at `buffer_addr` for transfers and for
    /// remote read/write by peers. `location` is accepted and ignored: as
    /// Mooncake does, the memory's kind is found from the pointer. Device
    /// memory of an installed provider (CUDA where a driver and a GPU are
    /// present, `kvmove.FakeDevice` in tests) is moved through it; other
    /// memory must be host memory this process can read, or the call is -1
    /// (`unsupported`) with nothing registered.
    ///
    /// Safety contract: the memory must stay allocated and writable until
    /// `unregister_memory(buffer_addr)` returns (or the engine is closed).
    #[pyo3(signature = (buffer_addr, capacity, location = "*"))]
    fn register_memory(&self, py: Python<'_>, buffer_addr: u64, capacity: u64, location: &str) -> i64 {
        let _ = location;
        // RDMA pins the pages here, which can take a while: GIL released.
        let r = self.core().and_then(|c| {
            py.allow_threads(|| {
                // SAFETY: the caller's contract, stated in this method's
                // docstring (Mooncake's contract too): the range is live
                // memory until it is unregistered.
                unsafe { c.register(buffer_addr, capacity, None, Want::Any) }.map(drop)
            })
        });
        Self::registration_code(py, "register_memory", r)
    }

    /// Unregisters the region registered at exactly `buffer_addr`; returns
    /// once no transfer can touch it.
    fn unregister_memory(&self, py: Python<'_>, buffer_addr: u64) -> i64 {
        let r = self.core().and_then(|c| py.allow_threads(|| c.unregister(buffer_addr)));
        Self::unregistration_code(py, "unregister_memory", r)
    }

    /// Registers several regions, all or none: the whole batch is checked
    /// (zero lengths, overlaps inside the batch and with registered memory,
    /// memory that is neither a provider's device memory nor readable host
    /// memory) before anything
    /// is registered, so a call returning -1 leaves nothing registered.
    #[pyo3(signature = (buffer_addresses, capacities, location = "*"))]
    fn batch_register_memory(
        &self,
        py: Python<'_>,
        buffer_addresses: Vec<u64>,
        capacities: Vec<u64>,
        location: &str,
    ) -> i64 {
        let _ = location;
        let r = self.core().and_then(|c| {
            if buffer_addresses.len() != capacities.len() {
                return Err(invalid("buffer_addresses and capacities have different lengths"));
            }
            let ranges: Vec<(u64, u64)> = buffer_addresses.into_iter().zip(capacities).collect();
            // SAFETY: as in `register_memory`, for every range.
            py.allow_threads(|| unsafe { c.register_all(&ranges, Want::Any) })
        });
        Self::registration_code(py, "batch_register_memory", r)
    }

    /// Unregisters several regions, all or none: every address must be
    /// registered (and listed once) before any is unregistered.
    fn batch_unregister_memory(&self, py: Python<'_>, buffer_addresses: Vec<u64>) -> i64 {
        let r = self.core().and_then(|c| py.allow_threads(|| c.unregister_all(&buffer_addresses)));
        Self::unregistration_code(py, "batch_unregister_memory", r)
    }

    /// Writes `length` bytes from registered local memory at `buffer` to
    /// `peer_buffer_address` in the peer's registered memory. 0 or -1.
    #[pyo3(signature = (target_hostname, buffer, peer_buffer_address, length, transport_hint = "", notify = None))]
    #[allow(clippy::too_many_arguments)]
    fn transfer_sync_write(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffer: u64,
        peer_buffer_address: u64,
        length: u64,
        transport_hint: &str,
        notify: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<i64> {
        let _ = transport_hint;
        let notify = notify_arg(notify)?;
        let op = RawOp { op: Opcode::Write, local_addr: buffer, remote_addr: peer_buffer_address, len: length };
        Ok(self.sync(py, "transfer_sync_write", target_hostname, Ok(vec![op]), notify))
    }

    /// Reads `length` bytes from the peer's `peer_buffer_address` into
    /// registered local memory at `buffer`. 0 or -1.
    #[pyo3(signature = (target_hostname, buffer, peer_buffer_address, length, transport_hint = "", notify = None))]
    #[allow(clippy::too_many_arguments)]
    fn transfer_sync_read(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffer: u64,
        peer_buffer_address: u64,
        length: u64,
        transport_hint: &str,
        notify: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<i64> {
        let _ = transport_hint;
        let notify = notify_arg(notify)?;
        let op = RawOp { op: Opcode::Read, local_addr: buffer, remote_addr: peer_buffer_address, len: length };
        Ok(self.sync(py, "transfer_sync_read", target_hostname, Ok(vec![op]), notify))
    }

    /// `transfer_sync_read` / `_write` chosen by `opcode`. With `notify` (a
    /// `TransferNotify`), the target receives it in `get_notifies()` once
    /// every byte of the transfer landed; nothing is sent if the transfer
    /// fails. 0 or -1 (also when the notification could not be delivered).
    #[pyo3(signature = (target_hostname, buffer, peer_buffer_address, length, opcode, notify = None, transport_hint = ""))]
    #[allow(clippy::too_many_arguments)]
    fn transfer_sync(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffer: u64,
        peer_buffer_address: u64,
        length: u64,
        opcode: i64,
        notify: Option<&Bound<'_, PyAny>>,
        transport_hint: &str,
    ) -> PyResult<i64> {
        let _ = transport_hint;
        let notify = notify_arg(notify)?;
        let ops = parse_opcode(opcode)
            .map(|op| vec![RawOp { op, local_addr: buffer, remote_addr: peer_buffer_address, len: length }]);
        Ok(self.sync(py, "transfer_sync", target_hostname, ops, notify))
    }

    /// Writes `lengths[i]` bytes from `buffers[i]` to
    /// `peer_buffer_addresses[i]`, all in one batch. 0 when every request
    /// completed, else -1.
    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint = "", notify = None))]
    #[allow(clippy::too_many_arguments)]
    fn batch_transfer_sync_write(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffers: Words,
        peer_buffer_addresses: Words,
        lengths: Words,
        transport_hint: &str,
        notify: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<i64> {
        let _ = transport_hint;
        let notify = notify_arg(notify)?;
        let ops = ops_from(Opcode::Write, &buffers, &peer_buffer_addresses, &lengths);
        Ok(self.sync(py, "batch_transfer_sync_write", target_hostname, ops, notify))
    }

    /// Reads a batch from the peer into local memory. 0 or -1.
    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint = "", notify = None))]
    #[allow(clippy::too_many_arguments)]
    fn batch_transfer_sync_read(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffers: Words,
        peer_buffer_addresses: Words,
        lengths: Words,
        transport_hint: &str,
        notify: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<i64> {
        let _ = transport_hint;
        let notify = notify_arg(notify)?;
        let ops = ops_from(Opcode::Read, &buffers, &peer_buffer_addresses, &lengths);
        Ok(self.sync(py, "batch_transfer_sync_read", target_hostname, ops, notify))
    }

    /// A batch whose direction is chosen by `opcode`; `notify` as in
    /// `transfer_sync` (sent once every request of the batch completed).
    /// 0 or -1.
    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths, opcode, notify = None, transport_hint = ""))]
    #[allow(clippy::too_many_arguments)]
    fn batch_transfer_sync(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffers: Words,
        peer_buffer_addresses: Words,
        lengths: Words,
        opcode: i64,
        notify: Option<&Bound<'_, PyAny>>,
        transport_hint: &str,
    ) -> PyResult<i64> {
        let _ = transport_hint;
        let notify = notify_arg(notify)?;
        let ops = parse_opcode(opcode).and_then(|op| ops_from(op, &buffers, &peer_buffer_addresses, &lengths));
        Ok(self.sync(py, "batch_transfer_sync", target_hostname, ops, notify))
    }

    /// Starts a batch of writes and returns its id (> 0), or 0 on failure
    /// (as Mooncake). Finish it with `get_batch_transfer_status([id])`.
    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint = ""))]
    fn batch_transfer_async_write(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffers: Words,
        peer_buffer_addresses: Words,
        lengths: Words,
        transport_hint: &str,
    ) -> u64 {
        let _ = transport_hint;
        let ops = ops_from(Opcode::Write, &buffers, &peer_buffer_addresses, &lengths);
        self.async_id(py, "batch_transfer_async_write", target_hostname, ops)
    }

    /// Starts a batch of reads; returns its id (> 0) or 0 on failure.
    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint = ""))]
    fn batch_transfer_async_read(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffers: Words,
        peer_buffer_addresses: Words,
        lengths: Words,
        transport_hint: &str,
    ) -> u64 {
        let _ = transport_hint;
        let ops = ops_from(Opcode::Read, &buffers, &peer_buffer_addresses, &lengths);
        self.async_id(py, "batch_transfer_async_read", target_hostname, ops)
    }

    /// Starts a batch whose direction is chosen by `opcode`; id or 0.
    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths, opcode, transport_hint = ""))]
    #[allow(clippy::too_many_arguments)]
    fn batch_transfer_async(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffers: Words,
        peer_buffer_addresses: Words,
        lengths: Words,
        opcode: i64,
        transport_hint: &str,
    ) -> u64 {
        let _ = transport_hint;
        let ops = parse_opcode(opcode).and_then(|op| ops_from(op, &buffers, &peer_buffer_addresses, &lengths));
        self.async_id(py, "batch_transfer_async", target_hostname, ops)
    }

    /// Waits until every listed batch is terminal and forgets them. 0 when
    /// all completed; -1 if any failed, timed out or is unknown. After the
    /// first failure the remaining batches are cancelled (and waited for
    /// until quiet), so the caller may reuse all their buffers on return.
    fn get_batch_transfer_status(&self, py: Python<'_>, batch_ids: Vec<u64>) -> i64 {
        let r = self.core().and_then(|core| {
            let mut transfers = Vec::with_capacity(batch_ids.len());
            let mut unknown = None;
            {
                let mut map = self.batches.lock();
                for id in &batch_ids {
                    match map.remove(id) {
                        Some(t) => transfers.extend(t),
                        None => unknown = Some(*id),
                    }
                }
            }
            let waited = py.allow_threads(|| {
                let mut first_err: Option<Error> = None;
                for t in transfers {
                    let r = if first_err.is_none() { core.wait(t) } else { core.cancel(t) };
                    if let Err(e) = r.and_then(TransferOutcome::into_result) {
                        first_err.get_or_insert(e);
                    }
                }
                first_err.map_or(Ok(()), Err)
            });
            match unknown {
                Some(id) => {
                    Err(Error::new(ErrorKind::InvalidHandle, "unknown or already finished batch id").with("batch", id))
                }
                None => waited,
            }
        });
        Self::code(py, "get_batch_transfer_status", r)
    }

    /// Starts one write; returns a batch id (> 0), or 0 (Mooncake's invalid
    /// batch id) when it could not be submitted (see `last_error()`).
    #[pyo3(signature = (target_hostname, buffer, peer_buffer_address, length, transport_hint = ""))]
    fn transfer_submit_write(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffer: u64,
        peer_buffer_address: u64,
        length: u64,
        transport_hint: &str,
    ) -> u64 {
        let _ = transport_hint;
        let op = RawOp { op: Opcode::Write, local_addr: buffer, remote_addr: peer_buffer_address, len: length };
        self.async_id(py, "transfer_submit_write", target_hostname, Ok(vec![op]))
    }

    /// Never blocks: 1 completed, 0 in progress, -1 failed (or unknown id),
    /// -2 timed out. A terminal batch is forgotten once reported.
    fn transfer_check_status(&self, py: Python<'_>, batch_id: u64) -> i64 {
        let mut map = self.batches.lock();
        let Some(t) = map.get(&batch_id) else {
            drop(map);
            return Self::code(
                py,
                "transfer_check_status",
                Err::<(), _>(Error::new(ErrorKind::InvalidHandle, "unknown batch id").with("batch", batch_id)),
            );
        };
        let Some(t) = t else {
            map.remove(&batch_id);
            return 1;
        };
        let Some(o) = t.poll() else { return 0 };
        map.remove(&batch_id);
        drop(map);
        match o.into_result() {
            Ok(_) => 1,
            Err(e) if e.kind() == ErrorKind::Timeout => {
                set_last_error(e);
                -2
            }
            Err(e) => Self::code(py, "transfer_check_status", Err::<(), _>(e)),
        }
    }

    /// 0 when the peer (`host:port`, or a segment name in metadata mode)
    /// answers a round trip (its segment is
    /// opened and one byte of its memory read), else -1: a peer that is
    /// gone, or stopped and silent for the probe's timeout (2 s). Asks the
    /// peer every time, also while its circuit breaker is open; a success
    /// closes the breaker.
    fn send_probe(&self, py: Python<'_>, peer_server_name: &str) -> i64 {
        let r = self.core().and_then(|c| py.allow_threads(|| c.probe(peer_server_name)));
        Self::code(py, "send_probe", r)
    }

    /// The first registered address the peer exposes, or 0.
    fn get_first_buffer_address(&self, py: Python<'_>, segment_name: &str) -> u64 {
        let r = self.core().and_then(|c| py.allow_threads(|| c.first_remote_region(segment_name)));
        match r {
            Ok(a) => a,
            Err(e) => {
                Self::code(py, "get_first_buffer_address", Err::<(), _>(e));
                0
            }
        }
    }

    /// Allocates `length` zeroed, page-aligned bytes owned by the engine and
    /// registers them. Returns the address, or 0 on failure.
    fn allocate_managed_buffer(&self, py: Python<'_>, length: u64) -> u64 {
        let r = self.core().and_then(|c| {
            let n = usize::try_from(length).map_err(|_| invalid("length too large"))?;
            let buf = Buffer::new(n)?;
            // SAFETY: `buf` is kept in `self.managed` until
            // `free_managed_buffer` has unregistered it, or until the engine
            // is closed (the transport is shut down before the map drops).
            unsafe { c.register(buf.addr(), length, None, Want::Host) }?;
            let addr = buf.addr();
            self.managed.lock().insert(addr, buf);
            Ok(addr)
        });
        match r {
            Ok(a) => a,
            Err(e) => {
                Self::code(py, "allocate_managed_buffer", Err::<(), _>(e));
                0
            }
        }
    }

    /// Unregisters and frees a buffer from `allocate_managed_buffer`.
    fn free_managed_buffer(&self, py: Python<'_>, buffer_addr: u64, length: u64) -> i64 {
        let _ = length;
        let r = self.core().and_then(|c| {
            if !self.managed.lock().contains_key(&buffer_addr) {
                return Err(Error::new(ErrorKind::InvalidHandle, "not a managed buffer of this engine"));
            }
            py.allow_threads(|| c.unregister(buffer_addr))?;
            self.managed.lock().remove(&buffer_addr);
            Ok(())
        });
        Self::code(py, "free_managed_buffer", r)
    }

    /// Copies `length` bytes of `src_ptr` into registered memory at
    /// `dest_address`. Unlike Mooncake, the range must lie inside registered
    /// memory; anything else returns -1 instead of writing.
    fn write_bytes_to_buffer(&self, py: Python<'_>, dest_address: u64, src_ptr: &[u8], length: u64) -> i64 {
        let r = self.core().and_then(|c| {
            let n = usize::try_from(length).map_err(|_| invalid("length too large"))?;
            let src = src_ptr.get(..n).ok_or_else(|| invalid("length exceeds the bytes given"))?;
            c.write_local(dest_address, src)
        });
        Self::code(py, "write_bytes_to_buffer", r)
    }

    /// Reads `length` bytes of registered memory at `source_address`.
    /// Raises `kvmove.PermanentError` outside registered memory.
    fn read_bytes_from_buffer<'py>(
        &self,
        py: Python<'py>,
        source_address: u64,
        length: u64,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let r = self.core().and_then(|c| c.read_local(source_address, length));
        match r {
            Ok(v) => Ok(PyBytes::new(py, &v)),
            Err(e) => Err(crate::errors::to_pyerr(py, &e)),
        }
    }

    /// The notifications received since the last call, oldest first, as
    /// `TransferNotify(name, msg)` objects (each is returned once). Empty
    /// before `initialize` and after `close`. Every notification sent with a
    /// transfer arrives after that transfer's bytes are in this engine's
    /// memory.
    fn get_notifies(&self, py: Python<'_>) -> Vec<TransferNotify> {
        let r = self.core().and_then(|c| c.take_notifications());
        match r {
            Ok(v) => v.into_iter().filter_map(TransferNotify::decode).collect(),
            Err(e) => {
                log(py, "debug", &format!("get_notifies failed: {e}"));
                Vec::new()
            }
        }
    }

    /// The error of the last call on this thread that returned a failure
    /// code, as a `kvmove.TransferError` instance (not raised), or None.
    fn last_error(&self, py: Python<'_>) -> Option<PyObject> {
        last_error(py)
    }

    /// Live resource counts (endpoints, segments, regions, batches, ...).
    fn stats(&self) -> Vec<(&'static str, u64)> {
        self.core().map(|c| c.stats()).unwrap_or_default()
    }

    /// Cancels all transfers, closes every segment, unregisters all memory
    /// and stops the backend. Called on garbage collection too; a closed
    /// engine answers -1 to everything.
    fn close(&self, py: Python<'_>) {
        let core = self.core.lock().clone();
        if let Some(core) = core {
            let batches: Vec<Transfer> = self.batches.lock().drain().filter_map(|(_, t)| t).collect();
            let keep = py.allow_threads(|| {
                for t in batches {
                    let _ = core.cancel(t);
                }
                core.close()
            });
            drop(keep);
            self.managed.lock().clear();
        }
    }
}

impl Drop for MooncakeEngine {
    fn drop(&mut self) {
        // Batches first (dropping a Transfer cancels it), then the backend,
        // then the managed buffers it may have been writing.
        self.batches.get_mut().clear();
        if let Some(core) = self.core.get_mut().take() {
            drop(core.close());
        }
        self.managed.get_mut().clear();
    }
}

impl MooncakeEngine {
    fn async_id(&self, py: Python<'_>, what: &str, target: &str, ops: Result<Vec<RawOp>>) -> u64 {
        match self.submit_async(py, target, ops) {
            Ok(id) => id,
            Err(e) => {
                Self::code(py, what, Err::<(), _>(e));
                0
            }
        }
    }
}
