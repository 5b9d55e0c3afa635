"""NIXL's peer-to-peer metadata exchange, between kvmove agents: the
listener an agent made with ``enable_listen_thread=True`` runs, and the
calls that reach one (``send_local_metadata``, ``fetch_remote_metadata``,
``invalidate_local_metadata``, ``send_partial_agent_metadata``).

The wire is kvmove's own, not NIXL's (the agents on both ends are
kvmove's): over TCP, frames of

    b"KVMX" | kind (1 byte) | payload length (u32, big-endian) | payload

``LOAD`` carries agent metadata to load, ``SEND`` asks for the listener's
metadata (answered with a ``LOAD``), ``INVL`` names an agent to forget; the
listener answers ``LOAD`` and ``INVL`` with ``OK`` or ``ERR`` (a message),
so one agent's calls take effect at the peer in the order made. A frame's
length is checked against ``MAX_FRAME`` before its body is read, and the
body is buffered as it arrives; a connection that sends anything else (a
bad magic or kind, an oversized length), or stays silent past
``IDLE_TIMEOUT``, is closed, and the listener goes on. What is loaded has
parsed as agent metadata (``nixl_agent.add_remote_agent``'s checks).

Who may use a listener is what kvmove's engines answer
(``docs/THREAT_MODEL.md``; ``kvmove._native.control_access``): with a
shared secret (``KVMOVE_SECRET``, ``KVMOVE_SECRET_FILE``) every request
and every answer carries an HMAC-SHA256 proof of it, bound to a nonce the
listener sends first (``NONC``) and to the request's place on the
connection, so nothing is loaded, forgotten or given to a peer without
the secret, a request cannot be replayed, and a caller loads no answer
from an impostor; without one (protected mode) only this host's
connections are served, unless ``KVMOVE_INSECURE=1``. A request is its
frame followed by a ``PROOF`` frame (empty without a secret), and so is
each answer."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import selectors
import socket
import struct
import threading
import time
import weakref
from typing import Callable, Dict, Optional, Tuple

from ._base import logger

MAGIC = b"KVMX"
LOAD, SEND, INVL, OK, ERR = b"L", b"S", b"I", b"K", b"E"
NONC, PROOF = b"N", b"P"
_REQUESTS = frozenset((LOAD, SEND, INVL))
_KINDS = frozenset((LOAD, SEND, INVL, OK, ERR, NONC, PROOF))
#: Bytes of the listener's nonce.
NONCE_LEN = 32
#: What a proof is an HMAC of names this protocol and the side.
_DOMAIN = b"kvmove-nixl-metadata/1"
#: What a peer refused by protected mode is told.
PROTECTED = (
    "protected mode: no shared secret is set, so this NIXL metadata listener serves only its own host; "
    "set the same KVMOVE_SECRET on both ends, or KVMOVE_INSECURE=1 on this one"
)
_HEADER = struct.Struct(">4scI")
#: The largest payload accepted (agent metadata is ~30 bytes a region).
MAX_FRAME = 16 << 20
#: How long a connection may stay silent, or take to send a frame.
IDLE_TIMEOUT = 10.0
#: The most connections a listener serves at once; more are closed.
MAX_CONNECTIONS = 64
#: A caller's connect and each read or write of its exchange.
CONNECT_TIMEOUT = 2.0
IO_TIMEOUT = 5.0
# How often the listener looks whether it should stop.
_TICK = 0.1


def frame(kind: bytes, payload: bytes) -> bytes:
    if len(payload) > MAX_FRAME:
        raise ValueError(f"a metadata frame of {len(payload)} bytes is over the {MAX_FRAME}-byte limit")
    return _HEADER.pack(MAGIC, kind, len(payload)) + payload


def _check_header(head: bytes) -> Tuple[bytes, int]:
    """The kind and length of a frame header; ValueError if it is not one."""
    magic, kind, n = _HEADER.unpack(head)
    if magic != MAGIC:
        raise ValueError("not a kvmove metadata frame")
    if kind not in _KINDS:
        raise ValueError(f"unknown frame kind {kind!r}")
    if n > MAX_FRAME:
        raise ValueError(f"a frame of {n} bytes is over the {MAX_FRAME}-byte limit")
    return kind, n


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    """``n`` bytes from a socket with a timeout set, read as they arrive."""
    buf = bytearray()
    while len(buf) < n:
        got = sock.recv(min(n - len(buf), 1 << 16))
        if not got:
            raise ConnectionError("the peer closed the connection mid-frame")
        buf += got
    return bytes(buf)


def recv_frame(sock: socket.socket) -> Tuple[bytes, bytes]:
    kind, n = _check_header(_recv_exact(sock, _HEADER.size))
    return kind, _recv_exact(sock, n)


def listen_host(env_value: Optional[str]) -> str:
    """The host part of ``KVMOVE_NIXL_HOST`` (``host``, ``host:port``,
    ``[v6]:port`` or a bare IPv6 address); ``127.0.0.1`` when unset."""
    v = (env_value or "").strip()
    if not v:
        return "127.0.0.1"
    if v.startswith("["):
        return v[1 : v.index("]")] if "]" in v else v[1:]
    if v.count(":") == 1:
        return v.split(":", 1)[0]
    return v


def peer_address(ip_addr: str) -> Optional[str]:
    """``ip_addr`` if it is an IP address literal (NIXL takes no names),
    else None."""
    try:
        return str(ipaddress.ip_address(ip_addr))
    except ValueError:
        return None


def proof(secret: Optional[bytes], side: bytes, nonce: bytes, seq: int, kind: bytes, payload: bytes) -> bytes:
    """The proof of the secret for one frame: an HMAC over the side
    (``b"request"``, ``b"answer"``), the connection's nonce, the frame's
    place on it, its kind and its payload; empty without a secret."""
    if secret is None:
        return b""
    m = hmac.new(secret, _DOMAIN + b" " + side, hashlib.sha256)
    m.update(nonce)
    m.update(seq.to_bytes(8, "big"))
    m.update(kind)
    m.update(len(payload).to_bytes(4, "big"))
    m.update(payload)
    return m.digest()


def exchange(ip: str, port: int, kind: bytes, payload: bytes, secret: Optional[bytes]) -> Tuple[bytes, bytes]:
    """One request to the listener at ``ip:port`` and its answer, proven
    with ``secret`` both ways (an answer whose proof fails is a
    ``ValueError``: nothing of it is used)."""
    with socket.create_connection((ip, port), timeout=CONNECT_TIMEOUT) as s:
        s.settimeout(IO_TIMEOUT)
        got, nonce = recv_frame(s)
        if got == ERR:
            return got, nonce  # refused at once (protected mode)
        if got != NONC or len(nonce) != NONCE_LEN:
            raise ValueError("the listener did not open with its nonce")
        s.sendall(frame(kind, payload) + frame(PROOF, proof(secret, b"request", nonce, 0, kind, payload)))
        got, answer = recv_frame(s)
        if got == ERR:
            # A refusal is only reported (a refusal of the proof comes
            # unproven: the listener may have another secret).
            return got, answer
        p_kind, p = recv_frame(s)
        if p_kind != PROOF or not hmac.compare_digest(p, proof(secret, b"answer", nonce, 0, got, answer)):
            raise ValueError("the listener's answer does not prove the shared secret (an impostor, or another secret)")
        return got, answer


def access() -> Tuple[Optional[bytes], bool]:
    """The secret (bytes) and whether protected mode is off, read as the
    engines read them."""
    from .._native import control_access

    secret, insecure = control_access()
    return (secret.encode() if secret is not None else None), insecure


def same_host(peer: str, local: str) -> bool:
    """Whether a connection from ``peer`` to ``local`` comes from this host
    (a loopback address, or the address it reached)."""
    try:
        p, loc = ipaddress.ip_address(peer), ipaddress.ip_address(local)
    except ValueError:
        return False
    p = getattr(p, "ipv4_mapped", None) or p
    loc = getattr(loc, "ipv4_mapped", None) or loc
    return p.is_loopback or p == loc


class _Conn:
    __slots__ = ("sock", "buf", "since", "nonce", "seq", "request")

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buf = bytearray()
        self.since = time.monotonic()
        self.nonce = os.urandom(NONCE_LEN)
        #: Requests answered on this connection (each proof's place).
        self.seq = 0
        #: A request read, waiting for its proof.
        self.request: Optional[Tuple[bytes, bytes]] = None


class Listener:
    """A listening socket and the thread that serves it for one agent.

    ``handle(kind, payload)`` (called on the listener's thread) answers a
    frame with a frame ``(kind, payload)``, or None to close the
    connection; it reaches the agent through a weak reference, so an agent
    no longer used is collected (and its ``__del__`` stops this)."""

    def __init__(
        self,
        host: str,
        port: int,
        handle: Callable[[bytes, bytes], Optional[Tuple[bytes, bytes]]],
        name: str,
        secret: Optional[bytes] = None,
        insecure: bool = False,
    ):
        self._secret = secret
        self._local_only = secret is None and not insecure
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(64)
            sock.setblocking(False)
        except OSError as e:
            sock.close()
            # NIXL's agent raises this (a RuntimeError) when its listener
            # cannot bind.
            raise RuntimeError(f"Failed to bind metadata listener socket on {host}:{port}: {e}") from None
        self._sock = sock
        self.address: Tuple[str, int] = (host, sock.getsockname()[1])
        self._handle = handle
        self._stop = threading.Event()
        self._conns: Dict[int, _Conn] = {}
        self._thread = threading.Thread(target=self._run, name=f"kvmove-nixl-listen-{name}"[:60], daemon=True)
        self._thread.start()

    # ---- the thread ----

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._sock, selectors.EVENT_READ)
        try:
            while not self._stop.is_set():
                for key, _ in sel.select(_TICK):
                    if key.fileobj is self._sock:
                        self._accept(sel)
                    else:
                        self._read(sel, key.fileobj)
                now = time.monotonic()
                for c in [c for c in self._conns.values() if now - c.since > IDLE_TIMEOUT]:
                    logger.info("metadata listener %s: closing a connection silent for %.0f s", self.address, IDLE_TIMEOUT)
                    self._drop(sel, c.sock)
        except Exception:  # never expected: log it rather than die silently
            logger.exception("metadata listener %s stopped", self.address)
        finally:
            for c in list(self._conns.values()):
                self._drop(sel, c.sock)
            sel.close()
            self._sock.close()

    def _accept(self, sel) -> None:
        try:
            s, _ = self._sock.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            logger.warning("metadata listener %s: accept failed: %s", self.address, e)
            return
        if len(self._conns) >= MAX_CONNECTIONS:
            logger.warning("metadata listener %s: %d connections already, closing a new one", self.address, MAX_CONNECTIONS)
            s.close()
            return
        c = _Conn(s)
        if self._local_only:
            try:
                peer, local = s.getpeername()[0], s.getsockname()[0]
            except OSError:
                peer, local = "", ""
            if not same_host(peer, local):
                logger.warning("metadata listener %s: refused %s: %s", self.address, peer, PROTECTED)
                self._send(s, frame(ERR, PROTECTED.encode()))
                s.close()
                return
        if not self._send(s, frame(NONC, c.nonce)):
            s.close()
            return
        s.setblocking(False)
        self._conns[s.fileno()] = c
        sel.register(s, selectors.EVENT_READ)

    def _drop(self, sel, s: socket.socket) -> None:
        self._conns.pop(s.fileno(), None)
        try:
            sel.unregister(s)
        except (KeyError, ValueError):
            pass
        s.close()

    def _read(self, sel, s: socket.socket) -> None:
        c = self._conns.get(s.fileno())
        if c is None:
            return
        try:
            got = s.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            got = b""
        if not got:
            self._drop(sel, s)
            return
        c.buf += got
        while len(c.buf) >= _HEADER.size:
            try:
                kind, n = _check_header(bytes(c.buf[: _HEADER.size]))
            except ValueError as e:
                logger.warning("metadata listener %s: closing a connection that sent garbage: %s", self.address, e)
                self._drop(sel, s)
                return
            if len(c.buf) < _HEADER.size + n:
                return  # the rest of the frame is still to come
            payload = bytes(c.buf[_HEADER.size : _HEADER.size + n])
            del c.buf[: _HEADER.size + n]
            c.since = time.monotonic()
            if c.request is None:
                if kind not in _REQUESTS:
                    logger.warning("metadata listener %s: closing a connection that sent %r, not a request", self.address, kind)
                    self._drop(sel, s)
                    return
                c.request = (kind, payload)
                continue
            request, c.request = c.request, None
            if kind != PROOF:
                logger.warning("metadata listener %s: closing a connection whose request came without its proof", self.address)
                self._drop(sel, s)
                return
            if self._secret is not None and not hmac.compare_digest(
                payload, proof(self._secret, b"request", c.nonce, c.seq, *request)
            ):
                logger.warning("metadata listener %s: refused a request that does not prove the shared secret", self.address)
                self._send(s, frame(ERR, b"authentication failed: the proof of the shared secret is wrong or missing"))
                self._drop(sel, s)
                return
            answer = self._answer(*request)
            if answer is None:
                self._drop(sel, s)
                return
            sealed = frame(*answer) + frame(PROOF, proof(self._secret, b"answer", c.nonce, c.seq, *answer))
            c.seq += 1
            if not self._send(s, sealed):
                self._drop(sel, s)
                return

    def _answer(self, kind: bytes, payload: bytes):
        try:
            return self._handle(kind, payload)
        except Exception as e:  # the agent's refusal goes back to the caller
            logger.warning("metadata listener %s: refused a %s frame: %s", self.address, kind.decode(), e)
            return ERR, str(e).encode("utf-8", "replace")[:4096]

    def _send(self, s: socket.socket, data: bytes) -> bool:
        try:
            s.setblocking(True)
            s.settimeout(IO_TIMEOUT)
            s.sendall(data)
            s.setblocking(False)
            return True
        except OSError as e:
            logger.warning("metadata listener %s: answering failed: %s", self.address, e)
            return False

    # ---- its owner ----

    def close(self) -> None:
        """Stops the thread (within ``_TICK`` plus one frame's handling)
        and closes every socket."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(5.0)


def agent_handler(agent) -> Callable[[bytes, bytes], Optional[Tuple[bytes, bytes]]]:
    """The listener's ``handle`` for ``agent``, through a weak reference."""
    ref = weakref.ref(agent)

    def handle(kind: bytes, payload: bytes):
        a = ref()
        if a is None:
            return None
        if kind == LOAD:
            name = a._load_md(payload)
            logger.info("agent %r loaded metadata of agent %r sent to its listener", a.name, name)
            return OK, b""
        if kind == SEND:
            return LOAD, a.get_agent_metadata()
        if kind == INVL:
            name = payload.decode("utf-8", "replace")
            a._invalidated(name)
            return OK, b""
        return None  # OK / ERR are answers, not requests

    return handle
