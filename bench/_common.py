"""Shared bits of the benchmark programs: free ports, percentiles, the spread of rounds, table
printing, JSON output, CPU and full-collection clocks, the event loop a role runs on, and ending
cleanly.

A bench that is stopped (Ctrl-C, `timeout`'s SIGTERM, a closed terminal's SIGHUP) must still remove
what it made: its clusters, their processes, and their shared memory in /dev/shm. `exit_on_signals()`
turns SIGTERM and SIGHUP into an exception like Ctrl-C's, so every `with` and `finally` runs;
`run_child()` runs a cluster command (`laminar-node up`) and, when interrupted or out of time, asks it
to stop as Ctrl-C would (it then stops its roles, which remove their engines' shared memory) before
it kills it.
"""
from __future__ import annotations

import asyncio
import gc
import math
import os
import signal
import statistics
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from laminar.report import print_table, write_json  # noqa: F401  (re-exported for the benchmarks)
from laminar.testing.procs import free_port  # noqa: F401  (re-exported for the benchmarks)


def percentile(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    i = min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))
    return s[i]


def spread_of(xs: list[float]) -> dict:
    """Median of `xs`, and how far they scatter around it: (max - min) / median and the
    interquartile range / median."""
    med = statistics.median(xs)
    if len(xs) < 2 or not med:
        return {"median": med, "spread": 0.0, "iqr": 0.0, "min": min(xs), "max": max(xs)}
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return {"median": med, "spread": (max(xs) - min(xs)) / med, "iqr": (q3 - q1) / med, "min": min(xs),
            "max": max(xs)}


def median_ci(xs: list[float], conf: float = 0.95) -> tuple[float, float]:
    """The distribution-free interval of the median of `xs` (order statistics): the k-th smallest
    and k-th largest values, k the largest rank with P(Binomial(n, 1/2) < k) <= (1 - conf) / 2, so
    the interval covers the true median at least `conf` of the time, whatever the distribution.
    Under six values no such k exists: (min, max), which covers less."""
    v, n = sorted(xs), len(xs)
    if not v:
        raise ValueError("median_ci of no values")
    cdf, k, tail = 0.0, 0, (1 - conf) / 2
    for j in range(n):  # cdf = P(B <= j - 1) before adding j's term; k = the last j with P(B < j) <= tail
        if cdf > tail:
            break
        k = j
        cdf += math.comb(n, j) / 2 ** n
    k = max(k, 1)
    return v[k - 1], v[n - k]


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) used so far by process `pid` (0.0 once it is gone)."""
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return 0.0


def descendants(pid: int) -> list[int]:
    """The processes below `pid` (children, theirs, ...)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            kids = [int(x) for x in Path(f"/proc/{p}/task/{p}/children").read_text().split()]
        except FileNotFoundError:
            kids = []
        out += kids
        todo += kids
    return out


def cpu_split(exclude: int | None = None) -> tuple[float, float]:
    """CPU seconds used so far by this process and by all its descendants but `exclude` (a bench's
    engine core and its workers, say, without the process that drives it)."""
    return time.process_time(), sum(cpu_s(p) for p in descendants(os.getpid()) if p != exclude)


class GcClock:
    """Seconds this process has spent in full (generation 2) garbage collections since it was made
    (`total`); `close()` stops counting."""

    def __init__(self):
        self.total, self._t0 = 0.0, None
        gc.callbacks.append(self._event)

    def _event(self, phase: str, info: dict) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            self.total += time.perf_counter() - self._t0
            self._t0 = None

    def close(self) -> None:
        if self._event in gc.callbacks:
            gc.callbacks.remove(self._event)


def run_loop(coro):
    """Run `coro` on the loop a role runs on (laminar/shell.py): uvloop when it is installed."""
    try:
        import uvloop  # late: optional, as in the roles
        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


def exit_on_signals() -> None:
    """SIGTERM and SIGHUP raise SystemExit (128 + signal) in the main thread, once: a second one
    while the bench cleans up is ignored (Ctrl-C still interrupts)."""
    def handler(sig, frame):
        for s in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(s, signal.SIG_IGN)
        raise SystemExit(128 + sig)
    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, handler)


def run_child(argv: list[str], timeout: float, stop_s: float = 60.0, **kw) -> int:
    """Run `argv` to its end; its exit code. If it overruns `timeout` (TimeoutExpired) or this
    program is interrupted, it gets SIGINT (an orderly stop), then SIGKILL after `stop_s`."""
    proc = subprocess.Popen(argv, **kw)
    try:
        return proc.wait(timeout)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(stop_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
