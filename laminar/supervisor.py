"""`laminar-node up/start`: run every role placed on one host as supervised child processes.

- Children are `python -m laminar.cli role NAME --id ID CONFIG --ready-fd N`; each writes READY on
  its pipe when setup is done (a handshake, never a sleep). The broker starts first; the rest
  start together once it is ready.
- A child that exits non-zero (or is killed) is restarted with exponential backoff (0.5 s doubling
  to 30 s, reset after 60 s of healthy running). Why it went down is kept as its `last_error`, one
  line: what it wrote on the READY pipe instead of READY (`FAILED <why>`: its setup or config
  failed), else the last error in its own log since it started, else its exit code. A child that
  fails to start (no READY) with the same reason `give_up_after` times in a row (default 3) is
  given up: state "failed", not restarted (a missing file or a taken port does not heal by
  retrying; a start that fails differently each time is retried). A child that exits 0 has finished and stays down;
  one that exits 3 (laminar/shell.py EXIT_STOPPED_BY_OPERATOR: an operator's Shutdown command)
  stays down too, in state "stopped_by_operator", logged as such.
- Children live in their own session (a terminal's Ctrl-C reaches only the supervisor, which then
  stops them in order: roles first, broker last) and get SIGTERM if the supervisor dies
  (PR_SET_PDEATHSIG), so no child outlives it.
- A child's own children (a rollout's vLLM EngineCore and workers) share its process group; when
  the child exits, however it exits (SIGKILL included), whatever is left in that group is killed,
  so an engine never outlives its rollout holding GiBs of memory.
- The same goes for the group's shared memory: what its processes map or hold open in /dev/shm
  (vLLM's `psm_*` message queues, multiprocessing semaphores) is noted when the child is READY,
  every SHM_SCAN_S while it runs, and once more just before the sweep; after the sweep, every
  noted top-level /dev/shm object that no live process outside the group holds is unlinked
  (laminar/shm.py). A clean engine shutdown unlinks its own; this catches the rest.
- READY deadline per child: `ready_timeout_s` of its placement (RoleSpec), else READY_TIMEOUT_S of
  its role kind (rollouts: long enough for a 70B vLLM start), else DEFAULT_READY_TIMEOUT_S.
- A placement's `gpus` becomes the child's CUDA_VISIBLE_DEVICES (RoleSpec.env), so each role
  (a trainer rank, a vLLM rollout and its engine processes) sees only its own GPUs as cuda:0...
- Logs: with a log folder, a child's stdout and stderr are one pipe; the supervisor appends what
  comes out of it to `<log_dir>/<role>.<id>.log`, rotated by size (laminar/logs.py RotatingSink).
  The child's own children inherit the pipe, so a vLLM engine's output follows the rotation too.
  After a child exits (and its group is swept) its pipe is read to the end before its last error
  is looked up; a process outside the group still holding the pipe is waited for at most
  DRAIN_S, and its output is still logged while it lives.
- Stop: SIGTERM, wait `shutdown_s`, SIGKILL what is left, reap everything.
"""
from __future__ import annotations

import asyncio
import ctypes
import json
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from laminar.bus.retry import Backoff
from laminar.logs import RotatingSink
from laminar.shell import EXIT_STOPPED_BY_OPERATOR
from laminar.shm import ShmLedger, group_members, groups_members

log = structlog.get_logger("laminar.supervisor")

BACKOFF_START_S, BACKOFF_MAX_S, HEALTHY_RESET_S = 0.5, 30.0, 60.0
SHM_SCAN_S = 5.0  # how often a running child's /dev/shm holdings are noted
DRAIN_S = 5.0     # how long an ended run's output pipe is read before going on without its end
PUMP_CHUNK = 1 << 16
DEFAULT_READY_TIMEOUT_S = 300.0
# a rollout loads its model into vLLM before READY: a 70B start (weights from disk, KV cache
# allocation, warm-up) takes many minutes on a real node
READY_TIMEOUT_S = {"rollout": 1800.0}


def ready_timeout_for(role: str, configured: float | None = None) -> float:
    """The READY deadline of a `role` child: its configured value, else its kind's default."""
    if configured is not None:
        return float(configured)
    return READY_TIMEOUT_S.get(role, DEFAULT_READY_TIMEOUT_S)


