"""The sim engines' clocks: simulated seconds, compressed against real time or virtual.

`CompressedClock(speedup)` sleeps seconds ÷ speedup of real time: an engine that keeps its own
simulated timeline and sleeps until it absorbs its Python overhead instead of accumulating it,
and how far it fell behind shows as lag (SimEngine's `max_lag_s`) when the machine cannot keep up.
`VirtualClock` advances instantly: only correct with one sleeper per clock (tests, single-engine
studies).
"""
from __future__ import annotations

import asyncio
import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float: ...                    # simulated seconds
    async def sleep(self, seconds: float) -> None: ...  # simulated seconds


class CompressedClock:
    """Simulated time = real time × speedup."""

    def __init__(self, speedup: float = 1.0):
        if speedup <= 0:
            raise ValueError(f"speedup must be > 0, got {speedup}")
        self.speedup, self._t0 = speedup, time.monotonic()

    def now(self) -> float:
        return (time.monotonic() - self._t0) * self.speedup

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds) / self.speedup)  # the simulated step itself


class VirtualClock:
    """Time moves only when its (single) sleeper sleeps; other tasks get one turn per sleep."""

    def __init__(self):
        self.t = 0.0

    def now(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        self.t += max(0.0, seconds)
        await asyncio.sleep(0)  # let consumers run between steps


