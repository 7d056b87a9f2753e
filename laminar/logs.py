"""structlog set-up: one JSON event per line on stderr, tagged with the process's component, and
mirrored onto the bus as LogEvent on `log.<role>` (info and above) so `laminar-node tail` can
follow a whole cluster. The mirror never blocks: beyond the publisher's HWM an event is dropped.

Rotation: logs stay bounded over a run of any length, by size: past `LAMINAR_LOG_MAX_BYTES`
(default 64 MiB; 0 = never) the line that crossed it ends the file, `<name>.k` becomes
`<name>.k+1`, the file becomes `<name>.1` and a new one takes its place, keeping
`LAMINAR_LOG_KEEP` older files (default 4: at most 5 x 64 MiB per role).

- A role under the supervisor writes its stdout and stderr into a pipe; the supervisor appends
  what comes out of it to `<workdir>/logs/<role>.<id>.log` and rotates that (`RotatingSink`).
  Every process of the role shares the pipe (a rollout's vLLM EngineCore and workers inherit it),
  so all their output follows the rotation; none keeps writing into a renamed or deleted file.
- A process whose stderr is itself a regular file (a role started by hand with `2>>file`) rotates
  it in-process (`RotatingStderr`: its own fds 1 and 2 move to the new file; processes it started
  before keep the old one).
- The manager's JSONL records (fleet.jsonl, repacks.jsonl) rotate the same way (`RotatingFile`).

Readers take every kept file, oldest first: `rotated_files`, `read_rotated_jsonl`.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import stat
import sys
import threading
import time
from pathlib import Path
from typing import Any

import structlog

from laminar.protocol import LogEvent

_LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40, "critical": 50}


class BusMirror:
    """structlog processor that republishes each event on the bus (from the loop thread only)."""

    def __init__(self, role: str, id: str, min_level: str = "info"):
        self.role, self.id, self.min = role, id, _LEVELS[min_level]
        self.publisher = None
        self.thread = threading.get_ident()

    def __call__(self, logger: Any, method: str, ev: dict) -> dict:
        pub = self.publisher
        if pub is not None and _LEVELS.get(method, 20) >= self.min and threading.get_ident() == self.thread:
            fields = {k: v if isinstance(v, (int, float, str, bool, type(None))) else repr(v)
                      for k, v in ev.items() if k not in ("event", "level", "timestamp")}
            pub.publish(f"log.{self.role}", LogEvent(role=self.role, id=self.id, level=method,
                                                     event=str(ev.get("event")), ts=time.time(), fields=fields))
        return ev


LOG_MAX_BYTES = 64 << 20
LOG_KEEP = 4


def rotation_settings() -> tuple[int, int]:
    """(max bytes per file, older files kept) from LAMINAR_LOG_MAX_BYTES / LAMINAR_LOG_KEEP."""
    def env(name: str, default: int) -> int:
        try:
            return max(0, int(os.environ.get(name, default)))
        except ValueError:
            return default
    return env("LAMINAR_LOG_MAX_BYTES", LOG_MAX_BYTES), env("LAMINAR_LOG_KEEP", LOG_KEEP)


def rotate(path: str | Path, keep: int) -> None:
    """`path.(keep-1)` -> `path.keep` ... `path` -> `path.1`; what falls past `keep` is deleted."""
    path = Path(path)
    if keep <= 0:
        path.unlink(missing_ok=True)
        return
    Path(f"{path}.{keep}").unlink(missing_ok=True)
    for k in range(keep - 1, 0, -1):
        older = Path(f"{path}.{k}")
        if older.exists():
            older.rename(f"{path}.{k + 1}")
    if path.exists():
        path.rename(f"{path}.1")


def rotated_files(path: str | Path) -> list[Path]:
    """The kept files of a rotated log, oldest first (`path.N` ... `path.1`, `path`); existing only."""
    path = Path(path)
    older = []
    for f in path.parent.glob(path.name + ".*"):
        tail = f.name[len(path.name) + 1:]
        if tail.isdigit():
            older.append((int(tail), f))
    return [f for _, f in sorted(older, reverse=True)] + ([path] if path.exists() else [])


def read_rotated_jsonl(path: str | Path) -> list[dict]:
    """The JSON records of a rotated file, oldest first ([] if there is none). Lines that are not a
    JSON object (torn by a kill, or a native library's output on a role's stderr) are skipped."""
    out = []
    for f in rotated_files(path):
        for line in f.read_text(errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict):
                out.append(rec)
    return out


class RotatingFile:
    """A line-buffered append-only text file rotated by size (JSONL records a role appends to)."""

    def __init__(self, path: str | Path, max_bytes: int | None = None, keep: int | None = None):
        dmax, dkeep = rotation_settings()
        self.path = Path(path)
        self.max_bytes = dmax if max_bytes is None else max_bytes
        self.keep = dkeep if keep is None else keep
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.f = open(self.path, "a", buffering=1)
        self.size = self.f.tell()

    def write(self, text: str) -> None:
        try:
            self.f.write(text)
        except OSError:  # a full disk: this record is lost, the role goes on (counted in `dropped`)
            self.dropped = getattr(self, "dropped", 0) + 1
            return
        self.size += len(text.encode()) if not text.isascii() else len(text)
        if self.max_bytes and self.size >= self.max_bytes and text.endswith("\n"):
            self.f.close()
            rotate(self.path, self.keep)
            self.f = open(self.path, "a", buffering=1)
            self.size = 0

    def close(self) -> None:
        try:
            self.f.close()
        except OSError:  # what a full disk kept in the buffer is lost with it
            pass


class RotatingSink:
    """A child's output (bytes from its pipe) appended to its log file, rotated by size at a line's
    end; `generation` counts the rotations (an offset taken before one means nothing after it)."""

    def __init__(self, path: str | Path, max_bytes: int | None = None, keep: int | None = None):
        dmax, dkeep = rotation_settings()
        self.path = Path(path)
        self.max_bytes = dmax if max_bytes is None else max_bytes
        self.keep = dkeep if keep is None else keep
        self.generation = self.dropped = 0
        self.f = open(self.path, "ab", buffering=0)
        self.size = self.f.seek(0, os.SEEK_END)

    def write(self, data: bytes) -> None:
        while data:
            nl = data.find(b"\n", max(self.max_bytes - self.size - 1, 0)) if self.max_bytes else -1
            if nl < 0:
                self._append(data)
                return
            self._append(data[:nl + 1])  # the line that crosses the bound ends the file
            data = data[nl + 1:]
            self._rotate()

    def _append(self, data: bytes) -> None:
        try:
            self.f.write(data)
        except OSError:  # a full disk: these bytes are lost, the child goes on
            self.dropped += 1
        self.size += len(data)

    def _rotate(self) -> None:
        try:
            self.f.close()
            rotate(self.path, self.keep)
        except OSError:
            self.max_bytes = 0  # rotation is not possible here: keep writing where we are
        try:
            self.f = open(self.path, "ab", buffering=0)
        except OSError:
            self.f = open(os.devnull, "ab", buffering=0)  # nowhere to write: drop, never raise
            self.dropped += 1
        self.size = self.f.seek(0, os.SEEK_END)
        self.generation += 1

    def close(self) -> None:
        try:
            self.f.close()
        except OSError:
            pass


class RotatingStderr:
    """The process's stderr when it is a regular file: each write goes to it, and past max_bytes
    (at a line's end) the file is rotated and a new one is put on fds 1 and 2."""

    def __init__(self, path: str, max_bytes: int, keep: int):
        self.path, self.max_bytes, self.keep = path, max_bytes, keep
        self.lock = threading.Lock()
        self.size = os.fstat(2).st_size
        self.writes = 0

    def write(self, text: str) -> int:
        with self.lock:
            n = sys.stderr.write(text)
            self.size += len(text)
            self.writes += 1
            if self.writes % 64 == 0:  # native writes to the same fd are not seen here
                sys.stderr.flush()
                self.size = os.fstat(2).st_size
            if self.size >= self.max_bytes and text.endswith("\n"):
                self._rotate()
            return n

    def _rotate(self) -> None:
        sys.stderr.flush()
        sys.stdout.flush()
        try:
            if os.fstat(2).st_ino != os.stat(self.path).st_ino:  # someone moved it: follow no further
                self.max_bytes = 0
                return
            rotate(self.path, self.keep)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError:
            self.max_bytes = 0  # rotation is not possible here: keep writing where we are
            return
        os.dup2(fd, 2)
        if stat.S_ISREG(os.fstat(1).st_mode):
            os.dup2(fd, 1)
        os.close(fd)
        self.size = 0

    def flush(self) -> None:
        sys.stderr.flush()


def _rotating_stderr() -> RotatingStderr | None:
    """A RotatingStderr when fd 2 is a regular file opened for appending (a role's log file)."""
    max_bytes, keep = rotation_settings()
    if not max_bytes:
        return None
    try:
        st = os.fstat(2)
        path = os.readlink("/proc/self/fd/2")
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode) or not os.path.isabs(path) or not os.path.exists(path):
        return None
    if not fcntl.fcntl(2, fcntl.F_GETFL) & os.O_APPEND:
        return None
    return RotatingStderr(path, max_bytes, keep)


