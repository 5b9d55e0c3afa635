import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).parent


class Peer:
    """A decode-like peer in its own Python process: ``script`` (default
    kvpeer.py; also notifypeer.py, sessionpeer.py, nixlpeer.py) started as ``script HOST
    NBYTES PROTOCOL DEVICE``, which prints one JSON line with its
    ``session_id``, ``addr`` and ``len`` and then answers commands."""

    def __init__(self, host: str, nbytes: int, protocol: str = "tcp", device: str = "", script: str = "kvpeer.py"):
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / script), host, str(nbytes), protocol, device],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"peer exited with {self.proc.wait()}")
        info = json.loads(line)
        if "error" in info:
            raise RuntimeError(f"peer failed to start: {info['error']}")
        self.info = info  # everything the script printed (nixlpeer.py adds its metadata)
        self.session_id = info["session_id"]
        self.addr = info["addr"]
        self.len = info["len"]

    @property
    def port(self) -> int:
        return int(self.session_id.rsplit(":", 1)[1])

    def ask(self, cmd: str) -> str:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self.read_line()

    def read_line(self) -> str:
        """The peer's next output line (bounded by the test's timeout)."""
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"peer exited with {self.proc.wait()}")
        return line.strip()

    def pause(self) -> None:
        """Stops the peer process (SIGSTOP): it neither runs nor reads.
        Returns once every thread of it is stopped: the signal takes effect
        only as each thread is next scheduled, and a thread already running
        could still answer a request sent right after the kill (seen: a
        READ "from a frozen peer" completed)."""
        self.proc.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while not self._all_stopped():
            if time.monotonic() > deadline:
                raise RuntimeError(f"peer {self.proc.pid} did not stop within 10 s of SIGSTOP")
            time.sleep(0.001)

    def _all_stopped(self) -> bool:
        tasks = Path(f"/proc/{self.proc.pid}/task")
        for t in tasks.iterdir():
            try:
                state = next(l for l in (t / "status").read_text().splitlines() if l.startswith("State:"))
            except (OSError, StopIteration):
                continue  # a thread that just ended
            if "(stopped)" not in state and "(tracing stop)" not in state:
                return False
        return True

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=10)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.kill()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


@pytest.fixture
def spawn_peer():
    peers = []

    def spawn(
        host: str = "127.0.0.1", nbytes: int = 1 << 20, protocol: str = "tcp", device: str = "", script: str = "kvpeer.py"
    ) -> Peer:
        p = Peer(host, nbytes, protocol, device, script)
        peers.append(p)
        return p

    yield spawn
    for p in peers:
        p.stop()


@pytest.fixture
def mooncake():
    """A Mooncake-API engine over TCP on loopback, closed after the test."""
    from kvmove.mooncake import TransferEngine

    e = TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0, e.last_error()
    yield e
    e.close()


def finish_with_decode_stopped(prefill, decode, sid: int, src, nbytes: int, stopped_s: float, gives_up: bool = False):
    """A session from ``prefill`` to a ``sessionpeer.py`` ``decode``:
    granted ``nbytes`` at the decode's buffer start, written from ``src``
    (a registered region), then finished while the decode process is
    stopped (SIGSTOP) for ``stopped_s`` seconds. ``gives_up``: the prefill
    side must end the session unsure (``outcome_unknown``) while the
    decode is still stopped. Returns the prefill side's session."""
    s = prefill.send(decode.session_id, sid)
    assert decode.ask(f"grant {prefill.session_id} {sid} 0 {nbytes} 60") == "ok"
    assert s.wait_grant(timeout=30) is not None
    assert s.write([(src.addr, decode.addr, nbytes)]).ok
    decode.pause()
    try:
        s.finish()
        t0 = time.monotonic()
        if gives_up:
            assert s.wait(timeout=30) == "failed"
            assert time.monotonic() - t0 < 20
            assert not s.error.is_transient and s.error.kind == "outcome_unknown", s.error
        time.sleep(max(0.0, stopped_s - (time.monotonic() - t0)))
    finally:
        decode.resume()
    return s


def wait_until(fn, timeout: float = 20.0, pause: float = 0.05):
    """Calls fn() until it returns a truthy value; returns it (or the last)."""
    deadline = time.monotonic() + timeout
    while True:
        v = fn()
        if v or time.monotonic() > deadline:
            return v
        time.sleep(pause)


@pytest.fixture(autouse=True)
def _no_protocol_override(monkeypatch):
    monkeypatch.delenv("KVMOVE_PROTOCOL", raising=False)
    monkeypatch.delenv("KVMOVE_POLICY", raising=False)
    monkeypatch.delenv("KVMOVE_CONFIG", raising=False)
    yield
