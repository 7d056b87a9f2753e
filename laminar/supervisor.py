"""`laminar-node up/start`: run every role placed on one host as supervised child processes.

- Children are `python -m laminar.cli role NAME --id ID CONFIG --ready-fd N`; each writes READY on
  its pipe when setup is done (a handshake, never a sleep). The broker starts first; the rest
  start together once it is ready.
- A child that exits non-zero (or is killed) is restarted with exponential backoff (0.5 s doubling
  to 30 s, reset after 60 s of healthy running). A child that exits 0 has finished and stays down.
- Children live in their own session (a terminal's Ctrl-C reaches only the supervisor, which then
  stops them in order: roles first, broker last) and get SIGTERM if the supervisor dies
  (PR_SET_PDEATHSIG), so no child outlives it.
- A child's own children (a rollout's vLLM EngineCore and workers) share its process group; when
  the child exits, however it exits (SIGKILL included), whatever is left in that group is killed,
  so an engine never outlives its rollout holding GiBs of memory.
- Stop: SIGTERM, wait `shutdown_s`, SIGKILL what is left, reap everything.
"""
from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import structlog

log = structlog.get_logger("laminar.supervisor")

BACKOFF_START_S, BACKOFF_MAX_S, HEALTHY_RESET_S = 0.5, 30.0, 60.0


def _pdeathsig() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def sweep_group(pgid: int | None) -> None:
    """SIGKILL what is left in the process group `pgid` (a child started with start_new_session, now
    exited): the descendants it did not take down with it. Nothing there is fine."""
    if not pgid:
        return
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


@dataclass
class Child:
    role: str
    id: str
    argv: list[str]
    state: str = "pending"      # pending | starting | ready | backoff | finished | failed | stopped
    pid: int | None = None
    restarts: int = 0
    started_at: float = 0.0
    last_exit: int | None = None
    proc: asyncio.subprocess.Process | None = field(default=None, repr=False)
    changed: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    @property
    def key(self) -> str:
        return f"{self.role}.{self.id}"


class Supervisor:
    def __init__(self, children: list[Child], shutdown_s: float = 10.0, ready_timeout_s: float = 300.0,
                 on_change: Callable[[Child], None] = lambda c: None, env: dict | None = None,
                 log_dir: str | None = None):
        self.children = children
        self.log_dir = log_dir
        self.shutdown_s, self.ready_timeout_s = shutdown_s, ready_timeout_s
        self.on_change, self.env = on_change, env
        self.stopping = asyncio.Event()
        self._watchers: list[asyncio.Task] = []

    def _set(self, c: Child, state: str) -> None:
        c.state = state
        c.changed.set()
        self.on_change(c)

    async def _spawn(self, c: Child) -> bool:
        """Start one child and wait for its READY line; False if it died or timed out first."""
        r, w = os.pipe()
        self._set(c, "starting")
        out = None
        if self.log_dir:  # each child's JSON log lines go to <log_dir>/<role>.<id>.log
            os.makedirs(self.log_dir, exist_ok=True)
            out = open(os.path.join(self.log_dir, f"{c.key}.log"), "ab")
        try:
            c.proc = await asyncio.create_subprocess_exec(
                *c.argv, "--ready-fd", str(w), pass_fds=(w,), start_new_session=True,
                preexec_fn=_pdeathsig, env=self.env, stdin=asyncio.subprocess.DEVNULL,
                stdout=out, stderr=out)
        finally:
            os.close(w)
            if out is not None:
                out.close()
        c.pid, c.started_at = c.proc.pid, time.monotonic()
        line = await self._read_ready(r)
        if line.startswith(b"READY"):
            self._set(c, "ready")
            return True
        log.warning("child_not_ready", child=c.key, pid=c.pid, got=line[:40].decode(errors="replace"))
        return False

    async def _read_ready(self, fd: int) -> bytes:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def readable() -> None:
            data = os.read(fd, 64)
            if not fut.done():
                fut.set_result(data)

        loop.add_reader(fd, readable)
        try:
            return await asyncio.wait_for(fut, self.ready_timeout_s)
        except TimeoutError:
            return b"TIMEOUT"
        finally:
            loop.remove_reader(fd)
            os.close(fd)

    async def _watch(self, c: Child) -> None:
        backoff = BACKOFF_START_S
        while not self.stopping.is_set():
            ok = await self._spawn(c)
            if not ok and c.proc.returncode is None:
                c.proc.kill()  # never became ready: treat as a failed start
            code = await c.proc.wait()
            sweep_group(c.proc.pid)
            c.last_exit, c.pid = code, None
            if self.stopping.is_set():
                self._set(c, "stopped")
                return
            if code == 0:
                self._set(c, "finished")
                return
            if time.monotonic() - c.started_at > HEALTHY_RESET_S:
                backoff = BACKOFF_START_S
            c.restarts += 1
            log.warning("child_exited", child=c.key, code=code, restart_in_s=backoff, restarts=c.restarts)
            self._set(c, "backoff")
            try:
                await asyncio.wait_for(self.stopping.wait(), backoff)
            except TimeoutError:
                pass
            backoff = min(backoff * 2, BACKOFF_MAX_S)

    async def start(self) -> None:
        """Start the broker (if placed here) and wait for READY, then everything else."""
        first = [c for c in self.children if c.role == "broker"]
        rest = [c for c in self.children if c.role != "broker"]
        for c in first:
            self._watchers.append(asyncio.create_task(self._watch(c), name=f"watch:{c.key}"))
            while c.state not in ("ready", "finished", "backoff") and not self.stopping.is_set():
                c.changed.clear()
                await c.changed.wait()
        for c in rest:
            self._watchers.append(asyncio.create_task(self._watch(c), name=f"watch:{c.key}"))

    async def wait(self) -> None:
        """Until stop() is asked for or every child has finished."""
        done = asyncio.gather(*self._watchers)
        stop = asyncio.ensure_future(self.stopping.wait())
        await asyncio.wait([done, stop], return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()

    async def stop(self) -> None:
        self.stopping.set()
        roles = [c for c in self.children if c.role != "broker"]
        brokers = [c for c in self.children if c.role == "broker"]
        for group in (roles, brokers):
            await self._terminate(group)
        for t in self._watchers:
            t.cancel()
        await asyncio.gather(*self._watchers, return_exceptions=True)

    async def _terminate(self, group: list[Child]) -> None:
        live = [c for c in group if c.proc is not None and c.proc.returncode is None]
        for c in live:
            c.proc.send_signal(signal.SIGTERM)
        if not live:
            return
        _, pending = await asyncio.wait([asyncio.ensure_future(c.proc.wait()) for c in live],
                                        timeout=self.shutdown_s)
        for c in live:
            if c.proc.returncode is None:
                log.error("child_killed_after_deadline", child=c.key, deadline_s=self.shutdown_s)
                c.proc.kill()
        for c in live:
            await c.proc.wait()


def children_for_host(cfg, config_path: str, host: str, level: str = "info") -> list[Child]:
    py = [sys.executable, "-m", "laminar.cli", "--log-level", level]
    return [Child(spec.role, spec.id, [*py, "role", spec.role, "--id", spec.id, "--host", host, config_path])
            for spec in cfg.cluster.hosts[host].roles]