class NeverRaise:
    """A log stream whose failures (a full disk: ENOSPC; a closed or broken file) drop the line
    instead of raising into the code that logged it: a role must not fail because its log cannot
    be written. `dropped` counts the lines lost; the first loss is said once on the original
    stderr, if that can be written at all."""

    def __init__(self, stream):
        self.stream, self.dropped = stream, 0

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except (OSError, ValueError) as exc:
            self._lost(exc)
            return 0

    def flush(self) -> None:
        try:
            self.stream.flush()
        except (OSError, ValueError) as exc:
            self._lost(exc)

    def _lost(self, exc: BaseException) -> None:
        self.dropped += 1
        if self.dropped == 1:
            try:
                os.write(2, f"laminar: log lines are being dropped: {exc}\n".encode())
            except OSError:
                pass


def configure(component: str, level: str = "info", mirror: BusMirror | None = None, stream=None) -> None:
    processors: list = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        lambda _l, _m, ev: {**ev, "component": component},
    ]
    if mirror is not None:
        processors.append(mirror)
    processors += [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(NeverRaise(stream or _rotating_stderr() or sys.stderr)),
        cache_logger_on_first_use=False,
    )
    logging.basicConfig(level=max(_LEVELS[level], logging.WARNING), stream=stream or sys.stderr)
