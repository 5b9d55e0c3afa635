"""A child process driven one JSON command per line (stdin / stdout), as
``bench/peers.py`` and ``difftest/compat_diff.py`` run their two sides."""

import json
import os
import signal
import subprocess
import sys


class LineProc:
    """``sys.executable`` running ``argv``; its first JSON line is
    ``ready``. Lines not starting with ``{`` are skipped (NIXL prints to
    stdout too)."""

    def __init__(self, argv, env=None, stderr=subprocess.DEVNULL):
        self.p = subprocess.Popen([sys.executable, *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=stderr, text=True, env=env)  # fmt: skip
        self.ready = self.read()["ready"]

    def read(self):
        while True:
            line = self.p.stdout.readline()
            if not line:
                raise RuntimeError(f"process exited with {self.p.wait()}")
            if line.startswith("{"):
                return json.loads(line)

    def ask(self, **cmd):
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()
        return self.read()

    def kill(self):
        self.p.send_signal(signal.SIGKILL)
        self.p.wait()

    def stop(self):
        """Asks it to quit; SIGKILL if it has not in 10 s."""
        try:
            self.ask(cmd="quit")
        except (RuntimeError, OSError):
            pass
        try:
            self.p.wait(10)
        except subprocess.TimeoutExpired:
            self.kill()


def context_switches(pid):
    """Context switches so far of every thread of process ``pid``
    (voluntary and not, from ``/proc/PID/task/*/status``)."""
    n = 0
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{t}/status") as f:
                for line in f:
                    if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                        n += int(line.split()[1])
        except OSError:
            pass  # the thread ended
    return n