def die_with_parent() -> None:
    """A `preexec_fn`: the child gets SIGTERM when the thread that started it ends (its parent was
    killed, even by SIGKILL), so no child outlives its parent re-parented to init."""
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
    ready_timeout_s: float | None = None  # None: the supervisor's default for this role kind
    env: dict[str, str] = field(default_factory=dict)  # added to the supervisor's environment (GPU visibility)
    pid: int | None = None
    restarts: int = 0
    started_at: float = 0.0
    last_exit: int | None = None
    proc: asyncio.subprocess.Process | None = field(default=None, repr=False)
    changed: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    group: int | None = field(default=None, repr=False)  # process group of the run not yet reaped
    shm: ShmLedger = field(default_factory=ShmLedger, repr=False)
    last_error: str | None = None   # why it last went down (one line), None while it never failed
    failed_starts: int = 0          # starts in a row that failed (no READY) with this same last_error
    log_offset: int = field(default=0, repr=False)  # size of its log when the current run started
    log_generation: int = field(default=0, repr=False)  # its log's rotations then (log_offset's file)
    pump: asyncio.Task | None = field(default=None, repr=False)  # copies the current run's pipe to its log

    @property
    def key(self) -> str:
        return f"{self.role}.{self.id}"


class Supervisor:
    def __init__(self, children: list[Child], shutdown_s: float = 10.0, ready_timeout_s: float | None = None,
                 on_change: Callable[[Child], None] = lambda c: None, env: dict | None = None,
                 log_dir: str | None = None, give_up_after: int = 3):
        """`ready_timeout_s`: READY deadline of children that configure none (None: per role kind);
        `give_up_after`: identical failed starts in a row after which a child is given up (0: never)."""
        self.children = children
        self.log_dir = log_dir
        self.give_up_after = give_up_after
        self.shutdown_s, self.ready_timeout_s = shutdown_s, ready_timeout_s
        self.on_change, self.env = on_change, env
        self.stopping = asyncio.Event()
        self._watchers: list[asyncio.Task] = []
        self._reaps: set[asyncio.Future] = set()
        self._scanner: asyncio.Task | None = None
        self._sinks: dict[str, RotatingSink] = {}   # per child, across its restarts
        self._pumps: set[asyncio.Task] = set()

    def ready_timeout(self, c: Child) -> float:
        if c.ready_timeout_s is None and self.ready_timeout_s is not None:
            return self.ready_timeout_s
        return ready_timeout_for(c.role, c.ready_timeout_s)

    def child_env(self, c: Child) -> dict | None:
        """The environment of `c`'s process: the supervisor's (or this process's) plus the child's
        own variables (CUDA_VISIBLE_DEVICES from its placement's `gpus`); None: inherit as is."""
        if not c.env:
            return self.env
        return {**(self.env if self.env is not None else os.environ), **c.env}

    def _set(self, c: Child, state: str) -> None:
        c.state = state
        c.changed.set()
        self.on_change(c)

    def log_path(self, c: Child) -> Path | None:
        return Path(self.log_dir, f"{c.key}.log") if self.log_dir else None

    async def _spawn(self, c: Child) -> str | None:
        """Start one child and wait for its READY line; None when READY, else why not (one line)."""
        self._set(c, "starting")
        out_r = out_w = None
        if self.log_dir:  # each child's output goes through a pipe to <log_dir>/<role>.<id>.log
            sink = self._sink(c)
            c.log_offset, c.log_generation = sink.size, sink.generation
            out_r, out_w = os.pipe()
        r, w = os.pipe()
        try:
            c.proc = await asyncio.create_subprocess_exec(
                *c.argv, "--ready-fd", str(w), pass_fds=(w,), start_new_session=True,
                preexec_fn=die_with_parent, env=self.child_env(c), stdin=asyncio.subprocess.DEVNULL,
                stdout=out_w, stderr=out_w)
        except BaseException:
            os.close(r)
            if out_r is not None:
                os.close(out_r)
            raise
        finally:
            os.close(w)
            if out_w is not None:
                os.close(out_w)
        if out_r is not None:
            c.pump = asyncio.create_task(self._pump(out_r, self._sinks[c.key]), name=f"log:{c.key}")
            self._pumps.add(c.pump)
            c.pump.add_done_callback(self._pumps.discard)
        c.pid, c.started_at = c.proc.pid, time.monotonic()
        c.group, c.shm = c.proc.pid, ShmLedger()  # start_new_session: its pid is its group
        timeout = self.ready_timeout(c)
        line = await self._read_ready(r, timeout)
        if line.startswith(b"READY"):
            await asyncio.to_thread(self._note, c)  # an engine made its queues during setup
            self._set(c, "ready")
            return None
        if line.startswith(b"FAILED "):
            return line[7:].decode(errors="replace").strip() or "setup failed"
        return f"no READY within {timeout:.0f} s" if line == b"TIMEOUT" else ""

    def _sink(self, c: Child) -> RotatingSink:
        if c.key not in self._sinks:
            os.makedirs(self.log_dir, exist_ok=True)
            self._sinks[c.key] = RotatingSink(self.log_path(c))
        return self._sinks[c.key]

    @staticmethod
    async def _pump(fd: int, sink: RotatingSink) -> None:
        """Copy a child's output pipe into its log until every writer has closed it."""
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=PUMP_CHUNK)
        transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader),
                                                    os.fdopen(fd, "rb", buffering=0))
        try:
            while chunk := await reader.read(PUMP_CHUNK):
                sink.write(chunk)
        finally:
            transport.close()

    async def _drained(self, c: Child) -> None:
        """Wait (at most DRAIN_S) until the ended run's output is all in its log."""
        if c.pump is not None:
            await asyncio.wait([c.pump], timeout=DRAIN_S)

    async def _read_ready(self, fd: int, timeout_s: float, limit: int = 8192) -> bytes:
        """The child's first line on the pipe (b"" when it closed the pipe without one)."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        buf = bytearray()

        def readable() -> None:
            data = os.read(fd, 4096)
            buf.extend(data)
            if (not data or b"\n" in buf or len(buf) >= limit) and not fut.done():
                fut.set_result(bytes(buf).split(b"\n", 1)[0])

        loop.add_reader(fd, readable)
        try:
            return await asyncio.wait_for(fut, timeout_s)
        except TimeoutError:
            return b"TIMEOUT"
        finally:
            loop.remove_reader(fd)
            os.close(fd)

    async def _watch(self, c: Child) -> None:
        wait = Backoff(BACKOFF_START_S, BACKOFF_MAX_S)
        while not self.stopping.is_set():
            not_ready = await self._spawn(c)
            if not_ready is not None and c.proc.returncode is None:
                await self._end_failed_start(c, not_ready)
            code = await c.proc.wait()
            await asyncio.shield(self._reap_soon(c))
            await self._drained(c)  # before its last error is read from the log
            c.last_exit, c.pid = code, None
            if self.stopping.is_set():
                self._set(c, "stopped")
                return
            if code == 0:
                self._set(c, "finished")
                return
            if code == EXIT_STOPPED_BY_OPERATOR:
                log.warning("child_stopped_by_operator", child=c.key, code=code)
                self._set(c, "stopped_by_operator")
                return
            why = not_ready or await asyncio.to_thread(self._logged_error, c) or f"exited with code {code}" + (
                " before READY" if not_ready is not None else "")
            c.failed_starts = (c.failed_starts + 1 if why == c.last_error else 1) if not_ready is not None else 0
            c.last_error = why
            if not_ready is not None and self.give_up_after and c.failed_starts >= self.give_up_after:
                log.error("child_given_up", child=c.key, failed_starts=c.failed_starts, error=why)
                self._set(c, "failed")
                return
            if time.monotonic() - c.started_at > HEALTHY_RESET_S:
                wait.reset()
            c.restarts += 1
            log.warning("child_exited", child=c.key, code=code, error=why, restart_in_s=wait.delay,
                        restarts=c.restarts)
            self._set(c, "backoff")
            try:
                await asyncio.wait_for(self.stopping.wait(), wait.next())
            except TimeoutError:
                pass

    async def _end_failed_start(self, c: Child, why: str) -> None:
        """A child that never became ready: one that said why (or closed the pipe) is on its way
        out and gets `shutdown_s` to stop; one that timed out is killed at once."""
        if not why.startswith("no READY within"):
            try:
                await asyncio.wait_for(asyncio.shield(c.proc.wait()), self.shutdown_s)
                return
            except TimeoutError:
                pass
        c.proc.kill()

    def _logged_error(self, c: Child) -> str | None:
        path = self.log_path(c)
        if not path:
            return None
        sink = self._sinks.get(c.key)
        rotated = sink is not None and sink.generation != c.log_generation  # the run's start is in an older file
        return last_error_line(path, 0 if rotated else c.log_offset)

    @staticmethod
    def _note(c: Child) -> None:
        """Note what the child's group holds in /dev/shm now (blocking: /proc reads)."""
        if c.group is not None:
            c.shm.note(group_members(c.group))

    def _reap(self, c: Child) -> None:
        """After the child exited: note what its survivors hold, kill them, remove the shared
        memory only they held. Once per run (blocking: /proc reads, unlinks)."""
        pgid, ledger = c.group, c.shm
        if pgid is None:
            return
        c.group = None
        ledger.note(group_members(pgid))
        sweep_group(pgid)
        removed = ledger.release()
        if removed:
            log.info("child_shm_removed", child=c.key, pgid=pgid, removed=removed)

    def _reap_soon(self, c: Child) -> asyncio.Future:
        fut = asyncio.ensure_future(asyncio.to_thread(self._reap, c))
        self._reaps.add(fut)
        fut.add_done_callback(self._reaps.discard)
        return fut

    def _note_all(self) -> None:
        running = [c for c in self.children if c.group is not None]
        members = groups_members([c.group for c in running])  # one pass over /proc for all
        for c in running:
            c.shm.note(members.get(c.group, []))

    async def _scan_shm(self) -> None:
        """Every SHM_SCAN_S: note what each running child's group holds in /dev/shm."""
        while True:
            await asyncio.sleep(SHM_SCAN_S)  # a period, not a synchronization
            try:
                await asyncio.to_thread(self._note_all)
            except Exception as exc:  # a failed scan must not stop supervision: loud, then the next one
                log.error("shm_scan_failed", error=repr(exc), exc_info=exc)

    async def start(self) -> None:
        """Start the broker (if placed here) and wait for READY, then everything else."""
        if self._scanner is None:
            self._scanner = asyncio.create_task(self._scan_shm(), name="scan_shm")
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
        # stop() cancels the watchers later: that outcome is expected, not an unretrieved error
        done.add_done_callback(lambda f: f.cancelled() or f.exception())
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
        if self._scanner is not None:
            self._scanner.cancel()
            await asyncio.gather(self._scanner, return_exceptions=True)
        for c in self.children:  # a watcher cancelled before it reaped its child's run
            if c.group is not None and c.proc is not None and c.proc.returncode is not None:
                self._reap_soon(c)
        await asyncio.gather(*self._reaps, return_exceptions=True)
        if self._pumps:  # the last output of every run, then the logs are closed
            _, late = await asyncio.wait(list(self._pumps), timeout=DRAIN_S)
            for t in late:
                t.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        for sink in self._sinks.values():
            sink.close()
        self._sinks.clear()
        for c in self.children:  # ... or before it recorded the end
            if c.pid is not None and c.proc is not None and c.proc.returncode is not None:
                c.last_exit, c.pid = c.proc.returncode, None
            if c.state not in ("finished", "stopped", "failed", "stopped_by_operator"):
                self._set(c, "stopped")

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


