"""Role processes for multi-process tests: start with a READY handshake, stop or kill by pid.

    p = RoleProc("relay", "r1", config_path, log_dir).start()
    p.wait_ready(timeout=30)     # the role wrote READY on its --ready-fd pipe (setup finished)
    p.kill()                     # SIGKILL this one process (chaos tests)
    p.stop()                     # SIGTERM, wait, SIGKILL if it overstays

Each process's stdout+stderr go to `<log_dir>/<role>.<id>.log` (JSON log lines), which tests read
to find events such as `chain_repaired`. Only processes started here are ever signalled.

Like the supervisor, kill() and stop() leave nothing of the role behind: what is left in its
process group (a rollout's vLLM engine) is killed, and the /dev/shm objects only that group held
(vLLM's `psm_*` queues; noted at READY and just before each signal) are removed (laminar/shm.py).
"""
from __future__ import annotations

import json
import os
import random
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from laminar.shm import ShmLedger, group_members
from laminar.supervisor import die_with_parent, sweep_group

_handed_out: set[int] = set()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is bindable now, below the kernel's ephemeral range (no outgoing
    connection can take it between choosing and binding), and never handed out twice by this process."""
    rng = random.Random()
    hi = min(_ephemeral_low(), 65536) - 1
    for _ in range(1000):
        port = rng.randint(min(20000, hi - 1000), hi)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError("no free port found below the ephemeral range")


def wait_ready(proc: subprocess.Popen, fd: int, timeout: float, what: str, detail=lambda: "") -> None:
    """Wait for READY on the read end `fd` of a child's --ready-fd pipe (closes `fd`). A timeout or
    an exit before READY raises, with `detail()` (e.g. the tail of the child's log) appended."""
    deadline, buf = time.monotonic() + timeout, b""
    try:
        while b"READY" not in buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{what} not ready within {timeout}s\n{detail()}".rstrip())
            if select.select([fd], [], [], left)[0]:
                chunk = os.read(fd, 64)
                if not chunk:
                    raise RuntimeError(f"{what} exited before READY (code {proc.wait(10)})\n{detail()}".rstrip())
                buf += chunk
    finally:
        os.close(fd)


class RoleProc:
    def __init__(self, role: str, id: str, config: str | os.PathLike, log_dir: str | os.PathLike,
                 env: dict | None = None):
        self.role, self.id, self.config = role, str(id), str(config)
        self.log_path = Path(log_dir) / f"{role}.{id}.log"
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None
        self._ready_r: int | None = None
        self.shm = ShmLedger()

    def start(self) -> RoleProc:
        r, w = os.pipe()
        argv = [sys.executable, "-m", "laminar.cli", "--log-level", "info", "role", self.role, self.config,
                "--id", self.id, "--ready-fd", str(w)]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, pass_fds=(w,), stdout=log, stderr=subprocess.STDOUT,
                                         env=self.env, start_new_session=True, preexec_fn=die_with_parent)
        os.close(w)
        self._ready_r = r
        self.shm = ShmLedger()
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def wait_ready(self, timeout: float) -> None:
        try:
            wait_ready(self.proc, self._ready_r, timeout, f"{self.role}.{self.id}", self.tail)
        finally:
            self._ready_r = None
        self.note_shm()

    def note_shm(self) -> None:
        """Note what the role's process group maps or holds open in /dev/shm now."""
        if self.proc is not None:
            self.shm.note(group_members(self.proc.pid))

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        if self.alive():
            self.note_shm()
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self._sweep()

    def _sweep(self) -> None:
        """The role ran in its own session: kill what it left there (a rollout's vLLM engine) and
        remove the shared memory only that group held."""
        if self.proc is not None and self.proc.returncode is not None:
            self.note_shm()  # survivors still hold what they made
            sweep_group(self.proc.pid)
            self.shm.release()

    def stop(self, timeout: float = 10.0) -> int | None:
        if self.proc is None:
            return None
        if self.alive():
            self.note_shm()
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._sweep()
        if self._ready_r is not None:
            os.close(self._ready_r)
            self._ready_r = None
        return self.proc.returncode

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def events(self, name: str) -> list[dict]:
        """Log events (JSON lines) of this process whose `event` is `name`."""
        return log_events(self.log_path, name)


def log_events(path: str | os.PathLike, name: str) -> list[dict]:
    """The JSON-line log events named `name` in a role's log file (other lines are skipped)."""
    out = []
    p = Path(path)
    if not p.exists():
        return out
    for line in p.read_text(errors="replace").splitlines():
        if f'"{name}"' in line:
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if isinstance(ev, dict) and ev.get("event") == name:
                out.append(ev)
    return out