_ERROR_LINE = re.compile(r"^(error|[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Failed|Refused)): ")


def last_error_line(path: str | os.PathLike, offset: int = 0, tail_bytes: int = 1 << 16) -> str | None:
    """The last error in a child's log from `offset` on (where its current run began): the newest
    JSON event at level error or above (`event: error`), or the last `SomeError: message` line of
    a Python traceback or `error: ...` line (what a process prints on stderr outside the logger,
    e.g. when it dies before configuring it); None when there is none."""
    try:
        with open(path, "rb") as f:
            end = f.seek(0, os.SEEK_END)
            f.seek(max(offset, end - tail_bytes))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        if line.startswith("{"):
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if isinstance(ev, dict) and ev.get("level") in ("error", "critical"):
                detail = ev.get("error") or (str(ev.get("exception") or "").strip().splitlines() or [""])[-1]
                return f"{ev.get('event', 'error')}: {detail}" if detail else str(ev.get("event", "error"))
        elif _ERROR_LINE.match(line):
            return line.strip()
    return None


def children_for_host(cfg, config_path: str, host: str, level: str = "info",
                      overrides: list[str] | tuple[str, ...] = ()) -> list[Child]:
    """One child per role the config places on `host`, each given the same `--set` overrides."""
    py = [sys.executable, "-m", "laminar.cli", "--log-level", level]
    sets = [a for o in overrides for a in ("--set", o)]
    return [Child(spec.role, spec.id, [*py, "role", spec.role, "--id", spec.id, "--host", host, *sets, config_path],
                  ready_timeout_s=ready_timeout_for(spec.role, spec.ready_timeout_s), env=spec.env())
            for spec in cfg.cluster.hosts[host].roles]
